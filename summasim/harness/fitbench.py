"""The microbenchmarks of a machine fit, under MPI: ping-pong, ring, collectives, GEMM,
reduction, memory bandwidth; :func:`run_fit` times them and fits a
:class:`~summasim.costmodel.machine.Machine` with the cost model's pure regression
(:mod:`summasim.costmodel.machine.regression`).

Run it under MPI::

    mpiexec -n 2 python -m summasim.costmodel fit --out machine.json
    mpiexec -n 2 python -m summasim.costmodel fit --quick --out /tmp/m.json

Rank 0 prints progress and the fit quality, and writes the JSON (atomically).

What is measured
----------------
ping-pong   ranks 0 and 1, log-spaced sizes 8 B .. ``max_bytes``: half the round
            trip of ``Send``/``Recv`` (the rest of the ranks wait in a barrier)
ring        every rank ``Sendrecv`` to its right neighbour (Cannon's shift)
collectives ``Bcast``, ``Reduce`` and ``Allreduce`` (sum) on groups of the given
            sizes (``comm.Split``), slowest rank of each call
GEMM        ``numpy.matmul`` of n x n blocks per dtype with one BLAS thread,
            all ranks at once (as SPMD code runs): seconds per flop
reduction   ``numpy.add(x, y, out=x)``: seconds per byte, the machine's gamma_reduce
            (summasim's own reductions); its gamma_reduce_mpi is the larger of this
            and what the measured MPI_Reduce/MPI_Allreduce imply
            (:func:`~summasim.costmodel.machine.regression.gamma_reduce_from_collectives`)
single GEMM rank 0 alone at the largest GEMM size (``notes["gemm_single"]``): all
            ranks' GEMM far slower than this means other work shared the cores

Every call is timed by the harness's one timer, :func:`summasim.harness.timing.time_calls`
(after a barrier that waits without spinning). Each point is the fastest of several short
repetitions (9 of about 0.5 ms with ``--quick``, else 21 of about 2 ms, each averaging
enough iterations to last that long): on a shared machine other work only ever adds
time, so the minimum over short repetitions estimates the machine itself.

Every fit takes the host's one fit lock (:class:`~summasim.harness.load.FitLock` on
:data:`~summasim.harness.load.HOST_FIT_LOCK`; the main job's quick fit takes it too), so
two fits never measure each other: the second waits for the first. Rank 0 measures the
CPU of other processes (:mod:`summasim.harness.load`, this job's ranks excluded) just
before the fit, in each of its phases and just after it; the fit is marked busy in
``Machine.fit_conditions`` when any of them exceeds
:data:`~summasim.harness.load.BUSY_CORES`, and every warning it prints about the load
comes from those same readings. The fit refuses
(:class:`~summasim.costmodel.machine.regression.FitRejected`) a machine that
:func:`~summasim.costmodel.machine.sanity_problems` finds implausible.

Oversubscription: MPICH's waiting ranks spin (``MPIR_CVAR_POLLS_BEFORE_YIELD`` =
1000 polls before a yield), so any rank idle in a barrier or a receive burns a
core. Run the fit with no more ranks than cores (here: 2); with more, every number
includes time-sharing and the model would apply the slowdown twice.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from typing import Callable, Sequence

import numpy as np

from ..costmodel.collectives import collective_time
from ..costmodel.machine import Machine, sanity_problems
from ..costmodel.machine.regression import (MiB, FitRejected, fit_regimes,
                                            gamma_reduce_from_collectives,
                                            library_eager_threshold, log_sizes,
                                            median_rel_err, split_huge)
from ..comm import node_cores_of
from ..mpiutil import mpi_library, quiet_barrier
from . import load as _load
from .timing import time_calls


def _touched(nbytes: int) -> np.ndarray:
    """A byte buffer whose pages are all written: ``np.zeros`` maps the shared zero
    page lazily, so a message read from it (or received into a fresh one) measures
    page faults and the zero page, not the copies a real algorithm's buffers see."""
    buf = np.empty(max(nbytes, 1), np.uint8)
    buf.fill(1)
    return buf[:nbytes]


