"""``bench ring-steps``: where a ring all-reduce's time goes: per step, inside MPI and
outside. Each size is marked with the load of other processes while it ran (column
``load``; ``load`` and ``quiet`` in the JSON)."""

from __future__ import annotations

import statistics

import numpy as np

from .allreduce import preflight_sizes
from .common import add_json, add_repeats, add_sizes, message_buffers, repeats


def add_arguments(ap):
    from ..options import add_dtype

    add_sizes(ap)
    add_dtype(ap)
    add_repeats(ap)
    add_json(ap)


def preflight(args, world, gpu) -> str:
    return preflight_sizes("ring-steps", args, gpu)


def bench_ring_steps(world, sizes_mib, dtype, repeats: int, say,
                     huge: bool = True) -> list[dict]:
    """Where a ring all-reduce's time goes: one traced call split into each step's
    seconds inside MPI (the trace's sendrecv events) and the time outside them (adds,
    copies, Python), median over ``repeats`` calls (each rank's own time,
    :func:`~summasim.harness.timing.time_calls`) and then over the ranks (buffers as
    in :func:`~summasim.bench.allreduce.bench_allreduce`)."""
    from ..algorithms import ring_allreduce
    from ..backends import get_backend
    from ..comm import Comm
    from ..harness.load import LoadWatch, combine, mark, warning
    from ..harness.timing import time_calls
    from ..mpiutil import agreement

    p = world.Get_size()
    comm = Comm(world.Dup(), name="world")
    rows = []
    say(f"{'MiB':>8} {'call ms':>9} {'in MPI ms':>10} {'share':>6} {'outside ms':>11} "
        f"{'RS step ms':>11} {'(min-max)':>17} {'AG step ms':>11} {'(min-max)':>17}  load")
    watch = LoadWatch(world)
    try:
        for mib in sizes_mib:
            count = max(1, int(mib * 2**20) // np.dtype(dtype).itemsize)
            x, out = message_buffers(get_backend("numpy"), np.random.default_rng(
                world.Get_rank()).standard_normal(count).astype(dtype), huge)
            ring_allreduce(x, comm, out=out)
            steps = []
            watch.lap()
            with agreement(False):
                calls = time_calls(lambda: ring_allreduce(x, comm, out=out), world, repeats,
                                   adaptive=False, before=comm.trace.clear,
                                   after=lambda: steps.append(
                                       [e.seconds for e in comm.trace.events]))["times"]
            load = world.bcast(watch.lap(), root=0)
            mine = (statistics.median(calls), statistics.median(sum(st) for st in steps),
                    [statistics.median(st[i] for st in steps) for i in range(2 * (p - 1))])
            every = world.allgather(mine)
            call = statistics.median(e[0] for e in every)
            in_mpi = statistics.median(e[1] for e in every)
            per = [statistics.median(e[2][i] for e in every) for i in range(2 * (p - 1))]
            rs, ag = per[:p - 1] or [0.0], per[p - 1:] or [0.0]
            rows.append({"mib": mib, "call_seconds": call, "mpi_seconds": in_mpi,
                         "outside_seconds": call - in_mpi, "reduce_scatter_steps": rs,
                         "allgather_steps": ag, "load": load,
                         "quiet": load and load["quiet"]})
            say(f"{mib:>8g} {1e3 * call:>9.3f} {1e3 * in_mpi:>10.3f} "
                f"{in_mpi / call:>6.0%} {1e3 * (call - in_mpi):>11.3f} "
                f"{1e3 * statistics.median(rs):>11.3f} "
                f"{f'({1e3 * min(rs):.3f}-{1e3 * max(rs):.3f})':>17} "
                f"{1e3 * statistics.median(ag):>11.3f} "
                f"{f'({1e3 * min(ag):.3f}-{1e3 * max(ag):.3f})':>17}  {mark(load)}")
    finally:
        comm.mpi.Free()
    busy = [r for r in rows if r["quiet"] is False]
    line = warning(combine(r["load"] for r in busy),
                   f"{len(busy)} of {len(rows)} sizes were timed (rows marked BUSY)")
    if line:
        say(line)
    return rows


def run(bench) -> bool:
    """Rows under ``report["ring_steps"]`` (nothing is checked: True)."""
    from ..harness.report import mark_report

    args = bench.args
    rows = bench_ring_steps(bench.world, args.sizes_mib, np.dtype(args.dtype), repeats(args),
                            bench.say, not args.np_empty)
    bench.report["ring_steps"] = rows
    mark_report(bench.report, "ring_steps", [r["load"] for r in rows])
    return True
