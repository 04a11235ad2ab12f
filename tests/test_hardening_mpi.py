"""The MPI front-ends under faults: nothing waits forever, exit codes say what happened,
and a job that ends early says which rank ended it and what it was doing.

Each case launches ``mpiexec -n 2`` or ``-n 4`` under ``timeout`` (as
tests/test_mpi_suites.py does), often with a ``-c`` program that patches one function
on one rank to raise, exit or sleep, then checks the exit status, stderr and the time
the job took. The serial checks of :mod:`summasim.harness.inject` sit at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, launcher_free, launcher_is_open_mpi, mpi_env

#: seconds a job that must end "within seconds" may take on the shared 2-core box
#: (start-up of 4 Python ranks under load included)
PROMPT = 60


def launch(mpiexec, n, args, timeout=120):
    cmd = ["timeout", "-k", "10", str(timeout)] + mpiexec + ["-n", str(n), sys.executable] + args
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def program(*lines, main="summasim.run", argv=()):
    """A ``-c`` program: ``lines`` (the patches), then ``sys.exit(<main>.main(argv))``."""
    return "\n".join(["import sys, os, time", "from mpi4py import MPI",
                      "RANK = MPI.COMM_WORLD.Get_rank()", f"import {main} as front", *lines,
                      f"sys.exit(front.main({list(argv)!r}))"])


SMALL = ["--algorithms", "summa_ab", "--sizes", "16", "16", "16", "--schemes", "none",
         "--meshes", "none", "--repeats", "1", "--no-predict"]


def user_error(proc, *needles):
    """Exit 2, one ``python -m summasim.<x>: error:`` line on stderr, no traceback."""
    out = proc.stdout + proc.stderr
    lines = launcher_free(proc.stderr)
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith("python -m summasim."), proc.stderr
    assert ": error: " in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def aborted(proc, seconds, *needles):
    """Non-zero, not the timeout's status, within PROMPT seconds, ``needles`` in the output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), f"rc={proc.returncode}\n{out[-3000:]}"
    assert seconds < PROMPT, f"took {seconds:.1f} s\n{out[-3000:]}"
    for n in needles:
        assert n in out, f"{n!r} not in the output:\n{out[-3000:]}"


# -- 1. nothing waits forever: the preflight under the guard --------------------------------
@pytest.mark.parametrize("front,exc", [
    ("summasim.run", "RecursionError('maximum recursion depth exceeded')"),
    ("summasim.run", "MemoryError()"),
    ("summasim.run", "KeyError('machine')"),
    ("summasim.bench.__main__", "RecursionError('maximum recursion depth exceeded')")])
def test_a_preflight_that_raises_on_rank_0_ends_the_job(mpiexec, front, exc):
    """Rank 0's preflight raises something that is no user error: before the guard the
    other ranks waited in the broadcast forever; now rank 0's traceback ends the job."""
    name = "preflight" if front == "summasim.run" else "_preflight"
    code = program(f"def bad(args, world): raise {exc}",
                   f"front.{name} = bad", main=front,
                   argv=SMALL if front == "summasim.run" else ["gemm", "--n", "32",
                                                               "--repeats", "1"])
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=90)
    aborted(proc, seconds, "[rank 0/4] unhandled exception", "it was in the preflight",
            exc.split("(")[0], "Traceback")


@pytest.mark.parametrize("exc,needle", [
    ("ValueError('results/x.json: not a summasim report')", "not a summasim report"),
    ("OSError(21, 'Is a directory', '/tmp/m')", "Is a directory: '/tmp/m'")])
def test_a_preflight_user_error_is_one_line_on_every_rank(mpiexec, exc, needle):
    """A ValueError or OSError out of the preflight (reading the user's file) is a user
    error: one line, exit 2, every rank ends."""
    code = program(f"def bad(args, world): raise {exc}", "front.preflight = bad", argv=SMALL)
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=90)
    user_error(proc, needle)
    assert seconds < PROMPT


@pytest.mark.parametrize("var,value", [("SUMMASIM_RING_WAIT", "fast"),
                                       ("SUMMASIM_WAIT", "busy"),
                                       ("SUMMASIM_REDUCE", "ring"),
                                       ("SUMMASIM_NAP_BYTES", "-3")])
