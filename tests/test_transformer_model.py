"""The serial reference model: gradients vs finite differences, invariants,
float32 vs float64, activation checkpointing, input validation.

Finite-difference tolerance (float64, central differences, step EPS = 1e-6): the
loss is O(1) (about ln(vocab)), so truncation ``EPS^2 / 6 * |L'''|`` and roundoff
``u * |L| / EPS`` (u = 2.2e-16) are both below ``TOL = 100 * (EPS^2 + u / EPS)``
= 2.2e-8 with a factor 100 to spare for |L'''| and for the condition of the loss.
"""

import math
import tracemalloc

import numpy as np
import pytest

from summasim.transformer import model, ops

EPS = 1e-6
U64 = np.finfo(np.float64).eps
TOL = 100.0 * (EPS ** 2 + U64 / EPS)


def _noisy_params(config, seed, scale=0.3):
    """Initial params plus noise, so LayerNorm gains/biases and biases are not trivial."""
    params = model.init_params(config, seed)
    rng = np.random.default_rng(seed + 100)
    for key in params:
        params[key] += (scale * rng.standard_normal(params[key].shape)).astype(config.dtype)
    return params


def _fd(params, key, index, fn):
    arr = params[key]
    old = arr[index]
    arr[index] = old + EPS
    lp = fn()
    arr[index] = old - EPS
    lm = fn()
    arr[index] = old
    return (lp - lm) / (2 * EPS)


def _batch(config, rng, b, s):
    tokens = rng.integers(0, config.vocab, (b, s))
    if config.n_classes:
        return tokens, rng.integers(0, config.n_classes, b)
    return tokens, rng.integers(0, config.vocab, (b, s))


@pytest.mark.parametrize("n_classes", [0, 3])
def test_tiny_model_every_gradient_entry(n_classes):
    """Every entry of every parameter's gradient, 2 layers, s < seq (unused wpe rows)."""
    config = model.Config(vocab=5, seq=4, hidden=4, heads=2, layers=2, n_classes=n_classes)
    params = _noisy_params(config, 0)
    tokens, targets = _batch(config, np.random.default_rng(1), 2, 3)
    loss, cache = model.forward(params, tokens, targets, config)
    grads = model.backward(cache)
    assert list(grads) == list(params)
    fn = lambda: model.forward(params, tokens, targets, config)[0]   # noqa: E731
    for key, arr in params.items():
        assert grads[key].shape == arr.shape and grads[key].dtype == arr.dtype
        fd = np.array([_fd(params, key, idx, fn) for idx in np.ndindex(arr.shape)])
        err = np.abs(fd.reshape(arr.shape) - grads[key]).max()
        assert err <= TOL, f"{key}: max |fd - analytic| = {err:.3e} > {TOL:.3e}"
    np.testing.assert_array_equal(grads["wpe"][3], 0.0)      # position 3 never used


def test_larger_model_sampled_entries():
    """Sampled entries of every gradient, plus the whole-gradient directional derivative."""
    config = model.Config(vocab=13, seq=8, hidden=16, heads=4, layers=2, ffn_mult=4)
    params = _noisy_params(config, 3, scale=0.1)
    rng = np.random.default_rng(4)
    tokens, targets = _batch(config, rng, 3, 8)
    loss, cache = model.forward(params, tokens, targets, config)
    grads = model.backward(cache)
    fn = lambda: model.forward(params, tokens, targets, config)[0]   # noqa: E731
    for key, arr in params.items():
        picks = rng.choice(arr.size, size=min(3, arr.size), replace=False)
        for flat in picks:
            idx = np.unravel_index(flat, arr.shape)
            fd = _fd(params, key, idx, fn)
            assert abs(fd - grads[key][idx]) <= TOL, (key, idx, fd, grads[key][idx])
    # all parameters at once along a random direction
    direction = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    norm = math.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    orig = {k: v.copy() for k, v in params.items()}
    vals = []
    for sign in (1.0, -1.0):
        for k in params:
            params[k][...] = orig[k] + sign * EPS * direction[k] / norm
        vals.append(fn())
    fd = (vals[0] - vals[1]) / (2 * EPS)
    an = sum(float((grads[k] * direction[k]).sum()) for k in params) / norm
    assert abs(fd - an) <= TOL, (fd, an)


