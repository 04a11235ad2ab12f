"""``bench mesh``: one training step (every micro-batch's forward and backward, the
gradient reduction, Adam) of each sharded-training composition (``--mesh``, or the
defaults that fit p) next to pure tensor parallelism of the same scheme on all p ranks
(the same model, global batch and engine), with the cost model's prediction for both.
``--overlap`` reduces the gradient buckets while the backward runs (non-blocking rings,
:class:`~summasim.transformer.composed.Trainer`'s ``overlap``); ``--overlap both`` times
each mesh without and with it, side by side; ``--bucket`` sets the gradient bucket.

``--torch`` also trains the same model with PyTorch where it has a peer
(:mod:`summasim.bench.torch_peers`): DDP over gloo next to pure data parallelism
(``dp=P``, ZeRO 0) and DTensor next to pure Megatron tensor parallelism (the "pure tp"
run of ``megatron``), step for step in a rotating order, with the paired ratio's 95%
interval (from 6 ``--repeats``). Without ``--mesh`` it times ``dp=P``, whose pure run is
``tp=megatron:P``: both peers. Run it under a Python that has torch::

    mpiexec -n 4 python -m summasim.bench mesh --torch --dtype float32
"""

from __future__ import annotations

import numpy as np

from .common import add_backend, add_json, add_predict, add_repeats, given, repeats, \
    runtime_config

#: the default model: b=16 s=32 h=128 n=16 v=128, 4 layers, float64
DEFAULT_MODEL = "h=128,heads=16,layers=4,seq=32,vocab=128"
DEFAULT_BATCH = 16
DEFAULT_MICROBATCHES = 2


def add_arguments(ap):
    from ..options import add_dtype, add_model

    add_model(ap, default=DEFAULT_MODEL, help_more="; trained in --dtype")
    add_dtype(ap, ("float64", "float32", "bfloat16", "float16"), "float64",
              help_more="; bfloat16 and float16 are mixed precision (16-bit compute, fp32 "
                        "master weights and Adam; --loss-scale, --grad-reduce)")
    add_training(ap)
    add_backend(ap, "the training steps")
    add_predict(ap, "each step")
    add_repeats(ap)
    ap.add_argument("--torch", action="store_true",
                    help="also train the model with PyTorch where it has a peer: DDP (gloo) "
                         "next to dp=P, DTensor next to pure Megatron tensor parallelism "
                         "(without --mesh: dp=P and its pure run tp=megatron:P; needs torch "
                         "in this Python)")
    add_json(ap)


def check(args) -> None:
    """``--torch``'s needs, before MPI starts; raises :class:`summasim.cli.UsageError`."""
    from .. import cli

    if not getattr(args, "torch", False):
        return
    cli.require(cli.module_available("torch"),
                "argument --torch: PyTorch is not installed in this Python (pip install "
                "torch, or run under a Python that has torch and summasim on its path)")
    cli.require(getattr(args, "dtype", None) in (None, "float32", "float64"),
                f"argument --torch: the PyTorch peers train float32 or float64 models, not "
                f"--dtype {args.dtype}")
    cli.require(getattr(args, "backend", "numpy") == "numpy",
                f"argument --torch: the PyTorch peers run on the CPU, next to --backend "
                f"numpy, not {args.backend}")


def add_training(ap):
    """``--batch``, ``--mesh`` (repeatable) and how the meshes train (``bench all``
    shares them)."""
    from ..options import add_batch, add_mesh
    from ..options import add_training as add_techniques

    add_batch(ap, help_more=f"; {DEFAULT_BATCH} for a model without one")
    add_mesh(ap, repeat=True, help_more=" (default: the main job's default compositions "
                                        "that fit p)")
    add_techniques(ap, microbatches=DEFAULT_MICROBATCHES)
    from ..cli import byte_size

    ap.add_argument("--overlap", nargs="?", const="on", default="off",
                    choices=OVERLAP_MODES,
                    help="reduce each gradient bucket over dp with a non-blocking ring while "
                         "the backward runs: on (--overlap alone), off (the default: the "
                         "blocking ring after the backward) or both (each mesh timed both "
                         "ways, side by side)")
    ap.add_argument("--bucket", type=byte_size, default=None, metavar="BYTES",
                    help="gradient bucket of the meshes (e.g. 64k; default 25 MiB, PyTorch "
                         "DDP's); overlap needs several buckets per stage to overlap anything")


