"""predict says what bounds the step and what one change would do
(summasim.costmodel.tools.explain)."""

import io
import types

import pytest

from summasim.costmodel.tools import predict


def _run(*argv):
    args = predict.build_parser().parse_args(list(argv))
    out = io.StringIO()
    res = predict.run(args, out=out)
    return res, out.getvalue()


def test_a_deep_pipeline_with_few_micro_batches_is_bound_by_its_bubble():
    res, text = _run("--model", "gpt3-175b", "--machine", "dgx-a100", "--mesh",
                     "dp=1,pp=32,tp=megatron:8", "--microbatches", "4", "--batch", "4",
                     "--dtype", "bfloat16", "--recompute", "full")
    b = res["bound"]
    assert b["term"] == "bubble" and b["share"] > 0.5
    assert "(32 - 1)/(1 x 4) = 775.0%" in b["why"]
    assert "bound by  the pipeline bubble" in text


def test_a_data_parallel_step_across_nodes_is_bound_by_its_nics_and_more_nics_help():
    # a small model on 4 nodes of data parallelism: the ring all-reduce over the NICs
    res, text = _run("--model", "h=2048,heads=16,layers=24,seq=1024,vocab=51200",
                     "--batch", "32", "--machine", "dgx-a100", "--mesh",
                     "dp=32,tp=megatron:1", "--microbatches", "1", "--dtype", "bfloat16")
    b = res["bound"]
    assert b["term"] == "comm.dp" and "inter-node NICs (8 x 200 Gb/s" in b["why"], b
    ifs = {r["change"].split(" (")[0]: r for r in res["what_ifs"]}
    nics = ifs["2x NICs per node"]
    assert nics["fits"] and 0.05 < nics["gain"] < 1.0
    assert ifs["the next GPU generation"]["gain"] > 0
    gains = [r["gain"] for r in res["what_ifs"] if r["fits"]]
    assert gains == sorted(gains, reverse=True)
    assert "what one change would do" in text and "2x NICs per node (16)" in text


def test_a_change_that_does_not_fit_is_marked_and_ranked_last():
    res, text = _run("--model", "gpt3-175b", "--machine", "dgx-a100", "--mesh",
                     "dp=16,pp=16,tp=megatron:4", "--microbatches", "96", "--zero", "1",
                     "--dtype", "bfloat16")
    ifs = res["what_ifs"]
    tail = [r["fits"] for r in ifs]
    assert tail == sorted(tail, reverse=True) and not tail[-1]       # fits first
    zero0 = next(r for r in ifs if r["change"] == "ZeRO 0")
    assert not zero0["fits"] and zero0["memory_bytes"] > 80 * 2 ** 30
    assert "does NOT fit" in text
    assert res["bound"]["term"] == "gemm" and "best bfloat16 GEMM rate" in res["bound"]["why"]


def test_a_tensor_grid_alone_names_its_bound():
    res, text = _run("--model", "gpt3-175b", "--machine", "dgx-a100", "--mesh",
                     "tp=optimus:4x4", "--batch", "16", "--dtype", "bfloat16")
    assert res["bound"]["term"] in ("gemm", "memory_bound", "optimizer", "comm")
    assert 0 < res["bound"]["share"] <= 1 and "bound by" in text


@pytest.mark.parametrize("seq,want", [(576, "gemm"), (256, "optimizer")])
def test_a_grid_alone_is_bound_by_the_largest_part_it_prints(seq, want):
    """The optimizer's update is a part of its own in predict's lines; the bound is the
    largest of those lines, never the memory-bound kernels and the optimizer summed."""
    res, text = _run("--model", f"gpt3-2.7b,seq={seq}", "--batch", "1", "--mesh",
                     "tp=megatron:1")
    parts = {}
    for line in text.splitlines():
        for name, term in (("GEMM", "gemm"), ("memory-bound", "memory_bound"),
                           ("optimizer", "optimizer"), ("exposed comm", "comm")):
            if line.startswith(f"  {name} ") and " ms " in line:
                parts[term] = float(line.split()[-3])
    assert set(parts) == {"gemm", "memory_bound", "optimizer", "comm"}
    assert res["bound"]["term"] == max(parts, key=parts.get) == want, (parts, res["bound"])
    assert abs(res["bound"]["seconds"] * 1e3 - parts[want]) < 0.01


