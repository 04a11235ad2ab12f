"""The serial reference of the training rows is one copy per node: rank 0 publishes it
in a shared-memory window (summasim.harness.shared), every rank reads the same values
read-only, and no rank but rank 0 holds a whole model (its private memory follows its
share)."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from _util import WORLD, parallel_assert, skip_unless
from summasim.harness.cases import MeshCase, transformer_case
from summasim.harness.composed import mesh_inputs
from summasim.harness.execute import run_case
from summasim.harness.shared import NodeShared
from summasim.transformer import model
from summasim.transformer.composed import Trainer
from summasim.transformer.schemes import SCHEMES, get_scheme
from summasim.grid import Mesh

P = WORLD.Get_size()
RANK = WORLD.Get_rank()


def _tree(rng):
    return {"w": rng.normal(size=(64, 48)),
            "list": [np.arange(10, dtype=np.int32), 2.5, np.zeros((0, 3))],
            "pair": (rng.normal(size=(8, 12))[:, ::3].astype(np.float32), "text"),
            "scalar": np.float64(1.5)}


def _digest(tree) -> float:
    return float(tree["w"].sum() + tree["list"][0].sum() + tree["pair"][0].sum())


def test_every_rank_reads_the_roots_values_read_only():
    want = _tree(np.random.default_rng(7))          # the same on every rank, to compare
    with NodeShared(WORLD, want if RANK == 0 else None) as sh:
        got = sh.value
        same = (np.array_equal(got["w"], want["w"]) and got["w"].dtype == np.float64
                and np.array_equal(got["list"][0], want["list"][0])
                and got["list"][0].dtype == np.int32 and got["list"][1] == 2.5
                and got["list"][2].shape == (0, 3)
                and np.array_equal(got["pair"][0], want["pair"][0])
                and got["pair"][1] == "text" and got["scalar"] == 1.5)
        try:
            got["w"][0, 0] = 0.0
            writable = True
        except ValueError:
            writable = False
        parallel_assert(same and not writable, f"values equal {same}, writable {writable}")


def test_publishing_again_replaces_the_values_in_the_same_window_or_a_larger_one():
    """A row publishes each training step's reference into one window: the views show
    the new values, the window is kept while the values fit and grown when they do
    not."""
    rng = np.random.default_rng(3)
    first, second = rng.normal(size=(32, 16)), rng.normal(size=(32, 16))
    larger = rng.normal(size=(64, 64)).astype(np.float32)
    with NodeShared(WORLD, {"g": first, "t": 1} if RANK == 0 else None) as sh:
        ok = np.array_equal(sh.value["g"], first) and sh.value["t"] == 1
        win = sh._win
        sh.publish({"g": second, "t": 2} if RANK == 0 else None)
        kept = sh._win is win
        ok = ok and np.array_equal(sh.value["g"], second) and sh.value["t"] == 2
        sh.publish({"g": larger, "h": first} if RANK == 0 else None)
        grown = sh._win is not win and sh.capacity >= larger.nbytes + first.nbytes
        ok = (ok and np.array_equal(sh.value["g"], larger) and sh.value["g"].dtype == np.float32
              and np.array_equal(sh.value["h"], first))
        parallel_assert(ok and kept and grown, f"values {ok}, window kept {kept}, "
                        f"grown {grown}")


def _rss_anon() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def test_the_node_holds_one_copy_not_one_per_rank():
    skip_unless(_rss_anon() is not None, "needs /proc/self/status (Linux) to read RssAnon")
    skip_unless(P > 1, "at p = 1 there is no other rank to share with (MPICH then gives "
                "the window private memory)")
    n = 4 << 20                                              # 32 MiB of float64
    tree = {"big": np.random.default_rng(0).normal(size=n)} if RANK == 0 else None
    before = _rss_anon()
    with NodeShared(WORLD, tree) as sh:
        total = float(sh.value["big"].sum())                 # touch every page
        grown = _rss_anon() - before
        parallel_assert(WORLD.allgather(total) == [total] * P, "ranks read different data")
        # a private copy would add 32 MiB of anonymous memory to this rank
        parallel_assert(grown < n * 8 // 4, f"RssAnon grew by {grown / 2**20:.1f} MiB "
                        f"reading a {n * 8 / 2**20:.0f} MiB shared tree")


def _traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _whole(config) -> int:
    """Bytes of the whole model's parameters."""
    return sum(math.prod(s) for s in model.param_shapes(config).values()) * \
        np.dtype(config.dtype).itemsize


SCHEME_ROWS = [(name, *spec.grids(P)[-1]) for name, spec in SCHEMES.items() if spec.grids(P)]


@pytest.mark.parametrize("name,q,pc,d", SCHEME_ROWS, ids=[f"{n}-{q}x{pc}x{d}" for n, q, pc, d
                                                          in SCHEME_ROWS])
