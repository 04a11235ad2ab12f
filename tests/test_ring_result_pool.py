"""The plain call's result pool (summasim.algorithms.allreduce._fresh_result): a result
the caller can still reach is never handed out again; a dropped one is; the pool is
bounded (pure: no MPI)."""

import numpy as np
import pytest

from summasim.algorithms import allreduce as ar


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.setattr(ar, "_result_pool", [])


def _big(n=1 << 18):
    return np.ones(n)                          # 2 MiB of float64, above POOL_MIN_BYTES


def test_a_result_the_caller_holds_is_never_reused():
    x = _big()
    held = [ar._fresh_result(x, np) for _ in range(4)]
    for i, a in enumerate(held):
        for b in held[i + 1:]:
            assert not np.shares_memory(a, b)


def test_a_dropped_result_is_reused_and_a_view_keeps_it_held():
    x = _big()
    a = ar._fresh_result(x, np)
    a[0] = 7.0
    addr = a.__array_interface__["data"][0]
    del a
    b = ar._fresh_result(x, np)                      # the dropped buffer, faulted in
    assert b.__array_interface__["data"][0] == addr and b[0] == 7.0
    view = b[::2]
    del b
    c = ar._fresh_result(x, np)                      # b's memory is still reachable
    assert not np.shares_memory(c, view)
    view[0] = -1.0
    assert c[0] != -1.0


def test_shapes_dtypes_and_small_results():
    x = np.ones((512, 256), dtype=np.float32)        # 512 KiB: below the pool
    assert ar._fresh_result(x, np).shape == (512, 256) and not ar._result_pool
    y = np.ones((1024, 512), dtype=np.float32)       # 2 MiB: pooled, in its shape
    r = ar._fresh_result(y, np)
    assert r.shape == (1024, 512) and r.dtype == np.float32 and len(ar._result_pool) == 1
    del r
    z = np.ones(1 << 19, dtype=np.float32)           # same bytes, other shape: reused
    assert ar._fresh_result(z, np).shape == (1 << 19,) and len(ar._result_pool) == 1


def test_the_pool_is_bounded(monkeypatch):
    monkeypatch.setattr(ar, "POOL_MAX_BYTES", 5 << 20)
    held = [ar._fresh_result(_big(), np) for _ in range(5)]       # 2 MiB each
    assert len([b for b in ar._result_pool if b.size == 1 << 18]) <= ar.POOL_PER_SIZE
    others = [ar._fresh_result(_big(1 << 17), np) for _ in range(3)]   # 1 MiB each
    assert sum(b.nbytes for b in ar._result_pool) <= 5 << 20
    for a in held + others:                # evicted from the pool, still the caller's
        a[...] = 1.0
    assert all(not np.shares_memory(a, b) for i, a in enumerate(held + others)
               for b in (held + others)[i + 1:])


def test_free_is_measured_by_the_count_this_interpreter_gives():
    """A pooled buffer's owner is free at the count measured at import (the pool's view
    alone), and held at any count above it: each array the caller keeps adds one."""
    import sys

    x = _big()
    a = ar._fresh_result(x, np)
    (buf,) = ar._result_pool
    held = sys.getrefcount(buf.base)
    del a
    for buf in ar._result_pool:                  # read as _fresh_result reads it
        free = sys.getrefcount(buf.base)         # (not inside assert: pytest keeps refs)
    assert free == ar._FREE_REFS < held
