"""Optimus (2D) and SUMMA2.5-LM (2.5D) tensor parallelism of the GPT-2 model.

One module, two grids. On a q x q grid (``Grid(comm, q)``, d = 1) this is Optimus
(Xu et al. 2021, section 3.2); on a ``[q, q, d]`` grid with d > 1 it is SUMMA2.5-LM
(Wang et al. 2021, section 3). With d == 1 the module calls ``summa_ab``,
``summa_abt`` and ``summa_atb`` themselves and sends nothing over the depth: the
Optimus path exactly.

Every linear layer ``Y = X W + b`` is a distributed product and its backward is
the closed set of Optimus eqs. (1)-(3)::

    forward    Y  = ab(X, W)          (+ b, broadcast down the columns from row 0)
    backward   dX = abt(dY, W)        dW = atb(X, dY)   (d > 1: atb all-reduces dW over depth)
               db = column sums of dY, reduced to row 0 (d > 1: then all-reduced over depth)

with ``(ab, abt, atb)`` = ``(summa_ab, summa_abt, summa_atb)`` for d = 1 and
``(summa25_ab, summa25_abt, summa25_atb)`` for d > 1.

Rectangular grids and sizes that do not divide
----------------------------------------------
The grid may be rectangular, ``[pr, pc, d]`` (``Grid(comm, pr, d, pc=pc)``): below, read
q as pr where it cuts rows (the batch, a weight's input) and as pc where it cuts columns
(the activation's hidden, a weight's output). No size need divide: the activation's
columns hold whole heads, the balanced partition of the key/value heads over pc
(:func:`head_groups`, :func:`column_cut`: column j holds kv heads ``[lo_j, hi_j)`` and
their query heads, at least one each); the MLP width over pc and over pr and the hidden
size over pr are the balanced partition; the vocabulary is padded to a multiple of
``lcm(pr, pc)`` (:func:`padded_vocab`); the batch is cut into ``d pr`` blocks of whole
sequences (``b % (d pr)``). Each product steps over the merged cut of its shared
dimension (its pc blocks and its pr blocks: :func:`_products`), as ScaLAPACK's PxGEMM
does on any grid. Blocks differ by rank, so the shapes in the table below are those of
a square grid with sizes that divide; :func:`local_shapes` gives every rank's.

Partition (rank ``(i, j, k)``, ``bl = b/(dq)`` sequences, ``N = bl*s`` rows)
-------------------------------------------------------------------------
================================  ===================================================
activations ``[b*s, h]``          "2.5d" ("2d" if d = 1), rows cut by WHOLE sequences:
                                  ``X[M_{kq+i}, H_j]``, local ``[N, h/q]``
weights ``W [in, out]``           "2d": ``W[In_i, Out_j]``, replicated over k
``wte [v, h]``                    "2d": ``wte[V_i, H_j]`` (embedding and tied LM head)
``head.w [h, v]`` (untied head)   "2d": ``head.w[H_i, V_j]``, a weight like the others:
                                  ``logits = ab(x, head.w)`` (vocab block j, as tied)
biases, LayerNorm ``g``/``b``,    hosted on row 0: rank ``(0, j, k)`` holds column block
``wpe [s, h]``                    j (``[n/q]`` or ``[s, h/q]``); ranks with ``i > 0`` hold
                                  zero-size arrays (``[0]``, ``[0, h/q]``) under the same
                                  keys, so params and grads have the same keys on every rank
``attn.qkv.w [h, W]``, ``.b``     columns permuted so column block j is ``[Q_j | K_j | V_j]``
(``W = h + 2 kv_width``)          (:func:`qkv_permutation`): the n/q query heads and the
                                  kv/q key/value heads of group j; the attention output
                                  block ``(i, j)`` is then column block j of ``[b*s, h]``
``mlp.gate.w [h, F]``, ``.b``     SwiGLU's gate: laid out exactly as ``mlp.fc.w``/``.b``
                                  (its own SUMMA product), so ``swiglu`` runs elementwise
                                  on matching ``[N, F/q]`` blocks of gate and up
``cls.w [h, k]`` (classifier)     hosted on row 0: rank ``(0, j, k)`` holds the rows that
                                  meet its hidden block, ``cls.w[H_j, :]`` ``[h/q, k]``;
                                  ranks with ``i > 0`` hold ``[0, k]``
``cls.b [k]`` (classifier)        hosted whole on rank ``(0, 0, k)``; ``[0]`` elsewhere
================================  ===================================================

Attention is local: a rank holds whole sequences (``bl`` of them), ``n/q`` whole query
heads and the ``kv/q`` key/value heads they read, so :func:`ops.attention_core_forward`
runs on its block as it is (``attention="plain"`` or ``"flash"``; ``recompute=
"selective"`` keeps q, k, v and y and recomputes the probabilities in the backward).
LayerNorm statistics over h are the local sums all-reduced along ``grid.row``; the
cross-entropy's max, sum-exp and target pick over v are all-reduced along
``grid.row`` too (the logits block ``[N, v/q]`` holds vocab block j). The mean over
the ``b*s`` tokens is all-reduced over ``grid.col`` and ``grid.depth``.

Embedding (Optimus 3.2.1, "SUMMA with a one-hot matrix"): for l = 0..q-1, block
``wte[V_l, H_j]`` travels down column j from row l and every rank adds the lookup
of its tokens that fall in vocab block l. The backward is the transpose: for each l
a partial ``dwte[V_l, H_j]`` (scatter-add) is reduced down the column to row l;
with d > 1 it is then all-reduced over depth. The tied LM head is
``logits = abt(x, wte)`` (``[N, v/q]``, vocab block j), with ``dx = ab(dlogits, wte)``
and ``dwte += atb(dlogits, x)``. The untied head (``tied=False``) is an ordinary
linear layer without bias: ``logits = ab(x, head.w)``, ``dx = abt(dlogits, head.w)``,
``dhead.w = atb(x, dlogits)`` (``[h/q, v/q]``), and ``wte``'s gradient is the
embedding's alone. Either way the logits block is ``[N, v/q]``, vocab block j, and the
vocab-parallel cross-entropy is the same.

Classification head (``Config.n_classes = k > 0``; Optimus section 2.1's second
branch, which "selects the embedding at certain token position" and predicts a label
per sequence, and leaves its partition open). As the serial model
(:func:`ops.classifier_forward`): the final LayerNorm runs on every token, the logits
are ``lnf(x)[:, -1] cls.w + cls.b`` from each sequence's LAST token (position ``t - 1``
of the ``t`` tokens given), the loss is the mean cross-entropy over the ``b``
sequences (``n_items = b``). The layout above treats ``cls.w`` as Optimus treats every
non-SUMMA parameter (section 3.2.1: hosted on row 0, broadcast down the columns,
gradients reduced onto row 0), cut along h to meet the activation's hidden block j:
k is small (2 for the paper's binary label) and need not divide q, so no SUMMA
product over a ``[h/q, k/q]`` block is needed, and every k runs on every grid. (Blocking
``cls.w`` 2d like ``head.w`` would need ``q | k``, which a binary label on q = 4 fails,
and its ``ab`` would move ``(b h / d + h k) / q`` items per rank forward against
``(b k / d + h k) / q`` here: more whenever k < h.) The
bias, whose k entries cannot be split into q column blocks in general, lives once, on
``(0, 0)``, and is added by column 0 only, into its partial logits before the row sum.
Per step and rank (``bl = b/(dq)`` sequences, ``hk = h k / q``, ``+k`` on column 0):

=====================================  ==============================================
``clshead.fwd/aux.params.bcast``       one ``grid.col`` broadcast from row 0 of the
                                       packed ``[cls.w[H_j, :] | cls.b]``: hk (+k) items
``clshead.fwd/aux.logits``             partial ``x_last[:, H_j] cls.w[H_j, :]`` (bl, k)
                                       (+ ``cls.b`` on column 0), one ``grid.row``
                                       all-reduce of ``bl k`` items: the logits
                                       ``[bl, k]``, replicated over the row
``loss/aux.mean``                      the cross-entropy is local (whole rows of k);
                                       the loss sum: one ``grid.col`` and one
                                       ``grid.depth`` all-reduce of 1 item
``clshead.bwd``                        ``dlogits`` is the same on every rank of the row
                                       (the conjugate of the row all-reduce is this
                                       copy: no message); ``dx[:, -1] = dlogits
                                       cls.w[H_j, :]^T`` locally; ``aux.grads.reduce``:
                                       one ``grid.col`` reduce onto row 0 of the packed
                                       ``[x_last^T dlogits | dlogits summed (column 0)]``,
                                       hk (+k) items; ``aux.grads.depth`` (d > 1, row
                                       0): a ring all-reduce of them over ``grid.depth``
=====================================  ==============================================

Groups of one send nothing, so q = 1, d = 1 sends nothing at all. :func:`classifier_payload`
states these per rank; ``lnf.fwd``/``lnf.bwd`` are the LM's.

Row-0 hosted vectors of one layer (LayerNorm ``g``/``b`` and the four biases) travel
as ONE packed buffer: one ``grid.col`` broadcast per layer forward, one ``grid.col``
reduce of the packed gradients per layer backward, then (d > 1) one ring all-reduce
over ``grid.depth`` among the row-0 ranks. Groups of one rank (q = 1 or d = 1)
communicate nothing.

Conjugates (each collective call site names its pair in a comment): a product ``ab``
in forward is ``abt`` and ``atb`` in backward; a broadcast down the column from row 0
(:func:`_bcast_from_row0`, the embedding's ``wte`` blocks from row l) is a reduce onto
that row in backward (:func:`_reduce_to_row0`, ``ireduce(root=l)``), plus the depth
all-reduce of what is replicated over k when d > 1; a LayerNorm's row all-reduces of
its statistics are row all-reduces again in backward; the cross-entropy's row
all-reduces and the loss's column/depth sums have no backward collective.

Trace phases (each event's phase is ``"<top>/<sub>"``; sub starts with "tp." or "aux.")
--------------------------------------------------------------------------------
``h{l}.fwd``   ``aux.params.bcast``, ``aux.ln1``, ``tp.attn.qkv``, ``tp.attn.proj``,
               ``aux.ln2``, ``tp.mlp.fc``, (SwiGLU) ``tp.mlp.gate``, ``tp.mlp.proj``
``h{l}.bwd``   (recompute="full" / checkpoint=True: the forward's phases first, for the
               recompute) then ``tp.mlp.proj.dX``, ``tp.mlp.proj.dW``, ``tp.mlp.fc.dX``,
               ``tp.mlp.fc.dW``, (SwiGLU) ``tp.mlp.gate.dX``, ``tp.mlp.gate.dW``,
               ``aux.ln2``, ``tp.attn.proj.dX``, ``tp.attn.proj.dW``, ``tp.attn.qkv.dX``,
               ``tp.attn.qkv.dW``, ``aux.ln1``, ``aux.grads.reduce``, ``aux.grads.depth``
               (the ``*.dW`` phases include summa25_atb's depth ring all-reduce)
``embed.fwd``  ``aux.wte.bcast``, ``aux.wpe.bcast``
``embed.bwd``  ``aux.wte.reduce``, ``aux.wte.depth``, ``aux.wpe.reduce``, ``aux.wpe.depth``
``lnf.fwd``    ``aux.params.bcast``, ``aux.ln``;  ``lnf.bwd``: ``aux.ln``,
               ``aux.grads.reduce``, ``aux.grads.depth``
``lmhead.fwd`` ``aux.logits``;  ``lmhead.bwd``: ``aux.logits.dX``, ``aux.logits.dW``
``clshead.fwd`` (classifier, in place of ``lmhead``) ``aux.params.bcast``, ``aux.logits``;
               ``clshead.bwd``: ``aux.grads.reduce``, ``aux.grads.depth``
``loss``       ``aux.ce`` (row max / sums; LM only), ``aux.mean`` (col and depth sums of
               the loss)

Per rank, one layer's ``tp.*`` broadcast and reduce payload is exactly
``(7 b s h / d + 12 h^2) / q`` items forward (Optimus Table 1 with ``ffn_mult = 4``;
in general ``((3 + f) b s h / d + (4 + 2f) h^2) / q``), twice that backward, three
times with checkpointing; nothing when q = 1. Every product ``ab`` of an ``[M, K]``
activation and a ``[K, K']`` weight moves ``(M K / d + K K') / q`` items per rank, and so
do its two backward products; :func:`layer_payload` sums them for any variant
(``(b s (3h + F + [SwiGLU] h) / d + h (W + h + 2F + [SwiGLU] F)) / q``, F the MLP width,
W the QKV width). ``recompute="selective"`` and ``attention="flash"`` change no traffic.

Pieces
------
``embed_forward/backward``, ``layer_forward/backward``, ``head_forward/backward`` and
``stage_keys``, as in :mod:`summasim.transformer.megatron` (docs/transformer.md,
"Pieces"): :func:`forward` and :func:`backward` are them in a row. Between pieces the
activation is this rank's block as ``(bl, t, h/q)``, a view of its ``(N, h/q)`` rows
(a layer needs ``t`` for its attention).

References
----------
Q. Xu, S. Li, C. Gong, Y. You, "An Efficient 2D Method for Training Super-Large Deep
Learning Models" (Optimus), 2021, section 3.2 and Table 1.
B. Wang, Q. Xu, Z. Bian, Y. You, "2.5-dimensional distributed model training"
(SUMMA2.5-LM), 2021, section 3.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple, Optional

import numpy as np

from summasim import layout
# The algorithms' unchecked twins under their public names: forward, shard and unshard
# check and agree once per call, so the many products of a step do not agree again.
from summasim.algorithms.allreduce import ring_allreduce_unchecked as ring_allreduce
from summasim.algorithms.summa import summa_ab_unchecked as summa_ab
from summasim.algorithms.summa import summa_abt_unchecked as summa_abt
from summasim.algorithms.summa import summa_atb_unchecked as summa_atb
from summasim.algorithms.summa25 import summa25_ab_unchecked as summa25_ab
from summasim.algorithms.summa25 import summa25_abt_unchecked as summa25_abt
from summasim.algorithms.summa25 import summa25_atb_unchecked as summa25_atb
from summasim.backends import array_module
from summasim.mpiutil import agree, fields_of, fingerprint, local_error
from summasim.spec import (ATTENTIONS, block_range, partition, positive_int,  # noqa: F401
                           vocab_block)

from . import model, ops
from .model import Config

Array = Any

# row-0 hosted vectors of one layer, packed in this order into one broadcast buffer
VEC_KEYS = ("ln1.g", "ln1.b", "attn.qkv.b", "attn.proj.b", "ln2.g", "ln2.b", "mlp.fc.b",
            "mlp.proj.b")
MAT_KEYS = ("attn.qkv.w", "attn.proj.w", "mlp.fc.w", "mlp.proj.w")
# a SwiGLU layer's: the gate's bias packed right after the up projection's
SWIGLU_VEC_KEYS = VEC_KEYS[:7] + ("mlp.gate.b",) + VEC_KEYS[7:]


def vec_keys(mlp: str = "gelu") -> tuple:
    """The row-0 hosted vectors of one layer in packing order (:data:`VEC_KEYS`, or
    :data:`SWIGLU_VEC_KEYS` with ``mlp.gate.b`` after ``mlp.fc.b``)."""
    return SWIGLU_VEC_KEYS if mlp == "swiglu" else VEC_KEYS


def _identity(x):
    return x


# --------------------------------------------------------------------------- #
# checks and local shapes (pure: no communication)                            #
# --------------------------------------------------------------------------- #
def _grid_label(grid) -> str:
    if grid.pr == grid.pc:
        return f"[q, q, d] = [{grid.pr}, {grid.pc}, {grid.d}]"
    return f"[pr, pc, d] = [{grid.pr}, {grid.pc}, {grid.d}]"


def _check_grid(grid, fields=("pr", "pc", "d", "row", "col", "depth", "layer", "world")) -> None:
    """``TypeError`` unless ``grid`` is a Grid (raised alone: no communicator to agree over)."""
    if not all(hasattr(grid, f) for f in fields):
        raise TypeError(f"optimus: grid must be a summasim.grid.Grid, got "
                        f"{type(grid).__name__}")


def check(config: Config, grid, batch: Optional[int] = None) -> None:
    """Raise unless ``config`` (and a batch of ``batch`` sequences) fits ``grid``.

    On a ``[pr, pc, d]`` grid (``pr = pc = q`` square) needs ``b % (d pr) == 0`` (whole
    sequences per rank) and at least one key/value head (one head without grouped-query
    attention) per column, ``kv_heads >= pc``: each column holds the whole heads of
    block j of their balanced partition (:func:`head_groups`), so its attention is
    local. Nothing else need divide: the weights' rows (h and the MLP width F over pr)
    and F over pc are the balanced partition, and the vocabulary is padded
    (:func:`padded_vocab`). A classification head (``n_classes = k > 0``) adds
    nothing: any k fits (``cls.w`` is cut along h only, see the module docstring).
    Pure: no communication, so every rank raises the same ``ValueError`` (naming the
    dimension, its size and the divisor or the least) before anything is sent.
    ``TypeError`` for a non-Grid.
    """
    model.need_config(config)
    _check_grid(grid, ("pr", "pc", "d", "row", "col", "depth", "layer"))   # pure: no world
    pr, pc, d = grid.pr, grid.pc, grid.d
    rows_sym, sym = ("d*q", "q") if pr == pc else ("d*pr", "pc")
    check_sizes(config, batch, d * pr, rows_sym, pc, sym,
                f"optimus on a {_grid_label(grid)} grid", "column")


def check_sizes(config: Config, batch: Optional[int], rows: int, rows_sym: str, blocks: int,
                sym: str, where: str, holder: str) -> None:
    """The checks of a grid that cuts the batch into ``rows`` blocks of whole sequences
    (``rows_sym`` names them) and the heads into ``blocks`` (``sym``) of whole heads, the
    balanced partition of the key/value heads (:func:`head_groups`: at least one per
    ``holder``); ``ValueError`` naming the size and the divisor or the least. Pure."""
    if batch is not None and int(batch) % rows:
        raise ValueError(f"{where}: batch b = {int(batch)} is not divisible by {rows_sym} = "
                         f"{rows} (each rank holds b/({rows_sym}) whole sequences)")
    what = "kv heads = Config.kv_heads" if config.kv_heads != config.heads else \
        "heads n = Config.heads"
    if config.kv_heads < blocks:
        raise ValueError(f"{where}: {what} = {config.kv_heads} is smaller than {sym} = "
                         f"{blocks} (each {holder} holds at least one whole head)")


def _size(n: int, parts: int, index: int) -> int:
    """Items of block ``index`` of the balanced partition of ``n`` into ``parts``."""
    lo, hi = block_range(n, parts, index)
    return hi - lo


def head_groups(config: Config, pc: int) -> list[int]:
    """The ``pc + 1`` offsets of the key/value heads over the pc columns: the balanced
    partition of the kv heads (each one group of ``g = n/kv`` query heads; without
    grouped-query attention one head). Column j holds kv heads ``[lo_j, hi_j)`` and
    their query heads ``[g lo_j, g hi_j)``: whole heads, so its attention is local."""
    return partition(config.kv_heads, pc)


def column_cut(config: Config, pc: int, what: str = "h") -> list[int]:
    """The ``pc + 1`` offsets of the columns of an activation (or a weight's output)
    over the pc columns of the grid, by what it holds: ``"h"`` the hidden size, cut at
    the query heads of each column's kv heads (:func:`head_groups`; ``h/pc`` when pc
    divides the kv heads); ``"W"`` the QKV width in the permuted order of
    :func:`qkv_permutation`, column j ``[Q_j | K_j | V_j]``; ``"F"`` the MLP width, the
    balanced partition. Pure."""
    hd = config.hidden // config.heads
    g = config.heads // config.kv_heads
    kv = head_groups(config, pc)
    if what == "h":
        return [g * hd * lo for lo in kv]
    if what == "W":
        return [(g + 2) * hd * lo for lo in kv]
    return partition(config.ffn, pc)


def _width(config: Config, pc: int, j: int, what: str = "h") -> int:
    """Columns of block j of :func:`column_cut`."""
    cut = column_cut(config, pc, what)
    return cut[j + 1] - cut[j]


#: what the last axis of each parameter holds (the column cut it follows); the rest "h"
_COLUMNS = {"attn.qkv.w": "W", "attn.qkv.b": "W", "mlp.fc.w": "F", "mlp.fc.b": "F",
            "mlp.gate.w": "F", "mlp.gate.b": "F", "head.w": "V"}


def _param_cut(name: str, config: Config, pr: int, pc: int) -> list[int]:
    """The pc + 1 offsets of the last axis of parameter ``name`` over the columns (the
    vocabulary padded: :func:`padded_vocab`)."""
    top, _, rest = name.partition(".")
    what = _COLUMNS.get(rest if top[:1] == "h" and top[1:].isdigit() else name, "h")
    if what == "V":
        return partition(padded_vocab(config.vocab, pr, pc), pc)
    return column_cut(config, pc, what)


def padded_vocab(vocab: int, pr: int, pc: int) -> int:
    """The vocabulary the 2D/2.5D schemes hold: ``v`` padded to a multiple of
    ``lcm(pr, pc)`` (``q`` on a square grid), so that ``wte``'s rows cut into pr even
    blocks for the embedding and the logits' columns into pc even blocks for the
    cross-entropy. The padding is zeros that no token looks up, left out of the
    softmax (:func:`summasim.spec.vocab_block`)."""
    step = math.lcm(int(pr), int(pc))
    return vocab_block(vocab, step) * step


def _vec_sizes(config: Config, grid) -> dict:
    """``{key: local size}`` of the layer's row-0 vectors in packing order: column
    block j (of pc) of each (:func:`column_cut`)."""
    return {key: _width(config, grid.pc, grid.j, _COLUMNS.get(key, "h"))
            for key in vec_keys(config.mlp)}


CLS_KEYS = ("cls.w", "cls.b")     # the classification head's: neither 2d nor column-blocked


def _is_row0_key(name: str) -> bool:
    """Vectors (biases, LayerNorm) and wpe are hosted on row 0; wte and weights are 2d.
    (The classifier's :data:`CLS_KEYS` are neither: see :func:`_cls_shape`.)"""
    return name == "wpe" or name.rsplit(".", 1)[-1] in ("b", "g")


def _cls_shape(name: str, config: Config, pc: int, i: int, j: int) -> tuple:
    """Local shape of ``cls.w`` (row 0: ``[h/pc, k]``, the rows ``H_j``; else ``[0, k]``)
    or ``cls.b`` (rank (0, 0): ``[k]``; else ``[0]``). Pure."""
    k = config.n_classes
    if name == "cls.w":
        return (_width(config, pc, j) if i == 0 else 0, k)
    return (k if i == 0 and j == 0 else 0,)


def local_shapes(config: Config, grid) -> dict:
    """``{name: local shape}`` on this rank, in the order of ``model.param_shapes``.

    On a ``[pr, pc, d]`` grid, rank ``(i, j, k)``: 2d blocks ``(rows/pr, cols/pc)`` for
    ``wte`` and the weights (``attn.qkv.w`` ``(h/pr, W/pc)`` with ``W = h + 2
    kv_width``; SwiGLU's ``mlp.gate.w`` like ``mlp.fc.w`` ``(h/pr, F/pc)``; the untied
    ``head.w`` ``(h/pr, v'/pc)``), block ``(i, j)`` of the balanced partition of each
    axis (the vocabulary padded to ``v'``, :func:`padded_vocab`); on row 0 the column
    block j of each row-0 hosted array (``(n/pc,)``, ``wpe``: ``(s, h/pc)``), elsewhere
    a zero-size array (``(0,)``, ``wpe``: ``(0, h/pc)``). A classifier's ``cls.w`` is
    ``(h/pc, k)`` on row 0 and ``(0, k)`` elsewhere, ``cls.b`` ``(k,)`` on rank (0, 0)
    and ``(0,)`` elsewhere.
    """
    check(config, grid)
    return {name: _local_shape(name, shape, config, grid.pr, grid.pc, grid.i, grid.j)
            for name, shape in model.param_shapes(config).items()}


def _local_shape(name: str, shape: tuple, config: Config, pr: int, pc: int, i: int,
                 j: int) -> tuple:
    """The local shape of parameter ``name`` (serial ``shape``) on rank ``(i, j)`` of a
    ``pr x pc`` layer (:func:`local_shapes`). Pure."""
    if name in CLS_KEYS:
        return _cls_shape(name, config, pc, i, j)
    cut = _param_cut(name, config, pr, pc)
    if _is_row0_key(name):      # column block j on row 0; leading extent 0 elsewhere
        block = shape[:-1] + (cut[j + 1] - cut[j],)
        return block if i == 0 else (0,) + block[1:]
    nr, _ = _padded_shape(name, shape, config, pr, pc)
    return (_size(nr, pr, i), cut[j + 1] - cut[j])


def _padded_shape(name: str, shape: tuple, config: Config, pr: int, pc: int) -> tuple:
    """The serial shape of a 2d parameter with its vocabulary axis padded to
    :func:`padded_vocab`."""
    v = padded_vocab(config.vocab, pr, pc)
    if name == "wte":
        return (v, shape[1])
    if name == "head.w":
        return (shape[0], v)
    return tuple(shape)


def _pad_vocab(arr, name: str, config: Config, pr: int, pc: int):
    """``arr`` (a serial 2d parameter) with zero rows (``wte``) or columns (``head.w``)
    padding its vocabulary to :func:`padded_vocab`; ``arr`` itself when it is."""
    full = _padded_shape(name, arr.shape, config, pr, pc)
    if tuple(arr.shape) == full:
        return arr
    out = array_module(arr).zeros(full, dtype=arr.dtype)
    out[:arr.shape[0], :arr.shape[1]] = arr
    return out


def layer_products(config: Config) -> dict:
    """``{phase: (K, K')}``: the SUMMA products ``Y[M, K'] = X[M, K] W[K, K']`` of one
    layer, in forward order, named by their ``tp.`` trace phase (``M = b s`` rows).

    ``attn.qkv`` ``(h, W)`` with ``W = h + 2 kv_width`` (grouped-query attention
    narrows it), ``attn.proj`` ``(h, h)``, ``mlp.fc`` ``(h, F)``, for SwiGLU
    ``mlp.gate`` ``(h, F)`` too (one more product, like ``mlp.fc``), ``mlp.proj``
    ``(F, h)``, with ``F = round(f h)``. Pure.
    """
    h, f = config.hidden, config.ffn
    out = {"attn.qkv": (h, config.qkv_width), "attn.proj": (h, h), "mlp.fc": (h, f)}
    if config.mlp == "swiglu":
        out["mlp.gate"] = (h, f)
    out["mlp.proj"] = (f, h)
    return out


def layer_payload(config: Config, batch: int, q: int, d: int = 1,
                  seq: Optional[int] = None, *, pc: Optional[int] = None, j: int = 0) -> dict:
    """Per-rank Optimus Table 1 payload of one layer, in items (scalars), for any variant.

    ``s`` is ``seq`` (default ``config.seq``), ``b`` the global ``batch``. Each SUMMA
    product ``ab`` of an ``[b s, K]`` activation and a ``[K, K']`` weight
    (:func:`layer_products`) broadcasts, per rank, the activation's and the weight's
    blocks once over the q steps: ``(b s K / d + K K') / q`` items; its two backward
    products ``abt`` (weight broadcast, ``dX`` reduce) and ``atb`` (activation broadcast,
    ``dW`` reduce) move as much each. Summed::

        fwd = (b s (3h + F [+ h]) / d + h (W + h + 2F [+ F])) / q

    (``[...]``: SwiGLU's gate product; ``W = h + 2 kv_width``, ``F = round(f h)``): for
    GPT-2 (W = 3h, F = 4h, GELU) Optimus's ``(7 b s h / d + 12 h^2) / q``, and
    ``((3 + f) b s h / d + (4 + 2f) h^2) / q`` for a GELU MLP of width f h. Returns
    ``{"fwd", "bwd", "bwd_checkpoint"}`` = fwd, 2 fwd, 3 fwd (``recompute="full"``
    recomputes the forward's products); 0 when q = 1. ``recompute="selective"`` and
    ``attention="flash"`` send what "none" and "plain" send. Exact integers when ``b``
    divides by ``d q`` and ``h``, ``kv_width``, ``F`` by ``q``.
    SUMMA2.5's depth all-reduce of the ``dW`` (summa25_atb) is not Table 1 traffic and
    is not counted. Pure.

    On a rectangular ``[pr, pc, d]`` grid (``q = pr`` rows, ``pc`` columns), or where
    the MLP width F does not divide, each product moves, on a rank of column ``j``,
    ``b s K / (d pr)`` items along its row (the activation's pieces over the steps;
    nothing when pc = 1) and ``K K'_j`` down its column (the weight's pieces, ``K'_j``
    column block j of ``K'`` by the balanced partition; nothing when pr = 1); column 0
    moves the most.
    """
    pr, d = int(q), int(d)
    pc = pr if pc is None else int(pc)
    m = int(batch) * (config.seq if seq is None else int(seq))
    if pr == pc and config.kv_heads % pc == 0 and config.ffn % pc == 0:
        fwd = 0 if pr == 1 else sum(m * k // d + k * k2
                                    for k, k2 in layer_products(config).values()) // pr
    else:
        widths = {"attn.qkv": "W", "mlp.fc": "F", "mlp.gate": "F"}
        fwd = sum((m // (d * pr) * k if pc > 1 else 0)
                  + (k * _width(config, pc, j, widths.get(name, "h")) if pr > 1 else 0)
                  for name, (k, _) in layer_products(config).items())
    return {"fwd": fwd, "bwd": 2 * fwd, "bwd_checkpoint": 3 * fwd}


def classifier_payload(config: Config, batch: int, q: int, d: int = 1, *, i: int = 0,
                       j: int = 0, pc: Optional[int] = None) -> dict:
    """Per-rank items of the classification head's own messages on rank ``(i, j, .)``.

    ``{"fwd": {(op, group): items}, "bwd": {(op, group): items}}`` for the phases
    ``clshead.fwd``, ``loss`` and ``clshead.bwd`` (module docstring), ``b = batch``,
    ``k = config.n_classes``, ``bl = b/(dq)``, ``own = h k / q`` (``+ k`` on column
    ``j = 0``, which also carries ``cls.b``); on a ``[pr, pc, d]`` grid (``q = pr``)
    ``bl = b/(d pr)`` and ``own = h k / pc``::

        fwd  ("bcast", "col"): own    ("allreduce", "row"): bl k
             ("allreduce", "col"): 1  ("allreduce", "depth"): 1      (the loss sum)
        bwd  ("reduce", "col"): own   ("ring", "depth"): own   (row 0, d > 1: the length
                                                                  of the ring all-reduce)

    A group of one sends nothing: row entries only when pc > 1, col entries only when
    pr > 1, depth entries only when d > 1. The final LayerNorm (``lnf.*``) is the LM
    head's and not counted. Pure.
    """
    pr, d, k = int(q), int(d), int(config.n_classes)
    pc = pr if pc is None else int(pc)
    if k <= 0:
        raise ValueError(f"classifier_payload needs Config.n_classes > 0, got {k}")
    own = _width(config, pc, j) * k + (k if j == 0 else 0)
    bl = int(batch) // (d * pr)
    fwd, bwd = {}, {}
    if pc > 1:
        fwd[("allreduce", "row")] = bl * k
    if pr > 1:
        fwd[("bcast", "col")] = own
        fwd[("allreduce", "col")] = 1
        bwd[("reduce", "col")] = own
    if d > 1:
        fwd[("allreduce", "depth")] = 1
        if i == 0:
            bwd[("ring", "depth")] = own
    return {"fwd": fwd, "bwd": bwd}


def _check_local(local_params: dict, config: Config, grid, what: str) -> None:
    if not isinstance(local_params, dict):
        raise TypeError(f"optimus: {what} must be a dict of arrays, got "
                        f"{type(local_params).__name__}")
    want = local_shapes(config, grid)
    missing = [k for k in want if k not in local_params]
    extra = [k for k in local_params if k not in want]
    if missing or extra:
        raise ValueError(f"optimus: {what} do not match the config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for name, shape in want.items():
        arr = local_params[name]
        if tuple(getattr(arr, "shape", ())) != shape:
            raise ValueError(f"optimus: {what}[{name!r}] has shape "
                             f"{tuple(getattr(arr, 'shape', ()))}, expected {shape} on rank "
                             f"(i, j, k) = {grid.coords} of a {_grid_label(grid)} grid")
        if getattr(arr, "dtype", None) != config.dtype:
            raise ValueError(f"optimus: {what}[{name!r}] has dtype "
                             f"{getattr(arr, 'dtype', None)}, Config.dtype is {config.dtype}")


def qkv_permutation(hidden: int, q: int, kv_width: Optional[int] = None, *,
                    head_dim: Optional[int] = None) -> np.ndarray:
    """Column order of ``attn.qkv`` such that column block j is ``[Q_j | K_j | V_j]``.

    The serial columns are ``[Q | K | V]``: Q the ``h`` columns of the n query heads,
    K and V the ``kv_width = kv hd`` columns of the kv key/value heads each (default
    ``hidden``: no grouped-query attention). ``Q_j`` are the Q columns ``j h/q ..
    (j+1) h/q`` (query heads ``j n/q .. (j+1) n/q``), ``K_j`` and ``V_j`` the K and V
    columns ``j kv_width/q .. (j+1) kv_width/q`` (kv heads ``j kv/q .. (j+1) kv/q``).

    Cutting both contiguously by q keeps grouped-query attention local: serially query
    head i reads kv head ``i // g``, ``g = n/kv``. Column j's first query head is
    ``j n/q = j (kv/q) g``, a multiple of g, so its local query head ``i'`` (global
    ``j n/q + i'``) reads kv head ``j kv/q + i' // g``: local kv head ``i' // g`` of the
    same column, the mapping :func:`ops.attention_core_forward` applies to ``n/q``
    query and ``kv/q`` kv heads (``q | kv`` makes ``kv/q`` an integer). ``w_local =
    w[:, perm]``; ``g[:, perm] = g_perm`` undoes it.

    With ``head_dim`` given, q need not divide the kv heads: column j holds the kv heads
    of block j of their balanced partition (:func:`head_groups`) and their query heads,
    ``Q_j`` the query columns ``g hd [lo_j, hi_j)``, ``K_j``/``V_j`` the columns
    ``hd [lo_j, hi_j)`` of K and V: the same order when q divides them.
    """
    kvw = hidden if kv_width is None else kv_width
    if head_dim is None:
        hq, kq = hidden // q, kvw // q
        qcut, kcut = [j * hq for j in range(q + 1)], [j * kq for j in range(q + 1)]
    else:
        kv = partition(kvw // head_dim, q)
        g = hidden // kvw
        qcut, kcut = [g * head_dim * lo for lo in kv], [head_dim * lo for lo in kv]
    return np.concatenate([part for j in range(q) for part in (
        np.arange(qcut[j], qcut[j + 1]),                                   # Q_j
        hidden + np.arange(kcut[j], kcut[j + 1]),                          # K_j
        hidden + kvw + np.arange(kcut[j], kcut[j + 1]))])                  # V_j  (W,)


# --------------------------------------------------------------------------- #
# small traced helpers (skip groups of one, as the algorithms do)             #
# --------------------------------------------------------------------------- #
def _products(grid, config: Config):
    """``(ab, abt, atb)``: the SUMMA products for d == 1, the SUMMA2.5 ones for d > 1,
    each called as ``ab(a, b, dim)`` with ``dim`` what the dimension it steps over (ab:
    k, abt: n, atb: m) holds: ``"h"`` the hidden size, ``"F"`` the MLP width, ``"V"``
    the padded vocabulary. Its two cuts give the steps: over the pc columns
    :func:`column_cut` (the vocabulary: even blocks), over the pr rows the balanced
    partition (:func:`summasim.algorithms.summa.parts_of` orders them by form).

    The unchecked twins (see the imports): :func:`forward` checked and agreed on every
    shape once, so the products of a step do not agree again.
    """
    fns = (summa_ab, summa_abt, summa_atb) if grid.d == 1 else (summa25_ab, summa25_abt,
                                                                summa25_atb)
    v = padded_vocab(config.vocab, grid.pr, grid.pc)
    sizes = {"h": config.hidden, "F": config.ffn, "V": v}
    cols = {"h": column_cut(config, grid.pc), "F": column_cut(config, grid.pc, "F"),
            "V": partition(v, grid.pc)}
    cuts = {dim: (cols[dim], partition(size, grid.pr)) for dim, size in sizes.items()}

    def bind(fn, form):
        # parts_of's order: ab and atb (the pc cut, the pr cut), abt (pr, pc)
        def run(a, b, dim):
            pc_cut, pr_cut = cuts[dim]
            return fn(a, b, grid, parts=(pr_cut, pc_cut) if form == "abt" else (pc_cut, pr_cut))
        return run

    return tuple(bind(fn, form) for fn, form in zip(fns, ("ab", "abt", "atb")))


def _allreduce(comm, a, op="sum"):
    """All-reduce over ``comm`` (nothing on a group of one); returns the result."""
    if comm.size == 1:
        return a
    return comm.allreduce(a, op=op)


def _row_hooks(grid):
    """Reductions over the hidden / vocab axis, split along ``grid.row``: all-reduces
    in forward. Their conjugates: a LayerNorm's backward calls ``sum_row`` again for
    its two means (the statistics' gradient is a row sum too); the cross-entropy's
    backward is local (this vocab block's logit gradient), so it has none."""
    row = grid.row

    def sum_row(a):         # (N, C) -> (N, 1), summed over the whole row
        return _allreduce(row, ops.local_sum(a))     # all-reduce over grid.row

    def max_row(a):         # (N, C) -> (N, 1), max over the whole row
        return _allreduce(row, ops.local_max(a), op="max")   # all-reduce over grid.row

    return sum_row, max_row


def _bcast_from_row0(grid, local, size, xp, dtype, out=None):
    """Forward: column broadcast from row 0 of a packed 1-D buffer (``local`` on row 0)
    (backward: :func:`_reduce_to_row0`, the column sum onto row 0 of its gradient)."""
    buf = out if out is not None else xp.empty(size, dtype=dtype)        # (size,)
    if grid.i == 0:
        buf[...] = local
    if grid.col.size > 1:
        grid.col.bcast(buf, root=0)
    return buf


def _reduce_to_row0(grid, partial, xp, what: str):
    """Backward of :func:`_bcast_from_row0` (forward: broadcast down the column from
    row 0): sum ``partial`` over the column onto row 0 (phase ``aux.<what>.reduce``)
    and, d > 1, over the depth among the row-0 ranks (phase ``aux.<what>.depth``).

    Returns the sum on row 0, None on the other rows.
    """
    if grid.col.size > 1:
        total = xp.empty_like(partial) if grid.i == 0 else None
        with grid.trace.phase(f"aux.{what}.reduce"):
            grid.col.reduce(partial, total, root=0)
    else:
        total = partial
    if grid.i == 0 and grid.depth.size > 1:
        with grid.trace.phase(f"aux.{what}.depth"):
            ring_allreduce(total, grid.depth, out=total)
    return total


# --------------------------------------------------------------------------- #
# shard / unshard                                                             #
# --------------------------------------------------------------------------- #
def shard(params: dict, config: Config, grid, keys=None) -> dict:
    """This rank's local parameters from the serial ``params`` (no data moves).

    Keys are those of ``model.param_shapes(config)``, or only ``keys`` when given (e.g.
    a pipeline stage's); shapes are :func:`local_shapes`.
    ``attn.qkv.w``/``.b`` columns are permuted by :func:`qkv_permutation` first.
    Returns fresh C-contiguous copies, never views of ``params`` (an in-place
    optimizer step on the shards must not touch the serial model). A config that does
    not fit or ``params`` that do not match it, on any rank, raise on every rank (one
    untraced agreement, :func:`summasim.mpiutil.agree`).
    """
    _check_grid(grid)
    shapes, err = local_error(lambda: (local_shapes(config, grid),       # checks config
                                       model.check_params(params, config))[0])
    agree("optimus.shard", grid, fields_of(config, "Config"), err)
    xp = array_module(params["wte"])
    pr, pc, i, j = grid.pr, grid.pc, grid.i, grid.j
    perm = xp.asarray(qkv_permutation(config.hidden, pc, config.kv_width,
                                      head_dim=config.hidden // config.heads))
    local = {}
    wanted = None if keys is None else set(keys)
    for name, arr in params.items():
        if wanted is not None and name not in wanted:
            continue
        if name in CLS_KEYS:                       # row 0: cls.w[H_j, :]; (0, 0): cls.b
            n0 = shapes[name][0]
            cut = column_cut(config, pc)           # cls.w's rows: the hidden columns H_j
            blk = arr[cut[j]:cut[j] + n0] if name == "cls.w" else arr[:n0]   # n0 = 0 off row 0
            local[name] = xp.array(blk, copy=True, order="C")
            continue
        if not _is_row0_key(name):
            arr = _pad_vocab(arr, name, config, pr, pc)
        cut = _param_cut(name, config, pr, pc)
        cols = slice(cut[j], cut[j + 1])
        if name.endswith(("attn.qkv.w", "attn.qkv.b")):
            cols = perm[cols]                      # column block j = [Q_j | K_j | V_j]
        if not _is_row0_key(name):                 # 2d block (i, j)
            blk = arr[slice(*block_range(arr.shape[0], pr, i))][:, cols]
        elif i == 0:                               # row 0 hosts column block j
            blk = arr[..., cols]
        else:                                      # other rows: zero-size, same key
            blk = xp.empty(shapes[name], dtype=arr.dtype)
        local[name] = xp.array(blk, copy=True, order="C")   # never a view of params
    return local


def unshard(local_grads: dict, config: Config, grid) -> dict:
    """Serial-layout arrays (keys and shapes of ``model.init_params``) on every rank.

    Works for local params as well as local grads: 2d blocks come from every rank of
    the layer, row-0 hosted arrays from row 0 (a classifier's ``cls.w`` from row 0,
    ``cls.b`` from rank (0, 0)); the qkv permutation is undone. One
    all-gather over ``grid.layer`` (phase ``"unshard/aux.gather"``) of a packed buffer.
    Bad ``local_grads`` on any rank, or configs that differ, raise on every rank
    before it (the untraced agreement).
    """
    _check_grid(grid)
    _, err = local_error(lambda: (check(config, grid),
                                  _check_local(local_grads, config, grid, "local_grads")))
    agree("optimus.unshard", grid, fields_of(config, "Config"), err)
    xp = array_module(local_grads["wte"])
    pr, pc = grid.pr, grid.pc
    shapes = model.param_shapes(config)
    # every rank packs the same layout: each parameter's block in the room of the largest
    # (rank (0, 0)'s: the balanced partition puts the larger blocks first), zeros where a
    # rank holds less (off row 0, the row-0 arrays hold nothing)
    room = {name: math.prod(_local_shape(name, shape, config, pr, pc, 0, 0))
            for name, shape in shapes.items()}
    total = sum(room.values())
    buf = xp.zeros(total, dtype=config.dtype)                              # (S,)
    off = {}
    o = 0
    for name in shapes:
        off[name] = o
        arr = local_grads[name]
        if arr.size:
            buf[o:o + arr.size] = arr.reshape(-1)
        o += room[name]
    if grid.layer.size > 1:
        parts = xp.empty((grid.layer.size, total), dtype=config.dtype)    # (pr*pc, S)
        with grid.trace.phase("unshard"), grid.trace.phase("aux.gather"):
            grid.layer.allgather(buf, parts)
    else:
        parts = buf[None]                                                   # (1, S)
    perm = qkv_permutation(config.hidden, pc, config.kv_width,
                           head_dim=config.hidden // config.heads)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)

    def block(name, shape, ii, jj):        # rank (ii, jj)'s block of ``name``
        want = _local_shape(name, shape, config, pr, pc, ii, jj)
        return parts[ii * pc + jj, off[name]:off[name] + math.prod(want)].reshape(want)

    out = {}
    for name, shape in shapes.items():
        if name == "cls.b":       # rank (0, 0) alone
            full = block(name, shape, 0, 0)                                 # (k,)
        elif name == "cls.w":     # row 0 holds the rows H_j
            full = xp.concatenate([block(name, shape, 0, jj) for jj in range(pc)])   # (h, k)
        elif _is_row0_key(name):  # row 0 holds column block j
            full = xp.concatenate([block(name, shape, 0, jj) for jj in range(pc)],
                                  axis=-1)                                  # shape
        else:
            full = xp.concatenate([xp.concatenate([block(name, shape, ii, jj)
                                                   for jj in range(pc)], axis=1)
                                   for ii in range(pr)], axis=0)            # padded shape
            full = full[:shape[0], :shape[1]]                               # the pad dropped
        if name.endswith("attn.qkv.w") or name.endswith("attn.qkv.b"):
            full = full[..., xp.asarray(inv)]
        out[name] = xp.ascontiguousarray(full)
    return out


# --------------------------------------------------------------------------- #
# one layer                                                                   #
# --------------------------------------------------------------------------- #
class LayerCache(NamedTuple):
    vec: dict                     # broadcast row-0 vectors (views of one packed buffer)
    ln1: ops.LayerNormCache
    a: Array                      # ln1 output = qkv input, (N, h/q)
    core: Any                     # the core's cache for the n/q (kv/q) local heads of bl
    #                               sequences: AttentionCoreCache, AttentionInputsCache
    #                               (selective) or FlashCache
    y: Array                      # merged attention output = proj input, (N, h/q)
    ln2: ops.LayerNormCache
    m: Array                      # ln2 output = fc (and gate) input, (N, h/q)
    gelu: Optional[ops.GeluCache]  # fc output (pre-activation), (N, F/q); None for SwiGLU
    g: Array                      # gelu (or swiglu) output = proj input, (N, F/q)
    swiglu: Optional[ops.SwigluCache] = None   # SwiGLU: gate and up blocks, (N, F/q) each


def _local_heads(config: Config, grid) -> tuple:
    """``(query heads, kv heads, h columns, QKV columns)`` of this rank's column j: the
    kv heads of block j of :func:`head_groups` and their query heads."""
    kv = head_groups(config, grid.pc)
    nkv = kv[grid.j + 1] - kv[grid.j]
    return (nkv * (config.heads // config.kv_heads), nkv, _width(config, grid.pc, grid.j),
            _width(config, grid.pc, grid.j, "W"))


def _broadcast_vectors(p: dict, config: Config, grid, xp):
    """The layer's row-0 vectors as views of one buffer broadcast down the column."""
    sizes = _vec_sizes(config, grid)
    keys = vec_keys(config.mlp)
    total = sum(sizes.values())
    local = xp.concatenate([p[key] for key in keys]) if grid.i == 0 else None  # (total,)
    with grid.trace.phase("aux.params.bcast"):  # (bwd: _reduce_to_row0 of the grads)
        buf = _bcast_from_row0(grid, local, total, xp, config.dtype)      # (total,)
    vec, o = {}, 0
    for key in keys:
        vec[key] = buf[o:o + sizes[key]]
        o += sizes[key]
    return vec


def _layer_forward(x, p: dict, config: Config, grid, bl: int, t: int,
                   attention: str = "plain", recompute: str = "none", tile=None):
    """One pre-LN layer on the local block x (N, h/q) -> (N, h/q) and its cache.

    ``attention``, ``recompute`` ("none" or "selective") and ``tile`` go to the local
    attention core; neither changes what is sent."""
    xp = array_module(x)
    ab, _, _ = _products(grid, config)
    h = config.hidden
    nh, nkv, hq, wq = _local_heads(config, grid)
    sum_row, _ = _row_hooks(grid)
    tr = grid.trace
    vec = _broadcast_vectors(p, config, grid, xp)
    with tr.phase("aux.ln1"):      # row all-reduces (bwd: row all-reduces, sum_row)
        a, ln1 = ops.layernorm_forward(x, vec["ln1.g"], vec["ln1.b"], sum_hidden=sum_row,
                                       hidden=h)                           # (N, h/q)
    with tr.phase("tp.attn.qkv"):  # ab (bwd: dX = abt(dY, W), dW = atb(X, dY))
        qkv = ab(a, p["attn.qkv.w"], "h")                                    # (N, W/q)
    qkv += vec["attn.qkv.b"]
    ops.stored(qkv)                                                        # 16-bit (autocast)
    qh, kh, vh = ops.split_heads(qkv.reshape(bl, t, wq), nh, nkv)  # (bl, nh|nkv, t, hd) x 3
    y = xp.empty((bl, t, hq), dtype=x.dtype)                               # (bl, t, h/q)
    y_heads = y.reshape(bl, t, nh, hq // nh).transpose(0, 2, 1, 3)         # (bl, nh, t, hd) view
    _, core = ops.attention_core_forward(qh, kh, vh, out=y_heads, attention=attention,
                                         recompute=recompute, tile=tile)
    y = y.reshape(bl * t, hq)                                              # (N, h/q)
    with tr.phase("tp.attn.proj"):  # ab (bwd: dX = abt(dY, W), dW = atb(X, dY))
        x1 = ab(y, p["attn.proj.w"], "h")                                    # (N, h/q)
    x1 += vec["attn.proj.b"]
    x1 += x                                                                # residual 1
    ops.stored(x1)
    with tr.phase("aux.ln2"):      # row all-reduces (bwd: row all-reduces, sum_row)
        m, ln2 = ops.layernorm_forward(x1, vec["ln2.g"], vec["ln2.b"], sum_hidden=sum_row,
                                       hidden=h)                           # (N, h/q)
    with tr.phase("tp.mlp.fc"):    # ab (bwd: dX = abt(dY, W), dW = atb(X, dY))
        f = ab(m, p["mlp.fc.w"], "h")                                        # (N, F/q)
    f += vec["mlp.fc.b"]
    ops.stored(f)
    gelu = swiglu = None
    if config.mlp == "swiglu":     # gate laid out as fc: matching (N, F/q) blocks
        with tr.phase("tp.mlp.gate"):  # ab (bwd: dX = abt(dY, W), dW = atb(X, dY))
            gate = ab(m, p["mlp.gate.w"], "h")                               # (N, F/q)
        gate += vec["mlp.gate.b"]
        ops.stored(gate)
        g, swiglu = ops.swiglu_forward(gate, f)                            # (N, F/q)
    else:
        g, gelu = ops.gelu_forward(f)                                      # (N, F/q)
    with tr.phase("tp.mlp.proj"):  # ab (bwd: dX = abt(dY, W), dW = atb(X, dY))
        out = ab(g, p["mlp.proj.w"], "F")                                  # (N, h/q)
    out += vec["mlp.proj.b"]
    out += x1                                                              # residual 2
    ops.stored(out)
    return out, LayerCache(vec=vec, ln1=ln1, a=a, core=core, y=y, ln2=ln2, m=m, gelu=gelu, g=g,
                           swiglu=swiglu)


def _layer_backward(dout, c: LayerCache, p: dict, config: Config, grid, bl: int, t: int):
    """The layer forward read in reverse: dx (N, h/q) and the layer's local grads."""
    xp = array_module(dout)
    _, abt, atb = _products(grid, config)
    nh, nkv, hq, wq = _local_heads(config, grid)
    tr = grid.trace
    sizes = _vec_sizes(config, grid)
    keys = vec_keys(config.mlp)
    offs, o = {}, 0
    for key in keys:
        offs[key] = o
        o += sizes[key]
    vgrad = xp.empty(o, dtype=dout.dtype)                                  # packed local sums
    view = {key: vgrad[offs[key]:offs[key] + sizes[key]] for key in keys}
    grads = {}

    dout.sum(axis=0, out=view["mlp.proj.b"])                               # (h/q,)
    with tr.phase("tp.mlp.proj.dX"):   # abt (fwd: ab(g, W))
        dg = ops.stored(abt(dout, p["mlp.proj.w"], "F"))                   # (N, F/q)
    with tr.phase("tp.mlp.proj.dW"):   # atb (fwd: ab(g, W)); d > 1: + depth all-reduce
        grads["mlp.proj.w"] = atb(c.g, dout, "F")                          # (F/q, h/q)
    if c.swiglu is None:
        df, _ = ops.gelu_backward(dg, c.gelu)                              # (N, F/q)
    else:
        (dgate, df), _ = ops.swiglu_backward(dg, c.swiglu)                 # 2 x (N, F/q)
    df.sum(axis=0, out=view["mlp.fc.b"])                                   # (F/q,)
    with tr.phase("tp.mlp.fc.dX"):     # abt (fwd: ab(m, W))
        dm = ops.stored(abt(df, p["mlp.fc.w"], "h"))                        # (N, h/q)
    with tr.phase("tp.mlp.fc.dW"):     # atb (fwd: ab(m, W)); d > 1: + depth all-reduce
        grads["mlp.fc.w"] = atb(c.m, df, "h")                                # (h/q, F/q)
    if c.swiglu is not None:           # the gate read ln2's output too: add its dX
        dgate.sum(axis=0, out=view["mlp.gate.b"])                          # (F/q,)
        with tr.phase("tp.mlp.gate.dX"):   # abt (fwd: ab(m, W_gate))
            dm += abt(dgate, p["mlp.gate.w"], "h")                           # (N, h/q)
            ops.stored(dm)
        with tr.phase("tp.mlp.gate.dW"):   # atb (fwd: ab(m, W_gate)); d > 1: + depth
            grads["mlp.gate.w"] = atb(c.m, dgate, "h")                       # (h/q, F/q)
    with tr.phase("aux.ln2"):          # row all-reduces (fwd: row all-reduces, sum_row)
        dx1, gl = ops.layernorm_backward(dm, c.ln2)                        # (N, h/q)
    view["ln2.g"][...] = gl["g"]
    view["ln2.b"][...] = gl["b"]
    dx1 += dout                                                            # residual 2
    ops.stored(dx1)
    dx1.sum(axis=0, out=view["attn.proj.b"])                               # (h/q,)
    with tr.phase("tp.attn.proj.dX"):  # abt (fwd: ab(y, W))
        dy = ops.stored(abt(dx1, p["attn.proj.w"], "h"))                     # (N, h/q)
    with tr.phase("tp.attn.proj.dW"):  # atb (fwd: ab(y, W)); d > 1: + depth all-reduce
        grads["attn.proj.w"] = atb(c.y, dx1, "h")                            # (h/q, h/q)
    hd = hq // nh
    dy_heads = dy.reshape(bl, t, nh, hd).transpose(0, 2, 1, 3)             # (bl, nh, t, hd) view
    dqkv = xp.empty((bl, t, wq), dtype=dout.dtype)                         # (bl, t, W/q)
    ops.attention_core_backward(dy_heads, c.core,
                                out=ops.split_heads(dqkv, nh, nkv))        # [dQ|dK|dV] views
    dqkv = dqkv.reshape(bl * t, wq)                                        # (N, W/q)
    dqkv.sum(axis=0, out=view["attn.qkv.b"])                               # (W/q,)
    with tr.phase("tp.attn.qkv.dX"):   # abt (fwd: ab(a, W))
        da = ops.stored(abt(dqkv, p["attn.qkv.w"], "h"))                     # (N, h/q)
    with tr.phase("tp.attn.qkv.dW"):   # atb (fwd: ab(a, W)); d > 1: + depth all-reduce
        grads["attn.qkv.w"] = atb(c.a, dqkv, "h")                            # (h/q, W/q)
    with tr.phase("aux.ln1"):          # row all-reduces (fwd: row all-reduces, sum_row)
        dx, gl = ops.layernorm_backward(da, c.ln1)                         # (N, h/q)
    view["ln1.g"][...] = gl["g"]
    view["ln1.b"][...] = gl["b"]
    dx += dx1                                                              # residual 1
    ops.stored(dx)
    # the vectors' gradients: column sums of every rank, onto row 0 (and over depth)
    total = _reduce_to_row0(grid, vgrad, xp, "grads")     # (fwd: _broadcast_vectors)
    for key in keys:
        grads[key] = (total[offs[key]:offs[key] + sizes[key]] if grid.i == 0
                      else xp.empty((0,), dtype=dout.dtype))
    return dx, grads


# --------------------------------------------------------------------------- #
# embedding, final LayerNorm, LM head                                         #
# --------------------------------------------------------------------------- #
def _embed_forward(params: dict, tok, config: Config, grid):
    """x (N, h/q) = onehot(tokens) wte[:, H_j] + wpe[:t, H_j], SUMMA over the pr vocab
    blocks of wte's rows."""
    xp = array_module(params["wte"])
    tr = grid.trace
    q, col = grid.pr, grid.col
    bl, t = tok.shape
    wte = xp.ascontiguousarray(params["wte"])     # (v/q, h/q), broadcast as it is: MPI
    vq, hq = wte.shape                            # needs C order (a copy if it is not)
    x = xp.zeros((bl, t, hq), dtype=wte.dtype)                             # (bl, t, h/q)
    caches = []
    bufs = tuple(xp.empty((vq, hq), wte.dtype) for _ in range(2 if q > 1 else 0))

    def post(l):
        # step l: block wte[V_l, H_j] travels down column j from row l
        blk = wte if grid.i == l else bufs[l % 2]
        if q == 1:
            return blk, None
        with tr.phase("aux.wte.bcast"):   # bcast down grid.col (bwd: ireduce onto row l)
            return blk, col.ibcast(blk, root=l)

    nxt = post(0)
    for l in range(q):
        blk, req = nxt
        if req is not None:
            req.wait()
        if l + 1 < q:  # overlap the next broadcast with this lookup
            nxt = post(l + 1)
        xl, cache = ops.embedding_forward(tok, blk, None, vocab_start=l * vq,
                                          combine_vocab=_identity)         # (bl, t, h/q)
        x += xl
        caches.append(cache)
    wpe_local = params["wpe"][:t].reshape(-1) if grid.i == 0 else None
    with tr.phase("aux.wpe.bcast"):  # (bwd: _reduce_to_row0 of dwpe)
        wpe = _bcast_from_row0(grid, wpe_local, t * hq, xp, wte.dtype)     # (t*h/q,)
    x += wpe.reshape(t, hq)
    return x.reshape(bl * t, hq), caches                                   # (N, h/q)


def _embed_backward(dx, caches, wpe_shape: tuple, grid, bl: int, t: int):
    """``dwte`` block (v/q, h/q) of the embedding and ``dwpe`` (row 0: (s, h/q))."""
    xp = array_module(dx)
    tr = grid.trace
    q, col = grid.pr, grid.col
    vq, hq = caches[0].wte_shape
    dx3 = dx.reshape(bl, t, hq)                                            # (bl, t, h/q)
    dwte = xp.empty((vq, hq), dtype=dx.dtype) if q > 1 else None
    reqs, parts = [], []
    for l in range(q):
        # partial dwte[V_l, H_j] of this rank's tokens, summed down column j onto row l
        _, g = ops.embedding_backward(dx3, caches[l])                      # (v/q, h/q)
        if q == 1:
            dwte = g["wte"]
            continue
        parts.append(g["wte"])  # alive until its reduce completes
        with tr.phase("aux.wte.reduce"):  # reduce onto row l (fwd: bcast down grid.col)
            reqs.append(col.ireduce(g["wte"], dwte if grid.i == l else None, root=l))
    for r in reqs:
        r.wait()
    if grid.depth.size > 1:
        with tr.phase("aux.wte.depth"):   # all-reduce over grid.depth (fwd: replicated)
            ring_allreduce(dwte, grid.depth, out=dwte)
    dwpe_t = dx3.sum(axis=0).reshape(-1)                                   # (t*h/q,)
    total = _reduce_to_row0(grid, dwpe_t, xp, "wpe")        # (fwd: _bcast_from_row0)
    if grid.i == 0:
        dwpe = xp.zeros(wpe_shape, dtype=dx.dtype)                         # (s, h/q)
        dwpe[:t] = total.reshape(t, hq)
    else:
        dwpe = xp.empty(wpe_shape, dtype=dx.dtype)                         # (0, h/q)
    return dwte, dwpe


def _lnf_forward(x, params: dict, config: Config, grid):
    xp = array_module(x)
    hq = _width(config, grid.pc, grid.j)
    local = xp.concatenate([params["lnf.g"], params["lnf.b"]]) if grid.i == 0 else None
    with grid.trace.phase("aux.params.bcast"):  # (bwd: _reduce_to_row0 of the grads)
        buf = _bcast_from_row0(grid, local, 2 * hq, xp, x.dtype)           # (2h/q,)
    sum_row, _ = _row_hooks(grid)
    with grid.trace.phase("aux.ln"):   # row all-reduces (bwd: row all-reduces, sum_row)
        return ops.layernorm_forward(x, buf[:hq], buf[hq:], sum_hidden=sum_row,
                                     hidden=config.hidden)                  # (N, h/q)


def _lnf_backward(dx, cache, config: Config, grid):
    xp = array_module(dx)
    hq = _width(config, grid.pc, grid.j)
    with grid.trace.phase("aux.ln"):   # row all-reduces (fwd: row all-reduces, sum_row)
        dx, g = ops.layernorm_backward(dx, cache)                          # (N, h/q)
    total = _reduce_to_row0(grid, xp.concatenate([g["g"], g["b"]]), xp,
                            "grads")      # row 0: (2h/q,) (fwd: _bcast_from_row0)
    if grid.i == 0:
        return dx, {"lnf.g": total[:hq], "lnf.b": total[hq:]}
    empty = xp.empty((0,), dtype=dx.dtype)
    return dx, {"lnf.g": empty, "lnf.b": empty.copy()}


def _local_rows(tokens, grid, xp):
    """This rank's sequences: row block k pr + i of the batch, (b/(d pr), t)."""
    bl = tokens.shape[0] // (grid.d * grid.pr)
    r = grid.k * grid.pr + grid.i
    return xp.asarray(tokens[r * bl:(r + 1) * bl])


# --------------------------------------------------------------------------- #
# the pieces: embedding, one layer, head (unchecked; the engine checks once)  #
# --------------------------------------------------------------------------- #
# Between pieces the activation block X[M_{kq+i}, H_j] travels as (bl, t, h/q), a
# view of the (N, h/q) rows the layers compute on: a layer needs t for its attention.
class EmbedCache(NamedTuple):
    grid: Any
    emb: list                    # q EmbeddingCaches, one per vocab block
    wpe_shape: tuple             # local wpe shape: (s, h/q) on row 0, (0, h/q) elsewhere


def embed_forward(p: dict, tokens, config: Config, grid):
    """x (bl, t, h/q) = onehot(tokens) wte[:, H_j] + wpe[:t, H_j] (phase ``embed.fwd``).

    ``tokens``: the global micro-batch [b, s]; this rank embeds its ``bl = b/(dq)``
    sequences (row block ``k q + i``). ``p`` needs ``wte`` and ``wpe`` (local blocks).
    Unchecked: :func:`forward` checks.
    """
    xp = array_module(p["wte"])
    tok = _local_rows(tokens, grid, xp)                                    # (bl, t)
    bl, t = tok.shape
    with grid.trace.phase("embed.fwd"):
        x, emb = _embed_forward(p, tok, config, grid)                      # (N, h/q)
    return x.reshape(bl, t, -1), EmbedCache(grid=grid, emb=emb,
                                            wpe_shape=p["wpe"].shape)  # (bl, t, h/q)


def embed_backward(dx, cache: EmbedCache) -> dict:
    """``{"wte": (v/q, h/q), "wpe": row 0 (s, h/q), else (0, h/q)}`` (phase ``embed.bwd``):
    the embedding's part of the tied ``wte`` gradient, summed over the column (and
    the depth), and ``wpe``'s gradient on row 0."""
    bl, t, _ = dx.shape
    with cache.grid.trace.phase("embed.bwd"):
        dwte, dwpe = _embed_backward(dx, cache.emb, cache.wpe_shape, cache.grid, bl, t)
    return {"wte": dwte, "wpe": dwpe}


class LayerPieceCache(NamedTuple):
    config: Config
    grid: Any
    l: int                       # global layer index (phase names)
    params: dict                 # the layer's local params, read again in the backward
    checkpoint: bool             # recompute == "full"
    block: Any                   # LayerCache, or the input (bl, t, h/q) if checkpointed
    recompute: str = "none"      # "none", "selective" or "full"
    attention: str = "plain"     # "plain" or "flash"
    tile: Optional[int] = None   # flash's key/value tile (None: flash's default)


def _how(checkpoint, recompute, attention) -> str:
    """``recompute`` resolved with ``checkpoint`` (:func:`model.forward`'s rule: True is
    "full"); ``ValueError`` for an unknown or contradictory mode or attention. Pure."""
    mode = model._recompute_mode(checkpoint, recompute)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    return mode


def layer_forward(x, p_layer: dict, l: int, config: Config, grid, checkpoint: bool = False,
                  *, recompute: Optional[str] = None, attention: str = "plain",
                  tile: Optional[int] = None):
    """Layer ``l`` (phase ``h{l}.fwd``) on the block x (bl, t, h/q) -> (bl, t, h/q).

    ``p_layer``: the layer's local params under the unprefixed keys of
    ``ops.block_keys(config.mlp)`` (SwiGLU adds ``mlp.gate.w``/``.b``). ``recompute``
    (default "full" if ``checkpoint`` else "none", as :func:`model.forward`): "full"
    keeps only ``x`` and ``p_layer`` and :func:`layer_backward` recomputes the layer;
    "selective" keeps the layer's cache but the attention core's probabilities, which
    the backward recomputes from the kept q, k, v. ``attention`` ("plain" or "flash")
    and ``tile`` go to the local attention core. None of them changes the traffic.
    """
    mode = _how(checkpoint, recompute, attention)
    bl, t, hq = x.shape
    with grid.trace.phase(f"h{l}.fwd"):
        out, block = _layer_forward(x.reshape(bl * t, hq), p_layer, config, grid, bl, t,
                                    attention, "selective" if mode == "selective" else "none",
                                    tile)                                  # (N, h/q)
    full = mode == "full"
    return out.reshape(bl, t, hq), LayerPieceCache(
        config=config, grid=grid, l=l, params=p_layer, checkpoint=full,
        block=x if full else block, recompute=mode, attention=attention,
        tile=tile)                                                         # (bl, t, h/q)


def layer_backward(dx, cache: LayerPieceCache):
    """``(dx (bl, t, h/q), unprefixed local grads)`` of the layer (phase ``h{l}.bwd``).

    Reads the weights from ``cache.params``; checkpointed (recompute "full"), the
    forward is recomputed first from the saved input (its phases inside ``h{l}.bwd``),
    bitwise as it ran; "selective" recomputes the attention probabilities inside the
    core's backward (no communication).
    """
    config, grid, p = cache.config, cache.grid, cache.params
    bl, t, hq = dx.shape
    with grid.trace.phase(f"h{cache.l}.bwd"):
        if cache.checkpoint:     # recompute the layer's forward from its saved input
            _, block = _layer_forward(cache.block.reshape(bl * t, hq), p, config, grid, bl, t,
                                      cache.attention, "none", cache.tile)
        else:
            block = cache.block
        dx, grads = _layer_backward(dx.reshape(bl * t, hq), block, p, config, grid,
                                    bl, t)                                 # (N, h/q)
    return dx.reshape(bl, t, hq), grads


class HeadCache(NamedTuple):
    config: Config
    grid: Any
    params: dict                 # needs "wte" (tied) or "head.w" (untied) again in the backward
    shape: tuple                 # (bl, t): local sequences and their length
    lnf: ops.LayerNormCache
    xf: Array                    # final hidden states (lnf output), (N, h/q)
    logits: Array                # local logits block, (N, v/q): vocab block j; classifier:
    #                              (bl, k), the whole logits of the row's sequences
    ce: Optional[ops.CrossEntropyCache]   # None when no targets were given
    n_items: Optional[int]       # the denominator of the mean loss (None: no targets)
    cls_w: Optional[Array] = None   # classifier: cls.w[H_j, :] as broadcast, (h/q, k)


def _cls_sizes(config: Config, grid) -> tuple:
    """``(h/q * k, own)``: the items of this column's ``cls.w`` rows, and of the packed
    ``[cls.w[H_j, :] | cls.b]`` buffer (``cls.b`` rides on column 0 only)."""
    k = config.n_classes
    hk = _width(config, grid.pc, grid.j) * k
    return hk, hk + (k if grid.j == 0 else 0)


def _cls_forward(xf, p: dict, config: Config, grid, bl: int, t: int):
    """Logits (bl, k) of the last tokens of the block xf (N, h/q), replicated over the
    row, and the broadcast ``cls.w[H_j, :]`` (h/q, k) (phase ``clshead.fwd``)."""
    xp = array_module(xf)
    tr = grid.trace
    hq, k = _width(config, grid.pc, grid.j), config.n_classes
    hk, own = _cls_sizes(config, grid)
    # row 0 packs [cls.w[H_j, :] | cls.b]; cls.b is (0,) off column 0, so one expression
    local = (xp.concatenate([p["cls.w"].reshape(-1), p["cls.b"]]) if grid.i == 0
             else None)                                                    # (own,)
    with tr.phase("aux.params.bcast"):  # col bcast from row 0 (bwd: _reduce_to_row0)
        buf = _bcast_from_row0(grid, local, own, xp, xf.dtype)             # (own,)
    w = buf[:hk].reshape(hq, k)                                            # (h/q, k)
    x_last = xf.reshape(bl, t, hq)[:, -1]                                  # (bl, h/q) last token
    z = x_last @ w                                                         # (bl, k) partial: H_j
    if grid.j == 0:
        z += buf[hk:]                                                      # + cls.b, once per row
    with tr.phase("aux.logits"):   # all-reduce over grid.row (bwd: none, dlogits replicated)
        lg = _allreduce(grid.row, z)                                       # (bl, k)
    return ops.stored(lg), w                                               # 16-bit (autocast)


def _cls_backward(dlogits, cache: HeadCache):
    """``dx`` (N, h/q) of the classifier, zero but at the last tokens, and its grads
    (phase ``clshead.bwd``): row 0 ``cls.w`` (h/q, k), rank (0, 0) ``cls.b`` (k,),
    zero-size elsewhere."""
    config, grid = cache.config, cache.grid
    xp = array_module(dlogits)
    bl, t = cache.shape
    hq, k = _width(config, grid.pc, grid.j), config.n_classes
    hk, own = _cls_sizes(config, grid)
    # dlogits (bl, k) is the same on every rank of the row: the conjugate of the forward's
    # row all-reduce is this copy, so dx's column block needs no message
    dx = xp.zeros((bl, t, hq), dtype=dlogits.dtype)                        # (bl, t, h/q)
    dx[:, -1] = dlogits @ cache.cls_w.T                                    # (bl, h/q)
    x_last = cache.xf.reshape(bl, t, hq)[:, -1]                            # (bl, h/q)
    part = xp.empty(own, dtype=dlogits.dtype)                              # packed partials
    part[:hk].reshape(hq, k)[...] = x_last.T @ dlogits                     # (h/q, k)
    if grid.j == 0:                # the bias was added by column 0 alone
        dlogits.sum(axis=0, out=part[hk:])                                 # (k,)
    # column sums onto row 0, then (d > 1) over depth (fwd: _bcast_from_row0)
    total = _reduce_to_row0(grid, part, xp, "grads")
    if grid.i == 0:
        grads = {"cls.w": total[:hk].reshape(hq, k), "cls.b": total[hk:]}
    else:
        grads = {"cls.w": xp.empty((0, k), dtype=dlogits.dtype),
                 "cls.b": xp.empty((0,), dtype=dlogits.dtype)}
    return ops.stored(dx.reshape(bl * t, hq)), grads                       # (N, h/q)


def head_forward(x, p: dict, targets, config: Config, grid, n_items: Optional[int] = None):
    """Final LayerNorm, LM head (or classifier) and loss on the block x (bl, t, h/q).

    Phases ``lnf.fwd``, ``lmhead.fwd`` (``clshead.fwd`` for a classifier) and, with
    ``targets`` (the global micro-batch's [b, s], [b] classes for a classifier, or None
    for logits only), ``loss``. ``p`` needs ``lnf.g``, ``lnf.b`` and the head: ``wte``
    (tied, ``logits = abt(x, wte)``), with ``config.tied`` False ``head.w`` (``logits =
    ab(x, head.w)``), or with ``config.n_classes = k > 0`` ``cls.w``, ``cls.b``
    (``logits = x[:, -1] cls.w + cls.b`` from each sequence's last token, ``[bl, k]``
    replicated over the row; module docstring). Returns ``(loss, cache)``: the sum of
    the per-item losses over ``n_items`` (default: the micro-batch's ``b*s`` tokens, or
    its ``b`` sequences for a classifier), the same float on every rank; None without
    targets.
    """
    head_key = "cls.w" if config.n_classes else "wte" if config.tied else "head.w"
    xp = array_module(p[head_key])
    tr = grid.trace
    bl, t, hq = x.shape
    with tr.phase("lnf.fwd"):
        xf, lnf = _lnf_forward(x.reshape(bl * t, hq), p, config, grid)   # (N, h/q)
    if config.n_classes:
        with tr.phase("clshead.fwd"):
            lg, cls_w = _cls_forward(xf, p, config, grid, bl, t)          # (bl, k), (h/q, k)
        loss, ce = None, None
        if targets is not None:
            if n_items is None:
                n_items = math.prod(targets.shape)                         # b
            tgt = _local_rows(targets, grid, xp)                           # (bl,)
            with tr.phase("loss"):
                # whole rows of k logits: a local cross-entropy, no row reduction
                losses, ce = ops.cross_entropy_forward(lg, tgt)            # (bl,)
                total = losses.sum().reshape(1)                            # (1,) this row block
                with tr.phase("aux.mean"):  # col, depth all-reduces (bwd: none, 1/n_items)
                    total = _allreduce(grid.col, total)
                    total = _allreduce(grid.depth, total)
            loss = float(total[0]) / n_items
        return loss, HeadCache(config=config, grid=grid, params=p, shape=(bl, t), lnf=lnf,
                               xf=xf, logits=lg, ce=ce, n_items=n_items, cls_w=cls_w)
    ab, abt, _ = _products(grid, config)
    with tr.phase("lmhead.fwd"), tr.phase("aux.logits"):
        if config.tied:   # abt (bwd: ab and atb)
            lg = abt(xf, p["wte"], "V")                                    # (N, v/q)
        else:             # ab (bwd: abt and atb)
            lg = ab(xf, p["head.w"], "h")                                  # (N, v/q)
        ops.stored(lg)                                                     # 16-bit (autocast)
    loss, ce = None, None
    if targets is not None:
        if n_items is None:
            n_items = math.prod(targets.shape)                             # b * s
        tgt = _local_rows(targets, grid, xp).reshape(-1)                   # (N,)
        sum_row, max_row = _row_hooks(grid)
        with tr.phase("loss"):
            with tr.phase("aux.ce"):   # row all-reduces (bwd: none, dlogits is local)
                start = grid.j * lg.shape[1]                               # v'/pc ids a block
                losses, ce = ops.cross_entropy_forward(
                    lg, tgt, vocab_start=start, max_vocab=max_row, sum_vocab=sum_row,
                    vocab_valid=config.vocab - start)                      # (N,)
            total = losses.sum().reshape(1)                                # (1,) this row block
            with tr.phase("aux.mean"):  # col, depth all-reduces (bwd: none, 1/n_items seed)
                total = _allreduce(grid.col, total)
                total = _allreduce(grid.depth, total)
        loss = float(total[0]) / n_items
    return loss, HeadCache(config=config, grid=grid, params=p, shape=(bl, t), lnf=lnf, xf=xf,
                           logits=lg, ce=ce, n_items=n_items)


def head_backward(cache: HeadCache, loss_scale: float = 1.0):
    """``(dx (bl, t, h/q), grads)`` of the head, seeded with ``loss_scale/n_items`` per
    token (per sequence for a classifier) (``loss_scale``: mixed precision's S);
    phases ``lmhead.bwd`` (``clshead.bwd``), ``lnf.bwd``. ``grads``: ``lnf.g``, ``lnf.b``
    (row 0; zero-size elsewhere) and the LM head's part of the tied ``wte`` gradient
    (v/q, h/q), or the untied ``head.w``'s whole gradient (h/q, v/q), or the
    classifier's ``cls.w`` (row 0: (h/q, k)) and ``cls.b`` (rank (0, 0): (k,)),
    zero-size elsewhere."""
    if cache.ce is None:
        raise ValueError("optimus.backward needs a forward with targets")
    config, grid = cache.config, cache.grid
    xp = array_module(cache.logits)
    tr = grid.trace
    ab, abt, atb = _products(grid, config)
    dlosses = xp.full(cache.logits.shape[0], float(loss_scale) / cache.n_items,
                      dtype=cache.logits.dtype)                            # (N,) S/n_items
    dlogits, _ = ops.cross_entropy_backward(dlosses, cache.ce)             # (N, v/q)
    if config.n_classes:          # dlosses (bl,): S/n_items per sequence; dlogits (bl, k)
        with tr.phase("clshead.bwd"):
            dx, cls_grads = _cls_backward(dlogits, cache)                  # (N, h/q)
        with tr.phase("lnf.bwd"):
            dx, grads = _lnf_backward(dx, cache.lnf, config, grid)         # (N, h/q)
        grads.update(cls_grads)
        return dx.reshape(cache.shape + (-1,)), grads                      # (bl, t, h/q)
    with tr.phase("lmhead.bwd"):
        if config.tied:
            with tr.phase("aux.logits.dX"):    # ab (fwd: abt(xf, wte))
                dx = ops.stored(ab(dlogits, cache.params["wte"], "V"))       # (N, h/q)
            with tr.phase("aux.logits.dW"):    # atb (fwd: abt(xf, wte))
                dhead = atb(dlogits, cache.xf, "V")                          # (v/q, h/q)
        else:
            with tr.phase("aux.logits.dX"):    # abt (fwd: ab(xf, head.w))
                dx = ops.stored(abt(dlogits, cache.params["head.w"], "h"))   # (N, h/q)
            with tr.phase("aux.logits.dW"):    # atb (fwd: ab(xf, head.w))
                dhead = atb(cache.xf, dlogits, "h")                          # (h/q, v/q)
    with tr.phase("lnf.bwd"):
        dx, grads = _lnf_backward(dx, cache.lnf, config, grid)             # (N, h/q)
    grads["wte" if config.tied else "head.w"] = dhead
    return dx.reshape(cache.shape + (-1,)), grads                          # (bl, t, h/q)


stage_keys = model.stage_keys


# --------------------------------------------------------------------------- #
# model: the pieces in a row                                                  #
# --------------------------------------------------------------------------- #
class OptimusCache(NamedTuple):
    params: dict                 # local params (the keys and order of the gradients)
    shape: tuple                 # (bl, t): local sequences and their length
    batch: int                   # global b
    emb: EmbedCache
    layers: list                 # per layer: LayerPieceCache
    head: HeadCache
    logits: Array                # local logits block, (N, v/q): vocab block j; classifier:
    #                              (bl, k), replicated over the row
    loss: Optional[float]

    @property
    def blocks(self) -> list:
        """Per layer: the LayerCache, or its input (bl, t, h/q) if checkpointed."""
        return [layer.block for layer in self.layers]


def forward(local_params: dict, tokens, targets, config: Config, grid,
            checkpoint: bool = False, *, recompute: Optional[str] = None,
            attention: str = "plain", tile: Optional[int] = None):
    """Mean cross-entropy over the ``b*s`` tokens (over the ``b`` sequences, from each
    one's last token, with ``config.n_classes > 0``) and the cache, on every rank.

    Parameters
    ----------
    local_params : dict
        This rank's parameters from :func:`shard` (keys of ``model.param_shapes``).
    tokens, targets : integer arrays [b, s] (targets [b] classes for a classifier)
        The GLOBAL batch on every rank; each rank takes its b/(dq) sequences.
        ``targets`` may be None (logits only; :func:`backward` then refuses).
    config : model.Config
    grid : summasim.grid.Grid
        ``[q, q, d]``; d == 1 is Optimus, d > 1 SUMMA2.5-LM.
    checkpoint : bool
        Keep only each layer's input block and recompute the layer in backward
        (``recompute="full"``).
    recompute : {None, "none", "selective", "full"}, keyword-only
        As :func:`model.forward` (None: "full" if ``checkpoint`` else "none"; a
        contradiction raises). "selective" keeps every layer's cache but the attention
        probabilities, recomputed in the backward. The gradients are bitwise the same
        in every mode, and so is the traffic but for "full"'s recomputed forward.
    attention : {"plain", "flash"}, keyword-only
        The local attention core (flash: blockwise, online softmax, ``tile`` its
        key/value tile). No traffic changes.

    Returns
    -------
    loss : float or None
        The same on every rank.
    cache : OptimusCache
        ``cache.logits`` is the local block ``[N, v/q]`` (a classifier's ``[b/(dq), k]``,
        replicated over the row); see :func:`logits`.

    Raises
    ------
    ValueError, TypeError
        On every rank alike, before any data moves (:func:`check`, shapes, ids): every
        rank checks its own arguments (its local parameter shapes against what its
        coordinates should hold), then one untraced agreement
        (:func:`summasim.mpiutil.agree`) on the config, the tokens and targets (shape,
        dtype, checksum), ``checkpoint``, ``recompute``, ``attention``, ``tile`` and
        every rank's check.

    Notes
    -----
    The pieces in a row: :func:`embed_forward`, :func:`layer_forward` for every
    layer, :func:`head_forward`.
    """
    return run_forward(sys.modules[__name__], "optimus", OptimusCache, local_params, tokens,
                       targets, config, grid, checkpoint, recompute, attention, tile)


def run_forward(mod, name: str, cache_type, local_params: dict, tokens, targets,
                config: Config, grid, checkpoint, recompute, attention, tile):
    """A scheme module's ``forward`` (this one's, :mod:`summasim.transformer.tp3d`'s):
    every rank checks its arguments (``mod.check``, ``mod._check_local``), one untraced
    agreement, then ``mod``'s pieces in a row; returns ``(loss, cache_type(...))``."""
    mod._check_grid(grid)

    def local():
        _how(checkpoint, recompute, attention)
        mod.check(config, grid)
        model.check_tokens(tokens, config)
        mod.check(config, grid, batch=tokens.shape[0])
        if targets is not None:
            model.check_targets(targets, tokens, config)
        mod._check_local(local_params, config, grid, "local_params")
        if tile is not None:
            positive_int("tile", tile)

    _, err = local_error(local)
    agree(f"{name}.forward", grid, {**fields_of(config, "Config"),
                                    "tokens": fingerprint(tokens),
                                    "targets": fingerprint(targets),
                                    "checkpoint": bool(checkpoint),
                                    "recompute": str(recompute), "attention": str(attention),
                                    "tile": str(tile)}, err)
    x, emb = mod.embed_forward(local_params, tokens, config, grid)         # (bl, t, h/q)
    layers = []
    for l in range(config.layers):
        x, layer = mod.layer_forward(x, model.layer_params(local_params, l), l, config, grid,
                                     checkpoint, recompute=recompute, attention=attention,
                                     tile=tile)                            # (bl, t, h/q)
        layers.append(layer)
    loss, head = mod.head_forward(x, local_params, targets, config, grid)
    return loss, cache_type(params=local_params, shape=head.shape, batch=tokens.shape[0],
                            emb=emb, layers=layers, head=head, logits=head.logits, loss=loss)


def backward(cache: OptimusCache) -> dict:
    """Local gradients of the mean loss: same keys, order and shapes as the local params.

    Row-0 hosted gradients hold the column-sum over the grid (and the depth) on row 0
    and are zero-size elsewhere; 2d gradients are identical on every layer k. The
    pieces in reverse (:func:`head_backward`, :func:`layer_backward` from the last
    layer down, :func:`embed_backward`); the tied ``wte`` gradient is the embedding's
    part plus the LM head's; with an untied head (or a classifier) it is the
    embedding's alone and ``head.w`` (``cls.w``, ``cls.b``) has its own.
    """
    return run_backward(sys.modules[__name__], cache)


def run_backward(mod, cache) -> dict:
    """A scheme module's ``backward``: ``mod``'s pieces in reverse, the tied ``wte``
    gradient the embedding's part plus the head's."""
    dx, grads = mod.head_backward(cache.head)                              # (bl, t, h/q)
    for l in reversed(range(len(cache.layers))):
        dx, g = mod.layer_backward(dx, cache.layers[l])                    # (bl, t, h/q)
        for key, val in g.items():
            grads[f"h{l}.{key}"] = val
    g = mod.embed_backward(dx, cache.emb)
    dwte_head = grads.get("wte")                                           # None: untied
    grads["wte"], grads["wpe"] = g["wte"], g["wpe"]
    if dwte_head is not None:
        grads["wte"] += dwte_head                                          # tied: embed + head
    return {key: grads[key] for key in cache.params}


def local_logits(full, config: Config, grid):
    """This rank's block ``[N, v/q]`` of the global logits ``full`` ``[b, s, v]`` (what
    ``cache.logits`` holds; a classifier's: rows ``k q + i`` of ``[b, k]``, ``[b/(dq), k]``);
    the inverse of :func:`logits`, and no data moves."""
    if config.n_classes:
        bl = full.shape[0] // (grid.d * grid.pr)
        r = grid.k * grid.pr + grid.i
        return full[r * bl:(r + 1) * bl]                                   # (bl, k)
    lay = "2d" if grid.d == 1 else "2.5d"
    flat = full.reshape(-1, config.vocab)
    padded = padded_vocab(config.vocab, grid.pr, grid.pc)
    if padded != config.vocab:                                             # zero columns
        wide = array_module(flat).zeros((flat.shape[0], padded), dtype=flat.dtype)
        wide[:, :config.vocab] = flat
        flat = wide
    return layout.split(flat, grid, lay)


def _join_cls_logits(lg, grid):
    """A classifier's logits [b, k] from every rank's (bl, k): all-gathers over
    ``grid.col`` (row blocks i), then ``grid.depth`` (k), each skipped on a group of one."""
    xp = array_module(lg)
    full = xp.ascontiguousarray(lg)                                        # (bl, k)
    for comm in (grid.col, grid.depth):        # row block k q + i: i inner, k outer
        if comm.size > 1:
            parts = xp.empty((comm.size,) + full.shape, dtype=full.dtype)  # (size, rows, k)
            comm.allgather(full, parts)
            full = parts.reshape(-1, full.shape[-1])                       # (size rows, k)
    return full


def logits(cache: OptimusCache, config: Config, grid):
    """The global logits [b, s, v] on every rank (a classifier's [b, k]; an all-gather;
    for checks)."""
    if config.n_classes:
        with grid.trace.phase("logits"), grid.trace.phase("aux.join"):
            return _join_cls_logits(cache.logits, grid)                    # (b, k)
    lay = "2d" if grid.d == 1 else "2.5d"
    t = cache.shape[1]
    with grid.trace.phase("logits"), grid.trace.phase("aux.join"):
        full = layout.join(cache.logits, grid, lay)                        # (b*t, padded v)
    if full.shape[-1] != config.vocab:                                     # drop the pad
        full = array_module(full).ascontiguousarray(full[:, :config.vocab])
    return full.reshape(cache.batch, t, config.vocab)
