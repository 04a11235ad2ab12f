"""SUMMA2.5 on a [q, q, d] grid (SUMMA2.5-LM Algorithm 3 and its transposed forms).

The activation-like operand uses the ``"2.5d"`` layout (rows cut into d*q blocks,
rank (i, j, k) holds row block k*q + i), the weight-like operand the ``"2d"``
layout replicated over the depth. Each layer k then runs a q x q SUMMA on its own
rows, concurrently with the other layers.

What every rank sends (per call)
--------------------------------
``summa25_ab``  (A [m, k] 2.5d, B [k, n] 2d -> C 2.5d): q broadcasts on
                ``grid.row`` of (m/(dq))(k/q) items, q on ``grid.col`` of (k/q)(n/q).
``summa25_abt`` (A [m, k] 2.5d, B [n, k] 2d -> C 2.5d): q broadcasts on
                ``grid.col`` of (n/q)(k/q) items, q sum-reduces on ``grid.row`` of
                (m/(dq))(n/q).
``summa25_atb`` (A [k, m] 2.5d, B [k, n] 2.5d -> C 2d): q broadcasts on ``grid.row``
                of (k/(dq))(m/q) items, q sum-reduces on ``grid.col`` of (m/q)(n/q),
                then :func:`~summasim.algorithms.allreduce.ring_allreduce` over
                ``grid.depth`` of (m/q)(n/q) items: 2(d-1) sendrecvs (none if d = 1).

With d = 1 these are exactly ``summa_ab``, ``summa_abt`` and ``summa_atb``. Like them,
they take any sizes (the balanced partition of :mod:`summasim.layout`; the activation's
rows are cut into d*pr blocks) and rectangular ``[pr, pc, d]`` grids, with the global
sizes as the keyword ``sizes=(m, k, n)`` or found by one small all-gather.
Backward of C = A B with A 2.5d and B 2d: dA = summa25_abt(dC, B), dB = summa25_atb(A, dC)
(the depth all-reduce of dB is the paper's "all-reduce after the computation of B'").

Checks
------
Each public function checks its own arguments, then agrees with the other ranks of
the grid (one small untraced collective, :mod:`summasim.algorithms._common`): input
that is bad on any one rank raises the same ``ValueError``/``TypeError`` on every
rank before anything is sent. The ``*_unchecked`` twins skip both, for library
callers that have checked and agreed already.

References
----------
E. Solomonik and J. Demmel, "Communication-optimal parallel 2.5D matrix
multiplication and LU factorization algorithms", Euro-Par 2011.
B. Wang, Q. Xu, Z. Bian, Y. You, "Tesseract / 2.5-dimensional tensor parallelism"
(SUMMA2.5-LM), 2021, Algorithm 3.
"""

from __future__ import annotations

from ..backends import backend_of
from ._common import contiguous
from .allreduce import ring_allreduce_unchecked
from .summa import _summa_ab, _summa_abt, _summa_atb, run_checked

_AB, _ABT, _ATB = ("2.5d", "2d", "2.5d"), ("2.5d", "2d", "2.5d"), ("2.5d", "2.5d", "2d")


def summa25_ab(a, b, grid, out=None, *, sizes=None):
    """C = A B with A and C in the ``"2.5d"`` layout and B in ``"2d"``.

    Parameters
    ----------
    a : array, shape (m/(dq), k/q)
        Block ``A[M_{kq+i}, K_j]`` of A [m, k].
    b : array, shape (k/q, n/q)
        Block ``B[K_i, N_j]`` of B [k, n] (the same on every layer).
    grid : summasim.grid.Grid
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes, for blocks that may be uneven (see
        :func:`summasim.algorithms.summa.summa_ab`).

    Returns
    -------
    array, shape (m/(dq), n/q)
        Block ``C[M_{kq+i}, N_j]``.

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (m/(dq))(k/q) items and q on
    ``grid.col`` of (k/q)(n/q) items.
    """
    return run_checked("summa25_ab", "ab", _summa_ab, a, b, grid, out, sizes, _AB)


def summa25_ab_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa25_ab` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa_ab(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                      parts)


def summa25_abt(a, b, grid, out=None, *, sizes=None):
    """C = A B^T with A and C in the ``"2.5d"`` layout and B in ``"2d"``.

    Parameters
    ----------
    a : array, shape (m/(dq), k/q)
        Block ``A[M_{kq+i}, K_j]`` of A [m, k].
    b : array, shape (n/q, k/q)
        Block ``B[N_i, K_j]`` of B [n, k].
    grid : summasim.grid.Grid
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes, for blocks that may be uneven (see
        :func:`summasim.algorithms.summa.summa_ab`).

    Returns
    -------
    array, shape (m/(dq), n/q)
        Block ``C[M_{kq+i}, N_j]``.

    Notes
    -----
    Per rank: q broadcasts on ``grid.col`` of (n/q)(k/q) items and q sum-reduces
    on ``grid.row`` of (m/(dq))(n/q) items.
    """
    return run_checked("summa25_abt", "abt", _summa_abt, a, b, grid, out, sizes, _ABT)


def summa25_abt_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa25_abt` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa_abt(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                      parts)


def summa25_atb(a, b, grid, out=None, *, sizes=None):
    """C = A^T B with A and B in the ``"2.5d"`` layout and C in ``"2d"`` on every layer.

    Parameters
    ----------
    a : array, shape (k/(dq), m/q)
        Block ``A[K_{kq+i}, M_j]`` of A [k, m].
    b : array, shape (k/(dq), n/q)
        Block ``B[K_{kq+i}, N_j]`` of B [k, n].
    grid : summasim.grid.Grid
    out : optional
        Where to write the result block.
    sizes : (m, k, n), keyword-only, optional
        The global sizes, for blocks that may be uneven (see
        :func:`summasim.algorithms.summa.summa_ab`).

    Returns
    -------
    array, shape (m/q, n/q)
        Block ``C[M_i, N_j]``, summed over the layers (identical on every k).

    Notes
    -----
    Per rank: q broadcasts on ``grid.row`` of (k/(dq))(m/q) items, q sum-reduces on
    ``grid.col`` of (m/q)(n/q) items, and a ring all-reduce of (m/q)(n/q) items over
    ``grid.depth`` (2(d-1) sendrecvs).
    """
    kernel = lambda *args: _summa25_atb(*args, depth=grid.depth)  # noqa: E731
    return run_checked("summa25_atb", "atb", kernel, a, b, grid, out, sizes, _ATB)


def summa25_atb_unchecked(a, b, grid, out=None, parts=None):
    """:func:`summa25_atb` without the checks and the agreement, for library callers that
    checked and agreed on their inputs once (e.g. once per transformer step). ``parts``:
    the two cuts of the dimension it steps over (:func:`~summasim.algorithms.summa.parts_of`),
    for blocks that are uneven or a grid that is not square; even blocks when None."""
    return _summa25_atb(contiguous(a), contiguous(b), grid.row, grid.col, backend_of(a), out,
                        parts, depth=grid.depth)


def _summa25_atb(a, b, row, col, be, out, mparts=None, *, depth):
    """The layer's SUMMA A^T B, then the ring all-reduce over the depth."""
    c = _summa_atb(a, b, row, col, be, out, mparts)
    if depth.size > 1:
        # each layer summed its own rows of A^T B; the depth sum completes C
        ring_allreduce_unchecked(c, depth, out=c)
    return c
