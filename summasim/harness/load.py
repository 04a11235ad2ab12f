"""How busy the machine is with work that is not ours (Linux ``/proc``; pure stdlib).

Timings on a shared machine are only worth keeping when nothing else competes for the
cores. :func:`foreign_cpu` measures the cores' worth of CPU that processes outside our
own process tree used over a short interval; :func:`wait_for_quiet` waits until that
drops below a limit; :func:`snapshot` records it with the load average and the time,
for the provenance of a measurement (``Machine.fit_conditions``). :class:`LoadWatch`
measures the foreign CPU over the whole of a timed interval (the machine's busy time in
``/proc/stat`` less our own processes'), so that load which appears only while or after
the timed work runs is seen too; benchmarks and the main job mark their rows and reports
with its :func:`interval_load` record. :class:`FitLock` is the one lock every machine fit
takes, so that two fits never measure each other.

"Ours" is this process and its descendants (the launcher of an ``mpiexec`` and every
rank under it), plus the trees of any ``exclude`` pids: a rank that measures the load
passes the pids of its job's other ranks, which are its siblings, not its children.

No MPI here: a rank that calls these does its own communication.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import tempfile
import time
from typing import Callable, Iterable

#: Foreign load, in cores, above which a measurement counts as taken on a busy machine.
BUSY_CORES = 0.25


def _proc_cpu_ticks() -> dict[int, tuple[int, int, int]]:
    """``{pid: (ppid, utime + stime, cutime + cstime)}`` ticks of every process (Linux
    /proc); the last is the CPU of its children that it has waited for."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2:].split()
        try:
            out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]),
                              int(rest[13]) + int(rest[14]))
        except (IndexError, ValueError):
            continue
    return out


def _descendants(procs: dict, root: int) -> set[int]:
    """``root`` and every process below it in ``procs`` (``{pid: (ppid, ...)}``)."""
    kids: dict = {}
    for pid, row in procs.items():
        kids.setdefault(row[0], []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(kids.get(pid, ()))
    return out


def foreign_cpu(interval: float = 1.0, exclude: Iterable[int] = ()) -> float:
    """Cores' worth of CPU used by processes outside this process tree over
    ``interval`` seconds (0.0 where /proc is unavailable).

    Parameters
    ----------
    interval : float
        Seconds between the two readings of ``/proc/*/stat``.
    exclude : iterable of int
        More pids whose process trees count as ours (the other ranks of this job).

    Returns
    -------
    float
        CPU seconds per second (cores) used by everything else, short-lived processes
        included: one that started inside the interval counts whole, one that ended
        counts through its parent's reaped-children time (a test suite's many short
        processes are most of the load when agents share a machine).
    """
    if not os.path.isdir("/proc"):
        return 0.0
    t0 = time.monotonic()
    a = _proc_cpu_ticks()
    t1 = time.monotonic()
    time.sleep(interval)
    t2 = time.monotonic()
    b = _proc_cpu_ticks()
    t3 = time.monotonic()
    elapsed = max((t2 + t3) / 2 - (t0 + t1) / 2, 1e-3)  # reading /proc takes 20-40 ms
    mine = _descendants(b, os.getpid()) | _descendants(a, os.getpid())
    for pid in exclude:
        mine |= _descendants(b, int(pid)) | _descendants(a, int(pid))
    mine.add(0)
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = 0
    for pid, (_, t, c) in b.items():
        if pid in mine:
            continue
        if pid in a:   # its own CPU in the interval, and its children reaped in it
            used += (t - a[pid][1]) + (c - a[pid][2])
        else:          # started inside the interval: all of its CPU is in it
            used += t + c
    for pid, (ppid, t, c) in a.items():
        if pid in b or pid in mine:
            continue
        # ended in the interval: its whole life reached the children time of its nearest
        # living ancestor (through parents that ended too: timeout -> mpiexec -> python),
        # which counts from the interval's start: take back what it had used before
        up = ppid
        while up in a and up not in b:
            up = a[up][0]
        if up in b and up not in mine:
            used -= t + c
    return max(0.0, used / hz / elapsed)


def wait_for_quiet(limit: float = BUSY_CORES, max_wait: float = 600.0,
                   say: Callable[[str], None] = print) -> float:
    """Wait until other processes use less than ``limit`` cores (at most ``max_wait``
    seconds); return the foreign load last seen."""
    t0 = time.time()
    load = foreign_cpu()
    told = False
    while load > limit and time.time() - t0 < max_wait:
        if not told:
            say(f"  other processes use {load:.2f} cores; waiting for a quiet machine "
                f"(up to {max_wait:.0f} s)")
            told = True
        time.sleep(5.0)
        load = foreign_cpu()
    return load


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):  # pragma: no cover
        return 0.0


