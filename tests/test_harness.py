"""The harness's pure parts: rank-local data, rank-local checks, fault injection,
memory estimates, cases (serial: grid positions are given as GridNumbers)."""

from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from summasim.algorithms.table import ALGORITHMS, PRODUCTS
from summasim.harness import memory
from summasim.harness.cases import (MatmulCase, MeshCase, RingCase, case_from_dict,
                                   transformer_case)
from summasim.harness.check import check_product, check_ring, op_panels, \
    product_block_slices, ring_input
from summasim.harness.data import STREAM_A, STREAM_B, uniform_block, uniform_segment
from summasim.harness.inject import KINDS, Fault, corrupt_entry
from summasim.layout import GridNumbers, block_slices


@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 40), C=st.integers(1, 40), data=st.data(),
       dtype=st.sampled_from([np.float64, np.float32]),
       path=st.sampled_from(["default", "row by row", "narrow in chunks"]))
def test_any_block_equals_the_slice_of_the_global_matrix(R, C, data, dtype, path):
    from summasim.harness import data as mod

    r0 = data.draw(st.integers(0, R - 1))
    r1 = data.draw(st.integers(r0 + 1, R))
    c0 = data.draw(st.integers(0, C - 1))
    c1 = data.draw(st.integers(c0 + 1, C))
    whole = uniform_segment(5, 3, 0, R * C).reshape(R, C).astype(dtype)
    # each way of drawing a block: the narrow rows whole (in chunks of a few rows), or
    # segment by segment with a jump between rows
    saved = mod.NARROW_ROWS, mod.NARROW_ITEMS, mod.CHUNK_ITEMS
    mod.NARROW_ROWS, mod.NARROW_ITEMS, mod.CHUNK_ITEMS = {
        "default": saved, "row by row": (0, 0, saved[2]),
        "narrow in chunks": (10 ** 9, 0, 3 * C)}[path]
    try:
        block = uniform_block(5, 3, (R, C), slice(r0, r1), slice(c0, c1), dtype)
    finally:
        mod.NARROW_ROWS, mod.NARROW_ITEMS, mod.CHUNK_ITEMS = saved
    assert block.dtype == dtype and block.flags.c_contiguous
    assert np.array_equal(block, whole[r0:r1, c0:c1])
    assert block.min() >= -1 and block.max() < 1


def test_streams_differ_and_segments_start_anywhere():
    whole = uniform_segment(3, 7, 0, 50)
    assert np.array_equal(uniform_segment(3, 7, 20, 30), whole[20:])
    assert not np.array_equal(uniform_segment(3, 8, 0, 50), whole)


def _rank_output(case, g, seed=0):
    """This rank's C block computed directly from its panels (what a correct
    distributed product returns), rounded to the case's dtype."""
    rows, cols = product_block_slices(case, g)
    a, b = op_panels(case.spec, case.m, case.k, case.n, rows, cols, slice(0, case.k), seed,
                     np.dtype(case.dtype))
    return (a @ b).astype(case.dtype)


def _positions(q, d):
    return [GridNumbers(q=q, d=d, p=d * q * q, i=i, j=j, k=k)
            for k in range(d) for i in range(q) for j in range(q)]


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("method", ["exact", "freivalds"])
def test_check_passes_right_blocks_and_fails_corrupted_ones(name, method):
    q, d = (2, 2) if ALGORITHMS[name].kind == "2.5d" else (2, 1)
    m, k, n = ALGORITHMS[name].round_up(20, 12, 16, q, d)
    for dtype in ("float64", "float32"):
        case = MatmulCase(name, q, d, m, k, n, dtype)
        for g in _positions(q, d)[:3]:
            c = _rank_output(case, g)
            assert check_product(c, case, g, 0, method).ok
            for kind in ("nan", "inf", "perturb"):     # perturb: 1e-6, or 1e-2 in float32
                bad = c.copy()
                corrupt_entry(bad, kind)
                chk = check_product(bad, case, g, 0, method)
                assert not chk.ok, (kind, dtype)
                assert chk.nonfinite == (kind != "perturb")
            # a block computed from another seed (wrong data) fails too
            assert not check_product(_rank_output(case, g, seed=1), case, g, 0, method).ok
            # a block of the wrong shape fails as FAIL, not as a NaN or an Inf (FAIL*)
            chk = check_product(c[:-1], case, g, 0, method)
            assert not chk.ok and not chk.nonfinite and chk.method == "shape"


