"""Megatron sequence parallelism (summasim.transformer.megatron, ``sequence_parallel=True``;
Korthikanti et al. 2022, section 4.2.2) against the serial model, against the 1D scheme
without it, and against its closed forms.

Written for the communicator it gets (P = COMM_WORLD size). Each test runs on three
kinds of 1D group: the whole communicator ("world", t = P), sub-groups of two
("pairs", t = 2: the tensor groups of a ``Mesh`` dp = P/2, when P is even and above 2)
and a group of one ("self", t = 1: the same code, nothing sent). A group that does not
exist at this P, or whose t does not divide the sequence, skips on every rank alike with
the reason. The model has ``2P`` heads of size 2, vocabulary ``4P``, two layers,
``b = 2`` and ``T = 2P`` tokens (``seq = T + 1``: ``wpe`` has a row no token reaches);
every bias and LayerNorm parameter is moved off its init value. Every rank builds the
same parameters and data from fixed seeds and runs the serial model itself; every
verdict is collective.

Error of a tensor: ``max|par - ref| / max|ref|``. Tolerances are derived, not fitted:
against the float64 serial model (run on the float32 run's rounded parameters when the
run is float32) the bound is :func:`summasim.validate.training_tolerance` (a chain of
``2 (6 L + 1)`` contractions of length at most ``K = max(b s, f h, v, s, h)``, each
adding ``8 sqrt(K) (u + u_64)``); between two parallel runs that differ only in the
order of their sums (the pieces with and without sequence parallelism) it is the same
bound for one layer (``L = 1``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from contextlib import contextmanager
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

from _util import WORLD, collective_raises, held_items, make_params, rel_err, parallel_assert, skip_unless
from summasim.costmodel.workload.table1 import table1_paper
from summasim.grid import Grid1D, Mesh
from summasim.transformer import megatron, model
from summasim.validate import training_tolerance

P = WORLD.Get_size()
HEADS, HEAD_SIZE = 2 * P, 2
B, S = 2, 2 * P
GROUPS = ["world", "pairs", "self"]


@contextmanager
def sp_group(name, backend=None):
    """The 1D group ``name`` this rank belongs to; skips (on every rank) where it does
    not exist at this P or its size does not divide the sequence."""
    if name == "pairs":
        skip_unless(P % 2 == 0 and P > 2, f"no sub-groups of two on {P} ranks "
                                          f"(needs an even P above 2)")
        skip_unless(S % 2 == 0, f"T = {S} is not divisible by t = 2")
        with Mesh(WORLD, dp=P // 2, pp=1, kind="1d", t=2, backend=backend) as mesh:
            yield mesh.tensor
        return
    comm = WORLD if name == "world" else MPI.COMM_SELF
    skip_unless(S % comm.Get_size() == 0,
                f"T = {S} is not divisible by t = {comm.Get_size()}")
    with Grid1D(comm, backend=backend) as grid:
        yield grid


def make_config(dtype=np.float64, n_classes=0, layers=2) -> model.Config:
    return model.Config(vocab=4 * P, seq=S + 1, hidden=HEAD_SIZE * HEADS, heads=HEADS,
                        layers=layers, dtype=dtype, n_classes=n_classes)


def make_data(cfg: model.Config, seed: int = 3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(B, S))
    targets = (rng.integers(0, cfg.n_classes, size=(B,)) if cfg.n_classes
               else rng.integers(0, cfg.vocab, size=(B, S)))
    return tokens, targets



def slice_of(x, grid):
    """This rank's positions ``[r T/t, (r+1) T/t)`` of a (B, T, ...) array, contiguous."""
    c = x.shape[1] // grid.p
    return np.ascontiguousarray(x[:, grid.rank * c:(grid.rank + 1) * c])


def serial_reference(params, tokens, targets, cfg):
    """Loss, logits and grads of the float64 serial model on ``params`` (as rounded)."""
    cfg64 = dataclasses.replace(cfg, dtype=np.float64)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    loss, cache = model.forward(p64, tokens, targets, cfg64)
    return loss, cache.logits, model.backward(cache)


