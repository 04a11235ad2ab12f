"""Activation memory of the serial model: ``model.activation_items`` against the bytes
its caches really hold, the relation to Korthikanti et al. 2022, eq. (1), and the
measured peak of forward + backward under each recompute mode.

Counting what a cache holds: walk the ``ModelCache`` (NamedTuples, lists, tuples,
dicts), take every NumPy array, follow ``.base`` to the buffer that owns the memory
and count each owning buffer once (q, k, v are views of one QKV output; the merged
heads are both the core's output and the output projection's input). Parameters
(``cache.params`` and the weights the linear caches point to) are not activations and
are left out. Floating buffers must come to ``activation_items(...).total * itemsize``
exactly, integer ones (token and target ids) to ``.ids * itemsize``: an exact count,
no tolerance.
"""

import itertools
import tracemalloc

import numpy as np
import pytest

from summasim.transformer import model

B, S = 3, 7
COMBOS = list(itertools.product(("none", "selective", "full"), ("plain", "flash"),
                                ("gelu", "swiglu"), (4, 2, 1)))


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def held_bytes(obj, params) -> dict:
    """``{"float": bytes, "int": bytes}`` of the distinct buffers ``obj`` holds, parameters
    excluded."""
    skip = {id(_root(v)) for v in params.values()}
    roots = {}

    def walk(o):
        if isinstance(o, np.ndarray):
            r = _root(o)
            if id(r) not in skip:
                roots[id(r)] = r
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (tuple, list)):
            for v in o:
                walk(v)

    walk(obj)
    out = {"float": 0, "int": 0}
    for r in roots.values():
        out["float" if r.dtype.kind == "f" else "int"] += r.nbytes
    return out


def _run(config, recompute, attention, b=B, s=S, seed=0):
    params = model.init_params(config, seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab, (b, s))
    targets = (rng.integers(0, config.n_classes, b) if config.n_classes
               else rng.integers(0, config.vocab, (b, s)))
    _, cache = model.forward(params, tokens, targets, config, recompute=recompute,
                             attention=attention, tile=3)
    return params, tokens, cache


@pytest.mark.parametrize("recompute, attention, mlp, kv_heads", COMBOS)
def test_cache_bytes_equal_the_formula(recompute, attention, mlp, kv_heads):
    config = model.Config(vocab=11, seq=8, hidden=16, heads=4, layers=2, ffn_mult=2.5,
                          mlp=mlp, kv_heads=kv_heads)
    params, tokens, cache = _run(config, recompute, attention)
    items = model.activation_items(config, B, S, recompute, attention)
    f, i = config.dtype.itemsize, tokens.itemsize
    whole = held_bytes(cache._replace(params=None), params)
    assert whole == {"float": items.total * f, "int": items.ids * i}, (whole, items)
    # part by part: embedding, each layer, head (lnf, LM head, logits), loss
    assert held_bytes(cache.emb, params) == {"float": items.embedding * f, "int": B * S * i}
    for block in cache.blocks:
        assert held_bytes(block, params) == {"float": items.layer * f, "int": 0}
    assert held_bytes((cache.lnf, cache.head, cache.logits), params)["float"] == items.head * f
    assert held_bytes(cache.ce, params) == {"float": items.loss * f, "int": B * S * i}
    assert items.layer == sum(items.layer_terms.values())
    assert items.layers == config.layers * items.layer


@pytest.mark.parametrize("tied, n_classes, dtype", [(False, 0, np.float64), (True, 3, np.float64),
                                                     (True, 0, np.float32)])
def test_cache_bytes_other_heads_and_dtype(tied, n_classes, dtype):
    """Untied LM head, a classifier (its last-token rows are a view of the whole final
    LayerNorm output) and float32 (4-byte items)."""
    config = model.Config(vocab=11, seq=8, hidden=16, heads=4, layers=2, tied=tied,
                          n_classes=n_classes, dtype=dtype)
    for recompute in ("none", "selective", "full"):
        params, tokens, cache = _run(config, recompute, "plain")
        items = model.activation_items(config, B, S, recompute)
        assert held_bytes(cache._replace(params=None), params) == {
            "float": items.total * np.dtype(dtype).itemsize, "int": items.ids * tokens.itemsize}


