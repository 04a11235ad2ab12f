"""Which cases a job runs on p ranks (pure: no MPI).

:func:`plan_products` turns algorithm names, sizes and dtypes into
:class:`~summasim.harness.cases.MatmulCase` / :class:`~summasim.harness.cases.RingCase`
on every grid that fits p, and :func:`plan_schemes` does the same for the
tensor-parallel schemes. What cannot run is returned as a :class:`Skip` with the
reason. Default sizes are rounded up to fit each grid; sizes a user gave must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.table import ALGORITHMS
from ..transformer.schemes import SCHEMES
from .cases import MatmulCase, RingCase, TransformerCase

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
                    skips.append(Skip(name, f"needs a square number of ranks (q x q); "
                                            f"p = {p} is not"))
                continue
            for q, d in grids:
                shapes = (m, k, n) if exact else spec.round_up(m, k, n, q, d)
                why = spec.misfit(*shapes, q, d)
                if why:
                    if dtype == dtypes[0]:
                        skips.append(Skip(name, why, spec.grid_label(q, d)))
                    continue
                cases.append(MatmulCase(name, q, d, *shapes, dtype))
    return cases, skips


def plan_schemes(p: int, schemes, config_of, batch: int, dtypes=("float64",)
                 ) -> tuple[list, list[Skip]]:
    """Transformer cases of each scheme on every grid that fits p; ``config_of(dtype)``
    gives the model configuration."""
    cases, skips = [], []
    for name in schemes:
        spec = SCHEMES[name]
        grids = spec.grids(p)
        if not grids:
            skips.append(Skip(name, f"needs {spec.needs()}; p = {p} does not fit"))
            continue
        for q, d in grids:
            for dtype in dtypes:
                config = config_of(dtype)
                why = spec.misfit(config, batch, p, q, d)
                if why:
                    if dtype == dtypes[0]:
                        skips.append(Skip(name, why, spec.grid_label(p, q, d)))
                    continue
                cases.append(TransformerCase(name, q, d, batch, config))
    return cases, skips
