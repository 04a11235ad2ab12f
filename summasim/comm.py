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
``"ipc"``     ranks of one node: broadcasts, send-receive pairs (ring steps) and the
              tree reduce copy device to device through each sender's CUDA IPC outbox
              (:mod:`summasim.backends.ipc`), done when the call returns; the other
              operations are staged.

Reduce
------
``reduce`` and ``ireduce`` run summasim's own binomial-tree sum over point-to-point
messages, with the additions done by the array library (``reduce_algorithm="tree"``,
the default), or MPI's ``MPI_Ireduce`` (``"mpi"``; environment variable
``SUMMASIM_REDUCE=tree|mpi``). On this project's machines MPICH's reduction of
large float64 buffers ran at 0.8 GB/s, 4.5x slower than a send plus a NumPy add,
which made every reducing SUMMA form slower than ``summa_ab``. Either way the call is
one traced "reduce" event. The tree: with ``rel = (rank - root) mod P``, at step
``mask = 1, 2, 4, ...`` a rank with ``rel & mask`` sends its partial sum to
``rel - mask`` and stops; otherwise it receives from ``rel + mask`` (if it exists)
and adds. Children are received in a fixed order, so results are deterministic.

Waiting
-------
Under oversubscription (more ranks on a node than cores) a rank that spins inside
MPI steals the core from a rank that computes. ``Comm`` therefore completes its
requests with a wait policy: ``"spin"`` (``MPI_Wait``), or ``"sleep"`` (``MPI_Test``
then a short sleep, which gives the core away). The default is ``"spin"`` when the
node has at least as many cores as ranks and ``"sleep"`` otherwise; the environment
variable ``SUMMASIM_WAIT=spin|sleep|yield`` overrides it (``"yield"``: ``MPI_Test`` then
``sched_yield``); all three are :func:`summasim.mpiutil.wait_requests`.

The steps of a ring (:meth:`Comm.exchanger`) wait in one of three ways: one blocking
``MPI_Sendrecv`` ("blocking"); the receive alone polled with ``sched_yield``, the sends
completed at the end of the ring's half, so that a rank never waits for its neighbour
to take a message ("yield"); or the same with naps between polls after a few yields, so
that waiters leave the cores to the ranks that hold data ("nap"). A ring call
(:meth:`Comm.ring_exchanger`) takes the one this communicator measured fastest for
its size class (:mod:`summasim.ringwait`; ``SUMMASIM_RING_WAIT`` fixes one, or
``rule``); other exchanges take the rule: blocking under "spin", else yield, napping
for chunks from 256 KiB at 4 or more ranks per core (docs/performance.md).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .backends import backend_of, ipc, is_device_array
from .backends.cupy_backend import gpu_comm_setting, launcher_local_ranks
from .cli import env_switch
from .mpiutil import SLEEP_S, WAIT_POLICIES, agreement_enabled, install_abort_hook, wait_requests
from .ringwait import MODES as RING_MODES
from .ringwait import kept_on, ring_wait_setting, waits_of
from .trace import Trace

REDUCE_ALGORITHMS = ("tree", "mpi")
# host ring steps (Comm.exchanger) and sendrecvs of fewer bytes than this wait without sleeping
# (the receive polled with sched_yield); larger ones go through the wait policy.
# Unlimited unless SUMMASIM_BLOCKING_BYTES sets it (0: every step waits by the policy): measured
# on 2 cores at 2 to 8 ranks per core (docs/performance.md), the ring's steps are as fast or
# faster that way at every size from 10 KiB to 64 MiB.
_UNLIMITED = 1 << 62


