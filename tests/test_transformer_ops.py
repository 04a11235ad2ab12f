"""Serial transformer ops: backward vs central finite differences, and the reduction hooks.

Every op is checked through a random projection loss ``L = sum(out * dout)``:
its gradient with respect to every input is the op's vector-Jacobian product,
so comparing the hand-written backward with finite differences of ``L`` checks
the whole Jacobian.

Finite-difference tolerance (float64, central differences, step EPS = 1e-6):
truncation error is ``EPS^2 / 6 * |L'''|`` and roundoff about ``u * |L| * k / EPS``
(u = 2.2e-16, k the condition of L). With the inputs O(1), |L| is bounded by
``S = 1 + sum|out * dout|`` and |L'''| by ``S * k^3``, so we allow
``100 * (EPS^2 k^3 + u k / EPS) * S``. k = 1 except through LayerNorm, where every
derivative of ``(x - mean) * rstd`` brings a factor ``rstd = 1/sqrt(var + 1e-5)``:
there k = max(1, max rstd) (a row of nearly equal values is badly conditioned).
For k = 1 the tolerance is about 2.2e-8 * S; a wrong formula gives errors of the
size of the gradient.

Hypothesis runs derandomized (reproducible); set SUMMASIM_HYPOTHESIS_EXAMPLES to
search more examples (e.g. 500) with a random seed.

The hook tests run p "ranks" as threads that really exchange partial sums
(:class:`FakeGroup`), each calling the op on its slice, and compare with the
serial result to float64 summation-order error.
"""

import functools
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from summasim.transformer import ops

EPS = 1e-6
U64 = np.finfo(np.float64).eps
MAX_ENTRIES = 300        # inputs up to this size are checked entry by entry
_DEEP = int(os.environ.get("SUMMASIM_HYPOTHESIS_EXAMPLES", "0"))


def hyp(n):
    """Hypothesis settings: ``n`` derandomized examples, or a deeper random search."""
    if _DEEP:
        return settings(max_examples=_DEEP, deadline=None)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None)


HYP = hyp(20)


def fd_tol(scale, k=1.0):
    """Central-difference tolerance for a loss of magnitude ``scale`` and condition ``k``
    (see the module docstring)."""
    return 100.0 * (EPS ** 2 * k ** 3 + U64 * k / EPS) * scale


def check_grads(loss_fn, inputs, grads, rng, scale, k=1.0):
    """Compare ``grads[name]`` with central differences of ``loss_fn()`` w.r.t. ``inputs[name]``.

    Inputs are perturbed in place (and restored). Small inputs: every entry;
    larger ones: three random unit directions (a directional derivative).
    """
    tol = fd_tol(scale, k)
    for name, arr in inputs.items():
        g = grads[name]
        assert g.shape == arr.shape, (name, g.shape, arr.shape)
        if arr.size <= MAX_ENTRIES:
            fd = np.empty(arr.shape)
            for i in range(arr.size):
                old = arr.flat[i]
                arr.flat[i] = old + EPS
                lp = loss_fn()
                arr.flat[i] = old - EPS
                lm = loss_fn()
                arr.flat[i] = old
                fd.flat[i] = (lp - lm) / (2 * EPS)
            err = np.abs(fd - g).max()
            assert err <= tol, f"d/d{name}: max |fd - analytic| = {err:.3e} > tol {tol:.3e}"
        else:
            orig = arr.copy()
            for _ in range(3):
                d = rng.standard_normal(arr.shape)
                d /= np.linalg.norm(d)
                arr[...] = orig + EPS * d
                lp = loss_fn()
                arr[...] = orig - EPS * d
                lm = loss_fn()
                arr[...] = orig
                fd = (lp - lm) / (2 * EPS)
                an = float((g * d).sum())
                assert abs(fd - an) <= tol, \
                    f"d/d{name} along a random direction: fd {fd:.10e} vs {an:.10e} " \
                    f"(tol {tol:.3e})"


def projection(out, rng):
    """A random ``dout`` and the loss ``L(out) = sum(out * dout)`` with its scale S."""
    dout = rng.standard_normal(out.shape)
    return dout, (lambda o: float((o * dout).sum())), 1.0 + float(np.abs(out * dout).sum())


seeds = st.integers(0, 2 ** 31 - 1)
small = st.integers(1, 3)


