"""The MLP multiplier f (``TransformerConfig.ffn``, the model's ``Config.ffn_mult``) in
every formula of the cost model: parameters, memory, flops, traffic, Table 1, step work.

With f = 4 (the default) nothing changes; with other f the counts follow the
model's own parameter shapes and the generalized closed forms.
"""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from summasim.costmodel import Machine, Scheme, TransformerConfig, memory
from summasim.costmodel.workload.layer import layer_ops, scheme_cost
from summasim.costmodel.workload.scheme import grid_shapes, misfit
from summasim.costmodel.workload.step import elementwise_items, model_messages, step_work
from summasim.costmodel.workload.table1 import table1, table1_paper
from summasim.transformer import model


def _serial_counts(config):
    """Items per layer and outside the layers, from the model's real parameters."""
    params = model.init_params(config, 0)
    layer = sum(a.size for k, a in params.items() if k.startswith("h0."))
    rest = sum(a.size for k, a in params.items() if not k.startswith("h"))
    return layer, rest


@pytest.mark.parametrize("f", [2, 3, 4])
def test_parameter_count_matches_the_model(f):
    """(4 + 2f) h^2 weights + (9 + f) h vectors per layer, as ``init_params`` makes them."""
    h = 16
    config = model.Config(vocab=24, seq=8, hidden=h, heads=2, layers=3, ffn_mult=f,
                          dtype=np.float32)
    layer, rest = _serial_counts(config)
    assert layer == (4 + 2 * f) * h * h + (9 + f) * h
    cfg = TransformerConfig.from_model(config, batch=4)
    for sch in (Scheme.make("megatron", p=1), Scheme.make("optimus", q=1),
                Scheme.make("summa25", q=1, d=1)):
        mem = memory(sch, cfg)
        assert mem.params == config.layers * layer * 4          # float32 bytes
        assert mem.embedding == rest * 4                        # wte, wpe, lnf
        assert mem.grads == mem.params + mem.embedding
        assert mem.optimizer == 2 * mem.grads


@pytest.mark.parametrize("f", [2, 3])
def test_parameters_per_rank(f):
    """Megatron splits the weights and the QKV / fc1 biases over p and keeps 6h whole;
    Optimus keeps the (9 + f) h vectors on row 0 split over q."""
    h, N, p, q = 32, 2, 4, 2
    cfg = TransformerConfig(b=4, s=8, h=h, n=4, N=N, ffn=f, dtype="float64")
    meg = memory(Scheme.make("megatron", p=p), cfg).params / 8 / N
    assert meg == ((4 + 2 * f) * h * h + (3 + f) * h) / p + 6 * h
    opt = memory(Scheme.make("optimus", q=q), cfg).params / 8 / N
    assert opt == (4 + 2 * f) * h * h / (q * q) + (9 + f) * h / q
    s25 = memory(Scheme.make("summa25", q=q, d=2), cfg).params / 8 / N
    assert s25 == opt                                  # weights replicated over depth


def test_ffn4_is_the_default_and_the_old_numbers():
    """f = 4 reproduces the papers' constants exactly (12h^2 + 13h, 16bsh, Table 1)."""
    assert TransformerConfig().ffn == 4
    b, s, h, n, N = 8, 16, 32, 4, 2
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=N, dtype="float32", checkpoint=False)
    assert cfg == cfg.replace(ffn=4)
    for sch in (Scheme.make("megatron", p=4), Scheme.make("optimus", q=2),
                Scheme.make("summa25", q=2, d=2)):
        assert memory(sch, cfg) == memory(sch, cfg.replace(ffn=4.0))
    opt = memory(Scheme.make("optimus", q=2), cfg)
    bsh = b * s * h
    assert opt.params == N * (12 * h * h / 4 + 13 * h / 2) * 4
    assert opt.workspace == (16 * bsh / 4 + 8 * h * h / 4) * 4
    assert opt.activations == (N * ((16 * bsh + b * n * s * s) / 4 + 4 * b * s / 2)
                               + 2 * bsh / 4) * 4
    for name, p in (("megatron", 16), ("optimus", 16)):
        assert table1(name, 8, 128, 256, p) == table1_paper(name, 8, 128, 256, p)
    paper = table1_paper("optimus", 8, 128, 256, 16)
    assert paper["forward communication"] == Fraction(4, 8) * (7 * 8 * 128 * 256 + 12 * 256 ** 2)


