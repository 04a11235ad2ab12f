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

Non-blocking
------------
:func:`ring_start` starts the same ring (a reduce-scatter, an all-gather or both) as a
:class:`RingInFlight` that never waits until asked: :meth:`RingInFlight.progress`
completes the steps whose messages have arrived and posts the next ones, and returns at
once; :meth:`RingInFlight.wait` finishes the ring. A caller that computes meanwhile
calls ``progress`` between pieces of its work (the sharded trainer does, after each
backward piece: the data-parallel reduction overlaps the backward, as PyTorch DDP's
buckets do, Li et al. 2020, section 3.2.3). The steps, chunks and additions are those
of the blocking ring, so the result is bitwise the same, and each step is traced as
the same "sendrecv" event of the same bytes (its phase that of the start).

References
----------
P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2), 2009.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from ..backends import array_module
from ..comm import NAP_AFTER_POLLS, as_comm
from ..mpiutil import SLEEP_S
from ._common import (agree, check_native, check_writable_apart, dtype_of, local_error, no_blas,
                      shape_of)


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
    return np if isinstance(x, np.ndarray) else array_module(x)


def _plain(a):
    """A host ndarray subclass (``np.memmap``, ``np.matrix``) as a plain ndarray view of
    the same memory; anything else as it is. The ring runs on plain arrays: a matrix
    reshapes to 2-D, and every rank must take the same path whatever its caller passed."""
    return a.view(np.ndarray) if isinstance(a, np.ndarray) and type(a) is not np.ndarray else a


def _flat(x, fn):
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu" or no_blas(x.dtype):
        raise TypeError(f"{fn}: expected a numeric array, got {dtype_of(x)}"
                        f"{no_blas(getattr(x, 'dtype', None))}")
    check_native(fn, "flat", x)
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
    return ring_reduce_scatter_unchecked(_plain(flat), comm, _plain(work))


