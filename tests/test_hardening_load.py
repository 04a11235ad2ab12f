"""Numbers that say how far to trust them, and fits that are safe to run concurrently.

Each benchmark, the main job and every machine fit measure the CPU that other processes
used while they ran (:mod:`summasim.harness.load`), mark their rows and reports with it,
and warn; a fit's decision, its warnings and its saved mark come from the same readings;
every fit takes one host-wide lock. Most cases replace the load reader
(``load.read_counters``) with a scripted one; a few run a real busy process or a real
``mpiexec -n 2`` under a timeout.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import mpiexec_command
from summasim.harness import load
from summasim.harness import machinefile as mf
from summasim.harness import fitbench as fitmod
from summasim.harness.report import format_prediction_summary, prediction_summary

MPI = pytest.importorskip("mpi4py.MPI")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counters(t, busy, ours=None, loadavg=1.0, hz=100):
    return {"t": t, "busy": busy, "ours": {} if ours is None and busy is not None else ours,
            "loadavg": loadavg, "hz": hz}


class Script:
    """A load reader that returns the readings it is given, in order (the last again)."""

    def __init__(self, readings):
        self.readings, self.calls = list(readings), 0

    def __call__(self, exclude=()):
        self.calls += 1
        return self.readings[min(self.calls, len(self.readings)) - 1]


# --------------------------------------------------------------------------- the reading
def test_interval_load_counts_other_processes_and_not_ours():
    """Over 2 s the machine was busy 300 ticks (3 s of CPU at 100 Hz); our ranks used
    200 of them: the other processes used 0.5 cores, which is busy."""
    a = _counters(10.0, 1000, {11: 50, 12: 70})
    b = _counters(12.0, 1300, {11: 150, 12: 170})
    rec = load.interval_load(a, b, limit=0.25)
    assert rec["source"] == "proc" and rec["seconds"] == 2.0
    assert rec["foreign_cpu"] == pytest.approx(0.5) and rec["quiet"] is False
    quiet = load.interval_load(a, _counters(12.0, 1210, {11: 150, 12: 170}), limit=0.25)
    assert quiet["foreign_cpu"] == pytest.approx(0.05) and quiet["quiet"] is True
    # a process of ours that started inside the interval counts whole as ours
    late = load.interval_load(a, _counters(12.0, 1300, {11: 150, 12: 170, 13: 100}))
    assert late["foreign_cpu"] == pytest.approx(0.0) and late["quiet"] is True


def test_read_counters_sees_a_real_foreign_spinner():
    """A real busy process outside our tree (double-forked, so not our child) spinning
    through the interval is counted as other work: the interval is not quiet."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 4: pass\n"
    sh = subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 & "
                         f"echo $!"], capture_output=True, text=True, timeout=30)
    pid = int(sh.stdout.strip())
    try:
        time.sleep(0.3)
        watch = load.LoadWatch(None)
        time.sleep(1.5)
        rec = watch.stop()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rec["source"] != "proc":
        pytest.skip("no /proc/stat here")
    assert rec["quiet"] is False and rec["foreign_cpu"] > 0.25, rec


def test_load_appearing_only_after_a_quiet_start_is_seen_by_the_interval():
    """A snapshot before the timed work saw nothing; the other work started while it ran
    (readings 2 -> 3): the lap that covers it is busy, the one before stays quiet, and the
    whole interval is busy."""
    fake = Script([_counters(0.0, 0), _counters(1.0, 5), _counters(2.0, 205)])
    watch_reads = load.read_counters
    try:
        load.read_counters = fake
        watch = load.LoadWatch(None)
        first, second = watch.lap(), watch.lap()
        whole = load.interval_load(fake.readings[0], fake.readings[2])
    finally:
        load.read_counters = watch_reads
    assert first["quiet"] is True and first["foreign_cpu"] == pytest.approx(0.05)
    assert second["quiet"] is False and second["foreign_cpu"] == pytest.approx(2.0)
    both = load.combine([first, second])
    assert both["quiet"] is False and both["busy_intervals"] == 1 and both["intervals"] == 2
    assert whole["quiet"] is False


