"""Price a training step of data x pipeline x ZeRO x tensor parallelism composed.

A composition runs ``devices = dp * pp * t`` ranks on the mesh ``[dp, pp, tensor
grid]`` (ranks in that Cartesian order, the tensor grid fastest: a tensor group is
``t`` consecutive ranks, a pipeline group has stride ``t``, a data-parallel group
stride ``pp t``). The tensor grid is one of today's schemes: Megatron 1D over ``t``
ranks, Optimus ``pr x pc`` (``q x q`` square), SUMMA2.5-LM ``[pr, pc, d]``, the 3D layer's
``q x q x q`` cube. The N layers are split into
``pp`` contiguous stages, or ``pp V`` virtual stages under the interleaved schedule
(virtual stage ``c pp + s`` is model chunk c of stage s), by
:func:`summasim.spec.stage_layers`: evenly, or as ``stages`` says (a stage may hold no
layer); the first stage also holds the embedding (``wte``, ``wpe``), the last the
final LayerNorm and the LM head (a tied copy of ``wte`` when pp > 1, or an untied
head's own ``[h, v]``). The global batch B is split over dp and into ``m``
micro-batches of ``b = B/(dp m)`` sequences, which must be a multiple of the scheme's
batch divisor (d pr; q^2 on the 3D cube). How the layers train (recompute, attention, sequence
parallelism) and the block (SwiGLU, grouped-query attention, the head) are the
workload's (:class:`~summasim.costmodel.workload.scheme.TransformerConfig`).

What a step costs (seconds; every piece below is in the result's breakdown)
---------------------------------------------------------------------------
tensor part      One micro-batch on one stage is priced with the per-scheme step
                 pricing of :mod:`~summasim.costmodel.workload.step` (``step_cost``: GEMMs,
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
                 in N only approximately). Full recompute adds each layer's forward
                 again (``scheme_cost``'s forward pass) to its backward; selective
                 recompute its attention core (``tensor.selective_part``: ``Q K^T``
                 and attention over V, ``4 b s^2 h`` flops over the ranks, and the
                 softmax; Korthikanti et al. 2022, section 5).
pipeline         Per micro-batch, stage s takes ``t_s = f_s + b_s`` (its forward and
                 backward, plus the point-to-point sends of the activation to s+1
                 and of its gradient to s-1). GPipe (Huang et al. 2019) runs all
                 forwards then all backwards, ``T = (m-1)(max f + max b) + sum(f + b)``;
                 1F1B (Narayanan et al. 2021, section 2.2) ``T = (m-1) max(f + b) +
                 sum(f + b)``. With equal stages both are ``(m + pp - 1) t`` and the
                 bubble ``(pp - 1) t`` is the fraction ``(pp-1)/(m+pp-1)`` of the
                 pipeline (:func:`bubble_fraction`); the schedules differ in memory.
                 Interleaved 1F1B with V chunks per stage (Narayanan et al. 2021,
                 section 2.2.2) ``T = m max(f + b) + (sum(f + b) - max(f + b)) / V``,
                 the bubble ``(pp - 1)/V`` of a stage's time, with V hand-offs each
                 way per micro-batch; m must be a multiple of pp (Megatron-LM's
                 rule). Stages of equal layers are priced once
                 (:func:`~summasim.costmodel.workload.stage_memory.stage_plan`); the
                 slowest sets the pace.
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
                 piece's compute, in backward only in the link time the
                 reduce-scatters leave: :func:`~.overlap.zero3_gathers`); no
                 all-gather after the update. ``grad_overlap=False`` runs every
                 gradient reduction after the backward that made it.
overlap          A collective hidden behind compute slows that compute by the share
                 of the device's SMs it runs on (:mod:`~.overlap`:
                 ``max(y, c + f y)``, ``f = comm_sms / sms``; 0 on the CPU model):
                 the breakdown's ``contention``. Pipeline hand-offs block, or with
                 ``p2p_overlap`` overlap the steady state's compute (:func:`steady`).
tied embedding   With pp > 1 the first and last stages all-reduce the ``wte``
                 gradient between them (Megatron; a ring of 2: the shard's bytes),
                 after the data-parallel reduction, on the 1/dp shard under ZeRO 2/3.
                 An untied head has no such all-reduce.
optimizer        The Adam update of the parameters a rank updates (P at ZeRO 0, P/dp
                 from ZeRO 1 on): at the rate ``step_cost`` prices it per parameter
                 when it does (GPU presets: roofline kernels), else Adam's bytes
                 (read params, grads, m, v, master; write params, m, v, master: ``2 bp
                 + bg + 4 bo + 2 bm`` per parameter) at the memory bandwidth
                 (``3 / gamma_reduce``: ``a += b`` streams 3 bytes per operand byte).
                 Under a loss scale the gradients are first unscaled and checked (a
                 pass reading and writing them), and dynamic scaling all-reduces one
                 float32 overflow flag (:func:`_unscale_seconds`).

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
micro-batch come from ``schemes.memory`` (per layer; per layer's checkpoint plus one
layer being recomputed under full recompute; per layer without its attention core
plus one core under selective recompute); a stage holds ``m`` micro-batches of them
under GPipe, ``min(m, pp - s)`` under 1F1B (stage s, from 0) and under the interleaved
schedule the chunk activations of Megatron-LM's schedule at their peak
(:func:`~summasim.costmodel.workload.pipeline.interleaved_held`); the last stage also
holds the logits and their gradient per micro-batch in flight. Add the two activation-gradient
buffers and the SUMMA workspaces.

Traffic per rank (bytes per step, what its trace records: summed ``nbytes``)
---------------------------------------------------------------------------
``tensor``: the tensor-parallel collectives' payload (as ``schemes`` reports it,
recomputation included); ``pipeline``: activations sent forward and gradients sent
backward, per micro-batch (Megatron sends the replicated ``b s h`` activation, the
2D/2.5D schemes their ``b s h / t`` block, Megatron under sequence parallelism its
``b s h / t`` shard; V times each way interleaved); ``embedding``: the tied-``wte``
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
V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022 (sequence parallelism, section 4.2.2; selective recompute, section 5).
P. Micikevicius et al., "Mixed Precision Training", ICLR 2018 (loss scaling, 3.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._checks import finite_size
from ..machine import Machine
from .mesh import MeshGroup, _Coll, _memory_bandwidth, model_flops
from .pipeline import _check_schedule, overlap_exposed
from ...spec import MIXED_DTYPES, parse_loss_scale, parse_schedule, stage_layers
from .scheme import Scheme, TransformerConfig, grid_blocks
from .stage_memory import _pieces, stage_memory, stage_plan
from .tensor import (Part, TensorMemory, TensorPrice, check_composition, make_scheme,
                     tensor_memory, tensor_price)
from .overlap import Window, bucket_contention, contention_share, window, zero3_gathers
from .zero import BUCKET_BYTES, ZERO_STAGES, StateBytes

@dataclass(frozen=True)
class Stage:
    """One representative pipeline stage: its share of the model and the cost of one
    micro-batch on it (seconds per rank; ``work`` the tensor-parallel part)."""

    stage: int
    count: int                  # the stages it stands for
    layers: int                 # all its chunks'
    params: float               # parameters of the stage on one rank of its tensor grid
    work: Part                  # forward + backward of one micro-batch (and the recompute)
    sends: float                # pipeline hand-offs of one micro-batch
    zero_per_mb: float          # ZeRO 2/3 collectives of one micro-batch, exposed
    forward_seconds: float
    backward_seconds: float
    traffic: dict               # bytes per rank per step by kind
    chunks: tuple = ()          # layers of each of its model chunks (interleaved: V)
    contention: float = 0.0     # compute slowed by its hidden ZeRO collectives

    @property
    def seconds(self) -> float:
        """One micro-batch, forward and backward."""
        return self.forward_seconds + self.backward_seconds


@dataclass(frozen=True)
class _Setup:
    """What every stage of one composition shares (see :func:`price_composition`)."""

    cfg: TransformerConfig
    sch: Scheme
    machine: Machine
    dp: int
    pp: int
    m: int                      # micro-batches per step
    b: int                      # sequences per micro-batch
    B: int                      # global batch
    zero: int
    schedule: str
    ck: bool                    # full recompute
    sb: StateBytes
    n_dev: int
    slow: float
    tm: TensorMemory
    tp: TensorPrice
    coll: _Coll
    L: int                      # layers of the largest stage
    g_dp: MeshGroup
    g_emb: MeshGroup
    p2p_bytes: float
    t_p2p: float
    bucket_bytes: float
    optimizer: bool
    zero3_prefetch: bool
    recompute: str = "none"     # none, selective, full
    chunks: int = 1             # V model chunks per stage (interleaved)
    stages: tuple | None = None  # layers per (virtual) stage, None: even
    plan: tuple = ()            # stage_plan: (stage, count, chunk layers)
    loss_scale: str = "none"
    g_flag: MeshGroup | None = None  # the loss-scale overflow flag's group
    grad_overlap: bool = True   # gradient reductions overlap the backward
    share: float = 0.0          # of the device a running collective takes (contention)
    p2p_overlap: bool = False   # pipeline hand-offs overlap the compute in steady state


def _cached(cache: dict, key: tuple, make):
    """``cache[key]``, made by ``make()`` the first time."""
    val = cache.get(key)
    if val is None:
        val = cache[key] = make()
    return val


def _setup(cfg, scheme, machine, t, q, d, dp, pp, microbatches, global_batch, zero,
           schedule, checkpoint, devices, bucket_bytes, state_bytes, optimizer,
           zero3_prefetch, cache, recompute=None, chunks=1, stages=None,
           loss_scale="none", pc=None, grad_overlap=True, p2p_overlap=False) -> _Setup:
    """Check the composition and price what its stages share (cached per grid and
    micro-batch in ``cache``)."""
    sch = make_scheme(scheme, t=t, q=q, d=d, pc=pc)
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of 0, 1, 2, 3, got {zero!r}")
    bucket_bytes = finite_size("bucket_bytes", bucket_bytes, positive=True)
    _check_schedule(schedule, chunks)
    recompute = _recompute_of(cfg, checkpoint, recompute)
    loss_scale = parse_loss_scale(loss_scale)           # a ValueError naming the forms
    if p2p_overlap and schedule == "gpipe":
        raise ValueError("p2p_overlap prices the steady state of 1f1b and interleaved "
                         "schedules; gpipe has none (all forwards, then all backwards)")
    stages = None if stages is None else tuple(int(x) for x in stages)
    B = cfg.b if global_batch is None else global_batch
    if isinstance(B, float) and B.is_integer():
        B = int(B)
    m = microbatches
    cache = {} if cache is None else cache
    b = _cached(cache, ("ok", cfg, sch, dp, pp, m, B, devices, stages, chunks),
                lambda: check_composition(cfg, sch, dp, pp, m, B, devices, stages=stages,
                                          chunks=chunks))
    T = sch.p
    n_dev = dp * pp * T
    rpn = machine.ranks_per_node(n_dev)
    slow = machine.slowdown(rpn)
    tm = _cached(cache, ("mem", cfg, sch, b), lambda: tensor_memory(sch, cfg, b))
    tp = _cached(cache, ("tp", cfg, machine.name, sch, b, rpn),
                 lambda: tensor_price(sch, cfg, b, machine, ranks_per_node=rpn, cache=cache))
    coll = _cached(cache, ("coll", machine.name, rpn, n_dev),
                   lambda: _Coll(machine, slow if machine.shared_comm else 1.0, n_dev))
    g_pp = MeshGroup(T, pp, pp * T, T)                  # pipeline neighbours
    # the pipeline hand-off: Megatron's activations are replicated over its t ranks and
    # each sends its copy (under sequence parallelism its [s/t, b, h] shard); the 2D,
    # 2.5D and 3D schemes' are distributed and each sends its block, b / (d pr)
    # sequences of its column's whole heads (the busiest: column 0, grid_blocks)
    if sch.name == "megatron":
        p2p_bytes = b * cfg.s * cfg.h * cfg.itemsize / (T if cfg.sequence_parallel else 1)
    else:
        p2p_bytes = b * cfg.s * grid_blocks(sch, cfg).h * cfg.itemsize / (sch.d * sch.q)
    plan = stage_plan(int(cfg.N), pp, stages, chunks)
    return _Setup(
        cfg=cfg, sch=sch, machine=machine, dp=dp, pp=pp, m=m, b=b, B=B, zero=zero,
        schedule=schedule, ck=recompute == "full",
        sb=state_bytes or StateBytes.for_dtype(cfg.dtype), n_dev=n_dev, slow=slow, tm=tm,
        tp=tp, coll=coll, L=max(sum(per) for _, _, per in plan),
        g_dp=MeshGroup(pp * T, dp, n_dev, pp * T),      # data parallel
        g_emb=MeshGroup((pp - 1) * T, 2, pp * T, T),     # first and last stage
        p2p_bytes=p2p_bytes, t_p2p=coll("p2p", p2p_bytes, g_pp) if pp > 1 else 0.0,
        bucket_bytes=bucket_bytes, optimizer=optimizer, zero3_prefetch=zero3_prefetch,
        recompute=recompute, chunks=chunks, stages=stages, plan=plan,
        loss_scale=str(loss_scale), grad_overlap=bool(grad_overlap),
        share=contention_share(machine), p2p_overlap=bool(p2p_overlap),
        # the overflow flag: over the model-parallel group (t x pp), and over every
        # device once ZeRO shards the gradients over dp
        g_flag=(MeshGroup(1, n_dev, n_dev, 1) if zero >= 1
                else MeshGroup(1, pp * T, pp * T, 1)))


def _recompute_of(cfg: TransformerConfig, checkpoint, recompute) -> str:
    """The recompute a composition prices: ``recompute``, else ``checkpoint`` (True:
    full, False: none), else the workload's; a ValueError when they contradict."""
    if checkpoint is not None and recompute is not None \
            and bool(checkpoint) != (recompute == "full"):
        raise ValueError(f"checkpoint={checkpoint} contradicts recompute={recompute!r} "
                         f"(checkpoint is recompute='full')")
    if recompute is None:
        recompute = cfg.recompute if checkpoint is None else (
            "full" if checkpoint else "none")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    return recompute


