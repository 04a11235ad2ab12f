"""Ctrl-C and SIGTERM on the serial front-ends and on what they launch: one line, the
signal's exit status, and nothing left running or lying about (no launcher, rank or
temporary folder outlives the command that started it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))


def _start(args, **kw):
    """``python ARGS`` in a session of its own (a terminal's Ctrl-C reaches its group)."""
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=kw.pop("env", None) or _env(), cwd=kw.pop("cwd", ROOT), **kw)


def _alive(marker: str) -> list[str]:
    """Pids of processes whose command line holds ``marker``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(pid) != os.getpid():
            out.append(pid)
    return out


def _catches_sigint(pid: int) -> bool:
    """Whether the process has a handler for SIGINT (its ``SigCgt`` mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            caught = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) & (1 << (signal.SIGINT - 1)))


def _wait_gone(marker: str, seconds: float = 15.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(marker)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_job_ends_the_whole_job(sig):
    """The launched job (``timeout`` and everything under it, in a session of its own)
    ends with its caller: ``subprocess.run`` killed ``timeout`` alone and left the rest
    running, unbounded."""
    marker = f"sleep 61.{int(sig)}7"
    script = textwrap.dedent("""
        import os, sys
        from summasim.harness.worker import JobInterrupted, run_job
        mark = os.environ["MARK"]               # (not on this process's command line)
        print("started", flush=True)
        try:
            run_job(["timeout", "-k", "10", "60", "bash", "-c", f"{mark} & {mark}; wait"])
        except JobInterrupted as e:
            print("interrupted", e.signum, flush=True)
            sys.exit(3)
    """)
    proc = _start(["-c", script], env=dict(_env(), MARK=marker))
    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 20
        while len(_alive(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)      # timeout, bash and the two sleeps
        assert len(_alive(marker)) >= 4, "the job did not start"
        os.killpg(proc.pid, sig)                  # a terminal's Ctrl-C: the caller's group
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 3, (out, err)
        assert f"interrupted {int(sig)}" in out and "Traceback" not in err, (out, err)
        assert not _wait_gone(marker), "the job's processes outlived its caller"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(marker):                  # a failing run: its job goes too
            os.kill(int(pid), signal.SIGKILL)


def test_a_serial_front_end_says_ctrl_c_in_one_line():
    proc = _start(["-m", "summasim.costmodel", "plan", "--model", "gpt3-175b", "--machine",
                   "dgx-a100", "--devices", "3072", "--no-progress"])
    deadline = time.monotonic() + 60
    while not _catches_sigint(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)                            # the command's own handler is up
    assert _catches_sigint(proc.pid), "plan never caught SIGINT"
    time.sleep(0.5)                                 # inside the search (it takes 5 s and more)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err == "python -m summasim.costmodel plan: interrupted (SIGINT)\n", err


def _shm() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")} \
        if os.path.isdir("/dev/shm") else set()


def _leaked_shm(before: set) -> set:
    """MPICH segments made since ``before`` that no live process maps (another job that
    runs meanwhile maps its own)."""
    new = _shm() - before
    for pid in filter(str.isdigit, os.listdir("/proc")) if new else ():
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                maps = f.read()
        except OSError:
            continue
        new = {n for n in new if n not in maps}
    return new


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, True), (signal.SIGTERM, False),
                                       (signal.SIGHUP, False)])
def test_accuracy_interrupted_leaves_nothing_behind(tmp_path, sig, group):
    """Ctrl-C at a terminal (the whole group), SIGTERM from a scheduler or SIGHUP from a
    terminal that closes (the command alone) while ``costmodel accuracy`` runs an MPI
    job, or waits for a quiet machine between jobs: one line, 128 + the signal, no
    launcher or rank left running, no temporary folder in --out, no shared memory."""
    out = tmp_path / "acc"
    shm_before = _shm()
    proc = _start(["-m", "summasim.costmodel", "accuracy", "--quick", "--machine",
                   "local-2core-mpich", "--out", str(out), "--timeout", "120",
                   "--repeats", "50"])
    try:
        seen, job = "", re.compile(r"-n ([2-9]|\d\d+) .*summasim\.harness\.worker")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (
                job.search(seen) or "waiting for a quiet" in seen):
            line = proc.stdout.readline()           # (a job of 2 ranks or more: shared memory)
            if not line:
                break
            seen += line
        marker = str(out)                           # the workers' spec path holds it
        if job.search(seen):                        # a job runs: interrupt it
            deadline = time.monotonic() + 60
            while not _alive(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _alive(marker), "no process of the job was seen"
            time.sleep(0.5)
        else:                                       # (a loaded machine: between jobs)
            assert "waiting for a quiet" in seen, seen
        (os.killpg if group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + int(sig), (proc.returncode, err)
        assert "Traceback" not in err, err
        # its line last; before it, at most the line of the job's rank 0 (SIGTERM ends it)
        lines = err.splitlines()
        assert lines[-1] == (f"python -m summasim.costmodel accuracy: interrupted "
                             f"({sig.name}); no MPI job of it is left running"), err
        assert all(ln.startswith("python -m summasim.costmodel accuracy-worker: terminated "
                                 "(SIGTERM) on rank 0; it was ") for ln in lines[:-1]) \
            and len(lines) <= 2, err
        assert not _wait_gone(marker), "a launcher or rank outlived costmodel accuracy"
        assert not [n for n in os.listdir(out) if n.startswith("tmp")], os.listdir(out)
        assert not _leaked_shm(shm_before), "the job's shared memory was left in /dev/shm"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("delay", [0.3, 0.6])
def test_ctrl_c_while_the_ranks_start_is_no_traceback_storm(delay):
    """A Ctrl-C in the first second of a job (the ranks still importing NumPy, SciPy
    and mpi4py) gave one KeyboardInterrupt traceback per rank, and a segmentation fault
    when it landed inside MPI's start-up. Now each rank ends by the signal itself."""
    proc = subprocess.Popen(
        ["mpiexec", "-n", "4", sys.executable, "-m", "summasim.run", "--sizes", "256", "256",
         "256", "--schemes", "none", "--meshes", "none", "--no-predict"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=_env(), cwd=ROOT)
    try:
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-2000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "Segmentation fault" not in out, out[-3000:]


def test_an_interrupted_benchmark_says_what_it_was_running():
    """The line of an interrupted ``summasim.bench`` names the benchmark (it said
    "starting the work", whatever ran)."""
    proc = subprocess.Popen(
        ["mpiexec", "-n", "2", sys.executable, "-m", "summasim.bench", "gemm", "--n", "2048",
         "--repeats", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        line = ""
        while not line.startswith("algorithm") and time.monotonic() < deadline:
            line = proc.stdout.readline()         # the table's head: the benchmark runs
            if not line:
                break
        assert line.startswith("algorithm"), "the benchmark did not start"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)          # the launcher forwards it to the ranks
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "python -m summasim.bench: interrupted (SIGINT) on rank 0; it was running bench " \
           "gemm" in err, err[-2000:]