@pytest.mark.parametrize("where", ["every rank", "rank 1 only"])
def test_a_bad_runtime_setting_is_one_user_error_even_on_one_rank(mpiexec, var, value,
                                                                  where):
    """The SUMMASIM_* runtime settings are checked on every rank before any work
    (harness.frontend): one line naming the variable, exit 2, no abort, no hang; a
    setting bad on one rank only names that rank."""
    patch = (f"os.environ[{var!r}] = {value!r}" if where == "every rank"
             else f"os.environ[{var!r}] = {value!r} if RANK == 1 else ''")
    proc, took = launch(mpiexec, 2, ["-c", program(patch, argv=SMALL)], timeout=PROMPT)
    user_error(proc, var, *(["rank 1"] if where == "rank 1 only" else []))
    assert took < PROMPT


@pytest.mark.parametrize("var,value", [("SUMMASIM_RING_WAIT", "rule"),
                                       ("SUMMASIM_BLOCKING_BYTES", "0"),
                                       ("SUMMASIM_REDUCE", "mpi")])
def test_a_valid_setting_that_differs_on_one_rank_is_a_user_error(mpiexec, var, value):
    """A setting that decides which messages a collective sends (whether a ring runs its
    wait trials, which steps block, how a reduce goes) must be the same on every rank,
    or the job would hang: set on rank 1 only, it is one line naming it, exit 2."""
    patch = f"os.environ[{var!r}] = {value!r} if RANK == 1 else ''"
    proc, took = launch(mpiexec, 2, ["-c", program(patch, argv=SMALL)], timeout=PROMPT)
    user_error(proc, var, "differs between ranks", "rank 1")
    assert took < PROMPT


def test_agreement_switched_off_on_one_rank_is_a_user_error(mpiexec):
    """``SUMMASIM_AGREE`` (read at import) decides whether the entry points run their
    collective input agreement: off on one rank only, the others waited in it forever.
    Now it is agreed like the other settings: one line naming it, exit 2."""
    patch = "import summasim.mpiutil as mu; mu.set_agreement(RANK != 1)"
    proc, took = launch(mpiexec, 2, ["-c", program(patch, argv=SMALL)], timeout=PROMPT)
    user_error(proc, "SUMMASIM_AGREE", "differs between ranks", "rank 1")
    assert took < PROMPT


@pytest.mark.parametrize("other", [["--seed", "2"], ["--repeats", "0"],
                                   ["--dtype", "float32"]])
def test_ranks_started_with_different_arguments_are_a_user_error(mpiexec, other):
    """``mpiexec -n 1 prog A : -n 1 prog B``: rank 1 runs other work (another seed: a
    FAIL verdict for a right product; no timed repeats: a hang; another dtype: an
    abort). The command lines are agreed before any work: one line, exit 2."""
    code = "\n".join(["import sys", "from mpi4py import MPI", "import summasim.run as front",
                       f"argv = {SMALL!r}",
                       f"argv = argv + ({other!r} if MPI.COMM_WORLD.Get_rank() == 1 else [])",
                       "sys.exit(front.main(argv))"])
    proc, took = launch(mpiexec, 2, ["-c", code], timeout=PROMPT)
    user_error(proc, "started with different arguments", "rank 1", other[0])
    assert took < PROMPT


@pytest.mark.parametrize("var", ["SUMMASIM_BLOCKING_BYTES", "SUMMASIM_STAGE_WHOLE_BYTES",
                                 "SUMMASIM_GPU_COMM"])
def test_a_bad_setting_read_at_import_is_one_user_error(mpiexec, var):
    """The byte limits are read when ``summasim.comm`` is imported, before the front-end
    can check anything: a bad value there was a ValueError traceback (exit 1, which
    says a row failed). Now the import takes the default and the check before any work
    says it: one line, exit 2. ``SUMMASIM_GPU_COMM`` is checked there too."""
    cmd = ["timeout", "-k", "10", str(PROMPT)] + mpiexec + ["-n", "2", sys.executable, "-m",
                                                            "summasim.run", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env={**mpi_env(), var: "abc"}, capture_output=True,
                          text=True)
    user_error(proc, var)


