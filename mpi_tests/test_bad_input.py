"""Bad input raises a clear error on every rank, before any communication."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, collective_raises, grid_shapes, parallel_assert, skip_unless
from summasim import algorithms as algs
from summasim import layout
from summasim.grid import Grid

P = WORLD.Get_size()
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
    skip_unless(P > 1, "every size divides a 1-rank grid")
    with Grid(WORLD, Q, D) as g:
        lay = "2.5d" if D > 1 else "2d"
        rows = D * Q if D > 1 else Q
        msg = collective_raises(ValueError, layout.split, np.ones((rows + 1, Q)), g, lay)
        parallel_assert(f"rows = {rows + 1}" in msg and f"divisible by {rows}" in msg,
                        f"message: {msg!r}")
        if Q > 1:
            msg = collective_raises(ValueError, layout.split, np.ones((rows, Q + 1)), g, lay)
            parallel_assert(f"columns = {Q + 1}" in msg, f"message: {msg!r}")


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
