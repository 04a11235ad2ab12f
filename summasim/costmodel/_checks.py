"""Argument checks of the cost model's public functions (pure): a size that is not a
finite number >= 0, or a count that is not a whole number, is a ``ValueError`` naming
the argument, never a NaN, an infinity or an arithmetic error deep inside a formula."""

from __future__ import annotations

import math
import numbers


def _scalar(value):
    """A 0-d array (a NumPy or CuPy reduction's result) as its Python number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:                  # an int beyond any float
        return False


def finite_size(name: str, value, *, positive: bool = False) -> float:
    """``value`` as a float when it is a real number (a 0-d array too), finite and >= 0
    (> 0 with ``positive``); else ``ValueError`` naming ``name``."""
    value = _scalar(value)
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and _finite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, "
                         f"got {value!r}")
    return float(value)


def whole(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int when it is a whole number >= ``minimum`` (an integral float
    such as 4.0 counts, and a 0-d array); else ``ValueError`` naming ``name``."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        ok = False
    elif isinstance(value, numbers.Integral):
        ok = True
    else:
        ok = _finite(value) and float(value).is_integer()
    if not ok or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)
