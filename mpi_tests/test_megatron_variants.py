"""Megatron 1D (summasim.transformer.megatron) with the model variants -- SwiGLU,
grouped-query attention, an untied LM head -- and with selective/full recompute and
flash attention, with and without sequence parallelism, against the serial model.

Written for the communicator it gets (P = COMM_WORLD size, any P): ``2P`` query heads
of size 2 (h = 4P), ``P`` key/value heads for grouped-query attention (two query heads
per group, one kv head per rank), MLP width ``2.5 h = 10P`` (a fractional multiplier
that p divides), vocabulary ``4P``, two layers, ``b = 2`` and ``T = 2P`` tokens
(``seq = T + 1``: ``wpe`` has a row no token reaches), flash tiles of 3 keys (several
tiles, the last one partial). Every bias and LayerNorm parameter is moved off its init
value. Every rank builds the same parameters and data from fixed seeds and runs the
serial model itself; every verdict is collective.

Error of a tensor: ``max|par - ref| / max|ref|``. Tolerance: the derived
:func:`summasim.validate.training_tolerance` of the config and batch, against the
float64 serial model run with the same attention (on the float32 run's rounded
parameters when the run is float32). Across recompute modes the gradients must be
bitwise identical on each rank (they recompute exactly what the forward computed).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

import numpy as np
import pytest

from _util import WORLD, collective_raises, held_items, make_params, rel_err, parallel_assert, skip_unless
from summasim.grid import Grid1D
from summasim.transformer import megatron, model
from summasim.validate import training_tolerance

P = WORLD.Get_size()
HEADS, HEAD_SIZE = 2 * P, 2
B, S = 2, 2 * P
TILE = 3
RECOMPUTE = ("none", "selective", "full")


def make_config(mlp="gelu", gqa=False, tied=True, dtype=np.float64, n_classes=0,
                layers=2) -> model.Config:
    return model.Config(vocab=4 * P, seq=S + 1, hidden=HEAD_SIZE * HEADS, heads=HEADS,
                        layers=layers, ffn_mult=2.5, dtype=dtype, n_classes=n_classes,
                        mlp=mlp, kv_heads=P if gqa else None, tied=tied)


def make_data(cfg: model.Config, seed: int = 3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(B, S))
    targets = (rng.integers(0, cfg.n_classes, size=(B,)) if cfg.n_classes
               else rng.integers(0, cfg.vocab, size=(B, S)))
    return tokens, targets



def digests_differ(arrays: dict, grid) -> list[str]:
    """Names whose bytes differ from the group's rank 0 (replicas must be identical)."""
    mine = {k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for k, a in arrays.items()}
    ref = grid.comm.mpi.bcast(mine, root=0)
    return [k for k in arrays if mine[k] != ref.get(k)]


def kw(recompute="none", attention="plain", sp=False) -> dict:
    return dict(recompute=recompute, attention=attention, tile=TILE, sequence_parallel=sp)


