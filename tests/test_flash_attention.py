"""Blockwise attention (summasim.transformer.flash) against the plain attention core.

Values, row log-sum-exp and all three gradients are compared with
``ops.attention_core_forward/backward`` evaluated in float64 on the same inputs; for
grouped-query attention the plain op runs on k, v repeated over each group of
``g = nh // nkv`` query heads, and its dk, dv are summed over the group.

Tolerance (derived as in :mod:`summasim.validate`). Each tensor is compared entry by
entry against its natural scale, the same chain evaluated in float64 on absolute
values (P >= 0)::

    |y|~  = P |V|                       |dv|~ = P^T |dY|
    |dS|~ = P * (|dY| |V|^T + rowsum(|dY| |y|~))
    |dq|~ = |dS|~ |K| / sqrt(hd)         |dk|~ = |dS|~^T |Q| / sqrt(hd)

Every contraction of length at most ``K = max(T, hd)`` adds at most
``tol(K) = 8 sqrt(K) (u + u_64)`` of its scale (Higham & Mary 2019) and passes on its
inputs' relative error; the deepest chain (dq, dk) has 6 of them: the scores, the
running row sum l with its tile rescales exp(m_old - m_new), the lse, P V, dP = dY V^T
and D = rowsum(dY * Y), and the final dS K (or dS^T Q). A score s_ij carries an
absolute error of ``tol(hd) (|q_s| |k|)_ij``, and the softmax turns an absolute score
error delta into a relative error of P of at most ``exp(2 delta) - 1 ~ 2 delta``; with
``sigma = max (|q_s| |k|)_ij`` over the causal entries the bound on every scaled error is::

    bound = (6 + 2 sigma) tol(max(T, hd), dtype)

(float64 ~ 1e-14, float32 ~ 1e-5 at these sizes). Errors and bounds are printed.

A wrong online softmax (an accumulator or a row sum not rescaled when the running max
grows, a diagonal tile not masked) gives errors of the size of the values themselves.
"""

import math
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from summasim import validate
from summasim.transformer import flash, ops

CHAIN = 6                 # contractions on the deepest chain (module docstring)
_DEEP = int(os.environ.get("SUMMASIM_HYPOTHESIS_EXAMPLES", "0"))


def hyp(n):
    """Hypothesis settings: ``n`` derandomized examples, or a deeper random search."""
    if _DEEP:
        return settings(max_examples=_DEEP, deadline=None)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None)


