"""Device-to-device messages between the processes of one node (``comm_mode == "ipc"``).

A rank that sends copies the message into its *outbox*, one device buffer of its own
(raw ``cudaMalloc``, outside CuPy's pool), and sends the receivers an 88-byte header
over MPI: the outbox's CUDA IPC memory handle, its capacity, the message's offset and
length. A receiver opens the handle (``cudaIpcOpenMemHandle``, once per outbox: on an
H200 an open took 167 ms, a 64 MiB copy out of the opened buffer 36 us), copies the
message device to device into its own array, waits for its stream and answers with an
empty acknowledgement. The sender waits for the acknowledgements only before it next
writes to its outbox, so a broadcast's root or a ring step goes on at once.

Every message thus costs one device copy on each side and two small host messages; the
bytes never cross PCIe. The same path serves several ranks that share one GPU (each
process has its own CUDA context; IPC works between contexts of one device) and the
GPUs of one node.

The outbox grows to the largest message (to at least twice its last capacity, from
:attr:`Outbox.MIN_BYTES`), and each growth is a new allocation with a new handle, which
every peer opens once more; the old buffers stay allocated until the process ends,
since a peer may still have them open (at most twice the final capacity in all).

The protocol is the same for the host stand-in :class:`IpcHostBackend`: NumPy arrays,
an outbox in a POSIX shared-memory file (``/dev/shm``) and the file's name as the
handle, so CI runs the whole transport without a GPU (``--backend ipc-host``).

Only the blocking shapes of traffic take this path, those that every rank of a group
enters together: broadcasts (:meth:`summasim.comm.Comm.ibcast` completes before it
returns) and send-receive pairs, ring steps included. Point-to-point ``isend`` and
``irecv`` (pipelines post them in orders that differ by rank), MPI's own all-reduce
and all-gather, and the tree reduce stay on the staged path.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os

import numpy as np

from .staged import StagedHostBackend

#: header: handle (64 bytes), then int64 capacity, offset, nbytes
HANDLE_BYTES = 64
HEADER_BYTES = HANDLE_BYTES + 3 * 8
#: acknowledgements travel on this tag of the operation's communicator (tree reduces use
#: [2^14, 2^15); MPI guarantees tags up to 32767)
ACK_TAG = 32001


def header(handle: bytes, capacity: int, offset: int, nbytes: int) -> np.ndarray:
    """The 88-byte header of a message (a host array, what MPI sends)."""
    out = np.zeros(HEADER_BYTES, dtype=np.uint8)
    out[: len(handle)] = np.frombuffer(handle, dtype=np.uint8)
    out[HANDLE_BYTES:].view(np.int64)[:] = (capacity, offset, nbytes)
    return out


def parse_header(buf: np.ndarray) -> tuple[bytes, int, int, int]:
    """``(handle, capacity, offset, nbytes)`` of a header."""
    capacity, offset, nbytes = (int(v) for v in buf[HANDLE_BYTES:].view(np.int64))
    return bytes(buf[:HANDLE_BYTES]), capacity, offset, nbytes


def byte_view(arr):
    """The bytes of a C-contiguous array, as a flat uint8 array of the same module."""
    return arr.reshape(-1).view(np.uint8)


class Outbox:
    """One process's outbox and the peers' outboxes it has opened.

    ``backend`` provides ``ipc_alloc(nbytes) -> (uint8 array, handle)``,
    ``ipc_open(handle, capacity) -> uint8 array`` and ``synchronize()``.
    """

    #: the smallest outbox: growth costs every peer a handle open
    MIN_BYTES = 64 << 20

    def __init__(self, backend, min_bytes: int | None = None):
        self.backend = backend
        self.min_bytes = self.MIN_BYTES if min_bytes is None else min_bytes
        self.buf = None             # uint8 array of the current outbox
        self.handle = b""
        self.retired: list = []     # earlier outboxes, kept: peers may have them open
        self.opened: dict = {}      # handle -> uint8 array of a peer's outbox
        self.pending: list = []     # MPI requests: acknowledgements of the last post
        self.waiter = None          # how to wait for them (the posting Comm's policy)

    def _ensure(self, nbytes: int):
        if self.buf is not None and self.buf.nbytes >= nbytes:
            return
        old = 0 if self.buf is None else self.buf.nbytes
        cap = max(nbytes, 2 * old, self.min_bytes, 1)
        cap = -(-cap // 4096) * 4096
        if self.buf is not None:
            self.retired.append(self.buf)
        self.buf, self.handle = self.backend.ipc_alloc(cap)

    def settle(self) -> None:
        """Wait for the acknowledgements of the last message (before the outbox is
        written again)."""
        if self.pending:
            reqs, self.pending = self.pending, []
            self.waiter(reqs)

    def post(self, arr, acks: list, waiter) -> np.ndarray:
        """Copy ``arr`` into the outbox and return its header; ``acks`` are the MPI
        receive requests of its acknowledgements, waited for (with ``waiter``) before
        the next post."""
        self.settle()
        nbytes = arr.nbytes
        self._ensure(nbytes)
        if nbytes:
            self.backend.ipc_copy(byte_view(arr), self.buf[:nbytes])
        self.backend.synchronize()   # the copy is done before any peer reads it
        self.pending, self.waiter = acks, waiter
        return header(self.handle, self.buf.nbytes, 0, nbytes)

    def fetch(self, hdr: np.ndarray, out) -> None:
        """Copy the message that ``hdr`` describes into ``out`` (opening the sender's
        outbox the first time), and wait until the copy is done."""
        handle, capacity, offset, nbytes = parse_header(hdr)
        if nbytes > out.nbytes:
            raise ValueError(f"ipc: a message of {nbytes} bytes does not fit the receive "
                             f"buffer of {out.nbytes}")
        peer = self.opened.get(handle)
        if peer is None:
            peer = self.opened[handle] = self.backend.ipc_open(handle, capacity)
        if nbytes:
            self.backend.ipc_copy(peer[offset: offset + nbytes], byte_view(out)[:nbytes])
        self.backend.synchronize()   # read out before the sender may overwrite it


def outbox_of(backend) -> Outbox:
    """The process's outbox for ``backend`` (made on first use)."""
    box = getattr(backend, "_summasim_outbox", None)
    if box is None:
        box = backend._summasim_outbox = Outbox(backend, getattr(backend, "ipc_min_bytes",
                                                                 None))
        # the last message's receivers read this process's outbox: it must outlive that
        # (atexit runs this before mpi4py finalizes MPI, registered earlier)
        atexit.register(box.settle)
    return box


