"""Transformer schemes: Optimus Table 1 exactly, payloads, memory, largest batch."""

import math
from fractions import Fraction

import pytest

from summasim import spec
from summasim.costmodel import (Machine, Scheme, TransformerConfig, largest_batch, memory,
                                scheme_cost, table1, table1_paper)
from summasim.costmodel.workload.footprint import batch_step
from summasim.costmodel.workload.layer import best_grid, layer_ops
from summasim.costmodel.workload.scheme import grid_shapes

KEYS = ("forward communication", "backward communication", "forward computation",
        "backward computation")


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64, 1024])
@pytest.mark.parametrize("b,s,h", [(4, 8, 16), (8, 512, 1024), (3, 5, 7 * 64)])
def test_table1_megatron_exact(b, s, h, p):
    ours = table1("megatron", b, s, h, p, n=p)
    assert all(isinstance(ours[k], Fraction) for k in KEYS)
    paper = table1_paper("megatron", b, s, h, p)
    if 4 * h % p and 4 * h >= p:   # the MLP's f h columns p does not divide: the busiest
        # rank's ceil(f h / p) columns take longer than the paper's average; the same sends
        assert ours["forward computation"] > paper["forward computation"]
        assert ours["forward communication"] == paper["forward communication"]
        return
    assert ours == paper
    # the printed formulas, spelled out
    assert ours["forward communication"] == Fraction(4 * (p - 1), p) * b * s * h
    assert ours["backward communication"] == Fraction(8 * (p - 1), p) * b * s * h
    assert ours["forward computation"] == Fraction(12 * b * s * h * h + 2 * b * s * s * h, p)
    assert ours["backward computation"] == Fraction(36 * b * s * h * h + 6 * b * s * s * h, p)


@pytest.mark.parametrize("q", [2, 4, 8, 16])
@pytest.mark.parametrize("b,s,h", [(16, 8, 64), (32, 512, 1024)])
def test_table1_optimus_exact(b, s, h, q):
    p = q * q
    ours = table1("optimus", b, s, h, p, n=q)
    assert all(isinstance(ours[k], Fraction) for k in KEYS)
    assert ours == table1_paper("optimus", b, s, h, p)
    # log(p) / (2 sqrt p) with log = log2 and sqrt p = q
    log_p = p.bit_length() - 1
    assert ours["forward communication"] == Fraction(log_p, 2 * q) * (7 * b * s * h + 12 * h * h)
    assert ours["backward communication"] == Fraction(log_p, 2 * q) * (21 * b * s * h
                                                                       + 36 * h * h)


@pytest.mark.parametrize("name", ["summa25", "2.5d", "cannon", "nope"])
def test_table1_paper_has_two_columns_only(name):
    # the paper prints Megatron and Optimus; SUMMA2.5 depends on d, which it has no say on
    with pytest.raises(ValueError, match="Megatron and an Optimus column"):
        table1_paper(name, 8, 16, 64, 16)


@pytest.mark.parametrize("q", [3, 5, 6, 10])
@pytest.mark.parametrize("f", [4, 3.5])
def test_table1_optimus_when_log_p_is_irrational(q, f):
    # sqrt(p) not a power of two: floats, yet the model's sum equals the formula to the bit
    p, b, s, h = q * q, 2 * q, 12, 8 * q * q
    ours, paper = table1("optimus", b, s, h, p, n=q, ffn=f), table1_paper("optimus", b, s, h, p,
                                                                         ffn=f)
    assert ours == paper
    printed = math.log2(p) / (2 * math.sqrt(p)) * ((3 + f) * b * s * h + (4 + 2 * f) * h * h)
    assert float(paper["forward communication"]) == pytest.approx(printed, rel=1e-13)
    assert float(paper["backward communication"]) == pytest.approx(3 * printed, rel=1e-13)


