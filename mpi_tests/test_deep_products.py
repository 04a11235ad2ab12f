"""The communication-optimal products: Solomonik-Demmel 2.5D (sd25_ab) and 3D (mm3d_ab).

Their blocks equal NumPy's, their traffic the closed forms (test_traffic covers every
grid; here the words each rank moves are checked against the 2.5D and 3D orders), and
a grid that is not a cube is refused by mm3d_ab on every rank alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, collective_raises, grid_shapes, parallel_assert
from summasim import algorithms as algs
from summasim import layout
from summasim.algorithms.deep import layer_steps
from summasim.grid import Grid

P = WORLD.Get_size()
CUBES = [(q, d) for q, d in grid_shapes(P) if d == q]
DEEP = [(q, d) for q, d in grid_shapes(P) if d > 1]


def test_layer_steps_cover_the_q_steps_once():
    for q in range(1, 9):
        for c in range(1, 10):
            steps = [list(layer_steps(q, c, k)) for k in range(c)]
            assert sum(steps, []) == list(range(q))
            assert max(map(len, steps)) - min(map(len, steps)) <= 1


@pytest.mark.skipif(not DEEP, reason=f"no [q, q, c] grid with c > 1 at p = {P}")
@pytest.mark.parametrize("q,c", DEEP)
def test_sd25_reads_layer_zero_only_and_sums_the_layers(q, c):
    """Only layer 0's inputs count (the others' copies are replaced by its broadcast):
    garbage on the other layers changes nothing."""
    rng = np.random.default_rng(3)
    m, k, n = 3 * q, 5 * q, 2 * q
    A, B = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    with Grid(WORLD, q, c) as grid:
        a, b = layout.split(A, grid, "2d"), layout.split(B, grid, "2d")
        if grid.k > 0:
            a[...] = np.nan
            b[...] = 1e300
        got = algs.sd25_ab(a, b, grid)
        want = layout.split(A @ B, grid, "2d")
        parallel_assert(np.allclose(got, want, rtol=1e-12, atol=1e-12),
                        f"rank {grid.coords}: sd25_ab block differs from NumPy's")


@pytest.mark.skipif(not CUBES or CUBES == [(1, 1)], reason=f"p = {P} is not a cube > 1")
def test_mm3d_moves_each_operand_once():
    """Per rank: A's and B's pieces gathered once and C's reduce-scattered once: the
    words are 3 (q-1)/q n^2/q^2 for n x n x n, the 3D order n^2/p^(2/3)."""
    (q, _), = CUBES
    n = 4 * q * q
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    with Grid(WORLD, q, q) as grid:
        a, b = layout.split(A, grid, "3d-a"), layout.split(B, grid, "3d-b")
        got = algs.mm3d_ab(a, b, grid)
        parallel_assert(np.allclose(got, layout.split(A @ B, grid, "3d-c"), rtol=1e-12,
                                    atol=1e-12), "mm3d_ab block differs")
        # words this rank sent: an all-gather sends its piece to q-1 ranks (MPI's own),
        # the ring's q-1 steps send a chunk each
        ev = grid.trace.events
        words = sum(e.nbytes * (e.group_size - 1) if e.op == "allgather" else e.nbytes
                    for e in ev) // 8
        block = (n // q) ** 2
        want = 3 * (q - 1) * block // q
        parallel_assert(words == want, f"{words} words moved, want 3(q-1)/q n^2/q^2 = {want}")
        whole = layout.join(got, grid, "3d-c")        # every block where "3d-c" puts it
        parallel_assert(np.allclose(whole, A @ B, rtol=1e-12, atol=1e-12), "join(3d-c)")


@pytest.mark.skipif(all(d == q for q, d in grid_shapes(P)), reason=f"every grid at p = {P} "
                                                                   f"is a cube")
def test_mm3d_refuses_a_grid_that_is_not_a_cube():
    q, d = next((q, d) for q, d in grid_shapes(P) if d != q)
    with Grid(WORLD, q, d) as grid:
        msg = collective_raises(ValueError, algs.mm3d_ab, np.ones((q * q, q)),
                                np.ones((q, q)), grid)
        parallel_assert("cube" in msg, msg)


@pytest.mark.skipif(not CUBES or CUBES == [(1, 1)], reason=f"p = {P} is not a cube > 1")
@pytest.mark.parametrize("name", ["mm3d_ab", "mm3d_abt", "mm3d_atb"])
def test_a_bad_block_on_one_rank_is_refused_on_every_rank(name):
    """Rank 0 alone passes a B block one row short: every rank raises the same error,
    before anything is sent."""
    (q, _), = CUBES
    spec = __import__("summasim.algorithms.table", fromlist=["ALGORITHMS"]).ALGORITHMS[name]
    m, k, n = spec.round_up(2 * q * q, 2 * q * q, 2 * q * q, q, q)
    sa, sb = spec.stored_shapes(m, k, n)
    rng = np.random.default_rng(5)
    with Grid(WORLD, q, q) as grid:
        a = layout.split(rng.standard_normal(sa), grid, spec.layout_a)
        b = layout.split(rng.standard_normal(sb), grid, spec.layout_b)
        if WORLD.Get_rank() == 0:
            b = b[:-1]
        msg = collective_raises(ValueError, getattr(algs, name), a, b, grid)
        parallel_assert("rank 0" in msg or "do not conform" in msg or "differ" in msg, msg)
        parallel_assert(len(grid.trace.events) == 0, "something was sent before the refusal")
