"""Argument checks shared by the algorithms, and the agreement that makes them collective.

Local checks (:func:`check_operands`, :func:`check_inner`, :func:`check_out`,
:func:`check_grid`) look at this rank's arguments only and never communicate.
Input that is bad on ONE rank only (a block one row short, a float32 block among
float64 ones, a ring vector of another length) passes them on the other ranks, which
would then wait forever in the first broadcast, or abort on a truncated message, or
print wrong blocks. So every public entry point ends its checks with
:func:`summasim.mpiutil.agree` over the raw (untraced) mpi4py communicator of the
grid's world (the ring: of its ``comm``), on a signature of the function name, the
dtype and the block shapes, which are equal on every rank for all of these
algorithms, and on each rank's local check failure. If any rank failed its checks or
the signatures differ, every rank raises the same ``ValueError``/``TypeError``
naming the ranks and what differed, before any data moves, e.g. ``summa_ab: ranks
disagree on the A block shape: rank 0 has (5, 8), ranks 1-3 have (6, 8)``. A rank
whose grid argument is not a grid at all raises on its own (it has no communicator
to agree over).

The library's own calls (summa25_atb's depth all-reduce, the transformer schemes'
products and ring all-reduces) use the ``*_unchecked`` twins: their callers checked
and agreed once (the schemes: once per ``forward``, ``shard`` or ``unshard``).

The agreement is on by default; :func:`set_agreement` ``(False)``, the ``with
agreement(False):`` block or ``SUMMASIM_AGREE=0`` in the environment (read at import)
switch it off; it is skipped on a communicator of one rank.

What the agreement costs
------------------------
One agreement is one ``Iallreduce`` (MAX) of 3 int64 (a digest of the signature, its
negation and a failure flag), waited for by the communicator's wait policy; only a
difference or a failure adds a pickled all-gather that says what. Its price is the
price of one synchronisation of all ranks. Measured on the 2-core CPU machine while
other jobs kept the load average at 6-10, MPICH 5.0.2, NumPy float64, default wait
policy ("sleep": more ranks than cores), median of 150 calls after a barrier, the
slowest rank's median:

=====================================  ===================  ==================
                                       p = 4 (2x oversub.)  p = 16 (8x)
=====================================  ===================  ==================
one agreement                          0.52-0.54 ms         2.9-3.0 ms
``summa_ab`` n = 64, agreement off     1.23-1.26 ms         7.6-8.1 ms
``summa_ab`` n = 64, agreement on      1.76-1.78 ms         9.9-10.5 ms
``summa_ab`` n = 512, agreement off    10.5-11.1 ms         23.3-25.1 ms
``summa_ab`` n = 512, agreement on     11.0-11.2 ms         25.6-27.2 ms
=====================================  ===================  ==================

So it adds 30-40 % to a 64 x 64 x 64 product, about 5 % (p = 4) and 9 % (p = 16) at
512, and one such price per transformer ``forward``. With ``SUMMASIM_WAIT=spin`` it
costs more here (1.1 ms at p = 4, 5.3 ms at p = 16: spinning ranks keep the cores from
the late ones), and a first version that all-gathered the pickled signatures (two
non-blocking collectives) cost 1.6 ms and 8.9 ms. Timing loops that call a public
function many times on the same arguments can run it once checked and then time it
under ``with agreement(False):``.
"""

from __future__ import annotations

import numpy as np

from ..backends import array_module, backend_of
from ..comm import Comm
from ..layout import block_index, block_shape, rank_numbers
from ..mpiutil import (agree, agreement, agreement_enabled, dtype_of, gather_agreed,  # noqa: F401
                       local_error, ranks_text, set_agreement, shape_of)

_FLOAT_KINDS = ("f", "c")


# --------------------------------------------------------------------------- #
# local checks (no communication)                                             #
# --------------------------------------------------------------------------- #
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
        if x.dtype.kind not in _FLOAT_KINDS or no_blas(x.dtype):
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}; expected a floating dtype"
                            f"{no_blas(x.dtype)}")
        check_native(fn, name, x)
    if a.dtype != b.dtype:
        raise TypeError(f"{fn}: mismatched dtypes a: {a.dtype} and b: {b.dtype}")
    array_module(a, b)  # raises TypeError on mixed host/device operands
    return backend_of(a)


def check_native(fn: str, name: str, x) -> None:
    """Raise ``TypeError`` unless ``x``'s items are in this machine's byte order: MPI
    moves native items only (mpi4py refuses a '>f8' buffer mid-call)."""
    if not x.dtype.isnative:
        raise TypeError(f"{fn}: {name} has dtype {x.dtype.str!r}, not in this machine's "
                        f"byte order; pass {name}.astype({name}.dtype.newbyteorder('='))")


