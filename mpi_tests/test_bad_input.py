"""Bad input raises a clear error on every rank, before any communication.

Input that is bad on ONE rank only (rank 0 passes a block one row short, a float32
block among float64 ones, a ring vector of another length, a local parameter of the
wrong shape) must raise the same error on every rank too: the agreement of
:func:`summasim.mpiutil.agree`. Without it these calls hang or abort the job.
"""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, collective_raises, grid_shapes, parallel_assert, skip_unless
from summasim import algorithms as algs
from summasim import layout
from summasim.grid import Grid, Grid1D
from summasim.transformer import megatron, model, optimus

P = WORLD.Get_size()
#: the verb of "ranks 1-3 have ..." when the other ranks are one rank ("rank 1 has ...")
OTHERS = "has" if P == 2 else "have"
Q, D = grid_shapes(P)[-1] if grid_shapes(P)[-1][0] > 1 else grid_shapes(P)[0]


def test_wrong_process_count():
    msg = collective_raises(ValueError, Grid, WORLD, P + 1)
    parallel_assert(f"{(P + 1) ** 2}" in msg and f"has {P}" in msg, f"message: {msg!r}")
    msg = collective_raises(ValueError, Grid, WORLD, 1, P + 2)
    parallel_assert(f"{P + 2}" in msg and f"has {P}" in msg, f"message: {msg!r}")


def test_bad_grid_arguments():
    for bad in (0, -2, 1.5, "2"):
        collective_raises(ValueError, Grid, WORLD, bad)


def test_cannon_needs_2d_grid():
    skip_unless(any(d > 1 for _, d in grid_shapes(P)), f"p = {P} has no [q, q, d>1] grid")
    q, d = next((q, d) for q, d in grid_shapes(P) if d > 1)
    with Grid(WORLD, q, d) as g:
        msg = collective_raises(ValueError, algs.cannon_ab, np.ones((2, 2)), np.ones((2, 2)), g)
        parallel_assert("q x q" in msg and f"p = {P}" in msg, f"message: {msg!r}")


def test_non_dividing_shapes():
    """A size that does not divide is cut into the balanced partition (the first
    size mod blocks blocks one larger) by split and put back by join; local_shape, the
    even-blocks question, still names the dimension and the divisor."""
    skip_unless(P > 1, "every size divides a 1-rank grid")
    with Grid(WORLD, Q, D) as g:
        lay = "2.5d" if D > 1 else "2d"
        rows = D * Q if D > 1 else Q
        M = np.arange((rows + 1) * (Q + 1), dtype=float).reshape(rows + 1, Q + 1)
        blk = layout.split(M, g, lay)
        bi, bj = layout.block_index(lay, layout.grid_numbers(g))
        want = (2 if bi == 0 else 1, 2 if bj == 0 else 1)     # rows+1 over rows blocks
        parallel_assert(blk.shape == want, f"block {blk.shape}, want {want}")
        parallel_assert(bool((layout.join(blk, g, lay) == M).all()), "join lost the array")
        msg = collective_raises(ValueError, layout.local_shape, (rows + 1, Q), lay, Q, D)
        parallel_assert(f"rows = {rows + 1}" in msg and f"divisible by {rows}" in msg,
                        f"message: {msg!r}")


@pytest.mark.parametrize("fn", ["summa_ab", "summa_abt", "summa_atb", "cannon_ab",
                                "summa25_ab", "summa25_abt", "summa25_atb"])
def test_mismatched_dtypes_and_shapes(fn):
    skip_unless(not (fn == "cannon_ab" and D > 1), "cannon needs d == 1")
    with Grid(WORLD, Q, D) as g:
        f = getattr(algs, fn)
        a32, b64 = np.ones((4, 4), np.float32), np.ones((4, 4), np.float64)
        msg = collective_raises(TypeError, f, a32, b64, g)
        parallel_assert("float32" in msg and "float64" in msg, f"message: {msg!r}")
        collective_raises(TypeError, f, np.ones((4, 4), np.int64), np.ones((4, 4), np.int64), g)
        collective_raises(ValueError, f, np.ones((4, 4)), np.ones((5, 5)), g)
        collective_raises(ValueError, f, np.ones(4), np.ones((4, 4)), g)
        collective_raises(TypeError, f, np.ones((4, 4)), np.ones((4, 4)), "not a grid")
        g.trace.clear()
    parallel_assert(len(g.trace.events) == 0, "a failed call communicated")


def test_ring_bad_input():
    collective_raises(TypeError, algs.ring_allreduce, [1.0, 2.0], WORLD)
    collective_raises(ValueError, algs.ring_allreduce, np.ones(3), WORLD, out=np.ones(4))


