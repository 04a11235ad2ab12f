"""Benchmarks: ``mpirun -n P python -m summasim.bench [gemm|allreduce|all]``.

``gemm``       GFLOP/s of every distributed product that fits p, on n x n x n, next to
               the ceiling: the single-process NumPy GEMM rate on this machine with all
               its cores, measured in the same run by rank 0 while the other ranks
               sleep (they wait without spinning, so they do not steal its cores). The
               ceiling is re-measured right before each algorithm and the ratio uses
               that adjacent value, because the machine's speed drifts (it is shared).
``allreduce``  bandwidth of ``ring_allreduce`` next to MPI's own ``Allreduce`` on the
               same buffers, over message sizes.

Speed goals live here, not in timed tests. Results go to the terminal and, with
``--json``, to a file (written atomically).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

GEMM_ALGORITHMS = ("cannon_ab", "summa_ab", "summa_abt", "summa_atb", "summa25_ab",
                   "summa25_abt", "summa25_atb")


def _sleep_barrier(comm):
    """A barrier that waits without spinning (ranks idle while rank 0 measures)."""
    from mpi4py import MPI  # noqa: F401

    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def _max_time(fn, comm) -> float:
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def ceiling_gflops(n: int, dtype, repeats: int, threads: int | None = None) -> float:
    """Single-process GEMM rate (GFLOP/s) at n x n x n with ``threads`` BLAS threads."""
    from threadpoolctl import threadpool_limits

    from .comm import cores

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    with threadpool_limits(limits=threads or cores()):
        np.matmul(a, b, out=c)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def bench_gemm(world, n: int, dtype, repeats: int, algorithms, say) -> list[dict]:
    """Time each distributed product on the grids that fit; return result rows."""
    from . import algorithms as algs
    from .grid import Grid
    from .run import ALGORITHMS, plan, stored_shapes

    p, rank = world.Get_size(), world.Get_rank()

    def measure_ceiling():
        value = ceiling_gflops(n, dtype, repeats) if rank == 0 else None
        _sleep_barrier(world)
        return world.bcast(value, root=0)

    say(f"ceiling: single-process NumPy GEMM, n = {n}, {np.dtype(dtype).name}, all cores, "
        f"measured before each algorithm")
    say(f"{'algorithm':<14} {'grid':<9} {'n':>6} {'median s':>9} {'best s':>8} "
        f"{'GFLOP/s':>8} {'ceiling':>8} {'% ceiling':>9} {'best %':>7}")
    rows = []
    for pl in plan(p, algorithms, sizes=(n, n, n)):
        if pl.skip:
            say(f"{pl.algorithm:<14} skipped: {pl.skip}")
            continue
        _, op, la, lb, _ = ALGORITHMS[pl.algorithm]
        ceiling = measure_ceiling()
        with Grid(world, pl.q, pl.d) as grid:
            from .layout import local_shape

            sa, sb = stored_shapes(op, n, n, n)
            rng = np.random.default_rng(rank)
            a = rng.standard_normal(local_shape(sa, la, pl.q, pl.d, p)).astype(dtype)
            b = rng.standard_normal(local_shape(sb, lb, pl.q, pl.d, p)).astype(dtype)
            fn = getattr(algs, pl.algorithm)
            grid.trace.enabled = False
            fn(a, b, grid)  # warm-up: first-touch of workspaces, MPI connections
            times = [_max_time(lambda: fn(a, b, grid), world) for _ in range(repeats)]
        t, best = statistics.median(times), min(times)
        gf, gf_best = 2.0 * n**3 / t / 1e9, 2.0 * n**3 / best / 1e9
        rows.append({"algorithm": pl.algorithm, "grid": pl.grid_label, "n": n,
                     "dtype": np.dtype(dtype).name, "seconds": t, "times": times,
                     "gflops": gf, "ceiling_gflops": ceiling, "fraction": gf / ceiling,
                     "best_fraction": gf_best / ceiling})
        say(f"{pl.algorithm:<14} {pl.grid_label:<9} {n:>6} {t:>9.4f} {best:>8.4f} {gf:>8.1f} "
            f"{ceiling:>8.1f} {100 * gf / ceiling:>8.1f}% {100 * gf_best / ceiling:>6.1f}%")
    return rows


def bench_allreduce(world, sizes_mib, dtype, repeats: int, say) -> list[dict]:
    """ring_allreduce vs MPI Allreduce bandwidth (message bytes / time) per size."""
    from mpi4py import MPI

    from .algorithms import ring_allreduce
    from .comm import Comm

    comm = Comm(world.Dup(), name="world")
    comm.trace.enabled = False
    say(f"{'MiB':>7} {'ring s':>9} {'ring GB/s':>10} {'MPI s':>9} {'MPI GB/s':>9} "
        f"{'ring/MPI':>9}")
    rows = []
    try:
        for mib in sizes_mib:
            count = int(mib * 2**20) // np.dtype(dtype).itemsize
            x = np.random.default_rng(world.Get_rank()).standard_normal(count).astype(dtype)
            out = np.empty_like(x)
            ring_allreduce(x, comm, out=out)                         # warm-up
            world.Allreduce(x, out, op=MPI.SUM)
            t_ring, t_mpi = [], []
            for _ in range(repeats):  # interleave so both see the same machine state
                t_ring.append(_max_time(lambda: ring_allreduce(x, comm, out=out), world))
                t_mpi.append(_max_time(lambda: world.Allreduce(x, out, op=MPI.SUM), world))
            tr, tm = statistics.median(t_ring), statistics.median(t_mpi)  # medians
            nbytes = count * np.dtype(dtype).itemsize
            rows.append({"mib": mib, "bytes": nbytes, "ring_seconds": tr, "mpi_seconds": tm,
                         "ring_gbps": nbytes / tr / 1e9, "mpi_gbps": nbytes / tm / 1e9,
                         "ratio": tm / tr})
            say(f"{mib:>7g} {tr:>9.4f} {nbytes / tr / 1e9:>10.2f} {tm:>9.4f} "
                f"{nbytes / tm / 1e9:>9.2f} {tm / tr:>8.1%}")
    finally:
        comm.mpi.Free()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m summasim.bench", description=__doc__.split(
        "\n\n")[0] + " Run under mpirun.")
    ap.add_argument("what", nargs="?", choices=("gemm", "allreduce", "all"), default="all")
    ap.add_argument("--n", type=int, default=4096, help="GEMM size n (default 4096)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--algorithms", default=",".join(GEMM_ALGORITHMS),
                    help="comma-separated distributed products to time")
    ap.add_argument("--sizes-mib", default="1,8,32,64",
                    help="all-reduce message sizes in MiB (default 1,8,32,64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)

    from mpi4py import MPI

    from .comm import cores, default_wait_policy
    from .mpiutil import abort_on_error, limit_blas_threads
    from .run import write_json_atomic

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    with abort_on_error(world):
        _limits = limit_blas_threads(1 if p > 1 else None)  # noqa: F841
        say(f"summasim.bench: p = {p} ranks on {cores()} cores, wait policy "
            f"{default_wait_policy()}, {args.dtype}")
        dtype = np.dtype(args.dtype)
        report = {"p": p, "cores": cores(), "dtype": args.dtype,
                  "wait_policy": default_wait_policy()}
        if args.what in ("gemm", "all"):
            names = [s for s in args.algorithms.split(",") if s]
            report["gemm"] = bench_gemm(world, args.n, dtype, args.repeats, names, say)
        if args.what in ("allreduce", "all"):
            sizes = [float(s) for s in args.sizes_mib.split(",") if s]
            say("")
            report["allreduce"] = bench_allreduce(world, sizes, dtype, args.repeats, say)
        if args.json and rank == 0:
            write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
