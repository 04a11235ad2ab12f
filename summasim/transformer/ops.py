"""Serial transformer ops: forward/backward pairs with hand-written gradients.

Every op is a pair ``x_forward(...) -> (out, cache)`` and
``x_backward(dout, cache) -> (dinput, grads)``. The cache is a NamedTuple that
names exactly what the backward needs; ``grads`` is a dict keyed like the
parameter dict the op reads (``"w"``, ``"b"``, ``"g"``, ...). Shapes use
``B`` batch, ``T`` sequence, ``C`` hidden (or the local slice of it),
``nh`` heads, ``hd = C / nh`` head size, ``V`` vocabulary, ``N = B*T`` rows.

Conventions (GPT-2, see DESIGN.md): weights are stored ``[in, out]``
(``y = x @ w + b``), LayerNorm eps 1e-5, GELU tanh approximation, causal
attention scaled by ``1/sqrt(hd)``, QKV columns ordered ``[Q | K | V]`` with the
heads contiguous inside each, LM head tied to ``wte``.

Variants (the defaults are GPT-2's, bit for bit):

* SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", FFN_SwiGLU):
  ``proj(silu(x W_gate + b_gate) * (x W_fc + b_fc))`` with ``silu(z) = z sigmoid(z)``
  (:func:`swiglu_forward`; the block's ``mlp="swiglu"``, keys :func:`block_keys`).
* Grouped-query attention (Ainslie et al. 2023, "GQA"): ``nkv`` key/value heads
  for ``nh`` query heads, query head i reading kv head ``i // (nh / nkv)``; the
  QKV columns are ``[Q (nh heads) | K (nkv heads) | V (nkv heads)]``
  (``kv_heads=`` of :func:`attention_forward`).
* ``attention="flash"``: the core runs blockwise with an online softmax
  (:mod:`summasim.transformer.flash`), holding no (T, T) array.
* ``recompute="selective"`` (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", section 4.2): the attention core
  keeps only its inputs q, k, v (views of the QKV output) and its output, and
  recomputes the (T, T) probabilities in the backward.

Reduction hooks. Ops that reduce over an axis a parallel scheme may shard take
that reduction as an argument, so Megatron (1D), Optimus (2D) and SUMMA2.5-LM
call *these* functions on their local slices:

* ``layernorm_forward(x, g, b, sum_hidden=..., hidden=h)`` -- statistics over
  the hidden axis; ``sum_hidden(a)`` returns the sum over the last axis of the
  *global* hidden dimension (keepdims).
* ``cross_entropy_forward(logits, targets, vocab_start=..., max_vocab=...,
  sum_vocab=...)`` -- log-sum-exp and target pick over the vocabulary axis.
* ``softmax_forward(x, max_last=..., sum_last=...)`` -- the same for a plain
  softmax.
* ``embedding_forward(tokens, wte, wpe, vocab_start=..., combine_vocab=...)``
  -- a vocab-parallel lookup.

The defaults are the local reductions, so serial callers pass nothing. The
hooks are stored in the cache, so the backward uses the same reduction as the
forward (a parallel scheme tags the trace phase around the call, not inside the
hook). Each hook runs on this process's arrays and returns an array of the
shape stated in the op's docstring; in a parallel scheme it is the local
reduction followed by an all-reduce over the group that shares the axis.

Arrays may be NumPy or CuPy: the array module comes from the inputs
(:func:`summasim.backends.array_module`), and every scalar is a Python float so
float32 stays float32 (NEP 50).

Mixed precision. Inside ``with autocast(precision):`` (a
:class:`summasim.transformer.precision.Precision`) every tensor an op hands on -- its
output in the forward, its input gradient in the backward, and the residual sums of
:func:`block_forward`/:func:`block_backward` -- is rounded to the 16-bit compute type
(in place, in its float32 container), while each op computes in fp32 inside: a GEMM
reads 16-bit inputs and accumulates in fp32, as tensor cores do. Parameter gradients
are not rounded: they accumulate in fp32 (Megatron-LM's ``main_grad``). Outside the
context nothing is rounded, bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from summasim.backends import array_module
from summasim.spec import ATTENTIONS, MLPS

from . import fused
from .fused import GELU_C, GELU_K

LN_EPS = 1e-5
# exp(-2z) is clamped at exp(80) so it never overflows in float32 (max ~exp(88));
# x * sigmoid(2z) is then about 1e-35 * x instead of 0: far below any tolerance.
_GELU_EXP_CLAMP = fused.GELU_EXP_CLAMP

Array = Any
Reduction = Callable[[Array], Array]
#: What an op can recompute: nothing, or the attention core's probabilities
#: ("selective"). Whole-layer recompute ("full") is the caller's: it keeps the layer's
#: input and calls :func:`block_forward` again in the backward.
CORE_RECOMPUTE = ("none", "selective")

_PRECISION: contextvars.ContextVar = contextvars.ContextVar("summasim_autocast", default=None)


@contextlib.contextmanager
def autocast(precision):
    """Within the block, the ops hand on 16-bit values (see the module docstring);
    ``precision`` has ``round(x, out=x)`` (None: no rounding)."""
    token = _PRECISION.set(precision)
    try:
        yield precision
    finally:
        _PRECISION.reset(token)


def stored(x):
    """``x`` as the next op receives it: rounded in place to the 16-bit compute type
    under :func:`autocast`, untouched otherwise."""
    precision = _PRECISION.get()
    if precision is not None and x is not None:
        precision.round(x, out=x)
    return x


_stored = stored          # the ops' own name for it


# --------------------------------------------------------------------------- #
# default (serial) reductions                                                 #
# --------------------------------------------------------------------------- #
def local_sum(a):
    """Sum over the last axis, keepdims: the serial ``sum_hidden``/``sum_vocab``."""
    return a.sum(axis=-1, keepdims=True)


def local_max(a):
    """Max over the last axis, keepdims: the serial ``max_vocab``."""
    return a.max(axis=-1, keepdims=True)


# --------------------------------------------------------------------------- #
# linear                                                                      #
# --------------------------------------------------------------------------- #
class LinearCache(NamedTuple):
    x: Array          # input as rows, (N, C)
    w: Array          # weight, (C, OC)
    has_bias: bool    # whether a bias was added (its gradient is returned)


def linear_forward(x, w, b=None):
    """``y = x @ w + b`` over the last axis of ``x`` (..., C) -> (..., OC).

    ``b`` may be None: a row-parallel (Megatron) caller adds the bias once,
    after the all-reduce of the partial products.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                     # (N, C)
    y = x2 @ w                                          # (N, OC)
    if b is not None:
        y += b
    y = _stored(y.reshape(lead + (w.shape[1],)))        # (..., OC)
    return y, LinearCache(x=x2, w=w, has_bias=b is not None)


def linear_backward(dy, cache):
    """Returns ``dx`` (..., C) and ``{"w": x^T dy, "b": sum(dy)}``."""
    x, w = cache.x, cache.w
    dy2 = dy.reshape(-1, dy.shape[-1])                  # (N, OC)
    dx = _stored((dy2 @ w.T).reshape(dy.shape[:-1] + (w.shape[0],)))  # (..., C)
    grads = {"w": x.T @ dy2}                            # (C, OC)
    if cache.has_bias:
        grads["b"] = dy2.sum(axis=0)                    # (OC,)
    return dx, grads


