"""SUMMA on a q x q or pr x pc grid: C = AB, C = AB^T and C = A^T B (Optimus
Algorithms 1-3).

All three take and return blocks in the ``"2d"`` layout: rank ``(i, j)`` holds
``A[I_i, J_j]``, ``B[I_i, J_j]`` and gets ``C[I_i, J_j]``. On a ``[q, q, d]`` grid
with ``d > 1`` every layer runs the same product on its own row and column groups.

Any sizes, any grid
-------------------
A size that does not divide its grid dimension is cut into the balanced partition
(:mod:`summasim.layout`: the first ``size mod blocks`` blocks one larger), and the grid
may be rectangular (``Grid(comm, pr, pc=pc)``; ScaLAPACK's PxGEMM does the same). Each
form steps over one dimension, which two operands cut differently on such a grid: ab
over k (A's columns in pc blocks, B's rows in pr blocks), abt over n (B's rows in pr,
C's columns in pc), atb over m (A's columns in pc, C's rows in pr). A step is a piece
of the merged cut (:func:`segments`), inside one block of each, so it has one owner
for the broadcast and one root for the reduce: q steps of whole blocks on a square
grid with even sizes, at most ``pr + pc - 1`` steps otherwise. A piece that is part of
a block's columns is packed into the workspace before its broadcast (A in ab and atb)
or copied out of it after its reduce (C in abt); pieces of rows are sent as they lie.

The three products are closed under differentiation (Optimus eqs. 1-3). For
``C = A B``::

    dA = dC B^T  -> summa_abt(dC, B, grid)
    dB = A^T dC  -> summa_atb(A, dC, grid)

and for ``C = A B^T``: ``dA = dC B = summa_ab(dC, B)``, ``dB = dC^T A = summa_atb(dC, A)``;
for ``C = A^T B``: ``dA = B dC^T = summa_abt(B, dC)``, ``dB = A dC = summa_ab(A, dC)``.

What every rank sends (per call, square grid, sizes that divide; otherwise one
broadcast or reduce per step, of the step's piece:
:func:`summasim.costmodel.workload.traffic.algorithm_events`)
--------------------------------------------------------------------
``summa_ab``  (A [m, k], B [k, n]): q broadcasts on ``grid.row`` of an
              (m/q) x (k/q) A block and q broadcasts on ``grid.col`` of a
              (k/q) x (n/q) B block.
``summa_abt`` (A [m, k], B [n, k]): q broadcasts on ``grid.col`` of an
              (n/q) x (k/q) B block and q sum-reduces on ``grid.row`` of an
              (m/q) x (n/q) partial C block.
``summa_atb`` (A [k, m], B [k, n]): q broadcasts on ``grid.row`` of a
              (k/q) x (m/q) A block and q sum-reduces on ``grid.col`` of an
              (m/q) x (n/q) partial C block.

Groups of one rank (q = 1) communicate nothing. Each call takes two receive
workspaces per broadcast operand and, for the reducing forms, two partial product
buffers, from :meth:`~summasim.comm.Comm.workspace` (kept on the communicator, so
repeated calls of one shape allocate nothing), and reuses them for all q steps: the broadcast of step l+1 is
posted before the multiply of step l (double buffering), and each reduce is
posted without waiting so it proceeds under the next multiply.

Checks
------
Each public function checks its own arguments, then agrees with the other ranks of
the grid (one small untraced collective, :mod:`summasim.algorithms._common`): input
that is bad on any one rank raises the same ``ValueError``/``TypeError`` on every
rank before anything is sent. The ``*_unchecked`` twins skip both, for library
callers that have checked and agreed already.

References
----------
R. A. van de Geijn and J. Watts, "SUMMA: Scalable Universal Matrix Multiplication
Algorithm", Concurrency: Practice and Experience 9(4), 1997.
Q. Xu, S. Li, C. Gong, Y. You, "An Efficient 2D Method for Training Super-Large
Deep Learning Models" (Optimus), 2021, Algorithms 1-3.
"""

from __future__ import annotations

from ..backends import backend_of
from ..spec import partition
from ._common import check_blocks, contiguous

_LAYOUTS_2D = ("2d", "2d", "2d")


