"""Memory per rank of a scheme's training step (bytes), and the largest batch that fits.

Parameters, gradients and optimizer states of the rank's shards, the activations a
layer keeps for its backward (all layers', or one layer's input under checkpointing),
the workspace of the largest collective and the embedding and head; see
:mod:`~summasim.costmodel.workload.layer` for the notation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scheme import Scheme, TransformerConfig


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
    it = cfg.itemsize
    p, q = scheme.p, scheme.q
    bsh = b * s * h
    weights = 4 * h * h + 2 * h * f                    # QKV 3h^2, proj h^2, fc1 and fc2 h f h
    layer_act = _layer_activations(scheme, cfg)
    if scheme.name == "megatron":
        # QKV and fc1 biases (3h + f h) split over p; LayerNorms and 2 biases (6h) whole
        layer_params = weights / p + (3 * h + f) / p + 6 * h
        emb = v * h / p + s * h + 2 * h
        grad_bufs = 2 * bsh
        work = 0.0
    else:
        vectors = 9 * h + f                            # LayerNorms 4h, biases 3h + h + f h + h
        layer_params = (weights / p + vectors / q if scheme.name == "optimus"
                        else weights / (q * q) + vectors / q)
        # wte in q x q blocks (replicated over depth); wpe [s, h/q] and lnf g, b on row 0
        emb = v * h / (q * q) + s * h / q + 2 * h / q
        grad_bufs = 2 * bsh / p
        wide = max(3 * h, f)                           # the widest linear: QKV or the MLP
        w_blk = h * wide / (q * q)
        act_blk = b * s * wide / p
        work = 2 * (act_blk + w_blk) + 2 * act_blk if q > 1 else 0.0
    if cfg.checkpoint:
        acts = N * bsh / p + layer_act
    else:
        acts = N * layer_act
    if v:
        acts += 2 * b * s * v / p
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
    masks = 0.0
    if cfg.dropout > 0:
        # one byte per element of the attention-probability and two hidden dropout masks
        hid = bsh if scheme.name == "megatron" else bsh / p
        per_layer = cfg.b * cfg.n * s * s / p + 2 * hid
        masks = per_layer * (1 if cfg.checkpoint else N)
    return Memory(params=params, grads=model, optimizer=optimizer,
                  activations=(acts + grad_bufs) * it + masks, workspace=work * it,
                  embedding=emb_b)


def batch_step(scheme: Scheme) -> int:
    """The batch must be a multiple of this (q for Optimus, d q for SUMMA2.5)."""
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


def _layer_activations(scheme: Scheme, cfg: TransformerConfig) -> float:
    """Items one rank keeps for the backward of one layer (see the module doc):
    ``(8 + 2f) b s h + b n s^2`` split over p, plus the LayerNorm statistics
    ``4 b s`` over d q; Megatron keeps the LayerNorm inputs and outputs (4 b s h)
    and statistics whole."""
    b, s, h, n = cfg.b, cfg.s, cfg.h, cfg.n
    p, q, d = scheme.p, scheme.q, scheme.d
    bsh, scores = b * s * h, b * n * s * s
    bsf = b * s * cfg.ffn_width                  # fc1 output, and GELU output
    if scheme.name == "megatron":
        # whole: LN1 in/out, LN2 in/out; split: QKV 3, attention out 1, fc1 and GELU f each
        return 4 * bsh + 4 * b * s + (4 * bsh + 2 * bsf + scores) / p
    # LN1 in/out 2, QKV 3, attention out 1, residual 1, LN2 out 1, fc1 and GELU f each
    return (8 * bsh + 2 * bsf + scores) / p + 4 * b * s / (d * q)
