"""Pipeline schedules: the order in which a stage runs the forwards and backwards of its
micro-batches (GPipe, 1F1B and Megatron-LM's interleaved 1F1B), the micro-batches it
holds at once, and the tags of the hand-offs between stages. Pure functions, used by
:class:`summasim.transformer.composed.Trainer` and the harness's checks
(``tests/test_schedules.py`` simulates their bubbles).

References
----------
GPipe (Huang et al. 2019); 1F1B and Megatron-LM's interleaved 1F1B (Narayanan et al.
2021, section 2.2); the activations an interleaved stage holds (Korthikanti et al.
2022). Full citations: :mod:`summasim.transformer.composed`.
"""

from __future__ import annotations

from ..spec import SCHEDULE_KINDS


def check_schedule(kind: str, microbatches: int, pp: int, chunks: int = 1) -> None:
    """``ValueError`` naming the numbers unless ``kind`` can run ``microbatches``
    micro-batches over ``pp`` stages of ``chunks`` model chunks each: gpipe and 1f1b
    take one chunk; interleaved takes ``V >= 2``, ``pp >= 2`` stages (with one stage
    there is nothing to interleave; Megatron-LM runs no pipeline then) and ``m`` a
    multiple of ``pp`` (its micro-batches go in groups of pp per chunk, as Megatron-LM
    requires)."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if (kind == "interleaved") != (chunks > 1):
        raise ValueError(f"interleaved takes V >= 2 model chunks per stage, gpipe and "
                         f"1f1b one; got {kind} with {chunks}")
    if microbatches < 1 or pp < 1:
        raise ValueError(f"schedule needs m >= 1 micro-batches and pp >= 1 stages; got "
                         f"m={microbatches}, pp={pp}")
    if kind == "interleaved" and microbatches % pp:
        raise ValueError(f"interleaved:{chunks} needs micro-batches m a multiple of pp = "
                         f"{pp} (they go in groups of pp per chunk); got m = {microbatches}")


def schedule(kind: str, microbatches: int, pp: int, stage: int,
             chunks: int = 1) -> list[tuple[str, int, int]]:
    """The order in which ``stage`` runs ``("F", j, c)`` forwards and ``("B", j, c)``
    backwards of micro-batch ``j = 0..m-1`` on its model chunk ``c = 0..V-1`` (virtual
    stage ``c pp + stage``; ``c = 0`` unless interleaved).

    "gpipe"
        all forwards, then all backwards in reverse (Huang et al. 2019); ``m`` in flight.
    "1f1b"
        ``min(pp - stage - 1, m)`` warm-up forwards, then forward j and backward ``j -
        warmup`` in turn, then the remaining backwards (Narayanan et al. 2021), so at
        most ``min(pp - stage, m)`` micro-batches are in flight.
    "interleaved"
        Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2.2, Figure 4;
        ``forward_backward_pipelining_with_interleaving``) over the ``m V`` micro-batch
        chunks, which needs m a multiple of pp. Chunk-step ``k`` (forward) is
        micro-batch ``j = (k // (pp V)) pp + k % pp`` of chunk ``c = (k % (pp V)) //
        pp``: micro-batches in groups of pp, each group through chunk 0, then chunk 1,
        ...; backward step ``k`` is the same ``j`` of chunk ``V - 1 - c``. The stage
        runs ``w = min(2 (pp - stage - 1) + (V - 1) pp, m V)`` warm-up forwards, then
        forward ``w + k`` and backward ``k`` in turn, then the remaining backwards.

    Peak micro-batch chunks in flight: :func:`peak_inflight`. With a forward of one
    chunk taking t and its backward 2t, the idle time of every stage (the bubble) is
    ``3 (pp - 1) t`` against an ideal ``3 m V t``: ``(pp - 1) / m`` of it for 1F1B
    and ``(pp - 1) / (V m)`` interleaved (Narayanan et al. 2021, section 2.2.2; checked
    by simulation in ``tests/test_schedules.py``), at V times the point-to-point
    hand-offs.
    """
    m, V = microbatches, chunks
    check_schedule(kind, m, pp, V)
    if not 0 <= stage < pp:
        raise ValueError(f"schedule needs 0 <= stage < pp; got stage={stage}, pp={pp}")
    if kind == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in reversed(range(m))]
    if kind == "1f1b":
        warm = min(pp - stage - 1, m)
        order = [("F", j, 0) for j in range(warm)]
        for j in range(warm, m):
            order += [("F", j, 0), ("B", j - warm, 0)]
        order += [("B", j, 0) for j in range(m - warm, m)]
        return order
    total, group = m * V, pp * V

    def chunk_step(k: int, op: str) -> tuple[str, int, int]:
        j = (k // group) * pp + k % pp                 # micro-batches in groups of pp
        c = (k % group) // pp                          # each group through every chunk
        return op, j, (c if op == "F" else V - 1 - c)

    warm = min(2 * (pp - stage - 1) + (V - 1) * pp, total)
    order = [chunk_step(k, "F") for k in range(warm)]
    for k in range(total - warm):                      # steady 1F1B
        order += [chunk_step(warm + k, "F"), chunk_step(k, "B")]
    order += [chunk_step(k, "B") for k in range(total - warm, total)]
    return order


def peak_inflight(kind: str, microbatches: int, pp: int, stage: int,
                  chunks: int = 1) -> int:
    """The most micro-batch chunks whose forward has run and backward has not on
    ``stage`` under :func:`schedule` (each holds its activations): ``m`` (GPipe),
    ``min(pp - stage, m)`` (1F1B) and ``min(2 (pp - stage - 1) + (V - 1) pp + 1, m V)``
    interleaved: the warm-up forwards plus the steady state's one forward ahead of its
    backward. On stage 0 that is ``(V + 1) pp - 1`` chunks of ``L / (pp V)`` layers,
    the activations of ``pp (1 + (pp - 1) / (pp V))`` stages' worth of micro-batches,
    Korthikanti et al.'s (2022) factor for the interleaved schedule."""
    m, V = microbatches, chunks
    check_schedule(kind, m, pp, V)
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(pp - stage, m)
    return min(2 * (pp - stage - 1) + (V - 1) * pp + 1, m * V)


def hand_off_tag(j: int, chunk: int, chunks: int, backward: bool) -> int:
    """The point-to-point tag of micro-batch ``j``'s activation (``backward``: its
    gradient) arriving at model chunk ``chunk`` of the receiving stage: ``2 (j V + c)``
    (+1 backward). Between two stages there is one message per (micro-batch, receiving
    chunk, direction), so the tags keep every micro-batch and chunk apart."""
    return 2 * (j * chunks + chunk) + (1 if backward else 0)