# --------------------------------------------------------------------------- #
# bad on one rank only: every rank raises the same error (the agreement)       #
# --------------------------------------------------------------------------- #
RANK = WORLD.Get_rank()
BLK = 3                     # every block is BLK x BLK unless a test makes rank 0's short


def same_everywhere(msg: str) -> None:
    """Every rank got the same message."""
    msgs = WORLD.allgather(msg)
    parallel_assert(len(set(msgs)) == 1, f"messages differ: {msg!r} vs rank 0's {msgs[0]!r}")


def one_rank_error(exc_type, fn, *args, **kwargs) -> str:
    """``fn`` raises ``exc_type`` on every rank with one message naming rank 0."""
    msg = collective_raises(exc_type, fn, *args, **kwargs)
    same_everywhere(msg)
    parallel_assert("rank 0" in msg, f"message does not name rank 0: {msg!r}")
    return msg


def grid_for(fn: str):
    """A grid the algorithm runs on (d > 1 where one exists, for summa25), or None."""
    shapes = [(q, d) for q, d in grid_shapes(P) if fn != "cannon_ab" or d == 1]
    if fn.startswith("summa25"):
        shapes.sort(key=lambda qd: -qd[1])
    return shapes[0] if shapes else None


@pytest.mark.parametrize("fn", ["summa_ab", "summa25_atb", "cannon_ab"])
def test_one_rank_short_block(fn):
    """Rank 0's A block is one row short: every rank raises the same ValueError."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    skip_unless(grid_for(fn) is not None, f"p = {P} has no grid for {fn}")
    q, d = grid_for(fn)
    with Grid(WORLD, q, d) as g:
        a = np.ones((BLK - 1 if RANK == 0 else BLK, BLK))
        msg = one_rank_error(ValueError, getattr(algs, fn), a, np.ones((BLK, BLK)), g)
        if fn == "summa25_atb":   # rank 0's own check fails: a.shape[0] vs b.shape[0]
            parallel_assert("bad input on rank 0" in msg and "do not conform" in msg
                            and "passed the checks" in msg, f"message: {msg!r}")
        else:                     # it conforms locally; the ranks of its block row differ
            parallel_assert(f"A block's rows (m): rank 0 has {BLK - 1}" in msg
                            and (f"has {BLK}" in msg or f"have {BLK}" in msg),
                            f"message: {msg!r}")
        parallel_assert(len(g.trace.events) == 0, "a failed call communicated")


@pytest.mark.parametrize("fn", ["summa_abt", "summa25_ab", "cannon_ab"])
def test_one_rank_dtype(fn):
    """Rank 0 computes in float32, the others in float64: TypeError everywhere."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    skip_unless(grid_for(fn) is not None, f"p = {P} has no grid for {fn}")
    q, d = grid_for(fn)
    dtype = np.float32 if RANK == 0 else np.float64
    with Grid(WORLD, q, d) as g:
        msg = one_rank_error(TypeError, getattr(algs, fn), np.ones((BLK, BLK), dtype),
                             np.ones((BLK, BLK), dtype), g)
        parallel_assert("dtype: rank 0 has float32" in msg and f"{OTHERS} float64" in msg,
                        f"message: {msg!r}")
        # and one operand alone: rank 0's own check fails, the others pass theirs
        b = np.ones((BLK, BLK), dtype)
        msg = one_rank_error(TypeError, getattr(algs, fn), np.ones((BLK, BLK)), b, g)
        parallel_assert("bad input on rank 0" in msg and "float32" in msg, f"message: {msg!r}")
        parallel_assert(len(g.trace.events) == 0, "a failed call communicated")


@pytest.mark.parametrize("fn", ["summa_ab", "cannon_ab", "sd25_ab"])
@pytest.mark.parametrize("bad", [(5, 7), (5.9, 7, 3), "573", (-5, 7, 3), (5, 7, 3, 1),
                                 (True, 7, 3), None])