def check_inner(fn: str, what: str, left: int, right: int):
    """Raise ``ValueError`` unless two block extents that must agree do."""
    if left != right:
        raise ValueError(f"{fn}: block shapes do not conform: {what} ({left} != {right})")


def data_address(x) -> int:
    """Address of ``x``'s first item (host or device array)."""
    iface = getattr(x, "__array_interface__", None) or x.__cuda_array_interface__
    return int(iface["data"][0])


def same_memory(x, y) -> bool:
    """True when ``x`` and ``y`` view exactly the same items the same way."""
    return (x is y or (tuple(x.shape) == tuple(y.shape) and x.strides == y.strides
                       and x.dtype == y.dtype and data_address(x) == data_address(y)))


def check_writable_apart(fn: str, out, inputs: tuple, names: tuple, allow_same=False,
                         what: str = "out") -> None:
    """Raise ``ValueError`` when ``out`` (called ``what``) is read-only or overlaps one of
    ``inputs`` (bounds-based, :func:`numpy.may_share_memory`); with ``allow_same`` an
    ``out`` that views exactly an input's items (an in-place call) passes."""
    if not getattr(out.flags, "writeable", True):
        raise ValueError(f"{fn}: {what} is read-only")
    xp = array_module(out)
    for x, name in zip(inputs, names):
        if xp.may_share_memory(out, x) and not (allow_same and same_memory(out, x)):
            raise ValueError(f"{fn}: {what} overlaps {name}; it would be overwritten "
                             f"while it is still read (pass a separate buffer)")


def check_out(fn: str, out, shape: tuple, like, inputs: tuple = (), names: tuple = ()) -> None:
    """Raise unless ``out`` is None or a C-contiguous, writable array of ``shape`` and
    ``like``'s dtype that shares no memory with ``inputs`` (named ``names``)."""
    if out is None:
        return
    if not hasattr(out, "dtype") or not hasattr(out, "shape"):
        raise TypeError(f"{fn}: out must be an array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}: out has shape {tuple(out.shape)}, the result block is "
                         f"{tuple(shape)}")
    if out.dtype != like.dtype:
        raise TypeError(f"{fn}: out has dtype {out.dtype}, the operands {like.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{fn}: out must be C-contiguous")
    array_module(out, like)  # raises TypeError on mixed host/device arrays
    check_writable_apart(fn, out, inputs, names)


def no_blas(dtype) -> str:
    """What to do with an ``ml_dtypes`` type (bfloat16, the float8 and int4 kinds: no BLAS
    and no MPI type, whatever kind NumPy gives it), as the tail of a dtype error; "" for
    any other dtype."""
    if str(getattr(getattr(dtype, "type", None), "__module__", "")).startswith("ml_dtypes"):
        return (f" ({dtype} from ml_dtypes has no BLAS or MPI type: hold the blocks as "
                f"float32, as the mixed-precision training does between its 16-bit casts)")
    return ""


def contiguous(x):
    """``x`` if C-contiguous, else a contiguous copy (MPI needs contiguous buffers)."""
    return x if x.flags.c_contiguous else array_module(x).ascontiguousarray(x)


def check_grid(grid, fn: str):
    """Raise ``TypeError`` unless ``grid`` looks like a :class:`summasim.grid.Grid`."""
    if not all(hasattr(grid, f) for f in ("q", "d", "row", "col", "depth", "world")):
        raise TypeError(f"{fn}: grid must be a summasim.grid.Grid, got {type(grid).__name__}")


def is_comm(c) -> bool:
    """True for a summasim :class:`~summasim.comm.Comm`."""
    return isinstance(c, Comm)


# --------------------------------------------------------------------------- #
# the products' entry check                                                   #
# --------------------------------------------------------------------------- #
# form: (contracted axes of (a, b), axes of (a, b) that make the result block)
_FORMS = {"ab": ((1, 0), (0, 1)), "abt": ((1, 1), (0, 0)), "atb": ((0, 0), (1, 1))}