def _zero3(c: _Setup, pieces, fwd: Part, bwd: Part, rs_alone: float) -> tuple[Window, Window]:
    """ZeRO-3's exposed all-gathers of one micro-batch, before and under its forward and
    backward, with their contention (:func:`~.overlap.zero3_gathers`); in backward the
    gathers hide in the link time the gradient reduce-scatters (``rs_alone`` seconds
    in all) leave."""
    runs = [(c.coll("allgather", n * c.sb.param / c.dp, c.g_dp), cnt) for n, cnt in pieces]
    k = sum(cnt for _, cnt in pieces)
    busy = rs_alone / k if c.grad_overlap else 0.0
    return zero3_gathers(runs, fwd.total / k, bwd.total / k, busy, c.share, c.zero3_prefetch)


def _bucketed(c: _Setup, total_bytes: float, window_s: float, op: str) -> Window:
    """A bucketed gradient reduction under ``window_s`` seconds of backward
    (:func:`overlap_exposed`), none of it hidden without ``grad_overlap``, and its
    contention: the backward, slowed by the device share ``f`` of the ``hidden``
    seconds it overlapped, produces its buckets ``f hidden`` later, which delays the
    reduction's end only by what its backlog does not absorb (the exposed time beyond
    the last bucket's, which waits for the end of the backward in any case):
    ``max(0, f hidden - (exposed - tau_last))`` (:func:`~.overlap.bucket_contention`)."""
    seconds = (lambda nb: c.coll(op, nb, c.g_dp))
    if not c.grad_overlap:
        window_s = 0.0
    exposed = overlap_exposed(total_bytes, c.bucket_bytes, window_s, seconds)
    if not c.share or window_s <= 0 or total_bytes <= 0:
        return Window(exposed, 0.0)
    alone = overlap_exposed(total_bytes, c.bucket_bytes, 0.0, seconds)
    n = max(1, math.ceil(total_bytes / c.bucket_bytes - 1e-12))
    last = seconds(total_bytes - (n - 1) * c.bucket_bytes)
    return Window(exposed, bucket_contention(min(window_s, alone - exposed), exposed, last,
                                             c.share))


