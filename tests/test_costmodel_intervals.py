"""Intervals from the dev set's residuals, and their leave-one-source-out check.

Closed forms on synthetic residuals: the type-7 quantiles of 0..10, the normal
approximation below ten residuals, the mapping of a residual interval to a time and to
a rate, a leave-one-source-out case where the left-out source would have moved the
interval, and coverage counted by hand.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from summasim.costmodel.tools import intervals as iv


def _row(pid, key, kind, published, predicted, used=False):
    return {"id": pid, "source_key": key, "kind": kind, "published": published,
            "predicted": predicted, "used_in_preset": used}


def test_residual_sign_means_optimistic_for_times_and_rates():
    # time predicted shorter than published: optimistic, r > 0
    assert iv.residual(1.0, 2.0, "step_time") == pytest.approx(math.log(2.0))
    # rate predicted higher than published: optimistic, r > 0
    assert iv.residual(2.0, 1.0, "composition_tokens") == pytest.approx(math.log(2.0))
    assert iv.residual(2.0, 1.0, "composition_step_time") < 0
    with pytest.raises(ValueError):
        iv.residual(0.0, 1.0, "step_time")
    with pytest.raises(ValueError, match="kind"):
        iv.residual(1.0, 1.0, "pending")


def test_empirical_quantiles_are_type_7():
    rs = [float(k) for k in range(11)]                # 0..10: q-quantile = 10 q
    lo, hi, method = iv.residual_bounds(rs, 0.8)
    assert (lo, hi, method) == (pytest.approx(1.0), pytest.approx(9.0), "empirical")
    lo, hi, _ = iv.residual_bounds(list(reversed(rs)), 0.5)
    assert (lo, hi) == (pytest.approx(2.5), pytest.approx(7.5))
    assert iv.quantile([1.0, 3.0], 0.25) == pytest.approx(1.5)


def test_normal_approximation_below_the_minimum_count():
    rs = [-0.2, 0.0, 0.1, 0.3]                        # 4 < MIN_EMPIRICAL
    assert len(rs) < iv.MIN_EMPIRICAL
    mean = sum(rs) / 4
    sd = math.sqrt(sum((r - mean) ** 2 for r in rs) / 3)
    z = NormalDist().inv_cdf(0.9)
    lo, hi, method = iv.residual_bounds(rs, 0.8)
    assert method == "normal"
    assert (lo, hi) == (pytest.approx(mean - z * sd), pytest.approx(mean + z * sd))
    assert iv.residual_bounds(rs[:iv.MIN_NORMAL - 1], 0.8) is None
    assert iv.interval(1.0, "step_time", rs[:2]) is None


def test_interval_maps_residual_quantiles_to_times_and_rates():
    rs = [float(k) / 10 for k in range(11)]           # 10% and 90% quantiles: 0.1, 0.9
    # optimistic by 0.1-0.9 in log: the real time is longer than predicted
    lo, hi = iv.interval(2.0, "step_time", rs, 0.8)
    assert (lo, hi) == (pytest.approx(2.0 * math.exp(0.1)), pytest.approx(2.0 * math.exp(0.9)))
    # ... and the real rate lower
    lo, hi = iv.interval(2.0, "composition_tokens", rs, 0.8)
    assert (lo, hi) == (pytest.approx(2.0 * math.exp(-0.9)), pytest.approx(2.0 * math.exp(-0.1)))
    with pytest.raises(ValueError, match="level"):
        iv.interval(2.0, "step_time", rs, 1.0)


def test_loso_leaves_the_points_own_source_out():
    """Source "far" has one point with a residual of log 10; the ten others sit near
    zero. Left out, far's interval comes from the ten and misses its published value;
    had it been kept in, the pool's 90% quantile would have moved."""
    rows = [_row(f"near{k}", f"src{k}", "composition_step_time", 1.0, math.exp(0.01 * (k - 5)))
            for k in range(11)]
    rows.append(_row("far", "far", "composition_step_time", 10.0, 1.0))   # r = log 10
    rows.append(_row("calib", "calib", "composition_step_time", 1.0, 50.0, used=True))
    out = {r["id"]: r for r in iv.loso_rows(rows, 0.8)}
    assert "calib" not in out                          # calibration points: no row
    far = out["far"]
    assert far["n"] == 11 and far["method"] == "random-effects"
    own_out = [iv.residual(math.exp(0.01 * (k - 5)), 1.0, "composition_step_time")
               for k in range(11)]
    srcs = [f"src{k}" for k in range(11)]
    assert (far["lo"], far["hi"]) == pytest.approx(iv.interval(
        1.0, "composition_step_time", own_out, 0.8, sources=srcs))
    with_own = iv.interval(1.0, "composition_step_time", own_out + [math.log(10.0)], 0.8,
                           sources=srcs + ["far"])
    assert with_own[1] != pytest.approx(far["hi"])    # including it would change it
    assert far["covered"] is False
    assert out["near3"]["n"] == 11                     # the far point is in the others' pools


