"""The trace tells which wait a sendrecv took: ``blocking`` for a wait that does not
sleep (a ring step or a sendrecv below ``Comm.blocking_limit``, its receive polled with
``sched_yield``), not for a request completed by the wait policy. The cost model
prices the two apart, so the flag must say what really ran. Ring steps complete their
sends late (at the end of each half), which must never leave a buffer in use."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert
from summasim import algorithms as algs
from summasim.comm import Comm

P = WORLD.Get_size()


@pytest.mark.parametrize("n", [1, 3 * P + 1, 4096])
def test_ring_steps_are_flagged_by_the_path_they_took(n):
    comm = Comm(WORLD.Dup(), name="ring")
    try:
        chunk = -(-n // P) * 8                       # bytes of the largest chunk
        verdicts = []
        for limit in (0, chunk, chunk + 1, 1 << 40):
            comm.blocking_limit = limit
            comm.trace.clear()
            x = np.full(n, float(WORLD.Get_rank() + 1))
            y = algs.ring_allreduce(x, comm)
            ev = comm.trace.events
            # the whole loop blocks below the limit (Comm.exchanger); above it each step
            # decides by its own size (Comm.sendrecv: uneven chunks may differ)
            want = [chunk < limit or e.nbytes < limit for e in ev]
            verdicts.append(bool(np.all(y == P * (P + 1) / 2))
                            and len(ev) == 2 * (P - 1)
                            and [e.op for e in ev] == ["sendrecv"] * len(ev)
                            and [e.blocking for e in ev] == want)
        parallel_assert(all(verdicts), f"n={n}: {verdicts}")
    finally:
        comm.mpi.Free()


def test_sendrecv_flags_its_path():
    comm = Comm(WORLD.Dup(), name="world")
    try:
        src, dst = comm.shift_ranks(1)
        flags = []
        for limit in (0, 1 << 20):
            comm.blocking_limit = limit
            comm.trace.clear()
            recv = np.empty(4)
            comm.sendrecv(np.full(4, float(comm.rank)), dst, recv, src)
            flags.append((recv[0] == src, [e.blocking for e in comm.trace.events]))
        parallel_assert(flags == [(True, [False]), (True, [True])], f"{flags}")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("how", ["rule", "fixed"])
def test_napping_ring_steps_sum_right_and_are_exchanger_steps(how):
    """Napping steps poll a few times and then nap between polls (many ranks per core,
    long steps): by the rule from ``Comm.nap_limit`` bytes, or every step with
    ``ring_wait = "nap"``. The sum must be the same, and each step is still one traced
    exchanger step (``blocking``: the receive alone awaited), which the cost model
    prices apart from a request completed by the wait policy."""
    comm = Comm(WORLD.Dup(), name="ring")
    try:
        n = 3 * P + 1
        verdicts = []
        for nap_limit, fixed in ((0, "nap"), (1 << 62, "yield")):
            comm.nap_limit = nap_limit
            comm.ring_wait = "rule" if how == "rule" else fixed
            comm.trace.clear()
            x = np.full(n, float(WORLD.Get_rank() + 1))
            y = algs.ring_allreduce(x, comm)
            ev = comm.trace.events
            verdicts.append(bool(np.all(y == P * (P + 1) / 2))
                            and len(ev) == 2 * (P - 1)
                            and all(e.blocking for e in ev))
        parallel_assert(all(verdicts), f"{verdicts} (policy {comm.wait_policy})")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("nap", [False, True], ids=["yield", "nap"])
@pytest.mark.parametrize("half", ["reduce_scatter", "allgather", "allreduce"])
def test_buffers_are_free_when_a_ring_returns(half, nap):
    """Ring steps wait for their receive only and complete their sends at the end of
    each half (``Comm.exchanger``'s ``finish``): once a half returns, no send may still
    read the caller's buffer. Each rank overwrites everything it sent with NaN straight
    after the call; the receivers must still hold the right values. Chunks of 256 KiB
    go by rendezvous (the receiver copies from the sender's memory late), so a send
    left in flight would show up as NaN on a neighbour."""
    n = P * (1 << 15)                                  # 256 KiB of float64 per chunk
    rank = WORLD.Get_rank()
    comm = Comm(WORLD.Dup(), name="ring")
    comm.ring_wait = "nap" if nap else "yield"
    try:
        ok = True
        for _ in range(5):
            x = np.full(n, float(rank + 1))
            if half == "reduce_scatter":
                own = algs.ring_reduce_scatter(x, comm)
                lo, hi = algs.chunk_bounds(n, P)[own]
                got = x[lo:hi].copy()
                x[:] = np.nan
                ok &= bool(np.all(got == P * (P + 1) / 2))
            elif half == "allgather":
                lo, hi = algs.chunk_bounds(n, P)[(rank + 1) % P]
                x[:] = np.nan
                x[lo:hi] = rank
                algs.ring_allgather(x, comm)
                got = x.copy()
                x[:] = np.nan
                want = np.concatenate([np.full(b - a, float((c - 1) % P))
                                       for c, (a, b) in enumerate(algs.chunk_bounds(n, P))])
                ok &= bool(np.array_equal(got, want))
            else:
                y = algs.ring_allreduce(x, comm)
                x[:] = np.nan
                got = y.copy()
                y[:] = np.nan
                ok &= bool(np.all(got == P * (P + 1) / 2))
            WORLD.Barrier()
        parallel_assert(ok, f"{half}: a buffer was still being read after the ring returned")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("wait", ["spin", "sleep", "yield"])
def test_ring_sums_and_traces_alike_under_every_wait_policy(wait):
    """Each policy takes its own step ("spin": one blocking MPI_Sendrecv; "sleep" and
    "yield": the receive polled, the sends completed at the end of each half): the same
    sums, in place and out of place, through the halves too, and the same trace, one
    blocking sendrecv per step carrying exactly its chunk's bytes. The ring's steps wait
    by the policy's rule here (``ring_wait = "rule"``), not by what they measure."""
    comm = Comm(WORLD.Dup(), name="ring", wait=wait)
    comm.ring_wait = "rule"
    try:
        ok = []
        for n in sorted({0, 1, P + 1, 5000}):
            x = np.arange(n, dtype=np.int64) * (comm.rank + 1)
            want = np.arange(n, dtype=np.int64) * (P * (P + 1) // 2)
            comm.trace.clear()
            out = algs.ring_allreduce(x, comm, out=np.empty_like(x))
            ev = comm.trace.events
            sent = [e.nbytes for e in ev]
            bounds = algs.chunk_bounds(n, P)
            r = comm.rank
            chunks = ([(bounds[(r - s) % P][1] - bounds[(r - s) % P][0]) * 8
                       for s in range(P - 1)]
                      + [(bounds[(r + 1 - s) % P][1] - bounds[(r + 1 - s) % P][0]) * 8
                         for s in range(P - 1)])
            inplace = x.copy()
            algs.ring_allreduce(inplace, comm, out=inplace)
            flat = x.copy()
            own = algs.ring_reduce_scatter(flat, comm)
            lo, hi = bounds[own]
            half_ok = np.array_equal(flat[lo:hi], want[lo:hi])
            algs.ring_allgather(flat, comm)
            ok.append(np.array_equal(out, want) and np.array_equal(inplace, want) and half_ok
                      and np.array_equal(flat, want) and sent == chunks
                      and all(e.op == "sendrecv" and e.blocking for e in ev))
        parallel_assert(all(ok), f"wait={wait}: {ok}")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("kind", ["host-spin", "host-yield", "policy-path", "staged"])
def test_a_dropped_comm_is_freed_after_a_ring(kind):
    """``Comm.exchanger`` keeps its host-array pairs on the Comm; they must not refer
    back to it, nor may any other path leave a cycle: a Comm dropped after a ring call
    (``ring_allreduce(x, MPI.COMM_WORLD)`` wraps a fresh one each call) is freed at once
    by reference counting, with its workspaces, not whenever the cycle collector runs."""
    import gc
    import weakref

    from summasim.backends import StagedHostBackend

    wait = "spin" if kind == "host-spin" else "yield"
    be = StagedHostBackend() if kind == "staged" else None
    gc.disable()
    try:
        comm = Comm(WORLD.Dup(), name="ring", backend=be, wait=wait)
        comm.ring_wait = "rule"
        if kind == "policy-path":
            comm.blocking_limit = 0
        comm.stage_whole_limit = 0                  # staged: every step through the Comm
        x = np.arange(5000.0) * (comm.rank + 1)
        y = algs.ring_allreduce(x, comm)
        own = algs.ring_reduce_scatter(x.copy(), comm)
        mpi, ref = comm.mpi, weakref.ref(comm)
        del comm
        alive = ref() is not None
        mpi.Free()
    finally:
        gc.enable()
    parallel_assert(np.array_equal(y, np.arange(5000.0) * P * (P + 1) / 2)
                    and own == (WORLD.Get_rank() + 1) % P, f"{kind}: wrong sum")
    parallel_assert(not alive, f"{kind}: the Comm outlived its last reference (a cycle)")


def test_a_kept_exchanger_whose_loop_never_finished_is_replaced():
    """A loop that raised between ``step`` and ``finish`` leaves sends pending in its
    pair; the next loop of that kind gets a fresh pair (and keeps it), so it never waits
    on another loop's sends."""
    skip = P < 2
    comm = Comm(WORLD.Dup(), name="ring", wait="yield")
    try:
        right, left = (comm.rank + 1) % P, (comm.rank - 1) % P
        buf, recv = np.full(4, float(comm.rank)), np.empty(4)
        step, finish = comm.exchanger(buf, buf.nbytes)
        same = comm.exchanger(buf, buf.nbytes)[0] is step      # kept while nothing pends
        if not skip:
            step(buf, right, recv, left)                       # its send still pending
        step2, finish2 = comm.exchanger(buf, buf.nbytes)
        finish()
        again = comm.exchanger(buf, buf.nbytes)[0]
        parallel_assert(same and (skip or (step2 is not step and again is step2
                                           and recv[0] == left)),
                        f"kept {same}, fresh {step2 is not step}, then kept {again is step2}")
    finally:
        comm.mpi.Free()


def test_ranks_waiting_for_rank_0s_long_work_leave_it_the_cores():
    """While rank 0 works for 1.5 s (a benchmark's ceiling, a serial reference), the
    others wait in quiet_bcast: their naps grow to LONG_WAIT_NAP_S, so together they
    take a few percent of one core, not the cores rank 0 measures with (naps of 20 us
    took about a tenth of a core per waiting rank, and the ceiling of bench gemm read
    7-8 GFLOP/s against 58-68 at p = 16)."""
    import time

    from summasim.bench.common import quiet_bcast

    if WORLD.rank == 0:
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:        # the long work
            pass
        quiet_bcast(WORLD, "done")
        used = 0.0
    else:
        c0 = time.process_time()
        assert quiet_bcast(WORLD, None) == "done"
        used = time.process_time() - c0
    total = WORLD.allreduce(used)
    parallel_assert(total < 0.05 * 1.5 * max(1, WORLD.size - 1),
                    f"the waiting ranks used {total:.3f} s of CPU in 1.5 s")


def _slowed(comm, mode: str, on_rank: int, seconds: float):
    """Make every ring step of ``mode`` on ``on_rank`` take ``seconds`` longer (the
    other ranks' steps wait for it through the ring)."""
    import time

    make = comm._new_exchanger

    def new(like, nbytes, tag, m):
        step, finish, pending, _ = make(like, nbytes, tag, m)
        if m != mode or comm.rank != on_rank:
            return step, finish, pending, False

        def slow(*a):
            time.sleep(seconds)
            return step(*a)
        return slow, finish, pending, False
    comm._new_exchanger = new


def test_every_rank_agrees_on_the_measured_mode_and_avoids_a_slow_one():
    """Under ``ring_wait = "auto"`` the first call of a size class tries every mode on
    scratch rings, untraced, then every rank takes the same one, by the slowest rank's
    times: a mode slowed on one rank only is never chosen. The sums are right, and
    every call (the first included) traces only its own steps."""
    comm = Comm(WORLD.Dup(), name="ring")
    comm.ring_wait = "auto"
    _slowed(comm, "yield", 0, 0.002)
    try:
        ok, counts = True, []
        n = 4 * P + 3
        for i in range(3):
            comm.trace.clear()
            x = np.full(n, float(comm.rank + 1))
            y = algs.ring_allreduce(x, comm)
            ok &= bool(np.all(y == P * (P + 1) / 2))
            counts.append(len(comm.trace.events))
        chunk = -(-n // P) * 8
        mine = comm.ring_waits.decided(chunk)
        every = WORLD.allgather(mine)
        parallel_assert(ok and counts == [2 * (P - 1)] * 3, f"sums {ok}, steps per call {counts}")
        # one rank sends nothing, so it measures nothing
        parallel_assert(len(set(every)) == 1 and (mine is None if P == 1
                                                  else mine in ("blocking", "nap")),
                        f"modes agreed over the ranks: {every}")
    finally:
        comm.mpi.Free()


def test_rings_on_a_plain_communicator_share_their_measurements():
    """``ring_allreduce(x, raw)`` wraps ``raw`` anew each call; the measurement is kept
    on the communicator (an MPI attribute), so its first call settles the class for the
    later ones, as a Comm's does."""
    from summasim import ringwait as rw

    raw = WORLD.Dup()
    try:
        x = np.arange(1000.0)
        y = algs.ring_allreduce(x, raw)
        decided = rw.waits_of(raw).decided(-(-1000 // P) * 8)
        parallel_assert((decided is None if P == 1 else decided in rw.MODES)
                        and np.array_equal(y, x * P),
                        f"decided {decided!r}")
    finally:
        raw.Free()


def test_point_to_point_exchanges_wait_by_the_rule_and_start_no_trials():
    """Only ring calls are collective over the communicator, which the agreement needs:
    a ``sendrecv`` between two ranks never runs the trials."""
    comm = Comm(WORLD.Dup(), name="world")
    try:
        src, dst = comm.shift_ranks(1)
        recv = np.empty(8)
        for _ in range(20):
            comm.sendrecv(np.full(8, float(comm.rank)), dst, recv, src)
        parallel_assert(recv[0] == src and not comm.ring_waits.chosen,
                        "a sendrecv ran the trials")
    finally:
        comm.mpi.Free()


def test_ranks_with_different_wait_policies_run_the_same_trials(monkeypatch):
    """The wait policy is a rank's own (it may differ between nodes: "sleep" where the
    node is oversubscribed), and "spin" lifts the blocking limit on its rank only; with
    SUMMASIM_BLOCKING_BYTES set, the ring trials must still run on every rank or on
    none, else the spinning rank's trial steps meet the others' real ones (wrong sums,
    a hang)."""
    from summasim import comm as comm_mod

    limit = 256
    monkeypatch.setattr(comm_mod, "BLOCKING_SENDRECV_BYTES", limit)
    comm = Comm(WORLD.Dup(), name="ring", wait="spin" if WORLD.Get_rank() == 0 else "sleep")
    comm.ring_wait = "auto"
    try:
        ok = True
        for n in (10 * P, 1000 * P):                 # steps below and above the limit
            x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
            y = algs.ring_allreduce(x, comm)
            ok &= bool(np.array_equal(y, np.arange(n) * (P * (P + 1) / 2)))
            ok &= bool(np.array_equal(algs.ring_allreduce(x, comm), y))
        every = WORLD.allgather(sorted(comm.ring_waits.chosen))
        parallel_assert(ok and all(e == every[0] for e in every),
                        f"sums {ok}; size classes settled per rank {every}")
    finally:
        comm.mpi.Free()


def test_a_larger_work_buffer_on_one_rank_changes_nothing():
    """``work`` needs room for the largest chunk; more room on one rank only must not
    change which size class (and so which trials) its ring steps take."""
    n = 1000
    need = -(-n // P)
    raw = WORLD.Dup()
    try:
        flat = np.full(n, float(WORLD.Get_rank() + 1))
        work = np.empty(need * (8 if WORLD.Get_rank() == 0 else 1))
        own = algs.ring_reduce_scatter(flat, raw, work=work)
        lo, hi = algs.chunk_bounds(n, P)[own]
        parallel_assert(np.all(flat[lo:hi] == P * (P + 1) / 2),
                        f"chunk {own} of the reduce-scatter")
    finally:
        raw.Free()