def ring_reduce_scatter_unchecked(flat, comm, work=None, src=None, add=None,
                                  bounds=None) -> int:
    """:func:`ring_reduce_scatter` without the checks and the agreement (library use).

    ``bounds``: the P chunks ``[(start, stop)]`` (in order, tiling ``flat``) where they
    are not the near-equal ones of :func:`chunk_bounds` (mm3d's C: row-aligned pieces of
    the nested partition); the steps are the same, each sends its chunk of ``bounds``
    and ``work`` (when given) needs room for the largest.

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
        _on_host_copy(flat, flat, comm, lambda h, twin: ring_reduce_scatter_unchecked(
            h, twin, add=add, bounds=bounds))
        return (r + 1) % p
    if bounds is None:
        bounds = _bounds(flat.shape[0], p)
    widest = max(hi - lo for lo, hi in bounds)
    if work is None:
        work = comm.workspace("ring.recv", flat[:widest], 1)[0]
    # the step's size from the chunks, never from ``work``: a larger ``work`` on one
    # rank must not change the size class, whose trials every rank runs alike
    step, finish = comm.ring_exchanger(flat, flat.itemsize * widest, ring_trial)
    _reduce_scatter_steps(flat, src, bounds, r, p, work, step, add or _xp(flat).add)
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


def ring_trial(like, nbytes: int, p: int, r: int):
    """One trial ring of :mod:`summasim.ringwait`: ``run(step, finish)`` all-reduces p
    chunks of ``nbytes`` of zeros (``like``'s dtype) on scratch buffers with the given
    exchanger pair, as a ring call of that size class does (both halves, a ``finish``
    after each)."""
    n = max(1, nbytes // like.itemsize)
    scratch, work = np.zeros(n * p, like.dtype), np.empty(n, like.dtype)
    bounds = _bounds(n * p, p)

    def run(step, finish):
        _reduce_scatter_steps(scratch, scratch, bounds, r, p, work, step, np.add)
        finish()
        _allgather_steps(scratch, bounds, r, p, step)
        finish()
    return run


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
    ring_allgather_unchecked(_plain(flat), comm)
    return flat


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
    step, finish = comm.ring_exchanger(flat, flat.itemsize * (bounds[0][1] - bounds[0][0]),
                                       ring_trial)
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
        The element-wise sum, shaped like ``x``: ``out`` itself when given (an
        ``np.memmap`` or ``np.matrix`` included), else a new plain array.

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
    return ring_allreduce_unchecked(x, comm, out)       # (subclasses: as plain views there)


def _check_allreduce(x, out):
    """The local checks of :func:`ring_allreduce`."""
    if not hasattr(x, "dtype") or x.dtype.kind not in "fciu" or no_blas(x.dtype):
        raise TypeError(f"ring_allreduce: expected a numeric array, got {dtype_of(x)}"
                        f"{no_blas(getattr(x, 'dtype', None))}")
    check_native("ring_allreduce", "x", x)
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


#: The plain call's result pool (:func:`_fresh_result`): buffers of at least
#: :data:`POOL_MIN_BYTES`, at most :data:`POOL_PER_SIZE` of one size and
#: :data:`POOL_MAX_BYTES` in all.
POOL_MIN_BYTES = 1 << 20
POOL_PER_SIZE = 2
POOL_MAX_BYTES = 512 << 20
_result_pool: list = []           # [buffer], oldest first


def _refs_when_free() -> int:
    """What ``sys.getrefcount`` says of a pooled buffer's owner that only the pool's
    view holds, read as :func:`_fresh_result` reads it. Measured, not assumed: whether
    the call's own argument and a loop's variable count differs between CPython
    versions, and a count one too low would hand out an array the caller still holds."""
    pool = [np.empty(2)[:1]]
    for buf in pool:
        return sys.getrefcount(buf.base)
    raise AssertionError("unreachable")  # pragma: no cover


_FREE_REFS = _refs_when_free()


def _fresh_result(x, xp):
    """The result of an all-reduce called without ``out``.

    A fresh host array pays for its first touch inside the ring's adds, on the critical
    path of every step: the plain call ``ring_allreduce(x, comm)`` took 1.34-1.42 s at
    p = 16 and 64 MiB against 0.49-0.62 s into a given ``out`` (the page faults and the
    kernel's zeroing of a fresh 64 MiB on every rank; transparent huge pages did not
    change it). So host results of at least :data:`POOL_MIN_BYTES` come from a pool of
    earlier results that the caller has dropped. The pool keeps a view of each buffer
    and hands out new views of it; every view of a view keeps the buffer's owning array
    as its ``base`` (NumPy collapses the chain), so the owner's reference count
    (``sys.getrefcount``) is the pool's view plus one per array the caller can still
    reach. A buffer is handed out again only when that count is the pool's alone: no
    array the caller holds is ever reused. The pool keeps at most :data:`POOL_PER_SIZE` buffers of one
    size and :data:`POOL_MAX_BYTES` in all (the oldest go first); that memory stays
    allocated after the caller drops it, the price of the reuse."""
    nbytes = x.size * x.dtype.itemsize
    if xp is not np or nbytes < POOL_MIN_BYTES:
        return xp.empty(x.shape, dtype=x.dtype)
    for i, buf in enumerate(_result_pool):
        # as many references as when the pool's view alone holds the owner: nobody else
        if (buf.dtype == x.dtype and buf.size == x.size
                and sys.getrefcount(buf.base) <= _FREE_REFS):
            _result_pool.append(_result_pool.pop(i))          # most recently used last
            return buf.reshape(x.shape)
    from ..backends.numpy_backend import empty_huge

    buf = empty_huge(x.size, x.dtype)
    if not isinstance(buf.base, np.ndarray):      # np.empty's own array: view it, so that
        buf = buf.view()                          # the owner is distinct from the pool's view
    same = [i for i, b in enumerate(_result_pool) if b.dtype == x.dtype and b.size == x.size]
    if len(same) >= POOL_PER_SIZE:
        del _result_pool[same[0]]                 # by position: == on arrays compares items
    _result_pool.append(buf)
    while sum(b.nbytes for b in _result_pool) > POOL_MAX_BYTES and len(_result_pool) > 1:
        _result_pool.pop(0)
    return buf.reshape(x.shape)


def ring_allreduce_unchecked(x, comm, out=None, add=None):
    """:func:`ring_allreduce` without the checks and the agreement, for library callers
    that checked and agreed on their inputs (summa25_atb's depth sum, the schemes).
    Out of place, the copy of ``x`` is fused into the reduce-scatter's adds. The two
    halves share one chunk table, one receive workspace and one exchange function
    (per-call Python is on the critical path of every small all-reduce). ``add``: as in
    :func:`ring_reduce_scatter_unchecked`."""
    comm = as_comm(comm, name="ring")
    xp = _xp(x)
    given, same = out, out is x
    x = _plain(x)
    out = x if same else _plain(out)
    if out is None:
        out = _fresh_result(x, xp)
    elif out is not given:       # a subclass: the sum lands in its memory, returned as given
        ring_allreduce_unchecked(x, comm, out, add)
        return given
    flat = out.reshape(-1)
    src = flat if out is x else xp.ascontiguousarray(x).reshape(-1)
    p, r = comm.size, comm.rank
    if p > 1 and comm.staged_whole(src):
        # a small sum on a staged MPI path: the same ring on one pinned host copy
        _on_host_copy(src, flat, comm, lambda h, twin: ring_allreduce_unchecked(
            h, twin, out=h, add=add))
        return out
    if p == 1:
        if src is not flat:
            flat[...] = src
        return out
    bounds = _bounds(flat.shape[0], p)
    widest = bounds[0][1] - bounds[0][0]
    work = comm.workspace("ring.recv", flat[:widest], 1)[0]
    step, finish = comm.ring_exchanger(flat, flat.itemsize * widest, ring_trial)
    _reduce_scatter_steps(flat, src, bounds, r, p, work, step, add or xp.add)
    finish()     # the all-gather receives into the chunks the reduce-scatter sent
    _allgather_steps(flat, bounds, r, p, step)
    finish()
    return out


# --------------------------------------------------------------------------- #
# the non-blocking ring                                                       #
# --------------------------------------------------------------------------- #
#: The first tag of the non-blocking rings' messages: apart from the blocking ring's 0,
#: so a blocking ring on the same communicator (a ZeRO-3 gather) never takes one of
#: them. Rings in flight together on one communicator need tags of their own (the
#: sharded trainer's are ``NONBLOCKING_TAG + k`` for k < its ``OVERLAP_RINGS``), and
#: every rank must start them in the same order.
NONBLOCKING_TAG = 1
HALVES = ("rs", "ag", "ar")


class RingInFlight:
    """A ring reduce-scatter ("rs"), all-gather ("ag") or all-reduce ("ar") of the 1-D
    host buffer ``flat``, in place, in flight (see :func:`ring_start`).

    Each step posts ``MPI_Irecv`` from the left neighbour and ``MPI_Isend`` to the right;
    :meth:`progress` tests the receive, adds it in (reduce-scatter) and posts the next
    step as long as receives have arrived, and never waits. The sends are completed
    together before the all-gather half (whose receives overwrite the chunks the
    reduce-scatter sent) and at the end. ``on_done`` callables run once, when the ring
    has finished; ``done`` says whether it has.

    Each step is recorded as one "sendrecv" of its send's bytes when its receive has
    arrived (``blocking=True``, the kind of the exchanger's steps: a receive polled, the
    sends completed at the end), in the phase the ring started in, with the seconds
    this rank spent in the step's own calls (posting, testing, adding, waiting), not
    the wall time it was in flight: what the ring cost the rank, the overlap excluded.
    """

    __slots__ = ("flat", "comm", "work", "tag", "phase", "plan", "i", "req", "sends",
                 "spent", "on_done", "done", "bounds", "_xp", "_nap", "_add")

    def __init__(self, flat, comm, half: str, work, tag: int, phase: str, add=None):
        p = comm.size
        self.flat, self.comm, self.work, self.tag, self.phase = flat, comm, work, tag, phase
        self.bounds = _bounds(flat.shape[0], p)
        steps = {"rs": [("rs", s) for s in range(p - 1)],
                 "ag": [("ag", s) for s in range(p - 1)]}
        self.plan = steps["rs"] + steps["ag"] if half == "ar" else steps[half]
        self.i, self.req, self.sends, self.spent = 0, None, [], 0.0
        self.on_done: list = []
        self.done = False
        self._xp = _xp(flat)
        self._add = add or self._xp.add
        chunk = flat.itemsize * (self.bounds[0][1] - self.bounds[0][0])
        self._nap = comm.wait_policy != "spin" and chunk >= comm.nap_limit
        t0 = time.perf_counter()
        self._post()
        self.spent += time.perf_counter() - t0

    def _chunks(self):
        """``(send slice, receive slice)`` of the current step (see the module doc)."""
        p, r = self.comm.size, self.comm.rank
        half, s = self.plan[self.i]
        if half == "rs":
            return self.bounds[(r - s) % p], self.bounds[(r - s - 1) % p]
        return self.bounds[(r + 1 - s) % p], self.bounds[(r - s) % p]

    def _post(self) -> None:
        """Post the current step, or finish the ring when every step is done."""
        if self.i == len(self.plan):
            if MPI.Request.Testall(self.sends):
                self._finish()
            return
        half, s = self.plan[self.i]
        if half == "ag" and s == 0 and self.sends:
            # the all-gather receives into the chunks the reduce-scatter sent
            if not MPI.Request.Testall(self.sends):
                return
            self.sends = []
        mpi, p, r = self.comm.mpi, self.comm.size, self.comm.rank
        (s0, s1), (r0, r1) = self._chunks()
        recv = self.work[: r1 - r0] if half == "rs" else self.flat[r0:r1]
        self.req = mpi.Irecv(recv, (r - 1) % p, self.tag)
        self.sends.append(mpi.Isend(self.flat[s0:s1], (r + 1) % p, self.tag))

    def _complete_step(self, t0: float) -> None:
        """The current step's receive has arrived: add it in, record it, go on."""
        half, _ = self.plan[self.i]
        (s0, s1), (r0, r1) = self._chunks()
        if half == "rs":
            dst = self.flat[r0:r1]
            self._add(dst, self.work[: r1 - r0], out=dst)
        self.req = None
        self.i += 1
        trace = self.comm.trace
        if trace.enabled:
            trace.record("sendrecv", self.comm.name, self.comm.size, -1,
                         (s1 - s0) * self.flat.itemsize,
                         self.spent + time.perf_counter() - t0, phase=self.phase,
                         blocking=True)
        self.spent = 0.0

    def _finish(self) -> None:
        self.sends = []
        self.done = True
        for fn in self.on_done:
            fn()

    def progress(self) -> bool:
        """Complete every step whose receive has arrived and post the next; never waits.
        Returns :attr:`done`."""
        t0 = time.perf_counter()
        while not self.done:
            if self.req is None:
                self._post()
                if self.req is None:            # sends still out (or just finished)
                    break
            if not self.req.Test():
                break
            self._complete_step(t0)
            t0 = time.perf_counter()
        self.spent += time.perf_counter() - t0
        return self.done

    def wait(self) -> None:
        """Finish the ring, waiting as the communicator's exchanger does: a blocking
        wait under "spin", else each receive polled with ``sched_yield`` (napping after
        a few polls for long steps on a crowded node) and the sends completed at the
        end."""
        spin = self.comm.wait_policy == "spin"
        while not self.done:
            t0 = time.perf_counter()
            if self.req is None:
                self._post()
                if self.req is None and not self.done:       # sends still out
                    if spin:
                        MPI.Request.Waitall(self.sends)
                    else:
                        while not MPI.Request.Testall(self.sends):
                            os.sched_yield()
                self.spent += time.perf_counter() - t0
                continue
            if spin:
                self.req.Wait()
            else:
                polls = 0
                while not self.req.Test():
                    polls += 1
                    if self._nap and polls > NAP_AFTER_POLLS:
                        time.sleep(SLEEP_S)
                    else:
                        os.sched_yield()
            self._complete_step(t0)


def _done_ring(flat, comm, phase) -> RingInFlight:
    """A :class:`RingInFlight` that has finished (nothing left to send)."""
    ring = RingInFlight.__new__(RingInFlight)
    ring.flat, ring.comm, ring.phase, ring.on_done, ring.done = flat, comm, phase, [], True
    ring.plan, ring.i, ring.req, ring.sends, ring.spent = [], 0, None, [], 0.0
    return ring


def ring_start(flat, comm, half: str = "ar", work=None, tag: int = NONBLOCKING_TAG,
               phase: str | None = None, add=None) -> RingInFlight:
    """Start a ring ``half`` ("rs": reduce-scatter, "ag": all-gather, "ar": both, the
    all-reduce) of the 1-D contiguous ``flat`` over ``comm``, in place, and return it in
    flight (:class:`RingInFlight`); unchecked, for library callers that agreed on their
    inputs, like the ``*_unchecked`` functions.

    Afterwards (:meth:`RingInFlight.wait`, or :meth:`~RingInFlight.progress` until it
    returns True) ``flat`` holds what :func:`ring_reduce_scatter_unchecked`,
    :func:`ring_allgather_unchecked` or an in-place :func:`ring_allreduce_unchecked`
    leaves, bitwise. ``work``: a receive workspace of at least ``ceil(N / P)`` items of
    ``flat``'s dtype (reduce-scatter), held until the ring is done; one is allocated
    when None. ``phase``: the trace phase of the ring's steps (default: the current one).
    ``add``: as in :func:`ring_reduce_scatter_unchecked`.

    A device array, or any array whose path to MPI is not plain host memory, runs the
    blocking ring here, traced in the current phase, and comes back done (no progress
    engine for staged copies yet): the same result and the same traced steps, nothing
    overlapped. So does P == 1.
    """
    if half not in HALVES:
        raise ValueError(f"ring_start: half must be one of {', '.join(HALVES)}, got {half!r}")
    comm = as_comm(comm, name="ring")
    phase = comm.trace.current_phase if phase is None else phase
    p = comm.size
    be = comm.backend
    flat, work = _plain(flat), _plain(work)
    host = isinstance(flat, np.ndarray) and (be is None or getattr(be, "on_device", False)
                                         or be.comm_mode == "host")
    if p == 1 or not host:          # traced in the current phase, like any blocking ring
        if half == "rs":
            ring_reduce_scatter_unchecked(flat, comm, work, add=add)
        elif half == "ag":
            ring_allgather_unchecked(flat, comm)
        else:
            ring_allreduce_unchecked(flat, comm, out=flat, add=add)
        return _done_ring(flat, comm, phase)
    if work is None and half != "ag":
        work = np.empty(-(-flat.shape[0] // p), dtype=flat.dtype)
    return RingInFlight(flat, comm, half, work, tag, phase, add)
