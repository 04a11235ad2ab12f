"""The shared nouns (summasim.spec): each parses what it prints, the one grid
enumeration is what the runtime and the cost model both use, and the rank order is
the one the grids are built on."""

from __future__ import annotations

import math

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from summasim import spec
from summasim.spec import MODELS, Mesh, Model, TensorGrid, grids


def test_spec_is_pure():
    code = ("import sys, summasim.spec, summasim.options; "
            "sys.exit(1 if {'numpy', 'mpi4py'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# -- Model ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_every_preset_round_trips_and_names_its_source(name):
    m = MODELS[name]
    assert Model.parse(name) == m and str(m) == name and Model.parse(str(m)) == m
    assert m.source and m.batch and m.hidden % m.heads == 0


def test_model_from_sizes_round_trips():
    m = Model.parse("h=64,heads=16,layers=2,seq=16,vocab=64")
    assert (m.hidden, m.heads, m.layers, m.seq, m.vocab, m.ffn_mult) == (64, 16, 2, 16, 64, 4)
    assert Model.parse(str(m)) == m == MODELS["tiny"]          # equality ignores the name
    assert str(m) == "h=64,heads=16,layers=2,seq=16,vocab=64,ffn=4"
    assert Model.parse("hidden=64,heads=16,layers=2,seq=16,vocab=64,ffn=2").ffn_width == 128


def test_preset_with_overrides_is_a_new_model():
    m = Model.parse("gpt3-175b,layers=8")
    assert m.layers == 8 and m.hidden == 12288 and m.name == "" and str(m).startswith("h=")
    assert Model.parse(str(m)) == m


@given(h=st.integers(1, 64), heads=st.integers(1, 8), layers=st.integers(1, 9),
       seq=st.integers(1, 99), vocab=st.integers(1, 999), ffn=st.integers(1, 8))
def test_any_model_round_trips(h, heads, layers, seq, vocab, ffn):
    m = Model(vocab, seq, h * heads, heads, layers, ffn)
    assert Model.parse(str(m)) == m


@pytest.mark.parametrize("text,fragment", [
    ("gpt9", "unknown model"),
    ("h=64,heads=16,layers=2,seq=16", "missing vocab"),
    ("h=64,heads=15,layers=2,seq=16,vocab=64", "not divisible"),
    ("h=64,heads=16,layers=0,seq=16,vocab=64", "positive integer"),
    ("h=64,heads=16,layers=2,seq=16,vocab=64,depth=3", "expected h=H"),
    ("h=64,h=64,heads=16,layers=2,seq=16,vocab=64", "given twice"),
    ("gpt3-175b,layers=x", "positive integer"),
])
def test_model_refuses(text, fragment):
    with pytest.raises(ValueError) as e:
        Model.parse(text)
    assert fragment in str(e.value)


# -- TensorGrid and Mesh -----------------------------------------------------------------
@pytest.mark.parametrize("text,shape,label", [
    ("megatron:4", (4, 1, 1), "Megatron p=4"),
    ("optimus:2x2", (4, 2, 1), "Optimus [2,2]"),
    ("summa25:2x2x4", (16, 2, 4), "SUMMA2.5 [2,2,4]"),
])
def test_tensor_grid_round_trips(text, shape, label):
    g = TensorGrid.parse(text)
    assert (g.p, g.q, g.d) == shape and g.label == label and str(g) == text
    assert TensorGrid.parse(str(g)) == g


@pytest.mark.parametrize("text,want", [
    ("dp=2,pp=2,tp=optimus:2x2", (2, 2, "optimus", 2, 1, 4)),
    ("dp=2,tp=optimus:2x3", (2, 1, "optimus", 2, 1, 6)),          # rectangular: 2 rows, 3 cols
    ("tp=summa25:3x1x2", (1, 1, "summa25", 3, 2, 6)),
    ("tp=megatron:4", (1, 1, "megatron", 1, 1, 4)),
    (" pp=4 , tp=summa25:2x2x3 ", (1, 4, "summa25", 2, 3, 12)),
    ("tp=MEGATRON:1,dp=16", (16, 1, "megatron", 1, 1, 1)),
    ("dp=2,pp=2", (2, 2, "megatron", 1, 1, 1)),   # no tensor grid
    ("dp=4", (4, 1, "megatron", 1, 1, 1)),
])
def test_parse_mesh(text, want):
    m = Mesh.parse(text)
    assert (m.dp, m.pp, m.tp.name, m.tp.q, m.tp.d, m.tp.p) == want
    assert Mesh.parse(str(m)) == m and m.devices == m.dp * m.pp * m.tp.p


@pytest.mark.parametrize("text,fragment", [
    ("", "expected dp=D"),
    ("tp=", "megatron:T, optimus:PRxPC, summa25:PRxPCxD or 3d:QxQxQ"),
    ("tp=cannon:", "megatron:T, optimus:PRxPC, summa25:PRxPCxD or 3d:QxQxQ"),
    ("dp=0,tp=megatron:2", "dp must be a positive integer"),
    ("dp=2,dp=2,tp=megatron:2", "dp given twice"),
    ("tp=3d:2x2x3", "must be a cube"),
    ("tp=3d:2x3x2", "must be a cube"),
    ("tp=optimus:4", "optimus:PRxPC"),
    ("tp=summa25:2x2x1", "depth D >= 2"),
    ("tp=summa25:2x3x1", "depth D >= 2"),
    ("tp=cannon:2x2", "megatron:T, optimus:PRxPC, summa25:PRxPCxD or 3d:QxQxQ"),
    ("dp=2;pp=2,tp=megatron:1", "positive integer"),
    ("tp=megatron:0", "positive"),
])
def test_parse_mesh_refuses(text, fragment):
    with pytest.raises(ValueError) as e:
        Mesh.parse(text)
    assert fragment in str(e.value)


# -- the one enumeration -------------------------------------------------------------------
def test_summa25_admits_depth_past_q():
    assert [str(g) for g in grids(16, "summa25")] == ["summa25:2x2x4"]
    assert [str(g) for g in grids(64, "summa25")] == ["summa25:2x2x16", "summa25:4x4x4"]
    assert [str(g) for g in grids(36, "optimus")] == ["optimus:6x6"]
    assert [str(g) for g in grids(8, "summa25")] == ["summa25:2x2x2"]
    # where p is not a square, Optimus trains on the most square rectangle, both ways
    # round (which side holds whole heads decides which models fit); SUMMA2.5-LM on the
    # smallest depth that leaves a layer of two ranks, and never on a depth alone
    assert [str(g) for g in grids(32, "optimus")] == ["optimus:4x8", "optimus:8x4"]
    assert [str(g) for g in grids(6, "optimus")] == ["optimus:2x3", "optimus:3x2"]
    assert [str(g) for g in grids(6, "summa25")] == ["summa25:1x3x2", "summa25:3x1x2"]
    assert [str(g) for g in grids(4, "summa25")] == ["summa25:1x2x2", "summa25:2x1x2"]
    assert grids(7, "summa25") == [] and grids(2, "summa25") == []
    # where no [q, q, d >= 2] exists the 2.5D products run on a rectangular layer (the
    # most square one of the smallest depth that leaves two ranks), and on a depth-only
    # grid only when p is prime
    assert [str(g) for g in grids(6, "summa25_ab")] == ["summa25_ab:1x3x2"]
    assert [str(g) for g in grids(9, "summa25_atb")] == ["summa25_atb:1x3x3"]
    assert [str(g) for g in grids(7, "summa25_abt")] == ["summa25_abt:1x1x7"]


@pytest.mark.parametrize("p,want", [(6, "2x3"), (12, "3x4"), (24, "4x6"), (8, "2x4"),
                                    (7, "1x7"), (16, "4x4"), (2, "1x2")])
def test_summa_runs_on_the_most_square_grid_of_any_p(p, want):
    for name in ("summa_ab", "summa_abt", "summa_atb"):
        assert [g.grid_label for g in grids(p, name)] == [want]
    square = p == math.isqrt(p) ** 2
    assert bool(grids(p, "cannon_ab")) == square          # Cannon: square grids only
    with pytest.raises(ValueError, match="square grid"):
        TensorGrid("cannon_ab", 6, 2, 1, 3)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 9, 12, 16, 32, 64, 128])
