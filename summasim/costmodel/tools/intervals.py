"""Prediction intervals from the dev set, checked by leaving one source out.

Residuals
---------
The residual of a priced dev-set point (:mod:`~summasim.costmodel.tools.devset`) is

    r = log(published / predicted)   for a time-like kind (seconds: :data:`TIME_KINDS`)
    r = log(predicted / published)   for a rate-like kind (throughput, bandwidth, MFU,
                                     efficiency: :data:`RATE_KINDS`)

so that ``r > 0`` always means the model is too optimistic (it predicts the work done
faster than it was): a time predicted as ``t`` was published as ``t exp(r)``, a rate
predicted as ``x`` as ``x exp(-r)``. Logs make a 2x miss either way the same size and
let a rate's residual and a time's share one pool (a rate is work over a time).

Intervals
---------
:func:`interval` turns a prediction and a pool of residuals into a ``level`` interval:
the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles ``q_lo, q_hi`` of the residuals
(Hyndman & Fan 1996 type 7, linear interpolation between order statistics, numpy's
default) when the pool holds at least :data:`MIN_EMPIRICAL` residuals; with fewer (down
to :data:`MIN_NORMAL`) the quantiles of a normal distribution with the residuals' mean and
sample standard deviation; with fewer still, no interval (``None``). A predicted time
``t`` gives the interval ``[t exp(q_lo), t exp(q_hi)]`` for the real time; a predicted
rate ``x`` gives ``[x exp(-q_hi), x exp(-q_lo)]``.

Points come in sources
----------------------
The points of one publication share a cluster, a code base and a way of measuring, so
their residuals are not independent: the model is off by about the same for all of
them (the FSDP points of one blog are all too fast by 0.1-0.55, the Megatron-LM ones of
one paper by 0-0.13). Plain quantiles of the pooled residuals then describe the big
sources' points, not the next publication's, and left-one-source-out they cover far
less than they claim (60% of the points for an 80% interval on today's dev set). :func:`source_bounds`
treats the residuals as a one-way random-effects model, ``r = mu + a_source + e``, with
a between-source variance ``tau^2`` and a within-source variance ``sigma^2``:

- ``sigma^2`` is the pooled within-source variance (``sum (r - mean_s)^2 / (N - k)``;
  0 when every source has one point),
- ``tau^2 = max(0, S^2 - sigma^2 mean(1/n_s))`` with ``S^2`` the sample variance of the
  ``k`` source means (the method of moments of DerSimonian & Laird 1986, for unequal
  source sizes in its simplest, unweighted form),
- ``mu`` the mean of the source means (each publication counts once),

and the prediction interval for a point of a new source is ``mu +- z sqrt(tau^2 +
sigma^2 + Var(mu))`` with ``Var(mu) = (tau^2 + sigma^2 mean(1/n_s)) / k`` and ``z`` the
normal quantile (the predictive distribution of a new study's effect, Higgins, Thompson
& Spiegelhalter 2009, "A re-evaluation of random-effects meta-analysis", J. R. Stat.
Soc. A 172, section 3.4; they widen it with Student's t on ``k - 2`` degrees of freedom
for few studies, which on today's dev set covers 97% of the points for an 80% claim,
against 85-89% with ``z``: the check decides, :func:`loso_rows`). It needs at least
:data:`MIN_SOURCES` sources; with fewer, the plain quantiles above.

Pools and leave-one-source-out
------------------------------
The *step* pool holds the end-to-end training points (:data:`STEP_KINDS`: step times,
throughputs in FLOP/s and tokens/s, MFU); the *collective* pool the NCCL-tests points.
Points whose number a preset was derived from (``used_in_preset``) are in neither.
:func:`loso_rows` gives every priced point the interval built from the residuals of its
pool **without any point of its own source** (``source_key``: a publication, whose points
share a cluster, code base and way of measuring, so are not independent), and says
whether the published value lies inside; :func:`coverage` is the fraction inside, to be
read next to the claimed level. Layer times and weak-scaling efficiencies are not in the
step pool but are checked against it (the interval a user would be shown).

Nothing in the cost model is fitted to the dev set, so a point's leave-one-source-out
prediction and error are its in-sample ones; what leaving the source out changes is the
interval, which no longer contains the point's own residual.

:func:`summasim.costmodel.tools.devset.step_interval` is the interval the ``predict``
and ``plan`` commands print next to a step time: the step pool of the whole dev set.
"""