def test_loso_groups_points_of_one_source_and_separates_families():
    rows = [_row(f"a{k}", "A", "step_time", 1.0, 1.0) for k in range(5)]
    rows += [_row(f"b{k}", f"B{k}", "composition_throughput", 1.0, 1.0 + k / 100) for k in range(5)]
    rows += [_row(f"n{k}", f"N{k}", "nccl_busbw", 1.0, 1.0) for k in range(3)]
    rows.append(_row("pending", "P", "pending", 1.0, None))
    out = {r["id"]: r for r in iv.loso_rows(rows)}
    assert out["a0"]["n"] == 5                         # the other four A points are out too
    assert out["b0"]["n"] == 9
    assert out["n0"]["n"] == 2 and out["n0"]["lo"] is None and out["n0"]["covered"] is None
    assert "pending" not in out


def test_coverage_is_the_fraction_inside():
    loso = [{"covered": True}, {"covered": False}, {"covered": True}, {"covered": None},
            {"covered": True}]
    assert iv.coverage(loso) == pytest.approx(3 / 4)
    assert iv.coverage([{"covered": None}]) is None
    # end to end on synthetic rows: residuals 0..0.10 and one far point
    rows = [_row(f"p{k}", f"s{k}", "composition_step_time", 1.0, math.exp(k / 100))
            for k in range(11)]
    rows.append(_row("far", "far", "composition_step_time", 1.0, math.exp(1.0)))
    loso = iv.loso_rows(rows, 0.8)
    inside = sum(1 for r in loso if r["lo"] <= r["published"] <= r["hi"])
    assert iv.coverage(loso) == pytest.approx(inside / len(loso))
    assert 0 < inside < len(loso)


def test_random_effects_bounds_are_the_closed_form():
    """Three sources: A (0.0, 0.2), B (0.4), C (0.9, 1.0, 1.1). Source means 0.1, 0.4,
    1.0; mu = 0.5; within: (0.01 + 0.01 + 0 + 0.01 + 0 + 0.01) / (6 - 3) = 0.04 / 3;
    S^2 = ((0.4)^2 + (0.1)^2 + (0.5)^2) / 2 = 0.21; mean(1/n) = (1/2 + 1 + 1/3) / 3;
    tau^2 = S^2 - sigma^2 mean(1/n); Var(mu) = (tau^2 + sigma^2 mean(1/n)) / 3."""
    pairs = [("A", 0.0), ("A", 0.2), ("B", 0.4), ("C", 0.9), ("C", 1.0), ("C", 1.1)]
    lo, hi, method = iv.source_bounds(pairs, 0.8)
    sigma2, inv_n = 0.04 / 3, (0.5 + 1 + 1 / 3) / 3
    tau2 = 0.21 - sigma2 * inv_n
    sd = math.sqrt(tau2 + sigma2 + (tau2 + sigma2 * inv_n) / 3)
    z = 1.2815515655446004                                  # the normal's 90% quantile
    assert method == "random-effects"
    assert (lo, hi) == (pytest.approx(0.5 - z * sd), pytest.approx(0.5 + z * sd))
    # one source counts once however many points it has: ten copies of C's points
    many = pairs[:3] + [("C", r) for _, r in pairs[3:]] * 10
    assert iv.source_bounds(many, 0.8)[0] == pytest.approx(lo, abs=0.05)
    # with two sources, the plain quantiles
    assert iv.source_bounds(pairs[:3], 0.8)[2] == "normal"


def test_step_interval_uses_the_devset_training_residuals():
    from summasim.costmodel.tools import devset

    rs = devset.devset_residuals()
    assert len(rs) >= iv.MIN_EMPIRICAL and all(math.isfinite(r) for r in rs)
    lo, hi = devset.step_interval(10.0, 0.8)
    q_lo, q_hi, _ = iv.source_bounds(list(devset._devset_pairs()), 0.8)
    assert (lo, hi) == (pytest.approx(10.0 * math.exp(q_lo)), pytest.approx(10.0 * math.exp(q_hi)))
    lo90, hi90 = devset.step_interval(10.0, 0.9)
    assert lo90 <= lo <= hi <= hi90


def test_devset_loso_rows_cover_the_priced_points():
    from summasim.costmodel.tools import devset

    rows = devset.evaluate_all()
    loso = iv.loso_rows(rows)
    scored = [r for r in rows if r["error"] is not None and not r["used_in_preset"]]
    assert {r["id"] for r in loso} == {r["id"] for r in scored}
    for r in loso:
        if r["lo"] is not None:
            assert 0 < r["lo"] < r["hi"]
    s = devset.summary(rows)
    assert s["loso_mape"] == s["mape"] and s["coverage"] == pytest.approx(iv.coverage(loso))
