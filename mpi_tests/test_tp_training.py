"""Ten Adam steps from one initialisation give one loss curve: serial, Megatron 1D,
Optimus 2D and SUMMA2.5-LM 2.5D, on every grid the process count allows."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert
from summasim.transformer import model
from summasim.transformer.schemes import SCHEMES
from summasim.transformer.train import Adam

P = WORLD.Get_size()
STEPS = 10
TOL = 1e-10  # float64, relative, on every step's loss and on the final parameters
CASES = [(name, q, pc, d) for name in ("megatron", "optimus", "summa25")
         for q, pc, d in SCHEMES[name].grids(P)]


def setup(q, d):
    """A config every case can shard at this P, its initial params and the batches."""
    heads = P  # Megatron needs heads % p, Optimus heads % pc; pc divides p = d pr pc
    config = model.Config(vocab=4 * P, seq=4, hidden=2 * heads, heads=heads, layers=2,
                          dtype=np.float64)
    batch = 2 * d * q
    rng = np.random.default_rng(42)
    params = model.init_params(config, seed=3)
    for val in params.values():
        if val.ndim == 1:  # LayerNorm and bias noise: no parameter starts at a special value
            val += rng.normal(0.0, 0.1, size=val.shape)
    # one batch, seen every step: the model memorises it, so the loss must fall
    tokens = rng.integers(0, config.vocab, size=(batch, config.seq))
    batches = [(tokens, np.roll(tokens, -1, axis=1))] * STEPS
    return config, batch, params, batches


@pytest.mark.parametrize("name,q,pc,d", CASES, ids=[f"{n}-{q}x{pc}x{d}" for n, q, pc, d in
                                                    CASES])
def test_adam_loss_curves_agree(name, q, pc, d):
    config, batch, params, batches = setup(q, d)
    why = SCHEMES[name].misfit(config, batch, P, q, d, pc)
    parallel_assert(why == "", f"test config does not fit {name}: {why}")
    module = SCHEMES[name].module

    serial = {k: v.copy() for k, v in params.items()}
    opt = Adam(lr=1e-2)
    ref = []
    for tokens, targets in batches:
        loss, cache = model.forward(serial, tokens, targets, config)
        opt.step(serial, model.backward(cache))
        ref.append(loss)

    grid = SCHEMES[name].make_grid(WORLD, q, d, pc=pc)
    try:
        local = module.shard(params, config, grid)
        popt = Adam(lr=1e-2)
        got = []
        for tokens, targets in batches:
            loss, cache = module.forward(local, tokens, targets, config, grid,
                                         checkpoint=len(got) % 2 == 1)
            popt.step(local, module.backward(cache))
            got.append(loss)
        final = module.unshard(local, config, grid)  # parameters share the gradients' layout
    finally:
        grid.free()
    curve = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    drift = max(float(np.max(np.abs(final[k] - serial[k]))) / float(np.max(np.abs(serial[k])))
                for k in serial)
    parallel_assert(curve <= TOL and drift <= TOL,
                    f"{name} [{q},{pc},{d}]: loss curve rel err {curve:.2e}, final params "
                    f"rel err {drift:.2e} (tolerance {TOL})")
    parallel_assert(ref[-1] < ref[0], f"the loss did not fall: {ref[0]:.4f} -> {ref[-1]:.4f}")
