"""Freeze the cost model's predictions on every preset, and of compositions.

Run ONCE, before the cost model was rearranged by concept (issue "One vocabulary, one
house"): ``.venv/bin/python tests/data/make_frozen_predictions.py``. It writes
``tests/data/preset_predictions.json``: each preset's machine as it was (so a later
recalibration of a preset does not move the pins) and, on it, collective times (MPICH
and, where the machine uses NCCL, NCCL over its topology), algorithm predictions,
scheme costs, memory and largest batches, training steps (``step_cost``,
``step_breakdown``), compositions (``price_composition`` over dp, pp, tensor grids,
ZeRO 0-3, both schedules, several micro-batch counts, checkpointing on and off) and the
dev set's step and composition points. ``tests/test_costmodel_frozen_presets.py``
recomputes every case with :func:`evaluate` and compares for EXACT equality.

Do not rerun it after changing the cost model: that would freeze the new numbers and
the test would pin nothing.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from summasim.costmodel import collectives as C  # noqa: E402
from summasim.costmodel.collectives.nccl import OPS as NCCL_OPS, nccl_time  # noqa: E402
from summasim.costmodel.machine import Machine, load_preset  # noqa: E402
from summasim.costmodel.machine.topology import GridShape, Placement, group_path  # noqa: E402
from summasim.costmodel.workload.composition import predict_case, price_composition  # noqa: E402
from summasim.costmodel.workload.footprint import largest_batch, memory  # noqa: E402
from summasim.costmodel.workload.layer import scheme_cost  # noqa: E402
from summasim.costmodel.workload.predict import predict_algorithm  # noqa: E402
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig, misfit  # noqa: E402
from summasim.costmodel.workload.step import step_breakdown, step_cost  # noqa: E402
from summasim.costmodel.workload.zero import StateBytes  # noqa: E402

PRESETS = ("h100-dgx-ndr", "dgx-a100", "dgx2h-v100", "frontera-rtx", "local-2core-mpich")
PATH = os.path.join(HERE, "preset_predictions.json")

MODELS = [dict(b=16, s=128, h=256, n=8, N=4, v=512, dtype="float32"),
          dict(b=32, s=512, h=1024, n=16, N=8, v=4096, dtype="bfloat16", checkpoint=False),
          dict(b=64, s=256, h=768, n=12, N=6, v=0, dtype="float16")]
GRIDS = [("megatron", dict(p=1)), ("megatron", dict(p=4)), ("megatron", dict(p=8)),
         ("optimus", dict(q=2)), ("optimus", dict(q=4)),
         ("summa25", dict(q=2, d=2)), ("summa25", dict(q=2, d=4)), ("summa25", dict(q=4, d=2)),
         ("summa25", dict(q=2, d=16))]


def _plain(x):
    """``x`` as JSON would give it back (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(x, default=str))


def model_of(mi: int, m: Machine) -> TransformerConfig:
    """Model ``mi`` in its dtype, or float32 where ``m`` has no GEMM rate for that dtype."""
    cfg = dict(MODELS[mi])
    if cfg["dtype"] not in m.gamma_gemm:
        cfg["dtype"] = "float32"
    return TransformerConfig(**cfg)


def machine_of(machines: dict, name: str) -> Machine:
    return Machine.from_dict(machines[name])