def test_malformed_sizes_on_one_rank(fn, bad):
    """``sizes`` that are not three non-negative integers on rank 0 (or missing there
    alone), right on the others: one clear error on every rank, nothing sent. A
    malformed ``sizes`` used to raise on rank 0 alone, before the agreement, and leave
    the others waiting."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    skip_unless(grid_for(fn) is not None, f"p = {P} has no grid for {fn}")
    q, d = grid_for(fn)
    m, k, n = 5, 7, 3
    sizes = bad if RANK == 0 else (m, k, n)
    with Grid(WORLD, q, d) as g:
        a, b = layout.split(np.ones((m, k)), g, "2d"), layout.split(np.ones((k, n)), g, "2d")
        msg = one_rank_error(ValueError, getattr(algs, fn), a, b, g, sizes=sizes)
        want = ("rank 0 has none" if bad is None
                else "sizes must be three non-negative integers")
        parallel_assert(want in msg and fn in msg, f"message: {msg!r}")
        parallel_assert(len(g.trace.events) == 0, "a failed call communicated")


def test_byte_swapped_arrays_are_refused_before_anything_is_sent():
    """MPI moves items in this machine's byte order only: a '>f8' operand or vector is
    a TypeError naming the fix on every rank, not a BufferError inside a broadcast."""
    swapped = np.dtype(np.float64).newbyteorder("S")
    q, d = grid_shapes(P)[0]
    with Grid(WORLD, q, d) as g:
        ones = np.ones((BLK, BLK), swapped)
        msg = collective_raises(TypeError, algs.summa_ab, ones, ones, g)
        parallel_assert("byte order" in msg and "newbyteorder" in msg, f"message: {msg!r}")
        parallel_assert(len(g.trace.events) == 0, "a failed call communicated")
    for fn in (algs.ring_allreduce, algs.ring_reduce_scatter, algs.ring_allgather):
        msg = collective_raises(TypeError, fn, np.ones(5, swapped), WORLD)
        parallel_assert("byte order" in msg, f"{fn.__name__}: {msg!r}")


def test_one_rank_ring_length():
    """ring_allreduce of 7 items on rank 0 and 8 elsewhere; the two halves alike."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    n = 7 if RANK == 0 else 8
    msg = one_rank_error(ValueError, algs.ring_allreduce, np.ones(n), WORLD)
    parallel_assert("shape of x: rank 0 has (7,)" in msg and f"{OTHERS} (8,)" in msg,
                    f"message: {msg!r}")
    for fn in (algs.ring_reduce_scatter, algs.ring_allgather):
        msg = one_rank_error(ValueError, fn, np.ones(n), WORLD)
        parallel_assert("buffer shape: rank 0 has (7,)" in msg, f"message: {msg!r}")
    # a bad out buffer on rank 0 only (its own check fails)
    out = np.ones(9) if RANK == 0 else None
    msg = one_rank_error(ValueError, algs.ring_allreduce, np.ones(8), WORLD, out=out)
    parallel_assert("bad input on rank 0" in msg, f"message: {msg!r}")


@pytest.mark.parametrize("fn", ["summa_ab", "summa_abt", "summa25_atb", "cannon_ab"])
def test_out_that_overlaps_an_operand_or_is_read_only(fn):
    """An ``out`` that is an operand (or overlaps one) would be overwritten while it is
    still read or sent, and a read-only ``out`` on rank 0 alone would raise there
    mid-algorithm: both raise ValueError on every rank before anything is sent."""
    skip_unless(grid_for(fn) is not None, f"p = {P} has no grid for {fn}")
    q, d = grid_for(fn)
    f = getattr(algs, fn)
    with Grid(WORLD, q, d) as g:
        a, b = np.ones((BLK, BLK)), np.ones((BLK, BLK))
        msg = collective_raises(ValueError, f, a, b, g, out=a)
        parallel_assert("out overlaps a" in msg, f"message: {msg!r}")
        big = np.ones((BLK + 1, BLK))            # b and out share BLK - 1 rows
        msg = collective_raises(ValueError, f, a, big[1:], g, out=big[:-1])
        parallel_assert("out overlaps b" in msg, f"message: {msg!r}")
        if P > 1:
            out = np.empty((BLK, BLK))
            out.flags.writeable = RANK != 0
            msg = one_rank_error(ValueError, f, a, b, g, out=out)
            parallel_assert("read-only" in msg, f"message: {msg!r}")
            # an out of the wrong shape on rank 0, and no out on the others: they check
            # rank 0's too, rather than wait for it in the product
            out = np.empty((BLK + 2, BLK)) if RANK == 0 else None
            msg = one_rank_error(ValueError, f, a, b, g, out=out)
            parallel_assert(f"out has shape {(BLK + 2, BLK)} on rank 0" in msg,
                            f"message: {msg!r}")
        parallel_assert(len(g.trace.events) == 0, "a failed call communicated")
        c = np.full((BLK, BLK), np.nan)          # a separate out is still written whole
        f(a, b, g, out=c)
        parallel_assert(bool(np.isfinite(c).all()), "out was not written")


