"""Why a predicted step takes what it takes, and what would make it faster.

:func:`what_bounds` names the part of a composition's step that bounds it: the largest
term of :func:`~summasim.costmodel.workload.composition.price_composition`'s breakdown
(the GEMMs at their rate, the memory-bound kernels at the memory bandwidth, one group's
exposed communication on the link that bounds it, the compute slowed by the collectives
it hides, the pipeline bubble, the optimizer),
with the numbers that make it so: the GEMMs' achieved fraction of the device's peak,
the link a group crosses (:func:`~summasim.costmodel.machine.topology.group_path`), the
bubble against its closed form ``(pp - 1) / (V m)`` (Narayanan et al. 2021, section
2.2).

:func:`what_ifs` prices the same step after one change each, with the same model, and
ranks them by the time they save. The changes are those a user can make or buy:

- twice the inter-node NICs per node (a node with more rails, when a group spans nodes);
- the next GPU generation's preset (V100 -> A100 -> H100 DGX presets);
- twice the micro-batch size (half as many micro-batches), when the schedule allows it;
- a cheaper recompute (full -> selective -> none) or blockwise attention, when it fits;
- Megatron sequence parallelism (tensor groups of t > 1), which shrinks the activations;
- fused elementwise kernels (``torch.compile``, or Megatron-LM's) for a run priced with
  PyTorch eager kernels;
- ZeRO one stage lower (less traffic) or higher (less memory) when it then fits.

For a tensor grid priced alone, :func:`placement_what_ifs` prices it under the other
placements of its ranks on the nodes (row-major or blocked tiles).

A change whose memory does not fit the device is listed as not fitting, not as a gain.
"""

from __future__ import annotations

import math
from typing import Callable

from ..compute.roofline import usable_memory

#: The presets of the next GPU generation, in the same form factor (DGX nodes).
NEXT_GENERATION = {"dgx1-v100": "dgx-a100", "dgx2-v100": "dgx-a100",
                   "dgx2h-v100": "dgx-a100", "dgx-a100": "h100-dgx-ndr",
                   "dgx-a100-80gb": "h100-dgx-ndr", "dgx-a100-40gb": "h100-dgx-ndr"}

_COMPONENTS = {"gemm": "the GEMMs", "memory_bound": "memory-bound kernels",
               "bubble": "the pipeline bubble", "optimizer": "the optimizer"}


def _components(res: dict) -> list[tuple[str, float]]:
    bd = res["breakdown"]
    parts = [("gemm", bd["gemm"]), ("memory_bound", bd["memory_bound"]),
             ("bubble", bd["bubble"]), ("optimizer", bd["optimizer"])]
    parts += [(f"comm.{k}", v) for k, v in bd["exposed_comm"].items()]
    return parts


def _link(machine, group: str, comp: dict) -> str:
    """The link a group's collectives cross, in rank order (tensor ranks fastest, then
    data-parallel replicas, then pipeline stages: Megatron-LM's order)."""
    topo = machine.topology
    if topo is None:
        return "the interconnect"
    dpn = topo.devices_per_node
    t = comp["t"]                      # the tensor grid's ranks (d pr pc; Megatron's t)
    span = {"tensor": t, "dp": t * comp["dp"], "zero": t * comp["dp"],
            "pp": t * comp["dp"] * comp["pp"]}.get(group, t * comp["dp"])
    if span <= dpn:
        return f"the intra-node {topo.intra_kind} links"
    return (f"the inter-node NICs ({topo.nics_per_node} x "
            f"{topo.nic_bandwidth * 8 / 1e9:g} Gb/s per node)")


