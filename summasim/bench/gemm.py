"""``bench gemm``: GFLOP/s of every distributed product that fits p, on n x n x n, next to
the ceiling: the single-process GEMM rate on this machine with all its cores, measured in
the same run by rank 0 while the other ranks sleep (they wait without spinning, so they
do not steal its cores). The ceiling is re-measured right before each algorithm and the
ratio uses that adjacent value, because the machine's speed drifts (it is shared).

Each row is marked with the load of other processes while its ceiling and its product
ran (:class:`~summasim.harness.load.LoadWatch`, column ``load``): a ceiling measured
under load is too low, and its "% ceiling" too high (above 100% here at n = 4096 on a
busy machine), so such rows say so, in the table, in a warning and in the JSON
(``load``, ``quiet``, ``ceiling_under_load``).

After summasim's products, ScaLAPACK's PDGEMM runs as a peer on the same blocks, check
and timer (:mod:`~summasim.bench.pdgemm`; NumPy backend, square p, where ScaLAPACK is
installed, else one line says why not): row ``pdgemm``, ``"peer": True`` in the JSON."""

from __future__ import annotations

import numpy as np

from .. import cli
from ..algorithms.table import PRODUCTS
from .common import add_backend, add_json, add_repeats, given, quiet_bcast, repeats

GEMM_ALGORITHMS = PRODUCTS
DEFAULT_N = 4096


#: Largest ``--n``: n x n float64 operands of 2^20 are 8 TiB, beyond any node here.
MAX_N = 1 << 20


def add_arguments(ap, every: bool = False):
    """gemm's own options (``every``: as ``bench all`` shares them)."""
    ap.add_argument("--n", type=cli.int_between(1, MAX_N), default=DEFAULT_N,
                    help=f"GEMM size n, 1 to {MAX_N} (default {DEFAULT_N}); the memory "
                         f"preflight refuses an n whose blocks would not fit and says what "
                         f"would")
    ap.add_argument("--algorithms", type=cli.choice_list(GEMM_ALGORITHMS, "algorithm"),
                    default=list(GEMM_ALGORITHMS), metavar="NAME,...",
                    help="comma-separated distributed products to time (default all)")
    if not every:
        from ..options import add_dtype

        add_dtype(ap)
        add_backend(ap, "the products (cupy: the ceiling is one process's CuPy rate)")
        add_repeats(ap)
        add_json(ap)


def ceiling_gflops(n: int, dtype, repeats: int, threads: int | None = None,
                   backend=None) -> float:
    """Single-process GEMM rate (GFLOP/s) at n x n x n: NumPy with ``threads`` BLAS
    threads (default all cores), or the backend's own matmul on its device (CuPy: this
    rank's GPU, each product waited for); one warm-up product, then the median of
    ``repeats`` (:func:`~summasim.harness.timing.time_calls`, serial)."""
    from threadpoolctl import threadpool_limits

    from ..comm import cores
    from ..harness.timing import time_calls

    rng = np.random.default_rng(0)
    host = [rng.standard_normal((n, n)).astype(dtype) for _ in range(2)]
    device = backend is not None and backend.name == "cupy"
    xp = backend.xp if device else np
    a, b = (backend.asarray(h) for h in host) if device else host
    c = xp.empty((n, n), dtype)

    def product():
        xp.matmul(a, b, out=c)
        if device:
            backend.synchronize()

    with threadpool_limits(limits=threads or cores()):   # warm-up: also CuPy's kernel choice
        median = time_calls(product, None, repeats, adaptive=False, warmup=1)["median"]
    return 2.0 * n**3 / median / 1e9


def bench_gemm(world, n: int, dtype, repeats: int, algorithms, say,
               backend=None) -> list[dict]:
    """Time each distributed product on the grids that fit (validated first, with the
    main job's check: exact or Freivalds by its cost) on ``backend`` (default NumPy),
    then ScaLAPACK's PDGEMM as a peer where it runs (:func:`_pdgemm_rows`); return
    result rows."""
    from ..backends import get_backend
    from ..harness.execute import run_product
    from ..harness.load import LoadWatch, combine, mark, warning
    from ..harness.plan import plan_products
    from ..harness.report import words_over_bound

    backend = backend or get_backend("numpy")
    p, rank = world.Get_size(), world.Get_rank()
    say("ceiling: single-process " + ("CuPy GEMM on rank 0's GPU" if backend.name == "cupy"
                                       else "NumPy GEMM, all cores")
        + f", n = {n}, {np.dtype(dtype).name}, measured before each algorithm")
    say(f"{'algorithm':<14} {'grid':<9} {'n':>6} {'median s':>9} {'best s':>8} "
        f"{'GFLOP/s':>8} {'ceiling':>8} {'% ceiling':>9} {'best %':>7} {'words/LB':>9}  "
        f"{'check':<15} load")
    cases, skips = plan_products(p, algorithms, (n, n, n), None, [np.dtype(dtype).name])
    for sk in skips:
        say(f"{sk.name:<14} skipped: {sk.reason}")
    rows = []
    watch = LoadWatch(world)
    for case in cases:
        watch.lap()                      # the load of this row: its ceiling and product
        ceiling = quiet_bcast(world, ceiling_gflops(n, dtype, repeats, backend=backend)
                              if rank == 0 else None)
        # the main job's check: exact while the reference costs at most 4 GFLOP per rank
        # (Freivalds alone passed blocks 100x past the per-entry bound at n = 256)
        res = run_product(case, world, backend, repeats=repeats, method="auto")
        spans = res.timing["spans"]
        t, best = res.seconds, min(spans)
        gf, gf_best = 2.0 * n**3 / t / 1e9, 2.0 * n**3 / best / 1e9
        label = case.grid_label()
        load = world.bcast(watch.lap(), root=0)
        lb = words_over_bound(res)            # words per rank over the lower bounds
        ratio = "-" if lb["ratio"] is None else f"{lb['ratio']:.2f}"
        rows.append({"algorithm": case.algorithm, "grid": label, "n": n, "lower_bounds": lb,
                     "dtype": case.dtype, "seconds": t, "times": spans, "ok": res.ok,
                     "check": {"method": res.check.method, "error": res.check.error,
                               "bound": res.check.bound,
                               "false_pass": res.check.false_pass or None},
                     "gflops": gf, "ceiling_gflops": ceiling, "fraction": gf / ceiling,
                     "best_fraction": gf_best / ceiling, "load": load,
                     "quiet": load and load["quiet"],
                     "ceiling_under_load": bool(load and load["quiet"] is False)})
        say(f"{case.algorithm:<14} {label:<9} {n:>6} {t:>9.4f} {best:>8.4f} {gf:>8.1f} "
            f"{ceiling:>8.1f} {100 * gf / ceiling:>8.1f}% {100 * gf_best / ceiling:>6.1f}% "
            f"{ratio:>9}  {('OK ' if res.ok else 'FAIL ') + res.check.method:<15} "
            f"{mark(load)}")
    rows += _pdgemm_rows(world, n, dtype, repeats, say, backend, watch)
    busy = [r for r in rows if r["ceiling_under_load"]]
    line = warning(combine(r["load"] for r in busy),
                   f"{len(busy)} of {len(rows)} products and their ceilings were measured "
                   f"(rows marked BUSY)", "their ceilings were measured under load, so "
                   "their % ceiling is not the algorithm's")
    if line:
        say(line)
    return rows


