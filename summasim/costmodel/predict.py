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

Machines whose ``library`` is "nccl" price every collective with NCCL's ring/tree
algorithms and protocols (:mod:`~summasim.costmodel.nccl`) on the links the
group crosses under a placement (:mod:`~summasim.costmodel.topology`): the
concurrent groups of one kind share the socket links and NICs. The algorithm
reported is ``nccl_<ring|tree|p2p>_<protocol>``. MPICH machines (the default, and
the local preset) take exactly the path above.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

from . import traffic as _traffic
from .collectives import (MPICH, CollectiveCost, Thresholds, collective_shape,
                          collective_time, default_reduce_impl)
from .machine import Machine, SharedCore, itemsize_of
from .nccl import NcclCost, nccl_time
from .topology import GridShape, Placement, group_path

_UNIT_SHARED = SharedCore()

#: Memory streams per byte: the traffic count of the memory floor
#: (:meth:`~summasim.costmodel.machine.Machine.memory_floor`, a machine with
#: ``memory_bandwidth``). A copy between ranks reads its source and writes its
#: destination, whose cache lines are read first (write-allocate): 3 (MPICH moves a
#: large shared-memory message in one copy, CMA's ``process_vm_readv``). An in-place
#: add ``a += b`` reads two streams and writes one: 3. An add into an output it has
#: not read (``out = x + recv``: the first add of each chunk of an out-of-place ring)
#: reads that output's lines first too: 4. GEMMs and elementwise work are not counted,
#: so the floor is a lower bound; it binds where messages and additions stream more
#: than the caches hold, and a machine with ``cache_bytes`` leaves it out where the
#: ranks' data (their ``working_set``, where known) fits in the node's cache. At
#: p = 16 on this VM the 64 MiB out-of-place ring streams 16 x 10 x 15/16 x 64 MiB =
#: 9.4 GiB by this count; its time times the memory throughput of the launch came to
#: 9.1-10.4 GiB in 18 of 19 launches over three sessions, and in place (9 streams per
#: step: 8.4 GiB) to 8.0 (docs/performance.md).
COPY_STREAMS = 3
ADD_STREAMS = 3
ADD_OUT_STREAMS = 4

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
    breakdown : dict
        Whole training steps (:func:`~summasim.costmodel.schemes.step_cost`):
        ``gemm_seconds``, ``memory_bound_seconds`` (elementwise and optimizer work,
        launches included), ``comm_seconds`` and ``comm_exposed_seconds``. A machine
        with ``memory_bandwidth`` adds ``memory_floor_seconds`` and
        ``memory_floor_excess_seconds`` (what the floor added; counted in
        ``comm_seconds``, so ``by_op`` and ``by_phase`` then sum to less).
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
    breakdown: dict = field(default_factory=dict)

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
                "counts": {key(k): list(v) for k, v in self.counts.items()},
                "breakdown": dict(self.breakdown)}


