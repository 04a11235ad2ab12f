"""The two set-up scripts: ``scripts/setup.sh`` builds the venv one set-up at a time,
and ``scripts/run`` launches through ``$SUMMASIM_MPIEXEC`` with
``$SUMMASIM_MPIEXEC_FLAGS``, as the README says."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

VENV = sys.prefix          # the venv these tests run in: installed, so setup is quick


def _mpi_kind() -> str:
    """The MPI this venv was set up for (its set-up stamp ends in "-wheel" or
    "-system"): the scripts these tests run must ask for the same, or set-up would make
    the suite's own venv anew for the other one."""
    try:
        with open(os.path.join(VENV, ".summasim-installed")) as fh:
            return fh.read().strip().rsplit("-", 1)[1]
    except (OSError, IndexError):
        return "wheel"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUMMASIM_")}
    return {**env, "SUMMASIM_VENV": VENV, "SUMMASIM_MPI": _mpi_kind(), **extra}


def test_a_second_setup_waits_for_the_first_and_says_so():
    with open(VENV + ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)          # a set-up in progress
        proc = subprocess.Popen(
            ["bash", "-c", 'source scripts/setup.sh && echo "set up"'], cwd=ROOT,
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        waiting = proc.poll() is None
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=120)
    assert waiting, f"set-up did not wait for the lock: rc={proc.returncode} {err}"
    assert proc.returncode == 0 and out.strip() == "set up", err
    assert "waiting for another set-up" in err


def test_run_uses_the_launcher_and_flags_it_is_given(tmp_path):
    fake = tmp_path / "launcher"
    log = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n')
    fake.chmod(0o755)
    res = subprocess.run(["scripts/run", "--sizes", "8", "8", "8"], cwd=ROOT, timeout=120,
                         env=_env(SUMMASIM_MPIEXEC=f"{fake} --partition=debug",
                                  SUMMASIM_MPIEXEC_FLAGS="--oversubscribe --quiet",
                                  SUMMASIM_RANKS="3"),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    args = log.read_text().split("\n")[:-1]
    assert args == ["--partition=debug", "--oversubscribe", "--quiet", "-n", "3", "python",
                    "-m", "summasim.run", "--sizes", "8", "8", "8"], args


def test_run_splits_the_launcher_as_the_tests_and_accuracy_do(tmp_path):
    """Shell quoting in the flags keeps a value with a comma or a space whole, as
    ``shlex`` does for the tests and ``costmodel accuracy`` (``harness.worker.mpiexec``);
    ``read -a`` split it at the quotes."""
    fake = tmp_path / "a launcher"
    log = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n')
    fake.chmod(0o755)
    env = _env(SUMMASIM_MPIEXEC=f"'{fake}'", SUMMASIM_MPIEXEC_FLAGS='--mca btl "self,vader"',
               SUMMASIM_RANKS="2")
    res = subprocess.run(["scripts/run", "--sizes", "8", "8", "8"], cwd=ROOT, timeout=120,
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    args = log.read_text().split("\n")[:-1]
    assert args[:5] == ["--mca", "btl", "self,vader", "-n", "2"], args
    from summasim.harness import worker

    old = {k: os.environ.get(k) for k in ("SUMMASIM_MPIEXEC", "SUMMASIM_MPIEXEC_FLAGS")}
    os.environ.update(SUMMASIM_MPIEXEC=env["SUMMASIM_MPIEXEC"],
                      SUMMASIM_MPIEXEC_FLAGS=env["SUMMASIM_MPIEXEC_FLAGS"])
    try:
        assert worker.mpiexec() == [str(fake), "--mca", "btl", "self,vader"]
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize("var,value", [("SUMMASIM_RANKS", "abc"), ("SUMMASIM_RANKS", "0"),
                                       ("SUMMASIM_RANKS", "2 3"), ("SUMMASIM_RANKS", "-1"),
                                       ("SUMMASIM_TIMEOUT", "soon"),
                                       ("SUMMASIM_MPIEXEC", "no-such-launcher"),
                                       ("SUMMASIM_MPIEXEC", "   "),
                                       ("SUMMASIM_MPIEXEC_FLAGS", '--mca "btl')])
def test_run_refuses_a_bad_setting_in_one_line(var, value):
    """A rank count the launcher would read as 1 (Hydra's atoi: "abc", "0") ran the job
    on one rank and passed; a bad timeout or a missing launcher ended in the shell's or
    timeout's own words. Each is one line naming the variable, exit 2, before set-up."""
    res = subprocess.run(["scripts/run", "--sizes", "8", "8", "8"], cwd=ROOT, timeout=120,
                         env=_env(**{var: value}), capture_output=True, text=True)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and var in lines[0], res.stderr


def test_setup_refuses_a_python_older_than_3_11_before_building(tmp_path):
    """One line naming SUMMASIM_PYTHON and 3.11, exit 2, before pip runs (pip's own
    refusal came after a minute of installing, exit 1)."""
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\ncase "$*" in *print*) echo 3.10.13 ;; *) exit 1 ;; esac\n')
    fake.chmod(0o755)
    res = subprocess.run(["bash", "-c", "source scripts/setup.sh"], cwd=ROOT, timeout=60,
                         env={**_env(), "SUMMASIM_VENV": str(tmp_path / "venv"),
                              "SUMMASIM_PYTHON": str(fake)},
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "Python 3.10.13" in last and "3.11" in last and "SUMMASIM_PYTHON" in last, last
    assert not (tmp_path / "venv" / "bin").exists()


def test_a_relative_venv_is_taken_from_where_it_was_asked_for(tmp_path):
    """``SUMMASIM_VENV=v`` from another folder: the venv and the PATH both point at
    ``<that folder>/v`` (setup.sh changes to the repository, where ``v`` is nothing)."""
    os.symlink(VENV, tmp_path / "v")
    res = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/setup.sh && command -v python"],
                         cwd=tmp_path, timeout=120,
                         env={**_env(), "SUMMASIM_VENV": "v"}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "v" / "bin" / "python"), res.stdout


