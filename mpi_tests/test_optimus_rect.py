"""Optimus and SUMMA2.5-LM on rectangular ``[pr, pc, d]`` grids and on sizes that the
grid does not divide (:mod:`summasim.transformer.optimus`), against the serial model.

The grids are every rectangular factorization ``d * pr * pc = P`` (pr != pc; the
square ones are the other suites'), at most six of them; P = 1 has none and skips with
that reason. Nothing need divide: the heads over pc (each column holds whole heads, the
balanced partition of the key/value heads), the hidden size over pr, the MLP width over
pr and pc, and the vocabulary (padded to a multiple of lcm(pr, pc)). Agreement: ``max|par - ser| / max|ser|`` within
FLOAT64_TOL (measured ~1e-15) for the loss, the logits and every gradient; the traffic
of every layer's ``tp.*`` phases is :func:`optimus.layer_payload` on every rank.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _util import (WORLD, collective_raises, make_params, parallel_assert, scheme_batch,
                   scheme_run, serial_errors, serial_run, skip_unless, worst_error)
from summasim.grid import Grid
from summasim.spec import grid_shapes
from summasim.transformer import model, optimus

P = WORLD.Get_size()
FLOAT64_TOL = 1e-10
S = 4                     # tokens per sequence given; seq = 5


def _rect_grids():
    out = [(pr, pc, P // (pr * pc)) for pr in range(1, P + 1) for pc in range(1, P + 1)
           if pr != pc and P % (pr * pc) == 0]
    # the most square first (the ones a user gets), then the thin ones
    out.sort(key=lambda g: (max(g[0], g[1]) / min(g[0], g[1]), g[2]))
    return out[:6]


GRIDS = _rect_grids()
IDS = [f"{pr}x{pc}x{d}" for pr, pc, d in GRIDS]


def needs_grids():
    skip_unless(bool(GRIDS), f"p = {P} has no rectangular pr x pc x d grid")


def config(pr, pc, *, heads=None, head=2, ffn_extra=1, vocab=None, layers=2, **kw):
    """Heads 2 pc of size ``head`` (h = 2 pc head: over pr it need not divide), an MLP
    width of 4h + ``ffn_extra`` (divides neither pr nor pc), and a vocabulary of
    3 lcm(pr, pc) + 1 (padded) unless given."""
    heads = 2 * pc if heads is None else heads
    h = heads * head
    return model.Config(vocab=3 * math.lcm(pr, pc) + 1 if vocab is None else vocab,
                        seq=S + 1, hidden=h, heads=heads, layers=layers,
                        ffn_mult=(4 * h + ffn_extra) / h, dtype=np.float64, **kw)


run = functools.partial(scheme_run, optimus)           # (grid, cfg, params, tokens, targets)
batch, serial, errors, worst = scheme_batch, serial_run, serial_errors, worst_error


VARIANTS = {
    "gpt2": {},
    "untied": {"tied": False},
    "swiglu-gqa": {"mlp": "swiglu", "kv_heads": "pc"},
    "classifier": {"n_classes": 3},
    "h-odd": {"head": 3, "ffn_extra": 3},      # h = 6 pc: odd over an even pr
    "heads-uneven": {"heads": "pc+1", "head": 3},   # pc + 1 heads: column 0 holds two
    "gqa-uneven": {"heads": "2pc+2", "kv_heads": "pc+1"},
}


def variant(pr, pc, name):
    kw = dict(VARIANTS[name])
    counts = {"pc": pc, "pc+1": pc + 1, "2pc+2": 2 * pc + 2}
    for key in ("heads", "kv_heads"):
        if isinstance(kw.get(key), str):
            kw[key] = counts[kw[key]]
    return config(pr, pc, **kw)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("pr,pc,d", GRIDS, ids=IDS)
def test_matches_serial(pr, pc, d, name):
    """Loss, logits and every gradient within 1e-10 of the serial model for each block
    variant on each rectangular grid, plain and with the full recompute (bitwise the
    same gradients); the loss is the same float on every rank; the parameters come
    back whole from their shards."""
    cfg = variant(pr, pc, name)
    params = make_params(cfg)
    tokens, targets = batch(cfg, 2 * d * pr)
    ref = serial(cfg, params, tokens, targets)
    with Grid(WORLD, pr, d, pc=pc) as grid:
        runs = [run(grid, cfg, params, tokens, targets, recompute=mode)
                for mode in ("none", "full")]
        back = optimus.unshard(runs[0]["local"], cfg, grid)
    for mode, got in zip(("none", "full"), runs):
        errs = errors(got, ref)
        parallel_assert(max(errs.values()) <= FLOAT64_TOL, f"{name} {mode}: {worst(errs)}")
        parallel_assert(len(set(WORLD.allgather(got["loss"]))) == 1, "loss differs by rank")
    same = all(np.array_equal(runs[1]["lgrads"][k], runs[0]["lgrads"][k])
               for k in runs[0]["lgrads"])
    parallel_assert(same, f"{name}: the recomputed gradients are not bitwise the plain run's")
    parallel_assert(all(np.array_equal(back[k], params[k]) for k in params),
                    "unshard(shard(params)) is not params")


SQUARE = [(q, q, d) for q, d in grid_shapes(P) if q > 1][:2]


@pytest.mark.parametrize("name", ["h-odd", "heads-uneven", "gqa-uneven"])
@pytest.mark.parametrize("pr,pc,d", SQUARE, ids=[f"{q}x{q}x{d}" for q, _, d in SQUARE])
def test_square_grids_take_sizes_that_do_not_divide(pr, pc, d, name):
    """On the square grids too (Optimus, SUMMA2.5-LM), heads, key/value heads, hidden,
    MLP width and vocabulary that q does not divide match the serial model."""
    cfg = variant(pr, pc, name)
    params = make_params(cfg)
    tokens, targets = batch(cfg, 2 * d * pr)
    ref = serial(cfg, params, tokens, targets)
    with Grid(WORLD, pr, d) as grid:
        errs = errors(run(grid, cfg, params, tokens, targets), ref)
    parallel_assert(max(errs.values()) <= FLOAT64_TOL, f"{name} [{pr},{pc},{d}]: {worst(errs)}")


@settings(max_examples=int(os.environ.get("SUMMASIM_MPI_EXAMPLES", "4")), deadline=None)
@given(g=st.integers(0, 5), more_heads=st.integers(0, 5), head=st.integers(1, 3),
       ffn_extra=st.integers(-1, 3), vocab=st.integers(1, 23), s=st.integers(1, 5),
       b_mult=st.integers(1, 2))
def test_matches_serial_drawn(g, more_heads, head, ffn_extra, vocab, s, b_mult):
    """Hypothesis-drawn shapes on a drawn rectangular grid (derandomized: every rank
    draws the same): pc to pc + 5 heads."""
    needs_grids()
    pr, pc, d = GRIDS[g % len(GRIDS)]
    cfg = config(pr, pc, heads=pc + more_heads, head=head, ffn_extra=ffn_extra,
                 vocab=vocab, layers=1)
    params = make_params(cfg, seed=s)
    tokens, targets = batch(cfg, b_mult * d * pr, s, seed=s)
    ref = serial(cfg, params, tokens, targets)
    with Grid(WORLD, pr, d, pc=pc) as grid:
        errs = errors(run(grid, cfg, params, tokens, targets), ref)
    parallel_assert(max(errs.values()) <= FLOAT64_TOL, f"[{pr},{pc},{d}] {cfg}: {worst(errs)}")


@pytest.mark.parametrize("pr,pc,d", GRIDS, ids=IDS)
def test_layer_traffic_is_the_closed_form(pr, pc, d):
    """Every layer's tp.* items are optimus.layer_payload(..., pc, j) on every rank
    (forward, backward, backward with the recomputed forward): b s K / (d pr) along the
    row and K K'_j down the column per product; column 0 holds the widest MLP block."""
    cfg = variant(pr, pc, "gqa-uneven")
    params = make_params(cfg)
    b = 2 * d * pr
    tokens, targets = batch(cfg, b)
    bad = []
    with Grid(WORLD, pr, d, pc=pc) as grid:
        want = optimus.layer_payload(cfg, b, pr, d, seq=S, pc=pc, j=grid.j)
        for ck in (False, True):
            got = run(grid, cfg, params, tokens, targets, checkpoint=ck)
            for l in range(cfg.layers):
                for way in ("fwd", "bwd"):
                    items = sum(e.nbytes for e in got["events"]
                                if e.phase.startswith(f"h{l}.{way}/tp.")
                                and e.op in ("bcast", "reduce")) // 8
                    key = "bwd_checkpoint" if (ck and way == "bwd") else way
                    if items != want[key]:
                        bad.append(f"h{l}.{way} ck={ck}: {items} != {want[key]}")
    parallel_assert(not bad, f"rank {WORLD.Get_rank()}: {bad[:3]}")
    parallel_assert(want["fwd"] > 0 and want["bwd"] == 2 * want["fwd"], str(want))
    top = optimus.layer_payload(cfg, b, pr, d, seq=S, pc=pc, j=0)["fwd"]
    parallel_assert(all(top >= optimus.layer_payload(cfg, b, pr, d, seq=S, pc=pc, j=j)["fwd"]
                        for j in range(pc)), "column 0 is not the busiest")


