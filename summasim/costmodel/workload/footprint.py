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

from .scheme import Scheme, TransformerConfig, megatron_shares, vocab_block


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
def memory(scheme: Scheme, cfg: TransformerConfig) -> Memory:
    """Peak bytes per rank of ``scheme`` on ``cfg`` (see the module docstring)."""
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
        grad_bufs = 2 * bsh / p
        work = _tp3d_workspace(cfg, q)
    else:
        # LayerNorms 4h; biases: QKV r h, proj h, MLP (k-1) f h, fc2 h
        vectors = (6 + r) * h + (k - 1) * f
        layer_params = (weights / p + vectors / q if scheme.name == "optimus"
                        else weights / (q * q) + vectors / q)
        # wte in q x q blocks (replicated over depth, the vocabulary padded to q
        # blocks); wpe [s, h/q] and lnf g, b on row 0
        vb = float(vocab_block(v, q))
        emb = vb * h / q + s * h / q + 2 * h / q
        if head:
            emb += vb * h / q                          # blocked like wte
        grad_bufs = 2 * bsh / p
        wide = max(r * h, cfg.fc1_width)               # the widest linear: QKV or the MLP
        w_blk = h * wide / (q * q)
        act_blk = b * s * wide / p
        work = 2 * (act_blk + w_blk) + 2 * act_blk if q > 1 else 0.0
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
                             else vocab_block(v, q) * q / p)
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
    return Memory(params=params, grads=model, optimizer=optimizer,
                  activations=(acts + grad_bufs) * it + masks, workspace=work * it,
                  embedding=emb_b)


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
    log-sum-exp of each query row, ``4 b n s / p`` bytes, for its backward.
    """
    b, s, h, p = cfg.b, cfg.s, cfg.h, scheme.p
    kept = core = 0.0
    if cfg.dropout > 0:
        hid = b * s * h if scheme.name == "megatron" and not cfg.sequence_parallel \
            else b * s * h / p
        kept += 2 * hid
        if cfg.attention == "plain":
            core += cfg.b * cfg.n * s * s / p * (1 + cfg.itemsize)
    if cfg.attention == "flash":
        kept += 4 * b * cfg.n * s / p
    return {"kept": kept, "core": core}


def batch_step(scheme: Scheme) -> int:
    """The batch must be a multiple of this (q for Optimus, d q for SUMMA2.5, q^2 for
    the 3D cube, whose d is q)."""
    return 1 if scheme.name == "megatron" else scheme.q * scheme.d


def largest_batch(scheme: Scheme, cfg: TransformerConfig, budget_bytes: float,
                  b_max: int = 1 << 40) -> int:
    """Largest batch b (a multiple of :func:`batch_step`) whose memory per rank fits
    ``budget_bytes``; 0 when even the smallest does not fit. Memory grows with b,
    so this is an exponential then binary search."""
    if budget_bytes <= 0:
        return 0
    step = batch_step(scheme)

    def fits(mult):
        return memory(scheme, cfg.replace(b=mult * step)).total <= budget_bytes

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
    (selective recompute, their eq. 2); blockwise attention never holds them. The 3D
    cube keeps the same blocks ``[b s/q^2, width/q]``: split over p, statistics over
    q^2 = d q."""
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
    # LN1 in/out 2, QKV r, attention out 1, residual 1, LN2 out 1, MLP k f h
    return ((5 + r) * bsh + k * bsf + scores) / p + 4 * b * s / (d * q)