# --------------------------------------------------------------------------- #
# finite-difference checks, one per op                                        #
# --------------------------------------------------------------------------- #
@HYP
@given(seed=seeds, lead=st.lists(small, min_size=1, max_size=2), c=small, oc=small,
       bias=st.booleans())
def test_linear(seed, lead, c, oc, bias):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (c,))
    w, b = rng.standard_normal((c, oc)), rng.standard_normal(oc)
    bb = b if bias else None
    out, cache = ops.linear_forward(x, w, bb)
    assert out.shape == tuple(lead) + (oc,)
    np.testing.assert_allclose(out, x @ w + (b if bias else 0.0), rtol=1e-14, atol=1e-14)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.linear_backward(dout, cache)
    grads["x"] = dx
    inputs = {"x": x, "w": w} | ({"b": b} if bias else {})
    assert set(grads) == set(inputs)
    check_grads(lambda: proj(ops.linear_forward(x, w, bb)[0]), inputs, grads, rng, scale)


@HYP
@given(seed=seeds, b=small, t=small, c=st.integers(1, 8))
def test_layernorm(seed, b, t, c):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, c)) * 2.0 + 0.5
    g, bb = rng.standard_normal(c), rng.standard_normal(c)
    out, cache = ops.layernorm_forward(x, g, bb)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + bb
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.layernorm_backward(dout, cache)
    grads["x"] = dx
    k = max(1.0, float(cache.rstd.max()))
    check_grads(lambda: proj(ops.layernorm_forward(x, g, bb)[0]),
                {"x": x, "g": g, "b": bb}, grads, rng, scale, k)


@HYP
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_gelu(seed, shape):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3.0
    out, cache = ops.gelu_forward(x)
    ref = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-15)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.gelu_backward(dout, cache)
    assert grads == {}
    check_grads(lambda: proj(ops.gelu_forward(x)[0]), {"x": x}, {"x": dx}, rng, scale)


def test_gelu_saturates_without_warnings():
    x = np.array([-1e4, -60.0, -10.0, 0.0, 10.0, 60.0, 1e4], dtype=np.float32)
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        out, cache = ops.gelu_forward(x)
        dx, _ = ops.gelu_backward(np.ones_like(x), cache)
    assert out.dtype == np.float32 and dx.dtype == np.float32
    np.testing.assert_allclose(out, np.where(x > 0, x, 0.0), atol=1e-6)
    np.testing.assert_allclose(dx, np.where(x > 0, 1.0, np.where(x == 0, 0.5, 0.0)), atol=1e-6)


@HYP
@given(seed=seeds, lead=st.lists(small, min_size=1, max_size=2), v=st.integers(1, 6))
def test_softmax(seed, lead, v):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (v,)) * 3.0
    out, cache = ops.softmax_forward(x)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True), rtol=1e-14, atol=1e-16)
    dout, proj, scale = projection(out, rng)
    dx, _ = ops.softmax_backward(dout, cache)
    check_grads(lambda: proj(ops.softmax_forward(x)[0]), {"x": x}, {"x": dx}, rng, scale)


