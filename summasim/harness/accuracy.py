"""The cost model's accuracy benchmark, measuring side: fit the links, run the
calibration and held-out cases under MPI with the harness's worker, then hand the
measurements to the cost model's pure analysis (:mod:`summasim.costmodel.tools.accuracy`).

    python -m summasim.costmodel accuracy                  # fit, calibrate, predict, report
    python -m summasim.costmodel accuracy --machine results/machine.json   # skip the fit
    python -m summasim.costmodel accuracy --from           # re-analyse results/accuracy/

Every case is validated (rank-local checks) before it is timed; a case that fails
its validation stops the benchmark. Every mpiexec runs under ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time

from .. import options
from ..cli import finite_positive_float, positive_int
from summasim.costmodel.tools.accuracy import STATISTICS, analyse, report_text
from summasim.costmodel.workload.measured import MeasuredRun
from ..jsonio import write_json_atomic
from .cases import MatmulCase, MeshCase, RingCase, transformer_case
from .load import wait_for_quiet
from .worker import (JobInterrupted, catch_signals, launch, mpiexec, restore_signals,
                     run_job, timeout_prefix, worker_env)


# --------------------------------------------------------------------------- the plan
def default_plan(quick: bool = False) -> dict:
    """The runs: ``calibrate`` (p = 1 serial steps, p = 3 and 4 runs, and ring
    all-reduces at p = 8, fitted on) and ``heldout`` (p = 8, 9, 16: process counts and
    sizes the fit never saw, no ring at p = 8), each ``{p: [case, ...]}``. The p = 8
    rings put four ranks on each of this machine's two cores, where ring steps of
    256 KiB and more nap (``Comm.exchanger``) and a ring's 2(p - 1) steps outnumber
    the p <= 4 runs' four to six: without them the fit cannot tell the price of a
    ring step from the per-call sync term, which is the same for every p. Ranking uses
    every group of candidates that solve the same problem on the same p (p = 4 and 16). ``calibrate_polled``: small ring all-reduces
    at p = 3 and 4 run with ``SUMMASIM_BLOCKING_BYTES=0``, so that their steps sleep
    between polls (the wait policy): ring steps normally wait without sleeping
    (``Comm.exchanger``), so the calibration then sees both kinds of wait on the same
    messages and fits both coefficients (``SharedCore.hop_seconds`` and
    ``mpi_hop_seconds``). When ``SUMMASIM_BLOCKING_BYTES=0`` is set for the whole
    benchmark they would repeat runs of ``calibrate`` and weigh small rings twice in
    the fit, so they are skipped."""
    tf = transformer_case
    mm = MatmulCase
    f = 2 if quick else 1
    cal = {
        1: [tf("megatron", 1, 1, 4, 64, 256, 8, 512, 2), tf("megatron", 1, 1, 8, 128, 256, 8, 512, 1),
            tf("megatron", 1, 1, 4, 64, 512, 8, 1024, 1)],
        3: [mm("summa25_ab", 1, 3, 768, 768, 768), mm("summa25_ab", 1, 3, 1536 // f, 1536 // f, 1536 // f),
            RingCase(1 << 12), RingCase(1 << 17), RingCase(1 << 21),
            tf("summa25", 1, 3, 6, 64, 256, 8, 512, 2)],
        4: [mm("cannon_ab", 2, 1, 512, 512, 512), mm("summa_ab", 2, 1, 1536 // f, 1536 // f, 1536 // f),
            mm("cannon_ab", 2, 1, 1536 // f, 1536 // f, 1536 // f),
            mm("summa25_ab", 1, 4, 1536 // f, 1536 // f, 1536 // f),
            mm("summa_abt", 2, 1, 1024, 1024, 1024), mm("summa_atb", 2, 1, 1024, 1024, 1024),
            RingCase(1 << 12), RingCase(1 << 17), RingCase(1 << 21),
            tf("megatron", 1, 1, 8, 64, 256, 8, 512, 2), tf("optimus", 2, 1, 8, 64, 256, 8, 512, 2),
            tf("summa25", 1, 4, 8, 64, 256, 8, 512, 2)],
        8: [RingCase(1 << 15), RingCase(1 << 18), RingCase(1 << 21)],
    }
    held = {
        8: [mm("summa25_ab", 2, 2, 1024, 1024, 1024), mm("summa25_abt", 2, 2, 2048 // f, 2048 // f, 2048 // f),
            tf("megatron", 1, 1, 8, 64, 256, 8, 512, 2), tf("summa25", 2, 2, 8, 64, 256, 8, 512, 2)],
        9: [mm("cannon_ab", 3, 1, 1152, 1152, 1152), mm("summa_ab", 3, 1, 2304 // f, 2304 // f, 2304 // f),
            mm("summa_atb", 3, 1, 1152, 1152, 1152), RingCase(3 << 18),
            tf("optimus", 3, 1, 6, 48, 288, 6, 576, 2)],
        16: [mm(a, *g, n, n, n) for n in ((1024, 2048) if quick else (1024, 2048, 3072))
             for a, g in (("cannon_ab", (4, 1)), ("summa_ab", (4, 1)), ("summa25_ab", (2, 4)))]
            + [mm("summa_abt", 4, 1, 2048, 2048, 2048), mm("summa_atb", 4, 1, 2048, 2048, 2048),
               RingCase(1 << 16), RingCase(1 << 20), RingCase(1 << 22)]
            + [tf(s, q, d, 16, 64, 256, 16, 512, 2) for s, q, d in
               (("megatron", 1, 1), ("optimus", 4, 1), ("summa25", 2, 4))]
            + [tf(s, q, d, 16, 128, 512, 16, 1024, 1) for s, q, d in
               (("megatron", 1, 1), ("optimus", 4, 1), ("summa25", 2, 4))],
    }
    # sharded-training steps (held out: never fitted on) on the models of the schemes
    # above; the meshes of one p form a ranking group of their own
    held[8] += _meshes(8, 64, 256, 8, 512, 2, ("dp=2,pp=2,tp=megatron:2", 3, "1f1b", 2),
                       ("pp=2,tp=optimus:2x2", 0, "gpipe", 2))
    held[16] += _meshes(16, 64, 256, 16, 512, 2, ("dp=2,pp=2,tp=optimus:2x2", 1, "1f1b", 2),
                        ("dp=2,pp=2,tp=megatron:4", 0, "gpipe", 2),
                        ("dp=4,pp=1,tp=megatron:4", 2, "1f1b", 1))
    polled = {p: [RingCase(1 << 12), RingCase(1 << 17)] for p in (3, 4)}
    return {"calibrate": cal, "heldout": held, "calibrate_polled": polled}


def _meshes(b, s, h, heads, v, layers, *specs) -> list:
    """Mesh cases of one model: ``(mesh, zero, schedule, microbatches)`` each."""
    from ..transformer.model import Config

    config = Config(vocab=v, seq=s, hidden=h, heads=heads, layers=layers)
    return [MeshCase.parse(text, b, config, zero=z, schedule=sch, microbatches=m)
            for text, z, sch, m in specs]


@contextlib.contextmanager
def _environ(**values):
    """Set environment variables for the jobs launched inside the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fit_machine(path: str, timeout: float, say) -> None:
    env = worker_env()
    cmd = timeout_prefix(timeout) + mpiexec() + [
        "-n", "2", sys.executable, "-m", "summasim.costmodel", "fit", "--out", path]
    say(f"$ {' '.join(cmd[4:])}")
    if run_job(cmd, env=env) != 0:
        raise RuntimeError("the machine fit failed")



