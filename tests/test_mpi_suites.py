"""Launch the MPI suites and the main job under mpiexec, each under a timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpi_env
from summasim.algorithms.table import ALGORITHMS

SUITE_TIMEOUT = int(os.environ.get("SUMMASIM_MPI_TIMEOUT", "900"))


def launch(mpiexec, n, args, timeout, echo=None):
    """Run ``args`` under ``mpiexec -n n`` and ``timeout``; returns the finished process
    and its seconds. With ``echo``, stdout and stderr are read as one stream, line by
    line, and each line is handed to ``echo`` as it comes."""
    cmd = ["timeout", "-k", "10", str(timeout)] + mpiexec + ["-n", str(n), sys.executable] + args
    t0 = time.perf_counter()
    if echo is None:
        proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True)
        return proc, time.perf_counter() - t0
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            lines.append(line)
            echo(line.rstrip("\n"))
    proc = subprocess.CompletedProcess(cmd, child.returncode, "".join(lines), "")
    return proc, time.perf_counter() - t0


PROGRESS = re.compile(r"\[\s*(\d+)%\]\s*$")


@pytest.mark.parametrize("n,backend", [(1, "numpy"), (4, "numpy"), (8, "numpy"), (9, "numpy"),
                                       (16, "numpy"), (4, "staged-host"), (4, "ipc-host")])
def test_mpi_suite(mpiexec, n, backend, capsys):
    """mpi_tests under mpiexec -n N; staged-host and ipc-host run the suite through the GPU's
    staged and device-to-device (IPC) paths.
    Its progress (pytest's percentage, as rank 0 prints it) shows while it runs."""
    name = f"mpi_tests -n {n}" + (f" --backend {backend}" if backend != "numpy" else "")

    def echo(line):
        m = PROGRESS.search(line)
        if m:
            with capsys.disabled():
                print(f"\n    {name}: {m.group(1)}%", end="", flush=True)

    proc, seconds = launch(mpiexec, n, ["-m", "mpi4py", "-m", "pytest", "mpi_tests", "-q",
                                        "-p", "no:cacheprovider", "-o", "addopts=", "-rs",
                                        "--backend", backend], SUITE_TIMEOUT, echo=echo)
    with capsys.disabled():
        print(f"\n    {name}: done in {seconds:.0f} s ", end="", flush=True)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode != 124, f"mpi_tests at n={n} timed out:\n{tail}"
    assert proc.returncode == 0, f"mpi_tests at n={n} failed:\n{tail}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_main_job_reports_and_writes_json(mpiexec, tmp_path):
    path = tmp_path / "run.json"
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", "--sizes", "96", "64", "80",
                                  "--ring-size", "1001", "--repeats", "2", "--dtype", "both",
                                  "--machine", "local-2core-mpich", "--json", str(path)], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    assert report["world_size"] == 4 and report["ok"] is True
    # what reproduces it: the command line, the seed, the repeats
    assert report["command"][0] == "python -m summasim.run" and \
        report["command"][1:5] == ["--sizes", "96", "64", "80"]
    assert (report["seed"], report["repeats"], report["check"]) == (0, 2, "auto")
    names = {(r["algorithm"], r["dtype"]) for r in report["rows"]}
    assert ("summa_abt", "float32") in names and ("ring_allreduce", "float64") in names
    assert ("summa25_atb", "float64") in names  # on [1, 1, 4]
    for r in report["rows"]:
        assert r["ok"] and r["error"] <= r["bound"] and r["seconds"] > 0
        assert r["predicted"] > 0 and r["prediction_error"] == pytest.approx(
            (r["predicted"] - r["seconds"]) / r["seconds"])
    tf = report["transformer"]
    # p = 4: Optimus 2x2, and SUMMA2.5-LM on the rectangular layers [1,2,2] and [2,1,2]
    assert {(r["scheme"], r["grid"], r["dtype"]) for r in tf} == {
        (name, grid, dt) for dt in ("float64", "float32") for name, grid in (
            ("megatron", "1D p=4"), ("optimus", "2x2"), ("summa25", "[1,2,2]"),
            ("summa25", "[2,1,2]"))}
    for r in tf:
        assert r["ok"] and max(r["loss_err"], r["logits_err"], r["grad_err"]) <= r["bound"]
        assert r["tp_fwd"] == r["table1"]["fwd"] > 0
        assert r["tp_bwd_checkpoint"] == r["table1"]["bwd_checkpoint"]
        assert r["memory"]["params"] > 0 and r["memory_formula"]["params"] > 0
    assert [s["scheme"] for s in report["transformer_skipped"]] == ["3d"]  # p = 4
    # the default composition at p = 4: data and pipeline parallelism around Megatron,
    # in each dtype of --dtype both
    meshes = report["meshes"]
    assert [m["dtype"] for m in meshes] == ["float64", "float32"]
    for r in tf:                     # each row names its model and batch
        assert (r["case"]["h"], r["case"]["heads"], r["case"]["b"]) == (64, 16, r["batch"])
    for mesh in meshes:
        assert mesh["mesh"] == "dp=2,pp=2,tp=megatron:1" and mesh["ok"] and mesh["values_ok"]
        assert (mesh["case"]["h"], mesh["case"]["b"], mesh["case"]["m"]) == (64, 8, 2)
        assert mesh["traffic"] == mesh["traffic_expected"] and mesh["traffic"]["dp.grads"] > 0
        assert mesh["memory"]["total"] == mesh["memory_formula"]["total"] > 0
    assert meshes[0]["memory"]["total"] == 2 * meshes[1]["memory"]["total"]   # 8 B and 4 B
    assert meshes[1]["bound"] > meshes[0]["bound"]
    assert sum(ln.startswith("dp=2,pp=2,tp=megatron:1 ") for ln in proc.stdout.splitlines()) == 2
    assert proc.stdout.count(" OK ") == len(report["rows"]) + len(tf) + 2
    assert report["machine"] == "local-2core-mpich" and "MAPE" in proc.stdout
    errs = [abs(r["prediction_error"]) for r in report["rows"]]
    for r in tf:        # every timed training step has a prediction too
        step = r["fwd_s"] + r["bwd_s"]
        assert r["predicted_s"] > 0
        errs.append(abs(r["predicted_s"] - step) / step)
    for mesh in meshes:                                      # and the mesh steps
        assert mesh["predicted_s"] > 0 and mesh["step_s"] > 0
        errs.append(abs(mesh["predicted_s"] - mesh["step_s"]) / mesh["step_s"])
    assert report["prediction"]["count"] == len(report["rows"]) + len(tf) + 2
    assert report["prediction"]["mape"] == pytest.approx(sum(errs) / len(errs))


