"""The regression of a machine fit (pure): alpha/beta per message regime, robust to
outliers, and the shared-core, element-wise and reduction rates.

alpha and beta are fitted per regime (small / large messages, split at the eager
threshold: given, or chosen as the split that fits best) by robust least squares
on relative residuals, ``scipy.optimize.least_squares(loss="soft_l1")`` on
``(alpha + beta m) / t - 1``, so that 8-byte and 64-MiB points weigh alike and
outliers (a descheduled rank) do not drag the line. When latency hides the small
regime's slope it takes the large regime's beta or, where its points do not bear that
out, the fastest link's (latency alone), whichever fits them better, and only its
alpha is fitted. The microbenchmarks that time the points under MPI live in
:mod:`summasim.harness.fitbench`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..collectives import collective_time
from .link import Link, SharedCore
from .record import Machine
from .sanity import MAX_LINK_BANDWIDTH

MiB = 1 << 20


class FitRejected(RuntimeError):
    """A fit that :func:`~summasim.costmodel.machine.sanity_problems` refuses.

    Raised by :func:`run_fit` on every rank alike. ``problems`` lists what is wrong;
    ``machine`` is the refused Machine on rank 0 (None elsewhere), for a report.
    """

    def __init__(self, problems, machine=None):
        self.problems = list(problems)
        self.machine = machine
        super().__init__("the machine fit is physically implausible, refused: "
                         + "; ".join(self.problems)
                         + " (other work on the machine, or too few points: refit on a "
                           "quiet machine)")


@dataclass
class LinearFit:
    """``t = alpha + beta * m`` over some points (seconds, seconds/byte)."""

    alpha: float
    beta: float
    median_rel_err: float
    n: int

    def predict(self, sizes):
        return self.alpha + self.beta * np.asarray(sizes, float)


@dataclass
class RegimeFit:
    """Two regimes split at ``threshold`` bytes (small: m < threshold), and an
    optional third from ``huge_threshold`` on."""

    small: LinearFit
    large: LinearFit
    threshold: int
    huge: LinearFit | None = None
    huge_threshold: int | None = None

    def link(self) -> Link:
        extra = {}
        if self.huge is not None:
            extra = dict(huge_threshold=int(self.huge_threshold), alpha_huge=self.huge.alpha,
                         beta_huge=self.huge.beta)
        return Link(self.small.alpha, self.small.beta, self.large.alpha, self.large.beta,
                    int(self.threshold), **extra)

    def regimes(self):
        """``[(name, LinearFit, from_bytes)]`` of the fitted regimes."""
        out = [("small", self.small, 0), ("large", self.large, self.threshold)]
        if self.huge is not None:
            out.append(("huge", self.huge, self.huge_threshold))
        return out


def _soft_l1(r, scale):
    z = (r / scale) ** 2
    return float(np.sum(2.0 * (np.sqrt(1.0 + z) - 1.0)))


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *,
                   f_scale: float = 0.05, beta: float | None = None) -> LinearFit:
    """Robust fit of ``t = alpha + beta m`` with relative residuals (``alpha`` alone
    when ``beta`` is given).

    Parameters
    ----------
    sizes : sequence of float
        Message sizes m, bytes.
    times : sequence of float
        Measured seconds (> 0).
    f_scale : float
        Relative error beyond which a point counts as an outlier (soft L1).

    Returns
    -------
    LinearFit
        alpha (seconds) and beta (seconds/byte), both >= 0, and the median
        relative error of the fit.
    """
    from scipy.optimize import least_squares

    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    if m.shape != t.shape or m.size < 2:
        raise ValueError(f"need >= 2 (size, time) pairs of equal length, got {m.size}, {t.size}")
    if np.any(t <= 0) or np.any(m < 0):
        raise ValueError("times must be > 0 and sizes >= 0")
    # scale to microseconds and nanoseconds per byte so both unknowns are O(1)
    a_s, b_s = 1e-6, 1e-9
    w = 1.0 / t
    A = np.column_stack([w * a_s, w * m * b_s])
    x0, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    x0 = np.maximum(x0, 1e-6)

    def resid(x):
        return (x[0] * a_s + x[1] * b_s * m) / t - 1.0

    if beta is not None:                    # alpha alone, the slope given
        fixed = float(beta)
        res = least_squares(lambda x: resid([x[0], fixed / b_s]), x0[:1], bounds=(0.0, np.inf),
                            loss="soft_l1", f_scale=f_scale, x_scale="jac")
    else:
        res = least_squares(resid, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=f_scale,
                            x_scale="jac")
    alpha = float(res.x[0] * a_s)
    beta = fixed if beta is not None else float(res.x[1] * b_s)
    rel = np.abs((alpha + beta * m) / t - 1.0)
    return LinearFit(alpha, beta, float(np.median(rel)), int(m.size))


def _unresolved(fit: LinearFit) -> bool:
    """The fit's slope sits at the bound or implies a bandwidth no link has: latency
    hides it at these sizes (a few small messages, timed on a noisy or oversubscribed
    machine)."""
    return fit.beta <= 0 or 1.0 / fit.beta > MAX_LINK_BANDWIDTH


def _small_and_large(m, t, lo, hi, f_scale):
    """The two regimes' fits. A small regime whose slope the latency hides is given one:
    the large regime's (no message moves its bytes faster than the large-message path)
    or, when the small points do not bear that out, the fastest link's
    (``MAX_LINK_BANDWIDTH``: latency alone), whichever fits its points better; so the
    fit is not refused for an infinite bandwidth that no point measured."""
    fl = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale)
    fs = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale)
    if _unresolved(fs):
        slopes = [1.0 / MAX_LINK_BANDWIDTH] + ([fl.beta] if not _unresolved(fl) else [])
        fits = [fit_alpha_beta(m[lo], t[lo], f_scale=f_scale, beta=b) for b in slopes]
        fs = min(fits, key=lambda f: _soft_l1(f.predict(m[lo]) / t[lo] - 1, f_scale))
    return fs, fl


def fit_regimes(sizes: Sequence[float], times: Sequence[float], threshold: int | None = None,
                *, min_points: int = 3, f_scale: float = 0.05,
                max_split: float | None = None) -> RegimeFit:
    """Fit small- and large-message regimes.

    ``threshold`` (bytes) splits them (small: m < threshold); None tries every
    split leaving ``min_points`` on each side (and at most ``max_split`` bytes)
    and keeps the one with the smallest total soft-L1 relative loss. With too few
    points both regimes get one fit.
    """
    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    order = np.argsort(m)
    m, t = m[order], t[order]
    if threshold is None:
        cands = [c for c in np.unique(m)
                 if (m < c).sum() >= min_points and (m >= c).sum() >= min_points
                 and (max_split is None or c <= max_split)]
        if not cands:
            one = fit_alpha_beta(m, t, f_scale=f_scale)
            return RegimeFit(one, one, int(m.max()) + 1)
        best = None
        for c in cands:
            lo, hi = m < c, m >= c
            fs, fl = _small_and_large(m, t, lo, hi, f_scale)
            loss = (_soft_l1(fs.predict(m[lo]) / t[lo] - 1, f_scale)
                    + _soft_l1(fl.predict(m[hi]) / t[hi] - 1, f_scale))
            if best is None or loss < best[0]:
                best = (loss, RegimeFit(fs, fl, int(c)))
        return best[1]
    lo, hi = m < threshold, m >= threshold
    if lo.sum() < 2 or hi.sum() < 2:
        one = fit_alpha_beta(m, t, f_scale=f_scale)
        fs = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale) if lo.sum() >= 2 else one
        fl = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale) if hi.sum() >= 2 else one
        return RegimeFit(fs, fl, int(threshold))
    return RegimeFit(*_small_and_large(m, t, lo, hi, f_scale), int(threshold))


def library_eager_threshold(version: str) -> tuple[int | None, str]:
    """The byte size at which the MPI library named by ``version`` (the text of
    ``MPI.Get_library_version()``) changes protocol within a node, and why; ``(None,
    "best split")`` for a library whose threshold summasim does not know.

    MPICH ch4 sends messages below 8 KiB through its shared-memory eager cells and
    larger ones with the CMA single-copy protocol from
    ``MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD`` (default 8192, read from the environment
    when set).
    """
    if "MPICH" in version:
        raw = os.environ.get("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", "8192")
        try:
            return int(raw), "MPICH ch4: shm eager cells below it, CMA single copy from it"
        except ValueError:
            pass
    return None, "best split"


def split_huge(rf: RegimeFit, sizes, times, *, min_bytes: int = 1 << 20, min_points: int = 3,
               f_scale: float = 0.05, min_gain: float = 0.25) -> RegimeFit:
    """Split ``rf``'s large regime once more where that fits markedly better.

    Tries every split at or above ``min_bytes`` that leaves ``min_points`` on each
    side; keeps the best one when it lowers the large regime's soft-L1 loss by at
    least ``min_gain`` (a fraction), else (or when the large regime already fits
    within 1% median) returns ``rf`` unchanged. (On Linux,
    NumPy's arrays of 4 MiB and up sit on transparent huge pages and move faster.)
    """
    m = np.asarray(sizes, float)
    t = np.asarray(times, float)
    big = m >= rf.threshold
    m, t = m[big], t[big]
    if rf.large.median_rel_err < 0.01:           # one line already fits
        return rf
    base = _soft_l1(rf.large.predict(m) / t - 1, f_scale)
    best = None
    for c in np.unique(m):
        lo, hi = m < c, m >= c
        if c < min_bytes or lo.sum() < min_points or hi.sum() < min_points:
            continue
        fl = fit_alpha_beta(m[lo], t[lo], f_scale=f_scale)
        fh = fit_alpha_beta(m[hi], t[hi], f_scale=f_scale)
        loss = (_soft_l1(fl.predict(m[lo]) / t[lo] - 1, f_scale)
                + _soft_l1(fh.predict(m[hi]) / t[hi] - 1, f_scale))
        if best is None or loss < best[0]:
            best = (loss, fl, fh, int(c))
    if best is None or best[0] > (1.0 - min_gain) * base:
        return rf
    return RegimeFit(rf.small, best[1], rf.threshold, best[2], best[3])


def median_rel_err(predicted, measured) -> float:
    """``median |predicted / measured - 1|``."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return float(np.median(np.abs(p / m - 1.0)))


def log_sizes(min_bytes: int = 8, max_bytes: int = 64 * MiB, factor: int = 2) -> list[int]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (inclusive)."""
    out, s = [], int(min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out

def gamma_reduce_from_collectives(machine: Machine, colls, min_bytes: int = 65536):
    """Median seconds/byte of reduction implied by measured reduces and all-reduces.

    For each ``(op, group size, nbytes, seconds)`` with ``nbytes >= min_bytes``, the
    model time is ``t0 + g c`` (``t0`` with gamma_reduce = 0, ``c`` the reduced bytes
    of the algorithm MPICH picks); solve for g. None when there is no such point.
    """
    est = []
    zero = machine.replace(gamma_reduce=0.0, gamma_reduce_mpi=0.0)
    one = machine.replace(gamma_reduce=1.0, gamma_reduce_mpi=1.0)
    for op, g, s, t in colls:
        if op not in ("reduce", "allreduce") or not t or s < min_bytes:
            continue
        t0 = collective_time(op, s, g, zero, reduce_impl="mpi").seconds
        c = collective_time(op, s, g, one, reduce_impl="mpi").seconds - t0
        if c > 0:
            est.append(max(0.0, (t - t0) / c))
    return float(np.median(est)) if est else None


# -- models fitted on timed runs of summasim itself (the accuracy benchmark) -----------------
def fit_nonneg_linear(X, y, *, f_scale: float = 0.05) -> tuple[np.ndarray, float]:
    """Robust fit of ``y = X c`` with ``c >= 0`` on relative residuals ``X c / y - 1``.

    Parameters
    ----------
    X : array (n, k)
        Features, one row per measured run (any units; columns are rescaled to
        O(1) internally so that seconds and bytes can sit side by side).
    y : array (n,)
        Measured values (> 0).
    f_scale : float
        Relative error beyond which a run counts as an outlier (soft L1).

    Returns
    -------
    (coefficients, median relative error)
    """
    from scipy.optimize import least_squares

    X = np.asarray(X, float)
    y = np.asarray(y, float)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X must be (n, k) with n = len(y), got {X.shape} and {y.shape}")
    if X.shape[0] < X.shape[1]:
        raise ValueError(f"need at least {X.shape[1]} runs to fit {X.shape[1]} coefficients, "
                         f"got {X.shape[0]}")
    if np.any(y <= 0) or np.any(X < 0) or not np.all(np.isfinite(X)):
        raise ValueError("measured values must be > 0 and features finite and >= 0")
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    A = X / scale / y[:, None]
    x0 = np.maximum(np.linalg.lstsq(A, np.ones_like(y), rcond=None)[0], 1e-3)

    def resid(c):
        return A @ c - 1.0

    res = least_squares(resid, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=f_scale,
                        x_scale="jac")
    coef = res.x / scale
    return coef, float(np.median(np.abs(X @ coef / y - 1.0)))


def fit_shared_core(samples) -> tuple["SharedCore", float]:
    """Fit the oversubscription model of :class:`~summasim.costmodel.machine.SharedCore`.

    ``samples``: ``(R, features, measured_seconds)`` per timed run with R > 1
    (ranks per core), ``features`` a
    :class:`~summasim.costmodel.workload.predict.SharedFeatures` (per-rank CPU work, critical-path
    hops and their bytes, polled and waited for inside MPI). The model is ``t / R =
    work_factor W + hop_seconds H + mpi_hop_seconds H_mpi + hop_seconds_per_byte B +
    mpi_hop_seconds_per_byte B_mpi + sync_seconds``, fitted by
    :func:`fit_nonneg_linear`, where W leaves out the link copies of the hops that
    waited inside MPI when their bytes have a price of their own
    (:meth:`~summasim.costmodel.machine.SharedCore.charged_work`). When no run has a
    hop that waited inside MPI, ``mpi_hop_seconds`` cannot be fitted and is left None
    (such a hop is then priced as a polled one); when none carried bytes,
    ``mpi_hop_seconds_per_byte`` is left None likewise. Returns the SharedCore and the
    fit's median relative error.
    """
    samples = list(samples)
    for R, _, _ in samples:
        if R <= 1:
            raise ValueError(f"shared-core samples need R > 1 ranks per core, got R = {R}")
    blocking = any(f.mpi_hops > 0 for _, f, _ in samples)
    blocking_bytes = any(f.mpi_hop_bytes > 0 for _, f, _ in samples)
    need = 4 + blocking + blocking_bytes
    if len(samples) < need:
        raise ValueError(f"fit_shared_core needs at least {need} runs"
                         + (" when some wait inside MPI" if need > 4 else "")
                         + f", got {len(samples)}")
    # the work term as the fitted machine will charge it (one rule: SharedCore.charged_work)
    charged = SharedCore(mpi_hop_seconds_per_byte=0.0 if blocking_bytes else None).charged_work
    rows = [[charged(f.work, f.mpi_copy), f.hops, f.hop_bytes, 1.0]
            + [f.mpi_hops] * blocking + [f.mpi_hop_bytes] * blocking_bytes
            for _, f, _ in samples]
    c, err = fit_nonneg_linear(rows, [t / R for R, _, t in samples])
    c = [float(v) for v in c]
    rest = iter(c[4:])
    return SharedCore(work_factor=c[0], hop_seconds=c[1], hop_seconds_per_byte=c[2],
                      sync_seconds=c[3],
                      mpi_hop_seconds=next(rest) if blocking else None,
                      mpi_hop_seconds_per_byte=next(rest) if blocking_bytes else None), err


def fit_elementwise(samples) -> tuple[float, float, float]:
    """Fit a machine's ``gamma_elementwise`` and ``layer_seconds`` from serial
    training steps: ``samples`` are ``(gemm_seconds, items, layers, measured)``
    with the model ``measured = gemm_seconds + gamma_elementwise items +
    layer_seconds layers`` (the GEMM time from the machine's gamma_gemm).

    Returns ``(gamma_elementwise, layer_seconds, median relative error)``.

    A step measured faster than its GEMMs alone by more than 10% means gamma_gemm
    is wrong (ValueError). Within that, a step that came out faster (the GEMM fit
    runs two ranks on two cores, a serial step one: a few % either way, measured)
    makes the fit a non-negative least squares of the residuals relative to the
    measured times, which any sign of residual can enter.
    """
    from scipy.optimize import nnls

    samples = list(samples)
    if len(samples) < 2:
        raise ValueError(f"fit_elementwise needs at least 2 runs, got {len(samples)}")
    g = np.array([s[0] for s in samples], float)
    X = np.array([[s[1], s[2]] for s in samples], float)
    t = np.array([s[3] for s in samples], float)
    rest = t - g
    if np.any(rest < -0.10 * t):
        raise ValueError("a measured step is faster than its GEMMs alone by more than 10%: "
                         "refit gamma_gemm")
    if np.all(rest > 0):
        c, _ = fit_nonneg_linear(X, rest)
    else:
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
        c = nnls(X / scale / t[:, None], rest / t)[0] / scale
    err = float(np.median(np.abs((g + X @ c) / t - 1.0)))
    return float(c[0]), float(c[1]), err
