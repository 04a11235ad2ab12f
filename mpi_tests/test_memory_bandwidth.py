"""The node's memory bandwidth and cache the fit records for the predictions' memory
floor (``harness.fitbench.node_memory``): one value on every rank, from every rank of a
node streaming at once, and no bandwidth where a node has fewer ranks than CPUs."""

from __future__ import annotations

import math
import os

from mpi4py import MPI

from _util import WORLD, parallel_assert
from summasim.harness import fitbench as fit
from summasim.harness.fitbench import MemoryProbe, node_memory


def _node_size() -> int:
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def test_the_bandwidth_is_agreed_and_measured_only_with_every_cpu_streaming(monkeypatch):
    size = _node_size()
    for cpus in (size, size + 1):                 # every CPU has a rank / one has none
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        said = []
        bw, cache = node_memory(WORLD, said.append)
        parallel_assert(len({(bw, cache)} | set(WORLD.allgather((bw, cache)))) == 1,
                        "ranks disagree")
        if cpus == size:
            parallel_assert(bw is not None and math.isfinite(bw) and bw > 0, f"bw {bw}")
            parallel_assert(any("GiB/s" in s and "best of 3" in s for s in said), f"{said}")
        else:
            parallel_assert(bw is None, f"measured {bw} with a CPU left idle")
            parallel_assert(any("not measured" in s for s in said), f"said {said}")
        # the cache of the CPUs the ranks may use, as sysfs gives it
        want = fit.node_cache_bytes(cpus=os.sched_getaffinity(0))
        parallel_assert(cache is None or (want is not None and cache >= want),
                        f"cache {cache}, this rank's CPUs alone {want}")


def test_a_reading_is_the_same_on_every_rank():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        one = MemoryProbe(1 << 20).read_nodes(WORLD, node, 2)
    finally:
        node.Free()
    parallel_assert(one > 0 and len(set(WORLD.allgather(one))) == 1, "readings differ")
