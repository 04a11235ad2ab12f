"""Process grids: the ONLY place that maps ranks to coordinates.

A :class:`Grid` arranges ``p = d * q * q`` ranks as ``[d, q, q]`` with
coordinates ``(k, i, j)``: ``k`` is the depth (layer), ``i`` the row, ``j`` the
column. It is built with ``Create_cart([d, q, q], periods=[False, True, True])``
(rows and columns are periodic so Cannon can shift) and split with ``Sub`` into

``grid.row``    fixed (k, i), ranks ordered by j   -- rank in row   == j
``grid.col``    fixed (k, j), ranks ordered by i   -- rank in col   == i
``grid.depth``  fixed (i, j), ranks ordered by k   -- rank in depth == k
``grid.layer``  fixed k: the q x q plane, rank == i * q + j
``grid.world``  all ranks of the grid

so a SUMMA step l is ``grid.row.bcast(buf, root=l)``: no global rank arithmetic.
All of them are :class:`summasim.comm.Comm` objects sharing one ``grid.trace``.

A :class:`Grid1D` is a single group of ``p`` ranks (Megatron's tensor-parallel group).
"""

from __future__ import annotations

import math
import numbers

from .trace import Trace

# mpi4py (and so MPI_Init) is imported only when a grid is built: the grid-shape
# functions below are pure and serve the cost model, which never needs MPI.

GRID_KINDS = ("2d", "2.5d", "any")


def grid_shapes(p: int, kind: str = "any") -> list[tuple[int, int]]:
    """The ``(q, d)`` grids with ``d * q * q == p`` of one kind (pure; the one
    enumeration every front-end, test and the cost model use).

    ``"any"``   every ``(q, d)``, q ascending (q = 1 included: a [1, 1, p] grid);
    ``"2d"``    ``[(q, 1)]`` when p is a perfect square, else ``[]``;
    ``"2.5d"``  every grid with ``d >= 2`` and ``q >= 2``; when none exists, the
                degenerate ``[(1, p)]`` (a depth-only grid; ``[(1, 1)]`` at p = 1).
    """
    p = _positive_int("p", p)
    if kind not in GRID_KINDS:
        raise ValueError(f"grid kind must be one of {', '.join(GRID_KINDS)}, got {kind!r}")
    every = [(q, p // (q * q)) for q in range(1, math.isqrt(p) + 1) if p % (q * q) == 0]
    if kind == "any":
        return every
    if kind == "2d":
        return [(q, d) for q, d in every if d == 1]
    deep = [(q, d) for q, d in every if d >= 2 and q >= 2]
    return deep or [(1, p)]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _raw(comm):
    from mpi4py import MPI

    from .comm import Comm

    if isinstance(comm, Comm):
        return comm.mpi
    if isinstance(comm, MPI.Comm):
        return comm
    raise TypeError(f"expected an mpi4py communicator or a summasim Comm, got "
                    f"{type(comm).__name__}")


def check_grid_size(size: int, q: int, d: int = 1) -> None:
    """Raise ``ValueError`` unless ``size == d * q * q`` (pure; no communication)."""
    q = _positive_int("q", q)
    d = _positive_int("d", d)
    if size != d * q * q:
        raise ValueError(f"a [q, q, d] = [{q}, {q}, {d}] grid needs d*q*q = {d * q * q} "
                         f"processes, but the communicator has {size}")


class Grid:
    """A ``[q, q, d]`` process grid with row, column, depth and layer communicators.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or Comm
        The ranks to arrange; its size must be ``d * q * q``.
    q : int
        Rows and columns of each layer.
    d : int, default 1
        Depth (number of layers); ``d == 1`` is a 2D grid.
    trace : Trace, optional
        Shared ledger for all of the grid's communicators (new by default).
    backend : optional
        Forces how the communicators hand arrays to MPI (see :mod:`summasim.comm`).

    Raises
    ------
    ValueError
        On every rank, before any communication, when the size does not fit.

    Notes
    -----
    Creating a grid is collective over ``comm``. Call :meth:`free` (or use the grid
    as a context manager) to release the communicators.
    """

    def __init__(self, comm, q: int, d: int = 1, trace: Trace | None = None, backend=None,
                 wait: str | None = None):
        from .comm import Comm

        raw = _raw(comm)
        check_grid_size(raw.Get_size(), q, d)
        self.q, self.d = int(q), int(d)
        self.p = self.d * self.q * self.q
        self.trace = trace if trace is not None else Trace()
        self.backend = backend
        self._cart = raw.Create_cart([self.d, self.q, self.q], periods=[False, True, True],
                                     reorder=False)
        self.k, self.i, self.j = self._cart.Get_coords(self._cart.Get_rank())
        self.rank = self._cart.Get_rank()
        subs = {
            "row": [False, False, True],
            "col": [False, True, False],
            "depth": [True, False, False],
            "layer": [False, True, True],
        }
        self._mpi_comms = [self._cart] + [self._cart.Sub(rem) for rem in subs.values()]
        make = lambda c, name: Comm(c, name=name, trace=self.trace, backend=backend,  # noqa: E731
                                    wait=wait)
        self.world = make(self._cart, "world")
        self.row, self.col, self.depth, self.layer = (
            make(c, name) for c, name in zip(self._mpi_comms[1:], subs))
        assert self.row.rank == self.j and self.col.rank == self.i and self.depth.rank == self.k

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(q, q, d)`` as the papers write it."""
        return (self.q, self.q, self.d)

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's ``(i, j, k)``."""
        return (self.i, self.j, self.k)

    def __repr__(self):
        return f"Grid(q={self.q}, d={self.d}, coords(i,j,k)={self.coords})"

    def free(self) -> None:
        """Release the grid's MPI communicators (collective)."""
        from mpi4py import MPI

        for c in reversed(self._mpi_comms):
            if c != MPI.COMM_NULL:
                c.Free()
        self._mpi_comms = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Grid1D:
    """A single group of ``p`` ranks (a 1D tensor-parallel group).

    ``grid.comm`` is the :class:`Comm` over all ranks, ``grid.rank`` this rank's
    position in it and ``grid.p`` its size. The group is a duplicate of ``comm``,
    so library traffic never mixes with the caller's.
    """

    def __init__(self, comm, trace: Trace | None = None, backend=None, wait: str | None = None):
        from .comm import Comm, as_comm

        raw = _raw(comm)
        self.trace = trace if trace is not None else Trace()
        self._dup = raw.Dup()
        self.comm = as_comm(Comm(self._dup, name="world", trace=self.trace, backend=backend,
                                 wait=wait))
        self.world = self.comm
        self.rank = self.comm.rank
        self.p = self.comm.size

    def __repr__(self):
        return f"Grid1D(p={self.p}, rank={self.rank})"

    def free(self) -> None:
        from mpi4py import MPI

        if self._dup != MPI.COMM_NULL:
            self._dup.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