def test_nan_in_a_block_whose_neighbours_are_fine_is_caught_by_both_methods():
    case = MatmulCase("summa_ab", 2, 1, 64, 64, 64)
    g = _positions(2, 1)[3]
    c = _rank_output(case, g)
    c[5, 7] = np.nan
    for method in ("exact", "freivalds"):
        chk = check_product(c, case, g, 0, method)
        assert not chk.ok and chk.nonfinite and math.isnan(chk.error)


def test_ring_check():
    p, n = 3, 101
    case = RingCase(n)
    y = sum(ring_input(0, r, n, np.float64) for r in range(p))
    assert check_ring(y, case, p, 0).ok
    assert check_ring(y, case, p, 0, chunk=7).ok
    bad = y.copy()
    bad[-1] = np.nan                       # outside any one rank's chunk: still caught
    assert not check_ring(bad, case, p, 0).ok
    assert not check_ring(y - ring_input(0, 1, n, np.float64), case, p, 0).ok
    short = check_ring(y[:-1], case, p, 0)
    assert not short.ok and not short.nonfinite and short.method == "shape"


class _Gather:
    """A stand-in world whose allgather returns the given ranks' verdicts."""

    def __init__(self, every):
        self.every = every

    def allgather(self, mine):
        return self.every


def test_a_block_of_the_wrong_shape_on_one_rank_fails_the_job_as_fail_not_fail_star():
    from summasim.harness.check import Check, collective
    from summasim.harness.report import verdict

    good, shape = Check(1e-17, 1e-14, "exact"), Check(math.inf, 1e-14, "shape")
    every = [(c.error, c.nonfinite, c.ok) for c in (good, shape, good)]
    job = collective(_Gather(every), good)
    assert not job.ok and not job.nonfinite and job.bad_ranks == [1]
    assert job.error == math.inf and verdict(job.ok, job.nonfinite) == "FAIL"
    nan = Check(math.nan, 1e-14, "exact")           # a NaN anywhere still wins: FAIL*
    job = collective(_Gather(every + [(nan.error, nan.nonfinite, nan.ok)]), good)
    assert job.nonfinite and math.isnan(job.error) and job.bad_ranks == [1, 3]
    assert verdict(job.ok, job.nonfinite) == "FAIL*"


def test_fault_parse_and_corrupt():
    assert Fault.parse("perturb@12") == Fault("perturb", 12)
    for bad in ("nan", "nan@", "boom@1", "nan@-1", "@2"):
        with pytest.raises(ValueError, match="KIND@RANK"):
            Fault.parse(bad)
    assert set(KINDS) == {"nan", "inf", "perturb", "drop", "drift"}
    assert Fault.parse("drift@3") == Fault("drift", 3) and str(Fault("drift", 3)) == "drift@3"
    x = np.array([[1.0, -3.0], [2.0, 0.5]])
    y = x.copy()
    corrupt_entry(y, "perturb")              # the largest entry, relative 1e-6
    assert y[0, 1] == -3.0 * (1 + 1e-6) and np.sum(y != x) == 1
    corrupt_entry(y, "nan")
    assert np.isnan(y[0, 1])
    z = x.astype(np.float32)
    corrupt_entry(z, "perturb")              # 1e-6 would be below float32's round-off
    assert z[0, 1] == np.float32(-3.0 * (1 + 1e-2)) and np.sum(z != x) == 1


