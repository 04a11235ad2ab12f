"""``python -m summasim.costmodel predict``: one configuration, one training step.

    python -m summasim.costmodel predict --scheme optimus --grid 8x8 --hidden 8192 \\
        --heads 64 --layers 24 --seq 2048 --batch 64 --vocab 51200 --dtype bfloat16 \\
        --checkpoint --preset dgx-a100 [--placement blocked] [--json results/p.json]

prints the step time with its breakdown (GEMM, memory-bound kernels, optimizer,
exposed communication), the model TFLOP/s per device, the collective algorithms
the model assumed per group (NCCL's algorithm and protocol on GPU presets), the
memory per device and the largest batch that fits. ``--grid`` is ``P`` for
Megatron, ``Q`` or ``QxQ`` for Optimus and ``QxQxD`` (or ``[Q,Q,D]``) for
SUMMA2.5-LM. A user error (a grid that does not divide the model, a placement
that does not fit, an unknown preset, an unwritable ``--json``) is one line and
exit status 2 (:mod:`summasim.cli`), found before anything is priced.
"""

from __future__ import annotations

import argparse
import re
import sys

from .. import cli
from ..jsonio import write_json_atomic
from .machine import DTYPE_SIZES, list_presets, machine_from_args
from .schemes import (SCHEMES, Scheme, TransformerConfig, batch_step, largest_batch, misfit,
                      step_breakdown)
from .topology import GridShape, Placement

GiB = float(1 << 30)
PREDICT_PRESET = "dgx-a100"


