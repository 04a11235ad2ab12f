"""Isoefficiency: how fast the problem must grow with p to keep the efficiency E.

Following Optimus section 3.1.2 (after Grama et al.): the serial time is W, the
parallel time ``T_p = W/p + T_comm`` and the efficiency ``E = W / (p T_p) =
1 / (1 + p T_comm / W)``. For each p we solve ``p T_comm(x, p) / W(x) = (1-E)/E``
for the problem size x with ``scipy.optimize.brentq`` (in log x), then fit the
growth exponent of W(p) on a log-log scale.

Problems
--------
Transformer schemes ("megatron", "optimus", "summa25", "3d"):
    x = h, with ``b = b_per_h * h`` and ``n = n_per_h * h`` (b, n proportional to h),
    s and N constant, as the paper assumes; W = serial compute of one layer's
    forward + backward (with checkpointing), ~ h^3. ``T_comm`` is the scheme's
    forward + backward communication (:func:`~summasim.costmodel.workload.layer.scheme_cost`).
Matrix products ("cannon", "summa", "summa25_mm", "sd25_mm", "mm3d_mm"):
    x = n for n x n matrices, W = 2 n^3 gamma; ``T_comm`` from the closed forms of
    :func:`~summasim.costmodel.workload.predict.predict_algorithm`. The 2.5D product
    runs on the [q, q, c] grid with c = q where p is a cube, the 3D one on the cube.

Under the papers' assumptions (alpha = 0; the paper's own collective formulas, or
MPICH's algorithms for the matrix products) the exponents are: Megatron p^3,
Optimus (sqrt(p) log p)^3, Cannon and SUMMA (with the scatter-allgather broadcast
MPICH uses for long messages) p^1.5.

Closed forms (what a fitted slope is checked against)
-----------------------------------------------------
2.5D, 3D    :func:`deep_closed_form`: W ~ (p D(q, c))^3 with D the per-rank overhead of
            :func:`deep_overhead`; (p^(1/3) - 1)^3 -> p for the 3D product and for the
            2.5D one at c = p^(1/3), p^1.5 for the 2.5D one at a fixed c.
Megatron    W ~ h^3 ~ p^3 (Optimus section 3.1.2: "the isoefficiency function for
            Megatron is W ~ h^3 ~ p^3").
Optimus     W ~ h^3 ~ (sqrt(p) log p)^3 (Optimus section 3.1.2, from a communication
            time "in O(2 beta q h^2/p log q)" on a q x q mesh; also its abstract).
SUMMA2.5-LM :func:`summa25_closed_form` (derived there from summasim.algorithms.summa25's
            per-call traffic; the SUMMA2.5-LM paper states no isoefficiency function):
            ``p T_comm = beta w h^2 Phi(q, d)`` with
            ``Phi = P q log2(q) ((3+f) c + (4+2f) d) + 2 (4+2f)(d-1)``, c = b s / h,
            P = 4 passes with checkpointing. Hence W ~ Phi^3: (sqrt(p) log p)^3 at a
            fixed d (Optimus's law; exactly Optimus's closed form at d = 1) and
            (p^(2/3) log p)^3 = p^2 log^3 p at d = p^(1/3), the cube
            (:func:`summa25_exponent`). :func:`reference_slope` prices it ("summa25
            closed form", "summa25 leading"), :func:`summa25_check` sets it next to the
            fitted slope and :func:`print_closed_forms` prints that comparison.
3D layer    :func:`tp3d_closed_form` (Bian et al. 2021's layer on the q x q x q cube,
            derived there from its per-linear all-gathers and reduce-scatters):
            ``p T_comm = beta w h^2 Phi_3(q)`` with
            ``Phi_3 = (q-1) ((P_f (8+2f) + 11+3f) c + (P_f+2)(4+2f))``, P_f = 2 with
            whole-layer recompute (else 1): W ~ Phi_3^3 ~ (p^(1/3) - 1)^3 -> p, the 3D
            product's law (:func:`deep_closed_form`). :func:`reference_slope` prices it
            ("3d closed form", "3d leading").

References
----------
A. Grama, A. Gupta, G. Karypis, V. Kumar, "Introduction to Parallel Computing",
2nd ed., Addison-Wesley 2003, section 5.4.
Q. Xu, S. Li, C. Gong, Y. You, "An Efficient 2D Method for Training Super-Large Deep
Learning Models" (Optimus), 2021, sections 2.5 and 3.1.2.
B. Wang, Q. Xu, Z. Bian, Y. You, "2.5-dimensional distributed model training"
(SUMMA2.5-LM), 2021, sections 2.3 and 3.1, Algorithm 3.
Z. Bian, Q. Xu, B. Wang, Y. You, "Maximizing Parallelism in Distributed Training for
Huge Neural Networks", arXiv 2105.14450, 2021 (the 3D layer).
R. C. Agarwal, S. M. Balle, F. G. Gustavson, M. Joshi, P. Palkar, "A three-dimensional
approach to parallel matrix multiplication", IBM J. Res. Dev. 39(5), 1995.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from summasim import spec
from summasim.costmodel.machine import Machine
from summasim.costmodel.workload.predict import predict_algorithm
from summasim.costmodel.workload.scheme import SCHEMES, Scheme, TransformerConfig
from summasim.costmodel.workload.layer import layer_ops, scheme_cost

from . import scheme_grids

TRANSFORMER_PROBLEMS = SCHEMES
MATMUL_PROBLEMS = {"cannon": "cannon_ab", "summa": "summa_ab", "summa25_mm": "summa25_ab",
                   "sd25_mm": "sd25_ab", "mm3d_mm": "mm3d_ab"}
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
    the 3D layer the q x q x q cube, SUMMA2.5 a square grid of
    :func:`summasim.spec.grids` (q, d >= 2, d > q included): the one of depth ``d``, or
    with ``d=None`` the deepest whose depth is at most q (d <= p^(1/3), Solomonik and
    Demmel's communication-optimal range), else the shallowest (the one nearest a
    cube). None when p has no such grid: the closed forms are the papers', on square
    layers (spec's rectangular fallback grids are left out)."""
    if problem == "megatron":
        return Scheme("megatron", p)
    if problem == "optimus":
        q = math.isqrt(p)
        return Scheme("optimus", q * q, q, 1) if q * q == p else None
    if spec.SCHEME_KINDS[problem] == "3d":      # the cube, when p is one
        return next(iter(scheme_grids(p, problem)), None)
    shapes = [sch for sch in scheme_grids(p, "summa25") if not sch.pc]   # q up: d down
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