def test_without_proc_the_load_average_decides_and_without_both_nothing_is_claimed(
        monkeypatch):
    """No /proc/stat: the load average less our ranks (2 ranks, load average 2.1: quiet;
    3.5: busy). Neither: quiet is None, the report says the load was not measured, and no
    warning claims a quiet or a busy machine."""
    monkeypatch.setattr(load, "_cpu_busy_ticks", lambda: None)
    rec = load.interval_load(_counters(0, None, None, 2.1), _counters(1, None, None, 2.1),
                             ranks=2)
    assert rec["source"] == "loadavg" and rec["quiet"] is True
    busy = load.interval_load(_counters(0, None, None, 2.0), _counters(1, None, None, 3.5),
                              ranks=2)
    assert busy["quiet"] is False and busy["foreign_cpu"] == pytest.approx(1.5)
    assert load.read_counters()["busy"] is None          # the real reader, /proc/stat gone
    none = load.interval_load(_counters(0, None, None, None), _counters(1, None, None, None))
    assert none["source"] == "none" and none["quiet"] is None and none["foreign_cpu"] is None
    assert load.warning(none, "x ran") is None and "not measured" in load.describe(none)
    summary = prediction_summary([(1.0, 1.5, "a")], none)
    assert summary["quiet"] is None
    assert "load was not measured" in format_prediction_summary(summary, "m")


# --------------------------------------------------------------------------- the main job
def test_the_main_jobs_prediction_error_says_when_the_run_was_not_quiet():
    """Predictions 45% off under load: the summary (JSON) carries the load and quiet=False,
    and its line warns next to the error; on a quiet machine it says quiet, no warning."""
    busy = load.interval_load(_counters(0.0, 0), _counters(10.0, 1200))   # 1.2 cores
    summary = prediction_summary([(1.0, 1.45, "summa_ab 2x2"), (2.0, 3.4, "x")], busy)
    assert summary["quiet"] is False and summary["load"]["foreign_cpu"] == pytest.approx(1.2)
    text = format_prediction_summary(summary, "local")
    assert text.startswith("cost model (local): MAPE")
    assert "WARNING: measured while other work ran (other processes used 1.20 cores" in text
    quiet = load.interval_load(_counters(0.0, 0), _counters(10.0, 10))
    text = format_prediction_summary(prediction_summary([(1.0, 1.1, "a")], quiet), "local")
    assert "WARNING" not in text and "the machine was quiet (other processes used 0.01" in text
    json.dumps(summary)                                   # the report stays valid JSON


def test_a_product_row_timed_under_load_is_marked_in_table_and_json():
    """run.py's row: the record carries the lap's load and quiet=False; the table row ends
    with BUSY and the cores; a quiet row has no mark."""
    from summasim.harness.report import format_row, row_record

    from summasim.harness.plan import plan_products

    cases, _ = plan_products(1, ["summa_ab"], (8, 8, 8), None, ["float64"])
    from summasim.backends import get_backend
    from summasim.harness.execute import run_product

    res = run_product(cases[0], MPI.COMM_SELF, get_backend("numpy"), repeats=1,
                      method="exact")
    busy = load.interval_load(_counters(0.0, 0), _counters(1.0, 90))
    quiet = load.interval_load(_counters(0.0, 0), _counters(1.0, 1))
    rec = row_record(res, None, load=busy)
    assert rec["quiet"] is False and rec["load"]["foreign_cpu"] == pytest.approx(0.9)
    assert format_row(res, None, busy).endswith("  BUSY 0.90")
    assert "BUSY" not in format_row(res, None, quiet)
    assert row_record(res, None, load=quiet)["quiet"] is True


