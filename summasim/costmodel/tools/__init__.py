"""The cost model's tools: the commands and analyses built on the pricers (pure, no MPI).

predict        ``costmodel predict``: one tensor grid, or one whole composition
               (``--mesh dp=..,pp=..,tp=..``), its step time, breakdown and memory
plan           the planner's search: the dp x pp x tensor x ZeRO compositions that fit,
               ranked (``plan_cli``: ``costmodel plan``, its arguments, tables, plot)
explore        the what-if tables: scaling sweeps, matrix products, isoefficiency, the
               largest batch (``explore_cli``: ``costmodel explore``)
_cli           what the command-line tools share: machine, model, batch and dtype
               resolution, output checks, number format and tables, plots
devset         ``costmodel devset``: the model against published GPU-cluster numbers
isoefficiency  W(p) at fixed efficiency and its growth exponent
accuracy       the pure analysis of the accuracy benchmark (predicted against measured)
bench          the predictions of ``python -m summasim.bench``: a ring all-reduce's time,
               the benchmarks' memory, the prediction target

Every tool enumerates grids with :func:`summasim.spec.grids` (THE enumeration: the grids
the main job runs), through :func:`scheme_grids` here.
"""

from __future__ import annotations

from summasim import spec


def scheme_of(grid: "spec.TensorGrid"):
    """The cost model's :class:`~summasim.costmodel.workload.scheme.Scheme` of a
    :class:`summasim.spec.TensorGrid`."""
    from summasim.costmodel.workload.scheme import Scheme

    if grid.kind == "1d":
        return Scheme("megatron", grid.p)
    return Scheme.of_grid(grid)


def parse_grid(scheme: str, text: str):
    """A devset point's ``scheme`` and ``grid`` (``"8"``, ``"2x2"``, ``"2x3"``, ``"2x2x4"``) as a
    cost-model Scheme, through :meth:`summasim.spec.TensorGrid.parse`; ValueError says
    what is expected."""
    return scheme_of(spec.TensorGrid.parse(f"{scheme}:{text}"))


def scheme_grids(p: int, name: str, cfg=None, *, batch: bool = True) -> list:
    """The grids of ``p`` ranks for scheme ``name`` (:func:`summasim.spec.grids`) as
    cost-model Schemes, in spec's order (q ascending);
    with ``cfg`` (a TransformerConfig) only those that divide it
    (:func:`~summasim.costmodel.workload.scheme.misfit`, the batch too unless ``batch=False``).

    Optimus is the q x q grid where p is a square, else the most square ``pr x pc``
    both ways round; SUMMA2.5-LM every [q, q, d] with q >= 2 and d >= 2, d > q
    included, else the smallest depth d >= 2 over its most square ``pr x pc`` both ways;
    [q, q, 1] is Optimus and not listed as a SUMMA2.5 grid.
    """
    from summasim.costmodel.workload.scheme import misfit

    out = [scheme_of(g) for g in spec.grids(p, name)]
    if cfg is not None:
        out = [sch for sch in out if misfit(sch, cfg, batch=batch) is None]
    return out
