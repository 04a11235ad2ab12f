"""``python -m summasim.costmodel {predict,plan,explore,devset,fit,accuracy,presets,table1}``.

``predict``, ``plan``, ``explore``, ``devset``, ``presets`` and ``table1`` never import MPI; ``fit`` and
``accuracy-worker`` must run under ``mpiexec`` (they import mpi4py only then);
``accuracy`` launches ``mpiexec`` itself.

A user error (a bad argument, an unwritable output, a model no grid can run) is
one line, ``<prog>: error: ...``, on stderr and exit status 2, found before any
work (see :mod:`summasim.cli`); ``fit`` checks its arguments before it imports
MPI, and only rank 0 speaks.
"""

from __future__ import annotations

from .. import cli

if __name__ == "__main__":        # a Ctrl-C while the modules below load: no traceback
    cli.quiet_interrupts()

import argparse
import json
import sys


#: The fit's smallest ``--max-bytes``: its collective benchmarks start at 64 B.
FIT_MIN_BYTES = 64
#: Dtypes the fit can time GEMMs in (NumPy has no bfloat16).
FIT_DTYPES = ("float64", "float32", "float16", "complex128", "complex64")


def _max_bytes(text: str) -> int:
    """argparse type of ``fit --max-bytes``: a byte size of at least 64 B."""
    val = cli.byte_size(text)
    if val < FIT_MIN_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {FIT_MIN_BYTES} B (the collective "
                                         f"benchmarks start there), got {text!r}")
    return val


#: The largest fit GEMM: three 16384^2 float64 blocks are 6 GiB per rank.
FIT_GEMM_MOST = 16384


def _gemm_sizes(text: str) -> list:
    """argparse type of ``fit --gemm-sizes``: block sizes from 1 to :data:`FIT_GEMM_MOST`,
    sorted and without repeats (the fitted table needs them increasing)."""
    sizes = sorted(set(cli.int_list(minimum=1)(text)))
    if sizes[-1] > FIT_GEMM_MOST:
        raise argparse.ArgumentTypeError(f"at most {FIT_GEMM_MOST} (three blocks of "
                                         f"{FIT_GEMM_MOST}^2 float64 are 6 GiB per rank), "
                                         f"got {sizes[-1]}")
    return sizes


