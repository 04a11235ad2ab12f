"""Pipeline schedules (GPipe, 1F1B): the bubble, the micro-batches in flight, the step of a
pipeline of stage times, and the exposed part of a bucketed collective under compute."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

SCHEDULES = ("1f1b", "gpipe")


# -- checks ---------------------------------------------------------------------------------
def _check_int(name, val, minimum=1):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {val!r}")


def _check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


# -- the pipeline ---------------------------------------------------------------------------
def bubble_fraction(pp: int, m: int) -> float:
    """``(pp - 1) / (m + pp - 1)``: the idle share of a pipeline of ``pp`` equal stages
    running ``m`` micro-batches, for GPipe and 1F1B alike (Huang et al. 2019;
    Narayanan et al. 2021, section 2.2)."""
    _check_int("pp", pp)
    _check_int("microbatches", m)
    return (pp - 1) / (m + pp - 1)


def in_flight(pp: int, m: int, stage: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak:
    ``m`` under GPipe, ``min(m, pp - stage)`` under 1F1B."""
    _check_schedule(schedule)
    return m if schedule == "gpipe" else min(m, pp - stage)


def pipeline_time(forward: Sequence[float], backward: Sequence[float], m: int,
                  schedule: str = "1f1b") -> tuple[float, int]:
    """Seconds of ``m`` micro-batches through stages with per-micro-batch ``forward``
    and ``backward`` seconds, and the index of the critical (slowest) stage.

    GPipe: ``(m-1)(max f + max b) + sum(f + b)``; 1F1B: ``(m-1) max(f + b) + sum(f +
    b)``. Equal stages give ``(m + pp - 1)(f + b)`` for both. The bubble is this time
    minus ``m`` times the critical stage's ``f + b``.
    """
    _check_schedule(schedule)
    if len(forward) != len(backward) or not forward:
        raise ValueError("forward and backward need one entry per stage")
    per = [f + b for f, b in zip(forward, backward)]
    crit = max(range(len(per)), key=per.__getitem__)
    steady = max(forward) + max(backward) if schedule == "gpipe" else per[crit]
    return (m - 1) * steady + sum(per), crit


def overlap_exposed(total_bytes: float, bucket_bytes: float, window: float,
                    seconds_of) -> float:
    """Seconds of a bucketed collective left over after ``window`` seconds of backward.

    The ``total_bytes`` of gradients are produced at an even rate over the window, in
    ``n = ceil(total / bucket)`` buckets (the last one partial); bucket i's collective
    (``seconds_of(nbytes)``) starts when the bucket is complete and the previous one
    is done. Returns ``max_i (ready_i + sum_{j >= i} tau_j) - window``: the last bucket,
    ready only at the end, is never hidden. O(1): the ready times and durations of the
    full buckets are uniform, so the maximum is at i = 1, n-1 or n.
    """
    if total_bytes <= 0:
        return 0.0
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    n = max(1, math.ceil(total_bytes / bucket_bytes - 1e-12))
    last = total_bytes - (n - 1) * bucket_bytes
    tau_n = seconds_of(last)
    if n == 1:
        return tau_n
    tau = seconds_of(bucket_bytes)

    def finish(i):                      # bucket i (1-based, i < n) starts the busy run
        return window * i * bucket_bytes / total_bytes + (n - i) * tau + tau_n

    end = max(finish(1), finish(n - 1), window + tau_n)
    return end - window
