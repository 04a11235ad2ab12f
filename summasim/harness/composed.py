"""The sharded-training executor: a ``[dp, pp, tensor]`` mesh next to the serial model.

What a row checks (every rank, then one collective verdict)
-----------------------------------------------------------
* **values**: over ``case.steps`` Adam steps on the same global batch, against the serial
  model trained in float64 on the whole batch. Every step starts from the reference's
  state (parameters and Adam's moments, :meth:`~summasim.transformer.composed.Trainer.
  load_state`), so each step is held to its own rounding rather than to the previous
  steps' rounding amplified by Adam. Per step: the loss and every gradient this rank
  holds after the step's reduction (all of its stage's tensor shards under ZeRO 0, its
  owned chunks under ZeRO 1-3), as ``max |par - ser| / max |ser|`` per tensor, within
  ``bound`` = :func:`summasim.validate.training_tolerance` (derived from the unit
  roundoff, the longest contraction of the step and its depth); and every parameter it
  holds after the update, elementwise, within :func:`summasim.validate.adam_step_bound`,
  which carries the gradients' bound through Adam's normalization (an entry whose
  gradient is small next to its error may move by up to the whole update, about lr; one
  whose gradient is large is held to about ``lr * bound``). ``param_err`` is the worst
  entry's error over its bound (passes at 1 or less);
* **replicas**: after every step, the runtime replica audit
  (:meth:`~summasim.transformer.composed.Trainer.audit`): every copy of a replicated
  tensor is bit-identical to its replicas, by a blake2b digest all-gathered over each
  replica group: the parameters (and under ZeRO 0 Adam's moments) over dp under ZeRO
  0-2; under ZeRO-3, whose owned chunks are disjoint, the units every replica
  all-gathered in the step; the parameters the tensor scheme replicates (Megatron's
  LayerNorms and row-parallel biases over the tensor group, SUMMA2.5-LM's copies over
  the depth) with their moments, held whole or as owned chunks; and the tied ``wte``
  of the first and last stage. A replica that drifts by one bit fails the row (the
  ``drift`` fault, :mod:`~summasim.harness.inject`, shows it; the values check cannot
  see a drift so small);
* **traffic**: the bytes sent in every phase of the step (``dp.grads``,
  ``zero.params``, ``zero.gather``, ``embed.tie``, ``pp.fwd``, ``pp.bwd``) equal
  :meth:`~summasim.transformer.composed.Trainer.expected_traffic` exactly (the ring's
  chunking, bucket by bucket), their sums over each data-parallel group equal the
  nominal forms of :func:`nominal_group_traffic` (``2 (dp-1) N`` for the all-reduce,
  derived from the parameter and activation counts alone), and the first layer of the
  stage sends ``m`` times its Table 1 payload per micro-batch (nothing on a stage of
  no layer);
* **schedule**: the most micro-batch chunks in flight on a stage is
  :func:`~summasim.transformer.schedules.peak_inflight`: ``m`` (GPipe), ``min(pp - s,
  m)`` (1F1B) or ``min(2 (pp - s - 1) + (V - 1) pp + 1, m V)`` (interleaved, V chunks);
* **memory**: the model state the rank keeps (parameters, gradients, Adam moments)
  against :func:`summasim.costmodel.workload.zero.model_state_bytes` for its ZeRO stage with
  the buckets as the partitioned pieces: a partitioned state holds ``floor`` or
  ``ceil(n_b / dp)`` items of each bucket, so it may fall short of the formula (the
  largest shard) by one item per bucket that dp does not divide (two for Adam's
  moments) and never exceed it; an unpartitioned state matches exactly.

The inputs are the harness's transformer inputs (:func:`mesh_inputs`: class labels
[B] for a classification model). An error of the serial reference (rank 0) is raised
on every rank. The reference (the inputs, then each step's state, gradients, next
parameters and bounds, one step at a time) is published once per node in shared memory
(:class:`~summasim.harness.shared.NodeShared`); a rank copies out only its own blocks,
so no rank but rank 0 holds a whole model.

A NaN or Inf anywhere fails the row on whichever rank it sits.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from ..backends import backend_of
from ..comm import Comm
from summasim.costmodel.tools.accuracy import event_summary
from ..grid import Mesh
from ..mpiutil import LONG_WAIT_NAP_S, agreement, quiet_barrier
from ..transformer import composed, model, schedules
from ..transformer.composed import Trainer
from ..transformer.optimus import column_cut
from ..transformer.schemes import get_scheme
from ..transformer.train import Adam
from ..validate import adam_step_bound, scaled_error, training_tolerance
from .check import Check, collective
from .inject import PERTURB_HALF, corrupt_entry, drift_at_gathers, drift_entry, drop_at_rings
from .memory import peak_rss_bytes
from .result import Result
from .shared import NodeShared
from .timing import reduce_max, time_calls, time_contenders
from .transformer import (_inputs, block_err, layer_tp_items, loss_error, scale_of,
                          table1_payload)

PHASES = ("dp.grads", "zero.params", "zero.gather", "embed.tie", "pp.fwd", "pp.bwd")
LR = 1e-3


@dataclass
class MeshReport:
    """One mesh row: verdicts, errors, step time, traffic and memory."""

    mesh: str
    zero: int
    schedule: str                  # gpipe, 1f1b or interleaved:V
    microbatches: int
    checkpoint: bool
    p: int
    dtype: str
    steps: int
    bound: float
    ok: bool = False
    nonfinite: bool = False
    bad_ranks: list = field(default_factory=list)
    loss_err: float = 0.0
    grad_err: float = 0.0
    param_err: float = 0.0
    worst: str = ""
    values_ok: bool = False
    replicas_ok: bool = False
    traffic_ok: bool = False
    tp_ok: bool = False
    schedule_ok: bool = False
    memory_ok: bool = False
    traffic: dict = field(default_factory=dict)          # largest per-rank bytes by phase
    traffic_expected: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)           # largest per-rank model state
    memory_formula: dict = field(default_factory=dict)
    inflight: int = 0
    step_s: float = 0.0
    predicted_s: float | None = None
    failures: list = field(default_factory=list)
    fault: str = ""
    fault_applied: bool = True
    load: dict | None = None        # other processes' load while it ran (rank 0)
    chunks: int = 1                 # model chunks per stage (interleaved: V >= 2)
    stages: str = ""                # layers per (virtual) stage as given; "" = even
    overlap: bool = False           # dp reductions overlapped with the backward
    audit: dict = field(default_factory=dict)    # replica group -> largest group size
    audit_bytes: int = 0            # largest per-rank bytes one step's audit hashes
    drifted: list = field(default_factory=list)  # replica groups that disagreed
    audit_s: float = 0.0            # the slowest rank's audit of one step, seconds
    rings: dict = field(default_factory=dict)    # overlap: the last step's rings, all ranks
    techniques: list = field(default_factory=list)   # e.g. ["selective", "flash", "sp"]
    losses: list = field(default_factory=list)       # the mesh's loss at every step
    serial_losses: list = field(default_factory=list)   # the serial model's, same steps
    skipped: list = field(default_factory=list)      # mixed precision: steps skipped (1-based)
    loss_scale: str = ""            # mixed precision: none, static:S or dynamic
    grad_reduce: str = ""           # mixed precision: the dp reduction's type
    case: dict = field(default_factory=dict)    # the case's to_dict(): model and batch


class SerialReference:
    """The serial model trained with Adam in float64 on the whole batch, one step at a
    time (rank 0). :meth:`step` returns what checking that step needs: the state it
    starts from (parameters, Adam's moments), the loss, the gradients and their scales,
    the next parameters and :func:`~summasim.validate.adam_step_bound`'s bound on each
    next parameter, given ``tol``, the bound on the gradients' scaled error."""

    def __init__(self, params: dict, tokens, targets, config, tol: float, dtype,
                 lr: float = LR):
        self.config = dataclasses.replace(config, dtype=np.dtype(np.float64))
        self.params = {k: np.asarray(v, dtype=np.float64).copy() for k, v in params.items()}
        self.tokens, self.targets, self.tol, self.dtype = tokens, targets, tol, dtype
        self.opt = Adam(lr=lr)
        self.t = 0

    def step(self) -> dict:
        p, opt = self.params, self.opt
        m_prev, v_prev = ({k: (opt.state[k][name].copy() if k in opt.state
                               else np.zeros_like(v)) for k, v in p.items()}
                          for name in ("m", "v"))
        start = {k: v.copy() for k, v in p.items()}
        loss, cache = model.forward(p, self.tokens, self.targets, self.config)
        grads = model.backward(cache)
        del cache
        opt.step(p, grads)
        self.t += 1
        scales = _max_abs(grads)
        bound = {k: adam_step_bound(
            grads[k], m_prev[k], v_prev[k], opt.state[k]["m"], opt.state[k]["v"], p[k],
            self.tol * scales[k], lr=opt.lr, betas=(opt.b1, opt.b2), eps=opt.eps,
            step=self.t, dtype=self.dtype) for k in p}
        return {"start": start, "m": m_prev, "v": v_prev, "loss": loss, "grads": grads,
                "grad_scales": scales, "next": {k: v.copy() for k, v in p.items()},
                "bound": bound}


def mesh_inputs(config, batch: int, seed: int):
    """Serial parameters, tokens [B, s] and targets of the harness's transformer rows:
    next tokens [B, s] for a language model, classes [B] when ``config.n_classes``."""
    params, tokens, targets = _inputs(config, batch, seed)
    if config.n_classes:
        rng = np.random.default_rng([seed, 1])
        targets = rng.integers(0, config.n_classes, size=(batch,))
    return params, tokens, targets


def _host(x) -> np.ndarray:
    """``x`` as a NumPy array, whatever its backend (a device array is copied)."""
    return np.asarray(backend_of(x).to_numpy(x))


def _worst(trainer, held, err_of) -> tuple[float, str]:
    """Worst ``err_of(key, values, start, stop)`` over every key's part of what ``held``
    covers (NaN, at once, when a held value or an error is not finite), and that key;
    infinite when a pad after a shard (:meth:`~summasim.transformer.composed.Trainer.
    pad_ranges`) is not zero, as it must stay."""
    worst, where = 0.0, ""
    pads = trainer.pad_ranges()
    for lo, hi, vals in held:
        vals = _host(vals)
        if not np.isfinite(vals).all():
            return math.nan, "non-finite"
        for key, (a, b) in pads.items():
            s, e = max(lo, a), min(hi, b)
            if s < e and np.any(vals[s - lo:e - lo]):
                return math.inf, f"the pad after {key}"
        for key, (a, b) in trainer.key_ranges().items():
            s, e = max(lo, a), min(hi, b)
            if s >= e:
                continue
            err = err_of(key, vals[s - lo:e - lo], s, e)
            if math.isnan(err):                      # a non-finite serial value
                return math.nan, key
            if err > worst or not where:
                worst, where = err, key
    return worst, where


def _compare(trainer, held, expected, scales: dict) -> tuple[float, str]:
    """Worst ``max |par - ser| / max |ser|`` over the keys that ``held`` covers, and
    that key."""
    expected = _host(expected)
    return _worst(trainer, held, lambda key, vals, s, e: block_err(vals, expected[s:e],
                                                                   scales[key]))


def _max_abs(arrays: dict) -> dict:
    """``max |v|`` of each tensor (:func:`~summasim.harness.transformer.scale_of`: NaN
    when it holds a non-finite value, which then fails every comparison with it)."""
    return {k: scale_of(v) for k, v in arrays.items()}


def _phase_bytes(events) -> dict:
    out = dict.fromkeys(PHASES, 0)
    for e in events:
        top = e.phase.split("/")[0]
        if top in out and e.op in ("send", "sendrecv"):
            out[top] += e.nbytes
    return out


def nominal_group_traffic(tr, batch: int, seq: int) -> dict:
    """Bytes per step in each phase summed over this rank's data-parallel group (the
    ``dp`` replicas of its stage and tensor rank), from the parameter and activation
    counts alone: an independent derivation of what
    :meth:`~summasim.transformer.composed.Trainer.expected_traffic` states per rank
    (which follows the ring's chunking, bucket by bucket).

    A ring reduce-scatter or all-gather of n items over p ranks sends every chunk but
    one from every rank: ``(p - 1) n`` items over the group, however n divides. So with
    ``N`` the stage's local parameters: all-reduce ``2 (dp-1) N`` (ZeRO 0), one
    reduce-scatter ``(dp-1) N`` (ZeRO 1), one reduce-scatter per micro-batch
    ``m (dp-1) N`` (ZeRO 2-3), one all-gather of the
    parameters ``(dp-1) N`` (ZeRO 1-2); ZeRO-3 all-gathers every unit before each piece
    that reads it: the embedding once per micro-batch (its backward reads no weight),
    every layer and the head twice (forward, backward), ``wte`` three times when one
    stage holds both ends. The tied-embedding all-reduce is a ring of 2, in which each
    rank sends exactly its length: ``dp |wte|`` (ZeRO 0) or ``|wte|`` (its chunks,
    ZeRO 1-3) over the group. Each virtual-stage boundary carries the global batch's
    activation once per step, forward and backward: ``B s h`` items per rank of a 1D
    tensor grid (replicated), ``B s h_j / (d pr)`` on a 2D/2.5D/3D grid (``h_j`` the
    rank's column of whole heads, ``h / pc`` when pc divides the key/value heads); a stage of V
    chunks sends across V boundaries each way, one fewer at the pipeline's ends.

    Under mixed precision the hand-offs and the ZeRO parameter gathers carry 16-bit
    values (2 bytes per item), and so does the gradient reduction when it is 16-bit;
    the tied-embedding sum stays fp32.
    """
    mesh, cfg, m, dp = tr.mesh, tr.config, tr.m, tr.mesh.dp
    item = np.dtype(cfg.dtype).itemsize
    half = 2 if tr.precision is not None else item
    items = dict.fromkeys(PHASES, half)
    items["embed.tie"] = item
    items["dp.grads"] = 2 if tr.reduce16 is not None else item
    size = {nm: u.stop - u.start for nm, u in tr.units.items()}
    n = tr.n
    out = dict.fromkeys(PHASES, 0)
    out["dp.grads"] = (dp - 1) * n * {0: 2, 1: 1}.get(tr.zero, m)
    if tr.zero in (1, 2):
        out["zero.params"] = (dp - 1) * n
    lm = not cfg.n_classes and cfg.tied          # the head reads wte: the tied copy
    if tr.zero == 3:
        reads = 2 * n
        if tr.first:
            reads -= size["wte"] + size["wpe"]
            if tr.last and lm:
                reads += 2 * size["wte"]
        out["zero.gather"] = m * (dp - 1) * reads
    if mesh.pp > 1 and lm and (tr.first or tr.last):
        out["embed.tie"] = size["wte"] * (dp if tr.zero == 0 else 1)
    g = tr.grid
    act = batch * seq * cfg.hidden
    if tr.spec.grid_kind != "1d":                 # this rank's column: whole heads
        cut = column_cut(cfg, g.pc)
        act = batch * seq * (cut[g.j + 1] - cut[g.j]) // (g.d * g.pr)
    elif tr.sp:                                   # sequence parallelism: s / t per rank
        act //= g.p
    out["pp.fwd"] = act * (tr.chunks - (1 if tr.last else 0))
    out["pp.bwd"] = act * (tr.chunks - (1 if tr.first else 0))
    return {k: v * items[k] for k, v in out.items()}


def _corrupt_held(tr, kind: str) -> bool:
    """``nan``/``inf``/``perturb`` in the first gradient items the rank holds (under
    mixed precision ``perturb`` doubles the entry: the fp32 gradient is held to the
    16-bit bound, far above float32's)."""
    eps = PERTURB_HALF if tr.precision else None
    keys = sorted(tr.key_ranges().values())
    for lo, hi, vals in tr.held_grads():
        for a, b in keys:                         # a shard's items, never its pad
            if max(a, lo) < min(b, hi):
                corrupt_entry(vals[max(a, lo) - lo:min(b, hi) - lo], kind, eps)
                return True                       # a device array: through the host
    return False


def _drift_target(tr):
    """The first non-empty view of a parameter this rank holds in a replica group of
    more than one rank (:meth:`~summasim.transformer.composed.Trainer.replica_sets`),
    or None. Under ZeRO-3 with dp > 1, or with nothing replicated over the tensor group
    or the tied pair, ``drift`` goes into a gathered unit instead (the tensor group
    compares only what all its ranks own)."""
    for rs in tr.replica_sets():
        for view in rs.params:
            if view.size:
                return view
    return None


def _share(world, value, what: str, into: NodeShared | None = None) -> NodeShared:
    """Rank 0's ``value`` as one read-only copy per node (collective), published in
    ``into``'s window when given (its views then show ``value``). An exception in its
    place (rank 0's reference could not be built) is raised on every rank."""
    quiet_barrier(world, longest=LONG_WAIT_NAP_S)   # the others sleep while rank 0 works
    if world.bcast(isinstance(value, BaseException), root=0):
        err = world.bcast(value, root=0)
        raise type(err)(f"{what}: {err}")
    if into is None:
        return NodeShared(world, value)
    into.publish(value)
    return into


def _serial_step(serial):
    """Rank 0: the reference's next step, or the exception that stopped it."""
    try:
        return serial.step()
    except (ValueError, TypeError, FloatingPointError) as e:
        return e


def _pack_host(tr, arrays: dict) -> np.ndarray:
    """Serial-layout ``arrays`` in this rank's flat layout, float64 on the host."""
    wide = dataclasses.replace(tr.config, dtype=np.dtype(np.float64))
    local = tr.module.shard(arrays, wide, tr.grid, tr.keys)
    out = np.empty(tr.n, dtype=np.float64)
    for key, (lo, hi) in tr.key_ranges().items():
        out[lo:hi] = np.asarray(local[key], dtype=np.float64).reshape(-1)
    return out


def _within(tr, held, expected, bound) -> tuple[float, str]:
    """Worst entry's ``|par - ser| / bound`` over what ``held`` covers (inf where the
    bound is 0 and the values differ; NaN when a value is not finite), and its key."""
    return _worst(tr, held, lambda key, vals, s, e: scaled_error(vals, expected[s:e],
                                                                 bound[s:e]))


def build_mesh(world, case, spec, backend, shared):
    """The :class:`Mesh` of ``case`` on ``world``; should it fail, the ``shared`` inputs
    are abandoned first (every rank then raises, none waits on them)."""
    try:
        return Mesh(world, case.dp, case.pp, spec.grid_kind, q=case.q, d=case.d, t=case.t,
                    backend=backend, pc=case.pc)
    except BaseException:
        shared.abandon()
        raise


def run_mesh(case, world, backend=None, *, repeats: int = 3, seed: int = 0,
             timed: bool = True, bound: float | None = None, fault=None,
             overlap: bool | None = None, alongside: dict | None = None, **_):
    """Validate and time ``case`` (a :class:`~summasim.harness.cases.MeshCase`) on
    ``world`` (collective). ``overlap``: the trainer's (None: the case's ``overlap``
    when it has one, else off). ``alongside``: ``{name: step}``, other collective
    training steps timed interleaved with the mesh's, step by step, in a rotating order
    (:func:`~summasim.harness.timing.time_contenders`: repeat i of each shares the
    machine's state), their spans in ``timing["alongside"][name]``. Returns a
    :class:`Result` whose ``extra["report"]`` is the :class:`MeshReport`."""
    from summasim.costmodel.workload.zero import model_state_bytes

    spec = get_scheme(case.scheme)
    config, batch = case.config, case.batch
    rank, p = world.Get_rank(), world.Get_size()
    if bound is None:
        bound = training_tolerance(config, batch, case.dtype, case.grad_reduce,
                                   case.microbatches * case.dp)
    first = serial = None
    if rank == 0:            # the serial reference's inputs; the other ranks sleep meanwhile
        try:
            params, tokens, targets = mesh_inputs(config, batch, seed)
            serial = SerialReference(params, tokens, targets, config, bound,
                                     case.master_dtype)   # Adam: fp32 when mixed
            first = {"params": params, "tokens": tokens, "targets": targets}
            del params
        except (ValueError, TypeError) as e:      # raised on every rank below, not alone
            first = e
    shared = _share(world, first, "serial reference")
    del first
    ref = shared.value
    tokens, targets = ref["tokens"], ref["targets"]
    if overlap is None:
        overlap = bool(getattr(case, "overlap", False))
    rep = MeshReport(case.spec, case.zero, case.schedule_label, case.microbatches,
                     case.checkpoint, p, case.dtype, case.steps, bound, chunks=case.chunks,
                     stages=case.stages_label, overlap=bool(overlap),
                     techniques=list(case.techniques),
                     loss_scale=case.loss_scale or "", grad_reduce=case.grad_reduce or "",
                     case=case.to_dict())
    mesh = build_mesh(world, case, spec, backend, shared)
    item = np.dtype(config.dtype).itemsize
    finished = False
    step_ref = None
    try:
        tr = Trainer(ref["params"], config, mesh, spec, zero=case.zero, schedule=case.schedule,
                     microbatches=case.microbatches, chunks=case.chunks, stages=case.stages,
                     checkpoint=case.checkpoint, recompute=case.recompute,
                     attention=case.attention, sequence_parallel=case.sequence_parallel,
                     bucket_bytes=case.bucket_bytes, overlap=bool(overlap),
                     precision=case.precision, loss_scale=case.loss_scale,
                     grad_reduce=case.grad_reduce or "float32", lr=LR)
        tr.audit_gathers = True                  # ZeRO-3: the audit's digest of the gathers
        audit_groups, audit_bytes, audit_s, drifted = {}, 0, 0.0, set()
        loss_err = grad_err = param_err = 0.0
        worst_grad = worst_param = ""
        traffic = tp_items = None
        mine = fault is not None and fault.rank == rank
        applied = not mine
        for step in range(case.steps):
            # the reference's step, published per node; every step starts from its state
            # (each step is held to its own rounding, not to the last step's through Adam)
            step_ref = _share(world, _serial_step(serial) if rank == 0 else None,
                              f"serial reference, step {step + 1}", into=step_ref)
            sref = step_ref.value
            if step:
                tr.load_state(sref["start"], sref["m"], sref["v"], step)
            mesh.trace.clear()
            drift = mine and step == 0 and fault.kind == "drift"
            if mine and step == 0 and fault.kind == "drop":
                # drop: the first ring reduction of the step on this rank (a data-parallel
                # bucket, else the tied embedding) keeps this rank's own contribution in
                # the chunk it would own, through the one hook (comm.DropFault)
                with Comm.drop_next_sum(groups=("dp", "embed")) as drop, \
                        drop_at_rings(composed):
                    loss = tr.step(tokens, targets)
                applied = drop.applied
            elif drift and tr.zero == 3 and (tr.mesh.dp > 1 or _drift_target(tr) is None):
                # drift, ZeRO-3: the first unit the rank all-gathers in the step moves by
                # one bit. Between steps nothing is replicated over dp, and the tensor
                # group compares only what all its ranks own, while every gather is
                # compared whole over dp
                with drift_at_gathers(composed) as hook:
                    loss = tr.step(tokens, targets)
                applied = hook.applied
            else:
                loss = tr.step(tokens, targets)
            if drift and not applied:
                # drift: one replicated parameter moves by one bit after the step, on
                # this rank only, before the value checks and the audit read it
                target = _drift_target(tr)
                applied = target is not None and drift_entry(target)
            elif mine and step == 0 and fault.kind not in ("drop", "drift"):
                applied = _corrupt_held(tr, fault.kind)
            if step == 0:
                events = list(mesh.trace.events)
                traffic = _phase_bytes(events)
                # the stage's first layer (none on a stage of the embedding or head alone);
                # under sequence parallelism its collectives are ring halves (sendrecv)
                tp_items = (layer_tp_items(events, tr.layers[0], "fwd", item,
                                           ring=case.sequence_parallel,
                                           cube=case.grid_kind == "3d")
                            if tr.layers else 0)
                sp_bytes = sum(e.nbytes for e in events if e.phase.split("/")[0] == "sp.grads")
            rep.losses.append(float(loss))
            rep.serial_losses.append(float(sref["loss"]))
            le = loss_error(loss, sref["loss"])
            loss_err = le if math.isnan(le) or le > loss_err else loss_err
            if tr.applied:
                expect = _pack_host(tr, sref["grads"])
                ge, where = _compare(tr, tr.held_grads(), expect, sref["grad_scales"])
                expect = None              # a stage's share at a time, freed as it goes
                if math.isnan(ge) or ge > grad_err or not worst_grad:
                    grad_err, worst_grad = ge, f"step {step + 1} grad {where}"
                # the parameters, elementwise, within what Adam makes of the gradients'
                # bound
                pe, where = _within(tr, tr.held_params(), _pack_host(tr, sref["next"]),
                                    _pack_host(tr, sref["bound"]))
            else:
                # mixed precision skipped the step (an overflow on some rank): the
                # parameters are the step's start, bit for bit in the master's type
                rep.skipped.append(step + 1)
                start = _pack_host(tr, sref["start"]).astype(config.dtype)
                pe, where = _within(tr, tr.held_params(), start.astype(np.float64),
                                    np.zeros(tr.n))
                pe = 0.0 if pe == 0 else math.inf
            if math.isnan(pe) or pe > param_err or not worst_param:
                param_err, worst_param = pe, f"step {step + 1} param {where}"
            expect = sref = None
            # replicas: every replicated tensor bit-identical over its group, this step
            t0 = time.perf_counter()
            audited = tr.audit()
            audit_s = max(audit_s, time.perf_counter() - t0)
            audit_bytes = max(audit_bytes, sum(got["nbytes"] for got in audited.values()))
            for name, got in audited.items():
                audit_groups[name] = got["size"]
                if not got["agree"]:
                    drifted.add(name)
        if step_ref is not None:
            step_ref.free()
            step_ref = None
        tr.audit_gathers = False                 # the timed steps hash nothing
        replicas_ok = not drifted
        expected = tr.expected_traffic(batch, config.seq)
        # per rank: the closed form, exactly; per data-parallel group: the nominal
        # (dp - 1) N forms (the sum over the group is untraced, after the traced step)
        group = mesh.dp_comm.mpi.allreduce(np.array([traffic[k] for k in PHASES], np.int64))
        nominal = nominal_group_traffic(tr, batch, config.seq)
        traffic_ok = traffic == expected and [int(v) for v in group] == [
            nominal[k] for k in PHASES] and sp_bytes == tr.sp_grad_bytes()
        table1 = table1_payload(case.scheme, config, case.micro_batch, case.tensor_size,
                                case.q, case.d, case.pc, getattr(mesh.tensor, "j", 0),
                                getattr(mesh.tensor, "i", 0))["fwd"]
        if case.sequence_parallel:   # each all-reduced item: a ring's 2 (t-1)/t sends
            table1 = 2 * table1 * (case.t - 1) // case.t
        tp_ok = tp_items == (case.microbatches * table1 if tr.layers else 0)
        schedule_ok = tr.max_inflight == schedules.peak_inflight(
            case.schedule, case.microbatches, mesh.pp, mesh.s, case.chunks)
        mem = tr.state_bytes()
        # the buckets are the pieces ZeRO partitions: the formula counts the largest
        # shard, ceil(n_b / dp) items of each; a rank holds ceil or floor of each
        sizes = [hi - lo for lo, hi in tr.buckets]
        # mixed precision: a 16-bit compute copy, fp32 gradients (16-bit with a 16-bit
        # reduction), fp32 moments and an fp32 master copy (optimizer state)
        per = ({"params": 2, "grads": 2 if tr.reduce16 else item, "optimizer": 3 * item}
               if case.precision else {"params": item, "grads": item, "optimizer": 2 * item})
        formula = model_state_bytes(sizes or [0], mesh.dp, case.zero,
                                    param_bytes=per["params"], grad_bytes=per["grads"],
                                    optim_bytes=item,
                                    master_bytes=item if case.precision else 0)
        uneven = sum(1 for n in sizes if n % mesh.dp)
        memory_ok = tr.model_params() == sum(sizes) and all(
            0 <= formula[k] - mem[k] <= uneven * per[k] for k in per)
        errs = [loss_err, grad_err, param_err]
        # one verdict in units of each check's own bound: the loss and the gradients
        # against ``bound``, the parameters as their worst ratio to the elementwise bound
        ratios = [loss_err / bound, grad_err / bound, param_err]
        worst = max(ratios) if not any(math.isnan(e) for e in ratios) else math.nan
        # mixed precision: a row whose every step was skipped validated no gradient; and
        # a step is skipped for an overflow of the scaled gradients, which only a loss
        # scale can cause: without one, the Inf or NaN that skipped it is a fault
        checked_ok = len(rep.skipped) < case.steps
        unscaled_ok = not rep.skipped or (tr.scaler is not None and tr.scaler.kind != "none")
        local_ok = (replicas_ok and traffic_ok and tp_ok and schedule_ok and memory_ok
                    and checked_ok and unscaled_ok)
        failures = [name for name, ok in (("replicas", replicas_ok), ("traffic", traffic_ok),
                                          ("table1", tp_ok), ("schedule", schedule_ok),
                                          ("memory", memory_ok),
                                          ("every step skipped", checked_ok),
                                          (f"step(s) {','.join(map(str, rep.skipped))} "
                                           f"skipped on a non-finite gradient without a "
                                           f"loss scale", unscaled_ok)) if not ok]
        chk = Check(worst, 1.0, "serial model")
        chk.ok = chk.ok and local_ok
        chk = collective(world, chk)
        every = world.allgather((errs, worst_grad, worst_param, failures,
                                 [traffic[k] for k in PHASES], [expected[k] for k in PHASES],
                                 [mem[k] for k in ("params", "grads", "optimizer", "total")],
                                 [formula[k] for k in ("params", "grads", "optimizer",
                                                       "total")], tr.max_inflight,
                                 audit_groups, audit_bytes, sorted(drifted), audit_s))
        rep.ok, rep.nonfinite, rep.bad_ranks = chk.ok, chk.nonfinite, chk.bad_ranks
        rep.fault = str(fault) if fault else ""
        rep.fault_applied = all(world.allgather(applied))

        def worst_of(i):
            vals = [r[0][i] for r in every]
            return math.nan if any(math.isnan(v) for v in vals) else max(vals)

        rep.loss_err, rep.grad_err, rep.param_err = (worst_of(i) for i in range(3))
        def ratios_of(r):     # a rank's errors in units of their bounds
            return [r[0][0] / bound, r[0][1] / bound, r[0][2]]

        top = max(every, key=lambda r: math.inf if any(map(math.isnan, r[0]))
                  else max(ratios_of(r)))
        g_ratio, p_ratio = ratios_of(top)[1:]
        grad_side = math.isnan(g_ratio) or (not math.isnan(p_ratio) and g_ratio >= p_ratio)
        rep.worst = top[1] if grad_side else top[2]
        rep.failures = sorted({f for r in every for f in r[3]})
        rep.values_ok = (not rep.nonfinite and max(rep.loss_err, rep.grad_err) <= bound
                         and rep.param_err <= 1.0)
        for name in ("replicas", "traffic", "table1", "schedule", "memory"):
            setattr(rep, {"table1": "tp_ok"}.get(name, f"{name}_ok"), name not in rep.failures)
        rep.traffic = {k: max(r[4][i] for r in every) for i, k in enumerate(PHASES)}
        rep.traffic_expected = {k: max(r[5][i] for r in every) for i, k in enumerate(PHASES)}
        keys = ("params", "grads", "optimizer", "total")
        rep.memory = {k: max(r[6][i] for r in every) for i, k in enumerate(keys)}
        rep.memory_formula = {k: max(r[7][i] for r in every) for i, k in enumerate(keys)}
        rep.inflight = max(r[8] for r in every)
        for r in every:
            for name, size in r[9].items():
                rep.audit[name] = max(rep.audit.get(name, 0), size)
        rep.audit = dict(sorted(rep.audit.items()))
        rep.audit_bytes = max(r[10] for r in every)
        rep.drifted = sorted({g for r in every for g in r[11]})
        rep.audit_s = max(r[12] for r in every)

        timing = {}
        if timed and repeats > 0:
            mesh.trace.enabled = False
            sync = backend.synchronize if backend is not None else (lambda: None)

            def train_step():   # device work (Adam's last kernels) waited for in the call
                tr.step(tokens, targets)
                sync()

            with agreement(False):
                if alongside:
                    timed = time_contenders({"mesh": train_step, **alongside}, world,
                                            repeats)
                    spans = timed.pop("mesh")
                    timing = {"spans": spans["spans"], "times": spans["times"],
                              "rank_max": spans["rank_max"],
                              "median": statistics.median(spans["spans"]),
                              "alongside": {k: v["spans"] for k, v in timed.items()}}
                else:
                    timing = time_calls(train_step, world, repeats, adaptive=False)
            mesh.trace.enabled = True
            rep.step_s = timing["median"]
        # overlap: the last step's rings that finished while it computed, and waited for
        names = sorted(tr.rings)
        rep.rings = dict(zip(names, (int(v) for v in world.allreduce(
            np.array([tr.rings[k] for k in names], np.int64)))))
        nbytes = int(reduce_max(world, [sum(traffic.values())])[0])
        msgs = int(reduce_max(world, [len(events)])[0])
        # what the cost model prices (costmodel.tools.accuracy): each rank's traced events of
        # the first step and where it sits, (replica, stage, tensor rank, lo, lo + the
        # number of layers it holds): its layers when contiguous (V = 1), their count
        # from its first one when interleaved
        summaries = world.gather(event_summary(events), root=0)
        lo = tr.layers[0] if tr.layers else tr.chunk_layers[0].start
        coords = world.gather(list(mesh.coords) + [lo, lo + len(tr.layers)], root=0)
        finished = True
    finally:
        mesh.free()
        ref = tokens = targets = expect = None     # views of the window, then the window
        if finished:    # freeing is collective: a rank that raised must reach the abort
            shared.free()
        else:
            shared.abandon()
            if step_ref is not None:
                step_ref.abandon()
    rss = int(reduce_max(world, [peak_rss_bytes()])[0])
    return Result(case, p, chk, timing, nbytes, msgs, rss, summaries, coords,
                  str(fault) if fault else "", extra={"report": rep},
                  fault_applied=rep.fault_applied)
