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
``tp=megatron:P``: both peers. The BLAS's part of each comparison follows the rows
(:func:`blas_peers`): each run's widest linear layer in NumPy and in torch.
Run it under a Python that has torch::

    mpiexec -n 4 python -m summasim.bench mesh --torch --dtype float32

Under the table, where each run's step goes (:func:`step_breakdown`): compute, and the
seconds inside MPI by kind (tensor parallelism, data-parallel gradients, pipeline
hand-offs, ZeRO's gathers, other), in exchanger steps or non-blocking requests, for the
slowest rank and the mean over ranks, from extra traced steps after the timed ones, with
the BLAS threads and ranks per core in effect.
"""

from __future__ import annotations

import dataclasses

import statistics

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
    from ..options import given_flags, without_mesh
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
        why = without_mesh(t, t.microbatches != DEFAULT_MICROBATCHES, given_flags(args))
        if why:
            return [], [], why
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


def is_pure(case, pure) -> bool:
    """Whether ``case`` is the pure run ``pure`` already (:func:`_pure_tensor`): the same
    grid trained the same way, not merely the same mesh text (a tp mesh of 4
    micro-batches is not the pure run of 1), whether it overlaps or not."""
    return pure is not None and pure.to_dict() == dataclasses.replace(
        case, overlap=pure.overlap).to_dict()


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
    fails the benchmark. A mesh that is its own pure run is run once.

    Every run that validated is also broken down (:func:`step_breakdown`: where a step's
    time goes, from extra traced steps after its timed ones): ``breakdown`` (the mesh),
    ``pure_breakdown`` (its pure run; None without one) and, with ``overlap`` "both",
    ``overlap_breakdown``; each carries ``threads`` (:func:`thread_report`). The
    breakdowns are printed as a table under the rows."""
    from ..harness.composed import run_mesh
    from ..harness.load import LoadWatch, mark, warn_busy

    p = world.Get_size()
    rows = []
    watch = LoadWatch(world)

    threads = thread_report(world)
    breakdowns = {}    # (label, index): each timed run's breakdown, printed under the table
    peered = []        # (row index, "blas" or "pure_blas", case): runs with a torch peer

    def measure(case, overlapped=overlap == "on", peer=None, label=None):
        res = run_mesh(case, world, backend, repeats=repeats, overlap=overlapped,
                       alongside=None if isinstance(peer, (dict, type(None)))
                       else {"torch": peer.step})
        pred = None
        if machine is not None and world.Get_rank() == 0:
            from summasim.costmodel.workload.measured import predict_measured_mesh

            pred = predict_measured_mesh(res.measured(), machine)
        pred = world.bcast(pred, root=0)
        bd = None
        if res.ok:          # a run that failed its validation is not broken down
            bd = step_breakdown(case, world, backend, repeats, overlapped)
            bd["threads"] = threads
            breakdowns[(label or case.spec, len(breakdowns))] = bd
        return res, pred, bd

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
        same = is_pure(case, pure)
        watch.lap()
        peers = {}
        peer = _peer(case, world) if torch else None
        res, pc, bd = measure(case, peer=peer)
        if torch:
            peers["torch"] = _verdict(peer, res)
        ores, _, obd = (measure(case, True, label=f"{case.spec} overlapped")
                        if overlap == "both" else (None, None, None))
        if pure is None:
            pres, pp_, pbd = None, None, None
        elif same:
            pres, pp_, pbd = res, pc, bd
        else:
            peer = _peer(pure, world) if torch else None
            pres, pp_, pbd = measure(pure, peer=peer, label=f"pure {pure.spec}")
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
                        v["paired"]["median"] for k, v in peers.items() if v.get("paired")},
                     "breakdown": bd, "pure_breakdown": pbd,
                     **({"overlap_breakdown": obd} if overlap == "both" else {})})
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
            if peers.get(key, {}).get("peer"):
                peered.append((len(rows) - 1, "blas" if key == "torch" else "pure_blas",
                               case if key == "torch" else pure))
    blas_peers(world, rows, peered, say)
    say_breakdowns(breakdowns, threads, say)
    warn_busy(rows, "meshes and their pure runs", say)
    return rows


