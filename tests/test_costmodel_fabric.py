"""The fabric above the NICs: leaf domains, oversubscribed uplinks (the "spine"
bound) and NIC traffic staged through host memory without GPUDirect RDMA
(summasim.costmodel.machine.topology, the variant keys of machine.presets), checked
against closed forms worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from summasim.costmodel.machine import Machine, load_preset
from summasim.costmodel.machine.presets import load_machine
from summasim.costmodel.machine.topology import GridShape, Placement, Topology, group_path
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.workload.scheme import TransformerConfig

GB = 1e9
NIC = 25 * GB                    # one NIC's achievable rate (efficiency 1)


def _topo(**fabric) -> Topology:
    """8 GPUs per node on NVSwitch, 8 NICs of 25 GB/s: one NIC per GPU."""
    return Topology(devices_per_node=8, intra_kind="nvswitch", intra_bandwidth=300 * GB,
                    intra_efficiency=0.8, nics_per_node=8, nic_bandwidth=NIC,
                    nic_efficiency=1.0, **fabric)


#: 8 nodes of 8 GPUs as a 2 x 32 grid: column j is the data-parallel pair {j, 32 + j},
#: one GPU on node j // 8 and one on node 4 + j // 8; with nodes_per_leaf=4 every one
#: of the 32 pairs joins leaf domain 0 (nodes 0-3) to domain 1 (nodes 4-7).
PAIRS = GridShape.of(q=2, pc=32)


def _pairs(topo: Topology, **kw):
    return group_path(topo, PAIRS, "col", 2, Placement(), **kw)


# --------------------------------------------------------------------------- spine
def test_data_parallel_pairs_across_two_oversubscribed_leaves():
    topo = _topo(nodes_per_leaf=4, oversubscription=2.0)
    # NIC: 8 users per node share 8 x 25 GB/s, each at most its own NIC: 25 GB/s
    nic = min(8 * NIC / 8, NIC)
    # spine: U = 4 nodes x 8 NICs x 25 GB/s / 2 = 400 GB/s out of each domain, and all
    # 32 pairs touch both domains and leave them
    u = 4 * 8 * NIC / 2
    path = _pairs(topo)
    assert path.nodes == 2 and path.per_node == 1
    assert path.bus_bandwidth == pytest.approx(min(nic, u / 32)) == pytest.approx(12.5 * GB)
    assert path.bottleneck == "spine" and path.sharing == 32
    # alone (not concurrent) one pair has the whole uplink: the NIC binds again
    assert _pairs(topo, concurrent=False).bus_bandwidth == pytest.approx(nic)


def test_non_blocking_or_one_domain_fabric_is_todays_value():
    today = _pairs(_topo())
    assert today.bottleneck == "nic" and today.bus_bandwidth == pytest.approx(NIC)
    for fabric in ({"nodes_per_leaf": 4, "oversubscription": 1.0},   # U / 32 = NIC
                   {"nodes_per_leaf": 8, "oversubscription": 2.0},   # one domain
                   {"nodes_per_leaf": 64, "oversubscription": 8.0}):
        assert _pairs(_topo(**fabric)) == today, fabric


def test_a_ring_crosses_each_leaf_boundary_once_per_direction():
    # 8 data-parallel rings of 8 nodes (1 GPU per node): each crosses the boundary of
    # each 4-node domain once per direction, so 8 rings load it with 8 bus bandwidths
    grid = GridShape.of(q=8)
    u = 4 * 8 * NIC

    def bw(r):
        return group_path(_topo(nodes_per_leaf=4, oversubscription=r), grid, "col", 8)

    assert bw(2.0).bus_bandwidth == pytest.approx(min(NIC, u / 2 / 8))    # NIC binds
    assert bw(2.0).bottleneck == "nic"
    assert bw(8.0).bus_bandwidth == pytest.approx(min(NIC, u / 8 / 8))    # 12.5 GB/s
    assert bw(8.0).bottleneck == "spine" and bw(8.0).sharing == 8


def test_groups_inside_one_domain_are_never_limited_by_the_spine():
    # the 32 pairs placed on nodes (2m, 2m + 1): with 2-node leaves each pair stays
    # under its leaf, however oversubscribed the uplinks
    slots = [0] * 64
    for j in range(32):
        node = 2 * (j // 8)
        slots[j], slots[32 + j] = node * 8 + j % 8, (node + 1) * 8 + j % 8
    placed = Placement("explicit", slots=tuple(slots))
    inside = group_path(_topo(nodes_per_leaf=2, oversubscription=64.0), PAIRS, "col", 2,
                        placed)
    assert inside.nodes == 2 and inside.bottleneck == "nic"
    assert inside.bus_bandwidth == pytest.approx(NIC)
    # the same pairs with 1-node leaves leave them: 8 pairs share U = 200 / 64 GB/s
    across = group_path(_topo(nodes_per_leaf=1, oversubscription=64.0), PAIRS, "col", 2,
                        placed)
    assert across.bottleneck == "spine"
    assert across.bus_bandwidth == pytest.approx(8 * NIC / 64 / 8)
    # pairs that stay under a leaf do not share its uplinks with those that leave it:
    # 16 pairs join nodes (0, 4) and (1, 5), 8 stay on (2, 3) and 8 on (6, 7)
    for j in range(16, 32):
        node = 2 if j < 24 else 6
        slots[j], slots[32 + j] = node * 8 + j % 8, (node + 1) * 8 + j % 8
    for j in range(16):
        node = j // 8
        slots[j], slots[32 + j] = node * 8 + j % 8, (node + 4) * 8 + j % 8
    mixed = group_path(_topo(nodes_per_leaf=4, oversubscription=4.0), PAIRS, "col", 2,
                       Placement("explicit", slots=tuple(slots)))
    assert mixed.bottleneck == "spine" and mixed.sharing == 16
    assert mixed.bus_bandwidth == pytest.approx(4 * 8 * NIC / 4 / 16)     # not / 24
    # intra-node groups never reach the NICs, let alone the spine
    row = group_path(_topo(nodes_per_leaf=1, oversubscription=64.0), GridShape.of(q=8),
                     "row", 8)
    assert row.bottleneck == "intra" and row.bus_bandwidth == pytest.approx(0.8 * 300 * GB)


# --------------------------------------------------------------------------- GPUDirect
def test_without_gpudirect_the_host_memory_bounds_the_nics():
    host = 100 * GB                 # staging: 100 / 2 = 50 GB/s per direction per node
    topo = _topo(gpudirect=False, host_bandwidth=host)
    grid = GridShape.of(q=8)       # 8 column rings, one GPU per node: 8 NIC users
    path = group_path(topo, grid, "col", 8)
    assert path.bus_bandwidth == pytest.approx(host / 2 / 8)   # 6.25 GB/s, not 25
    assert path.bottleneck == "host" and path.sharing == 8
    # one ring alone: 50 GB/s of staging for one user, its own NIC (25 GB/s) binds
    alone = group_path(topo, grid, "col", 8, concurrent=False)
    assert alone.bottleneck == "nic" and alone.bus_bandwidth == pytest.approx(NIC)
    # host memory faster than the NICs (1000 / 2 > 8 x 25): today's value
    fast = group_path(_topo(gpudirect=False, host_bandwidth=1000 * GB), grid, "col", 8)
    assert fast == group_path(_topo(), grid, "col", 8)


def test_gpudirect_off_needs_host_bandwidth_and_fields_are_validated():
    with pytest.raises(ValueError, match=r"topology\.host_bandwidth"):
        _topo(gpudirect=False)
    for field, bad in (("nodes_per_leaf", -1), ("nodes_per_leaf", 2.5),
                       ("nodes_per_leaf", "4"), ("oversubscription", 0.5),
                       ("oversubscription", float("inf")), ("gpudirect", "no"),
                       ("host_bandwidth", -1.0)):
        with pytest.raises(ValueError, match=rf"topology\.{field}"):
            _topo(**{field: bad})


def test_fabric_fields_round_trip_and_older_files_load():
    plain = load_preset("dgx-a100")
    d = plain.topology.to_dict()
    assert not {"nodes_per_leaf", "oversubscription", "gpudirect", "host_bandwidth"} & set(d)
    topo = _topo(nodes_per_leaf=32, oversubscription=2.0, gpudirect=False,
                 host_bandwidth=50 * GB)
    assert Topology.from_dict(topo.to_dict()) == topo
    m = plain.replace(topology=topo)
    assert Machine.from_dict(m.to_dict()) == m


# --------------------------------------------------------------------------- variants
def test_variant_sets_the_fabric_and_names_its_source():
    var = load_machine("dgx-a100:nodes_per_leaf=4,oversub=2")
    base = load_preset("dgx-a100")
    assert var.name == "dgx-a100:nodes_per_leaf=4,oversub=2"
    assert (var.topology.nodes_per_leaf, var.topology.oversubscription) == (4, 2.0)
    for f in ("nodes_per_leaf", "oversubscription"):
        assert "set by the variant dgx-a100:nodes_per_leaf=4,oversub=2" in \
            var.topology.sources[f]
    same = dataclasses.replace(var.topology, nodes_per_leaf=0, oversubscription=1.0,
                               sources=base.topology.sources)
    assert same == base.topology                       # nothing else moved


@pytest.mark.parametrize("spec,key", [
    ("nodes_per_leaf=0", "nodes_per_leaf"), ("nodes_per_leaf=x", "nodes_per_leaf"),
    ("nodes_per_leaf=2.5", "nodes_per_leaf"), ("oversub=0.5", "oversub"),
    ("oversub=x", "oversub"), ("oversub=0", "oversub"), ("oversub=nan", "oversub"),
])
def test_bad_fabric_variant_values_name_the_key(spec, key):
    with pytest.raises(ValueError) as err:
        load_machine("dgx-a100:" + spec)
    assert repr(key) in str(err.value) and "valid keys" in str(err.value)


def test_fabric_keys_need_nics():
    with pytest.raises(ValueError, match="does not apply"):
        load_machine("local-2core-mpich:oversub=2")


# --------------------------------------------------------------------------- a price
#: a GPT of 2048 hidden, 16 heads, 8 layers, bfloat16 (mixed precision)
CFG = TransformerConfig(b=8, s=512, h=2048, n=16, N=8, v=32768, dtype="bfloat16")


def _step(machine: str, dp: int) -> dict:
    return price_composition(CFG.replace(b=8 * dp), "megatron", t=8, dp=dp,
                             machine=load_machine(machine), grad_overlap=False)


def test_data_parallel_step_is_slower_only_when_its_groups_cross_oversubscribed_leaves():
    # dp = 8 over 8 nodes: 8 rings (one per tensor rank) cross each 2-node leaf once
    # per direction; U / 8 = 2 x 200 / 4 / 8 = 12.5 GB/s < the 25 GB/s NIC
    var = "dgx-a100:nodes_per_leaf=2,oversub=4"
    plain, slow = _step("dgx-a100", 8), _step(var, 8)
    assert slow["breakdown"]["exposed_comm"]["dp"] > plain["breakdown"]["exposed_comm"]["dp"]
    assert slow["step_seconds"] > plain["step_seconds"]
    assert slow["breakdown"]["gemm"] == plain["breakdown"]["gemm"]
    # dp = 2: both nodes under one leaf, nothing crosses it
    assert _step(var, 2)["step_seconds"] == _step("dgx-a100", 2)["step_seconds"]
    # the brief's 2:1 with 4-node leaves: a ring crosses each boundary once, so
    # U / 8 = 50 GB/s > 25 GB/s NIC and the step is unchanged
    assert _step("dgx-a100:nodes_per_leaf=4,oversub=2", 8)["step_seconds"] == \
        plain["step_seconds"]


def test_the_spine_counts_the_data_parallel_groups_of_every_pipeline_stage():
    # t = 8 (one node per tensor group), pp = 2, dp = 4: the dp groups of stage 0 sit on
    # nodes 0, 2, 4, 6 and those of stage 1 on nodes 1, 3, 5, 7. With two nodes per leaf
    # every domain holds 8 groups of each stage and all 16 leave it: U / 16 each.
    from summasim.costmodel.workload.mesh import MeshGroup, _Coll

    m = load_machine("dgx-a100:nodes_per_leaf=2,oversub=4")
    topo = m.topology
    t, pp, dp = 8, 2, 4
    coll = _Coll(m, 1.0, dp * pp * t)
    path = coll._where(MeshGroup(pp * t, dp, dp * pp * t, pp * t))
    u = 2 * topo.nics_per_node * topo.nic_effective / 4
    assert path.bus_bandwidth == pytest.approx(min(u / 16, topo.nic_effective))
    assert path.bottleneck == "spine"


@pytest.mark.parametrize("dp", [3, 5, 7])
def test_a_group_inside_one_node_crosses_no_nic_when_the_mesh_fills_part_of_it(dp):
    # dp < 8 devices of a dgx-a100 node: the ring stays on NVSwitch. The ranks past the
    # mesh's last device hold no group, so none may be priced as spanning two nodes.
    from summasim.costmodel.workload.mesh import MeshGroup, _Coll

    m = load_machine("dgx-a100")
    grp = MeshGroup(1, dp, dp, 1)
    assert grp.near(m.topology.devices_per_node, dp) == [list(range(dp))]
    path = _Coll(m, 1.0, dp)._where(grp)
    whole = _Coll(m, 1.0, 8)._where(MeshGroup(1, 8, 8, 1))
    assert path.nodes == 1 and path.bottleneck == whole.bottleneck != "nic"
    assert path.bus_bandwidth == whole.bus_bandwidth
