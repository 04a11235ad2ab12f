"""The MPI worker and its launcher.

``python -m summasim.harness.worker SPEC OUT`` runs the cases of a spec file
(``{"repeats": R, "seed": S, "check": "auto", "cases": [case dict, ...]}``) under MPI
with the harness's executors (validated, then timed) and rank 0 writes the results
(each ``Result.measured()`` record's ``to_dict()`` plus the run's verdict) to OUT,
atomically. :func:`launch` starts it under ``timeout`` and ``mpiexec`` and reads OUT
back as :class:`~summasim.costmodel.workload.measured.MeasuredRun` records.

The launcher is ``$SUMMASIM_MPIEXEC`` (default: the ``mpiexec`` beside the Python
interpreter, else the one on PATH; e.g. ``srun``) with ``$SUMMASIM_MPIEXEC_FLAGS``.
"""

from __future__ import annotations

from .. import cli

if __name__ == "__main__":        # a Ctrl-C while the modules below load: no traceback
    cli.quiet_interrupts()

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

from summasim.costmodel.workload.measured import MeasuredRun

from ..jsonio import write_json_atomic


def mpiexec() -> list[str]:
    """The launcher command (see the module doc): ``$SUMMASIM_MPIEXEC`` and
    ``$SUMMASIM_MPIEXEC_FLAGS`` split as a shell splits them (``shlex``), the one way the
    tests, ``costmodel accuracy`` and ``scripts/run`` all use. A
    :class:`~summasim.cli.UsageError` when their quotes do not close."""
    import shlex

    from ..cli import UsageError

    exe = os.environ.get("SUMMASIM_MPIEXEC", "")
    if exe and not exe.strip():
        raise UsageError("SUMMASIM_MPIEXEC is blank: name a launcher, or unset it for the "
                         "mpiexec beside this Python")
    if not exe:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        exe = shlex.quote(beside) if os.path.exists(beside) else "mpiexec"
    try:
        return shlex.split(exe) + shlex.split(os.environ.get("SUMMASIM_MPIEXEC_FLAGS", ""))
    except ValueError as exc:
        raise UsageError(f"SUMMASIM_MPIEXEC={os.environ.get('SUMMASIM_MPIEXEC', '')!r} "
                         f"SUMMASIM_MPIEXEC_FLAGS="
                         f"{os.environ.get('SUMMASIM_MPIEXEC_FLAGS', '')!r}: {exc}") from None


def check_launcher() -> None:
    """A :class:`~summasim.cli.UsageError` naming ``SUMMASIM_MPIEXEC`` when the launcher
    of :func:`mpiexec` cannot be found (checked before any work, so that a missing
    launcher is the user's one-line error, not a failed job)."""
    import shutil

    from ..cli import UsageError

    cmd = mpiexec()
    if not cmd or shutil.which(cmd[0]) is None:
        raise UsageError(f"no MPI launcher {cmd[0] if cmd else ''!r} (SUMMASIM_MPIEXEC, "
                         f"default: the mpiexec beside this Python or on PATH)")


def timeout_prefix(seconds: float) -> list[str]:
    """``timeout -k 10 S`` for a job of at most ``seconds``: S whole seconds, rounded
    up and at least 1 (GNU timeout takes 0 as no limit at all)."""
    return ["timeout", "-k", "10", str(max(1, math.ceil(seconds)))]


