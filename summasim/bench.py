"""Benchmarks: ``mpirun -n P python -m summasim.bench [gemm|allreduce|all]``.

``gemm``       GFLOP/s of every distributed product that fits p, on n x n x n, next to
               the ceiling: the single-process NumPy GEMM rate on this machine with all
               its cores, measured in the same run by rank 0 while the other ranks
               sleep (they wait without spinning, so they do not steal its cores). The
               ceiling is re-measured right before each algorithm and the ratio uses
               that adjacent value, because the machine's speed drifts (it is shared).
``allreduce``  bandwidth of ``ring_allreduce`` next to MPI's own ``Allreduce`` on the
               same buffers, over message sizes.
``transformer`` forward + backward time of each tensor-parallel scheme that fits p, on a
               one-layer model (default b=16, s=128, h=512, n=8, v=64, float32), next to
               the serial model on the same cores (rank 0 alone, all cores, the others
               asleep): the same total work, so the ratio is the parallel overhead.

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


def bench_transformer(world, shape, dtype, repeats: int, checkpoint: bool, say) -> list[dict]:
    """Forward+backward seconds of each scheme vs the serial model (collective)."""
    from threadpoolctl import threadpool_limits

    from .comm import cores
    from .transformer import model
    from .transformer.compare import (SCHEME_NAMES, grid_label, grid_shapes, make_grid,
                                      preconditions, scheme_module)

    b, s, h, n, v, layers = shape
    p, rank = world.Get_size(), world.Get_rank()
    config = model.Config(vocab=v, seq=s, hidden=h, heads=n, layers=layers,
                          dtype=np.dtype(dtype).type)
    params = model.init_params(config, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, v, size=(b, s))
    targets = rng.integers(0, v, size=(b, s))

    def serial_step():
        loss, cache = model.forward(params, tokens, targets, config, checkpoint=checkpoint)
        model.backward(cache)

    t_serial = None
    if rank == 0:
        with threadpool_limits(limits=cores()):
            serial_step()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                serial_step()
                ts.append(time.perf_counter() - t0)
        t_serial = statistics.median(ts)
    _sleep_barrier(world)
    t_serial = world.bcast(t_serial, root=0)
    say(f"transformer: b={b} s={s} h={h} heads={n} vocab={v} layers={layers} "
        f"{np.dtype(dtype).name}, checkpoint={checkpoint}; serial forward+backward on "
        f"{cores()} cores: {t_serial:.4f} s")
    say(f"{'scheme':<9} {'grid':<9} {'median s':>9} {'best s':>8} {'x serial':>9}")
    rows = []
    for name in SCHEME_NAMES:
        shapes = grid_shapes(name, p)
        if not shapes:
            say(f"{name:<9} skipped: no grid of this scheme has p = {p} ranks")
        for q, d in shapes:
            why = preconditions(name, config, b, p, q, d)
            if why:
                say(f"{name:<9} {grid_label(name, p, q, d):<9} skipped: {why}")
                continue
            module = scheme_module(name)
            grid = make_grid(name, world, q, d)
            try:
                grid.trace.enabled = False
                local = module.shard(params, config, grid)

                def step():
                    loss, cache = module.forward(local, tokens, targets, config, grid,
                                                 checkpoint=checkpoint)
                    module.backward(cache)

                step()
                times = [_max_time(step, world) for _ in range(repeats)]
            finally:
                grid.free()
            t = statistics.median(times)
            rows.append({"scheme": name, "grid": grid_label(name, p, q, d), "p": p,
                         "seconds": t, "times": times, "serial_seconds": t_serial,
                         "ratio": t / t_serial})
            say(f"{name:<9} {grid_label(name, p, q, d):<9} {t:>9.4f} {min(times):>8.4f} "
                f"{t / t_serial:>8.2f}x")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m summasim.bench", description=__doc__.split(
        "\n\n")[0] + " Run under mpirun.")
    ap.add_argument("what", nargs="?", choices=("gemm", "allreduce", "transformer", "all"),
                    default="all", help="which benchmark (default all)")
    ap.add_argument("--n", type=int, default=4096, help="GEMM size n (default 4096)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--algorithms", default=",".join(GEMM_ALGORITHMS),
                    help="comma-separated distributed products to time")
    ap.add_argument("--sizes-mib", default="1,8,32,64",
                    help="all-reduce message sizes in MiB (default 1,8,32,64)")
    ap.add_argument("--tf-shape", nargs=6, type=int, default=[16, 128, 512, 8, 64, 1],
                    metavar=("B", "S", "H", "N", "V", "L"),
                    help="transformer benchmark: batch, sequence, hidden, heads, vocab, layers "
                         "(default 16 128 512 8 64 1)")
    ap.add_argument("--tf-dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--checkpoint", action="store_true",
                    help="transformer benchmark with activation checkpointing")
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
        if args.what in ("transformer", "all"):
            say("")
            report["transformer"] = bench_transformer(world, args.tf_shape,
                                                      np.dtype(args.tf_dtype), args.repeats,
                                                      args.checkpoint, say)
        if args.json and rank == 0:
            write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
