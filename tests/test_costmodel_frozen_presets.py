"""Every preset predicts exactly what it predicted before the cost model was rearranged.

``tests/data/preset_predictions.json`` was written by
``tests/data/make_frozen_predictions.py`` from the cost model as it was before it was
arranged by concept (machine/, collectives/, compute/, workload/). Each case (a
collective, MPICH or NCCL; an algorithm; a scheme's cost, memory and largest batch; a
training step and its breakdown; a composition of data, pipeline and tensor
parallelism with ZeRO; a dev-set point) is recomputed on the preset's machine as it
was then (stored in the file) and compared for EXACT equality: the rearrangement
moves code, it does not change one float. Keys added since (the techniques of issue 30:
``recompute``, ``attention``, ``sequence_parallel``, the block's ``mlp``, ``kv_heads``,
``tied``; the schedule's ``chunks``, ``stages``) are new fields beside the frozen ones:
every frozen key must still be there with its exact value (:func:`_frozen_part`).

One change is by design, and checked to the byte: a model with dropout (the Megatron
dev-set points, dropout 0.1) now also holds the dropped attention probabilities that
attention over V reads in backward, ``b n s^2 / t`` items of the one layer a full
recompute holds (Korthikanti et al. 2022, Table 2: ``5 a s^2 b`` is the softmax output
2, the mask 1 and the dropout output 2; the cost model had counted 3). In those cases
the activations and totals, and nothing else, move by exactly that
(:func:`_dropout_output_delta`).

A second is a dev-set change (issue 29): the points whose publication says the gradient
all-reduce ran after the backward (Megatron-LM's 2019 code; Korthikanti et al.'s 2240-GPU
run) now say ``grad_overlap: false``. Such a point must reproduce its frozen values
exactly when priced with the overlap back on (:func:`_with_overlap`), and without it its
exposed data-parallel time can only grow (:func:`test_grad_overlap_points_moved_only_by_it`).

A third is a dev-set change too: Narayanan et al. 2021's Table 1 points take their
micro-batches and interleaving from the authors' Table 1 script
(``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM) instead of a micro-batch of 1,
which had come from that paper's held-out Table 2. Such a point must reproduce its
frozen values exactly when priced with its frozen micro-batches and plain 1F1B
(:func:`_with_frozen_schedule`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter

import pytest

from conftest import frozen_same

HERE = os.path.join(os.path.dirname(__file__), "data")
_spec = importlib.util.spec_from_file_location(
    "make_frozen_predictions", os.path.join(HERE, "make_frozen_predictions.py"))
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)

with open(maker.PATH, encoding="utf-8") as _fh:
    FROZEN = json.load(_fh)


def test_frozen_file_covers_every_preset_and_kind():
    per = Counter(c["preset"] for c in FROZEN["cases"])
    assert set(per) == set(maker.PRESETS)
    assert min(per.values()) >= 300
    kinds = Counter(c["kind"] for c in FROZEN["cases"])
    for kind in ("collective", "nccl", "nccl_grid", "algorithm", "scheme", "step",
                 "composition", "mesh_case", "devset"):
        assert kinds[kind] > 0, kind
    deep = [c for c in FROZEN["cases"] if c.get("scheme") == "summa25"
            and c["grid"]["d"] > c["grid"]["q"]]
    assert {c["kind"] for c in deep} >= {"scheme", "step", "composition"}


def _frozen_part(got, want):
    """``got`` restricted to the keys ``want`` has (recursively): a frozen key that is
    missing is kept missing, so the comparison fails on it."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: _frozen_part(got[k], w) for k, w in want.items() if k in got}
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [_frozen_part(g, w) for g, w in zip(got, want)]
    return got


def test_frozen_part_keeps_only_frozen_keys_and_catches_changes():
    want = {"a": 1.5, "b": {"c": [1, {"d": 2}]}}
    assert _frozen_part({"a": 1.5, "b": {"c": [1, {"d": 2, "new": 3}]}, "x": 0}, want) == want
    assert _frozen_part({"a": 1.5000001, "b": {"c": [1, {"d": 2}]}}, want) != want
    assert _frozen_part({"b": {"c": [1, {"d": 2}]}}, want) != want      # a key lost


