"""Run a tensor-parallel scheme next to the serial model and measure it.

Used by ``summasim.run`` (its transformer section), the scheme benchmark and the
MPI training test. One place knows the schemes:

==========  ======================  ==============================================
name        module                  grid
==========  ======================  ==============================================
megatron    transformer.megatron    ``Grid1D`` over all p ranks
optimus     transformer.optimus     ``Grid(comm, q)``, p = q*q
summa25     transformer.optimus     ``Grid(comm, q, d)``, p = d*q*q, d > 1
==========  ======================  ==============================================

What is measured
----------------
* agreement with the serial model (loss, logits, every unsharded gradient), as
  ``max |par - ser| / max |ser|`` per tensor;
* per-layer Table 1 traffic: the payload of the events in phases
  ``h{l}.fwd/tp.*`` and ``h{l}.bwd/tp.*`` (broadcast, reduce and all-reduce on the
  row, column and world groups), against :func:`table1_payload`;
* per-rank memory with ``tracemalloc`` (parameters, gradients, optimizer state,
  activations held after the forward, peak of forward + backward) next to the
  formula of :func:`summasim.costmodel.schemes.memory`.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

from . import model
from .train import Adam

SCHEME_NAMES = ("megatron", "optimus", "summa25")


def scheme_module(name: str):
    """The module implementing scheme ``name``."""
    if name == "megatron":
        from . import megatron

        return megatron
    if name in ("optimus", "summa25"):
        from . import optimus

        return optimus
    raise ValueError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEME_NAMES)}")


def grid_shapes(name: str, p: int) -> list[tuple[int, int]]:
    """``(q, d)`` choices of scheme ``name`` on p ranks (megatron: ``(1, 1)`` meaning 1D)."""
    if name == "megatron":
        return [(1, 1)]
    if name == "optimus":
        q = math.isqrt(p)
        return [(q, 1)] if q * q == p else []
    return [(q, p // (q * q)) for q in range(2, math.isqrt(p) + 1)
            if p % (q * q) == 0 and p // (q * q) >= 2]


def grid_label(name: str, p: int, q: int, d: int) -> str:
    return {"megatron": f"1D p={p}", "optimus": f"{q}x{q}"}.get(name, f"[{q},{q},{d}]")


def preconditions(name: str, config: model.Config, batch: int, p: int, q: int = 1,
                  d: int = 1) -> str:
    """Why scheme ``name`` cannot shard ``config`` at this grid ("" when it can). Pure."""
    if name == "megatron":
        checks = [("heads", config.heads, p), ("vocab", config.vocab, p),
                  ("ffn", config.ffn, p)]
    else:
        checks = [("batch", batch, d * q), ("hidden", config.hidden, q),
                  ("heads", config.heads, q), ("vocab", config.vocab, q),
                  ("ffn", config.ffn, q)]
    bad = [f"{what} = {size} is not divisible by {by}" for what, size, by in checks if size % by]
    return "; ".join(bad)


def make_grid(name: str, world, q: int, d: int, backend=None):
    """The grid a scheme runs on (collective)."""
    from ..grid import Grid, Grid1D

    if name == "megatron":
        return Grid1D(world, backend=backend)
    return Grid(world, q, d, backend=backend)


def table1_payload(name: str, config: model.Config, batch: int, p: int, q: int = 1,
                   d: int = 1) -> dict:
    """Per-rank Table 1 payload of one layer, in scalars.

    Megatron: the all-reduced items, ``2 bsh`` forward, ``2 bsh`` backward and ``4 bsh``
    backward with checkpointing (0 at p = 1). Optimus / SUMMA2.5: the broadcast and
    reduce payload of the four SUMMA products, ``(7 b s h / d + 12 h^2) / q`` forward,
    2x that in backward and 3x with checkpointing (0 when q = 1). Table 1 itself prices
    these with ``2 (p-1)/p`` (ring all-reduce) and ``log2 q`` (binomial trees).
    """
    b, s, h = batch, config.seq, config.hidden
    if name == "megatron":
        fwd = 2 * b * s * h if p > 1 else 0
    else:
        fwd = (7 * b * s * h // d + 12 * h * h) // q if q > 1 else 0
    if name != "megatron" and q > 1:
        assert (7 * b * s * h) % (d * q) == 0 and (12 * h * h) % q == 0
    return {"fwd": fwd, "bwd": 2 * fwd, "bwd_checkpoint": 3 * fwd if name != "megatron"
            else 2 * fwd}


def layer_tp_items(events, layer: int, direction: str, itemsize: int) -> int:
    """Scalars of Table 1 traffic recorded for one layer and direction ("fwd"/"bwd")."""
    prefix = f"h{layer}.{direction}/tp."
    return sum(e.nbytes for e in events
               if e.phase.startswith(prefix) and e.op in ("bcast", "reduce", "allreduce")
               and e.group in ("row", "col", "world")) // itemsize


def rel_err(par, ser) -> float:
    """``max |par - ser| / max |ser|`` (an exact match of zeros is 0)."""
    par = np.asarray(par, dtype=np.float64)
    ser = np.asarray(ser, dtype=np.float64)
    diff = float(np.max(np.abs(par - ser))) if ser.size else 0.0
    scale = float(np.max(np.abs(ser))) if ser.size else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


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
    bound: float = 1e-10
    ok: bool = False
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    tp_fwd: int = 0
    tp_bwd_checkpoint: int = 0
    table1: dict = field(default_factory=dict)
    aux_bytes: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    memory_formula: dict = field(default_factory=dict)
    predicted_s: float | None = None    # cost model: one fwd + bwd step (slowest rank)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured of fwd + bwd, or None without a prediction."""
        step = self.fwd_s + self.bwd_s
        if self.predicted_s is None or step <= 0:
            return None
        return (self.predicted_s - step) / step


