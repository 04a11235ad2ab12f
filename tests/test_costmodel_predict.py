"""``python -m summasim.costmodel predict`` and the new ``explore`` options: every
scheme answers on every GPU preset; user errors are one line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from summasim.costmodel.__main__ import main
from summasim.costmodel.tools.explore import weak_config
from summasim.costmodel.workload.scheme import TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model", "h=2048,heads=16,layers=4,seq=512,vocab=32000", "--batch", "16"]
GRIDS = {"megatron": "8", "optimus": "4x4", "summa25": "2x2x4"}


@pytest.mark.parametrize("preset", ["dgx-a100", "h100-dgx-ndr", "frontera-rtx"])
@pytest.mark.parametrize("scheme", ["megatron", "optimus", "summa25"])
def test_predict_answers_for_every_scheme_on_every_gpu_preset(tmp_path, capsys, preset, scheme):
    dtype = "float16" if preset == "frontera-rtx" else "bfloat16"
    path = tmp_path / "p.json"
    rc = main(["predict", "--mesh", f"tp={scheme}:{GRIDS[scheme]}", *MODEL, "--dtype", dtype,
               "--checkpoint", "--machine", preset, "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step time" in out and "largest batch" in out and "memory per device" in out
    doc = json.loads(path.read_text())
    parts = doc["gemm_seconds"] + doc["memory_bound_seconds"] + doc["comm_exposed_seconds"]
    assert doc["seconds"] == pytest.approx(parts)
    assert doc["seconds"] > 0 and doc["memory"]["total"] > 0
    assert doc["largest_batch"] is None or doc["largest_batch"] >= 0
    assert any(a.startswith("nccl_") for algs in doc["algorithms"].values() for a in algs)


@pytest.mark.parametrize("machine,mesh,dtype,extra", [
    ("local-2core-mpich", "tp=megatron:4", "float64", []),          # the shared-core fit
    ("local-2core-mpich", "tp=megatron:1", "float64", ["--recompute", "full"]),
    ("dgx-a100", "tp=megatron:1", "bfloat16", ["--recompute", "full"]),  # float32 grads
    ("frontera-rtx", "tp=megatron:4", "float16", []),               # the dynamic loss scale
    ("dgx-a100", "tp=megatron:8", "bfloat16", ["--sequence-parallel"]),
    ("dgx-a100", "tp=optimus:4x4", "bfloat16", ["--recompute", "selective"]),
    ("h100-dgx-ndr", "tp=summa25:2x2x4", "bfloat16", ["--attention", "flash"]),
])
def test_the_grid_alone_is_priced_as_the_composition_of_it_alone(tmp_path, capsys, machine,
                                                                 mesh, dtype, extra):
    """``--mesh tp=...`` alone and the same grid as a composition (``--microbatches 1``:
    dp = pp = m = 1, ZeRO 0) are one step: the same time, parts and memory, whatever
    the machine (a CPU fit's shared cores, a float16 loss scale, a float32 gradient
    buffer under mixed precision)."""
    docs = []
    for i, more in enumerate(([], ["--microbatches", "1"])):
        path = tmp_path / f"{i}.json"
        rc = main(["predict", "--mesh", mesh, *MODEL, "--dtype", dtype, "--machine", machine,
                   *extra, *more, "--json", str(path)])
        capsys.readouterr()
        assert rc == 0
        docs.append(json.loads(path.read_text()))
    alone, comp = docs
    assert alone["seconds"] == pytest.approx(comp["step_seconds"], rel=1e-12)
    bd = comp["breakdown"]
    assert alone["gemm_seconds"] == pytest.approx(bd["gemm"], rel=1e-12)
    assert alone["optimizer_seconds"] == pytest.approx(bd["optimizer"], rel=1e-12)
    assert alone["memory"]["total"] == pytest.approx(comp["memory"]["total"], rel=1e-12)
    # what is exposed is part of all the communication, and the groups add up to it
    assert alone["comm_exposed_seconds"] <= alone["comm_seconds"] * (1 + 1e-12)
    assert sum(alone["by_op"].values()) == pytest.approx(alone["comm_seconds"], rel=1e-9)


def test_predict_placement_changes_the_prediction(tmp_path, capsys):
    docs = {}
    for pl in ("row-major", "blocked", "map:" + ",".join(str(x) for x in range(16)[::-1])):
        path = tmp_path / f"{len(docs)}.json"
        assert main(["predict", "--mesh", "tp=optimus:4x4", *MODEL, "--machine",
                     "frontera-rtx", "--dtype", "float16", "--placement", pl,
                     "--json", str(path)]) == 0
        docs[pl] = json.loads(path.read_text())
    capsys.readouterr()
    assert docs["row-major"]["seconds"] != docs["blocked"]["seconds"]
    assert docs["blocked"]["placement"].startswith("blocked")
    assert docs["map:15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0"]["placement"].startswith("explicit")


FIT3 = ["--model", "h=2400,heads=24,layers=4,seq=512,vocab=32001", "--batch", "24"]
BAD = [
    (["--mesh", "tp=optimus:3x4"], "--mesh"),
    (["--mesh", "tp=summa25:4x4"], "--mesh"),
    (["--mesh", "tp=megatron:64"], "smaller than"),
    (["--mesh", "tp=optimus:3x3", "--machine", "frontera-rtx", "--placement",
      "blocked", "--dtype", "float16", *FIT3], "--placement"),
    (["--mesh", "tp=optimus:4x4", "--placement", "map:0,1"], "--placement"),
    (["--mesh", "tp=megatron:4", "--placement", "blocked:2x2"], "--placement"),
    (["--mesh", "tp=optimus:4x4", "--machine", "nope"], "--machine"),
    (["--mesh", "tp=optimus:4x4", "--dtype", "float64", "--machine", "dgx2h-v100",
      "--json", "/proc/nope/x.json"], "--json"),
]


@pytest.mark.parametrize("args,mention", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_predict_user_errors_are_one_line_and_exit_2(capsys, args, mention):
    try:                                           # later options win: FIT3 fits q = 3
        rc = main(["predict", *MODEL, *args])
    except SystemExit as exc:                      # refused by argparse's type check
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and mention in lines[0], err


def test_predict_bad_argument_is_a_clean_exit_from_the_shell():
    res = subprocess.run([sys.executable, "-m", "summasim.costmodel", "predict", "--mesh",
                          "tp=optimus:4x4", "--model", "h=2048,heads=16,layers=4,seq=512,"
                          "vocab=-1", "--batch", "16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len([x for x in res.stderr.splitlines() if x.strip()]) == 1


@pytest.mark.parametrize("argv", [["predict", "--mesh", "tp=optimus:4x4", *MODEL],
                                  ["presets", "dgx-a100"], ["presets"], ["table1"]],
                         ids=["predict", "presets-name", "presets", "table1"])
def test_a_command_into_a_closed_pipe_is_quiet(argv):
    # `python -m summasim.costmodel ... | head -1`: the reader leaves; no BrokenPipeError
    # traceback, on every subcommand (presets and table1 print outside the tools' mains)
    proc = subprocess.Popen([sys.executable, "-m", "summasim.costmodel", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                            # nobody reads what it prints
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err, err


def test_weak_rules_grow_batch_hidden_or_both():
    cfg = TransformerConfig(b=8, s=512, h=1024, n=16, N=2)
    assert weak_config(cfg, 16, 4, "batch").b == 32
    hid = weak_config(cfg, 16, 4, "hidden")
    assert (hid.b, hid.n, hid.h) == (8, 32, 2048)          # sqrt(4) = 2, head size 64 kept
    both = weak_config(cfg, 36, 4, "both")
    assert (both.b, both.n, both.h) == (72, 48, 3072)
    with pytest.raises(ValueError):
        weak_config(cfg, 4, 4, "depth")


def test_explore_takes_a_p_list_weak_rules_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = main(["explore", "--machine", "dgx-a100", "--p", "4,16,36,64", "--weak", "both",
               "--model", "h=1152,heads=12,layers=2,seq=256,vocab=1152", "--batch", "36",
               "--dtype", "bfloat16", "--no-iso", "--matmul-n", "2304",
               "--json", "--plot", "--outdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads((tmp_path / "explore.json").read_text())
    weak = doc["tables"]["weak"]
    assert {r["p"] for r in weak} >= {4, 16, 36, 64}
    at36 = [r for r in weak if r["p"] == 36][0]
    assert at36["n"] == 36 and at36["h"] == 3456 and at36["b"] == 324
    assert (tmp_path / "scaling.png").exists()
    assert "weak scaling (b = 36 * p / 4, n = 12 * sqrt(p / 4)" in out


def test_explore_bad_placement_and_p_list_are_user_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explore", "--machine", "dgx-a100", "--p", "4,0"])
    assert exc.value.code == 2
    assert "--p" in capsys.readouterr().err
    rc = main(["explore", "--machine", "dgx-a100", "--p", "4,16", "--placement", "map:0,1",
               "--no-iso"])
    err = capsys.readouterr().err
    assert rc == 2 and "--placement" in err and len(err.strip().splitlines()) == 1