def test_drift_moves_one_entry_by_one_unit_in_the_last_place():
    """``drift`` changes the largest entry by one ulp and nothing else; on an output with
    no replicas (``corrupt_entry``) it changes it as ``perturb`` does; the ZeRO-3 hook
    moves the first all-gather's result only, and puts the name back."""
    import types

    from summasim.harness.inject import drift_at_gathers, drift_entry

    x = np.array([[1.0, -3.0], [2.0, 0.5]])
    y = x.copy()
    assert drift_entry(y) and np.sum(y != x) == 1
    assert y[0, 1] == np.nextafter(-3.0, np.inf) and y[0, 1] != -3.0
    assert not drift_entry(np.empty(0))
    z = x.astype(np.float32)
    drift_entry(z)
    assert z[0, 1] == np.nextafter(np.float32(-3.0), np.float32(np.inf))
    w = x.copy()
    corrupt_entry(w, "drift")
    assert w[0, 1] == -3.0 * (1 + 1e-6) and np.sum(w != x) == 1

    class Two:
        size = 2

    def gather(flat, comm):
        return flat

    ns = types.SimpleNamespace(ring_allgather_unchecked=gather)
    a, b = x.reshape(-1).copy(), x.reshape(-1).copy()
    with drift_at_gathers(ns) as hook:
        assert not hook.applied
        ns.ring_allgather_unchecked(a, Two())
        ns.ring_allgather_unchecked(b, Two())
    assert hook.applied and np.sum(a != x.reshape(-1)) == 1 and np.array_equal(
        b, x.reshape(-1))
    assert ns.ring_allgather_unchecked is gather


def test_inputs_match_the_split_of_the_global_matrix():
    """What a rank generates is its layout block of the one global operand."""
    case = MatmulCase("summa25_atb", 2, 2, 16, 24, 8)
    spec = case.spec
    sa, sb = spec.stored_shapes(case.m, case.k, case.n)
    A = uniform_segment(0, STREAM_A, 0, sa[0] * sa[1]).reshape(sa)
    B = uniform_segment(0, STREAM_B, 0, sb[0] * sb[1]).reshape(sb)
    for g in _positions(2, 2):
        ra, ca = block_slices(sa, spec.layout_a, g)
        rb, cb = block_slices(sb, spec.layout_b, g)
        assert np.array_equal(uniform_block(0, STREAM_A, sa, ra, ca), A[ra, ca])
        assert np.array_equal(uniform_block(0, STREAM_B, sb, rb, cb), B[rb, cb])


def test_memory_estimate_grows_with_the_share_and_refuses_with_what_fits():
    small = MatmulCase("summa_ab", 2, 1, 4096, 4096, 4096)
    big = MatmulCase("summa_ab", 4, 1, 8192, 8192, 8192)
    # a rank's share of 8192^3 on 16 ranks is that of 4096^3 on 4
    assert memory.product_bytes(big) == pytest.approx(memory.product_bytes(small), rel=0.3)
    # the whole 8192^3 operands are 3 * 512 MiB; a rank of 16 needs far less than that
    # (its blocks, workspaces and the exact check's float64 blocks of C: ~0.3 of it)
    assert memory.product_bytes(big) < 0.5 * 3 * 8192**2 * 8
    assert memory.check_fits(small, 4, available=64 * 2**30) == ""
    msg = memory.check_fits(MatmulCase("summa_ab", 4, 1, 100000, 100000, 100000), 16,
                            available=24 * 2**30)
    assert "needs about" in msg and "largest cube that fits is" in msg
    n = int(msg.rsplit(" ", 1)[-1].split("x")[0])
    assert n % 4 == 0 and 8000 < n < 40000
    fits = MatmulCase("summa_ab", 4, 1, n, n, n)
    over = MatmulCase("summa_ab", 4, 1, n + 4, n + 4, n + 4)
    assert memory.check_fits(fits, 16, available=24 * 2**30) == ""
    assert memory.check_fits(over, 16, available=24 * 2**30) != ""
    assert "largest" in memory.check_fits(RingCase(10**10), 16, available=24 * 2**30, p=16)


