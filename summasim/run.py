"""The main job: ``mpirun -n 16 python -m summasim.run``.

Validates, times and reports every distributed algorithm on the grids that fit
the world size:

* 2D algorithms (``cannon_ab``, ``summa_ab``, ``summa_abt``, ``summa_atb``) on a
  q x q grid when p is a perfect square;
* 2.5D algorithms (``summa25_*``) on every [q, q, d] with d >= 2 and d*q*q = p
  (q = 1 only when no q >= 2 fits);
* ``ring_allreduce`` on all p ranks.

Each run draws random inputs from a fixed seed (the same on every rank), splits
them, runs the algorithm, and compares this rank's block with a float64 NumPy
reference of that block (see :mod:`summasim.validate` for the error measure and
the derived bound). It prints one row per run and exits non-zero if any run fails.
What does not fit the world size is listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

ALGORITHMS = {
    # name: (kind, C = op(A) op(B) with op given by "ab"/"abt"/"atb", layouts A, B, C)
    "cannon_ab": ("2d", "ab", "2d", "2d", "2d"),
    "summa_ab": ("2d", "ab", "2d", "2d", "2d"),
    "summa_abt": ("2d", "abt", "2d", "2d", "2d"),
    "summa_atb": ("2d", "atb", "2d", "2d", "2d"),
    "summa25_ab": ("2.5d", "ab", "2.5d", "2d", "2.5d"),
    "summa25_abt": ("2.5d", "abt", "2.5d", "2d", "2.5d"),
    "summa25_atb": ("2.5d", "atb", "2.5d", "2.5d", "2d"),
    "ring_allreduce": ("ring", None, None, None, None),
}
DEFAULT_SIZES = (1536, 1024, 1280)
DEFAULT_RING = 2**20 + 3  # deliberately not divisible by common p
DEFAULT_MACHINE_FILE = os.path.join("results", "machine.json")
CALIBRATED_MACHINE_FILE = os.path.join("results", "accuracy", "machine-calibrated.json")
DEFAULT_TF = (8, 16, 64, 16, 64, 2, 4)  # b, s, h, n, v, layers, ffn_mult


@dataclass
class Planned:
    """One run the job will do (or skip)."""

    algorithm: str
    q: int = 1
    d: int = 1
    shapes: tuple = ()        # (m, k, n) for products, (N,) for the ring
    skip: str = ""            # reason, when skipped

    @property
    def grid_label(self) -> str:
        if ALGORITHMS[self.algorithm][0] == "ring":
            return f"ring p={self.q}"
        return f"{self.q}x{self.q}" if ALGORITHMS[self.algorithm][0] == "2d" else \
            f"[{self.q},{self.q},{self.d}]"


@dataclass
class Row:
    """One line of the report."""

    algorithm: str
    grid: str
    shapes: str
    dtype: str
    error: float
    bound: float
    ok: bool
    seconds: float
    gflops: float | None
    gbytes_per_s: float | None
    bytes_per_rank: int
    messages_per_rank: int
    times: list = field(default_factory=list)
    predicted: float | None = None    # cost-model seconds (slowest rank)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured, or None without a prediction."""
        if self.predicted is None or self.seconds <= 0:
            return None
        return (self.predicted - self.seconds) / self.seconds


