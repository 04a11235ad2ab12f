"""Memory per device of one pipeline stage of a composition (bytes): its share of the
model states under ZeRO, the activations its schedule keeps in flight, the transient
buffers and the workspace (see :mod:`~summasim.costmodel.workload.composition`)."""

from __future__ import annotations
from .pipeline import in_flight
from .tensor import TensorMemory
from .zero import BUCKET_BYTES, StateBytes, _states

def _pieces(tm: TensorMemory, L: int, pp: int, s: int) -> list:
    """``(items, count)`` of the parameter pieces stage ``s`` holds without ZeRO, as
    ZeRO 3 gathers them: the embedding (``wte`` + ``wpe``, first stage), each of its L
    layers, the final LayerNorm (with the tied ``wte`` copy on the last stage when
    pp > 1)."""
    out = [(tm.wte + tm.wpe, 1)] if s == 0 else []
    out.append((tm.layer_params, L))
    if s == pp - 1:
        out.append((tm.lnf + (tm.wte if pp > 1 else 0.0), 1))
    return [(n, c) for n, c in out if n > 0 and c > 0]


def stage_memory(tm: TensorMemory, *, L: int, pp: int, s: int, dp: int, zero: int, m: int,
                 schedule: str, checkpoint: bool, sb: StateBytes,
                 bucket_bytes: float = BUCKET_BYTES) -> dict:
    """Bytes per device on stage ``s`` (see the module doc): ``model_states``
    (:func:`model_state_bytes` of its pieces, each sharded on its own), ``transient``
    (ZeRO 2: the gradient of the largest piece and one bucket, at most the stage's;
    ZeRO 3: the largest piece gathered, and its gradient), ``activations``,
    ``workspace``, ``total``, ``in_flight``."""
    pieces = _pieces(tm, L, pp, s)
    full = sum(round(n) * c for n, c in pieces)
    ms = _states(full, sum(-(-round(n) // dp) * c for n, c in pieces), zero, sb)
    if zero == 2:        # buckets are reduce-scattered as soon as the backward ends them
        transient = min(full, max(n for n, _ in pieces) + bucket_bytes / sb.grad) * sb.grad
    elif zero == 3:
        transient = max(n for n, _ in pieces) * (sb.param + sb.grad)
    else:
        transient = 0.0
    k = in_flight(pp, m, s, schedule)
    acts = (k * L * (tm.act_ckpt if checkpoint else tm.act_layer)
            + (tm.act_layer if checkpoint else 0.0) + tm.grad_bufs)
    if s == pp - 1:
        acts += k * tm.logits
    return {"model_states": ms, "transient": transient, "activations": acts,
            "workspace": tm.workspace,
            "total": ms["total"] + transient + acts + tm.workspace, "in_flight": k}


def composition_memory(tm: TensorMemory, *, layers: int, dp: int, pp: int, zero: int, m: int,
                       schedule: str, checkpoint: bool, sb: StateBytes,
                       bucket_bytes: float = BUCKET_BYTES) -> dict:
    """The worst stage's :func:`stage_memory` (with its ``stage``): what must fit."""
    L = layers // pp
    best = None
    for s, _ in _rep_stages(pp):
        mem = stage_memory(tm, L=L, pp=pp, s=s, dp=dp, zero=zero, m=m, schedule=schedule,
                           checkpoint=checkpoint, sb=sb, bucket_bytes=bucket_bytes)
        if best is None or mem["total"] > best["total"]:
            best = {**mem, "stage": s}
    return best


def _rep_stages(pp: int) -> list[tuple[int, int]]:
    """``(stage, count)``: the first stage, the first middle stage (standing for the
    ``pp - 2`` middle ones, which differ only in what 1F1B keeps in flight, the most
    at the first of them) and the last stage."""
    if pp == 1:
        return [(0, 1)]
    if pp == 2:
        return [(0, 1), (1, 1)]
    return [(0, 1), (1, pp - 2), (pp - 1, 1)]