def stage_cost(c: _Setup, s: int, count: int, chunks: tuple | None = None) -> Stage:
    """Stage ``s`` (standing for ``count`` stages; ``chunks``: the layers of each of its
    model chunks, default the even split's): one micro-batch's tensor-parallel work
    (and its recompute), its pipeline sends and ZeRO 2/3 collectives, and the stage's
    traffic."""
    first, last = s == 0, s == c.pp - 1
    if chunks is None:
        chunks = next(per for st, _, per in c.plan if st == s)
    tp, dp, zero, sb, m = c.tp, c.dp, c.zero, c.sb, c.m
    L = sum(chunks)
    pieces = _pieces(c.tm, L, c.pp, s, c.cfg.tied)
    P = sum(n * k for n, k in pieces)
    # tensor-parallel work of one micro-batch on this stage: full recompute runs each
    # layer's forward again in backward, selective its attention core
    again = (tp.layer_f if c.recompute == "full" else
             tp.layer_sel if c.recompute == "selective" else None)
    fwd = tp.layer_f.scale(L)
    bwd = tp.layer_b.scale(L) + (again.scale(L) if again is not None else Part())
    tbytes = L * (tp.layer_bytes_f + tp.layer_bytes_b + (tp.layer_bytes_f if c.ck else 0.0))
    if first:
        fwd, bwd, tbytes = fwd + tp.emb_f, bwd + tp.emb_b, tbytes + tp.emb_bytes
    if last:
        fwd, bwd, tbytes = fwd + tp.head_f, bwd + tp.head_b, tbytes + tp.head_bytes
    # each of the V chunks hands its activation on (but the last virtual stage) and its
    # gradient back (but the first): V times the hand-offs of 1F1B (Narayanan et al.
    # 2021, section 2.2.2)
    V = c.chunks
    send_f = (V - (1 if last else 0)) * c.t_p2p   # activations to s + 1
    send_b = (V - (1 if first else 0)) * c.t_p2p  # gradients to s - 1
    zf = rs = zb = Window()
    if zero >= 2 and dp > 1:                      # every micro-batch, under its backward
        rs = _bucketed(c, P * sb.grad, bwd.total, "reduce_scatter")
    if zero == 3 and dp > 1:                      # each piece before its forward and backward
        alone = overlap_exposed(P * sb.grad, c.bucket_bytes, 0.0,
                                lambda nb: c.coll("reduce_scatter", nb, c.g_dp))
        zf, zb = _zero3(c, pieces, fwd, bwd, alone)
    ebytes = c.tm.wte * sb.grad / (dp if zero >= 1 else 1) \
        if (c.pp > 1 and (first or last) and c.cfg.tied) else 0.0
    frac = (dp - 1) / dp
    return Stage(
        stage=s, count=count, layers=L, params=P, work=fwd + bwd, sends=send_f + send_b,
        zero_per_mb=rs.exposed + zf.exposed + zb.exposed,
        contention=zf.contention + rs.contention + zb.contention,
        forward_seconds=fwd.total + send_f + zf.exposed + zf.contention,
        backward_seconds=bwd.total + send_b + rs.exposed + zb.exposed
        + rs.contention + zb.contention,
        traffic={
            "tensor": m * tbytes,
            "pipeline": m * c.p2p_bytes * (2 * V - last - first),
            "embedding": ebytes,
            "dp_allreduce": 2 * frac * P * sb.grad if zero == 0 else 0.0,
            "zero_reduce_scatter": (m if zero >= 2 else 1) * frac * P * sb.grad
            if zero >= 1 else 0.0,
            "zero_allgather": (frac * P * sb.param if zero in (1, 2)
                               else 2 * m * frac * P * sb.param if zero == 3 else 0.0)},
        chunks=tuple(chunks))