def test_the_main_job_into_a_closed_pipe_is_quiet():
    """``python -m summasim.run ... --json R | head -1``: the reader leaves while rank 0
    prints; no BrokenPipeError traceback, the work goes on and writes the report it was
    asked for, and a non-zero status (what it printed was not all read)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        proc = subprocess.Popen([sys.executable, "-m", "summasim.run", *SMALL, "--json",
                                 report], cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
        assert proc.wait(timeout=PROMPT) == 1 and "Traceback" not in err, err
        with open(report) as fh:
            assert json.load(fh)["ok"] is True


def test_help_is_printed_once_under_mpiexec(mpiexec):
    proc, _ = launch(mpiexec, 3, ["-m", "summasim.run", "--help"], timeout=PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage:") == 1, proc.stdout[:500]


def test_a_deeply_nested_machine_file_is_a_user_error(mpiexec, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    proc, seconds = launch(mpiexec, 4, ["-m", "summasim.run", "--machine", str(deep), *SMALL[:-1]],
                           timeout=90)
    user_error(proc, "--machine", str(deep))
    assert seconds < PROMPT


def test_a_key_error_in_the_body_on_one_rank_names_the_rank_and_the_run(mpiexec):
    code = program("import summasim.harness.execute as ex", "orig = ex.run_case",
                   "def bad(case, *a, **k):",
                   "    if RANK == 2: raise KeyError('deliberate')",
                   "    return orig(case, *a, **k)", "ex.run_case = bad", argv=SMALL)
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=90)
    aborted(proc, seconds, "[rank 2/4] unhandled exception, aborting the job: it was running "
                           "summa_ab 2x2 16x16x16 float64", "KeyError: 'deliberate'")


def test_a_rank_that_exits_early_ends_the_job_not_a_hang(mpiexec):
    """sys.exit(0) on one rank in the middle of the work: the others would wait for it in
    their next collective (and MPI_Finalize waits for them); the job ends, non-zero, and
    names the rank."""
    code = program("import summasim.harness.execute as ex", "orig = ex.run_case",
                   "def bad(case, *a, **k):",
                   "    if RANK == 1: sys.exit(0)",
                   "    return orig(case, *a, **k)", "ex.run_case = bad", argv=SMALL)
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=90)
    aborted(proc, seconds, "[rank 1/4] left the job early (exit status 0)",
            "it was running summa_ab 2x2 16x16x16 float64")


def test_an_exception_leaves_no_shared_memory_segment(mpiexec):
    """The abort unlinks the node's MPI shared memory that the launcher's kill would leave
    in /dev/shm (rank 0 names what it maps before it fails)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    code = program("import summasim.harness.execute as ex, summasim.mpiutil as mu",
                   "def bad(case, *a, **k):",
                   "    MPI.COMM_WORLD.Barrier()",
                   "    if RANK == 0:",
                   "        print('SEGMENTS', *mu.shared_memory_segments(), flush=True)",
                   "        raise RuntimeError('deliberate')",
                   "    MPI.COMM_WORLD.Barrier()", "ex.run_case = bad", argv=SMALL)
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=90)
    aborted(proc, seconds, "deliberate")
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("SEGMENTS")]
    segments = line.split()[1:]
    assert segments, "MPI mapped no /dev/shm segment: nothing to check"
    assert [s for s in segments if os.path.exists(s)] == [], segments


# -- 3. faults that explain themselves: signals ---------------------------------------------
def _hold(where):
    """Patches under which the first run holds: each rank writes its process id to
    ``where``/pid.RANK, then rank 0 writes ``where``/ready and sleeps in Python while the
    others wait in a barrier (inside MPI, where Python never sees a signal)."""
    return ["import summasim.harness.execute as ex",
            "def hold(case, *a, **k):",
            f"    open(os.path.join({str(where)!r}, f'pid.{{RANK}}'), 'w').write(str(os.getpid()))",
            "    MPI.COMM_WORLD.Barrier()",
            "    if RANK == 0:",
            f"        open(os.path.join({str(where)!r}, 'ready'), 'w').close()",
            "        time.sleep(120)",
            "    MPI.COMM_WORLD.Barrier()",
            "ex.run_case = hold"]


