"""The composition cost model (summasim.costmodel.workload.composition): pipeline bubble and
schedules, bucketed overlap, ZeRO model states and traffic against their closed forms,
memory per stage, refusals, and the reduction to today's single-scheme prediction."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from summasim.costmodel import list_presets, load_preset
from summasim.costmodel.collectives import collective_time
from summasim.costmodel.workload.composition import predict_case, price_composition
from summasim.costmodel.workload.footprint import memory
from summasim.costmodel.workload.pipeline import (bubble_fraction, in_flight, overlap_exposed,
                                                  pipeline_time)
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
from summasim.costmodel.workload.step import step_cost
from summasim.costmodel.workload.tensor import check_composition
from summasim.costmodel.workload.zero import StateBytes, model_state_bytes

LOCAL = load_preset("local-2core-mpich")
GPU = load_preset("dgx-a100" if "dgx-a100" in list_presets() else "h100-dgx-ndr")
# small enough to price in milliseconds, large enough that every grid below divides it
SMALL = TransformerConfig(b=16, s=64, h=256, n=8, N=8, v=512, dtype="float64",
                          checkpoint=False)
GRIDS = [("megatron", dict(t=4)), ("optimus", dict(q=2)), ("summa25", dict(q=2, d=2))]


def _scheme(name, kw):
    return Scheme.make(name, p=kw.get("t"), q=kw.get("q"), d=kw.get("d", 1))


# -- pipeline --------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (4, 8), (8, 3), (16, 64)])
def test_bubble_fraction_is_the_gpipe_formula(pp, m):
    assert bubble_fraction(pp, m) == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-15)
    # equal stages: both schedules take (m + pp - 1) t and idle (pp - 1) t
    f, b = 0.3, 0.7
    for schedule in ("gpipe", "1f1b"):
        t, crit = pipeline_time([f] * pp, [b] * pp, m, schedule)
        assert t == pytest.approx((m + pp - 1) * (f + b))
        assert (t - m * (f + b)) / t == pytest.approx(bubble_fraction(pp, m))


def test_schedules_differ_in_memory_not_time():
    rng = random.Random(3)
    for _ in range(20):
        pp, m = rng.randint(1, 9), rng.randint(1, 20)
        fs = [rng.uniform(0.1, 1) for _ in range(pp)]
        bs = [rng.uniform(0.1, 2) for _ in range(pp)]
        g, _ = pipeline_time(fs, bs, m, "gpipe")
        o, crit = pipeline_time(fs, bs, m, "1f1b")
        per = [x + y for x, y in zip(fs, bs)]
        assert o == pytest.approx((m - 1) * max(per) + sum(per))
        assert g >= o - 1e-12 and crit == per.index(max(per))
        for s in range(pp):
            assert in_flight(pp, m, s, "gpipe") == m
            assert in_flight(pp, m, s, "1f1b") == min(m, pp - s)


def test_priced_pipeline_has_the_bubble_of_its_stages():
    # pp = 4 stages, m = 8: the step's bubble is the pipeline minus m critical stages, and
    # the breakdown adds up to the step
    for sch, kw in GRIDS:
        r = price_composition(SMALL.replace(b=64), sch, machine=GPU, pp=4, dp=2,
                              microbatches=8, zero=0, **kw)
        st = r["stages"]
        per = [s["forward_seconds"] + s["backward_seconds"] for s in st]
        full = [p for p, s in zip(per, st) for _ in range(s["count"])]
        assert len(full) == 4
        assert r["pipeline_seconds"] == pytest.approx(7 * max(full) + sum(full))
        bd = r["breakdown"]
        total = (bd["gemm"] + bd["memory_bound"] + sum(bd["exposed_comm"].values())
                 + bd["bubble"] + bd["optimizer"])
        assert total == pytest.approx(r["step_seconds"], rel=1e-12)
        assert bd["bubble"] == pytest.approx(r["pipeline_seconds"] - 8 * max(full))


# -- bucketed overlap ------------------------------------------------------------------------
def _simulate(total, bucket, window, tau):
    """Event-by-event: buckets ready as the backward produces them, one at a time."""
    n = math.ceil(total / bucket)
    t = 0.0
    for i in range(1, n + 1):
        size = min(bucket, total - (i - 1) * bucket)
        ready = window * min(i * bucket, total) / total
        t = max(t, ready) + tau(size)
    return t - window


def test_overlap_matches_an_event_simulation():
    rng = random.Random(7)
    for _ in range(200):
        total = rng.uniform(1, 1e4)
        bucket = rng.uniform(1, 3e3)
        window = rng.uniform(0, 5)
        a, beta = rng.uniform(0, 0.1), rng.uniform(0, 1e-3)
        tau = lambda nb: a + beta * nb  # noqa: E731
        got = overlap_exposed(total, bucket, window, tau)
        assert got == pytest.approx(_simulate(total, bucket, window, tau), abs=1e-12)
        last = total - (math.ceil(total / bucket) - 1) * bucket
        assert got >= tau(last) - 1e-12            # the last bucket is never hidden


def test_one_bucket_exposes_the_whole_allreduce():
    # bucket >= gradients: nothing overlaps, the dp part is the ring all-reduce itself
    cfg = SMALL.replace(b=32)
    r = price_composition(cfg, "megatron", t=2, machine=LOCAL, dp=4, zero=0,
                          bucket_bytes=1 << 40, optimizer=False)
    P = r["stages"][0]["params"]
    ring = collective_time("allreduce", P * 8, 4, LOCAL, algorithm="ring").seconds
    ring *= LOCAL.slowdown(LOCAL.ranks_per_node(8))
    assert r["breakdown"]["exposed_comm"]["dp"] == pytest.approx(ring, rel=1e-12)
    small = price_composition(cfg, "megatron", t=2, machine=LOCAL, dp=4, zero=0,
                              bucket_bytes=4096, optimizer=False)
    assert small["breakdown"]["exposed_comm"]["dp"] < ring


# -- ZeRO model states -----------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2, 4, 64])
def test_model_states_mixed_precision_are_the_zero_papers(dp):
    P = 2 ** 20 * 3 * 64              # divisible by every dp here
    mixed = dict(param_bytes=2, grad_bytes=2, optim_bytes=4, master_bytes=4)
    want = {0: 16 * P, 1: 4 * P + 12 * P // dp, 2: 2 * P + 14 * P // dp, 3: 16 * P // dp}
    for zero, total in want.items():
        got = model_state_bytes(P, dp, zero, **mixed)
        assert got["total"] == total, (zero, dp)
        assert got["params"] + got["grads"] + got["optimizer"] == got["total"]
    assert StateBytes.for_dtype("bfloat16").total == 16


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_plain_float64_and_rounding(zero):
    P, dp = 1001, 4                    # not divisible: shards are ceil(P / dp) = 251
    got = model_state_bytes(P, dp, zero)
    shard = 251
    p_items = shard if zero >= 3 else P
    g_items = shard if zero >= 2 else P
    o_items = shard if zero >= 1 else P
    assert got == {"params": 8 * p_items, "grads": 8 * g_items, "optimizer": 16 * o_items,
                   "total": 8 * p_items + 8 * g_items + 16 * o_items}
    # pieces are sharded one by one
    two = model_state_bytes([1001, 3], dp, zero)
    assert two["total"] == got["total"] + model_state_bytes(3, dp, zero)["total"]


def test_model_states_refuse_bad_input():
    for bad in (dict(params=-1, dp=2, zero=0), dict(params=10, dp=0, zero=0),
                dict(params=10, dp=2, zero=4), dict(params=1.5, dp=2, zero=0)):
        with pytest.raises(ValueError):
            model_state_bytes(**bad)


# -- traffic against the closed forms ----------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("sch,kw", GRIDS)
def test_traffic_per_kind_is_the_closed_form(zero, sch, kw):
    dp, pp, m = 4, 2, 3
    cfg = SMALL.replace(b=dp * m * 4)
    r = price_composition(cfg, sch, machine=LOCAL, dp=dp, pp=pp, microbatches=m, zero=zero,
                          **kw)
    bp = bg = 8
    frac = (dp - 1) / dp
    b = cfg.b // (dp * m)
    T = _scheme(sch, kw).p
    act = b * cfg.s * cfg.h * 8 / (1 if sch == "megatron" else T)
    for st in r["stages"]:
        P, tr = st["params"], st["traffic"]
        want = {
            "dp_allreduce": 2 * frac * P * bg if zero == 0 else 0.0,
            # ZeRO 1 reduce-scatters once, ZeRO 2 and 3 after every micro-batch
            "zero_reduce_scatter": {0: 0.0, 1: frac * P * bg, 2: m * frac * P * bg,
                                    3: m * frac * P * bg}[zero],
            "zero_allgather": {0: 0.0, 1: frac * P * bp, 2: frac * P * bp,
                               3: 2 * m * frac * P * bp}[zero],
            # pp = 2: the first stage sends activations, the last their gradients
            "pipeline": m * act,
        }
        for kind, val in want.items():
            assert tr[kind] == pytest.approx(val, rel=1e-12), (kind, st["stage"])
        assert tr["tensor"] > 0 and tr["embedding"] > 0
        if zero == 1:   # the ZeRO paper's P_os: the data-parallel bytes of plain DP
            assert tr["zero_reduce_scatter"] + tr["zero_allgather"] == pytest.approx(
                2 * frac * P * bg)
    # the tied embedding all-reduce carries the wte shard's gradient (1/dp of it under 1-3)
    wte = cfg.v * cfg.h / (T if sch == "megatron" else kw["q"] ** 2)
    assert r["traffic"]["embedding"] == pytest.approx(wte * bg / (dp if zero >= 1 else 1))


def test_zero3_gathers_every_piece_twice_per_microbatch():
    dp, m = 4, 2
    cfg = SMALL.replace(b=dp * m * 2)
    r = price_composition(cfg, "megatron", t=2, machine=LOCAL, dp=dp, microbatches=m,
                          zero=3, optimizer=False)
    pre = price_composition(cfg, "megatron", t=2, machine=LOCAL, dp=dp, microbatches=m,
                            zero=3, optimizer=False, zero3_prefetch=True)
    assert r["traffic"]["zero_allgather"] == pytest.approx(
        2 * m * (dp - 1) / dp * r["params_per_device"] * 8)
    assert pre["breakdown"]["exposed_comm"]["zero"] <= r["breakdown"]["exposed_comm"]["zero"]
    z2 = price_composition(cfg, "megatron", t=2, machine=LOCAL, dp=dp, microbatches=m,
                           zero=2, optimizer=False)
    assert r["breakdown"]["exposed_comm"]["zero"] > z2["breakdown"]["exposed_comm"]["zero"]


# -- memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ck", [False, True])
@pytest.mark.parametrize("sch,kw", GRIDS)
def test_one_replica_one_stage_is_schemes_memory(sch, kw, ck):
    cfg = SMALL.replace(checkpoint=ck)
    r = price_composition(cfg, sch, machine=LOCAL, **kw)
    ref = memory(_scheme(sch, kw), cfg)
    assert r["memory"]["total"] == pytest.approx(ref.total, rel=1e-12)
    assert r["memory"]["model_states"]["total"] == pytest.approx(
        ref.params + ref.grads + ref.optimizer + ref.embedding, rel=1e-12)


def test_memory_per_zero_stage_and_schedule():
    dp, pp, m = 4, 4, 8
    cfg = SMALL.replace(b=dp * m * 2)
    kw = dict(machine=LOCAL, t=2, dp=dp, pp=pp, microbatches=m)
    mems = [price_composition(cfg, "megatron", zero=z, **kw)["memory"] for z in range(4)]
    states = [x["model_states"]["total"] for x in mems]
    assert states[0] > states[1] > states[2] > states[3]
    assert mems[2]["transient"] > 0 and mems[3]["transient"] > 0 and mems[0]["transient"] == 0
    gp = price_composition(cfg, "megatron", zero=0, schedule="gpipe", **kw)
    ob = price_composition(cfg, "megatron", zero=0, schedule="1f1b", **kw)
    assert gp["memory"]["activations"] > ob["memory"]["activations"]
    assert gp["memory"]["in_flight"] == m and ob["memory"]["in_flight"] == min(m, pp)
    assert gp["step_seconds"] == pytest.approx(ob["step_seconds"], rel=0.02)
    ck = price_composition(cfg, "megatron", zero=0, checkpoint=True, **kw)
    assert ck["memory"]["activations"] < ob["memory"]["activations"]
    assert ck["step_seconds"] > ob["step_seconds"]     # recomputation costs time


# -- today's prediction ------------------------------------------------------------------------
@pytest.mark.parametrize("sch,kw", GRIDS)
def test_one_replica_one_stage_is_todays_prediction(sch, kw):
    sc = _scheme(sch, kw)
    # this machine (MPICH, no optimizer in step_cost): step minus the Adam update
    r = price_composition(SMALL, sch, machine=LOCAL, **kw)
    ref = step_cost(sc, SMALL, LOCAL)
    assert r["step_seconds"] - r["breakdown"]["optimizer"] == pytest.approx(ref.seconds,
                                                                            rel=1e-12)
    assert price_composition(SMALL, sch, machine=LOCAL, optimizer=False, **kw)[
        "step_seconds"] == pytest.approx(ref.seconds, rel=1e-12)
    # a GPU preset (NCCL, roofline, optimizer priced by step_cost): the whole step
    for cfg in (SMALL.replace(dtype="bfloat16"), SMALL.replace(dtype="bfloat16", v=0)):
        r = price_composition(cfg, sch, machine=GPU, **kw)     # v = 0: the layers alone
        assert r["step_seconds"] == pytest.approx(step_cost(sc, cfg, GPU).seconds, rel=1e-9)


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    (dict(scheme="megatron", t=4, dp=2, pp=2, devices=32), "2 * 2 * 4 = 16 is not the 32"),
    (dict(scheme="megatron", t=4, pp=9), "a pipeline of 9 stages needs at least 9 layers"),
    (dict(scheme="megatron", t=4, pp=2, stages=(4, 3)), "--stages 4,3: needs 2"),
    (dict(scheme="megatron", t=4, pp=2, microbatches=3, dp=1, schedule="interleaved",
          chunks=2), "m = 3 to be a multiple of pp = 2"),
    (dict(scheme="megatron", t=4, pp=1, schedule="interleaved", chunks=2),
     "needs pp >= 2 stages"),
    (dict(scheme="megatron", t=4, pp=2, schedule="interleaved", chunks=8),
     "2 stages x 8 chunks needs at least 16 layers"),
    (dict(scheme="megatron", t=4, dp=3, microbatches=1), "16 is not divisible by dp * "
                                                           "microbatches = 3 * 1 = 3"),
    (dict(scheme="optimus", q=2, dp=2, microbatches=8), "micro-batches of b = 1"),
    (dict(scheme="summa25", q=2, d=2, dp=1, microbatches=8), "b = 2"),
    (dict(scheme="megatron", t=16), "heads n = 8 is smaller than p = 16 (one per rank)"),
    (dict(scheme="megatron", t=4, zero=4), "zero must be one of"),
    (dict(scheme="megatron", t=4, schedule="interleaved"), "V >= 2 model chunks"),
    (dict(scheme="megatron", t=4, schedule="zigzag"), "unknown schedule"),
    (dict(scheme="megatron", t=4, checkpoint=True, recompute="selective"),
     "contradicts recompute='selective'"),
])
def test_compositions_that_cannot_exist_are_refused(kw, needle):
    with pytest.raises(ValueError) as exc:
        price_composition(SMALL, machine=LOCAL, **kw)
    assert needle in str(exc.value)


def test_check_composition_returns_the_micro_batch():
    assert check_composition(SMALL, Scheme.make("optimus", q=2), 2, 4, 4, 16, 32) == 2


def test_predict_case_prices_the_harness_case():
    # the keys of harness.cases.MeshCase.to_dict()
    case = {"kind": "mesh", "mesh": "dp=2,pp=2,tp=optimus:2x2", "dp": 2, "pp": 2,
            "scheme": "optimus", "q": 2, "d": 1, "t": 4, "zero": 2, "schedule": "gpipe",
            "m": 2, "checkpoint": True, "bucket_bytes": 4096, "steps": 3, "b": 16,
            "s": 64, "h": 256, "heads": 8, "v": 512, "layers": 8, "ffn": 4,
            "dtype": "float64"}
    want = price_composition(SMALL.replace(checkpoint=True), "optimus", q=2, machine=LOCAL,
                             dp=2, pp=2, microbatches=2, zero=2, schedule="gpipe",
                             bucket_bytes=4096, global_batch=16)
    assert predict_case(case, LOCAL) == pytest.approx(want["step_seconds"], rel=1e-12)
    mega = dict(case, scheme="megatron", q=1, t=4, mesh="dp=2,pp=2,tp=megatron:4")
    assert predict_case(mega, LOCAL) > 0
    assert predict_case(dict(case, layers=1), LOCAL) is None      # 1 layer, 2 stages
    # 7 layers on 2 stages: spec.stage_layers' split (4, 3), as the runtime runs it
    assert predict_case(dict(case, layers=7), LOCAL) == pytest.approx(price_composition(
        SMALL.replace(checkpoint=True, N=7), "optimus", q=2, machine=LOCAL, dp=2, pp=2,
        microbatches=2, zero=2, schedule="gpipe", bucket_bytes=4096, global_batch=16,
        stages=(4, 3))["step_seconds"], rel=1e-12)
    # the techniques a case names are priced
    inter = dict(case, schedule="interleaved:2", zero=1, m=2, recompute="selective",
                 checkpoint=False)
    assert predict_case(inter, LOCAL) == pytest.approx(price_composition(
        SMALL.replace(recompute="selective"), "optimus", q=2, machine=LOCAL, dp=2, pp=2,
        microbatches=2, zero=1, schedule="interleaved", chunks=2, bucket_bytes=4096,
        global_batch=16)["step_seconds"], rel=1e-12)
    assert predict_case({"scheme": "optimus"}, LOCAL) is None


def test_compose_never_starts_mpi():
    code = ("import sys, summasim.costmodel.workload.composition, summasim.costmodel.tools.plan; "
            "sys.exit(1 if 'mpi4py.MPI' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_each_stage_prices_the_optimizer_of_its_own_parameters():
    """On a machine with per-layer optimizer pricing, a stage's Adam share follows what
    it holds: the first stage (wte, wpe) and the last (lnf, the tied wte) pay for the
    ends, a middle stage for its layers alone (every stage was once priced as the last)."""
    cfg = SMALL.replace(dtype="bfloat16", N=8)
    r = price_composition(cfg, "megatron", machine=GPU, t=4, pp=4, microbatches=4)
    opt = {st["stage"]: st["tail"]["optimizer"] for st in r["stages"]}
    assert set(opt) == {0, 1, 3}
    assert opt[1] > 0
    assert opt[0] > opt[1] and opt[3] > opt[1]     # the ends hold wte on top of 2 layers
    assert opt[0] != opt[3]                        # wte + wpe against lnf + wte


@pytest.mark.parametrize("sch,kw", GRIDS)
@pytest.mark.parametrize("dp,pp", [(2, 1), (4, 2), (8, 4)])
def test_memory_falls_with_the_zero_stage(sch, kw, dp, pp):
    """Each ZeRO stage shards more and holds no more: ZeRO 2's transient is the
    gradient of one piece and one bucket (its buckets are reduce-scattered as the
    backward ends them), not the whole micro-batch gradient, which made it cost more
    than ZeRO 1."""
    cfg = TransformerConfig(b=16 * dp, s=512, h=2048, n=16, N=8, v=32768, dtype="bfloat16")
    tot = [price_composition(cfg, sch, machine=GPU, dp=dp, pp=pp, microbatches=4, zero=z,
                             **kw)["memory"]["total"] for z in (0, 1, 2, 3)]
    assert all(b <= a for a, b in zip(tot, tot[1:])), tot
    assert tot[3] < tot[0]


@pytest.mark.parametrize("dp, pp, t", [(2, 4, 4), (3, 2, 1), (1, 3, 2)])
def test_mesh_groups_are_the_meshs_rank_order(dp, pp, t):
    """The priced data-parallel and pipeline groups are spec's, in spec's order."""
    from summasim import spec
    from summasim.costmodel.workload.mesh import MeshGroup

    n = dp * pp * t
    assert MeshGroup(pp * t, dp, n, pp * t).groups(n) == spec.mesh_groups("dp", dp, pp, t)
    assert MeshGroup(t, pp, pp * t, t).groups(n) == spec.mesh_groups("pp", dp, pp, t)


@pytest.mark.parametrize("scheme,kw,heads,h0", [
    ("optimus", dict(q=2), 3, 12),             # 3 heads of 6 over 2 columns: 2 + 1
    ("optimus", dict(q=1, pc=3), 4, 12),       # 4 over 3: 2 + 1 + 1
    ("3d", dict(q=2), 3, 12),
    ("optimus", dict(q=2), 4, 12),             # even: h / pc
])
def test_a_hand_off_is_the_busiest_ranks_block_of_whole_heads(scheme, kw, heads, h0):
    """A pipeline hand-off of a 2D/3D grid carries the rank's own activation block:
    b / (d pr) sequences of its column's whole heads, the widest column 0's for the
    busiest rank (the runtime's ``composed.activation_shape``), h / pc only where pc
    divides the heads."""
    m, b, s = 2, 8, 4
    cfg = TransformerConfig(b=b, s=s, h=6 * heads, n=heads, N=2, v=8, dtype="float64",
                            checkpoint=False)
    r = price_composition(cfg, scheme, machine=LOCAL, pp=2, microbatches=m, **kw)
    rows = {"3d": kw["q"] ** 2}.get(scheme, kw["q"])          # d pr
    assert r["traffic"]["pipeline"] == m * (b // m) * s * h0 * 8 / rows
