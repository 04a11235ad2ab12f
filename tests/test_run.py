"""The main job's planning, size fitting, report format and CLI (serial)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from summasim import run
from summasim.layout import local_shape


@pytest.mark.parametrize("p,ran,skipped", [
    (1, {"cannon_ab": ["1x1"], "summa25_ab": ["[1,1,1]"], "ring_allreduce": ["ring p=1"]}, []),
    (2, {"summa25_ab": ["[1,1,2]"]}, ["cannon_ab", "summa_ab", "summa_abt", "summa_atb"]),
    (8, {"summa25_atb": ["[2,2,2]"]}, ["cannon_ab", "summa_ab"]),
    (9, {"cannon_ab": ["3x3"], "summa25_ab": ["[1,1,9]"]}, []),
    (16, {"cannon_ab": ["4x4"], "summa_atb": ["4x4"], "summa25_ab": ["[2,2,4]"],
          "ring_allreduce": ["ring p=16"]}, []),
    (64, {"summa_ab": ["8x8"], "summa25_abt": ["[2,2,16]", "[4,4,4]"]}, []),
])
def test_plan_fits_world_size(p, ran, skipped):
    runs = run.plan(p, list(run.ALGORITHMS))
    done: dict = {}
    for pl in runs:
        if not pl.skip:
            done.setdefault(pl.algorithm, []).append(pl.grid_label)
            if pl.algorithm != "ring_allreduce":
                assert pl.d * pl.q * pl.q == p
    for name, labels in ran.items():
        assert done[name] == labels
    skipped_names = {pl.algorithm for pl in runs if pl.skip}
    assert set(skipped) <= skipped_names
    for pl in runs:
        if pl.skip:
            assert f"p = {p}" in pl.skip


@pytest.mark.parametrize("name", [n for n in run.ALGORITHMS if n != "ring_allreduce"])
@pytest.mark.parametrize("q,d", [(3, 1), (2, 4), (4, 1), (1, 9)])
def test_default_sizes_are_rounded_to_fit(name, q, d):
    (m, k, n), reason = run.fit_sizes(name, run.DEFAULT_SIZES, q, d, exact=False)
    assert reason == "" and m >= 1536 and k >= 1024 and n >= 1280
    _, op, la, lb, lc = run.ALGORITHMS[name]
    sa, sb = run.stored_shapes(op, m, k, n)
    for shape, lay in ((sa, la), (sb, lb), ((m, n), lc)):
        local_shape(shape, lay, q, d, d * q * q)  # raises if it does not divide


def test_user_sizes_that_do_not_divide_are_skipped_with_reason():
    runs = run.plan(16, ["summa_ab", "summa25_ab"], sizes=(10, 8, 8))
    reasons = {pl.algorithm: pl.skip for pl in runs}
    assert reasons["summa_ab"] == "m=10 is not divisible by 4"
    assert "m=10 is not divisible by 8" in reasons["summa25_ab"]


def test_shapes_25d():
    assert run.shapes_25d(16) == [(2, 4)]
    assert run.shapes_25d(64) == [(2, 16), (4, 4)]
    assert run.shapes_25d(8) == [(2, 2)]
    assert run.shapes_25d(3) == [(1, 3)]


def _row(ok=True, gflops=12.5):
    return run.Row("summa_ab", "4x4", "8x8x8", "float64", 1e-16, 1e-14, ok, 0.0123,
                   gflops, None if gflops else 3.2, 2**20, 8)


def test_report_format():
    table = run.format_table([_row(), _row(ok=False, gflops=None)])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["algorithm", "grid", "shapes", "dtype"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    cells = lines[2].split()
    assert cells[:4] == ["summa_ab", "4x4", "8x8x8", "float64"]
    assert cells[6] == "OK" and cells[8] == "12.50" and cells[9] == "1.00" and cells[10] == "8"
    assert " FAIL " in lines[3] and "3.20 GB/s" in lines[3]
    # fixed widths: the result column starts at the same offset in every line
    assert lines[2].index("OK") == lines[3].index("FAIL") == lines[0].index("result")


def test_prediction_columns_and_summary():
    rows = [_row(), _row()]
    rows[0].predicted, rows[1].predicted = 0.0123 * 1.1, 0.0123 * 0.7
    assert rows[0].prediction_error == pytest.approx(0.1)
    line = run.format_table(rows).splitlines()[2]
    assert line.split()[-2:] == ["0.0135", "+10%"]
    s = run.prediction_summary(rows)
    assert s["mape"] == pytest.approx(0.2) and s["worst"] == pytest.approx(0.3)
    assert run.prediction_summary([_row()]) is None
    assert run.format_table([_row()]).splitlines()[2].split()[-2:] == ["-", "-"]


def test_json_written_atomically(tmp_path):
    path = tmp_path / "sub" / "report.json"
    run.write_json_atomic(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert [f for f in os.listdir(path.parent) if f.startswith(".tmp-")] == []

    class Boom:
        pass

    with pytest.raises(TypeError):
        run.write_json_atomic(str(path), {"x": Boom()})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}  # the old report survives
    assert [f for f in os.listdir(path.parent) if f.startswith(".tmp-")] == []


def test_cli_arguments(capsys):
    args = run.parse_args(["--algorithms", "summa_ab,ring_allreduce", "--sizes", "8", "8", "4"])
    assert args.algorithm_list == ["summa_ab", "ring_allreduce"] and args.sizes == [8, 8, 4]
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--algorithms", "summa_xyz"])
    assert e.value.code == 2 and "unknown algorithm(s) summa_xyz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for opt in ("--sizes", "--dtype", "--backend", "--algorithms", "--repeats", "--json"):
        assert opt in out


def test_uniform_streams_can_start_anywhere():
    whole = run._uniform(3, 7, 0, 50)
    assert np.array_equal(run._uniform(3, 7, 20, 30), whole[20:])
    assert whole.min() >= -1 and whole.max() < 1
    assert not np.array_equal(run._uniform(3, 8, 0, 50), whole)


def test_transformer_report_format():
    from summasim.transformer.compare import SchemeReport

    r = SchemeReport("optimus", "4x4", 16, 4, 1, "float64", loss_err=1e-16, logits_err=2e-16,
                     grad_err=3e-16, ok=True, fwd_s=0.1, bwd_s=0.2, tp_fwd=26624,
                     tp_bwd_checkpoint=79872, table1={"fwd": 26624, "bwd_checkpoint": 79872},
                     memory={"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                             "activations": 3 * 2**20, "peak_fwd_bwd": 5 * 2**20},
                     memory_formula={"params": 2**20, "grads": 2**20, "optimizer": 2**21,
                                     "activations": 2**21})
    lines = run.format_transformer([r]).splitlines()
    cells = lines[2].split()
    assert cells[:3] == ["optimus", "4x4", "float64"] and cells[7] == "OK"
    assert cells[-4:] == ["26624", "26624", "79872", "79872"]
    mem = lines[6].split()
    assert mem[:6] == ["optimus", "4x4", "1.000", "1.000", "2.000", "3.000"]
    assert mem[-1] == "5.000"


def test_scheme_arguments(capsys):
    args = run.parse_args(["--schemes", "megatron,summa25"])
    assert args.scheme_list == ["megatron", "summa25"]
    assert run.parse_args(["--schemes", "none"]).scheme_list == []
    with pytest.raises(SystemExit):
        run.parse_args(["--schemes", "tesseract"])
    assert "unknown scheme(s) tesseract" in capsys.readouterr().err
