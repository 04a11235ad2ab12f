"""Cost of one transformer layer under Megatron (1D), Optimus (2D), SUMMA2.5-LM and the
3D layer.

Symbols: b batch, s sequence length, h hidden size, n attention heads, v vocabulary,
N layers, f the MLP multiplier (``ffn``: the MLP is f h wide; GPT-2 has f = 4), p
ranks; Optimus runs on a ``pr x pc`` grid (p = pr pc; the papers' q x q, p = q^2),
SUMMA2.5-LM on ``[pr, pc, d]`` (p = d pr pc; the papers' [q, q, d]), the 3D layer on
the q x q x q cube (p = q^3, d = q). One layer is
attention (QKV [h, 3h], scores, projection [h, h]) and an MLP ([h, f h], [f h, h]);
activations are [b s, h]. The formulas below are
written for any f, with the GPT-2 values (f = 4) in brackets where the papers
print them.

A grid must fit the model it runs (:func:`misfit`): Megatron cuts the heads (key/value
head groups) and the MLP width f h over p by the balanced partition, at least one per
rank, and prices its busiest rank (:func:`~.scheme.megatron_shares`: ``ceil(n/p)``
heads where p does not divide them); Optimus and SUMMA2.5-LM need whole sequences per
rank (the batch over d pr) and a key/value head group per column: each column holds
whole heads, the groups' balanced partition over pc, and h and the QKV width are cut at
them; the weights' rows (h and f h over pr) and the MLP width over pc are the balanced
partition, any size. The cost model prices the busiest rank, rank (0, 0, 0), whose
blocks are the largest (column 0's head groups, ``ceil(f h/pc)`` MLP columns:
:func:`~.scheme.grid_blocks`), where the grid runs the model (:func:`~.scheme.runs`;
else, as for real sizes, the plain quotients);
the 3D cube splits the batch over q^2 and h, the heads and f h over q; any vocabulary
is padded (Optimus and SUMMA2.5-LM to a multiple of lcm(pr, pc),
:func:`~.scheme.grid_vocab`). :func:`grid_shapes` with a config lists only the grids
that fit, so a sweep never prices a model that cannot run on its grid.

What each scheme does per layer (what :func:`layer_ops` lists)
--------------------------------------------------------------
Megatron (p)        local GEMMs on column/row slices of the weights; 2 all-reduces
                    of b s h items on the whole group per forward (after attention,
                    after the MLP) and 2 in backward (the f operator's conjugate).
Optimus (pr x pc)   each linear C = X W is ``summa_ab(bs, in, out)``; backward is
                    ``summa_abt(dC, W)`` for dX and ``summa_atb(X, dC)`` for dW
                    (Optimus eqs. 1-3; SwiGLU's gate is a product of its own, as the
                    runtime runs it); attention is local to b/pr sequences and n/pc
                    heads. On q x q that is ((3+f)bsh + (4+2f)h^2)/q items
                    [(7bsh + 12h^2)/q] of broadcast and reduce payload per rank
                    forward and twice that backward; on pr x pc each product
                    ``X[M, K] W[K, N]`` broadcasts ``M K/pr`` items along the row (pc
                    ranks) and ``K N_0`` down the column (pr ranks) in ``pr + pc -
                    gcd`` steps or, where the sizes do not divide, one per piece of
                    the merged cuts of K (at most pr + pc - 1).
SUMMA2.5-LM         the same with ``summa25_*`` on [pr, pc, d]: activations split into
                    d pr row blocks, weights 2D and replicated over depth; dW is
                    all-reduced over the depth (ring, 2(d-1) sendrecvs).
3D (q x q x q)      Bian et al. 2021's layer (the 3D product of Agarwal et al. 1995 per
                    linear, :func:`tp3d_linear_ops`): activations ``[b s/q^2, h/q]``
                    blocks alternating between two layouts, weights split over all p
                    ranks; per linear all-gathers of X over q and of W over the depth,
                    one local GEMM, a reduce-scatter of the output over q. Per rank
                    ``(q-1)/q^3 ((8+2f) b s h + (4+2f) h^2)`` words forward and
                    ``(q-1)/q^3 ((11+3f) b s h + 2 (4+2f) h^2)`` backward (GPT-2's
                    block; docs/costmodel.md derives them); attention is local to
                    b/q^2 sequences and n/q heads.

With activation checkpointing the backward pass first recomputes the forward
(its communication included), so backward = 3x forward for Optimus and 2x for
Megatron (Optimus section 4). Megatron sends nothing at p = 1 (it skips groups of
one). ``include_minor=True`` adds the non-SUMMA traffic that the paper calls
negligible, as :mod:`summasim.transformer.optimus` sends it: per layer forward ONE
packed column broadcast (pr ranks) of the eight row-0 vectors (``(9h + f h)/pc`` items,
column 0's MLP block the largest) and 4 row all-reduces (pc ranks) of ``b s/(d pr)``
LayerNorm statistics (2 per LayerNorm: mean, then variance); backward 4 such
all-reduces, ONE packed column reduce of the vector
gradients and, for d > 1, a ring all-reduce of them over the depth among the row-0
ranks. Elementwise work (GELU, softmax, LayerNorm) is not in :func:`scheme_cost`'s
compute time; :func:`step_cost` prices a whole training step with it.

Table 1 of the Optimus paper
----------------------------
:func:`table1` prices these ops with the paper's formulas (broadcast = reduce =
log2(q) beta B, all-reduce = 2 beta (p-1) B / p, alpha = 0, beta = 1 per scalar,
checkpointing on) and counts multiplications; with integer b, s, h and q a power of
two it returns exact Fractions equal to (f = 4; :func:`table1_paper` gives the same
entries for any f: 12 becomes 4 + 2f, 7 becomes 3 + f)

=======================  ======================  =================================
item                     Megatron                Optimus
=======================  ======================  =================================
forward communication    4 (p-1)/p b s h         log(p)/(2 sqrt p) (7bsh + 12h^2)
backward communication   8 (p-1)/p b s h         log(p)/(2 sqrt p) (21bsh + 36h^2)
forward computation      (12bsh^2 + 2bs^2h)/p    (12bsh^2 + 2bs^2h)/p
backward computation     (36bsh^2 + 6bs^2h)/p    (36bsh^2 + 6bs^2h)/p
=======================  ======================  =================================

Memory per rank (bytes = items x item size)
-------------------------------------------
Following Optimus section 3.1.1. Parameters per layer are (4+2f)h^2 + (9+f)h
[12h^2 + 13h] (weights and biases of QKV, projection and MLP, two LayerNorms).
Megatron splits the weights and the QKV/fc biases ((3+f)h) over p and replicates
the rest (6h); Optimus splits weights over p and keeps vectors on grid row 0
((9+f)h/pc on those ranks); SUMMA2.5-LM stores
weights over pr pc (replicated over depth) and vectors over pc; both host ``wpe`` on
row 0 as ``[s, h/pc]`` (s h / pc items on those ranks) and ``wte`` in pr x pc blocks
``[V'/pr, h/pc]`` (an untied ``head.w`` in ``[h/pr, V'/pc]``); rank (0, 0), the
busiest, holds the first blocks of the balanced partitions (``ceil(h/pr)`` rows,
``ceil(f h/pc)`` MLP columns, column 0's head groups where pc does not divide them).
The 3D layer splits its weights over p and replicates its vectors (``(9+f)h/q`` on
every rank), ``wpe [s, h/q]`` and the final LayerNorm, and splits ``wte`` (and an
untied head) over p (``ceil(v/q) h / q^2``); its workspace is the widest linear's
gathered input, gathered weight and partial output, ``(b s (i + o) + i o) / q^2``.
Gradients equal the
parameters; the optimizer adds ``optimizer_states`` x parameters (Adam: 2).

Activations kept for backward, per layer, in items of the unsplit model:
``(8+2f) b s h + b n s^2 + 4 b s`` [16 b s h + ...] (LN1 input and output, QKV 3bsh,
attention probabilities b n s^2, attention output, residual, LN2 output, fc1 and
GELU outputs f bsh each, LayerNorm mean and rstd). Megatron keeps the LayerNorm
inputs and outputs (4bsh + 4bs) whole on every rank and splits the rest over p; Optimus
and SUMMA2.5-LM split everything over p (statistics over d pr; the MLP's tensors the
busiest rank's ``ceil(f h/pc)`` columns). Without
checkpointing all N layers' activations are kept; with it, each layer's input
(b s h / p, distributed checkpoints as in the paper) plus one layer's activations
while it is recomputed. The training techniques (selective recompute, Megatron
sequence parallelism, blockwise attention) and the block variants (SwiGLU,
grouped-query attention, an untied head) change these as
:func:`~summasim.costmodel.workload.footprint._layer_activations`, :func:`layer_ops`
and :func:`recompute_ops` say, each with its source. Add two activation-gradient buffers of the layer input
size, the SUMMA workspaces (double-buffered broadcast blocks and partial sums of
the widest linear, w = max(3h, f h): (4 b s w + 2 h w)/p for Optimus [(16 b s h +
8 h^2)/p]), and with a vocabulary the embedding table and
the logits with their gradient (2 b s v / p; Optimus and SUMMA2.5-LM 2 b s V' / p).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

from . import traffic as _traffic
from ..compute.gemm import gemm_seconds as _gemm_seconds
from ..collectives import MPICH, Thresholds
from ..compute.roofline import kernels_seconds, layer_kernels
from ..machine import Machine
from ..machine.topology import Placement
from .footprint import Memory, _layer_vectors, _vector_block, memory
from .predict import price_messages
from .pricer import make_pricer
from .scheme import (SCHEMES, Scheme, TransformerConfig, _split, _whole, grid_blocks,
                     grid_shapes, megatron_shares, runs, sequence_parallel_misfit)


# -- the ops of one layer -----------------------------------------------------------------
# ("mm", algorithm, m, k, n)           distributed matmul priced by traffic + collectives
# ("gemm", m, k, n, count)             local GEMMs
# ("coll", op, group, size, items, count)  a collective priced directly
# ("ring", group, size, items, count)  summasim's ring_allreduce (2(size-1) sendrecvs)
def layer_ops(scheme: Scheme, cfg: TransformerConfig, *, include_minor: bool = False,
              checkpoint: bool | None = None, row0: bool = True) -> dict[str, list]:
    """``{"forward": [...], "backward": [...]}`` ops of one layer (see module doc).

    The backward list starts with what the recompute re-runs (:func:`recompute_ops`:
    the whole forward, or the attention core under selective recompute); ``checkpoint``
    True or False overrides ``cfg.recompute`` with ``full`` or ``none``. ``row0``: the
    rank is on grid row 0 (only those run the depth ring of the vector gradients).
    """
    recompute = cfg.recompute if checkpoint is None else ("full" if checkpoint else "none")
    b, s, h = cfg.b, cfg.s, cfg.h
    M = b * s
    p, q, d = scheme.p, scheme.q, scheme.d
    fwd, bwd = [], []
    if scheme.name == "megatron":
        heads, mlp = megatron_shares(cfg, p)
        for name, fin, fout in _linears(cfg):
            # qkv and fc1 are split by columns, proj and fc2 by rows (Megatron's f and g),
            # the busiest rank's share: its heads' columns, its MLP columns
            share = heads if name in ("qkv", "proj") else mlp
            fin, fout = (((fin, _split(fout, p)) if _LINEARS_COL[name] else (_split(fin, p), fout))
                         if share == 1 / p else
                         ((fin, fout * share) if _LINEARS_COL[name] else (fin * share, fout)))
            fwd.append(("gemm", M, fin, fout, 1))
            bwd += [("gemm", M, fout, fin, 1), ("gemm", fin, M, fout, 1)]
        fwd += _core_ops(scheme, cfg)
        bwd += _core_backward_ops(scheme, cfg)
        if p > 1:  # Megatron skips the all-reduce on a group of one (its _reduce)
            fwd += _megatron_reductions(p, M * h, 2, cfg.sequence_parallel)
            bwd += _megatron_reductions(p, M * h, 2, cfg.sequence_parallel)
    elif scheme.kind == "3d":
        if cfg.sequence_parallel:
            raise ValueError(sequence_parallel_misfit(scheme, cfg))
        width = _tp3d_widths(scheme, cfg)
        for fin, fout, a_to_b in _tp3d_linears(cfg):
            f_ops, b_ops = tp3d_linear_ops(q, M, fin, fout, a_to_b,
                                           in_w=width.get(fin), out_w=width.get(fout))
            fwd += f_ops
            bwd += b_ops
        fwd += _core_ops(scheme, cfg)
        bwd += _core_backward_ops(scheme, cfg)
        if include_minor:
            fwd_aux, bwd_aux = _tp3d_layer_aux(cfg, q)
            fwd += fwd_aux
            bwd += bwd_aux
    else:
        if cfg.sequence_parallel:
            raise ValueError(sequence_parallel_misfit(scheme, cfg))
        ab, abt, atb = summa_forms(scheme)
        cut = dict(grid_blocks(scheme, cfg).cuts)   # the columns cut at the heads, if uneven
        for fin, fout, cin, cout in _grid_linears(cfg):
            c_in, c_out = cut.get(cin), cut.get(cout)
            fwd.append(summa_op(ab, M, fin, fout, k=c_in, n=c_out))
            bwd += [summa_op(abt, M, fout, fin, k=c_out, n=c_in),
                    summa_op(atb, fin, M, fout, m=c_in, n=c_out)]
        fwd += _core_ops(scheme, cfg)
        bwd += _core_backward_ops(scheme, cfg)
        if include_minor:
            fwd_aux, bwd_aux = _optimus_layer_aux(h, M, q, d, ffn=cfg.ffn, row0=row0,
                                                  vectors=_vector_block(scheme, cfg),
                                                  pc=scheme.cols)
            fwd += fwd_aux
            bwd += bwd_aux
    if recompute == "full":
        bwd = list(fwd) + bwd
    elif recompute == "selective" and cfg.attention == "plain":
        bwd = _core_ops(scheme, cfg) + bwd
    return {"forward": fwd, "backward": bwd}


def _megatron_reductions(p, items, count, sequence_parallel) -> list:
    """The g operators of ``count`` Megatron reductions of ``items`` ([b s, h]) over p: an
    all-reduce each, or under sequence parallelism a reduce-scatter of the ``[b s, h]``
    partial sums and an all-gather of the ``[b s / p, h]`` shards (Korthikanti et al.
    2022, section 4.2.2, Figure 5: g and g-bar; the same ring bytes as the all-reduce,
    ``2 (p-1)/p b s h``, in two collectives). The all-gather of a layer's input that
    Megatron-LM repeats in backward for the weight gradient runs under the
    input-gradient GEMM (section 4.2.2) and is not priced."""
    if not sequence_parallel:
        return [("coll", "allreduce", "world", p, items, count)]
    return [("coll", "reduce_scatter", "world", p, items, count),
            ("coll", "allgather", "world", p, _split(items, p), count)]


def _attention_seqs(scheme: Scheme, cfg: TransformerConfig):
    """(sequence, head) pairs one rank attends: ``b n / p`` (Megatron, heads split; the
    busiest rank's heads where p does not divide them) or ``b/(d pr) n/pc`` (Optimus,
    SUMMA2.5-LM: its rows of sequences, its column's heads; the 3D layer's ``b/q^2 n/q``,
    d = q)."""
    if scheme.name == "megatron":
        share = megatron_shares(cfg, scheme.p)[0]
        return (_split(cfg.b * cfg.n, scheme.p) if share == 1 / scheme.p
                else cfg.b * cfg.n * share)
    return _split(cfg.b, scheme.d * scheme.q) * grid_blocks(scheme, cfg).heads


def _core_ops(scheme: Scheme, cfg: TransformerConfig) -> list:
    """The attention core's forward GEMMs per (sequence, head): ``Q K^T`` ``[s, s/n h]
    x [s/n h, s]`` and the probabilities over V ``[s, s] x [s, h/n]``: ``4 b s^2 h``
    flops over the ranks (Korthikanti et al. 2022, section 5, selective recompute's
    part). Grouped-query heads share K and V, not the products."""
    seqs, hd, s = _attention_seqs(scheme, cfg), _split(cfg.h, cfg.n), cfg.s
    return [("gemm", s, hd, s, seqs), ("gemm", s, s, hd, seqs)]


def _core_backward_ops(scheme: Scheme, cfg: TransformerConfig) -> list:
    """The attention core's backward GEMMs: dV, dP, dQ, dK (twice the forward's); with
    blockwise attention ``Q K^T`` is recomputed first, so the backward's attention flops
    are 2.5 times the forward's (Dao 2023, FlashAttention-2, section 3.1.2, Algorithm 2)."""
    seqs, hd, s = _attention_seqs(scheme, cfg), _split(cfg.h, cfg.n), cfg.s
    out = [("gemm", s, hd, s, 2 * seqs), ("gemm", s, s, hd, 2 * seqs)]
    if cfg.attention == "flash":
        out.insert(0, ("gemm", s, hd, s, seqs))
    return out


