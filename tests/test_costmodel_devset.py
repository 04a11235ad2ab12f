"""The dev set: published GPU-cluster measurements against the model.

Prints the table (published, predicted, error per point; MAPE). What it asserts is
what is honest to assert of a dev set: every point has a source, every priced point
is predicted finite and positive and has an error, pending points say what they
need, every point names its source_key, framework and GPU, the dev set is large and
varied enough (>= 40 scored points, >= 4 GPUs, >= 3 frameworks), and none comes from the
held-out publications (docs/devset.md).
"""

from __future__ import annotations

import copy
import json
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
        assert "optimus" not in p["source"].lower() and "summa2.5" not in p["source"].lower()
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


#: Strings naming the held-out publications; none may appear anywhere in devset.json.
HELD_OUT = ("Optimus", "Tesseract", "SUMMA2.5", "MT-NLG", "NeoX", "BLOOM", "Llama 3 herd",
            "llm-foundry")


def _devset_text():
    from importlib import resources

    return resources.files("summasim.costmodel.tools").joinpath("devset.json").read_text("utf-8")


def test_held_out_sources_appear_nowhere():
    text = _devset_text().lower()
    found = [h for h in HELD_OUT if h.lower() in text]
    assert not found, f"held-out publications named in devset.json: {found}"
    # Narayanan et al. 2021's Table 2 (PTD-P vs ZeRO-3) is held out: no point of that
    # paper may take anything from it (its Table 1 compositions' micro-batches come from
    # the authors' Table 1 script instead)
    assert "ptd-p" not in text
    for p in devset.load_points():
        if p.get("source_key") == "narayanan2021":
            said = " ".join(str(p.get(k, "")) for k in ("note", "source", "needs"))
            assert "Table 2" not in said and "ZeRO-3" not in said, p["id"]


def test_every_point_has_its_fields():
    for p in devset.load_points():
        for field in ("source", "source_key", "framework", "unit", "gpu"):
            assert isinstance(p.get(field), str) and p[field].strip(), (p["id"], field)
        assert len(p["source"]) > 40, p["id"]
        assert " " not in p["source_key"] and len(p["source_key"]) <= 32, p["id"]
        assert float(p["published"]) > 0 and math.isfinite(float(p["published"])), p["id"]
        if p["kind"] == "pending":
            assert len(p["needs"]) > 10, p["id"]
        else:
            assert p.get("note"), p["id"]
    ids = [p["id"] for p in devset.load_points()]
    assert len(ids) == len(set(ids))


def test_frozen_points_keep_their_numbers():
    """The twelve points of the first dev set keep their ids and published numbers."""
    frozen = {"nccl-a100-8gpu-allreduce-1GiB": 200.0, "nccl-a100-3node-4nic-allreduce-128MiB": 96.0,
              "nccl-h100-8gpu-ring-allreduce": 370.0, "nccl-h100-8gpu-nvls-allreduce": 480.0,
              "megatron-v1-1.2B-1gpu-iteration": 1.288, "megatron-v1-4.2B-4gpu-iteration": 1.357,
              "megatron-8.3B-8gpu-weak-scaling": 0.77, "megatron-8.3B-512gpu-throughput": 15.1,
              "megatron-18.4B-256gpu-t8-d32": 135.0, "megatron-39.1B-512gpu-t8-p2-d32": 138.0,
              "megatron-145.6B-1536gpu-t8-p8-d24": 148.0, "megatron-1T-3072gpu-t8-p64-d6": 163.0}
    points = {p["id"]: p for p in devset.load_points()}
    assert {k: points[k]["published"] for k in frozen} == frozen


def test_devset_is_large_and_varied():
    rows = devset.evaluate_all()
    scored = [r for r in rows if r["error"] is not None and not r["used_in_preset"]]
    assert len(scored) >= 40
    assert len({r["gpu"] for r in scored}) >= 4
    assert len({r["framework"] for r in scored}) >= 3
    assert len({r["source_key"] for r in scored}) >= 8
    for r in scored:
        assert math.isfinite(r["predicted"]) and r["predicted"] > 0, r["id"]


def test_point_without_source_key_is_refused(monkeypatch):
    points = copy.deepcopy(devset.load_points())
    del points[0]["source_key"]
    text = json.dumps({"format": "summasim.devset/1", "points": points})

    class _Res:
        def joinpath(self, name):
            return self

        def read_text(self, enc):
            return text

    monkeypatch.setattr(devset.resources, "files", lambda pkg: _Res())
    with pytest.raises(ValueError, match="source_key"):
        devset.load_points()


def _tokens_point():
    return next(p for p in devset.load_points() if p["kind"] == "composition_tokens")


def test_tokens_kind_is_tokens_over_step_over_devices():
    point = _tokens_point()
    res = devset.price_point_composition(point)
    c = point["composition"]
    by_hand = c["global_batch"] * point["model"]["s"] / res["step_seconds"] / c["devices"]
    assert devset.predict_point(point) == pytest.approx(by_hand, rel=1e-12)
    assert res["composition"]["devices"] == c["devices"]


def test_mfu_kind_is_model_flops_over_step_over_the_publications_peak():
    """An MFU point made from a tokens point: MFU x peak x devices = model flops / step,
    and predicted / published MFU = published / predicted step time."""
    point = copy.deepcopy(_tokens_point())
    point["kind"], point["unit"] = "mfu", "MFU (fraction)"
    point["mfu"] = {"flops": "model", "peak_tflops": 312.0, "scale": 1.0}
    res = devset.price_point_composition(point)
    cfg = TransformerConfig(**point["model"])
    c = point["composition"]
    mfu = devset.predict_point(point)
    assert mfu * 312e12 * c["devices"] * res["step_seconds"] == pytest.approx(
        model_flops(cfg, c["global_batch"]), rel=1e-12)
    point["mfu"]["scale"] = 0.01                      # percent
    assert devset.predict_point(point) == pytest.approx(100 * mfu, rel=1e-12)
    del point["mfu"]["peak_tflops"]
    with pytest.raises(ValueError, match="mfu"):
        devset.predict_point(point)


def test_step_time_kind_is_the_composition_step_and_uses_its_recompute():
    """Korthikanti's selective + sequence-parallel column is priced as such: faster than
    the full-recompute column of the same row, as Table 5 says."""
    points = {p["id"]: p for p in devset.load_points()}
    sel, full = points["kor22-175b-selective-sp"], points["kor22-175b-fullrecompute"]
    assert sel["composition"]["schedule"] == "interleaved" and sel["composition"]["chunks"] == 3
    assert devset.predict_point(sel) == devset.price_point_composition(sel)["step_seconds"]
    assert devset.predict_point(sel) < devset.predict_point(full)
    none = copy.deepcopy(sel)
    none["model"]["recompute"] = "none"
    assert devset.predict_point(none) < devset.predict_point(sel)


def test_layer_time_is_one_layer_without_vocabulary():
    point = next(p for p in devset.load_points() if p["kind"] == "layer_time")
    one = devset.layer_seconds(point)
    two = copy.deepcopy(point)
    two["model"]["N"] = 2                             # ignored: always one layer
    assert devset.layer_seconds(two) == one
    assert devset.predict_point(point) == pytest.approx(one / point["layer"]["scale"])


def test_markdown_table_lists_every_point():
    rows = devset.evaluate_all()
    md = devset.markdown_table(rows)
    for r in rows:
        assert f"`{r['id']}`" in md
    assert "MAPE" in md and "coverage" in md


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
    point = copy.deepcopy(next(p for p in _composition_points()
                               if p["id"] == "megatron-1T-3072gpu-t8-p64-d6"))
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