def test_main_job_at_a_world_size_without_square_grid(mpiexec):
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.run", "--sizes", "32", "16", "24",
                                  "--repeats", "1", "--algorithms", "summa_ab,summa25_ab,cannon_ab",
                                  "--no-predict"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cannon_ab: needs a square number of ranks" in proc.stdout
    assert re.search(r"^summa_ab\s+1x2\s", proc.stdout, re.M) and "[1,1,2]" in proc.stdout


@pytest.mark.parametrize("p,sizes,grids", [
    (6, (101, 67, 83), {"summa_ab": "2x3", "summa25_atb": "[1,3,2]"}),
    (12, (101, 67, 83), {"summa_abt": "3x4", "summa25_ab": "[2,2,3]"}),
    (24, (101, 67, 83), {"summa_atb": "4x6", "summa25_abt": "[2,2,6]"}),
    (27, (63, 45, 54), {"mm3d_ab": "3x3x3", "sd25_ab": "[3,3,3]", "summa_ab": "3x9"})])
def test_main_job_on_rectangular_grids_and_sizes_that_do_not_divide(mpiexec, tmp_path, p,
                                                                    sizes, grids):
    """At p = 6, 12 and 24 SUMMA runs on the most square pr x pc grid and SUMMA2.5 on
    [pr, pc, d], on sizes no grid dimension divides; at 27 the 3D cube and the 2.5D
    product with c = 3 copies. Every row validates and its ledger is priced."""
    path = tmp_path / "run.json"
    proc, _ = launch(mpiexec, p, ["-m", "summasim.run", "--sizes", *map(str, sizes),
                                  "--repeats", "1", "--schemes", "none", "--meshes", "none",
                                  "--algorithms", ",".join(n for n in ALGORITHMS
                                                           if n != "ring_allreduce"),
                                  "--json", str(path)], 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(path.read_text())
    ran = {r["algorithm"]: r["grid"] for r in report["rows"]}
    assert report["ok"] and all(r["ok"] and r["error"] <= r["bound"] for r in report["rows"])
    for name, grid in grids.items():
        assert ran[name] == grid, (name, ran)
    assert all(r["bytes_per_rank"] > 0 for r in report["rows"]), report["rows"]


def test_one_failing_rank_aborts_the_whole_job(mpiexec):
    proc, seconds = launch(mpiexec, 16, ["-m", "summasim.run", "--algorithms", "summa_ab",
                                         "--sizes", "64", "64", "64", "--fail-on-rank", "3",
                                         "--no-predict"], 180)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), out[-3000:]
    assert "[rank 3/16] unhandled exception" in out and "deliberate failure on rank 3" in out
    assert "Traceback" in out
    print(f"abort of a 16-rank job took {seconds:.1f} s")


