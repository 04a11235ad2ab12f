"""The shared nouns of summasim (pure: no MPI, no NumPy).

Every floor and every command speaks these, so one thing has one name and one rule:

``Model``        a transformer's size (hidden, heads, layers, seq, vocab, ffn) and block
                 (mlp gelu|swiglu, kv_heads, tied), with named presets (:data:`MODELS`,
                 e.g. ``gpt3-175b``) and a parser for
                 ``--model NAME|h=...,heads=...,layers=...,seq=...,vocab=...,ffn=...``.
``TensorGrid``   a tensor-parallel scheme on its grid: ``megatron:4`` (1D over 4 ranks),
                 ``optimus:2x2`` (q x q), ``summa25:2x2x4`` ([q, q, d]);
                 ``TensorGrid.parse(str(g)) == g``.
``Mesh``         a training mesh ``dp=2,pp=2,tp=optimus:2x2`` of data, pipeline and
                 tensor parallelism; ``Mesh.parse(str(m)) == m``.
:func:`grids`    THE enumeration of the grids of p ranks that an algorithm or a scheme
                 runs on (and, given a model, that fit it). The main job runs exactly
                 these, and the cost model, ``predict``, ``plan`` and ``explore`` price
                 exactly these.
``Training``     how a mesh trains: ZeRO, the schedule (interleaved:V), the stages
                 (:func:`stage_layers`, THE split), recompute, attention, sequence
                 parallelism, mixed precision; what ``--zero``, ``--schedule``, ...,
                 ``--grad-reduce`` say (``summasim.options.add_training``).
rank order       :func:`grid_rank`, :func:`grid_coords`, :func:`grid_groups` and
                 :func:`mesh_coords`, :func:`mesh_groups`: where each rank sits on a
                 ``[q, q, d]`` grid and on a ``[dp, pp, tensor]`` mesh, and which ranks
                 form each communicator. ``summasim.grid`` builds its communicators on
                 this order (and checks it); the cost model's topology places it.

SUMMA2.5 admits any depth: a ``[q, q, d]`` grid with ``q >= 2`` and ``d >= 2``, d > q
included (Solomonik and Demmel's 2.5D bound asks d <= p^(1/3) for communication
optimality, not for correctness; the grids past it are run, priced and compared like
the others). ``d == 1`` is Optimus.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------
# The registries of names: the algorithms and the tensor-parallel schemes, with the kind
# of grid each runs on. algorithms.table and transformer.schemes attach the code.

#: Each algorithm and the kind of grid it runs on: "2d" (q x q), "2.5d" ([q, q, d]),
#: "2.5d-deep" ([q, q, d] with q, d >= 2 only), "3d" (a q x q x q cube) or "ring" (all p
#: ranks in one group).
ALGORITHM_KINDS: dict[str, str] = {
    "cannon_ab": "2d",
    "summa_ab": "2d",
    "summa_abt": "2d",
    "summa_atb": "2d",
    "summa25_ab": "2.5d",
    "summa25_abt": "2.5d",
    "summa25_atb": "2.5d",
    "sd25_ab": "2.5d-deep",
    "mm3d_ab": "3d",
    "mm3d_abt": "3d",
    "mm3d_atb": "3d",
    "ring_allreduce": "ring",
}
#: The matrix products (every algorithm but the ring).
PRODUCTS: tuple[str, ...] = tuple(n for n, k in ALGORITHM_KINDS.items() if k != "ring")
#: The products that run on any sizes (blocks of the balanced partition; the 3D
#: products' cube layouts nest it: row piece j of block i; every product takes them).
ANY_SIZE: tuple[str, ...] = ("cannon_ab", "summa_ab", "summa_abt", "summa_atb",
                             "summa25_ab", "summa25_abt", "summa25_atb", "sd25_ab",
                             "mm3d_ab", "mm3d_abt", "mm3d_atb")
#: The products that also run on rectangular ``pr x pc`` (and ``[pr, pc, d]``) grids.
#: Cannon needs a square torus; the 2.5D and 3D products of Solomonik-Demmel and
#: Agarwal a square layer or a cube.
RECTANGULAR: tuple[str, ...] = ("summa_ab", "summa_abt", "summa_atb", "summa25_ab",
                                "summa25_abt", "summa25_atb")

#: Each tensor-parallel scheme and its grid kind: "1d" (Megatron over p), "2d"
#: (Optimus, q x q), "2.5d" (SUMMA2.5-LM, [q, q, d] with d >= 2) or "3d" (the 3D layer
#: of Bian et al. on a q x q x q cube, :mod:`summasim.transformer.tp3d`).
SCHEME_KINDS: dict[str, str] = {"megatron": "1d", "optimus": "2d", "summa25": "2.5d",
                                "3d": "3d"}
SCHEME_NAMES: tuple[str, ...] = tuple(SCHEME_KINDS)
#: The schemes that also train on rectangular ``pr x pc`` (``[pr, pc, d]``) grids: their
#: products are SUMMA's, which take any grid. Megatron is 1D; the 3D layer needs a cube.
RECTANGULAR_SCHEMES: tuple[str, ...] = ("optimus", "summa25")

GRID_KINDS = ("2d", "2.5d", "2.5d-deep", "3d", "any")


def positive_int(name: str, value) -> int:
    """``value`` as an int, or ``ValueError`` naming ``name`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def grid_shapes(p: int, kind: str = "any") -> list[tuple[int, int]]:
    """The ``(q, d)`` grids with ``d * q * q == p`` of one kind, q ascending.

    ``"any"``   every ``(q, d)`` (q = 1 included: a [1, 1, p] grid);
    ``"2d"``    ``[(q, 1)]`` when p is a perfect square, else ``[]``;
    ``"2.5d"``  every grid with ``d >= 2`` and ``q >= 2``; when none exists, the
                degenerate ``[(1, p)]`` (a depth-only grid; ``[(1, 1)]`` at p = 1), on
                which the 2.5D products still run.
    ``"2.5d-deep"``  every grid with ``d >= 2`` and ``q >= 2``, and no fallback (the
                Solomonik-Demmel product: with d = 1 it is SUMMA, with q = 1 one layer
                does all the work).
    ``"3d"``    ``[(q, q)]`` when p = q^3 is a perfect cube (the q x q x q cube), else
                ``[]``.
    """
    p = positive_int("p", p)
    if kind not in GRID_KINDS:
        raise ValueError(f"grid kind must be one of {', '.join(GRID_KINDS)}, got {kind!r}")
    every = [(q, p // (q * q)) for q in range(1, math.isqrt(p) + 1) if p % (q * q) == 0]
    if kind == "any":
        return every
    if kind == "2d":
        return [(q, d) for q, d in every if d == 1]
    if kind == "3d":
        return [(q, d) for q, d in every if d == q]
    deep = [(q, d) for q, d in every if d >= 2 and q >= 2]
    if kind == "2.5d-deep":
        return deep
    return deep or [(1, p)]


# ---------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class Model:
    """A GPT-style transformer's size and block variant (items).

    Parameters
    ----------
    vocab, seq, hidden, heads, layers : int
        Vocabulary (as padded for training), longest sequence, hidden size h,
        attention heads n (dividing h) and layers.
    ffn_mult : int or float, default 4
        MLP multiplier f; the MLP width is ``round(f h)`` (:attr:`ffn_width`). It may be
        fractional (SwiGLU models use 8/3 or 3.25).
    mlp : {"gelu", "swiglu"}, keyword-only, default "gelu"
        GELU MLP ``[h, f h] -> [f h, h]`` (GPT-2), or SwiGLU (Shazeer 2020): a gate and
        an up projection ``[h, f h]`` each, ``silu(x W_gate) * (x W_up)``, then
        ``[f h, h]``: three matrices.
    kv_heads : int, keyword-only, default ``heads``
        Key/value heads: fewer than ``heads`` is grouped-query attention (Ainslie et al.
        2023; ``heads / kv_heads`` query heads share one key/value head). Must divide
        ``heads``.
    tied : bool, keyword-only, default True
        The LM head reads the embedding ``wte`` (GPT-2); False: its own ``head.w``.
    name, batch, source : keyword-only
        A preset's name, its published global batch (sequences; what ``--batch``
        defaults to for it) and where its numbers come from. They do not take part in
        equality: a preset and the same sizes written out are the same model.
    """

    vocab: int
    seq: int
    hidden: int
    heads: int
    layers: int
    ffn_mult: float = 4
    mlp: str = field(default="gelu", kw_only=True)
    kv_heads: int | None = field(default=None, kw_only=True)
    tied: bool = field(default=True, kw_only=True)
    name: str = field(default="", kw_only=True, compare=False)
    batch: int | None = field(default=None, kw_only=True, compare=False)
    source: str = field(default="", kw_only=True, compare=False, repr=False)

    def __post_init__(self):
        cls = type(self).__name__
        for key in ("vocab", "seq", "hidden", "heads", "layers"):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
                raise ValueError(f"{cls}.{key} must be a positive integer, got {val!r}")
        f = self.ffn_mult
        if (isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f)
                or f <= 0):
            raise ValueError(f"{cls}.ffn_mult must be a positive number, got {f!r}")
        if float(f).is_integer():
            object.__setattr__(self, "ffn_mult", int(f))
        if round(self.ffn_mult * self.hidden) < 1:
            raise ValueError(f"{cls}: the MLP width round(ffn_mult * hidden) = "
                             f"round({f} * {self.hidden}) is below 1")
        if self.hidden % self.heads:
            raise ValueError(f"{cls}.hidden={self.hidden} is not divisible by "
                             f"{cls}.heads={self.heads}")
        if self.mlp not in MLPS:
            raise ValueError(f"{cls}.mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, numbers.Integral) or kv < 1:
            raise ValueError(f"{cls}.kv_heads must be a positive integer, got {kv!r}")
        if self.heads % kv:
            raise ValueError(f"{cls}.kv_heads={kv} does not divide {cls}.heads={self.heads}")
        object.__setattr__(self, "kv_heads", int(kv))
        if not isinstance(self.tied, bool):
            raise ValueError(f"{cls}.tied must be True or False, got {self.tied!r}")
        if self.batch is not None:
            positive_int(f"{cls}.batch", self.batch)

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        """The MLP width ``round(f h)``."""
        return int(round(self.ffn_mult * self.hidden))

    @property
    def kv_width(self) -> int:
        """Columns of K (and of V): ``kv_heads * head_size`` (= h without GQA)."""
        return self.kv_heads * self.head_size

    @property
    def qkv_width(self) -> int:
        """Columns of the fused QKV projection: ``h + 2 kv_width`` (3h without GQA)."""
        return self.hidden + 2 * self.kv_width

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 2 (GELU) or 3 (SwiGLU)."""
        return 3 if self.mlp == "swiglu" else 2

    def replace(self, **changes) -> "Model":
        """A copy with some sizes changed (a preset's name and source are dropped)."""
        keep = {"name": "", "source": ""} if set(changes) - {"batch"} else {}
        if "heads" in changes and "kv_heads" not in changes and self.kv_heads == self.heads:
            changes["kv_heads"] = None          # plain attention stays plain
        return dataclasses.replace(self, **{**keep, **changes})

    def sizes(self) -> dict:
        """The ``--model`` keys and values: ``h``, ``heads``, ``layers``, ``seq``,
        ``vocab``, ``ffn``, then ``mlp``, ``kv_heads`` and ``tied`` where they differ
        from GPT-2's (gelu, kv_heads = heads, tied)."""
        out = {"h": self.hidden, "heads": self.heads, "layers": self.layers,
               "seq": self.seq, "vocab": self.vocab, "ffn": self.ffn_mult}
        if self.mlp != "gelu":
            out["mlp"] = self.mlp
        if self.kv_heads != self.heads:
            out["kv_heads"] = self.kv_heads
        if not self.tied:
            out["tied"] = "false"
        return out

    def variant(self) -> dict:
        """The keys of :meth:`sizes` that differ from GPT-2's block: ``ffn`` when not 4,
        and ``mlp``, ``kv_heads`` and ``tied`` where given."""
        return {k: v for k, v in self.sizes().items()
                if k in ("mlp", "kv_heads", "tied") or (k == "ffn" and v != 4)}

    def __str__(self) -> str:
        if self.name and MODELS.get(self.name) == self:
            return self.name
        return ",".join(f"{k}={v}" for k, v in self.sizes().items())

    @classmethod
    def parse(cls, text: str) -> "Model":
        """``"gpt3-175b"`` (a preset) or ``"h=64,heads=16,layers=2,seq=16,vocab=64,ffn=4"``.

        Keys: ``h`` (or ``hidden``), ``heads``, ``layers``, ``seq``, ``vocab``, ``ffn``
        (the MLP multiplier, default 4; a decimal such as 3.25 or a fraction such as
        8/3), ``mlp`` (gelu or swiglu), ``kv_heads`` (grouped-query attention) and
        ``tied`` (true or false); ``h``, ``heads``, ``layers``, ``seq`` and ``vocab`` are
        required. A preset may be followed by overrides: ``"gpt3-175b,layers=8"``.
        ``ValueError`` naming the problem otherwise.
        """
        text = str(text).strip()
        head, _, rest = text.partition(",")
        base = None
        if "=" not in head:
            base = MODELS.get(head.lower())
            if base is None:
                raise ValueError(f"unknown model {head!r}: a preset ({', '.join(MODELS)}) "
                                 f"or {MODEL_FORM}")
            text = rest
        fields = {}
        for part in filter(None, (s.strip() for s in text.split(","))):
            key, eq, val = part.partition("=")
            key = _MODEL_KEYS.get(key.strip().lower())
            if not eq or key is None:
                raise ValueError(f"model {part!r}: expected {MODEL_FORM}")
            if key in fields:
                raise ValueError(f"model: {part.split('=')[0].strip()} given twice")
            fields[key] = _model_value(key, val.strip())
        kw = {_MODEL_FIELDS[k]: v for k, v in fields.items()}
        if base is not None:
            return base.replace(**kw) if fields else base
        missing = [k for k in ("h", "heads", "layers", "seq", "vocab") if k not in fields]
        if missing:
            raise ValueError(f"model: missing {', '.join(missing)} (expected {MODEL_FORM})")
        return cls(**kw)


#: The MLP variants: GPT-2's GELU MLP and SwiGLU.
MLPS = ("gelu", "swiglu")


def _model_value(key: str, val: str):
    """One ``--model`` value, checked."""
    if key == "mlp":
        if val.lower() not in MLPS:
            raise ValueError(f"model: mlp must be one of {', '.join(MLPS)}, got {val!r}")
        return val.lower()
    if key == "tied":
        if val.lower() not in ("true", "false"):
            raise ValueError(f"model: tied must be true or false, got {val!r}")
        return val.lower() == "true"
    if key == "ffn":
        num, slash, den = val.partition("/")
        try:
            f = float(num) / (float(den) if slash else 1.0)
        except (ValueError, ZeroDivisionError):
            f = float("nan")
        if not math.isfinite(f) or f <= 0 or not re.fullmatch(r"[0-9.]+(/[0-9.]+)?", val):
            raise ValueError(f"model: ffn must be a positive number (4, 3.25 or 8/3), "
                             f"got {val!r}")
        return int(f) if f.is_integer() else f
    if not val.isdigit() or int(val) < 1:
        raise ValueError(f"model: {key} must be a positive integer, got {val!r}")
    return int(val)


MODEL_FORM = ("h=H,heads=N,layers=L,seq=S,vocab=V[,ffn=F][,mlp=gelu|swiglu][,kv_heads=K]"
              "[,tied=true|false]")
_MODEL_KEYS = {"h": "h", "hidden": "h", "heads": "heads", "layers": "layers", "seq": "seq",
               "vocab": "vocab", "ffn": "ffn", "mlp": "mlp", "kv_heads": "kv_heads",
               "kv": "kv_heads", "tied": "tied"}
_MODEL_FIELDS = {"h": "hidden", "heads": "heads", "layers": "layers", "seq": "seq",
                 "vocab": "vocab", "ffn": "ffn_mult", "mlp": "mlp", "kv_heads": "kv_heads",
                 "tied": "tied"}


def _preset(name, hidden, layers, heads, seq, vocab, batch, source, ffn=4) -> Model:
    return Model(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers,
                 ffn_mult=ffn, name=name, batch=batch, source=source)


#: Named models. Each carries where its numbers come from.
MODELS: dict[str, Model] = {m.name: m for m in (
    _preset("tiny", 64, 2, 16, 16, 64, 8,
            "summasim's own test model: the main job's default, small enough for 16 "
            "oversubscribed ranks and divisible by every scheme's grid at p = 16"),
    _preset("gpt3-175b", 12288, 96, 96, 2048, 51200, 1536,
            "GPT-3 175B: Brown et al. 2020, 'Language Models are Few-Shot Learners', Table "
            "2.1 (n_layers 96, d_model 12288, n_heads 96, context 2048, batch 3.2M tokens); "
            "vocab 50257 padded to 51200 and batch 1536 sequences as in Megatron-LM "
            "(Narayanan et al. 2021, which trains all its GPT models with a 51,200 "
            "vocabulary)"),
    _preset("gpt3-6.7b", 4096, 32, 32, 2048, 51200, 1024,
            "GPT-3 6.7B: Brown et al. 2020, Table 2.1 (32 layers, d_model 4096, 32 heads, "
            "context 2048, batch 2M tokens = 1024 sequences); vocab 50257 padded to 51200"),
    _preset("gpt3-2.7b", 2560, 32, 32, 2048, 51200, 512,
            "GPT-3 2.7B: Brown et al. 2020, Table 2.1 (32 layers, d_model 2560, 32 heads, "
            "context 2048, batch 1M tokens = 512 sequences); vocab 50257 padded to 51200"),
    _preset("megatron-8.3b", 3072, 72, 32, 1024, 51200, 512,
            "Megatron-LM 8.3B: Shoeybi et al. 2019, Table 2 (hidden 3072, 32 heads, 72 "
            "layers), sequence 1024, batch 512, vocab 51200 (GPT-2's 50257 padded)"),
    _preset("mt-nlg-530b", 20480, 105, 128, 2048, 51200, 1920,
            "MT-NLG 530B: Smith et al. 2022, section 3 (105 layers, hidden 20480, 128 "
            "heads, sequence 2048, batch 1920); vocab 51200 as Megatron pads GPT-2's 50257"),
)}


# ---------------------------------------------------------------------------------------
# Tensor grids

_LONG_LABEL = {"megatron": "Megatron", "optimus": "Optimus", "summa25": "SUMMA2.5",
               "3d": "3D"}
TP_FORMS = "megatron:T, optimus:PRxPC, summa25:PRxPCxD or 3d:QxQxQ"
_TP = {"megatron": r"(\d+)", "optimus": r"(\d+)x(\d+)", "summa25": r"(\d+)x(\d+)x(\d+)",
       "3d": r"(\d+)x(\d+)x(\d+)"}


@dataclass(frozen=True)
class TensorGrid:
    """A tensor-parallel scheme (or an algorithm) on its grid of ``p`` ranks.

    ``name`` is a scheme of :data:`SCHEME_KINDS` (or an algorithm of
    :data:`ALGORITHM_KINDS`); ``megatron`` is 1D over ``p`` (q = d = 1), ``optimus``
    a ``q x q`` grid, ``summa25`` a ``[q, q, d]`` grid (``p = d q^2``). ``pc`` > 0 makes
    the grid rectangular, ``q`` rows by ``pc`` columns (``p = d q pc``): the products of
    :data:`RECTANGULAR` run there.
    """

    name: str
    p: int
    q: int = 1
    d: int = 1
    pc: int = 0

    def __post_init__(self):
        for key in ("p", "q", "d"):
            positive_int(f"TensorGrid.{key}", getattr(self, key))
        if self.name not in SCHEME_KINDS and self.name not in ALGORITHM_KINDS:
            raise ValueError(f"unknown scheme {self.name!r}; choose from "
                             f"{', '.join(SCHEME_NAMES)}")
        if self.pc == self.q:
            object.__setattr__(self, "pc", 0)
        if self.pc:
            positive_int("TensorGrid.pc", self.pc)
            if self.name not in RECTANGULAR + RECTANGULAR_SCHEMES:
                raise ValueError(f"{self.name} needs a square grid (q x q); rectangular "
                                 f"grids run {', '.join(RECTANGULAR + RECTANGULAR_SCHEMES)}")
        if self.name in SCHEME_KINDS and self.kind == "3d" and self.d != self.q:
            raise ValueError(f"{self.name} runs on a q x q x q cube, got q={self.q}, "
                             f"d={self.d}")
        if self.kind not in ("1d", "ring") and self.p != self.d * self.q * self.cols:
            raise ValueError(f"{self.name} needs p = d*q*q, got p={self.p}, q={self.q}, "
                             f"d={self.d}" if not self.pc else
                             f"{self.name} needs p = d*pr*pc, got p={self.p}, pr={self.q}, "
                             f"pc={self.pc}, d={self.d}")

    @classmethod
    def of(cls, name: str, q: int = 1, d: int = 1, p: int | None = None,
           pc: int = 0) -> "TensorGrid":
        """The grid of scheme ``name`` with ``q`` (rows; ``pc`` columns when given) and
        ``d`` (Megatron: ``p`` ranks)."""
        if SCHEME_KINDS.get(name) == "1d" or ALGORITHM_KINDS.get(name) == "ring":
            return cls(name, positive_int("p", p if p is not None else q), 1, 1)
        if SCHEME_KINDS.get(name) == "3d":        # the cube: its depth is q
            if d not in (1, q):
                raise ValueError(f"{name} runs on a q x q x q cube, got q={q}, d={d}")
            d = q
        cols = positive_int("pc", pc) if pc else positive_int("q", q)
        return cls(name, positive_int("d", d) * positive_int("q", q) * cols, q, d, pc)

    @property
    def cols(self) -> int:
        """Columns of ranks: ``pc``, or ``q`` on a square grid."""
        return self.pc or self.q

    @property
    def kind(self) -> str:
        """"1d", "2d", "2.5d", "3d" (schemes; the products' kinds) or "ring" (the
        all-reduce)."""
        return SCHEME_KINDS.get(self.name) or ALGORITHM_KINDS[self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        """``(p,)`` for a 1D group, ``(q, q)`` or ``(q, q, d)`` (``(q, pc[, d])``)."""
        if self.kind in ("1d", "ring"):
            return (self.p,)
        if self.d == 1 and self.kind == "2d":
            return (self.q, self.cols)
        return (self.q, self.cols, self.d)

    def __str__(self) -> str:
        return f"{self.name}:" + "x".join(map(str, self.shape))

    @property
    def label(self) -> str:
        """"Megatron p=4", "Optimus [2,2]", "SUMMA2.5 [2,2,4]"."""
        if self.kind in ("1d", "ring"):
            return f"{_LONG_LABEL.get(self.name, self.name)} p={self.p}"
        if self.kind == "2d" and self.name in _LONG_LABEL:
            return f"{_LONG_LABEL[self.name]} [{self.q},{self.cols}]"
        return f"{_LONG_LABEL.get(self.name, self.name)} [{self.q},{self.cols},{self.d}]"

    @property
    def grid_label(self) -> str:
        """The grid alone, as the main job's rows print it: "1D p=4", "4x4", "2x3",
        "[2,2,4]"."""
        if self.kind == "ring":
            return f"ring p={self.p}"
        if self.kind == "1d":
            return f"1D p={self.p}"
        return grid_label(self.kind, self.q, self.d, self.pc)

    @classmethod
    def parse(cls, text: str) -> "TensorGrid":
        """``"megatron:4"``, ``"optimus:2x2"`` or ``"optimus:2x3"`` (PR rows by PC
        columns), ``"summa25:2x2x4"`` or ``"summa25:2x3x2"`` (D >= 2) or ``"3d:2x2x2"``;
        ``ValueError`` naming the problem otherwise."""
        scheme, _, grid = str(text).strip().partition(":")
        scheme = scheme.strip().lower()
        m = re.fullmatch(_TP[scheme], grid.strip().lower()) if scheme in _TP else None
        if not m:
            raise ValueError(f"tp must be {TP_FORMS}, got {str(text).strip()!r}")
        nums = [int(g) for g in m.groups()]
        if any(n < 1 for n in nums):
            raise ValueError(f"grid sizes must be positive, got {grid!r}")
        if scheme == "megatron":
            return cls(scheme, nums[0])
        if scheme == "3d":
            if not nums[0] == nums[1] == nums[2]:
                raise ValueError(f"the 3d grid must be a cube (QxQxQ), got {grid!r}")
            return cls.of(scheme, nums[0])
        if scheme == "optimus":
            return cls.of(scheme, nums[0], pc=nums[1])
        if nums[2] < 2:
            raise ValueError("summa25 needs depth D >= 2 (PRxPCx1 is optimus)")
        return cls.of(scheme, nums[0], nums[2], pc=nums[1])

    def divisors(self, hidden, heads, ffn_width, vocab=None, batch=None, kv_heads=None,
                 seq=None) -> list[tuple[str, object, int, str]]:
        """THE rule of which sizes this grid must divide: ``(what, size, divisor,
        symbol)`` for each, in order. Megatron over p: nothing (the heads, key/value head
        groups and MLP columns are cut by the balanced partition, ``megatron.head_range``;
        :meth:`least` asks for one of each per rank; any vocabulary, padded to a multiple
        of p as Megatron-LM pads it: ``megatron.vocab_block``). Optimus and SUMMA2.5-LM
        on ``[pr, pc, d]`` (``pr = pc = q`` square): whole sequences per rank (batch by
        d pr); the columns hold whole heads, the balanced partition of the key/value
        heads (``optimus.head_groups``; :meth:`least` asks for one per column), the
        weights' rows (h and the MLP width F over pr) and F over pc are the balanced
        partition, any size, and the vocabulary is padded to a multiple of
        ``lcm(pr, pc)`` (``optimus.padded_vocab``). The 3D layer on a q x q x q cube: whole
        sequences per rank (batch by q^2); its q feature blocks hold whole heads, cut as
        Optimus's columns (:meth:`least`: a key/value head per block), the MLP width and
        each weight's q depth pieces are the balanced partition, the vocabulary is
        padded to a multiple of q: any size. Grouped-query attention (``kv_heads`` given) also
        needs whole key/value heads per rank (kv heads by p, or by q), and Megatron's
        sequence parallelism (``seq`` given) whole sequence slices (seq by p). A size
        given as None is left out. The runtime
        (:meth:`misfit`) and the cost model (``workload.scheme.misfit``, whose sizes may
        be real) each phrase and test this list."""
        p, q, d = self.p, self.q, self.d
        if self.kind in ("1d", "ring"):      # heads and MLP columns: the balanced partition
            dims = [("sequence", seq, p, "p")]
        elif self.kind == "3d" and self.name in SCHEME_KINDS:
            dims = [("batch", batch, q * q, "q^2")]
        else:
            rows = "q" if not self.pc else "pr"
            dims = [("batch", batch, d * q, f"d {rows}" if d > 1 else rows)]
        return [dim for dim in dims if dim[1] is not None]

    def least(self, heads, ffn_width, kv_heads=None) -> list[tuple[str, object, int, str]]:
        """The sizes a grid needs at least one of per rank: ``(what, size, least, symbol)``.
        Megatron over p: a key/value head group (a head, without grouped-query attention)
        and an MLP column per rank, ``>= p`` each; Optimus and SUMMA2.5-LM one per
        column (``>= pc``), the 3D cube one per feature block (``>= q``)."""
        kv = heads if kv_heads is None else kv_heads
        what = "kv heads" if kv_heads is not None else "heads"
        if self.kind in ("2d", "2.5d", "3d") and self.name in SCHEME_KINDS:
            return [(what, kv, self.cols, "pc" if self.pc else "q")]
        if self.kind not in ("1d", "ring"):
            return []
        return [(what, kv, self.p, "p"), ("ffn width", ffn_width, self.p, "p")]

    def misfits(self, model: Model, batch: int | None = None,
                seq: int | None = None) -> list[tuple[str, int, int]]:
        """``(what, size, divisor)`` of every size of ``model`` (and ``batch``) this grid
        does not divide, and ``(what, size, least)`` of every size below :meth:`least`;
        empty when the model fits. See :meth:`divisors`; ``seq`` (the sequence length,
        given under sequence parallelism) must divide too."""
        kv = model.kv_heads if model.kv_heads != model.heads else None
        return [(what, size, by) for what, size, by, _ in self.divisors(
            model.hidden, model.heads, model.ffn_width, model.vocab, batch, kv, seq)
            if size % by] + [(what, size, by) for what, size, by, _ in self.least(
                model.heads, model.ffn_width, kv) if size < by]

    def misfit(self, model: Model, batch: int | None = None, seq: int | None = None) -> str:
        """Why this grid cannot shard ``model`` (with ``batch`` sequences); "" when it can.

        Megatron over p: a head (key/value head group) and an MLP column per rank, the
        balanced partition of each (no size need divide p). Optimus and SUMMA2.5-LM on
        [pr, pc, d]: the batch by d pr (whole sequences per rank) and a key/value head
        per column (the balanced partition of the heads), any hidden size and MLP width;
        the 3D cube the batch by q^2 and a key/value head per feature block. Any vocabulary: the schemes pad it, as Megatron-LM does. The schemes' own
        checks (``megatron.check``, ``optimus.check``, ``tp3d.check``) enforce the same.
        """
        per = "rank" if self.kind in ("1d", "ring") else "column"
        kv = model.kv_heads if model.kv_heads != model.heads else None
        least = {what for what, *_ in self.least(model.heads, model.ffn_width, kv)}
        return "; ".join(f"{what} = {size} is " + (
            f"smaller than {by} (one per {per})" if what in least and size < by
            else f"not divisible by {by}") for what, size, by in self.misfits(model, batch, seq))


def grid_label(kind: str, q: int, d: int = 1, pc: int = 0) -> str:
    """How a product's grid is printed: "4x4" or "2x3" (2D), "[2,2,4]" or "[1,3,2]"
    (2.5D and the rest), "2x2x2" (the 3D cube)."""
    pc = pc or q
    if kind == "3d":
        return f"{q}x{q}x{q}"
    if kind == "2d" and d == 1:
        return f"{q}x{pc}"
    return f"[{q},{pc},{d}]"


def most_square(p: int) -> tuple[int, int]:
    """``(pr, pc)`` with ``pr * pc = p``, ``pr <= pc`` and ``pr`` as large as it can be:
    the layer that sends the fewest words in SUMMA (each rank receives about
    ``m k / pr + k n / pc`` items: least when pr and pc are closest). A prime p
    gives ``(1, p)``."""
    p = positive_int("p", p)
    pr = max(r for r in range(1, math.isqrt(p) + 1) if p % r == 0)
    return pr, p // pr


def product_grids(p: int, name: str) -> list[tuple[int, int, int]]:
    """THE grids ``(pr, pc, d)`` of ``p`` ranks that product ``name`` runs on (the main
    job runs each; :func:`grids` gives them as :class:`TensorGrid`).

    Square grids as :func:`grid_shapes` gives them for the algorithm's kind, as
    ``(q, q, d)``. Where a kind has none, the products of :data:`RECTANGULAR` take a
    rectangular one instead: a "2d" SUMMA the most square ``pr x pc`` layer
    (:func:`most_square`: 2 x 3 at p = 6, 3 x 4 at 12, 4 x 6 at 24, 1 x p for a prime);
    a SUMMA2.5 product the depth ``d``, the smallest divisor of p that leaves a layer
    of at least two ranks, over the most square ``pr x pc`` layer (``[1, 3, 2]`` at
    p = 6), and ``[1, 1, p]`` only when no such layer exists (p prime).
    """
    kind = ALGORITHM_KINDS.get(name)
    if kind is None or kind == "ring":
        raise ValueError(f"{name!r} is not a distributed product")
    if kind == "2.5d":
        deep = grid_shapes(p, "2.5d-deep")
        if deep or name not in RECTANGULAR:
            return [(q, q, d) for q, d in (deep or grid_shapes(p, "2.5d"))]
        for d in range(2, p + 1):
            if p % d == 0 and p // d >= 2:
                return [(*most_square(p // d), d)]
        return [(1, 1, p)]
    square = [(q, q, d) for q, d in grid_shapes(p, kind)]
    if square or name not in RECTANGULAR:
        return square
    return [(*most_square(p), 1)]


def _both_ways(p: int) -> list[tuple[int, int]]:
    """The most square ``pr x pc`` layer of p ranks (:func:`most_square`) both ways
    round, ``pr < pc`` first: a training scheme holds whole heads per column, so which
    side is longer decides which models fit."""
    pr, pc = most_square(p)
    return [(pr, pc)] if pr == pc else [(pr, pc), (pc, pr)]


def grids(p: int, scheme: str, model: Model | None = None,
          batch: int | None = None) -> list[TensorGrid]:
    """THE grids of ``p`` ranks that ``scheme`` runs on, q ascending.

    ``scheme`` is a tensor-parallel scheme or an algorithm name:

    ``megatron``         ``[megatron:p]``
    ``optimus``          ``[optimus:qxq]`` when p = q^2, else the most square
                         rectangle both ways (``optimus:2x3``, ``optimus:3x2`` at p = 6;
                         ``1xp``, ``px1`` for a prime p)
    ``summa25``          every ``summa25:qxqxd`` with q >= 2, d >= 2 (d > q included);
                         where there is none, the smallest depth d >= 2 that leaves a
                         layer of two ranks or more, over its most square rectangle both
                         ways (``summa25:1x3x2``, ``summa25:3x1x2`` at p = 6); none
                         for a prime p (a depth alone is data parallelism)
    ``3d``               ``[3d:qxqxq]`` when p = q^3, else ``[]``
    a product            :func:`product_grids`: a "2d" algorithm as optimus, a "2.5d"
                         one as summa25, and where p has no such grid the SUMMA forms a
                         rectangular one (``summa_ab:2x3`` at p = 6); a "2.5d-deep" one
                         (sd25_ab): as summa25; a "3d" algorithm: the q x q x q cube when
                         p = q^3
    the ring             all p ranks

    With ``model`` (and ``batch``), only the grids that shard it (:meth:`TensorGrid.misfit`).
    """
    p = positive_int("p", p)
    kind = SCHEME_KINDS.get(scheme) or ALGORITHM_KINDS.get(scheme)
    if kind is None:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEME_NAMES)} "
                         f"or an algorithm ({', '.join(ALGORITHM_KINDS)})")
    if kind in ("1d", "ring"):
        out = [TensorGrid(scheme, p)]
    elif scheme in ALGORITHM_KINDS:
        out = [TensorGrid(scheme, p, pr, d, pc) for pr, pc, d in product_grids(p, scheme)]
    elif kind == "2d":
        out = [TensorGrid(scheme, p, q, 1) for q, _ in grid_shapes(p, "2d")]
        out = out or [TensorGrid(scheme, p, pr, 1, pc) for pr, pc in _both_ways(p)]
    elif kind == "3d":
        out = [TensorGrid(scheme, p, q, q) for q, _ in grid_shapes(p, "3d")]
    else:
        shapes = [(q, d) for q, d in grid_shapes(p, "2.5d") if q >= 2 and d >= 2]
        out = [TensorGrid(scheme, p, q, d) for q, d in shapes]
        if not out:
            d = next((d for d in range(2, p) if p % d == 0 and p // d >= 2), None)
            out = [TensorGrid(scheme, p, pr, d, pc) for pr, pc in _both_ways(p // d)] if d \
                else []
    if model is not None:
        out = [g for g in out if not g.misfits(model, batch)]
    return out


# ---------------------------------------------------------------------------------------
# Meshes

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Mesh:
    """A training mesh ``[dp, pp, tensor grid]``: ``dp`` data-parallel replicas, ``pp``
    pipeline stages and, inside each (replica, stage), the tensor grid ``tp``.

    ``Mesh.parse("dp=2,pp=2,tp=optimus:2x2")``; ``dp`` and ``pp`` default to 1 and ``tp``
    to ``megatron:1`` (no tensor parallelism: ``"dp=4"`` is plain data parallelism).
    ``str()`` writes the canonical form, which parses back to the same mesh.
    """

    dp: int = 1
    pp: int = 1
    tp: TensorGrid = TensorGrid("megatron", 1)

    def __post_init__(self):
        positive_int("dp", self.dp)
        positive_int("pp", self.pp)
        if not isinstance(self.tp, TensorGrid) or self.tp.name not in SCHEME_KINDS:
            raise ValueError(f"tp must be a scheme's TensorGrid ({TP_FORMS}), got {self.tp!r}")

    @property
    def devices(self) -> int:
        """Ranks of the whole mesh: dp * pp * tp.p."""
        return self.dp * self.pp * self.tp.p

    def __str__(self) -> str:
        return f"dp={self.dp},pp={self.pp},tp={self.tp}"

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """``"dp=D,pp=P,tp=SCHEME:GRID"`` (any subset, any order); ``ValueError`` naming
        the field otherwise, and on a mesh that names no axis at all."""
        fields = {}
        for part in str(text).split(","):
            key, eq, val = part.strip().partition("=")
            key = key.strip().lower()
            if key in fields:
                raise ValueError(f"mesh {text!r}: {key} given twice")
            if not eq or key not in ("dp", "pp", "tp"):
                raise ValueError(f"mesh {text!r}: expected dp=D,pp=P,tp=SCHEME:GRID, "
                                 f"got {part.strip()!r}")
            fields[key] = val.strip()
        out = {}
        for key in ("dp", "pp"):
            val = fields.get(key, "1")
            if not val.isdigit() or int(val) < 1:
                raise ValueError(f"mesh {text!r}: {key} must be a positive integer, "
                                 f"got {val!r}")
            out[key] = int(val)
        try:
            tp = TensorGrid.parse(fields.get("tp", "megatron:1"))
        except ValueError as e:
            raise ValueError(f"mesh {text!r}: {e}") from None
        return cls(out["dp"], out["pp"], tp)


# ---------------------------------------------------------------------------------------
# How a mesh trains: the techniques every command spells alike

#: Pipeline schedules; "interleaved" takes V model chunks per stage ("interleaved:2").
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
ATTENTIONS = ("plain", "flash")
#: Element types: the two plain ones, and the two mixed-precision ones (compute in the
#: 16-bit type, fp32 master weights and fp32 Adam).
DTYPES = ("float64", "float32", "bfloat16", "float16")
MIXED_DTYPES = ("bfloat16", "float16")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


def parse_schedule(text: str) -> tuple[str, int]:
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved:V"`` (V >= 2 model chunks per stage) as
    ``(kind, chunks)``; ``ValueError`` naming the problem otherwise."""
    kind, colon, v = str(text).strip().lower().partition(":")
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"schedule must be gpipe, 1f1b or interleaved:V, got {text!r}")
    if kind != "interleaved":
        if colon:
            raise ValueError(f"schedule {kind} takes no chunk count, got {text!r}")
        return kind, 1
    if not v.isdigit() or int(v) < 2:
        raise ValueError(f"interleaved:V needs V >= 2 model chunks per stage, got {text!r}")
    return kind, int(v)


def parse_stages(text: str) -> tuple[int, ...]:
    """``"6,6,5"``: layers per pipeline stage (per virtual stage when interleaved), in
    pipeline order; 0 is allowed (a stage holding only the embedding or only the head).
    ``ValueError`` otherwise."""
    parts = [t.strip() for t in str(text).split(",")]
    if not parts or any(not t.isdigit() for t in parts):
        raise ValueError(f"stages must be layers per stage, comma-separated non-negative "
                         f"integers such as 6,6,5, got {text!r}")
    return tuple(int(t) for t in parts)


#: the static loss scales a step can use: 1/S and S times a unit gradient stay normal
#: float32 numbers with room to spare (a scale of 1e-300 made every gradient NaN, 1e38
#: overflowed every step)
LOSS_SCALE_RANGE = (2.0 ** -24, 2.0 ** 64)


def parse_loss_scale(text: str) -> str:
    """``"dynamic"``, ``"none"`` or ``"static:S"`` (S in :data:`LOSS_SCALE_RANGE`),
    normalised."""
    t = str(text).strip().lower()
    if t in ("dynamic", "none"):
        return t
    kind, colon, val = t.partition(":")
    lo, hi = LOSS_SCALE_RANGE
    try:
        ok = kind == "static" and colon and math.isfinite(float(val)) and float(val) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"loss scale must be dynamic, none or static:S with S > 0, "
                         f"got {text!r}")
    if not lo <= float(val) <= hi:
        raise ValueError(f"a static loss scale must be between 2^-24 and 2^64, so that 1/S "
                         f"and S times a gradient stay finite in float32; got {text!r}")
    return f"static:{float(val):g}"


def stage_layers(layers: int, pp: int, stages=None, chunks: int = 1) -> list[range]:
    """THE split of ``layers`` into the ``pp * chunks`` (virtual) pipeline stages, in
    pipeline order: contiguous ascending ranges.

    Without ``stages`` the first ``layers % (pp chunks)`` stages get one layer more, and
    every stage needs a layer. ``stages`` (layers per stage, e.g. ``(6, 6, 5)``) splits
    explicitly: it must have ``pp * chunks`` entries summing to ``layers``; a 0 is a
    stage with no layer (the first stage holding only the embedding, the last only the
    final LayerNorm and the head). With ``chunks = V`` (interleaved 1F1B), virtual stage
    ``c pp + s`` is model chunk ``c`` of stage ``s`` (Narayanan et al. 2021, section
    2.2.2). ``ValueError`` naming the numbers otherwise.
    """
    pp, chunks = positive_int("pp", pp), positive_int("chunks", chunks)
    n = pp * chunks
    what = f"{pp} stages" + (f" x {chunks} chunks" if chunks > 1 else "")
    if stages is None:
        if layers < n:
            raise ValueError(f"a pipeline of {what} needs at least {n} layers, the model "
                             f"has {layers}")
        base, extra = divmod(layers, n)
        sizes = [base + (1 if i < extra else 0) for i in range(n)]
    else:
        sizes = [int(x) for x in stages]
        if len(sizes) != n or any(x < 0 for x in sizes) or sum(sizes) != layers:
            raise ValueError(f"--stages {','.join(map(str, sizes))}: needs {n} non-negative "
                             f"entries (one per stage{' and chunk' if chunks > 1 else ''}) "
                             f"summing to the model's {layers} layers")
        if n > 1 and not any(sizes):
            raise ValueError("--stages: every stage is empty")
    out, start = [], 0
    for x in sizes:
        out.append(range(start, start + x))
        start += x
    return out


@dataclass(frozen=True)
class Training:
    """How a mesh trains: the techniques ``run``, ``bench``, ``predict`` and ``plan`` all
    take from the same flags (``options.add_training``).

    zero            ZeRO stage 0-3
    schedule        ``gpipe``, ``1f1b`` or ``interleaved`` (with ``chunks`` = V >= 2)
    microbatches    micro-batches per replica per step (None: the command's default)
    stages          layers per (virtual) stage, or None for the even split
                    (:func:`stage_layers`)
    recompute       ``none``, ``selective`` (only the attention core is recomputed,
                    Korthikanti et al. 2022) or ``full`` (each layer from its input)
    attention       ``plain`` (the b n s^2 scores are held) or ``flash`` (blockwise,
                    online softmax: O(s tile) scores)
    sequence_parallel  Megatron sequence parallelism (Korthikanti et al. 2022)
    dtype           the element type; ``bfloat16``/``float16`` is mixed precision
                    (16-bit compute, fp32 master weights and fp32 Adam)
    loss_scale      ``none``, ``dynamic`` or ``static:S`` (mixed precision only; default
                    dynamic for float16, none for bfloat16)
    grad_reduce     ``float32`` or ``bfloat16``: the type of the data-parallel gradient
                    reduction (mixed precision only; default float32)
    """

    zero: int = 0
    schedule: str = "1f1b"
    chunks: int = 1
    microbatches: int | None = None
    stages: tuple | None = None
    recompute: str = "none"
    attention: str = "plain"
    sequence_parallel: bool = False
    dtype: str | None = None
    loss_scale: str | None = None
    grad_reduce: str | None = None

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of 0, 1, 2, 3, got {self.zero!r}")
        if self.schedule not in SCHEDULE_KINDS:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_KINDS)}, "
                             f"got {self.schedule!r}")
        positive_int("chunks", self.chunks)
        if (self.schedule == "interleaved") != (self.chunks > 1):
            raise ValueError("interleaved takes V >= 2 chunks per stage (interleaved:V); "
                             "the other schedules take one")
        if self.microbatches is not None:
            positive_int("microbatches", self.microbatches)
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(int(x) for x in self.stages))
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                             f"got {self.recompute!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, "
                             f"got {self.attention!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        mixed = self.mixed
        if self.loss_scale is not None:
            scale = parse_loss_scale(self.loss_scale)
            if not mixed and scale != "none":
                raise ValueError(f"--loss-scale {self.loss_scale} needs mixed precision "
                                 f"(--dtype bfloat16 or float16), the dtype is {self.dtype}")
            object.__setattr__(self, "loss_scale", scale)
        elif mixed:
            object.__setattr__(self, "loss_scale",
                               "dynamic" if self.dtype == "float16" else "none")
        if self.grad_reduce is not None:
            if self.grad_reduce not in GRAD_REDUCE_DTYPES:
                raise ValueError(f"grad reduce must be one of {', '.join(GRAD_REDUCE_DTYPES)}"
                                 f", got {self.grad_reduce!r}")
            if not mixed:
                raise ValueError(f"--grad-reduce {self.grad_reduce} needs mixed precision "
                                 f"(--dtype bfloat16 or float16), the dtype is {self.dtype}")
        elif mixed:
            object.__setattr__(self, "grad_reduce", "float32")

    @property
    def mixed(self) -> bool:
        """16-bit compute with fp32 master weights (``dtype`` bfloat16 or float16)."""
        return self.dtype in MIXED_DTYPES

    @property
    def checkpoint(self) -> bool:
        """Whole-layer recompute (``--checkpoint``, the same as ``--recompute full``)."""
        return self.recompute == "full"

    @property
    def schedule_label(self) -> str:
        """``gpipe``, ``1f1b`` or ``interleaved:V``."""
        return f"interleaved:{self.chunks}" if self.schedule == "interleaved" else self.schedule

    def stage_layers(self, layers: int, pp: int) -> list[range]:
        """The layers of each (virtual) stage (:func:`stage_layers`)."""
        return stage_layers(layers, pp, self.stages, self.chunks)

    def techniques(self) -> dict:
        """``{flag: value}`` of every technique that differs from plain training
        (ZeRO 0, gpipe or 1F1B over even stages, no recompute, plain attention, no
        sequence parallelism, a plain dtype): what a command that cannot run or price
        one of them must refuse by name."""
        out = {}
        if self.schedule == "interleaved":
            out["--schedule"] = self.schedule_label
        if self.stages is not None:
            out["--stages"] = ",".join(map(str, self.stages))
        if self.recompute == "selective":
            out["--recompute"] = self.recompute
        if self.attention != "plain":
            out["--attention"] = self.attention
        if self.sequence_parallel:
            out["--sequence-parallel"] = ""
        if self.mixed:
            out["--dtype"] = self.dtype
        return out

    def __str__(self) -> str:
        parts = [f"zero={self.zero}", f"schedule={self.schedule_label}"]
        if self.microbatches is not None:
            parts.append(f"microbatches={self.microbatches}")
        if self.stages is not None:
            parts.append("stages=" + ",".join(map(str, self.stages)))
        parts.append(f"recompute={self.recompute}")
        parts.append(f"attention={self.attention}")
        if self.sequence_parallel:
            parts.append("sequence-parallel")
        if self.dtype:
            parts.append(f"dtype={self.dtype}")
        if self.mixed:
            parts += [f"loss-scale={self.loss_scale}", f"grad-reduce={self.grad_reduce}"]
        return ",".join(parts)


def unsupported(training: Training, supported, who: str) -> str:
    """"" when ``who`` can do every technique of ``training``; else one line naming the
    flags it cannot (``supported``: the flag names of :meth:`Training.techniques` that
    ``who`` handles)."""
    missing = [f"{k} {v}".strip() for k, v in training.techniques().items()
               if k not in supported]
    if not missing:
        return ""
    return f"{who} does not support {', '.join(missing)} yet"


# ---------------------------------------------------------------------------------------
# The balanced partition: how every layout cuts a dimension that does not divide.


def partition(size: int, parts: int) -> list[int]:
    """The ``parts + 1`` offsets of the balanced partition of ``size`` items into
    ``parts`` blocks: the first ``size % parts`` blocks hold ``size // parts + 1``
    items, the others ``size // parts`` (no block is more than one item larger)."""
    size, parts = int(size), int(parts)
    if parts < 1 or size < 0:
        raise ValueError(f"cannot cut {size} items into {parts} blocks")
    base, extra = divmod(size, parts)
    return [t * base + min(t, extra) for t in range(parts + 1)]


def block_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of block ``index`` of the balanced partition (:func:`partition`)."""
    base, extra = divmod(int(size), int(parts))
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def vocab_block(vocab: int, parts: int) -> int:
    """Vocabulary ids per block when a vocabulary is cut into ``parts`` blocks (Megatron's
    p ranks, Optimus's and SUMMA2.5-LM's q rows or columns): ``ceil(v / parts)``. A
    vocabulary that does not divide is padded to ``parts ceil(v / parts)`` ids, as
    Megatron-LM pads it (``--make-vocab-size-divisible-by``, times the tensor size): the
    padding rows of ``wte`` (columns of ``head.w``) are zeros that no token looks up,
    their logits are left out of the softmax, their gradients stay zero."""
    return -(-int(vocab) // int(parts))


# ---------------------------------------------------------------------------------------
# Rank order: the one place that says where each rank sits.

GRID_GROUPS = ("row", "col", "depth", "layer")


def grid_rank(i: int, j: int, k: int, q: int, pc: int | None = None) -> int:
    """Rank of coordinate ``(i, j, k)`` on a ``[q, pc, d]`` grid (``pc`` columns, default
    ``q``): ``(k q + i) pc + j`` (row-major over ``[d, q, pc]``, as
    ``Create_cart([d, q, pc], reorder=False)`` numbers)."""
    return (k * q + i) * (pc or q) + j


def grid_coords(rank: int, q: int, pc: int | None = None) -> tuple[int, int, int]:
    """``(i, j, k)`` of ``rank`` on a ``[q, pc, d]`` grid (inverse of :func:`grid_rank`)."""
    pc = pc or q
    return (rank // pc) % q, rank % pc, rank // (q * pc)


def grid_groups(kind: str, q: int, d: int, pc: int | None = None) -> list[list[int]]:
    """Every communicator of ``kind`` on a ``[q, pc, d]`` grid (``q`` rows and ``pc``
    columns of ranks per layer, ``pc`` default ``q``) as lists of ranks, each ordered by
    its free coordinate (so a rank's position in its group is that coordinate):

    ``row``    fixed (k, i), ordered by j      ``col``    fixed (k, j), ordered by i
    ``depth``  fixed (i, j), ordered by k      ``layer``  fixed k, ordered by i pc + j
    """
    pc = pc or q
    r = lambda i, j, k: grid_rank(i, j, k, q, pc)  # noqa: E731
    if kind == "row":
        return [[r(i, j, k) for j in range(pc)] for k in range(d) for i in range(q)]
    if kind == "col":
        return [[r(i, j, k) for i in range(q)] for k in range(d) for j in range(pc)]
    if kind == "depth":
        return [[r(i, j, k) for k in range(d)] for i in range(q) for j in range(pc)]
    if kind == "layer":
        return [[r(i, j, k) for i in range(q) for j in range(pc)] for k in range(d)]
    raise ValueError(f"grid group must be one of {', '.join(GRID_GROUPS)}, got {kind!r}")


MESH_GROUPS = ("dp", "pp", "tensor")


def mesh_rank(a: int, s: int, r: int, pp: int, t: int) -> int:
    """Rank of replica ``a``, stage ``s``, tensor rank ``r`` on a ``[dp, pp, t]`` mesh:
    row-major, the tensor grid innermost (its ranks are neighbours, as Megatron-LM places
    them), then the stages, then the replicas."""
    return (a * pp + s) * t + r


def mesh_coords(rank: int, pp: int, t: int) -> tuple[int, int, int]:
    """``(a, s, r)`` of ``rank`` (inverse of :func:`mesh_rank`)."""
    return rank // (pp * t), (rank // t) % pp, rank % t


def mesh_groups(kind: str, dp: int, pp: int, t: int) -> list[list[int]]:
    """Every communicator of ``kind`` on a ``[dp, pp, t]`` mesh, each ordered by its free
    coordinate: ``dp`` (fixed stage and tensor rank, ordered by replica), ``pp`` (fixed
    replica and tensor rank, ordered by stage), ``tensor`` (fixed replica and stage)."""
    m = lambda a, s, r: mesh_rank(a, s, r, pp, t)  # noqa: E731
    if kind == "dp":
        return [[m(a, s, r) for a in range(dp)] for s in range(pp) for r in range(t)]
    if kind == "pp":
        return [[m(a, s, r) for s in range(pp)] for a in range(dp) for r in range(t)]
    if kind == "tensor":
        return [[m(a, s, r) for r in range(t)] for a in range(dp) for s in range(pp)]
    raise ValueError(f"mesh group must be one of {', '.join(MESH_GROUPS)}, got {kind!r}")
