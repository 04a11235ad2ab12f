"""The tables of ``python -m summasim.costmodel explore``: what-if sweeps over p, without MPI.

For a machine and a transformer (a
:class:`~summasim.costmodel.workload.scheme.TransformerConfig`) at the ranks ``p_values``:

:func:`scaling_table`  time per training step of every scheme, the best grid of each
                       (SUMMA2.5: the best [q, q, d]), speedup and efficiency against
                       one rank, the communication share, memory per rank, the best
                       scheme at each p; strong (fixed problem) or weak (the problem
                       grown by :func:`weak_config`: the batch, the hidden size and
                       heads, or both)
:func:`matmul_table`   cannon_ab, summa_ab, summa25_ab and sd25_ab (best d each) and
                       mm3d_ab (cubes) on n x n, with the
                       words the busiest rank moves against the communication lower
                       bounds (:mod:`~summasim.costmodel.workload.bounds`; SUMMA2.5's
                       weight starts copied over the depth, so its bound is 0 from
                       d = 4 on: it pays no replication in this layout)
:func:`iso_table`      fitted exponents of W(p) at a fixed efficiency under the papers'
                       assumptions (alpha = 0, paper formulas) and on this machine
:func:`batch_table`    per scheme and p, the largest b whose memory per rank fits

On a GPU machine (:func:`gpu_machine`: a roofline ``device`` or the NCCL library) a step
is the whole training step of :func:`~summasim.costmodel.workload.step.step_breakdown`
(embedding, layers, head, loss, optimizer, NCCL collectives on the topology under a
placement); elsewhere it is N layers of
:func:`~summasim.costmodel.workload.layer.scheme_cost`. The grids are those of
:func:`summasim.spec.grids` (Optimus: q x q, else the most square pr x pc both ways;
SUMMA2.5: every [q, q, d] with q, d >= 2, d > q included, else the smallest depth over
its most square pr x pc both ways). A grid that does not divide the model at some p is not priced there: the tables leave
it out and list it, with :func:`why_not`, as skipped. The command line is
:mod:`.explore_cli`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from summasim import spec
from summasim.costmodel.workload.bounds import product_bounds
from summasim.costmodel.workload.predict import predict_algorithm
from summasim.costmodel.workload.traffic import algorithm_messages, moved_bytes
from summasim.costmodel.workload.scheme import SCHEMES, Scheme, TransformerConfig, misfit
from summasim.costmodel.workload.footprint import (batch_step, largest_batch, memory,
                                                   training_grad_bytes)
from summasim.costmodel.workload.layer import scheme_cost
from summasim.costmodel.machine.topology import Placement

from . import scheme_grids
from .isoefficiency import isoefficiency, paper_machine, reference_slope
from .predict import step_breakdown_layers

GiB = float(1 << 30)


def p_range(p_min: int, p_max: int) -> list[int]:
    """p = ``p_min``, 2 ``p_min``, 4 ``p_min``, ... up to ``p_max``."""
    out, p = [], max(1, p_min)
    while p <= p_max:
        out.append(p)
        p *= 2
    return out


#: Weak-scaling rules: what grows with p.
WEAK_RULES = ("batch", "hidden", "both")


class _Priced(NamedTuple):
    """One scheme's step on one grid, as the tables need it."""

    scheme: Scheme
    step_seconds: float
    comm_fraction: float
    memory: object
    algorithms: str


def gpu_machine(machine) -> bool:
    """Whether ``machine`` prices whole GPU training steps (a roofline device or NCCL)."""
    return machine.device is not None or machine.library == "nccl"