def what_bounds(res: dict, machine) -> dict:
    """The term of the step that bounds it: ``{"term", "seconds", "share", "why"}``."""
    step = res["step_seconds"]
    term, secs = max(_components(res), key=lambda kv: kv[1])
    comp = res["composition"]
    share = secs / step if step else 0.0
    if term == "gemm":
        dtype = comp["dtype"]
        peak = machine.peak_flops(dtype) if hasattr(machine, "peak_flops") else None
        rate = res["flops_per_device"] * step / secs if secs else 0.0
        why = (f"the GEMM rate: {rate / 1e12:.0f} TFLOP/s of model FLOPs while computing"
               + (f", {rate / peak:.0%} of the device's best {dtype} GEMM rate {peak / 1e12:.0f}"
                  if peak else ""))
    elif term == "memory_bound":
        bw = getattr(machine.device, "memory_bandwidth", None) if machine.device else None
        why = "the memory bandwidth" + (f" ({bw / 1e9:.0f} GB/s)" if bw else "")
    elif term == "bubble":
        m, pp, v = comp["microbatches"], comp["pp"], comp.get("chunks", 1)
        why = (f"the pipeline bubble: (pp - 1)/(V m) = ({pp} - 1)/({v} x {m}) = "
               f"{(pp - 1) / (v * m):.1%} of the ideal time")
    elif term == "optimizer":
        why = "the optimizer's update, memory-bound"
    elif term == "comm.contention":
        dev = machine.device
        why = ("compute slowed by the collectives it hides: they take "
               f"{dev.comm_sms:g} of the device's {dev.sms} SMs while they run"
               if dev is not None and dev.sms else "compute slowed by the collectives it hides")
    else:
        group = term.split(".", 1)[1]
        why = f"{group} communication not hidden by compute, on {_link(machine, group, comp)}"
    return {"term": term, "seconds": secs, "share": share, "why": why}


def grid_bound(sb) -> dict:
    """:func:`what_bounds` of a tensor grid's step alone (a
    :class:`~summasim.costmodel.workload.step.StepBreakdown`): the GEMMs, the
    memory-bound kernels, the optimizer's update (which ``memory_bound_seconds``
    includes; predict prints it apart) or the exposed communication, named by its
    largest collective and group: the largest of the parts predict prints."""
    opt = sb.optimizer_seconds
    terms = [("gemm", sb.gemm_seconds),
             ("memory_bound", sb.memory_bound_seconds - opt),
             ("optimizer", opt),
             ("comm", sb.comm_exposed_seconds)]
    term, secs = max(terms, key=lambda kv: kv[1])
    share = secs / sb.seconds if sb.seconds else 0.0
    if term == "comm" and sb.by_op:
        (op, grp), _ = max(sb.by_op.items(), key=lambda kv: kv[1])
        why = f"exposed communication, most of it {op} over the {grp} groups"
    elif term == "comm":
        why = "exposed communication"
    else:
        why = {"gemm": "the GEMM rate", "optimizer": "the optimizer's update, memory-bound",
               "memory_bound": "the memory bandwidth of the memory-bound kernels"}[term]
    return {"term": term, "seconds": secs, "share": share, "why": why}


