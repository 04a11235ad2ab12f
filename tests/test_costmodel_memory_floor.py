"""The memory floor: a machine with ``memory_bandwidth`` never predicts less than the
time its node's memory needs to stream the bytes its ranks' copies and additions move
(``Machine.memory_floor``; the stream counts in :mod:`summasim.costmodel.workload.predict`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from summasim.comm import BLOCKING_SENDRECV_BYTES
from summasim.costmodel.tools.accuracy import predict_result
from summasim.costmodel.tools.bench import ring_prediction
from summasim.costmodel.machine import Machine, load_preset
from summasim.costmodel.workload.measured import MeasuredRun
from summasim.costmodel.workload.predict import predict_algorithm, predict_trace
from summasim.costmodel.workload.pricer import ADD_OUT_STREAMS, ADD_STREAMS, COPY_STREAMS
from summasim.costmodel.workload.traffic import algorithm_messages
from summasim.harness.cases import RingCase

LOCAL = load_preset("local-2core-mpich")
MiB = 1 << 20
SLOW = 1e6           # bytes/s: a memory so slow that the floor sets every large time


def _ring_bytes(nbytes, p):
    """Per rank: bytes copied in and bytes added by a ring all-reduce of ``nbytes``."""
    f = (p - 1) / p
    return 2 * f * nbytes, f * nbytes


@pytest.mark.parametrize("field", ["memory_bandwidth", "cache_bytes"])
def test_the_fields_round_trip_are_optional_and_checked(field):
    m = LOCAL.replace(**{field: 4.2e10})
    assert Machine.from_dict(m.to_dict()) == m
    assert field not in LOCAL.to_dict()                        # old files stay as they were
    assert getattr(Machine.from_dict(LOCAL.to_dict()), field) is None
    for bad in (0, -1.0, math.nan, math.inf, "fast", True):
        with pytest.raises(ValueError, match=field):
            Machine.from_dict({**LOCAL.to_dict(), field: bad})
        with pytest.raises(ValueError, match=field):
            LOCAL.replace(**{field: bad})


def test_the_floor_is_the_node_s_streams_over_its_bandwidth_unless_its_data_is_cached():
    m = LOCAL.replace(memory_bandwidth=2.0e10)
    assert m.memory_floor(16, 3e8) == pytest.approx(16 * 3e8 / 2.0e10)
    assert m.memory_floor(16, 0.0) == 0.0 and LOCAL.memory_floor(16, 3e8) == 0.0
    cached = m.replace(cache_bytes=32 * MiB)
    assert cached.memory_floor(16, 3e8, 2 * MiB) == 0.0          # 16 x 2 MiB fit in 32 MiB
    assert cached.memory_floor(16, 3e8, 2 * MiB + 1) == pytest.approx(16 * 3e8 / 2.0e10)
    assert cached.memory_floor(16, 3e8) == pytest.approx(16 * 3e8 / 2.0e10)   # unknown


@pytest.mark.parametrize("p", [2, 4, 16])
def test_a_closed_form_ring_on_a_slow_memory_is_priced_at_its_streams(p):
    """``ring_allreduce(x, comm)`` writes a new output: 3 streams per byte copied, 4 per
    byte added; its in-place half ``ring_reduce_scatter`` 3 per byte added."""
    n = 16 * MiB // 8
    copied, added = _ring_bytes(n * 8, p)
    half = predict_algorithm("ring_reduce_scatter", count=n, p=p,
                             machine=LOCAL.replace(memory_bandwidth=SLOW))
    assert half.seconds == pytest.approx(p * 3 * (copied / 2 + added) / SLOW, rel=1e-9)
    want = p * (COPY_STREAMS * copied + ADD_OUT_STREAMS * added) / SLOW
    got = predict_algorithm("ring_allreduce", count=n, p=p,
                            machine=LOCAL.replace(memory_bandwidth=SLOW))
    assert got.seconds == pytest.approx(want, rel=1e-9)
    assert got.breakdown["memory_floor_seconds"] == pytest.approx(want, rel=1e-9)
    # a fast memory leaves the prediction as it was without one
    fast = predict_algorithm("ring_allreduce", count=n, p=p,
                             machine=LOCAL.replace(memory_bandwidth=1e15))
    plain = predict_algorithm("ring_allreduce", count=n, p=p, machine=LOCAL)
    assert fast.seconds == plain.seconds and "memory_floor_seconds" not in plain.breakdown


def test_a_measured_ring_is_priced_out_of_place_and_a_trace_like_the_closed_form():
    """The harness and the bench time the ring out of place: each add writes ``out``,
    4 streams per added byte; a recorded trace with its adds counts 3 (in place)."""
    p, n = 8, 8 * MiB // 8
    copied, added = _ring_bytes(n * 8, p)
    m = LOCAL.replace(memory_bandwidth=SLOW)
    events = [[[mc.op, "world", mc.group_size, mc.nbytes, mc.count, True]
               for mc in algorithm_messages("ring_allreduce", count=n, p=p, coords=r,
                                            itemsize=8)] for r in range(p)]
    res = MeasuredRun.from_dict(dict(RingCase(n).to_dict(), p=p, events=events,
                                     coords=[[r] for r in range(p)]))
    want = p * (COPY_STREAMS * copied + ADD_OUT_STREAMS * added) / SLOW
    assert predict_result(res, m) == pytest.approx(want, rel=1e-9)
    assert ring_prediction(n, np.float64, p, m, BLOCKING_SENDRECV_BYTES) == \
        pytest.approx(want, rel=1e-9)
    msgs = algorithm_messages("ring_allreduce", count=n, p=p, coords=0, itemsize=8)
    got = predict_trace(msgs, m, p=p, reduce_bytes=added)
    assert got.seconds == pytest.approx(p * (COPY_STREAMS * copied + ADD_STREAMS * added)
                                        / SLOW, rel=1e-9)


def test_the_floor_binds_where_the_streams_outgrow_the_model_and_not_below():
    """On this VM's numbers (a 64 MiB ring at p = 16, out of place, 40 GiB/s) the floor
    is what sets the time, and at 1 MiB it is far below the shared-core model."""
    m = LOCAL.replace(memory_bandwidth=40 * 2**30, cache_bytes=32 * MiB)
    big = ring_prediction(64 * MiB // 8, np.float64, 16, m, BLOCKING_SENDRECV_BYTES)
    streams = 16 * 10 * 15 / 16 * 64 * MiB          # 9.4 GiB: 10 streams per chunk byte
    assert big == pytest.approx(streams / (40 * 2**30), rel=1e-9)
    assert big > ring_prediction(64 * MiB // 8, np.float64, 16, LOCAL, BLOCKING_SENDRECV_BYTES)
    small = [ring_prediction(MiB // 8, np.float64, 16, mm, BLOCKING_SENDRECV_BYTES)
             for mm in (m, LOCAL)]
    assert small[0] == small[1]


def test_gpu_collectives_do_not_stream_host_memory():
    """An NCCL machine's messages and additions stay on the devices: no floor, whatever
    its host's memory."""
    gpu = load_preset("h100-dgx-ndr")
    base = predict_algorithm("ring_allreduce", count=64 * MiB, p=8, machine=gpu)
    got = predict_algorithm("ring_allreduce", count=64 * MiB, p=8,
                            machine=gpu.replace(memory_bandwidth=SLOW))
    assert got.seconds == base.seconds
    assert gpu.replace(memory_bandwidth=SLOW).memory_floor(8, 1e9) == 0.0