def test_ring_out_overlap_read_only_and_in_place_forms():
    """ring_allreduce: an ``out`` that overlaps ``x`` without being it, or is read-only
    on rank 0 alone (``x`` itself too, in place), raises everywhere before anything moves; in place through a view
    of exactly ``x``, or on a transposed (non-contiguous) ``x``, sums correctly."""
    n = 4 * P + 3
    buf = np.ones(n + 1)
    msg = collective_raises(ValueError, algs.ring_allreduce, buf[:n], WORLD, out=buf[1:])
    parallel_assert("out overlaps x" in msg, f"message: {msg!r}")
    if P > 1:
        out = np.empty(n)
        out.flags.writeable = RANK != 0
        msg = one_rank_error(ValueError, algs.ring_allreduce, np.ones(n), WORLD, out=out)
        parallel_assert("read-only" in msg, f"message: {msg!r}")
        ro = np.ones(n)
        ro.flags.writeable = RANK != 0
        msg = one_rank_error(ValueError, algs.ring_allreduce, ro, WORLD, out=ro)
        parallel_assert("read-only" in msg, f"in place on a read-only x: {msg!r}")
        for fn in (algs.ring_reduce_scatter, algs.ring_allgather):
            msg = one_rank_error(ValueError, fn, ro, WORLD)
            parallel_assert("read-only" in msg, f"message: {msg!r}")
    flat = np.ones(n)
    msg = collective_raises(ValueError, algs.ring_reduce_scatter, flat, WORLD, work=flat[:n])
    parallel_assert("work overlaps" in msg, f"message: {msg!r}")
    total = P * (P + 1) / 2
    base = np.arange(n, dtype=np.float64)
    x = base * (RANK + 1)
    algs.ring_allreduce(x, WORLD, out=x.view())
    parallel_assert(np.array_equal(x, base * total), "in place through a view")
    t = (np.arange(12.0).reshape(3, 4) * (RANK + 1)).T          # (4, 3), not contiguous
    got = algs.ring_allreduce(t, WORLD, out=t)
    parallel_assert(got is t and np.array_equal(t, np.arange(12.0).reshape(3, 4).T * total),
                    "in place on a transposed x")


def test_one_rank_bad_local_param_megatron():
    """Rank 0's local ``h0.mlp.fc.b`` is one element short: every rank raises."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    cfg = model.Config(vocab=3 * P, seq=4, hidden=4 * P, heads=P, layers=1)
    params = model.init_params(cfg)
    tokens = np.arange(2 * 4).reshape(2, 4) % cfg.vocab
    with Grid1D(WORLD) as grid:
        local = megatron.shard(params, cfg, grid)
        if RANK == 0:
            local["h0.mlp.fc.b"] = local["h0.mlp.fc.b"][:-1].copy()
        msg = one_rank_error(ValueError, megatron.forward, local, tokens, tokens, cfg, grid)
        parallel_assert("h0.mlp.fc.b" in msg and "passed the checks" in msg, f"message: {msg!r}")
        # different tokens on rank 0 (same shape): the checksums differ
        other = (tokens + (RANK == 0)) % cfg.vocab
        local = megatron.shard(params, cfg, grid)
        msg = one_rank_error(ValueError, megatron.forward, local, other, tokens, cfg, grid)
        parallel_assert("ranks disagree on the tokens" in msg, f"message: {msg!r}")
        parallel_assert(len(grid.trace.events) == 0, "a failed call communicated")


def test_one_rank_bad_local_param_optimus():
    """Rank 0 (row 0: it hosts ``lnf.g``) holds a ``lnf.g`` one element short."""
    skip_unless(P > 1, "a one-rank error needs two ranks")
    q, d = grid_shapes(P)[-1]
    cfg = model.Config(vocab=3 * q, seq=4, hidden=4 * q, heads=2 * q, layers=1)
    params = model.init_params(cfg)
    tokens = np.arange(d * q * 4).reshape(d * q, 4) % cfg.vocab
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        if RANK == 0:
            local["lnf.g"] = local["lnf.g"][:-1].copy()
        msg = one_rank_error(ValueError, optimus.forward, local, tokens, tokens, cfg, grid)
        parallel_assert("'lnf.g'" in msg and "passed the checks" in msg, f"message: {msg!r}")
        # a config that differs on rank 0 only, at shard
        cfg0 = model.Config(vocab=3 * q, seq=5 if RANK == 0 else 4, hidden=4 * q,
                            heads=2 * q, layers=1)
        msg = one_rank_error(ValueError, optimus.shard, model.init_params(cfg0), cfg0, grid)
        parallel_assert("Config.seq: rank 0 has 5" in msg, f"message: {msg!r}")
        parallel_assert(len(grid.trace.events) == 0, "a failed call communicated")


def test_agreement_switch():
    """set_agreement/agreement switch it; a good call works either way."""
    from summasim.mpiutil import agreement, agreement_enabled, set_agreement

    was = agreement_enabled()
    with agreement(False):
        parallel_assert(not agreement_enabled(), "agreement(False) did not switch it off")
        y = algs.ring_allreduce(np.ones(5), WORLD)
    parallel_assert(agreement_enabled() == was and np.all(y == P), "switch or result wrong")
    parallel_assert(set_agreement(was) == was, "set_agreement returns the previous setting")
