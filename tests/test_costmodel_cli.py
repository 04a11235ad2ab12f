"""The command line: explore tables, CSV/JSON outputs, plots, presets, table1; one
spelling in every cost-model command (``--model``, ``--batch``, ``--mesh``, ``--machine``);
``predict --mesh`` of a whole composition equals the planner's row for it; every grid of
``spec.grids`` is priced."""

import csv
import json
import subprocess
import sys

import pytest

from summasim.costmodel.__main__ import main as cli_main
from summasim.costmodel.tools._cli import PLOT_HINT

SMALL = ["--p-max", "256", "--model", "h=1024,heads=16,layers=4,seq=256,vocab=2048",
         "--batch", "16", "--matmul-n", "4096"]


def test_explore_writes_csv_and_json(tmp_path, capsys):
    rc = cli_main(["explore", *SMALL, "--machine", "h100-dgx-ndr", "--outdir", str(tmp_path),
                   "--csv", "--json", "--mem-budget", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for section in ("strong scaling", "weak scaling", "matrix products", "isoefficiency",
                    "largest batch under 1 GiB", "crossovers:"):
        assert section in out
    rows = list(csv.DictReader(open(tmp_path / "explore.csv")))
    tables = {r["table"] for r in rows}
    assert tables == {"strong", "weak", "matmul", "largest_batch", "isoefficiency",
                      "crossovers"}
    strong = [r for r in rows if r["table"] == "strong"]
    assert sorted({int(r["p"]) for r in strong}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {r["scheme"] for r in strong} == {"megatron", "optimus", "summa25", "3d"}
    # exactly one fastest scheme per p, and efficiency = speedup / p
    for p in {r["p"] for r in strong}:
        mine = [r for r in strong if r["p"] == p]
        assert sum(r["best"] == "True" for r in mine) == 1
        for r in mine:
            assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / int(p))
    doc = json.loads((tmp_path / "explore.json").read_text())
    assert doc["machine"]["name"] == "h100-dgx-ndr"
    assert doc["config"]["h"] == 1024 and doc["mode"] == "mpich"
    iso = {r["problem"]: r for r in doc["tables"]["isoefficiency"]}
    assert abs(iso["megatron"]["slope_paper_assumptions"] - 3) < 0.25
    # the 3D and 2.5D products and the 3D layer on the cubes 8 and 64: the fit is the
    # closed form
    for prob in ("mm3d_mm", "sd25_mm", "3d"):
        assert iso[prob]["p_range"] == "8..64"
        assert iso[prob]["slope_paper_assumptions"] == pytest.approx(
            iso[prob]["reference_slope"], abs=1e-6)
    batches = doc["tables"]["largest_batch"]
    assert batches and all(r["largest_b"] >= 0 for r in batches)
    # no temp files left behind by the atomic writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explore.csv", "explore.json"]


def test_explore_explicit_paths_and_machine_file(tmp_path, capsys):
    from summasim.costmodel import load_preset

    mfile = tmp_path / "m.json"
    load_preset("frontera-rtx").save(mfile)
    (tmp_path / "a").mkdir()                  # summasim creates no folder it was not asked for
    rc = cli_main(["explore", *SMALL, "--machine", str(mfile), "--no-iso", "--mode", "paper",
                   "--csv", str(tmp_path / "a" / "t.csv")])
    out = capsys.readouterr().out
    assert rc == 0 and "frontera-rtx" in out and "isoefficiency at" not in out
    assert (tmp_path / "a" / "t.csv").exists()


def test_explore_bad_input(capsys):
    assert cli_main(["explore", "--machine", "nope"]) == 2
    assert "'nope' is neither a machine file nor a preset" in capsys.readouterr().err
    assert cli_main(["explore", "--schemes", "megatron,fox"]) == 2
    assert "unknown scheme 'fox'" in capsys.readouterr().err


def test_explore_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = cli_main(["explore", *SMALL, "--outdir", str(tmp_path), "--plot"])
    assert rc == 0
    for name in ("scaling.png", "isoefficiency.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("sub", ["explore", "plan"])
def test_a_plot_without_matplotlib_is_a_user_error_before_any_work(sub, tmp_path, capsys,
                                                                    monkeypatch):
    """--plot asks for a plot: without matplotlib that is one line and exit 2 before any
    pricing (not the tables and exit 0), and the rest of the command still works."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    args = ([*SMALL, "--no-iso", "--outdir", str(tmp_path), "--plot"] if sub == "explore" else
            ["--model", "h=1024,layers=8,heads=16,seq=512,vocab=2048", "--devices", "8",
             "--batch", "16", "--plot", str(tmp_path / "plan.png")])
    rc = cli_main([sub, *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--plot" in err and PLOT_HINT in err
    assert "pip install summasim[plot]" in PLOT_HINT
    assert not list(tmp_path.iterdir())
    if sub == "explore":      # an --outdir to be made is not made for a refused command
        fresh = tmp_path / "fresh"
        assert cli_main(["explore", *SMALL, "--no-iso", "--outdir", str(fresh),
                         "--plot"]) == 2
        assert not fresh.exists()
        capsys.readouterr()
    no_plot = [a for a in args if a not in ("--plot", str(tmp_path / "plan.png"))]
    assert cli_main([sub, *no_plot]) == 0


def test_presets_and_table1(capsys):
    assert cli_main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "h100-dgx-ndr" in out and "local-2core-mpich" in out and "frontera-rtx" in out
    assert cli_main(["presets", "h100-dgx-ndr"]) == 0
    assert json.loads(capsys.readouterr().out)["cores"] == 8
    assert cli_main(["table1", "--b", "8", "--s", "128", "--h", "256", "--p", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count(" == ") == 9 and "!=" not in out   # header + 8 entries
    # q = 6: log2(36) is irrational, and the model still equals the formula
    assert cli_main(["table1", "--b", "6", "--s", "12", "--h", "72", "--p", "36"]) == 0
    out = capsys.readouterr().out
    assert out.count(" == ") == 9 and "!=" not in out


def test_module_entry_point_subprocess(tmp_path):
    """``python -m summasim.costmodel explore`` runs without importing MPI."""
    code = ("import runpy, sys; sys.argv = ['x', 'explore', '--p-max', '64', '--no-iso', "
            f"'--outdir', {str(tmp_path)!r}, '--json']; "
            "import summasim.costmodel.__main__ as m; rc = m.main(sys.argv[1:]); "
            "print('MPI' if 'mpi4py' in sys.modules else 'noMPI', rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("noMPI 0")
    assert json.loads((tmp_path / "explore.json").read_text())["tables"]["strong"]
    res = subprocess.run([sys.executable, "-m", "summasim.costmodel", "explore", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--machine" in res.stdout and "--plot" in res.stdout
    assert "--preset" not in res.stdout and "--model" in res.stdout


# -- one spelling: predict and plan ---------------------------------------------------------
def _run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "summasim.costmodel", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", ["predict", "plan", "explore"])
def test_every_command_speaks_the_shared_options(cmd):
    """--model, --batch, --machine FILE|PRESET and --dtype in each; the old spellings
    are gone (and --mesh / --zero / --schedule / --microbatches in predict)."""
    from summasim.costmodel.tools import explore_cli, plan_cli, predict

    ap = {"predict": predict, "plan": plan_cli, "explore": explore_cli}[cmd].build_parser()
    flags = {f for a in ap._actions for f in a.option_strings}
    assert {"--model", "--batch", "--machine", "--dtype"} <= flags
    assert not flags & {"--preset", "--hidden", "--heads", "--layers", "--seq", "--vocab",
                        "--ffn", "--b", "--s", "--h", "--grid", "--scheme", "--global-batch"}
    if cmd == "predict":
        assert {"--mesh", "--zero", "--schedule", "--microbatches", "--checkpoint"} <= flags


def test_predict_prices_the_summa25_grid_past_the_cube_the_main_job_runs(capsys):
    """The main job's tiny model on [2,2,4] (d > q) at p = 16, on this machine's preset."""
    rc = cli_main(["predict", "--model", "tiny", "--batch", "8", "--mesh", "tp=summa25:2x2x4",
                   "--machine", "local-2core-mpich"])
    out = capsys.readouterr().out
    assert rc == 0 and "SUMMA2.5 [2,2,4]" in out and "step time" in out


def test_predict_prices_every_grid_of_spec_grids(tmp_path):
    """Every grid spec.grids(16, scheme) lists is priced by predict (tiny fits them all)."""
    from summasim import spec
    from summasim.costmodel.tools import predict

    ap = predict.build_parser()
    seen = []
    for scheme in spec.SCHEME_NAMES:
        for g in spec.grids(16, scheme, spec.MODELS["tiny"], 8):
            path = tmp_path / f"{scheme}-{g.q}-{g.d}.json"
            args = ap.parse_args(["--model", "tiny", "--batch", "8", "--mesh", f"tp={g}",
                                  "--machine", "local-2core-mpich", "--json", str(path)])
            doc = predict.run(args, out=__import__("io").StringIO())
            assert doc["seconds"] > 0 and json.loads(path.read_text())["seconds"] == \
                doc["seconds"]
            seen.append(str(g))
    assert "summa25:2x2x4" in seen and "optimus:4x4" in seen and "megatron:16" in seen


def test_predict_mesh_equals_the_plan_row_exactly():
    """predict --mesh prices one fixed composition with the pricer plan ranks with: its
    step time and memory are the plan search's row for the same composition, exactly."""
    import io

    from summasim.costmodel.tools import plan, plan_cli, predict

    pargs = plan_cli.build_parser().parse_args(
        ["--model", "h=1024,heads=16,layers=8,seq=512,vocab=2048", "--batch", "64",
         "--devices", "64", "--machine", "h100-dgx-ndr", "--mem-gib", "1000"])
    p = plan_cli.check_args(pargs)
    res = plan.search(p.cfg, p.devices, p.global_batch, p.machine, budget=p.budget,
                      schemes=p.schemes, zeros=p.zeros, recomputes=p.recomputes,
                      schedule=p.schedule, state_bytes=p.state_bytes,
                      sequence_parallel=p.sequence_parallel, chunks=p.chunks,
                      loss_scale=p.loss_scale)
    rows = res.rows
    picks = [rows[0], rows[len(rows) // 2], rows[-1]]
    picks += [r for r in rows if r["scheme"] == "summa25" and r["d"] > r["q"]][:1]
    picks += [r for r in rows if r["pp"] > 1 and r["zero"] == 3][:1]
    # every technique the planner searches, each in some row
    picks += [r for r in rows if r["recompute"] == "selective"][:1]
    picks += [r for r in rows if r["sequence_parallel"]][:1]
    picks += [r for r in rows if r["chunks"] > 1][:1]
    assert len(picks) == 8
    ap = predict.build_parser()
    for r in picks:
        argv = ["--model", "h=1024,heads=16,layers=8,seq=512,vocab=2048", "--batch", "64",
                "--machine", "h100-dgx-ndr",
                "--mesh", f"dp={r['dp']},pp={r['pp']},tp={plan.short_grid(r)}",
                "--zero", str(r["zero"]), "--microbatches", str(r["microbatches"]),
                "--dtype", p.cfg.dtype, "--recompute", r["recompute"],
                "--schedule", r["schedule"]] + (
                    ["--sequence-parallel"] if r["sequence_parallel"] else [])
        doc = predict.run(ap.parse_args(argv), out=io.StringIO())
        assert doc["step_seconds"] == r["step_seconds"], (argv, doc["step_seconds"], r)
        assert doc["memory"]["total"] / plan.GiB == r["memory_gib"]
        assert doc["composition"]["micro_batch"] == r["micro_batch"]


def test_predict_composition_output_and_user_errors(capsys):
    rc = cli_main(["predict", "--model", "gpt3-175b", "--machine", "dgx-a100", "--mesh",
                   "dp=8,pp=8,tp=megatron:8", "--zero", "1", "--microbatches", "48",
                   "--checkpoint"])
    out = capsys.readouterr().out
    assert rc == 0
    for part in ("step time", "exposed dp comm", "bubble", "memory per device (worst stage)",
                 "512 devices", "m = 48 micro-batches of 4"):
        assert part in out
    for argv, mention in (
            (["--mesh", "dp=1,pp=97,tp=megatron:8"], "do not split into pp = 97 stages"),
            (["--mesh", "dp=8,pp=8,tp=megatron:8", "--stages", "12,12"], "--stages"),
            (["--mesh", "dp=8,pp=8,tp=megatron:8", "--schedule", "interleaved:2",
              "--microbatches", "12"], "multiple of pp = 8"),
            (["--mesh", "dp=8,pp=8,tp=optimus:2x2", "--sequence-parallel"],
             "--sequence-parallel: sequence parallelism is Megatron's (1D) only"),
            (["--mesh", "dp=8,pp=8,tp=megatron:8", "--microbatches", "7"], "--microbatches"),
            (["--mesh", "dp=2,tp=optimus:4x4", "--placement", "blocked"], "--placement"),
            (["--mesh", "tp=megatron:97"], "smaller than p = 97"),   # 96 heads
            ([], "--mesh")):
        rc = cli_main(["predict", "--model", "gpt3-175b", *argv])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert rc == 2 and len(lines) == 1 and mention in lines[0], (argv, err)


def test_plan_lists_the_grids_spec_grids_runs():
    """plan at 16 devices searches every tensor grid spec.grids lists, [2,2,4] and the
    rectangles (optimus:2x4, summa25:1x2x2) included, but the grid of one rank."""
    from summasim import spec
    from summasim.costmodel.tools import plan, plan_cli

    p = plan_cli.check_args(plan_cli.build_parser().parse_args(
        ["--model", "tiny", "--devices", "16", "--machine", "local-2core-mpich"]))
    got = {(s.name, s.p, s.q, s.cols, s.d) for s in plan.tensor_grids(p.cfg, 16)}
    want = {(g.name, g.p, g.q, g.cols, g.d) for t in (1, 2, 4, 8, 16)
            for name in spec.SCHEME_NAMES for g in spec.grids(t, name, spec.MODELS["tiny"])
            if g.name == "megatron" or g.p >= 2}
    assert got == want and ("summa25", 16, 2, 2, 4) in got
    assert {("optimus", 8, 2, 4, 1), ("optimus", 8, 4, 2, 1), ("summa25", 4, 1, 2, 2)} <= got
    assert ("optimus", 1, 1, 1, 1) not in got
    res = _run_cli("plan", "--model", "tiny", "--devices", "16", "--machine",
                   "local-2core-mpich", "--schemes", "summa25", "--top", "100")
    assert res.returncode == 0, res.stderr
    assert all(f"summa25:{g}" in res.stdout for g in ("2x2x4", "2x2x2", "1x2x2", "2x1x2"))


def test_byte_size_is_the_cli_one():
    """fit's --max-bytes and --threshold parse with summasim.cli.byte_size."""
    import argparse

    import summasim.costmodel.__main__ as m

    assert not hasattr(m, "_bytes")
    assert m._max_bytes("64MiB") == 64 << 20 and m._threshold("8k") == 8192
    assert m._threshold("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError):
        m._max_bytes("32")


@pytest.mark.parametrize("machine", ["dgx-a100", "local-2core-mpich"])
def test_explore_counts_memory_as_predict_does(tmp_path, capsys, machine):
    """explore's memory per rank is predict's for the grid alone: in mixed precision the
    gradients take a float32 buffer (18 bytes a parameter), not 16 bits."""
    from summasim.costmodel.machine import load_preset
    from summasim.costmodel.tools import explore
    from summasim.costmodel.workload.footprint import memory
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig

    dtype = "bfloat16" if machine == "dgx-a100" else "float64"
    cfg = TransformerConfig(b=8, s=256, h=512, n=8, N=2, v=1000, dtype=dtype)
    sch = Scheme.make("megatron", p=4)
    mem = explore._price(sch, cfg, load_preset(machine), "mpich").memory
    plain = memory(sch, cfg)
    assert mem.grads == plain.grads * (2 if dtype == "bfloat16" else 1)
    path = tmp_path / "p.json"
    assert cli_main(["predict", "--model", "h=512,heads=8,layers=2,seq=256,vocab=1000",
                     "--batch", "8", "--mesh", "tp=megatron:4", "--machine", machine,
                     "--dtype", dtype, "--recompute", cfg.recompute, "--json", str(path)]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["memory"]["total"] == pytest.approx(mem.total)


def test_predict_and_plan_refuse_a_zero_memory_budget(capsys):
    """A budget of 0 GiB is a user error in predict as in plan (predict said "fits" for
    a composition and nothing for a tensor grid alone)."""
    for argv in (["predict", "--model", "gpt3-2.7b", "--batch", "8", "--mesh",
                  "tp=megatron:8", "--mem-budget", "0"],
                 ["predict", "--model", "gpt3-2.7b", "--batch", "8", "--mesh",
                  "tp=megatron:8", "--microbatches", "1", "--mem-budget", "0"],
                 ["plan", "--model", "gpt3-2.7b", "--devices", "8", "--mem-budget", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--mem-budget" in err and "Traceback" not in err, argv


def test_rates_print_three_significant_digits_on_any_machine():
    """A CPU rank's 0.0123 model TFLOP/s printed as "0.0"; a GPU's 104.7 as "105"."""
    from summasim.cli import sig3

    assert [sig3(x) for x in (104.7, 0.0123, 320.2, 99.96, 1.0, 0.0, 2.5e-5)] == \
        ["105", "0.0123", "320", "100", "1.00", "0", "2.5e-05"]


def test_explore_says_when_its_step_is_the_layers_alone(capsys):
    """On a CPU machine explore's step_s is the N layers (not predict's whole step); the
    table says so there and only there."""
    small = ["--model", "h=512,heads=8,layers=2,seq=64,vocab=100", "--batch", "8",
             "--p", "1,2", "--no-iso", "--schemes", "megatron"]
    for machine, said in (("local-2core-mpich", True), ("dgx-a100", False)):
        assert cli_main(["explore", *small, "--machine", machine]) == 0
        out = capsys.readouterr().out
        assert ("`costmodel predict` prices the step" in out) == said, machine
