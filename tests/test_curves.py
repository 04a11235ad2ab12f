"""The main job's loss curves (--steps N --curves PATH) and its refusals of techniques it
does not run (pure: no MPI)."""

import json
import types

import pytest

from summasim import run
from summasim.cli import UsageError
from summasim.harness.curves import curve_rows, png_path, write_curves


def _report(mesh, losses, serial, **kw):
    base = dict(mesh=mesh, schedule="1f1b", zero=0, dtype="float64", ok=True, bound=1e-12,
                techniques=["sp"], losses=losses, serial_losses=serial)
    return types.SimpleNamespace(**{**base, **kw})


def test_curves_are_written_beside_the_serial_model_with_their_largest_gap(tmp_path):
    reps = [_report("dp=2", [4.0, 3.0, 2.0], [4.0, 3.0, 2.5]),
            _report("pp=2", [1.0], [1.0, 2.0])]              # lengths differ: left out
    rows = curve_rows(reps)
    assert [r["mesh"] for r in rows] == ["dp=2"]
    assert rows[0]["max_rel_gap"] == pytest.approx(0.2)
    path = tmp_path / "c.json"
    written, png = write_curves(reps, str(path), title="t")
    data = json.loads(path.read_text())
    assert data["summasim_report"] == "curves" and data["meshes"][0]["loss"] == [4.0, 3.0, 2.0]
    assert data["meshes"][0]["serial_loss"] == [4.0, 3.0, 2.5]
    assert png == png_path(str(path)) == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(*argv):
    return run.parse_args(list(argv))


def test_the_plot_beside_the_curves_is_not_replaced_without_force(tmp_path):
    png = tmp_path / "c.png"
    png.write_bytes(b"mine")
    args = _args("--mesh", "dp=4", "--curves", str(tmp_path / "c.json"), "--steps", "2")
    assert "exists; pass --force" in run.check_curves(args, run.job(args, 4))
    args = _args("--mesh", "dp=4", "--curves", str(tmp_path / "c.json"), "--force")
    assert run.check_curves(args, run.job(args, 4)) == ""
    args = _args("--meshes", "none", "--curves", str(tmp_path / "d.json"))
    assert "no mesh runs" in run.check_curves(args, run.job(args, 4))


@pytest.mark.parametrize("argv, words", [
    (["--dtype", "bfloat16", "--algorithms", "summa_ab"], "runs the training rows only"),
    (["--dtype", "float16", "--schemes", "megatron"], "runs the training rows only"),
    (["--dtype", "bfloat16", "--self-test"], "--self-test runs its own"),  # leave out --dtype
    (["--recompute", "selective"], "give --mesh"),
    (["--sequence-parallel"], "give --mesh"),
    (["--microbatches", "3"], "--microbatches set"),     # the default meshes choose their own
    (["--algorithms", "ring_allreduce", "--sizes", "3", "3", "3"], "--sizes 3 3 3 sizes"),
    (["--algorithms", "summa_ab", "--ring-size", "7"], "--ring-size 7 sizes ring_allreduce"),
    (["--self-test", "--dtype", "float32"], "--self-test runs its own"),
    (["--self-test", "--sizes", "4", "4", "4"], "--self-test runs its own"),
    (["--dtype", "float16", "--meshes", "none"], "runs the training rows only"),
    (["--mesh", "dp=4", "--checkpoint", "--recompute", "selective"], "contradicts"),
    (["--mesh", "dp=4", "--loss-scale", "dynamic"], "needs mixed precision"),
    # what the self-test would silently drop
    (["--self-test", "--json", "r.json"], "writes no report; leave out --json"),
    (["--self-test", "--repeats", "5", "--steps", "4"], "leave out --steps, --repeats"),
    (["--mesh", "dp=4", "--json", "r.png", "--curves", "r"], "curves' plot"),
    # unbounded work, an empty path, two outputs in one file
    (["--repeats", str(10 ** 20)], "--repeats must be 0"),
    (["--json", ""], "needs a file path"),
    # a LayerNorm over 2 features: every gradient before it is rounding noise
    (["--model", "h=2,heads=1,layers=1,seq=4,vocab=8,ffn=2", "--batch", "4"], "hidden >= 3"),
    (["--mesh", "dp=4", "--json", "same.json", "--curves", "./same.json"], "where the curves"),
])
def test_what_the_job_cannot_run_is_a_user_error(argv, words):
    with pytest.raises(UsageError, match=words):
        _args(*argv)


