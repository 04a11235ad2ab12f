"""Freeze the cost model's predictions on the local preset (``local-2core-mpich``).

Run ONCE, before the topology / NCCL / roofline change of issue 10, from the code
as it was (commit 78f7ad6): ``.venv/bin/python tests/data/make_local_predictions.py``.
It writes ``tests/data/local_predictions.json``, which
``tests/test_costmodel_local_frozen.py`` compares the current code against, number
for number (exact equality): the local, shared-memory MPICH machine must predict
exactly what it predicted before the GPU-cluster model was added.

Do not rerun it after changing the cost model: that would freeze the new numbers
and the test would pin nothing.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from summasim.costmodel import collectives as C  # noqa: E402
from summasim.costmodel.machine import load_preset  # noqa: E402
from summasim.costmodel.workload.footprint import largest_batch, memory  # noqa: E402
from summasim.costmodel.workload.layer import scheme_cost  # noqa: E402
from summasim.costmodel.workload.predict import (predict_algorithm, predict_features,
                                                 predict_trace, trace_features)  # noqa: E402
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig  # noqa: E402
from summasim.costmodel.workload.step import model_messages, step_cost, step_work  # noqa: E402

PRESET = "local-2core-mpich"


def collective_cases():
    out = []
    for op in C.OPS:
        for p in (2, 3, 4, 8, 9, 16):
            for nbytes in (8, 4096, 100000, 1 << 22):
                for impl in ("tree", "mpi"):
                    if impl == "mpi" and op != "reduce":
                        continue
                    out.append({"op": op, "p": p, "nbytes": nbytes, "reduce_impl": impl})
    return out


def algorithm_cases():
    out = []
    for name, q, d, m, k, n in (("summa_ab", 2, 1, 96, 64, 80), ("summa_ab", 4, 1, 1536, 1024, 1280),
                                ("summa_abt", 3, 1, 96, 72, 60), ("summa_atb", 4, 1, 256, 512, 128),
                                ("summa_abt", 4, 1, 2048, 1024, 512),
                                ("summa25_ab", 2, 2, 1536, 1024, 1280),
                                ("summa25_abt", 2, 2, 512, 256, 128),
                                ("summa25_atb", 2, 2, 1536, 1024, 1280),
                                ("summa25_atb", 2, 4, 1024, 512, 256),
                                ("cannon_ab", 3, 1, 96, 96, 96), ("cannon_ab", 4, 1, 2048, 2048, 2048)):
        for overlap in (False, True):
            out.append({"name": name, "q": q, "d": d, "m": m, "k": k, "n": n,
                        "overlap": overlap, "dtype": "float64"})
        out.append({"name": name, "q": q, "d": d, "m": m, "k": k, "n": n, "overlap": False,
                    "dtype": "float32", "ranks_per_node": 1})
    for N, P in ((1048579, 16), (65536, 8), (4 << 20, 4), (1000, 9)):
        out.append({"name": "ring_allreduce", "count": N, "p": P, "overlap": False,
                    "dtype": "float64"})
    return out


def scheme_cases():
    out = []
    cfgs = [dict(b=8, s=64, h=96, n=4, N=2, v=128, dtype="float64"),
            dict(b=16, s=128, h=256, n=8, N=3, v=512, dtype="float32"),
            dict(b=36, s=32, h=144, n=12, N=2, v=0, dtype="float64")]
    grids = [("megatron", dict(p=1)), ("megatron", dict(p=2)), ("megatron", dict(p=4)),
             ("megatron", dict(p=8)), ("optimus", dict(q=2)), ("optimus", dict(q=4)),
             ("optimus", dict(q=3)), ("summa25", dict(q=2, d=2)), ("summa25", dict(q=2, d=4))]
    for ci, cfg in enumerate(cfgs):
        for name, kw in grids:
            sch = Scheme.make(name, **kw)
            from summasim.costmodel.workload.scheme import misfit

            c = TransformerConfig(**cfg)
            if misfit(sch, c) is not None:
                continue
            out.append({"scheme": name, "grid": kw, "cfg": cfg})
    return out


def main():
    m = load_preset(PRESET)
    res = {"preset": PRESET, "generated_from": "commit 78f7ad6 (before issue 10)",
           "collectives": [], "algorithms": [], "schemes": []}
    for case in collective_cases():
        cost = C.collective_time(case["op"], case["nbytes"], case["p"], m,
                                 reduce_impl=case["reduce_impl"])
        res["collectives"].append({**case, "seconds": cost.seconds, "algorithm": cost.algorithm})
    for case in algorithm_cases():
        kw = dict(machine=m, dtype=case["dtype"], overlap=case["overlap"], reduce_impl="tree")
        if "ranks_per_node" in case:
            kw["ranks_per_node"] = case["ranks_per_node"]
        if case["name"] == "ring_allreduce":
            pr = predict_algorithm("ring_allreduce", count=case["count"], p=case["p"], **kw)
        else:
            pr = predict_algorithm(case["name"], case["m"], case["k"], case["n"], case["q"],
                                   case["d"], **kw)
        res["algorithms"].append({**case, "seconds": pr.seconds, "comm": pr.comm_seconds,
                                  "compute": pr.compute_seconds, "slowdown": pr.slowdown})
    for case in scheme_cases():
        sch = Scheme.make(case["scheme"], **case["grid"])
        cfg = TransformerConfig(**case["cfg"])
        out = {**case}
        for ck in (False, True):
            sc = scheme_cost(sch, cfg, m, checkpoint=ck, include_minor=ck)
            out[f"scheme_cost_ck{int(ck)}"] = [sc.step_seconds, sc.step_comm_seconds,
                                               sc.step_compute_seconds, sc.memory.total]
        out["memory"] = memory(sch, cfg).total
        out["largest_batch"] = largest_batch(sch, cfg, m.memory_bytes)
        res["schemes"].append(out)
        if not cfg.v:      # a training step has an LM head
            continue
        st = step_cost(sch, cfg, m, reduce_impl="tree")
        out["step_cost"] = [st.seconds, st.comm_seconds, st.compute_seconds, st.slowdown]
        w = step_work(sch, cfg)
        feats = [trace_features(model_messages(sch, cfg, row0=r0), m, p=sch.p, q=sch.q, d=sch.d,
                                gemms=w.gemms, reduce_bytes=w.reduce_bytes,
                                elementwise_items=w.elementwise_items, layers=w.layers,
                                dtype=cfg.dtype, reduce_impl="tree") for r0 in (True, False)]
        out["predict_features"] = predict_features(feats, m, m.ranks_per_node(sch.p))
        out["features"] = [[f.work, f.hops, f.hop_bytes, f.dedicated, f.calls] for f in feats]
        tr = predict_trace(model_messages(sch, cfg), m, p=sch.p, q=sch.q, d=sch.d,
                           gemms=w.gemms, dtype=cfg.dtype, ranks_per_node=1, reduce_impl="tree")
        out["predict_trace_dedicated"] = [tr.seconds, tr.comm_seconds, tr.compute_seconds]
    path = os.path.join(HERE, "local_predictions.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {path}: {len(res['collectives'])} collectives, {len(res['algorithms'])} "
          f"algorithms, {len(res['schemes'])} scheme configurations")


if __name__ == "__main__":
    main()