def steady(c: _Setup, st: Stage) -> Window:
    """Stage ``st``'s pipeline hand-offs of one micro-batch in the steady state: all
    exposed (blocking sends, the default: DeepSpeed's pipeline engine, Megatron-LM's 1F1B,
    which refuses ``--overlap-p2p-communication``), or with ``p2p_overlap`` (an engine
    whose hand-offs are non-blocking: Megatron-LM's interleaved schedule with
    ``--overlap-p2p-communication``) overlapping the micro-batch's compute (:func:`~.overlap.window`: exposed ``max(0, sends -
    compute)``, with its contention). Warm-up and cool-down pay them in full."""
    if not c.p2p_overlap:
        return Window(st.sends, 0.0)
    return window(st.seconds - st.sends, st.sends, c.share)


def _steady_seconds(c: _Setup, st: Stage) -> float:
    """One micro-batch of stage ``st`` in the steady state (:func:`steady`)."""
    if not c.p2p_overlap:
        return st.seconds
    w = steady(c, st)
    return st.seconds - st.sends + w.exposed + w.contention


def pipeline_seconds(c: _Setup, stages: list[Stage]) -> float:
    """The pipeline of m micro-batches over the stages (:func:`pipeline_time`'s closed
    form over the representative stages): GPipe and 1F1B, and the interleaved
    schedule's ``m max(f + b) + (sum(f + b) - max(f + b)) / V``. The steady state's
    ``f + b`` is :func:`_steady_seconds` (the hand-offs hidden under ``p2p_overlap``);
    the fill and drain (the sums) pay every hand-off."""
    per = [st.seconds for st in stages]
    top_steady = max(_steady_seconds(c, st) for st in stages)
    if c.schedule == "interleaved":
        top = max(per)
        return (c.m * top_steady + (sum(st.count * x for st, x in zip(stages, per)) - top)
                / c.chunks)
    steady_s = (max(st.forward_seconds for st in stages)
                + max(st.backward_seconds for st in stages) if c.schedule == "gpipe"
                else top_steady)
    return (c.m - 1) * steady_s + sum(st.count * x for st, x in zip(stages, per))


