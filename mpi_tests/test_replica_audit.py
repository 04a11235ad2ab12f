"""The runtime replica audit of sharded training (``Trainer.audit``, run by the mesh
executor after every step): which replica groups it covers on each mesh and ZeRO stage,
what it hashes, and that one bit of drift on one rank in any group fails the row while
every value check still passes (the ``drift`` fault)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from _util import WORLD, parallel_assert, skip_unless
from summasim.grid import Mesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import mesh_inputs, run_mesh
from summasim.harness.inject import Fault
from summasim.transformer import model
from summasim.transformer.composed import Trainer
from summasim.transformer.model import Config
from summasim.transformer.schemes import get_scheme

P = WORLD.Get_size()


def _config(unit: int) -> Config:
    return Config(vocab=8 * unit, seq=4, hidden=8 * unit, heads=2 * unit, layers=2)


def _case(mesh: str, zero: int, unit: int = 1, per: int = 1) -> MeshCase:
    """``mesh`` with a model every grid side divides; ``per`` sequences per
    micro-batch and replica (a 2D/2.5D grid needs d q of them)."""
    m = MeshCase.parse(mesh, 1, _config(unit), zero=zero)
    return MeshCase.parse(mesh, m.dp * 2 * per, _config(unit), zero=zero, microbatches=2,
                          bucket_bytes=512)


def _cases():
    """Meshes of p ranks covering each replica group: dp x Megatron (dp, tensor), dp x
    pp (dp, the tied embedding), pp x Megatron (tensor, embed), dp alone, and SUMMA2.5
    over a depth of 2 (its copies over grid.depth) when p allows; every ZeRO stage."""
    out = []
    if P % 2 == 0 and P >= 4:
        t = P // 2
        for zero in (0, 1, 2, 3):
            out.append(_case(f"dp=2,pp=1,tp=megatron:{t}", zero, unit=t))
        out.append(_case(f"dp=2,pp=2,tp=megatron:{P // 4}", 1, unit=P // 4))
        out.append(_case(f"dp=2,pp=2,tp=megatron:{P // 4}", 3, unit=P // 4))
        out.append(_case(f"dp=1,pp=2,tp=megatron:{t}", 0, unit=t))
    if P >= 2:
        out.append(_case(f"dp={P},pp=1,tp=megatron:1", 3))
    if P == 8:
        out.append(_case("dp=1,pp=1,tp=summa25:2x2x2", 0, unit=2, per=4))
        out.append(_case("dp=1,pp=1,tp=summa25:2x2x2", 3, unit=2, per=4))
    return out


def _uneven_cases():
    """Tensor shards of unequal sizes (heads, the MLP and the vocabulary not divisible
    by t, or a 3D cube whose h leaves some blocks empty): every rank of a tensor group
    pads each key to the group's largest shard (``Trainer._slots``), so that the
    replicated keys keep one offset, bucket and ZeRO chunk on all of them. Without the
    pads, dp = 3 rounded a replicated key's sum in another order on each tensor rank
    (the audit failed), and sequence parallelism under ZeRO 2-3 summed parts of other
    keys over the tensor group (the parameters came out wrong)."""
    out = []
    if P % 2 == 0 and P >= 4:
        t = P // 2
        cfg = Config(vocab=5, seq=2, hidden=2 * (t + 1), heads=t + 1, layers=1, ffn_mult=1.5)
        for zero in (0, 1, 2, 3):
            out.append(MeshCase.parse(f"dp=2,pp=1,tp=megatron:{t}", 4, cfg, zero=zero,
                                      microbatches=1, bucket_bytes=512))
        cfg = dataclasses.replace(cfg, seq=t)          # sequence parallelism: t | seq
        for zero in (2, 3):
            for bucket in (64, 25 << 20):
                out.append(MeshCase.parse(f"dp=2,pp=1,tp=megatron:{t}", 4, cfg, zero=zero,
                                          microbatches=1, bucket_bytes=bucket,
                                          sequence_parallel=True))
    if P == 9:                    # three replicas of 4 heads (and their MLP) over t = 3
        cfg = Config(vocab=7, seq=3, hidden=8, heads=4, layers=2, ffn_mult=1.25)
        for zero in (0, 1, 2, 3):
            out.append(MeshCase.parse("dp=3,pp=1,tp=megatron:3", 6, cfg, zero=zero,
                                      microbatches=2, bucket_bytes=512))
        out.append(MeshCase.parse("dp=3,pp=1,tp=megatron:3", 3, cfg, zero=2,
                                  microbatches=1, sequence_parallel=True))
    if P >= 2:
        cfg = Config(vocab=5, seq=2, hidden=2 * (P + 1), heads=P + 1, layers=1, ffn_mult=1.5)
        for bucket in (300, 512):
            out.append(MeshCase.parse(f"dp=1,pp=1,tp=megatron:{P}", 2, cfg, zero=1,
                                      microbatches=1, bucket_bytes=bucket))
    if P == 8:
        cfg = Config(vocab=4, seq=2, hidden=3, heads=3, layers=1)
        for zero in (0, 3):
            out.append(MeshCase.parse("dp=1,pp=1,tp=3d:2x2x2", 4, cfg, zero=zero,
                                      microbatches=1, bucket_bytes=512))
    return out


CASES = _cases()
IDS = [f"{c.spec}-z{c.zero}" for c in CASES]
UNEVEN = _uneven_cases()


def _uneven_id(c) -> str:
    return f"{c.spec}-z{c.zero}-b{c.bucket_bytes}" + ("-sp" if c.sequence_parallel else "")


@pytest.mark.parametrize("case", UNEVEN, ids=[_uneven_id(c) for c in UNEVEN])
def test_every_tensor_rank_lays_its_stage_out_alike(case):
    """Offsets, buckets and owned ZeRO chunks are the same on every rank of a tensor
    group, however unevenly the scheme cuts its shards, and each key's pad (what its
    slot holds past the rank's shard) is still zeros after a step: parameters,
    gradients and Adam's moments."""
    spec = get_scheme(case.scheme)
    params, tokens, targets = mesh_inputs(case.config, case.batch, 0)
    with Mesh(WORLD, case.dp, case.pp, spec.grid_kind, q=case.q, d=case.d,
              t=case.t) as mesh:
        tr = Trainer(params, case.config, mesh, spec, zero=case.zero,
                     microbatches=case.microbatches, bucket_bytes=case.bucket_bytes,
                     sequence_parallel=case.sequence_parallel)
        tr.step(tokens, targets)
        layout = (tr.n, tuple(tr.offsets.items()), tuple(tr.buckets), tuple(tr.owned))
        every = mesh.tensor.world.mpi.allgather(layout)
        shapes = mesh.tensor.world.mpi.allgather(tuple(tr.shapes.values()))
        pads = [(tr.key_ranges()[k][1], tr.offsets[k] + tr.slots[k]) for k in tr.keys]
        held = tr.held_params() + tr.held_grads() + [
            (lo, hi, st[name]) for lo, hi, st in tr._held_moments() for name in "mv"]
        padded = sum(mesh.tensor.world.mpi.allgather(sum(b - a for a, b in pads)))
        stray = sum(int(np.count_nonzero(vals[max(a, lo) - lo:min(b, hi) - lo]))
                    for lo, hi, vals in held for a, b in pads if max(a, lo) < min(b, hi))
    parallel_assert(all(x == every[0] for x in every) and len(set(shapes)) > 1
                    and padded > 0 and stray == 0,
                    f"{_uneven_id(case)}: layouts alike {all(x == every[0] for x in every)}, "
                    f"{len(set(shapes))} shard shapes, {stray} non-zero pad items")


