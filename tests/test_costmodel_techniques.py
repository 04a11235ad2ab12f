"""Issue 30's techniques in the cost model, each against a hand computation on a small
model: mixed precision, Megatron sequence parallelism, the interleaved 1F1B schedule,
uneven stages, selective and full recompute, blockwise attention, SwiGLU, grouped-query
attention and an untied head; and predict and plan taking them."""

from __future__ import annotations

import io
import json

import pytest

from summasim import options, spec
from summasim.costmodel import load_preset
from summasim.costmodel.collectives.nccl import bus_factor, total_bytes
from summasim.costmodel.compute.roofline import (ADAM_BYTES, attention_kernels,
                                                 layer_kernels, model_kernels)
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.workload.footprint import memory
from summasim.costmodel.workload.layer import layer_ops, recompute_ops
from summasim.costmodel.workload.mesh import MeshGroup, _Coll, model_flops
from summasim.costmodel.workload.pipeline import (bubble_fraction, bubble_over_ideal,
                                                  in_flight, interleaved_held,
                                                  pipeline_time)
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig, misfit
from summasim.costmodel.workload.stage_memory import stage_plan
from summasim.costmodel.workload.tensor import tensor_memory
from summasim.costmodel.workload.zero import StateBytes

GPU = load_preset("dgx-a100")
LOCAL = load_preset("local-2core-mpich")
MEG = {t: Scheme.make("megatron", p=t) for t in (1, 2, 4)}
OPT = Scheme.make("optimus", q=2)
# 16-bit, no recompute: small enough to price in milliseconds
CFG = TransformerConfig(b=4, s=64, h=256, n=8, N=8, v=512, dtype="bfloat16",
                        recompute="none")


def per_layer(sch, cfg) -> float:
    """Activation bytes one more layer adds (memory is affine in N)."""
    return (memory(sch, cfg.replace(N=2)).activations
            - memory(sch, cfg.replace(N=1)).activations)


def flops(ops) -> float:
    return sum(2 * op[1] * op[2] * op[3] * op[4] for op in ops if op[0] == "gemm")


# -- mixed precision --------------------------------------------------------------------------
def test_mixed_precision_state_bytes():
    # the ZeRO paper's 2 + 2 + 12 bytes per parameter
    assert StateBytes.for_dtype("bfloat16").to_dict() == {
        "param": 2, "grad": 2, "optim": 4, "master": 4, "total": 16}
    # float32 gradient buffer and reduction (Megatron-LM's main_grad): 2 + 4 + 12
    assert StateBytes.for_training("bfloat16").total == 18
    assert StateBytes.for_training("float16", "float32").grad == 4
    assert StateBytes.for_training("bfloat16", "bfloat16") == StateBytes.for_dtype("bfloat16")
    assert StateBytes.for_training("float32") == StateBytes(4, 4, 4, 0)
    with pytest.raises(ValueError, match="needs mixed precision"):
        StateBytes.for_training("float32", "bfloat16")


def test_activations_and_messages_are_two_bytes_and_grads_are_reduced_in_their_type():
    f32 = CFG.replace(dtype="float32")
    assert memory(MEG[2], CFG).activations * 2 == memory(MEG[2], f32).activations
    dp, pp, m, t = 2, 2, 2, 2
    kw = dict(machine=GPU, t=t, dp=dp, pp=pp, microbatches=m, global_batch=16)
    for grad_reduce, bg in (("float32", 4), ("bfloat16", 2)):
        r = price_composition(CFG, "megatron", state_bytes=StateBytes.for_training(
            "bfloat16", grad_reduce), **kw)
        st = r["stages"][0]
        assert st["traffic"]["dp_allreduce"] == 2 * (dp - 1) / dp * st["params"] * bg
        # one activation forward, b s h 16-bit items (Megatron: every rank its copy)
        assert st["traffic"]["pipeline"] == m * 4 * 64 * 256 * 2
        assert r["memory"]["model_states"]["grads"] == st["memory"]["model_states"]["grads"]
    # Adam's fused update on the roofline: float32 master, moments and gradient read
    # and written (28 bytes) plus the 16-bit copy of the weight cast from the master
    kern = model_kernels(MEG[2], CFG, local_params=1000, param_tensors=1)["optimizer"]
    assert kern[0].nbytes == (ADAM_BYTES + 2 * 2) * 1000


