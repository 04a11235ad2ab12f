"""Collective formulas against hand-worked values; MPICH selection; paper mode."""

import pytest

from summasim.costmodel import Link, Machine, Thresholds, collective_time, select_algorithm
from summasim.costmodel import collectives as C

A, BETA, GR = 1e-6, 1e-9, 0.5e-9   # alpha s, beta s/B, gamma_reduce s/B


@pytest.fixture
def m():
    return Machine.simple(alpha=A, beta=BETA, gamma_reduce=GR)


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-18)


def test_bcast_hand_values(m):
    # binomial, p = 8, B = 1000: 3 (alpha + 1000 beta)
    assert C.bcast_binomial(1000, 8, m) == approx(3 * (A + 1000 * BETA))
    # p = 5: ceil(log2 5) = 3 steps
    assert C.bcast_binomial(1000, 5, m) == approx(3 * (A + 1000 * BETA))
    # van de Geijn, p = 8, B = 8000: scatter 4000, 2000, 1000; allgather 1000, 2000, 4000
    assert C.bcast_scatter_recursive_doubling_allgather(8000, 8, m) == approx(
        6 * A + 14000 * BETA)
    # = 2 lg p alpha + 2 (p-1)/p B beta
    assert 6 * A + 14000 * BETA == approx(2 * 3 * A + 2 * 7 / 8 * 8000 * BETA)
    # scatter + ring allgather: 3 + 7 messages
    assert C.bcast_scatter_ring_allgather(8000, 8, m) == approx(10 * A + 14000 * BETA)


def test_reduce_allreduce_hand_values(m):
    # binomial reduce p = 4, B = 1000: 2 (alpha + B beta + B gamma_r)
    assert C.reduce_binomial(1000, 4, m) == approx(2 * (A + 1000 * BETA + 1000 * GR))
    # Rabenseifner reduce p = 4, B = 4000: halving 2000, 1000 with reduction; gather back
    assert C.reduce_scatter_gather(4000, 4, m) == approx(4 * A + 6000 * BETA + 3000 * GR)
    # ring all-reduce p = 4, B = 4000: 6 steps of 1000 B, 3 chunk reductions
    assert C.allreduce_ring(4000, 4, m) == approx(6 * (A + 1000 * BETA) + 3000 * GR)
    # Rabenseifner all-reduce = 2 lg p alpha + 2 (p-1)/p B beta + (p-1)/p B gamma_r
    assert C.allreduce_reduce_scatter_allgather(4000, 4, m) == approx(
        4 * A + 6000 * BETA + 3000 * GR)
    # recursive doubling p = 8: 3 full exchanges with reduction
    assert C.allreduce_recursive_doubling(100, 8, m) == approx(3 * (A + 100 * BETA + 100 * GR))
    # p = 6 (not a power of two): fold 2 in (1 exchange + reduce), send back, 2 steps on 4
    assert C.allreduce_recursive_doubling(100, 6, m) == approx(
        2 * (A + 100 * BETA) + 100 * GR + 2 * (A + 100 * BETA + 100 * GR))


def test_allgather_reduce_scatter_sendrecv_barrier(m):
    # nbytes is the per-rank contribution: ring p = 4 of 1000 B -> 3 steps of 1000 B
    assert C.allgather_ring(1000, 4, m) == approx(3 * (A + 1000 * BETA))
    assert C.allgather_recursive_doubling(1000, 4, m) == approx(2 * A + 3000 * BETA)
    assert C.allgather_bruck(1000, 6, m) == approx(3 * A + 5000 * BETA)   # 1, 2, 2 blocks
    assert C.reduce_scatter_pairwise(4000, 4, m) == approx(3 * (A + 1000 * (BETA + GR)))
    assert C.reduce_scatter_recursive_halving(4000, 4, m) == approx(
        2 * A + 3000 * (BETA + GR))
    assert C.sendrecv(5000, 2, m) == approx(A + 5000 * BETA)
    assert C.barrier_dissemination(0, 16, m) == approx(4 * A)
    for fn in (C.bcast_binomial, C.allreduce_ring, C.sendrecv, C.reduce_scatter_gather):
        assert fn(1000, 1, m) == 0.0


def test_regimes_per_message_size():
    link = Link(alpha_small=1e-6, beta_small=1e-9, alpha_large=10e-6, beta_large=1e-10,
                eager_threshold=1000)
    m = Machine(name="r", source="t", cores=1, intra=link, gamma_gemm={"float64": [[1, 1e-9]]},
                gamma_reduce=0.0)
    # ring all-reduce of 4000 B on 8 ranks: chunks of 500 B are small messages
    assert C.allreduce_ring(4000, 8, m) == approx(14 * (1e-6 + 500e-9))
    # binomial bcast of 4000 B: large messages
    assert C.bcast_binomial(4000, 2, m) == approx(10e-6 + 4000e-10)


