"""The NumPy backend's in-place GEMM: SciPy's BLAS, called without the GIL when the GEMM
is long (so the heartbeat and the signal watcher run meanwhile), with the same results,
bit for bit, as SciPy's own wrapper, and the same refusals. And what ``get_backend``
says of a missing CuPy."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from summasim.backends import numpy_backend as nb

BE = nb.NumpyBackend()
DTYPES = [np.float64, np.float32, np.complex128, np.complex64]


def _operands(rng, dt, m, k, n, ta, tb):
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dt)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dt)
    return a, b, rng.standard_normal((m, n)).astype(dt)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_gil_free_call_is_scipys_bit_for_bit(dt, monkeypatch):
    assert nb._gil_free_gemm(np.dtype(dt)) is not None, "SciPy's cython_blas has no ?gemm"
    rng = np.random.default_rng(1)
    for ta, tb, acc in itertools.product((False, True), repeat=3):
        a, b, c0 = _operands(rng, dt, 37, 23, 41, ta, tb)
        ref = (a.T if ta else a) @ (b.T if tb else b) + (c0 if acc else 0)
        out = []
        for threshold in (1 << 62, 1):                 # SciPy's wrapper, then ctypes
            monkeypatch.setattr(nb, "GIL_FREE_FLOPS", threshold)
            c = c0.copy()
            assert BE.gemm(a, b, c, trans_a=ta, trans_b=tb, accumulate=acc) is c
            out.append(c)
        assert np.array_equal(out[0], out[1]), (ta, tb, acc)
        tol = 1e-12 if dt in (np.float64, np.complex128) else 1e-4
        assert np.abs(out[1] - ref).max() <= tol * np.abs(ref).max(), (ta, tb, acc)


def test_bad_shapes_and_read_only_outputs_still_raise(monkeypatch):
    """Raw BLAS checks nothing: a mismatch must reach SciPy's checks, never memory."""
    monkeypatch.setattr(nb, "GIL_FREE_FLOPS", 1)
    a, b = np.ones((8, 5)), np.ones((6, 7))
    with pytest.raises(Exception):
        BE.gemm(a, b, np.zeros((8, 7)))                 # k: 5 against 6
    a, b = np.ones((8, 5)), np.ones((5, 7))
    with pytest.raises(Exception):
        BE.gemm(a, b, np.zeros((8, 6)))                 # c's columns
    for threshold in (1, 1 << 62):      # SciPy's wrapper wrote a copy and dropped it
        monkeypatch.setattr(nb, "GIL_FREE_FLOPS", threshold)
        c = np.zeros((8, 7))
        c.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            BE.gemm(a, b, c)
        assert not c.any()


@pytest.mark.parametrize("threshold", [1, 1 << 62])
def test_a_misaligned_output_gets_the_product(monkeypatch, threshold):
    """A ``c`` that is not aligned to its item size (a view at an odd byte offset): the
    product lands in it on either path (SciPy's wrapper wrote an aligned copy and dropped
    it, so small products were silently lost)."""
    monkeypatch.setattr(nb, "GIL_FREE_FLOPS", threshold)
    c = np.frombuffer(bytearray(8 * 56 + 1), np.float64, offset=1, count=56).reshape(8, 7)
    assert not c.flags.aligned
    a, b = np.arange(40.0).reshape(8, 5), np.arange(35.0).reshape(5, 7)
    BE.gemm(a, b, c)
    assert np.array_equal(c, a @ b)


def test_a_long_gemm_lets_other_threads_run():
    """A thread that ticks every 10 ms keeps ticking during a GEMM of ~0.1-1 s; under
    the GIL-holding wrapper it ticked at most once."""
    n = 1600
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal((n, n)) for _ in range(3))
    BE.gemm(a[:64, :64].copy(), b[:64, :64].copy(), np.empty((64, 64)))   # imports SciPy
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        with threadpool_limits(1):
            t0 = time.monotonic()
            BE.gemm(a, b, c, accumulate=True)
            t1 = time.monotonic()
    finally:
        stop.set()
        thread.join()
    during = sum(t0 < t < t1 for t in ticks)
    assert t1 - t0 > 0.05, f"the GEMM took {t1 - t0:.3f} s: too short to tell"
    assert during >= 3, f"{during} ticks during a {t1 - t0:.2f} s GEMM"


def test_get_backend_cupy_without_cupy_says_what_is_missing(monkeypatch):
    """A library caller asking for the CuPy backend where CuPy is missing gets what the
    front-ends say (a RuntimeError naming the extra), not a bare ModuleNotFoundError."""
    import sys

    from summasim import backends

    monkeypatch.setitem(sys.modules, "cupy", None)            # import cupy raises
    monkeypatch.setattr(backends, "_cache", {})
    with pytest.raises(RuntimeError, match=r"get_backend: cupy needs CuPy \(pip install "
                                           r"'summasim\[cupy\]'\)"):
        backends.get_backend("cupy")
    assert backends.get_backend("numpy").name == "numpy"
