"""Node topology and rank placement: which links a communicator crosses, and how fast.

A machine is ``nodes x devices_per_node`` devices (GPUs, or CPU cores of one box).
Inside a node the devices talk over one kind of link (``intra_kind``):

=============  ===================================================================
``nvswitch``   every device has its own NVLink bandwidth to a non-blocking switch
               (DGX A100, DGX H100, DGX-2): concurrent groups do not share it
``nvlink``     the same figures, point-to-point NVLink (no contention modelled)
``pcie``       every device has a PCIe link; with ``sockets > 1`` a flow between
               devices of different CPU sockets goes through host memory and the
               socket interconnect (``socket_bandwidth`` per direction, shared by
               every flow that crosses it)
``shm``        shared memory of one CPU box (this project's VM): MPI copies
=============  ===================================================================

Between nodes, each node has ``nics_per_node`` NICs of ``nic_bandwidth`` bytes/s
per direction that ALL its devices share. Bandwidths are datasheet line rates;
``*_efficiency`` is the fraction a collective library achieves (from published
microbenchmarks such as NCCL-tests bus bandwidth), and the ``effective`` rates
below are their product.

The fabric above the NICs
-------------------------
By default the NICs reach one non-blocking network. Two mechanisms bound it:

* **Leaf domains and oversubscription** (``nodes_per_leaf``, ``oversubscription``).
  A fat tree (Leiserson 1985) is non-blocking when every switch has as much uplink
  as downlink capacity; an *oversubscribed* one gives each leaf switch ``R`` times
  less uplink than downlink (``R:1``). Nodes ``n`` with the same ``n //
  nodes_per_leaf`` form a leaf domain: their traffic among themselves stays under
  the leaf, traffic that leaves it shares the leaf's uplinks, ``U = (nodes of the
  domain) * nics_per_node * nic_effective / oversubscription`` bytes/s per
  direction. On a rail-optimized fabric (NVIDIA DGX SuperPOD) the domain is the
  scalable unit of 32 nodes: rail switch ``i`` connects NIC ``i`` of every node of
  the unit, and NCCL's PXN moves data over NVLink to the GPU on the right rail, so
  the unit behaves as one leaf of the whole unit's NICs; on a classic fabric it is
  the nodes of one leaf switch (a rack).
* **GPUDirect RDMA** (``gpudirect``, ``host_bandwidth``). With it the NIC reads and
  writes GPU memory directly; without it (NCCL's ``NCCL_NET_GDR_LEVEL`` forbidding
  it, or a system that lacks it) every byte a NIC moves is staged through host
  memory, written there by the GPU's DMA engine and read from it by the NIC, so a
  node's NIC traffic per direction is at most ``host_bandwidth / 2``, shared by all
  its NIC users.

Placement
---------
A :class:`Placement` maps the ranks of a grid to device slots (slot ``s`` is on node
``s // devices_per_node``, local index ``s % devices_per_node``):

``row-major``   slot = rank, with summasim's Cartesian rank order
                ``rank = (k pr + i) pc + j`` (what :mod:`summasim.grid` builds; pr =
                pc = q on a square grid)
``blocked``     each node holds an ``a x b`` tile of a ``pr x pc`` layer (``a b =
                devices_per_node``, a | pr, b | pc, as square as possible), so most
                row and column groups stay inside a node; when a whole layer fits
                in a node (``pr pc | devices_per_node``) several layers share one
``explicit``    a list of slots, one per rank

Groups and their path
---------------------
A grid's named groups are its communicators (:mod:`summasim.grid`): ``row`` (fixed
k, i), ``col`` (fixed k, j), ``depth`` (fixed i, j), ``layer`` (fixed k) and
``world``. All groups of one kind run concurrently (every row broadcasts at the
same time in SUMMA), so :func:`group_path` looks at all of them together and
returns the worst group's :class:`GroupPath`:

* intra-node bound: the device link (``intra_effective``); a ``pcie`` group whose
  members on a node sit on both sockets crosses the socket link once per direction
  (a ring), and the concurrent groups that cross it share ``socket_effective``;
* inter-node bound: on each node the NICs (``nics_per_node * nic_effective``) are
  shared by every device of the concurrent node-spanning groups on that node, each
  device using at most its local NIC share (``nic_effective * max(1, nics //
  devices_per_node)``); a group's ring must push its whole bus bandwidth through
  the NIC share of its devices on the node;
  without GPUDirect RDMA the node's NICs move at most ``min(nics_per_node *
  nic_effective, host_bandwidth / 2)`` (bottleneck ``"host"`` when the host binds);
* spine bound (``nodes_per_leaf > 0``): a group whose nodes lie in more than one
  leaf domain is a ring that leaves and enters each domain it touches once per
  direction, carrying its bus bandwidth over the domain's uplinks; the concurrent
  groups that touch a domain and leave it share its ``U`` equally (bottleneck
  ``"spine"``);
* the group's bus bandwidth is the smallest of these (bytes/s per rank, as
  NCCL-tests define bus bandwidth).

References
----------
NVIDIA DGX A100 / DGX H100 / DGX-2 system datasheets and user guides; NCCL-tests
``doc/PERFORMANCE.md`` (bus bandwidth); TACC Frontera user guide (GPU nodes).
C. E. Leiserson, "Fat-trees: universal networks for hardware-efficient
supercomputing", IEEE Trans. Computers C-34(10), 1985 (fat trees; a level with less
uplink than downlink capacity is oversubscribed). NVIDIA DGX SuperPOD reference
architecture (DGX A100 / H100): rail-optimized compute fabric, scalable units of 32
nodes. NVIDIA GPUDirect RDMA documentation (docs.nvidia.com/cuda/gpudirect-rdma) and
NCCL environment variables ``NCCL_NET_GDR_LEVEL`` / ``NCCL_NET_GDR_READ`` (without
GPUDirect RDMA, NCCL stages network traffic through host memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ...spec import GRID_GROUPS, grid_coords, grid_groups
from .._fields import nested_from_dict

INTRA_KINDS = ("shm", "nvswitch", "nvlink", "pcie")
PLACEMENTS = ("row-major", "blocked", "explicit")
GROUP_KINDS = ("row", "col", "depth", "layer", "world")


def _num(path: str, value, *, positive: bool = False, integer: bool = False,
         at_most: float | None = None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"machine field {path!r} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"machine field {path!r} must be {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    if at_most is not None and value > at_most:
        raise ValueError(f"machine field {path!r} must be <= {at_most:g}, got {value!r}")
    if integer:
        if int(value) != value:
            raise ValueError(f"machine field {path!r} must be an integer, got {value!r}")
        return int(value)
    return value


def _sources(d, path: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in d.items()):
        raise ValueError(f"machine field {path!r} must be an object of strings "
                         f"{{field: source}}")
    return dict(d)


@dataclass(frozen=True)
class Topology:
    """Nodes, devices per node, intra-node links and NICs (bytes/s per direction, s).

    Parameters
    ----------
    devices_per_node : int
        Devices (ranks) per node.
    intra_kind : str
        One of :data:`INTRA_KINDS`.
    intra_bandwidth : float
        Line rate of one device's intra-node link, bytes/s per direction.
    intra_latency : float
        Latency of one intra-node hop, seconds.
    intra_efficiency : float
        Fraction of the line rate a collective library reaches (0 < e <= 1).
    sockets : int
        CPU sockets per node; PCIe devices are split evenly over them.
    socket_bandwidth : float
        Bytes/s per direction between sockets through host memory (``pcie`` only).
    socket_efficiency : float
        Achievable fraction of ``socket_bandwidth``.
    nics_per_node, nic_bandwidth, nic_latency, nic_efficiency
        Inter-node NICs: count, line rate (bytes/s per direction each), latency
        (s) and achievable fraction.
    nodes : int or None
        Nodes in the machine (None: as many as a run needs).
    ll128 : bool
        Whether NCCL enables its LL128 protocol here (NCCL 2.8 enables it by default
        only on NVLink systems of compute capability 7.0 and 8.0).
    nodes_per_leaf : int
        Nodes per leaf domain, whose traffic among themselves stays under one leaf
        (a rail-optimized scalable unit, e.g. 32 DGX nodes; or one leaf switch's
        nodes); 0: the whole machine is one non-blocking fabric.
    oversubscription : float
        A leaf's downlink : uplink capacity ratio (>= 1; 2 is 2:1); the uplinks of a
        domain carry ``nodes * nics_per_node * nic_effective / oversubscription``
        bytes/s per direction.
    gpudirect : bool
        Whether the NICs read and write GPU memory directly (GPUDirect RDMA); False:
        NIC traffic is staged through host memory.
    host_bandwidth : float
        Host-memory bytes/s available to staging one direction of a node's NIC
        traffic; each staged byte is written and read once, so the node's NICs move
        at most ``host_bandwidth / 2`` per direction (needed when ``gpudirect`` is
        False).
    sources : dict
        ``{field: public source}`` for every number above.
    """

    devices_per_node: int
    intra_kind: str
    intra_bandwidth: float
    intra_latency: float = 0.0
    intra_efficiency: float = 1.0
    sockets: int = 1
    socket_bandwidth: float = 0.0
    socket_efficiency: float = 1.0
    nics_per_node: int = 0
    nic_bandwidth: float = 0.0
    nic_latency: float = 0.0
    nic_efficiency: float = 1.0
    nodes: int | None = None
    ll128: bool = True
    nodes_per_leaf: int = 0
    oversubscription: float = 1.0
    gpudirect: bool = True
    host_bandwidth: float = 0.0
    sources: dict = field(default_factory=dict)

    _NUMBERS = ("intra_bandwidth", "intra_latency", "intra_efficiency", "socket_bandwidth",
                "socket_efficiency", "nic_bandwidth", "nic_latency", "nic_efficiency")
    #: The fabric's fields and their defaults (a non-blocking fabric with GPUDirect
    #: RDMA): :meth:`to_dict` writes them only when set, so older files read the same.
    _FABRIC = {"nodes_per_leaf": 0, "oversubscription": 1.0, "gpudirect": True,
               "host_bandwidth": 0.0}
    _FIELDS = ("devices_per_node", "intra_kind") + _NUMBERS + (
        "sockets", "nics_per_node", "nodes", "ll128") + tuple(_FABRIC) + ("sources",)

    def __post_init__(self):
        p = "topology."
        _num(p + "devices_per_node", self.devices_per_node, positive=True, integer=True)
        if self.intra_kind not in INTRA_KINDS:
            raise ValueError(f"machine field 'topology.intra_kind' must be one of "
                             f"{', '.join(INTRA_KINDS)}, got {self.intra_kind!r}")
        for f in self._NUMBERS:
            eff = f.endswith("efficiency")
            _num(p + f, getattr(self, f), positive=eff or f == "intra_bandwidth",
                 at_most=1.0 if eff else None)
        _num(p + "sockets", self.sockets, positive=True, integer=True)
        _num(p + "nics_per_node", self.nics_per_node, integer=True)
        if self.nodes is not None:
            _num(p + "nodes", self.nodes, positive=True, integer=True)
        if self.intra_kind == "pcie" and self.devices_per_node % self.sockets:
            raise ValueError(f"topology: {self.devices_per_node} PCIe devices per node do not "
                             f"split evenly over {self.sockets} sockets")
        if self.intra_kind == "pcie" and self.sockets > 1 and self.socket_bandwidth <= 0:
            raise ValueError("topology: a PCIe node with several sockets needs "
                             "socket_bandwidth > 0 (flows between sockets cross it)")
        if self.nics_per_node and self.nic_bandwidth <= 0:
            raise ValueError("topology: nics_per_node > 0 needs nic_bandwidth > 0")
        if self.nodes is not None and self.nodes > 1 and not self.nics_per_node:
            raise ValueError(f"topology: {self.nodes} nodes need nics_per_node > 0 (and "
                             f"nic_bandwidth): a group that spans nodes crosses their NICs")
        if not isinstance(self.ll128, bool):
            raise ValueError("machine field 'topology.ll128' must be true or false")
        self._check_fabric()
        object.__setattr__(self, "sources", _sources(self.sources, p + "sources"))

    def _check_fabric(self) -> None:
        """Validate the fabric's fields (module docstring, "The fabric above the
        NICs"); ValueError naming ``topology.<field>``."""
        p = "topology."
        object.__setattr__(self, "nodes_per_leaf",
                           _num(p + "nodes_per_leaf", self.nodes_per_leaf, integer=True))
        _num(p + "oversubscription", self.oversubscription)
        if self.oversubscription < 1:
            raise ValueError(f"machine field 'topology.oversubscription' must be >= 1 "
                             f"(downlink : uplink, 2 for 2:1), got {self.oversubscription!r}")
        _num(p + "host_bandwidth", self.host_bandwidth)
        if not isinstance(self.gpudirect, bool):
            raise ValueError("machine field 'topology.gpudirect' must be true or false")
        if not self.gpudirect and self.host_bandwidth <= 0:
            raise ValueError("machine field 'topology.host_bandwidth' must be > 0 when "
                             "topology.gpudirect is false (NIC traffic is staged through "
                             "host memory)")

    # -- derived rates ------------------------------------------------------------------
    @property
    def intra_effective(self) -> float:
        """Achievable bytes/s per direction of one device's intra-node link."""
        return self.intra_bandwidth * self.intra_efficiency

    @property
    def socket_effective(self) -> float:
        return self.socket_bandwidth * self.socket_efficiency

    @property
    def nic_effective(self) -> float:
        """Achievable bytes/s per direction of one NIC."""
        return self.nic_bandwidth * self.nic_efficiency

    def socket_of(self, local: int) -> int:
        """CPU socket of local device ``local`` (devices split evenly, in order)."""
        return local // (self.devices_per_node // self.sockets)

    def node_of(self, slot: int) -> int:
        return slot // self.devices_per_node

    @property
    def node_nic_effective(self) -> float:
        """Achievable NIC bytes/s per direction of one node: its NICs, and without
        GPUDirect RDMA at most ``host_bandwidth / 2`` (each byte staged through host
        memory is written and read there once)."""
        nics = self.nics_per_node * self.nic_effective
        return nics if self.gpudirect else min(nics, self.host_bandwidth / 2)

    def domain_of(self, node: int) -> int:
        """Leaf domain of ``node`` (``node // nodes_per_leaf``; 0 when the fabric is
        one non-blocking domain)."""
        return node // self.nodes_per_leaf if self.nodes_per_leaf > 0 else 0

    def uplink_effective(self, domain: int) -> float:
        """``U``: achievable bytes/s per direction out of leaf domain ``domain``, its
        nodes' NIC line capacity over the oversubscription (the last domain of a
        machine of ``nodes`` may hold fewer nodes)."""
        n = self.nodes_per_leaf
        if self.nodes is not None:
            n = max(1, min(n, self.nodes - domain * n))
        return n * self.nics_per_node * self.nic_effective / self.oversubscription

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-ready dict; the fabric's fields only when not their default."""
        return {f: getattr(self, f) for f in self._FIELDS
                if f not in self._FABRIC or getattr(self, f) != self._FABRIC[f]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Topology":
        return nested_from_dict(cls, d, "topology",
                                ("devices_per_node", "intra_kind", "intra_bandwidth"))


# --------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class GridShape:
    """The ranks being placed: a 1D group of p (Megatron) or a [q, q, d] grid
    (``[q, pc, d]`` when ``pc`` is set: q rows by pc columns)."""

    p: int
    q: int = 1
    d: int = 1
    one_d: bool = False
    pc: int = 0

    @classmethod
    def of(cls, p: int | None = None, q: int = 1, d: int = 1, pc: int = 0) -> "GridShape":
        """A [q, q, d] grid ([q, pc, d]) when it has more than one rank per layer
        (p = d q pc), else a 1D group of p ranks."""
        cols = pc or q
        if q * cols > 1:
            return cls(d * q * cols, q, d, False, 0 if cols == q else cols)
        return cls(int(p if p is not None else d), 1, 1, True)

    def coords(self, rank: int) -> tuple:
        """(i, j, k) of ``rank`` in summasim's Cartesian order ``(k q + i) pc + j``
        (:func:`summasim.spec.grid_coords`)."""
        return grid_coords(rank, self.q, self.pc or None)

    def groups(self, kind: str, size: int | None = None) -> list[list[int]]:
        """Every group of ``kind`` as lists of ranks (ordered by the free coordinate:
        :func:`summasim.spec.grid_groups`; "world" is all the ranks).

        1D groups, unknown kinds and groups whose size does not match the grid are
        one group of ``size`` consecutive ranks from 0 (a ring of the first ranks).
        """
        p = self.p
        if self.one_d or kind not in GROUP_KINDS:
            return [list(range(p if size is None else int(size)))]
        out = grid_groups(kind, self.q, self.d, self.pc or None) if kind in GRID_GROUPS \
            else [list(range(p))]
        if size is not None and out and len(out[0]) != size:
            return [list(range(min(int(size), p)))]
        return out


@dataclass(frozen=True)
class Placement:
    """How ranks map to device slots (see the module docstring).

    Parameters
    ----------
    policy : {"row-major", "blocked", "explicit"}
    slots : tuple of int, optional
        ``explicit``: the device slot of each rank (distinct, >= 0).
    tile : (a, b), optional
        ``blocked``: rows x columns of the grid per node (default: chosen).
    """

    policy: str = "row-major"
    slots: tuple | None = None
    tile: tuple | None = None

    def __post_init__(self):
        if self.policy not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.policy!r}; choose "
                             f"{', '.join(PLACEMENTS)} (explicit: map:SLOT,SLOT,...)")
        if self.policy == "explicit":
            if not self.slots:
                raise ValueError("an explicit placement needs one device slot per rank")
            s = tuple(int(x) for x in self.slots)
            if any(x < 0 for x in s) or len(set(s)) != len(s):
                raise ValueError(f"explicit placement: slots must be distinct integers >= 0, "
                                 f"got {list(s)[:16]}")
            object.__setattr__(self, "slots", s)

    @classmethod
    def parse(cls, text: str | None) -> "Placement":
        """``"row-major"``, ``"blocked"``, ``"blocked:AxB"`` or ``"map:0,1,4,5,..."``."""
        text = (text or "row-major").strip()
        if text.startswith("map:"):
            try:
                slots = tuple(int(x) for x in text[4:].split(",") if x.strip())
            except ValueError:
                raise ValueError(f"placement {text!r}: map: takes comma-separated device "
                                 f"slots, e.g. map:0,1,4,5") from None
            return cls("explicit", slots=slots)
        if text.startswith("blocked:"):
            try:
                a, b = (int(x) for x in text[8:].lower().split("x"))
            except ValueError:
                raise ValueError(f"placement {text!r}: blocked:AxB takes a tile such as "
                                 f"blocked:2x2") from None
            if min(a, b) < 1:
                raise ValueError(f"placement {text!r}: a tile is at least 1x1 ranks, "
                                 f"e.g. blocked:2x2")
            return cls("blocked", tile=(a, b))
        return cls(text)

    def describe(self) -> str:
        if self.policy == "explicit":
            return f"explicit map ({len(self.slots)} ranks)"
        if self.policy == "blocked" and self.tile:
            return f"blocked {self.tile[0]}x{self.tile[1]} tiles"
        return self.policy

    def slots_for(self, grid: GridShape, devices_per_node: int) -> list[int]:
        """Device slot of every rank of ``grid``; ValueError when the policy cannot."""
        p = grid.p
        if self.policy == "explicit":
            if len(self.slots) != p:
                raise ValueError(f"explicit placement has {len(self.slots)} slots for "
                                 f"{p} ranks")
            return list(self.slots)
        if self.policy == "row-major" or grid.one_d:
            return list(range(p))
        q, pc, dpn = grid.q, grid.pc or grid.q, devices_per_node
        a, b = self.tile if self.tile else blocked_tile(q, dpn, pc)
        if a * b == dpn and q % a == 0 and pc % b == 0:
            per_row = pc // b
            per_layer = (q // a) * per_row
            out = []
            for r in range(p):
                i, j, k = grid.coords(r)
                node = k * per_layer + (i // a) * per_row + j // b
                out.append(node * dpn + (i % a) * b + j % b)
            return out
        if self.tile is None and dpn % (q * pc) == 0:
            return list(range(p))          # whole layers per node: row-major already is
        raise ValueError(f"blocked placement: no {a}x{b} tile of the {q}x{pc} grid fills a "
                         f"node of {dpn} devices (a b = {dpn}, a | {q}, b | {pc})")


def blocked_tile(q: int, devices_per_node: int, pc: int | None = None) -> tuple[int, int]:
    """The most square ``a x b`` tile with ``a b = devices_per_node``, a | q (rows), b | pc
    (columns, q unless given); ``(0, 0)`` when none exists."""
    pc = pc or q
    best = (0, 0)
    for a in range(1, devices_per_node + 1):
        if devices_per_node % a:
            continue
        b = devices_per_node // a
        if q % a == 0 and pc % b == 0 and (best == (0, 0) or abs(a - b) < abs(best[0] - best[1])):
            best = (a, b)
    return best


# --------------------------------------------------------------------------- paths
@dataclass(frozen=True)
class GroupPath:
    """The links one group (the worst of the concurrent groups of its kind) crosses.

    ``bus_bandwidth`` is bytes/s per rank (NCCL-tests' bus bandwidth of a ring over
    the group), ``nodes`` the nodes it spans, ``per_node`` its ranks on the fullest
    node, ``bottleneck`` the link that bounds it ("intra", "socket", "nic", "host":
    NIC traffic staged through host memory, or "spine": a leaf domain's uplinks).
    """

    size: int
    nodes: int
    per_node: int
    bus_bandwidth: float
    intra_kind: str
    bottleneck: str
    sharing: float = 1.0       # how many flows share the bottleneck link (1 = none)


#: Memo of :func:`group_path` (see :func:`_path_key`); cleared whole when it grows past
#: :data:`PATH_MEMO_SIZE` entries. A path depends only on the numbers of the topology,
#: the grid's shape, the kind, the size, the placement and ``concurrent``.
_PATHS: dict = {}
PATH_MEMO_SIZE = 4096


def _path_key(topology, grid, kind, size, placement, concurrent):
    """The memo key of a :func:`group_path` call, or None when an argument is not one of
    the exact immutable types whose result is a function of their fields (a subclass of
    :class:`GridShape` may define its own groups; ``sources`` is only documentation)."""
    if type(topology) is not Topology or type(grid) is not GridShape \
            or type(placement) is not Placement:
        return None
    key = (tuple(getattr(topology, f) for f in Topology._FIELDS if f != "sources"),
           grid, kind, size, placement, bool(concurrent))
    try:
        hash(key)
    except TypeError:                       # e.g. a tile given as a list
        return None
    return key


def clear_path_memo() -> None:
    """Forget every memoized :func:`group_path` result."""
    _PATHS.clear()


def group_path(topology: Topology, grid: GridShape, kind: str, size: int | None = None,
               placement: Placement | None = None, *, concurrent: bool = True) -> GroupPath:
    """:class:`GroupPath` of the groups of ``kind`` on ``grid`` placed by ``placement``.

    With ``concurrent`` every group of the kind runs at once and they share the
    socket links and NICs they cross (see the module docstring); otherwise only
    the first group is looked at, alone.

    Results are memoized per (topology numbers, grid, kind, size, placement,
    concurrent): a :class:`GroupPath` is immutable, and looking at every group of a
    large grid is what a planner would otherwise repeat for every pricer it makes.
    """
    placement = placement or Placement()
    key = _path_key(topology, grid, kind, size, placement, concurrent)
    if key is not None:
        hit = _PATHS.get(key)
        if hit is not None:
            return hit
    path = _group_path(topology, grid, kind, size, placement, concurrent)
    if key is not None:
        if len(_PATHS) >= PATH_MEMO_SIZE:
            _PATHS.clear()
        _PATHS[key] = path
    return path


def _group_path(topology, grid, kind, size, placement, concurrent) -> GroupPath:
    """:func:`group_path` itself, not memoized."""
    topo = topology
    dpn = topo.devices_per_node
    slots = placement.slots_for(grid, dpn)
    groups = grid.groups(kind, size)
    if not concurrent:
        groups = groups[:1]
    members = [[slots[r] if r < len(slots) else r for r in g] for g in groups]
    # per group: {node: [local indices]}
    layout = []
    for mem in members:
        by_node: dict = {}
        for s in mem:
            by_node.setdefault(s // dpn, []).append(s % dpn)
        layout.append(by_node)
    spanning = [len(bn) > 1 for bn in layout]
    # devices of node-spanning groups per node, and socket-crossing groups per node
    nic_users: dict = {}
    crossings: dict = {}
    for bn, span in zip(layout, spanning):
        for node, locs in bn.items():
            if span:
                nic_users[node] = nic_users.get(node, 0) + len(locs)
            if topo.intra_kind == "pcie" and topo.sockets > 1 and \
                    len({topo.socket_of(x) for x in locs}) > 1:
                crossings[node] = crossings.get(node, 0) + 1
    leaving = _leaving_groups(topo, layout)
    worst = None
    for bn, span in zip(layout, spanning):
        size_g = sum(len(v) for v in bn.values())
        bw, neck, share = topo.intra_effective, "intra", 1.0
        if topo.intra_kind == "pcie":
            for node, locs in bn.items():
                if topo.sockets > 1 and len({topo.socket_of(x) for x in locs}) > 1:
                    flows = crossings[node]
                    lim = topo.socket_effective / flows
                    if lim < bw:
                        bw, neck, share = lim, "socket", float(flows)
        if span:
            if topo.nics_per_node <= 0:
                from ...cli import UsageError     # the machine file's mistake: exit 2

                raise UsageError(f"the machine's nodes have no NICs (topology."
                                 f"nics_per_node = 0), but a group of {size_g} devices "
                                 f"spans {len(bn)} nodes of {dpn} devices each: give the "
                                 f"nodes' NICs (nics_per_node, nic_bandwidth), or price "
                                 f"a job on one node")
            for lim, why, flows in (_nic_bound(topo, bn, nic_users),
                                    _spine_bound(topo, bn, leaving)):
                if lim < bw:
                    bw, neck, share = lim, why, flows
        path = GroupPath(size_g, len(bn), max(len(v) for v in bn.values()), bw,
                         topo.intra_kind, neck, share)
        if worst is None or (path.bus_bandwidth, -path.nodes) < (worst.bus_bandwidth,
                                                                   -worst.nodes):
            worst = path
    return worst


def _nic_bound(topo: Topology, by_node: dict, nic_users: dict) -> tuple:
    """``(bus bandwidth, bottleneck, sharing)`` of a node-spanning group from the NICs
    of its nodes: on each node its devices get the node's NIC rate
    (:attr:`Topology.node_nic_effective`) shared by the node's ``nic_users``, each at
    most its local NIC share; the node where that is least binds. The bottleneck is
    ``"host"`` when staging through host memory (no GPUDirect RDMA) is what limits the
    node, else ``"nic"``."""
    nics = topo.nics_per_node * topo.nic_effective
    node_cap = topo.node_nic_effective
    cap = topo.nic_effective * max(1, topo.nics_per_node // topo.devices_per_node)
    best = (math.inf, "nic", 1.0)
    for node, locs in by_node.items():
        users = nic_users[node]
        lim = len(locs) * min(node_cap / users, cap)
        if lim < best[0]:
            host = node_cap < nics and node_cap / users < cap
            best = (lim, "host", float(users)) if host else \
                (lim, "nic", users / max(1, topo.nics_per_node))
    return best


def _leaving_groups(topo: Topology, layout: list) -> dict:
    """``{leaf domain: concurrent groups that touch it and leave it}`` (groups whose
    nodes lie in more than one domain); empty when the fabric is one domain."""
    out: dict = {}
    if topo.nodes_per_leaf <= 0:
        return out
    for by_node in layout:
        domains = {topo.domain_of(n) for n in by_node}
        if len(domains) > 1:
            for dom in domains:
                out[dom] = out.get(dom, 0) + 1
    return out


def _spine_bound(topo: Topology, by_node: dict, leaving: dict) -> tuple:
    """``(bus bandwidth, "spine", sharing)`` of a group from the leaf uplinks: a ring
    over several leaf domains leaves and enters each domain it touches once per
    direction, carrying its bus bandwidth, so it gets at most ``U / g`` of every such
    domain (:meth:`Topology.uplink_effective`, ``g`` the groups of ``leaving`` that
    share it); ``(inf, "spine", 1)`` for a group inside one domain (Leiserson 1985;
    NVIDIA DGX SuperPOD reference architecture: see the module docstring)."""
    best = (math.inf, "spine", 1.0)
    domains = {topo.domain_of(n) for n in by_node}
    if len(domains) < 2:
        return best
    for dom in sorted(domains):
        lim = topo.uplink_effective(dom) / leaving[dom]
        if lim < best[0]:
            best = (lim, "spine", float(leaving[dom]))
    return best


def explicit_slots(values: Sequence[int]) -> Placement:
    """An explicit :class:`Placement` from a sequence of slots."""
    return Placement("explicit", slots=tuple(values))
