"""Block layouts: pure index math, plus split/join of global arrays.

Block notation follows the papers: ``A[I_row, J_col]`` is the block in row block
``I`` and column block ``J``.

=============  ===================================  ===============================
name           global ``[m, n]`` split              rank ``(i, j, k)`` holds
=============  ===================================  ===============================
``"2d"``       pr x pc blocks (q x q)               block ``(i, j)``; same for all k
``"2.5d"``     rows in d*pr blocks, cols in pc      block ``(k*pr + i, j)``
``"3d-a"``     rows in q*q pieces, cols in q        piece ``(i*q + j, k)`` (3D A [m, k])
``"3d-b"``     rows in q*q pieces, cols in q        piece ``(k*q + i, j)`` (3D B [k, n])
``"3d-c"``     rows in q*q pieces, cols in q        piece ``(i*q + (k+1) % q, j)`` (3D C)
``"3d-bt"``    rows in q*q pieces, cols in q        piece ``(j*q + i, k)`` (3D B [n, k])
``"3d-at"``    rows in q*q pieces, cols in q        piece ``(k*q + j, i)`` (3D A [k, m])
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

Grids are ``[pr, pc, d]``: ``pr`` rows and ``pc`` columns of ranks per layer (``pr = pc
= q`` on the square grids; :class:`GridNumbers` ``pc = 0`` means square). The cube
layouts need a square grid.

Even and uneven blocks
----------------------
A dimension of size ``n`` cut into ``b`` blocks is cut into the balanced partition:
block ``t`` spans ``[t*(n//b) + min(t, n%b), ...)`` and holds ``n//b + 1`` items when
``t < n % b``, ``n//b`` otherwise. The first ``n mod b`` blocks are one larger; no block
is more than one item larger than another (ScaLAPACK's block-cyclic layout with one
block per process is the same thing when the sizes divide). :func:`partition` gives
the offsets, :func:`block_slices` and :func:`block_shape` a rank's block, and
:func:`split`/:func:`join` work on any sizes.

The cube layouts nest the partition: row piece ``o*q + t`` is piece ``t`` of the
balanced partition over q of block ``o`` of the balanced partition over q (e.g.
``"3d-a"``: rank (i, j, k) holds piece j of ``A``'s row block ``I_i``), so the q pieces
of one block stack to that block (what the 3D algorithm's all-gathers and its
reduce-scatter need: :mod:`summasim.algorithms.deep`). With sizes that divide by q^2
it is the flat cut into q*q blocks; otherwise pieces of one block differ by at most
one row, pieces of different blocks by at most two (the largest, ``ceil(ceil(m/q)/q)
= ceil(m/q^2)`` rows, is :func:`max_block_shape`'s).

:func:`local_shape` is the even case only: a dimension that does not divide raises a
``ValueError`` naming the dimension, its size and the divisor (for callers, such as
the transformer schemes, whose blocks must all be alike). :func:`max_block_shape` is
the largest block of any sizes (what a workspace or a memory estimate needs).
"""

from __future__ import annotations

from typing import NamedTuple

from .backends import array_module
from .spec import block_range, partition  # noqa: F401  (the balanced partition)

_CUBE_LAYOUTS = ("3d-a", "3d-b", "3d-c", "3d-bt", "3d-at")
LAYOUTS = ("2d", "2.5d") + _CUBE_LAYOUTS + ("row", "col", "replicated")
#: the layouts of 2-D arrays on a [q, q, d] Grid
GRID_LAYOUTS = ("2d", "2.5d") + _CUBE_LAYOUTS


class GridNumbers(NamedTuple):
    """What the block math needs to know about a grid and a rank: ``q`` rows of ranks
    (``pr``), ``pc`` columns (0: ``q``, a square grid), depth ``d``, ``p`` ranks, the
    rank's ``(i, j, k)`` and its rank ``r`` in a 1D group."""

    q: int = 1
    d: int = 1
    p: int = 1
    i: int = 0
    j: int = 0
    k: int = 0
    r: int = 0  # rank in the 1D group ("row"/"col")
    pc: int = 0  # columns of ranks; 0: square (q)

    @property
    def cols(self) -> int:
        return self.pc or self.q


def _check_name(name: str) -> None:
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")