def recompute_ops(scheme: Scheme, cfg: TransformerConfig) -> list:
    """The forward ops one layer's backward re-runs first: ``cfg.recompute`` ``full``:
    the whole forward (its collectives included; Optimus section 4), ``selective``: the
    attention core's two GEMMs, ``4 b s^2 h`` flops over the ranks (Korthikanti et al.
    2022, section 5, Table 2; the softmax and dropout kernels are
    :func:`~summasim.costmodel.compute.roofline.layer_kernels`'), and nothing under
    blockwise attention, whose backward recomputes ``Q K^T`` anyway; ``none``: []."""
    if cfg.recompute == "full":
        return list(layer_ops(scheme, cfg, include_minor=True, checkpoint=False)["forward"])
    if cfg.recompute == "selective" and cfg.attention == "plain":
        return _core_ops(scheme, cfg)
    return []


_LINEARS_COL = {"qkv": True, "proj": False, "fc1": True, "fc2": False}


def _linears(cfg: TransformerConfig) -> tuple:
    """``(name, in, out)`` of the layer's four linears, in items: QKV [h, r h] (3h, or
    h + 2 k_v h/n under grouped-query attention), projection [h, h], fc1 [h, f h] (SwiGLU:
    the gate and up projections fused, [h, 2 f h], as Megatron-LM's ``linear_fc1``), fc2
    [f h, h]."""
    h, f = cfg.h, cfg.ffn_width
    return (("qkv", h, cfg.qkv_width), ("proj", h, h), ("fc1", h, cfg.fc1_width),
            ("fc2", f, h))


