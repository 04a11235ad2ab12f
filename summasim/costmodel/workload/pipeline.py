"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B): the bubble, the micro-batches in
flight, the step of a pipeline of stage times, and the exposed part of a bucketed
collective under compute."""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from typing import Sequence

from .._checks import finite_size, whole
from ...spec import SCHEDULE_KINDS


# -- checks ---------------------------------------------------------------------------------
def _check_int(name, val, minimum=1):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {val!r}")


def _check_schedule(schedule, chunks: int = 1):
    if schedule not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULE_KINDS)}")
    _check_int("chunks", chunks)
    if (schedule == "interleaved") != (chunks > 1):
        raise ValueError(f"the interleaved schedule takes V >= 2 model chunks per stage "
                         f"and the others one; got {schedule} with {chunks} chunks")


def check_interleaved(pp: int, m: int, chunks: int) -> None:
    """``ValueError`` unless ``m`` micro-batches can run the interleaved schedule of
    ``chunks`` model chunks on ``pp`` stages: pp >= 2 (one stage has nothing to
    interleave) and m a multiple of pp, as Megatron-LM requires ("number of
    microbatches ... is not divisible by pipeline-model-parallel-size when using
    interleaved schedule"; Narayanan et al. 2021, section 2.2.2, runs the micro-batches
    in groups of pp)."""
    if chunks == 1:
        return
    if pp < 2:
        raise ValueError(f"the interleaved schedule needs pp >= 2 stages, got pp = {pp}")
    if m % pp:
        raise ValueError(f"the interleaved schedule needs the micro-batches m = {m} to be a "
                         f"multiple of pp = {pp} (Megatron-LM's rule)")


# -- the pipeline ---------------------------------------------------------------------------
def bubble_fraction(pp: int, m: int, chunks: int = 1) -> float:
    """``(pp - 1) / (V m + pp - 1)``: the idle share of a pipeline of ``pp`` equal
    stages running ``m`` micro-batches, for GPipe and 1F1B alike (V = 1; Huang et al.
    2019; Narayanan et al. 2021, section 2.2.1) and for the interleaved schedule with V
    model chunks per stage, whose bubble is ``(pp - 1)/V`` of a stage's time (section
    2.2.2): :func:`bubble_over_ideal` of the pipeline's length."""
    _check_int("pp", pp)
    _check_int("microbatches", m)
    _check_int("chunks", chunks)
    return (pp - 1) / (chunks * m + pp - 1)


def bubble_over_ideal(pp: int, m: int, chunks: int = 1) -> float:
    """Narayanan et al. 2021's bubble time fraction, the bubble over the ideal time
    ``m (t_f + t_b)``: ``(pp - 1) / m`` for 1F1B (section 2.2.1) and ``(pp - 1) / (V m)``
    with V model chunks per stage (interleaved, section 2.2.2)."""
    _check_int("pp", pp)
    _check_int("microbatches", m)
    _check_int("chunks", chunks)
    return (pp - 1) / (chunks * m)


def in_flight(pp: int, m: int, stage: int, schedule: str, chunks: int = 1) -> int:
    """Activations (micro-batches, or under the interleaved schedule micro-batches of one
    model chunk) that stage ``stage`` (0-based) holds at its peak: ``m`` under GPipe,
    ``min(m, pp - stage)`` under 1F1B, ``min(W + 1, V m)`` interleaved with
    Megatron-LM's warm-up ``W`` (:func:`interleaved_warmup`)."""
    _check_schedule(schedule, chunks)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - stage)
    return min(interleaved_warmup(pp, m, chunks, stage) + 1, chunks * m)


def interleaved_warmup(pp: int, m: int, chunks: int, stage: int) -> int:
    """Forward chunk passes stage ``stage`` runs before its first backward in
    Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``):
    ``(pp - stage - 1) 2 + (V - 1) pp``, at most ``V m``; all ``V m`` when ``m == pp``
    (its ``all_warmup_microbatches``)."""
    total = chunks * m
    if m == pp:
        return total
    return min((pp - stage - 1) * 2 + (chunks - 1) * pp, total)


def _forwards_of_chunk(k: int, pp: int, chunks: int, c: int) -> int:
    """How many of the first ``k`` chunk passes run chunk ``c``: Megatron-LM runs the
    micro-batches in groups of pp through chunk 0, then chunk 1, ... (pass ``j`` is
    chunk ``(j mod (pp V)) // pp``; backward passes visit the chunks in reverse)."""
    full, rest = divmod(k, pp * chunks)
    return full * pp + min(max(rest - c * pp, 0), pp)


@lru_cache(maxsize=4096)
def interleaved_held(pp: int, m: int, chunks: int, stage: int) -> tuple:
    """Every distinct vector ``(n_0, ..., n_{V-1})`` of micro-batches whose activations
    stage ``stage`` holds per model chunk right after a forward pass of Megatron-LM's
    interleaved schedule (:func:`interleaved_warmup` forwards, then one forward and one
    backward in turn, then the remaining backwards; the peaks follow forwards). The
    counts repeat with period ``pp V`` in the steady state, so this costs O(pp V^2)
    whatever m is; :func:`in_flight` is the largest sum."""
    total = chunks * m
    warm = interleaved_warmup(pp, m, chunks, stage)
    steady = total - warm
    out = set()
    for i in range(max(1, min(steady, pp * chunks))):
        fwd = min(warm + 1 + i, total)
        bwd = i if steady > 0 else 0
        out.add(tuple(_forwards_of_chunk(fwd, pp, chunks, c)
                      - _forwards_of_chunk(bwd, pp, chunks, chunks - 1 - c)
                      for c in range(chunks)))
    return tuple(sorted(out))


def pipeline_time(forward: Sequence[float], backward: Sequence[float], m: int,
                  schedule: str = "1f1b", chunks: int = 1) -> tuple[float, int]:
    """Seconds of ``m`` micro-batches through stages with per-micro-batch ``forward``
    and ``backward`` seconds (all of a stage's chunks), and the index of the critical
    (slowest) stage.

    GPipe: ``(m-1)(max f + max b) + sum(f + b)``; 1F1B: ``(m-1) max(f + b) + sum(f +
    b)``; interleaved with V chunks per stage: ``m max(f + b) + (sum(f + b) - max(f +
    b)) / V``, the fill and drain passing one chunk of each other stage (Narayanan et
    al. 2021, section 2.2.2: the bubble ``(pp - 1)(t_f + t_b) / V``; at V = 1 it is
    1F1B's). Equal stages give ``(m + (pp - 1)/V)(f + b)``. The bubble is this time
    minus ``m`` times the critical stage's ``f + b``.
    """
    _check_schedule(schedule, chunks)
    if len(forward) != len(backward) or not forward:
        raise ValueError("forward and backward need one entry per stage")
    m = whole("m (micro-batches)", m)
    forward = [finite_size(f"forward[{i}] (seconds)", f) for i, f in enumerate(forward)]
    backward = [finite_size(f"backward[{i}] (seconds)", b) for i, b in enumerate(backward)]
    per = [f + b for f, b in zip(forward, backward)]
    crit = max(range(len(per)), key=per.__getitem__)
    if schedule == "interleaved":
        return m * per[crit] + (sum(per) - per[crit]) / chunks, crit
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
