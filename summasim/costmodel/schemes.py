"""Cost of one transformer layer under Megatron (1D), Optimus (2D) and SUMMA2.5-LM.

Symbols: b batch, s sequence length, h hidden size, n attention heads, v vocabulary,
N layers, f the MLP multiplier (``ffn``: the MLP is f h wide; GPT-2 has f = 4), p
ranks; Optimus runs on a q x q grid (p = q^2), SUMMA2.5-LM on [q, q, d]
(p = d q^2). One layer is attention (QKV [h, 3h], scores, projection [h, h]) and
an MLP ([h, f h], [f h, h]); activations are [b s, h]. The formulas below are
written for any f, with the GPT-2 values (f = 4) in brackets where the papers
print them.

A grid must divide the model it runs (:func:`misfit`): Megatron splits the heads,
h, the MLP width f h and the vocabulary over p; Optimus and SUMMA2.5-LM split h,
the heads, f h and v over q and the batch over d q. :func:`grid_shapes` with a
config lists only the grids that do, so a sweep never prices a model that cannot
run on its grid.

What each scheme does per layer (what :func:`layer_ops` lists)
--------------------------------------------------------------
Megatron (p)        local GEMMs on column/row slices of the weights; 2 all-reduces
                    of b s h items on the whole group per forward (after attention,
                    after the MLP) and 2 in backward (the f operator's conjugate).
Optimus (q x q)     each linear C = X W is ``summa_ab(bs, in, out)``; backward is
                    ``summa_abt(dC, W)`` for dX and ``summa_atb(X, dC)`` for dW
                    (Optimus eqs. 1-3); attention is local to (b/q) sequences and
                    n/q heads. Per rank that is ((3+f)bsh + (4+2f)h^2)/q items
                    [(7bsh + 12h^2)/q] of broadcast and reduce payload forward and
                    twice that backward.
SUMMA2.5-LM         the same with ``summa25_*`` on [q, q, d]: activations split into
                    d q row blocks, weights 2D and replicated over depth; dW is
                    all-reduced over the depth (ring, 2(d-1) sendrecvs).

With activation checkpointing the backward pass first recomputes the forward
(its communication included), so backward = 3x forward for Optimus and 2x for
Megatron (Optimus section 4). Megatron sends nothing at p = 1 (it skips groups of
one). ``include_minor=True`` adds the non-SUMMA traffic that the paper calls
negligible, as :mod:`summasim.transformer.optimus` sends it: per layer forward ONE
packed column broadcast of the eight row-0 vectors (``(9h + f h)/q`` items) and 4
row all-reduces of ``b s/(d q)`` LayerNorm statistics (2 per LayerNorm: mean, then
variance); backward 4 such all-reduces, ONE packed column reduce of the vector
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
((9+f)h/q on those ranks); SUMMA2.5-LM stores
weights over q^2 (replicated over depth) and vectors over q; both host ``wpe`` on
row 0 as ``[s, h/q]`` (s h / q items on those ranks) and ``wte`` in q x q blocks.
Gradients equal the
parameters; the optimizer adds ``optimizer_states`` x parameters (Adam: 2).

Activations kept for backward, per layer, in items of the unsplit model:
``(8+2f) b s h + b n s^2 + 4 b s`` [16 b s h + ...] (LN1 input and output, QKV 3bsh,
attention probabilities b n s^2, attention output, residual, LN2 output, fc1 and
GELU outputs f bsh each, LayerNorm mean and rstd). Megatron keeps the LayerNorm
inputs and outputs (4bsh + 4bs) whole on every rank and splits the rest over p; Optimus
and SUMMA2.5-LM split everything over p (statistics over q or dq). Without
checkpointing all N layers' activations are kept; with it, each layer's input
(b s h / p, distributed checkpoints as in the paper) plus one layer's activations
while it is recomputed. Add two activation-gradient buffers of the layer input
size, the SUMMA workspaces (double-buffered broadcast blocks and partial sums of
the widest linear, w = max(3h, f h): (4 b s w + 2 h w)/p for Optimus [(16 b s h +
8 h^2)/p]), and with a vocabulary the embedding table and
the logits with their gradient (2 b s v / p).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Mapping

from ..grid import grid_shapes as _grid_shapes
from ..transformer.schemes import SCHEME_NAMES
from . import traffic as _traffic
from .collectives import MPICH, Thresholds
from .machine import Machine, itemsize_of
from .predict import Prediction, make_pricer, price_messages
from .roofline import gemm_roofline, kernels_seconds, layer_kernels, model_kernels
from .topology import Placement

SCHEMES = SCHEME_NAMES       # the one registry: summasim.transformer.schemes
_ALIASES = {"megatron": "megatron", "1d": "megatron", "optimus": "optimus", "2d": "optimus",
            "summa25": "summa25", "2.5d": "summa25", "summa2.5": "summa25",
            "summa25-lm": "summa25"}


@dataclass(frozen=True)
class TransformerConfig:
    """Problem size of a transformer (all sizes in items).

    Parameters
    ----------
    b, s, h, n : int or float
        Batch, sequence length, hidden size, attention heads.
    N : int
        Number of layers.
    v : int
        Vocabulary (0: leave out embedding and head).
    dtype : str
        Dtype of parameters, activations and messages.
    checkpoint : bool
        Activation checkpointing (recompute each layer's forward in backward).
    optimizer_states : float
        Optimizer state per parameter, in parameters (Adam: 2).
    ffn : float
        MLP multiplier f: the MLP is ``[h, f h]``, ``[f h, h]`` (GPT-2: 4; the
        model's ``Config.ffn_mult``).
    dropout : float
        Dropout probability of the attention probabilities and the two hidden
        dropouts (0: none, as in summasim's model; Megatron-LM trains with 0.1).
        Priced by the roofline model only (its masks and kernels).

    Sizes may be real (the isoefficiency solver varies h continuously) but must be
    finite and positive (v, optimizer_states: non-negative); a ``ValueError`` names
    the field. Whether a grid divides the sizes is :func:`misfit`'s question. Build
    one from the model's configuration with :meth:`from_model`.
    """

    b: float = 8
    s: float = 512
    h: float = 1024
    n: float = 16
    N: int = 24
    v: float = 0
    dtype: str = "float32"
    checkpoint: bool = True
    optimizer_states: float = 2.0
    ffn: float = 4
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("b", "s", "h", "n", "N", "v", "ffn", "optimizer_states"):
            val = getattr(self, name)
            ok = (not isinstance(val, bool) and isinstance(val, numbers.Real)
                  and math.isfinite(val))
            if not ok or val < 0 or (val == 0 and name not in ("v", "optimizer_states")):
                want = "non-negative" if name in ("v", "optimizer_states") else "positive"
                raise ValueError(f"TransformerConfig.{name} must be a finite {want} number, "
                                 f"got {val!r}")
        itemsize_of(self.dtype)              # a ValueError naming the known dtypes
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 <= d < 1:
            raise ValueError(f"TransformerConfig.dropout must be a number in [0, 1), got {d!r}")

    @classmethod
    def from_model(cls, config, batch, checkpoint: bool = False,
                   optimizer_states: float = 2.0) -> "TransformerConfig":
        """The priced workload of a :class:`summasim.transformer.model.Config`.

        The one bridge from the model's configuration to the cost model: vocab,
        seq, hidden, heads, layers, ffn_mult and dtype become v, s, h, n, N, ffn
        and dtype; ``batch`` is b (sequences per step). ``checkpoint`` defaults to
        False, as the model's ``forward`` does. A classification head
        (``n_classes > 0``) is not priced: ``ValueError``.
        """
        if getattr(config, "n_classes", 0):
            raise ValueError(f"the cost model prices the language-model head only; "
                             f"Config.n_classes = {config.n_classes}")
        dtype = config.dtype
        return cls(b=batch, s=config.seq, h=config.hidden, n=config.heads, N=config.layers,
                   v=config.vocab, dtype=str(getattr(dtype, "name", dtype)),
                   checkpoint=bool(checkpoint), optimizer_states=optimizer_states,
                   ffn=config.ffn_mult)

    def replace(self, **kw) -> "TransformerConfig":
        return replace(self, **kw)

    @property
    def ffn_width(self):
        """The MLP width f h (an int when it is whole)."""
        return _whole(self.ffn * self.h)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)


@dataclass(frozen=True)
class Scheme:
    """A parallel scheme and its grid: ``megatron`` over p, ``optimus`` on q x q,
    ``summa25`` on [q, q, d]."""

    name: str
    p: int
    q: int = 1
    d: int = 1

    @classmethod
    def make(cls, name: str, p: int | None = None, q: int | None = None,
             d: int = 1) -> "Scheme":
        """Build and check a scheme; ``optimus`` and ``summa25`` take q (and d) or p."""
        key = _ALIASES.get(str(name).lower())
        if key is None:
            raise ValueError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}")
        if key == "megatron":
            if p is None or p < 1:
                raise ValueError(f"megatron needs p >= 1, got {p!r}")
            return cls(key, int(p), 1, 1)
        if key == "optimus":
            d = 1
        if q is None:
            if p is None:
                raise ValueError(f"{key} needs q (or p)")
            q = math.isqrt(int(p) // d)
        if q < 1 or d < 1 or (p is not None and p != d * q * q):
            raise ValueError(f"{key} needs p = d*q*q, got p={p}, q={q}, d={d}")
        return cls(key, d * q * q, int(q), int(d))

    @property
    def label(self) -> str:
        if self.name == "megatron":
            return f"Megatron p={self.p}"
        if self.name == "optimus":
            return f"Optimus [{self.q},{self.q}]"
        return f"SUMMA2.5 [{self.q},{self.q},{self.d}]"


def grid_shapes(p: int, name: str, cfg: "TransformerConfig | None" = None) -> list[Scheme]:
    """Every grid of ``p`` ranks for scheme ``name`` (SUMMA2.5: 1 <= d <= q); with
    ``cfg``, only those that divide it (:func:`misfit` is None)."""
    key = _ALIASES.get(str(name).lower())
    if key == "megatron":
        out = [Scheme("megatron", p)]
    else:          # summasim.grid's one enumeration, d ascending; SUMMA2.5 keeps d <= q
        out = [Scheme(key, p, q, d) for q, d in reversed(_grid_shapes(p, "any"))
               if (d == 1 if key == "optimus" else d <= q)]
    if cfg is not None:
        out = [sch for sch in out if misfit(sch, cfg) is None]
    return out


def _divides(div: int, size) -> bool:
    """``div`` divides ``size`` (a real size that is not whole is divisible by nothing)."""
    size = _whole(size)
    return isinstance(size, numbers.Integral) and size % div == 0


def misfit(scheme: Scheme, cfg: "TransformerConfig", *, batch: bool = True) -> str | None:
    """Why ``scheme``'s grid cannot run ``cfg``, or None when it divides the model.

    Megatron over p: heads n, hidden h, the MLP width f h and the vocabulary v
    (when v > 0) divisible by p (whole heads, column and row slices, vocabulary
    slices per rank). Optimus and SUMMA2.5-LM on [q, q, d]: the batch b by d q
    (whole sequences per rank; skipped with ``batch=False``), and h, n, f h, v by
    q. The same conditions as the schemes' own checks (``megatron.check``,
    ``optimus.check``); the reason names every size that fails and its divisor
    (``"; "``-separated).
    """
    p, q, d = scheme.p, scheme.q, scheme.d
    if scheme.name == "megatron":
        dims = [("heads n", cfg.n, p, "p"), ("hidden h", cfg.h, p, "p"),
                ("MLP width f h", cfg.ffn_width, p, "p")]
        if cfg.v:
            dims.append(("vocabulary v", cfg.v, p, "p"))
    else:
        dims = [("batch b", cfg.b, d * q, "d q" if d > 1 else "q")] if batch else []
        dims += [("hidden h", cfg.h, q, "q"), ("heads n", cfg.n, q, "q"),
                 ("MLP width f h", cfg.ffn_width, q, "q")]
        if cfg.v:
            dims.append(("vocabulary v", cfg.v, q, "q"))
    bad = [f"{what} = {_fmt_num(size)} is not divisible by {sym} = {div}"
           for what, size, div, sym in dims if not _divides(div, size)]
    return "; ".join(bad) or None


def _fmt_num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


# -- the ops of one layer -----------------------------------------------------------------
# ("mm", algorithm, m, k, n)           distributed matmul priced by traffic + collectives
# ("gemm", m, k, n, count)             local GEMMs
# ("coll", op, group, size, items, count)  a collective priced directly
# ("ring", group, size, items, count)  summasim's ring_allreduce (2(size-1) sendrecvs)
def layer_ops(scheme: Scheme, cfg: TransformerConfig, *, include_minor: bool = False,
              checkpoint: bool | None = None, row0: bool = True) -> dict[str, list]:
    """``{"forward": [...], "backward": [...]}`` ops of one layer (see module doc).

    The backward list includes the recomputed forward when checkpointing. ``row0``:
    the rank is on grid row 0 (only those run the depth ring of the vector gradients).
    """
    ck = cfg.checkpoint if checkpoint is None else checkpoint
    b, s, h, n = cfg.b, cfg.s, cfg.h, cfg.n
    M, hd = b * s, _split(h, n)
    p, q, d = scheme.p, scheme.q, scheme.d
    fwd, bwd = [], []
    if scheme.name == "megatron":
        for name, fin, fout in _linears(cfg):
            # qkv and fc1 are split by columns, proj and fc2 by rows (Megatron's f and g)
            fin, fout = ((fin, _split(fout, p)) if _LINEARS_COL[name]
                         else (_split(fin, p), fout))
            fwd.append(("gemm", M, fin, fout, 1))
            bwd += [("gemm", M, fout, fin, 1), ("gemm", fin, M, fout, 1)]
        seqs = _split(b * n, p)
        fwd += [("gemm", s, hd, s, seqs), ("gemm", s, s, hd, seqs)]
        bwd += [("gemm", s, hd, s, 2 * seqs), ("gemm", s, s, hd, 2 * seqs)]
        if p > 1:  # Megatron skips the all-reduce on a group of one (its _reduce)
            fwd.append(("coll", "allreduce", "world", p, M * h, 2))
            bwd.append(("coll", "allreduce", "world", p, M * h, 2))
    else:
        ab, abt, atb = (("summa_ab", "summa_abt", "summa_atb") if scheme.name == "optimus"
                        else ("summa25_ab", "summa25_abt", "summa25_atb"))
        rows = d * q
        for _, fin, fout in _linears(cfg):
            fwd.append(("mm", ab, M, fin, fout))
            bwd += [("mm", abt, M, fout, fin), ("mm", atb, fin, M, fout)]
        seqs = _split(b, rows) * _split(n, q)
        fwd += [("gemm", s, hd, s, seqs), ("gemm", s, s, hd, seqs)]
        bwd += [("gemm", s, hd, s, 2 * seqs), ("gemm", s, s, hd, 2 * seqs)]
        if include_minor:
            fwd_aux, bwd_aux = _optimus_layer_aux(h, M, q, d, ffn=cfg.ffn, row0=row0)
            fwd += fwd_aux
            bwd += bwd_aux
    if ck:
        bwd = list(fwd) + bwd
    return {"forward": fwd, "backward": bwd}


_LINEARS_COL = {"qkv": True, "proj": False, "fc1": True, "fc2": False}


def _linears(cfg: TransformerConfig) -> tuple:
    """``(name, in, out)`` of the layer's four linears, in items: QKV [h, 3h],
    projection [h, h], fc1 [h, f h], fc2 [f h, h]."""
    h, f = cfg.h, cfg.ffn_width
    return (("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, f), ("fc2", f, h))


def _whole(x):
    """``x`` as an int when it is a whole non-integer type (so Fractions stay exact)."""
    if isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral) and x == int(x):
        return int(x)
    return x


def _optimus_layer_aux(h, M, q, d, ffn=4, row0=True):
    """The non-SUMMA traffic of one Optimus / SUMMA2.5-LM layer, as the code sends it.

    Forward: the eight row-0 vectors (LayerNorm g and b, four biases: ``(9h + f)/q``
    items) as ONE packed column broadcast; LayerNorm statistics as 4 row all-reduces
    of ``b s/(d q)`` items (2 LayerNorms, each all-reducing the mean and then the
    variance). Backward: 4 row all-reduces (each LayerNorm backward all-reduces two
    means), ONE packed column reduce of the vector gradients onto row 0, and for
    d > 1 a ring all-reduce of that buffer over the depth among the row-0 ranks.
    Groups of one send nothing.
    """
    fwd, bwd = [], []
    vec = _split(9 * h + _whole(ffn * h), q)
    stats = _split(M, d * q)
    if q > 1:
        fwd.append(("coll", "bcast", "col", q, vec, 1))
        fwd.append(("coll", "allreduce", "row", q, stats, 4))
        bwd.append(("coll", "allreduce", "row", q, stats, 4))
        bwd.append(("coll", "reduce", "col", q, vec, 1))
    if d > 1 and row0:
        bwd.append(("ring", "depth", d, vec, 1))
    return fwd, bwd


def _split(x, by):
    """x / by, exact for integers that divide, else real."""
    if isinstance(x, int) and isinstance(by, int) and x % by == 0:
        return x // by
    return x / by


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
        return {"scheme": s.name, "label": s.label, "p": s.p, "q": s.q, "d": s.d,
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


def _gemm_seconds(machine: Machine, m_, k_, n_, cnt, dtype, itemsize, batched=False) -> float:
    """``cnt`` local GEMMs: the machine's gamma, or on a roofline device
    :func:`~summasim.costmodel.roofline.gemm_roofline` (one launch per GEMM, or one
    for the whole batch when ``batched``: attention's per-head products)."""
    if machine.device is None:
        return cnt * machine.gemm_time(m_, k_, n_, dtype)
    dev = machine.device
    one = gemm_roofline(machine, dev, m_, k_, n_, dtype, itemsize)
    if batched and cnt > 1 and one > 0:
        return cnt * (one - dev.launch_seconds) + dev.launch_seconds
    return cnt * one


def _price_ops(ops, scheme, cfg, machine, pricer, strict, compute=True):
    it = cfg.itemsize
    out = PassCost()
    by_op: dict = {}
    algs: dict = {}
    q, d = scheme.q, scheme.d
    for op in ops:
        if op[0] == "gemm":
            if compute:
                _, m_, k_, n_, cnt = op
                out.compute_seconds += _gemm_seconds(machine, m_, k_, n_, cnt, cfg.dtype, it,
                                                     batched=True)
                out.mults += cnt * m_ * k_ * n_
            continue
        if op[0] == "mm":
            _, alg, m_, k_, n_ = op
            msgs = _traffic.algorithm_messages(alg, m_, k_, n_, q, d, it, None, strict=strict)
            if compute:
                work = _traffic.algorithm_compute(alg, m_, k_, n_, q, d, it, None, strict=strict)
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
        kernels (:func:`~summasim.costmodel.roofline.layer_kernels`).
    """
    ck = cfg.checkpoint if checkpoint is None else checkpoint
    cfg = cfg.replace(checkpoint=ck)
    ops = layer_ops(scheme, cfg, include_minor=include_minor)
    rpn = ranks_per_node if ranks_per_node is not None else machine.ranks_per_node(scheme.p)
    slow = machine.slowdown(rpn)
    comm_slow = slow if machine.shared_comm else 1.0
    pricer = make_pricer(machine, mode=mode, algorithms=algorithms,
                         thresholds=thresholds or MPICH, itemsize=cfg.itemsize, q=scheme.q,
                         d=scheme.d, p=scheme.p, placement=placement)
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


# -- Table 1 ------------------------------------------------------------------------------
def _log2_exact(x: int):
    return x.bit_length() - 1 if x > 0 and x & (x - 1) == 0 else math.log2(x)


def table1(scheme: str | Scheme, b: int, s: int, h: int, p: int, n: int | None = None,
           checkpoint: bool = True, ffn: float = 4) -> dict[str, Fraction | float]:
    """The Optimus paper's Table 1 entries computed from :func:`layer_ops`.

    Communication is priced with the paper's formulas (alpha = 0, beta = 1 per
    scalar), computation is counted in scalar multiplications. With integer
    arguments that divide and q a power of two the values are exact Fractions.
    ``n`` defaults to gcd(h, p q) (heads that every grid divides); ``ffn`` is the
    MLP multiplier f (the paper's 4).

    Returns
    -------
    dict
        Keys "forward communication", "backward communication", "forward
        computation", "backward computation".
    """
    sch = scheme if isinstance(scheme, Scheme) else Scheme.make(scheme, p=p)
    n = n if n is not None else math.gcd(h, sch.p * sch.q) or 1
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=1, dtype="float64", checkpoint=checkpoint,
                            ffn=ffn)
    ops = layer_ops(sch, cfg)
    out = {}
    for key in ("forward", "backward"):
        comm, mults, logs = Fraction(0), Fraction(0), {}
        for op in ops[key]:
            if op[0] == "gemm":
                mults += Fraction(op[4]) * Fraction(op[1]) * Fraction(op[2]) * Fraction(op[3])
                continue
            if op[0] == "mm":
                msgs = _traffic.algorithm_messages(op[1], op[2], op[3], op[4], sch.q, sch.d, 1)
                work = _traffic.algorithm_compute(op[1], op[2], op[3], op[4], sch.q, sch.d, 1)
                mults += sum(Fraction(a * b_ * c * cnt) for a, b_, c, cnt in work.gemms)
            else:
                _, cop, grp, size, items, cnt = op
                msgs = [_traffic.MessageClass(cop, grp, size, items, cnt)]
            for mc in msgs:
                B, P = Fraction(mc.nbytes) * mc.count, mc.group_size
                if P <= 1:
                    continue
                if mc.op in ("bcast", "reduce"):
                    if isinstance(_log2_exact(P), int):
                        comm += B * _log2_exact(P)
                    else:                 # log2 P irrational: its coefficient exactly
                        logs[P] = logs.get(P, Fraction(0)) + B
                elif mc.op == "allreduce":
                    comm += 2 * B * Fraction(P - 1, P)
                else:
                    comm += B
        for P, coef in sorted(logs.items()):  # one rounding per group size, as the paper's
            comm = comm + float(coef) * math.log2(P)
        out[f"{key} communication"] = comm
        out[f"{key} computation"] = mults
    return out


def table1_paper(scheme: str, b, s, h, p, ffn: float = 4) -> dict:
    """Table 1 as printed (log = log2; Fractions for integer input when sqrt(p) is
    an integer power of two), for an MLP ``ffn`` times h wide: the paper's f = 4
    gives the printed entries; for any f, 12 b s h^2 becomes (4 + 2f) b s h^2,
    7 b s h becomes (3 + f) b s h and 12 h^2 becomes (4 + 2f) h^2."""
    key = _ALIASES.get(str(scheme).lower())
    if key not in ("megatron", "optimus"):
        raise ValueError(f"table1_paper: Table 1 of the Optimus paper has a Megatron and an "
                         f"Optimus column, not {scheme!r}; for SUMMA2.5 on [q, q, d] use "
                         f"table1(Scheme.make('summa25', q=q, d=d), ...)")
    f = Fraction(ffn)
    wide, act = 4 + 2 * f, 3 + f              # 12 and 7 for f = 4
    comp_f = (wide * b * s * h * h + 2 * b * s * s * h) / Fraction(p)
    comp_b = 3 * comp_f
    if key == "megatron":
        return {"forward communication": Fraction(4 * (p - 1), p) * b * s * h,
                "backward communication": Fraction(8 * (p - 1), p) * b * s * h,
                "forward computation": comp_f, "backward computation": comp_b}
    sq = math.isqrt(p)
    per = act * b * s * h + wide * h * h
    if sq * sq != p:                                   # no q x q grid: the formula in floats
        fwd = math.log2(p) / (2 * math.sqrt(p)) * float(per)
        bwd = 3 * fwd
    elif isinstance(_log2_exact(p), int):              # exact
        fwd = Fraction(_log2_exact(p), 2 * sq) * per
        bwd = 3 * fwd
    else:   # log(p) / (2 sqrt p) = log2(q) / q, rounded once (table1's order of operations)
        fwd = float(Fraction(per, sq)) * math.log2(sq)
        bwd = float(Fraction(3 * per, sq)) * math.log2(sq)
    return {"forward communication": fwd, "backward communication": bwd,
            "forward computation": comp_f, "backward computation": comp_b}


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


def best_grid(p: int, cfg: TransformerConfig, machine: Machine, *,
              schemes=SCHEMES, **kw) -> tuple[SchemeCost | None, list[SchemeCost]]:
    """The fastest scheme and grid for ``p`` ranks, and every candidate's cost
    (only grids that divide ``cfg``: see :func:`misfit`)."""
    costs = [scheme_cost(sch, cfg, machine, **kw) for name in schemes
             for sch in grid_shapes(p, name, cfg)]
    best = min(costs, key=lambda c: c.step_seconds) if costs else None
    return best, costs


# -- a whole training step ------------------------------------------------------------------
def model_ops(scheme: Scheme, cfg: TransformerConfig, *, row0: bool = True) -> dict[str, list]:
    """``{"forward": [...], "backward": [...]}`` ops of one training step of the whole
    language model (embedding, N layers, final LayerNorm, tied LM head, loss), every
    collective included, as :mod:`summasim.transformer.megatron` and
    :mod:`summasim.transformer.optimus` send them (no checkpointing).

    Megatron: the embedding all-reduce of ``b s h`` items, the layers, the LM head's
    local GEMM, 3 all-reduces of ``b s`` items in the loss (max, sum of exponentials,
    target logit); backward the LM head's input-gradient all-reduce of ``b s h``.
    Optimus / SUMMA2.5-LM: the embedding as q column broadcasts of the ``wte`` blocks
    and one column broadcast of ``wpe[:s, H_j]``; the final LayerNorm's packed
    column broadcast (2h/q) and 2 row all-reduces; the head ``abt(x, wte)``; the loss's
    3 row all-reduces of ``b s/(d q)`` items and the column (and depth) all-reduce of
    one item. Backward: ``ab`` and ``atb`` of the head, the final LayerNorm's 2 row
    all-reduces, packed column reduce and (d > 1, ``row0``) depth ring, the layers,
    q column reduces of the ``dwte`` blocks and their depth ring, and the ``dwpe``
    column reduce and (``row0``) depth ring. ``row0=False`` leaves out the depth
    rings only row 0 runs.
    """
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    M = b * s
    p, q, d = scheme.p, scheme.q, scheme.d
    layer = layer_ops(scheme, cfg, include_minor=True, checkpoint=False, row0=row0)
    fwd, bwd = [], []
    if scheme.name == "megatron":
        if p > 1:
            fwd.append(("coll", "allreduce", "world", p, M * h, 1))
        fwd += N * layer["forward"]
        if v:
            fwd.append(("gemm", M, h, _split(v, p), 1))
            bwd += [("gemm", M, _split(v, p), h, 1), ("gemm", _split(v, p), M, h, 1)]
        if p > 1:
            fwd.append(("coll", "allreduce", "world", p, M, 3))
            bwd.append(("coll", "allreduce", "world", p, M * h, 1))
        bwd += N * layer["backward"]
        return {"forward": fwd, "backward": bwd}
    ab, abt, atb = (("summa_ab", "summa_abt", "summa_atb") if scheme.name == "optimus"
                    else ("summa25_ab", "summa25_abt", "summa25_atb"))
    rows = _split(M, d * q)
    if q > 1:
        if v:
            fwd.append(("coll", "bcast", "col", q, _split(v * h, q * q), q))
        fwd.append(("coll", "bcast", "col", q, _split(s * h, q), 1))
    fwd += N * layer["forward"]
    if q > 1:
        fwd.append(("coll", "bcast", "col", q, _split(2 * h, q), 1))
        fwd.append(("coll", "allreduce", "row", q, rows, 2))
    if v:                                            # the tied head (none without a vocabulary)
        fwd.append(("mm", abt, M, h, v))
    if q > 1:
        fwd.append(("coll", "allreduce", "row", q, rows, 3))
        fwd.append(("coll", "allreduce", "col", q, 1, 1))
    if d > 1:
        fwd.append(("coll", "allreduce", "depth", d, 1, 1))
    if v:
        bwd += [("mm", ab, M, v, h), ("mm", atb, v, M, h)]
    if q > 1:
        bwd.append(("coll", "allreduce", "row", q, rows, 2))
        bwd.append(("coll", "reduce", "col", q, _split(2 * h, q), 1))
    if d > 1 and row0:
        bwd.append(("ring", "depth", d, _split(2 * h, q), 1))
    bwd += N * layer["backward"]
    if q > 1:
        if v:
            bwd.append(("coll", "reduce", "col", q, _split(v * h, q * q), q))
        bwd.append(("coll", "reduce", "col", q, _split(s * h, q), 1))
    if d > 1:
        if v:
            bwd.append(("ring", "depth", d, _split(v * h, q * q), 1))
        if row0:
            bwd.append(("ring", "depth", d, _split(s * h, q), 1))
    return {"forward": fwd, "backward": bwd}


@dataclass
class StepWork:
    """One rank's local work in a training step: GEMMs ``(m, k, n, count)``, bytes
    added by summasim's ring all-reduces, elementwise activation items, and
    ``layers`` (N + 1: the layers and the embedding/head, each with the machine's
    fixed ``layer_seconds`` of call overhead)."""

    gemms: list
    reduce_bytes: float
    elementwise_items: float
    layers: float


def elementwise_items(scheme: Scheme, cfg: TransformerConfig) -> float:
    """Activation items whose elementwise work (LayerNorm, GELU, softmax, residuals,
    embedding lookup, cross-entropy) one rank does in a training step: per layer the
    activation items of :func:`memory` (Megatron keeps the LayerNorms whole), plus the
    local logits ``b s v / p`` and the embedding output."""
    b, s, h, v, N = cfg.b, cfg.s, cfg.h, cfg.v, cfg.N
    p = scheme.p
    bsh = b * s * h
    layer = _layer_activations(scheme, cfg)
    emb = bsh if scheme.name == "megatron" else bsh / p
    return N * layer + b * s * v / p + emb


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


def step_work(scheme: Scheme, cfg: TransformerConfig) -> StepWork:
    """:class:`StepWork` of one training step (forward + backward, no checkpointing) on
    the busiest rank (row 0) of ``scheme``."""
    ops = model_ops(scheme, cfg)
    gemms, red = [], 0.0
    it = cfg.itemsize
    for op in filter(_nonempty, ops["forward"] + ops["backward"]):
        if op[0] == "gemm":
            gemms.append(tuple(op[1:5]))
        elif op[0] == "mm":
            _, alg, m_, k_, n_ = op
            work = _traffic.algorithm_compute(alg, m_, k_, n_, scheme.q, scheme.d, it, None,
                                              strict=False)
            gemms += list(work.gemms)
            red += work.reduce_bytes
        elif op[0] == "ring" and op[2] > 1:
            _, grp, size, items, cnt = op
            red += cnt * (size - 1) / size * items * it
    return StepWork(gemms, red, elementwise_items(scheme, cfg), cfg.N + 1)


def _ops_messages(ops, scheme: Scheme, itemsize: int) -> list:
    """:class:`~summasim.costmodel.traffic.MessageClass` entries of a list of ops."""
    out = []
    for op in ops:
        if op[0] == "mm":
            _, alg, m_, k_, n_ = op
            out += _traffic.algorithm_messages(alg, m_, k_, n_, scheme.q, scheme.d, itemsize,
                                               None, strict=False)
        elif op[0] == "ring":
            _, grp, size, items, cnt = op
            out += _ring_allreduce_messages(items, size, grp, itemsize, cnt, False)
        elif op[0] == "coll" and op[3] > 1:
            _, cop, grp, size, items, cnt = op
            out.append(_traffic.MessageClass(cop, grp, size, items * itemsize, cnt))
    return out


def model_messages(scheme: Scheme, cfg: TransformerConfig, *, row0: bool = True) -> list:
    """The :class:`~summasim.costmodel.traffic.MessageClass` entries of one training
    step on one rank (what its trace records; origin of the grid, or ``row0=False``)."""
    ops = model_ops(scheme, cfg, row0=row0)
    return _ops_messages(ops["forward"] + ops["backward"], scheme, cfg.itemsize)


def step_cost(scheme: Scheme, cfg: TransformerConfig, machine: Machine, *,
              reduce_impl: str | None = None, ranks_per_node: int | None = None,
              placement: Placement | None = None):
    """Predicted seconds of one training step of the whole model on ``machine``, as a
    :class:`~summasim.costmodel.predict.Prediction` whose ``breakdown`` holds
    ``gemm_seconds``, ``memory_bound_seconds``, ``comm_seconds`` and
    ``comm_exposed_seconds`` (they add up to ``seconds``).

    On a machine without a roofline ``device`` (this VM): forward + backward without
    checkpointing, :func:`model_messages` priced like a trace plus :func:`step_work`
    (GEMMs, the ring additions, and ``gamma_elementwise`` per elementwise item); the
    shared-core model applies when the node is oversubscribed. On a GPU machine
    (``device`` set, or library "nccl"): :func:`step_breakdown` (checkpointing as
    ``cfg.checkpoint`` says, roofline kernels, the optimizer, NCCL collectives on the
    topology under ``placement``)."""
    from .predict import predict_trace

    if machine.device is not None or machine.library == "nccl":
        sb = step_breakdown(scheme, cfg, machine, placement=placement, reduce_impl=reduce_impl)
        return Prediction(sb.seconds, sb.comm_seconds, sb.seconds - sb.comm_exposed_seconds,
                          dict(sb.by_op), {}, dict(sb.algorithms), {}, 1.0, "mpich",
                          machine.name, breakdown=sb.breakdown())
    work = step_work(scheme, cfg)
    pred = predict_trace(model_messages(scheme, cfg), machine, p=scheme.p, q=scheme.q,
                         d=scheme.d, gemms=work.gemms, reduce_bytes=work.reduce_bytes,
                         elementwise_items=work.elementwise_items, layers=work.layers,
                         dtype=cfg.dtype,
                         reduce_impl=reduce_impl, ranks_per_node=ranks_per_node)
    gemm = sum(c * machine.gemm_time(a, b_, k, cfg.dtype) for a, b_, k, c in work.gemms)
    other = (machine.gamma_reduce * work.reduce_bytes
             + machine.gamma_elementwise * work.elementwise_items
             + machine.layer_seconds * work.layers)
    scale = pred.compute_seconds / (gemm + other) if gemm + other > 0 else 0.0
    floor = {k: v for k, v in pred.breakdown.items() if k.startswith("memory_floor")}
    pred.breakdown = {"gemm_seconds": gemm * scale, "memory_bound_seconds": other * scale,
                      "optimizer_seconds": 0.0, "comm_seconds": pred.comm_seconds,
                      "comm_exposed_seconds": pred.seconds - pred.compute_seconds, **floor}
    return pred


# -- a whole training step on a GPU cluster --------------------------------------------------
@dataclass
class StepBreakdown:
    """One training step on one rank (the busiest: grid row 0), split up.

    Times in seconds: ``gemm_seconds`` (local GEMMs, tensor cores for 16-bit
    dtypes), ``memory_bound_seconds`` (every non-GEMM kernel: LayerNorm, softmax,
    GELU, dropout, bias and residual adds, embedding, loss, local reductions, and
    the optimizer, which is also ``optimizer_seconds``), ``comm_seconds`` (every
    collective) and ``comm_exposed_seconds`` (the part not hidden under compute:
    all of it here, the schemes' collectives block the compute that needs their
    result). ``seconds`` = GEMM + memory-bound + exposed communication.
    ``launch_seconds`` is the kernel-launch share of GEMM and memory-bound time.
    ``model_flops`` is 6 x (forward GEMM flops) over all ranks, the useful work of
    a step without recomputation; ``tflops_per_device`` = model_flops / (p seconds).
    """

    scheme: Scheme
    config: TransformerConfig
    machine: str
    placement: str
    seconds: float
    gemm_seconds: float
    memory_bound_seconds: float
    optimizer_seconds: float
    comm_seconds: float
    comm_exposed_seconds: float
    launch_seconds: float
    kernels: int
    by_op: dict
    algorithms: dict
    memory: Memory
    model_flops: float

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / (self.scheme.p * self.seconds) / 1e12 if self.seconds else 0.0

    def breakdown(self) -> dict:
        """The four parts (what :func:`step_cost` puts in ``Prediction.breakdown``)."""
        return {"gemm_seconds": self.gemm_seconds,
                "memory_bound_seconds": self.memory_bound_seconds,
                "optimizer_seconds": self.optimizer_seconds,
                "comm_seconds": self.comm_seconds,
                "comm_exposed_seconds": self.comm_exposed_seconds,
                "launch_seconds": self.launch_seconds}

    def to_dict(self) -> dict:
        key = lambda k: f"{k[0]}/{k[1]}" if isinstance(k, tuple) else str(k)  # noqa: E731
        sch = self.scheme
        return {"scheme": sch.name, "grid": sch.label, "p": sch.p, "q": sch.q, "d": sch.d,
                "machine": self.machine, "placement": self.placement,
                "config": dict(self.config.__dict__), "seconds": self.seconds,
                **self.breakdown(), "kernels": self.kernels,
                "model_flops": self.model_flops, "tflops_per_device": self.tflops_per_device,
                "by_op": {key(k): v for k, v in self.by_op.items()},
                "algorithms": {key(k): list(v) for k, v in self.algorithms.items()},
                "memory": self.memory.to_dict()}


def _nonempty(op) -> bool:
    """False for a GEMM or product with a zero dimension (no vocabulary: no head)."""
    if op[0] == "gemm":
        return all(x != 0 for x in op[1:4])
    if op[0] == "mm":
        return all(x != 0 for x in op[2:5])
    return True


def step_ops(scheme: Scheme, cfg: TransformerConfig) -> dict[str, list]:
    """:func:`model_ops` of one training step with ``cfg.checkpoint`` honoured (the
    backward pass first recomputes every layer's forward, its collectives included)
    and no head when ``cfg.v == 0``."""
    ops = model_ops(scheme, cfg)
    fwd = [op for op in ops["forward"] if _nonempty(op)]
    bwd = [op for op in ops["backward"] if _nonempty(op)]
    if cfg.checkpoint:
        layer = layer_ops(scheme, cfg, include_minor=True, checkpoint=False)
        bwd = cfg.N * layer["forward"] + bwd
    return {"forward": fwd, "backward": bwd}


def step_breakdown(scheme: Scheme, cfg: TransformerConfig, machine: Machine, *,
                   placement: Placement | None = None, mode: str = "mpich",
                   reduce_impl: str | None = None,
                   algorithms: Mapping[str, str] | None = None) -> StepBreakdown:
    """Price one training step of ``scheme`` on ``cfg`` (see :class:`StepBreakdown`).

    Parameters
    ----------
    scheme : Scheme
    cfg : TransformerConfig
        ``cfg.checkpoint`` adds the recomputed forward (GEMMs, kernels, collectives).
    machine : Machine
        NCCL machines price collectives on their topology; machines with a
        ``device`` price GEMMs and kernels with the roofline (others: ``gamma``
        tables and ``gamma_elementwise``, no optimizer).
    placement : Placement, optional
        Ranks on nodes (default row-major).
    mode, reduce_impl, algorithms
        As in :func:`scheme_cost` (NCCL: ``algorithms={"allreduce": "ring/Simple"}``
        forces an algorithm and protocol).

    Returns
    -------
    StepBreakdown
    """
    placement = placement or Placement()
    it = cfg.itemsize
    ops = step_ops(scheme, cfg)
    pricer = make_pricer(machine, mode=mode, algorithms=algorithms, itemsize=it, q=scheme.q,
                         d=scheme.d, p=scheme.p, reduce_impl=reduce_impl, placement=placement)
    dev = machine.device
    gemm = red_bytes = fwd_flops = 0.0
    launches = 0
    for key in ("forward", "backward"):
        for op in ops[key]:
            if op[0] == "gemm":
                _, m_, k_, n_, cnt = op
                gemm += _gemm_seconds(machine, m_, k_, n_, cnt, cfg.dtype, it, batched=True)
                launches += 1
                if key == "forward":
                    fwd_flops += 2.0 * cnt * m_ * k_ * n_
            elif op[0] == "mm":
                _, alg, m_, k_, n_ = op
                work = _traffic.algorithm_compute(alg, m_, k_, n_, scheme.q, scheme.d, it, None,
                                                  strict=False)
                for a, b_, c, cnt in work.gemms:
                    gemm += _gemm_seconds(machine, a, b_, c, cnt, cfg.dtype, it)
                    launches += cnt
                    if key == "forward":
                        fwd_flops += 2.0 * cnt * a * b_ * c
                red_bytes += work.reduce_bytes
            elif op[0] == "ring" and op[2] > 1:
                _, grp, size, items, cnt = op
                red_bytes += cnt * (size - 1) / size * items * it
    msgs = _ops_messages(ops["forward"] + ops["backward"], scheme, it)
    comm, by_op, algs = price_messages(msgs, machine, pricer=pricer)
    mem = memory(scheme, cfg)
    if dev is not None:
        local_params = (mem.params + mem.embedding) / it
        tensors = 12 * cfg.N + (4 if cfg.v else 2)
        kern = model_kernels(scheme, cfg, local_params, tensors)
        elementwise = kernels_seconds(kern["forward"] + kern["backward"], dev, cfg.dtype)
        # local additions (a += b: 3 bytes moved per operand byte), one kernel per op
        elementwise += 3.0 * red_bytes / dev.memory_bandwidth
        optimizer = kernels_seconds(kern["optimizer"], dev, cfg.dtype)
        n_kern = len(kern["forward"]) + len(kern["backward"]) + len(kern["optimizer"])
        launch = (n_kern + launches) * dev.launch_seconds
    else:
        work = step_work(scheme, cfg)
        elementwise = (machine.gamma_reduce * red_bytes
                       + machine.gamma_elementwise * work.elementwise_items
                       + machine.layer_seconds * work.layers)
        optimizer = launch = 0.0
        n_kern = 0
    slow = machine.slowdown(machine.ranks_per_node(scheme.p))
    comm_slow = slow if machine.shared_comm else 1.0
    gemm, elementwise, optimizer, launch = (x * slow for x in (gemm, elementwise, optimizer,
                                                                launch))
    comm *= comm_slow
    mem_bound = elementwise + optimizer
    total = gemm + mem_bound + comm
    # useful model flops: forward + backward (2 x forward) without recomputation, all ranks
    model_flops = 3.0 * fwd_flops * scheme.p
    return StepBreakdown(scheme, cfg, machine.name, placement.describe(), total, gemm,
                         mem_bound, optimizer, comm, comm, launch, n_kern + launches,
                         {k: v * comm_slow for k, v in by_op.items()}, algs, mem, model_flops)
