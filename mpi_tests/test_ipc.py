"""The device-to-device (CUDA IPC) transport, exercised on the CPU with ipc-host.

The ipc-host backend runs the protocol of :mod:`summasim.backends.ipc` on NumPy arrays
with outboxes in shared memory: a message is one copy into the sender's outbox and one
copy out of it by each receiver, a peer's outbox is opened once (until it grows), no
data goes through MPI or a staging buffer, and the results and the traced ledger are
those of the host path.
"""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim import algorithms as algs
from summasim import layout
from summasim.backends import IpcHostBackend
from summasim.backends import ipc
from summasim.comm import Comm
from summasim.grid import Grid

P = WORLD.Get_size()


def _fresh(min_bytes=4096):
    be = IpcHostBackend()
    be.ipc_min_bytes = min_bytes
    return be


def _counts(be):
    return (be.ipc_allocs, be.ipc_opens, be.ipc_copies, be.d2h_copies, be.h2d_copies)


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_ipc_summa_equals_host_and_counts_copies(q, d):
    be = _fresh()
    rng = np.random.default_rng(5)
    A, B = rng.standard_normal((3 * q * d, 2 * q)), rng.standard_normal((2 * q, 4 * q))
    with Grid(WORLD, q, d) as host, Grid(WORLD, q, d, backend=be) as dev:
        a, b = layout.split(A, host, "2d"), layout.split(B, host, "2d")
        want = algs.summa_ab(a, b, host)
        got = algs.summa_ab(a, b, dev)
        opened = be.ipc_opens
        be.reset_counters()
        got2 = algs.summa_ab(a, b, dev)
        # rank (i, j) roots one row and one column broadcast (a copy into its outbox
        # each) and receives the other q - 1 of each (a copy out of a peer's outbox)
        want_copies = 2 + 2 * (q - 1) if q > 1 else 0
        parallel_assert(np.array_equal(got, want) and np.array_equal(got2, want),
                        "the IPC result differs from the host path")
        parallel_assert(_counts(be) == (0, 0, want_copies, 0, 0),
                        f"allocs/opens/copies/staged out/staged in {_counts(be)}, expected "
                        f"(0, 0, {want_copies}, 0, 0) on a warm outbox")
        # each rank opened at most one outbox per peer of its row and column
        parallel_assert(opened <= 2 * (q - 1), f"{opened} opens for {2 * (q - 1)} peers")


@pytest.mark.skipif(P < 2, reason="a ring needs 2 ranks")
def test_ipc_ring_allreduce_steps_device_to_device():
    be = _fresh()
    comm = Comm(WORLD.Dup(), name="ring", backend=be)
    host = Comm(WORLD.Dup(), name="ring")
    try:
        rng = np.random.default_rng(3)
        # below the stage-whole limit: one copy to the host, the host ring, one copy back
        X = rng.standard_normal((P, 100))
        got = algs.ring_allreduce(X[comm.rank].copy(), comm)
        parallel_assert(np.allclose(got, X.sum(0), rtol=0, atol=1e-13)
                        and (be.d2h_copies, be.h2d_copies, be.ipc_copies) == (1, 1, 0),
                        f"small vector: staged {(be.d2h_copies, be.h2d_copies)}, "
                        f"{be.ipc_copies} IPC copies; want (1, 1) and 0")
        comm.stage_whole_limit = 0           # from here every step goes device to device
        for n in (1, P - 1, 1000, 3 * P + 1):
            X = rng.standard_normal((P, n))
            be.reset_counters()
            comm.trace.clear()
            host.trace.clear()
            got = algs.ring_allreduce(X[comm.rank].copy(), comm)
            ref = algs.ring_allreduce(X[comm.rank].copy(), host)
            parallel_assert(np.array_equal(got, ref), f"n={n}: IPC ring differs from host ring")
            # 2(P-1) steps, each one copy into the outbox and one out of the left's (an
            # empty chunk, n < P, copies nothing)
            want = 4 * (P - 1) if n >= P else be.ipc_copies
            parallel_assert(be.ipc_copies == want and be.d2h_copies == 0,
                            f"n={n}: {be.ipc_copies} IPC copies, {be.d2h_copies} staged; "
                            f"want {want} and 0")
            mine = [(e.op, e.nbytes) for e in comm.trace.events]
            theirs = [(e.op, e.nbytes) for e in host.trace.events]
            parallel_assert(mine == theirs, f"n={n}: ledger {mine} != host ledger {theirs}")
    finally:
        comm.mpi.Free()
        host.mpi.Free()