# --------------------------------------------------------------------------- planning
def shapes_25d(p: int) -> list[tuple[int, int]]:
    """``(q, d)`` with d >= 2 and d*q*q == p; q = 1 only if no q >= 2 fits."""
    found = [(q, p // (q * q)) for q in range(2, math.isqrt(p) + 1)
             if p % (q * q) == 0 and p // (q * q) >= 2]
    if not found and p >= 2:
        found = [(1, p)]
    if p == 1:
        found = [(1, 1)]
    return found


def stored_shapes(op: str, m: int, k: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global shapes of the stored A and B for C[m, n] = op(A)[m, k] op(B)[k, n]."""
    return {"ab": ((m, k), (k, n)), "abt": ((m, k), (n, k)), "atb": ((k, m), (k, n))}[op]


def required_divisors(algorithm: str, q: int, d: int) -> dict[str, int]:
    """Required divisor of each of m, k, n for an algorithm on a [q, q, d] grid."""
    _, op, la, lb, lc = ALGORITHMS[algorithm]
    from .layout import block_counts

    need = {"m": 1, "k": 1, "n": 1}
    names = {"ab": (("m", "k"), ("k", "n")), "abt": (("m", "k"), ("n", "k")),
             "atb": (("k", "m"), ("k", "n"))}[op]
    for (r, c), lay in zip(names + (("m", "n"),), (la, lb, lc)):
        nr, nc = block_counts(lay, q, d)
        need[r] = math.lcm(need[r], nr)
        need[c] = math.lcm(need[c], nc)
    return need


def fit_sizes(algorithm: str, sizes, q: int, d: int, exact: bool):
    """``(m, k, n)`` for a grid: default sizes are rounded up to fit, user sizes must fit.

    Returns ``(sizes, reason)``; ``reason`` is non-empty when user sizes do not divide.
    """
    need = required_divisors(algorithm, q, d)
    out, bad = [], []
    for name, size in zip("mkn", sizes):
        div = need[name]
        if size % div:
            bad.append(f"{name}={size} is not divisible by {div}")
        out.append(-(-size // div) * div)
    if exact and bad:
        return tuple(sizes), "; ".join(bad)
    return tuple(out), ""


def plan(p: int, algorithms, sizes=None, ring_n: int | None = None) -> list[Planned]:
    """The runs for world size ``p`` (pure: no MPI). ``sizes=None`` uses the defaults."""
    exact = sizes is not None
    sizes = tuple(sizes) if sizes is not None else DEFAULT_SIZES
    out = []
    for name in algorithms:
        kind = ALGORITHMS[name][0]
        if kind == "ring":
            out.append(Planned(name, q=p, shapes=(ring_n or DEFAULT_RING,)))
            continue
        if kind == "2d":
            q = math.isqrt(p)
            if q * q != p:
                out.append(Planned(name, skip=f"needs a square number of ranks (q x q); "
                                               f"p = {p} is not"))
                continue
            grids = [(q, 1)]
        else:
            grids = shapes_25d(p)
        for q, d in grids:
            fitted, reason = fit_sizes(name, sizes, q, d, exact)
            out.append(Planned(name, q=q, d=d, shapes=fitted, skip=reason))
    return out


# --------------------------------------------------------------------------- inputs
def _uniform(seed: int, stream: int, start: int, count: int) -> np.ndarray:
    """``count`` values in [-1, 1) from position ``start`` of random stream ``stream``.

    PCG64 draws one 64-bit word per double, so any slice of a stream is reproducible
    without generating what precedes it (the ring reference uses this).
    """
    bitgen = np.random.PCG64([seed, stream])
    bitgen.advance(start)
    return 2.0 * np.random.Generator(bitgen).random(count) - 1.0


def _matrix(seed: int, stream: int, shape) -> np.ndarray:
    return _uniform(seed, stream, 0, shape[0] * shape[1]).reshape(shape)


# --------------------------------------------------------------------------- running
def _timed(fn, repeats: int, world) -> list[float]:
    """Per-repeat wall time, the maximum over ranks (the algorithm ends with its slowest rank)."""
    from mpi4py import MPI

    times = []
    for _ in range(repeats):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(world.allreduce(dt, op=MPI.MAX))
    return times


def run_product(pl: Planned, dtype, backend, world, repeats: int, seed: int,
                machine=None) -> Row:
    """Validate and time one distributed product."""
    from mpi4py import MPI

    from . import algorithms as algs
    from . import layout
    from .grid import Grid
    from .validate import scaled_error, tolerance

    _, op, la, lb, lc = ALGORITHMS[pl.algorithm]
    m, k, n = pl.shapes
    sa, sb = stored_shapes(op, m, k, n)
    A, B = _matrix(seed, 0, sa), _matrix(seed, 1, sb)                       # float64 globals
    grid = Grid(world, pl.q, pl.d)
    try:
        a = backend.asarray(layout.split(A.astype(dtype), grid, la))
        b = backend.asarray(layout.split(B.astype(dtype), grid, lb))
        fn = getattr(algs, pl.algorithm)
        c = fn(a, b, grid)                                     # the validated (and traced) call
        backend.synchronize()
        ev = list(grid.trace.events)
        coords = grid.coords
        # reference for this rank's C block, in float64 from the same rounded inputs
        opa = A.astype(dtype).astype(np.float64)
        opb = B.astype(dtype).astype(np.float64)
        opa = opa.T if op == "atb" else opa                                   # (m, k)
        opb = opb.T if op == "abt" else opb                                   # (k, n)
        rows, cols = layout.block_slices((m, n), lc, layout.grid_numbers(grid))
        ref = opa[rows] @ opb[:, cols]                                        # C block
        scale = np.abs(opa[rows]) @ np.abs(opb[:, cols])
        err = world.allreduce(scaled_error(backend.to_numpy(c), ref, scale), op=MPI.MAX)
        bound = tolerance(k, dtype)

        def call():
            fn(a, b, grid)
            backend.synchronize()

        grid.trace.enabled = False
        times = _timed(call, repeats, world)
    finally:
        grid.free()
    t = statistics.median(times)
    nbytes = world.allreduce(sum(e.nbytes for e in ev), op=MPI.MAX)
    msgs = world.allreduce(len(ev), op=MPI.MAX)
    pred = None
    if machine is not None:
        from .costmodel.predict import predict_trace
        from .costmodel.traffic import algorithm_compute

        work = algorithm_compute(pl.algorithm, m, k, n, pl.q, pl.d, np.dtype(dtype).itemsize,
                                 coords=coords)
        mine = predict_trace(ev, machine, p=world.Get_size(), q=pl.q, d=pl.d,
                             gemms=work.gemms, reduce_bytes=work.reduce_bytes, dtype=dtype)
        pred = world.allreduce(mine.seconds, op=MPI.MAX)
    return Row(pl.algorithm, pl.grid_label, f"{m}x{k}x{n}", np.dtype(dtype).name, err, bound,
               bool(err <= bound), t, 2.0 * m * k * n / t / 1e9, None, nbytes, msgs, times, pred)


def run_ring(pl: Planned, dtype, backend, world, repeats: int, seed: int,
             machine=None) -> Row:
    """Validate and time ``ring_allreduce`` over all ranks."""
    from mpi4py import MPI

    from .algorithms import chunk_bounds, ring_allreduce
    from .comm import Comm
    from .validate import scaled_error, tolerance

    (N,) = pl.shapes
    p, r = world.Get_size(), world.Get_rank()
    comm = Comm(world.Dup(), name="world")
    try:
        x = backend.asarray(_uniform(seed, 100 + r, 0, N).astype(dtype))
        y = ring_allreduce(x, comm)
        backend.synchronize()
        ev = list(comm.trace.events)
        # every rank checks one chunk of the result against the float64 sum of all inputs
        lo, hi = chunk_bounds(N, p)[r]
        parts = np.stack([_uniform(seed, 100 + s, lo, hi - lo).astype(dtype).astype(np.float64)
                          for s in range(p)])
        err = world.allreduce(scaled_error(backend.to_numpy(y)[lo:hi], parts.sum(0),
                                           np.abs(parts).sum(0)), op=MPI.MAX)
        bound = tolerance(p, dtype)
        out = backend.empty(x.shape, x.dtype)

        def call():
            ring_allreduce(x, comm, out=out)
            backend.synchronize()

        comm.trace.enabled = False
        times = _timed(call, repeats, world)
    finally:
        comm.mpi.Free()
    t = statistics.median(times)
    nbytes = world.allreduce(sum(e.nbytes for e in ev), op=MPI.MAX)
    msgs = world.allreduce(len(ev), op=MPI.MAX)
    pred = None
    if machine is not None:
        from .costmodel.predict import predict_trace
        from .costmodel.traffic import algorithm_compute

        work = algorithm_compute("ring_allreduce", count=N, p=p, coords=r,
                                 itemsize=np.dtype(dtype).itemsize)
        mine = predict_trace(ev, machine, p=p, reduce_bytes=work.reduce_bytes, dtype=dtype)
        pred = world.allreduce(mine.seconds, op=MPI.MAX)
    return Row(pl.algorithm, pl.grid_label, f"N={N}", np.dtype(dtype).name, err, bound,
               bool(err <= bound), t, None, N * np.dtype(dtype).itemsize / t / 1e9, nbytes,
               msgs, times, pred)


# --------------------------------------------------------------------------- report
HEADER = ("algorithm", "grid", "shapes", "dtype", "max rel err", "bound", "result",
          "median s", "GFLOP/s", "MB/rank", "msgs", "predicted s", "pred err")


def format_row(row: Row) -> tuple[str, ...]:
    rate = f"{row.gflops:.2f}" if row.gflops is not None else f"{row.gbytes_per_s:.2f} GB/s"
    return (row.algorithm, row.grid, row.shapes, row.dtype, f"{row.error:.2e}",
            f"{row.bound:.2e}", "OK" if row.ok else "FAIL", f"{row.seconds:.4f}", rate,
            f"{row.bytes_per_rank / 2**20:.2f}", str(row.messages_per_rank),
            "-" if row.predicted is None else f"{row.predicted:.4f}",
            "-" if row.prediction_error is None else f"{100 * row.prediction_error:+.0f}%")


WIDTHS = (14, 11, 16, 7, 11, 9, 6, 9, 14, 8, 4, 11, 8)


def _line(cells) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, WIDTHS)).rstrip()


def format_header() -> str:
    """The table header and its rule."""
    return _line(HEADER) + "\n" + "  ".join("-" * w for w in WIDTHS)


def format_table(rows: list[Row]) -> str:
    """The report table: header, rule and one line per row (fixed column widths, so
    rows can also be printed one by one as they complete)."""
    return "\n".join([format_header()] + [_line(format_row(r)) for r in rows])


def prediction_summary(rows: list[Row], tf_reports=()) -> dict | None:
    """Mean absolute percentage error and worst case of the predictions (algorithm
    rows and transformer fwd + bwd steps), or None."""
    errs = [(abs(r.prediction_error), f"{r.algorithm} {r.grid} {r.dtype}") for r in rows
            if r.prediction_error is not None]
    errs += [(abs(r.prediction_error), f"{r.scheme} {r.grid} {r.dtype} fwd+bwd")
             for r in tf_reports if r.prediction_error is not None]
    if not errs:
        return None
    worst, wlabel = max(errs, key=lambda e: e[0])
    return {"mape": sum(e for e, _ in errs) / len(errs), "worst": worst,
            "worst_run": wlabel, "count": len(errs)}


def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temp file in the same folder + rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- transformer
TF_HEADER = ("scheme", "grid", "dtype", "loss err", "logits err", "grad err", "bound",
             "result", "fwd s", "bwd s", "pred s", "pred err", "L0 fwd items", "Table 1",
             "L0 bwd+ckpt", "Table 1")
TF_WIDTHS = (9, 9, 7, 9, 10, 9, 7, 6, 8, 8, 8, 8, 12, 9, 12, 9)
MEM_HEADER = ("scheme", "grid", "params MiB", "grads MiB", "Adam MiB", "activ. MiB",
              "formula: params", "grads", "Adam", "activ.", "peak fwd+bwd MiB")
MEM_WIDTHS = (9, 9, 10, 9, 8, 10, 15, 8, 8, 8, 16)


def _cells(cells, widths) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def format_transformer(reports) -> str:
    """The transformer validation/traffic table and the memory table."""
    lines = [_cells(TF_HEADER, TF_WIDTHS), "  ".join("-" * w for w in TF_WIDTHS)]
    for r in reports:
        lines.append(_cells((r.scheme, r.grid, r.dtype, f"{r.loss_err:.1e}",
                             f"{r.logits_err:.1e}", f"{r.grad_err:.1e}", f"{r.bound:.0e}",
                             "OK" if r.ok else "FAIL", f"{r.fwd_s:.4f}", f"{r.bwd_s:.4f}",
                             "-" if r.predicted_s is None else f"{r.predicted_s:.4f}",
                             "-" if r.prediction_error is None
                             else f"{100 * r.prediction_error:+.1f}%",
                             str(r.tp_fwd), str(r.table1.get("fwd", "-")),
                             str(r.tp_bwd_checkpoint), str(r.table1.get("bwd_checkpoint", "-"))),
                            TF_WIDTHS))
    mib = lambda x: f"{x / 2**20:.3f}"  # noqa: E731
    lines += ["", _cells(MEM_HEADER, MEM_WIDTHS), "  ".join("-" * w for w in MEM_WIDTHS)]
    for r in reports:
        m, f = r.memory, r.memory_formula
        if not m:
            continue
        lines.append(_cells((r.scheme, r.grid, mib(m["params"]), mib(m["grads"]),
                             mib(m["optimizer"]), mib(m["activations"]), mib(f["params"]),
                             mib(f["grads"]), mib(f["optimizer"]), mib(f["activations"]),
                             mib(m["peak_fwd_bwd"])), MEM_WIDTHS))
    return "\n".join(lines)


def run_transformer_section(args, world, backend, say, machine=None):
    """Validate each tensor-parallel scheme against the serial model (collective)."""
    from .transformer import model
    from .transformer.compare import compare_scheme, grid_label, grid_shapes, preconditions

    b, s_, h, n, v, layers, ffn = args.tf_config
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    p = world.Get_size()
    reports, skipped = [], []
    say(f"\ntransformer: b={b} s={s_} h={h} heads={n} vocab={v} layers={layers} "
        f"ffn={ffn}h, vs the serial model; errors are max|par - ser| / max|ser| over loss, "
        f"logits and every gradient (plain and checkpointed); traffic is layer 0's Table 1 "
        f"payload per rank in scalars\n")
    for name in args.scheme_list:
        shapes = grid_shapes(name, p)
        if not shapes:
            why = ("needs p = q*q" if name == "optimus" else "needs p = d*q*q with q >= 2, d >= 2")
            skipped.append({"scheme": name, "reason": f"{why}; p = {p} does not fit"})
            continue
        for q, d in shapes:
            for dtype in dtypes:
                config = model.Config(vocab=v, seq=s_, hidden=h, heads=n, layers=layers,
                                      ffn_mult=ffn, dtype=np.dtype(dtype).type)
                why = preconditions(name, config, b, p, q, d)
                if why:
                    skipped.append({"scheme": f"{name} {grid_label(name, p, q, d)}",
                                    "reason": why})
                    continue
                bound = 1e-10 if dtype == "float64" else 1e-4
                reports.append(compare_scheme(name, world, q, d, config, b, seed=args.seed,
                                              repeats=args.repeats, backend=None, bound=bound,
                                              machine=machine))
    if reports:
        say(format_transformer(reports))
    for sk in skipped:
        say(f"  skipped {sk['scheme']}: {sk['reason']}")
    return reports, skipped


# --------------------------------------------------------------------------- cost model
def resolve_machine(spec: str | None, world, say):
    """The cost-model Machine on every rank: a file, a preset, the saved default, or a
    quick fit on two ranks (the others wait without spinning), saved for next time."""
    from .costmodel.machine import Machine, get_machine, list_presets

    if spec is not None:
        if os.path.exists(spec):
            machine = get_machine(spec)
        elif spec in list_presets():
            machine = get_machine(preset=spec)
        else:
            raise ValueError(f"--machine {spec!r}: no such file, and not a preset "
                             f"({', '.join(list_presets())})")
        say(f"cost model: machine {machine.name!r} from {spec}")
        return machine
    if os.path.exists(CALIBRATED_MACHINE_FILE):
        say(f"cost model: machine calibrated by the accuracy benchmark, "
            f"{CALIBRATED_MACHINE_FILE}")
        return Machine.load(CALIBRATED_MACHINE_FILE)
    if os.path.exists(DEFAULT_MACHINE_FILE):
        say(f"cost model: machine fitted earlier, {DEFAULT_MACHINE_FILE} (delete it to re-fit)")
        return Machine.load(DEFAULT_MACHINE_FILE)
    if world.Get_size() < 2:
        say("cost model: one rank cannot fit a machine; using the preset local-2core-mpich")
        return get_machine(preset="local-2core-mpich")
    from .costmodel.fit import run_fit

    say(f"cost model: no machine given and no {DEFAULT_MACHINE_FILE}; fitting a quick one "
        f"on 2 ranks first")
    rank = world.Get_rank()
    sub = world.Split(0 if rank < 2 else 1, rank)
    fitted = None
    if rank < 2:
        fitted = run_fit(sub, quick=True, gemm_sizes=(128, 256, 512, 1024),
                         say=lambda m: say(f"  {m}"))
    sub.Free()
    data = fitted.to_dict() if fitted is not None else None
    req = world.Ibarrier()  # idle ranks sleep instead of spinning against the fit
    while not req.Test():
        time.sleep(1e-3)
    machine = Machine.from_dict(world.bcast(data, root=0))
    machine = borrow_run_models(machine, say)
    if rank == 0:
        machine.save(DEFAULT_MACHINE_FILE)
        say(f"cost model: saved the fit to {DEFAULT_MACHINE_FILE}")
    return machine


def borrow_run_models(machine, say, preset: str = "local-2core-mpich"):
    """A quick fit measures links and GEMMs only: take the run-level models (the
    shared-core model of oversubscribed runs, elementwise and per-layer seconds of
    training steps) from ``preset`` when it was calibrated on a machine with the same
    core count, and say so."""
    from .costmodel.machine import load_preset

    ref = load_preset(preset)
    if machine.shared_core is not None or ref.shared_core is None or ref.cores != machine.cores:
        return machine
    say(f"cost model: oversubscription and elementwise models from the preset {preset} "
        f"(calibrated on {ref.cores} cores; `python -m summasim.costmodel accuracy` "
        f"calibrates this machine's own)")
    return machine.replace(shared_core=ref.shared_core, gamma_elementwise=ref.gamma_elementwise,
                           layer_seconds=ref.layer_seconds)


# --------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m summasim.run",
        description="Validate, time and report summasim's distributed algorithms on the "
                    "grids that fit the MPI world size. Run it under mpirun, e.g. "
                    "`mpirun -n 16 python -m summasim.run`.")
    ap.add_argument("--sizes", nargs=3, type=int, metavar=("M", "K", "N"),
                    help="global sizes of C[M, N] = op(A)[M, K] op(B)[K, N]; they must divide "
                         "the grid (runs that do not fit are skipped with the reason). "
                         f"Default {' '.join(map(str, DEFAULT_SIZES))}, rounded up per grid.")
    ap.add_argument("--ring-size", type=int, default=None, metavar="N",
                    help=f"length of the ring_allreduce vector (default {DEFAULT_RING})")
    ap.add_argument("--dtype", choices=("float64", "float32", "both"), default="float64",
                    help="element type (default float64)")
    ap.add_argument("--backend", choices=("numpy", "cupy", "staged-host"), default="numpy",
                    help="array backend: numpy (CPU), cupy (GPU), or staged-host (NumPy through "
                         "the GPU staging path, for testing it on a CPU)")
    ap.add_argument("--algorithms", default="all",
                    help="comma-separated subset of: " + ", ".join(ALGORITHMS) + " (default all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per run; the median "
                    "is reported (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS threads per rank (default 1 when p > 1, else the library's)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH "
                    "(atomically), e.g. results/run.json")
    ap.add_argument("--machine", metavar="FILE|PRESET",
                    help="cost-model machine for the predicted times: a JSON file from "
                         "`python -m summasim.costmodel fit` or a preset name. Default: "
                         f"{DEFAULT_MACHINE_FILE} if it exists, else a quick fit (a few "
                         "seconds, on 2 ranks) saved there")
    ap.add_argument("--no-predict", action="store_true",
                    help="skip the cost-model predictions")
    ap.add_argument("--schemes", default="all",
                    help="tensor-parallel transformer schemes to validate: comma-separated "
                         "subset of megatron, optimus, summa25, or 'none' (default all)")
    ap.add_argument("--tf-config", nargs=7, type=int, default=list(DEFAULT_TF),
                    metavar=("B", "S", "H", "N", "V", "L", "F"),
                    help="transformer section: batch, sequence, hidden, heads, vocab, layers, "
                         "ffn multiplier (default " + " ".join(map(str, DEFAULT_TF)) + ", which "
                         "every scheme can shard at p = 16)")
    ap.add_argument("--fail-on-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = list(ALGORITHMS) if args.algorithms == "all" else \
        [s.strip() for s in args.algorithms.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALGORITHMS]
    if unknown or not names:
        ap.error(f"unknown algorithm(s) {', '.join(unknown) or '(none given)'}; choose from "
                 + ", ".join(ALGORITHMS))
    args.algorithm_list = names
    from .transformer.compare import SCHEME_NAMES

    schemes = [] if args.schemes == "none" else list(SCHEME_NAMES) if args.schemes == "all" \
        else [x.strip() for x in args.schemes.split(",") if x.strip()]
    bad = [x for x in schemes if x not in SCHEME_NAMES]
    if bad:
        ap.error(f"unknown scheme(s) {', '.join(bad)}; choose from {', '.join(SCHEME_NAMES)}")
    args.scheme_list = schemes
    if min(args.tf_config) < 1:
        ap.error("--tf-config values must be positive")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.sizes and min(args.sizes) < 1:
        ap.error("--sizes must be positive")
    if args.ring_size is not None and args.ring_size < 1:
        ap.error("--ring-size must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    from .mpiutil import abort_on_error, limit_blas_threads

    world = MPI.COMM_WORLD
    with abort_on_error(world):
        return _main(args, world, limit_blas_threads, MPI)


def _main(args, world, limit_blas_threads, MPI) -> int:
    from .backends import get_backend
    from .comm import default_wait_policy

    t_start = time.perf_counter()
    p, rank = world.Get_size(), world.Get_rank()
    _threads = limit_blas_threads(args.threads)  # noqa: F841 - keep the limit alive
    backend = get_backend(args.backend)
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    runs = plan(p, args.algorithm_list, args.sizes, args.ring_size)
    say = print if rank == 0 else (lambda *a, **k: None)
    why = getattr(backend, "comm_mode_reason", "")
    say(f"summasim.run: p = {p} ranks, backend {backend.name} (MPI path: {backend.comm_mode}"
        f"{': ' + why if why else ''}), wait policy {default_wait_policy()}, "
        f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}")
    say(f"error = max |C - C_ref| / (|A||B|) per entry; bound = 8 sqrt(k) (u + u_64) "
        f"(summasim.validate)\n")

    machine = None if args.no_predict else resolve_machine(args.machine, world, say)
    say(format_header(), flush=True)
    rows: list[Row] = []
    for dtype in dtypes:
        for pl in runs:
            if pl.skip:
                continue
            if args.fail_on_rank is not None and rank == args.fail_on_rank:
                raise RuntimeError(f"deliberate failure on rank {rank} (--fail-on-rank)")
            runner = run_ring if ALGORITHMS[pl.algorithm][0] == "ring" else run_product
            rows.append(runner(pl, np.dtype(dtype), backend, world, args.repeats, args.seed,
                               machine))
            say(_line(format_row(rows[-1])), flush=True)
    skipped = [pl for pl in runs if pl.skip]
    if skipped:
        say("\nskipped:")
        for pl in skipped:
            say(f"  {pl.algorithm}: {pl.skip}")
    tf_reports, tf_skipped = run_transformer_section(args, world, backend, say, machine) \
        if args.scheme_list else ([], [])
    ok = all(r.ok for r in rows) and all(r.ok for r in tf_reports)
    summary = prediction_summary(rows, tf_reports)
    if summary:
        say(f"\ncost model ({machine.name}): MAPE {100 * summary['mape']:.1f}% over "
            f"{summary['count']} runs, worst {100 * summary['worst']:.1f}% "
            f"({summary['worst_run']})")
    elapsed = time.perf_counter() - t_start
    passed = sum(r.ok for r in rows) + sum(r.ok for r in tf_reports)
    failed = len(rows) + len(tf_reports) - passed
    say(f"\n{passed} passed, {failed} failed, {len(skipped) + len(tf_skipped)} skipped in "
        f"{elapsed:.1f} s")
    if args.json and rank == 0:
        write_json_atomic(args.json, {
            "world_size": p, "backend": backend.name, "comm_mode": backend.comm_mode,
            "wait_policy": default_wait_policy(), "ok": ok, "elapsed_s": elapsed,
            "machine": machine.name if machine else None, "prediction": summary,
            "rows": [dict(asdict(r), prediction_error=r.prediction_error) for r in rows],
            "skipped": [{"algorithm": s.algorithm, "reason": s.skip} for s in skipped],
            "transformer": [asdict(r) for r in tf_reports],
            "transformer_skipped": tf_skipped})
        say(f"report written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
