"""Isoefficiency: how fast the problem must grow with p to keep the efficiency E.

Following Optimus section 3.1.2 (after Grama et al.): the serial time is W, the
parallel time ``T_p = W/p + T_comm`` and the efficiency ``E = W / (p T_p) =
1 / (1 + p T_comm / W)``. For each p we solve ``p T_comm(x, p) / W(x) = (1-E)/E``
for the problem size x with ``scipy.optimize.brentq`` (in log x), then fit the
growth exponent of W(p) on a log-log scale.

Problems
--------
Transformer schemes ("megatron", "optimus", "summa25"):
    x = h, with ``b = b_per_h * h`` and ``n = n_per_h * h`` (b, n proportional to h),
    s and N constant, as the paper assumes; W = serial compute of one layer's
    forward + backward (with checkpointing), ~ h^3. ``T_comm`` is the scheme's
    forward + backward communication (:func:`~summasim.costmodel.workload.layer.scheme_cost`).
Matrix products ("cannon", "summa", "summa25_mm"):
    x = n for n x n matrices, W = 2 n^3 gamma; ``T_comm`` from the closed forms of
    :func:`~summasim.costmodel.workload.predict.predict_algorithm`.

Under the papers' assumptions (alpha = 0; the paper's own collective formulas, or
MPICH's algorithms for the matrix products) the exponents are: Megatron p^3,
Optimus (sqrt(p) log p)^3, Cannon and SUMMA (with the scatter-allgather broadcast
MPICH uses for long messages) p^1.5.

References
----------
A. Grama, A. Gupta, G. Karypis, V. Kumar, "Introduction to Parallel Computing",
2nd ed., Addison-Wesley 2003, section 5.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from summasim.costmodel.machine import Machine
from summasim.costmodel.workload.predict import predict_algorithm
from summasim.costmodel.workload.scheme import SCHEMES, Scheme, TransformerConfig
from summasim.costmodel.workload.layer import layer_ops, scheme_cost

from . import scheme_grids

TRANSFORMER_PROBLEMS = SCHEMES
MATMUL_PROBLEMS = {"cannon": "cannon_ab", "summa": "summa_ab", "summa25_mm": "summa25_ab"}
PROBLEMS = TRANSFORMER_PROBLEMS + tuple(MATMUL_PROBLEMS)


def paper_machine(beta: float = 1e-9, gamma: float = 1e-11) -> Machine:
    """The papers' assumptions: alpha = 0, one bandwidth, size-independent gamma,
    never oversubscribed (seconds/byte and seconds/flop)."""
    return Machine.simple(alpha=0.0, beta=beta, gamma=gamma, name="paper-assumptions",
                          source="alpha = 0 (Optimus section 2.5); beta, gamma constant")


@dataclass
class IsoResult:
    """W(p) keeping efficiency E, and its fitted log-log slope."""

    problem: str
    efficiency: float
    p: list
    x: list          # h (transformers) or n (matrix products) at each p; nan if none
    W: list          # serial seconds at each p
    slope: float     # d log W / d log p, least squares over the solved points
    grid: list = field(default_factory=list)  # the grid used at each p

    def to_dict(self) -> dict:
        return {"problem": self.problem, "efficiency": self.efficiency, "p": self.p,
                "x": self.x, "W": self.W, "slope": self.slope, "grid": self.grid}


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y against log x over the finite points."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    if ok.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0])


def illinois_root(f, lo: float, hi: float, *, xtol: float = 1e-12,
                  maxiter: int = 200) -> float:
    """Root of ``f`` in ``[lo, hi]`` (``f(lo)``, ``f(hi)`` of opposite signs) by the
    Illinois variant of regula falsi: bracketing, superlinear, no SciPy import
    (which alone takes longer than an ``explore`` sweep)."""
    flo, fhi = f(lo), f(hi)
    if flo == 0:
        return lo
    if fhi == 0:
        return hi
    if (flo > 0) == (fhi > 0):
        raise ValueError(f"root not bracketed: f({lo})={flo}, f({hi})={fhi}")
    side = 0
    x = lo
    for _ in range(maxiter):
        x = (lo * fhi - hi * flo) / (fhi - flo)
        fx = f(x)
        if fx == 0 or abs(hi - lo) < xtol * (1 + abs(x)):
            return x
        if (fx > 0) == (fhi > 0):
            hi, fhi = x, fx
            if side == -1:
                flo /= 2
            side = -1
        else:
            lo, flo = x, fx
            if side == 1:
                fhi /= 2
            side = 1
    return x


def _solve(g, root, lo: float, hi: float, start: float | None) -> float:
    """x = exp(root of g in log space), bracketed from ``start`` outwards (g decreases:
    larger problems are more efficient). exp(lo) if g <= 0 everywhere, nan if g > 0."""
    if start is not None and lo < start < hi:
        a = start
        ga = g(a)
        step = math.log(4.0)
        if ga > 0:   # too small: walk up until efficient
            b = a
            while True:
                b = min(hi, b + step)
                gb = g(b)
                if gb <= 0 or b >= hi:
                    break
                a, ga, step = b, gb, step * 2
            if gb > 0:
                return float("nan")
            return math.exp(root(g, a, b))
        b = a        # already efficient: walk down until not
        while True:
            a = max(lo, a - step)
            ga = g(a)
            if ga > 0 or a <= lo:
                break
            b, step = a, step * 2
        if ga <= 0:
            return math.exp(lo)
        return math.exp(root(g, a, b))
    glo, ghi = g(lo), g(hi)
    if glo <= 0:          # efficient at any size in range: the smallest problem
        return math.exp(lo)
    if ghi > 0:           # never efficient in range
        return float("nan")
    return math.exp(root(g, lo, hi))


def _scheme_for(problem, p, d):
    """The grid of ``p`` ranks a problem is solved on: Megatron over p, Optimus q x q,
    SUMMA2.5 a grid of :func:`summasim.spec.grids` (q, d >= 2, d > q included): the
    one of depth ``d``, or with ``d=None`` the deepest whose depth is at most q
    (d <= p^(1/3), Solomonik and Demmel's communication-optimal range), else the
    shallowest (the one nearest a cube). None when p has no such grid."""
    if problem == "megatron":
        return Scheme("megatron", p)
    if problem == "optimus":
        q = math.isqrt(p)
        return Scheme("optimus", q * q, q, 1) if q * q == p else None
    shapes = scheme_grids(p, "summa25")          # q ascending: d descending
    if d is not None:
        return next((sch for sch in shapes if sch.d == d), None)
    if not shapes:
        return None
    optimal = [sch for sch in shapes if sch.d <= sch.q]
    return optimal[0] if optimal else shapes[-1]


def _transformer_fns(problem, p, machine, mode, cfg, b_per_h, n_per_h, d):
    sch = _scheme_for(problem, p, d)
    serial = Scheme("megatron", 1)

    def at(h):
        return cfg.replace(h=h, b=b_per_h * h, n=max(n_per_h * h, 1e-9))

    def W(h):
        ops = layer_ops(serial, at(h))
        return sum(op[4] * machine.gemm_time(op[1], op[2], op[3], cfg.dtype)
                   for key in ("forward", "backward") for op in ops[key] if op[0] == "gemm")

    def T(h):
        c = scheme_cost(sch, at(h), machine, mode=mode, compute=False)
        return c.forward.comm_seconds + c.backward.comm_seconds

    return sch, W, T


def _matmul_fns(problem, p, machine, mode, dtype, d):
    name = MATMUL_PROBLEMS[problem]
    if name == "summa25_ab":
        sch = _scheme_for("summa25", p, d)
        if sch is None:
            return None, None, None
        q, dd = sch.q, sch.d
    else:
        q, dd = math.isqrt(p), 1
        if q * q != p:
            return None, None, None

    def W(n):
        return machine.gemm_time(n, n, n, dtype)

    def T(n):
        return predict_algorithm(name, n, n, n, q, dd, machine=machine, dtype=dtype, mode=mode,
                                 strict=False).comm_seconds

    return f"[{q},{q},{dd}]", W, T


def isoefficiency(problem: str, E: float, p_values, *, machine: Machine | None = None,
                  mode: str = "paper", cfg: TransformerConfig | None = None,
                  b_per_h: float = 1 / 64, n_per_h: float = 1 / 64, d: int | None = None,
                  dtype: str = "float64", x_bounds=(1e-3, 1e12),
                  solver: str = "brentq") -> IsoResult:
    """Solve for the problem size keeping efficiency ``E`` at each p; fit W ~ p^slope.

    Parameters
    ----------
    problem : str
        "megatron", "optimus", "summa25" (transformer layers) or "cannon", "summa",
        "summa25_mm" (n x n matrix products).
    E : float
        Target efficiency, 0 < E < 1.
    p_values : iterable of int
        Process counts (those without a legal grid are skipped: Optimus and the
        matrix products need p = q^2, SUMMA2.5 p = d q^2 with q, d >= 2).
    machine : Machine, optional
        Defaults to :func:`paper_machine` (alpha = 0).
    mode : {"paper", "mpich"}
        Collective formulas; "paper" is the Optimus section 2.5 model.
    cfg : TransformerConfig, optional
        s, N, dtype and checkpointing of the transformer problems (b, n, h are set
        from h). Defaults to s = 512, float32, checkpointing on.
    b_per_h, n_per_h : float
        b = b_per_h h and n = n_per_h h.
    d : int, optional
        SUMMA2.5 depth; None takes, at each p, the deepest grid with d <= q, else the
        shallowest (see :func:`_scheme_for`).
    dtype : str
        Dtype of the matrix products.
    x_bounds : (float, float)
        Search interval for h or n.
    solver : {"brentq", "illinois"}
        ``scipy.optimize.brentq``, or :func:`illinois_root` (no SciPy import).

    Returns
    -------
    IsoResult
    """
    if not 0 < E < 1:
        raise ValueError(f"efficiency E must be in (0, 1), got {E}")
    if problem not in PROBLEMS:
        raise ValueError(f"unknown problem {problem!r}; known: {', '.join(PROBLEMS)}")
    if solver == "brentq":
        from scipy.optimize import brentq

        def root(fn, a, b):
            return brentq(fn, a, b, xtol=1e-10, rtol=1e-12, maxiter=200)
    elif solver == "illinois":
        root = illinois_root
    else:
        raise ValueError(f"unknown solver {solver!r}; choose 'brentq' or 'illinois'")
    machine = machine or paper_machine()
    cfg = cfg or TransformerConfig(s=512, N=1, dtype="float32", checkpoint=True)
    target = (1.0 - E) / E
    ps, xs, Ws, grids = [], [], [], []
    for p in p_values:
        p = int(p)
        if problem in TRANSFORMER_PROBLEMS:
            sch, W, T = _transformer_fns(problem, p, machine, mode, cfg, b_per_h, n_per_h, d)
            label = sch.label if sch else None
        else:
            label, W, T = _matmul_fns(problem, p, machine, mode, dtype, d)
        if W is None or label is None:
            continue

        def g(logx, W=W, T=T, p=p):
            x = math.exp(logx)
            w = W(x)
            return p * T(x) / w - target if w > 0 else math.inf

        x = _solve(g, root, math.log(x_bounds[0]), math.log(x_bounds[1]),
                   math.log(xs[-1]) if xs and math.isfinite(xs[-1]) else None)
        ps.append(p)
        xs.append(x)
        Ws.append(W(x) if math.isfinite(x) else float("nan"))
        grids.append(label)
    return IsoResult(problem, E, ps, xs, Ws, loglog_slope(ps, Ws), grids)


def reference_slope(kind: str, p_values) -> float:
    """Log-log slope of a reference growth law over ``p_values``: "p^3", "p^1.5",
    or "(sqrt(p) log p)^3" (log base 2)."""
    p = np.asarray(list(p_values), float)
    if kind == "p^3":
        y = p ** 3
    elif kind == "p^1.5":
        y = p ** 1.5
    elif kind in ("(sqrt(p) log p)^3", "optimus"):
        y = (np.sqrt(p) * np.log2(p)) ** 3
    else:
        raise ValueError(f"unknown reference {kind!r}")
    return loglog_slope(p, y)