def stage_tail(c: _Setup, st: Stage, end: float, t_pipe: float) -> dict:
    """What stage ``st`` does after its last backward (which ends at ``end``): the
    drain of the dp all-reduce (ZeRO 0/1), the tied embedding's all-reduce, the
    optimizer step (with the loss scale's unscaling and overflow check), the all-gather
    of the updated parameters (ZeRO 1/2); seconds."""
    P, zero, dp, sb, tm, tp, pp = st.params, c.zero, c.dp, c.sb, c.tm, c.tp, c.pp
    ar = slowed = 0.0
    if zero <= 1 and dp > 1:                      # its last backward's buckets, the drain
        red = _bucketed(c, P * sb.grad, st.backward_seconds,
                        "allreduce" if zero == 0 else "reduce_scatter")
        ar = max(0.0, end + red.exposed - t_pipe)
        slowed = red.contention
    emb = c.coll("allreduce", st.traffic["embedding"], c.g_emb)
    shard = dp if zero >= 1 else 1
    if not c.optimizer:
        opt = 0.0
    elif tp.opt_layer > 0:                        # the machine's own optimizer pricing
        head = tm.head if not c.cfg.tied else (tm.wte if pp > 1 else 0.0)
        ends = tm.wte + tm.wpe + tm.lnf + tm.head
        mine = (tm.wte + tm.wpe if st.stage == 0 else 0.0) + (
            tm.lnf + head if st.stage == pp - 1 else 0.0)
        # without a vocabulary (v = 0) the ends are the final LayerNorm alone, whose
        # parameters the memory leaves out but whose Adam launches step_cost prices: the
        # last stage's
        last = tp.opt_ends if st.stage == pp - 1 else 0.0
        opt = (st.layers * tp.opt_layer + (tp.opt_ends * mine / ends if ends else last)) / shard
    else:                                         # Adam streams its bytes once
        opt = (P / shard * (2 * sb.param + sb.grad + 4 * sb.optim + 2 * sb.master)
               / _memory_bandwidth(c.machine) * c.slow)
    if c.optimizer and c.loss_scale != "none":
        opt += _unscale_seconds(c, P / shard)
    gath = (c.coll("allgather", P * sb.param / dp, c.g_dp)
            if zero in (1, 2) and dp > 1 else 0.0)
    return {"dp": ar, "embedding": emb, "optimizer": opt, "allgather": gath,
            "contention": slowed}


