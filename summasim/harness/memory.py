"""Per-rank memory: estimate before allocating, refuse what cannot fit, and say
what would (pure, except for reading /proc).

The estimate of a product run counts, per rank: the A, B and C blocks; the
algorithm's workspaces (two receive buffers per broadcast operand, two partial
products and the tree-reduce scratch for the reducing forms; the 3D product's
gathered operands and partial product; SD 2.5D's depth copies; a depth ring's
receive chunk and the trial rings of its first call); the host copy of C the check
reads; and the check itself (the float64 reference, scale and panel product for
``exact``, the panels and probe products for ``freivalds``). Peak RSS measured at
4096^3 on 4 ranks: 318 MiB, of which about 60 MiB is the interpreter and MPI before
any allocation; the estimate is 304 MiB (``--check freivalds``, what ``auto`` picks
there). ``mpi_tests/test_harness.py`` holds the estimate to the traced peak of the
deep products' arrays.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource

import numpy as np

from ..spec import stage_layers

from ..layout import max_block_shape
from .check import choose_method, panel_width

HEADROOM = 0.85      # use at most this share of the memory the OS calls available


def available_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping):
    :func:`summasim.cli.available_memory`."""
    from ..cli import available_memory

    return available_memory()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def product_bytes(case, method: str = "exact") -> int:
    """Estimated peak bytes per rank of a harness product run (see the module doc);
    ``method`` as given to the check ("auto" is resolved the way the check does)."""
    return sum(_product_parts(case, method))


def product_device_bytes(case, method: str = "exact") -> int:
    """The part of :func:`product_bytes` that a device backend (CuPy) holds on the
    rank's GPU: the blocks and the algorithm's workspaces. The check's host copy of C
    and its float64 reference stay on the host, which :func:`product_bytes` counts."""
    return _product_parts(case, method)[0]


