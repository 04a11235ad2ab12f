"""The registry of tensor-parallel schemes (pure until a grid is built).

==========  ======================  ==============================================
name        module                  grid
==========  ======================  ==============================================
megatron    transformer.megatron    ``Grid1D`` over all p ranks
optimus     transformer.optimus     ``Grid(comm, q)``, p = q*q, or ``Grid(comm, pr, pc=pc)``
summa25     transformer.optimus     ``Grid(comm, q, d)``, p = d*q*q, d > 1 (or [pr, pc, d])
3d          transformer.tp3d        ``Grid(comm, q, q)``, p = q*q*q (the cube)
==========  ======================  ==============================================

Every scheme module exposes ``shard``, ``forward``, ``backward``, ``unshard`` and
``logits`` with the signatures of DESIGN.md. Nothing else lists the schemes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..spec import SCHEME_KINDS, TensorGrid, grids


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme: its module and the grids it runs on."""

    name: str
    module_name: str
    grid_kind: str            # "1d", "2d", "2.5d" or "3d"

    @property
    def module(self):
        return importlib.import_module(f"summasim.transformer.{self.module_name}")

    def grids(self, p: int) -> list[tuple[int, int, int]]:
        """The ``(q, pc, d)`` grids on p ranks (``q`` rows by ``pc`` columns, ``d``
        deep; Megatron: ``[(1, 1, 1)]``, meaning 1D over p): :func:`summasim.spec.grids`,
        the one enumeration, as the algorithms' :meth:`AlgorithmSpec.grids` give it."""
        return [(g.q, g.cols, g.d) for g in grids(p, self.name)]

    def needs(self) -> str:
        """What the process count must be, in words."""
        return {"1d": "any p", "2d": "p = pr*pc",
                "2.5d": "p = d*pr*pc with d >= 2 and a layer of two ranks or more",
                "3d": "p = q*q*q"}[self.grid_kind]

    def tensor_grid(self, p: int | None, q: int = 1, d: int = 1, pc: int = 0) -> TensorGrid:
        """This scheme's :class:`summasim.spec.TensorGrid` on p ranks (or [q, pc, d])."""
        return TensorGrid.of(self.name, q, d, p=p, pc=0 if pc == q else pc)

    def grid_label(self, p, q: int, d: int, pc: int = 0) -> str:
        if self.grid_kind == "1d" and p is None:
            return "1D p=?"
        return self.tensor_grid(p, q, d, pc).grid_label

    def misfit(self, config, batch: int, p: int, q: int = 1, d: int = 1, pc: int = 0) -> str:
        """Why the scheme cannot shard ``config`` with ``batch`` on this grid ("" when
        it can): :meth:`summasim.spec.TensorGrid.misfit`, the one rule."""
        return self.tensor_grid(p, q, d, pc).misfit(config, batch)

    def make_grid(self, world, q: int, d: int, backend=None, pc: int = 0):
        """The grid the scheme runs on (collective over ``world``): ``q`` rows by ``pc``
        columns (``q`` when 0), ``d`` deep."""
        from ..grid import Grid, Grid1D

        if self.grid_kind == "1d":
            return Grid1D(world, backend=backend)
        return Grid(world, q, d, backend=backend, pc=pc or None)


_MODULES = {"1d": "megatron", "2d": "optimus", "2.5d": "optimus", "3d": "tp3d"}
SCHEMES: dict[str, SchemeSpec] = {   # names and grid kinds: spec's registry
    name: SchemeSpec(name, _MODULES[kind], kind) for name, kind in SCHEME_KINDS.items()}
SCHEME_NAMES = tuple(SCHEMES)


def get_scheme(name: str) -> SchemeSpec:
    """The spec of ``name``; ``ValueError`` listing the choices otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose from "
                         f"{', '.join(SCHEMES)}") from None
