"""Measured runs, as the workload pricers read them (pure).

A measured run is one case the harness timed on ``p`` ranks: what kind of run it was
(a matrix product, a ring all-reduce, a tensor-parallel training step, a sharded
training step on a mesh), its sizes and grid, its dtype, the seconds of its timed
repeats and, per rank, the summary of its traced traffic. :class:`MeasuredRun` is that
record, the one form in which measurements reach the cost model (``Result.measured()``
returns it); :class:`EventCount` is one line of a rank's traffic summary.

JSON is the only place a measured run is a dict: the worker's results and
``measured.json`` of the accuracy benchmark are :meth:`MeasuredRun.to_dict` written out,
and :meth:`MeasuredRun.from_dict` reads them back (the keys the kind needs checked,
unknown keys kept aside and written back last), so records and files round-trip and
files written before the records existed still load.

The record lives with the workload pricers because they read it:
:func:`mesh_features` and :func:`predict_measured_mesh` price a measured
sharded-training step back (each rank's traced events and its stage's compute); the
analysis of ``costmodel accuracy`` (:mod:`summasim.costmodel.tools.accuracy`) prices the
other kinds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from ..machine import Machine
from .scheme import Scheme, TransformerConfig

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
    lists of :func:`summasim.costmodel.tools.accuracy.event_summary` (the harness's
    per-rank summaries)."""

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
    pc : int
        Columns of a rectangular grid [q, pc, d] of a product or a 2D/2.5D scheme
        (0: square).
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
    pc: int = 0
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

    # -- the JSON form: worker results and measured.json ----------------------------------
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
        """The record of a worker-result dict (one result of the worker's output, or
        one entry of ``measured.json``; the harness also builds ``Result.measured()``
        with it): the case's ``to_dict()`` keys plus ``p``, ``spans``, ``rank_max``,
        ``events`` and ``coords``; other keys (the worker's verdict: ``ok``,
        ``error``, ``label``, ``load``) are kept in ``extra``. A MeasuredRun is returned
        as it is. ``ValueError`` naming the key when one the kind needs is missing."""
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
        if kind != "ring" and data.get("pc"):
            fields["pc"] = int(data["pc"])
        known = {"kind", "p", "dtype", "spans", "rank_max", "events", "coords",
                 *cls._keys(kind), *(("pc",) if kind != "ring" else ())}
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
        inverse; events and coordinates as lists, as JSON writes them): the case's keys
        in its ``to_dict()`` order (a scheme's ``pc``, where it has one, after ``d``), then
        ``p``, ``spans``, ``rank_max``, ``events``,
        ``coords`` and last the ``extra`` keys, the order the worker has always written
        (so a ``measured.json`` read and written back is the same file)."""
        out = {"kind": self.kind}
        for key in self._keys(self.kind):
            name = "microbatches" if (self.kind == "mesh" and key == "m") else key
            out[key] = getattr(self, name)
            if key == "d" and self.kind != "matmul" and self.pc:
                out["pc"] = self.pc             # a scheme's columns, after its depth
        if self.kind == "matmul" and self.pc:
            out["pc"] = self.pc
        out["dtype"] = self.dtype
        out.update(p=self.p, spans=list(self.spans), rank_max=list(self.rank_max),
                   events=[[e.to_list() for e in rank] for rank in self.events],
                   coords=[list(c) if isinstance(c, tuple) else c for c in self.coords])
        out.update(self.extra)
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
            pc = self.pc or self.q
            return (f"{self.q}x{pc}" if self.d == 1 and not
                    self.algorithm.startswith("summa25") else f"[{self.q},{pc},{self.d}]")
        if self.scheme == "megatron":
            return f"1D p={self.p}"
        pc = self.pc or self.q
        return f"{self.q}x{pc}" if self.scheme == "optimus" else f"[{self.q},{pc},{self.d}]"

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


def require_run(run, what: str) -> MeasuredRun:
    """``run`` itself when it is a :class:`MeasuredRun`; ``TypeError`` naming ``what``
    (the function it was handed to) otherwise: a measured run reaches the cost model as
    the record, and a worker-result dict is read with :meth:`MeasuredRun.from_dict` at
    the JSON boundary."""
    if isinstance(run, MeasuredRun):
        return run
    raise TypeError(f"{what} takes a MeasuredRun, got {type(run).__name__} (read a "
                    f"worker-result dict with MeasuredRun.from_dict)")


# --------------------------------------------------------------------------- sharded steps
#: Element-wise passes of one Adam update per parameter (m, v, the bias-corrected
#: denominator and the update: about ten array operations, each one pass).
ADAM_PASSES = 10


def mesh_features(run: MeasuredRun, machine: Machine) -> list:
    """The shared-core features (:class:`~summasim.costmodel.workload.predict.SharedFeatures`) of
    every rank of one measured sharded-training step (``run``: the record of a
    ``MeshCase``, with each rank's event summary and coordinates ``[replica, stage,
    tensor rank, first layer, stop layer]``), for machines that price this node
    (oversubscribed ranks share cores).

    Each rank's messages are its traced events; its compute is ``m`` micro-batches of
    its stage: the stage's layers at the micro-batch size (the per-layer work of
    :func:`~summasim.costmodel.workload.step.step_work`: its two-layer minus its one-layer
    work, 4/3 of it with checkpointing for the recomputed forward), the embedding and
    LM head on the last stage (the one-layer work minus one layer; the embedding's
    lookup is negligible next to the head's GEMM), and Adam on the stage's local
    parameters (``ADAM_PASSES`` element-wise passes, over ``dp`` under ZeRO >= 1).
    """
    from ..compute.gemm import gemms_seconds as _compute_seconds
    from .predict import trace_features
    from .pricer import summary_messages
    from .step import step_work

    run = require_run(run, "mesh_features")
    if run.kind != "mesh":
        raise ValueError(f"mesh_features prices sharded-training steps, got a {run.kind} run")
    name, dp, m = run.scheme, int(run.dp), int(run.microbatches)
    t, q, d = int(run.t), int(run.q), int(run.d)
    sch = (Scheme.make("megatron", p=t) if name == "megatron"
           else Scheme.make(name, q=q, d=d, pc=int(run.pc or q)))
    T = sch.p
    micro = int(run.b) // (dp * m)
    h, f, v, s = int(run.h), int(run.ffn), int(run.v), int(run.s)
    # a mixed-precision row computes on 16-bit values held in float32 (the runtime's
    # emulation, summasim.transformer.precision): its kernels run at float32's rate
    dtype = "float32" if run.dtype in ("bfloat16", "float16") else run.dtype

    def work_seconds(layers: int) -> float:
        cfg = TransformerConfig(b=micro, s=s, h=h, n=int(run.heads), N=layers, v=v,
                                dtype=dtype, checkpoint=False, ffn=f)
        w = step_work(sch, cfg)
        return (_compute_seconds(machine, w.gemms, cfg.dtype, w.reduce_bytes)
                + machine.gamma_elementwise * w.elementwise_items
                + machine.layer_seconds * w.layers)

    one, two = work_seconds(1), work_seconds(2)
    per_layer = (two - one) * (4.0 / 3.0 if run.checkpoint else 1.0)
    ends = one - (two - one)
    layer_params = ((4 + 2 * f) * h * h + (9 + f) * h) / T
    embed_params = (v + s) * h / T
    shard = dp if int(run.zero) >= 1 else 1
    out = []
    pp = int(run.pp)
    for events, coords in zip(run.events, run.coords):
        stage, lo, hi = int(coords[1]), int(coords[3]), int(coords[4])
        first, last = stage == 0, stage == pp - 1
        n_params = (hi - lo) * layer_params + (embed_params if first else 0) + (
            v * h / T if last and not first else 0)
        compute = m * ((hi - lo) * per_layer + (ends if last else 0.0))
        compute += machine.gamma_elementwise * ADAM_PASSES * n_params / shard
        out.append(trace_features(summary_messages(events), machine, p=run.p,
                                  dtype=dtype, compute_seconds=compute))
    return out


def predict_measured_mesh(run: MeasuredRun, machine: Machine) -> float:
    """Predicted seconds of one measured sharded-training step (``run``: its record) on
    this kind of node (the slowest rank,
    :func:`~summasim.costmodel.workload.predict.predict_features`)."""
    from .predict import predict_features

    run = require_run(run, "predict_measured_mesh")
    return predict_features(mesh_features(run, machine), machine,
                            machine.ranks_per_node(run.p))
