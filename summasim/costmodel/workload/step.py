"""A whole training step of one scheme: its ops (layers, embedding, head, loss, optimizer),
their messages and work, the step's time (:func:`step_cost`) and its breakdown into GEMM,
memory-bound kernels and exposed communication (:func:`step_breakdown`). Seconds, bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import traffic as _traffic
from ..compute.gemm import gemm_seconds as _gemm_seconds
from ..compute.roofline import kernels_seconds, model_kernels
from ..machine import Machine
from ..machine.topology import Placement
from .layer import (_ring_allreduce_messages, _split, layer_ops, product_work, recompute_ops,
                    summa_forms, summa_op, tp3d_linear_ops)
from .footprint import Memory, _layer_activations, memory
from .mesh import model_flops as _model_flops
from .predict import price_messages
from .pricer import Prediction, make_pricer
from .scheme import Scheme, TransformerConfig, grid_blocks, grid_vocab, runs, vocab_block

def model_ops(scheme: Scheme, cfg: TransformerConfig, *, row0: bool = True) -> dict[str, list]:
    """``{"forward": [...], "backward": [...]}`` ops of one training step of the whole
    language model (embedding, N layers, final LayerNorm, tied LM head, loss), every
    collective included, as :mod:`summasim.transformer.megatron`,
    :mod:`summasim.transformer.optimus` and the 3D layer (:func:`_tp3d_model_ops`) send
    them (no checkpointing).

    Megatron: the embedding all-reduce of ``b s h`` items, the layers, the LM head's
    local GEMM, 3 all-reduces of ``b s`` items in the loss (max, sum of exponentials,
    target logit); backward the LM head's input-gradient all-reduce of ``b s h``.
    Optimus / SUMMA2.5-LM on ``[pr, pc, d]`` (``q x q`` square), the vocabulary padded to
    ``V'``, a multiple of ``lcm(pr, pc)`` (:func:`~.scheme.grid_vocab`), ``h_0 = h/pc`` the
    hidden block of column 0 (its head groups' where pc does not divide the key/value
    heads: :func:`~.scheme.grid_blocks`): the embedding as pr broadcasts down the
    columns (pr ranks) of the ``wte[V'_l, H_j]`` blocks (``V'/pr h_0`` items each) and
    one of ``wpe[:s, H_j]`` (``s h_0``); the final LayerNorm's packed column broadcast
    (``2 h_0``) and 2 all-reduces along the row (pc
    ranks); the tied head ``abt(x, wte)`` (untied: ``ab(x, head.w)``); the loss's 3 row
    all-reduces of ``b s/(d pr)`` items and the column (and depth) all-reduce of one
    item. Backward: ``ab`` and ``atb`` of the tied head (untied: ``abt`` and ``atb``), the
    final LayerNorm's 2 row all-reduces, packed column reduce and (d > 1, ``row0``)
    depth ring, the layers, pr column reduces of the ``dwte`` blocks and their depth
    ring, and the ``dwpe`` column reduce and (``row0``) depth ring. ``row0=False``
    leaves out the depth rings only row 0 runs.
    """
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    M = b * s
    p, q, d = scheme.p, scheme.q, scheme.d
    layer = layer_ops(scheme, cfg, include_minor=True, checkpoint=False, row0=row0)
    fwd, bwd = [], []
    if scheme.name == "megatron":
        sp = cfg.sequence_parallel and p > 1
        if p > 1:
            # the vocabulary-parallel embedding's reduction; under sequence parallelism a
            # reduce-scatter onto the sequence shards (Korthikanti et al. 2022, 4.2.2)
            fwd.append(("coll", "reduce_scatter" if sp else "allreduce", "world", p,
                        M * h, 1))
        fwd += N * layer["forward"]
        if sp:                       # the head reads the whole sequence: all-gather it
            fwd.append(("coll", "allgather", "world", p, _split(M * h, p), 1))
        if v:                        # the padded vocabulary's block (megatron.vocab_block)
            vb = vocab_block(v, p)
            fwd.append(("gemm", M, h, vb, 1))
            bwd += [("gemm", M, vb, h, 1), ("gemm", vb, M, h, 1)]
        if p > 1:
            fwd.append(("coll", "allreduce", "world", p, M, 3))
            # the head's input gradient: all-reduced, or reduce-scattered (the conjugate
            # of the all-gather) under sequence parallelism
            bwd.append(("coll", "reduce_scatter" if sp else "allreduce", "world", p,
                        M * h, 1))
        bwd += N * layer["backward"]
        if sp:                       # the embedding's conjugate: all-gather its gradient
            bwd.append(("coll", "allgather", "world", p, _split(M * h, p), 1))
        return {"forward": fwd, "backward": bwd}
    if scheme.kind == "3d":
        return _tp3d_model_ops(cfg, q, layer)
    ab, abt, atb = summa_forms(scheme)
    pr, pc = q, scheme.cols          # a column has pr ranks, a row pc
    rows = _split(M, d * pr)
    if v:                            # the padded vocabulary (optimus.padded_vocab)
        v = grid_vocab(v, scheme)
    blk = grid_blocks(scheme, cfg)
    cut = dict(blk.cuts).get("h")    # h cut at the head groups where pc does not divide them
    if cut:                          # column 0's hidden block h_0, the widest
        wte, wpe, lnf = _split(v, pr) * blk.h, s * blk.h, 2 * blk.h
    else:
        wte, wpe, lnf = _split(v * h, pr * pc), _split(s * h, pc), _split(2 * h, pc)
    if pr > 1:
        if v:                        # wte[V'_l, H_j] down column j from row l, l < pr
            fwd.append(("coll", "bcast", "col", pr, wte, pr))
        fwd.append(("coll", "bcast", "col", pr, wpe, 1))
    fwd += N * layer["forward"]
    if pr > 1:
        fwd.append(("coll", "bcast", "col", pr, lnf, 1))
    if pc > 1:
        fwd.append(("coll", "allreduce", "row", pc, rows, 2))
    if v:                            # the head (none without a vocabulary)
        fwd.append(summa_op(abt if cfg.tied else ab, M, h, v, k=cut))
    if pc > 1:
        fwd.append(("coll", "allreduce", "row", pc, rows, 3))
    if pr > 1:
        fwd.append(("coll", "allreduce", "col", pr, 1, 1))
    if d > 1:
        fwd.append(("coll", "allreduce", "depth", d, 1, 1))
    if v:                            # tied: dx = ab(dl, wte), dwte += atb(dl, x); untied:
        bwd += ([summa_op(ab, M, v, h, n=cut), summa_op(atb, v, M, h, n=cut)] if cfg.tied
                else [summa_op(abt, M, v, h, n=cut),      # dx = abt(dl, w),
                      summa_op(atb, h, M, v, m=cut)])     # dw = atb(x, dl)
    if pc > 1:
        bwd.append(("coll", "allreduce", "row", pc, rows, 2))
    if pr > 1:
        bwd.append(("coll", "reduce", "col", pr, lnf, 1))
    if d > 1 and row0:
        bwd.append(("ring", "depth", d, lnf, 1))
    bwd += N * layer["backward"]
    if pr > 1:
        if v:
            bwd.append(("coll", "reduce", "col", pr, wte, pr))
        bwd.append(("coll", "reduce", "col", pr, wpe, 1))
    if d > 1:
        if v:
            bwd.append(("ring", "depth", d, wte, 1))
        if row0:
            bwd.append(("ring", "depth", d, wpe, 1))
    return {"forward": fwd, "backward": bwd}


def _tp3d_model_ops(cfg: TransformerConfig, q, layer: dict) -> dict[str, list]:
    """:func:`model_ops` of the 3D layer on the q x q x q cube (Bian et al. 2021), N = b s
    / q^2 rows per rank, ``vb = ceil(v/q)`` the vocabulary block.

    Forward: the embedding's all-gather of the ``wte`` piece ``[vb/q, h/q]`` over depth
    (``vb h/q^2`` items) and reduce-scatter of the looked-up ``[q N, h/q]`` over col
    (``N h``; ``wpe`` is replicated), the layers, the final LayerNorm's 2 row
    all-reduces of N, the LM head as an A -> B linear ``[h, q vb]``
    (:func:`~summasim.costmodel.workload.layer.tp3d_linear_ops`; tied or not, the same
    counts), the loss's 3 col all-reduces of N (max, sum of exponentials, target logit)
    and the loss sum's all-reduce of one item over row and over depth. Backward: the
    head's linear backward, the final LayerNorm's 2 row all-reduces and its ``2h/q``
    gradients all-reduced over col then depth, the layers, the embedding's all-gather of
    dx ``N h/q`` over col, reduce-scatter of ``dwte [vb, h/q]`` over depth and the
    ``dwpe [s, h/q]`` all-reduce over col then depth. Groups of one send nothing.
    """
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    rows = _split(b * s, q * q)
    vb = vocab_block(v, q) if v else 0
    head_f, head_b = tp3d_linear_ops(q, b * s, h, q * vb) if v else ([], [])
    lnf, wpe = _split(2 * h, q), _split(s * h, q)
    ranks = q > 1                                  # a group of one sends nothing
    fwd = []
    if v and ranks:
        fwd += [("coll", "allgather", "depth", q, _split(vb * h, q * q), 1),
                ("coll", "reduce_scatter", "col", q, rows * h, 1)]
    fwd += N * layer["forward"]
    if ranks:
        fwd.append(("coll", "allreduce", "row", q, rows, 2))
    fwd += head_f
    if v and ranks:
        fwd.append(("coll", "allreduce", "col", q, rows, 3))
    if ranks:
        fwd += [("coll", "allreduce", "row", q, 1, 1), ("coll", "allreduce", "depth", q, 1, 1)]
    bwd = list(head_b)
    if ranks:
        bwd += [("coll", "allreduce", "row", q, rows, 2),
                ("coll", "allreduce", "col", q, lnf, 1),
                ("coll", "allreduce", "depth", q, lnf, 1)]
    bwd += N * layer["backward"]
    if ranks:
        if v:
            bwd += [("coll", "allgather", "col", q, _split(rows * h, q), 1),
                    ("coll", "reduce_scatter", "depth", q, _split(vb * h, q), 1)]
        bwd += [("coll", "allreduce", "col", q, wpe, 1),
                ("coll", "allreduce", "depth", q, wpe, 1)]
    return {"forward": fwd, "backward": bwd}


@dataclass
class StepWork:
    """One rank's local work in a training step: GEMMs ``(m, k, n, count)``, bytes
    added by summasim's ring all-reduces, elementwise activation items, and
    ``layers`` (N + 1: the layers and the embedding/head, each with the machine's
    fixed ``layer_seconds`` of call overhead)."""

    gemms: list
    reduce_bytes: float
    elementwise_items: float
    layers: float


def elementwise_items(scheme: Scheme, cfg: TransformerConfig) -> float:
    """Activation items whose elementwise work (LayerNorm, GELU, softmax, residuals,
    embedding lookup, cross-entropy) one rank does in a training step: per layer the
    activation items of :func:`memory` (Megatron keeps the LayerNorms whole), plus the
    local logits ``b s v / p`` and the embedding output."""
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    p = scheme.p
    bsh = b * s * h
    # the work of plain attention (blockwise attention still computes its softmax)
    layer = _layer_activations(scheme, cfg if cfg.attention == "plain"
                               else cfg.replace(attention="plain"))
    emb = bsh if scheme.name == "megatron" and not cfg.sequence_parallel else bsh / p
    if scheme.kind in ("2d", "2.5d") and grid_blocks(scheme, cfg).cuts:
        emb = b * s / (scheme.d * scheme.q) * grid_blocks(scheme, cfg).h   # column 0's h_0
    logits = b * s * (vocab_block(v, p) if scheme.name == "megatron"
                      else grid_vocab(v, scheme) / p)
    return N * layer + logits + emb



def step_work(scheme: Scheme, cfg: TransformerConfig) -> StepWork:
    """:class:`StepWork` of one training step (forward + backward, no checkpointing) on
    the busiest rank (row 0) of ``scheme``."""
    ops = model_ops(scheme, cfg)
    gemms, red = [], 0.0
    it = cfg.itemsize
    busiest = runs(scheme, cfg)
    for op in filter(_nonempty, ops["forward"] + ops["backward"]):
        if op[0] == "gemm":
            gemms.append(tuple(op[1:5]))
        elif op[0] == "mm":
            work = product_work(scheme, op, it, busiest=busiest)[1]
            gemms += list(work.gemms)
            red += work.reduce_bytes
        elif op[0] == "ring" and op[2] > 1:
            _, grp, size, items, cnt = op
            red += cnt * (size - 1) / size * items * it
    return StepWork(gemms, red, elementwise_items(scheme, cfg), cfg.N + 1)


def _ops_messages(ops, scheme: Scheme, itemsize: int, busiest: bool = True) -> list:
    """:class:`~summasim.costmodel.workload.traffic.MessageClass` entries of a list of ops
    (``busiest``: as :func:`~.layer.product_work`)."""
    out = []
    for op in ops:
        if op[0] == "mm":
            out += product_work(scheme, op, itemsize, compute=False, busiest=busiest)[0]
        elif op[0] == "ring":
            _, grp, size, items, cnt = op
            out += _ring_allreduce_messages(items, size, grp, itemsize, cnt, False)
        elif op[0] == "coll" and op[3] > 1:
            _, cop, grp, size, items, cnt = op
            out.append(_traffic.MessageClass(cop, grp, size, items * itemsize, cnt))
    return out


def model_messages(scheme: Scheme, cfg: TransformerConfig, *, row0: bool = True) -> list:
    """The :class:`~summasim.costmodel.workload.traffic.MessageClass` entries of one training
    step on one rank (what its trace records; origin of the grid, or ``row0=False``)."""
    ops = model_ops(scheme, cfg, row0=row0)
    return _ops_messages(ops["forward"] + ops["backward"], scheme, cfg.itemsize,
                         runs(scheme, cfg))


def step_cost(scheme: Scheme, cfg: TransformerConfig, machine: Machine, *,
              reduce_impl: str | None = None, ranks_per_node: int | None = None,
              placement: Placement | None = None):
    """Predicted seconds of one training step of the whole model on ``machine``, as a
    :class:`~summasim.costmodel.workload.pricer.Prediction` whose ``breakdown`` holds
    ``gemm_seconds``, ``memory_bound_seconds``, ``comm_seconds`` and
    ``comm_exposed_seconds`` (they add up to ``seconds``).

    On a machine without a roofline ``device`` (this VM): forward + backward without
    checkpointing, :func:`model_messages` priced like a trace plus :func:`step_work`
    (GEMMs, the ring additions, and ``gamma_elementwise`` per elementwise item); the
    shared-core model applies when the node is oversubscribed. On a GPU machine
    (``device`` set, or library "nccl"): :func:`step_breakdown` (checkpointing as
    ``cfg.checkpoint`` says, roofline kernels, the optimizer, NCCL collectives on the
    topology under ``placement``)."""
    from .predict import predict_trace

    if machine.device is not None or machine.library == "nccl":
        sb = step_breakdown(scheme, cfg, machine, placement=placement, reduce_impl=reduce_impl)
        return Prediction(sb.seconds, sb.comm_seconds, sb.seconds - sb.comm_exposed_seconds,
                          dict(sb.by_op), {}, dict(sb.algorithms), {}, 1.0, "mpich",
                          machine.name, breakdown=sb.breakdown())
    work = step_work(scheme, cfg)
    pred = predict_trace(model_messages(scheme, cfg), machine, p=scheme.p, q=scheme.q,
                         d=scheme.d, pc=scheme.pc, gemms=work.gemms,
                         reduce_bytes=work.reduce_bytes,
                         elementwise_items=work.elementwise_items, layers=work.layers,
                         dtype=cfg.dtype,
                         reduce_impl=reduce_impl, ranks_per_node=ranks_per_node)
    gemm = sum(c * machine.gemm_time(a, b_, k, cfg.dtype) for a, b_, k, c in work.gemms)
    other = (machine.gamma_reduce * work.reduce_bytes
             + machine.gamma_elementwise * work.elementwise_items
             + machine.layer_seconds * work.layers)
    scale = pred.compute_seconds / (gemm + other) if gemm + other > 0 else 0.0
    floor = {k: v for k, v in pred.breakdown.items() if k.startswith("memory_floor")}
    pred.breakdown = {"gemm_seconds": gemm * scale, "memory_bound_seconds": other * scale,
                      "optimizer_seconds": 0.0, "comm_seconds": pred.comm_seconds,
                      "comm_exposed_seconds": pred.seconds - pred.compute_seconds, **floor}
    return pred


# -- a whole training step on a GPU cluster --------------------------------------------------
@dataclass
class StepBreakdown:
    """One training step on one rank (the busiest: grid row 0), split up.

    Times in seconds: ``gemm_seconds`` (local GEMMs, tensor cores for 16-bit
    dtypes), ``memory_bound_seconds`` (every non-GEMM kernel: LayerNorm, softmax,
    GELU, dropout, bias and residual adds, embedding, loss, local reductions, and
    the optimizer, which is also ``optimizer_seconds``), ``comm_seconds`` (every
    collective) and ``comm_exposed_seconds`` (the part not hidden under compute:
    all of it here, the schemes' collectives block the compute that needs their
    result). ``seconds`` = GEMM + memory-bound + exposed communication.
    ``launch_seconds`` is the kernel-launch share of GEMM and memory-bound time.
    ``model_flops`` is the model's useful work of a step without recomputation
    (``mesh.model_flops``: 3 x its forward GEMM flops, whatever the grid's padding or
    uneven blocks); ``tflops_per_device`` = model_flops / (p seconds).
    """

    scheme: Scheme
    config: TransformerConfig
    machine: str
    placement: str
    seconds: float
    gemm_seconds: float
    memory_bound_seconds: float
    optimizer_seconds: float
    comm_seconds: float
    comm_exposed_seconds: float
    launch_seconds: float
    kernels: int
    by_op: dict
    algorithms: dict
    memory: Memory
    model_flops: float

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / (self.scheme.p * self.seconds) / 1e12 if self.seconds else 0.0

    def breakdown(self) -> dict:
        """The four parts (what :func:`step_cost` puts in ``Prediction.breakdown``)."""
        return {"gemm_seconds": self.gemm_seconds,
                "memory_bound_seconds": self.memory_bound_seconds,
                "optimizer_seconds": self.optimizer_seconds,
                "comm_seconds": self.comm_seconds,
                "comm_exposed_seconds": self.comm_exposed_seconds,
                "launch_seconds": self.launch_seconds}

    def to_dict(self) -> dict:
        key = lambda k: f"{k[0]}/{k[1]}" if isinstance(k, tuple) else str(k)  # noqa: E731
        sch = self.scheme
        return {"scheme": sch.name, "grid": sch.label, "p": sch.p, "q": sch.q,
                "pc": sch.cols, "d": sch.d,
                "machine": self.machine, "placement": self.placement,
                "config": dict(self.config.__dict__), "seconds": self.seconds,
                **self.breakdown(), "kernels": self.kernels,
                "model_flops": self.model_flops, "tflops_per_device": self.tflops_per_device,
                "by_op": {key(k): v for k, v in self.by_op.items()},
                "algorithms": {key(k): list(v) for k, v in self.algorithms.items()},
                "memory": self.memory.to_dict()}


def _nonempty(op) -> bool:
    """False for a GEMM or product with a zero dimension (no vocabulary: no head)."""
    if op[0] == "gemm":
        return all(x != 0 for x in op[1:4])
    if op[0] == "mm":
        return all(x != 0 for x in op[2:5])
    return True


def step_ops(scheme: Scheme, cfg: TransformerConfig) -> dict[str, list]:
    """:func:`model_ops` of one training step with ``cfg.recompute`` honoured (the
    backward pass first re-runs :func:`~summasim.costmodel.workload.layer.recompute_ops`
    of every layer: its whole forward, collectives included, or its attention core)
    and no head when ``cfg.v == 0``."""
    ops = model_ops(scheme, cfg)
    fwd = [op for op in ops["forward"] if _nonempty(op)]
    bwd = [op for op in ops["backward"] if _nonempty(op)]
    again = recompute_ops(scheme, cfg)
    if again:
        bwd = cfg.N * again + bwd
    return {"forward": fwd, "backward": bwd}


def step_breakdown(scheme: Scheme, cfg: TransformerConfig, machine: Machine, *,
                   placement: Placement | None = None, mode: str = "mpich",
                   reduce_impl: str | None = None,
                   algorithms: Mapping[str, str] | None = None) -> StepBreakdown:
    """Price one training step of ``scheme`` on ``cfg`` (see :class:`StepBreakdown`).

    Parameters
    ----------
    scheme : Scheme
    cfg : TransformerConfig
        ``cfg.checkpoint`` adds the recomputed forward (GEMMs, kernels, collectives).
    machine : Machine
        NCCL machines price collectives on their topology; machines with a
        ``device`` price GEMMs and kernels with the roofline (others: ``gamma``
        tables and ``gamma_elementwise``, no optimizer).
    placement : Placement, optional
        Ranks on nodes (default row-major).
    mode, reduce_impl, algorithms
        As in :func:`scheme_cost` (NCCL: ``algorithms={"allreduce": "ring/Simple"}``
        forces an algorithm and protocol).

    Returns
    -------
    StepBreakdown
    """
    placement = placement or Placement()
    it = cfg.itemsize
    ops = step_ops(scheme, cfg)
    pricer = make_pricer(machine, mode=mode, algorithms=algorithms, itemsize=it, q=scheme.q,
                         d=scheme.d, p=scheme.p, reduce_impl=reduce_impl, placement=placement,
                         pc=scheme.pc)
    dev = machine.device
    busiest = runs(scheme, cfg)
    gemm = red_bytes = 0.0
    launches = 0
    for key in ("forward", "backward"):
        for op in ops[key]:
            if op[0] == "gemm":
                _, m_, k_, n_, cnt = op
                gemm += _gemm_seconds(machine, m_, k_, n_, cnt, cfg.dtype, it, batched=True)
                launches += 1
            elif op[0] == "mm":
                work = product_work(scheme, op, it, busiest=busiest)[1]
                for a, b_, c, cnt in work.gemms:
                    gemm += _gemm_seconds(machine, a, b_, c, cnt, cfg.dtype, it)
                    launches += cnt
                red_bytes += work.reduce_bytes
            elif op[0] == "ring" and op[2] > 1:
                _, grp, size, items, cnt = op
                red_bytes += cnt * (size - 1) / size * items * it
    msgs = _ops_messages(ops["forward"] + ops["backward"], scheme, it, busiest)
    comm, by_op, algs = price_messages(msgs, machine, pricer=pricer)
    mem = memory(scheme, cfg)
    if dev is not None:
        local_params = (mem.params + mem.embedding) / it
        tensors = 12 * cfg.N + (4 if cfg.v else 2)
        kern = model_kernels(scheme, cfg, local_params, tensors)
        elementwise = kernels_seconds(kern["forward"] + kern["backward"], dev, cfg.dtype)
        # local additions (a += b: 3 bytes moved per operand byte), one kernel per op
        elementwise += 3.0 * red_bytes / dev.memory_bandwidth
        optimizer = kernels_seconds(kern["optimizer"], dev, cfg.dtype)
        n_kern = len(kern["forward"]) + len(kern["backward"]) + len(kern["optimizer"])
        launch = (n_kern + launches) * dev.launch_seconds
    else:
        work = step_work(scheme, cfg)
        elementwise = (machine.gamma_reduce * red_bytes
                       + machine.gamma_elementwise * work.elementwise_items
                       + machine.layer_seconds * work.layers)
        optimizer = launch = 0.0
        n_kern = 0
    slow = machine.slowdown(machine.ranks_per_node(scheme.p))
    comm_slow = slow if machine.shared_comm else 1.0
    gemm, elementwise, optimizer, launch = (x * slow for x in (gemm, elementwise, optimizer,
                                                                launch))
    comm *= comm_slow
    mem_bound = elementwise + optimizer
    total = gemm + mem_bound + comm
    # useful model flops: forward + backward (2 x forward) without recomputation, of the
    # model itself (not the busiest rank's padded blocks times p): the composition's own
    model_flops = _model_flops(cfg, cfg.b)
    return StepBreakdown(scheme, cfg, machine.name, placement.describe(), total, gemm,
                         mem_bound, optimizer, comm, comm, launch, n_kern + launches,
                         {k: v * comm_slow for k, v in by_op.items()}, algs, mem, model_flops)
