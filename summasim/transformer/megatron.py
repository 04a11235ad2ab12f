"""Megatron-LM 1D tensor parallelism over a group of ``p`` ranks (Shoeybi et al. 2019).

Every rank of a :class:`~summasim.grid.Grid1D` holds the whole activation
``X [b*s, h]`` of every layer (replicated) and ``1/p`` of each weight matrix. The
ops of :mod:`summasim.transformer.ops` run unchanged on the local slices; this
module only chooses the slices and places the collectives.

The partition (rank ``r`` of ``p``)
-----------------------------------
Column-parallel linear (attention QKV, MLP fc and SwiGLU's gate): ``Y = XA + b``,
``A = [A_1, ..., A_p]`` split along its second dimension, ``b = [b_1, ..., b_p]``. Rank
``r`` computes ``Y_r = X A_r + b_r`` with no communication. For QKV, ``A_r`` is the Q
columns of query heads ``[r n/p, (r+1) n/p)`` and the K and V columns of key/value heads
``[r kv/p, (r+1) kv/p)`` (``kv = n`` without grouped-query attention; a permutation of
the serial ``[Q | K | V]`` columns, still ordered ``[Q_r | K_r | V_r]``), so attention
runs on whole local heads; for fc (and gate), ``A_r`` is columns ``[r f/p, (r+1) f/p)``
and GELU (SwiGLU's ``silu(gate) * up``) is elementwise on them.

Row-parallel linear (attention proj, MLP proj): ``Z = YB + c``, ``B = [B_1; ...; B_p]``
split along its first dimension to match ``Y = [Y_1, ..., Y_p]``, so
``Z = sum_r Y_r B_r + c``. Rank ``r`` computes the partial product ``Y_r B_r``,
ONE all-reduce (``g``) of the ``[b*s, h]`` partials gives ``Z - c`` on every rank,
and the bias ``c`` (replicated) is added once, after it.

The conjugate operators of Megatron's ``mappings.py``, one function per direction:

* ``f`` (before a column-parallel linear; Megatron's
  ``copy_to_tensor_model_parallel_region``): :func:`f_forward` is the identity;
  :func:`f_backward` all-reduces, since ``dX = sum_r dY_r A_r^T`` is a partial sum on
  each rank.
* ``g`` (after a row-parallel linear; ``reduce_from_tensor_model_parallel_region``):
  :func:`g_forward` all-reduces; :func:`g_backward` is the identity (``dZ`` is
  replicated, ``dY_r = dZ B_r^T`` is local).
* The vocabulary-parallel pieces pair up the same way: the masked embedding lookup is
  summed by ``g`` (its backward, the masked scatter-add, is local); the LM head's
  input passes ``f`` (its backward sums ``dx = sum_r dZ_r E_r``, or ``sum_r dZ_r
  W_r^T`` for an untied head); the cross-entropy's
  max and sums go through :func:`vocab_reduce_forward`, which has no backward
  collective (each shard's logit gradient is local, as in Megatron's
  ``_VocabParallelCrossEntropy``).

Parameter gradients need no communication: ``dA_r = X^T dY_r``, ``db_r = sum dY_r``,
``dB_r = Y_r^T dZ`` are this rank's blocks; ``dc = sum dZ`` and the LayerNorm
gradients are computed from replicated arrays, identically on every rank.

Vocabulary parallelism. ``wte = [E_1; ...; E_p]`` is split by rows (vocabulary ids
``[r v/p, (r+1) v/p)``, layout ``"row"``; a vocabulary p does not divide is padded to
``p ceil(v/p)`` ids, :func:`summasim.spec.vocab_block`, whose zero rows no token looks up
and whose logits the cross-entropy leaves out). The embedding is a masked lookup (ids
outside the shard give 0) followed by an all-reduce; ``wpe`` is replicated. The
tied LM head gives each rank its logit columns ``Z_r = x E_r^T [b*s, v/p]``; the
cross-entropy reduces over the vocabulary with three all-reduces of ``[b*s, 1]``
(max, sum of exponentials, target logit -- which is 0 on ranks without the
target). ``dZ_r`` is local, ``dx = sum_r dZ_r E_r`` is a partial sum: all-reduce.
An untied head ``head.w = W = [W_1, ..., W_p]`` (``[h, v]``, ``tied=False``) is split by
its vocabulary columns, the same ids as ``wte``'s rows (layout ``"col"``): ``Z_r = x
W_r``, the same cross-entropy, ``dx = sum_r dZ_r W_r^T`` all-reduced as the tied head's,
``dW_r = x^T dZ_r`` local, and no ``wte`` gradient from the head. LayerNorms (ln1, ln2,
lnf) are replicated and computed identically everywhere.

Traffic per layer (Optimus Table 1, ``4 (p-1)/p bsh`` forward and ``8 (p-1)/p bsh``
backward with checkpointing, counting ``2 (p-1)/p`` items per all-reduced item):
forward 2 all-reduces of ``b*s*h`` items (the two ``g``); backward 2 (the two
``f`` conjugates), plus the 2 ``g`` of the recomputed forward when checkpointing.
Outside Table 1 ("aux"): 1 all-reduce of ``b*s*h`` in the embedding, 3 of ``b*s``
in the loss, 1 of ``b*s*h`` for the LM head's input gradient. As in Megatron's
``_reduce``, every all-reduce (:func:`f_backward`, :func:`g_forward`,
:func:`vocab_reduce_forward`) is skipped on a group of one, so ``p == 1`` runs the
same code and communicates nothing.

Trace phases
------------
``embed.fwd/aux.vocab``                      embedding all-reduce
``h{l}.fwd/tp.attn.proj``, ``h{l}.fwd/tp.mlp.proj``      the two ``g`` of layer l
``loss.fwd/aux.max``, ``loss.fwd/aux.sum`` (x2)          vocab-parallel cross-entropy
``loss.bwd/aux.lm_head``                     LM head input gradient (its ``f`` conjugate)
``h{l}.bwd/tp.mlp.fc``, ``h{l}.bwd/tp.attn.qkv``         the two ``f`` conjugates
``h{l}.bwd/tp.recompute.attn.proj``, ``h{l}.bwd/tp.recompute.mlp.proj``
                                             the ``g`` of the recomputed forward
                                             (``checkpoint=True`` only)
``logits/aux.gather``, ``unshard/aux.gather``  checks only (not in a training step)

so ``[e for e in trace.events if e.phase.startswith("h0.fwd/tp.")]`` is Table 1's
forward traffic of layer 0. ``lnf`` runs inside ``loss.fwd``/``loss.bwd``.

With sequence parallelism each all-reduce above of ``b*s*h`` items becomes a
reduce-scatter under the same name (``h{l}.fwd/tp.attn.proj``, ``h{l}.bwd/tp.mlp.fc``,
``embed.fwd/aux.vocab``, ``loss.bwd/aux.lm_head``, ...) and each new all-gather takes the
name of the linear it feeds or conjugates, with ``sp.``: ``h{l}.fwd/tp.sp.attn.qkv``,
``h{l}.fwd/tp.sp.mlp.fc`` (before the column-parallel linears), ``h{l}.bwd/tp.sp.mlp.proj``,
``h{l}.bwd/tp.sp.attn.proj`` (the projections' conjugates), ``h{l}.bwd/tp.recompute.sp.*``,
``embed.bwd/aux.sp.vocab``, ``loss.fwd/aux.sp.head``; each ring half is ``t - 1``
``sendrecv`` events of ``b s h / t`` items. The parameter gradients' all-reduce is
``sp.grads``. :func:`traffic` gives this ledger from the sizes alone, with or without sequence
parallelism.

Sequence parallelism (``sequence_parallel=True``; Korthikanti et al. 2022, section 4.2.2)
----------------------------------------------------------------------------------------
Between the pieces, rank ``r`` of the group of ``t = p`` holds only its slice of the
sequence, x (B, T/t, h) with positions ``[r T/t, (r+1) T/t)``
(:func:`activation_shape`); ``T`` must be divisible by t (:func:`check`). The
LayerNorms, the residual adds and the biases after the row-parallel linears run on
the slice. The all-reduces of the 1D scheme are split into their two ring halves
(:func:`~summasim.algorithms.allreduce.ring_reduce_scatter`,
:func:`~summasim.algorithms.allreduce.ring_allgather`), the conjugate pair of
Korthikanti's Figures 5-6:

* ``g`` (before the column-parallel QKV and fc; :func:`seq_allgather`): all-gather of
  the LayerNorm output along the sequence; backward a reduce-scatter of the partial
  input gradient (Megatron's ``gather_from_sequence_parallel_region``).
* ``g-bar`` (after the row-parallel projections; :func:`seq_reduce_scatter`): a
  reduce-scatter of the partial sums in place of ``g``'s all-reduce, each rank keeping
  its slice's sum; backward an all-gather (``reduce_scatter_to_sequence_parallel_region``).
* The embedding's masked lookup is reduce-scattered in place of its all-reduce, the
  positions ``wpe[r T/t : (r+1) T/t]`` added to the slice; its backward all-gathers the
  gradient (the masked scatter-add needs every position of the sequence), and ``wpe``'s
  gradient comes from the gathered gradient, replicated, with no further message.
* The head all-gathers the final LayerNorm's output before the vocabulary-parallel
  logits; its backward reduce-scatters the LM head's partial input gradient in place of
  today's all-reduce. The replicated classifier's input gradient is identical on every
  rank, so there it is split, not summed (Megatron's ``tensor_parallel_output_grad=False``).

A ring all-reduce is exactly its reduce-scatter and all-gather, so a layer sends what
it sent before: forward 2 all-gathers + 2 reduce-scatters of ``b s h`` items, ``t-1``
ring steps each of ``b s h / t`` items, ``4 (t-1)/t b s h`` in all (Optimus Table 1's
forward entry); backward the same, mirrored, plus the recomputed forward's with
checkpointing. What is new is one all-reduce per backward of the gradients of the
replicated parameters that act on the slice (:func:`sequence_parallel_keys`: per layer
``ln1.g/b``, ``attn.proj.b``, ``ln2.g/b``, ``mlp.proj.b``, then ``lnf.g/b``), which each
rank has summed over its own positions only (:func:`allreduce_sequence_parallel_grads`,
phase ``sp.grads``, as Megatron-LM's ``finalize_model_grads`` does once per step).
The pieces return those gradients as partial sums; :func:`backward` all-reduces them.

Memory layout. The ring halves move contiguous chunks, so every gathered or scattered
buffer is sequence-major, (T, B, h) (Megatron keeps activations as [s, b, h] for this
reason), and in *ring order*: chunk ``k`` of t holds the slice of rank ``(k - 1) mod t``,
because a ring reduce-scatter leaves chunk ``(r + 1) mod t`` summed on rank ``r`` and
its all-gather takes that chunk from it. The position-wise work needs no other order:
the MLP (fc, GELU, proj) and the embedding lookup (on ring-ordered token ids, which
cost no copy of activations) run on the ring-ordered buffers as they are. Attention
mixes positions and ``ops.attention_forward`` takes (B, T, h): its gathered input is
copied into sequence order (B, T, h) and its partial output back into ring order, one
transposing copy of ``b s h`` items per collective, forward and backward (4 per layer;
:func:`_batch_major_from_ring`, :func:`_to_ring`). The head gathers into a buffer one
chunk longer, so one copy of ``b s h / t`` puts it in sequence order (the logits stay
``(B, T, v/t)``, a view); its backward copies ``b s h`` once into ring order.
The copies move whole rows of h items: measured on one rank of the 2-core CPU machine
while other work ran (b = 4, s = 256, h = 512, float32), 0.07-0.13 ms each, the four
of a layer 0.1% of its forward and backward (350-470 ms; one [b s, h] x [h, h] GEMM
6.4 ms).

Activation memory per layer (Korthikanti et al., Table 2, bytes with 16-bit activations
and 1-byte dropout masks): ``s b h (34 + 5 a s / h)`` without parallelism, ``s b h (10 +
24/t + 5 a s / (h t))`` with tensor parallelism, ``s b h (34/t + 5 a s / (h t))`` with
sequence parallelism, counting the gathered LayerNorm outputs as their ``1/t`` slices
(Megatron stores the slice and all-gathers it again in the backward). summasim has no
dropout and keeps the gathered LayerNorm outputs, so no extra all-gather is needed;
its caches hold, in elements (:func:`activation_items`, checked against the caches):

* tensor parallel: ``b s h (4 + (5 + 2 f) / t) + a b s^2 / t + 2 b s``;
* sequence parallel: ``b s h (2 + (7 + 2 f) / t) + a b s^2 / t + 2 b s / t``,

(``f`` the MLP multiplier: ``b s h (2 + 15/t)`` at f = 4) and with full recompute only
the layer input: ``b s h``, or ``b s h / t`` with sequence parallelism. The variants
change the per-rank terms only (:func:`activation_items`).

Local parameters
----------------
The serial names, with local shapes (``f = ffn_width``, ``W = h + 2 kv_width``):
``wte [v/p, h]`` (rows), ``wpe [s, h]`` (replicated), per layer ``attn.qkv.w [h, W/p]``,
``attn.qkv.b [W/p]`` (heads), ``attn.proj.w [h/p, h]`` (rows), ``mlp.fc.w [h, f/p]``,
``mlp.fc.b [f/p]`` (columns; SwiGLU's ``mlp.gate.w/b`` the same), ``mlp.proj.w [f/p, h]``
(rows); ``head.w [h, v/p]`` (columns; untied head); ``ln*.g/b``, ``attn.proj.b``,
``mlp.proj.b``, ``lnf.g/b`` and ``cls.w/b`` replicated. :func:`param_layout` and
:func:`local_param_shapes` list them. ``/p`` is exact when p divides; otherwise the
heads (key/value head groups, :func:`head_range`) and the MLP columns are cut by the
balanced partition (the first ``n mod p`` ranks hold one more; every rank needs one),
so the ranks' shapes differ, and the vocabulary is padded to a multiple of p.

Model variants, recompute and attention
---------------------------------------
SwiGLU (``mlp="swiglu"``): ``mlp.gate`` is split like ``mlp.fc`` (columns ``[r f/p,
(r+1) f/p)`` of both), so ``silu(gate_r) * up_r`` is the serial gating's columns on
rank r and ``mlp.proj``'s row block r consumes them; the gate's input gradient is added
to fc's before the one ``f`` all-reduce (reduce-scatter with sequence parallelism), as
both read the same replicated input. No collective is added.

Grouped-query attention (``kv_heads < heads``): the kv groups (a key/value head and the
``g = n / kv`` query heads that read it) are cut by the balanced partition
(:func:`head_range`; at least one group per rank, :func:`check`): rank r holds kv heads
``[lo_r, hi_r)`` and query heads ``[g lo_r, g hi_r)`` and runs the core with those. The
grouping is kept: serially query head i reads kv head ``i // g``; on rank r local query
head j (global ``i = g lo_r + j``) reads local kv head ``j // g``, which is global
``lo_r + j // g = (g lo_r + j) // g = i // g``. Cutting the query heads by any other
partition (e.g. their own balanced one) would pair query heads with another group's keys.
The traffic is unchanged (QKV's input gradient is still ``b s h``).

Untied head (``tied=False``): see the vocabulary parallelism above; its traffic is the
tied head's. :func:`stage_keys` gives the last pipeline stage ``head.w`` (no ``wte``).

Recompute and attention (``forward``/``layer_forward`` keywords, as ``model.forward``):
``recompute="full"`` is ``checkpoint=True`` (the layer's forward, collectives included,
again in the backward: ``tp.recompute.*``); ``"selective"`` keeps q, k, v and y of each
rank's heads and recomputes the (T, T) probabilities locally in the backward;
``attention="flash"`` runs the blockwise core on each rank's heads (with sequence
parallelism on the gathered sequence, as plain attention does). Neither sends anything:
the ledger is the same as without them, and the gradients do not depend on
``recompute`` (bitwise on each rank).

Pieces
------
:func:`forward` is :func:`embed_forward`, :func:`layer_forward` for every layer and
:func:`head_forward` in a row after its checks; :func:`backward` is their backwards in
reverse, adding the embedding's (:func:`embed_backward`) and the LM head's
(:func:`head_backward`) parts of the tied ``wte`` gradient. A pipeline / ZeRO engine
calls the pieces itself (they neither check nor agree). Between pieces the activation is
x (B, T, h), replicated, or with ``sequence_parallel`` this rank's slice (B, T/t, h)
(:func:`activation_shape`). :func:`stage_keys` (``model.stage_keys``) lists a stage's
parameters.

References
----------
Shoeybi, Patwary, Puri, LeGresley, Casper, Catanzaro (2019), "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", arXiv:1909.08053,
section 3 (f and g, Figures 3-4). Xu, Li, Gong, You (2021), "An Efficient 2D Method
for Training Super-Large Deep Learning Models" (Optimus), Table 1. Korthikanti, Casper,
Lym, McAfee, Andersch, Shoeybi, Catanzaro (2022), "Reducing Activation Recomputation in
Large Transformer Models", arXiv:2205.05198, section 4.2.2 (Figures 5-6) and Table 2.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from summasim import layout
from summasim.algorithms.allreduce import ring_allgather_unchecked, ring_reduce_scatter_unchecked
from summasim.backends import array_module
from summasim.mpiutil import agree, fields_of, fingerprint, local_error

from summasim.spec import ATTENTIONS, block_range, positive_int, vocab_block  # noqa: F401

from . import model, ops
from .model import Config

# How each parameter is split over the group: "row" (axis 0), "col" (last axis),
# "qkv" (the Q, K and V columns of this rank's query and key/value heads) or "replicated".
_LAYER_LAYOUT = {"ln1.g": "replicated", "ln1.b": "replicated",
                 "attn.qkv.w": "qkv", "attn.qkv.b": "qkv",
                 "attn.proj.w": "row", "attn.proj.b": "replicated",
                 "ln2.g": "replicated", "ln2.b": "replicated",
                 "mlp.fc.w": "col", "mlp.fc.b": "col",
                 "mlp.gate.w": "col", "mlp.gate.b": "col",     # SwiGLU's gate, like fc
                 "mlp.proj.w": "row", "mlp.proj.b": "replicated"}


# --------------------------------------------------------------------------- #
# layouts and checks (no communication)                                       #
# --------------------------------------------------------------------------- #
def param_layout(config: Config) -> dict:
    """``{name: "row" | "col" | "qkv" | "replicated"}`` in the order of ``model.param_shapes``."""
    out = {}
    for name in model.param_shapes(config):
        if name == "wte":
            out[name] = "row"
        elif name == "head.w":     # the untied LM head [h, v]: vocabulary columns
            out[name] = "col"
        elif name.startswith("h") and "." in name and name.split(".", 1)[1] in _LAYER_LAYOUT:
            out[name] = _LAYER_LAYOUT[name.split(".", 1)[1]]
        else:   # wpe, lnf.g, lnf.b, cls.w, cls.b
            out[name] = "replicated"
    return out


def head_range(config: Config, p: int, rank: int) -> tuple:
    """``((q_lo, q_hi), (kv_lo, kv_hi))``: the query heads and key/value heads rank
    ``rank`` of ``p`` holds. The ``kv_heads`` groups (a key/value head and the ``g =
    heads / kv_heads`` query heads that read it; g = 1 without grouped-query attention)
    are cut by the balanced partition (the first ``kv_heads mod p`` ranks hold one group
    more), so a rank's query heads read only its own key/value heads. Pure."""
    lo, hi = block_range(config.kv_heads, p, rank)
    g = config.heads // config.kv_heads
    return (g * lo, g * hi), (lo, hi)