def _leaves(x, path=""):
    """``{path: value}`` of every number or string in a JSON-plain value."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _leaves(val, f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in _leaves(val, f"{path}[{i}]").items()}
    return {path: x}


def _dropout_output_delta(case: dict, got: dict, path: str) -> float | None:
    """Bytes a frozen dev-set case with dropout gains at ``path`` (a memory field): the
    dropped attention probabilities of one layer, ``b n s^2 / t`` items (None: no such
    case)."""
    if case["kind"] != "devset":
        return None
    from summasim.costmodel.machine import itemsize_of
    from summasim.costmodel.tools import devset

    point = next(p for p in devset.load_points() if p["id"] == case["id"])
    model = point["model"] if "/baseline/" not in path else point["baseline"]["model"]
    if not model.get("dropout") or not model.get("checkpoint", True):
        return None
    if point["kind"] == "composition_throughput":
        b, t = got["composition"]["micro_batch"], got["composition"]["t"]
    else:
        part = got["baseline" if "/baseline/" in path else "step"]
        b, t = part["config"]["b"], part["p"]
    return b * model["n"] * model["s"] ** 2 / t * itemsize_of(model["dtype"])


def _changes(case, got, want) -> list:
    """The leaves of ``want`` that ``got`` does not reproduce, less those that moved by
    exactly :func:`_dropout_output_delta`."""
    g, w = _leaves(got), _leaves(want)
    bad = []
    for path, val in w.items():
        if frozen_same(g.get(path), val) and type(g.get(path)) is type(val):
            continue
        delta = (_dropout_output_delta(case, got, path)
                 if path.endswith(("memory/activations", "memory/total")) else None)
        if delta is None or not frozen_same(g.get(path), val + delta):
            bad.append((path, g.get(path), val))
    return bad


def _no_overlap_point(case: dict):
    """The dev-set point of a frozen case that says ``grad_overlap: false`` (else None)."""
    if case["kind"] != "devset":
        return None
    from summasim.costmodel.tools import devset

    point = next(p for p in devset.load_points() if p["id"] == case["id"])
    comp = point.get("composition") or {}
    return point if comp.get("grad_overlap", True) is False else None


def _with_overlap(case: dict, machine):
    """A ``grad_overlap: false`` case priced as frozen: its point with the overlap on."""
    from summasim.costmodel.tools import devset

    point = _no_overlap_point(case)
    point = {**point, "composition": {**point["composition"], "grad_overlap": True}}
    return maker._plain(devset.price_point_composition(point, maker._dev_machine(point, machine)))


def _script_point(case: dict):
    """The dev-set point of a frozen case whose composition now comes from the authors'
    Table 1 script (else None)."""
    if case["kind"] != "devset":
        return None
    from summasim.costmodel.tools import devset

    point = next(p for p in devset.load_points() if p["id"] == case["id"])
    return point if "run_table_1.sh" in point.get("note", "") else None


def _with_frozen_schedule(case: dict, machine):
    """A Table 1 case priced as frozen: its point with the frozen micro-batch count and
    the plain 1F1B schedule."""
    from summasim.costmodel.tools import devset

    point = _script_point(case)
    comp = {k: v for k, v in point["composition"].items() if k != "chunks"}
    comp.update(microbatches=case["want"]["composition"]["microbatches"], schedule="1f1b")
    point = {**point, "composition": comp}
    return maker._plain(devset.price_point_composition(point, maker._dev_machine(point, machine)))


def test_the_table_1_points_are_the_script_s_compositions():
    """Every frozen Narayanan Table 1 point now names the script, and its micro-batch
    count changed where the script's micro-batch is not 1 (the 1T run's is)."""
    moved = 0
    for case in FROZEN["cases"]:
        point = _script_point(case)
        if point is None:
            continue
        frozen = case["want"]["composition"]["microbatches"]
        moved += point["composition"]["microbatches"] != frozen
        assert point["composition"]["global_batch"] == case["want"]["composition"]["global_batch"]
    assert moved == 3                         # 18.4B, 39.1B and 145.6B (the 1T is m = 512)


@pytest.mark.parametrize("preset", maker.PRESETS)
def test_grad_overlap_points_moved_only_by_it(preset):
    machine = maker.machine_of(FROZEN["machines"], preset)
    for case in FROZEN["cases"]:
        if case["preset"] != preset or _no_overlap_point(case) is None:
            continue
        want = case["want"]
        assert not _changes(case, _frozen_part(_with_overlap(case, machine), want), want)
        args = {k: v for k, v in case.items() if k != "want"}
        now = maker.evaluate(args, machine)
        assert now["breakdown"]["exposed_comm"]["dp"] >= want["breakdown"]["exposed_comm"]["dp"]
        assert now["step_seconds"] >= want["step_seconds"]


@pytest.mark.parametrize("preset", maker.PRESETS)
def test_preset_predictions_unchanged(preset):
    machine = maker.machine_of(FROZEN["machines"], preset)
    bad = []
    n = 0
    for case in FROZEN["cases"]:
        if case["preset"] != preset:
            continue
        n += 1
        want = case["want"]
        args = {k: v for k, v in case.items() if k != "want"}
        if _no_overlap_point(case) is not None:       # checked by the test above
            got = _frozen_part(_with_overlap(case, machine), want)
        elif _script_point(case) is not None:         # priced with its frozen schedule
            got = _frozen_part(_with_frozen_schedule(case, machine), want)
        else:
            got = _frozen_part(maker.evaluate(args, machine), want)
        if json.dumps(got, sort_keys=True) != json.dumps(want, sort_keys=True):
            changes = _changes(case, got, want)
            if changes:
                bad.append((args, changes[:4]))
    assert n > 0
    assert not bad, f"{len(bad)} of {n} cases changed, first: {bad[0]}"
