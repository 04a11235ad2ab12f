"""A long row shows it is alive: ``mpiutil.heartbeat`` says on stderr what rank 0 is
still doing once a phase has lasted ``every`` seconds, and ``summasim.run`` names the
phase of the row (the traced call, the check, a timed call)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time

from conftest import ROOT, mpi_env
from summasim.mpiutil import doing, heartbeat


def test_the_heartbeat_speaks_of_a_long_phase_and_not_of_a_short_one():
    out = io.StringIO()
    previous = doing()
    try:
        with heartbeat(0.5, stream=out):
            for i in range(10):                # 10 short phases: each ends well before 0.5 s
                doing(f"short phase {i}")
                time.sleep(0.02)
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
    """One rank, one product big enough that its phases outlast a 0.02 s heartbeat."""
    script = tmp_path / "beat.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), "--algorithms", "summa_ab", "--schemes", "none",
         "--sizes", "900", "900", "900", "--repeats", "2", "--no-predict", "--meshes", "none"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=mpi_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    beats = [line for line in proc.stderr.splitlines() if line.startswith("summasim: still")]
    said = "\n".join(beats)
    assert "summasim: still running summa_ab 1x1" in said, proc.stderr
    for phase in ("the traced call", "the check", "timed call 1"):
        assert f": {phase} (" in said, (phase, proc.stderr)
