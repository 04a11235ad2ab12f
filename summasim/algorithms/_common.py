"""Argument checks shared by the algorithms (local: no communication)."""

from __future__ import annotations

from ..backends import array_module, backend_of
from ..comm import Comm

_FLOAT_KINDS = ("f", "c")


def check_operands(a, b, fn: str):
    """Both operands are 2-D floating arrays of one dtype and one backend.

    Returns the backend to compute with. Raises ``TypeError`` for mismatched or
    non-floating dtypes and mixed backends, ``ValueError`` for wrong ranks.
    """
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{fn}: {name} must be a 2-D block, got shape {tuple(x.shape)}")
        if x.dtype.kind not in _FLOAT_KINDS:
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}; expected a floating dtype")
    if a.dtype != b.dtype:
        raise TypeError(f"{fn}: mismatched dtypes a: {a.dtype} and b: {b.dtype}")
    array_module(a, b)  # raises TypeError on mixed host/device operands
    return backend_of(a)


def check_inner(fn: str, what: str, left: int, right: int):
    """Raise ``ValueError`` unless two block extents that must agree do."""
    if left != right:
        raise ValueError(f"{fn}: block shapes do not conform: {what} ({left} != {right})")


def contiguous(x):
    """``x`` if C-contiguous, else a contiguous copy (MPI needs contiguous buffers)."""
    return x if x.flags.c_contiguous else array_module(x).ascontiguousarray(x)


def check_grid(grid, fn: str):
    if not all(hasattr(grid, f) for f in ("q", "d", "row", "col", "depth")):
        raise TypeError(f"{fn}: grid must be a summasim.grid.Grid, got {type(grid).__name__}")


def is_comm(c) -> bool:
    return isinstance(c, Comm)
