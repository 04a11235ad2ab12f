"""NCCL's collectives: ring and tree, three protocols, and the choice NCCL makes.

NCCL (the collective library of GPU clusters) runs every collective as a pipeline
of chunks over rings (and, for all-reduce, also over trees), with one of three
protocols, and picks the (algorithm, protocol) pair its own cost model predicts to
be fastest for the message size. This module is that cost model, with the
bandwidths taken from the machine's topology (:mod:`~summasim.costmodel.machine.topology`)
instead of NCCL's probed graph.

Time of one call (NCCL's ``ncclTopoGetAlgoTime``)::

    T = latency(algorithm, protocol, ranks, nodes) + nbytes_total / algBw

``nbytes_total`` is NCCL's byte count: the buffer for broadcast, reduce and
all-reduce, and the gathered total (``p`` x the per-rank part) for all-gather and
reduce-scatter. ``algBw`` follows from the bus bandwidth ``busBw`` (bytes/s per rank
on the slowest link, :attr:`~summasim.costmodel.machine.topology.GroupPath.bus_bandwidth`):

=====================  ====================  =====================================
collective             ring ``algBw``        closed form (large messages)
=====================  ====================  =====================================
all-reduce             busBw p / (2(p-1))    2 (p-1)/p  B / busBw
all-gather             busBw p / (p-1)       (p-1)/p  (p B_rank) / busBw
reduce-scatter         busBw p / (p-1)       (p-1)/p  B / busBw
broadcast, reduce      busBw                 B / busBw  (pipelined chain)
all-reduce, tree       busBw_tree / 2        2 B / busBw_tree
=====================  ====================  =====================================

These are exactly the inverses of NCCL-tests' bus-bandwidth factors
(``doc/PERFORMANCE.md``: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter
``(n-1)/n``, broadcast and reduce 1): :func:`bus_factor` gives them, and a ring
collective's predicted busBw tends to the link's busBw for large messages.

Protocols (per the NCCL 2.8 tuning model, ``src/graph/tuning.cc``)
-------------------------------------------------------------------
``Simple``  full bandwidth, highest latency (chunks of 512 KiB; flags per chunk)
``LL128``   120 of every 128 bytes carry data: busBw x 0.92 (x 0.7 with one rank
            per node); enabled by default only on NVLink systems of compute
            capability 7.0/8.0 (:attr:`Topology.ll128`)
``LL``      8-byte stores with an inline flag: ring busBw x 1/4 (x 1/3 for
            one-node all-gather/reduce-scatter/broadcast), tree x 1/3.8; lowest
            latency
Tree (all-reduce only): busBw x 0.9 capped at 110 GB/s (<= 2 nodes) or 80 GB/s
(more; 130 / 105 for LL128), LL128 x 7/9 on one node (0.915 across), and NCCL's
per-size correction factors for trees below 128 MiB.

Latencies (microseconds): a base per algorithm and protocol (ring LL 3.6, LL128
10.0, Simple 8.4; tree LL and LL128 4.4) plus a per-hop latency of the hardware
(NVLink, PCI, network: e.g. ring Simple 3.4 / 5.7 / 9.6 us) times the steps:
ring all-reduce ``2(p-1)`` steps, all-gather and reduce-scatter ``p-1``, broadcast
and reduce ``p`` (inter-node steps priced as network hops, LL's intra-node hop x 1.8
across nodes); tree ``2((p/nodes - 1) intra + log2(nodes) inter)``. A multi-node
Simple ring all-reduce of at least ``p/16 x 64 KiB`` pays its latency x 1.9 (NCCL's
"plateau effect"). These constants are NCCL's published tuning tables; they are
the model NCCL uses to choose, which is what this module must reproduce.

Point-to-point (``sendrecv``) is one Simple message over the pair's path; a
``barrier`` is priced as a 4-byte all-reduce.

References
----------
NVIDIA NCCL, ``src/graph/tuning.cc`` (tuning model: baseLat, hwLat, protocol
factors, tree caps and correction factors; NCCL 2.8-2.10), ``src/enqueue.cc``
(algorithm/protocol chosen as the minimum predicted time).
NVIDIA nccl-tests, ``doc/PERFORMANCE.md`` (algorithm and bus bandwidth).
S. Jeaugey, "Massively scale your deep learning training with NCCL 2.4", NVIDIA
developer blog, 2019 (double binary trees); NCCL GitHub issue discussions of the
~20% protocol overhead on NVLink (nccl-tests issue #212).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._checks import finite_size
from ..machine.topology import GroupPath

ALGORITHMS = ("ring", "tree")
PROTOCOLS = ("LL", "LL128", "Simple")
OPS = ("bcast", "reduce", "allreduce", "allgather", "reduce_scatter", "sendrecv", "barrier")

#: Base latency (us) per algorithm and protocol (NCCL 2.8 tuning.cc ``baseLat``).
BASE_LAT = {"tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0},
            "ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}}
#: Per-hop latency (us) by hardware (NCCL 2.8 tuning.cc ``hwLat``).
HW_LAT = {"nvlink": {"tree": {"LL": 0.52, "LL128": 1.2, "Simple": 28.0},
                     "ring": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4}},
          "pci": {"tree": {"LL": 1.0, "LL128": 1.9, "Simple": 28.0},
                  "ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7}},
          "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0},
                  "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}}}
#: NCCL 2.8 tuning.cc ``treeCorrectionFactor``: tree bandwidth multipliers for
#: message sizes 64 B * 2^i (i = 0..21), per protocol.
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8,
              .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7,
               .8, .9),
}
GB = 1e9


class NcclCost(NamedTuple):
    """Predicted seconds of one NCCL call and the (algorithm, protocol) chosen."""

    seconds: float
    algorithm: str
    protocol: str

    @property
    def name(self) -> str:
        return f"nccl_{self.algorithm}_{self.protocol}"


def bus_factor(op: str, p: int) -> float:
    """NCCL-tests' factor from algorithm to bus bandwidth, ``busBw = algBw x factor``:
    all-reduce ``2(p-1)/p``, all-gather and reduce-scatter ``(p-1)/p``, broadcast,
    reduce and point-to-point 1 (nccl-tests ``doc/PERFORMANCE.md``)."""
    if op == "allreduce":
        return 2.0 * (p - 1) / p
    if op in ("allgather", "reduce_scatter"):
        return (p - 1) / p
    return 1.0


def total_bytes(op: str, nbytes: float, p: int) -> float:
    """NCCL's byte count of a call whose trace ``nbytes`` is given: the gathered
    total for all-gather (``p`` x the per-rank part), else ``nbytes``."""
    return nbytes * p if op == "allgather" else float(nbytes)


def _hw(path: GroupPath) -> str:
    if path.nodes > 1:
        return "net"
    return "nvlink" if path.intra_kind in ("nvswitch", "nvlink") else "pci"


def _intra_hw(path: GroupPath) -> str:
    return "nvlink" if path.intra_kind in ("nvswitch", "nvlink") else "pci"


def _steps(op: str, p: int) -> int:
    if op == "allreduce":
        return 2 * (p - 1)
    if op in ("allgather", "reduce_scatter"):
        return p - 1
    return p


def _bus_bw(op: str, algorithm: str, protocol: str, path: GroupPath, ll128: bool) -> float:
    """Bus bandwidth (bytes/s) of one (algorithm, protocol) on ``path``; 0: disabled."""
    bw = path.bus_bandwidth
    nodes = path.nodes
    ppn = path.size / max(1, nodes)
    if protocol == "LL128" and not ll128:
        return 0.0
    if algorithm == "ring":
        if protocol == "LL":
            return bw * (0.25 if (nodes > 1 or op in ("allreduce", "reduce")) else 1.0 / 3.0)
        if protocol == "LL128":
            return bw * (0.7 if ppn < 2 else 0.92)
        return bw
    # tree: all-reduce only
    if op != "allreduce":
        return 0.0
    cap = (105.0 if protocol == "LL128" else 80.0) if nodes > 2 else (
        130.0 if protocol == "LL128" else 110.0)
    bw = min(bw * 0.9, cap * GB)
    if protocol == "LL":
        return bw / 3.8
    if protocol == "LL128":
        return bw * (7.0 / 9.0 if nodes == 1 else 0.915)
    return bw


def _latency(op: str, algorithm: str, protocol: str, path: GroupPath, nbytes: float) -> float:
    """Latency (seconds) of one (algorithm, protocol) on ``path``."""
    p, nodes = path.size, path.nodes
    base = BASE_LAT[algorithm][protocol]
    intra = HW_LAT[_intra_hw(path)][algorithm][protocol]
    inter = HW_LAT["net"][algorithm][protocol]
    if nodes > 1 and protocol == "LL":
        intra *= 1.8
    if algorithm == "ring":
        steps = _steps(op, p)
        if op in ("bcast", "reduce"):
            lat = base + steps * HW_LAT[_hw(path)][algorithm][protocol]
        else:
            inter_steps = _steps(op, nodes) if nodes > 1 else 0
            lat = base + (steps - inter_steps) * intra + inter_steps * inter
        if protocol == "Simple" and nodes > 1 and op == "allreduce" \
                and nbytes >= p / 16.0 * 65536:
            lat *= 1.9                       # NCCL's "plateau effect of ring"
    else:
        ppn = p // max(1, nodes)
        lat = base + 2 * ((ppn - 1) * intra + math.log2(nodes) * inter) if nodes > 1 \
            else base + 2 * (ppn - 1) * intra
    return lat * 1e-6


def _tree_correction(protocol: str, nbytes: float) -> float:
    log_size = int(math.log2(max(1.0, nbytes / 64.0))) if nbytes >= 64 else 0
    if log_size < 22:
        return TREE_CORRECTION[protocol][max(0, log_size)]
    return 1.0


def candidate_time(op: str, nbytes: float, path: GroupPath, algorithm: str, protocol: str, *,
                   ll128: bool = True) -> float:
    """Seconds of ``op`` (trace ``nbytes``) with one (algorithm, protocol); inf when
    NCCL would not run that pair."""
    p = path.size
    total = total_bytes(op, nbytes, p)
    bus = _bus_bw(op, algorithm, protocol, path, ll128)
    if bus <= 0:
        return math.inf
    if algorithm == "ring":
        alg_bw = bus * p / _steps(op, p) if op in ("allreduce", "allgather",
                                                   "reduce_scatter") else bus
    else:
        alg_bw = bus * 0.5 * _tree_correction(protocol, total)
    return _latency(op, algorithm, protocol, path, total) + total / alg_bw


def nccl_time(op: str, nbytes: float, path: GroupPath, *, ll128: bool = True,
              algorithm: str | None = None, protocol: str | None = None) -> NcclCost:
    """Seconds of one NCCL ``op`` of ``nbytes`` (as a trace records it) over ``path``.

    Parameters
    ----------
    op : str
        One of :data:`OPS`.
    nbytes : float
        Trace bytes (per-rank contribution for all-gather; see
        :mod:`~summasim.costmodel.collectives`).
    path : GroupPath
        The group's links (from :func:`~summasim.costmodel.machine.topology.group_path`).
    ll128 : bool
        Whether the LL128 protocol is enabled on this machine.
    algorithm, protocol : str, optional
        Force one (``NCCL_ALGO`` / ``NCCL_PROTO``); default: NCCL's choice, the
        pair with the least predicted time.

    Returns
    -------
    NcclCost
        ``(seconds, algorithm, protocol)``; ``(0, "none", "none")`` for one rank.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    nbytes = finite_size(f"{op}: nbytes", nbytes)
    if path.size <= 1:
        return NcclCost(0.0, "none", "none")
    if op == "barrier":
        return nccl_time("allreduce", 4, path, ll128=ll128)
    if op == "sendrecv":
        hw = _hw(path)
        lat = (BASE_LAT["ring"]["Simple"] + HW_LAT[hw]["ring"]["Simple"]) * 1e-6
        return NcclCost(lat + nbytes / path.bus_bandwidth, "p2p", "Simple")
    algs = [algorithm] if algorithm else list(ALGORITHMS)
    protos = [protocol] if protocol else list(PROTOCOLS)
    for a in algs:
        if a not in ALGORITHMS:
            raise ValueError(f"unknown NCCL algorithm {a!r}; known: {', '.join(ALGORITHMS)}")
    for pr in protos:
        if pr not in PROTOCOLS:
            raise ValueError(f"unknown NCCL protocol {pr!r}; known: {', '.join(PROTOCOLS)}")
    best = None
    for a in algs:
        for pr in protos:
            t = candidate_time(op, nbytes, path, a, pr, ll128=ll128)
            if best is None or t < best.seconds:
                best = NcclCost(t, a, pr)
    if best is None or not math.isfinite(best.seconds):
        raise ValueError(f"no NCCL algorithm/protocol runs {op} with "
                         f"algorithm={algorithm!r}, protocol={protocol!r}")
    return best


def predicted_bus_bandwidth(op: str, nbytes: float, path: GroupPath, **kw) -> float:
    """What NCCL-tests would print as busBw (bytes/s) for ``op`` of ``nbytes`` (NCCL's
    count: for all-gather the per-rank part, as in the trace convention)."""
    cost = nccl_time(op, nbytes, path, **kw)
    total = total_bytes(op, nbytes, path.size)
    return total / cost.seconds * bus_factor(op, path.size)
