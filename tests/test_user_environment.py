"""What the user's environment does to a command: a FIFO where the saved fit lives, a
fit that cannot be saved, a report behind a symbolic link, a private report replaced,
stdout closed, read by ``head`` or unable to encode a path, on/off switches with other
words, and the BLAS threads a run inherits. None of them may hang a job, lose a
report, or end the work with a traceback."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import mpi_env, mpiexec_command
from summasim import cli
from summasim.jsonio import write_text_atomic

PLAN = ["-m", "summasim.costmodel", "plan", "--model", "tiny", "--machine",
        "local-2core-mpich", "--devices", "4"]


def _py(args, cwd, timeout=300, **kw):
    env = {**mpi_env(), **kw.pop("env", {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True, **kw)


def test_a_fifo_at_the_saved_fit_is_not_opened(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the check of what lies at
    ``results/machine.json`` must not open one."""
    fifo = tmp_path / "machine.json"
    os.mkfifo(fifo)
    res = _py(["-c", "import sys; from summasim.harness.machinefile import _machine_file; "
                     f"print(_machine_file({str(fifo)!r}))"], tmp_path, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_a_fit_that_cannot_be_saved_is_used_and_said(tmp_path):
    from summasim.costmodel.machine import load_preset
    from summasim.harness import load, machinefile

    snap = load.snapshot(0.05)
    fitted = load_preset("local-2core-mpich")
    fitted = fitted.replace(fit_conditions=load.fit_conditions(snap, snap))
    said = []
    where = tmp_path / "missing" / "machine.json"       # its folder does not exist
    used = machinefile._finish_on_root(fitted, None, snap, str(where), [], said.append,
                                       "local-2core-mpich", True)
    assert used["name"].startswith("local-2core-mpich")
    assert not where.exists()
    assert any("the fit is used for this run but" in s and "could not be written" in s
               for s in said), said


def test_a_report_behind_a_link_is_checked_where_it_is_written(tmp_path, monkeypatch):
    """The atomic write replaces the file a link points to, with a temp file in that
    file's folder: the preflight probes that folder, not the link's."""
    there = tmp_path / "there"
    there.mkdir()
    (there / "r.json").write_text(json.dumps({"summasim_report": "run"}))
    link = tmp_path / "link.json"
    link.symlink_to(there / "r.json")
    probed = []
    real = cli._probe_dir
    monkeypatch.setattr(cli, "_probe_dir", lambda folder, make=True: (probed.append(folder),
                                                                       real(folder, make)))
    assert cli.check_writable_path(str(link), "run") == str(link)
    assert probed == [os.path.realpath(there)]


def test_a_replaced_report_keeps_its_permissions(tmp_path):
    path = tmp_path / "private.json"
    path.write_text("{}")
    path.chmod(0o600)
    write_text_atomic(path, '{"a": 1}\n')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and json.loads(path.read_text()) == {"a": 1}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    write_text_atomic(link, '{"a": 2}\n')
    assert link.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"a": 2}


def test_stdout_closed_or_read_by_head_still_writes_the_report(tmp_path):
    report = tmp_path / "plan.json"
    closed = subprocess.run([sys.executable, *PLAN, "--json", str(report)], cwd=tmp_path,
                            env=mpi_env(), stdout=subprocess.DEVNULL, timeout=300,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.close(1))     # stdout closed: >&-
    assert closed.returncode == 0, closed.stderr
    assert json.loads(report.read_text())["summasim_report"] == "plan"
    report.unlink()
    # the reader takes one line and goes away, as ``| head -1`` does
    proc = subprocess.Popen([sys.executable, *PLAN, "--json", str(report)], cwd=tmp_path,
                            env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1, err       # quietly: the output was not all read
    assert first.startswith("machine:") and "Traceback" not in err and not err.strip()
    assert json.loads(report.read_text())["summasim_report"] == "plan"


def test_a_path_stdout_cannot_encode_is_escaped(tmp_path):
    res = _py([*PLAN, "--json", str(tmp_path / "ü.json")], tmp_path,
              env={"PYTHONIOENCODING": "ascii"})
    assert res.returncode == 0, res.stderr
    assert f"wrote {tmp_path}/\\xfc.json" in res.stdout
    assert (tmp_path / "ü.json").exists()


def test_on_off_switches_take_the_usual_words_and_refuse_others(monkeypatch):
    for word, want in (("1", True), ("Yes", True), ("on", True), ("TRUE", True),
                       ("0", False), ("no", False), ("Off", False), (" false ", False)):
        monkeypatch.setenv("SUMMASIM_X", word)
        assert cli.env_switch("SUMMASIM_X", not want) is want
    monkeypatch.setenv("SUMMASIM_X", "")
    assert cli.env_switch("SUMMASIM_X", True) is True
    monkeypatch.setenv("SUMMASIM_X", "abc")
    assert cli.env_switch("SUMMASIM_X", False, strict=False) is False
    with pytest.raises(ValueError, match="SUMMASIM_X='abc'"):
        cli.env_switch("SUMMASIM_X", False)
    from summasim.comm import check_environment

    for name in ("SUMMASIM_AGREE", "SUMMASIM_ABORT_HOOK", "SUMMASIM_FUSED"):
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(ValueError, match=name):
            check_environment()
        monkeypatch.delenv(name)
    check_environment()


@pytest.mark.parametrize("var", ["SUMMASIM_WAIT=bogus", "SUMMASIM_AGREE=abc"])
def test_the_fit_checks_the_settings_before_it_measures(var, tmp_path):
    name, value = var.split("=")
    res = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, "-m",
                          "summasim.costmodel", "fit", "--quick", "--out",
                          str(tmp_path / "m.json")], cwd=tmp_path, timeout=300,
                         env={**mpi_env(), name: value}, capture_output=True, text=True)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert any(name in ln and "error" in ln for ln in lines), res.stderr
    assert not (tmp_path / "m.json").exists()