def test_causal_mask():
    """Changing token t leaves the logits at positions < t unchanged (bit for bit)."""
    config = model.Config(vocab=11, seq=7, hidden=8, heads=2, layers=2)
    params = _noisy_params(config, 5)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 11, (2, 7))
    base = model.logits(params, tokens, config)
    assert base.shape == (2, 7, 11)
    for t in range(7):
        changed = tokens.copy()
        changed[:, t] = (changed[:, t] + 1 + rng.integers(0, 10)) % 11
        new = model.logits(params, changed, config)
        np.testing.assert_array_equal(new[:, :t], base[:, :t])
        assert not np.array_equal(new[:, t], base[:, t])


def test_fresh_init_loss_is_ln_vocab():
    """Init logits are small (std 0.02 * sqrt(h)), so the loss is about ln(vocab)."""
    config = model.Config(vocab=50, seq=16, hidden=32, heads=4, layers=2)
    params = model.init_params(config, 0)
    tokens, targets = _batch(config, np.random.default_rng(0), 4, 16)
    loss, _ = model.forward(params, tokens, targets, config)
    # E[loss] - ln v ~ var(logits) / 2 = 0.02^2 * 32 / 2 = 0.0064
    assert abs(loss - math.log(50)) < 0.05, loss


def test_init_statistics():
    config = model.Config(vocab=64, seq=16, hidden=64, heads=4, layers=3)
    params = model.init_params(config, 1)
    assert np.std(params["wte"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(params["h1.attn.proj.w"]) == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
    assert np.std(params["h2.mlp.proj.w"]) == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
    assert np.std(params["h0.mlp.fc.w"]) == pytest.approx(0.02, rel=0.05)
    assert np.all(params["h0.ln1.g"] == 1) and np.all(params["lnf.b"] == 0)
    assert np.all(params["h2.attn.qkv.b"] == 0)
    np.testing.assert_array_equal(model.init_params(config, 1)["wte"], params["wte"])
    assert {k: v.shape for k, v in params.items()} == model.param_shapes(config)


def test_tied_embedding_gradient_is_embedding_plus_head():
    config = model.Config(vocab=9, seq=6, hidden=8, heads=2, layers=2)
    params = _noisy_params(config, 7)
    rng = np.random.default_rng(8)
    tokens, targets = _batch(config, rng, 3, 6)
    loss, cache = model.forward(params, tokens, targets, config)
    parts = {}
    grads = model.backward(cache, parts=parts)
    np.testing.assert_array_equal(grads["wte"], parts["wte.embed"] + parts["wte.head"])
    # head part: dlogits^T @ x_final, dlogits = (softmax - onehot) / (b*s)
    logits = cache.logits.reshape(-1, 9)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(18), targets.reshape(-1)] -= 1.0
    np.testing.assert_allclose(parts["wte.head"], (p / 18).T @ cache.head.x, rtol=1e-12,
                               atol=1e-15)
    # embedding part: zero on rows of ids absent from the batch
    absent = np.setdiff1d(np.arange(9), tokens)
    np.testing.assert_array_equal(parts["wte.embed"][absent], 0.0)

    # and each part against finite differences, perturbing wte on one side only
    def untied_loss(wte_embed, wte_head):
        x, _ = ops.embedding_forward(tokens, wte_embed, params["wpe"])
        for l in range(config.layers):
            x, _ = ops.block_forward(x, model.layer_params(params, l), config.heads)
        x, _ = ops.layernorm_forward(x, params["lnf.g"], params["lnf.b"])
        lg, _ = ops.lm_head_forward(x, wte_head)
        return float(ops.cross_entropy_forward(lg, targets)[0].mean())

    wte = params["wte"]
    assert untied_loss(wte, wte) == pytest.approx(loss, rel=1e-15)
    for idx in [(int(tokens[0, 0]), 1), (int(tokens[2, 5]), 7), (0, 3)]:
        for name, fn in [("wte.embed", lambda w: untied_loss(w, wte)),
                         ("wte.head", lambda w: untied_loss(wte, w))]:
            wp, wm = wte.copy(), wte.copy()
            wp[idx] += EPS
            wm[idx] -= EPS
            fd = (fn(wp) - fn(wm)) / (2 * EPS)
            assert abs(fd - parts[name][idx]) <= TOL, (name, idx, fd, parts[name][idx])


def test_float32_agrees_with_float64():
    """Same params (float32 = rounded float64), DESIGN's float32 tolerance 1e-5.

    float32 roundoff u32 = 6e-8 grows with the depth (about 30 ops in sequence) and
    with the contraction lengths (<= 128 here, pairwise/blocked sums grow ~ log2);
    a bound of ~30 * 7 * u32 = 1.3e-5 is the worst case, typical errors are far
    smaller (measured: loss 8e-9, gradients 4e-7). We allow 1e-5 relative on the
    loss and logits and 1e-5 relative (Frobenius norm) on each gradient."""
    kw = dict(vocab=37, seq=16, hidden=32, heads=4, layers=2)
    c64, c32 = model.Config(**kw), model.Config(**kw, dtype=np.float32)
    p64 = model.init_params(c64, 9)
    p32 = model.init_params(c32, 9)
    np.testing.assert_array_equal(p32["wte"], p64["wte"].astype(np.float32))
    p64 = {k: v.astype(np.float64) for k, v in p32.items()}   # identical values
    tokens, targets = _batch(c64, np.random.default_rng(10), 4, 16)
    l64, cache64 = model.forward(p64, tokens, targets, c64)
    l32, cache32 = model.forward(p32, tokens, targets, c32)
    assert cache32.logits.dtype == np.float32
    assert abs(l32 - l64) <= 1e-5 * abs(l64)
    np.testing.assert_allclose(cache32.logits, cache64.logits, rtol=0,
                               atol=1e-5 * np.abs(cache64.logits).max())
    g64, g32 = model.backward(cache64), model.backward(cache32)
    for key in g64:
        assert g32[key].dtype == np.float32, key
        rel = np.linalg.norm(g32[key] - g64[key]) / np.linalg.norm(g64[key])
        assert rel <= 1e-5, (key, rel)


def _peak(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("n_classes", [0, 2])
def test_checkpointing_same_gradients_less_memory(n_classes):
    config = model.Config(vocab=32, seq=32, hidden=32, heads=4, layers=4, n_classes=n_classes)
    params = _noisy_params(config, 11, scale=0.05)
    tokens, targets = _batch(config, np.random.default_rng(12), 4, 32)
    l0, c0 = model.forward(params, tokens, targets, config)
    l1, c1 = model.forward(params, tokens, targets, config, checkpoint=True)
    assert l0 == l1
    np.testing.assert_array_equal(c0.logits, c1.logits)
    g0, g1 = model.backward(c0), model.backward(c1)
    for key in g0:
        np.testing.assert_array_equal(g1[key], g0[key], err_msg=key)
    del c0, c1
    peaks = [_peak(lambda ck=ck: model.backward(model.forward(params, tokens, targets, config,
                                                              checkpoint=ck)[1]))
             for ck in (False, True)]
    print(f"tracemalloc peak: {peaks[0]} B without, {peaks[1]} B with checkpointing")
    assert peaks[1] < 0.7 * peaks[0], peaks


def test_backward_needs_targets():
    config = model.Config(vocab=5, seq=4, hidden=4, heads=2, layers=1)
    params = model.init_params(config)
    loss, cache = model.forward(params, np.zeros((1, 4), int), None, config)
    assert loss is None and cache.logits.shape == (1, 4, 5)
    with pytest.raises(ValueError, match="targets"):
        model.backward(cache)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=10, heads=3), "Config.hidden=10 is not divisible by Config.heads=3"),
    (dict(vocab=0), "Config.vocab"),
    (dict(seq=2.5), "Config.seq"),
    (dict(layers=True), "Config.layers"),
    (dict(ffn_mult=-1), "Config.ffn_mult"),
    (dict(n_classes=-2), "Config.n_classes"),
    (dict(dtype=np.float16), "Config.dtype"),
    (dict(dtype="int32"), "Config.dtype"),
])
def test_config_validation(kwargs, match):
    base = dict(vocab=5, seq=4, hidden=4, heads=2, layers=1)
    with pytest.raises(ValueError, match=match):
        model.Config(**(base | kwargs))


