"""The harness's one timer.

A timed call starts after a barrier that waits without spinning
(:func:`summasim.mpiutil.quiet_barrier`: under oversubscription a spinning barrier
steals the cores of the ranks still computing). Its time is the *span*
``max_r t1_r - min_r t0_r`` on the node's common monotonic clock: from the first
rank's start to the last rank's end. Short calls are repeated more (up to 5x
``repeats``, about ``budget`` seconds in all), since their spread is the largest.
The median span is what every front-end reports.

With ``world=None`` the same timer times a serial call (no barrier, no reduction: the
span is the call's own time), so serial and parallel benchmarks share one loop.

:func:`time_contenders` times several calls against each other on the same machine
state: in rounds, each contender timed in turn (in an order rotated by one each round,
or in blocks in a fixed order), each turn by :func:`time_calls`.
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


def time_calls(fn, world, repeats: int, budget: float = 0.5, adaptive: bool = True, *,
               warmup: int = 0, warm_s: float = 0.0, before=None, after=None,
               returns: bool = False) -> dict:
    """Time ``fn()`` (collective over ``world``; ``world=None``: serial): a dict of
    seconds, ``"spans"`` (per call), ``"rank_max"`` (per call, the slowest rank's own
    time), ``"times"`` (per call, this rank's own time) and ``"median"`` (of the spans).

    ``adaptive``: the first timed call sizes the rest (up to 5x ``repeats`` within about
    ``budget`` seconds) and counts as one; else exactly ``repeats`` calls. ``warmup``
    untimed calls come first, and more of them until ``warm_s`` seconds have passed
    since the first, hooks included (serial only, a ValueError with a world: ranks would
    disagree on the count). ``before()`` (before the barrier) and ``after()`` (right
    after the call, before the reduction) run around every call, warm-ups included,
    outside the timed region. ``returns``: also ``"returns"``, ``fn``'s value of each
    timed call.
    """
    spans, rank_max, own, values = [], [], [], []

    def once(keep: bool):
        if before is not None:
            before()
        if world is not None:
            quiet_barrier(world)
        t0 = time.perf_counter()
        value = fn()
        t1 = time.perf_counter()
        if after is not None:
            after()
        if not keep:
            return
        if world is not None:
            mx = reduce_max(world, [-t0, t1, t1 - t0])
            span, slowest = float(mx[1] + mx[0]), float(mx[2])
        else:
            span = slowest = t1 - t0
        spans.append(span)
        rank_max.append(slowest)
        own.append(t1 - t0)
        if returns:
            values.append(value)

    if warm_s > 0 and world is not None:
        raise ValueError("time_calls: warm_s is for serial timing (world=None)")
    start = time.perf_counter()
    done = 0
    while done < warmup or (warm_s > 0 and time.perf_counter() - start < warm_s):
        once(False)
        done += 1
    once(True)                      # the first call sizes the rest and counts as one
    if adaptive:
        repeats = max(repeats, min(5 * repeats, int(budget / max(spans[0], 1e-6))))
    for _ in range(repeats - 1):
        once(True)
    out = {"spans": spans, "rank_max": rank_max, "times": own,
           "median": statistics.median(spans)}
    if returns:
        out["returns"] = values
    return out


def rotated(names: list, i: int) -> list:
    """``names`` rotated by ``i``: round i of an interleaved benchmark starts with the
    i-th entry, so that each contender takes each place in the order equally often (the
    first call after the timing barrier measured 2-10% slower than the same call in
    second place, at p = 2 and 4 below 1 MiB)."""
    k = i % len(names)
    return names[k:] + names[:k]


def shuffled(names: list, i: int) -> list:
    """Round i's order with a random rest: :func:`rotated` by ``i`` (each contender
    first equally often), the others after it in an order drawn from a generator seeded
    by ``i`` (the same on every rank), so that no contender always follows the same
    one. With a fixed cyclic order a contender inherits its predecessor's traces: at
    p = 4 and 1 MiB the in-place ring run right after ``MPI_Allreduce`` read 0.93x of
    the plain in-place loop run after it, and 1.04x with the two swapped."""
    import random

    first, *rest = rotated(names, i)
    random.Random(i).shuffle(rest)
    return [first] + rest


def time_contenders(calls: dict, world, rounds: int, *, repeats: int = 1, warmup: int = 0,
                    warm_s: float = 0.0, rotate: bool = True, shuffle: bool = False,
                    before=None, after_round=None, returns: bool = False) -> dict:
    """Time the calls of ``{name: fn}`` against each other (collective; ``world=None``:
    serial): ``rounds`` rounds, in each every contender's turn of ``warmup`` untimed
    calls (and more until ``warm_s`` seconds, serial only: :func:`time_calls`) and
    ``repeats`` timed calls (:func:`time_calls`, not adaptive). ``rotate``: round i
    starts with the i-th contender (:func:`rotated`: repeat i of each pairs with repeat
    i of the others, on the same machine state), and with ``shuffle`` the others follow
    in a seeded random order (:func:`shuffled`); else every round in the given order
    (blocks A B A B). ``before(name)`` runs before each call of ``name``.
    ``after_round(i, spans)`` runs after round i (1-based) with the spans so far and
    may return a new number of rounds.

    Returns ``{name: {"spans", "times", "rank_max"[, "returns"]}}``, each list over all
    the rounds' timed calls in order.
    """
    keys = ("spans", "times", "rank_max") + (("returns",) if returns else ())
    out = {k: {key: [] for key in keys} for k in calls}
    i = 0
    while i < rounds:
        order = shuffled if shuffle else rotated
        for k in (order(list(calls), i) if rotate else list(calls)):
            res = time_calls(calls[k], world, repeats, adaptive=False, warmup=warmup,
                             warm_s=warm_s,
                             before=None if before is None else (lambda k=k: before(k)),
                             returns=returns)
            for key in keys:
                out[k][key] += res[key]
        i += 1
        if after_round is not None:
            rounds = after_round(i, {k: v["spans"] for k, v in out.items()}) or rounds
    return out


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
