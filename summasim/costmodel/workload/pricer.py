"""Predicted time of summasim runs: from a trace, or in closed form.

Two entry points:

``predict_trace(events, machine, p=..., gemms=..., dtype=...)``
    Prices every recorded event with :func:`~summasim.costmodel.collectives.collective_time`
    (the algorithm MPI would pick, or a forced one), adds the compute, and applies
    the shared-core slowdown. This is what ``summasim.run`` calls with a rank's
    ``Trace`` to put a predicted time next to the measured one.
``predict_algorithm(name, m, k, n, q, d, machine, dtype=...)``
    The same from the closed forms of :mod:`~summasim.costmodel.workload.traffic`, without
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
algorithms and protocols (:mod:`~summasim.costmodel.collectives.nccl`) on the links the
group crosses under a placement (:mod:`~summasim.costmodel.machine.topology`): the
concurrent groups of one kind share the socket links and NICs. The algorithm
reported is ``nccl_<ring|tree|p2p>_<protocol>``. MPICH machines (the default, and
the local preset) take exactly the path above.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from . import traffic as _traffic
from ..collectives import (MPICH, CollectiveCost, Thresholds, collective_shape,
                          collective_time, default_reduce_impl)
from ..machine import Machine, SharedCore
from summasim.costmodel.collectives.nccl import NcclCost, nccl_time
from summasim.costmodel.machine.topology import GridShape, Placement, group_path

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
_GROUP_SHAPES = {"row": lambda q, d, p, c: (1, c), "col": lambda q, d, p, c: (c, q),
                 "layer": lambda q, d, p, c: (1, q * c), "depth": lambda q, d, p, c: (q * c, d),
                 "world": lambda q, d, p, c: (1, p)}


def group_spans_nodes(group: str, machine: Machine, *, q: int = 1, d: int = 1,
                      p: int | None = None, group_size: int | None = None,
                      pc: int | None = None) -> bool:
    """Whether a group's ranks lie on more than one node.

    Ranks fill nodes of ``machine.node_size`` in Cartesian order
    (``rank = (k q + i) pc + j`` on a ``[q, pc, d]`` grid, ``pc = q`` unless given): a
    group of ``size`` ranks ``stride`` apart stays
    inside a node iff ``stride * size`` divides into ``node_size``. Unknown group
    names (1D groups, "ring") count as contiguous. Always False when the machine
    has no ``node_size`` (one node).
    """
    ns = machine.node_size
    if ns is None:
        return False
    pc = pc or q
    p = p if p is not None else d * q * pc
    shape = _GROUP_SHAPES.get(group)
    stride, size = shape(q, d, p, pc) if shape else (1, group_size or p)
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
        Whole training steps (:func:`~summasim.costmodel.workload.step.step_cost`):
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
                 reduce_impl=None, placement=None, pc=None):
        self.machine, self.mode = machine, mode
        self.reduce_impl = reduce_impl or default_reduce_impl()
        self.algorithms = dict(algorithms or {})
        self.thresholds = thresholds or MPICH
        self.itemsize, self.q, self.d, self.p = itemsize, q, d, p
        self.pc = pc or q
        self.cache: dict = {}
        self.nccl = machine.library == "nccl" and mode != "paper"
        self.placement = placement if placement is not None else Placement()
        self.paths: dict = {}

    def path(self, group, size):
        """The :class:`~summasim.costmodel.machine.topology.GroupPath` of ``group`` (NCCL only)."""
        key = (group, size)
        hit = self.paths.get(key)
        if hit is None:
            grid = GridShape.of(self.p if self.p is not None else size, self.q, self.d,
                                pc=self.pc)
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
                                      group_size=size, pc=self.pc)
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
                                          group_size=size, pc=self.pc)
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
                placement: Placement | None = None, pc: int | None = None):
    """A caching callable ``(op, group, group_size, nbytes) -> CollectiveCost``
    (``placement``: how ranks sit on nodes, for NCCL machines; default row-major; ``pc``:
    the columns of a rectangular ``[q, pc, d]`` grid, q unless given)."""
    return _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p, reduce_impl,
                   placement, pc=pc or None)


def _resolve_p(machine, p, q, d, ranks_per_node, pc=None):
    if p is None and q is not None:
        p = d * q * (pc or q)
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
    :class:`~summasim.costmodel.workload.traffic.MessageClass` plus whether the rank waited for
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
    nbytes, count, blocking], ...]``, as :func:`summasim.costmodel.tools.accuracy.event_summary`
    writes it; five fields in measurements from before the ``blocking`` flag: all
    polled)."""
    return [Messages(e[0], e[1], int(e[2]), int(e[3]), int(e[4]),
                     bool(e[5]) if len(e) > 5 else False) for e in rank_events]