def test_training_memory_check_names_a_batch_that_fits():
    """A scheme or mesh run too large for the node is refused with the largest global
    batch of its shape that fits; that batch fits and the next one up does not. The
    estimate follows the share: rank 0 (the serial reference) above every other rank,
    and a rank's share shrinking with the tensor grid."""
    from summasim.harness.cases import MeshCase
    from summasim.transformer.model import Config

    avail = 24 * 2**30
    opt = transformer_case("optimus", 4, 1, 4096, 256, 512, 8, 2048, 2)
    mesh = MeshCase.parse("dp=2,pp=2,tp=optimus:2x2", 4096, Config(2048, 256, 512, 8, 2))
    for case, step in ((opt, 4), (mesh, 4)):
        root, other, window = memory.training_bytes(case, 16)
        assert root > other > 0 and window > 0
        msg = memory.check_training_fits(case, 16, 16, available=avail)
        assert "needs about" in msg and "largest global batch that fits is about" in msg, msg
        best = int(msg.rsplit(" ", 1)[-1])
        assert best % step == 0 and 0 < best < case.batch
        fit = dataclasses.replace(case, batch=best)
        over = dataclasses.replace(case, batch=best + step)
        assert memory.check_training_fits(fit, 16, 16, available=avail) == ""
        assert memory.check_training_fits(over, 16, 16, available=avail) != ""
        # a peer beside every rank (bench mesh --torch): what fitted alone fits no more,
        # and the batch it offers fits with the peer
        with_peer = memory.check_training_fits(fit, 16, 16, available=avail, peer=True)
        assert "largest global batch that fits is about" in with_peer, with_peer
        half = dataclasses.replace(case, batch=int(with_peer.rsplit(" ", 1)[-1]))
        assert 0 < half.batch < best
        assert memory.check_training_fits(half, 16, 16, available=avail, peer=True) == ""
    # Optimus on a 4x4 grid holds a quarter of what it holds on 2x2 (the reference is one
    # copy per node, not one per rank); Megatron on 16 ranks less than on 4
    o16 = memory.training_bytes(transformer_case("optimus", 4, 1, 64, 256, 1024, 8, 2048, 2), 16)
    o4 = memory.training_bytes(transformer_case("optimus", 2, 1, 64, 256, 1024, 8, 2048, 2), 4)
    assert o16[1] < 0.3 * o4[1] and o16[2] == o4[2]
    m16 = memory.training_bytes(transformer_case("megatron", 1, 1, 64, 256, 1024, 8, 2048, 2), 16)
    m4 = memory.training_bytes(transformer_case("megatron", 1, 1, 64, 256, 1024, 8, 2048, 2), 4)
    assert m16[1] < m4[1] and m16[0] == m4[0]          # the serial reference is the same
    huge = transformer_case("megatron", 1, 1, 64, 4096, 16384, 8, 64, 1)
    assert "not even batch 1 fits" in memory.check_training_fits(huge, 2, 2, available=avail)


def test_node_then_gpu_check_asks_the_gpu_only_when_the_node_fits():
    calls = []

    def fits(ranks, **kw):
        calls.append((ranks, kw))
        return "node too small" if not kw and ranks > 8 else ("gpu too small" if kw else "")

    assert memory.check_node_and_gpu(fits, 16, (5, 2)) == "node too small"
    assert calls == [(16, {})]                            # the GPU is not asked
    calls.clear()
    assert memory.check_node_and_gpu(fits, 4, None) == "" and calls == [(4, {})]
    calls.clear()
    assert memory.check_node_and_gpu(fits, 4, (5, 2)) == "gpu too small"
    assert calls == [(4, {}), (2, {"available": 5, "device": True})]


