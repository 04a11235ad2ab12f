"""The main job's planning, size fitting, report format and CLI (serial)."""

from __future__ import annotations

import json
import math
import os

import pytest

from summasim import run
from summasim.algorithms.table import ALGORITHMS, PRODUCTS
from summasim.spec import grid_shapes
from summasim.harness.check import Check
from summasim.harness.result import Result
from summasim.cli import UsageError
from summasim.harness.plan import DEFAULT_SIZES, plan_products
from summasim.harness.report import format_header, format_row, format_transformer, \
    prediction_summary, row_record
from summasim.harness.transformer import SchemeReport
from summasim.jsonio import write_json_atomic
from summasim.layout import local_shape


@pytest.mark.parametrize("p,ran,skipped", [
    (1, {"cannon_ab": ["1x1"], "summa25_ab": ["[1,1,1]"], "ring_allreduce": ["ring p=1"]}, []),
    (2, {"summa25_ab": ["[1,1,2]"], "summa_ab": ["1x2"]}, ["cannon_ab"]),
    (6, {"summa_abt": ["2x3"], "summa25_atb": ["[1,3,2]"]}, ["cannon_ab", "sd25_ab"]),
    (8, {"summa25_atb": ["[2,2,2]"], "summa_ab": ["2x4"]}, ["cannon_ab"]),
    (9, {"cannon_ab": ["3x3"], "summa25_ab": ["[1,3,3]"]}, []),
    (12, {"summa_atb": ["3x4"], "summa25_ab": ["[2,2,3]"]}, ["cannon_ab"]),
    (24, {"summa_ab": ["4x6"]}, ["cannon_ab", "mm3d_ab"]),
    (16, {"cannon_ab": ["4x4"], "summa_atb": ["4x4"], "summa25_ab": ["[2,2,4]"],
          "ring_allreduce": ["ring p=16"]}, []),
    (64, {"summa_ab": ["8x8"], "summa25_abt": ["[2,2,16]", "[4,4,4]"]}, []),
])
def test_plan_fits_world_size(p, ran, skipped):
    cases, skips = plan_products(p, list(ALGORITHMS))
    done: dict = {}
    for c in cases:
        done.setdefault(c.algorithm, []).append(c.grid_label(p))
        if c.kind == "matmul":
            assert c.d * c.q * c.cols == p and c.misfit() == ""
    for name, labels in ran.items():
        assert done[name] == labels
    assert set(skipped) <= {s.name for s in skips}
    for s in skips:
        assert f"p = {p}" in s.reason


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("q,d", [(3, 1), (2, 4), (4, 1), (1, 9)])
def test_default_sizes_are_rounded_to_fit(name, q, d):
    """The deep products round the default sizes up to divide their grid; Cannon, SUMMA
    and SUMMA2.5 take them as they are (balanced blocks)."""
    spec = ALGORITHMS[name]
    m, k, n = spec.round_up(*DEFAULT_SIZES, q, d)
    assert spec.misfit(m, k, n, q, d) == "" and m >= 1536 and k >= 1024 and n >= 1280
    if spec.any_size:
        assert (m, k, n) == DEFAULT_SIZES
        return
    sa, sb = spec.stored_shapes(m, k, n)
    for shape, lay in ((sa, spec.layout_a), (sb, spec.layout_b), ((m, n), spec.layout_c)):
        local_shape(shape, lay, q, d, d * q * q)  # raises if it does not divide


def test_user_sizes_that_do_not_divide():
    """Every product runs on them (balanced blocks; the cube's nested): Cannon, SUMMA,
    SUMMA2.5, and the 2.5D and 3D products, none rounded up or skipped."""
    cases, skips = plan_products(16, ["summa_ab", "summa25_ab", "cannon_ab", "sd25_ab"],
                                 sizes=(9, 7, 5))
    assert [c.label() for c in cases] == ["summa_ab 4x4 9x7x5", "summa25_ab [2,2,4] 9x7x5",
                                          "cannon_ab 4x4 9x7x5", "sd25_ab [2,2,4] 9x7x5"]
    assert skips == []
    cases, skips = plan_products(8, ["mm3d_ab", "mm3d_abt", "mm3d_atb", "sd25_ab"],
                                 sizes=(9, 7, 5))
    assert [c.label() for c in cases] == ["mm3d_ab 2x2x2 9x7x5", "mm3d_abt 2x2x2 9x7x5",
                                          "mm3d_atb 2x2x2 9x7x5", "sd25_ab [2,2,2] 9x7x5"]
    assert skips == []