def what_ifs(price: Callable[..., dict], res: dict, machine, cfg,
             load_preset: Callable | None = None, budget: float | None = None) -> list[dict]:
    """Each change of the module docstring that applies, priced by ``price(**change)``
    (``machine=``, ``microbatches=``, ``cfg=``, ``recompute=``, ``zero=``: the same
    composition otherwise), as ``{"change", "step_seconds", "gain", "fits",
    "memory_bytes"}`` with ``gain`` = 1 - new / old step time, sorted best first
    (changes that do not fit last). A change that cannot exist (a schedule that
    refuses the micro-batch count) is left out. Each change fits against ``budget``
    bytes per device when given (the user's), else its own machine's
    :func:`~summasim.costmodel.compute.roofline.usable_memory` (the next GPU's for
    that change)."""
    comp = res["composition"]
    step = res["step_seconds"]
    changes: list[tuple[str, dict]] = []
    topo = machine.topology
    t = comp["t"]                      # the tensor grid's ranks (d pr pc; Megatron's t)
    if topo is not None and topo.nics_per_node and comp["devices"] > topo.devices_per_node:
        from summasim.costmodel.machine.topology import Topology

        more = Topology(**{**topo.to_dict(), "nics_per_node": 2 * topo.nics_per_node})
        changes.append((f"2x NICs per node ({2 * topo.nics_per_node})",
                        {"machine": machine.replace(topology=more)}))
    base, _, variant = machine.name.partition(":")
    nxt = NEXT_GENERATION.get(base)
    if nxt and load_preset is not None:
        # a variant's changes carry over (dgx-a100:nics=1 -> h100-dgx-ndr:nics=1), so
        # that the generation is the one change; one that does not apply leaves it out
        if variant:
            from summasim.costmodel.machine.presets import derive

            try:
                changes.append((f"the next GPU generation ({nxt}:{variant})",
                                {"machine": derive(load_preset(nxt), variant)}))
            except ValueError:
                pass
        else:
            changes.append((f"the next GPU generation ({nxt})", {"machine": load_preset(nxt)}))
    m = comp["microbatches"]
    if m % 2 == 0:
        changes.append((f"micro-batch x2 ({2 * comp['micro_batch']} sequences, m = "
                        f"{m // 2})", {"microbatches": m // 2}))
    order = ("none", "selective", "full")
    rc = comp.get("recompute", "none")
    if rc != "none":
        cheaper = order[order.index(rc) - 1]
        changes.append((f"recompute {cheaper}", {"recompute": cheaper}))
    if getattr(cfg, "attention", "plain") == "plain":
        changes.append(("blockwise (flash) attention", {"cfg": cfg.replace(attention="flash")}))
    if comp["scheme"] == "megatron" and t > 1 and not comp.get("sequence_parallel"):
        changes.append(("sequence parallelism", {"cfg": cfg.replace(sequence_parallel=True)}))
    if getattr(cfg, "kernels", "fused") == "eager":
        changes.append(("fused kernels (torch.compile)", {"cfg": cfg.replace(kernels="fused")}))
    z = comp["zero"]
    if z > 0:
        changes.append((f"ZeRO {z - 1}", {"zero": z - 1}))
    if z < 3 and comp["dp"] > 1:
        changes.append((f"ZeRO {z + 1}", {"zero": z + 1}))
    out = []
    for label, change in changes:
        try:
            new = price(**change)
        except ValueError:
            continue
        secs = new["step_seconds"]
        mem = new["memory"]["total"]
        limit = budget if budget is not None else usable_memory(
            change.get("machine", machine), comp["devices"])
        fits = not limit or mem <= limit
        out.append({"change": label, "step_seconds": secs,
                    "gain": 1.0 - secs / step if step else 0.0, "fits": fits,
                    "memory_bytes": mem})
    out.sort(key=lambda r: (not r["fits"], -r["gain"] if math.isfinite(r["gain"]) else 0))
    return out


def placement_what_ifs(price: Callable, placement, sch, topology) -> list[dict]:
    """The tensor grid ``sch`` priced under each other placement of its ranks that its
    nodes allow (``row-major``, ``blocked`` tiles; ``price(placement)`` gives its step
    seconds), as ``{"change", "step_seconds"}``, fastest first; [] without a topology or
    for a grid of one group (Megatron's: rank order only)."""
    from ..machine.topology import GridShape, Placement

    if topology is None or sch.q * sch.cols == 1:
        return []
    shape = GridShape.of(sch.p, sch.q, sch.d, pc=sch.pc)
    dpn = topology.devices_per_node
    mine = placement.slots_for(shape, dpn)
    out = []
    for policy in ("row-major", "blocked"):
        other = Placement(policy)
        try:
            slots = other.slots_for(shape, dpn)
        except ValueError:
            continue                    # the nodes cannot hold this placement's tiles
        if list(slots) == list(mine):
            continue                    # the same slots: the placement priced already
        out.append({"change": f"placement {other.describe()}",
                    "step_seconds": price(other)})
    return sorted(out, key=lambda r: r["step_seconds"])
