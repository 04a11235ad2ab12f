"""When a fitted Machine may be trusted: sanity checks, busy fits, one fit at a time.

Serial: ``resolve_machine`` runs on ``MPI.COMM_SELF`` with ``run_fit`` and the load probe
replaced, so each test sets up exactly the situation it checks; one test runs the real
``run_fit`` on 2 ranks to see it refuse an impossible fit on every rank.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from summasim.harness import fitbench as fitmod
from summasim.costmodel.machine import (Link, Machine, SharedCore, list_presets, load_preset,
                                        sanity_problems)
from summasim.harness import load, machinefile as mf

MPI = pytest.importorskip("mpi4py.MPI")


def _fitted(**kw) -> Machine:
    """A plausible quick fit of this VM on a day its CPU differs from the preset's."""
    base = load_preset("local-2core-mpich")
    li = base.intra            # the same link on a CPU that is twice as slow at everything
    slow = Link(2 * li.alpha_small, 2 * li.beta_small, 2 * li.alpha_large, 2 * li.beta_large,
                li.eager_threshold)
    m = base.replace(name="fit-test", shared_core=None, gamma_elementwise=0.0, layer_seconds=0.0,
                     source="summasim.costmodel fit on test, 2 ranks, MPICH Version:  5.0.2",
                     intra=slow, memory_bandwidth=4.0e10, cache_bytes=32.0 * 2**20,
                     notes={"quick": True, "memory_bandwidth": 4.0e10,
                            "cache_bytes": 32.0 * 2**20})
    return m.replace(**kw)


def _broken_link(field, value) -> Machine:
    """A fit whose link holds a value the Link constructor would refuse (as a fit
    gone wrong, or a file edited by hand, could produce)."""
    link = Link(2.8e-6, 1.1e-10, 5.5e-6, 1.4e-10, 8192)
    object.__setattr__(link, field, value)
    m = _fitted()
    object.__setattr__(m, "intra", link)
    return m


