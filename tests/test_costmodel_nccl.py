"""NCCL's collectives against their published closed forms (summasim.costmodel.collectives.nccl).

Ring all-reduce moves 2 (p-1)/p B over the slowest link, all-gather and
reduce-scatter (p-1)/p of the total, broadcast and reduce B (a pipelined chain);
NCCL-tests' bus bandwidth undoes exactly those factors (doc/PERFORMANCE.md), so a
large ring collective's predicted busBw is the link's bus bandwidth.
"""

from __future__ import annotations

import math

import pytest

from summasim.costmodel import collectives as C
from summasim.costmodel.collectives.nccl import (_latency, bus_factor, candidate_time, nccl_time,
                                                 predicted_bus_bandwidth)
from summasim.costmodel.machine import load_preset
from summasim.costmodel.machine.topology import GridShape, GroupPath, group_path
from summasim.costmodel.workload.predict import predict_trace
from summasim.costmodel.workload.traffic import MessageClass

GB = 1e9


def _path(p=8, nodes=1, bw=200 * GB, kind="nvswitch"):
    return GroupPath(size=p, nodes=nodes, per_node=p // nodes, bus_bandwidth=bw,
                     intra_kind=kind, bottleneck="intra")


@pytest.mark.parametrize("p", [2, 3, 8, 24])
def test_ring_bandwidth_terms_are_the_closed_forms(p):
    path = _path(p)
    B = 1 << 30
    lat = lambda op, total: _latency(op, "ring", "Simple", path, total)  # noqa: E731
    ar = candidate_time("allreduce", B, path, "ring", "Simple") - lat("allreduce", B)
    assert ar == pytest.approx(2 * (p - 1) / p * B / path.bus_bandwidth, rel=1e-12)
    rs = candidate_time("reduce_scatter", B, path, "ring", "Simple") - lat("reduce_scatter", B)
    assert rs == pytest.approx((p - 1) / p * B / path.bus_bandwidth, rel=1e-12)
    per_rank = B / p                                     # all-gather: trace bytes per rank
    ag = candidate_time("allgather", per_rank, path, "ring", "Simple") - lat("allgather", B)
    assert ag == pytest.approx((p - 1) / p * B / path.bus_bandwidth, rel=1e-12)
    for op in ("bcast", "reduce"):
        t = candidate_time(op, B, path, "ring", "Simple") - lat(op, B)
        assert t == pytest.approx(B / path.bus_bandwidth, rel=1e-12)


def test_tree_allreduce_moves_twice_the_buffer_at_its_bus_bandwidth():
    path = _path(8)
    B = 1 << 30                                          # >= 128 MiB: no correction factor
    t = candidate_time("allreduce", B, path, "tree", "Simple") - _latency(
        "allreduce", "tree", "Simple", path, B)
    tree_bw = min(0.9 * path.bus_bandwidth, 110 * GB)    # NCCL 2.8's tree cap, <= 2 nodes
    assert t == pytest.approx(2 * B / tree_bw, rel=1e-12)


def test_bus_factor_is_nccl_tests_definition():
    assert bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("allgather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("bcast", 8) == bus_factor("reduce", 8) == 1.0


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter", "bcast"])
def test_large_ring_collectives_reach_the_links_bus_bandwidth(op):
    path = _path(8)
    nb = (1 << 33) if op != "allgather" else (1 << 30)
    bus = predicted_bus_bandwidth(op, nb, path, algorithm="ring", protocol="Simple")
    assert bus == pytest.approx(path.bus_bandwidth, rel=2e-3)
    assert bus < path.bus_bandwidth                      # latency only takes away


def test_protocol_and_algorithm_choice_follow_the_size():
    one = _path(8)
    assert nccl_time("allreduce", 1024, one).protocol == "LL"      # tiny: lowest latency
    big = nccl_time("allreduce", 1 << 30, one)
    assert (big.algorithm, big.protocol) == ("ring", "Simple")      # huge: full bandwidth
    assert nccl_time("allreduce", 1 << 30, one, ll128=False).protocol != "LL128"
    many = _path(512, nodes=64, bw=180 * GB)
    assert nccl_time("allreduce", 65536, many).algorithm == "tree"  # log-depth latency wins
    assert nccl_time("allreduce", 1 << 31, many).algorithm == "ring"
    # the chosen pair is the fastest candidate
    for nb in (4096, 1 << 20, 1 << 26):
        best = nccl_time("allreduce", nb, many)
        cands = [candidate_time("allreduce", nb, many, a, pr) for a in ("ring", "tree")
                 for pr in ("LL", "LL128", "Simple")]
        assert best.seconds == pytest.approx(min(cands))


def test_forced_and_disabled_choices():
    path = _path(8)
    assert nccl_time("allreduce", 1 << 20, path, algorithm="tree").algorithm == "tree"
    assert math.isinf(candidate_time("allgather", 1 << 20, path, "tree", "Simple"))
    with pytest.raises(ValueError, match="algorithm"):
        nccl_time("allreduce", 8, path, algorithm="butterfly")
    assert nccl_time("allreduce", 1 << 20, _path(1)).seconds == 0.0


def test_latency_grows_with_the_ring_steps():
    t8 = candidate_time("allreduce", 8, _path(8), "ring", "LL")
    t16 = candidate_time("allreduce", 8, _path(16), "ring", "LL")
    # 2 (p-1) hops of 0.47 us on NVLink after a 3.6 us base (NCCL 2.8 tuning tables)
    assert t8 == pytest.approx((3.6 + 14 * 0.47) * 1e-6, rel=1e-3)
    assert t16 - t8 == pytest.approx(16 * 0.47e-6, rel=1e-3)


def test_no_power_of_two_step_unlike_mpich():
    """On full nodes, NCCL's ring all-reduce over 24 ranks costs between 16 and 32;
    MPICH's Rabenseifner folds the extra ranks in and pays more than at 32."""
    m = load_preset("dgx-a100")
    B = 64 << 20
    t = {p: nccl_time("allreduce", B, group_path(m.topology, GridShape.of(p), "world", p))
         .seconds for p in (16, 24, 32)}
    assert t[16] <= t[24] <= t[32]
    mp = {p: C.collective_time("allreduce", B, p, m, inter=True).seconds for p in (16, 24, 32)}
    assert mp[24] > mp[32]


def test_nccl_machines_price_traces_with_nccl_and_mpich_machines_do_not():
    events = [MessageClass("allreduce", "world", 8, 1 << 24, 2)]
    gpu = load_preset("dgx-a100")
    pred = predict_trace(events, gpu, p=8, dtype="bfloat16")
    (algs,) = pred.algorithms.values()
    assert algs[0].startswith("nccl_ring_")
    path = group_path(gpu.topology, GridShape.of(8), "world", 8)
    assert pred.comm_seconds == pytest.approx(2 * nccl_time("allreduce", 1 << 24, path).seconds)
    mpich = gpu.replace(library="mpich", topology=None, device=None)
    (algs,) = predict_trace(events, mpich, p=8, dtype="bfloat16").algorithms.values()
    assert algs == ("reduce_scatter_allgather",)
