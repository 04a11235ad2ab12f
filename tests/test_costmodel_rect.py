"""The cost model on rectangular grids (Optimus on ``pr x pc``, SUMMA2.5-LM on ``[pr, pc,
d]``) and on sizes the grid does not divide (the MLP width F over pr and pc, h over pr,
the key/value heads over pc, the vocabulary): what rank (0, 0, 0), the busiest, sends
and holds under the runtime's layout (:mod:`summasim.transformer.optimus`), against
closed forms written out here.

Per rank, one product ``X[M, K] W[K, N]`` broadcasts ``M K/(d pr)`` items along its row
(pc ranks) and ``K N_0`` down its column (pr ranks) in total over its steps, ``N_0`` the
width of column 0 (``ceil(N/pc)`` for the MLP width, the balanced partition's first
block; for h and the QKV width that of column 0's head groups); ``abt`` and ``atb`` move
as much each (a broadcast and a reduce), and on d > 1 ``atb`` all-reduces the
``[ceil(K/pr), N_0]`` block of dW over the depth (d = 2: the ring sends the block once).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction

import pytest

from summasim import spec
from summasim.costmodel.__main__ import main
from summasim.costmodel.machine import load_preset
from summasim.costmodel.tools.plan import short_grid
from summasim.costmodel.tools.predict import step_breakdown_layers
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.workload.footprint import memory
from summasim.costmodel.workload.layer import layer_ops, product_work, scheme_cost
from summasim.costmodel.workload.scheme import (Scheme, TransformerConfig, grid_shapes,
                                                grid_vocab, misfit, runs)
from summasim.costmodel.workload.step import model_messages, model_ops, step_cost
from summasim.costmodel.workload.table1 import table1
from summasim.costmodel.workload.zero import StateBytes

# h = 15 (over pr = 2: blocks 8 and 7), 3 heads of 5 (whole heads per column on pc = 3),
# an MLP 61 wide (over pc = 3: 21, 20, 20; over pr = 2: 31, 30)
H, HEADS, F, S = 15, 3, 61, 8
FFN = Fraction(F, H)


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def _cfg(b: int, **kw) -> TransformerConfig:
    return TransformerConfig(b=b, s=S, h=H, n=HEADS, N=2, v=0, dtype="float64", ffn=FFN,
                             **kw)


def _products(h: int, f: int) -> list[tuple[int, int]]:
    """``(K, N)`` of one GELU layer's products: QKV, projection, fc, fc2."""
    return [(h, 3 * h), (h, h), (h, f), (f, h)]


def _words(pr: int, pc: int, d: int, b: int) -> tuple[Fraction, int, int]:
    """Hand closed form of one layer's forward on rank (0, 0, 0): items along the row,
    items down the column, and (backward, d > 1) items the dW depth rings send."""
    M = b * S
    row = sum(Fraction(M, d * pr) * K for K, _ in _products(H, F))
    col = sum(K * ceil(N, pc) for K, N in _products(H, F))
    ring = sum(ceil(K, pr) * ceil(N, pc) for K, N in _products(H, F)) if d > 1 else 0
    return row, col, ring


def _layer_words(sch: Scheme, cfg: TransformerConfig) -> dict:
    """``{(pass, op, group): items}`` of the products of :func:`layer_ops` (no recompute)."""
    out: Counter = Counter()
    for key, ops in layer_ops(sch, cfg, checkpoint=False).items():
        for op in ops:
            if op[0] == "mm":
                for mc in product_work(sch, op, 1, compute=False)[0]:
                    out[(key, mc.op, mc.group)] += mc.count * mc.nbytes
    return dict(out)


@pytest.mark.parametrize("grid, b", [("optimus:2x3", 4), ("summa25:2x3x2", 8)])
def test_layer_words_are_the_closed_form_on_rank_000(grid, b):
    sch = Scheme.of_grid(spec.TensorGrid.parse(grid))
    pr, pc, d = sch.q, sch.cols, sch.d
    assert (pr, pc, d, str(sch)) == (2, 3, 1 if grid.startswith("optimus") else 2, grid)
    cfg = _cfg(b)
    assert runs(sch, cfg) and cfg.ffn_width == F
    row, col, ring = _words(pr, pc, d, b)
    want = {("forward", "bcast", "row"): row, ("forward", "bcast", "col"): col,
            ("backward", "bcast", "col"): col, ("backward", "reduce", "row"): row,
            ("backward", "bcast", "row"): row, ("backward", "reduce", "col"): col}
    if ring:
        want[("backward", "sendrecv", "depth")] = ring
    assert _layer_words(sch, cfg) == want
    # and the payload scheme_cost prices (its default, real-valued path included)
    cost = scheme_cost(sch, cfg, load_preset("local-2core-mpich"), checkpoint=False,
                       compute=False)
    assert (cost.forward.payload, cost.backward.payload) == (row + col, 2 * (row + col) + ring)


