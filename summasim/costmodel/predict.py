"""Predicted time of summasim runs: from a trace, or in closed form.

Two entry points:

``predict_trace(events, machine, p=..., gemms=..., dtype=...)``
    Prices every recorded event with :func:`~summasim.costmodel.collectives.collective_time`
    (the algorithm MPI would pick, or a forced one), adds the compute, and applies
    the shared-core slowdown. This is what ``summasim.run`` calls with a rank's
    ``Trace`` to put a predicted time next to the measured one.
``predict_algorithm(name, m, k, n, q, d, machine, dtype=...)``
    The same from the closed forms of :mod:`~summasim.costmodel.traffic`, without
    running anything (fast for q up to 256 and rings of 10^5 ranks).

Model
-----
``T = slowdown * (T_comm + T_compute)`` with ``T_comm`` the sum of the predicted
times of the events, ``T_compute = sum 2 m k n gamma((m k n)^(1/3)) + gamma_r *
reduce_bytes``, and ``slowdown = max(1, ranks_per_node / cores)`` (communication
is slowed down only when the machine's ``shared_comm`` is true). With
``overlap=True`` the closed form assumes the double buffering the algorithms use:
the communication of step l+1 runs under the GEMM of step l, so
``T = c + (q-1) max(c, g) + g`` for per-step communication c and GEMM g. Overlap
buys nothing when cores are oversubscribed and communication needs them
(``shared_comm``), so then the sum is used.

A group's messages use the machine's inter-node link when the group spans nodes
(:func:`group_spans_nodes`; ranks are placed in Cartesian order
``rank = (k q + i) q + j``, ``node_size`` per node).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from . import traffic as _traffic
from .collectives import MPICH, Thresholds, collective_time, default_reduce_impl
from .machine import Machine, itemsize_of

#: (stride, size) of each named group on a [q, q, d] grid in Cartesian rank order.
_GROUP_SHAPES = {"row": lambda q, d, p: (1, q), "col": lambda q, d, p: (q, q),
                 "layer": lambda q, d, p: (1, q * q), "depth": lambda q, d, p: (q * q, d),
                 "world": lambda q, d, p: (1, p)}


def group_spans_nodes(group: str, machine: Machine, *, q: int = 1, d: int = 1,
                      p: int | None = None, group_size: int | None = None) -> bool:
    """Whether a group's ranks lie on more than one node.

    Ranks fill nodes of ``machine.node_size`` in Cartesian order
    (``rank = (k q + i) q + j``): a group of ``size`` ranks ``stride`` apart stays
    inside a node iff ``stride * size`` divides into ``node_size``. Unknown group
    names (1D groups, "ring") count as contiguous. Always False when the machine
    has no ``node_size`` (one node).
    """
    ns = machine.node_size
    if ns is None:
        return False
    p = p if p is not None else d * q * q
    shape = _GROUP_SHAPES.get(group)
    stride, size = shape(q, d, p) if shape else (1, group_size or p)
    if group_size is not None and shape is None:
        size = group_size
    extent = stride * size
    return not (extent <= ns and ns % extent == 0)


@dataclass
class Prediction:
    """A predicted time, split up.

    Attributes
    ----------
    seconds : float
        Predicted wall time (communication + compute, or the overlapped form).
    comm_seconds, compute_seconds : float
        The two parts, slowdown included.
    by_op : dict
        ``{(op, group): seconds}``.
    by_phase : dict
        ``{phase: seconds}`` of communication (trace predictions only).
    algorithms : dict
        ``{(op, group): sorted algorithm names}`` the model assumed.
    counts : dict
        ``{(op, group): (events, bytes)}`` that were priced.
    slowdown : float
        The shared-core factor applied.
    mode : str
        "mpich" or "paper".
    machine : str
        The machine's name.
    """

    seconds: float
    comm_seconds: float
    compute_seconds: float
    by_op: dict = field(default_factory=dict)
    by_phase: dict = field(default_factory=dict)
    algorithms: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    slowdown: float = 1.0
    mode: str = "mpich"
    machine: str = ""

    def describe_algorithms(self) -> str:
        """One line naming the algorithm assumed per (op, group), for reports."""
        return "; ".join(f"{op}/{grp}: {', '.join(algs)}"
                         for (op, grp), algs in sorted(self.algorithms.items()))

    def to_dict(self) -> dict:
        key = lambda k: f"{k[0]}/{k[1]}" if isinstance(k, tuple) else str(k)  # noqa: E731
        return {"seconds": self.seconds, "comm_seconds": self.comm_seconds,
                "compute_seconds": self.compute_seconds, "slowdown": self.slowdown,
                "mode": self.mode, "machine": self.machine,
                "by_op": {key(k): v for k, v in self.by_op.items()},
                "by_phase": dict(self.by_phase),
                "algorithms": {key(k): list(v) for k, v in self.algorithms.items()},
                "counts": {key(k): list(v) for k, v in self.counts.items()}}


class _Pricer:
    """Prices (op, group, size, nbytes) with caching and the placement rule."""

    def __init__(self, machine, mode, algorithms, thresholds, itemsize, q, d, p,
                 reduce_impl=None):
        self.machine, self.mode = machine, mode
        self.reduce_impl = reduce_impl or default_reduce_impl()
        self.algorithms = dict(algorithms or {})
        self.thresholds = thresholds or MPICH
        self.itemsize, self.q, self.d, self.p = itemsize, q, d, p
        self.cache: dict = {}

    def __call__(self, op, group, size, nbytes):
        key = (op, group, size, nbytes)
        hit = self.cache.get(key)
        if hit is None:
            inter = group_spans_nodes(group, self.machine, q=self.q, d=self.d, p=self.p,
                                      group_size=size)
            hit = collective_time(op, nbytes, size, self.machine,
                                  algorithm=self.algorithms.get(op), mode=self.mode,
                                  thresholds=self.thresholds, itemsize=self.itemsize,
                                  inter=inter, reduce_impl=self.reduce_impl)
            self.cache[key] = hit
        return hit


def make_pricer(machine: Machine, *, mode: str = "mpich",
                algorithms: Mapping[str, str] | None = None,
                thresholds: Thresholds | None = None, itemsize: int = 8, q: int = 1,
                d: int = 1, p: int | None = None, reduce_impl: str | None = None):
    """A caching callable ``(op, group, group_size, nbytes) -> CollectiveCost``."""
    return _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p, reduce_impl)


def _compute_seconds(machine: Machine, gemms, dtype, reduce_bytes) -> float:
    t = sum(cnt * machine.gemm_time(a, b, c, dtype) for a, b, c, cnt in gemms)
    return t + machine.gamma_reduce * reduce_bytes


def _resolve_p(machine, p, q, d, ranks_per_node):
    if p is None and q is not None:
        p = d * q * q
    if ranks_per_node is None:
        ranks_per_node = machine.ranks_per_node(p) if p is not None else 1
    return p, ranks_per_node


def predict_trace(events: Iterable, machine: Machine, *, p: int | None = None,
                  q: int | None = None, d: int = 1, ranks_per_node: int | None = None,
                  gemms: Iterable = (), dtype="float64", reduce_bytes: float = 0.0,
                  compute_seconds: float | None = None, mode: str = "mpich",
                  algorithms: Mapping[str, str] | None = None,
                  thresholds: Thresholds | None = None,
                  itemsize: int | None = None) -> Prediction:
    """Predicted time of one rank's recorded events plus its compute.

    Parameters
    ----------
    events : iterable of Event, or a Trace
        Anything with ``op``, ``group``, ``group_size``, ``nbytes`` (``phase``
        optional), e.g. ``grid.trace.events``.
    machine : Machine
    p : int, optional
        Total ranks (for the shared-core slowdown); or give ``q`` and ``d``.
    q, d : int, optional
        Grid shape, for placing "row"/"col"/"depth" groups on nodes.
    ranks_per_node : int, optional
        Overrides ``machine.ranks_per_node(p)``.
    gemms : iterable of (m, k, n, count)
        Local GEMM shapes (e.g. :func:`~summasim.costmodel.traffic.algorithm_compute`).
    dtype : str
        Dtype of the GEMMs.
    reduce_bytes : float
        Bytes added locally outside MPI (ring reduce-scatter).
    compute_seconds : float, optional
        Use this compute time (before slowdown) instead of the GEMM model.
    mode : {"mpich", "paper"}
    algorithms : dict, optional
        Force an algorithm per op, e.g. ``{"bcast": "binomial"}``.
    thresholds : Thresholds, optional
        MPICH selection thresholds.
    itemsize : int, optional
        Bytes per item for the selection rules (default: that of ``dtype``).

    Returns
    -------
    Prediction
    """
    events = getattr(events, "events", events)
    p, rpn = _resolve_p(machine, p, q, d, ranks_per_node)
    itemsize = itemsize if itemsize is not None else itemsize_of(dtype)
    pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q or 1, d, p)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    by_op: dict = defaultdict(float)
    by_phase: dict = defaultdict(float)
    algs: dict = defaultdict(set)
    counts: dict = defaultdict(lambda: [0, 0])
    for e in events:
        cost = pricer(e.op, e.group, int(e.group_size), int(e.nbytes))
        key = (e.op, e.group)
        by_op[key] += cost.seconds * comm_slow
        by_phase[getattr(e, "phase", "")] += cost.seconds * comm_slow
        algs[key].add(cost.algorithm)
        counts[key][0] += 1
        counts[key][1] += int(e.nbytes)
    comm = sum(by_op.values())
    base = (compute_seconds if compute_seconds is not None
            else _compute_seconds(machine, gemms, dtype, reduce_bytes))
    compute = base * slow
    return Prediction(comm + compute, comm, compute, dict(by_op), dict(by_phase),
                      {k: tuple(sorted(v)) for k, v in algs.items()},
                      {k: tuple(v) for k, v in counts.items()}, slow, mode, machine.name)


def _worst_coords(name, q, d, m, k, n, count, p):
    """Coordinates of a rank on the critical path (most traffic)."""
    if name == "cannon_ab":
        return [(1 % q, 1 % q)]
    if name == "summa25_atb" and d > 1:
        return [(0, 0, kk) for kk in range(d)]
    if name in _traffic.RING_NAMES:
        n_items = count if count is not None else m
        extra = int(n_items) % p if p else 0
        return sorted({r % p for r in (0, 1, extra - 2, extra - 1, extra, p - 2, p - 1)})
    return [None]


def price_messages(messages, machine: Machine, *, mode: str = "mpich",
                   algorithms: Mapping[str, str] | None = None,
                   thresholds: Thresholds | None = None, itemsize: int = 8,
                   q: int = 1, d: int = 1, p: int | None = None, pricer=None):
    """``(seconds, by_op, algorithms)`` of :class:`~summasim.costmodel.traffic.MessageClass`
    entries (no slowdown). ``pricer`` (from :func:`make_pricer`) reuses a cache."""
    if pricer is None:
        pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p)
    by_op: dict = defaultdict(float)
    algs: dict = defaultdict(set)
    for mc in messages:
        cost = pricer(mc.op, mc.group, mc.group_size, mc.nbytes)
        by_op[(mc.op, mc.group)] += mc.count * cost.seconds
        algs[(mc.op, mc.group)].add(cost.algorithm)
    return sum(by_op.values()), dict(by_op), {k: tuple(sorted(v)) for k, v in algs.items()}


def predict_algorithm(name: str, m: int | None = None, k: int | None = None,
                      n: int | None = None, q: int = 1, d: int = 1, *, machine: Machine,
                      dtype="float64", coords="worst", count: int | None = None,
                      p: int | None = None, group: str | None = None,
                      ranks_per_node: int | None = None, mode: str = "mpich",
                      algorithms: Mapping[str, str] | None = None,
                      thresholds: Thresholds | None = None, overlap: bool = False,
                      strict: bool = True) -> Prediction:
    """Closed-form predicted time of one call of algorithm ``name`` on one rank.

    Parameters
    ----------
    name : str
        A name in :data:`summasim.costmodel.traffic.ALGORITHM_NAMES`.
    m, k, n : int
        Global dimensions (see :mod:`~summasim.costmodel.traffic`).
    q, d : int
        Grid ``[q, q, d]``.
    machine : Machine
    dtype : str
        Item dtype (sets the item size and the GEMM gamma).
    coords : "worst", tuple or None
        The rank to predict; "worst" takes the slowest rank (Cannon's skewed ranks,
        the depth rank of summa25_atb with the largest ring chunks).
    count, p, group : optional
        Ring algorithms: N items, P ranks, group name.
    ranks_per_node : int, optional
        Overrides ``machine.ranks_per_node(p)``.
    mode, algorithms, thresholds
        See :func:`predict_trace`.
    overlap : bool
        Model the double-buffered overlap of communication and GEMMs.
    strict : bool
        Require even division (False: real-valued blocks, for scaling studies).

    Returns
    -------
    Prediction
    """
    itemsize = itemsize_of(dtype)
    if name in _traffic.RING_NAMES:
        ranks = p
        q_, d_ = 1, 1
    else:
        ranks = d * q * q
        q_, d_ = q, d
    rpn = ranks_per_node if ranks_per_node is not None else machine.ranks_per_node(ranks)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    cands = _worst_coords(name, q, d, m, k, n, count, p) if coords == "worst" else [coords]
    best = None
    for c in cands:
        msgs = _traffic.algorithm_messages(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                           group=group, strict=strict)
        comm, by_op, algs = price_messages(msgs, machine, mode=mode, algorithms=algorithms,
                                           thresholds=thresholds, itemsize=itemsize,
                                           q=q_, d=d_, p=ranks)
        work = _traffic.algorithm_compute(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                          group=group, strict=strict)
        compute = _compute_seconds(machine, work.gemms, dtype, work.reduce_bytes)
        total = (comm * comm_slow) + compute * slow
        if overlap and not (machine.shared_comm and slow > 1) and name in _traffic.MATMUL_NAMES \
                and q > 1:
            steps = q
            tail = sum(v for (op, grp), v in by_op.items() if grp == "depth")
            c_step = (comm - tail) / steps
            g_step = (compute - machine.gamma_reduce * work.reduce_bytes) / steps
            total = (c_step + (steps - 1) * max(c_step, g_step) + g_step) * slow \
                + (tail * comm_slow + machine.gamma_reduce * work.reduce_bytes * slow)
        pred = Prediction(total, comm * comm_slow, compute * slow,
                          {kk: v * comm_slow for kk, v in by_op.items()}, {}, algs,
                          _traffic.summarize_events(msgs), slow, mode, machine.name)
        if best is None or pred.seconds > best.seconds:
            best = pred
    return best
