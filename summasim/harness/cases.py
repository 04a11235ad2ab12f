"""Typed cases: what one run of the harness does (pure).

A case names the problem and the grid; the executors in :mod:`summasim.harness.run`
turn it into data, a distributed call, a verdict and timings. Cases round-trip
through plain dicts (the worker's spec files, ``measured.json`` and the cost model's
analysis read that form: ``kind`` plus the fields below, the transformer's model
shape spelled ``b, s, h, heads, v, layers, ffn``).

``MatmulCase(algorithm, q, d, m, k, n, dtype, pc)``  C[m, n] = op(A) op(B) on [q, q, d]
                                                  (``pc`` > 0: on [q, pc, d])
``RingCase(n, dtype)``                            ring_allreduce of n items, all ranks
``TransformerCase(scheme, q, d, batch, config)``  one training step of a scheme
``MeshCase(mesh, batch, config, ...)``             sharded training on a spec.Mesh
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..algorithms.table import get_algorithm
from ..spec import (ATTENTIONS, MIXED_DTYPES as MIXED, RECOMPUTE, SCHEDULE_KINDS,
                    ZERO_STAGES, Mesh, stage_layers)
from ..transformer.model import Config
from ..transformer.schemes import get_scheme
from ..validate import vacuous_training_check

DTYPES = ("float64", "float32")


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name}")
    return name


@dataclass(frozen=True)
class MatmulCase:
    """A distributed product C[m, n] = op(A)[m, k] op(B)[k, n] on a [q, q, d] grid, or
    on a rectangular [q, pc, d] one (``pc`` > 0, ``q`` rows by ``pc`` columns)."""

    algorithm: str
    q: int
    d: int
    m: int
    k: int
    n: int
    dtype: str = "float64"
    pc: int = 0
    kind = "matmul"

    def __post_init__(self):
        spec = get_algorithm(self.algorithm)
        if not spec.is_product:
            raise ValueError(f"{self.algorithm} is not a distributed product")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.pc == self.q:
            object.__setattr__(self, "pc", 0)

    @property
    def spec(self):
        return get_algorithm(self.algorithm)

    @property
    def cols(self) -> int:
        """Columns of ranks: ``pc``, or ``q`` on a square grid."""
        return self.pc or self.q

    @property
    def p(self) -> int:
        return self.d * self.q * self.cols

    @property
    def shapes(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)

    def misfit(self) -> str:
        """Why the sizes cannot run on the grid ("" when they can)."""
        return self.spec.misfit(self.m, self.k, self.n, self.q, self.d, self.pc)

    def grid_label(self, p: int | None = None) -> str:
        return self.spec.grid_label(self.q, self.d, self.pc)

    def label(self, p: int | None = None) -> str:
        return f"{self.algorithm} {self.grid_label()} {self.m}x{self.k}x{self.n}"

    def to_dict(self) -> dict:
        out = {"kind": "matmul", "algorithm": self.algorithm, "q": self.q, "d": self.d,
               "m": self.m, "k": self.k, "n": self.n, "dtype": self.dtype}
        if self.pc:
            out["pc"] = self.pc
        return out


@dataclass(frozen=True)
class RingCase:
    """``ring_allreduce`` of ``n`` items over all ranks."""

    n: int
    dtype: str = "float64"
    kind = "ring"
    algorithm = "ring_allreduce"

    def __post_init__(self):
        if int(self.n) < 1:
            raise ValueError(f"ring length must be positive, got {self.n}")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))

    def grid_label(self, p: int | None = None) -> str:
        return f"ring p={p if p is not None else '?'}"

    def label(self, p: int | None = None) -> str:
        return f"ring_allreduce p={p if p is not None else '?'} N={self.n}"

    def to_dict(self) -> dict:
        return {"kind": "ring", "algorithm": "ring_allreduce", "N": self.n, "dtype": self.dtype}


@dataclass(frozen=True)
class TransformerCase:
    """One training step (forward + backward) of a tensor-parallel scheme."""

    scheme: str
    q: int
    d: int
    batch: int
    config: Config
    pc: int = 0                  # columns of a rectangular grid (q rows); 0: square
    kind = "transformer"

    def __post_init__(self):
        get_scheme(self.scheme)
        if self.pc == self.q:
            object.__setattr__(self, "pc", 0)

    @property
    def dtype(self) -> str:
        return np.dtype(self.config.dtype).name

    def misfit(self, p: int) -> str:
        return get_scheme(self.scheme).misfit(self.config, self.batch, p, self.q, self.d,
                                              self.pc)

    def grid_label(self, p: int | None = None) -> str:
        return get_scheme(self.scheme).grid_label(p, self.q, self.d, self.pc)

    def label(self, p: int | None = None) -> str:
        c = self.config
        return (f"{self.scheme} {self.grid_label(p)} b{self.batch} s{c.seq} h{c.hidden} "
                f"v{c.vocab} L{c.layers}")

    def to_dict(self) -> dict:
        c = self.config
        return {"kind": "transformer", "scheme": self.scheme, "q": self.q, "d": self.d,
                "pc": self.pc or self.q, "b": self.batch, "s": c.seq, "h": c.hidden, "heads": c.heads, "v": c.vocab,
                "layers": c.layers, "ffn": c.ffn_mult, "dtype": self.dtype, **_variant(c)}


def _variant(c: Config) -> dict:
    """The model variant's fields of a case's dict, only where not GPT-2's defaults (older
    records read the same)."""
    return {k: (False if k == "tied" else v) for k, v in c.variant().items() if k != "ffn"}


def _ffn(value) -> int | float:
    """An MLP multiplier read back: an int where it is whole, else the real number."""
    f = float(value)
    return int(f) if f.is_integer() else f


@dataclass(frozen=True)
class MeshCase:
    """Sharded training on a :class:`summasim.spec.Mesh` ``[dp, pp, tensor grid]``,
    validated against the serial model over ``steps`` Adam steps.

    ``batch`` is the GLOBAL batch, cut into ``dp`` replicas of ``microbatches``
    micro-batches each. ``schedule`` is gpipe, 1f1b or interleaved (with ``chunks`` = V
    >= 2 model chunks per stage); ``stages`` the layers per (virtual) stage, or None
    for the even split (:func:`summasim.spec.stage_layers`). ``recompute`` is none,
    selective or full (``checkpoint`` is True exactly for full), ``attention`` plain or
    flash, ``sequence_parallel`` Megatron's sequence parallelism. ``precision``
    (bfloat16 or float16; ``config.dtype`` float32, the master weights) is mixed
    precision with ``loss_scale`` (none, static:S or dynamic; default: none for
    bfloat16, dynamic for float16) and ``grad_reduce`` (float32 or a 16-bit type).
    Reports name the mesh as ``str(mesh)`` (``dp=2,pp=1,tp=...``).
    """

    mesh: Mesh
    batch: int
    config: Config
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    checkpoint: bool = False
    bucket_bytes: int = 25 << 20
    steps: int = 3
    chunks: int = 1
    stages: tuple | None = None
    recompute: str = "none"
    attention: str = "plain"
    sequence_parallel: bool = False
    overlap: bool = False
    precision: str | None = None
    loss_scale: str | None = None
    grad_reduce: str | None = None
    kind = "mesh"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a summasim.spec.Mesh, got {type(self.mesh).__name__}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULE_KINDS:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_KINDS)}, "
                             f"got {self.schedule!r}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) \
                or (self.schedule == "interleaved") != (self.chunks > 1) or self.chunks < 1:
            raise ValueError(f"interleaved takes V >= 2 model chunks per stage, gpipe and "
                             f"1f1b one; got {self.schedule} with {self.chunks!r}")
        if self.microbatches < 1 or self.steps < 1 or self.bucket_bytes < 1:
            raise ValueError("microbatches, steps and bucket_bytes must be positive")
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(int(x) for x in self.stages))
        if self.recompute not in RECOMPUTE or self.attention not in ATTENTIONS:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} and attention "
                             f"one of {', '.join(ATTENTIONS)}; got {self.recompute!r}, "
                             f"{self.attention!r}")
        if self.checkpoint and self.recompute == "selective":
            raise ValueError("checkpoint is whole-layer recompute; it contradicts "
                             "recompute='selective'")
        if self.checkpoint or self.recompute == "full":
            object.__setattr__(self, "checkpoint", True)
            object.__setattr__(self, "recompute", "full")
        if self.precision is not None:
            if self.precision not in MIXED:
                raise ValueError(f"precision must be one of {', '.join(MIXED)}, got "
                                 f"{self.precision!r}")
            if np.dtype(self.config.dtype) != np.float32:
                raise ValueError(f"mixed precision keeps fp32 master weights: the model "
                                 f"must be float32, got {np.dtype(self.config.dtype).name}")
            if self.loss_scale is None:
                object.__setattr__(self, "loss_scale", "dynamic" if self.precision ==
                                   "float16" else "none")
            if self.grad_reduce is None:
                object.__setattr__(self, "grad_reduce", "float32")
        elif self.loss_scale not in (None, "none") or self.grad_reduce not in (None,
                                                                               "float32"):
            raise ValueError("loss_scale and grad_reduce need mixed precision "
                             "(precision bfloat16 or float16)")

    @classmethod
    def parse(cls, mesh: "str | Mesh", batch: int, config: Config, **kw) -> "MeshCase":
        """The case of ``mesh`` (a :class:`Mesh` or its text) with this model and batch."""
        return cls(mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh), int(batch), config,
                   **kw)

    @property
    def spec(self) -> str:
        """The mesh's canonical text, ``str(self.mesh)``."""
        return str(self.mesh)

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def scheme(self) -> str:
        return self.mesh.tp.name

    @property
    def q(self) -> int:
        return self.mesh.tp.q

    @property
    def d(self) -> int:
        return self.mesh.tp.d

    @property
    def pc(self) -> int:
        """Columns of a rectangular tensor grid; 0 when square (or 1D)."""
        return self.mesh.tp.pc

    @property
    def t(self) -> int:
        """Ranks of a Megatron tensor group (1 for a 2D/2.5D grid, whose size is d q^2)."""
        return self.mesh.tp.p if self.mesh.tp.kind == "1d" else 1

    @property
    def dtype(self) -> str:
        """The compute type: the 16-bit type under mixed precision, else the model's."""
        return self.precision or np.dtype(self.config.dtype).name

    @property
    def master_dtype(self) -> str:
        """The type of the parameters Adam updates (the model's: float32 when mixed)."""
        return np.dtype(self.config.dtype).name

    @property
    def grid_kind(self) -> str:
        return self.mesh.tp.kind

    @property
    def tensor_size(self) -> int:
        return self.mesh.tp.p

    @property
    def p(self) -> int:
        return self.dp * self.pp * self.tensor_size

    @property
    def schedule_label(self) -> str:
        """``gpipe``, ``1f1b`` or ``interleaved:V``."""
        return f"interleaved:{self.chunks}" if self.schedule == "interleaved" else self.schedule

    @property
    def stages_label(self) -> str:
        """The layers per (virtual) stage as given (``"1,0,0,3"``), "" for the even split."""
        return "" if self.stages is None else ",".join(map(str, self.stages))

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch (per replica)."""
        return self.batch // (self.dp * self.microbatches)

    def misfit(self, p: int) -> str:
        """Why this mesh cannot run on p ranks with this model and batch ("" if it can)."""
        bad = []
        if p != self.p:
            bad.append(f"the mesh needs dp*pp*tensor = {self.dp}*{self.pp}*"
                       f"{self.tensor_size} = {self.p} ranks, the job has {p}")
        try:
            stage_layers(self.config.layers, self.pp, self.stages, self.chunks)
        except ValueError as e:
            bad.append(str(e))
        if self.schedule == "interleaved":
            if self.pp < 2:
                bad.append(f"{self.schedule_label} needs pp >= 2 stages, the mesh has "
                           f"pp = {self.pp}")
            elif self.microbatches % self.pp:
                bad.append(f"{self.schedule_label} needs micro-batches a multiple of pp = "
                           f"{self.pp}, got {self.microbatches}")
        if self.sequence_parallel:
            if self.grid_kind != "1d":
                bad.append(f"sequence parallelism splits Megatron's 1D groups; "
                           f"{self.mesh.tp.label} already splits every activation over "
                           f"all its ranks")
            elif self.config.seq % self.t:
                bad.append(f"sequence parallelism needs seq = {self.config.seq} divisible "
                           f"by the tensor group t = {self.t}")
        vacuous = vacuous_training_check(self.config, self.batch, self.dtype,
                                         self.grad_reduce, self.microbatches * self.dp)
        if vacuous:
            bad.append(vacuous)
        if self.batch % (self.dp * self.microbatches):
            bad.append(f"batch = {self.batch} is not divisible by dp * microbatches = "
                       f"{self.dp * self.microbatches}")
        else:
            model_only = self.mesh.tp.misfit(self.config)
            why = model_only or self.mesh.tp.misfit(self.config, self.micro_batch)
            if model_only:
                bad.append(model_only)
            elif why:              # the micro-batch: batch / (dp * microbatches)
                bad.append(why.replace("batch = ", "micro-batch = ", 1) + (
                    f" (--batch {self.batch} over dp * microbatches = "
                    f"{self.dp * self.microbatches})"))
        return "; ".join(bad)

    def grid_label(self, p: int | None = None) -> str:
        return self.spec

    def label(self, p: int | None = None) -> str:
        c = self.config
        stages = f" stages={self.stages_label}" if self.stages is not None else ""
        extra = "".join(f" {t}" for t in self.techniques)
        return (f"{self.spec} zero={self.zero} {self.schedule_label}{stages} "
                f"m={self.microbatches}{' ckpt' if self.checkpoint else ''}{extra} "
                f"b{self.batch} s{c.seq} h{c.hidden} L{c.layers}")

    @property
    def techniques(self) -> list[str]:
        """The techniques beyond the schedule and ZeRO, as short labels (``selective``,
        ``flash``, ``sp``); empty for plain training."""
        mixed = []              # the dtype column names the precision itself
        if self.precision:
            if self.loss_scale != ("dynamic" if self.precision == "float16" else "none"):
                mixed.append(f"loss-scale={self.loss_scale}")
            if self.grad_reduce != "float32":
                mixed.append(f"grad-reduce={self.grad_reduce}")
        return ([self.recompute] if self.recompute == "selective" else []) + \
            (["flash"] if self.attention == "flash" else []) + \
            (["sp"] if self.sequence_parallel else []) + mixed

    def to_dict(self) -> dict:
        c = self.config
        return {"kind": "mesh", "mesh": self.spec, "dp": self.dp, "pp": self.pp,
                "scheme": self.scheme, "q": self.q, "d": self.d, "t": self.t,
                "zero": self.zero, "schedule": self.schedule, "m": self.microbatches,
                "checkpoint": self.checkpoint, "bucket_bytes": self.bucket_bytes,
                "steps": self.steps, "b": self.batch, "s": c.seq, "h": c.hidden,
                "heads": c.heads, "v": c.vocab, "layers": c.layers, "ffn": c.ffn_mult,
                "dtype": self.dtype,
                # last and only when not the defaults: older records read the same
                **({"chunks": self.chunks} if self.chunks != 1 else {}),
                **({"stages": list(self.stages)} if self.stages is not None else {}),
                **({"recompute": self.recompute} if self.recompute == "selective" else {}),
                **({"attention": self.attention} if self.attention != "plain" else {}),
                **({"sequence_parallel": True} if self.sequence_parallel else {}),
                **({"overlap": True} if self.overlap else {}),
                **_variant(c),
                **({"loss_scale": self.loss_scale, "grad_reduce": self.grad_reduce}
                   if self.precision else {})}


def transformer_case(scheme: str, q: int, d: int, b: int, s: int, h: int, heads: int,
                     v: int, layers: int, ffn: float = 4, dtype: str = "float64", pc: int = 0,
                     *, mlp: str = "gelu", kv_heads: int | None = None, tied: bool = True):
    """A :class:`TransformerCase` from the flat sizes (``pc`` columns of a rectangular
    grid of q rows) and the model variant."""
    config = Config(vocab=int(v), seq=int(s), hidden=int(h), heads=int(heads),
                    layers=int(layers), ffn_mult=_ffn(ffn), dtype=np.dtype(dtype).type,
                    mlp=mlp, kv_heads=kv_heads, tied=bool(tied))
    return TransformerCase(scheme, int(q), int(d), int(b), config, int(pc or 0))


def case_from_dict(data: dict):
    """The typed case of a dict written by ``to_dict`` (extra keys are ignored)."""
    kind = data.get("kind")
    if kind == "matmul":
        return MatmulCase(data["algorithm"], int(data["q"]), int(data["d"]), int(data["m"]),
                          int(data["k"]), int(data["n"]), data.get("dtype", "float64"),
                          int(data.get("pc") or 0))
    if kind == "ring":
        return RingCase(int(data["N"]), data.get("dtype", "float64"))
    if kind == "transformer":
        return transformer_case(data["scheme"], data["q"], data["d"], data["b"], data["s"],
                                data["h"], data["heads"], data["v"], data["layers"],
                                data.get("ffn", 4), data.get("dtype", "float64"),
                                data.get("pc") or 0, mlp=data.get("mlp", "gelu"),
                                kv_heads=data.get("kv_heads"),
                                tied=bool(data.get("tied", True)))
    if kind == "mesh":
        dtype = data.get("dtype", "float64")
        mixed = dtype in MIXED                 # mixed precision: float32 master weights
        master = "float32" if mixed else dtype
        config = Config(vocab=int(data["v"]), seq=int(data["s"]), hidden=int(data["h"]),
                        heads=int(data["heads"]), layers=int(data["layers"]),
                        ffn_mult=_ffn(data.get("ffn", 4)),
                        dtype=np.dtype(master).type,
                        mlp=data.get("mlp", "gelu"), kv_heads=data.get("kv_heads"),
                        tied=bool(data.get("tied", True)))
        return MeshCase.parse(data["mesh"], int(data["b"]), config, zero=int(data["zero"]),
                              recompute=data.get("recompute", "none"),
                              attention=data.get("attention", "plain"),
                              sequence_parallel=bool(data.get("sequence_parallel", False)),
                              overlap=bool(data.get("overlap", False)),
                              precision=dtype if mixed else None,
                              loss_scale=data.get("loss_scale") if mixed else None,
                              grad_reduce=data.get("grad_reduce") if mixed else None,
                              schedule=data["schedule"], microbatches=int(data["m"]),
                              checkpoint=bool(data["checkpoint"]),
                              bucket_bytes=int(data["bucket_bytes"]), steps=int(data["steps"]),
                              chunks=int(data.get("chunks", 1)),
                              stages=(None if data.get("stages") is None
                                      else tuple(int(x) for x in data["stages"])))
    raise ValueError(f"unknown case kind {kind!r}")