def _naive_attention(q, k, v):
    """Loop-per-head reference for the core attention."""
    b, nh, t, hd = q.shape
    y = np.zeros_like(q)
    for i in range(b):
        for h in range(nh):
            s = q[i, h] @ k[i, h].T / np.sqrt(hd)
            s[np.triu_indices(t, 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            y[i, h] = (p / p.sum(-1, keepdims=True)) @ v[i, h]
    return y


@HYP
@given(seed=seeds, b=small, nh=small, t=st.integers(1, 4), hd=small)
def test_attention_core(seed, b, nh, t, hd):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((b, nh, t, hd)) for _ in range(3))
    out, cache = ops.attention_core_forward(q, k, v)
    np.testing.assert_allclose(out, _naive_attention(q, k, v), rtol=1e-13, atol=1e-14)
    dout, proj, scale = projection(out, rng)
    (dq, dk, dv), _ = ops.attention_core_backward(dout, cache)
    check_grads(lambda: proj(ops.attention_core_forward(q, k, v)[0]),
                {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, rng, scale)


@HYP
@given(seed=seeds, b=small, t=st.integers(1, 4), nh=small, hd=small, bias=st.booleans())
def test_attention(seed, b, t, nh, hd, bias):
    rng = np.random.default_rng(seed)
    c = nh * hd
    x = rng.standard_normal((b, t, c))
    wq, bq = rng.standard_normal((c, 3 * c)) * 0.5, rng.standard_normal(3 * c)
    wp, bp = rng.standard_normal((c, c)) * 0.5, rng.standard_normal(c)
    bp_ = bp if bias else None
    out, cache = ops.attention_forward(x, wq, bq, wp, bp_, nh)
    # reference: [Q | K | V] columns, heads contiguous inside each
    qkv = x @ wq + bq
    q, k, v = (qkv[..., i * c:(i + 1) * c].reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
               for i in range(3))
    y = _naive_attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, c)
    np.testing.assert_allclose(out, y @ wp + (bp if bias else 0.0), rtol=1e-12, atol=1e-12)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.attention_backward(dout, cache)
    grads["x"] = dx
    inputs = {"x": x, "qkv.w": wq, "qkv.b": bq, "proj.w": wp} | ({"proj.b": bp} if bias else {})
    assert set(grads) == set(inputs)
    check_grads(lambda: proj(ops.attention_forward(x, wq, bq, wp, bp_, nh)[0]),
                inputs, grads, rng, scale)


@HYP
@given(seed=seeds, b=small, t=st.integers(1, 4), extra=st.integers(0, 2), v=st.integers(1, 5),
       c=small)
def test_embedding(seed, b, t, extra, v, c):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, v, (b, t))            # small v: repeated ids exercise scatter-add
    wte, wpe = rng.standard_normal((v, c)), rng.standard_normal((t + extra, c))
    out, cache = ops.embedding_forward(tokens, wte, wpe)
    np.testing.assert_array_equal(out, wte[tokens] + wpe[:t])
    dout, proj, scale = projection(out, rng)
    none, grads = ops.embedding_backward(dout, cache)
    assert none is None
    ref = np.zeros_like(wte)
    np.add.at(ref, tokens, dout)
    np.testing.assert_allclose(grads["wte"], ref, rtol=1e-14, atol=1e-14)
    check_grads(lambda: proj(ops.embedding_forward(tokens, wte, wpe)[0]),
                {"wte": wte, "wpe": wpe}, grads, rng, scale)


@HYP
@given(seed=seeds, lead=st.lists(small, min_size=1, max_size=2), v=st.integers(1, 6))
def test_cross_entropy(seed, lead, v):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(tuple(lead) + (v,)) * 3.0
    targets = rng.integers(0, v, tuple(lead))
    losses, cache = ops.cross_entropy_forward(logits, targets)
    z = logits - logits.max(-1, keepdims=True)
    ref = np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses, ref, rtol=1e-13, atol=1e-14)
    dl, proj, scale = projection(losses, rng)
    dlogits, _ = ops.cross_entropy_backward(dl, cache)
    check_grads(lambda: proj(ops.cross_entropy_forward(logits, targets)[0]),
                {"logits": logits}, {"logits": dlogits}, rng, scale)


@HYP
@given(seed=seeds, lead=st.lists(small, min_size=1, max_size=2), c=small, v=st.integers(1, 5))
def test_lm_head(seed, lead, c, v):
    rng = np.random.default_rng(seed)
    x, wte = rng.standard_normal(tuple(lead) + (c,)), rng.standard_normal((v, c))
    out, cache = ops.lm_head_forward(x, wte)
    np.testing.assert_allclose(out, x @ wte.T, rtol=1e-14, atol=1e-14)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.lm_head_backward(dout, cache)
    grads["x"] = dx
    check_grads(lambda: proj(ops.lm_head_forward(x, wte)[0]), {"x": x, "wte": wte}, grads,
                rng, scale)


@HYP
@given(seed=seeds, b=small, t=small, c=small, k=small)
def test_classifier(seed, b, t, c, k):
    rng = np.random.default_rng(seed)
    x, w, bb = rng.standard_normal((b, t, c)), rng.standard_normal((c, k)), rng.standard_normal(k)
    out, cache = ops.classifier_forward(x, w, bb)
    np.testing.assert_allclose(out, x[:, -1] @ w + bb, rtol=1e-14, atol=1e-14)
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.classifier_backward(dout, cache)
    grads["x"] = dx
    check_grads(lambda: proj(ops.classifier_forward(x, w, bb)[0]), {"x": x, "w": w, "b": bb},
                grads, rng, scale)


