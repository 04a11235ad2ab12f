"""``bench allreduce``: ``ring_allreduce`` called three ways, each next to what a user
would run instead, on the same buffers, 64 KiB to 64 MiB:

- **in place** (``ring_allreduce(y, comm, out=y)``) against the plain in-place mpi4py
  loop (:func:`plain_ring_allreduce`: ``MPI_Sendrecv`` and ``+=``);
- **into a given out** (``ring_allreduce(x, comm, out=out)``) against MPI's own
  ``Allreduce(x, out)``;
- **the plain call** (``ring_allreduce(x, comm)``, a fresh result each time) against the
  call into ``out``.

With the ratios, the cost model's prediction for the ring into ``out``, and the host
memory throughput of all ranks at once before and after (:func:`node_memory_gibs`; on a
shared VM it changes from launch to launch, and the largest sizes follow it). Each
size's prediction prices its memory floor at the throughput read in every round of its
repeats (the median).

Each ratio printed is one statistic with its own interval: the median of the paired
per-repeat ratios (:func:`paired_ratio`) beside the sign test's interval of that median
(the ratio of the two medians, which drifts with the machine between repeats, is kept in
the JSON as ``vs_plain`` and ``ratio`` but not printed, since the paired interval is not
its interval and need not hold it). Each size is marked with the load of other processes
while it ran (column ``load``; ``load`` and ``quiet`` in the JSON).

ZeRO's two ring halves are timed in the same rounds, on the same buffers (a second table;
``--no-halves`` leaves them out), each against what a user would run instead:

- ``ring_reduce_scatter(y, comm)`` in place against MPI's ``Reduce_scatter_block(y,
  out[chunk r])`` (``Reduce_scatter`` with the ring's chunk sizes,
  :func:`~summasim.algorithms.chunk_bounds`, where the size does not divide p);
- ``ring_allgather(y, comm)`` in place against MPI's ``Allgather(y[chunk r], out)``
  (``Allgatherv`` with the ring's chunks where the size does not divide p).

``y`` is refilled from ``x`` before each of their calls, untimed. Each half's median
times, its paired ratio (MPI's time over the ring's) with the sign test's interval and a
verdict are in the JSON under ``halves``; every half's result is checked once per size
(the reduce-scatter's chunk against MPI's all-reduce of the same vectors, the
all-gather's every chunk against a pattern each rank builds with NumPy:
:func:`reduce_scatter_correct`, :func:`allgather_correct`), and a wrong one on any rank
fails the run."""

from __future__ import annotations

import statistics

import numpy as np

from ..costmodel.tools import bench as bp
from ..costmodel.tools.bench import NODE_MEMORY_MIB, bench_bytes
from ..harness.timing import paired_ratio  # noqa: F401 -- bench allreduce's statistic
from .common import (add_backend, add_json, add_predict, add_repeats, add_sizes, given,
                     message_buffers)

ALLREDUCE_REPEATS = 9          # the least: a 96.1% interval of the paired ratios
ALLREDUCE_MAX_REPEATS = 39     # the most a size gets when --repeats is not given ...
ALLREDUCE_BUDGET_S = 3.0       # ... within about this many seconds of timed calls
#: additions of the memory reading in each round of an all-reduce size's repeats
#: (about 75 ms at p = 16 on this VM)
MEMORY_ROUND_ADDS = 2
REPEATS_HELP = (f"; allreduce: per size, as many as about {ALLREDUCE_BUDGET_S:g} s of calls "
                f"allow, {ALLREDUCE_REPEATS} to {ALLREDUCE_MAX_REPEATS}, for the 95%% "
                f"interval of the paired ratios")


def add_arguments(ap, every: bool = False):
    """allreduce's own options (``every``: as ``bench all`` shares them)."""
    add_sizes(ap)
    ap.add_argument("--no-halves", action="store_true",
                    help="leave out ZeRO's two ring halves (ring_reduce_scatter and "
                         "ring_allgather, each against MPI's Reduce_scatter / Allgather), "
                         "which are otherwise timed in the same rounds as the all-reduces "
                         "(1.4-1.6x the time per size at p = 4, and fewer repeats each "
                         "within the time allowed)")
    if not every:
        from ..options import add_dtype

        add_dtype(ap)
        add_backend(ap, "the all-reduces")
        add_predict(ap, "the ring")
        add_repeats(ap, REPEATS_HELP)
        add_json(ap)


def node_memory_gibs(world, mib: float = NODE_MEMORY_MIB, adds: int = 8, probe=None,
                     node=None) -> float:
    """The memory throughput of a node's ranks all at once, now, the slowest node's
    (GiB/s, collective; :meth:`~summasim.harness.fitbench.MemoryProbe.read_nodes`, on
    ``probe``'s arrays, else new ones of ``mib`` MiB; ``node``: ``world`` split by
    shared memory, else split here). On a shared VM this changes
    from launch to launch by up to 1.7x while a cache-resident add changes by 1.2x, and
    a large ring all-reduce's time follows it (docs/performance.md); the all-reduce
    benchmark reports it before and after its sizes so that a slow launch can be told
    from a slow ring, and prices the prediction's memory floor with it."""
    from mpi4py import MPI

    from summasim.harness.fitbench import MemoryProbe

    probe = probe or MemoryProbe(int(mib * 2**20))
    mine = node is None
    node = world.Split_type(MPI.COMM_TYPE_SHARED) if mine else node
    try:
        return probe.read_nodes(world, node, adds) / 2**30
    finally:
        if mine:
            node.Free()


