"""The training-step executor: a tensor-parallel scheme next to the serial model.

What is measured
----------------
* agreement with the serial model (loss, logits, every unsharded gradient, with and
  without checkpointing), as ``max |par - ser| / max |ser|`` per tensor; a NaN or
  Inf anywhere fails the run on whichever rank it sits (collective flags);
* per-layer Table 1 traffic: the payload of the events in phases ``h{l}.fwd/tp.*``
  and ``h{l}.bwd/tp.*`` against :func:`table1_payload`;
* forward and backward times with the harness's timer;
* per-rank memory with ``tracemalloc`` next to the cost model's formula.

The serial reference runs once, on rank 0 (the others sleep). Its inputs,
parameters, gradients and logits go into one read-only shared-memory copy per node
(:class:`~summasim.harness.shared.NodeShared`); every rank copies out only its own
block of each (``module.shard``, ``module.local_logits``) and compares its shard with
it, scaled by the whole tensor's ``max |ser|`` that rank 0 computed. So no rank but
rank 0 holds a whole model, and the errors are those of the unsharded comparison:
the worst over the ranks of ``max |par - ser|`` over a block is the ``max`` over the
tensor. (Replicated tensors are compared on every rank that holds them; a fault on one
rank fails that rank.)
"""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from ..comm import Comm
from summasim.costmodel.tools.accuracy import event_summary
from ..backends import array_module, backend_of, is_device_array, to_backend
from ..mpiutil import LONG_WAIT_NAP_S, agreement, quiet_barrier
from ..transformer import model
from ..transformer.schemes import get_scheme
from ..transformer.train import Adam
from .check import Check, collective
from .inject import Fault, corrupt_entry
from .memory import peak_rss_bytes, scheme_memory
from .result import Result
from .shared import NodeShared
from .timing import reduce_max, time_calls
from ..validate import training_tolerance


def table1_payload(name: str, config: model.Config, batch: int, p: int, q: int = 1,
                   d: int = 1, pc: int = 0, j: int = 0, i: int = 0) -> dict:
    """Per-rank Table 1 payload of one layer, in scalars.

    Megatron: the all-reduced items, ``2 bsh`` forward, ``2 bsh`` backward and ``4 bsh``
    backward with checkpointing (0 at p = 1), for every model variant. Optimus /
    SUMMA2.5: the broadcast and reduce payload of the layer's SUMMA products
    (:func:`summasim.transformer.optimus.layer_payload`: ``((3 + f) b s h / d + (4 + 2f)
    h^2) / q`` forward for GPT-2's MLP of multiplier f, ``(7 bsh/d + 12 h^2)/q`` at f = 4;
    SwiGLU's gate and grouped-query attention's narrower QKV change it), 2x that in
    backward and 3x with checkpointing (0 when q = 1). The 3D layer: the closed form
    of its all-gathers and reduce-scatters
    (:func:`summasim.transformer.tp3d.layer_payload`). On a rectangular grid (``pc``
    columns) or an MLP width that does not divide, the payload of a rank of column
    ``j`` (column 0 moves the most); on the 3D cube, of rank (., ``i``, ``j``) (rank
    (0, 0) moves the most).
    """
    b, s, h = batch, config.seq, config.hidden
    if name == "megatron":
        fwd = 2 * b * s * h if p > 1 else 0
    elif get_scheme(name).grid_kind == "3d":   # all-gathers and reduce-scatters
        from ..transformer.tp3d import layer_payload as tp3d_payload

        return tp3d_payload(config, b, q, i=i, j=j)
    else:
        from ..transformer.optimus import layer_payload

        fwd = layer_payload(config, b, q, d, pc=pc or q, j=j)["fwd"]
    return {"fwd": fwd, "bwd": 2 * fwd, "bwd_checkpoint": 3 * fwd if name != "megatron"
            else 2 * fwd}


def layer_tp_items(events, layer: int, direction: str, itemsize: int,
                   ring: bool = False, cube: bool = False) -> int:
    """Scalars of Table 1 traffic recorded for one layer and direction ("fwd"/"bwd"):
    its broadcasts, reduces and all-reduces, or with ``ring`` (Megatron's sequence
    parallelism, whose collectives are ring halves) the items its ring steps send, or
    with ``cube`` (the 3D layer) its all-gathers and reduce-scatters."""
    prefix = f"h{layer}.{direction}/tp."
    ops = (("sendrecv",) if ring else ("allgather", "reduce_scatter") if cube
           else ("bcast", "reduce", "allreduce"))
    groups = ("row", "col", "depth") if cube else ("row", "col", "world")
    return sum(e.nbytes for e in events
               if e.phase.startswith(prefix) and e.op in ops
               and (ring or e.group in groups)) // itemsize