@pytest.mark.parametrize("f", [1, 2, 3, 8])
@pytest.mark.parametrize("scheme,p", [("megatron", 4), ("megatron", 16), ("optimus", 16),
                                      ("optimus", 64)])
def test_table1_for_any_ffn(scheme, p, f):
    """The model's ops give the generalized Table 1 exactly: (4 + 2f) b s h^2 flops and
    log(p)/(2 sqrt p) ((3 + f) b s h + (4 + 2f) h^2) items forward, 3x backward."""
    b, s, h = 8, 128, 256
    ours, paper = table1(scheme, b, s, h, p, ffn=f), table1_paper(scheme, b, s, h, p, ffn=f)
    assert ours == paper
    assert paper["forward computation"] == Fraction((4 + 2 * f) * b * s * h * h
                                                    + 2 * b * s * s * h, p)
    assert paper["backward computation"] == 3 * paper["forward computation"]
    if scheme == "optimus":
        q = math.isqrt(p)
        fwd = Fraction(int(math.log2(q)), q) * ((3 + f) * b * s * h + (4 + 2 * f) * h * h)
        assert paper["forward communication"] == fwd
        assert paper["backward communication"] == 3 * fwd


def test_optimus_payload_per_rank_with_ffn():
    """SUMMA payload per rank and pass: ((3 + f) b s h + (4 + 2f) h^2) / q forward."""
    b, s, h, q = 8, 16, 64, 4
    for f in (2, 3, 4):
        cfg = TransformerConfig(b=b, s=s, h=h, n=4, N=1, ffn=f, dtype="float64",
                                checkpoint=False)
        cost = scheme_cost(Scheme.make("optimus", q=q), cfg, Machine.simple(), compute=False)
        assert cost.forward.payload == ((3 + f) * b * s * h + (4 + 2 * f) * h * h) / q
        assert cost.backward.payload == 2 * cost.forward.payload


