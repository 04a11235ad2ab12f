"""The benchmarks validate what they time: ``bench gemm`` fails a product the main job
fails (it checked with Freivalds alone, whose row threshold passed a block 100x past
the per-entry bound), and says which check ran."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert
from summasim import algorithms as algs
from summasim.bench.gemm import bench_gemm


@pytest.mark.parametrize("rel", [0.0, 1e-11])
def test_bench_gemm_fails_a_block_the_main_job_fails(monkeypatch, rel):
    orig = algs.summa_ab

    def off(a, b, grid, out=None, **kw):
        c = orig(a, b, grid, out=out, **kw)
        if WORLD.Get_rank() == 0 and c.size:
            c[0, 0] *= 1 + rel                      # rank 0's first entry, 1e-11 off
        return c

    monkeypatch.setattr(algs, "summa_ab", off)
    rows = bench_gemm(WORLD, 128, np.float64, 1, ["summa_ab"], lambda line: None)
    parallel_assert(len(rows) == 1, f"rows {rows}")
    row = rows[0]
    parallel_assert(row["ok"] == (rel == 0.0) and row["check"]["method"] == "exact",
                    f"rel {rel}: ok {row['ok']}, check {row['check']}")
