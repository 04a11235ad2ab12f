"""Roofline pricing of memory-bound work and the step breakdown
(summasim.costmodel.compute.roofline, schemes.step_breakdown / step_cost)."""

from __future__ import annotations

import pytest

from summasim.costmodel.compute.roofline import (ADAM_BYTES, Device, gemm_roofline,
                                                 kernels_seconds, layer_kernels, model_kernels)
from summasim.costmodel.machine import Machine, load_preset
from summasim.costmodel.workload.footprint import memory
from summasim.costmodel.workload.layer import scheme_cost
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
from summasim.costmodel.workload.step import step_breakdown, step_cost

CFG = TransformerConfig(b=8, s=1024, h=2048, n=16, N=4, v=32000, dtype="bfloat16",
                        checkpoint=False)


def _dev(bw=1e12, flops=1e13, launch=5e-6):
    return Device("test", memory_bandwidth=bw, vector_flops={"float32": flops},
                  launch_seconds=launch)


def test_kernel_time_is_the_roofline_plus_a_launch():
    d = _dev()
    assert d.kernel_time(1e6, 1e9) == pytest.approx(1e9 / 1e12 + 5e-6)     # memory-bound
    assert d.kernel_time(1e12, 1e3) == pytest.approx(1e12 / 1e13 + 5e-6)   # compute-bound
    assert d.flops_rate("bfloat16") == 1e13                                # falls back to fp32


def test_layer_kernels_split_as_the_scheme_does():
    it, b, s, h, n = 2, CFG.b, CFG.s, CFG.h, CFG.n
    meg = {k.name: k for k in layer_kernels(Scheme.make("megatron", p=4), CFG)["forward"]}
    opt = {k.name: k for k in layer_kernels(Scheme.make("optimus", q=2), CFG)["forward"]}
    # softmax reads and writes the b n s^2 / p scores once
    assert meg["softmax"].nbytes == pytest.approx(2 * b * n * s * s / 4 * it)
    assert opt["softmax"].nbytes == meg["softmax"].nbytes
    # Megatron runs LayerNorm on the whole b s h on every rank; Optimus on its block
    assert meg["ln1"].nbytes == pytest.approx(2 * b * s * h * it)
    assert opt["ln1"].nbytes == pytest.approx(2 * b * s * h / 4 * it)
    assert meg["fc1_bias_gelu"].nbytes == pytest.approx(2 * b * s * 4 * h / 4 * it)


def test_dropout_and_checkpointing_add_kernels():
    sch = Scheme.make("megatron", p=2)
    base = layer_kernels(sch, CFG)
    drop = layer_kernels(sch, CFG.replace(dropout=0.1))
    assert any(k.name == "attn_dropout" for k in drop["forward"])
    assert not any(k.name == "attn_dropout" for k in base["forward"])
    ck = layer_kernels(sch, CFG.replace(checkpoint=True))
    assert len(ck["backward"]) == len(base["backward"]) + len(base["forward"])


def test_adam_moves_28_bytes_per_parameter_plus_the_low_precision_copy():
    sch = Scheme.make("megatron", p=1)
    opt = model_kernels(sch, CFG, local_params=1e6, param_tensors=10)["optimizer"]
    assert len(opt) == 10
    assert sum(k.nbytes for k in opt) == pytest.approx((ADAM_BYTES + 2 * 2) * 1e6)
    fp32 = model_kernels(sch, CFG.replace(dtype="float32"), 1e6, 10)["optimizer"]
    assert sum(k.nbytes for k in fp32) == pytest.approx(ADAM_BYTES * 1e6)


def test_gemm_roofline_takes_the_max_of_compute_and_operand_traffic():
    m = load_preset("dgx-a100")
    dev = m.device
    big = gemm_roofline(m, dev, 8192, 8192, 8192, "bfloat16", 2)
    # 32 x 64 tiles of 256 x 128 fill 2048 of the 19 x 108 slots of 19 waves
    assert big == pytest.approx(m.gemm_time(8192, 8192, 8192, "bfloat16") * 19 * 108 / 2048
                                + dev.launch_seconds)
    thin = gemm_roofline(m, dev, 1 << 20, 8, 8, "bfloat16", 2)          # a skinny GEMM
    assert thin == pytest.approx((2 * 8 * (1 << 20) + 64) * 2 / dev.memory_bandwidth
                                 + dev.launch_seconds)
    # tensor cores: bf16 GEMMs run 16x faster than fp32 at the same size on an A100
    assert m.gemm_time(4096, 4096, 4096, "float32") == pytest.approx(
        16 * m.gemm_time(4096, 4096, 4096, "bfloat16"))