def test_the_self_test_takes_the_check_method():
    """``--self-test --check freivalds`` self-tests the randomized check: allowed."""
    assert _args("--self-test", "--check", "freivalds").check == "freivalds"


def test_the_self_test_without_meshes_runs_none():
    args = _args("--self-test", "--meshes", "none")
    assert run.plan_mesh_cases(args, 4) == ([], [], "")
    assert run.plan_mesh_cases(_args("--self-test"), 4)[0]        # the default ones


def test_a_name_given_twice_runs_once():
    args = _args("--algorithms", "summa_ab,summa_ab,cannon_ab", "--schemes",
                 "megatron,megatron")
    assert args.algorithm_list == ["summa_ab", "cannon_ab"] and args.scheme_list == ["megatron"]


@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_a_default_mesh_runs_the_next_batch_it_can_cut_unless_the_batch_is_given(p):
    """Without --mesh and --batch, the default compositions at a p that does not divide
    the model's batch run the next batch they can cut (dp m replicas and micro-batches),
    as the scheme rows do; a --batch the user gave is kept, and such a mesh skipped."""
    cases, skips, err = run.plan_mesh_cases(_args("--algorithms", "none"), p)
    assert err == "" and not skips and cases
    for c in cases:
        assert c.batch >= 8 and c.batch % (c.dp * c.microbatches) == 0 and c.misfit(p) == ""
        assert c.batch < 8 + c.dp * c.microbatches            # the next one, not any
    cases, skips, err = run.plan_mesh_cases(_args("--algorithms", "none", "--batch", "8"), p)
    assert err == "" and not cases and all("not divisible" in s.reason for s in skips)


def test_the_techniques_reach_every_mesh_case():
    args = _args("--mesh", "tp=megatron:4", "--sequence-parallel", "--recompute", "selective",
                 "--attention", "flash", "--overlap", "--steps", "5")
    cases, _, err = run.plan_mesh_cases(args, 4)
    assert err == "" and len(cases) == 1
    c = cases[0]
    assert (c.sequence_parallel, c.recompute, c.attention, c.overlap, c.steps) == \
        (True, "selective", "flash", True, 5)
    args = _args("--mesh", "tp=optimus:2x2", "--sequence-parallel")
    assert "Megatron's 1D groups" in run.plan_mesh_cases(args, 4)[2]


def test_mixed_precision_reaches_every_mesh_case_over_float32_master_weights():
    args = _args("--mesh", "dp=2,pp=2", "--mesh", "dp=4", "--dtype", "float16",
                 "--loss-scale", "static:512", "--zero", "2")
    cases, _, err = run.plan_mesh_cases(args, 4)
    assert err == "" and len(cases) == 2
    assert args.algorithm_list == [] and args.scheme_list == []    # the training rows only
    for c in cases:
        assert (c.precision, c.loss_scale, c.grad_reduce, c.dtype, c.master_dtype, c.zero) \
            == ("float16", "static:512", "float32", "float16", "float32", 2)
    args = _args("--dtype", "bfloat16", "--grad-reduce", "bfloat16")   # the default meshes
    cases, _, err = run.plan_mesh_cases(args, 4)
    assert err == "" and cases and all(
        (c.precision, c.loss_scale, c.grad_reduce) == ("bfloat16", "none", "bfloat16")
        for c in cases)