def test_config_accepts_dtype_names():
    assert model.Config(vocab=5, seq=4, hidden=4, heads=2, layers=1,
                        dtype="float32").dtype == np.float32


def test_input_validation():
    config = model.Config(vocab=5, seq=4, hidden=4, heads=2, layers=1)
    params = model.init_params(config)
    ok = np.zeros((2, 3), dtype=np.int64)
    cases = [
        (np.full((2, 3), 5), ok, "outside \\[0, Config.vocab=5\\)"),
        (np.full((2, 3), -1), ok, "outside"),
        (np.zeros((2, 3)), ok, "integer"),
        (np.zeros((2, 5), int), np.zeros((2, 5), int), "Config.seq=4"),
        (np.zeros((2, 3, 1), int), ok, "shape \\[b, s\\]"),
        (np.zeros((2, 0), int), np.zeros((2, 0), int), "shape \\[b, s\\]"),
        (ok, np.zeros((2, 2), int), "targets must have the shape"),
        (ok, np.full((2, 3), 7), "targets hold ids outside"),
        (ok, np.zeros((2, 3), np.float64), "integer"),
        ([[0, 1]], ok, "integer array"),
    ]
    for tokens, targets, match in cases:
        with pytest.raises(ValueError, match=match):
            model.forward(params, tokens, targets, config)
    bad = dict(params)
    bad["wte"] = params["wte"].astype(np.float32)
    with pytest.raises(ValueError, match="params\\['wte'\\] has dtype float32 but Config.dtype"):
        model.forward(bad, ok, ok, config)
    bad = dict(params)
    bad["h0.mlp.fc.w"] = np.zeros((4, 8))
    with pytest.raises(ValueError, match="h0.mlp.fc.w.*shape"):
        model.forward(bad, ok, ok, config)
    bad = dict(params)
    del bad["lnf.g"]
    with pytest.raises(ValueError, match="missing \\['lnf.g'\\]"):
        model.forward(bad, ok, ok, config)
    cls = model.Config(vocab=5, seq=4, hidden=4, heads=2, layers=1, n_classes=2)
    with pytest.raises(ValueError, match="classification"):
        model.forward(model.init_params(cls), ok, ok, cls)
    with pytest.raises(ValueError, match="n_classes=2"):
        model.forward(model.init_params(cls), ok, np.array([0, 2]), cls)


