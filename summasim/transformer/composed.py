"""Sharded training: data, pipeline and ZeRO parallelism composed with tensor parallelism.

A :class:`~summasim.grid.Mesh` ``[dp, pp, tensor grid]`` runs one training step of the
GPT-2 model of :mod:`model` as follows (rank at replica ``a``, stage ``s``):

Pipeline (``pp`` stages)
    The layers are cut into ``pp`` contiguous stages (:func:`split_layers`; the first
    ``layers % pp`` stages get one more). Stage 0 also runs the embedding, the last
    stage the final LayerNorm, the tied LM head and the loss; with ``pp > 1`` the last
    stage holds its own copy of ``wte`` and the two copies' gradients are summed over
    ``mesh.embed`` (a ring all-reduce between the two stages, phase ``embed.tie``), as
    Megatron-LM does with its embedding group. Each replica's batch is cut into ``m``
    micro-batches; activations go forward and their gradients backward point to point
    over ``mesh.pp_comm`` (phases ``pp.fwd``, ``pp.bwd``; non-blocking sends, blocking
    receives, tags ``2j`` and ``2j + 1`` for micro-batch j) in the order of
    :func:`schedule` ("gpipe": every forward, then every backward; "1f1b": ``pp - s - 1``
    warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards). Every micro-batch's loss is divided by the token count of the whole
    global batch, so the gradients summed over micro-batches and replicas are the
    full-batch gradient.

Data parallelism (``dp`` replicas) and ZeRO
    A stage's local parameters (its tensor-parallel shards) live in one flat buffer in
    forward order, cut into units (``wte``, ``wpe``, each layer, the head) and buckets
    (runs of parameters, in backward order, of about ``bucket_bytes``; ``wte`` is always
    a bucket of its own; under ZeRO-3 a bucket is a unit). Bucket ``b`` of ``n`` items is
    cut into ``dp`` ring chunks (:func:`~summasim.algorithms.allreduce.chunk_bounds`) and
    replica ``a`` owns chunk ``(a + 1) % dp``, the chunk a ring reduce-scatter leaves
    summed on it. Per step:

    ======  ====================================================================
    ZeRO 0  gradients accumulate over micro-batches; one ring all-reduce per bucket
            over ``mesh.dp_comm`` in backward order (phase ``dp.grads``); Adam on all
    ZeRO 1  gradients accumulate as in ZeRO 0; one ring reduce-scatter per bucket
            (only the owned chunk's sum is needed); Adam state only for the owned
            chunks; then a ring all-gather of each bucket's parameters (phase
            ``zero.params``): the same bytes as ZeRO 0's all-reduce (the ZeRO paper's
            P_os, section 7.2.1)
    ZeRO 2  during each micro-batch's backward, a ring reduce-scatter of each bucket
            into a gradient shard as soon as the backward has finished the bucket (about
            one piece's gradient and one bucket live at once, never the whole; the
            ZeRO paper's section 5.2); Adam on the owned chunks; all-gather of the
            parameters
    ZeRO 3  as ZeRO 2, and the parameters are kept as the owned chunks only: each
            unit is all-gathered (phase ``zero.gather``) right before a piece that
            reads it runs, forward and backward, every micro-batch, and dropped after
            (a forward piece's cache keeps no view of the gathered buffer: the views
            are taken out and re-made on the backward's fresh gather)
    ======  ====================================================================

    Reduce-scatter and all-gather are the two halves of summasim's ring all-reduce
    (:func:`~summasim.algorithms.allreduce.ring_reduce_scatter`,
    :func:`~summasim.algorithms.allreduce.ring_allgather`), traced like every other call.

The tensor-parallel scheme runs piece by piece through its module's ``embed_forward``,
``layer_forward``, ``head_forward`` and their backwards (see ``docs/transformer.md``).
:meth:`Trainer.expected_traffic` gives the closed form of every phase above for this
rank, and :meth:`Trainer.state_bytes` the bytes of model state it holds.

References
----------
Huang et al. (2019), "GPipe", arXiv:1811.06965. Narayanan et al. (2021), "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (1F1B).
Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20. Li et al. (2020), "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB (gradient buckets in backward order).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..algorithms.allreduce import (_bounds, ring_allgather_unchecked,
                                    ring_allreduce_unchecked, ring_reduce_scatter_unchecked)
from ..backends import array_module, to_backend
from ..mpiutil import agree, fields_of, fingerprint, local_error
from . import model
from .ops import BLOCK_KEYS
from .train import Adam

SCHEDULES = ("gpipe", "1f1b")
ZERO_STAGES = (0, 1, 2, 3)
#: PyTorch DDP's default bucket (``bucket_cap_mb=25``, Li et al. 2020).
DEFAULT_BUCKET_BYTES = 25 << 20


# --------------------------------------------------------------------------- #
# pure helpers                                                                #
# --------------------------------------------------------------------------- #
def split_layers(layers: int, pp: int) -> list[range]:
    """The contiguous layer ranges of ``pp`` stages; the first ``layers % pp`` stages
    get one layer more. ``ValueError`` when a stage would have no layer."""
    if pp < 1 or layers < pp:
        raise ValueError(f"pipeline of pp = {pp} stages needs at least pp layers, "
                         f"the model has {layers}")
    out, start = [], 0
    base, extra = divmod(layers, pp)
    for s in range(pp):
        stop = start + base + (1 if s < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def schedule(kind: str, microbatches: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs ``("F", j)`` forwards and ``("B", j)``
    backwards of micro-batches ``j = 0..m-1``.

    "gpipe": all forwards, then all backwards in reverse (Huang et al. 2019).
    "1f1b": ``min(pp - stage - 1, m)`` warm-up forwards, then forward j and backward
    ``j - warmup`` in turn, then the remaining backwards (Narayanan et al. 2021), so at
    most ``pp - stage`` micro-batches are in flight on a stage.
    """
    m = microbatches
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if m < 1 or not 0 <= stage < pp:
        raise ValueError(f"schedule needs m >= 1 and 0 <= stage < pp; got m={m}, "
                         f"stage={stage}, pp={pp}")
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    warm = min(pp - stage - 1, m)
    order = [("F", j) for j in range(warm)]
    for j in range(warm, m):
        order += [("F", j), ("B", j - warm)]
    order += [("B", j) for j in range(m - warm, m)]
    return order


