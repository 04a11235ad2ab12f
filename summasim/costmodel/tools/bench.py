"""What the cost model says about ``python -m summasim.bench`` (pure: no MPI, no harness).

The benchmarks measure; this module prices. Each function turns sizes into predicted
seconds or bytes, so that the bench front-end only times, checks and prints:

:func:`ring_prediction`     seconds of ``ring_allreduce`` of n items on p ranks (the slowest
                            rank, shared-core model), optionally with the memory floor at a
                            throughput read while the size ran (:func:`priced_at_memory`).
:func:`memory_floor_counts` whether a size's data outgrows the node's cache, so that its
                            memory floor (and a reading of the node's memory) can count.
:func:`bench_bytes`         peak bytes per rank of ``bench allreduce`` / ``bench ring-steps``
                            at their largest size, and :func:`largest_fitting_mib` the
                            largest size a memory budget holds.
:func:`prediction_target`   how many sizes meet the prediction target (within
                            :data:`PREDICTION_TOLERANCE` from :data:`PREDICTION_FROM_MIB`).
"""

from __future__ import annotations

import numpy as np

from summasim.costmodel.tools.accuracy import predict_result
from summasim.costmodel.workload.measured import MeasuredRun
from summasim.costmodel.workload.traffic import algorithm_messages, ring_working_set

# Peak bytes per rank of one all-reduce size, in messages: the rank's data, the reference
# sum, the result, MPI's own temporary and the check's. Measured (peak RSS over the ~120 MiB
# an idle rank holds) at 256 MiB: 6.3 messages on 2 ranks, 6.1 on 4; ring-steps: 2.1. With
# the huge-page buffers (whose slack is never touched) 6.8 messages on 2 ranks counting the
# idle rank and the node-memory probe's arrays, the same with --np-empty; one message more
# for the in-place contenders' buffer.
ALLREDUCE_MESSAGES = 8
RING_STEPS_MESSAGES = 3
#: The node-memory probe's arrays (MiB per array, two per rank): past any CPU's last-level
#: cache per rank, so that the probe measures DRAM.
NODE_MEMORY_MIB = 32
#: the ring benchmark's prediction target: within 10% from 1 MiB (at p = 16; reported at
#: every p)
PREDICTION_FROM_MIB = 1.0
PREDICTION_TOLERANCE = 0.10


def ring_prediction(n: int, dtype, p: int, machine, blocking_limit: int = 0,
                    memory_gibs: float | None = None) -> float:
    """The cost model's time (seconds) of ``ring_allreduce`` of n items on p ranks (the
    slowest rank, shared-core model), from the closed-form messages of every rank.

    Steps are priced as exchanger steps (``Event.blocking``: the receive alone awaited,
    yielding or napping) where ``Comm`` takes that path: every step when the largest
    chunk has fewer than ``blocking_limit`` bytes (``Comm.exchanger`` decides once per
    loop), else each step below the limit (``Comm.sendrecv`` decides per message); the
    others as waits of the wait policy. ``memory_gibs``: price the memory floor at this
    node memory throughput (GiB/s) instead of ``machine``'s (:func:`priced_at_memory`).
    """
    machine = priced_at_memory(machine, memory_gibs)
    dt = np.dtype(dtype)
    it = dt.itemsize
    every = -(-n // p) * it < blocking_limit
    events = [[[mc.op, "world", mc.group_size, mc.nbytes, mc.count,
                every or mc.nbytes < blocking_limit]
               for mc in algorithm_messages("ring_allreduce", count=n, p=p, coords=r,
                                            itemsize=it)] for r in range(p)]
    run = MeasuredRun.from_dict({"kind": "ring", "algorithm": "ring_allreduce", "N": n,
                                 "dtype": dt.name, "p": p, "events": events,
                                 "coords": [[r] for r in range(p)]})
    return predict_result(run, machine)


def priced_at_memory(machine, memory_gibs: float | None):
    """``machine`` with its memory floor at ``memory_gibs`` GiB/s (None: unchanged)."""
    if memory_gibs is None:
        return machine
    return machine.replace(memory_bandwidth=memory_gibs * 2**30)


def memory_floor_counts(machine, n: int, p: int, dtype) -> bool:
    """Whether the data of a ring all-reduce of n items on p ranks (x, out and a receive
    chunk on every rank of a node) outgrows ``machine.cache_bytes``: where the memory
    floor can count, and a reading of the node's memory is worth taking."""
    return not machine.fits_cache(machine.ranks_per_node(p),
                                  ring_working_set(n, p, np.dtype(dtype).itemsize))


def _memory_terms(what: str) -> tuple[int, int]:
    """``(messages held per rank, fixed bytes)`` of ``allreduce`` or ``ring-steps``."""
    if what == "allreduce":
        return ALLREDUCE_MESSAGES, 2 * NODE_MEMORY_MIB << 20
    if what == "ring-steps":
        return RING_STEPS_MESSAGES, 0
    raise ValueError(f"bench memory: 'allreduce' or 'ring-steps', got {what!r}")


def bench_bytes(what: str, sizes_mib) -> int:
    """Peak bytes per rank of ``allreduce`` or ``ring-steps`` at the largest of
    ``sizes_mib`` (:data:`ALLREDUCE_MESSAGES`, :data:`RING_STEPS_MESSAGES`; the ring's
    receive chunk, ``1 / p`` of a message, is within them), with the node-memory probe's
    arrays for ``allreduce``."""
    per, fixed = _memory_terms(what)
    return int(per * max(sizes_mib) * 2**20) + fixed


def largest_fitting_mib(what: str, budget_bytes: int, ranks: int) -> float:
    """The largest message (MiB) of ``what`` whose :func:`bench_bytes` on ``ranks`` ranks
    fits ``budget_bytes``."""
    messages, fixed = _memory_terms(what)
    return max(0, budget_bytes // ranks - fixed) / (messages * 2**20)


def prediction_error(predicted: float | None, measured: float) -> float | None:
    """``(predicted - measured) / measured``, None without a prediction."""
    return None if predicted is None else (predicted - measured) / measured


def prediction_target(rows) -> dict:
    """``{"sizes", "met"}``: the rows (``mib``, ``predicted``, ``prediction_error``) from
    :data:`PREDICTION_FROM_MIB` that have a prediction, and how many are within
    :data:`PREDICTION_TOLERANCE` of the measured time."""
    pred = [r for r in rows if r["mib"] >= PREDICTION_FROM_MIB and r["predicted"] is not None]
    return {"sizes": len(pred),
            "met": sum(abs(r["prediction_error"]) <= PREDICTION_TOLERANCE for r in pred)}
