"""Block layouts: pure index math, plus split/join of global arrays.

Block notation follows the papers: ``A[I_row, J_col]`` is the block in row block
``I`` and column block ``J``.

=============  ===================================  ===============================
name           global ``[m, n]`` split              rank ``(i, j, k)`` holds
=============  ===================================  ===============================
``"2d"``       q x q blocks                         block ``(i, j)``; same for all k
``"2.5d"``     rows in d*q blocks, cols in q        block ``(k*q + i, j)``
``"3d-a"``     rows in q*q blocks, cols in q        block ``(i*q + j, k)`` (3D A [m, k])
``"3d-b"``     rows in q*q blocks, cols in q        block ``(k*q + i, j)`` (3D B [k, n])
``"3d-c"``     rows in q*q blocks, cols in q        block ``(i*q + (k+1) % q, j)`` (3D C)
``"3d-bt"``    rows in q*q blocks, cols in q        block ``(j*q + i, k)`` (3D B [n, k])
``"3d-at"``    rows in q*q blocks, cols in q        block ``(k*q + j, i)`` (3D A [k, m])
``"row"``      rows (axis 0) in p blocks            block ``r`` of the 1D group
``"col"``      columns (last axis) in p blocks      block ``r`` of the 1D group
``"replicated"``  none                              the whole array
=============  ===================================  ===============================

The functions :func:`block_counts`, :func:`block_index`, :func:`local_shape` and
:func:`block_slices` are pure (no MPI) and take the grid's numbers explicitly.
:func:`split` and :func:`join` take a :class:`~summasim.grid.Grid` or
:class:`~summasim.grid.Grid1D`; ``split`` does not communicate, ``join``
all-gathers. For a :class:`~summasim.grid.Grid`, ``"row"``/``"col"`` split over
all ``p`` ranks in grid-rank order.

Dimensions must divide evenly; when one does not, a ``ValueError`` names the
dimension, its size and the divisor.
"""

from __future__ import annotations

from typing import NamedTuple

from .backends import array_module

_CUBE_LAYOUTS = ("3d-a", "3d-b", "3d-c", "3d-bt", "3d-at")
LAYOUTS = ("2d", "2.5d") + _CUBE_LAYOUTS + ("row", "col", "replicated")
#: the layouts of 2-D arrays on a [q, q, d] Grid
GRID_LAYOUTS = ("2d", "2.5d") + _CUBE_LAYOUTS


class GridNumbers(NamedTuple):
    """What the block math needs to know about a grid and a rank."""

    q: int = 1
    d: int = 1
    p: int = 1
    i: int = 0
    j: int = 0
    k: int = 0
    r: int = 0  # rank in the 1D group ("row"/"col")


def _check_name(name: str) -> None:
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")


def block_counts(name: str, q: int = 1, d: int = 1, p: int = 1) -> tuple[int, int]:
    """Number of ``(row, column)`` blocks a 2-D array is cut into by layout ``name``."""
    _check_name(name)
    if name in _CUBE_LAYOUTS:
        return (q * q, q)
    return {"2d": (q, q), "2.5d": (d * q, q), "row": (p, 1), "col": (1, p),
            "replicated": (1, 1)}[name]


def block_index(name: str, g: GridNumbers) -> tuple[int, int]:
    """``(row block, column block)`` held by the rank described by ``g``."""
    _check_name(name)
    return {"2d": (g.i, g.j), "2.5d": (g.k * g.q + g.i, g.j),
            "3d-a": (g.i * g.q + g.j, g.k), "3d-b": (g.k * g.q + g.i, g.j),
            "3d-c": (g.i * g.q + (g.k + 1) % g.q, g.j), "3d-bt": (g.j * g.q + g.i, g.k),
            "3d-at": (g.k * g.q + g.j, g.i), "row": (g.r, 0),
            "col": (0, g.r), "replicated": (0, 0)}[name]


def check_divisible(what: str, size: int, divisor: int, why: str = "") -> int:
    """Return ``size // divisor``; raise ``ValueError`` naming ``what`` if it does not divide."""
    if divisor < 1 or size % divisor:
        extra = f" ({why})" if why else ""
        raise ValueError(f"{what} = {size} is not divisible by {divisor}{extra}")
    return size // divisor


def _divisor_names(name: str) -> tuple[str, str]:
    if name in _CUBE_LAYOUTS:
        return ("q*q", "q")
    return {"2d": ("q", "q"), "2.5d": ("d*q", "q"), "row": ("p", ""), "col": ("", "p"),
            "replicated": ("", "")}[name]


