"""The replica audit's bookkeeping: what a rank holds of the state its replicas must
hold bit for bit alike (:class:`ReplicaSet`), the parts every rank of a group holds
(:func:`common_spans`) and the flat-range helpers they use; and :class:`Unit`, a run of
parameters fetched together. :meth:`summasim.transformer.composed.Trainer.replica_sets`
builds the sets and :meth:`~summasim.transformer.composed.Trainer.audit` compares them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..backends import backend_of


@dataclass(frozen=True)
class Unit:
    """A run of parameters fetched together (ZeRO-3) and never split by a bucket edge."""

    name: str
    keys: tuple
    start: int
    stop: int


@dataclass
class ReplicaSet:
    """State that every rank of ``comm`` holds bit for bit alike (:meth:`Trainer.
    replica_sets`): views of the held parameters (``params``) and of Adam's moments
    (``state``) in a fixed order, and ``extra``, the digest of what the step's ZeRO-3
    gathers delivered (None elsewhere).

    ``pieces`` (the tensor and the tied-embedding groups) lists the same views by key,
    ``(kind, key, a, b, view)`` with ``kind`` "p", "m" or "v" and ``[a, b)`` in items
    of the key. The ranks of a Megatron or 3D group lay their stage out alike
    (:meth:`Trainer._slots`), but the embedding group joins two stages whose layouts,
    buckets and ZeRO chunks differ: the audit compares the parts every rank of the
    group holds (:func:`common_spans`), key by key, never the order of one rank's
    segments."""

    name: str
    comm: object
    params: list = field(default_factory=list)
    state: list = field(default_factory=list)
    extra: bytes | None = None
    extra_nbytes: int = 0            # the bytes ``extra`` digested
    pieces: list | None = None

    def spans(self) -> dict:
        """``{(kind, key): [(a, b)]}``: what this rank holds of each key (``pieces``)."""
        out: dict = {}
        for kind, key, a, b, _ in self.pieces:
            out.setdefault((kind, key), []).append((a, b))
        return {k: _merge(v) for k, v in out.items()}

    def nbytes(self, common: dict | None = None) -> int:
        """Bytes hashed for the audit (with ``pieces``, those inside ``common``)."""
        if self.pieces is not None:
            return int(sum(v.itemsize * sum(min(b, d) - max(a, c) for c, d in common.get(
                (kind, key), ()) if max(a, c) < min(b, d))
                for kind, key, a, b, v in self.pieces))
        return int(sum(v.nbytes for v in self.params + self.state) + self.extra_nbytes)

    def digest(self, common: dict | None = None) -> int:
        """blake2b (8 bytes) of the views' bytes, in order, then ``extra``; with
        ``pieces``, of the parts inside ``common`` (:func:`common_spans`), parameters
        then the first moments then the second, each key in order and in its items'
        order, however this rank's views cut them."""
        h = hashlib.blake2b(digest_size=8)
        if self.pieces is not None:
            order = {key: i for i, key in enumerate(dict.fromkeys(p[1] for p in self.pieces))}
            for kind, key, a, b, view in sorted(
                    self.pieces, key=lambda p: ("pmv".index(p[0]), order[p[1]], p[2])):
                for c, d in _clip(common.get((kind, key), ()), a, b):
                    h.update(_host_bytes(view[c - a:d - a]))
            return int.from_bytes(h.digest(), "little")
        for v in self.params + self.state:
            h.update(_host_bytes(v))
        if self.extra is not None:
            h.update(self.extra)
        return int.from_bytes(h.digest(), "little")


def common_spans(every: list) -> dict:
    """``{(kind, key): [(a, b)]}`` held by every rank, from each rank's
    :meth:`ReplicaSet.spans`: the intersection, key by key."""
    out = dict(every[0])
    for spans in every[1:]:
        out = {k: _intersect(v, spans.get(k, ())) for k, v in out.items()}
    return {k: v for k, v in out.items() if v}


def _intersect(x, y) -> list[tuple[int, int]]:
    """The parts common to sorted disjoint ranges ``x`` and ``y``."""
    return [(max(a, c), min(b, d)) for a, b in x for c, d in y if max(a, c) < min(b, d)]


def _host_bytes(a) -> memoryview:
    """The bytes of array ``a`` (a device array through a host copy)."""
    if type(a) is not np.ndarray:
        a = backend_of(a).to_numpy(a)
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _clip(ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of sorted flat ``ranges`` inside ``[lo, hi)``."""
    return [(max(a, lo), min(b, hi)) for a, b in ranges if max(a, lo) < min(b, hi)]


def _merge(ranges) -> list[tuple[int, int]]:
    """Sorted ``ranges`` with touching ones joined."""
    out: list = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out
