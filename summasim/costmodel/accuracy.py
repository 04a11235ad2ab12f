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
2. **Run-level calibration, p <= 4.** Serial training steps (p = 1) fit the
   machine's ``gamma_elementwise`` and ``layer_seconds`` (LayerNorm, GELU, softmax
   and Python overheads); products, ring all-reduces and training steps at p = 3
   and 4 (1.5 and 2 ranks per core) fit the shared-core model
   (:class:`~summasim.costmodel.machine.SharedCore`, :func:`~summasim.costmodel.fit.fit_shared_core`).
3. **Held-out accuracy.** The same kinds of run at p = 8, 9 and 16 and at sizes
   the calibration never saw, predicted from their traces: MAPE, median and worst
   case, every run listed.
4. **Ranking.** Every group of runs that solve the same problem on the same p
   (Cannon / SUMMA / SUMMA2.5 grids for one product; Megatron / Optimus /
   SUMMA2.5-LM for one training step): is the predicted fastest the measured
   fastest? A wrong pick whose measured time is within 10% of the winner is
   reported as "tied".

Measurements come from a worker run under ``mpiexec`` (``python -m
summasim.costmodel accuracy-worker SPEC OUT``), always under ``timeout``. Each
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
(``results/accuracy``). Only the worker and the fit touch MPI (they import mpi4py
lazily); the analysis is pure and tested without MPI.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

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


# --------------------------------------------------------------------------- cases
def matmul_case(algorithm: str, q: int, d: int, m: int, k: int, n: int,
                dtype: str = "float64") -> dict:
    """A distributed product to time (global C[m, n] = op(A)[m, k] op(B)[k, n])."""
    return {"kind": "matmul", "algorithm": algorithm, "q": int(q), "d": int(d), "m": int(m),
            "k": int(k), "n": int(n), "dtype": dtype}


def ring_case(N: int, dtype: str = "float64") -> dict:
    """``ring_allreduce`` of N items over all ranks."""
    return {"kind": "ring", "algorithm": "ring_allreduce", "N": int(N), "dtype": dtype}


def transformer_case(scheme: str, q: int, d: int, b: int, s: int, h: int, heads: int,
                     v: int, layers: int, ffn: int = 4, dtype: str = "float64") -> dict:
    """One training step (forward + backward, no checkpointing) of a parallel scheme."""
    return {"kind": "transformer", "scheme": scheme, "q": int(q), "d": int(d), "b": int(b),
            "s": int(s), "h": int(h), "heads": int(heads), "v": int(v),
            "layers": int(layers), "ffn": int(ffn), "dtype": dtype}


def case_label(case: dict, p: int | None = None) -> str:
    """Short human label: ``summa_ab 4x4 1024x1024x1024`` / ``optimus 2x2 b8 s64 h256``."""
    kind = case["kind"]
    if kind == "matmul":
        grid = (f"{case['q']}x{case['q']}" if case["d"] == 1 and not
                case["algorithm"].startswith("summa25") else
                f"[{case['q']},{case['q']},{case['d']}]")
        return f"{case['algorithm']} {grid} {case['m']}x{case['k']}x{case['n']}"
    if kind == "ring":
        return f"ring_allreduce p={p if p is not None else '?'} N={case['N']}"
    grid = {"megatron": f"1D p={p if p is not None else '?'}",
            "optimus": f"{case['q']}x{case['q']}"}.get(case["scheme"],
                                                       f"[{case['q']},{case['q']},{case['d']}]")
    return (f"{case['scheme']} {grid} b{case['b']} s{case['s']} h{case['h']} "
            f"v{case['v']} L{case['layers']}")


# --------------------------------------------------------------------------- worker (MPI)
def _sleep_wait(req, interval: float = 20e-6):
    """Complete an mpi4py request without spinning (the cores belong to the other ranks)."""
    while not req.Test():
        time.sleep(interval)


def _sleep_barrier(world):
    _sleep_wait(world.Ibarrier())


def _reduce_max(world, values):
    """Element-wise max over ranks of a few floats, waiting without spinning."""
    import numpy as np
    from mpi4py import MPI

    send = np.asarray(values, dtype=np.float64)
    recv = np.empty_like(send)
    _sleep_wait(world.Iallreduce(send, recv, op=MPI.MAX))
    return recv