def cases_for(preset: str, m: Machine) -> list[dict]:
    out = []
    nccl = m.library == "nccl" and m.topology is not None
    for op in C.OPS:
        for p in (2, 4, 8, 16, 64):
            for nbytes in (8, 65536, 1 << 22, 1 << 28):
                out.append({"kind": "collective", "op": op, "p": p, "nbytes": nbytes})
                if nccl and op in NCCL_OPS:
                    out.append({"kind": "nccl", "op": op, "p": p, "nbytes": nbytes,
                                "placement": "row-major"})
    if nccl:
        for op in ("allreduce", "allgather"):
            for q, d, kind in ((4, 1, "row"), (4, 1, "col"), (2, 4, "depth"), (4, 2, "layer")):
                for pl in ("row-major", "blocked"):
                    out.append({"kind": "nccl_grid", "op": op, "q": q, "d": d, "group": kind,
                                "nbytes": 1 << 24, "placement": pl})
    for name, q, d, mm, k, n in (("summa_ab", 4, 1, 4096, 4096, 4096),
                                 ("summa_abt", 2, 1, 1024, 512, 2048),
                                 ("summa_atb", 4, 1, 2048, 1024, 512),
                                 ("summa25_ab", 2, 2, 2048, 2048, 2048),
                                 ("summa25_abt", 2, 4, 1024, 1024, 1024),
                                 ("summa25_atb", 2, 4, 2048, 1024, 4096),
                                 ("cannon_ab", 4, 1, 4096, 4096, 4096)):
        for dtype in ("float32", "float16" if "float16" in m.gamma_gemm else "float64"):
            out.append({"kind": "algorithm", "name": name, "q": q, "d": d, "m": mm, "k": k,
                        "n": n, "dtype": dtype, "overlap": dtype != "float32"})
    for count, p in ((1 << 20, 8), (1 << 24, 16), (1000, 4)):
        out.append({"kind": "algorithm", "name": "ring_allreduce", "count": count, "p": p,
                    "dtype": "float32", "overlap": False})
    for mi, cfg in enumerate(MODELS):
        for name, kw in GRIDS:
            sch = Scheme.make(name, **kw)
            if misfit(sch, model_of(mi, m)) is not None:
                continue
            out.append({"kind": "scheme", "model": mi, "scheme": name, "grid": kw})
            if cfg["v"]:
                out.append({"kind": "step", "model": mi, "scheme": name, "grid": kw})
    # compositions
    comp_grids = [("megatron", dict(p=1)), ("megatron", dict(p=4)), ("optimus", dict(q=2)),
                  ("summa25", dict(q=2, d=2)), ("summa25", dict(q=2, d=4))]
    kept = 0
    for mi in (0, 1):
        for name, kw in comp_grids:
            for dp, pp in ((1, 1), (2, 1), (1, 2), (2, 4), (4, 2)):
                for zero in (0, 1, 2, 3):
                    for sched, mb in (("1f1b", 1), ("1f1b", 4), ("gpipe", 4), ("1f1b", 8)):
                        if pp == 1 and sched == "gpipe":
                            continue
                        if zero in (1, 2) and mb == 8:
                            continue
                        ck = (zero + mb + dp) % 2 == 0
                        kept += 1
                        if kept % 3:                 # a third of them: a few hundred in all
                            continue
                        out.append({"kind": "composition", "model": mi, "scheme": name,
                                    "grid": kw, "dp": dp, "pp": pp, "zero": zero,
                                    "schedule": sched, "microbatches": mb, "checkpoint": ck,
                                    "prefetch": zero == 3 and pp == 2})
    out.append({"kind": "mesh_case", "case": {
        "dp": 2, "pp": 2, "scheme": "optimus", "q": 2, "d": 1, "t": 4, "zero": 1,
        "schedule": "1f1b", "m": 2, "checkpoint": True, "bucket_bytes": 1 << 20, "b": 16,
        "s": 32, "h": 64, "heads": 4, "v": 128, "layers": 4, "ffn": 4, "dtype": "float64"}})
    for c in out:
        c["preset"] = preset
    return out


def devset_cases() -> list[dict]:
    from summasim.costmodel.tools.devset import load_points

    return [{"kind": "devset", "preset": p["machine"], "id": p["id"]} for p in load_points()
            if p["kind"] in ("step_time", "composition_throughput", "weak_efficiency")
            and p["machine"] in PRESETS]


