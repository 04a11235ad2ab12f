"""Comm: a traced wrapper over an mpi4py communicator that moves any backend's arrays.

Every call appends an :class:`summasim.trace.Event` to the communicator's
:class:`~summasim.trace.Trace`. Buffers are handed to MPI with the uppercase
(buffer) methods; arrays must be C-contiguous.

Device arrays
-------------
How an array reaches MPI depends on the backend's ``comm_mode``:

``"host"``    NumPy arrays go to MPI as they are.
``"direct"``  the producing stream is synchronized, then the device array itself is
              handed to a CUDA-aware MPI (mpi4py reads ``__cuda_array_interface__``).
``"staged"``  the stream is synchronized, the array is copied into a reusable pinned
              host buffer (one device-to-host copy per outgoing buffer), MPI works on
              the host buffer, and received data is copied back (one host-to-device
              copy per incoming buffer). Staging buffers stay alive until the request
              that uses them completes, then return to the backend's pool.

Waiting
-------
Under oversubscription (more ranks on a node than cores) a rank that spins inside
MPI steals the core from a rank that computes. ``Comm`` therefore completes its
requests with a wait policy: ``"spin"`` (``MPI_Wait``), or ``"sleep"`` (``MPI_Test``
then a short sleep, which gives the core away). The default is ``"spin"`` when the
node has at least as many cores as ranks and ``"sleep"`` otherwise; the environment
variable ``SUMMASIM_WAIT=spin|sleep|yield`` overrides it (``"yield"``: ``MPI_Test`` then
``sched_yield``).
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

from .backends import backend_of
from .trace import Trace

_SLEEP_S = 20e-6
WAIT_POLICIES = ("spin", "sleep", "yield")


def local_ranks() -> int:
    """Ranks on this node according to the launcher (no communication)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE"):
        val = os.environ.get(var, "")
        if val.isdigit():
            return int(val)
    return MPI.COMM_WORLD.Get_size()


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_wait_policy() -> str:
    """``SUMMASIM_WAIT`` if set, else "sleep" when oversubscribed, else "spin"."""
    env = os.environ.get("SUMMASIM_WAIT", "").strip().lower()
    if env:
        if env not in WAIT_POLICIES:
            raise ValueError(f"SUMMASIM_WAIT={env!r}: expected 'spin', 'sleep' or 'yield'")
        return env
    return "sleep" if local_ranks() > cores() else "spin"


class _Staging:
    """Pool of reusable host staging buffers for one backend."""

    def __init__(self, backend):
        self.backend = backend
        self.free: list = []

    def acquire(self, nbytes: int):
        best = None
        for idx, buf in enumerate(self.free):
            if buf.nbytes >= nbytes and (best is None or buf.nbytes < self.free[best].nbytes):
                best = idx
        if best is not None:
            return self.free.pop(best)
        return self.backend.pinned_empty(max(nbytes, 1))

    def release(self, buf) -> None:
        self.free.append(buf)


def _staging_for(backend) -> _Staging:
    pool = getattr(backend, "_summasim_staging", None)
    if pool is None:
        pool = _Staging(backend)
        backend._summasim_staging = pool
    return pool


class Request:
    """A pending traced operation; :meth:`wait` completes it and records its event."""

    def __init__(self, comm: "Comm", reqs, op, root, nbytes, seconds, phase, on_done):
        self.comm, self.reqs, self.op, self.root = comm, reqs, op, root
        self.nbytes, self.seconds, self.phase, self.on_done = nbytes, seconds, phase, on_done
        self.done = False

    def wait(self):
        """Block until the operation completes (with the Comm's wait policy)."""
        if self.done:
            return
        t0 = time.perf_counter()
        self.comm._waitall(self.reqs)
        for fn in self.on_done:
            fn()
        self.seconds += time.perf_counter() - t0
        self.done = True
        c = self.comm
        c.trace.record(self.op, c.name, c.size, self.root, self.nbytes, self.seconds,
                       phase=self.phase)