def widest_gemm(case) -> tuple[int, int, int]:
    """``(m, k, n)`` of the MLP's first GEMM on one rank of ``case`` (its widest):
    the micro-batch's tokens on this data-parallel rank by the hidden size, by the MLP
    width over the tensor group (Megatron's column shard)."""
    cfg = case.config
    rows = max(1, case.batch // (case.dp * case.microbatches)) * cfg.seq
    return rows, cfg.hidden, max(1, cfg.ffn_width // case.tensor_size)


def blas_peers(world, rows: list[dict], peered: list, say) -> None:
    """The BLAS's part of each torch comparison (collective). Each run with a peer
    does its GEMMs on its own library's BLAS (NumPy: OpenBLAS; PyTorch's x86 wheels:
    MKL), so rank 0 times the three products of the run's widest linear layer
    (:func:`widest_gemm`: forward, input and weight gradients) in both, on the threads
    a rank computes with (one when p > 1), while the other ranks wait without spinning
    (:func:`~summasim.bench.common.quiet_bcast`). ``peered``: ``(row index, key, case)``
    of each run with a peer; ``rows[index][key]`` becomes
    :func:`summasim.bench.layer.gemm_peers`'s rates and ``numpy_over_torch``, the time
    ratio the BLAS alone puts into a step made of such GEMMs."""
    from .common import quiet_bcast
    from .layer import gemm_peers

    if not peered:
        return
    wanted = {(widest_gemm(case), case.dtype) for _, _, case in peered}
    got = None
    if world.Get_rank() == 0:
        got = {}
        for shape, dtype in sorted(wanted):
            g = gemm_peers(*shape, np.dtype(dtype), linear=True)
            g["numpy_over_torch"] = g["torch_gflops"] / g["numpy_gflops"]
            got[(shape, dtype)] = g
    got = quiet_bcast(world, got)
    for index, key, case in peered:
        rows[index][key] = got[(widest_gemm(case), case.dtype)]
    say("the BLAS's part: each run's widest linear layer (the MLP's first; x @ w, dy @ w.T "
        "and x.T @ dy) on rank 0's compute threads while the other ranks wait idle")
    for (shape, dtype), g in got.items():
        say(f"  {shape[0]}x{shape[1]}x{shape[2]} {dtype}: NumPy ({g['numpy_blas']}) "
            f"{g['numpy_gflops']:.1f} GFLOP/s, torch ({g['torch_blas']}) "
            f"{g['torch_gflops']:.1f}: NumPy's time {g['numpy_over_torch']:.2f}x torch's "
            f"from the BLAS alone")
    rank_parts(world, rows, peered, say)


def rank_parts(world, rows: list[dict], peered: list, say) -> None:
    """One data-parallel rank's compute, part by part, in NumPy and in torch
    (collective): for each run of ``peered`` (``(row index, key, case)``, the DDP
    peers: every rank computes the whole model), rank 0 times one layer's parts at a
    micro-batch's shape (:func:`summasim.bench.layer_parts.time_parts`) and one Adam
    step over the whole model (:func:`~summasim.bench.layer_parts.adam_peers`) on its
    compute threads, while the other ranks wait idle. Runs with a tensor group (DTensor's
    peers: no rank holds the whole model) get none. ``rows[index][key + "_parts"]``
    gets ``{"layer": {library: {part: s}}, "adam": {library: s}, "layers",
    "microbatches"}``: a step runs each part ``layers x microbatches`` times, forward
    and backward, and Adam once."""
    import dataclasses

    from ..transformer import model as serial
    from . import layer_parts
    from .common import quiet_bcast

    peered = [(i, k, c) for i, k, c in peered if c.tensor_size == 1]
    if not peered:
        return

    def key_of(case):   # a micro-batch's sequences on one rank, and the run's model
        return (max(1, case.batch // (case.dp * case.microbatches)),
                dataclasses.replace(case.config, dtype=np.dtype(case.dtype)))

    wanted = list(dict.fromkeys(key_of(case) for _, _, case in peered))
    got = None
    if world.Get_rank() == 0:
        got = {}
        for b, cfg in wanted:
            params = serial.init_params(cfg, 0)
            got[(b, cfg)] = {
                "layer": layer_parts.time_parts(serial.layer_params(params, 0), b, cfg.seq,
                                                cfg.heads, cfg.dtype),
                "adam": layer_parts.adam_peers({k: v.shape for k, v in params.items()},
                                               cfg.dtype)}
    got = quiet_bcast(world, got)
    say("one rank's compute, part by part (rank 0, the others idle; each part's forward "
        "and backward, ms, NumPy / torch):")
    for index, key, case in peered:
        b, cfg = key_of(case)
        g = dict(got[(b, cfg)], layers=cfg.layers, microbatches=case.microbatches)
        rows[index][key + "_parts"] = g
        lay, adam = g["layer"], g["adam"]
        cells = [f"{part} {lay['numpy'][part] * 1e3:.2f}/{lay['torch'][part] * 1e3:.2f}"
                 f" ({lay['numpy'][part] / lay['torch'][part]:.2f}x)"
                 for part in layer_parts.PARTS]
        say(f"  {case.spec}, one layer at {b}x{cfg.seq}x{cfg.hidden}: "
            + "; ".join(cells) + f" (each x {g['layers']} layers x {g['microbatches']} "
            f"micro-batches a step); Adam over the model {adam['numpy'] * 1e3:.2f}/"
            f"{adam['torch'] * 1e3:.2f} ({adam['numpy'] / adam['torch']:.2f}x, once a step)")


# -- where a step's time goes -----------------------------------------------------------
#: The breakdown's communication groups, by the top of an event's phase: the Trainer's own
#: phases (:mod:`summasim.transformer.composed`); every other phase (the tensor schemes'
#: "h3.fwd/tp.mlp.fc", "embed.fwd", "loss.bwd", ..., and "sp.grads", the sequence-parallel
#: norms' all-reduce over the tensor group) is tensor parallelism; no phase is "other".
PHASE_GROUPS = {"dp.grads": "data_parallel", "pp.fwd": "pipeline", "pp.bwd": "pipeline",
                "zero.gather": "zero", "zero.params": "zero", "embed.tie": "other",
                "aux.loss": "other", "aux.overflow": "other", "": "other"}
#: The groups in the order printed and written (``comm`` of a breakdown).
COMM_GROUPS = ("tensor", "data_parallel", "pipeline", "zero", "other")


def phase_group(phase: str) -> str:
    """The communication group (:data:`COMM_GROUPS`) of an event's ``phase``."""
    return PHASE_GROUPS.get(phase.split("/")[0], "tensor")


def comm_seconds(events) -> dict:
    """Seconds inside MPI of ``events`` (:class:`~summasim.trace.Event`): ``comm`` by
    group (:data:`COMM_GROUPS`), their total ``comm_s``, and the part in exchanger steps
    (``exchanger_s``: ``blocking``, the wait policy's polled and yielding waits of a ring
    step) against non-blocking requests (``requests_s``)."""
    groups = dict.fromkeys(COMM_GROUPS, 0.0)
    exch = req = 0.0
    for e in events:
        groups[phase_group(e.phase)] += e.seconds
        if e.blocking:
            exch += e.seconds
        else:
            req += e.seconds
    return {"comm": groups, "comm_s": sum(groups.values()), "exchanger_s": exch,
            "requests_s": req}


def _parts(step: float, comm: dict) -> dict:
    """One rank's breakdown of a ``step`` of seconds: its communication (``comm``, from
    :func:`comm_seconds`) and ``compute_s``, the rest of the step."""
    return {"step_s": step, "compute_s": step - comm["comm_s"], "comm_s": comm["comm_s"],
            "comm": dict(comm["comm"]), "exchanger_s": comm["exchanger_s"],
            "requests_s": comm["requests_s"]}


def _mean_parts(parts: list[dict]) -> dict:
    n = len(parts)
    mean = lambda k: sum(r[k] for r in parts) / n   # noqa: E731
    out = {k: mean(k) for k in ("step_s", "comm_s", "exchanger_s", "requests_s")}
    out["comm"] = {g: sum(r["comm"][g] for r in parts) / n for g in COMM_GROUPS}
    out["comm_s"] = sum(out["comm"].values())
    out["compute_s"] = out["step_s"] - out["comm_s"]
    return {"step_s": out["step_s"], "compute_s": out["compute_s"], "comm_s": out["comm_s"],
            "comm": out["comm"], "exchanger_s": out["exchanger_s"],
            "requests_s": out["requests_s"]}


def thread_report(world) -> dict:
    """The threads each rank computes with (collective): its BLAS threads as
    threadpoolctl reads them in effect (``blas_threads``, per rank; the benchmark limits
    them to 1 per rank when p > 1), the BLAS libraries, the cores of each rank's affinity
    mask, the node's cores and ranks, and ``ranks_per_core`` (the node's ranks over its
    cores)."""
    import os

    from threadpoolctl import threadpool_info

    from ..comm import cores, local_ranks

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    mine = (max((int(i["num_threads"]) for i in blas), default=0),
            sorted({str(i.get("internal_api")) for i in blas}), cores())
    every = world.allgather(mine)
    cpus, node = os.cpu_count() or 1, local_ranks()
    return {"blas_threads": [r[0] for r in every],
            "blas_libraries": sorted({x for r in every for x in r[1]}),
            "affinity_cores": [r[2] for r in every], "cpu_count": cpus, "node_ranks": node,
            "ranks_per_core": node / cpus}


def step_breakdown(case, world, backend=None, repeats: int = 3, overlap: bool = False,
                   seed: int = 0) -> dict:
    """Where a training step of ``case`` spends its time, measured (collective; after
    :func:`~summasim.harness.composed.run_mesh` validated and timed it, untraced): the
    same trainer is built afresh, one step warms it, then ``repeats`` rounds each time
    one untraced and one traced step, in a rotating order. Per rank, over the traced
    steps: its own step seconds (mean), the seconds inside MPI by group (:func:`comm_seconds`,
    their sums over the steps divided by the steps) and compute, the step less them.
    Returns ``{"steps", "source", "untraced_s", "traced_s", "trace_overhead",
    "slowest", "mean", "ranks"}``: the untraced and traced steps' median spans and the
    median paired ratio of traced over untraced less 1; ``slowest`` is the breakdown of
    the slowest rank (its ``rank``): the one that computes longest, for which the
    others wait inside MPI; ``mean`` the mean over ranks, and ``ranks`` every rank's.
    On every rank ``compute_s`` plus the groups of ``comm`` is ``step_s``, and
    ``exchanger_s`` plus ``requests_s`` is ``comm_s``."""
    from ..harness.composed import LR, _share, build_mesh, mesh_inputs
    from ..harness.timing import paired_ratio, time_contenders
    from ..mpiutil import agreement
    from ..transformer.composed import Trainer
    from ..transformer.schemes import get_scheme

    spec = get_scheme(case.scheme)
    first = None
    if world.Get_rank() == 0:
        try:
            params, tokens, targets = mesh_inputs(case.config, case.batch, seed)
            first = {"params": params, "tokens": tokens, "targets": targets}
            del params
        except (ValueError, TypeError) as e:
            first = e
    shared = _share(world, first, "step breakdown inputs")
    del first
    mesh = build_mesh(world, case, spec, backend, shared)
    finished = False
    try:
        ref = shared.value
        tokens, targets = ref["tokens"], ref["targets"]
        tr = Trainer(ref["params"], case.config, mesh, spec, zero=case.zero,
                     schedule=case.schedule, microbatches=case.microbatches,
                     chunks=case.chunks, stages=case.stages, checkpoint=case.checkpoint,
                     recompute=case.recompute, attention=case.attention,
                     sequence_parallel=case.sequence_parallel,
                     bucket_bytes=case.bucket_bytes, overlap=bool(overlap),
                     precision=case.precision, loss_scale=case.loss_scale,
                     grad_reduce=case.grad_reduce or "float32", lr=LR)
        trace = mesh.trace
        sync = backend.synchronize if backend is not None else (lambda: None)

        def train_step():
            tr.step(tokens, targets)
            sync()

        def before(name):        # the trace on for the traced steps alone
            trace.enabled = name == "traced"

        with agreement(False):
            trace.enabled = False
            train_step()                                  # warm-up, untimed
            trace.clear()
            timed = time_contenders({"untraced": train_step, "traced": train_step}, world,
                                    repeats, before=before)
        trace.enabled = True
        steps = len(timed["traced"]["times"])
        mine = comm_seconds(trace.events)
        mine = {k: ({g: v / steps for g, v in x.items()} if isinstance(x, dict)
                    else x / steps) for k, x in mine.items()}
        own = sum(timed["traced"]["times"]) / steps
        trace.clear()
        finished = True
    finally:
        mesh.free()
        ref = tokens = targets = None
        if finished:
            shared.free()
        else:
            shared.abandon()
    ranks = world.allgather(_parts(own, mine))
    # the slowest rank: the one that computes longest, the others wait for it in MPI (each
    # rank's own step is about the same: the step's collectives line their ends up)
    slow = max(range(len(ranks)), key=lambda r: (ranks[r]["compute_s"], ranks[r]["step_s"]))
    untraced = statistics.median(timed["untraced"]["spans"])
    traced = statistics.median(timed["traced"]["spans"])
    ratio = paired_ratio(timed["traced"]["spans"], timed["untraced"]["spans"])["median"]
    return {"steps": steps, "source": "extra traced steps after the timed ones",
            "untraced_s": untraced, "traced_s": traced, "trace_overhead": ratio - 1,
            "slowest": {"rank": slow, **ranks[slow]}, "mean": _mean_parts(ranks),
            "ranks": ranks}


def say_breakdowns(breakdowns: dict, threads: dict, say) -> None:
    """The breakdowns of :func:`bench_mesh`'s runs, as a table under its table."""
    if not breakdowns:
        return
    any_bd = next(iter(breakdowns.values()))
    over = [bd["trace_overhead"] for bd in breakdowns.values()]
    say("")
    say(f"where a step's time goes (seconds per step, from {any_bd['steps']} extra traced "
        f"steps after each run's timed ones, paired with as many untraced: the table's "
        f"steps run untraced; tracing cost {100 * min(over):+.1f}% to "
        f"{100 * max(over):+.1f}% of a step). Each run's slowest rank (the one computing "
        f"longest: the others wait for it in MPI), then the mean over ranks; 'exch' is "
        f"the part of MPI spent in exchanger steps (the ring steps' polled and yielding "
        f"waits), 'req' in non-blocking requests")
    head = (f"{'run':<36} {'rank':>4} {'step':>8} {'compute':>8} {'tp':>8} {'dp':>8} "
            f"{'pp':>8} {'zero':>8} {'other':>8} {'exch':>8} {'req':>8} {'traced':>7}")
    say(head)
    say("-" * len(head))
    for (label, _), bd in breakdowns.items():
        for who, part in (("slow", bd["slowest"]), ("mean", bd["mean"])):
            c = part["comm"]
            rank = str(part["rank"]) if who == "slow" else "mean"
            say(f"{label if who == 'slow' else '':<36} {rank:>4} {part['step_s']:>8.4f} "
                f"{part['compute_s']:>8.4f} {c['tensor']:>8.4f} {c['data_parallel']:>8.4f} "
                f"{c['pipeline']:>8.4f} {c['zero']:>8.4f} {c['other']:>8.4f} "
                f"{part['exchanger_s']:>8.4f} {part['requests_s']:>8.4f} "
                + (f"{100 * bd['trace_overhead']:>+6.1f}%" if who == "slow" else ""))
    blas = sorted(set(threads["blas_threads"]))
    say(f"threads: BLAS ({', '.join(threads['blas_libraries']) or 'none found'}) "
        f"{'/'.join(map(str, blas))} per rank; {threads['node_ranks']} ranks on "
        f"{threads['cpu_count']} cores ({threads['ranks_per_core']:.2f} ranks per core), "
        f"affinity masks of {'/'.join(map(str, sorted(set(threads['affinity_cores']))))} "
        f"cores")


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
