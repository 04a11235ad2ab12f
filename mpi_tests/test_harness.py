"""The harness under MPI: rank-local runs validate, verdicts are collective and keep
NaN whichever rank holds it, and every injected fault is caught on every rank."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import pytest
from mpi4py import MPI

from _util import WORLD, parallel_assert, skip_unless
from summasim.algorithms.table import ALGORITHMS
from summasim.comm import Comm
from summasim.harness.cases import MatmulCase, RingCase, transformer_case
from summasim.harness.execute import run_case
from summasim.harness.inject import KINDS, Fault
from summasim.transformer.schemes import SCHEMES

P = WORLD.Get_size()
LAST = P - 1   # faults on the last rank: the old verdict reduction lost NaN off rank 0


def _product_cases():
    out = []
    for name, spec in ALGORITHMS.items():
        if not spec.is_product:
            continue
        for q, pc, d in spec.grids(P)[-1:]:
            # sizes that divide every grid of the deep products; Cannon, SUMMA and
            # SUMMA2.5 take them as they are (uneven blocks on most grids)
            out.append(MatmulCase(name, q, d, *spec.round_up(25, 17, 21, q, d, pc),
                                  pc=pc))
    return out


CASES = _product_cases() + [RingCase(3 * P + 1)]


@pytest.fixture(scope="module")
def be(backend):
    return backend


@pytest.mark.parametrize("case", CASES, ids=[c.label(P) for c in CASES])
def test_clean_run_passes_and_every_fault_fails_everywhere(be, case):
    res = run_case(case, WORLD, be, timed=False)
    parallel_assert(res.ok and math.isfinite(res.check.error),
                    f"clean {case.label(P)}: {res.check}")
    for kind in KINDS:
        res = run_case(case, WORLD, be, timed=False, fault=Fault(kind, LAST))
        # the verdict is the same on every rank: gather it and compare
        verdicts = WORLD.allgather((res.ok, res.check.nonfinite, tuple(res.check.bad_ranks)))
        parallel_assert(all(v == verdicts[0] for v in verdicts),
                        f"{kind}: ranks disagree on the verdict {verdicts}")
        parallel_assert(not res.ok and LAST in res.check.bad_ranks,
                        f"{kind}@{LAST} on {case.label(P)} was not caught: {res.check}")
        if kind in ("nan", "inf"):
            parallel_assert(res.check.nonfinite and math.isnan(res.check.error),
                            f"{kind}: the job's error must be NaN, got {res.check.error}")


def test_timed_run_reports_traffic_and_spans(be):
    case = _product_cases()[0]
    res = run_case(case, WORLD, be, repeats=2)
    parallel_assert(res.ok and len(res.timing["spans"]) >= 2 and res.seconds > 0,
                    f"{res.timing}")
    parallel_assert(res.peak_rss > 0, "peak RSS measured")
    if WORLD.Get_rank() == 0:
        parallel_assert(len(res.events) == P and len(res.coords) == P, "gathered on rank 0")
    else:
        parallel_assert(res.events is None, "only rank 0 holds the gathered events")


SCHEME_CASES = [(name, q, pc, d) for name, spec in SCHEMES.items()
                for q, pc, d in spec.grids(P)]


@pytest.mark.parametrize("name,q,pc,d", SCHEME_CASES, ids=[f"{n}-{q}x{pc}x{d}" for n, q, pc, d
                                                            in SCHEME_CASES])
def test_training_step_faults_are_caught(name, q, pc, d):
    b = 2 * d * q
    case = transformer_case(name, q, d, b, 4, 4 * P, P, 4 * P, 1, pc=pc)
    skip_unless(case.misfit(P) == "", case.misfit(P))
    res = run_case(case, WORLD, None, timed=False, with_memory=False)
    parallel_assert(res.ok, f"clean {case.label(P)}: {res.extra['report']}")
    for kind in KINDS:
        res = run_case(case, WORLD, None, timed=False, with_memory=False,
                       fault=Fault(kind, LAST))
        rep = res.extra["report"]
        if kind == "drop" and P == 1:
            parallel_assert(not rep.fault_applied, "a group of one has no sum to drop")
            continue
        parallel_assert(rep.fault_applied and not res.ok and not rep.ok,
                        f"{kind}@{LAST} on {case.label(P)} was not caught: {rep}")


def test_the_drop_hook_leaves_one_block_unreduced():
    """``Comm.drop_next_sum`` armed on the last rank: its next sum all-reduce keeps its
    own contribution (x = rank + 1), every other rank gets ``P (P + 1) / 2``; the hook
    is one-shot; a group filter that does not name the group, a group of one and a
    max all-reduce leave it armed and the results exact."""
    comm = Comm(WORLD.Dup(), name="world")
    alone = Comm(MPI.COMM_SELF.Dup(), name="world")
    try:
        r, mine = comm.rank, comm.rank == LAST
        x = np.full(4, r + 1.0)
        total = np.full(4, P * (P + 1) / 2)
        arm = Comm.drop_next_sum
        with (arm(groups=("dp",)) if mine else nullcontext()) as skipped:
            other = comm.allreduce(x.copy())
        skipped = skipped.applied if mine else False     # the hook is one object: read now
        with (arm() if mine else nullcontext()) as drop:
            solo = alone.allreduce(x.copy())
            peak = comm.allreduce(x.copy(), op="max")
            first = comm.allreduce(x.copy())
            second = comm.allreduce(x.copy())
        ok = np.array_equal(other, total) and np.array_equal(second, total)
        ok &= np.array_equal(solo, x) and np.array_equal(peak, np.full(4, float(P)))
        ok &= np.array_equal(first, x if mine and P > 1 else total)
        if mine:
            ok &= not skipped and drop.applied == (P > 1) and not alone.take_drop()
        parallel_assert(ok, f"rank {r}: {other[0]} {solo[0]} {peak[0]} {first[0]} "
                            f"{second[0]}")
    finally:
        comm.mpi.Free()
        alone.mpi.Free()


#: what a product run's arrays hold beyond the sizes' share (probe vectors, the trace)
SLACK = 1 << 20


def _deep_memory_cases():
    """The products whose workspaces go beyond SUMMA's (the 3D cube's gathers, partial
    product and depth reduce-scatter; SD 2.5D's depth copies and depth all-reduce;
    SUMMA2.5 A^T B's depth all-reduce), on the last grid of P, even and uneven."""
    out = []
    for name in ("mm3d_ab", "mm3d_abt", "mm3d_atb", "sd25_ab", "summa25_atb"):
        spec = ALGORITHMS[name]
        for q, pc, d in spec.grids(P)[-1:]:
            if max(q, d) > 1:
                for n in (1536, 1535):
                    out.append(MatmulCase(name, q, d, n, n - 2, n + 1, pc=pc))
    return out