def _unscale_seconds(c: _Setup, params: float) -> float:
    """The loss scale's part of the optimizer step on ``params`` parameters (Micikevicius
    et al. 2018, section 3.2, mixed precision with loss scaling): the gradients are
    divided by the scale and checked for inf/NaN in one pass that reads and writes each
    (PyTorch's ``_amp_foreach_non_finite_check_and_unscale_``: ``2 bg`` bytes per
    parameter at the memory bandwidth); under dynamic scaling the overflow flag, one
    float32, is all-reduced (max) so every rank skips the same steps (Megatron-LM's
    ``found_inf``: over the model-parallel group, and over the data-parallel one once
    ZeRO shards the gradients)."""
    secs = params * 2 * c.sb.grad / _memory_bandwidth(c.machine) * c.slow
    if c.loss_scale == "dynamic":
        secs += c.coll("allreduce", 4, c.g_flag)
    return secs


def composition_breakdown(c: _Setup, crit: Stage, tail: dict, t_pipe: float) -> dict:
    """The step in parts (seconds, summing to it): the critical stage's m micro-batches,
    the bubble, and the tail of the stage that finishes last."""
    m, work = c.m, crit.work
    sends = steady(c, crit)
    return {
        "gemm": m * work.gemm,
        "memory_bound": m * work.membound,
        "exposed_comm": {"tensor": m * work.comm, "dp": tail["dp"],
                         "pp": m * sends.exposed + tail["embedding"],
                         "zero": m * crit.zero_per_mb + tail["allgather"],
                         "contention": m * (crit.contention + sends.contention)
                         + tail["contention"]},
        "bubble": t_pipe - m * _steady_seconds(c, crit),
        "optimizer": tail["optimizer"],
    }