def test_runtime_and_cost_model_enumerate_the_same_grids(p):
    from summasim.algorithms.table import ALGORITHMS
    from summasim.transformer.schemes import SCHEMES

    for name, s in SCHEMES.items():
        assert s.grids(p) == [(g.q, g.cols, g.d) for g in grids(p, name)]
    for name, a in ALGORITHMS.items():
        if a.is_product:
            assert a.grids(p) == [(g.q, g.cols, g.d) for g in grids(p, name)]


def test_grids_filter_by_model():
    tiny = MODELS["tiny"]                         # heads 16, hidden 64, vocab 64
    assert [str(g) for g in grids(16, "megatron", tiny)] == ["megatron:16"]
    assert grids(32, "megatron", tiny) == []      # 16 heads on 32 ranks
    assert [str(g) for g in grids(16, "summa25", tiny, batch=8)] == ["summa25:2x2x4"]
    assert grids(16, "summa25", tiny, batch=4) == []   # 4 sequences on d q = 8
    assert TensorGrid.parse("megatron:3").misfit(tiny) == ""   # 6, 5 and 5 heads
    why = TensorGrid.parse("megatron:32").misfit(tiny.replace(vocab=50257))
    assert why == "heads = 16 is smaller than 32 (one per rank)"  # any vocab (padded)
    gpt2 = tiny.replace(vocab=50257)             # any vocabulary: padded to p (q) blocks
    assert TensorGrid.parse("megatron:16").misfit(gpt2) == ""
    assert TensorGrid.parse("optimus:4x4").misfit(gpt2, batch=8) == ""