def _grid_linears(cfg: TransformerConfig) -> tuple:
    """``(in, out, in cut, out cut)`` of the SUMMA products of one Optimus / SUMMA2.5-LM
    layer, in the order the runtime runs them (``optimus.layer_products``): QKV [h, r h],
    projection [h, h], fc [h, f h], SwiGLU's gate [h, f h] (its own product, laid out as
    fc), fc2 [f h, h]; each width named by the column cut it follows (``"h"`` the
    hidden size, ``"W"`` the QKV width, ``"F"`` the MLP width: :func:`~.scheme.grid_blocks`)."""
    h, f = cfg.h, cfg.ffn_width
    gate = ((h, f, "h", "F"),) if cfg.mlp == "swiglu" else ()
    return ((h, cfg.qkv_width, "h", "W"), (h, h, "h", "h"), (h, f, "h", "F"), *gate,
            (f, h, "F", "h"))


def summa_op(alg: str, m, k, n, /, **cols) -> tuple:
    """The op ``("mm", alg, m, k, n)`` of a distributed product, with ``(("k",
    offsets), ...)`` appended for the dimensions whose cut over the pc columns is their
    own (``cols``: ``m=``, ``k=``, ``n=`` offsets or None; :func:`~.traffic.algorithm_messages`'s
    ``cols``)."""
    own = tuple((dim, cut) for dim, cut in sorted(cols.items()) if cut is not None)
    return ("mm", alg, m, k, n) + ((own,) if own else ())


