"""The command line: explore tables, CSV/JSON outputs, plots, presets, table1."""

import csv
import json
import subprocess
import sys

import pytest

from summasim.costmodel.__main__ import main as cli_main
from summasim.costmodel.explore import PLOT_HINT

SMALL = ["--p-max", "256", "--b", "16", "--s", "256", "--h", "1024", "--heads", "16",
         "--layers", "4", "--matmul-n", "4096"]


def test_explore_writes_csv_and_json(tmp_path, capsys):
    rc = cli_main(["explore", *SMALL, "--preset", "h100-dgx-ndr", "--outdir", str(tmp_path),
                   "--csv", "--json", "--mem-budget", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for section in ("strong scaling", "weak scaling", "matrix products", "isoefficiency",
                    "largest batch under 1 GiB"):
        assert section in out
    rows = list(csv.DictReader(open(tmp_path / "explore.csv")))
    tables = {r["table"] for r in rows}
    assert tables == {"strong", "weak", "matmul", "largest_batch", "isoefficiency"}
    strong = [r for r in rows if r["table"] == "strong"]
    assert sorted({int(r["p"]) for r in strong}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {r["scheme"] for r in strong} == {"megatron", "optimus", "summa25"}
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
    batches = doc["tables"]["largest_batch"]
    assert batches and all(r["largest_b"] >= 0 for r in batches)
    # no temp files left behind by the atomic writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explore.csv", "explore.json"]


def test_explore_explicit_paths_and_machine_file(tmp_path, capsys):
    from summasim.costmodel import load_preset

    mfile = tmp_path / "m.json"
    load_preset("frontera-rtx").save(mfile)
    rc = cli_main(["explore", *SMALL, "--machine", str(mfile), "--no-iso", "--mode", "paper",
                   "--csv", str(tmp_path / "a" / "t.csv")])
    out = capsys.readouterr().out
    assert rc == 0 and "frontera-rtx" in out and "isoefficiency at" not in out
    assert (tmp_path / "a" / "t.csv").exists()


def test_explore_bad_input(capsys):
    assert cli_main(["explore", "--preset", "nope"]) == 2
    assert "unknown machine preset 'nope'" in capsys.readouterr().err
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


def test_explore_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    rc = cli_main(["explore", *SMALL, "--no-iso", "--outdir", str(tmp_path), "--plot"])
    assert rc == 0
    assert PLOT_HINT in capsys.readouterr().out
    assert "pip install summasim[plot]" in PLOT_HINT
    assert not list(tmp_path.glob("*.png"))


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
    assert res.returncode == 0 and "--preset" in res.stdout and "--plot" in res.stdout
