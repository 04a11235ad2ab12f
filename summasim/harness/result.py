"""The record every executor returns (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from summasim.costmodel.workload.measured import MeasuredRun

from .check import Check


@dataclass
class Result:
    """One run: the case, its verdict, timings, traffic and memory (same on every rank,
    except ``events`` and ``coords``: every rank's, on rank 0 only)."""

    case: object
    p: int
    check: Check
    timing: dict = field(default_factory=dict)
    bytes_per_rank: int = 0            # largest per-rank payload in the trace
    messages_per_rank: int = 0
    peak_rss: int = 0                  # largest peak RSS over ranks, bytes
    events: list | None = None         # rank 0: each rank's event summary (event_summary)
    coords: list | None = None
    fault: str = ""
    extra: dict = field(default_factory=dict)
    # False when ``fault`` found nothing to corrupt on its rank (an empty block, a rank
    # with no sum to drop): the verdict is then the uncorrupted run's (same on every rank)
    fault_applied: bool = True

    @property
    def ok(self) -> bool:
        return self.check.ok

    @property
    def seconds(self) -> float:
        return float(self.timing.get("median", 0.0))

    def measured(self) -> MeasuredRun:
        """The record the cost model prices: the case, ``p``, the timed repeats and
        every rank's traffic summary and coordinates (rank 0's view: ``events`` and
        ``coords`` are empty elsewhere). ``.to_dict()`` is its JSON form."""
        return MeasuredRun.from_dict(dict(
            self.case.to_dict(), p=self.p, spans=self.timing.get("spans", []),
            rank_max=self.timing.get("rank_max", []), events=self.events,
            coords=self.coords))