def _price(sch, cfg, machine, mode, placement=None) -> _Priced:
    """The whole step on GPU machines (:func:`step_breakdown`), else N layers; the
    memory with the training's gradient bytes (:func:`training_grad_bytes`)."""
    mem = memory(sch, cfg, training_grad_bytes(cfg))
    if gpu_machine(machine):
        try:
            sb = step_breakdown_layers(sch, cfg, machine, mode=mode, placement=placement)
        except ValueError:
            if placement is None or placement.policy == "row-major":
                raise
            # the placement does not fit this grid: row-major instead
            sb = step_breakdown_layers(sch, cfg, machine, mode=mode)
        algs = "; ".join(f"{op}/{g}: {'+'.join(a)}" for (op, g), a in sorted(sb.algorithms.items()))
        return _Priced(sch, sb.seconds, sb.comm_exposed_seconds / sb.seconds if sb.seconds
                       else 0.0, mem, algs)
    c = scheme_cost(sch, cfg, machine, mode=mode)
    return _Priced(sch, c.step_seconds, c.comm_fraction, mem, c.algorithms())


def _best_of(p, name, cfg, machine, mode, placement=None):
    costs = [_price(sch, cfg, machine, mode, placement) for sch in scheme_grids(p, name, cfg)]
    return min(costs, key=lambda c: c.step_seconds) if costs else None


def weak_config(cfg: TransformerConfig, p: int, p0: int, rule: str = "batch") -> TransformerConfig:
    """The weak-scaling problem at p ranks (``cfg`` at ``p0``).

    ``batch``: b = b0 p / p0. ``hidden``: the heads grow with sqrt(p / p0) (rounded,
    at least 1) and h with them, the head size h0 / n0 kept (h = n hd), as the 2D
    papers grow h with sqrt(p). ``both``: the two together.
    """
    if rule not in WEAK_RULES:
        raise ValueError(f"unknown weak-scaling rule {rule!r}; choose {', '.join(WEAK_RULES)}")
    out = cfg
    if rule in ("batch", "both"):
        b = cfg.b * p / p0
        out = out.replace(b=int(b) if float(b).is_integer() else b)
    if rule in ("hidden", "both"):
        hd = cfg.h / cfg.n
        n = max(1, int(round(cfg.n * math.sqrt(p / p0))))
        h = n * hd
        out = out.replace(n=n, h=int(h) if float(h).is_integer() else h)
    return out


def why_not(p, name, cfg, **kw) -> str:
    """Why no grid of ``p`` ranks for ``name`` runs ``cfg`` (the first grid's reason)."""
    shapes = scheme_grids(p, name)
    if not shapes:
        return f"no {name} grid has p = {p} ranks"
    return misfit(shapes[0], cfg, **kw) or "no grid divides the model"


def scaling_table(cfg: TransformerConfig, machine, p_values, schemes=SCHEMES, *,
                  mode: str = "mpich", weak: bool = False, budget=0.0,
                  skipped: list | None = None, weak_rule: str = "batch",
                  placement: Placement | None = None, tick=None) -> list[dict]:
    """Rows ``{p, scheme, grid, b, h, n, step_s, speedup, efficiency, comm_frac, mem_gib,
    fits}``.

    Strong scaling keeps ``cfg``; weak scaling grows it by ``weak_rule`` from
    p_values[0] (:func:`weak_config`).
    Speedup is W / Tp and efficiency W / (p Tp) (Optimus section 3.1.2), with W the
    time of the same problem on one rank (Megatron with p = 1 is the serial model).
    Only grids that divide the model are priced (:func:`~.schemes.misfit`); a scheme
    with a grid of p ranks none of which divides it is appended to ``skipped`` as
    ``{p, scheme, reason}``. ``tick``, when given, is called once per p priced (a
    progress bar's ``update``).
    """
    rows = []
    p0 = p_values[0]
    serial = {}
    for p in p_values:
        c_p = weak_config(cfg, p, p0, weak_rule) if weak else cfg
        key = (c_p.b, c_p.h, c_p.n)
        if key not in serial:
            serial[key] = _price(Scheme("megatron", 1), c_p, machine, mode).step_seconds
        W = serial[key]
        for name in schemes:
            best = _best_of(p, name, c_p, machine, mode, placement)
            if best is None:
                if skipped is not None and scheme_grids(p, name):
                    skipped.append({"p": p, "scheme": name, "reason": why_not(p, name, c_p)})
                continue
            t = best.step_seconds
            mem = best.memory.total
            rows.append({"p": p, "scheme": name, "grid": best.scheme.label,
                         "b": c_p.b, "h": c_p.h, "n": c_p.n, "step_s": t, "speedup": W / t,
                         "efficiency": W / (p * t),
                         "comm_frac": best.comm_fraction, "mem_gib": mem / GiB,
                         "fits": (mem <= budget_at(budget, p)) if budget_at(budget, p) > 0
                         else None,
                         "algorithms": best.algorithms})
        if tick is not None:
            tick()
    # mark the fastest scheme at each p
    for p in p_values:
        mine = [r for r in rows if r["p"] == p]
        if mine:
            fastest = min(mine, key=lambda r: r["step_s"])
            for r in mine:
                r["best"] = r is fastest
    return rows


