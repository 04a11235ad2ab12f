"""The dev set: the model against published measurements of GPU clusters.

``devset.json`` (package data) lists published numbers with their sources:
NCCL-tests bus bandwidths on DGX-class systems, per-iteration times and
weak-scaling efficiencies of Megatron-LM's 1D tensor parallelism, and the FLOP/s of
Megatron-LM's compositions of tensor, pipeline and data parallelism. Each point is
priced with the presets (no fitting: the presets come from datasheets and
microbenchmarks) and its relative error reported. Points that need parallelism the
model cannot price yet are listed as pending; points whose
number a preset was derived from (``used_in_preset``) are reported but left out of
the error summary.

Kinds of points
---------------
``nccl_busbw``       NCCL-tests' bus bandwidth of ``op`` over ``ranks`` ranks (row-major,
                     ``devices_per_node`` per node) for ``nbytes`` (NCCL-tests' size):
                     ``busBw = size / T x factor`` (:func:`~summasim.costmodel.collectives.nccl.bus_factor`)
``step_time``        seconds of one training step
                     (:func:`~summasim.costmodel.workload.step.step_breakdown`)
``weak_efficiency``  (model flops / (p T)) of the point over the same of its ``baseline``
``composition_throughput``
                     FLOP/s of a data x pipeline x tensor composition
                     (:func:`~summasim.costmodel.workload.composition.price_composition`): the
                     publication's own FLOP count of one step (``throughput.flops``,
                     one of :data:`FLOP_FORMULAS`) over the predicted step time, per
                     device or aggregate (``throughput.per_device``), in units of
                     ``throughput.scale`` FLOP/s. ``composition`` gives ``dp``, ``pp``,
                     ``microbatches``, ``global_batch``, ``devices`` and optionally
                     ``zero``, ``schedule``; a composition that cannot exist is a
                     ``ValueError`` (:func:`~summasim.costmodel.workload.tensor.check_composition`)
``pending``          not priced yet (``needs`` says why)

``python -m summasim.costmodel devset`` prints the table; the test
``tests/test_costmodel_devset.py`` prints it too and checks every priced point is
finite and positive.
"""

from __future__ import annotations

import json
import math
from importlib import resources

from summasim.costmodel.workload.mesh import model_flops
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.machine import load_preset
from summasim.costmodel.collectives.nccl import predicted_bus_bandwidth
from summasim.costmodel.workload.scheme import TransformerConfig
from summasim.costmodel.workload.step import step_breakdown
from summasim.costmodel.machine.topology import GridShape, Topology, group_path

KINDS = ("nccl_busbw", "step_time", "weak_efficiency", "composition_throughput", "pending")
_COMPOSITION_KEYS = ("dp", "pp", "microbatches", "global_batch", "devices")


def flops_narayanan2021(cfg: TransformerConfig, global_batch: int) -> float:
    """FLOPs of one training step as Narayanan et al. 2021 count them (their eq. 3):
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``, forward, backward and the recomputed
    forward of activation checkpointing (4 passes of the layers' GEMMs, 3 of the
    logit GEMM). It assumes the MLP is 4h wide."""
    if cfg.ffn != 4:
        raise ValueError(f"Narayanan et al.'s FLOP count assumes ffn = 4, got {cfg.ffn!r}")
    B, s, h, v, N = global_batch, cfg.s, cfg.h, cfg.v, cfg.N
    return 96.0 * B * s * N * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * N * h))


#: The FLOP counts a publication may report throughput with: ``narayanan2021_eq3``
#: (with recomputation) and ``model`` (:func:`~summasim.costmodel.workload.mesh.model_flops`:
#: forward and backward only).
FLOP_FORMULAS = {"narayanan2021_eq3": flops_narayanan2021, "model": model_flops}


def load_points() -> list[dict]:
    """The points of ``devset.json``."""
    text = resources.files("summasim.costmodel.tools").joinpath("devset.json").read_text("utf-8")
    doc = json.loads(text)
    for p in doc["points"]:
        if p.get("kind") not in KINDS:
            raise ValueError(f"devset point {p.get('id')!r}: unknown kind {p.get('kind')!r}")
        if not p.get("source"):
            raise ValueError(f"devset point {p.get('id')!r} has no source")
        if p["kind"] == "composition_throughput":
            _check_composition_point(p)
    return doc["points"]


def _check_composition_point(point: dict) -> None:
    """ValueError naming what a ``composition_throughput`` point lacks."""
    pid = point.get("id")
    comp = point.get("composition")
    if not isinstance(comp, dict):
        raise ValueError(f"devset point {pid!r}: 'composition' must be an object")
    missing = [k for k in _COMPOSITION_KEYS if k not in comp]
    if missing:
        raise ValueError(f"devset point {pid!r}: composition lacks {', '.join(missing)}")
    thr = point.get("throughput")
    if not isinstance(thr, dict) or thr.get("flops") not in FLOP_FORMULAS \
            or not isinstance(thr.get("per_device"), bool) \
            or not isinstance(thr.get("scale"), (int, float)) or thr["scale"] <= 0:
        raise ValueError(f"devset point {pid!r}: 'throughput' must be {{flops: one of "
                         f"{', '.join(FLOP_FORMULAS)}, per_device: bool, scale: > 0}}")


def _machine(point):
    m = load_preset(point["machine"])
    over = (point.get("overrides") or {}).get("topology")
    if over:
        m = m.replace(topology=Topology(**{**m.topology.to_dict(), **over}))
    return m


def _step(machine, spec):
    from .predict import parse_grid

    sch = parse_grid(spec["scheme"], spec["grid"])
    cfg = TransformerConfig(**spec["model"])
    return step_breakdown(sch, cfg, machine)


def price_point_composition(point: dict, machine=None) -> dict:
    """:func:`~summasim.costmodel.workload.composition.price_composition` of a
    ``composition_throughput`` point (its machine unless ``machine`` is given);
    ValueError for a composition that cannot exist."""
    from .predict import parse_grid

    _check_composition_point(point)
    machine = _machine(point) if machine is None else machine
    comp = point["composition"]
    cfg = TransformerConfig(**point["model"])
    return price_composition(cfg, parse_grid(point["scheme"], point["grid"]), machine=machine,
                             dp=comp["dp"], pp=comp["pp"], microbatches=comp["microbatches"],
                             global_batch=comp["global_batch"], zero=comp.get("zero", 0),
                             schedule=comp.get("schedule", "1f1b"),
                             checkpoint=cfg.checkpoint, devices=comp["devices"])


def composition_throughput(point: dict, result: dict) -> float:
    """The point's throughput from a :func:`price_point_composition` result: the
    publication's FLOPs of one step over the predicted step seconds, per device or
    aggregate, in units of ``throughput.scale`` FLOP/s."""
    thr = point["throughput"]
    cfg = TransformerConfig(**point["model"])
    flops = FLOP_FORMULAS[thr["flops"]](cfg, point["composition"]["global_batch"])
    rate = flops / result["step_seconds"]
    if thr["per_device"]:
        rate /= result["composition"]["devices"]
    return rate / thr["scale"]


def predict_point(point: dict) -> float | None:
    """The model's value for ``point`` in the point's unit (None for pending points)."""
    kind = point["kind"]
    if kind == "pending":
        return None
    machine = _machine(point)
    if kind == "composition_throughput":
        return composition_throughput(point, price_point_composition(point, machine))
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