def group_digests_differ(arrays: dict, grid) -> list[str]:
    """Names whose bytes differ from the group's rank 0 (replicas must be identical)."""
    mine = {k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for k, a in arrays.items()}
    ref = grid.comm.mpi.bcast(mine, root=0)
    return [k for k in arrays if mine[k] != ref.get(k)]


# --------------------------------------------------------------------------- #
# the two ring halves                                                          #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", GROUPS)
def test_ring_halves_in_closed_form(name):
    """``seq_allgather`` of slices filled with their positions gives every position,
    chunk k holding rank (k - 1) mod t's slice (ring order), or in sequence order with
    ``ordered``; ``seq_reduce_scatter`` of ``rank + 1`` everywhere leaves
    ``t (t + 1) / 2`` in this rank's (B, T/t, h) slice; each half is ``t - 1`` traced
    sendrecvs of ``B T h / t`` items, none on a group of one."""
    b, h = 2, 3
    with sp_group(name) as grid:
        t, r = grid.p, grid.rank
        c = S // t
        pos = np.arange(S, dtype=np.float64)
        full = np.broadcast_to(pos[None, :, None], (b, S, h)) * 1.0   # (B, T, h) positions
        grid.trace.clear()
        ring = megatron.seq_allgather(slice_of(full, grid), grid)           # (T, B, h)
        ordered = megatron.seq_allgather(slice_of(full, grid), grid, ordered=True)
        want_ring = np.roll(pos, c)                      # chunk k = slice (k - 1) mod t
        ok = (ring.shape == (S, b, h) and ordered.shape == (S, b, h)
              and np.array_equal(ring[:, 0, 0], want_ring)
              and np.array_equal(ordered, full.transpose(1, 0, 2)))
        buf = np.full((S, b, h), r + 1.0)
        mine = megatron.seq_reduce_scatter(buf, grid)
        ok &= mine.shape == (b, c, h) and np.array_equal(mine, np.full((b, c, h),
                                                                       t * (t + 1) / 2))
        ev = grid.trace.events
        want = [("sendrecv", b * c * h * 8)] * (3 * (t - 1))
        ok &= [(e.op, e.nbytes) for e in ev] == want
        parallel_assert(ok, f"{name} t={t} rank {r}: ring {ring[:, 0, 0]}, slice "
                            f"{mine[0, :, 0]}, events {[(e.op, e.nbytes) for e in ev][:4]}")


# --------------------------------------------------------------------------- #
# agreement with the serial model                                              #
# --------------------------------------------------------------------------- #
def run_sp(params, tokens, targets, cfg, grid, checkpoint, backend=None):
    """shard, forward and backward with sequence parallelism, on ``backend``'s arrays;
    returns host copies of (local grads, unsharded grads, logits) and the loss."""
    be = backend
    if be is not None:
        params = {k: be.asarray(v) for k, v in params.items()}
        tokens, targets = be.asarray(tokens), be.asarray(targets)
    host = (lambda a: be.to_numpy(a)) if be is not None else (lambda a: a)
    local = megatron.shard(params, cfg, grid)
    loss, cache = megatron.forward(local, tokens, targets, cfg, grid, checkpoint=checkpoint,
                                   sequence_parallel=True)
    lgrads = megatron.backward(cache)
    grads = {k: host(v) for k, v in megatron.unshard(lgrads, cfg, grid).items()}
    logits = host(megatron.logits(cache, cfg, grid))
    return loss, {k: host(v) for k, v in lgrads.items()}, grads, logits, cache


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", GROUPS)
def test_agrees_with_serial(name, dtype, checkpoint, backend):
    cfg = make_config(dtype)
    tol = training_tolerance(cfg, B, dtype)
    params = make_params(cfg, seed=0)
    tokens, targets = make_data(cfg)
    ref_loss, ref_logits, ref_grads = serial_reference(params, tokens, targets, cfg)
    with sp_group(name, backend) as grid:
        loss, lgrads, grads, logits, cache = run_sp(params, tokens, targets, cfg, grid,
                                                    checkpoint, backend)
        kinds = megatron.param_layout(cfg)
        replicas = group_digests_differ({k: lgrads[k] for k, kind in kinds.items()
                                         if kind == "replicated"}, grid)
        t = grid.p
        kept = all(tuple(x.shape) == (B, S // t, cfg.hidden) for x in cache.blocks) \
            if checkpoint else True
    errs = {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_logits)}
    errs.update({k: rel_err(grads[k], ref_grads[k]) for k in ref_grads})
    shapes_ok = (list(grads) == list(params) and logits.shape == (B, S, cfg.vocab)
                 and all(grads[k].shape == params[k].shape and grads[k].dtype == cfg.dtype
                         for k in params))
    worst = max(errs, key=errs.get)
    print(f"\nsequence parallel {name} t={t} {np.dtype(dtype).name} checkpoint={checkpoint}: "
          f"worst relative error {errs[worst]:.2e} ({worst}), derived tolerance {tol:.2e}")
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= tol}
    parallel_assert(shapes_ok, "unsharded grads/logits lack the serial keys, shapes, dtype")
    parallel_assert(kept, "checkpointing kept more than the (B, T/t, h) layer inputs")
    parallel_assert(not replicas, f"replicated gradients differ inside the group: {replicas}")
    parallel_assert(not bad, f"{name} {np.dtype(dtype).name} checkpoint={checkpoint}: "
                             f"relative error above {tol:.2e} in {bad}")


