"""The cost model of the 3D layer (Bian et al. 2021) on the q x q x q cube.

Every expected value is computed here from the layer as the runtime sends it (per rank,
N = b s / q^2 rows; an all-gather records its piece, a reduce-scatter its whole buffer),
not from the cost model's own helpers.
"""

from collections import Counter
from fractions import Fraction

import pytest

from summasim import spec
from summasim.costmodel import load_preset
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.workload.footprint import batch_step, memory
from summasim.costmodel.workload.layer import layer_ops, scheme_cost
from summasim.costmodel.workload.scheme import (Scheme, TransformerConfig, grid_shapes, misfit,
                                                sequence_parallel_misfit)
from summasim.costmodel.workload.step import model_messages, model_ops, step_breakdown
from summasim.costmodel.workload.table1 import table1, table1_paper
from summasim.costmodel.tools.isoefficiency import (EXACT_SLOPE_TOL, isoefficiency,
                                                    paper_machine, reference_slope,
                                                    tp3d_closed_form, tp3d_overhead)

CUBE = Scheme.make("3d", q=2)
# b = 8 sequences: 2 per rank (b/q^2), N = b s / q^2 = 8 rows
CFG = TransformerConfig(b=8, s=4, h=16, n=4, N=2, v=51, dtype="float64", recompute="none")


def _linears(cfg):
    """(in, out, input group, output group) of the layer's linears, from the brief:
    A -> B linears read over col and write over row, B -> A ones the other way."""
    h, w, f = cfg.h, cfg.qkv_width, cfg.ffn_width
    ab, ba = ("col", "row"), ("row", "col")
    mlp = [(h, f, *ab)] * (2 if cfg.mlp == "swiglu" else 1)
    return [(h, w, *ab), (h, h, *ba), *mlp, (f, h, *ba)]