def test_ipc_outbox_grows_and_peers_reopen_once():
    be = _fresh(min_bytes=4096)
    comm = Comm(WORLD.Dup(), name="b", backend=be)
    try:
        root = P - 1
        # 8-byte items into a 4096-byte outbox: a receiver opens the root's outbox with
        # the first message, and once more when 5000 items have made it grow
        for n, opens in ((16, 1), (400, 1), (400, 1), (5000, 2), (5000, 2), (16, 2)):
            buf = (np.arange(n, dtype=np.float64) + 7 if comm.rank == root
                   else np.zeros(n, dtype=np.float64))
            comm.bcast(buf, root=root)
            parallel_assert(np.array_equal(buf, np.arange(n, dtype=np.float64) + 7),
                            f"bcast of {n} items through IPC is wrong")
            want = 0 if comm.rank == root else opens
            parallel_assert(be.ipc_opens == want, f"{be.ipc_opens} opens after {n} items, "
                                                  f"want {want}")
        want_allocs = (2 if comm.rank == root else 0) if P > 1 else 0
        parallel_assert(be.ipc_allocs == want_allocs,
                        f"{be.ipc_allocs} outboxes, want {want_allocs}")
    finally:
        comm.mpi.Free()


def test_ipc_message_larger_than_the_receive_buffer_raises():
    box = ipc.Outbox(_fresh())
    small = np.zeros(3)
    hdr = ipc.header(b"x", 64, 0, 64)
    with pytest.raises(ValueError, match="does not fit"):
        box.fetch(hdr, small)


def test_ipc_header_round_trips():
    hdr = ipc.header(b"\x01" * 64, 1 << 40, 123, 456)
    assert hdr.nbytes == ipc.HEADER_BYTES
    assert ipc.parse_header(hdr) == (b"\x01" * 64, 1 << 40, 123, 456)


@pytest.mark.skipif(P < 2, reason="needs 2 ranks")
def test_ipc_sendrecv_pairs_and_cannon():
    """isendrecv (Cannon's shifts) and sendrecv with a partner: the IPC path, right."""
    be = _fresh()
    comm = Comm(WORLD.Dup(), name="pair", backend=be)
    try:
        r = comm.rank
        right, left = (r + 1) % P, (r - 1) % P
        send = np.full(9, float(r))
        recv = np.empty(9)
        comm.isendrecv(send, right, recv, left).wait()
        parallel_assert(np.all(recv == left), "isendrecv through IPC is wrong")
        comm.sendrecv(send * 2, right, recv, left)
        parallel_assert(np.all(recv == 2 * left), "sendrecv through IPC is wrong")
        parallel_assert(be.ipc_copies == 4 and be.d2h_copies == 0,
                        f"{be.ipc_copies} IPC copies, {be.d2h_copies} staged")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("root", sorted({0, P - 1, P // 2}))
def test_ipc_tree_reduce_equals_the_staged_tree_bit_for_bit(root):
    """The reduce goes up the same tree through the outboxes: the same sum, bitwise, as
    the staged tree's, with no staging copy."""
    be = _fresh()
    dev = Comm(WORLD.Dup(), name="red", backend=be)
    host = Comm(WORLD.Dup(), name="red")
    try:
        x = np.random.default_rng(10 + dev.rank).standard_normal((7, 5))
        want = np.empty_like(x) if dev.rank == root else None
        got = np.full_like(x, np.nan) if dev.rank == root else None
        host.reduce(x, want, root=root)
        dev.reduce(x, got, root=root)
        ok = dev.rank != root or np.array_equal(got, want)
        parallel_assert(ok, "the IPC tree reduce differs from the host tree")
        # a rank with children copies each child's partial sum out of its outbox, a rank
        # with a parent copies its own (partial) sum into its outbox
        children, parent = ipc.tree_links(dev.rank, P, root)
        want_copies = len(children) + (parent is not None)
        parallel_assert((be.ipc_copies, be.d2h_copies) == (want_copies, 0),
                        f"{be.ipc_copies} IPC copies, {be.d2h_copies} staged; want "
                        f"{want_copies} and 0")
        ev = [e for e in dev.trace.events if e.op == "reduce"]
        parallel_assert(len(ev) == 1 and ev[0].nbytes == x.nbytes, f"reduce ledger {ev}")
    finally:
        dev.mpi.Free()
        host.mpi.Free()