def test_device_memory_checks_count_a_gpu_share_and_name_what_fits():
    """With a device backend the preflight also checks one GPU: the ranks that share it
    times a rank's device share (a product's blocks and workspaces, not the check's
    host buffers; a training rank's shard, not the serial reference, which stays on
    the host), against the GPU's free memory, and names the largest size that fits."""
    from summasim.bench.allreduce import check_bench_fits

    gib = 2**30
    case = MatmulCase("summa_ab", 2, 1, 8192, 8192, 8192)
    dev, host = memory.product_device_bytes(case), memory.product_bytes(case)
    blocks = 3 * (4096 * 4096 * 8)                      # A, B and C blocks of a 2x2 grid
    assert blocks <= dev < host and host - dev >= 4096 * 4096 * 8   # C's host copy stays out
    big = MatmulCase("summa_ab", 2, 1, 60000, 60000, 60000)
    msg = memory.check_fits(big, 4, available=140 * gib, device=True)
    assert "per rank on its GPU" in msg and "4 ranks sharing one GPU" in msg
    assert "GiB free on the GPU" in msg, msg
    n = int(msg.rsplit(" ", 1)[-1].split("x")[0])
    assert memory.check_fits(MatmulCase("summa_ab", 2, 1, n, n, n), 4, available=140 * gib,
                             device=True) == ""
    assert memory.check_fits(MatmulCase("summa_ab", 2, 1, n + 2, n + 2, n + 2), 4,
                             available=140 * gib, device=True) != ""
    # four ranks on one GPU fit a quarter of what one rank alone does (cube side ~ 1/2)
    huge = MatmulCase("summa_ab", 2, 1, 150000, 150000, 150000)
    one = memory.check_fits(huge, 1, available=140 * gib, device=True)
    n1 = int(one.rsplit(" ", 1)[-1].split("x")[0])
    assert 1.8 < n1 / n < 2.2
    # training: the device need is the shard ranks' alone, below the node's (serial
    # reference and its shared copy included)
    opt = transformer_case("optimus", 2, 1, 4096, 256, 512, 8, 2048, 2)
    root, other, window = memory.training_bytes(opt, 4)
    avail = int((4 * other + 1) / memory.HEADROOM) + 1
    assert memory.check_training_fits(opt, 4, 4, available=avail, device=True) == ""
    assert memory.check_training_fits(opt, 4, 4, available=avail) != ""       # host: more
    msg = memory.check_training_fits(opt, 4, 4, available=avail // 2, device=True)
    assert "sharing one GPU" in msg and "largest global batch that fits" in msg, msg
    # the benchmark's messages on a GPU
    msg = check_bench_fits("allreduce", [4096.0], 4, available=8 * gib, device=True)
    assert "sharing one GPU" in msg and "free on the GPU" in msg, msg


def test_cases_round_trip():
    for case in (MatmulCase("summa_abt", 2, 1, 8, 4, 6, "float32"), RingCase(77),
                 transformer_case("optimus", 2, 1, 4, 8, 16, 4, 32, 2, ffn=2),
                 # the variant and a real MLP multiplier come back as they were
                 transformer_case("megatron", 2, 1, 4, 8, 16, 4, 32, 2, ffn=2.5,
                                  mlp="swiglu", kv_heads=2, tied=False)):
        again = case_from_dict(case.to_dict())
        assert again == case and again.to_dict() == case.to_dict()
    assert transformer_case("optimus", 2, 1, 4, 8, 16, 4, 32, 2, ffn=2).config.ffn_mult == 2
    with pytest.raises(ValueError):
        MatmulCase("ring_allreduce", 1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        MatmulCase("summa_xyz", 1, 1, 1, 1, 1)


def test_results_hand_the_cost_model_a_measured_run_not_a_dict():
    """``Result.measured()`` is the typed record (never a string-keyed dict); its JSON
    form is the worker-result dict the worker has always written, key for key."""
    import json

    from summasim.costmodel.workload.measured import EventCount, MeasuredRun
    from summasim.harness.cases import MeshCase
    from summasim.harness.check import Check
    from summasim.harness.result import Result
    from summasim.transformer.model import Config

    mesh = MeshCase.parse("dp=2,pp=2,tp=megatron:1", 8,
                          Config(vocab=32, seq=8, hidden=16, heads=4, layers=2),
                          zero=1, schedule="1f1b", microbatches=2)
    for case, p in ((MatmulCase("summa_ab", 2, 1, 8, 4, 6), 4), (RingCase(77), 4),
                    (transformer_case("optimus", 2, 1, 4, 8, 16, 4, 32, 2), 4), (mesh, 4)):
        events = [[["bcast", "row", 2, 64, 3, True], ["allreduce", "world", p, 8, 1, False]]
                  for _ in range(p)]
        coords = [[0, r // 2, r % 2, 0, 2] if case.kind == "mesh" else [0, r // 2, r % 2]
                  for r in range(p)]
        timing = {"median": 0.02, "spans": [0.02, 0.01, 0.03], "rank_max": [0.01, 0.01, 0.02]}
        res = Result(case, p, Check(0.0, 1e-14, "exact"), timing, events=events,
                     coords=coords)
        run = res.measured()
        assert isinstance(run, MeasuredRun) and not isinstance(run, dict), type(run)
        assert run.kind == case.kind and run.p == p and run.spans == (0.02, 0.01, 0.03)
        assert run.events[0][0] == EventCount("bcast", "row", 2, 64, 3, True)
        old = dict(case.to_dict(), p=p, spans=timing["spans"], rank_max=timing["rank_max"],
                   events=events, coords=coords)          # what measured() returned before
        assert json.dumps(run.to_dict()) == json.dumps(old)


def test_memory_prices_auto_as_the_check_resolves_it():
    from summasim.harness.check import choose_method

    for n, k in ((256, 256), (4096, 4096), (32768, 2)):
        case = MatmulCase("summa_ab", 2, 1, n, k, n)
        picked = choose_method("auto", n // 2, n // 2, k)
        assert memory.product_bytes(case, "auto") == memory.product_bytes(case, picked)
    # a wide, shallow product: auto keeps the exact check (cheap flops), whose float64
    # reference and scale blocks are the larger memory cost
    wide = MatmulCase("summa_ab", 2, 1, 32768, 2, 32768)
    assert choose_method("auto", 16384, 16384, 2) == "exact"
    assert memory.product_bytes(wide, "auto") > memory.product_bytes(wide, "freivalds")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_block_errors_over_the_ranks_are_the_whole_tensors_error(parts, n, seed):
    """The training rows compare each rank's block with the serial block, scaled by
    the whole tensor's max |ser|: the worst block is the unsharded comparison."""
    from summasim.harness.transformer import block_err, scale_of

    rng = np.random.default_rng(seed)
    ser = rng.normal(size=(n, 7))
    par = ser + rng.normal(scale=1e-9, size=ser.shape) * (rng.random(ser.shape) < 0.3)
    scale = scale_of(ser)
    blocks = [block_err(pb, sb, scale) for pb, sb in zip(np.array_split(par, parts),
                                                         np.array_split(ser, parts))]
    assert max(blocks) == float(np.max(np.abs(par - ser))) / float(np.max(np.abs(ser)))
    bad = par.copy()
    bad.flat[rng.integers(bad.size)] = np.nan
    assert any(math.isnan(block_err(pb, sb, scale)) for pb, sb in
               zip(np.array_split(bad, parts), np.array_split(ser, parts)))
    ser_bad = ser.copy()
    ser_bad.flat[0] = np.inf
    assert math.isnan(scale_of(ser_bad)) and math.isnan(block_err(par, ser, scale_of(ser_bad)))
    assert block_err(np.empty((0, 7)), np.empty((0, 7)), scale) == 0.0
    assert block_err(np.zeros(3), np.zeros(3), scale_of(np.zeros(3))) == 0.0
    assert block_err(np.ones(3), np.zeros(3), 0.0) == math.inf
    # a block of the wrong shape fails, even an empty one or one that broadcasts
    assert block_err(np.empty((0, 7)), ser, scale) == math.inf
    assert block_err(ser[:, :1], ser, scale) == math.inf


def test_loss_error_is_relative_and_survives_a_zero_reference():
    """One class (vocab 1): every softmax is 1 and the serial loss is exactly 0; the
    loss error then follows block_err's zero scale instead of dividing by 0."""
    from summasim.harness.transformer import loss_error

    assert loss_error(2.5, 2.0) == 0.25 and loss_error(-1.0, -2.0) == 0.5
    assert loss_error(0.0, 0.0) == 0.0 and loss_error(1e-300, 0.0) == math.inf
    assert math.isnan(loss_error(math.nan, 1.0)) and math.isnan(loss_error(math.inf, 0.0))


def test_mesh_comparison_keeps_a_non_finite_serial_value():
    """The mesh rows' comparison: a NaN or Inf in the serial gradients (its scale NaN)
    fails the key, whichever key comes first; a clean match is 0."""
    from summasim.harness.composed import _compare, _max_abs

    class Layout:                          # two keys packed in one flat vector
        def key_ranges(self):
            return {"a": (0, 4), "b": (4, 10)}

        def pad_ranges(self):
            return {}

    ser = np.arange(1.0, 11.0)
    held = [(0, 10, ser.copy())]
    assert _compare(Layout(), held, ser, _max_abs({"a": ser[:4], "b": ser[4:]})) == (0.0, "a")
    for bad in (np.inf, np.nan):
        ref = ser.copy()
        ref[7] = bad
        err, key = _compare(Layout(), held, ref, _max_abs({"a": ref[:4], "b": ref[4:]}))
        assert math.isnan(err) and key == "b"


def test_the_drop_hook_is_armed_for_its_block_only():
    """``Comm.drop_next_sum`` arms the one ``drop`` hook for its ``with`` block only (an
    exception included), :func:`drop_at_rings` puts the trainer's ring reductions back
    on exit, and a group of one never takes the hook (it has no sum to drop)."""
    from mpi4py import MPI

    from summasim.algorithms import allreduce
    from summasim.comm import Comm
    from summasim.harness.inject import drop_at_rings
    from summasim.transformer import composed

    alone = Comm(MPI.COMM_SELF.Dup(), name="dp")
    try:
        x = np.arange(4.0)
        with Comm.drop_next_sum() as drop:
            assert drop.armed and np.array_equal(alone.allreduce(x.copy()), x)
            assert not alone.take_drop() and drop.armed
        assert not drop.armed and not drop.applied
        with pytest.raises(RuntimeError, match="inside"):
            with Comm.drop_next_sum(groups=("dp",)) as drop, drop_at_rings(composed):
                assert composed.ring_allreduce_unchecked is not allreduce.ring_allreduce_unchecked
                assert composed.ring_start is not allreduce.ring_start
                raise RuntimeError("inside")
        assert not drop.armed and drop.groups is None
        assert composed.ring_allreduce_unchecked is allreduce.ring_allreduce_unchecked
        assert composed.ring_reduce_scatter_unchecked is allreduce.ring_reduce_scatter_unchecked
        assert composed.ring_start is allreduce.ring_start
    finally:
        alone.mpi.Free()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_ring_preflight_counts_what_a_ring_row_holds(dtype):
    """The ring row held 3.8 vectors of its length per rank with NumPy, 4.9 through the
    staged-host stand-in (peak RSS above the interpreter's, N = 2e7 on 4 ranks); the
    preflight counted 2.25, so a ring it let through could run out of memory."""
    n, it = 20_000_000, np.dtype(dtype).itemsize
    need = memory.ring_bytes(RingCase(n, dtype), 4)
    assert need >= 4.9 * n * it
    assert memory.check_fits(RingCase(n, dtype), 4, available=int(4 * 4.9 * n * it))


def test_global_sizes_are_three_non_negative_integers():
    """The library's ``sizes=``: Python or NumPy integers (a 1-D integer array too);
    floats, strings, bools and other counts are one ValueError naming the function."""
    from summasim.algorithms._common import global_sizes

    assert global_sizes("f", (5, 7, 3)) == global_sizes("f", np.array([5, 7, 3])) == (5, 7, 3)
    assert global_sizes("f", [np.int64(5), 0, 3]) == (5, 0, 3)
    for bad in ((5, 7), (5.9, 7, 3), "573", (-5, 7, 3), (True, 7, 3), np.array([5.0, 7, 3]),
                (5, 7, 3, 1), None):
        with pytest.raises(ValueError, match="f: sizes must be three non-negative"):
            global_sizes("f", bad)


def test_a_job_timeout_under_a_second_still_limits_the_job():
    """``accuracy --timeout 0.5`` became ``timeout 0``, which GNU timeout reads as no
    limit at all: the bound rounds up to whole seconds, at least 1."""
    from summasim.harness.worker import timeout_prefix

    assert timeout_prefix(0.5) == ["timeout", "-k", "10", "1"]
    assert timeout_prefix(1e-9)[-1] == "1"
    assert timeout_prefix(90.2)[-1] == "91" and timeout_prefix(600)[-1] == "600"


class _PaddedTrainer:
    """A stand-in for a Trainer's flat layout: key ``a`` holds items [0, 3) of a slot of
    5 (items 3 and 4 are its pad), key ``b`` items [5, 9)."""

    precision = None

    def __init__(self, grads):
        self.grads = grads

    def key_ranges(self):
        return {"a": (0, 3), "b": (5, 9)}

    def pad_ranges(self):
        return {"a": (3, 5)}

    def held_grads(self):
        # owned chunks: one of a's pad alone (a ZeRO chunk can be all pad), then b
        return [(3, 5, self.grads[:2]), (5, 9, self.grads[2:])]


def test_a_nonzero_pad_fails_the_comparison_and_faults_land_in_a_shard():
    """The zeros after a smaller shard (one layout per tensor group) must stay zero: a
    value there is an infinite error naming the key; and a fault goes into a shard's
    items, never a pad, where no check would see it (a chunk that began with a pad took
    the fault there, and --self-test missed perturb at 8 ranks)."""
    from summasim.harness.composed import _corrupt_held, _worst

    grads = np.array([0.0, 0.0, 1.0, -3.0, 2.0, 0.5])
    tr = _PaddedTrainer(grads)
    err = lambda key, vals, s, e: 0.0                                  # noqa: E731
    assert _worst(tr, [(3, 9, grads)], err) == (0.0, "b")
    dirty = grads.copy()
    dirty[1] = 1e-300
    assert _worst(tr, [(3, 9, dirty)], err) == (math.inf, "the pad after a")
    assert _corrupt_held(tr, "nan")
    assert not np.isnan(grads[:2]).any() and np.isnan(grads[2:]).sum() == 1


def test_a_mesh_misfit_names_the_micro_batch_only_when_it_is_the_cause():
    """A model the grid cannot cut is said as it is; a batch the grid cannot cut is the
    micro-batch, with the --batch it comes from (it read "batch = 1" for --batch 2, and
    "(micro-batch of 1 sequences)" followed reasons that had nothing to do with it)."""
    from summasim.transformer.model import Config

    c = Config(vocab=7, seq=3, hidden=10, heads=5, layers=1)
    why = MeshCase.parse("dp=2,pp=1,tp=optimus:2x2", 2, c, microbatches=1).misfit(8)
    assert why == "micro-batch = 1 is not divisible by 2 (--batch 2 over dp * microbatches = 2)"
    c = Config(vocab=7, seq=3, hidden=12, heads=3, layers=1)
    why = MeshCase.parse("dp=1,pp=1,tp=megatron:4", 2, c, microbatches=1).misfit(4)
    assert why == "heads = 3 is smaller than 4 (one per rank)"