@pytest.mark.parametrize("owner,attr,args", [
    ("summasim.transformer.megatron", "backward", ["--schemes", "megatron", "--meshes", "none"]),
    ("summasim.transformer.composed.Trainer", "step",
     ["--schemes", "none", "--mesh", "dp=2,pp=2,tp=megatron:1"])])
def test_one_failing_rank_in_a_training_row_aborts_the_job(mpiexec, owner, attr, args):
    """An exception on one rank inside a scheme or mesh row (after the reference is
    shared) ends the job with its traceback; the others must not wait in a collective
    cleanup (the shared window's free) for a rank that will never come."""
    mod, _, cls = owner.rpartition(".") if attr == "step" else (owner, "", "")
    code = "\n".join([
        "import importlib, sys",
        "from mpi4py import MPI",
        "import summasim.run as r",
        f"o = importlib.import_module({mod!r})",
        f"o = getattr(o, {cls!r})" if cls else "",
        f"f = getattr(o, {attr!r})",
        "def bad(*a, **k):",
        "    if MPI.COMM_WORLD.rank == 1:",
        "        raise RuntimeError('deliberate failure in a row')",
        "    return f(*a, **k)",
        f"setattr(o, {attr!r}, bad)",
        f"sys.exit(r.main(['--algorithms', 'none', '--repeats', '1', '--no-predict', *{args!r}]))"])
    proc, _ = launch(mpiexec, 4, ["-c", code], 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), out[-3000:]
    assert "[rank 1/4] unhandled exception" in out and "deliberate failure in a row" in out, \
        out[-3000:]


