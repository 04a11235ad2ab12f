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


# -- SUMMA2.5-LM: the closed form ------------------------------------------------------------
import math  # noqa: E402

from summasim.costmodel.tools.isoefficiency import (  # noqa: E402
    CLOSED_FORM_CASES, EXACT_SLOPE_TOL, LEADING_SLOPE_TOL, print_closed_forms,
    summa25_check, summa25_closed_form, summa25_exponent, summa25_overhead)
from summasim.costmodel.workload.layer import scheme_cost  # noqa: E402
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig  # noqa: E402

ISO_CFG = TransformerConfig(s=512, N=1, dtype="float32", checkpoint=True)   # isoefficiency's
VARIANTS = [ISO_CFG,
            ISO_CFG.replace(recompute="none", dtype="float64"),
            ISO_CFG.replace(recompute="selective", ffn=2),
            ISO_CFG.replace(attention="flash", s=1024, dtype="bfloat16"),
            ISO_CFG.replace(recompute="none", attention="flash", ffn=8 / 3)]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"{c.recompute}-{c.attention}-f{c.ffn:.3g}")
@pytest.mark.parametrize("q,d", [(2, 2), (4, 2), (2, 4), (4, 4), (8, 4), (3, 5), (2, 8)])
def test_summa25_overhead_is_the_cost_models_communication(q, d, cfg):
    """Phi beta w h^2 / p is scheme_cost's forward + backward seconds in paper mode, per
    grid (d > q and q not a power of two included) and training variant; nothing fitted."""
    m = paper_machine()
    h = 768.0
    cfg = cfg.replace(h=h, b=h / 64, n=12)
    c = cfg.replace(checkpoint=None)
    cost = scheme_cost(Scheme("summa25", d * q * q, q, d), cfg, m, mode="paper", compute=False)
    passes = 4 if cfg.recompute == "full" else 3
    phi = summa25_overhead(q, d, c=cfg.b * cfg.s / h, ffn=cfg.ffn, passes=passes)
    want = 1e-9 * cfg.itemsize * h * h * phi / (d * q * q)
    got = cost.forward.comm_seconds + cost.backward.comm_seconds
    assert got == pytest.approx(want, rel=1e-12), (c.recompute, got, want)


def test_summa25_overhead_at_d1_is_optimus_table1():
    """d = 1: 4 passes of Optimus Table 1's forward ``log(p)/(2 sqrt p) (7bsh + 12h^2)``
    times p, in units of beta w h^2: ``4 q log2 q (7 c + 12)``; no depth term."""
    for q in (2, 4, 8, 64):
        p, c = q * q, 8.0
        table1 = 4 * p * math.log2(p) / (2 * math.sqrt(p)) * (7 * c + 12)
        assert summa25_overhead(q, 1, c=c) == pytest.approx(table1, rel=1e-14)
    # the depth all-reduce is 2 (4+2f)(d-1), whatever q
    assert summa25_overhead(1, 5, c=8.0) == pytest.approx(2 * 12 * 4)


@pytest.mark.parametrize("cfg", VARIANTS[:4], ids=lambda c: f"{c.recompute}-{c.attention}")
@pytest.mark.parametrize("d,ps", [(2, [8, 32, 128, 512, 2048, 8192]),
                                  (4, [16, 64, 256, 1024, 4096]),
                                  (None, [16, 64, 256, 1024, 4096]),
                                  (None, [8, 64, 512, 4096, 32768])])      # the cube
def test_summa25_fitted_slope_is_the_closed_forms(d, ps, cfg):
    """The cost model's W(p) (root finding on scheme_cost) is the closed form's, point by
    point, so the fitted slope equals the closed form's within EXACT_SLOPE_TOL."""
    row = summa25_check(0.5, ps, d=d, cfg=cfg)
    assert len(row["grids"]) == len(ps)
    assert row["max_rel_W"] < 1e-9
    assert abs(row["measured_minus_closed"]) <= EXACT_SLOPE_TOL
    # brentq agrees too
    fit = isoefficiency("summa25", 0.5, ps, d=d, cfg=cfg)
    assert abs(fit.slope - summa25_closed_form(0.5, ps, d=d, cfg=cfg).slope) <= EXACT_SLOPE_TOL