# -- rank order --------------------------------------------------------------------------
@pytest.mark.parametrize("q,d", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 1)])
def test_grid_groups_follow_coordinates(q, d):
    p = d * q * q
    for r in range(p):
        i, j, k = spec.grid_coords(r, q)
        assert spec.grid_rank(i, j, k, q) == r
    for kind, free in (("row", 1), ("col", 0), ("depth", 2)):
        groups = spec.grid_groups(kind, q, d)
        assert sorted(r for g in groups for r in g) == list(range(p))
        for g in groups:     # a rank's position in its group is its free coordinate
            assert [spec.grid_coords(r, q)[free] for r in g] == list(range(len(g)))
    assert spec.grid_groups("layer", q, d) == [list(range(k * q * q, (k + 1) * q * q))
                                               for k in range(d)]


@pytest.mark.parametrize("dp,pp,t", [(1, 1, 1), (2, 2, 4), (3, 2, 1), (1, 4, 2)])
def test_mesh_groups_follow_coordinates(dp, pp, t):
    for r in range(dp * pp * t):
        assert spec.mesh_rank(*spec.mesh_coords(r, pp, t), pp, t) == r
    for kind, free in (("dp", 0), ("pp", 1), ("tensor", 2)):
        groups = spec.mesh_groups(kind, dp, pp, t)
        assert sorted(r for g in groups for r in g) == list(range(dp * pp * t))
        for g in groups:
            assert [spec.mesh_coords(r, pp, t)[free] for r in g] == list(range(len(g)))


