"""``bench mesh --torch``'s PyTorch peers under MPI (:mod:`summasim.bench.torch_peers`):
DDP and DTensor train summasim's model, checked against the serial model before they
are timed. torch is not a summasim dependency: without it these tests skip."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, parallel_assert
from summasim.bench import torch_peers
from summasim.bench.common import runtime_config
from summasim.harness.cases import MeshCase
from summasim.spec import Model

P = WORLD.Get_size()
torch = pytest.importorskip("torch", reason="torch is not installed in this Python (it is "
                                            "not a summasim dependency)")

MODEL = Model.parse("h=16,heads=4,layers=2,seq=8,vocab=32")


def _case(text, dtype=np.float64, microbatches=2):
    return MeshCase.parse(text, 4 * P, runtime_config(MODEL, dtype), zero=0,
                          schedule="1f1b", microbatches=microbatches)


@pytest.mark.parametrize("text,peer", [(f"dp={P}", "DDP"), (f"tp=megatron:{P}", "DTensor")])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_peer_trains_the_serial_model(text, peer, dtype):
    """Built, checked against the serial model's loss and gradients, stepped twice:
    within the mesh's bound, the replicas alike on every rank."""
    if peer == "DTensor" and MODEL.heads % P:
        pytest.skip(f"{MODEL.heads} heads do not split over {P} ranks")
    c = _case(text, dtype)
    peer_run = torch_peers.Peer(c, WORLD)
    peer_run.step()
    peer_run.step()
    got = peer_run.finish()
    want = "DDP" if P == 1 else peer          # tp=megatron:1 is data parallelism
    parallel_assert(got["peer"] == want and got["ok"] and got["replicas_agree"]
                    and got["grad_error"] <= got["bound"]
                    and got["loss_error"] <= got["bound"], f"{peer}: {got}")


def test_a_replica_that_differs_on_one_rank_fails_the_peer_on_every_rank():
    """One replicated parameter nudged on the last rank only: every rank's verdict is
    "replicas differ", not ok."""
    c = _case(f"dp={P}")
    peer_run = torch_peers.Peer(c, WORLD)
    peer_run.step()
    if WORLD.Get_rank() == P - 1:
        with torch.no_grad():
            peer_run.model.lnf.bias[0] += 1e-3
    got = peer_run.finish()
    want = P == 1       # one rank: nothing to differ from
    parallel_assert(got["ok"] == want and got["replicas_agree"] == want, f"{got}")


def test_a_check_that_failed_on_one_rank_fails_on_every_rank():
    c = _case(f"dp={P}")
    peer_run = torch_peers.Peer(c, WORLD)
    if WORLD.Get_rank() == 0:
        peer_run.grad_error = 1.0
    parallel_assert(not peer_run.finish()["ok"], "a failed check passed on some rank")


def test_the_blas_peer_is_measured_on_rank_0_and_given_to_every_rank():
    """``bench mesh --torch``'s BLAS line: rank 0 times the run's widest linear layer
    while the others wait, and every rank's row gets the same rates."""
    from summasim.bench import mesh

    c = _case(f"dp={P}", np.float32)
    rows = [{"mesh": c.spec}]
    said = []
    mesh.blas_peers(WORLD, rows, [(0, "blas", c)], said.append)
    got = rows[0]["blas"]
    same = WORLD.allgather((got["numpy_gflops"], got["torch_gflops"]))
    parallel_assert(got["shape"] == list(mesh.widest_gemm(c)) and got["passes"] == 3
                    and got["numpy_gflops"] > 0 and len(set(same)) == 1
                    and got["numpy_over_torch"] == got["torch_gflops"] / got["numpy_gflops"]
                    and any("from the BLAS alone" in s for s in said), "blas peer")


def test_a_data_parallel_ranks_parts_are_measured_on_rank_0_and_given_to_every_rank():
    """``bench mesh --torch``'s parts line for a DDP peer: one layer's parts at a
    micro-batch's shape and Adam over the whole model, timed on rank 0, the same on every
    rank; a tensor-parallel run (no whole model on a rank) gets none."""
    from summasim.bench import layer_parts, mesh

    c = _case(f"dp={P}", np.float32)
    tp = _case(f"tp=megatron:{P}", np.float32)
    rows = [{"mesh": c.spec}, {"mesh": tp.spec}]
    said = []
    mesh.rank_parts(WORLD, rows, [(0, "blas", c), (1, "pure_blas", tp)], said.append)
    got = rows[0]["blas_parts"]
    same = WORLD.allgather(sorted(got["layer"]["numpy"].items()))
    parallel_assert(set(got["layer"]) == {"numpy", "torch", "torch_manual_attn"}
                    and tuple(got["layer"]["torch"]) == layer_parts.PARTS
                    and all(s > 0 for s in got["layer"]["numpy"].values())
                    and got["adam"]["numpy"] > 0 and got["adam"]["torch"] > 0
                    and got["layers"] == MODEL.layers and got["microbatches"] == 2
                    and all(x == same[0] for x in same)
                    and ("pure_blas_parts" in rows[1]) == (tp.tensor_size == 1)
                    and any("Adam over the model" in s for s in said), f"parts {got}")