def build_parser(ap):
    """Arguments of ``python -m summasim.costmodel accuracy``."""
    options.add_machine(ap, help_more=" (default: fit one at p = 2 first)")
    ap.add_argument("--out", default=os.path.join("results", "accuracy"),
                    help="folder for the measurements, machines and report (default %(default)s)")
    ap.add_argument("--from", dest="reuse", action="store_true",
                    help="re-analyse the measurements already in --out (no MPI)")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timed calls per case")
    ap.add_argument("--quick", action="store_true", help="smaller problems (a few minutes less)")
    ap.add_argument("--statistic", choices=STATISTICS, default="median",
                    help="which repeat statistic is the measured time (default %(default)s; "
                         "the report also summarizes the other)")
    ap.add_argument("--timeout", type=finite_positive_float, default=900,
                    help="seconds per mpiexec")
    return ap


def _read_measured(path: str) -> dict:
    """``measured.json`` of an earlier run: ``{"calibrate": [MeasuredRun, ...], "heldout":
    [...]}``; a UsageError or ValueError naming the file and what is wrong in it."""
    from ..cli import read_json_file

    data = read_json_file(path)
    missing = [part for part in ("calibrate", "heldout") if part not in data]
    if missing:
        raise ValueError(f"{path}: has no {' and no '.join(missing)} runs (not a "
                         f"measured.json of `accuracy`)")
    out = {}
    for part, runs in data.items():
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise ValueError(f"{path}: {part!r} must be a list of measured runs")
        try:
            out[part] = [MeasuredRun.from_dict(r) for r in runs]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {part}: {e}") from None
        failed = [r.extra.get("label", f"#{i}") for i, r in enumerate(out[part])
                  if r.extra.get("ok", True) is not True]
        if failed:           # the live run stops there too (worker.launch)
            raise ValueError(f"{path}: {part}: run(s) {', '.join(map(str, failed))} failed "
                             f"their validation; a wrong run's time measures nothing")
    if not out.get("heldout"):
        raise ValueError(f"{path}: no held-out runs: nothing to measure the model on")
    return out


