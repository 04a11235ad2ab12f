"""The serial model's modern variants: SwiGLU, grouped-query attention, an untied LM
head, flash attention and selective/full recompute.

Gradients are checked against central finite differences in float64, as in
``tests/test_transformer_ops.py`` (ops; its tolerance ``fd_tol``, derived there) and
``tests/test_transformer_model.py`` (whole model; ``TOL = 100 (EPS^2 + u / EPS)`` =
2.2e-8 for an O(1) loss). Recompute modes must give bitwise the same loss and
gradients. Flash against plain attention differs only in summation order: both are
float64 computations of the same step, so their difference per tensor,
``max |flash - plain| / max |plain|``, is within ``validate.training_tolerance`` (the
derived bound of a training step's rounding, ``8 sqrt(K) (u + u_64) D``).
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from summasim import validate
from summasim.spec import Model
from summasim.transformer import model, ops
from tests.test_transformer_ops import check_grads, hyp, projection, seeds

EPS = 1e-6
U64 = np.finfo(np.float64).eps
TOL = 100.0 * (EPS ** 2 + U64 / EPS)
small = st.integers(1, 3)

#: (mlp, GQA, tied, attention): every combination of the variants
VARIANTS = list(itertools.product(("gelu", "swiglu"), (False, True), (True, False),
                                  ("plain", "flash")))


def _ids(v):
    mlp, gqa, tied, att = v
    return f"{mlp}-{'gqa' if gqa else 'mha'}-{'tied' if tied else 'untied'}-{att}"


# --------------------------------------------------------------------------- #
# ops                                                                          #
# --------------------------------------------------------------------------- #
@hyp(20)
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_swiglu(seed, shape):
    rng = np.random.default_rng(seed)
    gate, up = rng.standard_normal(shape) * 3.0, rng.standard_normal(shape)
    out, cache = ops.swiglu_forward(gate, up)
    np.testing.assert_allclose(out, gate / (1.0 + np.exp(-gate)) * up, rtol=1e-14, atol=1e-15)
    dout, proj, scale = projection(out, rng)
    (dgate, dup), grads = ops.swiglu_backward(dout, cache)
    assert grads == {}
    check_grads(lambda: proj(ops.swiglu_forward(gate, up)[0]), {"gate": gate, "up": up},
                {"gate": dgate, "up": dup}, rng, scale)


def test_swiglu_saturates_without_warnings():
    g = np.array([-1e4, -100.0, -10.0, 0.0, 10.0, 100.0, 1e4], dtype=np.float32)
    up = np.full_like(g, 2.0)
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        out, cache = ops.swiglu_forward(g, up)
        (dg, du), _ = ops.swiglu_backward(np.ones_like(g), cache)
    assert out.dtype == dg.dtype == du.dtype == np.float32
    # float64 reference; float32 carries a few roundings of u32 = 6e-8 per entry
    z = g.astype(np.float64)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-z))                    # 0 for z = -1e4 (exp overflows)
    np.testing.assert_allclose(out, 2.0 * z * s, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(du, z * s, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(dg, 2.0 * s * (1.0 + z * (1.0 - s)), rtol=1e-6, atol=1e-30)
    # saturated: silu' = 1 far right; far left the clamped exp(80) leaves ~1e-31, not 0
    assert np.all(np.abs(dg[:2]) < 1e-30) and np.array_equal(dg[-2:], [2.0, 2.0])


def _naive_gqa(q, k, v):
    """Loop-per-head reference: query head i reads kv head i // (nh / nkv)."""
    b, nh, t, hd = q.shape
    g = nh // k.shape[1]
    y = np.zeros_like(q)
    for i in range(b):
        for h in range(nh):
            s = q[i, h] @ k[i, h // g].T / np.sqrt(hd)
            s[np.triu_indices(t, 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            y[i, h] = (p / p.sum(-1, keepdims=True)) @ v[i, h // g]
    return y


@hyp(20)
@given(seed=seeds, b=small, nkv=small, g=st.integers(1, 3), t=st.integers(1, 5), hd=small,
       mode=st.sampled_from([("plain", "none"), ("plain", "selective"), ("flash", "none")]),
       tile=st.integers(1, 3))
def test_attention_core_gqa(seed, b, nkv, g, t, hd, mode, tile):
    """GQA core (plain, selective, flash) against the per-head loop and finite differences."""
    attention, recompute = mode
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nkv * g, t, hd))
    k, v = rng.standard_normal((b, nkv, t, hd)), rng.standard_normal((b, nkv, t, hd))
    kw = dict(attention=attention, recompute=recompute, tile=tile)
    out, cache = ops.attention_core_forward(q, k, v, **kw)
    np.testing.assert_allclose(out, _naive_gqa(q, k, v), rtol=1e-13, atol=1e-14)
    dout, proj, scale = projection(out, rng)
    (dq, dk, dv), _ = ops.attention_core_backward(dout, cache)
    assert dk.shape == dv.shape == k.shape and dq.shape == q.shape
    check_grads(lambda: proj(ops.attention_core_forward(q, k, v, **kw)[0]),
                {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, rng, scale)


def test_attention_core_gqa_shares_kv_and_writes_out():
    """The plain GQA core broadcasts k, v over the group (the probabilities are the
    only (T, T) array), writes y and the gradients into the given strided views, and
    its dk, dv equal the group sums of the gradients with k, v repeated per query head."""
    rng = np.random.default_rng(3)
    b, nkv, g, t, hd = 2, 2, 3, 5, 4
    nh = nkv * g
    q = rng.standard_normal((b, nh, t, hd))
    k, v = rng.standard_normal((b, nkv, t, hd)), rng.standard_normal((b, nkv, t, hd))
    buf = np.empty((b, t, nh, hd))
    y, cache = ops.attention_core_forward(q, k, v, out=buf.transpose(0, 2, 1, 3))
    assert np.shares_memory(y, buf) and cache.k is k and cache.v is v
    np.testing.assert_allclose(buf.transpose(0, 2, 1, 3), _naive_gqa(q, k, v), rtol=1e-13)
    dy = rng.standard_normal(q.shape)
    dbuf = np.empty((b, t, nh + 2 * nkv, hd))
    outs = (dbuf[:, :, :nh].transpose(0, 2, 1, 3), dbuf[:, :, nh:nh + nkv].transpose(0, 2, 1, 3),
            dbuf[:, :, nh + nkv:].transpose(0, 2, 1, 3))
    (dq, dk, dv), _ = ops.attention_core_backward(dy, cache, out=outs)
    assert all(np.shares_memory(a, dbuf) for a in (dq, dk, dv))
    krep, vrep = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)     # (B, nh, T, hd)
    _, rcache = ops.attention_core_forward(q, krep, vrep)
    (rq, rk, rv), _ = ops.attention_core_backward(dy, rcache)
    np.testing.assert_allclose(dq, rq, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dk, rk.reshape(b, nkv, g, t, hd).sum(2), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dv, rv.reshape(b, nkv, g, t, hd).sum(2), rtol=1e-13, atol=1e-14)


@hyp(15)
@given(seed=seeds, b=small, t=st.integers(1, 4), nkv=small, g=st.integers(1, 3), hd=small,
       bias=st.booleans())
def test_attention_gqa(seed, b, t, nkv, g, hd, bias):
    """``[Q (nh heads) | K (nkv) | V (nkv)]`` columns, against a reference and FD."""
    rng = np.random.default_rng(seed)
    nh = nkv * g
    c, ckv = nh * hd, nkv * hd
    x = rng.standard_normal((b, t, c))
    wq, bq = rng.standard_normal((c, c + 2 * ckv)) * 0.5, rng.standard_normal(c + 2 * ckv)
    wp, bp = rng.standard_normal((c, c)) * 0.5, rng.standard_normal(c)
    bp_ = bp if bias else None
    out, cache = ops.attention_forward(x, wq, bq, wp, bp_, nh, kv_heads=nkv)
    qkv = x @ wq + bq

    def heads(a, n):
        return a.reshape(b, t, n, hd).transpose(0, 2, 1, 3)

    q = heads(qkv[..., :c], nh)
    k, v = heads(qkv[..., c:c + ckv], nkv), heads(qkv[..., c + ckv:], nkv)
    y = _naive_gqa(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, c)
    np.testing.assert_allclose(out, y @ wp + (bp if bias else 0.0), rtol=1e-12, atol=1e-12)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.attention_backward(dout, cache)
    grads["x"] = dx
    inputs = {"x": x, "qkv.w": wq, "qkv.b": bq, "proj.w": wp} | ({"proj.b": bp} if bias else {})
    assert set(grads) == set(inputs)
    check_grads(lambda: proj(ops.attention_forward(x, wq, bq, wp, bp_, nh, kv_heads=nkv)[0]),
                inputs, grads, rng, scale)


def _block_params(rng, c, ckv, f, mlp):
    shapes = {"ln1.g": (c,), "ln1.b": (c,), "attn.qkv.w": (c, c + 2 * ckv),
              "attn.qkv.b": (c + 2 * ckv,), "attn.proj.w": (c, c), "attn.proj.b": (c,),
              "ln2.g": (c,), "ln2.b": (c,), "mlp.fc.w": (c, f), "mlp.fc.b": (f,),
              "mlp.gate.w": (c, f), "mlp.gate.b": (f,), "mlp.proj.w": (f, c), "mlp.proj.b": (c,)}
    p = {}
    for key in ops.block_keys(mlp):
        p[key] = rng.standard_normal(shapes[key]) * (0.5 if key.endswith(".w") else 1.0)
        if key.endswith(".g"):
            p[key] += 1.0
    return p


@hyp(10)
@given(seed=seeds, b=small, t=st.integers(1, 4), nkv=small, g=st.integers(1, 2), hd=small,
       f=st.integers(1, 5), mlp=st.sampled_from(["gelu", "swiglu"]),
       mode=st.sampled_from([("plain", "none"), ("plain", "selective"), ("flash", "none")]))
def test_block_variants(seed, b, t, nkv, g, hd, f, mlp, mode):
    attention, recompute = mode
    rng = np.random.default_rng(seed)
    nh = nkv * g
    c = nh * hd
    x = rng.standard_normal((b, t, c))
    p = _block_params(rng, c, nkv * hd, f, mlp)
    kw = dict(kv_heads=nkv, mlp=mlp, attention=attention, recompute=recompute, tile=2)
    out, cache = ops.block_forward(x, p, nh, **kw)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.block_backward(dout, cache)
    assert list(grads) == list(ops.block_keys(mlp))
    grads["x"] = dx
    k = max(1.0, float(cache.ln1.rstd.max()), float(cache.ln2.rstd.max()))
    check_grads(lambda: proj(ops.block_forward(x, p, nh, **kw)[0]), {"x": x} | p, grads, rng,
                scale, k)


def test_block_keys():
    assert ops.block_keys() == ops.BLOCK_KEYS == ops.block_keys("gelu")
    assert ops.block_keys("swiglu") == ops.BLOCK_KEYS[:10] + ("mlp.gate.w", "mlp.gate.b") \
        + ops.BLOCK_KEYS[10:]
    with pytest.raises(ValueError, match="mlp must be one of"):
        ops.block_keys("relu")


@pytest.mark.parametrize("call, match", [
    (lambda x, p: ops.block_forward(x, p, 2, recompute="full"), "recompute='full' is the caller"),
    (lambda x, p: ops.block_forward(x, p, 2, recompute="some"), "recompute must be one of"),
    (lambda x, p: ops.block_forward(x, p, 2, attention="fast"), "attention must be one of"),
    (lambda x, p: ops.block_forward(x, p, 2, mlp="relu"), "mlp must be one of"),
    (lambda x, p: ops.block_forward(x, p, 2, kv_heads=3), "kv_heads=3 does not divide heads=2"),
    (lambda x, p: ops.split_heads(np.zeros((1, 2, 10)), 2, 1), "QKV width 10"),
    (lambda x, p: ops.attention_core_forward(np.zeros((1, 3, 2, 2)), np.zeros((1, 2, 2, 2)),
                                             np.zeros((1, 2, 2, 2))), "do not divide"),
])
def test_bad_variant_arguments_raise(call, match):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=match):
        call(rng.standard_normal((1, 3, 4)), _block_params(rng, 4, 4, 8, "gelu"))


# --------------------------------------------------------------------------- #
# the model                                                                    #
# --------------------------------------------------------------------------- #
def _config(mlp="gelu", gqa=False, tied=True, **kw):
    """A small model of the variant; GQA shares each kv head between 2 query heads."""
    base = dict(vocab=7, seq=5, hidden=8, heads=4, layers=2,
                ffn_mult=1.5 if mlp == "swiglu" else 2)
    base |= kw
    return model.Config(**base, mlp=mlp, kv_heads=base["heads"] // 2 if gqa else None,
                        tied=tied)


def _noisy_params(config, seed, scale=0.3):
    params = model.init_params(config, seed)
    rng = np.random.default_rng(seed + 100)
    for key in params:
        params[key] += (scale * rng.standard_normal(params[key].shape)).astype(config.dtype)
    return params


def _batch(config, rng, b, s):
    return rng.integers(0, config.vocab, (b, s)), rng.integers(0, config.vocab, (b, s))


def _fd_check(params, grads, fn, rng, picks=2, directions=2):
    """Sampled entries of every gradient plus directional derivatives of all of them."""
    for key, arr in params.items():
        for flat in rng.choice(arr.size, size=min(picks, arr.size), replace=False):
            idx = np.unravel_index(flat, arr.shape)
            old = arr[idx]
            arr[idx] = old + EPS
            lp = fn()
            arr[idx] = old - EPS
            lm = fn()
            arr[idx] = old
            fd = (lp - lm) / (2 * EPS)
            assert abs(fd - grads[key][idx]) <= TOL, (key, idx, fd, grads[key][idx], TOL)
    orig = {k: v.copy() for k, v in params.items()}
    for _ in range(directions):
        d = {k: rng.standard_normal(v.shape) for k, v in params.items()}
        norm = math.sqrt(sum(float((a * a).sum()) for a in d.values()))
        vals = []
        for sign in (1.0, -1.0):
            for k in params:
                params[k][...] = orig[k] + sign * EPS * d[k] / norm
            vals.append(fn())
        for k in params:
            params[k][...] = orig[k]
        fd = (vals[0] - vals[1]) / (2 * EPS)
        an = sum(float((grads[k] * d[k]).sum()) for k in params) / norm
        assert abs(fd - an) <= TOL, ("direction", fd, an, TOL)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_model_variant_gradients(variant):
    """Every variant combination: every entry of the variant's own parameters (the GQA
    QKV, the SwiGLU gate, the untied head, wte) and sampled entries plus directional
    derivatives of all gradients, against finite differences."""
    mlp, gqa, tied, attention = variant
    config = _config(mlp, gqa, tied, layers=1, hidden=4, heads=2)
    params = _noisy_params(config, 1)
    rng = np.random.default_rng(2)
    tokens, targets = _batch(config, rng, 2, 5)
    kw = dict(attention=attention, tile=2)
    loss, cache = model.forward(params, tokens, targets, config, **kw)
    grads = model.backward(cache)
    assert list(grads) == list(params) == list(model.param_shapes(config))
    fn = lambda: model.forward(params, tokens, targets, config, **kw)[0]   # noqa: E731
    own = ["wte", "h0.attn.qkv.w"] + (["h0.mlp.gate.w"] if mlp == "swiglu" else []) \
        + ([] if tied else ["head.w"])
    for key in own:
        arr = params[key]
        for idx in np.ndindex(arr.shape):
            old = arr[idx]
            arr[idx] = old + EPS
            lp = fn()
            arr[idx] = old - EPS
            lm = fn()
            arr[idx] = old
            fd = (lp - lm) / (2 * EPS)
            assert abs(fd - grads[key][idx]) <= TOL, (key, idx, fd, grads[key][idx], TOL)
    _fd_check(params, grads, fn, rng)


@hyp(12)
@given(seed=seeds, b=st.integers(1, 2), s=st.integers(1, 5), nkv=st.integers(1, 2),
       g=st.integers(1, 2), hd=st.integers(1, 2), layers=st.integers(1, 2),
       ffn=st.sampled_from([1, 1.5, 8 / 3, 4]), variant=st.sampled_from(VARIANTS),
       recompute=st.sampled_from(["none", "selective", "full"]), tile=st.integers(1, 3))
def test_model_variants_drawn_shapes(seed, b, s, nkv, g, hd, layers, ffn, variant, recompute,
                                     tile):
    """Hypothesis-drawn shapes and variants: sampled entries and directional derivatives."""
    mlp, gqa, tied, attention = variant
    nh = nkv * g
    config = model.Config(vocab=5, seq=5, hidden=nh * hd, heads=nh, layers=layers,
                          ffn_mult=ffn, mlp=mlp, kv_heads=nkv if gqa else None, tied=tied)
    params = _noisy_params(config, seed % 1000)
    rng = np.random.default_rng(seed)
    tokens, targets = _batch(config, rng, b, s)
    kw = dict(attention=attention, recompute=recompute, tile=tile)
    loss, cache = model.forward(params, tokens, targets, config, **kw)
    grads = model.backward(cache)
    _fd_check(params, grads, lambda: model.forward(params, tokens, targets, config, **kw)[0],
              rng, picks=1)


def test_untied_head():
    """``head.w`` [h, v] is the LM head (logits = x @ head.w); wte is only the embedding:
    its gradient is the embedding's scatter-add alone, and no head part exists."""
    config = _config(tied=False)
    params = _noisy_params(config, 4)
    assert list(params)[-3:] == ["lnf.g", "lnf.b", "head.w"]
    assert params["head.w"].shape == (config.hidden, config.vocab)
    rng = np.random.default_rng(5)
    tokens, targets = _batch(config, rng, 3, 5)
    loss, cache = model.forward(params, tokens, targets, config)
    x = cache.head.x                                      # lnf output rows (N, h)
    np.testing.assert_array_equal(cache.logits.reshape(-1, config.vocab), x @ params["head.w"])
    parts = {}
    grads = model.backward(cache, parts=parts)
    assert "wte.head" not in parts
    np.testing.assert_array_equal(grads["wte"], parts["wte.embed"])
    absent = np.setdiff1d(np.arange(config.vocab), tokens)
    np.testing.assert_array_equal(grads["wte"][absent], 0.0)
    p = np.exp(cache.logits.reshape(-1, config.vocab))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(15), targets.reshape(-1)] -= 1.0
    np.testing.assert_allclose(grads["head.w"], x.T @ (p / 15), rtol=1e-12, atol=1e-15)
    fn = lambda: model.forward(params, tokens, targets, config)[0]   # noqa: E731
    for key in ("wte", "head.w"):
        for idx in np.ndindex(params[key].shape):
            old = params[key][idx]
            params[key][idx] = old + EPS
            lp = fn()
            params[key][idx] = old - EPS
            lm = fn()
            params[key][idx] = old
            assert abs((lp - lm) / (2 * EPS) - grads[key][idx]) <= TOL, (key, idx)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_recompute_modes_bitwise(variant):
    """none, selective and full recompute: the same loss and bitwise the same gradients;
    selective keeps no (T, T) probabilities (plain attention)."""
    mlp, gqa, tied, attention = variant
    config = _config(mlp, gqa, tied, layers=3, seq=8)
    params = _noisy_params(config, 6, scale=0.1)
    tokens, targets = _batch(config, np.random.default_rng(7), 2, 8)
    out = {}
    for rc in ("none", "selective", "full"):
        loss, cache = model.forward(params, tokens, targets, config, recompute=rc,
                                    attention=attention, tile=3)
        if rc == "selective" and attention == "plain":
            assert all(isinstance(c.attn.core, ops.AttentionInputsCache) for c in cache.blocks)
        out[rc] = (loss, cache.logits, model.backward(cache))
    for rc in ("selective", "full"):
        assert out[rc][0] == out["none"][0], rc
        np.testing.assert_array_equal(out[rc][1], out["none"][1])
        for key, val in out["none"][2].items():
            np.testing.assert_array_equal(out[rc][2][key], val, err_msg=f"{rc} {key}")


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[3] == "plain"], ids=_ids)
def test_flash_matches_plain(variant):
    """The whole model with flash attention (several tiles) against plain: loss, logits
    and every gradient within the derived rounding bound of a training step."""
    mlp, gqa, tied, _ = variant
    config = _config(mlp, gqa, tied, seq=12)
    params = _noisy_params(config, 8, scale=0.2)
    b = 3
    tokens, targets = _batch(config, np.random.default_rng(9), b, 12)
    tol = validate.training_tolerance(config, b, np.float64)
    l0, c0 = model.forward(params, tokens, targets, config)
    l1, c1 = model.forward(params, tokens, targets, config, attention="flash", tile=5)
    g0, g1 = model.backward(c0), model.backward(c1)
    errs = {"loss": abs(l1 - l0) / abs(l0),
            "logits": float(np.abs(c1.logits - c0.logits).max() / np.abs(c0.logits).max())}
    errs |= {k: float(np.abs(g1[k] - g0[k]).max() / np.abs(g0[k]).max()) for k in g0}
    worst = max(errs, key=errs.get)
    print(f"flash vs plain: worst {worst} {errs[worst]:.2e}, tolerance {tol:.2e}")
    assert all(e <= tol for e in errs.values()), (worst, errs[worst], tol)
    assert errs[worst] > 0.0          # flash really ran: a different summation order