class JobInterrupted(Exception):
    """This process got one of :data:`JOB_SIGNALS` while a launched job ran;
    :func:`run_job` has ended the job (every process of it) before raising. ``signum``
    is the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Stop(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


# seconds the job's processes get to end on SIGTERM before they are killed
JOB_GRACE_S = 10.0


def _end_job(proc: subprocess.Popen) -> None:
    """End a job started by :func:`run_job` and every process of it. ``timeout`` goes
    first, by SIGKILL: on a signal it would relay it to its group, and a second SIGINT or
    SIGTERM makes MPICH's launcher abort by force (its assertion messages, and the ranks
    killed before they free their shared memory). Then the rest of the group (the
    launcher, its proxies, the ranks) gets one SIGTERM: each rank says one line
    (:func:`summasim.mpiutil.end_on_signals`) and ends; what is left after
    :data:`JOB_GRACE_S` is killed."""
    group = proc.pid                      # its own session: the group's id is its pid
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
    try:
        os.killpg(group, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + JOB_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


#: what ends a launched job with its caller: Ctrl-C, a scheduler's SIGTERM, a terminal
#: that closes (the job has a session of its own, so the hangup reaches the caller only)
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def catch_signals(signals, on_signal) -> dict:
    """Install a one-shot handler for each of ``signals`` that is not ignored (a signal
    the caller's parent ignored, as for ``cmd &`` in a script, stays ignored): the first
    signal calls ``on_signal(signum)`` (which may raise); any later one is dropped, so
    that it cannot cut the clean-up short. Returns the old handlers, for
    :func:`restore_signals`. Main thread only (elsewhere: nothing, ``{}``)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    fired = []

    def handler(signum, _frame):
        if not fired:
            fired.append(signum)
            on_signal(signum)

    old = {}
    for sig in signals:
        previous = signal.getsignal(sig)
        if previous is not signal.SIG_IGN:
            old[sig] = previous
            signal.signal(sig, handler)
    return old


def restore_signals(old: dict) -> None:
    for sig, previous in old.items():     # None: a handler set from C, not restorable
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def run_job(cmd: list[str], env: dict | None = None) -> int:
    """Run a launched job (``timeout ... mpiexec ...``) to its end; its exit status.

    The job gets a session of its own, so a Ctrl-C at the terminal reaches this process
    only, and SIGINT, SIGTERM or SIGHUP here ends the whole job (:func:`_end_job`) and
    raises :class:`JobInterrupted`: no launcher or rank is left running, unbounded, after
    its caller is gone (``subprocess.run`` would kill ``timeout`` alone and orphan the
    rest). A signal that lands while the job is being started ends it once it exists."""
    state = {"proc": None, "sig": None}

    def on_signal(signum):
        state["sig"] = signum
        if state["proc"] is not None:
            raise _Stop(signum)

    old = catch_signals(JOB_SIGNALS, on_signal)
    try:
        try:
            state["proc"] = subprocess.Popen(cmd, env=env, start_new_session=True)
            if state["sig"] is not None:          # it came while Popen ran
                raise _Stop(state["sig"])
            return state["proc"].wait()
        except _Stop as stop_:
            _end_job(state["proc"])
            raise JobInterrupted(stop_.signum) from None
    finally:
        restore_signals(old)


def worker_env() -> dict:
    """The environment of a launched job: one BLAS thread per rank."""
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")


def launch(p: int, cases: Sequence, repeats: int, workdir: str, *, timeout: float,
           seed: int = 0, check: str = "auto", say=print) -> list[MeasuredRun]:
    """Run typed ``cases`` under ``mpiexec -n p`` (bounded by ``timeout`` seconds);
    return their measured records (the worker's verdict, ``ok``, ``error``, ``label``
    and ``load``, kept in each record's ``extra``). Raises ``RuntimeError`` when the job
    fails, times out, or any case fails its validation."""
    spec = os.path.join(workdir, f"spec-p{p}.json")
    out = os.path.join(workdir, f"measured-p{p}.json")
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"repeats": repeats, "seed": seed, "check": check,
                   "cases": [c.to_dict() for c in cases]}, fh)
    cmd = timeout_prefix(timeout) + mpiexec() + [
        "-n", str(p), sys.executable, "-m", "summasim.harness.worker", spec, out]
    say(f"$ {' '.join(cmd[4:])}")
    status = run_job(cmd, env=worker_env())
    if status != 0:
        raise RuntimeError(f"the worker at p={p} failed (exit {status}"
                           f"{', timed out' if status in (124, 137) else ''})")
    with open(out, encoding="utf-8") as fh:
        data = json.load(fh)
    bad = [r["label"] for r in data["results"] if not r.get("ok", False)]
    if bad:
        raise RuntimeError(f"validation failed at p={p}: {', '.join(bad)}")
    return [MeasuredRun.from_dict(dict(r, p=data["p"])) for r in data["results"]]


