"""The communication-optimal products: Solomonik-Demmel 2.5D (sd25_ab) and 3D (mm3d_ab).

Their blocks equal NumPy's, their traffic the closed forms (test_traffic covers every
grid; here the words each rank moves are checked against the 2.5D and 3D orders), and
a grid that is not a cube is refused by mm3d_ab on every rank alike. On any sizes
(hypothesis draws 1..19; the balanced blocks, nested on the cube) every rank's block
equals NumPy's and its trace the closed form, with the sizes given or found, and a
block that is not the rank's block is refused on every rank before anything is sent.
"""

from __future__ import annotations

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from _util import WORLD, collective_raises, grid_shapes, parallel_assert, random_matrix
from summasim import algorithms as algs
from summasim import layout
from summasim.algorithms.deep import layer_steps
from summasim.algorithms.table import ALGORITHMS
from summasim.costmodel.workload.traffic import algorithm_events
from summasim.grid import Grid
from summasim.validate import product_error, tolerance

P = WORLD.Get_size()
RANK = WORLD.Get_rank()
CUBES = [(q, d) for q, d in grid_shapes(P) if d == q]
DEEP = [(q, d) for q, d in grid_shapes(P) if d > 1]
#: each deep product on each grid of P it runs on (sd25_ab: [q, q, c] with q >= 2)
ANY = ([("sd25_ab", q, d) for q, d in DEEP if q > 1]
       + [(name, q, q) for name in ("mm3d_ab", "mm3d_abt", "mm3d_atb") for q, _ in CUBES])


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


def _operands(name, m, k, n, dtype, seed):
    sa, sb = ALGORITHMS[name].stored_shapes(m, k, n)
    rng = np.random.default_rng(seed)
    return random_matrix(rng, sa, dtype), random_matrix(rng, sb, dtype)


@pytest.mark.skipif(not ANY, reason=f"no deep grid at p = {P}")
@pytest.mark.parametrize("name,q,d", ANY, ids=[f"{n}-{q}x{q}x{d}" for n, q, d in ANY])
@settings(max_examples=6, deadline=None)
@given(sizes=st.tuples(*[st.integers(1, 19)] * 3),
       dtype=st.sampled_from([np.float64, np.float32]), told=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_any_sizes_match_numpy_and_the_closed_form(grids, backend, name, q, d, sizes,
                                                   dtype, told, seed):
    """Every rank's block equals NumPy's within the bound and every rank's trace is the
    closed form's events (the padded all-gathers, the row-aligned ring chunks)."""
    grid = grids(q, d)
    spec = ALGORITHMS[name]
    m, k, n = sizes
    A, B = _operands(name, m, k, n, dtype, seed)
    a = backend.asarray(layout.split(A, grid, spec.layout_a))
    b = backend.asarray(layout.split(B, grid, spec.layout_b))
    c = backend.to_numpy(spec.fn(a, b, grid, sizes=sizes if told else None))
    opa, opb = (A.T, B) if spec.op == "atb" else (A, B.T) if spec.op == "abt" else (A, B)
    rows, cols = layout.block_slices((m, n), spec.layout_c, layout.grid_numbers(grid))
    want = (opa[rows].shape[0], opb[:, cols].shape[1])
    err = product_error(c, opa[rows], opb[:, cols]) if c.shape == want else np.inf
    parallel_assert(err <= tolerance(k, dtype), f"{name} [{q}, {q}, {d}] {sizes} "
                    f"{np.dtype(dtype)}: rank {RANK}'s block {c.shape} (want {want}) has "
                    f"error {err:.2e}")
    got = sorted((e.op, e.group, e.group_size, e.root, e.nbytes) for e in grid.trace.events)
    exp = sorted(tuple(e) for e in algorithm_events(name, m, k, n, q, d,
                                                     np.dtype(dtype).itemsize, grid.coords))
    parallel_assert(got == exp, f"{name} {sizes}: rank {RANK}'s trace {got} != closed "
                                f"form {exp}")


@pytest.mark.skipif(P == 1 or not ANY, reason=f"no deep grid of more than one rank at "
                                              f"p = {P}")
@pytest.mark.parametrize("name,q,d", ANY, ids=[f"{n}-{q}x{q}x{d}" for n, q, d in ANY])
def test_a_block_that_is_not_the_ranks_block_is_refused_everywhere(grids, name, q, d):
    """Uneven sizes; the last rank's A block one row short of its share: every rank
    raises the same ValueError naming that rank, with the sizes given or not, and nothing
    is sent."""
    grid = grids(q, d)
    spec = ALGORITHMS[name]
    m, k, n = 2 * q * q + 1, 3 * q + 2, 2 * q + 1
    A, B = _operands(name, m, k, n, np.float64, 1)
    a = layout.split(A, grid, spec.layout_a)
    b = layout.split(B, grid, spec.layout_b)
    last = P - 1
    if RANK == last:
        a = np.ones((a.shape[0] + 1, a.shape[1]))
    for sizes in (None, (m, k, n)):
        msg = collective_raises(ValueError, spec.fn, a, b, grid, sizes=sizes)
        parallel_assert(len(set(WORLD.allgather(msg))) == 1, f"messages differ: {msg!r}")
        parallel_assert(f"rank {last}" in msg, f"message does not name rank {last}: {msg!r}")
    parallel_assert(len(grid.trace.events) == 0, "a refused call communicated")
