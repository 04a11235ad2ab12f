"""``python -m summasim.costmodel explore``: what-if sweeps over p, without MPI.

For a machine (``--preset`` or ``--machine FILE``) and a transformer
(``--b --s --h --heads --layers --vocab --dtype``) it prints:

strong scaling      time per training step of every scheme at p = 1, 2, 4, ...,
                    ``--p-max`` (fixed problem), the best [q, q, d] for SUMMA2.5,
                    speedup and efficiency against one rank, the communication
                    share, memory per rank, and the best scheme at each p
weak scaling        the same with the batch grown with p (b = --b * p / --p-min)
matrix products     cannon_ab, summa_ab and summa25_ab (best d) on n x n
                    (``--matmul-n``), time and efficiency
isoefficiency       fitted exponents of W(p) at efficiency ``--efficiency`` under
                    the papers' assumptions (alpha = 0, paper formulas) and on this
                    machine (MPICH algorithms), with the papers' references
largest batch       per scheme and p, the largest b whose memory per rank fits
                    ``--mem-budget`` (default: the machine's memory per rank)

``--csv`` / ``--json`` write every table (atomically); ``--plot`` writes PNGs
(scaling curves, isoefficiency) with matplotlib, or says how to install it.
Files go under ``--outdir`` (default ./results). The model is analytic, so a sweep
to p = 65536 takes well under a second.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys

from .isoefficiency import isoefficiency, paper_machine, reference_slope
from .machine import (get_machine, list_presets, write_json_atomic,
                      write_text_atomic)
from .predict import predict_algorithm
from .schemes import SCHEMES, Scheme, TransformerConfig, grid_shapes, largest_batch, scheme_cost

GiB = float(1 << 30)
#: Sweeps to thousands of ranks are about clusters: explore defaults to the H100 preset.
EXPLORE_PRESET = "h100-dgx-ndr"
PLOT_HINT = "plots need matplotlib: pip install summasim[plot]"


def _p_values(p_min: int, p_max: int) -> list[int]:
    out, p = [], max(1, p_min)
    while p <= p_max:
        out.append(p)
        p *= 2
    return out


def _best_of(p, name, cfg, machine, mode):
    costs = [scheme_cost(sch, cfg, machine, mode=mode) for sch in grid_shapes(p, name)]
    return min(costs, key=lambda c: c.step_seconds) if costs else None


def scaling_table(cfg: TransformerConfig, machine, p_values, schemes=SCHEMES, *,
                  mode: str = "mpich", weak: bool = False, budget: float = 0.0) -> list[dict]:
    """Rows ``{p, scheme, grid, b, step_s, speedup, efficiency, comm_frac, mem_gib, fits}``.

    Strong scaling keeps ``cfg``; weak scaling multiplies the batch by p / p_values[0].
    Speedup is W / Tp and efficiency W / (p Tp) (Optimus section 3.1.2), with W the
    time of the same problem on one rank (Megatron with p = 1 is the serial model).
    """
    rows = []
    p0 = p_values[0]
    serial = {}
    for p in p_values:
        c_p = cfg.replace(b=cfg.b * p / p0) if weak else cfg
        if c_p.b not in serial:
            serial[c_p.b] = scheme_cost(Scheme("megatron", 1), c_p, machine,
                                        mode=mode).step_seconds
        W = serial[c_p.b]
        for name in schemes:
            best = _best_of(p, name, c_p, machine, mode)
            if best is None:
                continue
            t = best.step_seconds
            mem = best.memory.total
            rows.append({"p": p, "scheme": name, "grid": best.scheme.label,
                         "b": c_p.b, "step_s": t, "speedup": W / t, "efficiency": W / (p * t),
                         "comm_frac": best.comm_fraction, "mem_gib": mem / GiB,
                         "fits": (mem <= budget) if budget > 0 else None,
                         "algorithms": best.algorithms()})
    # mark the fastest scheme at each p
    for p in p_values:
        mine = [r for r in rows if r["p"] == p]
        if mine:
            fastest = min(mine, key=lambda r: r["step_s"])
            for r in mine:
                r["best"] = r is fastest
    return rows


def matmul_table(n: int, machine, p_values, *, dtype: str = "float64",
                 mode: str = "mpich") -> list[dict]:
    """Rows ``{p, algorithm, grid, seconds, efficiency, comm_frac}`` for n x n x n."""
    rows = []
    t1 = machine.gemm_time(n, n, n, dtype) * machine.slowdown(1)
    for p in p_values:
        q = math.isqrt(p)
        cands = []
        if q * q == p:
            cands += [("cannon_ab", q, 1), ("summa_ab", q, 1)]
        for sch in grid_shapes(p, "summa25"):
            if sch.d > 1:
                cands.append(("summa25_ab", sch.q, sch.d))
        best25 = None
        for alg, qq, dd in cands:
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
    rows = []
    if budget <= 0:
        return rows
    for p in p_values:
        for name in schemes:
            shapes = grid_shapes(p, name)
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


def _json_safe(obj):
    """NaN and infinities become null, so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


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
    ap = parser or argparse.ArgumentParser(prog="python -m summasim.costmodel explore",
                                           description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"machine preset ({', '.join(list_presets())}); "
                     f"default {EXPLORE_PRESET}")
    src.add_argument("--machine", metavar="FILE", help="machine JSON (from `fit`)")
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help="comma-separated: megatron,optimus,summa25")
    ap.add_argument("--p-min", type=int, default=1)
    ap.add_argument("--p-max", type=int, default=65536)
    ap.add_argument("--b", type=float, default=64, help="batch (sequences)")
    ap.add_argument("--s", type=float, default=1024, help="sequence length")
    ap.add_argument("--h", type=float, default=8192, help="hidden size")
    ap.add_argument("--heads", type=float, default=64, help="attention heads n")
    ap.add_argument("--layers", type=int, default=24, help="layers N")
    ap.add_argument("--vocab", type=float, default=0, help="vocabulary v (0: no embedding)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="no activation checkpointing")
    ap.add_argument("--mode", choices=("mpich", "paper"), default="mpich",
                    help="collective formulas: MPICH's algorithms or the Optimus paper's")
    ap.add_argument("--matmul-n", type=int, default=32768, help="n of the n x n matrix products")
    ap.add_argument("--efficiency", type=float, default=0.5, help="isoefficiency target E")
    ap.add_argument("--mem-budget", type=float, default=None,
                    help="GiB per rank for the largest-batch table (default: the machine's)")
    ap.add_argument("--outdir", default="results", help="folder for output files")
    ap.add_argument("--csv", nargs="?", const="", default=None, metavar="FILE",
                    help="write the tables as CSV (default FILE: OUTDIR/explore.csv)")
    ap.add_argument("--json", nargs="?", const="", default=None, metavar="FILE",
                    help="write the tables as JSON (default FILE: OUTDIR/explore.json)")
    ap.add_argument("--plot", action="store_true", help="write PNG plots to OUTDIR")
    ap.add_argument("--no-iso", action="store_true", help="skip the isoefficiency fits")
    return ap


def run(args, out=None) -> dict:
    """Run the sweeps for parsed ``args``; print to ``out``; return the tables."""
    out = out or sys.stdout
    machine = get_machine(args.machine, args.preset or (None if args.machine else EXPLORE_PRESET))
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    for s in schemes:
        if s not in SCHEMES:
            raise ValueError(f"unknown scheme {s!r}; known: {', '.join(SCHEMES)}")
    if args.p_min < 1 or args.p_max < args.p_min:
        raise ValueError(f"need 1 <= --p-min <= --p-max, got {args.p_min}, {args.p_max}")
    cfg = TransformerConfig(b=args.b, s=args.s, h=args.h, n=args.heads, N=args.layers,
                            v=args.vocab, dtype=args.dtype, checkpoint=not args.no_checkpoint)
    budget = (args.mem_budget * GiB if args.mem_budget is not None else machine.memory_bytes)
    ps = _p_values(args.p_min, args.p_max)
    title = (f"{machine.name}: b={_fmt(cfg.b)} s={_fmt(cfg.s)} h={_fmt(cfg.h)} "
             f"n={_fmt(cfg.n)} N={cfg.N} {cfg.dtype} "
             f"{'checkpointing' if cfg.checkpoint else 'no checkpointing'}, {args.mode}")
    tables = {
        "strong": scaling_table(cfg, machine, ps, schemes, mode=args.mode, budget=budget),
        "weak": scaling_table(cfg, machine, ps, schemes, mode=args.mode, weak=True,
                              budget=budget),
        "matmul": matmul_table(args.matmul_n, machine, ps, mode=args.mode),
        "largest_batch": batch_table(cfg, ps, budget, schemes),
    }
    curves = {}
    if not args.no_iso:
        tables["isoefficiency"], curves = iso_table(machine, ps, args.efficiency, cfg)
    w = out.write
    w(f"machine: {machine.name}  ({machine.source})\n")
    w(f"problem: {title.split(': ', 1)[1]}\n")
    w("\nstrong scaling (fixed problem; efficiency = W / (p Tp), W = time on one rank)\n")
    cols = ["p", "scheme", "grid", "step_s", "speedup", "efficiency", "comm_frac", "mem_gib",
            "fits", "best"]
    w(format_table(tables["strong"], cols))
    w(f"\nweak scaling (b = {_fmt(cfg.b)} * p / {ps[0]}; efficiency = W / (p Tp))\n")
    w(format_table(tables["weak"], ["p", "scheme", "grid", "b", "step_s", "efficiency",
                                    "comm_frac", "mem_gib", "fits", "best"]))
    w(f"\nn x n matrix products, n = {args.matmul_n}, float64 "
      f"(efficiency = T1 / (p Tp))\n")
    w(format_table(tables["matmul"], ["p", "algorithm", "grid", "seconds", "efficiency",
                                      "comm_frac"]))
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
    if args.csv is not None:
        path = args.csv or os.path.join(args.outdir, "explore.csv")
        write_csv(path, tables)
        written.append(path)
    if args.json is not None:
        path = args.json or os.path.join(args.outdir, "explore.json")
        write_json_atomic(path, _json_safe({"machine": machine.to_dict(), "config": cfg.__dict__,
                                            "mode": args.mode, "tables": tables}))
        written.append(path)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            w(f"\n{PLOT_HINT}\n")
        else:
            written += make_plots(args.outdir, tables, curves, title)
    for path in written:
        w(f"wrote {path}\n")
    return tables


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"explore: error: {exc}", file=sys.stderr)
        return 2
    return 0
