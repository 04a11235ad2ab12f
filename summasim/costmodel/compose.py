"""Price a training step of data x pipeline x ZeRO x tensor parallelism composed.

A composition runs ``devices = dp * pp * t`` ranks on the mesh ``[dp, pp, tensor
grid]`` (ranks in that Cartesian order, the tensor grid fastest: a tensor group is
``t`` consecutive ranks, a pipeline group has stride ``t``, a data-parallel group
stride ``pp t``). The tensor grid is one of today's schemes: Megatron 1D over ``t``
ranks, Optimus ``q x q``, SUMMA2.5-LM ``[q, q, d]``. The N layers are split into
``pp`` equal contiguous stages (N not divisible by pp is refused: uneven stages are
not priced); the first stage also holds the embedding (``wte``, ``wpe``), the last
the final LayerNorm and, when pp > 1, a tied copy of ``wte`` for the LM head. The
global batch B is split over dp and into ``m`` micro-batches of ``b = B/(dp m)``
sequences, which must be a multiple of the scheme's batch divisor (d q).

What a step costs (seconds; every piece below is in the result's breakdown)
---------------------------------------------------------------------------
tensor part      One micro-batch on one stage is priced with the per-scheme step
                 pricing of :mod:`~summasim.costmodel.schemes` (``step_cost``: GEMMs,
                 every tensor-parallel collective, memory-bound kernels; on GPU
                 presets the roofline and NCCL on the topology), read as ``layers x
                 (per-layer cost) + embedding (first stage) + head and loss (last
                 stage)``. The per-layer cost is ``step_cost(N=2) - step_cost(N=1)``,
                 the rest of ``step_cost(N=1)`` is the embedding and head, split by
                 pricing the embedding's own collectives (``schemes.model_ops``); the
                 GEMM / memory-bound / communication split is the prediction's
                 ``breakdown``, with its optimizer taken out (priced below, sharded).
                 So at ``dp = pp = m = 1`` and ZeRO 0 the step is today's
                 ``step_cost`` (to float rounding; plus the Adam update on machines
                 whose ``step_cost`` leaves it out; the shared-core CPU model is linear
                 in N only approximately). Checkpointing adds each layer's forward
                 again (``scheme_cost``'s forward pass) to its backward.
pipeline         Per micro-batch, stage s takes ``t_s = f_s + b_s`` (its forward and
                 backward, plus the point-to-point sends of the activation to s+1
                 and of its gradient to s-1). GPipe (Huang et al. 2019) runs all
                 forwards then all backwards, ``T = (m-1)(max f + max b) + sum(f + b)``;
                 1F1B (Narayanan et al. 2021, section 2.2) ``T = (m-1) max(f + b) +
                 sum(f + b)``. With equal stages both are ``(m + pp - 1) t`` and the
                 bubble ``(pp - 1) t`` is the fraction ``(pp-1)/(m+pp-1)`` of the
                 pipeline (:func:`bubble_fraction`); the schedules differ in memory.
data parallel    ZeRO 0: the gradients are all-reduced over dp once per step,
                 after the last micro-batch, with summasim's ring (``2(dp-1)/dp`` of
                 the local gradient bytes sent per rank; ZeRO 1 reduce-scatters them
                 instead, ``(dp-1)/dp``), in buckets of
                 ``bucket_bytes`` in backward order: bucket i can start once the last
                 micro-batch's backward has produced it, the buckets go one after the
                 other, and only what is left when that backward (and the drain of the
                 stages before it) ends is exposed; the last bucket is never hidden
                 (:func:`overlap_exposed`).
ZeRO             (Rajbhandari et al. 2020.) 1: Adam state partitioned; the gradients
                 are reduce-scattered, each rank updates its 1/dp shard, then the
                 parameters are all-gathered over dp (``(dp-1)/dp`` of the local
                 parameter bytes): in all the bytes of ZeRO 0's all-reduce (the
                 paper's P_os, section 7.2.1). 2: gradients
                 reduce-scattered over dp after every micro-batch's backward
                 (``(dp-1)/dp`` of the gradient bytes, m times per step, bucketed and
                 overlapped with that backward), Adam on the shard, all-gather after
                 the update. 3: as 2, and each piece (embedding, each layer, final
                 LayerNorm/head) is all-gathered right before its forward and again
                 before its backward in every micro-batch (``2m`` all-gathers of
                 ``(dp-1)/dp`` of the local parameter bytes), without prefetching
                 (``zero3_prefetch=True`` hides each gather behind the previous
                 piece's compute); no all-gather after the update.
tied embedding   With pp > 1 the first and last stages all-reduce the ``wte``
                 gradient between them (Megatron; a ring of 2: the shard's bytes),
                 after the data-parallel reduction, on the 1/dp shard under ZeRO 2/3.
optimizer        The Adam update of the parameters a rank updates (P at ZeRO 0, P/dp
                 from ZeRO 1 on): at the rate ``step_cost`` prices it per parameter
                 when it does (GPU presets: roofline kernels), else Adam's bytes
                 (read params, grads, m, v, master; write params, m, v, master: ``2 bp
                 + bg + 4 bo + 2 bm`` per parameter) at the memory bandwidth
                 (``3 / gamma_reduce``: ``a += b`` streams 3 bytes per operand byte).

Collectives over dp and pp: on MPICH machines summasim's ring algorithms (what the
engine runs) on the inter-node link when a group of the kind spans nodes; on NCCL
machines NCCL's own choice on the topology, the concurrent groups of a kind sharing
each node's NICs (``topology.group_path``). Tensor-parallel communication is not
overlapped (as in today's model).

Memory per device (bytes; the worst stage)
------------------------------------------
``P`` is the number of parameters a device holds without ZeRO (its tensor shard of
its stage's layers, plus the embedding on the first stage and the final LayerNorm
and the tied ``wte`` copy on the last, from ``schemes.memory``). Model states are
:func:`model_state_bytes`; ZeRO 2 adds the part of one micro-batch's gradient that
lives before its buckets are reduce-scattered (the largest piece's and one bucket's,
at most ``P bg``: the ZeRO paper's bucketed reduction, section 5.2), ZeRO 3 the largest
gathered piece and its gradient. Activations per
micro-batch come from ``schemes.memory`` (per layer, or per layer's checkpoint plus
one layer being recomputed); a stage holds ``m`` micro-batches of them under GPipe
and ``min(m, pp - s)`` under 1F1B (stage s, from 0); the last stage also holds the
logits and their gradient per micro-batch in flight. Add the two activation-gradient
buffers and the SUMMA workspaces.

Traffic per rank (bytes per step, what its trace records: summed ``nbytes``)
---------------------------------------------------------------------------
``tensor``: the tensor-parallel collectives' payload (as ``schemes`` reports it,
recomputation included); ``pipeline``: activations sent forward and gradients sent
backward, per micro-batch (Megatron sends the replicated ``b s h`` activation, the
2D/2.5D schemes their ``b s h / t`` block); ``embedding``: the tied-``wte``
all-reduce; ``dp_allreduce``, ``zero_reduce_scatter``, ``zero_allgather``: the ring
closed forms above (for the ring collectives the trace's summed ``nbytes`` is the
bytes sent).

References
----------
S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020 (section 5: 4P + 12P/dp, 2P + 14P/dp,
16P/dp with mixed-precision Adam).
Y. Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", NeurIPS 2019 (bubble (K-1)/(M+K-1)).
D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021 (1F1B and the interleaved schedule, section 2.2; model
FLOPs, section 5.1).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

# The one place this module reaches into the rest of the cost model (keep it small).
from .collectives import collective_time
from .machine import Machine, itemsize_of
from .nccl import nccl_time
from .predict import make_pricer, price_messages
from .schemes import (Scheme, TransformerConfig, layer_ops, memory, misfit, model_messages,
                      model_ops, scheme_cost, step_cost, step_work)
from .topology import GridShape, Placement, group_path
from .traffic import MessageClass

SCHEDULES = ("1f1b", "gpipe")
ZERO_STAGES = (0, 1, 2, 3)
#: Default gradient bucket: PyTorch DDP's ``bucket_cap_mb = 25`` (MiB).
BUCKET_BYTES = 25 << 20
#: Dtypes trained in mixed precision by default (16-bit params and grads, fp32 Adam).
HALF_DTYPES = ("float16", "bfloat16")
#: The ring collectives summasim implements by hand, as the MPICH-family algorithm names
#: that price them: all-reduce "ring", reduce-scatter "pairwise" (ring), all-gather "ring".
_RING_ALGORITHM = {"allreduce": "ring", "reduce_scatter": "pairwise", "allgather": "ring"}


# -- model states ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state.

    ``param`` and ``grad`` are the working copies, ``optim`` each of Adam's two moments,
    ``master`` an optional higher-precision copy of the parameters that the optimizer
    updates (0: none). The ZeRO paper's mixed precision is ``StateBytes(2, 2, 4, 4)``
    (16 bytes per parameter); this simulator's plain float64 is ``StateBytes(8, 8, 8)``.
    """

    param: int = 8
    grad: int = 8
    optim: int = 8
    master: int = 0

    def __post_init__(self):
        for name in ("param", "grad", "optim", "master"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0 \
                    or (val == 0 and name != "master"):
                raise ValueError(f"StateBytes.{name} must be a positive integer "
                                 f"(master: >= 0), got {val!r}")

    @classmethod
    def for_dtype(cls, dtype, mixed: bool | None = None) -> "StateBytes":
        """Mixed precision (2, 2, 4, 4) for 16-bit dtypes, else everything in ``dtype``
        with no master copy; ``mixed`` forces either."""
        it = itemsize_of(dtype)
        mixed = (str(getattr(dtype, "name", dtype)) in HALF_DTYPES) if mixed is None else mixed
        return cls(it, it, 4, 4) if mixed else cls(it, it, it, 0)

    @property
    def optimizer(self) -> int:
        """Optimizer bytes per parameter: two moments and the master copy."""
        return 2 * self.optim + self.master

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer

    def to_dict(self) -> dict:
        return {"param": self.param, "grad": self.grad, "optim": self.optim,
                "master": self.master, "total": self.total}


def _int_pieces(params) -> list:
    """``params`` as a list of non-negative ints (a ValueError names a bad one)."""
    if isinstance(params, (numbers.Real, str, bytes)) or not hasattr(params, "__iter__"):
        pieces = [params]
    else:
        pieces = list(params)
    for n in pieces:
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)) \
                or n < 0:
            raise ValueError(f"params must be non-negative integers, got {n!r}")
    return pieces