# --------------------------------------------------------------------------- #
# layernorm                                                                   #
# --------------------------------------------------------------------------- #
class LayerNormCache(NamedTuple):
    xhat: Array             # normalized input, (..., C)
    rstd: Array             # 1 / sqrt(var + eps), (..., 1)
    g: Array                # gain, (C,)
    hidden: int             # size of the full (global) hidden axis
    sum_hidden: Reduction   # the reduction used in forward, reused in backward


def _ln_by_products(sum_hidden, *arrays) -> bool:
    """Whether a LayerNorm takes its sums by products (:func:`layernorm_forward`): the
    serial sum over the hidden axis (a sharded one is the caller's collective), on
    C-contiguous NumPy arrays of one float dtype (float32 or float64)."""
    x = arrays[0]
    return (sum_hidden is local_sum and isinstance(x, np.ndarray)
            and x.dtype in (np.float32, np.float64)
            and all(isinstance(a, np.ndarray) and a.dtype == x.dtype and a.flags.c_contiguous
                    for a in arrays))


def layernorm_forward(x, g, b, *, eps=LN_EPS, sum_hidden: Optional[Reduction] = None,
                      hidden: Optional[int] = None):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * g + b``.

    Parameters
    ----------
    x : (..., C) array; C may be this rank's slice of the hidden axis.
    g, b : (C,) the matching slices of gain and bias.
    sum_hidden : callable ``a (..., C) -> (..., 1)``, the sum over the *whole*
        hidden axis. Default: ``a.sum(-1, keepdims=True)``. A hidden-parallel
        scheme (Optimus: h split over a grid row) passes
        ``lambda a: row.allreduce(a.sum(-1, keepdims=True))``. It is called
        twice in forward (mean, then the centred second moment: two-pass
        variance, stable in float32) and twice in backward.
    hidden : int, the size of the whole hidden axis (default ``C``).

    Every rank then gets exactly its slice of the serial output; ``dg``/``db``
    from the backward are sums over this rank's rows only, so a scheme that
    also splits the rows (batch) all-reduces them over that group.

    With the serial sum on host arrays (:func:`_ln_by_products`) the sums are products
    instead of NumPy's reductions, the same values to round-off in fewer passes: a row
    sum is a matrix-vector product with ones (one BLAS call, 0.2 against 0.8 ms for a
    (2048, 1024) float32 ``sum(-1)``), the squares' sum an ``einsum`` that forms no
    squares, and in the backward ``sum(dout * g)`` is ``dout @ g`` and the column sums
    of ``dg``/``db`` are products with ones. Forward and backward of the default
    ``bench layer``'s (8, 256, 1024) float32 LayerNorm on one thread: 17-19 ms by
    reductions, 12-14 ms by products (1.35-1.38x, in alternating blocks); float64 at
    (16, 64, 256): 1.14-1.21x. Megatron holds every LayerNorm whole on each rank, so
    there it weighs tp times more than in a serial step.
    """
    sum_hidden = local_sum if sum_hidden is None else sum_hidden
    hidden = x.shape[-1] if hidden is None else hidden
    inv_h = 1.0 / hidden
    xp = array_module(x)
    if _ln_by_products(sum_hidden, x):
        ones = np.ones(x.shape[-1], x.dtype)
        mean = (x.reshape(-1, x.shape[-1]) @ ones).reshape(x.shape[:-1] + (1,)) * inv_h
        xhat = x - mean                                 # (..., C)
        var = np.einsum("...c,...c->...", xhat, xhat)[..., None] * inv_h
    else:
        mean = sum_hidden(x) * inv_h                    # (..., 1)
        xhat = x - mean                                 # (..., C)
        var = sum_hidden(xhat * xhat) * inv_h           # (..., 1)
    rstd = 1.0 / xp.sqrt(var + eps)                     # (..., 1)
    if fused.applies(xp):                               # one kernel for the tail
        xhat, out = fused.layernorm_tail(xhat, rstd, g, b)
    else:
        xhat *= rstd
        out = xhat * g                                  # (..., C)
        out += b
    return _stored(out), LayerNormCache(xhat=xhat, rstd=rstd, g=g, hidden=hidden,
                               sum_hidden=sum_hidden)


def layernorm_backward(dout, cache):
    """``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``, ``dxhat = dout * g``.

    The two means are over the whole hidden axis through ``cache.sum_hidden``.
    Returns ``dx`` (..., C) and ``{"g": (C,), "b": (C,)}`` summed over local rows.
    """
    xhat, rstd, g = cache.xhat, cache.rstd, cache.g
    c = xhat.shape[-1]
    inv_h = 1.0 / cache.hidden
    if _ln_by_products(cache.sum_hidden, dout, xhat, rstd, g) and dout.shape == xhat.shape:
        d2, x2 = dout.reshape(-1, c), xhat.reshape(-1, c)
        t = d2 * x2                                            # (N, C)
        ones = np.ones(d2.shape[0], dout.dtype)
        grads = {"g": ones @ t, "b": ones @ d2}                # (C,)
        mean_d = (d2 @ g)[:, None] * inv_h                     # (N, 1): sum(dout * g)
        mean_dx = (t @ g)[:, None] * inv_h                     # (N, 1): sum(dxhat * xhat)
        dx = d2 * g                                            # dxhat
        dx -= mean_d
        np.multiply(x2, mean_dx, out=t)
        dx -= t
        dx *= rstd.reshape(-1, 1)
        return _stored(dx.reshape(dout.shape)), grads
    grads = {"g": (dout * xhat).reshape(-1, c).sum(axis=0),   # (C,)
             "b": dout.reshape(-1, c).sum(axis=0)}            # (C,)
    dxhat = dout * g                                           # (..., C)
    mean_d = cache.sum_hidden(dxhat) * inv_h                   # (..., 1)
    mean_dx = cache.sum_hidden(dxhat * xhat) * inv_h           # (..., 1)
    if fused.applies(array_module(dxhat)):
        return _stored(fused.layernorm_dx(dxhat, mean_d, xhat, mean_dx, rstd)), grads
    dx = dxhat
    dx -= mean_d
    dx -= xhat * mean_dx
    dx *= rstd
    return _stored(dx), grads


# --------------------------------------------------------------------------- #
# gelu                                                                        #
# --------------------------------------------------------------------------- #
class GeluCache(NamedTuple):
    x: Array   # input, (...); the sigmoid is recomputed in backward (memory as torch)


#: Items per block of the host GELU's elementwise chains (:func:`_in_blocks`). Each op
#: of a chain is one pass over its arrays; over a whole (B, T, F) tensor every pass
#: streams it through main memory (9 passes forward, 14 backward), over a block of
#: 64 Ki items (256 KiB in float32; 5 such arrays at most) the passes stay in the
#: core's caches. On the (8, 256, 4096) float32 GELU of the default ``bench layer`` on
#: one thread: forward 64-79 ms whole against 42-55 ms in blocks, backward 121-141 ms
#: against 59-74 (16-64 Ki items per block alike; one float32 ``exp`` pass alone takes
#: 38 ms of each).
GELU_BLOCK = 1 << 16


def _gelu_exp(x, out=None):
    """``e = exp(-2z)``, ``z = K (x + C x^3)`` (clamped so it cannot overflow), into
    ``out`` when given."""
    xp = array_module(x)
    e = xp.multiply(x, x, out=out)                      # (...)
    e *= -2.0 * GELU_K * GELU_C
    e += -2.0 * GELU_K
    e *= x                                              # -2z, using u*u*u not u**3
    xp.minimum(e, _GELU_EXP_CLAMP, out=e)
    xp.exp(e, out=e)
    return e


def _in_blocks(x) -> bool:
    """Whether a GELU chain on ``x`` runs block by block (:data:`GELU_BLOCK`): a
    C-contiguous NumPy array of more than one block. The blocks compute the same ops in
    the same order on each item as the whole-array chain, so the results are equal bit
    for bit."""
    return (array_module(x).__name__ == "numpy" and x.size > GELU_BLOCK
            and x.flags.c_contiguous)


def _gelu_forward_into(x, out):
    """``out = x * sigmoid(2z)`` (:func:`gelu_forward`'s chain) on arrays of one shape."""
    xp = array_module(x)
    _gelu_exp(x, out)
    out += 1.0
    xp.reciprocal(out, out=out)                         # sigmoid(2z)
    out *= x
    return out


def _gelu_backward_into(dout, x, u, e, s):
    """:func:`gelu_backward`'s chain into ``u``, with ``e`` and ``s`` as scratch."""
    xp = array_module(x)
    _gelu_exp(x, e)
    xp.add(e, 1.0, out=s)
    xp.reciprocal(s, out=s)                             # s = sigmoid(2z), recomputed
    e *= s                                              # 1 - s
    e *= s                                              # s (1 - s)
    xp.multiply(x, x, out=u)
    u *= 6.0 * GELU_K * GELU_C
    u += 2.0 * GELU_K
    u *= x                                              # 2 K x (1 + 3 C x^2)
    u *= e
    u += s
    u *= dout
    return u


def gelu_forward(x):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(K (x + 0.044715 x^3)))``.

    Computed as ``x * sigmoid(2z) = x / (1 + exp(-2z))`` (the same function:
    ``1 + tanh z = 2 sigmoid(2z)``); NumPy's exp is far faster than its tanh.
    Elementwise, so any sharding of ``x`` is fine.
    """
    xp = array_module(x)
    if fused.applies(xp):
        return _stored(fused.gelu_forward(x)), GeluCache(x=x)
    out = xp.empty_like(x)                              # (...)
    if _in_blocks(x):
        fx, fo, n = x.reshape(-1), out.reshape(-1), GELU_BLOCK
        for i in range(0, fx.size, n):
            _gelu_forward_into(fx[i:i + n], fo[i:i + n])
    else:
        _gelu_forward_into(x, out)
    return _stored(out), GeluCache(x=x)


def gelu_backward(dout, cache):
    """``d/dx = s + 2 x s (1-s) K (1 + 3 C x^2)`` with ``s = (1 + tanh z)/2``, ``1-s = e s``."""
    xp = array_module(dout)
    x = cache.x
    if fused.applies(xp):
        return _stored(fused.gelu_backward(dout, x)), {}
    u = xp.empty_like(x)                                # (...)
    if _in_blocks(x) and _in_blocks(dout) and dout.shape == x.shape:
        n = GELU_BLOCK
        e, s = xp.empty(n, x.dtype), xp.empty(n, x.dtype)
        fx, fd, fu = x.reshape(-1), dout.reshape(-1), u.reshape(-1)
        for i in range(0, fx.size, n):
            k = min(n, fx.size - i)
            _gelu_backward_into(fd[i:i + k], fx[i:i + k], fu[i:i + k], e[:k], s[:k])
    else:
        _gelu_backward_into(dout, x, u, xp.empty_like(x), xp.empty_like(x))
    return _stored(u), {}


# --------------------------------------------------------------------------- #
# swiglu                                                                      #
# --------------------------------------------------------------------------- #
class SwigluCache(NamedTuple):
    gate: Array   # gate pre-activation x W_gate + b_gate, (..., F); the sigmoid is recomputed
    up: Array     # up projection x W_fc + b_fc, (..., F)


def _sigmoid(z):
    """``1 / (1 + exp(-z))``, with ``-z`` clamped at 80 so exp cannot overflow in float32
    (sigmoid(-80) = 1.8e-35 instead of 0: far below any tolerance)."""
    xp = array_module(z)
    s = -z                                              # (...)
    xp.minimum(s, _GELU_EXP_CLAMP, out=s)
    xp.exp(s, out=s)
    s += 1.0
    xp.reciprocal(s, out=s)
    return s


def swiglu_forward(gate, up):
    """The SwiGLU gating ``silu(gate) * up``, ``silu(z) = z sigmoid(z)``: (..., F) x 2 -> (..., F).

    ``gate = x W_gate + b_gate`` and ``up = x W_fc + b_fc`` are the two projections of
    the MLP input (Shazeer 2020, "GLU Variants Improve Transformer", eq. FFN_SwiGLU,
    with Swish_1 = SiLU). Elementwise, so a scheme holding matching column slices of
    both projections calls it on its slices.
    """
    out = _sigmoid(gate)                                # (..., F)
    out *= gate                                         # silu(gate)
    out *= up
    return _stored(out), SwigluCache(gate=gate, up=up)


def swiglu_backward(dout, cache):
    """``dup = dout silu(g)``, ``dgate = dout up s (1 + g (1 - s))`` with ``s = sigmoid(g)``
    (``d silu/dz = s + z s (1 - s)``). Returns ``((dgate, dup), {})``."""
    g, up = cache.gate, cache.up
    s = _sigmoid(g)                                     # (..., F) recomputed
    dup = g * s                                         # silu(g)
    dup *= dout
    dgate = 1.0 - s                                     # (..., F)
    dgate *= g
    dgate += 1.0
    dgate *= s                                          # d silu / dg
    dgate *= up
    dgate *= dout
    return (_stored(dgate), _stored(dup)), {}


# --------------------------------------------------------------------------- #
# softmax                                                                     #
# --------------------------------------------------------------------------- #
class SoftmaxCache(NamedTuple):
    y: Array               # softmax output, (..., V)
    sum_last: Reduction    # the sum over the (global) last axis


def softmax_forward(x, *, max_last: Optional[Reduction] = None,
                    sum_last: Optional[Reduction] = None):
    """Softmax over the last axis (..., V) -> (..., V).

    ``max_last`` / ``sum_last`` map (..., V) to (..., 1) over the whole (global)
    last axis; a vocab-parallel caller passes the local max/sum followed by an
    all-reduce (MAX / SUM) over its group. The max only stabilizes the
    exponentials but must be the same on every rank.
    """
    max_last = local_max if max_last is None else max_last
    sum_last = local_sum if sum_last is None else sum_last
    xp = array_module(x)
    y = x - max_last(x)                                 # (..., V)
    xp.exp(y, out=y)
    y *= 1.0 / sum_last(y)
    return _stored(y), SoftmaxCache(y=y, sum_last=sum_last)


def softmax_backward(dy, cache):
    """``dx = y * (dy - sum(dy * y))``."""
    y = cache.y
    dx = dy - cache.sum_last(dy * y)                    # (..., V)
    dx *= y
    return _stored(dx), {}


# --------------------------------------------------------------------------- #
# attention                                                                   #
# --------------------------------------------------------------------------- #
def _check_choice(name: str, value, choices) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")


def _head_size(width: int, heads: int, kv_heads: int) -> int:
    """``hd`` of a packed QKV width ``(heads + 2 kv_heads) hd``; ValueError naming the field."""
    for name, val in (("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} does not divide heads={heads} "
                         f"(grouped-query attention)")
    if width % (heads + 2 * kv_heads):
        raise ValueError(f"the QKV width {width} is not (heads + 2 kv_heads) * head size "
                         f"with heads={heads}, kv_heads={kv_heads}")
    return width // (heads + 2 * kv_heads)


def split_heads(qkv, heads, kv_heads=None):
    """Views q (B, nh, T, hd), k and v (B, nkv, T, hd) of a packed QKV tensor (B, T, W).

    The columns are ``[Q | K | V]``: Q the ``nh = heads`` query heads contiguous, then K
    and V the ``nkv = kv_heads`` key/value heads each (default ``heads``; fewer is
    grouped-query attention), so ``W = (nh + 2 nkv) hd``. The views are writable: a
    backward passes them as the ``out`` of the core's gradients.
    """
    b, t, width = qkv.shape
    nkv = heads if kv_heads is None else kv_heads
    hd = _head_size(width, heads, nkv)
    if nkv == heads:
        packed = qkv.reshape(b, t, 3, heads, hd)        # (B, T, 3, nh, hd)
        packed = packed.transpose(2, 0, 3, 1, 4)        # (3, B, nh, T, hd) view
        return packed[0], packed[1], packed[2]
    c, ckv = heads * hd, nkv * hd
    q = qkv[..., :c].reshape(b, t, heads, hd).transpose(0, 2, 1, 3)          # (B, nh, T, hd)
    k = qkv[..., c:c + ckv].reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)     # (B, nkv, T, hd)
    v = qkv[..., c + ckv:].reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)      # (B, nkv, T, hd)
    return q, k, v


def merge_heads(y):
    """(B, nh, T, hd) -> (B, T, nh*hd) (a copy unless already laid out that way)."""
    b, nh, t, hd = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, nh * hd)   # (B, T, C)


def causal_mask(xp, t, dtype):
    """Additive mask (T, T): 0 on and below the diagonal, -inf above."""
    return xp.triu(xp.full((t, t), -math.inf, dtype=dtype), k=1)


def _grouped(a, nkv):
    """(B, nh, T, X) -> (B, nkv, g, T, X) view, ``g = nh / nkv``: the query heads grouped
    by the key/value head they read. ``a`` itself when ``g == 1`` (multi-head attention)."""
    b, nh, t, x = a.shape
    return a if nh == nkv else a.reshape(b, nkv, nh // nkv, t, x)   # (B, nkv, g, T, X)


def _shared(a, g):
    """(B, nkv, T, hd) -> (B, nkv, 1, T, hd) view that broadcasts over a group of ``g``
    query heads (no copy per query head). ``a`` itself when ``g == 1``."""
    return a if g == 1 else a[:, :, None]


def _check_core(q, k, v) -> int:
    """``nkv`` of q (B, nh, T, hd) and k, v (B, nkv, T, hd); ValueError unless they match."""
    if k.shape != v.shape or q.ndim != 4 or k.ndim != 4 or \
            (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"attention core: q must be (B, nh, T, hd) and k, v (B, nkv, T, hd), "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention core: kv heads nkv={k.shape[1]} do not divide the query "
                         f"heads nh={q.shape[1]} (grouped-query attention)")
    return k.shape[1]


class AttentionCoreCache(NamedTuple):
    qs: Array      # q * scale, (B, nh, T, hd)
    k: Array       # (B, nkv, T, hd)
    v: Array       # (B, nkv, T, hd)
    att: Array     # softmax probabilities, (B, nh, T, T); 0 above the diagonal
    y: Array       # output att @ v, (B, nh, T, hd) (read by the backward's row sums)
    scale: float   # 1 / sqrt(hd)


class AttentionInputsCache(NamedTuple):
    """Selective recompute: what the core keeps; ``q * scale`` and the (T, T)
    probabilities are recomputed from these in the backward."""
    q: Array       # (B, nh, T, hd) as given (a view of the QKV output)
    k: Array       # (B, nkv, T, hd)
    v: Array       # (B, nkv, T, hd)
    y: Array       # output, (B, nh, T, hd) (a view of the output projection's input)
    scale: float   # 1 / sqrt(hd)


def attention_probs(qs, k):
    """Causal softmax probabilities ``softmax(qs k^T + mask)`` (B, nh, T, T) of scaled
    queries qs (B, nh, T, hd) against keys k (B, nkv, T, hd).

    The one implementation of the scores, used by the forward and by selective
    recompute, so a recomputed ``att`` is bitwise the forward's. With ``nkv < nh`` the
    queries are viewed as (B, nkv, g, T, hd) and each key head broadcasts over its
    group of g query heads (no copy of k per query head).
    """
    xp = array_module(qs, k)
    b, nh, t, _ = qs.shape
    nkv = k.shape[1]
    att = _grouped(qs, nkv) @ _shared(k, nh // nkv).swapaxes(-1, -2)   # (B, nkv, g, T, T)
    if fused.applies(xp):
        att += fused.causal_mask(xp, t, att.dtype)
        fused.exp_sub(att, att.max(axis=-1, keepdims=True), att)
    else:
        att += causal_mask(xp, t, att.dtype)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
    att *= 1.0 / att.sum(axis=-1, keepdims=True)
    return att.reshape(b, nh, t, t)                     # (B, nh, T, T) view


def attention_core_forward(q, k, v, *, out=None, attention="plain", recompute="none",
                           tile=None):
    """Causal attention of already-projected heads: ``softmax(q k^T / sqrt(hd) + mask) v``.

    Parameters
    ----------
    q : (B, nh, T, hd) queries; k, v : (B, nkv, T, hd) keys and values with
        ``nh % nkv == 0`` (query head i reads kv head ``i // (nh / nkv)``; ``nkv == nh``
        is multi-head attention). Strided views are fine. Heads are independent, so a
        scheme holding a subset of the heads (Megatron: nh/p heads; Optimus: nh/q heads
        of b/q sequences) calls this on its subset.
    out : optional writable (B, nh, T, hd) array (e.g. a head view of a (B, T, C)
        buffer, so merging heads costs no copy).
    attention : ``"plain"`` (the (B, nh, T, T) probabilities are formed and, without
        recompute, kept) or ``"flash"``
        (:func:`summasim.transformer.flash.flash_attention_forward`: blockwise, online
        softmax, no (T, T) array; ``tile`` is its key/value tile, default flash's).
    recompute : ``"none"`` or ``"selective"``: keep only q, k, v and y
        (:class:`AttentionInputsCache`) and recompute ``q * scale`` and the
        probabilities in the backward (Korthikanti et al. 2022, section 4.2). The
        product ``att @ v`` is not recomputed: its result y is kept anyway, as the
        output projection's input. Flash keeps no (T, T) array, so for it
        "selective" is "none".

    Returns ``y`` (B, nh, T, hd) and the cache (:class:`AttentionCoreCache`,
    :class:`AttentionInputsCache` or flash's ``FlashCache``).
    """
    _check_choice("attention", attention, ATTENTIONS)
    _check_choice("recompute", recompute, CORE_RECOMPUTE)
    nkv = _check_core(q, k, v)
    if attention == "flash":
        from . import flash       # same floor
        y, cache = flash.flash_attention_forward(q, k, v, out=out,
                                                 **({} if tile is None else {"tile": tile}))
        return _stored(y), cache
    xp = array_module(q, k, v)
    b, nh, t, hd = q.shape
    scale = 1.0 / math.sqrt(hd)
    qs = q * scale                                      # (B, nh, T, hd)
    att = attention_probs(qs, k)                        # (B, nh, T, T)
    if out is None and nkv == nh:
        y = att @ v                                     # (B, nh, T, hd)
    else:
        y = xp.empty(q.shape, dtype=att.dtype) if out is None else out
        xp.matmul(_grouped(att, nkv), _shared(v, nh // nkv),
                  out=_grouped(y, nkv))                 # (B, nkv, g, T, hd) view of y
    _stored(y)
    if recompute == "selective":
        return y, AttentionInputsCache(q=q, k=k, v=v, y=y, scale=scale)
    return y, AttentionCoreCache(qs=qs, k=k, v=v, att=att, y=y, scale=scale)


def attention_core_recompute(cache: AttentionInputsCache) -> AttentionCoreCache:
    """The full core cache rebuilt from a selective one: ``qs = q * scale`` and the
    probabilities recomputed exactly as the forward computed them (bitwise)."""
    qs = cache.q * cache.scale                          # (B, nh, T, hd)
    return AttentionCoreCache(qs=qs, k=cache.k, v=cache.v, att=attention_probs(qs, cache.k),
                              y=cache.y, scale=cache.scale)


def attention_core_backward(dy, cache, *, out=None):
    """Gradients ``(dq, dk, dv)`` of the core attention for ``dy`` (B, nh, T, hd).

    The softmax backward's row sums ``sum_j att_ij datt_ij`` equal
    ``sum_d dy_id y_id`` (FlashAttention's D_i), a (B, nh, T, hd) product instead
    of a (B, nh, T, T) one. With grouped-query attention dk and dv (B, nkv, T, hd) are
    summed over the g query heads of each group. ``out`` optionally gives three
    writable arrays (dq like q, dk and dv like k) to receive them. A selective cache
    recomputes the probabilities first; a flash cache goes to flash's backward.
    Returns ``((dq, dk, dv), {})``.
    """
    if isinstance(cache, AttentionInputsCache):
        cache = attention_core_recompute(cache)         # selective recompute
    elif not isinstance(cache, AttentionCoreCache):
        from . import flash       # same floor
        if not isinstance(cache, flash.FlashCache):
            raise TypeError(f"attention_core_backward: not an attention core cache: "
                            f"{type(cache).__name__}")
        (dq, dk, dv), _ = flash.flash_attention_backward(dy, cache, out=out)
        return (_stored(dq), _stored(dk), _stored(dv)), {}
    xp = array_module(dy)
    qs, k, v, att, y = cache.qs, cache.k, cache.v, cache.att, cache.y
    nh, nkv = qs.shape[1], k.shape[1]
    g = nh // nkv
    dq, dk, dv = (None, None, None) if out is None else out
    attg = _grouped(att, nkv)                           # (B, nkv, g, T, T) view
    dyg = _grouped(dy, nkv)                             # (B, nkv, g, T, hd) view
    if g == 1:
        dv = xp.matmul(att.swapaxes(-1, -2), dy, out=dv)    # (B, nh, T, hd)
    else:   # dv = sum over the group of att^T dy
        dv = xp.sum(attg.swapaxes(-1, -2) @ dyg, axis=2, out=dv)   # (B, nkv, T, hd)
    ds = dyg @ _shared(v, g).swapaxes(-1, -2)           # (B, nkv, g, T, T) d(att)
    ds -= _grouped((dy * y).sum(axis=-1, keepdims=True), nkv)   # minus row sums (.., T, 1)
    ds *= attg                                          # d(scores); 0 above the diagonal
    if g == 1:
        dk = xp.matmul(ds.swapaxes(-1, -2), qs, out=dk)     # (B, nh, T, hd)
        dq = xp.matmul(ds, k, out=dq)                       # (B, nh, T, hd)
    else:   # dk = sum over the group of ds^T qs; dq of each query head from its kv head
        dk = xp.sum(ds.swapaxes(-1, -2) @ _grouped(qs, nkv), axis=2, out=dk)  # (B, nkv, T, hd)
        dq = xp.empty(qs.shape, dtype=ds.dtype) if dq is None else dq        # (B, nh, T, hd)
        xp.matmul(ds, k[:, :, None], out=_grouped(dq, nkv))  # (B, nkv, g, T, hd) view of dq
    dq *= cache.scale
    return (_stored(dq), _stored(dk), _stored(dv)), {}


class AttentionCache(NamedTuple):
    qkv: LinearCache          # the QKV projection
    core: Any                 # the heads: AttentionCoreCache, AttentionInputsCache or FlashCache
    proj: LinearCache         # the output projection
    heads: int                # query heads held by this call
    kv_heads: Optional[int] = None   # key/value heads held by this call (None: heads)


def attention_forward(x, qkv_w, qkv_b, proj_w, proj_b, heads, *, kv_heads=None,
                      attention="plain", recompute="none", tile=None):
    """Causal multi-head (or grouped-query) self-attention: x (B, T, C) -> (B, T, C_out).

    ``qkv_w`` (C, C' + 2 C'_kv) packs ``[Q | K | V]``: ``heads`` query heads of size
    ``hd = C'/heads`` contiguous, then ``kv_heads`` key heads and ``kv_heads`` value
    heads (default ``heads``: ``C'_kv = C'``); ``proj_w`` is (C', C_out). Serially
    ``C' = C_out = C``. A Megatron rank passes its column slice of qkv (the Q, K and
    V columns of its heads, still ordered [Q | K | V]), its row slice of proj,
    ``proj_b=None`` and ``heads = nh / p`` (``kv_heads = nkv / p``); the output is
    then its partial sum, to be all-reduced before the bias is added.
    ``attention``, ``recompute`` and ``tile`` go to :func:`attention_core_forward`.
    Gradients are keyed ``"qkv.w", "qkv.b", "proj.w", "proj.b"``.
    """
    xp = array_module(x)
    b, t, _ = x.shape
    qkv, qkv_cache = linear_forward(x, qkv_w, qkv_b)   # (B, T, C' + 2 C'_kv)
    q, k, v = split_heads(qkv, heads, kv_heads)         # (B, nh, T, hd), 2 x (B, nkv, T, hd) views
    hd = q.shape[-1]
    y = xp.empty((b, t, heads * hd), dtype=qkv.dtype)   # (B, T, C') merged heads
    y_heads = y.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)  # (B, nh, T, hd) view
    _, core_cache = attention_core_forward(q, k, v, out=y_heads, attention=attention,
                                           recompute=recompute, tile=tile)
    out, proj_cache = linear_forward(y, proj_w, proj_b)  # (B, T, C_out)
    return out, AttentionCache(qkv=qkv_cache, core=core_cache, proj=proj_cache, heads=heads,
                               kv_heads=k.shape[1])


def attention_backward(dout, cache):
    """Returns ``dx`` (B, T, C) and grads ``qkv.w, qkv.b, proj.w, proj.b``."""
    xp = array_module(dout)
    b, t, _ = dout.shape
    nh = cache.heads
    nkv = nh if cache.kv_heads is None else cache.kv_heads
    dy, g_proj = linear_backward(dout, cache.proj)      # (B, T, C')
    hd = dy.shape[-1] // nh
    dy_heads = dy.reshape(b, t, nh, hd).transpose(0, 2, 1, 3)      # (B, nh, T, hd) view
    dqkv = xp.empty((b, t, (nh + 2 * nkv) * hd), dtype=dy.dtype)   # (B, T, C' + 2 C'_kv)
    attention_core_backward(dy_heads, cache.core, out=split_heads(dqkv, nh, nkv))
    dx, g_qkv = linear_backward(dqkv, cache.qkv)        # (B, T, C)
    grads = {"qkv.w": g_qkv["w"], "proj.w": g_proj["w"]}
    if "b" in g_qkv:
        grads["qkv.b"] = g_qkv["b"]
    if "b" in g_proj:
        grads["proj.b"] = g_proj["b"]
    return dx, grads


# --------------------------------------------------------------------------- #
# embedding                                                                   #
# --------------------------------------------------------------------------- #
class EmbeddingCache(NamedTuple):
    rows: Array            # local table row of each token, (B, T) (0 where masked)
    mask: Optional[Array]  # token lives in this vocab shard, (B, T) bool; None: all do
    wte_shape: tuple       # (V_local, C)
    wpe_shape: Optional[tuple]  # (S, C), or None when no position table was given


def _scatter_add_rows(xp, index, rows, nrows):
    """``out[index[i]] += rows[i]`` into zeros (nrows, C), in a fixed order.

    NumPy: stable sort + ``add.reduceat`` (``np.add.at`` is slow on older NumPy).
    Other array modules (CuPy): :func:`_scatter_add_passes`, not their ``add.at``,
    whose atomic adds sum a repeated row in whatever order the threads arrive, so
    that the same gradient could differ in its last bits from run to run (a
    checkpointed backward against a plain one, one replica against another).
    """
    out = xp.zeros((nrows, rows.shape[-1]), dtype=rows.dtype)   # (V, C)
    if index.size == 0:
        return out
    if getattr(xp, "__name__", "") == "numpy":
        order, sidx, first, starts = _sorted_runs(xp, index)
        out[sidx[starts]] = xp.add.reduceat(rows[order], starts, axis=0)  # (U, C)
    else:
        _scatter_add_passes(xp, index, rows, out)
    return out


def _stable(xp) -> dict:
    """argsort's keyword for a stable sort: NumPy's on request; CuPy's argsort is always
    stable and takes no kind."""
    return {"kind": "stable"} if getattr(xp, "__name__", "") == "numpy" else {}


def _sorted_runs(xp, index):
    """``(order, sorted index, run-start mask, run starts)`` of a stable sort of the
    1-D ``index``: equal values form runs, in their original order within a run."""
    order = xp.argsort(index, **_stable(xp))            # (N,)
    sidx = index[order]                                 # (N,)
    first = xp.empty(sidx.shape, dtype=bool)            # (N,) start of each run
    first[0] = True
    xp.not_equal(sidx[1:], sidx[:-1], out=first[1:])
    return order, sidx, first, xp.flatnonzero(first)    # starts: (U,)


def _scatter_add_passes(xp, index, rows, out):
    """``out[index[i]] += rows[i]`` for every i, in order of i for each target row,
    without atomics: pass k adds the k-th occurrence of every index at once (the
    indices of one pass are distinct, so a gather-add-scatter is exact). As many
    passes as the most frequent index has occurrences (each a few kernel launches: a
    token that fills a tenth of a 16k-token batch costs about 1,600 passes, tens of ms);
    the sums are those of a sequential loop over i (``np.add.at``), bit for bit."""
    order, sidx, first, starts = _sorted_runs(xp, index)
    run = xp.cumsum(first) - 1                          # (N,) run of each sorted item
    pos = xp.arange(sidx.shape[0]) - starts[run]        # (N,) occurrence number
    by = order[xp.argsort(pos, **_stable(xp))]          # (N,) pass by pass
    lo = 0
    for count in xp.bincount(pos).tolist():             # items per pass (one host read)
        sel = by[lo:lo + count]
        out[index[sel]] += rows[sel]
        lo += count


def embedding_forward(tokens, wte, wpe=None, *, vocab_start=0,
                      combine_vocab: Optional[Reduction] = None):
    """Token plus position embedding: ``wte[tokens] + wpe[:T]``, (B, T) -> (B, T, C).

    Parameters
    ----------
    tokens : (B, T) integer array of global token ids.
    wte : (V_local, C) rows ``vocab_start .. vocab_start + V_local`` of the table.
    wpe : (S, C) position table (S >= T) or None (the caller adds positions).
    vocab_start : first global id held in ``wte``. Tokens outside this shard
        contribute zeros.
    combine_vocab : callable ``(B, T, C) -> (B, T, C)`` applied to the token
        part before positions are added; a vocab-parallel scheme passes an
        all-reduce over its vocab group (its backward is the identity, so the
        backward needs no hook). Default: identity.

    A hidden-parallel caller passes its column slices of ``wte``/``wpe``.
    """
    xp = array_module(wte)
    v_local = wte.shape[0]
    if vocab_start == 0 and combine_vocab is None:
        rows, mask = tokens, None
        x = wte[tokens]                                 # (B, T, C)
    else:
        local = tokens - vocab_start                    # (B, T)
        mask = (local >= 0) & (local < v_local)         # (B, T)
        rows = xp.where(mask, local, 0)                 # (B, T)
        x = wte[rows]                                   # (B, T, C)
        x *= mask[..., None]
        if combine_vocab is not None:
            x = combine_vocab(x)
    if wpe is not None:
        x += wpe[: tokens.shape[1]]
    return _stored(x), EmbeddingCache(rows=rows, mask=mask, wte_shape=wte.shape,
                             wpe_shape=None if wpe is None else wpe.shape)


def embedding_backward(dout, cache):
    """Scatter-add ``dout`` (B, T, C) into ``wte`` rows; sum it over the batch for ``wpe``.

    Returns ``(None, {"wte": (V_local, C), "wpe": (S, C)})`` (no input gradient:
    tokens are integers). ``dwpe`` rows past T are zero.
    """
    xp = array_module(dout)
    c = dout.shape[-1]
    d2 = dout.reshape(-1, c)                            # (N, C)
    rows = cache.rows.reshape(-1)                       # (N,)
    if cache.mask is not None:
        keep = cache.mask.reshape(-1)                   # (N,)
        d2, rows = d2[keep], rows[keep]                 # (N_local, C), (N_local,)
    grads = {"wte": _scatter_add_rows(xp, rows, d2, cache.wte_shape[0])}  # (V_local, C)
    if cache.wpe_shape is not None:
        dwpe = xp.zeros(cache.wpe_shape, dtype=dout.dtype)    # (S, C)
        dwpe[: dout.shape[1]] = dout.sum(axis=0)              # (T, C)
        grads["wpe"] = dwpe
    return None, grads


# --------------------------------------------------------------------------- #
# LM head (tied) and cross-entropy                                            #
# --------------------------------------------------------------------------- #
class LMHeadCache(NamedTuple):
    x: Array     # final hidden states as rows, (N, C)
    wte: Array   # (V_local, C) the tied embedding table


def lm_head_forward(x, wte):
    """Tied LM head: ``logits = x @ wte^T``, (..., C) -> (..., V_local).

    A vocab-parallel rank passes its rows of ``wte`` and gets its vocab slice of
    the logits, ready for :func:`cross_entropy_forward` with ``vocab_start``.
    """
    x2 = x.reshape(-1, x.shape[-1])                     # (N, C)
    logits = x2 @ wte.T                                 # (N, V)
    return (_stored(logits.reshape(x.shape[:-1] + (wte.shape[0],))),   # (..., V)
            LMHeadCache(x=x2, wte=wte))


def lm_head_backward(dlogits, cache):
    """Returns ``dx = dlogits @ wte`` (..., C) and ``{"wte": dlogits^T @ x}`` (V, C)."""
    d2 = dlogits.reshape(-1, dlogits.shape[-1])         # (N, V)
    dx = (d2 @ cache.wte).reshape(dlogits.shape[:-1] + (cache.wte.shape[1],))  # (..., C)
    return _stored(dx), {"wte": d2.T @ cache.x}         # (V, C)


class CrossEntropyCache(NamedTuple):
    probs: Array           # softmax over the (global) vocab, this rank's columns, (N, V_local)
    target: Array          # local column of each target, (N,) (0 where masked)
    mask: Optional[Array]  # target lives in this shard, (N,) bool; None: always
    shape: tuple           # leading shape of the logits, e.g. (B, T)


def cross_entropy_forward(logits, targets, *, vocab_start=0,
                          max_vocab: Optional[Reduction] = None,
                          sum_vocab: Optional[Reduction] = None,
                          vocab_valid: Optional[int] = None):
    """Per-token cross-entropy ``logsumexp(logits) - logits[target]``.

    Parameters
    ----------
    logits : (..., V_local) this rank's columns ``vocab_start .. vocab_start +
        V_local`` of the logits (all of them serially).
    targets : (...) integer array of *global* target ids (same array module as
        ``logits``).
    vocab_start : the first global id of this shard.
    max_vocab : callable ``(N, V_local) -> (N, 1)``, the max over the whole
        vocabulary (a parallel caller: local max, then all-reduce MAX). Only a
        stabilizer, but it must be identical on every rank.
    sum_vocab : callable ``(N, k) -> (N, 1)``, the sum over the whole vocabulary
        (a parallel caller: local sum over the last axis, then all-reduce SUM).
        It is called twice: on the exponentials (N, V_local), and on the picked
        target logit (N, 1), which is 0 on ranks that do not hold the target,
        so the sum delivers it to every rank.
    vocab_valid : how many of this rank's columns are real ids (default all); the rest
        pad the vocabulary to a multiple of the ranks and are left out of the softmax
        (their probability and gradient are 0).

    Returns the per-token losses (...) -- the caller takes the mean and seeds
    the backward with ``dlosses = 1 / n_tokens`` -- and the cache. Every rank of
    a vocab group gets the same losses and its own columns of ``dlogits``.
    """
    xp = array_module(logits)
    max_vocab = local_max if max_vocab is None else max_vocab
    sum_vocab = local_sum if sum_vocab is None else sum_vocab
    lead = logits.shape[:-1]
    v_local = logits.shape[-1]
    z = logits.reshape(-1, v_local)                     # (N, V)
    n = z.shape[0]
    if vocab_valid is not None and vocab_valid < v_local:  # padding ids: out of the softmax
        z = z.copy()
        z[:, max(int(vocab_valid), 0):] = -xp.inf
    m = max_vocab(z)                                    # (N, 1)
    probs = z - m                                       # (N, V)
    xp.exp(probs, out=probs)
    total = sum_vocab(probs)                            # (N, 1)
    tgt = targets.reshape(-1) - vocab_start             # (N,)
    mask = (tgt >= 0) & (tgt < v_local)                 # (N,)
    full = bool(mask.all()) if n else True
    if full:
        mask = None
    else:
        tgt = xp.where(mask, tgt, 0)                    # (N,)
    picked = z[xp.arange(n), tgt][:, None]              # (N, 1)
    if mask is not None:                                # 0 off-shard (where, not *: a
        picked = xp.where(mask[:, None], picked, 0)     # padding column is -inf) (N, 1)
    picked = sum_vocab(picked)                          # (N, 1)
    losses = (xp.log(total) + m - picked)[:, 0]         # (N,)
    probs *= 1.0 / total
    return losses.reshape(lead), CrossEntropyCache(probs=probs, target=tgt, mask=mask, shape=lead)


def cross_entropy_backward(dlosses, cache):
    """``dlogits = dlosses * (softmax - onehot(target))`` on this rank's columns.

    ``dlosses`` has the leading shape of the logits (``1/n_tokens`` everywhere
    for a mean loss). Returns ``dlogits`` (..., V_local) and ``{}``.
    """
    xp = array_module(cache.probs)
    n, v_local = cache.probs.shape
    d = dlosses.reshape(-1)                             # (N,)
    dz = cache.probs * d[:, None]                       # (N, V)
    rows = xp.arange(n)                                 # (N,)
    if cache.mask is None:
        dz[rows, cache.target] -= d
    else:
        dz[rows[cache.mask], cache.target[cache.mask]] -= d[cache.mask]
    return _stored(dz.reshape(cache.shape + (v_local,))), {}


# --------------------------------------------------------------------------- #
# classification head on the last token                                       #
# --------------------------------------------------------------------------- #
class ClassifierCache(NamedTuple):
    x_last: Array   # hidden state of the last token, (B, C)
    w: Array        # (C, K)
    shape: tuple    # (B, T, C) of the input


def classifier_forward(x, w, b):
    """Logits ``x[:, -1] @ w + b`` from the last token: (B, T, C) -> (B, K).

    Gradients are keyed ``"w"``, ``"b"`` (the model stores them as ``cls.w``, ``cls.b``).
    """
    x_last = x[:, -1, :]                                # (B, C)
    logits = x_last @ w                                 # (B, K)
    logits += b
    return _stored(logits), ClassifierCache(x_last=x_last, w=w, shape=x.shape)


def classifier_backward(dlogits, cache):
    """``dx`` (B, T, C), zero except at the last position; ``{"w", "b"}``."""
    xp = array_module(dlogits)
    dx = xp.zeros(cache.shape, dtype=dlogits.dtype)     # (B, T, C)
    dx[:, -1, :] = dlogits @ cache.w.T                  # (B, C)
    return _stored(dx), {"w": cache.x_last.T @ dlogits,          # (C, K)
                "b": dlogits.sum(axis=0)}               # (K,)


# --------------------------------------------------------------------------- #
# one transformer layer                                                       #
# --------------------------------------------------------------------------- #
BLOCK_KEYS = ("ln1.g", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
              "ln2.g", "ln2.b", "mlp.fc.w", "mlp.fc.b", "mlp.proj.w", "mlp.proj.b")
#: A SwiGLU layer's keys: ``mlp.fc`` is the up projection, ``mlp.gate`` the gate.
SWIGLU_BLOCK_KEYS = BLOCK_KEYS[:10] + ("mlp.gate.w", "mlp.gate.b") + BLOCK_KEYS[10:]


def block_keys(mlp: str = "gelu") -> tuple:
    """A layer's local parameter keys in order: :data:`BLOCK_KEYS` (GELU MLP) or
    :data:`SWIGLU_BLOCK_KEYS` (``mlp="swiglu"``: ``mlp.gate.w/b`` after ``mlp.fc.w/b``)."""
    _check_choice("mlp", mlp, MLPS)
    return SWIGLU_BLOCK_KEYS if mlp == "swiglu" else BLOCK_KEYS


class BlockCache(NamedTuple):
    ln1: LayerNormCache
    attn: AttentionCache
    ln2: LayerNormCache
    fc: LinearCache                       # the MLP's first projection (SwiGLU: the up one)
    gelu: Optional[GeluCache]             # GELU MLP; None for SwiGLU
    proj: LinearCache
    gate: Optional[LinearCache] = None    # SwiGLU: the gate projection
    swiglu: Optional[SwigluCache] = None  # SwiGLU: the gating silu(gate) * up


def block_forward(x, p, heads, *, sum_hidden: Optional[Reduction] = None,
                  hidden: Optional[int] = None, kv_heads: Optional[int] = None,
                  mlp: str = "gelu", attention: str = "plain", recompute: str = "none",
                  tile: Optional[int] = None):
    """One pre-LayerNorm GPT-2 layer, (B, T, C) -> (B, T, C).

    ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``. ``p`` holds the layer's
    parameters under the local keys of :func:`block_keys` (``"ln1.g"``, ...,
    ``"mlp.proj.b"``); ``sum_hidden``/``hidden`` go to both LayerNorms. The MLP is
    ``proj(gelu(fc(x)))`` or, with ``mlp="swiglu"``, ``proj(silu(gate(x)) * fc(x))``;
    ``kv_heads``, ``attention``, ``recompute`` (``"none"`` or ``"selective"``) and
    ``tile`` go to the attention. The input ``x`` is not modified and not saved (a
    caller recomputing whole layers, ``recompute="full"``, keeps it itself).
    """
    _check_choice("mlp", mlp, MLPS)
    if recompute == "full":
        raise ValueError("block_forward: recompute='full' is the caller's (keep the layer "
                         "input, run block_forward again in the backward); pass 'none' "
                         "or 'selective'")
    a, ln1 = layernorm_forward(x, p["ln1.g"], p["ln1.b"], sum_hidden=sum_hidden, hidden=hidden)
    a, attn = attention_forward(a, p["attn.qkv.w"], p["attn.qkv.b"],
                                p["attn.proj.w"], p["attn.proj.b"], heads, kv_heads=kv_heads,
                                attention=attention, recompute=recompute, tile=tile)  # (B, T, C)
    a += x                                              # residual 1 (x1 = x + attn)
    _stored(a)
    m, ln2 = layernorm_forward(a, p["ln2.g"], p["ln2.b"], sum_hidden=sum_hidden, hidden=hidden)
    gelu = gate = swiglu = None
    if mlp == "gelu":
        m, fc = linear_forward(m, p["mlp.fc.w"], p["mlp.fc.b"])     # (B, T, F)
        m, gelu = gelu_forward(m)                                   # (B, T, F)
    else:
        u, fc = linear_forward(m, p["mlp.fc.w"], p["mlp.fc.b"])     # (B, T, F) up
        g, gate = linear_forward(m, p["mlp.gate.w"], p["mlp.gate.b"])  # (B, T, F) gate
        m, swiglu = swiglu_forward(g, u)                            # (B, T, F)
    m, proj = linear_forward(m, p["mlp.proj.w"], p["mlp.proj.b"])  # (B, T, C)
    m += a                                              # residual 2
    _stored(m)
    return m, BlockCache(ln1=ln1, attn=attn, ln2=ln2, fc=fc, gelu=gelu, proj=proj, gate=gate,
                         swiglu=swiglu)


def block_backward(dout, cache):
    """The forward read in reverse; returns ``dx`` (B, T, C) and grads under
    :func:`block_keys` of the cache's MLP."""
    grads = {}
    dm, g = linear_backward(dout, cache.proj)           # (B, T, F)
    grads["mlp.proj.w"], grads["mlp.proj.b"] = g["w"], g["b"]
    if cache.swiglu is None:
        mlp = "gelu"
        dm, _ = gelu_backward(dm, cache.gelu)           # (B, T, F)
        dm, g = linear_backward(dm, cache.fc)           # (B, T, C)
        grads["mlp.fc.w"], grads["mlp.fc.b"] = g["w"], g["b"]
    else:
        mlp = "swiglu"
        (dgate, dup), _ = swiglu_backward(dm, cache.swiglu)   # 2 x (B, T, F)
        dm, g = linear_backward(dup, cache.fc)          # (B, T, C)
        grads["mlp.fc.w"], grads["mlp.fc.b"] = g["w"], g["b"]
        dgx, g = linear_backward(dgate, cache.gate)     # (B, T, C)
        grads["mlp.gate.w"], grads["mlp.gate.b"] = g["w"], g["b"]
        dm += dgx                                       # both projections read ln2's output
        _stored(dm)
    dx1, g = layernorm_backward(dm, cache.ln2)          # (B, T, C)
    grads["ln2.g"], grads["ln2.b"] = g["g"], g["b"]
    dx1 += dout                                         # residual 2
    _stored(dx1)
    da, g = attention_backward(dx1, cache.attn)         # (B, T, C)
    for key, val in g.items():
        grads["attn." + key] = val
    dx, g = layernorm_backward(da, cache.ln1)           # (B, T, C)
    grads["ln1.g"], grads["ln1.b"] = g["g"], g["b"]
    dx += dx1                                           # residual 1
    return _stored(dx), {key: grads[key] for key in block_keys(mlp)}
