"""The table that describes each algorithm: what it computes, its layouts, the
stored shapes of its operands and what the global sizes must divide (pure).

Every front-end, test and benchmark reads this table; nothing else lists the
algorithms. ``ALGORITHMS[name]`` is an :class:`AlgorithmSpec`; ``spec.fn`` is the
function itself.

==============  =========  ====  ========  ========  ========
name            kind       op    A layout  B layout  C layout
==============  =========  ====  ========  ========  ========
cannon_ab       2d         ab    2d        2d        2d
summa_ab        2d         ab    2d        2d        2d
summa_abt       2d         abt   2d        2d        2d
summa_atb       2d         atb   2d        2d        2d
summa25_ab      2.5d       ab    2.5d      2d        2.5d
summa25_abt     2.5d       abt   2.5d      2d        2.5d
summa25_atb     2.5d       atb   2.5d      2.5d      2d
sd25_ab         2.5d-deep  ab    2d        2d        2d
mm3d_ab         3d         ab    3d-a      3d-b      3d-c
mm3d_abt        3d         abt   3d-a      3d-bt     3d-c
mm3d_atb        3d         atb   3d-at     3d-b      3d-c
ring_allreduce  ring       -     -         -         -
==============  =========  ====  ========  ========  ========

``op`` names C[m, n] = op(A)[m, k] op(B)[k, n]: ``ab`` stores A [m, k] and B [k, n],
``abt`` stores B as [n, k], ``atb`` stores A as [k, m].

Every product takes any sizes (``spec.any_size``: blocks of the balanced partition,
nested in the 3D products' cube layouts, :mod:`summasim.layout`), so ``divisors`` is 1
for each; SUMMA and SUMMA2.5 also rectangular grids (``spec.rectangular``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import block_counts
from ..spec import ALGORITHM_KINDS, ANY_SIZE, RECTANGULAR, grid_label, product_grids

OPS = ("ab", "abt", "atb")

# the global dimension names of each stored operand and of C, per op
_DIMS = {"ab": (("m", "k"), ("k", "n")), "abt": (("m", "k"), ("n", "k")),
         "atb": (("k", "m"), ("k", "n"))}


def stored_shapes(op: str, m: int, k: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global shapes of the stored A and B for C[m, n] = op(A)[m, k] op(B)[k, n]."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    size = {"m": int(m), "k": int(k), "n": int(n)}
    (ra, ca), (rb, cb) = _DIMS[op]
    return (size[ra], size[ca]), (size[rb], size[cb])


@dataclass(frozen=True)
class AlgorithmSpec:
    """One row of the table."""

    name: str
    kind: str                 # "2d" (q x q), "2.5d" ([q, q, d]), "2.5d-deep", "3d" or "ring"
    op: str | None = None     # "ab", "abt", "atb"; None for the ring
    layout_a: str | None = None
    layout_b: str | None = None
    layout_c: str | None = None

    @property
    def fn(self):
        """The algorithm function (``fn(a, b, grid, out=None)``; the ring:
        ``fn(x, comm, out=None)``)."""
        from .. import algorithms

        return getattr(algorithms, self.name)

    @property
    def is_product(self) -> bool:
        return self.kind != "ring"

    def _product_only(self, what: str) -> None:
        if not self.is_product:
            raise ValueError(f"{self.name} is not a product: it has no m, k, n ({what}); "
                             f"any length on any p runs, see chunk_bounds")

    def stored_shapes(self, m: int, k: int, n: int):
        """Global shapes of the stored A and B."""
        self._product_only("stored_shapes")
        return stored_shapes(self.op, m, k, n)

    @property
    def any_size(self) -> bool:
        """Whether it runs on sizes that do not divide its grid (the balanced partition)."""
        return self.name in ANY_SIZE

    @property
    def rectangular(self) -> bool:
        """Whether it runs on rectangular ``pr x pc`` grids."""
        return self.name in RECTANGULAR

    def operands(self, m: int, k: int, n: int, q: int, d: int, pc: int = 0) -> list:
        """``[((rows, cols), (row blocks, column blocks))]`` of the stored A, B and C on
        ``[q, q, d]`` (``[q, pc, d]``; the lower bounds' view,
        :func:`summasim.costmodel.workload.bounds.product_bounds`)."""
        self._product_only("operands")
        sa, sb = self.stored_shapes(m, k, n)
        out = [(shape, block_counts(lay, q, d, pc=pc)) for shape, lay in
               ((sa, self.layout_a), (sb, self.layout_b), ((m, n), self.layout_c))]
        if self.name == "sd25_ab":      # A and B are read from layer 0 only: d times
            out[:2] = [(shape, (r * d, c)) for shape, (r, c) in out[:2]]   # fewer per rank
        return out

    def grids(self, p: int) -> list[tuple[int, int, int]]:
        """The ``(pr, pc, d)`` grids this algorithm runs on with p ranks
        (:func:`summasim.spec.product_grids`; the ring: ``[(p, 1, 1)]`` meaning all p
        ranks in one group)."""
        if self.kind == "ring":
            return [(p, 1, 1)]
        return product_grids(p, self.name)

    def grid_label(self, q: int, d: int, pc: int = 0) -> str:
        if self.kind == "ring":
            return f"ring p={q}"
        return grid_label(self.kind if self.kind != "2.5d-deep" else "2.5d", q, d, pc)

    def divisors(self, q: int, d: int, pc: int = 0) -> dict[str, int]:
        """What each of m, k, n must be divisible by on a ``[q, q, d]`` (``[q, pc, d]``)
        grid: 1 for the products that take any sizes."""
        self._product_only("divisors")
        need = {"m": 1, "k": 1, "n": 1}
        if self.any_size:
            return need
        (ra, ca), (rb, cb) = _DIMS[self.op]
        for (r, c), lay in (((ra, ca), self.layout_a), ((rb, cb), self.layout_b),
                            (("m", "n"), self.layout_c)):
            nr, nc = block_counts(lay, q, d, pc=pc)
            need[r] = math.lcm(need[r], nr)
            need[c] = math.lcm(need[c], nc)
        return need

    def misfit(self, m: int, k: int, n: int, q: int, d: int, pc: int = 0) -> str:
        """Why (m, k, n) cannot run on [q, q, d] ("" when it can)."""
        bad = [f"{name}={size} must be at least 1" for name, size in zip("mkn", (m, k, n))
               if size < 1]
        if pc and pc != q and not self.rectangular:
            bad.append(f"{self.name} needs a square grid, got {q} x {pc}")
        need = self.divisors(q, d, pc)
        bad += [f"{name}={size} is not divisible by {need[name]}"
                for name, size in zip("mkn", (m, k, n)) if size >= 1 and size % need[name]]
        return "; ".join(bad)

    def round_up(self, m: int, k: int, n: int, q: int, d: int,
                 pc: int = 0) -> tuple[int, int, int]:
        """The smallest sizes at least (m, k, n) that fit ``[q, q, d]`` (``[q, pc, d]``)."""
        need = self.divisors(q, d, pc)
        return tuple(-(-size // need[name]) * need[name]
                     for name, size in zip("mkn", (m, k, n)))


# op and layouts of A, B and C per algorithm; the names and grid kinds are spec's registry
_ROWS = {
    "cannon_ab": ("ab", "2d", "2d", "2d"),
    "summa_ab": ("ab", "2d", "2d", "2d"),
    "summa_abt": ("abt", "2d", "2d", "2d"),
    "summa_atb": ("atb", "2d", "2d", "2d"),
    "summa25_ab": ("ab", "2.5d", "2d", "2.5d"),
    "summa25_abt": ("abt", "2.5d", "2d", "2.5d"),
    "summa25_atb": ("atb", "2.5d", "2.5d", "2d"),
    "sd25_ab": ("ab", "2d", "2d", "2d"),
    "mm3d_ab": ("ab", "3d-a", "3d-b", "3d-c"),
    "mm3d_abt": ("abt", "3d-a", "3d-bt", "3d-c"),
    "mm3d_atb": ("atb", "3d-at", "3d-b", "3d-c"),
    "ring_allreduce": (None, None, None, None),
}
ALGORITHMS: dict[str, AlgorithmSpec] = {
    name: AlgorithmSpec(name, kind, *_ROWS[name]) for name, kind in ALGORITHM_KINDS.items()}
PRODUCTS = tuple(name for name, s in ALGORITHMS.items() if s.is_product)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec of ``name``; ``ValueError`` listing the choices otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose from "
                         f"{', '.join(ALGORITHMS)}") from None