def test_paper_mode(m):
    # Optimus eq. (4) and (5): alpha is omitted even though the machine has one
    cost = collective_time("bcast", 8000, 16, m, mode="paper")
    assert cost == (approx(4 * BETA * 8000), "paper")
    assert collective_time("reduce", 8000, 16, m, mode="paper").seconds == approx(
        4 * BETA * 8000)
    assert collective_time("allreduce", 8000, 4, m, mode="paper").seconds == approx(
        2 * BETA * 3 * 8000 / 4)
    assert collective_time("sendrecv", 8000, 4, m, mode="paper").seconds == approx(BETA * 8000)
    assert collective_time("barrier", 0, 4, m, mode="paper").seconds == 0.0


@pytest.mark.parametrize("op,nbytes,p,expected", [
    ("bcast", 12287, 16, "binomial"),
    ("bcast", 12288, 16, "scatter_recursive_doubling_allgather"),
    ("bcast", 1 << 20, 4, "binomial"),                  # p < BCAST_MIN_PROCS
    ("bcast", 524287, 16, "scatter_recursive_doubling_allgather"),
    ("bcast", 524288, 16, "scatter_ring_allgather"),
    ("bcast", 20000, 12, "scatter_ring_allgather"),      # not a power of two
    ("reduce", 2048, 16, "binomial"),
    ("reduce", 2056, 16, "reduce_scatter_gather"),
    ("reduce", 4000, 1024, "binomial"),                  # 500 items < p' = 1024
    ("allreduce", 2048, 4, "recursive_doubling"),
    ("allreduce", 1 << 20, 6, "reduce_scatter_allgather"),
    ("allgather", 65535, 8, "recursive_doubling"),       # total 524280 < 524288
    ("allgather", 65536, 8, "ring"),
    ("allgather", 13653, 6, "bruck"),                    # total 81918 < 81920
    ("allgather", 13654, 6, "ring"),
    ("reduce_scatter", 1000, 4, "recursive_halving"),
    ("reduce_scatter", 1 << 20, 4, "pairwise"),
    ("sendrecv", 10, 4, "sendrecv"),
    ("barrier", 0, 4, "dissemination"),
    ("bcast", 10 ** 6, 1, "none"),
])
def test_mpich_selection(op, nbytes, p, expected):
    assert select_algorithm(op, nbytes, p) == expected


def test_thresholds_from_env_and_forcing(m):
    th = Thresholds.from_env({"MPIR_CVAR_BCAST_SHORT_MSG_SIZE": "100", "PATH": "/bin"})
    assert th.bcast_short_msg_size == 100 and th.bcast_long_msg_size == 524288
    assert select_algorithm("bcast", 200, 16, th) == "scatter_recursive_doubling_allgather"
    assert collective_time("bcast", 200, 16, m, thresholds=th).algorithm == \
        "scatter_recursive_doubling_allgather"
    with pytest.raises(ValueError, match="MPIR_CVAR_BCAST_MIN_PROCS"):
        Thresholds.from_env({"MPIR_CVAR_BCAST_MIN_PROCS": "eight"})
    forced = collective_time("bcast", 1 << 20, 16, m, algorithm="binomial")
    assert forced == (approx(4 * (A + (1 << 20) * BETA)), "binomial")
    with pytest.raises(ValueError, match="unknown bcast algorithm 'ring'"):
        collective_time("bcast", 100, 4, m, algorithm="ring")
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        collective_time("gather", 100, 4, m)
    with pytest.raises(ValueError, match="unknown mode"):
        collective_time("bcast", 100, 4, m, mode="openmpi")
    assert collective_time("allreduce", 10 ** 6, 1, m) == (0.0, "none")


def test_inter_link_used():
    m = Machine(name="two", source="t", cores=8, node_size=8,
                intra=Link(1e-6, 1e-10, 1e-6, 1e-10, 0), inter=Link(1e-5, 1e-9, 1e-5, 1e-9, 0),
                gamma_gemm={"float64": [[1, 1e-12]]}, gamma_reduce=0.0)
    assert collective_time("sendrecv", 1000, 2, m).seconds == approx(1e-6 + 1000e-10)
    assert collective_time("sendrecv", 1000, 2, m, inter=True).seconds == approx(1e-5 + 1e-6)
