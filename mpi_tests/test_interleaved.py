"""Interleaved 1F1B (V model chunks per stage) and uneven pipeline stages under MPI:
each composition that fits the world size trains against the serial model (loss, every
gradient and every parameter after each Adam step, the traffic closed forms, the
micro-batch chunks in flight, memory, replicas: summasim.harness.composed.run_mesh);
and one step's point-to-point trace is V hand-offs per micro-batch and direction, one
fewer at the pipeline's ends, each of one activation."""

from __future__ import annotations

import pytest

from _util import WORLD, mesh_row, parallel_assert, run_mesh_case, skip_unless
from summasim.grid import Mesh as GridMesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import mesh_inputs
from summasim.spec import Mesh
from summasim.transformer import composed, schedules
from summasim.transformer.model import Config
from summasim.transformer.schemes import get_scheme

P = WORLD.Get_size()


def _case(text, *, layers, m, zero=0, schedule="interleaved", chunks=2, stages=None,
          checkpoint=False, steps=2):
    """A mesh case on a model every piece divides (heads and vocab multiples of the
    tensor grid's side), two Adam steps unless told."""
    mesh = Mesh.parse(text)
    tp = mesh.tp
    unit = tp.p if tp.kind == "1d" else tp.q
    heads = 2 * unit
    config = Config(vocab=8 * unit, seq=4, hidden=4 * heads, heads=heads, layers=layers)
    batch = mesh.dp * m * (1 if tp.kind == "1d" else tp.d * tp.q)
    return MeshCase(mesh, batch, config, zero=zero, schedule=schedule, chunks=chunks,
                    stages=stages, microbatches=m, checkpoint=checkpoint, steps=steps)


