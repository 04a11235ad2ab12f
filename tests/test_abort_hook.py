"""``install_abort_hook``: an uncaught exception on one rank ends the whole job, with
that rank's traceback, instead of leaving the others waiting in a collective."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time


from conftest import ROOT, mpi_env, mpiexec_command

TIMEOUT = 60        # the job must end well within this

SCRIPT = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    from summasim.mpiutil import install_abort_hook

    assert install_abort_hook()
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    comm.Barrier()                 # the others wait here for rank 1, forever without the hook
    print("barrier passed", flush=True)
""")


def find_mpiexec() -> list[str]:
    """The suite's launcher and its flags (``conftest.mpiexec_command``)."""
    return mpiexec_command()


def run_script(tmp_path, n: int, env_extra: dict | None = None):
    mpiexec = find_mpiexec()
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT)
    env = {**mpi_env(), **(env_extra or {})}
    cmd = ["timeout", "-k", "5", str(TIMEOUT), *mpiexec, "-n", str(n), sys.executable, str(script)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def test_uncaught_exception_aborts_the_job(tmp_path):
    proc, seconds = run_script(tmp_path, 3)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), f"rc={proc.returncode}\n{out[-3000:]}"
    assert seconds < TIMEOUT / 2, f"the job took {seconds:.1f} s to end\n{out[-3000:]}"
    assert "[rank 1/3] unhandled exception, aborting the job:" in proc.stderr, out[-3000:]
    assert "Traceback" in proc.stderr and "deliberate failure on rank 1" in proc.stderr
    assert "barrier passed" not in proc.stdout
    print(f"abort of a 3-rank job took {seconds:.1f} s")


def test_install_is_idempotent_and_skips_a_single_rank(monkeypatch):
    from summasim import mpiutil

    before = sys.excepthook
    assert mpiutil.install_abort_hook() is False          # this pytest is one MPI rank
    assert sys.excepthook is before
    monkeypatch.setenv("SUMMASIM_ABORT_HOOK", "0")
    assert mpiutil.abort_hook_wanted() is False


def test_opt_out_leaves_the_hook_alone(tmp_path):
    """With SUMMASIM_ABORT_HOOK=0 nothing is installed (the script says so)."""
    script = tmp_path / "opt_out.py"
    script.write_text("import sys\nfrom summasim.mpiutil import install_abort_hook\n"
                      "sys.stdout.write(f'installed {install_abort_hook()}\\n')\n")
    env = {**mpi_env(), "SUMMASIM_ABORT_HOOK": "0"}
    proc = subprocess.run(["timeout", "-k", "5", str(TIMEOUT), *find_mpiexec(), "-n", "2",
                           sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("installed False") == 2, proc.stdout
