"""Optimizers, the training loop, and a small synthetic task.

The optimizers update any dict of arrays in place and keep their state per key,
so a parallel scheme runs them unchanged on its local shards (after it has
reduced the gradients it must reduce).

    python -m summasim.transformer.train            # 2-layer model on the copy task

Every argument is checked before training (sizes are positive integers, the
heads divide the hidden size, the period fits the sequence, rates are finite);
a user error is one line on stderr and exit status 2. A run whose loss becomes
non-finite stops at that step with one line on stderr and exit status 1.

The copy task: each sequence is a random pattern of ``period`` tokens repeated
to fill it; the model predicts the next token. Only the first ``period - 1``
targets cannot be predicted, so the loss can fall from ln(vocab) at
initialisation to ``(period - 1) / seq * ln(vocab)`` (the "floor").
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Callable, Optional

import numpy as np
from threadpoolctl import threadpool_limits

from summasim import cli
from summasim.spec import parse_loss_scale
from summasim.backends import array_module

from . import model, ops
from .precision import LossScaler, Precision, has_overflow

PROG = "python -m summasim.transformer.train"


class NonFiniteLoss(FloatingPointError):
    """The loss of a training step is NaN or infinite (``step`` counts from 1)."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"the loss is non-finite ({loss}) at step {step}")
        self.step, self.loss = step, loss