def _max_time(fn, world) -> float:
    from mpi4py import MPI

    world.Barrier()
    t0 = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def measure_memory(module, local, tokens, targets, config, grid, checkpoint: bool) -> dict:
    """Per-rank bytes (tracemalloc): params, grads, optimizer (Adam), activations held
    after forward, and the peak of forward + backward above what was live before."""
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        loss, cache = module.forward(local, tokens, targets, config, grid, checkpoint=checkpoint)
        held = tracemalloc.get_traced_memory()[0] - before
        grads = module.backward(cache)
        peak = tracemalloc.get_traced_memory()[1] - before
        del cache
    finally:
        if not was:
            tracemalloc.stop()
    opt = Adam()
    opt.step({k: v.copy() for k, v in local.items()}, grads)
    state = sum(st["m"].nbytes + st["v"].nbytes for st in opt.state.values())
    return {"params": _nbytes(local), "grads": _nbytes(grads), "optimizer": int(state),
            "activations": int(held), "peak_fwd_bwd": int(peak)}


def memory_formula(name: str, config: model.Config, batch: int, p: int, q: int, d: int,
                   checkpoint: bool) -> dict:
    """The cost model's per-rank memory formula for the same configuration (bytes)."""
    from ..costmodel.schemes import Scheme, TransformerConfig, memory

    sch = Scheme.make(name, p=p) if name == "megatron" else Scheme.make(name, q=q, d=d)
    cfg = TransformerConfig(b=batch, s=config.seq, h=config.hidden, n=config.heads,
                            N=config.layers, v=config.vocab, dtype=np.dtype(config.dtype).name,
                            checkpoint=checkpoint)
    mem = memory(sch, cfg)
    return {"params": mem.params + mem.embedding, "grads": mem.grads,
            "optimizer": mem.optimizer, "activations": mem.activations}


def _predict_step(name, world, grid, q, d, config, batch, events, machine) -> float:
    """The cost model's fwd + bwd seconds of this run (collective; same on every rank)."""
    from ..costmodel.accuracy import event_summary, predict_result, transformer_case

    summary = world.gather(event_summary(events), root=0)
    coords = world.gather(list(getattr(grid, "coords", (world.Get_rank(),))), root=0)
    pred = None
    if world.Get_rank() == 0:
        case = transformer_case(name, q, d, batch, config.seq, config.hidden, config.heads,
                                config.vocab, config.layers, config.ffn_mult,
                                np.dtype(config.dtype).name)
        pred = predict_result(dict(case, p=world.Get_size(), events=summary, coords=coords),
                              machine)
    return world.bcast(pred, root=0)


