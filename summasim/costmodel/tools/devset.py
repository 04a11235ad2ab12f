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
``composition_step_time``
                     seconds of one training iteration of a composition: ``step_seconds`` of
                     :func:`price_point_composition` (same ``composition`` fields; optional
                     ``chunks`` for the interleaved schedule, ``zero3_prefetch``, and
                     ``grad_overlap: false`` where the publication says the gradient
                     reduction ran after the backward, ``p2p_overlap: true`` where its
                     pipeline hand-offs overlap the compute)
``composition_tokens``
                     tokens per second per device of a composition: ``global_batch x s``
                     over the predicted step seconds over ``devices``
``mfu``              model FLOPs utilization of a composition: the publication's FLOPs of one
                     step (``mfu.flops``) over the predicted step seconds, per device, over
                     the publication's own peak (``mfu.peak_tflops``), in units of
                     ``mfu.scale`` (1: a fraction, 0.01: percent)
``layer_time``       forward + backward of one transformer layer: ``step_seconds`` of a
                     one-layer model with no vocabulary (``v = 0``) on the point's tensor
                     grid, one micro-batch, no optimizer step, in units of ``layer.scale`` s
``pending``          not priced yet (``needs`` says what the model lacks)

Every point names its publication twice: ``source`` (the full citation with the quoted
text) and ``source_key`` (a short name, e.g. ``narayanan2021``, ``nccl-tests-149``: the
unit left out together by :func:`summasim.costmodel.tools.intervals.loso_rows`), its
``framework`` and its ``gpu``. :mod:`summasim.costmodel.tools.intervals` turns the errors
into residuals and intervals (``docs/devset.md``).

