"""PyTorch eager against fused kernels in the roofline (``TransformerConfig.kernels``,
:mod:`summasim.costmodel.compute.roofline`): every eager operation of the reference
code (Hugging Face's Llama, minGPT, ``torch.nn.LayerNorm``) is its own kernel with the
bytes it reads and writes, and the fused table is what it was."""

from __future__ import annotations

import pytest

from summasim.costmodel.compute.roofline import (kernels_seconds, layer_kernels,
                                                 model_kernels)
from summasim.costmodel.machine import load_preset
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
from summasim.costmodel.workload.step import step_breakdown

GPT = TransformerConfig(b=4, s=512, h=1024, n=16, N=2, v=50000, dtype="float16",
                        dropout=0.1, checkpoint=False)
LLAMA = TransformerConfig(b=2, s=4096, h=4096, n=32, N=2, v=32000, dtype="bfloat16",
                          mlp="swiglu", ffn=11008 / 4096, attention="flash", norm="rmsnorm",
                          rope=True, kv_heads=8, checkpoint=False)
MEG = Scheme.make("megatron", p=1)


def _by_name(cfg, part):
    return {k.name: k for k in layer_kernels(MEG, cfg)[part]}


def _bytes(cfg, part, prefix=""):
    return sum(k.nbytes for k in layer_kernels(MEG, cfg)[part] if k.name.startswith(prefix))


def test_the_fused_table_is_unchanged_by_the_new_fields():
    """Defaults (LayerNorm, no RoPE, fused) price exactly the Megatron table: one norm
    kernel of 2 X it forward and 3 X it backward, the bias+dropout+residual kernels."""
    it, X = 2, GPT.b * GPT.s * GPT.h
    f = _by_name(GPT, "forward")
    assert f["ln1"].nbytes == 2 * X * it
    assert f["proj_bias_dropout_residual"].nbytes == 3 * X * it + X
    assert _by_name(GPT, "backward")["ln1_bwd"].nbytes == 3 * X * it
    assert not [k for k in f if k.startswith(("rope", "scores_"))]


def test_eager_rmsnorm_is_hugging_faces_chain():
    """LlamaRMSNorm: x.float() (it + 4), pow (8), mean (4), the rsqrt multiply (8), the
    cast back (4 + it), the weight (2 it): 28 + 4 it bytes an item forward; fused,
    2 it."""
    it, X = 2, LLAMA.b * LLAMA.s * LLAMA.h
    eager = LLAMA.replace(kernels="eager")
    f = [k for k in layer_kernels(MEG, eager)["forward"] if k.name.startswith("ln1")]
    assert len(f) == 6
    assert sum(k.nbytes for k in f) == pytest.approx((28 + 4 * it) * X)
    assert _bytes(LLAMA, "forward", "ln1") == pytest.approx(2 * X * it)
    # backward: ten kernels, more than twice the forward's bytes
    b = [k for k in layer_kernels(MEG, eager)["backward"] if k.name.startswith("ln1")]
    assert len(b) == 10 and sum(k.nbytes for k in b) > 2 * sum(k.nbytes for k in f)


def test_eager_layernorm_reduces_its_weight_gradients_in_a_second_kernel():
    it, X = 2, GPT.b * GPT.s * GPT.h
    eager = GPT.replace(kernels="eager")
    assert _bytes(eager, "forward", "ln1") == _bytes(GPT, "forward", "ln1") == 2 * X * it
    assert _bytes(eager, "backward", "ln1") == pytest.approx(5 * X * it)


def test_rope_on_q_and_k():
    """Fused: 2 it an item each way on q and on k (k has kv/n of q's items). Eager
    (q cos + rotate_half(q) sin): 10 it forward, 15 it backward."""
    it = 2
    q = LLAMA.b * LLAMA.s * LLAMA.h
    k = q * 8 / 32
    assert _bytes(LLAMA, "forward", "rope") == pytest.approx(2 * it * (q + k))
    assert _bytes(LLAMA, "backward", "rope") == pytest.approx(2 * it * (q + k))
    eager = LLAMA.replace(kernels="eager")
    assert _bytes(eager, "forward", "rope") == pytest.approx(10 * it * (q + k))
    assert _bytes(eager, "backward", "rope") == pytest.approx(15 * it * (q + k))
    assert _bytes(LLAMA.replace(rope=False), "forward", "rope") == 0


def test_eager_swiglu_writes_silu_before_the_multiply():
    it, F = 2, LLAMA.b * LLAMA.s * LLAMA.ffn * LLAMA.h
    eager = LLAMA.replace(kernels="eager")
    assert _bytes(eager, "forward", "fc1") == pytest.approx(5 * F * it)
    assert _bytes(LLAMA, "forward", "fc1") == pytest.approx(3 * F * it)
    assert _bytes(eager, "backward", "fc1") - _bytes(eager, "backward", "fc1_bias") == \
        pytest.approx(9 * F * it)