def price_composition(cfg: TransformerConfig, scheme, *, machine: Machine,
                      t: int | None = None, q: int | None = None, d: int = 1, dp: int = 1,
                      pp: int = 1, microbatches: int = 1, global_batch: int | None = None,
                      zero: int = 0, schedule: str = "1f1b", checkpoint: bool | None = None,
                      devices: int | None = None, bucket_bytes: float = BUCKET_BYTES,
                      state_bytes: StateBytes | None = None, optimizer: bool = True,
                      zero3_prefetch: bool = False, cache: dict | None = None,
                      recompute: str | None = None, chunks: int = 1,
                      stages: tuple | None = None, loss_scale: str = "none",
                      pc: int | None = None, grad_overlap: bool = True,
                      p2p_overlap: bool = False) -> dict:
    """Predicted step time, memory and traffic per device of one composition.

    Parameters
    ----------
    cfg : TransformerConfig
        The model (``b`` is the global batch unless ``global_batch`` is given;
        ``recompute`` the default for ``recompute``; ``dtype`` the activations',
        messages' and GEMMs'; ``attention``, ``sequence_parallel`` and the block
        priced as it says).
    scheme : str or Scheme
        "megatron", "optimus", "summa25" or "3d"; its grid from ``t`` (Megatron) or
        ``q``, ``d`` and ``pc`` (3d: q, its depth is q).
    machine : Machine
    t, q, d, pc : int, optional
        The tensor grid: Megatron over ``t`` ranks, Optimus ``q x q`` (``q x pc``: q rows,
        pc columns), SUMMA2.5-LM ``[q, q, d]`` (``[q, pc, d]``), 3D ``q x q x q`` (ignored
        when ``scheme`` is a Scheme).
    dp, pp, microbatches : int
        Data-parallel ranks, pipeline stages, micro-batches per step (m).
    global_batch : int, optional
        Sequences per step over all replicas (default ``cfg.b``).
    zero : {0, 1, 2, 3}
    schedule : {"1f1b", "gpipe", "interleaved"}
    checkpoint : bool, optional
        Full recompute of every layer (True) or none (False); ``recompute`` names it.
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
    recompute : {"none", "selective", "full"}, optional
        Activation recompute (default ``cfg.recompute``, or ``checkpoint``'s).
    chunks : int
        Model chunks per stage V (>= 2 with ``schedule="interleaved"``, else 1).
    stages : tuple of int, optional
        Layers per (virtual) stage (:func:`summasim.spec.stage_layers`; default even).
    loss_scale : str
        ``none``, ``dynamic`` or ``static:S``: the optimizer step's unscaling and, when
        dynamic, the overflow flag's all-reduce.
    grad_overlap : bool
        The data-parallel gradient reduction (ZeRO 0/1's all-reduce or reduce-scatter,
        ZeRO 2/3's per-micro-batch reduce-scatter) runs bucket by bucket under the
        backward that produces it (True: PyTorch DDP, Megatron-LM's overlapped
        gradient reduction, DeepSpeed, FSDP), or only once that backward has ended
        (False: e.g. Megatron-LM's 2019 code, whose ``allreduce_params`` runs after
        ``backward``).
    p2p_overlap : bool
        The pipeline hand-offs of the steady state overlap the compute (non-blocking
        hand-offs: Megatron-LM's interleaved schedule with
        ``--overlap-p2p-communication``) instead of blocking it (the default: DeepSpeed's
        pipeline engine, Megatron-LM's 1F1B); the fill and drain pay them. 1F1B and
        interleaved only: a ValueError with GPipe, whose closed form has no steady
        state.

    Returns
    -------
    dict
        ``step_seconds``; ``breakdown`` (seconds, summing to the step: ``gemm``,
        ``memory_bound``, ``exposed_comm`` {tensor, dp, pp, zero, contention: the
        compute slowed by the collectives it hid}, ``bubble``,
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
    Stages of equal layers are identical in time and differ in memory only by what
    the schedule keeps in flight, so an even split costs O(1) in pp.
    """
    c = _setup(cfg, scheme, machine, t, q, d, dp, pp, microbatches, global_batch, zero,
               schedule, checkpoint, devices, bucket_bytes, state_bytes, optimizer,
               zero3_prefetch, cache, recompute, chunks, stages, loss_scale, pc,
               grad_overlap, p2p_overlap)
    m, sch, L = c.m, c.sch, c.L
    stages = [stage_cost(c, s, count, per) for s, count, per in c.plan]
    t_pipe = pipeline_seconds(c, stages)
    per = [_steady_seconds(c, st) for st in stages]
    crit = stages[max(range(len(stages)), key=per.__getitem__)]
    crit_s = max(per)
    tails, finish = [], []
    before = 0.0                                  # backward time of the stages before it
    for st in stages:
        tails.append(stage_tail(c, st, t_pipe - before, t_pipe))
        before += st.count * st.backward_seconds
        tl = tails[-1]
        finish.append(t_pipe + tl["dp"] + tl["embedding"] + tl["optimizer"] + tl["allgather"]
                      + tl["contention"])
    last = max(range(len(stages)), key=finish.__getitem__)
    step = finish[last]
    breakdown = composition_breakdown(c, crit, tails[last], t_pipe)
    out_stages = []
    worst = None
    for st, tail, fin in zip(stages, tails, finish):
        mem = stage_memory(c.tm, L=st.layers, pp=pp, s=st.stage, dp=dp, zero=zero, m=m,
                           schedule=schedule, sb=c.sb, bucket_bytes=bucket_bytes,
                           recompute=c.recompute, chunks=st.chunks, tied=cfg.tied)
        if worst is None or mem["total"] > worst["total"]:
            worst = {**mem, "stage": st.stage}
        out_stages.append({"stage": st.stage, "count": st.count, "layers": st.layers,
                           "params": st.params, "forward_seconds": st.forward_seconds,
                           "backward_seconds": st.backward_seconds, "tail": tail,
                           "finish_seconds": fin, "traffic": st.traffic, "memory": mem})
    traffic = {kind: max(st.traffic[kind] for st in stages) for kind in stages[0].traffic}
    flops = model_flops(cfg, c.B)
    n_dev = c.n_dev
    return {
        "composition": {"scheme": sch.name, "grid": sch.label, "t": sch.p, "q": sch.q,
                        "pc": sch.cols, "d": sch.d, "dp": dp, "pp": pp, "devices": n_dev, "microbatches": m,
                        "micro_batch": c.b, "global_batch": c.B, "zero": zero,
                        "schedule": schedule, "checkpoint": c.ck, "layers_per_stage": L,
                        "bucket_bytes": bucket_bytes, "state_bytes": c.sb.to_dict(),
                        "dtype": cfg.dtype, "zero3_prefetch": bool(zero3_prefetch),
                        "grad_overlap": c.grad_overlap, "p2p_overlap": c.p2p_overlap,
                        "optimizer": bool(optimizer), "chunks": c.chunks,
                        "stage_layers": [len(r) for r in stage_layers(
                            int(cfg.N), pp, c.stages, c.chunks)],
                        "recompute": c.recompute, "loss_scale": c.loss_scale,
                        **{k: v for k, v in cfg.techniques().items() if k != "recompute"}},
        "step_seconds": step,
        "pipeline_seconds": t_pipe,
        "critical_stage": crit.stage,
        "bubble_fraction": (t_pipe - m * crit_s) / t_pipe if t_pipe else 0.0,
        "bubble_over_ideal": (t_pipe - m * crit_s) / (m * crit_s) if crit_s else 0.0,
        "breakdown": breakdown,
        "memory": worst,
        "traffic": traffic,
        "stages": out_stages,
        "params_per_device": max(st.params for st in stages),
        "model_flops": flops,
        "flops_per_device": flops / (step * n_dev) if step > 0 else 0.0,
        "machine": machine.name,
    }