def test_a_ring_whose_data_fits_the_cache_has_no_floor():
    """x, out and a receive chunk of every rank against the node's cache: at p = 4 a
    4 MiB ring (4 x 9 MiB) outgrows 32 MiB and 3 MiB (4 x 6.75 MiB) does not; the
    in-place half ``ring_reduce_scatter`` (x and a chunk) fits at 4 MiB."""
    m = LOCAL.replace(memory_bandwidth=SLOW, cache_bytes=32 * MiB)
    limit = BLOCKING_SENDRECV_BYTES
    assert ring_prediction(3 * MiB // 8, np.float64, 4, m, limit) == \
        ring_prediction(3 * MiB // 8, np.float64, 4, LOCAL, limit)
    n = 4 * MiB // 8
    copied, added = _ring_bytes(n * 8, 4)
    assert ring_prediction(n, np.float64, 4, m, limit) == pytest.approx(
        4 * (COPY_STREAMS * copied + ADD_OUT_STREAMS * added) / SLOW, rel=1e-9)
    closed = predict_algorithm("ring_reduce_scatter", count=n, p=4, machine=m)
    assert closed.seconds == predict_algorithm("ring_reduce_scatter", count=n, p=4,
                                               machine=LOCAL).seconds
    assert closed.breakdown["memory_floor_seconds"] == 0.0
    whole = predict_algorithm("ring_allreduce", count=n, p=4, machine=m)
    assert whole.breakdown["memory_floor_seconds"] > 0 and \
        whole.breakdown["memory_floor_excess_seconds"] > 0


def test_the_node_s_cache_is_read_from_sysfs(tmp_path):
    """The highest level's data or unified caches, each instance once."""
    from summasim.harness.fitbench import node_cache_bytes

    def cache(cpu, index, level, kind, size, shared):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size),
                           ("shared_cpu_list", shared)):
            (d / name).write_text(f"{text}\n")

    assert node_cache_bytes(str(tmp_path)) is None
    for cpu in range(4):                       # two L3 instances of 16 MiB, private L2
        cache(cpu, 0, 1, "Data", "32K", str(cpu))
        cache(cpu, 1, 1, "Instruction", "32K", str(cpu))
        cache(cpu, 2, 2, "Unified", "1024K", str(cpu))
        cache(cpu, 3, 3, "Unified", "16384K", "0-1" if cpu < 2 else "2-3")
    assert node_cache_bytes(str(tmp_path)) == 32 * MiB
    assert node_cache_bytes(str(tmp_path), cpus={0, 1}) == 16 * MiB    # a cpuset's share
    assert node_cache_bytes(str(tmp_path), cpus={1, 2}) == 32 * MiB


