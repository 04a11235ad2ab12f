"""Process grids: the ONLY place that maps ranks to coordinates.

A :class:`Grid` arranges ``p = d * q * q`` ranks as ``[d, q, q]`` (or, rectangular,
``p = d * pr * pc`` as ``[d, pr, pc]``) with
coordinates ``(k, i, j)``: ``k`` is the depth (layer), ``i`` the row, ``j`` the
column. It is built with ``Create_cart([d, pr, pc], periods=[False, True, True])``
(rows and columns are periodic so Cannon can shift) and split with ``Sub`` into

``grid.row``    fixed (k, i), ranks ordered by j   -- rank in row   == j
``grid.col``    fixed (k, j), ranks ordered by i   -- rank in col   == i
``grid.depth``  fixed (i, j), ranks ordered by k   -- rank in depth == k
``grid.layer``  fixed k: the pr x pc plane, rank == i * pc + j
``grid.world``  all ranks of the grid

so a SUMMA step l is ``grid.row.bcast(buf, root=l)``: no global rank arithmetic.
All of them are :class:`summasim.comm.Comm` objects sharing one ``grid.trace``.

A :class:`Grid1D` is a single group of ``p`` ranks (Megatron's tensor-parallel group).
A :class:`Mesh` is the training mesh ``[dp, pp, tensor grid]`` of data, pipeline and
tensor parallelism, built the same way.
"""

from __future__ import annotations


from .spec import grid_coords, mesh_coords, positive_int
from .trace import Trace

# mpi4py (and so MPI_Init) is imported only when a grid is built. Which grids exist and
# where each rank sits are spec's pure answers (spec.grids, spec.grid_coords,
# spec.mesh_coords); this module builds communicators on that order and checks it.


def _raw(comm):
    from mpi4py import MPI

    from .comm import Comm

    if isinstance(comm, Comm):
        return comm.mpi
    if isinstance(comm, MPI.Comm):
        if comm.Is_inter():     # true on every rank of it: each raises, nothing is sent
            raise TypeError("a grid needs an intracommunicator, got an intercommunicator: "
                            "merge it first (comm.Merge())")
        return comm
    raise TypeError(f"expected an mpi4py communicator or a summasim Comm, got "
                    f"{type(comm).__name__}")


def check_grid_size(size: int, q: int, d: int = 1, pc: int | None = None) -> None:
    """Raise ``ValueError`` unless ``size == d * q * pc`` (``pc`` default ``q``; pure, no
    communication)."""
    q = positive_int("q", q)
    d = positive_int("d", d)
    pc = q if pc is None else positive_int("pc", pc)
    if size != d * q * pc:
        if pc == q:
            raise ValueError(f"a [q, q, d] = [{q}, {q}, {d}] grid needs d*q*q = {d * q * q} "
                             f"processes, but the communicator has {size}")
        raise ValueError(f"a [pr, pc, d] = [{q}, {pc}, {d}] grid needs d*pr*pc = "
                         f"{d * q * pc} processes, but the communicator has {size}")