def _env_bytes(name: str) -> int | None:
    """A byte count from the environment variable ``name`` (None when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number of bytes >= 0")
    return value


#: the byte limits read from the environment (below)
BYTE_SETTINGS = ("SUMMASIM_BLOCKING_BYTES", "SUMMASIM_NAP_BYTES", "SUMMASIM_STAGE_WHOLE_BYTES")


def _env_bytes_at_import(name: str) -> int | None:
    """:func:`_env_bytes` when this module is imported, where a bad value must not raise
    (a front-end's ``import`` would end in a traceback before it can say so): None
    (the default) for a bad value, which :func:`check_environment`, asked by every
    front-end before any work, then reports as one line, and which a :class:`Comm`
    refuses when it is made (library use, the fit and the accuracy workers)."""
    try:
        return _env_bytes(name)
    except ValueError:
        return None


_BLOCKING_ENV = _env_bytes_at_import("SUMMASIM_BLOCKING_BYTES")
BLOCKING_SENDRECV_BYTES = _UNLIMITED if _BLOCKING_ENV is None else _BLOCKING_ENV
# ring steps of at least NAP_BYTES, on a node with at least NAP_RANKS_PER_CORE ranks per core,
# poll with sched_yield NAP_AFTER_POLLS times and then nap between polls (Comm.exchanger): a long
# wait among many waiters. SUMMASIM_NAP_BYTES sets the size at any density (0: always; a huge
# value: never).
_NAP_ENV = _env_bytes_at_import("SUMMASIM_NAP_BYTES")
NAP_BYTES = 256 << 10 if _NAP_ENV is None else _NAP_ENV
NAP_RANKS_PER_CORE = 4
NAP_AFTER_POLLS = 32
# device all-reduces (and in-place reduce-scatters and all-gathers) of fewer bytes than this,
# on a staged (not CUDA-aware) MPI, are staged whole: one copy to a pinned host buffer, the
# ring on the host, one copy back, instead of a copy each way per ring step
# (Comm.staged_whole; SUMMASIM_STAGE_WHOLE_BYTES sets it, 0: never).
# Measured on an H200 shared by 4 ranks (docs/gpu.md).
_STAGE_WHOLE_ENV = _env_bytes_at_import("SUMMASIM_STAGE_WHOLE_BYTES")
STAGE_WHOLE_BYTES = 16 << 20 if _STAGE_WHOLE_ENV is None else _STAGE_WHOLE_ENV
# Each half of the ring alone pays both whole copies for half the steps, and an all-gather
# step adds nothing on the device, so the halves cross over sooner. Measured on the same
# H200 (2026-11-26, third session, scripts/ring-halves.py, two launches): in place, the
# reduce-scatter staged whole took 1.64-1.73 ms at 4 MiB against 2.38-2.42 per step, and
# 3.51-3.53 against 3.15-3.26 at 8 MiB; the all-gather 0.96-1.03 against 0.98-0.99 at
# 2 MiB and 1.50-1.54 against 1.23-1.31 at 4 MiB. Their limits: these shares of the limit.
STAGE_WHOLE_SHARES = {"allreduce": 1.0, "reduce_scatter": 0.5, "allgather": 0.125}
_NDARRAY = np.ndarray
_REDUCE_TAG = 1 << 14  # tags [2^14, 2^15) belong to tree reduces
_COUNTS_KEYVAL: list = []   # the MPI attribute key of a communicator's _Counts, made once


class _Counts:
    """What every ``Comm`` over one MPI communicator counts alike: the tree reduces
    started, whose tags tell two reduces in flight apart, even when two wrappers of the
    same communicator started them (each counting alone, both would take the same tag
    and the later wait could receive the other's partial sums)."""

    __slots__ = ("reduces",)

    def __init__(self):
        self.reduces = 0


def _counts_of(raw) -> _Counts:
    """The :class:`_Counts` of the mpi4py communicator ``raw``, kept on it as an MPI
    attribute (:func:`summasim.ringwait.kept_on`)."""
    return kept_on(raw, _COUNTS_KEYVAL, _Counts)


def _nothing() -> None:
    """``finish`` of an exchanger whose steps complete their sends themselves."""


class DropFault:
    """The ``drop`` fault's one hook, at the reduction (:mod:`summasim.harness.inject`).

    Armed on one rank by :meth:`Comm.drop_next_sum`, the next sum reduction over more
    than one rank on this process (over a group named in ``groups``, when given) leaves
    one block unreduced: this rank keeps its own contribution where the sum should be.
    :meth:`Comm.allreduce` asks for it itself; a reduction built from point-to-point
    steps asks :meth:`Comm.take_drop` and keeps its own contribution in the block it
    owns. One-shot: ``applied`` says whether a reduction took it.
    """

    __slots__ = ("armed", "applied", "groups")

    def __init__(self):
        self.armed, self.applied, self.groups = False, False, None


_DROP = DropFault()         # the process's one hook; armed only through Comm.drop_next_sum


def local_ranks() -> int:
    """Ranks on this node according to the launcher (no communication; the job's size
    when the launcher does not say)."""
    return launcher_local_ranks() or MPI.COMM_WORLD.Get_size()


def _affinity() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return set(range(os.cpu_count() or 1))


def cores() -> int:
    """Cores this process may run on (its affinity mask): what its own threads can use."""
    return len(_affinity())


_NODE: list = []     # [ranks on this node, CPUs they cover], once learn_node_cores has run


def node_cores_of(comm) -> tuple[int, int]:
    """Collective over ``comm``: ``(ranks of comm on this node, CPUs their affinity masks
    cover together)``. A launcher that binds each rank to its own core (Open MPI's
    default when the ranks fit, ``srun --cpu-bind``) leaves every rank a mask of one
    core; the node's ranks share cores only when there are more of them than the union
    of their masks."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        masks = node.allgather(sorted(_affinity()))
    finally:
        node.Free()
    return len(masks), len(set().union(*map(set, masks)))


def learn_node_cores(comm=None) -> None:
    """Collective over ``comm`` (the world by default): remember :func:`node_cores_of`
    for :func:`node_cores` and :func:`default_wait_policy`. The front-ends call it once,
    before any work."""
    _NODE[:] = node_cores_of(comm if comm is not None else MPI.COMM_WORLD)


def node_cores() -> int:
    """The CPUs this node's ranks may run on together (:func:`learn_node_cores`); before
    it has run, this process's own (:func:`cores`)."""
    return _NODE[1] if _NODE else cores()


def _node_ranks() -> int:
    return _NODE[0] if _NODE else local_ranks()


def default_reduce() -> str:
    """``SUMMASIM_REDUCE`` if set, else "tree" (see the module docstring)."""
    env = os.environ.get("SUMMASIM_REDUCE", "").strip().lower() or "tree"
    if env not in REDUCE_ALGORITHMS:
        raise ValueError(f"SUMMASIM_REDUCE={env!r}: expected one of {', '.join(REDUCE_ALGORITHMS)}")
    return env


def check_environment() -> dict:
    """Raise the ValueError of a bad ``SUMMASIM_*`` setting of this module (the byte
    limits are read when it is imported); return the settings that decide which
    messages a collective sends (the reduce's algorithm, whether a ring runs its wait
    trials, which steps block, what is staged whole, whether the entry points agree on
    their inputs), which every rank must share: a
    rank that ran the trials alone would wait for the others forever. The front-ends
    ask every rank before any work, so that a setting bad or different on one rank is
    one clear error, not an abort or a hang."""
    default_wait_policy()
    for name, default in (("SUMMASIM_AGREE", True), ("SUMMASIM_ABORT_HOOK", True),
                          ("SUMMASIM_FUSED", False)):
        env_switch(name, default)           # read leniently at import; a bad value said here
    shared = {"SUMMASIM_REDUCE": default_reduce(), "SUMMASIM_RING_WAIT": ring_wait_setting(),
              "SUMMASIM_AGREE": agreement_enabled(), "SUMMASIM_GPU_COMM": gpu_comm_setting()}
    for name in BYTE_SETTINGS:
        value = _env_bytes(name)
        if name != "SUMMASIM_NAP_BYTES":
            shared[name] = value
    return shared


def default_wait_policy() -> str:
    """``SUMMASIM_WAIT`` if set, else "sleep" when oversubscribed (more ranks on the node
    than the CPUs they may run on together, :func:`node_cores`), else "spin"."""
    env = os.environ.get("SUMMASIM_WAIT", "").strip().lower()
    if env:
        if env not in WAIT_POLICIES:
            raise ValueError(f"SUMMASIM_WAIT={env!r}: expected 'spin', 'sleep' or 'yield'")
        return env
    return "sleep" if _node_ranks() > node_cores() else "spin"


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

    def test(self) -> bool:
        """Whether the operation has completed, without waiting (completes and records
        it if so)."""
        if not self.done and MPI.Request.Testall(self.reqs):
            self.wait()
        return self.done


class _TreeReduce(Request):
    """A binomial-tree sum-reduce over point-to-point messages (see the module doc).

    Receives from children are posted at once and a leaf's send too; an inner rank
    adds and forwards its partial sum when it is waited on.
    """

    def __init__(self, comm: "Comm", sendbuf, recvbuf, root: int, tag: int):
        self.children, self.parent = ipc.tree_links(comm.rank, comm.size, root)
        phase = comm.trace.current_phase
        t0 = time.perf_counter()
        self.sendbuf, self.recvbuf, self.tag = sendbuf, recvbuf, tag
        self.tmps = [comm._scratch(sendbuf) for _ in self.children]
        self.cleanup: list = []
        reqs = [comm.mpi.Irecv(comm._incoming(t, self.cleanup), source=c, tag=tag)
                for t, c in zip(self.tmps, self.children)]
        if self.parent is not None and not self.children:  # a leaf sends right away
            reqs.append(comm.mpi.Isend(comm._outgoing(sendbuf, self.cleanup),
                                       dest=self.parent, tag=tag))
        super().__init__(comm, reqs, "reduce", root, sendbuf.nbytes,
                         time.perf_counter() - t0, phase, [])

    def wait(self):
        if self.done:
            return
        c = self.comm
        t0 = time.perf_counter()
        c._waitall(self.reqs)
        for fn in self.cleanup:
            fn()
        self.cleanup = []
        if self.children:
            # sendbuf + child_0 + child_1 + ... in this order on every rank: deterministic
            if self.parent is None:                      # the root sums into recvbuf
                acc, rest = self.recvbuf, self.tmps
                acc[...] = self.sendbuf
            else:                                        # an inner rank sums into scratch
                acc, rest = self.tmps[0], self.tmps[1:]
                acc += self.sendbuf
            for t in rest:
                acc += t
            if self.parent is not None:
                cleanup: list = []
                c._waitall([c.mpi.Isend(c._outgoing(acc, cleanup), dest=self.parent,
                                        tag=self.tag)])
                for fn in cleanup:
                    fn()
        elif self.parent is None:                        # a group of one
            self.recvbuf[...] = self.sendbuf
        for t in self.tmps:
            c._release_scratch(t)
        self.tmps = []
        self.seconds += time.perf_counter() - t0
        self.done = True
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
    wait : {"spin", "sleep", "yield"}, optional
        Wait policy; see :func:`default_wait_policy`.
    reduce : {"tree", "mpi"}, optional
        How ``reduce`` is done (see the module docstring); default ``$SUMMASIM_REDUCE``
        or "tree".
    """

    def __init__(self, comm, name: str = "world", trace: Trace | None = None, backend=None,
                 wait: str | None = None, reduce: str | None = None):
        # an uncaught exception on any rank aborts the job (SUMMASIM_ABORT_HOOK=0: off)
        install_abort_hook()
        for var in BYTE_SETTINGS:  # a bad value, taken as the default at import: said here
            _env_bytes(var)
        if isinstance(comm, Comm):
            name = name if name != "world" else comm.name
            trace = trace if trace is not None else comm.trace
            backend = backend if backend is not None else comm.backend
            wait = wait or comm.wait_policy
            reduce = reduce or comm.reduce_algorithm
            comm = comm.mpi
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"expected an mpi4py communicator or a summasim Comm, got "
                            f"{type(comm).__name__}")
        if comm.Is_inter():     # true on every rank of it: each raises, nothing is sent
            raise TypeError("expected an intracommunicator, got an intercommunicator (its "
                            "ranks address the remote group): merge it first "
                            "(comm.Merge()) or use one of its groups")
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
        self.reduce_algorithm = reduce or default_reduce()
        if self.reduce_algorithm not in REDUCE_ALGORITHMS:
            raise ValueError(f"reduce algorithm must be one of {', '.join(REDUCE_ALGORITHMS)}, "
                             f"got {self.reduce_algorithm!r}")
        self._counts = _counts_of(comm)   # tree reduces started, over every wrapper of comm
        spin = self.wait_policy == "spin"
        self.blocking_limit = _UNLIMITED if spin else BLOCKING_SENDRECV_BYTES
        crowded = _node_ranks() >= NAP_RANKS_PER_CORE * node_cores()
        self.nap_limit = (NAP_BYTES if not spin and (crowded or _NAP_ENV is not None)
                          else _UNLIMITED)
        self._scratch_free: list = []
        self._workspaces: OrderedDict = OrderedDict()
        self._exchangers: dict = {}     # kept host-loop (step, finish, pending sends), by kind
        self._twin = None
        self.stage_whole_limit = STAGE_WHOLE_BYTES
        #: how ring steps wait: "auto" (measured per size class, :mod:`summasim.ringwait`),
        #: "rule" (:meth:`_rule_mode`) or one of its modes; ``SUMMASIM_RING_WAIT`` by default
        self.ring_wait = ring_wait_setting()
        self._ring_waits = None

    def __repr__(self):
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size})"

    # -- buffers -------------------------------------------------------------
    def _backend(self, arr):
        """How ``arr`` reaches MPI: the Comm's backend, except that a host array on a
        device backend's communicator (a loss, a size, a host copy) goes as it is."""
        be = self.backend
        if be is None or (getattr(be, "on_device", False) and not is_device_array(arr)):
            return backend_of(arr)
        return be

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

    def staged_whole(self, arr, op: str = "allreduce") -> bool:
        """Whether a ring all-reduce of ``arr`` (``op`` "allreduce"), or an in-place
        "reduce_scatter" or "allgather", runs on one host copy of it: its path to MPI
        is "staged" or "ipc" (a device array on an MPI that is not CUDA-aware, or a host
        backend that stands in for one) and it has fewer bytes than
        :attr:`stage_whole_limit` times the op's share (:data:`STAGE_WHOLE_SHARES`). Per
        ring step a staged sum copies a chunk each way and waits for the stream, 4(P-1)
        copies in all, which costs more than two whole copies below that size
        (docs/gpu.md). A device-to-device ("ipc") step costs a stream wait and two small
        messages whatever its size: 1.1 ms a step with 4 ranks time-slicing one H200,
        0.22 ms under MPS, so below the same limit the host copy wins there too."""
        if self.backend is None and isinstance(arr, _NDARRAY):   # the host ring's fast path
            return False
        return (arr.nbytes < self.stage_whole_limit * STAGE_WHOLE_SHARES[op]
                and self._backend(arr).comm_mode in ("staged", "ipc"))

    def host_twin(self) -> "Comm":
        """This communicator with host arrays going to MPI as they are (same group,
        name, trace and wait policy): the ring on a staged host copy runs on it."""
        twin = self._twin
        if twin is None:
            from .backends import get_backend

            twin = self._twin = Comm(self.mpi, name=self.name, trace=self.trace,
                                     backend=get_backend("numpy"), wait=self.wait_policy,
                                     reduce=self.reduce_algorithm)
        # the waits as set on this communicator now (a caller may have changed them)
        twin.wait_policy, twin.blocking_limit = self.wait_policy, self.blocking_limit
        twin.nap_limit = self.nap_limit
        return twin

    def stage_in(self, arr, cleanup: list):
        """A host copy of device array ``arr`` in a pinned staging buffer (the stream
        waited for first); ``cleanup`` gets the buffer's release, which the caller runs
        once it is done with the copy (after :meth:`stage_back`)."""
        return self._outgoing(arr, cleanup)

    def stage_back(self, host, arr) -> None:
        """Copy ``host`` (from :meth:`stage_in`) into device array ``arr``."""
        self._backend(arr).copy_from_host(host, arr)

    def workspace(self, tag: str, like, count: int = 2, shape=None) -> tuple:
        """``count`` arrays shaped like ``like`` (or of ``shape``, with ``like``'s dtype
        and array type), kept on this communicator and reused by later calls with the
        same tag, shape and dtype (the 8 most recent are kept).

        Large fresh allocations cost page faults on every call (measured: SUMMA at
        n = 4096 on 4 ranks took 1.6-2.2 s with per-call buffers, 1.55-1.65 s with
        reused ones). The arrays' contents are undefined; a caller must not hold them
        across another call that uses the same tag.
        """
        shape = like.shape if shape is None else tuple(shape)
        key = (tag, shape, like.dtype, type(like), count)
        bufs = self._workspaces.pop(key, None)
        if bufs is None:
            xp = self._backend(like).xp
            bufs = tuple(xp.empty(shape, dtype=like.dtype) for _ in range(count))
        self._workspaces[key] = bufs
        while len(self._workspaces) > 8:
            self._workspaces.popitem(last=False)
        return bufs

    def _scratch(self, like):
        """A reusable array shaped like ``like`` (tree-reduce receive buffers)."""
        for idx, buf in enumerate(self._scratch_free):
            if buf.shape == like.shape and buf.dtype == like.dtype and type(buf) is type(like):
                return self._scratch_free.pop(idx)
        return self._backend(like).xp.empty_like(like)

    def _release_scratch(self, buf):
        if len(self._scratch_free) < 8:
            self._scratch_free.append(buf)

    # -- device-to-device (comm_mode "ipc") -----------------------------------
    def _ipc(self, arr) -> bool:
        """Whether ``arr`` travels through the IPC outboxes (:mod:`summasim.backends.ipc`)."""
        if isinstance(arr, _NDARRAY) and self.backend is None:      # the host fast path
            return False
        return self._backend(arr).comm_mode == "ipc"

    def _eager(self, arr, op, root, run) -> Request:
        """An operation on ``arr`` done at once through the IPC outboxes, as a completed
        request (traced when waited on, like any other)."""
        phase = self.trace.current_phase
        t0 = time.perf_counter()
        run(ipc.outbox_of(self._backend(arr)))
        return Request(self, [], op, root, arr.nbytes, time.perf_counter() - t0, phase, [])

    def _ipc_reduce(self, sendbuf, recvbuf, root, tag) -> Request:
        """The tree reduce through the IPC outboxes, done at once (every rank of the
        group enters it together, like any collective)."""
        held: list = []

        def scratch():
            held.append(self._scratch(sendbuf))
            return held[-1]

        try:
            return self._eager(sendbuf, "reduce", root, lambda box: ipc.reduce(
                self.mpi, box, sendbuf, recvbuf, root, tag, self._waitall, scratch))
        finally:
            for buf in held:
                self._release_scratch(buf)

    # -- completion ----------------------------------------------------------
    def _waitall(self, reqs):
        wait_requests(reqs, self.wait_policy)

    def _start(self, op, root, nbytes, post, cleanup) -> Request:
        phase = self.trace.current_phase
        t0 = time.perf_counter()
        reqs = post()
        return Request(self, reqs, op, root, nbytes, time.perf_counter() - t0, phase, cleanup)

    # -- collectives ---------------------------------------------------------
    def ibcast(self, buf, root: int = 0) -> Request:
        """Non-blocking broadcast of ``buf`` (in place) from group rank ``root``."""
        self._check(buf, "bcast")
        if self._ipc(buf):
            return self._eager(buf, "bcast", root, lambda box: ipc.bcast(
                self.mpi, box, buf, root, self._waitall))
        cleanup: list = []
        if self.rank == root:
            view = self._outgoing(buf, cleanup)
            if isinstance(view, _NDARRAY) and not view.flags.writeable:
                # MPI may write the root's own buffer (MPICH's scatter-allgather broadcast
                # receives the root's pieces back into it): read-only memory, a file
                # mapped read-only, would fault, so the root sends from a copy
                tmp = self._scratch(view.view(_NDARRAY))
                tmp[...] = view
                cleanup.append(lambda: self._release_scratch(tmp))
                view = tmp
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
        if self.rank == root:
            if recvbuf is None or recvbuf.shape != sendbuf.shape or recvbuf.dtype != sendbuf.dtype:
                raise ValueError("reduce: the root needs a recvbuf shaped like sendbuf")
            self._check(recvbuf, "reduce")
        if self.reduce_algorithm == "tree":
            tag = _REDUCE_TAG + self._counts.reduces % _REDUCE_TAG
            self._counts.reduces += 1
            if self._ipc(sendbuf):
                return self._ipc_reduce(sendbuf, recvbuf, root, tag)
            return _TreeReduce(self, sendbuf, recvbuf, root, tag)
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = None
        if self.rank == root:
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
        drop = op == "sum" and self.take_drop()
        if drop:                   # fault injection: keep this rank's own block
            mine = buf.copy()
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
        if drop:
            result[...] = mine
        return result

    # -- fault injection: the drop hook (DropFault) --------------------------
    @staticmethod
    @contextmanager
    def drop_next_sum(groups=None):
        """Arm the ``drop`` fault on this process for the ``with`` block: the next sum
        reduction over more than one rank (over a group whose :attr:`name` is in
        ``groups``, when given) keeps this rank's own contribution. Yields the
        :class:`DropFault`, whose ``applied`` says whether one did; disarmed on exit."""
        _DROP.armed, _DROP.applied = True, False
        _DROP.groups = None if groups is None else frozenset(groups)
        try:
            yield _DROP
        finally:
            _DROP.armed, _DROP.groups = False, None

    def take_drop(self) -> bool:
        """Whether this sum reduction is the one an armed ``drop`` leaves unreduced
        (it then disarms the hook); never on a group of one."""
        if not _DROP.armed or self.size == 1 or (
                _DROP.groups is not None and self.name not in _DROP.groups):
            return False
        _DROP.armed, _DROP.applied = False, True
        return True

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

    def reduce_scatter(self, sendbuf, recvbuf):
        """Sum ``sendbuf`` over the ranks and leave block ``rank`` of the sum in
        ``recvbuf`` (MPI's ``Reduce_scatter_block``: ``sendbuf`` is ``size`` equal
        blocks, leading axis = rank). Traced as "reduce_scatter" with the bytes of the
        whole ``sendbuf``, as the cost model prices it. A ``drop`` fault keeps this
        rank's own block unreduced."""
        self._check(sendbuf, "reduce_scatter")
        self._check(recvbuf, "reduce_scatter")
        if sendbuf.size != recvbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError(f"reduce_scatter: sendbuf needs {self.size} x {recvbuf.size} "
                             f"items of {recvbuf.dtype}")
        drop = self.take_drop()
        if drop:                      # fault injection: keep this rank's own block
            mine = sendbuf.reshape(self.size, -1)[self.rank].copy()
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = self._incoming(recvbuf, cleanup)
        self._start("reduce_scatter", -1, sendbuf.nbytes,
                    lambda: [self.mpi.Ireduce_scatter_block(sview, rview, op=MPI.SUM)],
                    cleanup).wait()
        if drop:                      # the collective ran on every rank; this one lies
            recvbuf.reshape(-1)[...] = mine
        return recvbuf

    def _blocks(self, arr, nbytes: int) -> bool:
        """Whether a sendrecv of ``nbytes`` on ``arr`` (a host or device array) takes
        the exchanger's path."""
        return nbytes < self.blocking_limit and (isinstance(arr, _NDARRAY)
                                                 or is_device_array(arr))

    def exchanger(self, like, nbytes: int, tag: int = 0):
        """``(step, finish)`` for a loop of ring steps of at most ``nbytes`` on arrays
        like ``like`` (contiguous, the caller's promise), with the per-call decisions of
        :meth:`sendrecv` taken once. ``step(sendbuf, dest, recvbuf, source)`` returns
        when ``recvbuf`` has arrived; ``finish()`` returns when every send of the loop has
        completed. Until then the caller must not write to a buffer it has sent. The
        ring's inner loops use it.

        The host steps of this pair wait by the rule (:meth:`_rule_mode`); a ring's by
        what the communicator measured (:meth:`ring_exchanger`). The three ways:

        Host arrays under the "spin" policy (a core for every rank): each step is one
        blocking ``MPI_Sendrecv``. Posting the two requests and completing the sends at
        the end buys nothing when no rank waits for a core, and costs two request
        objects a step: at p = 2 on 2 cores, 64 KiB in 59-61 us against 69-70 with the
        requests (two launches each, alternated; the plain ring 58-62 in the same
        launches), the same from 256 KiB to 16 MiB.

        Host arrays below :attr:`blocking_limit` under the other policies: each step posts
        ``MPI_Irecv`` and ``MPI_Isend`` and waits for the receive only; the sends are
        completed together by ``finish``. A step therefore does not wait for its right
        neighbour to take the message (a rendezvous, from 8 KiB in MPICH, completes the send
        only when the receiver has copied it and answered), so a rank goes on as soon as its
        own data is in. Under the "sleep" and "yield" policies the receive is polled with
        ``MPI_Test`` and ``sched_yield``, which hands the core at once to a rank that has
        work (oversubscribed: the rank that holds the next message). Measured on 2 cores,
        p = 4, 8 and 16 (docs/performance.md): 5-34% faster than a plain ring of
        ``MPI_Sendrecv`` from 64 KiB to 64 MiB except at p = 4 and 64 KiB (0.88x), and
        faster than polling with sleeps at every size.

        Long waits among many waiters nap: when the node has at least
        :data:`NAP_RANKS_PER_CORE` ranks per core and the loop's steps carry at least
        :attr:`nap_limit` bytes (:data:`NAP_BYTES`, 256 KiB), a step yields for its first
        :data:`NAP_AFTER_POLLS` polls and then sleeps between polls. Such a step lasts
        about R times the copy and add of its chunk; every yielding waiter that the
        scheduler picks in that time takes a turn from the rank that has the data, and a
        nap takes the waiter off the run queue. Measured at p = 16 on 2 cores: 4, 16 and
        64 MiB in 20.0, 47.6, 150 ms napping against 21.9, 54.3, 226 ms yielding; at
        2 ranks per core napping gained nothing (docs/performance.md).

        Every step is traced when the trace is on, with ``blocking`` set: an exchanger
        step (the receive alone awaited, yielding first), which the cost model prices
        apart from a request completed by the wait policy (both requests, a sleep after
        the first failed poll). A napping step is one too: it naps only once its wait
        has outlasted its yields, when the step's cost is its chunk's copy and add.

        Arrays that are not plain host memory (a device array, or any array of a
        "staged" backend) take the same steps through :meth:`_outgoing` and
        :meth:`_incoming`: the stream is synchronized, a staged send is copied into a
        pinned buffer that is held until ``finish``, and a staged receive is copied back
        as soon as it has arrived, before ``step`` returns.

        Messages from :attr:`blocking_limit` on go through :meth:`sendrecv` and the wait
        policy, and ``finish`` does nothing.

        Host-array pairs are built once per kind of loop (backend, wait policy, which
        side of the blocking and nap limits ``nbytes`` lies, tag, trace) and kept: a
        ring call then costs one dict lookup here instead of building its closures (cold,
        between barriers, a call's set-up Python costs several microseconds, part of a
        64 KiB ring's lead over the plain loop). They hold nothing of the Comm itself, so
        keeping them keeps no Comm alive; the pairs of other arrays (staged steps call
        the Comm's methods) and of the wait policy's path are built per call. A kept pair
        whose last loop never finished (an exception between ``step`` and ``finish``) is
        replaced by a fresh one."""
        return self._exchanger(like, nbytes, tag, self._rule_mode(nbytes))

    def ring_exchanger(self, like, nbytes: int, trial=None):
        """:meth:`exchanger` for one call of a ring, collective over this communicator
        (every rank makes the same ring calls, of the same sizes, in the same order):
        host steps wait the way :attr:`ring_wait` says, for ``"auto"`` the way this
        communicator measured fastest for the size class (:mod:`summasim.ringwait`):
        the first call of a class runs the trials before its own steps, untraced: each
        is one ring of the class on scratch buffers, ``run(step, finish)`` with the pair
        of a mode, where ``run = trial(like, nbytes, size, rank)``. Device and staged
        arrays, steps of :attr:`blocking_limit` or ``SUMMASIM_BLOCKING_BYTES`` bytes or
        more (the lesser: a "spin" rank's own limit is unbounded, and every rank must
        take the same path), and a call without ``trial`` wait by the rule."""
        rule = self._rule_mode(nbytes)
        mode = rule
        # whether the trials run must not depend on this rank's wait policy (which may
        # differ between nodes): "spin" lifts the blocking limit on its own rank only,
        # so the shared SUMMASIM_BLOCKING_BYTES bounds the trials on every rank
        if (self.ring_wait != "rule" and isinstance(like, _NDARRAY)
                and nbytes < min(self.blocking_limit, BLOCKING_SENDRECV_BYTES)
                and self._backend(like).comm_mode == "host"):
            if self.ring_wait in RING_MODES:
                mode = self.ring_wait
            elif trial is not None:
                mode = self.ring_waits.decided(nbytes) or self._settle(like, nbytes, rule,
                                                                         trial)
        return self._exchanger(like, nbytes, 0, mode)

    def _settle(self, like, nbytes: int, rule: str, trial) -> str:
        """Run the size class's trials now, untraced (:meth:`ring_exchanger`)."""
        run = trial(like, nbytes, self.size, self.rank)
        traced, self.trace.enabled = self.trace.enabled, False
        try:
            return self.ring_waits.settle(
                nbytes, lambda m: run(*self._exchanger(like, nbytes, 0, m)), rule,
                self.mpi, self._waitall)
        finally:
            self.trace.enabled = traced

    def ring_mode(self, nbytes: int) -> str:
        """How a host ring of steps of at most ``nbytes`` on this communicator waits now
        (:data:`summasim.ringwait.MODES`), ``"trials"`` while ``"auto"`` has not yet
        measured its size class, or ``"policy"`` from :attr:`blocking_limit`."""
        if nbytes >= self.blocking_limit:
            return "policy"
        if self.ring_wait == "rule" or nbytes >= BLOCKING_SENDRECV_BYTES:
            return self._rule_mode(nbytes)
        if self.ring_wait in RING_MODES:
            return self.ring_wait
        return self.ring_waits.decided(nbytes) or "trials"

    @property
    def ring_waits(self):
        """The ring waits measured on this communicator
        (:class:`summasim.ringwait.RingWaits`, shared by every Comm over it)."""
        if self._ring_waits is None:
            self._ring_waits = waits_of(self.mpi)
        return self._ring_waits

    def _rule_mode(self, nbytes: int) -> str:
        """How a step of ``nbytes`` waits by the fixed rule: ``"blocking"`` under the
        "spin" wait policy, else ``"nap"`` from :attr:`nap_limit` and ``"yield"`` below."""
        if self.wait_policy == "spin":
            return "blocking"
        return "nap" if nbytes >= self.nap_limit else "yield"

    def _exchanger(self, like, nbytes: int, tag: int, mode: str):
        """The kept or a new pair of :meth:`exchanger` whose host steps wait by ``mode``."""
        key = (type(like), self.backend, mode, nbytes < self.blocking_limit, tag, self.trace)
        kept = self._exchangers.get(key)
        if kept is not None and not kept[2]:
            return kept[0], kept[1]
        step, finish, pending, keep = self._new_exchanger(like, nbytes, tag, mode)
        if keep:
            if len(self._exchangers) >= 16:            # e.g. sendrecvs with many tags
                self._exchangers.clear()
            self._exchangers[key] = (step, finish, pending)
        return step, finish

    def _new_exchanger(self, like, nbytes: int, tag: int, mode: str):
        """A fresh pair of :meth:`exchanger` whose host steps wait by ``mode`` (one of
        :data:`summasim.ringwait.MODES`): ``(step, finish, pending, keep)``, with
        ``pending`` the list of sends not yet completed and ``keep`` whether the pair
        may be kept (host arrays: no reference to this Comm)."""
        if not self._blocks(like, nbytes):
            return self.sendrecv, _nothing, (), False
        irecv, isend, trace, name, size = (self.mpi.Irecv, self.mpi.Isend, self.trace,
                                           self.name, self.size)
        clock, sends, held = time.perf_counter, [], []
        if self.wait_policy == "spin" and mode == "blocking":
            def complete(req):
                req.Wait()

            def complete_all(reqs):
                MPI.Request.Waitall(reqs)
        else:
            pause, testall, nap = os.sched_yield, MPI.Request.Testall, time.sleep

            def complete_all(reqs):
                while not testall(reqs):
                    pause()

            if mode == "nap":
                def complete(req):
                    polls = 0
                    while not req.Test():
                        polls += 1
                        if polls <= NAP_AFTER_POLLS:
                            pause()
                        else:
                            nap(SLEEP_S)
            else:
                def complete(req):
                    while not req.Test():
                        pause()

        host = self._backend(like).comm_mode == "host"
        if host and mode == "blocking":
            sendrecv = self.mpi.Sendrecv

            def step(sb, dest, rb, source):    # every rank has a core: one blocking call
                t0 = clock()
                sendrecv(sb, dest, tag, rb, source, tag)
                if trace.enabled:
                    trace.record("sendrecv", name, size, -1, sb.nbytes, clock() - t0,
                                 blocking=True)
        elif host:
            def step(sb, dest, rb, source):
                t0 = clock()
                req = irecv(rb, source, tag)
                sends.append(isend(sb, dest, tag))
                complete(req)
                if trace.enabled:
                    trace.record("sendrecv", name, size, -1, sb.nbytes, clock() - t0,
                                 blocking=True)
        elif self._backend(like).comm_mode == "ipc":
            mpi, box, waiter = self.mpi, ipc.outbox_of(self._backend(like)), self._waitall

            def step(sb, dest, rb, source):   # device to device (summasim.backends.ipc)
                t0 = clock()
                ipc.sendrecv(mpi, box, sb, dest, rb, source, tag, waiter)
                if trace.enabled:
                    trace.record("sendrecv", name, size, -1, sb.nbytes, clock() - t0,
                                 blocking=True)
        else:
            outgoing, incoming = self._outgoing, self._incoming

            def step(sb, dest, rb, source):
                t0 = clock()
                back: list = []
                req = irecv(incoming(rb, back), source, tag)
                sends.append(isend(outgoing(sb, held), dest, tag))
                complete(req)
                for done in back:            # the copy back, then the buffer's release
                    done()
                if trace.enabled:
                    trace.record("sendrecv", name, size, -1, sb.nbytes, clock() - t0,
                                 blocking=True)

        def finish():
            if sends:
                complete_all(sends)
                sends.clear()
            for done in held:                # staged sends: their buffers back to the pool
                done()
            held.clear()

        return step, finish, sends, host

    def isendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> Request:
        """Non-blocking send of ``sendbuf`` to ``dest`` and receive into ``recvbuf``
        from ``source`` (group ranks). ``sendbuf`` and ``recvbuf`` must not overlap."""
        self._check(sendbuf, "sendrecv")
        self._check(recvbuf, "sendrecv")
        if self._ipc(sendbuf):
            return self._eager(sendbuf, "sendrecv", -1, lambda box: ipc.sendrecv(
                self.mpi, box, sendbuf, dest, recvbuf, source, tag, self._waitall))
        cleanup: list = []
        sview = self._outgoing(sendbuf, cleanup)
        rview = self._incoming(recvbuf, cleanup)

        def post():
            return [self.mpi.Irecv(rview, source=source, tag=tag),
                    self.mpi.Isend(sview, dest=dest, tag=tag)]

        return self._start("sendrecv", -1, sendbuf.nbytes, post, cleanup)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Blocking send of ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from
        ``source``; returns ``recvbuf``.

        Host arrays of less than :attr:`blocking_limit` bytes (unlimited unless
        ``SUMMASIM_BLOCKING_BYTES`` sets it; 0: off) take one step of
        :meth:`exchanger` (the receive waited for without sleeping, then the send) and
        one trace record (``blocking=True``, which the cost model prices as its own kind
        of wait). Everything else goes through :meth:`isendrecv` and the wait policy.
        """
        same_kind = (isinstance(recvbuf, _NDARRAY) == isinstance(sendbuf, _NDARRAY)
                     and (isinstance(sendbuf, _NDARRAY) or type(recvbuf) is type(sendbuf)))
        if self._blocks(sendbuf, sendbuf.nbytes) and same_kind:   # (a memmap is a host array)
            if not (sendbuf.flags.c_contiguous and recvbuf.flags.c_contiguous):
                raise ValueError("sendrecv: MPI buffers must be C-contiguous arrays")
            step, finish = self.exchanger(sendbuf, sendbuf.nbytes, tag)
            step(sendbuf, dest, recvbuf, source)
            finish()
            return recvbuf
        self.isendrecv(sendbuf, dest, recvbuf, source, tag).wait()
        return recvbuf

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Non-blocking point-to-point send of ``buf`` to group rank ``dest`` (traced as
        "send" with ``buf.nbytes``). ``buf`` must stay unchanged until the request is
        waited on (a staged copy is taken at once for device arrays)."""
        self._check(buf, "send")
        cleanup: list = []
        view = self._outgoing(buf, cleanup)
        return self._start("send", dest, buf.nbytes,
                           lambda: [self.mpi.Isend(view, dest=dest, tag=tag)], cleanup)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        """Non-blocking receive into ``buf`` from group rank ``source`` (traced as "recv"
        with ``buf.nbytes``; the ledger's payload counts what is sent, so compare
        "send" events with closed forms)."""
        self._check(buf, "recv")
        cleanup: list = []
        view = self._incoming(buf, cleanup)
        return self._start("recv", source, buf.nbytes,
                           lambda: [self.mpi.Irecv(view, source=source, tag=tag)], cleanup)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` from group rank ``source`` (waits with the wait policy);
        returns ``buf``."""
        self.irecv(buf, source, tag).wait()
        return buf

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
