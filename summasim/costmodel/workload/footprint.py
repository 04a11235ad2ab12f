"""Memory per rank of a scheme's training step (bytes), and the largest batch that fits.

Parameters, gradients and optimizer states of the rank's shards, the activations a
layer keeps for its backward (all layers'; under full recompute each layer's input and
one layer being recomputed; under selective recompute each layer's without its
attention core, Korthikanti et al. 2022, Table 2), the workspace of the largest
collective and the embedding and head (an untied head's ``[h, v]`` too); see
:mod:`~summasim.costmodel.workload.layer` for the notation and
:func:`_layer_activations` for sequence parallelism, blockwise attention, SwiGLU and
grouped-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scheme import (Scheme, TransformerConfig, _split, _whole, grid_block, grid_blocks,
                     grid_vocab, megatron_shares, vocab_block)


@dataclass
class Memory:
    """Bytes per rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    embedding: float

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.workspace
                + self.embedding)

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "embedding": self.embedding, "total": self.total}


# -- memory ---------------------------------------------------------------------------------
def training_grad_bytes(cfg: TransformerConfig) -> int:
    """Bytes per gradient in a training step of ``cfg`` (``grad_bytes`` of :func:`memory`):
    a float32 buffer under mixed precision, as ``predict`` and ``plan`` count the states
    (:meth:`~summasim.costmodel.workload.zero.StateBytes.for_training`)."""
    from .zero import StateBytes

    return StateBytes.for_training(cfg.dtype).grad


