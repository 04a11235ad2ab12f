"""Numerical validation against serial references: derived tolerances and errors.

Error measure
-------------
For a product C = A B of contraction length k, the error of entry (i, j) is
measured against the natural scale of that entry, (|A| |B|)_ij::

    err = max_ij |C - C_ref|_ij / (|A| |B|)_ij

Tolerance
---------
With unit roundoff u (2^-53 for float64, 2^-24 for float32), a dot product of
length k computed in any summation order satisfies, with probability at least
1 - 2 exp(-lambda^2 / 2) per entry (Higham & Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019)::

    |c_hat - c| <= lambda sqrt(k) u (|A| |B|)_ij

We take lambda = 8 (failure probability below 3e-14 per entry) and count the
rounding of both the result (u of its dtype) and the float64 reference (u_64)::

    tol(k, dtype) = 8 sqrt(k) (u + u_64)

For k = 1024 that is 1.4e-14 in float64 and 1.5e-5 in float32, inside the
project's stated bounds of about 1e-12 and 1e-5. A sum over p ranks (all-reduce)
is a dot product of length p with ones.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LAMBDA = 8.0
#: The 16-bit compute types of mixed precision and their unit roundoffs 2^-p, p the
#: significand bits with the implicit one: bfloat16 8, float16 11 (IEEE 754-2008
#: binary16; bfloat16: Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning
#: Training", section 2).
HALF_UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def unit_roundoff(dtype) -> float:
    """u = eps / 2 of a floating dtype (``"bfloat16"`` by name too)."""
    name = str(getattr(dtype, "__name__", dtype))
    if name in HALF_UNIT_ROUNDOFF:
        return HALF_UNIT_ROUNDOFF[name]
    return float(np.finfo(np.dtype(dtype)).eps) / 2.0


def tolerance(k: int, dtype) -> float:
    """Derived bound on the scaled error of a length-``k`` contraction in ``dtype``.

    It covers relative rounding of normal numbers, not underflow: float32 operands near
    1e-21, whose products are subnormal, can exceed it in a correct product."""
    return LAMBDA * math.sqrt(max(int(k), 1)) * (unit_roundoff(dtype) + unit_roundoff(np.float64))


def scaled_error(c, ref, scale) -> float:
    """``max |c - ref| / scale`` over entries (entries with zero scale must match exactly).

    NaN when any entry of ``c``, ``ref`` or ``scale`` is not finite: a non-finite
    value is never "exact", and ``NaN <= bound`` is false, so such a check fails.
    """
    c = np.asarray(c, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    if not (np.isfinite(c).all() and np.isfinite(ref).all() and np.isfinite(scale).all()):
        return math.nan
    diff = np.abs(c - ref)
    if diff.size == 0:
        return 0.0
    tiny = np.finfo(np.float64).tiny
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale > tiny, diff / np.maximum(scale, tiny),
                         np.where(diff > 0, np.inf, 0.0))
    return float(ratio.max())


def passes(error: float, bound: float) -> bool:
    """The verdict of one check: the error is a finite number within the bound."""
    return bool(math.isfinite(error) and error <= bound)


def product_error(c, a, b) -> float:
    """Scaled error of ``c`` against ``a @ b`` computed in float64 (host arrays)."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    return scaled_error(c, a64 @ b64, np.abs(a64) @ np.abs(b64))


# ---------------------------------------------------------------------------------------
# Training steps
#
# A training step is a chain of contractions: per transformer block, forward, the QKV
# projection (length h), the attention scores (h / heads) and their weighted sum (s), the
# output projection (h), the MLP (h, then f h); the head (h) and the softmax over the
# vocabulary (v); backward, the transposed products, and the weight gradients, each a sum
# over every token of the global batch (b s: the micro-batches and the data-parallel sum
# are the same sum in another order). Each contraction adds at most
# lambda sqrt(K) (u + u_64) of its scale (Higham & Mary, as above) and passes on the error
# of its inputs; summed along the chain of D contractions that reach the deepest gradient
# (forward and back through every layer) with K the longest contraction, the scaled
# error of every loss, logit and gradient tensor is at most
#
#     tol_step = lambda sqrt(K) (u + u_64) D,   K = max(b s, f h, v, s, h),
#     D = 2 (6 L + 1)        (6 contractions per block, 1 for the head; there and back)
#
# measured as ``max |par - ser| / max |ser|`` per tensor against a float64 serial model.
# The bound assumes that no tensor cancels more than the sqrt(K) a sum of K terms of
# random sign does; the sweep (scripts/bounds-sweep.py) records its headroom.
GEMMS_PER_BLOCK = 6


def _contraction_and_depth(config, batch: int) -> tuple[int, int]:
    """``(K, D)`` of the section above."""
    width = getattr(config, "ffn_width", None) or round(config.ffn_mult * config.hidden)
    k = max(int(batch) * config.seq, int(width), config.vocab, config.seq, config.hidden)
    return k, 2 * (GEMMS_PER_BLOCK * config.layers + 1)