def matmul_table(n: int, machine, p_values, *, dtype: str = "float64",
                 mode: str = "mpich", skipped: list | None = None,
                 placement: Placement | None = None, algorithms=None) -> list[dict]:
    """Rows ``{p, algorithm, grid, seconds, efficiency, comm_frac}`` for n x n x n on the
    grids :func:`summasim.spec.grids` gives each product (SUMMA on a rectangular
    ``pr x pc`` grid where p is not a square).

    Every product takes any n (balanced blocks; the 3D cube's nested partition), priced
    exactly; a product with no grid of p ranks goes to ``skipped`` as ``{p, scheme,
    reason}``. ``algorithms``: price only
    these (default all five)."""
    rows = []
    t1 = machine.gemm_time(n, n, n, dtype) * machine.slowdown(1)
    for p in p_values:
        cands = []
        for alg in ("cannon_ab", "summa_ab", "summa25_ab"):   # the grids the main job runs
            cands += [(alg, g.q, g.d, g.pc) for g in spec.grids(p, alg)
                      if alg != "summa25_ab" or g.d > 1 or p == 1]
        for g in spec.grids(p, "sd25_ab"):          # Solomonik-Demmel with c = d copies
            if g.d > 1 and g.q > 1:
                cands.append(("sd25_ab", g.q, g.d, 0))
        for g in spec.grids(p, "mm3d_ab"):          # the q x q x q cube
            if g.q > 1:
                cands.append(("mm3d_ab", g.q, g.d, 0))
        if algorithms is not None:
            cands = [c for c in cands if c[0] in algorithms]
        best = {}
        for alg, qq, dd, pc in list(cands):
            if alg in spec.ANY_SIZE:
                continue
            need = (qq * qq, "q^2") if alg == "mm3d_ab" else (qq, "q")
            if n % need[0]:
                cands.remove((alg, qq, dd, pc))
                if skipped is not None:
                    skipped.append({"p": p, "scheme": alg, "reason":
                                    f"n = {n} is not divisible by {need[1]} = {need[0]}"})
        for alg, qq, dd, pc in cands:
            exact = alg in spec.ANY_SIZE        # balanced blocks, any n, any pr x pc
            kw = dict(machine=machine, dtype=dtype, mode=mode, strict=exact,
                      pc=pc or None)
            try:
                pr = predict_algorithm(alg, n, n, n, qq, dd, placement=placement, **kw)
            except ValueError:           # the placement does not fit this grid
                pr = predict_algorithm(alg, n, n, n, qq, dd, **kw)
            row = {"p": p, "n": n, "algorithm": alg, "grid": f"[{qq},{pc or qq},{dd}]",
                   "seconds": pr.seconds, "efficiency": t1 / (p * pr.seconds),
                   "comm_frac": pr.comm_seconds / pr.seconds if pr.seconds else 0.0,
                   "algorithms": pr.describe_algorithms(), **words_moved(alg, n, qq, dd, pc)}
            if alg in ("summa25_ab", "sd25_ab"):     # the best depth of each
                if alg not in best or row["seconds"] < best[alg]["seconds"]:
                    best[alg] = row
            else:
                rows.append(row)
        rows += [best[a] for a in ("summa25_ab", "sd25_ab") if a in best]
    return rows