def test_a_message_streams_once_and_the_node_sums_its_ranks():
    """A point-to-point message is one copy, counted at its receiver; the node's
    streams are its ranks' mean times ranks per node, not the busiest rank's."""
    from summasim.costmodel.workload.predict import SharedFeatures, predict_features
    from summasim.costmodel.workload.traffic import MessageClass

    m = LOCAL.replace(memory_bandwidth=SLOW)
    B = 8 * MiB
    send = predict_trace([MessageClass("send", "pipe", 2, B, 1)], m, p=2)
    recv = predict_trace([MessageClass("recv", "pipe", 2, B, 1)], m, p=2)
    assert send.breakdown["memory_floor_seconds"] == 0.0
    assert recv.breakdown["memory_floor_seconds"] == pytest.approx(2 * 3 * B / SLOW)
    feats = [SharedFeatures(0.0, 0, 0, 0.0, memory_traffic=t) for t in (4e6, 0.0, 0.0, 0.0)]
    assert predict_features(feats, m, 4) == pytest.approx(4e6 / SLOW)


def test_paper_mode_and_training_steps():
    """The papers' formulas stay as published (no floor); a training step's breakdown
    keeps the floor it was raised to."""
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
    from summasim.costmodel.workload.step import step_cost

    m = LOCAL.replace(memory_bandwidth=SLOW)
    n = 16 * MiB // 8
    paper = predict_algorithm("ring_allreduce", count=n, p=4, machine=m, mode="paper")
    assert paper.seconds == predict_algorithm("ring_allreduce", count=n, p=4, machine=LOCAL,
                                              mode="paper").seconds
    assert "memory_floor_seconds" not in paper.breakdown
    cfg = TransformerConfig(b=8, s=64, h=256, n=8, N=2, v=512, dtype="float64")
    step = step_cost(Scheme.make("megatron", p=4), cfg, m)
    b = step.breakdown
    assert b["memory_floor_excess_seconds"] > 0 and step.seconds == pytest.approx(
        b["memory_floor_seconds"])