def test_eager_plain_attention_scales_and_masks_in_kernels_of_their_own():
    it, S = 2, GPT.b * GPT.n * GPT.s ** 2
    eager = GPT.replace(kernels="eager")
    assert _bytes(eager, "forward", "scores_") == pytest.approx(4 * S * it)
    assert _bytes(eager, "backward", "scores_") == pytest.approx(4 * S * it)
    # SDPA's flash kernel: nothing of the sort
    assert _bytes(eager.replace(attention="flash"), "forward", "scores_") == 0
    # selective recompute replays them with the softmax
    sel = eager.replace(recompute="selective")
    assert _bytes(sel, "backward", "scores_") == pytest.approx(8 * S * it)


def test_eager_dropout_and_residual_are_two_kernels_and_the_bias_is_in_the_gemm():
    it, X = 2, GPT.b * GPT.s * GPT.h
    eager = _by_name(GPT.replace(kernels="eager"), "forward")
    assert eager["proj_dropout"].nbytes == 2 * X * it + X
    assert eager["proj_residual_add"].nbytes == 3 * X * it
    assert "qkv_bias" not in eager and "proj_bias_dropout_residual" not in eager


def test_eager_loss_upcasts_the_logits():
    it, L = 2, LLAMA.b * LLAMA.s * LLAMA.v
    fused = model_kernels(MEG, LLAMA, 1e6, 10)
    eager = model_kernels(MEG, LLAMA.replace(kernels="eager"), 1e6, 10)

    def loss(kernels, names):
        return sum(k.nbytes for k in kernels if k.name in names)
    assert loss(fused["forward"], {"cross_entropy"}) == 3 * L * it
    assert loss(eager["forward"], {"logits_to_float32", "log_softmax"}) == (it + 4 + 8) * L
    assert loss(eager["backward"], {"nll_bwd", "log_softmax_bwd", "logits_to_float32_bwd"}) \
        == (4 + 12 + 4 + it) * L


def test_an_eager_step_costs_its_extra_kernels_and_no_more():
    """On an H100 the eager step's memory-bound time is the fused one's plus exactly the
    extra kernels' roofline time; its GEMMs are the same."""
    dev_machine = load_preset("h100-dgx-ndr")
    fused = step_breakdown(MEG, LLAMA, dev_machine)
    eager = step_breakdown(MEG, LLAMA.replace(kernels="eager"), dev_machine)
    assert eager.gemm_seconds == pytest.approx(fused.gemm_seconds)
    dev = dev_machine.device
    mk = {k: model_kernels(MEG, c, 0, 1) for k, c in
          (("f", LLAMA), ("e", LLAMA.replace(kernels="eager")))}
    secs = {k: kernels_seconds(v["forward"] + v["backward"], dev, "bfloat16")
            for k, v in mk.items()}
    assert eager.memory_bound_seconds - fused.memory_bound_seconds == pytest.approx(
        secs["e"] - secs["f"], rel=1e-6)
    assert secs["e"] > 2 * secs["f"]


@pytest.mark.parametrize("field,bad", [("kernels", "compiled"), ("norm", "batchnorm"),
                                       ("rope", "yes")])
def test_the_new_fields_are_checked(field, bad):
    with pytest.raises(ValueError, match=f"TransformerConfig.{field}"):
        TransformerConfig(**{field: bad})


def test_predict_and_plan_take_the_kernels_norm_and_rope(tmp_path, capsys):
    """``--kernels eager --norm rmsnorm --rope``: the same GEMMs, more memory-bound time,
    and the model line says what was priced; plan ranks with the same fields."""
    import json

    from summasim.costmodel.__main__ import main

    base = ["predict", "--machine", "h100-dgx-ndr", "--model",
            "vocab=32000,seq=4096,h=4096,heads=32,layers=4,mlp=swiglu", "--batch", "16",
            "--mesh", "dp=8,tp=megatron:1", "--zero", "3", "--attention", "flash",
            "--dtype", "bfloat16"]
    got = {}
    for extra in ([], ["--norm", "rmsnorm", "--rope"],
                  ["--norm", "rmsnorm", "--rope", "--kernels", "eager"]):
        path = tmp_path / f"p{len(got)}.json"
        assert main(base + extra + ["--json", str(path)]) == 0
        got[" ".join(extra)] = (json.loads(path.read_text()), capsys.readouterr().out)
    (plain, _), (rope, _), (eager, text) = got.values()
    assert "rmsnorm, rope, eager kernels" in text
    # the eager run's what-ifs include compiling it, priced as the fused run
    [fuse] = [w for w in eager["what_ifs"] if w["change"].startswith("fused kernels")]
    assert fuse["step_seconds"] == pytest.approx(rope["step_seconds"])
    assert not [w for w in rope["what_ifs"] if w["change"].startswith("fused kernels")]
    assert plain["breakdown"]["gemm"] == pytest.approx(eager["breakdown"]["gemm"])
    assert (plain["breakdown"]["memory_bound"] < rope["breakdown"]["memory_bound"]
            < eager["breakdown"]["memory_bound"])
    path = tmp_path / "plan.json"
    assert main(["plan", "--machine", "h100-dgx-ndr", "--model", "gpt3-2.7b", "--devices",
                 "8", "--kernels", "eager", "--json", str(path)]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["top"]