def _repeated(fn, n: int):
    """``fn`` called ``n`` times in a row (one timed repetition)."""
    def run():
        for _ in range(n):
            fn()
    return run


class _Bench:
    """The fit's communication microbenchmarks on an mpi4py communicator (rank 0
    reports); every repetition timed by :func:`~summasim.harness.timing.time_calls`."""

    def __init__(self, comm, target_s, reps, say):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.target_s, self.reps, self.say = target_s, reps, say

    def _iters(self, once_s):
        """Iterations per repetition so that one repetition lasts about target_s."""
        return int(max(1, min(10000, self.target_s / max(once_s, 1e-7))))

    def pingpong(self, nbytes):
        """Fastest half round trip (seconds) between ranks 0 and 1 over the repetitions
        (rank 0's own time; the first call, the slowest rank's, sizes the loop)."""
        comm, MPI = self.comm, self.MPI
        buf = _touched(nbytes)

        def once():
            if self.rank == 0:
                comm.Send([buf, MPI.BYTE], dest=1, tag=7)
                comm.Recv([buf, MPI.BYTE], source=1, tag=7)
            elif self.rank == 1:
                comm.Recv([buf, MPI.BYTE], source=0, tag=7)
                comm.Send([buf, MPI.BYTE], dest=0, tag=7)

        iters = comm.bcast(self._iters(time_calls(once, comm, 1, adaptive=False)
                                       ["rank_max"][0]), root=0)
        own = time_calls(_repeated(once, iters), comm, self.reps, adaptive=False)["times"]
        best = min(own) / (2 * iters)
        return comm.bcast(best if self.rank == 0 else None, root=0)

    def _timed(self, fn, comm):
        """Fastest repetition of the slowest rank's time per call of ``fn``."""
        iters = self._iters(time_calls(fn, comm, 1, adaptive=False)["rank_max"][0])
        slowest = time_calls(_repeated(fn, iters), comm, self.reps, adaptive=False)
        return min(slowest["rank_max"]) / iters

    def ring(self, nbytes):
        comm, MPI = self.comm, self.MPI
        send, recv = _touched(nbytes), _touched(nbytes)
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return self._timed(lambda: comm.Sendrecv([send, MPI.BYTE], right, 3,
                                                 [recv, MPI.BYTE], left, 3), comm)

    def collective(self, op, sub, nbytes):
        MPI = self.MPI
        count = max(1, nbytes // 8)
        x = np.ones(count, np.float64)
        y = np.ones_like(x)
        if op == "bcast":
            fn = lambda: sub.Bcast([x, MPI.DOUBLE], root=0)  # noqa: E731
        elif op == "reduce":
            fn = lambda: sub.Reduce([x, MPI.DOUBLE], [y, MPI.DOUBLE],  # noqa: E731
                                    op=MPI.SUM, root=0)
        else:
            fn = lambda: sub.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.SUM)  # noqa: E731
        return self._timed(fn, sub)


