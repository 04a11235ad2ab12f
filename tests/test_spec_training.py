"""The vocabulary of issue 30: model variants and the training techniques (pure)."""

import argparse

import pytest

from summasim import options, spec
from summasim.spec import Model, Training, parse_schedule, parse_stages, stage_layers

BASE = "h=64,heads=16,layers=2,seq=16,vocab=64"


@pytest.mark.parametrize("text", [
    BASE, BASE + ",ffn=3.25", BASE + ",ffn=8/3,mlp=swiglu", BASE + ",kv_heads=4",
    BASE + ",tied=false", BASE + ",mlp=swiglu,ffn=3.25,kv_heads=8,tied=false",
    "gpt3-175b", "gpt3-175b,kv_heads=8,mlp=swiglu,ffn=3.25"])
def test_model_variants_round_trip(text):
    m = Model.parse(text)
    assert Model.parse(str(m)) == m


def test_model_variant_sizes():
    m = Model.parse(BASE + ",ffn=3.25,mlp=swiglu,kv_heads=4,tied=false")
    assert (m.ffn_width, m.kv_width, m.qkv_width, m.mlp_matrices, m.tied) == \
        (208, 16, 64 + 32, 3, False)
    assert Model.parse(BASE + ",ffn=8/3").ffn_width == 171          # round(170.67)
    plain = Model.parse(BASE)
    assert (plain.kv_heads, plain.qkv_width, plain.mlp, plain.tied) == (16, 192, "gelu", True)
    assert str(plain) == BASE + ",ffn=4"                            # defaults stay silent
    # a preset with more heads keeps plain attention; GQA stays GQA
    assert MODELS_175B().replace(heads=48).kv_heads == 48
    assert Model.parse("gpt3-175b,kv_heads=8").replace(layers=4).kv_heads == 8


def MODELS_175B():
    return spec.MODELS["gpt3-175b"]


@pytest.mark.parametrize("text, words", [
    (BASE + ",kv_heads=3", "does not divide"), (BASE + ",mlp=relu", "mlp"),
    (BASE + ",tied=maybe", "tied"), (BASE + ",ffn=0", "ffn"), (BASE + ",ffn=1/0", "ffn"),
    (BASE + ",ffn=-2", "ffn"), (BASE + ",ffn=1e400", "ffn")])
def test_model_variant_errors(text, words):
    with pytest.raises(ValueError, match=words):
        Model.parse(text)


def test_grids_need_whole_kv_heads_per_rank():
    m = Model.parse("h=64,heads=16,layers=2,seq=16,vocab=64,kv_heads=2")
    assert spec.TensorGrid.parse("megatron:4").misfit(m) == ("kv heads = 2 is smaller than 4 "
                                                             "(one per rank)")
    assert spec.TensorGrid.parse("megatron:2").misfit(m) == ""
    assert "kv heads" in spec.TensorGrid.parse("optimus:4x4").misfit(m, 16)
    assert [str(g) for g in spec.grids(4, "megatron", m)] == []


def test_schedule_stages_and_loss_scale():
    assert parse_schedule("1f1b") == ("1f1b", 1)
    assert parse_schedule("Interleaved:3") == ("interleaved", 3)
    for bad in ("interleaved", "interleaved:1", "1f1b:2", "zigzag"):
        with pytest.raises(ValueError):
            parse_schedule(bad)
    assert parse_stages("6,6,0") == (6, 6, 0)
    for bad in ("6,,5", "6,-1", "a"):
        with pytest.raises(ValueError):
            parse_stages(bad)
    assert spec.parse_loss_scale("static:1024") == "static:1024"
    for bad in ("static:0", "static:x", "auto"):
        with pytest.raises(ValueError):
            spec.parse_loss_scale(bad)


def test_stage_layers_is_the_one_split():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(8, 2, chunks=2) == [range(0, 2), range(2, 4), range(4, 6),
                                            range(6, 8)]
    assert stage_layers(70, 12, (0,) + (7,) * 10 + (0,)) == \
        [range(0, 0)] + [range(7 * i, 7 * i + 7) for i in range(10)] + [range(70, 70)]
    with pytest.raises(ValueError, match="at least 4 layers"):
        stage_layers(3, 2, chunks=2)
    with pytest.raises(ValueError, match="summing"):
        stage_layers(8, 2, (4, 3))
    with pytest.raises(ValueError, match="4 non-negative"):
        stage_layers(8, 2, (4, 4), chunks=2)


def test_training_defaults_and_contradictions():
    t = Training()
    assert t.techniques() == {} and not t.mixed and t.schedule_label == "1f1b"
    assert Training(dtype="float16").loss_scale == "dynamic"
    assert Training(dtype="bfloat16").loss_scale == "none"
    assert Training(dtype="bfloat16").grad_reduce == "float32"
    with pytest.raises(ValueError, match="needs mixed precision"):
        Training(dtype="float32", loss_scale="dynamic")
    with pytest.raises(ValueError, match="needs mixed precision"):
        Training(dtype="float64", grad_reduce="bfloat16")
    with pytest.raises(ValueError, match="interleaved"):
        Training(schedule="interleaved")
    t = Training(schedule="interleaved", chunks=2, recompute="selective", attention="flash",
                 sequence_parallel=True, dtype="bfloat16", stages=(1, 1, 1, 1))
    assert set(t.techniques()) == {"--schedule", "--stages", "--recompute", "--attention",
                                   "--sequence-parallel", "--dtype"}
    why = spec.unsupported(t, {"--schedule", "--stages", "--dtype"}, "X")
    assert why == "X does not support --recompute selective, --attention flash, " \
                  "--sequence-parallel yet"


def _args(*argv, dtype=True):
    ap = argparse.ArgumentParser()
    options.add_training(ap)
    if dtype:
        options.add_dtype(ap, choices=spec.DTYPES)
    return ap.parse_args(list(argv))


def test_the_flags_build_one_training():
    t = options.training(_args("--schedule", "interleaved:2", "--stages", "1,1,1,1",
                               "--recompute", "selective", "--attention", "flash",
                               "--sequence-parallel", "--dtype", "float16",
                               "--loss-scale", "static:128", "--grad-reduce", "bfloat16"))
    assert (t.schedule, t.chunks, t.stages, t.recompute, t.attention, t.sequence_parallel,
            t.dtype, t.loss_scale, t.grad_reduce) == \
        ("interleaved", 2, (1, 1, 1, 1), "selective", "flash", True, "float16",
         "static:128", "bfloat16")
    assert options.training(_args("--checkpoint")).recompute == "full"
    with pytest.raises(ValueError, match="contradicts"):
        options.training(_args("--checkpoint", "--recompute", "selective"))
    with pytest.raises(SystemExit):
        _args("--schedule", "interleaved:1")


def test_sequence_parallelism_needs_whole_sequence_slices():
    m = Model.parse("h=64,heads=16,layers=2,seq=18,vocab=64")
    g = spec.TensorGrid.parse("megatron:4")
    assert g.misfit(m) == ""
    assert g.misfit(m, seq=m.seq) == "sequence = 18 is not divisible by 4"
    assert spec.TensorGrid.parse("megatron:2").misfit(m, seq=m.seq) == ""