def parts_of(form: str, sizes: dict, grid) -> tuple[list[int], list[int]]:
    """The two cuts of the dimension a form steps over (its ``kparts``, ``nparts`` or
    ``mparts``), from the global sizes on a ``[pr, pc, d]`` grid: ab steps over k (A's
    columns over pc, B's rows over pr), abt over n (B's rows over pr, C's columns over
    pc), atb over m (A's columns over pc, C's rows over pr)."""
    dim = {"ab": "k", "abt": "n", "atb": "m"}[form]
    first, second = (grid.pc, grid.pr) if form != "abt" else (grid.pr, grid.pc)
    return partition(sizes[dim], first), partition(sizes[dim], second)


def run_checked(fn: str, form: str, kernel, a, b, grid, out, sizes, layouts=_LAYOUTS_2D):
    """Check (any sizes, any grid), then run ``kernel(a, b, row, col, backend, out,
    cuts)`` over the grid's row and column groups with the cuts of :func:`parts_of`
    (a kernel that needs more of the grid takes it bound: summa25_atb's depth)."""
    be, found = check_blocks(fn, form, a, b, grid, out, layouts, sizes)
    return kernel(contiguous(a), contiguous(b), grid.row, grid.col, be, out,
                  parts_of(form, found, grid))


def segments(first: list[int], second: list[int]) -> list[tuple[int, int, int, int]]:
    """The steps of SUMMA over one dimension cut two ways: ``[(lo, hi, x, y)]``, the
    pieces of the merged partition, each inside block ``x`` of ``first`` and block ``y``
    of ``second`` (both offset lists of one length; empty pieces are left out).

    On a square grid with even blocks the two cuts agree and the steps are the q
    blocks; on a ``pr x pc`` grid, or with uneven blocks, a step is where both owners
    stay the same, at most ``pr + pc - 1`` of them.
    """
    cuts = sorted(set(first) | set(second))
    out, x, y = [], 0, 0
    for lo, hi in zip(cuts, cuts[1:]):
        while first[x + 1] <= lo:
            x += 1
        while second[y + 1] <= lo:
            y += 1
        out.append((lo, hi, x, y))
    return out


def even_offsets(block: int, parts: int) -> list[int]:
    """Offsets of ``parts`` blocks of ``block`` items each."""
    return [t * block for t in range(parts + 1)]


class _Done:
    """The request of an operation on a group of one rank: nothing to wait for."""

    @staticmethod
    def wait():
        return None


def _ibcast(group, buf, root):
    """``group.ibcast``; a group of one rank sends nothing (and records nothing)."""
    return group.ibcast(buf, root=root) if group.size > 1 else _Done


def _ireduce(group, send, recv, root):
    """``group.ireduce``; on a group of one rank the sum is the rank's own piece."""
    if group.size > 1:
        return group.ireduce(send, recv, root=root)
    recv[...] = send
    return _Done


def _flat(ws, slot, shape):
    """A C-contiguous ``shape`` view at the front of workspace buffer ``slot``."""
    n = shape[0] * shape[1]
    return ws[slot][:n].reshape(shape)


def _summa_ab(a, b, row, col, be, out=None, kparts=None):
    """C_ij = sum_l A_il B_lj over the given row and column groups.

    ``kparts``: the offsets of k as A's columns are cut (over the row group) and as B's
    rows are cut (over the column group); even blocks when not given."""
    xp = be.xp
    mb, nb = a.shape[0], b.shape[1]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if row.size == 1 and col.size == 1:
        return be.gemm(a, b, c)
    ka, kb = kparts or (even_offsets(a.shape[1], row.size), even_offsets(b.shape[0], col.size))
    steps = segments(ka, kb)
    if not steps:                                  # k = 0: C = 0
        c[...] = 0
        return c
    wa = max(hi - lo for lo, hi, _, _ in steps)
    abuf = row.workspace("summa.a", a, shape=(mb * wa,))                    # 2 x (m/q, k/q)
    bbuf = col.workspace("summa.b", b, shape=(wa * nb,))                    # 2 x (k/q, n/q)

    def post(l):
        # step l: A[:, lo:hi] travels along the row from its owner column, B[lo:hi, :]
        # down the column from its owner row
        lo, hi, ja, ib = steps[l]
        s, w = l % 2, hi - lo
        if row.rank == ja:
            a0 = lo - ka[ja]
            ab = a if w == a.shape[1] else _flat(abuf, s, (mb, w))
            if ab is not a:
                ab[...] = a[:, a0:a0 + w]
        else:
            ab = _flat(abuf, s, (mb, w))
        if col.rank == ib:
            bb = b[lo - kb[ib]:hi - kb[ib]]          # whole rows: contiguous
        else:
            bb = _flat(bbuf, s, (w, nb))
        return ab, bb, (_ibcast(row, ab, ja), _ibcast(col, bb, ib))

    nxt = post(0)
    for l in range(len(steps)):
        ab, bb, reqs = nxt
        for r in reqs:
            r.wait()
        if l + 1 < len(steps):  # overlap the next broadcast with this multiply
            nxt = post(l + 1)
        be.gemm(ab, bb, c, accumulate=l > 0)
    return c