def local_shape(global_shape, name: str, q: int = 1, d: int = 1, p: int = 1,
                dims: tuple[str, ...] | None = None) -> tuple[int, ...]:
    """Shape of one block of an array of ``global_shape`` under layout ``name``.

    ``"2d"`` and ``"2.5d"`` need 2-D arrays; ``"row"`` splits axis 0 and ``"col"``
    the last axis of an array of any rank. ``dims`` names the axes in errors
    (default ``("rows", "columns")`` for matrices, ``"axis N"`` otherwise).
    """
    _check_name(name)
    shape = tuple(int(s) for s in global_shape)
    if name == "replicated":
        return shape
    if name in GRID_LAYOUTS and len(shape) != 2:
        raise ValueError(f"layout {name!r} needs a 2-D array, got shape {shape}")
    if not shape:
        raise ValueError(f"layout {name!r} needs at least one dimension")
    labels = dims or (("rows", "columns") if len(shape) == 2 else
                      tuple(f"axis {a}" for a in range(len(shape))))
    nr, nc = block_counts(name, q, d, p)
    rname, cname = _divisor_names(name)
    out = list(shape)
    if name != "col":
        out[0] = check_divisible(labels[0], shape[0], nr,
                                 f"layout {name!r} splits them into {rname} = {nr} blocks")
    if name != "row":
        out[-1] = check_divisible(labels[-1], shape[-1], nc,
                                  f"layout {name!r} splits them into {cname} = {nc} blocks")
    return tuple(out)


def block_slices(global_shape, name: str, g: GridNumbers) -> tuple[slice, ...]:
    """Index of the rank's block in the global array (one slice per axis)."""
    loc = local_shape(global_shape, name, g.q, g.d, g.p)
    sl = [slice(None)] * len(loc)
    if name == "replicated":
        return tuple(sl)
    bi, bj = block_index(name, g)
    if name != "col":
        sl[0] = slice(bi * loc[0], (bi + 1) * loc[0])
    if name != "row":
        sl[-1] = slice(bj * loc[-1], (bj + 1) * loc[-1])
    return tuple(sl)


def grid_numbers(grid) -> GridNumbers:
    """The :class:`GridNumbers` of a Grid or Grid1D for this rank."""
    if hasattr(grid, "q"):
        return GridNumbers(q=grid.q, d=grid.d, p=grid.p, i=grid.i, j=grid.j, k=grid.k,
                           r=grid.world.rank)
    return GridNumbers(p=grid.p, r=grid.rank)


def _check_layout_for(grid, name: str) -> None:
    _check_name(name)
    if name in GRID_LAYOUTS and not hasattr(grid, "q"):
        raise ValueError(f"layout {name!r} needs a Grid, not a {type(grid).__name__}")


def split(M, grid, name: str):
    """This rank's block (a C-contiguous copy) of the global array ``M``.

    Every rank passes the same global ``M``; no communication happens.

    Raises
    ------
    ValueError
        When a dimension does not divide (message names it, its size and the divisor).
    """
    _check_layout_for(grid, name)
    xp = array_module(M)
    sl = block_slices(M.shape, name, grid_numbers(grid))
    return xp.array(M[sl], copy=True, order="C")   # a copy even when the block is contiguous


def join(block, grid, name: str):
    """The global array, on every rank, from each rank's ``block`` (a collective).

    The gather runs over ``grid.layer`` for ``"2d"`` (layers hold the same blocks)
    and over all ranks otherwise; it is traced under the phase ``"layout.join"``.
    """
    _check_layout_for(grid, name)
    xp = array_module(block)
    if name == "replicated":
        return block.copy()
    block = xp.ascontiguousarray(block)
    comm = grid.layer if name == "2d" else grid.world
    parts = xp.empty((comm.size,) + block.shape, dtype=block.dtype)
    with comm.trace.phase("layout.join"):
        comm.allgather(block, parts)
    # explicit lengths, not -1: a reshape cannot infer one next to a zero-length axis
    if name == "row":
        return parts.reshape((comm.size * block.shape[0],) + block.shape[1:])
    if name == "col":
        width = comm.size * block.shape[-1]
        return xp.moveaxis(parts, 0, -2).reshape(block.shape[:-1] + (width,)).copy() \
            if block.ndim > 1 else parts.reshape(width)
    mb, nb = block.shape
    nr, nc = block_counts(name, grid.q, grid.d, grid.p)
    if name in ("2d", "2.5d"):
        # ranks are numbered row-major over (k, i, j), so (k, i) flattens to k*q + i
        return parts.reshape(nr, nc, mb, nb).transpose(0, 2, 1, 3).reshape(nr * mb, nc * nb)
    from .spec import grid_coords

    out = xp.empty((nr * mb, nc * nb), dtype=block.dtype)
    for rank in range(comm.size):       # each rank's block where its layout puts it
        i, j, k = grid_coords(rank, grid.q)
        bi, bj = block_index(name, GridNumbers(q=grid.q, d=grid.d, p=grid.p, i=i, j=j, k=k))
        out[bi * mb:(bi + 1) * mb, bj * nb:(bj + 1) * nb] = parts[rank]
    return out
