"""Executors: one per kind of run. Each builds its grid and backend, makes this
rank's own inputs (:mod:`~summasim.harness.data`), makes the traced call, optionally
corrupts the output (:mod:`~summasim.harness.inject`), checks it without any global
operand (:mod:`~summasim.harness.check`), times it (:mod:`~summasim.harness.timing`)
and returns a :class:`Result` that is the same on every rank (the per-rank event
summaries are gathered on rank 0 only, for the cost model).

``run_case(case, world, backend, ...)`` dispatches on the case's kind.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from ..comm import Comm
from summasim.costmodel.tools.accuracy import event_summary
from ..grid import Grid
from ..layout import block_slices, grid_numbers
from ..mpiutil import agreement, doing
from .check import check_product, check_ring, collective, ring_input
from .data import STREAM_A, STREAM_B, uniform_block
from .inject import Fault, corrupt_entry, drop_panel, drop_summand, perturb_product
from .memory import peak_rss_bytes
from .result import Result
from .timing import reduce_max, time_calls
from .transformer import run_transformer


@contextlib.contextmanager
def _phases():
    """``with _phases() as phase``: ``phase(what)`` sets :func:`~summasim.mpiutil.doing`
    to what the caller was doing, followed by the phase (the heartbeat and the last
    words say it); on leaving, ``doing()`` is the caller's again, so that the next run
    of a caller that does not set it (the self-test, bench gemm, the accuracy worker)
    does not pile one phase on another."""
    base = doing()
    try:
        yield lambda what: doing(f"{base}: {what}")
    finally:
        doing(base)


def _time(call, backend, trace, world, repeats: int, timed: bool, phase) -> dict:
    """Time ``call`` with the trace off and without the input agreement (the checked,
    traced call before it agreed on these very inputs); ``{}`` when not ``timed``."""
    if not timed:
        return {}
    trace.enabled = False
    calls = [0]

    def run():
        call()
        backend.synchronize()

    def count():
        calls[0] += 1
        phase(f"timed call {calls[0]}")

    with agreement(False):
        return time_calls(run, world, repeats, before=count)


def _traffic(world, events) -> tuple[int, int, list | None]:
    mx = reduce_max(world, [sum(e.nbytes for e in events), len(events)])
    return int(mx[0]), int(mx[1]), world.gather(event_summary(events), root=0)


def run_product(case, world, backend, *, repeats: int = 3, seed: int = 0,
                method: str = "auto", fault: Fault | None = None, timed: bool = True) -> Result:
    """Validate (and time) one distributed product (collective over ``world``)."""
    with _phases() as phase:
        return _run_product(case, world, backend, phase, repeats, seed, method, fault, timed)


def _run_product(case, world, backend, phase, repeats, seed, method, fault, timed) -> Result:
    spec = case.spec
    rank, p = world.Get_rank(), world.Get_size()
    dtype = np.dtype(case.dtype)
    sa, sb = spec.stored_shapes(case.m, case.k, case.n)
    grid = Grid(world, case.q, case.d, backend=backend, pc=case.cols)
    try:
        phase("making this rank's blocks")
        g = grid_numbers(grid)
        # SD 2.5D reads A and B on layer 0 only and broadcasts them over the depth:
        # the layers above hold placeholders of the blocks' shapes and no memory
        unread = case.algorithm == "sd25_ab" and grid.depth.rank > 0
        a, b = (_operand(backend, seed, stream, shape, layout, g, dtype, unread)
                for stream, shape, layout in ((STREAM_A, sa, spec.layout_a),
                                              (STREAM_B, sb, spec.layout_b)))
        fn = spec.fn
        phase("the traced call")
        # the traced, validated call finds the global sizes from the blocks (an
        # all-gather of their shapes, untraced); the timed calls are told them
        c = fn(a, b, grid)
        if spec.any_size:
            fn = functools.partial(spec.fn, sizes=case.shapes)
        backend.synchronize()
        events = list(grid.trace.events)
        coords = list(grid.coords)
        mine = fault is not None and fault.rank == rank
        host = backend.to_numpy(c)             # the check reads it (copied only to corrupt)
        if mine:
            host = np.array(host, copy=True)
            _corrupt_product(host, case, g, seed, fault)
        applied = _applied(world, fault, not mine or (host.size > 0 and (
            fault.kind != "drop" or case.k > 0)))
        phase("the check")
        chk = collective(world, check_product(host, case, g, seed, method))
        del host
        timing = _time(lambda: fn(a, b, grid, out=c), backend, grid.trace, world, repeats,
                       timed, phase)
        nbytes, msgs, summaries = _traffic(world, events)
        coords_all = world.gather(coords, root=0)
    finally:
        grid.free()
    rss = int(reduce_max(world, [peak_rss_bytes()])[0])
    return Result(case, p, chk, timing, nbytes, msgs, rss, summaries, coords_all,
                  str(fault) if fault else "", fault_applied=applied)


def _operand(backend, seed, stream, shape, layout, g, dtype, unread: bool):
    """This rank's block of one operand; when the product does not read it
    (``unread``), a read-only placeholder of the block's shape that holds no memory."""
    rows, cols = block_slices(shape, layout, g)
    if unread:
        xp = backend.xp
        return xp.broadcast_to(xp.zeros((), dtype=dtype),
                               (rows.stop - rows.start, cols.stop - cols.start))
    return backend.asarray(uniform_block(seed, stream, shape, rows, cols, dtype))


