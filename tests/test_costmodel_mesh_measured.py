"""The cost model's side of measured sharded-training steps (workload.measured.mesh_features,
on the MeasuredRun record): each rank's compute follows its stage, micro-batches and
ZeRO stage, and a one-stage, one-replica mesh is priced like the plain training step of
its scheme."""

from __future__ import annotations

import pytest

from summasim.costmodel.tools.accuracy import rank_features
from summasim.costmodel.machine import load_preset
from summasim.costmodel.workload.measured import (ADAM_PASSES, MeasuredRun, mesh_features,
                                                  predict_measured_mesh)

MACHINE = load_preset("local-2core-mpich")
MODEL = dict(b=8, s=32, h=64, heads=8, v=128, layers=4, ffn=4, dtype="float64")


def _mesh(dp=1, pp=1, m=1, zero=0, checkpoint=False, scheme="megatron", t=1, q=1, d=1):
    T = t if scheme == "megatron" else d * q * q
    p = dp * pp * T
    split = [(s * MODEL["layers"] // pp, (s + 1) * MODEL["layers"] // pp) for s in range(pp)]
    coords = [[a, s, r, *split[s]] for a in range(dp) for s in range(pp) for r in range(T)]
    return MeasuredRun(kind="mesh", scheme=scheme, t=t, q=q, d=d, dp=dp, pp=pp,
                       microbatches=m, zero=zero, checkpoint=checkpoint, p=p,
                       events=tuple(() for _ in coords),
                       coords=tuple(tuple(c) for c in coords), **MODEL)


def _adam(n_params, shard=1):
    return MACHINE.gamma_elementwise * ADAM_PASSES * n_params / shard


def _params(stage_layers, first, last):
    h, v, s, f = MODEL["h"], MODEL["v"], MODEL["s"], MODEL["ffn"]
    return (stage_layers * ((4 + 2 * f) * h * h + (9 + f) * h) + ((v + s) * h if first else 0)
            + (v * h if last and not first else 0))


def test_one_stage_one_replica_is_the_training_step():
    mesh = _mesh()
    tf = MeasuredRun(kind="transformer", scheme="megatron", q=1, d=1, p=1, events=((),),
                     coords=((0,),), **MODEL)
    (mf,), (tf_f,) = mesh_features(mesh, MACHINE), rank_features(tf, MACHINE)
    assert mf.work - _adam(_params(4, True, True)) == pytest.approx(tf_f.work, rel=1e-12)


def test_the_pricers_take_the_record_and_its_json_form_reads_the_same():
    run = _mesh(dp=2, pp=2, m=2, zero=1)
    assert predict_measured_mesh(MeasuredRun.from_dict(run.to_dict()), MACHINE) == \
        predict_measured_mesh(run, MACHINE)
    for fn in (mesh_features, predict_measured_mesh):
        with pytest.raises(TypeError, match="takes a MeasuredRun"):
            fn(run.to_dict(), MACHINE)


def test_stages_split_the_work_and_microbatches_add_up():
    one = mesh_features(_mesh(), MACHINE)[0].work
    two = mesh_features(_mesh(pp=2), MACHINE)
    first, last = two[0].work, two[1].work
    # the last stage carries the LM head: it is the busier one
    assert last > first > 0
    adam = _adam(_params(2, True, False)) + _adam(_params(2, False, True))
    assert first + last - adam == pytest.approx(one - _adam(_params(4, True, True)), rel=1e-9)
    # two micro-batches of half the batch: the same GEMM rows, so close to one step
    m2 = mesh_features(_mesh(m=2), MACHINE)[0].work
    assert m2 == pytest.approx(one, rel=0.35) and m2 != one


def test_zero_shards_adam_and_checkpointing_adds_the_recompute():
    z0 = mesh_features(_mesh(dp=2, zero=0), MACHINE)[0].work
    z1 = mesh_features(_mesh(dp=2, zero=1), MACHINE)[0].work
    assert z0 - z1 == pytest.approx(_adam(_params(4, True, True)) / 2, rel=1e-9)
    ck = mesh_features(_mesh(checkpoint=True), MACHINE)[0].work
    assert ck > mesh_features(_mesh(), MACHINE)[0].work


def test_more_replicas_on_the_same_cores_do_not_speed_up_the_step():
    # 8 and 16 ranks on a 2-core node: twice the replicas, half the batch each, at
    # least the same total work on the same cores (more: each replica runs its own Adam)
    # -- the shared-core model must follow the node's work, not halve the step
    res8 = _mesh(dp=1, pp=2, m=2, scheme="optimus", q=2)
    res16 = _mesh(dp=2, pp=2, m=1, scheme="optimus", q=2)
    f8, f16 = (mesh_features(r, MACHINE) for r in (res8, res16))
    assert max(f.work for f in f16) < 0.75 * max(f.work for f in f8)   # less per rank ...
    node = sum(f.work for f in f16) / sum(f.work for f in f8)
    assert node >= 1.0                                                 # ... not per node
    p8, p16 = (predict_measured_mesh(r, MACHINE) for r in (res8, res16))
    assert p16 / p8 == pytest.approx(node, rel=0.05)
