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

import functools

import numpy as np

from ..backends import array_module
from ..comm import as_comm
from ._common import agree, check_writable_apart, dtype_of, local_error, shape_of


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the P ring chunks of a length-n vector (pure)."""
    if p < 1 or n < 0:
        raise ValueError(f"chunk_bounds: need n >= 0 and p >= 1, got n={n}, p={p}")
    return list(_bounds(int(n), int(p)))


@functools.lru_cache(maxsize=256)
def _bounds(n: int, p: int) -> tuple[tuple[int, int], ...]:
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for c in range(p):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def _xp(x):
    """NumPy for host arrays without a lookup (the ring's hot path), else the backend's."""
    return np if type(x) is np.ndarray else array_module(x)


def _flat(x, fn):
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu":
        raise TypeError(f"{fn}: expected a numeric array, got {dtype_of(x)}")
    if x.ndim != 1 or not x.flags.c_contiguous:
        raise ValueError(f"{fn}: expected a contiguous 1-D buffer, got shape {tuple(x.shape)}")
    check_writable_apart(fn, x, (), (), what="the buffer (the ring works in place)")
    return x


def _work(work, flat, p, fn):
    """``work`` is None or a 1-D buffer of ``flat``'s dtype with room for the largest chunk."""
    if work is None:
        return
    need = -(-flat.shape[0] // p)                                 # ceil(N / P)
    if (not hasattr(work, "dtype") or work.dtype != flat.dtype or work.ndim != 1
            or work.shape[0] < need or not work.flags.c_contiguous):
        raise ValueError(f"{fn}: work must be a contiguous 1-D {flat.dtype} buffer of at "
                         f"least ceil(N / P) = {need} items, got {shape_of(work)} "
                         f"{dtype_of(work)}")
    check_writable_apart(fn, work, (flat,), ("the buffer",), what="work")


def _agree_flat(fn, flat, comm, work=None):
    """The checked entry of the two halves: local checks, then the agreement over ``comm``."""
    comm = as_comm(comm, name="ring")
    _, err = local_error(lambda: (_flat(flat, fn), _work(work, flat, comm.size, fn)))
    agree(fn, comm, lambda: {"dtype": dtype_of(flat), "buffer shape": shape_of(flat)}, err)
    return comm


def ring_reduce_scatter(flat, comm, work=None) -> int:
    """In-place ring reduce-scatter of the 1-D contiguous ``flat`` over ``comm``.

    Afterwards chunk ``(rank + 1) % P`` of ``flat`` holds the sum over all ranks
    (other chunks hold partial sums). Returns that chunk's index.
    ``work`` is an optional receive workspace of at least ``ceil(N / P)`` items.
    ``flat`` must have the same length and dtype on every rank: a rank where it does
    not (or any local check fails) makes every rank raise, before anything is sent.
    """
    comm = _agree_flat("ring_reduce_scatter", flat, comm, work)
    return ring_reduce_scatter_unchecked(flat, comm, work)


def ring_reduce_scatter_unchecked(flat, comm, work=None, src=None) -> int:
    """:func:`ring_reduce_scatter` without the checks and the agreement (library use).

    With ``src`` (a buffer like ``flat``), this rank's contribution is read from
    ``src`` and the partial sums are written to ``flat``, which need not be
    initialised: every chunk but this rank's own is written (its first write fuses
    the copy into the add), so an out-of-place all-reduce makes no separate copy.
    In place on a staged path below half the all-reduce's limit
    (:meth:`~summasim.comm.Comm.staged_whole`), the steps run on one host copy of
    ``flat``, copied back whole.
    """
    comm = as_comm(comm, name="ring")
    p, r = comm.size, comm.rank
    src = flat if src is None else src
    if p == 1:
        if src is not flat:
            flat[...] = src
        return 0
    if src is flat and comm.staged_whole(flat, "reduce_scatter"):
        _on_host_copy(flat, flat, comm, ring_reduce_scatter_unchecked)
        return (r + 1) % p
    bounds = _bounds(flat.shape[0], p)
    if work is None:
        work = comm.workspace("ring.recv", flat[: bounds[0][1] - bounds[0][0]], 1)[0]
    step, finish = comm.exchanger(flat, work.itemsize * work.shape[0])
    _reduce_scatter_steps(flat, src, bounds, r, p, work, step, _xp(flat).add)
    finish()
    return (r + 1) % p


def _on_host_copy(src, dst, comm, run) -> None:
    """``run(host, twin)`` on one pinned host copy of the staged array ``src``, then the
    copy back into ``dst`` whole, on the communicator's host twin: below
    :attr:`~summasim.comm.Comm.stage_whole_limit`, two whole copies cost less than a
    copy each way and a stream wait at every ring step (docs/gpu.md). Should the ring
    raise, ``dst`` is left as it was (the per-step path would leave partial sums)."""
    cleanup: list = []
    try:
        host = comm.stage_in(src, cleanup)
        run(host, comm.host_twin())
        comm.stage_back(host, dst)
    finally:
        for fn in cleanup:            # the staging buffer back to the pool, even on error
            fn()


def _reduce_scatter_steps(flat, src, bounds, r, p, work, sendrecv, add):
    """The P-1 reduce-scatter steps (see the module doc); ``sendrecv`` from
    :meth:`~summasim.comm.Comm.exchanger`, ``add`` the array library's."""
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        # pass the growing partial sum of one chunk one step round the ring
        s0, s1 = bounds[(r - s) % p]
        r0, r1 = bounds[(r - s - 1) % p]
        recv = work[: r1 - r0]
        sendrecv((src if s == 0 else flat)[s0:s1], right, recv, left)
        add(src[r0:r1], recv, out=flat[r0:r1])


def _allgather_steps(flat, bounds, r, p, sendrecv):
    """The P-1 all-gather steps (see the module doc)."""
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        # forward the chunk completed last step, receive the next one in place
        s0, s1 = bounds[(r + 1 - s) % p]
        r0, r1 = bounds[(r - s) % p]
        sendrecv(flat[s0:s1], right, flat[r0:r1], left)


def ring_allgather(flat, comm):
    """In-place ring all-gather: rank r contributes chunk ``(r + 1) % P`` of ``flat``;
    afterwards every chunk on every rank holds its owner's data. Returns ``flat``.
    Checked and agreed like :func:`ring_reduce_scatter`."""
    comm = _agree_flat("ring_allgather", flat, comm)
    return ring_allgather_unchecked(flat, comm)


def ring_allgather_unchecked(flat, comm):
    """:func:`ring_allgather` without the checks and the agreement (library use); on a
    staged path below its limit (an eighth of the all-reduce's), on one host copy like
    the reduce-scatter."""
    comm = as_comm(comm, name="ring")
    p, r = comm.size, comm.rank
    if p == 1:
        return flat
    if comm.staged_whole(flat, "allgather"):
        _on_host_copy(flat, flat, comm, ring_allgather_unchecked)
        return flat
    bounds = _bounds(flat.shape[0], p)
    step, finish = comm.exchanger(flat, flat.itemsize * (bounds[0][1] - bounds[0][0]))
    _allgather_steps(flat, bounds, r, p, step)
    finish()
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
        Result buffer shaped like ``x``, writable: ``x`` itself (or a view of exactly
        its items) for an in-place sum, else sharing no memory with ``x``. It need not
        be contiguous (a non-contiguous one gets the sum copied in at the end).

    Returns
    -------
    array
        The element-wise sum, shaped like ``x``.

    Raises
    ------
    TypeError, ValueError
        On every rank alike, before anything is sent, when ``x`` or ``out`` is bad on
        any rank or the ranks disagree on the shape or dtype of ``x``.

    Notes
    -----
    Per rank: 2(P-1) sendrecvs of about N/P items (see the module docstring).
    """
    comm = as_comm(comm, name="ring")
    _, err = local_error(_check_allreduce, x, out)
    agree("ring_allreduce", comm, lambda: {"dtype": dtype_of(x), "shape of x": shape_of(x)},
          err)
    if out is not None and not out.flags.c_contiguous:   # e.g. in place on a transposed x
        out[...] = ring_allreduce_unchecked(x, comm)
        return out
    return ring_allreduce_unchecked(x, comm, out)


def _check_allreduce(x, out):
    """The local checks of :func:`ring_allreduce`."""
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu":
        raise TypeError(f"ring_allreduce: expected a numeric array, got {dtype_of(x)}")
    if out is None:
        return
    if out is x:                       # in place: nothing to overlap, only the flag
        if not getattr(out.flags, "writeable", True):
            raise ValueError("ring_allreduce: out is read-only")
        return
    if getattr(out, "shape", None) != x.shape or getattr(out, "dtype", None) != x.dtype:
        raise ValueError("ring_allreduce: out must have the shape and dtype of x")
    if type(out) is not type(x):
        array_module(out, x)         # raises TypeError on mixed host/device arrays
    # a view of exactly x's items (in place) or apart; a partial overlap would be read
    # after it was written
    check_writable_apart("ring_allreduce", out, (x,), ("x",), allow_same=True)


def ring_allreduce_unchecked(x, comm, out=None):
    """:func:`ring_allreduce` without the checks and the agreement, for library callers
    that checked and agreed on their inputs (summa25_atb's depth sum, the schemes).
    Out of place, the copy of ``x`` is fused into the reduce-scatter's adds. The two
    halves share one chunk table, one receive workspace and one exchange function
    (per-call Python is on the critical path of every small all-reduce)."""
    comm = as_comm(comm, name="ring")
    xp = _xp(x)
    if out is None:
        out = xp.empty(x.shape, dtype=x.dtype)
    flat = out.reshape(-1)
    src = flat if out is x else xp.ascontiguousarray(x).reshape(-1)
    p, r = comm.size, comm.rank
    if p > 1 and comm.staged_whole(src):
        # a small sum on a staged MPI path: the same ring on one pinned host copy
        _on_host_copy(src, flat, comm, lambda h, twin: ring_allreduce_unchecked(h, twin, out=h))
        return out
    if p == 1:
        if src is not flat:
            flat[...] = src
        return out
    bounds = _bounds(flat.shape[0], p)
    work = comm.workspace("ring.recv", flat[: bounds[0][1] - bounds[0][0]], 1)[0]
    step, finish = comm.exchanger(flat, work.itemsize * work.shape[0])
    _reduce_scatter_steps(flat, src, bounds, r, p, work, step, xp.add)
    finish()     # the all-gather receives into the chunks the reduce-scatter sent
    _allgather_steps(flat, bounds, r, p, step)
    finish()
    return out
