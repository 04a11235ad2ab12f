"""How busy the machine is with work that is not ours (Linux ``/proc``; pure stdlib).

Timings on a shared machine are only worth keeping when nothing else competes for the
cores. :func:`foreign_cpu` measures the cores' worth of CPU that processes outside our
own process tree used over a short interval; :func:`wait_for_quiet` waits until that
drops below a limit; :func:`snapshot` records it with the load average and the time,
for the provenance of a measurement (``Machine.fit_conditions``).

"Ours" is this process and its descendants (the launcher of an ``mpiexec`` and every
rank under it), plus the trees of any ``exclude`` pids: a rank that measures the load
passes the pids of its job's other ranks, which are its siblings, not its children.

No MPI here: a rank that calls these does its own communication.
"""

from __future__ import annotations

import datetime as _dt
import os
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
        if pid not in b and pid not in mine and ppid in b:
            used -= t + c   # ended and reaped: its parent's children time has its whole life
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
