"""A whole training step's traffic: what every rank's trace records for one forward
and backward of the language model (embedding, layers, head, loss) equals the cost
model's :func:`summasim.costmodel.workload.step.model_messages`, which ``step_cost`` and the
accuracy benchmark price. Megatron on p ranks, Optimus and SUMMA2.5-LM on every
[q, q, d] grid of the communicator and on the rectangular [pr, pc, d] ones that
:func:`summasim.spec.grids` offers where it has no square one."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim.spec import grids
from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
from summasim.costmodel.workload.step import model_messages
from summasim.transformer import model
from summasim.transformer.schemes import SCHEMES

P = WORLD.Get_size()
# every dimension divisible by p (so by q, d q and the depth rings' d): exact chunks
B, S, H, HEADS, V, LAYERS = 2 * P, 4, 8 * P, P, 4 * P, 2

CASES = [("megatron", 1, 1, 1)] + [("optimus" if d == 1 else "summa25", q, q, d)
                                   for q, d in grid_shapes(P)] + [
    (g.name, g.q, g.pc, g.d) for name in ("optimus", "summa25") for g in grids(P, name)
    if g.pc]


def _counter(entries):
    out = Counter()
    for op, group, size, nbytes, count in entries:
        if size > 1:                       # a group of one sends nothing
            out[(op, group, int(size), int(nbytes))] += count
    return out


@pytest.mark.parametrize("name,q,pc,d", CASES, ids=[f"{n}-{q}x{pc}x{d}" for n, q, pc, d in
                                                    CASES])
def test_training_step_traffic_matches_model_messages(name, q, pc, d):
    config = model.Config(vocab=V, seq=S, hidden=H, heads=HEADS, layers=LAYERS, ffn_mult=4,
                          dtype=np.float64)
    params = model.init_params(config, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(B, S))
    targets = rng.integers(0, V, size=(B, S))
    module = SCHEMES[name].module
    grid = SCHEMES[name].make_grid(WORLD, q, d, pc=pc)
    try:
        local = module.shard(params, config, grid)
        _, cache = module.forward(local, tokens, targets, config, grid)
        module.backward(cache)
        got = _counter((e.op, e.group, e.group_size, e.nbytes, 1) for e in grid.trace.events)
        row0 = name == "megatron" or grid.coords[0] == 0
    finally:
        grid.free()
    scheme = (Scheme.make("megatron", p=P) if name == "megatron"
              else Scheme.make(name, q=q, d=d, pc=pc))
    cfg = TransformerConfig(b=B, s=S, h=H, n=HEADS, N=LAYERS, v=V, dtype="float64",
                            checkpoint=False)
    want = _counter(model_messages(scheme, cfg, row0=row0))
    parallel_assert(got == want and (sum(got.values()) > 0 or P == 1),
                    f"rank {WORLD.Get_rank()} {name} [{q},{pc},{d}]: trace - model "
                    f"{dict(got - want)}, model - trace {dict(want - got)}")
