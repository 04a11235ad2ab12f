"""Rank-local validation and collective verdicts.

No rank holds a global operand. Each rank checks its own output block, regenerating
only the panels its block depends on (:mod:`summasim.harness.data`), one k-chunk at
a time, so a check needs memory of the order of the rank's own blocks.

Two methods for a product block ``C[I, J] = sum_l op(A)[I, K_l] op(B)[K_l, J]``:

``exact``      the float64 reference block and its scale ``|op(A)| |op(B)|`` from the
               panels, chunk by chunk: the per-entry error of
               :func:`summasim.validate.scaled_error` against
               ``tol(k) = 8 sqrt(k) (u + u_64)``. It costs the rank twice its share
               of the product's flops.
``freivalds``  t = 4 Gaussian probe vectors X [n_J, t]: compare ``C X`` with
               ``op(A) (op(B) X)`` row by row, against ``tol(k)`` times the row scale
               ``|op(A)| (|op(B)| |X|)`` plus the float64 rounding of the two
               matrix-vector products, ``8 (sqrt(n_J) + sqrt(k + n_J)) u_64``. Costs
               O(block size) flops per chunk instead of O(block * k). False pass: an
               error whose row 2-norm is ``F`` times the row threshold escapes one
               probe with probability at most ``sqrt(2/pi) / F`` (the probe sum is
               Gaussian with that standard deviation), all four with at most
               ``(0.8 / F)^4``: 4.1e-9 for F = 100 and below 1e-16 for errors
               10^4 times the threshold. It checks whole rows, so an error is caught
               when it exceeds the row's threshold, which is about ``n_J`` times
               looser than the per-entry one.

``auto`` uses ``exact`` while the reference costs at most 4 GFLOP per rank.

A verdict is never lost: each rank's check carries a non-finite flag (NaN or Inf in
the result, the reference or the error), and :func:`collective` gathers flags, not
a float maximum whose NaN a MAX reduction may drop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..layout import block_slices
from ..trace import untraced
from ..validate import LAMBDA, passes, scaled_error, tolerance, unit_roundoff
from .data import STREAM_A, STREAM_B, STREAM_RING, uniform_block, uniform_segment

METHODS = ("auto", "exact", "freivalds")
AUTO_EXACT_FLOPS = 4e9
PROBES = 4
PANEL = 512          # k-chunk of the panels: keeps the check's memory at about a block
WRONG_SHAPE = "shape"   # the method of a check that found a result of the wrong shape


@dataclass
class Check:
    """One rank's (or, after :func:`collective`, the job's) verdict on one output."""

    error: float
    bound: float
    method: str
    nonfinite: bool = False
    ok: bool = False
    bad_ranks: list = field(default_factory=list)
    false_pass: str = ""

    def __post_init__(self):          # one rank's verdict; collective() sets the job's
        # a block of the wrong shape has error inf and fails as FAIL, not as FAIL*
        # (which says a NaN or an Inf appeared in the values)
        wrong_shape = self.method == WRONG_SHAPE and math.isinf(self.error)
        self.nonfinite = bool(self.nonfinite or not (math.isfinite(self.error) or wrong_shape))
        self.ok = bool(not self.nonfinite and passes(self.error, self.bound))


def collective(world, check: Check) -> Check:
    """The job's verdict on every rank: OK only if every rank's check is OK and finite.
    The error is the largest finite error, or NaN when any rank saw a non-finite value
    (``bad_ranks`` names the ranks that failed). ``world``: an mpi4py communicator, a
    summasim ``Comm`` or a grid."""
    mine = (float(check.error), bool(check.nonfinite), bool(check.ok))
    every = untraced(world).allgather(mine)
    bad = [r for r, (_, nf, ok) in enumerate(every) if (nf or not ok)]
    nonfinite = any(nf for _, nf, _ in every)
    finite = [e for e, nf, _ in every if not nf]        # inf: a block of the wrong shape
    error = math.nan if nonfinite else (max(finite) if finite else 0.0)
    out = Check(0.0, check.bound, check.method, false_pass=check.false_pass)
    out.error, out.nonfinite, out.ok, out.bad_ranks = error, nonfinite, not bad, bad
    return out


def choose_method(method: str, mb: int, nb: int, k: int) -> str:
    if method not in METHODS:
        raise ValueError(f"check method must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "exact" if 4.0 * mb * nb * k <= AUTO_EXACT_FLOPS else "freivalds"


def panel_width(case) -> int:
    """The k-chunk a check generates at once: at most a rank's k-block and ``PANEL``."""
    return max(1, min(case.k // max(case.q, 1), PANEL))


def _panel_chunks(k: int, width: int):
    for k0 in range(0, k, width):
        yield slice(k0, min(k, k0 + width))


def op_panels(spec, m: int, k: int, n: int, rows: slice, cols: slice, kc: slice,
              seed: int, dtype):
    """``op(A)[rows, kc]`` and ``op(B)[kc, cols]`` in float64, from the rounded
    ``dtype`` values the distributed call was given."""
    sa, sb = spec.stored_shapes(m, k, n)
    if spec.op == "atb":
        a = uniform_block(seed, STREAM_A, sa, kc, rows, dtype).astype(np.float64).T
    else:
        a = uniform_block(seed, STREAM_A, sa, rows, kc, dtype).astype(np.float64)
    if spec.op == "abt":
        b = uniform_block(seed, STREAM_B, sb, cols, kc, dtype).astype(np.float64).T
    else:
        b = uniform_block(seed, STREAM_B, sb, kc, cols, dtype).astype(np.float64)
    return a, b


def product_block_slices(case, g) -> tuple[slice, slice]:
    """The rows and columns of C held by the rank described by GridNumbers ``g``."""
    rows, cols = block_slices((case.m, case.n), case.spec.layout_c, g)
    return rows, cols


def check_product(c, case, g, seed: int, method: str = "auto", chunk: int | None = None,
                  probe_seed: int = 12345) -> Check:
    """Check this rank's C block (host array) of ``case`` (a MatmulCase) at grid
    position ``g`` (:class:`~summasim.layout.GridNumbers`)."""
    spec, m, k, n = case.spec, case.m, case.k, case.n
    rows, cols = product_block_slices(case, g)
    c = np.asarray(c)
    mb, nb = rows.stop - rows.start, cols.stop - cols.start
    if c.shape != (mb, nb):
        return Check(math.inf, tolerance(k, np.dtype(case.dtype)), WRONG_SHAPE)
    how = choose_method(method, mb, nb, k)
    dtype = np.dtype(case.dtype)
    bound = tolerance(k, dtype)
    width = chunk or panel_width(case)
    c64 = c.astype(np.float64)
    if not np.isfinite(c64).all():
        return Check(math.nan, bound, how, nonfinite=True)
    if how == "exact":
        ref = np.zeros((mb, nb))
        scale = np.zeros((mb, nb))
        for kc in _panel_chunks(k, width):
            a, b = op_panels(spec, m, k, n, rows, cols, kc, seed, dtype)
            ref += a @ b
            np.abs(a, out=a)
            np.abs(b, out=b)
            scale += a @ b
        return Check(scaled_error(c64, ref, scale), bound, how)
    # Freivalds: probes drawn from a seed every rank derives alike from its block position
    rng = np.random.default_rng([probe_seed, rows.start, cols.start])
    X = rng.standard_normal((nb, PROBES))
    aX = np.abs(X)
    y = np.zeros((mb, PROBES))
    s = np.zeros((mb, PROBES))
    for kc in _panel_chunks(k, width):
        a, b = op_panels(spec, m, k, n, rows, cols, kc, seed, dtype)
        y += a @ (b @ X)
        s += np.abs(a) @ (np.abs(b) @ aX)
    cx = c64 @ X
    u64 = unit_roundoff(np.float64)
    fbound = bound + LAMBDA * (math.sqrt(nb) + math.sqrt(k + nb)) * u64
    err = scaled_error(cx, y, s)
    # express the error on the per-entry scale of the exact check so rows compare
    return Check(err * bound / fbound, bound, how,
                 false_pass="an error F times the row threshold escapes with probability "
                            "<= (0.8/F)^4")


def ring_reference(seed: int, p: int, n: int, lo: int, hi: int, dtype):
    """Float64 sum over the p ranks' inputs of items [lo, hi), and its scale."""
    ref = np.zeros(hi - lo)
    scale = np.zeros(hi - lo)
    part = np.empty(hi - lo, np.float64)
    for s in range(p):
        x = uniform_segment(seed, STREAM_RING + s, lo, hi - lo, dtype).astype(np.float64)
        ref += x
        np.abs(x, out=part)
        scale += part
    return ref, scale


def check_ring(y, case, p: int, seed: int, chunk: int = 1 << 18) -> Check:
    """Check this rank's whole all-reduce result (host array) against the float64 sum
    of all ranks' inputs, regenerated ``chunk`` items at a time."""
    dtype = np.dtype(case.dtype)
    bound = tolerance(p, dtype)
    y = np.asarray(y).reshape(-1)
    if y.shape[0] != case.n:
        return Check(math.inf, bound, WRONG_SHAPE)
    worst = 0.0
    for lo in range(0, case.n, chunk):
        hi = min(case.n, lo + chunk)
        ref, scale = ring_reference(seed, p, case.n, lo, hi, dtype)
        err = scaled_error(y[lo:hi], ref, scale)
        if not math.isfinite(err):
            return Check(math.nan, bound, "exact", nonfinite=True)
        worst = max(worst, err)
    return Check(worst, bound, "exact")


def ring_input(seed: int, rank: int, n: int, dtype) -> np.ndarray:
    """Rank ``rank``'s all-reduce input (host)."""
    return uniform_segment(seed, STREAM_RING + rank, 0, n, dtype)