def scale_of(ser) -> float:
    """``max |ser|`` over a whole serial tensor (0 when empty; NaN when it holds a
    non-finite value, which makes every error measured against it NaN)."""
    ser = np.asarray(ser)
    if not ser.size:
        return 0.0
    top = float(np.max(np.abs(ser)))
    return top if math.isfinite(top) and np.isfinite(ser).all() else math.nan


def block_err(par, ser, scale: float) -> float:
    """``max |par - ser| / scale`` over one rank's block ``par`` (any backend) of a
    tensor whose serial block is ``ser`` and whose whole serial tensor has ``max |.|
    = scale`` (:func:`scale_of`): the max over the ranks' blocks is ``max |par - ser| /
    max |ser|`` of the whole tensor. 0 for an empty block; NaN when ``par`` or the scale is not
    finite; inf when ``par`` does not have the serial block's shape."""
    if math.isnan(scale):
        return math.nan
    par = np.asarray(backend_of(par).to_numpy(par), dtype=np.float64)
    if par.shape != np.shape(ser):          # a block of the wrong shape is wrong, not 0
        return math.inf
    if not par.size:
        return 0.0
    if not np.isfinite(par).all():
        return math.nan
    diff = float(np.max(np.abs(par - np.asarray(ser, dtype=np.float64))))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def loss_error(loss: float, ref: float) -> float:
    """``|loss - ref| / |ref|`` (NaN when ``loss`` is not finite). A reference loss of
    exactly 0 (one class: every softmax is 1) is a scale of 0, as in :func:`block_err`:
    0 when the loss equals it, inf otherwise."""
    if not math.isfinite(loss):
        return math.nan
    diff = abs(loss - ref)
    return diff / abs(ref) if ref != 0 else (0.0 if diff == 0 else math.inf)


def _worst(values):
    """Max that keeps NaN (a NaN anywhere is the answer)."""
    vals = list(values)
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals) if vals else 0.0


def _nbytes(d: dict) -> int:
    return int(sum(a.nbytes for a in d.values() if hasattr(a, "nbytes")))


@dataclass
class SchemeReport:
    """One scheme's validation, timings, traffic and memory on one grid."""

    scheme: str
    grid: str
    p: int
    q: int
    d: int
    dtype: str
    loss_err: float = 0.0
    logits_err: float = 0.0
    grad_err: float = 0.0
    worst_grad: str = ""
    bound: float = math.nan      # validate.training_tolerance of the case
    ok: bool = False
    nonfinite: bool = False
    bad_ranks: list = field(default_factory=list)
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    tp_fwd: int = 0
    tp_bwd_checkpoint: int = 0
    table1: dict = field(default_factory=dict)
    aux_bytes: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    memory_formula: dict = field(default_factory=dict)
    fault: str = ""
    fault_applied: bool = True
    batch: int = 0                  # the sequences of the step (a row may raise the default)
    case: dict = field(default_factory=dict)    # the case's to_dict(): model and grid
    load: dict | None = None        # other processes' load while it ran (rank 0)
    predicted_s: float | None = None    # cost model: one fwd + bwd step (slowest rank)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured of fwd + bwd, or None without a prediction."""
        step = self.fwd_s + self.bwd_s
        if self.predicted_s is None or step <= 0:
            return None
        return (self.predicted_s - step) / step


class _HostMemory:
    """Live and peak bytes of host arrays (tracemalloc, started if it was not on)."""

    def __enter__(self):
        self.was = tracemalloc.is_tracing()
        if not self.was:
            tracemalloc.start()
        tracemalloc.reset_peak()
        return self

    def live(self) -> int:
        return tracemalloc.get_traced_memory()[0]

    def peak(self) -> int:
        return tracemalloc.get_traced_memory()[1]

    def __exit__(self, *exc):
        if not self.was:
            tracemalloc.stop()


class _DeviceMemory:
    """Live bytes of a device's arrays (the array library's memory pool, after waiting
    for the stream). The pool keeps no peak: the peak is the largest reading."""

    def __init__(self, xp):
        self.pool = xp.get_default_memory_pool()
        self.sync = xp.cuda.get_current_stream().synchronize
        self.top = 0

    def __enter__(self):
        return self

    def live(self) -> int:
        self.sync()
        used = self.pool.used_bytes()
        self.top = max(self.top, used)
        return used

    def peak(self) -> int:
        return self.top

    def __exit__(self, *exc):
        pass


