"""``mpirun -n P python -m summasim.bench BENCHMARK [options]``: the benchmarks (see
:data:`HELP`; ``python -m summasim.bench BENCHMARK --help`` for each one's options).

Every command spells the shared things alike (``--model``, ``--batch``, ``--mesh``,
``--machine FILE|PRESET``, ``--dtype``; :mod:`summasim.options`). Speed goals live here,
not in timed tests. Results go to the terminal and, with ``--json``, to a file (written
atomically). A user error is one line from rank 0 and exit status 2, before any work.
"""

from __future__ import annotations

from .. import cli

if __name__ == "__main__":        # a Ctrl-C while the modules below load: no traceback
    cli.quiet_interrupts()

import argparse
import sys

from .. import options
from ..harness.frontend import Parser, check_outputs, mpi_main
from . import allreduce, gemm, layer, mesh, ring_steps, transformer
from .common import (Run, add_backend, add_json, add_predict, add_repeats, given,
                     say_buffers)

PROG = "python -m summasim.bench"
HELP = {
    "gemm": "distributed products' GFLOP/s next to the single-process GEMM ceiling",
    "allreduce": "ring_allreduce vs a plain mpi4py ring and MPI_Allreduce, with the cost "
                 "model's prediction (from -n 2)",
    "ring-steps": "where a ring all-reduce's time goes, per step, inside MPI and outside",
    "transformer": "each tensor-parallel scheme's forward + backward vs the serial model",
    "mesh": "sharded-training compositions' step vs pure tensor parallelism",
    "all": "gemm, allreduce, transformer and mesh in one run (the default)",
    "layer": "one serial layer vs PyTorch eager, and checkpointing's memory (no MPI)",
}
BENCHMARKS = {"gemm": gemm, "allreduce": allreduce, "ring-steps": ring_steps,
              "transformer": transformer, "mesh": mesh, "layer": layer}
#: what ``all`` runs, in order
ALL = ("gemm", "allreduce", "transformer", "mesh")
#: the order of the memory checks (the largest first, as before)
PREFLIGHT = ("mesh", "transformer", "allreduce", "ring-steps", "gemm")


def _add_all(ap):
    """``all``: the options of the benchmarks it runs, each declared once; the shared
    ``--model`` and ``--dtype`` default to each benchmark's own."""
    from ..options import add_dtype, add_model

    gemm.add_arguments(ap, every=True)
    allreduce.add_arguments(ap, every=True)
    add_model(ap, help_more=f" (default: the transformer benchmark's "
                            f"{transformer.DEFAULT_MODEL}, the mesh benchmark's "
                            f"{mesh.DEFAULT_MODEL})")
    mesh.add_training(ap)
    add_dtype(ap, default=None, help_more=" (default float64; the transformer benchmark's "
                                          "float32; mesh trains in float64)")
    add_backend(ap, "gemm, allreduce and mesh (transformer times NumPy only)")
    add_predict(ap, "the ring and the training steps")
    add_repeats(ap, allreduce.REPEATS_HELP)
    add_json(ap)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = Parser(prog=PROG, formatter_class=raw,
                description="summasim's benchmarks: mpirun -n P python -m summasim.bench "
                            "BENCHMARK [options] (BENCHMARK --help: its options; none "
                            "named: all). Speed goals live here, not in timed tests.")
    sub = ap.add_subparsers(dest="what", metavar="BENCHMARK", required=True)
    for name, module in BENCHMARKS.items():
        module.add_arguments(sub.add_parser(name, help=HELP[name], description=module.__doc__,
                                            formatter_class=raw))
    _add_all(sub.add_parser("all", help=HELP["all"], description=HELP["all"]))
    return ap


def parse_args(argv=None):
    """Parse and check the arguments (pure, every rank); :class:`~summasim.cli.UsageError`
    on a mistake. No benchmark named (only options, or nothing): ``all``. ``--help`` is
    printed by rank 0 only (the launcher's rank: every rank parses before MPI starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "all")
    with cli.launcher_rank0_output():
        args = build_parser().parse_args(argv)
    options.check_machine_used(args)
    if args.what == "layer":
        layer.check(args)
    if args.what == "mesh":
        mesh.check(args)
    return args


def _preflight(args, world) -> str:
    """Rank 0: the outputs, the backend, and each benchmark's memory on this node."""
    from ..backends import device_share, unavailable
    from ..comm import local_ranks

    machine = None if getattr(args, "no_predict", True) else args.machine
    backend = getattr(args, "backend", "numpy")
    err = check_outputs(args.json, machine, world.Get_size()) or unavailable(backend)
    if err:
        return err
    gpu = device_share(backend, local_ranks())     # (free bytes, ranks per GPU) or None
    runs = ALL if args.what == "all" else (args.what,)
    for name in PREFLIGHT:
        if name in runs:
            why = BENCHMARKS[name].preflight(args, world, gpu)
            if why:
                return why
    nothing = {name: _nothing_to_measure(name, args, world.Get_size()) for name in runs}
    if all(nothing.values()):
        return "; ".join(f"{name} measures nothing: {why}" for name, why in nothing.items())
    return ""


