"""``python -m summasim.costmodel explore``: what-if sweeps over p, without MPI.

For a machine (``--machine FILE|PRESET``) and a transformer (``--model``, ``--batch``,
``--dtype``) it prints:

strong scaling      time per training step of every scheme at p = 1, 2, 4, ...,
                    ``--p-max`` (fixed problem), the best [q, q, d] for SUMMA2.5,
                    speedup and efficiency against one rank, the communication
                    share, memory per rank, and the best scheme at each p
weak scaling        the same with the problem grown with p by ``--weak``: ``batch``
                    (b = --batch * p / p0), ``hidden`` (h and the heads grown with
                    sqrt(p / p0), the head size h / n kept), or ``both``
matrix products     cannon_ab, summa_ab and summa25_ab (best d) on n x n
                    (``--matmul-n``), time and efficiency
isoefficiency       fitted exponents of W(p) at efficiency ``--efficiency`` under
                    the papers' assumptions (alpha = 0, paper formulas) and on this
                    machine (MPICH algorithms), with the papers' references
largest batch       per scheme and p, the largest b whose memory per rank fits
                    ``--mem-budget`` (default: the machine's memory per rank)

The ranks are ``--p 4,16,36,64`` (any list) or p = ``--p-min``, 2 ``--p-min``, ...,
``--p-max``. On a GPU machine (a preset with a roofline ``device`` or the NCCL
library: ``dgx-a100``, ``h100-dgx-ndr``, ``frontera-rtx``, ``dgx2h-v100``) a step is
the whole training step of :func:`~summasim.costmodel.workload.step.step_breakdown`
(embedding, layers, head, loss, optimizer, NCCL collectives on the topology under
``--placement``); elsewhere it is N layers of
:func:`~summasim.costmodel.workload.layer.scheme_cost`. The grids are those of
:func:`summasim.spec.grids` (SUMMA2.5: every [q, q, d] with q, d >= 2, d > q included).

``--csv`` / ``--json`` write every table (atomically); ``--plot`` writes PNGs
(scaling curves, isoefficiency) with matplotlib, or says how to install it.
Files go under ``--outdir`` (default ./results). The model is analytic, so a sweep
to p = 65536 takes well under a second.

Every argument is checked before the sweep (:func:`check_args`): the model parses
(:meth:`summasim.spec.Model.parse`: positive sizes, heads dividing h), the machine
loads, the outputs can be
written; a user error is one line on stderr and exit status 2. A grid that does
not divide the model at some p (Megatron: heads, h, the MLP width and v by p;
Optimus and SUMMA2.5-LM: those by q and the batch by d q; the n x n products: n by
d q) is not priced there: the tables leave it out and a "not priced" note says
why. A model that no grid of the sweep can run is a user error.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
from typing import NamedTuple

from summasim import cli, options, spec
from summasim.costmodel.machine import DTYPE_SIZES, Machine, list_presets
from summasim.costmodel.workload.predict import predict_algorithm
from summasim.costmodel.workload.scheme import SCHEMES, Scheme, TransformerConfig, misfit
from summasim.costmodel.workload.footprint import batch_step, largest_batch
from summasim.costmodel.workload.layer import scheme_cost
from summasim.costmodel.workload.step import step_breakdown
from summasim.costmodel.machine.topology import Placement
from summasim.jsonio import write_json_atomic, write_text_atomic

from . import scheme_grids
from .isoefficiency import isoefficiency, paper_machine, reference_slope
from .predict import model_batch, resolve_machine

GiB = float(1 << 30)
#: Sweeps to thousands of ranks are about clusters: explore defaults to the H100 preset.
EXPLORE_PRESET = "h100-dgx-ndr"
#: The default problem: h = 8192, 64 heads, 24 layers, sequence 1024, a GPT vocabulary
#: padded as Megatron-LM pads it, batch 64.
EXPLORE_MODEL = "h=8192,heads=64,layers=24,seq=1024,vocab=51200"
EXPLORE_BATCH = 64
PLOT_HINT = "plots need matplotlib: pip install summasim[plot]"
#: The largest --p-max: 2^40 ranks (the SUMMA2.5 grid search grows as p^(1/3)).
MAX_P = 1 << 40


def _p_values(p_min: int, p_max: int) -> list[int]:
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


def _gpu(machine) -> bool:
    return machine.device is not None or machine.library == "nccl"


def _price(sch, cfg, machine, mode, placement=None) -> _Priced:
    """The whole step on GPU machines (:func:`step_breakdown`), else N layers."""
    if _gpu(machine):
        try:
            sb = step_breakdown(sch, cfg, machine, mode=mode, placement=placement)
        except ValueError:
            if placement is None or placement.policy == "row-major":
                raise
            # the placement does not fit this grid: row-major instead
            sb = step_breakdown(sch, cfg, machine, mode=mode)
        algs = "; ".join(f"{op}/{g}: {'+'.join(a)}" for (op, g), a in sorted(sb.algorithms.items()))
        return _Priced(sch, sb.seconds, sb.comm_exposed_seconds / sb.seconds if sb.seconds
                       else 0.0, sb.memory, algs)
    c = scheme_cost(sch, cfg, machine, mode=mode)
    return _Priced(sch, c.step_seconds, c.comm_fraction, c.memory, c.algorithms())


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


def _why_not(p, name, cfg, **kw) -> str:
    """Why no grid of ``p`` ranks for ``name`` runs ``cfg`` (the first grid's reason)."""
    shapes = scheme_grids(p, name)
    if not shapes:
        return f"no {name} grid has p = {p} ranks"
    return misfit(shapes[0], cfg, **kw) or "no grid divides the model"


def scaling_table(cfg: TransformerConfig, machine, p_values, schemes=SCHEMES, *,
                  mode: str = "mpich", weak: bool = False, budget: float = 0.0,
                  skipped: list | None = None, weak_rule: str = "batch",
                  placement: Placement | None = None) -> list[dict]:
    """Rows ``{p, scheme, grid, b, h, n, step_s, speedup, efficiency, comm_frac, mem_gib,
    fits}``.

    Strong scaling keeps ``cfg``; weak scaling grows it by ``weak_rule`` from
    p_values[0] (:func:`weak_config`).
    Speedup is W / Tp and efficiency W / (p Tp) (Optimus section 3.1.2), with W the
    time of the same problem on one rank (Megatron with p = 1 is the serial model).
    Only grids that divide the model are priced (:func:`~.schemes.misfit`); a scheme
    with a grid of p ranks none of which divides it is appended to ``skipped`` as
    ``{p, scheme, reason}``.
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
                    skipped.append({"p": p, "scheme": name, "reason": _why_not(p, name, c_p)})
                continue
            t = best.step_seconds
            mem = best.memory.total
            rows.append({"p": p, "scheme": name, "grid": best.scheme.label,
                         "b": c_p.b, "h": c_p.h, "n": c_p.n, "step_s": t, "speedup": W / t,
                         "efficiency": W / (p * t),
                         "comm_frac": best.comm_fraction, "mem_gib": mem / GiB,
                         "fits": (mem <= budget) if budget > 0 else None,
                         "algorithms": best.algorithms})
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
                 placement: Placement | None = None) -> list[dict]:
    """Rows ``{p, algorithm, grid, seconds, efficiency, comm_frac}`` for n x n x n.

    Only grids whose blocks are whole are priced: n divisible by q ([q, q]) and by
    d q ([q, q, d]); the others go to ``skipped`` as ``{p, scheme, reason}``."""
    rows = []
    t1 = machine.gemm_time(n, n, n, dtype) * machine.slowdown(1)
    for p in p_values:
        q = math.isqrt(p)
        cands = []
        if q * q == p:
            cands += [("cannon_ab", q, 1), ("summa_ab", q, 1)]
        for g in spec.grids(p, "summa25_ab"):      # the grids the main job runs it on
            cands.append(("summa25_ab", g.q, g.d))
        best25 = None
        for alg, qq, dd in list(cands):
            if n % (qq * dd):
                cands.remove((alg, qq, dd))
                if skipped is not None:
                    skipped.append({"p": p, "scheme": alg, "reason":
                                    f"n = {n} is not divisible by "
                                    f"{'d q' if dd > 1 else 'q'} = {qq * dd}"})
        for alg, qq, dd in cands:
            try:
                pr = predict_algorithm(alg, n, n, n, qq, dd, machine=machine, dtype=dtype,
                                       mode=mode, strict=False, placement=placement)
            except ValueError:           # the placement does not fit this grid
                pr = predict_algorithm(alg, n, n, n, qq, dd, machine=machine, dtype=dtype,
                                       mode=mode, strict=False)
            row = {"p": p, "algorithm": alg, "grid": f"[{qq},{qq},{dd}]",
                   "seconds": pr.seconds, "efficiency": t1 / (p * pr.seconds),
                   "comm_frac": pr.comm_seconds / pr.seconds if pr.seconds else 0.0,
                   "algorithms": pr.describe_algorithms()}
            if alg == "summa25_ab":
                if best25 is None or row["seconds"] < best25["seconds"]:
                    best25 = row
            else:
                rows.append(row)
        if best25:
            rows.append(best25)
    return rows


def iso_table(machine, p_values, E: float, cfg: TransformerConfig) -> tuple[list[dict], dict]:
    """Fitted isoefficiency exponents (papers' assumptions and this machine)."""
    rows, curves = [], {}
    p4 = [p for p in p_values if p >= 16 and math.isqrt(p) ** 2 == p]
    if len(p4) < 2:
        return rows, curves
    refs = {"megatron": "p^3", "optimus": "(sqrt(p) log p)^3", "summa25": "(sqrt(p) log p)^3",
            "cannon": "p^1.5", "summa": "p^1.5"}
    paper = paper_machine()
    for prob, ref in refs.items():
        mode = "paper" if prob in SCHEMES else "mpich"
        r = isoefficiency(prob, E, p4, machine=paper, mode=mode, cfg=cfg.replace(N=1),
                          solver="illinois")
        rm = isoefficiency(prob, E, p4, machine=machine, mode="mpich", cfg=cfg.replace(N=1),
                           dtype=cfg.dtype if prob in SCHEMES else "float64", solver="illinois")
        curves[prob] = {"paper": r, "machine": rm}
        rows.append({"problem": prob, "E": E, "p_range": f"{p4[0]}..{p4[-1]}",
                     "slope_paper_assumptions": r.slope, "slope_this_machine": rm.slope,
                     "reference": ref, "reference_slope": reference_slope(ref, p4)})
    return rows, curves


def batch_table(cfg: TransformerConfig, p_values, budget: float, schemes=SCHEMES) -> list[dict]:
    """Rows ``{p, scheme, grid, largest_b, budget_gib}``: per scheme and p, the grid
    (among those dividing the model apart from the batch) that fits the largest batch."""
    rows = []
    if budget <= 0:
        return rows
    for p in p_values:
        for name in schemes:
            shapes = [sch for sch in scheme_grids(p, name)
                      if misfit(sch, cfg.replace(b=batch_step(sch))) is None]
            if not shapes:
                continue
            best = max(((largest_batch(s, cfg, budget), s) for s in shapes),
                       key=lambda t: t[0])
            rows.append({"p": p, "scheme": name, "grid": best[1].label, "largest_b": best[0],
                         "budget_gib": budget / GiB})
    return rows


# -- output ---------------------------------------------------------------------------------
def _fmt(v):
    if isinstance(v, bool) or v is None:
        return "-" if v is None else ("yes" if v else "no")
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:.3g}" if (a >= 1e4 or a < 1e-2) else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def format_table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "  (no rows)\n"
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    out = io.StringIO()
    out.write("  " + "  ".join(c.rjust(w) for c, w in zip(cols, width)) + "\n")
    for x in cells:
        out.write("  " + "  ".join(v.rjust(w) for v, w in zip(x, width)) + "\n")
    return out.getvalue()


def write_csv(path: str, tables: dict[str, list[dict]]) -> None:
    """All tables in one CSV, first column ``table`` (written atomically)."""
    cols = ["table"]
    for rows in tables.values():
        for r in rows:
            cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for name, rows in tables.items():
        for r in rows:
            w.writerow({"table": name, **r})
    write_text_atomic(path, buf.getvalue())


def make_plots(outdir: str, tables: dict, curves: dict, title: str) -> list[str]:
    """Write scaling.png and isoefficiency.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(outdir, exist_ok=True)
    paths = []
    colors = {"megatron": "tab:red", "optimus": "tab:blue", "summa25": "tab:green",
              "cannon_ab": "tab:purple", "summa_ab": "tab:orange", "summa25_ab": "tab:green",
              "cannon": "tab:purple", "summa": "tab:orange"}
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    for name in SCHEMES:
        rs = [r for r in tables["strong"] if r["scheme"] == name]
        if rs:
            ax[0].loglog([r["p"] for r in rs], [r["step_s"] for r in rs], "o-",
                         color=colors[name], label=name)
            ax[1].semilogx([r["p"] for r in rs], [r["efficiency"] for r in rs], "o-",
                           color=colors[name], label=f"{name} strong")
        rw = [r for r in tables["weak"] if r["scheme"] == name]
        if rw:
            ax[1].semilogx([r["p"] for r in rw], [r["efficiency"] for r in rw], "s--",
                           color=colors[name], alpha=0.6, label=f"{name} weak")
    ax[0].set(xlabel="p (ranks)", ylabel="seconds per training step",
              title="strong scaling: time per step")
    ax[1].set(xlabel="p (ranks)", ylabel="parallel efficiency", ylim=(0, 1.05),
              title="efficiency W / (p Tp): strong (solid), weak (dashed)")
    for alg in ("cannon_ab", "summa_ab", "summa25_ab"):
        rs = [r for r in tables["matmul"] if r["algorithm"] == alg]
        if rs:
            ax[2].loglog([r["p"] for r in rs], [r["seconds"] for r in rs], "o-",
                         color=colors[alg], label=alg if alg != "summa25_ab" else
                         "summa25_ab (best d)")
    ax[2].set(xlabel="p (ranks)", ylabel="seconds", title="n x n matrix product")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = os.path.join(outdir, "scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    if curves:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
        for i, which in enumerate(("paper", "machine")):
            for prob, cv in curves.items():
                r = cv[which]
                pts = [(p, w) for p, w in zip(r.p, r.W) if w == w and w > 0]
                if len(pts) < 2:
                    continue
                p0, w0 = pts[0]
                ax[i].loglog([p for p, _ in pts], [w / w0 for _, w in pts], "o-",
                             color=colors.get(prob), label=f"{prob} (slope {r.slope:.2f})")
            ps = [p for p in curves[next(iter(curves))]["paper"].p]
            if ps:
                for ref, style in (("p^3", ":"), ("p^1.5", "-."), ("(sqrt(p) log p)^3", "--")):
                    pa = np.asarray(ps, float)
                    y = {"p^3": pa ** 3, "p^1.5": pa ** 1.5,
                         "(sqrt(p) log p)^3": (np.sqrt(pa) * np.log2(pa)) ** 3}[ref]
                    ax[i].loglog(pa, y / y[0], style, color="gray", label=f"ref {ref}")
            ax[i].set(xlabel="p (ranks)", ylabel="W(p) / W(p0)",
                      title=("isoefficiency, papers' assumptions (alpha = 0)" if which == "paper"
                             else "isoefficiency, this machine (MPICH algorithms)"))
            ax[i].grid(True, which="both", alpha=0.3)
            ax[i].legend(fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = os.path.join(outdir, "isoefficiency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The explore arguments, added to ``parser`` (a sub-parser) or a new
    :class:`summasim.cli.ArgumentParser`. Each is checked as it is parsed; what
    needs several of them is checked by :func:`check_args`."""
    ap = parser or cli.ArgumentParser(prog="python -m summasim.costmodel explore",
                                      description=__doc__.splitlines()[0])
    options.add_machine(ap, default=EXPLORE_PRESET,
                        help_more=f"; presets: {', '.join(list_presets())}")
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated: megatron,optimus,summa25")
    ap.add_argument("--p-min", type=cli.positive_int, default=1, help="smallest p (default 1)")
    ap.add_argument("--p-max", type=cli.positive_int, default=65536,
                    help="largest p (default 65536, at most 2^40); p doubles from --p-min")
    ap.add_argument("--p", type=cli.int_list(minimum=1), default=None, metavar="P,P,...",
                    help="explicit ranks, e.g. 4,16,36,64 (instead of --p-min/--p-max)")
    ap.add_argument("--weak", choices=WEAK_RULES, default="batch",
                    help="weak scaling grows the batch (default), the hidden size and heads "
                         "with sqrt(p), or both")
    ap.add_argument("--placement", default="row-major",
                    help="ranks on nodes (GPU machines): row-major, blocked, blocked:AxB, "
                         "map:SLOT,SLOT,...")
    options.add_model(ap, default=EXPLORE_MODEL)
    options.add_batch(ap, default=EXPLORE_BATCH, help_more=" at the first p")
    options.add_dtype(ap, choices=tuple(DTYPE_SIZES), default="float32",
                      help_more=" of parameters, activations and messages")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="no activation checkpointing")
    ap.add_argument("--mode", choices=("mpich", "paper"), default="mpich",
                    help="collective formulas: MPICH's algorithms or the Optimus paper's")
    ap.add_argument("--matmul-n", type=cli.positive_int, default=32768,
                    help="n of the n x n matrix products")
    ap.add_argument("--efficiency", type=cli.float_range(0, 1, lo_open=True, hi_open=True),
                    default=0.5, help="isoefficiency target E, 0 < E < 1")
    ap.add_argument("--mem-budget", type=cli.finite_nonnegative_float, default=None,
                    help="GiB per rank for the largest-batch table (default: the machine's; "
                         "0: no table)")
    ap.add_argument("--outdir", default="results", help="folder for output files")
    ap.add_argument("--csv", nargs="?", const="", default=None, metavar="FILE",
                    help="write the tables as CSV (default FILE: OUTDIR/explore.csv)")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="FILE",
                    help="write the tables as JSON (default FILE: OUTDIR/explore.json)")
    ap.add_argument("--plot", action="store_true", help="write PNG plots to OUTDIR")
    ap.add_argument("--no-iso", action="store_true", help="skip the isoefficiency fits")
    return ap