class _Groups:
    """What every grid shares: ``free()`` releases the communicators it created (listed
    in ``self._mpi_comms``, and first any grid nested in ``self._nested``), and it is a
    context manager that frees on exit."""

    _mpi_comms: list = []
    _nested: tuple = ()

    def free(self) -> None:
        """Release the MPI communicators (collective)."""
        from mpi4py import MPI

        for g in self._nested:
            g.free()
        for c in reversed(self._mpi_comms):
            if c != MPI.COMM_NULL:
                c.Free()
        self._mpi_comms = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Grid(_Groups):
    """A ``[q, q, d]`` (or ``[pr, pc, d]``) process grid with row, column, depth and layer
    communicators.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or Comm
        The ranks to arrange; its size must be ``d * q * q`` (``d * q * pc``).
    q : int
        Rows and columns of each layer (rows only, when ``pc`` is given).
    d : int, default 1
        Depth (number of layers); ``d == 1`` is a 2D grid.
    pc : int, keyword-only, optional
        Columns of each layer, for a rectangular ``q x pc`` grid. ``grid.pr`` and
        ``grid.pc`` are the rows and columns on every grid; ``grid.q`` is their common
        value on a square grid and ``None`` on a rectangular one (an algorithm that
        needs a square grid says so).
    trace : Trace, optional
        Shared ledger for all of the grid's communicators (new by default).
    backend : optional
        Forces how the communicators hand arrays to MPI (see :mod:`summasim.comm`).

    Raises
    ------
    ValueError
        On every rank alike, before any group is built, when the size does not fit or
        the ranks ask for different shapes (one small agreement, :func:`summasim.mpiutil.agree`).
    TypeError
        On every rank, before any communication, for an intercommunicator.

    Notes
    -----
    Creating a grid is collective over ``comm``. Call :meth:`free` (or use the grid
    as a context manager) to release the communicators.
    """

    def __init__(self, comm, q: int, d: int = 1, trace: Trace | None = None, backend=None,
                 wait: str | None = None, *, pc: int | None = None):
        from .comm import Comm

        from .mpiutil import agree, local_error

        raw = _raw(comm)
        # every rank must ask for the same grid: a rank that asks for another shape of the
        # same size would build other groups and wait in them for ever
        _, err = local_error(check_grid_size, raw.Get_size(), q, d, pc)
        agree("Grid", raw, lambda: {"grid [pr, pc, d]": (q, q if pc is None else pc, d)}, err)
        self.pr, self.d = int(q), int(d)
        self.pc = self.pr if pc is None else int(pc)
        self.q = self.pr if self.pr == self.pc else None
        self.p = self.d * self.pr * self.pc
        self.trace = trace if trace is not None else Trace()
        self.backend = backend
        self._cart = raw.Create_cart([self.d, self.pr, self.pc], periods=[False, True, True],
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
        assert (self.i, self.j, self.k) == grid_coords(self.rank, self.pr, self.pc)

    @property
    def square(self) -> bool:
        return self.pr == self.pc

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(q, q, d)`` (``(pr, pc, d)``) as the papers write it."""
        return (self.pr, self.pc, self.d)

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's ``(i, j, k)``."""
        return (self.i, self.j, self.k)

    def __repr__(self):
        size = f"q={self.q}" if self.square else f"pr={self.pr}, pc={self.pc}"
        return f"Grid({size}, d={self.d}, coords(i,j,k)={self.coords})"


class Grid1D(_Groups):
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
        self._mpi_comms = [self._dup]
        self.comm = as_comm(Comm(self._dup, name="world", trace=self.trace, backend=backend,
                                 wait=wait))
        self.world = self.comm
        self.rank = self.comm.rank
        self.p = self.comm.size

    def __repr__(self):
        return f"Grid1D(p={self.p}, rank={self.rank})"


TENSOR_KINDS = ("1d", "2d", "2.5d", "3d")


def tensor_size(kind: str, q: int = 1, d: int = 1, t: int = 1, pc: int = 0) -> int:
    """Ranks of one tensor-parallel grid (pure): ``t`` for "1d", ``d*q*q`` otherwise
    (``d*q*pc`` on a rectangular grid of q rows and ``pc`` columns; the "3d" cube has
    d = q)."""
    if kind not in TENSOR_KINDS:
        raise ValueError(f"tensor grid kind must be one of {', '.join(TENSOR_KINDS)}, "
                         f"got {kind!r}")
    if kind == "1d":
        return positive_int("t", t)
    if kind == "3d" and d != q:
        raise ValueError(f"a 3d tensor grid is a q x q x q cube, got q={q}, d={d}")
    if pc and kind == "3d":
        raise ValueError(f"a 3d tensor grid is a q x q x q cube, got {q} rows and {pc} "
                         f"columns")
    return positive_int("d", d) * positive_int("q", q) * (positive_int("pc", pc) if pc else q)


class Mesh(_Groups):
    """The training mesh ``[dp, pp, tensor grid]``: data-parallel replicas, pipeline
    stages, and inside each (replica, stage) one tensor-parallel grid.

    Built like :class:`Grid`: ``Create_cart([dp, pp, T])`` (T = ranks of one tensor
    grid, no periodic axes, ranks in row-major order: the tensor grid is innermost, so
    its ranks are neighbours, as Megatron-LM places them) and ``Sub``:

    ``mesh.dp_comm``  fixed (stage, tensor rank), ordered by replica -- rank == ``mesh.a``
    ``mesh.pp_comm``  fixed (replica, tensor rank), ordered by stage -- rank == ``mesh.s``
    ``mesh.tensor``  fixed (replica, stage): a :class:`Grid1D` ("1d") or a
                     ``Grid(q, d)`` ("2d", "2.5d"; ``Grid(q, d, pc=pc)`` rectangular;
                     "3d": ``Grid(q, q)``) over its T ranks
    ``mesh.embed``   the first and last stage of ``mesh.pp_comm`` (first rank 0, last 1), where
                     the tied embedding's gradient is summed; ``None`` on the stages in
                     between and when ``pp == 1`` (one stage holds both ends)
    ``mesh.world``   all ranks

    ``mesh.dp``, ``mesh.pp`` and ``mesh.T`` are the sizes. All communicators share
    ``mesh.trace``; their trace groups are "dp", "pp", "embed", "mesh" (the world) and
    the tensor grid's own names. Coordinates: ``mesh.a`` (replica), ``mesh.s``
    (stage), ``mesh.r`` (rank in the tensor grid), ``mesh.first``/``mesh.last``.

    Raises
    ------
    ValueError
        On every rank alike, before any group is built, when ``dp * pp * T`` is not the
        communicator's size, a dimension is not a positive integer, or the ranks ask for
        different meshes (one small agreement, :func:`summasim.mpiutil.agree`).
    """

    def __init__(self, comm, dp: int, pp: int, kind: str, q: int = 1, d: int = 1,
                 t: int = 1, trace: Trace | None = None, backend=None,
                 wait: str | None = None, pc: int = 0):
        from .comm import Comm

        from .mpiutil import agree, local_error

        raw = _raw(comm)
        size = raw.Get_size()

        def check():
            n_dp, n_pp = positive_int("dp", dp), positive_int("pp", pp)
            n_t = tensor_size(kind, q, d, t, pc)
            if size != n_dp * n_pp * n_t:
                raise ValueError(f"a mesh dp={n_dp} x pp={n_pp} x tensor={n_t} needs "
                                 f"{n_dp * n_pp * n_t} processes, but the communicator has "
                                 f"{size}")
            return n_dp, n_pp, n_t

        # every rank must ask for the same mesh: one that asks for another of the same size
        # would build other groups, and wait in them for ever or pass on wrong ones
        shape, err = local_error(check)
        agree("Mesh", raw, lambda: {"mesh (dp, pp, tensor grid)": (dp, pp, str(kind)) + (
            (t,) if kind == "1d" else (q, d, pc or q))}, err)
        self.dp, self.pp, self.T = shape
        self.kind = kind
        self.p = size
        self.trace = trace if trace is not None else Trace()
        self.backend = backend
        self._cart = raw.Create_cart([self.dp, self.pp, self.T], periods=[False] * 3,
                                     reorder=False)
        self.a, self.s, self.r = self._cart.Get_coords(self._cart.Get_rank())
        self.rank = self._cart.Get_rank()
        self.first, self.last = self.s == 0, self.s == self.pp - 1
        subs = {"dp": [True, False, False], "pp": [False, True, False],
                "tensor": [False, False, True]}
        dp_c, pp_c, t_c = (self._cart.Sub(rem) for rem in subs.values())
        from mpi4py import MPI

        ends = self.pp > 1 and (self.first or self.last)
        embed_c = pp_c.Split(0 if ends else MPI.UNDEFINED, self.s)
        self._mpi_comms = [self._cart, dp_c, pp_c, t_c, embed_c]
        make = lambda c, name: Comm(c, name=name, trace=self.trace, backend=backend,  # noqa: E731
                                    wait=wait)
        self.world = make(self._cart, "mesh")
        self.dp_comm = make(dp_c, "dp")
        self.pp_comm = make(pp_c, "pp")
        self.embed = make(embed_c, "embed") if embed_c != MPI.COMM_NULL else None
        if kind == "1d":
            self.tensor = Grid1D(t_c, trace=self.trace, backend=backend, wait=wait)
        else:
            self.tensor = Grid(t_c, q, d, trace=self.trace, backend=backend, wait=wait,
                               pc=pc or None)
        self._nested = (self.tensor,)     # freed first by free()
        assert self.dp_comm.rank == self.a and self.pp_comm.rank == self.s
        assert (self.a, self.s, self.r) == mesh_coords(self.rank, self.pp, self.T)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(dp, pp, T)``."""
        return (self.dp, self.pp, self.T)

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's ``(replica, stage, tensor rank)``."""
        return (self.a, self.s, self.r)

    def __repr__(self):
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tensor={self.kind}:{self.T}, "
                f"coords(a,s,r)={self.coords})")