# --------------------------------------------------------------------------- benchmarks
def test_bench_gemm_labels_a_ceiling_measured_under_load(monkeypatch):
    """bench gemm at p = 1 with a scripted load of 1.5 cores while each ceiling and product
    ran: every row says ceiling_under_load, its table row ends BUSY, and one warning says
    the % ceiling is not the algorithm's."""
    from summasim.bench import gemm

    clock = {"t": 0.0, "busy": 0}

    def busy_reader(exclude=()):
        clock["t"] += 1.0
        clock["busy"] += 150
        return _counters(clock["t"], clock["busy"])

    monkeypatch.setattr(load, "read_counters", busy_reader)
    said = []
    rows = gemm.bench_gemm(MPI.COMM_SELF, 64, np.float64, 1, ["summa_ab"], said.append)
    assert rows and all(r["ceiling_under_load"] and r["quiet"] is False for r in rows)
    assert rows[0]["load"]["foreign_cpu"] == pytest.approx(1.5)
    table = [s for s in said if s.startswith("summa_ab")]
    assert table and table[0].endswith("BUSY 1.50")
    warn = [s for s in said if s.startswith("WARNING")]
    assert len(warn) == 1 and "ceilings were measured under load" in warn[0]
    report = {}
    from summasim.harness.report import mark_report

    mark_report(report, "gemm", [r["load"] for r in rows])
    assert report["load"]["gemm"]["quiet"] is False

    monkeypatch.setattr(load, "read_counters",
                        lambda exclude=(): _counters(clock.__setitem__("t", clock["t"] + 1)
                                                     or clock["t"], 0))
    said.clear()
    rows = gemm.bench_gemm(MPI.COMM_SELF, 64, np.float64, 1, ["summa_ab"], said.append)
    assert rows[0]["quiet"] is True and not rows[0]["ceiling_under_load"]
    assert not [s for s in said if s.startswith("WARNING")]


