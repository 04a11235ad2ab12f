"""``shard`` returns fresh copies: an in-place optimizer step on the shards leaves the
serial parameters it was given bit-for-bit unchanged (Megatron on the whole
communicator, Optimus and SUMMA2.5-LM on every [q, q, d] grid that fits)."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim.grid import Grid, Grid1D
from summasim.transformer import megatron, model, optimus
from summasim.transformer.train import Adam

P = WORLD.Get_size()
GRIDS = grid_shapes(P)


def shared_keys(local: dict, params: dict) -> list[str]:
    """Local arrays that share memory with any serial parameter."""
    return [name for name, arr in local.items()
            if any(np.shares_memory(arr, ser) for ser in params.values())]


def check_fresh_copies(module, params: dict, config, grid) -> None:
    """shard, then an Adam step on the shards in place; the serial params must not move."""
    before = {name: arr.copy() for name, arr in params.items()}
    local = module.shard(params, config, grid)
    shared = shared_keys(local, params)
    not_contiguous = [n for n, a in local.items() if not a.flags.c_contiguous]
    rng = np.random.default_rng(7)
    grads = {n: rng.standard_normal(a.shape).astype(a.dtype) for n, a in local.items()}
    Adam(lr=0.1, weight_decay=0.01).step(local, grads)
    changed = [n for n in params if params[n].tobytes() != before[n].tobytes()]   # bitwise
    nonempty = any(a.size for a in local.values())
    parallel_assert(not shared, f"local arrays share memory with the serial params: {shared[:5]}")
    parallel_assert(not not_contiguous, f"not C-contiguous: {not_contiguous[:5]}")
    parallel_assert(not changed, f"an Adam step on the shards changed serial {changed[:5]}")
    parallel_assert(nonempty, "the shards are all empty: the test checks nothing")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_megatron_shard_is_a_copy(dtype):
    heads = 2 * P if P <= 8 else P
    cfg = model.Config(vocab=3 * P, seq=5, hidden=2 * heads, heads=heads, layers=2, dtype=dtype)
    with Grid1D(WORLD) as grid:
        check_fresh_copies(megatron, model.init_params(cfg, seed=3), cfg, grid)


@pytest.mark.parametrize("q,d", GRIDS, ids=[f"q{q}d{d}" for q, d in GRIDS])
def test_optimus_shard_is_a_copy(q, d):
    cfg = model.Config(vocab=3 * q, seq=5, hidden=4 * q, heads=2 * q, layers=2)
    with Grid(WORLD, q, d) as grid:
        check_fresh_copies(optimus, model.init_params(cfg, seed=4), cfg, grid)