def _summa_abt(a, b, row, col, be, out=None, nparts=None):
    """C_il = sum_j A_ij B_lj^T: broadcast B down columns, reduce partials along rows.

    ``nparts``: the offsets of n as B's rows are cut (over the column group) and as C's
    columns are cut (over the row group); even blocks when not given."""
    xp = be.xp
    mb = a.shape[0]
    nbp, ncp = nparts or (even_offsets(b.shape[0], col.size),
                          even_offsets(b.shape[0] * col.size // row.size, row.size))
    nb = ncp[row.rank + 1] - ncp[row.rank]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if row.size == 1 and col.size == 1:
        return be.gemm(a, b, c, trans_b=True)
    steps = segments(nbp, ncp)
    w = max((hi - lo for lo, hi, _, _ in steps), default=0)
    bbuf = col.workspace("summa.b", b, shape=(w * b.shape[1],))              # 2 x (n/q, k/q)
    part = row.workspace("summa.part", c, shape=(mb * w,))                  # 2 x (m/q, n/q)
    staged = any(jc == row.rank and hi - lo != nb for lo, hi, _, jc in steps)
    red = row.workspace("summa.red", c, shape=(mb * w,)) if staged else None

    def bcast_buf(l):
        lo, hi, ib, _ = steps[l]
        if col.rank == ib:
            return b[lo - nbp[ib]:hi - nbp[ib]]      # whole rows: contiguous
        return _flat(bbuf, l % 2, (hi - lo, b.shape[1]))

    def dest(l):
        # the root's piece of C is a column slice: reduced into a buffer, then copied
        lo, hi, _, jc = steps[l]
        if row.rank != jc:
            return None, None
        if hi - lo == nb:
            return c, None
        c0 = lo - ncp[jc]
        return _flat(red, l % 2, (mb, hi - lo)), c[:, c0:c0 + hi - lo]

    return _bcast_multiply_reduce(
        steps, bcast_buf, col,
        lambda bb, l: _flat(part, l % 2, (mb, bb.shape[0])),
        lambda bb, t: be.gemm(a, bb, t, trans_b=True), row, dest, c)


def _summa_atb(a, b, row, col, be, out=None, mparts=None):
    """C_lj = sum_i A_il^T B_ij: broadcast A along rows, reduce partials down columns.

    ``mparts``: the offsets of m as A's columns are cut (over the row group) and as C's
    rows are cut (over the column group); even blocks when not given."""
    xp = be.xp
    nb = b.shape[1]
    map_, mcp = mparts or (even_offsets(a.shape[1], row.size),
                           even_offsets(a.shape[1] * row.size // col.size, col.size))
    mb = mcp[col.rank + 1] - mcp[col.rank]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if row.size == 1 and col.size == 1:
        return be.gemm(a, b, c, trans_a=True)
    steps = segments(map_, mcp)
    w = max((hi - lo for lo, hi, _, _ in steps), default=0)
    kb = a.shape[0]
    abuf = row.workspace("summa.a", a, shape=(kb * w,))                     # 2 x (k/q, m/q)
    part = col.workspace("summa.part", c, shape=(w * nb,))                  # 2 x (m/q, n/q)

    def bcast_buf(l):
        lo, hi, ja, _ = steps[l]
        ab = _flat(abuf, l % 2, (kb, hi - lo))
        if row.rank == ja:
            if hi - lo == a.shape[1]:
                return a
            ab[...] = a[:, lo - map_[ja]:hi - map_[ja]]
        return ab

    def dest(l):
        lo, hi, _, ic = steps[l]
        if col.rank != ic:
            return None, None
        return c[lo - mcp[ic]:hi - mcp[ic]], None    # whole rows: contiguous

    return _bcast_multiply_reduce(
        steps, bcast_buf, row,
        lambda ab, l: _flat(part, l % 2, (ab.shape[1], nb)),
        lambda ab, t: be.gemm(ab, b, t, trans_a=True), col, dest, c)


def _bcast_multiply_reduce(steps, bcast_buf, bgroup, partial, multiply, rgroup, dest, c):
    """Shared loop of Algorithms 2 and 3: for each step ``(lo, hi, x, y)``, broadcast
    operand piece ``bcast_buf(l)`` over ``bgroup`` from rank x, multiply into a partial
    product ``partial(buf, l)``, sum-reduce it over ``rgroup`` to rank y, into
    ``dest(l) = (receive buffer, where it is copied afterwards or None)``."""
    if not steps:           # the dimension the steps cut is 0: C's block is empty
        return c
    pending = [None, None]  # (reduce in flight, copy after it) per partial buffer

    def post(l):
        buf = bcast_buf(l)
        return buf, _ibcast(bgroup, buf, steps[l][2])

    def finish(s):
        req, copy = pending[s]
        req.wait()
        if copy is not None:
            copy[1][...] = copy[0]
        pending[s] = None

    nxt = post(0)
    for l in range(len(steps)):
        buf, req = nxt
        req.wait()
        if l + 1 < len(steps):  # overlap the next broadcast with this multiply
            nxt = post(l + 1)
        s = l % 2
        if pending[s] is not None:  # the partial buffer of step l-2 must be sent first
            finish(s)
        t = partial(buf, l)
        multiply(buf, t)
        recv, to = dest(l)
        pending[s] = (_ireduce(rgroup, t, recv, steps[l][3]),
                      (recv, to) if to is not None else None)
    for s in (0, 1):
        if pending[s] is not None:
            finish(s)
    return c


def summa_ab(a, b, grid, out=None, *, sizes=None):
    """C = A B on a q x q or pr x pc grid (SUMMA, Optimus Algorithm 1).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of the global A [m, k] (``"2d"`` layout).
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of the global B [k, n].
    grid : summasim.grid.Grid
    out : array, shape (m/q, n/q), optional
        Where to write ``C[M_i, N_j]``.
    sizes : (m, k, n), keyword-only, optional
        The global sizes. Blocks may be uneven (the balanced partition; shapes above
        are for sizes that divide). Without ``sizes`` one small all-gather of the block
        shapes finds them, with ``sizes`` each rank checks its own blocks.

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A B.

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (m/q)(k/q) items and q broadcasts on
    ``grid.col`` of (k/q)(n/q) items; 2 m n k / q^2 flops.
    """
    return run_checked("summa_ab", "ab", _summa_ab, a, b, grid, out, sizes)


def summa_ab_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa_ab` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa_ab(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                      parts)


def summa_abt(a, b, grid, out=None, *, sizes=None):
    """C = A B^T on a q x q or pr x pc grid (Optimus Algorithm 2).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of A [m, k].
    b : array, shape (n/q, k/q)
        Block ``B[N_i, K_j]`` of B [n, k].
    grid : summasim.grid.Grid
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes (see :func:`summa_ab`).

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A B^T.

    Notes
    -----
    Per rank: q broadcasts on ``grid.col`` of (n/q)(k/q) items and q sum-reduces on
    ``grid.row`` of (m/q)(n/q) items.
    """
    return run_checked("summa_abt", "abt", _summa_abt, a, b, grid, out, sizes)


def summa_abt_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa_abt` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa_abt(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                      parts)


def summa_atb(a, b, grid, out=None, *, sizes=None):
    """C = A^T B on a q x q or pr x pc grid (Optimus Algorithm 3).

    Parameters
    ----------
    a : array, shape (k/q, m/q)
        Block ``A[K_i, M_j]`` of A [k, m].
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of B [k, n].
    grid : summasim.grid.Grid
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes (see :func:`summa_ab`).

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A^T B.

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (k/q)(m/q) items and q sum-reduces on
    ``grid.col`` of (m/q)(n/q) items.
    """
    return run_checked("summa_atb", "atb", _summa_atb, a, b, grid, out, sizes)


def summa_atb_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa_atb` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa_atb(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                      parts)
