"""The planner (python -m summasim.costmodel plan): ranking, memory, JSON, plot, speed at
thousands of devices, and one-line user errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from summasim.costmodel import list_presets, load_preset
from summasim.costmodel.workload.zero import StateBytes
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.tools.plan import MODELS, ranked, search
from summasim.costmodel.tools.plan_cli import main
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "dgx-a100" if "dgx-a100" in list_presets() else "h100-dgx-ndr"
GiB = float(1 << 30)
SMALL = ["--model", "h=1024,layers=8,heads=16,seq=512,vocab=2048", "--devices", "64",
         "--batch", "64", "--machine", PRESET]


def _cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "summasim.costmodel", "plan", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _ranked(steps) -> bool:
    """Sorted by the step time to 12 significant digits (ties in the search's order:
    a step that differs in its last bits is a tie, whatever Python's sum() does)."""
    keys = [float(f"{s:.12g}") for s in steps]
    return keys == sorted(keys) and all(b >= a * (1 - 1e-11) for a, b in zip(steps, steps[1:]))


def test_ranked_compositions_fit_and_are_sorted():
    machine = load_preset(PRESET)
    cfg = TransformerConfig(b=64, s=512, h=1024, n=16, N=8, v=2048, dtype="bfloat16")
    budget = 0.2 * GiB                  # tight enough that about half do not fit
    res = search(cfg, 64, 64, machine, budget=budget)
    rows = res.rows
    assert rows and res.counts["fit"] == len(rows) < res.counts["compositions"]
    steps = [r["step_seconds"] for r in rows]
    assert _ranked(steps)
    assert all(r["memory_gib"] * GiB <= budget for r in rows)
    assert {r["scheme"] for r in rows} >= {"megatron"}
    assert all(r["t"] * r["dp"] * r["pp"] == 64 for r in rows)
    # a row is exactly what price_composition says of that composition
    for r in rows[:3] + rows[-2:]:
        sch = Scheme.make(r["scheme"], p=r["t"], q=None if r["scheme"] == "megatron"
                          else r["q"], d=r["d"],
                          pc=None if r["scheme"] == "megatron" else r["pc"])
        again = price_composition(
            cfg.replace(sequence_parallel=r["sequence_parallel"]), sch, machine=machine,
            dp=r["dp"], pp=r["pp"], microbatches=r["microbatches"], global_batch=64,
            zero=r["zero"], recompute=r["recompute"], devices=64,
            schedule="interleaved" if r["chunks"] > 1 else "1f1b", chunks=r["chunks"],
            state_bytes=StateBytes.for_dtype("bfloat16"))
        assert again["step_seconds"] == pytest.approx(r["step_seconds"], rel=1e-12)
        assert again["memory"]["total"] <= budget


def test_steps_that_differ_in_their_last_bits_tie_in_the_search_order():
    rows = [{"id": "a", "step_seconds": 1.0000000000000002},  # 1 ulp above b: a tie
            {"id": "b", "step_seconds": 1.0},
            {"id": "c", "step_seconds": 0.5},
            {"id": "d", "step_seconds": 1.00000000001},       # the 11th digit: after
            {"id": "e", "step_seconds": 0.9999999999999999}]  # 1 ulp below b: a tie
    assert [r["id"] for r in ranked(rows)] == ["c", "a", "b", "e", "d"]
    # in a real search, ZeRO 1 and 2 of one composition where neither's traffic shows
    # price the same step and keep the search's order (ZeRO ascending), whatever the
    # last bits of the float sums
    machine = load_preset(PRESET)
    cfg = TransformerConfig(b=64, s=512, h=1024, n=16, N=8, v=2048, dtype="bfloat16")
    res = search(cfg, 64, 64, machine, budget=4 * GiB)
    where = {}
    for i, r in enumerate(res.rows):
        key = tuple((k, r[k]) for k in ("grid", "dp", "pp", "microbatches", "chunks",
                                        "recompute", "sequence_parallel"))
        where.setdefault(key, {})[r["zero"]] = (i, float(f"{r['step_seconds']:.12g}"))
    ties = [z for z in where.values() if 1 in z and 2 in z and z[1][1] == z[2][1]]
    assert ties, "no composition whose ZeRO 1 and 2 steps tie: the check saw nothing"
    assert all(z[1][0] < z[2][0] for z in ties)


def test_memoized_paths_leave_the_ranking_unchanged():
    """topology.group_path is memoized across pricers: a search with the memo cold and
    one with it warm rank the same compositions with the same numbers, exactly."""
    from summasim.costmodel.machine.topology import clear_path_memo

    machine = load_preset(PRESET)
    cfg = TransformerConfig(b=64, s=512, h=1024, n=16, N=8, v=2048, dtype="bfloat16")
    clear_path_memo()
    cold = search(cfg, 64, 64, machine, budget=0.2 * GiB).rows
    warm = search(cfg, 64, 64, machine, budget=0.2 * GiB).rows
    assert cold and cold == warm


def test_cli_prints_top_ten_writes_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "out" / "plan.json", tmp_path / "out" / "plan.png"
    js.parent.mkdir()                         # summasim creates no folder it was not asked for
    rc = main([*SMALL, "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fastest 10" in out and "best:" in out and "best of each kind" in out
    doc = json.loads(js.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert doc["format"] == "summasim.plan/1" and doc["devices"] == 64
    assert len(doc["top"]) == 10 and doc["searched"]["fit"] == len(doc["ranked"])
    ranked = [r["step_seconds"] for r in doc["ranked"]]
    assert _ranked(ranked)
    assert [t["step_seconds"] for t in doc["top"]] == ranked[:10]
    for t in doc["top"]:
        assert t["memory"]["total"] <= doc["budget_bytes"]
        assert set(t["breakdown"]) == {"gemm", "memory_bound", "exposed_comm", "bubble",
                                       "optimizer"}
    if __import__("summasim.cli", fromlist=["module_available"]).module_available(
            "matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in js.parent.iterdir()) == sorted(
        {"plan.json"} | ({"plan.png"} if png.exists() else set()))


def test_gpt3_on_3072_devices_answers(capsys):
    """The issue's question; the time is measured and printed, not asserted (the 2-core
    machine is shared, and docs/planning.md reports it)."""
    t0 = time.perf_counter()
    rc = main(["--model", "gpt3-175b", "--devices", "3072", "--machine", PRESET, "--top", "3"])
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out
    print(f"\nplan gpt3-175b on 3072 x {PRESET}: {seconds:.1f} s\n{out}")
    assert rc == 0 and "fastest 3" in out


def test_nothing_fits_says_why_and_what_would():
    r = _cli("--model", "gpt3-175b", "--devices", "8", "--machine", PRESET)
    assert r.returncode == 1, r.stderr
    assert "nothing fits" in r.stdout and "would fit" in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt5"], "argument --model: unknown model 'gpt5'"),
    (["--model", "gpt3-175b"], "argument --devices: required"),
    (["--model", "h=1000,layers=2,heads=16,seq=8,vocab=8", "--devices", "4", "--batch", "4"],
     "argument --model"),
    (["--model", "h=1024", "--devices", "4"], "argument --model: model: missing heads"),
    (["--devices", "4"], "argument --model: required"),
    (["--model", "h=1024,layers=2,heads=16,seq=8,vocab=8", "--devices", "4"],
     "argument --batch: required"),
    (["--model", "gpt3-175b", "--devices", "64", "--zero", "5"], "argument --zero"),
    (["--model", "gpt3-175b", "--devices", "0"], "argument --devices"),
    (["--model", "gpt3-175b", "--devices", "97"], "no composition of 97 devices exists"),
    (["--model", "gpt3-175b", "--devices", "64", "--machine", "nope"], "argument --machine"),
    (["--model", "gpt3-175b", "--devices", "64", "--machine", "local-2core-mpich",
      "--dtype", "bfloat16"], "argument --dtype"),
    (["--model", "gpt3-175b", "--devices", "64", "--state-bytes", "2,2,4"],
     "argument --state-bytes"),
    (["--model", "gpt3-175b", "--devices", "64", "--mem-fraction", "1.5"],
     "argument --mem-fraction"),
])
def test_user_errors_are_one_line_and_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -m summasim.costmodel plan: error: ")
    assert needle in lines[0]


def test_unwritable_outputs_are_user_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for flag in ("--json", "--plot"):
        r = _cli(*SMALL, flag, str(blocker / ("plan.json" if flag == "--json" else "plan.png")))
        assert r.returncode == 2 and f"argument {flag}" in r.stderr
        assert "Traceback" not in r.stderr


def test_known_models_carry_sources():
    r = _cli("--list-models")
    assert r.returncode == 0
    from summasim import spec

    assert MODELS is spec.MODELS
    for name, shape in MODELS.items():
        assert name in r.stdout and shape.source
        assert shape.hidden % shape.heads == 0
    g = MODELS["gpt3-175b"]
    assert (g.layers, g.hidden, g.heads, g.seq, g.vocab) == (96, 12288, 96, 2048, 51200)
    assert _cli("--help").returncode == 0


@pytest.mark.parametrize("given, searched", [
    (["--recompute", "selective"], ("none",)),
    (["--recompute", "none,selective,full"], ("none", "full")),
    ([], ("none", "full")),
])
def test_under_flash_attention_the_plan_says_it_searches_no_selective_recompute(
        given, searched):
    """Flash attention holds no scores for selective recompute to drop, so selective is
    none there: the plan searches, and says in its header and JSON it searched, that."""
    import argparse

    from summasim.costmodel.tools.plan_cli import build_parser, check_args

    args = build_parser(argparse.ArgumentParser()).parse_args(
        ["--model", "h=1024,layers=8,heads=16,seq=512,vocab=2048", "--devices", "8",
         "--batch", "8", "--attention", "flash", *given])
    assert check_args(args).recomputes == searched


def test_the_memory_budget_has_one_name_in_plan_predict_and_explore():
    """plan takes --mem-budget (GiB per device) as predict and explore do; --mem-gib is
    the same flag."""
    import argparse

    from summasim.costmodel.tools.plan_cli import build_parser, check_args

    base = ["--model", "h=1024,layers=8,heads=16,seq=512,vocab=2048", "--devices", "8",
            "--batch", "8"]
    for flag in ("--mem-budget", "--mem-gib"):
        args = build_parser(argparse.ArgumentParser()).parse_args([*base, flag, "12"])
        assert check_args(args).budget == 12 * 2 ** 30


@pytest.mark.parametrize("flags, words", [
    (["--chunks", "3"], "--chunks 3: V model chunks per stage need"),
    (["--sequence-parallel", "on", "--schemes", "optimus"], "sequence parallelism"),
])
def test_nothing_exists_names_the_flag_that_emptied_the_search(flags, words):
    r = _cli("--model", "gpt3-2.7b", "--devices", "8", *flags)
    assert r.returncode == 2 and "no composition of 8 devices exists" in r.stderr, r.stderr
    assert words in r.stderr, r.stderr


def test_predict_prices_the_plan_s_best_with_its_state_bytes_and_bucket(tmp_path, capsys):
    """``plan --bucket-mb --state-bytes`` ranks compositions with them; ``predict`` takes
    the same two flags, so the plan's best row, given to predict, is the same step."""
    from summasim.costmodel.__main__ import main as cm

    flags = ["--machine", "dgx-a100", "--bucket-mb", "5", "--state-bytes", "2,2,4,4"]
    plan_json = tmp_path / "plan.json"
    assert cm(["plan", "--model", "gpt3-6.7b", "--devices", "32", *flags, "--top", "1",
               "--json", str(plan_json)]) == 0
    best = json.loads(plan_json.read_text())["top"][0]
    c = best["composition"]
    assert c["bucket_bytes"] == 5 * 2 ** 20 and c["state_bytes"]["total"] == 16
    grid = {"megatron": str(c["t"]), "optimus": f"{c['q']}x{c['pc']}",
            "summa25": f"{c['q']}x{c['pc']}x{c['d']}", "3d": f"{c['q']}x{c['q']}x{c['q']}"}
    pred_json = tmp_path / "predict.json"
    assert cm(["predict", "--model", "gpt3-6.7b", "--batch", str(c["global_batch"]),
               "--mesh", f"dp={c['dp']},pp={c['pp']},tp={c['scheme']}:{grid[c['scheme']]}",
               "--microbatches", str(c["microbatches"]), "--zero", str(c["zero"]),
               "--recompute", c["recompute"], *flags, "--json", str(pred_json)]) == 0
    capsys.readouterr()
    pred = json.loads(pred_json.read_text())
    assert pred["step_seconds"] == pytest.approx(best["step_seconds"], rel=1e-12)
    assert pred["memory"]["total"] == pytest.approx(best["memory"]["total"], rel=1e-12)
    # without the flags predict prices PyTorch's bucket and 18 bytes a parameter: not it
    assert cm(["predict", "--model", "gpt3-6.7b", "--batch", str(c["global_batch"]),
               "--mesh", f"dp={c['dp']},pp={c['pp']},tp={c['scheme']}:{grid[c['scheme']]}",
               "--microbatches", str(c["microbatches"]), "--zero", str(c["zero"]),
               "--recompute", c["recompute"], "--machine", "dgx-a100", "--json",
               str(pred_json), "--force"]) == 0
    capsys.readouterr()
    assert json.loads(pred_json.read_text())["memory"]["total"] != pred["memory"]["total"]