def _expected_linear(q, N, fin, fout, g_in, g_out):
    """Recorded (op, group, items) of one linear, forward and backward."""
    fwd = [("allgather", g_in, N * fin // q), ("allgather", "depth", fin * fout // q ** 3),
           ("reduce_scatter", g_out, N * fout)]
    bwd = [("allgather", g_out, N * fout // q), ("allgather", g_in, N * fin // q),
           ("allgather", "depth", fin * fout // q ** 3), ("reduce_scatter", g_in, N * fin),
           ("reduce_scatter", "depth", fin * fout // q ** 2)]
    return fwd, bwd


def _expected_layer(cfg, q, minor=True):
    N = cfg.b * cfg.s // q ** 2
    fwd, bwd = [], []
    for fin, fout, g_in, g_out in _linears(cfg):
        f_, b_ = _expected_linear(q, N, fin, fout, g_in, g_out)
        fwd += f_
        bwd += b_
    if minor:
        h, w, f = cfg.h, cfg.qkv_width, cfg.ffn_width
        b_vec = w + f * (2 if cfg.mlp == "swiglu" else 1)
        fwd += [("allreduce", "row", N)] * 4
        bwd += [("allreduce", "row", N)] * 4 + [("allreduce", "depth", (6 * h + b_vec) // q),
                                                ("allreduce", "col", 6 * h // q),
                                                ("allreduce", "row", b_vec // q)]
    return fwd, bwd


def _colls(ops):
    out = Counter()
    for op in ops:
        if op[0] == "coll":
            _, cop, grp, size, items, cnt = op
            assert size == CUBE.q
            out[(cop, grp, items)] += cnt
        else:
            assert op[0] == "gemm", op            # nothing priced as a SUMMA product
    return out


@pytest.mark.parametrize("mlp, kv", [("gelu", None), ("swiglu", 2)])
def test_layer_ops_are_the_3d_collectives(mlp, kv):
    cfg = CFG.replace(mlp=mlp, kv_heads=kv)
    ops = layer_ops(CUBE, cfg, include_minor=True)
    want_f, want_b = _expected_layer(cfg, 2)
    assert _colls(ops["forward"]) == Counter(want_f)
    assert _colls(ops["backward"]) == Counter(want_b)
    # the per-rank GEMMs: 1/p of the serial multiply-adds, forward; twice that backward;
    # the attention core on b/q^2 sequences and n/q heads
    M, s, hd = cfg.b * cfg.s, cfg.s, cfg.h // cfg.n
    lin = sum(M * i * o for i, o, _, _ in _linears(cfg))
    core = (cfg.b // 4) * (cfg.n // 2) * 2 * s * s * hd
    mults = lambda ops: sum(op[1] * op[2] * op[3] * op[4] for op in ops  # noqa: E731
                            if op[0] == "gemm")
    assert mults(ops["forward"]) == Fraction(lin, 8) + core
    assert mults(ops["backward"]) == 2 * (Fraction(lin, 8) + core)
    # full recompute re-runs the forward, collectives included
    full = layer_ops(CUBE, cfg.replace(recompute="full"), include_minor=True)
    assert _colls(full["backward"]) == Counter(want_f) + Counter(want_b)


def test_scheme_cost_payload_and_table1_closed_forms():
    """Recorded items per pass, and the wire words of Table 1's paper pricing (all-gather
    (q-1) x its piece, reduce-scatter (q-1)/q x its buffer), against the closed forms of
    the GPT-2 block: (q-1)/q^3 ((8+2f) bsh + (4+2f) h^2) forward, (q-1)/q^3 ((11+3f) bsh
    + 2 (4+2f) h^2) backward."""
    cfg = CFG
    want_f, want_b = _expected_layer(cfg, 2, minor=False)
    sc = scheme_cost(CUBE, cfg, paper_machine(), mode="paper", compute=False)
    assert sc.forward.payload == sum(x for _, _, x in want_f)
    assert sc.backward.payload == sum(x for _, _, x in want_b)
    for q in (2, 4):
        b, s, h, f = 4 * q * q, 8, 16 * q, 4
        t = table1(Scheme.make("3d", q=q), b, s, h, q ** 3, checkpoint=True)
        fwd = Fraction(q - 1, q ** 3) * ((8 + 2 * f) * b * s * h + (4 + 2 * f) * h * h)
        bwd = Fraction(q - 1, q ** 3) * ((11 + 3 * f) * b * s * h + 2 * (4 + 2 * f) * h * h)
        assert t["forward communication"] == fwd
        assert t["backward communication"] == fwd + bwd          # the recompute first
        assert t["forward computation"] == Fraction(12 * b * s * h * h + 2 * b * s * s * h,
                                                    q ** 3)
    with pytest.raises(ValueError, match="3D"):
        table1_paper("3d", 8, 8, 32, 8)


def test_model_ops_record_the_whole_step():
    """Every item one rank records in a training step: embedding, layers, final
    LayerNorm, the tied head as an A -> B linear [h, q vb], the loss."""
    cfg, q = CFG, 2
    N, h, s = cfg.b * cfg.s // q ** 2, cfg.h, cfg.s
    vb = -(-cfg.v // q)                                   # ceil(v / q) = 26: q vb > v
    layer_f, layer_b = _expected_layer(cfg, q)
    head_f, head_b = _expected_linear(q, N, h, q * vb, "col", "row")
    emb_f = [("allgather", "depth", vb * h // q ** 2), ("reduce_scatter", "col", N * h)]
    emb_b = [("allgather", "col", N * h // q), ("reduce_scatter", "depth", vb * h // q),
             ("allreduce", "col", s * h // q), ("allreduce", "depth", s * h // q)]
    lnf_f = [("allreduce", "row", N)] * 2
    lnf_b = [("allreduce", "row", N)] * 2 + [("allreduce", "col", 2 * h // q),
                                             ("allreduce", "depth", 2 * h // q)]
    loss = [("allreduce", "col", N)] * 3 + [("allreduce", "row", 1), ("allreduce", "depth", 1)]
    want = (emb_f + cfg.N * layer_f + lnf_f + head_f + loss + head_b + lnf_b
            + cfg.N * layer_b + emb_b)
    ops = model_ops(CUBE, cfg)
    assert _colls(ops["forward"] + ops["backward"]) == Counter(want)
    it = cfg.itemsize
    assert sum(mc.count * mc.nbytes for mc in model_messages(CUBE, cfg)) / it == \
        sum(x for _, _, x in want)
    # an untied head [h, v] is the same linear: the same traffic
    untied = model_ops(CUBE, cfg.replace(tied=False))
    assert _colls(untied["forward"] + untied["backward"]) == Counter(want)
    # a cube of one sends nothing
    one = model_ops(Scheme.make("3d", q=1), cfg)
    assert not [op for op in one["forward"] + one["backward"] if op[0] != "gemm"]


def test_roofline_kernels_of_the_cube():
    """Elementwise kernels on [b s/q^2, h/q] blocks; the embedding lookup writes the
    [b s/q, h/q] partial it reduce-scatters."""
    from summasim.costmodel.compute.roofline import layer_kernels, model_kernels

    cfg = CFG
    bsh = cfg.b * cfg.s * cfg.h
    kern = model_kernels(CUBE, cfg, 100, 10)
    emb = {k.name: k.flops for k in kern["forward"] + kern["backward"] if "embedding" in k.name}
    assert emb == {"embedding": bsh / 4, "embedding_bwd": bsh / 4}
    ln1 = next(k for k in layer_kernels(CUBE, cfg)["forward"] if k.name == "ln1")
    assert ln1.nbytes == 2 * bsh / 8 * cfg.itemsize


def test_memory_splits_weights_over_p():
    cfg, q, p = CFG, 2, 8
    h, s, f, w, it = cfg.h, cfg.s, cfg.ffn_width, cfg.qkv_width, cfg.itemsize
    weights = h * w + h * h + 2 * h * f                   # QKV, proj, fc, fc2
    vectors = 6 * h + w + f                               # LayerNorms, biases
    vb = -(-cfg.v // q)
    mem = memory(CUBE, cfg)
    assert mem.params == cfg.N * (Fraction(weights, p) + Fraction(vectors, q)) * it
    assert mem.embedding == (Fraction(vb * h, q * q) + Fraction(s * h, q)
                             + Fraction(2 * h, q)) * it
    untied = memory(CUBE, cfg.replace(tied=False))
    assert untied.embedding - mem.embedding == Fraction(vb * h, q * q) * it
    # the workspace of the widest linear (fc [h, 4h]): gathered X [q N, h/q], gathered
    # weight [h/q, 4h/q], partial [q N, 4h/q]
    bs = cfg.b * cfg.s
    assert mem.workspace == Fraction(bs * (h + f) + h * f, q * q) * it
    # activations: Optimus's blocks with N rows, split over p; statistics over q^2
    M, n = bs, cfg.n
    layer = Fraction((5 + 3) * M * h + 2 * M * f + cfg.b * n * s * s, p) + Fraction(4 * M, q * q)
    logits = 2 * Fraction(M * vb, q * q)
    grads = 2 * Fraction(M * h, p)
    assert mem.activations == (cfg.N * layer + logits + grads) * it
    assert batch_step(CUBE) == 4


def test_grids_aliases_and_misfit():
    assert grid_shapes(8, "3d") == [Scheme("3d", 8, 2, 2)]
    assert grid_shapes(64, "tp3d") == [Scheme("3d", 64, 4, 4)]
    assert grid_shapes(16, "3d") == [] and grid_shapes(32, "3d") == []
    assert Scheme.make("3d", p=27) == Scheme.make("3d", q=3) == Scheme.make("3d", q=3, d=3)
    assert Scheme.make("3d", p=8).label == "3D [2,2,2]"
    for kw in (dict(p=16), dict(q=2, d=4), dict(p=8, q=3)):
        with pytest.raises(ValueError, match="cube"):
            Scheme.make("3d", **kw)
    # the batch by q^2, whole sequences per rank; a key/value head per feature block
    # (any hidden size and MLP width: the balanced partition, whole heads per block)
    assert misfit(CUBE, CFG) is None
    why = misfit(CUBE, CFG.replace(b=6))
    assert "batch b = 6 is not divisible by q^2 = 4" in why
    assert misfit(CUBE, CFG.replace(h=15, n=3)) is None
    assert "heads n = 1 is smaller than" in misfit(CUBE, CFG.replace(h=15, n=1))
    assert grid_shapes(8, "3d", CFG.replace(b=6)) == []


@pytest.mark.parametrize("h, n, kv, f, mlp", [(15, 3, 3, Fraction(31, 15), "gelu"),
                                              (12, 6, 3, Fraction(25, 12), "swiglu"),
                                              (16, 4, 4, 4, "gelu")])
@pytest.mark.parametrize("q", [2, 3])
def test_layer_payload_is_the_runtime_closed_form_on_uneven_sizes(q, h, n, kv, f, mlp):
    """Where q cuts neither the heads nor the MLP width evenly, the layer's recorded
    items per pass are rank (0, 0, 0)'s, the busiest: the runtime's
    ``tp3d.layer_payload`` (checked against the trace in mpi_tests/test_tp3d.py)."""
    from summasim.transformer import model, tp3d

    b, s = 2 * q * q, 8
    mcfg = model.Config(vocab=11, seq=s, hidden=h, heads=n, kv_heads=kv, layers=1,
                        ffn_mult=f, mlp=mlp)
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=1, v=11, kv_heads=kv, ffn=f, mlp=mlp,
                            checkpoint=False)
    cube = Scheme.make("3d", q=q)
    sc = scheme_cost(cube, cfg, paper_machine(), mode="paper", compute=False)
    want = tp3d.layer_payload(mcfg, b, q)
    assert (sc.forward.payload, sc.backward.payload) == (want["fwd"], want["bwd"])
    assert want == tp3d.layer_payload(mcfg, b, q, i=0, j=0)
    assert all(want["fwd"] >= tp3d.layer_payload(mcfg, b, q, i=i, j=j)["fwd"]
               for i in range(q) for j in range(q))


def test_sequence_parallelism_is_refused():
    cfg = CFG.replace(sequence_parallel=True)
    why = sequence_parallel_misfit(CUBE, cfg)
    assert why and "Megatron's (1D) only" in why and "3D [2,2,2]" in why
    assert why in misfit(CUBE, cfg)
    with pytest.raises(ValueError, match="Megatron's"):
        layer_ops(CUBE, cfg)


def test_a_mesh_with_a_3d_tensor_grid_predicts():
    """dp=2,pp=2,tp=3d:2x2x2: the composition prices the cube's own traffic."""
    mesh = spec.Mesh.parse("dp=2,pp=2,tp=3d:2x2x2")
    sch = Scheme.of_grid(mesh.tp)
    cfg = CFG.replace(N=4)
    machine = load_preset("h100-dgx-ndr")
    res = price_composition(cfg.replace(b=32), sch, machine=machine, dp=mesh.dp, pp=mesh.pp,
                            microbatches=2, zero=1)
    comp = res["composition"]
    assert (comp["scheme"], comp["grid"], comp["devices"], comp["micro_batch"]) == \
        ("3d", "3D [2,2,2]", 32, 8)
    assert res["step_seconds"] > 0 and res["memory"]["total"] > 0
    # the pipeline hands on the [b s/q^2, h/q] block: b s h / p items per micro-batch
    it = cfg.itemsize
    assert res["traffic"]["pipeline"] == 2 * 8 * cfg.s * cfg.h * it / 8
    # one stage's tensor traffic over its micro-batches: half the layers, with the
    # embedding or the head; the whole grid's step (dp = pp = 1) is model_messages
    one = price_composition(cfg.replace(b=8), sch, machine=machine)
    assert one["traffic"]["tensor"] == pytest.approx(
        sum(mc.count * mc.nbytes for mc in model_messages(sch, cfg)), rel=1e-12)
    sb = step_breakdown(sch, cfg, machine)
    assert sb.seconds > 0 and sb.comm_seconds > 0


def test_isoefficiency_matches_the_closed_form():
    cubes = [8 ** k for k in range(1, 7)]
    for rc in ("full", "none"):
        cfg = TransformerConfig(s=512, N=1, dtype="float32", recompute=rc)
        fit = isoefficiency("3d", 0.5, cubes + [16, 32], cfg=cfg, solver="illinois")
        assert fit.p == cubes                              # only the cubes have a grid
        closed = tp3d_closed_form(0.5, cubes, cfg=cfg)
        assert abs(fit.slope - closed.slope) <= EXACT_SLOPE_TOL
        assert fit.W == pytest.approx(closed.W, rel=1e-9)
    # the leading order is (q-1)^3 = (p^(1/3) - 1)^3, which tends to p
    lead = tp3d_closed_form(0.5, cubes, order="leading")
    assert lead.slope == pytest.approx(reference_slope("(p^(1/3) - 1)^3", cubes), abs=1e-12)
    assert reference_slope("3d leading", cubes) == pytest.approx(lead.slope)
    far = [8 ** k for k in range(6, 9)]
    assert abs(reference_slope("3d closed form", far) - 1) < 0.02


@pytest.mark.parametrize("q", [2, 3, 4])
@pytest.mark.parametrize("rc", ["full", "none"])
def test_tp3d_overhead_is_the_cost_models_communication(q, rc):
    """Phi_3 = p T_comm / (beta w h^2) = (q-1) ((P_f (8+2f) + 11+3f) c + (P_f+2)(4+2f))."""
    h, f = 12.0 * q, 4
    cfg = TransformerConfig(b=2.0 * q * q, s=32, h=h, n=q, N=1, dtype="float32",
                            recompute=rc)
    sch = Scheme.make("3d", q=q)
    machine = paper_machine(beta=1.0)
    sc = scheme_cost(sch, cfg, machine, mode="paper", compute=False)
    T = sc.forward.comm_seconds + sc.backward.comm_seconds
    c = cfg.b * cfg.s / h
    P_f = 2 if rc == "full" else 1
    phi = (q - 1) * ((P_f * (8 + 2 * f) + 11 + 3 * f) * c + (P_f + 2) * (4 + 2 * f))
    assert sch.p * T / (cfg.itemsize * h * h) == pytest.approx(phi, rel=1e-12)
    assert tp3d_overhead(q, c=c, ffn=f, recompute=rc == "full") == pytest.approx(phi)


def test_plan_rows_round_trip_through_predict_mesh():
    """plan searches the cube; a row's grid, as --mesh spells it, predicts that row."""
    import io

    from summasim.costmodel.tools import plan, plan_cli, predict

    model = "h=64,heads=4,layers=4,seq=32,vocab=100"
    p = plan_cli.check_args(plan_cli.build_parser().parse_args(
        ["--model", model, "--batch", "16", "--devices", "16", "--machine", "h100-dgx-ndr",
         "--mem-gib", "1000", "--schemes", "3d"]))
    res = plan.search(p.cfg, p.devices, p.global_batch, p.machine, budget=p.budget,
                      schemes=p.schemes, zeros=p.zeros, recomputes=p.recomputes,
                      schedule=p.schedule, state_bytes=p.state_bytes,
                      sequence_parallel=p.sequence_parallel, chunks=p.chunks)
    rows = [r for r in res.rows if r["dp"] == 2 and r["pp"] == 1]
    assert rows and {r["scheme"] for r in res.rows} == {"3d"}
    r = rows[0]
    assert plan.short_grid(r) == "3d:2x2x2"
    argv = ["--model", model, "--batch", "16", "--machine", "h100-dgx-ndr",
            "--mesh", f"dp=2,pp=1,tp={plan.short_grid(r)}", "--zero", str(r["zero"]),
            "--microbatches", str(r["microbatches"]), "--dtype", p.cfg.dtype,
            "--recompute", r["recompute"], "--schedule", r["schedule"]]
    doc = predict.run(predict.build_parser().parse_args(argv), out=io.StringIO())
    assert doc["step_seconds"] == r["step_seconds"]


@pytest.mark.parametrize("h, n, kv, f, mlp, tied", [(15, 3, 3, Fraction(31, 15), "gelu", True),
                                                    (12, 6, 3, Fraction(25, 12), "swiglu",
                                                     False)])
def test_memory_is_the_busiest_ranks_shards_on_uneven_sizes(h, n, kv, f, mlp, tied):
    """Where q cuts the heads or the MLP width unevenly, the parameters priced per rank
    are rank (0, 0, 0)'s local shards, item for item (``tp3d._shape_of``, the runtime's
    local shapes), the largest of the cube's."""
    import math

    from summasim.transformer import model, tp3d

    q, b, s, v = 2, 8, 8, 11
    mcfg = model.Config(vocab=v, seq=s, hidden=h, heads=n, kv_heads=kv, layers=1,
                        ffn_mult=f, mlp=mlp, tied=tied)
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=1, v=v, kv_heads=kv, ffn=f, mlp=mlp,
                            tied=tied, checkpoint=False, dtype="float64")
    shapes = model.param_shapes(mcfg)

    def held(k, i, j):
        return sum(math.prod(tp3d._shape_of(name, shape, mcfg, q, k, i, j))
                   for name, shape in shapes.items())

    mem = memory(Scheme.make("3d", q=q), cfg)
    assert (mem.params + mem.embedding) / 8 == held(0, 0, 0)
    assert held(0, 0, 0) == max(held(k, i, j) for k in range(q) for i in range(q)
                                for j in range(q))
