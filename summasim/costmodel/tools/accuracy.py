"""Accuracy benchmark of the cost model: predicted against measured, on this machine.

    python -m summasim.costmodel accuracy                  # fit, calibrate, predict, report
    python -m summasim.costmodel accuracy --machine results/machine.json   # skip the fit
    python -m summasim.costmodel accuracy --from           # re-analyse results/accuracy/

What it does
------------
1. **Link fit.** ``mpiexec -n 2 python -m summasim.costmodel fit`` (or ``--machine``):
   alpha, beta per regime, gamma. Reported: the median relative error per regime
   on the fitted ping-pong points (latency regime, eager threshold to 64 KiB, 64 KiB
   and up) and, as a check that was not fitted, on the concurrent-ring points.
2. **Run-level calibration, p <= 4 and rings at p = 8.** Serial training steps
   (p = 1) fit the machine's ``gamma_elementwise`` and ``layer_seconds``
   (LayerNorm, GELU, softmax and Python overheads); products, ring all-reduces and
   training steps at p = 3 and 4 (1.5 and 2 ranks per core), with ring all-reduces
   at p = 8 (4 per core, where long ring steps nap), fit the shared-core model
   (:class:`~summasim.costmodel.machine.SharedCore`, :func:`~summasim.costmodel.machine.regression.fit_shared_core`).
3. **Held-out accuracy.** The same kinds of run at p = 8 (no ring), 9 and 16 and
   at sizes the calibration never saw, predicted from their traces: MAPE, median
   and worst case, every run listed.
4. **Ranking.** Every group of runs that solve the same problem on the same p
   (Cannon / SUMMA / SUMMA2.5 grids for one product; Megatron / Optimus /
   SUMMA2.5-LM for one training step): is the predicted fastest the measured
   fastest? A wrong pick whose measured time is within 10% of the winner is
   reported as "tied".

Measurements come from the harness (:mod:`summasim.harness.accuracy` runs the
worker :mod:`summasim.harness.worker` under ``mpiexec``, always under ``timeout``);
this module is the pure analysis of what it measured, handed down as typed records
(:class:`~summasim.costmodel.workload.measured.MeasuredRun`: every function here that
reads a measured run takes the record; the harness reads the worker's JSON and
``measured.json`` with :meth:`~summasim.costmodel.workload.measured.MeasuredRun.from_dict`). Each
case is set up once, called once with the trace on (its events are what the
model prices, exactly as ``summasim.run`` does), then timed ``repeats`` times
(short calls more, up to 5x, about half a second in all). A timed call starts
after a barrier that waits without spinning, and its time is the *span* ``max_r
t1_r - min_r t0_r`` on the node's common monotonic clock: the wall time from the
first rank's start to the last rank's end.

Statistic: the **median** of the repeats (``--statistic min`` for the fastest); the
report also summarizes the analysis with the other one. On this 2-core machine,
repeat-to-repeat spread of 20-60% is normal for short communicating calls under
oversubscription; the table shows each run's spread (slowest over fastest repeat).

Output: a table on the terminal, and ``measured.json``, ``report.json``,
``machine-fit.json`` and ``machine-calibrated.json`` (the fitted machine with the
run-level models, usable as ``summasim.run --machine``) under ``--out``
(``results/accuracy``). This module never touches MPI; it is tested without it.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

from ..workload.measured import STATISTICS, MeasuredRun, predict_measured_mesh, require_run

# --------------------------------------------------------------------------- errors
def rel_error(predicted: float, measured: float) -> float:
    """Signed relative error ``(predicted - measured) / measured``."""
    if measured <= 0:
        raise ValueError(f"measured time must be > 0, got {measured!r}")
    return (predicted - measured) / measured


def error_summary(pairs: Iterable[tuple[float, float]], labels: Sequence[str] | None = None
                  ) -> dict | None:
    """MAPE, median, worst case and bias of ``(predicted, measured)`` pairs.

    Returns ``None`` for no pairs. ``worst`` is the largest absolute relative
    error, ``worst_case`` its label (or index), ``bias`` the mean signed error.
    """
    pairs = list(pairs)
    if not pairs:
        return None
    errs = [rel_error(p, m) for p, m in pairs]
    absd = [abs(e) for e in errs]
    w = max(range(len(absd)), key=absd.__getitem__)
    return {"count": len(errs), "mape": sum(absd) / len(absd),
            "median": statistics.median(absd), "worst": absd[w],
            "worst_case": labels[w] if labels is not None else w,
            "bias": sum(errs) / len(errs),
            "within_10": sum(a <= 0.10 for a in absd) / len(absd),
            "within_20": sum(a <= 0.20 for a in absd) / len(absd)}


def ranking_outcome(candidates: Sequence[dict], *, noise: float = 0.10) -> dict:
    """Did the model pick the measured fastest candidate of one configuration?

    Parameters
    ----------
    candidates : sequence of dict
        Each with "label", "predicted" and "measured" (seconds); optionally
        "spread" (the relative repeat-to-repeat spread of its measurement).
    noise : float
        Relative margin under which two measured times count as tied.

    Returns
    -------
    dict
        "predicted_best", "measured_best" (labels), "correct" (they are equal),
        "tied" (not equal, but the predicted best measured within ``noise`` of the
        measured best), "regret" (measured time of the predicted best over the
        measured best, minus one) and "margin" (how much slower the measured
        runner-up is than the measured best).
    """
    cands = list(candidates)
    if not cands:
        raise ValueError("a configuration needs at least one candidate")
    pb = min(cands, key=lambda c: c["predicted"])
    mb = min(cands, key=lambda c: c["measured"])
    regret = pb["measured"] / mb["measured"] - 1.0
    rest = sorted(c["measured"] for c in cands)
    margin = rest[1] / rest[0] - 1.0 if len(rest) > 1 else math.inf
    correct = pb["label"] == mb["label"]
    return {"predicted_best": pb["label"], "measured_best": mb["label"], "correct": correct,
            "tied": (not correct) and regret <= noise, "regret": regret, "margin": margin,
            "candidates": len(cands)}


def ranking_summary(outcomes: Sequence[dict]) -> dict | None:
    """Fraction of configurations ranked right, strictly and up to ties."""
    if not outcomes:
        return None
    n = len(outcomes)
    right = sum(o["correct"] for o in outcomes)
    tied = sum(o["tied"] for o in outcomes)
    return {"configurations": n, "correct": right, "fraction": right / n,
            "fraction_with_ties": (right + tied) / n,
            "mean_regret": sum(o["regret"] for o in outcomes) / n,
            "worst_regret": max(o["regret"] for o in outcomes)}


# --------------------------------------------------------------------------- labels
def case_label(run: MeasuredRun) -> str:
    """Short human label: ``summa_ab 4x4 1024x1024x1024`` / ``optimus 2x2 b8 s64 h256``
    (:attr:`MeasuredRun.label`)."""
    return require_run(run, "case_label").label


def event_summary(events) -> list:
    """``[[op, group, group_size, nbytes, count, blocking], ...]`` of one rank's events
    (``blocking``: they waited inside a blocking MPI call, see
    :class:`summasim.trace.Event`)."""
    acc: dict = {}
    for e in events:
        key = (e.op, e.group, int(e.group_size), int(e.nbytes),
               bool(getattr(e, "blocking", False)))
        acc[key] = acc.get(key, 0) + 1
    return [list(k[:4]) + [c, k[4]] for k, c in sorted(acc.items())]


# --------------------------------------------------------------------------- model side (pure)
def _tf_scheme_config(run: MeasuredRun):
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig

    sch = (Scheme.make("megatron", p=run.p) if run.scheme == "megatron"
           else Scheme.make(run.scheme, q=run.q, d=run.d, pc=run.pc or run.q))
    cfg = TransformerConfig(b=run.b, s=run.s, h=run.h, n=run.heads, N=run.layers,
                            v=run.v, dtype=run.dtype, checkpoint=False, ffn=run.ffn)
    return sch, cfg


def rank_features(run: MeasuredRun, machine) -> list:
    """:class:`~summasim.costmodel.workload.predict.SharedFeatures` of every rank of one measured
    run (its :class:`MeasuredRun`): its traced events
    priced with ``machine``, plus its compute (GEMMs and additions from the closed forms
    at its grid coordinates; for a training step the row-0 work of
    :func:`~summasim.costmodel.workload.step.step_work`)."""
    from summasim.costmodel.machine import itemsize_of
    from summasim.costmodel.workload.pricer import ADD_OUT_STREAMS, summary_messages
    from summasim.costmodel.workload.predict import trace_features
    from summasim.costmodel.workload.traffic import algorithm_compute, ring_working_set

    run = require_run(run, "rank_features")
    p, kind, dtype = run.p, run.kind, run.dtype
    it = itemsize_of(dtype)
    out = []
    if kind == "transformer":
        from summasim.costmodel.workload.step import step_work

        sch, cfg = _tf_scheme_config(run)
        work = step_work(sch, cfg)
    for r, (events, coords) in enumerate(zip(run.events, run.coords)):
        extra = {}
        if kind == "matmul":
            w = algorithm_compute(run.algorithm, run.m, run.k, run.n, run.q, run.d, it,
                                  tuple(coords), pc=run.pc or None)
            extra = dict(gemms=w.gemms, reduce_bytes=w.reduce_bytes, q=run.q, d=run.d,
                         pc=run.pc or None)
        elif kind == "ring":
            # timed out of place (the harness and the bench): each add writes ``out``
            w = algorithm_compute("ring_allreduce", count=run.N, p=p, coords=r, itemsize=it)
            extra = dict(reduce_bytes=w.reduce_bytes, reduce_streams=ADD_OUT_STREAMS,
                         working_set=ring_working_set(run.N, p, it))
        else:
            extra = dict(gemms=work.gemms, reduce_bytes=work.reduce_bytes,
                         elementwise_items=work.elementwise_items, layers=work.layers,
                         q=run.q, d=run.d, pc=run.pc or None)
        out.append(trace_features(summary_messages(events), machine, p=p, dtype=dtype, **extra))
    return out


def predict_result(run: MeasuredRun, machine) -> float:
    """Predicted seconds of one measured run (its :class:`MeasuredRun`; the slowest rank;
    see :func:`~summasim.costmodel.workload.predict.predict_features`; a
    sharded-training step: :func:`~summasim.costmodel.workload.measured.predict_measured_mesh`)."""
    from summasim.costmodel.workload.predict import predict_features

    run = require_run(run, "predict_result")
    if run.kind == "mesh":
        return predict_measured_mesh(run, machine)

    return predict_features(rank_features(run, machine), machine,
                            machine.ranks_per_node(run.p))


def measured_seconds(run: MeasuredRun, statistic: str = "median") -> float:
    """The measured time compared with the model: the median span of the repeats
    (``statistic="min"``: the fastest, what a quiet machine would give)."""
    return require_run(run, "measured_seconds").seconds(statistic)


def calibrate(machine, serial: Sequence[MeasuredRun], shared: Sequence[MeasuredRun],
              statistic: str = "median"):
    """The machine with ``gamma_elementwise``/``layer_seconds`` fitted on serial
    training steps (``serial``: measured runs at p = 1) and the shared-core model
    fitted on oversubscribed runs (``shared``: runs with p > cores). Returns
    ``(machine, {"elementwise": err, "shared_core": err})`` (median relative errors)."""
    from summasim.costmodel.machine.regression import fit_elementwise, fit_shared_core
    from summasim.costmodel.workload.predict import merge_features
    from summasim.costmodel.workload.step import step_work

    errs = {}
    serial = [require_run(r, "calibrate") for r in serial]
    shared = [require_run(r, "calibrate") for r in shared]
    if serial:
        base = machine.replace(gamma_elementwise=0.0, layer_seconds=0.0)
        samples = []
        for res in serial:
            sch, cfg = _tf_scheme_config(res)
            w = step_work(sch, cfg)
            g = sum(c * base.gemm_time(a, b, k, cfg.dtype) for a, b, k, c in w.gemms) \
                + base.gamma_reduce * w.reduce_bytes
            samples.append((g, w.elementwise_items, w.layers, measured_seconds(res, statistic)))
        ge, ls, errs["elementwise"] = fit_elementwise(samples)
        machine = machine.replace(gamma_elementwise=ge, layer_seconds=ls)
    if shared:
        probe = machine.replace(shared_core=None)
        samples = []
        for res in shared:
            feats = rank_features(res, probe)
            R = machine.ranks_per_node(res.p) / machine.cores
            samples.append((R, merge_features(feats), measured_seconds(res, statistic)))
        sc, errs["shared_core"] = fit_shared_core(samples)
        machine = machine.replace(shared_core=sc)
    return machine, errs


def compare(runs: Sequence[MeasuredRun], machine, statistic: str = "median") -> list[dict]:
    """``[{"label", "p", "predicted", "measured", "error", "spread", "key"}, ...]`` per
    measured run."""
    rows = []
    for run in runs:
        run = require_run(run, "compare")
        pred = predict_result(run, machine)
        meas = run.seconds(statistic)
        rows.append({"label": run.label, "p": run.p, "predicted": pred,
                     "measured": meas, "error": rel_error(pred, meas),
                     "spread": run.spread, "key": run.ranking_key})
    return rows


def ranking_key(run: MeasuredRun):
    """Runs with the same key solve the same problem on the same p (candidates)."""
    return require_run(run, "ranking_key").ranking_key


def ranking(rows: Sequence[dict], noise: float = 0.10) -> list[dict]:
    """:func:`ranking_outcome` of every key with at least two candidates."""
    groups: dict = {}
    for r in rows:
        if r["key"] is not None:
            groups.setdefault(r["key"], []).append(r)
    out = []
    for key, cands in groups.items():
        if len(cands) >= 2:
            out.append(dict(ranking_outcome(cands, noise=noise), key=key))
    return out


def calibration_report(machine) -> dict:
    """Median and worst relative error of the fitted link per regime: ``latency``
    (below the eager threshold), ``mid`` (from there to 64 KiB) and ``large`` (64 KiB
    and up), on the fit's own ping-pong points (``pingpong``: what was fitted) and on
    its concurrent-ring points (``ring``: a check, every rank sending at once). None
    where the machine file has no points in a regime."""
    notes = machine.notes or {}
    link = machine.link()
    out = {}
    for source in ("pingpong", "ring"):
        reg = {"latency": [], "mid": [], "large": []}
        for s, t in notes.get(source, []):
            if not t:
                continue
            key = ("latency" if s < link.eager_threshold
                   else ("large" if s >= 65536 else "mid"))
            reg[key].append(abs(link.time(s) / t - 1.0))
        out[source] = {k: ({"points": len(v), "median": statistics.median(v), "worst": max(v)}
                           if v else None) for k, v in reg.items()}
    return out


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


def report_text(rep: dict) -> str:
    """The terminal report of :func:`analyse`'s dict."""
    lines = []
    lines.append("Calibration (the fitted link against the fit's points, |error|):")
    for source, title in (("pingpong", "ping-pong (fitted)"),
                          ("ring", "concurrent ring (check, not fitted)")):
        for k, what in (("latency", "latency regime (< eager threshold)"),
                        ("mid", "eager threshold .. 64 KiB"), ("large", ">= 64 KiB")):
            v = rep["calibration"][source][k]
            lines.append(f"  {title:<36s} {what:<36s} " + (
                "no points" if v is None else f"{v['median']:.1%} median, {v['worst']:.1%} "
                                              f"worst over {v['points']} points"))
    for k, v in rep["calibration_runs"].items():
        lines.append(f"  {k:<36s} {v:.1%} median on the runs it was fitted on")
    for part, title in (("calibrate", "Fitted-on runs (p = 1, 3 and 4)"),
                        ("heldout", "Held-out runs (p = 8, 9, 16; never fitted on)")):
        lines.append("")
        lines.append(f"{title}:")
        lines.append(f"  {'case':<52s} {'p':>3s} {'measured':>11s} {'predicted':>11s} "
                     f"{'error':>8s} {'spread':>7s}")
        for r in rep[part]["rows"]:
            lines.append(f"  {r['label']:<52s} {r['p']:>3d} {r['measured'] * 1e3:9.2f}ms "
                         f"{r['predicted'] * 1e3:9.2f}ms {r['error']:+8.1%} {r['spread']:7.0%}")
        s = rep[part]["summary"]
        if s:
            lines.append(f"  MAPE {s['mape']:.1%}, median {s['median']:.1%}, worst {s['worst']:.1%} "
                         f"({s['worst_case']}), bias {s['bias']:+.1%}; within 10%: "
                         f"{s['within_10']:.0%}, within 20%: {s['within_20']:.0%}")
    lines.append("")
    lines.append("Ranking (is the predicted fastest candidate the measured fastest?):")
    for o in rep["ranking"]["outcomes"]:
        verdict = "right" if o["correct"] else ("tied" if o["tied"] else "WRONG")
        lines.append(f"  {o['key']:<50s} predicted {o['predicted_best']:<26s} measured "
                     f"{o['measured_best']:<26s} {verdict} (regret {o['regret']:.1%}, "
                     f"margin {o['margin']:.1%})")
    s = rep["ranking"]["summary"]
    if s:
        lines.append(f"  {s['correct']}/{s['configurations']} right ({s['fraction']:.0%}); "
                     f"{s['fraction_with_ties']:.0%} counting ties within 10%; "
                     f"mean regret {s['mean_regret']:.1%}, worst {s['worst_regret']:.1%}")
    o = rep.get("other_statistic")
    if o:
        lines.append("")
        lines.append(f"The same, fitted and compared on the {o['statistic']} of the repeats "
                     f"instead of the {rep['statistic']}:")
        for part in ("calibrate", "heldout"):
            v = o[part]
            if v:
                lines.append(f"  {part:<10s} MAPE {v['mape']:.1%}, median {v['median']:.1%}, "
                             f"worst {v['worst']:.1%} ({v['worst_case']})")
        if o["ranking"]:
            lines.append(f"  ranking    {o['ranking']['correct']}/{o['ranking']['configurations']}"
                         f" right, {o['ranking']['fraction_with_ties']:.0%} counting ties")
    return "\n".join(lines)


