"""The pure parts of sharded training: mesh cases (their schedule, chunks and stages),
layer splits, ring closed forms and the default compositions (no MPI). The schedules
themselves: tests/test_schedules.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from summasim.algorithms.allreduce import chunk_bounds
from summasim.harness.cases import MeshCase, case_from_dict
from summasim.harness.plan import default_meshes, plan_meshes
from summasim.spec import SCHEME_NAMES, stage_layers
from summasim.transformer.composed import ring_send_items
from summasim.transformer.model import Config

CFG = Config(vocab=64, seq=16, hidden=64, heads=16, layers=2)


def test_mesh_case_round_trips_and_explains_misfits():
    case = MeshCase.parse("dp=2,pp=2,tp=optimus:2x2", 8, CFG, zero=3, schedule="gpipe",
                          microbatches=2, checkpoint=True, bucket_bytes=4096)
    assert case.p == 16 and case.micro_batch == 2 and case.tensor_size == 4
    assert case_from_dict(case.to_dict()) == case
    assert case.misfit(16) == ""
    assert "needs dp*pp*tensor = 2*2*4 = 16 ranks, the job has 8" in case.misfit(8)
    deep = MeshCase.parse("pp=4,tp=megatron:1", 8, CFG)
    assert "a pipeline of 4 stages needs at least 4 layers, the model has 2" in deep.misfit(4)
    odd = MeshCase.parse("dp=3,tp=megatron:1", 8, CFG)
    assert "batch = 8 is not divisible by dp * microbatches = 3" in odd.misfit(3)
    small = MeshCase.parse("dp=2,tp=summa25:2x2x2", 8, CFG, microbatches=2)
    assert "batch = 2 is not divisible by 4" in small.misfit(16)   # micro-batch of 2


@given(layers=st.integers(1, 40), pp=st.integers(1, 40))
def test_the_even_split_is_contiguous_and_balanced(layers, pp):
    if layers < pp:
        with pytest.raises(ValueError):
            stage_layers(layers, pp)
        return
    parts = stage_layers(layers, pp)
    assert [l for r in parts for l in r] == list(range(layers))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_mesh_case_carries_chunks_and_stages_and_round_trips():
    four = dataclasses.replace(CFG, layers=4)
    case = MeshCase.parse("dp=2,pp=2,tp=megatron:2", 8, four, zero=3, schedule="interleaved",
                          chunks=2, stages=[1, 0, 0, 3], microbatches=2, checkpoint=True)
    assert case.misfit(8) == "" and case.stages == (1, 0, 0, 3)
    assert case.schedule_label == "interleaved:2" and case.stages_label == "1,0,0,3"
    assert "interleaved:2 stages=1,0,0,3 m=2 ckpt" in case.label(8)
    d = case.to_dict()
    assert d["chunks"] == 2 and d["stages"] == [1, 0, 0, 3]
    assert case_from_dict(d) == case
    # the defaults write the record they always wrote (no chunks, no stages keys)
    plain = MeshCase.parse("dp=2,pp=2,tp=megatron:2", 8, four)
    assert "chunks" not in plain.to_dict() and "stages" not in plain.to_dict()
    assert case_from_dict(plain.to_dict()) == plain and "stages" not in plain.label(8)
    with pytest.raises(ValueError, match="V >= 2"):
        MeshCase.parse("pp=2", 8, four, schedule="interleaved")
    with pytest.raises(ValueError, match="V >= 2"):
        MeshCase.parse("pp=2", 8, four, schedule="1f1b", chunks=2)


@pytest.mark.parametrize("mesh,kw,words", [
    ("pp=2", dict(stages=(1, 1, 1)), "--stages 1,1,1: needs 2 non-negative entries (one per "
                                     "stage) summing to the model's 2 layers"),
    ("pp=2", dict(stages=(3, -1)), "--stages 3,-1: needs 2 non-negative entries"),
    ("pp=2", dict(schedule="interleaved", chunks=2),
     "a pipeline of 2 stages x 2 chunks needs at least 4 layers, the model has 2"),
    ("pp=2", dict(schedule="interleaved", chunks=2, stages=(1, 0, 1)),
     "needs 4 non-negative entries (one per stage and chunk)"),
    ("pp=2", dict(schedule="interleaved", chunks=2, stages=(0, 1, 1, 0), microbatches=3),
     "interleaved:2 needs micro-batches a multiple of pp = 2, got 3"),
    ("dp=2", dict(schedule="interleaved", chunks=2, stages=(1, 1)),
     "interleaved:2 needs pp >= 2 stages, the mesh has pp = 1"),
])
def test_plan_meshes_refuses_a_bad_split_or_schedule_naming_the_numbers(mesh, kw, words):
    p = 2
    _, _, err = plan_meshes(p, [(mesh, kw)], CFG, 12, explicit=True)
    assert err.startswith(f"--mesh {mesh}") and words in err, err
    # a default mesh that cannot run is skipped with the same reason
    cases, skips, err = plan_meshes(p, [(mesh, kw)], CFG, 12, explicit=False)
    assert err == "" and not cases and words in skips[0].reason


def test_plan_meshes_takes_an_uneven_or_interleaved_split_that_fits():
    four = dataclasses.replace(CFG, layers=4)
    specs = [("pp=2", dict(stages=(0, 2))),
             ("pp=2", dict(schedule="interleaved", chunks=2, stages=(1, 0, 0, 3),
                           microbatches=2))]
    cases, skips, err = plan_meshes(2, specs, CFG, 8, explicit=True)     # 2 layers: no
    assert err.startswith("--mesh pp=2") and "summing to the model's 2 layers" in err
    cases, skips, err = plan_meshes(2, specs[:1], CFG, 8, explicit=True)
    assert err == "" and cases[0].stages == (0, 2) and not skips
    cases, skips, err = plan_meshes(2, specs[1:], four, 8, explicit=True)
    assert err == "" and (cases[0].chunks, cases[0].stages) == (2, (1, 0, 0, 3))


@given(n=st.integers(0, 200), p=st.integers(1, 9), data=st.data())
def test_ring_send_items_matches_the_ring(n, p, data):
    r = data.draw(st.integers(0, p - 1))
    b = chunk_bounds(n, p)
    size = [hi - lo for lo, hi in b]
    # the reduce-scatter sends chunk (r - s) % p at steps s = 0..p-2, the all-gather
    # chunk (r + 1 - s) % p (summasim.algorithms.allreduce)
    rs = sum(size[(r - s) % p] for s in range(p - 1))
    ag = sum(size[(r + 1 - s) % p] for s in range(p - 1))
    assert ring_send_items(n, p, r, "rs") == rs
    assert ring_send_items(n, p, r, "ag") == ag
    assert ring_send_items(n, p, r, "ar") == rs + ag
    if n % p == 0:
        assert rs + ag == 2 * (p - 1) * n // p


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8, 9, 16, 32])
def test_default_meshes_fit_the_default_model_at_16(p):
    specs = default_meshes(p)
    assert bool(specs) == (p > 1)         # a job of any size >= 2 has a composition to try
    cases, skips, err = plan_meshes(p, specs, CFG, 8, explicit=False)
    assert err == "" and len(cases) + len(skips) == len(specs)
    for c in cases:
        assert c.p == p and c.misfit(p) == ""
    if p == 16:   # the main job's default: every scheme, every ZeRO stage, both schedules
        assert {c.scheme for c in cases} == set(SCHEME_NAMES)
        assert {c.zero for c in cases} == {0, 1, 2, 3}
        assert {c.schedule for c in cases} == {"gpipe", "1f1b"}
    if p == 2:    # plain data parallelism and a two-stage pipeline
        assert [(c.dp, c.pp, c.tensor_size) for c in cases] == [(2, 1, 1), (1, 2, 1)]


def test_plan_meshes_refuses_an_explicit_misfit():
    _, _, err = plan_meshes(8, [("dp=2,pp=2,tp=megatron:4", {})], CFG, 8, explicit=True)
    assert "--mesh dp=2,pp=2,tp=megatron:4" in err and "16" in err
    cases, skips, err = plan_meshes(8, [("dp=2,pp=2,tp=megatron:4", {})], CFG, 8,
                                    explicit=False)
    assert err == "" and not cases and len(skips) == 1
    assert all(s.reason for s in skips)


def test_the_default_batch_is_raised_to_whole_sequences_per_rank_where_a_grid_needs_it():
    """At p = 27 the default batch 8 cuts into whole sequences on neither SUMMA2.5-LM's
    [3, 3, 3] nor the 3D cube (both need b % 9): with ``fit_batch`` (no --batch given)
    they run b = 9, Megatron keeps b = 8; with a batch the user chose they are skipped,
    naming it; a model that does not fit is skipped either way."""
    from summasim.harness.plan import plan_schemes
    from summasim.transformer.model import Config

    cfg = Config(vocab=64, seq=16, hidden=64 * 3, heads=48, layers=1)
    cases, skips = plan_schemes(27, SCHEME_NAMES, lambda dt: cfg, 8, fit_batch=True)
    # 27 is not a square: Optimus on 3x9 (b = 9: three row blocks) and 9x3 (nine)
    assert {(c.scheme, c.grid_label(27), c.batch) for c in cases} == {
        ("megatron", "1D p=27", 8), ("summa25", "[3,3,3]", 9), ("3d", "3x3x3", 9),
        ("optimus", "3x9", 9), ("optimus", "9x3", 9)}
    assert skips == []
    cases, skips = plan_schemes(27, SCHEME_NAMES, lambda dt: cfg, 8)
    assert {c.scheme for c in cases} == {"megatron"}
    assert {s.name for s in skips if "batch" in s.reason} == {"summa25", "3d", "optimus"}
    # 16 heads: fewer than 27 (Megatron); Optimus, SUMMA2.5-LM and the cube cut them
    # unevenly over 3 (or 9) blocks. 2 heads: fewer than every grid's blocks
    odd = Config(vocab=64, seq=16, hidden=64, heads=16, layers=1)
    cases, _ = plan_schemes(27, SCHEME_NAMES, lambda dt: odd, 8, fit_batch=True)
    assert {c.scheme for c in cases} == {"optimus", "summa25", "3d"}
    few = Config(vocab=64, seq=16, hidden=64, heads=2, layers=1)
    cases, _ = plan_schemes(27, SCHEME_NAMES, lambda dt: few, 8, fit_batch=True)
    assert {c.scheme for c in cases} == set()