def _axis_range(name: str, config: Config, p: int, rank: int) -> tuple:
    """``(lo, hi, block)`` of rank ``rank``'s slice of ``name``'s split axis: the
    vocabulary (``wte`` rows, ``head.w`` columns) in padded blocks of
    :func:`vocab_block` ids (``block`` the padded size), ``attn.proj.w``'s rows those
    of its heads, the MLP's columns / rows the balanced partition of its width."""
    if name in ("wte", "head.w"):
        n = vocab_block(config.vocab, p)
        return min(rank * n, config.vocab), min((rank + 1) * n, config.vocab), n
    if name.endswith("attn.proj.w"):
        (lo, hi), _ = head_range(config, p, rank)
        hd = config.hidden // config.heads
        return lo * hd, hi * hd, (hi - lo) * hd
    lo, hi = block_range(config.ffn, p, rank)
    return lo, hi, hi - lo


def _qkv_sections(config: Config, p: int, rank: int = 0) -> tuple:
    """``(q, kv)``: rank ``rank``'s Q columns and K (= V) columns of its
    ``[Q_r | K_r | V_r]`` QKV block (its heads' columns)."""
    (q_lo, q_hi), (kv_lo, kv_hi) = head_range(config, p, rank)
    hd = config.hidden // config.heads
    return (q_hi - q_lo) * hd, (kv_hi - kv_lo) * hd


