"""Every preset predicts exactly what it predicted before the cost model was rearranged.

``tests/data/preset_predictions.json`` was written by
``tests/data/make_frozen_predictions.py`` from the cost model as it was before it was
arranged by concept (machine/, collectives/, compute/, workload/). Each case (a
collective, MPICH or NCCL; an algorithm; a scheme's cost, memory and largest batch; a
training step and its breakdown; a composition of data, pipeline and tensor
parallelism with ZeRO; a dev-set point) is recomputed on the preset's machine as it
was then (stored in the file) and compared for EXACT equality: the rearrangement
moves code, it does not change one float.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter

import pytest

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
        got = maker.evaluate(args, machine)
        if json.dumps(got, sort_keys=True) != json.dumps(want, sort_keys=True):
            bad.append((args, got, want))
    assert n > 0
    assert not bad, f"{len(bad)} of {n} cases changed, first: {bad[0]}"
