"""``bench mesh``'s breakdown of a training step (:func:`summasim.bench.mesh.
step_breakdown`): for every timed run (each mesh and its pure tensor-parallel run), the
seconds inside MPI by kind of phase (tensor parallelism, data-parallel gradients,
pipeline hand-offs, ZeRO, other), exchanger steps against non-blocking requests, and
compute (the rest of the step), for the slowest rank and the mean over ranks, with the
BLAS threads and ranks per core in effect.

The launches run ``mpiexec -n 2`` and ``-n 4`` under ``timeout`` (as
tests/test_bench_halves.py does) with the default small model: at p = 2 the default
meshes are ``dp=2`` and ``dp=1,pp=2`` (pure run ``tp=megatron:2``), at p = 4
``dp=2,pp=2,tp=megatron:1`` (pure run ``tp=megatron:4``). The grouping of phases is
also tested in-process on made-up events."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, mpi_env
from summasim.bench import mesh as M
from summasim.trace import Event

REPEATS = 2
PART_KEYS = ("step_s", "compute_s", "comm_s", "comm", "exchanger_s", "requests_s")


def launch(mpiexec, n, args, timeout=240):
    cmd = ["timeout", "-k", "10", str(timeout)] + mpiexec + ["-n", str(n), sys.executable] + args
    return subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True)


def _check_parts(part: dict, where: str) -> None:
    """Every part finite and >= 0; compute plus the groups is the step, exchanger plus
    requests is the communication."""
    assert set(PART_KEYS) <= set(part), (where, part)
    assert set(part["comm"]) == set(M.COMM_GROUPS), (where, part["comm"])
    values = [part[k] for k in PART_KEYS if k != "comm"] + list(part["comm"].values())
    assert all(math.isfinite(v) and v >= 0 for v in values), (where, part)
    assert part["step_s"] > 0, (where, part)
    assert part["compute_s"] + sum(part["comm"].values()) == pytest.approx(
        part["step_s"], rel=1e-9, abs=1e-12), (where, part)
    assert part["comm_s"] == pytest.approx(sum(part["comm"].values()), rel=1e-9, abs=1e-12)
    assert part["exchanger_s"] + part["requests_s"] == pytest.approx(
        part["comm_s"], rel=1e-9, abs=1e-12), (where, part)


def _check_breakdown(bd: dict, p: int, where: str) -> None:
    assert bd is not None, where
    assert bd["steps"] == REPEATS and bd["source"], (where, bd)
    for k in ("untraced_s", "traced_s"):
        assert math.isfinite(bd[k]) and bd[k] > 0, (where, bd)
    assert math.isfinite(bd["trace_overhead"]) and bd["trace_overhead"] > -1, (where, bd)
    assert len(bd["ranks"]) == p
    for r, part in enumerate(bd["ranks"]):
        _check_parts(part, f"{where} rank {r}")
    slow = bd["slowest"]
    assert 0 <= slow["rank"] < p
    _check_parts(slow, f"{where} slowest")
    assert {k: slow[k] for k in PART_KEYS} == bd["ranks"][slow["rank"]]
    # the slowest rank computes longest
    assert slow["compute_s"] == max(r["compute_s"] for r in bd["ranks"])
    _check_parts(bd["mean"], f"{where} mean")
    for g in M.COMM_GROUPS:
        assert bd["mean"]["comm"][g] == pytest.approx(
            sum(r["comm"][g] for r in bd["ranks"]) / p, rel=1e-9, abs=1e-15)
    th = bd["threads"]
    assert th["blas_threads"] == [1] * p, th           # the bench limits BLAS to 1 per rank
    assert len(th["affinity_cores"]) == p and all(c >= 1 for c in th["affinity_cores"])
    assert th["cpu_count"] >= 1 and th["node_ranks"] == p
    assert th["ranks_per_core"] == pytest.approx(p / th["cpu_count"])


@pytest.mark.parametrize("p", [2, 4])
def test_bench_mesh_breaks_every_run_down(mpiexec, tmp_path, p):
    """Every mesh and pure run has a breakdown whose parts add up; data-parallel
    communication where dp = 2 and none in a pure tensor run; pipeline hand-offs
    where pp = 2; the table under the rows."""
    path = tmp_path / "mesh.json"
    proc = launch(mpiexec, p, ["-m", "summasim.bench", "mesh", "--repeats", str(REPEATS),
                               "--no-predict", "--json", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(path.read_text())["mesh"]
    expect = {2: ["dp=2,pp=1,tp=megatron:1", "dp=1,pp=2,tp=megatron:1"],
              4: ["dp=2,pp=2,tp=megatron:1"]}[p]
    assert [r["mesh"] for r in rows] == expect
    for row in rows:
        assert row["ok"] and "breakdown" in row and "pure_breakdown" in row, row.keys()
        assert "overlap_breakdown" not in row                 # --overlap off
        bd, pbd = row["breakdown"], row["pure_breakdown"]
        _check_breakdown(bd, p, row["mesh"])
        _check_breakdown(pbd, p, row["pure"])
        dp, pp = (int(x.split("=")[1]) for x in row["mesh"].split(",")[:2])
        for part in bd["ranks"]:
            # every rank of a dp = 2 mesh reduces its gradients over dp; every rank of a
            # pp = 2 mesh hands activations or gradients on; neither without
            assert (part["comm"]["data_parallel"] > 0) == (dp > 1), (row["mesh"], part)
            assert (part["comm"]["pipeline"] > 0) == (pp > 1), (row["mesh"], part)
            assert part["comm"]["tensor"] == 0          # tensor size 1: no tensor group
        for part in pbd["ranks"] + [pbd["slowest"], pbd["mean"]]:
            # pure tensor parallelism: no data or pipeline parallelism at all
            assert part["comm"]["data_parallel"] == 0 and part["comm"]["pipeline"] == 0
            assert part["comm"]["zero"] == 0
            assert part["comm"]["tensor"] > 0, (row["pure"], part)
        if dp > 1:
            assert bd["mean"]["comm"]["data_parallel"] > 0
            assert bd["slowest"]["comm"]["data_parallel"] > 0
        if pp > 1:
            assert bd["mean"]["comm"]["pipeline"] > 0
            assert bd["slowest"]["comm"]["pipeline"] > 0
    out = proc.stdout
    assert "where a step's time goes" in out and "threads: BLAS" in out
    for row in rows:                       # the existing table's row, then the breakdown's
        assert sum(ln.startswith(row["mesh"] + " ") for ln in out.splitlines()) == 2, out
        assert any(ln.startswith(f"pure {row['pure']} ") for ln in out.splitlines()), out
    assert f"{p} ranks on " in out and "ranks per core" in out


def _event(phase: str, seconds: float, blocking: bool = False) -> Event:
    return Event("sendrecv", "g", 2, -1, 8, seconds, phase, blocking)


def test_phase_groups():
    """The Trainer's own phases by kind; every tensor scheme's phase is tensor
    parallelism; no phase is other."""
    assert M.phase_group("dp.grads") == "data_parallel"
    assert M.phase_group("pp.fwd") == M.phase_group("pp.bwd") == "pipeline"
    assert M.phase_group("zero.gather") == M.phase_group("zero.params") == "zero"
    for other in ("embed.tie", "aux.loss", "aux.overflow", ""):
        assert M.phase_group(other) == "other", other
    for tensor in ("h0.fwd/tp.mlp.fc", "h3.bwd/aux.ln1", "embed.fwd", "loss.bwd",
                   "lmhead.fwd", "lnf.bwd", "loss", "sp.grads", "tp.attn.qkv"):
        assert M.phase_group(tensor) == "tensor", tensor
    # nested under a Trainer phase: grouped by the outermost
    assert M.phase_group("dp.grads/anything") == "data_parallel"


def test_comm_seconds_sums_each_group_and_each_wait():
    events = [_event("dp.grads", 1.0, True), _event("pp.fwd", 2.0), _event("pp.bwd", 4.0),
              _event("zero.gather", 8.0, True), _event("zero.params", 16.0, True),
              _event("h0.fwd/tp.mlp.fc", 32.0), _event("embed.tie", 64.0, True),
              _event("aux.loss", 128.0)]
    got = M.comm_seconds(events)
    assert got["comm"] == {"tensor": 32.0, "data_parallel": 1.0, "pipeline": 6.0,
                           "zero": 24.0, "other": 192.0}
    assert got["comm_s"] == 255.0
    assert got["exchanger_s"] == 1.0 + 8.0 + 16.0 + 64.0
    assert got["requests_s"] == 2.0 + 4.0 + 32.0 + 128.0
    parts = M._parts(300.0, got)
    assert parts["compute_s"] == 45.0 and parts["step_s"] == 300.0
    mean = M._mean_parts([parts, M._parts(100.0, M.comm_seconds([]))])
    assert mean["step_s"] == 200.0 and mean["comm_s"] == 127.5
    assert mean["compute_s"] == 72.5 and mean["comm"]["other"] == 96.0