class SGD:
    """``p -= lr * g``, or with momentum ``buf = momentum * buf + g; p -= lr * buf``.

    ``weight_decay`` adds ``weight_decay * p`` to the gradient (L2). State:
    ``self.state[key] = {"momentum_buffer": array}``.
    """

    def __init__(self, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        if lr <= 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD needs lr > 0, momentum >= 0, weight_decay >= 0; got "
                             f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.state: dict = {}

    def step(self, params: dict, grads: dict) -> None:
        """Update ``params[key]`` in place for every key of ``grads``."""
        for key, g in grads.items():
            p = params[key]
            if self.weight_decay:
                g = g + self.weight_decay * p
            if self.momentum:
                st = self.state.get(key)
                if st is None:
                    st = self.state[key] = {"momentum_buffer": g.copy()}
                else:
                    buf = st["momentum_buffer"]
                    buf *= self.momentum
                    buf += g
                g = st["momentum_buffer"]
            p -= self.lr * g


#: Bytes per array per block of Adam's chain on host arrays (:meth:`Adam.step`): 256 KiB
#: (64 Ki float32 items, as :data:`summasim.transformer.ops.GELU_BLOCK`; 32 Ki float64).
#: Adam over the 3.3M parameters of ``bench mesh --torch``'s model on one thread, best
#: of 7 in alternating blocks, three rounds: float64 32.2-32.8 ms whole, 23.6-24.2 in
#: blocks of 16 Ki items, 24.3-25.6 of 32 Ki, 26.4-28.2 of 64 Ki; float32 15.1-20.0 ms
#: before (fresh temporaries), 12.1-16.4 in blocks of 64 Ki, 14.8-19.2 of 256 Ki.
ADAM_BLOCK_BYTES = 1 << 18


@functools.lru_cache(maxsize=None)
def _float_products_keep(dtype) -> bool:
    """Whether ``array * python_float`` keeps ``dtype`` (float16/32/64 do; ml_dtypes'
    bfloat16 gives float32), asked once per dtype; CuPy follows NumPy's rules."""
    return (np.empty(0, dtype=dtype) * 0.5).dtype == dtype


class Adam:
    """Adam with bias correction (Kingma & Ba 2015) and decoupled weight decay (AdamW).

    First ``p -= lr * weight_decay * p`` for keys where ``decay(key, p)`` is true
    (default: matrices only, GPT-2 style: no decay on biases and LayerNorm), as
    PyTorch's AdamW does; then ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``.
    State per key: ``{"step": t, "m": array, "v": array}``.
    """

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0,
                 decay: Optional[Callable] = None):
        b1, b2 = betas
        if lr <= 0 or not (0 <= b1 < 1 and 0 <= b2 < 1) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"Adam needs lr > 0, 0 <= betas < 1, eps > 0, weight_decay >= 0; "
                             f"got lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.lr, self.b1, self.b2 = float(lr), float(b1), float(b2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.decay = decay if decay is not None else (lambda key, p: p.ndim >= 2)
        self.state: dict = {}
        self._flat: dict = {}     # (module, dtype) -> two flat scratch arrays (_scratch)

    def step(self, params: dict, grads: dict) -> None:
        """Update ``params[key]`` in place for every key of ``grads``.

        A key whose gradient has its parameter's dtype and shape, of a dtype whose
        products with a Python float keep it (float16, float32, float64; not ml_dtypes'
        bfloat16, whose products are float32), runs the update as one chain of in-place
        operations through two scratch arrays (the same operations in the same order as
        with fresh temporaries, so the same bits). On C-contiguous NumPy arrays the chain
        runs block by block (:data:`ADAM_BLOCK_BYTES` per array) through two block-sized
        scratch arrays kept between steps, so its 13 passes stay in the core's caches and
        each of p, g, m and v streams through main memory once; other arrays (CuPy, or
        strided) take two scratch arrays for the key, freed after it. Other keys take
        a fresh temporary per operation."""
        for key, g in grads.items():
            p = params[key]
            xp = array_module(p)
            st = self.state.get(key)
            if st is None:
                st = self.state[key] = {"step": 0, "m": xp.zeros_like(p), "v": xp.zeros_like(p)}
            st["step"] += 1
            t, m, v = st["step"], st["m"], st["v"]
            decay = 1.0 - self.lr * self.weight_decay if (
                self.weight_decay and self.decay(key, p)) else None
            # the chain's constants, as the formula of the class docstring computes them
            c = (1.0 - self.b1, 1.0 - self.b2, 1.0 / (1.0 - self.b2 ** t),
                 self.lr / (1.0 - self.b1 ** t))
            if (g.dtype != p.dtype or g.shape != p.shape
                    or not _float_products_keep(np.dtype(p.dtype))):
                if decay is not None:
                    p *= decay
                m *= self.b1
                m += c[0] * g
                v *= self.b2
                v += c[1] * (g * g)
                denom = xp.sqrt(v * c[2])                       # sqrt(v_hat)
                denom += self.eps
                p -= c[3] * m / denom
                continue
            arrays = (p, g, m, v)
            if xp.__name__ == "numpy" and all(a.flags.c_contiguous for a in arrays):
                flat = [a.reshape(-1) for a in arrays]
                n = max(1, ADAM_BLOCK_BYTES // p.itemsize)
                scratch = self._scratch(xp, p.dtype, min(n, p.size))
                for i in range(0, p.size, n):
                    k = min(n, p.size - i)
                    self._chain(xp, *(a[i:i + k] for a in flat),
                                *(s_[:k] for s_ in scratch), c, decay)
            else:     # whole arrays: scratch for this key alone, not kept
                self._chain(xp, p, g, m, v, xp.empty_like(p), xp.empty_like(p), c, decay)

    def _chain(self, xp, p, g, m, v, d, u, c, decay) -> None:
        """One Adam update of ``p`` (in place, with ``m`` and ``v``) through the scratch
        arrays ``d`` and ``u`` shaped like ``p``; ``c``: ``(1 - b1, 1 - b2,
        1 / (1 - b2^t), lr / (1 - b1^t))``, ``decay``: ``1 - lr wd`` or None."""
        if decay is not None:
            p *= decay
        m *= self.b1
        m += xp.multiply(g, c[0], out=u)
        v *= self.b2
        xp.multiply(g, g, out=u)
        u *= c[1]
        v += u
        xp.multiply(v, c[2], out=d)
        xp.sqrt(d, out=d)                                       # sqrt(v_hat)
        d += self.eps
        xp.multiply(m, c[3], out=u)
        u /= d
        p -= u

    def _scratch(self, xp, dtype, size: int):
        """Two flat scratch arrays of module ``xp`` and ``dtype`` of at least ``size``
        items (at most a block's), kept between steps and grown when a key needs more."""
        key = (xp.__name__, dtype)
        flat = self._flat.get(key)
        if flat is None or flat[0].size < size:
            flat = self._flat[key] = (xp.empty(size, dtype), xp.empty(size, dtype))
        return flat


def copy_task_batch(rng, batch: int, seq: int, vocab: int, period: int):
    """``(tokens, targets)`` [batch, seq]: a random ``period``-token pattern repeated."""
    if not 1 <= period <= seq:
        raise ValueError(f"period must be in [1, seq={seq}], got {period}")
    pattern = rng.integers(0, vocab, (batch, period))
    reps = -(-(seq + 1) // period)
    stream = np.tile(pattern, (1, reps))[:, : seq + 1]      # (batch, seq + 1)
    return stream[:, :-1], stream[:, 1:]


def copy_task_floor(seq: int, vocab: int, period: int) -> float:
    """The lowest expected loss on the copy task: ``(period - 1) / seq * ln(vocab)``."""
    return (min(period, seq + 1) - 1) / seq * math.log(vocab)


def mixed_precision_grads(master: dict, tokens, targets, config: model.Config,
                          precision: Precision, loss_scale: float = 1.0, **forward_kw):
    """The loss and the gradients of one mixed-precision step (Micikevicius et al. 2018):
    the fp32 ``master`` weights rounded to ``precision``'s 16-bit type, the forward and
    backward under :func:`ops.autocast`, the backward seeded with ``loss_scale`` times the
    loss. Returns ``(loss, grads)``; the gradients are fp32 and still scaled."""
    if config.dtype != np.float32:
        raise ValueError(f"mixed precision keeps fp32 master weights: Config.dtype must be "
                         f"float32, got {config.dtype}")
    compute = precision.round_tree(master)             # the 16-bit weights, float32 boxes
    with ops.autocast(precision):
        loss, cache = model.forward(compute, tokens, targets, config, **forward_kw)
        grads = model.backward(cache, loss_scale=loss_scale)
    return loss, grads


def train(params: dict, config: model.Config, batches: Callable, optimizer, steps: int,
          callback: Optional[Callable] = None, checkpoint: bool = False, *,
          precision: Optional[Precision] = None, scaler: Optional[LossScaler] = None,
          overflow_at=()) -> list:
    """Run ``steps`` optimizer steps; returns the loss of every step.

    ``batches(step) -> (tokens, targets)``; ``callback(step, loss)`` is called
    after every step (e.g. to print). ``params`` are updated in place. A loss that
    is NaN or infinite raises :class:`NonFiniteLoss` before that step's update
    (the run has diverged; nothing after it would mean anything).

    With ``precision`` (mixed precision: ``params`` are the fp32 master weights), each
    step is :func:`mixed_precision_grads` with ``scaler``'s scale (default: no scaling);
    a step whose gradients hold an Inf or a NaN is skipped and the scaler told
    (:class:`~summasim.transformer.precision.LossScaler`); otherwise the gradients are
    unscaled and the optimizer updates the master weights. ``overflow_at`` lists steps
    (from 0) whose first gradient entry is set to Inf after the backward, to see them
    skipped.
    """
    losses = []
    if precision is not None and scaler is None:
        scaler = LossScaler("none")
    for step in range(steps):
        tokens, targets = batches(step)
        if precision is None:
            loss, cache = model.forward(params, tokens, targets, config,
                                        checkpoint=checkpoint)
            if not math.isfinite(float(loss)):
                raise NonFiniteLoss(step + 1, float(loss))
            grads = model.backward(cache)
            del cache
            optimizer.step(params, grads)
        else:
            scale = scaler.scale
            loss, grads = mixed_precision_grads(params, tokens, targets, config, precision,
                                                scale, checkpoint=checkpoint)
            if not math.isfinite(float(loss)):
                raise NonFiniteLoss(step + 1, float(loss))
            if step in overflow_at:
                next(iter(grads.values())).reshape(-1)[0] = np.inf
            if scaler.update(has_overflow(grads.values())):
                for g in grads.values():
                    g *= 1.0 / scale
                optimizer.step(params, grads)
        losses.append(loss)
        if callback is not None:
            callback(step, loss)
    return losses


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m summasim.transformer.train``; every argument
    is checked as it is parsed (:mod:`summasim.cli`), the rest by :func:`check_args`."""
    ap = cli.ArgumentParser(prog=PROG, description="Train the serial reference on the copy task.")
    ap.add_argument("--steps", type=cli.int_between(1, MAX_STEPS), default=300,
                    help=f"optimizer steps (at most {MAX_STEPS})")
    ap.add_argument("--batch", type=cli.positive_int, default=32, help="sequences per step")
    ap.add_argument("--vocab", type=cli.positive_int, default=16, help="vocabulary size")
    ap.add_argument("--seq", type=cli.positive_int, default=16, help="sequence length")
    ap.add_argument("--period", type=cli.positive_int, default=4,
                    help="length of the repeated pattern (at most --seq)")
    ap.add_argument("--hidden", type=cli.positive_int, default=32, help="hidden size")
    ap.add_argument("--heads", type=cli.positive_int, default=2,
                    help="attention heads (must divide --hidden)")
    ap.add_argument("--layers", type=cli.int_between(1, 1024), default=2,
                    help="transformer layers (at most 1024)")
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                    default="float32",
                    help="element type; bfloat16 and float16 are mixed precision (16-bit "
                         "compute, fp32 master weights and Adam)")
    ap.add_argument("--loss-scale", default=None, metavar="dynamic|static:S|none",
                    help="loss scaling under mixed precision (default dynamic for float16, "
                         "none for bfloat16)")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--lr", type=cli.finite_positive_float, default=None,
                    help="learning rate > 0; default 3e-3 (adam), 0.3 (sgd)")
    ap.add_argument("--momentum", type=cli.float_range(0, 1, hi_open=True), default=None,
                    help="SGD momentum, 0 <= momentum < 1 (default 0.9; --optimizer sgd "
                         "only)")
    ap.add_argument("--weight-decay", type=cli.finite_nonnegative_float, default=0.0,
                    help="weight decay >= 0")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    ap.add_argument("--threads", type=cli.int_between(1, 256), default=1,
                    help="BLAS threads (small model: 1; at most 256)")
    ap.add_argument("--log-every", type=cli.positive_int, default=25,
                    help="print the loss every this many steps")
    ap.add_argument("--seed", type=cli.nonnegative_int, default=0, help="random seed >= 0")
    return ap


def check_args(args) -> model.Config:
    """What no single argument tells: the period fits the sequence and the heads
    divide the hidden size. Returns the model's Config; raises
    :class:`summasim.cli.UsageError` naming the argument."""
    cli.require(args.momentum is None or args.optimizer == "sgd",
                f"argument --momentum: momentum is SGD's; --optimizer {args.optimizer} has "
                f"none (Adam's moments are fixed at betas 0.9, 0.999)")
    cli.require(args.period <= args.seq, f"argument --period: must be at most --seq "
                                         f"{args.seq}, got {args.period}")
    cli.require(args.hidden % args.heads == 0,
                f"argument --heads: {args.heads} heads do not divide --hidden {args.hidden} "
                f"(every head has hidden/heads whole columns)")
    cli.require(args.hidden >= 3, f"argument --hidden: a LayerNorm over {args.hidden} "
                                  f"feature(s) outputs the same values whatever its input, so "
                                  f"no gradient reaches the layers before it; give 3 or more")
    mixed = args.dtype in ("bfloat16", "float16")
    cli.require(mixed or args.loss_scale is None,
                f"argument --loss-scale: needs --dtype bfloat16 or float16, got {args.dtype}")
    if mixed:
        try:
            args.loss_scale = parse_loss_scale(args.loss_scale or (
                "dynamic" if args.dtype == "float16" else "none"))
        except ValueError as exc:
            raise cli.UsageError(f"argument --loss-scale: {exc}") from None
    try:
        config = model.Config(vocab=args.vocab, seq=args.seq, hidden=args.hidden,
                              heads=args.heads, layers=args.layers,
                              dtype="float32" if mixed else args.dtype)
    except ValueError as exc:   # pragma: no cover - the checks above cover Config's
        raise cli.UsageError(str(exc)) from None
    check_memory(config, args.batch, args.optimizer)
    return config


#: the most optimizer steps one run takes
MAX_STEPS = 1_000_000
#: the share of the memory the OS calls available that a run may use
HEADROOM = 0.85


def train_bytes(config: model.Config, batch: int, optimizer: str) -> int:
    """Bytes a training step of ``config`` on ``batch`` sequences holds: the parameters,
    their gradients and the optimizer's state (Adam: two moments; SGD: a momentum), and
    the activations the forward keeps for the backward (:func:`model.activation_items`)
    twice (their gradients), with the logits' share of the batch."""
    it = np.dtype(config.dtype).itemsize
    params = sum(math.prod(s) for s in model.param_shapes(config).values())
    acts = model.activation_items(config, batch, config.seq).total
    return it * ((4 if optimizer == "adam" else 3) * params + 2 * acts)


def check_memory(config: model.Config, batch: int, optimizer: str) -> None:
    """A :class:`summasim.cli.UsageError` before any allocation when a step does not fit
    in :data:`HEADROOM` of the available memory, naming the largest batch that does."""
    need, budget = train_bytes(config, batch, optimizer), HEADROOM * cli.available_memory()
    if need <= budget:
        return
    lo, hi = 0, batch                     # the largest batch that fits: lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if train_bytes(config, mid, optimizer) <= budget else (lo, mid)
    fits = lo
    raise cli.UsageError(f"a training step needs about {need / 2**30:.3g} GiB, but "
                         f"{budget / 2**30:.3g} GiB can be used ({HEADROOM:.0%} of what is "
                         f"available); " + (f"--batch {fits} fits" if fits else
                                            "the model does not fit even at --batch 1"))


def main(argv=None) -> list:
    """Train on the copy task; returns the losses. A user error exits with status 2,
    a diverged run (non-finite loss) with status 1, each after one line on stderr."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        config = check_args(args)
    except cli.UsageError as exc:
        ap.error(str(exc))
    params = model.init_params(config, args.seed)
    if args.optimizer == "adam":
        opt = Adam(lr=args.lr or 3e-3, weight_decay=args.weight_decay)
    else:
        opt = SGD(lr=args.lr or 0.3, momentum=0.9 if args.momentum is None else args.momentum,
                  weight_decay=args.weight_decay)
    rng = np.random.default_rng(args.seed + 1)
    floor = copy_task_floor(args.seq, args.vocab, args.period)
    print(f"copy task: vocab {args.vocab}, seq {args.seq}, period {args.period}; "
          f"ln(vocab) = {math.log(args.vocab):.3f}, floor = {floor:.3f}; "
          f"{args.layers} layers, hidden {args.hidden}, {args.optimizer}, {args.dtype}")
    t0 = time.perf_counter()

    def log(step, loss):
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            print(f"step {step + 1:5d}  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)

    mixed = {}
    if args.dtype in ("bfloat16", "float16"):
        mixed = {"precision": Precision.of(args.dtype), "scaler": LossScaler(args.loss_scale)}
    try:
        # a diverging run overflows on its way to NaN; the loss check below reports it
        with threadpool_limits(args.threads), np.errstate(over="ignore", invalid="ignore"):
            losses = train(params, config,
                           lambda step: copy_task_batch(rng, args.batch, args.seq,
                                                        args.vocab, args.period),
                           opt, args.steps, callback=log, checkpoint=args.checkpoint, **mixed)
        if mixed:
            s = mixed["scaler"]
            print(f"mixed precision ({args.dtype}, loss scale {args.loss_scale}): "
                  f"{s.skipped} of {s.steps} steps skipped on overflow, final scale "
                  f"{s.scale:g}")
            if s.steps and s.skipped == s.steps:
                cli.print_error(PROG, f"every step was skipped on overflow: nothing was "
                                      f"trained (--loss-scale {args.loss_scale})")
                raise SystemExit(1)
        return losses
    except NonFiniteLoss as exc:
        decay = f", --weight-decay {args.weight_decay:g}" if args.weight_decay else ""
        hint = "a smaller --lr or --weight-decay" if args.weight_decay else "a smaller --lr"
        cli.print_error(PROG, f"training diverged: {exc} (--lr {opt.lr:g}{decay}, "
                              f"{args.optimizer}); try {hint}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:            # Ctrl-C: one line, as every front-end says it
        sys.stderr.write(f"{PROG}: interrupted (SIGINT)\n")
        sys.exit(130)