@pytest.mark.parametrize("name", GROUPS)
def test_classifier_agrees_with_serial(name):
    cfg = make_config(np.float64, n_classes=3)
    tol = training_tolerance(cfg, B, np.float64)
    params = make_params(cfg, seed=5)
    tokens, targets = make_data(cfg)
    ref_loss, ref_logits, ref_grads = serial_reference(params, tokens, targets, cfg)
    with sp_group(name) as grid:
        loss, _, grads, logits, _ = run_sp(params, tokens, targets, cfg, grid, False)
    errs = {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_logits)}
    errs.update({k: rel_err(grads[k], ref_grads[k]) for k in ref_grads})
    worst = max(errs, key=errs.get)
    print(f"\nsequence parallel classifier {name}: worst relative error {errs[worst]:.2e} "
          f"({worst}), derived tolerance {tol:.2e}")
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= tol}
    parallel_assert(not bad and list(grads) == list(params), f"classifier {name}: {bad}")


# --------------------------------------------------------------------------- #
# the pieces, with and without sequence parallelism                           #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", GROUPS)
def test_pieces_match_the_plain_pieces_on_the_slices(name):
    """Embedding, layer 0 and head, forward and backward: the sequence-parallel piece
    on this rank's slice gives this rank's slice of the plain piece's output and input
    gradient (fed the same upstream gradient's slice), the same loss and logits, and the
    same parameter gradients once :func:`allreduce_sequence_parallel_grads` has summed
    the partial ones (which, before it, differ from the plain ones where t > 1)."""
    cfg = make_config(np.float64)
    tol = training_tolerance(dataclasses.replace(cfg, layers=1), B, np.float64)
    params = make_params(cfg, seed=1)
    tokens, targets = make_data(cfg, seed=4)
    errs, problems = {}, []
    with sp_group(name) as grid:
        t = grid.p
        local = megatron.shard(params, cfg, grid)
        lp = model.layer_params(local, 0)
        x, emb = megatron.embed_forward(local, tokens, cfg, grid)                 # (B, T, h)
        xs, embs = megatron.embed_forward(local, tokens, cfg, grid, sequence_parallel=True)
        y, lc = megatron.layer_forward(x, lp, 0, cfg, grid)
        ys, lcs = megatron.layer_forward(slice_of(x, grid), lp, 0, cfg, grid,
                                         sequence_parallel=True)
        loss, hc = megatron.head_forward(y, local, targets, cfg, grid)
        loss_s, hcs = megatron.head_forward(slice_of(y, grid), local, targets, cfg, grid,
                                            sequence_parallel=True)
        dy, gh = megatron.head_backward(hc)
        dys, ghs = megatron.head_backward(hcs)
        dx, gl = megatron.layer_backward(dy, lc)
        dxs, gls = megatron.layer_backward(slice_of(dy, grid), lcs)
        ge = megatron.embed_backward(dx, emb)
        ges = megatron.embed_backward(slice_of(dx, grid), embs)
        partial = {f"h0.{k}": v.copy() for k, v in gls.items()}
        partial.update({k: v.copy() for k, v in ghs.items()})
        summed = megatron.allreduce_sequence_parallel_grads(partial, cfg, grid)
        sp_keys = megatron.sequence_parallel_keys(cfg, summed)
    errs["embed x"] = rel_err(xs, slice_of(x, grid))
    errs["layer y"] = rel_err(ys, slice_of(y, grid))
    errs["loss"] = rel_err(loss_s, loss)
    errs["logits"] = rel_err(hcs.logits, hc.logits)
    errs["head dx"] = rel_err(dys, slice_of(dy, grid))
    errs["layer dx"] = rel_err(dxs, slice_of(dx, grid))
    for k, v in gh.items():
        errs[f"head {k}"] = rel_err(summed[k], v)
    for k, v in gl.items():
        errs[f"layer {k}"] = rel_err(summed[f"h0.{k}"], v)
    for k, v in ge.items():
        errs[f"embed {k}"] = rel_err(ges[k], v)
    if sp_keys != ["h0.ln1.g", "h0.ln1.b", "h0.attn.proj.b", "h0.ln2.g", "h0.ln2.b",
                   "h0.mlp.proj.b", "lnf.g", "lnf.b"]:
        problems.append(f"sequence_parallel_keys: {sp_keys}")
    if t > 1 and rel_err(gls["ln1.g"], gl["ln1.g"]) <= tol:   # partial before the sum
        problems.append("ln1.g from the slice already equals the whole sequence's")
    shapes = [(xs.shape, ys.shape, dxs.shape, dys.shape)]
    if shapes != [((B, S // t, cfg.hidden),) * 4]:
        problems.append(f"slice shapes {shapes}")
    worst = max(errs, key=errs.get)
    print(f"\npieces {name} t={t}: worst relative error {errs[worst]:.2e} ({worst}), "
          f"derived tolerance {tol:.2e}")
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= tol}
    parallel_assert(not bad and not problems, f"{name}: {bad} {problems}")


# --------------------------------------------------------------------------- #
# traffic                                                                      #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("checkpoint,n_classes", [(False, 0), (True, 0), (False, 3)],
                         ids=["lm", "lm-checkpoint", "cls"])
@pytest.mark.parametrize("name", GROUPS)
def test_traffic_matches_the_closed_form(name, checkpoint, n_classes):
    """Every event of a forward and backward, per (phase, op, bytes), equals
    ``megatron.traffic`` with and without sequence parallelism; per layer the ring
    halves move exactly Table 1's ``4 (t-1)/t b s h`` items forward (backward the same
    without checkpointing, twice with it), the bytes of the all-reduces they replace.
    One layer: the ledger of each layer is the same (the closed form is per layer)."""
    cfg = make_config(np.float64, n_classes=n_classes, layers=1)
    params = make_params(cfg, seed=0)
    tokens, targets = make_data(cfg)
    item = cfg.dtype.itemsize
    problems = []
    with sp_group(name) as grid:
        t = grid.p
        local = megatron.shard(params, cfg, grid)
        ledgers = {}
        for sp in (False, True):
            grid.trace.clear()
            _, cache = megatron.forward(local, tokens, targets, cfg, grid,
                                        checkpoint=checkpoint, sequence_parallel=sp)
            megatron.backward(cache)
            ledgers[sp] = list(grid.trace.events)
    for sp, events in ledgers.items():
        got = Counter((e.phase, e.op, e.nbytes) for e in events)
        want = megatron.traffic(cfg, t, B, S, checkpoint=checkpoint, sequence_parallel=sp)
        if got != want:
            problems.append(f"sp={sp}: extra {dict(got - want)}, missing {dict(want - got)}")
        if any(e.group_size != t for e in events):
            problems.append(f"sp={sp}: an event outside the group of {t}")
    paper = table1_paper("megatron", B, S, cfg.hidden, t)
    for l in range(cfg.layers):
        for pas, table in (("fwd", paper["forward communication"]),
                           ("bwd", paper["backward communication"]
                            * (1 if checkpoint else Fraction(1, 2)))):
            tp = [e for e in ledgers[True] if e.phase.startswith(f"h{l}.{pas}/tp.")]
            moved = sum(e.nbytes for e in tp) // item
            if any(e.op != "sendrecv" for e in tp) or moved != table:
                problems.append(f"h{l}.{pas}: {moved} items in {Counter(e.op for e in tp)}, "
                                f"Table 1 says {table}")
    if t == 1 and any(ledgers.values()):
        problems.append(f"a group of one communicated: {ledgers[True][:3]}")
    parallel_assert(not problems, f"{name} t={t}: " + "; ".join(problems[:4]))


# --------------------------------------------------------------------------- #
# the activation between the pieces and what a layer keeps                    #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", GROUPS)
def test_activation_shape_and_items_match_the_pieces(name):
    cfg = make_config(np.float64)
    params = make_params(cfg, seed=2)
    tokens, _ = make_data(cfg)
    problems = []
    with sp_group(name) as grid:
        t = grid.p
        local = megatron.shard(params, cfg, grid)
        lp = model.layer_params(local, 0)
        for sp in (False, True):
            x, _ = megatron.embed_forward(local, tokens, cfg, grid, sequence_parallel=sp)
            want = megatron.activation_shape(cfg, t, B, S, sp)
            if tuple(x.shape) != want:
                problems.append(f"sp={sp}: embedding gives {x.shape}, activation_shape {want}")
            for ckpt in (False, True):
                y, lc = megatron.layer_forward(x, lp, 0, cfg, grid, checkpoint=ckpt,
                                               sequence_parallel=sp)
                held = held_items(lc.block, list(lp.values()))
                items = megatron.activation_items(cfg, t, B, S, sequence_parallel=sp,
                                                  checkpoint=ckpt)
                if tuple(y.shape) != want or held != items:
                    problems.append(f"sp={sp} checkpoint={ckpt}: output {y.shape}, cache "
                                    f"holds {held} items, activation_items says {items}")
    parallel_assert(not problems, f"{name} t={t}: " + "; ".join(problems))


# --------------------------------------------------------------------------- #
# bad input                                                                    #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["world", "pairs"])
def test_indivisible_sequence_raises_everywhere_before_communicating(name):
    cfg = make_config(np.float64)
    params = make_params(cfg, seed=0)
    with sp_group(name) as grid:
        t = grid.p
        skip_unless(t > 1, "every sequence divides a group of one")
        tokens = np.random.default_rng(0).integers(0, cfg.vocab, size=(B, t + 1))
        local = megatron.shard(params, cfg, grid)
        grid.trace.clear()
        for fn, args, kwargs in (
                (megatron.check, (cfg, grid), dict(seq=t + 1, sequence_parallel=True)),
                (megatron.forward, (local, tokens, tokens, cfg, grid),
                 dict(sequence_parallel=True)),
                (megatron.embed_forward, (local, tokens, cfg, grid),
                 dict(sequence_parallel=True)),
                (megatron.activation_shape, (cfg, t, B, t + 1, True), {}),
                (megatron.traffic, (cfg, t, B, t + 1), dict(sequence_parallel=True))):
            msg = collective_raises(ValueError, fn, *args, **kwargs)
            parallel_assert(f"T = {t + 1}" in msg and f"p = {t}" in msg,
                            f"{fn.__name__}: message {msg!r} does not name T and p")
        megatron.check(cfg, grid, seq=t + 1)          # fine without sequence parallelism
        parallel_assert(len(grid.trace.events) == 0,
                        f"a failed call communicated: {grid.trace.events[:3]}")
