"""Typed cases: what one run of the harness does (pure).

A case names the problem and the grid; the executors in :mod:`summasim.harness.run`
turn it into data, a distributed call, a verdict and timings. Cases round-trip
through plain dicts (the worker's spec files, ``measured.json`` and the cost model's
analysis read that form: ``kind`` plus the fields below, the transformer's model
shape spelled ``b, s, h, heads, v, layers, ffn``).

``MatmulCase(algorithm, q, d, m, k, n, dtype)``   C[m, n] = op(A) op(B) on [q, q, d]
``RingCase(n, dtype)``                            ring_allreduce of n items, all ranks
``TransformerCase(scheme, q, d, batch, config)``  one training step of a scheme
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..algorithms.table import get_algorithm
from ..transformer.model import Config
from ..transformer.schemes import get_scheme

DTYPES = ("float64", "float32")


def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name}")
    return name


@dataclass(frozen=True)
class MatmulCase:
    """A distributed product C[m, n] = op(A)[m, k] op(B)[k, n] on a [q, q, d] grid."""

    algorithm: str
    q: int
    d: int
    m: int
    k: int
    n: int
    dtype: str = "float64"
    kind = "matmul"

    def __post_init__(self):
        spec = get_algorithm(self.algorithm)
        if not spec.is_product:
            raise ValueError(f"{self.algorithm} is not a distributed product")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))

    @property
    def spec(self):
        return get_algorithm(self.algorithm)

    @property
    def p(self) -> int:
        return self.d * self.q * self.q

    @property
    def shapes(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)

    def misfit(self) -> str:
        """Why the sizes do not divide the grid ("" when they do)."""
        return self.spec.misfit(self.m, self.k, self.n, self.q, self.d)

    def grid_label(self, p: int | None = None) -> str:
        return self.spec.grid_label(self.q, self.d)

    def label(self, p: int | None = None) -> str:
        return f"{self.algorithm} {self.grid_label()} {self.m}x{self.k}x{self.n}"

    def to_dict(self) -> dict:
        return {"kind": "matmul", "algorithm": self.algorithm, "q": self.q, "d": self.d,
                "m": self.m, "k": self.k, "n": self.n, "dtype": self.dtype}


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
    kind = "transformer"

    def __post_init__(self):
        get_scheme(self.scheme)

    @property
    def dtype(self) -> str:
        return np.dtype(self.config.dtype).name

    def misfit(self, p: int) -> str:
        return get_scheme(self.scheme).misfit(self.config, self.batch, p, self.q, self.d)

    def grid_label(self, p: int | None = None) -> str:
        return get_scheme(self.scheme).grid_label(p, self.q, self.d)

    def label(self, p: int | None = None) -> str:
        c = self.config
        return (f"{self.scheme} {self.grid_label(p)} b{self.batch} s{c.seq} h{c.hidden} "
                f"v{c.vocab} L{c.layers}")

    def to_dict(self) -> dict:
        c = self.config
        return {"kind": "transformer", "scheme": self.scheme, "q": self.q, "d": self.d,
                "b": self.batch, "s": c.seq, "h": c.hidden, "heads": c.heads, "v": c.vocab,
                "layers": c.layers, "ffn": c.ffn_mult, "dtype": self.dtype}


def transformer_case(scheme: str, q: int, d: int, b: int, s: int, h: int, heads: int,
                     v: int, layers: int, ffn: int = 4, dtype: str = "float64"):
    """A :class:`TransformerCase` from the flat sizes."""
    config = Config(vocab=int(v), seq=int(s), hidden=int(h), heads=int(heads),
                    layers=int(layers), ffn_mult=int(ffn), dtype=np.dtype(dtype).type)
    return TransformerCase(scheme, int(q), int(d), int(b), config)


def case_from_dict(data: dict):
    """The typed case of a dict written by ``to_dict`` (extra keys are ignored)."""
    kind = data.get("kind")
    if kind == "matmul":
        return MatmulCase(data["algorithm"], int(data["q"]), int(data["d"]), int(data["m"]),
                          int(data["k"]), int(data["n"]), data.get("dtype", "float64"))
    if kind == "ring":
        return RingCase(int(data["N"]), data.get("dtype", "float64"))
    if kind == "transformer":
        return transformer_case(data["scheme"], data["q"], data["d"], data["b"], data["s"],
                                data["h"], data["heads"], data["v"], data["layers"],
                                data.get("ffn", 4), data.get("dtype", "float64"))
    raise ValueError(f"unknown case kind {kind!r}")