def _time_calls(fn, world, repeats: int, budget: float = 0.5) -> dict:
    """Per-call spans (after a non-spinning barrier), per-rank maxima, and the
    back-to-back time per call of ``repeats`` calls in a row (seconds).

    Short calls are repeated more (up to 5 ``repeats``, about ``budget`` seconds in
    all): under oversubscription their spread is the largest."""
    _sleep_barrier(world)
    t0 = time.perf_counter()
    fn()
    one = float(_reduce_max(world, [time.perf_counter() - t0])[0])
    repeats = max(repeats, min(5 * repeats, int(budget / max(one, 1e-6))))
    spans, rank_max = [], []
    for _ in range(repeats):
        _sleep_barrier(world)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        mx = _reduce_max(world, [-t0, t1, t1 - t0])
        spans.append(float(mx[1] + mx[0]))
        rank_max.append(float(mx[2]))
    _sleep_barrier(world)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    t1 = time.perf_counter()
    mx = _reduce_max(world, [-t0, t1])
    return {"spans": spans, "rank_max": rank_max, "back_to_back": float(mx[1] + mx[0]) / repeats}


def event_summary(events) -> list:
    """``[[op, group, group_size, nbytes, count], ...]`` of one rank's events."""
    acc: dict = {}
    for e in events:
        key = (e.op, e.group, int(e.group_size), int(e.nbytes))
        acc[key] = acc.get(key, 0) + 1
    return [list(k) + [c] for k, c in sorted(acc.items())]


def _run_matmul(case, world, repeats, seed):
    import numpy as np

    from .. import algorithms as algs
    from ..grid import Grid
    from ..layout import local_shape
    from ..run import ALGORITHMS, stored_shapes

    _, op, la, lb, _ = ALGORITHMS[case["algorithm"]]
    q, d, p = case["q"], case["d"], world.Get_size()
    sa, sb = stored_shapes(op, case["m"], case["k"], case["n"])
    rng = np.random.default_rng([seed, world.Get_rank()])
    dtype = np.dtype(case["dtype"])
    grid = Grid(world, q, d)
    try:
        a = rng.standard_normal(local_shape(sa, la, q, d, p)).astype(dtype)
        b = rng.standard_normal(local_shape(sb, lb, q, d, p)).astype(dtype)
        c = np.empty(local_shape((case["m"], case["n"]), ALGORITHMS[case["algorithm"]][4],
                                 q, d, p), dtype)
        fn = getattr(algs, case["algorithm"])
        grid.trace.clear()
        fn(a, b, grid, out=c)                    # traced call (and warm-up)
        events = event_summary(grid.trace.events)
        coords = list(grid.coords)
        grid.trace.enabled = False
        timing = _time_calls(lambda: fn(a, b, grid, out=c), world, repeats)
    finally:
        grid.free()
    return timing, events, coords


def _run_ring(case, world, repeats, seed):
    import numpy as np

    from ..algorithms import ring_allreduce
    from ..comm import Comm

    comm = Comm(world.Dup(), name="world")
    try:
        rng = np.random.default_rng([seed, world.Get_rank()])
        x = rng.standard_normal(case["N"]).astype(case["dtype"])
        out = np.empty_like(x)
        ring_allreduce(x, comm, out=out)
        events = event_summary(comm.trace.events)
        comm.trace.enabled = False
        timing = _time_calls(lambda: ring_allreduce(x, comm, out=out), world, repeats)
    finally:
        comm.mpi.Free()
    return timing, events, [world.Get_rank()]


def _run_transformer(case, world, repeats, seed):
    import numpy as np

    from ..transformer import model
    from ..transformer.compare import make_grid, scheme_module

    module = scheme_module(case["scheme"])
    config = model.Config(vocab=case["v"], seq=case["s"], hidden=case["h"],
                          heads=case["heads"], layers=case["layers"], ffn_mult=case["ffn"],
                          dtype=np.dtype(case["dtype"]).type)
    params = model.init_params(config, seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab, size=(case["b"], config.seq))
    targets = rng.integers(0, config.vocab, size=(case["b"], config.seq))
    grid = make_grid(case["scheme"], world, case["q"], case["d"])
    try:
        local = module.shard(params, config, grid)

        def step():
            _, cache = module.forward(local, tokens, targets, config, grid)
            module.backward(cache)

        grid.trace.clear()
        step()                                   # traced step (and warm-up)
        events = event_summary(grid.trace.events)
        coords = list(getattr(grid, "coords", (getattr(grid, "rank", 0),)))
        grid.trace.enabled = False
        timing = _time_calls(step, world, repeats)
    finally:
        grid.free()
    return timing, events, coords


