"""No product moves fewer words than the communication lower bounds allow: the busiest
rank's ledger over the larger bound is at least 1 on every grid the world size allows
(a ratio below 1 would mean the ledger or the bound is wrong), and the ratio the report
prints is that number."""

from __future__ import annotations

import pytest

from _util import WORLD, parallel_assert
from summasim.algorithms.table import PRODUCTS
from summasim.backends import get_backend
from summasim.harness.execute import run_product
from summasim.harness.plan import plan_products
from summasim.harness.report import words_over_bound

P = WORLD.Get_size()


@pytest.mark.parametrize("sizes", [(256, 256, 256), (384, 128, 512), (288, 96, 192)])
def test_every_product_moves_at_least_the_lower_bound(sizes):
    cases, _ = plan_products(P, list(PRODUCTS), sizes)
    cases = [c for c in cases if c.kind == "matmul"]
    if not cases:
        pytest.skip(f"no product fits {sizes} at p = {P}")
    rows = []
    for case in cases:
        res = run_product(case, WORLD, get_backend("numpy"), repeats=0, timed=False)
        lb = words_over_bound(res)
        rows.append((case.algorithm, case.grid_label(P), lb["bound"], lb["words_per_rank"],
                     lb["ratio"]))
    bad = [r for r in rows if r[4] is not None and r[4] < 1.0]
    parallel_assert(not bad and (P == 1 or any(r[4] for r in rows)),
                    f"below the bound: {bad}; all: {rows}")
