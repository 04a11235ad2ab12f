"""Cannon's algorithm for C = A B on a q x q grid (d = 1).

Blocks use the ``"2d"`` layout. An initial skew shifts A_ij left by i along the row
and B_ij up by j along the column, so rank (i, j) starts with A_{i,i+j} and
B_{i+j,j}; then q multiply steps, each followed (except the last) by a cyclic shift
of A one step left and B one step up. The shifts of step l+1 are posted before the
multiply of step l, into a second workspace (double buffering).

What every rank sends (rank (i, j), per call)
---------------------------------------------
skew: 1 sendrecv on ``grid.row`` of an (m/q)(k/q) A block if i % q != 0, and 1 on
``grid.col`` of a (k/q)(n/q) B block if j % q != 0;
then q-1 sendrecvs on ``grid.row`` of the A block and q-1 on ``grid.col`` of the
B block: the skew plus 2(q-1) shifts.

Checks
------
Each public function checks its own arguments, then agrees with the other ranks of
the grid (one small untraced collective, :mod:`summasim.algorithms._common`): input
that is bad on any one rank raises the same ``ValueError``/``TypeError`` on every
rank before anything is sent. The ``*_unchecked`` twins skip both, for library
callers that have checked and agreed already.

References
----------
L. E. Cannon, "A cellular computer to implement the Kalman filter algorithm",
PhD thesis, Montana State University, 1969.
"""

from __future__ import annotations

from ..backends import backend_of
from ..spec import partition
from ._common import check_blocks, contiguous


def cannon_ab(a, b, grid, out=None, *, sizes=None):
    """C = A B with Cannon's algorithm on a q x q grid.

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of A [m, k].
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of B [k, n].
    grid : summasim.grid.Grid
        A square grid with ``d == 1``.
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes. Blocks may be uneven (the balanced partition of
        :mod:`summasim.layout`; the shapes above are for sizes that divide); without
        ``sizes`` one small all-gather of the block shapes finds them.

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]``.

    Raises
    ------
    ValueError
        If the grid is not q x q with ``d == 1`` (Cannon shifts whole blocks around a
        square torus: a rectangular grid has no such cycle; SUMMA runs there), or the
        blocks do not conform, on any rank, or are not the balanced partition: on
        every rank alike.
    TypeError
        For dtypes that are not floating or differ (between a and b, or between ranks).

    Notes
    -----
    Per rank: the skew (at most one sendrecv of each block) plus q-1 shifts of the A
    block on ``grid.row`` and q-1 of the B block on ``grid.col``. With uneven blocks
    the block a rank sends and the one it receives may differ by a row or column.
    """
    def needs_2d():
        if grid.d != 1 or grid.pr != grid.pc:
            raise ValueError(f"cannon_ab needs a q x q grid (p = q*q), got [pr, pc, d] = "
                             f"[{grid.pr}, {grid.pc}, {grid.d}] with p = {grid.p}")

    be, found = check_blocks("cannon_ab", "ab", a, b, grid, out, ("2d", "2d", "2d"), sizes,
                             extra=needs_2d)
    return _cannon_ab(a, b, grid, be, out, partition(found["k"], grid.pr))


def cannon_ab_unchecked(a, b, grid, out=None):
    """:func:`cannon_ab` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (blocks of one shape)."""
    return _cannon_ab(a, b, grid, backend_of(a), out)


def _cannon_ab(a, b, grid, be, out, kcut=None):
    """The skew, then q multiply-and-shift steps (see the module docstring); ``kcut``
    the offsets of k's q blocks (even when not given)."""
    a, b = contiguous(a), contiguous(b)
    xp, q = be.xp, grid.q
    c = out if out is not None else xp.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if q == 1:
        return be.gemm(a, b, c)
    kcut = kcut or [t * a.shape[1] for t in range(q + 1)]
    mb, nb = a.shape[0], b.shape[1]
    wide = max(hi - lo for lo, hi in zip(kcut, kcut[1:]))
    abuf = grid.row.workspace("cannon.a", a, shape=(mb * wide,))          # 2 x (m/q, k/q)
    bbuf = grid.col.workspace("cannon.b", b, shape=(wide * nb,))          # 2 x (k/q, n/q)

    def width(step):           # k extent of the blocks rank (i, j) holds at this step
        t = (grid.i + grid.j + step) % q
        return kcut[t + 1] - kcut[t]

    def view(ws, slot, shape):
        return ws[slot][:shape[0] * shape[1]].reshape(shape)

    # skew: row i rotates A left by i, column j rotates B up by j
    reqs = []
    acur, bcur = a, b
    w = width(0)
    if grid.i % q:
        acur = view(abuf, 0, (mb, w))
        reqs.append(grid.row.ishift(a, acur, -grid.i))
    if grid.j % q:
        bcur = view(bbuf, 0, (w, nb))
        reqs.append(grid.col.ishift(b, bcur, -grid.j))
    for r in reqs:
        r.wait()

    slot = 1
    for l in range(q):
        reqs = []
        if l + 1 < q:  # shift the next operands while multiplying the current ones
            w = width(l + 1)
            anext, bnext = view(abuf, slot, (mb, w)), view(bbuf, slot, (w, nb))
            reqs = [grid.row.ishift(acur, anext, -1), grid.col.ishift(bcur, bnext, -1)]
        be.gemm(acur, bcur, c, accumulate=l > 0)
        for r in reqs:
            r.wait()
        if reqs:
            acur, bcur, slot = anext, bnext, 1 - slot
    return c