#: The products :func:`crossovers` sets against SUMMA: Solomonik-Demmel 2.5D (its best
#: copies) and the 3D product, the communication-avoiding ones. (SUMMA2.5 starts from
#: its weight replicated over the depth: on [1, 1, d] it sends nothing at all, a
#: "crossover" at p = 2 that says nothing.)
CROSSOVER_ALGS = ("sd25_ab", "mm3d_ab")


def crossovers(rows: list[dict], against: str = "summa_ab") -> list[dict]:
    """Where each of :data:`CROSSOVER_ALGS` overtakes SUMMA in a :func:`matmul_table`:
    ``[{"algorithm", "against", "n", "p_time", "p_words", "p_max", "speedup",
    "words_ratio"}]``. ``p_time`` is the crossover in predicted time: the smallest p of
    the table from which on the product is faster than SUMMA at every larger p the two
    share (None when it is slower at the largest); ``p_words`` the same for the words
    the busiest rank moves. ``speedup`` and ``words_ratio`` are SUMMA's time and words
    over the product's at the largest p both ran."""
    out = []
    base = {r["p"]: r for r in rows if r["algorithm"] == against}

    def crossover(mine, key):
        p0 = None
        for r in reversed(mine):                 # the longest run of wins up to the end
            if not r[key] < base[r["p"]][key]:
                break
            p0 = r["p"]
        return p0

    for alg in CROSSOVER_ALGS:
        mine = sorted((r for r in rows if r["algorithm"] == alg and r["p"] in base),
                      key=lambda r: r["p"])
        if not mine:
            continue
        last = mine[-1]
        out.append({"algorithm": alg, "against": against, "n": last.get("n"),
                    "p_time": crossover(mine, "seconds"), "p_words": crossover(mine, "words"),
                    "p_max": last["p"],
                    "speedup": base[last["p"]]["seconds"] / last["seconds"],
                    "words_ratio": (base[last["p"]]["words"] / last["words"]
                                    if last["words"] else None)})
    return out


def words_moved(alg: str, n: int, q: int, d: int, pc: int = 0) -> dict:
    """The words the busiest rank of ``alg`` (an ``*_ab`` product on ``[q, q, d]``, or
    ``[q, pc, d]``) moves on n x n x n, from the closed-form events
    (:func:`~summasim.costmodel.workload.traffic.algorithm_messages`, an all-gather
    counted as the g - 1 contributions it brings in; Cannon's busiest rank
    is one that skews both operands, (1, 1); with balanced blocks the first rank, whose
    blocks are the largest), and the lower bounds with the blocks it holds:
    ``{"words", "bound_independent", "bound_dependent", "words_over_bound"}``."""
    cols = pc or q
    exact = alg in spec.ANY_SIZE
    coords = (1 % q, 1 % cols, 0)
    msgs = lambda c: algorithm_messages(alg, n, n, n, q, d, itemsize=1,  # noqa: E731
                                        coords=c, strict=exact, pc=pc or None)
    words = moved_bytes(msgs(coords))
    if exact and (pc or n % (d * q)):     # uneven: the first rank holds the most
        words = max(words, moved_bytes(msgs((0, 0, 0))))
    if alg == "mm3d_ab":                    # every operand cut into q^2 x q pieces
        blocks = [(q * q, q)] * 3
    elif alg == "sd25_ab":                  # A and B on layer 0 only, C on every layer
        blocks = [(d * q, q), (d * q, q), (q, q)]
    else:                                   # A's and C's row blocks; B copied over d
        rows = d * q if alg.startswith("summa25") else q
        blocks = [(rows, cols), (q, cols), (rows, cols)]
    b = product_bounds([((n, n), bl) for bl in blocks], n, n, n, q, d, pc)
    return {"words": words, "bound_independent": b["memory_independent"],
            "bound_dependent": b["memory_dependent"],
            "words_over_bound": words / b["bound"] if b["bound"] > 0 else None}