# --------------------------------------------------------------------------- #
# agreement with the serial model                                              #
# --------------------------------------------------------------------------- #
def _cases():
    """mlp x kv_heads x tied x attention, all 16, each with one recompute mode and
    sequence parallelism on or off, cycled so every recompute mode and both SP settings
    meet every other factor's levels."""
    out = []
    for i in range(16):
        mlp = ("gelu", "swiglu")[i & 1]
        gqa = bool(i & 2)
        tied = not i & 4
        attention = ("plain", "flash")[(i >> 3) & 1]
        recompute = RECOMPUTE[(i + i // 4) % 3]
        sp = bool((i ^ (i >> 2)) & 1)
        ident = (f"{mlp}-{'gqa' if gqa else 'mha'}-{'tied' if tied else 'untied'}-"
                 f"{attention}-{recompute}{'-sp' if sp else ''}")
        out.append(pytest.param(mlp, gqa, tied, attention, recompute, sp, id=ident))
    return out


def run_case(cfg, params, tokens, targets, grid, **how):
    local = megatron.shard(params, cfg, grid)
    loss, cache = megatron.forward(local, tokens, targets, cfg, grid, **how)
    lgrads = megatron.backward(cache)
    grads = megatron.unshard(lgrads, cfg, grid)
    return loss, lgrads, grads, megatron.logits(cache, cfg, grid), cache


def check_against_serial(cfg, attention, recompute, sp, label):
    dtype = cfg.dtype
    tol = training_tolerance(cfg, B, dtype)
    params = make_params(cfg, seed=0)
    tokens, targets = make_data(cfg)
    cfg64 = dataclasses.replace(cfg, dtype=np.float64)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    ref_loss, ref_cache = model.forward(p64, tokens, targets, cfg64, recompute=recompute,
                                        attention=attention, tile=TILE)
    ref_grads = model.backward(ref_cache)
    skip_unless(not sp or S % P == 0, f"T = {S} is not divisible by p = {P}")
    with Grid1D(WORLD) as grid:
        loss, lgrads, grads, logits, cache = run_case(
            cfg, params, tokens, targets, grid, **kw(recompute, attention, sp))
        kinds = megatron.param_layout(cfg)
        replicas = digests_differ({k: lgrads[k] for k, kind in kinds.items()
                                   if kind == "replicated"}, grid)
    errs = {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_cache.logits)}
    errs.update({k: rel_err(grads[k], ref_grads[k]) for k in ref_grads})
    shapes_ok = (list(grads) == list(params)
                 and all(grads[k].shape == params[k].shape and grads[k].dtype == cfg.dtype
                         for k in params)
                 and logits.shape == ref_cache.logits.shape
                 and cache.recompute == recompute and cache.attention == attention)
    worst = max(errs, key=errs.get)
    print(f"\nmegatron variants p={P} {label} {np.dtype(dtype).name}: worst relative error "
          f"{errs[worst]:.2e} ({worst}), derived tolerance {tol:.2e}")
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= tol}
    parallel_assert(shapes_ok, f"{label}: unsharded grads/logits lack the serial keys, "
                               f"shapes, dtype")
    parallel_assert(not replicas, f"{label}: replicated gradients differ across ranks: "
                                  f"{replicas}")
    parallel_assert(not bad, f"{label}: relative error above {tol:.2e} in {bad}")


@pytest.mark.parametrize("mlp,gqa,tied,attention,recompute,sp", _cases())
def test_variants_agree_with_serial(mlp, gqa, tied, attention, recompute, sp):
    cfg = make_config(mlp, gqa, tied)
    check_against_serial(cfg, attention, recompute, sp,
                         f"{mlp} gqa={gqa} tied={tied} {attention} {recompute} sp={sp}")


def test_float32_all_variants_agree_with_serial():
    """SwiGLU, grouped-query attention, untied head, flash, selective recompute and
    sequence parallelism at once, in float32 against the float64 serial model."""
    cfg = make_config("swiglu", True, False, dtype=np.float32)
    check_against_serial(cfg, "flash", "selective", True, "swiglu gqa untied flash "
                                                          "selective sp")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_classifier_with_variants_agrees_with_serial(sp):
    cfg = make_config("swiglu", True, True, n_classes=3)
    check_against_serial(cfg, "flash", "full", sp, f"classifier swiglu gqa flash full sp={sp}")