#: ``--overlap``: which ways each mesh is timed.
OVERLAP_MODES = ("off", "on", "both")


#: The techniques of ``spec.Training.techniques`` that ``bench mesh`` runs.
MESH_TECHNIQUES: frozenset = frozenset({"--schedule", "--stages", "--recompute", "--attention",
                                       "--sequence-parallel", "--dtype"})


def training_of(args):
    """The :class:`summasim.spec.Training` of ``args`` (its ``--dtype``, float64 without
    one), or ``ValueError`` naming a contradiction or a technique the benchmark does not
    run yet."""
    from ..options import training
    from ..spec import unsupported

    t = training(args, dtype=getattr(args, "dtype", None) or "float64")
    why = unsupported(t, MESH_TECHNIQUES, "bench mesh")
    if why:
        raise ValueError(why)
    return t


def plan_mesh_bench(args, p: int):
    """``(cases, skips, err)`` of the mesh benchmark (pure)."""
    from ..harness.plan import default_meshes, plan_meshes
    from ..spec import Model

    model = given(args, "model", None) or Model.parse(DEFAULT_MODEL)
    batch = given(args, "batch", None) or model.batch or DEFAULT_BATCH
    try:
        t = training_of(args)
    except ValueError as e:
        return [], [], str(e)
    # mixed precision: 16-bit compute over a float32 model (the master weights)
    config = runtime_config(model, np.float32 if t.mixed else np.dtype(t.dtype).type)
    kw = dict(precision=t.dtype, loss_scale=t.loss_scale,
              grad_reduce=t.grad_reduce) if t.mixed else {}
    if not args.mesh and getattr(args, "torch", False):   # the peers' own compositions
        specs = [(f"dp={p}", dict(zero=0, schedule=t.schedule, microbatches=t.microbatches))]
    elif args.mesh:
        specs = [(str(m), dict(zero=t.zero, schedule=t.schedule, chunks=t.chunks,
                               stages=t.stages, microbatches=t.microbatches,
                               checkpoint=t.checkpoint, recompute=t.recompute,
                               attention=t.attention, sequence_parallel=t.sequence_parallel))
                 for m in args.mesh]
    else:
        specs = default_meshes(p)
    bucket = given(args, "bucket", None)
    if bucket is not None:
        kw["bucket_bytes"] = bucket
    return plan_meshes(p, specs, config, batch,
                       bool(args.mesh) or bool(getattr(args, "torch", False)), **kw)


def preflight(args, world, gpu) -> str:
    """The meshes plan (a --mesh that cannot run is an error) and each fits this node
    (and GPU), with ``--torch``'s peer beside it, rank 0."""
    from ..comm import local_ranks
    from ..harness.memory import check_node_and_gpu, check_training_fits

    p = world.Get_size()
    cases, _, err = plan_mesh_bench(args, p)
    if err:
        return err
    peer = bool(getattr(args, "torch", False))     # the PyTorch peer beside each run
    for case in cases:
        why = check_node_and_gpu(
            lambda n, c=case, **kw: check_training_fits(c, p, n, peer=peer, **kw),
            local_ranks(), gpu)
        if why:
            return why
    return ""


def _pure_tensor(case, p: int):
    """The same scheme on all p ranks (its first grid that shards the model), else
    Megatron over p; ``None`` when neither fits."""
    from ..harness.cases import MeshCase
    from ..transformer.schemes import SCHEMES

    for name in (case.scheme, "megatron"):
        spec = SCHEMES[name]
        for q, pc, d in spec.grids(p):
            grid = str(spec.tensor_grid(p, q, d, pc))   # "optimus:2x2", "3d:2x2x2", ...
            # pure tensor parallelism has one stage: no interleaving
            pure = MeshCase.parse(f"tp={grid}", case.batch, case.config, zero=0,
                                  schedule="1f1b" if case.schedule == "interleaved"
                                  else case.schedule, microbatches=1,
                                  checkpoint=case.checkpoint, recompute=case.recompute,
                                  attention=case.attention,
                                  sequence_parallel=case.sequence_parallel
                                  and spec.grid_kind == "1d", precision=case.precision,
                                  loss_scale=case.loss_scale, grad_reduce=case.grad_reduce)
            if not pure.misfit(p):
                return pure
    return None