def deep_grid(problem: str, p: int, d: int | None = None) -> tuple[int, int] | None:
    """``(q, c)`` of the 2.5D or 3D product at p ranks: mm3d on the q x q x q cube
    (p = q^3); sd25 on the ``[q, q, c]`` grid of :func:`summasim.spec.grids` with
    ``c = d``, or with ``d=None`` the one with c = q (the cube, Solomonik and Demmel's
    most replicated optimal choice, c = p^(1/3)) else the deepest with c <= q. None
    when p has no such grid."""
    name = MATMUL_PROBLEMS[problem]
    shapes = [(g.q, g.d) for g in spec.grids(p, name) if g.q > 1 and g.d > 1]
    if name == "mm3d_ab" or d is not None:
        return next(((q, c) for q, c in shapes if d is None or c == d), None)
    cube = [(q, c) for q, c in shapes if c == q]
    fit = [(q, c) for q, c in shapes if c <= q]
    return (cube or fit[-1:] or [None])[0]


def _matmul_fns(problem, p, machine, mode, dtype, d, algorithms=None):
    name = MATMUL_PROBLEMS[problem]
    if name in ("sd25_ab", "mm3d_ab"):
        grid = deep_grid(problem, p, d)
        if grid is None:
            return None, None, None
        q, dd = grid
    elif name == "summa25_ab":
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
                                 strict=False, algorithms=algorithms).comm_seconds

    return f"[{q},{q},{dd}]", W, T