def ring_send_items(n: int, p: int, rank: int, half: str) -> int:
    """Items rank ``rank`` sends in one ring ``half`` ("rs", "ag" or "ar" = both) of a
    length-n buffer over p ranks (the closed form of :mod:`summasim.algorithms.allreduce`:
    the reduce-scatter sends every chunk but ``(r+1) % p``, the all-gather every chunk
    but ``(r+2) % p``; ``2 (p-1)/p n`` in all when p divides n)."""
    if p == 1:
        return 0
    b = _bounds(n, p)
    size = lambda c: b[c % p][1] - b[c % p][0]  # noqa: E731
    rs, ag = n - size(rank + 1), n - size(rank + 2)
    return {"rs": rs, "ag": ag, "ar": rs + ag}[half]


def activation_shape(grid_kind: str, config: model.Config, grid, batch: int,
                     seq: int) -> tuple:
    """The local shape of the activation between two layers for a micro-batch of
    ``batch`` sequences: (b, s, h) replicated (1D), (b/(dq), s, h/q) (2D / 2.5D)."""
    if grid_kind == "1d":
        return (batch, seq, config.hidden)
    return (batch // (grid.d * grid.q), seq, config.hidden // grid.q)


class _Ref(tuple):
    """Where a cached array viewed the i-th gathered buffer: (i, offset, shape, strides)."""

    def view(self, bufs):
        i, offset, shape, strides = self
        if i >= len(bufs):
            raise RuntimeError("a ZeRO-3 cache reads a parameter that was not re-gathered")
        buf = bufs[i]
        xp = array_module(buf)
        return xp.lib.stride_tricks.as_strided(buf[offset // buf.itemsize:], shape=shape,
                                               strides=strides)


def _ptr(a) -> int:
    """The address of an array's first byte (NumPy or CuPy)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]


def _ref_of(a, bufs):
    """A :class:`_Ref` if array ``a`` lies inside one of ``bufs`` ``[(i, ptr, nbytes)]``."""
    if a.size == 0:
        return a
    p = _ptr(a)
    for i, lo, nbytes in bufs:
        if lo <= p < lo + nbytes:
            return _Ref((i, p - lo, tuple(a.shape), tuple(a.strides)))
    return a


def _map_arrays(obj, on_array, on_ref=None):
    """``obj`` (NamedTuples, dicts, lists and tuples of arrays, nested) with each array
    ``a`` replaced by ``on_array(a)`` and each :class:`_Ref` by ``on_ref(r)``; other
    leaves as they are, containers rebuilt only where something changed."""
    if isinstance(obj, _Ref):
        return on_ref(obj) if on_ref is not None else obj
    if hasattr(obj, "shape") and hasattr(obj, "strides"):
        return on_array(obj)
    if isinstance(obj, dict):
        new = {k: _map_arrays(v, on_array, on_ref) for k, v in obj.items()}
        return new if any(new[k] is not obj[k] for k in obj) else obj
    if isinstance(obj, (list, tuple)):
        new = [_map_arrays(v, on_array, on_ref) for v in obj]
        if all(n is o for n, o in zip(new, obj)):
            return obj
        if hasattr(obj, "_fields"):                                  # a NamedTuple
            return type(obj)(*new)
        return type(obj)(new)
    return obj


@dataclass(frozen=True)
class Unit:
    """A run of parameters fetched together (ZeRO-3) and never split by a bucket edge."""

    name: str
    keys: tuple
    start: int
    stop: int


# --------------------------------------------------------------------------- #
# the trainer                                                                 #
# --------------------------------------------------------------------------- #
class _BucketGrads:
    """ZeRO 2-3: one micro-batch's gradient, held bucket by bucket. A bucket's buffer
    exists from the first gradient written into it until the backward piece after which
    all of its gradients are final (``Trainer.bucket_piece``); then it is
    reduce-scattered over dp into the gradient shard and dropped, in bucket order, so
    every replica reduces the same buckets in the same order. What lives at once is
    about one piece's gradient and one bucket (the ZeRO paper's section 5.2), not the
    stage's whole gradient."""

    def __init__(self, trainer):
        self.tr, self.bufs, self.next = trainer, {}, 0

    def add(self, offset: int, v) -> None:
        if not v.size:
            return
        tr = self.tr
        i = tr._bucket_of(offset)
        lo, hi = tr.buckets[i]
        buf = self.bufs.get(i)
        if buf is None:
            buf = self.bufs[i] = tr.xp.zeros(hi - lo, dtype=tr.config.dtype)
        buf[offset - lo:offset - lo + v.size] += v

    def done(self, piece: int) -> None:
        """Piece ``piece`` of the backward has run: reduce the buckets now final."""
        tr = self.tr
        while self.next < len(tr.buckets) and tr.bucket_piece[self.next] <= piece:
            i = self.next
            buf = self.bufs.pop(i, None)
            if buf is None:                   # a bucket nobody wrote is still reduced
                lo, hi = tr.buckets[i]
                buf = tr.xp.zeros(hi - lo, dtype=tr.config.dtype)
            tr._reduce_scatter(i, buf)
            self.next += 1


class Trainer:
    """One replica-stage-tensor rank of a sharded training run (collective over the
    mesh: every rank constructs it and calls :meth:`step` alike).

    Parameters
    ----------
    params : dict
        The serial parameters (``model.init_params``), the same on every rank.
    config : model.Config
    mesh : summasim.grid.Mesh
    spec : SchemeSpec
        The tensor-parallel scheme (``transformer.schemes.get_scheme``), matching
        ``mesh.kind``.
    zero : {0, 1, 2, 3}
    schedule : {"gpipe", "1f1b"}
    microbatches : int
        Micro-batches per replica per step.
    checkpoint : bool
        Recompute each layer in backward from its saved input.
    bucket_bytes : int
        Target size of a gradient bucket (ZeRO 0-2).
    lr, betas, eps :
        Adam (no weight decay: the flat shards carry no per-tensor decay mask).
    """

    def __init__(self, params: dict, config: model.Config, mesh, spec, *, zero: int = 0,
                 schedule: str = "1f1b", microbatches: int = 1, checkpoint: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8):
        def local():
            if zero not in ZERO_STAGES:
                raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
            if schedule not in SCHEDULES:
                raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, "
                                 f"got {schedule!r}")
            if microbatches < 1 or bucket_bytes < 1:
                raise ValueError(f"microbatches and bucket_bytes must be positive, got "
                                 f"{microbatches} and {bucket_bytes}")
            if spec.grid_kind != mesh.kind:
                raise ValueError(f"scheme {spec.name} runs on a {spec.grid_kind} grid, the "
                                 f"mesh has a {mesh.kind} tensor grid")
            split_layers(config.layers, mesh.pp)
            model.check_params(params, config)

        # a setting or parameter that is bad (or different) on one rank only raises the
        # same error on every rank of the mesh, before any data moves
        _, err = local_error(local)
        agree("composed.Trainer", mesh.world, lambda: {
            **fields_of(config, "Config"), "scheme": spec.name, "zero": zero,
            "schedule": schedule, "microbatches": microbatches, "checkpoint": bool(checkpoint),
            "bucket_bytes": bucket_bytes, "Adam": repr((lr, tuple(betas), eps)),
            **{f"params[{k}]": fingerprint(v) for k, v in sorted(params.items())}}, err)
        self.config, self.mesh, self.spec, self.module = config, mesh, spec, spec.module
        self.zero, self.kind, self.m = zero, schedule, int(microbatches)
        self.checkpoint, self.bucket_bytes = bool(checkpoint), int(bucket_bytes)
        self.grid = mesh.tensor
        self.trace = mesh.trace
        self.layers = split_layers(config.layers, mesh.pp)[mesh.s]
        self.first, self.last = mesh.first, mesh.last
        self.lm = not config.n_classes
        keys = model.stage_keys(config, self.layers, self.first, self.last)
        local = self.module.shard(params, config, self.grid, keys)   # agrees over the grid
        local = to_backend(getattr(mesh, "backend", None), local)   # CuPy: on the device
        self._layout(local, keys)
        self.xp = array_module(local[self.keys[0]])
        dtype, n = config.dtype, self.n
        if zero < 3:
            self.flat = self.xp.empty(n, dtype=dtype)                           # (n,)
            self.pack(local, out=self.flat)
            self.params = self._views(self.flat, 0, self.keys)
        else:
            self.flat, self.params = None, None
            full = self.pack(local)
            self.shard = self.xp.concatenate([full[lo:hi] for lo, hi in self.owned])
        del local
        self.grad = self.xp.zeros(n, dtype=dtype) if zero < 2 else None        # (n,)
        self.gshard = self.xp.zeros(self.shard_len, dtype=dtype) if zero >= 2 else None
        self.opt = Adam(lr=lr, betas=betas, eps=eps)
        self.max_inflight = 0
        self.steps = 0
        self._gathered = []

    # -- layout --------------------------------------------------------------
    def _layout(self, local: dict, keys: list) -> None:
        cfg = self.config
        units = []
        if self.first:
            units += [("wte", ("wte",)), ("wpe", ("wpe",))]
        for l in self.layers:
            units.append((f"h{l}", tuple(f"h{l}.{k}" for k in BLOCK_KEYS)))
        if self.last:
            head = ("lnf.g", "lnf.b") + (("cls.w", "cls.b") if cfg.n_classes else ())
            units.append(("head", head))
            if self.lm and not self.first:
                units.append(("wte", ("wte",)))
        order = [k for _, ks in units for k in ks]
        assert sorted(order) == sorted(keys), (order, keys)   # one stage layout, two views
        self.keys = order
        self.shapes = {k: tuple(local[k].shape) for k in order}
        self.offsets, off = {}, 0
        for k in order:
            self.offsets[k] = off
            off += math.prod(self.shapes[k])
        self.n = off
        self.units = {}
        for name, ks in units:
            start = self.offsets[ks[0]]
            stop = self.offsets[ks[-1]] + math.prod(self.shapes[ks[-1]])
            self.units[name] = Unit(name, ks, start, stop)
        self.buckets = self._buckets()
        dp, a = self.mesh.dp, self.mesh.a
        self.owned = []
        for lo, hi in self.buckets:
            c0, c1 = _bounds(hi - lo, dp)[(a + 1) % dp]
            self.owned.append((lo + c0, lo + c1))
        self.shard_offsets, o = [], 0
        for lo, hi in self.owned:
            self.shard_offsets.append(o)
            o += hi - lo
        self.shard_len = o
        # the backward pieces in order, and for each bucket the piece after which every
        # gradient in it is final (wte: the embedding's backward on the first stage, the
        # head's on a last stage that is not first; it is a bucket of its own)
        pieces = (["head"] if self.last else []) + [f"h{l}" for l in reversed(self.layers)] \
            + (["embed"] if self.first else [])
        writer = {f"h{l}": f"h{l}" for l in self.layers}
        writer.update(head="head", wpe="embed", wte="embed" if self.first else "head")
        self._bucket_lo = sorted((lo, i) for i, (lo, _) in enumerate(self.buckets))
        self.bucket_piece = [0] * len(self.buckets)
        for u in self.units.values():
            for k in u.keys:
                if math.prod(self.shapes[k]):
                    i = self._bucket_of(self.offsets[k])
                    self.bucket_piece[i] = max(self.bucket_piece[i],
                                               pieces.index(writer[u.name]))

    def _bucket_of(self, offset: int) -> int:
        """Index (in ``self.buckets``) of the bucket holding flat item ``offset``."""
        j = bisect.bisect_right(self._bucket_lo, (offset, len(self.buckets))) - 1
        return self._bucket_lo[j][1]

    def _buckets(self) -> list[tuple[int, int]]:
        """Flat ranges in backward order: units under ZeRO-3, otherwise runs of whole
        parameters of about ``bucket_bytes`` that never join ``wte`` to anything."""
        units = list(self.units.values())[::-1]
        if self.zero == 3:
            return [(u.start, u.stop) for u in units if u.stop > u.start]
        item = np.dtype(self.config.dtype).itemsize
        out, cur = [], None
        for u in units:
            alone = u.name == "wte"
            if alone and cur:
                out.append(cur)
                cur = None
            for k in reversed(u.keys):
                lo = self.offsets[k]
                hi = lo + math.prod(self.shapes[k])
                cur = (lo, hi) if cur is None else (lo, cur[1])
                if (cur[1] - cur[0]) * item >= self.bucket_bytes:
                    out.append(cur)
                    cur = None
            if alone and cur:
                out.append(cur)
                cur = None
        if cur:
            out.append(cur)
        return [b for b in out if b[1] > b[0]]

    def _views(self, flat, base: int, keys) -> dict:
        return {k: flat[self.offsets[k] - base:self.offsets[k] - base
                        + math.prod(self.shapes[k])].reshape(self.shapes[k]) for k in keys}

    def pack(self, arrays: dict, out=None):
        """This stage's arrays (local, tensor-sharded layout; e.g. ``shard()`` of serial
        params or grads) in the flat layout, ``(n,)``."""
        if out is None:
            out = self.xp.empty(self.n, dtype=self.config.dtype)
        for k in self.keys:
            o = self.offsets[k]
            out[o:o + math.prod(self.shapes[k])] = self.xp.asarray(arrays[k]).reshape(-1)
        return out

    def key_ranges(self) -> dict:
        """``{key: (start, stop)}`` in the flat layout."""
        return {k: (o, o + math.prod(self.shapes[k])) for k, o in self.offsets.items()}

    def load_state(self, params: dict, m: dict | None = None, v: dict | None = None,
                   step: int = 0) -> None:
        """Set the parameters this rank holds, and Adam's moments after ``step`` steps
        (none: a fresh optimizer), from serial-layout dicts (the same on every rank;
        collective over the tensor grid, as ``shard`` is). The harness starts every
        checked step from the reference's state this way, so that each step is held to
        its own rounding (:mod:`summasim.harness.composed`)."""
        def flat(arrays):         # any float dtype: sharded as it is, packed in ours
            dtype = next(iter(arrays.values())).dtype
            config = dataclasses.replace(self.config, dtype=dtype)
            local = self.module.shard(arrays, config, self.grid, self.keys)
            return self.pack(to_backend(getattr(self.mesh, "backend", None), local))

        full = flat(params)
        if self.zero < 3:
            self.flat[...] = full
        else:
            for (lo, hi), o in zip(self.owned, self.shard_offsets):
                self.shard[o:o + hi - lo] = full[lo:hi]
        del full
        self.opt.state = {}             # the old moments go before the new ones come
        if m is None:
            return
        state = {"flat": {"step": int(step)}} if self.zero == 0 else {
            i: {"step": int(step)} for i, (lo, hi) in enumerate(self.owned) if hi > lo}
        for name, arrays in (("m", m), ("v", v)):
            full = flat(arrays)
            if self.zero == 0:
                state["flat"][name] = full
            else:
                for i, st in state.items():
                    lo, hi = self.owned[i]
                    st[name] = full[lo:hi].copy()
            del full
        self.opt.state = state

    # -- what this rank holds --------------------------------------------------
    def held_params(self) -> list[tuple[int, int, object]]:
        """``[(start, stop, values)]``: all parameters (ZeRO 0-2) or the owned chunks."""
        if self.zero < 3:
            return [(0, self.n, self.flat)]
        return [(lo, hi, self.shard[o:o + hi - lo])
                for (lo, hi), o in zip(self.owned, self.shard_offsets)]

    def held_grads(self) -> list[tuple[int, int, object]]:
        """The summed gradients this rank holds after :meth:`step` (before the update
        they fed): all of them (ZeRO 0) or the owned chunks (ZeRO 1-3; under ZeRO 1 the
        rest of the full gradient buffer holds partial sums)."""
        if self.zero == 0:
            return [(0, self.n, self.grad)]
        return [(lo, hi, self.grad[lo:hi] if self.zero == 1 else self.gshard[o:o + hi - lo])
                for (lo, hi), o in zip(self.owned, self.shard_offsets)]

    def state_bytes(self) -> dict:
        """Bytes of model state held between steps: parameters, gradients and Adam's
        two moments (measured from the arrays this rank keeps)."""
        params = self.flat.nbytes if self.zero < 3 else self.shard.nbytes
        grads = self.grad.nbytes if self.zero < 2 else self.gshard.nbytes
        opt = sum(st["m"].nbytes + st["v"].nbytes for st in self.opt.state.values())
        return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
                "total": int(params + grads + opt)}

    # -- ZeRO-3 gathers ----------------------------------------------------------
    def _gather(self, names) -> dict:
        """Parameters of units ``names`` (ZeRO-3: all-gathered now; else views)."""
        keys = [k for nm in names for k in self.units[nm].keys]
        if self.zero < 3:
            return {k: self.params[k] for k in keys}
        out = {}
        dp_comm = self.mesh.dp_comm
        self._gathered = []                    # the unit buffers, for _detach/_attach
        for nm in names:
            u = self.units[nm]
            if u.stop == u.start:              # zero-size (e.g. Optimus rows i > 0)
                out.update(self._views(self.shard[:0], u.start, u.keys))
                continue
            idx = self.buckets.index((u.start, u.stop))
            lo, hi = self.owned[idx]
            o = self.shard_offsets[idx]
            buf = self.xp.empty(u.stop - u.start, dtype=self.config.dtype)     # (unit,)
            buf[lo - u.start:hi - u.start] = self.shard[o:o + hi - lo]
            with self.trace.phase("zero.gather"):
                ring_allgather_unchecked(buf, dp_comm)
            self._gathered.append(buf)
            out.update(self._views(buf, u.start, u.keys))
        return out

    def _detach(self, cache):
        """ZeRO-3: ``cache`` with every array that views a just-gathered unit buffer
        replaced by a :class:`_Ref` to it (offset, shape, strides), so the gathered
        parameters are dropped after the forward piece and re-gathered for its backward
        (:meth:`_attach`), instead of living in the caches of every micro-batch in flight."""
        if self.zero < 3 or not self._gathered:
            return cache
        bufs = [(i, _ptr(b), b.nbytes) for i, b in enumerate(self._gathered)]
        self._gathered = []
        return _map_arrays(cache, lambda a: _ref_of(a, bufs))

    @staticmethod
    def _attach(cache, bufs):
        """``cache`` with each :class:`_Ref` made a view of ``bufs`` again."""
        return _map_arrays(cache, lambda a: a, lambda r: r.view(bufs))

    def _head_units(self) -> tuple:
        return ("head", "wte") if self.lm else ("head",)

    # -- one micro-batch ---------------------------------------------------------
    def _forward(self, j, tok, tgt, n_items, sends):
        cfg, grid, mod, pp = self.config, self.grid, self.module, self.mesh.pp_comm
        shape = activation_shape(self.spec.grid_kind, cfg, grid, tok.shape[0], tok.shape[1])
        caches = []
        x = None
        if not self.first:
            x = self.xp.empty(shape, dtype=cfg.dtype)
            with self.trace.phase("pp.fwd"):
                pp.recv(x, self.mesh.s - 1, tag=2 * j)
        else:
            x, c = mod.embed_forward(self._gather(("wte", "wpe")), tok, cfg, grid)
            caches.append(self._detach(c))
        for l in self.layers:
            p = self._gather((f"h{l}",))
            x, c = mod.layer_forward(x, {k: p[f"h{l}.{k}"] for k in BLOCK_KEYS}, l, cfg,
                                     grid, checkpoint=self.checkpoint)
            del p
            caches.append(self._detach(c))
        loss = 0.0
        if self.last:
            loss, c = mod.head_forward(x, self._gather(self._head_units()), tgt, cfg, grid,
                                       n_items=n_items)
            caches.append(self._detach(c))
        else:
            x = self.xp.ascontiguousarray(x)
            if tuple(x.shape) != shape:
                raise RuntimeError(f"stage {self.mesh.s} output {tuple(x.shape)}, expected "
                                   f"{shape}")
            with self.trace.phase("pp.fwd"):
                sends.append((pp.isend(x, self.mesh.s + 1, tag=2 * j), x))
        return caches, loss

    def _backward(self, j, caches, grads, shape, sends):
        """One micro-batch's backward, piece by piece. ``grads`` is the flat gradient
        buffer to accumulate into (ZeRO 0-1) or a :class:`_BucketGrads` (ZeRO 2-3),
        told after each piece which buckets are final."""
        mod, pp = self.module, self.mesh.pp_comm
        caches = list(caches)
        piece = 0

        def add(g: dict, prefix: str = ""):
            nonlocal piece
            for k, v in g.items():
                key = prefix + k
                o = self.offsets[key]
                if isinstance(grads, _BucketGrads):
                    grads.add(o, v.reshape(-1))
                else:
                    grads[o:o + v.size] += v.reshape(-1)
            if isinstance(grads, _BucketGrads):
                grads.done(piece)
            piece += 1

        if self.last:
            self._refresh(caches, self._head_units())
            dx, g = mod.head_backward(caches.pop())
            add(g)
        else:
            dx = self.xp.empty(shape, dtype=self.config.dtype)
            with self.trace.phase("pp.bwd"):
                pp.recv(dx, self.mesh.s + 1, tag=2 * j + 1)
        for l in reversed(self.layers):
            self._refresh(caches, (f"h{l}",))
            dx, g = mod.layer_backward(dx, caches.pop())
            add(g, f"h{l}.")
        if self.first:              # the embedding's backward reads no weight
            add(mod.embed_backward(dx, self._attach(caches.pop(), [])))
        else:
            dx = self.xp.ascontiguousarray(dx)
            with self.trace.phase("pp.bwd"):
                sends.append((pp.isend(dx, self.mesh.s - 1, tag=2 * j + 1), dx))

    def _refresh(self, caches, names) -> None:
        """ZeRO-3: gather units ``names`` again for a backward piece and put the fresh
        buffers where :meth:`_detach` took the forward's out of its cache."""
        if self.zero < 3:
            return
        self._gather(names)
        bufs, self._gathered = self._gathered, []
        caches[-1] = self._attach(caches[-1], bufs)

    # -- the step ------------------------------------------------------------------
    def step(self, tokens, targets) -> float:
        """One training step on the GLOBAL batch ``tokens``/``targets`` [B, s] (the same
        on every rank): forward and backward of every micro-batch in schedule order,
        the gradient reduction, the tied-embedding sum, Adam. Returns the mean loss over
        the B * s tokens (B sequences for classification), the same on every rank."""
        cfg, mesh = self.config, self.mesh

        def local():
            model.check_tokens(tokens, cfg)
            model.check_targets(targets, tokens, cfg)
            B = tokens.shape[0]
            if B % (mesh.dp * self.m):
                raise ValueError(f"global batch {B} is not divisible by dp * microbatches "
                                 f"= {mesh.dp} * {self.m}")

        # one small agreement (untraced; off under mpiutil.agreement(False)): tokens or
        # targets that are bad or different on one rank raise on every rank alike
        _, err = local_error(local)
        agree("composed.step", mesh.world, lambda: {"tokens": fingerprint(tokens),
                                                    "targets": fingerprint(targets)}, err)
        if self.xp is not np:                  # the batch on the parameters' device
            tokens, targets = self.xp.asarray(tokens), self.xp.asarray(targets)
        B, seq = tokens.shape[0], tokens.shape[1]
        per = B // (mesh.dp * self.m)
        n_items = B if cfg.n_classes else B * seq
        shape = activation_shape(self.spec.grid_kind, cfg, self.grid, per, seq)
        if self.zero < 2:
            self.grad[...] = 0
        else:
            self.gshard[...] = 0
        caches, sends, loss = {}, [], 0.0
        for op, j in schedule(self.kind, self.m, mesh.pp, mesh.s):
            rows = slice((mesh.a * self.m + j) * per, (mesh.a * self.m + j + 1) * per)
            if op == "F":
                caches[j], lj = self._forward(j, tokens[rows], targets[rows], n_items, sends)
                loss += lj
                self.max_inflight = max(self.max_inflight, len(caches))
                continue
            # ZeRO 2-3: this micro-batch's gradient lives bucket by bucket, each
            # reduce-scattered into the shard as soon as the backward has finished it
            buf = self.grad if self.zero < 2 else _BucketGrads(self)
            self._backward(j, caches.pop(j), buf, shape, sends)
            sends = self._reap(sends)
        for req, _ in sends:
            req.wait()
        if self.zero < 2:
            with self.trace.phase("dp.grads"):
                for lo, hi in self.buckets:
                    if self.zero == 0:
                        ring_allreduce_unchecked(self.grad[lo:hi], mesh.dp_comm,
                                                 out=self.grad[lo:hi])
                    else:          # ZeRO 1 updates only the owned chunk: its sum is enough
                        ring_reduce_scatter_unchecked(self.grad[lo:hi], mesh.dp_comm)
        self._tie()
        self._update()
        self.steps += 1
        return self._global_loss(loss)

    @staticmethod
    def _reap(sends):
        """Drop completed sends (their buffers may go)."""
        return [(r, b) for r, b in sends if not r.test()]

    def _reduce_scatter(self, i: int, buf) -> None:
        """Reduce-scatter bucket ``i`` (``buf``: one micro-batch's gradient of its items)
        over dp and add the owned chunk's sum to the gradient shard."""
        lo = self.buckets[i][0]
        (olo, ohi), o = self.owned[i], self.shard_offsets[i]
        with self.trace.phase("dp.grads"):
            ring_reduce_scatter_unchecked(buf, self.mesh.dp_comm)
            self.gshard[o:o + ohi - olo] += buf[olo - lo:ohi - lo]

    def _tie(self) -> None:
        """Sum the two copies of the tied embedding's gradient (first and last stage)."""
        emb = self.mesh.embed
        if emb is None or not self.lm:
            return
        u = self.units["wte"]
        with self.trace.phase("embed.tie"):
            if self.zero == 0:
                g = self.grad[u.start:u.stop]
            else:                              # only the owned chunk is summed over dp
                idx = self.buckets.index((u.start, u.stop))
                lo, hi = self.owned[idx]
                o = self.shard_offsets[idx]
                g = self.grad[lo:hi] if self.zero == 1 else self.gshard[o:o + hi - lo]
            ring_allreduce_unchecked(g, emb, out=g)

    def _update(self) -> None:
        dp_comm = self.mesh.dp_comm
        if self.zero == 0:
            self.opt.step({"flat": self.flat}, {"flat": self.grad})
            return
        params, grads = {}, {}
        for i, ((lo, hi), o) in enumerate(zip(self.owned, self.shard_offsets)):
            if hi == lo:
                continue
            params[i] = self.flat[lo:hi] if self.zero < 3 else self.shard[o:o + hi - lo]
            grads[i] = self.grad[lo:hi] if self.zero < 2 else self.gshard[o:o + hi - lo]
        self.opt.step(params, grads)
        if self.zero in (1, 2):
            with self.trace.phase("zero.params"):
                for lo, hi in self.buckets:
                    ring_allgather_unchecked(self.flat[lo:hi], dp_comm)

    def _global_loss(self, loss: float) -> float:
        """The step's loss on every rank: summed over the replicas on the last stage,
        then broadcast along the pipeline (phase ``aux.loss``, 8-byte messages)."""
        mesh = self.mesh
        buf = np.array([loss if self.last else 0.0])
        with self.trace.phase("aux.loss"):
            if mesh.dp > 1:
                mesh.dp_comm.allreduce(buf)
            if mesh.pp > 1:
                mesh.pp_comm.bcast(buf, root=mesh.pp - 1)
        return float(buf[0])

    # -- closed forms -------------------------------------------------------------
    def expected_traffic(self, batch: int, seq: int) -> dict:
        """Bytes this rank sends per step in each phase, from the sizes alone:
        ``dp.grads``, ``zero.params``, ``zero.gather``, ``embed.tie``, ``pp.fwd``,
        ``pp.bwd`` (see the module docstring), for a global batch of ``batch``."""
        mesh, m = self.mesh, self.m
        item = np.dtype(self.config.dtype).itemsize
        dp, a = mesh.dp, mesh.a
        sizes = [hi - lo for lo, hi in self.buckets]
        out = dict.fromkeys(("dp.grads", "zero.params", "zero.gather", "embed.tie",
                             "pp.fwd", "pp.bwd"), 0)
        if self.zero == 0:
            out["dp.grads"] = sum(ring_send_items(n, dp, a, "ar") for n in sizes)
        elif self.zero == 1:
            out["dp.grads"] = sum(ring_send_items(n, dp, a, "rs") for n in sizes)
        else:
            out["dp.grads"] = m * sum(ring_send_items(n, dp, a, "rs") for n in sizes)
        if self.zero in (1, 2):
            out["zero.params"] = sum(ring_send_items(n, dp, a, "ag") for n in sizes)
        if self.zero == 3:
            uses = []                        # units read by each piece, forward + backward
            if self.first:
                uses += ["wte", "wpe"]                              # embedding forward only
            uses += [f"h{l}" for l in self.layers] * 2
            if self.last:
                uses += list(self._head_units()) * 2
            out["zero.gather"] = m * sum(ring_send_items(
                self.units[u].stop - self.units[u].start, dp, a, "ag") for u in uses)
        if mesh.embed is not None and self.lm:
            u = self.units["wte"]
            n = u.stop - u.start
            if self.zero >= 1:
                c0, c1 = _bounds(n, dp)[(a + 1) % dp]
                n = c1 - c0
            out["embed.tie"] = ring_send_items(n, 2, mesh.embed.rank, "ar")
        act = math.prod(activation_shape(self.spec.grid_kind, self.config, self.grid,
                                         batch // (dp * m), seq))
        out["pp.fwd"] = m * act if not self.last else 0
        out["pp.bwd"] = m * act if not self.first else 0
        return {k: v * item for k, v in out.items()}

    def model_params(self) -> int:
        """Parameters of this rank's stage without ZeRO (its tensor shards)."""
        return self.n

