"""The priced workload (:class:`TransformerConfig`) and the grid it runs on (:class:`Scheme`).

Symbols: b batch, s sequence length, h hidden size, n attention heads, v vocabulary,
N layers, f the MLP multiplier; Megatron runs over p ranks, Optimus on a q x q grid,
SUMMA2.5-LM on [q, q, d] (p = d q^2), the 3D layer on the q x q x q cube (p = q^3,
d = q). :func:`grid_shapes` is THE enumeration of the grids (:func:`summasim.spec.grids`),
:func:`misfit` says why a grid cannot shard a model.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ...spec import ATTENTIONS, MLPS, RECOMPUTE, SCHEME_KINDS, SCHEME_NAMES, TensorGrid, grids
from ...spec import vocab_block as spec_vocab_block
from ..machine import itemsize_of

SCHEMES = SCHEME_NAMES       # the one registry: summasim.transformer.schemes
_ALIASES = {"megatron": "megatron", "1d": "megatron", "optimus": "optimus", "2d": "optimus",
            "summa25": "summa25", "2.5d": "summa25", "summa2.5": "summa25",
            "summa25-lm": "summa25", "3d": "3d", "tp3d": "3d"}


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
        for name in ("sequence_parallel", "tied"):
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
                   attention: str = "plain", sequence_parallel: bool = False
                   ) -> "TransformerConfig":
        """The priced workload of a :class:`summasim.spec.Model` (or the runtime's
        ``Config``).

        The one bridge from the model to the cost model: vocab, seq, hidden, heads,
        layers, the MLP width round(f h) (as ffn = width / h), the MLP kind, the
        key/value heads and the tied head become v, s, h, n, N, ffn, mlp, kv_heads and
        tied; ``batch`` is b (sequences per step). ``checkpoint`` (default False, as the
        model's ``forward``) is ``recompute="full"``; ``recompute``, ``attention`` and
        ``sequence_parallel`` are the training's (:class:`summasim.spec.Training`). A
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
                   mlp=getattr(config, "mlp", "gelu"), tied=getattr(config, "tied", True))

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
    """A parallel scheme and its grid: ``megatron`` over p, ``optimus`` on q x q,
    ``summa25`` on [q, q, d], ``3d`` on the q x q x q cube (d = q). The
    :class:`summasim.spec.TensorGrid` the cost model prices (same fields, ``label`` and
    checks), with :meth:`make`, which also takes the schemes' aliases ("1d", "2d",
    "2.5d", "summa2.5", "tp3d", ...)."""

    @classmethod
    def make(cls, name: str, p: int | None = None, q: int | None = None,
             d: int = 1) -> "Scheme":
        """Build and check a scheme; ``optimus`` and ``summa25`` take q (and d) or p,
        ``3d`` q or p (its depth is q: a ``d`` other than 1 or q is refused)."""
        key = _ALIASES.get(str(name).lower())
        if key is None:
            raise ValueError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}")
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
        if q is None:
            if p is None:
                raise ValueError(f"{key} needs q (or p)")
            q = math.isqrt(int(p) // d)
        if q < 1 or d < 1 or (p is not None and p != d * q * q):
            raise ValueError(f"{key} needs p = d*q*q, got p={p}, q={q}, d={d}")
        return cls(key, d * q * q, int(q), int(d))

    @classmethod
    def of_grid(cls, grid: TensorGrid) -> "Scheme":
        """The scheme of a :class:`summasim.spec.TensorGrid`."""
        return grid if isinstance(grid, cls) else cls(grid.name, grid.p, grid.q, grid.d)


def grid_shapes(p: int, name: str, cfg: "TransformerConfig | None" = None) -> list[Scheme]:
    """Every grid of ``p`` ranks for scheme ``name``: THE enumeration,
    :func:`summasim.spec.grids` (q ascending; SUMMA2.5 on every [q, q, d] with q, d >= 2,
    d > q included); with ``cfg``, only those that divide it (:func:`misfit` is None)."""
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
    per rank, the balanced partition of each). The reason
    names every size that fails and its divisor in the papers' symbols
    (``"; "``-separated). Sequence parallelism (:func:`sequence_parallel_misfit`) adds
    its own rule.
    """
    dims = scheme.divisors(cfg.h, cfg.n, cfg.ffn_width, cfg.v or None,
                           cfg.b if batch else None, cfg.kv_heads)
    bad = [f"{_NAMES[what]} = {_fmt_num(size)} is not divisible by {sym} = {div}"
           for what, size, div, sym in dims if not _divides(div, size)]
    bad += [f"{_NAMES[what]} = {_fmt_num(size)} is smaller than {sym} = {least} (one per rank)"
            for what, size, least, sym in scheme.least(cfg.n, cfg.ffn_width, cfg.kv_heads)
            if size < least]
    if cfg.sequence_parallel:
        why = sequence_parallel_misfit(scheme, cfg)
        if why:
            bad.append(why)
    return "; ".join(bad) or None


def sequence_parallel_misfit(scheme: Scheme, cfg: "TransformerConfig") -> str | None:
    """Why ``scheme`` cannot run Megatron's sequence parallelism on ``cfg``, or None.

    Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) splits the parts of a
    Megatron layer that 1D tensor parallelism leaves replicated (LayerNorm, dropout,
    residual) along the sequence: the sequence must divide by p. Optimus,
    SUMMA2.5-LM and the 3D layer have no such part: every activation, LayerNorm input
    included, is already a ``[b s / (d q), h / q]`` block (Optimus section 3.1.1; the
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