class _Pricer:
    """Prices (op, group, size, nbytes) with caching and the placement rule."""

    def __init__(self, machine, mode, algorithms, thresholds, itemsize, q, d, p,
                 reduce_impl=None, placement=None):
        self.machine, self.mode = machine, mode
        self.reduce_impl = reduce_impl or default_reduce_impl()
        self.algorithms = dict(algorithms or {})
        self.thresholds = thresholds or MPICH
        self.itemsize, self.q, self.d, self.p = itemsize, q, d, p
        self.cache: dict = {}
        self.nccl = machine.library == "nccl" and mode != "paper"
        self.placement = placement if placement is not None else Placement()
        self.paths: dict = {}

    def path(self, group, size):
        """The :class:`~summasim.costmodel.topology.GroupPath` of ``group`` (NCCL only)."""
        key = (group, size)
        hit = self.paths.get(key)
        if hit is None:
            grid = GridShape.of(self.p if self.p is not None else size, self.q, self.d)
            if grid.p < size:
                grid = GridShape.of(size)
            hit = group_path(self.machine.topology, grid, group, size, self.placement)
            self.paths[key] = hit
        return hit

    def __call__(self, op, group, size, nbytes):
        key = (op, group, size, nbytes)
        hit = self.cache.get(key)
        if hit is None and self.nccl:
            if size <= 1:
                hit = CollectiveCost(0.0, "none")
            else:
                forced = self.algorithms.get(op)
                alg, _, proto = (forced or "").partition("/")
                c: NcclCost = nccl_time(op, nbytes, self.path(group, size),
                                        ll128=self.machine.topology.ll128,
                                        algorithm=alg or None, protocol=proto or None)
                hit = CollectiveCost(c.seconds, c.name)
            self.cache[key] = hit
        if hit is None:
            inter = group_spans_nodes(group, self.machine, q=self.q, d=self.d, p=self.p,
                                      group_size=size)
            hit = collective_time(op, nbytes, size, self.machine,
                                  algorithm=self.algorithms.get(op), mode=self.mode,
                                  thresholds=self.thresholds, itemsize=self.itemsize,
                                  inter=inter, reduce_impl=self.reduce_impl)
            self.cache[key] = hit
        return hit

    def work(self, op, group, size, nbytes):
        """``(cpu_seconds, hops, hop_bytes, copy_seconds)`` of one member's share of a
        collective (the shared-core model's inputs; see :func:`shared_core_time`);
        ``copy_seconds`` is the part of ``cpu_seconds`` that moves the bytes (the
        link's alpha and beta, without the additions)."""
        key = ("work", op, group, size, nbytes)
        hit = self.cache.get(key)
        if hit is None:
            cost = self(op, group, size, nbytes)
            if size <= 1 or cost.algorithm == "none":
                hit = (0.0, 0.0, 0.0, 0.0)
            else:
                sh = collective_shape(op, cost.algorithm, nbytes, size)
                inter = group_spans_nodes(group, self.machine, q=self.q, d=self.d, p=self.p,
                                          group_size=size)
                link = self.machine.link(inter)
                per = sh.nbytes / sh.msgs if sh.msgs else 0.0
                gr = (self.machine.gamma_reduce if sh.reduce_kind == "add"
                      else self.machine.gamma_reduce_mpi)
                copy = sh.msgs * link.alpha(per) + sh.nbytes * link.beta(per)
                hit = (copy + sh.reduce_bytes * gr, sh.hops, sh.hop_bytes, copy)
            self.cache[key] = hit
        return hit

    def traffic(self, op, group, size, nbytes):
        """Bytes one member's share of a collective streams through host memory
        (:data:`COPY_STREAMS` per byte copied, :data:`ADD_STREAMS` per byte added);
        0 on an NCCL machine, whose messages do not use the host's memory."""
        key = ("traffic", op, group, size, nbytes)
        hit = self.cache.get(key)
        if hit is None:
            cost = self(op, group, size, nbytes)
            if self.nccl or size <= 1 or cost.algorithm == "none":
                hit = 0.0
            else:
                sh = collective_shape(op, cost.algorithm, nbytes, size)
                hit = COPY_STREAMS * sh.nbytes + ADD_STREAMS * sh.reduce_bytes
            self.cache[key] = hit
        return hit


def make_pricer(machine: Machine, *, mode: str = "mpich",
                algorithms: Mapping[str, str] | None = None,
                thresholds: Thresholds | None = None, itemsize: int = 8, q: int = 1,
                d: int = 1, p: int | None = None, reduce_impl: str | None = None,
                placement: Placement | None = None):
    """A caching callable ``(op, group, group_size, nbytes) -> CollectiveCost``
    (``placement``: how ranks sit on nodes, for NCCL machines; default row-major)."""
    return _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p, reduce_impl,
                   placement)


def _compute_seconds(machine: Machine, gemms, dtype, reduce_bytes) -> float:
    t = sum(cnt * machine.gemm_time(a, b, c, dtype) for a, b, c, cnt in gemms)
    return t + machine.gamma_reduce * reduce_bytes