_RUNNERS = {"matmul": _run_matmul, "ring": _run_ring, "transformer": _run_transformer}


def worker_main(spec_path: str, out_path: str) -> int:
    """Run the cases of a spec file under MPI; rank 0 writes the results (atomically).

    The spec is ``{"repeats": R, "seed": S, "cases": [case, ...]}`` with cases from
    :func:`matmul_case`, :func:`ring_case` and :func:`transformer_case`.
    """
    from mpi4py import MPI

    from ..comm import cores, default_wait_policy
    from ..mpiutil import abort_on_error, limit_blas_threads
    from .machine import write_json_atomic

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    with abort_on_error(world):
        with open(spec_path, encoding="utf-8") as fh:
            spec = json.load(fh)
        _limits = limit_blas_threads(1 if p > 1 else None)  # noqa: F841 - keep alive
        repeats, seed = int(spec.get("repeats", 5)), int(spec.get("seed", 0))
        results = []
        t_start = time.time()
        for case in spec["cases"]:
            timing, events, coords = _RUNNERS[case["kind"]](case, world, repeats, seed)
            all_events = world.gather(events, root=0)
            all_coords = world.gather(coords, root=0)
            if rank == 0:
                res = dict(case, **timing, events=all_events, coords=all_coords,
                           load=os.getloadavg()[0])
                results.append(res)
                med = statistics.median(timing["spans"])
                print(f"[accuracy p={p}] {case_label(case, p):<48s} median {med * 1e3:9.2f} ms"
                      f"  min {min(timing['spans']) * 1e3:9.2f} ms", flush=True)
        if rank == 0:
            write_json_atomic(out_path, {"p": p, "cores": cores(),
                                         "wait_policy": default_wait_policy(),
                                         "repeats": repeats, "seconds": time.time() - t_start,
                                         "results": results})
    return 0


# --------------------------------------------------------------------------- model side (pure)
def _messages(rank_events):
    from .traffic import MessageClass

    return [MessageClass(op, grp, int(size), int(nb), int(cnt))
            for op, grp, size, nb, cnt in rank_events]


def _tf_scheme_config(res):
    from .schemes import Scheme, TransformerConfig

    q, d = res["q"], res["d"]
    sch = (Scheme.make("megatron", p=res["p"]) if res["scheme"] == "megatron"
           else Scheme.make(res["scheme"], q=q, d=d))
    cfg = TransformerConfig(b=res["b"], s=res["s"], h=res["h"], n=res["heads"], N=res["layers"],
                            v=res["v"], dtype=res["dtype"], checkpoint=False)
    return sch, cfg


def rank_features(res: dict, machine) -> list:
    """:class:`~summasim.costmodel.predict.SharedFeatures` of every rank of one measured
    case (``res``: a worker result with ``p``): its traced events priced with
    ``machine``, plus its compute (GEMMs and additions from the closed forms at its
    grid coordinates; for a training step the row-0 work of
    :func:`~summasim.costmodel.schemes.step_work`)."""
    from .machine import itemsize_of
    from .predict import trace_features
    from .traffic import algorithm_compute

    p, kind, dtype = res["p"], res["kind"], res["dtype"]
    it = itemsize_of(dtype)
    out = []
    if kind == "transformer":
        from .schemes import step_work

        sch, cfg = _tf_scheme_config(res)
        work = step_work(sch, cfg)
    for r, (events, coords) in enumerate(zip(res["events"], res["coords"])):
        extra = {}
        if kind == "matmul":
            w = algorithm_compute(res["algorithm"], res["m"], res["k"], res["n"], res["q"],
                                  res["d"], it, tuple(coords))
            extra = dict(gemms=w.gemms, reduce_bytes=w.reduce_bytes, q=res["q"], d=res["d"])
        elif kind == "ring":
            w = algorithm_compute("ring_allreduce", count=res["N"], p=p, coords=r, itemsize=it)
            extra = dict(reduce_bytes=w.reduce_bytes)
        else:
            extra = dict(gemms=work.gemms, reduce_bytes=work.reduce_bytes,
                         elementwise_items=work.elementwise_items, layers=work.layers,
                         q=res["q"], d=res["d"])
        out.append(trace_features(_messages(events), machine, p=p, dtype=dtype, **extra))
    return out


def predict_result(res: dict, machine) -> float:
    """Predicted seconds of one measured case (the slowest rank; see
    :func:`~summasim.costmodel.predict.predict_features`)."""
    from .predict import predict_features

    return predict_features(rank_features(res, machine), machine,
                            machine.ranks_per_node(res["p"]))


