"""How much headroom each derived training bound has: a sweep over dtype x scheme or mesh
x size x steps that records each check's largest observed error over its bound.

    mpiexec -n 4 python scripts/bounds-sweep.py [--quick] [--json results/bounds-sweep.json]

Each row runs one case through the harness's own executors (summasim.harness.composed.
run_mesh for meshes, summasim.harness.transformer.run_transformer for a scheme's single
step) and reports error / bound for the loss, the gradients and (meshes) the parameters
through Adam, and (schemes) the logits. A ratio at or below 1 passes; the table at the
end is the largest ratio per dtype and check. The bounds are derived in
summasim/validate.py (training_tolerance, adam_step_bound), never fitted to this sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def cases(p: int, quick: bool):
    """``(kind, label, case)`` of the sweep at p ranks."""
    from summasim.harness.cases import MeshCase, TransformerCase
    from summasim.spec import grids
    from summasim.transformer.model import Config

    # (hidden, heads, layers, seq, global batch, vocab, steps, every mesh): b s from 1024
    # to 8192, h from 256 to 1024, 1 to 10 steps; every mesh and scheme at the first two
    # sizes, a data-parallel and a 2D mesh and the schemes at the larger ones (a float64
    # serial model of 8192 tokens takes minutes on two cores)
    sizes = [(256, 8, 2, 64, 16, 512, 3, True), (512, 8, 1, 64, 32, 512, 5, True),
             (256, 8, 1, 128, 64, 256, 10, False)]
    if not quick:
        sizes.append((1024, 16, 1, 64, 16, 512, 3, False))
    every = [f"dp={p}", f"dp={p // 2},tp=megatron:2", f"dp={p // 2},pp=2",
             f"tp=megatron:{p}"] + [f"tp={g}" for s in ("optimus", "summa25")
                                    for g in grids(p, s)]
    few = [every[0]] + [f"tp={g}" for g in grids(p, "optimus")][:1]
    out = []
    for h, heads, layers, seq, batch, vocab, steps, all_meshes in sizes:
        meshes = every if all_meshes else few
        for dtype in (np.float64, np.float32):
            config = Config(vocab=vocab, seq=seq, hidden=h, heads=heads,
                            layers=max(layers, 2), dtype=dtype)
            for text in meshes:
                zero = len(out) % 4
                case = MeshCase.parse(text, batch, config, zero=zero, microbatches=2,
                                      steps=steps)
                if case.misfit(p) == "":
                    out.append(("mesh", f"{case.spec} z{zero}", case))
            for scheme in ("megatron", "optimus", "summa25"):
                for g in grids(p, scheme, config, batch):
                    out.append(("scheme", g.label, TransformerCase(scheme, g.q, g.d, batch,
                                                                   config)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the h = 1024 size")
    ap.add_argument("--json", help="also write the rows as JSON")
    ap.add_argument("--from-case", type=int, default=1, metavar="I",
                    help="start at case I of the list (to resume a sweep)")
    args = ap.parse_args(argv)
    from mpi4py import MPI

    from summasim.harness.composed import run_mesh
    from summasim.harness.transformer import run_transformer
    from summasim.mpiutil import abort_on_error, limit_blas_threads

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    _threads = limit_blas_threads(1)  # noqa: F841
    rows = []
    with abort_on_error(world):
        todo = cases(p, args.quick)
        for i, (kind, label, case) in enumerate(todo):
            if i + 1 < args.from_case:
                continue
            t0 = time.perf_counter()
            if kind == "mesh":
                r = run_mesh(case, world, repeats=0, timed=False).extra["report"]
                got = {"loss": r.loss_err / r.bound, "grad": r.grad_err / r.bound,
                       "param": r.param_err}
            else:
                r = run_transformer(case, world, repeats=0, timed=False,
                                    with_memory=False).extra["report"]
                got = {"loss": r.loss_err / r.bound, "logits": r.logits_err / r.bound,
                       "grad": r.grad_err / r.bound}
            c = case.config
            row = {"kind": kind, "case": label, "dtype": np.dtype(c.dtype).name,
                   "h": c.hidden, "layers": c.layers, "tokens": case.batch * c.seq,
                   "steps": getattr(case, "steps", 1), "bound": r.bound, "ok": r.ok,
                   **{f"{k}/bound": v for k, v in got.items()},
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            if rank == 0:
                print(f"[{i + 1}/{len(todo)}] {kind:6s} {label:28s} {row['dtype']:7s} "
                      f"h={c.hidden:<5d} L={c.layers} bs={row['tokens']:<5d} "
                      f"steps={row['steps']:<2d} bound={r.bound:.1e} "
                      + " ".join(f"{k}={v:.2e}" for k, v in got.items())
                      + f" {'OK' if r.ok else 'FAIL'} {row['seconds']}s", flush=True)
    if rank == 0:
        print("\nlargest observed error / bound (<= 1 passes)")
        checks = ("loss", "logits", "grad", "param")
        print(f"{'dtype':8s} " + " ".join(f"{c:>8s}" for c in checks) + "   runs  failed")
        for dt in ("float64", "float32"):
            sel = [r for r in rows if r["dtype"] == dt]
            worst = [max([r[f"{c}/bound"] for r in sel if f"{c}/bound" in r] or [float("nan")])
                     for c in checks]
            print(f"{dt:8s} " + " ".join(f"{w:8.2e}" for w in worst)
                  + f"  {len(sel):5d}  {sum(not r['ok'] for r in sel):6d}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(rows, fh, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
