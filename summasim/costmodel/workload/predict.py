"""Predictions of a trace, of its shared-core features, and of one algorithm call.

:func:`predict_trace` prices the events of a :class:`~summasim.trace.Trace` (or the
closed-form events of :mod:`~summasim.costmodel.workload.traffic`) with the pricer of
:mod:`~summasim.costmodel.workload.pricer`; :func:`trace_features` and
:func:`predict_features` are the shared-core model's view of the same events;
:func:`predict_algorithm` is one call of a summasim algorithm in closed form.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

from .._checks import finite_size, whole
from . import traffic as _traffic
from ..compute.gemm import gemms_seconds as _compute_seconds
from ..collectives import Thresholds
from ..machine import Machine, itemsize_of
from ..machine.topology import Placement
from .pricer import (_UNIT_SHARED, ADD_OUT_STREAMS, ADD_STREAMS, Prediction, _count, _finish,
                     _Pricer, _resolve_p, _Tally, shared_core_time)


def predict_trace(events: Iterable, machine: Machine, *, p: int | None = None,
                  q: int | None = None, d: int = 1, ranks_per_node: int | None = None,
                  gemms: Iterable = (), dtype="float64", reduce_bytes: float = 0.0,
                  compute_seconds: float | None = None, mode: str = "mpich",
                  algorithms: Mapping[str, str] | None = None,
                  thresholds: Thresholds | None = None,
                  itemsize: int | None = None, reduce_impl: str | None = None,
                  elementwise_items: float = 0.0, layers: float = 0.0,
                  placement: Placement | None = None,
                  working_set: float | None = None, pc: int | None = None) -> Prediction:
    """Predicted time of one rank's recorded events plus its compute.

    Parameters
    ----------
    events : iterable of Event, or a Trace
        Anything with ``op``, ``group``, ``group_size``, ``nbytes`` (``phase`` and
        ``count`` optional), e.g. ``grid.trace.events`` or
        :class:`~summasim.costmodel.workload.traffic.MessageClass` entries.
    machine : Machine
    p : int, optional
        Total ranks (for the shared cores); or give ``q`` and ``d``.
    q, d : int, optional
        Grid shape, for placing "row"/"col"/"depth" groups on nodes.
    ranks_per_node : int, optional
        Overrides ``machine.ranks_per_node(p)``.
    pc : int, optional
        Columns of a rectangular ``[q, pc, d]`` grid (q unless given).
    gemms : iterable of (m, k, n, count)
        Local GEMM shapes (e.g. :func:`~summasim.costmodel.workload.traffic.algorithm_compute`).
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
        ``gamma_elementwise``; see :func:`~summasim.costmodel.workload.step.step_work`).
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
    p, rpn = _resolve_p(machine, p, q, d, ranks_per_node, pc)
    itemsize = itemsize if itemsize is not None else itemsize_of(dtype)
    pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q or 1, d, p, reduce_impl,
                     placement, pc=pc or None)
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
                   working_set: float | None = None, pc: int | None = None) -> SharedFeatures:
    """:class:`SharedFeatures` of one rank's events and compute (arguments as in
    :func:`predict_trace`); what
    :func:`~summasim.costmodel.machine.regression.fit_shared_core` fits.
    ``reduce_streams``: memory streams per byte of ``reduce_bytes`` (:data:`ADD_STREAMS`
    in place, :data:`ADD_OUT_STREAMS` into a separate output); ``working_set`` as in
    :func:`predict_trace`."""
    events = getattr(events, "events", events)
    p, _ = _resolve_p(machine, p, q, d, None, pc)
    itemsize = itemsize if itemsize is not None else itemsize_of(dtype)
    probe = machine if machine.shared_core is not None else machine.replace(
        shared_core=_UNIT_SHARED)
    pricer = _Pricer(probe, "mpich", None, None, itemsize, q or 1, d, p, reduce_impl, pc=pc)
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
    This is what :func:`~summasim.costmodel.machine.regression.fit_shared_core` fits. Either is
    raised
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