def test_failed_validation_exits_nonzero(mpiexec):
    """A run whose result is wrong must FAIL and exit 1 (the bound is not a formality)."""
    code = ("import sys, summasim.algorithms as a, summasim.run as r;"
            "orig = a.summa_ab;"
            "a.summa_ab = lambda x, y, g, out=None, **kw: orig(x, y, g) * (1 + 1e-9);"
            "sys.exit(r.main(['--algorithms', 'summa_ab', '--sizes', '32', '32', '32',"
            " '--repeats', '1', '--no-predict', '--schemes', 'none']))")
    proc, _ = launch(mpiexec, 4, ["-c", code], 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert " FAIL " in proc.stdout and "1 failed" in proc.stdout


def test_bench_runs_and_reports(mpiexec, tmp_path):
    """All three benchmarks at toy sizes: every row is there and self-consistent."""
    path = tmp_path / "bench.json"
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.bench", "all", "--n", "128", "--repeats", "2",
                                  "--sizes-mib", "0.25", "--model",
                                  "h=16,heads=4,layers=1,seq=8,vocab=16", "--batch", "4",
                                  "--machine", "local-2core-mpich",
                                  "--json", str(path)], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    gemm = {r["algorithm"]: r for r in report["gemm"] if not r.get("peer")}
    assert set(gemm) == {"cannon_ab", "summa_ab", "summa_abt", "summa_atb", "summa25_ab",
                         "summa25_abt", "summa25_atb"}
    peers = [r for r in report["gemm"] if r.get("peer")]    # ScaLAPACK's, where installed
    assert [r["algorithm"] for r in peers] in ([], ["pdgemm"])
    assert bool(peers) != ("pdgemm         skipped: " in proc.stdout)
    for r in list(gemm.values()) + peers:
        assert r["gflops"] == pytest.approx(2 * 128**3 / r["seconds"] / 1e9)
        assert r["fraction"] == pytest.approx(r["gflops"] / r["ceiling_gflops"])
    (ar,) = report["allreduce"]
    assert ar["bytes"] == 2**18 and ar["ratio"] == pytest.approx(
        ar["mpi_seconds"] / ar["ring_seconds"]) and ar["ok"]
    # in place: the plain in-place loop against the ring in place
    assert ar["vs_plain"] == pytest.approx(ar["plain_seconds"] / ar["inplace_seconds"])
    assert ar["predicted"] > 0 and len(ar["ring_times"]) == len(ar["plain_times"]) == \
        len(ar["inplace_times"]) == 2
    # paired per-repeat ratios; 2 repeats are too few for a 95% interval, so no verdict
    pairs = [b / o for b, o in zip(ar["plain_times"], ar["inplace_times"])]
    assert ar["vs_plain_paired"]["median"] == pytest.approx(sum(pairs) / 2)
    assert ar["vs_plain_paired"]["low"] is None and ar["vs_plain_paired"]["verdict"] is None
    assert "targets at p = 4: in place, not slower than the plain ring at" in proc.stdout
    mem = report["node_memory_gibs"]         # this launch's host memory, both ends
    assert all(0 < mem[k] < float("inf") for k in ("before", "after")), mem
    assert f"{mem['before']:.1f} GiB/s before the sizes, {mem['after']:.1f} after" \
        in proc.stdout
    # the prediction's memory floor is priced at the memory read in the size's rounds
    assert len(ar["memory_readings"]) == 2 and all(r > 0 for r in ar["memory_readings"])
    assert ar["memory_gibs"] == pytest.approx(sum(ar["memory_readings"]) / 2)
    assert "each size's memory floor at the node's memory throughput while it ran" \
        in proc.stdout
    # p = 4: SUMMA2.5-LM on its rectangular layers; the 3D layer needs a cube
    assert {r["scheme"] for r in report["transformer"]} == {"megatron", "optimus", "summa25"}
    assert all(r["ratio"] == pytest.approx(r["seconds"] / r["serial_seconds"])
               for r in report["transformer"])
    shape = report["transformer_shape"]              # which model and batch it timed
    assert shape["model"].startswith("h=") and shape["batch"] > 0 and not shape["checkpoint"]
    assert "3d        skipped" in proc.stdout


def test_self_test_catches_every_fault(mpiexec):
    """--self-test: every clean run passes and every fault kind is caught, for every
    algorithm and scheme that fits p = 4 (the faults sit on the last rank)."""
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", "--self-test"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if " float64 " in ln]
    names = {ln.split()[0] for ln in rows}
    assert names == {"cannon_ab", "summa_ab", "summa_abt", "summa_atb", "summa25_ab",
                     "summa25_abt", "summa25_atb", "ring_allreduce", "megatron", "optimus",
                     "summa25", "dp=2,pp=2,tp=megatron:1"}
    from summasim.harness.inject import KINDS

    for ln in rows:         # clean, then every fault kind (drift: the mesh row's audit)
        assert ln.split()[-1 - len(KINDS):] == ["OK"] + ["caught"] * len(KINDS), ln
    assert "self-test passed" in proc.stdout


