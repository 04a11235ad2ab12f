"""Derived tolerances and the scaled error measure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from summasim.validate import product_error, scaled_error, tolerance, unit_roundoff


def test_tolerance_formula_and_stated_bounds():
    assert unit_roundoff(np.float64) == 2.0**-53
    assert unit_roundoff(np.float32) == 2.0**-24
    assert tolerance(1024, np.float64) == pytest.approx(8 * 32 * 2 * 2.0**-53)
    assert tolerance(100, np.float32) == pytest.approx(8 * 10 * (2.0**-24 + 2.0**-53))
    # inside the project's stated bounds: ~1e-12 (float64) and ~1e-5 (float32) at k = 1024
    assert tolerance(1024, np.float64) < 1e-12
    assert 1e-6 < tolerance(1024, np.float32) < 2e-5
    assert tolerance(0, np.float64) == tolerance(1, np.float64)


def test_scaled_error_detects_wrong_entries():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    c = a @ b
    assert product_error(c, a, b) <= tolerance(7, np.float64)
    c_bad = c.copy()
    c_bad[2, 1] += 1e-6 * (np.abs(a) @ np.abs(b))[2, 1]
    assert product_error(c_bad, a, b) == pytest.approx(1e-6, rel=1e-6)
    # float32 rounding of the result is inside the float32 bound, not the float64 one
    c32 = (a.astype(np.float32) @ b.astype(np.float32))
    e32 = product_error(c32, a.astype(np.float32), b.astype(np.float32))
    assert tolerance(7, np.float64) < e32 <= tolerance(7, np.float32)


def test_zero_scale_entries_must_be_exact():
    ref = np.zeros(3)
    assert scaled_error(np.zeros(3), ref, np.zeros(3)) == 0.0
    assert math.isinf(scaled_error(np.array([0, 1e-300, 0]), ref, np.zeros(3)))
    assert scaled_error(np.zeros(0), np.zeros(0), np.zeros(0)) == 0.0
