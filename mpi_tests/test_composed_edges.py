"""Sharded training at its edges, under MPI: classification heads (pp = 1 and pp > 1,
every ZeRO stage), float32, buckets that dp does not divide or that are emptier than
dp, zero-size Optimus/SUMMA2.5 shards under ZeRO, one layer per stage with fewer
micro-batches than stages; input that is bad on one rank only; ZeRO-3 caches that keep
no gathered parameter; and the independent (nominal) traffic and tight memory checks
catching what a closed form restating the code cannot."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, collective_raises, parallel_assert, skip_unless
from summasim.grid import Mesh
from summasim.harness.cases import MeshCase
from summasim.harness.composed import mesh_inputs, run_mesh
from summasim.transformer import composed
from summasim.transformer.model import Config
from summasim.transformer.schemes import get_scheme

P = WORLD.Get_size()


def _dp_pp(p):
    """A (dp, pp) with dp * pp = p, both > 1 when p allows, pp at most 4."""
    pairs = [(p // pp, pp) for pp in range(1, min(p, 4) + 1) if p % pp == 0]
    both = [f for f in pairs if f[0] > 1 and f[1] > 1]
    return max(both or pairs, key=lambda f: (f[1], -f[0]))


def _megatron(dp, pp, *, zero, m=2, schedule="1f1b", ncls=0, dtype=np.float64,
              hidden=8, vocab=8, layers=None, bucket=None, checkpoint=False, steps=3):
    config = Config(vocab=vocab, seq=4, hidden=hidden, heads=2, n_classes=ncls, dtype=dtype,
                    layers=layers if layers is not None else (pp + 1 if pp > 1 else 2))
    kw = {} if bucket is None else {"bucket_bytes": bucket}
    return MeshCase.parse(f"dp={dp},pp={pp},tp=megatron:1", dp * m, config, zero=zero,
                          schedule=schedule, microbatches=m, checkpoint=checkpoint,
                          steps=steps, **kw)


def _two_d(zero, bucket):
    """dp > 1 over a 2D/2.5D tensor grid (its rows i > 0 hold zero-size shards)."""
    for dp, spec, q, d in ((2, "optimus:2x2", 2, 1), (4, "optimus:2x2", 2, 1),
                           (2, "summa25:2x2x2", 2, 2)):
        if dp * q * q * d == P:
            config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=2)
            return MeshCase.parse(f"dp={dp},pp=1,tp={spec}", dp * d * q, config, zero=zero,
                                  bucket_bytes=bucket)
    return None


def _uneven_heads(pp: int):
    """A 2D/2.5D/3D tensor grid whose columns hold unequal numbers of whole heads (3
    heads over 2 columns, 4 over 3), with ``pp`` stages around it and an MLP width
    (2.9 h) that the grid does not cut evenly: each rank hands on, and moves in its
    layers, its own column's share, which differs from rank to rank."""
    if P % pp:
        return None
    # tensor size -> (grid, the batch's row split d pr)
    grids = {2: ("optimus:1x2", 1), 3: ("optimus:1x3", 1), 4: ("summa25:1x2x2", 2),
             8: ("3d:2x2x2", 4), 9: ("optimus:3x3", 3)}
    if pp > 1:
        grids[4] = ("optimus:2x2", 2)
    if P // pp not in grids or (pp, P) == (1, 2) or (pp, P) == (1, 3):
        return None
    spec, rows = grids[P // pp]
    pc = int(spec.split(":")[1].split("x")[1])
    heads = 3 if pc == 2 else 4
    config = Config(vocab=7, seq=4, hidden=6 * heads, heads=heads, layers=2 * pp,
                    ffn_mult=2.9)
    return MeshCase.parse(f"dp=1,pp={pp},tp={spec}", 2 * rows, config, zero=0,
                          microbatches=2)


DP, PP = _dp_pp(P)
# name -> (case or None, why it may not fit)
CASES = {
    # classification: the last stage holds cls.* and no wte copy (no embed.tie)
    "cls pp=1 zero0": (_megatron(P, 1, zero=0, m=1, ncls=3), ""),
    "cls pp>1 zero1 bucket=1": (_megatron(DP, PP, zero=1, ncls=3, bucket=1)
                                if PP > 1 else None, "pp > 1"),
    "cls pp>1 zero2 gpipe": (_megatron(DP, PP, zero=2, ncls=3, schedule="gpipe")
                             if PP > 1 else None, "pp > 1"),
    "cls pp>1 zero3 ckpt": (_megatron(DP, PP, zero=3, ncls=3, checkpoint=True)
                            if PP > 1 else None, "pp > 1"),
    # float32 (bound 1e-4) through Adam, packing and the comparisons
    "float32 zero1": (_megatron(DP, PP, zero=1, dtype=np.float32), ""),
    "float32 zero3": (_megatron(DP, PP, zero=3, dtype=np.float32), ""),
    # h = 6, vocab 5: buckets that dp does not divide, and (bucket = 1 byte: every
    # parameter its own bucket) LayerNorm vectors of 6 items over dp up to 16
    "uneven zero2 bucket=1": (_megatron(P, 1, zero=2, m=1, hidden=6, vocab=5, bucket=1), ""),
    "uneven zero1 one bucket": (_megatron(DP, PP, zero=1, hidden=6, vocab=5, bucket=1 << 40),
                                ""),
    # one layer per stage, fewer micro-batches than stages (1F1B warm-up longer than m)
    "pp=layers 1f1b m=1": (_megatron(1, P, zero=0, m=1, layers=P) if P > 1 else None,
                           "pp > 1"),
    # zero-size shards on tensor rows i > 0, under ZeRO
    "2d dp>1 zero3 bucket=1": (_two_d(3, 1), "dp=2/4 x optimus:2x2 or dp=2 x summa25:2x2x2"),
    "2d dp>1 zero1": (_two_d(1, 64), "dp=2/4 x optimus:2x2 or dp=2 x summa25:2x2x2"),
    # columns of unequal whole heads: the hand-offs, traffic and Table 1 per rank
    "uneven heads pp=1": (_uneven_heads(1), "p = 4, 8 or 9"),
    "uneven heads pp=2": (_uneven_heads(2), "p = 4, 8 or 16"),
    "uneven heads pp=3": (_uneven_heads(3), "p = 9"),
}


def _row(res):
    r = res.extra["report"]
    return (f"{r.mesh} zero={r.zero} {r.schedule} m={r.microbatches}: ok={res.ok} loss "
            f"{r.loss_err:.1e} grad {r.grad_err:.1e} param {r.param_err:.1e} ({r.worst}) "
            f"failures={r.failures} traffic {r.traffic} vs {r.traffic_expected} memory "
            f"{r.memory} vs {r.memory_formula}")


@pytest.mark.parametrize("name", list(CASES))
def test_edge_composition_matches_the_serial_model(backend, name):
    case, needs = CASES[name]
    skip_unless(case is not None and case.misfit(P) == "", f"needs {needs} (p = {P})")
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(res.ok and r.values_ok and not r.failures, _row(res))
    if case.config.n_classes and case.pp > 1:       # no tied copy on the last stage
        parallel_assert(r.traffic["embed.tie"] == 0, _row(res))
    if case.dp > 1:
        parallel_assert(r.traffic["dp.grads"] > 0, _row(res))


def _trainer(zero=1, dp=None, pp=None, **kw):
    dp, pp = (DP, PP) if dp is None else (dp, pp)
    config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=max(pp, 2))
    params, tokens, targets = mesh_inputs(config, 2 * dp, 0)
    mesh = Mesh(WORLD, dp, pp, "1d", t=1)
    tr = composed.Trainer(params, config, mesh, get_scheme("megatron"), zero=zero,
                          microbatches=2, **kw)
    return tr, mesh, tokens, targets


