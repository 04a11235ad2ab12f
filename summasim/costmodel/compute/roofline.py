"""Roofline pricing of the memory-bound work of a training step (GPU devices).

On a GPU the work of a transformer step that is not a GEMM (LayerNorm, the softmax
over the ``b n s^2`` attention scores, GELU, dropout, bias and residual adds, the
embedding, the loss, the optimizer update) is limited by memory bandwidth, not by
arithmetic, and every kernel pays a launch. Each such kernel is priced as

    t = max(flops / vector_flops, bytes / memory_bandwidth) + launch_seconds

(Williams, Waterman and Patterson's roofline), with the device's non-tensor-core
(vector) rate for the flops, its achievable memory bandwidth (STREAM-like) and a
per-kernel launch cost. GEMMs use the machine's ``gamma_gemm`` table (tensor-core
rates for float16/bfloat16) and the same roofline with their operand bytes.

Kernels of one layer, per rank (``it`` bytes per item; X the local activation
items of a ``[b s, h]`` tensor, Q of the QKV output, S of the attention scores,
F of the MLP's ``[b s, f h]`` hidden; Megatron runs LayerNorm, residuals and hidden
dropout replicated over ``b s h`` on every rank, the rest split over p; Optimus and
SUMMA2.5-LM split everything over p)

=========================  ===============================  ========================
kernel                     forward bytes (flops)            backward bytes
=========================  ===============================  ========================
LayerNorm (x2)             2 X it  (8 X)                    3 X it  (+ dgamma, dbeta)
QKV bias                   2 Q it                           Q it (bias gradient)
scale+mask+softmax         2 S it  (5 S)                    3 S it
attention dropout          S (2 it + 1)  [dropout > 0]      S (2 it + 1)
proj bias+dropout+residual 3 X it (+ X mask bytes)          3 X it (+ X)
fc1 bias + GELU            2 F it  (10 F)                   3 F it  (15 F)
fc2 bias+dropout+residual  3 X it (+ X mask bytes)          3 X it (+ X)
=========================  ===============================  ========================

Fused, as above, is Megatron-LM's (``cfg.kernels == "fused"``); RMSNorm (``cfg.norm``)
and RoPE (``cfg.rope``, 2 it bytes per q and k item each way) are one kernel each
there too. PyTorch **eager** (``cfg.kernels == "eager"``) runs one kernel per operation
of the reference eager code, each writing its result to memory
(:func:`_eager_norm`, :func:`_rope_kernels`, :func:`_eager_attention_extra`): the bias
adds happen inside the GEMMs (``addmm``); dropout and the residual add are two kernels
each way; plain attention scales and masks the scores in two kernels of their own
before the softmax (minGPT's ``att * scale``, ``masked_fill``); SwiGLU is ``silu`` then
a multiply (Hugging Face's ``LlamaMLP``); RMSNorm is Hugging Face's ``LlamaRMSNorm``
(a float32 copy, ``pow``, ``mean``, ``rsqrt``, a multiply, the cast back, the weight);
LayerNorm is ``torch.nn.LayerNorm``'s native kernel, whose backward reduces the
weight's and bias's gradients in a second kernel; RoPE is Hugging Face's
``apply_rotary_pos_emb`` (``q cos + rotate_half(q) sin``, ``rotate_half`` a negation
and a ``cat``); the loss upcasts the logits to float32 before its log-softmax (as
``LlamaForCausalLM`` and autocast's ``cross_entropy`` do). Each kernel also pays a
launch. (torch.compile fuses these chains again; a compiled run is ``fused``.)

With activation checkpointing the forward kernels run again in backward; with
selective recompute the softmax and attention dropout. Under Megatron sequence
parallelism X (LayerNorm, residual, hidden dropout) is ``b s h / p`` (Korthikanti et
al. 2022, section 4.2.2). Blockwise attention (:func:`_attention_kernels`) moves no
``S`` bytes; SwiGLU's kernel reads two F tensors and writes one. Per step
add the embedding (gather and position add, 3 X it; backward scatter-add 3 X it),
the final LayerNorm, the vocabulary-parallel cross-entropy over the local logits
``L = b s v / p`` (forward 3 L it: max, sum of exponentials, loss; backward 2 L it)
and Adam over the local parameters P: one fused multi-tensor update reading the
gradient, the float32 master weight and both moments and writing them back (plus
the low-precision copy when ``it < 4``): ``(28 + 2 it if it < 4 else 28) P`` bytes,
12 flops per parameter, one launch per parameter tensor.

References
----------
S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009.
J. D. McCalpin, "STREAM: sustainable memory bandwidth in high performance
computers" (the memory-bandwidth microbenchmark the presets cite).
V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4 (the per-layer activation tensors of Megatron's layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from .._fields import nested_from_dict

#: Flops per element assumed for each elementwise kernel (LayerNorm: mean, variance,
#: normalize, scale, shift; softmax: max, exp, sum, divide, scale/mask; GELU tanh form).
LN_FLOPS, SOFTMAX_FLOPS, GELU_FLOPS, GELU_BWD_FLOPS = 8.0, 5.0, 10.0, 15.0
#: SwiGLU (Shazeer 2020): ``silu(g) u = g u / (1 + exp(-g))``: exp, add, divide and two
#: multiplies forward; backward ``silu'(g) = s (1 + g (1 - s))`` with s the sigmoid,
#: times u and dout, and silu(g) times dout: about twice that.
SWIGLU_FLOPS, SWIGLU_BWD_FLOPS = 5.0, 10.0
#: Bytes per parameter of a fused Adam step (see the module docstring), without the
#: low-precision copy.
ADAM_BYTES = 28.0
ADAM_FLOPS = 12.0


def _num(path, value, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"machine field {path!r} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"machine field {path!r} must be {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class Device:
    """The memory-bound side of one device (a GPU).

    Parameters
    ----------
    name : str
        E.g. "A100-SXM4-80GB".
    memory_bandwidth : float
        Achievable device-memory bandwidth, bytes/s (a STREAM-like copy).
    vector_flops : dict
        ``{dtype: flop/s}`` of the non-tensor-core units (elementwise math).
    launch_seconds : float
        Cost of one kernel launch, seconds.
    sms : int
        Streaming multiprocessors (0: not given). With ``gemm_tiles`` it prices the tile
        and wave quantization of a GEMM's shape (:func:`gemm_quantization`); with
        ``comm_sms`` the contention of overlapped collectives
        (:func:`~summasim.costmodel.workload.overlap.contention_share`).
    comm_sms : float
        SMs a running collective occupies (NCCL: one thread block per channel; 0: its
        contention is not priced).
    gemm_tiles : list
        ``[[rows, cols], ...]``: the output tiles one SM computes in a large GEMM that
        the library picks among (each in either orientation; the presets: 256 x 128 and
        128 x 128); empty: no quantization priced.
    reserve_bytes : float
        Device memory a training process holds outside PyTorch's tensors: the CUDA
        context, the cuBLAS/cuBLASLt workspaces, NCCL's channel buffers (0: none).
    fragmentation : float
        Share of the caching allocator's reserved memory that fragmentation leaves
        unusable, in [0, 1) (0: none). :func:`usable_memory` applies both.
    sources : dict
        ``{field: public source}``.
    """

    name: str
    memory_bandwidth: float
    vector_flops: dict
    launch_seconds: float = 0.0
    sms: int = 0
    comm_sms: float = 0.0
    gemm_tiles: tuple = ()
    reserve_bytes: float = 0.0
    fragmentation: float = 0.0
    sources: dict = field(default_factory=dict)

    _FIELDS = ("name", "memory_bandwidth", "vector_flops", "launch_seconds", "sms",
               "comm_sms", "gemm_tiles", "reserve_bytes", "fragmentation", "sources")

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("machine field 'device.name' must be a non-empty string")
        _num("device.memory_bandwidth", self.memory_bandwidth, positive=True)
        _num("device.launch_seconds", self.launch_seconds)
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or self.sms < 0:
            raise ValueError(f"machine field 'device.sms' must be an integer >= 0, "
                             f"got {self.sms!r}")
        _num("device.comm_sms", self.comm_sms)
        if self.comm_sms > self.sms:
            raise ValueError(f"machine field 'device.comm_sms' ({self.comm_sms}) must not "
                             f"exceed 'device.sms' ({self.sms})")
        try:
            tiles = tuple(tuple(t) for t in self.gemm_tiles)
        except TypeError:
            tiles = None
        if tiles is None or any(len(t) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                   or x <= 0 for x in t) for t in tiles):
            raise ValueError(f"machine field 'device.gemm_tiles' must be a list of [rows, "
                             f"cols] of positive integers (or empty), got {self.gemm_tiles!r}")
        if tiles and not self.sms:
            raise ValueError("machine field 'device.gemm_tiles' needs 'device.sms'")
        object.__setattr__(self, "gemm_tiles", tiles)
        _num("device.reserve_bytes", self.reserve_bytes)
        if _num("device.fragmentation", self.fragmentation) >= 1:
            raise ValueError(f"machine field 'device.fragmentation' must be in [0, 1), "
                             f"got {self.fragmentation!r}")
        if not isinstance(self.vector_flops, Mapping) or not self.vector_flops:
            raise ValueError("machine field 'device.vector_flops' must be a non-empty object "
                             "{dtype: flop/s}")
        for dt, v in self.vector_flops.items():
            _num(f"device.vector_flops.{dt}", v, positive=True)
        object.__setattr__(self, "vector_flops", dict(self.vector_flops))
        if not isinstance(self.sources, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
            raise ValueError("machine field 'device.sources' must be an object of strings")
        object.__setattr__(self, "sources", dict(self.sources))

    def flops_rate(self, dtype: str) -> float:
        """Vector flop/s for ``dtype`` (float32's when the dtype is not listed)."""
        return self.vector_flops.get(dtype) or self.vector_flops.get("float32") or max(
            self.vector_flops.values())

    def kernel_time(self, flops: float, nbytes: float, dtype: str = "float32") -> float:
        """``max(flops / vector_flops, bytes / memory_bandwidth) + launch_seconds``."""
        return max(flops / self.flops_rate(dtype), nbytes / self.memory_bandwidth) \
            + self.launch_seconds

    def to_dict(self) -> dict:
        out = {f: getattr(self, f) for f in self._FIELDS}
        out["gemm_tiles"] = [list(t) for t in self.gemm_tiles]
        for f, empty in (("sms", 0), ("comm_sms", 0.0), ("gemm_tiles", []),
                         ("reserve_bytes", 0.0), ("fragmentation", 0.0)):
            if out[f] == empty:                 # files without them stay as they were
                del out[f]
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> "Device":
        return nested_from_dict(cls, d, "device", ("name", "memory_bandwidth", "vector_flops"))


def usable_memory(machine, ranks: int | None = None) -> float:
    """Bytes per device that a training step's tensors may take: the machine's
    ``memory_bytes`` less the device's ``reserve_bytes``, of which the allocator's
    ``fragmentation`` is lost: ``(memory - reserve) (1 - fragmentation)``. 0 when the
    memory is not given.

    On a machine without a device (a CPU node, whose fit records the node's memory over
    its ``cores``) the ranks on a node share its memory: with ``ranks`` ranks in the job
    (on one node when ``node_size`` is None, else at most ``node_size`` per node), a
    rank's share is the node's memory over the ranks on it, ``memory_bytes cores /
    (ranks on a node)``; without ``ranks``, one rank per core (``memory_bytes``)."""
    total = float(getattr(machine, "memory_bytes", 0) or 0)
    dev = getattr(machine, "device", None)
    if dev is None or total <= 0:
        cores = int(getattr(machine, "cores", 0) or 0)
        if ranks and total > 0 and cores > 0:
            size = getattr(machine, "node_size", None)
            on_node = int(ranks) if size is None else min(int(ranks), int(size))
            return total * cores / max(1, on_node)
        return total
    return max(0.0, total - dev.reserve_bytes) * (1.0 - dev.fragmentation)


class Kernel(NamedTuple):
    """One memory-bound kernel on one rank: flops and bytes moved."""

    name: str
    flops: float
    nbytes: float


def _local_sizes(scheme, cfg):
    """``(X_whole, X_split, Q, S, F)``: local items of one rank. On Optimus and
    SUMMA2.5-LM the busiest rank's, rank (0, 0, 0)'s, ``[b s/(d pr), width_0]`` blocks
    where pc does not divide the key/value heads or the MLP width (``scheme.blocks``:
    column 0's head groups, ``ceil(f h/pc)`` MLP columns)."""
    b, s, h, n = cfg.b, cfg.s, cfg.h, cfg.n
    p = scheme.p
    bsh = b * s * h
    f = cfg.ffn * h
    if scheme.name == "megatron" and not getattr(cfg, "sequence_parallel", False):
        x_rep = bsh                      # LayerNorm, residual, hidden dropout: replicated
    else:
        x_rep = bsh / p                  # 2D/2.5D blocks; Megatron's sequence shards
    qkv = getattr(cfg, "qkv_mult", 3)
    out = [x_rep, bsh / p, qkv * bsh / p, b * n * s * s / p, b * s * f / p]
    if scheme.kind in ("2d", "2.5d") and hasattr(scheme, "blocks"):
        blk = scheme.blocks(cfg)
        seqs = b / (scheme.d * scheme.q)  # the rank's sequences
        if blk.cuts:                      # column 0's head groups, the widest
            x = seqs * s * blk.h
            out[:4] = [x, x, seqs * s * blk.qkv, seqs * blk.heads * s * s]
        if blk.ffn != cfg.ffn_width / scheme.cols:
            out[4] = seqs * s * blk.ffn
    return tuple(out)


def _attention_kernels(cfg, X, Xs, S, it, drop) -> tuple[list, list]:
    """The attention core's memory-bound kernels, forward and backward.

    Plain: scale+mask+softmax over the S scores (forward reads and writes them, 2 S it;
    backward reads the probabilities and their gradient and writes the scores'
    gradient, 3 S it) and the attention dropout (S (2 it + 1), its mask a byte each).
    Blockwise (FlashAttention, Dao et al. 2022, section 3.1; FlashAttention-2, Dao 2023):
    the softmax, mask and dropout run inside the attention GEMMs' kernel, so the scores
    never reach device memory: the same flops at the vector rate, no S traffic; the
    kernel writes the float32 log-sum-exp (b n s / p, 4 bytes) forward, and backward
    first forms ``D = rowsum(dO * O)`` (reads dO and O, 2 Xs it), recomputing the
    probabilities' exponentials (5 S flops again) before the 4 S of the softmax backward.
    """
    if getattr(cfg, "attention", "plain") == "flash":
        lse = 4 * S / cfg.s              # b n s / p float32 row statistics
        fwd = [Kernel("flash_softmax", (SOFTMAX_FLOPS + (2 if drop else 0)) * S, lse)]
        bwd = [Kernel("flash_softmax_bwd", (SOFTMAX_FLOPS + 4 + (1 if drop else 0)) * S,
                      2 * Xs * it + lse)]
        return fwd, bwd
    fwd = [Kernel("softmax", SOFTMAX_FLOPS * S, 2 * S * it)]
    if drop:
        fwd.append(Kernel("attn_dropout", 2 * S, S * (2 * it + 1)))
    bwd = []
    if drop:
        bwd.append(Kernel("attn_dropout_bwd", S, S * (2 * it + 1)))
    bwd.append(Kernel("softmax_bwd", 4 * S, 3 * S * it))
    return fwd, bwd


def attention_kernels(scheme, cfg) -> dict:
    """``{"forward": [Kernel], "backward": [Kernel]}``: the attention core's memory-bound
    kernels of one layer on one rank (:func:`_attention_kernels`); its forward is what
    selective recompute runs again."""
    X, Xs, Q, S, F = _local_sizes(scheme, cfg)
    fwd, bwd = _attention_kernels(cfg, X, Xs, S, cfg.itemsize,
                                  getattr(cfg, "dropout", 0.0) > 0)
    return {"forward": fwd, "backward": bwd}


#: RMSNorm's flops per item: square, sum, scale by the reciprocal root, the weight.
RMS_FLOPS = 4.0


def _eager(cfg) -> bool:
    return getattr(cfg, "kernels", "fused") == "eager"


def _eager_norm(tag: str, X: float, it: int, rms: bool) -> tuple[list, list]:
    """One norm's kernels in PyTorch eager over ``X`` items (see the module doc)."""
    if not rms:        # torch.nn.LayerNorm: native; backward's dgamma/dbeta apart
        return ([Kernel(tag, LN_FLOPS * X, 2 * X * it)],
                [Kernel(f"{tag}_bwd", 2 * LN_FLOPS * X, 3 * X * it),
                 Kernel(f"{tag}_weight_bias_grad", 2 * X, 2 * X * it)])
    # LlamaRMSNorm: h = x.float(); v = h.pow(2).mean(-1); h = h * rsqrt(v + eps);
    # weight * h.to(dtype)
    fwd = [Kernel(f"{tag}_to_float32", 0, X * (it + 4)), Kernel(f"{tag}_pow", X, 8 * X),
           Kernel(f"{tag}_mean", X, 4 * X), Kernel(f"{tag}_mul_rsqrt", X, 8 * X),
           Kernel(f"{tag}_to_dtype", 0, X * (4 + it)), Kernel(f"{tag}_mul_weight", X, 2 * X * it)]
    # autograd, in reverse: the weight's multiply (dx, and dweight = sum(dy x)), the cast
    # back to float32, the rsqrt multiply (dh = g r; dr = sum(g h)), mean's expand, pow's
    # 2 h g, the two float32 gradients of h added, the cast to the input's dtype
    bwd = [Kernel(f"{tag}_mul_weight_bwd", X, 2 * X * it),
           Kernel(f"{tag}_weight_grad_mul", X, 3 * X * it),
           Kernel(f"{tag}_weight_grad_sum", X, X * it),
           Kernel(f"{tag}_to_dtype_bwd", 0, X * (it + 4)),
           Kernel(f"{tag}_mul_rsqrt_bwd", X, 12 * X), Kernel(f"{tag}_rsqrt_grad", 2 * X, 16 * X),
           Kernel(f"{tag}_mean_bwd", X, 4 * X), Kernel(f"{tag}_pow_bwd", 2 * X, 12 * X),
           Kernel(f"{tag}_grad_add", X, 12 * X), Kernel(f"{tag}_to_float32_bwd", 0, X * (4 + it))]
    return fwd, bwd


def _norm_kernels(tag: str, cfg, X: float, it: int) -> tuple[list, list]:
    """One LayerNorm or RMSNorm (``cfg.norm``) over ``X`` items, forward and backward."""
    rms = getattr(cfg, "norm", "layernorm") == "rmsnorm"
    if _eager(cfg):
        return _eager_norm(tag, X, it, rms)
    flops = RMS_FLOPS if rms else LN_FLOPS
    return ([Kernel(tag, flops * X, 2 * X * it)],
            [Kernel(f"{tag}_bwd", 2 * flops * X, 3 * X * it)])


def _rope_kernels(cfg, Xs: float, it: int) -> tuple[list, list]:
    """RoPE on this rank's q (``Xs`` items) and k (``Xs kv/n``), forward and backward:
    one kernel per tensor fused (reads it, writes it: 2 it a item each way); eager,
    Hugging Face's ``q * cos + rotate_half(q) * sin`` per tensor, and backward the
    gradients of both products, the negation, the two halves' slice gradients
    (zero-filled full tensors) and the sums."""
    if not getattr(cfg, "rope", False):
        return [], []
    kv = getattr(cfg, "kv_heads", None) or cfg.n
    fwd, bwd = [], []
    for name, E in (("q", Xs), ("k", Xs * kv / cfg.n)):
        if not _eager(cfg):
            fwd.append(Kernel(f"rope_{name}", 6 * E, 2 * E * it))
            bwd.append(Kernel(f"rope_{name}_bwd", 6 * E, 2 * E * it))
            continue
        fwd += [Kernel(f"rope_{name}_mul_cos", E, 2 * E * it),
                Kernel(f"rope_{name}_neg", E / 2, E * it),
                Kernel(f"rope_{name}_cat", 0, 2 * E * it),
                Kernel(f"rope_{name}_mul_sin", E, 2 * E * it),
                Kernel(f"rope_{name}_add", E, 3 * E * it)]
        bwd += [Kernel(f"rope_{name}_mul_sin_bwd", E, 2 * E * it),
                Kernel(f"rope_{name}_neg_bwd", E / 2, E * it),
                Kernel(f"rope_{name}_slice_bwd_1", 0, 2 * E * it),
                Kernel(f"rope_{name}_slice_bwd_2", 0, 2 * E * it),
                Kernel(f"rope_{name}_halves_add", E, 3 * E * it),
                Kernel(f"rope_{name}_mul_cos_bwd", E, 2 * E * it),
                Kernel(f"rope_{name}_grad_add", E, 3 * E * it)]
    return fwd, bwd


def _eager_attention_extra(cfg, S: float, it: int) -> tuple[list, list]:
    """Eager plain attention's own scale and mask kernels over the ``S`` scores (minGPT:
    ``(q @ k^T) * scale``, then ``masked_fill``), forward and backward; none for the
    fused softmax or blockwise attention (SDPA's kernels)."""
    if not _eager(cfg) or getattr(cfg, "attention", "plain") != "plain":
        return [], []
    return ([Kernel("scores_scale", S, 2 * S * it), Kernel("scores_mask", S, 2 * S * it)],
            [Kernel("scores_mask_bwd", S, 2 * S * it), Kernel("scores_scale_bwd", S, 2 * S * it)])


def _dropout_residual(tag: str, cfg, X: float, it: int, drop: bool) -> tuple[list, list]:
    """Bias, dropout and the residual add after a projection, forward and backward:
    one kernel each way fused; eager, the bias inside the GEMM, then a dropout kernel
    (when there is dropout) and an add, and backward the dropout's and the residual's
    gradient sum."""
    mask = 1.0 if drop else 0.0
    if not _eager(cfg):
        return ([Kernel(f"{tag}_bias_dropout_residual", 3 * X, 3 * X * it + mask * X)],
                [Kernel(f"{tag}_dropout_residual_bwd", 2 * X, 3 * X * it + mask * X)])
    fwd = [Kernel(f"{tag}_dropout", 2 * X, 2 * X * it + X)] if drop else []
    bwd = [Kernel(f"{tag}_dropout_bwd", X, 2 * X * it + X)] if drop else []
    return (fwd + [Kernel(f"{tag}_residual_add", X, 3 * X * it)],
            bwd + [Kernel(f"{tag}_residual_grad_add", X, 3 * X * it)])


def layer_kernels(scheme, cfg) -> dict:
    """``{"forward": [Kernel], "backward": [Kernel]}`` of one layer on one rank (see
    the module docstring); backward starts with what the recompute re-runs
    (``cfg.recompute``: the whole forward when ``full``; the attention core's softmax
    and dropout when ``selective``, Korthikanti et al. 2022, section 5)."""
    it = cfg.itemsize
    drop = getattr(cfg, "dropout", 0.0) > 0
    eager = _eager(cfg)
    X, Xs, Q, S, F = _local_sizes(scheme, cfg)
    att_f, att_b = _attention_kernels(cfg, X, Xs, S, it, drop)
    sc_f, sc_b = _eager_attention_extra(cfg, S, it)
    ln1_f, ln1_b = _norm_kernels("ln1", cfg, X, it)
    ln2_f, ln2_b = _norm_kernels("ln2", cfg, X, it)
    rope_f, rope_b = _rope_kernels(cfg, Xs, it)
    proj_f, proj_b = _dropout_residual("proj", cfg, X, it, drop)
    fc2_f, fc2_b = _dropout_residual("fc2", cfg, X, it, drop)
    # eager: the QKV bias is added inside its GEMM (addmm)
    fwd = ln1_f + ([] if eager else [Kernel("qkv_bias", Q, 2 * Q * it)]) + rope_f
    fwd += sc_f + att_f + proj_f + ln2_f
    if getattr(cfg, "mlp", "gelu") == "swiglu":
        if eager:       # LlamaMLP: silu(gate) written, then the multiply by up
            fwd += [Kernel("fc1_silu", 4 * F, 2 * F * it),
                    Kernel("fc1_mul_up", F, 3 * F * it)]
        else:           # gate and up (+ biases) in, silu(gate) * up out (Shazeer 2020)
            fwd.append(Kernel("fc1_bias_swiglu", SWIGLU_FLOPS * F, 3 * F * it))
    else:
        fwd.append(Kernel("fc1_gelu" if eager else "fc1_bias_gelu", GELU_FLOPS * F, 2 * F * it))
    fwd += fc2_f
    bwd = fc2_b + [Kernel("fc2_bias_grad", X, X * it)]
    if getattr(cfg, "mlp", "gelu") == "swiglu":
        if eager:       # d(silu) = g up, d(up) = g silu; then silu's backward
            bwd += [Kernel("fc1_mul_up_bwd_silu", F, 3 * F * it),
                    Kernel("fc1_mul_up_bwd_up", F, 3 * F * it),
                    Kernel("fc1_silu_bwd", SWIGLU_BWD_FLOPS * F, 3 * F * it)]
        else:           # reads gate, up and the product's gradient, writes both: 5 F it
            bwd.append(Kernel("fc1_swiglu_bwd", SWIGLU_BWD_FLOPS * F, 5 * F * it))
        bwd.append(Kernel("fc1_bias_grad", 2 * F, 2 * F * it))
    else:
        bwd += [Kernel("fc1_gelu_bwd", GELU_BWD_FLOPS * F, 3 * F * it),
                Kernel("fc1_bias_grad", F, F * it)]
    bwd += ln2_b + proj_b + [Kernel("proj_bias_grad", X, X * it)]
    bwd += att_b + sc_b + rope_b
    bwd += [Kernel("qkv_bias_grad", Q, Q * it)] + ln1_b
    recompute = getattr(cfg, "recompute", "full" if cfg.checkpoint else "none")
    if recompute == "full":
        bwd = list(fwd) + bwd
    elif recompute == "selective" and getattr(cfg, "attention", "plain") == "plain":
        bwd = list(sc_f + att_f) + bwd
    return {"forward": fwd, "backward": bwd}


def model_kernels(scheme, cfg, local_params: float, param_tensors: float) -> dict:
    """``{"forward", "backward", "optimizer"}`` kernels of one training step on one rank:
    N layers (:func:`layer_kernels`), embedding, final LayerNorm, the loss over the
    local logits, and Adam over ``local_params`` parameters in ``param_tensors``
    tensors."""
    it = cfg.itemsize
    X, Xs, Q, S, F = _local_sizes(scheme, cfg)
    layer = layer_kernels(scheme, cfg)
    L = cfg.b * cfg.s * cfg.v / scheme.p
    # the vocabulary-parallel lookup writes the whole [b s, h] partial sum on every
    # Megatron rank, sequence parallel or not (it is reduce-scattered afterwards); the 3D
    # cube's its [b s/q, h/q] partial (reduce-scattered over q)
    E = (cfg.b * cfg.s * cfg.h if scheme.name == "megatron"
         else X * scheme.q if scheme.kind == "3d" else X)
    lnf_f, lnf_b = _norm_kernels("lnf", cfg, X, it)
    fwd = [Kernel("embedding", E, 3 * E * it)] + cfg.N * layer["forward"] + lnf_f
    bwd = []
    if cfg.v and _eager(cfg):
        # logits.float(), log-softmax and the NLL gather; backward the NLL's scatter into
        # a zero-filled float32 tensor, the log-softmax's, the cast back
        fwd += [Kernel("logits_to_float32", 0, L * (it + 4)),
                Kernel("log_softmax", 4 * L, 8 * L)]
        bwd += [Kernel("nll_bwd", 0, 4 * L), Kernel("log_softmax_bwd", 2 * L, 12 * L),
                Kernel("logits_to_float32_bwd", 0, L * (4 + it))]
    elif cfg.v:
        fwd.append(Kernel("cross_entropy", 4 * L, 3 * L * it))
        bwd.append(Kernel("cross_entropy_bwd", 2 * L, 2 * L * it))
    bwd += lnf_b + cfg.N * layer["backward"] + [Kernel("embedding_bwd", E, 3 * E * it)]
    per_param = ADAM_BYTES + (2 * it if it < 4 else 0)
    opt = []
    if local_params > 0:
        tensors = max(1, int(round(param_tensors)))
        # one launch per parameter tensor; the bytes spread over them
        opt = [Kernel("adam", ADAM_FLOPS * local_params / tensors,
                      per_param * local_params / tensors)] * tensors
    return {"forward": fwd, "backward": bwd, "optimizer": opt}


def kernels_seconds(kernels, device: Device, dtype: str = "float32") -> float:
    """Sum of :meth:`Device.kernel_time` over ``kernels``."""
    return sum(device.kernel_time(k.flops, k.nbytes, dtype) for k in kernels)


def _useful(m: float, n: float, tile: tuple, sms: int, batch: int) -> float:
    """The share of the SM-waves a ``[m, n]`` output (``batch`` of them) keeps busy with
    tiles of ``tile``: tile quantization ``m n / (ceil(m/r) r ceil(n/c) c)`` times wave
    quantization ``T / (ceil(T/sms) sms)``, ``T = batch ceil(m/r) ceil(n/c)``; the better
    of the tile's two orientations."""
    best = 0.0
    for r, c in (tile, tile[::-1]):
        tm, tn = math.ceil(m / r), math.ceil(n / c)
        tiles = batch * tm * tn
        best = max(best, (m * n / (tm * r * tn * c)) * tiles / (math.ceil(tiles / sms) * sms))
    return best


def gemm_quantization(device: Device, m: float, k: float, n: float, batch: int = 1) -> float:
    """How much longer a ``[m, k] @ [k, n]`` GEMM (``batch`` of them in one launch) takes
    than the machine's ``gamma`` table says: ``1 / useful`` with the best of the
    device's ``gemm_tiles`` (:func:`_useful`; NVIDIA, "Matrix Multiplication Background
    User's Guide", section 3, tile and wave quantization: the library picks the tile
    per shape). The table is read as the rate of shapes that fill whole tiles and whole
    waves: its plateau is a microbenchmark's best shape. Outputs that the largest tile
    cuts into fewer tiles than SMs, or with a side shorter than the smallest tile's, are
    priced by the table's size curve alone (the library splits k or picks narrower
    tiles to fill the SMs for them), so the factor is 1 there, as it is without
    ``device.gemm_tiles``."""
    if not device.gemm_tiles or m <= 0 or n <= 0 or k <= 0:
        return 1.0
    b = max(1, int(batch))
    small = min(min(t) for t in device.gemm_tiles)
    r, c = max(device.gemm_tiles, key=lambda t: t[0] * t[1])
    if min(m, n) < small or b * math.ceil(m / r) * math.ceil(n / c) < device.sms:
        return 1.0
    return 1.0 / max(_useful(m, n, t, device.sms, b) for t in device.gemm_tiles)


def gemm_roofline(machine, device: Device, m: float, k: float, n: float, dtype: str,
                  itemsize: int, batch: int = 1) -> float:
    """One GEMM ``[m, k] @ [k, n]``: ``max(2 m k n gamma q, operand bytes / bandwidth)``
    plus one launch (``gamma`` from the machine's table for ``dtype``, ``q`` the shape's
    :func:`gemm_quantization`, with ``batch`` GEMMs of the shape in one launch)."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    compute = machine.gemm_time(m, k, n, dtype) * gemm_quantization(device, m, k, n, batch)
    memory = (m * k + k * n + m * n) * itemsize / device.memory_bandwidth
    return max(compute, memory) + device.launch_seconds
