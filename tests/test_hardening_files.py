"""Files in and out: every file a user names is read safely (regular files only, bounded
size and nesting, strict JSON), and every report is written where it may be (never over
a file that is not a summasim report of the same kind unless --force, never into a
folder nobody asked for, checked before any work, never lost to a late I/O error)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from summasim import cli, jsonio
from summasim.costmodel.machine import load_machine, load_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREDICT = ("-m", "summasim.costmodel", "predict", "--model", "tiny",
           "--mesh", "dp=1,tp=optimus:2x2")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _run(*args, timeout=120, cwd=None):
    """``python ARGS`` in a fresh interpreter; the CompletedProcess, its seconds in ``.took``."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=cwd or ROOT)
    res.took = time.monotonic() - t0
    return res


def _user_error(res, *words):
    """Exit 2, one line on stderr naming every word, no traceback."""
    report = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 2, report
    assert "Traceback" not in res.stderr, report
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], report
    for word in words:
        assert str(word) in lines[0], report


@pytest.fixture
def machine_file(tmp_path):
    """A valid machine JSON (the default preset, saved as `costmodel fit` would)."""
    path = tmp_path / "m.json"
    load_preset("local-2core-mpich").save(path)
    return path


# -- the reader: one bad input each ------------------------------------------------------
def _refused(path, *words):
    with pytest.raises(cli.UsageError) as exc:
        cli.read_json_file(path)
    msg = str(exc.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    for word in words:
        assert word in msg, msg
    return msg


def test_reader_accepts_a_machine_file(machine_file):
    d = cli.read_json_file(machine_file)
    assert d["summasim_report"] == "machine" and load_machine(str(machine_file)).cores >= 1


def test_reader_refuses_special_files_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "zero-link.json"
    os.symlink("/dev/zero", link)
    t0 = time.monotonic()
    _refused(fifo, "FIFO")
    _refused("/dev/zero", "character device")
    _refused(link, "character device")                 # a symlink to a device, too
    _refused(tmp_path, "folder")
    assert time.monotonic() - t0 < 5                     # nothing waited on a writer


@pytest.mark.parametrize("content, words", [
    (b"[" * 100000, ("deeper than", str(cli.MAX_JSON_DEPTH))),
    (b'{"a":' * 100000, ("deeper than",)),
    (b"[" * 70 + b"]" * 70, ("deeper than",)),           # valid JSON, still too deep
    (b"", ("empty",)),
    (b"   \n", ("empty",)),
    (b"[1, 2]", ("a list", "expected an object")),
    (b'"text"', ("a string",)),
    (b'{"alpha": NaN}', ("NaN",)),
    (b'{"alpha": -Infinity}', ("-Infinity",)),
    (b'{"alpha": 1e999}', ("1e999", "out of range")),
    (b'{"n": 1' + b"0" * 400 + b"}", ("the integer 1000", "out of range")),
    (b'{"alpha": 1, "alpha": 2}', ("'alpha'", "twice")),
    (b'{"n": ' + b"9" * 5000 + b"}", ("cannot be read as JSON",)),
    ('{"a": 1}'.encode("utf-16"), ("UTF-16",)),
    (b"\x7fELF\x02\x01\x01\x00\x00", ("NUL", "binary")),
    (b'{"a": "\xff\xfe"}', ("not UTF-8", "0xff")),
    (b'{"a": 1', ("not valid JSON", "line 1")),
])
def test_reader_refuses_bad_content(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    _refused(path, *words)


def test_reader_bounds_the_size(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b"0," * 600 + b"0]")
    assert len(cli.read_json_file(path, expect=list)) == 601
    with pytest.raises(cli.UsageError, match=r"too large \(at most 1000 bytes are read\)"):
        cli.read_json_file(path, max_bytes=1000)
    sparse = tmp_path / "sparse.json"                    # 65 MiB, no disk used
    with open(sparse, "wb") as fh:
        fh.truncate(cli.MAX_INPUT_BYTES + (1 << 20))
    _refused(sparse, "too large", "64 MiB")


def test_reader_path_errors(tmp_path):
    _refused(tmp_path / "nope.json", "no such file")
    _refused(tmp_path / ("x" * 300), "too long")
    dangling = tmp_path / "dangling.json"
    os.symlink(tmp_path / "gone", dangling)
    _refused(dangling, "no such file")
    loop = tmp_path / "loop.json"
    os.symlink(loop, loop)
    _refused(loop, "symbolic links")
    (tmp_path / "f").write_text("{}")
    _refused(tmp_path / "f" / "x.json", "not a folder")


@pytest.mark.skipif(IS_ROOT, reason="root reads files without read permission")
def test_reader_unreadable_file(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    _refused(path, "permission denied")


def test_machine_files_name_the_problem(tmp_path, machine_file):
    run_report = tmp_path / "run.json"
    run_report.write_text(json.dumps({"summasim_report": "run", "world_size": 4}))
    with pytest.raises(ValueError, match="summasim 'run' report, not a machine"):
        load_machine(str(run_report))
    d = json.loads(machine_file.read_text())
    d["cores"] = "many"
    bad = tmp_path / "bad-cores.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad-cores.json: .*cores"):
        load_machine(str(bad))
    legacy = tmp_path / "legacy.json"                    # written before the kind field
    d = json.loads(machine_file.read_text())
    del d["summasim_report"]
    legacy.write_text(json.dumps(d))
    assert load_machine(str(legacy)) == load_machine(str(machine_file))
    assert cli.report_kind(d) == "machine"


# -- the output checks -------------------------------------------------------------------
def test_output_refuses_other_files_unless_forced(tmp_path):
    other = tmp_path / "notes.md"
    other.write_text("# my notes\n")
    with pytest.raises(cli.UsageError, match="not a summasim run report; not replacing"):
        cli.check_writable_path(cli.ReportPath(str(other), "run"))
    assert cli.check_writable_path(cli.ReportPath(str(other), "run", force=True)) == str(other)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"summasim_report": "plan"}))
    with pytest.raises(cli.UsageError, match="a summasim plan report, not a run report"):
        cli.check_writable_path(cli.ReportPath(str(plan), "run"))
    same = tmp_path / "run.json"
    assert jsonio.write_report(cli.ReportPath(str(same), "run"), "run", {"ok": True})
    assert cli.check_writable_path(cli.ReportPath(str(same), "run")) == str(same)
    legacy = tmp_path / "old-run.json"                   # a report from before the field
    legacy.write_text(json.dumps({"world_size": 4, "backend": "numpy", "ok": True,
                                  "rows": []}))
    assert cli.check_writable_path(cli.ReportPath(str(legacy), "run")) == str(legacy)
    assert other.read_text() == "# my notes\n"           # the checks wrote nothing


