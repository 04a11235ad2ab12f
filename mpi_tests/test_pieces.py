"""The piece API of the scheme modules (``embed_*``, ``layer_*``, ``head_*``,
``stage_keys``), which the pipeline / ZeRO engine drives, against the serial model.

A pipeline is played on the ranks of one tensor grid: the layers are split into 2 or 3
contiguous stages run one after another, each stage holding only the parameters
``stage_keys`` gives it, and the batch into 2 micro-batches, GPipe order (every
forward, then every backward, last micro-batch first). Each head is given the whole
batch's item count as ``n_items``; the sum of the micro-batch losses must be the
whole-batch loss of ``model.forward`` and the gradients -- summed over micro-batches,
the tied ``wte``'s embedding part (first stage) and LM head part (last stage) added
as the engine's all-reduce between them would, then ``unshard()``ed -- every gradient
of ``model.backward``, in float64 to 1e-10 relative (``max|par - ser| / max|ser|``;
observed ~1e-15: only summation orders differ), checkpointing off and on.

Megatron 1D runs on every process count (the language model and the classifier);
Optimus / SUMMA2.5-LM on every ``[q, q, d]`` grid of the communicator (labelled
``summa25`` when d > 1). A scheme with no grid at this size skips on every rank.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim.transformer import model
from summasim.transformer.schemes import SCHEMES

P = WORLD.Get_size()
S = 4                  # tokens per sequence (seq = 5: wpe keeps a row no token reaches)
LAYERS = 3
MICRO = 2              # micro-batches
TOL = 1e-10
SPLITS = {"2stages": [[0, 1], [2]], "3stages": [[0], [1], [2]]}


def _cases():
    """``(scheme, q, d, n_classes)`` per grid of this P; a skip where a scheme has none."""
    grids = {"megatron": [(1, 1)],
             "optimus": [(q, d) for q, d in grid_shapes(P) if d == 1],
             "summa25": [(q, d) for q, d in grid_shapes(P) if d > 1]}
    needs = {"optimus": "p = q*q", "summa25": "p = d*q*q with d > 1"}
    out = [pytest.param("megatron", 1, 1, 3, id="megatron-cls")]
    for name, shapes in grids.items():
        for q, d in shapes:
            out.append(pytest.param(name, q, d, 0, id=f"{name}-q{q}d{d}"))
        if not shapes:
            out.append(pytest.param(name, 0, 0, 0, id=f"{name}-none", marks=pytest.mark.skip(
                reason=f"{name} has no grid on {P} ranks (needs {needs[name]})")))
    return out


CASES = _cases()


def make_setup(q, d, n_classes):
    """Config (fits Megatron on P ranks and the [q, q, d] grid), params with every vector
    off its init value, and a whole batch of ``MICRO`` micro-batches of b/(dq)-divisible
    size."""
    cfg = model.Config(vocab=4 * P, seq=S + 1, hidden=2 * P, heads=P, layers=LAYERS,
                       dtype=np.float64, n_classes=n_classes)
    params = model.init_params(cfg, seed=5)
    rng = np.random.default_rng(7)
    for val in params.values():
        if val.ndim == 1:
            val += rng.normal(0.0, 0.1, val.shape)
    b = MICRO * max(2, d * q)
    tokens = rng.integers(0, cfg.vocab, (b, S))
    targets = (rng.integers(0, n_classes, (b,)) if n_classes
               else rng.integers(0, cfg.vocab, (b, S)))
    return cfg, params, tokens, targets


def rel_err(par, ser) -> float:
    par, ser = np.asarray(par, np.float64), np.asarray(ser, np.float64)
    return float(np.abs(par - ser).max(initial=0.0)
                 / max(np.abs(ser).max(initial=0.0), np.finfo(np.float64).tiny))


def add_into(acc: dict, grads: dict, prefix: str = "") -> None:
    """``acc[prefix + key] += grads[key]`` (a copy the first time)."""
    for key, val in grads.items():
        name = prefix + key
        acc[name] = acc[name] + val if name in acc else val.copy()


def run_pipeline(module, local, tokens, targets, cfg, grid, split, checkpoint):
    """Stages one after another on the same ranks, GPipe over ``MICRO`` micro-batches.

    Returns the summed loss, every rank's micro-batch losses and the local gradients
    (keys and order of ``local``)."""
    n = len(split)
    owned = [{key: local[key] for key in module.stage_keys(cfg, layers, s == 0, s == n - 1)}
             for s, layers in enumerate(split)]
    n_items = targets.shape[0] if cfg.n_classes else targets.size     # the whole batch's
    bm = tokens.shape[0] // MICRO
    pending, losses = [], []
    for m in range(MICRO):                     # every forward ...
        tok, tgt = tokens[m * bm:(m + 1) * bm], targets[m * bm:(m + 1) * bm]
        x, emb = module.embed_forward(owned[0], tok, cfg, grid)
        layers = []
        for s, stage in enumerate(split):      # activations would go to stage s + 1 here
            for l in stage:
                x, c = module.layer_forward(x, model.layer_params(owned[s], l), l, cfg, grid,
                                            checkpoint=checkpoint)
                layers.append((l, c))
        loss, head = module.head_forward(x, owned[-1], tgt, cfg, grid, n_items=n_items)
        losses.append(loss)
        pending.append((emb, layers, head))
    first, last = {}, {}                       # the tied wte: embedding part, head part
    rest = {}
    for emb, layers, head in reversed(pending):   # ... then every backward
        dx, g = module.head_backward(head)
        add_into(last, {k: v for k, v in g.items() if k == "wte"})
        add_into(rest, {k: v for k, v in g.items() if k != "wte"})
        for l, c in reversed(layers):
            dx, g = module.layer_backward(dx, c)
            add_into(rest, g, prefix=f"h{l}.")
        g = module.embed_backward(dx, emb)
        add_into(first, {"wte": g["wte"]})
        add_into(rest, {"wpe": g["wpe"]})
    if "wte" in last:                          # the engine's all-reduce between the stages
        rest["wte"] = first["wte"] + last["wte"]
    else:
        rest["wte"] = first["wte"]
    grads = {key: rest[key] for key in local}
    return sum(losses), WORLD.allgather(losses), grads


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("name,q,d,n_classes", CASES)
def test_stages_and_micro_batches_match_the_serial_model(name, q, d, n_classes, split,
                                                         checkpoint, backend):
    cfg, params, tokens, targets = make_setup(q, d, n_classes)
    ser_loss, ser_cache = model.forward(params, tokens, targets, cfg)
    ser_grads = model.backward(ser_cache)
    module = SCHEMES[name].module
    dev = {k: backend.asarray(v) for k, v in params.items()}
    with SCHEMES[name].make_grid(WORLD, q, d, backend=backend) as grid:
        local = module.shard(dev, cfg, grid)
        loss, micro, lgrads = run_pipeline(module, local, backend.asarray(tokens),
                                           backend.asarray(targets), cfg, grid,
                                           SPLITS[split], checkpoint)
        grads = {k: backend.to_numpy(v) for k, v in module.unshard(lgrads, cfg, grid).items()}
    errs = {"loss": rel_err(loss, ser_loss)}
    errs.update({k: rel_err(grads[k], ser_grads[k]) for k in ser_grads})
    worst = max(errs, key=errs.get)
    print(f"\n{name} q={q} d={d} {split} checkpoint={checkpoint}: worst relative error "
          f"{errs[worst]:.2e} ({worst})")
    parallel_assert(all(m == micro[0] for m in micro),
                    f"micro-batch losses differ across ranks: {micro}")
    parallel_assert(list(grads) == list(ser_grads)
                    and all(grads[k].shape == ser_grads[k].shape for k in ser_grads),
                    "unshard()ed gradients lack the serial keys or shapes")
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= TOL}
    parallel_assert(not bad, f"{name} [{q},{q},{d}] {split} checkpoint={checkpoint}: "
                             f"relative errors above {TOL}: {bad}")


@pytest.mark.parametrize("n_classes", [0, 3], ids=["lm", "cls"])
def test_stage_keys_cover_every_parameter_once(n_classes):
    """Over every split of 3 and 4 layers into 1 to 4 contiguous stages: each key once,
    except the tied ``wte`` of a language model on both the first and the last stage;
    each stage in forward order; one stage is ``param_shapes``' order; both scheme
    modules give the same answer."""
    problems = []
    for layers in (3, 4):
        cfg = model.Config(vocab=8, seq=4, hidden=4, heads=2, layers=layers,
                           n_classes=n_classes)
        every = list(model.param_shapes(cfg))
        for cuts in range(1 << (layers - 1)):    # bit c set: a stage ends after layer c
            ends = [c + 1 for c in range(layers - 1) if cuts >> c & 1] + [layers]
            split = [list(range(a, b)) for a, b in zip([0] + ends[:-1], ends)]
            n = len(split)
            keys = [model.stage_keys(cfg, ls, s == 0, s == n - 1) for s, ls in enumerate(split)]
            count = Counter(k for ks in keys for k in ks)
            tied = 2 if n > 1 and not n_classes else 1
            want = Counter({k: tied if k == "wte" else 1 for k in every})
            if count != want:
                problems.append(f"{split}: {dict(count - want)} extra, {dict(want - count)} "
                                f"missing")
            if any(len(ks) != len(set(ks)) for ks in keys):
                problems.append(f"{split}: a stage lists a key twice")
            flat = [k for ks in keys for k in ks if not (k == "wte" and ks is keys[-1] and n > 1)]
            if flat != every:
                problems.append(f"{split}: not in forward order: {flat}")
            if n > 1 and not n_classes and keys[-1][-1] != "wte":
                problems.append(f"{split}: the last stage does not hold the tied wte last")
            for spec in SCHEMES.values():
                if [spec.module.stage_keys(cfg, ls, s == 0, s == n - 1)
                        for s, ls in enumerate(split)] != keys:
                    problems.append(f"{split}: {spec.name}.stage_keys differs from the model's")
    try:
        model.stage_keys(model.Config(vocab=8, seq=4, hidden=4, heads=2, layers=3), [0, 2],
                         True, False)
        problems.append("a non-contiguous stage [0, 2] was accepted")
    except ValueError:
        pass
    parallel_assert(not problems, "; ".join(problems[:4]))
