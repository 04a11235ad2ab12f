"""Communication-optimal 2.5D and 3D matrix multiplication.

``sd25_ab``: Solomonik and Demmel's 2.5D algorithm on a [q, q, c] grid (p = c q^2 ranks,
c copies of the operands), with SUMMA steps in each layer:

1. replicate: layer 0's A and B blocks are broadcast over ``grid.depth`` (the other
   layers' copies of the inputs are not read);
2. layer k runs its share of the q SUMMA steps: steps ``l`` in chunk k of ``range(q)``
   cut into c near-equal chunks (q mod c layers take one more step), each a broadcast
   of ``A[I_i, K_l]`` along ``grid.row`` and of ``B[K_l, J_j]`` down ``grid.col``;
3. the c partial products are summed over ``grid.depth`` with the ring all-reduce.

A, B and C are in the ``"2d"`` layout (C the same on every layer). With c = 1 it is
``summa_ab``. Per rank, for m = k = n: 2 n^2/q^2 words to replicate, about
2 n^2/(c q) in the layer's steps and 2 (c-1)/c n^2/q^2 in the sum: with q = sqrt(p/c),
O(n^2/sqrt(c p)), the 2.5D lower bound (Solomonik and Demmel, Euro-Par 2011, eq. 1;
Ballard et al. 2012).

``mm3d_ab``: the 3D algorithm (Agarwal et al. 1995; Berntsen 1989) on a q x q x q cube
(a [q, q, q] grid), rank (i, j, k) computing ``A[I_i, K_k] B[K_k, J_j]``:

1. all-gather ``A[I_i, K_k]`` along ``grid.row`` from the q row pieces the ranks
   (i, *, k) hold (layout ``"3d-a"``: rank (i, j, k) holds row piece j of it);
2. all-gather ``B[K_k, J_j]`` down ``grid.col`` (layout ``"3d-b"``: rank (i, j, k) holds
   row piece i of it);
3. multiply, and reduce-scatter the q partial ``C[I_i, J_j]`` over ``grid.depth`` with
   the ring's first half: rank (i, j, k) keeps row piece (k + 1) mod q of the sum (layout
   ``"3d-c"``; the ring leaves the chunk after its own on each rank).

Every operand is held once (no copies): per rank, for m = k = n, 3 (q-1)/q n^2/q^2
words = O(n^2/p^(2/3)), the memory-independent lower bound (Ballard et al., SPAA 2012,
Theorem 3.2; Irony, Toledo and Tiskin 2004).

``mm3d_abt`` (C = A B^T, B [n, k] in ``"3d-bt"``: rank (i, j, k) holds row piece i of
``B[N_j, K_k]``) and ``mm3d_atb`` (C = A^T B, A [k, m] in ``"3d-at"``: rank (i, j, k)
holds row piece j of ``A[K_k, M_i]``) are the same three steps with the product
transposed: what the backward of a 3D layer needs. All three move the same words: a
1/p share of A and of B gathered from q ranks each, and a (m/q)(n/q) partial product
reduce-scattered over q.

Any sizes
---------
All four take sizes that do not divide their grid. ``sd25_ab``'s blocks are the
``"2d"`` balanced partition (:mod:`summasim.layout`: the first ``size mod q`` blocks one
larger); on its square layer A's column cut and B's row cut of k are the same
partition over q, so step l is block l of k (``K_l``): its broadcasts are received
into workspaces of the largest block, viewed at the step's shape. The cube layouts nest
the balanced partition (rank (i, j, k) of ``"3d-a"`` holds row piece j, of the
partition over q, of ``A``'s row block ``I_i``), so the q pieces of a group stack to
the block the product needs. The all-gathers send every piece padded to the group's
largest, ``ceil(|I_i|/q)`` rows (MPI's ``Allgather`` needs one count; an
``Allgatherv`` would save the at most q - 1 padding rows): the trace, and the closed
form, count the padded bytes that are sent. The reduce-scatter's chunks are C's row
pieces of ``I_i`` (ring chunk t = rows ``[o_t, o_{t+1})`` of the partition of ``|I_i|``
over q, times ``|N_j|`` columns), so rank (i, j, k) keeps piece (k + 1) mod q, its
``"3d-c"`` block. With sizes that divide, the pieces are equal and nothing is padded.

The closed forms of every rank's events are
:func:`summasim.costmodel.workload.traffic.algorithm_events`. Checks and the agreement
are those of every product (:mod:`summasim.algorithms._common`).
"""