@pytest.mark.parametrize("name,grid", [("megatron", dict(p=8)), ("optimus", dict(q=4)),
                                       ("summa25", dict(q=2, d=2))])
def test_step_breakdown_parts_add_up(name, grid):
    m = load_preset("dgx-a100")
    sch = Scheme.make(name, **grid)
    sb = step_breakdown(sch, CFG, m)
    assert sb.seconds == pytest.approx(sb.gemm_seconds + sb.memory_bound_seconds
                                       + sb.comm_exposed_seconds)
    assert sb.gemm_seconds > 0 and sb.memory_bound_seconds > sb.optimizer_seconds > 0
    assert sb.comm_seconds > 0 and sb.launch_seconds > 0
    pred = step_cost(sch, CFG, m)
    assert pred.seconds == pytest.approx(sb.seconds)
    assert pred.breakdown["gemm_seconds"] == pytest.approx(sb.gemm_seconds)
    # checkpointing recomputes the forward: more GEMM and kernel time, same model flops
    ck = step_breakdown(sch, CFG.replace(checkpoint=True), m)
    assert ck.gemm_seconds > sb.gemm_seconds and ck.comm_seconds > sb.comm_seconds
    assert ck.model_flops == pytest.approx(sb.model_flops)


def test_memory_bound_time_follows_the_memory_bandwidth():
    m = load_preset("dgx-a100")
    sch = Scheme.make("megatron", p=8)
    slow = m.replace(device=Device(**{**m.device.to_dict(), "launch_seconds": 0.0}))
    fast = m.replace(device=Device(**{**slow.device.to_dict(),
                                      "memory_bandwidth": 2 * m.device.memory_bandwidth}))
    a, b = step_breakdown(sch, CFG, slow), step_breakdown(sch, CFG, fast)
    assert b.memory_bound_seconds == pytest.approx(a.memory_bound_seconds / 2, rel=0.02)


def test_model_flops_match_the_closed_form():
    """6 x forward GEMM flops: 3 (N (24 b s h^2 + 4 b s^2 h) + 2 b s h v)."""
    m = load_preset("dgx-a100")
    b, s, h, N, v = CFG.b, CFG.s, CFG.h, CFG.N, CFG.v
    want = 3 * (N * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v)
    for sch in (Scheme.make("megatron", p=1), Scheme.make("megatron", p=4),
                Scheme.make("optimus", q=2)):
        assert step_breakdown(sch, CFG, m).model_flops == pytest.approx(want)
    # grids that cut the heads and the MLP unevenly (t = 6, 3 x 3) pad the busiest rank's
    # blocks, not the model's work
    for sch in (Scheme.make("megatron", p=6), Scheme.make("optimus", q=3)):
        assert step_breakdown(sch, CFG, m).model_flops == pytest.approx(want)


def test_scheme_cost_adds_the_layers_kernels_on_gpu_machines_only():
    gpu = load_preset("dgx-a100")
    sch = Scheme.make("megatron", p=8)
    c = scheme_cost(sch, CFG, gpu)
    kern = layer_kernels(sch, CFG)
    assert c.forward.memory_seconds == pytest.approx(
        kernels_seconds(kern["forward"], gpu.device, "bfloat16"))
    assert c.forward.compute_seconds > c.forward.memory_seconds > 0
    cpu = Machine.simple(alpha=1e-6, beta=1e-9, gamma=1e-11)
    assert scheme_cost(sch, CFG, cpu).forward.memory_seconds == 0.0


def test_step_cost_breakdown_on_the_local_machine_adds_up():
    local = load_preset("local-2core-mpich")
    cfg = TransformerConfig(b=8, s=64, h=96, n=4, N=2, v=128, dtype="float64")
    for sch in (Scheme.make("megatron", p=4), Scheme.make("optimus", q=2)):
        pred = step_cost(sch, cfg, local)
        bd = pred.breakdown
        assert bd["gemm_seconds"] > 0 and bd["memory_bound_seconds"] > 0
        assert bd["gemm_seconds"] + bd["memory_bound_seconds"] + bd["comm_exposed_seconds"] \
            == pytest.approx(pred.seconds)


def test_mixed_precision_memory_counts_float32_master_weights():
    sch = Scheme.make("megatron", p=8)
    m16 = memory(sch, CFG)
    params = m16.params + m16.embedding
    assert m16.optimizer == pytest.approx((2 * 4 + 4) * params / 2)   # 12 bytes per parameter
    m32 = memory(sch, CFG.replace(dtype="float32"))
    assert m32.optimizer == pytest.approx(2 * (m32.params + m32.embedding))
