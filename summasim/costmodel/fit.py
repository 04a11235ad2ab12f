"""Fit a Machine from microbenchmarks: ping-pong, ring, collectives, GEMM.

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
            (:func:`gamma_reduce_from_collectives`): MPI's own reductions (temporary
            buffers, MPI_SUM loops) were 3.5x slower per byte here
single GEMM rank 0 alone at the largest GEMM size (``notes["gemm_single"]``): all
            ranks' GEMM far slower than this means other work shared the cores

Each point is the fastest of several short repetitions (9 of about 0.5 ms with
``--quick``, else 21 of about 2 ms, each averaging enough iterations to last that
long): on a shared machine other work only ever adds time, so the minimum over
short repetitions estimates the machine itself. The fit warns when the load
average exceeds the core count, and refuses (:class:`FitRejected`) a machine that
:func:`~summasim.costmodel.machine.sanity_problems` finds implausible: a regime
fitted to zero latency or infinite bandwidth, GEMM rates out of range or far below
one process alone.

alpha and beta are fitted per regime (small / large messages, split at the eager
threshold: given, or chosen as the split that fits best) by robust least squares
on relative residuals, ``scipy.optimize.least_squares(loss="soft_l1")`` on
``(alpha + beta m) / t - 1``, so that 8-byte and 64-MiB points weigh alike and
outliers (a descheduled rank) do not drag the line. When latency hides the small
regime's slope (its few sizes, timed on a noisy or oversubscribed machine, give beta at
the bound or a bandwidth above any link's), it takes the large regime's beta (no message
moves its bytes faster than the large-message path) or, where its points do not bear
that out, the fastest link's (latency alone), whichever fits them better, and only its
alpha is fitted: one unresolved slope should not refuse the whole machine. The fit quality printed per
regime is the median relative error. The collectives are then predicted with
the fitted machine and the MPICH-selected algorithm, and their median relative
error is printed too: a check of the whole model, not part of the fit.

Oversubscription: MPICH's waiting ranks spin (``MPIR_CVAR_POLLS_BEFORE_YIELD`` =
1000 polls before a yield), so any rank idle in a barrier or a receive burns a
core. Run the fit with no more ranks than cores (here: 2); with more, every number
includes time-sharing and the model would apply the slowdown twice.

Only :func:`run_fit` and :func:`main` import mpi4py (lazily); the fitting functions
are pure and testable without MPI.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .collectives import collective_time
from .machine import MAX_LINK_BANDWIDTH, Link, Machine, SharedCore, sanity_problems

MiB = 1 << 20


class FitRejected(RuntimeError):
    """A fit that :func:`~summasim.costmodel.machine.sanity_problems` refuses.

    Raised by :func:`run_fit` on every rank alike. ``problems`` lists what is wrong;
    ``machine`` is the refused Machine on rank 0 (None elsewhere), for a report.
    """

    def __init__(self, problems, machine=None):
        self.problems = list(problems)
        self.machine = machine
        super().__init__("the machine fit is physically implausible, refused: "
                         + "; ".join(self.problems)
                         + " (other work on the machine, or too few points: refit on a "
                           "quiet machine)")


@dataclass
class LinearFit:
    """``t = alpha + beta * m`` over some points (seconds, seconds/byte)."""

    alpha: float
    beta: float
    median_rel_err: float
    n: int

    def predict(self, sizes):
        return self.alpha + self.beta * np.asarray(sizes, float)


@dataclass
class RegimeFit:
    """Two regimes split at ``threshold`` bytes (small: m < threshold), and an
    optional third from ``huge_threshold`` on."""

    small: LinearFit
    large: LinearFit
    threshold: int
    huge: LinearFit | None = None
    huge_threshold: int | None = None

    def link(self) -> Link:
        extra = {}
        if self.huge is not None:
            extra = dict(huge_threshold=int(self.huge_threshold), alpha_huge=self.huge.alpha,
                         beta_huge=self.huge.beta)
        return Link(self.small.alpha, self.small.beta, self.large.alpha, self.large.beta,
                    int(self.threshold), **extra)

    def regimes(self):
        """``[(name, LinearFit, from_bytes)]`` of the fitted regimes."""
        out = [("small", self.small, 0), ("large", self.large, self.threshold)]
        if self.huge is not None:
            out.append(("huge", self.huge, self.huge_threshold))
        return out


def _soft_l1(r, scale):
    z = (r / scale) ** 2
    return float(np.sum(2.0 * (np.sqrt(1.0 + z) - 1.0)))


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *,
                   f_scale: float = 0.05, beta: float | None = None) -> LinearFit:
    """Robust fit of ``t = alpha + beta m`` with relative residuals (``alpha`` alone
    when ``beta`` is given).

    Parameters
    ----------
    sizes : sequence of float
        Message sizes m, bytes.
    times : sequence of float
        Measured seconds (> 0).
    f_scale : float
        Relative error beyond which a point counts as an outlier (soft L1).

    Returns
    -------
    LinearFit
        alpha (seconds) and beta (seconds/byte), both >= 0, and the median
        relative error of the fit.
    """
    from scipy.optimize import least_squares

    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    if m.shape != t.shape or m.size < 2:
        raise ValueError(f"need >= 2 (size, time) pairs of equal length, got {m.size}, {t.size}")
    if np.any(t <= 0) or np.any(m < 0):
        raise ValueError("times must be > 0 and sizes >= 0")
    # scale to microseconds and nanoseconds per byte so both unknowns are O(1)
    a_s, b_s = 1e-6, 1e-9
    w = 1.0 / t
    A = np.column_stack([w * a_s, w * m * b_s])
    x0, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    x0 = np.maximum(x0, 1e-6)

    def resid(x):
        return (x[0] * a_s + x[1] * b_s * m) / t - 1.0

    if beta is not None:                    # alpha alone, the slope given
        fixed = float(beta)
        res = least_squares(lambda x: resid([x[0], fixed / b_s]), x0[:1], bounds=(0.0, np.inf),
                            loss="soft_l1", f_scale=f_scale, x_scale="jac")
    else:
        res = least_squares(resid, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=f_scale,
                            x_scale="jac")
    alpha = float(res.x[0] * a_s)
    beta = fixed if beta is not None else float(res.x[1] * b_s)
    rel = np.abs((alpha + beta * m) / t - 1.0)
    return LinearFit(alpha, beta, float(np.median(rel)), int(m.size))


def _unresolved(fit: LinearFit) -> bool:
    """The fit's slope sits at the bound or implies a bandwidth no link has: latency
    hides it at these sizes (a few small messages, timed on a noisy or oversubscribed
    machine)."""
    return fit.beta <= 0 or 1.0 / fit.beta > MAX_LINK_BANDWIDTH


def _small_and_large(m, t, lo, hi, f_scale):
    """The two regimes' fits. A small regime whose slope the latency hides is given one:
    the large regime's (no message moves its bytes faster than the large-message path)
    or, when the small points do not bear that out, the fastest link's
    (``MAX_LINK_BANDWIDTH``: latency alone), whichever fits its points better; so the
    fit is not refused for an infinite bandwidth that no point measured."""
    fl = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale)
    fs = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale)
    if _unresolved(fs):
        slopes = [1.0 / MAX_LINK_BANDWIDTH] + ([fl.beta] if not _unresolved(fl) else [])
        fits = [fit_alpha_beta(m[lo], t[lo], f_scale=f_scale, beta=b) for b in slopes]
        fs = min(fits, key=lambda f: _soft_l1(f.predict(m[lo]) / t[lo] - 1, f_scale))
    return fs, fl


def fit_regimes(sizes: Sequence[float], times: Sequence[float], threshold: int | None = None,
                *, min_points: int = 3, f_scale: float = 0.05,
                max_split: float | None = None) -> RegimeFit:
    """Fit small- and large-message regimes.

    ``threshold`` (bytes) splits them (small: m < threshold); None tries every
    split leaving ``min_points`` on each side (and at most ``max_split`` bytes)
    and keeps the one with the smallest total soft-L1 relative loss. With too few
    points both regimes get one fit.
    """
    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    order = np.argsort(m)
    m, t = m[order], t[order]
    if threshold is None:
        cands = [c for c in np.unique(m)
                 if (m < c).sum() >= min_points and (m >= c).sum() >= min_points
                 and (max_split is None or c <= max_split)]
        if not cands:
            one = fit_alpha_beta(m, t, f_scale=f_scale)
            return RegimeFit(one, one, int(m.max()) + 1)
        best = None
        for c in cands:
            lo, hi = m < c, m >= c
            fs, fl = _small_and_large(m, t, lo, hi, f_scale)
            loss = (_soft_l1(fs.predict(m[lo]) / t[lo] - 1, f_scale)
                    + _soft_l1(fl.predict(m[hi]) / t[hi] - 1, f_scale))
            if best is None or loss < best[0]:
                best = (loss, RegimeFit(fs, fl, int(c)))
        return best[1]
    lo, hi = m < threshold, m >= threshold
    if lo.sum() < 2 or hi.sum() < 2:
        one = fit_alpha_beta(m, t, f_scale=f_scale)
        fs = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale) if lo.sum() >= 2 else one
        fl = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale) if hi.sum() >= 2 else one
        return RegimeFit(fs, fl, int(threshold))
    return RegimeFit(*_small_and_large(m, t, lo, hi, f_scale), int(threshold))


def library_eager_threshold(version: str) -> tuple[int | None, str]:
    """The byte size at which the MPI library named by ``version`` (the text of
    ``MPI.Get_library_version()``) changes protocol within a node, and why; ``(None,
    "best split")`` for a library whose threshold summasim does not know.

    MPICH ch4 sends messages below 8 KiB through its shared-memory eager cells and
    larger ones with the CMA single-copy protocol from
    ``MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD`` (default 8192, read from the environment
    when set).
    """
    if "MPICH" in version:
        raw = os.environ.get("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", "8192")
        try:
            return int(raw), "MPICH ch4: shm eager cells below it, CMA single copy from it"
        except ValueError:
            pass
    return None, "best split"


def split_huge(rf: RegimeFit, sizes, times, *, min_bytes: int = 1 << 20, min_points: int = 3,
               f_scale: float = 0.05, min_gain: float = 0.25) -> RegimeFit:
    """Split ``rf``'s large regime once more where that fits markedly better.

    Tries every split at or above ``min_bytes`` that leaves ``min_points`` on each
    side; keeps the best one when it lowers the large regime's soft-L1 loss by at
    least ``min_gain`` (a fraction), else (or when the large regime already fits
    within 1% median) returns ``rf`` unchanged. (On Linux,
    NumPy's arrays of 4 MiB and up sit on transparent huge pages and move faster.)
    """
    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    big = m >= rf.threshold
    m, t = m[big], t[big]
    if rf.large.median_rel_err < 0.01:           # one line already fits
        return rf
    base = _soft_l1(rf.large.predict(m) / t - 1, f_scale)
    best = None
    for c in np.unique(m):
        lo, hi = m < c, m >= c
        if c < min_bytes or lo.sum() < min_points or hi.sum() < min_points:
            continue
        fl = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale)
        fh = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale)
        loss = (_soft_l1(fl.predict(m[lo]) / t[lo] - 1, f_scale)
                + _soft_l1(fh.predict(m[hi]) / t[hi] - 1, f_scale))
        if best is None or loss < best[0]:
            best = (loss, fl, fh, int(c))
    if best is None or best[0] > (1.0 - min_gain) * base:
        return rf
    return RegimeFit(rf.small, best[1], rf.threshold, best[2], best[3])


def median_rel_err(predicted, measured) -> float:
    """``median |predicted / measured - 1|``."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return float(np.median(np.abs(p / m - 1.0)))


def log_sizes(min_bytes: int = 8, max_bytes: int = 64 * MiB, factor: int = 2) -> list[int]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (inclusive)."""
    out, s = [], int(min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


# -- MPI microbenchmarks ------------------------------------------------------------------
def _touched(nbytes: int) -> np.ndarray:
    """A byte buffer whose pages are all written: ``np.zeros`` maps the shared zero
    page lazily, so a message read from it (or received into a fresh one) measures
    page faults and the zero page, not the copies a real algorithm's buffers see."""
    buf = np.empty(max(nbytes, 1), np.uint8)
    buf.fill(1)
    return buf[:nbytes]


class _Bench:
    """Timing helpers on an mpi4py communicator (rank 0 reports)."""

    def __init__(self, comm, target_s, reps, say):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.target_s, self.reps, self.say = target_s, reps, say

    def _iters(self, once_s):
        """Iterations per repetition so that one repetition lasts about target_s."""
        return int(max(1, min(10000, self.target_s / max(once_s, 1e-7))))

    def _agree(self, x):
        return self.comm.allreduce(x, op=self.MPI.MAX)

    def pingpong(self, nbytes):
        """Fastest half round trip (seconds) between ranks 0 and 1 over the repetitions."""
        comm, MPI = self.comm, self.MPI
        buf = _touched(nbytes)
        samples = []
        iters = None
        for rep in range(self.reps + 1):
            comm.Barrier()
            n = 1 if iters is None else iters
            t0 = MPI.Wtime()
            if self.rank == 0:
                for _ in range(n):
                    comm.Send([buf, MPI.BYTE], dest=1, tag=7)
                    comm.Recv([buf, MPI.BYTE], source=1, tag=7)
            elif self.rank == 1:
                for _ in range(n):
                    comm.Recv([buf, MPI.BYTE], source=0, tag=7)
                    comm.Send([buf, MPI.BYTE], dest=0, tag=7)
            dt = (MPI.Wtime() - t0) / (2 * n)
            if iters is None:  # the first round only sizes the loop
                iters = self._iters(self._agree(dt) * 2)
                iters = comm.bcast(iters, root=0)
                continue
            samples.append(dt)
        return comm.bcast(float(np.min(samples)) if self.rank == 0 else None, root=0)

    def _timed(self, fn, comm):
        """Fastest repetition of the slowest rank's time per call of ``fn``."""
        MPI = self.MPI
        samples = []
        iters = None
        for rep in range(self.reps + 1):
            comm.Barrier()
            n = 1 if iters is None else iters
            t0 = MPI.Wtime()
            for _ in range(n):
                fn()
            dt = comm.allreduce((MPI.Wtime() - t0) / n, op=MPI.MAX)
            if iters is None:
                iters = self._iters(dt)
                continue
            samples.append(dt)
        return float(np.min(samples))

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
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    np.matmul(a, b, out=c)
    t0 = time.perf_counter()
    np.matmul(a, b, out=c)
    once = time.perf_counter() - t0
    iters = int(max(1, min(1000, 0.002 / max(once, 1e-7))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            np.matmul(a, b, out=c)
        samples.append((time.perf_counter() - t0) / iters)
    return float(np.min(samples))


def _reduce_seconds_per_byte(nbytes, reps):
    x = np.ones(nbytes // 8)
    y = np.ones_like(x)
    np.add(x, y, out=x)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.add(x, y, out=x)
        samples.append(time.perf_counter() - t0)
    return float(np.min(samples)) / x.nbytes


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
        (``perf_counter`` is the node's monotonic clock, so ``comm`` should be one node's
        ranks)."""
        from mpi4py import MPI

        from ..mpiutil import quiet_barrier

        a, b = self.a, self.b
        quiet_barrier(comm)
        t0 = time.perf_counter()
        for _ in range(adds):
            np.add(a, b, out=b)
        t1 = time.perf_counter()
        span = comm.allreduce(t1, op=MPI.MAX) - comm.allreduce(t0, op=MPI.MIN)
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def _phys_mem() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0.0


def run_fit(comm=None, *, quick: bool = False, max_bytes: int | None = None,
            group_sizes: Sequence[int] | None = None, gemm_sizes: Sequence[int] | None = None,
            dtypes: Sequence[str] = ("float64", "float32"), threshold: int | None = None,
            name: str | None = None, command: str | None = None,
            say: Callable[[str], None] | None = None, check: bool = True) -> Machine | None:
    """Run the microbenchmarks on ``comm`` (COMM_WORLD) and fit a Machine.

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

    Returns
    -------
    Machine on rank 0, None on the other ranks.

    Raises
    ------
    FitRejected
        On every rank, when ``check`` and the fitted machine has problems (an
        infinite bandwidth, a zero latency, GEMM far slower with all ranks busy than
        one process alone, ...).
    """
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise ValueError("the fit needs at least 2 MPI ranks (mpiexec -n 2 ...)")
    if say is None:
        say = (lambda msg: print(f"[fit] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    cores = _cores()
    if size > cores:
        say(f"WARNING: {size} ranks on {cores} cores: waiting ranks spin and share the cores; "
            f"the measured numbers include time-sharing")
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover
        load = 0.0
    if load > cores:
        say(f"WARNING: load average {load:.1f} on {cores} cores: other work is running, "
            f"expect noisy numbers (each point keeps the fastest repetition)")
    max_bytes = max_bytes or (4 * MiB if quick else 64 * MiB)
    sizes = log_sizes(8, max_bytes, 4 if quick else 2)
    reps = 9 if quick else 21
    bench = _Bench(comm, 0.0005 if quick else 0.002, reps, say)
    t_start = time.time()

    say(f"{size} ranks, {cores} cores, {MPI.Get_library_version().splitlines()[0].strip()}")
    say(f"ping-pong between ranks 0 and 1, {len(sizes)} sizes {sizes[0]} B .. {sizes[-1]} B")
    pp = []
    for _ in range(3):          # warm up: the first exchanges set up MPICH's shared queues
        bench.pingpong(sizes[0])
    for s in sizes:
        t = bench.pingpong(s)
        pp.append(t)
        say(f"  ping-pong {s:>10d} B  {t * 1e6:10.2f} us  {s / t / 1e9 if t else 0:7.2f} GB/s")
    say("ring sendrecv (every rank to its right neighbour)")
    ring = []
    ring_sizes = sizes[::2] if not quick else sizes
    for s in ring_sizes:
        t = bench.ring(s)
        ring.append(t)
        say(f"  ring      {s:>10d} B  {t * 1e6:10.2f} us")

    if group_sizes is None:
        group_sizes = sorted({g for g in (2 ** i for i in range(1, size.bit_length()))
                              if g <= size} | {size})
    coll_sizes = [s for s in sizes if s >= 64][:: (2 if quick else 3)]
    colls = []
    for g in group_sizes:
        if not 2 <= g <= size:
            continue
        color = rank // g if rank < (size // g) * g else MPI.UNDEFINED
        sub = comm.Split(color, rank)
        for op in ("bcast", "reduce", "allreduce"):
            for s in coll_sizes:
                t = bench.collective(op, sub, s) if sub != MPI.COMM_NULL else None
                t = comm.bcast(t, root=0)
                colls.append((op, g, s, t))
                say(f"  {op:<9s} g={g:<3d} {s:>10d} B  {t * 1e6:10.2f} us")
        if sub != MPI.COMM_NULL:
            sub.Free()
        comm.Barrier()

    if gemm_sizes is None:
        gemm_sizes = (64, 256, 1024) if quick else (32, 64, 128, 256, 512, 1024, 2048)
    gamma_gemm = {}
    with threadpool_limits(limits=1):
        for dt in dtypes:
            pts = []
            for n in gemm_sizes:
                comm.Barrier()
                t = _gemm_seconds(int(n), dt, 5 if quick else 9)
                t = float(np.median(comm.allgather(t)))
                g = t / (2.0 * n ** 3)
                pts.append((float(n), g))
                say(f"  gemm {dt:<8s} n={n:<5d} {t * 1e3:9.3f} ms  {1 / g / 1e9:7.2f} GFLOP/s/rank")
            gamma_gemm[dt] = pts
        # one process alone at the largest size, the others asleep: the reference that
        # tells all ranks' GEMM apart from cores shared with other work
        n1, dt1 = int(max(gemm_sizes)), dtypes[0]
        comm.Barrier()
        g1 = _gemm_seconds(n1, dt1, 5 if quick else 9) / (2.0 * n1 ** 3) if rank == 0 else None
        _sleep_barrier(comm)
        g1 = comm.bcast(g1, root=0)
        say(f"  gemm {dt1:<8s} n={n1:<5d} one process alone {1 / g1 / 1e9:7.2f} GFLOP/s")
        comm.Barrier()
        gr = _reduce_seconds_per_byte((1 if quick else 8) * MiB, 5)
        gr = float(np.median(comm.allgather(gr)))
        say(f"  reduction a += b: {gr * 1e9:.3f} ns/B ({1 / gr / 1e9:.2f} GB/s)")
    bandwidth, cache = node_memory(comm, say)

    if rank != 0:
        problems = comm.bcast(None, root=0)
        if problems:
            raise FitRejected(problems)
        return None
    how = "given"
    if threshold is None:
        threshold, how = library_eager_threshold(MPI.Get_library_version())
    rf = split_huge(fit_regimes(sizes, pp, threshold, max_split=MiB), sizes, pp)
    say(f"fit: large-message regime from {rf.threshold} B ({how})")
    if rf.huge is not None:
        say(f"fit: third regime from {rf.huge_threshold} B (best split at 1 MiB or more; "
            f"NumPy puts arrays of 4 MiB and up on transparent huge pages)")
    for tag, f, _ in rf.regimes():
        bw = f"{1 / f.beta / 1e9:7.2f} GB/s" if f.beta > 1e-15 else "    inf GB/s"
        say(f"  {tag:<5s} alpha = {f.alpha * 1e6:8.3f} us  beta = {f.beta * 1e9:8.4f} ns/B "
            f"({bw})  "
            f"median rel err {f.median_rel_err:.1%} over {f.n} points")
    host = platform.node() or "host"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = Machine(
        name=name or f"fit-{host}",
        source=(f"summasim.costmodel fit on {host}, {date}, {size} ranks, "
                f"{MPI.Get_library_version().splitlines()[0].strip()}"),
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
        say(f"gamma_reduce: numpy a += b {gr * 1e9:.3f} ns/B (summasim's reductions), "
            f"inside MPI reduce/allreduce {g_mpi * 1e9:.3f} ns/B; MPI's: "
            f"{max(gr, g_mpi) * 1e9:.3f} ns/B")
        machine = machine.replace(gamma_reduce=gr, gamma_reduce_mpi=max(gr, g_mpi),
                                  notes={**machine.notes, "gamma_reduce_numpy": gr,
                                         "gamma_reduce_mpi": g_mpi})
    # check the whole model on what was not fitted
    pred = [machine.link().time(s) for s in ring_sizes]
    say(f"check: ring sendrecv predicted vs measured, median rel err "
        f"{median_rel_err(pred, ring):.1%}")
    checks = {}
    for op in ("bcast", "reduce", "allreduce"):
        rows = [(g, s, t) for o, g, s, t in colls if o == op and t]
        if rows:
            pr = [collective_time(op, s, g, machine, reduce_impl="mpi") for g, s, _ in rows]
            algs = sorted({c.algorithm for c in pr})
            err = median_rel_err([c.seconds for c in pr], [t for *_, t in rows])
            checks[op] = err
            say(f"check: {op:<9s} median rel err {err:.1%} (model: {', '.join(algs)}"
                f"{'; gamma_reduce fitted on its large points' if op != 'bcast' else ''})")
    machine = machine.replace(notes={**machine.notes, "check_median_rel_err": checks})
    problems = sanity_problems(machine) if check else []
    for line in problems:
        say(f"REFUSED: {line}")
    comm.bcast(problems, root=0)
    if problems:
        raise FitRejected(problems, machine)
    return machine


def _sleep_barrier(comm, longest: float = 0.02):
    """A barrier whose waiting ranks sleep (short, growing naps) instead of spinning."""
    from ..mpiutil import quiet_barrier

    quiet_barrier(comm, longest)


def gamma_reduce_from_collectives(machine: Machine, colls, min_bytes: int = 65536):
    """Median seconds/byte of reduction implied by measured reduces and all-reduces.

    For each ``(op, group size, nbytes, seconds)`` with ``nbytes >= min_bytes``, the
    model time is ``t0 + g c`` (``t0`` with gamma_reduce = 0, ``c`` the reduced bytes
    of the algorithm MPICH picks); solve for g. None when there is no such point.
    """
    est = []
    zero = machine.replace(gamma_reduce=0.0, gamma_reduce_mpi=0.0)
    one = machine.replace(gamma_reduce=1.0, gamma_reduce_mpi=1.0)
    for op, g, s, t in colls:
        if op not in ("reduce", "allreduce") or not t or s < min_bytes:
            continue
        t0 = collective_time(op, s, g, zero, reduce_impl="mpi").seconds
        c = collective_time(op, s, g, one, reduce_impl="mpi").seconds - t0
        if c > 0:
            est.append(max(0.0, (t - t0) / c))
    return float(np.median(est)) if est else None


# -- models fitted on timed runs of summasim itself (the accuracy benchmark) -----------------
def fit_nonneg_linear(X, y, *, f_scale: float = 0.05) -> tuple[np.ndarray, float]:
    """Robust fit of ``y = X c`` with ``c >= 0`` on relative residuals ``X c / y - 1``.

    Parameters
    ----------
    X : array (n, k)
        Features, one row per measured run (any units; columns are rescaled to
        O(1) internally so that seconds and bytes can sit side by side).
    y : array (n,)
        Measured values (> 0).
    f_scale : float
        Relative error beyond which a run counts as an outlier (soft L1).

    Returns
    -------
    (coefficients, median relative error)
    """
    from scipy.optimize import least_squares

    X = np.asarray(X, float)
    y = np.asarray(y, float)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X must be (n, k) with n = len(y), got {X.shape} and {y.shape}")
    if X.shape[0] < X.shape[1]:
        raise ValueError(f"need at least {X.shape[1]} runs to fit {X.shape[1]} coefficients, "
                         f"got {X.shape[0]}")
    if np.any(y <= 0) or np.any(X < 0) or not np.all(np.isfinite(X)):
        raise ValueError("measured values must be > 0 and features finite and >= 0")
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    A = X / scale / y[:, None]
    x0 = np.maximum(np.linalg.lstsq(A, np.ones_like(y), rcond=None)[0], 1e-3)

    def resid(c):
        return A @ c - 1.0

    res = least_squares(resid, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=f_scale,
                        x_scale="jac")
    coef = res.x / scale
    return coef, float(np.median(np.abs(X @ coef / y - 1.0)))


def fit_shared_core(samples) -> tuple["SharedCore", float]:
    """Fit the oversubscription model of :class:`~summasim.costmodel.machine.SharedCore`.

    ``samples``: ``(R, features, measured_seconds)`` per timed run with R > 1
    (ranks per core), ``features`` a
    :class:`~summasim.costmodel.predict.SharedFeatures` (per-rank CPU work, critical-path
    hops and their bytes, polled and waited for inside MPI). The model is ``t / R =
    work_factor W + hop_seconds H + mpi_hop_seconds H_mpi + hop_seconds_per_byte B +
    mpi_hop_seconds_per_byte B_mpi + sync_seconds``, fitted by
    :func:`fit_nonneg_linear`, where W leaves out the link copies of the hops that
    waited inside MPI when their bytes have a price of their own
    (:meth:`~summasim.costmodel.machine.SharedCore.charged_work`). When no run has a
    hop that waited inside MPI, ``mpi_hop_seconds`` cannot be fitted and is left None
    (such a hop is then priced as a polled one); when none carried bytes,
    ``mpi_hop_seconds_per_byte`` is left None likewise. Returns the SharedCore and the
    fit's median relative error.
    """
    samples = list(samples)
    for R, _, _ in samples:
        if R <= 1:
            raise ValueError(f"shared-core samples need R > 1 ranks per core, got R = {R}")
    blocking = any(f.mpi_hops > 0 for _, f, _ in samples)
    blocking_bytes = any(f.mpi_hop_bytes > 0 for _, f, _ in samples)
    need = 4 + blocking + blocking_bytes
    if len(samples) < need:
        raise ValueError(f"fit_shared_core needs at least {need} runs"
                         + (" when some wait inside MPI" if need > 4 else "")
                         + f", got {len(samples)}")
    # the work term as the fitted machine will charge it (one rule: SharedCore.charged_work)
    charged = SharedCore(mpi_hop_seconds_per_byte=0.0 if blocking_bytes else None).charged_work
    rows = [[charged(f.work, f.mpi_copy), f.hops, f.hop_bytes, 1.0]
            + [f.mpi_hops] * blocking + [f.mpi_hop_bytes] * blocking_bytes
            for _, f, _ in samples]
    c, err = fit_nonneg_linear(rows, [t / R for R, _, t in samples])
    c = [float(v) for v in c]
    rest = iter(c[4:])
    return SharedCore(work_factor=c[0], hop_seconds=c[1], hop_seconds_per_byte=c[2],
                      sync_seconds=c[3],
                      mpi_hop_seconds=next(rest) if blocking else None,
                      mpi_hop_seconds_per_byte=next(rest) if blocking_bytes else None), err


def fit_elementwise(samples) -> tuple[float, float, float]:
    """Fit a machine's ``gamma_elementwise`` and ``layer_seconds`` from serial
    training steps: ``samples`` are ``(gemm_seconds, items, layers, measured)``
    with the model ``measured = gemm_seconds + gamma_elementwise items +
    layer_seconds layers`` (the GEMM time from the machine's gamma_gemm).

    Returns ``(gamma_elementwise, layer_seconds, median relative error)``.

    A step measured faster than its GEMMs alone by more than 10% means gamma_gemm
    is wrong (ValueError). Within that, a step that came out faster (the GEMM fit
    runs two ranks on two cores, a serial step one: a few % either way, measured)
    makes the fit a non-negative least squares of the residuals relative to the
    measured times, which any sign of residual can enter.
    """
    from scipy.optimize import nnls

    samples = list(samples)
    if len(samples) < 2:
        raise ValueError(f"fit_elementwise needs at least 2 runs, got {len(samples)}")
    g = np.array([s[0] for s in samples], float)
    X = np.array([[s[1], s[2]] for s in samples], float)
    t = np.array([s[3] for s in samples], float)
    rest = t - g
    if np.any(rest < -0.10 * t):
        raise ValueError("a measured step is faster than its GEMMs alone by more than 10%: "
                         "refit gamma_gemm")
    if np.all(rest > 0):
        c, _ = fit_nonneg_linear(X, rest)
    else:
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
        c = nnls(X / scale / t[:, None], rest / t)[0] / scale
    err = float(np.median(np.abs((g + X @ c) / t - 1.0)))
    return float(c[0]), float(c[1]), err