def test_loss_scale_unscales_and_dynamic_all_reduces_a_flag():
    kw = dict(machine=GPU, t=2, dp=2, pp=2, microbatches=2, global_batch=16, zero=1,
              state_bytes=StateBytes.for_training("float16"))
    cfg = CFG.replace(dtype="float16")
    opt = {ls: [s["tail"]["optimizer"] for s in price_composition(
        cfg, "megatron", loss_scale=ls, **kw)["stages"]] for ls in ("none", "static:1024",
                                                                     "dynamic")}
    r = price_composition(cfg, "megatron", **kw)
    for i, st in enumerate(r["stages"]):
        unscale = st["params"] / 2 * 2 * 4 / GPU.device.memory_bandwidth   # read + write
        assert opt["static:1024"][i] - opt["none"][i] == pytest.approx(unscale, rel=1e-9)
        flag = _Coll(GPU, 1.0, 8)("allreduce", 4, MeshGroup(1, 8, 8, 1))    # all 8 devices
        assert opt["dynamic"][i] - opt["static:1024"][i] == pytest.approx(flag, rel=1e-9)
        assert flag > 0


# -- sequence parallelism ---------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
def test_megatron_activations_are_korthikantis_table_2(t):
    """Korthikanti et al. 2022, Table 2, 16-bit with dropout: per layer s b h (10 + 24/t +
    5 a s/(h t)) bytes, with sequence parallelism s b h (34/t + 5 a s/(h t)); selective
    recompute drops the 5 a s/(h t); full keeps the layer input, 2 s b h / t. Plus the
    LayerNorm statistics summasim keeps, 4 b s float items (whole, or over t)."""
    cfg = CFG.replace(dropout=0.1)
    b, s, h, a = cfg.b, cfg.s, cfg.h, cfg.n
    sbh, stats = s * b * h, 4 * b * s * 2
    sch = MEG[t]
    assert per_layer(sch, cfg) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t))
                                                + stats, rel=1e-12)
    sp = cfg.replace(sequence_parallel=True)
    assert per_layer(sch, sp) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t))
                                               + stats / t, rel=1e-12)
    assert per_layer(sch, cfg.replace(recompute="selective")) == pytest.approx(
        sbh * (10 + 24 / t) + stats, rel=1e-12)
    assert per_layer(sch, sp.replace(recompute="selective")) == pytest.approx(
        sbh * 34 / t + stats / t, rel=1e-12)
    full = cfg.replace(recompute="full")
    assert per_layer(sch, full) == pytest.approx(2 * sbh / t, rel=1e-12)
    # without dropout the masks go: 32 s b h and 2 a s^2 b at t = 1
    assert per_layer(MEG[1], CFG) == pytest.approx(32 * sbh + 2 * a * s * s * b + stats)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sequence_parallelism_divides_the_layer_by_t(recompute):
    cfg = CFG.replace(dropout=0.1, recompute=recompute)
    one = per_layer(MEG[1], cfg)
    for t in (2, 4):
        assert per_layer(MEG[t], cfg.replace(sequence_parallel=True)) == pytest.approx(
            one / t, rel=1e-12)
        assert per_layer(MEG[t], cfg) > one / t


