"""The shared nouns of summasim (pure: no MPI, no NumPy).

Every floor and every command speaks these, so one thing has one name and one rule:

``Model``        a transformer's size (hidden, heads, layers, seq, vocab, ffn), with
                 named presets (:data:`MODELS`, e.g. ``gpt3-175b``) and a parser for
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

#: Each algorithm and the kind of grid it runs on: "2d" (q x q), "2.5d" ([q, q, d]) or
#: "ring" (all p ranks in one group).
ALGORITHM_KINDS: dict[str, str] = {
    "cannon_ab": "2d",
    "summa_ab": "2d",
    "summa_abt": "2d",
    "summa_atb": "2d",
    "summa25_ab": "2.5d",
    "summa25_abt": "2.5d",
    "summa25_atb": "2.5d",
    "ring_allreduce": "ring",
}
#: The matrix products (every algorithm but the ring).
PRODUCTS: tuple[str, ...] = tuple(n for n, k in ALGORITHM_KINDS.items() if k != "ring")

#: Each tensor-parallel scheme and its grid kind: "1d" (Megatron over p), "2d"
#: (Optimus, q x q) or "2.5d" (SUMMA2.5-LM, [q, q, d] with d >= 2).
SCHEME_KINDS: dict[str, str] = {"megatron": "1d", "optimus": "2d", "summa25": "2.5d"}
SCHEME_NAMES: tuple[str, ...] = tuple(SCHEME_KINDS)

GRID_KINDS = ("2d", "2.5d", "any")


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
    """
    p = positive_int("p", p)
    if kind not in GRID_KINDS:
        raise ValueError(f"grid kind must be one of {', '.join(GRID_KINDS)}, got {kind!r}")
    every = [(q, p // (q * q)) for q in range(1, math.isqrt(p) + 1) if p % (q * q) == 0]
    if kind == "any":
        return every
    if kind == "2d":
        return [(q, d) for q, d in every if d == 1]
    deep = [(q, d) for q, d in every if d >= 2 and q >= 2]
    return deep or [(1, p)]


# ---------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class Model:
    """A GPT-style transformer's size (items; the MLP is ``[h, ffn_mult h]``).

    Parameters
    ----------
    vocab, seq, hidden, heads, layers : int
        Vocabulary (as padded for training), longest sequence, hidden size h,
        attention heads n (dividing h) and layers.
    ffn_mult : int, default 4
        MLP multiplier f (GPT-2: 4).
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
    ffn_mult: int = 4
    name: str = field(default="", kw_only=True, compare=False)
    batch: int | None = field(default=None, kw_only=True, compare=False)
    source: str = field(default="", kw_only=True, compare=False, repr=False)

    def __post_init__(self):
        cls = type(self).__name__
        for key in ("vocab", "seq", "hidden", "heads", "layers", "ffn_mult"):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
                raise ValueError(f"{cls}.{key} must be a positive integer, got {val!r}")
        if self.hidden % self.heads:
            raise ValueError(f"{cls}.hidden={self.hidden} is not divisible by "
                             f"{cls}.heads={self.heads}")
        if self.batch is not None:
            positive_int(f"{cls}.batch", self.batch)

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        """The MLP width f h."""
        return self.ffn_mult * self.hidden

    def replace(self, **changes) -> "Model":
        """A copy with some sizes changed (a preset's name and source are dropped)."""
        keep = {"name": "", "source": ""} if set(changes) - {"batch"} else {}
        return dataclasses.replace(self, **{**keep, **changes})

    def sizes(self) -> dict[str, int]:
        """``{"h", "heads", "layers", "seq", "vocab", "ffn"}``: the ``--model`` keys."""
        return {"h": self.hidden, "heads": self.heads, "layers": self.layers,
                "seq": self.seq, "vocab": self.vocab, "ffn": self.ffn_mult}

    def __str__(self) -> str:
        if self.name and MODELS.get(self.name) == self:
            return self.name
        return ",".join(f"{k}={v}" for k, v in self.sizes().items())

    @classmethod
    def parse(cls, text: str) -> "Model":
        """``"gpt3-175b"`` (a preset) or ``"h=64,heads=16,layers=2,seq=16,vocab=64,ffn=4"``.

        Keys: ``h`` (or ``hidden``), ``heads``, ``layers``, ``seq``, ``vocab``, ``ffn``
        (the MLP multiplier, default 4); every key but ``ffn`` is required. A preset
        may be followed by overrides: ``"gpt3-175b,layers=8"``. ``ValueError`` naming
        the problem otherwise.
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
            val = val.strip()
            if not val.isdigit() or int(val) < 1:
                raise ValueError(f"model: {key} must be a positive integer, got {val!r}")
            fields[key] = int(val)
        if base is not None:
            return base.replace(**{_MODEL_FIELDS[k]: v for k, v in fields.items()}) \
                if fields else base
        missing = [k for k in ("h", "heads", "layers", "seq", "vocab") if k not in fields]
        if missing:
            raise ValueError(f"model: missing {', '.join(missing)} (expected {MODEL_FORM})")
        return cls(**{_MODEL_FIELDS[k]: v for k, v in fields.items()})


MODEL_FORM = "h=H,heads=N,layers=L,seq=S,vocab=V[,ffn=F]"
_MODEL_KEYS = {"h": "h", "hidden": "h", "heads": "heads", "layers": "layers", "seq": "seq",
               "vocab": "vocab", "ffn": "ffn"}
_MODEL_FIELDS = {"h": "hidden", "heads": "heads", "layers": "layers", "seq": "seq",
                 "vocab": "vocab", "ffn": "ffn_mult"}


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

_LONG_LABEL = {"megatron": "Megatron", "optimus": "Optimus", "summa25": "SUMMA2.5"}
TP_FORMS = "megatron:T, optimus:QxQ or summa25:QxQxD"
_TP = {"megatron": r"(\d+)", "optimus": r"(\d+)x(\d+)", "summa25": r"(\d+)x(\d+)x(\d+)"}


@dataclass(frozen=True)
class TensorGrid:
    """A tensor-parallel scheme (or an algorithm) on its grid of ``p`` ranks.

    ``name`` is a scheme of :data:`SCHEME_KINDS` (or an algorithm of
    :data:`ALGORITHM_KINDS`); ``megatron`` is 1D over ``p`` (q = d = 1), ``optimus``
    a ``q x q`` grid, ``summa25`` a ``[q, q, d]`` grid (``p = d q^2``).
    """

    name: str
    p: int
    q: int = 1
    d: int = 1

    def __post_init__(self):
        for key in ("p", "q", "d"):
            positive_int(f"TensorGrid.{key}", getattr(self, key))
        if self.name not in SCHEME_KINDS and self.name not in ALGORITHM_KINDS:
            raise ValueError(f"unknown scheme {self.name!r}; choose from "
                             f"{', '.join(SCHEME_NAMES)}")
        if self.kind not in ("1d", "ring") and self.p != self.d * self.q * self.q:
            raise ValueError(f"{self.name} needs p = d*q*q, got p={self.p}, q={self.q}, "
                             f"d={self.d}")

    @classmethod
    def of(cls, name: str, q: int = 1, d: int = 1, p: int | None = None) -> "TensorGrid":
        """The grid of scheme ``name`` with ``q`` and ``d`` (Megatron: ``p`` ranks)."""
        if SCHEME_KINDS.get(name) == "1d" or ALGORITHM_KINDS.get(name) == "ring":
            return cls(name, positive_int("p", p if p is not None else q), 1, 1)
        return cls(name, positive_int("d", d) * positive_int("q", q) ** 2, q, d)

    @property
    def kind(self) -> str:
        """"1d", "2d", "2.5d" (schemes) or "ring" (the all-reduce)."""
        return SCHEME_KINDS.get(self.name) or ALGORITHM_KINDS[self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        """``(p,)`` for a 1D group, ``(q, q)`` or ``(q, q, d)``."""
        if self.kind in ("1d", "ring"):
            return (self.p,)
        return (self.q, self.q) if self.d == 1 and self.kind == "2d" else (self.q, self.q, self.d)

    def __str__(self) -> str:
        return f"{self.name}:" + "x".join(map(str, self.shape))

    @property
    def label(self) -> str:
        """"Megatron p=4", "Optimus [2,2]", "SUMMA2.5 [2,2,4]"."""
        if self.kind in ("1d", "ring"):
            return f"{_LONG_LABEL.get(self.name, self.name)} p={self.p}"
        if self.kind == "2d" and self.name in _LONG_LABEL:
            return f"{_LONG_LABEL[self.name]} [{self.q},{self.q}]"
        return f"{_LONG_LABEL.get(self.name, self.name)} [{self.q},{self.q},{self.d}]"

    @property
    def grid_label(self) -> str:
        """The grid alone, as the main job's rows print it: "1D p=4", "4x4", "[2,2,4]"."""
        if self.kind == "ring":
            return f"ring p={self.p}"
        if self.kind == "1d":
            return f"1D p={self.p}"
        return f"{self.q}x{self.q}" if self.kind == "2d" else f"[{self.q},{self.q},{self.d}]"

    @classmethod
    def parse(cls, text: str) -> "TensorGrid":
        """``"megatron:4"``, ``"optimus:2x2"`` or ``"summa25:2x2x4"`` (D >= 2);
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
        if nums[0] != nums[1]:
            raise ValueError(f"the {scheme} grid must be square (QxQ), got {grid!r}")
        if scheme == "optimus":
            return cls.of(scheme, nums[0])
        if nums[2] < 2:
            raise ValueError("summa25 needs depth D >= 2 (QxQx1 is optimus)")
        return cls.of(scheme, nums[0], nums[2])

    def divisors(self, hidden, heads, ffn_width, vocab=None, batch=None
                 ) -> list[tuple[str, object, int, str]]:
        """THE rule of which sizes this grid must divide: ``(what, size, divisor,
        symbol)`` for each, in order. Megatron over p: whole heads, column and row slices
        and vocabulary slices per rank (heads, hidden, ffn width, vocab by p). Optimus
        and SUMMA2.5-LM on [q, q, d]: whole sequences per rank (batch by d q) and hidden,
        heads, ffn width, vocab by q. A size given as None is left out. The runtime
        (:meth:`misfit`) and the cost model (``workload.scheme.misfit``, whose sizes may
        be real) each phrase and test this list."""
        p, q, d = self.p, self.q, self.d
        if self.kind in ("1d", "ring"):
            dims = [("heads", heads, p, "p"), ("hidden", hidden, p, "p"),
                    ("ffn width", ffn_width, p, "p"), ("vocab", vocab, p, "p")]
        else:
            dims = [("batch", batch, d * q, "d q" if d > 1 else "q"),
                    ("hidden", hidden, q, "q"), ("heads", heads, q, "q"),
                    ("ffn width", ffn_width, q, "q"), ("vocab", vocab, q, "q")]
        return [dim for dim in dims if dim[1] is not None]

    def misfits(self, model: Model, batch: int | None = None) -> list[tuple[str, int, int]]:
        """``(what, size, divisor)`` of every size of ``model`` (and ``batch``) this grid
        does not divide; empty when the model fits. See :meth:`divisors`."""
        return [(what, size, by) for what, size, by, _ in self.divisors(
            model.hidden, model.heads, model.ffn_width, model.vocab, batch) if size % by]

    def misfit(self, model: Model, batch: int | None = None) -> str:
        """Why this grid cannot shard ``model`` (with ``batch`` sequences); "" when it can.

        Megatron over p: whole heads, column and row slices and vocabulary slices per
        rank (heads, hidden, ffn width and vocab divisible by p). Optimus and SUMMA2.5-LM
        on [q, q, d]: the batch by d q (whole sequences per rank) and hidden, heads,
        vocab and ffn width by q. The schemes' own checks (``megatron.check``,
        ``optimus.check``) enforce the same.
        """
        return "; ".join(f"{what} = {size} is not divisible by {by}"
                         for what, size, by in self.misfits(model, batch))


def grids(p: int, scheme: str, model: Model | None = None,
          batch: int | None = None) -> list[TensorGrid]:
    """THE grids of ``p`` ranks that ``scheme`` runs on, q ascending.

    ``scheme`` is a tensor-parallel scheme or an algorithm name:

    ``megatron``         ``[megatron:p]``
    ``optimus``          ``[optimus:qxq]`` when p = q^2, else ``[]``
    ``summa25``          every ``summa25:qxqxd`` with q >= 2, d >= 2 (d > q included)
    a "2d" algorithm     as optimus; a "2.5d" algorithm: as summa25, or the degenerate
                         ``[1, 1, p]`` when no such grid exists; the ring: all p ranks.

    With ``model`` (and ``batch``), only the grids that shard it (:meth:`TensorGrid.misfit`).
    """
    p = positive_int("p", p)
    kind = SCHEME_KINDS.get(scheme) or ALGORITHM_KINDS.get(scheme)
    if kind is None:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEME_NAMES)} "
                         f"or an algorithm ({', '.join(ALGORITHM_KINDS)})")
    if kind in ("1d", "ring"):
        out = [TensorGrid(scheme, p)]
    elif kind == "2d":
        out = [TensorGrid(scheme, p, q, 1) for q, _ in grid_shapes(p, "2d")]
    else:
        shapes = grid_shapes(p, "2.5d")
        if scheme in SCHEME_KINDS:
            shapes = [(q, d) for q, d in shapes if q >= 2 and d >= 2]
        out = [TensorGrid(scheme, p, q, d) for q, d in shapes]
    if model is not None:
        out = [g for g in out if not g.misfits(model, batch)]
    return out


# ---------------------------------------------------------------------------------------
# Meshes

SCHEDULES = ("gpipe", "1f1b")
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
            if not eq or key not in ("dp", "pp", "tp") or key in fields:
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
# Rank order: the one place that says where each rank sits.

GRID_GROUPS = ("row", "col", "depth", "layer")


def grid_rank(i: int, j: int, k: int, q: int) -> int:
    """Rank of coordinate ``(i, j, k)`` on a ``[q, q, d]`` grid: ``(k q + i) q + j``
    (row-major over ``[d, q, q]``, as ``Create_cart([d, q, q], reorder=False)`` numbers)."""
    return (k * q + i) * q + j


def grid_coords(rank: int, q: int) -> tuple[int, int, int]:
    """``(i, j, k)`` of ``rank`` on a ``[q, q, d]`` grid (inverse of :func:`grid_rank`)."""
    return (rank // q) % q, rank % q, rank // (q * q)


def grid_groups(kind: str, q: int, d: int) -> list[list[int]]:
    """Every communicator of ``kind`` on a ``[q, q, d]`` grid as lists of ranks, each
    ordered by its free coordinate (so a rank's position in its group is that coordinate):

    ``row``    fixed (k, i), ordered by j      ``col``    fixed (k, j), ordered by i
    ``depth``  fixed (i, j), ordered by k      ``layer``  fixed k, ordered by i q + j
    """
    r = lambda i, j, k: grid_rank(i, j, k, q)  # noqa: E731
    if kind == "row":
        return [[r(i, j, k) for j in range(q)] for k in range(d) for i in range(q)]
    if kind == "col":
        return [[r(i, j, k) for i in range(q)] for k in range(d) for j in range(q)]
    if kind == "depth":
        return [[r(i, j, k) for k in range(d)] for i in range(q) for j in range(q)]
    if kind == "layer":
        return [[r(i, j, k) for i in range(q) for j in range(q)] for k in range(d)]
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
