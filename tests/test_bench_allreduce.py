"""The pure parts of ``bench allreduce``: the paired-ratio statistic behind its
faster/tie/slower verdicts and the count of issue 12's targets; the bench's command
line (every subcommand's spelling) and the one timer's serial and interleaved loops."""

import numpy as np
import pytest
from scipy.stats import binom

from summasim.bench.__main__ import parse_args
from summasim.bench.allreduce import (allreduce_targets, check_bench_fits, paired_ratio)
from summasim.cli import UsageError
from summasim.costmodel.tools.bench import bench_bytes


def test_paired_ratio_interval_is_the_sign_test_interval():
    # 9 repeats: the 2nd smallest and the 2nd largest ratio, coverage 1 - 2 * 10/512
    base = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    r = paired_ratio(base, [1.0] * 9)
    assert (r["median"], r["low"], r["high"]) == (6.0, 3.0, 9.0)
    assert r["coverage"] == pytest.approx(1 - 2 * 10 / 512)
    assert r["verdict"] == "faster"


def test_paired_ratio_pairs_repeats_instead_of_comparing_medians():
    # the machine drifts 10x between repeats; the other contender is always 5% slower:
    # unpaired medians would see noise, pairs see a clear 1.05
    drift = [1, 10, 2, 9, 3, 8, 4, 7, 5]
    ours = [0.01 * d for d in drift]
    r = paired_ratio([1.05 * t for t in ours], ours)
    assert r["verdict"] == "faster" and r["median"] == pytest.approx(1.05)
    assert paired_ratio(ours, [1.05 * t for t in ours])["verdict"] == "slower"


def test_paired_ratio_calls_a_difference_inside_the_noise_a_tie():
    rng = np.random.default_rng(1)
    ours = list(1 + 0.1 * rng.standard_normal(15))
    r = paired_ratio(ours[::-1], ours)
    assert r["low"] < 1 < r["high"] and r["verdict"] == "tie"


def test_paired_ratio_coverage_holds_for_every_repeat_count():
    for n in range(6, 40):
        r = paired_ratio([1.0 + i for i in range(n)], [1.0] * n)
        assert r["coverage"] >= 0.95
        k = int(binom.ppf(0.025, n, 0.5))
        assert r["low"] == 1.0 + (k - 1)                   # the k-th smallest ratio
    r = paired_ratio([1.1] * 5, [1.0] * 5)                 # too few for 95%
    assert r["low"] is None and r["verdict"] is None and r["median"] == pytest.approx(1.1)
    with pytest.raises(ValueError):
        paired_ratio([], [])


def _row(mib, plain, mpi, err, verdict=None, mpi_verdict=None):
    return {"mib": mib, "ratio": mpi, "predicted": None if err is None else 1.0,
            "prediction_error": err,
            "vs_plain_paired": {"median": plain, "verdict": verdict},
            "vs_mpi_paired": {"median": mpi, "verdict": mpi_verdict}}


def test_targets_count_only_the_sizes_they_apply_to():
    rows = [_row(0.03125, 0.5, 0.2, 0.9, "slower"),        # below every target's range
            _row(0.0625, 0.97, 0.3, 0.5, "tie"),           # a tie is not slower
            _row(1, 0.9, 0.8, 0.09, "slower"),
            _row(4, 1.2, 1.05, -0.2, "faster", "tie"),     # MPI must be beaten, not tied
            _row(16, 1.0, 0.99, 0.3, "tie", "faster"),     # the paired verdict decides,
            _row(32, 1.0, 1.02, None, "tie", "slower"),    # not the ratio of the medians
            _row(64, 1.1, 1.3, -0.05, None)]               # no interval: the median decides
    calls = [(1.1, 0.9), (1.4, 1.3), (1.3, None), (1.2, None)]   # (median, interval low)
    for r, (med, low) in zip(rows, calls):
        r["call_vs_out_paired"] = {"median": med, "low": low, "high": None}
    tg = allreduce_targets(rows, 16)
    assert tg["call"] == {"sizes": 4, "met": 2}        # the low end, else the median
    assert tg["vs_plain"] == {"sizes": 6, "met": 5, "faster": 1}
    assert tg["vs_mpi"] == {"sizes": 4, "met": 2, "not_slower": 3}
    assert tg["prediction"] == {"sizes": 4, "met": 2}


