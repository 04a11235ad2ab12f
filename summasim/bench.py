"""Benchmarks: ``mpirun -n P python -m summasim.bench [gemm|allreduce|all]``.

``gemm``       GFLOP/s of every distributed product that fits p, on n x n x n, next to
               the ceiling: the single-process NumPy GEMM rate on this machine with all
               its cores, measured in the same run by rank 0 while the other ranks
               sleep (they wait without spinning, so they do not steal its cores). The
               ceiling is re-measured right before each algorithm and the ratio uses
               that adjacent value, because the machine's speed drifts (it is shared).
``allreduce``  ``ring_allreduce`` next to the plain mpi4py ring
               (:func:`plain_ring_allreduce`) and MPI's own ``Allreduce`` on the same
               buffers, 64 KiB to 64 MiB, with the ratios and the cost model's
               prediction for the ring, and the host memory throughput of all ranks
               at once before and after (:func:`node_memory_gibs`; on a shared VM it
               changes from launch to launch, and the largest sizes follow it). Each
               size's prediction prices its memory floor at the throughput read in
               every round of its repeats (the median).
``ring-steps`` where a ring all-reduce's time goes: per step, inside MPI and outside.
``transformer`` forward + backward time of each tensor-parallel scheme that fits p, on a
               one-layer model (default b=16, s=128, h=512, n=8, v=64, float32), next to
               the serial model on the same cores (rank 0 alone, all cores, the others
               asleep): the same total work, so the ratio is the parallel overhead.
``mesh``       one training step (every micro-batch's forward and backward, the gradient
               reduction, Adam) of each sharded-training composition (``--mesh``, or the
               defaults that fit p) next to pure tensor parallelism of the same scheme on
               all p ranks (the same model, global batch and engine), with the cost
               model's prediction for both.

Speed goals live here, not in timed tests. Results go to the terminal and, with
``--json``, to a file (written atomically).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from .algorithms.table import PRODUCTS
from .harness.frontend import Parser, UserError, check_outputs, mpi_main

GEMM_ALGORITHMS = PRODUCTS
DEFAULT_REPEATS = 3
ALLREDUCE_REPEATS = 9          # the least: a 96.1% interval of the paired ratios
ALLREDUCE_MAX_REPEATS = 39     # the most a size gets when --repeats is not given ...
ALLREDUCE_BUDGET_S = 3.0       # ... within about this many seconds of timed calls
# Peak bytes per rank of one all-reduce size, in messages: the rank's data, the reference
# sum, the result, MPI's own temporary and the check's. Measured (peak RSS over the ~120 MiB
# an idle rank holds) at 256 MiB: 6.3 messages on 2 ranks, 6.1 on 4; ring-steps: 2.1. With
# the huge-page buffers (whose slack is never touched) 6.8 messages on 2 ranks counting the
# idle rank and the node-memory probe's arrays, the same with --np-empty (2026-11-26).
ALLREDUCE_MESSAGES = 7
RING_STEPS_MESSAGES = 3
# The node-memory probe's arrays (MiB per array, two per rank): past any CPU's last-level
# cache per rank, so that the probe measures DRAM.
NODE_MEMORY_MIB = 32
#: additions of the memory reading in each round of an all-reduce size's repeats
#: (about 75 ms at p = 16 on this VM)
MEMORY_ROUND_ADDS = 2


def _quiet_bcast(world, value):
    """Broadcast rank 0's value after a barrier that waits without spinning (the
    other ranks idle while rank 0 measures with all cores)."""
    from .mpiutil import quiet_barrier

    quiet_barrier(world)
    return world.bcast(value, root=0)


def ceiling_gflops(n: int, dtype, repeats: int, threads: int | None = None,
                   backend=None) -> float:
    """Single-process GEMM rate (GFLOP/s) at n x n x n: NumPy with ``threads`` BLAS
    threads (default all cores), or the backend's own matmul on its device (CuPy: this
    rank's GPU, each product waited for)."""
    from threadpoolctl import threadpool_limits

    from .comm import cores

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

    with threadpool_limits(limits=threads or cores()):
        product()  # warm-up (and CuPy's kernel choice)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            product()
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def node_memory_gibs(world, mib: float = NODE_MEMORY_MIB, adds: int = 8, probe=None,
                     node=None) -> float:
    """The memory throughput of a node's ranks all at once, now, the slowest node's
    (GiB/s, collective; :meth:`~summasim.costmodel.fit.MemoryProbe.read_nodes`, on
    ``probe``'s arrays, else new ones of ``mib`` MiB; ``node``: ``world`` split by
    shared memory, else split here). On a shared VM this changes
    from launch to launch by up to 1.7x while a cache-resident add changes by 1.2x, and
    a large ring all-reduce's time follows it (docs/performance.md); the all-reduce
    benchmark reports it before and after its sizes so that a slow launch can be told
    from a slow ring, and prices the prediction's memory floor with it."""
    from mpi4py import MPI

    from .costmodel.fit import MemoryProbe

    probe = probe or MemoryProbe(int(mib * 2**20))
    mine = node is None
    node = world.Split_type(MPI.COMM_TYPE_SHARED) if mine else node
    try:
        return probe.read_nodes(world, node, adds) / 2**30
    finally:
        if mine:
            node.Free()


def _bench_memory_terms(what: str) -> tuple[int, int]:
    """``(messages held per rank, fixed bytes)`` of ``allreduce`` or ``ring-steps``."""
    if what == "allreduce":
        return ALLREDUCE_MESSAGES, 2 * NODE_MEMORY_MIB << 20
    return RING_STEPS_MESSAGES, 0


def bench_bytes(what: str, sizes_mib) -> int:
    """Peak bytes per rank of ``allreduce`` or ``ring-steps`` at the largest of
    ``sizes_mib`` (:data:`ALLREDUCE_MESSAGES`, :data:`RING_STEPS_MESSAGES`; the ring's
    receive chunk, ``1 / p`` of a message, is within them), with the node-memory probe's
    arrays for ``allreduce``."""
    per, fixed = _bench_memory_terms(what)
    return int(per * max(sizes_mib) * 2**20) + fixed