def parse_grid(scheme: str, text: str) -> Scheme:
    """``--grid`` for ``scheme`` -> :class:`Scheme`; ValueError says what is expected."""
    nums = [int(x) for x in re.findall(r"\d+", str(text))]
    if not nums or re.search(r"[^\d\sx,\[\]p=]", str(text).lower()):
        raise ValueError(f"not a grid: {text!r} (megatron: P; optimus: Q or QxQ; "
                         f"summa25: QxQxD)")
    if scheme == "megatron":
        if len(nums) != 1:
            raise ValueError(f"megatron takes --grid P (one number), got {text!r}")
        return Scheme.make("megatron", p=nums[0])
    if scheme == "optimus":
        if len(nums) == 2 and nums[0] != nums[1] or len(nums) > 2:
            raise ValueError(f"optimus runs on a square grid: --grid Q or QxQ, got {text!r}")
        return Scheme.make("optimus", q=nums[0])
    if len(nums) != 3 or nums[0] != nums[1]:
        raise ValueError(f"summa25 runs on [q, q, d]: --grid QxQxD, got {text!r}")
    return Scheme.make("summa25", q=nums[0], d=nums[2])


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The predict arguments, added to ``parser`` (a sub-parser) or a new one."""
    ap = parser or cli.ArgumentParser(prog="python -m summasim.costmodel predict",
                                      description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", required=True, choices=SCHEMES)
    ap.add_argument("--grid", required=True,
                    help="megatron: P; optimus: Q or QxQ; summa25: QxQxD")
    ap.add_argument("--hidden", type=cli.positive_int, required=True, help="hidden size h")
    ap.add_argument("--heads", type=cli.positive_int, required=True, help="attention heads n")
    ap.add_argument("--layers", type=cli.positive_int, required=True, help="layers N")
    ap.add_argument("--seq", type=cli.positive_int, required=True, help="sequence length s")
    ap.add_argument("--batch", type=cli.positive_int, required=True, help="batch b (sequences)")
    ap.add_argument("--vocab", type=cli.nonnegative_int, default=0,
                    help="vocabulary v (0: no embedding and head)")
    ap.add_argument("--ffn", type=cli.finite_positive_float, default=4,
                    help="MLP multiplier f (default 4)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_SIZES),
                    help="dtype of parameters, activations and messages (default bfloat16)")
    ap.add_argument("--dropout", type=cli.float_range(0, 1, hi_open=True), default=0.0,
                    help="dropout probability (default 0)")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"machine preset ({', '.join(list_presets())}); "
                     f"default {PREDICT_PRESET}")
    src.add_argument("--machine", metavar="FILE", type=cli.existing_file, help="machine JSON")
    ap.add_argument("--placement", default="row-major",
                    help="row-major (default), blocked, blocked:AxB, or map:SLOT,SLOT,...")
    ap.add_argument("--mem-budget", type=cli.finite_nonnegative_float, default=None,
                    help="GiB per device for the largest batch (default: the machine's)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    return ap


_arg = cli.argument_error


def check_args(args):
    """``(machine, scheme, cfg, placement, budget)`` or :class:`cli.UsageError`."""
    machine = machine_from_args(args.machine, args.preset or PREDICT_PRESET)
    if args.dtype not in machine.gamma_gemm:
        raise _arg("--dtype", f"machine {machine.name!r} has no GEMM rate for {args.dtype} "
                              f"(it has {', '.join(machine.gamma_gemm)})")
    try:
        sch = parse_grid(args.scheme, args.grid)
    except ValueError as exc:
        raise _arg("--grid", exc) from None
    if args.hidden % args.heads:
        raise _arg("--heads", f"{args.heads} heads do not divide --hidden {args.hidden}")
    ffn = int(args.ffn) if float(args.ffn).is_integer() else args.ffn
    if not float(ffn * args.hidden).is_integer():
        raise _arg("--ffn", f"the MLP width {ffn:g} x {args.hidden} is not whole")
    cfg = TransformerConfig(b=args.batch, s=args.seq, h=args.hidden, n=args.heads,
                            N=args.layers, v=args.vocab, dtype=args.dtype,
                            checkpoint=args.checkpoint, ffn=ffn, dropout=args.dropout)
    why = misfit(sch, cfg)
    if why:
        raise _arg("--grid", f"{sch.label} does not divide the model: {why}")
    try:
        placement = Placement.parse(args.placement)
        if placement.tile and sch.q == 1:
            raise ValueError(f"{args.placement!r} tiles a q x q grid; {sch.label} is one "
                             f"group of {sch.p} ranks, placed in rank order")
        if machine.topology is not None:
            placement.slots_for(GridShape.of(sch.p, sch.q, sch.d),
                                machine.topology.devices_per_node)
    except ValueError as exc:
        raise _arg("--placement", exc) from None
    budget = args.mem_budget * GiB if args.mem_budget is not None else machine.memory_bytes
    if args.json is not None:
        try:
            cli.check_writable_path(args.json)
        except cli.UsageError as exc:
            raise _arg("--json", exc) from None
    return machine, sch, cfg, placement, budget


def _s(x: float) -> str:
    return f"{x * 1e3:10.2f} ms"


def run(args, out=None) -> dict:
    """Price the configuration of ``args``, print it, return it as a dict."""
    out = out or sys.stdout
    machine, sch, cfg, placement, budget = check_args(args)
    sb = step_breakdown(sch, cfg, machine, placement=placement)
    mem = sb.memory
    step = batch_step(sch)
    best_b = largest_batch(sch, cfg, budget) if budget > 0 else None
    w = out.write
    w(f"machine:   {machine.name} (library {machine.library}"
      f"{', ' + machine.device.name if machine.device else ''})\n")
    w(f"scheme:    {sch.label}, placement {placement.describe()}\n")
    w(f"model:     b={cfg.b} s={cfg.s} h={cfg.h} n={cfg.n} N={cfg.N} v={cfg.v} "
      f"ffn={cfg.ffn} {cfg.dtype}{' checkpointing' if cfg.checkpoint else ''}"
      f"{f' dropout={cfg.dropout:g}' if cfg.dropout else ''}\n\n")
    w(f"step time            {_s(sb.seconds)}   ({sb.tflops_per_device:.1f} model TFLOP/s per "
      f"device, {sb.model_flops / 1e15:.3g} PFLOP per step)\n")
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
    w("\nmemory per device\n")
    for key, val in mem.to_dict().items():
        w(f"  {key:<20s} {val / GiB:10.3f} GiB\n")
    if best_b is not None:
        fits = "fits" if mem.total <= budget else "does NOT fit"
        w(f"\n{fits} in {budget / GiB:.3g} GiB per device; largest batch that fits: "
          f"{best_b} (a multiple of {step})\n")
    result = {**sb.to_dict(), "budget_bytes": budget, "fits": mem.total <= budget,
              "largest_batch": best_b}
    if args.json is not None:
        write_json_atomic(args.json, result)
        w(f"wrote {args.json}\n")
    return result


def main(argv=None) -> int:
    ap = build_parser()
    return cli.run_command(ap.prog, run, ap.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