@pytest.mark.parametrize("case", UNEVEN, ids=[_uneven_id(c) for c in UNEVEN])
def test_uneven_shards_pass_the_audit_and_drift_still_fails_it(case):
    """A right run on uneven shards passes every check, the audit included (it compares
    each replicated key where every rank of the group holds it, never one rank's
    segments against another's); one bit of drift on the last rank still fails it."""
    clean = run_mesh(case, WORLD, timed=False)
    r = clean.extra["report"]
    parallel_assert(clean.ok and r.replicas_ok and r.audit_bytes > 0,
                    f"{case.spec} zero={case.zero}: {r.failures}, audit {r.audit}")
    res = run_mesh(case, WORLD, timed=False, fault=Fault("drift", P - 1))
    r = res.extra["report"]
    parallel_assert(r.fault_applied and not res.ok and r.failures == ["replicas"],
                    f"{case.spec} zero={case.zero} drift: applied={r.fault_applied} "
                    f"ok={res.ok} failures={r.failures}")


def _expected_groups(case) -> dict:
    """The replica groups of ``case`` and their sizes, from the mesh alone."""
    tp = case.mesh.tp
    out = {}
    if case.dp > 1:
        out["dp" if case.zero < 3 else "dp.gathers"] = case.dp
    if tp.kind == "1d" and tp.p > 1:
        out["tensor"] = tp.p
    if tp.kind == "2.5d" and tp.d > 1:
        out["tensor"] = tp.d
    if case.pp > 1:
        out["embed"] = 2
    return dict(sorted(out.items()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_clean_mesh_audits_every_replica_group(backend, case):
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(res.ok and r.replicas_ok and not r.drifted
                    and r.audit == _expected_groups(case) and r.audit_bytes > 0,
                    f"{case.spec} zero={case.zero}: audit {r.audit} (want "
                    f"{_expected_groups(case)}), drifted {r.drifted}, {r.failures}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_bit_of_drift_fails_only_the_audit(backend, case):
    """``drift@P-1``: one replicated entry moves by one unit in the last place on one
    rank. The values stay within every bound (the value check alone would pass the
    row); the audit fails it, on every rank alike."""
    res = run_mesh(case, WORLD, backend, timed=False, fault=Fault("drift", P - 1))
    r = res.extra["report"]
    verdicts = WORLD.allgather((res.ok, tuple(r.failures), tuple(r.drifted)))
    parallel_assert(all(v == verdicts[0] for v in verdicts), f"ranks disagree: {verdicts}")
    parallel_assert(r.fault_applied and not res.ok and r.failures == ["replicas"]
                    and r.values_ok and r.drifted and set(r.drifted) <= set(r.audit),
                    f"{case.spec} zero={case.zero}: applied={r.fault_applied} ok={res.ok} "
                    f"failures={r.failures} values_ok={r.values_ok} drifted={r.drifted} "
                    f"param_err={r.param_err:.2e}")


def test_drift_has_nothing_to_move_where_nothing_is_replicated(backend):
    """Optimus on q x q (d = 1), one replica, one stage: no tensor is stored twice, so
    ``drift`` is not applied and the row passes (reported as untouched)."""
    skip_unless(P == 4, "optimus:2x2 alone needs p = 4")
    case = _case("dp=1,pp=1,tp=optimus:2x2", 0, unit=2, per=2)
    res = run_mesh(case, WORLD, backend, timed=False, fault=Fault("drift", P - 1))
    r = res.extra["report"]
    parallel_assert(not r.fault_applied and res.ok and r.audit == {},
                    f"applied={r.fault_applied} ok={res.ok} audit={r.audit}")


def test_the_audit_hashes_the_replicated_state():
    """dp = p replicas of the whole model, ZeRO 0: the dp group's digest covers the
    parameters and Adam's two moments, 3 N items (N from the serial shapes); ZeRO-1
    partitions the moments: N items."""
    skip_unless(P >= 2, "needs dp > 1")
    config = _config(1)
    n = sum(math.prod(s) for s in model.param_shapes(config).values())
    item = np.dtype(config.dtype).itemsize
    ok, why = True, ""
    for zero, want in ((0, 3 * n * item), (1, n * item)):
        case = _case(f"dp={P},pp=1,tp=megatron:1", zero)
        res = run_mesh(case, WORLD, timed=False)
        r = res.extra["report"]
        if not (res.ok and r.audit == {"dp": P} and r.audit_bytes == want):
            ok, why = False, f"zero={zero}: {r.audit} {r.audit_bytes} bytes, want {want}"
    parallel_assert(ok, why)


def _members(rs) -> list:
    """World ranks of a replica set's group (collective over it)."""
    return rs.comm.mpi.allgather(WORLD.Get_rank())


@pytest.mark.parametrize("key", ["h0.attn.qkv.w", "h0.ln1.g", "wte"])
def test_each_group_sees_exactly_the_drift_inside_it(key):
    """ZeRO 0: one bit of ``key`` moved on rank 0 (first stage). Every group that holds a copy
    of that entry and contains that rank disagrees, on each of its ranks; every other
    group agrees. A sharded weight (qkv) is replicated over dp only, a LayerNorm gain
    over dp and the tensor group, ``wte`` over dp and the tied first/last pair."""
    skip_unless(P % 4 == 0, "needs dp = 2, pp = 2 and a tensor group of p / 4")
    t = P // 4
    case = _case(f"dp=2,pp=2,tp=megatron:{t}", 0, unit=t)
    mesh = Mesh(WORLD, case.dp, case.pp, "1d", t=t)
    try:
        params, tokens, targets = mesh_inputs(case.config, case.batch, 0)
        tr = Trainer(params, case.config, mesh, get_scheme("megatron"), zero=0,
                     microbatches=case.microbatches, bucket_bytes=case.bucket_bytes)
        tr.step(tokens, targets)
        sets = tr.replica_sets()
        members = {rs.name: _members(rs) for rs in sets}
        drifter = 0
        moved = WORLD.Get_rank() == drifter and key in tr.offsets
        if moved:
            lo, hi = tr.key_ranges()[key]
            tr.flat[lo] = np.nextafter(tr.flat[lo], np.inf)
        holds = WORLD.bcast(moved, root=drifter)
        parallel_assert(holds, f"rank {drifter} holds no {key}")
        got = tr.audit()
        comm, tkeys = tr.tensor_replicated()
        keys_of = {"dp": set(tr.offsets), "tensor": set(tkeys), "embed": {"wte"}}
        want = {rs.name: not (holds and drifter in members[rs.name]
                              and key in keys_of[rs.name]) for rs in sets}
        parallel_assert({k: v["agree"] for k, v in got.items()} == want,
                        f"{key}: agree {got}, want {want}")
        if key == "h0.ln1.g":
            parallel_assert(t == 1 or "tensor" in got, f"no tensor group: {got}")
    finally:
        mesh.free()


@pytest.mark.parametrize("key", ["h0.attn.qkv.w", "h0.ln1.g", "h0.attn.qkv.b"])
def test_the_3d_cube_audits_its_vectors_over_their_whole_plane(key):
    """tp=3d:2x2x2, ZeRO 0: one bit of ``key`` moved on rank 0. A weight is held once
    (every group agrees); a LayerNorm gain (layout A, shared by the ranks of a depth x
    column plane) is caught by the "tensor" (depth) and "tensor.col" groups, a QKV bias
    (layout B, a depth x row plane) by "tensor" and "tensor.row"."""
    skip_unless(P == 8, "the 2 x 2 x 2 cube needs p = 8")
    from summasim.transformer import tp3d

    case = _case("dp=1,pp=1,tp=3d:2x2x2", 0, unit=2, per=4)
    mesh = Mesh(WORLD, 1, 1, "3d", q=2, d=2)
    try:
        params, tokens, targets = mesh_inputs(case.config, case.batch, 0)
        tr = Trainer(params, case.config, mesh, get_scheme("3d"), zero=0,
                     microbatches=case.microbatches, bucket_bytes=case.bucket_bytes)
        tr.step(tokens, targets)
        if WORLD.Get_rank() == 0:
            lo, _ = tr.key_ranges()[key]
            tr.flat[lo] = np.nextafter(tr.flat[lo], np.inf)
        got = {name: v["agree"] for name, v in tr.audit().items()}
        role = tp3d.role(key)
        want = {"tensor": role in ("a", "b"), "tensor.col": role == "a",
                "tensor.row": role == "b"}
        # rank 0's groups disagree where they hold the key; groups without rank 0 agree
        mine = {name: not (want[name] and WORLD.Get_rank() in _rank0_peers(tr, name))
                for name in got}
        parallel_assert(set(got) == set(want) and got == mine, f"{key}: {got}, want {mine}")
    finally:
        mesh.free()


def _rank0_peers(tr, name) -> set:
    """This rank if it shares the ``name`` group with world rank 0 (collective)."""
    comm = {"tensor": tr.grid.depth, "tensor.col": tr.grid.col, "tensor.row": tr.grid.row}[name]
    members = comm.mpi.allgather(WORLD.Get_rank())
    return {WORLD.Get_rank()} if 0 in members else set()