class Plan(NamedTuple):
    """What :func:`check_args` found: the checked inputs of one explore run."""

    machine: Machine
    schemes: tuple
    cfg: TransformerConfig
    budget: float          # bytes per rank (0: no largest-batch table)
    p_values: list
    placement: Placement
    csv: str | None        # output paths (None: not asked for)
    json: str | None
    plot_dir: str | None   # None: no plots (or matplotlib missing: a hint instead)


_arg = cli.argument_error


def check_args(args) -> Plan:
    """Check everything the sweep needs before any of it runs; raise
    :class:`summasim.cli.UsageError` naming the argument at the first problem.

    Checks what argparse's types cannot: the scheme names, that the machine loads
    and has GEMM rates for ``--dtype`` (and float64, for the matrix products),
    ``--p-min <= --p-max <= 2^40``, that the output files and folder can be written (the folder is
    created), and that some grid of the sweep divides the model.
    """
    schemes = tuple(s.strip() for s in str(args.schemes).split(",") if s.strip())
    if not schemes:
        raise _arg("--schemes", f"no scheme named in {args.schemes!r}; known: "
                                f"{', '.join(SCHEMES)}")
    for s in schemes:
        if s not in SCHEMES:
            raise _arg("--schemes", f"unknown scheme {s!r}; known: {', '.join(SCHEMES)}")
    machine = resolve_machine(args.machine)
    if args.dtype not in machine.gamma_gemm:
        raise _arg("--dtype", f"machine {machine.name!r} has no GEMM rate for {args.dtype} "
                              f"(it has {', '.join(machine.gamma_gemm)})")
    if "float64" not in machine.gamma_gemm:
        raise _arg("--machine", f"machine {machine.name!r} has no float64 GEMM rate, which "
                                f"the n x n matrix products need (it has "
                                f"{', '.join(machine.gamma_gemm)})")
    if args.p_max < args.p_min:
        raise _arg("--p-max", f"must be >= --p-min, got --p-min {args.p_min} and "
                              f"--p-max {args.p_max}")
    if args.p_max > MAX_P:
        raise _arg("--p-max", f"at most 2^40 = {MAX_P}, got {args.p_max}")
    model, batch = model_batch(args)
    cfg = TransformerConfig.from_model(model, batch, checkpoint=not args.no_checkpoint,
                                       dtype=args.dtype)
    budget = (args.mem_budget * GiB if args.mem_budget is not None else machine.memory_bytes)
    if getattr(args, "p", None):
        ps = sorted(set(args.p))
        if ps[-1] > MAX_P:
            raise _arg("--p", f"at most 2^40 = {MAX_P}, got {ps[-1]}")
    else:
        ps = _p_values(args.p_min, args.p_max)
    try:
        placement = Placement.parse(getattr(args, "placement", None))
    except ValueError as exc:
        raise _arg("--placement", exc) from None
    if placement.policy == "explicit":
        raise _arg("--placement", "an explicit map fits one p only: use it with `predict`")
    if not any(scheme_grids(p, name, cfg) for p in ps for name in schemes):
        why = "; ".join(f"{name} at p = {p}: {_why_not(p, name, cfg)}"
                        for name in schemes for p in ps[:1])
        span = f"{ps[0]}" if len(ps) == 1 else f"{ps[0]}..{ps[-1]}"
        raise cli.UsageError(
            f"nothing to price: no grid of p = {span} ranks divides the model ({why}); "
            f"choose --p-min/--p-max, --schemes or sizes that divide")
    csv_path = json_path = plot_dir = None
    for flag, value, default in (("--csv", args.csv, "explore.csv"),
                                 ("--json", args.json, "explore.json")):
        if value is None:
            continue
        path = value or os.path.join(args.outdir, default)
        try:
            cli.check_writable_path(path)
        except cli.UsageError as exc:
            raise _arg(flag if value else "--outdir", exc) from None
        if flag == "--csv":
            csv_path = path
        else:
            json_path = path
    if args.plot and cli.module_available("matplotlib"):
        try:
            plot_dir = cli.check_writable_dir(args.outdir)
        except cli.UsageError as exc:
            raise _arg("--outdir", exc) from None
    return Plan(machine, schemes, cfg, budget, ps, placement, csv_path, json_path, plot_dir)


