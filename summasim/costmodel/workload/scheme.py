"""The priced workload (:class:`TransformerConfig`) and the grid it runs on (:class:`Scheme`).

Symbols: b batch, s sequence length, h hidden size, n attention heads, v vocabulary,
N layers, f the MLP multiplier; Megatron runs over p ranks, Optimus on a q x q grid,
SUMMA2.5-LM on [q, q, d] (p = d q^2). :func:`grid_shapes` is THE enumeration of the grids
(:func:`summasim.spec.grids`), :func:`misfit` says why a grid cannot shard a model.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ...spec import SCHEME_NAMES, TensorGrid, grids
from ..machine import itemsize_of

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
                   optimizer_states: float = 2.0, dtype=None) -> "TransformerConfig":
        """The priced workload of a :class:`summasim.transformer.model.Config`.

        The one bridge from the model's configuration to the cost model: vocab,
        seq, hidden, heads, layers, the MLP width round(f h) (as ffn = width / h) and
        dtype become v, s, h, n, N, ffn and dtype; ``batch`` is b (sequences per step). ``checkpoint`` defaults to
        False, as the model's ``forward`` does. A classification head
        (``n_classes > 0``) is not priced: ``ValueError``. ``config`` may be a
        :class:`summasim.spec.Model`, which has no dtype: pass ``dtype``.
        """
        if getattr(config, "n_classes", 0):
            raise ValueError(f"the cost model prices the language-model head only; "
                             f"Config.n_classes = {config.n_classes}")
        if dtype is None:
            dtype = config.dtype
        return cls(b=batch, s=config.seq, h=config.hidden, n=config.heads, N=config.layers,
                   v=config.vocab, dtype=str(getattr(dtype, "name", dtype)),
                   checkpoint=bool(checkpoint), optimizer_states=optimizer_states,
                   ffn=config.ffn_width / config.hidden)

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
class Scheme(TensorGrid):
    """A parallel scheme and its grid: ``megatron`` over p, ``optimus`` on q x q,
    ``summa25`` on [q, q, d]. The :class:`summasim.spec.TensorGrid` the cost model prices
    (same fields, ``label`` and checks), with :meth:`make`, which also takes the
    schemes' aliases ("1d", "2d", "2.5d", "summa2.5", ...)."""

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


def _divides(div: int, size) -> bool:
    """``div`` divides ``size`` (a real size that is not whole is divisible by nothing)."""
    size = _whole(size)
    return isinstance(size, numbers.Integral) and size % div == 0


def misfit(scheme: Scheme, cfg: "TransformerConfig", *, batch: bool = True) -> str | None:
    """Why ``scheme``'s grid cannot run ``cfg``, or None when it divides the model.

    The rule is spec's (:meth:`summasim.spec.TensorGrid.divisors`, the one the runtime
    checks too), on the workload's sizes, which may be real (a real size that is not
    whole divides by nothing); the vocabulary only when v > 0, the batch unless
    ``batch=False``. The reason names every size that fails and its divisor in the
    papers' symbols (``"; "``-separated).
    """
    dims = scheme.divisors(cfg.h, cfg.n, cfg.ffn_width, cfg.v or None,
                           cfg.b if batch else None)
    bad = [f"{_NAMES[what]} = {_fmt_num(size)} is not divisible by {sym} = {div}"
           for what, size, div, sym in dims if not _divides(div, size)]
    return "; ".join(bad) or None


#: How the cost model names spec's sizes: in the papers' symbols.
_NAMES = {"heads": "heads n", "hidden": "hidden h", "ffn width": "MLP width f h",
          "vocab": "vocabulary v", "batch": "batch b"}


def _fmt_num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)

def _whole(x):
    """``x`` as an int when it is a whole non-integer type (so Fractions stay exact)."""
    if isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral) and x == int(x):
        return int(x)
    return x
