"""The classification head (``Config.n_classes = k > 0``) of Optimus (2D) and SUMMA2.5-LM
(2.5D) against the serial model, on every ``[q, q, d]`` grid of the communicator
(``optimus`` when d = 1, ``summa25`` when d > 1).

Layout under test (:mod:`summasim.transformer.optimus`, module docstring): ``cls.w[H_j, :]``
``[h/q, k]`` on row 0, ``cls.b`` whole on rank (0, 0), zero-size elsewhere; the logits of
each sequence's LAST token are the row sum of the partial products (column 0 adding the
bias), replicated over the row; the loss is the mean over the ``b`` sequences. Any k runs on
any grid: k = 2 (the paper's binary label), 3 and 4 divide q or not.

Agreement measure, per tensor (the loss and the logits included):
``max|par - ser| / max|ser|`` against the float64 serial model, within the derived bound
:func:`summasim.validate.training_tolerance` of the config, batch and dtype (float64
measures ~1e-15 against ~3e-13).
"""

from __future__ import annotations

import numpy as np
import pytest

from _util import (WORLD, collective_raises, grid_shapes, make_params, parallel_assert,
                   rel_err, serial_errors, worst_error)
from test_optimus import run_parallel  # one runner of the scheme for both suites
from summasim.costmodel.workload.traffic import ring_allreduce_events, summarize_events
from summasim.grid import Grid
from summasim.transformer import model, optimus
from summasim.validate import training_tolerance

P = WORLD.Get_size()
GRIDS = grid_shapes(P)
GRID_PARAMS = [pytest.param(q, d, id=f"{'optimus' if d == 1 else 'summa25'}-q{q}d{d}")
               for q, d in GRIDS]
S = 4                       # tokens per sequence; seq = 5, so the last token is not seq - 1
KS = (2, 3, 4)              # classes: binary, one that divides no q > 1, one that divides 2, 4
LOSS_SCALE = 3.0            # not a power of two: the scaled gradients round differently


# --------------------------------------------------------------------------- #
# helpers                                                                     #
# --------------------------------------------------------------------------- #
def make_config(q, k, layers=2, dtype=np.float64):
    """heads = 2q of size 2 (h = 4q), vocab = 3q, GELU f = 4, seq = S + 1, k classes."""
    return model.Config(vocab=3 * q, seq=S + 1, hidden=4 * q, heads=2 * q, layers=layers,
                        ffn_mult=4, dtype=dtype, n_classes=k)


def make_batch(cfg, b, seed=1):
    """tokens [b, S] and classes [b]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab, (b, S)), rng.integers(0, cfg.n_classes, b)


def serial(cfg, params, tokens, targets, loss_scale=1.0):
    loss, cache = model.forward(params, tokens, targets, cfg)
    return loss, cache.logits, model.backward(cache, loss_scale=loss_scale)


def errors(run, ref) -> dict:
    """:func:`_util.serial_errors`, or one infinite error when the gradients' keys are
    not the serial model's (a classifier head lost or misnamed)."""
    if list(run["grads"]) != list(ref[2]):
        return {f"keys {list(run['grads'])[-3:]} != serial {list(ref[2])[-3:]}": np.inf}
    return serial_errors(run, ref)


def same_everywhere(value) -> bool:
    """Whether ``value`` (a float) is bitwise the same on every rank of the world."""
    return len({repr(v) for v in WORLD.allgather(value)}) == 1