def check_worker_files(spec_path: str, out_path: str | None) -> dict:
    """The spec (a JSON object whose ``cases`` is a non-empty list), read safely, and
    (unless ``out_path`` is None) an output path that is free or holds an earlier
    worker's results; a :class:`summasim.cli.UsageError` otherwise."""
    from ..cli import UsageError, read_json_file

    spec = read_json_file(spec_path)
    if not isinstance(spec.get("cases"), list) or not spec["cases"]:
        raise UsageError(f"{spec_path}: a worker spec lists its cases (a non-empty list "
                         f"under \"cases\"); nothing to run")
    if out_path is not None and os.path.lexists(out_path):
        try:
            old = read_json_file(out_path)
        except (UsageError, OSError):
            old = None
        if not (isinstance(old, dict) and {"p", "results"} <= old.keys()):
            raise UsageError(f"{out_path} exists and is not a worker's results; give a new "
                             f"path")
    return spec


def worker_main(spec_path: str, out_path: str) -> int:
    """Run the cases of a spec file under MPI; rank 0 writes the results (atomically).
    A bad spec on any rank, or a bad output path on rank 0 (the one that writes it), is
    one line and exit 2 on every rank before any work (:func:`check_worker_files`,
    agreed by one all-gather of the ranks' messages)."""
    from mpi4py import MPI

    from ..cli import UsageError, print_error
    from ..mpiutil import end_on_signals

    # an interrupted job (costmodel accuracy ends it with SIGTERM): one line from rank 0,
    # and the node's shared memory freed, not a launcher's report of killed ranks
    end_on_signals("python -m summasim.costmodel accuracy-worker", MPI.COMM_WORLD.Get_rank())
    try:
        spec = check_worker_files(spec_path,
                                  out_path if MPI.COMM_WORLD.Get_rank() == 0 else None)
        mine = ""
    except UsageError as exc:
        spec, mine = None, str(exc)
    why = next((e for e in MPI.COMM_WORLD.allgather(mine) if e), "")
    if why:
        return print_error("python -m summasim.costmodel accuracy-worker", why)

    from ..backends import get_backend
    from ..comm import default_wait_policy, learn_node_cores, node_cores
    from ..mpiutil import abort_on_error, doing, limit_blas_threads
    from .cases import case_from_dict
    from .execute import run_case

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    with abort_on_error(world):
        learn_node_cores(world)
        # one BLAS thread per rank, at p = 1 too: the machine's GEMM rates are per rank
        # (fitted at p = 2, one thread each), and the serial calibration steps are
        # compared with them (with all cores a GEMM-bound step could beat them)
        _limits = limit_blas_threads(1)  # noqa: F841 - keep alive
        repeats, seed = int(spec.get("repeats", 5)), int(spec.get("seed", 0))
        backend = get_backend(spec.get("backend", "numpy"))
        results = []
        t_start = time.time()
        for data in spec["cases"]:
            case = case_from_dict(data)
            doing(f"running {case.label(p)}")
            kw = {"method": spec.get("check", "auto")} if case.kind != "transformer" else \
                {"with_memory": False}
            res = run_case(case, world, backend, repeats=repeats, seed=seed, **kw)
            if rank == 0:
                m = res.measured().to_dict()
                m.update(ok=res.ok, error=res.check.error, label=case.label(p),
                         load=os.getloadavg()[0])
                results.append(m)
                spans = res.timing["spans"]
                print(f"[worker p={p}] {case.label(p):<48s} "
                      f"{'OK  ' if res.ok else 'FAIL'} median {res.seconds * 1e3:9.2f} ms"
                      f"  min {min(spans) * 1e3:9.2f} ms", flush=True)
        if rank == 0:
            write_json_atomic(out_path, {"p": p, "cores": node_cores(),
                                         "wait_policy": default_wait_policy(),
                                         "repeats": repeats, "seconds": time.time() - t_start,
                                         "results": results})
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--launcher"]:      # scripts/run: the launcher, a word a line
        from ..cli import UsageError

        try:
            check_launcher()
        except UsageError as exc:
            print(f"summasim: {exc}", file=sys.stderr)
            sys.exit(2)
        print("\n".join(mpiexec()))
        sys.exit(0)
    if len(sys.argv) != 3:
        print("usage: python -m summasim.harness.worker SPEC OUT", file=sys.stderr)
        sys.exit(2)
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
