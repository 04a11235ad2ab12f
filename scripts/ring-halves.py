"""Time ZeRO's two ring halves on a backend's arrays, each staging path side by side.

    mpiexec -n 4 python scripts/ring-halves.py [--backend cupy|staged-host]
                                               [--sizes-mib 0.0625,...] [--repeats 15]

For each size: the in-place ``ring_reduce_scatter`` and ``ring_allgather`` of a vector
of that many MiB (float64), on a communicator that stages whole vectors (one pinned host
copy each way, the host ring on it) and on one that stages every ring step, and MPI's
``Reduce_scatter_block`` / ``Allgather`` on one pinned host copy (what a user without a
CUDA-aware MPI writes first). Interleaved call by call, with the collective agreement on
the arguments switched off as in ``bench allreduce``; median of the spans (slowest
rank's end minus first rank's start). Each path's result is checked against NumPy once
per size. On a device backend this finds where ``Comm.stage_whole_limit`` (the
all-reduce's 16 MiB) should sit for the halves (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from mpi4py import MPI

from summasim.algorithms import chunk_bounds, ring_allgather, ring_reduce_scatter
from summasim.backends import get_backend
from summasim.comm import Comm
from summasim.harness.timing import time_calls
from summasim.mpiutil import agreement


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cupy", choices=("cupy", "staged-host"),
                    help="a staging backend: cupy (GPU), or staged-host (NumPy through the "
                         "staging code, for a check without a GPU)")
    ap.add_argument("--sizes-mib", default="0.0625,0.25,1,4,16,64")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    try:
        sizes = [float(v) for v in args.sizes_mib.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0 or args.repeats < 1:
        ap.error(f"--sizes-mib takes positive numbers, comma-separated (got "
                 f"{args.sizes_mib!r}), and --repeats at least 1 (got {args.repeats})")
    world = MPI.COMM_WORLD
    p, r = world.Get_size(), world.Get_rank()
    be = get_backend(args.backend)
    comms = {}
    for name, limit in (("whole", 1 << 50), ("steps", 0)):
        comms[name] = Comm(world.Dup(), name="world", backend=be)
        comms[name].trace.enabled = False
        comms[name].stage_whole_limit = limit
    raw = world.Dup()
    say = print if r == 0 else (lambda *a, **k: None)
    say(f"p = {p}, backend {args.backend} ({be.comm_mode}), float64, median of "
        f"{args.repeats}; ms whole-staged / step-staged / MPI on a host copy")
    say(f"{'MiB':>8} {'RS whole':>9} {'RS steps':>9} {'RS MPI':>9} "
        f"{'AG whole':>9} {'AG steps':>9} {'AG MPI':>9}  check")
    bad = 0
    for mib in sizes:
        n = max(p, int(mib * 2**20) // 8 // p * p)
        hx = np.random.default_rng(r).standard_normal(n)
        ref = np.empty_like(hx)
        world.Allreduce(hx, ref)
        bounds = chunk_bounds(n, p)
        mine = (r + 1) % p
        c0, c1 = bounds[mine]
        x0 = be.asarray(hx)
        buf = be.empty(hx.shape, hx.dtype)
        hbuf = be.pinned_empty(hx.nbytes).view(hx.dtype)[:n]
        hout = be.pinned_empty(hx.nbytes).view(hx.dtype)[:n]
        gathered = np.empty_like(hx)          # the all-gather's expected result
        for c, (a, b) in enumerate(bounds):
            gathered[a:b] = np.random.default_rng((c - 1) % p).standard_normal(n)[a:b]
        hg = gathered[c0:c1].copy()

        def reset_rs():
            buf[...] = x0
            be.synchronize()

        def reset_ag():
            buf[...] = x0
            buf[c0:c1] = be.asarray(hg)
            be.synchronize()

        def rs(name):
            return lambda: (ring_reduce_scatter(buf, comms[name]), be.synchronize())

        def ag(name):
            return lambda: (ring_allgather(buf, comms[name]), be.synchronize())

        def mpi_rs():
            be.synchronize()
            be.copy_to_host(buf, hbuf)
            raw.Reduce_scatter_block(hbuf, hout[:n // p])
            buf[:n // p] = be.asarray(hout[:n // p])
            be.synchronize()

        def mpi_ag():
            be.synchronize()
            be.copy_to_host(buf[c0:c1], hbuf[:c1 - c0])
            raw.Allgather(hbuf[:c1 - c0], hout)
            be.copy_from_host(hout, buf)
            be.synchronize()

        cases = {"RS whole": (reset_rs, rs("whole")), "RS steps": (reset_rs, rs("steps")),
                 "RS MPI": (reset_rs, mpi_rs), "AG whole": (reset_ag, ag("whole")),
                 "AG steps": (reset_ag, ag("steps")), "AG MPI": (reset_ag, mpi_ag)}
        ok = True
        for name, (reset, call) in cases.items():     # each checked once
            reset()
            call()
            got = be.to_numpy(buf)
            if name == "RS MPI":
                ok &= np.allclose(got[:n // p], ref[r * (n // p):(r + 1) * (n // p)])
            elif name.startswith("RS"):
                ok &= np.allclose(got[c0:c1], ref[c0:c1])
            elif name == "AG MPI":      # MPI gathers rank k's chunk (k + 1) % p in rank order
                ok &= np.allclose(got, np.concatenate([
                    gathered[slice(*bounds[(k + 1) % p])] for k in range(p)]))
            else:
                ok &= np.array_equal(got, gathered)
        ok = world.allreduce(bool(ok), op=MPI.LAND)
        bad += not ok
        t = {k: [] for k in cases}
        with agreement(False):     # as in bench allreduce: the calls, not the arguments' check
            for i in range(args.repeats):
                names = list(cases)
                for k in names[i % len(names):] + names[:i % len(names)]:
                    reset, call = cases[k]
                    reset()
                    t[k] += time_calls(call, world, 1, adaptive=False)["spans"]
        say(f"{mib:>8g} " + " ".join(f"{1e3 * statistics.median(t[k]):>9.3f}" for k in cases)
            + f"  {'OK' if ok else 'FAIL'}")
    for c in comms.values():
        c.mpi.Free()
    raw.Free()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