def _skipped_lines(skipped: list[dict]) -> str:
    """One line per scheme: the p it was not priced at and why (at the smallest)."""
    out = []
    for name in dict.fromkeys(r["scheme"] for r in skipped):
        mine = [r for r in skipped if r["scheme"] == name]
        ps = sorted({r["p"] for r in mine})
        shown = ", ".join(map(str, ps[:8])) + (", ..." if len(ps) > 8 else "")
        out.append(f"  not priced (the grid does not divide the model): {name} at p = "
                   f"{shown} ({mine[0]['reason']})\n")
    return "".join(out)


def run(args, out=None) -> dict:
    """Run the sweeps for parsed ``args``; print to ``out``; return the tables.

    Raises :class:`summasim.cli.UsageError` (before any sweep) for a user error.
    """
    out = out or sys.stdout
    plan = check_args(args)
    machine, schemes, cfg, budget, ps = (plan.machine, plan.schemes, plan.cfg, plan.budget,
                                         plan.p_values)
    title = (f"{machine.name}: b={_fmt(cfg.b)} s={_fmt(cfg.s)} h={_fmt(cfg.h)} "
             f"n={_fmt(cfg.n)} N={cfg.N} ffn={_fmt(cfg.ffn)} {cfg.dtype} "
             f"{'checkpointing' if cfg.checkpoint else 'no checkpointing'}, {args.mode}")
    skipped = {"strong": [], "weak": [], "matmul": []}
    rule = getattr(args, "weak", "batch")
    tables = {
        "strong": scaling_table(cfg, machine, ps, schemes, mode=args.mode, budget=budget,
                                skipped=skipped["strong"], placement=plan.placement),
        "weak": scaling_table(cfg, machine, ps, schemes, mode=args.mode, weak=True,
                              budget=budget, skipped=skipped["weak"], weak_rule=rule,
                              placement=plan.placement),
        "matmul": matmul_table(args.matmul_n, machine, ps, mode=args.mode,
                               skipped=skipped["matmul"], placement=plan.placement),
        "largest_batch": batch_table(cfg, ps, budget, schemes),
    }
    curves = {}
    if not args.no_iso:
        tables["isoefficiency"], curves = iso_table(machine, ps, args.efficiency, cfg)
    w = out.write
    w(f"machine: {machine.name}  ({machine.source})\n")
    w(f"problem: {title.split(': ', 1)[1]}\n")
    if _gpu(machine):
        w(f"placement: {plan.placement.describe()} (a placement that does not fit a grid "
          f"falls back to row-major)\n")
    w("\nstrong scaling (fixed problem; efficiency = W / (p Tp), W = time on one rank)\n")
    cols = ["p", "scheme", "grid", "step_s", "speedup", "efficiency", "comm_frac", "mem_gib",
            "fits", "best"]
    w(format_table(tables["strong"], cols))
    w(_skipped_lines(skipped["strong"]))
    grow = {"batch": f"b = {_fmt(cfg.b)} * p / {ps[0]}",
            "hidden": f"n = {_fmt(cfg.n)} * sqrt(p / {ps[0]}), h = n * {_fmt(cfg.h / cfg.n)}",
            "both": f"b = {_fmt(cfg.b)} * p / {ps[0]}, n = {_fmt(cfg.n)} * sqrt(p / {ps[0]}), "
                    f"h = n * {_fmt(cfg.h / cfg.n)}"}[rule]
    w(f"\nweak scaling ({grow}; efficiency = W / (p Tp))\n")
    w(format_table(tables["weak"], ["p", "scheme", "grid", "b", "h", "n", "step_s",
                                    "efficiency", "comm_frac", "mem_gib", "fits", "best"]))
    w(_skipped_lines(skipped["weak"]))
    w(f"\nn x n matrix products, n = {args.matmul_n}, float64 "
      f"(efficiency = T1 / (p Tp))\n")
    w(format_table(tables["matmul"], ["p", "algorithm", "grid", "seconds", "efficiency",
                                      "comm_frac"]))
    w(_skipped_lines(skipped["matmul"]))
    if tables.get("isoefficiency"):
        w(f"\nisoefficiency at E = {args.efficiency} (fitted log-log slope of W(p))\n")
        w(format_table(tables["isoefficiency"], ["problem", "p_range",
                                                 "slope_paper_assumptions",
                                                 "slope_this_machine", "reference",
                                                 "reference_slope"]))
    if tables["largest_batch"]:
        w(f"\nlargest batch under {budget / GiB:.3g} GiB per rank\n")
        w(format_table(tables["largest_batch"], ["p", "scheme", "grid", "largest_b"]))
    algs = sorted({r["algorithms"] for r in tables["strong"] if r["algorithms"]})
    if algs:
        w("\ncollective algorithms the model assumed (strong scaling):\n")
        for a in algs[:12]:
            w(f"  {a}\n")
    written = []
    if plan.csv is not None:
        write_csv(plan.csv, tables)
        written.append(plan.csv)
    if plan.json is not None:
        write_json_atomic(plan.json, ({"machine": machine.to_dict(),
                                                 "config": cfg.__dict__, "mode": args.mode,
                                                 "tables": tables, "not_priced": skipped}))
        written.append(plan.json)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            w(f"\n{PLOT_HINT}\n")
        else:
            written += make_plots(plan.plot_dir or args.outdir, tables, curves, title)
    for path in written:
        w(f"wrote {path}\n")
    return tables


def main(argv=None) -> int:
    """``python -m summasim.costmodel explore`` on its own: 0, or 2 for a user error."""
    ap = build_parser()
    return cli.run_command(ap.prog, run, ap.parse_args(argv))
