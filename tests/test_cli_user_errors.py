"""User errors in the command lines: one message, exit status 2, never a traceback.

Every bad invocation runs as its own process (``python -m ...``), as a user would
run it, and must print exactly ONE non-empty line on stderr, ``<prog>: error: ...``
naming the offending argument, print nothing on stdout (the check comes before any
work), and exit with status 2. Also the checks of :mod:`summasim.cli` in-process.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from summasim import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
for _var in cli.RANK_VARIABLES:   # not launched by mpiexec: every message is rank 0's
    ENV.pop(_var, None)

EXPLORE = ("summasim.costmodel", "explore", "--no-iso", "--p-max", "16")
TABLE1 = ("summasim.costmodel", "table1")
FIT = ("summasim.costmodel", "fit")
TRAIN = ("summasim.transformer.train", "--steps", "3")
BENCH = ("summasim.bench", "layer", "--batch", "1", "--model",
         "h=8,heads=2,layers=1,seq=4,vocab=8", "--repeats", "1", "--blocks", "1")


def run(module, *args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env or ENV)


def assert_user_error(res, *mentions, status=2, stdout_empty=True):
    """Exit ``status``, no traceback, exactly one stderr line with 'error:' and
    every string of ``mentions``; nothing on stdout."""
    report = f"rc={res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, report
    assert res.returncode == status, report
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, report
    assert "error:" in lines[0], report
    for m in mentions:
        assert m in lines[0], f"{m!r} not in the message\n{report}"
    if stdout_empty:
        assert res.stdout.strip() == "", report


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "plain.txt").write_text("not json {")
    (d / "folder").mkdir()
    return d


# -- explore --------------------------------------------------------------------------------
EXPLORE_MODEL = "h={h},heads={heads},layers=4,seq={seq},vocab={vocab}{ffn}"


def _model(h="1024", heads="16", seq="256", vocab="2048", ffn=""):
    return ["--model", EXPLORE_MODEL.format(h=h, heads=heads, seq=seq, vocab=vocab,
                                            ffn=f",ffn={ffn}" if ffn else "")]


EXPLORE_CASES = [
    (["--crossover-n", "0"], "--crossover-n"),
    (["--crossover-n", "64,x"], "--crossover-n"),
    (["--crossover-n", str(2 ** 41)], "--crossover-n"),
    (["--batch", "0"], "--batch"),
    (["--batch", "-3"], "--batch"),
    (["--batch", "1.5"], "--batch"),
    (_model(seq="nan"), "--model"),
    (_model(h="inf"), "--model"),
    (_model(h="0"), "--model"),
    (_model(h="1000", heads="64"), "--model"),                 # heads must divide hidden
    (_model(heads="0"), "--model"),
    (_model(heads="-64"), "--model"),
    (_model(vocab="-5"), "--model"),
    (_model(vocab="nan"), "--model"),
    (["--model", "h=64,heads=4,layers=0,seq=8,vocab=8"], "--model"),
    (["--model", "gpt9"], "--model"),
    (["--p-min", "0"], "--p-min"),
    (["--p-min", "8", "--p-max", "4"], "--p-max"),
    (["--p-max", "1e30"], "--p-max"),
    (["--matmul-n", "0"], "--matmul-n"),
    (["--efficiency", "1.5"], "--efficiency"),
    (["--efficiency", "nan"], "--efficiency"),
    (["--efficiency", "0"], "--efficiency"),
    (["--mem-budget", "-1"], "--mem-budget"),
    (["--mem-budget", "nan"], "--mem-budget"),
    (["--dtype", "float8"], "--dtype"),
    (_model(ffn="0"), "--model"),
    (_model(ffn="nan"), "--model"),
    (_model(ffn="1/0"), "--model"),
    (_model(ffn="-3.25"), "--model"),
    (["--model", EXPLORE_MODEL.format(h="1024", heads="16", seq="256", vocab="2048",
                                      ffn=",kv_heads=3")], "--model"),   # does not divide 16
    (["--model", EXPLORE_MODEL.format(h="1024", heads="16", seq="256", vocab="2048",
                                      ffn=",mlp=relu")], "--model"),
    (["--schemes", "megatron,fox"], "--schemes"),
    (["--schemes", ","], "--schemes"),
    (["--machine", "nope"], "--machine"),
    (["--machine", "missing.json"], "--machine"),
]


@pytest.mark.parametrize("args,flag", EXPLORE_CASES, ids=[" ".join(a) for a, _ in EXPLORE_CASES])
def test_explore_bad_arguments(args, flag):
    assert_user_error(run(*EXPLORE, *args), flag)


def test_explore_bad_files(files):
    assert_user_error(run(*EXPLORE, "--machine", files / "folder"), "--machine")
    assert_user_error(run(*EXPLORE, "--machine", files / "plain.txt"), "--machine")
    # outputs under a path whose "folder" is a file: refused before the sweep
    blocked = files / "plain.txt"
    assert_user_error(run(*EXPLORE, "--csv", blocked / "t.csv"), "--csv")
    assert_user_error(run(*EXPLORE, "--json", blocked / "t.json"), "--json")
    assert_user_error(run(*EXPLORE, "--json", files / "folder"), "--json")
    assert_user_error(run(*EXPLORE, "--outdir", blocked, "--csv"), "--outdir")
    assert_user_error(run(*EXPLORE, "--outdir", blocked, "--plot"), "--outdir")


def test_explore_machine_without_float64(tmp_path):
    """A fitted machine without a float64 GEMM rate cannot price the float64 matrix
    products: said before the sweep."""
    from summasim.costmodel import load_preset

    m = load_preset("local-2core-mpich")
    m = m.replace(gamma_gemm={"float32": m.gamma_gemm["float32"]})
    m.save(tmp_path / "m.json")
    assert_user_error(run(*EXPLORE, "--machine", tmp_path / "m.json"), "--machine",
                      "float64")
    assert_user_error(run(*EXPLORE, "--machine", tmp_path / "m.json", "--dtype", "float16"),
                      "--dtype")


def test_explore_megatron_beyond_its_heads_does_not_fit():
    """64 heads cannot be split over 2^16 ranks: nothing to price is a user error."""
    res = run("summasim.costmodel", "explore", "--no-iso", "--schemes", "megatron",
              "--p-min", 2 ** 16, "--p-max", 2 ** 16, "--model",
              "h=8192,heads=64,layers=24,seq=1024,vocab=51200")
    assert_user_error(res, "heads", str(2 ** 16))


def test_explore_reports_grids_that_do_not_divide_the_model(tmp_path, capsys):
    """Megatron with 16 heads is priced up to p = 16 only; Optimus [pr, pc] needs b % pr;
    the matrix products need n % (d q); the sweep says what it left out and why."""
    import json

    from summasim.costmodel.__main__ import main

    rc = main(["explore", "--no-iso", "--p-max", "64", "--batch", "2", "--model",
               "h=256,heads=16,layers=2,seq=64,vocab=256", "--matmul-n", "1020", "--json",
               "--outdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads((tmp_path / "explore.json").read_text())
    strong = doc["tables"]["strong"]
    assert max(r["p"] for r in strong if r["scheme"] == "megatron") == 16
    # b = 2: Optimus on [1,1], [1,2] (or [2,1]), [2,2] and [2,4] (b % pr: pr <= 2);
    # SUMMA2.5 on [1,2,2] only (d pr = 2; the square [q, q, d] grids need d q >= 4)
    assert {r["p"] for r in strong if r["scheme"] == "optimus"} == {1, 2, 4, 8}
    assert [(r["p"], r["grid"]) for r in strong if r["scheme"] == "summa25"] == [
        (4, "SUMMA2.5 [1,2,2]")]
    weak = doc["tables"]["weak"]                      # b = 2 p: a grid fits at every p
    assert {r["p"] for r in weak if r["scheme"] == "optimus"} == {1, 2, 4, 8, 16, 32, 64}
    for r in doc["tables"]["largest_batch"]:
        assert r["scheme"] != "megatron" or r["p"] <= 16
    matmul = doc["tables"]["matmul"]                  # 1020 % 8 != 0, 1020 % 16 != 0
    # Cannon, SUMMA and SUMMA2.5 take any n (balanced blocks): every square p for Cannon,
    # every p for SUMMA (rectangular where p is not a square), SUMMA2.5 on spec.grids
    assert {r["p"] for r in matmul if r["algorithm"] == "cannon_ab"} == {1, 4, 16, 64}
    assert {(r["p"], r["grid"]) for r in matmul if r["algorithm"] == "summa_ab"} == {
        (1, "[1,1,1]"), (2, "[1,2,1]"), (4, "[2,2,1]"), (8, "[2,4,1]"), (16, "[4,4,1]"),
        (32, "[4,8,1]"), (64, "[8,8,1]")}
    assert {r["p"] for r in matmul if r["algorithm"] == "summa25_ab"} == {1, 2, 4, 8, 16, 32,
                                                                          64}
    assert [r["grid"] for r in matmul if r["algorithm"] == "summa25_ab" and r["p"] == 4] == \
        ["[1,2,2]"]
    # at 64 Solomonik-Demmel and the 3D product both run on [4,4,4], n = 1020 cut into
    # balanced blocks (the cube's nested partition over q^2 = 16 row pieces)
    assert {(r["algorithm"], r["grid"]) for r in matmul if r["p"] == 64
            and r["algorithm"] in ("sd25_ab", "mm3d_ab")} == {("sd25_ab", "[4,4,4]"),
                                                              ("mm3d_ab", "[4,4,4]")}
    # the crossovers: --matmul-n and three GPT-3 hidden sizes; the 3D product moves fewer
    # words than SUMMA from its first cube on
    cross = doc["tables"]["crossovers"]
    assert {c["n"] for c in cross} == {1020, 2560, 4096, 12288} and "crossovers:" in out
    assert all(c["p_words"] == 8 for c in cross if c["algorithm"] == "mm3d_ab")
    assert "not priced" in out and "heads n = 16 is smaller than p = 32 (one per rank)" in out


# -- predict and plan -----------------------------------------------------------------------
PREDICT = ("summasim.costmodel", "predict", "--machine", "local-2core-mpich")
PREDICT_CASES = [
    ([], "--model"),                                             # required
    (["--model", "tiny"], "--mesh"),                             # required
    (["--model", "gpt9", "--mesh", "tp=optimus:2x2"], "--model"),
    (["--model", "tiny", "--mesh", "tp=3d:2x3x2"], "--mesh"),
    (["--model", "tiny", "--mesh", "tp=optimus:2x32"], "heads"),  # 16 heads on 32 columns
    (["--model", "tiny", "--mesh", "tp=summa25:2x2x1"], "--mesh"),
    (["--model", "tiny", "--mesh", "dp=0"], "--mesh"),
    (["--model", "tiny", "--mesh", "tp=megatron:32"], "heads"),  # 16 heads on 32 ranks
    (["--model", "tiny", "--batch", "4", "--mesh", "tp=summa25:2x2x4"], "batch"),
    (["--model", "tiny", "--mesh", "dp=2,pp=3"], "pp = 3"),
    (["--model", "tiny", "--mesh", "dp=2", "--microbatches", "3"], "--microbatches"),
    (["--model", "tiny", "--mesh", "dp=2", "--zero", "4"], "--zero"),
    (["--model", "tiny", "--mesh", "tp=optimus:2x2", "--dtype", "bfloat16"], "--dtype"),
    (["--model", "tiny", "--mesh", "tp=optimus:2x2", "--machine", "nope"], "--machine"),
]


@pytest.mark.parametrize("args,flag", PREDICT_CASES, ids=[" ".join(a) for a, _ in PREDICT_CASES])
def test_predict_bad_arguments(args, flag):
    assert_user_error(run(*PREDICT, *args), flag)


def test_plan_with_a_model_no_composition_runs_says_why():
    """A model no grid of the devices can run: one line naming why, status 2."""
    res = run("summasim.costmodel", "plan", "--model", "h=63,heads=1,layers=3,seq=8,vocab=7",
              "--batch", "5", "--devices", "6", "--machine", "local-2core-mpich")
    assert_user_error(res, "no composition of 6 devices exists")


# -- table1 ---------------------------------------------------------------------------------
TABLE1_CASES = [(["--p", "0"], "--p"), (["--b", "0"], "--b"), (["--h", "-8"], "--h"),
                (["--s", "x"], "--s"), (["--s", "nan"], "--s"),
                (["--p", "3"], "--p")]   # neither Megatron (1024 % 3) nor Optimus fits


@pytest.mark.parametrize("args,flag", TABLE1_CASES, ids=[" ".join(a) for a, _ in TABLE1_CASES])
def test_table1_bad_arguments(args, flag):
    assert_user_error(run(*TABLE1, *args), flag)


def test_table1_reports_a_grid_that_does_not_divide(capsys):
    from summasim.costmodel.__main__ import main

    assert main(["table1", "--h", "1000", "--p", "16"]) == 0   # Optimus [4, 4] fits
    out = capsys.readouterr().out
    assert "megatron" in out and "smaller than p = 16" in out and "!=" not in out


# -- fit ------------------------------------------------------------------------------------
FIT_CASES = [
    (["--max-bytes", "0"], "--max-bytes"),
    (["--max-bytes", "12x"], "--max-bytes"),
    (["--groups", "0,2"], "--groups"),
    (["--groups", "a"], "--groups"),
    (["--gemm-sizes", "-1"], "--gemm-sizes"),
    (["--gemm-sizes", "64,100000"], "--gemm-sizes"),     # 240 GB of blocks per rank
    (["--dtypes", "float8"], "--dtypes"),
    (["--threshold", "abc"], "--threshold"),
    (["--name", ""], "--name"),
]


@pytest.mark.parametrize("args,flag", FIT_CASES, ids=[" ".join(a) for a, _ in FIT_CASES])
def test_fit_bad_arguments(args, flag):
    """Checked before MPI is imported (so no rank waits and no MPI job starts)."""
    assert_user_error(run(*FIT, *args, timeout=60), flag)


def test_fit_gemm_sizes_in_any_order_are_sorted_once():
    """The fitted GEMM table needs increasing sizes: "128,64,64" is read as 64, 128 at
    parse time (it failed after the whole benchmark, on every rank)."""
    from summasim.costmodel.__main__ import _gemm_sizes

    assert _gemm_sizes("128,64,64") == [64, 128]


def test_fit_bad_output_path(files):
    assert_user_error(run(*FIT, "--out", files / "plain.txt" / "m.json", timeout=60), "--out")
    assert_user_error(run(*FIT, "--out", files / "folder", timeout=60), "--out")


def test_fit_on_one_rank_is_a_user_error(tmp_path):
    """The fit needs two ranks: one message and status 2, before any benchmark."""
    pytest.importorskip("mpi4py")
    res = run(*FIT, "--quick", "--out", tmp_path / "m.json", timeout=120)
    assert_user_error(res, "mpiexec")
    assert not (tmp_path / "m.json").exists()


def test_fit_bad_argument_under_mpiexec_prints_once():
    """Under a launcher every rank checks, rank 0 alone speaks (its rank from the
    environment; MPI is never initialised)."""
    from conftest import mpiexec_command

    res = subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, "-m",
                          "summasim.costmodel", "fit",
                          "--max-bytes", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=ENV)
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert res.returncode == 2 and len(lines) == 1 and "--max-bytes" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


# -- train ----------------------------------------------------------------------------------
TRAIN_CASES = [
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1e-3"], "--lr"),
    (["--steps", "0"], "--steps"),
    (["--batch", "0"], "--batch"),
    (["--vocab", "0"], "--vocab"),
    (["--seq", "0"], "--seq"),
    (["--period", "0"], "--period"),
    (["--period", "17"], "--period"),                      # longer than --seq 16
    (["--hidden", "30", "--heads", "4"], "--heads"),
    (["--hidden", "0"], "--hidden"),
    (["--layers", "0"], "--layers"),
    (["--momentum", "nan"], "--momentum"),
    (["--momentum", "-0.5"], "--momentum"),
    (["--momentum", "1"], "--momentum"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--threads", "0"], "--threads"),
    (["--log-every", "0"], "--log-every"),
    (["--seed", "-1"], "--seed"),
    # bounded work, a degenerate model, a loss scale no step can use, memory
    (["--steps", str(10 ** 12)], "--steps"),
    (["--threads", str(10 ** 9)], "--threads"),
    (["--layers", str(10 ** 8)], "--layers"),
    (["--hidden", "2", "--heads", "1"], "--hidden"),
    (["--dtype", "float16", "--loss-scale", "static:1e-300"], "--loss-scale"),
    (["--dtype", "float16", "--loss-scale", "static:1e38"], "--loss-scale"),
    (["--batch", str(10 ** 8)], "GiB can be used"),
    (["--hidden", str(10 ** 6), "--heads", "1"], "does not fit even at --batch 1"),
]


@pytest.mark.parametrize("args,flag", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_bad_arguments(args, flag):
    assert_user_error(run(*TRAIN, *args), flag)


def test_train_with_every_step_skipped_fails():
    """A loss scale that overflows every float16 step trains nothing: status 1 (it
    exited 0 after skipping them all)."""
    res = run("summasim.transformer.train", "--dtype", "float16", "--loss-scale",
              "static:1e15", "--steps", "3")
    assert_user_error(res, "every step was skipped", status=1, stdout_empty=False)


def test_train_loss_becoming_nonfinite_fails():
    """A run that diverges stops at the first non-finite loss: status 1, one message
    (no NumPy overflow warnings, no traceback)."""
    res = run("summasim.transformer.train", "--optimizer", "sgd", "--lr", "1e4", "--steps",
              "6", "--log-every", "1")
    assert_user_error(res, "non-finite", "--lr", status=1, stdout_empty=False)
    assert "loss nan" not in res.stdout


# -- bench ----------------------------------------------------------------------------------
BENCH_CASES = [
    (["--batch", "0"], "--batch"),
    (["--model", "h=8,heads=2,layers=1,seq=-4,vocab=8"], "--model"),
    (["--model", "h=30,heads=4,layers=1,seq=4,vocab=8"], "--model"),   # heads divide h
    (["--model", "nope"], "--model"),
    (["--repeats", "0"], "--repeats"),
    (["--blocks", "0"], "--blocks"),
    (["--threads", "0"], "--threads"),
    (["--threads", "1", "-2"], "--threads"),
    (["--dtype", "int8"], "--dtype"),
    (["--mem-layers", "1"], "--mem-layers"),            # the old spellings are gone
    (["--hidden", "8"], "--hidden"),
]


@pytest.mark.parametrize("args,flag", BENCH_CASES, ids=[" ".join(a) for a, _ in BENCH_CASES])
def test_bench_bad_arguments(args, flag):
    assert_user_error(run(*BENCH, *args), flag)


@pytest.mark.skipif(__import__("summasim.backends", fromlist=["unavailable"])
                    .unavailable("cupy") == "", reason="CuPy and a GPU are here")
def test_bench_layer_on_a_gpu_that_is_not_there():
    """--backend cupy without CuPy or a GPU: one line naming --backend, exit 2."""
    assert_user_error(run(*BENCH, "--backend", "cupy"), "--backend", "CuPy")


def test_bench_bad_json_path_and_missing_torch(files):
    assert_user_error(run(*BENCH, "--json", files / "plain.txt" / "r.json"), "--json")
    assert_user_error(run(*BENCH, "--json", files / "folder"), "--json")
    if not cli.module_available("torch"):
        assert_user_error(run(*BENCH, "--torch"), "--torch")


MPI_BENCH_CASES = [
    (["gemm", "--n", "0"], "--n"),
    (["gem"], "gem"),
    (["transformer", "--tf-shape", "4", "8", "16", "4", "16", "1"], "--tf-shape"),
    (["transformer", "--model", "h=30,heads=4,layers=1,seq=4,vocab=8"], "--model"),
    (["mesh", "--mesh", "dp=2,tp=optimus:3x2"], "--mesh"),
    (["mesh", "--zero", "4"], "--zero"),
    (["allreduce", "--sizes-mib", "x"], "--sizes-mib"),
    (["ring-steps", "--backend", "cupy"], "--backend"),
    (["mesh", "--torch", "--dtype", "bfloat16"], "--torch"),    # no mixed-precision peer
    (["mesh", "--torch", "--backend", "staged-host"], "--torch"),   # the peers run on the CPU
]


@pytest.mark.parametrize("args,flag", MPI_BENCH_CASES,
                         ids=[" ".join(a) for a, _ in MPI_BENCH_CASES])
def test_mpi_bench_bad_arguments(args, flag):
    """The MPI benchmarks (one process here): one line, status 2, before any work."""
    pytest.importorskip("mpi4py")
    assert_user_error(run("summasim.bench", *args), flag)


# -- the helpers themselves -----------------------------------------------------------------
def test_number_types():
    assert cli.positive_int("8") == 8 and cli.positive_int("1e3") == 1000
    assert cli.nonnegative_int("0") == 0 and cli.int_at_least(2)("2") == 2
    assert cli.int_list(2)("2, 4,8") == [2, 4, 8]
    assert cli.finite_positive_float("3e-3") == 3e-3
    assert cli.finite_nonnegative_float("0") == 0.0 and cli.finite_float("-2.5") == -2.5
    assert cli.float_range(0, 1, lo_open=True, hi_open=True)("0.5") == 0.5
    assert cli.choice_list(("a", "b"))("a,b") == ["a", "b"]
    bad = [(cli.positive_int, "0"), (cli.positive_int, "1.5"), (cli.positive_int, "x"),
           (cli.positive_int, "nan"), (cli.nonnegative_int, "-1"), (cli.int_at_least(2), "1"),
           (cli.int_list(2), "2,1"), (cli.int_list(), ","), (cli.finite_positive_float, "0"),
           (cli.finite_positive_float, "nan"), (cli.finite_positive_float, "-inf"),
           (cli.finite_nonnegative_float, "-1"), (cli.finite_float, "inf"),
           (cli.float_range(0, 1, lo_open=True), "0"), (cli.float_range(0, 1), "1.01"),
           (cli.choice_list(("a",)), "a,c")]
    for fn, text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_path_types(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert cli.existing_file(str(f)) == str(f)
    for text in (str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.existing_file(text)
    out = tmp_path / "new" / "deeper" / "r.json"
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        cli.writable_path(str(out))                     # no folder the user did not ask for
    assert not (tmp_path / "new").exists()
    assert cli.writable_dir(str(tmp_path / "d")) == str(tmp_path / "d")
    for fn, text in ((cli.writable_path, str(f / "x.json")), (cli.writable_path, str(tmp_path)),
                     (cli.writable_dir, str(f)), (cli.writable_dir, str(f / "sub"))):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_byte_size_accepts_every_spelling_of_the_costmodel():
    """The one byte parser: what ``costmodel fit --max-bytes`` took, decimals included."""
    assert [cli.byte_size(t) for t in ("4M", "64MiB", "512k", "1048576", "0.5M", "2 GB",
                                       "8kib", "1")] == \
        [4 << 20, 64 << 20, 512 << 10, 1 << 20, 1 << 19, 2 << 30, 8 << 10, 1]
    for bad in ("0", "0.1", "12x", "-4M", "M", "", "1e6", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.byte_size(bad)


def test_one_user_error_class():
    from summasim.harness import frontend

    assert not hasattr(frontend, "UserError")          # one class, one name
    with pytest.raises(cli.UsageError):
        frontend.Parser(prog="x").parse_args(["--nope"])


def test_parser_error_is_one_line_and_rank0_only(capsys, monkeypatch):
    ap = cli.ArgumentParser(prog="prog")
    ap.add_argument("--n", type=cli.positive_int)
    with pytest.raises(SystemExit) as exc:
        ap.parse_args(["--n", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "prog: error: argument --n: must be a positive " \
                                      "integer, got '0'\n"
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit):
        ap.parse_args(["--n", "0"])
    assert capsys.readouterr().err == ""
    assert cli.launcher_rank() == 1


def test_table1_says_why_optimus_has_no_column_at_a_p_that_is_not_a_square(capsys):
    from summasim.costmodel.__main__ import main

    assert main(["table1", "--p", "8"]) == 0                    # Megatron's column alone
    out = capsys.readouterr().out
    assert "megatron  forward communication" in out
    assert "p = 8 is not a square" in out and "needs p = d*q*q" not in out


def test_two_outputs_at_one_path_are_refused_before_any_work(tmp_path):
    """``plan --json X --plot X`` wrote the plot over the plan's JSON (exit 0), and
    ``explore --csv X --json X`` did all its work before refusing the second file:
    both are one line and exit 2 up front, and nothing is written."""
    same = tmp_path / "out.png"
    res = run("summasim.costmodel", "plan", "--model", "tiny", "--devices", "4", "--machine",
              "dgx-a100", "--batch", "8", "--json", same, "--plot", same)
    assert_user_error(res, "--json and --plot both write")
    same = tmp_path / "out.csv"
    res = run(*EXPLORE, "--csv", same, "--json", same)
    assert_user_error(res, "--csv and --json both write")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("field,value,says", [
    (("device", "memory_bandwidth"), 1e-300, "memory_bandwidth"),
    (("device", "vector_flops", "bfloat16"), 1e-300, "vector_flops"),
    (("topology", "intra_bandwidth"), 1e-300, "intra_bandwidth"),
    (("gamma_elementwise",), 1e300, "gamma_elementwise"), (("cores",), 1e300, "cores"),
    (("intra", "beta_large"), 1e300, "large-message regime")])
def test_a_machine_file_out_of_physical_bounds_is_refused(tmp_path, field, value, says):
    """One number a thousand orders of magnitude off priced a step of "inf ms" and
    exited 0: a machine file is held to the physical bounds as it loads."""
    import json

    data = json.loads(run("summasim.costmodel", "presets", "dgx-a100").stdout)
    node = data
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    res = run("summasim.costmodel", "predict", "--model", "tiny", "--mesh",
              "dp=2,pp=2,tp=optimus:2x2", "--microbatches", "2", "--batch", "8",
              "--machine", path)
    assert_user_error(res, "--machine", says)


def test_the_accuracy_worker_checks_its_files_before_any_work(tmp_path):
    """``costmodel accuracy-worker SPEC OUT`` (internal, but on the command line):
    a missing spec or one without cases was a traceback and MPI_Abort, an empty list
    of cases exited 0 having checked nothing, and OUT replaced any file."""
    import json

    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": [{"kind": "ring", "n": 8}]}))
    worker = ("summasim.costmodel", "accuracy-worker")
    assert_user_error(run(*worker, tmp_path / "missing.json", tmp_path / "o.json"),
                      "missing.json")
    (tmp_path / "empty.json").write_text(json.dumps({"cases": []}))
    assert_user_error(run(*worker, tmp_path / "empty.json", tmp_path / "o.json"), "cases")
    assert_user_error(run(*worker, spec, precious), "not a worker's results")
    assert precious.read_text() == "keep me"


def test_a_diverging_run_names_what_made_it_diverge():
    """``--weight-decay 1e30`` diverges (exit 1), and the message names the decay with
    the learning rate (it told the user to lower --lr alone)."""
    res = run(*TRAIN, "--weight-decay", "1e30")
    assert res.returncode == 1, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "training diverged" in line and "--weight-decay 1e+30" in line \
        and "a smaller --lr or --weight-decay" in line, line
