"""What one member of an MPICH collective does: its messages, bytes and reduced bytes,
and its critical path (the input of the shared-core model of
:mod:`~summasim.costmodel.workload.pricer`)."""

from __future__ import annotations

from typing import NamedTuple

from .mpich import lg, pof2_floor

class Shape(NamedTuple):
    """What one member of a collective does, on average over the members, and its
    critical path (for the shared-core model of :mod:`~summasim.costmodel.workload.pricer`).

    ``msgs`` messages and ``nbytes`` bytes received (each copied once by the CPU of
    shared-memory MPI), ``reduce_bytes`` bytes added (``reduce_kind`` "add": NumPy,
    "mpi": MPI's loops), ``hops`` messages on the critical path one after another
    and ``hop_bytes`` the bytes they carry.
    """

    msgs: float
    nbytes: float
    reduce_bytes: float
    reduce_kind: str
    hops: float
    hop_bytes: float


def collective_shape(op: str, algorithm: str, nbytes: float, p: int) -> Shape:
    """Per-member work and critical path of ``op`` run with ``algorithm`` (pure counting).

    ``nbytes`` and ``p`` as in :func:`collective_time`; p = 1 gives zeros. Counts are
    for p a power of two (the fold of the other ranks adds two messages to
    ``(p - p')/p`` of the members on average). The "paper" formulas count as the
    algorithms they idealize (binomial trees, ring all-reduce).
    """
    if p <= 1:
        return Shape(0.0, 0.0, 0.0, "add", 0.0, 0.0)
    B, L, f = float(nbytes), lg(p), (p - 1) / p
    p2 = pof2_floor(p)
    fold = 2.0 * (p - p2) / p
    if algorithm == "paper":
        algorithm = {"bcast": "binomial", "reduce": "binomial", "allreduce": "ring",
                     "allgather": "ring", "reduce_scatter": "pairwise", "sendrecv": "sendrecv",
                     "barrier": "dissemination"}[op]
    key = (op, algorithm)
    if key == ("bcast", "binomial"):
        return Shape(f, f * B, 0.0, "add", L, L * B)
    if key == ("bcast", "scatter_recursive_doubling_allgather"):
        return Shape(f + L, L * B / 2 / p + f * B, 0.0, "add", 2 * L, 2 * f * B)
    if key == ("bcast", "scatter_ring_allgather"):
        return Shape(f + (p - 1), L * B / 2 / p + f * B, 0.0, "add", L + p - 1, 2 * f * B)
    if key == ("reduce", "tree"):
        return Shape(f, f * B, f * B + B / p, "add", L, L * B)
    if key == ("reduce", "binomial"):
        return Shape(f, f * B, f * B, "mpi", L, L * B)
    if key == ("reduce", "reduce_scatter_gather"):
        f2 = (p2 - 1) / p2
        return Shape(lg(p2) + f + fold / 2, f2 * B + f * B / 2 + fold / 2 * B, f2 * B, "mpi",
                     2 * lg(p2), 2 * f2 * B)
    if key == ("allreduce", "recursive_doubling"):
        return Shape(lg(p2) + fold, (lg(p2) + fold) * B, (lg(p2) + fold / 2) * B, "mpi",
                     lg(p2) + (2 if p != p2 else 0), (lg(p2) + (2 if p != p2 else 0)) * B)
    if key == ("allreduce", "reduce_scatter_allgather"):
        f2 = (p2 - 1) / p2
        return Shape(2 * lg(p2) + fold, 2 * f2 * B + fold * B, f2 * B + fold / 2 * B, "mpi",
                     2 * lg(p2) + (2 if p != p2 else 0), 2 * f2 * B)
    if key == ("allreduce", "ring"):
        return Shape(2 * (p - 1), 2 * f * B, f * B, "add", 2 * (p - 1), 2 * f * B)
    if key == ("allgather", "ring"):
        return Shape(p - 1, (p - 1) * B, 0.0, "add", p - 1, (p - 1) * B)
    if key in (("allgather", "recursive_doubling"), ("allgather", "bruck")):
        return Shape(L, (p - 1) * B, 0.0, "add", L, (p - 1) * B)
    if key == ("reduce_scatter", "recursive_halving"):
        return Shape(L, f * B, f * B, "mpi", L, f * B)
    if key == ("reduce_scatter", "pairwise"):
        return Shape(p - 1, f * B, f * B, "mpi", p - 1, f * B)
    if key == ("sendrecv", "sendrecv"):
        return Shape(1.0, B, 0.0, "add", 1.0, B)
    if key == ("barrier", "dissemination"):
        return Shape(L, 0.0, 0.0, "add", L, 0.0)
    raise ValueError(f"unknown {op} algorithm {algorithm!r}")