from __future__ import annotations

from ..spec import block_range, partition
from ._common import check_blocks, contiguous
from .allreduce import _bounds, ring_allreduce_unchecked, ring_reduce_scatter_unchecked

_LAYOUTS = {"ab": ("3d-a", "3d-b", "3d-c"), "abt": ("3d-a", "3d-bt", "3d-c"),
            "atb": ("3d-at", "3d-b", "3d-c")}


def layer_steps(q: int, c: int, k: int) -> range:
    """The SUMMA steps layer ``k`` of ``c`` runs in ``sd25_ab`` (chunk k of range(q))."""
    lo, hi = _bounds(q, c)[k]
    return range(lo, hi)


def _extent(size: int, parts: int, t: int) -> int:
    """Items in block ``t`` of the balanced partition of ``size`` over ``parts``."""
    lo, hi = block_range(size, parts, t)
    return hi - lo


def _square(fn: str, grid):
    def check():
        if grid.pr != grid.pc:
            raise ValueError(f"{fn} needs a square grid ([q, q, d]), got [pr, pc, d] = "
                             f"[{grid.pr}, {grid.pc}, {grid.d}]")
    return check


def sd25_ab(a, b, grid, out=None, *, sizes=None):
    """C = A B, Solomonik-Demmel 2.5D (SUMMA steps split over the c = d layers).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[M_i, K_j]`` of A [m, k] (``"2d"``; read on layer 0 only).
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of B [k, n] (``"2d"``; read on layer 0 only).
    grid : summasim.grid.Grid
        A square ``[q, q, c]`` grid.
    out : array, shape (m/q, n/q), optional
    sizes : (m, k, n), keyword-only, optional
        The global sizes. Blocks may be uneven (the balanced partition; shapes above
        are for sizes that divide); without ``sizes`` one small all-gather of the block
        shapes finds them (:func:`summasim.algorithms._common.check_blocks`).

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]``, on every layer.

    Notes
    -----
    Per rank: 2 broadcasts on ``grid.depth`` (the A and B blocks), for each step l of
    ``layer_steps`` a broadcast on ``grid.row`` of ``|M_i| |K_l|`` items and one on
    ``grid.col`` of ``|K_l| |N_j|``, and a ring all-reduce of ``|M_i| |N_j|`` items over
    ``grid.depth``.

    References
    ----------
    E. Solomonik and J. Demmel, "Communication-optimal parallel 2.5D matrix
    multiplication and LU factorization algorithms", Euro-Par 2011.
    """
    be, found = check_blocks("sd25_ab", "ab", a, b, grid, out, ("2d", "2d", "2d"), sizes,
                             extra=_square("sd25_ab", grid))
    if grid.depth.rank == 0:        # the layers above receive layer 0's blocks
        a, b = contiguous(a), contiguous(b)
    return _sd25_ab(a, b, grid, be, out, partition(found["k"], grid.q))


def _flat(ws, slot, shape):
    """A C-contiguous ``shape`` view at the front of workspace buffer ``slot``."""
    return ws[slot][:shape[0] * shape[1]].reshape(shape)


