"""Measured sharded-training steps priced back: the shared-core features of every rank of a
worker's result and its predicted step."""

from __future__ import annotations
from ..machine import Machine
from .scheme import Scheme, TransformerConfig

#: denominator and the update: about ten array operations, each one pass).
ADAM_PASSES = 10


def mesh_features(res: dict, machine: Machine) -> list:
    """The shared-core features (:class:`~summasim.costmodel.workload.predict.SharedFeatures`) of
    every rank of one measured sharded-training step (``res``: a worker result of a
    ``MeshCase``, with each rank's event summary and coordinates ``[replica, stage,
    tensor rank, first layer, stop layer]``), for machines that price this node
    (oversubscribed ranks share cores).

    Each rank's messages are its traced events; its compute is ``m`` micro-batches of
    its stage: the stage's layers at the micro-batch size (the per-layer work of
    :func:`~summasim.costmodel.workload.step.step_work`: its two-layer minus its one-layer
    work, 4/3 of it with checkpointing for the recomputed forward), the embedding and
    LM head on the last stage (the one-layer work minus one layer; the embedding's
    lookup is negligible next to the head's GEMM), and Adam on the stage's local
    parameters (``ADAM_PASSES`` element-wise passes, over ``dp`` under ZeRO >= 1).
    """
    from ..compute.gemm import gemms_seconds as _compute_seconds
    from .predict import trace_features
    from .pricer import summary_messages
    from .step import step_work

    name, dp, m = res["scheme"], int(res["dp"]), int(res["m"])
    t, q, d = int(res.get("t", 1)), int(res["q"]), int(res["d"])
    T = t if name == "megatron" else d * q * q
    sch = (Scheme.make("megatron", p=t) if name == "megatron"
           else Scheme.make(name, q=q, d=d))
    micro = int(res["b"]) // (dp * m)
    h, f, v, s = int(res["h"]), int(res.get("ffn", 4)), int(res["v"]), int(res["s"])

    def work_seconds(layers: int) -> float:
        cfg = TransformerConfig(b=micro, s=s, h=h, n=int(res["heads"]), N=layers, v=v,
                                dtype=res["dtype"], checkpoint=False, ffn=f)
        w = step_work(sch, cfg)
        return (_compute_seconds(machine, w.gemms, cfg.dtype, w.reduce_bytes)
                + machine.gamma_elementwise * w.elementwise_items
                + machine.layer_seconds * w.layers)

    one, two = work_seconds(1), work_seconds(2)
    per_layer = (two - one) * (4.0 / 3.0 if res.get("checkpoint") else 1.0)
    ends = one - (two - one)
    layer_params = ((4 + 2 * f) * h * h + (9 + f) * h) / T
    embed_params = (v + s) * h / T
    shard = dp if int(res.get("zero", 0)) >= 1 else 1
    out = []
    pp = int(res["pp"])
    for events, coords in zip(res["events"], res["coords"]):
        stage, lo, hi = int(coords[1]), int(coords[3]), int(coords[4])
        first, last = stage == 0, stage == pp - 1
        n_params = (hi - lo) * layer_params + (embed_params if first else 0) + (
            v * h / T if last and not first else 0)
        compute = m * ((hi - lo) * per_layer + (ends if last else 0.0))
        compute += machine.gamma_elementwise * ADAM_PASSES * n_params / shard
        out.append(trace_features(summary_messages(events), machine, p=int(res["p"]),
                                  dtype=res["dtype"], compute_seconds=compute))
    return out


def predict_measured_mesh(res: dict, machine: Machine) -> float:
    """Predicted seconds of one measured sharded-training step on this kind of node
    (the slowest rank, :func:`~summasim.costmodel.workload.predict.predict_features`)."""
    from .predict import predict_features

    return predict_features(mesh_features(res, machine), machine,
                            machine.ranks_per_node(int(res["p"])))