def check_bench_fits(what: str, sizes_mib, ranks_on_node: int,
                     available: int | None = None, device: bool = False) -> str:
    """"" when ``what``'s largest message fits this node's memory, else the message
    that says what it needs, what can be used and the largest size that would fit.
    ``device=True``: one GPU's free memory (``available``) shared by ``ranks_on_node``
    ranks instead."""
    from .harness.memory import HEADROOM, places, available_bytes

    avail = available_bytes() if available is None else available
    budget = int(HEADROOM * avail)
    per = bench_bytes(what, sizes_mib)
    if ranks_on_node * per <= budget:
        return ""
    messages, fixed = _bench_memory_terms(what)
    most = max(0, budget // ranks_on_node - fixed) / (messages * 2**20)
    each, where, pool = places(device)
    return (f"{what} at {max(sizes_mib):g} MiB needs about {per / 2**30:.2f} GiB {each}, "
            f"{ranks_on_node * per / 2**30:.1f} GiB for {ranks_on_node} ranks {where}, "
            f"but {budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
            f"{avail / 2**30:.1f} GiB {pool}); the largest size that fits is about "
            f"{most:.4g} MiB")


def bench_gemm(world, n: int, dtype, repeats: int, algorithms, say,
               backend=None) -> list[dict]:
    """Time each distributed product on the grids that fit (validated first, with the
    harness's Freivalds check) on ``backend`` (default NumPy); return result rows."""
    from .backends import get_backend
    from .harness.execute import run_product
    from .harness.plan import plan_products

    backend = backend or get_backend("numpy")
    p, rank = world.Get_size(), world.Get_rank()
    say("ceiling: single-process " + ("CuPy GEMM on rank 0's GPU" if backend.name == "cupy"
                                       else "NumPy GEMM, all cores")
        + f", n = {n}, {np.dtype(dtype).name}, measured before each algorithm")
    say(f"{'algorithm':<14} {'grid':<9} {'n':>6} {'median s':>9} {'best s':>8} "
        f"{'GFLOP/s':>8} {'ceiling':>8} {'% ceiling':>9} {'best %':>7}  check")
    cases, skips = plan_products(p, algorithms, (n, n, n), None, [np.dtype(dtype).name])
    for sk in skips:
        say(f"{sk.name:<14} skipped: {sk.reason}")
    rows = []
    for case in cases:
        ceiling = _quiet_bcast(world, ceiling_gflops(n, dtype, repeats, backend=backend)
                               if rank == 0 else None)
        res = run_product(case, world, backend, repeats=repeats, method="freivalds")
        spans = res.timing["spans"]
        t, best = res.seconds, min(spans)
        gf, gf_best = 2.0 * n**3 / t / 1e9, 2.0 * n**3 / best / 1e9
        label = case.grid_label()
        rows.append({"algorithm": case.algorithm, "grid": label, "n": n,
                     "dtype": case.dtype, "seconds": t, "times": spans, "ok": res.ok,
                     "gflops": gf, "ceiling_gflops": ceiling, "fraction": gf / ceiling,
                     "best_fraction": gf_best / ceiling})
        say(f"{case.algorithm:<14} {label:<9} {n:>6} {t:>9.4f} {best:>8.4f} {gf:>8.1f} "
            f"{ceiling:>8.1f} {100 * gf / ceiling:>8.1f}% {100 * gf_best / ceiling:>6.1f}%  "
            f"{'OK' if res.ok else 'FAIL'}")
    return rows


def plain_ring_allreduce(x, out, comm, sync=None):
    """The baseline: a 20-line ring all-reduce in plain mpi4py (``MPI_Sendrecv`` and an
    in-place add, no workspace reuse, no wait policy, no trace), what a user would write
    first. ``comm`` is a raw mpi4py communicator; ``x`` and ``out`` are 1-D arrays of
    one array module (device arrays only with a CUDA-aware MPI, and then ``sync``, the
    stream's synchronize, runs before every ``Sendrecv``)."""
    from .algorithms import chunk_bounds
    from .backends import array_module

    p, r = comm.Get_size(), comm.Get_rank()
    out[...] = x
    bounds = chunk_bounds(out.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    work = array_module(out).empty(bounds[0][1] - bounds[0][0], out.dtype)
    sync = sync or (lambda: None)
    for s in range(p - 1):
        s0, s1 = bounds[(r - s) % p]
        r0, r1 = bounds[(r - s - 1) % p]
        sync()
        comm.Sendrecv(out[s0:s1], right, recvbuf=work[:r1 - r0], source=left)
        out[r0:r1] += work[:r1 - r0]
    for s in range(p - 1):
        s0, s1 = bounds[(r + 1 - s) % p]
        r0, r1 = bounds[(r - s) % p]
        sync()
        comm.Sendrecv(out[s0:s1], right, recvbuf=out[r0:r1], source=left)
    return out


def ring_prediction(n: int, dtype, p: int, machine, blocking_limit: int = 0) -> float:
    """The cost model's time of ``ring_allreduce`` of n items on p ranks (the slowest
    rank, shared-core model), from the closed-form messages of every rank. Steps are
    priced as exchanger steps (``Event.blocking``: the receive alone awaited, yielding
    or napping) where ``Comm`` takes that path: every step when the largest chunk has
    fewer than ``blocking_limit`` bytes (``Comm.exchanger`` decides once per loop),
    else each step below the limit (``Comm.sendrecv`` decides per message); the others
    as waits of the wait policy."""
    from .costmodel.accuracy import predict_result
    from .costmodel.traffic import algorithm_messages
    from .harness.cases import RingCase

    it = np.dtype(dtype).itemsize
    every = -(-n // p) * it < blocking_limit
    events = [[[mc.op, "world", mc.group_size, mc.nbytes, mc.count,
                every or mc.nbytes < blocking_limit]
               for mc in algorithm_messages("ring_allreduce", count=n, p=p, coords=r,
                                            itemsize=it)] for r in range(p)]
    res = dict(RingCase(n, np.dtype(dtype).name).to_dict(), p=p, events=events,
               coords=[[r] for r in range(p)])
    return predict_result(res, machine)


def _rotated(names: list, i: int) -> list:
    """``names`` rotated by ``i``: repeat i of an interleaved benchmark starts with the
    i-th entry, so that each contender takes each place in the order equally often (the
    first call after the timing barrier measured 2-10% slower than the same call in
    second place, at p = 2 and 4 below 1 MiB)."""
    k = i % len(names)
    return names[k:] + names[:k]


def paired_ratio(base, ours, confidence: float = 0.95) -> dict:
    """How much faster ``ours`` is than ``base`` from paired timings: repeat i of each
    ran back to back on the same machine state, so the ratios ``base[i] / ours[i]``
    cancel the drift between repeats. Returns the median ratio, a distribution-free
    interval for it (order statistics of the ratios, the sign test's interval:
    ``low``/``high`` None when there are too few repeats for ``confidence``; 6 give
    96.9%), the interval's real coverage, and a verdict: "faster" (low > 1), "slower"
    (high < 1), "tie" (the interval holds 1: the difference is within the noise), or
    None without an interval."""
    from scipy.stats import binom

    ratios = sorted(b / o for b, o in zip(base, ours))
    n = len(ratios)
    if n == 0:
        raise ValueError("paired_ratio: no timings")
    k = int(binom.ppf((1 - confidence) / 2, n, 0.5))   # the k-th smallest is the low end
    low, high, coverage = None, None, None
    if k >= 1:
        low, high = float(ratios[k - 1]), float(ratios[n - k])
        coverage = float(1 - 2 * binom.cdf(k - 1, n, 0.5))
    verdict = (None if low is None else "tie" if low <= 1 <= high
               else "faster" if low > 1 else "slower")
    return {"median": float(statistics.median(ratios)), "low": low, "high": high,
            "coverage": coverage, "verdict": verdict}


#: issue 12's targets: at least as fast as the plain ring from 64 KiB, faster than MPI
#: from 4 MiB, the prediction within 10% from 1 MiB (at p = 16; reported at every p)
TARGETS = {"plain_from_mib": 0.0625, "mpi_from_mib": 4.0, "prediction_from_mib": 1.0,
           "prediction_tolerance": 0.10}


def allreduce_targets(rows, p: int) -> dict:
    """Which of :data:`TARGETS` the rows of one ``bench allreduce`` run meet: per target
    the sizes it applies to and how many of them meet it. "vs plain" is met where the
    ring is not slower (faster, or a tie within the paired interval; without an
    interval, where the median ratio is at least 1), "vs MPI" only where it is faster
    (the paired interval above 1; without an interval, the median paired ratio above
    1): both judged on the paired per-repeat ratios, which cancel the drift between
    repeats that the ratio of the two medians keeps."""
    def sizes(frm):
        return [r for r in rows if r["mib"] >= frm]

    plain = sizes(TARGETS["plain_from_mib"])
    mpi = sizes(TARGETS["mpi_from_mib"])
    pred = [r for r in sizes(TARGETS["prediction_from_mib"]) if r["predicted"] is not None]
    tol = TARGETS["prediction_tolerance"]
    return {"p": p,
            "vs_plain": {"sizes": len(plain),
                         "met": sum(_not_slower(r["vs_plain_paired"]) for r in plain),
                         "faster": sum(r["vs_plain_paired"]["verdict"] == "faster"
                                       for r in plain)},
            "vs_mpi": {"sizes": len(mpi), "met": sum(_faster(r["vs_mpi_paired"]) for r in mpi)},
            "prediction": {"sizes": len(pred),
                           "met": sum(abs(r["prediction_error"]) <= tol for r in pred)}}


def _not_slower(r: dict) -> bool:
    return r["median"] >= 1 if r["verdict"] is None else r["verdict"] != "slower"


def _faster(r: dict) -> bool:
    return r["median"] > 1 if r["verdict"] is None else r["verdict"] == "faster"


def _contenders(backend, comm, raw, x, out) -> dict:
    """The three all-reduces of ``x`` into ``out`` as calls that return when the result
    is there (device work waited for). On the host the plain ring and ``MPI_Allreduce``
    get the arrays themselves; with a CUDA-aware MPI ("direct") the device arrays, the
    stream synchronized before each MPI call; without one ("staged") what a user would
    write first: copy the vector into a pinned host buffer, all-reduce it there, copy
    the sum back. summasim's ring does the same below ``STAGE_WHOLE_BYTES`` (16 MiB), with
    its own host ring, and from there stages per step (``Comm``) and adds on the device."""
    from mpi4py import MPI

    from .algorithms import ring_allreduce

    mode = backend.comm_mode
    sync = backend.synchronize

    def plain(a, b):
        plain_ring_allreduce(a, b, raw, sync if mode == "direct" else None)

    def mpi(a, b):
        raw.Allreduce(a, b, op=MPI.SUM)

    def done(f, a, b):
        def call():
            if mode != "host":
                sync()
            f(a, b)
            if mode != "host":
                sync()
        return call

    def staged(f):
        def call():
            sync()
            backend.copy_to_host(x, hx)
            f(hx, hout)
            backend.copy_from_host(hout, out)
            sync()
        return call

    if mode == "staged":          # one pair of pinned buffers for both baselines
        hx = backend.pinned_empty(x.nbytes).view(x.dtype)[:x.size]
        hout = backend.pinned_empty(out.nbytes).view(out.dtype)[:out.size]
        base = {"plain": staged(plain), "mpi": staged(mpi)}
    else:
        base = {"plain": done(plain, x, out), "mpi": done(mpi, x, out)}
    return {"ring": done(lambda a, b: ring_allreduce(a, comm, out=b), x, out), **base}


def allreduce_repeats(seconds_per_repeat: float, least: int | None = None,
                      most: int | None = None, budget: float | None = None,
                      step: int = 3) -> int:
    """Repeats of one size of ``bench allreduce`` when ``--repeats`` is not given (pure):
    as many as fit ``budget`` seconds (:data:`ALLREDUCE_BUDGET_S`) at
    ``seconds_per_repeat`` (one call of each contender), at least ``least``
    (:data:`ALLREDUCE_REPEATS`) and at most ``most`` (:data:`ALLREDUCE_MAX_REPEATS`), in
    steps of ``step`` from ``least`` (the contenders, so that each takes each place in
    the rotated order equally often). A short call is noisy here (its paired ratios
    spread by 20-40% at 8 ranks per core) but cheap, so it gets more repeats: the
    sign-test interval of 9 repeats runs from the 2nd to the 8th of the sorted ratios,
    that of 39 from the 13th to the 27th. The count depends on the calls' total duration
    only, which is the same whichever contender was faster in each pair, so stopping
    does not bias the verdict."""
    least = ALLREDUCE_REPEATS if least is None else least
    most = ALLREDUCE_MAX_REPEATS if most is None else most
    budget = ALLREDUCE_BUDGET_S if budget is None else budget
    if least < 1 or most < least or budget < 0 or step < 1:
        raise ValueError(f"allreduce_repeats: need 1 <= least <= most, budget >= 0 and "
                         f"step >= 1, got least={least}, most={most}, budget={budget}, "
                         f"step={step}")
    fit = most if not seconds_per_repeat > 0 else int(budget / seconds_per_repeat)
    fit = max(least, min(most, fit))
    return fit - (fit - least) % step


def _message_buffers(backend, hx, huge: bool = True):
    """``(x, out)``: ``hx``'s values and an output buffer, as ``backend``'s arrays;
    with ``huge``, host arrays from a huge page up lie on transparent huge pages from
    end to end (:func:`~summasim.backends.numpy_backend.empty_huge`), so that their page
    backing, worth 15-55% of a memory-bound all-reduce here, is the same in every
    launch."""
    make = backend.empty_huge if huge else backend.empty
    x = make(hx.shape, hx.dtype)
    x[...] = backend.asarray(hx)
    return x, make(hx.shape, hx.dtype)


def bench_allreduce(world, sizes_mib, dtype, repeats: int | None, say, machine=None,
                    backend=None, huge: bool = True, memory=None) -> list[dict]:
    """summasim's ring_allreduce, the plain mpi4py ring and MPI's Allreduce on the same
    buffers (``backend``'s arrays, default NumPy; see :func:`_contenders`; on huge
    pages unless ``huge`` is false: :func:`_message_buffers`), interleaved
    call by call (median spans), with the cost model's prediction for the ring when a
    ``machine`` is given. Each contender's result is checked against MPI's on the host
    on every size. ``repeats`` None: per size by :func:`allreduce_repeats`, from the
    median duration of its first :data:`ALLREDUCE_REPEATS` repeats.

    ``memory``: a short collective reading of the node's memory throughput (GiB/s),
    taken in every round of the interleaved repeats, after the three contenders, at
    the sizes whose data (x, out and a receive chunk on every rank of a node) outgrows
    ``machine.cache_bytes`` (where the floor can count). Each such size's prediction
    then prices its memory floor at the median of its rounds' readings (the memory the
    size ran on: on a shared VM it drifts within a launch; priced with readings taken
    only before and after the sizes, the 64 MiB ring at p = 16 came out 11% and 14% low
    in two launches), and its row keeps them (``memory_gibs``: the median;
    ``memory_readings``)."""
    from mpi4py import MPI

    from .backends import get_backend
    from .comm import Comm
    from .costmodel.traffic import ring_working_set
    from .harness.timing import time_calls
    from .mpiutil import agreement

    backend = backend or get_backend("numpy")
    p = world.Get_size()
    comm = Comm(world.Dup(), name="world", backend=backend)
    comm.trace.enabled = False
    raw = world.Dup()
    say(f"{'MiB':>8} {'ring ms':>9} {'plain ms':>9} {'MPI ms':>9} {'vs plain':>9} "
        f"{'95% interval':>13} {'':>6} {'vs MPI':>8} {'95% interval':>13} {'':>6} "
        f"{'ring GB/s':>10} {'pred ms':>9} {'pred err':>9} {'mem GiB/s':>10} {'reps':>5}  "
        f"check")
    rows = []
    try:
        for mib in sizes_mib:
            count = max(1, int(mib * 2**20) // np.dtype(dtype).itemsize)
            hx = np.random.default_rng(world.Get_rank()).standard_normal(count).astype(dtype)
            ref = np.empty_like(hx)
            world.Allreduce(hx, ref, op=MPI.SUM)
            tol = 8 * np.sqrt(p) * np.finfo(hx.dtype).eps * max(1.0, float(np.abs(ref).max()))
            x, out = _message_buffers(backend, hx, huge)
            del hx                            # its values are in x: one message less held
            calls = _contenders(backend, comm, raw, x, out)
            good = True
            for k in calls:                   # each checked once, the ring agreed too
                out[...] = 0
                calls[k]()
                good &= bool(np.allclose(backend.to_numpy(out), ref, rtol=0, atol=p * tol))
            ok = bool(world.allreduce(good, op=MPI.LAND))
            t = {"ring": [], "plain": [], "mpi": []}
            # interleaved, so that all see the same machine state; without --repeats, the
            # first ALLREDUCE_REPEATS size the rest by their duration (the same spans on
            # every rank, so every rank takes the same count)
            reps, i = ALLREDUCE_REPEATS if repeats is None else repeats, 0
            readings = []
            spill = machine is not None and not machine.fits_cache(
                machine.ranks_per_node(p), ring_working_set(count, p, np.dtype(dtype).itemsize))
            while i < reps:
                with agreement(False):
                    for k in _rotated(list(calls), i):
                        t[k] += time_calls(calls[k], world, 1, adaptive=False)["spans"]
                if memory is not None and spill:
                    readings.append(memory())
                i += 1
                if repeats is None and i == ALLREDUCE_REPEATS:
                    reps = allreduce_repeats(statistics.median(
                        sum(t[k][j] for k in t) for j in range(i)), step=len(calls))
            tr, tp, tm = (statistics.median(t[k]) for k in ("ring", "plain", "mpi"))
            nbytes = count * np.dtype(dtype).itemsize
            mem = statistics.median(readings) if readings else None
            priced = machine
            if machine is not None and mem is not None:
                priced = machine.replace(memory_bandwidth=mem * 2**30)
            pred = (ring_prediction(count, dtype, p, priced, comm.blocking_limit)
                    if machine is not None else None)
            vp, vm = paired_ratio(t["plain"], t["ring"]), paired_ratio(t["mpi"], t["ring"])
            rows.append({"mib": mib, "bytes": nbytes, "ring_seconds": tr, "plain_seconds": tp,
                         "mpi_seconds": tm, "ring_times": t["ring"], "plain_times": t["plain"],
                         "mpi_times": t["mpi"], "ring_gbps": nbytes / tr / 1e9,
                         "mpi_gbps": nbytes / tm / 1e9, "ratio": tm / tr,
                         "vs_plain": tp / tr, "vs_plain_paired": vp, "vs_mpi_paired": vm,
                         "predicted": pred, "ok": ok, "repeats": reps, "memory_gibs": mem,
                         "memory_readings": readings,
                         "prediction_error": None if pred is None else (pred - tr) / tr})
            say(f"{mib:>8g} {1e3 * tr:>9.3f} {1e3 * tp:>9.3f} {1e3 * tm:>9.3f} "
                f"{tp / tr:>8.2f}x {_interval(vp):>13} {vp['verdict'] or '-':>6} "
                f"{tm / tr:>7.2f}x {_interval(vm):>13} {vm['verdict'] or '-':>6} "
                f"{nbytes / tr / 1e9:>10.2f} "
                + (f"{1e3 * pred:>9.3f} {100 * (pred - tr) / tr:>+8.1f}%" if pred is not None
                   else f"{'-':>9} {'-':>9}")
                + (f" {mem:>10.1f}" if mem is not None else f" {'-':>10}")
                + f" {reps:>5}  {'OK' if ok else 'FAIL'}")
    finally:
        comm.mpi.Free()
        raw.Free()
    say("vs plain / vs MPI: their median time over the ring's (> 1: the ring is faster); "
        "95% interval: of the median of the paired per-repeat ratios (faster/slower: the "
        "interval excludes 1; tie: the difference is within the noise)")
    tg = allreduce_targets(rows, p)
    say(f"targets at p = {p}: not slower than the plain ring at {tg['vs_plain']['met']}/"
        f"{tg['vs_plain']['sizes']} sizes from 64 KiB ({tg['vs_plain']['faster']} faster); "
        f"faster than MPI at {tg['vs_mpi']['met']}/{tg['vs_mpi']['sizes']} from 4 MiB"
        + (f"; prediction within 10% at {tg['prediction']['met']}/"
           f"{tg['prediction']['sizes']} from 1 MiB" if tg["prediction"]["sizes"] else ""))
    return rows


def _interval(r: dict) -> str:
    """``[low, high]`` of a :func:`paired_ratio`, or "-" with too few repeats."""
    return "-" if r["low"] is None else f"[{r['low']:.2f},{r['high']:.2f}]"


def bench_ring_steps(world, sizes_mib, dtype, repeats: int, say,
                     huge: bool = True) -> list[dict]:
    """Where a ring all-reduce's time goes: one traced call split into each step's
    seconds inside MPI (the trace's sendrecv events) and the time outside them (adds,
    copies, Python), median over ``repeats`` calls and then over the ranks (buffers as
    in :func:`bench_allreduce`)."""
    from .algorithms import ring_allreduce
    from .backends import get_backend
    from .comm import Comm
    from .mpiutil import agreement, quiet_barrier

    p = world.Get_size()
    comm = Comm(world.Dup(), name="world")
    rows = []
    say(f"{'MiB':>8} {'call ms':>9} {'in MPI ms':>10} {'share':>6} {'outside ms':>11} "
        f"{'RS step ms':>11} {'(min-max)':>17} {'AG step ms':>11} {'(min-max)':>17}")
    try:
        for mib in sizes_mib:
            count = max(1, int(mib * 2**20) // np.dtype(dtype).itemsize)
            x, out = _message_buffers(get_backend("numpy"), np.random.default_rng(
                world.Get_rank()).standard_normal(count).astype(dtype), huge)
            ring_allreduce(x, comm, out=out)
            calls, steps = [], []
            with agreement(False):
                for _ in range(repeats):
                    comm.trace.clear()
                    quiet_barrier(world)
                    t0 = time.perf_counter()
                    ring_allreduce(x, comm, out=out)
                    calls.append(time.perf_counter() - t0)
                    steps.append([e.seconds for e in comm.trace.events])
            mine = (statistics.median(calls), statistics.median(sum(st) for st in steps),
                    [statistics.median(st[i] for st in steps) for i in range(2 * (p - 1))])
            every = world.allgather(mine)
            call = statistics.median(e[0] for e in every)
            in_mpi = statistics.median(e[1] for e in every)
            per = [statistics.median(e[2][i] for e in every) for i in range(2 * (p - 1))]
            rs, ag = per[:p - 1] or [0.0], per[p - 1:] or [0.0]
            rows.append({"mib": mib, "call_seconds": call, "mpi_seconds": in_mpi,
                         "outside_seconds": call - in_mpi, "reduce_scatter_steps": rs,
                         "allgather_steps": ag})
            say(f"{mib:>8g} {1e3 * call:>9.3f} {1e3 * in_mpi:>10.3f} "
                f"{in_mpi / call:>6.0%} {1e3 * (call - in_mpi):>11.3f} "
                f"{1e3 * statistics.median(rs):>11.3f} "
                f"{f'({1e3 * min(rs):.3f}-{1e3 * max(rs):.3f})':>17} "
                f"{1e3 * statistics.median(ag):>11.3f} "
                f"{f'({1e3 * min(ag):.3f}-{1e3 * max(ag):.3f})':>17}")
    finally:
        comm.mpi.Free()
    return rows


def bench_transformer(world, shape, dtype, repeats: int, checkpoint: bool, say) -> list[dict]:
    """Forward+backward seconds of each scheme vs the serial model (collective)."""
    from threadpoolctl import threadpool_limits

    from .comm import cores
    from .harness.shared import NodeShared
    from .harness.timing import time_calls
    from .mpiutil import agreement
    from .transformer import model
    from .transformer.schemes import SCHEMES

    b, s, h, n, v, layers = shape
    p, rank = world.Get_size(), world.Get_rank()
    config = model.Config(vocab=v, seq=s, hidden=h, heads=n, layers=layers,
                          dtype=np.dtype(dtype).type)
    t_serial, inputs = None, None
    if rank == 0:                     # the serial model, on rank 0 only
        params = model.init_params(config, seed=0)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, v, size=(b, s))
        targets = rng.integers(0, v, size=(b, s))

        def serial_step():
            loss, cache = model.forward(params, tokens, targets, config,
                                        checkpoint=checkpoint)
            model.backward(cache)

        with threadpool_limits(limits=cores()):
            serial_step()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                serial_step()
                ts.append(time.perf_counter() - t0)
        t_serial = statistics.median(ts)
        inputs = {"params": params, "tokens": tokens, "targets": targets}
        del params, tokens, targets
    t_serial = _quiet_bcast(world, t_serial)
    # the model and inputs, one read-only copy per node; each rank shards its own blocks
    shared = NodeShared(world, inputs)
    del inputs
    params, tokens, targets = (shared.value[k] for k in ("params", "tokens", "targets"))
    say(f"transformer: b={b} s={s} h={h} heads={n} vocab={v} layers={layers} "
        f"{np.dtype(dtype).name}, checkpoint={checkpoint}; serial forward+backward on "
        f"{cores()} cores: {t_serial:.4f} s")
    say(f"{'scheme':<9} {'grid':<9} {'median s':>9} {'best s':>8} {'x serial':>9}")
    rows = []
    for name, spec in SCHEMES.items():
        grids = spec.grids(p)
        if not grids:
            say(f"{name:<9} skipped: needs {spec.needs()}; p = {p} does not fit")
        for q, d in grids:
            label = spec.grid_label(p, q, d)
            why = spec.misfit(config, b, p, q, d)
            if why:
                say(f"{name:<9} {label:<9} skipped: {why}")
                continue
            module = spec.module
            grid = spec.make_grid(world, q, d)
            try:
                grid.trace.enabled = False
                local = module.shard(params, config, grid)

                def step():
                    loss, cache = module.forward(local, tokens, targets, config, grid,
                                                 checkpoint=checkpoint)
                    module.backward(cache)

                step()                                 # checked (agreed) once
                with agreement(False):
                    times = time_calls(step, world, repeats, adaptive=False)["spans"]
            finally:
                grid.free()
            t = statistics.median(times)
            rows.append({"scheme": name, "grid": label, "p": p,
                         "seconds": t, "times": times, "serial_seconds": t_serial,
                         "ratio": t / t_serial})
            say(f"{name:<9} {label:<9} {t:>9.4f} {min(times):>8.4f} {t / t_serial:>8.2f}x")
    params = tokens = targets = None          # views of the window, then the window
    shared.free()
    return rows


def _pure_tensor(case, p: int):
    """The same scheme on all p ranks (its first grid that shards the model), else
    Megatron over p; ``None`` when neither fits."""
    from .harness.cases import MeshCase
    from .transformer.schemes import SCHEMES

    for name in (case.scheme, "megatron"):
        spec = SCHEMES[name]
        for q, d in spec.grids(p):
            grid = {"1d": f"megatron:{p}", "2d": f"optimus:{q}x{q}",
                    "2.5d": f"summa25:{q}x{q}x{d}"}[spec.grid_kind]
            pure = MeshCase.parse(f"tp={grid}", case.batch, case.config, zero=0,
                                  schedule=case.schedule, microbatches=1,
                                  checkpoint=case.checkpoint)
            if not pure.misfit(p):
                return pure
    return None


def bench_mesh(world, cases, repeats: int, say, machine=None, backend=None) -> list[dict]:
    """Step seconds of each mesh case and of pure tensor parallelism on the same ranks
    (collective), on ``backend`` (default NumPy). Each run is validated first
    (:func:`~summasim.harness.composed.run_mesh`: three Adam steps against the serial
    model); a failed validation fails the benchmark. The prediction prices each run's
    traced step with ``machine`` (none given: no prediction)."""
    from .harness.composed import run_mesh

    p = world.Get_size()
    rows = []

    def measure(case):
        res = run_mesh(case, world, backend, repeats=repeats)
        pred = None
        if machine is not None and world.Get_rank() == 0:
            from .costmodel.compose import predict_measured_mesh

            pred = predict_measured_mesh(res.measured(), machine)
        return res, world.bcast(pred, root=0)

    c0 = cases[0].config if cases else None
    if c0 is not None:
        say(f"sharded training step: b={cases[0].batch} (global) s={c0.seq} h={c0.hidden} "
            f"heads={c0.heads} vocab={c0.vocab} layers={c0.layers} "
            f"{np.dtype(c0.dtype).name}; each run validated first; 'pure' is the same "
            f"scheme on all {p} ranks")
    head = (f"{'mesh':<28} {'zero':>4} {'sched':>5} {'m':>2} {'step s':>8} {'pred s':>8} "
            f"{'err':>6} {'pure tp':<20} {'pure s':>8} {'pred s':>8} {'err':>6} {'vs pure':>8}")
    say(head)
    say("-" * len(head))
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    err = lambda pr, t: "-" if pr is None else f"{100 * (pr - t) / t:+.0f}%"  # noqa: E731
    for case in cases:
        pure = _pure_tensor(case, p)
        res, pc = measure(case)
        pres, pp_ = measure(pure) if pure is not None else (None, None)
        t = res.seconds
        tp = pres.seconds if pres is not None else None
        ok = res.ok and (pres is None or pres.ok)
        rows.append({"mesh": case.spec, "zero": case.zero, "schedule": case.schedule,
                     "microbatches": case.microbatches, "ok": ok, "seconds": t,
                     "predicted": pc, "pure": pure.spec if pure else None,
                     "pure_seconds": tp, "pure_predicted": pp_,
                     "ratio": (tp / t) if tp else None})
        say(f"{case.spec:<28} {case.zero:>4} {case.schedule:>5} {case.microbatches:>2} "
            f"{t:>8.4f} {fmt(pc):>8} {err(pc, t):>6} {pure.spec if pure else '-':<20} "
            f"{fmt(tp):>8} {fmt(pp_):>8} {err(pp_, tp) if tp else '-':>6} "
            f"{(f'{tp / t:.2f}x') if tp else '-':>8}" + ("" if ok else "  FAILED validation"))
    return rows


def build_parser():
    ap = Parser(prog="python -m summasim.bench", description=__doc__.split(
        "\n\n")[0] + " Run under mpirun.")
    ap.add_argument("what", nargs="?",
                    choices=("gemm", "allreduce", "ring-steps", "transformer", "mesh", "all"),
                    default="all", help="which benchmark (default all)")
    ap.add_argument("--n", type=int, default=4096, help="GEMM size n (default 4096)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--backend", choices=("numpy", "cupy", "staged-host"), default="numpy",
                    help="array backend of gemm, allreduce and mesh: numpy (CPU), cupy (GPU; "
                         "its GEMM ceiling is one process's CuPy rate), or staged-host (NumPy "
                         "through the GPU staging path); transformer and ring-steps time "
                         "NumPy (default numpy)")
    ap.add_argument("--algorithms", default=",".join(GEMM_ALGORITHMS),
                    help="comma-separated distributed products to time")
    ap.add_argument("--sizes-mib", default="0.0625,0.25,1,4,16,64",
                    help="all-reduce message sizes in MiB (default 0.0625,0.25,1,4,16,64)")
    ap.add_argument("--machine", metavar="FILE|PRESET", default=None,
                    help="cost-model machine for the ring's predicted time (default: as "
                         "summasim.run chooses)")
    ap.add_argument("--no-predict", action="store_true", help="skip the prediction")
    ap.add_argument("--np-empty", action="store_true",
                    help="allreduce and ring-steps: message buffers as np.empty returns "
                         "them (partly on huge pages, by the luck of their alignment) "
                         "instead of on huge pages from end to end")
    ap.add_argument("--tf-shape", nargs=6, type=int, default=[16, 128, 512, 8, 64, 1],
                    metavar=("B", "S", "H", "N", "V", "L"),
                    help="transformer benchmark: batch, sequence, hidden, heads, vocab, layers "
                         "(default 16 128 512 8 64 1)")
    ap.add_argument("--tf-dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--checkpoint", action="store_true",
                    help="transformer benchmark with activation checkpointing")
    ap.add_argument("--mesh", action="append", default=None, metavar="dp=D,pp=P,tp=SCHEME:GRID",
                    help="mesh benchmark: a composition to time (repeatable; default: the "
                         "main job's default compositions that fit p)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                    help="mesh benchmark: ZeRO stage of the --mesh runs (default 0)")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--mesh-shape", nargs=6, type=int, default=[16, 32, 128, 16, 128, 4],
                    metavar=("B", "S", "H", "N", "V", "L"),
                    help="mesh benchmark model: global batch, sequence, hidden, heads, vocab, "
                         "layers (default 16 32 128 16 128 4, float64)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed repeats (default {DEFAULT_REPEATS}; allreduce: per size, "
                         f"as many as about {ALLREDUCE_BUDGET_S:g} s of calls allow, "
                         f"{ALLREDUCE_REPEATS} to {ALLREDUCE_MAX_REPEATS}, for the 95%% "
                         f"interval of the paired ratios)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return ap


def parse_args(argv=None):
    """Parse and check the arguments (pure); :class:`UserError` on a mistake."""
    args = build_parser().parse_args(argv)
    if args.n < 1:
        raise UserError(f"--n must be positive, got {args.n}")
    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    args.allreduce_repeats = args.repeats          # None: per size (allreduce_repeats)
    args.repeats = args.repeats or DEFAULT_REPEATS
    args.algorithm_list = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithm_list if a not in GEMM_ALGORITHMS]
    if bad or not args.algorithm_list:
        raise UserError(f"--algorithms: unknown {', '.join(bad) or '(none given)'}; choose "
                        f"from {', '.join(GEMM_ALGORITHMS)}")
    try:
        args.sizes = [float(x) for x in args.sizes_mib.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--sizes-mib takes comma-separated numbers, got "
                        f"{args.sizes_mib!r}") from None
    if not args.sizes or not all(np.isfinite(x) and x > 0 for x in args.sizes):
        raise UserError(f"--sizes-mib must be positive numbers, got {args.sizes_mib!r}")
    if min(args.tf_shape) < 1:
        raise UserError("--tf-shape values must be positive")
    b, s, h, n, v, layers = args.tf_shape
    if h % n:
        raise UserError(f"--tf-shape: heads = {n} must divide hidden = {h}")
    if min(args.mesh_shape) < 1 or args.mesh_shape[2] % args.mesh_shape[3]:
        raise UserError("--mesh-shape values must be positive and heads must divide hidden")
    if args.microbatches < 1:
        raise UserError("--microbatches must be at least 1")
    if args.backend != "numpy" and args.what in ("transformer", "ring-steps"):
        raise UserError(f"--backend {args.backend}: the {args.what} benchmark times NumPy "
                        f"only; --backend applies to gemm, allreduce and mesh")
    return args


def plan_mesh_bench(args, p: int):
    """``(cases, skips, err)`` of the mesh benchmark (pure)."""
    from .harness.plan import default_meshes, plan_meshes
    from .transformer.model import Config

    b, s, h, n, v, layers = args.mesh_shape
    config = Config(vocab=v, seq=s, hidden=h, heads=n, layers=layers)
    if args.mesh:
        specs = [(m, dict(zero=args.zero, schedule=args.schedule,
                          microbatches=args.microbatches)) for m in args.mesh]
    else:
        specs = default_meshes(p)
    return plan_meshes(p, specs, config, b, bool(args.mesh))


def _transformer_cases(shape, dtype, p: int) -> list:
    """The :class:`~summasim.harness.cases.TransformerCase` of every scheme and grid that
    ``bench transformer`` runs at p (for the memory check)."""
    from .harness.plan import plan_schemes
    from .transformer import model
    from .transformer.schemes import SCHEMES

    b, s, h, n, v, layers = shape
    config = model.Config(vocab=v, seq=s, hidden=h, heads=n, layers=layers,
                          dtype=np.dtype(dtype).type)
    return plan_schemes(p, SCHEMES, lambda _: config, b)[0]


def _preflight(args, world) -> str:
    from .harness.memory import check_fits, check_node_and_gpu, check_training_fits
    from .harness.plan import plan_products
    from .backends import device_share, unavailable
    from .comm import local_ranks

    err = (check_outputs(args.json, None if args.no_predict else args.machine)
           or unavailable(args.backend))
    if err:
        return err
    p = world.Get_size()
    gpu = device_share(args.backend, local_ranks())     # (free bytes, ranks per GPU) or None
    if args.what in ("mesh", "all"):
        mcases, _, err = plan_mesh_bench(args, p)
        if err:
            return err
        for case in mcases:
            why = check_node_and_gpu(
                lambda n, c=case, **kw: check_training_fits(c, p, n, **kw), local_ranks(), gpu)
            if why:
                return why
    if args.what in ("transformer", "all"):
        for case in _transformer_cases(args.tf_shape, np.dtype(args.tf_dtype), p):
            why = check_training_fits(case, p, local_ranks())
            if why:
                return why
    sized = {"allreduce": "allreduce", "all": "allreduce", "ring-steps": "ring-steps"}
    if args.what in sized:
        why = check_node_and_gpu(
            lambda n, **kw: check_bench_fits(sized[args.what], args.sizes, n, **kw),
            local_ranks(), gpu)
        if why:
            return why
    if args.what in ("gemm", "all"):
        cases, _ = plan_products(world.Get_size(), args.algorithm_list, (args.n,) * 3, None,
                                 [args.dtype])
        for case in cases:
            why = check_node_and_gpu(
                lambda n, c=case, **kw: check_fits(c, n, "freivalds", **kw), local_ranks(), gpu)
            if why:
                return why
    return ""


def main(argv=None) -> int:
    return mpi_main(lambda: parse_args(argv), _preflight, _body, prog="python -m summasim.bench")


def _body(args, world) -> int:
    from .comm import cores, default_wait_policy
    from .backends import get_backend
    from .jsonio import write_json_atomic
    from .mpiutil import limit_blas_threads

    rank, p = world.Get_rank(), world.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    _limits = limit_blas_threads(1 if p > 1 else None)  # noqa: F841
    backend = get_backend(args.backend)
    say(f"summasim.bench: p = {p} ranks on {cores()} cores, wait policy "
        f"{default_wait_policy()}, {args.dtype}, backend {backend.name} (MPI path: "
        f"{backend.comm_mode})")
    dtype = np.dtype(args.dtype)
    report = {"p": p, "cores": cores(), "dtype": args.dtype,
              "wait_policy": default_wait_policy(), "backend": backend.name,
              "comm_mode": backend.comm_mode}
    if args.what in ("allreduce", "ring-steps", "all") and backend.name != "cupy":
        from .backends.numpy_backend import transparent_huge_pages

        mode, page = transparent_huge_pages()
        report["buffers"] = {"huge_pages": not args.np_empty, "thp": mode, "page_bytes": page}
        say("message buffers: " + ("as np.empty returns them (--np-empty)" if args.np_empty
                                  else f"from {page >> 20} MiB on, on huge pages from end "
                                  f"to end") + f"; transparent huge pages: {mode}")
    resolved = []

    def machine():
        """The cost-model machine of the predictions, resolved once (None: none)."""
        if not resolved:
            if args.no_predict:
                resolved.append(None)
            elif backend.name != "numpy":
                say(f"backend {backend.name}: no prediction: the cost model prices host "
                    f"arrays only")
                resolved.append(None)
            else:
                from .harness.machinefile import resolve_machine

                resolved.append(resolve_machine(args.machine, world, say))
        return resolved[0]

    ok = True
    if args.what in ("gemm", "all"):
        report["gemm"] = bench_gemm(world, args.n, dtype, args.repeats, args.algorithm_list, say,
                                    backend)
        ok = all(r["ok"] for r in report["gemm"])
    if args.what in ("allreduce", "all"):
        say("")
        host = backend.name != "cupy"        # device arrays: host memory is not theirs
        from mpi4py import MPI

        from .costmodel.fit import MemoryProbe

        probe = MemoryProbe(NODE_MEMORY_MIB << 20) if host else None
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            before = node_memory_gibs(world, probe=probe, node=node) if host else None
            if machine() is not None and host:
                say(f"cost model: each size's memory floor at the node's memory throughput "
                    f"while it ran (mem GiB/s: all of a node's ranks adding {NODE_MEMORY_MIB} "
                    f"MiB arrays {MEMORY_ROUND_ADDS} times at once, in every round of the "
                    f"repeats, the median; at the sizes whose data outgrows the node's cache)")
            report["allreduce"] = bench_allreduce(
                world, args.sizes, dtype, args.allreduce_repeats, say, machine(), backend,
                not args.np_empty,
                memory=((lambda: node_memory_gibs(world, adds=MEMORY_ROUND_ADDS, probe=probe,
                                                  node=node))
                        if host and machine() is not None else None))
            after = node_memory_gibs(world, probe=probe, node=node) if host else None
        finally:
            node.Free()
        report["node_memory_gibs"] = {"before": before, "after": after,
                                      "array_mib": NODE_MEMORY_MIB}
        if host:
            say(f"host memory of a node's ranks all at once (the slowest node; each adding "
                f"{NODE_MEMORY_MIB} MiB arrays): {before:.1f} GiB/s before the sizes, "
                f"{after:.1f} after; on a shared VM it changes from launch to launch and the "
                f"largest sizes' times follow it (docs/performance.md)")
        ok = ok and all(r["ok"] for r in report["allreduce"])
    if args.what == "ring-steps":
        report["ring_steps"] = bench_ring_steps(world, args.sizes, dtype, args.repeats, say,
                                                not args.np_empty)
    if args.what == "all" and backend.name != "numpy":
        say(f"\ntransformer: skipped with --backend {backend.name} (it times NumPy only)")
    elif args.what in ("transformer", "all"):
        say("")
        report["transformer"] = bench_transformer(world, args.tf_shape, np.dtype(args.tf_dtype),
                                                  args.repeats, args.checkpoint, say)
    if args.what in ("mesh", "all"):
        say("")
        cases, skips, _ = plan_mesh_bench(args, p)
        report["mesh"] = bench_mesh(world, cases, args.repeats, say, machine(), backend)
        ok = ok and all(r["ok"] for r in report["mesh"])
        for sk in skips:
            say(f"  skipped mesh {sk.name}: {sk.reason}")
    if args.json and rank == 0:
        write_json_atomic(args.json, report)
    if not ok:
        say("a benchmarked result failed its check")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