def _sd25_ab(a, b, grid, be, out, kparts):
    depth, row, col = grid.depth, grid.row, grid.col
    if depth.size > 1:              # replicate layer 0's operands over the layers
        if depth.rank > 0:          # the root sends its own blocks; the others receive
            a = depth.workspace("sd25.a", a, 1)[0]
            b = depth.workspace("sd25.b", b, 1)[0]
        ra, rb = depth.ibcast(a, root=0), depth.ibcast(b, root=0)
        ra.wait()
        rb.wait()
    xp = be.xp
    mb, nb = a.shape[0], b.shape[1]
    c = out if out is not None else xp.empty((mb, nb), dtype=a.dtype)      # (|M_i|, |N_j|)
    steps = layer_steps(row.size, depth.size, depth.rank)
    if row.size == 1:
        if len(steps):
            be.gemm(a, b, c)
        else:
            c[...] = 0
    else:
        wide = max(hi - lo for lo, hi in zip(kparts, kparts[1:]))          # ceil(k/q)
        wa = row.workspace("summa.a", a, shape=(mb * wide,))               # 2 x (m/q, k/q)
        wb = col.workspace("summa.b", b, shape=(wide * nb,))               # 2 x (k/q, n/q)
        if not len(steps):
            c[...] = 0
        for n, l in enumerate(steps):
            # step l: A[M_i, K_l] along the row from column l, B[K_l, N_j] down the
            # column from row l (block l of k in both cuts)
            w = kparts[l + 1] - kparts[l]
            ab = a if row.rank == l else _flat(wa, n % 2, (mb, w))
            bb = b if col.rank == l else _flat(wb, n % 2, (w, nb))
            reqs = (row.ibcast(ab, root=l), col.ibcast(bb, root=l))
            for r in reqs:
                r.wait()
            be.gemm(ab, bb, c, accumulate=n > 0)
    if depth.size > 1:              # the c partial sums
        ring_allreduce_unchecked(c, depth, out=c)
    return c


def _cube(fn: str, grid):
    def check():
        _square(fn, grid)()
        if grid.d != grid.q:
            raise ValueError(f"{fn} needs a q x q x q cube, got [q, q, d] = "
                             f"[{grid.q}, {grid.q}, {grid.d}]")
    return check


def _mm3d_checked(fn, form, a, b, grid, out, sizes):
    """The cube's entry check (any sizes) and the product."""
    be, found = check_blocks(fn, form, a, b, grid, out, _LAYOUTS[form], sizes,
                             extra=_cube(fn, grid), inner=False)
    return _mm3d(contiguous(a), contiguous(b), grid, be, out, form, found)


def mm3d_ab(a, b, grid, out=None, *, sizes=None):
    """C = A B, the 3D algorithm on a q x q x q cube (``grid.d == grid.q``).

    Parameters
    ----------
    a : array, shape (m/q^2, k/q)
        Piece j of ``A[M_i, K_k]``'s rows (layout ``"3d-a"``).
    b : array, shape (k/q^2, n/q)
        Piece i of ``B[K_k, N_j]``'s rows (layout ``"3d-b"``).
    grid : summasim.grid.Grid
    out : array, shape (m/q^2, n/q), optional
    sizes : (m, k, n), keyword-only, optional
        The global sizes (any; the cube layouts' nested balanced partition; shapes above
        are for sizes that divide); found from the blocks when not given.

    Returns
    -------
    array, shape (m/q^2, n/q)
        Piece (k + 1) mod q of ``C[M_i, N_j]``'s rows (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (m/q^2)(k/q) items, one on ``grid.col``
    of (k/q^2)(n/q), each piece padded to its group's largest, and a ring
    reduce-scatter of (m/q)(n/q) items over ``grid.depth`` (q - 1 sendrecvs).

    References
    ----------
    R. C. Agarwal, S. M. Balle, F. G. Gustavson, M. Joshi and P. Palkar, "A
    three-dimensional approach to parallel matrix multiplication", IBM J. Res. Dev.
    39(5), 1995.
    """
    return _mm3d_checked("mm3d_ab", "ab", a, b, grid, out, sizes)


def mm3d_abt(a, b, grid, out=None, *, sizes=None):
    """C = A B^T on a q x q x q cube.

    Parameters
    ----------
    a : array, shape (m/q^2, k/q)
        Piece j of ``A[M_i, K_k]``'s rows (layout ``"3d-a"``).
    b : array, shape (n/q^2, k/q)
        Piece i of ``B[N_j, K_k]``'s rows (layout ``"3d-bt"``).
    grid : summasim.grid.Grid
    out : array, shape (m/q^2, n/q), optional
    sizes : (m, k, n), keyword-only, optional
        As :func:`mm3d_ab`.

    Returns
    -------
    array, shape (m/q^2, n/q)
        Piece (k + 1) mod q of ``C[M_i, N_j]``'s rows (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (m/q^2)(k/q) items, one on ``grid.col``
    of (n/q^2)(k/q), and a ring reduce-scatter of (m/q)(n/q) items over ``grid.depth``.
    """
    return _mm3d_checked("mm3d_abt", "abt", a, b, grid, out, sizes)