STATISTICS = ("median", "min")


def measured_seconds(res: dict, statistic: str = "median") -> float:
    """The measured time compared with the model: the median span of the repeats
    (``statistic="min"``: the fastest, what a quiet machine would give)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    return statistics.median(res["spans"]) if statistic == "median" else min(res["spans"])


def calibrate(machine, serial: Sequence[dict], shared: Sequence[dict],
              statistic: str = "median"):
    """The machine with ``gamma_elementwise``/``layer_seconds`` fitted on serial
    training steps (``serial``: worker results at p = 1) and the shared-core model
    fitted on oversubscribed runs (``shared``: results with p > cores). Returns
    ``(machine, {"elementwise": err, "shared_core": err})`` (median relative errors)."""
    from .fit import fit_elementwise, fit_shared_core
    from .predict import merge_features
    from .schemes import step_work

    errs = {}
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
            R = machine.ranks_per_node(res["p"]) / machine.cores
            samples.append((R, merge_features(feats), measured_seconds(res, statistic)))
        sc, errs["shared_core"] = fit_shared_core(samples)
        machine = machine.replace(shared_core=sc)
    return machine, errs


def compare(results: Sequence[dict], machine, statistic: str = "median") -> list[dict]:
    """``[{"label", "p", "predicted", "measured", "error", "spread"}, ...]`` per case."""
    rows = []
    for res in results:
        pred = predict_result(res, machine)
        meas = measured_seconds(res, statistic)
        spans = sorted(res["spans"])
        rows.append({"label": case_label(res, res["p"]), "p": res["p"], "predicted": pred,
                     "measured": meas, "error": rel_error(pred, meas),
                     "spread": spans[-1] / spans[0] - 1.0, "key": ranking_key(res)})
    return rows


def ranking_key(res: dict):
    """Cases with the same key solve the same problem on the same p (candidates)."""
    if res["kind"] == "matmul":
        op = res["algorithm"].rsplit("_", 1)[1]
        return f"p={res['p']} C=op(A)op(B) {op} {res['m']}x{res['k']}x{res['n']} {res['dtype']}"
    if res["kind"] == "transformer":
        return (f"p={res['p']} step b{res['b']} s{res['s']} h{res['h']} n{res['heads']} "
                f"v{res['v']} L{res['layers']} {res['dtype']}")
    return None


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


# --------------------------------------------------------------------------- the plan
def default_plan(quick: bool = False) -> dict:
    """The runs: ``calibrate`` (p = 1 serial steps, p = 3 and 4 runs, fitted on) and
    ``heldout`` (p = 8, 9, 16: process counts and sizes the fit never saw), each
    ``{p: [case, ...]}``. Ranking uses every group of candidates that solve the same
    problem on the same p (p = 4 and 16)."""
    tf = transformer_case
    mm = matmul_case
    f = 2 if quick else 1
    cal = {
        1: [tf("megatron", 1, 1, 4, 64, 256, 8, 512, 2), tf("megatron", 1, 1, 8, 128, 256, 8, 512, 1),
            tf("megatron", 1, 1, 4, 64, 512, 8, 1024, 1)],
        3: [mm("summa25_ab", 1, 3, 768, 768, 768), mm("summa25_ab", 1, 3, 1536 // f, 1536 // f, 1536 // f),
            ring_case(1 << 12), ring_case(1 << 17), ring_case(1 << 21),
            tf("summa25", 1, 3, 6, 64, 256, 8, 512, 2)],
        4: [mm("cannon_ab", 2, 1, 512, 512, 512), mm("summa_ab", 2, 1, 1536 // f, 1536 // f, 1536 // f),
            mm("cannon_ab", 2, 1, 1536 // f, 1536 // f, 1536 // f),
            mm("summa25_ab", 1, 4, 1536 // f, 1536 // f, 1536 // f),
            mm("summa_abt", 2, 1, 1024, 1024, 1024), mm("summa_atb", 2, 1, 1024, 1024, 1024),
            ring_case(1 << 12), ring_case(1 << 17), ring_case(1 << 21),
            tf("megatron", 1, 1, 8, 64, 256, 8, 512, 2), tf("optimus", 2, 1, 8, 64, 256, 8, 512, 2),
            tf("summa25", 1, 4, 8, 64, 256, 8, 512, 2)],
    }
    held = {
        8: [mm("summa25_ab", 2, 2, 1024, 1024, 1024), mm("summa25_abt", 2, 2, 2048 // f, 2048 // f, 2048 // f),
            ring_case(1 << 15), ring_case(1 << 20),
            tf("megatron", 1, 1, 8, 64, 256, 8, 512, 2), tf("summa25", 2, 2, 8, 64, 256, 8, 512, 2)],
        9: [mm("cannon_ab", 3, 1, 1152, 1152, 1152), mm("summa_ab", 3, 1, 2304 // f, 2304 // f, 2304 // f),
            mm("summa_atb", 3, 1, 1152, 1152, 1152), ring_case(3 << 18),
            tf("optimus", 3, 1, 6, 48, 288, 6, 576, 2)],
        16: [mm(a, *g, n, n, n) for n in ((1024, 2048) if quick else (1024, 2048, 3072))
             for a, g in (("cannon_ab", (4, 1)), ("summa_ab", (4, 1)), ("summa25_ab", (2, 4)))]
            + [mm("summa_abt", 4, 1, 2048, 2048, 2048), mm("summa_atb", 4, 1, 2048, 2048, 2048),
               ring_case(1 << 16), ring_case(1 << 20), ring_case(1 << 22)]
            + [tf(s, q, d, 16, 64, 256, 16, 512, 2) for s, q, d in
               (("megatron", 1, 1), ("optimus", 4, 1), ("summa25", 2, 4))]
            + [tf(s, q, d, 16, 128, 512, 16, 1024, 1) for s, q, d in
               (("megatron", 1, 1), ("optimus", 4, 1), ("summa25", 2, 4))],
    }
    return {"calibrate": cal, "heldout": held}


# --------------------------------------------------------------------------- launcher
def _mpiexec() -> list[str]:
    exe = os.environ.get("SUMMASIM_MPIEXEC")
    if not exe:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        exe = beside if os.path.exists(beside) else "mpiexec"
    return exe.split() + os.environ.get("SUMMASIM_MPIEXEC_FLAGS", "").split()


def launch(p: int, cases: Sequence[dict], repeats: int, workdir: str, *, timeout: float,
           seed: int = 0, say=print) -> list[dict]:
    """Run ``cases`` under ``mpiexec -n p`` (with ``timeout``); return the results,
    each with ``p`` added."""
    spec = os.path.join(workdir, f"spec-p{p}.json")
    out = os.path.join(workdir, f"measured-p{p}.json")
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"repeats": repeats, "seed": seed, "cases": list(cases)}, fh)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = ["timeout", "-k", "10", str(int(timeout))] + _mpiexec() + [
        "-n", str(p), sys.executable, "-m", "summasim.costmodel", "accuracy-worker", spec, out]
    say(f"$ {' '.join(cmd[4:])}")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the accuracy worker at p={p} failed (exit {proc.returncode}"
                           f"{', timed out' if proc.returncode in (124, 137) else ''})")
    with open(out, encoding="utf-8") as fh:
        data = json.load(fh)
    return [dict(r, p=data["p"]) for r in data["results"]]


def _fit_machine(path: str, timeout: float, say) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = ["timeout", "-k", "10", str(int(timeout))] + _mpiexec() + [
        "-n", "2", sys.executable, "-m", "summasim.costmodel", "fit", "--out", path]
    say(f"$ {' '.join(cmd[4:])}")
    if subprocess.run(cmd, env=env).returncode != 0:
        raise RuntimeError("the machine fit failed")


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
    model. ``measured``: ``{"calibrate": [results], "heldout": [results]}``. Returns
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
    cal = measured["calibrate"]
    serial = [r for r in cal if r["p"] == 1]
    shared = [r for r in cal if machine.ranks_per_node(r["p"]) > machine.cores]
    calibrated, errs = calibrate(machine, serial, shared, statistic)
    rep = {"machine": calibrated.name, "calibration": calibration_report(calibrated),
           "calibration_runs": {f"{k} model": v for k, v in errs.items()}}
    for part in ("calibrate", "heldout"):
        rows = compare(measured[part], calibrated, statistic)
        rep[part] = {"rows": rows, "summary": error_summary(
            [(r["predicted"], r["measured"]) for r in rows], [r["label"] for r in rows])}
    outcomes = ranking(rep["calibrate"]["rows"] + rep["heldout"]["rows"])
    rep["ranking"] = {"outcomes": outcomes, "summary": ranking_summary(outcomes)}
    return rep, calibrated


def build_parser(ap):
    """Arguments of ``python -m summasim.costmodel accuracy``."""
    ap.add_argument("--machine", default=None,
                    help="a fitted machine JSON (default: fit one at p=2 first)")
    ap.add_argument("--out", default=os.path.join("results", "accuracy"),
                    help="folder for the measurements, machines and report (default %(default)s)")
    ap.add_argument("--from", dest="reuse", action="store_true",
                    help="re-analyse the measurements already in --out (no MPI)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per case")
    ap.add_argument("--quick", action="store_true", help="smaller problems (a few minutes less)")
    ap.add_argument("--statistic", choices=STATISTICS, default="median",
                    help="which repeat statistic is the measured time (default %(default)s; "
                         "the report also summarizes the other)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec")
    return ap


def run(args) -> int:
    """The accuracy benchmark (see the module doc)."""
    from .machine import Machine, write_json_atomic

    def say(msg):
        print(msg, flush=True)

    os.makedirs(args.out, exist_ok=True)
    mfile = os.path.join(args.out, "machine-fit.json")
    mpath = os.path.join(args.out, "measured.json")
    t0 = time.time()
    if args.reuse:
        if not os.path.exists(mpath):
            print(f"accuracy: --from needs {mpath} from an earlier run (run without --from "
                  f"first, or give its --out)", file=sys.stderr)
            return 2
        with open(mpath, encoding="utf-8") as fh:
            measured = json.load(fh)
        machine = Machine.load(args.machine or mfile)
    else:
        if args.machine:
            machine = Machine.load(args.machine)
            machine.save(mfile)
        else:
            say("[accuracy] 1/3 fitting the machine at p=2 (no oversubscription)")
            _fit_machine(mfile, args.timeout, say)
            machine = Machine.load(mfile)
        plan = default_plan(args.quick)
        measured = {"calibrate": [], "heldout": []}
        with tempfile.TemporaryDirectory(dir=args.out) as work:
            for part, step in (("calibrate", "2/3 calibration runs"), ("heldout", "3/3 held-out runs")):
                for p, cases in plan[part].items():
                    wait_for_quiet(say=say)
                    say(f"[accuracy] {step}: p={p}, {len(cases)} cases")
                    measured[part] += launch(p, cases, args.repeats, work, timeout=args.timeout,
                                             say=say)
        write_json_atomic(mpath, measured)
    rep, calibrated = analyse(measured, machine, args.statistic)
    calibrated.replace(notes={**calibrated.notes, "accuracy": {
        k: rep[k]["summary"] for k in ("calibrate", "heldout")}}).save(
        os.path.join(args.out, "machine-calibrated.json"))
    rep["seconds"] = round(time.time() - t0, 1)
    write_json_atomic(os.path.join(args.out, "report.json"), rep)
    say("")
    say(report_text(rep))
    say(f"\n[accuracy] wrote {args.out}/report.json, measured.json, machine-calibrated.json "
        f"({rep['seconds']:.0f} s)")
    return 0


# --------------------------------------------------------------------------- machine load
def _proc_cpu_ticks() -> dict[int, tuple[int, int]]:
    """``{pid: (ppid, utime + stime ticks)}`` of every process (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2:].split()
        try:
            out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
        except (IndexError, ValueError):
            continue
    return out


def _descendants(procs: dict, root: int) -> set[int]:
    kids: dict = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(kids.get(pid, ()))
    return out


def foreign_cpu(interval: float = 1.0) -> float:
    """Cores' worth of CPU used by processes outside this process tree over
    ``interval`` seconds (0.0 where /proc is unavailable)."""
    if not os.path.isdir("/proc"):
        return 0.0
    a = _proc_cpu_ticks()
    time.sleep(interval)
    b = _proc_cpu_ticks()
    mine = _descendants(b, os.getpid())
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = sum(t - a[pid][1] for pid, (_, t) in b.items()
               if pid in a and pid not in mine and pid != 0)
    return max(0.0, used / hz / interval)


def wait_for_quiet(limit: float = 0.25, max_wait: float = 600.0, say=print) -> float:
    """Wait until other processes use less than ``limit`` cores (at most ``max_wait``
    seconds); return the foreign load last seen."""
    t0 = time.time()
    load = foreign_cpu()
    told = False
    while load > limit and time.time() - t0 < max_wait:
        if not told:
            say(f"  other processes use {load:.2f} cores; waiting for a quiet machine "
                f"(up to {max_wait:.0f} s)")
            told = True
        time.sleep(5.0)
        load = foreign_cpu()
    return load
