"""The communication lower bounds printed beside every product
(summasim.costmodel.workload.bounds): their closed forms, and their place in the report."""

import math

import pytest

from summasim.costmodel.workload import bounds
from summasim.algorithms.table import get_algorithm


def test_memory_independent_bound_is_the_loomis_whitney_form():
    n, p = 4096, 64
    want = 3 * n ** 2 / p ** (2 / 3) - 3 * n ** 2 / p          # square: 3 n^2 (p^-2/3 - 1/p)
    assert bounds.memory_independent_words(n, n, n, p) == pytest.approx(want)
    assert bounds.memory_independent_words(n, n, n, 1) == 0.0   # one processor sends nothing
    # rectangular: 3 (m k n / p)^(2/3) - (m k + k n + m n) / p
    assert bounds.memory_independent_words(100, 200, 300, 8) == pytest.approx(
        3 * (100 * 200 * 300 / 8) ** (2 / 3) - (100 * 200 + 200 * 300 + 100 * 300) / 8)


def test_memory_dependent_bound_is_irony_toledo_tiskin():
    n, p, mem = 8192, 1024, 3 * 8192 ** 2 / 1024      # the least memory: positive from p ~ 216
    want = n ** 3 / (2 * math.sqrt(2) * p * math.sqrt(mem)) - mem
    assert want > 0 and bounds.memory_dependent_words(n, n, n, p, mem) == pytest.approx(want)
    assert bounds.memory_dependent_words(n, n, n, 16, 3 * n * n / 16) == 0.0   # negative: 0
    # more memory never raises it
    assert bounds.memory_dependent_words(n, n, n, p, 4 * mem) <= \
        bounds.memory_dependent_words(n, n, n, p, mem)
    with pytest.raises(ValueError):
        bounds.memory_dependent_words(n, n, n, p, 0)


def test_a_product_holds_its_blocks_and_copies():
    m = k = n = 1024
    summa = bounds.product_bounds(get_algorithm("summa_ab").operands(m, k, n, 4, 1), m, k, n, 4, 1)
    assert summa["p"] == 16 and summa["memory_words"] == pytest.approx(3 * n * n / 16)
    # SUMMA2.5 on [2, 2, 4]: A and C split over d q^2 = 16 ranks, B copied over the depth
    s25 = bounds.product_bounds(get_algorithm("summa25_ab").operands(m, k, n, 2, 4), m, k, n, 2, 4)
    assert s25["memory_words"] == pytest.approx(2 * n * n / 16 + n * n / 4)
    assert s25["bound"] == max(s25["memory_dependent"], s25["memory_independent"]) > 0


def test_the_report_prints_words_over_the_bound():
    import types

    from summasim.harness.cases import MatmulCase
    from summasim.harness.report import format_row, row_record, words_over_bound

    case = MatmulCase("summa_ab", 4, 1, 1024, 1024, 1024, "float64")
    chk = types.SimpleNamespace(error=0.0, bound=1e-12, method="exact", ok=True,
                                nonfinite=False, false_pass=0.0, bad_ranks=[])
    words = 3 * 1024 * 1024 / 4                  # what SUMMA sends per rank here, roughly
    res = types.SimpleNamespace(case=case, p=16, check=chk, timing={}, seconds=0.0,
                                bytes_per_rank=8 * words, messages_per_rank=8,
                                peak_rss=0, fault="")
    w = words_over_bound(res)
    b = bounds.product_bounds(get_algorithm("summa_ab").operands(1024, 1024, 1024, 4, 1),
                              1024, 1024, 1024, 4, 1)
    assert w["ratio"] == pytest.approx(words / b["bound"]) and w["ratio"] > 1
    assert format_row(res).split()[-1] == f"{w['ratio']:.2f}"
    assert row_record(res)["lower_bounds"]["bound"] == b["bound"]


def test_replicated_inputs_lower_the_memory_independent_bound():
    """SUMMA2.5 on [1, 1, 4] starts with the whole weight on every rank: the bound is 0,
    and the algorithm sends nothing; on [2, 2, 4] it is positive."""
    n = 1024
    flat = bounds.product_bounds(get_algorithm("summa25_ab").operands(n, n, n, 1, 4), n, n, n, 1, 4)
    assert flat["memory_words"] == pytest.approx(n * n / 4 + n * n + n * n / 4)
    assert flat["memory_independent"] == 0.0 and flat["bound"] == 0.0
    even = bounds.memory_independent_words(n, n, n, 4)          # no copies: positive
    assert even > 0