def _resolve_p(machine, p, q, d, ranks_per_node):
    if p is None and q is not None:
        p = d * q * q
    if ranks_per_node is None:
        ranks_per_node = machine.ranks_per_node(p) if p is not None else 1
    return p, ranks_per_node


def shared_core_time(machine: Machine, ranks_per_node: int, compute: float, comm_cpu: float,
                     calls: float, hops: float, hop_bytes: float,
                     mpi_hops: float = 0.0, mpi_hop_bytes: float = 0.0,
                     mpi_copy: float = 0.0) -> float | None:
    """Seconds of one rank under oversubscription (see the module doc), or None when
    the machine has no shared-core model or the node is not oversubscribed.

    ``compute``: CPU seconds of local work; ``comm_cpu``: the rank's share of the
    copies and additions of its collectives; ``calls``: its communication calls;
    ``hops``/``hop_bytes``: messages (and their bytes) on the critical paths of its
    collectives completed by the wait policy (polled); ``mpi_hops``/``mpi_hop_bytes``:
    those waited for inside a blocking MPI call or an exchanger step, ``mpi_copy``
    the link copies of those (within ``comm_cpu``; see
    :meth:`~summasim.costmodel.machine.SharedCore.charged_work`).
    """
    sc = machine.shared_core
    R = ranks_per_node / machine.cores
    if sc is None or R <= 1.0:
        return None
    work = compute + comm_cpu + calls * machine.call_seconds
    return R * (sc.unit_seconds(work, hops, hop_bytes, mpi_hops, mpi_hop_bytes, mpi_copy)
                + sc.sync_seconds)


#: Traced point-to-point ops and the collective whose one-message cost prices them.
_POINT_TO_POINT = {"send": "sendrecv", "recv": "sendrecv"}


class _Tally:
    """Accumulates priced events: critical-path seconds and shared-core inputs."""

    def __init__(self, pricer):
        self.pricer = pricer
        self.crit: dict = defaultdict(float)      # (op, group) -> seconds (no slowdown)
        # cpu, calls, polled hops, their bytes, hops waited for inside MPI, their bytes,
        # the copy seconds (within cpu) of the latter
        self.shared: dict = defaultdict(lambda: [0.0] * 7)
        self.by_phase: dict = defaultdict(float)
        self.algs: dict = defaultdict(set)
        self.counts: dict = defaultdict(lambda: [0, 0])
        self.traffic = 0.0      # bytes streamed through host memory (the memory floor)

    def add(self, op, group, size, nbytes, count=1, phase="", blocking=False):
        # a point-to-point send or receive (a pipeline's activations) is one message of
        # nbytes on this rank's path: priced like a sendrecv step of that size
        sent_only = op == "send"      # the receiver's copy streams its bytes: counted there
        op = _POINT_TO_POINT.get(op, op)
        cost = self.pricer(op, group, size, nbytes)
        key = (op, group)
        self.crit[key] += count * cost.seconds
        self.by_phase[phase] += count * cost.seconds
        self.algs[key].add(cost.algorithm)
        self.counts[key][0] += count
        self.counts[key][1] += count * nbytes
        if size > 1 and not self.pricer.nccl and not sent_only:
            self.traffic += count * self.pricer.traffic(op, group, size, nbytes)
        if size > 1 and self.pricer.machine.shared_core is not None and not self.pricer.nccl:
            cpu, hops, hb, copy = self.pricer.work(op, group, size, nbytes)
            acc = self.shared[key]
            acc[0] += count * cpu
            acc[1] += count
            acc[4 if blocking else 2] += count * hops
            acc[5 if blocking else 3] += count * hb
            if blocking:
                acc[6] += count * copy
        elif size > 1:
            self.shared[key][1] += count

    def totals(self):
        v = list(self.shared.values())
        return tuple(sum(x[i] for x in v) for i in range(7))


