"""The planner's search: every composition of N devices that fits, ranked, without MPI.

For a transformer (a :class:`~summasim.costmodel.workload.scheme.TransformerConfig`),
``devices`` N and a global batch of B sequences on a machine, :func:`search` enumerates

    data parallel dp  x  pipeline stages pp  x  tensor scheme and grid
    x  ZeRO stage  x  micro-batches m  x  recompute (none, selective, full)
    x  sequence parallelism (Megatron, t > 1: off, on)
    x  model chunks per stage V (1: 1F1B; 2, 4: interleaved 1F1B)

with ``dp * pp * t = N``, pp dividing the layers (even stages), ``dp m`` dividing B and
the micro-batch ``B / (dp m)`` one the tensor grid can split (the rules of
:func:`summasim.costmodel.workload.tensor.check_composition`); V > 1 only where
``pp >= 2``, ``pp V`` divides the layers and m is a multiple of pp (Megatron-LM's
rule). Attention is plain unless asked (``attention="flash"``), under which selective
recompute has nothing left to drop and is not searched; the mixed-precision state
bytes, loss scale and gradient-reduction type are the caller's. It keeps the compositions whose
memory per device (the worst pipeline stage: model states under ZeRO, activations
of the micro-batches in flight, workspaces) fits the budget, prices them with
:func:`summasim.costmodel.workload.composition.price_composition` and ranks them by predicted
step time (compact rows, :class:`SearchResult`). When nothing exists or nothing fits,
:func:`nothing_exists` says why and :func:`fits_with_more` how many devices would fit one.
The command line, ``python -m summasim.costmodel plan``, is :mod:`.plan_cli`.

Speed: memory is checked before any time is priced, and the tensor-parallel prices
(``schemes.step_cost``) are computed once per (grid, micro-batch, sequence
parallelism) and shared by every dp, pp, ZeRO stage, recompute and schedule; a
composition costs O(1) in pp. The links
of each group (``topology.group_path``) are memoized across pricers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from summasim import spec
from summasim.costmodel.workload.zero import BUCKET_BYTES, ZERO_STAGES, StateBytes
from summasim.costmodel.workload.stage_memory import composition_memory
from summasim.costmodel.workload.composition import flatten_breakdown, price_composition
from summasim.costmodel.workload.tensor import tensor_memory
from summasim.costmodel.machine import Machine
from summasim.costmodel.workload.scheme import (SCHEMES, Scheme, TransformerConfig, misfit,
                                                sequence_parallel_misfit)
from summasim.costmodel.workload.footprint import batch_step

from . import scheme_grids

GiB = float(1 << 30)
#: Share of the usable device memory the plan may use (:func:`~summasim.costmodel.compute.
#: roofline.usable_memory`: the device memory less the CUDA context, library workspaces
#: and NCCL buffers, of which the allocator's fragmentation is lost; each with its source
#: in the preset).
MEM_FRACTION = 1.0
#: The known models: :data:`summasim.spec.MODELS` (kept under this name for callers).
MODELS = spec.MODELS


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def tensor_grids(cfg: TransformerConfig, devices: int, schemes=SCHEMES) -> list[Scheme]:
    """Every tensor grid of a divisor t of ``devices`` that divides the model (apart
    from the batch), as :func:`summasim.spec.grids` enumerates them: Megatron over t
    (t = 1 is no tensor parallelism), Optimus q x q with q >= 2 or, where t is not a
    square, its most square ``pr x pc`` both ways round, SUMMA2.5-LM [q, q, d] with
    q >= 2 and d >= 2 (d > q included; d = 1 is Optimus) or, where t has none, the
    smallest depth over its most square ``pr x pc`` both ways, the 3D cube q x q x q with
    q >= 2. A grid of one rank (Optimus 1 x 1) is Megatron's t = 1 and not listed."""
    out = []
    for t in _divisors(devices):
        for name in schemes:
            out += [sch for sch in scheme_grids(t, name, cfg, batch=False)
                    if sch.name == "megatron" or sch.p >= 2]
    return out