# --------------------------------------------------------------------------- #
# agreement with the serial model                                             #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("k", KS, ids=[f"k{k}" for k in KS])
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_classifier_matches_serial(q, d, k, backend):
    """float64, 2 layers, b = 2dq sequences of S = 4 < seq tokens: the loss, the logits
    [b, k] (joined, and this rank's block) and every unshard()ed gradient (embedding,
    layers, lnf, cls.w, cls.b) within training_tolerance, checkpoint off and on; the
    checkpointed local gradients bitwise those without; the same loss on every rank.
    Runs on the suite's --backend (numpy by default; cupy on a GPU)."""
    cfg = make_config(q, k)
    params = make_params(cfg)
    b = 2 * d * q
    tokens, targets = make_batch(cfg, b)
    ref = serial(cfg, params, tokens, targets)
    tol = training_tolerance(cfg, b, np.float64)
    with Grid(WORLD, q, d, backend=backend) as grid:
        runs = {ck: run_parallel(grid, cfg, params, tokens, targets, ck, backend)
                for ck in (False, True)}
        mine = optimus.local_logits(ref[1], cfg, grid)
    report = []
    for ck, run in runs.items():
        errs = errors(run, ref)
        errs["local logits"] = rel_err(run["local_logits"], mine)
        report.append(f"checkpoint={ck} {worst_error(errs)} (cls.w {errs.get('cls.w', np.inf):.2g}, "
                      f"cls.b {errs.get('cls.b', np.inf):.2g}, wte {errs.get('wte', np.inf):.2g})")
        parallel_assert(max(errs.values()) <= tol,
                        f"[{q},{q},{d}] k={k} checkpoint={ck}: {worst_error(errs)} > {tol:.3g}")
        parallel_assert(same_everywhere(run["loss"]),
                        f"[{q},{q},{d}] k={k}: the loss differs across ranks: {run['loss']!r}")
    base, ckpt = runs[False], runs[True]
    differ = [key for key in base["lgrads"]
              if not np.array_equal(base["lgrads"][key], ckpt["lgrads"][key])]
    parallel_assert(not differ and base["loss"] == ckpt["loss"],
                    f"rank {WORLD.rank}: checkpointing changed {differ[:4]} or the loss")
    if WORLD.rank == 0:
        print(f"\n[{q},{q},{d}] k={k}: {'; '.join(report)} (bound {tol:.3g})")


@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_classifier_loss_scale(q, d):
    """The pieces in a row with ``head_backward(loss_scale=3)``: every gradient within
    training_tolerance of ``model.backward(loss_scale=3)``, and the head's local gradients
    are 3x those of loss_scale = 1 (within a few ulps)."""
    k = 3
    cfg = make_config(q, k)
    params = make_params(cfg, seed=2)
    b = 2 * d * q
    tokens, targets = make_batch(cfg, b, seed=3)
    ref = serial(cfg, params, tokens, targets, loss_scale=LOSS_SCALE)
    tol = training_tolerance(cfg, b, np.float64)
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        x, emb = optimus.embed_forward(local, tokens, cfg, grid)
        layers = []
        for l in range(cfg.layers):
            x, c = optimus.layer_forward(x, model.layer_params(local, l), l, cfg, grid)
            layers.append(c)
        loss, head = optimus.head_forward(x, local, targets, cfg, grid)
        _, unscaled = optimus.head_backward(head)
        dx, grads = optimus.head_backward(head, loss_scale=LOSS_SCALE)
        for l in reversed(range(cfg.layers)):
            dx, g = optimus.layer_backward(dx, layers[l])
            grads.update({f"h{l}.{key}": val for key, val in g.items()})
        grads.update(optimus.embed_backward(dx, emb))
        lgrads = {key: grads[key] for key in local}
        full = optimus.unshard(lgrads, cfg, grid)
        logits = optimus.logits(head, cfg, grid)
    errs = errors(dict(loss=loss, logits=logits, grads=full), ref)
    parallel_assert(max(errs.values()) <= tol,
                    f"[{q},{q},{d}] loss_scale={LOSS_SCALE}: {worst_error(errs)} > {tol:.3g}")
    scaled = {key: rel_err(grads[key], LOSS_SCALE * unscaled[key]) for key in unscaled
              if unscaled[key].size}
    parallel_assert(all(e <= 64 * np.finfo(np.float64).eps for e in scaled.values()),
                    f"rank {WORLD.rank}: head grads not {LOSS_SCALE}x: {scaled}")
    if WORLD.rank == 0:
        print(f"\n[{q},{q},{d}] loss_scale={LOSS_SCALE}: {worst_error(errs)} (bound {tol:.3g})")