def _finish(machine, tally, rpn, compute_base, mode, dedicated_total=None,
            local_traffic=0.0, working_set=None):
    """Combine a tally and the compute into a Prediction (dedicated or shared-core),
    never below the node's memory floor (the tally's traffic plus ``local_traffic``,
    the bytes the rank's own additions stream, over a rank's ``working_set``;
    ``breakdown["memory_floor_seconds"]`` when the machine has a ``memory_bandwidth``)."""
    pred = _combine(machine, tally, rpn, compute_base, mode, dedicated_total)
    if machine.memory_bandwidth is not None and mode != "paper":
        _raise_to_floor(pred, machine.memory_floor(rpn, tally.traffic + local_traffic,
                                                   working_set))
    return pred


def _raise_to_floor(pred, floor: float) -> None:
    """Record the memory floor in ``pred.breakdown`` and raise ``pred`` to it: the
    excess (``memory_floor_excess_seconds``) counts as communication, the time the
    node's memory keeps its ranks waiting."""
    excess = max(0.0, floor - pred.seconds)
    pred.breakdown["memory_floor_seconds"] = floor
    pred.breakdown["memory_floor_excess_seconds"] = excess
    pred.comm_seconds += excess
    pred.seconds += excess


def _combine(machine, tally, rpn, compute_base, mode, dedicated_total=None):
    """A tally and the compute as a Prediction (dedicated or shared-core)."""
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    cpu, calls, hops, hb, mpi_hops, mpi_hb, mpi_copy = tally.totals()
    call_t = machine.call_seconds
    crit = {k: v + tally.shared[k][1] * call_t for k, v in tally.crit.items()}
    shared = shared_core_time(machine, rpn, compute_base, cpu, calls, hops, hb, mpi_hops,
                              mpi_hb, mpi_copy)
    algs = {k: tuple(sorted(v)) for k, v in tally.algs.items()}
    counts = {k: tuple(v) for k, v in tally.counts.items()}
    if shared is None:
        comm = sum(crit.values()) * comm_slow
        compute = compute_base * slow
        total = comm + compute if dedicated_total is None else dedicated_total
        return Prediction(total, comm, compute, {k: v * comm_slow for k, v in crit.items()},
                          {k: v * comm_slow for k, v in tally.by_phase.items()}, algs, counts,
                          slow, mode, machine.name)
    sc, R = machine.shared_core, rpn / machine.cores
    by_op = {k: R * sc.unit_seconds(a[0] + a[1] * call_t, a[2], a[3], a[4], a[5], a[6])
             for k, a in tally.shared.items()}
    compute = R * sc.work_factor * compute_base
    dedicated = (sum(crit.values()) + compute_base if dedicated_total is None
                 else dedicated_total)
    total = max(shared, dedicated)
    return Prediction(total, total - compute, compute, by_op, {}, algs, counts, R, mode,
                      machine.name)


def _count(e) -> int:
    """Events one entry stands for: a MessageClass's or a :class:`Messages`' ``count``,
    else 1 (an Event is a NamedTuple too, whose ``count`` is tuple's method)."""
    return e.count if isinstance(e, (_traffic.MessageClass, Messages)) else 1


class Messages(NamedTuple):
    """``count`` identical events of one rank, as a trace summary holds them: a
    :class:`~summasim.costmodel.traffic.MessageClass` plus whether the rank waited for
    them inside a blocking MPI call (``blocking``, as the trace's
    :class:`~summasim.trace.Event` records it)."""

    op: str
    group: str
    group_size: int
    nbytes: int
    count: int
    blocking: bool = False


def summary_messages(rank_events) -> list:
    """:class:`Messages` of one rank's event summary (``[[op, group, group_size,
    nbytes, count, blocking], ...]``, as :func:`summasim.costmodel.accuracy.event_summary`
    writes it; five fields in measurements from before the ``blocking`` flag: all
    polled)."""
    return [Messages(e[0], e[1], int(e[2]), int(e[3]), int(e[4]),
                     bool(e[5]) if len(e) > 5 else False) for e in rank_events]


