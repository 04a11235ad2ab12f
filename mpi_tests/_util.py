"""Helpers for MPI tests: collective verdicts, grids that fit, reference data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from summasim.spec import grid_shapes as summasim_grid_shapes
from summasim.transformer import model

WORLD = MPI.COMM_WORLD


class CollectiveFailure(AssertionError):
    """An assertion every rank agreed on (raised on all ranks alike)."""


def parallel_assert(ok: bool, msg: str = "", comm=WORLD) -> None:
    """Fail on every rank if ``ok`` is false on any rank, naming the failing ranks."""
    flags = comm.allgather((bool(ok), str(msg) if not ok else ""))
    bad = [(r, m) for r, (f, m) in enumerate(flags) if not f]
    if bad:
        detail = "; ".join(f"rank {r}: {m}" for r, m in bad[:4])
        more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
        raise CollectiveFailure(f"failed on ranks {[r for r, _ in bad]}: {detail}{more}")


def grid_shapes(p: int) -> list[tuple[int, int]]:
    """Every ``(q, d)`` with d*q*q == p (summasim.grid's one enumeration)."""
    return summasim_grid_shapes(p, "any")


def collective_raises(exc_type, fn, *args, **kwargs) -> str:
    """Call ``fn``; every rank must raise ``exc_type``. Returns this rank's message."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:  # noqa: PERF203
        parallel_assert(True)
        return str(e)
    except Exception as e:  # noqa: BLE001
        parallel_assert(False, f"raised {type(e).__name__}: {e}, not {exc_type.__name__}")
    parallel_assert(False, f"did not raise {exc_type.__name__}")
    return ""


def random_matrix(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


def skip_unless(cond: bool, reason: str):
    """Skip on every rank alike (the condition must be the same everywhere)."""
    if not cond:
        pytest.skip(reason)


def mesh_row(res) -> str:
    """One line naming a mesh row's verdict, errors, bounds, failures and traffic."""
    r = res.extra["report"]
    return (f"{r.mesh} {' '.join(getattr(r, 'techniques', []))} zero={r.zero} {r.schedule} "
            f"stages={r.stages or 'even'} m={r.microbatches}: ok={res.ok} loss "
            f"{r.loss_err:.1e} grad {r.grad_err:.1e} bound {r.bound:.1e} param/bnd "
            f"{r.param_err:.1e} ({r.worst}) failures={r.failures} traffic {r.traffic} vs "
            f"{r.traffic_expected} in flight {r.inflight}")


def run_mesh_case(case, backend):
    """Run a mesh case on the world (skipped, with the reason, when it does not fit) and
    assert, collectively, that it passed every check within its bounds; returns the
    result."""
    from summasim.harness.composed import run_mesh

    p = WORLD.Get_size()
    skip_unless(case.misfit(p) == "", f"needs p = {case.p} (p = {p})")
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(res.ok and r.values_ok and not r.failures and r.grad_err <= r.bound
                    and r.loss_err <= r.bound and r.param_err <= 1.0, mesh_row(res))
    return res


def held_items(cache, exclude) -> int:
    """Elements of the distinct buffers that arrays in ``cache`` (nested NamedTuples,
    dicts, lists) keep alive, leaving out the buffers of ``exclude`` (the parameters)."""
    def root(a):
        while isinstance(getattr(a, "base", None), np.ndarray):
            a = a.base
        return a

    skip = {id(root(a)) for a in exclude}
    seen: dict = {}

    def walk(obj):
        if isinstance(obj, np.ndarray):
            base = root(obj)
            if id(base) not in skip:
                seen[id(base)] = base.size
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(cache)
    return sum(seen.values())


def make_params(cfg: model.Config, seed: int = 0) -> dict:
    """The serial parameters of a scheme's tests: ``model.init_params`` in float64 with every bias and LayerNorm gain/bias moved
    off its init value, then rounded to ``cfg.dtype``."""
    params = model.init_params(dataclasses.replace(cfg, dtype=np.float64), seed=seed)
    rng = np.random.default_rng(seed + 100)
    for val in params.values():
        if val.ndim == 1:
            val += rng.normal(0.0, 0.1, val.shape)
    return {k: v.astype(cfg.dtype) for k, v in params.items()}


def rel_err(par, ref) -> float:
    """``max |par - ref| / max |ref|`` in float64: inf when the shapes differ, NaN when
    either holds a non-finite value (so a check against a bound fails)."""
    par, ref = np.asarray(par, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if par.shape != ref.shape:
        return float("inf")
    if not (np.isfinite(par).all() and np.isfinite(ref).all()):
        return float("nan")
    return float(np.abs(par - ref).max(initial=0.0)
                 / max(float(np.abs(ref).max(initial=0.0)), np.finfo(np.float64).tiny))


# -- a tensor-parallel scheme against the serial model (the test_tp3d / test_optimus_rect
#    suites) -------------------------------------------------------------------------------
def scheme_batch(cfg: model.Config, b: int, s: int = 4, seed: int = 3):
    """``(tokens [b, s], targets)`` drawn from ``seed``: token targets, or a class per
    sequence for a classifier."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, (b, s))
    if cfg.n_classes:
        return tokens, rng.integers(0, cfg.n_classes, b)
    return tokens, rng.integers(0, cfg.vocab, (b, s))


def serial_run(cfg: model.Config, params, tokens, targets):
    """``(loss, logits, grads)`` of the serial model."""
    loss, cache = model.forward(params, tokens, targets, cfg)
    return loss, cache.logits, model.backward(cache)


def scheme_run(module, grid, cfg, params, tokens, targets, **kw) -> dict:
    """One traced step of a scheme module: its shards, loss, cache, local gradients, the
    step's trace events, the global logits and the gradients in the serial layout."""
    local = module.shard(params, cfg, grid)
    grid.trace.clear()
    loss, cache = module.forward(local, tokens, targets, cfg, grid, **kw)
    lgrads = module.backward(cache)
    events = list(grid.trace.events)
    return dict(local=local, loss=loss, cache=cache, lgrads=lgrads, events=events,
                logits=module.logits(cache, cfg, grid),
                grads=module.unshard(lgrads, cfg, grid))


def serial_errors(got: dict, ref) -> dict:
    """``{what: max|par - ser| / max|ser|}`` of a :func:`scheme_run` against
    :func:`serial_run`: the loss, the logits and every gradient."""
    loss, logits, grads = ref
    errs = {"loss": rel_err(got["loss"], loss), "logits": rel_err(got["logits"], logits)}
    errs.update({k: rel_err(got["grads"][k], grads[k]) for k in grads})
    return errs


def worst_error(errs: dict) -> str:
    key = max(errs, key=errs.get)
    return f"worst {key}: {errs[key]:.3g}"