def _start_held(mpiexec, where, n=4):
    code = program(*_hold(where), argv=SMALL)
    cmd = ["timeout", "-k", "10", "150"] + mpiexec + ["-n", str(n), sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (where / "ready").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if not (where / "ready").exists():
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not reach the held run:\n{(out + err)[-3000:]}")
    time.sleep(0.5)             # let every rank enter its wait
    return proc, {r: int((where / f"pid.{r}").read_text()) for r in range(n)}


def _finish(proc):
    t0 = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=PROMPT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end after the signal:\n{err[-3000:]}")
    return out, err, time.perf_counter() - t0


def _ours(err):
    return [ln for ln in err.splitlines() if ln.startswith("python -m summasim.run")]


def test_ctrl_c_ends_the_job_with_one_line(mpiexec, tmp_path):
    """SIGINT to the launcher, which forwards it to every rank: one line, no traceback, a
    failing status (rank 0 exits 130; Hydra reports the kill of the others), although
    ranks 1-3 sit inside MPI. Before: a KeyboardInterrupt traceback per rank that runs
    Python, and the ranks inside MPI kept the job waiting."""
    proc, pids = _start_held(mpiexec, tmp_path)
    os.kill(_launcher(proc), signal.SIGINT)
    out, err, seconds = _finish(proc)
    assert proc.returncode not in (0, 124), f"rc={proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # Open MPI's launcher hands a Ctrl-C on to the ranks as SIGTERM
    said = "terminated (SIGTERM)" if launcher_is_open_mpi() else "interrupted (SIGINT)"
    assert _ours(err) == [f"python -m summasim.run: {said} on rank 0; it was "
                          "running summa_ab 2x2 16x16x16 float64; the job ends"], err[-3000:]
    assert seconds < 20, seconds


def test_ctrl_c_to_the_whole_process_group_ends_the_job(mpiexec, tmp_path):
    """A terminal's Ctrl-C reaches the launcher, its proxy and the ranks at once. Hydra's
    proxy dies of it (its own assertion), and the launcher kills the ranks, often before
    rank 0 has written its line (a copy of each rank's stderr kept in a file showed none
    in 4 runs of 6); the job still ends promptly, failing (but for Hydra's race below),
    with no Python traceback, and every rank ends within seconds (orphaned by the proxy,
    they end in 0.5-2 s here): that last check is the one the race cannot excuse.
    The launcher does most of this; summasim's own line is checked where the signal
    reaches the launcher alone or one rank (the tests around this one).

    About 1 run in 15 here the proxy dies before it collects the ranks' exit statuses and
    MPICH 5.0.2's mpiexec then returns 0 (a launcher race no rank can change): that case
    must show the proxy's assertion."""
    proc, pids = _start_held(mpiexec, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    out, err, seconds = _finish(proc)
    hydra_race = proc.returncode == 0 and "assert (!closed) failed" in err
    assert proc.returncode not in (0, 124) or hydra_race, f"rc={proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err[-3000:]
    assert seconds < 20, seconds
    deadline = time.time() + 5      # ranks 1-3 wait their grace before they end
    while any(_rank_alive(pid) for pid in pids.values()) and time.time() < deadline:
        time.sleep(0.1)
    assert [r for r, pid in pids.items() if _rank_alive(pid)] == [], \
        "ranks outlived the job by 5 s"


def test_sigterm_to_the_launcher_ends_the_job_with_one_line(mpiexec, tmp_path):
    proc, pids = _start_held(mpiexec, tmp_path)
    os.kill(_launcher(proc), signal.SIGTERM)
    out, err, seconds = _finish(proc)
    assert proc.returncode not in (0, 124), f"rc={proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert _ours(err) == ["python -m summasim.run: terminated (SIGTERM) on rank 0; it was "
                          "running summa_ab 2x2 16x16x16 float64; the job ends"], err[-3000:]
    assert seconds < 20, seconds


def test_sigterm_to_one_rank_names_that_rank(mpiexec, tmp_path):
    """Only rank 2 gets the signal (inside MPI's barrier): it says so itself."""
    proc, pids = _start_held(mpiexec, tmp_path)
    os.kill(pids[2], signal.SIGTERM)
    out, err, seconds = _finish(proc)
    assert proc.returncode not in (0, 124), f"rc={proc.returncode}\n{err[-3000:]}"
    ours = _ours(err)
    if launcher_is_open_mpi():   # it then sends SIGTERM to the others: they say so after
        assert all(ln.startswith("python -m summasim.run: terminated (SIGTERM) on rank ")
                   for ln in ours), err[-3000:]
        ours = ours[:1]
    assert ours == ["python -m summasim.run: terminated (SIGTERM) on rank 2; it was "
                    "running summa_ab 2x2 16x16x16 float64; the job ends"], err[-3000:]
    assert seconds < 20, seconds


def test_a_killed_rank_ends_the_job_promptly(mpiexec, tmp_path):
    """SIGKILL leaves summasim no last words: the launcher ends the job (which process it
    names is the launcher's choice; the node's shared-memory segment stays, see
    mpiutil's module doc), and no rank waits for the dead one."""
    proc, pids = _start_held(mpiexec, tmp_path)
    os.kill(pids[1], signal.SIGKILL)
    out, err, seconds = _finish(proc)
    assert proc.returncode not in (0, 124), err[-3000:]
    assert seconds < 20, seconds


def _launcher(proc) -> int:
    """The launcher's process id: the one child of the ``timeout`` that ``proc`` runs
    (whatever the launcher is called: mpiexec, mpirun, srun)."""
    kids = [k for k in _children(proc.pid) if _parent(k) == proc.pid]
    assert len(kids) == 1, [_cmdline(k) for k in kids]
    return kids[0]


def _parent(pid) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _children(pid):
    """Every descendant process id of ``pid`` (from /proc)."""
    kids = [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) == pid]
    return kids + [g for k in kids for g in _children(k)]