@pytest.mark.parametrize("pr,pc,d", GRIDS, ids=IDS)
def test_each_weight_is_held_once_per_layer(pr, pc, d):
    """Over the pr x pc ranks of a layer, every weight's blocks add up to its serial
    size (the vocabulary padded to a multiple of lcm(pr, pc)): nothing is held twice
    inside a layer; the row-0 vectors add up to theirs over row 0."""
    cfg = variant(pr, pc, "h-odd")
    params = make_params(cfg)
    with Grid(WORLD, pr, d, pc=pc) as grid:
        local = optimus.shard(params, cfg, grid)
        mine = {k: v.size for k, v in local.items()}
        sizes = {k: sum(r[k] for r in grid.layer.mpi.allgather(mine)) for k in mine}
    vp = optimus.padded_vocab(cfg.vocab, pr, pc)
    bad = []
    for name, arr in params.items():
        want = arr.size
        if name == "wte":
            want = vp * cfg.hidden
        elif name == "head.w":
            want = cfg.hidden * vp
        if sizes[name] != want:
            bad.append(f"{name}: {sizes[name]} != {want}")
    parallel_assert(not bad, f"{bad[:3]}")
    parallel_assert(vp % pr == 0 and vp % pc == 0 and vp - cfg.vocab < math.lcm(pr, pc),
                    f"padded vocabulary {vp}")