#: The problems of :func:`iso_table`, with the reference growth law of each.
ISO_REFERENCES = {"megatron": "p^3", "optimus": "(sqrt(p) log p)^3",
                  "summa25": "summa25 closed form", "3d": "3d closed form",
                  "cannon": "p^1.5", "summa": "p^1.5",
                  "sd25_mm": "sd25 closed form", "mm3d_mm": "mm3d closed form"}
#: The 2.5D and 3D products' fits under the papers' assumptions take every broadcast as
#: scatter + all-gather (bandwidth-optimal, what their closed forms assume; MPICH picks
#: a binomial tree below 8 ranks), on cubes p = q^3 (sd25 with c = q copies).
DEEP_ISO = {"sd25_mm", "mm3d_mm"}
DEEP_BCAST = {"bcast": "scatter_ring_allgather"}


def iso_table(machine, p_values, E: float, cfg: TransformerConfig,
              tick=None) -> tuple[list[dict], dict]:
    """Fitted isoefficiency exponents (papers' assumptions and this machine); ``tick``,
    when given, is called once per problem fitted."""
    rows, curves = [], {}
    p4 = [p for p in p_values if p >= 16 and math.isqrt(p) ** 2 == p]
    cubes = [p for p in p_values if p >= 8 and round(p ** (1 / 3)) ** 3 == p]
    if len(p4) < 2:
        return rows, curves
    paper = paper_machine()
    for prob, ref in ISO_REFERENCES.items():
        deep = prob in DEEP_ISO
        ps = cubes if deep or spec.SCHEME_KINDS.get(prob) == "3d" else p4
        if len(ps) < 2:             # fewer than two cubes in range: nothing to fit
            if tick is not None:
                tick()
            continue
        mode = "paper" if prob in SCHEMES else "mpich"
        r = isoefficiency(prob, E, ps, machine=paper, mode=mode, cfg=cfg.replace(N=1),
                          solver="illinois", algorithms=DEEP_BCAST if deep else None)
        rm = isoefficiency(prob, E, ps, machine=machine, mode="mpich", cfg=cfg.replace(N=1),
                           dtype=cfg.dtype if prob in SCHEMES else "float64", solver="illinois")
        curves[prob] = {"paper": r, "machine": rm}
        rows.append({"problem": prob, "E": E, "p_range": f"{ps[0]}..{ps[-1]}",
                     "slope_paper_assumptions": r.slope, "slope_this_machine": rm.slope,
                     "reference": ref,
                     "reference_slope": reference_slope(ref, ps, E=E, cfg=cfg.replace(N=1))})
        if tick is not None:
            tick()
    return rows, curves


def budget_at(budget, p: int) -> float:
    """Bytes per rank at ``p`` ranks: ``budget`` itself, or ``budget(p)`` when it is a
    function of the ranks (a CPU node's memory shared by the ranks on it,
    :func:`~summasim.costmodel.compute.roofline.usable_memory`)."""
    return float(budget(p) if callable(budget) else budget)


def batch_table(cfg: TransformerConfig, p_values, budget, schemes=SCHEMES) -> list[dict]:
    """Rows ``{p, scheme, grid, largest_b, budget_gib}``: per scheme and p, the grid
    (among those dividing the model apart from the batch) that fits the largest batch
    under ``budget`` bytes per rank (a number, or a function of p: :func:`budget_at`)."""
    rows = []
    if not any(budget_at(budget, p) > 0 for p in p_values):
        return rows
    for p in p_values:
        mine = budget_at(budget, p)
        for name in schemes:
            shapes = [sch for sch in scheme_grids(p, name)
                      if misfit(sch, cfg.replace(b=batch_step(sch))) is None]
            if not shapes:
                continue
            best = max(((largest_batch(s, cfg, mine, grad_bytes=training_grad_bytes(cfg)), s)
                        for s in shapes),
                       key=lambda t: t[0])
            rows.append({"p": p, "scheme": name, "grid": best[1].label, "largest_b": best[0],
                         "budget_gib": mine / GiB})
    return rows
