"""The closed forms of Megatron sequence parallelism (summasim.transformer.megatron), pure:
no MPI. The MPI suite (mpi_tests/test_sequence_parallel.py) checks them against the
trace and the caches at the group sizes it runs on; here they are checked against each
other and against Optimus Table 1 for groups of up to 16 ranks, which no CPU run reaches.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from summasim.costmodel.workload.table1 import table1_paper
from summasim.transformer import megatron, model

B, S = 2, 48            # 48 = lcm of 1, 2, 3, 4, 6, 8, 12, 16 (the t below)
TS = (1, 2, 3, 4, 6, 8, 12, 16)


def config(t: int, n_classes: int = 0, layers: int = 3) -> model.Config:
    return model.Config(vocab=16 * 3, seq=S, hidden=4 * 48, heads=48, layers=layers,
                        dtype=np.float32, n_classes=n_classes)


def by_prefix(ledger: Counter, prefix: str) -> dict:
    """{op: bytes} of the ledger's events whose phase starts with ``prefix``."""
    out: Counter = Counter()
    for (phase, op, nbytes), count in ledger.items():
        if phase.startswith(prefix):
            out[op] += nbytes * count
    return dict(out)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("t", TS)
def test_ring_halves_send_the_bytes_of_the_all_reduces_they_replace(t, checkpoint):
    """Per layer and pass, the sequence-parallel ring halves send exactly the
    ``2 (t-1)/t`` bytes per all-reduced byte that the plain scheme's all-reduces count
    (Table 1: ``4 (t-1)/t b s h`` items forward; backward the same, doubled by the
    recompute), in sendrecvs only; the head and the embedding likewise."""
    cfg = config(t)
    item = cfg.dtype.itemsize
    plain = megatron.traffic(cfg, t, B, S, checkpoint=checkpoint)
    sp = megatron.traffic(cfg, t, B, S, checkpoint=checkpoint, sequence_parallel=True)
    paper = table1_paper("megatron", B, S, cfg.hidden, t)
    ring = Fraction(2 * (t - 1), t)
    for l in range(cfg.layers):
        for pas, table in (("fwd", paper["forward communication"]),
                           ("bwd", paper["backward communication"]
                            * (1 if checkpoint else Fraction(1, 2)))):
            got = by_prefix(sp, f"h{l}.{pas}/tp.")
            reduced = by_prefix(plain, f"h{l}.{pas}/tp.").get("allreduce", 0)
            assert set(got) <= {"sendrecv"}
            assert got.get("sendrecv", 0) == ring * reduced == table * item, (l, pas, got)
    # the vocabulary lookup (reduce-scatter, all-gather back) and the LM head (all-gather,
    # reduce-scatter back): one all-reduce's bytes each, as in the plain scheme; the
    # loss's statistics stay all-reduces
    embed = by_prefix(sp, "embed.")
    assert "allreduce" not in embed
    assert embed.get("sendrecv", 0) == ring * by_prefix(plain, "embed.").get("allreduce", 0)
    lm_head = by_prefix(plain, "loss.bwd/").get("allreduce", 0)
    assert by_prefix(sp, "loss.").get("sendrecv", 0) == ring * lm_head == \
        (ring * B * S * cfg.hidden * item if t > 1 else 0)
    assert by_prefix(sp, "loss.fwd/aux.max") == by_prefix(plain, "loss.fwd/aux.max")


@pytest.mark.parametrize("n_classes", [0, 3], ids=["lm", "cls"])
@pytest.mark.parametrize("t", TS)
def test_what_sequence_parallelism_adds(t, n_classes):
    """Beyond the replaced all-reduces: one all-gather before the head and one in the
    embedding's backward (``t - 1`` steps of ``b s h / t``), one all-reduce of the
    ``6 L + 2`` hidden-sized gradients of :func:`sequence_parallel_keys`; nothing at all
    on a group of one."""
    cfg = config(t, n_classes)
    item = cfg.dtype.itemsize
    sp = megatron.traffic(cfg, t, B, S, sequence_parallel=True)
    if t == 1:
        assert sp == Counter() and megatron.traffic(cfg, t, B, S) == Counter()
        return
    chunk = B * S * cfg.hidden * item // t
    assert sp[("loss.fwd/aux.sp.head", "sendrecv", chunk)] == t - 1
    assert sp[("embed.bwd/aux.sp.vocab", "sendrecv", chunk)] == t - 1
    keys = megatron.sequence_parallel_keys(cfg)
    assert len(keys) == 6 * cfg.layers + 2 and keys[-2:] == ["lnf.g", "lnf.b"]
    assert sp[("sp.grads", "allreduce", (6 * cfg.layers + 2) * cfg.hidden * item)] == 1
    stage = model.stage_keys(cfg, [1], False, True)          # a last pipeline stage
    assert megatron.sequence_parallel_keys(cfg, stage) == [
        f"h1.{k}" for k in megatron.SP_LAYER_KEYS] + ["lnf.g", "lnf.b"]


@pytest.mark.parametrize("t", TS)
def test_activation_shape_and_memory(t):
    """The slice between the pieces is 1/t of the replicated activation; a layer holds
    ``2 b s h (1 - 1/t) + 2 b s (1 - 1/t)`` fewer elements with sequence parallelism
    (the LayerNorm inputs and statistics on the slice, the gathered outputs kept), and a
    checkpointed layer 1/t of its input."""
    cfg = config(t)
    h, bs = cfg.hidden, B * S
    assert megatron.activation_shape(cfg, t, B, S) == (B, S, h)
    assert megatron.activation_shape(cfg, t, B, S, True) == (B, S // t, h)
    plain = megatron.activation_items(cfg, t, B, S)
    sp = megatron.activation_items(cfg, t, B, S, sequence_parallel=True)
    assert plain - sp == Fraction(2 * bs * h + 2 * bs) * (1 - Fraction(1, t))
    assert megatron.activation_items(cfg, t, B, S, sequence_parallel=True, checkpoint=True) \
        * t == megatron.activation_items(cfg, t, B, S, checkpoint=True) == bs * h


def test_indivisible_sequence_is_refused_with_the_numbers():
    cfg = config(4)
    for fn, args in ((megatron.activation_shape, (cfg, 4, B, 10, True)),
                     (megatron.traffic, (cfg, 4, B, 10))):
        with pytest.raises(ValueError, match=r"T = 10 is not divisible by p = 4"):
            fn(*args, **({} if fn is megatron.activation_shape else
                         {"sequence_parallel": True}))
    assert megatron.activation_shape(cfg, 4, B, 10) == (B, 10, cfg.hidden)