def test_optimus_payload_per_rank():
    # per-rank SUMMA payload of one layer forward: (7 b s h + 12 h^2) / q items;
    # backward with checkpointing 3x that, without 2x
    b, s, h, n, q = 8, 16, 64, 8, 4
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=1, dtype="float64")
    m = Machine.simple()
    c = scheme_cost(Scheme.make("optimus", q=q), cfg, m, strict=True)
    fwd = Fraction(7 * b * s * h + 12 * h * h, q)
    assert c.forward.payload == fwd and c.backward.payload == 3 * fwd
    c2 = scheme_cost(Scheme.make("optimus", q=q), cfg, m, checkpoint=False, strict=True)
    assert c2.backward.payload == 2 * fwd
    # Megatron: 2 all-reduces of b s h each way (+ the recomputed forward)
    mc = scheme_cost(Scheme.make("megatron", p=4), cfg, m, strict=True)
    assert mc.forward.payload == 2 * b * s * h and mc.backward.payload == 4 * b * s * h
    # SUMMA2.5 on [q, q, d]: activations over d q rows, weights over q
    d = 2
    c25 = scheme_cost(Scheme.make("summa25", q=q, d=d), cfg, m, checkpoint=False, strict=True)
    assert c25.forward.payload == Fraction(7 * b * s * h, d * q) + Fraction(12 * h * h, q)
    ring = sum(2 * (d - 1) * (i * o * h * h // (q * q)) // d  # depth all-reduce of dW blocks
               for i, o in ((1, 3), (1, 1), (1, 4), (4, 1)))
    assert c25.backward.payload == 2 * c25.forward.payload + ring
    # d = 1 is Optimus
    c1 = scheme_cost(Scheme.make("summa25", q=q, d=1), cfg, m, strict=True)
    assert c1.forward.payload == c.forward.payload and c1.layer_seconds == c.layer_seconds


def test_paper_mode_times_equal_table1():
    b, s, h, p = 8, 64, 256, 16
    cfg = TransformerConfig(b=b, s=s, h=h, n=16, N=1, dtype="float64")
    # alpha = 0, beta = 1 s per scalar of 8 bytes, gamma = 0.5 s/flop -> 1 s per multiply
    m = Machine.simple(alpha=0.0, beta=1 / 8, gamma=0.5)
    for name in ("megatron", "optimus"):
        c = scheme_cost(Scheme.make(name, p=p), cfg, m, mode="paper")
        t = table1_paper(name, b, s, h, p)
        assert c.forward.comm_seconds == pytest.approx(float(t["forward communication"]))
        assert c.backward.comm_seconds == pytest.approx(float(t["backward communication"]))
        assert c.forward.compute_seconds == pytest.approx(float(t["forward computation"]))
        assert c.backward.compute_seconds == pytest.approx(float(t["backward computation"]))
        assert c.step_seconds == pytest.approx(c.layer_seconds)
        c24 = scheme_cost(Scheme.make(name, p=p), cfg.replace(N=24), m, mode="paper")
        assert c24.step_seconds == pytest.approx(24 * c.layer_seconds)
        assert c24.step_comm_seconds == pytest.approx(24 * float(
            t["forward communication"] + t["backward communication"]))
        assert c24.step_payload == pytest.approx(24 * (c.forward.payload + c.backward.payload))
        assert c24.to_dict()["step_compute_seconds"] == pytest.approx(c24.step_compute_seconds)


def test_memory_by_hand():
    cfg = TransformerConfig(b=8, s=16, h=32, n=4, N=2, dtype="float32", checkpoint=False)
    mem = memory(Scheme.make("optimus", q=2), cfg)
    # params: 12 h^2 / p + 13 h / q = 3072 + 208 = 3280 items per layer, 2 layers, 4 B
    assert mem.params == 2 * 3280 * 4 and mem.grads == mem.params
    assert mem.optimizer == 2 * mem.params
    # activations: (16 bsh + b n s^2) / p + 4 b s / q per layer, plus 2 bsh / p gradient buffers
    assert mem.activations == (2 * ((16 * 4096 + 8192) / 4 + 256) + 2 * 4096 / 4) * 4
    assert mem.workspace == (2 * (4096 + 1024) + 8192) * 4
    assert mem.total == 336384
    meg = memory(Scheme.make("megatron", p=4), cfg)
    assert meg.params == 2 * (3072 + 56 + 192) * 4
    # Megatron keeps 4 bsh + 4 bs whole on every rank
    assert meg.activations == (2 * (4 * 4096 + 512 + (12 * 4096 + 8192) / 4) + 2 * 4096) * 4
    # checkpointing keeps N layer inputs / p plus one layer
    ck = memory(Scheme.make("optimus", q=2), cfg.replace(checkpoint=True))
    assert ck.activations == (2 * 4096 / 4 + (16 * 4096 + 8192) / 4 + 256 + 2 * 4096 / 4) * 4
    assert ck.total < mem.total
    # SUMMA2.5 [2, 2, 2]: weights over q^2 (replicated over depth), LN statistics over d q
    m25 = memory(Scheme.make("summa25", q=2, d=2), cfg)
    assert m25.params == 2 * (12 * 1024 / 4 + 13 * 32 / 2) * 4
    assert m25.activations == (2 * ((16 * 4096 + 8192) / 8 + 4 * 128 / 4) + 2 * 4096 / 8) * 4
    # vocabulary adds the table and the logits with their gradient; wte in q x q blocks,
    # wpe [s, h/q] and lnf g, b hosted on row 0 (the ranks that hold them)
    v = memory(Scheme.make("optimus", q=2), cfg.replace(v=100))
    assert v.embedding == (100 * 32 / 4 + 16 * 32 / 2 + 2 * 32 / 2) * 4
    v25 = memory(Scheme.make("summa25", q=2, d=2), cfg.replace(v=100))
    assert v25.embedding == v.embedding


def test_largest_batch():
    cfg = TransformerConfig(b=1, s=128, h=256, n=8, N=4, dtype="float32")
    budget = 64 * 2 ** 20
    for sch in (Scheme.make("megatron", p=4), Scheme.make("optimus", q=4),
                Scheme.make("summa25", q=2, d=2)):
        b = largest_batch(sch, cfg, budget)
        step = batch_step(sch)
        assert b > 0 and b % step == 0
        assert memory(sch, cfg.replace(b=b)).total <= budget
        assert memory(sch, cfg.replace(b=b + step)).total > budget
    assert largest_batch(Scheme.make("megatron", p=4), cfg, 1000) == 0
    # Optimus distributes activations, Megatron replicates some: a larger batch fits
    big = cfg.replace(h=1024, s=1024, n=16)
    assert largest_batch(Scheme.make("optimus", q=8), big, 2 ** 30) > \
        largest_batch(Scheme.make("megatron", p=64), big, 2 ** 30)


def test_grids_and_best():
    # THE enumeration (summasim.spec.grids), q ascending: SUMMA2.5 runs on every [q, q, d]
    # with q, d >= 2, d > q included ([2,2,16]); d = 1 is Optimus, not SUMMA2.5 (until the
    # cost model was arranged by concept it kept d <= q and d = 1: [(8, 1), (4, 4)])
    assert [(s.q, s.d) for s in grid_shapes(64, "summa25")] == [(2, 16), (4, 4)]
    assert [(s.q, s.d) for s in grid_shapes(16, "summa25")] == [(2, 4)]
    assert [(s.q, s.d) for s in grid_shapes(32, "summa25")] == [(2, 8), (4, 2)]
    # where p has no square [q, q, d] (q, d >= 2): the smallest depth over its most square
    # rectangle both ways; where p is not a square, Optimus's most square pr x pc both ways
    assert [str(s) for s in grid_shapes(4, "summa25")] == ["summa25:1x2x2", "summa25:2x1x2"]
    assert grid_shapes(7, "summa25") == []
    assert grid_shapes(64, "summa25") == [Scheme.of_grid(g) for g in spec.grids(64, "summa25")]
    assert [str(s) for s in grid_shapes(32, "optimus")] == ["optimus:4x8", "optimus:8x4"]
    assert [(s.q, s.cols) for s in grid_shapes(32, "optimus")] == [(4, 8), (8, 4)]
    assert grid_shapes(36, "optimus")[0].q == 6
    assert Scheme.make("2.5d", p=128, d=2).q == 8
    with pytest.raises(ValueError, match="p = d\\*q\\*q"):
        Scheme.make("optimus", p=8, q=2)
    with pytest.raises(ValueError, match="unknown scheme"):
        Scheme.make("tesseract", p=8)
    cfg = TransformerConfig(b=64, s=1024, h=8192, n=64, N=24)
    best, costs = best_grid(64, cfg, Machine.simple(alpha=1e-5, beta=1e-10, gamma=1e-12))
    assert best is min(costs, key=lambda c: c.step_seconds)
    assert {c.scheme.name for c in costs} == {"megatron", "optimus", "summa25", "3d"}


@pytest.mark.parametrize("q, d", [(2, 4), (2, 16)])
def test_every_pricer_takes_a_grid_deeper_than_wide(q, d):
    """SUMMA2.5 on [2,2,4] (p = 16) and [2,2,16] (p = 64): d > q, which the runtime runs."""
    from summasim.costmodel import load_preset, step_breakdown, step_cost
    from summasim.costmodel.workload.composition import price_composition
    from summasim.costmodel.workload.predict import predict_algorithm

    sch = Scheme.make("summa25", q=q, d=d)
    assert sch in grid_shapes(d * q * q, "summa25") and sch.label == f"SUMMA2.5 [{q},{q},{d}]"
    cfg = TransformerConfig(b=2 * q * d, s=64, h=128, n=4, N=2, v=256, dtype="float32")
    for name in ("local-2core-mpich", "h100-dgx-ndr"):
        machine = load_preset(name)
        times = [scheme_cost(sch, cfg, machine).step_seconds, step_cost(sch, cfg, machine).seconds,
                 step_breakdown(sch, cfg, machine).seconds,
                 price_composition(cfg.replace(b=4 * q * d), sch, machine=machine, dp=2,
                                   microbatches=2, zero=1)["step_seconds"],
                 predict_algorithm("summa25_ab", 64 * q * d, 64 * q, 64 * q, q, d,
                                   machine=machine, dtype="float32").seconds]
        assert all(math.isfinite(t) and t > 0 for t in times), (name, times)
    assert memory(sch, cfg).total > 0 and largest_batch(sch, cfg, 2 ** 34) > 0
    assert table1(sch, b=cfg.b, s=cfg.s, h=cfg.h, p=sch.p, n=cfg.n)


def test_layer_ops_counts():
    cfg = TransformerConfig(b=4, s=8, h=16, n=4, N=1)
    ops = layer_ops(Scheme.make("optimus", q=2), cfg, include_minor=True)
    mm = [o for o in ops["forward"] if o[0] == "mm"]
    assert [o[1] for o in mm] == ["summa_ab"] * 4
    assert any(o[0] == "coll" and o[1] == "allreduce" and o[2] == "row" for o in ops["forward"])
    minor = scheme_cost(Scheme.make("optimus", q=2), cfg, Machine.simple(), include_minor=True)
    plain = scheme_cost(Scheme.make("optimus", q=2), cfg, Machine.simple())
    assert minor.forward.comm_seconds > plain.forward.comm_seconds


@pytest.mark.parametrize("name,kw", [("megatron", dict(p=4)), ("optimus", dict(q=2)),
                                     ("summa25", dict(q=2, d=2))])
def test_no_vocabulary_means_no_head(name, kw):
    """v = 0 (the CLIs' "no embedding and head") prices the layers alone: the 2D and 2.5D
    head products were kept with a zero dimension and raised in step_work."""
    from summasim.costmodel import load_preset
    from summasim.costmodel.workload.composition import price_composition
    from summasim.costmodel.workload.step import model_ops, step_work
    sch = Scheme.make(name, **kw)
    cfg = TransformerConfig(b=4, s=8, h=64, n=4, N=2, v=0)
    with_head = TransformerConfig(b=4, s=8, h=64, n=4, N=2, v=64)
    ops = model_ops(sch, cfg)
    assert not any(op[0] in ("mm", "gemm") and 0 in op[2:5] for op in ops["forward"]
                   + ops["backward"])
    work, head = step_work(sch, cfg), step_work(sch, with_head)
    flops = sum(2 * m * k * n * c for m, k, n, c in work.gemms)
    assert 0 < flops < sum(2 * m * k * n * c for m, k, n, c in head.gemms)
    for preset in ("local-2core-mpich", "dgx-a100"):
        res = price_composition(cfg, name, machine=load_preset(preset),
                                **{("t" if name == "megatron" else "q"): kw.get("p", kw.get("q")),
                                   "d": kw.get("d", 1)})
        assert res["step_seconds"] > 0