def measure_memory(module, local, tokens, targets, config, grid, checkpoint: bool) -> dict:
    """Per-rank bytes: params, grads, optimizer (Adam), activations held after forward,
    and the peak of forward + backward above what was live before.

    Host arrays are counted with tracemalloc. On a device (CuPy) the live bytes are the
    memory pool's ``used_bytes``, read after the forward and after the backward; the pool
    keeps no peak, so ``peak_fwd_bwd`` there is the larger reading, a lower bound."""
    first = next(iter(local.values()))
    probe = _DeviceMemory(array_module(first)) if is_device_array(first) else _HostMemory()
    with probe:
        before = probe.live()
        loss, cache = module.forward(local, tokens, targets, config, grid, checkpoint=checkpoint)
        held = probe.live() - before
        grads = module.backward(cache)
        probe.live()
        peak = probe.peak() - before
        del cache
    opt = Adam()
    opt.step({k: v.copy() for k, v in local.items()}, grads)
    state = sum(st["m"].nbytes + st["v"].nbytes for st in opt.state.values())
    return {"params": _nbytes(local), "grads": _nbytes(grads), "optimizer": int(state),
            "activations": int(held), "peak_fwd_bwd": int(peak)}


def memory_formula(name: str, config: model.Config, batch: int, p: int, q: int, d: int,
                   checkpoint: bool, pc: int = 0) -> dict:
    """The cost model's per-rank memory formula for the same configuration (bytes)."""
    mem = scheme_memory(name, p, q, d, config, batch, checkpoint, pc)
    return {"params": mem.params + mem.embedding, "grads": mem.grads,
            "optimizer": mem.optimizer, "activations": mem.activations}


def _inputs(config, batch, seed):
    rng = np.random.default_rng(seed)
    params = model.init_params(config, seed)
    for val in params.values():  # noise on 1-D params so bias/LayerNorm bugs show
        if val.ndim == 1:
            val += rng.normal(0.0, 0.1, size=val.shape).astype(val.dtype)
    tokens = rng.integers(0, config.vocab, size=(batch, config.seq))
    targets = rng.integers(0, config.vocab, size=(batch, config.seq))
    return params, tokens, targets


def _fault_key(grads: dict) -> str:
    weights = sorted(k for k in grads if k.endswith(".w") or k == "wte")
    return weights[0] if weights else sorted(grads)[0]