def test_float32():
    """float32 once, on the grid with the largest q (then d), k = 3: every tensor within
    training_tolerance(float32) of the float64 serial model, and everything float32."""
    q, d = max(GRIDS)
    cfg64, cfg32 = make_config(q, 3), make_config(q, 3, dtype=np.float32)
    params64 = make_params(cfg64)
    params32 = {key: val.astype(np.float32) for key, val in params64.items()}
    b = 2 * d * q
    tokens, targets = make_batch(cfg64, b)
    ref = serial(cfg64, params64, tokens, targets)
    tol = training_tolerance(cfg32, b, np.float32)
    with Grid(WORLD, q, d) as grid:
        run = run_parallel(grid, cfg32, params32, tokens, targets)
    errs = errors(run, ref)
    dtypes = {val.dtype for val in run["lgrads"].values()} | {run["logits"].dtype}
    parallel_assert(max(errs.values()) <= tol and dtypes == {np.dtype(np.float32)},
                    f"[{q},{q},{d}] float32: {worst_error(errs)} > {tol:.3g} or dtypes {dtypes}")
    if WORLD.rank == 0:
        print(f"\nfloat32 [{q},{q},{d}] k=3: {worst_error(errs)} (bound {tol:.3g})")


# --------------------------------------------------------------------------- #
# layout                                                                      #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_classifier_layout(q, d):
    """Rank (i, j, k) holds, written out here without the module's helpers: on row 0 the
    rows j h/q .. (j+1) h/q of cls.w [h, k], elsewhere [0, k]; cls.b [k] on (0, 0) only,
    [0] elsewhere; local_shapes says so; check() accepts k = 3 on any q; and
    unshard(shard(params)) == params, bitwise."""
    cfg = make_config(q, 3, layers=1)
    params = make_params(cfg)
    h, k = cfg.hidden, cfg.n_classes
    with Grid(WORLD, q, d) as grid:
        optimus.check(cfg, grid, d * q)
        local = optimus.shard(params, cfg, grid)
        shapes = optimus.local_shapes(cfg, grid)
        back = optimus.unshard(local, cfg, grid)
        i, j = grid.i, grid.j
    want_w = params["cls.w"][j * h // q:(j + 1) * h // q] if i == 0 else np.empty((0, k))
    want_b = params["cls.b"] if (i, j) == (0, 0) else np.empty((0,))
    wrong = [name for name, want in (("cls.w", want_w), ("cls.b", want_b))
             if local[name].shape != want.shape or not np.array_equal(local[name], want)]
    wrong += [name for name in local if local[name].shape != shapes[name]]
    parallel_assert(not wrong and list(local) == list(model.param_shapes(cfg)),
                    f"rank {grid.coords}: wrong local blocks or shapes {wrong}")
    parallel_assert(list(back) == list(params)
                    and all(np.array_equal(back[key], params[key]) for key in params),
                    "unshard(shard(params)) != params")


# --------------------------------------------------------------------------- #
# traffic                                                                     #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_classifier_traffic(q, d):
    """k = 3, b = 2dq: per rank, the head's messages in clshead.fwd and loss, and in
    clshead.bwd, are optimus.classifier_payload message for message (one message per
    (op, group)), the backward's depth ring is ring_allreduce_events of its length; the
    phases are clshead.* (no lmhead.*, no loss/aux.ce); lnf.* sends what the LM's
    final LayerNorm sends."""
    k = 3
    cfg = make_config(q, k, layers=1)
    lm = model.Config(vocab=cfg.vocab, seq=cfg.seq, hidden=cfg.hidden, heads=cfg.heads,
                      layers=1)
    b = 2 * d * q
    tokens, targets = make_batch(cfg, b)
    with Grid(WORLD, q, d) as grid:
        ev = run_parallel(grid, cfg, make_params(cfg), tokens, targets)["events"]
        lm_ev = run_parallel(grid, lm, make_params(lm), tokens,
                             np.random.default_rng(5).integers(0, lm.vocab, (b, S)))["events"]
        i, j, kk = grid.i, grid.j, grid.k
    want = optimus.classifier_payload(cfg, b, q, d, i=i, j=j)
    ring = want["bwd"].pop(("ring", "depth"), None)

    def items(events):
        out = {}
        for e in events:
            out[(e.op, e.group)] = out.get((e.op, e.group), (0, 0))
            c, n = out[(e.op, e.group)]
            out[(e.op, e.group)] = (c + 1, n + e.nbytes // 8)
        return out

    fwd = items(e for e in ev if e.phase.startswith(("clshead.fwd/", "loss/")))
    bwd_all = [e for e in ev if e.phase.startswith("clshead.bwd/")]
    bwd = items(e for e in bwd_all if e.phase != "clshead.bwd/aux.grads.depth")
    depth = summarize_events(e for e in bwd_all if e.phase == "clshead.bwd/aux.grads.depth")
    ring_want = ({} if ring is None
                 else summarize_events(ring_allreduce_events(ring, d, kk, "depth")))
    parallel_assert(fwd == {key: (1, n) for key, n in want["fwd"].items()}
                    and bwd == {key: (1, n) for key, n in want["bwd"].items()}
                    and depth == ring_want,
                    f"rank {(i, j, kk)}: fwd {fwd} bwd {bwd} depth {depth} != {want}, "
                    f"ring {ring_want}")
    phases = {e.phase for e in ev if not e.phase.startswith(("h0.", "embed.", "lnf."))}
    allowed = {"clshead.fwd/aux.params.bcast", "clshead.fwd/aux.logits", "loss/aux.mean",
               "clshead.bwd/aux.grads.reduce", "clshead.bwd/aux.grads.depth"}
    lnf = [(e.phase, e.op, e.group, e.nbytes) for e in ev if e.phase.startswith("lnf.")]
    lm_lnf = [(e.phase, e.op, e.group, e.nbytes) for e in lm_ev if e.phase.startswith("lnf.")]
    parallel_assert(phases <= allowed and lnf == lm_lnf,
                    f"rank {(i, j, kk)}: phases {sorted(phases - allowed)} or lnf traffic "
                    f"{lnf[:3]} != LM's {lm_lnf[:3]}")
    if q == d == 1:
        parallel_assert(not ev, f"q = d = 1 sent {len(ev)} messages")


# --------------------------------------------------------------------------- #
# bad input                                                                   #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_classifier_bad_input(q, d):
    """Classes out of [0, k), targets shaped like tokens, a batch not divisible by dq and
    LM-shaped local params raise ValueError on every rank before any communication;
    backward without targets refuses."""
    cfg = make_config(q, 3, layers=1)
    params = make_params(cfg)
    b = d * q
    tokens, targets = make_batch(cfg, b)
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        lm_cfg = model.Config(vocab=cfg.vocab, seq=cfg.seq, hidden=cfg.hidden,
                              heads=cfg.heads, layers=1)
        lm = optimus.shard(make_params(lm_cfg), lm_cfg, grid)
        grid.trace.clear()
        bad = targets.copy()
        bad[0] = cfg.n_classes
        msg = collective_raises(ValueError, optimus.forward, local, tokens, bad, cfg, grid)
        parallel_assert("n_classes" in msg, f"class out of range: {msg!r}")
        msg = collective_raises(ValueError, optimus.forward, local, tokens, tokens, cfg, grid)
        parallel_assert("classification" in msg, f"LM targets: {msg!r}")
        msg = collective_raises(ValueError, optimus.forward, lm, tokens, targets, cfg, grid)
        parallel_assert("cls.w" in msg, f"LM params: {msg!r}")
        if d * q > 1:
            tok1, tgt1 = make_batch(cfg, d * q + 1)
            msg = collective_raises(ValueError, optimus.forward, local, tok1, tgt1, cfg, grid)
            parallel_assert("batch b" in msg and f"d*q = {d * q}" in msg, f"batch: {msg!r}")
        events = len(grid.trace.events)
        _, cache = optimus.forward(local, tokens, None, cfg, grid)
        grid.trace.clear()
        collective_raises(ValueError, optimus.backward, cache)
        events += len(grid.trace.events)
    parallel_assert(events == 0, f"a failed call communicated ({events} events)")
