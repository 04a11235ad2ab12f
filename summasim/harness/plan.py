"""Which cases a job runs on p ranks (pure: no MPI).

:func:`plan_products` turns algorithm names, sizes and dtypes into
:class:`~summasim.harness.cases.MatmulCase` / :class:`~summasim.harness.cases.RingCase`
on every grid that fits p, and :func:`plan_schemes` does the same for the
tensor-parallel schemes, and :func:`plan_meshes` for the sharded-training meshes
(:class:`~summasim.harness.cases.MeshCase`). What cannot run is returned as a :class:`Skip` with the
reason. Default sizes are rounded up to fit each grid; sizes a user gave must fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..algorithms.table import ALGORITHMS
from ..transformer.schemes import SCHEMES
from ..spec import Mesh
from .cases import MatmulCase, MeshCase, RingCase, TransformerCase

DEFAULT_SIZES = (1536, 1024, 1280)
DEFAULT_RING = 2**20 + 3  # deliberately not divisible by common p
SELF_TEST_SIZES = (96, 64, 80)
SELF_TEST_RING = 1001


@dataclass(frozen=True)
class Skip:
    """A run that does not fit, and why."""

    name: str
    reason: str
    grid: str = ""


def plan_products(p: int, algorithms, sizes=None, ring_n: int | None = None,
                  dtypes=("float64",)) -> tuple[list, list[Skip]]:
    """``(cases, skips)`` for world size p; ``sizes=None`` uses the defaults rounded up."""
    exact = sizes is not None
    m, k, n = tuple(sizes) if exact else DEFAULT_SIZES
    cases, skips = [], []
    for dtype in dtypes:
        for name in algorithms:
            spec = ALGORITHMS[name]
            if spec.kind == "ring":
                cases.append(RingCase(int(ring_n or DEFAULT_RING), dtype))
                continue
            grids = spec.grids(p)
            if not grids:
                if dtype == dtypes[0]:
                    skips.append(Skip(name, {
                        "2d": f"needs a square number of ranks (q x q: Cannon shifts around "
                              f"a square torus; SUMMA runs on pr x pc); p = {p} is not",
                        "3d": f"needs a cube number of ranks (q x q x q); p = {p} is not",
                        "2.5d-deep": f"needs p = c q^2 ranks with q, c >= 2; p = {p} is "
                                     f"not"}[spec.kind]))
                continue
            for q, pc, d in grids:
                shapes = (m, k, n) if exact else spec.round_up(m, k, n, q, d, pc)
                why = spec.misfit(*shapes, q, d, pc)
                if why:
                    if dtype == dtypes[0]:
                        skips.append(Skip(name, why, spec.grid_label(q, d, pc)))
                    continue
                cases.append(MatmulCase(name, q, d, *shapes, dtype, pc))
    return cases, skips


def fitted_batch(spec, config, batch: int, p: int, q: int, d: int, pc: int = 0) -> int:
    """``batch``, or where the grid needs whole sequences per rank that ``batch`` does not
    cut into and the model itself fits, the next multiple of the grid's row blocks
    (``d q``, the cube's ``q^2``): 8 becomes 9 on ``[3, 3, 3]`` and on ``3x3x3``."""
    if not spec.misfit(config, batch, p, q, d, pc) or spec.misfit(config, None, p, q, d, pc):
        return batch
    tg = spec.tensor_grid(p, q, d, pc)
    rows = next(div for what, _, div, _ in tg.divisors(config.hidden, config.heads,
                                                       config.ffn, batch=batch)
                if what == "batch")
    return -(-batch // rows) * rows


def plan_schemes(p: int, schemes, config_of, batch: int, dtypes=("float64",),
                 fit_batch: bool = False) -> tuple[list, list[Skip]]:
    """Transformer cases of each scheme on every grid that fits p; ``config_of(dtype)``
    gives the model configuration. With ``fit_batch`` (the batch is the model's default,
    not one the user asked for) a grid that cannot cut ``batch`` into whole sequences per
    rank runs the next batch it can (:func:`fitted_batch`) instead of being skipped."""
    cases, skips = [], []
    for name in schemes:
        spec = SCHEMES[name]
        grids = spec.grids(p)
        if not grids:
            skips.append(Skip(name, f"needs {spec.needs()}; p = {p} does not fit"))
            continue
        for q, pc, d in grids:
            for dtype in dtypes:
                config = config_of(dtype)
                b = fitted_batch(spec, config, batch, p, q, d, pc) if fit_batch else batch
                why = spec.misfit(config, b, p, q, d, pc)
                if why:
                    if dtype == dtypes[0]:
                        skips.append(Skip(name, why, spec.grid_label(p, q, d, pc)))
                    continue
                cases.append(TransformerCase(name, q, d, b, config, pc))
    return cases, skips


def default_meshes(p: int) -> list[tuple[Mesh, dict]]:
    """A few compositions for a job of p ranks without ``--mesh``: pipeline and data
    parallelism around each tensor scheme, each ZeRO stage and both schedules once
    (those that do not fit the model are skipped with the reason). Where p is not a
    multiple of 4, plain data parallelism over p replicas and, for even p, two pipeline
    stages of p / 2 replicas."""
    out = []
    if p % 4 == 0:
        out.append((f"dp=2,pp=2,tp=megatron:{p // 4}",
                    dict(zero=1, schedule="1f1b", microbatches=2)))
        q = math.isqrt(p // 4)
        if q >= 2 and q * q == p // 4:
            out.append((f"dp=2,pp=2,tp=optimus:{q}x{q}",
                        dict(zero=2, schedule="1f1b", microbatches=2, checkpoint=True)))
    if p % 8 == 0:
        out.append((f"dp={p // 8},pp=1,tp=summa25:2x2x2",
                    dict(zero=3, schedule="gpipe", microbatches=1)))
    if p % 16 == 0:
        out.append((f"dp={p // 16},pp=2,tp=3d:2x2x2",
                    dict(zero=1, schedule="1f1b", microbatches=2)))
    if p % 4 == 0 and p >= 8:
        out.append((f"dp={p // 4},pp=2,tp=megatron:2",
                    dict(zero=0, schedule="gpipe", microbatches=2)))
    if p > 1 and p % 4:   # no tensor grid above fits p: data and pipeline parallelism alone
        out.append((f"dp={p}", dict(zero=2, schedule="1f1b", microbatches=1)))
        if p % 2 == 0:
            out.append((f"dp={p // 2},pp=2", dict(zero=1, schedule="1f1b", microbatches=2)))
    return [(Mesh.parse(text), opts) for text, opts in out]


#: How many batch sizes :func:`fitted_mesh_batch` tries.
FIT_TRIES = 64


def fitted_mesh_batch(case: MeshCase, p: int) -> int:
    """``case.batch``, or where the mesh cannot cut it (into dp replicas of m
    micro-batches, each into whole sequences per tensor rank) the next multiple of dp m
    that it can, among the next :data:`FIT_TRIES` (else ``case.batch``, and the case
    says why it misfits)."""
    if not case.misfit(p):
        return case.batch
    unit = case.dp * case.microbatches
    start = -(-case.batch // unit) * unit
    for b in range(start, start + FIT_TRIES * unit, unit):
        if not dataclasses.replace(case, batch=b).misfit(p):
            return b
    return case.batch


def plan_meshes(p: int, specs, config, batch: int, explicit: bool, fit_batch: bool = False,
                **kw) -> tuple[list, list[Skip], str]:
    """Mesh cases for ``specs`` (``[(mesh, options)]``, a mesh a :class:`Mesh` or its
    text; the options are :class:`MeshCase` fields: zero, schedule, chunks, stages,
    microbatches, ...). Returns ``(cases, skips, err)``: a mesh the user asked for that
    cannot run is an error (``err``, naming the numbers: ranks, a layer split that does
    not fit the model's layers, an interleaved schedule over one stage or over
    micro-batches that are not a multiple of pp, a batch or micro-batch the scheme
    cannot shard), a default one that cannot is skipped with the reason; nothing runs
    before. With ``fit_batch`` (the batch is the model's default, not one the user asked
    for) a default mesh that cannot cut ``batch`` runs the next batch it can
    (:func:`fitted_mesh_batch`)."""
    cases, skips = [], []
    for text, opts in specs:
        try:
            case = MeshCase.parse(text, batch, config, **{**kw, **opts})
        except ValueError as e:
            return [], [], f"--mesh {text}: {e}"
        if fit_batch and not explicit:
            case = dataclasses.replace(case, batch=fitted_mesh_batch(case, p))
        why = case.misfit(p)
        if why:
            if explicit:
                return [], [], f"--mesh {text}: {why}"
            skips.append(Skip(str(case.mesh), why))
            continue
        cases.append(case)
    return cases, skips, ""