@pytest.mark.parametrize("bad", ["token values", "batch size", "token range"])
def test_tokens_bad_on_one_rank_raise_on_every_rank_before_data_moves(bad):
    skip_unless(P > 1, "needs two ranks")
    tr, mesh, tokens, targets = _trainer()
    try:
        mine = WORLD.Get_rank() == P - 1
        if mine and bad == "token values":
            tokens = (tokens + 1) % 8
        elif mine and bad == "batch size":
            tokens, targets = tokens[:1], targets[:1]
        elif mine and bad == "token range":
            tokens = tokens + 100
        mesh.trace.clear()
        msg = collective_raises(ValueError, tr.step, tokens, targets)
        parallel_assert(msg.startswith("composed.step") and f"rank {P - 1}" in msg, msg)
        sent = sum(e.nbytes for e in mesh.trace.events)
        parallel_assert(sent == 0, f"{sent} bytes moved before the error")
    finally:
        mesh.free()


def test_a_micro_batch_the_tensor_grid_cannot_cut_raises_before_data_moves():
    """Trainer.step checks that each micro-batch fits the tensor scheme (whole sequences
    per rank of a 2D/3D grid) on every rank before any work: a direct user of the
    Trainer gets the scheme's own error, not a wrong loss of 0 or a reshape error."""
    grids = {4: ("optimus", dict(q=2), 2), 8: ("3d", dict(q=2, d=2), 4),
             9: ("optimus", dict(q=3), 3), 16: ("optimus", dict(q=4), 4)}
    skip_unless(P in grids, "p = 4, 8, 9 or 16 (a tensor grid of several rows)")
    name, kw, rows = grids[P]
    spec = get_scheme(name)
    config = Config(vocab=8, seq=4, hidden=8 * rows, heads=2 * rows, layers=1)
    params, tokens, targets = mesh_inputs(config, rows - 1, 0)       # one sequence short
    mesh = Mesh(WORLD, 1, 1, spec.grid_kind, **kw)
    try:
        tr = composed.Trainer(params, config, mesh, spec)
        mesh.trace.clear()
        msg = collective_raises(ValueError, tr.step, tokens, targets)
        parallel_assert(f"batch b = {rows - 1}" in msg and "whole sequences" in msg, msg)
        sent = sum(e.nbytes for e in mesh.trace.events)
        parallel_assert(sent == 0, f"{sent} bytes moved before the error")
    finally:
        mesh.free()