class IpcHostBackend(StagedHostBackend):
    """NumPy arrays through the IPC transport: outboxes in POSIX shared memory.

    Stands in for the CuPy backend in "ipc" mode, as :class:`StagedHostBackend` does for
    "staged" (whose staging it inherits for the operations that stay staged). Counts
    outbox allocations, handle opens, device copies and stream waits.
    """

    name = "ipc-host"
    comm_mode = "ipc"
    comm_mode_reason = "host stand-in: outboxes in shared memory"
    #: small outboxes, so that tests see them grow
    ipc_min_bytes = 4096

    def reset_counters(self):
        super().reset_counters()
        self.ipc_allocs = 0      # outboxes created
        self.ipc_opens = 0       # peers' outboxes opened
        self.ipc_copies = 0      # copies into an outbox or out of a peer's

    def ipc_alloc(self, nbytes: int):
        self.ipc_allocs += 1
        if not _ORPHANS_REMOVED:
            _remove_orphans()
        name = f"/dev/shm/summasim-ipc-{os.getpid()}-{next(_SERIAL)}"
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        atexit.register(_unlink, name)
        return np.frombuffer(mm, dtype=np.uint8), name.encode()

    def ipc_open(self, handle: bytes, capacity: int):
        self.ipc_opens += 1
        name = handle.rstrip(b"\0").decode()
        fd = os.open(name, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, capacity, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return np.frombuffer(mm, dtype=np.uint8)

    def ipc_copy(self, src, dst):
        self.ipc_copies += 1
        np.copyto(dst, src)


_SERIAL = itertools.count()   # names of this process's shared-memory outboxes
_ORPHANS_REMOVED = False


def _remove_orphans() -> None:
    """Remove the outboxes of processes that are gone (a job that aborted skips the
    unlink at exit); once per process."""
    import glob

    global _ORPHANS_REMOVED
    _ORPHANS_REMOVED = True
    for path in glob.glob("/dev/shm/summasim-ipc-*-*"):
        try:
            os.kill(int(path.split("-")[-2]), 0)
        except ProcessLookupError:
            _unlink(path)
        except (ValueError, PermissionError):
            pass


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- #
# the two shapes of traffic, over an mpi4py communicator                      #
# --------------------------------------------------------------------------- #
_ACK = np.zeros(1, dtype=np.uint8)


def sendrecv(mpi, box: Outbox, sendbuf, dest: int, recvbuf, source: int, tag: int,
             waiter) -> None:
    """Send ``sendbuf`` to group rank ``dest`` and receive into ``recvbuf`` from
    ``source`` through the outboxes (every rank of the ring calls it together).
    ``waiter(requests)`` completes MPI requests (the Comm's wait policy)."""
    rank = mpi.Get_rank()
    if dest == rank and source == rank:            # a ring of one: a local copy
        if sendbuf.nbytes:
            box.backend.ipc_copy(byte_view(sendbuf), byte_view(recvbuf)[: sendbuf.nbytes])
        return
    box.settle()
    ack = np.empty(1, dtype=np.uint8)
    hdr = box.post(sendbuf, [mpi.Irecv(ack, source=dest, tag=ACK_TAG)], waiter)
    inbound = np.empty(HEADER_BYTES, dtype=np.uint8)
    waiter([mpi.Irecv(inbound, source=source, tag=tag), mpi.Isend(hdr, dest=dest, tag=tag)])
    box.fetch(inbound, recvbuf)
    mpi.Send(_ACK, dest=source, tag=ACK_TAG)       # 1 byte: eager, returns at once


def bcast(mpi, box: Outbox, buf, root: int, waiter) -> None:
    """Broadcast ``buf`` in place from group rank ``root`` through the root's outbox."""
    size, rank = mpi.Get_size(), mpi.Get_rank()
    if size == 1:
        return
    if rank == root:
        box.settle()
        acks = np.empty(size, dtype=np.uint8)
        reqs = [mpi.Irecv(acks[r: r + 1], source=r, tag=ACK_TAG)
                for r in range(size) if r != root]
        hdr = box.post(buf, reqs, waiter)
        waiter([mpi.Ibcast(hdr, root=root)])
    else:
        hdr = np.empty(HEADER_BYTES, dtype=np.uint8)
        waiter([mpi.Ibcast(hdr, root=root)])
        box.fetch(hdr, buf)
        mpi.Send(_ACK, dest=root, tag=ACK_TAG)


def tree_links(rank: int, size: int, root: int) -> tuple[list, int | None]:
    """``(children, parent)`` of group rank ``rank`` in the binomial tree rooted at
    ``root`` (the tree of :class:`summasim.comm.Comm`'s reduce, module doc there)."""
    rel, children, parent, mask = (rank - root) % size, [], None, 1
    while mask < size:
        if rel & mask:
            parent = (rel - mask + root) % size
            break
        if rel + mask < size:
            children.append((rel + mask + root) % size)
        mask <<= 1
    return children, parent


def reduce(mpi, box: Outbox, sendbuf, recvbuf, root: int, tag: int, waiter, scratch) -> None:
    """Sum-reduce ``sendbuf`` into ``recvbuf`` on ``root`` over the binomial tree, each
    partial sum passed up through the sender's outbox. The sum is ``sendbuf + child_0 +
    child_1 + ...`` in the tree's fixed order on every rank, as on the staged path, so
    the result is the same bit for bit. ``scratch()`` gives a buffer shaped like
    ``sendbuf`` (returned to the caller's pool by the caller)."""
    children, parent = tree_links(mpi.Get_rank(), mpi.Get_size(), root)
    if not children:
        acc = sendbuf
        if parent is None:                     # a group of one
            recvbuf[...] = sendbuf
    else:
        acc = recvbuf if parent is None else scratch()
        acc[...] = sendbuf
        part = scratch()
        hdr = np.empty(HEADER_BYTES, dtype=np.uint8)
        for child in children:
            waiter([mpi.Irecv(hdr, source=child, tag=tag)])
            box.fetch(hdr, part)
            mpi.Send(_ACK, dest=child, tag=ACK_TAG)
            acc += part
    if parent is not None:
        box.settle()
        ack = np.empty(1, dtype=np.uint8)
        out = box.post(acc, [mpi.Irecv(ack, source=parent, tag=ACK_TAG)], waiter)
        waiter([mpi.Isend(out, dest=parent, tag=tag)])
