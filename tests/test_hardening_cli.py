"""Bounded work, honest exit codes and help in the single-process commands and the
benchmark front-end.

- ``python -m summasim.costmodel`` alone lists its commands, one line each, and exits 2;
- every benchmark has its own ``--help``, and the top-level help lists every benchmark;
- ``predict``, ``plan`` and ``explore`` default to one machine preset and one dtype rule;
- a benchmark that would measure nothing is a user error (exit 2, one line), before work;
- ``predict`` costs the same at any layer count (two small steps, not N layers), equal to
  the layer-by-layer sum within rounding;
- every numeric argument has a bound stated in ``--help``, and a value past it, or a
  bad value of any other kind, is one ``error:`` line and exit status 2.

Most cases call the commands' ``main`` in this process (quick); those that need a new
process or ``mpiexec`` run under a timeout.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from summasim import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
for _var in cli.RANK_VARIABLES:
    ENV.pop(_var, None)
SMALL = "h=64,heads=4,layers=2,seq=16,vocab=64"


def run(module, *args, timeout=120, mpi: int | None = None):
    """``python -m module args`` (under ``mpiexec -n mpi`` when given) in a new process."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if mpi:
        from conftest import mpiexec_command

        cmd = [*mpiexec_command(), "-n", str(mpi)] + cmd
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def costmodel(*argv) -> tuple[int, str, str]:
    """``python -m summasim.costmodel argv`` in this process: (status, stdout, stderr)."""
    from summasim.costmodel.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def assert_one_error(rc, out, err, *mentions):
    """Status 2, no traceback, one stderr line with 'error:' and each mention, no stdout."""
    report = f"rc={rc}\nstdout:\n{out[-1500:]}\nstderr:\n{err[-1500:]}"
    assert rc == 2, report
    assert "Traceback" not in err, report
    from conftest import launcher_free

    lines = launcher_free(err)           # without Open MPI's report of a failed job
    assert len(lines) == 1 and "error:" in lines[0], report
    for m in mentions:
        assert m in lines[0], f"{m!r} not in the message\n{report}"
    assert out.strip() == "", report


# -- the command list --------------------------------------------------------------------
def test_costmodel_alone_lists_every_command_and_exits_2():
    from summasim.costmodel.__main__ import COMMANDS

    rc, out, err = costmodel()
    assert rc == 2 and out == "" and "Traceback" not in err, err
    lines = err.splitlines()
    assert lines[0].startswith("usage: python -m summasim.costmodel COMMAND")
    for name in COMMANDS:       # one line each: the name, then what it does
        assert sum(ln.split()[:1] == [name] for ln in lines) == 1, (name, err)
    assert {"predict", "plan", "explore", "fit", "presets"} <= set(COMMANDS)
    assert lines[-1].startswith("python -m summasim.costmodel: error: a command is required")


# -- bench help --------------------------------------------------------------------------
def test_each_benchmark_has_its_own_help_and_the_top_level_lists_them_all():
    from summasim.bench.__main__ import BENCHMARKS, build_parser

    top = build_parser().format_help()
    for name in [*BENCHMARKS, "all"]:
        assert f"\n    {name}" in top, (name, top)
    own = {"gemm": "--algorithms", "allreduce": "--sizes-mib", "ring-steps": "--sizes-mib",
           "transformer": "--checkpoint", "mesh": "--microbatches", "layer": "--threads"}
    assert set(own) == set(BENCHMARKS)
    for name, flag in own.items():
        res = run("summasim.bench", name, "--help", timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"usage: python -m summasim.bench {name} "), res.stdout
        assert flag in res.stdout and "BENCHMARK ..." not in res.stdout, res.stdout


def test_bench_help_under_mpiexec_is_printed_once():
    res = run("summasim.bench", "gemm", "--help", timeout=60, mpi=2)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("usage: python -m summasim.bench gemm") == 1, res.stdout


# -- one default ---------------------------------------------------------------------------
def test_predict_plan_and_explore_share_the_default_machine_and_dtype():
    from summasim.costmodel.machine import load_machine
    from summasim.costmodel.tools import explore_cli, plan_cli, predict
    from summasim.costmodel.tools._cli import pick_dtype

    parsed = {
        "predict": predict.build_parser().parse_args(["--model", "tiny", "--mesh",
                                                      "tp=megatron:2"]),
        "plan": plan_cli.build_parser().parse_args(["--model", "tiny", "--devices", "2"]),
        "explore": explore_cli.build_parser().parse_args([]),
    }
    assert {a.machine for a in parsed.values()} == {predict.DEFAULT_PRESET}
    assert {a.dtype for a in parsed.values()} == {None}       # each picks by one rule
    explore_args = parsed["explore"]
    explore_args.p_max, explore_args.no_iso = 16, True
    want = pick_dtype(load_machine(predict.DEFAULT_PRESET), None)
    assert explore_cli.check_args(explore_args).cfg.dtype == want
    assert predict.check_args(parsed["predict"])[2].dtype == want


