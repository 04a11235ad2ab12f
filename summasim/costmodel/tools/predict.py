"""``python -m summasim.costmodel predict``: one tensor grid or one composition, one step.

    python -m summasim.costmodel predict --model gpt3-6.7b --batch 64 --dtype bfloat16 \\
        --mesh tp=optimus:8x8 --checkpoint --machine dgx-a100 [--placement blocked]
    python -m summasim.costmodel predict --model gpt3-175b --machine dgx-a100 \\
        --mesh dp=8,pp=8,tp=megatron:8 --zero 1 --microbatches 48 --checkpoint

``--mesh tp=SCHEME:GRID`` (dp = pp = 1, no ``--microbatches``) prices the tensor scheme
alone (:func:`grid_alone`: the step of the composition of the grid alone, with the
communication by group and kernels of
:func:`~summasim.costmodel.workload.step.step_breakdown`): the step time with its
breakdown (GEMM, memory-bound kernels, optimizer, exposed communication), the model
TFLOP/s per device, the collective algorithms the model assumed per group (NCCL's
algorithm and protocol on GPU presets), the memory per device and the largest batch
that fits. A whole composition (``dp``, ``pp`` > 1, or ``--microbatches``) is priced by
:func:`~summasim.costmodel.workload.composition.price_composition`, the pricer ``plan`` ranks with, so
its step time is exactly the plan's row for the same composition: step time, breakdown
(GEMM, memory-bound, exposed tensor / dp / pp / ZeRO communication, bubble, optimizer),
memory per device on the worst stage and traffic. Either costs the same at any layer
count: a composition prices one stage's layers in closed form, and a tensor grid alone
is priced layer by layer up to :data:`EXACT_LAYERS` layers and above from one and two
layers (:func:`step_breakdown_layers`: a step is affine in the layer count). A user
error (a grid that does not divide the model, a composition that cannot exist, a placement that does not fit, an
unknown machine, an unwritable ``--json``) is one line and exit status 2
(:mod:`summasim.cli`), found before anything is priced.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from summasim import cli, options
from summasim.spec import unsupported
from summasim.jsonio import write_report
from summasim.costmodel.workload.tensor import check_composition
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.machine import DTYPE_SIZES, load_preset
from summasim.costmodel.workload.scheme import (TransformerConfig, misfit,
                                                sequence_parallel_misfit)
from summasim.costmodel.workload.footprint import (batch_step, largest_batch, memory,
                                                   training_grad_bytes)
from summasim.costmodel.workload.step import StepBreakdown, step_breakdown
from summasim.costmodel.machine.topology import GridShape, Placement

from ..compute.roofline import usable_memory
from . import _cli, parse_grid, scheme_of  # noqa: F401  (parse_grid: predict's name too)
from .devset import machine_interval
from .explain import grid_bound, placement_what_ifs, what_bounds, what_ifs
from ._cli import DEFAULT_DTYPES, model_batch, pick_dtype, resolve_machine

GiB = float(1 << 30)
#: The machine every cost-model command (``predict``, ``plan``, ``explore``) prices on
#: without ``--machine``; their ``--dtype`` defaults alike, to the first of
#: :data:`~summasim.costmodel.tools._cli.DEFAULT_DTYPES` the machine has.
DEFAULT_PRESET = "dgx-a100"
#: The largest size a cost-model command takes (every ``--model`` size, ``--batch``,
#: ``--matmul-n``): 2^40, far beyond any model, and small enough that every product of
#: sizes the model forms stays a finite float.
MAX_SIZE = 1 << 40
#: Up to this many layers a tensor grid's step is priced layer by layer (exactly as
#: :func:`~summasim.costmodel.workload.step.step_breakdown` sums it, about 0.4 ms a
#: layer here); above, in constant time from one and two layers.
EXACT_LAYERS = 256


def size_help() -> str:
    """What ``--help`` says of the bound on the model's sizes."""
    return f"each size at most 2^40 = {MAX_SIZE} (more layers cost no more time)"


def check_sizes(model, batch: int) -> None:
    """Every size of ``model`` and ``batch`` at most :data:`MAX_SIZE`, else a
    :class:`cli.UsageError` naming the size."""
    for key, val in model.sizes().items():
        if isinstance(val, (int, float)) and val > MAX_SIZE:   # mlp, tied: words
            raise cli.argument_error("--model", f"{key} = {val} is above 2^40 = {MAX_SIZE}")
    if batch > MAX_SIZE:
        raise cli.argument_error("--batch", f"at most 2^40 = {MAX_SIZE}, got {batch}")