def _worst_coords(name, q, d, m, k, n, count, p, pc=None):
    """Coordinates of a rank on the critical path (most traffic)."""
    if _traffic.is_general(name, m, k, n, q, d, pc):
        # balanced blocks: the first rank of each layer holds the largest ones; Cannon's
        # skewed ranks shift twice more
        cols = pc or q
        return [(0, 0, kk) for kk in range(d)] + [(1 % q, 1 % cols, 0)]
    if name == "cannon_ab":
        return [(1 % q, 1 % q)]
    if (name == "summa25_atb" or name == "sd25_ab") and d > 1:
        # the ring's chunks (sd25: and the steps) tell the layers apart: a layer's ring
        # sends every chunk but two, the first (items mod d) chunks one item larger, and
        # sd25's first (q mod d) layers take one SUMMA step more; the slowest layer is
        # among those next to where either changes (all d of them when d is small)
        items = (m // q) * (n // q) if m is not None and n is not None else 0
        marks = {0, 1, d - 2, d - 1, items % d - 2, items % d - 1, items % d,
                 q % d - 1, q % d}
        layers = range(d) if d <= 16 else sorted(k for k in marks if 0 <= k < d)
        return [(0, 0, kk) for kk in layers]
    if name.startswith("mm3d") and q > 1:
        return [(0, 0, kk) for kk in range(q)]
    if name in _traffic.RING_NAMES:
        n_items = count if count is not None else m
        extra = int(n_items) % p if p else 0
        return sorted({r % p for r in (0, 1, extra - 2, extra - 1, extra, p - 2, p - 1)})
    return [None]


def price_messages(messages, machine: Machine, *, mode: str = "mpich",
                   algorithms: Mapping[str, str] | None = None,
                   thresholds: Thresholds | None = None, itemsize: int = 8,
                   q: int = 1, d: int = 1, p: int | None = None, pricer=None,
                   reduce_impl: str | None = None, placement: Placement | None = None,
                   pc: int | None = None):
    """``(seconds, by_op, algorithms)`` of
    :class:`~summasim.costmodel.workload.traffic.MessageClass`
    entries (no slowdown). ``pricer`` (from :func:`make_pricer`) reuses a cache; ``pc``
    the columns of a rectangular ``[q, pc, d]`` grid."""
    if pricer is None:
        pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q, d, p, reduce_impl,
                         placement, pc=pc or None)
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
                      placement: Placement | None = None,
                      pc: int | None = None) -> Prediction:
    """Closed-form predicted time of one call of algorithm ``name`` on one rank.

    Parameters
    ----------
    name : str
        A name in :data:`summasim.costmodel.workload.traffic.ALGORITHM_NAMES`.
    m, k, n : int
        Global dimensions (see :mod:`~summasim.costmodel.workload.traffic`).
    q, d : int
        Grid ``[q, q, d]``.
    machine : Machine
    pc : int, keyword-only, optional
        Columns of a rectangular ``[q, pc, d]`` grid (SUMMA and SUMMA2.5). With it, or
        with sizes that do not divide, the balanced blocks are priced.
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
    for nm, v in (("m", m), ("k", k), ("n", n), ("count", count)):
        if v is not None:
            finite_size(f"{name}: {nm}", v)
    q, d = whole(f"{name}: q", q), whole(f"{name}: d", d)
    if pc is not None:
        pc = whole(f"{name}: pc", pc)
    if name in _traffic.RING_NAMES:
        p = whole(f"{name}: p (the ring's ranks)", p)
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
        ranks = d * q * (pc or q)
        q_, d_ = q, d
    rpn = ranks_per_node if ranks_per_node is not None else machine.ranks_per_node(ranks)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    cands = _worst_coords(name, q, d, m, k, n, count, p, pc) if coords == "worst" \
        else [coords]
    general = name not in _traffic.RING_NAMES and _traffic.is_general(name, m, k, n, q, d, pc)
    pricer = _Pricer(machine, mode, algorithms, thresholds, itemsize, q_, d_, ranks, reduce_impl,
                     placement, pc=pc if name not in _traffic.RING_NAMES else None)
    best = None
    for c in cands:
        msgs = _traffic.algorithm_messages(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                           group=group, strict=strict, pc=pc)
        tally = _Tally(pricer)
        for mc in msgs:
            tally.add(mc.op, mc.group, mc.group_size, mc.nbytes, mc.count)
        work = _traffic.algorithm_compute(name, m, k, n, q, d, itemsize, c, count=count, p=p,
                                          group=group, strict=strict, pc=pc)
        compute = _compute_seconds(machine, work.gemms, dtype, work.reduce_bytes)
        dedicated = None
        if overlap and not (machine.shared_comm and slow > 1) and name in _traffic.MATMUL_NAMES \
                and ranks > d:
            # the steps: q, or one per piece of the stepped dimension (balanced blocks)
            steps = sum(g[3] for g in work.gemms) if general else q
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