def check_bench_fits(what: str, sizes_mib, ranks_on_node: int,
                     available: int | None = None, device: bool = False) -> str:
    """"" when ``what``'s (``allreduce`` or ``ring-steps``) largest message fits this
    node's memory (:func:`~summasim.costmodel.tools.bench.bench_bytes`), else the
    message that says what it needs, what can be used and the largest size that would
    fit. ``device=True``: one GPU's free memory (``available``) shared by
    ``ranks_on_node`` ranks instead."""
    from ..harness.memory import HEADROOM, available_bytes, places

    avail = available_bytes() if available is None else available
    budget = int(HEADROOM * avail)
    per = bench_bytes(what, sizes_mib)
    if ranks_on_node * per <= budget:
        return ""
    most = bp.largest_fitting_mib(what, budget, ranks_on_node)
    each, where, pool = places(device)
    return (f"{what} at {max(sizes_mib):g} MiB needs about {per / 2**30:.4g} GiB {each}, "
            f"{ranks_on_node * per / 2**30:.4g} GiB for {ranks_on_node} ranks {where}, "
            f"but {budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
            f"{avail / 2**30:.1f} GiB {pool}); the largest size that fits is about "
            f"{most:.4g} MiB")


def preflight_sizes(what: str, args, gpu) -> str:
    """:func:`check_bench_fits` on this node (and GPU), rank 0."""
    from ..comm import local_ranks
    from ..harness.memory import check_node_and_gpu

    return check_node_and_gpu(
        lambda n, **kw: check_bench_fits(what, args.sizes_mib, n, **kw), local_ranks(), gpu)


def preflight(args, world, gpu) -> str:
    return preflight_sizes("allreduce", args, gpu)