LONG_RUN = ["scripts/run", "--sizes", "1024", "1024", "1024", "--schemes", "none",
            "--meshes", "none", "--no-predict", "--repeats", "400"]


def _job_gone(proc, seconds: float = 20.0) -> bool:
    """No process of the run's session is left (the watchdog included)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)],
                              capture_output=True, text=True).stdout.split()
        if not left:
            return True
        time.sleep(0.2)
    return False


def test_run_limit_ends_the_job_once_and_says_why():
    """SUMMASIM_TIMEOUT: the watchdog sends SIGTERM once; each rank says its line, and
    the watchdog leaves with the job (it holds stderr, so a caller reading to the end of
    stderr would otherwise wait on it)."""
    proc = subprocess.Popen(LONG_RUN, cwd=ROOT, start_new_session=True, text=True,
                            env=_env(SUMMASIM_RANKS="2", SUMMASIM_TIMEOUT="6"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0, out[-2000:]
    assert "scripts/run: the run has taken 6 s (SUMMASIM_TIMEOUT); ending it" in err, err
    assert "terminated (SIGTERM) on rank" in err, err
    assert took < 6 + 8 + 5, f"{took:.1f} s"          # not the 10 s of the SIGKILL grace
    assert _job_gone(proc)


def test_run_ctrl_c_reaches_the_launcher_once():
    """A terminal's Ctrl-C (SIGINT to the whole group): rank 0's one line, and no forced
    abort of MPICH's launcher (its assertion messages), which a second SIGINT relayed by
    `timeout` caused."""
    proc = subprocess.Popen(LONG_RUN, cwd=ROOT, start_new_session=True, text=True,
                            env=_env(SUMMASIM_RANKS="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line, deadline = "", time.monotonic() + 90
        while "summa_ab " not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()          # a row has run: the ranks are working
            if not line:
                break
        assert "summa_ab " in line, "the run did not start"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    both = out + err
    assert "interrupted (SIGINT) on rank" in err, both[-3000:]
    assert "assert (!closed) failed" not in both, both[-3000:]
    assert "Press Ctrl-C again" not in both or "Ctrl-C caught" not in both, both[-3000:]
    assert _job_gone(proc)