CASES = {
    # 4 ranks: interleaved with a tensor grid; 0-layer virtual stages (the embedding
    # alone, the head alone, empty relays between) with checkpointing and ZeRO-3;
    # uneven 1F1B/GPipe stages, two of them holding no parameter at all
    "pp=2 megatron:2 interleaved:2": _case("pp=2,tp=megatron:2", layers=4, m=2),
    "pp=4 interleaved:2 stages=1,0,0,0,0,0,0,3 ckpt": _case(
        "pp=4", layers=4, m=4, stages=(1, 0, 0, 0, 0, 0, 0, 3), checkpoint=True),
    "dp=2 pp=2 interleaved:2 stages=0,2,1,1 zero3 ckpt": _case(
        "dp=2,pp=2", layers=4, m=2, zero=3, stages=(0, 2, 1, 1), checkpoint=True),
    "pp=4 1f1b stages=1,0,0,3": _case("pp=4", layers=4, m=2, schedule="1f1b", chunks=1,
                                      stages=(1, 0, 0, 3)),
    "dp=2 pp=2 gpipe stages=0,2 zero2": _case("dp=2,pp=2", layers=2, m=2, zero=2,
                                              schedule="gpipe", chunks=1, stages=(0, 2)),
    # 8 ranks
    "pp=2 optimus:2x2 interleaved:2": _case("pp=2,tp=optimus:2x2", layers=4, m=2),
    "dp=2 pp=2 megatron:2 interleaved:2 stages=2,0,0,2 zero1": _case(
        "dp=2,pp=2,tp=megatron:2", layers=4, m=2, zero=1, stages=(2, 0, 0, 2)),
    "dp=2 pp=2 megatron:2 interleaved:3 zero2": _case(
        "dp=2,pp=2,tp=megatron:2", layers=6, m=2, zero=2, chunks=3),
    # 9 ranks
    "pp=3 megatron:3 interleaved:2": _case("pp=3,tp=megatron:3", layers=6, m=3),
    # 16 ranks
    # (8 virtual stages of 16 ranks on a few cores: one step, the slowest case)
    "pp=4 optimus:2x2 interleaved:2 stages=1,0,1,0,0,1,0,1": _case(
        "pp=4,tp=optimus:2x2", layers=4, m=4, stages=(1, 0, 1, 0, 0, 1, 0, 1), steps=1),
    "pp=2 summa25:2x2x2 interleaved:2": _case("pp=2,tp=summa25:2x2x2", layers=4, m=2),
    "dp=2 pp=2 optimus:2x2 interleaved:2 zero3": _case("dp=2,pp=2,tp=optimus:2x2",
                                                       layers=4, m=2, zero=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_interleaved_and_uneven_stages_match_the_serial_model(backend, name):
    case = CASES[name]
    res = run_mesh_case(case, backend)
    r = res.extra["report"]
    parallel_assert(r.schedule == case.schedule_label and r.chunks == case.chunks
                    and r.stages == case.stages_label, mesh_row(res))
    # V chunks: the busiest stage holds more than the 1F1B min(pp, m) chunks in flight
    want = max(schedules.peak_inflight(case.schedule, case.microbatches, case.pp, s,
                                      case.chunks) for s in range(case.pp))
    parallel_assert(r.inflight == want, mesh_row(res))
    if case.pp > 1:
        parallel_assert(r.traffic["pp.fwd"] > 0 and r.traffic["pp.bwd"] > 0
                        and r.traffic["embed.tie"] > 0, mesh_row(res))
    if case.zero == 3 and case.dp > 1:
        parallel_assert(r.traffic["zero.gather"] > 0, mesh_row(res))


@pytest.mark.parametrize("zero", [0, 3])
def test_each_chunk_hands_each_micro_batch_on_once(zero, monkeypatch):
    """One step on ``dp=1|2, pp=P|P/2, V=2``: stage s sends m (V - [s = pp-1]) forward
    and m (V - [s = 0]) backward messages, each one micro-batch's activation, and
    receives as many; bytes per phase are Trainer.expected_traffic's. ZeRO-3 (dp = 2)
    gathers each of its units, per micro-batch, before every piece that reads it."""
    dp = 2 if zero == 3 else 1
    skip_unless(P % dp == 0 and P // dp >= 2, f"needs pp >= 2 with dp = {dp} (p = {P})")
    pp, V = P // dp, 2
    m = pp
    config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=2 * pp)
    stages = [2] + [1] * (2 * pp - 3) + [0, 1]        # uneven, one 0-layer chunk
    params, tokens, targets = mesh_inputs(config, dp * m, 0)
    gathers = []
    real = composed.ring_allgather_unchecked

    def counting(buf, comm):
        gathers.append(buf.size)
        return real(buf, comm)

    monkeypatch.setattr(composed, "ring_allgather_unchecked", counting)
    mesh = GridMesh(WORLD, dp, pp, "1d", t=1)
    try:
        tr = composed.Trainer(params, config, mesh, get_scheme("megatron"), zero=zero,
                              schedule="interleaved", chunks=V, stages=stages,
                              microbatches=m, bucket_bytes=1)
        mesh.trace.clear()
        tr.step(tokens, targets)
        s = mesh.s
        act = 1 * config.seq * config.hidden * 8                 # one sequence per micro
        got = {}
        for e in mesh.trace.events:
            top = e.phase.split("/")[0]
            if top in ("pp.fwd", "pp.bwd"):
                got.setdefault((top, e.op), []).append(e.nbytes)
        first, last = int(s == 0), int(s == pp - 1)
        want = {("pp.fwd", "send"): m * (V - last), ("pp.fwd", "recv"): m * (V - first),
                ("pp.bwd", "send"): m * (V - first), ("pp.bwd", "recv"): m * (V - last)}
        counts = {k: len(v) for k, v in got.items()}
        ok = counts == {k: n for k, n in want.items() if n} and all(
            n == act for v in got.values() for n in v)
        expected = tr.expected_traffic(dp * m, config.seq)
        sent = {ph: sum(e.nbytes for e in mesh.trace.events if e.op in ("send", "sendrecv")
                        and e.phase.split("/")[0] == ph) for ph in expected}
        ok &= sent == expected
        # ZeRO-3: per micro-batch, each layer's unit before its forward and its
        # backward, wte and wpe before the embedding, the head (and the tied wte)
        # before the head's forward and backward; nothing else is all-gathered
        uses = 2 * len(tr.layers) + (2 if tr.first else 0) + (4 if tr.last else 0)
        ok &= len(gathers) == (m * uses if zero == 3 else 0)
        parallel_assert(ok, f"stage {s}: counts {counts} (want {want}), sizes "
                            f"{ {k: sorted(set(v)) for k, v in got.items()} } (want {act}), "
                            f"bytes {sent} vs {expected}, {len(gathers)} all-gathers")
    finally:
        mesh.free()