def test_the_run_says_how_many_blas_threads_it_used(tmp_path):
    args = ["-m", "summasim.run", "--sizes", "32", "32", "32", "--algorithms", "summa_ab",
            "--schemes", "none", "--meshes", "none", "--repeats", "1", "--machine",
            "local-2core-mpich", "--json", str(tmp_path / "r.json")]
    # OpenBLAS never runs more threads than the CPUs it may use
    for threads in sorted({1, min(2, len(os.sched_getaffinity(0)))}):
        res = _py(args, tmp_path, env={"OPENBLAS_NUM_THREADS": str(threads),
                                       "OMP_NUM_THREADS": str(threads)})
        assert res.returncode == 0, res.stderr
        word = "thread" if threads == 1 else "threads"
        assert f") {threads} {word} per rank" in res.stdout.splitlines()[0]
        assert json.loads((tmp_path / "r.json").read_text())["blas_threads"] == threads


def test_a_refused_fit_is_said_once_and_ends_without_an_abort(tmp_path):
    """run_fit raises FitRejected on every rank alike (noisy points on a busy machine):
    rank 0 says why, in one line, and every rank exits 1; no rank aborts the job."""
    script = tmp_path / "refused.py"
    script.write_text(
        "import sys\n"
        "import summasim.harness.fitbench as fb\n"
        "from summasim.costmodel.machine.regression import FitRejected\n"
        "def refuse(*a, **k):\n"
        "    raise FitRejected(['intra small: misses its own points by 69%'])\n"
        "fb.run_fit = refuse\n"
        "from summasim.costmodel.__main__ import main\n"
        f"sys.exit(main(['fit', '--quick', '--out', {str(tmp_path / 'm.json')!r}]))\n")
    res = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, str(script)],
                         cwd=tmp_path, timeout=300, env=mpi_env(), capture_output=True,
                         text=True)
    said = [ln for ln in res.stderr.splitlines() if "misses its own points" in ln]
    assert res.returncode == 1, res.stderr
    assert len(said) == 1 and "refused" in said[0], res.stderr
    assert "Abort" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "m.json").exists()


def test_a_file_named_results_is_named_as_the_reason_no_fit_is_saved(tmp_path):
    (tmp_path / "results").write_text("not a folder\n")
    res = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, "-m",
                          "summasim.run", "--sizes", "32", "32", "32", "--algorithms",
                          "summa_ab", "--schemes", "none", "--meshes", "none", "--repeats",
                          "1"], cwd=tmp_path, timeout=600, env=mpi_env(),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "cannot lock results/machine.json.lock (results is not a folder)" in res.stdout
    assert (tmp_path / "results").read_text() == "not a folder\n"


@pytest.mark.parametrize("front", [["summasim.costmodel", "presets"],
                                   ["summasim.run", "--sizes", "16", "16", "16"]])
def test_a_deleted_working_folder_is_one_user_error(front, tmp_path):
    res = subprocess.run(["bash", "-c", 'mkdir gone && cd gone && rmdir ../gone && exec "$@"',
                          "-", sys.executable, "-m", *front], cwd=tmp_path,
                         # absolute entries only: Python cannot start with a relative one
                         # (an empty one is the current folder) once that folder is gone
                         env={**mpi_env(), "PYTHONPATH": os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))},
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "the current folder no longer exists" in lines[0] and res.stdout == ""