def test_recompute_arguments():
    config = _config()
    params = model.init_params(config)
    tok = np.zeros((1, 3), int)
    with pytest.raises(ValueError, match="contradicts recompute='selective'"):
        model.forward(params, tok, tok, config, checkpoint=True, recompute="selective")
    with pytest.raises(ValueError, match="recompute must be one of"):
        model.forward(params, tok, tok, config, recompute="partial")
    with pytest.raises(ValueError, match="attention must be one of"):
        model.forward(params, tok, tok, config, attention="ring")
    _, cache = model.forward(params, tok, tok, config, checkpoint=True, recompute="full")
    assert cache.checkpoint and cache.recompute == "full"
    _, cache = model.forward(params, tok, tok, config, checkpoint=True)
    assert cache.recompute == "full"


# --------------------------------------------------------------------------- #
# parameters                                                                   #
# --------------------------------------------------------------------------- #
def test_variant_param_shapes_and_init():
    config = model.Config(vocab=11, seq=6, hidden=64, heads=8, layers=2, ffn_mult=8 / 3,
                          mlp="swiglu", kv_heads=2, tied=False)
    shapes = model.param_shapes(config)
    f = round(8 / 3 * 64)
    assert config.ffn == f == 171
    assert shapes["h0.attn.qkv.w"] == (64, 64 + 2 * 16) and shapes["h1.attn.qkv.b"] == (96,)
    assert [k for k in shapes if k.startswith("h0.mlp")] == [
        "h0.mlp.fc.w", "h0.mlp.fc.b", "h0.mlp.gate.w", "h0.mlp.gate.b", "h0.mlp.proj.w",
        "h0.mlp.proj.b"]
    assert shapes["h0.mlp.gate.w"] == (64, f) and shapes["h0.mlp.proj.w"] == (f, 64)
    assert list(shapes)[-1] == "head.w" and shapes["head.w"] == (64, 11)
    params = model.init_params(config, 1)
    assert np.std(params["h0.mlp.gate.w"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(params["head.w"]) == pytest.approx(0.02, rel=0.1)
    assert np.all(params["h1.mlp.gate.b"] == 0)
    model.check_params(params, config)
    assert list(model.layer_params(params, 1)) == list(ops.block_keys("swiglu"))
    # GPT-2 defaults: unchanged keys, and the same draws as before the variants existed
    plain = model.Config(vocab=11, seq=6, hidden=64, heads=8, layers=2)
    assert "head.w" not in model.param_shapes(plain)
    assert list(model.layer_params(model.init_params(plain), 0)) == list(ops.BLOCK_KEYS)
    # a classifier has no LM head, tied or not
    cls = model.Config(vocab=11, seq=6, hidden=64, heads=8, layers=1, tied=False, n_classes=3)
    assert "head.w" not in model.param_shapes(cls)
    bad = dict(params)
    del bad["h0.mlp.gate.w"]
    with pytest.raises(ValueError, match="missing \\['h0.mlp.gate.w'\\]"):
        model.check_params(bad, config)


def test_stage_keys_untied_and_swiglu():
    config = model.Config(vocab=7, seq=4, hidden=8, heads=2, layers=4, mlp="swiglu",
                          tied=False)
    last = model.stage_keys(config, [2, 3], first=False, last=True)
    assert last[-3:] == ["lnf.g", "lnf.b", "head.w"] and "wte" not in last
    assert "h2.mlp.gate.w" in last
    split = (model.stage_keys(config, [0, 1], True, False)
             + model.stage_keys(config, [2, 3], False, True))
    assert sorted(split) == sorted(model.param_shapes(config))     # every key exactly once
    tied = model.Config(vocab=7, seq=4, hidden=8, heads=2, layers=4)
    assert model.stage_keys(tied, [2, 3], False, True)[-1] == "wte"


def test_config_of_carries_the_variant():
    m = Model.parse("h=64,heads=8,layers=2,seq=16,vocab=64,ffn=8/3,mlp=swiglu,kv_heads=2,"
                    "tied=false")
    config = model.Config.of(m, np.float32)
    assert (config.mlp, config.kv_heads, config.tied) == ("swiglu", 2, False)
    assert config.model == m and config.dtype == np.float32
    assert config.qkv_width == 96 and config.ffn == 171
    with pytest.raises(ValueError, match="Config.kv_heads=3 does not divide Config.heads=8"):
        model.Config(vocab=5, seq=4, hidden=64, heads=8, layers=1, kv_heads=3)
    with pytest.raises(ValueError, match="Config.mlp"):
        model.Config(vocab=5, seq=4, hidden=64, heads=8, layers=1, mlp="relu")