def predict_trace(events: Iterable, machine: Machine, *, p: int | None = None,
                  q: int | None = None, d: int = 1, ranks_per_node: int | None = None,
                  gemms: Iterable = (), dtype="float64", reduce_bytes: float = 0.0,
                  compute_seconds: float | None = None, mode: str = "mpich",
                  algorithms: Mapping[str, str] | None = None,
                  thresholds: Thresholds | None = None,
                  itemsize: int | None = None, reduce_impl: str | None = None,
                  elementwise_items: float = 0.0, layers: float = 0.0,
                  placement: Placement | None = None,
                  working_set: float | None = None) -> Prediction:
    """Predicted time of one rank's recorded events plus its compute.

    Parameters
    ----------
    events : iterable of Event, or a Trace
        Anything with ``op``, ``group``, ``group_size``, ``nbytes`` (``phase`` and
        ``count`` optional), e.g. ``grid.trace.events`` or
        :class:`~summasim.costmodel.traffic.MessageClass` entries.
    machine : Machine
    p : int, optional
        Total ranks (for the shared cores); or give ``q`` and ``d``.
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
        Use this compute time (CPU seconds of one rank) instead of the GEMM model.
    mode : {"mpich", "paper"}
    algorithms : dict, optional
        Force an algorithm per op, e.g. ``{"bcast": "binomial"}``.
    thresholds : Thresholds, optional
        MPICH selection thresholds.
    itemsize : int, optional
        Bytes per item for the selection rules (default: that of ``dtype``).
    reduce_impl : {"tree", "mpi"}, optional
        How "reduce" events ran (default as ``Comm``: ``$SUMMASIM_REDUCE`` or "tree").
    elementwise_items : float
        Activation items of transformer elementwise work (priced with the machine's
        ``gamma_elementwise``; see :func:`~summasim.costmodel.schemes.step_work`).
    layers : float
        Transformer layers in the run (each costs the machine's ``layer_seconds``).
    placement : Placement, optional
        How the ranks sit on nodes (NCCL machines; default row-major).
    working_set : float, optional
        Bytes of data the rank touches (its buffers), for the memory floor's cache
        test (``Machine.memory_floor``); None: unknown, taken as outgrowing the cache.

    Returns
    -------
    Prediction
        ``slowdown`` is the time-sharing factor R = ranks per node / cores.
    """
    events = getattr(events, "events", events)
    p, rpn = _resolve_p(machine, p, q, d, ranks_per_node)
    itemsize = itemsize if itemsize is not None else itemsize_of(dtype)
    pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q or 1, d, p, reduce_impl,
                     placement)
    tally = _Tally(pricer)
    for e in events:   # recorded Events, or MessageClass entries (``count`` events each)
        tally.add(e.op, e.group, int(e.group_size), int(e.nbytes), _count(e),
                  getattr(e, "phase", ""), getattr(e, "blocking", False))
    base = (compute_seconds if compute_seconds is not None
            else _compute_seconds(machine, gemms, dtype, reduce_bytes))
    base += machine.gamma_elementwise * elementwise_items + machine.layer_seconds * layers
    return _finish(machine, tally, rpn, base, mode, local_traffic=ADD_STREAMS * reduce_bytes,
                   working_set=working_set)


@dataclass
class SharedFeatures:
    """The inputs of the shared-core model for one rank (all per rank, no R):
    CPU ``work`` seconds (compute, the rank's share of copies and additions, and
    ``call_seconds`` per call), ``hops`` (completed by the wait policy: polled) and
    ``mpi_hops`` (waited for inside a blocking MPI call or an exchanger step) on
    critical paths, their bytes ``hop_bytes`` and ``mpi_hop_bytes``, the link copies
    of the latter ``mpi_copy`` (seconds, within ``work``), the ``dedicated``
    prediction (one rank per core), the bytes ``memory_traffic`` its messages and
    additions stream through host memory and the bytes ``working_set`` of data it
    touches (None: unknown), the memory floor's inputs."""

    work: float
    hops: float
    hop_bytes: float
    dedicated: float
    calls: float = 0.0
    mpi_hops: float = 0.0
    mpi_hop_bytes: float = 0.0
    mpi_copy: float = 0.0
    memory_traffic: float = 0.0
    working_set: float | None = None


