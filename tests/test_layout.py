"""Pure block math of summasim.layout: no MPI."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from summasim import layout
from summasim.layout import GridNumbers


def all_ranks(name, q, d, p):
    if name in ("row", "col"):
        return [GridNumbers(q=q, d=d, p=p, r=r) for r in range(p)]
    return [GridNumbers(q=q, d=d, p=p, i=i, j=j, k=k)
            for k in range(d) for i in range(q) for j in range(q)]


@settings(max_examples=60, deadline=None)
@given(q=st.integers(1, 4), d=st.integers(1, 3), mult=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       name=st.sampled_from(["2d", "2.5d", "row", "col"]))
def test_blocks_tile_the_array(q, d, mult, name):
    """Each entry is covered by the expected number of ranks: once per layer for
    "2d" (replicated over depth), exactly once for the others."""
    p = d * q * q
    nr, nc = layout.block_counts(name, q, d, p)
    shape = (nr * mult[0], nc * mult[1])
    cover = np.zeros(shape, dtype=int)
    for g in all_ranks(name, q, d, p):
        sl = layout.block_slices(shape, name, g)
        assert cover[sl].shape == layout.local_shape(shape, name, q, d, p)
        cover[sl] += 1
    assert np.all(cover == (d if name == "2d" else 1))


def test_block_index_conventions():
    g = GridNumbers(q=3, d=2, p=18, i=2, j=1, k=1, r=5)
    assert layout.block_index("2d", g) == (2, 1)
    assert layout.block_index("2.5d", g) == (1 * 3 + 2, 1)
    assert layout.block_index("row", g) == (5, 0)
    assert layout.block_index("col", g) == (0, 5)
    assert layout.block_counts("2.5d", 3, 2) == (6, 3)
    assert layout.block_slices((12, 9), "2.5d", g) == (slice(10, 12), slice(3, 6))


def test_vectors_and_higher_rank():
    assert layout.local_shape((12,), "col", p=4) == (3,)
    assert layout.local_shape((8, 5, 6), "row", p=4) == (2, 5, 6)
    assert layout.local_shape((8, 5, 6), "col", p=3) == (8, 5, 2)
    assert layout.local_shape((7, 5), "replicated", q=3) == (7, 5)
    g = GridNumbers(p=4, r=2)
    assert layout.block_slices((12,), "col", g) == (slice(6, 9),)


@pytest.mark.parametrize("shape,name,q,d,p,needle", [
    ((10, 8), "2d", 4, 1, 16, "rows = 10 is not divisible by 4"),
    ((8, 6), "2d", 4, 1, 16, "columns = 6 is not divisible by 4"),
    ((12, 8), "2.5d", 2, 4, 16, "rows = 12 is not divisible by 8"),
    ((9, 4), "row", 1, 1, 4, "rows = 9 is not divisible by 4"),
    ((4, 9), "col", 1, 1, 4, "columns = 9 is not divisible by 4"),
])
def test_non_dividing_dimension_is_named(shape, name, q, d, p, needle):
    with pytest.raises(ValueError, match=needle):
        layout.local_shape(shape, name, q, d, p)


def test_bad_layout_names_and_ranks():
    with pytest.raises(ValueError, match="unknown layout"):
        layout.local_shape((4, 4), "3d", 2)
    with pytest.raises(ValueError, match="needs a 2-D array"):
        layout.local_shape((4, 4, 4), "2d", 2)


@pytest.mark.parametrize("name", ["3d-a", "3d-b", "3d-c", "3d-bt", "3d-at"])
@pytest.mark.parametrize("q", [1, 2, 3])
def test_3d_layouts_hold_every_block_once_on_the_cube(name, q):
    """On a q x q x q cube each of the q^2 x q blocks sits on exactly one rank."""
    from summasim.layout import GridNumbers, block_counts, block_index

    held = [block_index(name, GridNumbers(q=q, d=q, p=q ** 3, i=i, j=j, k=k))
            for i in range(q) for j in range(q) for k in range(q)]
    nr, nc = block_counts(name, q, q)
    assert (nr, nc) == (q * q, q)
    assert sorted(held) == [(r, c) for r in range(nr) for c in range(nc)]


# -- any sizes, any [pr, pc, d] grid: the balanced partition ---------------------------------
@settings(max_examples=80, deadline=None)
@given(size=st.integers(0, 60), parts=st.integers(1, 9))
def test_partition_is_balanced(size, parts):
    """The first size mod parts blocks hold one item more; the blocks tile [0, size)."""
    cut = layout.partition(size, parts)
    lengths = [b - a for a, b in zip(cut, cut[1:])]
    assert cut[0] == 0 and cut[-1] == size and len(lengths) == parts
    assert lengths == sorted(lengths, reverse=True) and max(lengths) - min(lengths) <= 1
    assert sum(1 for n in lengths if n > size // parts) == size % parts
    assert all(layout.block_range(size, parts, t) == (cut[t], cut[t + 1]) for t in range(parts))


@settings(max_examples=80, deadline=None)
@given(pr=st.integers(1, 4), pc=st.integers(1, 4), d=st.integers(1, 3),
       shape=st.tuples(st.integers(1, 23), st.integers(1, 23)),
       name=st.sampled_from(["2d", "2.5d"]))
def test_uneven_blocks_on_rectangular_grids_tile_the_array(pr, pc, d, shape, name):
    """Any sizes on any [pr, pc, d] grid: every entry is held once per layer ("2d") or
    once ("2.5d"), each block has block_shape's shape, none exceeds max_block_shape."""
    p = d * pr * pc
    cover = np.zeros(shape, dtype=int)
    big = layout.max_block_shape(shape, name, pr, d, p, pc)
    for k in range(d):
        for i in range(pr):
            for j in range(pc):
                g = GridNumbers(q=pr, d=d, p=p, i=i, j=j, k=k, pc=pc)
                sl = layout.block_slices(shape, name, g)
                assert cover[sl].shape == layout.block_shape(shape, name, g)
                assert all(a <= b for a, b in zip(cover[sl].shape, big))
                cover[sl] += 1
    assert np.all(cover == (d if name == "2d" else 1))


def test_rectangular_block_counts_and_the_cube_layouts_need_a_square_grid():
    assert layout.block_counts("2d", 2, 1, 6, pc=3) == (2, 3)
    assert layout.block_counts("2.5d", 2, 2, 12, pc=3) == (4, 3)
    g = GridNumbers(q=2, d=1, p=6, i=1, j=2, pc=3)
    assert layout.block_slices((5, 7), "2d", g) == (slice(3, 5), slice(5, 7))
    with pytest.raises(ValueError, match="square grid"):
        layout.block_slices((8, 8), "3d-a", g)
    # local_shape is the even question: it still names what does not divide
    with pytest.raises(ValueError, match="columns = 7 is not divisible by 3"):
        layout.local_shape((4, 7), "2d", 2, pc=3)