def test_matches_torch_autograd():
    """Optional: the same params loaded into PyTorch give the same loss and gradients."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    config = model.Config(vocab=11, seq=8, hidden=8, heads=2, layers=2)
    params = _noisy_params(config, 13)
    tokens, targets = _batch(config, np.random.default_rng(14), 2, 7)
    loss, cache = model.forward(params, tokens, targets, config)
    grads = model.backward(cache)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    h, nh = config.hidden, config.heads
    b, s = tokens.shape
    x = tp["wte"][torch.tensor(tokens)] + tp["wpe"][:s]
    for l in range(config.layers):
        P = {k: tp[f"h{l}.{k}"] for k in ops.BLOCK_KEYS}
        a = F.layer_norm(x, (h,), P["ln1.g"], P["ln1.b"], eps=1e-5)
        q, k, v = (a @ P["attn.qkv.w"] + P["attn.qkv.b"]).split(h, dim=2)
        q, k, v = (z.view(b, s, nh, h // nh).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h)
        x = x + y @ P["attn.proj.w"] + P["attn.proj.b"]
        m = F.layer_norm(x, (h,), P["ln2.g"], P["ln2.b"], eps=1e-5)
        m = F.gelu(m @ P["mlp.fc.w"] + P["mlp.fc.b"], approximate="tanh")
        x = x + m @ P["mlp.proj.w"] + P["mlp.proj.b"]
    x = F.layer_norm(x, (h,), tp["lnf.g"], tp["lnf.b"], eps=1e-5)
    tl = F.cross_entropy((x @ tp["wte"].T).reshape(-1, config.vocab),
                         torch.tensor(targets).reshape(-1))
    tl.backward()
    assert abs(tl.item() - loss) <= 1e-12 * loss
    for key in params:
        np.testing.assert_allclose(grads[key], tp[key].grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=key)


def test_bench_smoke(capsys):
    """The benchmark CLI runs (tiny shapes) and reports checkpointing's memory drop."""
    from summasim.bench import layer
    from summasim.bench.__main__ import parse_args

    res = layer.run(parse_args(["layer", "--batch", "2", "--model",
                                "h=16,heads=2,layers=3,seq=8,vocab=8", "--repeats", "1",
                                "--blocks", "1"]))
    out = capsys.readouterr().out
    assert "numpy" in out and "checkpointing: peak" in out
    off, on = res["memory"]
    assert on["held_after_forward_bytes"] < off["held_after_forward_bytes"]