def test_explore_prices_words_against_the_bounds():
    """explore's matrix table: SUMMA and Cannon move 2 n^2 / q words on the busiest rank
    (q broadcasts or shifts of each operand's (n/q)^2 block), over the bounds."""
    from summasim.costmodel.machine import load_preset
    from summasim.costmodel.tools.explore import matmul_table

    n = 4096
    rows = matmul_table(n, load_preset("dgx-a100"), [16, 64])
    for r in rows:
        if r["algorithm"] in ("summa_ab", "cannon_ab"):
            q = int(r["grid"].split(",")[0][1:])
            assert r["words"] == 2 * n * n // q
            b = bounds.memory_independent_words(n, n, n, q * q)
            assert r["bound_independent"] == pytest.approx(b)
            assert r["words_over_bound"] == pytest.approx(r["words"] / max(
                b, r["bound_dependent"])) and r["words_over_bound"] > 1


def test_the_3d_product_attains_the_memory_independent_bound():
    """mm3d_ab moves 3 (q-1)/q n^2/q^2 words per rank (its all-gathers counted as the
    q - 1 pieces they bring in): exactly 3 (n^3/p)^(2/3) - 3 n^2/p, the Loomis-Whitney
    bound with each operand held once."""
    from summasim.costmodel.workload.bounds import product_bounds
    from summasim.costmodel.workload.traffic import algorithm_messages, moved_bytes

    for q in (2, 3, 4):
        n = 6 * q * q
        words = moved_bytes(algorithm_messages("mm3d_ab", n, n, n, q, q, itemsize=1))
        assert words == 3 * (q - 1) * n * n // q ** 3
        b = product_bounds([((n, n), (q * q, q))] * 3, n, n, n, q, q)
        assert abs(words / b["memory_independent"] - 1) < 1e-12


def test_sd25_splits_the_steps_and_replicates_once():
    """sd25_ab on [q, q, c]: the layer's share of the q steps, two depth broadcasts and
    the ring all-reduce over c; with c = 1 it is summa_ab's traffic."""
    from summasim.costmodel.workload.traffic import algorithm_traffic

    n, q = 48, 4
    assert algorithm_traffic("sd25_ab", n, n, n, q, 1) == algorithm_traffic("summa_ab", n, n,
                                                                            n, q, 1)
    for c, k in ((2, 0), (3, 0), (3, 2)):
        t = algorithm_traffic("sd25_ab", n, n, n, q, c, coords=(0, 0, k))
        steps = q // c + (1 if k < q % c else 0)
        block = (n // q) ** 2 * 8
        assert t[("bcast", "row")] == (steps, steps * block)
        assert t[("bcast", "depth")] == (2, 2 * block)
        assert t[("sendrecv", "depth")][0] == 2 * (c - 1)


def test_crossovers_are_the_start_of_the_last_run_of_wins():
    """crossovers(): the smallest p from which a product beats SUMMA at every larger p of
    the sweep (a win followed by a loss is not a crossover), in time and in words."""
    from summasim.costmodel.tools.explore import crossovers

    def row(alg, p, seconds, words):
        return {"algorithm": alg, "p": p, "n": 64, "seconds": seconds, "words": words}

    rows = [row("summa_ab", p, 1.0, 100) for p in (2, 4, 8, 16, 32)]
    rows += [row("mm3d_ab", 2, 0.5, 50), row("mm3d_ab", 4, 2.0, 150),     # win, loss, then
             row("mm3d_ab", 8, 0.9, 90), row("mm3d_ab", 16, 0.8, 120),    # wins in time
             row("mm3d_ab", 32, 0.5, 40)]
    rows += [row("sd25_ab", 8, 0.9, 90), row("sd25_ab", 32, 1.5, 50)]    # loses at the end
    got = {c["algorithm"]: c for c in crossovers(rows)}
    assert (got["mm3d_ab"]["p_time"], got["mm3d_ab"]["p_words"]) == (8, 32)
    assert got["mm3d_ab"]["speedup"] == pytest.approx(2.0)
    assert got["mm3d_ab"]["words_ratio"] == pytest.approx(2.5)
    assert (got["sd25_ab"]["p_time"], got["sd25_ab"]["p_words"]) == (None, 8)
    rows = [r for r in rows if r["algorithm"] != "sd25_ab"]
    assert [c["algorithm"] for c in crossovers(rows)] == ["mm3d_ab"]   # sd25 never ran


def test_the_3d_product_crosses_summa_at_its_first_cube_in_words():
    """On every cube p the 3D product moves the memory-independent bound's words, fewer
    than SUMMA's on the most square grid of the same p: its words crossover is the first
    cube of the sweep, for any n."""
    from summasim.costmodel.machine import load_preset
    from summasim.costmodel.tools.explore import crossovers, matmul_table

    ps = [2 ** k for k in range(1, 10)]
    for n in (2560, 12288):
        rows = matmul_table(n, load_preset("dgx-a100"), ps)
        mm3d = {c["algorithm"]: c for c in crossovers(rows)}["mm3d_ab"]
        assert mm3d["p_words"] == 8 and mm3d["words_ratio"] > 1
        assert all(r["words_over_bound"] == pytest.approx(1.0) for r in rows
                   if r["algorithm"] == "mm3d_ab")