def training_tolerance(config, batch: int, dtype, grad_reduce=None,
                       partials: int = 1) -> float:
    """Derived bound on the scaled error of one training step's loss, logits and
    gradients (see the section above). ``config`` has seq, hidden, heads, layers, vocab
    and ffn_width (or ffn_mult); ``batch`` is the GLOBAL batch in sequences. A 16-bit
    ``dtype`` ("bfloat16", "float16") is mixed precision: :func:`mixed_tolerance`, with
    ``grad_reduce`` and ``partials`` as it takes them."""
    if str(getattr(dtype, "__name__", dtype)) in HALF_UNIT_ROUNDOFF:
        return mixed_tolerance(config, batch, dtype, grad_reduce, partials)
    k, depth = _contraction_and_depth(config, batch)
    return tolerance(k, dtype) * depth


# Mixed precision (16-bit compute, fp32 accumulation, fp32 master weights) against the
# float64 serial model. Each contraction of the chain above now
#   - reads two inputs rounded to 16 bits: relative errors of at most u_16 on each factor,
#     independent across the K products, so at most lambda 2 u_16 of its scale (Higham &
#     Mary's model, as above, applied to the K products' relative errors);
#   - accumulates in fp32: lambda sqrt(K) (u_32 + u_64), as above;
#   - stores its result in 16 bits: u_16.
# Along the chain of D contractions these independent errors add in quadrature (the same
# probabilistic model: a sum of D independent mean-zero errors), not linearly:
#
#     tol_mixed = sqrt(D) (lambda sqrt(K) (u_32 + u_64) + (2 lambda + 1) u_16)
#
# For bfloat16 (u_16 = 2^-8) and the tiny model (L = 2, D = 26) that is 0.34; for
# float16 (2^-11) 0.042. It is a bound on the rounding of a correct computation, and it
# catches what moves a tensor by more than that: a NaN, a missing or doubled reduction
# where its share of the sum is large, a dropped micro-batch where m is small. A fault
# that moves a gradient by less (one of four micro-batches lost, a gradient scaled by
# 0.75 under bfloat16) passes it: the float64 and float32 runs of the same mesh, which
# share every code path but the 16-bit casts, are held to bounds of about 1e-12 and 1e-4
# and catch those. The bound grows as sqrt(D): at bfloat16 it passes 1 from about 19
# layers, where a step that computed no gradient at all (scaled error 1) would pass, and
# :func:`vacuous_training_check` refuses such a run.
#
# Gradients reduced in 16 bits (``--grad-reduce bfloat16``; the library also takes
# float16) are summed in that
# type over the n partial sums of the step (m micro-batches on each of dp replicas), every
# add rounded: one more sum of n terms, lambda sqrt(n) u_r of its scale, and the rounding
# of the partials to 16 bits, u_r. That adds linearly to the chain's bound:
#
#     tol_mixed + (lambda sqrt(n) + 1) u_r
#
# (float16 compute with a bfloat16 reduction is held to bfloat16's u_r there, not to
# float16's).


def mixed_tolerance(config, batch: int, dtype, grad_reduce=None, partials: int = 1) -> float:
    """Derived bound on the scaled error of one mixed-precision training step in the
    16-bit ``dtype`` against the float64 serial model (see above); with a 16-bit
    ``grad_reduce``, the gradients summed in it over ``partials`` partial sums
    (micro-batches times data-parallel replicas)."""
    k, depth = _contraction_and_depth(config, batch)
    u16 = unit_roundoff(dtype)
    acc = LAMBDA * math.sqrt(k) * (unit_roundoff(np.float32) + unit_roundoff(np.float64))
    tol = math.sqrt(depth) * (acc + (2.0 * LAMBDA + 1.0) * u16)
    reduce_name = str(getattr(grad_reduce, "__name__", grad_reduce))
    if reduce_name in HALF_UNIT_ROUNDOFF:
        if isinstance(partials, bool) or int(partials) != partials or partials < 1:
            raise ValueError(f"partials must be a positive integer, got {partials!r}")
        tol += (LAMBDA * math.sqrt(partials) + 1.0) * HALF_UNIT_ROUNDOFF[reduce_name]
    return tol