def run(args) -> int:
    """The accuracy benchmark (see the module doc). SIGINT or SIGTERM while a job runs
    ends that job, every process of it (:func:`~summasim.harness.worker.run_job`), and
    the benchmark, with one line; its temporary folder goes too."""
    def terminated(signum):
        raise JobInterrupted(signum)     # between jobs: said as during one

    old = catch_signals((signal.SIGTERM, signal.SIGHUP), terminated)
    try:
        return _run(args)
    except (JobInterrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        with contextlib.suppress(OSError, ValueError):      # a terminal gone: no stderr
            print(f"python -m summasim.costmodel accuracy: interrupted "
                  f"({signal.Signals(signum).name}); no MPI job of it is left running",
                  file=sys.stderr, flush=True)
        return 128 + int(signum)
    finally:
        restore_signals(old)


def _run(args) -> int:
    from ..costmodel.machine import Machine

    def say(msg):
        print(msg, flush=True)

    from ..cli import UsageError, check_writable_dir
    from .machinefile import check_machine_spec
    from .worker import check_launcher

    mfile = os.path.join(args.out, "machine-fit.json")
    mpath = os.path.join(args.out, "measured.json")
    if args.reuse and not os.path.exists(mpath):      # before --out is made
        print(f"python -m summasim.costmodel accuracy: error: --from needs {mpath} from an "
              f"earlier run (run without --from "
              f"first, or give its --out)", file=sys.stderr)
        return 2
    try:                                # every argument and file, before any work
        check_writable_dir(args.out)
        given = check_machine_spec(args.machine)     # --machine FILE|PRESET, loaded once
        if given is not None and (given.library != "mpich" or given.device is not None):
            raise UsageError(f"--machine {args.machine}: accuracy prices MPI runs on this "
                             f"machine's CPUs, and {given.name} is a {given.library} "
                             f"machine{' of ' + given.device.name if given.device else ''}; "
                             f"give this machine's fit (costmodel fit) or leave --machine "
                             f"out")
        if not args.reuse:
            check_launcher()
    except (UsageError, ValueError) as e:
        print(f"python -m summasim.costmodel accuracy: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.reuse:
        try:
            measured = _read_measured(mpath)
            machine = given or Machine.load(mfile)
        except (UsageError, ValueError) as e:
            print(f"python -m summasim.costmodel accuracy: error: --from: {e}", file=sys.stderr)
            return 2
    else:
        os.makedirs(args.out, exist_ok=True)
        if given is not None:
            machine = given
            machine.save(mfile)
        else:
            say("[accuracy] 1/3 fitting the machine at p=2 (no oversubscription)")
            try:
                _fit_machine(mfile, args.timeout, say)
            except RuntimeError as e:
                print(f"[accuracy] stopped: {e}", file=sys.stderr)
                return 1
            machine = Machine.load(mfile)
        plan = default_plan(args.quick)
        measured = {"calibrate": [], "heldout": []}
        # comm.BLOCKING_SENDRECV_BYTES, read without importing mpi4py into the launcher
        if os.environ.get("SUMMASIM_BLOCKING_BYTES", "").strip() == "0":
            plan["calibrate_polled"] = {}      # every ring step sleeps already
        with tempfile.TemporaryDirectory(dir=args.out) as work:
            for part, step, env in (
                    ("calibrate", "2/3 calibration runs", {}),
                    ("calibrate_polled", "2/3 calibration runs, polled ring steps",
                     {"SUMMASIM_BLOCKING_BYTES": "0"}),
                    ("heldout", "3/3 held-out runs", {})):
                for p, cases in plan[part].items():
                    wait_for_quiet(say=say)
                    say(f"[accuracy] {step}: p={p}, {len(cases)} cases")
                    try:
                        with _environ(**env):
                            measured[part.split("_")[0]] += launch(
                                p, cases, args.repeats, work, timeout=args.timeout, say=say)
                    except RuntimeError as e:
                        print(f"[accuracy] stopped: {e}", file=sys.stderr)
                        return 1
        write_json_atomic(mpath, {part: [r.to_dict() for r in runs]
                                  for part, runs in measured.items()})
    try:
        rep, calibrated = analyse(measured, machine, args.statistic)
    except ValueError as e:          # measurements that price to nothing (empty spans...)
        print(f"python -m summasim.costmodel accuracy: error: {mpath}: {e}", file=sys.stderr)
        return 2 if args.reuse else 1    # a file given with --from, or this run's own
    calibrated.replace(notes={**calibrated.notes, "accuracy": {
        k: rep[k]["summary"] for k in ("calibrate", "heldout")}}).save(
        os.path.join(args.out, "machine-calibrated.json"))
    rep["seconds"] = round(time.time() - t0, 1)
    write_json_atomic(os.path.join(args.out, "report.json"), rep)
    say("")
    say(report_text(rep))
    say(f"\n[accuracy] wrote {args.out}/report.json, measured.json, machine-calibrated.json "
        f"({rep['seconds']:.0f} s)")
    return 0