def bench_mesh(world, cases, repeats: int, say, machine=None, backend=None,
               overlap: str = "off", torch: bool = False) -> list[dict]:
    """Step seconds of each mesh case and of pure tensor parallelism on the same ranks
    (collective), on ``backend`` (default NumPy). Each run is validated first
    (:func:`~summasim.harness.composed.run_mesh`: three Adam steps against the serial
    model); a failed validation fails the benchmark. The prediction prices each run's
    traced step with ``machine`` (none given: no prediction). ``overlap`` (one of
    :data:`OVERLAP_MODES`): the meshes' dp reductions overlapped with the backward, or
    not, or "both": each mesh also timed with them overlapped (``overlap_seconds``,
    ``overlap_gain`` = seconds without over seconds with, and ``rings``: how many of the
    last timed step's rings finished while it computed, and how many were waited for).
    ``torch``: each mesh and pure run with a PyTorch peer
    (:func:`~summasim.bench.torch_peers.peer_reason`) is also trained by it, its steps
    timed interleaved with summasim's (``torch``/``pure_torch``: the peer's verdict and
    times, :func:`_verdict`; ``vs_torch``/``pure_vs_torch``: the median paired ratio of
    torch's step over summasim's, > 1: summasim is faster); a peer that fails its check
    fails the benchmark. A mesh that is its own pure run is run once."""
    from ..harness.composed import run_mesh
    from ..harness.load import LoadWatch, mark, warn_busy

    p = world.Get_size()
    rows = []
    watch = LoadWatch(world)

    def measure(case, overlapped=overlap == "on", peer=None):
        res = run_mesh(case, world, backend, repeats=repeats, overlap=overlapped,
                       alongside=None if isinstance(peer, (dict, type(None)))
                       else {"torch": peer.step})
        pred = None
        if machine is not None and world.Get_rank() == 0:
            from summasim.costmodel.workload.measured import predict_measured_mesh

            pred = predict_measured_mesh(res.measured(), machine)
        return res, world.bcast(pred, root=0)

    c0 = cases[0].config if cases else None
    if c0 is not None:
        say(f"sharded training step: b={cases[0].batch} (global) s={c0.seq} h={c0.hidden} "
            f"heads={c0.heads} vocab={c0.vocab} layers={c0.layers} "
            f"{cases[0].dtype}; each run validated first; 'pure' is the same "
            f"scheme on all {p} ranks")
    head = (f"{'mesh':<28} {'zero':>4} {'sched':>13} {'m':>2} {'step s':>8} {'pred s':>8} "
            f"{'err':>6} {'pure tp':<20} {'pure s':>8} {'pred s':>8} {'err':>6} {'vs pure':>8}  "
            f"load")
    say(head)
    say("-" * len(head))
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    err = lambda pr, t: "-" if pr is None else f"{100 * (pr - t) / t:+.0f}%"  # noqa: E731
    for case in cases:
        pure = _pure_tensor(case, p)
        same = pure is not None and pure.spec == case.spec     # the mesh is pure already
        watch.lap()
        peers = {}
        peer = _peer(case, world) if torch else None
        res, pc = measure(case, peer=peer)
        if torch:
            peers["torch"] = _verdict(peer, res)
        ores = measure(case, True)[0] if overlap == "both" else None
        if pure is None:
            pres, pp_ = None, None
        elif same:
            pres, pp_ = res, pc
        else:
            peer = _peer(pure, world) if torch else None
            pres, pp_ = measure(pure, peer=peer)
            if torch:
                peers["pure_torch"] = _verdict(peer, pres)
        load = world.bcast(watch.lap(), root=0)
        t = res.seconds
        tp = pres.seconds if pres is not None else None
        ok = res.ok and (pres is None or pres.ok) and (ores is None or ores.ok)
        rep = (ores or res).extra["report"]
        ok = ok and all(v["ok"] for v in peers.values() if v.get("ok") is not None)
        rows.append({"mesh": case.spec, "zero": case.zero, "schedule": case.schedule_label,
                     "stages": case.stages_label or None,
                     "microbatches": case.microbatches, "ok": ok, "seconds": t,
                     "predicted": pc, "pure": pure.spec if pure else None,
                     "pure_seconds": tp, "pure_predicted": pp_,
                     "ratio": (tp / t) if tp else None, "load": load,
                     "quiet": load and load["quiet"], "bucket_bytes": case.bucket_bytes,
                     "overlap": overlap,
                     "overlap_seconds": ores.seconds if ores is not None else None,
                     "overlap_gain": (t / ores.seconds) if ores is not None and ores.seconds
                     else None,
                     "rings": rep.rings if overlap != "off" else None, **peers,
                     **{("vs_torch" if k == "torch" else "pure_vs_torch"):
                        v["paired"]["median"] for k, v in peers.items() if v.get("paired")}})
        say(f"{case.spec:<28} {case.zero:>4} {case.schedule_label:>13} {case.microbatches:>2} "
            f"{t:>8.4f} {fmt(pc):>8} {err(pc, t):>6} {pure.spec if pure else '-':<20} "
            f"{fmt(tp):>8} {fmt(pp_):>8} {err(pp_, tp) if tp else '-':>6} "
            f"{(f'{tp / t:.2f}x') if tp else '-':>8}  {mark(load)}"
            + ("" if ok else "  FAILED validation"))
        if ores is not None:
            say(f"{'  with overlap':<28} {'':>4} {'':>13} {'':>2} {ores.seconds:>8.4f}   "
                f"without/with {t / ores.seconds:.2f}x; last step's rings: "
                f"{rep.rings.get('in_flight', 0)} finished in flight, "
                f"{rep.rings.get('waited', 0)} waited for")
        for key, label in (("torch", case.spec), ("pure_torch", pure.spec if pure else "")):
            if key in peers:
                say(_peer_line(label, peers[key], t if key == "torch" else tp))
    warn_busy(rows, "meshes and their pure runs", say)
    return rows