def test_fewer_heads_than_columns_are_refused_on_every_rank():
    """A column holds at least one whole key/value head: fewer than pc raises the same
    ValueError on every rank, naming them and pc, before anything is sent; a batch that
    d pr does not cut into whole sequences likewise."""
    needs_grids()
    pr, pc, d = next((g for g in GRIDS if g[1] > 1), GRIDS[0])
    skip_unless(pc > 1, "every rectangular grid here has one column")
    cfg = config(pr, pc, heads=2 * (pc - 1), kv_heads=pc - 1)     # one kv head short
    params = make_params(cfg)
    with Grid(WORLD, pr, d, pc=pc) as grid:
        msg = collective_raises(ValueError, lambda: optimus.shard(params, cfg, grid))
        parallel_assert("kv heads = Config.kv_heads" in msg and f"pc = {pc}" in msg
                        and "smaller than" in msg, msg)
        good = config(pr, pc)
        local = optimus.shard(make_params(good), good, grid)
        if d * pr > 1:
            bad_tokens, bad_targets = batch(good, d * pr + 1)
            msg = collective_raises(ValueError, lambda: optimus.forward(
                local, bad_tokens, bad_targets, good, grid))
            parallel_assert("batch b" in msg, msg)
        parallel_assert(len(grid.trace.events) == 0, "a refused call sent something")
