"""Optimus (2D) and SUMMA2.5-LM (2.5D) on today's model variants, against the serial model:
SwiGLU, grouped-query attention, the untied LM head, recompute none | selective | full
and attention plain | flash (issue 30), on every ``[q, q, d]`` grid of the communicator
(``optimus`` when d = 1, ``summa25`` when d > 1).

Agreement measure, per tensor (the loss and the logits included):
``max|par - ser| / max|ser|`` against the float64 serial model, within the derived
bound :func:`summasim.validate.training_tolerance` of the config, batch and dtype (a
chain of ``2 (6 L + 1)`` contractions, each at most ``8 sqrt(K) (u + u_64)``). float64
measures ~1e-15 against bounds ~4e-13; float32 ~1e-7 against ~2e-6.

The variant grid: mlp x kv_heads x tied x attention has 16 points; :data:`VARIANTS` runs
4 of them so that every value of every factor appears in 2, and each runs all three
recompute modes (12 runs per grid), whose local gradients must be bitwise identical.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from _util import WORLD, collective_raises, grid_shapes, parallel_assert
from summasim.costmodel.workload.traffic import algorithm_traffic, summarize_events
from summasim.grid import Grid
from summasim.transformer import model, optimus
from summasim.validate import training_tolerance

P = WORLD.Get_size()
GRIDS = grid_shapes(P)
GRID_PARAMS = [pytest.param(q, d, id=f"{'optimus' if d == 1 else 'summa25'}-q{q}d{d}")
               for q, d in GRIDS]
if not any(d == 1 for _, d in GRIDS):
    GRID_PARAMS.append(pytest.param(0, 0, id="optimus-none", marks=pytest.mark.skip(
        reason=f"no Optimus q x q grid on {P} ranks (needs p = q*q)")))
if not any(d > 1 for _, d in GRIDS):
    GRID_PARAMS.append(pytest.param(0, 0, id="summa25-none", marks=pytest.mark.skip(
        reason=f"no SUMMA2.5 [q, q, d] grid with d > 1 on {P} ranks (needs p = d*q*q)")))
S = 4                       # tokens per sequence (seq = 5: wpe keeps a row no token reaches)
FLOAT32_TOL = 1e-5          # DESIGN.md: float32 to 1e-5
TILE = 2                    # flash's key/value tile: 2 tiles per sequence, a diagonal one
RECOMPUTES = ("none", "selective", "full")
# (mlp, kv heads per grid column (None: kv_heads = heads), tied, attention): every value
# of every factor in two of the four
VARIANTS = [("swiglu", 1, False, "flash"), ("swiglu", None, True, "plain"),
            ("gelu", 2, True, "flash"), ("gelu", None, False, "plain")]
VARIANT_IDS = ["swiglu-mqa-untied-flash", "swiglu-mha-tied-plain", "gelu-gqa-tied-flash",
               "gelu-mha-untied-plain"]


# --------------------------------------------------------------------------- #
# helpers                                                                     #
# --------------------------------------------------------------------------- #
def make_config(q, mlp="swiglu", kv_per_col=1, tied=False, layers=2, dtype=np.float64):
    """heads = 4q of size 2 (h = 8q), kv_heads = kv_per_col q; SwiGLU with the fractional
    f = 2.75 (F = 22q), GELU with f = 4; vocab = 3q."""
    heads = 4 * q
    return model.Config(vocab=3 * q, seq=S + 1, hidden=2 * heads, heads=heads, layers=layers,
                        ffn_mult=2.75 if mlp == "swiglu" else 4, dtype=dtype, mlp=mlp,
                        kv_heads=None if kv_per_col is None else kv_per_col * q, tied=tied)


def make_params(cfg, seed=0):
    """init_params, every array perturbed: biases and LayerNorm b non-zero, gains off 1."""
    params = model.init_params(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    for arr in params.values():
        arr += ((0.1 if arr.ndim == 1 else 0.02) * rng.standard_normal(arr.shape)).astype(
            cfg.dtype)
    return params


def make_batch(cfg, b, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab, (b, S)), rng.integers(0, cfg.vocab, (b, S))


def rel_err(par, ser) -> float:
    par, ser = np.asarray(par, np.float64), np.asarray(ser, np.float64)
    return float(np.abs(par - ser).max(initial=0.0)
                 / max(np.abs(ser).max(initial=0.0), np.finfo(np.float64).tiny))


def serial(cfg, params, tokens, targets, attention="plain"):
    loss, cache = model.forward(params, tokens, targets, cfg, attention=attention, tile=TILE)
    return loss, cache.logits, model.backward(cache)


def run_parallel(grid, cfg, params, tokens, targets, recompute="none", attention="plain",
                 backend=None):
    """Shard, forward, backward (traced from a clean ledger), then logits and unshard."""
    if backend is not None:
        params = {k: backend.asarray(v) for k, v in params.items()}
    host = backend.to_numpy if backend is not None else (lambda a: a)
    local = optimus.shard(params, cfg, grid)
    grid.trace.clear()
    loss, cache = optimus.forward(local, tokens, targets, cfg, grid, recompute=recompute,
                                  attention=attention, tile=TILE)
    kept = [type(layer.block).__name__ if layer.checkpoint else type(layer.block.core).__name__
            for layer in cache.layers]         # what each layer keeps for its backward
    lgrads = optimus.backward(cache)
    events = list(grid.trace.events)
    logits = optimus.logits(cache, cfg, grid)
    grads = optimus.unshard(lgrads, cfg, grid)
    return dict(loss=loss, logits=host(logits), lgrads={k: host(v) for k, v in lgrads.items()},
                grads={k: host(v) for k, v in grads.items()}, events=events, kept=kept)


def errors(run, ref) -> dict:
    loss, logits, grads = ref
    errs = {"loss": rel_err(run["loss"], loss), "logits": rel_err(run["logits"], logits)}
    missing = [k for k in grads if k not in run["grads"]]
    if missing or list(run["grads"]) != list(grads):
        return {f"keys {list(run['grads'])[:3]}... != serial, missing {missing[:3]}": np.inf}
    errs.update({k: rel_err(run["grads"][k], grads[k]) for k in grads})
    return errs


def worst(errs: dict) -> str:
    key = max(errs, key=errs.get)
    return f"worst {key}: {errs[key]:.3g}"


# --------------------------------------------------------------------------- #
# agreement with the serial model; recompute modes bitwise                    #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mlp,kv,tied,attention", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_variants_match_serial(q, d, mlp, kv, tied, attention, backend):
    """float64, 2 layers, b = d q: loss, logits and every unshard()ed gradient within
    training_tolerance under recompute none, selective and full; the local gradients
    and the loss of the three modes bitwise identical on every rank; each layer keeps
    what its mode says (plain: the probabilities, selective: only q, k, v, y; flash: its
    own cache; full: the input alone)."""
    cfg = make_config(q, mlp, kv, tied)
    params = make_params(cfg)
    b = d * q
    tokens, targets = make_batch(cfg, b)
    ref = serial(cfg, params, tokens, targets, attention)
    tol = training_tolerance(cfg, b, np.float64)
    with Grid(WORLD, q, d, backend=backend) as grid:
        runs = {rc: run_parallel(grid, cfg, params, tokens, targets, rc, attention, backend)
                for rc in RECOMPUTES}
    report = []
    for rc, run in runs.items():
        errs = errors(run, ref)
        report.append(f"{rc} {worst(errs)}")
        parallel_assert(max(errs.values()) <= tol,
                        f"[{q},{q},{d}] {mlp} kv={cfg.kv_heads} tied={tied} {attention} "
                        f"recompute={rc}: "
                        f"{worst(errs)} > {tol:.3g}")
    core = "FlashCache" if attention == "flash" else "AttentionCoreCache"
    want = {"none": core, "full": type(np.empty(0)).__name__,
            "selective": "FlashCache" if attention == "flash" else "AttentionInputsCache"}
    kept = {rc: run["kept"] for rc, run in runs.items()}
    parallel_assert(all(k == [want[rc]] * cfg.layers for rc, k in kept.items()),
                    f"layers keep {kept}, want {want}")
    base = runs["none"]
    differ = [(rc, k) for rc in ("selective", "full") for k in base["lgrads"]
              if not np.array_equal(runs[rc]["lgrads"][k], base["lgrads"][k])]
    differ += [(rc, "loss") for rc in ("selective", "full")
               if runs[rc]["loss"] != base["loss"]]
    parallel_assert(not differ, f"rank {WORLD.rank}: not bitwise across recompute modes: "
                                f"{differ[:4]}")
    if WORLD.rank == 0:
        print(f"\n[{q},{q},{d}] {mlp} kv={cfg.kv_heads} tied={tied} {attention}: "
              f"{'; '.join(report)} (bound {tol:.3g})")


def test_float32():
    """float32 once, on the grid with the largest q (then d), SwiGLU + GQA + untied +
    flash + selective: every tensor within training_tolerance(float32) of the float64
    serial model (and DESIGN.md's 1e-5, the smaller here), and everything float32."""
    q, d = max(GRIDS)
    cfg64 = make_config(q, "swiglu", 1, False)
    cfg32 = make_config(q, "swiglu", 1, False, dtype=np.float32)
    params64 = make_params(cfg64)
    params32 = {k: v.astype(np.float32) for k, v in params64.items()}
    b = 2 * d * q
    tokens, targets = make_batch(cfg64, b)
    ref = serial(cfg64, params64, tokens, targets, "flash")
    tol = min(training_tolerance(cfg32, b, np.float32), FLOAT32_TOL)
    with Grid(WORLD, q, d) as grid:
        run = run_parallel(grid, cfg32, params32, tokens, targets, "selective", "flash")
    errs = errors(run, ref)
    dtypes = {v.dtype for v in run["lgrads"].values()} | {run["logits"].dtype}
    parallel_assert(max(errs.values()) <= tol and dtypes == {np.dtype(np.float32)},
                    f"[{q},{q},{d}] float32: {worst(errs)} > {tol:.3g} or dtypes {dtypes}")
    if WORLD.rank == 0:
        print(f"\nfloat32 [{q},{q},{d}]: {worst(errs)} (bound {tol:.3g})")


# --------------------------------------------------------------------------- #
# layout: GQA column blocks, the gate like fc, head.w a 2d weight            #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_layout(q, d):
    """Rank (i, j, k) holds, written out here without the module's helpers: qkv.w rows
    i, columns [Q heads j n/q.. | K heads j kv/q.. | V heads j kv/q..] of the serial
    [h, h + 2 kv hd]; gate.w block (i, j) like fc.w; head.w block (i, j) of [h, v];
    gate.b column block j on row 0, zero-size elsewhere; the local shapes say so; and
    unshard(shard(params)) == params."""
    cfg = make_config(q, "swiglu", 1, False, layers=1)
    params = make_params(cfg)
    h, v, f, hd = cfg.hidden, cfg.vocab, cfg.ffn, cfg.head_size
    nq, nkv = cfg.heads // q, cfg.kv_heads // q
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        shapes = optimus.local_shapes(cfg, grid)
        back = optimus.unshard(local, cfg, grid)
        i, j = grid.i, grid.j
    rows = slice(i * h // q, (i + 1) * h // q)
    kv_w = cfg.kv_heads * hd
    cols = np.r_[j * nq * hd:(j + 1) * nq * hd,                          # query heads of j
                 h + j * nkv * hd:h + (j + 1) * nkv * hd,                # their kv heads
                 h + kv_w + j * nkv * hd:h + kv_w + (j + 1) * nkv * hd]
    want = {"h0.attn.qkv.w": params["h0.attn.qkv.w"][rows][:, cols],
            "h0.mlp.fc.w": params["h0.mlp.fc.w"][rows, j * f // q:(j + 1) * f // q],
            "h0.mlp.gate.w": params["h0.mlp.gate.w"][rows, j * f // q:(j + 1) * f // q],
            "head.w": params["head.w"][rows, j * v // q:(j + 1) * v // q]}
    if i == 0:
        want["h0.attn.qkv.b"] = params["h0.attn.qkv.b"][cols]
        want["h0.mlp.gate.b"] = params["h0.mlp.gate.b"][j * f // q:(j + 1) * f // q]
    else:
        want["h0.mlp.gate.b"] = np.empty((0,))
    wrong = [k for k, a in want.items() if not np.array_equal(local[k], a)]
    wrong += [k for k in local if local[k].shape != shapes[k]]
    parallel_assert(not wrong, f"rank {grid.coords}: wrong local blocks or shapes {wrong}")
    parallel_assert(shapes["h0.attn.qkv.w"] == (h // q, (h + 2 * kv_w) // q)
                    and shapes["head.w"] == (h // q, v // q) and "wte" in shapes
                    and shapes["h0.mlp.gate.w"] == shapes["h0.mlp.fc.w"] == (h // q, f // q),
                    f"local_shapes: {shapes}")
    parallel_assert(list(back) == list(params)
                    and all(np.array_equal(back[k], params[k]) for k in params),
                    "unshard(shard(params)) != params")


# --------------------------------------------------------------------------- #
# traffic: SwiGLU + GQA layer against the closed forms                        #
# --------------------------------------------------------------------------- #
def _items(events, prefix):
    return sum(Fraction(e.nbytes, 8) for e in events if e.phase.startswith(prefix)
               and e.op in ("bcast", "reduce") and e.group in ("row", "col"))


@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_swiglu_gqa_traffic(q, d):
    """One SwiGLU + GQA layer (untied head): the h0 SUMMA bcast + reduce payload per rank
    is optimus.layer_payload (fwd, 2x bwd, 3x bwd with recompute full), which for this
    config is (b s (4h + F)/d + h (W + h + 3F)) / q written out here; every tp phase
    (tp.mlp.gate included) equals its SUMMA algorithm's closed form; the row-0 vector
    broadcast carries gate.b; the untied head's products are ab / abt / atb; selective
    and flash record exactly the events of none and plain."""
    cfg = make_config(q, "swiglu", 1, False, layers=1)
    b = 2 * d * q
    params = make_params(cfg)
    tokens, targets = make_batch(cfg, b)
    runs = {}
    with Grid(WORLD, q, d) as grid:
        for rc, att in (("none", "plain"), ("full", "plain"), ("selective", "flash")):
            runs[rc, att] = run_parallel(grid, cfg, params, tokens, targets, rc, att)["events"]
        coords = grid.coords
    h, f, v, w, m = cfg.hidden, cfg.ffn, cfg.vocab, cfg.qkv_width, b * S
    pay = optimus.layer_payload(cfg, b, q, d, seq=S)
    closed = (Fraction(m * (4 * h + f), d) + h * (w + h + 3 * f)) / q if q > 1 else 0
    ev = runs["none", "plain"]
    got = (_items(ev, "h0.fwd/tp."), _items(ev, "h0.bwd/tp."),
           _items(runs["full", "plain"], "h0.bwd/tp."))
    parallel_assert(got == (pay["fwd"], pay["bwd"], pay["bwd_checkpoint"])
                    and pay["fwd"] == closed and pay["bwd"] == 2 * closed,
                    f"rank {coords}: traced (fwd, bwd, bwd full) {got}, layer_payload {pay}, "
                    f"closed form fwd {closed}")

    ab, abt, atb = (("summa_ab", "summa_abt", "summa_atb") if d == 1 else
                    ("summa25_ab", "summa25_abt", "summa25_atb"))
    want = {}
    for name, (fin, fout) in {"attn.qkv": (h, w), "attn.proj": (h, h), "mlp.fc": (h, f),
                              "mlp.gate": (h, f), "mlp.proj": (f, h)}.items():
        want[f"h0.fwd/tp.{name}"] = algorithm_traffic(ab, m, fin, fout, q, d, 8, coords)
        want[f"h0.bwd/tp.{name}.dX"] = algorithm_traffic(abt, m, fout, fin, q, d, 8, coords)
        want[f"h0.bwd/tp.{name}.dW"] = algorithm_traffic(atb, fin, m, fout, q, d, 8, coords)
    want["lmhead.fwd/aux.logits"] = algorithm_traffic(ab, m, h, v, q, d, 8, coords)
    want["lmhead.bwd/aux.logits.dX"] = algorithm_traffic(abt, m, v, h, q, d, 8, coords)
    want["lmhead.bwd/aux.logits.dW"] = algorithm_traffic(atb, h, m, v, q, d, 8, coords)
    phases = {e.phase for e in ev if "/tp." in e.phase or e.phase.startswith("lmhead.")}
    bad = [(ph, "unexpected") for ph in phases if ph not in want]
    bad += [(ph, summarize_events(e for e in ev if e.phase == ph), tr)
            for ph, tr in want.items()
            if summarize_events(e for e in ev if e.phase == ph) != tr]
    parallel_assert(not bad, f"rank {coords}: phase traffic != closed form: {bad[:2]}")

    vec = (2 * h + w + h + 2 * h + 2 * f + h) // q     # ln1, qkv.b, proj.b, ln2, fc.b, gate.b
    bcast = summarize_events(e for e in ev if e.phase == "h0.fwd/aux.params.bcast")
    parallel_assert(bcast == ({("bcast", "col"): (1, 8 * vec)} if q > 1 else {}),
                    f"rank {coords}: row-0 vector broadcast {bcast}, want {vec} items")
    sig = [[(e.op, e.group, e.nbytes, e.root, e.phase) for e in runs[key]]
           for key in (("none", "plain"), ("selective", "flash"))]
    parallel_assert(sig[0] == sig[1], f"rank {coords}: selective + flash changed the traffic")


def test_layer_payload_is_table1_for_gpt2():
    """Pure: for GELU, kv_heads = heads (every integer f = 1..4 and the GPT-2 f = 4)
    layer_payload is the harness's Table 1 payload ((3 + f) b s h / d + (4 + 2f) h^2) / q
    on q in 1..4, d in 1..3; SwiGLU adds exactly one fc-like product, (b s h / d + h F) / q,
    and GQA removes 2 h (h - kv_width) / q."""
    from summasim.harness.transformer import table1_payload

    bad = []
    for f in (1, 2, 3, 4):
        for q in (1, 2, 3, 4):
            for d in (1, 2, 3):
                cfg = model.Config(vocab=12, seq=6, hidden=4 * q, heads=2 * q, layers=1,
                                   ffn_mult=f)
                b = 2 * d * q
                if optimus.layer_payload(cfg, b, q, d) != table1_payload("optimus", cfg, b,
                                                                          d * q * q, q, d):
                    bad.append(("gelu", f, q, d))
                if q == 1:
                    continue
                sw = model.Config(vocab=12, seq=6, hidden=4 * q, heads=2 * q, layers=1,
                                  ffn_mult=f, mlp="swiglu", kv_heads=q)
                gelu = optimus.layer_payload(cfg, b, q, d)["fwd"]
                extra = (b * 6 * cfg.hidden // d + cfg.hidden * cfg.ffn) // q
                fewer = 2 * cfg.hidden * (cfg.hidden - sw.kv_width) // q
                if optimus.layer_payload(sw, b, q, d)["fwd"] != gelu + extra - fewer:
                    bad.append(("swiglu-gqa", f, q, d))
    parallel_assert(not bad, f"layer_payload differs: {bad[:4]}")


# --------------------------------------------------------------------------- #
# pieces (what a pipeline stage runs) and bad input                           #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_pieces_untied_swiglu(q, d):
    """Two pipeline stages played one after the other with the pieces, each holding
    only stage_keys (the last stage the untied head.w, not wte), SwiGLU + GQA, layer
    pieces called with recompute="selective", attention="flash": the loss and every
    unshard()ed gradient within training_tolerance of the serial model."""
    cfg = make_config(q, "swiglu", 1, False)
    params = make_params(cfg, seed=3)
    b = d * q
    tokens, targets = make_batch(cfg, b, seed=4)
    ref_loss, _, ref = serial(cfg, params, tokens, targets, "flash")
    tol = training_tolerance(cfg, b, np.float64)
    split = [[0], [1]]
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        owned = [{k: local[k] for k in optimus.stage_keys(cfg, ls, s == 0, s == 1)}
                 for s, ls in enumerate(split)]
        x, emb = optimus.embed_forward(owned[0], tokens, cfg, grid)
        caches = []
        for s, ls in enumerate(split):
            for l in ls:
                x, c = optimus.layer_forward(x, model.layer_params(owned[s], l), l, cfg, grid,
                                             recompute="selective", attention="flash",
                                             tile=TILE)
                caches.append((l, c))
        loss, head = optimus.head_forward(x, owned[-1], targets, cfg, grid)
        dx, grads = optimus.head_backward(head)
        for l, c in reversed(caches):
            dx, g = optimus.layer_backward(dx, c)
            grads.update({f"h{l}.{k}": val for k, val in g.items()})
        grads.update(optimus.embed_backward(dx, emb))
        full = optimus.unshard({k: grads[k] for k in local}, cfg, grid)
    errs = {"loss": rel_err(loss, ref_loss)}
    errs.update({k: rel_err(full[k], ref[k]) for k in ref})
    parallel_assert("wte" not in owned[-1] and "head.w" in owned[-1]
                    and sorted(grads) == sorted(local) and max(errs.values()) <= tol,
                    f"[{q},{q},{d}] pieces: last stage {list(owned[-1])[-3:]}, "
                    f"{worst(errs)} > {tol:.3g}")


@pytest.mark.parametrize("q,d", GRID_PARAMS)
def test_bad_variants(q, d):
    """Fewer key/value heads than columns, an unknown attention or recompute, and
    checkpoint=True with recompute="selective" raise ValueError on every rank, naming
    what is wrong, before any communication."""
    with Grid(WORLD, q, d) as grid:
        cases = []
        if q > 1:
            cases.append((["kv heads", f"= {q - 1}", f"q = {q}", "smaller than"],
                          model.Config(vocab=3 * q, seq=5, hidden=2 * q * (q - 1),
                                       heads=q * (q - 1), layers=1, kv_heads=q - 1)))
        for names, cfg in cases:
            msg = collective_raises(ValueError, optimus.check, cfg, grid, d * q)
            parallel_assert(all(n in msg for n in names), f"message {msg!r} lacks {names}")
            msg = collective_raises(ValueError, optimus.shard, model.init_params(cfg), cfg,
                                    grid)
            parallel_assert(all(n in msg for n in names), f"message {msg!r} lacks {names}")
        cfg = make_config(q, "swiglu", 1, False, layers=1)
        local = optimus.shard(model.init_params(cfg), cfg, grid)
        tokens, targets = make_batch(cfg, d * q)
        grid.trace.clear()
        for kw, word in (({"attention": "fast"}, "attention"),
                         ({"recompute": "some"}, "recompute"),
                         ({"checkpoint": True, "recompute": "selective"}, "checkpoint")):
            msg = collective_raises(ValueError, optimus.forward, local, tokens, targets, cfg,
                                    grid, **kw)
            parallel_assert(word in msg, f"{kw}: message {msg!r} lacks {word!r}")
        events = len(grid.trace.events)
    parallel_assert(events == 0, f"a refused call communicated ({events} events)")