def test_a_setting_bad_on_one_rank_raises_on_every_rank():
    skip_unless(P > 1, "needs two ranks")
    zero = 3 if WORLD.Get_rank() == P - 1 else 1
    msg = ""
    mesh = None
    try:
        config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=max(PP, 2))
        params, _, _ = mesh_inputs(config, 2 * DP, 0)
        mesh = Mesh(WORLD, DP, PP, "1d", t=1)
        msg = collective_raises(ValueError, composed.Trainer, params, config, mesh,
                                get_scheme("megatron"), zero=zero)
    finally:
        mesh.free()
    parallel_assert("composed.Trainer" in msg and "zero" in msg, msg)


@pytest.mark.parametrize("bad,words", [
    ("stages on one rank", "stages"),
    ("micro-batches", "needs micro-batches m a multiple of pp = 2 (they go in groups of "
                      "pp per chunk); got m = 3"),
    ("split", "--stages 1,3: needs 4 non-negative entries (one per stage and chunk) "
              "summing to the model's 4 layers"),
    ("one stage", "interleaved:2 needs pp >= 2 stages, the mesh has pp = 1"),
])
def test_a_bad_split_or_interleaving_raises_on_every_rank_before_data_moves(bad, words):
    skip_unless(P % 2 == 0, f"needs an even world size (p = {P})")
    pp = 1 if bad == "one stage" else 2
    config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=4)
    params, _, _ = mesh_inputs(config, 2, 0)
    kw = dict(schedule="interleaved", chunks=2, microbatches=2, stages=(1, 1, 1, 1))
    if bad == "stages on one rank" and WORLD.Get_rank() == P - 1:
        kw["stages"] = (2, 0, 1, 1)
    elif bad == "micro-batches":
        kw["microbatches"] = 3
    elif bad == "split":
        kw["stages"] = (1, 3)
    elif bad == "one stage":
        kw["stages"] = (2, 2)
    mesh = Mesh(WORLD, P // pp, pp, "1d", t=1)
    try:
        mesh.trace.clear()
        msg = collective_raises(ValueError, composed.Trainer, params, config, mesh,
                                get_scheme("megatron"), **kw)
        # bad everywhere: the error itself; on one rank: the agreement names it
        parallel_assert(words in msg and (bad != "stages on one rank" or (
            msg.startswith("composed.Trainer") and f"rank {P - 1}" in msg)), msg)
        sent = sum(e.nbytes for e in mesh.trace.events)
        parallel_assert(sent == 0, f"{sent} bytes moved before the error")
    finally:
        mesh.free()


def test_zero3_forward_caches_keep_no_gathered_parameter(monkeypatch):
    """ZeRO-3 drops a gathered unit after its forward piece: no array in the caches of
    the micro-batches in flight may lie in a gathered buffer (they are re-gathered for
    the backward; the values are checked by the compositions above)."""
    skip_unless(P > 1, "needs dp > 1")
    bufs = []
    real = composed.ring_allgather_unchecked

    def recording(buf, comm):
        bufs.append(buf)
        return real(buf, comm)

    monkeypatch.setattr(composed, "ring_allgather_unchecked", recording)
    tr, mesh, tokens, targets = _trainer(zero=3, dp=P, pp=1, checkpoint=False)
    try:
        caches, _ = tr._forward(0, 0, tokens[:1], targets[:1], tokens.size, [])
        held = []

        def leaves(o):
            if isinstance(o, np.ndarray):
                held.append(o)
            elif isinstance(o, dict):
                for v in o.values():
                    leaves(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    leaves(v)

        leaves(caches)
        kept = sum(a.size for a in held if any(np.shares_memory(a, b) for b in bufs))
        parallel_assert(bufs and kept == 0, f"caches keep {kept} gathered items "
                        f"({sum(b.size for b in bufs)} gathered)")
    finally:
        mesh.free()


def _breakable():
    case = _megatron(DP, PP, zero=1, hidden=6, vocab=5, bucket=64, steps=1)
    return case if case.dp > 1 else None


def test_nominal_traffic_catches_what_a_restated_closed_form_cannot(backend, monkeypatch):
    """Every all-gather runs twice (the values stay right) and the per-rank closed form
    is 'fixed' to match: only the group's nominal (dp - 1) N form sees the waste."""
    case = _breakable()
    skip_unless(case is not None, f"needs dp > 1 (p = {P})")
    real_ag, real_items = composed.ring_allgather_unchecked, composed.ring_send_items

    def twice(buf, comm):
        real_ag(buf, comm)
        return real_ag(buf, comm)

    monkeypatch.setattr(composed, "ring_allgather_unchecked", twice)
    monkeypatch.setattr(composed, "ring_send_items", lambda n, p, r, half: real_items(
        n, p, r, half) * (2 if half == "ag" else 1))
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(r.values_ok and r.traffic == r.traffic_expected, _row(res))
    parallel_assert(not res.ok and r.failures == ["traffic"], _row(res))


def test_memory_check_is_tight(backend, monkeypatch):
    """Three Adam items more per bucket than a rank holds: inside the old slack of four
    items per bucket, outside the floor/ceil bound of the buckets' chunks."""
    case = _breakable()
    skip_unless(case is not None, f"needs dp > 1 (p = {P})")
    real = composed.Trainer.state_bytes
    item = np.dtype(case.config.dtype).itemsize

    def more(self):
        out = dict(real(self))
        extra = 3 * len(self.buckets) * item
        out["optimizer"] += extra
        out["total"] += extra
        return out

    monkeypatch.setattr(composed.Trainer, "state_bytes", more)
    res = run_mesh(case, WORLD, backend, timed=False)
    r = res.extra["report"]
    parallel_assert(r.values_ok and not res.ok and r.failures == ["memory"], _row(res))


def test_the_nominal_forms_hold_when_chunks_divide_evenly():
    """With every bucket a multiple of dp the per-rank closed form is the textbook
    2 (dp - 1)/dp of the gradient bytes (ZeRO 0); ZeRO 1 reduce-scatters the gradients
    and all-gathers the parameters, (dp - 1)/dp each, the same total (the ZeRO paper's
    P_os), on every rank."""
    skip_unless(P > 1, "needs dp > 1")
    dp = P
    for zero in (0, 1):
        # vocab = seq = dp, h = 2 dp: every parameter's length is a multiple of dp
        config = Config(vocab=dp, seq=dp, hidden=2 * dp, heads=2, layers=1)
        params, _, _ = mesh_inputs(config, dp, 0)
        mesh = Mesh(WORLD, dp, 1, "1d", t=1)
        try:
            tr = composed.Trainer(params, config, mesh, get_scheme("megatron"), zero=zero,
                                  bucket_bytes=1)
            sizes = [hi - lo for lo, hi in tr.buckets]
            parallel_assert(all(n % dp == 0 for n in sizes), f"buckets {sizes}")
            item = 8
            got = tr.expected_traffic(dp, config.seq)
            want = (2 if zero == 0 else 1) * (dp - 1) * tr.n * item // dp
            parallel_assert(got["dp.grads"] == want, f"zero {zero}: {got} vs {want}")
            if zero == 1:
                parallel_assert(got["zero.params"] == (dp - 1) * tr.n * item // dp, str(got))
                parallel_assert(got["dp.grads"] + got["zero.params"]
                                == 2 * (dp - 1) * tr.n * item // dp, str(got))
        finally:
            mesh.free()


@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_3_hold_a_piece_of_the_gradient_not_all_of_it(zero, monkeypatch):
    """Each bucket is reduce-scattered as soon as the backward has finished it, so the
    micro-batch gradient buffers alive at once stay within the largest piece (a layer,
    or the embedding with its tied wte) plus one bucket: with 6 layers and one-parameter
    buckets, well under the stage's whole gradient, which every micro-batch once held."""
    config = Config(vocab=8, seq=4, hidden=8, heads=2, layers=6)
    params, tokens, targets = mesh_inputs(config, 2 * P, 0)
    mesh = Mesh(WORLD, P, 1, "1d", t=1)
    live, peak = {}, [0]
    add, done = composed._BucketGrads.add, composed._BucketGrads.done

    def count(self):        # the items every micro-batch's buckets hold right now
        live[id(self)] = sum(b.size for b in self.bufs.values())
        peak[0] = max(peak[0], sum(live.values()))

    def counting_add(self, offset, v):
        add(self, offset, v)
        count(self)

    def counting_done(self, piece):
        done(self, piece)
        count(self)

    monkeypatch.setattr(composed._BucketGrads, "add", counting_add)
    monkeypatch.setattr(composed._BucketGrads, "done", counting_done)
    try:
        tr = composed.Trainer(params, config, mesh, get_scheme("megatron"), zero=zero,
                              microbatches=2, bucket_bytes=1)
        tr.step(tokens, targets)
        unit = max(u.stop - u.start for u in tr.units.values())
        parallel_assert(0 < peak[0] <= unit + max(hi - lo for lo, hi in tr.buckets)
                        and peak[0] < tr.n / 2,
                        f"peak {peak[0]} items live, largest unit {unit}, stage {tr.n}")
    finally:
        mesh.free()
