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
:func:`summasim.spec.grids` (Optimus: q x q, else the most square pr x pc both ways;
SUMMA2.5: every [q, q, d] with q, d >= 2, d > q included, else the smallest depth over
its most square pr x pc both ways).

``--csv`` / ``--json`` write every table (atomically); ``--plot`` writes PNGs
(scaling curves, isoefficiency) with matplotlib; without it, ``--plot`` is a user error.
Files go under ``--outdir`` (default ./results). A sweep to p = 65536 on a GPU machine
takes about a minute (each p prices whole steps; a progress bar shows on a terminal,
or with ``--progress``); p stops at 2^16.

Every argument is checked before the sweep (:func:`check_args`): the model parses
(:meth:`summasim.spec.Model.parse`: positive sizes, heads dividing h), the machine
loads, the outputs can be
written; a user error is one line on stderr and exit status 2. A grid that does
not divide the model at some p (Megatron: a head and an MLP column per rank;
Optimus and SUMMA2.5-LM: the heads and h by pc and the batch by d pr; the 3D cube: the
heads, h and the MLP width by q
and the batch by q^2; the n x n products: n by d q) is not priced there: the tables leave it out and a "not priced" note says
why. A model that no grid of the sweep can run is a user error.

The tables themselves are :mod:`summasim.costmodel.tools.explore`; this module is their
command line: the arguments, checked before any sweep, the printed tables, CSV, JSON
and plots.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import math
import os
import sys
from typing import NamedTuple

from summasim import cli, options, spec
from summasim.costmodel.machine import DTYPE_SIZES, Machine
from summasim.costmodel.workload.scheme import SCHEMES, TransformerConfig
from summasim.costmodel.machine.topology import Placement
from summasim.jsonio import write_report, write_text_atomic

from ..compute.roofline import usable_memory
from . import _cli, scheme_grids
from ._cli import fmt, model_batch, pick_dtype, resolve_machine
from .predict import (DEFAULT_PRESET, MAX_SIZE, add_progress, check_sizes, progress_bar,
                      size_help)
from .explore import (CROSSOVER_ALGS, GiB, ISO_REFERENCES, WEAK_RULES, batch_table,
                      crossovers, gpu_machine, iso_table, matmul_table,
                      p_range, scaling_table, why_not)

#: The default problem: h = 8192, 64 heads, 24 layers, sequence 1024, a GPT vocabulary
#: padded as Megatron-LM pads it, batch 64.
EXPLORE_MODEL = "h=8192,heads=64,layers=24,seq=1024,vocab=51200"
EXPLORE_BATCH = 64
#: The largest p of a sweep: 2^16 ranks, the default --p-max. A whole-step price on a
#: GPU machine sends q broadcasts per product, so one p costs about sqrt(p) layers'
#: work: the default sweep took 80 s on this 2-core VM under load (with a progress
#: bar), to 2^20 more than 15 minutes, to 2^24 over 5 minutes and 4 GB unloaded.
MAX_P = 1 << 16
#: The most ranks ``--p`` may list (each is a row of every table).
MAX_P_VALUES = 64


# -- output ---------------------------------------------------------------------------------
def format_table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "  (no rows)\n"
    return _cli.table(cols, [[fmt(r.get(c)) for c in cols] for r in rows])


