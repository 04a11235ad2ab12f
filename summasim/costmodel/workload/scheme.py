"""The priced workload (:class:`TransformerConfig`) and the grid it runs on (:class:`Scheme`).

Symbols: b batch, s sequence length, h hidden size, n attention heads, v vocabulary,
N layers, f the MLP multiplier; Megatron runs over p ranks, Optimus on a ``pr x pc``
grid (``q x q`` square: pr = pc = q), SUMMA2.5-LM on ``[pr, pc, d]`` (p = d pr pc), the
3D layer on the q x q x q cube (p = q^3, d = q). :func:`grid_shapes` is THE enumeration
of the grids (:func:`summasim.spec.grids`), :func:`misfit` says why a grid cannot shard a
model, :func:`grid_block` is the busiest rank's block of a size cut by the balanced
partition, :func:`grid_blocks` the extents of the busiest rank of a 2D/2.5D grid (its
column's head groups, MLP columns and weight rows) and :func:`grid_vocab` the vocabulary
such a grid pads to.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import NamedTuple

from ...spec import (ATTENTIONS, MLPS, RECOMPUTE, RECTANGULAR_SCHEMES, SCHEME_KINDS,
                     SCHEME_NAMES, TensorGrid, grids, partition)
from ...spec import vocab_block as spec_vocab_block
from ..machine import itemsize_of

SCHEMES = SCHEME_NAMES       # the one registry: summasim.transformer.schemes
_ALIASES = {"megatron": "megatron", "1d": "megatron", "optimus": "optimus", "2d": "optimus",
            "summa25": "summa25", "2.5d": "summa25", "summa2.5": "summa25",
            "summa25-lm": "summa25", "3d": "3d", "tp3d": "3d"}


#: The layer norms and the kernel styles a :class:`TransformerConfig` prices.
NORMS = ("layernorm", "rmsnorm")
KERNELS = ("fused", "eager")


@dataclass(frozen=True)
class TransformerConfig:
    """Problem size of a transformer (all sizes in items) and how its layers train.

    Parameters
    ----------
    b, s, h, n : int or float
        Batch, sequence length, hidden size, attention heads.
    N : int
        Number of layers.
    v : int
        Vocabulary (0: leave out embedding and head).
    dtype : str
        Dtype of parameters, activations and messages (a 16-bit dtype is mixed
        precision: 16-bit activations, messages and GEMMs, fp32 master weights and Adam).
    checkpoint : bool, optional
        Whole-layer activation recompute (the same as ``recompute="full"``; kept for the
        callers that name it). Default: what ``recompute`` says, else True.
    optimizer_states : float
        Optimizer state per parameter, in parameters (Adam: 2).
    ffn : float
        MLP multiplier f: the MLP is f h wide (GPT-2: 4; the model's ``ffn_mult``,
        any real f).
    dropout : float
        Dropout probability of the attention probabilities and the two hidden
        dropouts (0: none, as in summasim's model; Megatron-LM trains with 0.1).
        Priced by the roofline model (its kernels) and in memory (its masks).
    recompute : {"none", "selective", "full"}, optional
        Activation recompute (Korthikanti et al. 2022, section 5): ``full`` recomputes
        each layer from its input in backward, ``selective`` only the attention core
        (``Q K^T``, softmax, dropout, attention over V). Default: ``full`` when
        ``checkpoint`` is True or not given, ``none`` when it is False.
    attention : {"plain", "flash"}
        ``plain`` holds the ``b n s^2`` attention probabilities for backward;
        ``flash`` is blockwise attention with an online softmax (Dao et al. 2022,
        FlashAttention-2 2023): only the ``b n s`` log-sum-exp is held, the softmax,
        mask and dropout run inside the attention kernel, backward recomputes ``Q K^T``.
    sequence_parallel : bool
        Megatron sequence parallelism (Korthikanti et al. 2022, section 4.2.2; Megatron
        1D only): LayerNorm, dropout and residual on ``s / p`` of the sequence, each
        tensor-parallel all-reduce a reduce-scatter and an all-gather.
    kv_heads : int, optional
        Key/value heads (grouped-query attention, Ainslie et al. 2023; None: ``n``).
    mlp : {"gelu", "swiglu"}
        The MLP: GELU's two matrices, or SwiGLU's three (Shazeer 2020).
    tied : bool
        The LM head reads the embedding ``wte`` (GPT-2); False: its own ``[h, v]``.
    norm : {"layernorm", "rmsnorm"}
        The layer norms: LayerNorm (GPT) or RMSNorm (Zhang and Sennrich 2019; Llama).
    rope : bool
        Rotary position embeddings on q and k in every layer (Su et al. 2021; Llama).
    kernels : {"fused", "eager"}
        How the training framework runs the memory-bound work
        (:mod:`summasim.costmodel.compute.roofline`): ``fused`` kernels as Megatron-LM's
        (bias, dropout and residual in one kernel, fused softmax, LayerNorm and RoPE),
        or PyTorch ``eager``, one kernel per operation of the reference eager code
        (Hugging Face's Llama, minGPT), every intermediate written to memory.

    Sizes may be real (the isoefficiency solver varies h continuously) but must be
    finite and positive (v, optimizer_states: non-negative); a ``ValueError`` names
    the field. Whether a grid divides the sizes is :func:`misfit`'s question. Build
    one from the model (:class:`summasim.spec.Model`) with :meth:`from_model`.
    """

    b: float = 8
    s: float = 512
    h: float = 1024
    n: float = 16
    N: int = 24
    v: float = 0
    dtype: str = "float32"
    checkpoint: bool | None = None
    optimizer_states: float = 2.0
    ffn: float = 4
    dropout: float = 0.0
    recompute: str | None = None
    attention: str = "plain"
    sequence_parallel: bool = False
    kv_heads: float | None = None
    mlp: str = "gelu"
    tied: bool = True
    norm: str = "layernorm"
    rope: bool = False
    kernels: str = "fused"

    def __post_init__(self):
        cls = type(self).__name__
        for name in ("b", "s", "h", "n", "N", "v", "ffn", "optimizer_states"):
            val = getattr(self, name)
            ok = (not isinstance(val, bool) and isinstance(val, numbers.Real)
                  and math.isfinite(val))
            if not ok or val < 0 or (val == 0 and name not in ("v", "optimizer_states")):
                want = "non-negative" if name in ("v", "optimizer_states") else "positive"
                raise ValueError(f"{cls}.{name} must be a finite {want} number, got {val!r}")
        itemsize_of(self.dtype)              # a ValueError naming the known dtypes
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 <= d < 1:
            raise ValueError(f"{cls}.dropout must be a number in [0, 1), got {d!r}")
        ck, rc = self.checkpoint, self.recompute
        if ck is not None and not isinstance(ck, bool):
            raise ValueError(f"{cls}.checkpoint must be True or False, got {ck!r}")
        if rc is None:
            rc = "none" if ck is False else "full"
        elif rc not in RECOMPUTE:
            raise ValueError(f"{cls}.recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {rc!r}")
        elif ck is not None and ck != (rc == "full"):
            raise ValueError(f"{cls}: checkpoint={ck} contradicts recompute={rc!r} "
                             f"(checkpoint is recompute='full')")
        object.__setattr__(self, "recompute", rc)
        object.__setattr__(self, "checkpoint", rc == "full")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"{cls}.attention must be one of {', '.join(ATTENTIONS)}, "
                             f"got {self.attention!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"{cls}.mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        for name, allowed in (("norm", NORMS), ("kernels", KERNELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{cls}.{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("sequence_parallel", "tied", "rope"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{cls}.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        kv = self.kv_heads
        if kv is not None:
            if (isinstance(kv, bool) or not isinstance(kv, numbers.Real)
                    or not math.isfinite(kv) or kv <= 0 or kv > self.n):
                raise ValueError(f"{cls}.kv_heads must be a positive number of at most "
                                 f"n = {self.n}, got {kv!r}")
            if _whole(self.n) == self.n and _whole(kv) == kv and int(self.n) % int(kv):
                raise ValueError(f"{cls}.kv_heads = {kv} does not divide n = {self.n}")
            if kv == self.n:                  # plain attention, spelled one way
                object.__setattr__(self, "kv_heads", None)

    @classmethod
    def from_model(cls, config, batch, checkpoint: bool = False,
                   optimizer_states: float = 2.0, dtype=None, *, recompute: str | None = None,
                   attention: str = "plain", sequence_parallel: bool = False,
                   kernels: str = "fused") -> "TransformerConfig":
        """The priced workload of a :class:`summasim.spec.Model` (or the runtime's
        ``Config``).

        The one bridge from the model to the cost model: vocab, seq, hidden, heads,
        layers, the MLP width round(f h) (as ffn = width / h), the MLP kind, the
        key/value heads and the tied head become v, s, h, n, N, ffn, mlp, kv_heads and
        tied; ``batch`` is b (sequences per step). ``checkpoint`` (default False, as the
        model's ``forward``) is ``recompute="full"``; ``recompute``, ``attention`` and
        ``sequence_parallel`` are the training's (:class:`summasim.spec.Training`),
        ``kernels`` the framework's (summasim's model: LayerNorm, no RoPE). A
        classification head (``n_classes > 0``) is not priced: ``ValueError``. A
        :class:`summasim.spec.Model` has no dtype: pass ``dtype``.
        """
        if getattr(config, "n_classes", 0):
            raise ValueError(f"the cost model prices the language-model head only; "
                             f"Config.n_classes = {config.n_classes}")
        if dtype is None:
            dtype = config.dtype
        if recompute is None:
            recompute = "full" if checkpoint else "none"
        elif checkpoint and recompute != "full":
            raise ValueError(f"checkpoint=True is recompute='full'; it contradicts "
                             f"recompute={recompute!r}")
        kv = getattr(config, "kv_heads", None)
        return cls(b=batch, s=config.seq, h=config.hidden, n=config.heads, N=config.layers,
                   v=config.vocab, dtype=str(getattr(dtype, "name", dtype)),
                   optimizer_states=optimizer_states,
                   ffn=config.ffn_width / config.hidden, recompute=recompute,
                   attention=attention, sequence_parallel=bool(sequence_parallel),
                   kv_heads=None if kv in (None, config.heads) else kv,
                   mlp=getattr(config, "mlp", "gelu"), tied=getattr(config, "tied", True),
                   kernels=kernels)

    def replace(self, **kw) -> "TransformerConfig":
        """A copy with fields changed. ``checkpoint=True`` is ``recompute="full"``;
        ``checkpoint=False`` turns a full recompute off (``"none"``) and leaves
        ``selective`` as it is."""
        if "checkpoint" in kw and "recompute" not in kw:
            ck = kw.pop("checkpoint")
            if ck is not None:
                kw["recompute"] = ("full" if ck else
                                   "none" if self.recompute == "full" else self.recompute)
        if "recompute" in kw:
            kw["checkpoint"] = None
        return replace(self, **kw)

    @property
    def ffn_width(self):
        """The MLP width f h (an int when it is whole)."""
        return _whole(self.ffn * self.h)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)

    @property
    def qkv_mult(self):
        """Columns of the fused QKV projection per hidden column: 3, or ``1 + 2 k/n``
        with ``k`` key/value heads (grouped-query attention: K and V are ``k h / n``
        wide; Ainslie et al. 2023, section 2.2)."""
        return 3 if self.kv_heads is None else 1 + 2 * self.kv_heads / self.n

    @property
    def qkv_width(self):
        """Columns of the QKV projection: ``h + 2 kv_width`` (3h without GQA)."""
        return _whole(self.qkv_mult * self.h)

    @property
    def kv(self):
        """Key/value heads (``n`` without grouped-query attention)."""
        return self.n if self.kv_heads is None else self.kv_heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 2 (GELU: fc1, fc2) or 3 (SwiGLU: gate, up, down;
        Shazeer 2020, eq. FFN_SwiGLU)."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def fc1_width(self):
        """Columns of the MLP's first (column-parallel) GEMM: f h, or 2 f h for SwiGLU,
        whose gate and up projections Megatron-LM fuses into one ``linear_fc1``."""
        return self.ffn_width if self.mlp == "gelu" else _whole(2 * self.ffn * self.h)

    def techniques(self) -> dict:
        """What this workload prices beyond plain training: ``recompute``,
        ``attention``, ``sequence_parallel`` and the block (``mlp``, ``kv_heads``,
        ``tied``)."""
        return {"recompute": self.recompute, "attention": self.attention,
                "sequence_parallel": self.sequence_parallel, "mlp": self.mlp,
                "kv_heads": self.kv, "tied": self.tied}


@dataclass(frozen=True)
class Scheme(TensorGrid):
    """A parallel scheme and its grid: ``megatron`` over p, ``optimus`` on ``pr x pc``
    (``q`` rows, ``pc`` columns; ``q x q`` when ``pc`` is 0), ``summa25`` on ``[pr, pc,
    d]``, ``3d`` on the q x q x q cube (d = q). The :class:`summasim.spec.TensorGrid` the
    cost model prices (same fields, ``label``, ``cols`` and checks), with :meth:`make`,
    which also takes the schemes' aliases ("1d", "2d", "2.5d", "summa2.5", "tp3d", ...)."""

    @classmethod
    def make(cls, name: str, p: int | None = None, q: int | None = None,
             d: int = 1, pc: int | None = None) -> "Scheme":
        """Build and check a scheme; ``optimus`` and ``summa25`` take q (and d) or p, and
        ``pc`` columns for a rectangular grid of q rows (``pc = q`` is the square grid;
        with ``pc`` and p alone, q = p / (d pc)); ``3d`` q or p (its depth is q: a ``d``
        other than 1 or q is refused)."""
        key = _ALIASES.get(str(name).lower())
        if key is None:
            raise ValueError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}")
        if pc is not None and key not in RECTANGULAR_SCHEMES:
            if q is not None and pc != q:
                raise ValueError(f"{key} takes no rectangular grid (q={q}, pc={pc}); "
                                 f"{' and '.join(RECTANGULAR_SCHEMES)} do")
            pc = None
        if key == "megatron":
            if p is None or p < 1:
                raise ValueError(f"megatron needs p >= 1, got {p!r}")
            return cls(key, int(p), 1, 1)
        if key == "optimus":
            d = 1
        if SCHEME_KINDS[key] == "3d":               # the cube: its depth is q
            cube = q if q is not None else round(int(p) ** (1 / 3)) if p else None
            if cube is None or d not in (1, cube) or (p is not None and p != cube ** 3):
                raise ValueError(f"{key} runs on a q x q x q cube (p = q^3), got p={p}, "
                                 f"q={q}, d={d}")
            q = d = cube
        if pc is not None:                          # pr = q rows by pc columns
            if pc < 1 or d < 1:
                raise ValueError(f"{key} needs pc >= 1 and d >= 1, got pc={pc}, d={d}")
            if q is None:
                if p is None:
                    raise ValueError(f"{key} needs q (or p)")
                q = int(p) // (d * int(pc))
            if q < 1 or (p is not None and p != d * q * pc):
                raise ValueError(f"{key} needs p = d*pr*pc, got p={p}, pr={q}, pc={pc}, "
                                 f"d={d}")
            return cls(key, d * q * int(pc), int(q), int(d), int(pc))
        if q is None:
            if p is None:
                raise ValueError(f"{key} needs q (or p)")
            q = math.isqrt(int(p) // d)
        if q < 1 or d < 1 or (p is not None and p != d * q * q):
            raise ValueError(f"{key} needs p = d*q*q, got p={p}, q={q}, d={d}")
        return cls(key, d * q * q, int(q), int(d))

    def blocks(self, cfg: "TransformerConfig") -> "GridBlocks":
        """:func:`grid_blocks` of this grid (Optimus, SUMMA2.5-LM) for ``cfg``."""
        return grid_blocks(self, cfg)

    @classmethod
    def of_grid(cls, grid: TensorGrid) -> "Scheme":
        """The scheme of a :class:`summasim.spec.TensorGrid` (its columns ``pc`` kept)."""
        return grid if isinstance(grid, cls) else cls(grid.name, grid.p, grid.q, grid.d,
                                                      grid.pc)


def grid_shapes(p: int, name: str, cfg: "TransformerConfig | None" = None) -> list[Scheme]:
    """Every grid of ``p`` ranks for scheme ``name``: THE enumeration,
    :func:`summasim.spec.grids` (q ascending; Optimus the square grid, else the most
    square ``pr x pc`` both ways round; SUMMA2.5 on every [q, q, d] with q, d >= 2, d > q
    included, else the smallest depth over its most square rectangle both ways); with
    ``cfg``, only those that divide it (:func:`misfit` is None)."""
    key = _ALIASES.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}")
    out = [Scheme.of_grid(g) for g in grids(p, key)]
    if cfg is not None:
        out = [sch for sch in out if misfit(sch, cfg) is None]
    return out


def vocab_block(v, p):
    """Vocabulary ids per block of the tensor-parallel layers: the padded block
    (:func:`summasim.spec.vocab_block`, ``ceil(v / p)``) for a whole v, what the schemes
    run; ``v / p`` for a real v (scaling studies)."""
    whole = _whole(v)
    if isinstance(whole, numbers.Integral) and isinstance(p, numbers.Integral):
        return spec_vocab_block(whole, p)
    return v / p


def grid_vocab(v, scheme: TensorGrid):
    """The vocabulary ``V'`` an Optimus or SUMMA2.5-LM grid holds: ``v`` padded to a
    multiple of ``lcm(pr, pc)`` (q on a square grid), so that ``wte``'s rows cut into pr
    even blocks and the logits' columns into pc (the runtime's ``optimus.padded_vocab``;
    Megatron-LM pads the same way, ``--make-vocab-size-divisible-by``). A real v (scaling
    studies) is ``v`` itself, up to the rounding of ``v / lcm * lcm``."""
    step = math.lcm(int(scheme.q), int(scheme.cols))
    return vocab_block(v, step) * step


class GridBlocks(NamedTuple):
    """The extents of the busiest rank's blocks, rank (0, 0, 0), of an Optimus or
    SUMMA2.5-LM grid ``[pr, pc, d]`` (:func:`grid_blocks`): its column's hidden width
    ``h``, query heads ``heads``, QKV width ``qkv`` and MLP width ``ffn``, and the
    weights' rows of h and of the MLP width on its row, ``h_rows`` and ``ffn_rows``.
    ``cuts`` is ``(("h", offsets), ("W", offsets))``, the runtime's cuts of the hidden
    size and the QKV width over the pc columns where they are not even (at the key/value
    head groups), else ``()``."""

    h: object
    heads: object
    qkv: object
    ffn: object
    h_rows: object
    ffn_rows: object
    cuts: tuple = ()


def grid_blocks(scheme: TensorGrid, cfg: "TransformerConfig") -> GridBlocks:
    """:class:`GridBlocks` of ``cfg`` on an Optimus or SUMMA2.5-LM grid ``[pr, pc, d]``.

    The runtime (``summasim.transformer.optimus.column_cut``) gives column j the
    key/value heads of block j of their balanced partition over pc and their query heads
    (whole heads: its attention is local), so the hidden size and the QKV width are cut
    at those groups, ``g hd kv_j`` and ``(g + 2) hd kv_j`` columns (``g = n/kv`` query
    heads per group of head size ``hd = h/n``), and column 0, with ``ceil(kv/pc)`` groups,
    is the widest; the MLP width is the balanced partition over pc, the weights' rows
    (h and the MLP width over pr) too (:func:`grid_block`). Where pc divides the
    key/value heads, or the sizes are real, the extents are the plain quotients ``h/pc``,
    ``n/pc``, ``r h/pc``."""
    pr, pc = scheme.q, scheme.cols
    h, n, kv = (_whole(x) for x in (cfg.h, cfg.n, cfg.kv))
    whole = all(isinstance(x, numbers.Integral) for x in (h, n, kv))
    if whole and kv % pc and h % n == 0 and n % kv == 0:
        hd, g = h // n, n // kv
        offsets = partition(kv, pc)
        cuts = (("h", tuple(g * hd * o for o in offsets)),
                ("W", tuple((g + 2) * hd * o for o in offsets)))
        top = -(-kv // pc)                     # column 0's key/value head groups
        cols = (g * hd * top, g * top, (g + 2) * hd * top)
    else:
        cols, cuts = (_split(cfg.h, pc), _split(cfg.n, pc), _split(cfg.qkv_width, pc)), ()
    f = cfg.ffn_width
    return GridBlocks(*cols, grid_block(f, pc), grid_block(cfg.h, pr), grid_block(f, pr),
                      cuts)


def grid_block(size, parts):
    """The busiest rank's block of ``size`` cut into ``parts`` by the balanced partition
    (:func:`summasim.spec.partition`: the first ``size mod parts`` blocks one larger):
    ``ceil(size / parts)`` for a whole size that ``parts`` does not divide, else
    ``size / parts`` (a real size: the scaling studies' plain quotient)."""
    whole = _whole(size)
    if isinstance(whole, numbers.Integral) and isinstance(parts, numbers.Integral) \
            and whole % parts:
        return -(-whole // parts)
    return size / parts


def megatron_shares(cfg: TransformerConfig, p: int) -> tuple:
    """``(heads, mlp)``: the fractions of the heads and of the MLP columns Megatron's
    busiest rank holds: ``1/p`` when p divides them, else the balanced partition's
    largest block (``ceil(kv/p)`` of the ``kv`` key/value head groups, ``ceil(f h/p)``
    of the ``f h`` columns; ``megatron.head_range``); ``1/p`` for real sizes and for
    fewer than p (a model that does not fit, priced as the papers' average)."""
    groups = cfg.kv_heads if cfg.kv_heads is not None else cfg.n
    out = []
    for total in (groups, cfg.ffn_width):
        whole = _whole(total)
        out.append(-(-whole // p) / whole if isinstance(whole, int) and isinstance(p, int)
                   and whole % p and whole >= p else 1 / p)
    return tuple(out)


def _divides(div: int, size) -> bool:
    """``div`` divides ``size`` (a real size that is not whole is divisible by nothing)."""
    size = _whole(size)
    return isinstance(size, numbers.Integral) and size % div == 0


def misfit(scheme: Scheme, cfg: "TransformerConfig", *, batch: bool = True) -> str | None:
    """Why ``scheme``'s grid cannot run ``cfg``, or None when it divides the model.

    The rule is spec's (:meth:`summasim.spec.TensorGrid.divisors`, the one the runtime
    checks too), on the workload's sizes, which may be real (a real size that is not
    whole divides by nothing); the vocabulary only when v > 0, the batch unless
    ``batch=False``; the key/value heads under grouped-query attention; and
    :meth:`~summasim.spec.TensorGrid.least` (Megatron: a head group and an MLP column
    per rank, the balanced partition of each; Optimus and SUMMA2.5-LM: a key/value head
    group per column). The reason
    names every size that fails and its divisor in the papers' symbols
    (``"; "``-separated). Sequence parallelism (:func:`sequence_parallel_misfit`) adds
    its own rule.
    """
    dims = scheme.divisors(cfg.h, cfg.n, cfg.ffn_width, cfg.v or None,
                           cfg.b if batch else None, cfg.kv_heads)
    bad = [f"{_NAMES[what]} = {_fmt_num(size)} is not divisible by {sym} = {div}"
           for what, size, div, sym in dims if not _divides(div, size)]
    per = "rank" if scheme.kind in ("1d", "ring") else "column"
    bad += [f"{_NAMES[what]} = {_fmt_num(size)} is smaller than {sym} = {least} (one per {per})"
            for what, size, least, sym in scheme.least(cfg.n, cfg.ffn_width, cfg.kv_heads)
            if size < least]
    if cfg.sequence_parallel:
        why = sequence_parallel_misfit(scheme, cfg)
        if why:
            bad.append(why)
    return "; ".join(bad) or None


def runs(scheme: Scheme, cfg: "TransformerConfig") -> bool:
    """Whether ``scheme``'s grid runs ``cfg`` as the runtime would (:func:`misfit` is
    None, the batch included). The cost model then prices the busiest rank: whole sizes
    that a rectangular grid or the balanced partition leaves uneven take their largest
    blocks; a model the grid cannot run (a batch it cannot cut into whole sequences per
    rank, the scaling studies' sizes) takes the plain quotients."""
    return misfit(scheme, cfg) is None


def sequence_parallel_misfit(scheme: Scheme, cfg: "TransformerConfig") -> str | None:
    """Why ``scheme`` cannot run Megatron's sequence parallelism on ``cfg``, or None.

    Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits the parts of a
    Megatron layer that 1D tensor parallelism leaves replicated (LayerNorm, dropout,
    residual) along the sequence: the sequence must divide by p. Optimus,
    SUMMA2.5-LM and the 3D layer have no such part: every activation, LayerNorm input
    included, is already a ``[b s / (d pr), h / pc]`` block (Optimus section 3.1.1; the
    cube's ``[b s / q^2, h / q]``), so there is nothing left to split and the flag names
    no technique there: refused.
    """
    if scheme.name != "megatron":
        return (f"sequence parallelism is Megatron's (1D) only: {scheme.label} already "
                f"splits every activation, LayerNorm and residual included, over its "
                f"{scheme.p} ranks")
    if not _divides(scheme.p, cfg.s):
        return f"sequence s = {_fmt_num(cfg.s)} is not divisible by p = {scheme.p}"
    return None


#: How the cost model names spec's sizes: in the papers' symbols.
_NAMES = {"heads": "heads n", "hidden": "hidden h", "ffn width": "MLP width f h",
          "vocab": "vocabulary v", "batch": "batch b", "kv heads": "key/value heads"}


def _fmt_num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)

def _whole(x):
    """``x`` as an int when it is a whole non-integer type (so Fractions stay exact)."""
    if isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral) and x == int(x):
        return int(x)
    return x


def _split(x, by):
    """x / by, exact for integers that divide, else real."""
    if isinstance(x, int) and isinstance(by, int) and x % by == 0:
        return x // by
    return x / by