def _gemm_seconds(n, dtype, reps):
    """Fastest of ``reps`` repetitions of an n x n GEMM (this rank alone), seconds."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    gemm = lambda: np.matmul(a, b, out=c)  # noqa: E731
    once = time_calls(gemm, None, 1, adaptive=False, warmup=1)["times"][0]
    iters = int(max(1, min(1000, 0.002 / max(once, 1e-7))))
    return min(time_calls(_repeated(gemm, iters), None, reps, adaptive=False)["times"]) / iters


def _reduce_seconds_per_byte(nbytes, reps):
    """Fastest of ``reps`` additions ``x += y`` of ``nbytes``, seconds per byte."""
    x = np.ones(nbytes // 8)
    y = np.ones_like(x)
    add = lambda: np.add(x, y, out=x)  # noqa: E731
    return min(time_calls(add, None, reps, adaptive=False, warmup=1)["times"]) / x.nbytes


class MemoryProbe:
    """Two float64 arrays of ``nbytes`` each, touched once: :meth:`read` times ``adds``
    additions of one into the other (three streams: two reads, one write) on all of a
    communicator's ranks at once. Kept between readings, so that a reading taken between
    the calls of a benchmark faults in no pages."""

    def __init__(self, nbytes: int = 32 * MiB):
        self.a = np.ones(max(1, int(nbytes) // 8))
        self.b = np.zeros_like(self.a)
        np.add(self.a, self.b, out=self.b)          # first touch outside the timing

    def read(self, comm, adds: int = 8) -> float:
        """Bytes per second all of ``comm``'s ranks stream at once (collective; the same
        value on every rank), timed from the first rank's start to the last rank's end
        (the span of :func:`~summasim.harness.timing.time_calls`: ``perf_counter`` is the
        node's monotonic clock, so ``comm`` should be one node's ranks)."""
        a, b = self.a, self.b
        span = time_calls(_repeated(lambda: np.add(a, b, out=b), adds), comm, 1,
                          adaptive=False)["spans"][0]
        return 3.0 * a.nbytes * adds * comm.Get_size() / span

    def read_nodes(self, comm, node, adds: int = 8) -> float:
        """The slowest node's :meth:`read` (collective over ``comm``): every node reads
        on its own ranks (``node``: ``comm`` split by shared memory) at the same time."""
        from mpi4py import MPI

        return comm.allreduce(self.read(node, adds), op=MPI.MIN)


def node_memory(comm, say, readings: int = 3) -> tuple[float | None, float | None]:
    """``(memory_bandwidth, cache_bytes)`` of a Machine (collective; the same on every
    rank), the slowest node's of each:

    * the best of ``readings`` :meth:`MemoryProbe.read_nodes`; None (said) when a node
      has fewer ranks than logical CPUs (``os.cpu_count``): fewer streams may not reach
      its memory bandwidth, and a floor priced with less would be too high;
    * the last-level cache of the CPUs the node's ranks may run on
      (:func:`node_cache_bytes`; a cpuset or core binding leaves out the others).
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                else range(os.cpu_count() or 1))
        cpus = set().union(*node.allgather(sorted(mine)))
        caches = comm.allgather(node_cache_bytes(cpus=cpus))
        cache = None if None in caches else min(caches)
        logical = os.cpu_count() or 1
        full = comm.allreduce(node.Get_size() >= logical, op=MPI.LAND)
        bw = None
        if full:
            probe = MemoryProbe()
            bw = max(probe.read_nodes(comm, node) for _ in range(readings))
    finally:
        node.Free()
    if bw is None:
        say(f"memory bandwidth: not measured (a node has fewer ranks than its {logical} "
            f"logical CPUs); predictions have no memory floor")
    else:
        say(f"  memory: all ranks of a node adding 32 MiB arrays at once: {bw / 2**30:.1f} "
            f"GiB/s (best of {readings}; the memory floor of the predictions)")
    if cache is not None:
        say(f"  last-level cache of the node: {cache / 2**20:.0f} MiB (the memory floor "
            f"leaves out runs whose data fits in it)")
    return bw, cache


def node_cache_bytes(root: str = "/sys/devices/system/cpu", cpus=None) -> float | None:
    """The node's last-level cache in bytes: the highest-level data or unified cache of
    its CPUs (those in ``cpus`` when given), each instance (a distinct
    ``shared_cpu_list``) counted once, from Linux's sysfs under ``root``; None where it
    cannot be read."""
    import glob

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    found = {}
    for index in glob.glob(os.path.join(root, "cpu[0-9]*", "cache", "index[0-9]*")):
        cpu = int(os.path.basename(os.path.dirname(os.path.dirname(index)))[3:])
        if cpus is not None and cpu not in cpus:
            continue
        try:
            with open(os.path.join(index, "type")) as fh:
                if fh.read().strip() not in ("Data", "Unified"):
                    continue
            with open(os.path.join(index, "level")) as fh:
                level = int(fh.read())
            with open(os.path.join(index, "size")) as fh:
                text = fh.read().strip()
            with open(os.path.join(index, "shared_cpu_list")) as fh:
                shared = fh.read().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (OSError, ValueError):
            continue
        found.setdefault(level, {})[shared] = size
    if not found:
        return None
    return float(sum(found[max(found)].values()))


