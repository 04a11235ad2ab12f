"""Traffic closed forms on hand-counted cases, and the trace-based prediction."""

import itertools

import pytest

from summasim.costmodel import (ALGORITHM_NAMES, Link, Machine, algorithm_compute,
                                algorithm_events, algorithm_flops, algorithm_messages,
                                algorithm_traffic, collective_time, group_spans_nodes,
                                predict_algorithm, predict_trace, ring_allgather_events,
                                ring_allreduce_events, ring_reduce_scatter_events,
                                summarize_events)
from summasim.trace import Event


# -- ring -----------------------------------------------------------------------------
def test_ring_n10_p4_by_hand():
    # chunks of N = 10 over P = 4: [3, 3, 2, 2]
    # rank 0: reduce-scatter sends chunks 0, 3, 2; allgather sends chunks 1, 0, 3
    assert [e.nbytes for e in ring_reduce_scatter_events(10, 4, 0, itemsize=1)] == [3, 2, 2]
    assert [e.nbytes for e in ring_allgather_events(10, 4, 0, itemsize=1)] == [3, 3, 2]
    # rank 3: RS chunks 3, 2, 1 -> 2, 2, 3; AG chunks 0, 3, 2 -> 3, 2, 2
    assert [e.nbytes for e in ring_allreduce_events(10, 4, 3, itemsize=1)] == [2, 2, 3, 3, 2, 2]
    totals = [sum(e.nbytes for e in ring_allreduce_events(10, 4, r, itemsize=1))
              for r in range(4)]
    assert totals == [15, 16, 15, 14]
    ev = ring_allreduce_events(10, 4, 1, group="depth")
    assert len(ev) == 6 and {(e.op, e.group, e.group_size, e.root) for e in ev} == {
        ("sendrecv", "depth", 4, -1)}
    assert algorithm_traffic("ring_allreduce", count=10, p=4, coords=1, itemsize=8) == {
        ("sendrecv", "ring"): (6, 16 * 8)}


def test_ring_edge_cases():
    assert ring_allreduce_events(10, 1, 0) == []
    # N < P: empty chunks still take a step
    sizes = [e.nbytes for e in ring_allreduce_events(2, 4, 0, itemsize=1)]
    assert sizes == [1, 0, 0, 1, 1, 0]   # chunks [1,1,0,0]: RS 0,3,2; AG 1,0,3
    with pytest.raises(ValueError, match="outside 0..3"):
        ring_allreduce_events(10, 4, 4)
    with pytest.raises(ValueError, match="count N"):
        ring_allreduce_events(-1, 4, 0)


# -- matmul algorithms ---------------------------------------------------------------
def test_summa_by_hand():
    # A [8, 8], B [8, 8], q = 2: 4x4 blocks of 16 float64 = 128 B; 2 steps each
    assert algorithm_traffic("summa_ab", 8, 8, 8, 2) == {("bcast", "row"): (2, 256),
                                                         ("bcast", "col"): (2, 256)}
    ev = algorithm_events("summa_ab", 8, 8, 8, 2)
    assert [(e.op, e.group, e.root) for e in ev] == [
        ("bcast", "row", 0), ("bcast", "col", 0), ("bcast", "row", 1), ("bcast", "col", 1)]
    # C = A B^T, A [4, 6], B [8, 6], q = 2: col bcasts of (8/2)(6/2) = 12 items,
    # row reduces of (4/2)(8/2) = 8 items
    assert algorithm_traffic("summa_abt", 4, 6, 8, 2, itemsize=1) == {
        ("bcast", "col"): (2, 24), ("reduce", "row"): (2, 16)}
    # C = A^T B, A [k=6, m=4], B [6, n=8]: row bcasts of (6/2)(4/2) = 6, col reduces of 2*4 = 8
    assert algorithm_traffic("summa_atb", 4, 6, 8, 2, itemsize=1) == {
        ("bcast", "row"): (2, 12), ("reduce", "col"): (2, 16)}
    assert algorithm_traffic("summa_ab", 8, 8, 8, 1) == {}


