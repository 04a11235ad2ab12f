"""The GPU staging path, exercised on the CPU with the staged-host backend.

Every array handed to MPI goes through a reusable host buffer: one copy out per
sent buffer, one copy back per received buffer, a stream synchronization before
each MPI call, and no new buffers once the pool is warm.
"""

from __future__ import annotations

from contextlib import nullcontext

import contextlib

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim import algorithms as algs
from summasim import layout
from summasim.backends import StagedHostBackend
from summasim.comm import Comm
from summasim.grid import Grid

P = WORLD.Get_size()


@contextlib.contextmanager
def _staged_and_host(whole: bool):
    """``(backend, staged communicator, host communicator)`` over WORLD; the staged one
    stages small vectors whole (``whole``) or every step's chunk (limit 0)."""
    be = StagedHostBackend()
    comm = Comm(WORLD.Dup(), name="ring", backend=be)
    if not whole:
        comm.stage_whole_limit = 0
    host = Comm(WORLD.Dup(), name="host")
    try:
        yield be, comm, host
    finally:
        comm.mpi.Free()
        host.mpi.Free()


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_staged_summa_equals_host_and_counts_copies(q, d):
    be = StagedHostBackend()
    rng = np.random.default_rng(5)
    A, B = rng.standard_normal((3 * q * d, 2 * q)), rng.standard_normal((2 * q, 4 * q))
    with Grid(WORLD, q, d) as host, Grid(WORLD, q, d, backend=be) as staged:
        a, b = layout.split(A, host, "2d"), layout.split(B, host, "2d")
        want = algs.summa_ab(a, b, host)
        be.reset_counters()
        got = algs.summa_ab(a, b, staged)
        # rank (i, j) is the root of one row and one column broadcast, receives the rest
        exp_d2h, exp_h2d = (2, 2 * (q - 1)) if q > 1 else (0, 0)
        counts = (be.d2h_copies, be.h2d_copies, be.syncs)
        allocs = be.pinned_allocs
        for _ in range(3):
            got2 = algs.summa_ab(a, b, staged)
        parallel_assert(np.array_equal(got, want) and np.array_equal(got2, want),
                        "staged result differs from the host path")
        parallel_assert(counts == (exp_d2h, exp_h2d, 2 * q if q > 1 else 0),
                        f"copies/syncs {counts}, expected ({exp_d2h}, {exp_h2d}, {2 * q})")
        parallel_assert(be.pinned_allocs == allocs and allocs <= 4,
                        f"staging buffers not reused: {allocs} then {be.pinned_allocs}")


def test_staged_ring_and_reduce():
    be = StagedHostBackend()
    comm = Comm(WORLD.Dup(), name="ring", backend=be)
    try:
        X = np.random.default_rng(2).standard_normal((P, 11))
        # a small vector is staged whole: one copy out, the host ring, one copy back
        y = algs.ring_allreduce(X[comm.rank].copy(), comm)
        whole = (1, 1) if P > 1 else (0, 0)
        parallel_assert(np.allclose(y, X.sum(0), rtol=0, atol=1e-13)
                        and (be.d2h_copies, be.h2d_copies) == whole,
                        f"ring staged whole: copies {(be.d2h_copies, be.h2d_copies)}, "
                        f"want {whole}")
        # at or past the limit, every step stages its chunk: a copy each way per sendrecv
        be.reset_counters()
        comm.stage_whole_limit = X[0].nbytes
        y = algs.ring_allreduce(X[comm.rank].copy(), comm)
        nsr = 2 * (P - 1)
        parallel_assert(np.allclose(y, X.sum(0), rtol=0, atol=1e-13)
                        and (be.d2h_copies, be.h2d_copies) == (nsr, nsr),
                        f"ring staged: copies {(be.d2h_copies, be.h2d_copies)}, want {nsr} each")
        be.reset_counters()
        buf = X[comm.rank].copy()
        comm.allreduce(buf)                      # in place: staged once each way
        out = np.empty(11) if comm.rank == 0 else None
        comm.reduce(X[comm.rank].copy(), out, root=0)
        ok = np.allclose(buf, X.sum(0), rtol=0, atol=1e-13)
        if comm.rank == 0:
            ok = ok and np.allclose(out, X.sum(0), rtol=0, atol=1e-13)
        # in-place allreduce: one copy each way; tree reduce: a rank sends its partial
        # once (not the root) and receives one buffer per child in the binomial tree
        rel, children, mask = comm.rank, 0, 1
        while mask < P and not rel & mask:
            children += rel + mask < P
            mask <<= 1
        want = (1 + (comm.rank != 0), 1 + children) if comm.reduce_algorithm == "tree" \
            else ((2, 2) if comm.rank == 0 else (2, 1))
        parallel_assert(ok and (be.d2h_copies, be.h2d_copies) == want,
                        f"allreduce+reduce copies {(be.d2h_copies, be.h2d_copies)} != {want}")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("n", sorted({1, max(P - 1, 1), 1000}))