def evaluate(case: dict, m: Machine):
    """The frozen numbers of one case on machine ``m`` (JSON-plain)."""
    kind = case["kind"]
    if kind == "collective":
        c = C.collective_time(case["op"], case["nbytes"], case["p"], m)
        return _plain([c.seconds, c.algorithm])
    if kind == "nccl":
        path = group_path(m.topology, GridShape.of(case["p"]), "world", case["p"],
                          Placement.parse(case["placement"]))
        c = nccl_time(case["op"], case["nbytes"], path, ll128=m.topology.ll128)
        return _plain(list(c))
    if kind == "nccl_grid":
        grid = GridShape.of(q=case["q"], d=case["d"])
        size = {"row": case["q"], "col": case["q"], "depth": case["d"],
                "layer": case["q"] ** 2}[case["group"]]
        path = group_path(m.topology, grid, case["group"], size,
                          Placement.parse(case["placement"]))
        c = nccl_time(case["op"], case["nbytes"], path, ll128=m.topology.ll128)
        return _plain(list(c))
    if kind == "algorithm":
        kw = dict(machine=m, dtype=case["dtype"], overlap=case["overlap"])
        if case["name"] == "ring_allreduce":
            pr = predict_algorithm("ring_allreduce", count=case["count"], p=case["p"], **kw)
        else:
            pr = predict_algorithm(case["name"], case["m"], case["k"], case["n"], case["q"],
                                   case["d"], **kw)
        return _plain([pr.seconds, pr.comm_seconds, pr.compute_seconds, pr.slowdown,
                       pr.breakdown])
    if kind in ("scheme", "step"):
        sch = Scheme.make(case["scheme"], **case["grid"])
        cfg = model_of(case["model"], m)
        if kind == "scheme":
            res = {}
            for ck in (False, True):
                sc = scheme_cost(sch, cfg, m, checkpoint=ck, include_minor=ck)
                res[f"ck{int(ck)}"] = [sc.step_seconds, sc.step_comm_seconds,
                                       sc.step_compute_seconds, sc.memory.total]
            res["memory"] = memory(sch, cfg).to_dict()
            res["largest_batch"] = largest_batch(sch, cfg, m.memory_bytes or 16e9)
            return _plain(res)
        st = step_cost(sch, cfg, m)
        sb = step_breakdown(sch, cfg, m)
        return _plain({"step_cost": [st.seconds, st.comm_seconds, st.compute_seconds,
                                     st.slowdown], "breakdown": sb.to_dict()})
    if kind == "composition":
        sch = Scheme.make(case["scheme"], **case["grid"])
        cfg = model_of(case["model"], m)
        B = cfg.b * case["dp"] * case["microbatches"]
        return _plain(price_composition(
            cfg, sch, machine=m, dp=case["dp"], pp=case["pp"],
            microbatches=case["microbatches"], global_batch=B, zero=case["zero"],
            schedule=case["schedule"], checkpoint=case["checkpoint"],
            zero3_prefetch=case["prefetch"],
            state_bytes=None if case["zero"] != 2 else StateBytes.for_dtype(cfg.dtype,
                                                                            mixed=False)))
    if kind == "mesh_case":
        return _plain(predict_case(case["case"], m))
    if kind == "devset":
        from summasim.costmodel.tools import devset

        point = next(p for p in devset.load_points() if p["id"] == case["id"])
        if point["kind"] == "composition_throughput":
            return _plain(devset.price_point_composition(point, _dev_machine(point, m)))
        from summasim.costmodel.tools.predict import parse_grid

        def step(spec):
            sb = step_breakdown(parse_grid(spec["scheme"], spec["grid"]),
                                TransformerConfig(**spec["model"]), _dev_machine(point, m))
            return sb.to_dict()
        res = {"step": step(point)}
        if "baseline" in point:
            res["baseline"] = step(point["baseline"])
        return _plain(res)
    raise ValueError(kind)


def _dev_machine(point, m):
    from summasim.costmodel.machine.topology import Topology

    over = (point.get("overrides") or {}).get("topology")
    if over:
        m = m.replace(topology=Topology(**{**m.topology.to_dict(), **over}))
    return m


def main():
    machines = {name: load_preset(name).to_dict() for name in PRESETS}
    res = {"generated_from": "the cost model before it was arranged by concept",
           "machines": machines, "cases": []}
    cases = [c for name in PRESETS for c in cases_for(name, machine_of(machines, name))]
    cases += devset_cases()
    for case in cases:
        m = machine_of(machines, case["preset"])
        got = evaluate(case, m)
        res["cases"].append({**case, "want": got})
    with open(PATH, "w", encoding="utf-8") as fh:
        fh.write('{"generated_from": %s,\n "machines": %s,\n "cases": [\n'
                 % (json.dumps(res["generated_from"]), json.dumps(machines)))
        fh.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in res["cases"]))
        fh.write("\n]}\n")
    counts = {}
    for c in res["cases"]:
        counts.setdefault(c["preset"], {}).setdefault(c["kind"], 0)
        counts[c["preset"]][c["kind"]] += 1
    print(f"wrote {PATH}: {len(res['cases'])} cases")
    for name, kinds in counts.items():
        print(f"  {name}: {sum(kinds.values())} {kinds}")


if __name__ == "__main__":
    main()