def _block_params(rng, c, f):
    p = {}
    for key, shape in {"ln1.g": (c,), "ln1.b": (c,), "attn.qkv.w": (c, 3 * c),
                       "attn.qkv.b": (3 * c,), "attn.proj.w": (c, c), "attn.proj.b": (c,),
                       "ln2.g": (c,), "ln2.b": (c,), "mlp.fc.w": (c, f), "mlp.fc.b": (f,),
                       "mlp.proj.w": (f, c), "mlp.proj.b": (c,)}.items():
        p[key] = rng.standard_normal(shape) * (0.5 if key.endswith(".w") else 1.0)
        if key.endswith(".g"):
            p[key] += 1.0
    return p


@hyp(8)
@given(seed=seeds, b=small, t=st.integers(1, 4), nh=small, hd=small)
def test_block(seed, b, t, nh, hd):
    rng = np.random.default_rng(seed)
    c = nh * hd
    x = rng.standard_normal((b, t, c))
    p = _block_params(rng, c, 2 * c)
    x_before = x.copy()
    out, cache = ops.block_forward(x, p, nh)
    np.testing.assert_array_equal(x, x_before)         # the input is not modified
    dout, proj, scale = projection(out, rng)
    dx, grads = ops.block_backward(dout, cache)
    assert list(grads) == list(ops.BLOCK_KEYS)
    grads["x"] = dx
    k = max(1.0, float(cache.ln1.rstd.max()), float(cache.ln2.rstd.max()))
    check_grads(lambda: proj(ops.block_forward(x, p, nh)[0]), {"x": x} | p, grads, rng, scale,
                k)


def test_ops_keep_float32():
    """No silent upcast: float32 in, float32 everywhere out (forward and backward)."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    x = rng.standard_normal((2, 5, 8)).astype(f32)
    p = {k: v.astype(f32) for k, v in _block_params(rng, 8, 32).items()}
    out, cache = ops.block_forward(x, p, 2)
    dx, grads = ops.block_backward(np.ones_like(out), cache)
    assert out.dtype == f32 and dx.dtype == f32
    assert all(g.dtype == f32 for g in grads.values())
    logits = rng.standard_normal((10, 7)).astype(f32)
    losses, cache = ops.cross_entropy_forward(logits, rng.integers(0, 7, 10))
    dl, _ = ops.cross_entropy_backward(np.full(10, 0.1, f32), cache)
    assert losses.dtype == f32 and dl.dtype == f32
    emb, cache = ops.embedding_forward(rng.integers(0, 7, (2, 5)),
                                       rng.standard_normal((7, 8)).astype(f32), x[0].copy())
    _, g = ops.embedding_backward(emb, cache)
    assert emb.dtype == f32 and g["wte"].dtype == f32 and g["wpe"].dtype == f32


# --------------------------------------------------------------------------- #
# reduction hooks: p ranks as threads                                         #
# --------------------------------------------------------------------------- #
class FakeGroup:
    """p ranks (threads) that all-reduce for real: every rank gets the same
    rank-ordered sum (or max) of all ranks' arrays. A rank that calls it a
    different number of times than the others times out the barrier."""

    def __init__(self, p):
        self.p = p
        self.slots = [None] * p
        self.barrier = threading.Barrier(p, timeout=20)
        self.calls = [0] * p

    def allreduce(self, rank, a, op="sum"):
        self.calls[rank] += 1
        self.slots[rank] = a
        self.barrier.wait()
        fn = np.add if op == "sum" else np.maximum
        out = functools.reduce(fn, self.slots)
        self.barrier.wait()
        return out

    def run(self, fn):
        """``[fn(rank) for rank in range(p)]``, the ranks running concurrently."""
        results, errors = [None] * self.p, []

        def target(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as exc:   # noqa: BLE001 - re-raised below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.p)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results


def _splits(rng, n, p):
    """p contiguous, possibly uneven, nonempty pieces of range(n)."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=p - 1, replace=False)) if p > 1 else []
    edges = [0, *cuts, n]
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


HOOK_RTOL = 1e-12   # float64: only the order of the partial sums differs


