"""What the harness hands the cost model: measured runs as typed records (pure).

A measured run is one case the harness timed on ``p`` ranks: what kind of run it was
(a matrix product, a ring all-reduce, a tensor-parallel training step, a sharded
training step on a mesh), its sizes and grid, its dtype, the seconds of its timed
repeats and, per rank, the summary of its traced traffic. :class:`MeasuredRun` is that
record; :class:`EventCount` one line of a rank's traffic summary.

The harness writes these today as string-keyed dicts (``Result.measured()``, and
``measured.json`` of the accuracy benchmark): :meth:`MeasuredRun.from_dict` reads those
dicts (the keys the kind needs checked, unknown keys kept aside) and
:meth:`MeasuredRun.to_dict` writes the same dict back (every field present, e.g. an
empty ``rank_max``), so records and files round-trip.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

#: The kinds of measured run.
KINDS = ("matmul", "ring", "transformer", "mesh")
#: The statistic of the repeats compared with the model.
STATISTICS = ("median", "min")


class EventCount(NamedTuple):
    """One line of a rank's traffic summary: ``count`` calls of ``op`` on ``group``
    (``group_size`` ranks) moving ``nbytes`` bytes each; ``blocking``: they waited
    inside a blocking MPI call (see :class:`summasim.trace.Event`; None: recorded before
    the flag existed, priced as polled). A tuple, so it
    indexes and serializes as the ``[op, group, group_size, nbytes, count, blocking]``
    lists of :func:`summasim.costmodel.tools.accuracy.event_summary`."""

    op: str
    group: str
    group_size: int
    nbytes: int
    count: int
    blocking: bool | None = None

    @classmethod
    def from_list(cls, e) -> "EventCount":
        """From ``[op, group, group_size, nbytes, count(, blocking)]`` (five fields in
        measurements from before the ``blocking`` flag: polled)."""
        if isinstance(e, EventCount):
            return e
        if len(e) not in (5, 6):
            raise ValueError(f"an event summary line has 5 or 6 fields, got {list(e)!r}")
        return cls(str(e[0]), str(e[1]), int(e[2]), int(e[3]), int(e[4]),
                   bool(e[5]) if len(e) > 5 else None)

    def to_list(self) -> list:
        """``[op, group, group_size, nbytes, count, blocking]`` (five fields when the
        flag was not recorded)."""
        return list(self) if self.blocking is not None else list(self[:5])


def _ints(values) -> tuple:
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class MeasuredRun:
    """One timed case on ``p`` ranks, as the cost model reads it.

    Parameters
    ----------
    kind : {"matmul", "ring", "transformer", "mesh"}
    p : int
        Ranks of the run.
    dtype : str
        Element type of the operands (a NumPy dtype name).
    spans : tuple of float
        Seconds of each timed repeat (first rank's start to last rank's end).
    rank_max : tuple of float
        The slowest rank's own seconds of each repeat (empty when not recorded).
    events : tuple of tuple of EventCount
        Every rank's traffic summary (rank order).
    coords : tuple of tuple of int
        Every rank's coordinates on its grid or mesh (rank order).
    algorithm : str
        The product (``"summa_ab"``, ...) or ``"ring_allreduce"``; "" for training steps.
    m, k, n : int
        Matrix product sizes (C[m, n] = A[m, k] B[k, n]).
    N : int
        Ring all-reduce length, items.
    scheme : str
        Tensor-parallel scheme of a training step ("megatron", "optimus", "summa25").
    q, d : int
        The [q, q, d] grid (1, 1 for Megatron and the ring).
    b, s, h, heads, v, layers, ffn : int
        A training step's global batch (sequences), sequence, hidden size, heads,
        vocabulary, layers and MLP multiplier.
    mesh : str
        A sharded step's mesh, ``"dp=2,pp=2,tp=optimus:2x2"``; with ``dp``, ``pp``,
        ``t`` (tensor ranks), ``zero``, ``schedule``, ``microbatches``,
        ``checkpoint``, ``bucket_bytes`` and ``steps``.
    """

    kind: str
    p: int
    dtype: str
    spans: tuple = ()
    rank_max: tuple = ()
    events: tuple = ()
    coords: tuple = ()
    algorithm: str = ""
    m: int = 0
    k: int = 0
    n: int = 0
    N: int = 0
    scheme: str = ""
    q: int = 1
    d: int = 1
    b: int = 0
    s: int = 0
    h: int = 0
    heads: int = 0
    v: int = 0
    layers: int = 0
    ffn: int = 4
    mesh: str = ""
    dp: int = 1
    pp: int = 1
    t: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    checkpoint: bool = False
    bucket_bytes: float = 0.0
    steps: int = 1
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"MeasuredRun.kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if isinstance(self.p, bool) or int(self.p) < 1:
            raise ValueError(f"MeasuredRun.p must be a positive integer, got {self.p!r}")

    # -- the dicts the harness writes today ------------------------------------------------
    _MATMUL = ("algorithm", "q", "d", "m", "k", "n")
    _RING = ("algorithm", "N")
    _STEP = ("scheme", "q", "d", "b", "s", "h", "heads", "v", "layers", "ffn")
    _MESH = ("mesh", "dp", "pp", "scheme", "q", "d", "t", "zero", "schedule", "m",
             "checkpoint", "bucket_bytes", "steps", "b", "s", "h", "heads", "v", "layers",
             "ffn")

    @classmethod
    def _keys(cls, kind: str) -> tuple:
        return {"matmul": cls._MATMUL, "ring": cls._RING, "transformer": cls._STEP,
                "mesh": cls._MESH}[kind]

    @classmethod
    def from_dict(cls, data) -> "MeasuredRun":
        """The record of a worker-result dict (``Result.measured()``, or one entry of
        ``measured.json``): the case's ``to_dict()`` keys plus ``p``, ``spans``,
        ``rank_max``, ``events`` and ``coords``. A MeasuredRun is returned as it is.
        ``ValueError`` naming the key when one the kind needs is missing."""
        if isinstance(data, MeasuredRun):
            return data
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"measured run: unknown kind {kind!r} (one of {', '.join(KINDS)})")
        missing = [k for k in ("p", *cls._keys(kind)) if k not in data
                   and not (k == "ffn" or (kind == "ring" and k == "algorithm"))]
        if missing:
            raise ValueError(f"measured {kind} run lacks {', '.join(missing)}")
        fields = {}
        for key in cls._keys(kind):
            if key not in data:
                continue
            name = "microbatches" if (kind == "mesh" and key == "m") else key
            fields[name] = data[key]
        known = {"kind", "p", "dtype", "spans", "rank_max", "events", "coords",
                 *cls._keys(kind)}
        return cls(kind=kind, p=int(data["p"]), dtype=str(data.get("dtype", "float64")),
                   spans=tuple(float(x) for x in data.get("spans") or ()),
                   rank_max=tuple(float(x) for x in data.get("rank_max") or ()),
                   events=tuple(tuple(EventCount.from_list(e) for e in rank)
                                for rank in data.get("events") or ()),
                   coords=tuple(_ints(c) if isinstance(c, (list, tuple)) else int(c)
                                for c in data.get("coords") or ()),
                   extra={k: v for k, v in data.items() if k not in known},
                   **fields)

    def to_dict(self) -> dict:
        """The worker-result dict this record was read from (:meth:`from_dict`'s
        inverse; events and coordinates as lists, as JSON writes them)."""
        out = {"kind": self.kind, **self.extra}
        for key in self._keys(self.kind):
            name = "microbatches" if (self.kind == "mesh" and key == "m") else key
            out[key] = getattr(self, name)
        out["dtype"] = self.dtype
        out.update(p=self.p, spans=list(self.spans), rank_max=list(self.rank_max),
                   events=[[e.to_list() for e in rank] for rank in self.events],
                   coords=[list(c) if isinstance(c, tuple) else c for c in self.coords])
        return out

    # -- what the analysis asks of a run --------------------------------------------------
    def seconds(self, statistic: str = "median") -> float:
        """The measured time compared with the model: the median span of the repeats
        (``statistic="min"``: the fastest, what a quiet machine would give)."""
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        if not self.spans:
            raise ValueError(f"measured run {self.label} has no timed repeats")
        return statistics.median(self.spans) if statistic == "median" else min(self.spans)

    @property
    def spread(self) -> float:
        """Slowest over fastest repeat, minus one."""
        spans = sorted(self.spans)
        return spans[-1] / spans[0] - 1.0

    @property
    def polled(self) -> bool:
        """A ring whose neighbour exchanges all polled (no blocking wait recorded)."""
        return any(e.blocking is False and e.op == "sendrecv" for rank in self.events
                   for e in rank)

    @property
    def grid_label(self) -> str:
        """``4x4``, ``[2,2,4]``, ``1D p=4`` or ``ring p=8``, as the main job prints grids."""
        if self.kind == "ring":
            return f"ring p={self.p}"
        if self.kind == "matmul":
            return (f"{self.q}x{self.q}" if self.d == 1 and not
                    self.algorithm.startswith("summa25") else f"[{self.q},{self.q},{self.d}]")
        if self.scheme == "megatron":
            return f"1D p={self.p}"
        return f"{self.q}x{self.q}" if self.scheme == "optimus" else \
            f"[{self.q},{self.q},{self.d}]"

    @property
    def label(self) -> str:
        """Short human label: ``summa_ab 4x4 1024x1024x1024`` / ``optimus 2x2 b8 s64 h256 ...``."""
        if self.kind == "matmul":
            return f"{self.algorithm} {self.grid_label} {self.m}x{self.k}x{self.n}"
        if self.kind == "ring":
            return f"ring_allreduce p={self.p} N={self.N}" + (" polled" if self.polled else "")
        if self.kind == "mesh":
            return (f"{self.mesh} zero={self.zero} {self.schedule} m={self.microbatches} "
                    f"b{self.b} s{self.s} h{self.h} L{self.layers}")
        return (f"{self.scheme} {self.grid_label} b{self.b} s{self.s} h{self.h} "
                f"v{self.v} L{self.layers}")

    @property
    def ranking_key(self) -> str | None:
        """Runs with the same key solve the same problem on the same p (candidates)."""
        if self.kind == "matmul":
            op = self.algorithm.rsplit("_", 1)[1]
            return (f"p={self.p} C=op(A)op(B) {op} {self.m}x{self.k}x{self.n} "
                    f"{self.dtype}")
        if self.kind in ("transformer", "mesh"):
            # a mesh step includes the gradient reduction and Adam: it competes with the
            # other meshes of its model, not with the schemes' forward + backward
            return (f"p={self.p} {'sharded ' if self.kind == 'mesh' else ''}step b{self.b} "
                    f"s{self.s} h{self.h} n{self.heads} v{self.v} L{self.layers} "
                    f"{self.dtype}")
        return None

    def model(self):
        """The :class:`summasim.spec.Model` of a training step (transformer, mesh)."""
        from summasim.spec import Model

        if self.kind not in ("transformer", "mesh"):
            raise ValueError(f"a {self.kind} run has no transformer model")
        return Model(vocab=self.v, seq=self.s, hidden=self.h, heads=self.heads,
                     layers=self.layers, ffn_mult=self.ffn)


def as_run(res) -> MeasuredRun:
    """``res`` as a :class:`MeasuredRun` (a worker-result dict is read with
    :meth:`MeasuredRun.from_dict`)."""
    return res if isinstance(res, MeasuredRun) else MeasuredRun.from_dict(res)