#: The kind of ``--csv``'s file (``cli.FILE_SIGNATURES``: it begins ``table,``).
CSV_KIND = "explore csv"
#: The plots ``--plot`` writes into ``--outdir``.
PLOTS = ("scaling.png", "bounds.png", "isoefficiency.png")


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
    """Write scaling.png, bounds.png and isoefficiency.png; return their paths."""
    import numpy as np

    plt = _cli.pyplot()

    os.makedirs(outdir, exist_ok=True)
    paths = []
    colors = {"megatron": "tab:red", "optimus": "tab:blue", "summa25": "tab:green",
              "3d": "tab:pink",
              "cannon_ab": "tab:purple", "summa_ab": "tab:orange", "summa25_ab": "tab:green",
              "sd25_ab": "tab:brown", "mm3d_ab": "tab:cyan",
              "cannon": "tab:purple", "summa": "tab:orange", "sd25_mm": "tab:brown",
              "mm3d_mm": "tab:cyan"}
    best = {"summa25_ab": " (best d)", "sd25_ab": " (best c)"}
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    for name in SCHEMES:
        rs = [r for r in tables["strong"] if r["scheme"] == name]
        if rs:
            ax[0].loglog([r["p"] for r in rs], [r["step_s"] for r in rs], "o-",
                         color=colors.get(name), label=name)
            ax[1].semilogx([r["p"] for r in rs], [r["efficiency"] for r in rs], "o-",
                           color=colors.get(name), label=f"{name} strong")
        rw = [r for r in tables["weak"] if r["scheme"] == name]
        if rw:
            ax[1].semilogx([r["p"] for r in rw], [r["efficiency"] for r in rw], "s--",
                           color=colors.get(name), alpha=0.6, label=f"{name} weak")
    ax[0].set(xlabel="p (ranks)", ylabel="seconds per training step",
              title="strong scaling: time per step")
    ax[1].set(xlabel="p (ranks)", ylabel="parallel efficiency", ylim=(0, 1.05),
              title="efficiency W / (p Tp): strong (solid), weak (dashed)")
    for alg in ("cannon_ab", "summa_ab", "summa25_ab") + CROSSOVER_ALGS:
        rs = [r for r in tables["matmul"] if r["algorithm"] == alg]
        if rs:
            ax[2].loglog([r["p"] for r in rs], [r["seconds"] for r in rs], "o-",
                         color=colors[alg], label=alg + best.get(alg, ""))
    ax[2].set(xlabel="p (ranks)", ylabel="seconds", title="n x n matrix product")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    paths.append(_cli.save_figure(fig, os.path.join(outdir, PLOTS[0]), title))

    # words per rank of each product against the communication lower bounds
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for alg in ("cannon_ab", "summa_ab", "summa25_ab") + CROSSOVER_ALGS:
        rs = [r for r in tables["matmul"] if r["algorithm"] == alg and r["words"] > 0]
        if rs:
            ax.loglog([r["p"] for r in rs], [r["words"] for r in rs], "o-",
                      color=colors[alg], label=alg + (best[alg] + " by time" if alg in best
                                                      else ""))
    for c in tables.get("crossovers", []):   # where the 2.5D and 3D products overtake
        if c["n"] == tables["matmul"][0].get("n") and c["p_words"]:
            ax.axvline(c["p_words"], color=colors[c["algorithm"]], alpha=0.4, ls="-.")
    rs = [r for r in tables["matmul"] if r["algorithm"] == "summa_ab"]
    for key, style, label in (("bound_independent", "--", "memory-independent bound"),
                              ("bound_dependent", ":", "memory-dependent bound (M: the blocks)")):
        pts = [(r["p"], r[key]) for r in rs if r[key] > 0]
        if pts:
            ax.loglog(*zip(*pts), style, color="gray", label=label)
    ax.set(xlabel="p (ranks)", ylabel="words moved by the busiest rank",
           title="n x n matrix product: words against the lower bounds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_cli.save_figure(fig, os.path.join(outdir, PLOTS[1]), title))

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
        paths.append(_cli.save_figure(fig, os.path.join(outdir, PLOTS[2]), title))
    return paths


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The explore arguments, added to ``parser`` (a sub-parser) or a new
    :class:`summasim.cli.ArgumentParser`. Each is checked as it is parsed; what
    needs several of them is checked by :func:`check_args`."""
    ap = _cli.new_parser(parser, "explore", __doc__)
    _cli.add_machine(ap, DEFAULT_PRESET)
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help=f"comma-separated: {','.join(SCHEMES)}")
    ap.add_argument("--p-min", type=cli.positive_int, default=1, help="smallest p (default 1)")
    ap.add_argument("--p-max", type=cli.positive_int, default=65536,
                    help=f"largest p (default 65536, at most 2^16 = {MAX_P}); p doubles "
                         f"from --p-min")
    ap.add_argument("--p", type=cli.int_list(minimum=1), default=None, metavar="P,P,...",
                    help=f"explicit ranks, e.g. 4,16,36,64 (instead of --p-min/--p-max; at "
                         f"most {MAX_P_VALUES} of them, each at most 2^16)")
    ap.add_argument("--weak", choices=WEAK_RULES, default="batch",
                    help="weak scaling grows the batch (default), the hidden size and heads "
                         "with sqrt(p), or both")
    ap.add_argument("--placement", default="row-major",
                    help="ranks on nodes (GPU machines): row-major, blocked, blocked:AxB, "
                         "map:SLOT,SLOT,...")
    options.add_model(ap, default=EXPLORE_MODEL, help_more=f"; {size_help()}")
    options.add_batch(ap, default=EXPLORE_BATCH, help_more=f" at the first p (at most "
                                                           f"2^40 = {MAX_SIZE})")
    options.add_dtype(ap, choices=tuple(DTYPE_SIZES), default=None,
                      help_more=" of parameters, activations and messages (default: as "
                                "predict and plan, the first of "
                                f"{', '.join(_cli.DEFAULT_DTYPES)} the machine has)")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="no activation checkpointing (the same as --recompute none)")
    ap.add_argument("--recompute", choices=spec.RECOMPUTE, default=None,
                    help="activation recompute of every step: none, selective (the "
                         "attention core) or full (default full, or none with "
                         "--no-checkpoint)")
    ap.add_argument("--attention", choices=spec.ATTENTIONS, default="plain",
                    help="plain (default) or flash (blockwise attention)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="Megatron sequence parallelism (the 2D, 2.5D and 3D schemes "
                         "already split every activation: not priced with it, the note says "
                         "so)")
    ap.add_argument("--mode", choices=("mpich", "paper"), default="mpich",
                    help="collective formulas: MPICH's algorithms or the Optimus paper's")
    ap.add_argument("--matmul-n", type=cli.positive_int, default=32768,
                    help=f"n of the n x n matrix products (default 32768, at most 2^40 = "
                         f"{MAX_SIZE})")
    ap.add_argument("--crossover-n", default=None, metavar="N,...", type=cli.int_list(1),
                    help="n of the n x n products whose crossovers (the p from which the "
                         "2.5D and the 3D product beat SUMMA) are printed (default: "
                         "--matmul-n and the hidden sizes of " + ", ".join(CROSSOVER_MODELS)
                         + ")")
    ap.add_argument("--efficiency", type=cli.float_range(0, 1, lo_open=True, hi_open=True),
                    default=0.5, help="isoefficiency target E, 0 < E < 1")
    ap.add_argument("--mem-budget", type=cli.finite_nonnegative_float, default=None,
                    help="GiB per rank for the largest-batch table (default: the machine's; "
                         "0: no table)")
    ap.add_argument("--outdir", default="results", help="folder for output files")
    # the flag alone: an empty ReportPath (OUTDIR's default name), which the path type
    # passes through; an empty path typed by the user is refused
    ap.add_argument("--csv", nargs="?", const=cli.ReportPath("", CSV_KIND), default=None,
                    metavar="FILE",
                    type=cli.report_path(CSV_KIND), action=cli.ReportAction,
                    help="write the tables as CSV (default FILE: OUTDIR/explore.csv)")
    ap.add_argument("--json", nargs="?", const=cli.ReportPath("", "explore"), default=None,
                    metavar="FILE",
                    type=cli.report_path("explore"), action=cli.ReportAction,
                    help="write the tables as JSON (default FILE: OUTDIR/explore.json)")
    cli.add_force(ap)
    ap.add_argument("--plot", action="store_true", help="write PNG plots to OUTDIR")
    ap.add_argument("--no-iso", action="store_true", help="skip the isoefficiency fits")
    add_progress(ap)
    return ap


#: The presets whose hidden sizes are the default ``--crossover-n`` (n = h).
CROSSOVER_MODELS = ("gpt3-2.7b", "gpt3-6.7b", "gpt3-175b")


def crossover_sizes(args) -> list[int]:
    """The n of the crossover table: ``--crossover-n``, else ``--matmul-n`` and the
    hidden sizes of :data:`CROSSOVER_MODELS`, ascending, without repeats."""
    if args.crossover_n:
        return sorted(set(args.crossover_n))
    return sorted({args.matmul_n} | {spec.MODELS[m].hidden for m in CROSSOVER_MODELS})


class Plan(NamedTuple):
    """What :func:`check_args` found: the checked inputs of one explore run."""

    machine: Machine
    schemes: tuple
    cfg: TransformerConfig
    budget: object         # bytes per rank (0: no largest-batch table), or a function
    #                        of p (a CPU node's memory shared by its ranks: budget_at)
    p_values: list
    placement: Placement
    csv: str | None        # output paths (None: not asked for)
    json: str | None
    plot_dir: str | None   # None: no plots


_arg = cli.argument_error


def check_args(args) -> Plan:
    """Check everything the sweep needs before any of it runs; raise
    :class:`summasim.cli.UsageError` naming the argument at the first problem.

    Checks what argparse's types cannot: the scheme names, that the machine loads
    and has GEMM rates for ``--dtype`` (and float64, for the matrix products),
    ``--p-min <= --p-max <= 2^16`` (:data:`MAX_P`), at most :data:`MAX_P_VALUES` ranks in
    ``--p``, sizes within :data:`~.predict.MAX_SIZE`, that the output files and folder can be written (the folder is
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
    dtype = pick_dtype(machine, args.dtype)
    if "float64" not in machine.gamma_gemm:
        raise _arg("--machine", f"machine {machine.name!r} has no float64 GEMM rate, which "
                                f"the n x n matrix products need (it has "
                                f"{', '.join(machine.gamma_gemm)})")
    if args.p_max < args.p_min:
        raise _arg("--p-max", f"must be >= --p-min, got --p-min {args.p_min} and "
                              f"--p-max {args.p_max}")
    if args.p_max > MAX_P:
        raise _arg("--p-max", f"at most 2^16 = {MAX_P}, got {args.p_max}")
    if args.matmul_n > MAX_SIZE:
        raise _arg("--matmul-n", f"at most 2^40 = {MAX_SIZE}, got {args.matmul_n}")
    if args.crossover_n and max(args.crossover_n) > MAX_SIZE:
        raise _arg("--crossover-n", f"at most 2^40 = {MAX_SIZE}, got {max(args.crossover_n)}")
    if args.crossover_n and len(args.crossover_n) > 16:
        raise _arg("--crossover-n", f"at most 16 sizes, got {len(args.crossover_n)}")
    model, batch = model_batch(args)
    check_sizes(model, batch)
    if args.recompute is not None and args.no_checkpoint and args.recompute != "none":
        raise _arg("--recompute", f"--no-checkpoint is --recompute none; it contradicts "
                                  f"--recompute {args.recompute}")
    recompute = args.recompute or ("none" if args.no_checkpoint else "full")
    cfg = TransformerConfig.from_model(model, batch, dtype=dtype, recompute=recompute,
                                       attention=args.attention,
                                       sequence_parallel=args.sequence_parallel)
    if args.mem_budget is not None:
        budget = args.mem_budget * GiB
    elif machine.device is None and usable_memory(machine):
        budget = functools.partial(usable_memory, machine)    # a node's memory, shared
    else:
        budget = usable_memory(machine)
    if getattr(args, "p", None):
        ps = sorted(set(args.p))
        if ps[-1] > MAX_P:
            raise _arg("--p", f"at most 2^16 = {MAX_P}, got {ps[-1]}")
        if len(ps) > MAX_P_VALUES:
            raise _arg("--p", f"at most {MAX_P_VALUES} ranks, got {len(ps)}")
    else:
        ps = p_range(args.p_min, args.p_max)
    try:
        placement = Placement.parse(getattr(args, "placement", None))
    except ValueError as exc:
        raise _arg("--placement", exc) from None
    if placement.policy == "explicit":
        raise _arg("--placement", "an explicit map fits one p only: use it with `predict`")
    if not any(scheme_grids(p, name, cfg) for p in ps for name in schemes):
        why = "; ".join(f"{name} at p = {p}: {why_not(p, name, cfg)}"
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
        path = value or cli.ReportPath(os.path.join(args.outdir, default),
                                       "explore" if flag == "--json" else CSV_KIND,
                                       force=getattr(args, "force", False))
        _cli.writable(flag if value else "--outdir", path)
        if flag == "--csv":
            csv_path = path
        else:
            json_path = path
    outputs = [("--csv", csv_path), ("--json", json_path)]
    if args.plot:
        if not (os.path.exists(args.outdir) and not os.path.isdir(args.outdir)):
            _cli.need_matplotlib()  # before the folder is made (a file in its place: below)
        plot_dir = _cli.writable("--outdir", args.outdir, cli.check_writable_dir)
        for name in PLOTS:      # a file there that is not a PNG is not replaced
            _cli.writable("--outdir", cli.ReportPath(os.path.join(plot_dir, name), "png",
                                                     force=getattr(args, "force", False)))
            outputs.append((f"the plot {name}", os.path.join(plot_dir, name)))
    cli.check_distinct_outputs(outputs)
    return Plan(machine, schemes, cfg, budget, ps, placement, csv_path, json_path, plot_dir)


def _skipped_lines(skipped: list[dict]) -> str:
    """One line per scheme: the p it was not priced at and why (at the smallest)."""
    out = []
    for name in dict.fromkeys(r["scheme"] for r in skipped):
        mine = [r for r in skipped if r["scheme"] == name]
        ps = sorted({r["p"] for r in mine})
        shown = ", ".join(map(str, ps[:8])) + (", ..." if len(ps) > 8 else "")
        out.append(f"  not priced (the grid does not run the model): {name} at p = "
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
    title = (f"{machine.name}: b={fmt(cfg.b)} s={fmt(cfg.s)} h={fmt(cfg.h)} "
             f"n={fmt(cfg.n)} N={cfg.N} ffn={fmt(cfg.ffn)} {cfg.dtype} "
             f"recompute {cfg.recompute}, attention {cfg.attention}"
             f"{', sequence parallel' if cfg.sequence_parallel else ''}, collectives "
             f"{machine.library if args.mode == 'mpich' else 'of the Optimus paper'}")
    skipped = {"strong": [], "weak": [], "matmul": []}
    rule = getattr(args, "weak", "batch")
    iso = not args.no_iso and len([p for p in ps if p >= 16 and math.isqrt(p) ** 2 == p]) > 1
    with progress_bar(args, total=2 * len(ps) + (len(ISO_REFERENCES) if iso else 0),
                      unit="p", desc="explore") as bar:
        tables = {
            "strong": scaling_table(cfg, machine, ps, schemes, mode=args.mode, budget=budget,
                                    skipped=skipped["strong"], placement=plan.placement,
                                    tick=bar.update),
            "weak": scaling_table(cfg, machine, ps, schemes, mode=args.mode, weak=True,
                                  budget=budget, skipped=skipped["weak"], weak_rule=rule,
                                  placement=plan.placement, tick=bar.update),
            "matmul": matmul_table(args.matmul_n, machine, ps, mode=args.mode,
                                   skipped=skipped["matmul"], placement=plan.placement),
            "crossovers": [c for n in crossover_sizes(args)
                           for c in crossovers(
                               matmul_table(n, machine, ps, mode=args.mode,
                                            placement=plan.placement,
                                            algorithms=("summa_ab",) + CROSSOVER_ALGS))],
            "largest_batch": batch_table(cfg, ps, budget, schemes),
        }
        curves = {}
        if not args.no_iso:
            tables["isoefficiency"], curves = iso_table(machine, ps, args.efficiency, cfg,
                                                        tick=bar.update)
    w = out.write
    w(f"machine: {machine.name}  ({machine.source})\n")
    w(f"problem: {title.split(': ', 1)[1]}\n")
    if gpu_machine(machine):
        w(f"placement: {plan.placement.describe()} (a placement that does not fit a grid "
          f"falls back to row-major)\n")
    w("\nstrong scaling (fixed problem; efficiency = W / (p Tp), W = time on one rank)\n")
    if not gpu_machine(machine):
        w("step_s: the N layers' forward and backward (the layer model), without the "
          "embedding, head, optimizer and shared-core waits of a whole step: "
          "`costmodel predict` prices the step\n")
    cols = ["p", "scheme", "grid", "step_s", "speedup", "efficiency", "comm_frac", "mem_gib",
            "fits", "best"]
    w(format_table(tables["strong"], cols))
    w(_skipped_lines(skipped["strong"]))
    grow = {"batch": f"b = {fmt(cfg.b)} * p / {ps[0]}",
            "hidden": f"n = {fmt(cfg.n)} * sqrt(p / {ps[0]}), h = n * {fmt(cfg.h / cfg.n)}",
            "both": f"b = {fmt(cfg.b)} * p / {ps[0]}, n = {fmt(cfg.n)} * sqrt(p / {ps[0]}), "
                    f"h = n * {fmt(cfg.h / cfg.n)}"}[rule]
    w(f"\nweak scaling ({grow}; efficiency = W / (p Tp))\n")
    w(format_table(tables["weak"], ["p", "scheme", "grid", "b", "h", "n", "step_s",
                                    "efficiency", "comm_frac", "mem_gib", "fits", "best"]))
    w(_skipped_lines(skipped["weak"]))
    w(f"\nn x n matrix products, n = {args.matmul_n}, float64 "
      f"(efficiency = T1 / (p Tp))\n")
    w(format_table(tables["matmul"], ["p", "algorithm", "grid", "seconds", "efficiency",
                                      "comm_frac", "words", "bound_independent",
                                      "bound_dependent", "words_over_bound"]))
    w(_skipped_lines(skipped["matmul"]))
    if tables["crossovers"]:
        w("\ncrossovers: the p from which each product beats SUMMA (on pr x pc where p is "
          "not a square) at every larger p of the sweep, in predicted time and in the "
          "words of the busiest rank ('-': not by the largest p); speedup and words "
          "ratio are SUMMA's over its at that p\n")
        w(format_table(tables["crossovers"], ["n", "algorithm", "p_time", "p_words", "p_max",
                                              "speedup", "words_ratio"]))
    if tables.get("isoefficiency"):
        w(f"\nisoefficiency at E = {args.efficiency} (fitted log-log slope of W(p))\n")
        w(format_table(tables["isoefficiency"], ["problem", "p_range",
                                                 "slope_paper_assumptions",
                                                 "slope_this_machine", "reference",
                                                 "reference_slope"]))
    if tables["largest_batch"]:
        gib = sorted({r["budget_gib"] for r in tables["largest_batch"]})
        under = (f"{gib[0]:.3g} GiB" if len(gib) == 1 else
                 f"the node's memory over the ranks on it ({gib[-1]:.3g} GiB at "
                 f"p = {min(ps)} to {gib[0]:.3g} GiB at p = {max(ps)})")
        w(f"\nlargest batch under {under} per rank\n")
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
        write_report(plan.json, "explore", ({"machine": machine.to_dict(),
                                                 "config": cfg.__dict__, "mode": args.mode,
                                                 "tables": tables, "not_priced": skipped}))
        written.append(plan.json)
    if plan.plot_dir is not None:
        written += make_plots(plan.plot_dir, tables, curves, title)
    for path in written:
        w(f"wrote {path}\n")
    return tables


def main(argv=None) -> int:
    """``python -m summasim.costmodel explore`` on its own: 0, or 2 for a user error."""
    return _cli.main(build_parser, run, argv)