def test_one_divisibility_rule_for_the_runtime_and_the_cost_model():
    """spec's TensorGrid.divisors and .least are the rule; both floors phrase it, neither
    keeps its own."""
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig, misfit

    # 60 heads of 1: 60 divides by 4 (optimus:2x2); Megatron cuts any count >= p (8, 60)
    # but not 60 over 64 ranks
    odd = Model(vocab=63, seq=16, hidden=60, heads=60, layers=2, ffn_mult=2)
    for text, want in (("megatron:4", []), ("megatron:8", []), ("megatron:64", ["heads"]),
                       ("optimus:2x2", []), ("summa25:2x2x2", ["batch"])):
        g = TensorGrid.parse(text)
        assert [w for w, *_ in g.misfits(odd, batch=6)] == want, text
        cfg = TransformerConfig.from_model(odd, 6, dtype="float32")
        why = misfit(Scheme.of_grid(g), cfg) or ""
        # any vocabulary: padded to a multiple of p (q), never a misfit
        assert "vocabulary" not in why and (("batch b = 6" in why) == ("batch" in want))
        assert ("heads n = 60" in why) == ("heads" in want)
    # the cost model's sizes may be real: a size that is not whole divides by nothing
    cfg = TransformerConfig(b=8.5, s=16, h=64, n=16, N=2, v=0)
    assert "batch b = 8.5" in misfit(Scheme.of_grid(TensorGrid.parse("3d:2x2x2")), cfg)
    assert "batch b = 8.5" in misfit(Scheme.of_grid(TensorGrid.parse("optimus:2x2")), cfg)
    # (no scheme cuts h into blocks that must divide: a real h is priced as it is)
    cfg = TransformerConfig(b=8, s=16, h=64.5, n=16, N=2, v=0)
    assert misfit(Scheme.of_grid(TensorGrid.parse("optimus:2x2")), cfg) is None
    # Optimus and SUMMA2.5-LM: a key/value head per column, phrased alike by both floors
    g = TensorGrid.parse("optimus:2x8")
    few = Model(vocab=63, seq=16, hidden=60, heads=6, layers=2)
    assert g.misfit(few, 2) == "heads = 6 is smaller than 8 (one per column)"
    assert "heads n = 6" in misfit(Scheme.of_grid(g), TransformerConfig.from_model(
        few, 2, dtype="float32"))


def test_the_3d_scheme_is_a_cube_that_cuts_the_batch_into_q_squared_blocks():
    """``3d:QxQxQ`` parses back to itself on p = q^3 ranks; a box that is not a cube is
    refused naming the cube; spec.grids gives the cube exactly when p is one; the batch
    must divide by q^2 (whole sequences per rank), hidden, heads and ffn by q, and any
    vocabulary fits (it is padded)."""
    g = TensorGrid.parse("3d:3x3x3")
    assert (g.p, g.q, g.d, str(g), g.grid_label) == (27, 3, 3, "3d:3x3x3", "3x3x3")
    assert str(Mesh.parse("dp=2,tp=3d:2x2x2")) == "dp=2,pp=1,tp=3d:2x2x2"
    with pytest.raises(ValueError, match="dp given twice"):
        Mesh.parse("dp=1,dp=1")
    with pytest.raises(ValueError, match="cube"):
        TensorGrid.parse("3d:2x2x3")
    with pytest.raises(ValueError, match="cube"):
        TensorGrid("3d", 4, 2, 1)                # a 2 x 2 layer is not a cube
    assert [str(t) for t in grids(8, "3d")] == ["3d:2x2x2"] and grids(16, "3d") == []
    m = Model(vocab=50257, seq=8, hidden=12, heads=6, layers=1, ffn_mult=4)
    assert g.misfits(m, batch=18) == [] and TensorGrid.parse("3d:2x2x2").misfits(m, 8) == []
    assert [w for w, _, _ in g.misfits(m, batch=6)] == ["batch"]
    # any hidden size, head count and MLP width: whole heads per block, a key/value head
    # in each (5 heads over 3 blocks: 2, 2, 1); 2 heads leave a block without one
    odd = Model(vocab=7, seq=8, hidden=10, heads=5, layers=1, ffn_mult=4)
    assert g.misfits(odd, batch=9) == []
    few = Model(vocab=7, seq=8, hidden=10, heads=2, layers=1, ffn_mult=4)
    assert g.misfit(few, 9) == "heads = 2 is smaller than 3 (one per column)"