def check_product(fn: str, form: str, a, b, grid, out, k_block: str, extra=None,
                  inner_scale: int = 1, out_shape=None):
    """The checked entry of a distributed product: local checks, then :func:`agree`.

    ``form`` is "ab", "abt" or "atb"; ``k_block`` names the contracted block extent in
    messages ("k/q", "k/(dq)"); ``extra()`` is one more local check (Cannon's d == 1).
    ``inner_scale``: the contracted extent of a is that many times b's (the 3D
    algorithm's blocks: A (m/q^2, k/q), B (k/q^2, n/q)); ``out_shape()``: the result
    block's shape when it is not ``(a.shape[r], b.shape[r])`` (called after the operand
    checks).
    Returns the backend to compute with. Raises on every rank alike (see :func:`agree`).
    """
    check_grid(grid, fn)           # no grid, no communicator to agree over: raise alone
    (ia, ib), (ra, rb) = _FORMS[form]

    def local():
        be = check_operands(a, b, fn)
        if grid.pr != grid.pc:
            raise ValueError(f"{fn} needs a square grid ([q, q, d]), got [pr, pc, d] = "
                             f"[{grid.pr}, {grid.pc}, {grid.d}]")
        if extra is not None:
            extra()
        scale = f"{inner_scale} x " if inner_scale != 1 else ""
        check_inner(fn, f"a.shape[{ia}] ({k_block}) vs {scale}b.shape[{ib}]",
                    a.shape[ia], inner_scale * b.shape[ib])
        shape = out_shape() if out_shape is not None else (a.shape[ra], b.shape[rb])
        check_out(fn, out, shape, a, (a, b), ("a", "b"))
        return be

    be, err = local_error(local)
    agree(fn, grid, lambda: {"grid [pr, pc, d]": grid.shape, "dtype": dtype_of(a),
                             "A block shape": shape_of(a), "B block shape": shape_of(b)}, err)
    return be


# --------------------------------------------------------------------------- #
# the balanced-block entry check: any sizes, any [pr, pc, d] grid             #
# --------------------------------------------------------------------------- #
# the global dimension names of the stored A and B, per form
_NAMES = {"ab": (("m", "k"), ("k", "n")), "abt": (("m", "k"), ("n", "k")),
          "atb": (("k", "m"), ("k", "n"))}


def _stored(form: str, sizes: dict) -> tuple:
    (ra, ca), (rb, cb) = _NAMES[form]
    return (sizes[ra], sizes[ca]), (sizes[rb], sizes[cb])


def _two(x) -> tuple[int, int]:
    """A 2-D array's shape, or (-1, -1) for anything else (it failed its local check)."""
    shape = getattr(x, "shape", None)
    return tuple(int(v) for v in shape) if shape is not None and len(shape) == 2 else (-1, -1)


def _sum_blocks(fn: str, what: str, axis_name: str, grid, layout: str, every, col: int,
                axis: int) -> int:
    """The global extent of one axis of an operand: the sum of its distinct blocks'
    extents along it; ``ValueError`` when ranks holding the same block disagree."""
    seen: dict = {}
    for r in range(len(every)):
        bi = block_index(layout, rank_numbers(grid, r))[axis]
        seen.setdefault(bi, {}).setdefault(int(every[r, col]), []).append(r)
    for bi, sizes in seen.items():
        if len(sizes) > 1:
            held = ", ".join(f"{ranks_text(rs)} {'has' if len(rs) == 1 else 'have'} {v}"
                             for v, rs in sizes.items())
            raise ValueError(f"{fn}: ranks disagree on the {what} block's "
                             f"{'rows' if axis == 0 else 'columns'} ({axis_name}): {held}")
    return sum(next(iter(sizes)) for sizes in seen.values())


def block_sizes(fn: str, form: str, grid, layouts, every) -> dict:
    """``{"m": m, "k": k, "n": n}`` from every rank's ``(A rows, A cols, B rows, B cols)``
    (the first four columns of ``every``), checked: the blocks of one operand conform
    across ranks, A and B agree on their shared size, and every block is the rank's
    block of the balanced partition. Pure and the same on every rank, so each raises
    the same ``ValueError``."""
    (ra, ca), (rb, cb) = _NAMES[form]
    lay_a, lay_b, _ = layouts
    ext = [_sum_blocks(fn, what, name, grid, lay, every, col, axis)
           for name, what, lay, col, axis in ((ra, "A", lay_a, 0, 0), (ca, "A", lay_a, 1, 1),
                                              (rb, "B", lay_b, 2, 0), (cb, "B", lay_b, 3, 1))]
    for r in range(len(every)):
        g = rank_numbers(grid, r)
        for what, shape, lay, cols in (("A", ext[:2], lay_a, (0, 1)),
                                       ("B", ext[2:], lay_b, (2, 3))):
            want = block_shape(shape, lay, g)
            have = (int(every[r, cols[0]]), int(every[r, cols[1]]))
            if have != want:
                raise ValueError(
                    f"{fn}: the {what} blocks are not the balanced partition of {what} "
                    f"{list(shape)}: rank {r} has {have}, its block is {want} (the first "
                    f"size mod blocks blocks are one larger)")
    sizes = {}
    for name, size, what in zip((ra, ca, rb, cb), ext, "AABB"):
        if name in sizes and sizes[name] != size:
            raise ValueError(f"{fn}: block shapes do not conform: A's blocks add up to "
                             f"{name} = {sizes[name]}, B's to {name} = {size}")
        sizes[name] = size
    return sizes