class Comm:
    """Traced communicator over an mpi4py communicator.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or Comm
        The communicator to wrap (a ``Comm`` is unwrapped, keeping its name).
    name : str
        Group name recorded in the trace ("row", "col", "depth", "layer", "world").
    trace : Trace, optional
        Ledger to append to; a new one by default. Communicators of one grid share one.
    backend : backend object, optional
        Forces how arrays reach MPI (see the module docstring); by default the
        backend of each array (CuPy arrays: the CuPy backend's mode; NumPy: host).
    wait : {"spin", "sleep"}, optional
        Wait policy; see :func:`default_wait_policy`.
    """

    def __init__(self, comm, name: str = "world", trace: Trace | None = None, backend=None,
                 wait: str | None = None):
        if isinstance(comm, Comm):
            name = name if name != "world" else comm.name
            trace = trace if trace is not None else comm.trace
            backend = backend if backend is not None else comm.backend
            wait = wait or comm.wait_policy
            comm = comm.mpi
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"expected an mpi4py communicator or a summasim Comm, got "
                            f"{type(comm).__name__}")
        self.mpi = comm
        self.name = name
        self.trace = trace if trace is not None else Trace()
        self.backend = backend
        self.wait_policy = wait or default_wait_policy()
        if self.wait_policy not in WAIT_POLICIES:
            raise ValueError(f"wait policy must be one of {', '.join(WAIT_POLICIES)}, "
                             f"got {self.wait_policy!r}")
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def __repr__(self):
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size})"

    # -- buffers -------------------------------------------------------------
    def _backend(self, arr):
        return self.backend if self.backend is not None else backend_of(arr)

    @staticmethod
    def _check(arr, what):
        if not getattr(arr, "flags", None) or not arr.flags.c_contiguous:
            raise ValueError(f"{what}: MPI buffers must be C-contiguous arrays")

    def _outgoing(self, arr, cleanup):
        """MPI-ready view of an array whose contents are sent."""
        be = self._backend(arr)
        mode = be.comm_mode
        if mode == "host":
            return arr
        be.synchronize()  # the producing stream must be done before MPI reads the buffer
        if mode == "direct":
            return arr
        pool = _staging_for(be)
        raw = pool.acquire(arr.nbytes)
        host = raw[: arr.nbytes].view(arr.dtype).reshape(arr.shape)
        be.copy_to_host(arr, host)
        cleanup.append(lambda: pool.release(raw))
        return host

    def _incoming(self, arr, cleanup, send_view=None):
        """MPI-ready view of an array that receives data (copied back on completion).

        ``send_view``: the staged view of the same array when it is also sent
        (in-place operations), so it is staged once.
        """
        be = self._backend(arr)
        mode = be.comm_mode
        if mode == "host":
            return arr
        if send_view is None:
            be.synchronize()
        if mode == "direct":
            return arr
        if send_view is not None:
            host = send_view
        else:
            pool = _staging_for(be)
            raw = pool.acquire(arr.nbytes)
            host = raw[: arr.nbytes].view(arr.dtype).reshape(arr.shape)
            cleanup.append(lambda: pool.release(raw))
        # copy back before the staging buffer returns to the pool
        cleanup.insert(0, lambda: be.copy_from_host(host, arr))
        return host

    # -- completion ----------------------------------------------------------
    def _waitall(self, reqs):
        if self.wait_policy == "spin":
            MPI.Request.Waitall(reqs)
            return
        if self.wait_policy == "yield":
            while not MPI.Request.Testall(reqs):
                os.sched_yield()
            return
        while not MPI.Request.Testall(reqs):
            time.sleep(_SLEEP_S)

    def _start(self, op, root, nbytes, post, cleanup) -> Request:
        phase = self.trace.current_phase
        t0 = time.perf_counter()
        reqs = post()
        return Request(self, reqs, op, root, nbytes, time.perf_counter() - t0, phase, cleanup)

    # -- collectives ---------------------------------------------------------
    def ibcast(self, buf, root: int = 0) -> Request:
        """Non-blocking broadcast of ``buf`` (in place) from group rank ``root``."""
        self._check(buf, "bcast")
        cleanup: list = []
        if self.rank == root:
            view = self._outgoing(buf, cleanup)
        else:
            view = self._incoming(buf, cleanup)
        return self._start("bcast", root, buf.nbytes,
                           lambda: [self.mpi.Ibcast(view, root=root)], cleanup)

    def bcast(self, buf, root: int = 0):
        """Broadcast ``buf`` in place from group rank ``root``; returns ``buf``."""
        self.ibcast(buf, root).wait()
        return buf

    def ireduce(self, sendbuf, recvbuf, root: int = 0) -> Request:
        """Non-blocking sum-reduce of ``sendbuf`` into ``recvbuf`` on ``root``.

        ``recvbuf`` is only used on the root (pass ``None`` elsewhere).
        """
        self._check(sendbuf, "reduce")
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = None
        if self.rank == root:
            if recvbuf is None or recvbuf.shape != sendbuf.shape or recvbuf.dtype != sendbuf.dtype:
                raise ValueError("reduce: the root needs a recvbuf shaped like sendbuf")
            self._check(recvbuf, "reduce")
            rview = self._incoming(recvbuf, cleanup)
        return self._start("reduce", root, sendbuf.nbytes,
                           lambda: [self.mpi.Ireduce(sview, rview, op=MPI.SUM, root=root)],
                           cleanup)

    def reduce(self, sendbuf, recvbuf, root: int = 0):
        """Sum-reduce ``sendbuf`` into ``recvbuf`` on ``root``; returns ``recvbuf``."""
        self.ireduce(sendbuf, recvbuf, root).wait()
        return recvbuf

    _OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def allreduce(self, buf, out=None, op: str = "sum"):
        """MPI's own all-reduce (``op`` "sum", "max" or "min"), in place on ``buf``
        unless ``out`` is given; returns the result array."""
        self._check(buf, "allreduce")
        if op not in self._OPS:
            raise ValueError(f"allreduce: op must be one of {', '.join(self._OPS)}, got {op!r}")
        mop = self._OPS[op]
        cleanup: list = []
        if out is None:
            view = self._incoming(buf, cleanup, send_view=self._outgoing(buf, cleanup))
            post = lambda: [self.mpi.Iallreduce(MPI.IN_PLACE, view, op=mop)]  # noqa: E731
            result = buf
        else:
            sview = self._outgoing(buf, cleanup)
            rview = self._incoming(out, cleanup)
            post = lambda: [self.mpi.Iallreduce(sview, rview, op=mop)]  # noqa: E731
            result = out
        self._start("allreduce", -1, buf.nbytes, post, cleanup).wait()
        return result

    def allgather(self, sendbuf, recvbuf):
        """Gather ``sendbuf`` from every rank into ``recvbuf`` (leading axis = rank)."""
        self._check(sendbuf, "allgather")
        self._check(recvbuf, "allgather")
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError(f"allgather: recvbuf needs {self.size} x {sendbuf.size} items "
                             f"of {sendbuf.dtype}")
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = self._incoming(recvbuf, cleanup)
        self._start("allgather", -1, sendbuf.nbytes,
                    lambda: [self.mpi.Iallgather(sview, rview)], cleanup).wait()
        return recvbuf

    def isendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> Request:
        """Non-blocking send of ``sendbuf`` to ``dest`` and receive into ``recvbuf``
        from ``source`` (group ranks). ``sendbuf`` and ``recvbuf`` must not overlap."""
        self._check(sendbuf, "sendrecv")
        self._check(recvbuf, "sendrecv")
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = self._incoming(recvbuf, cleanup)

        def post():
            return [self.mpi.Irecv(rview, source=source, tag=tag),
                    self.mpi.Isend(sview, dest=dest, tag=tag)]

        return self._start("sendrecv", -1, sendbuf.nbytes, post, cleanup)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Blocking :meth:`isendrecv`; returns ``recvbuf``."""
        self.isendrecv(sendbuf, dest, recvbuf, source, tag).wait()
        return recvbuf

    def shift_ranks(self, disp: int) -> tuple[int, int]:
        """``(source, dest)`` of a cyclic shift by ``disp`` along this communicator.

        Uses ``MPI_Cart_shift`` on Cartesian communicators (grid rows and columns);
        on a plain communicator the ranks are taken as a ring in rank order.
        """
        if isinstance(self.mpi, MPI.Cartcomm) and self.mpi.Get_dim() == 1:
            return self.mpi.Shift(0, disp)
        return (self.rank - disp) % self.size, (self.rank + disp) % self.size

    def ishift(self, sendbuf, recvbuf, disp: int) -> Request:
        """Non-blocking cyclic shift: ``recvbuf`` gets the ``sendbuf`` of rank ``rank - disp``."""
        source, dest = self.shift_ranks(disp)
        return self.isendrecv(sendbuf, dest, recvbuf, source)

    def barrier(self):
        """Barrier (traced with 0 bytes)."""
        self._start("barrier", -1, 0, lambda: [self.mpi.Ibarrier()], []).wait()


def as_comm(comm, name: str = "world", trace: Trace | None = None) -> Comm:
    """Wrap a plain mpi4py communicator; return a :class:`Comm` unchanged."""
    if isinstance(comm, Comm):
        return comm
    return Comm(comm, name=name, trace=trace)
