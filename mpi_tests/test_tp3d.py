"""The 3D tensor-parallel layer (:mod:`summasim.transformer.tp3d`) against the serial
model, on the q x q x q cube of the communicator (p = 1 and 8 in the suites; skipped,
with the reason, where p is not a cube).

Agreement measure, per tensor (loss and logits included): ``max|par - ser| / max|ser|``
against the float64 serial model, within FLOAT64_TOL (measured ~1e-15). The traffic of
every layer's ``tp.*`` phases is the closed form :func:`tp3d.layer_payload` on every
rank, message for message in its ops and groups.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _util import (WORLD, collective_raises, make_params, parallel_assert, scheme_batch,
                   scheme_run, serial_errors, serial_run, skip_unless, worst_error)
from summasim.grid import Grid
from summasim.spec import grid_shapes
from summasim.transformer import model, tp3d

P = WORLD.Get_size()
CUBE = grid_shapes(P, "3d")
Q = CUBE[0][0] if CUBE else 0
FLOAT64_TOL = 1e-10
S = 4                     # tokens per sequence given; seq = 5


def needs_cube():
    skip_unless(bool(CUBE), f"the 3D layer needs p = q^3 ranks (p = {P})")


def config(q, *, hidden=None, heads=None, vocab=None, layers=2, ffn_mult=4, **kw):
    """heads = 2q of size 2 (h = 4q) unless given; vocab 3q + 1 (padded) unless given."""
    heads = 2 * q if heads is None else heads
    return model.Config(vocab=3 * q + 1 if vocab is None else vocab, seq=S + 1,
                        hidden=2 * heads if hidden is None else hidden, heads=heads,
                        layers=layers, ffn_mult=ffn_mult, dtype=np.float64, **kw)


run = functools.partial(scheme_run, tp3d)           # (grid, cfg, params, tokens, targets)
batch, serial, errors, worst = scheme_batch, serial_run, serial_errors, worst_error


VARIANTS = {
    "gpt2": {},
    "untied": {"tied": False},
    "swiglu": {"mlp": "swiglu"},
    "gqa": {"kv_heads": None},           # kv heads = q (heads 2q)
    "classifier": {"n_classes": 3},
    # h/q = 5 over q = 2 (and 3 over q = 1): depth pieces of unequal size; vocab 2
    "uneven": {"hidden": "odd", "heads": "q"},
    # q + 1 heads (block 0 holds two) and an MLP width q does not divide
    "heads-uneven": {"heads": "q+1", "ffn": "odd"},
    # grouped-query attention with q + 1 key/value heads of two query heads each
    "gqa-uneven": {"heads": "2q+2", "kv_heads": "q+1", "mlp": "swiglu"},
}


def variant(q, name):
    kw = dict(VARIANTS[name])
    counts = {"q+1": q + 1, "2q+2": 2 * q + 2, None: q}
    if "kv_heads" in kw:
        kw["kv_heads"] = counts[kw["kv_heads"]]
    if kw.get("hidden") == "odd":
        kw.update(hidden=5 * q, heads=q, vocab=2)
    if isinstance(kw.get("heads"), str):
        kw["heads"] = counts[kw["heads"]]
    if kw.pop("ffn", None) == "odd":          # ffn = 4h + 1: divides no q > 1
        return config(q, ffn_mult=(8 * kw["heads"] + 1) / (2 * kw["heads"]), **kw)
    return config(q, **kw)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_serial_in_every_recompute_mode(name):
    """Loss, logits and every gradient within 1e-10 of the serial model for each block
    variant, with recompute none, selective and full and with blockwise attention; the
    gradients of every mode are bitwise those of the plain run, and the loss is the
    same float on every rank."""
    needs_cube()
    q = Q
    cfg = variant(q, name)
    params = make_params(cfg)
    tokens, targets = batch(cfg, 2 * q * q)
    ref = serial(cfg, params, tokens, targets)
    modes = [dict(), dict(recompute="selective"), dict(recompute="full"),
             dict(attention="flash", tile=2)]
    with Grid(WORLD, q, q) as grid:
        runs = [run(grid, cfg, params, tokens, targets, **kw) for kw in modes]
    for kw, got in zip(modes, runs):
        errs = errors(got, ref)
        parallel_assert(max(errs.values()) <= FLOAT64_TOL, f"{name} {kw}: {worst(errs)}")
        parallel_assert(len(set(WORLD.allgather(got["loss"]))) == 1, "loss differs by rank")
    for kw, got in zip(modes[1:3], runs[1:3]):
        same = all(np.array_equal(got["lgrads"][k], runs[0]["lgrads"][k]) for k in got["lgrads"])
        parallel_assert(same, f"{name} {kw}: the gradients are not bitwise the plain run's")


@settings(max_examples=int(os.environ.get("SUMMASIM_MPI_EXAMPLES", "4")), deadline=None)
@given(heads_per_q=st.integers(1, 2), head_size=st.integers(1, 3), vocab=st.integers(1, 20),
       s=st.integers(1, 5), layers=st.integers(1, 2), b_mult=st.integers(1, 2),
       ck=st.booleans())
def test_matches_serial_drawn(heads_per_q, head_size, vocab, s, layers, b_mult, ck):
    """Hypothesis-drawn shapes (derandomized: every rank draws the same)."""
    needs_cube()
    q = Q
    heads = heads_per_q * q
    cfg = config(q, hidden=heads * head_size, heads=heads, vocab=vocab, layers=layers)
    params = make_params(cfg, seed=layers)
    tokens, targets = batch(cfg, b_mult * q * q, s, seed=s)
    ref = serial(cfg, params, tokens, targets)
    with Grid(WORLD, q, q) as grid:
        errs = errors(run(grid, cfg, params, tokens, targets, checkpoint=ck), ref)
    parallel_assert(max(errs.values()) <= FLOAT64_TOL, f"{cfg}: {worst(errs)}")


@pytest.mark.parametrize("name", ["gpt2", "swiglu", "uneven", "heads-uneven", "gqa-uneven"])
def test_layer_traffic_is_the_closed_form(name):
    """Every layer's tp.* items are tp3d.layer_payload of the rank's (i, j) on every rank
    (forward, backward, backward with the recomputed forward), and they are all-gathers
    and reduce-scatters on the row, column and depth groups alone: per linear, two
    all-gathers and one reduce-scatter forward, three and two backward; what arrives on
    the wire is tp3d.layer_words."""
    needs_cube()
    q = Q
    cfg = variant(q, name)
    params = make_params(cfg)
    b = 2 * q * q
    tokens, targets = batch(cfg, b)
    n_lin = len(tp3d.linears(cfg))
    bad = []
    received = 0              # items arriving in layer 0's tp.* collectives (no recompute)
    with Grid(WORLD, q, q) as grid:
        ij = dict(i=grid.i, j=grid.j)
        want = tp3d.layer_payload(cfg, b, q, seq=S, **ij)
        for ck in (False, True):
            got = run(grid, cfg, params, tokens, targets, checkpoint=ck)
            for l in range(cfg.layers):
                for way in ("fwd", "bwd"):
                    evs = [e for e in got["events"] if e.phase.startswith(f"h{l}.{way}/tp.")]
                    items = sum(e.nbytes for e in evs) // 8
                    key = "bwd_checkpoint" if (ck and way == "bwd") else way
                    if items != want[key]:
                        bad.append(f"h{l}.{way} ck={ck}: {items} != {want[key]}")
                    if l == 0 and not ck:   # an all-gather brings q - 1 pieces, a
                        received += sum(    # reduce-scatter (q - 1)/q of its buffer
                            (q - 1) * e.nbytes if e.op == "allgather"
                            else (q - 1) * e.nbytes // q for e in evs) // 8
                    if q > 1 and not ck:
                        ops = sorted(e.op for e in evs)
                        n_ag, n_rs = (2, 1) if way == "fwd" else (3, 2)
                        if ops != ["allgather"] * (n_ag * n_lin) + ["reduce_scatter"] * (
                                n_rs * n_lin) or {e.group for e in evs} - {"row", "col", "depth"}:
                            bad.append(f"h{l}.{way}: ops {ops}")
    if received != tp3d.layer_words(cfg, b, q, seq=S, **ij):
        bad.append(f"received {received} != layer_words "
                   f"{tp3d.layer_words(cfg, b, q, seq=S, **ij)}")
    parallel_assert(not bad, f"{name}: {bad[:3]}")
    if q > 1:   # the closed form is not 0 by accident
        parallel_assert(want["fwd"] > 0 and want["bwd"] > want["fwd"], str(want))


@pytest.mark.parametrize("name", ["uneven", "gqa-uneven"])
def test_each_weight_is_held_once(name):
    """Every weight's and wte's local pieces over the cube add up to the serial size
    (the vocabulary padded): 1/p each, nothing replicated; a layer vector is held by
    the q^2 ranks that share its block (blocks of unequal size included)."""
    needs_cube()
    q = Q
    cfg = variant(q, name)
    params = make_params(cfg)
    with Grid(WORLD, q, q) as grid:
        local = tp3d.shard(params, cfg, grid)
    mine = {k: v.size for k, v in local.items()}
    sizes = {k: sum(r[k] for r in WORLD.allgather(mine)) for k in mine}
    vp = tp3d.vocab_block(cfg.vocab, q) * q
    bad = []
    for name, arr in params.items():
        kind = tp3d.role(name)
        if name in ("wte", "head.w"):          # once, the vocabulary padded
            want = vp * cfg.hidden
        elif kind in ("ab", "ba"):             # once
            want = arr.size
        elif kind == "whole":                  # cls.b on every rank
            want = arr.size * P
        else:                                  # a plane of q^2 ranks shares each block
            want = arr.size * q * q
        if sizes[name] != want:
            bad.append(f"{name}: {sizes[name]} held, {want} expected")
    parallel_assert(not bad, "; ".join(bad[:4]))


def test_bad_input_on_one_rank_raises_on_every_rank():
    """A local parameter of the wrong shape on the last rank only, and a batch the cube
    cannot cut into whole sequences, raise the same ValueError on every rank before any
    data moves."""
    needs_cube()
    q = Q
    cfg = config(q, layers=1)
    params = make_params(cfg)
    tokens, targets = batch(cfg, q * q)
    with Grid(WORLD, q, q) as grid:
        local = tp3d.shard(params, cfg, grid)
        if WORLD.Get_rank() == P - 1:
            local["h0.mlp.fc.w"] = local["h0.mlp.fc.w"][:, :-1].copy()
        grid.trace.clear()
        msg = collective_raises(ValueError, tp3d.forward, local, tokens, targets, cfg, grid)
        moved = len(grid.trace.events)
        parallel_assert("mlp.fc.w" in msg and moved == 0, f"{msg!r}, {moved} events")
        # a block of another dtype, or not an array, on the last rank only
        for bad, words in ((lambda a: a.astype(np.float32), "dtype float32"),
                           (lambda a: a.tolist(), "has shape ()")):
            local = tp3d.shard(params, cfg, grid)
            if WORLD.Get_rank() == P - 1:
                local["h0.attn.qkv.w"] = bad(local["h0.attn.qkv.w"])
            grid.trace.clear()
            msg = collective_raises(ValueError, tp3d.forward, local, tokens, targets, cfg,
                                    grid)
            moved = len(grid.trace.events)
            parallel_assert(words in msg and "qkv.w" in msg and moved == 0,
                            f"{msg!r}, {moved} events")
        if q > 1:
            good = tp3d.shard(params, cfg, grid)
            msg = collective_raises(ValueError, tp3d.forward, good, tokens[:q * q - 1],
                                    targets[:q * q - 1], cfg, grid)
            parallel_assert("q^2" in msg, msg)
            few = config(q, heads=2 * (q - 1), kv_heads=q - 1, layers=1)  # a kv head short
            msg = collective_raises(ValueError, tp3d.shard, make_params(few), few, grid)
            parallel_assert("kv heads" in msg and "smaller than q" in msg, msg)


@pytest.mark.parametrize("zero", [1, 3])
def test_two_replicas_of_the_cube_with_unequal_depth_pieces(zero, backend):
    """dp = 2 replicas of tp=3d:2x2x2 (p = 16), ZeRO 1 and 3, h/q = 5 cut into depth pieces
    of 3 and 2: three Adam steps against the serial model, the traffic and state equal
    their closed forms, and the replica audit (dp, depth, column and row groups) agrees
    although the ranks' flat layouts differ."""
    skip_unless(P == 16, "two replicas of the 2 x 2 x 2 cube need p = 16")
    from _util import run_mesh_case
    from summasim.harness.cases import MeshCase

    cfg = model.Config(vocab=20, seq=8, hidden=10, heads=2, layers=2, dtype=np.float64)
    case = MeshCase.parse("dp=2,tp=3d:2x2x2", 8, cfg, zero=zero, microbatches=1)
    res = run_mesh_case(case, backend)
    r = res.extra["report"]
    # run_mesh_case asserted every check, the replicas' included; these groups ran
    parallel_assert({"tensor", "tensor.col", "tensor.row"} <= set(r.audit),
                    f"audited groups {r.audit}")
