"""``bench gemm``'s ScaLAPACK peer under MPI (:mod:`summasim.bench.pdgemm`): PDGEMM's C
is summasim's SUMMA product on the same blocks, a wrong input fails the collective
check on every rank, and the process still maps one MPI library. ScaLAPACK is not a
summasim dependency: without it (or on a p that is not q x q) these tests skip with the
peer's own reason."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert
from summasim import algorithms as algs
from summasim.bench import pdgemm
from summasim.grid import Grid
from summasim.harness.data import STREAM_A, STREAM_B, uniform_block
from summasim.layout import block_slices, grid_numbers
from summasim.validate import tolerance

P = WORLD.Get_size()
Q = int(round(P ** 0.5))
N = 24 * Q                   # one 24 x 24 block of each matrix per rank


def _available(n: int = N, dtype="float64"):
    lib = pdgemm.available(WORLD, n, dtype)          # the same reason on every rank
    if lib.reason:
        pytest.skip(lib.reason)
    return lib


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_pdgemm_equals_summa_on_the_same_blocks(dtype):
    _available(N, dtype)
    run = pdgemm.pdgemm_peer(WORLD, N, dtype, 2, keep=True)
    parallel_assert(run.ok and run.check.method == "freivalds", f"{run.reason} {run.check}")
    parallel_assert(run.timing and len(run.timing["spans"]) >= 2, str(run.timing))
    with Grid(WORLD, Q) as grid:
        g = grid_numbers(grid)
        a, b = (uniform_block(0, s, (N, N), *block_slices((N, N), "2d", g), dtype)
                for s in (STREAM_A, STREAM_B))
        want = algs.summa_ab(a, b, grid)
        where = (grid.i, grid.j)
    parallel_assert(run.coords == where, f"BLACS put this rank at {run.coords}, summasim "
                                         f"at {where}")
    # |C| <= N entry by entry (|a|, |b| <= 1): both within the rounding of an N-term sum
    err = float(np.max(np.abs(run.c.astype(np.float64) - want)))
    parallel_assert(run.c.dtype == np.dtype(dtype) and err <= 2 * N * tolerance(N, dtype),
                    f"max |pdgemm - summa| = {err:.3e}")


def test_a_corrupted_input_fails_on_every_rank():
    _available()

    def tamper(a, b):                  # rank 0's A block: one entry off by 1
        if WORLD.Get_rank() == 0:
            a = a.copy(order="F")
            a[0, 0] += 1.0
        return a, b

    run = pdgemm.pdgemm_peer(WORLD, N, "float64", 1, timed=False, tamper=tamper)
    # A's block (0, 0) enters C's block row 0: ranks (0, j), j < q, hold a wrong C
    parallel_assert(not run.ok and run.check.bad_ranks == list(range(Q)),
                    f"ok={run.ok} bad ranks {run.check.bad_ranks}")
    parallel_assert(run.timing == {}, "timed although timed=False")


def test_a_transposed_b_fails():
    _available()
    q, nb = Q, N // Q

    def transposed(a, b):              # rank (i, j) is given block (i, j) of B^T
        i, j = divmod(WORLD.Get_rank(), q)
        bt = uniform_block(0, STREAM_B, (N, N), slice(j * nb, (j + 1) * nb),
                           slice(i * nb, (i + 1) * nb), "float64").T
        return a, bt

    run = pdgemm.pdgemm_peer(WORLD, N, "float64", 1, timed=False, tamper=transposed)
    parallel_assert(not run.ok and run.check.bad_ranks == list(range(P)),
                    f"ok={run.ok} bad ranks {run.check.bad_ranks}")


def test_one_mpi_library_in_the_process():
    lib = _available()
    mapped = pdgemm.mapped_mpi()
    parallel_assert(len(mapped) == 1, f"MPI libraries mapped: {mapped}")
    parallel_assert(lib.lib is not None and not lib.reason, lib.reason)
