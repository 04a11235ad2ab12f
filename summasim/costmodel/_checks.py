"""Argument checks of the cost model's public functions (pure): a size that is not a
finite number >= 0, or a count that is not a whole number, is a ``ValueError`` naming
the argument, never a NaN, an infinity or an arithmetic error deep inside a formula."""

from __future__ import annotations

import math
import numbers


def finite_size(name: str, value, *, positive: bool = False) -> float:
    """``value`` as a float when it is a real number, finite and >= 0 (> 0 with
    ``positive``); else ``ValueError`` naming ``name``."""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, "
                         f"got {value!r}")
    return float(value)


def whole(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int when it is a whole number >= ``minimum`` (an integral float
    such as 4.0 counts); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        ok = False
    elif isinstance(value, numbers.Integral):
        ok = True
    else:
        ok = math.isfinite(value) and float(value).is_integer()
    if not ok or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)