def isoefficiency(problem: str, E: float, p_values, *, machine: Machine | None = None,
                  mode: str = "paper", cfg: TransformerConfig | None = None,
                  b_per_h: float = 1 / 64, n_per_h: float = 1 / 64, d: int | None = None,
                  dtype: str = "float64", x_bounds=(1e-3, 1e12),
                  solver: str = "brentq", algorithms: dict | None = None) -> IsoResult:
    """Solve for the problem size keeping efficiency ``E`` at each p; fit W ~ p^slope.

    Parameters
    ----------
    problem : str
        "megatron", "optimus", "summa25", "3d" (transformer layers) or "cannon",
        "summa", "summa25_mm" (n x n matrix products).
    E : float
        Target efficiency, 0 < E < 1.
    p_values : iterable of int
        Process counts (those without a legal grid are skipped: Optimus and the
        matrix products need p = q^2, SUMMA2.5 p = d q^2 with q, d >= 2, the 3D layer
        p = q^3).
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
    algorithms : dict, optional
        The matrix products' collectives forced per op (``{"bcast":
        "scatter_ring_allgather"}``), as :func:`predict_algorithm` takes them.

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
            label, W, T = _matmul_fns(problem, p, machine, mode, dtype, d, algorithms)
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


# -- 2.5D and 3D matrix multiplication: the closed forms -----------------------------------
def deep_overhead(problem: str, q: int, c: int) -> float:
    """``T_comm / (beta w n^2)`` of one rank of the 2.5D or 3D product (alpha = 0, every
    collective at its bandwidth-optimal form: a broadcast as scatter + all-gather,
    ``2 (g-1)/g`` of the buffer, an all-gather or reduce-scatter ``(g-1)/g``, an
    all-reduce ``2 (g-1)/g``, what MPICH selects for long messages and summasim's ring
    sends), from the events of
    :func:`~summasim.costmodel.workload.traffic.algorithm_events`:

    mm3d on q x q x q:  all-gathers of the A and B pieces over q (``n^2/q^3`` each) and a
                        reduce-scatter of the ``n^2/q^2`` C block over q:
                        ``3 (q-1) / q^3``
    sd25 on [q, q, c]:  two depth broadcasts of ``n^2/q^2`` blocks over c, q/c SUMMA
                        steps of a row and a column broadcast over q, an all-reduce of
                        the C block over c:
                        ``(6 (c-1) + 4 (q-1)) / (c q^2)``
    """
    if problem == "mm3d_mm":
        return 3.0 * (q - 1) / q ** 3
    if problem == "sd25_mm":
        return (6.0 * (c - 1) + 4.0 * (q - 1)) / (c * q * q)
    raise ValueError(f"no deep closed form for {problem!r}")


def deep_closed_form(problem: str, E: float, p_values, *, d: int | None = None,
                     beta: float = 1e-9, gamma: float = 1e-11, itemsize: int = 8
                     ) -> IsoResult:
    """Isoefficiency of the 2.5D (``"sd25_mm"``) and 3D (``"mm3d_mm"``) n x n products in
    closed form, on the grids :func:`isoefficiency` takes (:func:`deep_grid`).

    With ``W = 2 n^3 gamma`` and ``T_comm = beta w n^2 D(q, c)`` (:func:`deep_overhead`),
    ``p T_comm / W = (1-E)/E`` gives ``n = p beta w D E / (2 gamma (1-E))`` and W = 2 gamma
    n^3 ~ (p D)^3. For mm3d, ``p D = 3 (q-1)`` with q = p^(1/3): W ~ (p^(1/3) - 1)^3,
    which tends to p (the 3D algorithm's isoefficiency with alpha = 0; Grama et al.
    section 8.2.3 give p log^3 p once the latency of its log p steps counts). For sd25
    at c = q it is the same law, ``p D = 10 (q-1)`` (constant aside); at a fixed c,
    ``p D = 6 (c-1) + 4 (q-1)`` with q = sqrt(p/c): W tends to p^1.5, SUMMA's law, the
    copies only shrinking the constant (Solomonik and Demmel 2011, section 4).
    """
    if not 0 < E < 1:
        raise ValueError(f"efficiency E must be in (0, 1), got {E}")
    ps, xs, Ws, grids = [], [], [], []
    for p in p_values:
        grid = deep_grid(problem, int(p), d)
        if grid is None:
            continue
        q, c = grid
        n = int(p) * beta * itemsize * deep_overhead(problem, q, c) * E / (2 * gamma * (1 - E))
        ps.append(int(p))
        xs.append(n)
        Ws.append(2 * gamma * n ** 3)
        grids.append(f"[{q},{q},{c}]")
    return IsoResult(f"{problem} closed form", E, ps, xs, Ws, loglog_slope(ps, Ws), grids)


# -- SUMMA2.5-LM: the closed form ----------------------------------------------------------
#: The growth law of :func:`reference_slope`'s ``"summa25 leading"`` (leading order in h).
SUMMA25_LAW = "Phi^3, Phi = P q log2(q) ((3+f) bs/h + (4+2f) d) + 2 (4+2f)(d-1)"


def summa25_exponent(delta: float) -> float:
    """The power of p in SUMMA2.5-LM's isoefficiency W ~ (p^((1+delta)/2) log p)^3 with
    the depth growing as d ~ p^delta, 0 <= delta <= 1/3 (log factors aside): 3/2 at a
    fixed d (Optimus's), 2 at the cube d = p^(1/3) (:func:`summa25_closed_form`)."""
    if not 0 <= delta <= 1 / 3:
        raise ValueError(f"delta must be in [0, 1/3] (d <= q), got {delta}")
    return 1.5 * (1 + delta)


def _passes(cfg: TransformerConfig) -> tuple[float, float, float]:
    """(linear GEMM passes, attention-core passes in forward units, communication passes)
    of one layer's forward + backward: forward 1, backward 2 (its dX and dW products),
    plus 1 for what the recompute re-runs; the blockwise (flash) backward is 2.5 forward
    attention cores (Dao 2023), and under it selective recompute is none (layer_ops)."""
    att_bwd = 2.5 if cfg.attention == "flash" else 2.0
    if cfg.recompute == "full":
        return 4.0, 2.0 + att_bwd, 4.0
    if cfg.recompute == "selective" and cfg.attention == "plain":
        return 3.0, 2.0 + att_bwd, 3.0
    return 3.0, 1.0 + att_bwd, 3.0


def _paper_block(cfg: TransformerConfig, name: str = "SUMMA2.5-LM") -> None:
    """ValueError unless ``cfg`` is the papers' block (GELU MLP, every head its own K, V):
    the closed form's linear sums ((3+f) h, (4+2f) h^2, ...) are that block's."""
    if cfg.mlp != "gelu" or cfg.kv_heads is not None:
        raise ValueError(f"the {name} closed form is derived for the papers' block "
                         f"(mlp='gelu', kv_heads=None); got mlp={cfg.mlp!r}, "
                         f"kv_heads={cfg.kv_heads!r}")
    if cfg.sequence_parallel:
        raise ValueError(f"sequence parallelism is Megatron's; {name} has none")


def summa25_overhead(q: int, d: int, *, c: float, ffn: float = 4.0,
                     passes: float = 4.0) -> float:
    """``Phi = p T_comm / (beta w h^2)``: a SUMMA2.5-LM layer's total overhead on [q, q, d]
    in units of ``beta w h^2`` (paper formulas, alpha = 0; see :func:`summa25_closed_form`).

    ``Phi = passes q log2(q) ((3+f) c + (4+2f) d) + 2 (4+2f)(d-1)`` with ``c = b s / h``;
    d = 1 is Optimus on q x q. ``passes``: 4 with whole-layer recompute, else 3.
    """
    if q < 1 or d < 1:
        raise ValueError(f"need q, d >= 1, got q={q}, d={d}")
    f = ffn
    return (passes * q * math.log2(q) * ((3 + f) * c + (4 + 2 * f) * d)
            + 2 * (4 + 2 * f) * (d - 1))


def summa25_closed_form(E: float, p_values, *, d: int | None = None,
                        cfg: TransformerConfig | None = None, b_per_h: float = 1 / 64,
                        beta: float = 1e-9, gamma: float = 1e-11, order: str = "exact",
                        x_bounds=(1e-3, 1e12)) -> IsoResult:
    r"""The isoefficiency function of SUMMA2.5-LM in closed form: W(p) and its slope.

    The same problem as :func:`isoefficiency` ("summa25" with ``mode="paper"`` on
    :func:`paper_machine`: alpha = 0, ``beta`` s/byte, ``gamma`` s/flop), solved by
    hand instead of by root finding, on the same grids (:func:`_scheme_for`; ``d=1``
    is Optimus on q x q, p = q^2).

    Parameters
    ----------
    E : float
        Efficiency, 0 < E < 1.
    p_values : iterable of int
        Ranks; those without a grid of the rule are skipped, as in :func:`isoefficiency`.
    d : int, optional
        A fixed depth, or None for :func:`_scheme_for`'s rule (the deepest d <= q; on
        p = q^3 that is the cube d = q = p^(1/3)).
    cfg : TransformerConfig, optional
        s, f, dtype (w bytes per item), recompute, attention; default as
        :func:`isoefficiency`'s. Must be the papers' block (GELU, no grouped-query heads).
    b_per_h : float
        b = b_per_h h (so c = b s / h = b_per_h s is constant).
    beta, gamma : float
        :func:`paper_machine`'s.
    order : {"exact", "leading"}
        "exact": h from the linear equation below, finite s included (equals the
        cost model's solution to rounding); "leading": the ``2 s`` attention term of W
        dropped, so ``W = (beta w)^3 Phi^3 / (4 P_l^2 gamma^2 c^2 (4+2f)^2 r^3)`` ~ Phi^3.
    x_bounds : (float, float)
        h is clamped to ``x_bounds[0]`` (efficient at any size), as the solver does.

    Returns
    -------
    IsoResult
        problem ``"summa25 closed form"`` (or ``"... (leading)"``); ``slope`` the
        log-log slope of the closed-form W over the solved p.

    Notes
    -----
    *Communication per layer per rank* (summasim.algorithms.summa25's module docstring:
    what every rank sends per call). Each linear ``Y = X W``, X ``[M, i]`` (M = b s,
    2.5d layout), W ``[i, o]`` (2d, replicated over depth), runs

    - forward ``summa25_ab``: q row broadcasts of ``(M/(dq))(i/q)`` items and q column
      broadcasts of ``(i/q)(o/q)``;
    - backward dX ``summa25_abt(dY, W)``: q column broadcasts of ``(i/q)(o/q)`` and q
      row reduces of ``(M/(dq))(i/q)``;
    - backward dW ``summa25_atb(X, dY)``: q row broadcasts of ``(M/(dq))(i/q)``, q
      column reduces of ``(i/q)(o/q)``, then a ring all-reduce over ``grid.depth`` of
      ``(i/q)(o/q)`` items (2(d-1) sendrecvs of 1/d of it).

    With the Optimus eq. (4) broadcast = reduce = ``log2(q) beta B`` and the ring
    ``2 (d-1)/d beta B`` (eq. (5); B bytes, w bytes per item), each of the three
    products costs ``(log2 q / q) beta w (M i / d + i o)``, and the depth all-reduce
    ``2 (d-1)/(d q^2) beta w i o``. The four linears of the papers' block (QKV
    [h, 3h], projection [h, h], fc1 [h, f h], fc2 [f h, h]) sum to
    ``sum i = (3+f) h`` and ``sum i o = (4+2f) h^2`` [7h, 12h^2 for f = 4]; the
    attention core sends nothing. The forward is therefore

        T_f = (log2 q / q) beta w ((3+f) M h / d + (4+2f) h^2)

    (Optimus Table 1's ``log(p)/(2 sqrt p) (7bsh + 12h^2)`` at d = 1), the backward
    ``2 T_f + T_depth`` with ``T_depth = 2 (d-1)/(d q^2) (4+2f) beta w h^2``, and with
    whole-layer recompute the backward re-runs the forward: ``T_comm = P T_f +
    T_depth`` with P = 4 (3 without recompute).

    *Computation.* The serial layer takes ``W = gamma (P_l 2 M (4+2f) h^2 + P_a 4 b s^2
    h)`` (linears, attention core; P_l = P_a = 4 with recompute), and a rank ``W/p``.

    *Overhead.* ``T_o = p T_comm``; with ``p = d q^2`` (so p/q = d q, p/q^2 = d) and
    b = b_per_h h, i.e. ``M = c h`` with c = b s / h = b_per_h s constant:

        T_o = beta w h^2 Phi(q, d),
        Phi = P q log2(q) ((3+f) c + (4+2f) d) + 2 (4+2f)(d-1).

    *Isoefficiency.* ``E = 1 / (1 + T_o/W)``, so ``W = K T_o`` with K = E/(1-E) = 1/r.
    Both sides are ``h^2`` times something: with W = ``2 gamma c h^2 (P_l (4+2f) h +
    P_a 2 s)``,

        P_l (4+2f) h + 2 P_a s = beta w Phi / (2 gamma c r),

    linear in h: ``h = (beta w Phi / (2 gamma c r) - 2 P_a s) / (P_l (4+2f))`` and
    W = W(h). To leading order in h (h >> s), ``W ~ h^3 ~ Phi^3``:

    - fixed d: q = sqrt(p/d), ``Phi ~ q log q`` so ``W ~ (sqrt(p) log p)^3``, power
      exponent 3/2: Optimus's law (section 3.1.2); d only changes the constant
      (activations' term shrinks as 1/d, the weights' grows as d);
    - d = p^(1/3) (the cube, q = d): ``Phi ~ P (4+2f) q^2 log2 q = P (4+2f)/3
      p^(2/3) log2 p``, so ``W ~ (p^(2/3) log p)^3 = p^2 log^3 p``, exponent 2;
    - d = p^delta, 0 < delta <= 1/3: ``W ~ (p^((1+delta)/2) log p)^3``.

    The depth all-reduce adds ``2 (4+2f)(d-1)`` to Phi: a constant at fixed d and
    ~ p^(1/3) at the cube, below the broadcasts' ``q log q`` terms in order; it stays
    in the exact form. The weights are replicated over the depth and every depth
    layer broadcasts them again, so the weight term (4+2f) d q log q grows with d at
    fixed p while the activation term (3+f) c q log q shrinks: deeper pays while
    ``d < (3+f) c / (4+2f)`` (log factors aside), which is why a growing d ends up
    with a steeper law than Optimus's. The SUMMA2.5-LM paper (sections 2.3 and 3.1)
    quotes Solomonik and Demmel's 2.5D lower bounds (words ``Omega(n^2/sqrt(d p))``,
    messages ``Omega(p^(1/2)/d^(3/2))``) and concludes "greater d could lead to less
    communication time"; that bound is met by Solomonik and Demmel's algorithm, whose d
    layers each run 1/d of the q steps on replicated A and B, whereas SUMMA2.5 gives
    each layer 1/d of A's rows and all q steps, so every layer broadcasts the whole
    of B (the weights) again. It states no isoefficiency function.

    What this leaves out, as the cost model's "paper" mode does: latency (alpha = 0),
    the LayerNorm and bias traffic (``include_minor``; the paper's "negligible"),
    elementwise compute, and the embedding and head.
    """
    cfg = cfg or TransformerConfig(s=512, N=1, dtype="float32", checkpoint=True)
    _paper_block(cfg)
    P = _passes(cfg)[2]

    def phi(p):
        sch = _scheme_for("optimus" if d == 1 else "summa25", p, None if d == 1 else d)
        return sch, sch and summa25_overhead(sch.q, sch.d, c=b_per_h * cfg.s, ffn=cfg.ffn,
                                             passes=P)

    return _layer_closed_form("summa25", phi, E, p_values, cfg=cfg, b_per_h=b_per_h,
                              beta=beta, gamma=gamma, order=order, x_bounds=x_bounds)


def _layer_closed_form(name: str, phi, E: float, p_values, *, cfg: TransformerConfig,
                       b_per_h: float, beta: float, gamma: float, order: str,
                       x_bounds) -> IsoResult:
    """Solve ``W = T_o / r`` for h at each p, given ``phi(p) -> (scheme, Phi)`` with
    ``T_o = beta w h^2 Phi`` (a scheme of None: p skipped): ``P_l (4+2f) h + 2 P_a s =
    beta w Phi / (2 gamma c r)`` (:func:`summa25_closed_form`'s Notes); ``order``
    "leading" drops the ``2 P_a s`` attention term."""
    if not 0 < E < 1:
        raise ValueError(f"efficiency E must be in (0, 1), got {E}")
    if order not in ("exact", "leading"):
        raise ValueError(f"unknown order {order!r}; choose 'exact' or 'leading'")
    r = (1.0 - E) / E
    f, s, w = cfg.ffn, cfg.s, cfg.itemsize
    c = b_per_h * s
    P_l, P_a, _ = _passes(cfg)
    ps, hs, Ws, grids = [], [], [], []
    for p in p_values:
        p = int(p)
        sch, ph = phi(p)
        if sch is None:
            continue
        rhs = beta * w * ph / (2 * gamma * c * r)       # = P_l (4+2f) h + 2 P_a s
        if order == "leading":
            h = rhs / (P_l * (4 + 2 * f))
            W = 2 * gamma * c * h * h * P_l * (4 + 2 * f) * h
        else:
            h = max((rhs - 2 * P_a * s) / (P_l * (4 + 2 * f)), x_bounds[0])
            W = 2 * gamma * c * h * h * (P_l * (4 + 2 * f) * h + 2 * P_a * s)
        ps.append(p)
        hs.append(h)
        Ws.append(W)
        grids.append(sch.label)
    name = f"{name} closed form" + (" (leading)" if order == "leading" else "")
    return IsoResult(name, E, ps, hs, Ws, loglog_slope(ps, Ws), grids)


# -- the 3D layer: the closed form ---------------------------------------------------------
def tp3d_overhead(q: int, *, c: float, ffn: float = 4.0, recompute: bool = True) -> float:
    """``Phi_3 = p T_comm / (beta w h^2)``: the 3D layer's total overhead on the q x q x q
    cube in units of ``beta w h^2`` (paper formulas, alpha = 0; see
    :func:`tp3d_closed_form`), ``c = b s / h``; ``recompute``: whole-layer recompute
    (the backward re-runs the forward's collectives).

    ``Phi_3 = (q-1) ((P_f (8+2f) + 11+3f) c + (P_f+2)(4+2f))`` with P_f = 2 (recompute)
    or 1; 0 at q = 1.
    """
    if q < 1:
        raise ValueError(f"need q >= 1, got q={q}")
    f, P_f = ffn, 2 if recompute else 1
    return (q - 1) * ((P_f * (8 + 2 * f) + 11 + 3 * f) * c + (P_f + 2) * (4 + 2 * f))


def tp3d_closed_form(E: float, p_values, *, cfg: TransformerConfig | None = None,
                     b_per_h: float = 1 / 64, beta: float = 1e-9, gamma: float = 1e-11,
                     order: str = "exact", x_bounds=(1e-3, 1e12)) -> IsoResult:
    r"""The isoefficiency function of the 3D layer (Bian et al. 2021) in closed form.

    The problem of :func:`isoefficiency` ("3d", ``mode="paper"`` on
    :func:`paper_machine`), solved by hand on the cubes p = q^3 (others skipped);
    parameters as :func:`summa25_closed_form`'s.

    Notes
    -----
    *Communication per layer per rank* (what
    :func:`~summasim.costmodel.workload.layer.tp3d_linear_ops` lists, the 3D product of
    Agarwal et al. 1995 per linear). A linear ``Y = X W``, X ``[M, i]`` in ``[M/q^2,
    i/q]`` blocks (M = b s), W ``[i, o]`` in ``[i/q^2, o/q]`` pieces, runs forward an
    all-gather of X (``M i/q^3`` items per rank) over q, of W (``i o/q^3``) over the
    depth, and a reduce-scatter of the ``[M/q, o/q]`` partial (``M o/q^2``) over q;
    backward all-gathers of dY (``M o/q^3``), X and W again, and reduce-scatters of dX
    (``M i/q^2``) over q and dW (``i o/q^2``) over the depth. With the paper's
    all-gather ``(g-1) beta B`` (B per rank) and reduce-scatter ``(g-1)/g beta B``, a
    linear costs ``(q-1)/q^3 beta w (M (i + o) + i o)`` forward and ``(q-1)/q^3 beta w
    (M (o + 2i) + 2 i o)`` backward. The papers' block (QKV [h, 3h], projection [h, h],
    fc1 [h, f h], fc2 [f h, h]) has ``sum i = (3+f) h``, ``sum o = (5+f) h``, ``sum i o
    = (4+2f) h^2``, so

        T_f = (q-1)/q^3 beta w ((8+2f) M h + (4+2f) h^2),
        T_b = (q-1)/q^3 beta w ((11+3f) M h + 2 (4+2f) h^2),

    and ``T_comm = P_f T_f + T_b`` (P_f = 2 with whole-layer recompute, else 1).

    *Overhead.* ``T_o = p T_comm = q^3 T_comm``; with M = c h:

        T_o = beta w h^2 Phi_3,  Phi_3 = (q-1) ((P_f (8+2f) + 11+3f) c + (P_f+2)(4+2f))

    (:func:`tp3d_overhead`). *Isoefficiency*: as :func:`summa25_closed_form`, ``P_l
    (4+2f) h + 2 P_a s = beta w Phi_3 / (2 gamma c r)``, linear in h, W = W(h). To
    leading order W ~ h^3 ~ Phi_3^3 ~ (q-1)^3 = (p^(1/3) - 1)^3, which tends to p: every
    term of the overhead is ``O(b s h / p^(2/3) + h^2 / p^(2/3))`` per rank, the
    activations' and the weights' alike shrinking with p^(2/3), where Optimus's
    shrink with sqrt(p) only and carry log q (Optimus's W ~ (sqrt(p) log p)^3).
    Left out as in the "paper" mode: latency, the LayerNorm and bias traffic
    (``include_minor``), elementwise compute, the embedding and head.
    """
    cfg = cfg or TransformerConfig(s=512, N=1, dtype="float32", checkpoint=True)
    _paper_block(cfg, "3D")

    def phi(p):
        sch = _scheme_for("3d", p, None)
        return sch, sch and tp3d_overhead(sch.q, c=b_per_h * cfg.s, ffn=cfg.ffn,
                                          recompute=cfg.recompute == "full")

    return _layer_closed_form("3d", phi, E, p_values, cfg=cfg, b_per_h=b_per_h, beta=beta,
                              gamma=gamma, order=order, x_bounds=x_bounds)


#: How far the fitted slope may sit from the exact closed form's (both solve the same
#: equation; the root finder's tolerance, 1e-10 in log h, is far below it).
EXACT_SLOPE_TOL = 1e-6


def summa25_check(E: float, p_values, *, d: int | None = None,
                  cfg: TransformerConfig | None = None, b_per_h: float = 1 / 64,
                  law: str | None = None, case: str | None = None,
                  solver: str = "illinois") -> dict:
    """The fitted SUMMA2.5 slope (:func:`isoefficiency`, paper assumptions; d = 1:
    Optimus) next to its closed forms over the same p and grids.

    Returns ``{"case", "p_range", "grids", "slope_measured", "slope_closed_form",
    "measured_minus_closed", "slope_leading", "law", "slope_law", "max_rel_W"}``: the
    exact closed form's slope (equal to the measured one within :data:`EXACT_SLOPE_TOL`:
    the same equation, solved by hand), the leading-order law's (Phi^3; the fitted slope is steeper while h is not
    >> s, by the attention core's ``2 s`` term of W: within :data:`LEADING_SLOPE_TOL`
    here), and, when ``law`` (a :func:`reference_slope` kind) is given, the asymptotic
    law's over the same p, which also differs by the log factors' local slope
    (``log2 p = 2 log2 q + log2 d``), by the d - 1 term and, while ``d < (3+f) c /
    (4+2f)``, by the activation term that the law drops. ``max_rel_W`` is the largest
    relative difference between the fitted and the exact closed-form W.
    """
    cfg = cfg or TransformerConfig(s=512, N=1, dtype="float32", checkpoint=True)
    kw = dict(cfg=cfg, b_per_h=b_per_h, n_per_h=b_per_h)
    if d == 1:
        meas = isoefficiency("optimus", E, p_values, solver=solver, **kw)
    else:
        meas = isoefficiency("summa25", E, p_values, d=d, solver=solver, **kw)
    exact = summa25_closed_form(E, meas.p, d=d, cfg=cfg, b_per_h=b_per_h)
    lead = summa25_closed_form(E, meas.p, d=d, cfg=cfg, b_per_h=b_per_h, order="leading")
    rel = max((abs(a / b - 1) for a, b in zip(meas.W, exact.W)), default=float("nan"))
    if case is None:
        case = "d = 1 (Optimus)" if d == 1 else (f"d = {d}" if d else "d by the rule")
    return {"case": case, "p_range": f"{meas.p[0]}..{meas.p[-1]}" if meas.p else "-",
            "grids": meas.grid, "slope_measured": meas.slope,
            "slope_closed_form": exact.slope,
            "measured_minus_closed": meas.slope - exact.slope, "slope_leading": lead.slope,
            "law": law or "-",
            "slope_law": reference_slope(law, meas.p) if law else float("nan"),
            "max_rel_W": rel}


#: How far the fitted slope may sit from the leading-order law's over
#: :data:`CLOSED_FORM_CASES` (s = 512, b = h/64: h from 260 up, 2 s/(4+2f) = 85).
LEADING_SLOPE_TOL = 0.05

#: The rows of :func:`print_closed_forms`: (case, d, p values, asymptotic law).
CLOSED_FORM_CASES = (
    ("d = 1 (Optimus)", 1, [4 ** k for k in range(2, 9)], "(sqrt(p) log p)^3"),  # 16..65536
    ("d = 2", 2, [2 * 4 ** k for k in range(1, 9)], "(sqrt(p) log p)^3"),        # 8..131072
    ("d = 4", 4, [4 ** k for k in range(2, 10)], "(sqrt(p) log p)^3"),           # 16..262144
    ("d by the rule", None, [4 ** k for k in range(2, 9)], None),   # explore's p: a staircase
    ("d = p^(1/3)", None, [8 ** k for k in range(1, 7)], "(p^(2/3) log p)^3"),  # cubes 8..262144
)


def print_closed_forms(E: float = 0.5, out=None) -> list[dict]:
    """Print (to ``out``, default stdout) and return :func:`summa25_check`'s rows for
    :data:`CLOSED_FORM_CASES`: the measured SUMMA2.5 slopes next to the closed forms."""
    import sys

    from ._cli import fmt, table

    rows = [summa25_check(E, ps, d=d, law=law, case=case)
            for case, d, ps, law in CLOSED_FORM_CASES]
    heads = ["case", "p_range", "slope_measured", "slope_closed_form",
             "measured_minus_closed", "slope_leading", "law", "slope_law", "max_rel_W"]
    out = out or sys.stdout
    out.write(f"SUMMA2.5-LM isoefficiency at E = {E}, papers' assumptions (alpha = 0): "
              f"fitted slope of W(p) against the closed form\n")
    out.write(table(heads, [[fmt(r[k]) for k in heads] for r in rows]))
    return rows


def reference_slope(kind: str, p_values, *, E: float = 0.5,
                    cfg: TransformerConfig | None = None, b_per_h: float = 1 / 64,
                    d: int | None = None) -> float:
    """Log-log slope of a reference growth law over ``p_values``.

    Kinds: "p^3", "p^1.5", "(sqrt(p) log p)^3" (log base 2; alias "optimus"),
    "(p^(2/3) log p)^3" (SUMMA2.5 at d = p^(1/3), asymptotically), "(p^(1/3) - 1)^3"
    (the 3D product, and the 2.5D one at c = p^(1/3)), the 2.5D and 3D products' closed
    forms "sd25 closed form" and "mm3d closed form" (:func:`deep_closed_form`, at depth
    ``d`` for sd25), and SUMMA2.5-LM's
    closed forms of :func:`summa25_closed_form` on the grids :func:`isoefficiency` takes
    at each p for depth ``d`` (p without one are skipped), with ``cfg``'s s, f, dtype
    and recompute and ``b_per_h`` (defaults: :func:`isoefficiency`'s), on
    :func:`paper_machine`: "summa25 closed form" (exact, at efficiency ``E``: what the
    "paper assumptions" fit must equal) and "summa25 leading" (:data:`SUMMA25_LAW`,
    W ~ Phi^3, independent of E, beta and gamma); the 3D layer's "3d closed form" and
    "3d leading" (:func:`tp3d_closed_form`, on the cubes among ``p_values``). Only the
    SUMMA2.5 and 3D kinds read ``E``, ``cfg`` and ``b_per_h``, only SUMMA2.5's ``d``.
    """
    if kind in ("summa25 closed form", "summa25 leading"):
        order = "exact" if kind == "summa25 closed form" else "leading"
        return summa25_closed_form(E, p_values, d=d, cfg=cfg, b_per_h=b_per_h,
                                   order=order).slope
    if kind in ("3d closed form", "3d leading"):
        order = "exact" if kind == "3d closed form" else "leading"
        return tp3d_closed_form(E, p_values, cfg=cfg, b_per_h=b_per_h, order=order).slope
    if kind in ("sd25 closed form", "mm3d closed form"):
        return deep_closed_form(kind.split()[0] + "_mm", E, p_values, d=d).slope
    p = np.asarray(list(p_values), float)
    if kind == "p^3":
        y = p ** 3
    elif kind == "p^1.5":
        y = p ** 1.5
    elif kind in ("(sqrt(p) log p)^3", "optimus"):
        y = (np.sqrt(p) * np.log2(p)) ** 3
    elif kind == "(p^(2/3) log p)^3":
        y = (p ** (2 / 3) * np.log2(p)) ** 3
    elif kind == "(p^(1/3) - 1)^3":
        y = (np.cbrt(p) - 1) ** 3
    else:
        raise ValueError(f"unknown reference {kind!r}")
    return loglog_slope(p, y)
