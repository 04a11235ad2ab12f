"""Topology and placement: which links a group crosses, and how concurrent groups
share them (summasim.costmodel.machine.topology)."""

from __future__ import annotations

import pytest

from summasim.costmodel.compute.roofline import Device
from summasim.costmodel.machine import Machine, load_preset
from summasim.costmodel.machine.topology import (GridShape, Placement, Topology, blocked_tile,
                                                 group_path)

GB = 1e9


def _nvswitch(dpn=8, nics=8):
    return Topology(devices_per_node=dpn, intra_kind="nvswitch", intra_bandwidth=300 * GB,
                    intra_efficiency=0.8, nics_per_node=nics, nic_bandwidth=25 * GB,
                    nic_efficiency=1.0)


def _pcie(nics=1):
    return Topology(devices_per_node=4, intra_kind="pcie", intra_bandwidth=16 * GB,
                    intra_efficiency=1.0, sockets=2, socket_bandwidth=10 * GB,
                    socket_efficiency=1.0, nics_per_node=nics, nic_bandwidth=12 * GB)


def test_row_major_is_the_cartesian_rank_order():
    grid = GridShape.of(q=4, d=2)
    assert Placement().slots_for(grid, 4) == list(range(32))
    assert grid.coords((1 * 4 + 2) * 4 + 3) == (2, 3, 1)        # rank = (k q + i) q + j
    rows = grid.groups("row")
    assert len(rows) == 8 and rows[0] == [0, 1, 2, 3]
    assert grid.groups("col")[0] == [0, 4, 8, 12]
    assert grid.groups("depth")[0] == [0, 16]