def _rank_alive(pid):
    """True while ``pid`` runs (a zombie has ended) and is still a held rank (a pid the
    system gave to another process since is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            running = fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
    return running and "summasim.harness.execute" in _cmdline(pid)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# -- 2. honest exit codes -------------------------------------------------------------------
@pytest.mark.parametrize("args,needles", [
    (["--algorithms", "sd25_ab,mm3d_ab", "--sizes", "5", "7", "9"],
     ["--algorithms sd25_ab,mm3d_ab: none can run at p = 4", "needs p = c q^2"]),
    (["--schemes", "3d", "--algorithms", "none"],
     ["--schemes 3d: none can run at p = 4"]),
    (["--schemes", "megatron,bogus"], ["unknown scheme(s) bogus"]),
    (["--inject", "drop@4"], ["rank 4 does not exist (p = 4)"]),
    (["--inject", "perturb@1", "--dtype", "float32", "--check", "freivalds"],
     ["--inject perturb@1 with --check freivalds in float32", "pass unseen"]),
    (["--inject", "perturb@1", "--dtype", "both", "--check", "freivalds"],
     ["in float32:"])])
def test_what_was_named_but_cannot_run_is_a_user_error(mpiexec, args, needles):
    """Exit 2 before any work, even where default sections would run."""
    proc, seconds = launch(mpiexec, 4, ["-m", "summasim.run", "--no-predict", *args], 90)
    user_error(proc, *needles)
    assert proc.stdout.strip() == "", proc.stdout[-2000:]


def test_a_named_scheme_beside_one_that_runs_is_skipped_not_refused(mpiexec):
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.run", "--algorithms", "none", "--schemes",
                                  "megatron,3d", "--meshes", "none", "--repeats", "1",
                                  "--no-predict"], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped 3d" in proc.stdout


def test_a_fault_that_passes_its_check_fails_the_job(mpiexec):
    """A check that lets an applied fault through must not leave "corrupted" next to
    "passed" with exit 0: the run is named and the job exits 1."""
    code = program("import summasim.harness.execute as ex",
                   "from summasim.harness.check import Check",
                   "ex.check_product = lambda *a, **k: Check(0.0, 1.0, 'exact')",
                   argv=SMALL + ["--inject", "nan@1"])
    proc, _ = launch(mpiexec, 4, ["-c", code], 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "corrupted 1 of 1 runs; it was NOT caught in: summa_ab 2x2 16x16x16 float64" in proc.stdout


@pytest.mark.parametrize("sizes", [("1", "100000", "1"), ("4", "60000", "3")])
def test_a_single_precision_perturb_is_caught_on_a_long_contraction(mpiexec, sizes):
    """perturb moves a product's entry by 1e-2 of its scale (|A||B|)_ij: at k = 1e5, where
    1e-2 of the entry itself (about sqrt(k) times smaller) falls under the float32
    bound, the check still catches it on every rank's block."""
    argv = ["--algorithms", "summa_ab", "--sizes", *sizes, "--schemes", "none", "--meshes",
            "none", "--repeats", "0", "--no-predict", "--dtype", "float32", "--inject",
            "perturb@0"]                             # rank 0 holds a block of C
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", *argv], 240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOT caught" not in proc.stdout and "corrupted 1 of 1 runs" in proc.stdout, \
        proc.stdout
    row = [ln for ln in proc.stdout.splitlines() if ln.startswith("summa_ab ")]
    assert len(row) == 1 and " FAIL" in row[0], proc.stdout


