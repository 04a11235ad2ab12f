"""``bench mesh --torch``'s peers (:mod:`summasim.bench.torch_peers`): which compositions
have one, what the benchmark plans with ``--torch``, the gradient comparison, and (where
torch is installed) the torch GPT against summasim's serial model. The peers' MPI run is
``mpi_tests/test_torch_peers.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from summasim import cli
from summasim.bench import mesh, torch_peers
from summasim.bench.common import runtime_config
from summasim.harness.cases import MeshCase
from summasim.spec import Model

MODEL = Model.parse("h=16,heads=4,layers=2,seq=8,vocab=32")


def case(text, model=MODEL, dtype=np.float64, **kw):
    opts = dict(zero=0, schedule="1f1b", microbatches=1) | kw
    return MeshCase.parse(text, 8, runtime_config(model, dtype), **opts)


@pytest.mark.parametrize("text,kw,peer", [
    ("dp=4", {}, "DDP"),
    ("dp=2", {"microbatches": 2}, "DDP"),
    ("tp=megatron:4", {}, "DTensor"),
    ("dp=1,tp=megatron:2", {}, "DTensor"),
])
def test_the_compositions_with_a_peer(text, kw, peer):
    c = case(text, **kw)
    assert torch_peers.peer_reason(c) == "" and torch_peers.peer_name(c) == peer


@pytest.mark.parametrize("text,kw,model,words", [
    ("dp=4", {"zero": 1}, MODEL, "ZeRO 0"),
    ("dp=2,pp=2", {"microbatches": 2}, MODEL, "ZeRO 0"),
    ("dp=2,tp=megatron:2", {}, MODEL, "pure"),
    ("tp=optimus:2x2", {}, MODEL, "Megatron"),
    ("dp=4", {"recompute": "selective"}, MODEL, "recompute"),
    ("dp=4", {"precision": "bfloat16"}, MODEL, "mixed"),
    ("dp=4", {}, Model.parse("h=16,heads=4,layers=2,seq=8,vocab=32,mlp=swiglu"), "GELU"),
    ("dp=4", {}, Model.parse("h=16,heads=4,layers=2,seq=8,vocab=32,kv_heads=2"),
     "multi-head"),
])
def test_the_compositions_without_one_say_why(text, kw, model, words):
    c = case(text, model=model, dtype=np.float32 if "precision" in kw else np.float64, **kw)
    assert words in torch_peers.peer_reason(c)


def test_torch_without_a_mesh_plans_data_parallelism_over_p():
    """--torch alone: dp=P (ZeRO 0), whose pure run is Megatron over P: both peers."""
    import argparse

    parser = argparse.ArgumentParser()
    mesh.add_arguments(parser)
    args = parser.parse_args(["--torch", "--model", str(MODEL), "--batch", "8"])
    cases, skips, err = mesh.plan_mesh_bench(args, 4)
    assert not err and [c.spec for c in cases] == ["dp=4,pp=1,tp=megatron:1"]
    assert cases[0].zero == 0 and torch_peers.peer_name(cases[0]) == "DDP"
    pure = mesh._pure_tensor(cases[0], 4)
    assert pure.spec == "dp=1,pp=1,tp=megatron:4" and torch_peers.peer_name(pure) == "DTensor"
    # without --torch, the default compositions
    args = parser.parse_args(["--model", str(MODEL), "--batch", "8"])
    cases, _, _ = mesh.plan_mesh_bench(args, 4)
    assert "dp=4,pp=1,tp=megatron:1" not in [c.spec for c in cases]


def test_a_mesh_is_its_pure_run_only_when_it_trains_the_same_way():
    """bench mesh times the pure run beside a mesh unless the mesh is it: the same grid
    with m = 1 (a 4-micro-batch tp mesh is not), overlapping or not."""
    import argparse

    parser = argparse.ArgumentParser()
    mesh.add_arguments(parser)
    for m, same in (("1", True), ("4", False)):
        args = parser.parse_args(["--model", str(MODEL), "--batch", "8", "--mesh",
                                  "tp=megatron:4", "--microbatches", m])
        (case,), _, err = mesh.plan_mesh_bench(args, 4)
        pure = mesh._pure_tensor(case, 4)
        assert not err and pure.spec == case.spec and mesh.is_pure(case, pure) is same


def test_torch_refuses_what_it_has_no_peer_for(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    mesh.add_arguments(parser)
    monkeypatch.setattr(cli, "module_available", lambda name: True)
    for argv, words in ((["--torch", "--dtype", "bfloat16"], "float32 or float64"),
                        (["--torch", "--backend", "staged-host"], "on the CPU")):
        with pytest.raises(cli.UsageError, match=words):
            mesh.check(parser.parse_args(argv))
    mesh.check(parser.parse_args(["--torch", "--dtype", "float32"]))     # fine
    mesh.check(parser.parse_args(["--dtype", "bfloat16"]))              # no --torch: fine
    monkeypatch.setattr(cli, "module_available", lambda name: False)
    with pytest.raises(cli.UsageError, match="not installed"):
        mesh.check(parser.parse_args(["--torch"]))


def test_grad_error_is_the_worst_relative_error_and_names_its_key():
    ref = {"a": np.ones(4), "b": np.full(3, 2.0)}
    got = {"a": np.ones(4), "b": np.array([2.0, 2.0, 2.0 + 1e-6])}
    err, key = torch_peers._grad_error(got, ref)
    assert key == "b" and err == pytest.approx(1e-6 / np.linalg.norm(ref["b"]))
    assert torch_peers._grad_error({"a": np.ones(4)}, ref) == (math.inf, "b")
    nan = {"a": np.array([1.0, np.nan, 1.0, 1.0]), "b": ref["b"]}
    err, key = torch_peers._grad_error(nan, ref)
    assert math.isnan(err) and key == "a"
    assert torch_peers._grad_error(dict(ref), ref) == (0.0, "a")


@pytest.mark.parametrize("tied", [True, False])
def test_the_torch_gpt_is_the_serial_model(tied):
    """Built from summasim's parameters, the torch GPT's loss and every gradient (in
    summasim's keys and layouts) equal the serial model's in float64; a gradient key
    mapped to the wrong parameter would not."""
    torch = pytest.importorskip("torch", reason="torch is not installed in this Python "
                                                "(it is not a summasim dependency)")
    from summasim.harness.composed import mesh_inputs

    model = Model.parse(f"h=16,heads=4,layers=2,seq=8,vocab=32,tied={str(tied).lower()}")
    cfg = runtime_config(model, np.float64)
    params, tokens, targets = mesh_inputs(cfg, 4, 0)
    _, ref = torch_peers._serial_loss_and_grads(params, tokens, targets, cfg)
    gpt = torch_peers._gpt_class()(params, cfg)
    loss = gpt(torch.from_numpy(tokens), torch.from_numpy(targets))
    loss.backward()
    got = gpt.serial_grads()
    assert set(got) == set(ref)
    err, key = torch_peers._grad_error(got, ref)
    assert err < 1e-12, (err, key)
    from summasim.transformer import model as serial

    assert float(loss.detach()) == pytest.approx(serial.forward(params, tokens, targets, cfg)[0],
                                        rel=1e-13)


@pytest.mark.parametrize("text,kw,want", [
    # 8 sequences of 8 over dp = 4 ranks, one micro-batch: 2 x 8 rows; the MLP is 4 x 16
    ("dp=4", {}, (16, 16, 64)),
    ("dp=2", {"microbatches": 2}, (16, 16, 64)),
    # Megatron over 4: every rank sees the whole batch, a quarter of the MLP's columns
    ("tp=megatron:4", {}, (64, 16, 16)),
])
def test_the_blas_peer_times_the_widest_linear_of_one_rank(text, kw, want):
    """``bench mesh --torch`` times each run's widest linear layer in NumPy and torch at
    the shape one rank multiplies, so its BLAS ratio is that of the run's own GEMMs."""
    assert mesh.widest_gemm(case(text, **kw)) == want


def test_the_blas_peer_times_a_linear_layers_three_products():
    """``linear=True``: forward, input and weight gradient, 3 x 2mkn flops, each library's
    BLAS named."""
    pytest.importorskip("torch", reason="torch is not a summasim dependency")
    from summasim.bench.layer import gemm_peers

    one = gemm_peers(16, 16, 64, np.float32, repeats=2)
    three = gemm_peers(16, 16, 64, np.float32, repeats=2, linear=True)
    assert (one["passes"], three["passes"]) == (1, 3)
    assert three["shape"] == [16, 16, 64]
    assert three["numpy_gflops"] > 0 and three["torch_gflops"] > 0
    assert "unknown" not in (three["numpy_blas"], three["torch_blas"])
