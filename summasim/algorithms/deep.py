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

The closed forms of every rank's events are
:func:`summasim.costmodel.workload.traffic.algorithm_events`. Checks and the agreement
are those of every product (:mod:`summasim.algorithms._common`).
"""

from __future__ import annotations

from ..backends import backend_of
from ._common import check_product, contiguous
from .allreduce import _bounds, ring_allreduce_unchecked, ring_reduce_scatter_unchecked


def layer_steps(q: int, c: int, k: int) -> range:
    """The SUMMA steps layer ``k`` of ``c`` runs in ``sd25_ab`` (chunk k of range(q))."""
    lo, hi = _bounds(q, c)[k]
    return range(lo, hi)


def sd25_ab(a, b, grid, out=None):
    """C = A B, Solomonik-Demmel 2.5D (SUMMA steps split over the c = d layers).

    Parameters
    ----------
    a : array, shape (m/q, k/q)
        Block ``A[I_i, K_j]`` of A [m, k] (read on layer 0 only).
    b : array, shape (k/q, n/q)
        Block ``B[I_i, J_j]`` of B [k, n] (read on layer 0 only).
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[I_i, J_j]``, on every layer.

    Notes
    -----
    Per rank: 2 broadcasts on ``grid.depth`` (the A and B blocks), ``len(layer_steps)``
    broadcasts on ``grid.row`` of (m/q)(k/q) items and on ``grid.col`` of (k/q)(n/q),
    and a ring all-reduce of (m/q)(n/q) items over ``grid.depth``.
    """
    be = check_product("sd25_ab", "ab", a, b, grid, out, "k/q")
    return _sd25_ab(contiguous(a), contiguous(b), grid, be, out)


def _sd25_ab(a, b, grid, be, out):
    depth, row, col = grid.depth, grid.row, grid.col
    if depth.size > 1:              # replicate layer 0's operands over the layers
        if depth.rank > 0:          # the root sends its own blocks; the others receive
            a = depth.workspace("sd25.a", a, 1)[0]
            b = depth.workspace("sd25.b", b, 1)[0]
        ra, rb = depth.ibcast(a, root=0), depth.ibcast(b, root=0)
        ra.wait()
        rb.wait()
    xp = be.xp
    c = out if out is not None else xp.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    steps = layer_steps(row.size, depth.size, depth.rank)
    if row.size == 1:
        if len(steps):
            be.gemm(a, b, c)
        else:
            c[...] = 0
    else:
        wa = row.workspace("summa.a", a)
        wb = col.workspace("summa.b", b)
        if not len(steps):
            c[...] = 0
        for n, l in enumerate(steps):
            ab = a if row.rank == l else wa[n % 2]
            bb = b if col.rank == l else wb[n % 2]
            reqs = (row.ibcast(ab, root=l), col.ibcast(bb, root=l))
            for r in reqs:
                r.wait()
            be.gemm(ab, bb, c, accumulate=n > 0)
    if depth.size > 1:              # the c partial sums
        ring_allreduce_unchecked(c, depth, out=c)
    return c


def _cube(fn: str, grid):
    def check():
        if grid.d != grid.q:
            raise ValueError(f"{fn} needs a q x q x q cube, got [q, q, d] = "
                             f"[{grid.q}, {grid.q}, {grid.d}]")
    return check


def mm3d_ab(a, b, grid, out=None):
    """C = A B, the 3D algorithm on a q x q x q cube (``grid.d == grid.q``).

    Parameters
    ----------
    a : array, shape (m/q^2, k/q)
        Block ``A[M_{iq+j}, K_k]`` of A [m, k] (layout ``"3d-a"``).
    b : array, shape (k/q^2, n/q)
        Block ``B[K_{kq+i}, N_j]`` of B [k, n] (layout ``"3d-b"``).
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q^2, n/q)
        Block ``C[M_{iq+(k+1) mod q}, N_j]`` (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (m/q^2)(k/q) items, one on ``grid.col``
    of (k/q^2)(n/q), and a ring reduce-scatter of (m/q)(n/q) items over ``grid.depth``
    (q - 1 sendrecvs).
    """
    q = getattr(grid, "q", 1)
    be = check_product("mm3d_ab", "ab", a, b, grid, out, "k/q", extra=_cube("mm3d_ab", grid),
                       inner_scale=q)
    return _mm3d(contiguous(a), contiguous(b), grid, be, out, False, False)


def mm3d_abt(a, b, grid, out=None):
    """C = A B^T on a q x q x q cube.

    Parameters
    ----------
    a : array, shape (m/q^2, k/q)
        Block ``A[M_{iq+j}, K_k]`` of A [m, k] (layout ``"3d-a"``).
    b : array, shape (n/q^2, k/q)
        Block ``B[N_{jq+i}, K_k]`` of B [n, k] (layout ``"3d-bt"``).
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q^2, n/q)
        Block ``C[M_{iq+(k+1) mod q}, N_j]`` (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (m/q^2)(k/q) items, one on ``grid.col``
    of (n/q^2)(k/q), and a ring reduce-scatter of (m/q)(n/q) items over ``grid.depth``.
    """
    q = getattr(grid, "q", 1)
    be = check_product("mm3d_abt", "abt", a, b, grid, out, "k/q",
                       extra=_cube("mm3d_abt", grid),
                       out_shape=lambda: (a.shape[0], q * b.shape[0]))
    return _mm3d(contiguous(a), contiguous(b), grid, be, out, False, True)


def mm3d_atb(a, b, grid, out=None):
    """C = A^T B on a q x q x q cube.

    Parameters
    ----------
    a : array, shape (k/q^2, m/q)
        Block ``A[K_{kq+j}, M_i]`` of A [k, m] (layout ``"3d-at"``).
    b : array, shape (k/q^2, n/q)
        Block ``B[K_{kq+i}, N_j]`` of B [k, n] (layout ``"3d-b"``).
    grid : summasim.grid.Grid

    Returns
    -------
    array, shape (m/q^2, n/q)
        Block ``C[M_{iq+(k+1) mod q}, N_j]`` (layout ``"3d-c"``).

    Notes
    -----
    Per rank: one all-gather on ``grid.row`` of (k/q^2)(m/q) items, one on ``grid.col``
    of (k/q^2)(n/q), and a ring reduce-scatter of (m/q)(n/q) items over ``grid.depth``.
    """
    q = getattr(grid, "q", 1)
    def cube_and_rows():
        _cube("mm3d_atb", grid)()
        if a.shape[1] % q:
            raise ValueError(f"mm3d_atb: a.shape[1] (m/q = {a.shape[1]}) is not divisible "
                             f"by q = {q}: C is cut into q^2 row pieces")

    be = check_product("mm3d_atb", "atb", a, b, grid, out, "k/q^2", extra=cube_and_rows,
                       out_shape=lambda: (a.shape[1] // q, b.shape[1]))
    return _mm3d(contiguous(a), contiguous(b), grid, be, out, True, False)


def _mm3d(a, b, grid, be, out, trans_a, trans_b):
    """Gather A's pieces along the row and B's down the column, multiply, and
    reduce-scatter the product over the depth (each rank keeps chunk (k + 1) mod q)."""
    q, xp = grid.q, be.xp
    ga = grid.row.workspace("mm3d.a", a, 1, shape=(q,) + a.shape)[0] if q > 1 else a[None]
    gb = grid.col.workspace("mm3d.b", b, 1, shape=(q,) + b.shape)[0] if q > 1 else b[None]
    if q > 1:
        grid.row.allgather(a, ga)                      # A's block: pieces in j order
        grid.col.allgather(b, gb)                      # B's block: pieces in i order
    fa = ga.reshape(q * a.shape[0], a.shape[1])
    fb = gb.reshape(q * b.shape[0], b.shape[1])
    rows = fa.shape[1] if trans_a else fa.shape[0]     # m/q
    cols = fb.shape[0] if trans_b else fb.shape[1]     # n/q
    if q == 1:
        c = out if out is not None else xp.empty((rows, cols), dtype=a.dtype)
        return be.gemm(fa, fb, c, trans_a=trans_a, trans_b=trans_b)
    full = grid.depth.workspace("mm3d.c", a, 1, shape=(rows, cols))[0]
    be.gemm(fa, fb, full, trans_a=trans_a, trans_b=trans_b)
    flat = full.reshape(-1)
    owned = ring_reduce_scatter_unchecked(flat, grid.depth)   # chunk (k + 1) mod q
    lo, hi = _bounds(flat.shape[0], q)[owned]
    c = out if out is not None else xp.empty((rows // q, cols), dtype=a.dtype)
    c[...] = flat[lo:hi].reshape(c.shape)
    return c