def test_backend_applies_to_gemm_allreduce_and_mesh_only():
    assert parse_args(["allreduce", "--backend", "staged-host"]).backend == "staged-host"
    assert parse_args(["all", "--backend", "cupy"]).backend == "cupy"
    assert parse_args(["mesh", "--backend", "cupy"]).backend == "cupy"
    for what in ("transformer", "ring-steps"):
        with pytest.raises(UsageError, match="unrecognized arguments: --backend"):
            parse_args([what, "--backend", "cupy"])


def test_every_subcommand_speaks_the_shared_spelling():
    """--model, --batch, --mesh (repeatable), --zero/--schedule/--microbatches/
    --checkpoint, --machine and --dtype arrive parsed; the defaults are the sizes the
    benchmarks always ran."""
    from summasim.spec import Mesh, Model

    t = parse_args(["transformer"])
    assert t.model == Model(vocab=64, seq=128, hidden=512, heads=8, layers=1)
    assert (t.batch, t.dtype, t.checkpoint) == (None, "float32", False)
    from summasim.bench.transformer import model_of

    assert model_of(t)[1:] == (16, np.dtype("float32"))
    t = parse_args(["transformer", "--model", "tiny", "--dtype", "float64", "--checkpoint"])
    assert model_of(t) == (Model.parse("tiny"), 8, np.dtype("float64")) and t.checkpoint
    m = parse_args(["mesh", "--mesh", "dp=2,pp=2", "--mesh", "tp=optimus:2x2", "--zero",
                    "2", "--schedule", "gpipe", "--microbatches", "4", "--checkpoint",
                    "--machine", "local-2core-mpich", "--batch", "32"])
    assert m.mesh == [Mesh.parse("dp=2,pp=2"), Mesh.parse("tp=optimus:2x2")]
    assert (m.zero, m.schedule, m.microbatches, m.checkpoint, m.batch, m.machine) == \
        (2, "gpipe", 4, True, 32, "local-2core-mpich")
    assert parse_args(["mesh"]).model == Model(vocab=128, seq=32, hidden=128, heads=16,
                                                layers=4)
    from summasim.bench.mesh import plan_mesh_bench

    cases, _, err = plan_mesh_bench(parse_args(["mesh", "--mesh", "dp=2,pp=2",
                                                "--checkpoint"]), 4)
    assert err == "" and cases[0].checkpoint and cases[0].batch == 16
    # without --mesh the default compositions train their own way: a flag that says how
    # a mesh trains is refused, not dropped
    _, _, err = plan_mesh_bench(parse_args(["mesh", "--zero", "3", "--schedule", "gpipe"]), 4)
    assert "--zero, --schedule set(s) how a --mesh trains" in err
    # given at their defaults they are still given: refused, not silently the defaults'
    _, _, err = plan_mesh_bench(parse_args(["mesh", "--zero", "0", "--schedule", "1f1b",
                                            "--attention", "plain", "--recompute", "none"]), 4)
    assert "--zero, --schedule, --recompute/--checkpoint, --attention set(s)" in err
    cases, _, err = plan_mesh_bench(parse_args(["mesh"]), 4)
    assert err == "" and cases
    a = parse_args([])                                          # no benchmark: all
    assert a.what == "all" and a.model is None and a.dtype is None
    assert parse_args(["--n", "64"]).n == 64
    g = parse_args(["gemm", "--algorithms", "summa_ab,cannon_ab", "--dtype", "float32"])
    assert g.algorithms == ["summa_ab", "cannon_ab"] and g.dtype == "float32"
    lay = parse_args(["layer"])
    assert lay.model == Model.parse("h=1024,heads=16,layers=4,seq=256,vocab=512")
    assert (lay.repeats, lay.blocks, lay.no_memory) == (3, 2, False)
    for bad, flag in ((["transformer", "--tf-shape", "1"], "--tf-shape"),
                      (["mesh", "--mesh-shape", "1"], "--mesh-shape"),
                      (["transformer", "--tf-dtype", "float32"], "--tf-dtype"),
                      (["transformer", "--model", "h=30,heads=4,layers=1,seq=4,vocab=8"],
                       "--model"),
                      (["mesh", "--mesh", "dp=2,tp=3d:3x3x2"], "--mesh"),
                      (["gemm", "--n", "0"], "--n"),
                      (["gemm", "--algorithms", "fox"], "--algorithms"),
                      (["allreduce", "--sizes-mib", "1,-2"], "--sizes-mib"),
                      (["allreduce", "--repeats", "0"], "--repeats"),
                      (["mesh", "--microbatches", "0"], "--microbatches"),
                      (["gem"], "gem")):
        with pytest.raises(UsageError, match=flag):
            parse_args(bad)


