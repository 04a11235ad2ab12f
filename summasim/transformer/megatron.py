"""Megatron-LM 1D tensor parallelism over a group of ``p`` ranks (Shoeybi et al. 2019).

Every rank of a :class:`~summasim.grid.Grid1D` holds the whole activation
``X [b*s, h]`` of every layer (replicated) and ``1/p`` of each weight matrix. The
ops of :mod:`summasim.transformer.ops` run unchanged on the local slices; this
module only chooses the slices and places the collectives.

The partition (rank ``r`` of ``p``)
-----------------------------------
Column-parallel linear (attention QKV, MLP fc): ``Y = XA + b``, ``A = [A_1, ..., A_p]``
split along its second dimension, ``b = [b_1, ..., b_p]``. Rank ``r`` computes
``Y_r = X A_r + b_r`` with no communication. For QKV, ``A_r`` is the Q, K and V
columns of heads ``[r n/p, (r+1) n/p)`` (a permutation of the serial ``[Q | K | V]``
columns, still ordered ``[Q_r | K_r | V_r]``), so attention runs on whole local
heads; for fc, ``A_r`` is columns ``[r f/p, (r+1) f/p)`` and GELU is elementwise.

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
  summed by ``g`` (its backward, the masked scatter-add, is local); the tied LM head's
  input passes ``f`` (its backward sums ``dx = sum_r dZ_r E_r``); the cross-entropy's
  max and sums go through :func:`vocab_reduce_forward`, which has no backward
  collective (each shard's logit gradient is local, as in Megatron's
  ``_VocabParallelCrossEntropy``).

Parameter gradients need no communication: ``dA_r = X^T dY_r``, ``db_r = sum dY_r``,
``dB_r = Y_r^T dZ`` are this rank's blocks; ``dc = sum dZ`` and the LayerNorm
gradients are computed from replicated arrays, identically on every rank.

Vocabulary parallelism. ``wte = [E_1; ...; E_p]`` is split by rows (vocabulary ids
``[r v/p, (r+1) v/p)``, layout ``"row"``). The embedding is a masked lookup (ids
outside the shard give 0) followed by an all-reduce; ``wpe`` is replicated. The
tied LM head gives each rank its logit columns ``Z_r = x E_r^T [b*s, v/p]``; the
cross-entropy reduces over the vocabulary with three all-reduces of ``[b*s, 1]``
(max, sum of exponentials, target logit -- which is 0 on ranks without the
target). ``dZ_r`` is local, ``dx = sum_r dZ_r E_r`` is a partial sum: all-reduce.
LayerNorms (ln1, ln2, lnf) are replicated and computed identically everywhere.

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

Local parameters
----------------
The serial names, with local shapes (``f = ffn_mult * h``):
``wte [v/p, h]`` (rows), ``wpe [s, h]`` (replicated), per layer ``attn.qkv.w [h, 3h/p]``,
``attn.qkv.b [3h/p]`` (heads), ``attn.proj.w [h/p, h]`` (rows), ``mlp.fc.w [h, f/p]``,
``mlp.fc.b [f/p]`` (columns), ``mlp.proj.w [f/p, h]`` (rows); ``ln*.g/b``,
``attn.proj.b``, ``mlp.proj.b``, ``lnf.g/b`` and ``cls.w/b`` replicated.
:func:`param_layout` and :func:`local_param_shapes` list them.

Pieces
------
:func:`forward` is :func:`embed_forward`, :func:`layer_forward` for every layer and
:func:`head_forward` in a row after its checks; :func:`backward` is their backwards in
reverse, adding the embedding's (:func:`embed_backward`) and the LM head's
(:func:`head_backward`) parts of the tied ``wte`` gradient. A pipeline / ZeRO engine
calls the pieces itself (they neither check nor agree). Between pieces the activation is
x (B, T, h), replicated. :func:`stage_keys` (``model.stage_keys``) lists a stage's parameters.

References
----------
Shoeybi, Patwary, Puri, LeGresley, Casper, Catanzaro (2019), "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", arXiv:1909.08053,
section 3 (f and g, Figures 3-4). Xu, Li, Gong, You (2021), "An Efficient 2D Method
for Training Super-Large Deep Learning Models" (Optimus), Table 1.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from summasim import layout
from summasim.backends import array_module
from summasim.mpiutil import agree, fields_of, fingerprint, local_error

from . import model, ops
from .model import Config
from .ops import BLOCK_KEYS

# How each parameter is split over the group: "row" (axis 0), "col" (last axis),
# "qkv" (the Q, K and V columns of this rank's heads) or "replicated".
_LAYER_LAYOUT = {"ln1.g": "replicated", "ln1.b": "replicated",
                 "attn.qkv.w": "qkv", "attn.qkv.b": "qkv",
                 "attn.proj.w": "row", "attn.proj.b": "replicated",
                 "ln2.g": "replicated", "ln2.b": "replicated",
                 "mlp.fc.w": "col", "mlp.fc.b": "col",
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
        elif name.startswith("h") and "." in name and name.split(".", 1)[1] in _LAYER_LAYOUT:
            out[name] = _LAYER_LAYOUT[name.split(".", 1)[1]]
        else:   # wpe, lnf.g, lnf.b, cls.w, cls.b
            out[name] = "replicated"
    return out


def _local_shape(shape: tuple, kind: str, p: int) -> tuple:
    if kind == "replicated":
        return tuple(shape)
    if kind == "row":
        return (shape[0] // p,) + tuple(shape[1:])
    return tuple(shape[:-1]) + (shape[-1] // p,)          # "col" and "qkv"


def local_param_shapes(config: Config, p: int) -> dict:
    """``{name: local shape}`` on each of ``p`` ranks (see the module docstring)."""
    kinds = param_layout(config)
    return {name: _local_shape(shape, kinds[name], p)
            for name, shape in model.param_shapes(config).items()}


def _check_grid(grid) -> None:
    if not (hasattr(grid, "comm") and hasattr(grid, "p") and hasattr(grid, "rank")
            and hasattr(grid, "trace")):
        raise TypeError(f"megatron needs a Grid1D (summasim.grid.Grid1D(comm)), got "
                        f"{type(grid).__name__}")


def check(config: Config, grid) -> None:
    """Raise ``ValueError`` (on every rank, without communicating) unless ``config``
    can be split over ``grid.p`` ranks: heads, vocab and the MLP width divisible by p.

    (``ffn = ffn_mult * h`` divides whenever heads does, since ``h = heads * head_size``;
    it is checked anyway.)
    """
    _check_grid(grid)
    if not isinstance(config, Config):
        raise TypeError(f"config must be a summasim.transformer.model.Config, got "
                        f"{type(config).__name__}")
    p = grid.p
    why = {"heads": "every rank holds whole attention heads",
           "vocab": "wte rows and the logits are split over the vocabulary",
           "ffn": "the MLP's fc columns and proj rows are split"}
    sizes = {"heads": config.heads, "vocab": config.vocab, "ffn": config.ffn}
    bad = [f"Config.{dim} = {size} is not divisible by p = {p} ({why[dim]})"
           for dim, size in sizes.items() if size % p]
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
    _check_arrays(local_params, local_param_shapes(config, grid.p), config.dtype,
                  f"local params (p = {grid.p})")


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
    return grid.comm.allreduce(dx)


def g_forward(x, grid):
    """g, forward: all-reduce of the partial ``x`` in place over ``grid.comm``
    (backward: identity, :func:`g_backward`)."""
    if grid.p == 1:
        return x
    return grid.comm.allreduce(x)


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
# shard / unshard                                                             #
# --------------------------------------------------------------------------- #
def _split(a, kind: str, grid):
    """This rank's block of the serial array ``a``: a fresh C-contiguous copy, never a
    view (an in-place optimizer step on the shards must not touch the serial model)."""
    xp = array_module(a)
    if kind in ("row", "col"):
        a = a[layout.block_slices(a.shape, kind, layout.grid_numbers(grid))]   # view
    elif kind == "qkv":
        # [..., 3h] = [..., 3, p, h/p] -> [..., 3, h/p] of this rank's heads
        lead, c = a.shape[:-1], a.shape[-1] // (3 * grid.p)
        a = a.reshape(lead + (3, grid.p, c))[..., grid.rank, :]         # (..., 3, h/p) view
        return xp.array(a, copy=True, order="C").reshape(lead + (3 * c,))     # (..., 3h/p)
    return xp.array(a, copy=True, order="C")


def _assemble(parts, kind: str):
    """The serial array from every rank's block, ``parts`` (p, *local shape)."""
    xp = array_module(parts)
    p = parts.shape[0]
    if kind == "row":
        return xp.ascontiguousarray(parts).reshape((-1,) + parts.shape[2:])   # (p*rows, ...)
    if kind == "col":
        return xp.ascontiguousarray(xp.moveaxis(parts, 0, -2)).reshape(
            parts.shape[1:-1] + (-1,))                                        # (..., p*cols)
    lead, c = parts.shape[1:-1], parts.shape[-1] // 3                         # qkv
    heads = xp.moveaxis(parts.reshape((p,) + lead + (3, c)), 0, -2)           # (..., 3, p, h/p)
    return xp.ascontiguousarray(heads).reshape(lead + (3 * p * c,))           # (..., 3h)


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
    return {name: _split(params[name], kind, grid)
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
        _check_arrays(local_grads, local_param_shapes(config, grid.p), config.dtype,
                      f"local grads (p = {grid.p})")

    _, err = local_error(local)
    agree("megatron.unshard", grid, fields_of(config, "Config"), err)
    kinds = param_layout(config)
    shapes = local_param_shapes(config, grid.p)
    sharded = [name for name, kind in kinds.items() if kind != "replicated"]
    xp = array_module(local_grads[sharded[0]])
    sizes = [math.prod(shapes[name]) for name in sharded]
    send = xp.empty(sum(sizes), dtype=config.dtype)          # (total,) packed blocks
    off = 0
    for name, n in zip(sharded, sizes):
        send[off:off + n] = local_grads[name].reshape(-1)
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
        out[name] = _assemble(parts[:, off:off + n].reshape((grid.p,) + shapes[name]), kind)
        off += n
    return out


# --------------------------------------------------------------------------- #
# one layer                                                                   #
# --------------------------------------------------------------------------- #
def _block_forward(x, p, config: Config, grid, recompute: bool = False):
    """One pre-LayerNorm layer on local weights, (B, T, h) -> (B, T, h), replicated in
    and out. ``recompute`` only renames the phases (checkpointed backward)."""
    trace = grid.trace
    tag = "tp.recompute." if recompute else "tp."
    heads = config.heads // grid.p
    a, ln1 = ops.layernorm_forward(x, p["ln1.g"], p["ln1.b"])            # (B, T, h) replicated
    a = f_forward(a, grid)         # f: identity (backward: f_backward, all-reduce)
    a, attn = ops.attention_forward(a, p["attn.qkv.w"], p["attn.qkv.b"],
                                    p["attn.proj.w"], None, heads)       # (B, T, h) partial sum
    with trace.phase(tag + "attn.proj"):
        g_forward(a, grid)         # g: all-reduce (backward: g_backward, identity)
    a += p["attn.proj.b"]                               # bias once, after the reduction
    a += x                                              # residual 1
    m, ln2 = ops.layernorm_forward(a, p["ln2.g"], p["ln2.b"])            # (B, T, h) replicated
    m = f_forward(m, grid)         # f: identity (backward: f_backward, all-reduce)
    m, fc = ops.linear_forward(m, p["mlp.fc.w"], p["mlp.fc.b"])         # (B, T, f/p)
    m, gelu = ops.gelu_forward(m)                                        # (B, T, f/p)
    m, proj = ops.linear_forward(m, p["mlp.proj.w"])                    # (B, T, h) partial sum
    with trace.phase(tag + "mlp.proj"):
        g_forward(m, grid)         # g: all-reduce (backward: g_backward, identity)
    m += p["mlp.proj.b"]                                # bias once, after the reduction
    m += a                                              # residual 2
    return m, ops.BlockCache(ln1=ln1, attn=attn, ln2=ln2, fc=fc, gelu=gelu, proj=proj)


def _block_backward(dout, cache: ops.BlockCache, grid):
    """The layer read in reverse: ``dx`` (B, T, h) replicated and local grads (BLOCK_KEYS)."""
    trace = grid.trace
    h = dout.shape[-1]
    grads = {}
    # g (mlp.proj), backward: identity (forward: g_forward, all-reduce); dout is
    # replicated and feeds every rank's row block as is
    dm = g_backward(dout, grid)                                          # (B, T, h)
    grads["mlp.proj.b"] = dout.reshape(-1, h).sum(axis=0)               # (h,) replicated
    dm, g = ops.linear_backward(dm, cache.proj)                          # (B, T, f/p)
    grads["mlp.proj.w"] = g["w"]                                         # (f/p, h)
    dm, _ = ops.gelu_backward(dm, cache.gelu)                            # (B, T, f/p)
    dm, g = ops.linear_backward(dm, cache.fc)                            # (B, T, h) partial sum
    grads["mlp.fc.w"], grads["mlp.fc.b"] = g["w"], g["b"]                # (h, f/p), (f/p,)
    with trace.phase("tp.mlp.fc"):
        f_backward(dm, grid)       # f: all-reduce (forward: f_forward, identity)
    dx1, g = ops.layernorm_backward(dm, cache.ln2)                       # (B, T, h)
    grads["ln2.g"], grads["ln2.b"] = g["g"], g["b"]
    dx1 += dout                                         # residual 2
    grads["attn.proj.b"] = dx1.reshape(-1, h).sum(axis=0)               # (h,) replicated
    da = g_backward(dx1, grid)     # g (attn.proj): identity (forward: g_forward, all-reduce)
    da, g = ops.attention_backward(da, cache.attn)                       # (B, T, h) partial sum
    grads["attn.qkv.w"], grads["attn.qkv.b"] = g["qkv.w"], g["qkv.b"]    # (h, 3h/p), (3h/p,)
    grads["attn.proj.w"] = g["proj.w"]                                   # (h/p, h)
    with trace.phase("tp.attn.qkv"):
        f_backward(da, grid)       # f: all-reduce (forward: f_forward, identity)
    dx, g = ops.layernorm_backward(da, cache.ln1)                        # (B, T, h)
    grads["ln1.g"], grads["ln1.b"] = g["g"], g["b"]
    dx += dx1                                           # residual 1
    return dx, {key: grads[key] for key in BLOCK_KEYS}


# --------------------------------------------------------------------------- #
# the pieces: embedding, one layer, head (unchecked; the engine checks once)  #
# --------------------------------------------------------------------------- #
class EmbedCache(NamedTuple):
    grid: Any
    emb: ops.EmbeddingCache      # masked lookup of this rank's vocabulary rows


def embed_forward(p: dict, tokens, config: Config, grid):
    """x (B, T, h) replicated = wte[tokens] + wpe[:T] on the global micro-batch ``tokens``.

    ``p`` needs ``wte`` (this rank's rows) and ``wpe``. One all-reduce of the masked
    lookup (phase ``embed.fwd/aux.vocab``). Unchecked: :func:`forward` checks.
    """
    combine_vocab, _, _ = _vocab_hooks(grid)
    with grid.trace.phase("embed.fwd"):
        x, emb = ops.embedding_forward(tokens, p["wte"], p["wpe"],
                                       vocab_start=grid.rank * (config.vocab // grid.p),
                                       combine_vocab=combine_vocab)        # (B, T, h)
    return x, EmbedCache(grid=grid, emb=emb)


def embed_backward(dx, cache: EmbedCache) -> dict:
    """``{"wte": (v/p, h), "wpe": (s, h)}``: the embedding's part of the tied ``wte``
    gradient (this shard's rows) and the replicated ``wpe`` gradient. No communication."""
    dx = g_backward(dx, cache.grid)    # g (the lookup's): identity (forward: all-reduce)
    with cache.grid.trace.phase("embed.bwd"):
        _, g = ops.embedding_backward(dx, cache.emb)   # masked: only this shard's rows
    return {"wte": g["wte"], "wpe": g["wpe"]}


class LayerPieceCache(NamedTuple):
    config: Config
    grid: Any
    l: int                       # global layer index (phase names)
    params: dict                 # the layer's local params, read again when recomputed
    checkpoint: bool
    block: Any                   # ops.BlockCache, or the input (B, T, h) if checkpointed


def layer_forward(x, p_layer: dict, l: int, config: Config, grid, checkpoint: bool = False):
    """Layer ``l`` (phase ``h{l}.fwd``) on x (B, T, h) replicated -> (B, T, h) replicated.

    ``p_layer``: the layer's local params under the unprefixed keys of
    ``ops.BLOCK_KEYS``. With ``checkpoint`` the cache keeps only ``x`` and
    ``p_layer``; :func:`layer_backward` recomputes.
    """
    with grid.trace.phase(f"h{l}.fwd"):
        out, block = _block_forward(x, p_layer, config, grid)            # (B, T, h)
    return out, LayerPieceCache(config=config, grid=grid, l=l, params=p_layer,
                                checkpoint=checkpoint, block=x if checkpoint else block)


def layer_backward(dx, cache: LayerPieceCache):
    """``(dx (B, T, h) replicated, unprefixed local grads)`` of the layer (phase ``h{l}.bwd``).

    Checkpointed: the forward is recomputed first from the saved input and
    ``cache.params`` (its ``g``'s as ``tp.recompute.*``).
    """
    grid = cache.grid
    with grid.trace.phase(f"h{cache.l}.bwd"):
        if cache.checkpoint:   # recompute the layer's forward (its g's included)
            _, block = _block_forward(cache.block, cache.params, cache.config, grid,
                                      recompute=True)
        else:
            block = cache.block
        return _block_backward(dx, block, grid)                          # (B, T, h)


class HeadCache(NamedTuple):
    config: Config
    grid: Any
    lnf: ops.LayerNormCache
    head: Any                    # LMHeadCache (local wte rows) or ClassifierCache
    ce: Optional[ops.CrossEntropyCache]   # None when no targets were given
    logits: Any                  # this rank's logits (B, T, v/p), or (B, n_classes) replicated
    n_items: int                 # the denominator of the mean loss


def head_forward(x, p: dict, targets, config: Config, grid, n_items: Optional[int] = None):
    """Final LayerNorm, tied LM head (or classifier) and loss (phase ``loss.fwd``).

    ``x`` (B, T, h) replicated; ``p`` needs ``lnf.g``, ``lnf.b`` and ``wte`` (this
    rank's rows), or ``cls.w``, ``cls.b`` when ``config.n_classes``. ``targets``: the
    global micro-batch's, or None (logits only). Returns ``(loss, cache)``: the sum of
    the per-item losses over ``n_items`` (default: this micro-batch's tokens, or
    sequences for classification), the same float on every rank; None without targets.
    """
    _, max_vocab, sum_vocab = _vocab_hooks(grid)
    with grid.trace.phase("loss.fwd"):
        x, lnf = ops.layernorm_forward(x, p["lnf.g"], p["lnf.b"])       # (B, T, h)
        if config.n_classes:   # the classifier is replicated: no communication
            logits, head = ops.classifier_forward(x, p["cls.w"], p["cls.b"])   # (B, k)
            reductions = {}
        else:
            x = f_forward(x, grid)     # f: identity (backward: f_backward, all-reduce)
            logits, head = ops.lm_head_forward(x, p["wte"])                  # (B, T, v/p)
            reductions = dict(vocab_start=grid.rank * (config.vocab // grid.p),
                              max_vocab=max_vocab, sum_vocab=sum_vocab)
        if n_items is None:
            n_items = math.prod(logits.shape[:-1])
        loss, ce = None, None
        if targets is not None:
            losses, ce = ops.cross_entropy_forward(logits, targets, **reductions)  # (B, T)
            loss = float(losses.sum()) / n_items
    return loss, HeadCache(config=config, grid=grid, lnf=lnf, head=head, ce=ce,
                           logits=logits, n_items=n_items)


def head_backward(cache: HeadCache):
    """``(dx (B, T, h) replicated, grads)`` of the head (phase ``loss.bwd``), seeded with
    ``1/n_items`` per item. ``grads``: ``cls.w``, ``cls.b`` (classification), ``lnf.g``,
    ``lnf.b`` and, for the LM, the LM head's part of the tied ``wte`` gradient (v/p, h)."""
    if cache.ce is None:
        raise ValueError("backward needs a forward with targets")
    grid = cache.grid
    xp = array_module(cache.logits)
    grads = {}
    with grid.trace.phase("loss.bwd"):
        dlosses = xp.full(cache.logits.shape[:-1], 1.0 / cache.n_items,
                          dtype=cache.logits.dtype)     # dloss = 1/n_items per item
        dlogits, _ = ops.cross_entropy_backward(dlosses, cache.ce)     # this rank's columns
        if cache.config.n_classes:
            dx, g = ops.classifier_backward(dlogits, cache.head)      # (B, T, h) replicated
            grads["cls.w"], grads["cls.b"] = g["w"], g["b"]
        else:
            dx, g = ops.lm_head_backward(dlogits, cache.head)         # (B, T, h) partial sum
            grads["wte"] = g["wte"]                                   # (v/p, h)
            with grid.trace.phase("aux.lm_head"):
                f_backward(dx, grid)   # f: all-reduce (forward: f_forward, identity)
        dx, g = ops.layernorm_backward(dx, cache.lnf)                 # (B, T, h)
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

    @property
    def blocks(self) -> list:
        """Per layer: the ops.BlockCache, or its input (B, T, h) if checkpointed."""
        return [layer.block for layer in self.layers]


def forward(local_params: dict, tokens, targets, config: Config, grid,
            checkpoint: bool = False):
    """Loss (a Python float, the same on every rank) and cache on global ``tokens`` [b, s].

    ``targets`` are the global [b, s] next-token ids ([b] classes when
    ``config.n_classes > 0``) or None. With ``checkpoint`` each layer keeps only its
    input and is recomputed in :func:`backward`. All checks (:func:`check`, local
    parameter shapes, tokens, targets) run before any communication, on every rank,
    and end in one agreement (:func:`summasim.mpiutil.agree`, untraced) on the config,
    the tokens and targets (shape, dtype, checksum) and ``checkpoint``: input that is
    bad on one rank raises the same ``ValueError``/``TypeError`` on every rank.
    Then :func:`embed_forward`, :func:`layer_forward` for every layer and
    :func:`head_forward`.
    """
    _check_grid(grid)          # not a group: no communicator to agree over, raise alone

    def local():
        check(config, grid)
        check_local_params(local_params, config, grid)
        model.check_tokens(tokens, config)
        if targets is not None:
            model.check_targets(targets, tokens, config)

    _, err = local_error(local)
    agree("megatron.forward", grid, {**fields_of(config, "Config"), "tokens": fingerprint(tokens),
                                     "targets": fingerprint(targets),
                                     "checkpoint": bool(checkpoint)}, err)
    x, emb = embed_forward(local_params, tokens, config, grid)            # (B, T, h)
    layers = []
    for l in range(config.layers):
        x, layer = layer_forward(x, model.layer_params(local_params, l), l, config, grid,
                                 checkpoint)                              # (B, T, h)
        layers.append(layer)
    loss, head = head_forward(x, local_params, targets, config, grid)
    return loss, MegatronCache(params=local_params, emb=emb, layers=layers, head=head,
                               logits=head.logits, loss=loss)


def backward(cache: MegatronCache) -> dict:
    """Local gradients of the mean loss, same keys and local shapes as the local params.

    The pieces in reverse: :func:`head_backward`, :func:`layer_backward` from the last
    layer down, :func:`embed_backward`; the tied ``wte`` gradient is the embedding's
    part plus the LM head's. Replicated parameters get identical gradients on every
    rank (no communication); :func:`unshard` assembles the serial-layout gradients.
    """
    dx, grads = head_backward(cache.head)                                 # (B, T, h)
    for l in reversed(range(len(cache.layers))):
        dx, g = layer_backward(dx, cache.layers[l])                       # (B, T, h)
        for key, val in g.items():
            grads[f"h{l}.{key}"] = val
    g = embed_backward(dx, cache.emb)
    grads["wpe"] = g["wpe"]                            # (s, h) replicated
    dwte_head = grads.get("wte")
    grads["wte"] = g["wte"]                            # (v/p, h)
    if dwte_head is not None:
        grads["wte"] += dwte_head                      # tied: embedding + LM head
    return {key: grads[key] for key in cache.params}


def local_logits(full, config: Config, grid):
    """This rank's block of the global logits ``full`` (what ``cache.logits`` holds: the
    vocab columns ``[B, T, v/p]`` of the LM, all of ``[B, n_classes]`` for
    classification); the inverse of :func:`logits`, and no data moves."""
    if config.n_classes or grid.p == 1:
        return array_module(full).array(full, copy=True)
    return layout.split(full, grid, "col")


def logits(cache: MegatronCache, config: Config, grid):
    """The global logits on every rank: (b, s, v) for the LM (an all-gather of the
    vocab columns, phase ``logits/aux.gather``; none when p == 1), (b, k) replicated
    for classification."""
    local = cache.logits
    if config.n_classes or grid.p == 1:
        return local.copy()
    with grid.trace.phase("logits"), grid.trace.phase("aux.gather"):
        return layout.join(local, grid, "col")                      # (B, T, v)