class FakeFit:
    """Stands in for ``harness.fitbench.run_fit``: returns ``machine`` or raises ``error``,
    counting its calls."""

    def __init__(self, machine=None, error=None):
        self.machine, self.error, self.calls = machine, error, 0

    def __call__(self, comm, **kw):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.machine


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh results folder, one rank allowed to fit, a quiet machine by default."""
    state = {"foreign": 0.0}
    monkeypatch.setattr(load, "foreign_cpu", lambda interval=1.0, exclude=(): state["foreign"])
    monkeypatch.setattr(mf, "FIT_RANKS", 1)
    said = []
    path = str(tmp_path / "results" / "machine.json")
    calibrated = str(tmp_path / "results" / "accuracy" / "machine-calibrated.json")

    def resolve(fake, spec=None):
        monkeypatch.setattr(fitmod, "run_fit", fake)
        return mf.resolve_machine(spec, MPI.COMM_SELF, said.append, path=path,
                                  calibrated=calibrated)

    return dict(state=state, said=said, path=path, calibrated=calibrated, resolve=resolve)


# --------------------------------------------------------------------------- sanity
@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_is_plausible(name):
    m = load_preset(name)
    assert m.fit_conditions is None and not m.fitted_busy          # presets carry none
    assert sanity_problems(m) == []
    assert sanity_problems(m.to_dict()) == []


def test_a_plausible_fit_has_no_problems():
    assert sanity_problems(_fitted()) == []


@pytest.mark.parametrize("field,value,words", [
    ("beta_small", 0.0, "infinite bandwidth"),
    ("beta_large", 1e-14, "above the ceiling"),                  # 100 TB/s
    ("beta_large", math.inf, "infinite"),
    ("beta_small", 1e-5, "below"),                               # 100 kB/s
    ("alpha_small", 0.0, "no message is free"),
    ("alpha_large", -1e-6, "no message is free"),
    ("alpha_small", math.nan, "latency"),
])
def test_sanity_names_impossible_links(field, value, words):
    problems = sanity_problems(_broken_link(field, value))
    assert problems and any(words in p for p in problems), problems
    regime = field.split("_")[1]
    assert any(regime in p for p in problems)


def test_sanity_refuses_a_negative_alpha_in_a_file_dict():
    d = _fitted().to_dict()
    d["intra"]["alpha_small"] = -1e-6
    problems = sanity_problems(d)
    assert len(problems) == 1 and "alpha_small" in problems[0]


def test_sanity_checks_gemm_reductions_and_shared_core():
    m = _fitted()
    object.__setattr__(m, "gamma_gemm", {"float64": ((64.0, 1e-20),)})     # 1e20 flop/s
    assert any("GEMM float64" in p for p in sanity_problems(m))
    m = _fitted()
    object.__setattr__(m, "gamma_gemm", {"float64": ((64.0, math.inf),)})
    assert any("GEMM float64" in p for p in sanity_problems(m))
    m = _fitted(gamma_reduce=1e-15)                                          # 1 PB/s adds
    assert any("gamma_reduce" in p for p in sanity_problems(m))
    m = _fitted(shared_core=SharedCore(work_factor=0.0))
    assert any("work_factor" in p for p in sanity_problems(m))


def test_sanity_refuses_a_fit_that_misses_its_own_points():
    quiet = _fitted(notes={"fit": {"small": [2.8e-6, 1.1e-10, 0.008],
                                   "large": [5.5e-6, 1.4e-10, 0.012]}})
    assert sanity_problems(quiet) == []
    noisy = _fitted(notes={"fit": {"small": [4.6e-5, 4.3e-8, 0.279],
                                   "large": [6.0e-5, 5.9e-10, 0.149]}})
    problems = sanity_problems(noisy)
    assert len(problems) == 1 and "small-message fit misses its own points by 28%" in problems[0]


def test_sanity_compares_gemm_with_one_process_alone():
    g = _fitted().gamma(1024)
    ok = _fitted(notes={"gemm_single": {"dtype": "float64", "n": 1024, "seconds_per_flop": g}})
    assert sanity_problems(ok) == []
    shared = _fitted(notes={"gemm_single": {"dtype": "float64", "n": 1024,
                                            "seconds_per_flop": g / 2.0}})
    problems = sanity_problems(shared)
    assert len(problems) == 1 and "2.00x slower than one process alone" in problems[0]


# --------------------------------------------------------------------------- load probe
class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_foreign_cpu_counts_short_lived_processes_and_excludes_our_ranks(monkeypatch):
    """Two fabricated /proc readings 1 s apart ({pid: (ppid, own ticks, reaped children's
    ticks)}): a long-lived foreign process, a foreign spawner whose children live less
    than the interval, this process with a child, and another rank of our job."""
    me, rank1 = 10, 40
    a = {1: (0, 0, 0), me: (1, 100, 0), 11: (me, 5, 0), 20: (1, 500, 0),
         30: (1, 0, 0), 31: (30, 40, 0), rank1: (1, 1000, 0)}
    b = {1: (0, 0, 0), me: (1, 200, 0), 11: (me, 90, 0), 20: (1, 550, 0),
         30: (1, 2, 70),                 # reaped 31 (70 ticks in its life, 40 before a)
         32: (30, 25, 0),                # started inside the interval
         rank1: (1, 1100, 0)}
    readings = iter([a, b])
    monkeypatch.setattr(load, "_proc_cpu_ticks", lambda: next(readings))
    monkeypatch.setattr(load, "time", _Clock())
    monkeypatch.setattr(load.os, "getpid", lambda: me)
    hz = os.sysconf("SC_CLK_TCK")
    # foreign: 50 (pid 20) + 2 + 70 - 40 (the spawner and its reaped child) + 25 (new)
    assert load.foreign_cpu(1.0, exclude=[rank1]) == pytest.approx(107 / hz)
    readings = iter([a, b])
    monkeypatch.setattr(load, "_proc_cpu_ticks", lambda: next(readings))
    assert load.foreign_cpu(1.0) == pytest.approx(207 / hz)          # rank 1 counted


# --------------------------------------------------------------------------- provenance
def test_fit_conditions_round_trip_and_old_files_load(tmp_path):
    fc = {"foreign_cpu_before": 0.12, "foreign_cpu_after": 1.5, "loadavg": 3.2,
          "time": "2026-11-23T14:00:00Z", "limit": 0.25, "busy": True}
    m = _fitted(fit_conditions=fc)
    assert m.fitted_busy
    assert Machine.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    m.save(tmp_path / "m.json")
    back = Machine.load(tmp_path / "m.json")
    assert back == m and back.fit_conditions == fc and back.fitted_busy
    old = _fitted().to_dict()
    assert "fit_conditions" not in old                     # not written when not recorded
    assert Machine.from_dict(old).fit_conditions is None
    with pytest.raises(ValueError, match="fit_conditions.busy"):
        Machine.from_dict({**old, "fit_conditions": {"busy": "yes"}})
    with pytest.raises(ValueError, match="fit_conditions.foreign_cpu_after"):
        Machine.from_dict({**old, "fit_conditions": {"foreign_cpu_after": -1}})


# --------------------------------------------------------------------------- spec
class _NoMPI:
    def __getattr__(self, name):
        raise AssertionError(f"resolve_machine communicated ({name}) before checking the spec")


def test_bad_spec_is_a_value_error_before_any_communication(tmp_path):
    with pytest.raises(ValueError, match="no such file, and not a preset"):
        mf.resolve_machine("no-such-machine", _NoMPI(), print)
    with pytest.raises(ValueError, match="no such file"):
        mf.check_machine_spec(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        mf.check_machine_spec(str(bad))
    with pytest.raises(ValueError, match="directory"):
        mf.check_machine_spec(str(tmp_path))
    mf.check_machine_spec(None)
    mf.check_machine_spec("local-2core-mpich")


def test_explicit_spec_is_used_but_its_problems_are_said(env, tmp_path):
    f = tmp_path / "m.json"
    _fitted(fit_conditions={"busy": True, "foreign_cpu_after": 1.0}).save(f)
    got = env["resolve"](FakeFit(error=AssertionError("no fit")), spec=str(f))
    assert got.name == "fit-test"
    assert any("busy" in s for s in env["said"])


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("broken", [
    lambda: _broken_link("beta_small", 0.0),
    lambda: _broken_link("beta_large", 1e-14),
    lambda: _broken_link("alpha_small", -1e-6),
], ids=["beta0", "inf-bandwidth", "negative-alpha"])
def test_an_impossible_fit_is_neither_saved_nor_used(env, broken):
    fake = FakeFit(broken())
    got = env["resolve"](fake)
    assert fake.calls == 1
    assert got == load_preset("local-2core-mpich")
    assert not os.path.exists(env["path"])
    assert any("not saved and not used" in s for s in env["said"])


def test_a_fit_refused_by_run_fit_falls_back_to_the_preset(env):
    fake = FakeFit(error=fitmod.FitRejected(["intra small: beta = 0"]))
    got = env["resolve"](fake)
    assert got == load_preset("local-2core-mpich") and not os.path.exists(env["path"])
    assert any("refused" in s and "beta = 0" in s for s in env["said"])


def test_a_refused_fit_is_tried_once_more_before_the_preset(env):
    class NoisyOnce(FakeFit):
        def __call__(self, comm, **kw):
            self.calls += 1
            if self.calls == 1:
                raise fitmod.FitRejected(["intra small: misses its own points by 69%"])
            return self.machine

    fake = NoisyOnce(_fitted())
    got = env["resolve"](fake)
    assert fake.calls == 2 and got != load_preset("local-2core-mpich")
    assert os.path.exists(env["path"]) and any("once more" in s for s in env["said"])
    always = FakeFit(error=fitmod.FitRejected(["intra small: beta = 0"]))
    os.unlink(env["path"])
    env["resolve"](always)
    assert always.calls == 2


@pytest.mark.parametrize("old_format", [False, True])
def test_a_saved_file_that_fails_the_checks_is_refitted(env, old_format):
    os.makedirs(os.path.dirname(env["path"]))
    bad = _fitted().to_dict()
    bad["intra"]["beta_small"] = 0.0                    # a distorted fit saved long ago
    if old_format:
        bad.pop("format")                               # written before the field was
    with open(env["path"], "w") as fh:
        json.dump(bad, fh)
    fake = FakeFit(_fitted())
    got = env["resolve"](fake)
    assert fake.calls == 1 and got.intra.beta_small > 0
    assert any("fails the sanity checks" in s for s in env["said"])
    assert Machine.load(env["path"]).intra.beta_small > 0


def test_a_file_that_is_no_machine_at_the_fit_path_is_not_replaced(env):
    """A run report written to results/machine.json (``--json results/machine.json``)
    is not a machine: the next run fits for itself and leaves the file as it was."""
    os.makedirs(os.path.dirname(env["path"]))
    mine = json.dumps({"summasim_report": "run", "rows": []})
    with open(env["path"], "w") as fh:
        fh.write(mine)
    fake = FakeFit(_fitted())
    got = env["resolve"](fake)
    assert fake.calls == 1 and got.name == "fit-test"
    with open(env["path"]) as fh:
        assert fh.read() == mine
    assert any("not a machine file" in s and "will not replace it" in s for s in env["said"])


def test_one_rank_with_nothing_saved_takes_the_preset_and_makes_no_files(env, monkeypatch):
    """A singleton run cannot fit: it uses the preset and leaves no lock file and no
    results/ folder behind (it made both before)."""
    monkeypatch.setattr(mf, "FIT_RANKS", 2)
    fake = FakeFit(error=AssertionError("one rank must not fit"))
    assert env["resolve"](fake) == load_preset("local-2core-mpich")
    assert not os.path.exists(os.path.dirname(env["path"]))
    assert any("one rank cannot fit" in s for s in env["said"])


def test_a_calibrated_file_that_fails_the_checks_is_not_used(env):
    bad = _broken_link("beta_small", 0.0).replace(name="calibrated")
    os.makedirs(os.path.dirname(env["calibrated"]))
    with open(env["calibrated"], "w") as fh:
        json.dump(bad.to_dict(), fh)
    got = env["resolve"](FakeFit(_fitted()))
    assert got.name != "calibrated"
    assert any("accuracy benchmark" in s and "sanity" in s for s in env["said"])


def test_a_calibration_without_the_ring_byte_price_is_used_with_a_note(env):
    ref = load_preset("local-2core-mpich")
    old = ref.replace(name="calibrated-before",
                      shared_core=SharedCore(**{**ref.shared_core.__dict__,
                                                "mpi_hop_seconds_per_byte": None}))
    os.makedirs(os.path.dirname(env["calibrated"]))
    old.save(env["calibrated"])
    got = env["resolve"](FakeFit(error=AssertionError("a calibration is there")))
    assert got.name == "calibrated-before"
    assert any("no byte price of ring steps" in s for s in env["said"])
    env["said"].clear()
    ref.replace(name="calibrated-now").save(env["calibrated"])
    assert env["resolve"](FakeFit()).name == "calibrated-now"
    assert not any("byte price" in s for s in env["said"])


# --------------------------------------------------------------------------- busy fits
def test_a_busy_fit_is_marked_warned_about_and_replaced_when_quiet(env):
    env["state"]["foreign"] = 1.4                        # another job uses 1.4 cores
    first = FakeFit(_fitted())
    got = env["resolve"](first)
    assert first.calls == 1 and got.fitted_busy
    saved = Machine.load(env["path"])
    assert saved.fitted_busy and saved.fit_conditions["foreign_cpu_before"] == 1.4
    assert any("WARNING" in s and "busy" in s for s in env["said"])
    # a later run on a still busy machine uses it, warns again, does not fit
    env["said"].clear()
    again = FakeFit(error=AssertionError("must not refit while busy"))
    got = env["resolve"](again)
    assert got.fitted_busy and again.calls == 0
    warn = [s for s in env["said"] if "fitted while the machine was busy" in s]
    assert warn and "refit" in warn[0] and env["path"] in warn[0]
    # once the machine is quiet, the next run refits and saves a trusted fit
    env["state"]["foreign"] = 0.0
    quiet = FakeFit(_fitted())
    got = env["resolve"](quiet)
    assert quiet.calls == 1 and not got.fitted_busy
    assert not Machine.load(env["path"]).fitted_busy


def test_a_quiet_fit_records_its_conditions_and_is_reused(env):
    fake = FakeFit(_fitted())
    got = env["resolve"](fake)
    fc = got.fit_conditions
    assert fc["busy"] is False and fc["foreign_cpu_before"] == 0.0 and fc["limit"] == 0.25
    assert "time" in fc and "loadavg" in fc
    env["said"].clear()
    again = FakeFit(error=AssertionError("must reuse the saved fit"))
    assert env["resolve"](again) == got and again.calls == 0
    assert any("fitted earlier" in s for s in env["said"])


def test_a_fit_composed_with_an_older_preset_is_refitted(env, monkeypatch):
    """The saved fit carries the preset's run-level models as they were when it was
    composed; once summasim ships a recalibrated preset, the next run refits instead of
    predicting with the old copy (this once priced the p = 16 ring at +116 %)."""
    first = FakeFit(_fitted())
    got = env["resolve"](first)
    assert first.calls == 1 and got.notes["composed"]["from_preset"]
    assert mf.stale_composition(Machine.load(env["path"])) is None
    ref = load_preset("local-2core-mpich")
    newer = ref.replace(shared_core=SharedCore(**{**ref.shared_core.__dict__,
                                                   "sync_seconds": 2e-4}))
    monkeypatch.setattr(mf, "load_preset", lambda name: newer)
    env["said"].clear()
    again = FakeFit(_fitted())
    got = env["resolve"](again)
    assert again.calls == 1, "a fit composed with the old preset was reused"
    assert got.shared_core.sync_seconds == 2e-4
    assert any("out of date" in s and "older version of the preset" in s for s in env["said"])
    # one rank cannot refit: it uses the (new) preset rather than the stale file
    newest = newer.replace(shared_core=SharedCore(**{**newer.shared_core.__dict__,
                                                     "sync_seconds": 3e-4}))
    monkeypatch.setattr(mf, "load_preset", lambda name: newest)
    monkeypatch.setattr(mf, "FIT_RANKS", 2)
    env["said"].clear()
    alone = FakeFit(error=AssertionError("one rank must not fit"))
    assert env["resolve"](alone).shared_core.sync_seconds == 3e-4 and alone.calls == 0
    assert any("one rank cannot refit" in s for s in env["said"])
    # a fit saved by a summasim that did not record the digest is out of date too
    old = Machine.load(env["path"])
    comp = {k: v for k, v in old.notes["composed"].items() if k != "preset_digest"}
    assert mf.stale_composition(old.replace(notes={**old.notes, "composed": comp}))
    # a fit that took nothing from a preset never is
    assert mf.stale_composition(old.replace(notes={})) is None


@pytest.mark.parametrize("note", ["memory_bandwidth", "cache_bytes"])
def test_a_fit_without_the_floor_s_inputs_is_refitted(env, note, monkeypatch):
    """The memory floor of the predictions needs the node's memory bandwidth and cache:
    a fit saved by a summasim that did not measure them is refitted, and the composed
    machine keeps the measured values (from the preset branch, whose notes are the
    preset's, too)."""
    first = FakeFit(_fitted())
    got = env["resolve"](first)
    assert first.calls == 1 and got.memory_bandwidth == 4.0e10
    assert got.cache_bytes == 32 * 2**20
    assert {"memory bandwidth", "cache"} <= set(got.notes["composed"]["measured"])
    assert mf.stale_fit(Machine.load(env["path"])) is None
    old = Machine.load(env["path"])
    notes = {k: v for k, v in old.notes.items() if k != note}
    old.replace(**{note: None}, notes=notes).save(env["path"])
    env["said"].clear()
    again = FakeFit(_fitted())
    got = env["resolve"](again)
    assert again.calls == 1 and got.memory_bandwidth == 4.0e10
    assert got.cache_bytes == 32 * 2**20
    assert any("no measurement of the node's memory bandwidth and cache" in s
               for s in env["said"])
    # one rank cannot refit, and needs no floor: it keeps the saved fit, not the preset
    old = Machine.load(env["path"])
    notes = {k: v for k, v in old.notes.items() if k != note}
    old.replace(**{note: None}, notes=notes).save(env["path"])
    monkeypatch.setattr(mf, "FIT_RANKS", 2)
    env["said"].clear()
    alone = FakeFit(error=AssertionError("one rank must not fit"))
    got = env["resolve"](alone)
    assert alone.calls == 0 and got.name == old.name and got.intra == old.intra
    assert any("predates the memory floor" in s for s in env["said"])
    # the fit matching the preset: the preset's machine, with the measured values
    ref = load_preset("local-2core-mpich")
    same = mf.compose_with_preset(
        ref.replace(name="fit-same", memory_bandwidth=3.0e10, cache_bytes=1.0e7,
                    notes={"memory_bandwidth": 3.0e10, "cache_bytes": 1.0e7}),
        lambda line: None)
    assert same.name.endswith("+gemm") and same.memory_bandwidth == 3.0e10
    assert same.cache_bytes == 1.0e7 and mf.stale_fit(same) is None


# --------------------------------------------------------------------------- one fit at a time
def test_a_second_job_waits_for_the_first_jobs_fit_and_uses_it(env, tmp_path):
    """Another process holds the fit lock for 1 s and saves its fit before releasing it:
    resolve_machine waits for it and uses that file instead of fitting again."""
    theirs = _fitted(name="fit-by-the-other-job")
    staged = tmp_path / "staged.json"
    theirs.save(staged)
    os.makedirs(os.path.dirname(env["path"]), exist_ok=True)
    holder = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({env['path'] + '.lock'!r}, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(0.5)
        os.replace({str(staged)!r}, {env['path']!r})
        time.sleep(0.5)
        fcntl.flock(fd, fcntl.LOCK_UN)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        fake = FakeFit(error=AssertionError("fitted while another job held the lock"))
        got = env["resolve"](fake)
        waited = time.monotonic() - t0
    finally:
        proc.wait(timeout=30)
    assert waited >= 0.8, waited
    assert fake.calls == 0 and got.name == "fit-by-the-other-job"
    assert any("another job is fitting" in s for s in env["said"])


# --------------------------------------------------------------------------- preset parts
def test_on_the_presets_machine_only_gemm_is_measured():
    ref = load_preset("local-2core-mpich")
    slow = {dt: [(n, g * 3.0) for n, g in pts if 128 <= n <= 1024]
            for dt, pts in ref.gamma_gemm.items()}
    fitted = ref.replace(name="fit-test", shared_core=None, gamma_elementwise=0.0,
                         layer_seconds=0.0, gamma_gemm=slow,
                         source="summasim.costmodel fit on vm, MPICH Version:  5.0.2")
    said = []
    got = mf.compose_with_preset(fitted, said.append)
    assert got.intra == ref.intra and got.shared_core == ref.shared_core
    assert got.gamma(512) == pytest.approx(3.0 * ref.gamma(512))
    assert got.gamma(32) == pytest.approx(3.0 * ref.gamma(32))    # extended with the preset's shape
    assert got.notes["composed"]["measured"] == ["GEMM rates"]
    assert len(said) == 1 and "GEMM rates measured now" in said[0]


def test_on_another_cpu_links_are_measured_and_run_models_borrowed():
    ref = load_preset("local-2core-mpich")
    said = []
    got = mf.compose_with_preset(_fitted(), said.append)
    assert got.intra == _fitted().intra and got.shared_core == ref.shared_core
    assert "links" in got.notes["composed"]["measured"]
    assert len(said) == 1 and "2.0" in said[0] and "not the preset" in said[0]
    other = _fitted(source="fit, Open MPI v5.0.5")
    ok, why = mf.preset_matches(other, ref)
    assert not ok and "Open MPI" in why


def test_mpi_library_names():
    assert mf.mpi_library("MPICH Version:      5.0.2") == ("MPICH", "5.0.2")
    assert mf.mpi_library("2-core VM, MPICH 5.0.2 (pip wheel)") == ("MPICH", "5.0.2")
    assert mf.mpi_library("Open MPI v5.0.5, package: Open MPI") == ("Open MPI", "5.0.5")
    assert mf.mpi_library("datasheet") is None


# --------------------------------------------------------------------------- run_fit itself
RUN_FIT_REFUSES = """
import sys
from mpi4py import MPI
from summasim.harness import fitbench as fit

real = fit.fit_regimes
def broken(*a, **k):                      # a fit that hit the bound: infinite bandwidth
    rf = real(*a, **k)
    rf.small.beta = 0.0
    return rf
fit.fit_regimes = broken
try:
    fit.run_fit(MPI.COMM_WORLD, quick=True, max_bytes=1 << 16, group_sizes=(2,),
                gemm_sizes=(64,), dtypes=("float64",), say=lambda m: None)
except fit.FitRejected as exc:
    ok = "infinite bandwidth" in str(exc) and bool(exc.problems)
    print(f"rank {MPI.COMM_WORLD.Get_rank()} refused {ok}", flush=True)
    sys.exit(0)
print("accepted", flush=True)
sys.exit(1)
"""


def _run_two_ranks(tmp_path, name: str, text: str, limit: int):
    """``text`` as a script under the suite's launcher (``conftest.mpiexec_command``)
    with 2 ranks and a ``limit``-second timeout."""
    from conftest import mpiexec_command

    script = tmp_path / name
    script.write_text(text)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(["timeout", "-k", "5", str(limit), *mpiexec_command(), "-n", "2",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=limit + 30, env=env)


def test_run_fit_refuses_an_impossible_fit_on_every_rank(tmp_path):
    proc = _run_two_ranks(tmp_path, "refuse.py", RUN_FIT_REFUSES, 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = sorted(re.findall(r"rank (\d) refused (True|False)", proc.stdout))
    assert said == [("0", "True"), ("1", "True")], proc.stdout


FIT_SAYS = """
import json
from mpi4py import MPI
from summasim.harness import fitbench as fit

out = {}
for mode in ("quiet", "verbose"):
    said, points = [], []
    fit.run_fit(MPI.COMM_WORLD, quick=True, max_bytes=1 << 16, group_sizes=(2,),
                gemm_sizes=(64,), dtypes=("float64",), say=said.append,
                detail=points.append if mode == "quiet" else None, check=False)
    out[mode] = [said, points]
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(out), flush=True)
"""


def test_a_fit_says_one_summary_and_keeps_its_points_apart(tmp_path):
    """By default the fit's measured points go to ``detail`` (``costmodel fit`` drops
    them unless --verbose; they are in the saved notes) and ``say`` gets one summary
    line; without ``detail`` every point goes to ``say`` as before."""
    proc = _run_two_ranks(tmp_path, "says.py", FIT_SAYS, 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    said, points = out["quiet"]
    assert sum(line.startswith("fitted 2 ranks in ") for line in said) == 1, said
    assert not any("ping-pong" in line or "alpha =" in line for line in said), said
    assert any("ping-pong" in line for line in points) and any("alpha =" in line
                                                               for line in points), points
    said, points = out["verbose"]
    assert points == [] and any("ping-pong" in line for line in said), said