def test_summa25_by_hand():
    # [q, q, d] = [2, 2, 3]; A [12, 4] 2.5d: (12/6)(4/2) = 4 items; B [4, 10]: (2)(5) = 10
    assert algorithm_traffic("summa25_ab", 12, 4, 10, 2, 3, itemsize=1) == {
        ("bcast", "row"): (2, 8), ("bcast", "col"): (2, 20)}
    # A [12, 4] 2.5d, B [10, 4] 2d: col bcasts of (10/2)(4/2) = 10, row reduces (12/6)(10/2) = 10
    assert algorithm_traffic("summa25_abt", 12, 4, 10, 2, 3, itemsize=1) == {
        ("bcast", "col"): (2, 20), ("reduce", "row"): (2, 20)}
    # A [k=12, m=4], B [12, n=10] both 2.5d: row bcasts (12/6)(4/2) = 4; col reduces 2*5 = 10;
    # ring all-reduce of 10 items over d = 3: chunks [4, 3, 3]
    t = algorithm_traffic("summa25_atb", 4, 12, 10, 2, 3, itemsize=1, coords=(0, 1, 2))
    # depth rank 2: RS chunks 2, 1 (3+3), AG chunks 0, 2 (4+3)
    assert t == {("bcast", "row"): (2, 8), ("reduce", "col"): (2, 20),
                 ("sendrecv", "depth"): (4, 13)}
    t0 = algorithm_traffic("summa25_atb", 4, 12, 10, 2, 3, itemsize=1, coords=(0, 0, 0))
    assert t0[("sendrecv", "depth")] == (4, 14)   # RS 0, 2 (4+3); AG 1, 0 (3+4)
    # d = 1 is plain SUMMA, no depth ring
    assert algorithm_traffic("summa25_atb", 4, 6, 8, 2, 1) == algorithm_traffic(
        "summa_atb", 4, 6, 8, 2)


@pytest.mark.parametrize("coords,rows,cols", [((0, 0), 2, 2), ((1, 0), 3, 2), ((0, 2), 2, 3),
                                              ((2, 1), 3, 3)])
def test_cannon_by_hand(coords, rows, cols):
    # q = 3, A [6, 9] -> A block (2, 3) = 6 items, B [9, 12] -> (3, 4) = 12 items
    t = algorithm_traffic("cannon_ab", 6, 9, 12, 3, itemsize=1, coords=coords)
    assert t == {("sendrecv", "row"): (rows, rows * 6), ("sendrecv", "col"): (cols, cols * 12)}
    with pytest.raises(ValueError, match="d == 1"):
        algorithm_traffic("cannon_ab", 6, 9, 12, 3, 2)


def test_deep_products_on_sizes_that_do_not_divide_by_hand():
    """The deep products take any sizes. mm3d_ab, m = 10, k = n = 8, q = 2, rank
    (0, 0, 0): M_0 = 5 rows (pieces 3, 2), K_0 = N_0 = 4; A's pieces padded to 3 x 4,
    B's 2 x 4; ring chunks of C[M_0, N_0] 3 x 4 and 2 x 4, step 0 sends chunk 0.
    sd25_ab, 4 x 9 x 4 on [2, 2, 2], rank (0, 0, 0): blocks A 2 x 5, B 5 x 2; layer 0
    runs step 0 (K_0: 5 wide); the ring sums 2 x 2 over 2 layers."""
    assert algorithm_traffic("mm3d_ab", 10, 8, 8, 2, 2, itemsize=1) == {
        ("allgather", "row"): (1, 12), ("allgather", "col"): (1, 8),
        ("sendrecv", "depth"): (1, 12)}
    assert algorithm_traffic("sd25_ab", 4, 9, 4, 2, 2, itemsize=1) == {
        ("bcast", "depth"): (2, 20), ("bcast", "row"): (1, 10), ("bcast", "col"): (1, 10),
        ("sendrecv", "depth"): (2, 4)}