def test_the_ring_row_of_the_table_has_no_product_sizes():
    ring = ALGORITHMS["ring_allreduce"]
    assert not ring.is_product and ring.grids(6) == [(6, 1, 1)]
    for call in (lambda: ring.divisors(2, 1), lambda: ring.misfit(4, 4, 4, 2, 1),
                 lambda: ring.round_up(3, 3, 3, 2, 1), lambda: ring.stored_shapes(2, 2, 2)):
        with pytest.raises(ValueError, match="ring_allreduce is not a product"):
            call()


def test_grid_shapes_one_enumeration():
    assert grid_shapes(16, "2.5d") == [(2, 4)]
    assert grid_shapes(64, "2.5d") == [(2, 16), (4, 4)]
    assert grid_shapes(8, "2.5d") == [(2, 2)]
    assert grid_shapes(3, "2.5d") == [(1, 3)]
    assert grid_shapes(1, "2.5d") == [(1, 1)]
    assert grid_shapes(12, "2d") == [] and grid_shapes(36, "2d") == [(6, 1)]
    assert grid_shapes(16, "any") == [(1, 16), (2, 4), (4, 1)]
    with pytest.raises(ValueError):
        grid_shapes(0)


def _result(ok=True, error=1e-16, algorithm="summa_ab", seconds=0.0123):
    from summasim.harness.cases import MatmulCase, RingCase

    case = MatmulCase(algorithm, 4, 1, 8, 8, 8) if algorithm != "ring_allreduce" \
        else RingCase(1000)
    chk = Check(error, 1e-14, "exact")
    if not ok:
        chk.ok = False
        chk.bad_ranks = [2]
    return Result(case, 16, chk, {"median": seconds, "spans": [seconds]}, 2**20, 8, 3 * 2**20)


