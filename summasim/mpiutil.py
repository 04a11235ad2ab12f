"""MPI helpers: abort on error, collective verdicts, BLAS threads.

These use raw mpi4py communicators (untraced): they are bookkeeping, not part of
any algorithm's traffic.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

from mpi4py import MPI


@contextlib.contextmanager
def abort_on_error(comm=None):
    """Abort the whole job (``MPI_Abort``) on an unhandled exception in the block.

    The failing rank prints ``[rank r/p]`` and its traceback to stderr first, so
    a failure on one rank never leaves the others waiting in a collective.
    ``SystemExit`` passes through (argument errors exit on every rank alike).
    """
    comm = comm or MPI.COMM_WORLD
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - anything else must take the job down
        tb = traceback.format_exc()
        sys.stderr.write(f"[rank {comm.Get_rank()}/{comm.Get_size()}] unhandled exception, "
                         f"aborting the job:\n{tb}")
        sys.stderr.flush()
        comm.Abort(1)


def collective_verdict(ok: bool, comm=None) -> tuple[bool, list[int]]:
    """Agree on a verdict: ``(all ranks ok, ranks that were not)`` on every rank."""
    comm = comm or MPI.COMM_WORLD
    flags = comm.allgather(bool(ok))
    bad = [r for r, f in enumerate(flags) if not f]
    return not bad, bad


def max_over_ranks(value: float, comm=None) -> float:
    """The maximum of a float over all ranks (on every rank)."""
    comm = comm or MPI.COMM_WORLD
    return comm.allreduce(float(value), op=MPI.MAX)


def limit_blas_threads(n: int | None = None):
    """Limit BLAS/OpenMP threads of this process (default: 1 under MPI with p > 1).

    Returns the threadpoolctl controller (keep it alive) or ``None``.
    """
    from threadpoolctl import threadpool_limits

    if n is None:
        if MPI.COMM_WORLD.Get_size() == 1:
            return None
        n = 1
    return threadpool_limits(limits=int(n))