from __future__ import annotations

import math
from statistics import NormalDist

#: Kinds whose value is a time (seconds, or a fixed multiple): r = log(published / predicted).
TIME_KINDS = ("step_time", "composition_step_time", "layer_time")
#: Kinds whose value is a rate: r = log(predicted / published).
RATE_KINDS = ("nccl_busbw", "weak_efficiency", "composition_throughput", "composition_tokens",
              "mfu")
#: End-to-end training kinds: the residuals behind ``devset.step_interval``.
STEP_KINDS = ("step_time", "composition_step_time", "composition_throughput",
              "composition_tokens", "mfu")
#: Fewest residuals for empirical quantiles; below it the normal approximation.
MIN_EMPIRICAL = 10
#: Fewest residuals for the normal approximation; below it no interval.
MIN_NORMAL = 3
#: Fewest sources for the random-effects interval (a between-source variance from at
#: least two others' means, once a source is left out).
MIN_SOURCES = 3


def residual(predicted: float, published: float, kind: str) -> float:
    """``log(published / predicted)`` for a time-like kind, ``log(predicted /
    published)`` for a rate-like one: > 0 when the model is too optimistic (predicts
    the work done faster than it was)."""
    if not (predicted > 0 and published > 0 and math.isfinite(predicted)
            and math.isfinite(published)):
        raise ValueError(f"residual needs finite positive values, got {predicted!r}, "
                         f"{published!r}")
    if kind in TIME_KINDS:
        return math.log(published / predicted)
    if kind in RATE_KINDS:
        return math.log(predicted / published)
    raise ValueError(f"no residual for kind {kind!r}")


def family(kind: str) -> str:
    """The pool a kind's interval is drawn from: ``collective`` (NCCL-tests) or ``step``."""
    return "collective" if kind == "nccl_busbw" else "step"


def quantile(xs, q: float) -> float:
    """The ``q`` quantile of ``xs`` by linear interpolation between order statistics
    (Hyndman & Fan 1996, type 7): position ``(n - 1) q`` of the sorted values."""
    v = sorted(xs)
    if not v or not 0 <= q <= 1:
        raise ValueError(f"quantile of {len(v)} values at q = {q!r}")
    pos = (len(v) - 1) * q
    i = math.floor(pos)
    j = min(i + 1, len(v) - 1)
    return v[i] + (pos - i) * (v[j] - v[i])


def residual_bounds(residuals, level: float = 0.8) -> tuple[float, float, str] | None:
    """``(q_lo, q_hi, method)``: the ``(1 -+ level) / 2`` quantiles of the residuals,
    empirical (``"empirical"``, at least :data:`MIN_EMPIRICAL` residuals) or of the fitted
    normal (``"normal"``, at least :data:`MIN_NORMAL`); None with fewer."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    rs = [float(r) for r in residuals]
    if any(not math.isfinite(r) for r in rs):
        raise ValueError("residuals must be finite")
    a = (1.0 - level) / 2.0
    if len(rs) >= MIN_EMPIRICAL:
        return quantile(rs, a), quantile(rs, 1.0 - a), "empirical"
    if len(rs) >= MIN_NORMAL:
        mean = sum(rs) / len(rs)
        sd = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        z = NormalDist().inv_cdf(1.0 - a)
        return mean - z * sd, mean + z * sd, "normal"
    return None


def source_bounds(pairs, level: float = 0.8) -> tuple[float, float, str] | None:
    """``(q_lo, q_hi, "random-effects")`` for ``pairs`` of ``(source, residual)``: the
    ``level`` prediction interval of a residual of a new source (module docstring);
    :func:`residual_bounds` of the residuals when there are fewer than
    :data:`MIN_SOURCES` sources."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    groups: dict = {}
    for src, r in pairs:
        r = float(r)
        if not math.isfinite(r):
            raise ValueError("residuals must be finite")
        groups.setdefault(src, []).append(r)
    k = len(groups)
    if k < MIN_SOURCES:
        return residual_bounds([r for _, r in pairs], level)
    means = [sum(v) / len(v) for v in groups.values()]
    n_total = sum(len(v) for v in groups.values())
    within = sum((r - m) ** 2 for v, m in zip(groups.values(), means) for r in v)
    sigma2 = within / (n_total - k) if n_total > k else 0.0
    mu = sum(means) / k
    s2 = sum((m - mu) ** 2 for m in means) / (k - 1)
    inv_n = sum(1.0 / len(v) for v in groups.values()) / k
    tau2 = max(0.0, s2 - sigma2 * inv_n)
    var_mu = (tau2 + sigma2 * inv_n) / k
    half = NormalDist().inv_cdf((1.0 + level) / 2.0) * math.sqrt(tau2 + sigma2 + var_mu)
    return mu - half, mu + half, "random-effects"


