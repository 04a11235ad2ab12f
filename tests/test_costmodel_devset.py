"""The dev set: published GPU-cluster measurements against the model.

Prints the table (published, predicted, error per point; MAPE). What it asserts is
what is honest to assert of a dev set: every point has a source, every priced point
is predicted finite and positive and has an error, pending points say what they
need, and none comes from the held-out papers (Optimus, SUMMA2.5-LM).
"""

from __future__ import annotations

import math

from summasim.costmodel import devset


def test_devset_table(capsys):
    points = devset.load_points()
    rows = devset.evaluate_all(points)
    with capsys.disabled():
        print("\n" + devset.format_table(rows))
    assert len(rows) == len(points) >= 6
    kinds = {r["kind"] for r in rows}
    assert {"nccl_busbw", "step_time", "weak_efficiency"} <= kinds
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
