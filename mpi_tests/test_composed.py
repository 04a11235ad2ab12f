"""Sharded training under MPI: the mesh's coordinates and communicators, and every
composition of data, pipeline and ZeRO parallelism with the tensor schemes that the
process count allows, validated against the serial model (values, traffic, memory,
schedule, replicas); and the verdict fails when a piece of the engine is broken."""

from __future__ import annotations

import math

import pytest

from _util import WORLD, parallel_assert, skip_unless
from summasim.grid import Mesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import run_mesh
from summasim.transformer import composed
from summasim.transformer.model import Config

P = WORLD.Get_size()


def _factorizations(p):
    return [(dp, pp, p // (dp * pp)) for dp in range(1, p + 1) for pp in range(1, p + 1)
            if p % (dp * pp) == 0]


def _tensor_specs(T):
    out = [("megatron", f"megatron:{T}", 1, 1, T)]
    for q in range(2, T + 1):
        if T % (q * q) == 0:
            d = T // (q * q)
            if d == 1:
                out.append(("optimus", f"optimus:{q}x{q}", q, 1, 1))
            else:
                out.append(("summa25", f"summa25:{q}x{q}x{d}", q, d, 1))
    return out


def _case(dp, pp, tp, q, d, t, zero, schedule, m, checkpoint, bucket=None):
    """A mesh case with a model every piece of it divides: heads and vocab are
    multiples of the tensor grid's side, layers = pp + 1 (uneven stages when pp > 1)."""
    unit = t if tp.startswith("megatron") else q
    heads = 2 * unit
    config = Config(vocab=8 * unit, seq=4, hidden=4 * heads, heads=heads,
                    layers=pp + 1 if pp > 1 else 2)
    batch = dp * m * (d * q if not tp.startswith("megatron") else 1)
    kw = {} if bucket is None else {"bucket_bytes": bucket}
    return MeshCase.parse(f"dp={dp},pp={pp},tp={tp}", batch, config, zero=zero,
                          schedule=schedule, microbatches=m, checkpoint=checkpoint, **kw)


def _compositions(p, limit):
    """Every (dp, pp, tensor grid) of p with one ZeRO stage / schedule / checkpoint
    setting each, rotating so that every stage and schedule is covered; the meshes with
    both dp > 1 and pp > 1 first; at most ``limit``."""
    out, i = [], 0
    meshes = sorted(_factorizations(p), key=lambda f: (not (f[0] > 1 and f[1] > 1), f))
    for dp, pp, T in meshes:
        for name, tp, q, d, t in _tensor_specs(T):
            zero = i % 4
            schedule = ("1f1b", "gpipe")[(i // 4) % 2]
            out.append(_case(dp, pp, tp, q, d, t, zero, schedule, m=2 if pp > 1 else 1 + i % 2,
                             checkpoint=i % 3 == 1, bucket=256 if i % 2 else None))
            i += 1
    return out[:limit]


LIMIT = {1: 4, 4: 12, 8: 10, 9: 8, 16: 6}.get(P, 4)
CASES = _compositions(P, LIMIT)
# every other composition reduces over dp while the backward runs (Trainer overlap=True;
# mpi_tests/test_overlap.py holds it bitwise to the blocking path); the rest, and every
# other suite, run the blocking default
OVERLAP = [i % 2 == 1 for i in range(len(CASES))]


def _row(res):
    r = res.extra["report"]
    return (f"{r.mesh} zero={r.zero} {r.schedule} m={r.microbatches} ckpt={r.checkpoint}: "
            f"ok={r.ok} loss {r.loss_err:.1e} grad {r.grad_err:.1e} param {r.param_err:.1e} "
            f"({r.worst}) failures={r.failures} traffic {r.traffic} vs "
            f"{r.traffic_expected} memory {r.memory} vs {r.memory_formula}")


@pytest.mark.parametrize("dp,pp,T", _factorizations(P))
def test_mesh_coordinates_and_groups(dp, pp, T):
    mesh = Mesh(WORLD, dp, pp, "1d", t=T)
    try:
        rank = WORLD.Get_rank()
        a, s, r = mesh.coords
        ok = (rank == (a * pp + s) * T + r and mesh.dp_comm.rank == a
              and mesh.pp_comm.rank == s and mesh.tensor.rank == r
              and mesh.dp_comm.size == dp and mesh.pp_comm.size == pp
              and mesh.tensor.p == T and mesh.first == (s == 0) and mesh.last == (s == pp - 1))
        # the groups hold exactly the ranks that share the other two coordinates
        dp_world = mesh.dp_comm.mpi.allgather(rank)
        pp_world = mesh.pp_comm.mpi.allgather(rank)
        ok &= dp_world == [(x * pp + s) * T + r for x in range(dp)]
        ok &= pp_world == [(a * pp + x) * T + r for x in range(pp)]
        ends = pp > 1 and s in (0, pp - 1)
        ok &= (mesh.embed is not None) == ends
        if ends:
            ok &= mesh.embed.mpi.allgather(s) == [0, pp - 1]
        parallel_assert(ok, f"coords {mesh.coords} of world rank {rank} on {dp}x{pp}x{T}")
    finally:
        mesh.free()


def test_mesh_refuses_a_wrong_size_on_every_rank():
    from _util import collective_raises

    msg = collective_raises(ValueError, Mesh, WORLD, P + 1, 1, "1d", t=1)
    parallel_assert(f"needs {P + 1} processes" in msg, msg)


@pytest.mark.parametrize("case,overlap", list(zip(CASES, OVERLAP)),
                         ids=[f"{c.spec}-z{c.zero}-{c.schedule}-m{c.microbatches}"
                              f"{'-ckpt' if c.checkpoint else ''}{'-overlap' if o else ''}"
                              for c, o in zip(CASES, OVERLAP)])
def test_composition_matches_the_serial_model(backend, case, overlap):
    res = run_mesh(case, WORLD, backend, timed=False, overlap=overlap)
    r = res.extra["report"]
    parallel_assert(r.overlap == overlap and r.replicas_ok and not r.drifted, _row(res))
    # within the derived bounds (validate.training_tolerance; adam_step_bound: param_err
    # is the worst ratio to it), which in float64 are far below the old flat 1e-10
    parallel_assert(res.ok and r.values_ok and not r.failures and r.grad_err <= r.bound
                    and r.loss_err <= r.bound and r.param_err <= 1.0, _row(res))
    parallel_assert(r.dtype != "float64" or r.bound < 1e-10, _row(res))
    # the closed forms were met exactly and say what this composition must send
    parallel_assert(r.traffic == r.traffic_expected, _row(res))
    if case.dp > 1:
        parallel_assert(r.traffic["dp.grads"] > 0, _row(res))
    if case.pp > 1:
        parallel_assert(r.traffic["pp.fwd"] > 0 and r.traffic["embed.tie"] > 0, _row(res))
    if case.zero == 3 and case.dp > 1:
        parallel_assert(r.traffic["zero.gather"] > 0 and r.traffic["zero.params"] == 0,
                        _row(res))
    if case.zero in (1, 2) and case.dp > 1:
        parallel_assert(r.traffic["zero.params"] > 0, _row(res))


def _breakable_case():
    """A mesh with dp > 1 and pp > 1 when p allows, else the richest one."""
    for dp, pp, T in sorted(_factorizations(P), key=lambda f: (-(f[0] > 1) - (f[1] > 1), f)):
        if T == 1:
            return _case(dp, pp, "megatron:1", 1, 1, 1, zero=1, schedule="1f1b", m=2,
                         checkpoint=False)
    return None


_STATE_BYTES = composed.Trainer.state_bytes
# what to break, how, and which check must catch it ("values": the serial comparison)
BREAKS = {
    "no dp reduction": ("ring_allreduce_unchecked", lambda x, comm, out=None: out,
                        "values"),
    "no tied embedding sum": ("Trainer._tie", lambda self: None, "values"),
    "1f1b runs as gpipe": ("schedule", lambda kind, m, pp, s, chunks=1: [
        ("F", j, 0) for j in range(m)] + [("B", j, 0) for j in reversed(range(m))],
        "schedule"),
    "a stage's memory doubles": ("Trainer.state_bytes", lambda self: {
        k: 2 * v for k, v in _STATE_BYTES(self).items()}, "memory"),
}


@pytest.mark.parametrize("what", list(BREAKS))
def test_a_broken_piece_fails_the_verdict_on_every_rank(backend, monkeypatch, what):
    case = _breakable_case()
    skip_unless(case is not None and case.dp > 1 and case.pp > 1,
                f"needs a mesh with dp > 1 and pp > 1 (p = {P})")
    name, fake, check = BREAKS[what]
    if "." in name:
        cls, attr = name.split(".")
        monkeypatch.setattr(getattr(composed, cls), attr, fake)
    else:
        monkeypatch.setattr(composed, name, fake)
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    verdicts = WORLD.allgather((res.ok, tuple(r.failures), r.values_ok))
    parallel_assert(all(v == verdicts[0] for v in verdicts), f"ranks disagree: {verdicts}")
    caught = (not r.values_ok) if check == "values" else check in r.failures
    parallel_assert(not res.ok and caught, f"{what}: not caught by {check}: {_row(res)}")


@pytest.mark.parametrize("kind", ["nan", "inf", "perturb", "drop"])
def test_every_injected_fault_fails_a_mesh_on_every_rank(backend, kind):
    from summasim.harness.inject import Fault

    case = _breakable_case() or _compositions(P, 1)[0]
    res = run_mesh(case, WORLD, backend, timed=False, fault=Fault(kind, P - 1))
    r = res.extra["report"]
    verdicts = WORLD.allgather((res.ok, r.fault_applied, tuple(r.failures)))
    parallel_assert(all(v == verdicts[0] for v in verdicts), f"ranks disagree: {verdicts}")
    if not r.fault_applied:           # drop needs a reduction on that rank (dp or pp > 1)
        parallel_assert(kind == "drop" and case.dp == 1 and case.pp == 1, _row(res))
        return
    parallel_assert(not res.ok and not r.values_ok, f"{kind}@{P - 1} not caught: {_row(res)}")
    if kind in ("nan", "inf"):
        parallel_assert(r.nonfinite and math.isnan(r.grad_err), _row(res))