def _phys_mem() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0.0


def run_fit(comm=None, *, quick: bool = False, max_bytes: int | None = None,
            group_sizes: Sequence[int] | None = None, gemm_sizes: Sequence[int] | None = None,
            dtypes: Sequence[str] = ("float64", "float32"), threshold: int | None = None,
            name: str | None = None, command: str | None = None,
            say: Callable[[str], None] | None = None, check: bool = True,
            before: dict | None = None, exclude: Sequence[int] = (),
            lock_wait: float = _load.LOCK_WAIT,
            detail: Callable[[str], None] | None = None) -> Machine | None:
    """Run the microbenchmarks on ``comm`` (COMM_WORLD) and fit a Machine, holding the
    host's fit lock and recording the load around it in ``fit_conditions``.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        At least 2 ranks.
    quick : bool
        Fewer sizes (factor 4 apart, up to 4 MiB unless ``max_bytes``), fewer
        repetitions, fewer GEMM sizes: about a minute on 2 cores.
    max_bytes : int, optional
        Largest message (default 64 MiB, quick 4 MiB).
    group_sizes : sequence of int, optional
        Collective group sizes (default: powers of two up to the world size, and it).
    gemm_sizes : sequence of int, optional
        GEMM block sizes n.
    dtypes : sequence of str
        GEMM dtypes.
    threshold : int, optional
        Eager/rendezvous split in bytes; None chooses the best split.
    name : str, optional
        Machine name.
    command : str, optional
        Recorded in the notes (default: the command line).
    say : callable, optional
        Progress printer (rank 0 only); default prints with flush.
    check : bool
        Refuse a fit that :func:`~summasim.costmodel.machine.sanity_problems` finds
        implausible (default); False returns it anyway (to inspect it).
    before : dict, optional
        The caller's :func:`~summasim.harness.load.snapshot` that decided to fit (so
        that the decision and the fit's own warnings rest on one reading); default:
        taken here once the lock is held (also when waiting for the lock made it old).
    exclude : sequence of int
        More pids whose CPU is ours (the other ranks of a job that fits on a part of
        its ranks).
    lock_wait : float
        Longest wait, in seconds, for another fit to release the host's fit lock.

    Returns
    -------
    Machine on rank 0 (``fit_conditions`` set), None on the other ranks.

    Raises
    ------
    FitBusy
        On every rank, when another fit held the lock for longer than ``lock_wait``.
    FitRejected
        On every rank, when ``check`` and the fitted machine has problems (an
        infinite bandwidth, a zero latency, GEMM far slower with all ranks busy than
        one process alone, ...).
    """
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise ValueError("the fit needs at least 2 MPI ranks (mpiexec -n 2 ...)")
    if say is None:
        say = (lambda msg: print(f"[fit] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    pids = [int(x) for x in comm.allgather(os.getpid())] + [int(x) for x in exclude]
    lock = _load.FitLock(_load.HOST_FIT_LOCK) if rank == 0 else None
    got = True
    if rank == 0:
        try:
            got = lock.acquire(say, lock_wait, what="another fit is measuring this machine",
                               then="waiting for it: two fits at once would measure each "
                                    "other")
        except OSError as exc:
            say(f"WARNING: cannot open the fit lock {lock.lock_path} ({exc.strerror}); "
                f"fitting without it")
            lock = None
    _sleep_barrier(comm)
    got = comm.bcast(got, root=0)
    if not got:
        raise _load.FitBusy(f"another fit held {_load.HOST_FIT_LOCK + '.lock'} for more than "
                            f"{lock_wait:.0f} s; try again when it is done")
    try:
        return _run_fit_locked(comm, quick, max_bytes, group_sizes, gemm_sizes, dtypes,
                               threshold, name, command, say, check, pids,
                               None if lock is not None and lock.waited > 0.5 else before,
                               detail or say)
    finally:
        if lock is not None:
            lock.release()


def _run_fit_locked(comm, quick, max_bytes, group_sizes, gemm_sizes, dtypes, threshold,
                    name, command, say, check, pids, before, detail):
    """:func:`run_fit` once the fit lock is held; each measured point goes to
    ``detail``, the warnings and the outcome to ``say``."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from ..mpiutil import doing      # each phase: what an interrupt's line names

    rank, size = comm.Get_rank(), comm.Get_size()
    cores = node_cores_of(comm)[1]       # the CPUs the fit's ranks cover together
    if size > cores:
        say(f"WARNING: {size} ranks on {cores} cores: waiting ranks spin and share the cores; "
            f"the measured numbers include time-sharing")
    watch = None
    if rank == 0:
        before = before or _load.snapshot(0.3, exclude=pids)
        if before["foreign_cpu"] > _load.BUSY_CORES:
            say(f"WARNING: other processes use {before['foreign_cpu']:.2f} cores now (load "
                f"average {before['loadavg']:.1f}, this job's ranks included): expect noisy "
                f"numbers (each point keeps the fastest repetition); the fit will be marked "
                f"busy")
        watch = _load.LoadWatch(None, exclude=pids)
    laps = []
    max_bytes = max_bytes or (4 * MiB if quick else 64 * MiB)
    sizes = log_sizes(8, max_bytes, 4 if quick else 2)
    reps = 9 if quick else 21
    bench = _Bench(comm, 0.0005 if quick else 0.002, reps, say)
    t_start = time.time()

    detail(f"{size} ranks, {cores} cores, {mpi_library()}")
    doing("fitting the machine: ping-pong")
    detail(f"ping-pong between ranks 0 and 1, {len(sizes)} sizes {sizes[0]} B .. {sizes[-1]} B")
    pp = []
    for _ in range(3):          # warm up: the first exchanges set up MPICH's shared queues
        bench.pingpong(sizes[0])
    for s in sizes:
        t = bench.pingpong(s)
        pp.append(t)
        detail(f"  ping-pong {s:>10d} B  {t * 1e6:10.2f} us  {s / t / 1e9 if t else 0:7.2f} GB/s")
    laps.append(watch and watch.lap())
    doing("fitting the machine: ring sendrecv")
    detail("ring sendrecv (every rank to its right neighbour)")
    ring = []
    ring_sizes = sizes[::2] if not quick else sizes
    for s in ring_sizes:
        t = bench.ring(s)
        ring.append(t)
        detail(f"  ring      {s:>10d} B  {t * 1e6:10.2f} us")

    laps.append(watch and watch.lap())
    if group_sizes is None:
        group_sizes = sorted({g for g in (2 ** i for i in range(1, size.bit_length()))
                              if g <= size} | {size})
    coll_sizes = [s for s in sizes if s >= 64][:: (2 if quick else 3)]
    colls = []
    for g in group_sizes:
        if not 2 <= g <= size:
            continue
        doing(f"fitting the machine: collectives of {g} ranks")
        color = rank // g if rank < (size // g) * g else MPI.UNDEFINED
        sub = comm.Split(color, rank)
        for op in ("bcast", "reduce", "allreduce"):
            for s in coll_sizes:
                t = bench.collective(op, sub, s) if sub != MPI.COMM_NULL else None
                t = comm.bcast(t, root=0)
                colls.append((op, g, s, t))
                detail(f"  {op:<9s} g={g:<3d} {s:>10d} B  {t * 1e6:10.2f} us")
        if sub != MPI.COMM_NULL:
            sub.Free()
        comm.Barrier()

    laps.append(watch and watch.lap())
    if gemm_sizes is None:
        gemm_sizes = (64, 256, 1024) if quick else (32, 64, 128, 256, 512, 1024, 2048)
    gamma_gemm = {}
    with threadpool_limits(limits=1):
        for dt in dtypes:
            doing(f"fitting the machine: {dt} GEMM")
            pts = []
            for n in gemm_sizes:
                comm.Barrier()
                t = _gemm_seconds(int(n), dt, 5 if quick else 9)
                t = float(np.median(comm.allgather(t)))
                g = t / (2.0 * n ** 3)
                pts.append((float(n), g))
                detail(f"  gemm {dt:<8s} n={n:<5d} {t * 1e3:9.3f} ms  {1 / g / 1e9:7.2f} GFLOP/s/rank")
            gamma_gemm[dt] = pts
        # one process alone at the largest size, the others asleep: the reference that
        # tells all ranks' GEMM apart from cores shared with other work
        n1, dt1 = int(max(gemm_sizes)), dtypes[0]
        comm.Barrier()
        g1 = _gemm_seconds(n1, dt1, 5 if quick else 9) / (2.0 * n1 ** 3) if rank == 0 else None
        _sleep_barrier(comm)
        g1 = comm.bcast(g1, root=0)
        detail(f"  gemm {dt1:<8s} n={n1:<5d} one process alone {1 / g1 / 1e9:7.2f} GFLOP/s")
        comm.Barrier()
        gr = _reduce_seconds_per_byte((1 if quick else 8) * MiB, 5)
        gr = float(np.median(comm.allgather(gr)))
        detail(f"  reduction a += b: {gr * 1e9:.3f} ns/B ({1 / gr / 1e9:.2f} GB/s)")
    laps.append(watch and watch.lap())
    doing("fitting the machine: memory bandwidth")
    bandwidth, cache = node_memory(comm, detail)
    laps.append(watch and watch.lap())

    if rank != 0:
        problems = comm.bcast(None, root=0)
        if problems:
            raise FitRejected(problems)
        return None
    how = "given"
    if threshold is None:
        threshold, how = library_eager_threshold(MPI.Get_library_version())
    rf = split_huge(fit_regimes(sizes, pp, threshold, max_split=MiB), sizes, pp)
    detail(f"fit: large-message regime from {rf.threshold} B ({how})")
    if rf.huge is not None:
        detail(f"fit: third regime from {rf.huge_threshold} B (best split at 1 MiB or more; "
            f"NumPy puts arrays of 4 MiB and up on transparent huge pages)")
    for tag, f, _ in rf.regimes():
        bw = f"{1 / f.beta / 1e9:7.2f} GB/s" if f.beta > 1e-15 else "    inf GB/s"
        detail(f"  {tag:<5s} alpha = {f.alpha * 1e6:8.3f} us  beta = {f.beta * 1e9:8.4f} ns/B "
            f"({bw})  "
            f"median rel err {f.median_rel_err:.1%} over {f.n} points")
    host = platform.node() or "host"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = Machine(
        name=name or f"fit-{host}",
        source=(f"summasim.costmodel fit on {host}, {date}, {size} ranks, "
                f"{mpi_library()}"),
        cores=cores, intra=rf.link(), gamma_gemm=gamma_gemm, gamma_reduce=gr,
        memory_bytes=_phys_mem() / max(cores, 1), shared_comm=True,
        memory_bandwidth=bandwidth, cache_bytes=cache,
        notes={"date": date, "command": command or " ".join([sys.executable] + sys.argv),
               "ranks": size, "cores": cores, "quick": quick,
               "fit": {"threshold": rf.threshold,
                       "small": [rf.small.alpha, rf.small.beta, rf.small.median_rel_err],
                       "large": [rf.large.alpha, rf.large.beta, rf.large.median_rel_err],
                       **({"huge": [rf.huge.alpha, rf.huge.beta, rf.huge.median_rel_err],
                           "huge_threshold": rf.huge_threshold} if rf.huge else {})},
               "pingpong": [[s, t] for s, t in zip(sizes, pp)],
               "ring": [[s, t] for s, t in zip(ring_sizes, ring)],
               "collectives": [list(c) for c in colls],
               "gemm_single": {"dtype": dt1, "n": n1, "seconds_per_flop": g1},
               "memory_bandwidth": (bandwidth if bandwidth is not None else
                                    "not measured: a node had fewer ranks than CPUs"),
               "cache_bytes": cache if cache is not None else "not found in sysfs",
               "seconds": round(time.time() - t_start, 1)})
    # MPI's own reductions (temporary buffers, MPI_SUM loops) can be much slower per
    # byte than numpy's a += b; estimate them as seen inside MPI_Reduce / MPI_Allreduce
    # from their large-message points: gamma_reduce_mpi (never below numpy's), while
    # gamma_reduce stays numpy's a += b (summasim's own reductions)
    g_mpi = gamma_reduce_from_collectives(machine, colls)
    if g_mpi is not None:
        detail(f"gamma_reduce: numpy a += b {gr * 1e9:.3f} ns/B (summasim's reductions), "
            f"inside MPI reduce/allreduce {g_mpi * 1e9:.3f} ns/B; MPI's: "
            f"{max(gr, g_mpi) * 1e9:.3f} ns/B")
        machine = machine.replace(gamma_reduce=gr, gamma_reduce_mpi=max(gr, g_mpi),
                                  notes={**machine.notes, "gamma_reduce_numpy": gr,
                                         "gamma_reduce_mpi": g_mpi})
    # check the whole model on what was not fitted
    pred = [machine.link().time(s) for s in ring_sizes]
    detail(f"check: ring sendrecv predicted vs measured, median rel err "
        f"{median_rel_err(pred, ring):.1%}")
    checks = {}
    for op in ("bcast", "reduce", "allreduce"):
        rows = [(g, s, t) for o, g, s, t in colls if o == op and t]
        if rows:
            pr = [collective_time(op, s, g, machine, reduce_impl="mpi") for g, s, _ in rows]
            algs = sorted({c.algorithm for c in pr})
            err = median_rel_err([c.seconds for c in pr], [t for *_, t in rows])
            checks[op] = err
            detail(f"check: {op:<9s} median rel err {err:.1%} (model: {', '.join(algs)}"
                f"{'; gamma_reduce fitted on its large points' if op != 'bcast' else ''})")
    machine = machine.replace(notes={**machine.notes, "check_median_rel_err": checks})
    gemm_best = max(1 / g for pts in gamma_gemm.values() for _, g in pts)
    say(f"fitted {size} ranks in {time.time() - t_start:.0f} s: latency "
        f"{rf.small.alpha * 1e6:.2f} us, bandwidth {1 / max(rf.large.beta, 1e-30) / 1e9:.2f} "
        f"GB/s, GEMM up to {gemm_best / 1e9:.1f} GFLOP/s per rank; the model's median error "
        f"on what it was not fitted to: ring {median_rel_err(pred, ring):.0%}"
        + "".join(f", {op} {err:.0%}" for op, err in checks.items()))
    during = _load.combine(laps)
    conditions = _load.fit_conditions(before, _load.snapshot(0.3, exclude=pids), during)
    machine = machine.replace(fit_conditions=conditions)
    worst = max(conditions["foreign_cpu_before"], conditions["foreign_cpu_after"],
                conditions.get("foreign_cpu_during", 0.0))
    if conditions["busy"]:
        say(f"WARNING: other processes used up to {worst:.2f} cores before, during or after "
            f"the fit (limit {_load.BUSY_CORES}): it is marked busy (fit_conditions), and "
            f"every run that uses it says so")
    else:
        say(f"load: quiet before, during and after the fit (other processes used at most "
            f"{worst:.2f} cores)")
    problems = sanity_problems(machine) if check else []
    for line in problems:
        say(f"REFUSED: {line}")
    comm.bcast(problems, root=0)
    if problems:
        raise FitRejected(problems, machine)
    return machine


def _sleep_barrier(comm, longest: float = 0.02):
    """A barrier whose waiting ranks sleep (short, growing naps) instead of spinning."""
    quiet_barrier(comm, longest)