def _pdgemm_rows(world, n: int, dtype, repeats: int, say, backend, watch) -> list[dict]:
    """ScaLAPACK's PDGEMM on the same blocks, timer and check as the products
    (:mod:`~summasim.bench.pdgemm`), its ceiling measured right before it: one row,
    ``"peer": True``, or none and one line saying why it was skipped (host backend
    only; ScaLAPACK optional)."""
    from ..harness.load import mark
    from .pdgemm import available, pdgemm_peer

    why = (f"the ScaLAPACK peer runs with --backend numpy only, not {backend.name}"
           if backend.name != "numpy" else available(world, n, dtype).reason)
    if why:
        say(f"{'pdgemm':<14} skipped: {why}")
        return []
    rank = world.Get_rank()
    watch.lap()
    ceiling = quiet_bcast(world, ceiling_gflops(n, dtype, repeats) if rank == 0 else None)
    res = pdgemm_peer(world, n, dtype, repeats, method="auto")     # the products' check
    load = world.bcast(watch.lap(), root=0)
    if res.reason:
        say(f"{'pdgemm':<14} skipped: {res.reason}")
        return []
    lib = res.library
    say(f"pdgemm (ScaLAPACK): a peer, not summasim: {lib.path}"
        + (f" (its {', '.join(lib.relinked)} relinked to mpi4py's "
           f"{', '.join(sorted(set(lib.relinked.values())))})" if lib.relinked else "")
        + (f", BLAS {lib.blas}" if lib.blas else ""))
    spans = res.timing["spans"]
    t, best = res.seconds, min(spans)
    gf, gf_best = 2.0 * n**3 / t / 1e9, 2.0 * n**3 / best / 1e9
    say(f"{'pdgemm':<14} {res.grid:<9} {n:>6} {t:>9.4f} {best:>8.4f} {gf:>8.1f} "
        f"{ceiling:>8.1f} {100 * gf / ceiling:>8.1f}% {100 * gf_best / ceiling:>6.1f}% "
        f"{'-':>9}  {('OK ' if res.ok else 'FAIL ') + res.check.method:<15} {mark(load)}")
    return [{"algorithm": "pdgemm", "peer": True, "label": "pdgemm (ScaLAPACK)",
             "library": lib.path, "relinked": lib.relinked, "blas": lib.blas,
             "grid": res.grid, "n": n, "lower_bounds": None,
             "dtype": np.dtype(dtype).name, "seconds": t, "times": spans, "ok": res.ok,
             "gflops": gf, "ceiling_gflops": ceiling, "fraction": gf / ceiling,
             "best_fraction": gf_best / ceiling, "load": load,
             "quiet": load and load["quiet"],
             "ceiling_under_load": bool(load and load["quiet"] is False)}]


def preflight(args, world, gpu) -> str:
    """Each product's memory on this node (and GPU), rank 0."""
    from ..comm import local_ranks
    from ..harness.memory import check_fits, check_node_and_gpu
    from ..harness.plan import plan_products

    cases, _ = plan_products(world.Get_size(), args.algorithms, (args.n,) * 3, None,
                             [given(args, "dtype", "float64")])
    for case in cases:
        why = check_node_and_gpu(
            lambda n, c=case, **kw: check_fits(c, n, "auto", **kw), local_ranks(), gpu)
        if why:
            return why
    return ""


def run(bench) -> bool:
    """Time the products; rows under ``report["gemm"]``, their load under
    ``report["load"]["gemm"]``; True when all checked OK."""
    from ..harness.report import mark_report

    args = bench.args
    dtype = np.dtype(given(args, "dtype", "float64"))
    rows = bench_gemm(bench.world, args.n, dtype, repeats(args), args.algorithms, bench.say,
                      bench.backend)
    bench.report["gemm"] = rows
    mark_report(bench.report, "gemm", [r["load"] for r in rows])
    return all(r["ok"] for r in rows)

