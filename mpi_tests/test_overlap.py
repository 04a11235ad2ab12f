"""The data-parallel reduction overlapped with the backward: the non-blocking ring
(``ring_start``) against the blocking one, bitwise and in the ledger; a progress call
that never waits; and the sharded trainer with ``overlap=True`` against ``overlap=False``
(the same parameters bit for bit, the same traffic, reductions queued while backward
pieces remain), then through the mesh executor (values, ledger, faults)."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert, skip_unless
from summasim.algorithms.allreduce import (ring_allgather_unchecked,
                                           ring_allreduce_unchecked,
                                           ring_reduce_scatter_unchecked, ring_start)
from summasim.comm import Comm
from summasim.grid import Mesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import mesh_inputs, run_mesh
from summasim.transformer.composed import Trainer
from summasim.transformer.model import Config
from summasim.transformer.schemes import get_scheme

P = WORLD.Get_size()
BLOCKING = {"ar": lambda x, c: ring_allreduce_unchecked(x, c, out=x),
            "rs": ring_reduce_scatter_unchecked, "ag": ring_allgather_unchecked}


def _steps(comm):
    """``(op, phase, nbytes)`` of each traced event, in order."""
    return [(e.op, e.phase, e.nbytes) for e in comm.trace.events]


@pytest.mark.parametrize("half", ["ar", "rs", "ag"])
def test_the_nonblocking_ring_is_the_blocking_ring_bitwise(half):
    """Every length from empty chunks (n < P) up: the same result bit for bit and the
    same traced steps (one "sendrecv" of the send's bytes per step, the start's phase),
    whether driven by progress() calls or by wait()."""
    comm = Comm(WORLD.Dup(), name="dp")
    try:
        rank, ok, why = comm.rank, True, ""
        for n in (0, 1, P - 1, P + 1, 37, 4096 + 3):
            x = np.random.default_rng([rank, n]).standard_normal(n)
            want = x.copy()
            comm.trace.clear()
            with comm.trace.phase("dp.grads"):
                BLOCKING[half](want, comm)
            ledger = _steps(comm)
            for drive in ("progress", "wait"):
                got = x.copy()
                comm.trace.clear()
                with comm.trace.phase("dp.grads"):
                    ring = ring_start(got, comm, half)
                if drive == "progress":
                    while not ring.progress():
                        pass
                else:
                    ring.wait()
                same = np.array_equal(got, want) and _steps(comm) == ledger and ring.done
                steps = 0 if P == 1 else (2 if half == "ar" else 1) * (P - 1)
                if not same or len(ledger) != steps:
                    ok, why = False, f"n={n} {drive}: {got[:4]} vs {want[:4]}, " \
                                     f"{_steps(comm)} vs {ledger}"
        parallel_assert(ok, why)
    finally:
        comm.mpi.Free()


def test_progress_returns_without_waiting_for_a_late_neighbour():
    """Rank 0 starts its ring and calls progress() before any other rank has started:
    its left neighbour has sent nothing, so progress() must come back False (a call that
    waited would hang here); the ring then finishes once the others start."""
    skip_unless(P > 1, "needs a ring of at least 2 ranks")
    comm = Comm(WORLD.Dup(), name="dp")
    try:
        rank = comm.rank
        x = np.full(64, float(rank + 1))
        early = None
        if rank == 0:
            ring = ring_start(x, comm, "ar")
            early = ring.progress()
        comm.mpi.Barrier()                 # untraced: the others start only now
        if rank != 0:
            ring = ring_start(x, comm, "ar")
        ring.wait()
        total = P * (P + 1) / 2
        parallel_assert(early is not True and np.all(x == total),
                        f"progress before the neighbour started: {early}; sum {x[:2]}")
    finally:
        comm.mpi.Free()


def _mesh_case(zero: int):
    """A mesh with dp = 2 and what else p allows (a Megatron tensor group of p/2, or a
    pipeline of 2 stages from p = 8), 4 layers, 256-byte buckets (several per stage);
    dp = 1 (nothing to overlap) when p is odd."""
    dp = 2 if P % 2 == 0 else 1
    rest = P // dp
    pp, t = (2, rest // 2) if rest >= 4 and rest % 2 == 0 else (1, rest)
    config = Config(vocab=8 * t, seq=4, hidden=8 * t, heads=2 * t, layers=4)
    return MeshCase.parse(f"dp={dp},pp={pp},tp=megatron:{t}", dp * 2, config, zero=zero,
                          schedule="1f1b", microbatches=2, bucket_bytes=256)


def _trainer(case, mesh, overlap):
    params, _, _ = mesh_inputs(case.config, case.batch, 0)
    return Trainer(params, case.config, mesh, get_scheme(case.scheme), zero=case.zero,
                   schedule=case.schedule, microbatches=case.microbatches,
                   bucket_bytes=case.bucket_bytes, overlap=overlap)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_overlap_trains_the_same_bits_with_the_same_messages(zero):
    """One step with overlap off and on from the same state: the same parameters and
    gradients bit for bit, the same dp.grads steps in the ledger (one "sendrecv" of the
    same bytes each; rings in flight together record theirs interleaved), and
    (ZeRO 0-1) each bucket queued while ``n - 1 - bucket_piece`` backward pieces remain
    (closed form over the buckets), nothing queued early without overlap."""
    case = _mesh_case(zero)
    skip_unless(case.dp > 1, f"needs dp > 1 (p = {P})")
    mesh = Mesh(WORLD, case.dp, case.pp, "1d", t=case.t)
    try:
        _, tokens, targets = mesh_inputs(case.config, case.batch, 0)
        runs = {}
        for overlap in (False, True):
            tr = _trainer(case, mesh, overlap)
            mesh.trace.clear()
            loss = tr.step(tokens, targets)
            grads = [np.array(v, copy=True) for _, _, v in tr.held_grads()]
            params = [np.array(v, copy=True) for _, _, v in tr.held_params()]
            dp = sorted((e.op, e.nbytes) for e in mesh.trace.events if e.phase == "dp.grads")
            runs[overlap] = (loss, grads, params, dp, dict(tr.rings), tr)
        (l0, g0, p0, d0, r0, _), (l1, g1, p1, d1, r1, tr) = runs[False], runs[True]
        bits = l0 == l1 and all(np.array_equal(a, b) for a, b in zip(g0 + p0, g1 + p1))
        parallel_assert(bits and d0 == d1 and len(d0) > 0,
                        f"zero={zero}: overlap changed the step (same bits: {bits}; "
                        f"{len(d0)} vs {len(d1)} dp steps)")
        n = tr._n_pieces
        want = sum(n - 1 - k for k in tr.bucket_piece) if zero < 2 else None
        parallel_assert(r0["pieces_left"] == 0 and r0["in_flight"] + r0["waited"] == 0
                        and (want is None or r1["pieces_left"] == want)
                        and r1["in_flight"] + r1["waited"] == len(tr.buckets) * (
                            1 if zero < 2 else case.microbatches), f"rings {r0} {r1}, want "
                                                                   f"{want} pieces left")
        if zero < 2 and len(set(tr.bucket_piece)) > 1:
            parallel_assert(want > 0, "every bucket became final only at the last piece")
    finally:
        mesh.free()


def _compositions():
    """Meshes with dp > 1 under every ZeRO stage and schedule the executor checks."""
    out = []
    for zero in (0, 1, 2, 3):
        case = _mesh_case(zero)
        if case.dp > 1:
            out.append(case)
    if P > 4:                       # the larger suites run two of them
        return out[::2]
    if P == 4:
        config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=4)
        out.append(MeshCase.parse("dp=2,pp=2,tp=megatron:1", 8, config, zero=1,
                                  schedule="interleaved", chunks=2, microbatches=2,
                                  bucket_bytes=256))
        out.append(MeshCase.parse("dp=2,pp=2,tp=megatron:1", 8, config, zero=0,
                                  schedule="gpipe", microbatches=2, bucket_bytes=256))
    return out


CASES = _compositions()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.spec}-z{c.zero}-{c.schedule_label}"
                                            for c in CASES])
def test_overlap_passes_the_mesh_executor(backend, case):
    """Values against the float64 serial model, the traffic ledger exactly, the replica
    audit, memory and schedule: as without overlap."""
    res = run_mesh(case, WORLD, backend, timed=False, overlap=True)
    r = res.extra["report"]
    parallel_assert(res.ok and r.overlap and r.values_ok and not r.failures
                    and r.traffic == r.traffic_expected and r.traffic["dp.grads"] > 0,
                    f"{case.spec} zero={case.zero}: {r.failures} {r.traffic} vs "
                    f"{r.traffic_expected} grad {r.grad_err:.1e} param {r.param_err:.1e}")


@pytest.mark.parametrize("zero", [0, 2])
def test_a_dropped_sum_in_flight_fails_the_mesh(backend, zero):
    """``drop`` reaches the overlapped rings (the hook wraps ``ring_start``): the first
    dp sum is a gradient bucket, so the gradients fail, not only the loss (whose sum
    over dp would take an armed hook that the rings let pass)."""
    from summasim.harness.inject import Fault

    case = _mesh_case(zero)
    skip_unless(case.dp > 1, f"needs dp > 1 (p = {P})")
    res = run_mesh(case, WORLD, backend, timed=False, overlap=True, fault=Fault("drop", P - 1))
    r = res.extra["report"]
    parallel_assert(r.fault_applied and not res.ok and not r.values_ok
                    and r.grad_err > r.bound,
                    f"drop under overlap not caught: {r.failures} grad {r.grad_err:.1e}")