# --------------------------------------------------------------------------- #
# recompute changes nothing (bitwise)                                          #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("attention", ["plain", "flash"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_gradients_bitwise_identical_across_recompute(attention, sp):
    """Loss, logits and every local gradient, on each rank, are the same bits with
    recompute none, selective and full (SwiGLU, grouped-query attention, untied head)."""
    cfg = make_config("swiglu", True, False)
    params = make_params(cfg, seed=7)
    tokens, targets = make_data(cfg, seed=8)
    runs = {}
    with Grid1D(WORLD) as grid:
        local = megatron.shard(params, cfg, grid)
        for mode in RECOMPUTE:
            loss, cache = megatron.forward(local, tokens, targets, cfg, grid,
                                           **kw(mode, attention, sp))
            runs[mode] = (loss, np.array(cache.logits), megatron.backward(cache))
    base_loss, base_logits, base = runs["none"]
    diff = []
    for mode in RECOMPUTE[1:]:
        loss, logits, grads = runs[mode]
        if loss != base_loss or not np.array_equal(logits, base_logits):
            diff.append(f"{mode}: loss/logits")
        diff += [f"{mode}: {k}" for k in base if not np.array_equal(grads[k], base[k])]
    parallel_assert(not diff, f"{attention} sp={sp}: not bitwise equal: {diff[:6]}")


# --------------------------------------------------------------------------- #
# the layout of the variants' parameters                                       #
# --------------------------------------------------------------------------- #
def test_variant_shards_hold_the_right_columns():
    """Rank r's ``attn.qkv.w`` is ``[Q_r | K_r | V_r]``: query heads ``[r n/p, (r+1)
    n/p)`` and kv heads ``[r kv/p, (r+1) kv/p)`` of the serial columns; ``mlp.gate.w/b``
    and ``head.w`` are column blocks r; ``unshard(shard(params))`` is ``params`` bitwise."""
    cfg = make_config("swiglu", True, False)
    params = make_params(cfg, seed=4)
    h, kvw, hd = cfg.hidden, cfg.kv_width, HEAD_SIZE
    with Grid1D(WORLD) as grid:
        r = grid.rank
        local = megatron.shard(params, cfg, grid)
        back = megatron.unshard(local, cfg, grid)
    nq, nkv = cfg.heads // P, cfg.kv_heads // P
    w = params["h1.attn.qkv.w"]
    want = np.concatenate([w[:, r * nq * hd:(r + 1) * nq * hd],
                           w[:, h + r * nkv * hd:h + (r + 1) * nkv * hd],
                           w[:, h + kvw + r * nkv * hd:h + kvw + (r + 1) * nkv * hd]], axis=1)
    f = cfg.ffn // P
    v = cfg.vocab // P
    problems = []
    if not np.array_equal(local["h1.attn.qkv.w"], want):
        problems.append("attn.qkv.w is not [Q_r | K_r | V_r]")
    cols = slice(r * f, (r + 1) * f)
    if not np.array_equal(local["h0.mlp.gate.w"], params["h0.mlp.gate.w"][:, cols]) \
            or not np.array_equal(local["h0.mlp.gate.b"], params["h0.mlp.gate.b"][cols]):
        problems.append("mlp.gate is not column block r")
    if not np.array_equal(local["head.w"], params["head.w"][:, r * v:(r + 1) * v]):
        problems.append("head.w is not vocabulary column block r")
    kinds = megatron.param_layout(cfg)
    if (kinds["head.w"], kinds["h0.mlp.gate.w"], kinds["h0.mlp.gate.b"]) != ("col",) * 3:
        problems.append(f"layout {kinds['head.w']}, {kinds['h0.mlp.gate.w']}")
    shapes = megatron.local_param_shapes(cfg, P)
    if {k: a.shape for k, a in local.items()} != shapes \
            or shapes["h0.attn.qkv.w"] != (h, (h + 2 * kvw) // P):
        problems.append("local shapes")
    problems += [f"round trip {k}" for k in params if not np.array_equal(back[k], params[k])]
    parallel_assert(not problems, "; ".join(problems[:5]))


# --------------------------------------------------------------------------- #
# traffic and activation memory in closed form                                 #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("recompute,attention", [("selective", "flash"), ("full", "plain"),
                                                 ("selective", "plain")])
