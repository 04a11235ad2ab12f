"""Numerical validation against serial references: derived tolerances and errors.

Error measure
-------------
For a product C = A B of contraction length k, the error of entry (i, j) is
measured against the natural scale of that entry, (|A| |B|)_ij::

    err = max_ij |C - C_ref|_ij / (|A| |B|)_ij

Tolerance
---------
With unit roundoff u (2^-53 for float64, 2^-24 for float32), a dot product of
length k computed in any summation order satisfies, with probability at least
1 - 2 exp(-lambda^2 / 2) per entry (Higham & Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019)::

    |c_hat - c| <= lambda sqrt(k) u (|A| |B|)_ij

We take lambda = 8 (failure probability below 3e-14 per entry) and count the
rounding of both the result (u of its dtype) and the float64 reference (u_64)::

    tol(k, dtype) = 8 sqrt(k) (u + u_64)

For k = 1024 that is 1.4e-14 in float64 and 1.5e-5 in float32, inside the
project's stated bounds of about 1e-12 and 1e-5. A sum over p ranks (all-reduce)
is a dot product of length p with ones.
"""

from __future__ import annotations

import math

import numpy as np

LAMBDA = 8.0


def unit_roundoff(dtype) -> float:
    """u = eps / 2 of a floating dtype."""
    return float(np.finfo(np.dtype(dtype)).eps) / 2.0


def tolerance(k: int, dtype) -> float:
    """Derived bound on the scaled error of a length-``k`` contraction in ``dtype``."""
    return LAMBDA * math.sqrt(max(int(k), 1)) * (unit_roundoff(dtype) + unit_roundoff(np.float64))


def scaled_error(c, ref, scale) -> float:
    """``max |c - ref| / scale`` over entries (entries with zero scale must match exactly).

    NaN when any entry of ``c``, ``ref`` or ``scale`` is not finite: a non-finite
    value is never "exact", and ``NaN <= bound`` is false, so such a check fails.
    """
    c = np.asarray(c, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    if not (np.isfinite(c).all() and np.isfinite(ref).all() and np.isfinite(scale).all()):
        return math.nan
    diff = np.abs(c - ref)
    if diff.size == 0:
        return 0.0
    tiny = np.finfo(np.float64).tiny
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale > tiny, diff / np.maximum(scale, tiny),
                         np.where(diff > 0, np.inf, 0.0))
    return float(ratio.max())


def passes(error: float, bound: float) -> bool:
    """The verdict of one check: the error is a finite number within the bound."""
    return bool(math.isfinite(error) and error <= bound)


def product_error(c, a, b) -> float:
    """Scaled error of ``c`` against ``a @ b`` computed in float64 (host arrays)."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    return scaled_error(c, a64 @ b64, np.abs(a64) @ np.abs(b64))