def trace_features(events: Iterable, machine: Machine, *, p: int | None = None,
                   q: int | None = None, d: int = 1, gemms: Iterable = (), dtype="float64",
                   reduce_bytes: float = 0.0, compute_seconds: float | None = None,
                   itemsize: int | None = None, reduce_impl: str | None = None,
                   elementwise_items: float = 0.0, layers: float = 0.0,
                   reduce_streams: int = ADD_STREAMS,
                   working_set: float | None = None) -> SharedFeatures:
    """:class:`SharedFeatures` of one rank's events and compute (arguments as in
    :func:`predict_trace`); what :func:`~summasim.costmodel.fit.fit_shared_core` fits.
    ``reduce_streams``: memory streams per byte of ``reduce_bytes`` (:data:`ADD_STREAMS`
    in place, :data:`ADD_OUT_STREAMS` into a separate output); ``working_set`` as in
    :func:`predict_trace`."""
    events = getattr(events, "events", events)
    p, _ = _resolve_p(machine, p, q, d, None)
    itemsize = itemsize if itemsize is not None else itemsize_of(dtype)
    probe = machine if machine.shared_core is not None else machine.replace(
        shared_core=_UNIT_SHARED)
    pricer = _Pricer(probe, "mpich", None, None, itemsize, q or 1, d, p, reduce_impl)
    tally = _Tally(pricer)
    for e in events:   # recorded Events, or MessageClass entries (``count`` events each)
        tally.add(e.op, e.group, int(e.group_size), int(e.nbytes), _count(e),
                  blocking=getattr(e, "blocking", False))
    base = (compute_seconds if compute_seconds is not None
            else _compute_seconds(machine, gemms, dtype, reduce_bytes))
    base += machine.gamma_elementwise * elementwise_items + machine.layer_seconds * layers
    cpu, calls, hops, hb, mpi_hops, mpi_hb, mpi_copy = tally.totals()
    dedicated = sum(tally.crit.values()) + calls * machine.call_seconds + base
    return SharedFeatures(base + cpu + calls * machine.call_seconds, hops, hb, dedicated, calls,
                          mpi_hops, mpi_hb, mpi_copy,
                          tally.traffic + reduce_streams * reduce_bytes, working_set)


def predict_features(features: Iterable[SharedFeatures], machine: Machine,
                     ranks_per_node: int) -> float:
    """Predicted seconds of a run (the slowest rank) from every rank's
    :class:`SharedFeatures`: with the shared-core model on an oversubscribed node,
    ``R (work_factor max W + hop_seconds max H + mpi_hop_seconds max H_mpi +
    hop_seconds_per_byte max B + mpi_hop_seconds_per_byte max B_mpi + sync_seconds)``
    (maxima over ranks, R = ranks per node / cores), never less
    than the dedicated prediction; otherwise the largest dedicated prediction
    (times the machine's plain ``slowdown`` when it has no shared-core model).
    This is what :func:`~summasim.costmodel.fit.fit_shared_core` fits. Either is raised
    to the node's memory floor (``machine.memory_floor`` of the ranks' mean streamed
    bytes: the node's total over its ranks) where that is larger.
    """
    f = merge_features(features)
    floor = machine.memory_floor(ranks_per_node, f.memory_traffic, f.working_set)
    if ranks_per_node <= machine.cores:
        return max(f.dedicated, floor)
    if machine.shared_core is None:
        return max(f.dedicated * machine.slowdown(ranks_per_node), floor)
    # f.work already holds the calls' seconds: none added again
    shared = shared_core_time(machine, ranks_per_node, f.work, 0.0, 0.0, f.hops, f.hop_bytes,
                              f.mpi_hops, f.mpi_hop_bytes, f.mpi_copy)
    return max(shared, f.dedicated, floor)


