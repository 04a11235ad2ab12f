"""The arrays and communicators a caller of the library really has.

A ``np.memmap`` or ``np.matrix`` as a result buffer (on some ranks only), operands in a
file mapped read-only, a strided parameter, an intercommunicator, ranks that ask for
different grids: each gives the right result or the same clear error on every rank,
never a wrong answer on one rank and a hang on the others.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from _util import WORLD, collective_raises, grid_shapes, parallel_assert, rel_err, skip_unless
from summasim import algorithms as algs
from summasim import layout
from summasim.algorithms.allreduce import chunk_bounds
from summasim.grid import Grid, Grid1D, Mesh
from summasim.transformer import model, optimus

P = WORLD.Get_size()
RANK = WORLD.Get_rank()


def _scratch_dir() -> str:
    """One temporary folder, named by rank 0, for every rank (removed by the caller)."""
    return WORLD.bcast(tempfile.mkdtemp(prefix="summasim-arrays-") if RANK == 0 else None)


def _cleanup(path: str) -> None:
    WORLD.Barrier()
    if RANK == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def test_an_intercommunicator_is_refused_on_every_rank():
    skip_unless(P >= 2, "an intercommunicator needs two groups")
    local = WORLD.Split(RANK % 2, RANK)
    inter = local.Create_intercomm(0, WORLD, 1 - RANK % 2, tag=5)
    try:
        for call in (lambda: algs.ring_allreduce(np.full(8, RANK + 1.0), inter),
                     lambda: algs.ring_reduce_scatter(np.zeros(8), inter),
                     lambda: algs.ring_allgather(np.zeros(8), inter),
                     lambda: Grid1D(inter),
                     lambda: Grid(inter, 1, pc=inter.Get_size())):
            msg = collective_raises(TypeError, call)
            parallel_assert("intercommunicator" in msg and "Merge" in msg, f"message: {msg!r}")
        merged = inter.Merge()          # what the message says to do: then it sums
        total = algs.ring_allreduce(np.full(8, RANK + 1.0), merged)
        parallel_assert(bool((total == P * (P + 1) / 2).all()), f"merged sum {total[:2]}")
        merged.Free()
    finally:
        inter.Free()
        local.Free()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")   # np.matrix, on purpose
def test_memmap_and_matrix_results_on_some_ranks_only():
    """Rank 0's result buffer is a file-backed ``np.memmap``, the others' plain arrays
    (the ring's wait trials of a new size class run on every rank or none); then
    ``np.matrix`` buffers, which reshape to 2-D. Each on a fresh communicator, so that
    the size class is not yet measured."""
    path = _scratch_dir()
    try:
        n = 16 * P + 3
        want = np.arange(n, dtype=float) * (P * (P + 1) / 2)
        x = np.arange(n, dtype=float) * (RANK + 1)
        for inplace in (False, True):
            comm = WORLD.Dup()
            out = (np.memmap(os.path.join(path, f"out{inplace}.bin"), np.float64, "w+",
                             shape=(n,)) if RANK == 0 else np.empty(n))
            if inplace:
                out[...] = x
            got = algs.ring_allreduce(out if inplace else x, comm, out=out)
            parallel_assert(got is out and bool((np.asarray(out) == want).all()),
                            f"in place {inplace}: {type(got).__name__} "
                            f"{np.asarray(out)[:3]}, want {want[:3]}")
            comm.Free()
        comm = WORLD.Dup()
        flat = (np.memmap(os.path.join(path, "rs.bin"), np.float64, "w+", shape=(n,))
                if RANK == 0 else np.empty(n))
        flat[...] = x
        c = algs.ring_reduce_scatter(flat, comm)
        lo, hi = chunk_bounds(n, P)[c]
        parallel_assert(bool((np.asarray(flat)[lo:hi] == want[lo:hi]).all()),
                        f"reduce-scatter chunk {c} wrong on a memmap")
        comm.Free()
        # np.matrix: a (3, 5) x and out; in place on rank 0 only
        m = np.asmatrix(np.arange(15.0).reshape(3, 5) * (RANK + 1))
        out = np.asmatrix(np.zeros((3, 5)))
        got = algs.ring_allreduce(m, WORLD, out=out)
        want_m = np.arange(15.0).reshape(3, 5) * (P * (P + 1) / 2)
        parallel_assert(got is out and bool((np.asarray(out) == want_m).all()),
                        f"matrix out: {np.asarray(out)[0, :3]}")
        mine = m.copy() if RANK == 0 else np.asarray(m).copy()
        got = algs.ring_allreduce(mine, WORLD, out=mine)
        parallel_assert(got is mine and bool((np.asarray(got) == want_m).all()),
                        "matrix in place on rank 0")
    finally:
        _cleanup(path)


def test_operands_in_a_file_mapped_read_only():
    """SUMMA broadcasts the caller's block itself from its owner; MPICH's broadcast of a
    large message writes the root's own pieces back into its buffer, which faults on
    memory mapped read-only (``np.load(mmap_mode="r")``). The root sends from a copy."""
    squares = [q for q, d in grid_shapes(P) if d == 1 and q > 1]
    skip_unless(bool(squares), f"p = {P} has no square 2D grid of more than one rank")
    q = squares[0]
    path = _scratch_dir()
    try:
        rng = np.random.default_rng(7)
        n = 96 * q                                   # blocks of 96 x 96: 72 KiB each
        A, B = rng.standard_normal((n, n)), rng.standard_normal((n, n))
        with Grid(WORLD, q) as grid:
            blocks = {}
            for name, M in (("a", A), ("b", B)):
                f = os.path.join(path, f"{name}{RANK}.npy")
                np.save(f, layout.split(M, grid, "2d"))
                blocks[name] = np.load(f, mmap_mode="r")
            parallel_assert(not blocks["a"].flags.writeable, "the block is not read-only")
            c = algs.summa_ab(blocks["a"], blocks["b"], grid)
            ref = layout.split(A @ B, grid, "2d")
            err = float(np.abs(c - ref).max() / np.abs(ref).max())
            parallel_assert(err < 1e-12, f"summa_ab on read-only mapped blocks: {err:.2e}")
            parallel_assert(bool((blocks["a"] == layout.split(A, grid, "2d")).all()),
                            "the operand changed")
    finally:
        _cleanup(path)


def test_optimus_with_a_strided_or_fortran_embedding():
    """``wte`` is broadcast down the column as it is held: a strided or Fortran-ordered
    block (same values) gives the same loss and gradients as a contiguous one."""
    skip_unless(P > 1, "a one-rank grid broadcasts nothing")
    q, d = grid_shapes(P)[-1]
    cfg = model.Config(vocab=3 * q, seq=4, hidden=4 * q, heads=2 * q, layers=1)
    params = model.init_params(cfg, seed=1)
    tokens = np.arange(d * q * 4).reshape(d * q, 4) % cfg.vocab
    with Grid(WORLD, q, d) as grid:
        local = optimus.shard(params, cfg, grid)
        loss0, cache = optimus.forward(local, tokens, tokens, cfg, grid)
        grads0 = optimus.backward(cache)
        w = local["wte"]
        wide = np.zeros((w.shape[0], 2 * w.shape[1]))
        wide[:, ::2] = w
        for held in (wide[:, ::2], np.asfortranarray(w)):
            loss, cache = optimus.forward({**local, "wte": held}, tokens, tokens, cfg, grid)
            grads = optimus.backward(cache)
            worst = max(rel_err(grads[k], grads0[k]) for k in grads0)
            parallel_assert(loss == loss0 and worst == 0.0,
                            f"loss {loss} vs {loss0}, gradients {worst:.1e}")


def test_ranks_that_ask_for_different_grids_all_raise():
    """Same size, other shape on the last rank: every rank raises, naming the shapes,
    before any group is built (a rank that built other groups would wait for ever)."""
    skip_unless(P > 1, "one rank has one grid")
    shape = (1, P) if RANK == P - 1 else (P, 1)
    msg = collective_raises(ValueError, lambda: Grid(WORLD, shape[0], pc=shape[1]))
    parallel_assert("ranks disagree on the grid [pr, pc, d]" in msg, f"message: {msg!r}")
    with Grid(WORLD, 1, pc=P) as g:                     # and agreeing ranks still build it
        parallel_assert(g.p == P and g.j == RANK, f"grid {g}")


def test_ranks_that_ask_for_different_meshes_all_raise():
    """A training mesh too: another split of the same size on the last rank (dp x 1D
    against 1D alone; before, it hung or passed with mismatched groups), or another kind
    of tensor grid."""
    skip_unless(P > 1, "one rank has one mesh")
    last = RANK == P - 1
    for make in (lambda: Mesh(WORLD, 1, 1, "1d", t=P) if last else Mesh(WORLD, P, 1, "1d"),
                 lambda: Mesh(WORLD, 1, 1, "2d", q=1, pc=P) if last
                 else Mesh(WORLD, 1, 1, "1d", t=P)):
        msg = collective_raises(ValueError, make)
        parallel_assert("Mesh: ranks disagree on the mesh" in msg, f"message: {msg!r}")
    # arguments that the kind ignores are not a difference
    mesh = Mesh(WORLD, 1, 1, "1d", t=P, q=7 if last else 1)
    parallel_assert(mesh.T == P and mesh.dp == 1, f"mesh {mesh.dp} x {mesh.pp} x {mesh.T}")
    mesh.free()


def test_verdict_and_trace_totals_take_any_communicator():
    """``harness.check.collective`` and ``Trace.allgather_totals`` take an mpi4py
    communicator, a summasim ``Comm`` or a grid, as every public function does."""
    from summasim.comm import Comm
    from summasim.harness.check import Check, collective

    with Grid1D(WORLD) as g:
        g.comm.allreduce(np.ones(3))                           # one traced event
        mine = Check(0.0, 1.0, "exact")
        mine.error, mine.ok = float(RANK), RANK != P - 1      # the last rank fails
        comm = Comm(WORLD)
        for who in (WORLD, comm, g):
            verdict = collective(who, mine)
            parallel_assert(verdict.bad_ranks == [P - 1] and verdict.error == P - 1,
                            f"{type(who).__name__}: {verdict.bad_ranks} {verdict.error}")
            totals = g.trace.allgather_totals(who)
            parallel_assert(len(totals) == P and totals[RANK]["count"] == len(g.trace.events),
                            f"{type(who).__name__}: {totals}")


def test_bfloat16_blocks_say_what_to_do():
    import ml_dtypes

    x = np.ones((2, 2), ml_dtypes.bfloat16)
    with Grid(WORLD, 1, pc=P) as g:
        msg = collective_raises(TypeError, algs.summa_ab, x, x, g)
    parallel_assert("float32" in msg and "ml_dtypes" in msg, f"message: {msg!r}")
    msg = collective_raises(TypeError, algs.ring_allreduce, x, WORLD)
    parallel_assert("float32" in msg and "ml_dtypes" in msg, f"message: {msg!r}")
