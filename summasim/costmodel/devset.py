"""The dev set: the model against published measurements of GPU clusters.

``devset.json`` (package data) lists published numbers with their sources:
NCCL-tests bus bandwidths on DGX-class systems, and per-iteration times and
weak-scaling efficiencies of Megatron-LM's 1D tensor parallelism. Each point is
priced with the presets (no fitting: the presets come from datasheets and
microbenchmarks) and its relative error reported. Points that need parallelism the
model does not compose yet (data parallelism) are listed as pending; points whose
number a preset was derived from (``used_in_preset``) are reported but left out of
the error summary.

Kinds of points
---------------
``nccl_busbw``       NCCL-tests' bus bandwidth of ``op`` over ``ranks`` ranks (row-major,
                     ``devices_per_node`` per node) for ``nbytes`` (NCCL-tests' size):
                     ``busBw = size / T x factor`` (:func:`~summasim.costmodel.nccl.bus_factor`)
``step_time``        seconds of one training step
                     (:func:`~summasim.costmodel.schemes.step_breakdown`)
``weak_efficiency``  (model flops / (p T)) of the point over the same of its ``baseline``
``pending``          not priced yet (``needs`` says why)

``python -m summasim.costmodel devset`` prints the table; the test
``tests/test_costmodel_devset.py`` prints it too and checks every priced point is
finite and positive.
"""

from __future__ import annotations

import json
import math
from importlib import resources

from .machine import load_preset
from .nccl import predicted_bus_bandwidth
from .schemes import TransformerConfig, step_breakdown
from .topology import GridShape, Topology, group_path

KINDS = ("nccl_busbw", "step_time", "weak_efficiency", "pending")


def load_points() -> list[dict]:
    """The points of ``devset.json``."""
    text = resources.files("summasim.costmodel").joinpath("devset.json").read_text("utf-8")
    doc = json.loads(text)
    for p in doc["points"]:
        if p.get("kind") not in KINDS:
            raise ValueError(f"devset point {p.get('id')!r}: unknown kind {p.get('kind')!r}")
        if not p.get("source"):
            raise ValueError(f"devset point {p.get('id')!r} has no source")
    return doc["points"]


def _machine(point):
    m = load_preset(point["machine"])
    over = (point.get("overrides") or {}).get("topology")
    if over:
        m = m.replace(topology=Topology(**{**m.topology.to_dict(), **over}))
    return m


def _step(machine, spec):
    from .predictcmd import parse_grid

    sch = parse_grid(spec["scheme"], spec["grid"])
    cfg = TransformerConfig(**spec["model"])
    return step_breakdown(sch, cfg, machine)


def predict_point(point: dict) -> float | None:
    """The model's value for ``point`` in the point's unit (None for pending points)."""
    kind = point["kind"]
    if kind == "pending":
        return None
    machine = _machine(point)
    if kind == "nccl_busbw":
        topo = machine.topology
        path = group_path(topo, GridShape.of(point["ranks"]), "world", point["ranks"])
        nbytes = point["nbytes"]
        if point["op"] == "allgather":        # NCCL-tests' size is the gathered total
            nbytes = nbytes / point["ranks"]
        return predicted_bus_bandwidth(point["op"], nbytes, path, ll128=topo.ll128,
                                       algorithm=point.get("algorithm"),
                                       protocol=point.get("protocol")) / 1e9
    if kind == "step_time":
        return _step(machine, point).seconds
    target = _step(machine, point)
    base = _step(machine, point["baseline"])
    per_dev = lambda sb: sb.model_flops / (sb.scheme.p * sb.seconds)  # noqa: E731
    return per_dev(target) / per_dev(base)


def evaluate_all(points: list[dict] | None = None) -> list[dict]:
    """One row per point: ``{id, kind, machine, published, predicted, error, unit,
    used_in_preset, pending}`` (error = predicted / published - 1)."""
    rows = []
    for p in points if points is not None else load_points():
        pred = predict_point(p)
        pub = float(p["published"])
        rows.append({"id": p["id"], "kind": p["kind"], "machine": p.get("machine", "-"),
                     "published": pub, "predicted": pred,
                     "error": None if pred is None else pred / pub - 1.0,
                     "unit": p["unit"], "used_in_preset": bool(p.get("used_in_preset")),
                     "pending": p.get("needs") if pred is None else None,
                     "source": p["source"]})
    return rows


def summary(rows: list[dict]) -> dict:
    """MAPE and worst error over the priced points not used in a preset."""
    errs = [abs(r["error"]) for r in rows if r["error"] is not None
            and not r["used_in_preset"]]
    return {"points": len(errs), "mape": sum(errs) / len(errs) if errs else math.nan,
            "worst": max(errs) if errs else math.nan,
            "pending": sum(1 for r in rows if r["error"] is None)}


def format_table(rows: list[dict]) -> str:
    """The dev-set table as text (one line per point, then the summary)."""
    lines = [f"{'point':<40s} {'machine':<13s} {'published':>10s} {'predicted':>10s} "
             f"{'error':>8s}  unit"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.4g}"
        err = "pending" if r["error"] is None else f"{r['error']:+.1%}"
        tag = " (calibration)" if r["used_in_preset"] else ""
        lines.append(f"{r['id']:<40s} {r['machine']:<13s} {r['published']:>10.4g} {pred:>10s} "
                     f"{err:>8s}  {r['unit']}{tag}")
    s = summary(rows)
    lines.append(f"MAPE {s['mape']:.1%} over {s['points']} points (worst {s['worst']:.1%}); "
                 f"{s['pending']} pending; calibration points excluded")
    return "\n".join(lines)