class Plan(NamedTuple):
    """The checked inputs of one planner run (what
    :func:`~summasim.costmodel.tools.plan_cli.check_args` found)."""

    machine: Machine
    cfg: TransformerConfig
    model: "spec.Model"
    devices: int
    global_batch: int
    schemes: tuple
    zeros: tuple
    recomputes: tuple        # of "none", "selective", "full"
    schedule: str
    budget: float            # bytes per device
    state_bytes: StateBytes
    bucket_bytes: float
    max_microbatches: int
    zero3_prefetch: bool
    top: int
    json: str | None
    plot: str | None
    sequence_parallel: tuple = (False, True)
    chunks: tuple = (1, 2, 4)
    attention: str = "plain"
    loss_scale: str = "none"
    training: "spec.Training | None" = None     # dtype, loss scale, grad reduce
    grad_overlap: bool = True                   # price_composition's engine overlaps
    p2p_overlap: bool = False


#: The model chunks per stage the planner tries by default: 1 (1F1B) and the
#: interleaved schedule's 2 and 4 (Narayanan et al. 2021 run V = 2 to 6 chunks).
CHUNKS = (1, 2, 4)
#: The recomputes it tries by default.
RECOMPUTES = ("none", "selective", "full")


@dataclass
class SearchResult:
    """What :func:`search` found: the fitting compositions ranked (compact rows), counts,
    the smallest memory seen when nothing fits, and the seconds it took."""

    rows: list
    counts: dict
    smallest: dict | None
    seconds: float
    reasons: dict


def _row(res: dict) -> dict:
    """A compact ranked row of a :func:`price_composition` result."""
    c = res["composition"]
    mem = res["memory"]
    return {"scheme": c["scheme"], "grid": c["grid"], "t": c["t"], "q": c["q"],
            "pc": c.get("pc", c["q"]), "d": c["d"],
            "dp": c["dp"], "pp": c["pp"], "microbatches": c["microbatches"],
            "micro_batch": c["micro_batch"], "zero": c["zero"], "checkpoint": c["checkpoint"],
            "recompute": c["recompute"], "chunks": c["chunks"],
            "sequence_parallel": c["sequence_parallel"], "attention": c["attention"],
            "schedule": (f"interleaved:{c['chunks']}" if c["schedule"] == "interleaved"
                         else c["schedule"]), "step_seconds": res["step_seconds"],
            **flatten_breakdown(res["breakdown"]),
            "bubble_fraction": res["bubble_fraction"],
            "memory_gib": mem["total"] / GiB,
            "model_states_gib": mem["model_states"]["total"] / GiB,
            "activations_gib": mem["activations"] / GiB,
            "transient_gib": mem["transient"] / GiB,
            "tflops_per_device": res["flops_per_device"] / 1e12}


def _ticking(items, tick):
    """``items``, calling ``tick(1)`` after each (when ``tick`` is given)."""
    for item in items:
        yield item
        if tick is not None:
            tick(1)