def test_output_never_replaces_special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        with pytest.raises(cli.UsageError, match="written only to a regular file"):
            cli.check_writable_path(cli.ReportPath(str(path), "run", force=True))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_output_makes_no_folder_and_probes_the_name(tmp_path):
    missing = tmp_path / "a" / "b" / "r.json"
    with pytest.raises(cli.UsageError, match="folder .* does not exist"):
        cli.check_writable_path(cli.ReportPath(str(missing), "run"))
    assert not (tmp_path / "a").exists()
    default = cli.ReportPath(str(tmp_path / "results" / "r.json"), "run", default=True)
    assert cli.check_writable_path(default) == default           # a command's own default
    assert (tmp_path / "results").is_dir()
    os.rmdir(tmp_path / "results")            # summasim's own results/ (as in the README) ...
    named = cli.ReportPath(str(tmp_path / "results" / "r.json"), "run")
    assert cli.check_writable_path(named) == named and (tmp_path / "results").is_dir()
    with pytest.raises(cli.UsageError, match="folder .* does not exist"):   # ... only there
        cli.check_writable_path(cli.ReportPath(str(tmp_path / "x" / "results" / "r.json"),
                                               "run"))
    assert not (tmp_path / "x").exists()
    with pytest.raises(cli.UsageError, match="name is too long"):
        cli.check_writable_path(cli.ReportPath(str(tmp_path / ("r" * 300)), "run"))
    assert cli.check_writable_path(str(tmp_path / ("r" * 250))) == str(tmp_path / ("r" * 250))
    assert sorted(os.listdir(tmp_path)) == ["results"]           # every probe cleaned up
    dangling = tmp_path / "dangling.json"
    os.symlink(tmp_path / "gone" / "x", dangling)
    with pytest.raises(cli.UsageError, match="broken symbolic link"):
        cli.check_writable_path(cli.ReportPath(str(dangling), "run"))


def test_force_marks_report_paths_in_either_order():
    for argv in (["--json", "r.json", "--force"], ["--force", "--json", "r.json"]):
        ap = cli.ArgumentParser(prog="t")
        ap.add_argument("--json", type=cli.report_path("run"), action=cli.ReportAction)
        ap.add_argument("--out", type=cli.report_path("machine"), action=cli.ReportAction,
                        default=cli.ReportPath("results/m.json", "machine", default=True))
        cli.add_force(ap)
        args = ap.parse_args(argv)
        assert args.force and args.json.force and args.json.kind == "run"
        assert args.out.force and args.out.default and args.out == "results/m.json"
    args = ap.parse_args(["--json", "r.json"])
    assert not args.force and not args.json.force and not args.out.force


