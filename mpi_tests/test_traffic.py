"""Trace totals per rank equal the closed forms of what each algorithm sends."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim import algorithms as algs
from summasim import layout
from summasim.comm import Comm
from summasim.costmodel.workload.traffic import algorithm_traffic, summarize_events
from summasim.grid import Grid
from summasim.algorithms.table import ALGORITHMS, stored_shapes

P = WORLD.Get_size()
ITEM = 8


def ring_items(N: int, p: int, r: int) -> list[int]:
    """Items sent in each of the 2(p-1) sendrecvs of a ring all-reduce at rank r."""
    size = [N // p + (1 if c < N % p else 0) for c in range(p)]
    return [size[(r - s) % p] for s in range(p - 1)] + \
           [size[(r + 1 - s) % p] for s in range(p - 1)]


def expected(name, m, k, n, grid) -> dict:
    """{(op, group): (count, bytes)} per rank, from the module docstrings' closed forms."""
    q, d, i, j = grid.q, grid.d, grid.i, grid.j
    out: dict = {}

    def add(op, group, count, items):
        if count:
            c0, b0 = out.get((op, group), (0, 0))
            out[(op, group)] = (c0 + count, b0 + count * items * ITEM)

    md = m // (d * q)  # rows of a 2.5d block
    kd = k // (d * q)
    if q > 1:
        if name == "summa_ab":
            add("bcast", "row", q, (m // q) * (k // q))
            add("bcast", "col", q, (k // q) * (n // q))
        elif name == "summa_abt":
            add("bcast", "col", q, (n // q) * (k // q))
            add("reduce", "row", q, (m // q) * (n // q))
        elif name == "summa_atb":
            add("bcast", "row", q, (k // q) * (m // q))
            add("reduce", "col", q, (m // q) * (n // q))
        elif name == "summa25_ab":
            add("bcast", "row", q, md * (k // q))
            add("bcast", "col", q, (k // q) * (n // q))
        elif name == "summa25_abt":
            add("bcast", "col", q, (n // q) * (k // q))
            add("reduce", "row", q, md * (n // q))
        elif name == "summa25_atb":
            add("bcast", "row", q, kd * (m // q))
            add("reduce", "col", q, (m // q) * (n // q))
        elif name == "cannon_ab":
            add("sendrecv", "row", (1 if i % q else 0) + q - 1, (m // q) * (k // q))
            add("sendrecv", "col", (1 if j % q else 0) + q - 1, (k // q) * (n // q))
    if name == "summa25_atb" and d > 1:
        for items in ring_items((m // q) * (n // q), d, grid.k):
            add("sendrecv", "depth", 1, items)
    if name == "sd25_ab":
        # layer k's share of the q steps: q // d, one more on the first q % d layers
        steps = q // d + (1 if grid.k < q % d else 0)
        if d > 1:       # replicate layer 0's blocks, sum the layers' partial products
            add("bcast", "depth", 1, (m // q) * (k // q))
            add("bcast", "depth", 1, (k // q) * (n // q))
            for items in ring_items((m // q) * (n // q), d, grid.k):
                add("sendrecv", "depth", 1, items)
        if q > 1:
            add("bcast", "row", steps, (m // q) * (k // q))
            add("bcast", "col", steps, (k // q) * (n // q))
    if name.startswith("mm3d") and q > 1:
        # gather the A and B pieces (1/p of each), then the ring's first half over the depth
        add("allgather", "row", 1, m * k // q ** 3)
        add("allgather", "col", 1, k * n // q ** 3)
        for items in ring_items((m // q) * (n // q), q, grid.k)[: q - 1]:
            add("sendrecv", "depth", 1, items)
    return out


CASES = [(name, q, d) for name, spec in ALGORITHMS.items() if spec.is_product
         for q, d in grid_shapes(P) if not (name == "cannon_ab" and d > 1)
         and not (name.startswith("mm3d") and d != q)]


@pytest.mark.parametrize("name,q,d", CASES, ids=[f"{n}-q{q}d{d}" for n, q, d in CASES])
def test_trace_matches_closed_form(name, q, d):
    spec = ALGORITHMS[name]
    op, la, lb, lc = spec.op, spec.layout_a, spec.layout_b, spec.layout_c
    unit = d * q * q      # divides every block count of every layout: the even blocks
    m, k, n = 5 * unit, 3 * unit, 2 * unit                  # non-square, odd ring lengths
    sa, sb = stored_shapes(op, m, k, n)
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal(sa), rng.standard_normal(sb)
    with Grid(WORLD, q, d) as grid:
        a, b = layout.split(A, grid, la), layout.split(B, grid, lb)
        with grid.trace.phase("algo"):
            getattr(algs, name)(a, b, grid)
        got = {key: (t.count, t.nbytes) for key, t in grid.trace.by_op_group().items()}
        want = expected(name, m, k, n, grid)
        sizes_ok = all(e.group_size == {"row": q, "col": q, "depth": d}[e.group]
                       and e.phase == "algo" for e in grid.trace.events)
        roots_ok = all(e.root in range(q) for e in grid.trace.events if e.op in ("bcast", "reduce"))
        parallel_assert(got == want and sizes_ok and roots_ok,
                        f"rank {grid.coords}: traced {got} != closed form {want}")
        # the cost model's closed forms (what it prices) equal the trace too
        model = algorithm_traffic(name, m, k, n, q, d, itemsize=ITEM, coords=grid.coords)
        parallel_assert(summarize_events(grid.trace.events) == model,
                        f"rank {grid.coords}: costmodel.workload.traffic {model} != trace {got}")


@pytest.mark.parametrize("N", [0, 1, P - 1, 10 * P + 3, 4096])
def test_ring_traffic(N):
    comm = Comm(WORLD.Dup(), name="ring")
    try:
        algs.ring_allreduce(np.ones(N), comm)
        sent = [e.nbytes // ITEM for e in comm.trace.events]
        want = ring_items(N, P, comm.rank) if P > 1 else []
        ops = {e.op for e in comm.trace.events}
        parallel_assert(sent == want and ops <= {"sendrecv"} and len(sent) == 2 * (P - 1),
                        f"ring N={N}: sent {sent}, closed form {want}")
        model = algorithm_traffic("ring_allreduce", count=N, p=P, coords=comm.rank,
                                  itemsize=ITEM)
        parallel_assert(summarize_events(comm.trace.events) == model, f"ring N={N}: {model}")
    finally:
        comm.mpi.Free()