def _product_parts(case, method: str) -> tuple[int, int]:
    """``(blocks and workspaces, the check's host buffers)`` of a product run."""
    spec, q, d, p, pc = case.spec, case.q, case.d, case.p, case.pc
    it = 8 if case.dtype == "float64" else 4
    sa, sb = spec.stored_shapes(case.m, case.k, case.n)
    # the largest blocks (uneven blocks differ by at most one row and column)
    na = math.prod(max_block_shape(sa, spec.layout_a, q, d, p, pc))
    nb_ = math.prod(max_block_shape(sb, spec.layout_b, q, d, p, pc))
    mb, nb = max_block_shape((case.m, case.n), spec.layout_c, q, d, p, pc)
    method = choose_method(method, mb, nb, case.k)      # "auto" as the check resolves it
    nc = mb * nb
    blocks = (na + nb_ + nc) * it
    side = max(q, case.cols)                            # the larger group of a layer
    if spec.layout_c == "3d-c":
        work = _mm3d_work(case, na, nb_, nc) * it
    else:
        work = (2 * na + 2 * nb_) * it if side > 1 else 0
        if spec.op != "ab" and side > 1:
            work += (2 + max(1, math.ceil(math.log2(side)))) * nc * it
        if d > 1 and (spec.op == "atb" or case.algorithm == "sd25_ab"):
            chunk = -(-nc // d)            # the depth ring all-reduce of C: its chunk
            work += (chunk + _ring_trial(chunk, d)) * it
    host = nc * 8                                       # float64 copy of C for the check
    width = panel_width(case)
    # float64 panels and their abs, and the generator's panels they are converted from
    panels = 3 * (mb * width + width * nb) * 8
    # exact: the reference, its scale and the product of a panel pair before it is added
    check = (3 * nc * 8 if method == "exact" else 4 * mb * 8 * 4) + panels
    return blocks + work, host + check


def _mm3d_work(case, na: int, nb: int, nc: int) -> int:
    """Items of the 3D product's workspaces (:func:`summasim.algorithms.deep._mm3d`):
    the row and column all-gathers of A's and B's pieces (q pieces each, padded to the
    largest; with uneven pieces also the padded send and the unpadded copy), the
    partial product ``C[M_i, N_j]`` (q of C's pieces), the depth ring's receive chunk
    (one piece) and its first call's trials."""
    q = case.q
    if q == 1:
        return 0
    uneven = any(x % (q * q) for x in (case.m, case.k, case.n))
    gathers = q * (na + nb) * (2 if uneven else 1) + ((na + nb) if uneven else 0)
    return gathers + (q + 1) * nc + _ring_trial(nc, q)


def _ring_trial(chunk: int, p: int) -> int:
    """Items of the scratch a ring's first call of a size class may hold while it
    measures how to wait (:func:`summasim.algorithms.allreduce.ring_trial`: a ring of
    p chunks and a receive chunk, freed before the ring's own steps)."""
    return (p + 1) * chunk if p > 1 else 0


#: vectors of the ring row's length a rank holds at its peak (measured 3.8 with NumPy at
#: N = 2e7 on 4 ranks, 4.5 through ipc-host, 4.9 through staged-host): its input and the
#: generator's copy of it, the result, the host copy the check reads (then the timed
#: calls' ``out``), and a staged or IPC copy of a vector on the stand-in backends
RING_VECTORS = 5


def ring_bytes(case, p: int) -> int:
    """Bytes a rank holds in the main job's ring row (:func:`run_ring`): RING_VECTORS
    vectors, the ring's chunk, and the check's float64 chunks."""
    it = 8 if case.dtype == "float64" else 4
    return (RING_VECTORS * case.n * it + (case.n // max(p, 1) + 1) * it
            + 4 * (1 << 18) * 8)


def largest_cube(case, ranks_on_node: int, budget: int, method: str = "exact",
                 size=product_bytes) -> int:
    """The largest n such that the case at n x n x n (rounded to fit the grid) fits
    ``budget`` bytes on a node running ``ranks_on_node`` ranks (0 if none does);
    ``size`` gives a rank's bytes (:func:`product_device_bytes` for a GPU's share)."""
    spec = case.spec
    step = math.lcm(*spec.divisors(case.q, case.d, case.pc).values())
    lo, hi = 0, 1
    fits = lambda n: ranks_on_node * size(  # noqa: E731
        type(case)(case.algorithm, case.q, case.d, n, n, n, case.dtype, case.pc),
        method) <= budget
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def check_node_and_gpu(fits, ranks_on_node: int, gpu) -> str:
    """The node's check, then the GPU's: ``fits(ranks, **kw)`` is one of the checks
    here (``check_fits``, ``check_training_fits``, ``bench.check_bench_fits``) with its
    other arguments bound; ``gpu`` is ``(free bytes, ranks sharing it)`` from
    :func:`summasim.backends.device_share`, or None for a host backend."""
    why = fits(ranks_on_node)
    if why or gpu is None:
        return why
    free, sharing = gpu
    return fits(sharing, available=free, device=True)


def places(device: bool) -> tuple[str, str, str]:
    """``(per rank, the ranks' place, what the budget is a share of)`` in messages."""
    if device:
        return "per rank on its GPU", "sharing one GPU", "free on the GPU"
    return "per rank", "on this node", "available"


def check_fits(case, ranks_on_node: int, method: str = "exact", available: int | None = None,
               p: int | None = None, device: bool = False) -> str:
    """"" when the case fits this node's available memory, else a message that says
    how much it needs, what is available and the largest cube that fits. It runs
    after every rank has started, so what they hold already (the interpreter, MPI)
    is outside ``MemAvailable``.

    ``device=True``: the check of one GPU instead, for a device backend:
    ``ranks_on_node`` is the number of ranks that share it and ``available`` its free
    memory; a rank's share is :func:`product_device_bytes` (a ring: its vectors)."""
    avail = available_bytes() if available is None else available
    budget = int(HEADROOM * avail)
    each, where, pool = places(device)
    if case.kind == "ring":
        need = ranks_on_node * ring_bytes(case, p or ranks_on_node)
        if need <= budget:
            return ""
        per = ring_bytes(case, p or ranks_on_node)
        most = int(case.n * budget / need)
        return (f"{case.label(p)} needs about {per / 2**30:.2f} GiB {each}, "
                f"{need / 2**30:.1f} GiB for {ranks_on_node} ranks {where}, but "
                f"{budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
                f"{avail / 2**30:.1f} GiB {pool}); the largest that fits is about "
                f"N = {most}")
    size = product_device_bytes if device else product_bytes
    per = size(case, method)
    if ranks_on_node * per <= budget:
        return ""
    n = largest_cube(case, ranks_on_node, budget, method, size)
    fits = f"the largest cube that fits is {n}x{n}x{n}" if n else "not even the smallest fits"
    return (f"{case.label()} {case.dtype} needs about {per / 2**30:.2f} GiB {each}, "
            f"{ranks_on_node * per / 2**30:.1f} GiB for {ranks_on_node} ranks {where}, "
            f"but {budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
            f"{avail / 2**30:.1f} GiB {pool}); {fits}")


# Training runs (a scheme's step or a mesh's Adam steps, validated against the serial model).
# Rank 0 runs the serial model, then publishes its inputs, parameters, gradients (a mesh's:
# of every step, and the final parameters) and logits in one shared-memory copy per node
# (``harness.shared``, the ``window`` below); every rank copies out only its own blocks
# (about its shard's parameters and gradients again, and its block of the logits).
# Node memory above idle (``MemAvailable`` sampled every 20 ms through summasim.run,
# float64, s = 256, v = 2048, 2 layers; idle ~40 MiB a rank), measured at p = 16
# (Megatron b = 16, h = 512: 9.1 GiB; SUMMA2.5 [2,2,4] b = 16, h = 512: 4.1 GiB; mesh
# dp=2,pp=2,tp=optimus:2x2 b = 16, h = 512: 3.8 GiB) and p = 4 (Optimus 2x2 b = 32,
# h = 1024: 10.3 GiB; Megatron the same: 12.9 GiB; mesh dp=2,pp=2,tp=megatron:1 b = 16,
# h = 1024: 5.2 GiB):
#   rank 0: 1.4-1.5x the serial model's parameters, gradients and activations (the cost
#     model's formula at p = 1) in scheme runs (its peak RSS less the shared pages), more
#     in mesh runs (it keeps every step's gradients);
#   other ranks: up to 2.05x the scheme's per-rank formula (``shard``) once rank 0 and
#     the window are taken off (Megatron, whose activations are replicated over the
#     group; SUMMA2.5 1.0x); for a mesh rank (the formula of its tensor grid on a
#     replica's batch and a stage's layers) less than 1x, because the ranks' peaks do not
#     coincide with rank 0's.
# The estimate adds every rank's peak with margins: 1.15-1.8x the measured node totals
# of the scheme runs, 1.6x those of the meshes.
SERIAL_FACTOR = {"transformer": 1.5, "mesh": 1.9}
SHARD_FACTOR = {"transformer": 2.4, "mesh": 1.6}


def scheme_memory(scheme: str, t: int, q: int, d: int, config, batch: int, checkpoint: bool,
                  pc: int = 0):
    """The cost model's per-rank :class:`~summasim.costmodel.workload.footprint.Memory` of ``scheme``
    on ``t`` ranks (Megatron) or a ``q x q x d`` grid (``q x pc x d``), for a model
    ``config`` and batch."""
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
    from summasim.costmodel.workload.footprint import memory

    sch = (Scheme.make("megatron", p=t) if scheme == "megatron"
           else Scheme.make(scheme, q=q, d=d, pc=pc or None))
    return memory(sch, TransformerConfig.from_model(config, batch, checkpoint=checkpoint))


def training_bytes(case, p: int) -> tuple[int, int, int]:
    """``(rank 0, any other rank, the node's shared reference)`` estimated peak bytes of
    a transformer or mesh case (see the factors above): rank 0 also runs the serial
    model; the shared reference is one copy per node, whatever the ranks on it."""
    config, k = case.config, case.kind
    item = np.dtype(config.dtype).itemsize
    ser = scheme_memory("megatron", 1, 1, 1, config, case.batch, False)
    serial = ser.params + ser.embedding + ser.grads + ser.activations
    params = ser.params + ser.embedding
    tokens = 2 * case.batch * config.seq * 8                     # tokens and targets, int64
    logits = case.batch * config.seq * config.vocab * item
    if k == "mesh":
        split = stage_layers(config.layers, case.pp, getattr(case, "stages", None),
                             getattr(case, "chunks", 1))
        most = max(sum(len(r) for r in split[s::case.pp]) for s in range(case.pp))
        stage = dataclasses.replace(config, layers=max(most, 1))
        m = scheme_memory(case.scheme, case.tensor_size, case.q, case.d, stage,
                          -(-case.batch // case.dp), case.checkpoint, case.pc)
        # the reference runs in float64; one step of it is shared at a time (its start
        # parameters, the two moments, the gradients, the next parameters, the bound),
        # and rank 0 keeps its parameters and moments between steps
        wide = max(1, 8 // item)
        window = 6 * params * wide + tokens
        serial = serial * wide + 3 * params * wide
    else:
        m = scheme_memory(case.scheme, p, case.q, case.d, config, case.batch, False, case.pc)
        wide = max(1, 8 // item)          # the reference runs in float64
        window = (2 * params + logits) * wide + tokens
        serial = serial * wide
    shard = m.params + m.grads + m.optimizer + m.activations + m.workspace + m.embedding
    other = SHARD_FACTOR[k] * shard + logits / p
    return int(max(SERIAL_FACTOR[k] * serial, other)), int(other), int(window)


def check_training_fits(case, p: int, ranks_on_node: int, available: int | None = None,
                        device: bool = False, peer: bool = False) -> str:
    """"" when a transformer or mesh case fits this node (rank 0 and the others on
    it), else a message with what it needs, what can be used and the largest global
    batch of the same shape that fits.

    ``device=True``: the check of one GPU that ``ranks_on_node`` ranks share, with
    ``available`` its free memory. The serial reference and its shared copy stay on
    the host, so each of them holds a shard rank's share there, rank 0 included.
    ``peer=True``: every rank also holds a peer that trains the same composition
    (``bench mesh --torch``), counted as a second shard rank's share."""
    avail = available_bytes() if available is None else available
    budget = int(HEADROOM * avail)

    def need(c):
        root, other, window = training_bytes(c, p)
        if peer:
            root, other = root + other, 2 * other
        if device:
            return ranks_on_node * other, root, other, window
        return root + window + (ranks_on_node - 1) * other, root, other, window

    total, root, other, window = need(case)
    if total <= budget:
        return ""
    ok = lambda b: dataclasses.replace(case, batch=b).misfit(p) == ""  # noqa: E731
    unit = next(b for b in range(1, case.batch + 1) if case.batch % b == 0 and ok(b))
    lo, hi = 0, case.batch // unit       # multiples k * unit: k = lo fits, k = hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(dataclasses.replace(case, batch=mid * unit))[0] <= budget \
            else (lo, mid)
    best = lo * unit if lo and ok(lo * unit) else 0
    fits = (f"the largest global batch that fits is about {best}" if best
            else f"not even batch {unit} fits")
    if device:
        return (f"{case.label(p)} needs about {other / 2**30:.2f} GiB per rank on its GPU, "
                f"{total / 2**30:.1f} GiB for {ranks_on_node} ranks sharing one GPU, but "
                f"{budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
                f"{avail / 2**30:.1f} GiB free on the GPU); {fits}")
    return (f"{case.label(p)} needs about {total / 2**30:.1f} GiB on this node "
            f"({root / 2**30:.2f} GiB on rank 0, which also runs the serial reference, "
            f"{window / 2**30:.2f} GiB for the reference shared by the node's ranks, "
            f"{other / 2**30:.2f} GiB on each other rank of {ranks_on_node}), but "
            f"{budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
            f"{avail / 2**30:.1f} GiB available); {fits}")