def vacuous_training_check(config, batch: int, dtype, grad_reduce=None,
                           partials: int = 1) -> str:
    """Why a training step of ``config`` in ``dtype`` could not be checked ("" when it
    can): its bound (:func:`training_tolerance`) is 1 or more, so a tensor that is all
    zeros (scaled error exactly 1) would pass. Names the most layers that can be checked
    in ``dtype`` with the rest of ``config``."""
    tol = training_tolerance(config, batch, dtype, grad_reduce, partials)
    if tol < 1.0:
        return ""
    name = str(getattr(dtype, "__name__", dtype))
    reduce_name = str(getattr(grad_reduce, "__name__", grad_reduce))
    if reduce_name in HALF_UNIT_ROUNDOFF and training_tolerance(config, batch, dtype) < 1.0:
        return (f"{name} training with gradients summed in {reduce_name} over {partials} "
                f"partial sums (micro-batches x data-parallel replicas) has a derived bound "
                f"of {tol:.2f} on the scaled error of its gradients (validate.mixed_tolerance: "
                f"the {reduce_name} sum adds ({LAMBDA:g} sqrt(n) + 1) u for n partial sums): a step "
                f"that computed no gradient at all (scaled error 1) would pass, so nothing "
                f"would be checked; reduce in float32 (--grad-reduce float32) or over fewer "
                f"micro-batches x replicas")
    most = 0
    for layers in range(int(config.layers) - 1, 0, -1):
        if training_tolerance(dataclasses.replace(config, layers=layers), batch, dtype,
                              grad_reduce, partials) < 1.0:
            most = layers
            break
    fix = (f"validate at most {most} layers in {name}" if most else
           f"no depth of this model can be checked in {name}")
    return (f"{name} training of {config.layers} layers has a derived bound of {tol:.2f} on "
            f"the scaled error of its loss and gradients (validate.mixed_tolerance, which "
            f"grows as the square root of the layers): a step that computed no gradient at "
            f"all (scaled error 1) would pass, so nothing would be checked; {fix}, or run "
            f"it in float32 or float64")


# Adam, through which a gradient's error reaches the parameters. For one entry with the
# reference's moments m, v (after the step), gradient g, step t and an error of at most
# delta in g, the update ``lr c1 m / (sqrt(c2 v) + eps)`` (c1 = 1/(1 - b1^t), c2 =
# 1/(1 - b2^t)) lies between its values at the corners of m +- dm, v +- dv, where
#
#     dm = (1 - b1) delta + (b1 |m_prev| + 3 |m|) u,
#     dv = (1 - b2) (2 |g| delta + delta^2) + (b2 v_prev + 4 v) u
#
# (the gradient's error, the rounding of the moments the step starts from and of the
# moments' own update); the update is monotone in m and in v, so the corners are its
# extremes. The parameter adds the rounding of the step itself (the start parameters,
# the update's dozen operations and the subtraction):
#
#     |p - p_ref| <= max over corners |u' - u| + 14 u (|p_ref| + |u|)
#
# elementwise. The corners treat m and v as independent, which they are not; no Adam
# update exceeds, by Cauchy-Schwarz on the two moments' sums (r = b1^2 / b2 < 1),
#
#     U_t = lr c1 (1 - b1) / sqrt(c2 (1 - b2)) sqrt((1 - r^t) / (1 - r))    (lr at t = 1),
#
# so the update's error is also at most |u| + U_t. An entry whose gradient is small next
# to its error may move by up to the whole update (about lr): that is what Adam does with
# it, and the bound says so; an entry whose gradient is large is held to about
# lr delta / |g|.
ADAM_ROUNDINGS = 14


def adam_step_bound(g, m_prev, v_prev, m, v, p_new, delta, *, lr: float, betas, eps: float,
                    step: int, dtype):
    """Elementwise bound on ``|p - p_ref|`` after one Adam step (see above): all array
    arguments are the float64 reference's (``m``, ``v`` after the step; ``p_new`` the
    parameters after it), ``delta`` the bound on each gradient entry's error."""
    b1, b2 = betas
    u = unit_roundoff(dtype)
    c1, c2 = 1.0 / (1.0 - b1 ** step), 1.0 / (1.0 - b2 ** step)
    g, delta = np.abs(g), np.asarray(delta, dtype=np.float64)
    dm = (1.0 - b1) * delta + (b1 * np.abs(m_prev) + 3.0 * np.abs(m)) * u
    dv = (1.0 - b2) * (2.0 * g * delta + delta * delta) + (b2 * v_prev + 4.0 * v) * u

    def update(mm, vv):
        return lr * c1 * mm / (np.sqrt(c2 * np.maximum(vv, 0.0)) + eps)

    ref = update(m, v)
    worst = np.zeros_like(ref)
    for mm in (m - dm, m + dm):
        for vv in (v - dv, v + dv):
            np.maximum(worst, np.abs(update(mm, vv) - ref), out=worst)
    r = b1 * b1 / b2
    cap = lr * c1 * (1.0 - b1) / math.sqrt(c2 * (1.0 - b2)) * math.sqrt((1.0 - r ** step)
                                                                       / (1.0 - r))
    np.minimum(worst, np.abs(ref) + cap, out=worst)
    return worst + ADAM_ROUNDINGS * u * (np.abs(p_new) + np.abs(ref))
