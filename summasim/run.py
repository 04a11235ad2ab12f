"""The main job: ``mpirun -n 16 python -m summasim.run``.

A thin front-end over :mod:`summasim.harness`: it plans the cases that fit the world
size (the grids of :func:`summasim.spec.product_grids`: 2D algorithms on a q x q grid
when p is square and SUMMA on the most square pr x pc one when it is not, 2.5D ones on
every [q, q, d] with d >= 2 (else a rectangular [pr, pc, d]), the ring on all p ranks,
each tensor-parallel scheme on its grids; Cannon, SUMMA and SUMMA2.5 on any sizes),
checks its arguments, files and per-rank memory before any work, then runs each
case (rank-local inputs, the traced call, a rank-local check, timing), prints one
row per case with the cost model's prediction, and exits 1 if any check fails.

``--mesh dp=D,pp=P,tp=SCHEME:GRID`` adds sharded-training rows (data, pipeline and
ZeRO parallelism around a tensor scheme; :mod:`summasim.harness.composed`); without it
a few default compositions run. ``--inject KIND@RANK`` corrupts every run's output on
one rank (every row must then FAIL); ``--self-test`` runs every fault kind on every
algorithm, scheme and default composition that fits and shows each one caught. A user error gets one message and exit status 2.
"""

from __future__ import annotations

from . import cli

if __name__ == "__main__":        # a Ctrl-C while the modules below load: no traceback
    cli.quiet_interrupts()

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import numpy as np

from . import options
from .algorithms.table import ALGORITHMS
from .backends import NAMES as BACKENDS
from .cli import UsageError
from .harness.check import METHODS
from .harness.frontend import Parser, check_outputs, mpi_main
from .harness.inject import KINDS, Fault, check_method, uncatchable
from .harness.plan import DEFAULT_RING, DEFAULT_SIZES, SELF_TEST_RING, SELF_TEST_SIZES, \
    plan_products, plan_schemes
from .spec import MIXED_DTYPES, MODELS, SCHEME_NAMES, unsupported

PROG = "python -m summasim.run"
#: seconds of one phase of a row (the traced call, the check, a timed call) before rank 0
#: says on stderr that it is still at it, and again each time as long
HEARTBEAT_S = 30.0

#: The transformer and mesh sections' model: every scheme shards it at p = 16.
DEFAULT_MODEL = MODELS["tiny"]
#: The techniques of ``spec.Training.techniques`` that ``run --mesh`` runs and validates.
RUN_TECHNIQUES: frozenset = frozenset({"--schedule", "--stages", "--recompute", "--attention",
                                      "--sequence-parallel", "--dtype"})
