"""Whether a node's ranks share cores is judged on the union of their affinity masks:
a launcher that binds each rank to a core of its own (Open MPI's default when the
ranks fit, ``srun --cpu-bind``, Hydra's ``-bind-to core``) leaves every rank a mask of
one core, and 2 ranks on 2 such cores are not oversubscribed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, mpi_env, mpiexec_command

SCRIPT = textwrap.dedent("""
    import os, sys
    from mpi4py import MPI
    from summasim import comm as c
    rank = MPI.COMM_WORLD.Get_rank()
    cpus = [int(c) for c in sys.argv[3].split(",")]   # the test's CPUs: a binding launcher
                                                     # has already cut each rank's own mask
    # "own": each rank on a core of its own, as a binding launcher leaves it;
    # "shared": both ranks on one core
    os.sched_setaffinity(0, {cpus[rank % len(cpus)] if sys.argv[1] == "own" else cpus[0]})
    before = c.default_wait_policy()
    c.learn_node_cores()
    with open(os.path.join(sys.argv[2], f"rank{rank}"), "w") as out:   # no interleaving
        out.write(f"{rank} {before} {c.default_wait_policy()} {c.node_cores()} {c.cores()}")
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs to give each of 2 ranks a core of its own")
@pytest.mark.parametrize("how,policy,cpus", [("own", "spin", 2), ("shared", "sleep", 1)])
def test_ranks_bound_to_cores_of_their_own_are_not_oversubscribed(tmp_path, how, policy,
                                                                   cpus):
    script = tmp_path / "bind.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in mpi_env().items() if k != "SUMMASIM_WAIT"}
    proc = subprocess.run(["timeout", "-k", "5", "120", *mpiexec_command(), "-n", "2",
                           sys.executable, str(script), how, str(tmp_path),
                           ",".join(map(str, sorted(os.sched_getaffinity(0))))],
                          capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    assert [r[0] for r in rows] == ["0", "1"], rows
    for _, before, after, node, own in rows:
        assert own == "1" and before == "sleep", rows       # one rank's own mask: 1 core
        assert after == policy and node == str(cpus), rows