def block_counts(name: str, q: int = 1, d: int = 1, p: int = 1,
                 pc: int = 0) -> tuple[int, int]:
    """Number of ``(row, column)`` blocks a 2-D array is cut into by layout ``name`` on
    a ``[q, pc, d]`` grid (``pc = 0``: square, ``pc = q``)."""
    _check_name(name)
    pc = pc or q
    if name in _CUBE_LAYOUTS:
        return (q * q, q)
    return {"2d": (q, pc), "2.5d": (d * q, pc), "row": (p, 1), "col": (1, p),
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


def _divisor_names(name: str, square: bool = True) -> tuple[str, str]:
    if name in _CUBE_LAYOUTS:
        return ("q*q", "q")
    r, c = ("q", "q") if square else ("pr", "pc")
    return {"2d": (r, c), "2.5d": (f"d*{r}", c), "row": ("p", ""), "col": ("", "p"),
            "replicated": ("", "")}[name]


def _check_shape(global_shape, name: str) -> tuple[int, ...]:
    _check_name(name)
    shape = tuple(int(s) for s in global_shape)
    if name in GRID_LAYOUTS and len(shape) != 2:
        raise ValueError(f"layout {name!r} needs a 2-D array, got shape {shape}")
    if name != "replicated" and not shape:
        raise ValueError(f"layout {name!r} needs at least one dimension")
    return shape


def local_shape(global_shape, name: str, q: int = 1, d: int = 1, p: int = 1,
                dims: tuple[str, ...] | None = None, pc: int = 0) -> tuple[int, ...]:
    """Shape of one block of an array of ``global_shape`` under layout ``name``, when
    every block is alike (the sizes divide; ``ValueError`` naming the dimension
    otherwise).

    ``"2d"`` and ``"2.5d"`` need 2-D arrays; ``"row"`` splits axis 0 and ``"col"``
    the last axis of an array of any rank. ``dims`` names the axes in errors
    (default ``("rows", "columns")`` for matrices, ``"axis N"`` otherwise).
    """
    shape = _check_shape(global_shape, name)
    if name == "replicated":
        return shape
    labels = dims or (("rows", "columns") if len(shape) == 2 else
                      tuple(f"axis {a}" for a in range(len(shape))))
    nr, nc = block_counts(name, q, d, p, pc)
    rname, cname = _divisor_names(name, not pc or pc == q)
    out = list(shape)
    if name != "col":
        out[0] = check_divisible(labels[0], shape[0], nr,
                                 f"layout {name!r} splits them into {rname} = {nr} blocks")
    if name != "row":
        out[-1] = check_divisible(labels[-1], shape[-1], nc,
                                  f"layout {name!r} splits them into {cname} = {nc} blocks")
    return tuple(out)


def nested_range(size: int, q: int, outer: int, inner: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``inner`` of the balanced partition over ``q`` of block
    ``outer`` of the balanced partition of ``size`` over ``q`` (the cube layouts' rows)."""
    o0, o1 = block_range(size, q, outer)
    s0, s1 = block_range(o1 - o0, q, inner)
    return o0 + s0, o0 + s1


def block_slices(global_shape, name: str, g: GridNumbers) -> tuple[slice, ...]:
    """Index of the rank's block in the global array (one slice per axis), for any
    sizes (the balanced partition of :func:`partition`)."""
    shape = _check_shape(global_shape, name)
    if name in _CUBE_LAYOUTS and g.cols != g.q:
        raise ValueError(f"layout {name!r} needs a square grid, got {g.q} x {g.cols}")
    sl = [slice(None)] * len(shape)
    if name == "replicated":
        return tuple(sl)
    nr, nc = block_counts(name, g.q, g.d, g.p, g.pc)
    bi, bj = block_index(name, g)
    if name in _CUBE_LAYOUTS:                   # piece bi % q of block bi // q
        sl[0] = slice(*nested_range(shape[0], g.q, bi // g.q, bi % g.q))
    elif name != "col":
        sl[0] = slice(*block_range(shape[0], nr, bi))
    if name != "row":
        sl[-1] = slice(*block_range(shape[-1], nc, bj))
    return tuple(sl)


def block_shape(global_shape, name: str, g: GridNumbers) -> tuple[int, ...]:
    """Shape of the rank's block, for any sizes (:func:`block_slices`)."""
    shape = _check_shape(global_shape, name)
    return tuple(sl.indices(n)[1] - sl.indices(n)[0]
                 for sl, n in zip(block_slices(shape, name, g), shape))


def max_block_shape(global_shape, name: str, q: int = 1, d: int = 1, p: int = 1,
                    pc: int = 0) -> tuple[int, ...]:
    """The largest block of layout ``name`` (each dimension rounded up), for any sizes."""
    shape = _check_shape(global_shape, name)
    if name == "replicated":
        return shape
    nr, nc = block_counts(name, q, d, p, pc)
    out = list(shape)
    if name != "col":
        out[0] = -(-shape[0] // nr)
    if name != "row":
        out[-1] = -(-shape[-1] // nc)
    return tuple(out)


def grid_numbers(grid) -> GridNumbers:
    """The :class:`GridNumbers` of a Grid or Grid1D for this rank."""
    if hasattr(grid, "pr"):
        return GridNumbers(q=grid.pr, d=grid.d, p=grid.p, i=grid.i, j=grid.j, k=grid.k,
                           r=grid.world.rank, pc=grid.pc if grid.pc != grid.pr else 0)
    return GridNumbers(p=grid.p, r=grid.rank)


def _check_layout_for(grid, name: str) -> None:
    _check_name(name)
    if name in GRID_LAYOUTS and not hasattr(grid, "pr"):
        raise ValueError(f"layout {name!r} needs a Grid, not a {type(grid).__name__}")
    if name in _CUBE_LAYOUTS and not (grid.pr == grid.pc == grid.d):
        raise ValueError(f"layout {name!r} needs a q x q x q cube grid (Grid(comm, q, q)), "
                         f"not [{grid.pr}, {grid.pc}, {grid.d}]")


def split(M, grid, name: str):
    """This rank's block (a C-contiguous copy) of the global array ``M``.

    Every rank passes the same global ``M``; no communication happens. Any sizes: a
    dimension that does not divide is cut by the balanced partition (the module doc).

    Raises
    ------
    ValueError
        For an unknown layout, a grid layout on a ``Grid1D``, or a cube layout
        (``"3d-*"``) on a grid that is not a q x q x q cube.
    """
    _check_layout_for(grid, name)
    xp = array_module(M)
    sl = block_slices(M.shape, name, grid_numbers(grid))
    return xp.array(M[sl], copy=True, order="C")   # a copy even when the block is contiguous


def join(block, grid, name: str):
    """The global array, on every rank, from each rank's ``block`` (a collective).

    The gather runs over ``grid.layer`` for ``"2d"`` (layers hold the same blocks)
    and over all ranks otherwise; it is traced under the phase ``"layout.join"``.
    Blocks of any sizes (the balanced partition) are joined: when they differ, each is
    padded to the largest for the gather (the block shapes travel first, untraced).
    """
    _check_layout_for(grid, name)
    xp = array_module(block)
    if name == "replicated":
        return block.copy()
    block = xp.ascontiguousarray(block)
    comm = grid.layer if name == "2d" else grid.world
    shapes = [tuple(s) for s in comm.mpi.allgather(tuple(int(n) for n in block.shape))]
    if len(set(shapes)) == 1:
        return _join_alike(block, grid, name, comm, xp)
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"join: the blocks differ in rank: {sorted(set(shapes))}")
    big = tuple(max(s[a] for s in shapes) for a in range(block.ndim))
    padded = xp.zeros(big, dtype=block.dtype)
    padded[tuple(slice(0, n) for n in block.shape)] = block
    parts = xp.empty((comm.size,) + big, dtype=block.dtype)
    with comm.trace.phase("layout.join"):
        comm.allgather(padded, parts)
    nums = [_numbers_of(grid, name, r, comm.size) for r in range(comm.size)]
    index = [block_index(name, g) for g in nums]
    rows = sum({bi: s[0] for (bi, _), s in zip(index, shapes)}.values())
    cols = sum({bj: s[-1] for (_, bj), s in zip(index, shapes)}.values())
    full = ((rows,) + shapes[0][1:] if name == "row" else
            shapes[0][:-1] + (cols,) if name == "col" else (rows, cols))
    out = xp.empty(full, dtype=block.dtype)
    for r, (g, s) in enumerate(zip(nums, shapes)):
        sl = block_slices(full, name, g)
        if tuple(out[sl].shape) != s:
            raise ValueError(f"join: rank {r}'s block {s} is not its block of the balanced "
                             f"partition of {full} ({tuple(out[sl].shape)})")
        out[sl] = parts[r][tuple(slice(0, n) for n in s)]
    return out


def rank_numbers(grid, rank: int) -> GridNumbers:
    """The :class:`GridNumbers` of any ``rank`` of a Grid's world (or of a Grid1D);
    :func:`grid_numbers` is this rank's."""
    if not hasattr(grid, "pr"):
        return GridNumbers(p=grid.p, r=rank)
    from .spec import grid_coords

    i, j, k = grid_coords(rank, grid.pr, grid.pc)
    pc = grid.pc if grid.pc != grid.pr else 0
    return GridNumbers(q=grid.pr, d=grid.d, p=grid.p, i=i, j=j, k=k, r=rank, pc=pc)


def _numbers_of(grid, name: str, rank: int, size: int) -> GridNumbers:
    """The :class:`GridNumbers` of ``rank`` of the gather's communicator."""
    if name in ("row", "col"):
        return GridNumbers(p=size, r=rank)
    return rank_numbers(grid, rank)


def _join_alike(block, grid, name: str, comm, xp):
    """:func:`join` of blocks of one shape."""
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
    nr, nc = block_counts(name, grid.pr, grid.d, grid.p, grid.pc)
    if name in ("2d", "2.5d"):
        # ranks are numbered row-major over (k, i, j), so (k, i) flattens to k*pr + i
        return parts.reshape(nr, nc, mb, nb).transpose(0, 2, 1, 3).reshape(nr * mb, nc * nb)
    out = xp.empty((nr * mb, nc * nb), dtype=block.dtype)
    for rank in range(comm.size):       # each rank's block where its layout puts it
        bi, bj = block_index(name, _numbers_of(grid, name, rank, comm.size))
        out[bi * mb:(bi + 1) * mb, bj * nb:(bj + 1) * nb] = parts[rank]
    return out
