"""Trace and Event: the communication ledger.

Every call through :class:`summasim.comm.Comm` appends one :class:`Event`:

``op``          "bcast", "reduce", "allreduce", "allgather", "reduce_scatter", "sendrecv",
                "send", "recv" or "barrier"
``group``       name of the communicator: "row", "col", "depth", "layer", "world", ...
``group_size``  number of ranks in that communicator
``root``        root rank inside the group (the peer for send and recv; -1 when none)
``nbytes``      payload of the call on this rank: the broadcast / reduce / all-reduce
                buffer (the same on every member), or the bytes sent by a sendrecv
``seconds``     wall time this rank spent inside MPI for the call (for a
                non-blocking call: posting it plus waiting for it)
``phase``       the innermost ``with trace.phase(...)`` label ("" outside any)
``blocking``    True for an exchanger step (:meth:`summasim.comm.Comm.exchanger`: a ring
                step or a small sendrecv, the receive alone awaited, yielding the core
                between polls and napping only when a long step outlasts its yields;
                older traces: a blocking ``MPI_Sendrecv``); False when the call was a
                non-blocking request completed by ``Comm``'s wait policy (polled, a
                sleep after the first failed poll). The cost model prices the two waits
                apart under oversubscription (:class:`summasim.costmodel.machine.SharedCore`).

A trace belongs to one rank. Totals per op, group and phase are local; use
:meth:`Trace.allgather_totals` to see every rank's totals.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import NamedTuple


class Event(NamedTuple):
    """One communication call on one rank."""

    op: str
    group: str
    group_size: int
    root: int
    nbytes: int
    seconds: float
    phase: str
    blocking: bool = False


class Total(NamedTuple):
    """Aggregate of a set of events."""

    count: int
    nbytes: int
    seconds: float


class Trace:
    """An append-only list of :class:`Event` with a phase stack and totals.

    Examples
    --------
    >>> t = Trace()
    >>> with t.phase("mlp.fc1.fwd"):
    ...     t.record("bcast", "row", 4, 0, 1024, 1e-5)
    >>> t.by_phase()["mlp.fc1.fwd"].nbytes
    1024
    """

    def __init__(self, enabled: bool = True):
        self.events: list[Event] = []
        self.enabled = enabled
        self._phases: list[str] = []

    # -- recording -----------------------------------------------------------
    @property
    def current_phase(self) -> str:
        return self._phases[-1] if self._phases else ""

    @contextlib.contextmanager
    def phase(self, name: str):
        """Tag the events recorded inside the block with ``name``.

        Nested phases are joined with "/" ("layer0/mlp.fc1.fwd").
        """
        full = f"{self._phases[-1]}/{name}" if self._phases else name
        self._phases.append(full)
        try:
            yield self
        finally:
            self._phases.pop()

    def record(self, op: str, group: str, group_size: int, root: int, nbytes: int,
               seconds: float, phase: str | None = None, blocking: bool = False) -> None:
        """Append an event (``phase`` defaults to the current phase; ``blocking``: the
        wait was inside a blocking MPI call, see the module doc)."""
        if self.enabled:
            self.events.append(Event(op, group, int(group_size), int(root), int(nbytes),
                                     float(seconds), self.current_phase if phase is None
                                     else phase, bool(blocking)))

    def clear(self) -> None:
        self.events.clear()

    def __len__(self) -> int:
        return len(self.events)

    # -- totals --------------------------------------------------------------
    def select(self, op: str | None = None, group: str | None = None,
               phase: str | None = None) -> list[Event]:
        """Events matching every given field (``phase`` matches as a prefix)."""
        return [e for e in self.events
                if (op is None or e.op == op) and (group is None or e.group == group)
                and (phase is None or e.phase == phase or e.phase.startswith(phase + "/"))]

    def total(self, **filters) -> Total:
        """Count, bytes and seconds over the events matching ``filters`` (see select)."""
        ev = self.select(**filters)
        return Total(len(ev), sum(e.nbytes for e in ev), sum(e.seconds for e in ev))

    def _by(self, key) -> dict[str, Total]:
        acc: dict = defaultdict(lambda: [0, 0, 0.0])
        for e in self.events:
            a = acc[key(e)]
            a[0] += 1
            a[1] += e.nbytes
            a[2] += e.seconds
        return {k: Total(*v) for k, v in acc.items()}

    def by_op(self) -> dict[str, Total]:
        return self._by(lambda e: e.op)

    def by_group(self) -> dict[str, Total]:
        return self._by(lambda e: e.group)

    def by_op_group(self) -> dict[tuple[str, str], Total]:
        return self._by(lambda e: (e.op, e.group))

    def by_phase(self) -> dict[str, Total]:
        return self._by(lambda e: e.phase)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.events)

    def allgather_totals(self, comm) -> list[dict]:
        """Every rank's ``{"nbytes", "count", "by_op"}`` (a collective over ``comm``: an
        mpi4py communicator, a summasim ``Comm`` or a grid, whose raw communicator
        carries the exchange, so that it is not itself traced)."""
        mine = {"nbytes": self.nbytes, "count": len(self.events),
                "by_op": {k: tuple(v) for k, v in self.by_op().items()}}
        return untraced(comm).allgather(mine)


def untraced(comm):
    """What carries an exchange that is not itself traced: the raw mpi4py communicator of
    a summasim ``Comm`` (``.mpi``) or of a grid (``.world.mpi``), else ``comm`` itself (an
    mpi4py communicator, or anything with the methods the caller uses)."""
    return (getattr(comm, "mpi", None) or getattr(getattr(comm, "world", None), "mpi", None)
            or comm)
