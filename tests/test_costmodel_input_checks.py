"""The cost model's public primitives refuse sizes that are not finite numbers >= 0 and
counts that are not whole numbers, with a ValueError naming the argument: never a NaN,
an infinity, a time for 2.5 ranks or an arithmetic error from deep inside a formula."""

from __future__ import annotations

import math

import pytest

from summasim.costmodel import TransformerConfig, load_machine
from summasim.costmodel._checks import finite_size, whole
from summasim.costmodel.collectives.nccl import nccl_time
from summasim.costmodel.collectives.select import collective_time
from summasim.costmodel.machine.topology import GroupPath
from summasim.costmodel.workload.composition import price_composition
from summasim.costmodel.workload.pipeline import pipeline_time
from summasim.costmodel.workload.predict import predict_algorithm

LOCAL = load_machine("local-2core-mpich")
GPU = load_machine("dgx-a100")
PATH = GroupPath(size=8, nodes=1, per_node=8, bus_bandwidth=200e9, intra_kind="nvswitch",
                 bottleneck="intra")
CFG = TransformerConfig(b=8, s=64, h=64, n=4, N=2, v=64)
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("value", [NAN, INF, -INF, -1, -1e-9, "8", None, True, 10 ** 400,
                                   -(10 ** 400)])
def test_finite_size_refuses(value):
    with pytest.raises(ValueError, match="nbytes must be a finite number >= 0"):
        finite_size("nbytes", value)


def test_finite_size_and_whole_take_what_they_should():
    assert finite_size("x", 0) == 0.0 and finite_size("x", 2.5) == 2.5
    with pytest.raises(ValueError, match="> 0"):
        finite_size("x", 0, positive=True)
    assert whole("p", 4) == 4 and whole("p", 4.0) == 4 and type(whole("p", 4.0)) is int
    import numpy as np                                   # NumPy scalars and 0-d arrays
    assert finite_size("x", np.array(10.0)) == 10.0 and finite_size("x", np.float32(2)) == 2
    assert whole("p", np.array(4)) == 4 and whole("p", np.int64(4)) == 4
    assert collective_time("bcast", np.array(1024.0), np.int64(4), LOCAL) == \
        collective_time("bcast", 1024, 4, LOCAL)
    for bad in (2.5, 0, NAN, INF, True, "4", None):
        with pytest.raises(ValueError, match="p must be a whole number >= 1"):
            whole("p", bad)


@pytest.mark.parametrize("call,needle", [
    (lambda: collective_time("allreduce", NAN, 4, LOCAL), "allreduce: nbytes"),
    (lambda: collective_time("bcast", INF, 4, LOCAL), "bcast: nbytes"),
    (lambda: collective_time("bcast", -8, 4, LOCAL), "bcast: nbytes"),
    (lambda: collective_time("bcast", 10, 2.5, LOCAL), "bcast: p"),
    (lambda: collective_time("allreduce", 10, 0, LOCAL), "allreduce: p"),
    (lambda: nccl_time("allreduce", -1, PATH), "allreduce: nbytes"),
    (lambda: nccl_time("sendrecv", NAN, PATH), "sendrecv: nbytes"),
    (lambda: nccl_time("allreduce", INF, PATH), "allreduce: nbytes"),
    (lambda: predict_algorithm("summa_ab", NAN, 8, 8, 2, machine=LOCAL, strict=False),
     "summa_ab: m"),
    (lambda: predict_algorithm("summa_ab", 8, 8, INF, 2, machine=LOCAL, strict=False),
     "summa_ab: n"),
    (lambda: predict_algorithm("summa_ab", 8, 8, 8, 0, machine=LOCAL), "summa_ab: q"),
    (lambda: predict_algorithm("ring_allreduce", count=10, p=0, machine=LOCAL),
     "ring_allreduce: p"),
    (lambda: predict_algorithm("ring_allreduce", count=NAN, p=4, machine=LOCAL),
     "ring_allreduce: count"),
    (lambda: pipeline_time([-1, 1], [1, 1], 4), r"forward\[0\]"),
    (lambda: pipeline_time([1, 1], [1, NAN], 4), r"backward\[1\]"),
    (lambda: pipeline_time([1, 1], [1, 1], 0), "m .micro-batches."),
    (lambda: price_composition(CFG, "megatron", machine=GPU, t=2, bucket_bytes=0),
     "bucket_bytes"),
    (lambda: price_composition(CFG, "megatron", machine=GPU, t=2, bucket_bytes=NAN),
     "bucket_bytes"),
    (lambda: price_composition(CFG, "megatron", machine=GPU, t=2, dp=2, devices=4,
                               bucket_bytes=INF), "bucket_bytes"),
])
def test_primitives_refuse_bad_sizes(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_the_same_primitives_still_price_good_input():
    """Integral floats are counts; real-valued sizes stay allowed where scaling studies
    use them (``strict=False``)."""
    assert collective_time("bcast", 10, 4.0, LOCAL) == collective_time("bcast", 10, 4, LOCAL)
    assert collective_time("bcast", 0, 4, LOCAL).seconds >= 0
    assert math.isfinite(nccl_time("allreduce", 0, PATH).seconds)
    assert math.isfinite(predict_algorithm("summa_ab", 100.5, 64.0, 80.25, 2, machine=LOCAL,
                                           strict=False).seconds)
    assert pipeline_time([1, 2], [2, 4], 3) == ((3 - 1) * 6 + 9, 1)
    assert price_composition(CFG, "megatron", machine=GPU, t=2, bucket_bytes=1)["step_seconds"] > 0
