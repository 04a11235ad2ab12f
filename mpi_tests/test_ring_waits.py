"""The trace tells which wait a sendrecv took: ``blocking`` for ``MPI_Sendrecv`` (below
``Comm.blocking_limit``), not for a request completed by the wait policy. The cost
model prices the two apart, so the flag must say what really ran."""

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