def test_variant_traffic_matches_the_closed_form(recompute, attention):
    """Every event of a forward and backward of the all-variants model, per (phase, op,
    bytes), equals ``megatron.traffic`` with and without sequence parallelism, and
    equals the ledger of the GPT-2 model of the same sizes (the variants add no
    collective; selective recompute and flash send nothing; full recompute repeats
    the forward's collectives as ``tp.recompute.*``)."""
    variant = make_config("swiglu", True, False, layers=1)
    plain = make_config("gelu", False, True, layers=1)
    tokens, targets = make_data(variant)
    problems = []
    with Grid1D(WORLD) as grid:
        t = grid.p
        for sp in (False, True):
            ledgers = []
            for cfg, how in ((variant, kw(recompute, attention, sp)), (plain, dict(
                    checkpoint=recompute == "full", sequence_parallel=sp))):
                local = megatron.shard(make_params(cfg), cfg, grid)
                grid.trace.clear()
                _, cache = megatron.forward(local, tokens, targets, cfg, grid, **how)
                megatron.backward(cache)
                ledgers.append(Counter((e.phase, e.op, e.nbytes) for e in grid.trace.events))
            want = megatron.traffic(variant, t, B, S, recompute=recompute, attention=attention,
                                    sequence_parallel=sp)
            got, base = ledgers
            if got != want:
                problems.append(f"sp={sp}: extra {dict(got - want)}, missing "
                                f"{dict(want - got)}")
            if got != base:
                problems.append(f"sp={sp}: differs from GPT-2's: {dict(got - base)} "
                                f"{dict(base - got)}")
            rec = any(".bwd/tp.recompute." in k[0] for k in got)
            if t > 1 and rec != (recompute == "full"):
                problems.append(f"sp={sp}: recomputed collectives {rec}")
    parallel_assert(not problems, f"t={t}: " + "; ".join(problems[:4]))


@pytest.mark.parametrize("mlp,gqa", [("gelu", False), ("swiglu", True)], ids=["gpt", "swiglu-gqa"])
def test_activation_items_match_the_layer_caches(mlp, gqa):
    """What a layer piece's cache holds equals ``megatron.activation_items`` for every
    recompute mode and attention, with and without sequence parallelism; on one rank
    without sequence parallelism the closed form is ``model.activation_items``'s layer."""
    cfg = make_config(mlp, gqa, True)
    params = make_params(cfg, seed=2)
    tokens, _ = make_data(cfg)
    problems = []
    for recompute in RECOMPUTE:
        for attention in ("plain", "flash"):
            one = megatron.activation_items(cfg, 1, B, S, recompute=recompute,
                                            attention=attention)
            serial = model.activation_items(cfg, B, S, recompute, attention).layer
            if one != serial:
                problems.append(f"{recompute} {attention}: t=1 {one}, serial {serial}")
    with Grid1D(WORLD) as grid:
        t = grid.p
        local = megatron.shard(params, cfg, grid)
        lp = model.layer_params(local, 0)
        for sp in (False, True):
            x, _ = megatron.embed_forward(local, tokens, cfg, grid, sequence_parallel=sp)
            for recompute in RECOMPUTE:
                for attention in ("plain", "flash"):
                    _, lc = megatron.layer_forward(x, lp, 0, cfg, grid,
                                                   **kw(recompute, attention, sp))
                    held = held_items(lc.block, list(lp.values()))
                    items = megatron.activation_items(cfg, t, B, S, sequence_parallel=sp,
                                                      recompute=recompute,
                                                      attention=attention)
                    if held != items:
                        problems.append(f"sp={sp} {recompute} {attention}: cache holds "
                                        f"{held}, activation_items says {items}")
    parallel_assert(not problems, f"{mlp} gqa={gqa} t={P}: " + "; ".join(problems[:4]))


