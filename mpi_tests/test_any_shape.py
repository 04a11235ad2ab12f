"""Cannon, SUMMA and SUMMA2.5 on any sizes (the balanced partition) and SUMMA and
SUMMA2.5 on rectangular [pr, pc, d] grids: values against NumPy, the ledger against the
closed form, and input that is not the balanced partition refused on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _util import WORLD, collective_raises, parallel_assert, random_matrix, skip_unless
from summasim import layout
from summasim.algorithms.table import ALGORITHMS, stored_shapes
from summasim.costmodel.workload.traffic import algorithm_events
from summasim.spec import ANY_SIZE, RECTANGULAR
from summasim.validate import product_error, tolerance

P = WORLD.Get_size()
RANK = WORLD.Get_rank()
#: the [pr, pc, d] factorizations of P (at most 6 of them, the most square first)
FACTORS = sorted(((pr, P // (pr * d), d) for d in range(1, P + 1) for pr in range(1, P + 1)
                  if P % (pr * d) == 0), key=lambda g: (abs(g[0] - g[1]), g))[:6]
#: (the 2.5D and 3D products on their own grids: test_deep_products)
CASES = [(name, g) for name in ANY_SIZE for g in FACTORS
         if ALGORITHMS[name].kind not in ("2.5d-deep", "3d")
         and (name in RECTANGULAR or (g[0] == g[1] and g[2] == 1))]


def _operands(name, m, k, n, dtype, seed):
    op = ALGORITHMS[name].op
    rng = np.random.default_rng(seed)
    sa, sb = stored_shapes(op, m, k, n)
    A, B = random_matrix(rng, sa, dtype), random_matrix(rng, sb, dtype)
    return A, B


@pytest.mark.parametrize("name,g", CASES, ids=[f"{n}-{a}x{b}x{c}" for n, (a, b, c) in CASES])
@settings(max_examples=5, deadline=None)
@given(sizes=st.tuples(*[st.integers(1, 19)] * 3), dtype=st.sampled_from([np.float64,
                                                                          np.float32]),
       told=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_any_sizes_match_numpy_and_the_ledger_its_closed_form(grids, backend, name, g, sizes,
                                                              dtype, told, seed):
    """Every rank's block equals NumPy's within the bound, with the sizes given or found
    by the blocks' all-gather, and every rank's trace is the closed form's events."""
    grid = grids(g[0], g[2], g[1])                        # (pr, d, pc)
    spec = ALGORITHMS[name]
    m, k, n = sizes
    A, B = _operands(name, m, k, n, dtype, seed)
    a = backend.asarray(layout.split(A, grid, spec.layout_a))
    b = backend.asarray(layout.split(B, grid, spec.layout_b))
    c = spec.fn(a, b, grid, sizes=sizes if told else None)
    backend.synchronize()
    full = layout.join(backend.to_numpy(c), grid, spec.layout_c)
    opa, opb = (A.T, B) if spec.op == "atb" else (A, B.T) if spec.op == "abt" else (A, B)
    err = product_error(full, opa, opb)
    parallel_assert(err <= tolerance(k, dtype), f"{name} {g} {sizes}: error {err:.2e}")
    got = sorted((e.op, e.group, e.group_size, e.root, e.nbytes) for e in grid.trace.events
                 if e.phase != "layout.join")
    want = sorted(tuple(e) for e in algorithm_events(
        name, m, k, n, g[0], g[2], np.dtype(dtype).itemsize, grid.coords, pc=g[1]))
    parallel_assert(got == want, f"{name} {g} {sizes}: trace {got} != closed form {want}")


@pytest.mark.parametrize("name,g", CASES, ids=[f"{n}-{a}x{b}x{c}" for n, (a, b, c) in CASES])
@pytest.mark.parametrize("sizes", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_a_size_of_zero_is_an_empty_or_zero_product(grids, name, g, sizes):
    """m, k or n = 0: an empty C, or (k = 0) C = 0, on every rank, with the sizes given
    or found (the cost model's closed forms take positive sizes only)."""
    grid = grids(g[0], g[2], g[1])
    spec = ALGORITHMS[name]
    m, k, n = sizes
    A, B = _operands(name, m, k, n, np.float64, 7)
    for told in (False, True):
        c = spec.fn(layout.split(A, grid, spec.layout_a), layout.split(B, grid, spec.layout_b),
                    grid, sizes=sizes if told else None)
        full = layout.join(c, grid, spec.layout_c)
        parallel_assert(full.shape == (m, n) and not full.any(),
                        f"{name} {g} {sizes}: C is {full.shape}, max {abs(full).max(initial=0)}")


def test_blocks_that_are_not_the_balanced_partition_are_refused_everywhere(grids):
    """Rank 0's A block one column wide of its share: every rank raises the same
    ValueError naming rank 0, before anything is sent."""
    skip_unless(P > 1, "needs two ranks")
    pr, pc, d = FACTORS[0]
    grid = grids(pr, d, pc)
    m, k, n = 2 * pr + 1, 3 * pc + 2, 2 * pc + 1
    A, B = _operands("summa_ab", m, k, n, np.float64, 1)
    a = layout.split(A, grid, "2d")
    b = layout.split(B, grid, "2d")
    if RANK == 0:
        a = np.ones((a.shape[0], a.shape[1] + 1))
    for sizes in (None, (m, k, n)):
        msg = collective_raises(ValueError, ALGORITHMS["summa_ab"].fn, a, b, grid, sizes=sizes)
        parallel_assert(len(set(WORLD.allgather(msg))) == 1, f"messages differ: {msg!r}")
        parallel_assert("rank 0" in msg, f"message does not name rank 0: {msg!r}")
    # the sizes given on rank 0 alone: one collective all the same, a disagreement
    a = layout.split(A, grid, "2d")
    msg = collective_raises(ValueError, ALGORITHMS["summa_ab"].fn, a, b, grid,
                            sizes=(m, k, n) if RANK == 0 else None)
    parallel_assert("ranks disagree on the sizes (m, k, n): rank 0 has" in msg,
                    f"message: {msg!r}")
    parallel_assert(len(grid.trace.events) == 0, "a refused call communicated")


def test_cannon_and_the_deep_products_refuse_a_rectangular_grid(grids):
    rect = [g for g in FACTORS if g[0] != g[1]]
    skip_unless(bool(rect), f"p = {P} has no rectangular layer")
    grid = grids(rect[0][0], rect[0][2], rect[0][1])      # (pr, d, pc)
    for name, needle in (("cannon_ab", "needs a q x q grid"), ("sd25_ab", "square grid"),
                         ("mm3d_ab", "square grid")):
        msg = collective_raises(ValueError, ALGORITHMS[name].fn, np.ones((2, 2)),
                                np.ones((2, 2)), grid)
        parallel_assert(needle in msg, f"{name}: message {msg!r}")
    parallel_assert(len(grid.trace.events) == 0, "a refused call communicated")
