"""The node's memory bandwidth the fit measures for the predictions' memory floor
(``costmodel.fit.node_memory_bandwidth``): one value on every rank, from every rank of
the node streaming at once, and none where too few ranks share a node to reach it."""

from __future__ import annotations

import math

from mpi4py import MPI

from _util import WORLD, parallel_assert
from summasim.costmodel.fit import node_memory_bandwidth, node_memory_throughput


def _node_size() -> int:
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def test_the_bandwidth_is_agreed_and_counts_every_rank_s_streams():
    said = []
    bw = node_memory_bandwidth(WORLD, _node_size(), said.append)
    got = WORLD.allgather(bw)
    parallel_assert(bw is not None and math.isfinite(bw) and bw > 0, f"bandwidth {bw}")
    parallel_assert(len(set(got)) == 1, f"ranks disagree: {got}")
    parallel_assert(any("GiB/s" in s and "best of 3" in s for s in said), f"said {said}")
    # one span, from the first rank's start to the last rank's end: the same on every rank
    one = node_memory_throughput(WORLD, 1 << 20, 8)
    parallel_assert(len(set(WORLD.allgather(one))) == 1, "readings differ between ranks")


def test_fewer_ranks_than_cores_measure_nothing():
    said = []
    bw = node_memory_bandwidth(WORLD, _node_size() + 1, said.append)
    parallel_assert(bw is None, f"measured {bw} with fewer ranks than cores")
    parallel_assert(any("not measured" in s for s in said), f"said {said}")
