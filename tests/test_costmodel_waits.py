"""Two kinds of wait in the shared-core model: hops completed by summasim's wait
policy (polled) and hops waited for inside a blocking MPI call (``MPI_Sendrecv``),
from the trace's ``blocking`` flag through the features, the fit and the machine file."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import matmul_result, synthetic_machine
from summasim.costmodel.tools import accuracy as A
from summasim.costmodel.machine import Machine, SharedCore
from summasim.costmodel.machine.regression import fit_shared_core
from summasim.costmodel.workload.measured import EventCount, MeasuredRun
from summasim.costmodel.workload.predict import (SharedFeatures, merge_features, predict_features,
                                                 predict_trace, trace_features)
from summasim.costmodel.workload.pricer import Messages, summary_messages
from summasim.costmodel.workload.traffic import algorithm_messages
from summasim.trace import Event, Trace


_machine = synthetic_machine


def _ring_events(p, N, r, blocking):
    return [Event("sendrecv", "ring", p, -1, mc.nbytes, 0.0, "", blocking)
            for mc in algorithm_messages("ring_allreduce", count=N, p=p, coords=r, itemsize=8)
            for _ in range(mc.count)]


# ----------------------------------------------------------------------------- the ledger
def test_trace_records_which_wait_a_call_took():
    t = Trace()
    t.record("sendrecv", "ring", 4, -1, 800, 1e-5, blocking=True)
    t.record("sendrecv", "ring", 4, -1, 800, 1e-5)
    assert [e.blocking for e in t.events] == [True, False]
    assert Event("bcast", "row", 4, 0, 8, 0.0, "").blocking is False   # 7 fields still build


def test_event_summary_keeps_the_flag_and_old_summaries_read_as_polled():
    ev = [Event("sendrecv", "ring", 4, -1, 800, 0.0, "", True)] * 3 \
        + [Event("sendrecv", "ring", 4, -1, 800, 0.0, "", False)]
    summary = A.event_summary(ev)
    assert summary == [["sendrecv", "ring", 4, 800, 1, False], ["sendrecv", "ring", 4, 800, 3, True]]
    msgs = summary_messages(summary + [["bcast", "row", 4, 64, 2]])
    assert msgs[1] == Messages("sendrecv", "ring", 4, 800, 3, True)
    assert msgs[2] == Messages("bcast", "row", 4, 64, 2, False)


# ----------------------------------------------------------------------------- features
def test_blocking_events_count_as_mpi_hops_and_nothing_else_changes():
    m = _machine(shared_core=SharedCore(1.2, 80e-6, 1e-10, 1e-4))
    polled = trace_features(_ring_events(8, 1 << 16, 0, False), m, p=8,
                            reduce_bytes=7 / 8 * (1 << 19))
    blocked = trace_features(_ring_events(8, 1 << 16, 0, True), m, p=8,
                             reduce_bytes=7 / 8 * (1 << 19))
    assert polled.hops == 14 and polled.mpi_hops == 0
    assert blocked.hops == 0 and blocked.mpi_hops == 14
    # the bytes move with their hops: 14 steps of one 8 KiB chunk (2^16 items / 8 ranks)
    assert polled.hop_bytes == blocked.mpi_hop_bytes == 14 * (1 << 16) // 8 * 8
    assert polled.mpi_hop_bytes == blocked.hop_bytes == 0
    assert (blocked.work, blocked.dedicated, blocked.calls) == \
        (polled.work, polled.dedicated, polled.calls)
    # the same counts from a summary (count x identical messages) as from the events
    summary = summary_messages(A.event_summary(_ring_events(8, 1 << 16, 0, True)))
    got = trace_features(summary, m, p=8, reduce_bytes=7 / 8 * (1 << 19))
    assert (got.hops, got.mpi_hops, got.hop_bytes, got.mpi_hop_bytes) == \
        (0, 14, 0, blocked.mpi_hop_bytes)
    assert got.work == pytest.approx(blocked.work, rel=1e-12)
    merged = merge_features([polled, blocked])
    assert (merged.mpi_hops, merged.mpi_hop_bytes) == (14, blocked.mpi_hop_bytes)
    # the charged work (work less the exchanger copies) is the largest rank's, not the
    # largest work less the largest copies of another rank
    a = SharedFeatures(work=10.0, hops=0, hop_bytes=0, dedicated=0, mpi_copy=0.0)
    b = SharedFeatures(work=5.0, hops=0, hop_bytes=0, dedicated=0, mpi_copy=5.0)
    m2 = merge_features([a, b])
    assert (m2.work, m2.work - m2.mpi_copy) == (10.0, 10.0)
    assert merge_features([b]).mpi_copy == 5.0


def test_a_machine_without_the_distinction_prices_both_waits_alike():
    old = _machine(shared_core=SharedCore(1.2, 80e-6, 1e-10, 1e-4))
    for p in (4, 16):
        ev_b, ev_p = _ring_events(p, 1 << 14, 1, True), _ring_events(p, 1 << 14, 1, False)
        assert predict_trace(ev_b, old, p=p).seconds == predict_trace(ev_p, old, p=p).seconds
        fb = [trace_features(ev_b, old, p=p)]
        fp = [trace_features(ev_p, old, p=p)]
        assert predict_features(fb, old, p) == predict_features(fp, old, p)


def test_mpi_hop_seconds_prices_the_blocking_hops():
    sc = SharedCore(1.2, 80e-6, 1e-10, 1e-4, mpi_hop_seconds=10e-6)
    m = _machine(shared_core=sc)
    f = SharedFeatures(work=0.01, hops=6, hop_bytes=1e6, dedicated=0.0, mpi_hops=30)
    R = 16 / 2
    assert predict_features([f], m, 16) == pytest.approx(
        R * (1.2 * 0.01 + 80e-6 * 6 + 10e-6 * 30 + 1e-10 * 1e6 + 1e-4))
    ev = _ring_events(16, 1 << 14, 3, True)
    fast = predict_trace(ev, m, p=16)
    slow = predict_trace(ev, m.replace(shared_core=SharedCore(1.2, 80e-6, 1e-10, 1e-4)), p=16)
    assert slow.seconds - fast.seconds == pytest.approx(R * 30 * (80e-6 - 10e-6))
    assert sum(fast.by_op.values()) + R * 1e-4 == pytest.approx(    # + the sync term
        fast.seconds - fast.compute_seconds)


def test_mpi_hop_seconds_per_byte_prices_the_blocking_bytes_alone():
    sc = SharedCore(1.2, 80e-6, 1e-10, 1e-4, mpi_hop_seconds=10e-6,
                    mpi_hop_seconds_per_byte=4e-10)
    m = _machine(shared_core=sc)
    f = SharedFeatures(work=0.01, hops=6, hop_bytes=1e6, dedicated=0.0, mpi_hops=30,
                       mpi_hop_bytes=3e6)
    R = 16 / 2
    assert predict_features([f], m, 16) == pytest.approx(
        R * (1.2 * 0.01 + 80e-6 * 6 + 10e-6 * 30 + 1e-10 * 1e6 + 4e-10 * 3e6 + 1e-4))
    # a ring of exchanger steps: its bytes priced at the blocking price, not the polled one
    ev = _ring_events(16, 1 << 16, 3, True)
    both = predict_trace(ev, m, p=16)
    one = predict_trace(ev, m.replace(shared_core=SharedCore(
        1.2, 80e-6, 1e-10, 1e-4, mpi_hop_seconds=10e-6)), p=16)
    f16 = trace_features(ev, m, p=16)
    nbytes = f16.mpi_hop_bytes
    assert nbytes == 30 * (1 << 16) // 16 * 8
    # ... and its copies leave the work term: the byte price covers them
    assert f16.mpi_copy > 0 and f16.mpi_copy == pytest.approx(f16.work)   # no additions given
    assert both.seconds - one.seconds == pytest.approx(
        R * (nbytes * (4e-10 - 1e-10) - 1.2 * f16.mpi_copy))
    assert sum(both.by_op.values()) + R * 1e-4 == pytest.approx(
        both.seconds - both.compute_seconds)
    # polled steps do not see it
    ev_p = _ring_events(16, 1 << 16, 3, False)
    assert predict_trace(ev_p, m, p=16).seconds == predict_trace(
        ev_p, m.replace(shared_core=SharedCore(1.2, 80e-6, 1e-10, 1e-4, 10e-6)), p=16).seconds
    assert SharedCore(1.0, 7e-5, 2e-10).blocking_seconds_per_byte == 2e-10
    assert SharedCore(1.0, 7e-5, 2e-10, mpi_hop_seconds_per_byte=0.0) \
        .blocking_seconds_per_byte == 0.0


# ----------------------------------------------------------------------------- the fit
def test_fit_shared_core_tells_the_two_waits_apart():
    true = SharedCore(work_factor=1.1, hop_seconds=70e-6, hop_seconds_per_byte=1.5e-10,
                      sync_seconds=3e-4, mpi_hop_seconds=15e-6,
                      mpi_hop_seconds_per_byte=4e-10)
    rng = np.random.default_rng(2)
    samples = []
    for k in range(16):
        blocking = k % 2 == 0
        hops, nbytes = rng.uniform(4, 200), rng.uniform(1e4, 5e7)
        f = SharedFeatures(work=rng.uniform(1e-3, 0.2), hops=0.0 if blocking else hops,
                           hop_bytes=rng.uniform(0, 1e5) if blocking else nbytes,
                           dedicated=0.0, mpi_hops=hops if blocking else rng.uniform(0, 3),
                           mpi_hop_bytes=nbytes if blocking else rng.uniform(0, 1e5))
        R = rng.choice([1.5, 2.0, 4.0])
        t = R * (true.work_factor * f.work + true.hop_seconds * f.hops
                 + true.mpi_hop_seconds * f.mpi_hops
                 + true.hop_seconds_per_byte * f.hop_bytes
                 + true.mpi_hop_seconds_per_byte * f.mpi_hop_bytes + true.sync_seconds)
        samples.append((R, f, t))
    got, err = fit_shared_core(samples)
    for name in SharedCore._FIELDS + SharedCore._OPTIONAL:
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-3), name
    assert err < 1e-6
    # without a single blocking hop neither blocking coefficient is identifiable: None
    polled = [(R, SharedFeatures(f.work, f.hops + f.mpi_hops, f.hop_bytes + f.mpi_hop_bytes,
                                 0.0), t) for R, f, t in samples]
    sc = fit_shared_core(polled)[0]
    assert sc.mpi_hop_seconds is None and sc.mpi_hop_seconds_per_byte is None
    # blocking hops that carry no bytes: their count is fitted, their byte price is not
    counted = [(R, SharedFeatures(f.work, f.hops, f.hop_bytes + f.mpi_hop_bytes, 0.0,
                                  mpi_hops=f.mpi_hops), t) for R, f, t in samples]
    sc = fit_shared_core(counted)[0]
    assert sc.mpi_hop_seconds is not None and sc.mpi_hop_seconds_per_byte is None
    with pytest.raises(ValueError, match="at least 6 runs"):
        fit_shared_core(samples[:5])


# ----------------------------------------------------------------------------- machine file
def test_shared_core_file_round_trips_with_and_without_the_mpi_hop_term(tmp_path):
    for sc in (SharedCore(1.0, 7e-5, 1e-10, 3e-4), SharedCore(1.0, 7e-5, 1e-10, 3e-4, 2e-5),
               SharedCore(1.0, 7e-5, 1e-10, 3e-4, 2e-5, 3e-10)):
        m = _machine(shared_core=sc)
        m.save(tmp_path / "m.json")
        assert Machine.load(tmp_path / "m.json").shared_core == sc
        d = json.loads((tmp_path / "m.json").read_text())["shared_core"]
        assert ("mpi_hop_seconds" in d) == (sc.mpi_hop_seconds is not None)
        assert ("mpi_hop_seconds_per_byte" in d) == (sc.mpi_hop_seconds_per_byte is not None)
    assert SharedCore(1.0, 7e-5).blocking_hop_seconds == 7e-5
    assert SharedCore(1.0, 7e-5, mpi_hop_seconds=0.0).blocking_hop_seconds == 0.0
    with pytest.raises(ValueError, match="shared_core.mpi_hop_seconds"):
        SharedCore.from_dict({"work_factor": 1, "hop_seconds": 0, "hop_seconds_per_byte": 0,
                              "sync_seconds": 0, "mpi_hop_seconds": -1.0})
    with pytest.raises(ValueError, match="unknown machine field"):
        SharedCore.from_dict({"work_factor": 1, "hop_seconds": 0, "hop_seconds_per_byte": 0,
                              "sync_seconds": 0, "blocking_seconds": 1.0})


# ----------------------------------------------------------------------------- analysis
def _ring_result(p, N, blocking, measured=(1.0,)):
    events = tuple(tuple(EventCount(mc.op, "world", mc.group_size, mc.nbytes, mc.count, blocking)
                         for mc in algorithm_messages("ring_allreduce", count=N, p=p, coords=r,
                                                      itemsize=8)) for r in range(p))
    return MeasuredRun(kind="ring", p=p, dtype="float64", algorithm="ring_allreduce", N=N,
                       spans=tuple(measured), events=events, coords=tuple((r,) for r in range(p)))


def test_calibration_recovers_both_wait_terms_and_predicts_held_out_rings():
    truth = _machine(shared_core=SharedCore(1.05, 90e-6, 1.2e-10, 2.5e-4,
                                            mpi_hop_seconds=20e-6,
                                            mpi_hop_seconds_per_byte=3e-10))
    naive = truth.replace(shared_core=None)
    cal, held = [], []
    for p in (3, 4):
        for N in (1 << 10, 1 << 12, 1 << 17, 1 << 19):
            cal.append(_ring_result(p, N, True))
        for N in (1 << 21, 1 << 22, 1 << 23):
            cal.append(_ring_result(p, N, False))
    # products: CPU work that is not proportional to their messages (else the work
    # factor and the byte prices could trade off on rings alone)
    cal += [matmul_result("summa_ab", 2, n, 4, (1.0,)) for n in (256, 512, 1024)]
    held = [_ring_result(16, 1 << 16, True), _ring_result(16, 1 << 20, True),
            _ring_result(8, 1 << 24, False)]
    def timed(res):
        t = A.predict_result(res, truth)
        return dataclasses.replace(res, spans=(t * 0.97, t, t * 1.04))

    cal, held = [timed(r) for r in cal], [timed(r) for r in held]
    rep, calibrated = A.analyse({"calibrate": cal, "heldout": held}, naive)
    assert calibrated.shared_core.mpi_hop_seconds == pytest.approx(20e-6, rel=0.05)
    assert calibrated.shared_core.hop_seconds == pytest.approx(90e-6, rel=0.05)
    assert calibrated.shared_core.mpi_hop_seconds_per_byte == pytest.approx(3e-10, rel=0.05)
    assert rep["heldout"]["summary"]["worst"] < 0.01