def summa_forms(scheme: Scheme) -> tuple:
    """``(ab, abt, atb)`` of a 2D / 2.5D scheme: SUMMA's for Optimus, SUMMA2.5's for
    SUMMA2.5-LM (whose ``atb`` all-reduces dW over the depth)."""
    return (("summa_ab", "summa_abt", "summa_atb") if scheme.name == "optimus"
            else ("summa25_ab", "summa25_abt", "summa25_atb"))


def _optimus_layer_aux(h, M, q, d, ffn=4, row0=True, vectors=None, pc=None):
    """The non-SUMMA traffic of one Optimus / SUMMA2.5-LM layer on ``[pr, pc, d]`` (pr =
    ``q`` rows; ``pc = q`` unless given), as the code sends it.

    Forward: the row-0 vectors of column j (LayerNorm g and b, the biases:
    ``(9h + f h)/pc`` items for GPT-2's block; ``vectors``, the items of column 0, the
    busiest, otherwise) as ONE packed broadcast down the column (pr ranks); LayerNorm
    statistics as 4 all-reduces along the row (pc ranks) of ``b s/(d pr)`` items (2
    LayerNorms, each all-reducing the mean and then the variance). Backward: 4 row
    all-reduces (each LayerNorm backward all-reduces two means), ONE packed column reduce
    of the vector gradients onto row 0, and for d > 1 a ring all-reduce of that buffer
    over the depth among the row-0 ranks. Groups of one send nothing.
    """
    pr, pc = q, q if pc is None else pc
    fwd, bwd = [], []
    vec = _split(9 * h + _whole(ffn * h), pc) if vectors is None else vectors
    stats = _split(M, d * pr)
    if pr > 1:
        fwd.append(("coll", "bcast", "col", pr, vec, 1))
    if pc > 1:
        fwd.append(("coll", "allreduce", "row", pc, stats, 4))
        bwd.append(("coll", "allreduce", "row", pc, stats, 4))
    if pr > 1:
        bwd.append(("coll", "reduce", "col", pr, vec, 1))
    if d > 1 and row0:
        bwd.append(("ring", "depth", d, vec, 1))
    return fwd, bwd


