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
from summasim.transformer import model as serial

P = WORLD.Get_size()
torch = pytest.importorskip("torch", reason="torch is not installed in this Python (it is "
                                            "not a summasim dependency)")

MODEL = Model.parse("h=16,heads=4,layers=2,seq=8,vocab=32")


def _case(text, dtype=np.float64, microbatches=2):
    return MeshCase.parse(text, 4 * P, runtime_config(MODEL, dtype), zero=0,
                          schedule="1f1b", microbatches=microbatches)


def _serial_loss(c):
    from summasim.harness.composed import mesh_inputs

    params, tokens, targets = mesh_inputs(c.config, c.batch, 0)
    return serial.forward(params, tokens, targets, c.config)[0]


@pytest.mark.parametrize("text,peer", [(f"dp={P}", "DDP"), (f"tp=megatron:{P}", "DTensor")])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_peer_trains_the_serial_model(text, peer, dtype):
    if peer == "DTensor" and MODEL.heads % P:
        pytest.skip(f"{MODEL.heads} heads do not split over {P} ranks")
    from summasim.validate import training_tolerance

    c = _case(text, dtype)
    bound = training_tolerance(c.config, c.batch, c.dtype)
    got = torch_peers.run_peer(c, WORLD, 2, _serial_loss(c), bound)
    parallel_assert(got["peer"] == peer and got["ok"] and got["replicas_agree"]
                    and got["grad_error"] <= bound and got["loss_error"] <= bound
                    and len(got["times"]) == 2 and got["seconds"] > 0,
                    f"{peer}: {got}")


def test_a_peer_whose_loss_is_not_the_serial_models_fails_on_every_rank():
    """A serial loss that is off by 1e-6 relative: the peer's check fails, on every rank."""
    c = _case(f"dp={P}")
    got = torch_peers.run_peer(c, WORLD, 1, _serial_loss(c) * (1 + 1e-6), 1e-9)
    parallel_assert(not got["ok"] and got["grad_error"] <= 1e-9, f"{got}")