``python -m summasim.costmodel devset`` prints the table (:func:`format_table`, with each
point's leave-one-source-out interval); :func:`markdown_table` writes it for
``docs/devset.md``. The tests ``tests/test_costmodel_devset.py`` and
``tests/test_costmodel_intervals.py`` check every priced point is finite and positive.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

from summasim.costmodel.workload.mesh import model_flops
from summasim.costmodel.workload.composition import flatten_breakdown, price_composition
from summasim.costmodel.machine import load_preset
from summasim.costmodel.collectives.nccl import predicted_bus_bandwidth
from summasim.costmodel.workload.scheme import TransformerConfig
from summasim.costmodel.workload.step import step_breakdown
from summasim.costmodel.machine.topology import GridShape, Topology, group_path

KINDS = ("nccl_busbw", "step_time", "weak_efficiency", "composition_throughput",
         "composition_step_time", "composition_tokens", "mfu", "layer_time", "pending")
#: The kinds priced by :func:`price_point_composition` (they carry ``composition``).
COMPOSITION_KINDS = ("composition_throughput", "composition_step_time", "composition_tokens",
                     "mfu")
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
    """The points of ``devset.json``; ValueError for a point without a known kind, a
    ``source``, a ``source_key``, a ``framework`` or a ``gpu``, or with a composition
    that lacks its fields."""
    text = resources.files("summasim.costmodel.tools").joinpath("devset.json").read_text("utf-8")
    doc = json.loads(text)
    for p in doc["points"]:
        if p.get("kind") not in KINDS:
            raise ValueError(f"devset point {p.get('id')!r}: unknown kind {p.get('kind')!r}")
        for field in ("source", "source_key", "framework", "gpu"):
            if not p.get(field):
                raise ValueError(f"devset point {p.get('id')!r} has no {field}")
        if p["kind"] in COMPOSITION_KINDS:
            _check_composition_point(p)
    return doc["points"]


def _check_composition_point(point: dict) -> None:
    """ValueError naming what a composition point (:data:`COMPOSITION_KINDS`) lacks."""
    pid = point.get("id")
    comp = point.get("composition")
    if not isinstance(comp, dict):
        raise ValueError(f"devset point {pid!r}: 'composition' must be an object")
    missing = [k for k in _COMPOSITION_KEYS if k not in comp]
    if missing:
        raise ValueError(f"devset point {pid!r}: composition lacks {', '.join(missing)}")
    kind = point.get("kind", "composition_throughput")
    if kind == "composition_throughput":
        thr = point.get("throughput")
        if not isinstance(thr, dict) or thr.get("flops") not in FLOP_FORMULAS \
                or not isinstance(thr.get("per_device"), bool) \
                or not isinstance(thr.get("scale"), (int, float)) or thr["scale"] <= 0:
            raise ValueError(f"devset point {pid!r}: 'throughput' must be {{flops: one of "
                             f"{', '.join(FLOP_FORMULAS)}, per_device: bool, scale: > 0}}")
    if kind == "mfu":
        mfu = point.get("mfu")
        if not isinstance(mfu, dict) or mfu.get("flops") not in FLOP_FORMULAS \
                or not all(isinstance(mfu.get(k), (int, float)) and mfu[k] > 0
                           for k in ("peak_tflops", "scale")):
            raise ValueError(f"devset point {pid!r}: 'mfu' must be {{flops: one of "
                             f"{', '.join(FLOP_FORMULAS)}, peak_tflops: > 0, scale: > 0}}")


def _machine(point):
    m = load_preset(point["machine"])
    over = (point.get("overrides") or {}).get("topology")
    if over:
        m = m.replace(topology=Topology(**{**m.topology.to_dict(), **over}))
    return m


def _step(machine, spec):
    from . import parse_grid

    sch = parse_grid(spec["scheme"], spec["grid"])
    cfg = TransformerConfig(**spec["model"])
    return step_breakdown(sch, cfg, machine)


def price_point_composition(point: dict, machine=None) -> dict:
    """:func:`~summasim.costmodel.workload.composition.price_composition` of a
    composition point (its machine unless ``machine`` is given): the model's
    ``recompute`` (full, selective or none), the composition's ``zero``, ``schedule``,
    ``chunks`` (interleaved), ``zero3_prefetch`` and ``grad_overlap``; ValueError for a composition that
    cannot exist."""
    from . import parse_grid

    _check_composition_point(point)
    machine = _machine(point) if machine is None else machine
    comp = point["composition"]
    cfg = TransformerConfig(**point["model"])
    return price_composition(cfg, parse_grid(point["scheme"], point["grid"]), machine=machine,
                             dp=comp["dp"], pp=comp["pp"], microbatches=comp["microbatches"],
                             global_batch=comp["global_batch"], zero=comp.get("zero", 0),
                             schedule=comp.get("schedule", "1f1b"), chunks=comp.get("chunks", 1),
                             zero3_prefetch=bool(comp.get("zero3_prefetch", False)),
                             grad_overlap=bool(comp.get("grad_overlap", True)),
                             p2p_overlap=bool(comp.get("p2p_overlap", False)),
                             recompute=cfg.recompute, devices=comp["devices"])


def explain_point(point: dict) -> str:
    """A composition point's predicted step as ``predict`` prints it: published against
    predicted, the breakdown (seconds and share of the step) and what bounds it
    (:func:`~summasim.costmodel.tools.explain.what_bounds`). ValueError for a point that
    is not a priced composition."""
    from .explain import what_bounds

    if point.get("kind") not in COMPOSITION_KINDS or point.get("pending"):
        raise ValueError(f"devset point {point.get('id')!r} is not a priced composition "
                         f"(kind {point.get('kind')!r})")
    machine = _machine(point)
    res = price_point_composition(point, machine)
    comp, step = res["composition"], res["step_seconds"]
    pred = predict_point(point)
    lines = [f"{point['id']}: {point.get('framework')}, {point.get('gpu')}, "
             f"{point.get('source_key')}",
             f"  machine {machine.name}; {comp['grid']} x dp {comp['dp']} x pp {comp['pp']}, "
             f"m = {comp['microbatches']} of {comp['micro_batch']}, ZeRO {comp['zero']}, "
             f"{comp['schedule']}{':' + str(comp['chunks']) if comp['chunks'] > 1 else ''}, "
             f"recompute {comp['recompute']}",
             f"  published {point['published']:g}, predicted {pred:.4g} {point['unit']} "
             f"({pred / point['published'] - 1:+.1%})",
             f"  step {step:.4g} s:"]
    bd = flatten_breakdown(res["breakdown"])
    for key, val in bd.items():
        if val > 0:
            lines.append(f"    {key:<16s} {val:10.4g} s  {val / step:6.1%}")
    bound = what_bounds(res, machine)
    lines.append(f"  bound by {bound['why']} ({bound['share']:.0%} of the step)")
    return "\n".join(lines)


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


def composition_tokens(point: dict, result: dict) -> float:
    """Tokens per second per device: the step's ``global_batch x s`` tokens over the
    predicted step seconds over the devices (torchtitan's "TPS/GPU" and "WPS", the
    FSDP blogs' "tokens/s/GPU")."""
    cfg = TransformerConfig(**point["model"])
    tokens = point["composition"]["global_batch"] * cfg.s
    return tokens / result["step_seconds"] / result["composition"]["devices"]


def composition_mfu(point: dict, result: dict) -> float:
    """Model FLOPs utilization (Chowdhery et al. 2022, PaLM, appendix B; Korthikanti et
    al. 2022, eq. 7): the publication's FLOPs of one step (``mfu.flops``) over the
    predicted step seconds over the devices, over the peak the publication divides by
    (``mfu.peak_tflops``, e.g. 312 for an A100's dense 16-bit tensor cores), in units
    of ``mfu.scale``.

    The peak is the publication's, not :meth:`Machine.peak_flops
    <summasim.costmodel.machine.record.Machine.peak_flops>`: the presets' peak is the
    best *achieved* GEMM rate of their gamma table (265 TFLOP/s on ``dgx-a100``), so
    dividing by it would scale every predicted MFU by 312/265 whatever the predicted
    step time. With the publication's peak, predicted / published MFU is exactly
    published / predicted step time."""
    mfu = point["mfu"]
    cfg = TransformerConfig(**point["model"])
    flops = FLOP_FORMULAS[mfu["flops"]](cfg, point["composition"]["global_batch"])
    per_device = flops / result["step_seconds"] / result["composition"]["devices"]
    return per_device / (mfu["peak_tflops"] * 1e12) / mfu["scale"]


def layer_seconds(point: dict, machine=None) -> float:
    """Seconds of the forward and backward of one transformer layer of ``point["model"]``
    on its tensor grid (Korthikanti et al. 2022, Table 4): ``step_seconds`` of
    :func:`~summasim.costmodel.workload.composition.price_composition` for the model with
    ``N = 1`` and ``v = 0`` (no embedding, head or loss), one micro-batch of ``b``
    sequences, ``dp = pp = 1`` and no optimizer step."""
    from . import parse_grid

    machine = _machine(point) if machine is None else machine
    cfg = TransformerConfig(**{**point["model"], "N": 1, "v": 0})
    sch = parse_grid(point["scheme"], point["grid"])
    res = price_composition(cfg, sch, machine=machine, dp=1, pp=1, microbatches=1,
                            global_batch=cfg.b, recompute=cfg.recompute, optimizer=False)
    return res["step_seconds"]


def predict_point(point: dict) -> float | None:
    """The model's value for ``point`` in the point's unit (None for pending points)."""
    kind = point["kind"]
    if kind == "pending":
        return None
    machine = _machine(point)
    if kind in COMPOSITION_KINDS:
        res = price_point_composition(point, machine)
        if kind == "composition_step_time":
            return res["step_seconds"]
        if kind == "composition_tokens":
            return composition_tokens(point, res)
        if kind == "mfu":
            return composition_mfu(point, res)
        return composition_throughput(point, res)
    if kind == "layer_time":
        return layer_seconds(point, machine) / point["layer"]["scale"]
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
    """One row per point: ``{id, kind, machine, gpu, framework, source_key, published,
    predicted, error, unit, used_in_preset, pending, source}`` (error = predicted /
    published - 1; ``pending`` is the point's ``needs``)."""
    rows = []
    for p in points if points is not None else load_points():
        pred = predict_point(p)
        pub = float(p["published"])
        rows.append({"id": p["id"], "kind": p["kind"], "machine": p.get("machine", "-"),
                     "gpu": p.get("gpu", "-"), "framework": p.get("framework", "-"),
                     "source_key": p.get("source_key", p["id"]),
                     "published": pub, "predicted": pred,
                     "error": None if pred is None else pred / pub - 1.0,
                     "unit": p["unit"], "used_in_preset": bool(p.get("used_in_preset")),
                     "pending": p.get("needs") if pred is None else None,
                     "source": p["source"]})
    return rows


def _counts(rows, field):
    out: dict[str, int] = {}
    for r in rows:
        out[r[field]] = out.get(r[field], 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def summary(rows: list[dict], level: float = 0.8) -> dict:
    """MAPE and worst |error| over the priced points not used in a preset, in-sample and
    leave-one-source-out (equal: nothing is fitted, see
    :mod:`~summasim.costmodel.tools.intervals`), the coverage of the LOSO ``level``
    intervals, and counts of the priced points by GPU and framework and of the pending
    points by what they need."""
    from .intervals import loso_rows, coverage

    scored = [r for r in rows if r["error"] is not None and not r["used_in_preset"]]
    errs = [abs(r["error"]) for r in scored]
    loso = loso_rows(rows, level=level)
    pend = [r for r in rows if r["error"] is None]
    out = {"points": len(errs), "mape": sum(errs) / len(errs) if errs else math.nan,
           "worst": max(errs) if errs else math.nan,
           "pending": len(pend)}
    out["loso_mape"], out["loso_worst"] = out["mape"], out["worst"]
    out["level"] = level
    out["coverage"] = coverage(loso)
    out["coverage_step"] = coverage([r for r in loso if r["family"] == "step"])
    out["intervals"] = sum(1 for r in loso if r["lo"] is not None)
    out["by_gpu"] = _counts(scored, "gpu")
    out["by_framework"] = _counts(scored, "framework")
    out["by_kind"] = _counts(scored, "kind")
    out["pending_by_need"] = _counts([{"need": r["pending"]} for r in pend], "need")
    for key in ("mape", "worst", "loso_mape", "loso_worst", "coverage", "coverage_step"):
        if out[key] is not None and not math.isfinite(out[key]):
            out[key] = None                                  # valid JSON: no bare NaN
    return out


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


def _interval_text(r):
    if r["lo"] is None:
        return "-", ""
    return f"[{r['lo']:.4g}, {r['hi']:.4g}]", "yes" if r["covered"] else "NO"


def format_table(rows: list[dict], level: float = 0.8) -> str:
    """The dev-set table as text: one line per point (published, predicted, error,
    source_key, framework, GPU, the leave-one-source-out ``level`` interval and whether
    the published value lies in it), then the summary."""
    from .intervals import loso_rows

    loso = {r["id"]: r for r in loso_rows(rows, level=level)}
    lines = [f"{'point':<42s} {'gpu':<15s} {'framework':<13s} {'source_key':<21s} "
             f"{'published':>10s} {'predicted':>10s} {'error':>8s}  "
             f"{'LOSO ' + format(level, '.0%') + ' interval':<24s} in?  unit"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.4g}"
        err = "pending" if r["error"] is None else f"{r['error']:+.1%}"
        tag = " (calibration)" if r["used_in_preset"] else ""
        iv, ok = _interval_text(loso[r["id"]]) if r["id"] in loso else ("-", "")
        lines.append(f"{r['id']:<42s} {r['gpu']:<15s} {r['framework'][:13]:<13s} "
                     f"{r['source_key']:<21s} {r['published']:>10.4g} {pred:>10s} {err:>8s}  "
                     f"{iv:<24s} {ok:<4s} {r['unit']}{tag}")
    lines += [""] + _summary_lines(rows, level)
    return "\n".join(lines)


def _summary_lines(rows, level):
    s = summary(rows, level)
    lines = [f"MAPE {_pct(s['mape'])} over {s['points']} points (worst {_pct(s['worst'])}); "
             f"{s['pending']} pending; calibration points excluded",
             f"leave-one-source-out: MAPE {_pct(s['loso_mape'])}, worst {_pct(s['loso_worst'])} "
             f"(the same as in-sample: nothing is fitted; LOSO changes only the intervals)",
             f"coverage of the LOSO {level:.0%} intervals: {_pct(s['coverage'])} of "
             f"{s['intervals']} points with an interval; training points (all but the "
             f"NCCL-tests ones) {_pct(s['coverage_step'])}",
             "priced by GPU: " + ", ".join(f"{k} {v}" for k, v in s["by_gpu"].items()),
             "priced by framework: " + ", ".join(f"{k} {v}" for k, v in s["by_framework"].items()),
             "priced by kind: " + ", ".join(f"{k} {v}" for k, v in s["by_kind"].items()),
             f"pending ({s['pending']}), by what they need:"]
    lines += [f"  {v} x {k}" for k, v in s["pending_by_need"].items()]
    return lines


def markdown_table(rows: list[dict] | None = None, level: float = 0.8) -> str:
    """The dev-set table as Markdown (the table of ``docs/devset.md``): the priced points
    with their LOSO ``level`` intervals, the summary, then the pending points and what
    each needs."""
    from .intervals import loso_rows

    rows = evaluate_all() if rows is None else rows
    loso = {r["id"]: r for r in loso_rows(rows, level=level)}
    out = [f"| point | kind | GPU | framework | source_key | published | predicted | error | "
           f"LOSO {level:.0%} interval | inside | unit |",
           "|---|---|---|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        if r["error"] is None:
            continue
        iv, ok = _interval_text(loso[r["id"]]) if r["id"] in loso else ("-", "")
        tag = " (calibration, not scored)" if r["used_in_preset"] else ""
        out.append(f"| `{r['id']}` | {r['kind']} | {r['gpu']} | {r['framework']} | "
                   f"{r['source_key']} | {r['published']:.4g} | {r['predicted']:.4g} | "
                   f"{r['error']:+.1%} | {iv} | {ok} | {r['unit']}{tag} |")
    out += ["", "```"] + _summary_lines(rows, level) + ["```", "",
            "| pending point | GPU | framework | source_key | published | unit | needs |",
            "|---|---|---|---|---:|---|---|"]
    for r in rows:
        if r["error"] is None:
            out.append(f"| `{r['id']}` | {r['gpu']} | {r['framework']} | {r['source_key']} | "
                       f"{r['published']:.4g} | {r['unit']} | {r['pending']} |")
    return "\n".join(out) + "\n"


# --- the intervals that predict and plan print: the dev set's residuals ----------------
@functools.lru_cache(maxsize=1)
def _devset_pairs() -> tuple[tuple[str, float], ...]:
    """``(source_key, residual)`` of every priced training point (the step pool)."""
    from .intervals import _pool, _scored

    return tuple((s["source_key"], s["residual"])
                 for s in _pool(_scored(evaluate_all()), "step"))


def _devset_residuals() -> tuple[float, ...]:
    return tuple(r for _, r in _devset_pairs())


def devset_residuals() -> list[float]:
    """The residuals behind :func:`step_interval`: one per priced end-to-end training
    point of the dev set (:data:`~summasim.costmodel.tools.intervals.STEP_KINDS`; its
    ``used_in_preset`` points left out), in
    the order of ``devset.json``. Computed once per process."""
    return list(_devset_residuals())


def step_interval(seconds: float, level: float = 0.8) -> tuple[float, float]:
    """The ``level`` interval for the real seconds of a training step predicted as
    ``seconds``.

    Its residuals are :func:`devset_residuals`: the dev set's published step times and
    throughputs (Megatron-LM, PyTorch FSDP, torchtitan on V100, A100 and H100 clusters;
    not the NCCL-tests points) against the model's predictions with the shipped presets,
    nothing fitted. The interval says how far off the model has been on published runs,
    not how far it is for this machine; :func:`~summasim.costmodel.tools.intervals.
    loso_rows` checks the construction by leaving each publication out.
    """
    from .intervals import interval

    pairs = _devset_pairs()
    iv = interval(seconds, "step_time", [r for _, r in pairs], level,
                  sources=[s for s, _ in pairs])
    if iv is None:                                   # pragma: no cover - dev set has > 3
        raise ValueError("the dev set has too few priced training points for an interval")
    return iv


def machine_interval(machine, seconds: float, level: float = 0.8):
    """:func:`step_interval` where the dev set speaks for ``machine``: its runs are GPU
    clusters, so a machine without a device (a CPU node, whose own error
    ``costmodel accuracy`` measures) gets None. A :class:`summasim.cli.UsageError`
    (one line, exit 2) when ``seconds`` is not a finite positive time (a machine whose
    numbers price an infinite step)."""
    if not (seconds > 0 and math.isfinite(seconds)):
        from summasim.cli import UsageError

        raise UsageError(f"{machine.name}: the model priced a step of {seconds!r} s; "
                         f"check the machine's numbers")
    if getattr(machine, "device", None) is None:
        return None
    return step_interval(seconds, level)


def within_source_sd() -> float:
    """The pooled within-source standard deviation ``sigma`` of the dev set's training
    residuals (:func:`~summasim.costmodel.tools.intervals.source_bounds`' ``sigma^2``,
    square-rooted): how far apart the
    model's errors on two configurations of one publication (one cluster, one code base)
    are."""
    groups: dict = {}
    for src, r in _devset_pairs():
        groups.setdefault(src, []).append(r)
    n_total, k = sum(len(v) for v in groups.values()), len(groups)
    if n_total <= k:                                 # pragma: no cover - dev set has more
        raise ValueError("the dev set has no source with two training points")
    within = sum((r - sum(v) / len(v)) ** 2 for v in groups.values() for r in v)
    return math.sqrt(within / (n_total - k))


def tie_ratio(level: float = 0.8) -> float:
    """The largest ratio of two predicted step times on one machine that the model cannot
    tell apart at ``level``: ``exp(z sqrt(2) sigma)`` with ``sigma`` =
    :func:`within_source_sd`. Two compositions priced for one cluster share its source
    effect (``a_source`` above cancels in their ratio), so what separates their real
    times beyond the predicted ratio is the difference of two within-source errors, of
    standard deviation ``sqrt(2) sigma``; ``z`` is the normal's two-sided ``level``
    quantile."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    from statistics import NormalDist

    z = NormalDist().inv_cdf((1.0 + level) / 2.0)
    return math.exp(z * math.sqrt(2.0) * within_source_sd())