def test_self_test_catches_every_fault_on_the_meshes_of_8_ranks(mpiexec):
    """--self-test's meshes at p = 8 (SUMMA2.5 [2,2,2] under ZeRO 3, dp x pp x
    Megatron): perturb was missed there when a ZeRO chunk of the last rank began with
    a pad of the flat layout and took the fault."""
    proc, _ = launch(mpiexec, 8, ["-m", "summasim.run", "--self-test", "--algorithms",
                                  "none", "--schemes", "none"], 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if " float64 " in ln]
    assert len(rows) >= 2 and all("MISSED" not in ln and ln.split()[-6] == "OK"
                                  for ln in rows), proc.stdout
    assert "self-test passed" in proc.stdout


@pytest.mark.parametrize("fault", ["nan@3", "inf@2", "perturb@1", "drop@3"])
def test_injected_fault_fails_the_job(mpiexec, tmp_path, fault):
    path = tmp_path / "run.json"
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", "--algorithms", "summa_abt",
                                  "--sizes", "32", "32", "32", "--repeats", "1", "--no-predict",
                                  "--schemes", "megatron", "--inject", fault,
                                  "--json", str(path)], 180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text        # strict JSON
    report = json.loads(text)
    assert report["ok"] is False and report["fault"] == fault
    (row,) = report["rows"]
    rank = int(fault.split("@")[1])
    assert row["ok"] is False and rank in row["bad_ranks"]
    if fault.startswith(("nan", "inf")):
        assert row["error"] is None and row["error_nonfinite"] == "nan" and row["nonfinite"]
    assert [t["ok"] for t in report["transformer"]] == [False]
    assert [m["ok"] for m in report["meshes"]] == [False]      # the default composition
    assert "0 passed, 3 failed" in proc.stdout


def test_a_fault_with_nothing_to_corrupt_is_named_not_passed_over(mpiexec):
    # rank 1 is a middle stage of pp = 4: no sum all-reduce there for "drop" to drop
    mesh = ["--schemes", "none", "--mesh", "pp=4", "--model", "tiny,layers=4", "--batch", "8",
            "--no-predict", "--repeats", "1", "--inject", "drop@1"]
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", "--algorithms", "none", *mesh], 180)
    _user_error(proc, "--inject drop@1", "nothing to corrupt in any run")
    assert "corrupted 0 of 1 runs" in proc.stdout
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.run", "--algorithms", "summa_ab", "--sizes",
                                  "32", "32", "32", *mesh], 180)
    assert proc.returncode == 1, proc.stdout + proc.stderr      # the product row FAILs
    assert "1 passed, 1 failed" in proc.stdout
    assert "corrupted 1 of 2 runs; rank 1 had nothing to corrupt in: dp=1,pp=4,tp=megatron:1 float64" in proc.stdout


def _user_error(proc, *needles):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(err) == 1 and err[0].startswith("python -m summasim."), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_a_run_that_checks_nothing_is_an_error(mpiexec):
    """Every product takes any sizes, but Cannon needs a square grid: asked for alone on
    8 ranks, nothing would be checked."""
    proc, _ = launch(mpiexec, 8, ["-m", "summasim.run", "--sizes", "5", "7", "9",
                                  "--algorithms", "cannon_ab", "--schemes", "none",
                                  "--meshes", "none"], 120)
    _user_error(proc, "nothing would be checked", "needs a square number of ranks")