SELF_TEST_MODEL = DEFAULT_MODEL.replace(layers=1)
#: ``--mesh``'s micro-batches per replica when ``--microbatches`` is not given.
MESH_MICROBATCHES = 2
#: training steps of a mesh row by default, and the most timed repeats of a run
DEFAULT_STEPS, MAX_REPEATS = 3, 1000


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog=PROG,
        description="Validate, time and report summasim's distributed algorithms and "
                    "tensor-parallel schemes on the grids that fit the MPI world size. Run "
                    "it under mpirun, e.g. `mpirun -n 16 python -m summasim.run`.")
    ap.add_argument("--sizes", nargs=3, type=int, metavar=("M", "K", "N"),
                    help="global sizes of C[M, N] = op(A)[M, K] op(B)[K, N]: any sizes, cut "
                         "into the balanced partition of each grid "
                         f"(default {' '.join(map(str, DEFAULT_SIZES))})")
    ap.add_argument("--ring-size", type=int, default=None, metavar="N",
                    help=f"length of the ring_allreduce vector (default {DEFAULT_RING})")
    options.add_dtype(ap, ("float64", "float32", "both", "bfloat16", "float16"), "float64",
                      help_more="; bfloat16 and float16 are mixed precision (16-bit compute, "
                                "fp32 master weights and Adam; see --loss-scale, "
                                "--grad-reduce) and run the training rows only: the products, "
                                "the ring and the scheme rows run in float64 or float32")
    ap.add_argument("--backend", choices=BACKENDS, default="numpy",
                    help="array backend: numpy (CPU), cupy (GPU), or staged-host / ipc-host "
                         "(NumPy through the GPU's staged or IPC path, for testing them on a "
                         "CPU)")
    ap.add_argument("--algorithms", default="all",
                    help="comma-separated subset of: " + ", ".join(ALGORITHMS)
                         + ", or 'none' (default all)")
    ap.add_argument("--check", choices=METHODS, default="auto",
                    help="how each product block is validated: exact (float64 reference "
                         "block from the panels it needs), freivalds (randomized, 4 probes), "
                         "or auto (exact up to 4 GFLOP of reference work per rank; default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per run, at least "
                    "(a product or ring call that is short repeats up to 5x within about "
                    "0.5 s); the median span is reported (default 3; 0 validates without "
                    f"timing, for sizes where one call takes minutes; at most {MAX_REPEATS})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--threads", type=cli.int_between(1, 256), default=None,
                    help="BLAS threads per rank (default 1 when p > 1, else the library's; "
                    "at most 256)")
    ap.add_argument("--json", metavar="PATH", type=cli.report_path("run"),
                    action=cli.ReportAction, help="also write the report as JSON to PATH "
                    "(atomically), e.g. results/run.json; its folder must exist")
    cli.add_force(ap)
    options.add_machine(ap, help_more=" (default: the calibrated or fitted machine under "
                        "results/, else a quick fit)")
    ap.add_argument("--no-predict", action="store_true",
                    help="skip the cost-model predictions")
    ap.add_argument("--schemes", default="all",
                    help="tensor-parallel transformer schemes to validate: comma-separated "
                         "subset of " + ", ".join(SCHEME_NAMES) + ", or 'none' (default all)")
    options.add_model(ap, default=None, help_more=f"; the transformer and mesh sections' "
                      f"model (default {DEFAULT_MODEL}, which every scheme can shard at p = 16)")
    options.add_batch(ap, help_more=f" in the transformer and mesh sections; "
                      f"{DEFAULT_MODEL.batch} for a model without one")
    options.add_mesh(ap, repeat=True, help_more="; sharded training validated against the "
                     "serial model on --model and --batch. Without --mesh the job runs a few "
                     "default compositions that fit p")
    options.add_training(ap, zero=0, schedule="1f1b",
                         microbatches_help=f" (default {MESH_MICROBATCHES})")
    ap.add_argument("--overlap", action="store_true",
                    help="reduce each gradient bucket over dp with a non-blocking ring while "
                         "the backward runs (docs/sharded-training.md: on this kind of "
                         "machine it does not pay)")
    options.add_steps(ap, default=DEFAULT_STEPS, most=1000)
    ap.add_argument("--curves", metavar="PATH", type=cli.report_path("curves"),
                    action=cli.ReportAction, default=None,
                    help="write each mesh's loss at every step beside the serial model's "
                         "as JSON to PATH (e.g. results/curves.json) and a plot beside it "
                         "(PATH with .png); use with --steps")
    ap.add_argument("--bucket", type=cli.byte_size, default=None, metavar="BYTES",
                    help="gradient bucket of the --mesh runs (e.g. 64k; default 25 MiB, "
                         "PyTorch DDP's)")
    ap.add_argument("--meshes", choices=("default", "none"), default="default",
                    help="without --mesh: run the default compositions or none")
    ap.add_argument("--inject", metavar="KIND@RANK", default=None,
                    help="corrupt every run's output on one rank after it computes, to see the "
                         f"validator fail: KIND is one of {', '.join(KINDS)} (e.g. nan@2)")
    ap.add_argument("--self-test", action="store_true",
                    help="run every fault kind on every algorithm and scheme that fits (small "
                         "sizes, float64) and show that each one is caught")
    ap.add_argument("--fail-on-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def _names(text: str, valid, what: str) -> list[str]:
    if text == "none":
        return []
    names = list(valid) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    names = list(dict.fromkeys(names))             # a name given twice runs once
    bad = [s for s in names if s not in valid]
    if bad or (not names and text != "none"):
        raise UsageError(f"unknown {what}(s) {', '.join(bad) or '(none given)'}; choose from "
                        + ", ".join(valid))
    return names


def parse_args(argv=None):
    """Parse and check everything that needs no MPI and no files (pure). ``--help`` is
    printed by the launcher's rank 0 only (every rank parses, before MPI starts)."""
    with cli.launcher_rank0_output():
        args = build_parser().parse_args(argv)
    args.argv = None if argv is None else [str(a) for a in argv]
    args.algorithm_list = _names(args.algorithms, ALGORITHMS, "algorithm")
    args.scheme_list = _names(args.schemes, SCHEME_NAMES, "scheme")
    if not 0 <= args.repeats <= MAX_REPEATS:
        raise UsageError(f"--repeats must be 0 (validate only) to {MAX_REPEATS}, got "
                         f"{args.repeats}")
    if args.sizes and min(args.sizes) < 1:
        raise UsageError("--sizes must be positive")
    if args.ring_size is not None and args.ring_size < 1:
        raise UsageError("--ring-size must be positive")
    if args.seed < 0:
        raise UsageError("--seed must be non-negative")
    args.fault = None
    if args.inject is not None:
        try:
            args.fault = Fault.parse(args.inject)
        except ValueError as e:
            raise UsageError(str(e)) from None
    options.check_machine_used(args)
    if args.self_test and args.inject:
        raise UsageError("--self-test injects every fault itself; leave out --inject")
    if args.self_test and (args.model or args.batch or args.mesh or args.sizes
                           or args.ring_size or args.dtype != "float64"):
        raise UsageError("--self-test runs its own small sizes, model and meshes in float64; "
                         "leave out --sizes, --ring-size, --model, --batch, --mesh and "
                         "--dtype")
    if args.self_test:
        ignored = [flag for flag, given in (
            ("--json", args.json is not None), ("--curves", args.curves is not None),
            ("--steps", args.steps != DEFAULT_STEPS), ("--repeats", args.repeats != 3),
            ("--overlap", args.overlap),
            ("--bucket", args.bucket is not None)) if given]
        if ignored:
            raise UsageError(f"--self-test runs each fault with its own settings, prints "
                             f"which runs catch it and writes no report; leave out "
                             f"{', '.join(ignored)}")
    if args.json is not None and args.curves is not None:
        from .harness.curves import png_path

        same = [what for what, path in (("curves", args.curves),
                                        ("curves' plot", png_path(args.curves)))
                if os.path.realpath(path) == os.path.realpath(args.json)]
        if same:
            raise UsageError(f"--json {args.json!r} is also where the {same[0]} would be "
                             f"written, replacing the run report; give --json and --curves "
                             f"other paths")
    args.model = args.model or DEFAULT_MODEL
    args.batch_given = bool(args.batch)
    args.batch = args.batch or args.model.batch or DEFAULT_MODEL.batch
    args.mixed = args.dtype in MIXED_DTYPES
    if args.mixed:
        named = [f"--{what} {text}" for what, text, names in (
            ("algorithms", args.algorithms, args.algorithm_list),
            ("schemes", args.schemes, args.scheme_list)) if text != "all" and names]
        if named or args.self_test:
            raise UsageError(f"--dtype {args.dtype} (mixed precision) runs the training rows "
                             f"only; {' and '.join(named) or '--self-test'} run(s) in float64 "
                             f"or float32: drop it or choose another --dtype")
        args.algorithm_list, args.scheme_list = [], []
    args.dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    if args.model.hidden < 3 and (args.scheme_list or args.mesh or args.meshes == "default"):
        raise UsageError(f"--model {args.model}: a LayerNorm over {args.model.hidden} "
                         f"feature(s) outputs the same values whatever its input, so every "
                         f"gradient before it is zero but for rounding, and no training row "
                         f"could be checked against the serial model; give hidden >= 3")
    microbatches_given = args.microbatches is not None
    if not microbatches_given:
        args.microbatches = MESH_MICROBATCHES
    try:
        args.training = options.training(args, dtype=args.dtypes[0])
    except ValueError as e:
        raise UsageError(str(e)) from None
    why = unsupported(args.training, RUN_TECHNIQUES, "run --mesh")
    if why:
        raise UsageError(why)
    why = "" if args.mesh else options.without_mesh(args.training, microbatches_given,
                                                     options.given_flags(args))
    if why:
        raise UsageError(why)
    if any(ALGORITHMS[a].kind != "ring" for a in args.algorithm_list):
        why = uncatchable(args.fault, args.check, args.dtypes)
        if why:
            raise UsageError(why)
    if not args.algorithm_list and not args.scheme_list and not args.mesh \
            and args.meshes == "none":
        raise UsageError("nothing to run: no products, ring or schemes"
                         + (f" (--dtype {args.dtype} runs the training rows only)"
                            if args.mixed else "") + " and --meshes none without --mesh")
    kinds = {ALGORITHMS[a].kind for a in args.algorithm_list}
    if args.sizes and not kinds - {"ring"}:
        raise UsageError(f"--sizes {' '.join(map(str, args.sizes))} sizes the products, and "
                         f"none runs (--algorithms {args.algorithms}); leave it out or name a "
                         f"product")
    if args.ring_size is not None and "ring" not in kinds:
        raise UsageError(f"--ring-size {args.ring_size} sizes ring_allreduce, which does not "
                         f"run (--algorithms {args.algorithms}); leave it out or name it")
    args.job = None           # planned once per rank, on first use (see job())
    args.machine_loaded = None    # --machine, loaded once by rank 0's preflight
    return args


def _config(model, dtype):
    from .transformer.model import Config

    return Config.of(model, np.dtype(dtype).type)


def plan_mesh_cases(args, p: int):
    """``(cases, skips, err)`` of the sharded-training section (pure)."""
    from .harness.plan import default_meshes, plan_meshes

    if args.self_test:             # the default compositions on the default model
        if args.meshes == "none":
            return [], [], ""
        return plan_meshes(p, default_meshes(p), _config(DEFAULT_MODEL, "float64"),
                           DEFAULT_MODEL.batch, False, fit_batch=True)
    kw = {"steps": args.steps, "overlap": bool(args.overlap)}
    if args.mixed:             # 16-bit compute over float32 master weights
        t = args.training
        kw.update(precision=args.dtype, loss_scale=t.loss_scale, grad_reduce=t.grad_reduce)
    if args.bucket is not None:
        kw["bucket_bytes"] = args.bucket
    if args.mesh:
        t = args.training
        opts = dict(zero=t.zero, schedule=t.schedule, chunks=t.chunks, stages=t.stages,
                    microbatches=t.microbatches, checkpoint=t.checkpoint,
                    recompute=t.recompute, attention=t.attention,
                    sequence_parallel=t.sequence_parallel)
        specs = [(m, opts) for m in args.mesh]
    else:
        specs = default_meshes(p) if args.meshes == "default" else []
    cases, skips = [], []
    for dtype in args.dtypes:                      # --dtype both: each mesh in each
        c, s, err = plan_meshes(p, specs,
                                _config(args.model, "float32" if args.mixed else dtype),
                                args.batch, bool(args.mesh),
                                fit_batch=not args.batch_given, **kw)
        if err:
            return [], [], err
        cases += c
        skips = skips or s      # why a mesh does not fit is the same in every dtype
    return cases, skips, ""


def plan(args, p: int):
    """The product, ring and scheme cases of this job and what is skipped (pure)."""
    if args.self_test:
        cases, skips = plan_products(p, args.algorithm_list, None, SELF_TEST_RING, ["float64"])
        m, k, n = SELF_TEST_SIZES
        cases = [dataclasses.replace(c, **dict(zip("mkn", c.spec.round_up(m, k, n, c.q, c.d,
                                                                          c.pc))))
                 if c.kind == "matmul" else c for c in cases]
        tcases, tskips = plan_schemes(p, args.scheme_list,
                                      lambda dt: _config(SELF_TEST_MODEL, dt),
                                      SELF_TEST_MODEL.batch, ["float64"], fit_batch=True)
        return cases, skips, tcases, tskips
    cases, skips = plan_products(p, args.algorithm_list, args.sizes, args.ring_size,
                                 args.dtypes)
    tcases, tskips = plan_schemes(p, args.scheme_list, lambda dt: _config(args.model, dt),
                                  args.batch, args.dtypes,
                                  fit_batch=not getattr(args, "batch_given", True))
    return cases, skips, tcases, tskips


class Job:
    """Everything this run does on p ranks, planned once (pure): the product and ring
    cases, the scheme cases, the mesh cases, what is skipped and why, and a mesh error."""

    def __init__(self, args, p: int):
        self.p = p
        self.cases, self.skips, self.tcases, self.tskips = plan(args, p)
        self.mcases, self.mskips, self.mesh_error = plan_mesh_cases(args, p)


def job(args, p: int) -> Job:
    """The run's :class:`Job`, planned on first use and kept on ``args``."""
    if args.job is None or args.job.p != p:
        args.job = Job(args, p)
    return args.job


def _why(skips) -> str:
    return "; ".join(f"{s.name}{' ' + s.grid if s.grid else ''}: {s.reason}" for s in skips)


def check_curves(args, jb: Job) -> str:
    """``--curves``: a mesh row to draw, and a plot path that is free or may be
    replaced (``--force``); an error message, or ""."""
    if not args.curves:
        return ""
    import os

    from .cli import check_writable_path
    from .harness.curves import png_path

    if not jb.mcases:
        return "--curves draws the training rows' losses; no mesh runs at this p"
    try:
        check_writable_path(args.curves)
    except UsageError as e:
        return f"--curves: {e}"
    png = png_path(args.curves)
    if os.path.lexists(png) and not args.force:
        return f"--curves: the plot {png} exists; pass --force to replace it"
    return ""


def named_but_unrunnable(args, jb: Job) -> str:
    """The user error of a section the user asked for by name of which nothing can run
    at this p (pure), even when other sections run: ``--algorithms`` naming only
    algorithms that cannot run, ``--sizes`` that no product fits, ``--schemes`` naming
    only schemes that cannot run. "" when each named section runs something (a named
    algorithm that cannot run beside one that can is skipped with the reason)."""
    p, problems = jb.p, []
    products = [c for c in jb.cases if c.kind == "matmul"]
    named = [a for a in args.algorithm_list if ALGORITHMS[a].kind != "ring"]
    if args.algorithms not in ("all", "none") and args.algorithm_list and not jb.cases:
        problems.append(f"--algorithms {args.algorithms}: none can run at p = {p} "
                        f"({_why(jb.skips)})")
    elif args.sizes and named and not products:
        problems.append(f"--sizes {' '.join(map(str, args.sizes))}: no product fits them at "
                        f"p = {p} ({_why(jb.skips)})")
    if args.schemes not in ("all", "none") and args.scheme_list and not jb.tcases:
        problems.append(f"--schemes {args.schemes}: none can run at p = {p} "
                        f"({_why(jb.tskips)})")
    return "; ".join(problems)


def preflight(args, world) -> str:
    """Everything found wrong before any work, as one message ("" when all is well).
    Runs on rank 0 (reads files, probes the output path and the memory)."""
    from .backends import device_share, unavailable
    from .comm import local_ranks
    from .harness.memory import check_fits, check_node_and_gpu, check_training_fits

    p = world.Get_size()
    jb = job(args, p)
    cases, tcases, mcases = jb.cases, jb.tcases, jb.mcases
    if jb.mesh_error:
        return jb.mesh_error
    if not cases and not tcases and not mcases:
        why = "; ".join(f"{s.name}{' ' + s.grid if s.grid else ''}: {s.reason}"
                        for s in jb.skips + jb.tskips + jb.mskips) or "no run fits"
        return f"nothing would be checked at p = {p}: {why}"
    err = named_but_unrunnable(args, jb)
    if err:
        return err
    if args.fault is not None and args.fault.rank >= p:
        return f"--inject {args.inject}: rank {args.fault.rank} does not exist (p = {p})"
    if args.fail_on_rank is not None and not 0 <= args.fail_on_rank < p:
        return f"--fail-on-rank {args.fail_on_rank}: no such rank (p = {p})"
    err = check_outputs(args.json, None) or check_curves(args, jb)
    if err:
        return err
    if not args.no_predict:
        from .harness.machinefile import check_machine_spec, machine_misfit

        try:   # loaded once, here; the body hands rank 0's copy to the other ranks
            args.machine_loaded = check_machine_spec(args.machine)
        except ValueError as e:
            return str(e)                      # it names --machine and the file
        err = machine_misfit(args.machine_loaded, p)
        if err:
            return err
    why = unavailable(args.backend)
    if why:
        return why
    ranks = local_ranks()
    gpu = device_share(args.backend, ranks)       # (free bytes, ranks per GPU) or None
    for c in cases:
        why = check_node_and_gpu(
            lambda n, c=c, **kw: check_fits(c, n, args.check, p=p, **kw), ranks, gpu)
        if why:
            return why
    for c in list(tcases) + list(mcases):
        why = check_node_and_gpu(
            lambda n, c=c, **kw: check_training_fits(c, p, n, **kw), ranks, gpu)
        if why:
            return why
    return ""


def main(argv=None) -> int:
    return mpi_main(lambda: parse_args(argv), preflight, _body, prog=PROG, argv=argv)


def _body(args, world) -> int:
    from .mpiutil import heartbeat

    jb = job(args, world.Get_size())
    # a row can take minutes (one product at 17280^3): rank 0 says on stderr, every
    # HEARTBEAT_S seconds of one phase, what it is still doing
    with heartbeat(HEARTBEAT_S) if world.Get_rank() == 0 else contextlib.nullcontext():
        if args.self_test:
            return _self_test(args, world, jb.cases, list(jb.tcases) + jb.mcases,
                              jb.skips + jb.tskips + jb.mskips)
        return _main(args, world, jb)


def _banner(args, world, backend, say):
    from .comm import default_wait_policy
    from .mpiutil import blas_threads, mpi_library

    why = getattr(backend, "comm_mode_reason", "")
    threads, libs = blas_threads()
    # the thread count sets the GEMM rate: an inherited OPENBLAS_NUM_THREADS at p = 1
    # changes both the time and the prediction's error, so it is said
    say(f"summasim.run: p = {world.Get_size()} ranks, backend {backend.name} (MPI path: "
        f"{backend.comm_mode}{': ' + why if why else ''}), wait policy "
        f"{default_wait_policy()}, BLAS ({'/'.join(libs) or 'none'}) {threads} "
        f"thread{'s' if threads != 1 else ''} per rank, {mpi_library()}")


def _predict(res, machine):
    if machine is None or not res.timing:
        return None
    from summasim.costmodel.tools.accuracy import predict_result

    return predict_result(res.measured(), machine)


def _main(args, world, jb: Job) -> int:
    from .backends import get_backend
    from .harness.execute import run_case
    from .harness.report import (format_header, format_prediction_summary, format_row,
                                 format_transformer, mesh_record, prediction_summary,
                                 row_record, transformer_record)
    from .mpiutil import doing, limit_blas_threads

    t_start = time.perf_counter()
    cases, skips, tcases, tskips, mskips = jb.cases, jb.skips, jb.tcases, jb.tskips, jb.mskips
    p, rank = world.Get_size(), world.Get_rank()
    _threads = limit_blas_threads(args.threads)  # noqa: F841 - keep the limit alive
    backend = get_backend(args.backend)
    say = print if rank == 0 else (lambda *a, **k: None)
    _banner(args, world, backend, say)
    say("error = max |C - C_ref| / (|A||B|) per entry; bound = 8 sqrt(k) (u + u_64) "
        "(summasim.validate); inputs and checks are rank-local (summasim.harness)")
    if args.fault is not None:
        say(f"fault injection: {args.fault} (every run it corrupts should FAIL)")
    machine = None
    if not args.no_predict and backend.on_device:
        say(f"backend {backend.name}: no predictions: the machine models price host arrays "
            f"(this node's fit and the presets), not device arrays staged through the host")
    elif not args.no_predict:
        from .harness.machinefile import resolve_machine

        machine = resolve_machine(args.machine, world, say, loaded=args.machine_loaded)
    say("")
    from .harness.load import LoadWatch, warning
    # other processes' load, per row and in all; none to report when nothing was timed
    watch = LoadWatch(world, timed=args.repeats > 0)
    rows, pairs, untouched = [], [], []      # untouched: runs the fault found nothing in
    if cases:
        say(format_header(), flush=True)
    missed = []                               # runs the fault corrupted that still passed
    for case in cases:
        doing(f"running {case.label(p)} {case.dtype}")
        if args.fail_on_rank is not None and rank == args.fail_on_rank:
            raise RuntimeError(f"deliberate failure on rank {rank} (--fail-on-rank)")
        res = run_case(case, world, backend, repeats=args.repeats, seed=args.seed,
                       method=check_method(args.fault, args.check, case.dtype),
                       fault=args.fault, timed=args.repeats > 0)
        if args.fault is not None and res.fault_applied and res.ok:
            missed.append(f"{case.label(p)} {case.dtype}")
        pred = _predict(res, machine) if rank == 0 else None
        rows.append(row_record(res, pred, load=watch.lap()))
        if not res.fault_applied:
            untouched.append(f"{case.label(p)} {case.dtype}")
        if pred is not None:
            pairs.append((pred, res.seconds, f"{case.label(p)} {case.dtype}"))
        say(format_row(res, pred, rows[-1]["load"]), flush=True)
    if skips:
        say("\nskipped:")
        for s in skips:
            say(f"  {s.name}{' ' + s.grid if s.grid else ''}: {s.reason}")
    reports = []
    if tcases:
        c0 = tcases[0].config
        say(f"\ntransformer: b={args.batch} s={c0.seq} h={c0.hidden} heads={c0.heads} "
            f"vocab={c0.vocab} layers={c0.layers} ffn={c0.ffn_mult}h, vs the serial model; "
            f"errors are max|par - ser| / max|ser| over loss, logits and every gradient "
            f"(plain and checkpointed); traffic is layer 0's Table 1 payload per rank in "
            f"scalars")
        raised = sorted({f"{c.scheme} {c.grid_label(p)} b={c.batch}" for c in tcases
                         if c.batch != args.batch})
        if raised:
            say(f"  ({', '.join(raised)}: the next batch that cuts into whole sequences per "
                f"rank; --batch sets one batch for every scheme)")
        say("")
        for case in tcases:
            doing(f"running {case.label(p)} {case.dtype}")
            res = run_case(case, world, backend, repeats=args.repeats, seed=args.seed,
                           fault=args.fault, timed=args.repeats > 0)
            rep = res.extra["report"]
            rep.load = watch.lap()
            if not res.fault_applied:
                untouched.append(f"{rep.scheme} {rep.grid} {rep.dtype}")
            if rank == 0:
                rep.predicted_s = _predict(res, machine)
                if rep.predicted_s is not None:
                    pairs.append((rep.predicted_s, rep.fwd_s + rep.bwd_s,
                                  f"{rep.scheme} {rep.grid} {rep.dtype} fwd+bwd"))
            reports.append(rep)
        say(format_transformer(reports))
    for s in tskips:
        say(f"  skipped {s.name}{' ' + s.grid if s.grid else ''}: {s.reason}")
    meshes = _meshes(jb.mcases, args, world, backend, machine, say, pairs, untouched, watch)
    for s in mskips:
        say(f"  skipped mesh {s.name}: {s.reason}")
    reports_all = reports + meshes
    doing("reporting")
    if args.fault is not None:
        missed += [f"{r.scheme} {r.grid} {r.dtype}" if hasattr(r, "scheme") else
                   f"{r.mesh} {r.dtype}" for r in reports_all if r.fault_applied and r.ok]
    ok = all(r["ok"] for r in rows) and all(r.ok for r in reports_all) and not missed
    load = watch.stop()
    summary = prediction_summary(pairs, load)
    if summary:
        say("\n" + format_prediction_summary(summary, machine.name))
    elif warning(load, "this job was timed"):
        say("\n" + warning(load, "this job was timed"))
    elapsed = time.perf_counter() - t_start
    passed = sum(r["ok"] for r in rows) + sum(r.ok for r in reports_all)
    failed = len(rows) + len(reports_all) - passed
    say(f"\n{passed} passed, {failed} failed, {len(skips) + len(tskips) + len(mskips)} skipped in "
        f"{elapsed:.1f} s")
    runs = len(rows) + len(reports_all)
    if args.fault is not None:
        say(f"fault {args.fault} corrupted {runs - len(untouched)} of {runs} runs"
            + (f"; rank {args.fault.rank} had nothing to corrupt in: {', '.join(untouched)} "
               f"(their verdicts are those of the uncorrupted runs)" if untouched else "")
            + (f"; it was NOT caught in: {', '.join(missed)} (the job fails)" if missed
               else ""))
    if args.json and rank == 0:
        from .comm import default_wait_policy
        from .jsonio import write_report
        from .mpiutil import blas_threads

        written = write_report(args.json, "run", {
            "command": [PROG, *(sys.argv[1:] if args.argv is None else args.argv)],
            "seed": args.seed, "repeats": args.repeats, "check": args.check,
            "world_size": p, "backend": backend.name, "comm_mode": backend.comm_mode,
            "wait_policy": default_wait_policy(), "blas_threads": blas_threads()[0],
            "ok": ok, "elapsed_s": elapsed,
            "fault": str(args.fault) if args.fault else None,
            "fault_not_applied": untouched, "fault_missed": missed,
            "machine": machine.name if machine else None, "prediction": summary,
            "load": load,
            "rows": rows,
            "skipped": [{"algorithm": s.name, "grid": s.grid, "reason": s.reason}
                        for s in skips],
            "transformer": [transformer_record(r) for r in reports],
            "transformer_skipped": [{"scheme": s.name, "grid": s.grid, "reason": s.reason}
                                    for s in tskips],
            "meshes": [mesh_record(r) for r in meshes],
            "meshes_skipped": [{"mesh": s.name, "reason": s.reason} for s in mskips]},
            prog=PROG)
        ok &= written
        if written:
            say(f"report written to {args.json}")
    if args.curves and rank == 0:
        from .harness.curves import write_curves

        c0 = jb.mcases[0].config
        written, png = write_curves(meshes, args.curves, prog=PROG, title=(
            f"{c0.layers} layers, h={c0.hidden}, batch {jb.mcases[0].batch}: each mesh's "
            f"loss per Adam step beside the serial model's"))
        ok &= written is not None
        if written:
            say(f"loss curves written to {written}" + (f" and {png}" if png else
                                                        " (no plot: matplotlib is missing)"))
    if args.fault is not None and runs and len(untouched) == runs and ok:
        # (a run that failed anyway is a failure, exit 1, not this user error)
        return cli.print_error(PROG, f"--inject {args.fault}: rank {args.fault.rank} had "
                                     f"nothing to corrupt in any run (an empty block, or no "
                                     f"sum to drop); no fault was shown to be caught")
    return 0 if ok and passed > 0 else 1


def _meshes(mcases, args, world, backend, machine, say, pairs, untouched, watch) -> list:
    """The sharded-training section: one validated, timed row per mesh, marked BUSY when
    other processes' load (``watch``, a :class:`~summasim.harness.load.LoadWatch`) was
    high while it ran."""
    from .harness.composed import run_mesh
    from .harness.report import format_mesh_header, format_mesh_row
    from .mpiutil import doing

    if not mcases:
        return []
    c0 = mcases[0].config
    batches = sorted({c.batch for c in mcases})
    b_text = (f"b={batches[0]} (global)" if len(batches) == 1 else
              f"b={' or '.join(map(str, batches))} (global; a default mesh that cannot cut "
              f"the model's batch runs the next it can)")
    variant = "".join(f" {k}={v}" for k, v in c0.variant().items())
    say(f"\nsharded training: {b_text} s={c0.seq} h={c0.hidden} "
        f"heads={c0.heads} vocab={c0.vocab} layers={c0.layers}{variant}, {mcases[0].steps} "
        f"Adam steps "
        f"vs the serial model (float64) on the whole batch, each step from its state; loss "
        f"and grad err are max|par - ser| / max|ser| against the derived bound, param/bnd the "
        f"worst parameter's error over its elementwise bound through Adam; traffic is "
        f"the largest per-rank bytes of the step's data/pipeline/ZeRO phases against the "
        f"closed form, state the largest per-rank model state against the ZeRO formula\n")
    if any(c.precision == "float16" and c.loss_scale == "none" for c in mcases):
        say("note: float16 without a loss scale: gradients below 6e-5 lose bits and below "
            "6e-8 vanish (Micikevicius et al. 2018, section 3.2), which the bound, of "
            "relative rounding, does not cover; such a row can fail for that alone, as the "
            "training itself would drift (--loss-scale dynamic or static:S avoids it)\n")
    out = []
    width = max(len(" ".join([c.spec] + ([f"stages={c.stages_label}"] if c.stages_label
                                           else []) + list(c.techniques)
                             + (["overlap"] if c.overlap else []))) for c in mcases)
    say(format_mesh_header(width), flush=True)
    for case in mcases:
        doing(f"running the mesh {case.spec} {case.dtype}")
        res = run_mesh(case, world, backend, repeats=args.repeats, seed=args.seed,
                       timed=args.repeats > 0, fault=args.fault)
        rep = res.extra["report"]
        rep.load = watch.lap()
        if not res.fault_applied:
            untouched.append(f"{case.spec} {case.dtype}")
        if world.Get_rank() == 0 and machine is not None and rep.step_s:
            rep.predicted_s = _predict_mesh(res, machine)
            if rep.predicted_s is not None:
                pairs.append((rep.predicted_s, rep.step_s, f"{case.spec} step"))
        out.append(rep)
        say(format_mesh_row(rep, width), flush=True)
    return out


def _predict_mesh(res, machine):
    """The cost model's time of a measured mesh step: its traced events and its stage's
    compute priced on ``machine`` (:func:`summasim.costmodel.workload.measured.predict_measured_mesh`)."""
    from summasim.costmodel.workload.measured import predict_measured_mesh

    return predict_measured_mesh(res.measured(), machine)


def _self_test(args, world, cases, tcases, skips) -> int:
    """Every fault kind on every case: the clean run must pass, every fault must fail."""
    from .backends import get_backend
    from .harness.execute import run_case
    from .mpiutil import doing, limit_blas_threads

    p, rank = world.Get_size(), world.Get_rank()
    _threads = limit_blas_threads(args.threads)  # noqa: F841
    backend = get_backend(args.backend)
    say = print if rank == 0 else (lambda *a, **k: None)
    target = p - 1
    _banner(args, world, backend, say)
    say(f"self-test: each fault is injected on rank {target} after the run computes; "
        f"'caught' means the collective verdict was FAIL (float64, small sizes)\n")
    cols = ("clean",) + KINDS
    every = list(cases) + list(tcases)
    width = max([46] + [len(c.label(p) + " " + c.dtype) for c in every])
    head = f"{'run':<{width}s}  " + "  ".join(f"{c:<8s}" for c in cols)
    say(head)
    say("-" * len(head))
    good = True
    for case in every:
        doing(f"self-testing {case.label(p)} {case.dtype}")
        cells = []
        for kind in cols:
            fault = None if kind == "clean" else Fault(kind, target)
            kw = {"timed": False}
            if case.kind == "transformer":
                kw["with_memory"] = False
            elif case.kind == "matmul":
                kw["method"] = args.check
            res = run_case(case, world, backend, seed=args.seed, fault=fault, **kw)
            applied = res.fault_applied
            if kind == "clean":
                cell = "OK" if res.ok else "FAIL"
                good &= res.ok
            elif not applied:
                cell = "n/a"
            else:
                cell = "caught" if not res.ok else "MISSED"
                good &= not res.ok
            cells.append(cell)
        say(f"{case.label(p) + ' ' + case.dtype:<{width}s}  "
            + "  ".join(f"{c:<8s}" for c in cells), flush=True)
    for s in skips:
        say(f"  skipped {s.name}{' ' + s.grid if s.grid else ''}: {s.reason}")
    say(f"\nself-test {'passed' if good else 'FAILED'}: every clean run "
        f"{'passed' if good else 'should pass'} and every applicable fault "
        f"{'was caught' if good else 'should be caught'} "
        f"({len(cases) + len(tcases)} runs x {len(cols)} variants)")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