def test_an_untimed_run_reports_no_time_and_no_load(mpiexec, tmp_path):
    """--repeats 0 validates without timing: the JSON has no seconds (null, not 0.0) and
    no load reading, and no row is marked BUSY nor the job warned that its times include
    other work, whatever else runs on the machine."""
    out = tmp_path / "r.json"
    argv = ["--algorithms", "summa_ab,ring_allreduce", "--sizes", "16", "16", "16",
            "--schemes", "megatron", "--meshes", "none", "--repeats", "0", "--no-predict",
            "--json", out]                  # (a machine fit, were one run, is timed work)
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.run", *map(str, argv)], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["rows"] and all(r["seconds"] is None and r["times"] == [] and r["load"] is None
                               for r in rep["rows"]), rep["rows"]
    assert rep["load"] is None and all(t["load"] is None for t in rep["transformer"])
    assert "BUSY" not in proc.stdout and "times include" not in proc.stdout, proc.stdout


def test_auto_checks_exactly_under_a_single_precision_perturb(mpiexec):
    """With auto's threshold at zero every product would be checked by Freivalds; under
    --inject perturb in float32 it checks exactly, and the fault is caught."""
    code = program("import summasim.harness.check as ch", "ch.AUTO_EXACT_FLOPS = 0",
                   argv=SMALL + ["--dtype", "float32", "--inject", "perturb@1"])
    proc, _ = launch(mpiexec, 4, ["-c", code], 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = [ln for ln in proc.stdout.splitlines() if ln.startswith("summa_ab ")]
    assert len(row) == 1 and " exact " in row[0] and " FAIL" in row[0], proc.stdout


# -- serial: which check catches which fault -------------------------------------------------
def test_which_checks_can_catch_a_perturbation():
    from summasim.harness.inject import Fault, check_method, uncatchable

    perturb, nan = Fault("perturb", 1), Fault("nan", 1)
    assert uncatchable(perturb, "freivalds", ["float32"])
    assert uncatchable(perturb, "freivalds", ["float64", "float32"])
    assert not uncatchable(perturb, "freivalds", ["float64"])
    assert not uncatchable(perturb, "exact", ["float32"])
    assert not uncatchable(nan, "freivalds", ["float32"])
    assert not uncatchable(None, "freivalds", ["float32"])
    assert check_method(perturb, "auto", "float32") == "exact"
    assert check_method(perturb, "auto", "float64") == "auto"
    assert check_method(nan, "auto", "float32") == "auto"
    assert check_method(perturb, "freivalds", "float32") == "freivalds"


def test_only_the_mpi_librarys_segments_are_released_never_the_users():
    """An abort unlinks the MPI library's /dev/shm segments that the rank maps, and
    leaves alone a segment the user's own code maps beside summasim."""
    import mmap
    from multiprocessing import shared_memory

    from summasim import mpiutil

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    user = shared_memory.SharedMemory(create=True, size=4096)
    path = f"/dev/shm/mpich_shm_summasim_test_{os.getpid()}"
    with open(path, "wb+") as fh:
        fh.write(b"\0" * 4096)
        fh.flush()
        mapped = mmap.mmap(fh.fileno(), 4096)
    try:
        found = mpiutil.shared_memory_segments()
        assert path in found and f"/dev/shm/{user.name.lstrip('/')}" not in found, found
    finally:
        mapped.close()
        os.unlink(path)
        user.close()
        user.unlink()


def test_a_worker_spec_missing_on_one_rank_is_one_error_on_every_rank(mpiexec, tmp_path):
    """``accuracy-worker``'s files are checked on every rank and agreed before any work:
    a spec that rank 2 cannot read (a node-local path) is one message and exit 2, with
    no rank running cases the others never join."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": [{"kind": "ring", "n": 8}]}))
    code = "\n".join([
        "import sys", "from mpi4py import MPI",
        "from summasim.harness.worker import worker_main",
        f"spec = {str(spec)!r} if MPI.COMM_WORLD.Get_rank() != 2 else {str(tmp_path / 'gone.json')!r}",
        f"sys.exit(worker_main(spec, {str(tmp_path / 'out.json')!r}))"])
    proc, seconds = launch(mpiexec, 4, ["-c", code], timeout=PROMPT)
    user_error(proc, "gone.json: no such file")
    assert seconds < PROMPT and not (tmp_path / "out.json").exists()
