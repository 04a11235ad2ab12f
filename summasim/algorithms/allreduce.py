"""Ring all-reduce, hand-written from a ring reduce-scatter and a ring all-gather.

A length-N vector is cut into P chunks; chunk c has ``N // P + (c < N % P)``
items (:func:`chunk_bounds`), so any N works, including N < P (empty chunks).

What every rank sends (group rank r, P ranks, all on ``comm``)
----------------------------------------------------------------
reduce-scatter: P-1 sendrecvs; at step s = 0..P-2 rank r sends chunk (r - s) mod P
to rank r+1 and adds the chunk (r - s - 1) mod P received from rank r-1. After it,
rank r holds the full sum of chunk (r + 1) mod P.
all-gather: P-1 sendrecvs; at step s rank r sends chunk (r + 1 - s) mod P and
stores chunk (r - s) mod P.
In total 2(P-1) sendrecvs of about N/P items each, 2(P-1)/P * N items per rank:
the bandwidth-optimal all-reduce (Optimus eq. 5). Nothing is sent when P == 1.

References
----------
P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2), 2009.
"""

from __future__ import annotations

from ..backends import array_module
from ..comm import as_comm


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the P ring chunks of a length-n vector (pure)."""
    if p < 1 or n < 0:
        raise ValueError(f"chunk_bounds: need n >= 0 and p >= 1, got n={n}, p={p}")
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for c in range(p):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _flat(x, fn):
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu":
        raise TypeError(f"{fn}: expected a numeric array, got {type(x).__name__}")
    if x.ndim != 1 or not x.flags.c_contiguous:
        raise ValueError(f"{fn}: expected a contiguous 1-D buffer, got shape {tuple(x.shape)}")
    return x


def ring_reduce_scatter(flat, comm, work=None) -> int:
    """In-place ring reduce-scatter of the 1-D contiguous ``flat`` over ``comm``.

    Afterwards chunk ``(rank + 1) % P`` of ``flat`` holds the sum over all ranks
    (other chunks hold partial sums). Returns that chunk's index.
    ``work`` is an optional receive workspace of at least ``ceil(N / P)`` items.
    """
    comm = as_comm(comm, name="ring")
    _flat(flat, "ring_reduce_scatter")
    p, r = comm.size, comm.rank
    if p == 1:
        return 0
    bounds = chunk_bounds(flat.shape[0], p)
    if work is None:
        work = comm.workspace("ring.recv", flat[: bounds[0][1] - bounds[0][0]], 1)[0]
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        # pass the growing partial sum of one chunk one step round the ring
        s0, s1 = bounds[(r - s) % p]
        r0, r1 = bounds[(r - s - 1) % p]
        recv = work[: r1 - r0]
        comm.sendrecv(flat[s0:s1], right, recv, left)
        flat[r0:r1] += recv
    return (r + 1) % p


def ring_allgather(flat, comm):
    """In-place ring all-gather: rank r contributes chunk ``(r + 1) % P`` of ``flat``;
    afterwards every chunk on every rank holds its owner's data. Returns ``flat``."""
    comm = as_comm(comm, name="ring")
    _flat(flat, "ring_allgather")
    p, r = comm.size, comm.rank
    if p == 1:
        return flat
    bounds = chunk_bounds(flat.shape[0], p)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        # forward the chunk completed last step, receive the next one in place
        s0, s1 = bounds[(r + 1 - s) % p]
        r0, r1 = bounds[(r - s) % p]
        comm.sendrecv(flat[s0:s1], right, flat[r0:r1], left)
    return flat


def ring_allreduce(x, comm, out=None):
    """Sum of ``x`` over all ranks of ``comm``, on every rank (ring algorithm).

    Parameters
    ----------
    x : array, any shape
        This rank's contribution; the same shape and dtype on every rank.
    comm : summasim.comm.Comm or mpi4py.MPI.Comm
        The group (a plain communicator is wrapped and traced as group "ring").
    out : array, optional
        Result buffer shaped like ``x`` (may be ``x`` itself for an in-place sum).

    Returns
    -------
    array
        The element-wise sum, shaped like ``x``.

    Notes
    -----
    Per rank: 2(P-1) sendrecvs of about N/P items (see the module docstring).
    """
    comm = as_comm(comm, name="ring")
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu":
        raise TypeError(f"ring_allreduce: expected a numeric array, got {type(x).__name__}")
    xp = array_module(x)
    if out is None:
        out = xp.array(x, copy=True, order="C")
    elif out is not x:
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError("ring_allreduce: out must have the shape and dtype of x")
        out[...] = x
    if not out.flags.c_contiguous:
        raise ValueError("ring_allreduce: out must be C-contiguous")
    flat = out.reshape(-1)
    ring_reduce_scatter(flat, comm)
    ring_allgather(flat, comm)
    return out
