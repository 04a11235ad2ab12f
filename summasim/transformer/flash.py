"""Blockwise causal attention with an online softmax (what FlashAttention computes).

The same function as :func:`summasim.transformer.ops.attention_core_forward`,
``y = softmax(q k^T / sqrt(hd) + mask) v`` with a causal mask, computed without ever
holding the (T, T) score matrix: the keys and values are read in tiles of ``tile``
columns, and each row keeps a running maximum ``m``, a running sum ``l`` and an output
accumulator ``acc`` that are rescaled whenever the maximum grows (Milakov & Gimelshein
2018, "Online normalizer calculation for softmax"; Dao et al. 2022, "FlashAttention",
Algorithm 1)::

    S     = q_s k_j^T                                  scores of key tile j
    m'    = max(m, rowmax S)
    P     = exp(S - m')
    l     = exp(m - m') l + rowsum P
    acc   = exp(m - m') acc + P v_j
    y     = acc / l,    lse = m + log l                after the last tile

The backward recomputes ``P = exp(S - lse)`` tile by tile from the saved row
log-sum-exp instead of storing it (Dao 2023, "FlashAttention-2", Algorithm 2)::

    D     = rowsum(dy * y)                             (B, nh, T), once
    dv_j  = P^T dy
    dP    = dy v_j^T
    dS    = P * (dP - D)
    dq   += dS k_j / sqrt(hd),    dk_j = dS^T q / sqrt(hd)

Loop order and memory. The loop runs over key/value tiles only (Algorithm 1's outer
loop); for tile j, all query rows at or below the diagonal (rows ``j*tile .. T``) are
processed at once, which is Algorithm 1's inner loop over query tiles done by one
batched matmul. Tiles wholly above the causal diagonal are never formed; inside the
diagonal tile an additive ``-inf`` mask removes the upper triangle. The largest
score-shaped arrays are therefore (B, nh, T, tile): **the peak score storage is
O(B nh T tile), never O(T^2)** -- one such array in the forward, two (P and dS) in the
backward, plus the (tile, tile) mask; :func:`score_items` gives the exact count. Every
other array is O(B nh T hd) (the scaled queries, the accumulators, dq) or O(B nh T)
(m, l, lse, D).

Grouped-query attention (Ainslie et al. 2023, "GQA"). ``q`` has ``nh`` heads and ``k``,
``v`` have ``nkv`` heads with ``nh % nkv == 0``; query head i reads key/value head
``i // (nh // nkv)``. The query heads are viewed as (B, nkv, g, T, hd) with
``g = nh // nkv`` and the keys as (B, nkv, 1, T, hd), so the group shares each key tile
by broadcasting (no copy of k or v); dk and dv are summed over the g query heads of
each group. ``nkv == nh`` is plain multi-head attention.

Arrays may be NumPy or CuPy (the array module comes from the inputs) in float32 or
float64; the running statistics are kept in the input dtype, and scalars are Python
floats so float32 stays float32 (NEP 50). There is no Python loop over batch or heads.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from summasim.backends import array_module

Array = Any


class FlashCache(NamedTuple):
    q: Array       # queries as given (unscaled), (B, nh, T, hd)
    k: Array       # (B, nkv, T, hd)
    v: Array       # (B, nkv, T, hd)
    y: Array       # output, (B, nh, T, hd) (read by the backward's D = rowsum(dy * y))
    lse: Array     # row log-sum-exp of the scaled, masked scores, (B, nh, T)
    scale: float   # 1 / sqrt(hd)
    tile: int      # key/value tile width used; the backward uses the same tiles
    # P is not saved: the backward recomputes each tile as exp(S - lse).


def score_items(B: int, nh: int, T: int, tile: int) -> int:
    """The largest number of score-shaped items (scores, probabilities, their gradient,
    the diagonal mask) that :func:`flash_attention_forward` plus
    :func:`flash_attention_backward` hold at once: the backward's first key tile holds P
    and dS, each (B, nh, T, min(tile, T)), and the (min(tile, T))^2 mask."""
    for name, val in (("B", B), ("nh", nh), ("T", T), ("tile", tile)):
        _check_count(name, val)
    tc = min(tile, T)
    return 2 * B * nh * T * tc + tc * tc


def _check_count(name, val, low=1):
    """A positive (``>= low``) integer argument, else ValueError naming it."""
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {val!r}")


def _check_inputs(q, k, v, tile):
    """Shapes (B, nh, T, hd), (B, nkv, T, hd) twice, nh % nkv == 0, one dtype, tile >= 1."""
    _check_count("tile", tile)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(f"{name} must be a 4-D array (B, heads, T, hd), "
                             f"got shape {getattr(a, 'shape', None)}")
        if 0 in a.shape:
            raise ValueError(f"{name} has an empty axis: shape {a.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, nkv, T, hd), "
                         f"got k {k.shape} and v {v.shape}")
    b, nh, t, hd = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, t, hd):
        raise ValueError(f"k and v must be (B, nkv, T, hd) = ({b}, nkv, {t}, {hd}) "
                         f"to match q {q.shape}, got {k.shape}")
    if nh % k.shape[1]:
        raise ValueError(f"query heads nh = {nh} must be a multiple of key/value heads "
                         f"nkv = {k.shape[1]} (grouped-query attention)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_out(name, out, like):
    """``out`` is an array of ``like``'s shape and dtype (it may be a strided view)."""
    if getattr(out, "shape", None) != like.shape:
        raise ValueError(f"{name} must be an array of shape {like.shape}, "
                         f"got {getattr(out, 'shape', None)}")
    if out.dtype != like.dtype:
        raise ValueError(f"{name} must have dtype {like.dtype}, got {out.dtype}")