@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
@pytest.mark.parametrize("whole", [True, False], ids=["staged-whole", "staged-per-step"])
def test_staged_ring_takes_exchanger_steps_and_returns_its_buffers(n, dtype, whole):
    """A staged ring (what CuPy without a CUDA-aware MPI does), staged whole (small
    vectors) or chunk by chunk, steps like the host ring: every step an exchanger step
    (the receive polled, sends completed together at the end) traced on the caller's
    communicator, the same sums bit for bit, and every staging buffer back in the pool
    when the call returns, so a second call allocates none."""
    from summasim.comm import _staging_for

    with _staged_and_host(whole) as (be, comm, host):
        x = (np.random.default_rng(comm.rank).standard_normal(n) * 100).astype(dtype)
        want = algs.ring_allreduce(x, host)
        got = algs.ring_allreduce(x, comm)
        allocs = be.pinned_allocs
        comm.trace.clear()
        got2 = algs.ring_allreduce(x, comm)
        steps = [e for e in comm.trace.events if e.op == "sendrecv"]
        chunk = -(-n // P) * x.itemsize
        parallel_assert(np.array_equal(got, want) and np.array_equal(got2, want),
                        "staged ring differs from the host ring")
        parallel_assert(len(steps) == 2 * (P - 1)
                        and all(e.group == "ring" for e in steps),
                        f"{len(steps)} steps traced ({ {e.group for e in steps} })")
        copies = (1, 1) if whole and P > 1 else (2 * (P - 1), 2 * (P - 1))
        before = (be.d2h_copies, be.h2d_copies)
        algs.ring_allreduce(x, comm)
        made = (be.d2h_copies - before[0], be.h2d_copies - before[1])
        parallel_assert(made == copies, f"copies {made}, want {copies}")
        parallel_assert(chunk >= comm.blocking_limit or all(e.blocking for e in steps),
                        "staged ring steps did not take the exchanger")
        parallel_assert(be.pinned_allocs == allocs
                        and len(_staging_for(be).free) == allocs,
                        f"staging buffers: {allocs} allocated by the first call, "
                        f"{be.pinned_allocs} after the second, "
                        f"{len(_staging_for(be).free)} back in the pool")


class _DirectHost(StagedHostBackend):
    """NumPy arrays handed to MPI as a CUDA-aware MPI takes device arrays ("direct"):
    no staging copies, a stream synchronization before each MPI call (counted)."""

    name = "direct-host"
    comm_mode = "direct"


def test_bench_contenders_in_every_mode_sum_alike_and_sync_before_mpi():
    """``bench allreduce``'s contenders on host, staged and direct arrays: the same
    sums (the in-place ones in their own buffer, refilled), the staged baselines copy
    the whole vector once each way, and in direct mode the plain in-place ring
    synchronizes the stream before each of its 2(P-1) steps."""
    from summasim.backends import get_backend
    from summasim.bench.allreduce import HALVES, IN_PLACE, _contenders

    rank = WORLD.Get_rank()
    x = np.random.default_rng(rank).standard_normal(37)
    want = np.empty_like(x)
    WORLD.Allreduce(x, want)
    for be in (get_backend("numpy"), StagedHostBackend(), _DirectHost()):
        comm, raw = Comm(WORLD.Dup(), name="ring", backend=be), WORLD.Dup()
        try:
            out, y = np.empty_like(x), np.empty_like(x)
            calls, held = _contenders(be, comm, raw, x, out, y)
            halves = {k for pair in HALVES.values() for k in pair}   # timed with bounds only
            parallel_assert(set(calls) == {"ring", "mpi", "inplace", "plain", "call"}
                            and IN_PLACE == {"inplace", "plain"} | halves,
                            f"contenders {set(calls)}, in place {set(IN_PLACE)}")
            for name, call in calls.items():
                out[...] = np.nan
                y[...] = x if name in IN_PLACE else np.nan
                if be.comm_mode != "host":
                    be.reset_counters()
                call()
                got = (held["call"] if name == "call"      # the plain call's own
                       else y if name in IN_PLACE else out)
                parallel_assert(name in IN_PLACE or np.isnan(y).all(),
                                f"{be.name} {name}: wrote the in-place buffer")
                parallel_assert(np.allclose(np.asarray(got), want, rtol=0, atol=1e-12),
                                f"{be.name} {name}: wrong sum on rank {rank}")
                if be.comm_mode == "staged" and name in ("mpi", "plain"):   # the baselines
                    parallel_assert((be.d2h_copies, be.h2d_copies) == (1, 1),
                                    f"{name}: {(be.d2h_copies, be.h2d_copies)} copies")
                if be.comm_mode == "direct" and name == "plain":
                    parallel_assert(be.syncs == 2 * (P - 1) + 2 and be.d2h_copies == 0,
                                    f"plain ring, direct: {be.syncs} syncs")
        finally:
            comm.mpi.Free()
            raw.Free()


class _FakeDevice(StagedHostBackend):
    """A device backend whose own arrays would be staged; NumPy arrays are not its own
    (``is_device_array`` is false for them), as host arrays are not CuPy's."""

    name = "fake-device"
    on_device = True


def test_host_arrays_on_a_device_communicator_go_to_mpi_as_they_are():
    """A loss, a size or a host copy sent over a device backend's communicator (the
    Grid and Mesh communicators of a CuPy run) reaches MPI as it is: no staging copy
    (CuPy's copy would call ``.get()`` on a NumPy array and raise)."""
    be = _FakeDevice()
    comm = Comm(WORLD.Dup(), name="world", backend=be)
    try:
        buf = np.full(3, float(comm.rank + 1))
        comm.allreduce(buf)
        x = np.arange(7.0) * (comm.rank + 1)
        y = algs.ring_allreduce(x, comm)
        total = P * (P + 1) / 2
        parallel_assert(np.array_equal(buf, np.full(3, total))
                        and np.array_equal(y, np.arange(7.0) * total),
                        "host sums over a device communicator are wrong")
        parallel_assert((be.d2h_copies, be.h2d_copies, be.pinned_allocs) == (0, 0, 0),
                        f"host arrays were staged: {(be.d2h_copies, be.h2d_copies)} copies")
    finally:
        comm.mpi.Free()


@pytest.mark.parametrize("n", sorted({1, max(P - 1, 1), 1000}))
@pytest.mark.parametrize("whole", [True, False], ids=["staged-whole", "staged-per-step"])
def test_staged_ring_halves_equal_the_host_halves_and_count_copies(n, whole):
    """ZeRO's reduce-scatter and all-gather on a staged path: below the limit each half
    runs on one host copy (one copy out, one back), at or past it every step stages its
    chunk (a copy each way per sendrecv); either way the same values as the host halves
    bit for bit, P - 1 exchanger steps traced per half, and the staging buffers back in
    the pool."""
    from summasim.algorithms.allreduce import (ring_allgather_unchecked,
                                               ring_reduce_scatter_unchecked)
    from summasim.comm import _staging_for

    with _staged_and_host(whole) as (be, comm, host):
        x = np.random.default_rng(comm.rank).standard_normal(n)
        want_rs, got_rs = x.copy(), x.copy()
        own = ring_reduce_scatter_unchecked(want_rs, host)
        comm.trace.clear()
        got_own = ring_reduce_scatter_unchecked(got_rs, comm)
        rs_copies, rs_steps = (be.d2h_copies, be.h2d_copies), len(comm.trace.events)
        allocs = be.pinned_allocs
        want_ag, got_ag = want_rs.copy(), want_rs.copy()
        ring_allgather_unchecked(want_ag, host)
        comm.trace.clear()
        be.reset_counters()
        returned = ring_allgather_unchecked(got_ag, comm)
        ag_copies, ag_steps = (be.d2h_copies, be.h2d_copies), len(comm.trace.events)
        parallel_assert(got_own == own and np.array_equal(got_rs, want_rs)
                        and np.array_equal(got_ag, want_ag) and returned is got_ag,
                        "staged halves differ from the host halves")
        want = ((1, 1) if whole else (P - 1, P - 1)) if P > 1 else (0, 0)
        parallel_assert(rs_copies == want and ag_copies == want,
                        f"copies: reduce-scatter {rs_copies}, all-gather {ag_copies}, "
                        f"want {want} each")
        parallel_assert(rs_steps == P - 1 and ag_steps == P - 1,
                        f"{rs_steps} and {ag_steps} steps traced, want {P - 1} each")
        allocs += be.pinned_allocs
        parallel_assert(len(_staging_for(be).free) == allocs,
                        f"{allocs} staging buffers, {len(_staging_for(be).free)} back "
                        f"in the pool")


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_staged_ring_ops_cross_over_at_their_own_limits(monkeypatch, op):
    """Each staged ring op runs on one host copy below its own share of the staging
    limit (the all-reduce all of it, the reduce-scatter half, the all-gather an eighth,
    as measured on a GPU: ``comm.STAGE_WHOLE_SHARES``) and step by step from there: one
    item below the op's limit it takes the whole copy, at the limit it does not (seen by
    a spy on the whole-copy path, which tells at any P), with the host op's values either
    way."""
    from summasim.algorithms import allreduce as ar
    wholes = []
    real = ar._on_host_copy
    monkeypatch.setattr(ar, "_on_host_copy", lambda *a: (wholes.append(1), real(*a)))
    run = {"allreduce": lambda v, c: algs.ring_allreduce(v, c, out=v),
           "reduce_scatter": ar.ring_reduce_scatter_unchecked,
           "allgather": ar.ring_allgather_unchecked}[op]
    limit = 1 << 16
    want_share = {"allreduce": 1.0, "reduce_scatter": 0.5, "allgather": 0.125}[op]
    n_at = int(limit * want_share) // 8
    took, same = [], []
    with _staged_and_host(True) as (be, comm, host):
        comm.stage_whole_limit = limit
        for n in (n_at - 1, n_at):
            x = np.random.default_rng(comm.rank).standard_normal(n)
            got, want = x.copy(), x.copy()
            wholes.clear()
            run(got, comm)
            took.append(len(wholes))
            run(want, host)
            same.append(bool(np.array_equal(got, want)))
    expect = [1, 0] if P > 1 else [0, 0]
    parallel_assert(took == expect and all(same),
                    f"{op}: whole-copy path taken {took} (want {expect}) below and at "
                    f"{n_at} items; values equal to the host op's: {same}")


@pytest.mark.parametrize("budget", [0.0, 1e-9, 60.0])
def test_bench_allreduce_sizes_its_repeats_alike_on_every_rank(monkeypatch, budget):
    """Without --repeats, ``bench allreduce`` times 9 repeats and then sizes the rest by
    their duration: every rank must take the same count (a rank that stopped early would
    leave the others waiting in a collective), each contender timed that many times, in
    steps of the nine contenders (ring and MPI into out, ring and plain ring in place,
    the plain call, and ZeRO's two halves each against MPI); an explicit
    count is exactly that count."""
    from summasim.bench import allreduce as bench

    monkeypatch.setattr(bench, "ALLREDUCE_BUDGET_S", budget)
    monkeypatch.setattr(bench, "ALLREDUCE_MAX_REPEATS", 20)
    rows = bench.bench_allreduce(WORLD, [1 / 64], "float64", None, lambda *a, **k: None)
    fixed = bench.bench_allreduce(WORLD, [1 / 64], "float64", 4, lambda *a, **k: None)
    n = rows[0]["repeats"]
    counts = WORLD.allgather(n)
    parallel_assert(len(set(counts)) == 1, f"ranks took different counts: {counts}")
    want = 18 if budget == 60.0 else 9          # 9 + one step of 9, at most 20
    timed = [len(rows[0][k + "_times"]) for k in ("ring", "plain", "mpi", "inplace", "call")]
    parallel_assert(n == want and timed == [n] * 5,
                    f"{n} repeats ({timed} timed), want {want}")
    parallel_assert(fixed[0]["repeats"] == 4 and len(fixed[0]["ring_times"]) == 4
                    and rows[0]["ok"] and fixed[0]["ok"], "--repeats 4 not honoured")


def test_reduce_scatter_sums_blocks_on_host_and_staged():
    """Comm.reduce_scatter: rank r keeps block r of the sum of every rank's [P, 3] buffer,
    traced once as "reduce_scatter" with the whole send buffer's bytes; staged, the send
    buffer goes out once and the block comes back once; a drop fault keeps the rank's
    own block unreduced."""
    X = np.random.default_rng(5).standard_normal((P, P, 3))        # rank r sends X[r]
    want = X.sum(0)[WORLD.Get_rank()]
    be = StagedHostBackend()
    for backend in (None, be):
        comm = Comm(WORLD.Dup(), name="row", backend=backend)
        try:
            out = np.empty(3)
            comm.reduce_scatter(X[comm.rank].copy(), out)
            ev = comm.trace.events
            ok = (np.allclose(out, want, rtol=0, atol=1e-13) and len(ev) == 1
                  and (ev[0].op, ev[0].group, ev[0].nbytes) == ("reduce_scatter", "row",
                                                                 X[0].nbytes))
            if backend is not None:
                ok = ok and (be.d2h_copies, be.h2d_copies) == (1, 1)
            parallel_assert(ok, f"backend {backend}: {out} != {want}, events {ev}")
            # the drop fault on the last rank alone: the collective still runs on every
            # rank (the others get the true sums), and that rank keeps its own block
            liar = comm.rank == P - 1 and P > 1
            with (Comm.drop_next_sum() if liar else nullcontext()) as drop:
                comm.reduce_scatter(X[comm.rank].copy(), out)
            kept = X[comm.rank, comm.rank] if liar else want
            parallel_assert(np.allclose(out, kept, rtol=0, atol=1e-13)
                            and (not liar or drop.applied), f"drop: {out}")
        finally:
            comm.mpi.Free()