# -- a benchmark that measures nothing -----------------------------------------------------
def test_bench_gemm_that_fits_no_grid_exits_2_before_any_work():
    """Every product takes any n, but Cannon needs a square grid: asked for alone on 8
    ranks, nothing runs."""
    res = run("summasim.bench", "gemm", "--n", "1001", "--algorithms", "cannon_ab",
              "--repeats", "1", timeout=120, mpi=8)
    assert_one_error(res.returncode, res.stdout, res.stderr, "gemm measures nothing",
                     "--n 1001", "p = 8")


def _bench_args(*argv):
    from summasim.bench.__main__ import parse_args

    return parse_args(list(argv))


@pytest.mark.parametrize("argv,p,why", [
    (["gemm", "--n", "1001", "--algorithms", "cannon_ab"], 8,
     "no product of --n 1001 runs on p = 8"),
    (["allreduce"], 1, "a ring of one rank"),
    (["ring-steps"], 1, "a ring of one rank"),
    (["transformer"], 17, "no scheme's grid of p = 17 ranks"),   # 16 heads, 17 a prime
    (["mesh", "--mesh", "tp=megatron:2"], 3, "no composition runs on p = 3"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_each_benchmark_says_when_it_would_measure_nothing(argv, p, why):
    from summasim.bench.__main__ import _nothing_to_measure

    name = argv[0]
    assert why in _nothing_to_measure(name, _bench_args(*argv), p)
    fits = {"gemm": 1, "allreduce": 2, "ring-steps": 2, "transformer": 4, "mesh": 2}[name]
    assert _nothing_to_measure(name, _bench_args(*argv), fits) == ""


# -- predict: O(1) in the layers -----------------------------------------------------------
def test_predict_prices_many_layers_from_two_small_steps_equal_to_the_sum(monkeypatch):
    from summasim import spec
    from summasim.costmodel.machine import load_machine
    from summasim.costmodel.tools import predict
    from summasim.costmodel.workload.scheme import Scheme, TransformerConfig
    from summasim.costmodel.workload.step import step_breakdown

    machine = load_machine("dgx-a100")
    n = predict.EXACT_LAYERS + 7
    model = spec.Model.parse(f"h=256,heads=8,layers={n},seq=64,vocab=512")
    for sch in (Scheme("megatron", 4), Scheme("optimus", 4, 2, 1)):
        cfg = TransformerConfig.from_model(model, 32, checkpoint=True, dtype="bfloat16")
        exact, fast = step_breakdown(sch, cfg, machine), predict.step_breakdown_layers(
            sch, cfg, machine)
        for f in ("seconds", "gemm_seconds", "memory_bound_seconds", "comm_seconds",
                  "launch_seconds", "kernels", "model_flops"):
            assert getattr(fast, f) == pytest.approx(getattr(exact, f), rel=1e-11), f
        assert fast.by_op.keys() == exact.by_op.keys()
        assert all(fast.by_op[k] == pytest.approx(v, rel=1e-11) for k, v in exact.by_op.items())
        assert fast.memory == exact.memory and fast.config == cfg
    # at any layer count it prices two steps of at most two layers, whatever N is
    seen = []
    real = predict.step_breakdown
    monkeypatch.setattr(predict, "step_breakdown",
                        lambda s, c, m, **kw: seen.append(c.N) or real(s, c, m, **kw))
    rc, out, err = costmodel("predict", "--model", "gpt3-175b,layers=24000000", "--mesh",
                             "tp=megatron:8")
    assert rc == 0, err
    assert "N=24000000" in out and seen == [1, 2], seen
    seen.clear()
    assert costmodel("predict", "--model", "gpt3-175b", "--mesh", "tp=megatron:8")[0] == 0
    assert seen == [96]          # the presets' sizes: layer by layer, as before


# -- progress ------------------------------------------------------------------------------
def test_progress_bar_shows_when_asked_or_on_a_terminal_only(monkeypatch):
    from argparse import Namespace

    from summasim.costmodel.tools.predict import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress_bar(Namespace(progress=None), total=3).disable
    assert progress_bar(Namespace(progress=False), total=3).disable
    assert not progress_bar(Namespace(progress=True), total=3).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not progress_bar(Namespace(progress=None), total=3).disable


def test_explore_with_progress_counts_every_p_and_stays_quiet_in_a_pipe(monkeypatch,
                                                                        tmp_path):
    from summasim.costmodel.tools import explore_cli

    counted = []

    class Bar:
        def __init__(self, args, **kw):
            self.total = kw["total"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            counted.append(self)

        def update(self, n=1):
            self.n = getattr(self, "n", 0) + n

    monkeypatch.setattr(explore_cli, "progress_bar", Bar)
    rc, out, err = costmodel("explore", "--machine", "local-2core-mpich", "--model", SMALL,
                             "--batch", "8", "--p", "1,4,16,64", "--outdir", tmp_path)
    assert rc == 0 and err == "", err
    (bar,) = counted
    # strong and weak per p, and one tick per isoefficiency problem (the 2.5D and 3D
    # products' and the 3D layer's too, though 64 is the only cube here)
    assert bar.n == bar.total == 2 * 4 + len(explore_cli.ISO_REFERENCES) == 16


# -- bounds and bad inputs -----------------------------------------------------------------
EXPLORE = ("explore", "--machine", "local-2core-mpich", "--model", SMALL, "--batch", "8",
           "--no-iso")
PLAN = ("plan", "--model", "gpt3-2.7b")
PREDICT = ("predict", "--model", "gpt3-2.7b", "--mesh", "tp=megatron:8")
BAD = [
    ((*EXPLORE, "--p-max", 2 ** 17), "--p-max"),                      # huge, past 2^16
    ((*EXPLORE, "--p-max", 2 ** 40), "--p-max"),                      # the old bound
    ((*EXPLORE, "--p", "4,0"), "--p"),                                # zero
    ((*EXPLORE, "--p", ","), "--p"),                                  # empty list
    ((*EXPLORE, "--p", ",".join(map(str, range(1, 66)))), "--p"),     # too many
    ((*EXPLORE, "--matmul-n", 2 ** 41), "--matmul-n"),                # huge
    ((*EXPLORE, "--efficiency", "nan"), "--efficiency"),              # NaN
    ((*EXPLORE, "--p-min", "64", "--p-max", "16"), "--p-max"),        # conflicting
    ((*EXPLORE, "--schemes", ","), "--schemes"),                      # empty list
    ((*EXPLORE, "--schemes", "megatron,cannon"), "--schemes"),        # unknown name
    (("explore", "--model", f"h=64,heads=4,layers={2 ** 41},seq=16,vocab=64"), "--model"),
    ((*PREDICT, "--batch", "inf"), "--batch"),                        # inf
    ((*PREDICT, "--batch", str(2 ** 41)), "--batch"),                 # huge
    ((*PREDICT, "--mem-budget", "-1"), "--mem-budget"),               # negative
    ((*PREDICT, "--dropout", "nan"), "--dropout"),                    # NaN
    ((*PREDICT, "--machine", "no-such-preset"), "--machine"),         # unknown name
    (("predict", "--model", "gpt3-2.7b,vocab=0", "--mesh", "tp=megatron:8"), "--model"),
    ((*PLAN, "--devices", 2 ** 17), "--devices"),                     # huge
    ((*PLAN, "--devices", "-8"), "--devices"),                        # negative
    (("plan", "--model", "gpt3-2.7b,layers=70000", "--devices", "8"), "--model"),
    ((*PLAN, "--devices", "8", "--batch", 2 ** 25), "--batch"),
    ((*PLAN, "--devices", "8", "--mem-gib", "10", "--mem-fraction", "0.5"), "--mem-"),
    ((*PLAN, "--devices", "8", "--top", "0"), "--top"),               # zero
    ((*PLAN, "--devices", "8", "--zero", "4"), "--zero"),             # unknown stage
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(map(str, a[3:] if a[0] == "explore"
                                                             and len(a) > 8 else a))[:60]
                                                 for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, flag):
    assert_one_error(*costmodel(*argv), flag)


def test_bounds_are_stated_in_help():
    from summasim.bench.__main__ import build_parser as bench_parser
    from summasim.costmodel.tools import explore_cli, plan_cli, predict

    explore = explore_cli.build_parser().format_help()
    for text in ("2^16", "--progress", "at most 64"):
        assert text in explore, text
    assert "2^40" in predict.build_parser().format_help().replace("\n", " ")
    plan = " ".join(plan_cli.build_parser().format_help().split())
    for text in ("at most 2^16", "2^24", "--progress"):
        assert text in plan, text
    sub = bench_parser()._subparsers._group_actions[0].choices
    assert "1 to 1000" in " ".join(sub["allreduce"].format_help().split())
    assert "at most 32" in " ".join(sub["allreduce"].format_help().split())


@pytest.mark.parametrize("argv,flag", [
    (("allreduce", "--repeats", "1001"), "--repeats"),
    (("allreduce", "--sizes-mib", ",".join(str(i) for i in range(1, 34))), "--sizes-mib"),
    (("gemm", "--repeats", "0"), "--repeats"),
    (("gemm", "--n", str(2 ** 21)), "--n"),
    (("layer", "--threads", "1", "257"), "--threads"),
    (("layer", "--blocks", "101"), "--blocks"),
    (("layer", "--repeats", "1001"), "--repeats"),
])
def test_bench_bad_bounds_are_one_line_and_exit_2(argv, flag):
    res = run("summasim.bench", *argv, timeout=60)
    assert_one_error(res.returncode, res.stdout, res.stderr, flag)
