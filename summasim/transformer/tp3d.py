"""3D tensor parallelism of the GPT-2 model on a q x q x q cube.

The fourth member of the 1D/2D/2.5D family: Bian et al. (2021), "Maximizing
Parallelism in Distributed Training for Huge Neural Networks" (the 3D layers of
Colossal-AI), whose linear layer is Agarwal et al.'s 3D matrix multiplication
(1995) with the roles of the cube's axes chosen so that one layer's output is the
next layer's input.

Grid and layouts
----------------
``Grid(comm, q, q)``: rank ``(k, i, j)`` (depth, row, column; world rank
``(k q + i) q + j``), ``grid.row`` joins the ranks that differ in j, ``grid.col`` in i,
``grid.depth`` in k. The ``b s`` rows of an activation are cut into q^2 blocks of whole
sequences (``bl = b / q^2`` of them, ``N = bl t`` rows); ``R_{k,i}`` is block ``k q + i``.
An activation ``[b s, w]`` is held in one of two layouts, each rank a ``[N, w/q]`` block:

=========  ==========================================  ============================
layout     rank (k, i, j) holds                        where
=========  ==========================================  ============================
A          ``X[R_{k,i}, W_j]`` (rows by k, i; cols j)   the residual stream, the
                                                       LayerNorms, the inputs of
                                                       QKV, fc (gate) and the head
B          ``X[R_{k,j}, W_i]`` (rows by k, j; cols i)   QKV, the attention core,
                                                       the MLP's hidden, the logits
=========  ==========================================  ============================

The linear ``Y = X W`` (``W [in, out]``) from layout A to B ("ab": QKV, fc, gate, the LM
head) and from B to A ("ba": the two projections), on rank (k, i, j); G_in, G_out =
``grid.col``, ``grid.row`` for "ab" and ``grid.row``, ``grid.col`` for "ba":

1. all-gather the input block ``[N, in/q]`` over G_in: ``X[R_k, In_c]`` ``[q N, in/q]``;
2. all-gather the weight over ``grid.depth``: rank (k, i, j) stores the depth piece k
   (the balanced partition, :func:`summasim.spec.block_range`) of the rows of
   ``W[In_c, Out_r]`` (c, r = j, i for "ab"; i, j for "ba"), 1/p of W;
3. multiply: the partial ``[q N, out/q]``, summed over the input blocks c;
4. reduce-scatter it over G_out: the rank keeps its row block, ``[N, out/q]``, of the sum.

Backward (Bian et al. section 3, the conjugates): all-gather ``dY`` over G_out, all-gather
the input over G_in again and the weight over depth again (the gathered operands are not
kept, so activations and weights take their 1/p share of memory), ``dX = reduce-scatter
over G_in of dY W^T`` and ``dW = reduce-scatter over depth of X^T dY`` (the rows of the
depth piece). Every per-rank GEMM is ``(q N)(in/q)(out/q)``: 1/p of the serial one.

Parameters (rank (k, i, j))
---------------------------
===================================  ==================================================
``attn.qkv.w``, ``mlp.fc.w``,        "ab": rows ``In_j`` depth piece k, columns ``Out_i``
``mlp.gate.w``, ``head.w``           (QKV columns permuted as Optimus's, so that block i
                                     is ``[Q_i | K_i | V_i]``: n/q whole query heads and
                                     kv/q key/value heads; ``head.w``'s vocabulary padded
                                     to a multiple of q)
``attn.proj.w``, ``mlp.proj.w``      "ba": rows ``In_i`` depth piece k, columns ``Out_j``
``wte [v, h]``                       vocabulary block i (padded, :func:`vocab_block`),
                                     depth piece k of its rows; hidden block j
LayerNorm g/b, ``attn.proj.b``,      block j (``[h/q]``), the same on the q^2 ranks that
``mlp.proj.b``, ``lnf.*``, ``wpe``   share j (``wpe``: ``[s, h/q]``)
``attn.qkv.b``, ``mlp.fc.b``,        block i (permuted as the weight), the same on the
``mlp.gate.b``                       q^2 ranks that share i
``cls.w [h, k]``, ``cls.b [k]``      rows ``H_j`` (replicated over the ranks sharing j);
                                     ``cls.b`` whole on every rank
===================================  ==================================================

The replicated vectors send nothing forward; their gradients (local sums over the
rank's rows) are all-reduced over ``grid.depth`` (one packed buffer per layer), then
the A-layout ones over ``grid.col`` and the B-layout ones over ``grid.row``.

Embedding: the ``wte`` block of vocabulary block i is all-gathered over the depth, each
rank looks up the tokens of ``R_k`` that fall in it, and the partial ``[q N, h/q]`` is
reduce-scattered over ``grid.col`` (the sum over the vocabulary blocks): layout A.
Backward: all-gather ``dx`` over ``grid.col``, scatter-add, reduce-scatter ``dwte`` over
the depth. The tied LM head is the "ab" linear with ``wte^T`` as its weight: logits
``[N, v/q]`` in layout B, vocabulary block i; the cross-entropy's max, sum and target
pick are all-reduced over ``grid.col``, the loss sum over ``grid.row`` and the depth.
A classifier reads each sequence's last token from layout A: ``x_last[:, H_j] cls.w[H_j]``
(+ ``cls.b`` on j = 0) all-reduced over ``grid.row``.

Traffic per rank (items: an all-gather counts its piece, a reduce-scatter its whole
buffer, as the trace records them), for a linear ``[in, out]``, ``N = b s / q^2``:
forward ``N in/q + w + N out``; backward ``N out/q + N in/q + w + N in + q w``, with
``w = ceil(in/q^2) out/q`` the largest depth piece (``q w = in out/q^2`` when q^2 divides
in). :func:`layer_payload` sums them over the
layer's linears; on the wire an all-gather of a piece moves ``(q-1)`` pieces and a
reduce-scatter ``(q-1)/q`` of its buffer. Groups of one send nothing (q = 1).

Trace phases (as :mod:`summasim.transformer.optimus`; sub starts with "tp." or "aux.")
----------------------------------------------------------------------------------
``h{l}.fwd``   ``aux.ln1``, ``tp.attn.qkv``, ``tp.attn.proj``, ``aux.ln2``, ``tp.mlp.fc``,
               (SwiGLU) ``tp.mlp.gate``, ``tp.mlp.proj``
``h{l}.bwd``   (recompute "full": the forward's first) ``tp.<linear>.dX`` and
               ``tp.<linear>.dW`` for each linear in reverse, ``aux.ln2``, ``aux.ln1``,
               ``aux.grads.depth``, ``aux.grads.plane``
``embed.fwd``  ``aux.wte.gather``, ``aux.embed.sum``; ``embed.bwd``: ``aux.embed.gather``,
               ``aux.wte.reduce``, ``aux.wpe.reduce``
``lnf.fwd``    ``aux.ln``; ``lnf.bwd``: ``aux.ln``, ``aux.grads.depth``, ``aux.grads.plane``
``lmhead.fwd`` ``aux.logits``; ``lmhead.bwd``: ``aux.logits.dX``, ``aux.logits.dW``
``clshead.fwd`` ``aux.logits``; ``clshead.bwd``: ``aux.grads.depth``, ``aux.grads.plane``
``loss``       ``aux.ce``, ``aux.mean``

References
----------
Z. Bian, Q. Xu, B. Wang, Y. You, "Maximizing Parallelism in Distributed Training for
Huge Neural Networks", arXiv:2105.14450, 2021, section 3.
R. C. Agarwal, S. M. Balle, F. G. Gustavson, M. Joshi, P. Palkar, "A three-dimensional
approach to parallel matrix multiplication", IBM J. Res. Dev. 39(5), 1995.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple, Optional

import numpy as np

from summasim.backends import array_module
from summasim.mpiutil import agree, fields_of, local_error
from summasim.spec import block_range, grid_coords, vocab_block

from . import model, ops
from .model import Config
from .optimus import (OptimusCache, _how, check_sizes, column_cut, head_groups,
                      qkv_permutation, run_backward, run_forward)

Array = Any

#: Linears from layout A to B and from B to A (their weights' layouts).
AB_WEIGHTS = ("attn.qkv.w", "mlp.fc.w", "mlp.gate.w", "head.w")
BA_WEIGHTS = ("attn.proj.w", "mlp.proj.w")
#: Vectors in layout A (hidden block j) and B (feature block i), in packing order.
A_VECS = ("ln1.g", "ln1.b", "attn.proj.b", "ln2.g", "ln2.b", "mlp.proj.b")
B_VECS = ("attn.qkv.b", "mlp.fc.b", "mlp.gate.b")


def _identity(x):
    return x


# --------------------------------------------------------------------------- #
# checks and layout (pure)                                                    #
# --------------------------------------------------------------------------- #
def _check_grid(grid, fields=("q", "d", "row", "col", "depth", "world")) -> None:
    """``TypeError`` unless ``grid`` is a Grid; ``ValueError`` unless it is a cube."""
    if not all(hasattr(grid, f) for f in fields):
        raise TypeError(f"tp3d: grid must be a summasim.grid.Grid, got {type(grid).__name__}")
    if grid.q is None or grid.d != grid.q:
        raise ValueError(f"tp3d runs on a q x q x q cube, got [{grid.pr}, {grid.pc}, "
                         f"{grid.d}]")


def check(config: Config, grid, batch: Optional[int] = None) -> None:
    """Raise unless ``config`` (and ``batch`` sequences) fits the cube: ``b % q^2``
    (whole sequences per rank) and at least one key/value head per feature block,
    ``kv_heads >= q`` (each block i of QKV, of the attention and of the hidden holds
    whole heads, the balanced partition of the kv heads: ``optimus.head_groups``). Any
    hidden size, MLP width (the balanced partition over q), vocabulary (padded to a
    multiple of q) and size of a weight's depth pieces. Pure, so every rank raises
    alike."""
    model.need_config(config)
    _check_grid(grid, ("q", "d", "row", "col", "depth"))
    q = grid.q
    check_sizes(config, batch, q * q, "q^2", q, "q", f"tp3d on a {q}x{q}x{q} cube", "block")


def role(name: str) -> str:
    """How parameter ``name`` is laid out: "ab", "ba" (weights), "wte", "a", "b"
    (vectors), "cls.w" or "whole"."""
    base = name.split(".", 1)[1] if name.startswith("h") and name[1:2].isdigit() else name
    if base in AB_WEIGHTS:
        return "ab"
    if base in BA_WEIGHTS:
        return "ba"
    if base in ("wte", "cls.w"):
        return base
    if base in B_VECS:
        return "b"
    if base == "cls.b":
        return "whole"
    return "a"                    # LayerNorms, projection biases, lnf, wpe


def _prepared_shape(name: str, shape: tuple, config: Config, q: int) -> tuple:
    """The serial shape with its vocabulary axis padded to a multiple of q."""
    vp = vocab_block(config.vocab, q) * q
    if name == "wte":
        return (vp, shape[1])
    if name == "head.w":
        return (shape[0], vp)
    return tuple(shape)


#: what each weight's input and output axes hold (:func:`cut`); wte's rows are "V"
_AXES = {"attn.qkv.w": ("h", "W"), "mlp.fc.w": ("h", "F"), "mlp.gate.w": ("h", "F"),
         "head.w": ("h", "V"), "attn.proj.w": ("h", "h"), "mlp.proj.w": ("F", "h"),
         "attn.qkv.b": (None, "W"), "mlp.fc.b": (None, "F"), "mlp.gate.b": (None, "F")}


def cut(config: Config, q: int, what: str) -> list[int]:
    """The ``q + 1`` offsets of a size over the cube's q blocks: ``"h"`` the hidden size
    and ``"W"`` the QKV width at the key/value head groups (``optimus.column_cut``:
    whole heads per block), ``"F"`` the MLP width (the balanced partition), ``"V"`` the
    padded vocabulary (even blocks). ``h/q`` etc. when q divides the kv heads."""
    if what == "V":
        return [t * vocab_block(config.vocab, q) for t in range(q + 1)]
    return column_cut(config, q, what)


def _width(config: Config, q: int, t: int, what: str = "h") -> int:
    off = cut(config, q, what)
    return off[t + 1] - off[t]


def _slices(name: str, shape: tuple, config: Config, q: int, k: int, i: int, j: int):
    """``(rows, cols)`` slices of rank (k, i, j)'s piece of the prepared (padded,
    permuted) serial array of ``shape`` (``rows`` is None for a vector). Pure."""
    kind = role(name)
    base = name.split(".", 1)[1] if name.startswith("h") and name[1:2].isdigit() else name
    rows_of, cols_of = _AXES.get(base, ("V", "h") if kind == "wte" else ("h", "h"))

    def block(what, t):
        off = cut(config, q, what)
        return slice(off[t], off[t + 1])

    def piece(what, t):           # block t, then depth piece k of it (balanced)
        off = cut(config, q, what)
        lo, hi = block_range(off[t + 1] - off[t], q, k)
        return slice(off[t] + lo, off[t] + hi)

    if kind == "ab":
        return piece(rows_of, j), block(cols_of, i)
    if kind == "ba":
        return piece(rows_of, i), block(cols_of, j)
    if kind == "wte":
        return piece("V", i), block("h", j)
    if kind == "cls.w":
        return block("h", j), slice(None)
    if kind == "whole":
        return None, slice(None)
    cols = block(cols_of, j if kind == "a" else i)
    return (slice(None) if len(shape) == 2 else None), cols


def _extent(s: slice, n: int) -> int:
    return len(range(*s.indices(n)))


def _shape_of(name: str, shape: tuple, config: Config, q: int, k: int, i: int, j: int):
    full = _prepared_shape(name, shape, config, q)
    rows, cols = _slices(name, shape, config, q, k, i, j)
    if rows is None:
        return (_extent(cols, full[-1]),)
    return (_extent(rows, full[0]), _extent(cols, full[1]))


def local_shapes(config: Config, grid) -> dict:
    """``{name: local shape}`` on this rank, in the order of ``model.param_shapes``:
    weights ``(piece of in/q, out/q)``, ``wte`` ``(piece of v/q, h/q)``, vectors their
    block, ``wpe`` ``(s, h/q)``, ``cls.w`` ``(h/q, k)``, ``cls.b`` ``(k,)``."""
    check(config, grid)
    return {name: _shape_of(name, shape, config, grid.q, grid.k, grid.i, grid.j)
            for name, shape in model.param_shapes(config).items()}


def _prepare(arr, name: str, config: Config, q: int):
    """``arr`` with its vocabulary padded (zeros) and QKV columns permuted."""
    xp = array_module(arr)
    full = _prepared_shape(name, arr.shape, config, q)
    if tuple(arr.shape) != full:
        out = xp.zeros(full, dtype=arr.dtype)
        out[:arr.shape[0], :arr.shape[1]] = arr
        arr = out
    if name.endswith(("attn.qkv.w", "attn.qkv.b")):
        arr = arr[..., xp.asarray(qkv_permutation(config.hidden, q, config.kv_width,
                                                  head_dim=config.hidden // config.heads))]
    return arr


def _check_local(local: dict, config: Config, grid, what: str) -> None:
    if not isinstance(local, dict):
        raise TypeError(f"tp3d: {what} must be a dict of arrays, got {type(local).__name__}")
    want = local_shapes(config, grid)
    if set(local) != set(want):
        raise ValueError(f"tp3d: {what} keys differ from the model's: missing "
                         f"{sorted(set(want) - set(local))[:4]}, extra "
                         f"{sorted(set(local) - set(want))[:4]}")
    for name, shape in want.items():
        arr = local[name]
        have = tuple(getattr(arr, "shape", ()))
        if have != shape:
            raise ValueError(f"tp3d: {what}[{name!r}] has shape {have}, rank {grid.coords} "
                             f"should hold {shape}")
        if getattr(arr, "dtype", None) != config.dtype:
            raise ValueError(f"tp3d: {what}[{name!r}] has dtype {getattr(arr, 'dtype', None)}, "
                             f"Config.dtype is {config.dtype}")


# --------------------------------------------------------------------------- #
# shard / unshard                                                             #
# --------------------------------------------------------------------------- #
def shard(params: dict, config: Config, grid, keys=None) -> dict:
    """This rank's local parameters from the serial ``params`` (fresh copies; no data
    moves). ``keys``: only those (a pipeline stage's). A config or params that do not
    fit, on any rank, raise on every rank (one untraced agreement)."""
    _check_grid(grid)
    shapes, err = local_error(lambda: (local_shapes(config, grid),
                                       model.check_params(params, config))[0])
    agree("tp3d.shard", grid, fields_of(config, "Config"), err)
    xp = array_module(params["wte"])
    q, k, i, j = grid.q, grid.k, grid.i, grid.j
    wanted = None if keys is None else set(keys)
    local = {}
    for name, arr in params.items():
        if wanted is not None and name not in wanted:
            continue
        rows, cols = _slices(name, arr.shape, config, q, k, i, j)
        arr = _prepare(arr, name, config, q)
        blk = arr[cols] if rows is None else arr[rows][:, cols]
        local[name] = xp.array(blk, copy=True, order="C")     # never a view of params
    return local


def _kij(rank: int, q: int) -> tuple:
    """``(k, i, j)`` of ``rank`` on the cube (:func:`summasim.spec.grid_coords`)."""
    i, j, k = grid_coords(rank, q)
    return k, i, j


def _canonical(name: str, k: int, i: int, j: int) -> bool:
    """Whether rank (k, i, j) is the one :func:`unshard` reads a replicated array from."""
    kind = role(name)
    if kind in ("a", "cls.w"):
        return k == 0 and i == 0
    if kind == "b":
        return k == 0 and j == 0
    if kind == "whole":
        return k == 0 and i == 0 and j == 0
    return True


def unshard(local_grads: dict, config: Config, grid) -> dict:
    """Serial-layout arrays (keys and shapes of ``model.init_params``) on every rank,
    from local params or grads: one all-gather over ``grid.world`` (phase
    ``"unshard/aux.gather"``) of a packed buffer (each array padded to its largest
    piece), the vocabulary padding dropped and the QKV permutation undone."""
    _check_grid(grid)
    _, err = local_error(lambda: (check(config, grid),
                                  _check_local(local_grads, config, grid, "local_grads")))
    agree("tp3d.unshard", grid, fields_of(config, "Config"), err)
    xp = array_module(local_grads["wte"])
    q = grid.q
    shapes = model.param_shapes(config)
    coords = [_kij(r, q) for r in range(grid.p)]
    size = {name: max(math.prod(_shape_of(name, shape, config, q, *c)) for c in coords)
            for name, shape in shapes.items()}
    off, o = {}, 0
    for name in shapes:
        off[name] = o
        o += size[name]
    buf = xp.zeros(o, dtype=config.dtype)                                  # (S,)
    for name in shapes:
        a = local_grads[name]
        buf[off[name]:off[name] + a.size] = a.reshape(-1)
    if grid.world.size > 1:
        parts = xp.empty((grid.world.size, o), dtype=config.dtype)         # (p, S)
        with grid.trace.phase("unshard"), grid.trace.phase("aux.gather"):
            grid.world.allgather(buf, parts)
    else:
        parts = buf[None]
    perm = qkv_permutation(config.hidden, q, config.kv_width,
                           head_dim=config.hidden // config.heads)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    out = {}
    for name, shape in shapes.items():
        full = xp.zeros(_prepared_shape(name, shape, config, q), dtype=config.dtype)
        for r, c in enumerate(coords):
            if not _canonical(name, *c):
                continue
            pshape = _shape_of(name, shape, config, q, *c)
            piece = parts[r, off[name]:off[name] + math.prod(pshape)].reshape(pshape)
            rows, cols = _slices(name, shape, config, q, *c)
            if rows is None:
                full[cols] = piece
            else:
                full[rows, cols] = piece
        if name.endswith(("attn.qkv.w", "attn.qkv.b")):
            full = full[..., xp.asarray(inv)]
        out[name] = xp.ascontiguousarray(full[tuple(slice(0, n) for n in shape)])
    return out


# --------------------------------------------------------------------------- #
# the 3D linear and its helpers                                               #
# --------------------------------------------------------------------------- #
def _groups(grid, orient: str):
    """``(G_in, G_out)``: (col, row) for "ab", (row, col) for "ba"."""
    return (grid.col, grid.row) if orient == "ab" else (grid.row, grid.col)


def _gather_rows(comm, x, tag: str):
    """All-gather the ``[n, c]`` blocks of ``comm`` into ``[size n, c]`` (rank order);
    ``x`` itself on a group of one. A reused workspace: valid until the next call
    with the same tag."""
    if comm.size == 1:
        return x
    x = array_module(x).ascontiguousarray(x)
    buf = comm.workspace(tag, x, 1, shape=(comm.size,) + tuple(x.shape))[0]
    comm.allgather(x, buf)
    return buf.reshape((comm.size * x.shape[0],) + tuple(x.shape[1:]))


def _scatter_rows(comm, full):
    """Reduce-scatter ``[size n, c]`` over ``comm``: this rank's row block ``[n, c]`` of
    the sum (a fresh array)."""
    if comm.size == 1:
        return full
    out = array_module(full).empty((full.shape[0] // comm.size,) + tuple(full.shape[1:]),
                                   dtype=full.dtype)
    comm.reduce_scatter(full, out)
    return out


def _gather_depth(grid, w, total: int, tag: str):
    """The ``[total, c]`` rows whose depth pieces (:func:`block_range`) the ranks of
    ``grid.depth`` hold; pieces of unequal size travel padded to the largest."""
    depth = grid.depth
    q = depth.size
    if q == 1:
        return w
    base, extra = divmod(total, q)
    if not extra:
        return _gather_rows(depth, w, tag)
    xp = array_module(w)
    top = base + 1
    send = xp.zeros((top,) + tuple(w.shape[1:]), dtype=w.dtype)
    send[:w.shape[0]] = w
    parts = depth.workspace(tag, w, 1, shape=(q, top) + tuple(w.shape[1:]))[0]
    depth.allgather(send, parts)
    return xp.concatenate([parts[t, :block_range(total, q, t)[1] - block_range(total, q, t)[0]]
                           for t in range(q)])


def _scatter_depth(grid, full):
    """Reduce-scatter ``[total, c]`` over ``grid.depth``: this rank's depth piece of the
    rows of the sum (pieces of unequal size travel padded to the largest)."""
    depth = grid.depth
    q = depth.size
    if q == 1:
        return full
    total = full.shape[0]
    base, extra = divmod(total, q)
    if not extra:
        return _scatter_rows(depth, full)
    xp = array_module(full)
    top = base + 1
    send = xp.zeros((q, top) + tuple(full.shape[1:]), dtype=full.dtype)
    for t in range(q):
        lo, hi = block_range(total, q, t)
        send[t, :hi - lo] = full[lo:hi]
    out = xp.empty((top,) + tuple(full.shape[1:]), dtype=full.dtype)
    depth.reduce_scatter(send, out)
    lo, hi = block_range(total, q, depth.rank)
    return xp.ascontiguousarray(out[:hi - lo])


def _linear(x, w, grid, orient: str, *, trans_w: bool = False, rows: Optional[int] = None):
    """``Y = X W`` (``X W^T`` with ``trans_w``) from layout A to B ("ab") or B to A
    ("ba"): ``x [N, in/q]`` -> ``[N, out/q]`` (module docstring, steps 1-4). ``rows``:
    the rows of the gathered weight (default ``in/q``; ``trans_w``: its out/q)."""
    g_in, g_out = _groups(grid, orient)
    xg = _gather_rows(g_in, x, "tp3d.x")                                  # (qN, in/q)
    wg = _gather_depth(grid, w, rows if rows is not None else x.shape[1], "tp3d.w")
    part = xg @ (wg.T if trans_w else wg)                                  # (qN, out/q)
    return _scatter_rows(g_out, part)                                      # (N, out/q)


def _linear_backward(dy, x, w, grid, orient: str, what: str, *, trans_w: bool = False,
                     rows: Optional[int] = None):
    """``(dx [N, in/q], dw)`` of :func:`_linear` (phases ``<what>.dX``, ``<what>.dW``):
    all-gather dY over G_out, the weight over the depth and X over G_in again;
    reduce-scatter ``dY W^T`` over G_in and ``X^T dY`` over the depth."""
    g_in, g_out = _groups(grid, orient)
    tr = grid.trace
    with tr.phase(f"{what}.dX"):
        dyg = _gather_rows(g_out, dy, "tp3d.dy")                           # (qN, out/q)
        wg = _gather_depth(grid, w, rows if rows is not None else x.shape[1], "tp3d.w")
        dxp = dyg @ (wg if trans_w else wg.T)                              # (qN, in/q)
        dx = ops.stored(_scatter_rows(g_in, dxp))                          # (N, in/q)
    with tr.phase(f"{what}.dW"):
        xg = _gather_rows(g_in, x, "tp3d.x")                               # (qN, in/q)
        dwp = (dyg.T @ xg) if trans_w else (xg.T @ dyg)    # (out/q, in/q) | (in/q, out/q)
        dw = _scatter_depth(grid, dwp)                                     # w's piece
    return dx, dw


def _allreduce(comm, a, op="sum"):
    """All-reduce over ``comm`` (nothing on a group of one); returns the result."""
    if comm.size == 1:
        return a
    return comm.allreduce(a, op=op)


def _row_sum(grid):
    """The sum over the hidden axis of a layout-A block: local, then over ``grid.row``
    (a LayerNorm's statistics; its backward's two means are row sums again)."""
    return lambda a: _allreduce(grid.row, ops.local_sum(a))


def _reduce_vectors(grid, a_grads: list, b_grads: list):
    """Sum the replicated vectors' local gradients over the ranks that share them:
    one packed all-reduce over ``grid.depth``, then the layout-A part over
    ``grid.col`` and the layout-B part over ``grid.row``. Returns the summed arrays."""
    parts = list(a_grads) + list(b_grads)
    if not parts:
        return [], []
    xp = array_module(parts[0])
    buf = xp.concatenate([g.reshape(-1) for g in parts])                  # (S,)
    na = sum(g.size for g in a_grads)
    with grid.trace.phase("aux.grads.depth"):
        _allreduce(grid.depth, buf)
    with grid.trace.phase("aux.grads.plane"):
        if na and grid.col.size > 1:
            grid.col.allreduce(buf[:na])
        if buf.size > na and grid.row.size > 1:
            grid.row.allreduce(buf[na:])
    out, o = [], 0
    for g in parts:
        out.append(buf[o:o + g.size].reshape(g.shape))
        o += g.size
    return out[:len(a_grads)], out[len(a_grads):]


# --------------------------------------------------------------------------- #
# one layer                                                                   #
# --------------------------------------------------------------------------- #
def _local_heads(config: Config, grid) -> tuple:
    """``(query heads, kv heads, h columns, QKV columns)`` of feature block i (layout
    B: QKV, the attention core, its output): the kv heads of block i of
    :func:`optimus.head_groups` and their query heads."""
    kv = head_groups(config, grid.q)
    nkv = kv[grid.i + 1] - kv[grid.i]
    return (nkv * (config.heads // config.kv_heads), nkv, _width(config, grid.q, grid.i),
            _width(config, grid.q, grid.i, "W"))


class LayerCache(NamedTuple):
    ln1: ops.LayerNormCache
    a: Array                      # ln1 output = QKV input, layout A (N, h/q)
    core: Any                     # the attention core's cache (n/q heads of bl sequences)
    y: Array                      # attention output = proj input, layout B (N, h/q)
    ln2: ops.LayerNormCache
    m: Array                      # ln2 output = fc (gate) input, layout A (N, h/q)
    gelu: Optional[ops.GeluCache]  # fc output, layout B (N, F/q); None for SwiGLU
    g: Array                      # activation output = proj input, layout B (N, F/q)
    swiglu: Optional[ops.SwigluCache] = None


def _layer_forward(x, p: dict, config: Config, grid, bl: int, t: int,
                   attention: str = "plain", recompute: str = "none", tile=None):
    """One pre-LN layer on the layout-A block x (N, h/q) -> (N, h/q) and its cache."""
    xp = array_module(x)
    h = config.hidden
    nh, nkv, hq, wq = _local_heads(config, grid)      # block i of layout B
    tr = grid.trace
    sum_row = _row_sum(grid)
    with tr.phase("aux.ln1"):      # row all-reduces (bwd: row all-reduces)
        a, ln1 = ops.layernorm_forward(x, p["ln1.g"], p["ln1.b"], sum_hidden=sum_row,
                                       hidden=h)                           # A (N, h/q)
    with tr.phase("tp.attn.qkv"):  # ab (bwd: _linear_backward)
        qkv = _linear(a, p["attn.qkv.w"], grid, "ab")                      # B (N, W/q)
    qkv += p["attn.qkv.b"]
    ops.stored(qkv)
    qh, kh, vh = ops.split_heads(qkv.reshape(bl, t, wq), nh, nkv)
    y = xp.empty((bl, t, hq), dtype=x.dtype)                               # B (bl, t, h/q)
    y_heads = y.reshape(bl, t, nh, hq // nh).transpose(0, 2, 1, 3)
    _, core = ops.attention_core_forward(qh, kh, vh, out=y_heads, attention=attention,
                                         recompute=recompute, tile=tile)
    y = y.reshape(bl * t, hq)
    with tr.phase("tp.attn.proj"):  # ba (bwd: _linear_backward)
        x1 = _linear(y, p["attn.proj.w"], grid, "ba")                      # A (N, h/q)
    x1 += p["attn.proj.b"]
    x1 += x                                                                # residual 1
    ops.stored(x1)
    with tr.phase("aux.ln2"):
        m, ln2 = ops.layernorm_forward(x1, p["ln2.g"], p["ln2.b"], sum_hidden=sum_row,
                                       hidden=h)                           # A (N, h/q)
    with tr.phase("tp.mlp.fc"):    # ab
        f = _linear(m, p["mlp.fc.w"], grid, "ab")                          # B (N, F/q)
    f += p["mlp.fc.b"]
    ops.stored(f)
    gelu = swiglu = None
    if config.mlp == "swiglu":
        with tr.phase("tp.mlp.gate"):  # ab
            gate = _linear(m, p["mlp.gate.w"], grid, "ab")                 # B (N, F/q)
        gate += p["mlp.gate.b"]
        ops.stored(gate)
        g, swiglu = ops.swiglu_forward(gate, f)
    else:
        g, gelu = ops.gelu_forward(f)                                      # B (N, F/q)
    with tr.phase("tp.mlp.proj"):  # ba
        out = _linear(g, p["mlp.proj.w"], grid, "ba")                      # A (N, h/q)
    out += p["mlp.proj.b"]
    out += x1                                                              # residual 2
    ops.stored(out)
    return out, LayerCache(ln1=ln1, a=a, core=core, y=y, ln2=ln2, m=m, gelu=gelu, g=g,
                           swiglu=swiglu)


def _layer_backward(dout, c: LayerCache, p: dict, config: Config, grid, bl: int, t: int):
    """The layer forward read in reverse: dx (N, h/q) and the layer's local grads."""
    xp = array_module(dout)
    nh, nkv, hq, wq = _local_heads(config, grid)      # block i of layout B
    tr = grid.trace
    grads, vec = {}, {}
    vec["mlp.proj.b"] = dout.sum(axis=0)                                   # (h/q,)
    dg, grads["mlp.proj.w"] = _linear_backward(dout, c.g, p["mlp.proj.w"], grid, "ba",
                                               "tp.mlp.proj")              # B (N, F/q)
    if c.swiglu is None:
        df, _ = ops.gelu_backward(dg, c.gelu)
    else:
        (dgate, df), _ = ops.swiglu_backward(dg, c.swiglu)
    vec["mlp.fc.b"] = df.sum(axis=0)                                       # (F/q,)
    dm, grads["mlp.fc.w"] = _linear_backward(df, c.m, p["mlp.fc.w"], grid, "ab",
                                             "tp.mlp.fc")                  # A (N, h/q)
    if c.swiglu is not None:
        vec["mlp.gate.b"] = dgate.sum(axis=0)
        dm2, grads["mlp.gate.w"] = _linear_backward(dgate, c.m, p["mlp.gate.w"], grid, "ab",
                                                    "tp.mlp.gate")
        dm += dm2
        ops.stored(dm)
    with tr.phase("aux.ln2"):
        dx1, gl = ops.layernorm_backward(dm, c.ln2)                        # A (N, h/q)
    vec["ln2.g"], vec["ln2.b"] = gl["g"], gl["b"]
    dx1 += dout                                                            # residual 2
    ops.stored(dx1)
    vec["attn.proj.b"] = dx1.sum(axis=0)
    dy, grads["attn.proj.w"] = _linear_backward(dx1, c.y, p["attn.proj.w"], grid, "ba",
                                                "tp.attn.proj")            # B (N, h/q)
    dy_heads = dy.reshape(bl, t, nh, hq // nh).transpose(0, 2, 1, 3)
    dqkv = xp.empty((bl, t, wq), dtype=dout.dtype)
    ops.attention_core_backward(dy_heads, c.core, out=ops.split_heads(dqkv, nh, nkv))
    dqkv = dqkv.reshape(bl * t, wq)                                        # B (N, W/q)
    vec["attn.qkv.b"] = dqkv.sum(axis=0)
    da, grads["attn.qkv.w"] = _linear_backward(dqkv, c.a, p["attn.qkv.w"], grid, "ab",
                                               "tp.attn.qkv")              # A (N, h/q)
    with tr.phase("aux.ln1"):
        dx, gl = ops.layernorm_backward(da, c.ln1)
    vec["ln1.g"], vec["ln1.b"] = gl["g"], gl["b"]
    dx += dx1                                                              # residual 1
    ops.stored(dx)
    a_keys = [k for k in A_VECS if k in vec]
    b_keys = [k for k in B_VECS if k in vec]
    ga, gb = _reduce_vectors(grid, [vec[k] for k in a_keys], [vec[k] for k in b_keys])
    grads.update(zip(a_keys, ga))
    grads.update(zip(b_keys, gb))
    return dx, grads


# --------------------------------------------------------------------------- #
# embedding, final LayerNorm, heads                                           #
# --------------------------------------------------------------------------- #
def _row_block(tokens, grid, xp, minor: str):
    """Sequences of row block ``k q + i`` (``minor`` "i": layout A) or ``k q + j`` ("j":
    layout B) of the batch, ``(b/q^2, ...)``."""
    q = grid.q
    bl = tokens.shape[0] // (q * q)
    r = grid.k * q + (grid.i if minor == "i" else grid.j)
    return xp.asarray(tokens[r * bl:(r + 1) * bl])


class EmbedCache(NamedTuple):
    grid: Any
    emb: Any                     # EmbeddingCache of the q bl sequences of R_k
    wpe_shape: tuple             # (s, h/q)


def embed_forward(p: dict, tokens, config: Config, grid):
    """x (bl, t, h/q), layout A: ``wte[tokens] + wpe`` (phase ``embed.fwd``)."""
    xp = array_module(p["wte"])
    q, tr = grid.q, grid.trace
    bl = tokens.shape[0] // (q * q)
    t = tokens.shape[1]
    k = grid.k
    tok = xp.asarray(tokens[k * q * bl:(k + 1) * q * bl])                  # R_k (q bl, t)
    vb = vocab_block(config.vocab, q)
    with tr.phase("embed.fwd"):
        with tr.phase("aux.wte.gather"):   # all-gather over depth (bwd: reduce-scatter)
            wte = _gather_depth(grid, p["wte"], vb, "tp3d.w")              # (v/q, h/q)
        part, emb = ops.embedding_forward(tok, wte, None, vocab_start=grid.i * vb,
                                          combine_vocab=_identity)         # (q bl, t, h/q)
        hq = part.shape[-1]
        with tr.phase("aux.embed.sum"):    # reduce-scatter over col (bwd: all-gather)
            x = _scatter_rows(grid.col, part.reshape(q * bl, t * hq))       # (bl, t h/q)
        x = x.reshape(bl, t, hq)
        x += p["wpe"][:t]
        ops.stored(x)
    return x, EmbedCache(grid=grid, emb=emb, wpe_shape=tuple(p["wpe"].shape))


def embed_backward(dx, cache: EmbedCache) -> dict:
    """``{"wte": this rank's piece, "wpe": (s, h/q)}`` (phase ``embed.bwd``)."""
    grid = cache.grid
    xp = array_module(dx)
    tr = grid.trace
    bl, t, hq = dx.shape
    with tr.phase("embed.bwd"):
        with tr.phase("aux.embed.gather"):  # all-gather over col (fwd: reduce-scatter)
            dxg = _gather_rows(grid.col, xp.ascontiguousarray(dx).reshape(bl, t * hq),
                               "tp3d.dy")
        _, g = ops.embedding_backward(dxg.reshape(-1, t, hq), cache.emb)   # (v/q, h/q)
        with tr.phase("aux.wte.reduce"):    # reduce-scatter over depth (fwd: all-gather)
            dwte = _scatter_depth(grid, g["wte"])
        dwpe = xp.zeros(cache.wpe_shape, dtype=dx.dtype)                   # (s, h/q)
        dwpe[:t] = dx.sum(axis=0)
        with tr.phase("aux.wpe.reduce"):    # replicated over (col, depth)
            dwpe = _allreduce(grid.col, dwpe)
            dwpe = _allreduce(grid.depth, dwpe)
    return {"wte": dwte, "wpe": dwpe}


class LayerPieceCache(NamedTuple):
    config: Config
    grid: Any
    l: int
    params: dict
    checkpoint: bool
    block: Any                   # LayerCache, or the input (bl, t, h/q) if checkpointed
    recompute: str = "none"
    attention: str = "plain"
    tile: Optional[int] = None


def layer_forward(x, p_layer: dict, l: int, config: Config, grid, checkpoint: bool = False,
                  *, recompute: Optional[str] = None, attention: str = "plain",
                  tile: Optional[int] = None):
    """Layer ``l`` (phase ``h{l}.fwd``) on the layout-A block x (bl, t, h/q); as
    :func:`summasim.transformer.optimus.layer_forward` (recompute, attention, tile)."""
    mode = _how(checkpoint, recompute, attention)
    bl, t, hq = x.shape
    with grid.trace.phase(f"h{l}.fwd"):
        out, block = _layer_forward(x.reshape(bl * t, hq), p_layer, config, grid, bl, t,
                                    attention, "selective" if mode == "selective" else "none",
                                    tile)
    full = mode == "full"
    return out.reshape(bl, t, hq), LayerPieceCache(
        config=config, grid=grid, l=l, params=p_layer, checkpoint=full,
        block=x if full else block, recompute=mode, attention=attention, tile=tile)


def layer_backward(dx, cache: LayerPieceCache):
    """``(dx (bl, t, h/q), unprefixed local grads)`` of the layer (phase ``h{l}.bwd``);
    checkpointed, the forward is recomputed first."""
    config, grid, p = cache.config, cache.grid, cache.params
    bl, t, hq = dx.shape
    with grid.trace.phase(f"h{cache.l}.bwd"):
        if cache.checkpoint:
            _, block = _layer_forward(cache.block.reshape(bl * t, hq), p, config, grid, bl, t,
                                      cache.attention, "none", cache.tile)
        else:
            block = cache.block
        dx, grads = _layer_backward(dx.reshape(bl * t, hq), block, p, config, grid, bl, t)
    return dx.reshape(bl, t, hq), grads


def _mean(losses, comm, grid, n_items: int) -> float:
    """The sum of every rank's ``losses`` over ``comm`` (the ranks with the other rows of
    the layer) and the depth, over ``n_items`` (phase ``aux.mean``)."""
    total = losses.sum().reshape(1)
    with grid.trace.phase("aux.mean"):
        total = _allreduce(grid.depth, _allreduce(comm, total))
    return float(total[0]) / n_items


class HeadCache(NamedTuple):
    config: Config
    grid: Any
    params: dict
    shape: tuple                 # (bl, t)
    lnf: ops.LayerNormCache
    xf: Array                    # lnf output, layout A (N, h/q)
    logits: Array                # layout B (N, v/q), vocabulary block i; classifier:
    #                              (bl, k) of the sequences R_{k,i}, replicated over j
    ce: Any = None
    n_items: Optional[int] = None


def head_forward(x, p: dict, targets, config: Config, grid, n_items: Optional[int] = None):
    """Final LayerNorm, LM head (tied: ``x wte^T``; untied: ``x head.w``) or classifier,
    and the loss on the layout-A block x (bl, t, h/q); as
    :func:`summasim.transformer.optimus.head_forward` (``loss`` the sum over ``n_items``
    of the micro-batch's per-item losses divided by it, the same on every rank)."""
    tr = grid.trace
    q = grid.q
    bl, t, hq = x.shape
    xp = array_module(x)
    with tr.phase("lnf.fwd"), tr.phase("aux.ln"):
        xf, lnf = ops.layernorm_forward(x.reshape(bl * t, hq), p["lnf.g"], p["lnf.b"],
                                        sum_hidden=_row_sum(grid), hidden=config.hidden)
    if config.n_classes:
        with tr.phase("clshead.fwd"), tr.phase("aux.logits"):
            last = xp.ascontiguousarray(xf.reshape(bl, t, hq)[:, -1])      # (bl, h/q)
            lg = last @ p["cls.w"]                                         # (bl, k) partial
            if grid.j == 0:
                lg += p["cls.b"]
            lg = ops.stored(_allreduce(grid.row, lg))                      # (bl, k)
        loss, ce = None, None
        if targets is not None:
            n_items = math.prod(targets.shape) if n_items is None else n_items
            tgt = _row_block(targets, grid, xp, "i")                       # (bl,)
            with tr.phase("loss"):
                losses, ce = ops.cross_entropy_forward(lg, tgt)
                loss = _mean(losses, grid.col, grid, n_items)   # rows R_{k,i}
        return loss, HeadCache(config=config, grid=grid, params=p, shape=(bl, t), lnf=lnf,
                               xf=xf, logits=lg, ce=ce, n_items=n_items)
    vb = vocab_block(config.vocab, q)
    with tr.phase("lmhead.fwd"), tr.phase("aux.logits"):
        if config.tied:
            lg = _linear(xf, p["wte"], grid, "ab", trans_w=True, rows=vb)  # B (N, v/q)
        else:
            lg = _linear(xf, p["head.w"], grid, "ab")                      # B (N, v/q)
        ops.stored(lg)
    loss, ce = None, None
    if targets is not None:
        n_items = math.prod(targets.shape) if n_items is None else n_items
        tgt = _row_block(targets, grid, xp, "j").reshape(-1)               # (N,)
        start = grid.i * vb
        with tr.phase("loss"):
            with tr.phase("aux.ce"):    # vocabulary blocks i: all-reduces over col
                losses, ce = ops.cross_entropy_forward(
                    lg, tgt, vocab_start=start,
                    max_vocab=lambda a: _allreduce(grid.col, ops.local_max(a), op="max"),
                    sum_vocab=lambda a: _allreduce(grid.col, ops.local_sum(a)),
                    vocab_valid=config.vocab - start)
            loss = _mean(losses, grid.row, grid, n_items)           # rows R_{k,j}
    return loss, HeadCache(config=config, grid=grid, params=p, shape=(bl, t), lnf=lnf,
                           xf=xf, logits=lg, ce=ce, n_items=n_items)


def head_backward(cache: HeadCache, loss_scale: float = 1.0):
    """``(dx (bl, t, h/q), grads)`` of the head, seeded with ``loss_scale/n_items``:
    ``lnf.g``, ``lnf.b`` and the head's ``wte`` part (tied), ``head.w`` or ``cls.w``,
    ``cls.b`` (phases ``lmhead.bwd`` / ``clshead.bwd``, ``lnf.bwd``)."""
    if cache.ce is None:
        raise ValueError("tp3d.backward needs a forward with targets")
    config, grid = cache.config, cache.grid
    xp = array_module(cache.logits)
    tr = grid.trace
    bl, t = cache.shape
    hq = cache.xf.shape[1]
    dlosses = xp.full(cache.logits.shape[0], float(loss_scale) / cache.n_items,
                      dtype=cache.logits.dtype)
    dlogits, _ = ops.cross_entropy_backward(dlosses, cache.ce)
    grads = {}
    if config.n_classes:
        with tr.phase("clshead.bwd"):
            w = cache.params["cls.w"]                                      # (h/q, k)
            last = xp.ascontiguousarray(cache.xf.reshape(bl, t, hq)[:, -1])
            dx = xp.zeros((bl, t, hq), dtype=dlogits.dtype)
            dx[:, -1] = dlogits @ w.T
            (gw, gb), _ = _reduce_vectors(grid, [last.T @ dlogits, dlogits.sum(axis=0)], [])
            grads["cls.w"], grads["cls.b"] = gw, gb
        dx = ops.stored(dx.reshape(bl * t, hq))
    else:
        vb = vocab_block(config.vocab, grid.q)
        with tr.phase("lmhead.bwd"):
            if config.tied:
                dx, dw = _linear_backward(dlogits, cache.xf, cache.params["wte"], grid, "ab",
                                          "aux.logits", trans_w=True, rows=vb)
                grads["wte"] = dw
            else:
                dx, dw = _linear_backward(dlogits, cache.xf, cache.params["head.w"], grid,
                                          "ab", "aux.logits")
                grads["head.w"] = dw
    with tr.phase("lnf.bwd"):
        with tr.phase("aux.ln"):
            dx, gl = ops.layernorm_backward(dx, cache.lnf)
        (gg, gbias), _ = _reduce_vectors(grid, [gl["g"], gl["b"]], [])
    grads["lnf.g"], grads["lnf.b"] = gg, gbias
    return ops.stored(dx).reshape(bl, t, hq), grads


stage_keys = model.stage_keys


# --------------------------------------------------------------------------- #
# model: the pieces in a row                                                  #
# --------------------------------------------------------------------------- #
#: The model's cache: Optimus's fields (local params, shape, batch, the pieces' caches,
#: this rank's logits block, the loss).
TP3DCache = OptimusCache


def forward(local_params: dict, tokens, targets, config: Config, grid,
            checkpoint: bool = False, *, recompute: Optional[str] = None,
            attention: str = "plain", tile: Optional[int] = None):
    """Mean cross-entropy and the cache, on every rank: as
    :func:`summasim.transformer.optimus.forward` on a q x q x q cube (``tokens`` the
    global batch; each rank takes its ``b/q^2`` sequences). Bad arguments on any rank
    raise on every rank before any data moves (one untraced agreement)."""
    return run_forward(sys.modules[__name__], "tp3d", TP3DCache, local_params, tokens,
                       targets, config, grid, checkpoint, recompute, attention, tile)


def backward(cache: TP3DCache) -> dict:
    """Local gradients of the mean loss: the keys, order and shapes of the local params
    (replicated vectors' gradients summed over every rank that holds them)."""
    return run_backward(sys.modules[__name__], cache)


def local_logits(full, config: Config, grid):
    """This rank's block of the global logits ``full`` ``[b, s, v]`` (layout B: rows
    ``R_{k,j}``, vocabulary block i, ``[N, v/q]``; a classifier's ``[b, k]``: rows
    ``R_{k,i}``); no data moves."""
    xp = array_module(full)
    if config.n_classes:
        return _row_block(full, grid, xp, "i")
    q = grid.q
    vb = vocab_block(config.vocab, q)
    rows = _row_block(full, grid, xp, "j").reshape(-1, config.vocab)       # (N, v)
    lo, hi = grid.i * vb, min((grid.i + 1) * vb, config.vocab)
    out = xp.zeros((rows.shape[0], vb), dtype=full.dtype)
    out[:, :max(hi - lo, 0)] = rows[:, lo:hi]
    return out


def logits(cache: TP3DCache, config: Config, grid):
    """The global logits ``[b, s, v]`` (a classifier's ``[b, k]``) on every rank: one
    all-gather over ``grid.world`` (phase ``logits/aux.join``; for checks)."""
    q = grid.q
    lg = cache.logits
    xp = array_module(lg)
    with grid.trace.phase("logits"), grid.trace.phase("aux.join"):
        parts = _gather_rows(grid.world, xp.ascontiguousarray(lg), "tp3d.join")
    parts = parts.reshape((grid.world.size,) + tuple(lg.shape))
    if config.n_classes:
        bl = lg.shape[0]
        full = xp.empty((q * q * bl, lg.shape[1]), dtype=lg.dtype)
        for r in range(grid.world.size):
            k, i, j = _kij(r, q)
            if j == 0:
                full[(k * q + i) * bl:(k * q + i + 1) * bl] = parts[r]
        return full
    bl, t = cache.shape
    vb = lg.shape[1]
    full = xp.empty((q * q * bl * t, q * vb), dtype=lg.dtype)
    n = bl * t
    for r in range(grid.world.size):
        k, i, j = _kij(r, q)
        full[(k * q + j) * n:(k * q + j + 1) * n, i * vb:(i + 1) * vb] = parts[r]
    full = xp.ascontiguousarray(full[:, :config.vocab])
    return full.reshape(cache.batch, t, config.vocab)


# --------------------------------------------------------------------------- #
# closed forms                                                                #
# --------------------------------------------------------------------------- #
def linears(config: Config) -> list:
    """``(name, in, out, orient)`` of one layer's linears in forward order."""
    h, f = config.hidden, config.ffn
    out = [("attn.qkv", h, config.qkv_width, "ab"), ("attn.proj", h, h, "ba"),
           ("mlp.fc", h, f, "ab")]
    if config.mlp == "swiglu":
        out.append(("mlp.gate", h, f, "ab"))
    return out + [("mlp.proj", f, h, "ba")]


def linear_payload(n_rows: int, fin: int, fout: int, q: int, *,
                   in_w: Optional[int] = None, out_w: Optional[int] = None) -> dict:
    """Per-rank items one 3D linear ``[fin, fout]`` passes to its collectives, with
    ``n_rows`` local rows (as the trace records them: an all-gather its piece, a
    reduce-scatter its whole buffer; the weight's depth pieces padded to the largest,
    ``w = ceil(in/q^2) out/q``): ``{"fwd": N in/q + w + N out, "bwd": N out/q + N in/q +
    w + N in + q w}`` (``q w = in out/q^2`` when q^2 divides in); 0 when q = 1. Where q
    does not cut the sizes evenly, ``in_w`` and ``out_w`` are the rank's input and output
    block widths (in place of ``in/q``, ``out/q``; ``w = ceil(in_w/q) out_w``)."""
    if q == 1:
        return {"fwd": 0, "bwd": 0}
    n = n_rows
    iq = fin // q if in_w is None else int(in_w)
    oq = fout // q if out_w is None else int(out_w)
    wpiece = -(-iq // q) * oq                   # the largest depth piece
    return {"fwd": n * iq + wpiece + q * n * oq,
            "bwd": n * oq + n * iq + wpiece + q * n * iq + q * wpiece}


def _linear_widths(config: Config, q: int, name: str, orient: str, i: int, j: int):
    """``(in_w, out_w)`` of linear ``name`` on rank (., i, j): "ab" reads input block j
    and writes output block i, "ba" the other way round (:func:`cut`)."""
    ins, outs = _AXES[f"{name}.w"]
    a, b = (j, i) if orient == "ab" else (i, j)
    return _width(config, q, a, ins), _width(config, q, b, outs)


def layer_payload(config: Config, batch: int, q: int, seq: Optional[int] = None, *,
                  i: int = 0, j: int = 0) -> dict:
    """Per-rank ``tp.*`` items of one layer (the sum of :func:`linear_payload` over its
    linears, ``N = b t / q^2`` rows for sequences of ``seq`` tokens, default
    ``config.seq``): ``{"fwd", "bwd", "bwd_checkpoint"}`` (recompute "full" re-runs the
    forward inside the backward). Where q does not cut the sizes evenly the blocks
    differ by rank: rank (., i, j)'s (rank (0, 0) holds the largest blocks)."""
    n = batch * (config.seq if seq is None else seq) // (q * q)
    fwd = bwd = 0
    for name, fin, fout, orient in linears(config):
        in_w, out_w = _linear_widths(config, q, name, orient, i, j)
        pay = linear_payload(n, fin, fout, q, in_w=in_w, out_w=out_w)
        fwd += pay["fwd"]
        bwd += pay["bwd"]
    return {"fwd": fwd, "bwd": bwd, "bwd_checkpoint": fwd + bwd}


def layer_words(config: Config, batch: int, q: int, seq: Optional[int] = None, *,
                i: int = 0, j: int = 0) -> int:
    """Items rank (., i, j) receives in one layer's ``tp.*`` collectives, forward and
    backward (an all-gather of a piece brings q - 1 pieces, a reduce-scatter of a
    buffer (q - 1)/q of it): ``(q - 1)`` times the all-gathered pieces plus ``(q - 1)/q``
    of the reduce-scattered buffers."""
    if q == 1:
        return 0
    n = batch * (config.seq if seq is None else seq) // (q * q)
    words = 0
    for name, fin, fout, orient in linears(config):
        in_w, out_w = _linear_widths(config, q, name, orient, i, j)
        pay = linear_payload(n, fin, fout, q, in_w=in_w, out_w=out_w)
        wpiece = -(-in_w // q) * out_w
        gathered = n * in_w + wpiece + n * out_w + n * in_w + wpiece
        scattered = pay["fwd"] + pay["bwd"] - gathered        # whole buffers, q blocks each
        words += (q - 1) * gathered + (q - 1) * scattered // q
    return words
