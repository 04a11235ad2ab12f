"""Every algorithm against NumPy on hypothesis-drawn, non-square shapes, on every
grid the process count allows (2D grids replicate over depth when d > 1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _util import WORLD, grid_shapes, parallel_assert, random_matrix
from summasim import algorithms as algs
from summasim import layout
from summasim.comm import Comm
from summasim.algorithms.table import ALGORITHMS, stored_shapes
from summasim.validate import product_error, tolerance

P = WORLD.Get_size()
PRODUCTS = [n for n, spec in ALGORITHMS.items() if spec.is_product]
CASES = [(name, q, d) for name in PRODUCTS for q, d in grid_shapes(P)
         if not (name == "cannon_ab" and d > 1) and not (name.startswith("mm3d") and d != q)]


@pytest.mark.parametrize("name,q,d", CASES, ids=[f"{n}-q{q}d{d}" for n, q, d in CASES])
@given(mult=st.tuples(*[st.integers(1, 3)] * 3),
       dtype=st.sampled_from([np.float64, np.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_product_matches_numpy(grids, backend, name, q, d, mult, dtype, seed):
    grid = grids(q, d)
    spec = ALGORITHMS[name]
    op, la, lb, lc = spec.op, spec.layout_a, spec.layout_b, spec.layout_c
    need = spec.divisors(q, d)
    # non-square by construction: distinct multipliers of what the layouts need
    m, k, n = (need[c] * f * s for c, f, s in zip("mkn", mult, (3, 2, 1)))
    rng = np.random.default_rng(seed)
    sa, sb = stored_shapes(op, m, k, n)
    A, B = random_matrix(rng, sa, dtype), random_matrix(rng, sb, dtype)
    a = backend.asarray(layout.split(A, grid, la))
    b = backend.asarray(layout.split(B, grid, lb))
    c = getattr(algs, name)(a, b, grid)
    backend.synchronize()

    opa = A.T if op == "atb" else A                                          # (m, k)
    opb = B.T if op == "abt" else B                                          # (k, n)
    rows, cols = layout.block_slices((m, n), lc, layout.grid_numbers(grid))
    err = product_error(backend.to_numpy(c), opa[rows], opb[:, cols])
    tol = tolerance(k, dtype)
    parallel_assert(c.dtype == dtype and c.shape == (rows.stop - rows.start,
                                                     cols.stop - cols.start),
                    f"result block {c.dtype} {c.shape}")
    parallel_assert(err <= tol, f"{name} m,k,n={m},{k},{n} {np.dtype(dtype).name}: "
                                f"error {err:.3e} > bound {tol:.3e}")


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_backward_closed_set(grids, backend, q, d):
    """dA = summa_abt(dC, B) and dB = summa_atb(A, dC) for C = A B (Optimus eq. 1)."""
    grid = grids(q, d)
    rng = np.random.default_rng(7)
    m, k, n = 2 * q * d, 3 * q, 4 * q
    A, B, dC = (random_matrix(rng, s, np.float64) for s in ((m, k), (k, n), (m, n)))
    lay = "2.5d" if d > 1 else "2d"
    f_abt = algs.summa25_abt if d > 1 else algs.summa_abt
    f_atb = algs.summa25_atb if d > 1 else algs.summa_atb
    a, b, dc = (backend.asarray(layout.split(M, grid, lt))
                for M, lt in ((A, lay), (B, "2d"), (dC, lay)))
    dA = backend.to_numpy(layout.join(f_abt(dc, b, grid), grid, lay))
    dB = backend.to_numpy(layout.join(f_atb(a, dc, grid), grid, "2d"))
    ok = product_error(dA, dC, B.T) <= tolerance(n, np.float64) and \
        product_error(dB, A.T, dC) <= tolerance(m, np.float64)
    parallel_assert(ok, "backward of C = A B does not match dC B^T / A^T dC")


@given(n=st.integers(0, 40), dtype=st.sampled_from([np.float64, np.float32, np.int64]),
       seed=st.integers(0, 2**31 - 1))
def test_ring_allreduce_any_length(backend, n, dtype, seed):
    """Lengths below, at and not divisible by p; the input is not modified."""
    rng = np.random.default_rng(seed)
    X = (rng.integers(-9, 9, size=(P, n)) if dtype == np.int64
         else rng.uniform(-1, 1, size=(P, n))).astype(dtype)
    comm = Comm(WORLD, name="ring", backend=backend)
    x = backend.asarray(X[WORLD.Get_rank()])
    y = backend.to_numpy(algs.ring_allreduce(x, comm))
    x = backend.to_numpy(x)
    ref = X.astype(np.float64).sum(0)
    if dtype == np.int64:
        ok = np.array_equal(y, ref.astype(np.int64))
    else:
        scale = np.abs(X.astype(np.float64)).sum(0)
        ok = np.all(np.abs(y - ref) <= tolerance(P, dtype) * scale)
    parallel_assert(ok and y.shape == x.shape and y.dtype == x.dtype
                    and np.array_equal(x, X[WORLD.Get_rank()]), f"n={n} {dtype}")


def test_ring_allreduce_matrix_in_place():
    rng = np.random.default_rng(3)
    X = rng.uniform(-1, 1, size=(P, 5, 7))
    x = X[WORLD.Get_rank()].copy()
    out = algs.ring_allreduce(x, WORLD, out=x)
    parallel_assert(out is x and np.allclose(x, X.sum(0), rtol=0, atol=1e-14 * P),
                    "in-place ring all-reduce of a 5x7 matrix")


@pytest.mark.parametrize("limit", [1 << 30, 0], ids=["blocking-steps", "polled-steps"])
def test_ring_allreduce_into_an_uninitialised_out(limit):
    """Out of place the copy of x is fused into the adds: an ``out`` full of NaN, a
    non-contiguous x, either step path (blocking MPI_Sendrecv below the limit, the
    wait policy above), the same sum and exactly 2(P-1) traced steps."""
    rng = np.random.default_rng(5)
    X = rng.uniform(-1, 1, size=(P, 2 * (10 * P + 3)))
    comm = Comm(WORLD.Dup(), name="ring")
    try:
        comm.blocking_limit = limit
        x = X[WORLD.Get_rank()][::2]                       # a strided view
        out = np.full(x.shape, np.nan)
        y = algs.ring_allreduce(x, comm, out=out)
        ref = X[:, ::2].sum(0)
        ok = y is out and bool(np.all(np.abs(out - ref) <= tolerance(P, np.float64)
                                      * np.abs(X[:, ::2]).sum(0)))
        steps = [e.op for e in comm.trace.events]
        parallel_assert(ok and steps == ["sendrecv"] * (2 * (P - 1))
                        and np.array_equal(x, X[WORLD.Get_rank()][::2]),
                        f"ring into out (limit {limit}): {steps}")
    finally:
        comm.mpi.Free()
