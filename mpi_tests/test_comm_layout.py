"""Comm records what it does; grids map ranks to coordinates; layouts round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from _util import WORLD, grid_shapes, parallel_assert
from summasim import layout
from summasim.comm import Comm
from summasim.grid import Grid, Grid1D

P = WORLD.Get_size()


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_grid_coordinates_and_groups(q, d):
    with Grid(WORLD, q, d) as g:
        # every rank learns every rank's coordinates; sub-communicator ranks equal coordinates
        coords = WORLD.allgather((g.k, g.i, g.j))
        row_members = g.row.mpi.allgather((g.k, g.i, g.j))
        col_members = g.col.mpi.allgather((g.k, g.i, g.j))
        depth_members = g.depth.mpi.allgather((g.k, g.i, g.j))
        ok = (sorted(coords) == [(k, i, j) for k in range(d) for i in range(q) for j in range(q)]
              and row_members == [(g.k, g.i, j) for j in range(q)]
              and col_members == [(g.k, i, g.j) for i in range(q)]
              and depth_members == [(k, g.i, g.j) for k in range(d)]
              and g.layer.rank == g.i * q + g.j and g.p == P)
        parallel_assert(ok, f"coords {g.coords}")


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_bcast_reduce_shift_are_traced(q, d):
    with Grid(WORLD, q, d) as g:
        buf = np.full(6, float(g.j))
        with g.trace.phase("demo"):
            g.row.bcast(buf, root=q - 1)
            part = np.full(3, float(g.i + 1))
            out = np.empty(3) if g.col.rank == 0 else None
            g.col.reduce(part, out, root=0)
            recv = np.empty(1)
            g.row.sendrecv(np.array([float(g.j)]), g.row.shift_ranks(-1)[1], recv,
                           g.row.shift_ranks(-1)[0])
        ok = np.all(buf == q - 1) and recv[0] == (g.j + 1) % q
        if g.i == 0:
            ok = ok and np.all(out == q * (q + 1) / 2)
        ev = g.trace.events
        ok = ok and [(e.op, e.group, e.group_size, e.root, e.nbytes, e.phase) for e in ev] == [
            ("bcast", "row", q, q - 1, 48, "demo"), ("reduce", "col", q, 0, 24, "demo"),
            ("sendrecv", "row", q, -1, 8, "demo")]
        tot = g.trace.by_op()
        ok = ok and tot["bcast"].nbytes == 48 and g.trace.by_phase()["demo"].count == 3
        ok = ok and all(e.seconds >= 0 for e in ev)
        parallel_assert(ok, f"trace {ev}")


@pytest.mark.parametrize("q,d", grid_shapes(P))
@pytest.mark.parametrize("name", ["2d", "2.5d", "row", "col", "replicated"])
@pytest.mark.parametrize("empty", [None, 0, 1])
def test_split_join_round_trip(q, d, name, empty):
    rng = np.random.default_rng(11)
    shape = [2 * q * d * P, 3 * q * P]
    if empty is not None:                      # a zero-length axis (either one)
        shape[empty] = 0
    M = rng.standard_normal(shape)
    with Grid(WORLD, q, d) as g:
        blk = layout.split(M, g, name)
        want_shape = layout.local_shape(M.shape, name, q, d, P)
        back = layout.join(blk, g, name)
        parallel_assert(blk.shape == want_shape and blk.flags.c_contiguous
                        and back.shape == M.shape and np.array_equal(back, M),
                        f"{name} on [{q},{q},{d}], shape {tuple(shape)}")


@pytest.mark.parametrize("q,d", grid_shapes(P))
def test_cube_layouts_need_a_cube(q, d):
    """The 3D product's layouts on any other grid: one clear error on every rank (they
    cut a block that a join could not put back, and differently on different ranks)."""
    from _util import collective_raises

    M = np.arange(12.0 * 12).reshape(12, 12)
    with Grid(WORLD, q, d) as g:
        for name in ("3d-a", "3d-b", "3d-c", "3d-bt", "3d-at"):
            if q == d:                               # a cube: the round trip holds
                back = layout.join(layout.split(M, g, name), g, name)
                parallel_assert(np.array_equal(back, M), f"{name} on the {q}-cube")
            else:
                msg = collective_raises(ValueError, layout.split, M, g, name)
                parallel_assert("needs a q x q x q cube" in msg, msg)
                msg = collective_raises(ValueError, layout.join, M, g, name)
                parallel_assert("needs a q x q x q cube" in msg, msg)


@pytest.mark.parametrize("name", ["row", "col", "replicated"])
def test_grid1d_layouts(name):
    with Grid1D(WORLD) as g:
        V = np.arange(4 * P * 3 * P, dtype=np.float64).reshape(4 * P, 3 * P)
        back = layout.join(layout.split(V, g, name), g, name)
        vec = np.arange(2 * P, dtype=np.float32)
        vback = layout.join(layout.split(vec, g, name), g, name)
        parallel_assert(np.array_equal(back, V) and np.array_equal(vback, vec), name)


def test_plain_communicator_is_wrapped():
    from summasim.algorithms import ring_allreduce

    dup = WORLD.Dup()
    try:
        y = ring_allreduce(np.ones(5), dup)          # a raw mpi4py communicator
        c = Comm(dup, name="x")
        parallel_assert(np.all(y == P) and c.size == P and c.name == "x", "wrap")
    finally:
        dup.Free()


@pytest.mark.parametrize("wait", ["spin", "sleep", "yield"])
def test_allreduce_ops(wait):
    c = Comm(WORLD, name="world", wait=wait)
    x = np.array([float(c.rank), -float(c.rank)])
    mx = c.allreduce(x.copy(), op="max")
    mn = c.allreduce(x.copy(), op="min")
    sm = c.allreduce(x, out=np.empty(2))
    ok = (mx.tolist() == [P - 1, 0.0] and mn.tolist() == [0.0, -(P - 1)]
          and sm.tolist() == [P * (P - 1) / 2, -P * (P - 1) / 2]
          and [e.op for e in c.trace.events] == ["allreduce"] * 3)
    parallel_assert(ok, f"{mx} {mn} {sm}")


def test_bad_wait_policy():
    from _util import collective_raises

    msg = collective_raises(ValueError, Comm, WORLD, wait="busy")
    parallel_assert("spin, sleep, yield" in msg, msg)


def test_workspaces_are_reused_and_bounded():
    c = Comm(WORLD, name="world")
    a = np.ones((3, 4))
    w1 = c.workspace("x", a)
    w2 = c.workspace("x", np.zeros((3, 4)))
    w3 = c.workspace("x", np.zeros((3, 4), np.float32))
    ok = w1 is w2 and len(w1) == 2 and w1[0] is not w1[1] and w3[0].dtype == np.float32
    for i in range(10):                      # the 8 most recent keys are kept
        c.workspace(f"y{i}", a)
    ok = ok and c.workspace("x", a) is not w1 and len(c._workspaces) == 8
    parallel_assert(ok, "workspace cache")


def test_two_wrappers_of_one_communicator_keep_their_reduces_apart():
    """Two tree reduces in flight, started through two Comms over the same communicator
    and waited in the other order, each sum their own buffers: the tags are counted on
    the communicator, not on each wrapper (a Comm re-wrapping a Comm shares them too)."""
    raw = WORLD.Dup()
    try:
        for second in (lambda a: Comm(raw), lambda a: Comm(a)):
            a = Comm(raw, reduce="tree")
            b = second(a)
            ya, yb = (np.empty(4), np.empty(4)) if a.rank == 0 else (None, None)
            ra = a.ireduce(np.full(4, 1.0), ya, 0)
            rb = b.ireduce(np.full(4, 100.0), yb, 0)
            rb.wait()
            ra.wait()
            ok = a.rank != 0 or (np.all(ya == P) and np.all(yb == 100.0 * P))
            parallel_assert(ok, f"A {ya}, B {yb}: expected {P} and {100 * P}")
    finally:
        raw.Free()