def _peer(case, world):
    """The PyTorch peer of ``case``, built and checked (collective:
    :class:`~summasim.bench.torch_peers.Peer`), or ``{"peer": None, "reason"}``."""
    from . import torch_peers

    why = torch_peers.peer_reason(case)
    if why:
        return {"peer": None, "reason": why, "ok": None}
    return torch_peers.Peer(case, world)


def _verdict(peer, res) -> dict:
    """The peer's verdict after ``res`` timed it beside the mesh (collective), with its
    step's ``seconds`` (median), ``times`` and ``paired``: the paired per-step ratios
    of its time over the mesh's (:func:`~summasim.harness.timing.paired_ratio`; > 1:
    summasim is faster)."""
    import statistics

    from ..harness.timing import paired_ratio

    if isinstance(peer, dict):
        return peer
    got = peer.finish()
    spans = res.timing.get("alongside", {}).get("torch", [])
    if spans:
        got.update(seconds=statistics.median(spans), times=spans,
                   paired=paired_ratio(spans, res.timing["spans"]))
    return got


def _peer_line(label: str, peer: dict, ours: float) -> str:
    """One line under a row: the peer's step and summasim's against it."""
    if peer["peer"] is None:
        return f"  torch peer of {label}: none ({peer['reason']})"
    name = "DDP (gloo)" if peer["peer"] == "DDP" else "DTensor (gloo)"
    pr = peer.get("paired")
    speed = ("-" if pr is None else f"{pr['median']:.2f}x" + (
        f" [{pr['low']:.2f},{pr['high']:.2f}] {pr['verdict']}" if pr["low"] is not None
        else " (too few steps for an interval)"))
    took = f"{peer['seconds']:.4f} s" if "seconds" in peer else "not timed"
    return (f"  torch {peer['torch']} {name:<15} of {label:<22} step {took}; "
            f"summasim {ours:.4f} s, {speed} torch's speed; against the "
            f"serial model: first loss {peer['loss_error']:.1e}, gradients "
            f"{peer['grad_error']:.1e} (bound {peer['bound']:.1e}); replicas "
            f"{'agree' if peer['replicas_agree'] else 'DIFFER'}"
            + ("" if peer["ok"] else "  FAILED check"))


def run(bench) -> bool:
    """Rows under ``report["mesh"]``; True when every run validated."""
    cases, skips, _ = plan_mesh_bench(bench.args, bench.p)
    use_torch = bool(given(bench.args, "torch", False))
    try:
        rows = bench_mesh(bench.world, cases, repeats(bench.args), bench.say,
                          bench.machine(), bench.backend,
                          overlap=given(bench.args, "overlap", "off"), torch=use_torch)
    finally:
        if use_torch:
            from . import torch_peers

            torch_peers.close()
    bench.report["mesh"] = rows
    from ..harness.report import mark_report

    mark_report(bench.report, "mesh", [r["load"] for r in rows])
    for sk in skips:
        bench.say(f"  skipped mesh {sk.name}: {sk.reason}")
    return all(r["ok"] for r in rows)