def _applied(world, fault, mine_ok: bool) -> bool:
    """Whether ``fault`` corrupted something on its rank (collective; True without one)."""
    return fault is None or all(world.allgather(bool(mine_ok)))


def _corrupt_product(host, case, g, seed, fault):
    if fault.kind == "drop":      # the block misses the summand of its first k-panel
        drop_panel(host, case, g, seed)
    elif fault.kind in ("perturb", "drift"):     # no replicas: drift perturbs
        perturb_product(host, case, g, seed)
    else:
        corrupt_entry(host, fault.kind)


def run_ring(case, world, backend, *, repeats: int = 3, seed: int = 0,
             fault: Fault | None = None, timed: bool = True, method: str = "exact") -> Result:
    """Validate (and time) ``ring_allreduce`` over all of ``world`` (collective)."""
    with _phases() as phase:
        return _run_ring(case, world, backend, phase, repeats, seed, fault, timed)


def _run_ring(case, world, backend, phase, repeats, seed, fault, timed) -> Result:
    from ..algorithms import ring_allreduce

    rank, p = world.Get_rank(), world.Get_size()
    dtype = np.dtype(case.dtype)
    comm = Comm(world.Dup(), name="world", backend=backend)
    try:
        phase("the traced call")
        x = backend.empty_huge((case.n,), dtype)     # page backing as in the bench
        x[...] = backend.asarray(ring_input(seed, rank, case.n, dtype))
        y = ring_allreduce(x, comm)
        backend.synchronize()
        events = list(comm.trace.events)
        host = np.array(backend.to_numpy(y), copy=True)
        if fault is not None and fault.rank == rank:
            if fault.kind == "drop":          # the result misses the next rank's input
                drop_summand(host, seed, rank, p)
            else:
                corrupt_entry(host, fault.kind)
        applied = _applied(world, fault, host.size > 0)
        phase("the check")
        chk = collective(world, check_ring(host, case, p, seed))
        del host
        out = backend.empty_huge(x.shape, x.dtype) if timed else None
        timing = _time(lambda: ring_allreduce(x, comm, out=out), backend, comm.trace, world,
                       repeats, timed, phase)
        nbytes, msgs, summaries = _traffic(world, events)
        coords_all = world.gather([rank], root=0)
    finally:
        comm.mpi.Free()
    rss = int(reduce_max(world, [peak_rss_bytes()])[0])
    return Result(case, p, chk, timing, nbytes, msgs, rss, summaries, coords_all,
                  str(fault) if fault else "", fault_applied=applied)


def run_case(case, world, backend, **kw) -> Result:
    """Run any case (dispatch on its kind)."""
    if case.kind == "matmul":
        return run_product(case, world, backend, **kw)
    if case.kind == "ring":
        return run_ring(case, world, backend, **kw)
    if case.kind == "transformer":
        kw.pop("method", None)
        return run_transformer(case, world, backend, **kw)
    if case.kind == "mesh":
        from .composed import run_mesh

        kw.pop("method", None)
        kw.pop("with_memory", None)
        return run_mesh(case, world, backend, **kw)
    raise ValueError(f"unknown case kind {case.kind!r}")