def snapshot(interval: float = 0.3, exclude: Iterable[int] = ()) -> dict:
    """``{"foreign_cpu": cores, "loadavg": 1-min load, "time": ISO UTC}`` now: the
    foreign CPU over ``interval`` seconds (see :func:`foreign_cpu`)."""
    foreign = foreign_cpu(interval, exclude)
    return {"foreign_cpu": round(foreign, 3), "loadavg": round(load_average(), 2),
            "time": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


# --------------------------------------------------------------------------- intervals
def _cpu_busy_ticks() -> int | None:
    """Ticks all CPUs spent busy since boot (``/proc/stat``: every state but idle and
    iowait, steal included: another VM on our cores is other work too); None where
    there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    try:
        ticks = [int(x) for x in fields[1:]]
    except ValueError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    return sum(ticks[:8]) - sum(ticks[3:5])


def read_counters(exclude: Iterable[int] = ()) -> dict:
    """One reading of the load counters (THE load reader; tests replace it):
    ``{"t": monotonic seconds, "busy": CPU-busy ticks of the machine or None,
    "ours": {pid: ticks} of this process tree and those of ``exclude`` or None,
    "loadavg": 1-minute load average or None, "hz": ticks per second}``."""
    busy = _cpu_busy_ticks()
    ours = None
    if busy is not None:
        procs = _proc_cpu_ticks()
        mine = _descendants(procs, os.getpid())
        for pid in exclude:
            mine |= _descendants(procs, int(pid))
        ours = {pid: procs[pid][1] + procs[pid][2] for pid in mine if pid in procs}
    try:
        avg = float(os.getloadavg()[0])
    except (OSError, AttributeError):
        avg = None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return {"t": time.monotonic(), "busy": busy, "ours": ours, "loadavg": avg, "hz": hz}


def interval_load(a: dict, b: dict, limit: float = BUSY_CORES, ranks: int = 1) -> dict:
    """How much other work ran between two :func:`read_counters` readings.

    Returns ``{"foreign_cpu": cores or None, "loadavg_before", "loadavg_after",
    "seconds", "limit", "quiet": bool or None, "source"}``: with ``/proc``
    (``source="proc"``) the cores' worth of CPU the machine was busy beyond our own
    processes over the whole interval; without it (``"loadavg"``) an estimate from the
    load average (the larger reading less our ``ranks``: coarse, a one-minute
    average that lags); with neither (``"none"``) nothing is known and ``quiet`` is
    None. ``quiet``: the foreign CPU is at most ``limit``.
    """
    seconds = max(b["t"] - a["t"], 1e-6)
    foreign, source = None, "none"
    if a["busy"] is not None and b["busy"] is not None and a["ours"] is not None \
            and b["ours"] is not None:
        ours = sum(t - a["ours"].get(pid, 0) for pid, t in b["ours"].items())
        foreign = max(0.0, (b["busy"] - a["busy"] - ours) / b["hz"] / seconds)
        source = "proc"
    elif a["loadavg"] is not None and b["loadavg"] is not None:
        foreign = max(0.0, max(a["loadavg"], b["loadavg"]) - ranks)
        source = "loadavg"
    return {"foreign_cpu": None if foreign is None else round(foreign, 3),
            "loadavg_before": a["loadavg"], "loadavg_after": b["loadavg"],
            "seconds": round(seconds, 3), "limit": limit,
            "quiet": None if foreign is None else bool(foreign <= limit), "source": source}


class LoadWatch:
    """The foreign load over timed work, measured on rank 0 of ``world`` (its node):
    :meth:`lap` returns the :func:`interval_load` since the last lap (or the start),
    :meth:`stop` the one since the start. Building it is collective (the ranks' pids,
    so that our own ranks are not counted as other work); the readings are rank 0's
    alone, so they cost the other ranks nothing. Other ranks get None from both, and so
    does every rank when ``timed`` is False (nothing is timed: no time can include other
    work). ``world`` None: this process alone."""

    def __init__(self, world=None, limit: float = BUSY_CORES, exclude: Iterable[int] = (),
                 timed: bool = True):
        pids = world.allgather(os.getpid()) if world is not None else [os.getpid()]
        self.root = (world is None or world.Get_rank() == 0) and bool(timed)
        self.exclude = [int(p) for p in list(pids) + list(exclude)]
        self.limit, self.ranks = limit, len(set(pids))
        self.first = self.last = read_counters(self.exclude) if self.root else None

    def lap(self) -> dict | None:
        if not self.root:
            return None
        now = read_counters(self.exclude)
        out = interval_load(self.last, now, self.limit, self.ranks)
        self.last = now
        return out

    def stop(self) -> dict | None:
        if not self.root:
            return None
        self.last = read_counters(self.exclude)
        return interval_load(self.first, self.last, self.limit, self.ranks)


def combine(records: Iterable[dict | None]) -> dict | None:
    """One record for several intervals: the busiest one's (its foreign CPU), ``quiet``
    only when every interval was quiet (None when any is unknown and none busy)."""
    recs = [r for r in records if r]
    if not recs:
        return None
    known = [r for r in recs if r["foreign_cpu"] is not None]
    worst = max(known, key=lambda r: r["foreign_cpu"]) if known else recs[0]
    quiet = (False if any(r["quiet"] is False for r in recs)
             else None if any(r["quiet"] is None for r in recs) else True)
    return {**worst, "quiet": quiet, "seconds": round(sum(r["seconds"] for r in recs), 3),
            "intervals": len(recs), "busy_intervals": sum(r["quiet"] is False for r in recs)}


def fit_conditions(before: dict, after: dict, during: dict | None = None,
                   limit: float = BUSY_CORES) -> dict:
    """A fit's ``Machine.fit_conditions`` from the :func:`snapshot` taken just before it
    (the one that decided to fit), the one just after, and the busiest interval during
    it (:func:`combine` of :class:`LoadWatch` laps): busy when any of them saw more than
    ``limit`` cores of other work, so the mark and every warning come from the same
    readings."""
    seen = [before["foreign_cpu"], after["foreign_cpu"]]
    if during is not None and during.get("foreign_cpu") is not None:
        seen.append(during["foreign_cpu"])
    out = {"foreign_cpu_before": before["foreign_cpu"],
           "foreign_cpu_after": after["foreign_cpu"],
           "loadavg": max(before["loadavg"], after["loadavg"]),
           "time": before["time"], "limit": limit, "busy": bool(max(seen) > limit)}
    if during is not None and during.get("foreign_cpu") is not None:
        out["foreign_cpu_during"] = during["foreign_cpu"]
    return out


def describe(rec: dict | None) -> str:
    """One phrase for a record: "quiet (other processes used 0.02 cores)", "BUSY: ...",
    or "load not measured"."""
    if not rec or rec["quiet"] is None:
        return "load not measured (no /proc and no load average)"
    how = ("other processes used" if rec["source"] == "proc"
           else "load average above our ranks by")
    text = f"{how} {rec['foreign_cpu']:.2f} cores"
    if rec.get("loadavg_after") is not None:
        text += f", load average {rec['loadavg_after']:.1f} (ours included)"
    return ("quiet (" if rec["quiet"] else "BUSY: ") + text + (")" if rec["quiet"] else "")


def mark(rec: dict | None) -> str:
    """A row's load column: "quiet", "BUSY 1.23" (cores of other work), or "?"."""
    if not rec or rec["quiet"] is None:
        return "?"
    return "quiet" if rec["quiet"] else f"BUSY {rec['foreign_cpu']:.2f}"


def warning(rec: dict | None, what: str, why: str = "those times include it") -> str | None:
    """The warning line for ``what`` measured under ``rec``'s load, or None when quiet."""
    if rec is None or rec["quiet"] is not False:
        return None
    return (f"WARNING: other work ran while {what} ({describe(rec)[len('BUSY: '):]}, limit "
            f"{rec['limit']:.2f}): {why}; rerun on a quiet machine to trust them")


def warn_busy(rows: list, what: str, say) -> None:
    """Say one :func:`warning` for the ``rows`` (records with ``load``/``quiet``) that were
    timed under load: "``k`` of ``n`` ``what`` were timed (rows marked BUSY)"."""
    busy = [r for r in rows if r["quiet"] is False]
    line = warning(combine(r["load"] for r in busy),
                   f"{len(busy)} of {len(rows)} {what} were timed (rows marked BUSY)")
    if line:
        say(line)


# --------------------------------------------------------------------------- the fit lock
#: The lock every machine fit takes (:class:`FitLock`), shared by the host's users.
HOST_FIT_LOCK = os.path.join(tempfile.gettempdir(), "summasim-fit")
#: Longest wait for another fit to finish.
LOCK_WAIT = 600.0


class FitBusy(RuntimeError):
    """Another fit held the lock for longer than the wait allows."""


class FitLock:
    """An exclusive ``fcntl.flock`` on ``path + ".lock"`` (the lock file stays; removing
    it would let two jobs lock two different files). The kernel drops the lock when its
    holder dies, so a file left by a dead process blocks nobody."""

    def __init__(self, path: str):
        self.lock_path = os.fspath(path) + ".lock"
        self.fd = None
        self.waited = 0.0

    def _open(self) -> int:
        os.makedirs(os.path.dirname(os.path.abspath(self.lock_path)), exist_ok=True)
        try:
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:   # another user's lock file: a read-only fd locks too
            return os.open(self.lock_path, os.O_RDONLY)

    def acquire(self, say, max_wait: float = LOCK_WAIT, what: str = "another job is "
                "fitting the machine", then: str = "waiting for its fit instead of "
                "measuring against it") -> bool:
        """Take the lock, waiting (asleep) at most ``max_wait`` seconds; False on
        timeout. OSError when the lock file cannot be opened."""
        import fcntl

        fd = self._open()
        t0 = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if not told:
                say(f"cost model: {what} ({self.lock_path} is locked); {then}")
                told = True
            if time.monotonic() - t0 > max_wait:
                os.close(fd)
                return False
            time.sleep(0.05)
        self.fd = fd
        self.waited = time.monotonic() - t0
        if told:
            say(f"cost model: the other fit is done after {time.monotonic() - t0:.1f} s")
        return True

    def release(self) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
