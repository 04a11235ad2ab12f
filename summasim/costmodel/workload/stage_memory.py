"""Memory per device of one pipeline stage of a composition (bytes): its share of the
model states under ZeRO, the activations its schedule keeps in flight, the transient
buffers and the workspace (see :mod:`~summasim.costmodel.workload.composition`), and
THE split of the layers into stages the composition prices (:func:`stage_plan`)."""

from __future__ import annotations

from functools import lru_cache

from ...spec import stage_layers
from .pipeline import in_flight, interleaved_held
from .tensor import TensorMemory
from .zero import BUCKET_BYTES, StateBytes, _states


@lru_cache(maxsize=4096)
def stage_plan(layers: int, pp: int, stages: tuple | None = None,
               chunks: int = 1) -> tuple:
    """``((stage, count, chunk_layers), ...)``: the stages of :func:`summasim.spec.stage_layers`
    (``stages``: layers per (virtual) stage, None: the even split; ``chunks``: V model
    chunks per stage, virtual stage ``c pp + s`` being chunk c of stage s), grouped:
    stages with the same layers per chunk and the same ends (the first holds the
    embedding, the last the head) cost the same time, so each group is priced once,
    by its first stage, which under 1F1B holds the most in flight; ``count`` stages
    stand for it. The even split of a deep pipeline is three groups (first, middle,
    last): a composition costs O(1) in pp."""
    ranges = stage_layers(layers, pp, stages, chunks)
    groups: dict = {}
    for s in range(pp):
        per = tuple(len(ranges[c * pp + s]) for c in range(chunks))
        key = (per, s == 0, s == pp - 1)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [s, 1, per]
    return tuple(sorted(tuple(g) for g in groups.values()))


def _pieces(tm: TensorMemory, L: int, pp: int, s: int, tied: bool = True) -> list:
    """``(items, count)`` of the parameter pieces stage ``s`` holds without ZeRO, as
    ZeRO 3 gathers them: the embedding (``wte`` + ``wpe``, first stage), each of its L
    layers, the final LayerNorm with the head on the last stage (the tied ``wte`` copy
    when pp > 1; an untied head's own ``[h, v]`` always)."""
    out = [(tm.wte + tm.wpe, 1)] if s == 0 else []
    out.append((tm.layer_params, L))
    if s == pp - 1:
        head = tm.head if not tied else (tm.wte if pp > 1 else 0.0)
        out.append((tm.lnf + head, 1))
    return [(n, c) for n, c in out if n > 0 and c > 0]


def _activation_per_layer(tm: TensorMemory, recompute: str) -> tuple[float, float]:
    """``(per layer per micro-batch in flight, once)`` bytes of activations under
    ``recompute``: all of a layer (none); its checkpoint, and one layer recomputed
    whole (full); all but its attention core, and one core recomputed (selective)."""
    if recompute == "full":
        return tm.act_ckpt, tm.act_layer
    if recompute == "selective":
        return tm.act_sel, tm.act_layer - tm.act_sel
    return tm.act_layer, 0.0


def stage_memory(tm: TensorMemory, *, L: int, pp: int, s: int, dp: int, zero: int, m: int,
                 schedule: str, checkpoint: bool | None = None, sb: StateBytes,
                 bucket_bytes: float = BUCKET_BYTES, recompute: str | None = None,
                 chunks: tuple | None = None, tied: bool = True) -> dict:
    """Bytes per device on stage ``s`` (see the module doc): ``model_states``
    (:func:`model_state_bytes` of its pieces, each sharded on its own), ``transient``
    (ZeRO 2: the gradient of the largest piece and one bucket, at most the stage's;
    ZeRO 3: the largest piece gathered, and its gradient), ``activations``,
    ``workspace``, ``total``, ``in_flight``.

    ``L`` layers in all; under the interleaved schedule ``chunks`` gives the layers of
    each of the stage's V model chunks, and the activations are the largest over
    Megatron-LM's schedule of the chunk passes in flight
    (:func:`~summasim.costmodel.workload.pipeline.interleaved_held`), the last stage's
    last chunk holding the logits too. ``recompute`` (``checkpoint`` True: ``full``)."""
    if recompute is None:
        recompute = "full" if checkpoint else "none"
    pieces = _pieces(tm, L, pp, s, tied)
    full = sum(round(n) * c for n, c in pieces)
    ms = _states(full, sum(-(-round(n) // dp) * c for n, c in pieces), zero, sb)
    if zero == 2:        # buckets are reduce-scattered as soon as the backward ends them
        transient = min(full, max(n for n, _ in pieces) + bucket_bytes / sb.grad) * sb.grad
    elif zero == 3:
        transient = max(n for n, _ in pieces) * (sb.param + sb.grad)
    else:
        transient = 0.0
    per, once = _activation_per_layer(tm, recompute)
    if schedule == "interleaved":
        V = len(chunks)
        weights = [n * per + (tm.logits if s == pp - 1 and c == V - 1 else 0.0)
                   for c, n in enumerate(chunks)]
        held = interleaved_held(pp, m, V, s)
        k = max(sum(held[i]) for i in range(len(held)))
        acts = max(sum(n * w for n, w in zip(vec, weights)) for vec in held)
        acts += once + tm.grad_bufs
    else:
        k = in_flight(pp, m, s, schedule)
        acts = (k * L * (tm.act_ckpt if recompute == "full" else per)
                + (tm.act_layer if recompute == "full" else once) + tm.grad_bufs)
        if s == pp - 1:
            acts += k * tm.logits
    return {"model_states": ms, "transient": transient, "activations": acts,
            "workspace": tm.workspace,
            "total": ms["total"] + transient + acts + tm.workspace, "in_flight": k}


def composition_memory(tm: TensorMemory, *, layers: int, dp: int, pp: int, zero: int, m: int,
                       schedule: str, checkpoint: bool | None = None, sb: StateBytes,
                       bucket_bytes: float = BUCKET_BYTES, recompute: str | None = None,
                       stages: tuple | None = None, chunks: int = 1,
                       tied: bool = True) -> dict:
    """The worst stage's :func:`stage_memory` (with its ``stage``): what must fit."""
    best = None
    for s, _, per in stage_plan(layers, pp, stages, chunks):
        mem = stage_memory(tm, L=sum(per), pp=pp, s=s, dp=dp, zero=zero, m=m,
                           schedule=schedule, checkpoint=checkpoint, sb=sb,
                           bucket_bytes=bucket_bytes, recompute=recompute, chunks=per,
                           tied=tied)
        if best is None or mem["total"] > best["total"]:
            best = {**mem, "stage": s}
    return best

