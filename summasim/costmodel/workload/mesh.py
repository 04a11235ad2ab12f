"""The groups of a training mesh ``[dp, pp, tensor]`` (rank order of
:func:`summasim.spec.mesh_rank`) and the collectives over them, priced on the machine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from ..collectives import collective_time
from ..collectives.nccl import nccl_time
from ..machine.topology import GridShape, Placement, group_path
from .scheme import TransformerConfig
from .zero import _RING_ALGORITHM


@dataclass(frozen=True)
class MeshGroup:
    """The concurrent groups of one kind on the mesh (ranks in mesh order ``[dp, pp,
    tensor]``): in every block of ``block`` ranks, ``width`` groups of ``size`` ranks
    ``stride`` apart, starting at the block's first ``width`` ranks. Data parallel:
    ``(pp t, dp, devices, pp t)``; pipeline: ``(t, pp, pp t, t)``; the tied embedding's
    pair of first and last stage: ``((pp-1) t, 2, pp t, t)``. The data-parallel and
    pipeline groups are :func:`summasim.spec.mesh_groups`' ``"dp"`` and ``"pp"``, in its
    order; the embedding's pair has no name there."""

    stride: int
    size: int
    block: int
    width: int

    def groups(self, devices: int) -> list[list[int]]:
        return [[blk + o + i * self.stride for i in range(self.size)]
                for blk in range(0, devices, self.block) for o in range(self.width)]

    def group_of(self, rank: int):
        """``(block, offset)`` of the group holding ``rank``, or None."""
        x = rank % self.block
        o, i = x % self.stride, x // self.stride
        return (rank - x, o) if o < self.width and i < self.size else None

    def near(self, node_size: int, devices: int) -> list[list[int]]:
        """The first group and every group with a rank on one of its nodes: all the
        groups that share a NIC with it (the first group stands for the others). Only the
        ``devices`` ranks of the mesh exist: a node it fills in part holds no other
        group."""
        first = [i * self.stride for i in range(self.size)]
        keys = {(0, 0)}
        for node in {r // node_size for r in first}:
            for r in range(node * node_size, min((node + 1) * node_size, devices)):
                k = self.group_of(r)
                if k is not None:
                    keys.add(k)
        return [[blk + o + i * self.stride for i in range(self.size)]
                for blk, o in sorted(keys)]


@dataclass(frozen=True)
class _MeshGrid(GridShape):
    """A 1D placement of the whole mesh (row-major) whose groups are given: what
    :func:`~summasim.costmodel.machine.topology.group_path` needs to share NICs among them."""

    members: tuple = ()

    def groups(self, kind, size=None):
        return [list(g) for g in self.members]


class _Coll:
    """Cached seconds of the composition's collectives over dp and pp groups.

    MPICH-family machines: summasim's ring algorithms (what the engine runs:
    all-reduce "ring", reduce-scatter "pairwise", all-gather "ring"; sends ``alpha +
    beta B``) on the inter-node link when any group of the kind spans nodes. NCCL
    machines: NCCL's own choice (:func:`~summasim.costmodel.collectives.nccl.nccl_time`) on the
    topology, every group of the kind running at once and sharing the NICs
    (:func:`~summasim.costmodel.machine.topology.group_path` of all of them).
    """

    def __init__(self, machine, comm_slow, devices):
        self.machine, self.slow, self.devices = machine, comm_slow, devices
        self.nccl = getattr(machine, "library", "mpich") == "nccl" and \
            getattr(machine, "topology", None) is not None
        self.cache, self.paths = {}, {}

    def _where(self, grp: MeshGroup):
        hit = self.paths.get(grp)
        if hit is None:
            if self.nccl:
                topo = self.machine.topology
                # every group sharing a NIC with the first, or a leaf domain's uplinks
                groups = grp.near(topo.devices_per_node * max(1, topo.nodes_per_leaf),
                                  self.devices)
                grid = _MeshGrid(self.devices, 1, 1, True, members=tuple(map(tuple, groups)))
                hit = group_path(self.machine.topology, grid, "world", grp.size, Placement())
            else:
                ns = self.machine.node_size
                hit = ns is not None and any(len({r // ns for r in g}) > 1
                                             for g in grp.groups(self.devices))
            self.paths[grp] = hit
        return hit

    def __call__(self, op, nbytes, grp: MeshGroup):
        if grp.size <= 1 or nbytes <= 0:
            return 0.0
        key = (op, nbytes, grp)
        hit = self.cache.get(key)
        if hit is None:
            where = self._where(grp)
            if self.nccl:
                hit = nccl_time("sendrecv" if op == "p2p" else op, nbytes, where,
                                ll128=self.machine.topology.ll128).seconds
            elif op == "p2p":
                hit = self.machine.link(where).time(nbytes)
            else:
                try:
                    hit = collective_time(op, nbytes, grp.size, self.machine, inter=where,
                                          algorithm=_RING_ALGORITHM[op]).seconds
                except ValueError:       # a library that names its algorithms differently
                    hit = collective_time(op, nbytes, grp.size, self.machine,
                                          inter=where).seconds
            hit *= self.slow
            self.cache[key] = hit
        return hit


def _memory_bandwidth(machine) -> float:
    """Bytes/s of device memory: the roofline device's, else ``3 / gamma_reduce``."""
    dev = getattr(machine, "device", None)
    bw = getattr(dev, "memory_bandwidth", None)
    if isinstance(bw, (int, float)) and not isinstance(bw, bool) and bw > 0:
        return float(bw)
    return 3.0 / machine.gamma_reduce if machine.gamma_reduce > 0 else math.inf


def model_flops(cfg: TransformerConfig, global_batch: int) -> float:
    """Useful flops of one step (forward + backward, no recomputation): ``3 [N (2 b s
    h^2 (1 + r + k f) + 4 b s^2 h) + 2 b s h v]`` over the global batch, with the QKV
    ``r h`` wide (r = 3; ``1 + 2 k_v / n`` under grouped-query attention) and k MLP
    matrices (GELU 2, SwiGLU 3); for GPT-2's block (r = 3, k = 2, f = 4) this is
    Narayanan et al. 2021's ``72 B s N h^2 (1 + s/(6h) + v/(12 N h))``. An untied head
    does the same GEMMs as a tied one."""
    B, s, h, v, N, f = global_batch, cfg.s, cfg.h, cfg.v, cfg.N, cfg.ffn
    r, k = getattr(cfg, "qkv_mult", 3), getattr(cfg, "mlp_matrices", 2)
    return 3.0 * (N * (2 * B * s * h * h * (1 + r + k * f) + 4 * B * s * s * h)
                  + 2 * B * s * h * v)
