"""The pure parts of sharded training: mesh cases, layer splits, schedules, ring closed
forms and the default compositions (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from summasim.algorithms.allreduce import chunk_bounds
from summasim.harness.cases import MeshCase, case_from_dict
from summasim.harness.plan import default_meshes, plan_meshes
from summasim.transformer.composed import ring_send_items, schedule, split_layers
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
    assert "layers = 2 < pp = 4" in deep.misfit(4)
    odd = MeshCase.parse("dp=3,tp=megatron:1", 8, CFG)
    assert "batch = 8 is not divisible by dp * microbatches = 3" in odd.misfit(3)
    small = MeshCase.parse("dp=2,tp=summa25:2x2x2", 8, CFG, microbatches=2)
    assert "batch = 2 is not divisible by 4" in small.misfit(16)   # micro-batch of 2


@given(layers=st.integers(1, 40), pp=st.integers(1, 40))
def test_split_layers_is_contiguous_and_balanced(layers, pp):
    if layers < pp:
        with pytest.raises(ValueError):
            split_layers(layers, pp)
        return
    parts = split_layers(layers, pp)
    assert [l for r in parts for l in r] == list(range(layers))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(m=st.integers(1, 12), pp=st.integers(1, 8), kind=st.sampled_from(["gpipe", "1f1b"]))
def test_schedules_run_each_microbatch_once_in_a_deadlock_free_order(m, pp, kind):
    orders = [schedule(kind, m, pp, s) for s in range(pp)]
    for s, order in enumerate(orders):
        assert sorted(order) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        pos = {op: i for i, op in enumerate(order)}
        assert all(pos[("F", j)] < pos[("B", j)] for j in range(m))
        live, most = 0, 0
        for op, _ in order:
            live += 1 if op == "F" else -1
            most = max(most, live)
        assert most == (m if kind == "gpipe" else min(pp - s, m))
    # simulate the pipeline: a forward needs the previous stage's forward, a backward
    # the next stage's backward; sends never block. Every stage must finish.
    done, at = set(), [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            if at[s] == len(orders[s]):
                continue
            op, j = orders[s][at[s]]
            need = (("F", j, s - 1) if op == "F" and s > 0 else
                    ("B", j, s + 1) if op == "B" and s < pp - 1 else None)
            if need is None or need in done:
                done.add((op, j, s))
                at[s] += 1
                progressed = True
    assert at == [2 * m] * pp, f"{kind} deadlocks at {at}"


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
        assert {c.scheme for c in cases} == {"megatron", "optimus", "summa25"}
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
    assert np.all([s.reason for s in skips])
