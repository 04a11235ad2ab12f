"""``python -m summasim.costmodel plan``: the fastest composition that fits, without MPI.

For a transformer (``--model NAME|h=...,heads=...,layers=...,seq=...,vocab=...``),
``--devices N`` and a global batch of ``--batch B`` sequences (default: the model
preset's published batch) on a machine (``--machine FILE|PRESET``), the planner
searches every composition of the N devices (dp x pp x tensor grid x ZeRO stage x
micro-batches x recompute none/selective/full x Megatron sequence parallelism off/on x
model chunks per stage V = 1, 2, 4 (interleaved 1F1B):
:func:`summasim.costmodel.tools.plan.search`, which also says how fast it is), with
plain attention unless ``--attention flash``, keeps those whose memory per device on
the worst pipeline stage fits ``--mem-fraction`` of the device's memory (or
``--mem-budget``), ranks them by predicted step time, and prints the ``--top`` ten with
their techniques, breakdown (GEMM, memory-bound work, exposed tensor / data-parallel /
pipeline / ZeRO communication, bubble, optimizer) and memory, the best of each scheme,
ZeRO stage, recompute, sequence parallelism and chunk count (why the winner wins),
writes JSON (``--json``, atomically) and a plot (``--plot``, matplotlib with
Agg). This module is the command line: the arguments, checked before any work, the
tables, JSON and plot.

Exit status: 0 with a plan; 1 when compositions exist but none fits the memory (the
message says the smallest memory per device found, the composition that has it, and
how many devices would fit one); 2 for a user error (one line, before any work; this
includes a model and device count for which no composition exists at all).

How the mesh trains is searched, not fixed, so ``plan`` declares its own lists
(``--zero 0,1,2,3``, ``--recompute none,selective,full``, ``--sequence-parallel
both|on|off``, ``--chunks 1,2,4``) where :func:`summasim.options.add_training` declares
one value each; ``--attention``, ``--loss-scale`` and ``--grad-reduce`` are spelled and
checked as there (:class:`summasim.spec.Training`). Mixed precision (a 16-bit
``--dtype``) keeps 16-bit parameters, float32 master weights and Adam and the gradients
in ``--grad-reduce``'s type (float32 by default: 18 bytes per parameter;
:meth:`~summasim.costmodel.workload.zero.StateBytes.for_training`).

Known models (``--model``; ``--list-models``: :data:`summasim.spec.MODELS`) carry their
published shapes and sources; vocabularies are padded as Megatron-LM pads them (to
51,200 for GPT-2/3's 50,257 tokens, a multiple of 128 times any tensor size up to 8;
51,200 = 2^11 x 25, so every power-of-two tensor grid up to 2,048 divides it).
"""

from __future__ import annotations

import argparse
import sys

from summasim import cli, options, spec
from summasim.jsonio import write_report
from summasim.costmodel.workload.zero import BUCKET_BYTES, ZERO_STAGES
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.machine import DTYPE_SIZES
from summasim.costmodel.workload.scheme import SCHEMES, Scheme, TransformerConfig

from ..compute.roofline import usable_memory
from . import _cli
from ._cli import DEFAULT_DTYPES, model_batch, pick_dtype, resolve_machine
from .devset import machine_interval, tie_ratio
from .predict import DEFAULT_PRESET, add_progress, check_sizes, progress_bar

#: The bounds of a search: its cost grows with the divisors of each (the tensor grids
#: of the devices, the pipeline depths of the layers, the micro-batch counts of the
#: batch); a search shows its progress on a terminal (or with ``--progress``).
MAX_DEVICES = 1 << 16
MAX_LAYERS = 1 << 16
MAX_BATCH = 1 << 24
#: Model chunks per stage: at most this many values, each at most this (each value is
#: one more pass over the compositions).
MAX_CHUNK_VALUES = 4
MAX_CHUNKS = 16
from .plan import (CHUNKS, GiB, MEM_FRACTION, MODELS, RECOMPUTES, Plan, SearchResult,  # noqa: E402
                   fits_with_more, nothing_exists, search, short_grid)