def _reasons(skips, most: int = 3) -> str:
    """The first ``most`` skips' reasons, one clause each."""
    parts = [f"{sk.name}: {sk.reason}" for sk in skips[:most]]
    return "; ".join(parts) + (f"; and {len(skips) - most} more" if len(skips) > most else "")


def _nothing_to_measure(name: str, args, p: int) -> str:
    """Why benchmark ``name`` would measure nothing at p ranks ("" when it measures
    something): a benchmark that times nothing is a user error (exit status 2), found
    before any work, not a run that prints only "skipped" and exits 0."""
    import numpy as np

    if name in ("allreduce", "ring-steps"):
        return "" if p > 1 else ("a ring of one rank sends nothing; run it under "
                                 "mpiexec -n 2 or more")
    if name == "gemm":
        from ..harness.plan import plan_products

        cases, skips = plan_products(p, args.algorithms, (args.n,) * 3, None,
                                     [np.dtype(given(args, "dtype", "float64")).name])
        return "" if cases else (f"no product of --n {args.n} runs on p = {p} ranks "
                                 f"({_reasons(skips)}); name --algorithms whose grids fit "
                                 f"p = {p}")
    if name == "transformer":
        if getattr(args, "backend", "numpy") != "numpy":
            return f"it times NumPy only, not --backend {args.backend}"
        from ..harness.plan import plan_schemes
        from ..transformer.schemes import SCHEMES
        from .common import runtime_config

        model, batch, dtype = transformer.model_of(args)
        cases, skips = plan_schemes(p, SCHEMES, lambda _: runtime_config(model, dtype), batch)
        return "" if cases else (f"no scheme's grid of p = {p} ranks divides the model "
                                 f"({_reasons(skips)})")
    if name == "mesh":
        cases, skips, _ = mesh.plan_mesh_bench(args, p)
        return "" if cases else (f"no composition runs on p = {p} ranks"
                                 + (f" ({_reasons(skips)})" if skips else ""))
    return ""


def _body(args, world) -> int:
    from ..backends import get_backend
    from ..comm import default_wait_policy, node_cores
    from ..jsonio import write_report
    from ..mpiutil import doing, limit_blas_threads

    p = world.Get_size()
    _limits = limit_blas_threads(1 if p > 1 else None)  # noqa: F841
    backend = get_backend(getattr(args, "backend", "numpy"))
    dtype = given(args, "dtype", "float64")
    report = {"p": p, "cores": node_cores(), "dtype": dtype,
              "wait_policy": default_wait_policy(), "backend": backend.name,
              "comm_mode": backend.comm_mode}
    bench = Run(args, world, backend, report)
    say = bench.say
    say(f"summasim.bench: p = {p} ranks on {node_cores()} cores, wait policy "
        f"{default_wait_policy()}, {dtype}, backend {backend.name} (MPI path: "
        f"{backend.comm_mode})")
    runs = ALL if args.what == "all" else (args.what,)
    if {"allreduce", "ring-steps"} & set(runs) and backend.name != "cupy":
        say_buffers(bench, not args.np_empty)
    ok = True
    for name in runs:
        if name in ("allreduce", "transformer", "mesh"):
            say("")
        if name == "transformer" and backend.name != "numpy":
            say(f"transformer: skipped with --backend {backend.name} (it times NumPy only)")
            continue
        why = _nothing_to_measure(name, args, p) if args.what == "all" else ""
        if why:              # bench all: each benchmark that measures nothing here, named
            say(f"{name}: skipped, it measures nothing at p = {p}: {why}")
            report.setdefault("skipped", {})[name] = why
            continue
        doing(f"running bench {name}")       # what an interrupt's line says it was doing
        ok = BENCHMARKS[name].run(bench) and ok
    if args.json and bench.rank == 0:
        doing("writing the report")
        ok = write_report(args.json, "bench", report, prog=PROG) and ok
    if not ok:
        say("a benchmarked result failed its check")
    return 0 if ok else 1


def main(argv=None) -> int:
    """Run the benchmarks; the exit status (2: a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["layer"]:                   # serial: no MPI
        try:
            args = parse_args(argv)
        except cli.UsageError as e:
            return cli.print_error(PROG, e)
        return cli.run_command(PROG, layer.run, args)
    return mpi_main(lambda: parse_args(argv), _preflight, _body, prog=PROG, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
