"""Fused elementwise kernels for CuPy arrays (one kernel where NumPy takes a chain).

:mod:`summasim.transformer.ops` writes each op as a chain of in-place array calls, which
NumPy runs well; on a GPU every call is a kernel launch and a pass over memory. For
CuPy arrays the ops below take one ``cupy.ElementwiseKernel`` each instead, computing
the same formula in the same order (so float64 results agree with NumPy's to round-off,
and the validation bounds are unchanged):

- GELU forward ``x / (1 + exp(min(-2z, 80)))`` and its backward (7 and 13 launches
  become 1 each);
- the attention softmax's ``exp(s - max)`` (2 become 1);
- layer norm's ``(x - mean) * rstd * g + b`` (3 become 1) and its backward's
  ``(dxhat - mean_d - xhat * mean_dx) * rstd`` (3 become 1);
- the causal mask, built once per (T, dtype) and kept.

They are off unless ``SUMMASIM_FUSED=1``: they have not yet run on a GPU (the kernel
bodies are compiled and checked against the NumPy chains on the CPU with a C++ compiler,
``tests/test_fused_kernels.py``); ``scripts/gpu-check OUT layer-fused`` times the layer
with and without them. The kernels are compiled by CuPy on first use (NVRTC) and cached
on disk by CuPy.
"""

from __future__ import annotations

import math

from ..cli import env_switch

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715
#: exp(-2z) is clamped at exp(80), so it never overflows in float32 (max ~exp(88))
GELU_EXP_CLAMP = 80.0
ENABLED = env_switch("SUMMASIM_FUSED", False, strict=False)     # strictly: check_environment

_kernels: dict = {}
_masks: dict = {}


def applies(xp) -> bool:
    """Whether the fused kernels serve arrays of module ``xp`` (CuPy, when enabled)."""
    return ENABLED and getattr(xp, "__name__", "") == "cupy"


def sources() -> dict:
    """``{name: (in_params, out_params, operation)}`` of every kernel (CuPy's
    ``ElementwiseKernel`` arguments; templated on ``T``)."""
    a, b = -2.0 * GELU_K * GELU_C, -2.0 * GELU_K
    c, d = 6.0 * GELU_K * GELU_C, 2.0 * GELU_K
    # -2z = (x*x*a + b) * x, as ops._gelu_exp computes it, then clamped and exponentiated
    e = (f"T e = (x * x * (T)({a!r}) + (T)({b!r})) * x; "
         f"e = exp(e < (T)({GELU_EXP_CLAMP!r}) ? e : (T)({GELU_EXP_CLAMP!r}));")
    return {
        "gelu_fwd": ("T x", "T y", e + " y = (T)1 / ((T)1 + e) * x;"),
        "gelu_bwd": ("T x, T dout", "T dx",
                     e + " T s = (T)1 / (e + (T)1); e = e * s * s;"
                     f" T u = (x * x * (T)({c!r}) + (T)({d!r})) * x;"
                     " dx = (u * e + s) * dout;"),
        "exp_sub": ("T x, T m", "T y", "y = exp(x - m);"),
        "ln_fwd": ("T xc, T rstd, T g, T b", "T xhat, T out",
                   "xhat = xc * rstd; out = xhat * g + b;"),
        "ln_bwd": ("T dxhat, T mean_d, T xhat, T mean_dx, T rstd", "T dx",
                   "dx = (dxhat - mean_d - xhat * mean_dx) * rstd;"),
    }


def _kernel(name: str):
    kern = _kernels.get(name)
    if kern is None:
        import cupy

        kern = _kernels[name] = cupy.ElementwiseKernel(*sources()[name],
                                                       name=f"summasim_{name}")
    return kern


def gelu_forward(x):
    """``x * sigmoid(2z)`` in one kernel (ops.gelu_forward's formula)."""
    return _kernel("gelu_fwd")(x)


def gelu_backward(dout, x):
    """GELU's ``dx`` in one kernel (ops.gelu_backward's formula)."""
    return _kernel("gelu_bwd")(x, dout)


def exp_sub(x, m, out):
    """``out = exp(x - m)`` (m broadcast), in one kernel; ``out`` may be ``x``."""
    return _kernel("exp_sub")(x, m, out)


def layernorm_tail(xc, rstd, g, b):
    """``(xhat, out)`` with ``xhat = xc * rstd`` and ``out = xhat * g + b``."""
    return _kernel("ln_fwd")(xc, rstd, g, b)


def layernorm_dx(dxhat, mean_d, xhat, mean_dx, rstd):
    """``(dxhat - mean_d - xhat * mean_dx) * rstd`` in one kernel."""
    return _kernel("ln_bwd")(dxhat, mean_d, xhat, mean_dx, rstd)


def causal_mask(xp, t: int, dtype):
    """The additive causal mask (T, T), built once per (T, dtype) on this device and
    kept (read-only; at most 8 kept)."""
    key = (t, str(dtype), xp.cuda.Device().id)
    mask = _masks.get(key)
    if mask is None:
        if len(_masks) >= 8:
            _masks.clear()
        mask = _masks[key] = xp.triu(xp.full((t, t), -math.inf, dtype=dtype), k=1)
    return mask