def _threshold(text: str):
    """argparse type of ``fit --threshold``: ``"auto"`` or a byte size."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return cli.byte_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a byte size (e.g. 8192, 64k), "
                                         f"got {text!r}") from None


PROG = "python -m summasim.costmodel"
#: The commands, one line each: the sub-parsers' help and the list that a bare
#: ``python -m summasim.costmodel`` prints (``accuracy-worker`` is internal, not listed).
COMMANDS = {
    "predict": "one tensor grid or one composition (--mesh): step time, breakdown, memory "
               "(no MPI)",
    "plan": "the fastest dp x pp x tensor x ZeRO compositions that fit (no MPI)",
    "explore": "scaling sweeps and what-ifs (no MPI)",
    "devset": "the model against published GPU-cluster measurements (no MPI)",
    "fit": "fit a machine from microbenchmarks (run under mpiexec)",
    "accuracy": "predicted vs measured on this machine (launches mpiexec)",
    "presets": "list presets, or print one as JSON",
    "table1": "the Optimus paper's Table 1 from the model",
}


def command_list() -> str:
    """The usage and one line per command: what a bare ``python -m summasim.costmodel``
    prints (on stderr, exit status 2: a command is required, as argparse treats a
    missing sub-command, and ``summasim.bench BENCHMARK --help`` lists its own)."""
    width = max(map(len, COMMANDS))
    return (f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help: its options)\n"
            "commands:\n" + "".join(f"  {name:<{width}}  {what}\n"
                                     for name, what in COMMANDS.items()))


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _fit_main(args, prog: str) -> int:
    # arguments and the output file first, before MPI: no rank waits for a user error
    try:
        cli.check_writable_path(args.out)
    except cli.UsageError as exc:
        return cli.print_error(prog, f"argument --out: {exc}")
    from mpi4py import MPI  # only the fit needs MPI

    from ..mpiutil import abort_job, end_on_signals
    from summasim.harness.fitbench import run_fit
    from summasim.costmodel.machine.regression import FitRejected
    from summasim.harness.load import FitBusy

    comm = MPI.COMM_WORLD
    end_on_signals(prog, comm.Get_rank())            # Ctrl-C: one line, not one per rank
    size = comm.Get_size()
    problem = None
    if size < 2:
        problem = ("the fit needs at least 2 MPI ranks: run it under mpiexec "
                   "(mpiexec -n 2 python -m summasim.costmodel fit ...)")
    elif args.groups and max(args.groups) > size:
        problem = (f"argument --groups: group size {max(args.groups)} is larger than the "
                   f"{size} ranks of this run")
    else:
        from summasim.harness.frontend import environment_error

        problem = environment_error(comm) or None
    if problem:   # the same on every rank: each exits, rank 0 says why
        if comm.Get_rank() == 0:
            cli.print_error(prog, problem)
        return 2
    try:
        machine = run_fit(comm, quick=args.quick, max_bytes=args.max_bytes,
                          group_sizes=args.groups, gemm_sizes=args.gemm_sizes,
                          dtypes=tuple(args.dtypes),
                          threshold=None if args.threshold == "auto" else args.threshold,
                          name=args.name, command=" ".join(["python -m summasim.costmodel"]
                                                           + sys.argv[1:]),
                          detail=None if args.verbose else (lambda msg: None))
    except FitBusy as exc:    # raised on every rank alike: a user-facing refusal
        if comm.Get_rank() == 0:
            cli.print_error(prog, str(exc))
        return 2
    except FitRejected as exc:  # every rank alike: the fit failed, said once, no abort
        if comm.Get_rank() == 0:
            sys.stderr.write(f"{prog}: {exc}\n")
        return 1
    except Exception as exc:  # one rank failing must not leave the others waiting
        abort_job(comm, f"[fit] rank {comm.Get_rank()}: {type(exc).__name__}: {exc}\n")
        return 1
    if comm.Get_rank() == 0:
        if not machine.save(args.out, prog=prog):
            return 1
        print(f"[fit] wrote {args.out}", flush=True)
    return 0


def main(argv=None) -> int:
    """The ``summasim.costmodel`` command; a reader that goes away (``... | head``) ends
    it quietly (:func:`summasim.cli.run_command`)."""
    return cli.run_command("summasim.costmodel", _main, argv)


def _main(argv=None) -> int:
    from .tools import devset, explore_cli, plan_cli
    from .tools import predict as predict_tool
    from .machine import get_machine
    from .machine.presets import presets_listing

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        sys.stderr.write(command_list())
        return cli.print_error(PROG, "a command is required: " + ", ".join(COMMANDS))
    ap = cli.ArgumentParser(prog=PROG, description="summasim cost model: "
                            + ", ".join(COMMANDS) + " (COMMAND --help: its options)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    prp = predict_tool.build_parser(sub.add_parser(
        "predict", help=COMMANDS["predict"],
        description=predict_tool.__doc__.splitlines()[0]))
    plp = plan_cli.build_parser(sub.add_parser(
        "plan", help=COMMANDS["plan"],
        description=plan_cli.__doc__.splitlines()[0]))
    dsp = sub.add_parser("devset", help=COMMANDS["devset"], description=devset.__doc__.splitlines()[0])
    dsp.add_argument("--json", default=None, metavar="PATH", type=cli.report_path("devset"),
                     action=cli.ReportAction, help="write the table as JSON")
    dsp.add_argument("--markdown", action="store_true",
                     help="print the table as Markdown (what docs/devset.md shows)")
    dsp.add_argument("--explain", nargs="+", metavar="ID", default=None,
                     help="print the predicted breakdown and bound of these composition "
                          "points instead of the table")
    cli.add_force(dsp)
    ep = explore_cli.build_parser(sub.add_parser("explore", help=COMMANDS["explore"],
                                                 description=explore_cli.__doc__.splitlines()[0]))
    fp = sub.add_parser("fit", help=COMMANDS["fit"])
    fp.add_argument("--out", type=cli.report_path("machine"), action=cli.ReportAction,
                    default=cli.ReportPath("results/machine.json", "machine", default=True),
                    help="machine JSON to write (checked before the benchmarks; its folder "
                         "must exist unless it is the default)")
    cli.add_force(fp)
    fp.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    fp.add_argument("--verbose", action="store_true",
                    help="print every measured point and each regime's fit (they are in "
                         "the saved file's notes either way); by default the fit prints "
                         "its warnings and one summary line")
    fp.add_argument("--max-bytes", type=_max_bytes, default=None,
                    help="largest message, at least 64 B (default 64MiB, quick 4MiB)")
    fp.add_argument("--groups", type=cli.int_list(minimum=2), default=None,
                    help="collective group sizes >= 2, e.g. 2,4 (default: powers of two)")
    fp.add_argument("--gemm-sizes", type=_gemm_sizes, default=None,
                    help=f"GEMM block sizes n, 1 to {FIT_GEMM_MOST} (any order)")
    fp.add_argument("--dtypes", type=cli.choice_list(FIT_DTYPES, "dtype"),
                    default="float64,float32", help="GEMM dtypes, comma-separated, from "
                                                    + ", ".join(FIT_DTYPES))
    fp.add_argument("--threshold", type=_threshold, default="auto",
                    help="eager/rendezvous split in bytes, or 'auto': the MPI library's own "
                         "(MPICH: 8192, its CMA threshold), else the best split")
    fp.add_argument("--name", type=_name, default=None, help="machine name")
    pp = sub.add_parser("presets", help=COMMANDS["presets"])
    pp.add_argument("name", nargs="?", help="a preset (or a variant NAME:key=value,...) to "
                    "print as JSON; none: list the presets and the variant keys")
    acc = sub.add_parser("accuracy", help=COMMANDS["accuracy"], description="The cost model's accuracy benchmark: "
                         "predicted against measured, on this machine.")
    if argv[:1] == ["accuracy"]:
        # the measuring side lives in the harness (it imports MPI): only for this command
        from ..harness import accuracy as harness_accuracy

        harness_accuracy.build_parser(acc)
    wp = sub.add_parser("accuracy-worker", help="(internal) the accuracy benchmark's MPI "
                        "worker: run under mpiexec")
    wp.add_argument("spec", help="JSON spec of the cases to time")
    wp.add_argument("out", help="JSON file rank 0 writes")
    tp = sub.add_parser("table1", help=COMMANDS["table1"])
    for flag, default, what in (("--b", 8, "batch"), ("--s", 512, "sequence length"),
                                ("--h", 1024, "hidden size"), ("--p", 16, "ranks"),
                                ("--ffn", 4, "MLP multiplier f (the paper's 4)")):
        tp.add_argument(flag, type=cli.positive_int, default=default,
                        help=f"{what} (default {default})")
    args = ap.parse_args(argv)

    if args.cmd == "predict":
        return cli.run_command(prp.prog, predict_tool.run, args)
    if args.cmd == "plan":
        return cli.run_command(plp.prog, plan_cli.run, args)
    if args.cmd == "devset":
        return cli.run_command(dsp.prog, _devset_run, args)
    if args.cmd == "explore":
        return cli.run_command(ep.prog, explore_cli.run, args)
    if args.cmd == "fit":
        return _fit_main(args, fp.prog)
    if args.cmd == "accuracy":
        return harness_accuracy.run(args)
    if args.cmd == "accuracy-worker":
        from ..harness.worker import worker_main

        return worker_main(args.spec, args.out)
    if args.cmd == "presets":
        if args.name:
            try:     # a preset, an alias, or a variant NAME:key=value,... of one
                machine = get_machine(preset=args.name)
            except (OSError, ValueError) as exc:
                return cli.print_error(pp.prog, f"argument name: {exc}")
            print(json.dumps(machine.to_dict(), indent=2))
        else:
            print(presets_listing())
        return 0
    return _table1_main(args, tp.prog)


def _devset_run(args) -> int:
    """``costmodel devset``: the table, ``--explain`` or the ``--json`` report."""
    from .tools import devset

    if args.json is not None:
        try:
            cli.check_writable_path(args.json)
        except cli.UsageError as exc:
            raise cli.argument_error("--json", exc) from None
    if args.explain:
        points = {p["id"]: p for p in devset.load_points()}
        unknown = [i for i in args.explain if i not in points]
        if unknown:
            raise cli.argument_error("--explain", f"unknown point(s) {', '.join(unknown)}")
        try:
            print("\n\n".join(devset.explain_point(points[i]) for i in args.explain))
        except ValueError as exc:
            raise cli.argument_error("--explain", exc) from None
        return 0
    rows = devset.evaluate_all()
    print(devset.markdown_table(rows) if args.markdown else devset.format_table(rows),
          end="\n" if not args.markdown else "")
    if args.json is not None:
        from ..jsonio import write_report

        write_report(args.json, "devset", {"points": rows, "summary": devset.summary(rows)})
        print(f"wrote {args.json}")
    return 0


def _table1_main(args, prog: str) -> int:
    """Print Table 1 for the schemes whose grid of ``--p`` ranks divides the model;
    a scheme that cannot run there gets a line saying why; none: a user error."""
    import math

    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig, misfit
    from summasim.costmodel.workload.table1 import table1, table1_paper

    b, s, h, p, f = args.b, args.s, args.h, args.p, args.ffn
    results, notes = {}, {}
    for scheme in ("megatron", "optimus"):
        if scheme == "optimus" and math.isqrt(p) ** 2 != p:
            notes[scheme] = (f"the paper's Table 1 prices Optimus on a q x q grid, p = q^2; "
                             f"p = {p} is not a square (predict and plan price rectangular "
                             f"pr x pc grids)")
            continue
        try:
            sch = Scheme.make(scheme, p=p)
        except ValueError as exc:
            notes[scheme] = str(exc)
            continue
        n = math.gcd(h, sch.p * sch.q) or 1           # the heads table1 assumes
        why = misfit(sch, TransformerConfig(b=b, s=s, h=h, n=n, N=1, ffn=f))
        if why:
            notes[scheme] = f"not priced, the grid does not divide the model: {why}"
            continue
        results[scheme] = (table1(sch, b, s, h, p, ffn=f), table1_paper(scheme, b, s, h, p, ffn=f))
    if not results:
        return cli.print_error(prog, f"argument --p: no grid of p = {p} ranks divides the "
                                     f"model (" + "; ".join(f"{k}: {v}" for k, v in notes.items())
                               + ")")
    print(f"Optimus Table 1 at b={b} s={s} h={h} p={p}{f' ffn={f}' if f != 4 else ''} "
          f"(model value == paper formula)")
    bad = False
    for scheme in ("megatron", "optimus"):
        if scheme not in results:
            print(f"  {scheme}: {notes[scheme]}")
            continue
        ours, paper = results[scheme]
        for key in paper:
            rel = "==" if ours[key] == paper[key] else "!="
            bad = bad or rel == "!="
            print(f"  {scheme:<9s} {key:<23s} {float(ours[key]):>16.6g}  "
                  f"{rel} {float(paper[key]):.6g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