def test_report_format():
    lines = format_header().splitlines()
    lines += [format_row(_result()), format_row(_result(ok=False, error=math.nan,
                                                        algorithm="ring_allreduce"))]
    assert lines[0].split()[:4] == ["algorithm", "grid", "shapes", "dtype"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    cells = lines[2].split()
    assert cells[:4] == ["summa_ab", "4x4", "8x8x8", "float64"]
    assert cells[6] == "exact" and cells[7] == "OK" and cells[10:13] == ["1.00", "8", "3"]
    assert "FAIL*" in lines[3] and " nan " in lines[3] and "GB/s" in lines[3]
    # fixed widths: the result column starts at the same offset in every line
    assert lines[2].index("OK") == lines[3].index("FAIL") == lines[0].index("result")


def test_nan_check_is_a_failure():
    assert not Check(math.nan, 1.0, "exact").ok
    assert Check(math.nan, 1.0, "exact").nonfinite
    assert not Check(math.inf, 1.0, "exact").ok
    assert Check(0.5, 1.0, "exact").ok and not Check(2.0, 1.0, "exact").ok


def test_prediction_columns_and_summary():
    line = format_row(_result(), 0.0123 * 1.1)
    assert line.split()[-3:-1] == ["0.0135", "+10%"]
    s = prediction_summary([(1.1, 1.0, "a"), (0.7, 1.0, "b")])
    assert s["mape"] == pytest.approx(0.2) and s["worst"] == pytest.approx(0.3)
    assert s["worst_run"] == "b"
    assert prediction_summary([]) is None
    assert format_row(_result()).split()[-3:-1] == ["-", "-"]


def test_json_written_atomically_and_valid_with_nan(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_json_atomic(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert [f for f in os.listdir(path.parent) if f.startswith(".tmp-")] == []

    class Boom:
        pass

    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"x": Boom()})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}  # the old report survives
    assert [f for f in os.listdir(path.parent) if f.startswith(".tmp-")] == []
    rec = row_record(_result(ok=False, error=math.nan))
    write_json_atomic(str(path), {"rows": [rec], "x": [1.0, math.inf]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)                       # strict JSON
    assert data["rows"][0]["error"] is None and data["rows"][0]["error_nonfinite"] == "nan"
    assert data["rows"][0]["ok"] is False and data["rows"][0]["bad_ranks"] == [2]
    assert data["x"] == [1.0, None] and data["x_nonfinite"] == [[1, "inf"]]


def test_cli_arguments():
    args = run.parse_args(["--algorithms", "summa_ab,ring_allreduce", "--sizes", "8", "8", "4"])
    assert args.algorithm_list == ["summa_ab", "ring_allreduce"] and args.sizes == [8, 8, 4]
    with pytest.raises(UsageError, match="unknown algorithm"):
        run.parse_args(["--algorithms", "summa_xyz"])
    assert run.parse_args(["--repeats", "0"]).repeats == 0
    for bad in (["--repeats", "-1"], ["--sizes", "0", "4", "4"], ["--ring-size", "-1"],
                ["--inject", "nan"], ["--inject", "boom@1"],
                ["--model", "h=64,heads=5,layers=2,seq=16,vocab=64"], ["--model", "gpt9"],
                ["--batch", "0"], ["--self-test", "--model", "tiny"],
                ["--self-test", "--inject", "nan@1"], ["--self-test", "--dtype", "float16"],
                ["--algorithms", "none",
                                                       "--schemes", "none", "--meshes", "none"],
                ["--microbatches", "0"], ["--zero", "4"], ["--schedule", "zb"],
                ["--bucket", "0"],
                # BLAS threads: 2**64 + 1 overflowed in threadpoolctl on every rank
                ["--threads", "0"], ["--threads", "257"], ["--threads", str(2 ** 64 + 1)],
                # how a --mesh trains, without --mesh: refused even at the default value
                ["--zero", "0"], ["--schedule", "1f1b"], ["--attention", "plain"],
                ["--recompute", "none"]):
        with pytest.raises(UsageError):
            run.parse_args(bad)
    # the products and schemes off, the default meshes still run
    assert run.parse_args(["--algorithms", "none", "--schemes", "none"]).meshes == "default"
    args = run.parse_args(["--algorithms", "none", "--mesh", "dp=2,tp=megatron:2", "--zero",
                           "3", "--bucket", "64k"])
    assert [str(m) for m in args.mesh] == ["dp=2,pp=1,tp=megatron:2"]
    assert args.zero == 3 and args.bucket == 65536
    cases, skips, err = run.plan_mesh_cases(args, 4)
    assert err == "" and [c.spec for c in cases] == ["dp=2,pp=1,tp=megatron:2"]
    assert cases[0].zero == 3 and cases[0].bucket_bytes == 65536
    assert "the job has 8" in run.plan_mesh_cases(args, 8)[2]
    # --dtype reaches the meshes: one row per mesh and dtype, in that dtype
    for dt, want in (("float32", ["float32"]), ("both", ["float64", "float32"])):
        args = run.parse_args(["--algorithms", "none", "--mesh", "dp=2,pp=2", "--dtype", dt])
        cases, _, err = run.plan_mesh_cases(args, 4)
        assert err == "" and [c.dtype for c in cases] == want
    # a default mesh that cannot run is skipped once, not once per dtype
    one_layer = ["--algorithms", "none", "--model", "tiny,layers=1", "--batch", "8"]
    _, skips, _ = run.plan_mesh_cases(run.parse_args(one_layer + ["--dtype", "both"]), 4)
    assert [s.name for s in skips] == ["dp=2,pp=2,tp=megatron:1"]
    # the model and batch: a preset (with its batch) or sizes, parsed once into a Model
    args = run.parse_args([])
    assert str(args.model) == "tiny" and args.batch == 8
    args = run.parse_args(["--model", "h=32,heads=4,layers=3,seq=8,vocab=16", "--batch", "4"])
    assert (args.model.hidden, args.model.layers, args.batch) == (32, 3, 4)
    tcases = run.job(args, 4).tcases
    assert tcases and all(c.batch == 4 and c.config.hidden == 32 for c in tcases)
    assert run.job(args, 4) is run.job(args, 4)          # planned once
    args = run.parse_args(["--inject", "drop@3"])
    assert (args.fault.kind, args.fault.rank) == ("drop", 3)
    help_text = run.build_parser().format_help()
    for opt in ("--sizes", "--dtype", "--backend", "--algorithms", "--repeats", "--json",
                "--inject", "--self-test", "--check"):
        assert opt in help_text


def test_transformer_report_format():
    r = SchemeReport("optimus", "4x4", 16, 4, 1, "float64", loss_err=1e-16, logits_err=2e-16,
                     grad_err=3e-16, ok=True, fwd_s=0.1, bwd_s=0.2, tp_fwd=26624,
                     tp_bwd_checkpoint=79872, table1={"fwd": 26624, "bwd_checkpoint": 79872},
                     memory={"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                             "activations": 3 * 2**20, "peak_fwd_bwd": 5 * 2**20},
                     memory_formula={"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                                     "activations": 2**21})
    lines = format_transformer([r]).splitlines()
    cells = lines[2].split()
    assert cells[:3] == ["optimus", "4x4", "float64"] and cells[7] == "OK"
    assert cells[-4:] == ["26624", "26624", "79872", "79872"]
    mem = lines[6].split()
    assert mem[:7] == ["optimus", "4x4", "float64", "1.000", "1.000", "2.000", "3.000"]
    assert mem[-1] == "5.000"
    r.ok, r.nonfinite, r.grad_err = False, True, math.nan
    assert "FAIL*" in format_transformer([r]).splitlines()[2]


def test_scheme_arguments():
    args = run.parse_args(["--schemes", "megatron,summa25"])
    assert args.scheme_list == ["megatron", "summa25"]
    assert run.parse_args(["--schemes", "none"]).scheme_list == []
    with pytest.raises(UsageError, match="unknown scheme"):
        run.parse_args(["--schemes", "tesseract"])


class _World:
    def __init__(self, p):
        self.p = p

    def Get_size(self):
        return self.p


def test_preflight_checks_the_gpu_with_a_device_backend(monkeypatch):
    """--backend cupy: the preflight checks a GPU's free memory shared by its ranks too,
    so a product that fits the host but not the GPU is one message before any work,
    naming the cube that fits (here a stand-in GPU: 4 ranks share 2 GiB)."""
    import summasim.backends as backends

    monkeypatch.setattr(backends, "unavailable", lambda name: "")
    monkeypatch.setattr(backends, "device_share", lambda name, ranks: (
        (2 * 2**30, 4) if name == "cupy" else None))
    monkeypatch.setattr("summasim.comm.local_ranks", lambda: 4)
    args = ["--sizes", "8192", "8192", "8192", "--algorithms", "summa_ab", "--schemes", "none"]
    assert run.preflight(run.parse_args(args), _World(4)) == ""          # host backend
    msg = run.preflight(run.parse_args(args + ["--backend", "cupy"]), _World(4))
    assert "sharing one GPU" in msg and "the largest cube that fits is" in msg, msg
    small = ["--sizes", "1024", "1024", "1024", "--algorithms", "summa_ab", "--schemes", "none"]
    assert run.preflight(run.parse_args(small + ["--backend", "cupy"]), _World(4)) == ""


def test_a_machine_that_would_price_nothing_is_refused():
    """``--machine`` with ``--no-predict`` was ignored, a missing file included (exit
    0): one user error, in the main job and the benchmarks."""
    from summasim.bench.__main__ import parse_args as bench_args

    for parse, argv in ((run.parse_args, []), (bench_args, ["mesh"])):
        with pytest.raises(UsageError, match="--machine prices the runs"):
            parse([*argv, "--no-predict", "--machine", "/nonexistent.json"])
        assert parse([*argv, "--no-predict"]).machine is None