def plain_ring_allreduce(x, out, comm, sync=None):
    """The baseline: a 20-line ring all-reduce in plain mpi4py (``MPI_Sendrecv`` and an
    in-place add, no workspace reuse, no wait policy, no trace), what a user would write
    first; in place when ``out is x`` (no copy), else ``x`` is copied into ``out`` first.
    ``comm`` is a raw mpi4py communicator; ``x`` and ``out`` are 1-D arrays of
    one array module (device arrays only with a CUDA-aware MPI, and then ``sync``, the
    stream's synchronize, runs before every ``Sendrecv``)."""
    from ..algorithms import chunk_bounds
    from ..backends import array_module

    p, r = comm.Get_size(), comm.Get_rank()
    if out is not x:
        out[...] = x
    bounds = chunk_bounds(out.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    work = array_module(out).empty(bounds[0][1] - bounds[0][0], out.dtype)
    sync = sync or (lambda: None)
    for s in range(p - 1):
        s0, s1 = bounds[(r - s) % p]
        r0, r1 = bounds[(r - s - 1) % p]
        sync()
        comm.Sendrecv(out[s0:s1], right, recvbuf=work[:r1 - r0], source=left)
        out[r0:r1] += work[:r1 - r0]
    for s in range(p - 1):
        s0, s1 = bounds[(r + 1 - s) % p]
        r0, r1 = bounds[(r - s) % p]
        sync()
        comm.Sendrecv(out[s0:s1], right, recvbuf=out[r0:r1], source=left)
    return out


#: The benchmark's targets: in place, at least as fast as the plain in-place ring from
#: 64 KiB; into out, faster than MPI from 4 MiB; the plain call within 1.25x of the call
#: into out; the prediction within 10% from 1 MiB (at p = 16; reported at every p; the
#: prediction's target is the cost model's, :mod:`summasim.costmodel.tools.bench`)
TARGETS = {"plain_from_mib": 0.0625, "mpi_from_mib": 4.0,
           "prediction_from_mib": bp.PREDICTION_FROM_MIB,
           "prediction_tolerance": bp.PREDICTION_TOLERANCE, "call_over_out": 1.25}


def allreduce_targets(rows, p: int) -> dict:
    """Which of :data:`TARGETS` the rows of one ``bench allreduce`` run meet: per target
    the sizes it applies to and how many of them meet it. "vs plain" is met where the
    ring is not slower (faster, or a tie within the paired interval; without an
    interval, where the median ratio is at least 1), "vs MPI" only where it is faster
    (the paired interval above 1; without an interval, the median paired ratio above
    1; ``not_slower`` counts its ties too): both judged on the paired per-repeat ratios, which cancel the drift between
    repeats that the ratio of the two medians keeps. The prediction's count is
    :func:`~summasim.costmodel.tools.bench.prediction_target`."""
    def sizes(frm):
        return [r for r in rows if r["mib"] >= frm]

    plain = sizes(TARGETS["plain_from_mib"])
    mpi = sizes(TARGETS["mpi_from_mib"])
    return {"p": p,
            "vs_plain": {"sizes": len(plain),
                         "met": sum(_not_slower(r["vs_plain_paired"]) for r in plain),
                         "faster": sum(r["vs_plain_paired"]["verdict"] == "faster"
                                       for r in plain)},
            "vs_mpi": {"sizes": len(mpi), "met": sum(_faster(r["vs_mpi_paired"]) for r in mpi),
                       "not_slower": sum(_not_slower(r["vs_mpi_paired"]) for r in mpi)},
            # the plain call (a fresh result) within 1.25x of the call into ``out``: its
            # paired interval's low end at most 1.25 (the median paired ratio without one)
            "call": {"sizes": sum(1 for r in rows if "call_vs_out_paired" in r),
                     "met": sum(_within(r["call_vs_out_paired"], TARGETS["call_over_out"])
                                for r in rows if "call_vs_out_paired" in r)},
            "prediction": bp.prediction_target(rows)}


def _within(r: dict, most: float) -> bool:
    return r["median"] <= most if r["low"] is None else r["low"] <= most


def _not_slower(r: dict) -> bool:
    return r["median"] >= 1 if r["verdict"] is None else r["verdict"] != "slower"


def _faster(r: dict) -> bool:
    return r["median"] > 1 if r["verdict"] is None else r["verdict"] == "faster"


def _contenders(backend, comm, raw, x, out, y, bounds=None) -> tuple[dict, dict]:
    """The all-reduces of ``x`` as calls that return when the result is there (device
    work waited for), and where the plain call keeps its result. Out of place, into
    ``out``: ``ring`` (``ring_allreduce(x, comm, out=out)``) and ``mpi``
    (``MPI_Allreduce``). In place on ``y`` (which :data:`IN_PLACE` contenders get refilled
    with ``x`` before each call, untimed): ``inplace`` (``ring_allreduce(y, comm,
    out=y)``) and ``plain``, the plain 20-line loop (:func:`plain_ring_allreduce`) on
    ``y``. And ``call``, ``ring_allreduce(x, comm)`` returning a fresh result each time
    (``held["call"]``). On the host the baselines get the arrays themselves; with a
    CUDA-aware MPI ("direct") the device arrays, the stream synchronized before each MPI
    call; without one ("staged", "ipc") what a user would write first: copy the vector
    into a pinned host buffer, all-reduce it there, copy the sum back. summasim's ring
    does the same below ``STAGE_WHOLE_BYTES`` (16 MiB), with its own host ring, and from
    there stages per step (``Comm``) and adds on the device. With ``bounds`` (the ring's
    chunks, :func:`~summasim.algorithms.chunk_bounds`), ZeRO's two halves too
    (:func:`_half_contenders`, :data:`HALVES`)."""
    from mpi4py import MPI

    from ..algorithms import ring_allreduce

    mode = backend.comm_mode
    sync = backend.synchronize

    def plain(a, b):
        plain_ring_allreduce(a, b, raw, sync if mode == "direct" else None)

    def mpi(a, b):
        raw.Allreduce(a, b, op=MPI.SUM)

    def done(f, a, b):
        def call():
            if mode != "host":
                sync()
            f(a, b)
            if mode != "host":
                sync()
        return call

    def staged(f, src, dst):
        def call():
            sync()
            backend.copy_to_host(src, hx)
            f(hx, hx if src is dst else hout)
            backend.copy_from_host(hx if src is dst else hout, dst)
            sync()
        return call

    if mode in ("staged", "ipc"):  # one pair of pinned buffers for both baselines
        hx = backend.pinned_empty(x.nbytes).view(x.dtype)[:x.size]
        hout = backend.pinned_empty(out.nbytes).view(out.dtype)[:out.size]
        base = {"mpi": staged(mpi, x, out), "plain": staged(plain, y, y)}
    else:
        base = {"mpi": done(mpi, x, out), "plain": done(plain, y, y)}

    def fresh(a, b):              # the call a user writes first: a fresh result each time,
        held["call"] = None       # the last one held until the next (as ``y = ...`` does)
        held["call"] = ring_allreduce(a, comm)

    held = {"call": None}
    calls = {"ring": done(lambda a, b: ring_allreduce(a, comm, out=b), x, out),
             "mpi": base["mpi"],
             "inplace": done(lambda a, b: ring_allreduce(a, comm, out=a), y, y),
             "plain": base["plain"], "call": done(fresh, x, out)}
    if bounds is not None:
        calls.update(_half_contenders(backend, comm, raw, y, out, bounds, done,
                                      (hx, hout) if mode in ("staged", "ipc") else None))
    return calls, held


#: ZeRO's ring halves and their MPI baselines (:func:`_half_contenders`), in place on
#: ``y`` (refilled from ``x`` before each call, untimed, as :data:`IN_PLACE`'s are):
#: ``{half: (ring contender, MPI contender)}``
HALVES = {"reduce_scatter": ("rs_ring", "rs_mpi"), "allgather": ("ag_ring", "ag_mpi")}


def mpi_half_calls(bounds) -> dict:
    """``{half: MPI call}``: the MPI collective a half is timed against (pure): the
    ``_block`` / plain forms where every chunk is the same size, else the ``v`` forms with
    the ring's chunk sizes."""
    even = len({hi - lo for lo, hi in bounds}) == 1
    return {"reduce_scatter": "Reduce_scatter_block" if even else "Reduce_scatter",
            "allgather": "Allgather" if even else "Allgatherv"}


def _half_contenders(backend, comm, raw, y, out, bounds, done, pinned) -> dict:
    """ZeRO's two ring halves on ``y``, each next to MPI's collective on the same
    vector (``bounds``: the ring's chunks; ``done``: :func:`_contenders`' wrapper that
    waits for device work; ``pinned``: its pair of pinned host buffers on a staged path,
    else None). ``rs_ring``: ``ring_reduce_scatter(y, comm)`` (rank r's sum lands in
    chunk (r + 1) % p of ``y``); ``rs_mpi``: MPI's reduce-scatter of ``y`` into chunk r
    of ``out``. ``ag_ring``: ``ring_allgather(y, comm)`` (rank r contributes chunk
    (r + 1) % p of ``y``); ``ag_mpi``: MPI's all-gather of chunk r of ``y`` into
    ``out``, chunk k from rank k. On a staged path without a CUDA-aware MPI the MPI
    calls run on the pinned host copies (what a user would write first: the vector, or
    the chunk, copied down, the collective there, the result copied back)."""
    from mpi4py import MPI

    from ..algorithms import ring_allgather, ring_reduce_scatter

    r = raw.Get_rank()
    a, b = bounds[r]
    counts = [hi - lo for lo, hi in bounds]
    displs = [lo for lo, _ in bounds]
    names = mpi_half_calls(bounds)
    block = names["reduce_scatter"] == "Reduce_scatter_block"

    def rs_mpi(src, dst):              # the sum's chunk r into dst's chunk r
        if block:
            raw.Reduce_scatter_block(src, dst[a:b], op=MPI.SUM)
        else:
            raw.Reduce_scatter(src, dst[a:b], counts, op=MPI.SUM)

    def ag_mpi(src, dst):              # chunk r of src from every rank r into dst
        if block:
            raw.Allgather(src[a:b], dst)
        else:
            raw.Allgatherv(src[a:b], [dst, (counts, displs)])

    calls = {"rs_ring": done(lambda s, d: ring_reduce_scatter(s, comm), y, y),
             "ag_ring": done(lambda s, d: ring_allgather(s, comm), y, y)}
    if pinned is None:
        calls.update(rs_mpi=done(rs_mpi, y, out), ag_mpi=done(ag_mpi, y, out))
        return calls
    hx, hout = pinned
    sync = backend.synchronize

    def staged_rs():
        sync()
        backend.copy_to_host(y, hx)
        rs_mpi(hx, hout)
        backend.copy_from_host(hout[a:b], out[a:b])
        sync()

    def staged_ag():
        sync()
        backend.copy_to_host(y[a:b], hx[a:b])
        ag_mpi(hx, hout)
        backend.copy_from_host(hout, out)
        sync()

    calls.update(rs_mpi=staged_rs, ag_mpi=staged_ag)
    return calls


def own_chunk(name: str, p: int, r: int) -> int:
    """The chunk that rank ``r`` of ``p`` ends a reduce-scatter with, or contributes to
    an all-gather (pure): the ring's (``rs_ring``, ``ag_ring``) is (r + 1) % p, MPI's is
    r."""
    return (r + 1) % p if name.endswith("_ring") else r


def chunk_owners(name: str, p: int) -> list[int]:
    """The rank whose contribution each chunk holds after all-gather ``name`` (pure):
    the ring's chunk c is rank (c - 1) % p's (:func:`own_chunk`), MPI's chunk c rank
    c's."""
    return [(c - 1) % p if name.endswith("_ring") else c for c in range(p)]


def gather_pattern(owner: int, lo: int, hi: int, dtype) -> np.ndarray:
    """What rank ``owner`` contributes to items ``lo:hi`` in the all-gathers' check
    (pure): ``owner + 1 + (i % 1021) / 1024`` for item i, exact in float32 and float64,
    whole parts different for every owner, so a chunk from the wrong rank, a stale chunk
    or one in the wrong place differs."""
    i = np.arange(lo, hi)
    return (owner + 1 + (i % 1021) / 1024).astype(dtype)


def reduce_scatter_correct(got, ref, chunk, atol: float) -> bool:
    """Whether ``got``'s ``chunk`` (``(start, stop)``) holds the sum ``ref`` there,
    within ``atol`` (pure; host arrays)."""
    lo, hi = chunk
    return bool(got.shape == ref.shape
                and np.allclose(got[lo:hi], ref[lo:hi], rtol=0, atol=atol))


def allgather_correct(got, bounds, owners) -> bool:
    """Whether every chunk c of ``got`` (host array; ``bounds``: the chunks) holds
    exactly :func:`gather_pattern` of its owner, ``owners[c]`` (pure)."""
    return bool(got.shape == (bounds[-1][1],) and all(
        np.array_equal(got[lo:hi], gather_pattern(owners[c], lo, hi, got.dtype))
        for c, (lo, hi) in enumerate(bounds)))


#: The contenders that work in place on ``y``: it is refilled before each call.
IN_PLACE = frozenset({"inplace", "plain"} | {k for pair in HALVES.values() for k in pair})


def allreduce_repeats(seconds_per_repeat: float, least: int | None = None,
                      most: int | None = None, budget: float | None = None,
                      step: int = 3) -> int:
    """Repeats of one size of ``bench allreduce`` when ``--repeats`` is not given (pure):
    as many as fit ``budget`` seconds (:data:`ALLREDUCE_BUDGET_S`) at
    ``seconds_per_repeat`` (one call of each contender), at least ``least``
    (:data:`ALLREDUCE_REPEATS`) and at most ``most`` (:data:`ALLREDUCE_MAX_REPEATS`), in
    steps of ``step`` from ``least`` (the contenders, so that each takes each place in
    the rotated order equally often). A short call is noisy here (its paired ratios
    spread by 20-40% at 8 ranks per core) but cheap, so it gets more repeats: the
    sign-test interval of 9 repeats runs from the 2nd to the 8th of the sorted ratios,
    that of 39 from the 13th to the 27th. The count depends on the calls' total duration
    only, which is the same whichever contender was faster in each pair, so stopping
    does not bias the verdict."""
    least = ALLREDUCE_REPEATS if least is None else least
    most = ALLREDUCE_MAX_REPEATS if most is None else most
    budget = ALLREDUCE_BUDGET_S if budget is None else budget
    if least < 1 or most < least or budget < 0 or step < 1:
        raise ValueError(f"allreduce_repeats: need 1 <= least <= most, budget >= 0 and "
                         f"step >= 1, got least={least}, most={most}, budget={budget}, "
                         f"step={step}")
    fit = most if not seconds_per_repeat > 0 else int(budget / seconds_per_repeat)
    fit = max(least, min(most, fit))
    return fit - (fit - least) % step


def _mib(nbytes: int) -> str:
    """A message's size in MiB as the tables label it: what was sent, in 8 characters."""
    text = f"{nbytes / 2**20:.4g}"
    return text if len(text) <= 8 else f"{nbytes / 2**20:.2e}"


def bench_allreduce(world, sizes_mib, dtype, repeats: int | None, say, machine=None,
                    backend=None, huge: bool = True, memory=None,
                    halves: bool = True) -> list[dict]:
    """summasim's ring_allreduce, the plain mpi4py ring and MPI's Allreduce on the same
    buffers (``backend``'s arrays, default NumPy; see :func:`_contenders`; on huge
    pages unless ``huge`` is false: :func:`~summasim.bench.common.message_buffers`),
    interleaved call by call (:func:`~summasim.harness.timing.time_contenders`, median
    spans), with the cost model's prediction for the ring
    (:func:`~summasim.costmodel.tools.bench.ring_prediction`) when a ``machine``
    is given. Each contender's result is checked against MPI's on the host on every
    size. ``repeats`` None: per size by :func:`allreduce_repeats`, from the median
    duration of its first :data:`ALLREDUCE_REPEATS` repeats.

    ``memory``: a short collective reading of the node's memory throughput (GiB/s),
    taken in every round of the interleaved repeats, after the contenders, at
    the sizes whose data (x, out and a receive chunk on every rank of a node) outgrows
    ``machine.cache_bytes`` (where the floor can count:
    :func:`~summasim.costmodel.tools.bench.memory_floor_counts`). Each such size's
    prediction then prices its memory floor at the median of its rounds' readings (the
    memory the size ran on: on a shared VM it drifts within a launch; priced with
    readings taken only before and after the sizes, the 64 MiB ring at p = 16 came out
    11% and 14% low in two launches), and its row keeps them (``memory_gibs``: the
    median; ``memory_readings``).

    ``halves``: ZeRO's two ring halves against MPI's reduce-scatter and all-gather too,
    in the same rounds (:func:`_half_contenders`), each checked once per size; each row
    keeps them under ``halves`` (:func:`_halves_row`; None without them) and a second
    table prints them after the first."""
    from mpi4py import MPI

    from ..algorithms import chunk_bounds
    from ..backends import get_backend
    from ..comm import Comm
    from ..harness.load import LoadWatch, combine, mark, warning
    from ..harness.timing import time_contenders
    from ..mpiutil import agreement
    from ..ringwait import size_class as ring_size_class

    backend = backend or get_backend("numpy")
    p = world.Get_size()
    comm = Comm(world.Dup(), name="world", backend=backend)
    comm.trace.enabled = False
    raw = world.Dup()
    say(f"{'':>8} {'in place':-^48} {'into out':-^48} {'plain call':-^33}")
    say(f"{'MiB':>8} {'ring ms':>9} {'plain ms':>9} {'vs plain':>9} "
        f"{'95% interval':>13} {'':>6} {'ring ms':>9} {'MPI ms':>9} "
        f"{'vs MPI':>8} {'95% interval':>13} {'':>6} "
        f"{'call ms':>9} {'call/out':>9} {'95% interval':>13} {'ring GB/s':>10} "
        f"{'pred ms':>9} {'pred err':>9} {'mem GiB/s':>10} {'reps':>5} {'wait':>8}  check  load")
    rows = []
    rank = world.Get_rank()
    watch = LoadWatch(world)
    try:
        for mib in sizes_mib:
            count = max(1, int(mib * 2**20) // np.dtype(dtype).itemsize)
            hx = np.random.default_rng(world.Get_rank()).standard_normal(count).astype(dtype)
            ref = np.empty_like(hx)
            world.Allreduce(hx, ref, op=MPI.SUM)
            tol = 8 * np.sqrt(p) * np.finfo(hx.dtype).eps * max(1.0, float(np.abs(ref).max()))
            x, out = message_buffers(backend, hx, huge)
            y = message_buffers(backend, hx, huge)[0]      # the in-place contenders'
            del hx                            # its values are in x: one message less held

            def refill(k):
                if k in IN_PLACE:
                    y[...] = x

            bounds = chunk_bounds(count, p)
            calls, held = _contenders(backend, comm, raw, x, out, y,
                                      bounds if halves else None)
            good = {"allreduce": True, "halves": True}
            for k in calls:                   # each checked once, the ring agreed too
                out[...] = 0
                refill(k)
                if k in ("ag_ring", "ag_mpi"):    # this rank's part: the check's pattern
                    lo, hi = bounds[own_chunk(k, p, rank)]
                    y[lo:hi] = backend.asarray(gather_pattern(rank, lo, hi, dtype))
                calls[k]()
                got = backend.to_numpy(held["call"] if k == "call" else y
                                       if k in ("inplace", "plain", "rs_ring", "ag_ring")
                                       else out)
                if k in ("rs_ring", "rs_mpi"):
                    good["halves"] &= reduce_scatter_correct(
                        got, ref, bounds[own_chunk(k, p, rank)], p * tol)
                elif k in ("ag_ring", "ag_mpi"):
                    good["halves"] &= allgather_correct(got, bounds, chunk_owners(k, p))
                else:
                    good["allreduce"] &= bool(np.allclose(got, ref, rtol=0, atol=p * tol))
            del ref
            # the checks' first ring call ran the size class's wait trials (ringwait)
            chunk_bytes = (bounds[0][1] - bounds[0][0]) * np.dtype(dtype).itemsize
            ok, halves_ok = (bool(world.allreduce(good[g], op=MPI.LAND))
                             for g in ("allreduce", "halves"))
            readings = []
            spill = machine is not None and bp.memory_floor_counts(machine, count, p, dtype)

            reps = [ALLREDUCE_REPEATS if repeats is None else repeats]

            def after_round(i, spans):
                """A memory reading per round; without --repeats, the first
                ALLREDUCE_REPEATS rounds size the rest by their duration (the same spans
                on every rank, so every rank takes the same count)."""
                if memory is not None and spill:
                    readings.append(memory())
                if repeats is None and i == ALLREDUCE_REPEATS:
                    reps[0] = allreduce_repeats(statistics.median(
                        sum(spans[k][j] for k in spans) for j in range(i)), step=len(calls))
                return reps[0]

            watch.lap()
            with agreement(False):    # interleaved, so that all see the same machine state
                timed = time_contenders(calls, world, reps[0], shuffle=True,
                                        before=refill, after_round=after_round)
            load = world.bcast(watch.lap(), root=0)
            t = {k: timed[k]["spans"] for k in calls}
            reps = reps[0]
            tr, tp, tm, ti = (statistics.median(t[k])
                              for k in ("ring", "plain", "mpi", "inplace"))
            nbytes = count * np.dtype(dtype).itemsize
            mem = statistics.median(readings) if readings else None
            pred = (bp.ring_prediction(count, dtype, p, machine, comm.blocking_limit, mem)
                    if machine is not None else None)
            vp, vm = paired_ratio(t["plain"], t["inplace"]), paired_ratio(t["mpi"], t["ring"])
            vc = paired_ratio(t["call"], t["ring"])       # the plain call over into ``out``
            tc = statistics.median(t["call"])
            rows.append({"mib": mib, "bytes": nbytes, "ring_seconds": tr, "plain_seconds": tp,
                         "mpi_seconds": tm, "inplace_seconds": ti, "ring_times": t["ring"],
                         "plain_times": t["plain"], "mpi_times": t["mpi"],
                         "inplace_times": t["inplace"], "call_seconds": tc,
                         "call_times": t["call"],
                         "call_vs_out_paired": vc, "ring_gbps": nbytes / tr / 1e9,
                         "mpi_gbps": nbytes / tm / 1e9, "ratio": tm / tr,
                         "vs_plain": tp / ti, "vs_plain_paired": vp, "vs_mpi_paired": vm,
                         "predicted": pred, "ok": ok, "repeats": reps, "memory_gibs": mem,
                         "memory_readings": readings,
                         "prediction_error": bp.prediction_error(pred, tr),
                         "load": load, "quiet": load and load["quiet"],
                         "ring_wait": comm.ring_mode(chunk_bytes) if p > 1 else "-",
                         "ring_wait_medians": (comm.ring_waits.medians.get(
                             ring_size_class(chunk_bytes)) if comm.ring_wait == "auto"
                             else None),
                         "halves": _halves_row(t, bounds, halves_ok) if halves else None})
            say(f"{_mib(nbytes):>8} {1e3 * ti:>9.3f} {1e3 * tp:>9.3f} "
                f"{vp['median']:>8.2f}x {_interval(vp):>13} {vp['verdict'] or '-':>6} "
                f"{1e3 * tr:>9.3f} {1e3 * tm:>9.3f} "
                f"{vm['median']:>7.2f}x {_interval(vm):>13} {vm['verdict'] or '-':>6} "
                f"{1e3 * tc:>9.3f} {vc['median']:>8.2f}x {_interval(vc):>13} "
                f"{nbytes / tr / 1e9:>10.2f} "
                + (f"{1e3 * pred:>9.3f} {100 * (pred - tr) / tr:>+8.1f}%" if pred is not None
                   else f"{'-':>9} {'-':>9}")
                + (f" {mem:>10.1f}" if mem is not None else f" {'-':>10}")
                + f" {reps:>5} {rows[-1]['ring_wait']:>8}  {'OK' if ok else 'FAIL':<5} "
                  f"{mark(load)}")
    finally:
        comm.mpi.Free()
        raw.Free()
    say("in place: ring_allreduce(y, comm, out=y) against the plain 20-line in-place loop "
        "(MPI_Sendrecv and +=), y refilled before each call, untimed; into out: "
        "ring_allreduce(x, comm, out=out) against MPI_Allreduce(x, out); vs plain / vs MPI: "
        "the median of the paired per-repeat ratios, their time over the ring's (> 1: the "
        "ring is faster); 95% interval: of that same median (the sign test's; "
        "faster/slower: the interval excludes 1; tie: the difference is within the noise); "
        "call: ring_allreduce(x, comm), a fresh result per call, and call/out its time over "
        "the ring's into out (target: at most 1.25x); ring GB/s and the prediction: into out; "
        "wait: how the ring's steps waited (summasim.ringwait: measured per size class in "
        "its first, untimed call: blocking, yield or nap; SUMMASIM_RING_WAIT fixes it)")
    if halves:
        _say_halves(rows, p, say)
    busy = [r for r in rows if r["quiet"] is False]
    line = warning(combine(r["load"] for r in busy),
                   f"{len(busy)} of {len(rows)} sizes were timed (rows marked BUSY)")
    if line:
        say(line)
    tg = allreduce_targets(rows, p)
    say(f"targets at p = {p}: in place, not slower than the plain ring at "
        f"{tg['vs_plain']['met']}/"
        f"{tg['vs_plain']['sizes']} sizes from 64 KiB ({tg['vs_plain']['faster']} faster); "
        f"into out, faster than MPI at {tg['vs_mpi']['met']}/{tg['vs_mpi']['sizes']} from "
        f"4 MiB (not slower at {tg['vs_mpi']['not_slower']})"
        + (f"; prediction within 10% at {tg['prediction']['met']}/"
           f"{tg['prediction']['sizes']} from 1 MiB" if tg["prediction"]["sizes"] else "")
        + f"; the plain call within {TARGETS['call_over_out']}x of the call into out at "
          f"{tg['call']['met']}/{tg['call']['sizes']}")
    return rows


def _halves_row(t: dict, bounds, ok: bool) -> dict:
    """A size's ``halves`` (pure): per half, the ring's and MPI's median times and
    spans, MPI's call (:func:`mpi_half_calls`) and the paired ratio of MPI's time over
    the ring's (:func:`paired_ratio`, > 1: the ring is faster); ``ok``: every half's
    result checked right on every rank."""
    names = mpi_half_calls(bounds)
    row = {"ok": ok}
    for half, (ring, mpi) in HALVES.items():
        row[half] = {"ring_seconds": statistics.median(t[ring]),
                     "mpi_seconds": statistics.median(t[mpi]),
                     "ring_times": t[ring], "mpi_times": t[mpi], "mpi_call": names[half],
                     "vs_mpi_paired": paired_ratio(t[mpi], t[ring])}
    return row


#: the halves' names in the second table
HALF_LABELS = {"reduce_scatter": "reduce-scatter", "allgather": "all-gather"}


def _say_halves(rows, p: int, say) -> None:
    """The second table: ZeRO's halves, one line per size and half (each line starts
    with the half's name, so the first table's lines stay the only ones that start
    with a size), its caption, and a count of the verdicts."""
    from ..harness.load import mark

    say("")
    say(f"{'half':<15} {'MiB':>8} {'ring ms':>9} {'MPI ms':>9} {'vs MPI':>8} "
        f"{'95% interval':>13} {'':>6}  {'MPI call':<21} check  load")
    for r in rows:
        h = r["halves"]
        for half, label in HALF_LABELS.items():
            v = h[half]["vs_mpi_paired"]
            say(f"{label:<15} {_mib(r['bytes']):>8} {1e3 * h[half]['ring_seconds']:>9.3f} "
                f"{1e3 * h[half]['mpi_seconds']:>9.3f} {v['median']:>7.2f}x "
                f"{_interval(v):>13} {v['verdict'] or '-':>6}  {h[half]['mpi_call']:<21} "
                f"{'OK' if h['ok'] else 'FAIL':<5} {mark(r['load'])}")
    say("ZeRO's halves, timed in the same rounds on the same buffers: reduce-scatter: "
        "ring_reduce_scatter(y, comm) in place against MPI's Reduce_scatter_block(y, "
        "out[chunk r]) (Reduce_scatter with the ring's chunk sizes where p does not "
        "divide the size); all-gather: ring_allgather(y, comm) in place against MPI's "
        "Allgather(y[chunk r], out) (Allgatherv likewise); y refilled before each call, "
        "untimed; vs MPI: the median of the paired per-repeat ratios, MPI's time over the "
        "ring's (> 1: the ring is faster), with the sign test's 95% interval of it")
    counts = {half: {w: sum(r["halves"][half]["vs_mpi_paired"]["verdict"] == w
                            for r in rows) for w in ("faster", "tie", "slower", None)}
              for half in HALVES}
    say(f"halves at p = {p}, against MPI over {len(rows)} sizes: " + "; ".join(
        f"{HALF_LABELS[half]} faster at {c['faster']}, tie at {c['tie']}, slower at "
        f"{c['slower']}" + (f", no interval at {c[None]}" if c[None] else "")
        for half, c in counts.items()))


def _interval(r: dict) -> str:
    """``[low, high]`` of a :func:`paired_ratio`, or "-" with too few repeats."""
    return "-" if r["low"] is None else f"[{r['low']:.2f},{r['high']:.2f}]"


def run(bench) -> bool:
    """Time the sizes, with the node's memory before and after; rows under
    ``report["allreduce"]``; True when every contender's result checked OK (the halves'
    included)."""
    from mpi4py import MPI

    from summasim.harness.fitbench import MemoryProbe
    from summasim.harness.report import mark_report

    args, world, say = bench.args, bench.world, bench.say
    host = bench.backend.name != "cupy"        # device arrays: host memory is not theirs
    machine = bench.machine()
    probe = MemoryProbe(NODE_MEMORY_MIB << 20) if host else None
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        before = node_memory_gibs(world, probe=probe, node=node) if host else None
        if machine is not None and host:
            say(f"cost model: each size's memory floor at the node's memory throughput "
                f"while it ran (mem GiB/s: all of a node's ranks adding {NODE_MEMORY_MIB} "
                f"MiB arrays {MEMORY_ROUND_ADDS} times at once, in every round of the "
                f"repeats, the median; at the sizes whose data outgrows the node's cache)")
        rows = bench_allreduce(
            world, args.sizes_mib, np.dtype(given(args, "dtype", "float64")), args.repeats,
            say, machine, bench.backend, not args.np_empty,
            memory=((lambda: node_memory_gibs(world, adds=MEMORY_ROUND_ADDS, probe=probe,
                                              node=node))
                    if host and machine is not None else None),
            halves=not getattr(args, "no_halves", False))
        after = node_memory_gibs(world, probe=probe, node=node) if host else None
    finally:
        node.Free()
    bench.report["allreduce"] = rows
    mark_report(bench.report, "allreduce", [r["load"] for r in rows])
    bench.report["node_memory_gibs"] = {"before": before, "after": after,
                                        "array_mib": NODE_MEMORY_MIB}
    if host:
        say(f"host memory of a node's ranks all at once (the slowest node; each adding "
            f"{NODE_MEMORY_MIB} MiB arrays): {before:.1f} GiB/s before the sizes, "
            f"{after:.1f} after; on a shared VM it changes from launch to launch and the "
            f"largest sizes' times follow it (docs/performance.md)")
    return all(r["ok"] and (r["halves"] is None or r["halves"]["ok"]) for r in rows)
