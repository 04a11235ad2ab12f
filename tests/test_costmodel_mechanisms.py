"""The cluster model's mechanisms of issue 29, each against its closed form or the
published measurement it cites: the contention of overlapped collectives with compute,
ZeRO-3's per-piece gathers, gradient reductions that do not overlap the backward, GEMM
tile and wave quantization, the measured GEMM plateau per GPU generation, and the
memory a device really leaves to tensors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from summasim.costmodel.compute.roofline import (Device, gemm_quantization, gemm_roofline,
                                                 usable_memory)
from summasim.costmodel.machine.presets import load_preset
from summasim.costmodel.workload.composition import flatten_breakdown, price_composition
from summasim.costmodel.workload.overlap import (Window, contention_share, overlapped,
                                                 window, zero3_gathers)
from summasim.costmodel.workload.pipeline import overlap_exposed
from summasim.costmodel.workload.scheme import TransformerConfig

GPU_PRESETS = ("dgx-a100", "dgx-a100-40gb", "h100-dgx-ndr", "dgx1-v100", "dgx2-v100",
               "dgx2h-v100", "pcie-a100-4gpu", "frontera-rtx")


def _device(**kw) -> Device:
    base = dict(name="toy", memory_bandwidth=1e12, vector_flops={"float32": 1e13})
    return Device(**{**base, **kw})


# -- contention ----------------------------------------------------------------------------
@pytest.mark.parametrize("c, y, f", [(1.0, 0.5, 0.2), (1.0, 2.0, 0.2), (1.0, 1.1, 0.2),
                                     (1.0, 0.5, 0.0), (0.0, 0.3, 0.5), (2.0, 0.0, 0.3)])
def test_overlapped_is_the_closed_form_of_compute_slowed_while_the_collective_runs(c, y, f):
    # compute runs at (1 - f) while the collective runs: it ends at c + f y when that is
    # after the collective, else the collective ends last
    t = overlapped(c, y, f)
    if y * (1 - f) <= c:
        assert t == pytest.approx(c + f * y)
    else:
        assert t == pytest.approx(y)
    w = window(c, y, f)
    assert w.exposed == pytest.approx(max(0.0, y - c))
    assert max(c, y) + w.contention == pytest.approx(t)
    if f == 0:
        assert w.contention == 0.0 and t == max(c, y)


def test_contention_share_is_nccls_blocks_over_the_sms_and_matches_the_measured_slowdown():
    h100 = load_preset("h100-dgx-ndr")
    assert h100.device.sms == 132 and h100.device.comm_sms == 24   # whitepaper; NCCL log
    assert contention_share(h100) == pytest.approx(24 / 132)
    # Lee et al. 2025 (arXiv:2507.03114) measured an 18.9% average compute slowdown
    # (at most 40%) from overlapped communication on A100 and H100
    for name in ("h100-dgx-ndr", "dgx-a100"):
        share = contention_share(load_preset(name))
        assert 0.189 - 0.05 < share < 0.40
    assert contention_share(load_preset("local-2core-mpich")) == 0.0   # no device
    assert contention_share(load_preset("pcie-a100-4gpu")) == 0.0      # no channel count


def test_overlapped_data_parallel_buckets_slow_the_backward_by_the_share_of_what_they_hide():
    cfg = TransformerConfig(b=64, s=2048, h=4096, n=32, N=8, v=51200, dtype="bfloat16")
    m = load_preset("dgx-a100")
    kw = dict(t=8, dp=8, global_batch=64, microbatches=1)
    r = price_composition(cfg, "megatron", machine=m, **kw)
    quiet = m.replace(device=dataclasses.replace(m.device, comm_sms=0.0))
    r0 = price_composition(cfg, "megatron", machine=quiet, **kw)
    bd = flatten_breakdown(r["breakdown"])
    tail = r["stages"][0]["tail"]
    assert tail["contention"] > 0 and bd["comm_contention"] == pytest.approx(tail["contention"])
    assert r0["breakdown"]["exposed_comm"]["contention"] == 0.0
    # the same step, slowed by exactly the contention; at most the share of the whole
    # all-reduce (what the backward hid of it)
    assert r["step_seconds"] == pytest.approx(r0["step_seconds"] + tail["contention"])
    exposed_dp = r["breakdown"]["exposed_comm"]["dp"]
    assert tail["contention"] <= 24 / 108 * (r["stages"][0]["backward_seconds"])
    assert exposed_dp == pytest.approx(r0["breakdown"]["exposed_comm"]["dp"])
    assert sum(bd.values()) == pytest.approx(r["step_seconds"])


# -- ZeRO-3 per piece ----------------------------------------------------------------------
def _expand(runs):
    return [x for x, k in runs for _ in range(k)]


def _gathers_by_hand(runs, cf, cb, busy, share, prefetch):
    """An event-by-event walk of the pieces (the reference for zero3_gathers)."""
    xs = _expand(runs)
    if not prefetch:
        return sum(xs), 0.0, sum(xs), 0.0
    exp_f, con_f = xs[0], 0.0
    for j in range(len(xs)):                 # piece j computes while j+1 gathers
        y = xs[j + 1] if j + 1 < len(xs) else 0.0
        t = max(y, cf + share * y) if y > 0 else cf
        exp_f += max(0.0, y - cf)
        con_f += t - max(cf, y)
    back = xs[::-1]
    cw = max(0.0, cb - busy)
    exp_b, con_b = back[0], 0.0
    for j in range(len(back)):
        y = back[j + 1] if j + 1 < len(back) else 0.0
        t = max(y, cw + share * y) if y > 0 else cw
        exp_b += max(0.0, y - cw)
        con_b += t - max(cw, y)
    return exp_f, con_f, exp_b, con_b


@pytest.mark.parametrize("runs", [[(0.3, 1), (0.5, 6), (0.2, 1)], [(0.5, 1)],
                                  [(0.7, 2), (0.1, 1)], [(0.05, 1), (0.04, 30), (0.9, 1)]])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("share", [0.0, 0.18])
def test_zero3_gathers_equal_an_event_walk_over_every_piece(runs, prefetch, share):
    cf, cb, busy = 0.4, 0.8, 0.25
    f, b = zero3_gathers(runs, cf, cb, busy, share, prefetch)
    ef, cfn, eb, cbn = _gathers_by_hand(runs, cf, cb, busy, share, prefetch)
    assert f.exposed == pytest.approx(ef) and f.contention == pytest.approx(cfn)
    assert b.exposed == pytest.approx(eb) and b.contention == pytest.approx(cbn)


def test_zero3_prefetch_hides_gathers_and_the_reduce_scatters_take_backward_link_time():
    runs = [(0.5, 10)]
    f, b = zero3_gathers(runs, 1.0, 1.0, 0.0, 0.0, True)
    assert f.exposed == 0.5 and b.exposed == 0.5            # only the first of each pass
    _, b_busy = zero3_gathers(runs, 1.0, 1.0, 0.8, 0.0, True)
    # 0.2 s of each backward is left to a 0.5 s gather: 0.3 exposed for 9 of them
    assert b_busy.exposed == pytest.approx(0.5 + 9 * 0.3)
    f0, b0 = zero3_gathers(runs, 1.0, 1.0, 0.0, 0.0, False)
    assert f0 == Window(5.0, 0.0) and b0 == Window(5.0, 0.0)


def test_zero3_composition_prices_contention_only_on_devices_with_a_share():
    cfg = TransformerConfig(b=64, s=2048, h=4096, n=32, N=8, v=32000, dtype="bfloat16")
    kw = dict(t=1, dp=64, global_batch=64, zero=3, zero3_prefetch=True)
    gpu = price_composition(cfg, "megatron", machine=load_preset("h100-dgx-ndr"), **kw)
    assert gpu["breakdown"]["exposed_comm"]["contention"] > 0
    cpu_cfg = cfg.replace(dtype="float64", h=64, n=4, s=32, v=128)
    cpu = price_composition(cpu_cfg, "megatron", machine=load_preset("local-2core-mpich"),
                            t=1, dp=4, global_batch=64, zero=3, zero3_prefetch=True)
    assert cpu["breakdown"]["exposed_comm"]["contention"] == 0.0


# -- gradient reduction after the backward --------------------------------------------------
def test_without_grad_overlap_the_whole_bucketed_all_reduce_is_exposed():
    cfg = TransformerConfig(b=64, s=1024, h=3072, n=32, N=4, v=51200, dtype="float16")
    m = load_preset("dgx2h-v100")
    kw = dict(machine=m, t=8, dp=64, global_batch=512, microbatches=1)
    on = price_composition(cfg, "megatron", **kw)
    off = price_composition(cfg, "megatron", grad_overlap=False, **kw)
    assert off["composition"]["grad_overlap"] is False and on["composition"]["grad_overlap"]
    dp_on = on["breakdown"]["exposed_comm"]["dp"]
    dp_off = off["breakdown"]["exposed_comm"]["dp"]
    assert dp_off > dp_on
    # the exposed time is every bucket one after the other: overlap_exposed with no window
    assert off["breakdown"]["exposed_comm"]["contention"] == 0.0
    alone = overlap_exposed(1.0, 2.0, 0.0, lambda nb: 3.0 * nb)
    assert alone == 3.0
    assert off["step_seconds"] - on["step_seconds"] == pytest.approx(
        dp_off - dp_on - on["breakdown"]["exposed_comm"]["contention"], rel=1e-9)


# -- GEMM quantization ---------------------------------------------------------------------
A100_LIKE = dict(sms=108, gemm_tiles=[[256, 128]])   # the guide's example: one tile


def test_wave_quantization_follows_the_nvidia_guide_example():
    # the guide's A100 example: M = 2304, K = 4096, 256 x 128 tiles, a wave of 108 tiles
    dev = _device(**A100_LIKE)
    assert gemm_quantization(dev, 2304, 4096, 1536) == pytest.approx(1.0)   # 9 x 12 = 108
    # one more column of tiles spills into a second, nearly empty wave
    # (9 x 13 = 117 tiles in two waves of 108: 117 of 216 slots busy)
    assert gemm_quantization(dev, 2304, 4096, 1536 + 128) == pytest.approx(216 / 117)
    # whole multiples of 108 tiles are the best points of the sawtooth
    for n in (1536, 3072, 4608):
        assert gemm_quantization(dev, 2304, 4096, n) == pytest.approx(1.0)
    assert gemm_quantization(dev, 2304, 4096, 4608 + 128) > 1.2


def test_tile_quantization_pays_for_the_partial_tiles():
    dev = _device(sms=1, gemm_tiles=[[256, 128]])
    # 257 rows take two tiles of 256 rows (the work of 512); the other orientation, three
    # tiles of 128 rows by 256 columns, wastes more
    assert gemm_quantization(dev, 257, 64, 128) == pytest.approx(512 / 257)


def test_small_outputs_and_devices_without_tiles_are_left_to_the_size_curve():
    dev = _device(**A100_LIKE)
    assert gemm_quantization(dev, 512, 512, 512) == 1.0            # 8 tiles < 108 SMs
    assert gemm_quantization(_device(), 2304, 4096, 1664) == 1.0     # no tile given
    assert gemm_quantization(dev, 1 << 20, 8, 8) == 1.0               # thinner than a tile


def test_the_library_picks_the_tile_that_wastes_least():
    # the guide's spilled shape with both preset tiles: 128 x 128 gives 18 x 13 = 234 tiles
    # in 3 waves of 108 (234 of 324 slots busy), better than 256 x 128's 117 of 216
    two = _device(sms=108, gemm_tiles=[[256, 128], [128, 128]])
    assert gemm_quantization(two, 2304, 4096, 1664) == pytest.approx(324 / 234)
    assert gemm_quantization(two, 2304, 4096, 1536) == pytest.approx(1.0)
    # the presets' plateau shapes (Bekman's MAMF) pay little: A100 PCIe 2304x5120x1536
    pcie = load_preset("pcie-a100-4gpu").device
    assert gemm_quantization(pcie, 2304, 1536, 5120) < 1.06


def test_batched_products_fill_their_waves_together():
    dev = _device(**A100_LIKE)
    one = gemm_quantization(dev, 2048, 128, 2048, batch=1)   # 128 tiles: 2 waves
    many = gemm_quantization(dev, 2048, 128, 2048, batch=27)  # 3456 tiles = 32 waves
    assert one > 1.5 and many == pytest.approx(1.0)


def test_gemm_roofline_applies_the_quantization_to_the_compute():
    m = load_preset("dgx-a100")
    dev = m.device
    base = m.gemm_time(2304, 4096, 1664, "bfloat16")
    t = gemm_roofline(m, dev, 2304, 4096, 1664, "bfloat16", 2)
    assert t == pytest.approx(base * gemm_quantization(dev, 2304, 4096, 1664)
                              + dev.launch_seconds)


def test_gemm_plateau_is_the_measured_mamf_per_generation():
    # Bekman's MAMF table: A100 SXM 267.9, H100 SXM 792.1, A100 PCIe 256.4 TFLOP/s
    assert load_preset("dgx-a100").peak_flops("bfloat16") == pytest.approx(267.9e12)
    assert load_preset("h100-dgx-ndr").peak_flops("bfloat16") == pytest.approx(792.1e12)
    assert load_preset("pcie-a100-4gpu").peak_flops("bfloat16") == pytest.approx(256.4e12)


# -- memory --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GPU_PRESETS)
def test_usable_memory_is_the_memory_less_reserve_less_fragmentation(name):
    m = load_preset(name)
    dev = m.device
    assert dev.reserve_bytes > 0 and 0 < dev.fragmentation < 1
    assert {"reserve_bytes", "fragmentation", "sms", "gemm_tiles"} <= set(dev.sources)
    assert usable_memory(m) == pytest.approx(
        (m.memory_bytes - dev.reserve_bytes) * (1 - dev.fragmentation))
    assert usable_memory(m) < 0.9 * m.memory_bytes


def test_usable_memory_without_a_device_is_the_node_s_memory_over_its_ranks():
    """A CPU node's fit records its memory per core; the ranks of a job on that node
    share it (8 ranks on a 2-core, 24 GiB node get 3 GiB each, not 12)."""
    m = load_preset("local-2core-mpich")
    assert m.node_size is None and m.cores == 2
    assert usable_memory(m) == m.memory_bytes                  # one rank per core
    node = 2 * m.memory_bytes
    for ranks in (1, 2, 3, 8, 16):
        assert usable_memory(m, ranks) == pytest.approx(node / ranks)
    cluster = m.replace(node_size=4)                        # at most 4 ranks per node
    assert usable_memory(cluster, 64) == pytest.approx(node / 4)
    assert usable_memory(load_preset("dgx-a100"), 64) == usable_memory(load_preset("dgx-a100"))


def test_predict_plan_and_explore_share_a_cpu_node_s_memory_among_its_ranks():
    import io
    import sys

    from summasim.costmodel.tools import predict

    model = ["--model", "h=2048,heads=16,layers=24,seq=1024,vocab=51200", "--dtype",
             "float64", "--machine", "local-2core-mpich"]
    args = predict.build_parser().parse_args(model + ["--batch", "2", "--mesh",
                                                      "tp=megatron:8"])
    out = io.StringIO()
    predict.run(args, out=out)
    # 10.1 GiB per rank, 81 GiB in all on a 23.5 GiB node: it does not fit
    assert "does NOT fit in 2.94 GiB per device" in out.getvalue(), out.getvalue()
    from summasim.costmodel.__main__ import main as cli_main
    from summasim.costmodel.tools import plan_cli

    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        assert cli_main(["explore", *model, "--batch", "8", "--p", "1,8", "--no-iso",
                         "--schemes", "megatron"]) == 0
    finally:
        sys.stdout = sys_stdout
    assert "23.5 GiB at p = 1 to 2.94 GiB at p = 8" in out.getvalue(), out.getvalue()
    args = plan_cli.build_parser().parse_args(model + ["--devices", "8", "--batch", "8"])
    assert plan_cli.check_args(args).budget == pytest.approx(
        2 * load_preset("local-2core-mpich").memory_bytes / 8)


@pytest.mark.parametrize("bad, says", [
    (dict(sms=10, comm_sms=11), "must not exceed"),
    (dict(fragmentation=1.0), "[0, 1)"),
    (dict(gemm_tiles=[[256, 128]]), "needs 'device.sms'"),
    (dict(sms=10, gemm_tiles=[[256]]), "[rows,"),
    (dict(sms=10, gemm_tiles=[256, 128]), "[rows,"),
    (dict(sms=-1), "integer >= 0"),
    (dict(reserve_bytes=-1.0), ">= 0"),
])
def test_device_fields_are_checked(bad, says):
    with pytest.raises(ValueError, match=None) as exc:
        _device(**bad)
    assert says in str(exc.value)


def test_device_round_trips_its_new_fields():
    dev = load_preset("h100-dgx-ndr").device
    again = Device.from_dict(dev.to_dict())
    assert again == dev and again.gemm_tiles == ((256, 128), (128, 128))
    plain = _device()
    assert "sms" not in plain.to_dict() and Device.from_dict(plain.to_dict()) == plain


def test_math_of_the_reserve_matches_its_cited_parts():
    # context 700 MiB + cuBLAS 8.125 MiB + cuBLASLt (32 MiB Hopper, 4 MiB others) + NCCL
    # 24 channels x 2 neighbours x 4 MiB x 3 communicators
    MiB = float(1 << 20)
    nccl = 24 * 2 * 4 * 3
    assert load_preset("h100-dgx-ndr").device.reserve_bytes == (700 + 8.125 + 32 + nccl) * MiB
    assert load_preset("dgx-a100").device.reserve_bytes == (700 + 8.125 + 4 + nccl) * MiB
    assert math.isclose(load_preset("dgx-a100").device.fragmentation, 0.15)


# -- pipeline hand-offs ----------------------------------------------------------------------
@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2)])
def test_overlapped_hand_offs_leave_the_steady_state_and_stay_in_fill_and_drain(schedule,
                                                                               chunks):
    cfg = TransformerConfig(b=64, s=2048, h=8192, n=64, N=16, v=51200, dtype="bfloat16",
                            tied=False)
    m = 8
    kw = dict(machine=load_preset("dgx-a100"), t=8, pp=4, microbatches=m, global_batch=64,
              schedule=schedule, chunks=chunks)
    block = price_composition(cfg, "megatron", **kw)
    over = price_composition(cfg, "megatron", p2p_overlap=True, **kw)
    assert over["composition"]["p2p_overlap"] and not block["composition"]["p2p_overlap"]
    sends = block["breakdown"]["exposed_comm"]["pp"] / m        # untied: no embedding
    per = [st["forward_seconds"] + st["backward_seconds"] for st in block["stages"]]
    crit = max(per)
    assert 0 < sends < crit - sends                              # hidden, with contention
    f = 24 / 108
    steady = crit - sends + f * sends                            # max(y, c + f y)
    saved = (m - 1 if schedule == "1f1b" else m) * (crit - steady)
    assert over["pipeline_seconds"] == pytest.approx(block["pipeline_seconds"] - saved)
    bd = flatten_breakdown(over["breakdown"])
    assert bd["comm_pp"] == 0.0
    assert bd["comm_contention"] == pytest.approx(m * f * sends)
    assert sum(bd.values()) == pytest.approx(over["step_seconds"])
    assert over["step_seconds"] < block["step_seconds"]


def test_predict_and_plan_take_the_engines_overlaps(tmp_path, capsys):
    from summasim.costmodel.__main__ import main

    base = ["predict", "--machine", "dgx-a100", "--model", "gpt3-6.7b", "--batch", "64",
            "--mesh", "dp=4,pp=2,tp=megatron:8", "--microbatches", "8"]
    got = {}
    for flag in ("", "--no-grad-overlap", "--p2p-overlap"):
        path = tmp_path / f"p{len(got)}.json"
        assert main(base + ([flag] if flag else []) + ["--json", str(path)]) == 0
        got[flag] = json.loads(path.read_text())
    capsys.readouterr()
    plain, after, p2p = got[""], got["--no-grad-overlap"], got["--p2p-overlap"]
    assert after["composition"]["grad_overlap"] is False and p2p["composition"]["p2p_overlap"]
    assert (after["breakdown"]["exposed_comm"]["dp"]
            > plain["breakdown"]["exposed_comm"]["dp"])
    assert p2p["breakdown"]["exposed_comm"]["pp"] < plain["breakdown"]["exposed_comm"]["pp"]
    path = tmp_path / "plan.json"
    assert main(["plan", "--machine", "dgx-a100", "--model", "gpt3-2.7b", "--devices", "16",
                 "--p2p-overlap", "--no-grad-overlap", "--json", str(path)]) == 0
    capsys.readouterr()
    plan = json.loads(path.read_text())
    assert plan["top"]
    for row in plan["top"]:
        assert row["composition"]["p2p_overlap"] is True
        assert row["composition"]["grad_overlap"] is False


def test_devset_explains_a_points_breakdown_and_bound(capsys):
    from summasim.costmodel.__main__ import main
    from summasim.costmodel.tools import devset

    pid = "ibmfsdp-a100-128gpu-llama2-70b"
    assert main(["devset", "--explain", pid]) == 0
    out = capsys.readouterr().out
    point = next(p for p in devset.load_points() if p["id"] == pid)
    res = devset.price_point_composition(point)
    assert f"step {res['step_seconds']:.4g} s" in out
    assert "comm_contention" in out and "bound by the GEMM rate" in out
    assert f"predicted {devset.predict_point(point):.4g}" in out
    assert main(["devset", "--explain", "no-such-point"]) == 2
    assert "unknown point" in capsys.readouterr().err
    assert main(["devset", "--explain", "nccl-h100-2gpu-ring-nvswitch"]) == 2
    assert "not a priced composition" in capsys.readouterr().err


def test_bucket_contention_is_absorbed_by_a_backlogged_reduction():
    from summasim.costmodel.workload.overlap import bucket_contention

    # hidden but for its last bucket: the compute's slowdown moves the end by f hidden
    assert bucket_contention(1.0, 0.1, 0.1, 0.2) == pytest.approx(0.2)
    # a backlog of 0.5 s beyond the last bucket absorbs all of it
    assert bucket_contention(1.0, 0.6, 0.1, 0.2) == 0.0
    # part of it
    assert bucket_contention(1.0, 0.15, 0.1, 0.2) == pytest.approx(0.15)


def test_a_communication_bound_reduction_has_no_contention(tmp_path, capsys):
    from summasim.costmodel.__main__ import main

    # one NIC per node: the dp all-reduce of float32 gradients outlasts the backward
    path = tmp_path / "p.json"
    assert main(["predict", "--model", "gpt3-6.7b", "--batch", "16", "--mesh",
                 "dp=2,tp=megatron:8", "--machine", "dgx-a100:nics=1", "--json",
                 str(path)]) == 0
    capsys.readouterr()
    r = json.loads(path.read_text())
    assert r["breakdown"]["exposed_comm"]["dp"] > 0.5 * r["step_seconds"]
    assert r["breakdown"]["exposed_comm"]["contention"] == 0.0


def test_p2p_overlap_is_refused_with_gpipe(capsys):
    from summasim.costmodel.__main__ import main

    cfg = TransformerConfig(b=16, s=256, h=512, n=8, N=4, v=1024, dtype="bfloat16")
    with pytest.raises(ValueError, match="gpipe has none"):
        price_composition(cfg, "megatron", machine=load_preset("dgx-a100"), t=2, pp=2,
                          microbatches=4, global_batch=16, schedule="gpipe", p2p_overlap=True)
    assert main(["predict", "--machine", "dgx-a100", "--model", "gpt3-2.7b", "--batch", "64",
                 "--mesh", "dp=4,pp=2,tp=megatron:8", "--microbatches", "8",
                 "--schedule", "gpipe", "--p2p-overlap"]) == 2
    assert "--p2p-overlap" in capsys.readouterr().err
