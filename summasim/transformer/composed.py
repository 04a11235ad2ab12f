"""Sharded training: data, pipeline and ZeRO parallelism composed with tensor parallelism.

A :class:`~summasim.grid.Mesh` ``[dp, pp, tensor grid]`` runs one training step of the
GPT-2 model of :mod:`model` as follows (rank at replica ``a``, stage ``s``):

Pipeline (``pp`` stages, ``V`` model chunks each)
    The layers are cut into ``pp V`` contiguous virtual stages by
    :func:`summasim.spec.stage_layers` (the even split, or ``stages`` layers each; a
    virtual stage may hold no layer). Virtual stage ``k = c pp + s`` is model chunk
    ``c`` of stage ``s`` (``V = 1`` except under the interleaved schedule, Narayanan
    et al. 2021, section 2.2.2). Virtual stage 0 (chunk 0 of stage 0) also runs the
    embedding, the last one (chunk ``V - 1`` of stage ``pp - 1``) the final LayerNorm,
    the tied LM head and the loss; with ``pp > 1`` the last stage holds its own copy of
    ``wte`` and the two copies' gradients are summed over ``mesh.embed`` (a ring
    all-reduce between the two stages, phase ``embed.tie``), as Megatron-LM does with
    its embedding group. Each replica's batch is cut into ``m`` micro-batches;
    activations go from virtual stage ``k`` to ``k + 1`` (stage ``s`` to ``(s + 1) %
    pp``: the last stage hands chunk ``c`` on to chunk ``c + 1`` of stage 0) and their
    gradients back, point to point over ``mesh.pp_comm`` (phases ``pp.fwd``,
    ``pp.bwd``; non-blocking sends, blocking receives, tag ``2 (j V + c) + 0|1`` for
    micro-batch j arriving at chunk c, forward|backward) in the order of
    :func:`~summasim.transformer.schedules.schedule` ("gpipe": every forward, then every backward; "1f1b": ``pp - s -
    1`` warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards; "interleaved": Megatron-LM's interleaved 1F1B over the ``m V``
    micro-batch chunks). Every micro-batch's loss is divided by the token count of the
    whole global batch, so the gradients summed over micro-batches and replicas are
    the full-batch gradient.

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

Overlap (``overlap=True``)
    The data-parallel reduction of each bucket starts as soon as its gradients are
    final, as a non-blocking ring (:func:`~summasim.algorithms.allreduce.ring_start`)
    advanced by ``MPI_Test`` calls between the pieces of the backward (and forward):
    under ZeRO 0-1 when every micro-batch has run the bucket's last writing piece (in
    the last micro-batch's backward), under ZeRO 2-3 each micro-batch's reduce-scatter
    of the bucket (PyTorch DDP's buckets, Li et al. 2020, section 3.2.3; Megatron-LM's
    ``overlap_grad_reduce``). The rings are queued in bucket order, up to
    :data:`OVERLAP_RINGS` in flight at once (each on its own tag; at most
    :data:`OVERLAP_QUEUE` queued), and finished after the last backward.
    The same rings, bytes (phase ``dp.grads``) and additions in the same order: the
    parameters are bitwise those of the blocking path.

The replica audit (:meth:`Trainer.audit`)
    After a step every replicated tensor must be bit-identical on each of its replicas:
    over dp the parameters (ZeRO 0-2; under ZeRO 0 Adam's moments too) or, under
    ZeRO-3, every unit the step all-gathered; over the tensor group the parameters the
    scheme replicates (:meth:`Trainer.tensor_replicated`); over the first and last stage
    the tied ``wte``. One blake2b digest per group, all-gathered over it (untraced).

The tensor-parallel scheme runs piece by piece through its module's ``embed_forward``,
``layer_forward``, ``head_forward`` and their backwards (see ``docs/transformer.md``).
:meth:`Trainer.expected_traffic` gives the closed form of every phase above for this
rank, and :meth:`Trainer.state_bytes` the bytes of model state it holds.

References
----------
Huang et al. (2019), "GPipe", arXiv:1811.06965. Narayanan et al. (2021), "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (1F1B
and its interleaved form, section 2.2; Megatron-LM's
``forward_backward_pipelining_with_interleaving``). Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198
(the activations an interleaved stage holds).
Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20. Li et al. (2020), "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB (gradient buckets in backward order).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections import deque

import numpy as np

from ..algorithms.allreduce import (NONBLOCKING_TAG, _bounds, ring_allgather_unchecked,
                                    ring_allreduce_unchecked, ring_reduce_scatter_unchecked,
                                    ring_start)
from ..backends import array_module, to_backend
from ..mpiutil import agree, allgather_objects, fields_of, fingerprint, local_error
from ..spec import stage_layers
from . import model
from . import ops
from .ops import block_keys
from .optimus import column_cut
from .replicas import ReplicaSet, Unit, _clip, _host_bytes, _merge, common_spans
from .schedules import check_schedule, hand_off_tag, schedule
from .precision import LossScaler, Precision, bits_adder, has_overflow, pack_bits, unpack_bits
from .train import Adam

ZERO_STAGES = (0, 1, 2, 3)
#: PyTorch DDP's default bucket (``bucket_cap_mb=25``, Li et al. 2020).
DEFAULT_BUCKET_BYTES = 25 << 20
#: The largest tag every MPI library accepts (the standard's MPI_TAG_UB is at least
#: 32767).
MPI_TAG_FLOOR = 32767
#: Overlapped reductions (``overlap=True``) in flight at once, each on its own tag and
#: receive workspace; and queued at most (in flight or not yet started), beyond which
#: the oldest is finished first, so that at most this many buckets' buffers wait.
OVERLAP_RINGS = 4
OVERLAP_QUEUE = 8


# --------------------------------------------------------------------------- #
# pure helpers                                                                #
# --------------------------------------------------------------------------- #
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
                     seq: int, sequence_parallel: bool = False) -> tuple:
    """The local shape of the activation between two layers for a micro-batch of
    ``batch`` sequences: (b, s, h) replicated (1D), (b, s/t, h) under Megatron's
    sequence parallelism, (b/(d pr), s, h_j) (2D / 2.5D on [pr, pc, d]; the 3D cube's
    pr = pc = d = q), where h_j is this rank's column of the hidden size: whole heads
    (``optimus.column_cut``), h/pc when pc divides the key/value heads."""
    if grid_kind == "1d":
        return (batch, seq // grid.p if sequence_parallel else seq, config.hidden)
    cut = column_cut(config, grid.pc)
    return (batch // (grid.d * grid.pr), seq, cut[grid.j + 1] - cut[grid.j])


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
        self.piece = 0                  # backward pieces run so far, over every chunk

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
    schedule : {"gpipe", "1f1b", "interleaved"}
        The pipeline schedule (:func:`schedule`).
    microbatches : int
        Micro-batches per replica per step (a multiple of ``pp`` when interleaved).
    chunks : int
        Model chunks per stage, V: 1, or ``V >= 2`` with ``schedule="interleaved"``
        (stage ``s`` runs virtual stages ``c pp + s``, ``c = 0..V-1``).
    stages : sequence of int, optional
        Layers per (virtual) stage in pipeline order, ``pp V`` entries summing to the
        model's layers, 0 allowed (:func:`summasim.spec.stage_layers`); None: the even
        split.
    checkpoint : bool
        Recompute each layer in backward from its saved input (``recompute="full"``).
    recompute : {"none", "selective", "full"}, optional
        Activation recompute (default: "full" with ``checkpoint``, else "none");
        "selective" recomputes only the attention core's probabilities.
    attention : {"plain", "flash"}
        The attention core: plain, or blockwise with an online softmax.
    sequence_parallel : bool
        Megatron's sequence parallelism (1D tensor grids): the pieces hand on (b, s/t, h)
        and the sequence-parallel parameters' gradients are summed over the tensor group
        once per step (phase ``sp.grads``): ZeRO 0-1 the whole of them, ZeRO 2-3 the parts
        of them in the owned chunks, after the per-micro-batch reduce-scatters over dp
        (both sums are linear). Those chunks are the same flat ranges on every rank of the
        tensor group, however unevenly it cuts its shards (:meth:`_slots`).
    bucket_bytes : int
        Target size of a gradient bucket (ZeRO 0-2).
    overlap : bool
        Reduce each gradient bucket over dp with a non-blocking ring as soon as the
        backward has finished it, advanced between backward (and forward) pieces,
        instead of with a blocking ring (ZeRO 0-1: after the last backward; ZeRO 2-3:
        per micro-batch). The same rings, bytes and sums, bitwise; whether it pays:
        "Overlap and the replica audit" in ``docs/sharded-training.md``.
    precision : {None, "bfloat16", "float16"}
        Mixed precision (``config.dtype`` float32): the forward and backward compute on
        16-bit values (:func:`~summasim.transformer.ops.autocast`; the tensor schemes'
        sums are rounded too) with a 16-bit compute copy of the fp32 master weights;
        Adam updates the fp32 master weights (ZeRO 0: all of them; ZeRO 1-3: the owned
        chunks, Adam's state) and the compute copy follows. The pipeline hand-offs and
        the ZeRO parameter all-gathers send 16-bit messages (2 bytes per item).
    loss_scale : str, optional
        ``none``, ``static:S`` or ``dynamic`` (:class:`~summasim.transformer.precision.
        LossScaler`; default: none for bfloat16, dynamic for float16). The backward is
        seeded with S/n; after the reductions every rank votes on Inf/NaN in the
        gradients it holds (one all-reduce over the mesh, phase ``aux.overflow``): an
        overflow anywhere skips the step on every rank (:attr:`skipped`), otherwise the
        gradients are divided by S before Adam.
    grad_reduce : {"float32", "bfloat16", "float16"}
        The gradients' type under mixed precision: float32 (they accumulate over the
        micro-batches and are reduced over dp in fp32, Megatron-LM's fp32 ``main_grad``),
        or 16-bit: they accumulate in 16 bits (each sum rounded) and the ring adds in 16
        bits (2-byte messages; overlapped or not), so they cost 2 bytes per parameter
        (the 2 + 2 + 12 of the ZeRO paper).
    lr, betas, eps :
        Adam (no weight decay: the flat shards carry no per-tensor decay mask).
    """

    def __init__(self, params: dict, config: model.Config, mesh, spec, *, zero: int = 0,
                 schedule: str = "1f1b", microbatches: int = 1, chunks: int = 1,
                 stages=None, checkpoint: bool = False, recompute: str | None = None,
                 attention: str = "plain", sequence_parallel: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False,
                 precision: str | None = None, loss_scale: str | None = None,
                 grad_reduce: str = "float32",
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        stages = None if stages is None else tuple(int(x) for x in stages)
        recompute = recompute or ("full" if checkpoint else "none")
        if precision is not None and loss_scale is None:
            loss_scale = "dynamic" if precision == "float16" else "none"
        grad_reduce = grad_reduce or "float32"

        def local():
            if zero not in ZERO_STAGES:
                raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
            if microbatches < 1 or bucket_bytes < 1:
                raise ValueError(f"microbatches and bucket_bytes must be positive, got "
                                 f"{microbatches} and {bucket_bytes}")
            check_schedule(schedule, microbatches, mesh.pp, chunks)
            if schedule == "interleaved" and mesh.pp < 2:
                raise ValueError(f"interleaved:{chunks} needs pp >= 2 stages, the mesh has "
                                 f"pp = {mesh.pp}")
            if hand_off_tag(microbatches - 1, chunks - 1, chunks, True) > MPI_TAG_FLOOR:
                raise ValueError(f"m V = {microbatches} * {chunks} micro-batch chunks need "
                                 f"tags up to {2 * microbatches * chunks - 1}, above MPI's "
                                 f"guaranteed {MPI_TAG_FLOOR}")
            if spec.grid_kind != mesh.kind:
                raise ValueError(f"scheme {spec.name} runs on a {spec.grid_kind} grid, the "
                                 f"mesh has a {mesh.kind} tensor grid")
            stage_layers(config.layers, mesh.pp, stages, chunks)
            if recompute not in ("none", "selective", "full") or (
                    checkpoint and recompute != "full"):
                raise ValueError(f"recompute must be none, selective or full (checkpoint is "
                                 f"full), got {recompute!r} with checkpoint={checkpoint}")
            if attention not in ("plain", "flash"):
                raise ValueError(f"attention must be plain or flash, got {attention!r}")
            if sequence_parallel and spec.grid_kind != "1d":
                raise ValueError(f"sequence parallelism splits Megatron's 1D groups; "
                                 f"{spec.name} already splits every activation")
            if precision is not None:
                Precision.of(precision)
                if np.dtype(config.dtype) != np.float32:
                    raise ValueError(f"mixed precision keeps fp32 master weights: the config's "
                                     f"dtype must be float32, got {np.dtype(config.dtype).name}")
                LossScaler(loss_scale)
            elif loss_scale not in (None, "none") or grad_reduce != "float32":
                raise ValueError(f"loss scaling and a 16-bit gradient reduction need mixed "
                                 f"precision (precision bfloat16 or float16), got "
                                 f"loss_scale={loss_scale!r}, grad_reduce={grad_reduce!r}")
            if grad_reduce != "float32":
                Precision.of(grad_reduce)
            model.check_params(params, config)

        # a setting or parameter that is bad (or different) on one rank only raises the
        # same error on every rank of the mesh, before any data moves
        _, err = local_error(local)
        agree("composed.Trainer", mesh.world, lambda: {
            **fields_of(config, "Config"), "scheme": spec.name, "zero": zero,
            "schedule": schedule, "microbatches": microbatches, "chunks": chunks,
            "stages": repr(stages), "checkpoint": bool(checkpoint), "recompute": recompute,
            "attention": attention, "sequence_parallel": bool(sequence_parallel),
            "bucket_bytes": bucket_bytes, "overlap": bool(overlap),
            "precision": repr(precision), "loss_scale": repr(loss_scale),
            "grad_reduce": grad_reduce,
            "Adam": repr((lr, tuple(betas), eps)),
            **{f"params[{k}]": fingerprint(v) for k, v in sorted(params.items())}}, err)
        self.config, self.mesh, self.spec, self.module = config, mesh, spec, spec.module
        self.zero, self.kind, self.m = zero, schedule, int(microbatches)
        self.chunks, self.stages = int(chunks), stages
        self.checkpoint, self.bucket_bytes = recompute == "full", int(bucket_bytes)
        self.recompute, self.attention = recompute, attention
        self.sp = bool(sequence_parallel)
        self._sp_kw = {"sequence_parallel": True} if self.sp else {}
        self.grid = mesh.tensor
        self.trace = mesh.trace
        pp, s, V = mesh.pp, mesh.s, self.chunks
        # the layers of each model chunk c (virtual stage c pp + s), and all of them
        split = stage_layers(config.layers, pp, stages, V)
        self.chunk_layers = [split[c * pp + s] for c in range(V)]
        self.layers = [l for r in self.chunk_layers for l in r]          # ascending
        self.first, self.last = mesh.first, mesh.last    # virtual stage 0 / pp V - 1 here
        self.lm = not config.n_classes
        keys = []
        for c, r in enumerate(self.chunk_layers):        # wte once when both ends are here
            keys += model.stage_keys(config, r, self.first and c == 0,
                                     self.last and c == V - 1)
        keys = list(dict.fromkeys(keys))
        local = self.module.shard(params, config, self.grid, keys)   # agrees over the grid
        backend = getattr(mesh, "backend", None)
        local = to_backend(backend, local)                          # CuPy: on the device
        self._layout(local, keys)
        # a stage of no layer between the ends holds no parameter: the backend names xp
        self.xp = (array_module(local[self.keys[0]]) if self.keys
                   else getattr(backend, "xp", np))
        dtype, n = config.dtype, self.n
        #: mixed precision: the compute type, the loss scaler and the 16-bit reduction
        self.precision = Precision.of(precision) if precision else None
        self.scaler = LossScaler(loss_scale) if precision else None
        self.reduce16 = Precision.of(grad_reduce) if grad_reduce != "float32" else None
        self._add16 = bits_adder(self.reduce16) if self.reduce16 else None
        self.skipped = 0                        # steps skipped on an overflow
        self.applied = True                     # whether the last step updated
        #: a test's hook: at this step (0-based) this rank puts an Inf into the first
        #: gradient it holds, before the overflow vote
        self.inject_overflow_at: int | None = None
        # the parameters: ``flat`` (ZeRO 0-2) is what the pieces compute with, ``shard``
        # the owned chunks (ZeRO-3; and under mixed precision ZeRO 1-2, the fp32 master);
        # mixed ZeRO 0 keeps its fp32 master whole in ``master``, mixed ZeRO-3 its
        # 16-bit compute copy of the owned chunks in ``cshard``
        full = self.pack(local)                                                 # (n,)
        del local
        self.flat = full if zero < 3 else None
        self.params = self._views(self.flat, 0, self.keys) if zero < 3 else None
        self.shard = self.cshard = self.master = None
        if zero == 3 or (self.precision and zero >= 1):
            self.shard = self.xp.concatenate([full[lo:hi] for lo, hi in self.owned]) \
                if self.owned else self.xp.empty(0, dtype=dtype)
        if self.precision:
            if zero == 0:
                self.master = full.copy()
            if zero < 3:
                self.precision.round(self.flat, out=self.flat)
            else:
                self.cshard = self.precision.round(self.shard)
        del full
        most = max([hi - lo for lo, hi in self.buckets] or [0])
        # 16-bit messages: the bits of a bucket (ZeRO 1-3 all-gathers; under ZeRO-3 a
        # bucket is a unit), or of a 16-bit reduction; one workspace, reused
        self._bits = (self.xp.empty(most, dtype=np.uint16)
                      if self.precision and (self.reduce16 or zero >= 1) else None)
        self.grad = self.xp.zeros(n, dtype=dtype) if zero < 2 else None        # (n,)
        self.gshard = self.xp.zeros(self.shard_len, dtype=dtype) if zero >= 2 else None
        self.opt = Adam(lr=lr, betas=betas, eps=eps)
        self.max_inflight = 0
        self.steps = 0
        self._gathered = []
        # overlap: the reductions queued in bucket order ([buf, half, then, ring]), one
        # ring in flight at a time on one preallocated receive workspace
        self.overlap = bool(overlap) and mesh.dp > 1
        self._queue: deque = deque()
        self._ring_work = [self.xp.empty(-(-most // mesh.dp),
                                         dtype=np.uint16 if self.reduce16 else dtype)
                           for _ in range(OVERLAP_RINGS if self.overlap else 0)]
        self._rings_started = 0                   # rings started in the step: tag, work
        self._mb_piece: dict = {}                 # ZeRO 0-1 overlap: pieces run, per j
        self._piece_runs = [0] * self._n_pieces   # micro-batches past each piece
        self._next_final = 0                      # the next bucket to become final
        #: ZeRO-3: digest what every gather of the step delivered (the replica audit's
        #: dp evidence, :meth:`replica_sets`); costs a hash of each gathered unit
        self.audit_gathers = False
        self._gather_hash, self._gather_hashed = None, 0
        #: overlap: the step's rings finished while the step computed (between pieces)
        #: and those finished by waiting (the queue's limit, or after the last backward),
        #: and the backward pieces of the step still to run when each was queued, summed
        self.rings = {"in_flight": 0, "waited": 0, "pieces_left": 0}
        self._pieces_run = 0

    # -- layout --------------------------------------------------------------
    def _layout(self, local: dict, keys: list) -> None:
        cfg = self.config
        units = []
        if self.first:
            units += [("wte", ("wte",)), ("wpe", ("wpe",))]
        for l in self.layers:
            units.append((f"h{l}", tuple(f"h{l}.{k}" for k in block_keys(cfg.mlp))))
        if self.last:
            head = ("lnf.g", "lnf.b") + (("cls.w", "cls.b") if cfg.n_classes else ()) + \
                (("head.w",) if self.lm and not cfg.tied else ())
            units.append(("head", head))
            if self.lm and cfg.tied and not self.first:
                units.append(("wte", ("wte",)))
        order = [k for _, ks in units for k in ks]
        assert sorted(order) == sorted(keys), (order, keys)   # one stage layout, two views
        self.keys = order
        self.shapes = {k: tuple(local[k].shape) for k in order}
        self.slots = self._slots(order)
        self.offsets, off = {}, 0
        for k in order:
            self.offsets[k] = off
            off += self.slots[k]
        self.n = off
        self.units = {}
        for name, ks in units:
            start = self.offsets[ks[0]]
            stop = self.offsets[ks[-1]] + self.slots[ks[-1]]
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
        self._n_pieces = len(pieces)
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

    def _slots(self, keys: list) -> dict:
        """``{key: items}`` each key takes in the flat layout: under Megatron and the 3D
        layer, the most any rank of the tensor grid holds of it (one untraced all-gather
        of the local sizes); elsewhere the rank's own. Every rank of a Megatron group or
        a 3D cube then lays its stage out alike, however the scheme cuts its shards
        (heads, the MLP width or the hidden size not divisible by the grid): a key
        replicated over the grid sits at one offset, in one bucket and one ZeRO chunk on
        each of them, so that its data-parallel sum adds in one order everywhere (over 3
        or more replicas the order rounds) and sequence parallelism sums its owned parts
        over the tensor group item for item. A smaller shard is followed by zeros that no
        piece reads or writes: their gradients are 0 and Adam keeps them 0 (as Megatron-LM
        pads the vocabulary to a multiple of the tensor group)."""
        sizes = tuple(math.prod(self.shapes[k]) for k in keys)
        world = self.grid.world
        # only Megatron's group and the 3D cube replicate a parameter over ranks that
        # hold other shards; Optimus and SUMMA2.5 keep their row vectors on one row
        # (the others would hold whole slots of zeros) and their depth copies alike
        if world.size > 1 and self.spec.grid_kind in ("1d", "3d"):
            every = allgather_objects(world.mpi, sizes, world.wait_policy)
            sizes = tuple(max(col) for col in zip(*every))
        return dict(zip(keys, sizes))

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
                hi = lo + self.slots[k]
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
            o, n = self.offsets[k], math.prod(self.shapes[k])
            out[o:o + n] = self.xp.asarray(arrays[k]).reshape(-1)
            out[o + n:o + self.slots[k]] = 0                  # the pad (:meth:`_slots`)
        return out

    def key_ranges(self) -> dict:
        """``{key: (start, stop)}`` in the flat layout."""
        return {k: (o, o + math.prod(self.shapes[k])) for k, o in self.offsets.items()}

    def pad_ranges(self) -> dict:
        """``{key: (start, stop)}`` of the zeros after each key's shard in its slot
        (:meth:`_slots`), for the keys that have any."""
        out = {}
        for k, o in self.offsets.items():
            lo, hi = o + math.prod(self.shapes[k]), o + self.slots[k]
            if hi > lo:
                out[k] = (lo, hi)
        return out

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
        if self.master is not None:
            self.master[...] = full
        if self.shard is not None:
            for (lo, hi), o in zip(self.owned, self.shard_offsets):
                self.shard[o:o + hi - lo] = full[lo:hi]
        if self.flat is not None:
            self.flat[...] = full
        if self.precision:                           # the compute copy follows
            if self.flat is not None:
                self.precision.round(self.flat, out=self.flat)
            else:
                self.precision.round(self.shard, out=self.cshard)
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
        """``[(start, stop, values)]``: all parameters (ZeRO 0-2) or the owned chunks
        (ZeRO-3); under mixed precision the fp32 master weights (ZeRO 0: all of them,
        ZeRO 1-3: the owned chunks)."""
        if self.master is not None:
            return [(0, self.n, self.master)]
        if self.shard is None:
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
        two moments (measured from the arrays this rank keeps). Under mixed precision the
        parameters are the 16-bit compute copy (2 bytes per item: a float32 container
        here), the gradients 16-bit with a 16-bit ``grad_reduce``, and the optimizer
        adds the fp32 master weights."""
        grads = self.grad.nbytes if self.zero < 2 else self.gshard.nbytes
        if self.reduce16:                      # 16-bit gradients in float32 containers
            grads = grads // np.dtype(self.config.dtype).itemsize * self.reduce16.itemsize
        opt = sum(st["m"].nbytes + st["v"].nbytes for st in self.opt.state.values())
        if self.precision:
            compute = self.flat if self.flat is not None else self.cshard
            params = compute.size * self.precision.itemsize
            opt += (self.master if self.master is not None else self.shard).nbytes
        else:
            params = self.flat.nbytes if self.zero < 3 else self.shard.nbytes
        return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
                "total": int(params + grads + opt)}

    # -- the replica audit --------------------------------------------------------
    def tensor_replicated(self) -> tuple:
        """``(comm, keys)``: the tensor-parallel group over which this rank's copies of
        ``keys`` are replicas, and those keys (``(None, [])`` when there is none).
        Megatron (1D over t > 1 ranks): every parameter held whole, as its serial shape
        (the LayerNorms, the biases of the row-parallel layers, ``wpe``, ``lnf``, a
        classifier), over the tensor group. SUMMA2.5-LM (d > 1): every parameter (its
        2D blocks and row-0 vectors are copied over the depth), over ``grid.depth``. The
        3D layer: its vectors (replicated over a plane of the cube; the depth is one of
        its axes), over ``grid.depth``; its weights are held once. Optimus (d = 1) stores
        nothing twice: a row-0 vector lives on row 0 only (its
        column broadcasts are transient), each 2D block on one rank."""
        grid, kind = self.grid, self.spec.grid_kind
        if kind == "1d" and grid.p > 1:
            serial = model.param_shapes(self.config)
            return grid.comm, [k for k in self.keys if self.shapes[k] == tuple(serial[k])]
        if kind == "2.5d" and grid.d > 1:
            return grid.depth, list(self.keys)
        if kind == "3d" and grid.q > 1:      # the vectors, wpe, lnf and a classifier
            return grid.depth, [k for k in self.keys
                                if self.module.role(k) not in ("ab", "ba", "wte")]
        return None, []

    def tensor_planes(self) -> list:
        """``[(name, comm, keys)]``: the 3D layer's replicated vectors over the rest of
        their plane of the cube (:meth:`tensor_replicated` gives the depth): the
        layout-A ones (LayerNorms, the projections' biases, ``wpe``, ``lnf``, a
        classifier) over ``grid.col`` ("tensor.col"), the layout-B ones (the QKV and MLP
        column biases) and ``cls.b`` over ``grid.row`` ("tensor.row"); [] for the other
        schemes."""
        grid = self.grid
        if self.spec.grid_kind != "3d" or grid.q == 1:
            return []
        role = self.module.role
        return [("tensor.col", grid.col, [k for k in self.keys
                                          if role(k) in ("a", "cls.w", "whole")]),
                ("tensor.row", grid.row, [k for k in self.keys if role(k) in ("b", "whole")])]

    def _held_moments(self) -> list:
        """``[(start, stop, {"m": ..., "v": ...})]``: Adam's moments this rank holds."""
        st = self.opt.state
        if self.zero == 0 and "flat" in st:
            return [(0, self.n, st["flat"])]
        return [(lo, hi, st[i]) for i, (lo, hi) in enumerate(self.owned) if i in st]

    def _held_views(self, ranges) -> tuple[list, list]:
        """Views of the parameters and of Adam's moments this rank holds inside flat
        ``ranges`` (sorted), in flat order."""
        params, state = [], []
        for lo, hi, vals in self.held_params():
            for a, b in _clip(ranges, lo, hi):
                params.append(vals[a - lo:b - lo])
        for lo, hi, moments in self._held_moments():
            for a, b in _clip(ranges, lo, hi):
                state += [moments["m"][a - lo:b - lo], moments["v"][a - lo:b - lo]]
        return params, state

    def _keyed_set(self, name: str, comm, keys) -> ReplicaSet:
        """The :class:`ReplicaSet` of ``keys`` over ``comm``, with its ``pieces``: what
        this rank holds of each key, in the key's own items."""
        ranges, pieces = self.key_ranges(), []
        held = [("p", lo, hi, vals) for lo, hi, vals in self.held_params()]
        for lo, hi, moments in self._held_moments():
            held += [("m", lo, hi, moments["m"]), ("v", lo, hi, moments["v"])]
        for k in keys:
            k0, k1 = ranges[k]
            for kind, lo, hi, vals in held:
                for a, b in _clip([(k0, k1)], lo, hi):
                    pieces.append((kind, k, a - k0, b - k0, vals[a - lo:b - lo]))
        return ReplicaSet(name, comm, [p[4] for p in pieces if p[0] == "p"],
                          [p[4] for p in pieces if p[0] != "p"], pieces=pieces)

    def replica_sets(self) -> list[ReplicaSet]:
        """Every group over which this rank holds state that must be bit-identical
        after a step, with views of that state (groups of one rank left out):

        ``dp``          ZeRO 0-2: all the stage's parameters over ``mesh.dp_comm``, and
                        under ZeRO 0 Adam's moments (ZeRO 1-2 partition them);
        ``dp.gathers``  ZeRO-3: nothing persistent is replicated over dp (the owned
                        chunks are disjoint), but every unit each replica all-gathered
                        in the step must be the same bytes: the digest of them all, in
                        order (when :attr:`audit_gathers` was on for the step);
        ``tensor``      the parameters the tensor scheme replicates
                        (:meth:`tensor_replicated`), their held part (ZeRO-3: the owned
                        chunks) and its moments, compared key by key where every
                        rank of the group holds them (:attr:`ReplicaSet.pieces`);
        ``tensor.col``, ``tensor.row``  the 3D layer's vectors over the rest of their
                        plane (:meth:`tensor_planes`);
        ``embed``       with pp > 1, ``wte`` on the first and the last stage (the tied
                        copies, Megatron-LM's embedding group) and its moments.
        """
        mesh, out = self.mesh, []
        everything = [(0, self.n)]
        if mesh.dp > 1 and self.zero < 3:
            params, state = self._held_views(everything)
            if self.shard is not None:         # mixed ZeRO 1-2: the compute copy is whole
                params = [self.flat]
            out.append(ReplicaSet("dp", mesh.dp_comm, params,
                                  state if self.zero == 0 else []))
        elif mesh.dp > 1 and self._gather_hash is not None:
            out.append(ReplicaSet("dp.gathers", mesh.dp_comm,
                                  extra=self._gather_hash.digest(),
                                  extra_nbytes=self._gather_hashed))
        comm, keys = self.tensor_replicated()
        for name, comm, keys in [("tensor", comm, keys)] + self.tensor_planes():
            if comm is not None and comm.size > 1 and keys:
                out.append(self._keyed_set(name, comm, keys))
        if mesh.embed is not None and self.lm and self.config.tied:   # as _tie()
            out.append(self._keyed_set("embed", mesh.embed, ["wte"]))
        return out

    def audit(self) -> dict:
        """The runtime replica audit (collective over the mesh; untraced): the blake2b
        digest of each :meth:`replica_sets` entry, all-gathered over its group.
        Returns ``{name: {"size": ranks, "agree": bool, "nbytes": bytes hashed}}``;
        a replica that drifted by one bit makes ``agree`` False on every rank of its
        group. Costs one hash of the replicated state and, per group, an all-gather of
        8 bytes per rank (and, for a group of :attr:`ReplicaSet.pieces`, one of the
        spans each rank holds, a few per key)."""
        out = {}
        for rs in self.replica_sets():        # the same groups, in the same order
            common = None
            if rs.pieces is not None:          # what every rank of the group holds
                common = common_spans(allgather_objects(rs.comm.mpi, rs.spans(),
                                                        rs.comm.wait_policy))
            mine = rs.digest(common)
            every = allgather_objects(rs.comm.mpi, mine, rs.comm.wait_policy)
            out[rs.name] = {"size": rs.comm.size, "agree": len(set(every)) == 1,
                            "nbytes": rs.nbytes(common)}
        return out

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
            with self.trace.phase("zero.gather"):
                if self.precision:      # the 16-bit compute copy, 2 bytes per item
                    bits = self._bits[:u.stop - u.start]          # the unit is a bucket
                    pack_bits(self.precision, self.cshard[o:o + hi - lo],
                              out=bits[lo - u.start:hi - u.start])
                    ring_allgather_unchecked(bits, dp_comm)
                    unpack_bits(self.precision, bits, out=buf)
                else:
                    buf[lo - u.start:hi - u.start] = self.shard[o:o + hi - lo]
                    ring_allgather_unchecked(buf, dp_comm)
            if self._gather_hash is not None:
                self._gather_hash.update(_host_bytes(buf))
                self._gather_hashed += buf.nbytes
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
        return ("head", "wte") if self.lm and self.config.tied else ("head",)

    # -- one micro-batch on one model chunk ------------------------------------------
    def _neighbours(self, c: int) -> tuple:
        """``(prev, c_prev, next, c_next)``: the stage and chunk of virtual stage ``k -
        1`` and ``k + 1`` for chunk ``c`` (virtual stage ``k = c pp + s``): stage ``s -
        1`` / ``s + 1`` mod pp, the chunk one down after stage 0 / one up after the
        last stage."""
        pp, s = self.mesh.pp, self.mesh.s
        return ((s - 1) % pp, c - 1 if s == 0 else c, (s + 1) % pp,
                c + 1 if s == pp - 1 else c)

    def _forward(self, j, c, tok, tgt, n_items, sends):
        """Micro-batch ``j``'s forward through chunk ``c``: receive (or embed), the
        chunk's layers, then send on (or the head and the loss). Returns its caches
        and its loss (0 off the last virtual stage)."""
        cfg, grid, mod = self.config, self.grid, self.module
        V = self.chunks
        shape = activation_shape(self.spec.grid_kind, cfg, grid, tok.shape[0], tok.shape[1],
                                 self.sp)
        prev, _, nxt, c_next = self._neighbours(c)
        caches = []
        if self.first and c == 0:                        # virtual stage 0: the embedding
            x, cache = mod.embed_forward(self._gather(("wte", "wpe")), tok, cfg, grid,
                                         **self._sp_kw)
            caches.append(self._detach(cache))
            self._poll()
        else:
            with self.trace.phase("pp.fwd"):
                x = self._recv(shape, prev, hand_off_tag(j, c, V, False))
        for l in self.chunk_layers[c]:
            p = self._gather((f"h{l}",))
            x, cache = mod.layer_forward(x, {k: p[f"h{l}.{k}"] for k in block_keys(cfg.mlp)},
                                         l, cfg, grid, recompute=self.recompute,
                                         attention=self.attention, **self._sp_kw)
            del p
            caches.append(self._detach(cache))
            self._poll()
        loss = 0.0
        if self.last and c == V - 1:                     # the last virtual stage: the head
            loss, cache = mod.head_forward(x, self._gather(self._head_units()), tgt, cfg,
                                           grid, n_items=n_items, **self._sp_kw)
            caches.append(self._detach(cache))
            self._poll()
        else:
            x = self.xp.ascontiguousarray(x)
            if tuple(x.shape) != shape:
                raise RuntimeError(f"stage {self.mesh.s} chunk {c} output "
                                   f"{tuple(x.shape)}, expected {shape}")
            with self.trace.phase("pp.fwd"):
                sends.append(self._isend(x, nxt, hand_off_tag(j, c_next, V, False)))
        return caches, loss

    def _backward(self, j, c, caches, grads, shape, sends):
        """Micro-batch ``j``'s backward through chunk ``c``, piece by piece. ``grads``
        is the flat gradient buffer to accumulate into (ZeRO 0-1) or the micro-batch's
        :class:`_BucketGrads` (ZeRO 2-3), told after each piece which buckets are final
        (its piece count runs on over the chunks, V - 1 down to 0)."""
        mod, V = self.module, self.chunks
        prev, c_prev, nxt, _ = self._neighbours(c)
        caches = list(caches)
        bucketed = isinstance(grads, _BucketGrads)

        def add(g: dict, prefix: str = ""):
            for k, v in g.items():
                o = self.offsets[prefix + k]
                if bucketed:
                    grads.add(o, v.reshape(-1))
                else:
                    grads[o:o + v.size] += v.reshape(-1)
                    if self.reduce16:     # 16-bit gradients accumulate in 16 bits
                        self.reduce16.round(grads[o:o + v.size], out=grads[o:o + v.size])
            self._pieces_run += 1
            if bucketed:
                grads.done(grads.piece)
                grads.piece += 1
            elif self.overlap:
                self._piece_done(j)
            self._poll()

        if self.last and c == V - 1:
            self._refresh(caches, self._head_units())
            seed = {"loss_scale": self.scaler.scale} if self.scaler else {}
            dx, g = mod.head_backward(caches.pop(), **seed)
            add(g)
        else:
            with self.trace.phase("pp.bwd"):
                dx = self._recv(shape, nxt, hand_off_tag(j, c, V, True))
        for l in reversed(self.chunk_layers[c]):
            self._refresh(caches, (f"h{l}",))
            dx, g = mod.layer_backward(dx, caches.pop())
            add(g, f"h{l}.")
        if self.first and c == 0:   # the embedding's backward reads no weight
            add(mod.embed_backward(dx, self._attach(caches.pop(), [])))
        else:
            dx = self.xp.ascontiguousarray(dx)
            with self.trace.phase("pp.bwd"):
                sends.append(self._isend(dx, prev, hand_off_tag(j, c_prev, V, True)))

    def _recv(self, shape, source: int, tag: int):
        """A pipeline hand-off from ``source``: float32 (or the config's dtype), or under
        mixed precision 16-bit bits unpacked to float32."""
        pp = self.mesh.pp_comm
        if self.precision is None:
            x = self.xp.empty(shape, dtype=self.config.dtype)
            pp.recv(x, source, tag=tag)
            return x
        bits = self.xp.empty(shape, dtype=np.uint16)
        pp.recv(bits, source, tag=tag)
        return unpack_bits(self.precision, bits)

    def _isend(self, x, dest: int, tag: int):
        """``(request, buffer)`` of a hand-off of the contiguous ``x`` to ``dest`` (16-bit
        under mixed precision: the activations are 16-bit values already, packed
        exactly)."""
        if self.precision is not None:
            x = pack_bits(self.precision, x)
        return self.mesh.pp_comm.isend(x, dest, tag=tag), x

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
            # each micro-batch fits the tensor scheme: whole sequences per rank of a 2D,
            # 2.5D or 3D grid; T / t positions per rank under sequence parallelism
            if self.spec.grid_kind == "1d":
                self.module.check(cfg, self.grid, seq=tokens.shape[1],
                                  sequence_parallel=self.sp)
            else:
                self.module.check(cfg, self.grid, batch=B // (mesh.dp * self.m))

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
        shape = activation_shape(self.spec.grid_kind, cfg, self.grid, per, seq, self.sp)
        if self.zero < 2:
            self.grad[...] = 0
        else:
            self.gshard[...] = 0
        self._mb_piece, self._next_final = {}, 0
        self._piece_runs = [0] * self._n_pieces
        self._gather_hash = (hashlib.blake2b(digest_size=8)
                             if self.audit_gathers and self.zero == 3 and mesh.dp > 1
                             else None)
        self._gather_hashed = 0
        self.rings = {"in_flight": 0, "waited": 0, "pieces_left": 0}
        self._pieces_run = 0                      # backward pieces run in the step
        self._rings_started = 0
        caches, pending, sends, loss = {}, {}, [], 0.0
        with ops.autocast(self.precision):        # None: no rounding
            for op, j, c in schedule(self.kind, self.m, mesh.pp, mesh.s, self.chunks):
                rows = slice((mesh.a * self.m + j) * per, (mesh.a * self.m + j + 1) * per)
                if op == "F":
                    caches[j, c], lj = self._forward(j, c, tokens[rows], targets[rows],
                                                     n_items, sends)
                    loss += lj
                    self.max_inflight = max(self.max_inflight, len(caches))
                    continue
                # ZeRO 2-3: this micro-batch's gradient lives bucket by bucket, each
                # reduce-scattered as soon as the backward has finished it (its chunks
                # run V - 1 down to 0, so it is complete after chunk 0)
                buf = self.grad if self.zero < 2 else pending.get(j)
                if buf is None:
                    buf = pending[j] = _BucketGrads(self)
                self._backward(j, c, caches.pop((j, c)), buf, shape, sends)
                if c == 0:
                    pending.pop(j, None)
                sends = self._reap(sends)
        for req, _ in sends:
            req.wait()
        if self.overlap:
            # ZeRO 0-1: every bucket was queued as the last backward finished it; ZeRO 2-3:
            # each micro-batch's. Finish what is still in flight.
            self._final_buckets(everything=True)
            self._drain()
        elif self.zero < 2:
            with self.trace.phase("dp.grads"):
                for lo, hi in self.buckets:
                    # ZeRO 1 updates only the owned chunk: its sum is enough
                    self._dp_ring(self.grad[lo:hi], "ar" if self.zero == 0 else "rs")
        if self.sp and self.zero < 2:   # partial sums over the sequence slices: one
            self.module.allreduce_sequence_parallel_grads(      # all-reduce per step
                {k: self.grad[self.offsets[k]:self.offsets[k] + math.prod(self.shapes[k])]
                 for k in self._sp_keys()}, cfg, self.grid)
        elif self.sp:
            self._allreduce_sp_owned()
        self._tie()
        self.applied = self._unscale() if self.precision else True
        if self.applied:
            self._update()
        self.steps += 1
        return self._global_loss(loss)

    def _dp_ring(self, buf, half: str) -> None:
        """A blocking ring ``half`` ("ar" or "rs") of gradient bucket ``buf`` over dp, in
        place: in its own type, or with a 16-bit ``grad_reduce`` on its 16-bit bits (the
        ring adds in 16 bits), unpacked back into ``buf``."""
        comm = self.mesh.dp_comm
        if self.reduce16 is None or comm.size == 1:
            if half == "ar":
                ring_allreduce_unchecked(buf, comm, out=buf)
            else:
                ring_reduce_scatter_unchecked(buf, comm)
            return
        bits = pack_bits(self.reduce16, buf, out=self._bits[:buf.shape[0]])
        if half == "ar":
            ring_allreduce_unchecked(bits, comm, out=bits, add=self._add16)
        else:
            ring_reduce_scatter_unchecked(bits, comm, add=self._add16)
        unpack_bits(self.reduce16, bits, out=buf)

    def _unscale(self) -> bool:
        """Mixed precision, after the reductions: the collective overflow vote (an Inf or
        NaN in a gradient any rank holds skips the step on every rank; phase
        ``aux.overflow``, one 8-byte all-reduce over the mesh), the loss scaler's update,
        and the held gradients divided by the step's scale. Returns whether to update."""
        held = [g for _, _, g in self.held_grads()]
        if self.inject_overflow_at == self.steps:
            for g in held:
                if g.size:
                    g[0] = np.inf
                    break
        flag = np.array([1.0 if has_overflow(held) else 0.0])
        with self.trace.phase("aux.overflow"):
            flag = self.mesh.world.allreduce(flag, op="max")
        scale = self.scaler.scale
        if not self.scaler.update(bool(flag[0])):
            self.skipped += 1
            return False
        if scale != 1.0:
            for g in held:
                g *= 1.0 / scale
        return True

    def sp_grad_bytes(self) -> int:
        """Bytes of the step's one all-reduce of the sequence-parallel parameters'
        gradients over the tensor group (phase ``sp.grads``; 0 without sequence
        parallelism or on a group of one): all of them (ZeRO 0-1), or their parts in
        the owned chunks (ZeRO 2-3)."""
        if not self.sp or self.grid.p == 1:
            return 0
        item = np.dtype(self.config.dtype).itemsize
        if self.zero >= 2:
            return item * sum(n for _, n in self._sp_owned())
        return item * sum(math.prod(self.shapes[k]) for k in self._sp_keys())

    def _sp_owned(self) -> list[tuple[int, int]]:
        """ZeRO 2-3: ``[(offset in gshard, items)]`` of the sequence-parallel
        parameters' gradients inside the owned chunks, in flat order."""
        ranges = _merge(self.key_ranges()[k] for k in self._sp_keys())
        out = []
        for (lo, hi), o in zip(self.owned, self.shard_offsets):
            out += [(o + a - lo, b - a) for a, b in _clip(ranges, lo, hi)]
        return out

    def _allreduce_sp_owned(self) -> None:
        """ZeRO 2-3 with sequence parallelism: sum the sequence-parallel gradients'
        owned parts over the tensor group, packed in one all-reduce (phase ``sp.grads``)."""
        parts = self._sp_owned()
        if self.grid.p == 1 or not parts:
            return
        buf = self.xp.empty(sum(n for _, n in parts), dtype=self.gshard.dtype)
        off = 0
        for o, n in parts:
            buf[off:off + n] = self.gshard[o:o + n]
            off += n
        with self.trace.phase("sp.grads"):
            self.grid.comm.allreduce(buf)
        off = 0
        for o, n in parts:
            self.gshard[o:o + n] = buf[off:off + n]
            off += n

    def _sp_keys(self) -> list:
        """The parameters of this stage whose gradients sequence parallelism leaves as
        partial sums over the tensor group (Megatron's :func:`sequence_parallel_keys`)."""
        return self.module.sequence_parallel_keys(self.config, self.keys) if self.sp else []

    @staticmethod
    def _reap(sends):
        """Drop completed sends (their buffers may go)."""
        return [(r, b) for r, b in sends if not r.test()]

    # -- overlapped reductions (overlap=True) ----------------------------------------
    def _piece_done(self, j: int) -> None:
        """ZeRO 0-1: micro-batch ``j`` has run one more backward piece; queue the
        buckets whose gradients are now final."""
        k = self._mb_piece.get(j, 0)
        self._mb_piece[j] = k + 1
        self._piece_runs[k] += 1
        self._final_buckets()

    def _final_buckets(self, everything: bool = False) -> None:
        """ZeRO 0-1: queue, in bucket order, each bucket after whose last writing piece
        (:attr:`bucket_piece`) every micro-batch has run (``everything``: the rest, at
        the end of the step). Buckets are in backward order, so they become final in
        order, on every replica alike."""
        if self.zero >= 2:
            return
        half = "ar" if self.zero == 0 else "rs"    # ZeRO 1 needs the owned chunk only
        while self._next_final < len(self.buckets) and (
                everything or self._piece_runs[self.bucket_piece[self._next_final]]
                == self.m):
            lo, hi = self.buckets[self._next_final]
            self._enqueue(self.grad[lo:hi], half)
            self._next_final += 1

    def _enqueue(self, buf, half: str, then=None) -> None:
        """Queue a ring ``half`` of ``buf`` over dp (phase ``dp.grads``), ``then`` to run
        when it is done; the oldest is finished first when more than
        :data:`OVERLAP_QUEUE` wait. A 16-bit ``grad_reduce`` packs ``buf`` now (its
        gradients are final), rings the bits, and unpacks them into ``buf`` before
        ``then``."""
        if self.reduce16 is not None:
            bits, after = pack_bits(self.reduce16, buf), then

            def then(bits=bits, buf=buf, after=after):
                unpack_bits(self.reduce16, bits, out=buf)
                if after is not None:
                    after()

            buf = bits
        self._queue.append([buf, half, then, None])
        self.rings["pieces_left"] += self.m * self._n_pieces - self._pieces_run
        self._progress()
        while len(self._queue) > OVERLAP_QUEUE:
            self._finish_head()

    def _poll(self) -> None:
        """Advance the queued reductions, if any (a few MPI_Test calls; never waits)."""
        if self._queue:
            self._progress()

    def _start(self, entry) -> None:
        """Start queued ring ``entry`` on the next of :data:`OVERLAP_RINGS` tags and
        workspaces. Rings start in queue order and at most OVERLAP_RINGS of the queue's
        head are in flight, so ring k starts after ring k - OVERLAP_RINGS, the last one
        on its tag, is done here, and every replica posts the same messages on the same
        tags in the same order (MPI matches each tag's messages in order)."""
        k = self._rings_started % OVERLAP_RINGS
        with self.trace.phase("dp.grads"):
            entry[3] = ring_start(entry[0], self.mesh.dp_comm, entry[1],
                                  work=self._ring_work[k], tag=NONBLOCKING_TAG + k,
                                  add=self._add16)
        self._rings_started += 1

    def _progress(self) -> None:
        """Start the queue's first :data:`OVERLAP_RINGS` rings, advance each (never
        waits), then retire the done ones at the head, in order, running their
        ``then``: the adds into the gradient shard keep the blocking order."""
        q = self._queue
        for n, entry in enumerate(q):
            if n == OVERLAP_RINGS:
                break
            if entry[3] is None:
                self._start(entry)
            entry[3].progress()
        while q and q[0][3] is not None and q[0][3].done:
            self._retire("in_flight")

    def _retire(self, how: str) -> None:
        _, _, then, _ = self._queue.popleft()
        self.rings[how] += 1
        if then is not None:
            then()

    def _finish_head(self) -> None:
        """Wait for the oldest queued ring (started first if it is not yet) and retire
        it. Every rank's head is its oldest unfinished ring, and a rank that finished a
        ring sent all of its messages, so the lowest ring anyone waits for completes."""
        head = self._queue[0]
        if head[3] is None:
            self._start(head)
        done = head[3].done
        head[3].wait()
        self._retire("in_flight" if done else "waited")

    def _drain(self) -> None:
        """Finish every queued reduction, in order."""
        while self._queue:
            self._progress()
            if self._queue:
                self._finish_head()

    def _reduce_scatter(self, i: int, buf) -> None:
        """Reduce-scatter bucket ``i`` (``buf``: one micro-batch's gradient of its items)
        over dp and add the owned chunk's sum to the gradient shard (``overlap``: queued,
        and added when its ring is done; the adds keep the blocking order)."""
        lo = self.buckets[i][0]
        (olo, ohi), o = self.owned[i], self.shard_offsets[i]

        def add_owned():
            g = self.gshard[o:o + ohi - olo]
            g += buf[olo - lo:ohi - lo]
            if self.reduce16:             # 16-bit gradients accumulate in 16 bits
                self.reduce16.round(g, out=g)

        if self.overlap:
            self._enqueue(buf, "rs", add_owned)
            return
        with self.trace.phase("dp.grads"):
            self._dp_ring(buf, "rs")
            add_owned()

    def _tie(self) -> None:
        """Sum the two copies of the tied embedding's gradient (first and last stage)."""
        emb = self.mesh.embed
        if emb is None or not self.lm or not self.config.tied:
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
        """Adam on the (master) parameters this rank owns, then what follows from them:
        ZeRO 1-2 all-gather the updated chunks over dp (16-bit under mixed precision),
        mixed precision rounds its compute copy."""
        dp_comm, prec = self.mesh.dp_comm, self.precision
        if self.zero == 0:
            master = self.flat if self.master is None else self.master
            self.opt.step({"flat": master}, {"flat": self.grad})
            if prec:
                prec.round(master, out=self.flat)
            return
        params, grads = {}, {}
        for i, ((lo, hi), o) in enumerate(zip(self.owned, self.shard_offsets)):
            if hi == lo:
                continue
            params[i] = self.flat[lo:hi] if self.shard is None else self.shard[o:o + hi - lo]
            grads[i] = self.grad[lo:hi] if self.zero < 2 else self.gshard[o:o + hi - lo]
        self.opt.step(params, grads)
        if prec and self.zero == 3:
            prec.round(self.shard, out=self.cshard)
        if self.zero in (1, 2):
            with self.trace.phase("zero.params"):
                for (lo, hi), (olo, ohi), o in zip(self.buckets, self.owned,
                                                   self.shard_offsets):
                    if prec is None:
                        ring_allgather_unchecked(self.flat[lo:hi], dp_comm)
                        continue
                    # the owned chunk's new 16-bit values, gathered as 2-byte items
                    bits = self._bits[:hi - lo]
                    pack_bits(prec, self.shard[o:o + ohi - olo], out=bits[olo - lo:ohi - lo])
                    ring_allgather_unchecked(bits, dp_comm)
                    unpack_bits(prec, bits, out=self.flat[lo:hi])

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
        ``pp.bwd`` (see the module docstring), for a global batch of ``batch``. The
        ZeRO collectives go unit by unit over every chunk's layers (a 0-layer chunk
        has none); the point-to-point hand-offs are ``V`` per micro-batch and
        direction, less one at the pipeline's two ends."""
        mesh, m = self.mesh, self.m
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
        if mesh.embed is not None and self.lm and self.config.tied:
            u = self.units["wte"]
            n = u.stop - u.start
            if self.zero >= 1:
                c0, c1 = _bounds(n, dp)[(a + 1) % dp]
                n = c1 - c0
            out["embed.tie"] = ring_send_items(n, 2, mesh.embed.rank, "ar")
        act = math.prod(activation_shape(self.spec.grid_kind, self.config, self.grid,
                                         batch // (dp * m), seq, self.sp))
        # every chunk hands each micro-batch on, but the last virtual stage's forward
        # and virtual stage 0's backward (0-layer chunks relay theirs unchanged)
        out["pp.fwd"] = m * act * (self.chunks - (1 if self.last else 0))
        out["pp.bwd"] = m * act * (self.chunks - (1 if self.first else 0))
        item = self.item_bytes()
        return {k: v * item[k] for k, v in out.items()}

    def item_bytes(self) -> dict:
        """Bytes per item of each traced phase's messages: the config's dtype, or under
        mixed precision 2 for the hand-offs and the ZeRO parameter gathers (16-bit
        values) and for ``dp.grads`` with a 16-bit ``grad_reduce``; ``embed.tie`` sums
        the fp32 gradients."""
        item = np.dtype(self.config.dtype).itemsize
        half = self.precision.itemsize if self.precision else item
        return {"dp.grads": self.reduce16.itemsize if self.reduce16 else item,
                "zero.params": half, "zero.gather": half, "embed.tie": item,
                "pp.fwd": half, "pp.bwd": half}

    def model_params(self) -> int:
        """Parameters of this rank's stage without ZeRO (its tensor shards)."""
        return self.n

