"""Accuracy benchmark of the cost model: predicted against measured, on this machine.

    python -m summasim.costmodel accuracy                  # fit at p = 2, predict p = 8, 9, 16
    python -m summasim.costmodel accuracy --machine results/machine.json
    python -m summasim.costmodel accuracy --from results/accuracy.json   # re-predict only

What it does
------------
1. **Calibration.** Fits a machine with ``mpiexec -n 2 python -m summasim.costmodel fit``
   (or takes ``--machine``) and reports the fit's median relative error per message
   regime: the latency regime (below the eager threshold) and messages of 64 KiB and
   up, over the ping-pong and the concurrent-ring points of the fit.
2. **Held-out accuracy.** Runs the distributed products and the ring all-reduce at
   process counts the fit never saw (p = 8, 9, 16; sizes not used by the fit) and
   compares the measured time with the model's: the mean absolute percentage error
   (MAPE) and the worst case, listing every run.
3. **Ranking.** For a sweep of configurations (n x n products at several n on
   p = 4 and 16; transformer schemes on p = 4 and 16) it asks whether the
   predicted fastest algorithm / grid / scheme is the measured fastest; a
   configuration whose predicted winner is within the measurement noise of the
   measured winner is reported separately ("tied").

Measurements come from a worker run under ``mpiexec`` (``python -m
summasim.costmodel accuracy-worker SPEC OUT``), always under ``timeout``. Each
case is set up once, called once with the trace on (its events are what the
model prices, exactly as ``summasim.run`` does), then timed ``repeats`` times.
A timed call starts after a barrier that waits without spinning, and its time is
the *span* ``max_r t1_r - min_r t0_r`` on the node's common monotonic clock: the
wall time from the first rank's start to the last rank's end. (``summasim.run``
reports the maximum over ranks of each rank's own elapsed time, which under
oversubscription can be far less than the span: a rank that was descheduled
before it read its start time does not count the wait. Both are recorded.)

Statistic: the **median** of the repeats (the minimum is recorded too). On this
2-core machine shared with other work, repeat-to-repeat variation of 20-30% is
normal for communicating algorithms under oversubscription.

Output: a table on the terminal and JSON written atomically under ``results/``.
Only the worker and the launcher touch MPI (the worker imports mpi4py lazily);
everything else here is pure and tested without MPI.
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


def _time_calls(fn, world, repeats: int) -> dict:
    """Per-call spans (after a non-spinning barrier), per-rank maxima, and the
    back-to-back time per call of ``repeats`` calls in a row (seconds)."""
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


def _event_summary(events) -> list:
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
        events = _event_summary(grid.trace.events)
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
        events = _event_summary(comm.trace.events)
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
        events = _event_summary(grid.trace.events)
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


def build_parser(ap):
    """Arguments of ``python -m summasim.costmodel accuracy``."""
    ap.add_argument("--machine", default=None)
    return ap


def run(args) -> int:
    raise NotImplementedError


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
