"""bench layer's breakdown: each part of the serial layer, timed in NumPy and in torch."""

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from summasim.bench import layer_parts as lp
from summasim.bench.layer import _layer

MODEL = SimpleNamespace(hidden=32, heads=4, ffn_mult=4)


def _params(dtype=np.float64):
    return _layer(MODEL, dtype)


def test_blocks_alternate_and_each_opens_with_an_untimed_call():
    calls = []
    runs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    best = lp.best_in_blocks(runs, repeats=3, warm_s=0.0)
    # block 1: 2 timed calls after the opening one; block 2: 1 timed call after it
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 2 + ["b"] * 2
    assert set(best) == {"a", "b"} and all(0 <= s < 1 for s in best.values())


def test_blocks_keep_the_least_time_of_the_timed_calls_only(monkeypatch):
    clock = [0.0]                     # a fake clock that each call moves on
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    durations = iter([0.001, 0.004, 0.002, 0.001, 0.003])  # the opening calls are fastest

    def call():
        clock[0] += next(durations)

    best = lp.best_in_blocks({"a": call}, repeats=3, warm_s=0.0)
    assert best["a"] == pytest.approx(0.002)


def test_a_block_opens_with_calls_for_at_least_warm_s(monkeypatch):
    clock, calls = [0.0], []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def call():
        calls.append(clock[0])
        clock[0] += 0.01

    lp.best_in_blocks({"a": call}, repeats=1, warm_s=0.035)
    assert len(calls) == 4 + 1       # one block: untimed until 0.04 >= 0.035, 1 timed call
    calls.clear()
    lp.best_in_blocks({"a": call}, repeats=1, warm_s=0.0)
    assert len(calls) == 2           # one opening call and the one timed call
    with pytest.raises(ValueError, match="at least 1"):
        lp.best_in_blocks({"a": call}, repeats=0)


def test_the_numpy_parts_are_the_layers_ops_at_its_shapes():
    p = _params()
    inp = lp._inputs(p, batch=2, seq=8, heads=MODEL.heads, dtype=np.float64)
    parts = lp.numpy_parts(inp)
    assert tuple(parts) == lp.PARTS
    lin = parts["linears"]()
    assert [y.shape for y, *_ in lin] == [(2, 8, 96), (2, 8, 32), (2, 8, 128), (2, 8, 32)]
    x, w, b, dy = inp["lin"][2]
    y, dx, dw, db = lin[2]
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-12)
    np.testing.assert_allclose(dw, x.reshape(-1, 32).T @ dy.reshape(-1, 128), rtol=1e-12)
    np.testing.assert_allclose(db, dy.sum(axis=(0, 1)), rtol=1e-12)
    (y, dqkv), = parts["attention"]()
    assert y.shape == (2, 8, 32) and dqkv.shape == (2, 8, 96)
    # causal: the first token's output is its own value head
    v0 = inp["qkv"][:, 0, 64:]
    np.testing.assert_allclose(y[:, 0], v0, rtol=1e-12)
    assert len(parts["layer norms"]()) == 2
    (y, dh), = parts["GELU"]()
    assert y.shape == dh.shape == inp["h"].shape


def test_describe_gives_each_parts_ratio_and_their_sum():
    parts = {"numpy": {"linears": 0.6, "attention": 0.12, "layer norms": 0.04, "GELU": 0.06},
             "torch": {"linears": 0.5, "attention": 0.06, "layer norms": 0.01, "GELU": 0.03},
             "torch_manual_attn": {"attention": 0.15}}
    lines = lp.describe(parts)
    assert len(lines) == len(lp.PARTS) + 1
    assert lines[0].startswith("linears") and "1.20x" in lines[0]
    assert "2.00x" in lines[1] and "(torch written out 150.0 ms, 0.80x)" in lines[1]
    assert "4.00x" in lines[2] and "2.00x" in lines[3]
    assert lines[4].startswith("together") and "820.0 ms" in lines[4] and "1.37x" in lines[4]


def test_speedups_compare_each_later_thread_count_with_the_first():
    one = {"threads": 1, "parts": {lib: dict.fromkeys(lp.PARTS, 0.4) for lib in ("numpy", "torch")}}
    two = {"threads": 2, "parts": {"numpy": dict.fromkeys(lp.PARTS, 0.4),
                                   "torch": dict.fromkeys(lp.PARTS, 0.2)}}
    line, = lp.speedups([one, two])
    assert line.startswith("speed-up from 1 to 2 threads")
    assert line.count("numpy 1.00x") == len(lp.PARTS) and line.count("torch 2.00x") == len(lp.PARTS)
    assert lp.speedups([one]) == [] and lp.speedups([]) == []


def test_time_parts_without_torch_times_every_numpy_part():
    r = lp.time_parts(_params(np.float32), 2, 8, MODEL.heads, np.float32, repeats=1,
                      use_torch=False)
    assert set(r) == {"numpy"} and tuple(r["numpy"]) == lp.PARTS
    assert all(0 < s < 10 and math.isfinite(s) for s in r["numpy"].values())


def test_the_torch_parts_compute_what_the_numpy_parts_do():
    pytest.importorskip("torch", reason="torch is not a summasim dependency; this compares "
                                        "the parts with PyTorch's where it is installed")
    p = _params()
    inp = lp._inputs(p, batch=2, seq=8, heads=MODEL.heads, dtype=np.float64)
    ours = lp.numpy_parts(inp)
    for theirs in (lp.torch_parts(inp), lp.torch_parts(inp, sdpa=False)):
        for part in lp.PARTS:
            for a, b in zip(ours[part](), theirs[part](), strict=True):
                for u, v in zip(a, b, strict=True):
                    np.testing.assert_allclose(u, v.detach().numpy(), rtol=1e-9, atol=1e-12,
                                               err_msg=part)


def test_adam_peers_time_both_optimizers_over_the_given_shapes():
    pytest.importorskip("torch", reason="torch is not a summasim dependency; the Adam peer "
                                        "is timed where it is installed")
    got = lp.adam_peers({"w": (16, 8), "b": (8,)}, np.float32, repeats=1)
    assert set(got) == {"numpy", "torch"} and all(0 < s < 1 for s in got.values())