def test_a_scheme_row_holds_its_share_of_the_reference_off_rank_0(name, q, pc, d):
    """Off rank 0, validating a scheme costs the scheme's own step plus about one shard
    of the reference (its gradient and logits blocks), not a whole model."""
    skip_unless(P > 1, "at p = 1 rank 0 runs the serial model: nothing is shared")
    case = transformer_case(name, q, d, 2 * d * max(q, 1), 8, 256, 16, 2048, 2, 4, pc=pc)
    skip_unless(case.misfit(P) == "", case.misfit(P))
    spec, config = get_scheme(name), case.config
    params, tokens, targets = model.init_params(config, 0), *mesh_inputs(config,
                                                                          case.batch, 0)[1:]
    grid = spec.make_grid(WORLD, q, d, pc=pc)

    def scheme_alone():
        local = spec.module.shard(params, config, grid)
        _, cache = spec.module.forward(local, tokens, targets, config, grid)
        spec.module.backward(cache)

    try:
        alone = _traced_peak(scheme_alone)
    finally:
        grid.free()
    del params
    row = _traced_peak(lambda: run_case(case, WORLD, None, timed=False, with_memory=False))
    whole = _whole(config)
    share = whole / (P if name == "megatron" else q * pc)  # 2.5D: replicated over depth
    extra = row - alone
    logits = case.batch * config.seq * config.vocab * 8 / P      # a rank's logits block
    parallel_assert(RANK == 0 or extra < 3 * share + 2 * logits,
                    f"{name}: the row took {extra / 2**20:.1f} MiB more than the scheme "
                    f"alone; a share of the model is {share / 2**20:.1f} MiB, the whole "
                    f"{whole / 2**20:.1f} MiB")


def test_a_mesh_row_holds_its_share_of_the_reference_off_rank_0():
    """Off rank 0, validating three Adam steps of a [dp, pp, tensor] mesh costs the
    Trainer's own step plus about a stage shard of the reference per step, not the
    whole model's gradients of every step."""
    skip_unless(P % 4 == 0, f"needs dp = 2 x pp = 2 x a Megatron group (p = {P})")
    t = P // 4
    config = model.Config(vocab=2048, seq=8, hidden=256, heads=16, layers=2)
    case = MeshCase.parse(f"dp=2,pp=2,tp=megatron:{t}", 4, config, microbatches=2)
    spec = get_scheme("megatron")
    params, tokens, targets = mesh_inputs(config, case.batch, 0)

    def trainer_alone():
        # what the row does besides the reference: its mesh built inside the measurement
        # and as many steps as it validates
        mesh = Mesh(WORLD, 2, 2, spec.grid_kind, t=t)
        try:
            trainer = Trainer(params, config, mesh, spec, microbatches=2)
            for _ in range(case.steps):
                trainer.step(tokens, targets)
        finally:
            mesh.free()

    alone = _traced_peak(trainer_alone)
    del params
    row = _traced_peak(lambda: run_case(case, WORLD, None, timed=False))
    whole = _whole(config)
    share = whole / (2 * t) + 2048 * 256 * 8 / t       # a stage's layers + the tied wte
    extra = row - alone
    parallel_assert(RANK == 0 or extra < 3 * share,
                    f"the mesh row took {extra / 2**20:.1f} MiB more than its Trainer "
                    f"alone; a stage's share is {share / 2**20:.1f} MiB, the whole model "
                    f"{whole / 2**20:.1f} MiB")


def test_a_row_that_fails_on_every_rank_leaves_no_window_behind(monkeypatch):
    """An error raised on every rank alike inside a row (caught by the caller) abandons
    the row's window; the next row on the same communicator frees it first, so a caller
    that catches such errors row after row does not pile up copies of the reference."""
    from summasim.harness import shared
    from summasim.transformer import megatron

    case = transformer_case("megatron", 1, 1, 2, 4, 4 * P, P, 8 * P, 1)

    def refuse(*a, **k):
        raise ValueError("refused on every rank")

    monkeypatch.setattr(megatron, "forward", refuse)
    for _ in range(3):
        with pytest.raises(ValueError, match="refused on every rank"):
            run_case(case, WORLD, None, timed=False, with_memory=False)
        parallel_assert(len(shared._ABANDONED) == 1, f"{len(shared._ABANDONED)} windows left")
    monkeypatch.undo()
    res = run_case(case, WORLD, None, timed=False, with_memory=False)
    parallel_assert(res.ok and not shared._ABANDONED,
                    f"ok {res.ok}, {len(shared._ABANDONED)} windows left")


def test_the_transformer_benchmark_holds_no_whole_model_off_rank_0():
    """``bench transformer`` times the schemes on the model that rank 0 shares; off rank
    0 its traced peak stays below the whole model's parameters (each rank used to build
    the whole model and shard it)."""
    from summasim.bench.transformer import bench_transformer
    from summasim.spec import Model

    skip_unless(P >= 8, f"at p = {P} a rank's shard and its step's workspaces approach the "
                "whole model")
    sizes = Model.parse("h=256,heads=16,layers=1,seq=8,vocab=2048")      # batch 2
    config = model.Config(vocab=2048, seq=8, hidden=256, heads=16, layers=1)
    peak = _traced_peak(lambda: bench_transformer(WORLD, sizes, 2, "float64", 1, False,
                                                  lambda *a, **k: None))
    whole = _whole(config)
    parallel_assert(RANK == 0 or peak < whole,
                    f"bench transformer peaked at {peak / 2**20:.1f} MiB off rank 0; the "
                    f"whole model's parameters are {whole / 2**20:.1f} MiB")
