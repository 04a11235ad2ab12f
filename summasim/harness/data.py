"""Rank-local inputs: any block of a global random matrix, without the matrix.

Entry ``(i, j)`` of the global ``R x C`` matrix of stream ``s`` is
``2 u - 1``, where ``u`` is draw number ``i * C + j`` of the PCG64 stream
``[seed, s]``. PCG64 draws one 64-bit word per double and can jump ahead in
O(log n) (``advance``), so a block is generated row segment by row segment,
skipping what lies between, and no rank ever generates or holds more than the
blocks it asks for. The values do not depend on the grid: the same global matrix
is seen by every decomposition, and a reference computed from panels matches the
distributed product exactly.

Values are drawn in float64 and rounded once to the block's dtype; the float64
reference is formed from the rounded values (``block.astype(float64)``).
"""

from __future__ import annotations

import numpy as np

# streams of the harness's operands
STREAM_A, STREAM_B, STREAM_RING = 0, 1, 100
#: A block whose rows are at most NARROW_ROWS times its width, or whose rows hold at most
#: NARROW_ITEMS draws in all, is drawn row-whole (CHUNK_ITEMS draws at a time) and cut.
NARROW_ROWS, NARROW_ITEMS, CHUNK_ITEMS = 8, 1 << 16, 1 << 20


def _generator(seed: int, stream: int, start: int):
    bitgen = np.random.PCG64([int(seed), int(stream)])
    if start:
        bitgen.advance(int(start))
    return bitgen, np.random.Generator(bitgen)


def uniform_segment(seed: int, stream: int, start: int, count: int,
                    dtype=np.float64, out=None) -> np.ndarray:
    """``count`` values in [-1, 1) from position ``start`` of stream ``stream``."""
    out = np.empty(count, dtype) if out is None else out
    _, gen = _generator(seed, stream, start)
    if out.dtype == np.float64:
        gen.random(out=out)
        out *= 2.0
        out -= 1.0
        return out
    tmp = gen.random(count)
    tmp *= 2.0
    tmp -= 1.0
    out[...] = tmp
    return out


def uniform_block(seed: int, stream: int, global_shape, rows: slice, cols: slice,
                  dtype=np.float64) -> np.ndarray:
    """Block ``M[rows, cols]`` of the global matrix ``M`` of stream ``stream``
    (C-contiguous, ``dtype``), generated alone."""
    R, C = (int(x) for x in global_shape)
    r0, r1, _ = rows.indices(R)
    c0, c1, _ = cols.indices(C)
    h, w = max(r1 - r0, 0), max(c1 - c0, 0)
    out = np.empty((h, w), dtype)
    if h == 0 or w == 0:
        return out
    if w == C:                                   # whole rows: one contiguous segment
        uniform_segment(seed, stream, r0 * C, h * w, dtype, out=out.reshape(-1))
        return out
    if C <= NARROW_ROWS * w or h * C <= NARROW_ITEMS:
        # narrow rows (a tall, skinny matrix): drawing them whole, CHUNK_ITEMS at a time,
        # beats a Python step per row; at most NARROW_ROWS times the block's draws
        step = max(1, CHUNK_ITEMS // C)
        for i in range(0, h, step):
            n = min(step, h - i)
            rows_ = uniform_segment(seed, stream, (r0 + i) * C, n * C).reshape(n, C)
            out[i:i + n] = rows_[:, c0:c1]
        return out
    bitgen, gen = _generator(seed, stream, r0 * C + c0)
    row = np.empty(w, np.float64)
    for i in range(h):
        gen.random(out=row)
        row *= 2.0
        row -= 1.0
        out[i] = row
        if i + 1 < h:
            bitgen.advance(C - w)                # skip to column c0 of the next row
    return out