@hyp(10)
@given(seed=seeds, p=st.integers(1, 3), extra=st.integers(0, 6), b=small, t=small)
def test_layernorm_hidden_parallel(seed, p, extra, b, t):
    """Each rank holds a slice of the hidden axis; sum_hidden adds the other slices' sums."""
    rng = np.random.default_rng(seed)
    c = p + extra
    x = rng.standard_normal((b, t, c)) + 1.0
    g, bb = rng.standard_normal(c), rng.standard_normal(c)
    dout = rng.standard_normal((b, t, c))
    out, cache = ops.layernorm_forward(x, g, bb)
    dx, grads = ops.layernorm_backward(dout, cache)
    parts = _splits(rng, c, p)
    group = FakeGroup(p)

    def rank(r):
        sl = parts[r]
        hook = lambda a: group.allreduce(r, a.sum(-1, keepdims=True))   # noqa: E731
        o, cch = ops.layernorm_forward(x[..., sl], g[sl], bb[sl], sum_hidden=hook, hidden=c)
        d, gr = ops.layernorm_backward(dout[..., sl], cch)
        return o, d, gr

    res = group.run(rank)
    assert group.calls == [4] * p           # 2 in forward, 2 in backward, on every rank
    np.testing.assert_allclose(np.concatenate([r[0] for r in res], -1), out, rtol=HOOK_RTOL,
                               atol=HOOK_RTOL)
    np.testing.assert_allclose(np.concatenate([r[1] for r in res], -1), dx, rtol=HOOK_RTOL,
                               atol=HOOK_RTOL * np.abs(dx).max())
    for key in ("g", "b"):
        np.testing.assert_allclose(np.concatenate([r[2][key] for r in res]), grads[key],
                                   rtol=HOOK_RTOL, atol=HOOK_RTOL)


@hyp(10)
@given(seed=seeds, p=st.integers(1, 3), extra=st.integers(0, 6), n=st.integers(1, 6))
def test_cross_entropy_vocab_parallel(seed, p, extra, n):
    """Each rank holds a slice of the vocabulary; targets may live on another rank."""
    rng = np.random.default_rng(seed)
    v = p + extra
    logits = rng.standard_normal((n, v)) * 3.0
    targets = rng.integers(0, v, n)
    dl = rng.standard_normal(n)
    losses, cache = ops.cross_entropy_forward(logits, targets)
    dlogits, _ = ops.cross_entropy_backward(dl, cache)
    parts = _splits(rng, v, p)
    group = FakeGroup(p)

    def rank(r):
        sl = parts[r]
        lo, d = ops.cross_entropy_forward(
            logits[:, sl], targets, vocab_start=sl.start,
            max_vocab=lambda a: group.allreduce(r, a.max(-1, keepdims=True), "max"),
            sum_vocab=lambda a: group.allreduce(r, a.sum(-1, keepdims=True)))
        return lo, ops.cross_entropy_backward(dl, d)[0]

    res = group.run(rank)
    for lo, _ in res:                         # every rank gets the full losses
        np.testing.assert_allclose(lo, losses, rtol=HOOK_RTOL, atol=HOOK_RTOL)
    np.testing.assert_allclose(np.concatenate([r[1] for r in res], -1), dlogits,
                               rtol=HOOK_RTOL, atol=HOOK_RTOL)


@hyp(10)
@given(seed=seeds, p=st.integers(1, 3), extra=st.integers(0, 5), n=st.integers(1, 4))
def test_softmax_vocab_parallel(seed, p, extra, n):
    rng = np.random.default_rng(seed)
    v = p + extra
    x, dy = rng.standard_normal((n, v)) * 3.0, rng.standard_normal((n, v))
    y, cache = ops.softmax_forward(x)
    dx, _ = ops.softmax_backward(dy, cache)
    parts = _splits(rng, v, p)
    group = FakeGroup(p)

    def rank(r):
        sl = parts[r]
        yl, c = ops.softmax_forward(
            x[:, sl], max_last=lambda a: group.allreduce(r, a.max(-1, keepdims=True), "max"),
            sum_last=lambda a: group.allreduce(r, a.sum(-1, keepdims=True)))
        return yl, ops.softmax_backward(dy[:, sl], c)[0]

    res = group.run(rank)
    np.testing.assert_allclose(np.concatenate([r[0] for r in res], -1), y, rtol=HOOK_RTOL)
    np.testing.assert_allclose(np.concatenate([r[1] for r in res], -1), dx, rtol=HOOK_RTOL,
                               atol=HOOK_RTOL)