@pytest.mark.parametrize("case", _deep_memory_cases(),
                         ids=lambda c: f"{c.algorithm}-{c.m}")
def test_the_memory_estimate_covers_what_a_product_run_holds(case):
    """The preflight's per-rank estimate (``memory.product_bytes``) covers the traced
    peak of the run's arrays (NumPy reports its buffers to tracemalloc; the
    interpreter's own memory is outside both) on every rank, but for SLACK: what does
    not grow with the sizes (probe vectors, the trace). It priced the 3D product as
    SUMMA and left out SD 2.5D's depth copies and the depth rings' first-call trials,
    and admitted runs 20-50% larger than it said."""
    import tracemalloc

    from summasim.backends import get_backend
    from summasim.harness import memory
    from summasim.harness.execute import run_product

    # warm: what a first run allocates once (imports, caches) is not the product's
    small = MatmulCase(case.algorithm, case.q, case.d, 16, 16, 16, pc=case.pc)
    run_product(small, WORLD, get_backend("numpy"), timed=False)
    tracemalloc.start()
    try:
        res = run_product(case, WORLD, get_backend("numpy"), timed=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    est = memory.product_bytes(case, "auto")
    parallel_assert(res.check.ok and peak <= est + SLACK,
                    f"{case.algorithm} {case.m}x{case.k}x{case.n}: traced peak "
                    f"{peak / 2**20:.2f} MiB, estimate {est / 2**20:.2f} MiB")