# --------------------------------------------------------------------------- #
# bad input                                                                    #
# --------------------------------------------------------------------------- #
def test_bad_variants_raise_on_every_rank():
    """Fewer key/value heads than ranks, a recompute that contradicts
    ``checkpoint``, an unknown attention: ``ValueError`` on every rank before any
    message."""
    cfg = make_config("swiglu", True, False)
    params = make_params(cfg)
    tokens, targets = make_data(cfg)
    problems = []
    with Grid1D(WORLD) as grid:
        local = megatron.shard(params, cfg, grid)
        grid.trace.clear()
        for how in (dict(checkpoint=True, recompute="selective"), dict(attention="paged"),
                    dict(attention="flash", tile=0), dict(recompute="some")):
            collective_raises(ValueError, megatron.forward, local, tokens, targets, cfg,
                              grid, **how)
        for fn, args, how in ((megatron.traffic, (cfg, P, B, S), dict(recompute="some")),
                              (megatron.activation_items, (cfg, P, B, S),
                               dict(attention="paged"))):
            collective_raises(ValueError, fn, *args, **how)
        if P > 2:   # 2 kv heads divide the 2P query heads, but 2 groups cannot cover p
            odd = dataclasses.replace(cfg, kv_heads=2)
            msg = collective_raises(ValueError, megatron.check, odd, grid)
            if "kv_heads = 2 is smaller than p" not in msg:
                problems.append(f"message does not name kv_heads: {msg}")
        if grid.trace.events:
            problems.append(f"bad input communicated: {grid.trace.events[:2]}")
    parallel_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("variant", ["gpt2", "gqa-swiglu", "untied-classifier"])
def test_heads_and_mlp_width_p_does_not_divide(variant):
    """p + 1 key/value head groups (2 query heads each with grouped-query attention) and
    an MLP of 3p + 1 columns on p ranks: each rank holds the balanced partition's share
    (the first ranks one group, one column more: ``megatron.head_range``), and loss,
    logits and every gradient agree with the serial model in every recompute mode, with
    sequence parallelism too (its T divisible by p); the local shapes differ by rank as
    ``local_param_shapes(config, p, rank)`` says."""
    groups = P + 1
    g = 2 if variant == "gqa-swiglu" else 1
    cfg = model.Config(vocab=3 * P + 1, seq=S, hidden=HEAD_SIZE * g * groups,
                       heads=g * groups, kv_heads=groups, layers=2,
                       ffn_mult=(3 * P + 1) / (HEAD_SIZE * g * groups), dtype=np.float64,
                       mlp="swiglu" if variant == "gqa-swiglu" else "gelu",
                       tied=variant != "untied-classifier",
                       n_classes=3 if variant == "untied-classifier" else 0)
    assert cfg.ffn == 3 * P + 1
    params = make_params(cfg)
    tokens, targets = make_data(cfg)
    loss, cache = model.forward(params, tokens, targets, cfg)
    ref, ref_logits = model.backward(cache), cache.logits
    bad = []
    with Grid1D(WORLD) as grid:
        (q_lo, q_hi), (kv_lo, kv_hi) = megatron.head_range(cfg, P, grid.rank)
        want_groups = groups // P + (grid.rank < groups % P)
        local = megatron.shard(params, cfg, grid)
        if kv_hi - kv_lo != want_groups or q_hi - q_lo != g * want_groups or any(
                local[k].shape != s for k, s in megatron.local_param_shapes(
                    cfg, P, grid.rank).items()):
            bad.append(f"rank {grid.rank}: heads {(q_lo, q_hi)}, {(kv_lo, kv_hi)}")
        for how in ({"recompute": r} for r in RECOMPUTE):
            for sp in (False, True):
                if sp and cfg.n_classes:
                    continue
                l2, c2 = megatron.forward(local, tokens, targets, cfg, grid,
                                          sequence_parallel=sp, **how)
                grads = megatron.unshard(megatron.backward(c2), cfg, grid)
                errs = {k: rel_err(grads[k], ref[k]) for k in ref}
                errs["loss"] = rel_err(l2, loss)
                errs["logits"] = rel_err(megatron.logits(c2, cfg, grid), ref_logits)
                worst = max(errs, key=errs.get)
                if errs[worst] > 1e-10:
                    bad.append(f"{how} sp={sp}: {worst} {errs[worst]:.2e}")
    parallel_assert(not bad, "; ".join(bad[:4]))