def predict_case(case: dict, machine: Machine, **kw) -> float | None:
    """Predicted seconds of one training step of a mesh case as the harness writes it
    (``MeshCase.to_dict()``: ``dp, pp, scheme, q, d, t`` (and ``pc``, the columns of a
    rectangular grid, where the case has it), ``zero, schedule, m,
    checkpoint, bucket_bytes, b`` (the global batch), ``s, h, heads, v, layers, ffn,
    dtype``, and where the case has them the techniques: ``chunks`` (or a schedule
    ``interleaved:V``), ``stages``, ``recompute``, ``attention``,
    ``sequence_parallel``, ``loss_scale``, ``grad_reduce`` and the block's ``mlp``,
    ``kv_heads``, ``tied``), or None when it cannot be priced (a missing key, a
    composition that cannot exist). The engine trains in its own dtype: plain model
    states for float64/float32 (``StateBytes.for_dtype(dtype, mixed=False)``), mixed
    precision for bfloat16/float16 (:meth:`StateBytes.for_training`); the Adam update is
    priced; ``kw`` goes to :func:`price_composition`."""
    try:
        dtype = str(case.get("dtype", "float64"))
        recompute = case.get("recompute") or (
            "full" if case.get("checkpoint", False) else "none")
        cfg = TransformerConfig(b=int(case["b"]), s=int(case["s"]), h=int(case["h"]),
                                n=int(case["heads"]), N=int(case["layers"]),
                                v=int(case.get("v", 0)), dtype=dtype,
                                recompute=str(recompute), ffn=case.get("ffn", 4),
                                attention=str(case.get("attention", "plain")),
                                sequence_parallel=bool(case.get("sequence_parallel", False)),
                                kv_heads=case.get("kv_heads"),
                                mlp=str(case.get("mlp", "gelu")),
                                tied=bool(case.get("tied", True)))
        name = str(case["scheme"])
        if name == "megatron":
            sch = Scheme.make(name, p=int(case["t"]))
        else:
            sch = Scheme.make(name, q=int(case["q"]), d=int(case.get("d", 1)),
                              pc=int(case.get("pc") or case["q"]))
        kind, chunks = parse_schedule(str(case.get("schedule", "1f1b")))
        chunks = int(case.get("chunks") or chunks)
        kw.setdefault("state_bytes", StateBytes.for_training(
            dtype, case.get("grad_reduce")) if dtype in MIXED_DTYPES
            else StateBytes.for_dtype(dtype, mixed=False))
        stages = case.get("stages")
        res = price_composition(cfg, sch, machine=machine, dp=int(case["dp"]),
                                pp=int(case["pp"]), microbatches=int(case.get("m", 1)),
                                global_batch=int(case["b"]), zero=int(case.get("zero", 0)),
                                schedule=kind, chunks=chunks,
                                stages=tuple(stages) if stages else None,
                                loss_scale=str(case.get("loss_scale") or "none"),
                                bucket_bytes=float(case.get("bucket_bytes", BUCKET_BYTES)),
                                **kw)
    except (KeyError, TypeError, ValueError):
        return None
    return res["step_seconds"]


def flatten_breakdown(breakdown: dict) -> dict:
    """``{"gemm", "memory_bound", "comm_tensor", "comm_dp", "comm_pp", "comm_zero",
    "comm_contention", "bubble", "optimizer"}`` from a :func:`price_composition`
    breakdown."""
    out = {k: v for k, v in breakdown.items() if k != "exposed_comm"}
    out.update({f"comm_{k}": v for k, v in breakdown["exposed_comm"].items()})
    return out


__all__ = ["Stage", "composition_breakdown", "flatten_breakdown", "pipeline_seconds",
           "predict_case", "price_composition", "stage_cost", "stage_tail"]
