"""The harness's one timer.

A timed call starts after a barrier that waits without spinning
(:func:`summasim.mpiutil.quiet_barrier`: under oversubscription a spinning barrier
steals the cores of the ranks still computing). Its time is the *span*
``max_r t1_r - min_r t0_r`` on the node's common monotonic clock: from the first
rank's start to the last rank's end. Short calls are repeated more (up to 5x
``repeats``, about ``budget`` seconds in all), since their spread is the largest.
The median span is what every front-end reports.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..mpiutil import quiet_barrier, wait_requests


def reduce_max(world, values) -> np.ndarray:
    """Element-wise maximum over ranks of a few floats, waiting without spinning."""
    from mpi4py import MPI

    send = np.asarray(values, dtype=np.float64)
    recv = np.empty_like(send)
    wait_requests(world.Iallreduce(send, recv, op=MPI.MAX), "sleep")
    return recv


def time_calls(fn, world, repeats: int, budget: float = 0.5, adaptive: bool = True) -> dict:
    """Time ``fn()`` (collective): ``{"spans", "rank_max", "median"}`` in seconds:
    per-call spans, per-call slowest-rank times and the median span."""
    spans, rank_max = [], []

    def once():
        quiet_barrier(world)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        mx = reduce_max(world, [-t0, t1, t1 - t0])
        spans.append(float(mx[1] + mx[0]))
        rank_max.append(float(mx[2]))

    once()                          # the first call sizes the rest and counts as one
    if adaptive:
        repeats = max(repeats, min(5 * repeats, int(budget / max(spans[0], 1e-6))))
    for _ in range(repeats - 1):
        once()
    return {"spans": spans, "rank_max": rank_max, "median": statistics.median(spans)}