def test_minor_traffic_and_gemms_carry_ffn():
    b, s, h, q, f = 4, 8, 32, 2, 2
    cfg = TransformerConfig(b=b, s=s, h=h, n=4, N=1, ffn=f, dtype="float64")
    ops = layer_ops(Scheme.make("optimus", q=q), cfg, include_minor=True)
    bcast = [op for op in ops["forward"] if op[:3] == ("coll", "bcast", "col")]
    assert bcast == [("coll", "bcast", "col", q, (9 * h + f * h) // q, 1)]
    mms = [op[2:] for op in ops["forward"] if op[0] == "mm"]
    assert mms == [(b * s, h, 3 * h), (b * s, h, h), (b * s, h, f * h), (b * s, f * h, h)]
    meg = layer_ops(Scheme.make("megatron", p=4), cfg)["forward"]
    gemms = [op[1:4] for op in meg if op[0] == "gemm"][:4]
    assert gemms == [(b * s, h, 3 * h // 4), (b * s, h // 4, h), (b * s, h, f * h // 4),
                     (b * s, f * h // 4, h)]


def test_memory_and_elementwise_change_with_ffn():
    """Activations grow by 2 b s (f h) per layer (fc1 and GELU outputs); the SUMMA
    workspace follows the widest linear, max(3h, f h)."""
    b, s, h, n, N, v = 4, 16, 32, 4, 3, 64
    base = TransformerConfig(b=b, s=s, h=h, n=n, N=N, v=v, dtype="float64", checkpoint=False)
    for sch in (Scheme.make("megatron", p=4), Scheme.make("optimus", q=2),
                Scheme.make("summa25", q=2, d=2)):
        p = sch.p
        m2, m4 = memory(sch, base.replace(ffn=2)), memory(sch, base)
        assert m4.activations - m2.activations == N * 2 * b * s * (2 * h) / p * 8
        e2, e4 = elementwise_items(sch, base.replace(ffn=2)), elementwise_items(sch, base)
        assert e4 - e2 == N * 2 * b * s * (2 * h) / p
    q, p = 2, 4
    for f, wide in ((2, 3 * h), (3, 3 * h), (6, 6 * h)):
        ws = memory(Scheme.make("optimus", q=q), base.replace(ffn=f)).workspace / 8
        assert ws == 2 * (b * s * wide / p + h * wide / (q * q)) + 2 * b * s * wide / p


def test_step_work_and_messages_carry_ffn():
    """A whole training step: the fc1/fc2 GEMMs are f h wide, and the messages change."""
    cfg = TransformerConfig(b=4, s=8, h=16, n=2, N=2, v=32, dtype="float64", checkpoint=False)
    for f in (2, 3):
        work = step_work(Scheme.make("megatron", p=1), cfg.replace(ffn=f))
        assert (4 * 8, 16, f * 16, 1) in work.gemms and (4 * 8, f * 16, 16, 1) in work.gemms
        assert (4 * 8, 16, 4 * 16, 1) not in work.gemms
    sch = Scheme.make("optimus", q=2)
    assert model_messages(sch, cfg.replace(ffn=2)) != model_messages(sch, cfg)


def test_from_model_carries_everything():
    config = model.Config(vocab=24, seq=8, hidden=16, heads=2, layers=3, ffn_mult=3,
                          dtype=np.float32)
    cfg = TransformerConfig.from_model(config, batch=6)
    assert (cfg.b, cfg.s, cfg.h, cfg.n, cfg.N, cfg.v, cfg.ffn) == (6, 8, 16, 2, 3, 24, 3)
    assert cfg.dtype == "float32" and cfg.checkpoint is False and cfg.itemsize == 4
    assert TransformerConfig.from_model(config, 6, checkpoint=True).checkpoint is True
    cfg64 = TransformerConfig.from_model(model.Config(8, 8, 16, 2, 1), batch=2)
    assert cfg64.dtype == "float64" and cfg64.ffn == 4
    with pytest.raises(ValueError, match="n_classes"):
        TransformerConfig.from_model(model.Config(8, 8, 16, 2, 1, n_classes=3), batch=2)


def test_megatron_needs_one_mlp_column_per_rank():
    """Megatron cuts the MLP columns by the balanced partition: f h = 12 runs on 8 ranks
    (the busiest with 2 columns), not on 16; the other grids must divide."""
    cfg = TransformerConfig(b=8, s=8, h=8, n=16, N=1, ffn=1.5)     # f h = 12
    assert "MLP width f h = 12 is smaller than p = 16 (one per rank)" in misfit(
        Scheme.make("megatron", p=16), cfg)
    assert misfit(Scheme.make("megatron", p=8), cfg) is None
    assert grid_shapes(16, "megatron", cfg) == [] and grid_shapes(8, "megatron", cfg)
    fc = layer_ops(Scheme.make("megatron", p=8), cfg)["forward"][2]      # fc1: 2 of 12
    assert fc == ("gemm", 64, 8, 2.0, 1)
    assert "batch b = 8 is not divisible by d q = 16" in misfit(
        Scheme.make("summa25", q=4, d=4), cfg.replace(h=16, n=16, ffn=4))


@pytest.mark.parametrize("field,value", [("b", 0), ("s", -1), ("h", float("nan")),
                                         ("n", float("inf")), ("N", 0), ("v", -8),
                                         ("ffn", 0), ("ffn", float("nan")),
                                         ("optimizer_states", -1), ("dtype", "float8")])
def test_config_rejects_impossible_sizes(field, value):
    with pytest.raises(ValueError, match=field if field != "dtype" else "float8"):
        TransformerConfig(**{field: value})


def test_explore_takes_ffn(tmp_path, capsys):
    from summasim.costmodel.__main__ import main

    args = ["explore", "--no-iso", "--p-max", "16", "--batch", "16", "--matmul-n", "1024",
            "--json", "--outdir", str(tmp_path), "--model"]
    model = "h=512,heads=8,layers=2,seq=128,vocab=512"
    assert main(args + [model + ",ffn=2"]) == 0
    two = json.loads((tmp_path / "explore.json").read_text())
    assert main(args + [model]) == 0
    four = json.loads((tmp_path / "explore.json").read_text())
    assert "ffn=2" in capsys.readouterr().out
    assert two["config"]["ffn"] == 2 and four["config"]["ffn"] == 4
    t2 = {(r["p"], r["scheme"]): r for r in two["tables"]["strong"]}
    t4 = {(r["p"], r["scheme"]): r for r in four["tables"]["strong"]}
    assert t2.keys() == t4.keys()
    assert all(t2[k]["step_s"] < t4[k]["step_s"] and t2[k]["mem_gib"] < t4[k]["mem_gib"]
               for k in t2)