def test_sequence_parallel_collectives_are_reduce_scatter_and_all_gather():
    M, h, p = CFG.b * CFG.s, CFG.h, 4
    plain = layer_ops(MEG[p], CFG)
    sp = layer_ops(MEG[p], CFG.replace(sequence_parallel=True))
    colls = lambda ops: [op for op in ops if op[0] == "coll"]  # noqa: E731
    assert colls(plain["forward"]) == [("coll", "allreduce", "world", p, M * h, 2)]
    assert colls(sp["forward"]) == [("coll", "reduce_scatter", "world", p, M * h, 2),
                                    ("coll", "allgather", "world", p, M * h // p, 2)]
    assert colls(sp["backward"]) == colls(sp["forward"])
    # the same ring bytes per rank: 2 (p-1)/p b s h in one collective or in two
    wire = lambda op: bus_factor(op[1], p) * total_bytes(op[1], op[4], p) * op[5]  # noqa
    assert sum(map(wire, colls(sp["forward"]))) == pytest.approx(
        sum(map(wire, colls(plain["forward"]))), rel=1e-15)
    # the LayerNorm, dropout and residual kernels run on s / p of the sequence
    k0 = {k.name: k for k in layer_kernels(MEG[p], CFG)["forward"]}
    k1 = {k.name: k for k in layer_kernels(MEG[p], CFG.replace(sequence_parallel=True))[
        "forward"]}
    for name in ("ln1", "ln2", "proj_bias_dropout_residual", "fc2_bias_dropout_residual"):
        assert k1[name].nbytes * p == k0[name].nbytes
    assert k1["softmax"] == k0["softmax"]                      # split by heads anyway
    # the pipeline hands on the [s/t, b, h] shard
    r = price_composition(CFG.replace(sequence_parallel=True), "megatron", t=p, pp=2,
                          machine=GPU, microbatches=2, global_batch=2 * CFG.b)
    assert r["stages"][0]["traffic"]["pipeline"] == 2 * M * h * 2 / p


def test_sequence_parallelism_is_megatrons_only():
    sp = CFG.replace(sequence_parallel=True)
    for sch in (OPT, Scheme.make("summa25", q=2, d=2)):
        assert "sequence parallelism is Megatron's (1D) only" in misfit(sch, sp)
        with pytest.raises(ValueError, match="already splits every activation"):
            price_composition(sp, sch, machine=GPU)
    assert "sequence s = 63 is not divisible by p = 2" in misfit(MEG[2], sp.replace(s=63))
    assert misfit(MEG[4], sp) is None


# -- interleaved 1F1B -------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16)])
def test_interleaved_bubble_is_narayanans(pp, m):
    f, b = 0.3, 0.7
    last = None
    for V in (1, 2, 4):
        kind = "interleaved" if V > 1 else "1f1b"
        t, _ = pipeline_time([f] * pp, [b] * pp, m, kind, chunks=V)
        bubble = t - m * (f + b)
        assert bubble / (m * (f + b)) == pytest.approx((pp - 1) / (V * m), rel=1e-12)
        assert bubble_over_ideal(pp, m, V) == pytest.approx((pp - 1) / (V * m))
        assert bubble / t == pytest.approx(bubble_fraction(pp, m, V), rel=1e-12)
        if last is not None:
            assert bubble < last                               # falls with V
        last = bubble


def _megatron_schedule_peak(pp, m, V, s, weights):
    """An event-by-event run of Megatron-LM's interleaved loop on stage s: the largest
    weighted sum of chunk activations held."""
    total = m * V
    warm = total if m == pp else min((pp - s - 1) * 2 + (V - 1) * pp, total)
    held, peak, nf, nb = [0] * V, 0.0, 0, 0

    def chunk(k, forward):
        c = (k % (pp * V)) // pp
        return c if forward else V - 1 - c

    def forward():
        nonlocal nf, peak
        held[chunk(nf, True)] += 1
        nf += 1
        peak = max(peak, sum(n * w for n, w in zip(held, weights)))

    def backward():
        nonlocal nb
        held[chunk(nb, False)] -= 1
        assert held[chunk(nb, False)] >= 0
        nb += 1

    for _ in range(warm):
        forward()
    for _ in range(total - warm):
        forward()
        backward()
    while nb < total:
        backward()
    assert held == [0] * V
    return peak


@pytest.mark.parametrize("pp,m,V", [(2, 2, 2), (2, 6, 3), (4, 4, 2), (4, 8, 2), (4, 12, 4),
                                    (8, 16, 2), (3, 9, 3)])
def test_interleaved_in_flight_follows_megatrons_schedule(pp, m, V):
    for s in range(pp):
        count = _megatron_schedule_peak(pp, m, V, s, [1] * V)
        assert in_flight(pp, m, s, "interleaved", V) == count
        if m != pp:                                # the warm-up, then one forward more
            assert count == min((pp - s - 1) * 2 + (V - 1) * pp + 1, m * V)
        weights = [1.0 + 0.37 * c for c in range(V)]
        got = max(sum(n * w for n, w in zip(vec, weights))
                  for vec in interleaved_held(pp, m, V, s))
        assert got == pytest.approx(_megatron_schedule_peak(pp, m, V, s, weights))


def test_interleaved_composition_hand_offs_memory_and_refusals():
    pp, m, t = 4, 8, 2
    cfg = CFG.replace(N=16)
    kw = dict(machine=GPU, t=t, pp=pp, microbatches=m, global_batch=32)
    one = price_composition(cfg, "megatron", **kw)
    bubbles = [one["bubble_over_ideal"]]
    for V in (2, 4):
        r = price_composition(cfg, "megatron", schedule="interleaved", chunks=V, **kw)
        bubbles.append(r["bubble_over_ideal"])
        p2p = 4 * 64 * 256 * 2                     # b s h, 16-bit
        tr = {st["stage"]: st["traffic"]["pipeline"] for st in r["stages"]}
        # V hand-offs each way per micro-batch; the ends one fewer
        assert tr == {0: m * p2p * (2 * V - 1), 1: m * p2p * 2 * V, 3: m * p2p * (2 * V - 1)}
        assert r["composition"]["stage_layers"] == [16 // (pp * V)] * (pp * V)
        # stage 0 holds min(2 (pp - 1) + (V - 1) pp + 1, m V) chunk activations
        tm = tensor_memory(MEG[t], cfg, 4)
        st0 = next(st for st in r["stages"] if st["stage"] == 0)["memory"]
        held = min(2 * (pp - 1) + (V - 1) * pp + 1, m * V)
        assert st0["in_flight"] == held
        assert st0["activations"] == pytest.approx(held * (16 // (pp * V)) * tm.act_layer
                                                   + tm.grad_bufs, rel=1e-12)
    assert bubbles[0] > bubbles[1] > bubbles[2]
    with pytest.raises(ValueError, match="multiple of pp = 4"):
        price_composition(cfg, "megatron", schedule="interleaved", chunks=2,
                          **{**kw, "microbatches": 6, "global_batch": 24})


# -- uneven stages ----------------------------------------------------------------------------
def test_stage_plan_groups_equal_stages():
    assert stage_plan(8, 4) == ((0, 1, (2,)), (1, 2, (2,)), (3, 1, (2,)))
    # stages 1 and 2 cost the same: priced once, by stage 1 (more in flight)
    assert stage_plan(8, 4, (0, 4, 4, 0)) == ((0, 1, (0,)), (1, 2, (4,)), (3, 1, (0,)))
    assert stage_plan(7, 2) == ((0, 1, (4,)), (1, 1, (3,)))
    # interleaved: virtual stage c pp + s is chunk c of stage s
    assert stage_plan(8, 2, (1, 2, 3, 2), 2) == ((0, 1, (1, 3)), (1, 1, (2, 2)))


def test_uneven_stages_price_each_stage_and_the_slowest():
    kw = dict(machine=GPU, t=2, pp=4, microbatches=4, global_batch=16)
    even = price_composition(CFG, "megatron", **kw)
    ends = price_composition(CFG, "megatron", stages=(0, 4, 4, 0), **kw)
    skew = price_composition(CFG, "megatron", stages=(1, 3, 1, 3), **kw)
    assert ends["composition"]["stage_layers"] == [0, 4, 4, 0]
    st = {s["stage"]: s for s in ends["stages"]}
    assert st[0]["layers"] == 0 and st[1]["layers"] == 4 and st[1]["count"] == 2
    # the embedding stage holds no layer's activations: its in-flight micro-batches
    # cost only the activation-gradient buffers
    tm = tensor_memory(MEG[2], CFG, 4)
    assert st[0]["memory"]["activations"] == pytest.approx(tm.grad_bufs)
    # the step: the pipeline of the four stages, the slowest setting the pace
    per = [s["forward_seconds"] + s["backward_seconds"] for s in ends["stages"]]
    full = [x for x, s in zip(per, ends["stages"]) for _ in range(s["count"])]
    assert len(full) == 4
    assert ends["pipeline_seconds"] == pytest.approx(3 * max(full) + sum(full), rel=1e-12)
    assert ends["memory"]["total"] == max(s["memory"]["total"] for s in ends["stages"])
    assert ends["step_seconds"] > even["step_seconds"]
    assert skew["step_seconds"] > even["step_seconds"]


# -- recompute --------------------------------------------------------------------------------
def test_recompute_memory_and_compute():
    sch = MEG[2]
    none, sel, full = (CFG.replace(recompute=r) for r in ("none", "selective", "full"))
    b, s, h, n = CFG.b, CFG.s, CFG.h, CFG.n
    # selective drops the b n s^2 / t probabilities of every layer (16-bit)
    assert per_layer(sch, none) - per_layer(sch, sel) == pytest.approx(b * n * s * s / 2 * 2)
    assert per_layer(sch, sel) < per_layer(sch, none)
    assert per_layer(sch, full) < per_layer(sch, sel)
    # ... and holds one layer's core while its backward recomputes it
    assert memory(sch, sel).activations == pytest.approx(
        memory(sch, none).activations - (CFG.N - 1) * b * n * s * s / 2 * 2, rel=1e-12)
    # compute: selective runs Q K^T and attention over V again, 4 b s^2 h / t flops
    extra = flops(layer_ops(sch, sel)["backward"]) - flops(layer_ops(sch, none)["backward"])
    assert extra == 4 * b * s * s * h / 2
    assert flops(recompute_ops(sch, sel)) == extra
    # full runs the whole forward again
    assert flops(layer_ops(sch, full)["backward"]) - flops(layer_ops(sch, none)[
        "backward"]) == flops(layer_ops(sch, none)["forward"])
    # and the softmax kernel again on the roofline
    k_sel = [k.name for k in layer_kernels(sch, sel)["backward"]]
    assert k_sel[0] == "softmax" and k_sel.count("softmax") == 1
    # a composition: none < selective < full in time, the reverse in memory
    kw = dict(machine=GPU, t=2, pp=2, microbatches=4, global_batch=16)
    res = {rc: price_composition(CFG, "megatron", recompute=rc, **kw)
           for rc in ("none", "selective", "full")}
    steps = [res[rc]["step_seconds"] for rc in ("none", "selective", "full")]
    mems = [res[rc]["memory"]["activations"] for rc in ("none", "selective", "full")]
    assert steps[0] < steps[1] < steps[2] and mems[0] > mems[1] > mems[2]
    assert res["full"]["composition"]["checkpoint"] and \
        res["selective"]["composition"]["recompute"] == "selective"


def test_checkpoint_is_an_alias_of_full_recompute():
    assert TransformerConfig(checkpoint=True).recompute == "full"
    assert TransformerConfig(checkpoint=False).recompute == "none"
    assert TransformerConfig().recompute == "full"            # the old default
    sel = TransformerConfig(recompute="selective")
    assert not sel.checkpoint
    assert sel.replace(checkpoint=True).recompute == "full"
    assert sel.replace(checkpoint=False).recompute == "selective"   # not full: unchanged
    assert TransformerConfig(recompute="full").replace(checkpoint=False).recompute == "none"
    with pytest.raises(ValueError, match="contradicts"):
        TransformerConfig(checkpoint=True, recompute="none")
    with pytest.raises(ValueError, match="recompute must be one of"):
        TransformerConfig(recompute="some")
    model = spec.Model.parse("tiny")
    assert TransformerConfig.from_model(model, 8, checkpoint=True,
                                        dtype="float32").recompute == "full"
    assert TransformerConfig.from_model(model, 8, recompute="selective",
                                        dtype="float32").recompute == "selective"
    with pytest.raises(ValueError, match="contradicts"):
        TransformerConfig.from_model(model, 8, checkpoint=True, recompute="none",
                                     dtype="float32")


# -- blockwise attention ----------------------------------------------------------------------
def test_flash_attention_memory_traffic_and_flops():
    sch, p = MEG[2], 2
    b, s, h, n = CFG.b, CFG.s, CFG.h, CFG.n
    fl = CFG.replace(attention="flash")
    # no b n s^2 in memory: only the float32 log-sum-exp of each query row
    assert per_layer(sch, fl) == pytest.approx(
        per_layer(sch, CFG.replace(recompute="selective")) + 4 * b * n * s / p)
    assert per_layer(sch, fl.replace(s=2 * s)) == 2 * per_layer(sch, fl)    # linear in s
    assert per_layer(sch, CFG) - per_layer(sch, fl) == b * n * s * s / p * 2 - 4 * b * n * s / p
    # no s^2 traffic on the roofline: the softmax runs inside the attention kernel
    S, Xs = b * n * s * s / p, b * s * h / p
    plain = attention_kernels(sch, CFG)
    flash = attention_kernels(sch, fl)
    assert [k.nbytes for k in plain["forward"]] == [2 * S * 2]
    assert [k.nbytes for k in flash["forward"]] == [4 * b * n * s / p]
    assert [k.nbytes for k in flash["backward"]] == [2 * Xs * 2 + 4 * b * n * s / p]
    assert flash["forward"][0].flops == plain["forward"][0].flops
    # FlashAttention-2: backward attention flops 2.5x the forward's (Q K^T recomputed)
    att = lambda ops: flops([op for op in ops if op[0] == "gemm" and op[1] == s])  # noqa
    att_f = att(layer_ops(sch, fl)["forward"])
    assert att_f == 4 * b * s * s * h / p == att(layer_ops(sch, CFG)["forward"])
    assert att(layer_ops(sch, CFG)["backward"]) == 2 * att_f
    assert att(layer_ops(sch, fl)["backward"]) == 2.5 * att_f
    # selective recompute has nothing left to do under flash
    assert recompute_ops(sch, fl.replace(recompute="selective")) == []


# -- model variants ---------------------------------------------------------------------------
def test_swiglu_gqa_and_untied_head_params_flops_and_fit():
    h, f, v, t = CFG.h, CFG.ffn_width, CFG.v, 2
    sch = MEG[t]
    base = memory(sch, CFG)
    layer = lambda cfg: (memory(sch, cfg.replace(N=2)).params  # noqa: E731
                         - memory(sch, cfg.replace(N=1)).params)
    sw = CFG.replace(mlp="swiglu", ffn=8 / 3)
    fw = sw.ffn_width
    # SwiGLU: three [h, f h] matrices and the gate and up biases (split over t), per layer
    assert layer(sw) == pytest.approx((4 * h * h + 3 * h * fw) / t * 2 + (3 * h + 2 * fw)
                                      / t * 2 + 6 * h * 2)
    gqa = CFG.replace(kv_heads=2)
    kvw = 2 * h // CFG.n                                     # two key/value heads
    assert gqa.qkv_width == h + 2 * kvw
    assert layer(gqa) == pytest.approx(((h * (h + 2 * kvw) + h * h + 2 * h * f)
                                        + (h + 2 * kvw + f)) / t * 2 + 6 * h * 2)
    assert layer(gqa) < layer(CFG)
    # the QKV GEMM narrows
    assert layer_ops(sch, gqa)["forward"][0] == ("gemm", CFG.b * CFG.s, h, (h + 2 * kvw) / t
                                                 if (h + 2 * kvw) % t else (h + 2 * kvw) // t,
                                                 1)
    # model flops: 2 b s h^2 (1 + r + k f) per layer forward
    B = 8
    for cfg, r, k, ff in ((CFG, 3, 2, 4), (sw, 3, 3, sw.ffn), (gqa, 1 + 2 * 2 / 8, 2, 4)):
        want = 3.0 * (cfg.N * (2 * B * cfg.s * h * h * (1 + r + k * ff)
                               + 4 * B * cfg.s ** 2 * h) + 2 * B * cfg.s * h * v)
        assert model_flops(cfg, B) == pytest.approx(want, rel=1e-12)
    # kv heads by p
    assert "key/value heads = 2 is smaller than p = 4 (one per rank)" in misfit(MEG[4], gqa)
    assert misfit(MEG[2], gqa) is None
    # an untied head: v h / t more parameters on the last stage; no embedding all-reduce
    un = CFG.replace(tied=False)
    assert memory(sch, un).embedding - base.embedding == v * h / t * 2
    kw = dict(machine=GPU, t=t, pp=2, microbatches=2, global_batch=8)
    tied_r = price_composition(CFG, "megatron", **kw)
    un_r = price_composition(un, "megatron", **kw)
    assert tied_r["traffic"]["embedding"] > 0 and un_r["traffic"]["embedding"] == 0
    last = lambda r: next(s for s in r["stages"] if s["stage"] == 1)["params"]  # noqa
    first = lambda r: next(s for s in r["stages"] if s["stage"] == 0)["params"]  # noqa
    assert last(un_r) == last(tied_r)          # its own head in place of the wte copy
    assert first(un_r) == first(tied_r)
    one = price_composition(un, "megatron", machine=GPU, t=t, global_batch=8)
    assert one["params_per_device"] == pytest.approx(
        price_composition(CFG, "megatron", machine=GPU, t=t, global_batch=8)[
            "params_per_device"] + v * h / t)
    # from_model carries the block
    model = spec.Model.parse("h=256,heads=8,layers=2,seq=64,vocab=512,ffn=8/3,mlp=swiglu,"
                             "kv_heads=2,tied=false")
    cfg = TransformerConfig.from_model(model, 4, dtype="bfloat16")
    assert (cfg.mlp, cfg.kv_heads, cfg.tied, cfg.ffn_width) == ("swiglu", 2, False, 683)


# -- predict and plan ---------------------------------------------------------------------------
def test_predict_prices_every_technique_and_prints_them(tmp_path):
    from summasim.costmodel.tools import predict

    every = spec.Training(schedule="interleaved", chunks=2, stages=(1,) * 4,
                          recompute="selective", attention="flash", sequence_parallel=True,
                          dtype="bfloat16")
    assert set(every.techniques()) <= predict.PREDICT_TECHNIQUES
    assert spec.unsupported(every, predict.PREDICT_TECHNIQUES, "x") == ""
    path = tmp_path / "p.json"
    argv = ["--model", "h=256,heads=8,layers=8,seq=64,vocab=512", "--batch", "16",
            "--mesh", "dp=2,pp=2,tp=megatron:2", "--microbatches", "4", "--machine",
            "dgx-a100", "--schedule", "interleaved:2", "--recompute", "selective",
            "--sequence-parallel", "--dtype", "float16", "--json", str(path)]
    out = io.StringIO()
    doc = predict.run(predict.build_parser().parse_args(argv), out=out)
    text = out.getvalue()
    assert "training:  ZeRO 0, interleaved:2, recompute selective, attention plain, " \
           "sequence parallel, mixed precision float16" in text
    assert "loss scale dynamic" in text and "gradients reduced in float32" in text
    saved = json.loads(path.read_text())
    assert saved["training"]["schedule"] == "interleaved" and saved["training"]["chunks"] == 2
    assert saved["composition"]["recompute"] == "selective"
    assert saved["composition"]["sequence_parallel"] is True
    assert saved["composition"]["state_bytes"]["total"] == 18
    want = price_composition(
        TransformerConfig(b=16, s=64, h=256, n=8, N=8, v=512, dtype="float16",
                          recompute="selective", sequence_parallel=True),
        "megatron", t=2, dp=2, pp=2, microbatches=4, machine=GPU, schedule="interleaved",
        chunks=2, loss_scale="dynamic", state_bytes=StateBytes.for_training("float16"))
    assert doc["step_seconds"] == want["step_seconds"]


def test_plan_searches_the_techniques_and_prints_them(tmp_path):
    from summasim.costmodel.tools import plan_cli

    argv = ["--model", "h=256,heads=8,layers=8,seq=64,vocab=512", "--batch", "16",
            "--devices", "8", "--machine", "dgx-a100", "--mem-gib", "1000", "--zero", "0"]
    js = tmp_path / "plan.json"
    out = io.StringIO()
    assert plan_cli.run(plan_cli.build_parser().parse_args(argv + ["--json", str(js)]),
                        out=out) == 0
    rows = json.loads(js.read_text())["ranked"]
    assert {r["recompute"] for r in rows} == {"none", "selective", "full"}
    assert {r["sequence_parallel"] for r in rows} == {False, True}
    assert {r["chunks"] for r in rows} == {1, 2, 4}
    assert {r["attention"] for r in rows} == {"plain"}        # flash only when asked
    assert not [r for r in rows if r["sequence_parallel"] and r["t"] == 1]
    assert {r["scheme"] for r in rows} == {"megatron", "optimus", "summa25", "3d"}
    assert not [r for r in rows if r["sequence_parallel"] and r["scheme"] != "megatron"]
    assert all(r["chunks"] == 1 or (r["pp"] >= 2 and r["microbatches"] % r["pp"] == 0
                                    and 8 % (r["pp"] * r["chunks"]) == 0) for r in rows)
    text = out.getvalue()
    assert "recomp" in text and "schedule" in text and "interleaved:" in text
    assert "searched: recompute none/selective/full, sequence parallelism off/on" in text
    flash = io.StringIO()
    assert plan_cli.run(plan_cli.build_parser().parse_args(
        argv + ["--attention", "flash", "--json", str(js), "--force"]), out=flash) == 0
    rows = json.loads(js.read_text())["ranked"]
    assert {r["attention"] for r in rows} == {"flash"}
    assert {r["recompute"] for r in rows} == {"none", "full"}   # selective: nothing to drop


@pytest.mark.parametrize("extra,needle", [
    (["--chunks", "1,2,3,4,5"], "argument --chunks: at most 4 values"),
    (["--chunks", "32"], "each at most 16"),
    (["--recompute", "full", "--checkpoint", "on"], "argument --checkpoint"),
    (["--recompute", "some"], "argument --recompute"),
    (["--grad-reduce", "bfloat16", "--dtype", "float32"], "argument --grad-reduce"),
    (["--loss-scale", "static:0"], "argument --loss-scale"),
    (["--schedule", "gpipe", "--chunks", "2"], "argument --chunks"),
])
def test_plan_refuses_bad_technique_arguments(extra, needle, capsys):
    from summasim.costmodel.tools import plan_cli

    argv = ["--model", "tiny", "--devices", "4", "--machine", "dgx-a100", *extra]
    try:
        rc = plan_cli.main(argv)
    except SystemExit as exc:                 # argparse's own: one line, status 2
        rc = exc.code
    assert rc == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and needle in err[0], err


def test_options_training_feeds_the_cost_model():
    """The flags options.add_training declares build the workload the cost model prices."""
    import argparse

    ap = argparse.ArgumentParser()
    options.add_training(ap)
    tr = options.training(ap.parse_args(["--recompute", "selective", "--attention", "flash",
                                         "--sequence-parallel"]), dtype="bfloat16")
    cfg = TransformerConfig.from_model(spec.Model.parse("tiny"), 8, dtype=tr.dtype,
                                       recompute=tr.recompute, attention=tr.attention,
                                       sequence_parallel=tr.sequence_parallel)
    assert (cfg.recompute, cfg.attention, cfg.sequence_parallel) == ("selective", "flash",
                                                                     True)


def test_explore_takes_the_techniques_that_apply():
    from summasim.costmodel.tools import explore_cli

    out = io.StringIO()
    base = ["--machine", "local-2core-mpich", "--model", "tiny", "--batch", "8", "--p", "4",
            "--no-iso", "--matmul-n", "64", "--mem-budget", "0", "--dtype", "float64"]
    argv = base + ["--recompute", "selective", "--attention", "flash", "--sequence-parallel"]
    tables = explore_cli.run(explore_cli.build_parser().parse_args(argv), out=out)
    text = out.getvalue()
    assert "recompute selective, attention flash, sequence parallel" in text
    assert {r["scheme"] for r in tables["strong"]} == {"megatron"}
    assert "optimus at p = 4 (sequence parallelism is Megatron's (1D) only" in text
    with pytest.raises(Exception, match="contradicts"):
        explore_cli.run(explore_cli.build_parser().parse_args(
            base + ["--no-checkpoint", "--recompute", "full"]), out=io.StringIO())