def search(cfg: TransformerConfig, devices: int, global_batch: int, machine: Machine, *,
           budget: float, schemes=SCHEMES, zeros=ZERO_STAGES, recomputes=RECOMPUTES,
           checkpoints=None, schedule: str = "1f1b", state_bytes: StateBytes | None = None,
           bucket_bytes: float = BUCKET_BYTES, max_microbatches: int | None = None,
           zero3_prefetch: bool = False, price: bool = True, tick=None,
           sequence_parallel=(False, True), chunks=CHUNKS, loss_scale: str = "none",
           grad_overlap: bool = True, p2p_overlap: bool = False) -> SearchResult:
    """Every composition of ``devices`` for ``cfg`` that fits ``budget`` bytes per
    device, priced and ranked by step time (``price=False``: memory only, unranked).

    ``recomputes`` (``checkpoints``, True/False, names full/none instead),
    ``sequence_parallel`` (tried for Megatron with t > 1 only) and ``chunks`` (V; V > 1
    with ``schedule`` 1f1b only, where the layers and m allow) are searched; the
    attention, the block and the dtype are ``cfg``'s. ZeRO stages above 0 are tried
    only with dp > 1 (they equal stage 0 at dp = 1). ``counts``: ``compositions`` (all
    that exist), ``fit``; ``reasons``: why (dp, pp) pairs or grids had no composition
    (for the nothing-exists message). ``tick``, when given, is called with the number
    of tensor grids once they are known (``tick(0, total)``) and then once per grid
    searched (``tick(1)``): a progress bar's hook.
    """
    t0 = time.perf_counter()
    sb = state_bytes or StateBytes.for_dtype(cfg.dtype)
    if checkpoints is not None:
        recomputes = tuple("full" if ck else "none" for ck in checkpoints)
    if cfg.attention == "flash":          # nothing left for selective recompute to drop
        recomputes = tuple(rc for rc in recomputes if rc != "selective") or ("none",)
    chunks = (1,) if schedule == "gpipe" else tuple(chunks)
    N, B = cfg.N, global_batch
    cache: dict = {}
    rows, counts, reasons = [], {"grids": 0, "compositions": 0, "fit": 0}, {}
    smallest = None
    grids = tensor_grids(cfg.replace(sequence_parallel=False), devices, schemes)
    counts["grids"] = len(grids)
    if tick is not None:
        tick(0, len(grids))
    sp_cfgs = {sp: cfg.replace(sequence_parallel=sp) for sp in (False, True)}
    for sch in _ticking(grids, tick):
        t = sch.p
        step = batch_step(sch)
        sps = [sp for sp in sequence_parallel if not sp or (
            sch.name == "megatron" and t > 1
            and sequence_parallel_misfit(sch, sp_cfgs[True]) is None)]
        if not sps:
            reasons.setdefault("sp", f"sequence parallelism (--sequence-parallel on) splits "
                                     f"Megatron's groups of t >= 2; {sch.label} has none")
            continue
        for pp in _divisors(N):
            if devices % (t * pp):
                continue
            dp = devices // (t * pp)
            if B % dp:
                reasons.setdefault("batch", f"global batch {B} is not divisible by dp = {dp} "
                                            f"(t = {t}, pp = {pp})")
                continue
            per = B // dp
            for m in _divisors(per):
                b = per // m
                if b % step or (max_microbatches and m > max_microbatches):
                    if b % step:
                        reasons.setdefault("micro", f"{sch.label}: micro-batch {b} is not a "
                                                    f"multiple of d q = {step}")
                    continue
                vs = [v for v in chunks if v == 1 or (pp >= 2 and N % (pp * v) == 0
                                                      and m % pp == 0)]
                if not vs:
                    reasons.setdefault("chunks", f"--chunks {'/'.join(map(str, chunks))}: "
                                                 f"V model chunks per stage need pp >= 2, N = "
                                                 f"{N} layers divisible by pp V and m a "
                                                 f"multiple of pp")
                for sp in sps:
                    c = sp_cfgs[sp]
                    tm = cache.get(("mem", c, sch, b))
                    if tm is None:
                        tm = cache[("mem", c, sch, b)] = tensor_memory(sch, c, b)
                    for v in vs:
                        kind = "interleaved" if v > 1 else schedule
                        for rc in recomputes:
                            for zero in (zeros if dp > 1 else (0,)):
                                counts["compositions"] += 1
                                mem = composition_memory(
                                    tm, layers=N, dp=dp, pp=pp, zero=zero, m=m,
                                    schedule=kind, recompute=rc, sb=sb,
                                    bucket_bytes=bucket_bytes, chunks=v, tied=c.tied)
                                if mem["total"] > budget:
                                    if smallest is None or mem["total"] < smallest["memory"]:
                                        smallest = {
                                            "memory": mem["total"], "grid": sch.label,
                                            "scheme": sch.name, "t": t, "dp": dp, "pp": pp,
                                            "microbatches": m, "micro_batch": b,
                                            "zero": zero, "checkpoint": rc == "full",
                                            "recompute": rc, "chunks": v,
                                            "sequence_parallel": sp,
                                            "model_states": mem["model_states"]["total"],
                                            "activations": mem["activations"]}
                                    continue
                                counts["fit"] += 1
                                if not price:
                                    continue
                                res = price_composition(
                                    c, sch, machine=machine, dp=dp, pp=pp, microbatches=m,
                                    global_batch=B, zero=zero, schedule=kind, chunks=v,
                                    recompute=rc, devices=devices, bucket_bytes=bucket_bytes,
                                    state_bytes=sb, zero3_prefetch=zero3_prefetch,
                                    loss_scale=loss_scale, cache=cache,
                                    grad_overlap=grad_overlap, p2p_overlap=p2p_overlap)
                                rows.append(_row(res))
    return SearchResult(ranked(rows), counts, smallest, time.perf_counter() - t0, reasons)