def test_summa25_closed_form_reduces_to_optimus_at_d1():
    """At d = 1 the closed form is Optimus's: the fitted Optimus W point by point, and its
    leading order is exactly the paper's (sqrt(p) log p)^3 (Optimus section 3.1.2)."""
    closed = summa25_closed_form(0.5, P2, d=1)
    fit = isoefficiency("optimus", 0.5, P2)
    assert closed.p == fit.p == P4 and closed.grid == fit.grid
    assert np.allclose(closed.W, fit.W, rtol=1e-9)
    lead = summa25_closed_form(0.5, P4, d=1, order="leading")
    assert lead.slope == pytest.approx(reference_slope("(sqrt(p) log p)^3", P4), abs=1e-12)
    assert reference_slope("summa25 leading", P4, d=1) == pytest.approx(lead.slope)


@pytest.mark.parametrize("delta", [0.0, 0.2, 1 / 3])
def test_summa25_asymptotic_exponent(delta):
    """W ~ Phi^3 ~ (p^((1+delta)/2) log p)^3 with d ~ p^delta: 3/2 at a fixed d (Optimus's
    law), 2 at the cube. Far out (p ~ 2^60..2^90, real q and d) the closed form's local
    slope divided by that law's is flat."""
    e = summa25_exponent(delta)
    ps = np.logspace(60, 90, 7, base=2.0)
    d = 4.0 * np.ones_like(ps) if delta == 0 else ps ** delta
    q = np.sqrt(ps / d)
    W = np.array([summa25_overhead(qi, di, c=8.0) ** 3 for qi, di in zip(q, d)])
    law = ps ** e * np.log2(ps) ** 3
    assert abs(loglog_slope(ps, W / law)) < 0.01
    assert abs(loglog_slope(ps, W) - loglog_slope(ps, law)) < 0.01
    assert summa25_exponent(0) == 1.5 and summa25_exponent(1 / 3) == 2.0


class _Sink:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s


def test_summa25_measured_slopes_against_the_laws():
    """The printed table: over its ranges the fitted slope equals the exact closed
    form's, sits within LEADING_SLOPE_TOL above the leading order's (finite s makes it
    steeper), and at a fixed d within 0.25 of (sqrt(p) log p)^3, the tolerance the other
    schemes' laws get; at the cube the asymptotic p^2 log^3 p is not reached by
    p = 262144 (the activation term outweighs the weights' until d > (3+f) c/(4+2f) = 4.7)."""
    out = _Sink()
    rows = {r["case"]: r for r in print_closed_forms(0.5, out=out)}
    head = out.text.splitlines()[1]
    assert "slope_measured" in head and "slope_closed_form" in head
    assert set(rows) == {case for case, *_ in CLOSED_FORM_CASES}
    for case, r in rows.items():
        assert case in out.text
        assert abs(r["measured_minus_closed"]) <= EXACT_SLOPE_TOL
        assert 0 < r["slope_measured"] - r["slope_leading"] <= LEADING_SLOPE_TOL
    for case in ("d = 1 (Optimus)", "d = 2", "d = 4"):
        assert abs(rows[case]["slope_measured"] - rows[case]["slope_law"]) <= 0.25
    cube = rows["d = p^(1/3)"]
    assert cube["grids"][-1] == "SUMMA2.5 [64,64,64]"
    assert cube["slope_measured"] < cube["slope_law"] - 0.2
    assert cube["slope_measured"] > rows["d = 2"]["slope_measured"]


def test_summa25_reference_kinds_and_bad_input():
    P = [16, 64, 256, 1024]
    fit = isoefficiency("summa25", 0.5, P)
    assert reference_slope("summa25 closed form", P) == pytest.approx(fit.slope, abs=1e-9)
    assert reference_slope("summa25 closed form", P, E=0.7) != pytest.approx(fit.slope)
    # (p^(2/3) log2 p)^3 from 8 to 64: 2 + 3 ln(6/3) / ln(8) = 3
    assert reference_slope("(p^(2/3) log p)^3", [8, 64]) == pytest.approx(3.0, abs=1e-12)
    with pytest.raises(ValueError, match="unknown reference"):
        reference_slope("p^2", P)
    with pytest.raises(ValueError, match="order"):
        summa25_closed_form(0.5, P, order="first")
    with pytest.raises(ValueError, match="efficiency E"):
        summa25_closed_form(1.0, P)
    with pytest.raises(ValueError, match="papers' block"):
        summa25_closed_form(0.5, P, cfg=ISO_CFG.replace(mlp="swiglu"))
    with pytest.raises(ValueError, match="delta"):
        summa25_exponent(0.5)
    with pytest.raises(ValueError, match="q, d >= 1"):
        summa25_overhead(0, 2, c=1.0)
    assert summa25_closed_form(0.5, [4, 9]).p == []       # no [q,q,d] with q, d >= 2


