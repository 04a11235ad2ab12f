"""A long row shows it is alive: ``mpiutil.heartbeat`` says on stderr what rank 0 is
still doing once a phase has lasted ``every`` seconds, and ``summasim.run`` names the
phase of the row (the traced call, the check, a timed call)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, mpi_env
from summasim.mpiutil import doing, heartbeat


def test_the_heartbeat_speaks_of_a_long_phase_and_not_of_a_short_one():
    out = io.StringIO()
    previous = doing()
    try:
        with heartbeat(0.5, stream=out):
            for i in range(10):                # 10 short phases, back to back
                doing(f"short phase {i}")
            doing("a long phase")
            time.sleep(1.8)                    # 3 periods and a bit
    finally:
        doing(previous)
    lines = out.getvalue().splitlines()
    assert lines, "nothing was said of a phase 3.6 periods long"
    assert all(line.startswith("summasim: still a long phase (") for line in lines), lines
    assert 2 <= len(lines) <= 3, lines          # once per period it lasted, not per wake-up


def test_the_heartbeat_stops_with_its_block():
    out = io.StringIO()
    with heartbeat(0.1, stream=out):
        doing("quick")
    time.sleep(0.35)
    assert out.getvalue() == ""


SCRIPT = textwrap.dedent("""
    import sys
    import summasim.run as run
    run.HEARTBEAT_S = 0.02
    sys.exit(run.main(sys.argv[1:]))
""")


def test_a_run_names_the_phase_it_is_still_in(tmp_path):
    """One rank, one product whose phases outlast a 0.02 s heartbeat. Which phases a beat
    falls in is a race (SciPy's GEMM holds Python's lock, so no beat lands inside one):
    the phases themselves are checked in order below."""
    script = tmp_path / "beat.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), "--algorithms", "summa_ab", "--schemes", "none",
         "--sizes", "900", "900", "900", "--repeats", "2", "--no-predict", "--meshes", "none"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=mpi_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    beats = [line for line in proc.stderr.splitlines()
             if line.startswith("summasim: still running")]
    row = "summasim: still running summa_ab 1x1 900x900x900 float64"
    # every beat names the row; one between two phases (the row's own words, while the
    # run works on after a phase ends) names no phase, and on a loaded machine there may
    # be several of those, but at least one beat lands in a phase and names it
    assert beats and all(b.startswith(row) for b in beats), proc.stderr
    assert any(b.startswith(row + ": ") for b in beats), proc.stderr


def test_a_product_and_a_ring_say_each_phase_in_order_and_give_the_callers_words_back(
        monkeypatch):
    """What ``doing()`` says through a product run and a ring run, in order; after each,
    the caller's words again (the self-test, bench gemm and the accuracy worker run
    several without setting them: one phase must not pile on the last)."""
    MPI = pytest.importorskip("mpi4py.MPI")
    from summasim.backends import get_backend
    from summasim.harness import execute
    from summasim.harness.cases import MatmulCase, RingCase

    said = []
    real = execute.doing

    def record(what=None):
        if what is not None:
            said.append(what)
        return real(what)

    monkeypatch.setattr(execute, "doing", record)
    previous = doing()
    try:
        doing("self-testing X")
        world, backend = MPI.COMM_WORLD, get_backend("numpy")
        for _ in range(2):
            execute.run_product(MatmulCase("summa_ab", 1, 1, 16, 16, 16), world, backend,
                                repeats=2)
            assert doing() == "self-testing X"
        execute.run_ring(RingCase(64), world, backend, repeats=2)
        assert doing() == "self-testing X"
    finally:
        doing(previous)
    assert all(s == "self-testing X" or s.startswith("self-testing X: ") for s in said), said
    phases = [s.split(": ", 1)[1] for s in said if s != "self-testing X"]
    runs, numbers = [], []                 # each run's phases, timed calls as one
    for ph in phases:
        if ph in ("making this rank's blocks", "the traced call") and (
                not runs or runs[-1][-1] == "timed call"):
            runs.append([])
            numbers.append([])
        if ph.startswith("timed call "):
            numbers[-1].append(int(ph.rsplit(" ", 1)[1]))
            ph = "timed call"
        if not runs[-1] or runs[-1][-1] != ph:
            runs[-1].append(ph)
    product = ["making this rank's blocks", "the traced call", "the check", "timed call"]
    assert runs == [product, product, product[1:]], runs
    assert all(n == list(range(1, len(n) + 1)) and len(n) >= 2 for n in numbers), numbers