def test_blocked_places_square_tiles_per_node():
    grid = GridShape.of(q=4)
    slots = Placement("blocked").slots_for(grid, 4)
    node = [s // 4 for s in slots]
    # 2 x 2 tiles: node of (i, j) is (i // 2) * 2 + j // 2
    assert node == [(i // 2) * 2 + j // 2 for i in range(4) for j in range(4)]
    assert sorted(slots) == list(range(16))                    # a permutation
    for g in grid.groups("row") + grid.groups("col"):
        assert len({node[r] for r in g}) == 2                  # every group: 2 nodes x 2
    assert blocked_tile(8, 8) in ((2, 4), (4, 2))
    assert blocked_tile(3, 4) == (0, 0)


def test_blocked_that_cannot_tile_is_an_error_and_explicit_maps_work():
    with pytest.raises(ValueError, match="blocked placement"):
        Placement("blocked").slots_for(GridShape.of(q=3), 4)
    pl = Placement.parse("map:3,2,1,0")
    assert pl.slots_for(GridShape.of(4), 4) == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="slots"):
        pl.slots_for(GridShape.of(8), 4)
    with pytest.raises(ValueError, match="distinct"):
        Placement.parse("map:0,0")
    with pytest.raises(ValueError, match="unknown placement"):
        Placement.parse("diagonal")
    assert Placement.parse("blocked:1x4").slots_for(GridShape.of(q=4), 4) == list(range(16))
    # a tile of no ranks was taken, and explore fell back to row-major without a word
    for empty in ("blocked:0x0", "blocked:0x4", "blocked:-1x2"):
        with pytest.raises(ValueError, match="at least 1x1"):
            Placement.parse(empty)


def test_group_inside_a_node_gets_the_device_link():
    topo = _nvswitch()
    path = group_path(topo, GridShape.of(q=8), "row", 8)       # a row is one node
    assert path.nodes == 1 and path.bottleneck == "intra"
    assert path.bus_bandwidth == pytest.approx(0.8 * 300 * GB)


def test_columns_share_the_nics_of_their_nodes():
    topo = _nvswitch()
    path = group_path(topo, GridShape.of(q=8), "col", 8)       # 1 device per node, 8 nodes
    assert path.nodes == 8 and path.per_node == 1 and path.bottleneck == "nic"
    assert path.bus_bandwidth == pytest.approx(25 * GB)        # its own NIC, no more
    # one NIC shared by 4 devices whose 4 column groups all leave the node
    shared = Topology(**{**topo.to_dict(), "devices_per_node": 4, "nics_per_node": 1})
    col = group_path(shared, GridShape.of(q=4), "col", 4)
    assert col.bus_bandwidth == pytest.approx(25 * GB / 4)
    alone = group_path(shared, GridShape.of(q=4), "col", 4, concurrent=False)
    assert alone.bus_bandwidth == pytest.approx(25 * GB)


def test_blocked_placement_changes_the_links_a_row_crosses():
    topo = _nvswitch(dpn=4, nics=4)
    grid = GridShape.of(q=4)
    rm = group_path(topo, grid, "row", 4, Placement())
    bl = group_path(topo, grid, "row", 4, Placement("blocked"))
    assert rm.nodes == 1 and bl.nodes == 2
    # blocked: 2 devices of the row per node, each with its NIC share
    assert bl.bus_bandwidth == pytest.approx(2 * 25 * GB)
    assert group_path(topo, grid, "col", 4, Placement()).nodes == 4
    assert group_path(topo, grid, "col", 4, Placement("blocked")).nodes == 2


def test_pcie_socket_crossings_share_the_socket_link():
    topo = _pcie()
    grid = GridShape.of(q=2)                  # one 4-GPU node: devices 0,1 socket 0; 2,3 socket 1
    row = group_path(topo, grid, "row", 2)    # (0,1) and (2,3): each on one socket
    col = group_path(topo, grid, "col", 2)    # (0,2) and (1,3): both cross, sharing the link
    assert row.bottleneck == "intra" and row.bus_bandwidth == pytest.approx(16 * GB)
    assert col.bottleneck == "socket" and col.bus_bandwidth == pytest.approx(10 * GB / 2)
    whole = group_path(topo, GridShape.of(4), "world", 4)
    assert whole.bus_bandwidth == pytest.approx(10 * GB)


def test_topology_validation_and_machine_round_trip():
    with pytest.raises(ValueError, match="intra_kind"):
        Topology(devices_per_node=4, intra_kind="carrier-pigeon", intra_bandwidth=1.0)
    with pytest.raises(ValueError, match="socket_bandwidth"):
        Topology(devices_per_node=4, intra_kind="pcie", intra_bandwidth=1.0, sockets=2)
    with pytest.raises(ValueError, match="efficiency"):
        Topology(devices_per_node=4, intra_kind="nvswitch", intra_bandwidth=1.0,
                 intra_efficiency=1.5)
    m = load_preset("frontera-rtx")
    assert m.library == "nccl" and m.topology.intra_kind == "pcie"
    assert Machine.from_dict(m.to_dict()) == m
    d = m.to_dict()
    d["topology"]["bogus"] = 1
    with pytest.raises(ValueError, match="topology.bogus"):
        Machine.from_dict(d)
    d = m.to_dict()
    d["topology"] = None
    with pytest.raises(ValueError, match="topology"):
        Machine.from_dict(d)                       # library nccl needs a topology
    d = m.to_dict()
    d["device"]["memory_bandwidth"] = -1
    with pytest.raises(ValueError, match="device.memory_bandwidth"):
        Machine.from_dict(d)
    assert isinstance(m.device, Device)


@pytest.mark.parametrize("name", ["dgx-a100", "h100-dgx-ndr", "frontera-rtx", "dgx2h-v100"])
def test_gpu_presets_cite_a_source_for_every_topology_and_device_number(name):
    m = load_preset(name)
    topo, dev = m.topology, m.device
    for f in ("devices_per_node", "intra_bandwidth", "intra_efficiency", "nics_per_node",
              "nic_bandwidth", "nic_efficiency", "ll128"):
        assert len(topo.sources.get(f, "")) > 20, (name, f)
    if topo.intra_kind == "pcie":
        assert topo.sources.get("socket_bandwidth") and topo.sources.get("socket_efficiency")
    for f in ("memory_bandwidth", "vector_flops", "launch_seconds"):
        assert len(dev.sources.get(f, "")) > 20, (name, f)
    assert "gamma_gemm" in m.notes and "datasheet" in m.notes["gamma_gemm"]


def test_group_path_memo_returns_what_the_computation_does():
    """The memo (topology.group_path) is keyed on everything a path depends on: the
    same answers cold and warm, a different topology or placement is not confused
    with a memoized one, documentation (sources) does not matter, and arguments that
    cannot be hashed are computed without the memo."""
    from summasim.costmodel.machine import topology as T

    cases = [(_nvswitch(), GridShape.of(q=8), "col", 8, Placement()),
             (_nvswitch(nics=4), GridShape.of(q=8), "col", 8, Placement()),
             (_nvswitch(), GridShape.of(q=8), "col", 8, Placement("blocked")),
             (_nvswitch(), GridShape.of(q=8), "row", 8, Placement("blocked")),
             (_pcie(), GridShape.of(q=4), "row", 4, Placement()),
             (_nvswitch(), GridShape.of(32), "world", 32, Placement())]
    fresh = [T._group_path(*c, True) for c in cases]
    T.clear_path_memo()
    for _ in range(2):                                   # cold, then warm
        assert [group_path(*c) for c in cases] == fresh
    assert group_path(*cases[0]) != group_path(*cases[1])   # 8 NICs vs 4 per node
    noted = _nvswitch()
    object.__setattr__(noted, "sources", {"nic_bandwidth": "another citation"})
    assert group_path(noted, *cases[0][1:]) == fresh[0]
    listed = Placement("blocked", tile=[2, 4])               # a list: not hashable
    assert group_path(_nvswitch(), GridShape.of(q=8), "col", 8, listed) == \
        T._group_path(_nvswitch(), GridShape.of(q=8), "col", 8, Placement("blocked",
                                                                           tile=(2, 4)), True)
    assert group_path(*cases[0], concurrent=False) == T._group_path(*cases[0], False)


def test_several_nodes_without_nics_are_refused_when_the_machine_loads():
    """A machine of several nodes whose topology lacks NICs would load and then fail the
    first time a group spans nodes; it is refused as it loads, naming the field. One
    node (or an unstated count) needs none."""
    with pytest.raises(ValueError, match="2 nodes need nics_per_node > 0"):
        Topology(**{**_nvswitch(nics=0).to_dict(), "nodes": 2})
    assert Topology(**{**_nvswitch(nics=0).to_dict(), "nodes": 1}).nodes == 1
    assert Topology(**{**_nvswitch(nics=2).to_dict(), "nodes": 2}).nics_per_node == 2


def test_a_group_across_nodes_without_nics_is_a_user_error():
    """A machine file whose nodes have no NICs (nics_per_node 0, or left out) can price
    groups inside a node; a group that spans nodes is a user error naming the field and
    the most devices that can be placed (it was a ValueError traceback from predict,
    plan and explore)."""
    from summasim.cli import UsageError

    topo = _nvswitch(nics=0)
    assert group_path(topo, GridShape.of(8), "world", 8).nodes == 1
    with pytest.raises(UsageError, match=r"nics_per_node = 0.*16 devices spans 2 nodes of 8"):
        group_path(topo, GridShape.of(16), "world", 16)
