"""The registry of tensor-parallel schemes (pure until a grid is built).

==========  ======================  ==============================================
name        module                  grid
==========  ======================  ==============================================
megatron    transformer.megatron    ``Grid1D`` over all p ranks
optimus     transformer.optimus     ``Grid(comm, q)``, p = q*q
summa25     transformer.optimus     ``Grid(comm, q, d)``, p = d*q*q, d > 1
==========  ======================  ==============================================

Every scheme module exposes ``shard``, ``forward``, ``backward``, ``unshard`` and
``logits`` with the signatures of DESIGN.md. Nothing else lists the schemes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..grid import grid_shapes


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme: its module and the grids it runs on."""

    name: str
    module_name: str
    grid_kind: str            # "1d", "2d" or "2.5d"

    @property
    def module(self):
        return importlib.import_module(f"summasim.transformer.{self.module_name}")

    def grids(self, p: int) -> list[tuple[int, int]]:
        """The ``(q, d)`` grids on p ranks (Megatron: ``[(1, 1)]``, meaning 1D over p)."""
        if self.grid_kind == "1d":
            return [(1, 1)]
        if self.grid_kind == "2d":
            return grid_shapes(p, "2d")
        return [(q, d) for q, d in grid_shapes(p, "2.5d") if q >= 2 and d >= 2]

    def needs(self) -> str:
        """What the process count must be, in words."""
        return {"1d": "any p", "2d": "p = q*q",
                "2.5d": "p = d*q*q with q >= 2, d >= 2"}[self.grid_kind]

    def grid_label(self, p, q: int, d: int) -> str:
        if self.grid_kind == "1d":
            return f"1D p={p if p is not None else '?'}"
        return f"{q}x{q}" if self.grid_kind == "2d" else f"[{q},{q},{d}]"

    def misfit(self, config, batch: int, p: int, q: int = 1, d: int = 1) -> str:
        """Why the scheme cannot shard ``config`` with ``batch`` on this grid ("" when
        it can)."""
        if self.grid_kind == "1d":
            checks = [("heads", config.heads, p), ("vocab", config.vocab, p),
                      ("ffn width", config.ffn, p)]
        else:
            checks = [("batch", batch, d * q), ("hidden", config.hidden, q),
                      ("heads", config.heads, q), ("vocab", config.vocab, q),
                      ("ffn width", config.ffn, q)]
        bad = [f"{what} = {size} is not divisible by {by}" for what, size, by in checks
               if size % by]
        return "; ".join(bad)

    def make_grid(self, world, q: int, d: int, backend=None):
        """The grid the scheme runs on (collective over ``world``)."""
        from ..grid import Grid, Grid1D

        if self.grid_kind == "1d":
            return Grid1D(world, backend=backend)
        return Grid(world, q, d, backend=backend)


SCHEMES: dict[str, SchemeSpec] = {s.name: s for s in (
    SchemeSpec("megatron", "megatron", "1d"),
    SchemeSpec("optimus", "optimus", "2d"),
    SchemeSpec("summa25", "optimus", "2.5d"),
)}
SCHEME_NAMES = tuple(SCHEMES)


def get_scheme(name: str) -> SchemeSpec:
    """The spec of ``name``; ``ValueError`` listing the choices otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose from "
                         f"{', '.join(SCHEMES)}") from None