def test_user_errors_are_one_message_before_any_work(mpiexec, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from summasim.costmodel.machine import load_preset

    nonic = load_preset("pcie-a100-4gpu").to_dict()     # 2 devices a node and no NICs:
    nonic["topology"].update(devices_per_node=2, nics_per_node=0, nic_bandwidth=0)
    nonic["node_size"] = 2
    (tmp_path / "nonic.json").write_text(json.dumps(nonic))   # 4 ranks span 2 nodes
    for args, needles in (
            (["--machine", str(tmp_path / "nonic.json")], ["no NICs", "the job has 4"]),
            (["--json", str(blocker / "run.json")], ["--json"]),
            (["--machine", str(tmp_path / "missing.json")], ["--machine"]),
            (["--inject", "nan@9"], ["rank 9 does not exist"]),
            (["--sizes", "100000", "100000", "100000", "--algorithms", "summa_ab"],
             ["largest cube that fits is"]),
            (["--model", "h=64,heads=5,layers=2,seq=16,vocab=64"], ["--model", "not divisible"]),
            (["--repeats", "-1"], ["--repeats"]),
            (["--mesh", "dp=2,pp=2,tp=megatron:4"], ["--mesh dp=2,pp=2,tp=megatron:4",
                                                     "16 ranks, the job has 4"]),
            (["--mesh", "dp=2,tp=optimus:3x2"], ["--mesh dp=2,pp=1,tp=optimus:3x2",
                                                 "12 ranks, the job has 4"]),
            (["--mesh", "tp=3d:2x2x1"], ["must be a cube"])):
        t0 = time.perf_counter()
        proc, _ = launch(mpiexec, 4, ["-m", "summasim.run"] + args, 120)
        _user_error(proc, *needles)
        assert time.perf_counter() - t0 < 60
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.bench", "gemm", "--n", "0"], 60)
    _user_error(proc, "--n")
    proc, _ = launch(mpiexec, 4, ["-m", "summasim.bench", "mesh", "--mesh", "dp=4",
                                  "--machine", str(tmp_path / "nonic.json")], 60)
    _user_error(proc, "no NICs", "the job has 4")
    huge = ["--model", "h=16384,heads=8,layers=1,seq=4096,vocab=64,ffn=2",   # ~1 TiB a rank
            "--batch", "64"]
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.run", "--algorithms", "none"] + huge, 60)
    _user_error(proc, "megatron 1D p=2 b64", "not even batch 1 fits")
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.bench", "transformer"] + huge, 60)
    _user_error(proc, "megatron 1D p=2 b64", "not even batch 1 fits")
    for what in ("allreduce", "ring-steps"):     # refused before any buffer is allocated
        proc, _ = launch(mpiexec, 2, ["-m", "summasim.bench", what, "--sizes-mib",
                                      "0.0625,1e7"], 60)
        _user_error(proc, f"{what} at 1e+07 MiB", "largest size that fits")


def test_cupy_backend_without_cupy_is_a_user_error(mpiexec):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the error case cannot be produced")
    except ImportError:
        pass
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.run", "--backend", "cupy"], 60)
    _user_error(proc, "CuPy")
    proc, _ = launch(mpiexec, 2, ["-m", "summasim.bench", "allreduce", "--backend", "cupy"], 60)
    _user_error(proc, "CuPy")


def test_bench_allreduce_through_the_staging_path(mpiexec, tmp_path):
    """--backend staged-host: the ring, the plain ring and MPI each staged (at these sizes
    all three once around the whole vector, the ring with its own host ring inside), each
    checked, no prediction."""
    path = tmp_path / "bench.json"
    proc, _ = launch(mpiexec, 3, ["-m", "summasim.bench", "allreduce", "--backend",
                                  "staged-host", "--sizes-mib", "0.0625,0.5", "--repeats", "2",
                                  "--json", str(path)], 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    assert (report["backend"], report["comm_mode"]) == ("staged-host", "staged")
    assert [r["bytes"] for r in report["allreduce"]] == [2**16, 2**19]
    assert all(r["ok"] and r["predicted"] is None and len(r["mpi_times"]) == 2
               for r in report["allreduce"])
    assert "no prediction: the cost model prices host arrays only" in proc.stdout