def _local_shape(name: str, shape: tuple, kind: str, config: Config, p: int,
                 rank: int) -> tuple:
    if kind == "replicated":
        return tuple(shape)
    if kind == "qkv":
        cq, ck = _qkv_sections(config, p, rank)
        return tuple(shape[:-1]) + (cq + 2 * ck,)
    n = _axis_range(name, config, p, rank)[2]
    if kind == "row":
        return (n,) + tuple(shape[1:])
    return tuple(shape[:-1]) + (n,)                      # "col"


def local_param_shapes(config: Config, p: int, rank: int = 0) -> dict:
    """``{name: local shape}`` on rank ``rank`` of ``p`` (see the module docstring;
    the ranks' shapes differ where p does not divide the heads or the MLP width)."""
    kinds = param_layout(config)
    return {name: _local_shape(name, shape, kinds[name], config, p, rank)
            for name, shape in model.param_shapes(config).items()}


def _check_grid(grid) -> None:
    if not (hasattr(grid, "comm") and hasattr(grid, "p") and hasattr(grid, "rank")
            and hasattr(grid, "trace")):
        raise TypeError(f"megatron needs a Grid1D (summasim.grid.Grid1D(comm)), got "
                        f"{type(grid).__name__}")


def check(config: Config, grid, *, seq: Optional[int] = None,
          sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` (on every rank, without communicating) unless ``config``
    can be split over ``grid.p`` ranks: at least one key/value head (one head without
    grouped-query attention) and one MLP column per rank; the heads and the MLP width
    need not divide (:func:`head_range`, the balanced partition), and any vocabulary is
    padded to a multiple of p (:func:`vocab_block`); with ``sequence_parallel``, also
    the sequence length ``seq`` (default ``config.seq``: pass the micro-batch's T),
    since each rank holds T/p positions. (The same list as
    :meth:`summasim.spec.TensorGrid.divisors` for a 1D grid, phrased for the runtime.)
    """
    _check_grid(grid)
    model.need_config(config)
    p = grid.p
    heads = "heads" if config.kv_heads == config.heads else "kv_heads"
    why = {heads: "every rank holds at least one whole head" + (
               "" if heads == "heads" else " of keys and values and its query heads"),
           "ffn": "every rank holds at least one of the MLP's fc (and gate) columns"}
    sizes = {heads: config.kv_heads, "ffn": config.ffn}
    bad = [f"Config.{dim} = {size} is smaller than p = {p} ({why[dim]})"
           for dim, size in sizes.items() if size < p]
    if sequence_parallel:
        t = config.seq if seq is None else seq
        if t % p:
            bad.append(f"the sequence length T = {t} is not divisible by p = {p} (sequence "
                       f"parallelism: each rank holds T/p positions between the pieces)")
    if bad:
        raise ValueError("Megatron 1D: " + "; ".join(bad))


def _check_arrays(arrays, shapes: dict, dtype, what: str) -> None:
    if not isinstance(arrays, dict):
        raise TypeError(f"{what} must be a dict of arrays, got {type(arrays).__name__}")
    missing = [k for k in shapes if k not in arrays]
    extra = [k for k in arrays if k not in shapes]
    if missing or extra:
        raise ValueError(f"{what} do not match the config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for name, shape in shapes.items():
        arr = arrays[name]
        if tuple(getattr(arr, "shape", ())) != shape or getattr(arr, "dtype", None) != dtype:
            raise ValueError(f"{what}[{name!r}] is {tuple(getattr(arr, 'shape', ()))} "
                             f"{getattr(arr, 'dtype', None)}, expected {shape} {dtype}")


def check_local_params(local_params: dict, config: Config, grid) -> None:
    """Raise ``ValueError`` unless ``local_params`` has this scheme's names, local shapes, dtype."""
    _check_arrays(local_params, local_param_shapes(config, grid.p, grid.rank), config.dtype,
                  f"local params (p = {grid.p}, rank {grid.rank})")


# --------------------------------------------------------------------------- #
# the collectives                                                             #
# --------------------------------------------------------------------------- #
# Megatron-core's mappings.py, one function per direction: f =
# copy_to_tensor_model_parallel_region, g = reduce_from_tensor_model_parallel_region.
# Each skips the work on a group of one, so p == 1 runs the same code and sends nothing.
def f_forward(x, grid):
    """f, forward: identity (backward: all-reduce over ``grid.comm``, :func:`f_backward`)."""
    return x


def f_backward(dx, grid):
    """f, backward: all-reduce of the partial ``dx`` in place over ``grid.comm``
    (forward: identity, :func:`f_forward`)."""
    if grid.p == 1:
        return dx
    return ops.stored(grid.comm.allreduce(dx))      # a 16-bit sum under autocast


def g_forward(x, grid):
    """g, forward: all-reduce of the partial ``x`` in place over ``grid.comm``
    (backward: identity, :func:`g_backward`)."""
    if grid.p == 1:
        return x
    return ops.stored(grid.comm.allreduce(x))       # a 16-bit sum under autocast


def g_backward(dx, grid):
    """g, backward: identity (forward: all-reduce over ``grid.comm``, :func:`g_forward`)."""
    return dx


def vocab_reduce_forward(x, grid, op: str = "sum"):
    """Vocab-parallel cross-entropy statistic, forward: all-reduce (``op`` "max" or
    "sum") in place over ``grid.comm`` (backward: none; as in Megatron's
    ``_VocabParallelCrossEntropy``, each shard's logit gradient is local)."""
    if grid.p == 1:
        return x
    return grid.comm.allreduce(x, op=op)


def _vocab_hooks(grid):
    """``(combine_vocab, max_vocab, sum_vocab)`` for the ops: local reduction, then an
    all-reduce over the group, each tagged with its "aux." sub-phase."""
    trace = grid.trace

    def combine_vocab(x):          # (B, T, h) masked lookup -> full lookup
        with trace.phase("aux.vocab"):
            return g_forward(x, grid)      # g: all-reduce (backward: g_backward, identity)

    def max_vocab(a):              # (N, v/p) -> (N, 1)
        m = ops.local_max(a)
        with trace.phase("aux.max"):
            return vocab_reduce_forward(m, grid, "max")    # backward: none (local)

    def sum_vocab(a):              # (N, k) -> (N, 1)
        s = ops.local_sum(a)
        with trace.phase("aux.sum"):
            return vocab_reduce_forward(s, grid)           # backward: none (local)

    return combine_vocab, max_vocab, sum_vocab


# --------------------------------------------------------------------------- #
# sequence parallelism: Korthikanti's g and g-bar as the two ring halves       #
# --------------------------------------------------------------------------- #
# Every buffer a ring half moves is sequence-major, (T, B, h), and in ring order: chunk
# k of p holds the slice of rank (k - 1) mod p, because the ring reduce-scatter leaves
# chunk (r + 1) mod p summed on rank r and the ring all-gather takes that chunk from it
# (summasim.algorithms.allreduce). Each helper skips the ring on a group of one.
def _ring_chunk(grid) -> int:
    """The chunk of a ring buffer this rank owns: ``(rank + 1) % p``."""
    return (grid.rank + 1) % grid.p


def seq_allgather(x, grid, ordered: bool = False):
    """Korthikanti's ``g`` with sequence parallelism, forward: all-gather of the
    sequence slices over ``grid.comm`` (a ring all-gather, ``p - 1`` traced steps of
    ``B T h / p`` items; backward: :func:`seq_reduce_scatter` of the partial gradient).

    ``x`` (B, T/p, h), this rank's positions ``[r T/p, (r+1) T/p)``, any strides.
    Returns a fresh sequence-major (T, B, h) array of every rank's slice, in ring
    order (chunk ``k`` holds rank ``(k - 1) mod p``'s slice), or with ``ordered`` in
    sequence order: a view of a buffer one chunk longer, where the ring leaves slice
    ``p - 1`` in chunk 0 and one copy of ``B T h / p`` items puts it after slice ``p - 2``.
    """
    xp = array_module(x)
    b, c, h = x.shape
    p = grid.p
    t = c * p
    extra = c if ordered and p > 1 else 0
    buf = xp.empty((t + extra, b, h), dtype=x.dtype)   # (T [+ T/p], B, h) sequence-major
    k = _ring_chunk(grid)
    buf[k * c:(k + 1) * c] = x.transpose(1, 0, 2)      # this rank's slice as (T/p, B, h)
    ring_allgather_unchecked(buf[:t].reshape(-1), grid.comm)
    if not extra:
        return buf                                     # (T, B, h) ring order
    buf[t:] = buf[:c]                                  # slice p-1 after slice p-2
    return buf[c:]                                     # (T, B, h) sequence order, a view


def seq_reduce_scatter(buf, grid):
    """Korthikanti's ``g-bar``, forward: reduce-scatter of partial sums along the
    sequence, in place on ``buf`` (a ring reduce-scatter, ``p - 1`` traced steps of
    ``B T h / p`` items; backward: :func:`seq_allgather`).

    ``buf``: C-contiguous sequence-major (T, B, h) in ring order (:func:`_to_ring`,
    :func:`seq_allgather`, or a position-wise op applied to one). Returns this rank's
    slice of the sum, positions ``[r T/p, (r+1) T/p)``, as a (B, T/p, h) view of ``buf``.
    """
    if not buf.flags.c_contiguous:
        raise ValueError("seq_reduce_scatter: the ring works in place on a C-contiguous "
                         f"(T, B, h) buffer, got strides {buf.strides}")
    c = buf.shape[0] // grid.p
    k = ring_reduce_scatter_unchecked(buf.reshape(-1), grid.comm)   # (r + 1) % p: summed
    ops.stored(buf[k * c:(k + 1) * c])                 # a 16-bit sum under autocast
    return buf[k * c:(k + 1) * c].transpose(1, 0, 2)   # (B, T/p, h) view


def _to_ring(a, p: int, seq_axis: int):
    """A fresh C-contiguous sequence-major copy of ``a`` in ring order (the layout
    :func:`seq_reduce_scatter` takes): ``a`` is (B, T, ...) (``seq_axis`` 1) or
    (T, B, ...) (``seq_axis`` 0) in sequence order. Slices ``0 .. p-2`` go to chunks
    ``1 .. p-1`` and slice ``p - 1`` to chunk 0: two block copies, transposing when
    ``seq_axis`` is 1 (then one pass over ``B T h`` items in rows of h, the copy that a
    batch-major op such as ``ops.attention_forward`` costs; measured in the module
    docstring)."""
    xp = array_module(a)
    s = a if seq_axis == 0 else xp.swapaxes(a, 0, 1)   # (T, B, ...) view
    t = s.shape[0]
    c = t // p
    out = xp.empty(s.shape, dtype=a.dtype)             # (T, B, ...) ring order
    out[c:] = s[:t - c]                                # slices 0 .. p-2 -> chunks 1 .. p-1
    out[:c] = s[t - c:]                                # slice p-1 -> chunk 0
    return out


def _batch_major_from_ring(buf, p: int):
    """A fresh C-contiguous (B, T, h) in sequence order from the ring-ordered (T, B, h)
    ``buf``: the inverse of :func:`_to_ring` with ``seq_axis`` 1 (one transposing pass)."""
    xp = array_module(buf)
    t, b, h = buf.shape
    c = t // p
    out = xp.empty((b, t, h), dtype=buf.dtype)         # (B, T, h)
    seq = out.transpose(1, 0, 2)                       # (T, B, h) view
    seq[:t - c] = buf[c:]                              # chunks 1 .. p-1 are slices 0 .. p-2
    seq[t - c:] = buf[:c]                              # chunk 0 is slice p-1
    return out


def _added(view, bias):
    """A fresh C-contiguous ``view + bias`` (a reduce-scattered slice plus its bias,
    the bias once, after the reduction)."""
    xp = array_module(view)
    out = xp.empty(view.shape, dtype=view.dtype)       # (B, T/p, h)
    xp.add(view, bias, out=out)
    return out


SP_LAYER_KEYS = ("ln1.g", "ln1.b", "attn.proj.b", "ln2.g", "ln2.b", "mlp.proj.b")


def sequence_parallel_keys(config: Config, keys=None) -> list:
    """The parameters whose gradients a sequence-parallel backward leaves as partial
    sums over the sequence slices: the replicated parameters that act on the slice,
    per layer ``ln1.g``, ``ln1.b``, ``attn.proj.b``, ``ln2.g``, ``ln2.b``,
    ``mlp.proj.b``, then ``lnf.g``, ``lnf.b`` (in ``model.param_shapes`` order; only
    those in ``keys`` when given, e.g. a pipeline stage's). ``wpe`` and ``cls.*`` are not
    among them: they are computed from gathered, replicated data."""
    wanted = None if keys is None else set(keys)
    out = []
    for name in model.param_shapes(config):
        leaf = name.split(".", 1)[1] if name.startswith("h") and "." in name else name
        if (leaf in SP_LAYER_KEYS and name != leaf) or name in ("lnf.g", "lnf.b"):
            if wanted is None or name in wanted:
                out.append(name)
    return out


def allreduce_sequence_parallel_grads(grads: dict, config: Config, grid) -> dict:
    """Sum, in place over ``grid.comm``, the gradients of :func:`sequence_parallel_keys`
    present in ``grads``: one all-reduce of all of them packed (phase ``sp.grads``;
    nothing on a group of one). Call it once per step, after the micro-batches'
    gradients are accumulated (it is linear), as Megatron-LM's ``finalize_model_grads``
    does for its sequence-parallel parameters. Returns ``grads``."""
    keys = [k for k in sequence_parallel_keys(config) if k in grads]
    if grid.p == 1 or not keys:
        return grads
    xp = array_module(grads[keys[0]])
    sizes = [grads[k].size for k in keys]
    buf = xp.empty(sum(sizes), dtype=grads[keys[0]].dtype)    # (n,) packed
    off = 0
    for k, n in zip(keys, sizes):
        buf[off:off + n] = grads[k].reshape(-1)
        off += n
    with grid.trace.phase("sp.grads"):
        grid.comm.allreduce(buf)
    off = 0
    for k, n in zip(keys, sizes):
        grads[k][...] = buf[off:off + n].reshape(grads[k].shape)
        off += n
    return grads


# --------------------------------------------------------------------------- #
# shard / unshard                                                             #
# --------------------------------------------------------------------------- #
def _split(a, name: str, kind: str, grid, config: Config):
    """This rank's block of the serial array ``a``: a fresh C-contiguous copy, never a
    view (an in-place optimizer step on the shards must not touch the serial model)."""
    xp = array_module(a)
    r = grid.rank
    if kind in ("row", "col"):
        axis = 0 if kind == "row" else a.ndim - 1
        lo, hi, n = _axis_range(name, config, grid.p, r)
        out = xp.zeros(_local_shape(name, a.shape, kind, config, grid.p, r), dtype=a.dtype)
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(0, hi - lo)                   # a vocabulary block past v: zeros
        src = [slice(None)] * a.ndim
        src[axis] = slice(lo, hi)
        out[tuple(idx)] = a[tuple(src)]
        return out
    if kind == "qkv":
        # [..., Q | K | V] (h + 2 kv_width columns) -> [..., Q_r | K_r | V_r]: the columns
        # of this rank's query heads and of the key/value heads they read
        (q_lo, q_hi), (kv_lo, kv_hi) = head_range(config, grid.p, r)
        hd, h = config.hidden // config.heads, config.hidden
        return xp.concatenate([a[..., q_lo * hd:q_hi * hd],                       # Q_r
                               a[..., h + kv_lo * hd:h + kv_hi * hd],             # K_r
                               a[..., h + config.kv_width + kv_lo * hd:
                                 h + config.kv_width + kv_hi * hd]], axis=-1)     # V_r
    return xp.array(a, copy=True, order="C")


def _assemble(parts, name: str, kind: str, config: Config):
    """The serial array (the vocabulary padded) from every rank's block: ``parts[r]``
    is rank r's block."""
    xp = array_module(parts[0])
    p = len(parts)
    if kind == "row":
        return xp.concatenate(parts, axis=0)
    if kind == "col":
        return xp.concatenate(parts, axis=-1)
    secs = [_qkv_sections(config, p, r) for r in range(p)]                    # qkv
    return xp.concatenate([parts[r][..., :cq] for r, (cq, ck) in enumerate(secs)] +
                          [parts[r][..., cq:cq + ck] for r, (cq, ck) in enumerate(secs)] +
                          [parts[r][..., cq + ck:] for r, (cq, ck) in enumerate(secs)],
                          axis=-1)                                            # (..., h + 2 kvw)


def shard(params: dict, config: Config, grid, keys=None) -> dict:
    """This rank's local parameters from the serial ``params`` (same on every rank).

    Parameters
    ----------
    params : dict
        ``model.init_params(config)``-style serial parameters.
    config : Config
    grid : Grid1D
        The tensor-parallel group.
    keys : iterable of str, optional
        Shard only these keys (e.g. a pipeline stage's); default all of them.

    Returns
    -------
    dict
        The keys, local shapes (:func:`local_param_shapes`), fresh C-contiguous copies
        (never views of ``params``).

    Raises
    ------
    ValueError, TypeError
        On every rank alike when the config does not divide (:func:`check`) or
        ``params`` do not match it on any rank, or the ranks' configs differ: the only
        message is the (untraced) agreement of :func:`summasim.mpiutil.agree`.
    """
    _check_grid(grid)          # not a group: no communicator to agree over, raise alone
    _, err = local_error(lambda: (check(config, grid), model.check_params(params, config)))
    agree("megatron.shard", grid, fields_of(config, "Config"), err)
    wanted = None if keys is None else set(keys)
    return {name: _split(params[name], name, kind, grid, config)
            for name, kind in param_layout(config).items() if wanted is None or name in wanted}


def unshard(local_grads: dict, config: Config, grid) -> dict:
    """Serial-layout gradients (keys and shapes of ``model.init_params``) on every rank.

    One all-gather (phase ``unshard/aux.gather``) of all sharded blocks packed into
    one buffer; replicated gradients are this rank's copy (identical everywhere).
    Nothing is sent when ``p == 1``. Bad ``local_grads`` on any rank, or configs that
    differ, raise on every rank before it (the untraced agreement).
    """
    _check_grid(grid)          # not a group: no communicator to agree over, raise alone

    def local():
        check(config, grid)
        _check_arrays(local_grads, local_param_shapes(config, grid.p, grid.rank),
                      config.dtype, f"local grads (p = {grid.p}, rank {grid.rank})")

    _, err = local_error(local)
    agree("megatron.unshard", grid, fields_of(config, "Config"), err)
    kinds = param_layout(config)
    every = [local_param_shapes(config, grid.p, r) for r in range(grid.p)]
    sharded = [name for name, kind in kinds.items() if kind != "replicated"]
    xp = array_module(local_grads[sharded[0]])
    # each block packed into the room of the largest (rank 0's: the first blocks of a
    # balanced partition are the larger ones)
    sizes = [max(math.prod(shapes[name]) for shapes in every) for name in sharded]
    send = xp.zeros(sum(sizes), dtype=config.dtype)          # (total,) packed blocks
    off = 0
    for name, n in zip(sharded, sizes):
        blk = local_grads[name].reshape(-1)
        send[off:off + blk.size] = blk
        off += n
    if grid.p == 1:
        parts = send[None]                                    # (1, total)
    else:
        parts = xp.empty((grid.p, send.size), dtype=config.dtype)   # (p, total)
        with grid.trace.phase("unshard"), grid.trace.phase("aux.gather"):
            grid.comm.allgather(send, parts)
    out, off = {}, 0
    blocks = dict(zip(sharded, sizes))
    for name, kind in kinds.items():
        if kind == "replicated":
            out[name] = local_grads[name].copy()
            continue
        n = blocks[name]
        pieces = [parts[r, off:off + math.prod(every[r][name])].reshape(every[r][name])
                  for r in range(grid.p)]
        whole = _assemble(pieces, name, kind, config)
        serial = model.param_shapes(config)[name]
        out[name] = whole if whole.shape == serial else xp.ascontiguousarray(
            whole[tuple(slice(0, k) for k in serial)])          # drop the vocabulary pad
        off += n
    return out


# --------------------------------------------------------------------------- #
# one layer                                                                   #
# --------------------------------------------------------------------------- #
def _attention(a, p, config: Config, grid, how: dict):
    """The column-parallel QKV, this rank's heads and the row-parallel proj:
    (B, T, h) -> (B, T, h) partial sum. Rank r holds the query and key/value heads of
    :func:`head_range` (``[r n/p, (r+1) n/p)`` and ``[r kv/p, (r+1) kv/p)`` when p divides
    them); ``how`` carries ``recompute`` ("none"
    or "selective"), ``attention`` and ``tile`` to the core."""
    (q_lo, q_hi), (kv_lo, kv_hi) = head_range(config, grid.p, grid.rank)
    return ops.attention_forward(a, p["attn.qkv.w"], p["attn.qkv.b"], p["attn.proj.w"],
                                 None, q_hi - q_lo, kv_heads=kv_hi - kv_lo, **how)


def _mlp_forward(m, p, config: Config):
    """Column-parallel fc (and SwiGLU's gate), the elementwise activation on the local
    columns, row-parallel proj: (..., h) -> (..., h) partial sum and the caches
    ``(fc, gelu, proj, gate, swiglu)`` (``ops.BlockCache``'s MLP fields)."""
    gelu = gate = swiglu = None
    if config.mlp == "gelu":
        m, fc = ops.linear_forward(m, p["mlp.fc.w"], p["mlp.fc.b"])     # (..., f/p)
        m, gelu = ops.gelu_forward(m)                                    # (..., f/p)
    else:   # SwiGLU: up (fc) and gate, columns [r f/p, (r+1) f/p) of each
        u, fc = ops.linear_forward(m, p["mlp.fc.w"], p["mlp.fc.b"])     # (..., f/p) up
        g, gate = ops.linear_forward(m, p["mlp.gate.w"], p["mlp.gate.b"])  # (..., f/p) gate
        m, swiglu = ops.swiglu_forward(g, u)                             # (..., f/p)
    m, proj = ops.linear_forward(m, p["mlp.proj.w"])                    # (..., h) partial sum
    return m, (fc, gelu, proj, gate, swiglu)


def _mlp_backward(dm, cache: ops.BlockCache, grads: dict):
    """:func:`_mlp_forward` read in reverse from the replicated (or gathered) ``dm``
    (..., h): the MLP's local weight gradients into ``grads`` and the PARTIAL input
    gradient (..., h), which the caller sums over the group (``f``'s conjugate). With
    SwiGLU the gate's input gradient is added to the fc's before that one sum: both
    column-parallel linears read the same replicated input."""
    dm, g = ops.linear_backward(dm, cache.proj)                          # (..., f/p)
    grads["mlp.proj.w"] = g["w"]                                         # (f/p, h)
    if cache.swiglu is None:
        dm, _ = ops.gelu_backward(dm, cache.gelu)                        # (..., f/p)
        dm, g = ops.linear_backward(dm, cache.fc)                        # (..., h) partial sum
        grads["mlp.fc.w"], grads["mlp.fc.b"] = g["w"], g["b"]            # (h, f/p), (f/p,)
        return dm
    (dgate, dup), _ = ops.swiglu_backward(dm, cache.swiglu)              # 2 x (..., f/p)
    dm, g = ops.linear_backward(dup, cache.fc)                           # (..., h) partial sum
    grads["mlp.fc.w"], grads["mlp.fc.b"] = g["w"], g["b"]                # (h, f/p), (f/p,)
    dgx, g = ops.linear_backward(dgate, cache.gate)                      # (..., h) partial sum
    grads["mlp.gate.w"], grads["mlp.gate.b"] = g["w"], g["b"]            # (h, f/p), (f/p,)
    dm += dgx                      # the gate's part joins the fc's before the f all-reduce
    return dm


def _block_cache(ln1, attn, ln2, mlp) -> ops.BlockCache:
    fc, gelu, proj, gate, swiglu = mlp
    return ops.BlockCache(ln1=ln1, attn=attn, ln2=ln2, fc=fc, gelu=gelu, proj=proj,
                          gate=gate, swiglu=swiglu)


def _block_keys(cache: ops.BlockCache) -> tuple:
    """The layer's keys (``ops.block_keys``) of the MLP the cache ran."""
    return ops.block_keys("gelu" if cache.swiglu is None else "swiglu")


def _block_forward(x, p, config: Config, grid, rerun: bool = False, how: Optional[dict] = None):
    """One pre-LayerNorm layer on local weights, (B, T, h) -> (B, T, h), replicated in
    and out. ``rerun`` only renames the phases (the recomputed forward of
    ``recompute="full"``); ``how``: the core's ``recompute``, ``attention``, ``tile``."""
    trace = grid.trace
    tag = "tp.recompute." if rerun else "tp."
    a, ln1 = ops.layernorm_forward(x, p["ln1.g"], p["ln1.b"])            # (B, T, h) replicated
    a = f_forward(a, grid)         # f: identity (backward: f_backward, all-reduce)
    a, attn = _attention(a, p, config, grid, how or {})                 # (B, T, h) partial sum
    with trace.phase(tag + "attn.proj"):
        g_forward(a, grid)         # g: all-reduce (backward: g_backward, identity)
    a += p["attn.proj.b"]                               # bias once, after the reduction
    a += x                                              # residual 1
    m, ln2 = ops.layernorm_forward(a, p["ln2.g"], p["ln2.b"])            # (B, T, h) replicated
    m = f_forward(m, grid)         # f: identity (backward: f_backward, all-reduce)
    m, mlp = _mlp_forward(m, p, config)                                  # (B, T, h) partial sum
    with trace.phase(tag + "mlp.proj"):
        g_forward(m, grid)         # g: all-reduce (backward: g_backward, identity)
    m += p["mlp.proj.b"]                                # bias once, after the reduction
    m += a                                              # residual 2
    return m, _block_cache(ln1, attn, ln2, mlp)


def _block_backward(dout, cache: ops.BlockCache, grid):
    """The layer read in reverse: ``dx`` (B, T, h) replicated and local grads
    (``ops.block_keys`` of its MLP)."""
    trace = grid.trace
    h = dout.shape[-1]
    grads = {}
    # g (mlp.proj), backward: identity (forward: g_forward, all-reduce); dout is
    # replicated and feeds every rank's row block as is
    dm = g_backward(dout, grid)                                          # (B, T, h)
    grads["mlp.proj.b"] = dout.reshape(-1, h).sum(axis=0)               # (h,) replicated
    dm = _mlp_backward(dm, cache, grads)                                 # (B, T, h) partial sum
    with trace.phase("tp.mlp.fc"):
        f_backward(dm, grid)       # f: all-reduce (forward: f_forward, identity)
    dx1, g = ops.layernorm_backward(dm, cache.ln2)                       # (B, T, h)
    grads["ln2.g"], grads["ln2.b"] = g["g"], g["b"]
    dx1 += dout                                         # residual 2
    grads["attn.proj.b"] = dx1.reshape(-1, h).sum(axis=0)               # (h,) replicated
    da = g_backward(dx1, grid)     # g (attn.proj): identity (forward: g_forward, all-reduce)
    da, g = ops.attention_backward(da, cache.attn)                       # (B, T, h) partial sum
    grads["attn.qkv.w"], grads["attn.qkv.b"] = g["qkv.w"], g["qkv.b"]    # (h, W/p), (W/p,)
    grads["attn.proj.w"] = g["proj.w"]                                   # (h/p, h)
    with trace.phase("tp.attn.qkv"):
        f_backward(da, grid)       # f: all-reduce (forward: f_forward, identity)
    dx, g = ops.layernorm_backward(da, cache.ln1)                        # (B, T, h)
    grads["ln1.g"], grads["ln1.b"] = g["g"], g["b"]
    dx += dx1                                           # residual 1
    return dx, {key: grads[key] for key in _block_keys(cache)}


def _block_forward_sp(x, p, config: Config, grid, rerun: bool = False,
                      how: Optional[dict] = None):
    """One layer with sequence parallelism: x (B, T/p, h), this rank's slice, ->
    (B, T/p, h) slice (Korthikanti et al. 2022, Figure 6). ``rerun`` and ``how`` as in
    :func:`_block_forward`."""
    trace = grid.trace
    tag = "tp.recompute." if rerun else "tp."
    a, ln1 = ops.layernorm_forward(x, p["ln1.g"], p["ln1.b"])            # (B, T/p, h) slice
    with trace.phase(tag + "sp.attn.qkv"):
        a = seq_allgather(a, grid)   # g: all-gather (backward: reduce-scatter) (T, B, h) ring
    a = _batch_major_from_ring(a, grid.p)              # (B, T, h) sequence order: a copy
    a, attn = _attention(a, p, config, grid, how or {})                 # (B, T, h) partial sum
    a = _to_ring(a, grid.p, seq_axis=1)                # (T, B, h) ring order: a copy
    with trace.phase(tag + "attn.proj"):
        a = seq_reduce_scatter(a, grid)   # g-bar: reduce-scatter (backward: all-gather)
    a = _added(a, p["attn.proj.b"])                    # (B, T/p, h); bias once, after it
    a += x                                             # residual 1
    m, ln2 = ops.layernorm_forward(a, p["ln2.g"], p["ln2.b"])            # (B, T/p, h) slice
    with trace.phase(tag + "sp.mlp.fc"):
        m = seq_allgather(m, grid)   # g: all-gather (backward: reduce-scatter) (T, B, h) ring
    # the MLP is position-wise: it runs on the ring-ordered rows as they are
    m, mlp = _mlp_forward(m, p, config)                                  # (T, B, h) partial sum
    with trace.phase(tag + "mlp.proj"):
        m = seq_reduce_scatter(m, grid)   # g-bar: reduce-scatter (backward: all-gather)
    m = _added(m, p["mlp.proj.b"])                     # (B, T/p, h); bias once, after it
    m += a                                             # residual 2
    return m, _block_cache(ln1, attn, ln2, mlp)


def _block_backward_sp(dout, cache: ops.BlockCache, grid):
    """:func:`_block_forward_sp` read in reverse: ``dx`` (B, T/p, h) slice and local grads
    (``ops.block_keys`` of its MLP); those of :data:`SP_LAYER_KEYS` are this slice's
    partial sums."""
    trace = grid.trace
    xp = array_module(dout)
    h = dout.shape[-1]
    grads = {}
    grads["mlp.proj.b"] = dout.reshape(-1, h).sum(axis=0)               # (h,) this slice's
    with trace.phase("tp.sp.mlp.proj"):
        dm = seq_allgather(dout, grid)   # g-bar, backward: all-gather (T, B, h) ring order
    dm = _mlp_backward(dm, cache, grads)                                 # (T, B, h) partial sum
    with trace.phase("tp.mlp.fc"):
        dm = seq_reduce_scatter(dm, grid)   # g, backward: reduce-scatter (B, T/p, h) view
    dx1, g = ops.layernorm_backward(xp.ascontiguousarray(dm), cache.ln2)  # (B, T/p, h)
    grads["ln2.g"], grads["ln2.b"] = g["g"], g["b"]                      # this slice's
    dx1 += dout                                        # residual 2
    grads["attn.proj.b"] = dx1.reshape(-1, h).sum(axis=0)               # (h,) this slice's
    with trace.phase("tp.sp.attn.proj"):
        da = seq_allgather(dx1, grid)    # g-bar, backward: all-gather (T, B, h) ring order
    da = _batch_major_from_ring(da, grid.p)            # (B, T, h) sequence order: a copy
    da, g = ops.attention_backward(da, cache.attn)                       # (B, T, h) partial sum
    grads["attn.qkv.w"], grads["attn.qkv.b"] = g["qkv.w"], g["qkv.b"]    # (h, W/p), (W/p,)
    grads["attn.proj.w"] = g["proj.w"]                                   # (h/p, h)
    da = _to_ring(da, grid.p, seq_axis=1)              # (T, B, h) ring order: a copy
    with trace.phase("tp.attn.qkv"):
        da = seq_reduce_scatter(da, grid)   # g, backward: reduce-scatter (B, T/p, h) view
    dx, g = ops.layernorm_backward(xp.ascontiguousarray(da), cache.ln1)  # (B, T/p, h)
    grads["ln1.g"], grads["ln1.b"] = g["g"], g["b"]                      # this slice's
    dx += dx1                                          # residual 1
    return dx, {key: grads[key] for key in _block_keys(cache)}


# --------------------------------------------------------------------------- #
# the pieces: embedding, one layer, head (unchecked; the engine checks once)  #
# --------------------------------------------------------------------------- #
class EmbedCache(NamedTuple):
    grid: Any
    emb: ops.EmbeddingCache      # masked lookup of this rank's vocabulary rows
    sequence_parallel: bool = False   # the lookup ran on ring-ordered (T, B) ids
    wpe_shape: Optional[tuple] = None  # (s, h), for wpe's gradient (sequence parallel)


def _check_seq(tokens, grid) -> None:
    """The pieces' one check under sequence parallelism: T divisible by p (local, before
    any message; the tokens are the same on every rank)."""
    if tokens.shape[1] % grid.p:
        raise ValueError(f"Megatron 1D: the sequence length T = {tokens.shape[1]} is not "
                         f"divisible by p = {grid.p} (sequence parallelism: each rank "
                         f"holds T/p positions between the pieces)")


def embed_forward(p: dict, tokens, config: Config, grid, sequence_parallel: bool = False):
    """x (B, T, h) replicated = wte[tokens] + wpe[:T] on the global micro-batch ``tokens``.

    ``p`` needs ``wte`` (this rank's rows) and ``wpe``. One all-reduce of the masked
    lookup (phase ``embed.fwd/aux.vocab``). With ``sequence_parallel`` it is a
    reduce-scatter instead and the result this rank's slice x (B, T/p, h) =
    (wte[tokens] + wpe[:T])[:, r T/p : (r+1) T/p]: the lookup runs on the token ids in
    ring order (T, B), so the reduce-scatter moves contiguous chunks and no activation
    is copied. Unchecked but for T % p (:func:`forward` checks).
    """
    combine_vocab, _, _ = _vocab_hooks(grid)
    vocab_start = grid.rank * vocab_block(config.vocab, grid.p)
    if not sequence_parallel:
        with grid.trace.phase("embed.fwd"):
            x, emb = ops.embedding_forward(tokens, p["wte"], p["wpe"],
                                           vocab_start=vocab_start,
                                           combine_vocab=combine_vocab)    # (B, T, h)
        return x, EmbedCache(grid=grid, emb=emb)
    _check_seq(tokens, grid)
    c = tokens.shape[1] // grid.p
    trace = grid.trace

    def scatter_vocab(x):          # (T, B, h) masked lookup, ring order -> (B, T/p, h)
        with trace.phase("aux.vocab"):
            return seq_reduce_scatter(x, grid)   # g-bar: reduce-scatter (backward: all-gather)

    with trace.phase("embed.fwd"):
        ids = _to_ring(tokens, grid.p, seq_axis=1)                        # (T, B) ring order
        x, emb = ops.embedding_forward(ids, p["wte"], None, vocab_start=vocab_start,
                                       combine_vocab=scatter_vocab)       # (B, T/p, h) view
        x = _added(x, p["wpe"][grid.rank * c:(grid.rank + 1) * c])       # + this slice's wpe
    return x, EmbedCache(grid=grid, emb=emb, sequence_parallel=True,
                         wpe_shape=tuple(p["wpe"].shape))


def embed_backward(dx, cache: EmbedCache) -> dict:
    """``{"wte": (v/p, h), "wpe": (s, h)}``: the embedding's part of the tied ``wte``
    gradient (this shard's rows) and the replicated ``wpe`` gradient. No communication,
    except with sequence parallelism: one all-gather of the slices ``dx`` (B, T/p, h)
    (phase ``embed.bwd/aux.sp.vocab``, the reduce-scatter's conjugate), since the masked
    scatter-add reads every position; ``wpe``'s gradient then comes from the gathered
    gradient, the same on every rank."""
    grid = cache.grid
    if not cache.sequence_parallel:
        dx = g_backward(dx, grid)      # g (the lookup's): identity (forward: all-reduce)
        with grid.trace.phase("embed.bwd"):
            _, g = ops.embedding_backward(dx, cache.emb)   # masked: only this shard's rows
        return {"wte": g["wte"], "wpe": g["wpe"]}
    xp = array_module(dx)
    with grid.trace.phase("embed.bwd"):
        with grid.trace.phase("aux.sp.vocab"):
            d = seq_allgather(dx, grid)   # g-bar, backward: all-gather (T, B, h) ring order
        _, g = ops.embedding_backward(d, cache.emb)    # masked: only this shard's rows
        t = d.shape[0]
        c = t // grid.p
        sums = d.sum(axis=1)                                              # (T, h) ring order
        dwpe = xp.zeros(cache.wpe_shape, dtype=d.dtype)                   # (s, h)
        dwpe[:t - c] = sums[c:]                        # chunks 1 .. p-1: slices 0 .. p-2
        dwpe[t - c:t] = sums[:c]                       # chunk 0: slice p-1
    return {"wte": g["wte"], "wpe": dwpe}


class LayerPieceCache(NamedTuple):
    config: Config
    grid: Any
    l: int                       # global layer index (phase names)
    params: dict                 # the layer's local params, read again when recomputed
    checkpoint: bool             # recompute == "full"
    block: Any                   # ops.BlockCache, or the input (B, T[/p], h) if checkpointed
    sequence_parallel: bool = False   # the input is this rank's slice (B, T/p, h)
    recompute: str = "none"      # "none", "selective" or "full"
    attention: str = "plain"     # "plain" or "flash"
    tile: Optional[int] = None   # flash's key/value tile (None: flash's default)


def _core_how(recompute: str, attention: str, tile) -> dict:
    """The attention core's keywords for a layer run under ``recompute``: "selective"
    reaches the core; "full" is the layer piece's (the core then keeps everything)."""
    return dict(recompute="selective" if recompute == "selective" else "none",
                attention=attention, tile=tile)


def layer_forward(x, p_layer: dict, l: int, config: Config, grid, checkpoint: bool = False,
                  *, recompute: Optional[str] = None, attention: str = "plain",
                  tile: Optional[int] = None, sequence_parallel: bool = False):
    """Layer ``l`` (phase ``h{l}.fwd``) on x (B, T, h) replicated -> (B, T, h) replicated,
    or with ``sequence_parallel`` on this rank's slice x (B, T/p, h) -> (B, T/p, h)
    (:func:`seq_allgather` before QKV and fc, :func:`seq_reduce_scatter` after the
    projections).

    ``p_layer``: the layer's local params under the unprefixed keys of
    ``ops.block_keys(config.mlp)``. ``recompute`` as in ``model.forward`` (default
    ``"full"`` if ``checkpoint`` else ``"none"``): with ``"full"`` the cache keeps only
    ``x`` and ``p_layer`` and :func:`layer_backward` recomputes the layer, its
    collectives included; with ``"selective"`` the attention core keeps q, k, v and y
    and recomputes its probabilities locally in the backward (no message). ``attention``
    ``"plain"`` or ``"flash"`` (``tile`` its key/value tile) runs on the local heads.
    """
    mode = model._recompute_mode(checkpoint, recompute)
    block_forward = _block_forward_sp if sequence_parallel else _block_forward
    with grid.trace.phase(f"h{l}.fwd"):
        out, block = block_forward(x, p_layer, config, grid,
                                   how=_core_how(mode, attention, tile))  # (B, T[/p], h)
    full = mode == "full"
    return out, LayerPieceCache(config=config, grid=grid, l=l, params=p_layer,
                                checkpoint=full, block=x if full else block,
                                sequence_parallel=bool(sequence_parallel), recompute=mode,
                                attention=attention, tile=tile)


def layer_backward(dx, cache: LayerPieceCache):
    """``(dx (B, T, h) replicated, unprefixed local grads)`` of the layer (phase ``h{l}.bwd``).

    With sequence parallelism ``dx`` is this rank's slice (B, T/p, h), in and out, and
    the gradients of :data:`SP_LAYER_KEYS` are this slice's partial sums (summed over
    the group by :func:`allreduce_sequence_parallel_grads`). Checkpointed
    (``recompute="full"``): the forward is recomputed first from the saved input and
    ``cache.params`` (its collectives as ``tp.recompute.*``), with the same attention.
    The gradients do not depend on ``recompute`` (bitwise).
    """
    grid = cache.grid
    sp = cache.sequence_parallel
    block_forward = _block_forward_sp if sp else _block_forward
    with grid.trace.phase(f"h{cache.l}.bwd"):
        if cache.checkpoint:   # recompute the layer's forward (its collectives included)
            _, block = block_forward(cache.block, cache.params, cache.config, grid,
                                     rerun=True, how=_core_how("full", cache.attention,
                                                                cache.tile))
        else:
            block = cache.block
        if sp:
            return _block_backward_sp(dx, block, grid)                   # (B, T/p, h)
        return _block_backward(dx, block, grid)                          # (B, T, h)


class HeadCache(NamedTuple):
    config: Config
    grid: Any
    lnf: ops.LayerNormCache
    head: Any                    # LMHeadCache (tied: local wte rows), LinearCache (untied:
    #                              local head.w columns) or ClassifierCache
    ce: Optional[ops.CrossEntropyCache]   # None when no targets were given
    logits: Any                  # this rank's logits (B, T, v/p), or (B, n_classes) replicated
    n_items: int                 # the denominator of the mean loss
    sequence_parallel: bool = False   # the input was this rank's slice (B, T/p, h)


def head_forward(x, p: dict, targets, config: Config, grid, n_items: Optional[int] = None,
                 sequence_parallel: bool = False):
    """Final LayerNorm, LM head (tied or untied) or classifier, and loss (phase ``loss.fwd``).

    ``x`` (B, T, h) replicated, or with ``sequence_parallel`` this rank's slice
    (B, T/p, h): the LayerNorm runs on the slice and its output is all-gathered
    (phase ``loss.fwd/aux.sp.head``) before the logits; the LM head then runs on the
    sequence-major rows, and ``cache.logits`` is their (B, T, v/p) view. ``p`` needs
    ``lnf.g``, ``lnf.b`` and ``wte`` (this rank's rows; tied LM head), ``head.w`` (this
    rank's vocabulary columns; ``config.tied`` False), or ``cls.w``, ``cls.b`` when
    ``config.n_classes``. ``targets``: the global micro-batch's, or None (logits only).
    Returns ``(loss, cache)``: the sum of the per-item losses over ``n_items`` (default:
    this micro-batch's tokens, or sequences for classification), the same float on
    every rank; None without targets.
    """
    _, max_vocab, sum_vocab = _vocab_hooks(grid)
    with grid.trace.phase("loss.fwd"):
        x, lnf = ops.layernorm_forward(x, p["lnf.g"], p["lnf.b"])       # (B, T[/p], h)
        seq_major = None
        if sequence_parallel:
            with grid.trace.phase("aux.sp.head"):
                # g: all-gather (backward: reduce-scatter for the LM, a split for the
                # replicated classifier)
                seq_major = seq_allgather(x, grid, ordered=True)     # (T, B, h) sequence order
            x = seq_major.transpose(1, 0, 2)                             # (B, T, h) view
        if config.n_classes:   # the classifier is replicated: no communication
            logits, head = ops.classifier_forward(x, p["cls.w"], p["cls.b"])   # (B, k)
            reductions = {}
        else:
            if seq_major is None:
                x = f_forward(x, grid)     # f: identity (backward: f_backward, all-reduce)
            else:   # g above took f's place; the rows stay sequence-major and the
                x = seq_major              # targets are read to match: no copy of logits
                targets = None if targets is None else targets.T             # (T, B) view
            if config.tied:
                logits, head = ops.lm_head_forward(x, p["wte"])  # (B, T, v/p) or (T, B, v/p)
            else:          # untied: x head.w_r, this rank's vocabulary columns
                logits, head = ops.linear_forward(x, p["head.w"])  # (B, T, v/p) or (T, B, v/p)
            start = grid.rank * vocab_block(config.vocab, grid.p)
            reductions = dict(vocab_start=start, max_vocab=max_vocab, sum_vocab=sum_vocab,
                              vocab_valid=config.vocab - start)
        if n_items is None:
            n_items = math.prod(logits.shape[:-1])
        loss, ce = None, None
        if targets is not None:
            losses, ce = ops.cross_entropy_forward(logits, targets, **reductions)  # (B, T)
            loss = float(losses.sum()) / n_items                             # or (T, B)
        if seq_major is not None and not config.n_classes:
            logits = logits.transpose(1, 0, 2)                               # (B, T, v/p) view
    return loss, HeadCache(config=config, grid=grid, lnf=lnf, head=head, ce=ce,
                           logits=logits, n_items=n_items,
                           sequence_parallel=bool(sequence_parallel))


def head_backward(cache: HeadCache, loss_scale: float = 1.0):
    """``(dx (B, T, h) replicated, grads)`` of the head (phase ``loss.bwd``), seeded with
    ``loss_scale/n_items`` per item (``loss_scale``: mixed precision's S). ``grads``: ``cls.w``, ``cls.b`` (classification), ``lnf.g``,
    ``lnf.b`` and, for the LM, the LM head's part of the tied ``wte`` gradient (v/p, h)
    or the untied ``head.w``'s gradient (h, v/p) (no ``wte`` part then).
    With sequence parallelism ``dx`` is this rank's slice (B, T/p, h): the LM head's
    partial input gradient is reduce-scattered (phase ``loss.bwd/aux.lm_head``) in place
    of the all-reduce, the classifier's (replicated) split; ``lnf.g``, ``lnf.b`` are
    then this slice's partial sums."""
    if cache.ce is None:
        raise ValueError("backward needs a forward with targets")
    grid = cache.grid
    xp = array_module(cache.logits)
    sp = cache.sequence_parallel
    grads = {}
    with grid.trace.phase("loss.bwd"):
        dlosses = xp.full(cache.ce.shape, float(loss_scale) / cache.n_items,
                          dtype=cache.logits.dtype)     # dloss = S/n_items per item
        dlogits, _ = ops.cross_entropy_backward(dlosses, cache.ce)     # this rank's columns
        if cache.config.n_classes:
            dx, g = ops.classifier_backward(dlogits, cache.head)      # (B, T, h) replicated
            grads["cls.w"], grads["cls.b"] = g["w"], g["b"]
            if sp:             # replicated: this rank's positions, no message
                c = dx.shape[1] // grid.p
                dx = xp.ascontiguousarray(dx[:, grid.rank * c:(grid.rank + 1) * c])  # (B, T/p, h)
        else:
            if cache.config.tied:
                dx, g = ops.lm_head_backward(dlogits, cache.head)  # (B, T, h) or (T, B, h)
                grads["wte"] = g["wte"]                               # (v/p, h)
            else:
                dx, g = ops.linear_backward(dlogits, cache.head)   # (B, T, h) or (T, B, h)
                grads["head.w"] = g["w"]                              # (h, v/p)
            # dx = sum_r dZ_r E_r (tied) or dZ_r head.w_r^T (untied): a partial sum
            with grid.trace.phase("aux.lm_head"):
                if sp:   # g, backward: reduce-scatter (forward: all-gather)
                    dx = seq_reduce_scatter(_to_ring(dx, grid.p, seq_axis=0), grid)
                    dx = xp.ascontiguousarray(dx)                     # (B, T/p, h)
                else:
                    f_backward(dx, grid)   # f: all-reduce (forward: f_forward, identity)
        dx, g = ops.layernorm_backward(dx, cache.lnf)                 # (B, T[/p], h)
        grads["lnf.g"], grads["lnf.b"] = g["g"], g["b"]
    return dx, grads


stage_keys = model.stage_keys


# --------------------------------------------------------------------------- #
# the model: the pieces in a row                                              #
# --------------------------------------------------------------------------- #
class MegatronCache(NamedTuple):
    params: dict                 # local params (the keys and order of the gradients)
    emb: EmbedCache
    layers: list                 # per layer: LayerPieceCache
    head: HeadCache
    logits: Any                  # this rank's logits (B, T, v/p), or (B, n_classes) replicated
    loss: Optional[float]
    sequence_parallel: bool = False   # activations were (B, T/p, h) slices between pieces
    recompute: str = "none"      # "none", "selective" or "full"
    attention: str = "plain"     # "plain" or "flash"

    @property
    def blocks(self) -> list:
        """Per layer: the ops.BlockCache, or its input (B, T, h) (with sequence
        parallelism this rank's slice (B, T/p, h)) if checkpointed."""
        return [layer.block for layer in self.layers]


def forward(local_params: dict, tokens, targets, config: Config, grid,
            checkpoint: bool = False, *, recompute: Optional[str] = None,
            attention: str = "plain", tile: Optional[int] = None,
            sequence_parallel: bool = False):
    """Loss (a Python float, the same on every rank) and cache on global ``tokens`` [b, s].

    ``targets`` are the global [b, s] next-token ids ([b] classes when
    ``config.n_classes > 0``) or None. ``recompute``, ``attention`` and ``tile`` as in
    ``model.forward``: ``recompute="full"`` (``checkpoint=True``) keeps only each
    layer's input and recomputes the layer, collectives included, in :func:`backward`;
    ``"selective"`` recomputes only the attention probabilities, locally; ``attention``
    ``"flash"`` runs the blockwise core on each rank's heads. Neither of the last two
    sends anything. With ``sequence_parallel`` the activations between the pieces are
    this rank's sequence slices (B, T/p, h) (see the module docstring; T =
    ``tokens.shape[1]`` must be divisible by p). All checks (:func:`check`, local
    parameter shapes, tokens, targets, the recompute and attention choices) run before
    any communication, on every rank, and end in one agreement
    (:func:`summasim.mpiutil.agree`, untraced) on the config, the tokens and targets
    (shape, dtype, checksum), ``checkpoint``, ``recompute``, ``attention``, ``tile`` and
    ``sequence_parallel``: input that is bad on one rank raises the same
    ``ValueError``/``TypeError`` on every rank. Then :func:`embed_forward`,
    :func:`layer_forward` for every layer and :func:`head_forward`.
    """
    _check_grid(grid)          # not a group: no communicator to agree over, raise alone
    sp = bool(sequence_parallel)

    def local():
        check(config, grid)
        check_local_params(local_params, config, grid)
        model.check_tokens(tokens, config)
        if targets is not None:
            model.check_targets(targets, tokens, config)
        if sp:
            check(config, grid, seq=tokens.shape[1], sequence_parallel=True)
        mode = model._recompute_mode(checkpoint, recompute)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, "
                             f"got {attention!r}")
        if tile is not None:
            positive_int("tile", tile)
        return mode

    mode, err = local_error(local)
    agree("megatron.forward", grid, {**fields_of(config, "Config"), "tokens": fingerprint(tokens),
                                     "targets": fingerprint(targets),
                                     "checkpoint": bool(checkpoint),
                                     "recompute": repr(recompute),
                                     "attention": repr(attention), "tile": repr(tile),
                                     "sequence_parallel": sp}, err)
    x, emb = embed_forward(local_params, tokens, config, grid, sp)       # (B, T[/p], h)
    layers = []
    for l in range(config.layers):
        x, layer = layer_forward(x, model.layer_params(local_params, l), l, config, grid,
                                 recompute=mode, attention=attention, tile=tile,
                                 sequence_parallel=sp)                    # (B, T[/p], h)
        layers.append(layer)
    loss, head = head_forward(x, local_params, targets, config, grid, sequence_parallel=sp)
    return loss, MegatronCache(params=local_params, emb=emb, layers=layers, head=head,
                               logits=head.logits, loss=loss, sequence_parallel=sp,
                               recompute=mode, attention=attention)


def backward(cache: MegatronCache) -> dict:
    """Local gradients of the mean loss, same keys and local shapes as the local params.

    The pieces in reverse: :func:`head_backward`, :func:`layer_backward` from the last
    layer down, :func:`embed_backward`; the tied ``wte`` gradient is the embedding's
    part plus the LM head's (an untied head's ``head.w`` gradient is the head's alone,
    and ``wte``'s the embedding's). Replicated parameters get identical gradients on every
    rank (no communication; with sequence parallelism, the partial sums of
    :func:`sequence_parallel_keys` are summed by one all-reduce,
    :func:`allreduce_sequence_parallel_grads`); :func:`unshard` assembles the
    serial-layout gradients.
    """
    dx, grads = head_backward(cache.head)                                 # (B, T[/p], h)
    for l in reversed(range(len(cache.layers))):
        dx, g = layer_backward(dx, cache.layers[l])                       # (B, T[/p], h)
        for key, val in g.items():
            grads[f"h{l}.{key}"] = val
    g = embed_backward(dx, cache.emb)
    grads["wpe"] = g["wpe"]                            # (s, h) replicated
    dwte_head = grads.get("wte")
    grads["wte"] = g["wte"]                            # (v/p, h)
    if dwte_head is not None:
        grads["wte"] += dwte_head                      # tied: embedding + LM head
    if cache.sequence_parallel:   # the slices' partial sums of the replicated parameters
        allreduce_sequence_parallel_grads(grads, cache.head.config, cache.head.grid)
    return {key: grads[key] for key in cache.params}


def local_logits(full, config: Config, grid):
    """This rank's block of the global logits ``full`` (what ``cache.logits`` holds: the
    vocab columns ``[B, T, v/p]`` of the LM, all of ``[B, n_classes]`` for
    classification); the inverse of :func:`logits`, and no data moves."""
    if config.n_classes or grid.p == 1:
        return array_module(full).array(full, copy=True)
    return _split(full, "head.w", "col", grid, config)    # the padded vocabulary's block


def logits(cache: MegatronCache, config: Config, grid):
    """The global logits on every rank: (b, s, v) for the LM (an all-gather of the
    vocab columns, phase ``logits/aux.gather``; none when p == 1), (b, k) replicated
    for classification."""
    local = cache.logits
    if config.n_classes or grid.p == 1:
        return local.copy()
    with grid.trace.phase("logits"), grid.trace.phase("aux.gather"):
        full = layout.join(local, grid, "col")                      # (B, T, padded v)
    return full if full.shape[-1] == config.vocab else \
        array_module(full).ascontiguousarray(full[..., :config.vocab])


# --------------------------------------------------------------------------- #
# closed forms (pure: the sizes alone)                                        #
# --------------------------------------------------------------------------- #
def activation_shape(config: Config, t: int, batch: int, seq: int,
                     sequence_parallel: bool = False) -> tuple:
    """The local shape of the activation between two pieces (what a pipeline stage
    sends) for a micro-batch of ``batch`` sequences of ``seq`` tokens on a group of
    ``t``: (batch, seq, h) replicated, or with ``sequence_parallel`` this rank's slice
    (batch, seq / t, h). ``ValueError`` when ``seq`` is not divisible by ``t`` there."""
    if sequence_parallel and seq % t:
        raise ValueError(f"Megatron 1D: the sequence length T = {seq} is not divisible by "
                         f"p = {t} (sequence parallelism: each rank holds T/p positions "
                         f"between the pieces)")
    return (batch, seq // t if sequence_parallel else seq, config.hidden)


def traffic(config: Config, t: int, batch: int, seq: int, *, checkpoint: bool = False,
            recompute: Optional[str] = None, attention: str = "plain",
            sequence_parallel: bool = False):
    """The ledger of one :func:`forward` and :func:`backward` on each rank of a group of
    ``t`` for a micro-batch of ``batch`` sequences of ``seq`` tokens, from the sizes
    alone: ``Counter({(phase, op, nbytes): count})``, comparable with
    ``Counter((e.phase, e.op, e.nbytes) for e in trace.events)`` (the check-only
    phases ``logits`` and ``unshard`` left out). Empty when ``t == 1``.

    Without sequence parallelism every collective is one ``allreduce`` event: per layer
    the two ``g`` forward, the two ``f`` conjugates backward (and the recomputed ``g``'s
    with ``checkpoint``) of ``b s h`` items; the embedding's and the LM head's of
    ``b s h``; the loss's three of ``b s``. With it each of those ``b s h`` all-reduces is
    a reduce-scatter and each new all-gather one more ring half: ``t - 1`` ``sendrecv``
    events of ``b s h / t`` items each (see the module docstring for the phases), so a
    layer sends the same ``4 (t-1)/t b s h`` items forward as before; plus one
    ``allreduce`` of the :func:`sequence_parallel_keys` gradients (phase ``sp.grads``).

    The model variants change nothing here: SwiGLU's gate is a second column-parallel
    linear on the same input (its input gradient joins fc's before the one ``f``
    all-reduce), grouped-query attention only narrows each rank's QKV columns, and an
    untied head sends what the tied one sends. ``recompute="full"`` is ``checkpoint``;
    ``"selective"`` and ``attention="flash"`` recompute locally and send nothing more
    (``attention`` is accepted for symmetry and checked).
    """
    from collections import Counter

    checkpoint = model._recompute_mode(checkpoint, recompute) == "full"
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")

    item = config.dtype.itemsize
    out: Counter = Counter()
    if t == 1:
        return out
    lm = not config.n_classes
    act = batch * seq * config.hidden * item                # a [b*s, h] buffer
    stat = batch * seq * item                               # a [b*s, 1] buffer
    if not sequence_parallel:
        def reduce(phase):
            out[(phase, "allreduce", act)] += 1
        gather = None
    else:
        if seq % t:
            activation_shape(config, t, batch, seq, True)   # raises, naming the numbers
        chunk = act // t

        def reduce(phase):                                  # a reduce-scatter
            out[(phase, "sendrecv", chunk)] += t - 1

        def gather(phase):                                  # an all-gather
            out[(phase, "sendrecv", chunk)] += t - 1
    reduce("embed.fwd/aux.vocab")
    for l in range(config.layers):
        fwd, bwd = f"h{l}.fwd/tp.", f"h{l}.bwd/tp."
        passes = [fwd] + ([bwd + "recompute."] if checkpoint else [])
        for tag in passes:                                  # the forward, and its recompute
            if gather:
                gather(tag + "sp.attn.qkv")
                gather(tag + "sp.mlp.fc")
            reduce(tag + "attn.proj")
            reduce(tag + "mlp.proj")
        if gather:                                          # the projections' conjugates
            gather(bwd + "sp.mlp.proj")
            gather(bwd + "sp.attn.proj")
        reduce(bwd + "mlp.fc")                              # the column-parallel conjugates
        reduce(bwd + "attn.qkv")
    if gather:
        gather("loss.fwd/aux.sp.head")
        gather("embed.bwd/aux.sp.vocab")
    if lm:
        out[("loss.fwd/aux.max", "allreduce", stat)] += 1
        out[("loss.fwd/aux.sum", "allreduce", stat)] += 2
        reduce("loss.bwd/aux.lm_head")
    if sequence_parallel:
        n = sum(math.prod(model.param_shapes(config)[k]) for k in sequence_parallel_keys(config))
        out[("sp.grads", "allreduce", n * item)] += 1
    return out


def activation_items(config: Config, t: int, batch: int, seq: int, *,
                     sequence_parallel: bool = False, checkpoint: bool = False,
                     recompute: Optional[str] = None, attention: str = "plain") -> int:
    """Elements one layer's cache holds between its forward and its backward on each
    rank of a group of ``t``: ``model.activation_items(...).layer`` term by term, with
    each term either replicated (whole) or split over the group (``/ t``). ``b`` = batch,
    ``s`` = seq, ``N = b s``, ``a`` query heads, ``W = h + 2 kv_width`` the QKV width
    (``3h`` without grouped-query attention), ``F`` the MLP width:

    * ``recompute="full"`` (``checkpoint``): the input only, ``N h`` (``N h / t`` with
      sequence parallelism);
    * replicated: ln1's and ln2's normalized inputs and statistics ``2 (N h + N)``
      (with sequence parallelism this rank's slices, ``2 (N h + N) / t``) and the
      inputs of QKV and of fc (and gate) ``2 N h`` (kept gathered with sequence
      parallelism);
    * per rank: the QKV output ``N W / t``, the merged heads ``N h / t``, the attention
      core's own: ``N h / t + a b s^2 / t`` (``q * scale`` and the probabilities;
      ``recompute="none"``, plain), ``0`` (``"selective"``: recomputed from q, k, v) or
      ``a b s / t`` (``attention="flash"``: the row log-sum-exp); the MLP's activations
      ``2 N F / t`` (GELU: its input and output) or ``3 N F / t`` (SwiGLU: up, gate and
      their product).

    So the default (GELU, plain, no recompute) is ``b s h (4 + (5 + 2 f) / t) + a b s^2
    / t + 2 b s`` (``f = F / h``), and with sequence parallelism ``b s h (2 + (7 + 2 f)
    / t) + a b s^2 / t + 2 b s / t``; at ``t = 1`` without sequence parallelism every
    variant equals ``model.activation_items(config, batch, seq, recompute,
    attention).layer``. Korthikanti et al. (2022) Table 2 count ``s b h (10 + 24/t + 5 a
    s/(h t))`` bytes (tensor parallel) and ``s b h (34/t + 5 a s/(h t))`` (sequence
    parallel) for 16-bit activations with dropout, storing the gathered LayerNorm
    outputs as their slices; see the module docstring.
    """
    mode = model._recompute_mode(checkpoint, recompute)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    h, a, f, w = config.hidden, config.heads, config.ffn, config.qkv_width
    bs = batch * seq
    if mode == "full":
        return bs * h // t if sequence_parallel else bs * h
    if attention == "flash":
        core = a * bs                                    # the row log-sum-exp
    elif mode == "selective":
        core = 0                                         # recomputed from q, k, v
    else:
        core = bs * h + a * batch * seq * seq            # q * scale, the probabilities
    act = (3 if config.mlp == "swiglu" else 2) * bs * f
    per_rank = (bs * w + bs * h + core + act) // t       # QKV out, merged heads, core, MLP
    ln = 2 * (bs * h + bs)                               # ln1, ln2: xhat and rstd
    inputs = 2 * bs * h                                  # QKV's and fc's inputs
    return (ln // t if sequence_parallel else ln) + inputs + per_rank
