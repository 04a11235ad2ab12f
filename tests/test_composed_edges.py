"""The pure parts of sharded training at its edges (no MPI): the ring's group totals
that the harness's nominal traffic check rests on, the ZeRO-3 cache detach/attach,
1F1B with fewer micro-batches than stages, and the harness's classification inputs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from summasim.harness.composed import mesh_inputs
from summasim.transformer.composed import (_map_arrays, _ptr, _Ref, _ref_of, ring_send_items,
                                           schedule)
from summasim.transformer.model import Config


@given(n=st.integers(0, 300), p=st.integers(1, 17))
def test_a_ring_half_sends_p_minus_1_times_n_over_the_group_however_n_divides(n, p):
    # every rank sends every chunk but one: (p - 1) n items in all, the identity
    # behind harness.composed.nominal_group_traffic
    for half, times in (("rs", 1), ("ag", 1), ("ar", 2)):
        assert sum(ring_send_items(n, p, r, half) for r in range(p)) == times * (p - 1) * n
    # and each rank sends between n - ceil(n/p) and n - floor(n/p) per half
    for r in range(p):
        assert n - -(-n // p) <= ring_send_items(n, p, r, "rs") <= n - n // p


def test_1f1b_with_fewer_microbatches_than_stages():
    # warm-up min(pp - s - 1, m) = m: every forward, then every backward in order
    assert schedule("1f1b", 1, 4, 0) == [("F", 0, 0), ("B", 0, 0)]
    assert schedule("1f1b", 2, 4, 1) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert schedule("1f1b", 2, 4, 3) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]


class _Inner(NamedTuple):
    w: object
    x: object


class _Outer(NamedTuple):
    params: dict
    inner: _Inner
    layers: list
    grid: object


def test_zero3_detach_and_attach_round_trip():
    buf = np.arange(24.0)                                        # a gathered unit
    other = np.ones(5)                                           # an activation
    w = buf[4:16].reshape(3, 4)
    cache = _Outer(params={"w": w, "b": buf[:4], "none": buf[:0]},
                   inner=_Inner(w=w.T, x=other), layers=[buf[16:20], (other, buf[20:])],
                   grid="grid")
    bufs = [(0, _ptr(buf), buf.nbytes)]
    out = _map_arrays(cache, lambda a: _ref_of(a, bufs))
    assert isinstance(out, _Outer) and isinstance(out.inner, _Inner)
    assert isinstance(out.params["w"], _Ref) and isinstance(out.inner.w, _Ref)
    assert isinstance(out.layers[1][1], _Ref) and out.layers[1][0] is other
    assert out.inner.x is other and out.grid == "grid" and out.params["none"].size == 0
    fresh = buf * 10                                             # the backward's gather
    back = _map_arrays(out, lambda a: a, lambda r: r.view([fresh]))
    np.testing.assert_array_equal(back.params["w"], fresh[4:16].reshape(3, 4))
    np.testing.assert_array_equal(back.inner.w, fresh[4:16].reshape(3, 4).T)
    np.testing.assert_array_equal(back.layers[1][1], fresh[20:])
    assert np.shares_memory(back.params["b"], fresh) and not np.shares_memory(
        back.params["b"], buf)
    # nothing to take out: the very same object back
    assert _map_arrays(cache, lambda a: _ref_of(a, [(0, _ptr(other) + 10**6, 8)])) is cache


def test_harness_inputs_for_classification_are_class_labels():
    config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=1, n_classes=3)
    _, tokens, targets = mesh_inputs(config, 5, 0)
    assert tokens.shape == (5, 4) and targets.shape == (5,)
    assert 0 <= targets.min() and targets.max() < 3
    _, tokens, targets = mesh_inputs(Config(vocab=8, seq=4, hidden=8, heads=2, layers=1), 5, 0)
    assert targets.shape == tokens.shape