# -- the 2.5D and 3D products: closed forms ---------------------------------------------------
from summasim.costmodel.tools.isoefficiency import (  # noqa: E402
    deep_closed_form, deep_grid, deep_overhead)
from summasim.costmodel.workload.traffic import algorithm_messages, moved_bytes  # noqa: E402

SCATTER_BCAST = {"bcast": "scatter_ring_allgather"}


@pytest.mark.parametrize("problem,d,ps", [("mm3d_mm", None, [8, 64, 512, 4096]),
                                          ("sd25_mm", None, [8, 64, 512, 4096]),
                                          ("sd25_mm", 2, [8, 32, 128, 512, 2048])])
def test_deep_fitted_slope_is_the_closed_forms(problem, d, ps):
    """The numerical isoefficiency of the 2.5D and 3D products (the cost model's events
    priced with bandwidth-optimal broadcasts, alpha = 0) is the closed form's, point by
    point: n at each p and the slope."""
    fit = isoefficiency(problem, 0.5, ps, mode="mpich", solver="illinois", d=d,
                        algorithms=SCATTER_BCAST)
    closed = deep_closed_form(problem, 0.5, ps, d=d)
    assert fit.p == closed.p == ps and fit.grid == closed.grid
    assert fit.x == pytest.approx(closed.x, rel=1e-6)
    assert fit.slope == pytest.approx(closed.slope, abs=1e-6)
    assert fit.slope == pytest.approx(reference_slope(f"{problem[:4]} closed form", ps, d=d),
                                      abs=1e-6)


def test_deep_laws_the_3d_product_tends_to_p_the_2_5d_one_at_fixed_c_to_p_1_5():
    cubes = [q ** 3 for q in (64, 128, 256, 512)]
    assert deep_closed_form("mm3d_mm", 0.5, cubes).slope == pytest.approx(
        reference_slope("(p^(1/3) - 1)^3", cubes)) and \
        reference_slope("(p^(1/3) - 1)^3", cubes) == pytest.approx(1.0, abs=0.02)
    fixed = [2 * q * q for q in (256, 512, 1024, 2048)]
    assert deep_closed_form("sd25_mm", 0.5, fixed, d=2).slope == pytest.approx(1.5, abs=0.01)


@pytest.mark.parametrize("problem,q,c", [("mm3d_mm", 2, 2), ("mm3d_mm", 4, 4),
                                         ("sd25_mm", 4, 2), ("sd25_mm", 4, 4),
                                         ("sd25_mm", 8, 2)])
def test_deep_overhead_is_the_events_words(problem, q, c):
    """deep_overhead's words are the closed-form events' words with every broadcast at
    2 (g-1)/g of its buffer (an all-gather's ledger entry is its own contribution)."""
    name = {"mm3d_mm": "mm3d_ab", "sd25_mm": "sd25_ab"}[problem]
    n = 4 * q * q * c
    words = 0.0
    for mc in algorithm_messages(name, n, n, n, q, c, itemsize=1, coords=(0, 0, 0)):
        g = mc.group_size
        factor = {"bcast": 2 * (g - 1) / g, "allgather": g - 1}.get(mc.op, 1.0)
        words += mc.count * mc.nbytes * factor
    if problem == "mm3d_mm":
        assert words == pytest.approx(moved_bytes(algorithm_messages(
            name, n, n, n, q, c, itemsize=1, coords=(0, 0, 0))))
    assert words / n ** 2 == pytest.approx(deep_overhead(problem, q, c))
    assert deep_grid(problem, c * q * q, None if problem == "mm3d_mm" or c == q else c) == \
        (q, c)
