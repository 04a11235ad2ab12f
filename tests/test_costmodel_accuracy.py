"""The accuracy benchmark's pure side: fits of run-level models, the three-regime
link, and the analysis pipeline on synthetic measurements with a known answer."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import matmul_result as _matmul_result, synthetic_machine
from summasim.costmodel.tools import accuracy as A
from summasim.costmodel.machine.regression import (
    fit_elementwise, fit_nonneg_linear, fit_regimes, fit_shared_core, library_eager_threshold,
    split_huge)
from summasim.costmodel.machine import Link, Machine, SharedCore
from summasim.costmodel.workload.measured import EventCount, MeasuredRun
from summasim.costmodel.workload.predict import SharedFeatures, predict_features
from summasim.costmodel.workload.traffic import algorithm_messages


_machine = synthetic_machine


# ----------------------------------------------------------------------------- fits
def test_fit_nonneg_linear_recovers_coefficients_despite_an_outlier():
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.uniform(1e-3, 1e-1, 30), rng.uniform(10, 1000, 30),
                         rng.uniform(1e5, 1e8, 30), np.ones(30)])
    c = np.array([1.3, 2e-5, 3e-10, 5e-3])    # every term matters somewhere
    y = X @ c * (1 + rng.normal(0, 0.01, 30))
    y[3] *= 3.0                                   # one descheduled run
    got, err = fit_nonneg_linear(X, y)
    np.testing.assert_allclose(got, c, rtol=0.1)
    assert err < 0.02


def test_fit_nonneg_linear_keeps_coefficients_nonnegative_and_rejects_bad_input():
    X = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    got, _ = fit_nonneg_linear(X, np.array([1.0, 0.9, 0.8]))  # a falling line
    assert np.all(got >= 0)
    with pytest.raises(ValueError, match="at least 2 runs"):
        fit_nonneg_linear(X[:1], np.array([1.0]))
    with pytest.raises(ValueError, match="> 0"):
        fit_nonneg_linear(X, np.array([1.0, 0.0, 1.0]))


def test_fit_shared_core_recovers_a_known_model():
    true = SharedCore(work_factor=1.4, hop_seconds=30e-6, hop_seconds_per_byte=2e-10,
                      sync_seconds=1e-3)
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(12):
        f = SharedFeatures(work=rng.uniform(1e-3, 0.2), hops=rng.uniform(4, 200),
                           hop_bytes=rng.uniform(1e4, 5e7), dedicated=0.0)
        R = rng.choice([1.5, 2.0, 4.0])
        t = R * (true.work_factor * f.work + true.hop_seconds * f.hops
                 + true.hop_seconds_per_byte * f.hop_bytes + true.sync_seconds)
        samples.append((R, f, t))
    got, err = fit_shared_core(samples)
    for name in SharedCore._FIELDS:
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-3)
    assert err < 1e-6
    with pytest.raises(ValueError, match="R > 1"):
        fit_shared_core([(1.0, samples[0][1], 1.0)] * 4)


def test_fit_elementwise_recovers_per_item_and_per_layer_seconds():
    samples = [(g, items, L, g + 3e-9 * items + 2e-3 * L)
               for g, items, L in ((0.01, 1e6, 3), (0.02, 4e6, 2), (0.05, 2e6, 5))]
    ge, ls, err = fit_elementwise(samples)
    assert ge == pytest.approx(3e-9, rel=1e-4) and ls == pytest.approx(2e-3, rel=1e-4)
    assert err < 1e-6
    with pytest.raises(ValueError, match="faster than its GEMMs"):
        fit_elementwise([(1.0, 1e6, 1, 0.5), (1.0, 2e6, 1, 2.0)])


def test_fit_elementwise_takes_a_step_a_little_faster_than_its_gemms():
    """Serial steps run one rank on two cores, the GEMM fit two: a step may come out a
    few % faster than its GEMMs alone. The fit then still recovers the terms from the
    other steps (and the noisy step pulls them only a little); beyond 10% it refuses."""
    truth = [(g, items, L, g + 3e-9 * items + 2e-3 * L)
             for g, items, L in ((0.01, 1e6, 3), (0.02, 4e6, 2), (0.05, 2e6, 5), (0.03, 3e6, 4))]
    noisy = truth + [(0.35, 1e5, 1, 0.35 * 0.97)]          # 3% faster than its GEMMs
    ge, ls, err = fit_elementwise(noisy)
    assert ge == pytest.approx(3e-9, rel=0.05) and ls == pytest.approx(2e-3, rel=0.05)
    assert err < 0.01
    with pytest.raises(ValueError, match="more than 10%"):
        fit_elementwise(truth + [(0.35, 1e5, 1, 0.35 * 0.85)])


# ----------------------------------------------------------------------------- link
def _three_regime_times(sizes):
    out = []
    for s in sizes:
        if s < 8192:
            out.append(2e-6 + 1e-10 * s)
        elif s < 4 << 20:
            out.append(5e-6 + 1.2e-10 * s)
        else:
            out.append(80e-6 + 0.6e-10 * s)
    return np.array(out)


def test_split_huge_finds_a_third_regime_and_leaves_two_regime_data_alone():
    sizes = [2 ** i for i in range(3, 27)]
    t = _three_regime_times(sizes)
    rf = split_huge(fit_regimes(sizes, t, 8192), sizes, t)
    assert rf.huge_threshold == 4 << 20
    assert rf.huge.beta == pytest.approx(0.6e-10, rel=0.02)
    assert rf.large.beta == pytest.approx(1.2e-10, rel=0.02)
    link = rf.link()
    assert link.time(64 << 20) == pytest.approx(t[-1], rel=0.02)
    two = np.array([2e-6 + 1e-10 * s if s < 8192 else 5e-6 + 1.2e-10 * s for s in sizes])
    rf2 = fit_regimes(sizes, two, 8192)
    assert split_huge(rf2, sizes, two) is rf2


def test_link_third_regime_round_trips_and_checks_its_fields():
    link = Link(2e-6, 1e-10, 5e-6, 1.2e-10, 8192, huge_threshold=4 << 20, alpha_huge=8e-5,
                beta_huge=6e-11)
    assert link.beta(1 << 20) == 1.2e-10 and link.beta(4 << 20) == 6e-11
    assert link.alpha(100) == 2e-6
    assert Link.from_dict(link.to_dict()) == link
    plain = Link(2e-6, 1e-10, 5e-6, 1.2e-10, 8192)
    assert "huge_threshold" not in plain.to_dict() and plain.beta(1 << 30) == 1.2e-10
    d = dict(link.to_dict())
    del d["beta_huge"]
    with pytest.raises(ValueError, match="all of"):
        Link.from_dict(d)
    with pytest.raises(ValueError, match="must be above"):
        Link(2e-6, 1e-10, 5e-6, 1.2e-10, 8192, huge_threshold=4096)
    m = _machine(intra=link)
    assert Machine.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_library_eager_threshold(monkeypatch):
    monkeypatch.delenv("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", raising=False)
    assert library_eager_threshold("MPICH Version: 5.0.2\nMPICH Release date")[0] == 8192
    monkeypatch.setenv("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", "65536")
    assert library_eager_threshold("MPICH Version: 4.2")[0] == 65536
    assert library_eager_threshold("Open MPI v5.0.3")[0] is None


# ----------------------------------------------------------------------------- predict
def test_predict_features_combines_ranks():
    feats = [SharedFeatures(0.10, 10, 1e6, 0.12), SharedFeatures(0.08, 30, 2e6, 0.15)]
    m = _machine()
    assert predict_features(feats, m, 2) == 0.15           # R = 1: dedicated
    assert predict_features(feats, m, 4) == pytest.approx(0.30)   # plain slowdown 2
    sc = SharedCore(1.5, 1e-4, 1e-9, 1e-3)
    got = predict_features(feats, m.replace(shared_core=sc), 4)
    assert got == pytest.approx(2 * (1.5 * 0.10 + 1e-4 * 30 + 1e-9 * 2e6 + 1e-3))
    with pytest.raises(ValueError):
        predict_features([], m, 4)


# ----------------------------------------------------------------------------- pipeline
def _ring_dict(p, N, measured):
    """A ring's measured run in its JSON form, as a ``measured.json`` from before the
    ``blocking`` flag and ``rank_max`` holds it (five-field event lines)."""
    from summasim.harness.cases import RingCase

    events = [[[mc.op, "world", mc.group_size, mc.nbytes, mc.count]
               for mc in algorithm_messages("ring_allreduce", count=N, p=p, coords=r,
                                            itemsize=8)] for r in range(p)]
    return dict(RingCase(N).to_dict(), p=p, spans=list(measured), events=events,
                coords=[[r] for r in range(p)])


def _ring_result(p, N, measured):
    """The record of a ring all-reduce on p ranks: its closed-form messages, ``measured``
    as its spans."""
    events = tuple(tuple(EventCount(mc.op, "world", mc.group_size, mc.nbytes, mc.count)
                         for mc in algorithm_messages("ring_allreduce", count=N, p=p, coords=r,
                                                      itemsize=8)) for r in range(p))
    return MeasuredRun(kind="ring", p=p, dtype="float64", algorithm="ring_allreduce", N=N,
                       spans=tuple(measured), events=events, coords=tuple((r,) for r in range(p)))


def test_analyse_recovers_the_model_that_made_the_measurements(tmp_path):
    """Measurements generated by a known shared-core machine: calibration on the
    p = 4 runs recovers it, and the held-out p = 16 runs are then predicted exactly."""
    truth = _machine(shared_core=SharedCore(1.3, 40e-6, 3e-10, 2e-4))
    naive = truth.replace(shared_core=None)

    def measured(res):
        t = A.predict_result(res, truth)         # median = the model's time
        return dataclasses.replace(res, spans=(t * 0.98, t, t * 1.05))

    cal, held = [], []
    for N in (1 << 12, 1 << 16, 1 << 20, 1 << 22):
        cal.append(_ring_result(4, N, [1.0]))
    for alg, n in (("cannon_ab", 512), ("summa_ab", 1024), ("summa_abt", 2048)):
        cal.append(_matmul_result(alg, 2, n, 4, [1.0]))
    for alg in ("cannon_ab", "summa_ab"):
        held.append(_matmul_result(alg, 4, 2048, 16, [1.0]))
    held.append(_ring_result(16, 1 << 20, [1.0]))
    cal, held = [measured(r) for r in cal], [measured(r) for r in held]
    rep, calibrated = A.analyse({"calibrate": cal, "heldout": held}, naive)
    assert calibrated.shared_core.work_factor == pytest.approx(1.3, rel=0.05)
    assert rep["heldout"]["summary"]["worst"] < 0.02
    assert rep["calibrate"]["summary"]["worst"] < 0.02
    assert rep["ranking"]["summary"]["configurations"] == 1       # the p=16 n=2048 pair
    assert rep["ranking"]["outcomes"][0]["correct"]
    # and through the CLI, re-analysing saved measurements without MPI
    out = tmp_path / "acc"
    out.mkdir()
    (out / "measured.json").write_text(json.dumps({"calibrate": [r.to_dict() for r in cal],
                                                   "heldout": [r.to_dict() for r in held]}))
    naive.save(out / "machine-fit.json")
    proc = subprocess.run([sys.executable, "-m", "summasim.costmodel", "accuracy", "--from",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Held-out runs" in proc.stdout and "MAPE" in proc.stdout
    rep2 = json.loads((out / "report.json").read_text())
    assert rep2["heldout"]["summary"]["mape"] == pytest.approx(rep["heldout"]["summary"]["mape"])
    assert Machine.load(out / "machine-calibrated.json").shared_core is not None


def test_ranking_groups_candidates_of_the_same_problem():
    rows = [{"label": "a", "predicted": 1.0, "measured": 2.0, "key": "k"},
            {"label": "b", "predicted": 2.0, "measured": 1.0, "key": "k"},
            {"label": "c", "predicted": 1.0, "measured": 1.0, "key": "solo"},
            {"label": "d", "predicted": 1.0, "measured": 1.0, "key": None}]
    out = A.ranking(rows)
    assert len(out) == 1 and out[0]["key"] == "k"
    assert not out[0]["correct"] and not out[0]["tied"] and out[0]["regret"] == 1.0


def test_calibration_report_splits_regimes_and_sources():
    m = _machine(notes={"pingpong": [[8, 2e-6], [1 << 20, 5e-6 + 8e-11 * (1 << 20)]],
                        "ring": [[1 << 20, 2 * (5e-6 + 8e-11 * (1 << 20))]]})
    rep = A.calibration_report(m)
    assert rep["pingpong"]["large"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert rep["pingpong"]["latency"]["points"] == 1 and rep["pingpong"]["mid"] is None
    assert rep["ring"]["large"]["median"] == pytest.approx(0.5)


def test_quick_fit_borrows_run_level_models_only_from_a_matching_preset():
    from summasim.costmodel.machine import load_preset
    from summasim.harness.machinefile import borrow_run_models

    ref = load_preset("local-2core-mpich")
    assert ref.shared_core is not None and ref.gamma_elementwise > 0   # the preset is calibrated
    said = []
    got = borrow_run_models(_machine(cores=ref.cores), said.append)
    assert got.shared_core == ref.shared_core and got.layer_seconds == ref.layer_seconds
    assert said and "local-2core-mpich" in said[0]
    other = _machine(cores=ref.cores * 8)
    assert borrow_run_models(other, said.append) is other             # a different machine


def test_reanalysis_without_measurements_says_what_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "summasim.costmodel", "accuracy", "--from",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "measured.json" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- typed records
def _transformer_result(p=4):
    from summasim.harness.cases import transformer_case

    case = transformer_case("optimus", 2, 1, 4, 8, 16, 4, 32, 2, dtype="float64")
    events = [[["bcast", "row", 2, 512, 6, True], ["bcast", "col", 2, 256, 4, False]]
              for _ in range(p)]
    coords = [[r // 2, r % 2, 0] for r in range(p)]
    return dict(case.to_dict(), p=p, spans=[0.02, 0.01, 0.03], rank_max=[0.01, 0.01, 0.02],
                events=events, coords=coords)


def test_measured_runs_read_the_harness_dicts_and_write_them_back():
    """MeasuredRun.from_dict(d).to_dict() == d (with every field present) for every kind
    of run the harness measures (old five-field event lines included), the worker's
    key order kept (its verdict last), and the record is what the analysis reads: the
    analysis takes the record only (a dict is read with from_dict at the JSON boundary)."""
    m = _machine()
    ring = _ring_dict(4, 1 << 12, [1.0, 2.0, 3.0])              # five-field events
    matmul = _matmul_result("summa_ab", 2, 256, 4, [1.0, 1.5])
    assert MeasuredRun.from_dict(matmul.to_dict()) == matmul     # record -> JSON -> record
    for res in (ring, matmul.to_dict(), _transformer_result()):
        run = MeasuredRun.from_dict(res)
        assert run.to_dict() == {"rank_max": [], **res} and MeasuredRun.from_dict(run) is run
        assert all(isinstance(e, EventCount) for rank in run.events for e in rank)
        assert run.kind == res["kind"] and run.p == res["p"] and run.dtype == res["dtype"]
        assert A.predict_result(run, m) == A.predict_result(MeasuredRun.from_dict(res), m)
        assert A.case_label(run) == run.label
        assert A.ranking_key(run) == run.ranking_key
        assert A.measured_seconds(run, "min") == min(res["spans"])
        assert run.seconds() == __import__("statistics").median(res["spans"])
        for fn in (A.case_label, A.ranking_key, A.measured_seconds,
                   lambda r: A.rank_features(r, m), lambda r: A.compare([r], m),
                   lambda r: A.calibrate(m, [r], []), lambda r: A.predict_result(r, m)):
            with pytest.raises(TypeError, match="takes a MeasuredRun"):
                fn(res)
    # the worker's JSON: the case's keys, the measurements, then its verdict, in that order
    worker = dict(_transformer_result(), ok=True, error=1e-16, label="optimus", load=0.5)
    run = MeasuredRun.from_dict(worker)
    assert run.extra == {"ok": True, "error": 1e-16, "label": "optimus", "load": 0.5}
    assert json.dumps(run.to_dict()) == json.dumps(worker)
    assert not MeasuredRun.from_dict(ring).polled               # no flag: not marked polled
    tf = MeasuredRun.from_dict(_transformer_result())
    assert tf.label == "optimus 2x2 b4 s8 h16 v32 L2" and tf.model().hidden == 16
    assert tf.events[0][1] == EventCount("bcast", "col", 2, 256, 4, False)
    with pytest.raises(ValueError, match="lacks"):
        MeasuredRun.from_dict({"kind": "matmul", "p": 4, "algorithm": "summa_ab"})
    with pytest.raises(ValueError, match="unknown kind"):
        MeasuredRun.from_dict({"kind": "fft", "p": 4})


def test_mesh_runs_round_trip_for_the_composition_pricer():
    res = {"kind": "mesh", "mesh": "dp=2,pp=1,tp=megatron:2", "dp": 2, "pp": 1,
           "scheme": "megatron", "q": 1, "d": 1, "t": 2, "zero": 1, "schedule": "1f1b",
           "m": 2, "checkpoint": False, "bucket_bytes": 1 << 20, "steps": 1, "b": 8, "s": 8,
           "h": 16, "heads": 4, "v": 32, "layers": 2, "ffn": 4, "dtype": "float64", "p": 4,
           "spans": [0.1], "rank_max": [], "events": [[] for _ in range(4)],
           "coords": [[r // 2, 0, r % 2, 0, 2] for r in range(4)]}
    run = MeasuredRun.from_dict(res)
    assert run.microbatches == 2 and run.m == 0 and run.to_dict() == res
    assert run.label == "dp=2,pp=1,tp=megatron:2 zero=1 1f1b m=2 b8 s8 h16 L2"
    assert run.ranking_key.startswith("p=4 sharded step b8")


@pytest.mark.parametrize("content, words", [
    ("{}", "no calibrate and no heldout"),
    ("[1", "not valid JSON"),
    ("null", "holds null"),
    ('{"summasim_report": "accuracy"}', "no calibrate"),
    ('{"calibrate": 1, "heldout": []}', "list of measured runs"),
    ('{"calibrate": [{"kind": "ring"}], "heldout": []}', "lacks p"),
    ('{"calibrate": [{"kind": "nope"}], "heldout": []}', "unknown kind"),
])
def test_from_a_bad_measured_file_is_one_message_and_exit_2(tmp_path, content, words):
    out = tmp_path / "acc"
    out.mkdir()
    (out / "measured.json").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "summasim.costmodel", "accuracy", "--from",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr
    # --from reads an earlier --out: a missing one is not made
    missing = tmp_path / "none"
    proc = subprocess.run([sys.executable, "-m", "summasim.costmodel", "accuracy", "--from",
                           "--out", str(missing)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--from needs" in proc.stderr and not missing.exists()


def test_accuracy_with_no_launcher_is_a_user_error(tmp_path):
    """``SUMMASIM_MPIEXEC`` naming no program: one line, exit 2, before any work (it was
    "the machine fit failed" and exit 1)."""
    import os

    out = tmp_path / "acc"
    env = {**os.environ, "SUMMASIM_MPIEXEC": "no-such-launcher"}
    res = subprocess.run([sys.executable, "-m", "summasim.costmodel", "accuracy", "--out",
                          str(out), "--quick"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "no-such-launcher" in res.stderr and "SUMMASIM_MPIEXEC" in res.stderr
    assert not (out / "machine-fit.json").exists()


def test_from_refuses_runs_that_failed_validation_and_a_gpu_machine(tmp_path):
    """A held-out run recorded as failed (``ok: false``) measures nothing: ``--from``
    refuses it as the live run does, instead of scoring it. A GPU preset cannot price
    this machine's CPU runs (it scored 94% and wrote a "calibrated" NCCL machine where
    summasim.run looks for its default)."""
    out = tmp_path / "acc"
    out.mkdir()
    run = _transformer_result()
    run.update(ok=False, label="optimus 2x2")
    (out / "measured.json").write_text(json.dumps({"calibrate": [], "heldout": [run]}))
    argv = [sys.executable, "-m", "summasim.costmodel", "accuracy", "--from", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "failed their validation" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(argv + ["--machine", "dgx-a100"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "nccl machine" in proc.stderr, proc.stderr
    assert not (out / "machine-calibrated.json").exists()
