"""``python -m summasim.costmodel {explore,fit,accuracy,presets,table1}``.

``explore``, ``presets`` and ``table1`` never import MPI; ``fit`` and
``accuracy-worker`` must run under ``mpiexec`` (they import mpi4py only then);
``accuracy`` launches ``mpiexec`` itself.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def _bytes(text: str) -> int:
    """"4M", "64MiB", "512k", "1048576" -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4M, 64MiB, 8192)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _fit_main(args) -> int:
    from mpi4py import MPI  # only the fit needs MPI

    from .fit import run_fit

    comm = MPI.COMM_WORLD
    try:
        machine = run_fit(comm, quick=args.quick, max_bytes=args.max_bytes,
                          group_sizes=args.groups, gemm_sizes=args.gemm_sizes,
                          dtypes=tuple(args.dtypes.split(",")),
                          threshold=None if args.threshold == "auto" else _bytes(args.threshold),
                          name=args.name, command=" ".join(["python -m summasim.costmodel"]
                                                           + sys.argv[1:]))
    except Exception as exc:  # one rank failing must not leave the others waiting
        print(f"[fit] rank {comm.Get_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        comm.Abort(1)
        return 1
    if comm.Get_rank() == 0:
        machine.save(args.out)
        print(f"[fit] wrote {args.out}", flush=True)
    return 0


def main(argv=None) -> int:
    from . import explore
    from .machine import get_machine, list_presets

    ap = argparse.ArgumentParser(prog="python -m summasim.costmodel",
                                 description="summasim cost model: explore, fit, presets")
    sub = ap.add_subparsers(dest="cmd", required=True)
    explore.build_parser(sub.add_parser("explore", help="scaling sweeps and what-ifs (no MPI)",
                                        description=explore.__doc__.splitlines()[0]))
    fp = sub.add_parser("fit", help="fit a machine from microbenchmarks (run under mpiexec)")
    fp.add_argument("--out", default="results/machine.json", help="machine JSON to write")
    fp.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    fp.add_argument("--max-bytes", type=_bytes, default=None,
                    help="largest message (default 64MiB, quick 4MiB)")
    fp.add_argument("--groups", type=_ints, default=None,
                    help="collective group sizes, e.g. 2,4 (default: powers of two)")
    fp.add_argument("--gemm-sizes", type=_ints, default=None, help="GEMM block sizes n")
    fp.add_argument("--dtypes", default="float64,float32", help="GEMM dtypes")
    fp.add_argument("--threshold", default="auto",
                    help="eager/rendezvous split in bytes, or 'auto': the MPI library's own "
                         "(MPICH: 8192, its CMA threshold), else the best split")
    fp.add_argument("--name", default=None, help="machine name")
    pp = sub.add_parser("presets", help="list presets, or print one as JSON")
    pp.add_argument("name", nargs="?")
    from . import accuracy

    accuracy.build_parser(sub.add_parser(
        "accuracy", help="predicted vs measured on this machine (launches mpiexec)",
        description=accuracy.__doc__.splitlines()[0]))
    wp = sub.add_parser("accuracy-worker", help="(internal) the accuracy benchmark's MPI "
                        "worker: run under mpiexec")
    wp.add_argument("spec", help="JSON spec of the cases to time")
    wp.add_argument("out", help="JSON file rank 0 writes")
    tp = sub.add_parser("table1", help="the Optimus paper's Table 1 from the model")
    for flag, default in (("--b", 8), ("--s", 512), ("--h", 1024), ("--p", 16)):
        tp.add_argument(flag, type=int, default=default)
    args = ap.parse_args(argv)

    if args.cmd == "explore":
        try:
            explore.run(args)
        except ValueError as exc:
            print(f"explore: error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "fit":
        return _fit_main(args)
    if args.cmd == "accuracy":
        return accuracy.run(args)
    if args.cmd == "accuracy-worker":
        return accuracy.worker_main(args.spec, args.out)
    if args.cmd == "presets":
        if args.name:
            try:
                print(json.dumps(get_machine(preset=args.name).to_dict(), indent=2))
            except ValueError as exc:
                print(f"presets: error: {exc}", file=sys.stderr)
                return 2
        else:
            for name in list_presets():
                m = get_machine(preset=name)
                print(f"{name:<22s} {m.source[:100]}")
        return 0
    from .schemes import table1, table1_paper

    print(f"Optimus Table 1 at b={args.b} s={args.s} h={args.h} p={args.p} "
          f"(model value == paper formula)")
    for scheme in ("megatron", "optimus"):
        try:
            ours, paper = table1(scheme, args.b, args.s, args.h, args.p), \
                table1_paper(scheme, args.b, args.s, args.h, args.p)
        except ValueError as exc:
            print(f"  {scheme}: {exc}")
            continue
        for key in paper:
            print(f"  {scheme:<9s} {key:<23s} {float(ours[key]):>16.6g}  "
                  f"{'==' if ours[key] == paper[key] else '!='} {float(paper[key]):.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