@hyp(10)
@given(seed=seeds, p=st.integers(1, 3), extra=st.integers(0, 5), b=small, t=small, c=small)
def test_embedding_vocab_parallel(seed, p, extra, b, t, c):
    """Rows of wte split over ranks; combine_vocab all-reduces the partial lookups."""
    rng = np.random.default_rng(seed)
    v = p + extra
    tokens = rng.integers(0, v, (b, t))
    wte, wpe = rng.standard_normal((v, c)), rng.standard_normal((t, c))
    dout = rng.standard_normal((b, t, c))
    out, cache = ops.embedding_forward(tokens, wte, wpe)
    _, grads = ops.embedding_backward(dout, cache)
    parts = _splits(rng, v, p)
    group = FakeGroup(p)

    def rank(r):
        sl = parts[r]
        o, cch = ops.embedding_forward(tokens, wte[sl], wpe, vocab_start=sl.start,
                                       combine_vocab=lambda a: group.allreduce(r, a))
        return o, ops.embedding_backward(dout, cch)[1]

    res = group.run(rank)
    for o, gr in res:
        np.testing.assert_allclose(o, out, rtol=HOOK_RTOL, atol=HOOK_RTOL)
        np.testing.assert_allclose(gr["wpe"], grads["wpe"], rtol=HOOK_RTOL, atol=HOOK_RTOL)
    np.testing.assert_allclose(np.concatenate([r[1]["wte"] for r in res]), grads["wte"],
                               rtol=HOOK_RTOL, atol=HOOK_RTOL)


@hyp(10)
@given(seed=seeds, p=st.integers(1, 3), b=small, t=st.integers(1, 4), hd=small)
def test_attention_heads_subset(seed, p, b, t, hd):
    """A rank holding a subset of heads (Megatron) gets exactly its heads' share."""
    rng = np.random.default_rng(seed)
    nh = 2 * p
    c = nh * hd
    x = rng.standard_normal((b, t, c))
    wq, bq = rng.standard_normal((c, 3 * c)) * 0.5, rng.standard_normal(3 * c)
    wp = rng.standard_normal((c, c)) * 0.5
    dout = rng.standard_normal((b, t, c))
    out, cache = ops.attention_forward(x, wq, bq, wp, None, nh)
    dx, grads = ops.attention_backward(dout, cache)
    per = c // p                                   # hidden columns of one rank's heads
    outs, dxs = [], []
    for r in range(p):
        cols = np.concatenate([np.arange(i * c + r * per, i * c + (r + 1) * per)
                               for i in range(3)])  # its Q, K, V columns, still [Q | K | V]
        rows = slice(r * per, (r + 1) * per)
        o, cch = ops.attention_forward(x, wq[:, cols], bq[cols], wp[rows], None, nh // p)
        d, g = ops.attention_backward(dout, cch)
        outs.append(o)
        dxs.append(d)
        np.testing.assert_allclose(g["qkv.w"], grads["qkv.w"][:, cols], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(g["qkv.b"], grads["qkv.b"][cols], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(g["proj.w"], grads["proj.w"][rows], rtol=1e-13, atol=1e-13)
    # row-parallel projection: the partial outputs and input grads sum to the serial ones
    np.testing.assert_allclose(sum(outs), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sum(dxs), dx, rtol=1e-12, atol=1e-12)


def test_layernorm_hook_is_used_in_backward():
    """The backward reuses the forward's reduction (it is kept in the cache)."""
    calls = []

    def hook(a):
        calls.append(a.shape)
        return a.sum(-1, keepdims=True)

    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    out, cache = ops.layernorm_forward(x, np.ones(4), np.zeros(4), sum_hidden=hook)
    ops.layernorm_backward(np.ones_like(out), cache)
    assert calls == [(2, 3, 4)] * 4


def test_attention_core_writes_into_out():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))
    buf = np.empty((2, 4, 3, 5))                    # (B, T, nh, hd): merged-heads layout
    y, _ = ops.attention_core_forward(q, k, v, out=buf.transpose(0, 2, 1, 3))
    np.testing.assert_allclose(buf.transpose(0, 2, 1, 3), _naive_attention(q, k, v),
                               rtol=1e-13, atol=1e-14)
    assert np.shares_memory(y, buf)
    np.testing.assert_array_equal(ops.merge_heads(y), buf.reshape(2, 4, 15))


def test_scatter_add_matches_add_at():
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 50, 1000)
    rows = rng.standard_normal((1000, 7))
    ref = np.zeros((60, 7))
    np.add.at(ref, idx, rows)
    np.testing.assert_allclose(ops._scatter_add_rows(np, idx, rows, 60), ref, rtol=1e-13,
                               atol=1e-13)
    assert ops._scatter_add_rows(np, idx[:0], rows[:0], 5).shape == (5, 7)