def test_predict_and_plan_carry_the_dev_set_interval_and_the_ties():
    import json

    from summasim.costmodel.tools import devset as intervals, plan_cli

    res, text = _run("--model", "gpt3-175b", "--machine", "dgx-a100", "--mesh",
                     "dp=16,pp=16,tp=megatron:4", "--microbatches", "96", "--zero", "1",
                     "--dtype", "bfloat16")
    lo, hi = res["interval_seconds"]
    assert (lo, hi) == intervals.step_interval(res["step_seconds"]) and lo < hi
    assert "80% interval" in text
    out = io.StringIO()
    args = plan_cli.build_parser().parse_args(
        ["--model", "gpt3-175b", "--machine", "dgx-a100", "--devices", "64", "--batch", "64",
         "--json", "/dev/null"])
    args.json = None
    assert plan_cli.run(args, out=out) == 0
    text = out.getvalue()
    assert "cannot be told apart" in text and "80% interval" in text
    ratio = intervals.tie_ratio()
    assert 1.0 < ratio < 2.0 and f"within {ratio:.2f}x" in text
    # the ties are exactly the ranks within the ratio of the best
    rows = [{"step_seconds": t} for t in (2.0, 2.0 * ratio * 0.999, 2.0 * ratio * 1.001, 9.0)]
    from summasim.costmodel.machine import load_preset

    got = plan_cli._uncertainty(types.SimpleNamespace(rows=rows), load_preset("dgx-a100"))
    assert got["ties"] == [1, 2] and got["tie_ratio"] == ratio
    assert got["interval_seconds"] == list(intervals.step_interval(2.0))
    json.dumps(got)
    # the dev set is GPU clusters: no interval for a CPU node, in predict and plan alike
    cpu = load_preset("local-2core-mpich")
    assert plan_cli._uncertainty(types.SimpleNamespace(rows=rows), cpu)["interval_seconds"] \
        is None
    res, text = _run("--model", "tiny", "--batch", "8", "--mesh", "tp=megatron:4",
                     "--machine", "local-2core-mpich")
    assert res["interval_seconds"] is None and "80% interval       none" in text
    with pytest.raises(ValueError, match="priced a step of inf"):
        intervals.machine_interval(load_preset("dgx-a100"), float("inf"))
    from summasim.cli import number_ranges

    assert number_ranges([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"


def test_a_tensor_grid_alone_prices_its_other_placements(tmp_path, capsys):
    import json

    from summasim.costmodel.__main__ import main

    base = ["predict", "--machine", "dgx-a100", "--model", "gpt3-6.7b", "--batch", "64",
            "--mesh", "tp=optimus:8x8"]
    got = {}
    for placement in ("row-major", "blocked"):
        path = tmp_path / f"{placement}.json"
        assert main(base + ["--placement", placement, "--json", str(path)]) == 0
        got[placement] = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "what another placement would do" in out
    row, blocked = got["row-major"], got["blocked"]
    # each run's what-if is the other run's own step, and its gain is their ratio
    [alt] = row["placements"]
    assert alt["change"] == "placement blocked"
    assert alt["step_seconds"] == pytest.approx(blocked["seconds"])
    assert alt["gain"] == pytest.approx(1 - blocked["seconds"] / row["seconds"])
    [back] = blocked["placements"]
    assert back["step_seconds"] == pytest.approx(row["seconds"])
    # Megatron's one group has rank order only
    path = tmp_path / "megatron.json"
    assert main(["predict", "--machine", "dgx-a100", "--model", "gpt3-6.7b", "--batch", "64",
                 "--mesh", "tp=megatron:8", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["placements"] == []


def test_the_next_generation_of_a_variant_keeps_the_variant():
    """dgx-a100:nics=1's next generation is h100-dgx-ndr:nics=1 (one change: the GPU
    generation), not the H100 preset with its 8 NICs."""
    mesh = ["--model", "gpt3-6.7b", "--batch", "16", "--mesh", "dp=2,tp=megatron:8"]
    res, _ = _run(*mesh, "--machine", "dgx-a100:nics=1")
    nxt = next(r for r in res["what_ifs"] if r["change"].startswith("the next GPU"))
    alone, _ = _run(*mesh, "--machine", "h100-dgx-ndr:nics=1")
    plain, _ = _run(*mesh, "--machine", "h100-dgx-ndr")
    assert "h100-dgx-ndr:nics=1" in nxt["change"]
    assert nxt["step_seconds"] == pytest.approx(alone["step_seconds"], rel=1e-12)
    assert alone["step_seconds"] > 1.5 * plain["step_seconds"]      # the NICs mattered