def test_backend_unavailable_names_what_is_missing(monkeypatch):
    import sys

    from summasim.backends import unavailable

    assert unavailable("numpy") == "" and unavailable("staged-host") == ""
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy raises ImportError
    assert "CuPy is not installed" in unavailable("cupy")


def test_bench_memory_check_names_a_size_that_fits():
    """A size too large for the node is refused with the largest that fits, and that
    size does fit while one a little larger does not (both benchmarks)."""
    avail = 16 << 30
    for what in ("allreduce", "ring-steps"):
        assert check_bench_fits(what, [0.0625, 64], 16, available=avail) == ""
        msg = check_bench_fits(what, [0.0625, 4096], 16, available=avail)
        assert msg.startswith(f"{what} at 4096 MiB needs about"), msg
        most = float(msg.rsplit("about ", 1)[1].split()[0])
        assert check_bench_fits(what, [most * 0.999], 16, available=avail) == ""
        assert check_bench_fits(what, [most * 1.01], 16, available=avail) != ""
    # the all-reduce holds more messages per rank than the step timeline does
    assert bench_bytes("allreduce", [64]) > bench_bytes("ring-steps", [64])


def _thp(monkeypatch, mode, page=2 << 20):
    from summasim.backends import numpy_backend

    monkeypatch.setattr(numpy_backend, "transparent_huge_pages", lambda: (mode, page))
    return numpy_backend


def _allocation(a):
    """(start, end) of the NumPy allocation under view ``a``."""
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base.ctypes.data, base.ctypes.data + base.nbytes


