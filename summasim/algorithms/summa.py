"""SUMMA on a q x q grid: C = AB, C = AB^T and C = A^T B (Optimus Algorithms 1-3).

All three take and return blocks in the ``"2d"`` layout: rank ``(i, j)`` holds
``A[I_i, J_j]``, ``B[I_i, J_j]`` and gets ``C[I_i, J_j]``. On a ``[q, q, d]`` grid
with ``d > 1`` every layer runs the same product on its own row and column groups.

The three products are closed under differentiation (Optimus eqs. 1-3). For
``C = A B``::

    dA = dC B^T  -> summa_abt(dC, B, grid)
    dB = A^T dC  -> summa_atb(A, dC, grid)

and for ``C = A B^T``: ``dA = dC B = summa_ab(dC, B)``, ``dB = dC^T A = summa_atb(dC, A)``;
for ``C = A^T B``: ``dA = B dC^T = summa_abt(B, dC)``, ``dB = A dC = summa_ab(A, dC)``.

What every rank sends (per call; ``mb x kb`` etc. are block shapes)
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
from ._common import check_product, contiguous


def _summa_ab(a, b, row, col, be, out=None):
    """C_ij = sum_l A_il B_lj over the given row and column groups."""
    q = row.size
    xp = be.xp
    mb, nb = a.shape[0], b.shape[1]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if q == 1:
        return be.gemm(a, b, c)
    abuf = row.workspace("summa.a", a)                                       # 2 x (m/q, k/q)
    bbuf = col.workspace("summa.b", b)                                       # 2 x (k/q, n/q)

    def post(l):
        # step l: A_il travels along the row from column l, B_lj down the column from row l
        s = l % 2
        ab = a if row.rank == l else abuf[s]
        bb = b if col.rank == l else bbuf[s]
        return ab, bb, (row.ibcast(ab, root=l), col.ibcast(bb, root=l))

    nxt = post(0)
    for l in range(q):
        ab, bb, reqs = nxt
        for r in reqs:
            r.wait()
        if l + 1 < q:  # overlap the next broadcast with this multiply
            nxt = post(l + 1)
        be.gemm(ab, bb, c, accumulate=l > 0)
    return c


def _summa_abt(a, b, row, col, be, out=None):
    """C_il = sum_j A_ij B_lj^T: broadcast B down columns, reduce partials along rows."""
    q = row.size
    xp = be.xp
    mb, nb = a.shape[0], b.shape[0]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if q == 1:
        return be.gemm(a, b, c, trans_b=True)
    bbuf = col.workspace("summa.b", b)                                       # 2 x (n/q, k/q)
    part = row.workspace("summa.part", c)                                    # 2 x (m/q, n/q)
    return _bcast_multiply_reduce(
        q, lambda l: b if col.rank == l else bbuf[l % 2], col,
        lambda bb, t: be.gemm(a, bb, t, trans_b=True), part, row, c)


def _summa_atb(a, b, row, col, be, out=None):
    """C_lj = sum_i A_il^T B_ij: broadcast A along rows, reduce partials down columns."""
    q = row.size
    xp = be.xp
    mb, nb = a.shape[1], b.shape[1]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)        # (m/q, n/q)
    if q == 1:
        return be.gemm(a, b, c, trans_a=True)
    abuf = row.workspace("summa.a", a)                                       # 2 x (k/q, m/q)
    part = col.workspace("summa.part", c)                                    # 2 x (m/q, n/q)
    return _bcast_multiply_reduce(
        q, lambda l: a if row.rank == l else abuf[l % 2], row,
        lambda ab, t: be.gemm(ab, b, t, trans_a=True), part, col, c)


def _bcast_multiply_reduce(q, bcast_buf, bgroup, multiply, part, rgroup, c):
    """Shared loop of Algorithms 2 and 3: for each l, broadcast operand l over ``bgroup``,
    multiply into a partial product, sum-reduce it over ``rgroup`` to rank l (into ``c``)."""
    pending = [None, None]  # reduce in flight per partial buffer

    def post(l):
        buf = bcast_buf(l)
        return buf, bgroup.ibcast(buf, root=l)

    nxt = post(0)
    for l in range(q):
        buf, req = nxt
        req.wait()
        if l + 1 < q:  # overlap the next broadcast with this multiply
            nxt = post(l + 1)
        s = l % 2
        if pending[s] is not None:  # the partial buffer of step l-2 must be sent first
            pending[s].wait()
        multiply(buf, part[s])
        pending[s] = rgroup.ireduce(part[s], c if rgroup.rank == l else None, root=l)
    for r in pending:
        if r is not None:
            r.wait()
    return c


def summa_ab(a, b, grid, out=None):
    """C = A B on a q x q grid (SUMMA, Optimus Algorithm 1).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of the global A [m, k] (``"2d"`` layout).
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of the global B [k, n].
    grid : summasim.grid.Grid
    out : array, shape (m/q, n/q), optional
        Where to write ``C[M_i, N_j]``.

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A B.

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (m/q)(k/q) items and q broadcasts on
    ``grid.col`` of (k/q)(n/q) items; 2 m n k / q^2 flops.
    """
    be = check_product("summa_ab", "ab", a, b, grid, out, "k/q")
    return _summa_ab(contiguous(a), contiguous(b), grid.row, grid.col, be, out)


def summa_ab_unchecked(a, b, grid, out=None):
    """:func:`summa_ab` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step)."""
    return _summa_ab(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out)


def summa_abt(a, b, grid, out=None):
    """C = A B^T on a q x q grid (Optimus Algorithm 2).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of A [m, k].
    b : array, shape (n/q, k/q)
        Block ``B[N_i, K_j]`` of B [n, k].
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A B^T.

    Notes
    -----
    Per rank: q broadcasts on ``grid.col`` of (n/q)(k/q) items and q sum-reduces on
    ``grid.row`` of (m/q)(n/q) items.
    """
    be = check_product("summa_abt", "abt", a, b, grid, out, "k/q")
    return _summa_abt(contiguous(a), contiguous(b), grid.row, grid.col, be, out)


def summa_abt_unchecked(a, b, grid, out=None):
    """:func:`summa_abt` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step)."""
    return _summa_abt(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out)


def summa_atb(a, b, grid, out=None):
    """C = A^T B on a q x q grid (Optimus Algorithm 3).

    Parameters
    ----------
    a : array, shape (k/q, m/q)
        Block ``A[K_i, M_j]`` of A [k, m].
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of B [k, n].
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]`` of C = A^T B.

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (k/q)(m/q) items and q sum-reduces on
    ``grid.col`` of (m/q)(n/q) items.
    """
    be = check_product("summa_atb", "atb", a, b, grid, out, "k/q")
    return _summa_atb(contiguous(a), contiguous(b), grid.row, grid.col, be, out)


def summa_atb_unchecked(a, b, grid, out=None):
    """:func:`summa_atb` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step)."""
    return _summa_atb(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out)
