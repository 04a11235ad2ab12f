"""The local machine predicts exactly what it predicted before issue 10.

``tests/data/local_predictions.json`` was written by
``tests/data/make_local_predictions.py`` from the cost model as it was before the
GPU-cluster model (topology, NCCL collectives, roofline compute) was added. The
preset ``local-2core-mpich`` (library MPICH, one shared-memory node) must take the
old code path: every collective, algorithm, scheme layer, training step,
shared-core feature, memory figure and largest batch here is compared for EXACT
equality: the path is meant to be the same arithmetic, so floats may differ only in
their last bits, where Python 3.12's compensated ``sum`` differs from 3.11's
(``conftest.frozen_same``, 1e-12 relative).

The machine is ``tests/data/local-2core-mpich-frozen.json``, the preset as it was when
the numbers were frozen (2026-11-23 calibration): the preset itself is recalibrated
when the local machine changes, and the frozen numbers pin the code path, not one
day's calibration.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import frozen_same
from summasim.costmodel import collectives as C
from summasim.costmodel.machine import Machine, load_preset
from summasim.costmodel.workload.footprint import largest_batch, memory
from summasim.costmodel.workload.layer import scheme_cost
from summasim.costmodel.workload.predict import (predict_algorithm, predict_features,
                                                 predict_trace, trace_features)
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
from summasim.costmodel.workload.step import model_messages, step_cost, step_work

DATA = os.path.join(os.path.dirname(__file__), "data", "local_predictions.json")
MACHINE = os.path.join(os.path.dirname(__file__), "data", "local-2core-mpich-frozen.json")

with open(DATA, encoding="utf-8") as _fh:
    FROZEN = json.load(_fh)


@pytest.fixture(scope="module")
def local():
    machine = Machine.load(MACHINE)
    assert machine.name == FROZEN["preset"]
    return machine


def test_frozen_file_covers_a_few_dozen_configurations():
    assert len(FROZEN["collectives"]) >= 100
    assert len(FROZEN["algorithms"]) >= 30
    assert len(FROZEN["schemes"]) >= 20


def test_local_preset_names_mpich_on_shared_memory(local):
    for machine in (local, load_preset(FROZEN["preset"])):
        assert machine.library == "mpich"
        assert machine.topology is None or machine.topology.intra_kind == "shm"


def test_collectives_unchanged(local):
    bad = []
    for case in FROZEN["collectives"]:
        cost = C.collective_time(case["op"], case["nbytes"], case["p"], local,
                                 reduce_impl=case["reduce_impl"])
        if not frozen_same((cost.seconds, cost.algorithm), (case["seconds"], case["algorithm"])):
            bad.append((case, cost))
    assert not bad, f"{len(bad)} collectives changed, first: {bad[0]}"


def test_algorithms_unchanged(local):
    bad = []
    for case in FROZEN["algorithms"]:
        kw = dict(machine=local, dtype=case["dtype"], overlap=case["overlap"],
                  reduce_impl="tree")
        if "ranks_per_node" in case:
            kw["ranks_per_node"] = case["ranks_per_node"]
        if case["name"] == "ring_allreduce":
            pr = predict_algorithm("ring_allreduce", count=case["count"], p=case["p"], **kw)
        else:
            pr = predict_algorithm(case["name"], case["m"], case["k"], case["n"], case["q"],
                                   case["d"], **kw)
        got = [pr.seconds, pr.comm_seconds, pr.compute_seconds, pr.slowdown]
        want = [case["seconds"], case["comm"], case["compute"], case["slowdown"]]
        if not frozen_same(got, want):
            bad.append((case["name"], case.get("q"), case.get("d"), got, want))
    assert not bad, f"{len(bad)} algorithm predictions changed, first: {bad[0]}"


@pytest.mark.parametrize("idx", range(len(FROZEN["schemes"])))
def test_schemes_and_steps_unchanged(local, idx):
    case = FROZEN["schemes"][idx]
    sch = Scheme.make(case["scheme"], **case["grid"])
    cfg = TransformerConfig(**case["cfg"])
    for ck in (False, True):
        sc = scheme_cost(sch, cfg, local, checkpoint=ck, include_minor=ck)
        assert frozen_same([sc.step_seconds, sc.step_comm_seconds, sc.step_compute_seconds,
                            sc.memory.total], case[f"scheme_cost_ck{int(ck)}"]), (sch.label, ck)
    assert frozen_same(memory(sch, cfg).total, case["memory"])
    assert largest_batch(sch, cfg, local.memory_bytes) == case["largest_batch"]
    if "step_cost" not in case:
        return
    st = step_cost(sch, cfg, local, reduce_impl="tree")
    assert frozen_same([st.seconds, st.comm_seconds, st.compute_seconds, st.slowdown],
                       case["step_cost"])
    w = step_work(sch, cfg)
    feats = [trace_features(model_messages(sch, cfg, row0=r0), local, p=sch.p, q=sch.q,
                            d=sch.d, gemms=w.gemms, reduce_bytes=w.reduce_bytes,
                            elementwise_items=w.elementwise_items, layers=w.layers,
                            dtype=cfg.dtype, reduce_impl="tree") for r0 in (True, False)]
    assert frozen_same([[f.work, f.hops, f.hop_bytes, f.dedicated, f.calls] for f in feats],
                       case["features"])
    assert frozen_same(predict_features(feats, local, local.ranks_per_node(sch.p)),
                       case["predict_features"])
    tr = predict_trace(model_messages(sch, cfg), local, p=sch.p, q=sch.q, d=sch.d,
                       gemms=w.gemms, dtype=cfg.dtype, ranks_per_node=1, reduce_impl="tree")
    assert frozen_same([tr.seconds, tr.comm_seconds, tr.compute_seconds],
                       case["predict_trace_dedicated"])


def test_frozen_numbers_may_move_in_their_last_bits_only():
    """Python 3.12's compensated ``sum`` moves a float by an ulp or two; a mechanism's
    change moves it by far more, and ints, strings and shapes must match exactly."""
    assert sum([0.1] * 10) in (1.0, 0.9999999999999999)
    assert frozen_same([0.04023481641814105, "ring", 3], [0.04023481641814104, "ring", 3])
    assert not frozen_same([0.0402348164, "ring"], [0.0402348165, "ring"])
    assert not frozen_same([1.0, "ring"], [1.0, "tree"]) and not frozen_same([1.0], [1.0, 2.0])
    assert not frozen_same({"a": 1}, {"a": 1, "b": 2}) and not frozen_same(3, 4)