def test_relation_to_korthikanti_eq1():
    """Korthikanti et al. 2022, eq. (1): a GPT layer keeps 34 s b h + 5 a s^2 b bytes
    with 2-byte activations and 1-byte dropout masks; selective 34 s b h (section 4.2),
    full 2 s b h. summasim has no dropout (no masks: s b h after the attention's output
    projection, s b h after the MLP, a s^2 b after the softmax; no dropout output a s^2 b
    of 2 bytes) and adds q * scale (s b h) and the two LayerNorms' rstd (2 s b)."""
    b, s, h, a = 2, 16, 32, 4
    config = model.Config(vocab=8, seq=s, hidden=h, heads=a, layers=3)

    def layer(rc):
        return model.activation_items(config, b, s, rc).layer

    sbh, as2b, sb = s * b * h, a * s * s * b, s * b
    dropout_bytes = 2 * sbh + as2b + 2 * as2b          # masks (1 byte) + dropout output
    assert 2 * (layer("none") - sbh - 2 * sb) + dropout_bytes == 34 * sbh + 5 * as2b
    assert 2 * (layer("selective") - 2 * sb) + 2 * sbh == 34 * sbh
    assert 2 * layer("full") == 2 * sbh
    flash = model.activation_items(config, b, s, "none", "flash").layer
    assert layer("none") - flash == sbh + as2b - a * s * b    # no q * scale, no probs; lse


def _traced(config, b, s, recompute, attention):
    """``(held after forward, peak of forward + backward)`` in bytes above the start,
    by tracemalloc (the parameters and ids are made before tracing starts)."""
    params = model.init_params(config, 1)
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, config.vocab, (b, s)) for _ in range(2))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        _, cache = model.forward(params, tokens, targets, config, recompute=recompute,
                                 attention=attention)
        held = tracemalloc.get_traced_memory()[0] - base
        grads = model.backward(cache)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del grads, cache
    return held, peak


def test_peak_shrinks_with_recompute():
    """Where the b a s^2 scores dominate a layer (s = 96, h = 16), the measured peak of
    forward + backward falls from none to selective to full, and flash holds less than
    plain. tracemalloc sees at least the formula's bytes held after the forward; the
    rest (printed, about 4-13 KiB here) is fixed-size Python objects: array headers,
    NamedTuples, lists. The exact count is :func:`test_cache_bytes_equal_the_formula`'s."""
    b, s = 3, 96
    config = model.Config(vocab=16, seq=s, hidden=16, heads=4, layers=3)
    it = model.activation_items(config, b, s)
    assert it.layer_terms["attn.core"] > it.layer - it.layer_terms["attn.core"]  # s^2 dominates
    peaks = {}
    for rc, att in [("none", "plain"), ("selective", "plain"), ("full", "plain"),
                    ("none", "flash")]:
        _traced(config, 1, s, rc, att)      # warm-up: lazy imports, NumPy's first-use caches
        held, peak = _traced(config, b, s, rc, att)
        items = model.activation_items(config, b, s, rc, att)
        formula = (items.total + items.ids) * 8 - b * s * 8     # the tokens predate tracing
        peaks[rc, att] = peak
        print(f"b={b} s={s} {rc:9s} {att:5s}: formula {formula / 2**20:6.3f} MiB, held after "
              f"forward {held / 2**20:6.3f} MiB (+{(held - formula) / 1024:.1f} KiB), peak "
              f"fwd+bwd {peak / 2**20:6.3f} MiB")
        assert formula <= held, (rc, att, held, formula)
    assert peaks["none", "plain"] > peaks["selective", "plain"] > peaks["full", "plain"]
    assert peaks["none", "flash"] < peaks["none", "plain"]