def interval(prediction: float, kind: str, residuals, level: float = 0.8, *,
             sources=None):
    """The ``level`` interval ``(lo, hi)`` for the real value of a ``kind`` predicted as
    ``prediction`` (seconds for a time-like kind, the rate's unit for a rate-like one),
    from the residuals' quantiles (:func:`residual_bounds`); None when there are too
    few residuals.

    A time: ``(t exp(q_lo), t exp(q_hi))``; a rate: ``(x exp(-q_hi), x exp(-q_lo))``.
    With ``sources`` (one per residual), the random-effects bounds of
    :func:`source_bounds`.
    """
    if not (prediction > 0 and math.isfinite(prediction)):
        raise ValueError(f"prediction must be finite and positive, got {prediction!r}")
    bounds = (residual_bounds(residuals, level) if sources is None
              else source_bounds(list(zip(sources, residuals)), level))
    if bounds is None:
        return None
    q_lo, q_hi, _ = bounds
    if kind in TIME_KINDS:
        return prediction * math.exp(q_lo), prediction * math.exp(q_hi)
    if kind in RATE_KINDS:
        return prediction * math.exp(-q_hi), prediction * math.exp(-q_lo)
    raise ValueError(f"no interval for kind {kind!r}")


def _scored(rows):
    """The priced rows not used in a preset, each with its residual and family."""
    out = []
    for r in rows:
        if r["predicted"] is None or r.get("used_in_preset"):
            continue
        out.append({**r, "residual": residual(r["predicted"], r["published"], r["kind"]),
                    "family": family(r["kind"])})
    return out


def _pool(scored, fam):
    return [s for s in scored if s["family"] == fam
            and (fam != "step" or s["kind"] in STEP_KINDS)]


def loso_rows(rows, level: float = 0.8) -> list[dict]:
    """Leave-one-source-out intervals of the priced points of ``rows``
    (:func:`~summasim.costmodel.tools.devset.evaluate_all`'s rows; calibration points
    left out).

    Returns
    -------
    list of dict
        Per point: ``id``, ``source_key``, ``kind``, ``family``, ``published``,
        ``predicted``, ``residual``, ``n`` (residuals in the pool once its own source
        is left out), ``method`` (``random-effects``, or with fewer than
        :data:`MIN_SOURCES` other sources ``empirical``/``normal``; None), ``lo``, ``hi``
        (None without an interval) and ``covered`` (``lo <= published <= hi``, None
        without an interval).
    """
    scored = _scored(rows)
    out = []
    for s in scored:
        others = [o for o in _pool(scored, s["family"]) if o["source_key"] != s["source_key"]]
        pool = [o["residual"] for o in others]
        srcs = [o["source_key"] for o in others]
        bounds = source_bounds(list(zip(srcs, pool)), level)
        iv = None if bounds is None else interval(s["predicted"], s["kind"], pool, level,
                                                  sources=srcs)
        out.append({"id": s["id"], "source_key": s["source_key"], "kind": s["kind"],
                    "family": s["family"], "published": s["published"],
                    "predicted": s["predicted"], "residual": s["residual"], "n": len(pool),
                    "method": None if bounds is None else bounds[2],
                    "lo": None if iv is None else iv[0], "hi": None if iv is None else iv[1],
                    "covered": None if iv is None else iv[0] <= s["published"] <= iv[1]})
    return out


def coverage(loso) -> float | None:
    """Fraction of the :func:`loso_rows` with an interval whose published value lies
    inside it (None when no row has one)."""
    judged = [r["covered"] for r in loso if r["covered"] is not None]
    return sum(judged) / len(judged) if judged else None
