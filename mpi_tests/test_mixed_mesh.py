"""Mixed precision inside sharded training, under MPI: bfloat16 and float16 compute with
fp32 master weights and fp32 Adam, loss scaling and a float32 or 16-bit gradient
reduction, composed with data, pipeline and ZeRO parallelism and each tensor scheme that
fits the world size. Every row trains against the float64 serial model within
:func:`summasim.validate.mixed_tolerance` (stated, never fitted), with the traffic
ledger's 2-byte messages, the 16-bit memory formula and the replica audit
(summasim.harness.composed.run_mesh). An overflow on one rank skips that step on every
rank."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, mesh_row, parallel_assert, run_mesh_case, skip_unless
from summasim.grid import Mesh as GridMesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import run_mesh
from summasim.spec import Mesh
from summasim.transformer import composed, model
from summasim.transformer.model import Config
from summasim.transformer.schemes import get_scheme
from summasim.validate import mixed_tolerance, training_tolerance

P = WORLD.Get_size()


def _case(text, precision="bfloat16", *, m=2, zero=0, steps=2, layers=2, **kw):
    """A float32 (master) model every piece divides: hidden 8 per head, 2 heads per
    tensor-grid unit, sequence 8."""
    mesh = Mesh.parse(text)
    tp = mesh.tp
    unit = tp.p if tp.kind == "1d" else tp.q
    heads = 2 * unit
    config = Config(vocab=8 * unit, seq=8, hidden=8 * heads, heads=heads, layers=layers,
                    dtype=np.float32)
    batch = mesh.dp * m * (1 if tp.kind == "1d" else tp.d * tp.q)
    return MeshCase(mesh, batch, config, zero=zero, microbatches=m, steps=steps,
                    precision=precision, **kw)


CASES = {
    # 4 ranks
    "dp=2 megatron:2 bf16": _case("dp=2,tp=megatron:2"),
    "dp=2 pp=2 bf16 zero1 bf16-reduce": _case("dp=2,pp=2", zero=1, grad_reduce="bfloat16"),
    "dp=2 pp=2 fp16 zero3 static": _case("dp=2,pp=2", "float16", zero=3,
                                         loss_scale="static:1024"),
    "pp=2 megatron:2 bf16 sp interleaved": _case("pp=2,tp=megatron:2", layers=4,
                                                 schedule="interleaved", chunks=2,
                                                 sequence_parallel=True),
    "optimus:2x2 bf16": _case("tp=optimus:2x2"),
    "dp=4 fp16 zero2 dynamic": _case("dp=4", "float16", zero=2),
    "dp=2 pp=2 bf16 zero1 bf16-reduce overlap": _case("dp=2,pp=2", zero=1,
                                                      grad_reduce="bfloat16", overlap=True,
                                                      bucket_bytes=4096),
    "dp=4 bf16 zero3 bf16-reduce overlap": _case("dp=4", zero=3, grad_reduce="bfloat16",
                                                 overlap=True, bucket_bytes=4096),
    # 8 ranks
    "dp=2 optimus:2x2 bf16 zero2 bf16-reduce": _case("dp=2,tp=optimus:2x2", zero=2,
                                                     grad_reduce="bfloat16"),
    "summa25:2x2x2 fp16": _case("tp=summa25:2x2x2", "float16"),
    "dp=2 pp=2 megatron:2 bf16 zero3": _case("dp=2,pp=2,tp=megatron:2", zero=3),
    # 16 ranks
    "dp=2 pp=2 megatron:4 bf16 sp zero1": _case("dp=2,pp=2,tp=megatron:4",
                                               sequence_parallel=True, zero=1, steps=1),
    "pp=2 summa25:2x2x2 bf16 zero1": _case("pp=2,tp=summa25:2x2x2", zero=1, steps=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_precision_mesh_matches_the_float64_serial_model(backend, name):
    case = CASES[name]
    res = run_mesh_case(case, backend)
    r = res.extra["report"]
    bound = mixed_tolerance(case.config, case.batch, case.precision, case.grad_reduce,
                            case.microbatches * case.dp)
    parallel_assert(r.bound == bound and r.dtype == case.precision and not r.skipped
                    and len(r.losses) == case.steps, mesh_row(res))


def _float32_case(case):
    """The same composition in float32 (no mixed precision)."""
    import dataclasses

    return dataclasses.replace(case, precision=None, loss_scale=None, grad_reduce=None)


def test_the_16_bit_error_is_far_above_float32s_and_within_its_bound(backend):
    """bfloat16 rounds every activation to 8 bits: its error must be far above float32's
    (the rounding happens) and within the mixed bound (it is right)."""
    case = CASES["dp=2 megatron:2 bf16"] if P == 4 else None
    skip_unless(case is not None, "a 4-rank row")
    mixed = run_mesh_case(case, backend).extra["report"]
    plain = run_mesh_case(_float32_case(case), backend).extra["report"]
    f32 = training_tolerance(case.config, case.batch, "float32")
    parallel_assert(plain.grad_err <= f32 < mixed.grad_err <= mixed.bound,
                    f"float32 {plain.grad_err:.2e} (bound {f32:.2e}), bfloat16 "
                    f"{mixed.grad_err:.2e} (bound {mixed.bound:.2e})")


def test_messages_and_state_are_16_bit(backend):
    """The hand-offs, the ZeRO gathers and a 16-bit gradient reduction send 2 bytes an
    item: half the float32 row's bytes in those phases. The compute copy and the 16-bit
    gradients hold half the float32 row's bytes, and the optimizer adds an fp32 master
    copy to the moments (2 + 2 + 12 bytes per parameter, partitioned as ZeRO-1 does)."""
    case = CASES["dp=2 pp=2 bf16 zero1 bf16-reduce"] if P == 4 else None
    skip_unless(case is not None, "a 4-rank row")
    mixed = run_mesh_case(case, backend).extra["report"]
    plain = run_mesh_case(_float32_case(case), backend).extra["report"]
    halves = {k: (mixed.traffic[k], plain.traffic[k]) for k in
              ("dp.grads", "zero.params", "pp.fwd", "pp.bwd")}
    parallel_assert(all(b > 0 and 2 * a == b for a, b in halves.values())
                    and mixed.traffic["embed.tie"] == plain.traffic["embed.tie"] > 0,
                    f"{halves}, embed.tie {mixed.traffic['embed.tie']} vs "
                    f"{plain.traffic['embed.tie']}")
    mem, ref = mixed.memory, plain.memory
    parallel_assert(2 * mem["params"] == ref["params"] and 2 * mem["grads"] == ref["grads"]
                    and 2 * mem["optimizer"] == 3 * ref["optimizer"]
                    and mem == mixed.memory_formula, f"{mem} vs float32 {ref}")


def _trainer(text, precision, zero, loss_scale=None):
    mesh_spec = Mesh.parse(text)
    tp = mesh_spec.tp
    config = Config(vocab=16, seq=8, hidden=16, heads=2, layers=2, dtype=np.float32)
    spec = get_scheme(tp.name)
    mesh = GridMesh(WORLD, mesh_spec.dp, mesh_spec.pp, spec.grid_kind, q=tp.q, d=tp.d,
                    t=tp.p if tp.kind == "1d" else 1)
    params = model.init_params(config, seed=3)
    tr = composed.Trainer(params, config, mesh, spec, zero=zero, microbatches=2,
                          precision=precision, loss_scale=loss_scale)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, config.vocab, size=(4 * mesh_spec.dp, 8))
    targets = rng.integers(0, config.vocab, size=tokens.shape)
    return tr, mesh, tokens, targets


def _snapshot(tr):
    return [np.array(v, copy=True) for _, _, v in tr.held_params()]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(zero):
    """An Inf in one rank's gradient at step 2: every rank skips step 2 (its master
    weights and compute copy unchanged, bit for bit), the dynamic scale halves on every
    rank, and steps 1 and 3 apply."""
    skip_unless(P == 4, "the dp=2,pp=2 mesh")
    tr, mesh, tokens, targets = _trainer("dp=2,pp=2", "float16", zero, "dynamic")
    try:
        if WORLD.rank == P - 1:
            tr.inject_overflow_at = 1
        applied, same, scales = [], [], []
        for _ in range(3):
            before = _snapshot(tr)
            compute = np.array(tr.flat if tr.flat is not None else tr.cshard, copy=True)
            tr.step(tokens, targets)
            after = _snapshot(tr)
            now = tr.flat if tr.flat is not None else tr.cshard
            same.append(all(np.array_equal(a, b) for a, b in zip(before, after))
                        and np.array_equal(compute, now))
            applied.append(tr.applied)
            scales.append(tr.scaler.scale)
    finally:
        mesh.free()
    parallel_assert(applied == [True, False, True] and same == [False, True, False]
                    and scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15] and tr.skipped == 1,
                    f"applied {applied}, unchanged {same}, scales {scales}")


@pytest.mark.parametrize("precision,loss_scale,passes", [("float16", "dynamic", True),
                                                          ("bfloat16", "none", False)])
def test_a_skipped_step_passes_only_under_a_loss_scale(backend, monkeypatch, precision,
                                                      loss_scale, passes):
    """An Inf in the last rank's gradient at step 2: under a dynamic loss scale that is an
    overflow, the step is skipped and the row passes (its parameters checked unchanged);
    without a loss scale nothing can overflow, so the skip hides a fault and the row
    fails, naming the step."""
    case = (_case("dp=2,pp=2", precision, loss_scale=loss_scale, steps=3) if P == 4
            else None)
    skip_unless(case is not None, "the dp=2,pp=2 mesh")
    init = composed.Trainer.__init__

    def hooked(self, *a, **kw):
        init(self, *a, **kw)
        if WORLD.rank == P - 1:
            self.inject_overflow_at = 1

    monkeypatch.setattr(composed.Trainer, "__init__", hooked)
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    named = any("without a loss scale" in f for f in r.failures)
    parallel_assert(r.skipped == [2] and res.ok == passes and named == (not passes),
                    f"skipped {r.skipped}, failures {r.failures}: {mesh_row(res)}")


@pytest.mark.parametrize("kind,precision,zero,reduce16", [
    ("perturb", "bfloat16", 1, False), ("drop", "float16", 0, True),
    ("drop", "float16", 3, True), ("drift", "bfloat16", 3, False)])
def test_every_fault_fails_a_mixed_precision_row(backend, kind, precision, zero, reduce16):
    """The faults under mixed precision: ``perturb`` moved the fp32 gradient by 1e-2,
    far under the 16-bit bound, and passed; ``drop`` around a 16-bit reduction raised a
    TypeError (its ``add``); ``drift`` in a ZeRO-3 gather of raw 16-bit bits changed
    nothing and was counted as applied. Each now fails its row, on every rank. (``drop``
    runs in float16: one rank's chunk missing 3 of 4 replicas' sums can stay under
    bfloat16's bound of about 0.4 on this small model.)"""
    from summasim.harness.inject import Fault

    case = (_case("dp=4", precision, zero=zero,
                  grad_reduce="bfloat16" if reduce16 else "float32") if P == 4 else None)
    skip_unless(case is not None, "the dp=4 mesh")
    res = run_mesh(case, WORLD, backend, timed=False, fault=Fault(kind, P - 1))
    r = res.extra["report"]
    parallel_assert(r.fault_applied and not res.ok, f"{kind}@{P - 1}: {mesh_row(res)}")


def test_a_loss_scale_left_in_the_gradients_fails_the_row(backend, monkeypatch):
    """Skip the division by S before Adam: the gradients are 1024 times too large and
    the row fails against the serial model."""
    case = _case("dp=2,pp=2", "float16", loss_scale="static:1024") if P == 4 else None
    skip_unless(case is not None, "the dp=2,pp=2 mesh")

    def no_unscale(self):
        self.scaler.update(False)
        return True

    monkeypatch.setattr(composed.Trainer, "_unscale", no_unscale)
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(not res.ok and r.grad_err > 100 * r.bound, mesh_row(res))


def test_a_local_overflow_vote_fails(backend, monkeypatch):
    """An overflow vote that is not collective (each rank its own verdict) lets the other
    ranks apply the step the overflowing rank skips: their replicas drift apart."""
    skip_unless(P == 4, "the dp=2,pp=2 mesh")
    tr, mesh, tokens, targets = _trainer("dp=2,pp=2", "float16", 0, "dynamic")
    monkeypatch.setattr(type(mesh.world), "allreduce", lambda self, buf, op="sum": buf)
    try:
        if WORLD.rank == 0:
            tr.inject_overflow_at = 0
        tr.step(tokens, targets)
        monkeypatch.undo()
        audit = tr.audit()
    finally:
        mesh.free()
    # rank 0 skipped alone: its replica (rank 2, stage 0) applied the step
    drifted = WORLD.allgather(sorted(k for k, v in audit.items() if not v["agree"]))
    parallel_assert("dp" in drifted[0] and "dp" in drifted[2], f"drifted {drifted}")


@pytest.mark.parametrize("zero", [0, 2])
def test_overlapped_16_bit_reductions_equal_the_blocking_ones_bitwise(backend, zero):
    """The overlapped rings of a 16-bit reduction add the same 16-bit values in the same
    order as the blocking ones: the same losses and the same errors, bit for bit."""
    import dataclasses

    case = _case("dp=4", zero=zero, grad_reduce="bfloat16", bucket_bytes=4096)
    skip_unless(case.misfit(P) == "", f"needs p = 4 (p = {P})")
    blocking = run_mesh_case(case, backend).extra["report"]
    overlapped = run_mesh_case(dataclasses.replace(case, overlap=True),
                               backend).extra["report"]
    parallel_assert(overlapped.overlap and sum(overlapped.rings.values()) > 0
                    and overlapped.losses == blocking.losses
                    and overlapped.grad_err == blocking.grad_err
                    and overlapped.traffic == blocking.traffic,
                    f"losses {overlapped.losses} vs {blocking.losses}, grad "
                    f"{overlapped.grad_err} vs {blocking.grad_err}, rings {overlapped.rings}")