def _groups(a, nkv):
    """View (B, nh, T, hd) as (B, nkv, g, T, hd); g = nh // nkv.

    Splitting one axis never needs a copy, so a strided ``out`` stays a view of itself.
    """
    b, nh, t, hd = a.shape
    return a.reshape(b, nkv, nh // nkv, t, hd)          # (B, nkv, g, T, hd)


def _diagonal_mask(xp, n, dtype):
    """Additive mask (n, n) of a diagonal tile: 0 on and below the diagonal, -inf above.

    The same array as ``ops.causal_mask``; built here because ``ops`` dispatches its
    ``attention="flash"`` core to this module, which therefore imports nothing from it.
    """
    return xp.triu(xp.full((n, n), -math.inf, dtype=dtype), k=1)   # (n, n)


def _tiles(t, tile):
    """Start and end of each key/value tile: (0, tile), (tile, 2 tile), ..., (., T)."""
    return [(j0, min(j0 + tile, t)) for j0 in range(0, t, tile)]


def flash_attention_forward(q, k, v, *, tile=64, out=None):
    """Causal attention, blockwise with an online softmax: ``softmax(q k^T / sqrt(hd) + mask) v``.

    Parameters
    ----------
    q : (B, nh, T, hd) queries (strided views are fine).
    k, v : (B, nkv, T, hd) keys and values, ``nh % nkv == 0``; query head i reads
        key/value head ``i // (nh // nkv)`` (``nkv == nh``: multi-head attention).
    tile : int >= 1, the key/value tile width; peak score storage is
        ``score_items(B, nh, T, tile)`` items.
    out : optional writable (B, nh, T, hd) array (possibly a strided view, e.g. a head
        view of a (B, T, C) buffer) that receives y; it is also the accumulator.

    Returns ``y`` (B, nh, T, hd) and a :class:`FlashCache` (no (T, T) array).

    References
    ----------
    Dao, Fu, Ermon, Rudra, Re 2022, "FlashAttention: Fast and Memory-Efficient Exact
    Attention with IO-Awareness", Algorithm 1; Milakov & Gimelshein 2018.
    """
    _check_inputs(q, k, v, tile)
    xp = array_module(q, k, v)
    b, nh, t, hd = q.shape
    nkv = k.shape[1]
    if out is not None:
        _check_out("out", out, q)
    scale = 1.0 / math.sqrt(hd)
    qs = _groups(q * scale, nkv)                        # (B, nkv, g, T, hd)
    k5 = k[:, :, None]                                  # (B, nkv, 1, T, hd) view
    v5 = v[:, :, None]                                  # (B, nkv, 1, T, hd) view
    mask = _diagonal_mask(xp, min(tile, t), q.dtype)   # (tile, tile) 0 / -inf
    y = xp.empty(q.shape, dtype=q.dtype) if out is None else out
    acc = _groups(y, nkv)                               # (B, nkv, g, T, hd) view of y
    m = l = None
    for j0, j1 in _tiles(t, tile):
        tc = j1 - j0
        # scores of rows j0..T against key tile j; rows above j0 see none of its keys
        s = qs[..., j0:, :] @ k5[..., j0:j1, :].swapaxes(-1, -2)   # (B, nkv, g, R, tc)
        s[..., :tc, :] += mask[:tc, :tc]                # the diagonal tile's upper triangle
        smax = s.max(axis=-1)                           # (B, nkv, g, R) finite: diagonal kept
        if m is None:
            # first tile: every row sees key 0, so m, l, acc start from it (no rescale)
            m = smax                                    # (B, nkv, g, T)
            s -= m[..., None]
            xp.exp(s, out=s)                            # P
            l = s.sum(axis=-1)                          # (B, nkv, g, T)
            xp.matmul(s, v5[..., j0:j1, :], out=acc)    # (B, nkv, g, T, hd)
            del s                                       # freed before the next tile's scores
            continue
        # later tiles: grow the running max, rescale l and acc by exp(m_old - m_new)
        m_new = xp.maximum(m[..., j0:], smax)           # (B, nkv, g, R)
        alpha = m[..., j0:] - m_new
        xp.exp(alpha, out=alpha)                        # exp(m_old - m_new) <= 1
        m[..., j0:] = m_new
        s -= m_new[..., None]
        xp.exp(s, out=s)                                # P
        l_tail = l[..., j0:]                            # (B, nkv, g, R) view
        l_tail *= alpha
        l_tail += s.sum(axis=-1)
        acc_tail = acc[..., j0:, :]                     # (B, nkv, g, R, hd) view
        acc_tail *= alpha[..., None]
        acc_tail += s @ v5[..., j0:j1, :]               # (B, nkv, g, R, hd)
        del s                                           # freed before the next tile's scores
    acc /= l[..., None]                                 # y = acc / l, in place
    lse = xp.log(l)
    lse += m                                            # (B, nkv, g, T)
    lse = lse.reshape(b, nh, t)                         # (B, nh, T)
    return y, FlashCache(q=q, k=k, v=v, y=y, lse=lse, scale=scale, tile=int(tile))


def flash_attention_backward(dy, cache, *, out=None):
    """Gradients ``(dq, dk, dv)`` of :func:`flash_attention_forward` for ``dy`` (B, nh, T, hd).

    P is recomputed per key tile from the saved ``lse``; ``D = rowsum(dy * y)`` replaces
    the softmax backward's row sums ``rowsum(P * dP)``. dk and dv (B, nkv, T, hd) are
    summed over the query heads of each group. ``out`` optionally gives three writable
    arrays (dq like q, dk and dv like k) to receive them. Returns ``((dq, dk, dv), {})``.

    References
    ----------
    Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", Algorithm 2.
    """
    q, k, v, y, lse = cache.q, cache.k, cache.v, cache.y, cache.lse
    _check_out("dy", dy, q)
    xp = array_module(dy, q)
    b, nh, t, hd = q.shape
    nkv = k.shape[1]
    if out is None:
        dq = xp.empty(q.shape, dtype=q.dtype)
        dk = xp.empty(k.shape, dtype=k.dtype)
        dv = xp.empty(v.shape, dtype=v.dtype)
    else:
        if len(out) != 3:
            raise ValueError(f"out must be three arrays (dq, dk, dv), got {len(out)}")
        dq, dk, dv = out
        _check_out("out[0] (dq)", dq, q)
        _check_out("out[1] (dk)", dk, k)
        _check_out("out[2] (dv)", dv, v)
    qs = _groups(q * cache.scale, nkv)                  # (B, nkv, g, T, hd), recomputed
    k5 = k[:, :, None]                                  # (B, nkv, 1, T, hd) view
    v5 = v[:, :, None]                                  # (B, nkv, 1, T, hd) view
    dy5 = _groups(dy, nkv)                              # (B, nkv, g, T, hd)
    lse5 = lse.reshape(b, nkv, nh // nkv, t)            # (B, nkv, g, T)
    dd = (dy5 * _groups(y, nkv)).sum(axis=-1)           # D = rowsum(dy * y), (B, nkv, g, T)
    dq5 = _groups(dq, nkv)                              # (B, nkv, g, T, hd) view of dq
    mask = _diagonal_mask(xp, min(cache.tile, t), q.dtype)   # (tile, tile)
    for j0, j1 in _tiles(t, cache.tile):
        tc = j1 - j0
        kj, vj = k5[..., j0:j1, :], v5[..., j0:j1, :]   # (B, nkv, 1, tc, hd)
        # P recomputed from lse: rows j0..T against key tile j
        p = qs[..., j0:, :] @ kj.swapaxes(-1, -2)       # (B, nkv, g, R, tc)
        p[..., :tc, :] += mask[:tc, :tc]
        p -= lse5[..., j0:, None]
        xp.exp(p, out=p)                                # P
        # dv_j = P^T dy, summed over the g query heads that read this key head
        xp.sum(p.swapaxes(-1, -2) @ dy5[..., j0:, :], axis=2,
               out=dv[:, :, j0:j1])                     # (B, nkv, tc, hd)
        ds = dy5[..., j0:, :] @ vj.swapaxes(-1, -2)     # dP, (B, nkv, g, R, tc)
        ds -= dd[..., j0:, None]
        ds *= p                                         # dS = P * (dP - D)
        # dk_j = dS^T (q scale), summed over the group
        xp.sum(ds.swapaxes(-1, -2) @ qs[..., j0:, :], axis=2,
               out=dk[:, :, j0:j1])                     # (B, nkv, tc, hd)
        if j0 == 0:
            xp.matmul(ds, kj, out=dq5)                  # (B, nkv, g, T, hd) first tile: all rows
        else:
            dq5[..., j0:, :] += ds @ kj                 # (B, nkv, g, R, hd)
        del p, ds                                       # freed before the next tile's P
    dq5 *= cache.scale
    return (dq, dk, dv), {}