def global_sizes(fn: str, sizes) -> tuple[int, int, int]:
    """``sizes`` as ``(m, k, n)``: three integers (Python or NumPy), none negative;
    ``ValueError`` naming ``fn`` otherwise (a float, a string, a bool, another count)."""
    if isinstance(sizes, np.ndarray) and sizes.ndim == 1 and sizes.dtype.kind in "iu":
        sizes = sizes.tolist()                          # np.array([m, k, n])
    vals = tuple(sizes) if isinstance(sizes, (tuple, list)) else None
    if (vals is None or len(vals) != 3
            or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                   or v < 0 for v in vals)):
        raise ValueError(f"{fn}: sizes must be three non-negative integers (m, k, n), "
                         f"got {sizes!r}")
    return tuple(int(v) for v in vals)


def check_blocks(fn: str, form: str, a, b, grid, out, layouts, sizes=None, extra=None,
                 inner: bool = True):
    """The checked entry of a product whose blocks may be uneven (any sizes, the
    balanced partition of :mod:`summasim.layout`) on any ``[pr, pc, d]`` grid.

    ``layouts`` are the A, B and C layouts; ``sizes`` the global ``(m, k, n)`` when the
    caller knows them (every rank checks its own blocks against them, then the ranks
    agree: one small collective), else one small all-gather of the block shapes
    derives them (:func:`summasim.mpiutil.gather_agreed`; it runs even with the
    agreement off, since the algorithm needs the sizes). Returns ``(backend, sizes)``
    with ``sizes = {"m":, "k":, "n":}``; raises the same error on every rank.
    ``inner=False`` skips the local test that abt's and atb's blocks agree on the
    contracted extent (the cube layouts cut it into different pieces of one block:
    mm3d_atb's A and B rows); the global sizes are still checked to conform.
    """
    check_grid(grid, fn)           # no grid, no communicator to agree over: raise alone
    g = rank_numbers(grid, grid.world.rank)
    lay_c = layouts[2]
    given, bad_sizes = None, None
    if sizes is not None:
        try:
            m, k, n = global_sizes(fn, sizes)
            given = {"m": m, "k": k, "n": n}
        except ValueError as e:    # raised in local(): every rank learns of it
            bad_sizes = e

    def local():
        if bad_sizes is not None:
            raise bad_sizes
        be = check_operands(a, b, fn)
        if extra is not None:
            extra()
        if form != "ab" and inner:   # abt and atb contract an axis both cut alike
            (ia, ib), _ = _FORMS[form]
            check_inner(fn, f"a.shape[{ia}] vs b.shape[{ib}]", a.shape[ia], b.shape[ib])
        if given is not None:
            sa, sb = _stored(form, given)
            for what, x, shape, lay in (("a", a, sa, layouts[0]), ("b", b, sb, layouts[1])):
                want = block_shape(shape, lay, g)
                if tuple(x.shape) != want:
                    raise ValueError(f"{fn}: {what} has shape {tuple(x.shape)}; this rank's "
                                     f"block of {list(shape)} is {want}")
            check_out(fn, out, block_shape((m, n), lay_c, g), a, (a, b), ("a", "b"))
        elif out is not None:
            check_out(fn, out, tuple(out.shape) if hasattr(out, "shape") else (), a,
                      (a, b), ("a", "b"))
        return be

    be, err = local_error(local)
    # one collective of one length whether or not sizes were given, so that ranks that
    # differ in it disagree (on the "sizes" key) instead of waiting in different ones
    signature = lambda: {"grid [pr, pc, d]": grid.shape, "dtype": dtype_of(a),  # noqa: E731
                         "sizes (m, k, n)": (tuple(given.values()) if given else
                                             "none" if sizes is None else "invalid")}
    if sizes is not None and not agreement_enabled():
        if err is not None:
            raise err
        return be, given
    every = gather_agreed(fn, grid, signature, _two(a) + _two(b) + _two(out), err)
    if given is not None:
        return be, given
    found = block_sizes(fn, form, grid, layouts, every)
    # every rank checks every rank's out (those without one too): the same verdict on all
    for r in range(len(every)):
        want = block_shape((found["m"], found["n"]), lay_c, rank_numbers(grid, r))
        have = (int(every[r, 4]), int(every[r, 5]))
        if have != want and have != (-1, -1):
            raise ValueError(f"{fn}: out has shape {have} on rank {r}, the result "
                             f"block is {want}")
    return be, found
