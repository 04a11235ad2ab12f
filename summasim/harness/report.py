"""Tables and JSON records of harness results (pure)."""

from __future__ import annotations

import math
from dataclasses import asdict

HEADER = ("algorithm", "grid", "shapes", "dtype", "max rel err", "bound", "check", "result",
          "median s", "GFLOP/s", "MB/rank", "msgs", "peak MiB", "predicted s", "pred err",
          "words/LB")
WIDTHS = (14, 11, 16, 7, 11, 9, 9, 6, 9, 14, 8, 4, 8, 11, 8, 8)


def _line(cells, widths=WIDTHS) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def format_header() -> str:
    return _line(HEADER) + "\n" + "  ".join("-" * w for w in WIDTHS)


def _err(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")


def verdict(ok: bool, nonfinite: bool = False) -> str:
    return "OK" if ok else ("FAIL*" if nonfinite else "FAIL")


def shapes_label(case) -> str:
    return f"N={case.n}" if case.kind == "ring" else f"{case.m}x{case.k}x{case.n}"


def rate(res) -> str:
    t = res.seconds
    if t <= 0:
        return "-"
    c = res.case
    if c.kind == "ring":
        it = 8 if c.dtype == "float64" else 4
        return f"{c.n * it / t / 1e9:.2f} GB/s"
    return f"{2.0 * c.m * c.k * c.n / t / 1e9:.2f}"


def words_over_bound(res) -> dict | None:
    """A product's words moved per rank (the busiest rank's ledger) against the
    communication lower bounds (:func:`summasim.costmodel.workload.bounds.product_bounds`):
    ``{"words_per_rank", "memory_words", "memory_dependent", "memory_independent",
    "bound", "ratio"}`` (``ratio``: words over the larger bound; None when the bound is
    0, e.g. on one rank). None for a ring."""
    c = res.case
    if c.kind != "matmul":
        return None
    from ..algorithms.table import get_algorithm
    from ..costmodel.workload.bounds import product_bounds

    from ..costmodel.workload.traffic import algorithm_messages

    pc = getattr(c, "pc", 0)
    b = product_bounds(get_algorithm(c.algorithm).operands(c.m, c.k, c.n, c.q, c.d, pc),
                       c.m, c.k, c.n, c.q, c.d, pc)
    it = 8 if c.dtype == "float64" else 4
    # an all-gather's ledger event holds the rank's own contribution; it moves the other
    # g - 1 (mm3d_ab's gathers: the same on every rank)
    extra = sum(mc.count * mc.nbytes * (mc.group_size - 2) for mc in algorithm_messages(
        c.algorithm, c.m, c.k, c.n, c.q, c.d, itemsize=it, pc=pc or None)
        if mc.op == "allgather")
    words = (res.bytes_per_rank + extra) / it
    return {"words_per_rank": words, **b,
            "ratio": words / b["bound"] if b["bound"] > 0 else None}


def _ratio(res) -> str:
    w = words_over_bound(res)
    return "-" if w is None or w["ratio"] is None else f"{w['ratio']:.2f}"


def prediction_error(predicted, measured) -> float | None:
    if predicted is None or not measured or measured <= 0:
        return None
    return (predicted - measured) / measured


def format_row(res, predicted=None, load: dict | None = None) -> str:
    """One row of the products' table; ``  BUSY n.nn`` after it when other processes
    used more than the limit's cores while it ran (``load``)."""
    c, chk = res.case, res.check
    pe = prediction_error(predicted, res.seconds)
    return _line((c.algorithm, c.grid_label(res.p), shapes_label(c), c.dtype, _err(chk.error),
                  f"{chk.bound:.2e}", chk.method, verdict(chk.ok, chk.nonfinite),
                  f"{res.seconds:.4f}" if res.timing else "-", rate(res),
                  f"{res.bytes_per_rank / 2**20:.2f}", str(res.messages_per_rank),
                  f"{res.peak_rss / 2**20:.0f}",
                  "-" if predicted is None else f"{predicted:.4f}",
                  "-" if pe is None else f"{100 * pe:+.0f}%", _ratio(res))) + busy_mark(load)


def busy_mark(load: dict | None) -> str:
    """``"  BUSY n.nn"`` (cores of other work) after a row timed under load, else ""."""
    return f"  BUSY {load['foreign_cpu']:.2f}" if load and load["quiet"] is False else ""


def row_record(res, predicted=None, load: dict | None = None) -> dict:
    """The JSON record of a product or ring result (``load``: the other processes' load
    while it ran, :func:`~summasim.harness.load.interval_load`; ``quiet`` from it)."""
    c, chk = res.case, res.check
    t = res.seconds
    it = 8 if c.dtype == "float64" else 4
    return {"algorithm": c.algorithm, "grid": c.grid_label(res.p), "shapes": shapes_label(c),
            "dtype": c.dtype, "case": c.to_dict(), "error": chk.error, "bound": chk.bound,
            "check": chk.method, "false_pass": chk.false_pass, "ok": chk.ok,
            "nonfinite": chk.nonfinite, "bad_ranks": chk.bad_ranks,
            "seconds": t if res.timing.get("spans") else None,      # None: not timed
            "times": res.timing.get("spans", []),
            "gflops": (2.0 * c.m * c.k * c.n / t / 1e9) if c.kind == "matmul" and t > 0
            else None,
            "gbytes_per_s": (c.n * it / t / 1e9) if c.kind == "ring" and t > 0 else None,
            "bytes_per_rank": res.bytes_per_rank, "messages_per_rank": res.messages_per_rank,
            "peak_rss_bytes": res.peak_rss, "predicted": predicted,
            "prediction_error": prediction_error(predicted, t),
            "lower_bounds": words_over_bound(res), "fault": res.fault,
            "load": load, "quiet": None if load is None else load["quiet"]}


TF_HEADER = ("scheme", "grid", "dtype", "loss err", "logits err", "grad err", "bound",
             "result", "fwd s", "bwd s", "pred s", "pred err", "L0 fwd items", "Table 1",
             "L0 bwd+ckpt", "Table 1")
TF_WIDTHS = (8, 8, 7, 8, 10, 8, 7, 6, 7, 7, 7, 8, 12, 8, 11, 8)
MEM_HEADER = ("scheme", "grid", "dtype", "params", "grads", "Adam", "activ.",
              "formula params", "grads", "Adam", "activ.", "peak fwd+bwd MiB")
MEM_WIDTHS = (9, 9, 7, 10, 9, 8, 10, 15, 8, 8, 8, 16)


def _e1(x: float) -> str:
    return f"{x:.1e}" if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")


def format_transformer(reports) -> str:
    """The transformer validation/traffic table and the memory table."""
    lines = [_line(TF_HEADER, TF_WIDTHS), "  ".join("-" * w for w in TF_WIDTHS)]
    for r in reports:
        pe = r.prediction_error
        lines.append(_line((r.scheme, r.grid, r.dtype, _e1(r.loss_err), _e1(r.logits_err),
                            _e1(r.grad_err), _e1(r.bound), verdict(r.ok, r.nonfinite),
                            f"{r.fwd_s:.4f}" if r.fwd_s else "-",
                            f"{r.bwd_s:.4f}" if r.bwd_s else "-",
                            "-" if r.predicted_s is None else f"{r.predicted_s:.4f}",
                            "-" if pe is None else f"{100 * pe:+.1f}%",
                            str(r.tp_fwd), str(r.table1.get("fwd", "-")),
                            str(r.tp_bwd_checkpoint), str(r.table1.get("bwd_checkpoint", "-"))),
                           TF_WIDTHS) + busy_mark(r.load))
    mib = lambda x: f"{x / 2**20:.3f}"  # noqa: E731
    mem = [r for r in reports if r.memory]
    if mem:
        lines += ["", _line(MEM_HEADER, MEM_WIDTHS), "  ".join("-" * w for w in MEM_WIDTHS)]
    for r in mem:
        m, f = r.memory, r.memory_formula
        lines.append(_line((r.scheme, r.grid, r.dtype, mib(m["params"]), mib(m["grads"]),
                            mib(m["optimizer"]), mib(m["activations"]), mib(f["params"]),
                            mib(f["grads"]), mib(f["optimizer"]), mib(f["activations"]),
                            mib(m["peak_fwd_bwd"])), MEM_WIDTHS))
    return "\n".join(lines)


def transformer_record(rep) -> dict:
    return dict(asdict(rep), prediction_error=rep.prediction_error)


def prediction_summary(pairs, load: dict | None = None) -> dict | None:
    """MAPE and worst case of ``[(predicted, measured, label), ...]`` (None if empty);
    with ``load`` (the run's :func:`~summasim.harness.load.interval_load` record), also
    the load the measurements were taken under (``load``, ``quiet``): a prediction of a
    quiet machine compared with a time taken while other work ran is off by that work."""
    errs = [(abs(prediction_error(p, m)), label) for p, m, label in pairs
            if prediction_error(p, m) is not None]
    if not errs:
        return None
    worst, wlabel = max(errs, key=lambda e: e[0])
    out = {"mape": sum(e for e, _ in errs) / len(errs), "worst": worst,
           "worst_run": wlabel, "count": len(errs)}
    if load is not None:
        out.update(load=load, quiet=load["quiet"])
    return out


def format_prediction_summary(summary: dict, machine_name: str) -> str:
    """The line of the prediction error, and, when the run was not quiet (or its load
    unknown), why the error is not the cost model's alone."""
    line = (f"cost model ({machine_name}): MAPE {100 * summary['mape']:.1f}% over "
            f"{summary['count']} runs, worst {100 * summary['worst']:.1f}% "
            f"({summary['worst_run']})")
    if "quiet" not in summary:
        return line
    from .load import describe

    if summary["quiet"] is False:
        busy = describe(summary["load"])[len("BUSY: "):]
        return (line + f"\n  WARNING: measured while other work ran ({busy}): "
                f"the times include it and the predictions (of a quiet machine) do not; "
                f"rerun on a quiet machine before trusting this error")
    if summary["quiet"] is None:
        return line + "\n  note: the load was not measured (no /proc, no load average)"
    return line + f"; the machine was {describe(summary['load'])}"


def mark_report(report: dict, name: str, loads) -> dict | None:
    """Set ``report["load"][name]`` to the busiest of a benchmark's interval loads
    (:func:`~summasim.harness.load.combine`: ``quiet`` only when all were); return it."""
    from .load import combine

    out = combine(loads)
    report.setdefault("load", {})[name] = out
    return out


# loss err and grad err: max |par - ser| / max |ser| against ``bound`` (validate.
# training_tolerance); param/bnd: the worst parameter's |par - ser| over its elementwise
# bound through Adam (validate.adam_step_bound), which passes at 1 or less
MESH_HEADER = ("mesh", "dtype", "zero", "sched", "m", "ckpt", "result", "loss err", "grad err",
               "bound", "param/bnd", "step s", "pred s", "traffic KiB meas/closed",
               "state KiB meas/formula", "in flight")


def _mesh_widths(width: int) -> tuple:
    return (max(width, len(MESH_HEADER[0])), 8, 4, 13, 2, 4, 6, 8, 8, 7, 9, 8, 8, 23, 22, 9)


def _mesh_cell(r) -> str:
    """The mesh as given, and its layers per stage when the split is not the even one."""
    stages = getattr(r, "stages", "")        # "1,0,0,3", or "" for the even split
    extra = [f"stages={stages}"] if stages else []
    extra += list(getattr(r, "techniques", []) or [])
    if getattr(r, "overlap", False):
        extra.append("overlap")
    return " ".join([r.mesh] + extra)


def format_mesh_header(width: int) -> str:
    """Header of the sharded-training table whose mesh column is ``width`` wide."""
    widths = _mesh_widths(width)
    return _line(MESH_HEADER, widths) + "\n" + "  ".join("-" * w for w in widths)


def format_mesh_row(r, width: int) -> str:
    """One mesh row, starting with the mesh as given (plus a line naming any failed
    check)."""
    kib = lambda x: f"{x / 1024:.1f}"  # noqa: E731
    line = _line((_mesh_cell(r), r.dtype, str(r.zero), r.schedule, str(r.microbatches),
                  "yes" if r.checkpoint else "no", verdict(r.ok, r.nonfinite), _e1(r.loss_err),
                  _e1(r.grad_err), _e1(r.bound), _e1(r.param_err),
                  f"{r.step_s:.4f}" if r.step_s else "-",
                  "-" if r.predicted_s is None else f"{r.predicted_s:.4f}",
                  f"{kib(sum(r.traffic.values()))}/{kib(sum(r.traffic_expected.values()))}",
                  f"{kib(r.memory.get('total', 0))}/{kib(r.memory_formula.get('total', 0))}",
                  str(r.inflight)), _mesh_widths(width)) + busy_mark(r.load)
    skipped = getattr(r, "skipped", None)
    if skipped:
        line += (f"\n    {r.mesh}: step(s) {', '.join(map(str, skipped))} skipped: a rank's "
                 f"gradients were not finite, and every rank kept its parameters")
    if r.failures or not r.values_ok:
        why = list(r.failures) + ([] if r.values_ok else ["values"])
        line += (f"\n    {r.mesh}: failed checks: {', '.join(why)}"
                 + (f" (worst value: {r.worst})" if r.worst and not r.values_ok else ""))
    return line


def format_meshes(reports) -> str:
    """The whole sharded-training table."""
    width = max([0] + [len(_mesh_cell(r)) for r in reports])
    return "\n".join([format_mesh_header(width)] + [format_mesh_row(r, width)
                                                     for r in reports])


def mesh_record(rep) -> dict:
    return asdict(rep)