def _inputs(seed, b, nh, nkv, t, hd, dtype):
    """q (B, nh, T, hd), k, v (B, nkv, T, hd) and dy (B, nh, T, hd) of standard normals."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nh, t, hd)).astype(dtype)
    k = rng.standard_normal((b, nkv, t, hd)).astype(dtype)
    v = rng.standard_normal((b, nkv, t, hd)).astype(dtype)
    dy = rng.standard_normal((b, nh, t, hd)).astype(dtype)
    return q, k, v, dy


def _group_sum(a, nkv):
    """(B, nh, T, hd) -> (B, nkv, T, hd): the sum over each group of query heads."""
    b, nh, t, hd = a.shape
    return a.reshape(b, nkv, nh // nkv, t, hd).sum(axis=2)


def reference(q, k, v, dy):
    """float64 plain attention on k, v repeated over each group: values, lse, gradients,
    their natural scales (module docstring) and sigma = max causal (|q_s| |k|)."""
    q, k, v, dy = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dy))
    nkv, g = k.shape[1], q.shape[1] // k.shape[1]
    t, hd = q.shape[2], q.shape[3]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)   # (B, nh, T, hd)
    y, cache = ops.attention_core_forward(q, kr, vr)
    (dq, dk, dv), _ = ops.attention_core_backward(dy, cache)
    scale = cache.scale
    s = cache.qs @ kr.swapaxes(-1, -2) + ops.causal_mask(np, t, np.float64)  # (B, nh, T, T)
    smax = s.max(axis=-1, keepdims=True)
    lse = (smax + np.log(np.exp(s - smax).sum(axis=-1, keepdims=True)))[..., 0]
    p = cache.att                                               # (B, nh, T, T)
    abs_q, abs_k, abs_v, abs_dy = np.abs(q), np.abs(kr), np.abs(vr), np.abs(dy)
    y_abs = p @ abs_v
    ds_abs = p * (abs_dy @ abs_v.swapaxes(-1, -2)
                  + (abs_dy * y_abs).sum(axis=-1, keepdims=True))
    scales = {"y": y_abs,
              "lse": np.ones_like(lse),     # an absolute error of the log: relative of P
              "dq": ds_abs @ abs_k * scale,
              "dk": _group_sum(ds_abs.swapaxes(-1, -2) @ abs_q * scale, nkv),
              "dv": _group_sum(p.swapaxes(-1, -2) @ abs_dy, nkv)}
    qk = (abs_q @ abs_k.swapaxes(-1, -2)) * scale               # (B, nh, T, T)
    sigma = float((qk * np.tri(t)).max())
    values = {"y": y, "lse": lse, "dq": dq, "dk": _group_sum(dk, nkv),
              "dv": _group_sum(dv, nkv)}
    return values, scales, sigma


def bound(t, hd, dtype, sigma):
    """(6 + 2 sigma) tol(max(T, hd), dtype): see the module docstring."""
    return (CHAIN + 2.0 * sigma) * validate.tolerance(max(t, hd), dtype)


def check_against_plain(q, k, v, dy, tile):
    """Run flash forward+backward and assert every tensor within the derived bound."""
    y, cache = flash.flash_attention_forward(q, k, v, tile=tile)
    (dq, dk, dv), extra = flash.flash_attention_backward(dy, cache)
    assert extra == {}
    got = {"y": y, "lse": cache.lse, "dq": dq, "dk": dk, "dv": dv}
    want, scales, sigma = reference(q, k, v, dy)
    tol = bound(q.shape[2], q.shape[3], q.dtype, sigma)
    errs = {}
    for name in got:
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == q.dtype, name
        errs[name] = validate.scaled_error(got[name], want[name], scales[name])
    print(f"shape q {q.shape} kv {k.shape} tile {tile} {q.dtype}: bound {tol:.2e}, "
          + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    bad = {n: e for n, e in errs.items() if not validate.passes(e, tol)}
    assert not bad, f"scaled errors {bad} exceed the derived bound {tol:.3e}"


@hyp(25)
@given(seed=st.integers(0, 2 ** 31 - 1), b=st.integers(1, 2), nkv=st.integers(1, 2),
       g=st.integers(1, 3), t=st.integers(1, 40), hd=st.integers(1, 8),
       tile=st.one_of(st.integers(1, 9), st.sampled_from([16, 40, 64])),
       dtype=st.sampled_from([np.float64, np.float32]))
def test_matches_plain_attention(seed, b, nkv, g, t, hd, tile, dtype):
    check_against_plain(*_inputs(seed, b, nkv * g, nkv, t, hd, dtype), tile)


@pytest.mark.parametrize("t, tile", [(1, 1), (9, 1), (7, 64), (12, 12), (13, 4), (16, 4),
                                     (33, 8), (5, 6)])
@pytest.mark.parametrize("nh, nkv", [(2, 2), (6, 2), (3, 1)])
def test_tile_edges(t, tile, nh, nkv):
    """tile = 1, tile > T, tile = T, T not a multiple of tile, several full tiles."""
    check_against_plain(*_inputs(t * 100 + tile, 2, nh, nkv, t, 5, np.float64), tile)


def test_float32_long_rows():
    """Many tiles, so the running max is rescaled often, in float32."""
    check_against_plain(*_inputs(3, 1, 4, 2, 200, 16, np.float32), 7)


def test_finite_differences():
    """Central differences of L = sum(y * w) in float64 on a tiny GQA case.

    Step EPS = 1e-6; the tolerance is tests/test_transformer_ops.py's (truncation
    EPS^2 / 6 |L'''| plus roundoff u |L| / EPS, both bounded by S = 1 + sum |y w| with
    O(1) inputs): 100 (EPS^2 + u / EPS) S, about 2e-8 S, where a wrong gradient is off
    by the size of the gradient.
    """
    eps = 1e-6
    q, k, v, _ = _inputs(11, 1, 4, 2, 5, 3, np.float64)
    w = np.random.default_rng(12).standard_normal(q.shape)

    def loss():
        return float((flash.flash_attention_forward(q, k, v, tile=2)[0] * w).sum())

    y, cache = flash.flash_attention_forward(q, k, v, tile=2)
    (dq, dk, dv), _ = flash.flash_attention_backward(w, cache)
    tol = 100.0 * (eps ** 2 + np.finfo(np.float64).eps / eps) * (1.0 + float(np.abs(y * w).sum()))
    for name, arr, grad in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        fd = np.empty(arr.shape)
        for i in range(arr.size):
            old = arr.flat[i]
            arr.flat[i] = old + eps
            lp = loss()
            arr.flat[i] = old - eps
            lm = loss()
            arr.flat[i] = old
            fd.flat[i] = (lp - lm) / (2 * eps)
        err = float(np.abs(fd - grad).max())
        print(f"d/d{name}: max |fd - analytic| = {err:.2e}, tol {tol:.2e}")
        assert err <= tol, f"d/d{name}: max |fd - analytic| = {err:.3e} > tol {tol:.3e}"


def _peak_bytes(fn):
    """tracemalloc peak (NumPy reports its data buffers to it) of ``fn()``, result kept."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    return peak


def test_memory_is_linear_in_sequence():
    """Forward+backward peak: flash O(B nh T tile), plain above B nh T^2.

    Flash's allowance beyond ``score_items * itemsize``: six (B, nh, T, hd) arrays (y in
    the cache; the scaled queries, dq, dk, dv and one dq update of the backward), four
    (B, nh, T) arrays (lse, D, and two running statistics) and 64 KiB for the per-tile
    (tile, hd) products and interpreter objects; under NumPy before 2.3 also the ufunc
    iterator's buffers (a constant). The plain op holds the (T, T)
    probabilities and their gradient at once, so its peak exceeds B nh T^2 itemsize.
    """
    b, nh, t, hd, tile = 1, 2, 512, 16, 32
    q, k, v, dy = _inputs(5, b, nh, nh, t, hd, np.float64)
    isz = q.itemsize

    def run_flash():
        y, cache = flash.flash_attention_forward(q, k, v, tile=tile)
        return flash.flash_attention_backward(dy, cache), cache

    def run_plain():
        y, cache = ops.attention_core_forward(q, k, v)
        return ops.attention_core_backward(dy, cache), cache

    allowance = (6 * b * nh * t * hd + 4 * b * nh * t) * isz + 64 * 1024
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 3):
        # NumPy before 2.3 runs an in-place ufunc on a strided view (``acc_tail += ...``)
        # through its iterator's buffers, np.getbufsize() items for each of 3 operands: a
        # constant 192 KiB at float64, whatever T (traced line by line on 1.24 to 2.2)
        allowance += 3 * np.getbufsize() * isz
    limit = flash.score_items(b, nh, t, tile) * isz + allowance
    quadratic = b * nh * t * t * isz
    peak_flash, peak_plain = _peak_bytes(run_flash), _peak_bytes(run_plain)
    print(f"peak flash {peak_flash} B (limit {limit}), plain {peak_plain} B "
          f"(B nh T^2 itemsize {quadratic})")
    assert peak_flash <= limit < quadratic
    assert peak_plain > quadratic


def test_score_items():
    assert flash.score_items(2, 3, 100, 16) == 2 * 2 * 3 * 100 * 16 + 16 * 16
    assert flash.score_items(1, 1, 10, 64) == 2 * 10 * 10 + 10 * 10     # tile capped at T
    with pytest.raises(ValueError, match="tile"):
        flash.score_items(1, 1, 10, 0)
    with pytest.raises(ValueError, match="T"):
        flash.score_items(1, 1, 0, 4)


def test_cache_holds_no_square_array():
    t, hd = 24, 3
    q, k, v, _ = _inputs(1, 2, 4, 2, t, hd, np.float64)
    _, cache = flash.flash_attention_forward(q, k, v, tile=5)
    assert cache.lse.shape == (2, 4, t)
    assert cache.scale == 1.0 / math.sqrt(hd) and cache.tile == 5
    for name, val in cache._asdict().items():
        if isinstance(val, np.ndarray):
            assert val.shape[-2:] != (t, t), name


def test_out_arrays_are_strided_views():
    """y into a merged-heads (B, T, nh, hd) buffer; dq, dk, dv into strided views."""
    b, nh, nkv, t, hd = 2, 4, 2, 11, 3
    q, k, v, dy = _inputs(7, b, nh, nkv, t, hd, np.float64)
    y_ref, cache_ref = flash.flash_attention_forward(q, k, v, tile=4)
    grads_ref, _ = flash.flash_attention_backward(dy, cache_ref)
    buf = np.full((b, t, nh, hd), np.nan)                       # (B, T, nh, hd)
    y, cache = flash.flash_attention_forward(q, k, v, tile=4, out=buf.transpose(0, 2, 1, 3))
    assert np.shares_memory(y, buf)
    np.testing.assert_array_equal(buf.transpose(0, 2, 1, 3), y_ref)
    outs = (np.full((b, t, nh, hd), np.nan).transpose(0, 2, 1, 3),
            np.full((b, t, nkv, hd), np.nan).transpose(0, 2, 1, 3),
            np.full((b, t, nkv, hd), np.nan).transpose(0, 2, 1, 3))
    grads, _ = flash.flash_attention_backward(dy, cache, out=outs)
    for got, dest, want in zip(grads, outs, grads_ref):
        assert got is dest
        np.testing.assert_array_equal(got, want)


def test_strided_inputs():
    """q, k, v as head views of a packed [Q | K | V] tensor (B, T, 3C)."""
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((2, 9, 3 * 12))
    q, k, v = ops.split_heads(qkv, 4)                           # (B, nh, T, hd) views
    dy = rng.standard_normal(q.shape)
    check_against_plain(q, k, v, dy, 4)


def test_bad_arguments():
    q, k, v, dy = _inputs(0, 1, 4, 2, 6, 3, np.float64)
    cases = [
        (dict(q=q[0]), "q must be a 4-D"),
        (dict(k=k[:, :, :5]), "k and v must have the same shape"),
        (dict(k=k[:, :, :5], v=v[:, :, :5]), "match q"),
        (dict(k=k[:, :1].repeat(3, 1), v=v[:, :1].repeat(3, 1)), "multiple of key/value heads"),
        (dict(tile=0), "tile must be an integer >= 1"),
        (dict(tile=2.0), "tile must be an integer"),
        (dict(tile=True), "tile must be an integer"),
        (dict(v=v.astype(np.float32)), "one dtype"),
        (dict(q=q[:, :, :0]), "q has an empty axis"),
        (dict(out=np.empty((1, 4, 6, 2))), "out must be an array of shape"),
        (dict(out=np.empty((1, 4, 6, 3), dtype=np.float32)), "out must have dtype float64"),
    ]
    for kw, msg in cases:
        args = dict(q=q, k=k, v=v)
        opts = {key: kw.pop(key) for key in ("tile", "out") if key in kw}
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            flash.flash_attention_forward(args["q"], args["k"], args["v"], **opts)
    _, cache = flash.flash_attention_forward(q, k, v, tile=2)
    with pytest.raises(ValueError, match="dy must be an array of shape"):
        flash.flash_attention_backward(dy[:, :2], cache)
    with pytest.raises(ValueError, match="dy must have dtype float64"):
        flash.flash_attention_backward(dy.astype(np.float32), cache)
    with pytest.raises(ValueError, match="out must be three arrays"):
        flash.flash_attention_backward(dy, cache, out=(np.empty_like(q),))
    with pytest.raises(ValueError, match=r"out\[1\] \(dk\)"):
        flash.flash_attention_backward(dy, cache, out=(np.empty_like(q),) * 3)