def compare_scheme(name: str, world, q: int, d: int, config: model.Config, batch: int,
                   seed: int = 0, repeats: int = 3, backend=None, bound: float = 1e-10,
                   with_memory: bool = True, machine=None) -> SchemeReport:
    """Validate scheme ``name`` against the serial model and measure it (collective).
    With a cost-model ``machine``, also predict the fwd + bwd step from the traced
    events of every rank (:func:`summasim.costmodel.accuracy.predict_result`)."""
    from mpi4py import MPI

    module = scheme_module(name)
    p = world.Get_size()
    rng = np.random.default_rng(seed)
    params = model.init_params(config, seed)
    for key, val in params.items():  # noise on 1-D params so bias/LayerNorm bugs show
        if val.ndim == 1:
            val += rng.normal(0.0, 0.1, size=val.shape).astype(val.dtype)
    tokens = rng.integers(0, config.vocab, size=(batch, config.seq))
    targets = rng.integers(0, config.vocab, size=(batch, config.seq))
    ref_loss, ref_cache = model.forward(params, tokens, targets, config)
    ref_grads = model.backward(ref_cache)
    ref_logits = ref_cache.logits

    rep = SchemeReport(name, grid_label(name, p, q, d), p, q, d, np.dtype(config.dtype).name,
                       bound=bound)
    grid = make_grid(name, world, q, d, backend)
    itemsize = np.dtype(config.dtype).itemsize
    try:
        local = module.shard(params, config, grid)
        errs = []
        for checkpoint in (False, True):
            grid.trace.clear()
            loss, cache = module.forward(local, tokens, targets, config, grid,
                                         checkpoint=checkpoint)
            grads = module.backward(cache)
            events = list(grid.trace.events)
            full = module.unshard(grads, config, grid)
            logits = module.logits(cache, config, grid)
            gerr = {k: rel_err(full[k], ref_grads[k]) for k in ref_grads}
            worst = max(gerr, key=gerr.get)
            errs.append((abs(loss - ref_loss) / abs(ref_loss), rel_err(logits, ref_logits),
                         gerr[worst], worst))
            if checkpoint:
                rep.tp_bwd_checkpoint = world.allreduce(
                    layer_tp_items(events, 0, "bwd", itemsize), op=MPI.MAX)
                aux: dict = {}
                for e in events:
                    if "/aux." in e.phase or e.phase.startswith("aux."):
                        top = e.phase.split("/")[0]
                        aux[top] = aux.get(top, 0) + e.nbytes
                rep.aux_bytes = aux
            else:
                rep.tp_fwd = world.allreduce(layer_tp_items(events, 0, "fwd", itemsize),
                                             op=MPI.MAX)
                plain_events = events
        worst = max(errs, key=lambda e: max(e[:3]))
        rep.loss_err = world.allreduce(max(e[0] for e in errs), op=MPI.MAX)
        rep.logits_err = world.allreduce(max(e[1] for e in errs), op=MPI.MAX)
        rep.grad_err = world.allreduce(max(e[2] for e in errs), op=MPI.MAX)
        rep.worst_grad = worst[3]
        rep.ok = bool(max(rep.loss_err, rep.logits_err, rep.grad_err) <= bound)
        rep.table1 = table1_payload(name, config, batch, p, q, d)

        # timings (plain, no checkpointing), trace off
        grid.trace.enabled = False
        holder = {}

        def fwd():
            holder["cache"] = module.forward(local, tokens, targets, config, grid)[1]

        def bwd():
            module.backward(holder["cache"])

        fwd()
        bwd()
        tf, tb = [], []
        for _ in range(repeats):
            tf.append(_max_time(fwd, world))
            tb.append(_max_time(bwd, world))
        rep.fwd_s, rep.bwd_s = float(np.median(tf)), float(np.median(tb))
        holder.clear()
        if machine is not None:
            rep.predicted_s = _predict_step(name, world, grid, q, d, config, batch,
                                            plain_events, machine)
        if with_memory:
            mem = measure_memory(module, local, tokens, targets, config, grid, False)
            rep.memory = {k: world.allreduce(v, op=MPI.MAX) for k, v in mem.items()}
            rep.memory_formula = memory_formula(name, config, batch, p, q, d, False)
    finally:
        grid.free()
    return rep