def test_bench_allreduce_prints_one_statistic_inside_its_own_interval(tmp_path):
    """mpiexec -n 2 bench allreduce, 9 repeats: the printed "vs plain", "vs MPI" and
    "call/out" are the medians of the paired ratios (the JSON's), each inside the
    interval printed beside it; each row and the report carry the load."""
    out = tmp_path / "ar.json"
    proc = subprocess.run(
        ["timeout", "150", *mpiexec_command(), "-n", "2", sys.executable, "-m", "summasim.bench",
         "allreduce", "--sizes-mib", "0.0625,0.25", "--repeats", "9", "--no-predict",
         "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    lines = [ln for ln in proc.stdout.splitlines()
             if ln.split() and ln.split()[0] in ("0.0625", "0.25")]
    assert len(lines) == 2, proc.stdout
    for line, row in zip(lines, report["allreduce"]):
        cells = re.findall(r"(\S+)x\s+\[(\S+),(\S+)\]", line)
        assert len(cells) == 3, line
        for (shown, low, high), key in zip(cells, ("vs_plain_paired", "vs_mpi_paired",
                                                   "call_vs_out_paired")):
            shown, low, high = float(shown), float(low), float(high)
            assert shown == pytest.approx(row[key]["median"], abs=0.006), (line, row[key])
            assert low <= shown <= high, (line, row[key])
        assert row["load"]["source"] in ("proc", "loadavg", "none")
        assert row["quiet"] == row["load"]["quiet"]
        words = line.split()
        assert words[-1] in ("quiet", "?") or words[-2] == "BUSY", line
    assert set(report["load"]) == {"allreduce"}


# --------------------------------------------------------------------------- fits
def test_fit_conditions_mark_load_seen_only_during_the_fit():
    """Quiet just before and just after, 0.8 cores in one phase of the fit: busy, with the
    phase's reading recorded; quiet throughout: not busy."""
    before = {"foreign_cpu": 0.0, "loadavg": 1.0, "time": "t"}
    after = {"foreign_cpu": 0.1, "loadavg": 1.2, "time": "u"}
    during = load.combine([load.interval_load(_counters(0, 0), _counters(1, 5)),
                           load.interval_load(_counters(1, 5), _counters(2, 85))])
    fc = load.fit_conditions(before, after, during)
    assert fc["busy"] is True and fc["foreign_cpu_during"] == pytest.approx(0.8)
    quiet = load.fit_conditions(before, after,
                                load.interval_load(_counters(0, 0), _counters(1, 5)))
    assert quiet["busy"] is False


def test_the_saved_mark_is_the_fits_own_even_when_it_is_quiet_afterwards(tmp_path,
                                                                         monkeypatch):
    """The main job's quick fit: run_fit saw load during the fit and marked its machine busy;
    the machine is quiet by the time it is saved. The saved file keeps the fit's own mark
    (one measurement decides, warns and marks), and the run says it is busy."""
    from tests.test_machine_trust import _fitted

    monkeypatch.setattr(load, "foreign_cpu", lambda interval=1.0, exclude=(): 0.0)
    monkeypatch.setattr(mf, "FIT_RANKS", 1)
    marked = _fitted(fit_conditions={"foreign_cpu_before": 0.0, "foreign_cpu_after": 0.0,
                                     "foreign_cpu_during": 1.3, "loadavg": 2.0,
                                     "time": "t", "limit": 0.25, "busy": True})
    seen = {}

    def fake(comm, **kw):
        seen.update(kw)
        return marked

    monkeypatch.setattr(fitmod, "run_fit", fake)
    said = []
    path = str(tmp_path / "results" / "machine.json")
    got = mf.resolve_machine(None, MPI.COMM_SELF, said.append, path=path,
                             calibrated=str(tmp_path / "none.json"))
    from summasim.costmodel.machine import Machine

    saved = Machine.load(path)
    assert saved.fitted_busy and saved.fit_conditions["foreign_cpu_during"] == 1.3
    assert got.fitted_busy and any("marked busy" in s for s in said)
    # the snapshot that decided to fit is the one the fit warns from
    assert seen["before"]["foreign_cpu"] == 0.0 and os.getpid() in seen["exclude"]


def _hold_lock(base: str) -> subprocess.Popen:
    """Another process that holds the fit lock ``base + ".lock"`` for a minute (it
    prints "locked" once it does)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        fd = os.open({base + '.lock'!r}, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)


def test_a_lock_file_left_by_a_killed_process_blocks_nobody(tmp_path):
    """A process took the fit lock and was SIGKILLed: its lock file stays, the kernel
    dropped its lock, and the next fit takes it at once, without a waiting message."""
    base = str(tmp_path / "fit")
    holder = _hold_lock(base)
    try:
        assert holder.stdout.readline().strip() == "locked"
        said = []
        busy = load.FitLock(base)
        assert busy.acquire(said.append, max_wait=0.3) is False       # held while alive
        assert said and "is locked" in said[0]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert os.path.exists(base + ".lock")
    said = []
    lock = load.FitLock(base)
    t0 = time.monotonic()
    assert lock.acquire(said.append, max_wait=5.0) is True
    assert time.monotonic() - t0 < 0.5 and said == [] and lock.waited < 0.5
    lock.release()


def test_two_fits_racing_the_second_waits_then_refuses_on_every_rank(tmp_path):
    """mpiexec -n 2: another fit holds the host's fit lock; run_fit waits (and says so),
    then raises FitBusy on both ranks (no rank left in a collective) without measuring;
    once the lock is free it is taken at once."""
    base = str(tmp_path / "host-fit")
    holder = _hold_lock(base)
    script = textwrap.dedent(f"""
        from mpi4py import MPI
        from summasim.harness import fitbench, load
        load.HOST_FIT_LOCK = {base!r}
        comm = MPI.COMM_WORLD
        try:
            fitbench.run_fit(comm, quick=True, lock_wait=1.0,
                             say=lambda m: print("said:", m, flush=True))
            print("rank", comm.Get_rank(), "FITTED", flush=True)
        except load.FitBusy as exc:
            print("rank", comm.Get_rank(), "FitBusy", exc, flush=True)
    """)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = subprocess.run(["timeout", "90", *mpiexec_command(), "-n", "2", sys.executable, "-c",
                               script], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        holder.kill()
        holder.wait(timeout=30)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0 FitBusy" in out and "rank 1 FitBusy" in out and "FITTED" not in out, out
    assert "another fit is measuring this machine" in out
    assert "ping-pong" not in out                                 # nothing was measured


def test_training_rows_timed_under_load_are_marked_and_carry_their_load():
    """The main job's scheme and mesh rows, like its product rows, end ``BUSY n.nn``
    when other processes used more than the limit while they ran, and their JSON
    records keep that load; a quiet row has no mark."""
    from summasim.harness.composed import MeshReport
    from summasim.harness.report import (format_mesh_row, format_transformer, mesh_record,
                                         transformer_record)
    from summasim.harness.transformer import SchemeReport

    busy = {"foreign_cpu": 1.25, "quiet": False, "limit": 0.5}
    quiet = {"foreign_cpu": 0.01, "quiet": True, "limit": 0.5}
    mesh = MeshReport("dp=2,pp=2,tp=megatron:1", 0, "1f1b", 2, False, 4, "float64", 3, 1e-12)
    scheme = SchemeReport("megatron", "1D p=4", 4, 1, 1, "float64")
    for load, want in ((busy, "BUSY 1.25"), (quiet, None), (None, None)):
        mesh.load = scheme.load = load
        row = format_mesh_row(mesh, 24).split("\n")[0]
        table = format_transformer([scheme]).split("\n")[2]
        for line in (row, table):
            assert (line.endswith("  " + want) if want else "BUSY" not in line), line
        assert mesh_record(mesh)["load"] == load and transformer_record(scheme)["load"] == load


def test_a_failed_mesh_check_names_the_worst_value_only_when_values_failed():
    """The line under a failed mesh row names the failed checks; "worst value" names the
    worst parameter only when the values themselves failed, not when only the traffic
    or Table 1 check did (the values passed there)."""
    from summasim.harness.composed import MeshReport
    from summasim.harness.report import format_mesh_row

    r = MeshReport("tp=3d:2x2x2", 0, "1f1b", 1, False, 8, "float64", 3, 1e-12,
                   worst="step 3 param h0.ln1.b", failures=["table1"], values_ok=True)
    line = format_mesh_row(r, 24).split("\n")[1]
    assert "failed checks: table1" in line and "worst value" not in line, line
    r.values_ok = False
    line = format_mesh_row(r, 24).split("\n")[1]
    assert "failed checks: table1, values (worst value: step 3 param h0.ln1.b)" in line, line


def test_a_chain_that_ends_in_the_interval_counts_only_its_cpu_inside_it(monkeypatch):
    """shell -> timeout -> mpiexec -> python, all but the shell ending inside the
    interval: the shell's reaped-children time grows by the whole chain's life (python's
    150 ticks before the interval and 20 in it), and only the 20 are load. The python's
    parent ended too, so its life was counted whole: 1.7 cores for 0.2."""
    from summasim.harness import load as ld

    before = {10: (1, 0, 0), 11: (10, 1, 0), 12: (11, 2, 0), 13: (12, 150, 0)}
    after = {10: (1, 0, 1 + 2 + 170)}                 # timeout, mpiexec, python: reaped
    snaps = iter([before, after])
    clock = iter([0.0, 0.0, 1.0, 1.0])
    monkeypatch.setattr(ld, "_proc_cpu_ticks", lambda: next(snaps))
    monkeypatch.setattr(ld.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(ld.time, "sleep", lambda s: None)
    monkeypatch.setattr(ld.os, "sysconf", lambda name: 100)
    assert ld.foreign_cpu(1.0) == pytest.approx(0.2)