def run_transformer(case, world, backend=None, *, repeats: int = 3, seed: int = 0,
                    fault: Fault | None = None, timed: bool = True, with_memory: bool = True,
                    bound: float | None = None):
    """Validate scheme ``case.scheme`` against the serial model and measure it
    (collective). Returns a :class:`~summasim.harness.execute.Result` whose
    ``extra["report"]`` is the :class:`SchemeReport`."""
    spec = get_scheme(case.scheme)
    module = spec.module
    config, batch, q, d, pc = case.config, case.batch, case.q, case.d, case.pc
    rank, p = world.Get_rank(), world.Get_size()
    if bound is None:
        bound = training_tolerance(config, batch, case.dtype)
    wide = dataclasses.replace(config, dtype=np.dtype(np.float64))   # the reference's
    ref = None
    if rank == 0:        # the serial reference, in float64; the other ranks sleep meanwhile
        params, tokens, targets = _inputs(config, batch, seed)
        exact = {k: v.astype(np.float64) for k, v in params.items()}
        loss, cache = model.forward(exact, tokens, targets, wide)
        del exact
        grads = model.backward(cache)
        ref = {"params": params, "tokens": tokens, "targets": targets, "loss": loss,
               "logits": cache.logits, "grads": grads, "logits_scale": scale_of(cache.logits),
               "grad_scales": {k: scale_of(v) for k, v in grads.items()}}
        del cache, params, grads
    quiet_barrier(world, longest=LONG_WAIT_NAP_S)   # the others sleep while rank 0 works
    shared = NodeShared(world, ref)      # one read-only copy per node; ranks read blocks
    del ref
    ref = shared.value
    tokens, targets, ref_loss = ref["tokens"], ref["targets"], ref["loss"]

    rep = SchemeReport(case.scheme, spec.grid_label(p, q, d, pc), p, q, d, case.dtype,
                       bound=bound, fault=str(fault) if fault else "", batch=batch,
                       case=case.to_dict())
    try:
        grid = spec.make_grid(world, q, d, backend, pc=pc)
    except BaseException:
        shared.abandon()
        raise
    itemsize = np.dtype(config.dtype).itemsize
    cube = spec.grid_kind == "3d"
    mine = fault is not None and fault.rank == rank
    want_grads = want_logits = None
    finished = False
    try:
        # the rank's shards and the batch on the backend's device (a copy for CuPy only)
        local = to_backend(backend, module.shard(ref["params"], config, grid))
        dev = to_backend(backend, {"tokens": tokens, "targets": targets})
        tokens, targets = dev["tokens"], dev["targets"]
        want_grads = module.shard(ref["grads"], wide, grid)        # this rank's blocks
        want_logits = module.local_logits(ref["logits"], wide, grid)
        scales, logits_scale = ref["grad_scales"], ref["logits_scale"]
        errs = []
        plain_events = []
        for checkpoint in (False, True):
            grid.trace.clear()
            inject_now = mine and not checkpoint
            dropping = inject_now and fault.kind == "drop"
            # drop: the first sum reduction of the step on this rank (comm.DropFault)
            with (Comm.drop_next_sum() if dropping else nullcontext()) as drop:
                loss, cache = module.forward(local, tokens, targets, config, grid,
                                             checkpoint=checkpoint)
                grads = module.backward(cache)
            if dropping:
                rep.fault_applied = drop.applied
            if inject_now and fault.kind != "drop":
                corrupt_entry(grads[_fault_key(grads)], fault.kind)
            events = list(grid.trace.events)
            gerr = {k: block_err(grads[k], want_grads[k], scales[k]) for k in want_grads}
            worst = max(gerr, key=lambda k: math.inf if math.isnan(gerr[k]) else gerr[k])
            lerr = loss_error(loss, ref_loss)
            errs.append((lerr, block_err(cache.logits, want_logits, logits_scale),
                         gerr[worst], worst))
            if checkpoint:
                rep.tp_bwd_checkpoint = int(reduce_max(
                    world, [layer_tp_items(events, 0, "bwd", itemsize, cube=cube)])[0])
                aux: dict = {}
                for e in events:
                    if "/aux." in e.phase or e.phase.startswith("aux."):
                        top = e.phase.split("/")[0]
                        aux[top] = aux.get(top, 0) + e.nbytes
                rep.aux_bytes = aux
            else:
                rep.tp_fwd = int(reduce_max(world, [layer_tp_items(events, 0, "fwd", itemsize,
                                                                   cube=cube)])[0])
                plain_events = events
        local_errs = [_worst(e[i] for e in errs) for i in range(3)]
        key = lambda e: math.inf if math.isnan(e[0]) else e[0]     # noqa: E731
        mine_worst = max(((e[2], e[3]) for e in errs), key=key)
        every = world.allgather((local_errs, mine_worst))
        rep.loss_err, rep.logits_err, rep.grad_err = (_worst(r[0][i] for r in every)
                                                      for i in range(3))
        rep.worst_grad = max((r[1] for r in every), key=key)[1]
        chk = collective(world, Check(_worst(local_errs), bound, "serial model"))
        rep.ok, rep.nonfinite, rep.bad_ranks = chk.ok, chk.nonfinite, chk.bad_ranks
        applied = world.allgather(rep.fault_applied)
        rep.fault_applied = all(applied)
        rep.table1 = table1_payload(case.scheme, config, batch, p, q, d, pc)

        timing = {}
        if timed:
            grid.trace.enabled = False
            holder = {}

            sync = backend.synchronize if backend is not None else (lambda: None)

            def fwd():          # device work is waited for inside the timed call
                holder["cache"] = module.forward(local, tokens, targets, config, grid)[1]
                sync()

            def bwd():
                module.backward(holder["cache"])
                sync()

            fwd()
            with agreement(False):      # the checked forward above agreed on the inputs
                tf = time_calls(fwd, world, repeats, adaptive=False)
                tb = time_calls(bwd, world, repeats, adaptive=False)
            holder.clear()
            rep.fwd_s, rep.bwd_s = tf["median"], tb["median"]
            spans = [f + b for f, b in zip(tf["spans"], tb["spans"])]
            timing = {"spans": spans, "rank_max": [f + b for f, b in zip(
                tf["rank_max"], tb["rank_max"])], "median": rep.fwd_s + rep.bwd_s}
        if with_memory:
            mem = measure_memory(module, local, tokens, targets, config, grid, False)
            rep.memory = {k: int(v) for k, v in zip(mem, reduce_max(world, list(mem.values())))}
            rep.memory_formula = memory_formula(case.scheme, config, batch, p, q, d, False, pc)
        nbytes = int(reduce_max(world, [sum(e.nbytes for e in plain_events)])[0])
        msgs = int(reduce_max(world, [len(plain_events)])[0])
        summaries = world.gather(event_summary(plain_events), root=0)
        coords = world.gather(list(getattr(grid, "coords", (grid.rank,))), root=0)
        finished = True
    finally:
        grid.free()
        ref = tokens = targets = None         # views of the window, then the window
        if finished:    # freeing is collective: a rank that raised must reach the abort
            shared.free()
        else:
            shared.abandon()
    rss = int(reduce_max(world, [peak_rss_bytes()])[0])
    return Result(case, p, chk, timing, nbytes, msgs, rss, summaries, coords,
                  str(fault) if fault else "", extra={"report": rep},
                  fault_applied=rep.fault_applied)