def memory(scheme: Scheme, cfg: TransformerConfig, grad_bytes: int | None = None) -> Memory:
    """Peak bytes per rank of ``scheme`` on ``cfg`` (see the module docstring); the
    gradients take ``grad_bytes`` per parameter (default the dtype's itemsize; a
    mixed-precision step that accumulates them in float32 holds 4:
    :meth:`~summasim.costmodel.workload.zero.StateBytes.for_training`)."""
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    f = cfg.ffn_width                                  # MLP width f h
    r, k = cfg.qkv_mult, cfg.mlp_matrices              # QKV r h wide (3 without GQA); MLP k
    it = cfg.itemsize
    p, q = scheme.p, scheme.q
    bsh = b * s * h
    weights = (1 + r) * h * h + k * h * f              # QKV r h^2, proj h^2, MLP k f h^2
    layer_act = _layer_activations(scheme, cfg)
    head = 0.0 if cfg.tied else v * h                  # an untied LM head [h, v]
    if scheme.name == "megatron":
        # QKV and the column-parallel MLP biases (r h + (k-1) f h) split over p, the
        # busiest rank's share where p divides neither the heads nor the MLP width
        # (scheme.megatron_shares); LayerNorms and 2 row-parallel biases (6h) whole
        sh, sf = megatron_shares(cfg, p)
        layer_params = ((1 + r) * h * h + r * h) * sh + (k * h * f + (k - 1) * f) * sf + 6 * h
        vb = float(vocab_block(v, p))                  # the padded vocabulary's block
        emb = vb * h + s * h + 2 * h
        if head:
            emb += vb * h                              # vocabulary-parallel, like wte
        # the two activation-gradient buffers of the layer input: [s/p, b, h] under SP
        grad_bufs = 2 * bsh / p if cfg.sequence_parallel else 2 * bsh
        work = 0.0
    elif scheme.kind == "3d":
        # weights over all p ranks ([in/q^2, out/q] each); the vectors replicated, each
        # rank holding its h/q (A layout) or W/q, F/q (B layout) slice of every one
        layer_params = weights / p + ((6 + r) * h + (k - 1) * f) / q
        # wte [vb/q, h/q] (vocabulary block i, its depth piece; an untied head the same),
        # wpe [s, h/q] and lnf g, b replicated
        vb = float(vocab_block(v, q))
        emb = vb * h / (q * q) + s * h / q + 2 * h / q
        if head:
            emb += vb * h / (q * q)                    # split like wte
        blk = grid_blocks(scheme, cfg)
        if blk.cuts or blk.ffn != f / q:
            # q cuts the heads or the MLP width unevenly: rank (0, 0, 0) holds block 0 of
            # each (grid_blocks: ceil(kv/q) head groups, ceil(F/q) columns) and the
            # largest depth piece, ceil(in_0/q) rows, of each weight
            wid = {"h": blk.h, "W": blk.qkv, "F": blk.ffn}
            lins = [("h", "W"), ("h", "h"), ("h", "F"), ("F", "h")] + [("h", "F")] * (k - 2)
            layer_params = (sum(-(-wid[a] // q) * wid[b] for a, b in lins)
                            + 6 * blk.h + blk.qkv + (k - 1) * blk.ffn)
            emb = -(-vb // q) * blk.h + s * blk.h + 2 * blk.h
            if head:
                emb += -(-blk.h // q) * vb             # head.w: rows h_0 by depth, block 0
        grad_bufs = 2 * bsh / p
        work = _tp3d_workspace(cfg, q)
    else:
        # rank (0, 0, 0) of [pr, pc, d], the busiest (grid_blocks): weights W[In_0, Out_0],
        # replicated over depth; on row 0 its column block of the vectors (LayerNorms 4h;
        # biases: QKV r h, proj h, MLP (k-1) f h, fc2 h) and of wpe [s, h_0] and lnf g, b
        pr, pc = q, scheme.cols
        blk = grid_blocks(scheme, cfg)
        layer_params = _grid_weights(cfg, blk, pr, pc) + _vector_block(scheme, cfg)
        # wte [V'/pr, h_0] blocks (the vocabulary padded to V', a multiple of lcm(pr, pc))
        vr = grid_vocab(v, scheme) / pr
        emb = vr * blk.h + s * blk.h + 2 * blk.h
        if head:                                       # head.w [h, V'] blocked like a weight
            emb += blk.h_rows * (grid_vocab(v, scheme) / pc)
        grad_bufs = 2 * b * s / (scheme.d * pr) * blk.h
        work = _grid_workspace(cfg, blk, pr, pc, scheme.d) if pr * pc > 1 else 0.0
    if cfg.recompute == "full":
        acts = N * bsh / p + layer_act
    elif cfg.recompute == "selective":
        # every layer without its attention core (Korthikanti et al. 2022, eq. 2), and
        # the one core recomputed while its layer's backward runs
        core = _layer_activations(scheme, cfg, core=False)
        acts = N * core + (layer_act - core)
    else:
        acts = N * layer_act
    if v:
        acts += 2 * b * s * (vocab_block(v, p) if scheme.name == "megatron"
                             else vocab_block(v, q) * q / p if scheme.kind == "3d"
                             else grid_vocab(v, scheme) / p)
    else:
        emb = 0.0
    params = (N * layer_params) * it
    emb_b = emb * it
    model = params + emb_b
    optimizer = cfg.optimizer_states * model
    if it < 4:
        # mixed precision: float32 optimizer states and a float32 master copy of the
        # weights (Megatron-LM, ZeRO section 3.1: 2 + 2 + 12 bytes per parameter)
        optimizer = (cfg.optimizer_states * 4 + 4) * model / it
    extra = _layer_extra_bytes(scheme, cfg)
    held = {"none": N, "selective": N, "full": 1}[cfg.recompute]
    masks = held * extra["kept"] + (N if cfg.recompute == "none" else 1) * extra["core"]
    grads = model if grad_bytes is None else model / it * grad_bytes
    return Memory(params=params, grads=grads, optimizer=optimizer,
                  activations=(acts + grad_bufs) * it + masks, workspace=work * it,
                  embedding=emb_b)


def _vector_block(scheme: Scheme, cfg: TransformerConfig):
    """Items of one layer's row-0 vectors on column 0 of an Optimus / SUMMA2.5-LM grid, the
    busiest (:func:`~.scheme.grid_blocks`): column block 0 of each, the LayerNorms' and
    the projection's and fc2's biases ``6 h_0``, the QKV bias ``W_0`` and the MLP's
    column biases ``(k-1) F_0`` (``F_0 = ceil(f h/pc)``); ``_layer_vectors / pc`` where
    pc divides them all."""
    blk = grid_blocks(scheme, cfg)
    f = _whole(cfg.ffn * cfg.h)
    if blk.ffn == f / scheme.cols and not blk.cuts:
        return _split(_layer_vectors(cfg), scheme.cols)
    return 6 * blk.h + blk.qkv + (cfg.mlp_matrices - 1) * blk.ffn


def _layer_vectors(cfg: TransformerConfig):
    """Items of one layer's vectors: two LayerNorms (4h), the QKV bias (r h), the
    projection's and fc2's biases (2h) and the MLP's column biases ((k-1) f h):
    ``(6 + r) h + (k-1) f h``, GPT-2's ``9h + f h``."""
    return (6 + cfg.qkv_mult) * cfg.h + (cfg.mlp_matrices - 1) * _whole(cfg.ffn * cfg.h)


def _grid_weights(cfg: TransformerConfig, blk, pr, pc) -> float:
    """Items of one layer's weight blocks on rank (0, 0) of an Optimus / SUMMA2.5-LM
    ``pr x pc`` layer (``blk``: :func:`~.scheme.grid_blocks`): ``W[In_0, Out_0]`` of QKV
    ``[h, r h]``, the projection ``[h, h]``, the MLP's ``[h, f h]`` (k-1 of them) and
    ``[f h, h]``, rows over pr and the MLP width over pc by the balanced partition (the
    first blocks, the largest), h and the QKV width over pc at the head groups:
    ``((1 + r) h^2 + k h f h) / (pr pc)`` where they divide."""
    h, f, r, k = cfg.h, cfg.ffn_width, cfg.qkv_mult, cfg.mlp_matrices
    if (blk.h_rows, blk.ffn_rows, blk.ffn) == (h / pr, f / pr, f / pc) and not blk.cuts:
        return ((1 + r) * h * h + k * h * f) / (pr * pc)
    return (blk.h_rows * (blk.qkv + blk.h) + (k - 1) * blk.h_rows * blk.ffn
            + blk.ffn_rows * blk.h)


def _grid_workspace(cfg: TransformerConfig, blk, pr, pc, d) -> float:
    """Items of the SUMMA workspaces on rank (0, 0) of ``[pr, pc, d]``: double-buffered
    broadcast blocks (activation ``[b s/(d pr), w_0]``, weight ``[h_0, w_0]``) and the
    partial sums of the widest linear, w = max(r h, fc1 width), its column 0 block (the
    QKV's at the head groups, the MLP's by the balanced partition; GPT-2 on a grid that
    divides it: ``(16 b s h + 8 h^2)/p``)."""
    h = cfg.h
    wide = max(cfg.qkv_mult * h, cfg.fc1_width)      # the widest linear: QKV or the MLP
    w_c = max(blk.qkv, grid_block(cfg.fc1_width, pc))
    if (w_c, blk.h_rows) == (wide / pc, h / pr) and not blk.cuts:
        w_blk, act_blk = h * wide / (pr * pc), cfg.b * cfg.s * wide / (d * pr * pc)
    else:
        w_blk, act_blk = blk.h_rows * w_c, cfg.b * cfg.s / (d * pr) * w_c
    return 2 * (act_blk + w_blk) + 2 * act_blk


def _tp3d_workspace(cfg: TransformerConfig, q) -> float:
    """Items of the 3D layer's workspace: for its widest linear ``[in, out]`` the gathered
    input ``[b s/q, in/q]``, the gathered weight ``[in/q, out/q]`` and the partial output
    ``[b s/q, out/q]``: ``(b s (in + out) + in out) / q^2`` (none at q = 1)."""
    if q == 1:
        return 0.0
    bs, h, f = cfg.b * cfg.s, cfg.h, cfg.ffn_width
    return max(bs * (i + o) + i * o for i, o in ((h, cfg.qkv_width), (h, f))) / (q * q)


def _layer_extra_bytes(scheme: Scheme, cfg: TransformerConfig) -> dict:
    """Bytes one layer keeps beyond its activation items: ``kept`` outside the attention
    core, ``core`` inside it (what selective recompute drops).

    Dropout (``cfg.dropout > 0``): one byte per element of the two hidden dropout masks
    (``b s h`` each, on every Megatron rank, ``b s h / p`` under sequence parallelism or
    on a 2D/2.5D block), and for the attention probabilities a mask byte and the dropped
    probabilities in the activation dtype, ``b n s^2 / p (1 + it)``: Korthikanti et al.
    2022, section 4.1, whose ``5 a s^2 b`` is the softmax output (2), the mask (1) and
    the dropout output (2). With dropout 0 (summasim's model) these terms are dropped.
    Blockwise attention keeps none of the attention terms (it regenerates the mask from
    the random generator's state, Dao et al. 2022, section 3.1) and holds the float32
    log-sum-exp of each query row, ``4 b n s / p`` bytes, for its backward. Optimus and
    SUMMA2.5-LM with key/value heads pc does not divide: column 0's head groups
    (:func:`~.scheme.grid_blocks`).
    """
    b, s, h, p = cfg.b, cfg.s, cfg.h, scheme.p
    hid = b * s * h if scheme.name == "megatron" and not cfg.sequence_parallel \
        else b * s * h / p
    scores, lse = cfg.b * cfg.n * s * s / p, 4 * b * cfg.n * s / p
    if scheme.kind in ("2d", "2.5d"):
        blk = grid_blocks(scheme, cfg)
        if blk.cuts:                         # column 0's head groups, the widest
            seqs = b / (scheme.d * scheme.q)
            hid, pairs = seqs * s * blk.h, seqs * blk.heads
            scores, lse = pairs * s * s, 4 * pairs * s
    kept = core = 0.0
    if cfg.dropout > 0:
        kept += 2 * hid
        if cfg.attention == "plain":
            core += scores * (1 + cfg.itemsize)
    if cfg.attention == "flash":
        kept += lse
    return {"kept": kept, "core": core}


def batch_step(scheme: Scheme) -> int:
    """The batch must be a multiple of this (pr, the rows, for Optimus, d pr for
    SUMMA2.5, q^2 for the 3D cube, whose d is q)."""
    return 1 if scheme.name == "megatron" else scheme.q * scheme.d


def largest_batch(scheme: Scheme, cfg: TransformerConfig, budget_bytes: float,
                  b_max: int = 1 << 40, grad_bytes: int | None = None) -> int:
    """Largest batch b (a multiple of :func:`batch_step`) whose memory per rank fits
    ``budget_bytes``; 0 when even the smallest does not fit. Memory grows with b,
    so this is an exponential then binary search."""
    if budget_bytes <= 0:
        return 0
    step = batch_step(scheme)

    def fits(mult):
        return memory(scheme, cfg.replace(b=mult * step), grad_bytes).total <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= b_max and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, b_max // step + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


def _layer_activations(scheme: Scheme, cfg: TransformerConfig, core: bool = True) -> float:
    """Items one rank keeps for the backward of one layer (Korthikanti et al. 2022,
    section 4.1, in summasim's accounting): ``(5 + r) b s h + k b s f h + b n s^2``
    split over p, plus the LayerNorm statistics ``4 b s`` over d q, where the QKV output
    is ``r b s h`` (r = 3, or ``1 + 2 k_v / n`` under grouped-query attention) and the
    MLP keeps k of its ``[b s, f h]`` tensors (GELU 2: fc1 and GELU outputs; SwiGLU 3:
    the gate and up outputs and their product, the down projection's input). Megatron
    keeps the LayerNorm inputs and outputs (4 b s h) and statistics whole, or split
    over p under sequence parallelism (their Table 2: ``34/t`` in place of ``10 +
    24/t``). ``core=False`` leaves out the attention core's ``b n s^2`` probabilities
    (selective recompute, their eq. 2); blockwise attention never holds them. Optimus
    and SUMMA2.5-LM on ``[pr, pc, d]`` keep ``[b s/(d pr), width/pc]`` blocks: split over
    p, statistics over d pr, and where pc does not divide the key/value heads or the MLP
    width the busiest rank's, column 0's widths (:func:`~.scheme.grid_blocks`: its head
    groups' hidden and QKV widths and probabilities, ``ceil(F/pc)`` MLP columns). The
    3D cube keeps the same
    blocks ``[b s/q^2, width/q]``: split over p, statistics over q^2 = d q."""
    b, s, h, n = cfg.b, cfg.s, cfg.h, cfg.n
    p, q, d = scheme.p, scheme.q, scheme.d
    r, k = cfg.qkv_mult, cfg.mlp_matrices
    bsh = b * s * h
    scores = b * n * s * s if core and cfg.attention == "plain" else 0.0
    bsf = b * s * cfg.ffn_width                  # fc1 output, and GELU output
    if scheme.name == "megatron":
        # whole: LN1 in/out, LN2 in/out; split: QKV r, attention out 1, MLP k f h (the
        # busiest rank's heads and columns: scheme.megatron_shares)
        whole = 4 * bsh + 4 * b * s
        sh, sf = megatron_shares(cfg, p)
        split = ((1 + r) * bsh + scores) * sh + k * bsf * sf
        return (whole / p if cfg.sequence_parallel else whole) + split
    # LN1 in/out 2, QKV r, attention out 1, residual 1, LN2 out 1, MLP k f h; on the 2D
    # and 2.5D grids [b s/(d pr), width_0] blocks, width_0 column 0's (grid_blocks: its
    # head groups' h_0 and W_0, the MLP's ceil(F/pc)), the cube's [b s/q^2, width/q]
    if scheme.kind != "3d":
        blk = grid_blocks(scheme, cfg)
        if blk.cuts or blk.ffn != cfg.ffn_width / scheme.cols:
            rows = b * s / (d * q)
            pairs = b / (d * q) * blk.heads * s * s if scores else 0.0
            return rows * (5 * blk.h + blk.qkv + k * blk.ffn) + pairs + 4 * rows
    return ((5 + r) * bsh + k * bsf + scores) / p + 4 * b * s / (d * q)