def ranked(rows: list[dict]) -> list[dict]:
    """``rows`` by their step time to 12 significant digits, ties in their given order
    (the search's). Two compositions that differ only in what the step does not price
    (ZeRO 1 and 2 where neither's traffic shows) tie in every Python, whose float sums
    differ in the last bits (3.12's ``sum()`` is compensated)."""
    return sorted(rows, key=lambda r: float(f"{r['step_seconds']:.12g}"))


def nothing_exists(plan: Plan, res: SearchResult) -> str:
    """Why no composition of the devices exists at all (a user error)."""
    cfg = plan.cfg
    why = list(res.reasons.values())
    if not res.counts["grids"]:
        probe = [misfit(sch, cfg, batch=False) for name in plan.schemes
                 for sch in scheme_grids(plan.devices, name)[:1]]
        why.append("no tensor grid of a divisor of the devices divides the model" +
                   (f" (e.g. {probe[0]})" if probe and probe[0] else ""))
    pps = [pp for pp in _divisors(cfg.N)]
    return (f"no composition of {plan.devices} devices exists for this model and batch "
            f"(layers {cfg.N} allow pp in {pps[:8]}{'...' if len(pps) > 8 else ''}; "
            + "; ".join(why[:3]) + "): choose --devices, --batch or a model that divides")


def fits_with_more(plan: Plan, tick=None) -> tuple[int, dict] | None:
    """The smallest multiple of the devices (x2, x4, ... x1024) at which a composition
    fits; ``tick``, when given, is called once per multiple tried."""
    for k in range(1, 11):
        if tick is not None:
            tick()
        dev = plan.devices << k
        res = search(plan.cfg, dev, plan.global_batch, plan.machine, budget=plan.budget,
                     schemes=plan.schemes, zeros=plan.zeros, recomputes=plan.recomputes,
                     schedule=plan.schedule, state_bytes=plan.state_bytes, price=False,
                     max_microbatches=plan.max_microbatches,
                     sequence_parallel=plan.sequence_parallel, chunks=plan.chunks,
                     loss_scale=plan.loss_scale)
        if res.counts["fit"]:
            return dev, res.counts
    return None


def short_grid(r: dict) -> str:
    """A row's tensor grid as ``--mesh`` spells it: ``megatron:T``, ``optimus:PRxPC``
    (``QxQ``), ``summa25:PRxPCxD``, ``3d:QxQxQ`` (:class:`summasim.spec.TensorGrid`'s
    spelling)."""
    if r["scheme"] == "megatron":
        return f"megatron:{r['t']}"
    pc = r.get("pc") or r["q"]
    return str(spec.TensorGrid.of(r["scheme"], r["q"], r["d"], pc=pc))