@pytest.mark.parametrize("mode", ["madvise", "always"])
def test_huge_page_buffers_lie_inside_whole_huge_pages_at_staggered_offsets(monkeypatch,
                                                                            mode):
    nb = _thp(monkeypatch, mode)
    page = 2 << 20
    offsets = []
    for shape, dtype in [(((2 << 20) // 8,), np.float64), ((3, 1 << 20), np.float32),
                         ((5_000_001,), np.float64), ((1 << 20,), np.float64)]:
        a = nb.empty_huge(shape, dtype)
        assert a.shape == shape and a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        lo, hi = _allocation(a)
        first = a.ctypes.data // page * page              # the huge pages it touches
        last = -(-(a.ctypes.data + a.nbytes) // page) * page
        assert lo <= first and last <= hi, (shape, dtype)  # all inside its allocation
        offsets.append(a.ctypes.data % page)
        a[...] = 7                                # every byte is its own memory
        assert a.sum() == 7 * a.size
    # consecutive buffers start at different offsets within a huge page, a known step
    # apart (equal offsets put the operands of an add on the same cache sets)
    assert len(set(offsets)) == len(offsets)
    steps = {(b - a) % page for a, b in zip(offsets, offsets[1:])}
    assert steps == {nb.STAGGER_BYTES % page}


def test_huge_page_buffers_follow_the_kernels_page_size(monkeypatch):
    page = 64 << 20                                # a stand-in kernel's huge page
    nb = _thp(monkeypatch, "madvise", page)
    a = nb.empty_huge((page // 8 + 5,), np.float64)              # never touched
    lo, hi = _allocation(a)
    assert lo <= a.ctypes.data // page * page
    assert -(-(a.ctypes.data + a.nbytes) // page) * page <= hi
    assert nb.empty_huge((page // 8 - 1,), np.float64).base is None    # below one page


def test_buffers_below_a_huge_page_or_without_thp_are_plain(monkeypatch):
    nb = _thp(monkeypatch, "madvise")
    small = nb.empty_huge(((2 << 20) // 8 - 1,), np.float64)
    assert small.base is None                     # np.empty's own array, no slack
    for mode in ("never", None):
        a = _thp(monkeypatch, mode).empty_huge((1 << 20,), np.float64)
        assert a.base is None and a.shape == (1 << 20,)


def test_bench_buffers_hold_the_values_and_honour_np_empty(monkeypatch):
    from summasim.backends import get_backend
    from summasim.bench.common import message_buffers

    _thp(monkeypatch, "madvise")
    hx = np.random.default_rng(0).standard_normal((4 << 20) // 8)
    x, out = message_buffers(get_backend("numpy"), hx)
    assert np.array_equal(x, hx) and x is not hx and not np.shares_memory(x, out)
    assert x.base is not None and out.base is not None         # views of huge buffers
    x, out = message_buffers(get_backend("numpy"), hx, huge=False)
    assert np.array_equal(x, hx) and x.base is None and out.base is None
    assert parse_args(["allreduce", "--np-empty"]).np_empty
    assert not parse_args(["allreduce"]).np_empty


def test_repeats_follow_the_call_time_within_their_bounds():
    from summasim.bench.allreduce import (ALLREDUCE_MAX_REPEATS, ALLREDUCE_REPEATS,
                                          allreduce_repeats)

    assert allreduce_repeats(0.010, budget=3.0) == ALLREDUCE_MAX_REPEATS
    assert allreduce_repeats(0.1, least=9, most=41, budget=3.0, step=1) == 30
    assert allreduce_repeats(0.1, least=9, most=41, budget=3.0, step=3) == 30
    assert allreduce_repeats(0.1, least=9, most=41, budget=3.2, step=3) == 30  # 32 -> 30
    assert allreduce_repeats(0.001, least=9, most=41, step=3) == 39            # <= most
    assert allreduce_repeats(1.2, least=9, most=41, budget=3.0) == 9      # the floor
    assert allreduce_repeats(0.0) == ALLREDUCE_MAX_REPEATS               # a free call
    for t in (0.001, 0.05, 0.09, 0.2, 0.33, 1.0):
        n = allreduce_repeats(t)
        assert ALLREDUCE_REPEATS <= n <= ALLREDUCE_MAX_REPEATS
        assert (n - ALLREDUCE_REPEATS) % 3 == 0           # each contender first alike
    with pytest.raises(ValueError):
        allreduce_repeats(0.1, least=10, most=9)
    # no --repeats: the allreduce benchmark sizes each run; --repeats N is exactly N
    assert parse_args(["allreduce"]).repeats is None
    assert parse_args(["allreduce", "--repeats", "5"]).repeats == 5


def test_each_size_is_priced_at_the_memory_read_while_it_ran(monkeypatch):
    """The prediction's memory floor uses the median of the readings taken in the size's
    rounds of repeats (the node's memory drifts within a launch), and each row keeps
    them."""
    from mpi4py import MPI

    import summasim.bench.allreduce as B
    from summasim.costmodel.tools import bench as bench_predictions
    from summasim.costmodel.machine import load_preset

    seen = []
    monkeypatch.setattr(bench_predictions, "predict_result",
                        lambda res, m: seen.append(m.memory_bandwidth) or 1.0)
    readings = iter([30.0, 50.0, 20.0, 44.0, 40.0, 10.0])
    rows = B.bench_allreduce(MPI.COMM_SELF, [0.0625, 0.25], np.float64, 3, lambda s: None,
                             load_preset("local-2core-mpich"), memory=lambda: next(readings))
    assert [r["memory_readings"] for r in rows] == [[30.0, 50.0, 20.0], [44.0, 40.0, 10.0]]
    assert [r["memory_gibs"] for r in rows] == [30.0, 40.0]
    assert seen == [30.0 * 2**30, 40.0 * 2**30]
    assert all(r["predicted"] == 1.0 and r["ok"] for r in rows)
    # where the data fits in the node's cache the floor cannot count: nothing is read
    seen.clear()
    rows = B.bench_allreduce(MPI.COMM_SELF, [0.0625], np.float64, 3, lambda s: None,
                             load_preset("local-2core-mpich").replace(cache_bytes=2**20),
                             memory=lambda: 1 / 0)
    assert rows[0]["memory_readings"] == [] and rows[0]["memory_gibs"] is None
    assert seen == [None]


def test_the_one_timer_times_serial_calls_with_warm_ups_and_hooks():
    """world=None: no MPI; warm-ups untimed; before/after around every call; the call's
    own time is its span; returns kept on request; adaptive=False is exact."""
    from summasim.harness.timing import time_calls

    log = []
    res = time_calls(lambda: log.append("call") or len(log), None, 3, adaptive=False,
                     warmup=2, before=lambda: log.append("before"),
                     after=lambda: log.append("after"), returns=True)
    assert log == ["before", "call", "after"] * 5
    assert len(res["spans"]) == len(res["times"]) == len(res["rank_max"]) == 3
    assert res["spans"] == res["times"] == res["rank_max"]
    assert res["returns"] == [8, 11, 14] and res["median"] == sorted(res["spans"])[1]
    assert len(time_calls(lambda: None, None, 2, budget=1e-9)["spans"]) == 2
    assert "returns" not in time_calls(lambda: None, None, 1)


def test_warm_s_warms_up_serial_calls_for_that_long_and_refuses_a_world(monkeypatch):
    """warm_s: untimed calls until that many seconds have passed (at least ``warmup``),
    then the timed ones, in time_calls and in each turn of time_contenders; with a world
    it is refused (ranks would disagree on the count)."""
    import time

    from summasim.harness.timing import time_calls, time_contenders

    clock, calls = [0.0], []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def call(name="a"):
        calls.append(name)
        clock[0] += 0.01

    res = time_calls(call, None, 2, adaptive=False, warmup=1, warm_s=0.035)
    assert len(calls) == 4 + 2                 # untimed until 0.04 >= 0.035, then 2 timed
    assert res["spans"] == pytest.approx([0.01, 0.01])
    calls.clear()
    time_contenders({k: (lambda k=k: call(k)) for k in "ab"}, None, 1, warm_s=0.025,
                    rotate=False)
    assert calls == ["a"] * (3 + 1) + ["b"] * (3 + 1)
    with pytest.raises(ValueError, match="serial"):
        time_calls(call, object(), 1, warm_s=0.1)
    with pytest.raises(ValueError, match="serial"):
        time_contenders({"a": call}, object(), 1, warm_s=0.1)


def test_contenders_rotate_or_alternate_in_blocks_and_may_resize_the_rounds():
    from summasim.harness.timing import rotated, time_contenders

    assert [rotated(list("abc"), i) for i in range(4)] == [
        list("abc"), list("bca"), list("cab"), list("abc")]
    order = []
    calls = {k: (lambda k=k: order.append(k)) for k in "abc"}
    out = time_contenders(calls, None, 2)
    assert order == list("abcbca") and all(len(out[k]["spans"]) == 2 for k in "abc")
    order.clear()
    seen = []
    out = time_contenders(calls, None, 1, repeats=2, warmup=1, rotate=False,
                          before=seen.append,
                          after_round=lambda i, spans: 2 if i == 1 else None)
    assert order == list("aaabbbccc") * 2 and seen == order
    assert all(len(out[k]["spans"]) == 4 for k in "abc")


def test_shuffled_rounds_rotate_the_first_and_vary_what_each_follows():
    """shuffle: each round starts as rotated does and holds every contender once; the
    others' order is drawn from the round's seed (the same on every rank, so the same
    call again), and over rounds a contender follows more than one other (a fixed
    cyclic order gave each always the same predecessor)."""
    from summasim.harness.timing import rotated, shuffled, time_contenders

    names = list("abcde")
    rounds = [shuffled(names, i) for i in range(40)]
    assert rounds == [shuffled(names, i) for i in range(40)]            # seeded
    assert all(sorted(r) == names and r[0] == rotated(names, i)[0]
               for i, r in enumerate(rounds))
    before = {k: {r[r.index(k) - 1] for r in rounds if r.index(k)} for k in names}
    assert all(len(v) >= 3 for v in before.values()), before
    fixed = {k: {r[r.index(k) - 1] for r in (rotated(names, i) for i in range(40))
                 if r.index(k)} for k in names}
    assert all(len(v) == 1 for v in fixed.values())
    order = []
    calls = {k: (lambda k=k: order.append(k)) for k in names}
    time_contenders(calls, None, 3, shuffle=True)
    assert order == sum((shuffled(names, i) for i in range(3)), [])


def test_bench_layer_refuses_a_variant_it_would_not_time_and_a_batch_that_does_not_fit(
        monkeypatch):
    """bench layer times GPT-2's layer: a SwiGLU or GQA --model is refused, not timed as
    GELU. Its memory is checked before any allocation, naming the largest batch that fits,
    and the estimate bounds what the layer allocates."""
    from summasim.bench import layer
    from summasim.harness import memory
    from summasim.spec import Model

    with pytest.raises(UsageError, match="mlp=swiglu"):
        layer.check(parse_args(["layer", "--model",
                                "h=16,heads=4,layers=1,seq=8,vocab=16,mlp=swiglu"]))
    with pytest.raises(UsageError, match="kv_heads=2"):
        layer.check(parse_args(["layer", "--model", "h=16,heads=4,layers=1,seq=8,vocab=16,"
                                "kv_heads=2"]))
    model = Model.parse("h=64,heads=4,layers=2,seq=32,vocab=64")
    args = ["layer", "--model", str(model), "--batch", "64", "--no-memory"]
    need = layer.layer_bench_bytes(model, 64, "float32", False, False)
    at_8 = layer.layer_bench_bytes(model, 8, "float32", False, False)
    monkeypatch.setattr(memory, "available_bytes", lambda: at_8)
    with pytest.raises(UsageError, match=r"batch 64 needs about .* the largest batch that "
                                         r"fits is 8$"):
        layer.check(parse_args(args))
    monkeypatch.setattr(memory, "available_bytes", lambda: need)
    layer.check(parse_args(args))                          # exactly enough: it runs
    # the estimate is above what one layer's forward and backward hold (tracemalloc)
    import tracemalloc

    from summasim.bench.layer import _layer, _our_step

    p = _layer(model, np.float32)
    x = np.ones((8, model.seq, model.hidden), np.float32)
    tracemalloc.start()
    try:
        _our_step(x, p, model.heads, x.copy(), None, lambda: None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < at_8, (peak, at_8)


def test_bench_all_on_one_rank_names_what_it_skips(tmp_path):
    """bench all at p = 1: the all-reduce and the meshes measure nothing there, so they are
    skipped with the reason (in the output and the JSON), not run as one-rank rings or an
    empty table."""
    import json
    import subprocess
    import sys

    out = tmp_path / "all.json"
    proc = subprocess.run(
        [sys.executable, "-m", "summasim.bench", "all", "--n", "8", "--sizes-mib", "0.01",
         "--model", "h=16,heads=2,layers=2,seq=8,vocab=16", "--batch", "4", "--repeats", "1",
         "--no-predict", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = json.loads(out.read_text())["skipped"]
    assert set(skipped) == {"allreduce", "mesh"}, skipped
    assert "allreduce: skipped, it measures nothing at p = 1" in proc.stdout
    assert "ring GB/s" not in proc.stdout


def test_a_name_or_size_given_twice_is_timed_once():
    assert parse_args(["gemm", "--algorithms", "summa_ab,summa_ab,cannon_ab"]).algorithms == \
        ["summa_ab", "cannon_ab"]
    assert parse_args(["ring-steps", "--sizes-mib", "0.01,0.5,0.01"]).sizes_mib == [0.01, 0.5]


def test_a_rows_size_is_what_was_sent_in_eight_characters():
    """``--sizes-mib 1e-30`` sends one item: the row says 8 B, not the size asked for."""
    from summasim.bench.allreduce import _mib

    assert _mib(8) == "7.63e-06"              # one float64 item
    assert _mib(2**20) == "1" and _mib(64 * 2**10) == "0.0625" and _mib(2**30) == "1024"
    assert all(len(_mib(n)) <= 8 for n in (1, 8, 3 * 2**7, 13107 * 8, 2**40, 2**50))