def _tp3d_linears(cfg: TransformerConfig) -> tuple:
    """``(in, out, a_to_b)`` of the 3D layer's linears, in the order they run: QKV [h, W]
    (A -> B), attn.proj [h, h] (B -> A), mlp.fc [h, F] (A -> B), SwiGLU's mlp.gate [h, F]
    (A -> B, its own product as in the runtime), mlp.proj [F, h] (B -> A)."""
    h, f = cfg.h, cfg.ffn_width
    gate = ((h, f, True),) if cfg.mlp == "swiglu" else ()
    return ((h, cfg.qkv_width, True), (h, h, False), (h, f, True), *gate, (f, h, False))


def _tp3d_widths(scheme, cfg: TransformerConfig) -> dict:
    """``{size: the busiest rank's block of it}`` for the 3D layer's h, QKV and MLP
    widths where q does not cut them evenly (rank (0, 0, 0): its feature block 0 holds
    ``ceil(kv/q)`` key/value head groups and ``ceil(F/q)`` MLP columns, as
    :func:`~.scheme.grid_blocks` gives a q-column grid); ``{}`` when every cut is even
    (then the plain quotients hold). Keyed by size: where two of them are equal, so are
    their blocks."""
    blk = grid_blocks(scheme, cfg)
    even = not blk.cuts and blk.ffn == cfg.ffn_width / scheme.q
    if even:
        return {}
    return {cfg.h: blk.h, cfg.qkv_width: blk.qkv, cfg.ffn_width: blk.ffn}