def merge_features(features: Iterable[SharedFeatures]) -> SharedFeatures:
    """The run's features: the maximum over ranks of each of them, but
    ``memory_traffic``, their mean (times ranks per node, the node's streams: the ranks
    share one memory) and ``working_set`` (None if any rank's is unknown). ``mpi_copy`` is
    merged so that ``work - mpi_copy`` (the work a machine with
    ``mpi_hop_seconds_per_byte`` charges) is the maximum over ranks of that
    difference too: a rank with more work but no exchanger copies is not charged less
    because another rank's copies were large."""
    feats = list(features)
    if not feats:
        raise ValueError("the features of at least one rank are needed")
    top = {k: max(getattr(f, k) for f in feats)
           for k in ("work", "hops", "hop_bytes", "dedicated", "calls", "mpi_hops",
                     "mpi_hop_bytes")}
    top["memory_traffic"] = sum(f.memory_traffic for f in feats) / len(feats)
    top["mpi_copy"] = top["work"] - max(f.work - f.mpi_copy for f in feats)
    sets = [f.working_set for f in feats]
    top["working_set"] = None if None in sets else max(sets)
    return SharedFeatures(**top)


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
                   q: int = 1, d: int = 1, p: int | None = None, pricer=None,
                   reduce_impl: str | None = None, placement: Placement | None = None):
    """``(seconds, by_op, algorithms)`` of :class:`~summasim.costmodel.traffic.MessageClass`
    entries (no slowdown). ``pricer`` (from :func:`make_pricer`) reuses a cache."""
    if pricer is None:
        pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p, reduce_impl,
                         placement)
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
                      strict: bool = True, reduce_impl: str | None = None,
                      placement: Placement | None = None) -> Prediction:
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
    reduce_impl : {"tree", "mpi"}, optional
        How "reduce" runs (default as ``Comm``).
    placement : Placement, optional
        How the ranks sit on nodes (NCCL machines; default row-major).

    Returns
    -------
    Prediction
    """
    itemsize = itemsize_of(dtype)
    # a ring's data: its vector, a receive chunk and, for ring_allreduce called as by
    # default (out=None), the output its adds write (4 streams per added byte); the
    # ZeRO halves run in place
    ring_set, add_streams = None, ADD_STREAMS
    if name in _traffic.RING_NAMES:
        ranks = p
        q_, d_ = 1, 1
        out = name == "ring_allreduce"
        ring_set = _traffic.ring_working_set(count if count is not None else m, p, itemsize,
                                             out)
        add_streams = ADD_OUT_STREAMS if out else ADD_STREAMS
    else:
        ranks = d * q * q
        q_, d_ = q, d
    rpn = ranks_per_node if ranks_per_node is not None else machine.ranks_per_node(ranks)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    cands = _worst_coords(name, q, d, m, k, n, count, p) if coords == "worst" else [coords]
    pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q_, d_, ranks, reduce_impl,
                     placement)
    best = None
    for c in cands:
        msgs = _traffic.algorithm_messages(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                           group=group, strict=strict)
        tally = _Tally(pricer)
        for mc in msgs:
            tally.add(mc.op, mc.group, mc.group_size, mc.nbytes, mc.count)
        work = _traffic.algorithm_compute(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                          group=group, strict=strict)
        compute = _compute_seconds(machine, work.gemms, dtype, work.reduce_bytes)
        dedicated = None
        if overlap and not (machine.shared_comm and slow > 1) and name in _traffic.MATMUL_NAMES \
                and q > 1:
            steps = q
            by_op = {kk: v + tally.shared[kk][1] * machine.call_seconds
                     for kk, v in tally.crit.items()}
            comm = sum(by_op.values())
            tail = sum(v for (op, grp), v in by_op.items() if grp == "depth")
            c_step = (comm - tail) / steps
            g_step = (compute - machine.gamma_reduce * work.reduce_bytes) / steps
            dedicated = (c_step + (steps - 1) * max(c_step, g_step) + g_step) * slow \
                + (tail * comm_slow + machine.gamma_reduce * work.reduce_bytes * slow)
        pred = _finish(machine, tally, rpn, compute, mode, dedicated,
                       local_traffic=add_streams * work.reduce_bytes, working_set=ring_set)
        pred.counts = _traffic.summarize_events(msgs)
        if best is None or pred.seconds > best.seconds:
            best = pred
    return best