def analyse(measured: dict, machine, statistic: str = "median") -> tuple[dict, object]:
    """Calibrate ``machine`` on ``measured["calibrate"]`` and compare every run with the
    model. ``measured``: ``{"calibrate": [runs], "heldout": [runs]}`` of
    :class:`MeasuredRun` records. Returns
    the report dict and the calibrated machine. ``rep["other_statistic"]`` holds the
    summaries of the same analysis with the other statistic of the repeats (fitted
    and compared on the fastest repeat instead of the median, or the reverse)."""
    rep, calibrated = _analyse(measured, machine, statistic)
    other = [s for s in STATISTICS if s != statistic][0]
    rep2, _ = _analyse(measured, machine, other)
    rep["statistic"] = statistic
    rep["other_statistic"] = {"statistic": other, "calibrate": rep2["calibrate"]["summary"],
                              "heldout": rep2["heldout"]["summary"],
                              "ranking": rep2["ranking"]["summary"]}
    return rep, calibrated


def _analyse(measured, machine, statistic):
    cal = [require_run(r, "analyse") for r in measured["calibrate"]]
    serial = [r for r in cal if r.p == 1]
    shared = [r for r in cal if machine.ranks_per_node(r.p) > machine.cores]
    calibrated, errs = calibrate(machine, serial, shared, statistic)
    rep = {"machine": calibrated.name, "calibration": calibration_report(calibrated),
           "calibration_runs": {f"{k} model": v for k, v in errs.items()}}
    runs = {"calibrate": cal, "heldout": [require_run(r, "analyse") for r in measured["heldout"]]}
    for part in ("calibrate", "heldout"):
        rows = compare(runs[part], calibrated, statistic)
        rep[part] = {"rows": rows, "summary": error_summary(
            [(r["predicted"], r["measured"]) for r in rows], [r["label"] for r in rows])}
    outcomes = ranking(rep["calibrate"]["rows"] + rep["heldout"]["rows"])
    rep["ranking"] = {"outcomes": outcomes, "summary": ranking_summary(outcomes)}
    return rep, calibrated