def _states(full: float, part: float, zero: int, sb: "StateBytes") -> dict:
    """Model-state bytes of ``full`` parameters whose 1/dp shard has ``part``."""
    p_items = part if zero >= 3 else full
    g_items = part if zero >= 2 else full
    o_items = part if zero >= 1 else full
    out = {"params": p_items * sb.param, "grads": g_items * sb.grad,
           "optimizer": o_items * sb.optimizer}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def model_state_bytes(params, dp: int, zero: int, param_bytes: int = 8, grad_bytes: int = 8,
                      optim_bytes: int = 8, master_bytes: int = 0) -> dict:
    """Persistent model-state bytes per device under ZeRO stage ``zero``.

    Parameters
    ----------
    params : int or sequence of int
        P, the parameters the device holds without ZeRO (its tensor shard of its
        pipeline stage). A sequence gives the pieces that are sharded separately
        (each flattened and split over dp).
    dp : int
        Data-parallel ranks the states are partitioned over.
    zero : {0, 1, 2, 3}
    param_bytes, grad_bytes : int
        Bytes per parameter and per gradient (16-bit mixed precision: 2, 2).
    optim_bytes : int
        Bytes of each of Adam's two moments (mixed precision: 4).
    master_bytes : int
        Bytes of the optimizer's master copy of a parameter (mixed precision: 4;
        plain: 0). It is optimizer state: partitioned from ZeRO 1 on.

    Returns
    -------
    dict
        ``{"params", "grads", "optimizer", "total"}`` in bytes. A partitioned state
        counts the largest shard, ``ceil(n / dp)`` items of each piece (rank 0 of the
        dp group in the ring's chunking, ``n // dp + (r < n % dp)``).

    Notes
    -----
    With ``K = 2 optim_bytes + master_bytes``: ZeRO 0 ``P (bp + bg + K)``; 1 ``P (bp +
    bg) + K P/dp``; 2 ``P bp + (bg + K) P/dp``; 3 ``(bp + bg + K) P/dp``. With (2, 2,
    4, 4) these are the ZeRO paper's 16P, 4P + 12P/dp, 2P + 14P/dp and 16P/dp.

    References
    ----------
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC 2020, section 5 and Figure 1.
    """
    sb = StateBytes(param_bytes, grad_bytes, optim_bytes, master_bytes)
    _check_int("dp", dp)
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of 0, 1, 2, 3, got {zero!r}")
    pieces = _int_pieces(params)
    return _states(sum(int(n) for n in pieces), sum(-(-int(n) // dp) for n in pieces), zero, sb)


# -- pipeline -------------------------------------------------------------------------------
def bubble_fraction(pp: int, m: int) -> float:
    """``(pp - 1) / (m + pp - 1)``: the idle share of a pipeline of ``pp`` equal stages
    running ``m`` micro-batches, for GPipe and 1F1B alike (Huang et al. 2019;
    Narayanan et al. 2021, section 2.2)."""
    _check_int("pp", pp)
    _check_int("microbatches", m)
    return (pp - 1) / (m + pp - 1)


def in_flight(pp: int, m: int, stage: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak:
    ``m`` under GPipe, ``min(m, pp - stage)`` under 1F1B."""
    _check_schedule(schedule)
    return m if schedule == "gpipe" else min(m, pp - stage)


def pipeline_time(forward: Sequence[float], backward: Sequence[float], m: int,
                  schedule: str = "1f1b") -> tuple[float, int]:
    """Seconds of ``m`` micro-batches through stages with per-micro-batch ``forward``
    and ``backward`` seconds, and the index of the critical (slowest) stage.

    GPipe: ``(m-1)(max f + max b) + sum(f + b)``; 1F1B: ``(m-1) max(f + b) + sum(f +
    b)``. Equal stages give ``(m + pp - 1)(f + b)`` for both. The bubble is this time
    minus ``m`` times the critical stage's ``f + b``.
    """
    _check_schedule(schedule)
    if len(forward) != len(backward) or not forward:
        raise ValueError("forward and backward need one entry per stage")
    per = [f + b for f, b in zip(forward, backward)]
    crit = max(range(len(per)), key=per.__getitem__)
    steady = max(forward) + max(backward) if schedule == "gpipe" else per[crit]
    return (m - 1) * steady + sum(per), crit


def overlap_exposed(total_bytes: float, bucket_bytes: float, window: float,
                    seconds_of) -> float:
    """Seconds of a bucketed collective left over after ``window`` seconds of backward.

    The ``total_bytes`` of gradients are produced at an even rate over the window, in
    ``n = ceil(total / bucket)`` buckets (the last one partial); bucket i's collective
    (``seconds_of(nbytes)``) starts when the bucket is complete and the previous one
    is done. Returns ``max_i (ready_i + sum_{j >= i} tau_j) - window``: the last bucket,
    ready only at the end, is never hidden. O(1): the ready times and durations of the
    full buckets are uniform, so the maximum is at i = 1, n-1 or n.
    """
    if total_bytes <= 0:
        return 0.0
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    n = max(1, math.ceil(total_bytes / bucket_bytes - 1e-12))
    last = total_bytes - (n - 1) * bucket_bytes
    tau_n = seconds_of(last)
    if n == 1:
        return tau_n
    tau = seconds_of(bucket_bytes)

    def finish(i):                      # bucket i (1-based, i < n) starts the busy run
        return window * i * bucket_bytes / total_bytes + (n - i) * tau + tau_n

    end = max(finish(1), finish(n - 1), window + tau_n)
    return end - window


# -- checks ---------------------------------------------------------------------------------
def _check_int(name, val, minimum=1):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {val!r}")


def _check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def make_scheme(scheme, t: int | None = None, q: int | None = None, d: int = 1) -> Scheme:
    """A :class:`~summasim.costmodel.schemes.Scheme` from a name and its grid (``t``
    ranks for Megatron; ``q`` (and ``d``) for Optimus and SUMMA2.5-LM), or as given."""
    if isinstance(scheme, Scheme):
        return scheme
    if t is not None and q is None:
        return Scheme.make(scheme, p=t, d=d)
    return Scheme.make(scheme, p=t, q=q, d=d)


def check_composition(cfg: TransformerConfig, scheme: Scheme, dp: int, pp: int,
                      microbatches: int, global_batch: int, devices: int | None = None) -> int:
    """The micro-batch size ``b = B / (dp m)`` of a composition that can exist, else a
    ``ValueError`` with the numbers: ``dp pp t != devices``; N not divisible by pp
    (uneven stages are not priced); B not divisible by ``dp m``; a micro-batch the
    tensor grid cannot split, or a model it cannot divide (:func:`schemes.misfit`)."""
    for name, val in (("dp", dp), ("pp", pp), ("microbatches", microbatches),
                      ("global_batch", global_batch)):
        _check_int(name, val)
    t = scheme.p
    if devices is not None and dp * pp * t != devices:
        raise ValueError(f"dp * pp * tensor = {dp} * {pp} * {t} = {dp * pp * t} is not the "
                         f"{devices} devices")
    if not isinstance(cfg.N, numbers.Integral) or cfg.N % pp:
        raise ValueError(f"layers N = {cfg.N} are not divisible by pp = {pp} (uneven "
                         f"pipeline stages are not priced)")
    if global_batch % (dp * microbatches):
        raise ValueError(f"global batch {global_batch} is not divisible by dp * microbatches "
                         f"= {dp} * {microbatches} = {dp * microbatches}")
    b = global_batch // (dp * microbatches)
    why = misfit(scheme, cfg.replace(b=b))
    if why:
        raise ValueError(f"{scheme.label} cannot run micro-batches of b = {b}: {why}")
    return b


# -- the tensor-parallel prices of one micro-batch ------------------------------------------
@dataclass(frozen=True)
class Part:
    """Seconds of one piece of work on one rank: communication, GEMM, memory-bound."""

    comm: float = 0.0
    gemm: float = 0.0
    membound: float = 0.0

    @property
    def total(self) -> float:
        return self.comm + self.gemm + self.membound

    def __add__(self, o: "Part") -> "Part":
        return Part(self.comm + o.comm, self.gemm + o.gemm, self.membound + o.membound)

    def __sub__(self, o: "Part") -> "Part":
        return Part(self.comm - o.comm, self.gemm - o.gemm, self.membound - o.membound)

    def scale(self, k: float) -> "Part":
        return Part(self.comm * k, self.gemm * k, self.membound * k)


@dataclass(frozen=True)
class TensorMemory:
    """Memory pieces of micro-batches of ``b`` sequences on one tensor grid, per rank,
    from ``schemes.memory`` (parameters in items, the rest in bytes)."""

    layer_params: float       # one layer's parameters
    wte: float                # the embedding table's shard (tied to the LM head)
    wpe: float                # position embedding
    lnf: float                # final LayerNorm
    act_layer: float          # kept per layer per micro-batch (no checkpointing)
    act_ckpt: float           # kept per layer per micro-batch (checkpointing)
    logits: float             # logits and their gradient, last stage, per micro-batch
    grad_bufs: float          # the two activation-gradient buffers
    workspace: float          # SUMMA workspaces


@dataclass(frozen=True)
class TensorPrice:
    """One micro-batch of ``b`` sequences on one tensor grid: seconds (as
    :class:`Part`) and tensor-parallel payload bytes, from :mod:`schemes`."""

    layer_f: Part             # one layer's forward
    layer_b: Part             # one layer's backward (no recomputation)
    emb_f: Part               # embedding (first stage)
    emb_b: Part
    head_f: Part              # final LayerNorm, LM head and loss (last stage)
    head_b: Part
    layer_bytes_f: float      # tensor-parallel payload, bytes
    layer_bytes_b: float
    emb_bytes: float
    head_bytes: float
    opt_layer: float = 0.0    # the machine's own optimizer seconds of one layer's params
    opt_ends: float = 0.0     # and of the embedding and final LayerNorm (0: not priced)


def _membound_field(pred):
    """The memory-bound seconds a prediction reports itself, if it has such a field."""
    for name in ("memory_bound_seconds", "memory_seconds", "membound_seconds",
                 "elementwise_seconds"):
        val = getattr(pred, name, None)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
    return None


def _gemm_seconds(scheme, cfg, machine, slow):
    """GEMM (and summasim's ring additions) seconds of ``step_work``, with ``slow``."""
    work = step_work(scheme, cfg)
    t = sum(cnt * machine.gemm_time(a, b, c, cfg.dtype) for a, b, c, cnt in work.gemms)
    return (t + machine.gamma_reduce * work.reduce_bytes) * slow


def _split_step(pred, gemm) -> tuple[Part, float]:
    """A ``step_cost`` prediction as ``(Part, optimizer seconds)``, the optimizer taken
    out (the composition shards it). Its ``breakdown`` when it has one (``gemm_seconds``,
    ``memory_bound_seconds`` with ``optimizer_seconds`` inside, ``comm_exposed_seconds``),
    else a memory-bound field, else whatever its compute has beyond ``gemm``."""
    bd = getattr(pred, "breakdown", None) or {}
    if "gemm_seconds" in bd and "memory_bound_seconds" in bd:
        opt = float(bd.get("optimizer_seconds", 0.0))
        g, mb = float(bd["gemm_seconds"]), float(bd["memory_bound_seconds"]) - opt
        comm = float(bd.get("comm_exposed_seconds", pred.seconds - g - mb - opt))
        return Part(comm, g, mb), opt
    mb = _membound_field(pred)
    if mb is None:
        mb = max(0.0, pred.compute_seconds - gemm)
    return Part(pred.seconds - pred.compute_seconds, max(0.0, pred.compute_seconds - mb),
                mb), 0.0


def _sublist_at(seq, sub):
    """Index where ``sub`` occurs in ``seq`` (first), or -1."""
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if seq[i:i + n] == sub:
            return i
    return -1


def _embedding_parts(scheme, cfg, machine, rpn, pricers=None):
    """``(forward Part, backward Part, payload bytes)`` of the embedding's collectives:
    the ops of ``schemes.model_ops`` before the layers in forward and after them in
    backward (None when that structure is not found). ``pricers``: a dict in which the
    two pricers of this grid are kept for the next call."""
    ops = model_ops(scheme, cfg.replace(N=1))
    layer = layer_ops(scheme, cfg.replace(N=1), include_minor=True, checkpoint=False)
    i_f = _sublist_at(ops["forward"], layer["forward"])
    i_b = _sublist_at(ops["backward"], layer["backward"])
    if i_f < 0 or i_b < 0:
        return None
    it = cfg.itemsize
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    kw = dict(itemsize=it, q=scheme.q, d=scheme.d, p=scheme.p)
    pricers = {} if pricers is None else pricers
    key = ("pricers", machine.name, scheme, it)
    if key not in pricers:
        pricers[key] = (make_pricer(machine, **kw),
                        make_pricer(machine, algorithms={"allreduce": "ring"}, **kw))
    plain, ring = pricers[key]
    out, nbytes = [], 0.0
    for lst in (ops["forward"][:i_f], ops["backward"][i_b + len(layer["backward"]):]):
        comm = gemm = 0.0
        for op in lst:
            if op[0] in ("coll", "ring"):
                if op[0] == "coll":
                    _, cop, grp, size, items, cnt = op
                    pricer = plain
                else:                     # summasim's ring all-reduce
                    _, grp, size, items, cnt = op
                    cop, pricer = "allreduce", ring
                if size > 1:
                    mc = MessageClass(cop, grp, size, items * it, cnt)
                    comm += price_messages([mc], machine, pricer=pricer)[0]
                    nbytes += cnt * items * it
            elif op[0] == "gemm":
                _, m_, k_, n_, cnt = op
                gemm += cnt * machine.gemm_time(m_, k_, n_, cfg.dtype)
            else:
                return None               # a distributed product in the embedding: unknown
        out.append(Part(comm * comm_slow, gemm * slow, 0.0))
    return out[0], out[1], nbytes


def tensor_memory(scheme: Scheme, cfg: TransformerConfig, b: int) -> TensorMemory:
    """The :class:`TensorMemory` of micro-batches of ``b`` sequences on ``scheme``:
    ``schemes.memory`` at N = 1, 2, with and without checkpointing, the vocabulary
    doubled and the sequence doubled, differenced (it is linear in each)."""
    c1 = cfg.replace(b=b, N=1, checkpoint=False)
    it = cfg.itemsize
    m1 = memory(scheme, c1)
    m2 = memory(scheme, c1.replace(N=2))
    act_layer = m2.activations - m1.activations
    act_ckpt = (memory(scheme, c1.replace(N=2, checkpoint=True)).activations
                - memory(scheme, c1.replace(checkpoint=True)).activations)
    if cfg.v:
        grad_bufs = memory(scheme, c1.replace(v=0)).activations - act_layer
        logits = m1.activations - act_layer - grad_bufs
        wte = (memory(scheme, c1.replace(v=2 * cfg.v)).embedding - m1.embedding) / it
        wpe = (memory(scheme, c1.replace(s=2 * cfg.s)).embedding - m1.embedding) / it
        lnf = m1.embedding / it - wte - wpe
    else:
        grad_bufs, logits, wte, wpe, lnf = m1.activations - act_layer, 0.0, 0.0, 0.0, 0.0
    return TensorMemory(m1.params / it, wte, wpe, lnf, act_layer, act_ckpt, logits, grad_bufs,
                        m1.workspace)


def tensor_price(scheme: Scheme, cfg: TransformerConfig, b: int, machine: Machine, *,
                 ranks_per_node: int, cache: dict | None = None) -> TensorPrice:
    """The :class:`TensorPrice` of micro-batches of ``b`` sequences on ``scheme``.

    ``step_cost`` at N = 1 and N = 2 (the layer is their difference, the rest of
    N = 1 the embedding and the head, the embedding priced from its own collectives);
    the layer's forward share is ``scheme_cost``'s forward pass plus a third of its
    memory-bound work, the head's forward a third of the head.
    """
    c1 = cfg.replace(b=b, N=1, checkpoint=False)
    c2 = c1.replace(N=2)
    slow = machine.slowdown(ranks_per_node)
    p1 = step_cost(scheme, c1, machine, ranks_per_node=ranks_per_node)
    p2 = step_cost(scheme, c2, machine, ranks_per_node=ranks_per_node)
    s1, o1 = _split_step(p1, _gemm_seconds(scheme, c1, machine, slow))
    s2, o2 = _split_step(p2, _gemm_seconds(scheme, c2, machine, slow))
    layer = s2 - s1
    ends = s1 - layer
    sc = scheme_cost(scheme, c1, machine, include_minor=True, checkpoint=False,
                     ranks_per_node=ranks_per_node)
    fw = sc.forward
    f_mem = getattr(fw, "memory_seconds", 0.0) or 0.0
    layer_f = Part(min(fw.comm_seconds, layer.comm), min(fw.compute_seconds - f_mem, layer.gemm),
                   min(f_mem, layer.membound) if f_mem > 0 else layer.membound / 3)
    it = cfg.itemsize
    bytes1 = sum(mc.count * mc.nbytes for mc in model_messages(scheme, c1))
    bytes2 = sum(mc.count * mc.nbytes for mc in model_messages(scheme, c2))
    ends_bytes = bytes1 - (bytes2 - bytes1)
    emb = (_embedding_parts(scheme, c1, machine, ranks_per_node, cache)
           or (Part(), Part(), 0.0))
    emb_f, emb_b, emb_bytes = emb
    head = ends - emb_f - emb_b
    head = Part(max(0.0, head.comm), max(0.0, head.gemm), max(0.0, head.membound))
    head_f = head.scale(1 / 3)
    return TensorPrice(layer_f, layer - layer_f, emb_f, emb_b, head_f, head - head_f,
                       fw.payload * it, sc.backward.payload * it, emb_bytes,
                       max(0.0, ends_bytes - emb_bytes), o2 - o1, max(0.0, 2 * o1 - o2))


# -- the composition ------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshGroup:
    """The concurrent groups of one kind on the mesh (ranks in mesh order ``[dp, pp,
    tensor]``): in every block of ``block`` ranks, ``width`` groups of ``size`` ranks
    ``stride`` apart, starting at the block's first ``width`` ranks. Data parallel:
    ``(pp t, dp, devices, pp t)``; pipeline: ``(t, pp, pp t, t)``; the tied embedding's
    pair of first and last stage: ``((pp-1) t, 2, pp t, t)``."""

    stride: int
    size: int
    block: int
    width: int

    def groups(self, devices: int) -> list[list[int]]:
        return [[blk + o + i * self.stride for i in range(self.size)]
                for blk in range(0, devices, self.block) for o in range(self.width)]

    def group_of(self, rank: int):
        """``(block, offset)`` of the group holding ``rank``, or None."""
        x = rank % self.block
        o, i = x % self.stride, x // self.stride
        return (rank - x, o) if o < self.width and i < self.size else None

    def near(self, node_size: int) -> list[list[int]]:
        """The first group and every group with a rank on one of its nodes: all the
        groups that share a NIC with it (the first group stands for the others)."""
        first = [i * self.stride for i in range(self.size)]
        keys = {(0, 0)}
        for node in {r // node_size for r in first}:
            for r in range(node * node_size, (node + 1) * node_size):
                k = self.group_of(r)
                if k is not None:
                    keys.add(k)
        return [[blk + o + i * self.stride for i in range(self.size)]
                for blk, o in sorted(keys)]


@dataclass(frozen=True)
class _MeshGrid(GridShape):
    """A 1D placement of the whole mesh (row-major) whose groups are given: what
    :func:`~summasim.costmodel.topology.group_path` needs to share NICs among them."""

    members: tuple = ()

    def groups(self, kind, size=None):
        return [list(g) for g in self.members]


class _Coll:
    """Cached seconds of the composition's collectives over dp and pp groups.

    MPICH-family machines: summasim's ring algorithms (what the engine runs:
    all-reduce "ring", reduce-scatter "pairwise", all-gather "ring"; sends ``alpha +
    beta B``) on the inter-node link when any group of the kind spans nodes. NCCL
    machines: NCCL's own choice (:func:`~summasim.costmodel.nccl.nccl_time`) on the
    topology, every group of the kind running at once and sharing the NICs
    (:func:`~summasim.costmodel.topology.group_path` of all of them).
    """

    def __init__(self, machine, comm_slow, devices):
        self.machine, self.slow, self.devices = machine, comm_slow, devices
        self.nccl = getattr(machine, "library", "mpich") == "nccl" and \
            getattr(machine, "topology", None) is not None
        self.cache, self.paths = {}, {}

    def _where(self, grp: MeshGroup):
        hit = self.paths.get(grp)
        if hit is None:
            if self.nccl:
                groups = grp.near(self.machine.topology.devices_per_node)
                grid = _MeshGrid(self.devices, 1, 1, True, tuple(map(tuple, groups)))
                hit = group_path(self.machine.topology, grid, "world", grp.size, Placement())
            else:
                ns = self.machine.node_size
                hit = ns is not None and any(len({r // ns for r in g}) > 1
                                             for g in grp.groups(self.devices))
            self.paths[grp] = hit
        return hit

    def __call__(self, op, nbytes, grp: MeshGroup):
        if grp.size <= 1 or nbytes <= 0:
            return 0.0
        key = (op, nbytes, grp)
        hit = self.cache.get(key)
        if hit is None:
            where = self._where(grp)
            if self.nccl:
                hit = nccl_time("sendrecv" if op == "p2p" else op, nbytes, where,
                                ll128=self.machine.topology.ll128).seconds
            elif op == "p2p":
                hit = self.machine.link(where).time(nbytes)
            else:
                try:
                    hit = collective_time(op, nbytes, grp.size, self.machine, inter=where,
                                          algorithm=_RING_ALGORITHM[op]).seconds
                except ValueError:       # a library that names its algorithms differently
                    hit = collective_time(op, nbytes, grp.size, self.machine,
                                          inter=where).seconds
            hit *= self.slow
            self.cache[key] = hit
        return hit


def _memory_bandwidth(machine) -> float:
    """Bytes/s of device memory: the roofline device's, else ``3 / gamma_reduce``."""
    dev = getattr(machine, "device", None)
    bw = getattr(dev, "memory_bandwidth", None)
    if isinstance(bw, (int, float)) and not isinstance(bw, bool) and bw > 0:
        return float(bw)
    return 3.0 / machine.gamma_reduce if machine.gamma_reduce > 0 else math.inf


def model_flops(cfg: TransformerConfig, global_batch: int) -> float:
    """Useful flops of one step (forward + backward, no recomputation): ``3 [N (2 b s
    h^2 (4 + 2f) + 4 b s^2 h) + 2 b s h v]`` over the global batch; for f = 4 this is
    Narayanan et al. 2021's ``72 B s N h^2 (1 + s/(6h) + v/(12 N h))``."""
    B, s, h, v, N, f = global_batch, cfg.s, cfg.h, cfg.v, cfg.N, cfg.ffn
    return 3.0 * (N * (2 * B * s * h * h * (4 + 2 * f) + 4 * B * s * s * h) + 2 * B * s * h * v)


def _rep_stages(pp: int) -> list[tuple[int, int]]:
    """``(stage, count)``: the first stage, the first middle stage (standing for the
    ``pp - 2`` middle ones, which differ only in what 1F1B keeps in flight, the most
    at the first of them) and the last stage."""
    if pp == 1:
        return [(0, 1)]
    if pp == 2:
        return [(0, 1), (1, 1)]
    return [(0, 1), (1, pp - 2), (pp - 1, 1)]


def _pieces(tm: TensorMemory, L: int, pp: int, s: int) -> list:
    """``(items, count)`` of the parameter pieces stage ``s`` holds without ZeRO, as
    ZeRO 3 gathers them: the embedding (``wte`` + ``wpe``, first stage), each of its L
    layers, the final LayerNorm (with the tied ``wte`` copy on the last stage when
    pp > 1)."""
    out = [(tm.wte + tm.wpe, 1)] if s == 0 else []
    out.append((tm.layer_params, L))
    if s == pp - 1:
        out.append((tm.lnf + (tm.wte if pp > 1 else 0.0), 1))
    return [(n, c) for n, c in out if n > 0 and c > 0]


def stage_memory(tm: TensorMemory, *, L: int, pp: int, s: int, dp: int, zero: int, m: int,
                 schedule: str, checkpoint: bool, sb: StateBytes,
                 bucket_bytes: float = BUCKET_BYTES) -> dict:
    """Bytes per device on stage ``s`` (see the module doc): ``model_states``
    (:func:`model_state_bytes` of its pieces, each sharded on its own), ``transient``
    (ZeRO 2: the gradient of the largest piece and one bucket, at most the stage's;
    ZeRO 3: the largest piece gathered, and its gradient), ``activations``,
    ``workspace``, ``total``, ``in_flight``."""
    pieces = _pieces(tm, L, pp, s)
    full = sum(round(n) * c for n, c in pieces)
    ms = _states(full, sum(-(-round(n) // dp) * c for n, c in pieces), zero, sb)
    if zero == 2:        # buckets are reduce-scattered as soon as the backward ends them
        transient = min(full, max(n for n, _ in pieces) + bucket_bytes / sb.grad) * sb.grad
    elif zero == 3:
        transient = max(n for n, _ in pieces) * (sb.param + sb.grad)
    else:
        transient = 0.0
    k = in_flight(pp, m, s, schedule)
    acts = (k * L * (tm.act_ckpt if checkpoint else tm.act_layer)
            + (tm.act_layer if checkpoint else 0.0) + tm.grad_bufs)
    if s == pp - 1:
        acts += k * tm.logits
    return {"model_states": ms, "transient": transient, "activations": acts,
            "workspace": tm.workspace,
            "total": ms["total"] + transient + acts + tm.workspace, "in_flight": k}


def composition_memory(tm: TensorMemory, *, layers: int, dp: int, pp: int, zero: int, m: int,
                       schedule: str, checkpoint: bool, sb: StateBytes,
                       bucket_bytes: float = BUCKET_BYTES) -> dict:
    """The worst stage's :func:`stage_memory` (with its ``stage``): what must fit."""
    L = layers // pp
    best = None
    for s, _ in _rep_stages(pp):
        mem = stage_memory(tm, L=L, pp=pp, s=s, dp=dp, zero=zero, m=m, schedule=schedule,
                           checkpoint=checkpoint, sb=sb, bucket_bytes=bucket_bytes)
        if best is None or mem["total"] > best["total"]:
            best = {**mem, "stage": s}
    return best


def price_composition(cfg: TransformerConfig, scheme, *, machine: Machine,
                      t: int | None = None, q: int | None = None, d: int = 1, dp: int = 1,
                      pp: int = 1, microbatches: int = 1, global_batch: int | None = None,
                      zero: int = 0, schedule: str = "1f1b", checkpoint: bool | None = None,
                      devices: int | None = None, bucket_bytes: float = BUCKET_BYTES,
                      state_bytes: StateBytes | None = None, optimizer: bool = True,
                      zero3_prefetch: bool = False, cache: dict | None = None) -> dict:
    """Predicted step time, memory and traffic per device of one composition.

    Parameters
    ----------
    cfg : TransformerConfig
        The model (``b`` is the global batch unless ``global_batch`` is given;
        ``checkpoint`` the default for ``checkpoint``; ``dtype`` the activations',
        messages' and GEMMs').
    scheme : str or Scheme
        "megatron", "optimus" or "summa25"; its grid from ``t`` (Megatron) or ``q``, ``d``.
    machine : Machine
    t, q, d : int, optional
        The tensor grid: Megatron over ``t`` ranks, Optimus ``q x q``, SUMMA2.5-LM
        ``[q, q, d]`` (ignored when ``scheme`` is a Scheme).
    dp, pp, microbatches : int
        Data-parallel ranks, pipeline stages, micro-batches per step (m).
    global_batch : int, optional
        Sequences per step over all replicas (default ``cfg.b``).
    zero : {0, 1, 2, 3}
    schedule : {"1f1b", "gpipe"}
    checkpoint : bool, optional
        Activation checkpointing of every layer.
    devices : int, optional
        When given, ``dp * pp * t`` must equal it.
    bucket_bytes : float
        Gradient bucket of the data-parallel all-reduce / ZeRO reduce-scatter.
    state_bytes : StateBytes, optional
        Bytes per parameter of the model states (default
        ``StateBytes.for_dtype(cfg.dtype)``: mixed precision for 16-bit dtypes).
    optimizer : bool
        Price the Adam update (today's single-scheme prediction does not).
    zero3_prefetch : bool
        ZeRO 3: hide each piece's all-gather behind the previous piece's compute.
    cache : dict, optional
        Reused across calls for the per-(grid, micro-batch) prices (the planner's).

    Returns
    -------
    dict
        ``step_seconds``; ``breakdown`` (seconds, summing to the step: ``gemm``,
        ``memory_bound``, ``exposed_comm`` {tensor, dp, pp, zero}, ``bubble``,
        ``optimizer``), all of the critical stage's m micro-batches and the tail of
        the stage that finishes last; ``memory`` (bytes per device on the worst stage:
        ``model_states`` {params, grads, optimizer, total}, ``transient``,
        ``activations``, ``workspace``, ``total``, ``stage``); ``traffic`` (bytes per
        rank per step by kind, the maximum over stages); ``stages`` (the first, first
        middle and last stage, each with ``count``, the stages it stands for);
        ``composition``; ``params_per_device``; ``model_flops`` and
        ``flops_per_device`` (achieved model flop/s per device).

    Raises
    ------
    ValueError
        For a composition that cannot exist (see :func:`check_composition`), an
        unknown schedule or ZeRO stage.

    Notes
    -----
    Middle stages are identical in time and differ in memory only by what 1F1B keeps
    in flight, so the cost is O(1) in pp.
    """
    sch = make_scheme(scheme, t=t, q=q, d=d)
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of 0, 1, 2, 3, got {zero!r}")
    _check_schedule(schedule)
    B = cfg.b if global_batch is None else global_batch
    if isinstance(B, float) and B.is_integer():
        B = int(B)
    m = microbatches
    cache = {} if cache is None else cache
    ok = ("ok", cfg, sch, dp, pp, m, B, devices)
    b = cache.get(ok)
    if b is None:
        b = cache[ok] = check_composition(cfg, sch, dp, pp, m, B, devices)
    ck = cfg.checkpoint if checkpoint is None else bool(checkpoint)
    sb = state_bytes or StateBytes.for_dtype(cfg.dtype)
    T = sch.p
    n_dev = dp * pp * T
    rpn = machine.ranks_per_node(n_dev)
    slow = machine.slowdown(rpn)
    tm = cache.get(("mem", cfg, sch, b))
    if tm is None:
        tm = cache[("mem", cfg, sch, b)] = tensor_memory(sch, cfg, b)
    tp = cache.get(("tp", cfg, machine.name, sch, b, rpn))
    if tp is None:
        tp = cache[("tp", cfg, machine.name, sch, b, rpn)] = tensor_price(
            sch, cfg, b, machine, ranks_per_node=rpn, cache=cache)
    coll = cache.get(("coll", machine.name, rpn, n_dev))
    if coll is None:
        coll = cache[("coll", machine.name, rpn, n_dev)] = _Coll(
            machine, slow if machine.shared_comm else 1.0, n_dev)
    L = cfg.N // pp
    g_dp = MeshGroup(pp * T, dp, n_dev, pp * T)        # data parallel
    g_pp = MeshGroup(T, pp, pp * T, T)                  # pipeline neighbours
    g_emb = MeshGroup((pp - 1) * T, 2, pp * T, T)       # first and last stage
    it = cfg.itemsize
    # the pipeline hand-off: Megatron's activations are replicated over its t ranks and
    # each sends its copy; the 2D/2.5D schemes' are distributed and each sends its block
    p2p_bytes = b * cfg.s * cfg.h * it / (1 if sch.name == "megatron" else T)
    t_p2p = coll("p2p", p2p_bytes, g_pp) if pp > 1 else 0.0
    frac = (dp - 1) / dp
    reps = _rep_stages(pp)
    stages = []
    for s, count in reps:
        first, last = s == 0, s == pp - 1
        pieces = _pieces(tm, L, pp, s)
        P = sum(n * c for n, c in pieces)
        # tensor-parallel work of one micro-batch on this stage
        fwd = tp.layer_f.scale(L)
        bwd = tp.layer_b.scale(L) + (tp.layer_f.scale(L) if ck else Part())
        tbytes = L * (tp.layer_bytes_f + tp.layer_bytes_b + (tp.layer_bytes_f if ck else 0.0))
        if first:
            fwd, bwd, tbytes = fwd + tp.emb_f, bwd + tp.emb_b, tbytes + tp.emb_bytes
        if last:
            fwd, bwd, tbytes = fwd + tp.head_f, bwd + tp.head_b, tbytes + tp.head_bytes
        send_f = 0.0 if last else t_p2p           # activation to s + 1
        send_b = 0.0 if first else t_p2p          # its gradient to s - 1
        rs = ag_f = ag_b = 0.0
        if zero >= 2 and dp > 1:                  # every micro-batch, under its backward
            rs = overlap_exposed(P * sb.grad, bucket_bytes, bwd.total,
                                 lambda nb: coll("reduce_scatter", nb, g_dp))
        if zero == 3 and dp > 1:                  # before each piece's forward and backward
            piece_t = [(coll("allgather", n * sb.param / dp, g_dp), c)
                       for n, c in pieces]
            if zero3_prefetch:                    # hidden behind the previous piece
                k = sum(c for _, c in pieces)
                cf, cb = fwd.total / k, bwd.total / k
                hid_f = sum(c * max(0.0, x - cf) for x, c in piece_t)
                hid_b = sum(c * max(0.0, x - cb) for x, c in piece_t)
                ag_f = hid_f + piece_t[0][0] - max(0.0, piece_t[0][0] - cf)
                ag_b = hid_b + piece_t[-1][0] - max(0.0, piece_t[-1][0] - cb)
            else:
                ag_f = ag_b = sum(x * c for x, c in piece_t)
        ebytes = tm.wte * sb.grad / (dp if zero >= 1 else 1) if (pp > 1 and (first or last)) \
            else 0.0
        stages.append({
            "stage": s, "count": count, "layers": L, "params": P,
            "work": fwd + bwd, "sends": send_f + send_b, "zero_per_mb": rs + ag_f + ag_b,
            "forward_seconds": fwd.total + send_f + ag_f,
            "backward_seconds": bwd.total + send_b + rs + ag_b,
            "traffic": {
                "tensor": m * tbytes,
                "pipeline": m * p2p_bytes * ((not last) + (not first)),
                "embedding": ebytes,
                "dp_allreduce": 2 * frac * P * sb.grad if zero == 0 else 0.0,
                "zero_reduce_scatter": (m if zero >= 2 else 1) * frac * P * sb.grad
                if zero >= 1 else 0.0,
                "zero_allgather": (frac * P * sb.param if zero in (1, 2)
                                   else 2 * m * frac * P * sb.param if zero == 3 else 0.0)},
        })
    # the pipeline (pipeline_time's closed form over the representative stages)
    per = [st["forward_seconds"] + st["backward_seconds"] for st in stages]
    steady = (max(st["forward_seconds"] for st in stages)
              + max(st["backward_seconds"] for st in stages) if schedule == "gpipe"
              else max(per))
    t_pipe = (m - 1) * steady + sum(c * x for c, x in zip((st["count"] for st in stages), per))
    crit_rep = stages[max(range(len(stages)), key=per.__getitem__)]
    crit = crit_rep["stage"]
    # after the pipeline: the dp all-reduce (ZeRO 0/1), the tied embedding's all-reduce,
    # the optimizer, the all-gather of the updated parameters (ZeRO 1/2)
    bw = _memory_bandwidth(machine)
    before = 0.0                                  # backward time of the stages before it
    for st in stages:
        P = st["params"]
        end = t_pipe - before                     # its last backward ends here
        before += st["count"] * st["backward_seconds"]
        ar = 0.0
        if zero <= 1 and dp > 1:                  # its last backward's buckets, the drain
            red = "allreduce" if zero == 0 else "reduce_scatter"
            left = overlap_exposed(P * sb.grad, bucket_bytes, st["backward_seconds"],
                                   lambda nb: coll(red, nb, g_dp))
            ar = max(0.0, end + left - t_pipe)
        emb = coll("allreduce", st["traffic"]["embedding"], g_emb)
        shard = dp if zero >= 1 else 1
        if not optimizer:
            opt = 0.0
        elif tp.opt_layer > 0:                    # the machine's own optimizer pricing
            ends = tm.wte + tm.wpe + tm.lnf
            s = st["stage"]                       # (not the loop variable above)
            mine = (tm.wte + tm.wpe if s == 0 else 0.0) + (
                tm.lnf + (tm.wte if pp > 1 else 0.0) if s == pp - 1 else 0.0)
            opt = (L * tp.opt_layer + (tp.opt_ends * mine / ends if ends else 0.0)) / shard
        else:                                     # Adam streams its bytes once
            opt = (P / shard * (2 * sb.param + sb.grad + 4 * sb.optim + 2 * sb.master) / bw
                   * slow)
        gath = (coll("allgather", P * sb.param / dp, g_dp)
                if zero in (1, 2) and dp > 1 else 0.0)
        st["tail"] = {"dp": ar, "embedding": emb, "optimizer": opt, "allgather": gath}
        st["finish_seconds"] = t_pipe + ar + emb + opt + gath
    ender = max(stages, key=lambda st: st["finish_seconds"])
    step = ender["finish_seconds"]
    # breakdown: the critical stage's m micro-batches, the bubble, the last tail
    work = crit_rep["work"]
    per_mb = crit_rep["forward_seconds"] + crit_rep["backward_seconds"]
    tl = ender["tail"]
    breakdown = {
        "gemm": m * work.gemm,
        "memory_bound": m * work.membound,
        "exposed_comm": {"tensor": m * work.comm, "dp": tl["dp"],
                         "pp": m * crit_rep["sends"] + tl["embedding"],
                         "zero": m * crit_rep["zero_per_mb"] + tl["allgather"]},
        "bubble": t_pipe - m * per_mb,
        "optimizer": tl["optimizer"],
    }
    out_stages = []
    worst = None
    for st in stages:
        mem = stage_memory(tm, L=L, pp=pp, s=st["stage"], dp=dp, zero=zero, m=m,
                           schedule=schedule, checkpoint=ck, sb=sb, bucket_bytes=bucket_bytes)
        if worst is None or mem["total"] > worst["total"]:
            worst = {**mem, "stage": st["stage"]}
        out_stages.append({k: st[k] for k in ("stage", "count", "layers", "params",
                                              "forward_seconds", "backward_seconds", "tail",
                                              "finish_seconds", "traffic")}
                          | {"memory": mem})
    traffic = {kind: max(st["traffic"][kind] for st in stages) for kind in stages[0]["traffic"]}
    flops = model_flops(cfg, B)
    return {
        "composition": {"scheme": sch.name, "grid": sch.label, "t": T, "q": sch.q, "d": sch.d,
                        "dp": dp, "pp": pp, "devices": n_dev, "microbatches": m,
                        "micro_batch": b, "global_batch": B, "zero": zero,
                        "schedule": schedule, "checkpoint": ck, "layers_per_stage": L,
                        "bucket_bytes": bucket_bytes, "state_bytes": sb.to_dict(),
                        "dtype": cfg.dtype, "zero3_prefetch": bool(zero3_prefetch),
                        "optimizer": bool(optimizer)},
        "step_seconds": step,
        "pipeline_seconds": t_pipe,
        "critical_stage": crit,
        "bubble_fraction": (t_pipe - m * per_mb) / t_pipe if t_pipe else 0.0,
        "breakdown": breakdown,
        "memory": worst,
        "traffic": traffic,
        "stages": out_stages,
        "params_per_device": max(st["params"] for st in stages),
        "model_flops": flops,
        "flops_per_device": flops / (step * n_dev) if step > 0 else 0.0,
        "machine": machine.name,
    }


def predict_case(case: dict, machine: Machine, **kw) -> float | None:
    """Predicted seconds of one training step of a mesh case as the harness writes it
    (``MeshCase.to_dict()``: ``dp, pp, scheme, q, d, t, zero, schedule, m,
    checkpoint, bucket_bytes, b`` (the global batch), ``s, h, heads, v, layers, ffn,
    dtype``), or None when it cannot be priced (a missing key, a composition that
    cannot exist). The engine trains in its own dtype, so the model states are plain
    (``StateBytes.for_dtype(dtype, mixed=False)``) and the Adam update is priced;
    ``kw`` goes to :func:`price_composition`."""
    try:
        dtype = str(case.get("dtype", "float64"))
        cfg = TransformerConfig(b=int(case["b"]), s=int(case["s"]), h=int(case["h"]),
                                n=int(case["heads"]), N=int(case["layers"]),
                                v=int(case.get("v", 0)), dtype=dtype,
                                checkpoint=bool(case.get("checkpoint", False)),
                                ffn=case.get("ffn", 4))
        name = str(case["scheme"])
        if name == "megatron":
            sch = Scheme.make(name, p=int(case["t"]))
        else:
            sch = Scheme.make(name, q=int(case["q"]), d=int(case.get("d", 1)))
        kw.setdefault("state_bytes", StateBytes.for_dtype(dtype, mixed=False))
        res = price_composition(cfg, sch, machine=machine, dp=int(case["dp"]),
                                pp=int(case["pp"]), microbatches=int(case.get("m", 1)),
                                global_batch=int(case["b"]), zero=int(case.get("zero", 0)),
                                schedule=str(case.get("schedule", "1f1b")),
                                bucket_bytes=float(case.get("bucket_bytes", BUCKET_BYTES)),
                                **kw)
    except (KeyError, TypeError, ValueError):
        return None
    return res["step_seconds"]


def flatten_breakdown(breakdown: dict) -> dict:
    """``{"gemm", "memory_bound", "comm_tensor", "comm_dp", "comm_pp", "comm_zero",
    "bubble", "optimizer"}`` from a :func:`price_composition` breakdown."""
    out = {k: v for k, v in breakdown.items() if k != "exposed_comm"}
    out.update({f"comm_{k}": v for k, v in breakdown["exposed_comm"].items()})
    return out


__all__ = ["BUCKET_BYTES", "Part", "SCHEDULES", "StateBytes", "TensorMemory", "TensorPrice",
           "ZERO_STAGES", "bubble_fraction", "check_composition", "composition_memory",
           "flatten_breakdown", "in_flight", "make_scheme", "model_flops",
           "model_state_bytes", "overlap_exposed", "pipeline_time", "predict_case",
           "price_composition",
           "stage_memory", "tensor_memory", "tensor_price"]


# --------------------------------------------------------------------------- measured meshes
#: Element-wise passes of one Adam update per parameter (m, v, the bias-corrected
#: denominator and the update: about ten array operations, each one pass).
ADAM_PASSES = 10


def mesh_features(res: dict, machine: Machine) -> list:
    """The shared-core features (:class:`~summasim.costmodel.predict.SharedFeatures`) of
    every rank of one measured sharded-training step (``res``: a worker result of a
    ``MeshCase``, with each rank's event summary and coordinates ``[replica, stage,
    tensor rank, first layer, stop layer]``), for machines that price this node
    (oversubscribed ranks share cores).

    Each rank's messages are its traced events; its compute is ``m`` micro-batches of
    its stage: the stage's layers at the micro-batch size (the per-layer work of
    :func:`~summasim.costmodel.schemes.step_work`: its two-layer minus its one-layer
    work, 4/3 of it with checkpointing for the recomputed forward), the embedding and
    LM head on the last stage (the one-layer work minus one layer; the embedding's
    lookup is negligible next to the head's GEMM), and Adam on the stage's local
    parameters (``ADAM_PASSES`` element-wise passes, over ``dp`` under ZeRO >= 1).
    """
    from .predict import _compute_seconds, summary_messages, trace_features
    from .schemes import step_work

    name, dp, m = res["scheme"], int(res["dp"]), int(res["m"])
    t, q, d = int(res.get("t", 1)), int(res["q"]), int(res["d"])
    T = t if name == "megatron" else d * q * q
    sch = (Scheme.make("megatron", p=t) if name == "megatron"
           else Scheme.make(name, q=q, d=d))
    micro = int(res["b"]) // (dp * m)
    h, f, v, s = int(res["h"]), int(res.get("ffn", 4)), int(res["v"]), int(res["s"])

    def work_seconds(layers: int) -> float:
        cfg = TransformerConfig(b=micro, s=s, h=h, n=int(res["heads"]), N=layers, v=v,
                                dtype=res["dtype"], checkpoint=False, ffn=f)
        w = step_work(sch, cfg)
        return (_compute_seconds(machine, w.gemms, cfg.dtype, w.reduce_bytes)
                + machine.gamma_elementwise * w.elementwise_items
                + machine.layer_seconds * w.layers)

    one, two = work_seconds(1), work_seconds(2)
    per_layer = (two - one) * (4.0 / 3.0 if res.get("checkpoint") else 1.0)
    ends = one - (two - one)
    layer_params = ((4 + 2 * f) * h * h + (9 + f) * h) / T
    embed_params = (v + s) * h / T
    shard = dp if int(res.get("zero", 0)) >= 1 else 1
    out = []
    pp = int(res["pp"])
    for events, coords in zip(res["events"], res["coords"]):
        stage, lo, hi = int(coords[1]), int(coords[3]), int(coords[4])
        first, last = stage == 0, stage == pp - 1
        n_params = (hi - lo) * layer_params + (embed_params if first else 0) + (
            v * h / T if last and not first else 0)
        compute = m * ((hi - lo) * per_layer + (ends if last else 0.0))
        compute += machine.gamma_elementwise * ADAM_PASSES * n_params / shard
        out.append(trace_features(summary_messages(events), machine, p=int(res["p"]),
                                  dtype=res["dtype"], compute_seconds=compute))
    return out


def predict_measured_mesh(res: dict, machine: Machine) -> float:
    """Predicted seconds of one measured sharded-training step on this kind of node
    (the slowest rank, :func:`~summasim.costmodel.predict.predict_features`)."""
    from .predict import predict_features

    return predict_features(mesh_features(res, machine), machine,
                            machine.ranks_per_node(int(res["p"])))