class _NotNumpy:
    """NumPy under another name: takes the device path of ``_scatter_add_rows``."""

    __name__ = "not-numpy"

    @staticmethod
    def argsort(a, kind=None):        # like CuPy's: always stable, no other kind
        assert kind is None
        return np.argsort(a, kind="stable")

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("n, vocab", [(1, 3), (1000, 50), (400, 2), (64, 64)])
def test_scatter_add_device_path_is_add_at_bit_for_bit(n, vocab):
    """The path CuPy takes (passes of distinct indices, no atomics) sums each row in
    the order of a sequential loop: exactly ``np.add.at``, whatever the repeats."""
    rng = np.random.default_rng(n)
    idx = rng.integers(0, vocab, n)
    idx[: n // 3] = 0                              # one index repeated many times
    rows = rng.standard_normal((n, 7))
    ref = np.zeros((vocab + 3, 7))
    np.add.at(ref, idx, rows)
    got = ops._scatter_add_rows(_NotNumpy(), idx, rows, vocab + 3)
    np.testing.assert_array_equal(got, ref)
    assert ops._scatter_add_rows(_NotNumpy(), idx[:0], rows[:0], 5).shape == (5, 7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 64])
def test_gelu_in_blocks_is_the_whole_chain_bit_for_bit(monkeypatch, dtype, n):
    """The host GELU runs its chains block by block (ops.GELU_BLOCK items): forward and
    backward equal the whole-array chains bit for bit, on sizes that are and are not
    multiples of the block, a strided input (no blocks) included (test_gelu checks
    the chain against GELU itself)."""
    rng = np.random.default_rng(n)
    x = (4 * rng.standard_normal((3, n))).astype(dtype)
    d = rng.standard_normal((3, n)).astype(dtype)
    got = []
    for block in (8, 1 << 40):                  # blocks of 8 items; one block of all
        monkeypatch.setattr(ops, "GELU_BLOCK", block)
        y, cache = ops.gelu_forward(x)
        g, _ = ops.gelu_backward(d, cache)
        ys, cs = ops.gelu_forward(x[:, ::2])      # not contiguous: the whole chain
        gs, _ = ops.gelu_backward(d[:, ::2], cs)
        got.append((y, g, ys, gs))
    for a, b in zip(*got):
        assert a.dtype == dtype and np.array_equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_layernorm_by_products_is_the_chain_of_reductions_to_round_off(monkeypatch, dtype, tol):
    """The host LayerNorm with the serial sum takes its sums by products (ones-vector
    BLAS products, an einsum): output, cache, dx and the parameter gradients equal the
    chain of NumPy reductions (the same sum passed as another function) to round-off.
    A sharded sum and a strided input keep the reductions."""
    rng = np.random.default_rng(3)
    x = (3 * rng.standard_normal((3, 5, 64)) + 1).astype(dtype)
    g, b = rng.standard_normal(64).astype(dtype), rng.standard_normal(64).astype(dtype)
    d = rng.standard_normal((3, 5, 64)).astype(dtype)
    taken = []
    real = ops._ln_by_products
    monkeypatch.setattr(ops, "_ln_by_products",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    got = []
    for sum_hidden in (None, lambda a: a.sum(axis=-1, keepdims=True)):
        y, cache = ops.layernorm_forward(x, g, b, sum_hidden=sum_hidden)
        dx, grads = ops.layernorm_backward(d, cache)
        got.append((y, cache.xhat, cache.rstd, dx, grads["g"], grads["b"]))
    assert taken == [True, True, False, False]
    for ours, ref in zip(*got):
        assert ours.dtype == dtype and ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= tol * np.abs(ref).max()
    taken.clear()
    ops.layernorm_forward(x[:, :, ::2], g[::2], b[::2])
    assert taken == [False]