def add_progress(ap: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: a progress bar on stderr (tqdm)."""
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="a progress bar on stderr while the work takes longer than a "
                         "second (default: only when stderr is a terminal, so that pipes "
                         "and logs stay clean)")


class _NoBar:
    """What :func:`progress_bar` returns without tqdm: counts nothing, shows nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass


def progress_bar(args, **kw):
    """A tqdm bar on stderr (``kw``: ``total``, ``desc``, ``unit``) that shows after a
    second, when ``--progress`` asks for it or, by default, when stderr is a terminal;
    a disabled one otherwise."""
    show = getattr(args, "progress", None)
    if show is None:
        show = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:                 # tqdm is a dependency; without it, no bar
        return _NoBar()
    return tqdm(disable=not show, file=sys.stderr, delay=1.0, mininterval=0.5,
                dynamic_ncols=True, **kw)


def step_breakdown_layers(scheme, cfg: TransformerConfig, machine, **kw) -> StepBreakdown:
    """:func:`~summasim.costmodel.workload.step.step_breakdown` in constant time in the
    layer count: itself up to :data:`EXACT_LAYERS` layers; above, each time, count and
    flop count extrapolated from the steps of one and two layers (a step is the
    embedding and head plus N identical layers: affine in N), the memory computed at N."""
    if cfg.N <= EXACT_LAYERS:
        return step_breakdown(scheme, cfg, machine, **kw)
    one = step_breakdown(scheme, cfg.replace(N=1), machine, **kw)
    two = step_breakdown(scheme, cfg.replace(N=2), machine, **kw)
    more = cfg.N - 1

    def at_n(a, b):
        return a + more * (b - a)

    fields = ("seconds", "gemm_seconds", "memory_bound_seconds", "optimizer_seconds",
              "comm_seconds", "comm_exposed_seconds", "launch_seconds", "kernels",
              "model_flops")
    return dataclasses.replace(
        two, config=cfg, memory=memory(scheme, cfg),
        **{f: at_n(getattr(one, f), getattr(two, f)) for f in fields},
        by_op={k: at_n(one.by_op.get(k, 0.0), v) for k, v in two.by_op.items()})


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The predict arguments, added to ``parser`` (a sub-parser) or a new one."""
    ap = _cli.new_parser(parser, "predict", __doc__)
    options.add_model(ap, help_more=f" (required; {size_help()})")
    options.add_batch(ap, help_more=f" (at most 2^40 = {MAX_SIZE})")
    options.add_mesh(ap, help_more=" (required); dp = pp = 1 and no --microbatches prices "
                                   "the tensor grid alone")
    options.add_training(ap)
    options.add_dtype(ap, choices=tuple(DTYPE_SIZES), default=None,
                      help_more=" of parameters, activations and messages (default: the "
                                f"first of {', '.join(DEFAULT_DTYPES)} the machine has)")
    _cli.add_machine(ap, DEFAULT_PRESET)
    ap.add_argument("--dropout", type=cli.float_range(0, 1, hi_open=True), default=0.0,
                    help="dropout probability (default 0)")
    _cli.add_engine(ap)
    _cli.add_kernels(ap)
    _cli.add_states(ap, None)
    ap.add_argument("--placement", default="row-major",
                    help="tensor grid alone: row-major (default), blocked, blocked:AxB, or "
                         "map:SLOT,SLOT,...")
    ap.add_argument("--mem-budget", type=cli.finite_positive_float, default=None,
                    help="usable GiB per device, for whether it fits and the largest batch "
                         "(default: the machine's), as plan's")
    ap.add_argument("--json", default=None, metavar="PATH", type=cli.report_path("predict"),
                    action=cli.ReportAction, help="write the result as JSON (its folder "
                                                  "must exist)")
    cli.add_force(ap)
    return ap


_arg = cli.argument_error


def is_composition(args) -> bool:
    """Whether ``args`` name a whole composition (dp or pp > 1, --microbatches, a ZeRO
    stage, a schedule or stages of a pipeline, a loss scale or gradient-reduction type,
    the model states' bytes or the gradient bucket), not the tensor grid alone."""
    mesh = args.mesh
    return (mesh.dp > 1 or mesh.pp > 1 or args.microbatches is not None or args.zero != 0
            or str(args.schedule).startswith("interleaved") or args.stages is not None
            or args.loss_scale is not None or args.grad_reduce is not None
            or getattr(args, "state_bytes", None) is not None
            or getattr(args, "bucket_mb", None) is not None)


#: The techniques of ``spec.Training.techniques`` that ``predict`` prices: all of them
#: (mixed precision: :meth:`StateBytes.for_training`; the schedule, stages and the loss
#: scale: :func:`price_composition`; recompute, attention and sequence parallelism: the
#: workload, :class:`TransformerConfig`).
PREDICT_TECHNIQUES: frozenset = frozenset({"--schedule", "--stages", "--recompute",
                                           "--attention", "--sequence-parallel", "--dtype"})


def training_dict(training) -> dict:
    """The :class:`summasim.spec.Training` as JSON: every technique, named as its flag."""
    return {"zero": training.zero, "schedule": training.schedule, "chunks": training.chunks,
            "microbatches": training.microbatches,
            "stages": list(training.stages) if training.stages is not None else None,
            "recompute": training.recompute, "attention": training.attention,
            "sequence_parallel": training.sequence_parallel, "dtype": training.dtype,
            "mixed": training.mixed, "loss_scale": training.loss_scale,
            "grad_reduce": training.grad_reduce}


def technique_line(training) -> str:
    """One line naming how the mesh trains (what ``predict`` and ``plan`` print)."""
    parts = [f"ZeRO {training.zero}", training.schedule_label,
             f"recompute {training.recompute}", f"attention {training.attention}",
             "sequence parallel" if training.sequence_parallel else "no sequence parallelism"]
    if training.stages is not None:
        parts.append("stages " + ",".join(map(str, training.stages)))
    if training.mixed:
        parts.append(f"mixed precision {training.dtype} (fp32 master and Adam, gradients "
                     f"reduced in {training.grad_reduce}, loss scale {training.loss_scale})")
    elif training.dtype:
        parts.append(training.dtype)
    return ", ".join(parts)


def training_of(args, dtype):
    """The :class:`summasim.spec.Training` of ``args`` in ``dtype``, or a usage error
    naming a contradiction or a technique the cost model does not price yet."""
    try:
        training = options.training(args, dtype=dtype)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    why = unsupported(training, PREDICT_TECHNIQUES, "the cost model")
    if why:
        raise cli.UsageError(why)
    return training


def check_args(args):
    """``(machine, scheme, cfg, placement, budget)`` or :class:`cli.UsageError`."""
    machine = resolve_machine(args.machine)
    model, batch = model_batch(args)
    check_sizes(model, batch)
    if args.mesh is None:
        raise _arg("--mesh", "required: dp=D,pp=P,tp=SCHEME:GRID (e.g. tp=optimus:4x4)")
    dtype = pick_dtype(machine, args.dtype)
    args.training = tr = training_of(args, dtype)
    if getattr(args, "p2p_overlap", False) and tr.schedule == "gpipe":
        raise _arg("--p2p-overlap", "prices the steady state of 1f1b and interleaved "
                                    "schedules; gpipe has none (drop one of the two)")
    sch = scheme_of(args.mesh.tp)
    cfg = TransformerConfig.from_model(model, batch, dtype=dtype, recompute=tr.recompute,
                                       attention=tr.attention,
                                       sequence_parallel=tr.sequence_parallel
                                       ).replace(**_cli.kernel_fields(args))
    if args.dropout:
        cfg = cfg.replace(dropout=args.dropout)
    if tr.sequence_parallel:
        why = sequence_parallel_misfit(sch, cfg)
        if why:
            raise _arg("--sequence-parallel", why)
    if args.json is not None:
        _cli.writable("--json", args.json)
    if is_composition(args):
        if args.placement.strip() != "row-major":
            raise _arg("--placement", "places a tensor grid alone (dp = pp = 1); a "
                                      "composition is priced in rank order")
        m = args.microbatches if args.microbatches is not None else args.mesh.pp
        try:
            check_composition(cfg, sch, args.mesh.dp, args.mesh.pp, m, batch,
                              stages=tr.stages, chunks=tr.chunks)
        except ValueError as exc:
            flag = ("--stages" if tr.stages is not None and "--stages" in str(exc)
                    else "--schedule" if "interleaved" in str(exc)
                    else "--microbatches" if args.microbatches is not None else "--mesh")
            raise _arg(flag, f"{args.mesh} cannot run {model} at batch {batch}: "
                             f"{exc}") from None
        return machine, sch, cfg, m, None
    why = misfit(sch, cfg)
    if why:
        raise _arg("--mesh", f"{sch.label} does not divide the model: {why}")
    try:
        placement = Placement.parse(args.placement)
        if placement.tile and sch.q * sch.cols == 1:
            raise ValueError(f"{args.placement!r} tiles a pr x pc grid; {sch.label} is one "
                             f"group of {sch.p} ranks, placed in rank order")
        if machine.topology is not None:
            placement.slots_for(GridShape.of(sch.p, sch.q, sch.d, pc=sch.pc),
                                machine.topology.devices_per_node)
    except ValueError as exc:
        raise _arg("--placement", exc) from None
    budget = (args.mem_budget * GiB if args.mem_budget is not None
              else usable_memory(machine, sch.p))
    return machine, sch, cfg, placement, budget


def price_fixed_composition(args, machine, sch, cfg, m, *, recompute=None,
                            zero=None) -> dict:
    """:func:`~summasim.costmodel.workload.composition.price_composition` of the composition of
    ``args`` exactly as :func:`summasim.costmodel.tools.plan.search` prices it (the
    training's state bytes, :meth:`StateBytes.for_training`, or ``--state-bytes``; the
    bucket of ``--bucket-mb``, default PyTorch DDP's; the engine's overlaps,
    :func:`~._cli.add_engine`)."""
    mesh, tr = args.mesh, args.training
    return price_composition(cfg, sch, machine=machine, dp=mesh.dp, pp=mesh.pp,
                             microbatches=m, global_batch=int(cfg.b),
                             zero=args.zero if zero is None else zero,
                             schedule=tr.schedule, chunks=tr.chunks, stages=tr.stages,
                             recompute=recompute or tr.recompute, devices=mesh.devices,
                             loss_scale=tr.loss_scale or "none",
                             state_bytes=_cli.state_bytes(args, cfg.dtype, tr.grad_reduce),
                             bucket_bytes=_cli.bucket_bytes(args),
                             zero3_prefetch=getattr(args, "zero3_prefetch", False),
                             grad_overlap=getattr(args, "grad_overlap", True),
                             p2p_overlap=getattr(args, "p2p_overlap", False))


def grid_alone(args, machine, sch, cfg, placement) -> StepBreakdown:
    """The tensor grid of ``args`` alone, one step, as ``plan`` and a composition price
    it: :func:`step_breakdown_layers` for its parts (communication by group, kernels,
    placement), with the step's time and parts those of the composition of the grid
    alone (dp = pp = m = 1, ZeRO 0; :func:`price_fixed_composition`), which adds what
    the training does beyond the layers (the loss scale's unscaling pass and overflow
    flag; on a CPU machine, the shared-core model its fit calibrated), and the memory
    with the training's gradient bytes (:meth:`StateBytes.for_training`: a float32
    gradient buffer under mixed precision). Under a placement other than rank order, the
    step moves by what that placement changes in the exposed communication."""
    sb = step_breakdown_layers(sch, cfg, machine, placement=placement)
    bd = price_fixed_composition(args, machine, sch, cfg, 1)["breakdown"]
    exposed = sum(bd["exposed_comm"].values()) + bd["bubble"]
    if placement != Placement():
        exposed += (sb.comm_exposed_seconds
                    - step_breakdown_layers(sch, cfg, machine).comm_exposed_seconds)
    mem_bound = bd["memory_bound"] + bd["optimizer"]
    comm, by_op = sb.comm_seconds, dict(sb.by_op)
    if exposed > comm > 0:
        # the composition's communication (a CPU fit's shared cores wait longer than the
        # layer model's messages alone): the groups keep their shares of it
        by_op = {k: v * exposed / comm for k, v in by_op.items()}
        comm = exposed
    return dataclasses.replace(
        sb, memory=memory(sch, cfg, training_grad_bytes(cfg)), gemm_seconds=bd["gemm"],
        memory_bound_seconds=mem_bound, optimizer_seconds=bd["optimizer"],
        comm_seconds=comm, by_op=by_op, comm_exposed_seconds=exposed,
        seconds=bd["gemm"] + mem_bound + exposed)


def _run_lengths(values, most: int = 16) -> str:
    """``8,8,8,8`` as it is; a list of more than ``most`` values as runs, ``1 x 32,
    0 x 1048544`` (so that a million stages print one short line)."""
    values = list(values)
    if len(values) <= most:
        return ",".join(map(str, values))
    runs: list = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    text = ", ".join(f"{v} x {n}" if n > 1 else str(v) for v, n in runs[:most])
    return text + (f", ... ({len(runs) - most} more runs)" if len(runs) > most else "")


def _s(x: float) -> str:
    return f"{x * 1e3:10.2f} ms"


def run(args, out=None) -> dict:
    """Price the configuration of ``args``, print it, return it as a dict."""
    out = out or sys.stdout
    machine, sch, cfg, placement, budget = check_args(args)
    if is_composition(args):
        return _run_composition(args, out, machine, sch, cfg, placement)
    sb = grid_alone(args, machine, sch, cfg, placement)
    mem = sb.memory
    step = batch_step(sch)
    best_b = (largest_batch(sch, cfg, budget, grad_bytes=training_grad_bytes(cfg))
              if budget > 0 else None)
    w = out.write
    w(f"machine:   {machine.name} (library {machine.library}"
      f"{', ' + machine.device.name if machine.device else ''})\n")
    w(f"scheme:    {sch.label}, placement {placement.describe()}\n")
    w(f"model:     {_model_line(cfg)}\n")
    w(f"training:  {technique_line(args.training)}\n\n")
    w(f"step time            {_s(sb.seconds)}   ({cli.sig3(sb.tflops_per_device)} model "
      f"TFLOP/s per device, {sb.model_flops / 1e15:.3g} PFLOP per step)\n")
    iv = machine_interval(machine, sb.seconds)
    w(_interval_line(iv))
    for label, val in (("  GEMM", sb.gemm_seconds),
                       ("  memory-bound", sb.memory_bound_seconds - sb.optimizer_seconds),
                       ("  optimizer", sb.optimizer_seconds),
                       ("  exposed comm", sb.comm_exposed_seconds)):
        share = val / sb.seconds if sb.seconds else 0.0
        w(f"{label:<20s} {_s(val)}   {share:6.1%}\n")
    w(f"  (kernel launches   {_s(sb.launch_seconds)}, {sb.kernels} kernels, inside GEMM and "
      f"memory-bound)\n\ncommunication by group\n")
    for (op, grp), secs in sorted(sb.by_op.items(), key=lambda kv: -kv[1]):
        algs = ", ".join(sb.algorithms.get((op, grp), ()))
        w(f"  {op + '/' + grp:<22s} {_s(secs)}   {algs}\n")
    bound = grid_bound(sb)
    w(f"\nbound by  {bound['why']} ({bound['share']:.0%} of the step)\n")
    moves = placement_what_ifs(
        lambda pl: grid_alone(args, machine, sch, cfg, pl).seconds,
        placement, sch, machine.topology)
    for r in moves:
        r["gain"] = 1.0 - r["step_seconds"] / sb.seconds if sb.seconds else 0.0
    if moves:
        w("what another placement would do\n")
        for r in moves:
            w(f"  {r['change']:<46s} {_s(r['step_seconds'])}   {-r['gain'] + 0.0:+6.1%}\n")
    w("\nmemory per device\n")
    for key, val in mem.to_dict().items():
        w(f"  {key:<20s} {val / GiB:10.3f} GiB\n")
    if best_b is not None:
        fits = "fits" if mem.total <= budget else "does NOT fit"
        w(f"\n{fits} in {budget / GiB:.3g} GiB per device; largest batch that fits: "
          f"{best_b} (a multiple of {step})\n")
    result = {**sb.to_dict(), "bound": bound, "interval_seconds": iv and list(iv),
              "placements": moves,
              "budget_bytes": budget,
              "fits": mem.total <= budget,
              "largest_batch": best_b, "training": training_dict(args.training)}
    if args.json is not None:
        write_report(args.json, "predict", result)
        w(f"wrote {args.json}\n")
    return result


def _run_composition(args, out, machine, sch, cfg, m) -> dict:
    """Price, print and return one fixed composition (:func:`price_fixed_composition`)."""
    res = price_fixed_composition(args, machine, sch, cfg, m)
    c, mem, bd = res["composition"], res["memory"], res["breakdown"]
    w = out.write
    w(f"machine:   {machine.name} (library {machine.library}"
      f"{', ' + machine.device.name if machine.device else ''})\n")
    w(f"mesh:      {args.mesh} ({sch.label}), {args.mesh.devices} devices, m = "
      f"{c['microbatches']} micro-batches of {c['micro_batch']}, layers per "
      f"{'virtual stage (chunk c of stage s is c pp + s)' if c['chunks'] > 1 else 'stage'} "
      f"{_run_lengths(c['stage_layers'])}\n")
    w(f"model:     {args.model}: {_model_line(cfg)}\n")
    w(f"training:  {technique_line(args.training)}\n\n")
    step = res["step_seconds"]
    w(f"step time            {_s(step)}   ({cli.sig3(res['flops_per_device'] / 1e12)} model "
      f"TFLOP/s per device, bubble {100 * res['bubble_fraction']:.1f}% of the pipeline, "
      f"{100 * res['bubble_over_ideal']:.1f}% of its ideal time)\n")
    iv = machine_interval(machine, step)
    w(_interval_line(iv))
    parts = [("  GEMM", bd["gemm"]), ("  memory-bound", bd["memory_bound"])]
    parts += [("  comm contention" if k == "contention" else f"  exposed {k} comm", v)
              for k, v in bd["exposed_comm"].items()]
    parts += [("  bubble", bd["bubble"]), ("  optimizer", bd["optimizer"])]
    for label, val in parts:
        share = val / step if step else 0.0
        w(f"{label:<20s} {_s(val)}   {share:6.1%}\n")
    w("\nmemory per device (worst stage)\n")
    for key in ("model_states", "transient", "activations", "workspace", "total"):
        val = mem.get(key)
        if isinstance(val, dict):
            val = val.get("total")
        if val is not None:
            w(f"  {key:<20s} {val / GiB:10.3f} GiB\n")
    budget = (args.mem_budget * GiB if args.mem_budget is not None
              else usable_memory(machine, c["devices"]))
    fits = not budget or mem["total"] <= budget
    if budget:
        w(f"  {'fits' if fits else 'does NOT fit'} in {budget / GiB:.3g} GiB per device"
          f"{'' if args.mem_budget is not None else ' (the usable memory: the device memory less its reserve and fragmentation)'}\n")
    traffic = res.get("traffic") or {}
    if traffic:
        w("\ntraffic per rank per step\n")
        for key, val in traffic.items():
            if isinstance(val, (int, float)):
                w(f"  {key:<20s} {val / GiB:10.3f} GiB\n")
    bound = what_bounds(res, machine)
    w(f"\nbound by  {bound['why']} ({bound['share']:.0%} of the step)\n")

    def price(machine=machine, microbatches=m, cfg=cfg, recompute=None, zero=None):
        return price_fixed_composition(args, machine, sch, cfg, microbatches,
                                       recompute=recompute, zero=zero)

    ifs = what_ifs(price, res, machine, cfg, load_preset,
                   budget=budget if args.mem_budget is not None else None)
    if ifs:
        w("what one change would do (the same model, each alone)\n")
        for r in ifs:
            fit = "" if r["fits"] else (f"   does NOT fit ({r['memory_bytes'] / GiB:.1f} "
                                        f"GiB)")
            w(f"  {r['change']:<44s} {_s(r['step_seconds'])}  {-r['gain']:+7.1%}{fit}\n")
    res = {**res, "training": training_dict(args.training), "bound": bound,
           "what_ifs": ifs, "interval_seconds": iv and list(iv), "budget_bytes": budget,
           "fits": fits}
    if args.json is not None:
        write_report(args.json, "predict", res)
        w(f"wrote {args.json}\n")
    return res


def _interval_line(iv) -> str:
    if iv is None:
        return ("  80% interval       none: the dev set's published runs are GPU clusters; "
                "`costmodel accuracy` measures this machine's error (docs/costmodel.md)\n")
    return (f"  80% interval       {_s(iv[0])} to {_s(iv[1]).strip()}   (from the dev "
            f"set's published runs; its coverage is checked leaving each publication out: "
            f"docs/devset.md)\n")


def _model_line(cfg) -> str:
    """The priced workload's sizes and block, one line."""
    block = [f"mlp {cfg.mlp}"]
    if cfg.kv_heads is not None:
        block.append(f"kv_heads {cfg.kv_heads:g}")
    if not cfg.tied:
        block.append("untied head")
    if cfg.norm != "layernorm":
        block.append(cfg.norm)
    if cfg.rope:
        block.append("rope")
    block.append(f"{cfg.kernels} kernels")
    return (f"b={cfg.b} s={cfg.s} h={cfg.h} n={cfg.n} N={cfg.N} v={cfg.v} ffn={cfg.ffn:g} "
            f"{cfg.dtype}{f' dropout={cfg.dropout:g}' if cfg.dropout else ''}, "
            + ", ".join(block))


def main(argv=None) -> int:
    return _cli.main(build_parser, run, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