def mm3d_atb(a, b, grid, out=None, *, sizes=None):
    """C = A^T B on a q x q x q cube.

    Parameters
    ----------
    a : array, shape (k/q^2, m/q)
        Piece j of ``A[K_k, M_i]``'s rows (layout ``"3d-at"``).
    b : array, shape (k/q^2, n/q)
        Piece i of ``B[K_k, N_j]``'s rows (layout ``"3d-b"``).
    grid : summasim.grid.Grid
    out : array, shape (m/q^2, n/q), optional
    sizes : (m, k, n), keyword-only, optional
        As :func:`mm3d_ab`.

    Returns
    -------
    array, shape (m/q^2, n/q)
        Piece (k + 1) mod q of ``C[M_i, N_j]``'s rows (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (k/q^2)(m/q) items, one on ``grid.col``
    of (k/q^2)(n/q), and a ring reduce-scatter of (m/q)(n/q) items over ``grid.depth``.
    """
    return _mm3d_checked("mm3d_atb", "atb", a, b, grid, out, sizes)


def _gather_rows(group, x, rows: int, tag: str):
    """The ``rows`` x cols block whose q row pieces (the balanced partition of ``rows``)
    the group's ranks hold, ``x`` this rank's, all-gathered in rank order: each piece
    is sent padded to the largest (one count for ``Allgather``) and the pieces are
    packed together after, unless they were all alike."""
    q, cols = group.size, x.shape[1]
    cut = partition(rows, q)
    big = cut[1] - cut[0]                                     # ceil(rows / q)
    recv = group.workspace(tag, x, 1, shape=(q, big, cols))[0]   # (q, ceil(rows/q), cols)
    send = x
    if x.shape[0] != big:                                     # pad this piece
        send = group.workspace(tag + ".pad", x, 1, shape=(big, cols))[0]
        send[:x.shape[0]] = x
        send[x.shape[0]:] = 0
    group.allgather(send, recv)
    if rows == q * big:                                       # alike: already stacked
        return recv.reshape(rows, cols)
    full = group.workspace(tag + ".full", x, 1, shape=(rows, cols))[0]    # (rows, cols)
    for t in range(q):                                        # drop each piece's padding
        full[cut[t]:cut[t + 1]] = recv[t, :cut[t + 1] - cut[t]]
    return full


def _mm3d(a, b, grid, be, out, form, sizes):
    """Gather A's pieces along the row and B's down the column, multiply, and
    reduce-scatter the product over the depth (each rank keeps row piece (k + 1) mod q
    of ``C[M_i, N_j]``)."""
    q, xp = grid.q, be.xp
    trans_a, trans_b = form == "atb", form == "abt"
    mi = _extent(sizes["m"], q, grid.i)                      # |M_i|
    kk = _extent(sizes["k"], q, grid.k)                      # |K_k|
    nj = _extent(sizes["n"], q, grid.j)                      # |N_j|
    if q == 1:
        c = out if out is not None else xp.empty((mi, nj), dtype=a.dtype)
        return be.gemm(a, b, c, trans_a=trans_a, trans_b=trans_b)
    fa = _gather_rows(grid.row, a, kk if trans_a else mi, "mm3d.a")   # A[M_i, K_k] (atb: ^T)
    fb = _gather_rows(grid.col, b, nj if trans_b else kk, "mm3d.b")   # B[K_k, N_j] (abt: ^T)
    full = grid.depth.workspace("mm3d.c", a, 1, shape=(mi, nj))[0]   # partial C[M_i, N_j]
    be.gemm(fa, fb, full, trans_a=trans_a, trans_b=trans_b)
    flat = full.reshape(-1)
    # ring chunk t: C's row piece t of M_i (the nested partition), whole rows
    bounds = tuple((lo * nj, hi * nj) for lo, hi in _bounds(mi, q))
    owned = ring_reduce_scatter_unchecked(flat, grid.depth, bounds=bounds)  # (k + 1) mod q
    lo, hi = bounds[owned]
    c = out if out is not None else xp.empty((_extent(mi, q, owned), nj), dtype=a.dtype)
    c[...] = flat[lo:hi].reshape(c.shape)
    return c