def test_errors_name_the_dimension():
    """Bad grids and sizes: the errors say what."""
    with pytest.raises(ValueError, match=r"mm3d_ab needs a cube"):
        algorithm_traffic("mm3d_ab", 10, 8, 8, 2, 1)
    with pytest.raises(ValueError, match=r"sd25_ab needs a square grid"):
        algorithm_traffic("sd25_ab", 4, 9, 4, 2, 2, pc=1)
    with pytest.raises(ValueError, match="unknown algorithm"):
        algorithm_traffic("fox_ab", 4, 4, 4, 2)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        algorithm_traffic("summa_ab", 0, 8, 8, 2, pc=3)


def test_balanced_blocks_closed_form():
    """Sizes that do not divide: each rank's blocks are those of the balanced partition
    (the first size mod blocks one larger), and the steps the pieces of k that lie in
    one block of A's columns and one of B's rows."""
    # m = 10 over 4 rows: 3, 3, 2, 2; k = 8 over 4: 2 each; n = 8 over 4: 2 each
    assert algorithm_traffic("summa_ab", 10, 8, 8, 4, coords=(0, 0, 0)) == {
        ("bcast", "row"): (4, 4 * 3 * 2 * 8), ("bcast", "col"): (4, 4 * 2 * 2 * 8)}
    assert algorithm_traffic("summa_ab", 10, 8, 8, 4, coords=(3, 1, 0)) == {
        ("bcast", "row"): (4, 4 * 2 * 2 * 8), ("bcast", "col"): (4, 4 * 2 * 2 * 8)}
    # a 2 x 3 grid, k = 7: A's columns cut 3, 2, 2 (pc = 3), B's rows 4, 3 (pr = 2); the
    # pieces are [0,3) [3,4) [4,5) [5,7): four steps, row roots 0 1 1 2, column roots 0 0 1 1
    ev = algorithm_events("summa_ab", 5, 7, 9, 2, 1, 8, (0, 0, 0), pc=3)
    assert [(e.group, e.root, e.nbytes // 8) for e in ev] == [
        ("row", 0, 3 * 3), ("col", 0, 3 * 3), ("row", 1, 3 * 1), ("col", 0, 1 * 3),
        ("row", 1, 3 * 1), ("col", 1, 1 * 3), ("row", 2, 3 * 2), ("col", 1, 2 * 3)]
    # on a square grid with sizes that divide it is the q-step table
    assert algorithm_events("summa_abt", 8, 8, 8, 2, 1, 8, (1, 0, 0), pc=2) == \
        algorithm_events("summa_abt", 8, 8, 8, 2, 1, 8, (1, 0, 0))


def test_messages_equal_events_everywhere():
    """The O(1) message classes agree with the enumerated events for every algorithm."""
    cases = [("summa_ab", 12, 8, 4, 2, 1), ("summa_abt", 6, 9, 12, 3, 1),
             ("summa_atb", 6, 9, 12, 3, 1), ("summa25_ab", 12, 6, 6, 2, 3),
             ("summa25_abt", 16, 4, 8, 2, 4), ("summa25_atb", 4, 16, 6, 2, 4),
             ("cannon_ab", 8, 8, 8, 4, 1)]
    for name, m, k, n, q, d in cases:
        for coords in itertools.product(range(q), range(q), range(d)):
            ev = algorithm_events(name, m, k, n, q, d, 4, coords)
            assert summarize_events(ev) == algorithm_traffic(name, m, k, n, q, d, 4, coords)
    for count, p in ((10, 4), (3, 5), (100, 7), (0, 3)):
        for r in range(p):
            for name in ("ring_allreduce", "ring_reduce_scatter", "ring_allgather"):
                ev = algorithm_events(name, count=count, p=p, coords=r)
                assert summarize_events(ev) == summarize_events(
                    algorithm_messages(name, count=count, p=p, coords=r))
    assert set(ALGORITHM_NAMES) >= {n for n, *_ in cases}


def test_compute_and_flops():
    m, k, n, q, d = 12, 8, 16, 2, 3
    assert algorithm_flops("summa_ab", 12, 8, 16, 2) == 2 * 12 * 8 * 16 // 4
    assert algorithm_flops("summa25_ab", m, k, n, q, d) == 2 * m * k * n // (d * q * q)
    assert algorithm_flops("summa25_atb", 8, 12, 16, 2, 3) == 2 * 8 * 12 * 16 // 12
    assert algorithm_flops("cannon_ab", 8, 8, 8, 4) == 2 * 8 ** 3 // 16
    # ring reduce-scatter adds every chunk but its own once
    assert algorithm_compute("ring_allreduce", count=10, p=4, coords=0, itemsize=1) \
        .reduce_bytes == 3 + 2 + 2     # chunks 3, 2, 1 -> sizes 2, 2, 3
    assert algorithm_compute("ring_allgather", count=10, p=4, coords=0).reduce_bytes == 0


# -- prediction -------------------------------------------------------------------------
M = Machine.simple(alpha=2e-6, beta=1e-9, gamma=1e-10, gamma_reduce=1e-10, cores=2)


def test_predict_trace_sums_events_and_slowdown():
    events = [Event("bcast", "row", 4, 0, 1000, 0.1, "fwd"),
              Event("bcast", "row", 4, 1, 1000, 0.1, "fwd"),
              Event("sendrecv", "col", 4, -1, 5000, 0.1, "bwd"),
              Event("allreduce", "world", 16, -1, 1 << 20, 0.1, "bwd")]
    pred = predict_trace(events, M, p=2, gemms=[(10, 20, 30, 2)])
    exp_comm = (2 * collective_time("bcast", 1000, 4, M).seconds
                + collective_time("sendrecv", 5000, 4, M).seconds
                + collective_time("allreduce", 1 << 20, 16, M).seconds)
    assert pred.comm_seconds == pytest.approx(exp_comm, rel=1e-12)
    assert pred.compute_seconds == pytest.approx(2 * 2 * 10 * 20 * 30 * 1e-10, rel=1e-12)
    assert pred.seconds == pytest.approx(pred.comm_seconds + pred.compute_seconds)
    assert pred.algorithms[("bcast", "row")] == ("binomial",)
    assert pred.algorithms[("allreduce", "world")] == ("reduce_scatter_allgather",)
    assert pred.counts[("bcast", "row")] == (2, 2000)
    assert pred.by_phase["fwd"] == pytest.approx(2 * collective_time("bcast", 1000, 4, M).seconds)
    assert "bcast/row: binomial" in pred.describe_algorithms()
    # 16 ranks on 2 cores: everything 8x slower (communication shares the cores too)
    slow = predict_trace(events, M, p=16, gemms=[(10, 20, 30, 2)])
    assert slow.slowdown == 8.0 and slow.seconds == pytest.approx(8 * pred.seconds)
    gpu = M.replace(shared_comm=False)
    slow_gpu = predict_trace(events, gpu, p=16, gemms=[(10, 20, 30, 2)])
    assert slow_gpu.comm_seconds == pytest.approx(pred.comm_seconds)
    forced = predict_trace(events, M, p=2, algorithms={"allreduce": "ring"})
    assert forced.algorithms[("allreduce", "world")] == ("ring",)
    assert predict_trace(events, M, p=2, mode="paper").comm_seconds < pred.comm_seconds
    assert predict_trace([], M, p=1, compute_seconds=3.0).seconds == 3.0
    assert set(pred.to_dict()) >= {"seconds", "by_op", "algorithms"}


@pytest.mark.parametrize("name,m,k,n,q,d,coords", [
    ("summa_ab", 64, 32, 48, 4, 1, (0, 0, 0)), ("summa_abt", 64, 32, 48, 4, 1, (1, 2, 0)),
    ("summa25_atb", 32, 64, 48, 4, 2, (0, 0, 1)), ("cannon_ab", 64, 64, 64, 4, 1, (1, 1)),
    ("summa25_abt", 64, 32, 48, 2, 2, (0, 0, 0)), ("sd25_ab", 9, 10, 7, 2, 2, (1, 0, 1)),
    ("mm3d_atb", 9, 10, 7, 2, 2, (1, 0, 1))])
def test_trace_and_closed_form_agree(name, m, k, n, q, d, coords):
    ev = algorithm_events(name, m, k, n, q, d, 8, coords)
    work = algorithm_compute(name, m, k, n, q, d, 8, coords)
    via_trace = predict_trace(ev, M, q=q, d=d, gemms=work.gemms,
                              reduce_bytes=work.reduce_bytes)
    closed = predict_algorithm(name, m, k, n, q, d, machine=M, coords=coords)
    assert closed.seconds == pytest.approx(via_trace.seconds, rel=1e-12)
    assert closed.algorithms == via_trace.algorithms


def test_predict_algorithm_worst_rank_and_overlap():
    # Cannon: the skewed ranks do two more shifts than rank (0, 0)
    worst = predict_algorithm("cannon_ab", 64, 64, 64, 4, machine=M)
    origin = predict_algorithm("cannon_ab", 64, 64, 64, 4, machine=M, coords=(0, 0))
    assert worst.counts[("sendrecv", "row")] == (4, 4 * 16 * 16 * 8)
    assert worst.seconds > origin.seconds
    # overlap model: c + (q-1) max(c, g) + g, when the cores are not oversubscribed
    gpu = M.replace(shared_comm=False, cores=64)
    serial = predict_algorithm("summa_ab", 64, 64, 64, 4, machine=gpu)
    over = predict_algorithm("summa_ab", 64, 64, 64, 4, machine=gpu, overlap=True)
    c, g = serial.comm_seconds / 4, serial.compute_seconds / 4
    assert over.seconds == pytest.approx(c + 3 * max(c, g) + g)
    assert over.seconds < serial.seconds
    # strict=False accepts shapes that do not divide (scaling studies)
    loose = predict_algorithm("summa_ab", 10, 10, 10, 4, machine=M, strict=False)
    assert loose.seconds > 0
    # sd25_ab too: rank (0, 0, k) holds the largest blocks, 5 x 5 (m = 9, k = n = 10)
    deep = predict_algorithm("sd25_ab", 9, 10, 10, 2, 2, machine=M)
    assert deep.counts[("bcast", "depth")] == (2, 2 * 25 * 8)
    assert deep.counts[("sendrecv", "depth")] == (2, 25 * 8)    # ring chunks 13 + 12
    # SUMMA takes them as they are: the balanced blocks, priced on the busiest rank
    uneven = predict_algorithm("summa_ab", 10, 10, 10, 4, machine=M)
    assert uneven.counts[("bcast", "row")] == (4, 3 * 10 * 8)     # m_0 = 3 rows, all of k
    rect = predict_algorithm("summa_ab", 12, 12, 12, 2, machine=M, pc=3)
    assert rect.counts[("bcast", "row")][0] == 4 and rect.seconds > 0  # pieces of k


def test_group_placement():
    m = Machine(name="c", source="t", cores=8, node_size=8, intra=Link(1e-6, 1e-10, 1e-6, 1e-10, 0),
                inter=Link(1e-5, 1e-9, 1e-5, 1e-9, 0), gamma_gemm={"float64": [[1, 1e-12]]},
                gamma_reduce=0.0)
    assert not group_spans_nodes("row", m, q=4)           # 4 contiguous ranks
    assert group_spans_nodes("col", m, q=4)               # stride 4, 16 ranks wide
    assert not group_spans_nodes("col", m, q=2, d=2)      # a 2x2 layer fits in a node
    assert not group_spans_nodes("depth", m, q=2, d=2)    # stride 4, 2 deep = 8
    assert group_spans_nodes("depth", m, q=2, d=4)
    assert group_spans_nodes("world", m, p=16) and not group_spans_nodes("world", m, p=8)
    assert not group_spans_nodes("col", M, q=64)          # no node_size: one node
    ev = [Event("bcast", "col", 4, 0, 1000, 0.0, ""), Event("bcast", "row", 4, 0, 1000, 0.0, "")]
    pred = predict_trace(ev, m, q=4)
    assert pred.by_op[("bcast", "col")] > pred.by_op[("bcast", "row")]