@pytest.mark.parametrize("grid, b", [("optimus:2x3", 4), ("summa25:2x3x2", 8)])
def test_table1_on_a_rectangle_is_the_closed_form(grid, b):
    """table1 prices broadcasts and reduces as ``log2(P)`` words each: the column's pr = 2
    exactly, the row's pc = 3 rounded once (its coefficient exact); with checkpointing
    the backward is three forwards plus the depth rings' words."""
    sch = Scheme.of_grid(spec.TensorGrid.parse(grid))
    row, col, ring = _words(sch.q, sch.cols, sch.d, b)
    t = table1(sch, b, S, H, sch.p, n=HEADS, ffn=FFN)
    assert t["forward communication"] == Fraction(col) + float(row) * math.log2(3)
    assert t["backward communication"] == Fraction(3 * col + ring) + float(3 * row) * math.log2(3)
    # multiplications: each product's K N_0 M/(d pr), the attention core's b/(d pr) n/pc
    # (sequence, head) pairs 2 s^2 h/n each (forward)
    M = Fraction(b * S, sch.d * sch.q)
    core = Fraction(b, sch.d * sch.q) * (HEADS // sch.cols) * 2 * S * S * (H // HEADS)
    assert t["forward computation"] == sum(M * K * ceil(N, 3) for K, N in _products(H, F)) + core


def test_a_square_grid_is_priced_alike_however_it_is_built():
    machine = load_preset("local-2core-mpich")
    cfg = TransformerConfig(b=8, s=16, h=32, n=4, N=2, v=50, dtype="float64")
    for name, d, text in (("optimus", 1, "optimus:2x2"), ("summa25", 2, "summa25:2x2x2")):
        plain, named = Scheme.make(name, q=2, d=d), Scheme.make(name, q=2, d=d, pc=2)
        parsed = Scheme.of_grid(spec.TensorGrid.parse(text))
        assert plain == named == parsed and plain.pc == 0 and str(plain) == text
        assert scheme_cost(plain, cfg, machine).to_dict() == \
            scheme_cost(named, cfg, machine).to_dict()
        assert step_cost(plain, cfg, machine).seconds == step_cost(named, cfg, machine).seconds
        assert memory(plain, cfg) == memory(named, cfg)
        assert model_messages(plain, cfg) == model_messages(named, cfg)
    # of_grid keeps the columns of a rectangle: 2 x 3 is not 2 x 2
    rect = Scheme.of_grid(spec.grids(6, "optimus")[0])
    assert (rect.q, rect.cols, rect.p, str(rect)) == (2, 3, 6, "optimus:2x3")
    assert rect == Scheme.make("2d", q=2, pc=3) == Scheme.make("optimus", p=6, pc=3)
    assert model_messages(rect, cfg) != model_messages(Scheme.make("optimus", q=2), cfg)
    with pytest.raises(ValueError, match="p = d\\*pr\\*pc"):
        Scheme.make("summa25", p=12, q=2, d=2, pc=2)
    with pytest.raises(ValueError, match="no rectangular grid"):
        Scheme.make("3d", q=2, pc=3)


def test_misfit_asks_sequences_per_rank_and_a_head_group_per_column():
    sch = Scheme.make("summa25", q=2, d=2, pc=3)                 # d pr = 4, pc = 3
    fits = _cfg(8)
    assert misfit(sch, fits) is None                           # F and h over pr: any size
    assert misfit(sch, fits.replace(b=6)) == "batch b = 6 is not divisible by d pr = 4"
    # the key/value head groups are cut over pc by the balanced partition: one per column
    assert misfit(sch, fits.replace(n=5, h=20)) is None
    assert misfit(sch, fits.replace(n=2, h=10)) == \
        "heads n = 2 is smaller than pc = 3 (one per column)"
    assert misfit(sch, fits.replace(n=4, h=20, kv_heads=2)) == \
        "key/value heads = 2 is smaller than pc = 3 (one per column)"
    # real sizes: the batch divides by nothing, an MLP width need not be whole
    assert misfit(sch, fits.replace(b=8.5)) == "batch b = 8.5 is not divisible by d pr = 4"
    assert misfit(sch, fits.replace(ffn=4.1)) is None
    # which way round the rectangle lies decides which models fit: a head group per column
    cfg = TransformerConfig(b=6, s=8, h=16, n=2, N=1)
    assert [str(g) for g in grid_shapes(6, "optimus")] == ["optimus:2x3", "optimus:3x2"]
    assert [str(g) for g in grid_shapes(6, "optimus", cfg)] == ["optimus:3x2"]


def test_uneven_mlp_and_hidden_are_priced_as_the_busiest_rank():
    """Rank (0, 0) holds the first blocks of every balanced partition: ceil(h/pr) rows,
    ceil(F/pc) MLP columns, ceil(F/pr) fc2 rows; the vectors' column block and the padded
    vocabulary's wte block ``[V'/pr, h/pc]``, V' a multiple of lcm(pr, pc) = 6."""
    sch = Scheme.make("optimus", q=2, pc=3)
    cfg = _cfg(4).replace(v=13, recompute="none")          # every layer's activations kept
    hr, hc, fc, fr = ceil(H, 2), H // 3, ceil(F, 3), ceil(F, 2)
    layer = hr * (3 * H // 3 + hc) + hr * fc + fr * hc + (9 * H // 3 + fc)
    assert layer == 549
    assert grid_vocab(13, sch) == 18 and grid_vocab(13, Scheme.make("optimus", q=2)) == 14
    emb = 18 // 2 * hc + S * hc + 2 * hc                       # wte, wpe, lnf on row 0
    mem = memory(sch, cfg)
    assert (mem.params, mem.embedding) == (cfg.N * layer * 8, emb * 8)
    # the MLP's kept tensors: fc1 and GELU outputs, [b s/pr, ceil(F/pc)] each
    even = memory(sch, cfg.replace(ffn=Fraction(60, H)))
    assert mem.activations - even.activations == cfg.N * 2 * (4 * S // 2) * (fc - 60 // 3) * 8
    # an untied head.w [h, V'] blocked like a weight: [ceil(h/pr), V'/pc]
    untied = memory(sch, cfg.replace(tied=False))
    assert untied.embedding - mem.embedding == hr * (18 // 3) * 8
    # the busiest rank's words exceed the average's (the plain quotients of a real F)
    row, col, _ = _words(2, 3, 1, 4)
    avg = sum(Fraction(4 * S, 2) * K + Fraction(K * N, 3) for K, N in _products(H, F))
    assert row + col > avg


def test_the_lm_head_is_abt_of_wte_tied_and_ab_of_its_own_weight_untied():
    """Tied: logits = abt(x, wte), dx = ab(dl, wte), dwte += atb(dl, x); untied: logits
    = ab(x, head.w), dx = abt(dl, head.w), dhead.w = atb(x, dl); V' = 18 on 2 x 3."""
    sch = Scheme.make("optimus", q=2, pc=3)
    M = 4 * S
    for tied, fwd, bwd in ((True, [("summa_abt", M, H, 18)],
                            [("summa_ab", M, 18, H), ("summa_atb", 18, M, H)]),
                           (False, [("summa_ab", M, H, 18)],
                            [("summa_abt", M, 18, H), ("summa_atb", H, M, 18)])):
        ops = model_ops(sch, _cfg(4).replace(v=13, N=1, tied=tied))
        layer = layer_ops(sch, _cfg(4).replace(N=1), include_minor=True, checkpoint=False)
        head_f = [op[1:] for op in ops["forward"] if op[0] == "mm"
                  and op not in layer["forward"]]
        head_b = [op[1:] for op in ops["backward"] if op[0] == "mm"
                  and op not in layer["backward"]]
        assert (head_f, head_b) == (fwd, bwd), tied


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_head_and_loss_collectives_on_a_rectangle(tied):
    """Beyond the layers and the head's products, on summa25:2x3x2 (rows b s/(d pr) =
    8, V' = 18): pr = 2 broadcasts of the wte blocks ``[V'/pr, h/pc]`` down the columns
    and one of ``wpe [s, h/pc]``; the final LayerNorm's ``2h/pc`` vectors and 2 row
    all-reduces of the statistics; the loss's 3 row all-reduces and its sum over the
    column and the depth. Backward: the conjugates, and on row 0 the depth rings."""
    sch = Scheme.make("summa25", q=2, d=2, pc=3)
    cfg = _cfg(8).replace(v=13, N=1, tied=tied)
    ops = model_ops(sch, cfg)
    layer = layer_ops(sch, cfg, include_minor=True, checkpoint=False)
    rest = {key: Counter(op for op in ops[key] if op[0] in ("coll", "ring"))
            - Counter(op for op in layer[key] if op[0] in ("coll", "ring"))
            for key in ("forward", "backward")}
    wte, wpe, lnf, rows = 18 // 2 * (H // 3), S * H // 3, 2 * H // 3, 8 * S // 4
    assert rest["forward"] == Counter({
        ("coll", "bcast", "col", 2, wte, 2): 1, ("coll", "bcast", "col", 2, wpe, 1): 1,
        ("coll", "bcast", "col", 2, lnf, 1): 1, ("coll", "allreduce", "row", 3, rows, 2): 1,
        ("coll", "allreduce", "row", 3, rows, 3): 1, ("coll", "allreduce", "col", 2, 1, 1): 1,
        ("coll", "allreduce", "depth", 2, 1, 1): 1})
    assert rest["backward"] == Counter({
        ("coll", "allreduce", "row", 3, rows, 2): 1, ("coll", "reduce", "col", 2, lnf, 1): 1,
        ("ring", "depth", 2, lnf, 1): 1, ("coll", "reduce", "col", 2, wte, 2): 1,
        ("coll", "reduce", "col", 2, wpe, 1): 1, ("ring", "depth", 2, wte, 1): 1,
        ("ring", "depth", 2, wpe, 1): 1})


def test_heads_pc_does_not_divide_cut_h_at_the_head_groups():
    """4 heads of 4 on pc = 3 columns: the balanced partition of the heads, 2, 1, 1, so
    column 0 holds h_0 = 8 hidden and W_0 = 24 QKV columns (not ceil(16/3) = 6 and 16);
    the MLP's 66 columns 22 each; h over pr = 2 rows 8 and F 33."""
    sch = Scheme.make("optimus", q=2, pc=3)
    h, n, f, b = 16, 4, 66, 4
    cfg = TransformerConfig(b=b, s=S, h=h, n=n, N=2, v=13, dtype="float64",
                            ffn=Fraction(f, h), recompute="none")
    assert runs(sch, cfg)
    top = ceil(n, 3)                                   # column 0's heads
    h0, w0, f0, hr, fr = 4 * top, 3 * 4 * top, ceil(f, 3), ceil(h, 2), ceil(f, 2)
    blk = sch.blocks(cfg)
    assert (blk.h, blk.heads, blk.qkv, blk.ffn, blk.h_rows, blk.ffn_rows) == \
        (h0, top, w0, f0, hr, fr) == (8, 2, 24, 22, 8, 33)
    assert blk.cuts == (("h", (0, 8, 12, 16)), ("W", (0, 24, 36, 48)))
    M = b * S
    row = sum(Fraction(M, 2) * K for K, _ in _products(h, f))
    col = h * w0 + h * h0 + h * f0 + f * h0
    words = _layer_words(sch, cfg)
    assert (words[("forward", "bcast", "row")], words[("forward", "bcast", "col")]) == (row, col)
    assert words[("backward", "reduce", "row")] == row
    assert words[("backward", "reduce", "col")] == col
    # memory: weight blocks, the row-0 vectors and wte [V'/pr, h_0], wpe [s, h_0], lnf
    mem = memory(sch, cfg)
    layer = hr * (w0 + h0) + hr * f0 + fr * h0 + (6 * h0 + w0 + f0)
    assert (mem.params, mem.embedding) == (2 * layer * 8, (18 // 2 + S + 2) * h0 * 8)
    # attention on column 0's heads: b/pr sequences x 2 heads
    core = [op for op in layer_ops(sch, cfg)["forward"] if op[0] == "gemm"]
    assert core[0] == ("gemm", S, h // n, S, b // 2 * top)
    # the embedding's and the final LayerNorm's broadcasts down the columns: h_0 wide
    sent = Counter((op[4], op[5]) for op in model_ops(sch, cfg)["forward"]
                   if op[:3] == ("coll", "bcast", "col"))
    assert sent[(18 // 2 * h0, 2)] == 1 and sent[(S * h0, 1)] == 1 and sent[(2 * h0, 1)] == 1


def test_real_sizes_take_the_plain_quotients_on_a_rectangle():
    """A scaling study's real h: every block the quotient, pr + pc - gcd = 4 equal steps."""
    sch = Scheme.make("optimus", q=2, pc=3)
    h = 15.5
    cfg = TransformerConfig(b=4, s=S, h=h, n=HEADS, N=1, dtype="float64")
    M = 4 * S
    want = sum(M * K / 2 + K * N / 3 for K, N in _products(h, 4 * h))
    got = scheme_cost(sch, cfg, load_preset("local-2core-mpich"), checkpoint=False,
                      compute=False)
    assert got.forward.payload == pytest.approx(want, rel=1e-12)
    steps = [mc.count for op in layer_ops(sch, cfg, checkpoint=False)["forward"]
             if op[0] == "mm" for mc in product_work(sch, op, 8, compute=False)[0]]
    assert steps == [4] * 8


def test_a_layer_of_one_row_sends_nothing_down_its_columns():
    """summa25:1x3x2: the column groups hold one rank; the row and the depth carry all."""
    sch = Scheme.of_grid(spec.TensorGrid.parse("summa25:1x3x2"))
    groups = {(mc.op, mc.group) for mc in model_messages(sch, _cfg(4).replace(v=13))}
    assert groups and not any(g == "col" for _, g in groups)
    assert {("bcast", "row"), ("reduce", "row"), ("sendrecv", "depth")} <= groups


def test_predict_prices_a_mesh_on_optimus_2x3(tmp_path, capsys):
    model = "h=96,heads=6,layers=2,seq=32,vocab=100"
    machine = load_preset("local-2core-mpich")
    sch = Scheme.make("optimus", q=2, pc=3)
    path = tmp_path / "alone.json"
    assert main(["predict", "--model", model, "--batch", "12", "--mesh", "tp=optimus:2x3",
                 "--machine", "local-2core-mpich", "--dtype", "float64",
                 "--json", str(path)]) == 0
    assert "Optimus [2,3]" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert (doc["grid"], doc["p"], doc["q"], doc["pc"], doc["d"]) == ("Optimus [2,3]", 6, 2, 3, 1)
    cfg = TransformerConfig.from_model(spec.Model.parse(model), 12, dtype="float64")
    # the grid alone is the composition of it alone (dp = pp = m = 1), priced as plan does
    alone = price_composition(cfg, sch, machine=machine, microbatches=1, global_batch=12,
                              devices=6, state_bytes=StateBytes.for_training("float64", None))
    assert doc["seconds"] == pytest.approx(alone["step_seconds"], rel=1e-12)
    # the groups keep the layer model's shares of it
    layer = {f"{op}/{g}": v
             for (op, g), v in step_breakdown_layers(sch, cfg, machine).by_op.items()}
    scale = doc["comm_seconds"] / sum(layer.values())
    assert doc["by_op"] == pytest.approx({k: v * scale for k, v in layer.items()})
    assert doc["memory"]["total"] == memory(sch, cfg).total
    # a composition of two replicas of the rectangle
    path = tmp_path / "mesh.json"
    assert main(["predict", "--model", model, "--batch", "12", "--mesh",
                 "dp=2,tp=optimus:2x3", "--machine", "local-2core-mpich", "--dtype",
                 "float64", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    comp = doc["composition"]
    assert (comp["grid"], comp["t"], comp["q"], comp["pc"]) == ("Optimus [2,3]", 6, 2, 3)
    assert short_grid({**comp, "scheme": "optimus"}) == "optimus:2x3"
    again = price_composition(cfg, sch, machine=machine, dp=2, microbatches=1,
                              global_batch=12, devices=12,
                              state_bytes=StateBytes.for_training("float64", None))
    assert comp["micro_batch"] == again["composition"]["micro_batch"] == 6
    assert doc["step_seconds"] == again["step_seconds"] > 0
