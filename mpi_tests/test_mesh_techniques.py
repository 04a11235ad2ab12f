"""The techniques of modern training inside sharded training, under MPI: model variants
(SwiGLU, grouped-query attention, an untied head), recompute none|selective|full, flash
attention and Megatron's sequence parallelism, composed with data, pipeline (1F1B and
interleaved) and ZeRO parallelism and each tensor scheme that fits the world size. Every
composition trains against the float64 serial model (loss, every gradient and every
parameter after each Adam step, the traffic closed forms including the sequence-parallel
gradient all-reduce, memory, replicas: summasim.harness.composed.run_mesh)."""

from __future__ import annotations

import pytest

from _util import WORLD, mesh_row, parallel_assert, run_mesh_case, skip_unless
from summasim.harness.cases import MeshCase
from summasim.harness.composed import run_mesh
from summasim.spec import Mesh
from summasim.transformer import composed
from summasim.transformer.model import Config

P = WORLD.Get_size()
VARIANT = dict(mlp="swiglu", ffn_mult=3.25, tied=False)


def _case(text, *, variant=True, gqa=True, layers=2, m=2, zero=0, steps=2, **kw):
    """A case on a model every piece divides: hidden 16 per tensor-grid unit, heads 2 per
    unit, kv heads one per unit (grouped-query) when ``gqa``, sequence 8."""
    mesh = Mesh.parse(text)
    tp = mesh.tp
    unit = tp.p if tp.kind == "1d" else tp.q
    heads = 2 * unit
    extra = dict(VARIANT) if variant else {}
    if gqa:
        extra["kv_heads"] = unit
    config = Config(vocab=8 * unit, seq=8, hidden=8 * heads, heads=heads, layers=layers,
                    **extra)
    batch = mesh.dp * m * (1 if tp.kind == "1d" else tp.d * tp.q)
    return MeshCase(mesh, batch, config, zero=zero, microbatches=m, steps=steps, **kw)


CASES = {
    # 4 ranks
    "megatron:4 sp selective flash": _case("tp=megatron:4", sequence_parallel=True,
                                           recompute="selective", attention="flash"),
    "pp=2 megatron:2 sp full zero1": _case("pp=2,tp=megatron:2", sequence_parallel=True,
                                           recompute="full", zero=1),
    "dp=2 megatron:2 sp flash": _case("dp=2,tp=megatron:2", sequence_parallel=True,
                                      attention="flash"),
    "pp=2 megatron:2 interleaved:2 sp selective": _case(
        "pp=2,tp=megatron:2", layers=4, schedule="interleaved", chunks=2,
        sequence_parallel=True, recompute="selective"),
    "optimus:2x2 selective flash": _case("tp=optimus:2x2", recompute="selective",
                                         attention="flash"),
    "dp=2 pp=2 gpt2 untied zero3 flash": _case("dp=2,pp=2", variant=False, gqa=False,
                                               zero=3, attention="flash"),
    "dp=2 megatron:2 sp zero2": _case("dp=2,tp=megatron:2", sequence_parallel=True, zero=2),
    "dp=2 megatron:2 sp zero3 selective": _case("dp=2,tp=megatron:2", sequence_parallel=True,
                                                zero=3, recompute="selective"),
    # 8 ranks
    "dp=2 optimus:2x2 full zero2": _case("dp=2,tp=optimus:2x2", recompute="full", zero=2),
    "summa25:2x2x2 selective": _case("tp=summa25:2x2x2", recompute="selective"),
    "dp=2 pp=2 megatron:2 sp zero1 flash": _case("dp=2,pp=2,tp=megatron:2",
                                                 sequence_parallel=True, zero=1,
                                                 attention="flash"),
    "dp=2 pp=2 megatron:2 sp zero3": _case("dp=2,pp=2,tp=megatron:2", sequence_parallel=True,
                                           zero=3),
    # 16 ranks
    "pp=2 summa25:2x2x2 flash selective": _case("pp=2,tp=summa25:2x2x2", attention="flash",
                                                recompute="selective", steps=1),
    "dp=2 pp=2 megatron:4 sp": _case("dp=2,pp=2,tp=megatron:4", sequence_parallel=True,
                                     steps=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_techniques_in_a_mesh_match_the_serial_model(backend, name):
    case = CASES[name]
    res = run_mesh_case(case, backend)
    r = res.extra["report"]
    parallel_assert(r.techniques == case.techniques and len(r.losses) == case.steps
                    and len(r.serial_losses) == case.steps, mesh_row(res))


def test_a_missing_sequence_parallel_gradient_sum_fails_the_row(backend, monkeypatch):
    """Skip the once-per-step all-reduce of the sequence-parallel parameters' partial
    gradients: the LayerNorm and bias gradients are then partial sums, and the row
    fails (values, and the sp.grads traffic against its closed form)."""
    case = _case("tp=megatron:4" if P == 4 else f"tp=megatron:{P}", variant=False,
                 gqa=False, sequence_parallel=True, steps=1)
    skip_unless(P in (2, 4, 8) and case.misfit(P) == "", f"needs a Megatron group (p = {P})")
    monkeypatch.setattr(composed.Trainer, "_sp_keys", lambda self: [])
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(not res.ok and not r.values_ok, mesh_row(res))


@pytest.mark.parametrize("zero", [2, 3])
def test_a_missing_owned_sequence_parallel_sum_fails_the_row(backend, monkeypatch, zero):
    """ZeRO 2-3: skip the tensor-group sum of the sequence-parallel gradients' owned
    parts; the row fails."""
    case = _case("dp=2,tp=megatron:2", variant=False, gqa=False, sequence_parallel=True,
                 zero=zero, steps=1)
    skip_unless(case.misfit(P) == "", f"needs p = 4 (p = {P})")
    monkeypatch.setattr(composed.Trainer, "_allreduce_sp_owned", lambda self: None)
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(not res.ok and not r.values_ok, mesh_row(res))
