"""One read-only copy per node of what one rank computed (an MPI-3 shared window).

The training rows compare every rank's shard with the serial model, which rank 0 runs
alone. Handing each rank its own copy of the serial model's parameters, gradients and
logits (a pickled broadcast) put a whole model on every rank: at p = 16 on one node the
copies, not the shards, set how large a model fits. :class:`NodeShared` puts them in
one shared-memory window per node instead; every rank reads read-only NumPy views of
it and copies out only its block (``module.shard``). The node's cost is one copy,
whatever the number of ranks on it; a rank's own memory follows its share.

How the data moves: rank 0 (a node leader: the node communicator orders ranks by world
rank) sends the shapes and every non-array leaf as one small pickle to all ranks, copies
its arrays into its node's window and broadcasts the window's bytes over the node
leaders (in pieces below 2 GiB); a fence on each node makes them visible. On one node
nothing crosses the network.

:meth:`NodeShared.publish` (collective) replaces the value, in the same window while
it fits: a mesh row publishes every training step's reference there, so a step costs a
copy, not a new window and two communicators.

The views live as long as the :class:`NodeShared`; :meth:`NodeShared.free` (collective
over the node, and synchronizing: MPI_Win_free waits for every rank of the node)
releases the window, after which no view may be touched: keep only scalars and copies
past it. Free it on the path where the work finished, not in a ``finally``: a rank that
raised alone must reach the abort hook, not wait in the free for ranks that wait for it.
On an error, :meth:`NodeShared.abandon` (local) leaves the window to the next
:class:`NodeShared` on the same communicator, which frees it first: an error that every
rank raised alike (an argument agreement) leaves every rank there, so the windows are
freed in step and a caller that catches such errors row after row does not pile up
copies; a rank that raised alone never gets there (the job aborts).
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ..mpiutil import quiet_barrier

ALIGN = 64                 # bytes: each array starts on a cache line
PIECE = 1 << 30            # bytes per broadcast call (MPI counts are C ints)
_ABANDONED: list = []      # NodeShared left by an error, freed by the next on their world


class _Slot:
    """Where one array of the tree sits in the window."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple, dtype: str):
        self.offset, self.shape, self.dtype = offset, shape, dtype


def _strip(tree, arrays: list, offset: list):
    """``tree`` with every NumPy array replaced by a :class:`_Slot` (appended to
    ``arrays``); dicts, lists and tuples are walked, other leaves kept as they are."""
    if isinstance(tree, np.ndarray):
        arrays.append(tree)
        slot = _Slot(offset[0], tree.shape, tree.dtype.str)
        offset[0] += -(-tree.nbytes // ALIGN) * ALIGN
        return slot
    if isinstance(tree, dict):
        return {k: _strip(v, arrays, offset) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_strip(v, arrays, offset) for v in tree)
    return tree


def _views(skeleton, memory: np.ndarray):
    if isinstance(skeleton, _Slot):
        dtype = np.dtype(skeleton.dtype)
        n = math.prod(skeleton.shape) * dtype.itemsize
        view = memory[skeleton.offset:skeleton.offset + n].view(dtype).reshape(skeleton.shape)
        view.flags.writeable = False
        return view
    if isinstance(skeleton, dict):
        return {k: _views(v, memory) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_views(v, memory) for v in skeleton)
    return skeleton


class NodeShared:
    """``tree`` of rank ``root`` (dicts, lists and tuples of NumPy arrays and picklable
    leaves) on every rank of ``world``, its arrays as read-only views of one copy per
    node (collective; ``tree`` is read on the root only).

    Use as a context manager where nothing in the block can raise on one rank alone,
    else call :meth:`free` on every rank once the work is done.
    """

    def __init__(self, world, tree=None, root: int = 0):
        if root != 0:
            raise ValueError("NodeShared publishes from rank 0 (a node leader)")
        _free_abandoned(world)
        self._world = world
        rank = world.Get_rank()
        self._node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        leader = self._node.Get_rank() == 0
        self._leaders = world.Split(0 if leader else MPI.UNDEFINED, key=rank)
        self._win = None
        self.capacity = 0
        self.publish(tree)

    def publish(self, tree=None) -> None:
        """Replace the shared value with rank 0's ``tree`` (collective over the world),
        in the same window when it fits, else in a new one. Every rank must be done
        with the previous views: they now show the new values (keep copies past it)."""
        world, rank = self._world, self._world.Get_rank()
        arrays: list = []
        total = [0]
        skeleton = _strip(tree, arrays, total) if rank == 0 else None
        skeleton, nbytes = world.bcast((skeleton, total[0]) if rank == 0 else None, root=0)
        self.value = None
        self.nbytes = int(nbytes)
        leader = self._node.Get_rank() == 0
        if self._win is None or self.nbytes > self.capacity:
            if self._win is not None:
                self._win.Free()
            self.capacity = max(self.nbytes, 1)
            self._win = MPI.Win.Allocate_shared(self.capacity if leader else 0, 1,
                                                comm=self._node)
            buf, _ = self._win.Shared_query(0)
            self._memory = np.frombuffer(buf, dtype=np.uint8, count=self.capacity)
        memory = self._memory
        self._win.Fence()
        if rank == 0:
            for arr, slot in zip(arrays, _slots(skeleton)):
                dst = memory[slot.offset:slot.offset + arr.nbytes]
                dst.view(arr.dtype).reshape(arr.shape)[...] = arr
        if leader and self._leaders.Get_size() > 1:
            for lo in range(0, self.nbytes, PIECE):
                self._leaders.Bcast(memory[lo:min(lo + PIECE, self.nbytes)], root=0)
        quiet_barrier(self._node)        # the node's other ranks sleep while it copies
        self._win.Fence()
        self.value = _views(skeleton, memory)

    def free(self) -> None:
        """Release the window (collective over the node); the views die with it."""
        if self._win is None:
            return
        self.value = self._memory = None
        self._win.Free()
        self._win = None
        if self._leaders != MPI.COMM_NULL:
            self._leaders.Free()
        self._node.Free()

    def abandon(self) -> None:
        """Drop the views and leave the window to the next :class:`NodeShared` on this
        communicator (local; for an error path, where a collective free could wait for
        a rank that raised alone)."""
        self.value = None
        if self._win is not None and self not in _ABANDONED:
            _ABANDONED.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def _free_abandoned(world) -> None:
    """Free, in the order they were left, the windows abandoned on ``world`` (collective
    over ``world``: every rank that gets here left the same ones, see the module)."""
    for sh in list(_ABANDONED):
        try:
            same = world.Compare(sh._world) in (MPI.IDENT, MPI.CONGRUENT)
        except MPI.Exception:              # its communicator is gone: nothing to match
            same = False
        if same:
            _ABANDONED.remove(sh)
            sh.free()


def _slots(skeleton):
    """The :class:`_Slot` leaves of ``skeleton`` in :func:`_strip`'s order."""
    if isinstance(skeleton, _Slot):
        yield skeleton
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            yield from _slots(v)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            yield from _slots(v)
