"""The dev set: published GPU-cluster measurements against the model.

Prints the table (published, predicted, error per point; MAPE). What it asserts is
what is honest to assert of a dev set: every point has a source, every priced point
is predicted finite and positive and has an error, pending points say what they
need, and none comes from the held-out papers (Optimus, SUMMA2.5-LM).
"""

from __future__ import annotations

import copy
import math

import pytest

from summasim.costmodel.tools import devset
from summasim.costmodel.workload.mesh import model_flops
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.machine import load_preset
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig


def test_devset_table(capsys):
    points = devset.load_points()
    rows = devset.evaluate_all(points)
    with capsys.disabled():
        print("\n" + devset.format_table(rows))
    assert len(rows) == len(points) >= 6
    kinds = {r["kind"] for r in rows}
    assert {"nccl_busbw", "step_time", "weak_efficiency", "composition_throughput"} <= kinds
    for p, r in zip(points, rows):
        assert len(p["source"]) > 40
        assert "optimus" not in p["source"].lower() and "summa" not in p["source"].lower()
        if p["kind"] == "pending":
            assert r["predicted"] is None and r["error"] is None and p.get("needs")
            continue
        assert math.isfinite(r["predicted"]) and r["predicted"] > 0, r
        assert r["error"] == r["predicted"] / r["published"] - 1.0
    s = devset.summary(rows)
    assert s["points"] == sum(1 for r in rows if r["error"] is not None
                              and not r["used_in_preset"])
    assert math.isfinite(s["mape"]) and s["worst"] >= s["mape"] >= 0


def test_devset_cli_writes_json(tmp_path, capsys):
    import json

    from summasim.costmodel.__main__ import main

    path = tmp_path / "dev.json"
    assert main(["devset", "--json", str(path)]) == 0
    assert "MAPE" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert len(doc["points"]) == len(devset.load_points()) and "mape" in doc["summary"]


def _composition_points():
    return [p for p in devset.load_points() if p["kind"] == "composition_throughput"]


def test_composition_kind_prices_as_price_composition_does():
    """One point priced by hand: price_composition on its preset, then the paper's
    eq. 3 FLOPs over the step, per GPU, in TFLOP/s."""
    point = next(p for p in _composition_points() if p["composition"]["pp"] > 1)
    m, c = point["model"], point["composition"]
    cfg = TransformerConfig(b=m["b"], s=m["s"], h=m["h"], n=m["n"], N=m["N"], v=m["v"],
                            dtype=m["dtype"], checkpoint=m["checkpoint"], dropout=m["dropout"])
    res = price_composition(cfg, Scheme.make("megatron", p=int(point["grid"])),
                            machine=load_preset(point["machine"]), dp=c["dp"], pp=c["pp"],
                            microbatches=c["microbatches"], global_batch=c["global_batch"],
                            zero=c["zero"], schedule=c["schedule"], checkpoint=True,
                            devices=c["devices"])
    B, s, h, N, v = c["global_batch"], m["s"], m["h"], m["N"], m["v"]
    eq3 = 96 * B * s * N * h * h * (1 + s / (6 * h) + v / (16 * N * h))
    by_hand = eq3 / res["step_seconds"] / c["devices"] / 1e12
    assert devset.predict_point(point) == pytest.approx(by_hand, rel=1e-12)
    assert c["dp"] * c["pp"] * int(point["grid"]) == c["devices"]


def test_eq3_is_the_model_flops_plus_the_recomputed_forward():
    """Narayanan et al.'s eq. 3 counts the layers' forward once more than the model
    flops (compose.model_flops): 24 B s l h^2 (1 + s / (6 h))."""
    cfg = TransformerConfig(b=1, s=2048, h=12288, n=96, N=80, v=51200)
    B = 2304
    extra = 24 * B * 2048 * 80 * 12288 ** 2 * (1 + 2048 / (6 * 12288))
    assert devset.flops_narayanan2021(cfg, B) - model_flops(cfg, B) == pytest.approx(
        extra, rel=1e-12)
    with pytest.raises(ValueError, match="ffn"):
        devset.flops_narayanan2021(cfg.replace(ffn=3), B)


@pytest.mark.parametrize("change, needle", [
    ({"dp": 7}, "is not the"),                         # dp pp t != the published GPUs
    ({"pp": 1024, "dp": 1, "devices": 8192}, "do not split into pp = 1024"),  # > layers
    ({"microbatches": 5}, "not divisible by dp"),      # B / (dp m) not whole
])
def test_composition_kind_refuses_a_composition_that_cannot_exist(change, needle):
    point = copy.deepcopy(_composition_points()[-1])
    point["composition"].update(change)
    with pytest.raises(ValueError, match=needle):
        devset.predict_point(point)


def test_composition_point_without_its_fields_is_refused():
    point = copy.deepcopy(_composition_points()[0])
    del point["composition"]["devices"]
    with pytest.raises(ValueError, match="devices"):
        devset.predict_point(point)
    point = copy.deepcopy(_composition_points()[0])
    point["throughput"]["flops"] = "guess"
    with pytest.raises(ValueError, match="throughput"):
        devset.predict_point(point)
