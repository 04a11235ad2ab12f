"""The fused CuPy kernels' bodies, checked on the CPU.

Each kernel of :mod:`summasim.transformer.fused` is CUDA C++ that CuPy wraps in a loop
over elements. Here the same bodies go into a C++ loop, are compiled with the host's
compiler, and run on NumPy arrays; their results must equal the NumPy chains of
:mod:`summasim.transformer.ops` (the formulas the GPU path replaces) to a few ulps, on
inputs that reach GELU's clamp, infinities and NaN.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from summasim.transformer import fused, ops

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the kernel "
                                                     "bodies on the CPU")
CTYPES = {"float": np.float32, "double": np.float64}


def _params(spec: str) -> list[str]:
    return [p.split()[-1] for p in spec.split(",")]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The kernels as ``extern "C" void NAME_float/double(long n, T* args...)``."""
    parts = ["#include <cmath>", "using std::exp;"]
    for name, (ins, outs, op) in fused.sources().items():
        for ctype in CTYPES:
            args = ", ".join(f"const {ctype}* in_{p}" for p in _params(ins))
            args += ", " + ", ".join(f"{ctype}* out_{p}" for p in _params(outs))
            loads = " ".join(f"const T {p} = in_{p}[i];" for p in _params(ins))
            decls = " ".join(f"T {p};" for p in _params(outs))
            stores = " ".join(f"out_{p}[i] = {p};" for p in _params(outs))
            parts.append(f'extern "C" void {name}_{ctype}(long n, {args}) {{ typedef {ctype} T;'
                         f" for (long i = 0; i < n; i++) {{ {loads} {decls} {op} {stores} }} }}")
    src = tmp_path_factory.mktemp("fused") / "kernels.cpp"
    src.write_text("\n".join(parts) + "\n")
    so = src.with_suffix(".so")
    subprocess.run([CXX, "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                   capture_output=True, text=True)
    return ctypes.CDLL(str(so))


def _run(lib, name, dtype, *inputs, nout=1):
    """The kernel on ``inputs`` broadcast to one shape; its outputs as arrays."""
    shape = np.broadcast_shapes(*(a.shape for a in inputs))
    ins = [np.ascontiguousarray(np.broadcast_to(a, shape), dtype=dtype) for a in inputs]
    outs = [np.empty(shape, dtype=dtype) for _ in range(nout)]
    ctype = {np.float32: "float", np.float64: "double"}[dtype]
    fn = getattr(lib, f"{name}_{ctype}")
    fn(ctypes.c_long(int(np.prod(shape))), *(a.ctypes.data_as(ctypes.c_void_p) for a in ins),
       *(a.ctypes.data_as(ctypes.c_void_p) for a in outs))
    return outs


def _close(got, want, dtype, ulps=4, scale=None):
    """Equal to ``ulps`` units of roundoff of ``scale`` (default: of ``want`` itself),
    NaN where NaN, the same infinities."""
    tol = ulps * np.finfo(dtype).eps
    scale = np.abs(want) if scale is None else scale
    both_nan = np.isnan(got) & np.isnan(want)
    same_inf = np.isinf(got) & (got == want)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want) <= tol * np.maximum(scale, np.finfo(dtype).tiny)
    return bool(np.all(both_nan | same_inf | err))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_kernels_equal_the_numpy_chains(lib, dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * 4, np.linspace(-60, 60, 241),
                        [np.inf, -np.inf, np.nan, 0.0, -0.0]]).astype(dtype)
    dout = rng.standard_normal(x.shape).astype(dtype)
    want, cache = ops.gelu_forward(x.copy())
    (got,) = _run(lib, "gelu_fwd", dtype, x)
    assert _close(got, want, dtype), np.max(np.abs(got - want))
    with np.errstate(invalid="ignore"):
        want_dx, _ = ops.gelu_backward(dout, cache)
    (got_dx,) = _run(lib, "gelu_bwd", dtype, x, dout)
    # the derivative is s + u e with |s|, |u e| = O(1): near its zero (x = -0.75) the two
    # cancel, so the roundoff is that of dout, not of the result
    scale = np.maximum(np.abs(want_dx), np.abs(dout))
    assert _close(got_dx, want_dx, dtype, ulps=16, scale=scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_exp_kernel_equals_numpy(lib, dtype):
    rng = np.random.default_rng(1)
    s = rng.standard_normal((3, 5, 9)).astype(dtype) * 10
    s[..., 4:] = -np.inf                               # masked scores
    m = s.max(axis=-1, keepdims=True)
    (got,) = _run(lib, "exp_sub", dtype, s, m)
    assert _close(got, np.exp(s - m), dtype)
    assert np.all(got[..., 4:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layernorm_kernels_equal_the_numpy_chains(lib, dtype):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 6, 11)) * 3 + 1).astype(dtype)
    g, b = rng.standard_normal(11).astype(dtype), rng.standard_normal(11).astype(dtype)
    # the chain of reductions, as CuPy arrays run it (host arrays take sums by products)
    want, cache = ops.layernorm_forward(x, g, b, sum_hidden=lambda a: a.sum(-1, keepdims=True))
    xc = x - x.sum(-1, keepdims=True) * (1.0 / 11)
    rstd = cache.rstd
    xhat, out = _run(lib, "ln_fwd", dtype, xc, rstd, g, b, nout=2)
    assert _close(xhat, cache.xhat, dtype) and _close(out, want, dtype, ulps=8)
    dout = rng.standard_normal(x.shape).astype(dtype)
    want_dx, _ = ops.layernorm_backward(dout, cache)
    dxhat = dout * g
    mean_d = dxhat.sum(-1, keepdims=True) * (1.0 / 11)
    mean_dx = (dxhat * cache.xhat).sum(-1, keepdims=True) * (1.0 / 11)
    (got_dx,) = _run(lib, "ln_bwd", dtype, dxhat, mean_d, cache.xhat, mean_dx, rstd)
    assert _close(got_dx, want_dx, dtype, ulps=8), np.max(np.abs(got_dx - want_dx))


def test_the_kernels_are_off_unless_asked():
    """Not yet run on a GPU: CuPy arrays take the array chains unless SUMMASIM_FUSED=1,
    and NumPy arrays always do."""
    import types

    assert not fused.applies(np)
    assert fused.applies(types.SimpleNamespace(__name__="cupy")) == fused.ENABLED