def test_bench_layer_with_torch_times_the_blas_of_both(capsys):
    """``bench layer --torch`` checks the layer against torch and times the MLP's GEMM
    in both libraries, naming each one's BLAS, so that a gap can be read as the BLAS's."""
    pytest.importorskip("torch", reason="--torch times PyTorch, which is not a summasim "
                                        "dependency and is not installed here")
    from summasim.bench import layer
    from summasim.bench.__main__ import parse_args

    res = layer.run(parse_args(["layer", "--torch", "--batch", "2", "--model",
                                "h=32,heads=2,layers=1,seq=8,vocab=8", "--repeats", "1",
                                "--blocks", "1", "--no-memory"]))
    out = capsys.readouterr().out
    [timing] = res["timing"]
    g = timing["gemm"]
    assert g["shape"] == [16, 32, 128]
    assert g["numpy_gflops"] > 0 and g["torch_gflops"] > 0
    assert g["numpy_blas"] != "unknown" and g["torch_blas"] != "unknown"
    assert "the MLP's GEMM 16x32x128" in out and timing["max_rel_diff_vs_torch"] < 1e-5


def test_a_spec_model_is_refused_with_what_to_do():
    """The runtime takes a ``model.Config``; a ``spec.Model`` (the description every floor
    shares) got an AttributeError from deep inside. Now: a TypeError naming Config.of."""
    from types import SimpleNamespace

    from summasim import spec
    from summasim.transformer import megatron, optimus, tp3d

    m = spec.Model.parse("tiny")
    calls = [lambda: model.init_params(m),
             lambda: model.forward({}, np.zeros((1, 4), np.int64), None, m),
             lambda: megatron.check(m, one),
             lambda: optimus.check(m, SimpleNamespace(pr=1, pc=1, d=1, row=0, col=0,
                                                      depth=0, layer=0)),
             lambda: tp3d.check(m, SimpleNamespace(q=1, d=1, row=0, col=0, depth=0))]
    from mpi4py import MPI

    from summasim.grid import Grid1D

    with Grid1D(MPI.COMM_SELF) as one:
        for call in calls:
            with pytest.raises(TypeError, match=r"got Model \(Config.of\(model, dtype\)"):
                call()
    with pytest.raises(TypeError, match="got dict$"):
        model.init_params({"hidden": 8})
    assert len(model.init_params(model.Config.of(m))) == len(model.param_shapes(
        model.Config.of(m)))