def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The plan arguments, added to ``parser`` (a sub-parser) or a new
    :class:`summasim.cli.ArgumentParser`."""
    ap = _cli.new_parser(parser, "plan", __doc__)
    options.add_model(ap, help_more=f" (required unless --list-models; at most 2^16 = "
                                   f"{MAX_LAYERS} layers, other sizes at most 2^40)")
    ap.add_argument("--list-models", action="store_true",
                    help="list the known models with their sources and exit")
    ap.add_argument("--dropout", type=cli.float_range(0, 1, hi_open=True), default=0.0,
                    help="dropout probability (default 0, as summasim's model; Megatron-LM "
                         "trains with 0.1): its masks in memory, its kernels in time")
    ap.add_argument("--devices", type=cli.positive_int, default=None,
                    help=f"devices N (at most 2^16 = {MAX_DEVICES})")
    options.add_batch(ap, help_more=f", over all replicas (at most 2^24 = {MAX_BATCH})")
    _cli.add_machine(ap, DEFAULT_PRESET)
    options.add_dtype(ap, choices=tuple(DTYPE_SIZES), default=None,
                      help_more=" of activations, messages and GEMMs (default: the first of "
                                f"{', '.join(DEFAULT_DTYPES)} the machine has); 16-bit "
                                "dtypes train in mixed precision (2+2 bytes, fp32 Adam and "
                                "master: 16/param)")
    ap.add_argument("--schemes", type=cli.choice_list(SCHEMES, "scheme"),
                    default=",".join(SCHEMES), help="tensor schemes to search")
    ap.add_argument("--zero", type=cli.choice_list(tuple(map(str, ZERO_STAGES)), "ZeRO stage"),
                    default=",".join(map(str, ZERO_STAGES)), help="ZeRO stages to search")
    ap.add_argument("--recompute", type=cli.choice_list(spec.RECOMPUTE, "recompute"),
                    default=None, metavar="LIST",
                    help="activation recomputes to search, of none, selective (the "
                         "attention core, Korthikanti et al. 2022) and full (default "
                         "all three; selective is left out under --attention flash)")
    ap.add_argument("--checkpoint", choices=("both", "on", "off"), default=None,
                    help="full recompute only: on (full), off (none) or both; the "
                         "same as --recompute full / none / none,full")
    ap.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b",
                    help="pipeline schedule (same time; GPipe holds m micro-batches); "
                         "1f1b also tries --chunks")
    ap.add_argument("--chunks", type=cli.int_list(minimum=1), default=list(CHUNKS),
                    metavar="V,V,...",
                    help=f"model chunks per stage to search (1: 1F1B; V >= 2: interleaved "
                         f"1F1B, where pp >= 2, pp V divides the layers and m is a multiple "
                         f"of pp; default {','.join(map(str, CHUNKS))}; at most "
                         f"{MAX_CHUNK_VALUES} values, each at most {MAX_CHUNKS})")
    ap.add_argument("--sequence-parallel", nargs="?", const="on", default="both",
                    choices=("both", "on", "off"),
                    help="Megatron sequence parallelism (t > 1) to search: both "
                         "(default), on (alone: the same) or off")
    ap.add_argument("--attention", choices=spec.ATTENTIONS, default="plain",
                    help="plain (default; holds the b n s^2 scores) or flash (blockwise "
                         "attention, Dao et al.): the planner uses flash only when asked")
    ap.add_argument("--loss-scale", type=options.loss_scale_type, default=None,
                    metavar="dynamic|static:S|none",
                    help="loss scaling under mixed precision (default dynamic for "
                         "float16, none for bfloat16): the unscaling pass and, dynamic, "
                         "the overflow flag's all-reduce")
    ap.add_argument("--grad-reduce", choices=spec.GRAD_REDUCE_DTYPES, default=None,
                    help="type of the gradients and their data-parallel reduction under "
                         "mixed precision (default float32: a float32 buffer, 4 bytes "
                         "on the wire)")
    ap.add_argument("--max-microbatches", type=cli.positive_int, default=None,
                    help="largest m to try")
    _cli.add_states(ap, BUCKET_BYTES / 2**20)
    _cli.add_engine(ap)
    _cli.add_kernels(ap)
    mem = ap.add_mutually_exclusive_group()
    mem.add_argument("--mem-fraction", type=cli.float_range(0, 1, lo_open=True),
                     default=MEM_FRACTION,
                     help=f"share of the usable device memory (the memory less the device's "
                          f"reserve and fragmentation) the plan may fill (default "
                          f"{MEM_FRACTION})")
    mem.add_argument("--mem-budget", "--mem-gib", dest="mem_gib", metavar="GIB",
                     type=cli.finite_positive_float, default=None,
                     help="usable GiB per device, as predict's and explore's --mem-budget "
                          "(overrides the machine's memory; --mem-gib is the same flag)")
    ap.add_argument("--top", type=cli.positive_int, default=10, help="rows to print")
    add_progress(ap)
    ap.add_argument("--json", nargs="?", default=None, type=cli.report_path("plan"),
                    const=cli.ReportPath("results/plan.json", "plan", default=True),
                    action=cli.ReportAction,
                    metavar="PATH", help="write the plan as JSON (default results/plan.json)")
    cli.add_force(ap)
    ap.add_argument("--plot", nargs="?", default=None, type=cli.report_path("png"),
                    const=cli.ReportPath("results/plan.png", "png", default=True),
                    action=cli.ReportAction, metavar="PATH",
                    help="draw the plan as a PNG (default results/plan.png)")
    return ap


_arg = cli.argument_error


def check_args(args) -> Plan:
    """Everything the search needs, checked before it runs; raise
    :class:`summasim.cli.UsageError` naming the argument at the first problem."""
    model, batch = model_batch(args)
    if args.devices is None:
        raise _arg("--devices", "required")
    check_sizes(model, batch)
    for flag, val, most, what in (("--devices", args.devices, MAX_DEVICES, "2^16"),
                                  ("--model", model.layers, MAX_LAYERS, "2^16 layers"),
                                  ("--batch", batch, MAX_BATCH, "2^24")):
        if val > most:
            raise _arg(flag, f"at most {what} = {most} for a search, got {val}")
    machine = resolve_machine(args.machine)
    dtype = pick_dtype(machine, args.dtype)
    try:
        training = spec.Training(dtype=dtype, loss_scale=args.loss_scale,
                                 grad_reduce=args.grad_reduce, attention=args.attention)
    except ValueError as exc:
        flag = "--loss-scale" if "loss-scale" in str(exc) else "--grad-reduce"
        raise _arg(flag, exc) from None
    chunks = tuple(sorted(set(args.chunks)))
    if len(chunks) > MAX_CHUNK_VALUES or chunks[-1] > MAX_CHUNKS:
        raise _arg("--chunks", f"at most {MAX_CHUNK_VALUES} values, each at most "
                               f"{MAX_CHUNKS}, got {','.join(map(str, args.chunks))}")
    if args.p2p_overlap and args.schedule == "gpipe":
        raise _arg("--p2p-overlap", "prices the steady state of 1f1b and interleaved "
                                    "schedules; gpipe has none (drop one of the two)")
    if args.schedule == "gpipe" and chunks != (1,) and args.chunks != list(CHUNKS):
        raise _arg("--chunks", "the interleaved schedule is 1F1B's; --schedule gpipe "
                               "takes one chunk per stage")
    if args.checkpoint is not None and args.recompute is not None:
        raise _arg("--checkpoint", "names full recompute; give --recompute or "
                                   "--checkpoint, not both")
    if args.checkpoint is not None:
        recomputes = {"both": ("none", "full"), "on": ("full",),
                      "off": ("none",)}[args.checkpoint]
    else:
        recomputes = tuple(dict.fromkeys(args.recompute or RECOMPUTES))
    if args.attention == "flash":     # flash holds no scores for selective recompute to drop:
        # selective is none there, and the header and JSON say what is searched
        recomputes = tuple(dict.fromkeys("none" if rc == "selective" else rc
                                         for rc in recomputes))
    sb = _cli.state_bytes(args, dtype, training.grad_reduce)
    if args.mem_gib is not None:
        budget = args.mem_gib * GiB
    else:
        if not machine.memory_bytes:
            raise _arg("--mem-budget", f"machine {machine.name!r} does not say its memory "
                                       f"per device; give --mem-budget")
        budget = usable_memory(machine, args.devices) * args.mem_fraction
    cfg = TransformerConfig.from_model(model, batch, dtype=dtype, attention=args.attention
                                       ).replace(**_cli.kernel_fields(args))
    if args.dropout:
        cfg = cfg.replace(dropout=args.dropout)
    zeros = tuple(sorted({int(z) for z in args.zero}))
    sps = {"both": (False, True), "on": (True,), "off": (False,)}[args.sequence_parallel]
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise cli.UsageError(f"argument --plot: {args.plot}: the plan is drawn as a PNG; "
                             f"give a path ending in .png")
    cli.check_distinct_outputs([("--json", args.json), ("--plot", args.plot)])
    out = {flag: _cli.writable(flag, value)
           for flag, value in (("--json", args.json), ("--plot", args.plot)) if value is not None}
    plot = out.get("--plot")
    if plot is not None:
        _cli.need_matplotlib()      # after the paths: their errors do not depend on it
    return Plan(machine, cfg, model, args.devices, batch, tuple(args.schemes), zeros,
                recomputes, args.schedule, budget, sb, args.bucket_mb * 2**20,
                args.max_microbatches or 0, args.zero3_prefetch, args.top, out.get("--json"),
                plot, sps, chunks if args.schedule == "1f1b" else (1,), args.attention,
                training.loss_scale or "none", training, args.grad_overlap, args.p2p_overlap)


# -- output ---------------------------------------------------------------------------------
COLUMNS = [("rank", "#"), ("tensor", "tensor"), ("dp", "dp"), ("pp", "pp"),
           ("microbatches", "m"), ("micro_batch", "b"), ("zero", "ZeRO"),
           ("schedule", "schedule"), ("recompute", "recomp"), ("sp", "SP"),
           ("step_seconds", "step s"), ("gemm", "gemm"), ("memory_bound", "mem-bnd"),
           ("comm_tensor", "tensor"), ("comm_dp", "dp"), ("comm_pp", "pp"),
           ("comm_zero", "zero"), ("comm_contention", "contn"), ("bubble", "bubble"),
           ("optimizer", "optim"),
           ("memory_gib", "mem GiB"), ("model_states_gib", "states"),
           ("activations_gib", "acts"), ("tflops_per_device", "TFLOP/s")]


def format_rows(rows: list[dict], start: int = 1) -> str:
    """The ranked table (times in seconds per step, memory in GiB per device)."""
    cells = []
    for i, r in enumerate(rows, start):
        x = dict(r, rank=i, tensor=short_grid(r), sp="yes" if r["sequence_parallel"] else "no")
        cells.append([_cli.fmt(x[k]) for k, _ in COLUMNS])
    return _cli.table([h for _, h in COLUMNS], cells)


def _best_by(rows: list[dict], key) -> list[dict]:
    seen, out = set(), []
    for r in rows:                                   # rows are ranked: first is best
        k = key(r)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def make_plot(path: str, rows: list[dict], top: int, budget_gib: float, title: str) -> str:
    """Two panels: step time against memory of every fitting composition, by scheme,
    and the breakdown of the top ones. Returns the path."""
    plt = _cli.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(15, 5.5))
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(SCHEMES):
        mine = [r for r in rows if r["scheme"] == name]
        if mine:
            ax[0].scatter([r["memory_gib"] for r in mine], [r["step_seconds"] for r in mine],
                          s=8, alpha=0.5, color=cmap(i), label=f"{name} ({len(mine)})")
    best = rows[:top]
    ax[0].scatter([r["memory_gib"] for r in best], [r["step_seconds"] for r in best], s=60,
                  facecolors="none", edgecolors="black", label=f"top {len(best)}")
    ax[0].axvline(budget_gib, color="gray", ls="--", label="memory budget")
    ax[0].set(xlabel="memory per device (GiB, worst stage)", ylabel="seconds per step",
              yscale="log", title="every composition that fits")
    ax[0].grid(True, which="both", alpha=0.3)
    ax[0].legend(fontsize=8)
    parts = [("gemm", "GEMM"), ("memory_bound", "memory-bound"), ("comm_tensor", "tensor comm"),
             ("comm_dp", "dp comm"), ("comm_pp", "pp comm"), ("comm_zero", "ZeRO comm"),
             ("comm_contention", "contention"), ("bubble", "bubble"),
             ("optimizer", "optimizer")]
    labels = [f"{i + 1}. {row_label(r)}" for i, r in enumerate(best)]
    left = [0.0] * len(best)
    for j, (key, name) in enumerate(parts):
        vals = [r[key] for r in best]
        ax[1].barh(range(len(best)), vals, left=left, color=cmap(j), label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax[1].set_yticks(range(len(best)), labels, fontsize=7)
    ax[1].invert_yaxis()
    ax[1].set(xlabel="seconds per step", title="breakdown of the fastest")
    ax[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    return _cli.save_figure(fig, path, title)


def run(args, out=None) -> int:
    """Plan for parsed ``args``, print to ``out``; return the exit status (0 a plan, 1
    nothing fits). Raises :class:`summasim.cli.UsageError` before any work."""
    out = out or sys.stdout
    w = out.write
    if args.list_models:
        for name, m in MODELS.items():
            w(f"{name:<14s} h={m.hidden} N={m.layers} n={m.heads} s={m.seq} v={m.vocab} "
              f"ffn={m.ffn_mult} B={m.batch}\n    {m.source}\n")
        return 0
    plan = check_args(args)
    cfg, machine = plan.cfg, plan.machine
    with progress_bar(args, desc="plan", unit="grid") as bar:
        def tick(n=1, total=None):
            if total is not None:
                bar.reset(total=total)
            bar.update(n)

        res = search(cfg, plan.devices, plan.global_batch, machine, budget=plan.budget,
                     schemes=plan.schemes, zeros=plan.zeros, recomputes=plan.recomputes,
                     schedule=plan.schedule, state_bytes=plan.state_bytes,
                     bucket_bytes=plan.bucket_bytes, max_microbatches=plan.max_microbatches,
                     zero3_prefetch=plan.zero3_prefetch, grad_overlap=plan.grad_overlap,
                     p2p_overlap=plan.p2p_overlap, tick=tick,
                     sequence_parallel=plan.sequence_parallel, chunks=plan.chunks,
                     loss_scale=plan.loss_scale)
    if not res.counts["compositions"]:
        raise cli.UsageError(nothing_exists(plan, res))
    sb = plan.state_bytes
    params = _total_params(cfg)
    w(f"machine: {machine.name}  ({machine.source[:160]})\n")
    w(f"model: {plan.model}: h={cfg.h} N={cfg.N} n={cfg.n} s={cfg.s} v={cfg.v} "
      f"f={cfg.ffn}, dropout {getattr(cfg, 'dropout', 0)}, {params / 1e9:.1f}B parameters; "
      f"{plan.devices} devices, global batch "
      f"{plan.global_batch}, {cfg.dtype}, model states {sb.total} B/param "
      f"({sb.param}+{sb.grad}+2x{sb.optim}+{sb.master}), {plan.schedule}\n")
    w(f"searched: recompute {'/'.join(plan.recomputes)}, sequence parallelism "
      f"{'/'.join('on' if x else 'off' for x in plan.sequence_parallel)} (Megatron), "
      f"chunks per stage {'/'.join(map(str, plan.chunks))}, attention {plan.attention}, "
      f"loss scale {plan.loss_scale}\n")
    w(f"memory budget: {plan.budget / GiB:.1f} GiB per device\n")
    w(f"searched {res.counts['compositions']} compositions on {res.counts['grids']} tensor "
      f"grids: {res.counts['fit']} fit, ranked in {res.seconds:.2f} s\n")
    if not res.rows:
        sm = res.smallest
        with progress_bar(args, total=10, desc="plan: more devices", unit="size") as bar:
            more = fits_with_more(plan, tick=bar.update)
        where = (f"{more[0]} devices ({more[1]['fit']} compositions fit there)" if more
                 else "no multiple of the devices up to x1024")
        msg = (f"nothing fits {plan.budget / GiB:.1f} GiB per device: the smallest is "
               f"{sm['memory'] / GiB:.1f} GiB ({sm['grid']} dp={sm['dp']} pp={sm['pp']} "
               f"m={sm['microbatches']} b={sm['micro_batch']} ZeRO {sm['zero']}, "
               f"recompute {sm['recompute']}"
               f"{', sequence parallel' if sm['sequence_parallel'] else ''}: model states "
               f"{sm['model_states'] / GiB:.1f} GiB, activations "
               f"{sm['activations'] / GiB:.1f} GiB); would fit: {where}"
               + ("" if 3 in plan.zeros and "full" in plan.recomputes
                  else ", or allow ZeRO 3 and full recompute") + ", or more memory per device")
        w(f"\n{msg}\n")
        if plan.json:
            write_report(plan.json, "plan", _report(plan, res, [], msg))
            w(f"wrote {plan.json}\n")
        return 1
    top = res.rows[:plan.top]
    w(f"\nfastest {len(top)} (seconds per step; exposed communication by kind; memory per "
      f"device on the worst stage, GiB)\n")
    w(format_rows(top))
    best = res.rows[0]
    w(f"\nbest: {short_grid(best)} x dp {best['dp']} x pp {best['pp']}, m = "
      f"{best['microbatches']} micro-batches of {best['micro_batch']}, ZeRO "
      f"{best['zero']}, {best['schedule']}, recompute {best['recompute']}, "
      f"{'with' if best['sequence_parallel'] else 'no'} sequence parallelism, "
      f"attention {best['attention']}: "
      f"{best['step_seconds']:.3g} s per step, bubble {100 * best['bubble_fraction']:.1f}%, "
      f"{cli.sig3(best['tflops_per_device'])} model TFLOP/s per device, "
      f"{best['memory_gib']:.1f} GiB per device\n")
    iv = machine_interval(machine, best["step_seconds"])
    ratio = tie_ratio()
    ties = [i for i, r in enumerate(res.rows, 1)
            if r["step_seconds"] <= best["step_seconds"] * ratio]
    if iv is None:
        w("  80% interval: none (the dev set's published runs are GPU clusters; "
          "`costmodel accuracy` measures this machine's error)\n")
    else:
        w(f"  80% interval {iv[0]:.3g}-{iv[1]:.3g} s (from the dev set's published runs; "
          f"its coverage is checked leaving each publication out: docs/devset.md)\n")
    w(f"  {len(ties)} composition(s) within {ratio:.2f}x of the best cannot be told apart "
      f"from it (the dev set's scatter between runs of one cluster, 80%): ranks "
      f"{cli.number_ranges(ties)}\n")
    w("\nbest of each kind (why the winner wins):\n")
    kinds = (_best_by(res.rows, lambda r: r["scheme"])
             + _best_by(res.rows, lambda r: ("zero", r["zero"]))
             + _best_by(res.rows, lambda r: ("pp1", r["pp"] == 1))
             + _best_by(res.rows, lambda r: ("rc", r["recompute"]))
             + _best_by(res.rows, lambda r: ("sp", r["sequence_parallel"]))
             + _best_by(res.rows, lambda r: ("v", r["chunks"])))
    kinds = [r for i, r in enumerate(kinds) if r not in kinds[:i]]
    kinds.sort(key=lambda r: r["step_seconds"])
    w(format_rows(kinds, start=1).replace("  #", "  -", 1))
    for r in kinds:
        w(f"  {row_label(r)}: {r['step_seconds'] / best['step_seconds']:.2f}x the best\n")
    if plan.json:
        write_report(plan.json, "plan", _report(plan, res, top, None))
        w(f"wrote {plan.json}\n")
    if plan.plot:
        title = (f"{plan.model} on {plan.devices} x {machine.name}, batch "
                 f"{plan.global_batch}, {cfg.dtype}")
        w(f"wrote {make_plot(plan.plot, res.rows, plan.top, plan.budget / GiB, title)}\n")
    return 0


def row_label(r: dict) -> str:
    """A ranked row in one short phrase: grid, dp, pp, m, ZeRO and the techniques."""
    return (f"{short_grid(r)} dp{r['dp']} pp{r['pp']} m{r['microbatches']} Z{r['zero']} "
            f"{r['schedule']} rc:{r['recompute']}{' sp' if r['sequence_parallel'] else ''}")


def _total_params(cfg: TransformerConfig) -> float:
    """Parameters of the whole model: ``N ((1 + r + k f) h^2 + (6 + r + (k-1) f) h) + v h
    + s h + 2 h`` (QKV r h wide, k MLP matrices; GPT-2: ``(4 + 2f) h^2 + (9 + f) h``),
    plus ``v h`` for an untied head."""
    h, f, r, k = cfg.h, cfg.ffn, cfg.qkv_mult, cfg.mlp_matrices
    return (cfg.N * ((1 + r + k * f) * h * h + (6 + r + (k - 1) * f) * h) + cfg.v * h
            * (1 if cfg.tied else 2) + cfg.s * h + 2 * h)


def _report(plan: Plan, res: SearchResult, top: list, nothing: str | None) -> dict:
    """The JSON document: inputs, counts, the top compositions in full, and every fitting
    composition as a compact row (ranked)."""
    cfg = plan.cfg
    full = []
    for r in top:
        sch = Scheme.make(r["scheme"], p=r["t"], d=r["d"],
                          q=r["q"] if r["scheme"] != "megatron" else None,
                          pc=r.get("pc") if r["scheme"] != "megatron" else None)
        full.append(price_composition(
            cfg.replace(sequence_parallel=r["sequence_parallel"]), sch,
            machine=plan.machine, dp=r["dp"], pp=r["pp"], microbatches=r["microbatches"],
            global_batch=plan.global_batch, zero=r["zero"],
            schedule="interleaved" if r["chunks"] > 1 else plan.schedule, chunks=r["chunks"],
            recompute=r["recompute"], devices=plan.devices, bucket_bytes=plan.bucket_bytes,
            state_bytes=plan.state_bytes, zero3_prefetch=plan.zero3_prefetch,
            loss_scale=plan.loss_scale, grad_overlap=plan.grad_overlap,
            p2p_overlap=plan.p2p_overlap))
    return {"format": "summasim.plan/1", "machine": plan.machine.name,
            "model": str(plan.model), "config": {"h": cfg.h, "N": cfg.N, "n": cfg.n, "s": cfg.s,
                                            "v": cfg.v, "ffn": cfg.ffn, "dtype": cfg.dtype,
                                            "dropout": getattr(cfg, "dropout", 0.0)},
            "source": plan.model.source or None,
            "devices": plan.devices, "global_batch": plan.global_batch,
            "budget_bytes": plan.budget, "state_bytes": plan.state_bytes.to_dict(),
            "schedule": plan.schedule, "bucket_bytes": plan.bucket_bytes,
            "searched_techniques": {"recompute": list(plan.recomputes),
                                    "sequence_parallel": list(plan.sequence_parallel),
                                    "chunks": list(plan.chunks),
                                    "attention": plan.attention,
                                    "loss_scale": plan.loss_scale,
                                    "grad_reduce": plan.training.grad_reduce
                                    if plan.training else None},
            "searched": res.counts, "search_seconds": res.seconds, "nothing_fits": nothing,
            **_uncertainty(res, plan.machine), "top": full, "ranked": res.rows}


def _uncertainty(res: SearchResult, machine) -> dict:
    """The best step's 80% interval (None where the dev set does not speak for the
    machine: :func:`~.devset.machine_interval`) and the ranks within the tie ratio of it
    (empty when nothing fits)."""
    if not res.rows:
        return {}
    best = res.rows[0]["step_seconds"]
    ratio = tie_ratio()
    iv = machine_interval(machine, best)
    return {"interval_seconds": iv and list(iv), "tie_ratio": ratio,
            "ties": [i for i, r in enumerate(res.rows, 1)
                     if r["step_seconds"] <= best * ratio]}


def main(argv=None) -> int:
    """``python -m summasim.costmodel plan``: 0 with a plan, 1 when nothing fits, 2 for a
    user error (one line on stderr)."""
    return _cli.main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
