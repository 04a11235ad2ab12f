"""``bench transformer``: forward + backward time of each tensor-parallel scheme that fits
p, on a one-layer model (default b=16, s=128, h=512, n=8, v=64, float32), next to the
serial model on the same cores (rank 0 alone, all cores, the others asleep): the same
total work, so the ratio is the parallel overhead. Each row is marked with the load of
other processes while it and the serial baseline ran (column ``load``; ``load`` and
``quiet`` in the JSON)."""

from __future__ import annotations

import statistics

import numpy as np

from .common import add_json, add_repeats, given, quiet_bcast, repeats, runtime_config

#: the default model: one layer, b=16 s=128 h=512 n=8 v=64, in float32
DEFAULT_MODEL = "h=512,heads=8,layers=1,seq=128,vocab=64"
DEFAULT_BATCH = 16
DEFAULT_DTYPE = "float32"


def add_arguments(ap):
    from ..options import add_batch, add_dtype, add_model

    add_model(ap, default=DEFAULT_MODEL)
    add_batch(ap, help_more=f"; {DEFAULT_BATCH} for a model without one")
    add_dtype(ap, choices=("float32", "float64"), default=DEFAULT_DTYPE)
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing (recompute each layer's forward in "
                         "backward)")
    add_repeats(ap)
    add_json(ap)


def model_of(args):
    """``(model, batch, dtype)`` of the benchmark (``all``: its defaults where unset)."""
    from ..spec import Model

    model = given(args, "model", None) or Model.parse(DEFAULT_MODEL)
    batch = given(args, "batch", None) or model.batch or DEFAULT_BATCH
    return model, batch, np.dtype(given(args, "dtype", DEFAULT_DTYPE))


def transformer_cases(model, batch: int, dtype, p: int) -> list:
    """The :class:`~summasim.harness.cases.TransformerCase` of every scheme and grid that
    ``bench transformer`` runs at p (for the memory check)."""
    from ..harness.plan import plan_schemes
    from ..transformer.schemes import SCHEMES

    config = runtime_config(model, dtype)
    return plan_schemes(p, SCHEMES, lambda _: config, batch)[0]


def preflight(args, world, gpu) -> str:
    """Each scheme's training memory on this node, rank 0."""
    from ..comm import local_ranks
    from ..harness.memory import check_training_fits

    p = world.Get_size()
    for case in transformer_cases(*model_of(args), p):
        why = check_training_fits(case, p, local_ranks())
        if why:
            return why
    return ""


def bench_transformer(world, model, batch: int, dtype, repeats: int, checkpoint: bool,
                      say) -> list[dict]:
    """Forward+backward seconds of each scheme vs the serial model (collective)."""
    from threadpoolctl import threadpool_limits

    from ..comm import cores
    from ..harness.load import LoadWatch, combine, mark, warn_busy
    from ..harness.shared import NodeShared
    from ..harness.timing import time_calls
    from ..mpiutil import agreement
    from ..transformer import model as serial
    from ..transformer.schemes import SCHEMES

    b, v = batch, model.vocab
    p, rank = world.Get_size(), world.Get_rank()
    config = runtime_config(model, dtype)
    t_serial, inputs = None, None
    watch = LoadWatch(world)          # the load of the serial baseline, then of each row
    if rank == 0:                     # the serial model, on rank 0 only
        params = serial.init_params(config, seed=0)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, v, size=(b, config.seq))
        targets = rng.integers(0, v, size=(b, config.seq))

        def serial_step():
            loss, cache = serial.forward(params, tokens, targets, config,
                                         checkpoint=checkpoint)
            serial.backward(cache)

        with threadpool_limits(limits=cores()):
            t_serial = time_calls(serial_step, None, repeats, adaptive=False,
                                  warmup=1)["median"]
        inputs = {"params": params, "tokens": tokens, "targets": targets}
        del params, tokens, targets
    t_serial, serial_load = quiet_bcast(world, (t_serial, watch.lap()))
    # the model and inputs, one read-only copy per node; each rank shards its own blocks
    shared = NodeShared(world, inputs)
    del inputs
    params, tokens, targets = (shared.value[k] for k in ("params", "tokens", "targets"))
    variant = "".join(f" {k}={v}" for k, v in config.variant().items())
    say(f"transformer: b={b} s={config.seq} h={config.hidden} heads={config.heads} "
        f"vocab={v} layers={config.layers}{variant} {np.dtype(dtype).name}, "
        f"checkpoint={checkpoint}; "
        f"serial forward+backward on {cores()} cores: {t_serial:.4f} s")
    say(f"{'scheme':<9} {'grid':<9} {'median s':>9} {'best s':>8} {'x serial':>9}  load "
        f"(with the serial run's)")
    rows = []
    for name, spec in SCHEMES.items():
        grids = spec.grids(p)
        if not grids:
            say(f"{name:<9} skipped: needs {spec.needs()}; p = {p} does not fit")
        for q, pc, d in grids:
            label = spec.grid_label(p, q, d, pc)
            why = spec.misfit(config, b, p, q, d, pc)
            if why:
                say(f"{name:<9} {label:<9} skipped: {why}")
                continue
            module = spec.module
            grid = spec.make_grid(world, q, d, pc=pc)
            try:
                grid.trace.enabled = False
                local = module.shard(params, config, grid)

                def step():     # timed only: summasim.run validates these schemes
                    loss, cache = module.forward(local, tokens, targets, config, grid,
                                                 checkpoint=checkpoint)
                    module.backward(cache)

                step()      # the inputs agreed once (no value is checked here)
                watch.lap()
                with agreement(False):
                    times = time_calls(step, world, repeats, adaptive=False)["spans"]
                load = world.bcast(combine([serial_load, watch.lap()]), root=0)
            finally:
                grid.free()
            t = statistics.median(times)
            rows.append({"scheme": name, "grid": label, "p": p,
                         "seconds": t, "times": times, "serial_seconds": t_serial,
                         "ratio": t / t_serial, "load": load,
                         "quiet": load and load["quiet"]})
            say(f"{name:<9} {label:<9} {t:>9.4f} {min(times):>8.4f} {t / t_serial:>8.2f}x  "
                f"{mark(load)}")
    warn_busy(rows, "schemes or the serial baseline", say)
    params = tokens = targets = None          # views of the window, then the window
    shared.free()
    return rows


def run(bench) -> bool:
    """Rows under ``report["transformer"]`` (timing only: True)."""
    from ..harness.report import mark_report

    model, batch, dtype = model_of(bench.args)
    rows = bench_transformer(bench.world, model, batch, dtype, repeats(bench.args),
                             bench.args.checkpoint, bench.say)
    bench.report["transformer"] = rows
    bench.report["transformer_shape"] = {"model": str(model), "batch": batch,
                                         "dtype": np.dtype(dtype).name,
                                         "checkpoint": bool(bench.args.checkpoint)}
    mark_report(bench.report, "transformer", [r["load"] for r in rows])
    return True