def test_report_path_survives_pickle():
    import pickle

    path = pickle.loads(pickle.dumps(cli.ReportPath("r.json", "run", force=True)))
    assert (path, path.kind, path.force, path.default) == ("r.json", "run", True, False)


def test_late_write_failure_keeps_the_report(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    target = cli.ReportPath(str(folder / "r.json"), "run")
    cli.check_writable_path(target)
    folder.rmdir()                                        # the folder goes away mid-job
    with pytest.raises(jsonio.ReportNotSaved, match="could not be written") as exc:
        jsonio.write_report(target, "run", {"ok": True, "x": float("nan")})
    saved = str(exc.value).split("saved in ")[1].split(" instead")[0]
    try:
        doc = json.loads(open(saved, encoding="utf-8").read())
        assert doc == {"summasim_report": "run", "ok": True, "x": None, "x_nonfinite": "nan"}
    finally:
        os.unlink(saved)
    assert not folder.exists()
    assert not jsonio.write_report(target, "run", {"ok": True}, prog="prog")
    err = capsys.readouterr().err
    assert err.startswith("prog: error: ") and err.count("\n") == 1
    os.unlink(err.split("saved in ")[1].split(" instead")[0])


@pytest.mark.parametrize("cmd", [("devset",), ("plan", "--model", "tiny", "--devices", "4"),
                                 ("predict", "--model", "tiny", "--mesh", "dp=4")])
def test_a_late_write_failure_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys, cmd):
    """A report the serial front-ends cannot write after the work (the disk filled, the
    folder went away) is found after the preflight, so it is not a user error: one line
    saying where the report went, exit 1, as the MPI front-ends (never a traceback)."""
    from summasim.costmodel.__main__ import main

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonio, "write_text_atomic", full)
    status = main([*cmd, "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert status == 1, err
    assert err.count("\n") == 1 and "No space left" in err and "saved in " in err, err
    os.unlink(err.split("saved in ")[1].split(" instead")[0])


def test_a_file_put_at_the_path_during_the_job_is_not_replaced(tmp_path):
    """The preflight found no file at --json; one written there while the job ran (not a
    report) is left alone: the report goes to the temp folder and the error says so."""
    target = cli.ReportPath(str(tmp_path / "r.json"), "run")
    cli.check_writable_path(target)
    (tmp_path / "r.json").write_text("precious\n")
    with pytest.raises(jsonio.ReportNotSaved, match="not a summasim") as exc:
        jsonio.write_report(target, "run", {"ok": True})
    assert (tmp_path / "r.json").read_text() == "precious\n"
    os.unlink(str(exc.value).split("saved in ")[1].split(" instead")[0])
    # an earlier report of the same kind is replaced, as at the preflight
    os.unlink(tmp_path / "r.json")
    jsonio.write_report(target, "run", {"ok": 1})
    jsonio.write_report(target, "run", {"ok": 2})
    assert json.loads((tmp_path / "r.json").read_text())["ok"] == 2


def test_a_link_to_a_report_keeps_the_link(tmp_path):
    real = tmp_path / "real.json"
    jsonio.write_report(str(real), "run", {"ok": 1})
    link = tmp_path / "link.json"
    link.symlink_to(real)
    jsonio.write_report(cli.ReportPath(str(link), "run"), "run", {"ok": 2})
    assert link.is_symlink() and json.loads(real.read_text())["ok"] == 2
    # every atomic writer (explore's CSV too) writes through a link
    csv, csv_link = tmp_path / "t.csv", tmp_path / "t-link.csv"
    csv.write_text("old\n")
    csv_link.symlink_to(csv)
    jsonio.write_text_atomic(str(csv_link), "new\n")
    assert csv_link.is_symlink() and csv.read_text() == "new\n"


# -- the commands -------------------------------------------------------------------------
def test_predict_refuses_special_machine_files(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for machine, word in ((deep, "deeper than"), (fifo, "FIFO"), ("/dev/zero", "device")):
        res = _run(*PREDICT, "--machine", machine)
        _user_error(res, "--machine", machine, word)
        assert res.took < 60, res.took
    res = _run("-m", "summasim.costmodel", "plan", "--model", "tiny", "--devices", "4",
               "--machine", deep)
    _user_error(res, "--machine", "deeper than")


def test_predict_outputs(tmp_path):
    notes = tmp_path / "setup.cfg"
    notes.write_text("[metadata]\n")
    _user_error(_run(*PREDICT, "--json", notes), "--json", "not replacing", "--force")
    assert notes.read_text() == "[metadata]\n"
    _user_error(_run(*PREDICT, "--json", tmp_path / "new" / "p.json"), "does not exist")
    assert not (tmp_path / "new").exists()
    _user_error(_run(*PREDICT, "--json", tmp_path / ("p" * 300)), "too long")
    out = tmp_path / "p.json"
    for _ in range(2):                                    # its own report may be replaced
        res = _run(*PREDICT, "--json", out)
        assert res.returncode == 0, res.stderr
        assert json.loads(out.read_text())["summasim_report"] == "predict"
    res = _run(*PREDICT, "--json", notes, "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads(notes.read_text())["summasim_report"] == "predict"


def test_fit_out_refused_before_mpi(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# hello\n")
    res = _run("-m", "summasim.costmodel", "fit", "--quick", "--out", readme)
    _user_error(res, "--out", "not replacing")
    assert readme.read_text() == "# hello\n"


@pytest.mark.parametrize("case", ["deep", "fifo", "zero", "readme", "nodir"])
def test_main_job_user_errors_under_mpi(tmp_path, case):
    """`mpiexec -n 2 python -m summasim.run`: each bad file is one line and exit 2 on
    every rank, well inside the timeout (no rank left waiting)."""
    readme = tmp_path / "README.md"
    readme.write_text("# hello\n")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    extra, words = {"deep": (["--machine", deep], ["deeper than"]),
                    "fifo": (["--machine", fifo], ["FIFO"]),
                    "zero": (["--machine", "/dev/zero"], ["device"]),
                    "readme": (["--json", readme], ["not replacing"]),
                    "nodir": (["--json", tmp_path / "nodir" / "r.json"], ["does not exist"]),
                    }[case]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    from conftest import mpiexec_command

    cmd = ["timeout", "100", *mpiexec_command(), "-n", "2", sys.executable, "-m", "summasim.run",
           "--sizes", "8", "8", "8", "--schemes", "none", "--meshes", "none", *map(str, extra)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    report = f"rc={res.returncode}\n{res.stdout}\n{res.stderr}"
    assert res.returncode == 2, report
    assert "Traceback" not in res.stderr, report
    errors = [ln for ln in res.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, report
    for word in words:
        assert word in errors[0], report
    assert readme.read_text() == "# hello\n" and not (tmp_path / "nodir").exists()


def test_csv_and_plots_replace_only_their_own_kind_of_file(tmp_path):
    """explore --csv, explore --plot and plan --plot never write over a file that is not
    what they write (a CSV that begins ``table,``, a PNG) without --force, and refuse a
    plot path that is not a PNG before the search runs."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    explore = ("-m", "summasim.costmodel", "explore", "--p", "4", "--no-iso")
    _user_error(_run(*explore, "--csv", notes), "--csv", "not replacing", "--force")
    assert notes.read_text() == "mine\n"
    out = tmp_path / "e.csv"
    for _ in range(2):                                    # its own CSV may be replaced
        res = _run(*explore, "--csv", out)
        assert res.returncode == 0 and out.read_text().startswith("table,"), res.stderr
    res = _run(*explore, "--csv", notes, "--force")
    assert res.returncode == 0 and notes.read_text().startswith("table,"), res.stderr
    fake = tmp_path / "plots" / "scaling.png"
    fake.parent.mkdir()
    fake.write_text("not an image\n")
    _user_error(_run(*explore, "--plot", "--outdir", fake.parent), "scaling.png",
                "not replacing")
    assert fake.read_text() == "not an image\n"
    plan = ("-m", "summasim.costmodel", "plan", "--model", "tiny", "--devices", "4")
    _user_error(_run(*plan, "--plot", tmp_path / "plan.txt"), "--plot", ".png")
    _user_error(_run(*plan, "--plot", fake), "--plot", "not replacing")
    assert fake.read_text() == "not an image\n"
    png = tmp_path / "plan.png"
    for _ in range(2):
        res = _run(*plan, "--plot", png)
        assert res.returncode == 0, res.stderr
        assert png.read_bytes().startswith(cli.FILE_SIGNATURES["png"])


def test_a_write_cut_short_by_a_signal_leaves_no_temp_file(tmp_path, monkeypatch):
    """A rank that ends at once on SIGINT or SIGTERM (``os._exit``: no ``finally``) while
    it writes a report first unlinks the temp files of writes in progress; the report
    keeps its old contents."""
    target = tmp_path / "r.json"
    target.write_text("old\n")
    seen = []

    def cut(tmp, path):                  # the signal lands between the write and the rename
        seen.append(os.path.exists(tmp))
        jsonio.discard_unfinished()      # what mpiutil.end_on_signals does before _exit
        seen.append(os.path.exists(tmp))
        raise SystemExit(143)

    monkeypatch.setattr(jsonio.os, "replace", cut)
    with pytest.raises(SystemExit):
        jsonio.write_text_atomic(str(target), "new\n")
    assert seen == [True, False]
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["r.json"]
    assert not jsonio._WRITING
