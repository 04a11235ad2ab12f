"""``bench allreduce``'s second table: ZeRO's two ring halves (``ring_reduce_scatter``,
``ring_allgather``) against MPI's reduce-scatter and all-gather, timed in the same rounds
as the all-reduces and checked once per size.

The launches run ``mpiexec -n 2`` and ``-n 3`` under ``timeout`` (as
tests/test_mpi_suites.py does), at sizes that p divides and sizes it does not (the
``_block`` / plain MPI calls and the ``v`` forms); a ``-c`` program that patches one half
on the last rank shows that a wrong result fails the run. The checking functions and the
wiring are also tested in-process, on one rank."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, mpi_env
from summasim.algorithms import chunk_bounds
from summasim.bench import allreduce as B

#: the halves' JSON keys and their MPI calls by whether p divides the size
HALVES = ("reduce_scatter", "allgather")
EVEN = {"reduce_scatter": "Reduce_scatter_block", "allgather": "Allgather"}
UNEVEN = {"reduce_scatter": "Reduce_scatter", "allgather": "Allgatherv"}
#: 0.0625077 MiB: 65544 bytes, 8193 float64 items (odd); 0.1875 MiB: 24576 (3 divides)
SIZES = {2: ("0.0625,0.0625077", [8192, 8193]), 3: ("0.0625,0.1875", [8192, 24576])}


def launch(mpiexec, n, args, timeout=150):
    cmd = ["timeout", "-k", "10", str(timeout)] + mpiexec + ["-n", str(n), sys.executable] + args
    return subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True)


def _bench(sizes, json_path, more=()):
    return ["allreduce", "--sizes-mib", sizes, "--repeats", "9", "--no-predict",
            "--json", str(json_path), *more]


@pytest.mark.parametrize("p", [2, 3])
def test_bench_allreduce_times_and_checks_the_halves(mpiexec, tmp_path, p):
    """Every size has both halves: positive, finite times of every repeat, MPI's call
    by whether p divides the size, the paired ratio's median inside its own interval
    (9 repeats: a 96% interval), a verdict, the check passed; the table prints them."""
    sizes, counts = SIZES[p]
    path = tmp_path / "ar.json"
    proc = launch(mpiexec, p, ["-m", "summasim.bench"] + _bench(sizes, path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(path.read_text())["allreduce"]
    assert [r["bytes"] // 8 for r in rows] == counts
    for row, n in zip(rows, counts):
        assert row["ok"]                                    # the all-reduces, as before
        h = row["halves"]
        assert h["ok"] is True, h
        names = EVEN if n % p == 0 else UNEVEN
        for half in HALVES:
            d = h[half]
            assert d["mpi_call"] == names[half]
            for key in ("ring", "mpi"):
                times = d[f"{key}_times"]
                assert len(times) == 9 == len(row["ring_times"])   # the same rounds
                assert all(0 < t < math.inf for t in times), times
                assert 0 < d[f"{key}_seconds"] < math.inf
                assert d[f"{key}_seconds"] == pytest.approx(float(np.median(times)))
            v = d["vs_mpi_paired"]
            ratios = [m / r for m, r in zip(d["mpi_times"], d["ring_times"])]
            assert v["median"] == pytest.approx(float(np.median(ratios)))
            assert v["low"] <= v["median"] <= v["high"], v
            assert v["coverage"] >= 0.95 and v["verdict"] in ("faster", "tie", "slower")
    lines = [ln for ln in proc.stdout.splitlines()
             if ln.startswith(("reduce-scatter ", "all-gather "))]
    assert len(lines) == 2 * len(rows), proc.stdout
    expected = [(row, half) for row in rows for half in HALVES]
    for line, (row, half) in zip(lines, expected):
        words = line.split()
        assert words[0] == {"reduce_scatter": "reduce-scatter",
                            "allgather": "all-gather"}[half]
        # the size sent (8193 items: 0.06251 MiB), as the main table labels it
        assert words[1] == B._mib(row["bytes"]) and "OK" in words and "FAIL" not in words
        assert row["bytes"] == 8 * max(1, int(row["mib"] * 2**20) // 8)
        assert words[-1] in ("quiet", "?") or words[-2] == "BUSY", words    # the load
        # the printed ratio is the JSON's paired median, inside the interval beside it
        (shown, low, high), = re.findall(r"(\S+)x\s+\[(\S+),(\S+)\]", line)
        v = row["halves"][half]["vs_mpi_paired"]
        assert float(shown) == pytest.approx(v["median"], abs=0.006), (line, v)
        assert float(low) <= float(shown) <= float(high), line
        assert words[words.index(f"[{low},{high}]") + 1] == v["verdict"]
    assert f"halves at p = {p}, against MPI over {len(rows)} sizes" in proc.stdout
    # the first table's lines are still the only ones that start with a size
    labels = [B._mib(row["bytes"]) for row in rows]        # the sizes sent
    first = [ln for ln in proc.stdout.splitlines() if ln.split() and ln.split()[0] in labels]
    assert len(first) == len(rows)


@pytest.mark.parametrize("name", ["ring_reduce_scatter", "ring_allgather"])
def test_bench_allreduce_fails_on_a_wrong_half(mpiexec, tmp_path, name):
    """One item of one half's result wrong on the last rank: the halves' check says FAIL
    on every size, the JSON says so, the all-reduces still check OK, and the run exits
    with status 1."""
    path = tmp_path / "ar.json"
    code = "\n".join([
        "import sys", "from mpi4py import MPI", "import summasim.algorithms as a",
        "from summasim.bench.__main__ import main",
        f"orig = a.{name}",
        "def wrong(flat, comm, *args, **kw):",
        "    got = orig(flat, comm, *args, **kw)",
        "    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:",
        "        flat[...] += 1e-3",          # every chunk, the one kept among them
        "    return got",
        f"a.{name} = wrong",
        f"sys.exit(main({_bench('0.0625', path)!r}))"])
    proc = launch(mpiexec, 2, ["-c", code])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (row,) = json.loads(path.read_text())["allreduce"]
    assert row["halves"]["ok"] is False and row["ok"] is True
    halves = [ln for ln in proc.stdout.splitlines()
              if ln.startswith(("reduce-scatter ", "all-gather "))]
    assert len(halves) == 2 and all(" FAIL " in ln for ln in halves), proc.stdout
    assert "a benchmarked result failed its check" in proc.stdout


# -- in-process, one rank ----------------------------------------------------------------
def test_the_reduce_scatter_check_reads_the_kept_chunk_only():
    ref = np.arange(10.0)
    bounds = chunk_bounds(10, 3)                        # (0, 4), (4, 7), (7, 10)
    got = np.zeros(10)
    got[4:7] = ref[4:7] + 1e-12                         # partial sums elsewhere: fine
    assert B.reduce_scatter_correct(got, ref, bounds[1], atol=1e-9)
    assert not B.reduce_scatter_correct(got, ref, bounds[0], atol=1e-9)   # the wrong chunk
    got[6] += 1e-6                                      # one item beyond the tolerance
    assert not B.reduce_scatter_correct(got, ref, bounds[1], atol=1e-9)
    assert not B.reduce_scatter_correct(np.zeros(9), ref, bounds[1], atol=1.0)  # shape


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_allgather_check_wants_every_chunk_from_its_owner(dtype):
    p, n = 3, 3001                                     # 3 does not divide it
    bounds = chunk_bounds(n, p)
    for name, owners in (("ag_ring", [2, 0, 1]), ("ag_mpi", [0, 1, 2])):
        assert B.chunk_owners(name, p) == owners
        for r in range(p):                              # rank r contributes its own chunk
            assert owners[B.own_chunk(name, p, r)] == r
        good = np.concatenate([B.gather_pattern(owners[c], lo, hi, dtype)
                               for c, (lo, hi) in enumerate(bounds)])
        assert good.dtype == dtype and B.allgather_correct(good, bounds, owners)
        lo, hi = bounds[1]
        for wrong in (lambda g: g.__setitem__(slice(lo, hi), 0),          # never arrived
                      lambda g: g.__setitem__(slice(lo, hi), B.gather_pattern(
                          (owners[1] + 1) % p, lo, hi, dtype)),           # the wrong rank
                      lambda g: g.__setitem__(slice(lo, hi), B.gather_pattern(
                          owners[1], lo + 1, hi + 1, dtype)),             # shifted by one
                      lambda g: g.__setitem__(hi - 1, g[hi - 1] + 1)):    # one item
            bad = good.copy()
            wrong(bad)
            assert not B.allgather_correct(bad, bounds, owners)
        assert not B.allgather_correct(good[:-1], bounds, owners)


def test_gather_pattern_is_exact_and_tells_owners_apart():
    for dtype in (np.float32, np.float64):
        a = B.gather_pattern(15, 0, 5000, dtype)
        assert np.array_equal(a.astype(np.float64),
                              15 + 1 + (np.arange(5000) % 1021) / 1024)   # exact
        b = B.gather_pattern(14, 0, 5000, dtype)
        assert np.all(np.floor(a) != np.floor(b))


def test_mpi_calls_follow_whether_p_divides_the_size():
    assert B.mpi_half_calls(chunk_bounds(12, 4)) == EVEN
    assert B.mpi_half_calls(chunk_bounds(13, 4)) == UNEVEN
    assert B.mpi_half_calls(chunk_bounds(3, 1)) == EVEN


def _one_rank(halves=True, **kw):
    from mpi4py import MPI

    return B.bench_allreduce(MPI.COMM_SELF, [0.0625], np.float64, 6, lambda s: None,
                             halves=halves, **kw)


def test_the_halves_ride_in_the_all_reduces_rounds_and_can_be_left_out():
    (row,) = _one_rank()
    h = row["halves"]
    assert row["ok"] and h["ok"] and set(h) == {"ok", *HALVES}
    for half in HALVES:
        assert len(h[half]["ring_times"]) == len(h[half]["mpi_times"]) == 6 == \
            len(row["ring_times"])
        assert h[half]["vs_mpi_paired"]["low"] is not None          # 6 repeats: 96.9%
    (row,) = _one_rank(halves=False)
    assert row["halves"] is None and row["ok"]
    from summasim.bench.__main__ import parse_args

    assert parse_args(["allreduce", "--no-halves"]).no_halves
    assert not parse_args(["allreduce"]).no_halves
    assert not parse_args(["all"]).no_halves                        # bench all shares it


@pytest.mark.parametrize("name", ["ring_reduce_scatter", "ring_allgather"])
def test_a_wrong_half_fails_the_row_and_the_run(monkeypatch, name):
    """On one rank the halves move nothing, so a half that scales its buffer is wrong:
    the row's halves fail, the all-reduces do not, and ``run`` reports failure (the exit
    status 1 of ``bench``)."""
    import summasim.algorithms as alg
    from mpi4py import MPI

    from summasim.backends import get_backend
    from summasim.bench.__main__ import parse_args
    from summasim.bench.common import Run

    orig = getattr(alg, name)

    def wrong(flat, comm, *a, **kw):
        got = orig(flat, comm, *a, **kw)
        flat *= 2
        return got

    monkeypatch.setattr(alg, name, wrong)
    (row,) = _one_rank()
    assert row["ok"] and row["halves"]["ok"] is False
    args = parse_args(["allreduce", "--sizes-mib", "0.0625", "--repeats", "1",
                       "--no-predict"])
    said = []
    bench = Run(args, MPI.COMM_SELF, get_backend("numpy"), {})
    bench.say = said.append
    assert B.run(bench) is False
    assert any(s.startswith(("reduce-scatter ", "all-gather ")) and " FAIL " in s
               for s in said), said