def tp3d_linear_ops(q, M, fin, fout, a_to_b: bool = True, *, in_w=None,
                    out_w=None) -> tuple[list, list]:
    """``(forward, backward)`` ops of one linear ``Y = X W`` (``X [M, in]``, ``W [in,
    out]``) of the 3D layer on the q x q x q cube (Bian et al. 2021; Agarwal et al.
    1995), per rank, N = M / q^2 local rows.

    The input group G_in and output group G_out are ``col`` and ``row`` for an A -> B
    linear (QKV, fc, gate, the LM head), ``row`` and ``col`` for a B -> A one (the two
    projections). The weight is stored ``[in/q^2, out/q]`` (1/p of it). Items as the
    trace records them (an all-gather its piece, a reduce-scatter its whole buffer):

    forward   all-gather X ``N in/q`` over G_in, all-gather W ``in out/q^3`` over depth,
              the GEMM ``[q N, in/q] x [in/q, out/q]``, reduce-scatter of the partial
              ``[q N, out/q]`` (``N out`` items) over G_out;
    backward  all-gather dY ``N out/q`` over G_out, X again ``N in/q`` over G_in and W
              ``in out/q^3`` over depth, the GEMMs of dX ``[q N, out/q] x [out/q, in/q]``
              and dW ``[in/q, q N] x [q N, out/q]``, reduce-scatter of dX (``N in``) over
              G_in and of dW (``in out/q^2``) over depth.

    Groups of one send nothing (q = 1: the GEMMs only). ``in_w``/``out_w``: the busiest
    rank's input and output blocks where q does not cut ``in``/``out`` evenly (the
    runtime's ``tp3d.linear_payload``): ``in/q``, ``out/q`` above become them, the
    weight's depth piece ``ceil(in_w/q) out_w`` (padded to the largest, as it travels).
    """
    g_in, g_out = ("col", "row") if a_to_b else ("row", "col")
    rows = _split(M, q * q)                                # N
    big = _split(M, q)                                     # q N
    if in_w is None and out_w is None:
        i_q, o_q = _split(fin, q), _split(fout, q)
        w_piece, w_sum = _split(fin * fout, q ** 3), _split(fin * fout, q * q)
        x_piece, y_piece = _split(rows * fin, q), _split(rows * fout, q)
        x_buf, y_buf = rows * fin, rows * fout
    else:
        i_q = _split(fin, q) if in_w is None else in_w
        o_q = _split(fout, q) if out_w is None else out_w
        w_piece = -(-i_q // q) * o_q
        w_sum, x_piece, y_piece = q * w_piece, rows * i_q, rows * o_q
        x_buf, y_buf = q * x_piece, q * y_piece
    fwd = [("coll", "allgather", g_in, q, x_piece, 1),
           ("coll", "allgather", "depth", q, w_piece, 1),
           ("gemm", big, i_q, o_q, 1),
           ("coll", "reduce_scatter", g_out, q, y_buf, 1)]
    bwd = [("coll", "allgather", g_out, q, y_piece, 1),
           ("coll", "allgather", g_in, q, x_piece, 1),
           ("coll", "allgather", "depth", q, w_piece, 1),
           ("gemm", big, o_q, i_q, 1),
           ("coll", "reduce_scatter", g_in, q, x_buf, 1),
           ("gemm", i_q, big, o_q, 1),
           ("coll", "reduce_scatter", "depth", q, w_sum, 1)]
    if q == 1:
        return ([op for op in fwd if op[0] == "gemm"], [op for op in bwd if op[0] == "gemm"])
    return fwd, bwd


def _tp3d_layer_aux(cfg: TransformerConfig, q) -> tuple[list, list]:
    """The 3D layer's traffic beyond its linears (``include_minor``), per rank.

    Forward: the LayerNorm statistics, 4 ``row`` all-reduces of N = b s / q^2 items (2
    LayerNorms, mean then variance, as Optimus's); the vectors are replicated (none).
    Backward: 4 such all-reduces, then the vector gradients packed in one buffer of
    ``(6h + W + (k-1) F)/q`` items all-reduced over ``depth``, its A part (LayerNorms,
    the projections' biases: ``6h/q``) over ``col`` and its B part (the QKV, fc and
    gate biases: ``(W + (k-1) F)/q``) over ``row``. Groups of one send nothing.
    """
    if q == 1:
        return [], []
    stats = _split(cfg.b * cfg.s, q * q)
    a_part = _split(6 * cfg.h, q)
    b_part = _split(_layer_vectors(cfg) - 6 * cfg.h, q)
    fwd = [("coll", "allreduce", "row", q, stats, 4)]
    bwd = [("coll", "allreduce", "row", q, stats, 4),
           ("coll", "allreduce", "depth", q, _split(_layer_vectors(cfg), q), 1),
           ("coll", "allreduce", "col", q, a_part, 1),
           ("coll", "allreduce", "row", q, b_part, 1)]
    return fwd, bwd


# -- pricing ------------------------------------------------------------------------------
@dataclass
class PassCost:
    """One pass (forward or backward) of one layer on one rank.

    ``payload`` is in items (the summed ``nbytes / itemsize`` of the trace events),
    ``mults`` in scalar multiplications, times in seconds (slowdown included).
    On a machine with a roofline ``device``, ``compute_seconds`` includes the
    memory-bound kernels of the pass, ``memory_seconds`` of them.
    """

    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    payload: float = 0.0
    mults: float = 0.0
    by_op: dict = field(default_factory=dict)
    algorithms: dict = field(default_factory=dict)
    memory_seconds: float = 0.0

    @property
    def gemm_seconds(self) -> float:
        return self.compute_seconds - self.memory_seconds

    @property
    def seconds(self) -> float:
        return self.comm_seconds + self.compute_seconds


@dataclass
class SchemeCost:
    """Per-rank cost of a scheme: one layer's passes, the N-layer step, memory."""

    scheme: Scheme
    config: TransformerConfig
    forward: PassCost
    backward: PassCost
    memory: Memory
    slowdown: float
    mode: str

    @property
    def layer_seconds(self) -> float:
        """Forward + backward of one layer, seconds."""
        return self.forward.seconds + self.backward.seconds

    @property
    def step_seconds(self) -> float:
        """Forward + backward of all N layers (one training step), seconds."""
        return self.config.N * self.layer_seconds

    @property
    def step_comm_seconds(self) -> float:
        """Communication of all N layers, forward + backward, seconds."""
        return self.config.N * (self.forward.comm_seconds + self.backward.comm_seconds)

    @property
    def step_compute_seconds(self) -> float:
        """Compute of all N layers, forward + backward, seconds."""
        return self.config.N * (self.forward.compute_seconds + self.backward.compute_seconds)

    @property
    def step_payload(self) -> float:
        """Items this rank passes to collectives over all N layers, forward + backward."""
        return self.config.N * (self.forward.payload + self.backward.payload)

    @property
    def comm_fraction(self) -> float:
        c = self.forward.comm_seconds + self.backward.comm_seconds
        return c / self.layer_seconds if self.layer_seconds else 0.0

    def algorithms(self) -> str:
        algs: dict = {}
        for ps in (self.forward, self.backward):
            for key, names in ps.algorithms.items():
                algs.setdefault(key, set()).update(names)
        return "; ".join(f"{op}/{g}: {'+'.join(sorted(a))}" for (op, g), a in sorted(algs.items()))

    def to_dict(self) -> dict:
        s = self.scheme
        return {"scheme": s.name, "label": s.label, "p": s.p, "q": s.q, "pc": s.cols,
                "d": s.d,
                "mode": self.mode, "slowdown": self.slowdown,
                "forward_seconds": self.forward.seconds, "backward_seconds": self.backward.seconds,
                "forward_comm_seconds": self.forward.comm_seconds,
                "backward_comm_seconds": self.backward.comm_seconds,
                "forward_payload_items": self.forward.payload,
                "backward_payload_items": self.backward.payload,
                "layer_seconds": self.layer_seconds, "step_seconds": self.step_seconds,
                "step_comm_seconds": self.step_comm_seconds,
                "step_compute_seconds": self.step_compute_seconds,
                "step_payload_items": self.step_payload,
                "comm_fraction": self.comm_fraction, "memory": self.memory.to_dict(),
                "algorithms": self.algorithms()}


def _ring_allreduce_messages(items, size, group, itemsize, count, strict):
    """Sendrecv message classes of ``count`` ring all-reduces of ``items`` (rank 0)."""
    if size <= 1:
        return []
    exact = float(items) == int(items)           # integral: exact chunks; else equal real ones
    msgs = _traffic.algorithm_messages("ring_allreduce", count=int(items) if exact else items,
                                       p=size, coords=0, group=group, itemsize=itemsize,
                                       strict=exact)
    return [mc._replace(count=mc.count * count) for mc in msgs]


def product_work(scheme: Scheme, op, itemsize: int, strict: bool = False,
                 compute: bool = True, *, busiest: bool = True) -> tuple:
    """``(messages, Compute or None)`` of one distributed product ``("mm", alg, m, k,
    n[, cols])`` (:func:`summa_op`) on the scheme's grid, at its origin rank (grid row 0,
    column 0: the busiest).

    With ``busiest`` (the grid runs the model: :func:`~.scheme.runs`), whole sizes that
    a rectangular grid or the balanced partition makes uneven are priced exactly
    (:func:`~.traffic.algorithm_messages` with ``strict=True``: the blocks of rank (0, 0,
    0), the largest, and one step per piece of the two cuts); otherwise ``strict``
    decides: True requires whole blocks, False takes the plain quotients (real sizes,
    the scaling studies, and a model the grid cannot run; on a rectangular grid equal
    pieces).
    """
    msgs, work = _product(scheme, tuple(op), int(itemsize), bool(strict), bool(busiest))
    return list(msgs), (work if compute else None)


@functools.lru_cache(maxsize=4096)
def _product(scheme: Scheme, op: tuple, itemsize: int, strict: bool, busiest: bool) -> tuple:
    """:func:`product_work`'s messages (a tuple) and work, kept: a step repeats each
    layer's products N times, and the exact form walks the pieces of two cuts."""
    _, alg, m_, k_, n_, *own = op
    cols = own[0] if own else None
    q, d, pc = scheme.q, scheme.d, scheme.pc or None
    sizes = [_whole(x) for x in (m_, k_, n_)]
    if busiest and all(isinstance(x, int) for x in sizes) \
            and _traffic.is_general(alg, *sizes, q, d, pc, cols):
        strict, (m_, k_, n_) = True, sizes
    msgs = _traffic.algorithm_messages(alg, m_, k_, n_, q, d, itemsize, None, strict=strict,
                                       pc=pc, cols=cols)
    work = _traffic.algorithm_compute(alg, m_, k_, n_, q, d, itemsize, None, strict=strict,
                                      pc=pc, cols=cols)
    return tuple(msgs), work


def _price_ops(ops, scheme, cfg, machine, pricer, strict, compute=True):
    it = cfg.itemsize
    out = PassCost()
    by_op: dict = {}
    algs: dict = {}
    busiest = runs(scheme, cfg)
    for op in ops:
        if op[0] == "gemm":
            if compute:
                _, m_, k_, n_, cnt = op
                out.compute_seconds += _gemm_seconds(machine, m_, k_, n_, cnt, cfg.dtype, it,
                                                     batched=True)
                out.mults += cnt * m_ * k_ * n_
            continue
        if op[0] == "mm":
            msgs, work = product_work(scheme, op, it, strict, compute, busiest=busiest)
            if compute:
                for a, b_, c, cnt in work.gemms:
                    out.compute_seconds += _gemm_seconds(machine, a, b_, c, cnt, cfg.dtype, it)
                    out.mults += cnt * a * b_ * c
                out.compute_seconds += machine.gamma_reduce * work.reduce_bytes
        elif op[0] == "ring":
            _, grp, size, items, cnt = op
            msgs = _ring_allreduce_messages(items, size, grp, it, cnt, strict)
            if compute and size > 1:
                exact = float(items) == int(items)
                red = _traffic.algorithm_compute("ring_allreduce",
                                                 count=int(items) if exact else items, p=size,
                                                 coords=0, itemsize=it, strict=exact)
                out.compute_seconds += cnt * machine.gamma_reduce * red.reduce_bytes
        else:
            _, cop, grp, size, items, cnt = op
            msgs = [_traffic.MessageClass(cop, grp, size, items * it, cnt)] if size > 1 else []
        secs, by, al = price_messages(msgs, machine, pricer=pricer)
        out.comm_seconds += secs
        out.payload += sum(mc.count * mc.nbytes for mc in msgs) / it
        for key, v in by.items():
            by_op[key] = by_op.get(key, 0.0) + v
        for key, v in al.items():
            algs.setdefault(key, set()).update(v)
    out.by_op = by_op
    out.algorithms = {k: tuple(sorted(v)) for k, v in algs.items()}
    return out


def scheme_cost(scheme: Scheme, cfg: TransformerConfig, machine: Machine, *,
                mode: str = "mpich", algorithms: Mapping[str, str] | None = None,
                thresholds: Thresholds | None = None, include_minor: bool = False,
                checkpoint: bool | None = None, ranks_per_node: int | None = None,
                strict: bool = False, compute: bool = True,
                placement: Placement | None = None) -> SchemeCost:
    """Per-rank communication, compute and memory of ``scheme`` on ``cfg``.

    Parameters
    ----------
    scheme : Scheme
    cfg : TransformerConfig
    machine : Machine
    mode : {"mpich", "paper"}
        Collective formulas (see :mod:`~summasim.costmodel.collectives`).
    algorithms : dict, optional
        Force collective algorithms per op.
    thresholds : Thresholds, optional
    include_minor : bool
        Add the LayerNorm and bias traffic (see module doc).
    checkpoint : bool, optional
        Overrides ``cfg.checkpoint``.
    ranks_per_node : int, optional
        Overrides ``machine.ranks_per_node(p)`` for the shared-core slowdown.
    strict : bool
        Require every dimension to divide (False: real-valued blocks).
    compute : bool
        False skips the compute model (zero compute times; faster).
    placement : Placement, optional
        How the ranks sit on nodes (NCCL machines; default row-major).

    Returns
    -------
    SchemeCost
        Times in seconds, payloads in items, memory in bytes per rank. On a machine
        with a roofline ``device`` the compute includes the layer's memory-bound
        kernels (:func:`~summasim.costmodel.compute.roofline.layer_kernels`).
    """
    ck = cfg.checkpoint if checkpoint is None else checkpoint
    cfg = cfg.replace(checkpoint=ck)
    ops = layer_ops(scheme, cfg, include_minor=include_minor)
    rpn = ranks_per_node if ranks_per_node is not None else machine.ranks_per_node(scheme.p)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    pricer = make_pricer(machine, mode=mode, algorithms=algorithms,
                         thresholds=thresholds or MPICH, itemsize=cfg.itemsize, q=scheme.q,
                         d=scheme.d, p=scheme.p, placement=placement, pc=scheme.pc)
    kernels = (layer_kernels(scheme, cfg) if compute and machine.device is not None
               else None)
    passes = []
    for key in ("forward", "backward"):
        pc = _price_ops(ops[key], scheme, cfg, machine, pricer, strict, compute)
        if kernels is not None:
            pc.memory_seconds = kernels_seconds(kernels[key], machine.device, cfg.dtype)
            pc.compute_seconds += pc.memory_seconds
        pc.comm_seconds *= comm_slow
        pc.compute_seconds *= slow
        pc.memory_seconds *= slow
        pc.by_op = {k: v * comm_slow for k, v in pc.by_op.items()}
        passes.append(pc)
    return SchemeCost(scheme, cfg, passes[0], passes[1], memory(scheme, cfg), slow, mode)


def best_grid(p: int, cfg: TransformerConfig, machine: Machine, *,
              schemes=SCHEMES, **kw) -> tuple[SchemeCost | None, list[SchemeCost]]:
    """The fastest scheme and grid for ``p`` ranks, and every candidate's cost
    (only grids that divide ``cfg``: see :func:`misfit`)."""
    costs = [scheme_cost(sch, cfg, machine, **kw) for name in schemes
             for sch in grid_shapes(p, name, cfg)]
    best = min(costs, key=lambda c: c.step_seconds) if costs else None
    return best, costs


# -- a whole training step ------------------------------------------------------------------
