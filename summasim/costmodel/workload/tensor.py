"""The tensor-parallel part of a composition: one micro-batch of one scheme's grid, its
memory (:class:`TensorMemory`) and its price per layer, embedding and head
(:class:`TensorPrice`), and the checks of a composition that cannot exist."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from ..machine import Machine
from .footprint import memory
from .traffic import MessageClass
from .layer import layer_ops, recompute_ops, scheme_cost
from ..compute.gemm import gemm_seconds
from ..compute.roofline import attention_kernels, kernels_seconds
from .predict import price_messages
from .pricer import make_pricer
from .scheme import Scheme, TransformerConfig, misfit
from .step import model_messages, model_ops, step_cost, step_work
from .pipeline import _check_int, check_interleaved
from ...spec import stage_layers

# -- checks ---------------------------------------------------------------------------------
def make_scheme(scheme, t: int | None = None, q: int | None = None, d: int = 1,
                pc: int | None = None) -> Scheme:
    """A :class:`~summasim.costmodel.workload.scheme.Scheme` from a name and its grid (``t``
    ranks for Megatron; ``q`` (and ``d``, and ``pc`` columns of a rectangular grid) for
    Optimus and SUMMA2.5-LM), or as given."""
    if isinstance(scheme, Scheme):
        return scheme
    if t is not None and q is None:
        return Scheme.make(scheme, p=t, d=d, pc=pc)
    return Scheme.make(scheme, p=t, q=q, d=d, pc=pc)


def check_composition(cfg: TransformerConfig, scheme: Scheme, dp: int, pp: int,
                      microbatches: int, global_batch: int, devices: int | None = None,
                      *, stages: tuple | None = None, chunks: int = 1) -> int:
    """The micro-batch size ``b = B / (dp m)`` of a composition that can exist, else a
    ``ValueError`` with the numbers: ``dp pp t != devices``; layers that
    :func:`summasim.spec.stage_layers` cannot split into ``pp`` stages of ``chunks``
    model chunks (``stages``: the layers of each); an interleaved schedule whose m is
    not a multiple of pp (:func:`~summasim.costmodel.workload.pipeline.check_interleaved`);
    B not divisible by ``dp m``; a micro-batch the tensor grid cannot split, or a model
    it cannot divide (:func:`schemes.misfit`, sequence parallelism's rule included)."""
    for name, val in (("dp", dp), ("pp", pp), ("microbatches", microbatches),
                      ("global_batch", global_batch)):
        _check_int(name, val)
    t = scheme.p
    if devices is not None and dp * pp * t != devices:
        raise ValueError(f"dp * pp * tensor = {dp} * {pp} * {t} = {dp * pp * t} is not the "
                         f"{devices} devices")
    if not isinstance(cfg.N, numbers.Integral):
        raise ValueError(f"layers N = {cfg.N} must be whole to split into pipeline stages")
    try:
        stage_layers(int(cfg.N), pp, stages, chunks)
    except ValueError as exc:
        raise ValueError(f"layers N = {cfg.N} do not split into pp = {pp} stages"
                         f"{f' of {chunks} chunks' if chunks > 1 else ''}: {exc}") from None
    check_interleaved(pp, microbatches, chunks)
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
    act_layer: float          # kept per layer per micro-batch (no recompute)
    act_ckpt: float           # kept per layer per micro-batch (full recompute)
    logits: float             # logits and their gradient, last stage, per micro-batch
    grad_bufs: float          # the two activation-gradient buffers
    workspace: float          # SUMMA workspaces
    act_sel: float = 0.0      # kept per layer per micro-batch (selective recompute)
    head: float = 0.0         # an untied LM head's shard (0: tied to wte)


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
    layer_sel: Part = Part()  # selective recompute of one layer: its attention core again
    layer_sel_bytes: float = 0.0


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
    kw = dict(itemsize=it, q=scheme.q, d=scheme.d, p=scheme.p, pc=scheme.pc)
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
    ``schemes.memory`` at N = 1, 2, under each recompute, the vocabulary doubled and
    the sequence doubled, differenced (it is linear in each); an untied head is what
    the embedding holds beyond the tied model's (its own blocks: ``[h/pr, V'/pc]`` on a
    ``pr x pc`` grid, where ``wte``'s are ``[V'/pr, h/pc]``)."""
    c1 = cfg.replace(b=b, N=1, recompute="none")
    it = cfg.itemsize
    m1 = memory(scheme, c1)
    m2 = memory(scheme, c1.replace(N=2))
    act_layer = m2.activations - m1.activations
    act_ckpt = (memory(scheme, c1.replace(N=2, recompute="full")).activations
                - memory(scheme, c1.replace(recompute="full")).activations)
    act_sel = (memory(scheme, c1.replace(N=2, recompute="selective")).activations
               - memory(scheme, c1.replace(recompute="selective")).activations)
    head = 0.0
    if cfg.v:
        grad_bufs = memory(scheme, c1.replace(v=0)).activations - act_layer
        logits = m1.activations - act_layer - grad_bufs
        tied = c1.replace(tied=True)
        wte = (memory(scheme, tied.replace(v=2 * cfg.v)).embedding
               - memory(scheme, tied).embedding) / it
        if not cfg.tied:                           # the head's own blocks, beyond wte's
            head = (m1.embedding - memory(scheme, tied).embedding) / it
        wpe = (memory(scheme, c1.replace(s=2 * cfg.s)).embedding - m1.embedding) / it
        lnf = m1.embedding / it - wte - wpe - head
    else:
        grad_bufs, logits, wte, wpe, lnf = m1.activations - act_layer, 0.0, 0.0, 0.0, 0.0
    return TensorMemory(m1.params / it, wte, wpe, lnf, act_layer, act_ckpt, logits, grad_bufs,
                        m1.workspace, act_sel, head)


def tensor_price(scheme: Scheme, cfg: TransformerConfig, b: int, machine: Machine, *,
                 ranks_per_node: int, cache: dict | None = None) -> TensorPrice:
    """The :class:`TensorPrice` of micro-batches of ``b`` sequences on ``scheme``.

    ``step_cost`` at N = 1 and N = 2 (the layer is their difference, the rest of
    N = 1 the embedding and the head, the embedding priced from its own collectives);
    the layer's forward share is ``scheme_cost``'s forward pass plus a third of its
    memory-bound work, the head's forward a third of the head.
    """
    c1 = cfg.replace(b=b, N=1, recompute="none")
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
                       max(0.0, ends_bytes - emb_bytes), o2 - o1, max(0.0, 2 * o1 - o2),
                       selective_part(scheme, c1, machine, slow))


def selective_part(scheme: Scheme, cfg: TransformerConfig, machine: Machine,
                   slow: float = 1.0) -> Part:
    """Seconds one layer's selective recompute adds to its backward (Korthikanti et al.
    2022, section 5): the attention core's forward again, its two GEMMs (``4 b s^2 h``
    flops over the ranks, :func:`~summasim.costmodel.workload.layer.recompute_ops`) and
    its softmax and dropout kernels (the roofline's on a GPU, else ``gamma_elementwise``
    per score); no communication. Nothing under blockwise attention, whose backward
    recomputes the scores anyway."""
    ops = recompute_ops(scheme, cfg.replace(recompute="selective"))
    if not ops:
        return Part()
    it = cfg.itemsize
    gemm = sum(gemm_seconds(machine, m_, k_, n_, cnt, cfg.dtype, it, batched=True)
               for _, m_, k_, n_, cnt in ops)
    if machine.device is not None:
        mem = kernels_seconds(attention_kernels(scheme, cfg)["forward"], machine.device,
                              cfg.dtype)
    else:
        scores = sum(cnt * m_ * n_ for _, m_, k_, n_, cnt in ops[:1])   # b n s^2 / p
        mem = machine.gamma_elementwise * scores
    return Part(0.0, gemm * slow, mem * slow)


# -- the composition ------------------------------------------------------------------------
