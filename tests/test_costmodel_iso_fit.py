"""Isoefficiency exponents under the papers' assumptions; synthetic alpha/beta fits."""

import dataclasses

import numpy as np
import pytest

from summasim.costmodel.tools.isoefficiency import isoefficiency, paper_machine, reference_slope
from summasim.costmodel.tools.isoefficiency import illinois_root, loglog_slope
from summasim.costmodel.machine import MAX_LINK_BANDWIDTH, Machine, sanity_problems
from summasim.costmodel.machine.regression import (fit_alpha_beta, fit_regimes, log_sizes,
                                                   median_rel_err)

P2 = [2 ** k for k in range(4, 17)]        # 16 .. 65536
P4 = [4 ** k for k in range(2, 9)]         # 16 .. 65536, perfect squares


def test_megatron_is_p_cubed():
    r = isoefficiency("megatron", 0.5, P2)
    assert r.p == P2 and all(np.isfinite(r.W))
    assert abs(r.slope - 3.0) <= 0.25


def test_optimus_is_sqrt_p_log_p_cubed():
    r = isoefficiency("optimus", 0.5, P2)        # non-squares are skipped
    assert r.p == P4
    ref = reference_slope("(sqrt(p) log p)^3", P4)
    assert abs(r.slope - ref) <= 0.25
    assert r.slope < isoefficiency("megatron", 0.5, P4).slope - 0.5   # scales better


@pytest.mark.parametrize("problem", ["cannon", "summa"])
def test_matmul_is_p_to_1_5(problem):
    # n x n matrices; alpha = 0; SUMMA broadcasts with MPICH's long-message algorithm
    r = isoefficiency(problem, 0.5, P4, mode="mpich")
    assert abs(r.slope - 1.5) <= 0.25


def test_summa_with_paper_broadcast_is_slower_growing_than_megatron():
    # with the paper's log(q) beta B broadcast, SUMMA's W grows like (sqrt(p) log p)^3
    r = isoefficiency("summa", 0.5, P4, mode="paper")
    assert abs(r.slope - reference_slope("optimus", P4)) <= 0.25


def test_efficiency_is_met_and_solvers_agree():
    m = paper_machine()
    a = isoefficiency("optimus", 0.6, [64, 256], machine=m)
    b = isoefficiency("optimus", 0.6, [64, 256], machine=m, solver="illinois")
    assert np.allclose(a.x, b.x, rtol=1e-8)
    # a larger efficiency needs a larger problem
    c = isoefficiency("optimus", 0.8, [64, 256], machine=m)
    assert all(x8 > x6 for x8, x6 in zip(c.x, a.x))
    with pytest.raises(ValueError, match="efficiency E"):
        isoefficiency("optimus", 1.2, [16])
    with pytest.raises(ValueError, match="unknown problem"):
        isoefficiency("fox", 0.5, [16])
    assert illinois_root(lambda x: x * x - 2, 0.0, 2.0) == pytest.approx(2 ** 0.5, rel=1e-10)
    assert loglog_slope([1, 10, 100], [2, 2000, 2e6]) == pytest.approx(3.0)


# -- fitting ------------------------------------------------------------------------------
def test_fit_recovers_known_alpha_beta_exactly():
    sizes = np.array(log_sizes(8, 1 << 20, 4), float)
    t = 3e-6 + 2e-10 * sizes
    f = fit_alpha_beta(sizes, t)
    assert f.alpha == pytest.approx(3e-6, rel=1e-6)
    assert f.beta == pytest.approx(2e-10, rel=1e-6)
    assert f.median_rel_err < 1e-6


def test_fit_two_regimes_with_noise_and_outliers():
    rng = np.random.default_rng(5)
    sizes = np.array(log_sizes(8, 64 << 20, 2), float)
    true = np.where(sizes < 8192, 2.0e-6 + 1e-10 * sizes, 6.0e-6 + 2.5e-10 * sizes)
    t = true * (1 + 0.03 * rng.standard_normal(sizes.size))
    t[[3, 15]] *= 4.0                  # two descheduled measurements
    rf = fit_regimes(sizes, t)         # threshold found, not given
    assert rf.threshold == 8192
    assert rf.small.alpha == pytest.approx(2.0e-6, rel=0.1)
    assert rf.large.alpha == pytest.approx(6.0e-6, rel=0.15)
    assert rf.large.beta == pytest.approx(2.5e-10, rel=0.05)
    assert rf.small.median_rel_err < 0.05 and rf.large.median_rel_err < 0.05
    link = rf.link()
    assert link.eager_threshold == 8192 and link.beta(1 << 20) == rf.large.beta
    # a given threshold is used as is
    assert fit_regimes(sizes, t, threshold=4096).threshold == 4096
    assert median_rel_err([1.1, 0.9, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(0.1)


def test_a_small_regime_whose_slope_latency_hides_takes_the_large_regimes():
    """Timed on an oversubscribed machine, the few sizes below the eager threshold can
    fall with size (noise over a flat latency): an unconstrained slope is then 0, an
    infinite bandwidth the sanity check refuses. The small regime takes the large
    regime's slope instead; a slope the points do resolve is kept as fitted."""
    sizes = np.array(log_sizes(8, 64 << 20, 4), float)
    small = sizes < 8192
    t = np.where(small, 40e-6 * (1 - 0.02 * np.log2(sizes / 8) / 10), 6e-6 + 2.5e-10 * sizes)
    rf = fit_regimes(sizes, t, 8192)
    assert rf.large.beta == pytest.approx(2.5e-10, rel=1e-3)
    assert rf.small.beta in (rf.large.beta, 1 / MAX_LINK_BANDWIDTH)
    assert rf.small.alpha == pytest.approx(40e-6, rel=0.05)
    assert rf.small.median_rel_err < 0.02
    # flat small points next to a slow large path: the large slope would over-predict
    # the largest small message by 3x; latency alone fits them
    t3 = np.where(small, 1e-6, 6e-6 + 1e-9 * sizes)
    rf3 = fit_regimes(sizes, t3, 8192)
    assert rf3.small.beta == 1 / MAX_LINK_BANDWIDTH and rf3.small.median_rel_err < 0.01
    free = fit_alpha_beta(sizes[small], t[small])
    assert free.beta == 0.0 or 1 / free.beta > 1e12     # what the floor replaces
    machine = Machine.simple(alpha=1e-6, beta=1e-10, gamma=1e-10, cores=2)
    link = rf.link()
    assert not [x for x in sanity_problems(dataclasses.replace(machine, intra=link))
                if "link" in x]
    # a resolved small slope, steeper or shallower than the large one, is the fit's own
    for b in (1e-9, 1e-10):
        t2 = np.where(small, 2e-6 + b * sizes, 6e-6 + 2.5e-10 * sizes)
        assert fit_regimes(sizes, t2, 8192).small.beta == pytest.approx(b, rel=1e-3)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match=">= 2"):
        fit_alpha_beta([8], [1e-6])
    with pytest.raises(ValueError, match="times must be > 0"):
        fit_alpha_beta([8, 16], [1e-6, 0.0])


def test_fit_module_does_not_import_mpi_at_import_time():
    import subprocess
    import sys

    code = ("import sys, summasim.costmodel.machine.regression, summasim.costmodel.tools.explore; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_summa25_isoefficiency_solves_on_the_grids_spec_lists():
    """The SUMMA2.5 problems run on spec.grids' grids: a depth past the cube (d > q) is
    solved when asked for, and the default at each p is the deepest grid with d <= q,
    else the one nearest a cube ([2,2,4] at p = 16, where it is the only grid)."""
    from summasim import spec

    r = isoefficiency("summa25", 0.5, [16, 64], d=4)
    assert r.p == [16, 64] and r.grid == ["SUMMA2.5 [2,2,4]", "SUMMA2.5 [4,4,4]"]
    r = isoefficiency("summa25", 0.5, [8, 16, 32, 64, 256], solver="illinois")
    assert r.grid == ["SUMMA2.5 [2,2,2]", "SUMMA2.5 [2,2,4]", "SUMMA2.5 [4,4,2]",
                       "SUMMA2.5 [4,4,4]", "SUMMA2.5 [8,8,4]"]
    for p, label in zip(r.p, r.grid):
        assert label in {g.label for g in spec.grids(p, "summa25")}
    assert isoefficiency("summa25", 0.5, [4, 9], d=None).p == []   # no [q,q,d], q, d >= 2
    mm = isoefficiency("summa25_mm", 0.5, [16], d=4, mode="mpich")
    assert mm.grid == ["[2,2,4]"]
