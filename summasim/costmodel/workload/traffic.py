"""Exact per-rank communication of each summasim algorithm, in closed form.

These functions say, without MPI, which trace events one rank records when it runs
an algorithm of :mod:`summasim.algorithms`. The MPI tests compare a rank's
:class:`~summasim.trace.Trace` with them, and the cost model prices them.

Conventions
-----------
An event is ``(op, group, group_size, root, nbytes)`` as in
:class:`summasim.trace.Event`: ``nbytes`` is the broadcast or reduce buffer on
every member, or the bytes this rank sends in a sendrecv; ``root`` is the root's
rank inside the group, -1 for sendrecv. Global shapes: ``A [m, k]``, ``B [k, n]``
for ``*_ab``; ``A [m, k]``, ``B [n, k]`` for ``*_abt``; ``A [k, m]``, ``B [k, n]``
for ``*_atb``. ``itemsize`` is bytes per item.

The deep products (``sd25_ab``, ``mm3d_*``) take any sizes on their square grid
(:func:`_deep_general`): sd25_ab's step l moves block l of k of the ``"2d"`` balanced
blocks; the cube layouts nest the balanced partition (row piece j of block ``M_i``),
each all-gather sends the rank's piece padded to the largest of its group (``ceil(|M_i|
/q)`` rows of ``A[M_i, K_k]`` for mm3d_ab's A), and the reduce-scatter's ring chunk t is
C's row piece t of ``M_i``. With sizes that divide, that is the table below.

The SUMMA family and Cannon (:data:`GENERAL_NAMES`) also take sizes that do not divide
and, but for Cannon, rectangular ``[pr, pc, d]`` grids (``pc=``): each block is the
rank's block of the balanced partition (the first ``size mod blocks`` blocks one
larger), and a SUMMA form steps over the pieces of its stepped dimension that lie in
one block of each of its two cuts (ab over k: A's columns in pc blocks, B's rows in pr;
abt over n: B's rows in pr, C's columns in pc; atb over m: A's columns in pc, C's rows
in pr), one broadcast (and for abt/atb one reduce) per piece on groups of more than
one rank; at most ``pr + pc - 1`` pieces. A dimension cut over the pc columns may
take a cut of its own (``cols={"k": offsets}``: a transformer's hidden size cut at its
heads, ``summasim.transformer.optimus.column_cut``). On a square grid with sizes that
divide, those are the q steps of the table below. Relaxed (``strict=False``, real sizes) on a
rectangular grid, every block is the plain quotient and the ``pr + pc - gcd(pr, pc)``
pieces of the even cuts are taken equal.

=================  =============================================================
algorithm          events on every rank of the ``[q, q, d]`` grid
=================  =============================================================
``summa_ab``       q bcasts on "row" of (m/q)(k/q) items (root l = 0..q-1) and
                   q bcasts on "col" of (k/q)(n/q) items
``summa_abt``      q bcasts on "col" of (n/q)(k/q) items, q reduces on "row" of
                   (m/q)(n/q) items (root l)
``summa_atb``      q bcasts on "row" of (k/q)(m/q) items, q reduces on "col" of
                   (m/q)(n/q) items
``summa25_ab``     q row bcasts of (m/(dq))(k/q), q col bcasts of (k/q)(n/q)
``summa25_abt``    q col bcasts of (n/q)(k/q), q row reduces of (m/(dq))(n/q)
``summa25_atb``    q row bcasts of (k/(dq))(m/q), q col reduces of (m/q)(n/q),
                   then a ring all-reduce over "depth" (d ranks, depth rank =
                   coordinate k) of (m/q)(n/q) items: 2(d-1) sendrecvs
``cannon_ab``      (d = 1; rank (i, j)) skew: 1 sendrecv on "row" of the
                   (m/q)(k/q) A block if i % q != 0, 1 sendrecv on "col" of the
                   (k/q)(n/q) B block if j % q != 0; then q-1 sendrecvs on "row"
                   of the A block and q-1 on "col" of the B block
``sd25_ab``        (rank (i, j, k) of [q, q, c]) 2 bcasts on "depth" from layer 0 of
                   the (m/q)(k/q) A and (k/q)(n/q) B blocks (if c > 1); for each
                   SUMMA step l of layer k (chunk k of range(q) in c near-equal
                   chunks) a bcast on "row" of (m/q)(k/q) and one on "col" of
                   (k/q)(n/q) (root l); then a ring all-reduce over "depth" of
                   (m/q)(n/q) items
``mm3d_ab``        (q x q x q cube, rank (i, j, k)) 1 allgather on "row" of
                   (m/q^2)(k/q) items, 1 on "col" of (k/q^2)(n/q), then a ring
                   reduce-scatter over "depth" of (m/q)(n/q) items: q-1 sendrecvs;
                   ``mm3d_abt`` and ``mm3d_atb`` the same (A's and B's pieces are
                   m k/q^3 and k n/q^3 items whatever the form)
``ring_allreduce`` N items over P ranks at group rank r: chunk c has
                   N//P + (1 if c < N%P else 0) items; reduce-scatter step
                   s = 0..P-2 sends chunk (r - s) mod P, allgather step
                   s = 0..P-2 sends chunk (r + 1 - s) mod P; all "sendrecv" on
                   the group; nothing when P == 1. ``ring_reduce_scatter`` and
                   ``ring_allgather`` are the two halves.
=================  =============================================================

Groups of one rank (q == 1) send nothing. Broadcast and reduce events are listed
step by step (bcast l, then reduce l); the implementation overlaps steps, so a
trace may record them in another order: compare with :func:`summarize_events`.

Public functions
----------------
``algorithm_events(name, m, k, n, q, d=1, itemsize=8, coords=None)``
    the list of :class:`EventSpec` of one rank.
``algorithm_traffic(name, m, k, n, q, d=1, itemsize=8, coords=None)``
    ``{(op, group): (count, nbytes)}``: number of events and their total bytes.
``algorithm_messages(...)``
    the same as a short list of :class:`MessageClass` (identical events grouped),
    computed without enumerating events (what the cost model prices).
``ring_allreduce_events(N, P, r, group="ring", itemsize=8)``,
``ring_reduce_scatter_events``, ``ring_allgather_events``
    the ring on its own (``algorithm_*("ring_allreduce", count=N, p=P, coords=r)``
    is the same).
``summarize_events(events)``
    the ``{(op, group): (count, nbytes)}`` of any events (e.g. a Trace's), to compare.
``algorithm_compute(name, m, k, n, q, d=1, itemsize=8, coords=None)``
    the local GEMMs ``[(m_, k_, n_, count)]`` and locally reduced bytes of one rank.

For ``summa25_atb`` the depth coordinate ``k`` (from ``coords = (i, j, k)``)
decides the ring chunks; for ``cannon_ab`` ``coords = (i, j)`` decides the skew.
``coords`` defaults to the origin.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, NamedTuple

from ...spec import ALGORITHM_KINDS, ANY_SIZE, PRODUCTS, partition

MATMUL_NAMES = PRODUCTS            # the algorithm table's products
RING_NAMES = ("ring_allreduce", "ring_reduce_scatter", "ring_allgather")
#: the 2.5D and 3D products of algorithms.deep (events of their own shape)
DEEP_NAMES = tuple(n for n, kind in ALGORITHM_KINDS.items() if kind in ("2.5d-deep", "3d"))
ALGORITHM_NAMES = MATMUL_NAMES + RING_NAMES


class EventSpec(NamedTuple):
    """One expected trace event (the fields of :class:`summasim.trace.Event` that a
    closed form can know)."""

    op: str
    group: str
    group_size: int
    root: int
    nbytes: int


class MessageClass(NamedTuple):
    """``count`` identical events."""

    op: str
    group: str
    group_size: int
    nbytes: int
    count: int


class Compute(NamedTuple):
    """Local work of one rank: GEMMs ``(m, k, n, count)`` and bytes added locally."""

    gemms: tuple
    reduce_bytes: int


# -- checks ---------------------------------------------------------------------
def _pos(name: str, value) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _div(fn: str, dim: str, size, by: int, what: str) -> int:
    size = _pos(f"{fn}: {dim}", size)
    if size % by:
        raise ValueError(f"{fn}: {dim}={size} is not divisible by {what}={by}")
    return size // by


def _real(fn: str, dim: str, size, by: int, what: str) -> float:
    if size is None or size <= 0:
        raise ValueError(f"{fn}: {dim} must be > 0, got {size!r}")
    return size / by


def _blocks(name, m, k, n, q, d, strict=True):
    """Per-rank block extents of the operands of ``name`` (raises on bad shapes).

    ``strict=False`` allows real-valued extents (scaling studies), no divisibility.
    """
    q, d = _pos("q", q), _pos("d", d)
    div = _div if strict else _real
    if name == "cannon_ab" and d != 1:
        raise ValueError(f"cannon_ab needs d == 1 (p = q*q), got d={d}")
    if name.startswith("mm3d"):   # (m/q^2, k/q, n/q); each piece is 1/p of its operand
        if d != q:
            raise ValueError(f"{name} needs a cube (d == q), got q={q}, d={d}")
        # the dimension cut into q^2 row pieces besides m: B's rows k (ab), B's rows n
        # (abt), A's and B's rows k (atb)
        div(name, *{"mm3d_ab": ("k", k), "mm3d_abt": ("n", n),
                    "mm3d_atb": ("k", k)}[name], q * q, "q*q")
        return (div(name, "m", m, q * q, "q*q"), div(name, "k", k, q, "q"),
                div(name, "n", n, q, "q"))
    rows, what = (d * q, "d*q") if name.startswith("summa25") else (q, "q")
    if name in ("summa_atb", "summa25_atb"):       # A [k, m] and B [k, n]: k is split in rows
        return (div(name, "k", k, rows, what), div(name, "m", m, q, "q"),
                div(name, "n", n, q, "q"))
    return (div(name, "m", m, rows, what), div(name, "k", k, q, "q"), div(name, "n", n, q, "q"))


def _coords(coords, n: int) -> tuple:
    if coords is None:
        return (0,) * n
    if isinstance(coords, int):
        coords = (coords,)
    coords = tuple(int(c) for c in coords)
    if len(coords) < n:
        coords = coords + (0,) * (n - len(coords))
    return coords


# -- ring ---------------------------------------------------------------------------
def _chunk(c: int, count: int, p: int) -> int:
    base, extra = divmod(count, p)
    return base + (1 if c < extra else 0)


def _ring_check(count, p, r, strict=True):
    if isinstance(count, bool) or count is None or count < 0 or (
            strict and int(count) != count):
        raise ValueError(f"ring: count N must be an integer >= 0, got {count!r}")
    p = _pos("ring: P", p)
    if not 0 <= int(r) < p:
        raise ValueError(f"ring: rank r={r} is outside 0..{p - 1}")
    return (int(count) if strict else count), p, int(r)


def ring_reduce_scatter_events(count: int, p: int, r: int, group: str = "ring",
                               itemsize: int = 8) -> list[EventSpec]:
    """Sendrecvs of the ring reduce-scatter at group rank ``r``: step s sends chunk
    (r - s) mod P (P-1 events; none when P == 1)."""
    count, p, r = _ring_check(count, p, r)
    return [EventSpec("sendrecv", group, p, -1, _chunk((r - s) % p, count, p) * itemsize)
            for s in range(p - 1)]


def ring_allgather_events(count: int, p: int, r: int, group: str = "ring",
                          itemsize: int = 8) -> list[EventSpec]:
    """Sendrecvs of the ring allgather at group rank ``r``: step s sends chunk
    (r + 1 - s) mod P (P-1 events; none when P == 1)."""
    count, p, r = _ring_check(count, p, r)
    return [EventSpec("sendrecv", group, p, -1, _chunk((r + 1 - s) % p, count, p) * itemsize)
            for s in range(p - 1)]


def ring_allreduce_events(count: int, p: int, r: int, group: str = "ring",
                          itemsize: int = 8) -> list[EventSpec]:
    """Reduce-scatter then allgather: 2(P-1) sendrecvs at group rank ``r``."""
    return (ring_reduce_scatter_events(count, p, r, group, itemsize)
            + ring_allgather_events(count, p, r, group, itemsize))


def _ring_half_messages(count, p, skip, group, itemsize) -> list[MessageClass]:
    """All chunks but ``skip`` are sent once: group them by size (O(1))."""
    if isinstance(count, float):  # real-valued (strict=False): equal chunks
        return [MessageClass("sendrecv", group, p, count / p * itemsize, p - 1)]
    base, extra = divmod(count, p)
    big = extra - (1 if skip < extra else 0)
    small = (p - 1) - big
    out = []
    if big:
        out.append(MessageClass("sendrecv", group, p, (base + 1) * itemsize, big))
    if small:
        out.append(MessageClass("sendrecv", group, p, base * itemsize, small))
    return out


def ring_working_set(count: int, p: int, itemsize: int, out_of_place: bool = True) -> int:
    """Bytes of data one rank of a ring all-reduce of ``count`` items over ``p`` ranks
    touches: its vector, a receive chunk and, out of place, the output its adds write
    (the memory floor's cache test, ``Machine.memory_floor``)."""
    return ((2 if out_of_place else 1) * count + -(-count // p)) * itemsize


def _ring_messages(kind, count, p, r, group, itemsize, strict=True) -> list[MessageClass]:
    count, p, r = _ring_check(count, p, r, strict)
    if not strict:
        count = float(count)
    if p == 1:
        return []
    out = []
    if kind in ("ring_allreduce", "ring_reduce_scatter"):
        # steps s = 0..P-2 send chunks (r - s): every chunk except (r + 1)
        out += _ring_half_messages(count, p, (r + 1) % p, group, itemsize)
    if kind in ("ring_allreduce", "ring_allgather"):
        # steps send chunks (r + 1 - s): every chunk except (r + 2)
        out += _ring_half_messages(count, p, (r + 2) % p, group, itemsize)
    return out


# -- matmul algorithms ----------------------------------------------------------------
def _matmul_plan(name, m, k, n, q, d, itemsize, coords, strict=True):
    """Block extents and the per-step ``[(op, group, nbytes)]`` of a matmul algorithm."""
    if name not in MATMUL_NAMES:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHM_NAMES)}")
    b0, b1, b2 = _blocks(name, m, k, n, q, d, strict)
    it = int(itemsize)
    if it < 1:
        raise ValueError(f"itemsize must be >= 1, got {itemsize}")
    if q == 1:
        plan = []
    elif name in DEEP_NAMES:                         # their own events (algorithm_events)
        plan = []
    elif name in ("summa_ab", "summa25_ab"):        # blocks: (m/q or m/dq, k/q, n/q)
        plan = [("bcast", "row", b0 * b1 * it), ("bcast", "col", b1 * b2 * it)]
    elif name in ("summa_abt", "summa25_abt"):      # B block (n/q, k/q), C (m/., n/q)
        plan = [("bcast", "col", b2 * b1 * it), ("reduce", "row", b0 * b2 * it)]
    elif name in ("summa_atb", "summa25_atb"):      # A block (k/., m/q), C (m/q, n/q)
        plan = [("bcast", "row", b0 * b1 * it), ("reduce", "col", b1 * b2 * it)]
    else:                                            # cannon_ab
        plan = []
    return (b0, b1, b2), plan


# -- any sizes, any [pr, pc, d] grid (the balanced partition) ------------------------
#: the products that take uneven blocks and, but for Cannon, rectangular grids
GENERAL_NAMES = ANY_SIZE
#: those of them with a relaxed (real-valued) form on a rectangular grid
RECT_NAMES = tuple(n for n in GENERAL_NAMES if n not in DEEP_NAMES)


def _cut(size: int, parts: int) -> list[int]:
    """Offsets of the balanced partition (:func:`summasim.spec.partition`)."""
    return partition(size, parts)


def _extent(size: int, parts: int, t: int) -> int:
    base, extra = divmod(size, parts)
    return base + (1 if t < extra else 0)


def _pieces(first: list[int], second: list[int]) -> list[tuple[int, int, int]]:
    """``[(width, block of first, block of second)]``: the pieces of [0, size) that lie
    inside one block of each cut, in order."""
    out = []
    x = y = 0
    lo = 0
    size = first[-1]
    while lo < size:
        while first[x + 1] <= lo:
            x += 1
        while second[y + 1] <= lo:
            y += 1
        hi = min(first[x + 1], second[y + 1])
        out.append((hi - lo, x, y))
        lo = hi
    return out


def is_general(name: str, m, k, n, q: int, d: int, pc=None, cols=None) -> bool:
    """Whether ``name`` on ``[q, pc, d]`` with these sizes takes the general form: a
    rectangular grid, a column cut of its own (``cols``), or sizes that do not divide
    it."""
    if name not in GENERAL_NAMES or m is None:
        return False
    if (pc is not None and int(pc) != int(q)) or cols:
        return True
    try:
        _blocks(name, m, k, n, q, d, True)
    except ValueError as e:
        return "divisible" in str(e)
    return False


def _general(name, m, k, n, pr, pc, d, it, coords, cols=None):
    """``(events, gemms, reduce_bytes)`` of one rank of a SUMMA-family product or
    Cannon on ``[pr, pc, d]`` with any sizes: the balanced blocks, and one step per
    piece of the stepped dimension's two cuts (see :mod:`summasim.algorithms.summa`).
    ``cols``: ``{dim: offsets}``, the cut over the pc columns of a dimension (``"m"``,
    ``"k"`` or ``"n"``) where it is not the balanced partition (a transformer's hidden
    size cut at its heads)."""
    m, k, n, pr, pc, d = (int(v) for v in (m, k, n, pr, pc, d))
    cols = dict(cols or ())

    def col_cut(dim, size):                       # a dimension's cut over the columns
        return list(cols[dim]) if dim in cols else _cut(size, pc)

    def col_extent(dim, size, t):
        cut = col_cut(dim, size)
        return cut[t + 1] - cut[t]

    for dim, v in (("m", m), ("k", k), ("n", n)):
        if v < 1:
            raise ValueError(f"{name}: {dim} must be a positive integer, got {v}")
    if name in DEEP_NAMES:
        if pr != pc:
            raise ValueError(f"{name} needs a square grid, got [{pr}, {pc}, {d}]")
        return _deep_general(name, m, k, n, pr, d, it, coords)
    i, j, kk = _coords(coords, 3)
    deep = name.startswith("summa25")
    rows = d * pr if deep else pr
    ri = kk * pr + i if deep else i              # the activation's row block
    events: list[EventSpec] = []
    gemms: list = []
    red = 0
    if name == "cannon_ab":
        if pr != pc or d != 1:
            raise ValueError(f"cannon_ab needs a q x q grid, got [{pr}, {pc}, {d}]")
        q = pr
        mi, nj = _extent(m, q, i), _extent(n, q, j)
        kw = lambda t: _extent(k, q, t % q)  # noqa: E731
        if q > 1:
            if i % q:
                events.append(EventSpec("sendrecv", "row", q, -1, mi * kw(j) * it))
            if j % q:
                events.append(EventSpec("sendrecv", "col", q, -1, kw(i) * nj * it))
            for s in range(q - 1):          # the block held at step s moves on
                events.append(EventSpec("sendrecv", "row", q, -1, mi * kw(i + j + s) * it))
                events.append(EventSpec("sendrecv", "col", q, -1, kw(i + j + s) * nj * it))
        gemms = [(mi, kw(i + j + s), nj, 1) for s in range(q)]
        return events, gemms, red
    # each form: the stepped dimension, its cut over the broadcast's group and over the
    # other op's, those two ops (op, group, size, items of a piece of width w), the GEMM
    form = name.split("_")[-1]
    if form == "ab":
        mi, nj = _extent(m, rows, ri), col_extent("n", n, j)
        size, cuts = k, (col_cut("k", k), _cut(k, pr))
        ops = (("bcast", "row", pc, lambda w: mi * w), ("bcast", "col", pr, lambda w: w * nj))
        gemm = lambda w: (mi, w, nj, 1)  # noqa: E731
    elif form == "abt":
        mi, kj = _extent(m, rows, ri), col_extent("k", k, j)
        size, cuts = n, (_cut(n, pr), col_cut("n", n))
        ops = (("bcast", "col", pr, lambda w: w * kj), ("reduce", "row", pc, lambda w: mi * w))
        gemm = lambda w: (mi, kj, w, 1)  # noqa: E731
    else:                                           # atb: A [k, m], B [k, n]
        ki, nj = _extent(k, rows, ri), col_extent("n", n, j)
        size, cuts = m, (col_cut("m", m), _cut(m, pr))
        ops = (("bcast", "row", pc, lambda w: ki * w), ("reduce", "col", pr, lambda w: w * nj))
        gemm = lambda w: (w, ki, nj, 1)  # noqa: E731
    for w, x, y in _pieces(*cuts):
        for (op, group, g, items), root in zip(ops, (x, y)):
            if g > 1:                               # groups of one rank send nothing
                events.append(EventSpec(op, group, g, root, items(w) * it))
        gemms.append(gemm(w))
    if pr == 1 and pc == 1:                         # one GEMM, no steps
        gemms = [gemm(size)]
    if name == "summa25_atb" and d > 1:
        items = _extent(m, pr, i) * col_extent("n", n, j)
        events += ring_allreduce_events(items, d, kk, "depth", it)
        red = algorithm_compute("ring_reduce_scatter", count=items, p=d, coords=kk,
                                itemsize=it).reduce_bytes
    return events, gemms, red


def _deep_general(name, m, k, n, q, d, it, coords):
    """``(events, gemms, reduce_bytes)`` of one rank of ``sd25_ab`` or an ``mm3d_*``
    product with any sizes (:mod:`summasim.algorithms.deep`). sd25_ab: the ``"2d"``
    balanced blocks, step l moving block l of k. mm3d: the cube layouts' nested
    partition; each all-gather sends the rank's piece padded to its group's largest,
    ``ceil(rows/q)`` rows of the block the group gathers, and the reduce-scatter's ring
    chunk t is C's row piece t of ``M_i`` (``|M_i|`` cut over q, times ``|N_j|``)."""
    i, j, kk = _coords(coords, 3)
    mi, nj = _extent(m, q, i), _extent(n, q, j)
    events: list[EventSpec] = []
    if name == "sd25_ab":
        kw = lambda t: _extent(k, q, t)  # noqa: E731
        if d > 1:                                   # layer 0's blocks to the layers
            events += [EventSpec("bcast", "depth", d, 0, mi * kw(j) * it),
                       EventSpec("bcast", "depth", d, 0, kw(i) * nj * it)]
        first = sum(layer_steps(q, d, x) for x in range(kk))
        steps = range(first, first + layer_steps(q, d, kk))
        if q > 1:
            for l in steps:
                events += [EventSpec("bcast", "row", q, l, mi * kw(l) * it),
                           EventSpec("bcast", "col", q, l, kw(l) * nj * it)]
        gemms = [(mi, kw(l), nj, 1) for l in steps] if q > 1 else (
            [(mi, k, nj, 1)] if len(steps) else [])
        red = 0
        if d > 1:
            events += ring_allreduce_events(mi * nj, d, kk, "depth", it)
            red = algorithm_compute("ring_reduce_scatter", count=mi * nj, p=d, coords=kk,
                                    itemsize=it).reduce_bytes
        return events, gemms, red
    if d != q:
        raise ValueError(f"{name} needs a cube (d == q), got q={q}, d={d}")
    kd = _extent(k, q, kk)
    # (rows of the gathered block, its columns) for A along the row and B down the column
    a_rows, a_cols = (kd, mi) if name == "mm3d_atb" else (mi, kd)
    b_rows, b_cols = (nj, kd) if name == "mm3d_abt" else (kd, nj)
    gemms = [(mi, kd, nj, 1)]
    if q == 1:
        return events, gemms, 0
    events += [EventSpec("allgather", "row", q, -1, -(-a_rows // q) * a_cols * it),
               EventSpec("allgather", "col", q, -1, -(-b_rows // q) * b_cols * it)]
    chunk = [_extent(mi, q, t) * nj for t in range(q)]
    # step s sends chunk (k - s) mod q and adds the received (k - s - 1) mod q
    events += [EventSpec("sendrecv", "depth", q, -1, chunk[(kk - s) % q] * it)
               for s in range(q - 1)]
    red = sum(chunk[(kk - s - 1) % q] for s in range(q - 1)) * it
    return events, gemms, red


def _relaxed_rect(name, m, k, n, pr, pc, d, it):
    """``(messages, gemms, reduce_bytes)`` of a SUMMA-family product on ``[pr, pc, d]``
    with real-valued blocks (``strict=False``: scaling studies): every block the plain
    quotient, and the stepped dimension cut into ``pr + pc - gcd(pr, pc)`` equal pieces
    (as many as the even cuts over pc and over pr make together; q on a square grid)."""
    if name == "cannon_ab":
        raise ValueError(f"cannon_ab needs a q x q grid, got [{pr}, {pc}, {d}]")
    for dim, v in (("m", m), ("k", k), ("n", n)):
        _real(name, dim, v, 1, "1")
    rows = d * pr if name.startswith("summa25") else pr
    steps = pr + pc - math.gcd(pr, pc)
    form = name.split("_")[-1]
    if form == "ab":                       # k stepped; A [m/rows, k/pc], B [k/pr, n/pc]
        mi, nj, w = m / rows, n / pc, k / steps
        ops = (("bcast", "row", pc, mi * w), ("bcast", "col", pr, w * nj))
        gemm = (mi, w, nj, steps)
    elif form == "abt":                    # n stepped; B [n/pr, k/pc], C [m/rows, n/pc]
        mi, kj, w = m / rows, k / pc, n / steps
        ops = (("bcast", "col", pr, w * kj), ("reduce", "row", pc, mi * w))
        gemm = (mi, kj, w, steps)
    else:                                  # atb, m stepped; A [k/rows, m/pc], C [m/pr, n/pc]
        ki, nj, w = k / rows, n / pc, m / steps
        ops = (("bcast", "row", pc, ki * w), ("reduce", "col", pr, w * nj))
        gemm = (w, ki, nj, steps)
    msgs = [MessageClass(op, group, g, items * it, steps) for op, group, g, items in ops
            if g > 1]                      # groups of one rank send nothing
    red = 0
    if name == "summa25_atb" and d > 1:
        items = m / pr * (n / pc)
        msgs += _ring_messages("ring_allreduce", items, d, 0, "depth", it, False)
        red = algorithm_compute("ring_reduce_scatter", count=items, p=d, itemsize=it,
                                strict=False).reduce_bytes
    return msgs, [gemm], red


def _rectangular(q, pc) -> bool:
    """Whether ``pc`` makes the grid rectangular (given and not q)."""
    return pc is not None and int(pc) != int(q)


def algorithm_events(name: str, m: int | None = None, k: int | None = None,
                     n: int | None = None, q: int = 1, d: int = 1, itemsize: int = 8,
                     coords=None, *, count: int | None = None, p: int | None = None,
                     group: str | None = None, pc: int | None = None,
                     cols=None) -> list[EventSpec]:
    """The events one rank records when it runs algorithm ``name``.

    Parameters
    ----------
    name : str
        One of :data:`ALGORITHM_NAMES`.
    m, k, n : int
        Global dimensions (see the module docstring for each algorithm's shapes).
    q, d : int
        Grid ``[q, q, d]`` (``q`` rows when ``pc`` is given).
    itemsize : int
        Bytes per item.
    pc : int, keyword-only, optional
        Columns of a rectangular ``[q, pc, d]`` grid (SUMMA and SUMMA2.5). A rectangular
        grid, or sizes that do not divide, give the events of the balanced blocks
        (:data:`GENERAL_NAMES`).
    cols : mapping, keyword-only, optional
        ``{"m" | "k" | "n": offsets}``: the cut over the pc columns of a dimension that is
        not the balanced partition (``pc + 1`` offsets; a transformer's hidden size cut
        at its heads); the general form.
    coords : tuple or int, optional
        ``(i, j, k)`` grid coordinates (Cannon: ``(i, j)``; rings: the group rank r).
    count, p, group : optional
        For the ring algorithms: N items, P ranks and the group name ("ring").

    Returns
    -------
    list of EventSpec
        In the algorithm's logical order.
    """
    if name in RING_NAMES:
        n_items, size, r = _ring_args(name, count, p, coords, m)
        grp = group or "ring"
        if name == "ring_reduce_scatter":
            return ring_reduce_scatter_events(n_items, size, r, grp, itemsize)
        if name == "ring_allgather":
            return ring_allgather_events(n_items, size, r, grp, itemsize)
        return ring_allreduce_events(n_items, size, r, grp, itemsize)
    if is_general(name, m, k, n, q, d, pc, cols):
        return _general(name, m, k, n, q, q if pc is None else pc, d, int(itemsize),
                        coords, cols)[0]
    (b0, b1, b2), plan = _matmul_plan(name, m, k, n, q, d, itemsize, coords)
    q = int(q)
    events: list[EventSpec] = []
    if name == "cannon_ab":
        if q == 1:
            return events
        i, j = _coords(coords, 2)[:2]
        a_bytes, b_bytes = b0 * b1 * itemsize, b1 * b2 * itemsize
        # skew: row i rotates A left by i, column j rotates B up by j
        if i % q:
            events.append(EventSpec("sendrecv", "row", q, -1, a_bytes))
        if j % q:
            events.append(EventSpec("sendrecv", "col", q, -1, b_bytes))
        # q-1 single-step shifts of both blocks
        for _ in range(q - 1):
            events.append(EventSpec("sendrecv", "row", q, -1, a_bytes))
            events.append(EventSpec("sendrecv", "col", q, -1, b_bytes))
        return events
    if name in DEEP_NAMES:
        return _deep_events(name, b0, b1, b2, q, int(d), int(itemsize), coords)
    for l in range(q if plan else 0):
        for op, grp, nbytes in plan:
            events.append(EventSpec(op, grp, q, l, nbytes))
    if name == "summa25_atb" and int(d) > 1:
        depth_rank = _coords(coords, 3)[2]
        events += ring_allreduce_events(b1 * b2, int(d), depth_rank, "depth", itemsize)
    return events


def layer_steps(q: int, c: int, k: int) -> int:
    """How many SUMMA steps layer ``k`` of ``c`` runs in ``sd25_ab`` (chunk k of
    range(q) in c near-equal chunks)."""
    return _chunk(k, q, c)


def _deep_events(name, b0, b1, b2, q, d, it, coords) -> list[EventSpec]:
    """The events of ``sd25_ab`` and ``mm3d_ab`` (see the module docstring)."""
    kk = _coords(coords, 3)[2]
    events: list[EventSpec] = []
    if name.startswith("mm3d"):       # pieces of A and B: 1/p of each, whatever the form
        if q > 1:
            events += [EventSpec("allgather", "row", q, -1, b0 * b1 * it),
                       EventSpec("allgather", "col", q, -1, (b1 * b2 // q) * it)]
            events += ring_reduce_scatter_events(q * b0 * b2, q, kk, "depth", it)
        return events
    if d > 1:
        events += [EventSpec("bcast", "depth", d, 0, b0 * b1 * it),
                   EventSpec("bcast", "depth", d, 0, b1 * b2 * it)]
    if q > 1:
        first = sum(layer_steps(q, d, x) for x in range(kk))
        for l in range(first, first + layer_steps(q, d, kk)):
            events += [EventSpec("bcast", "row", q, l, b0 * b1 * it),
                       EventSpec("bcast", "col", q, l, b1 * b2 * it)]
    if d > 1:
        events += ring_allreduce_events(b0 * b2, d, kk, "depth", it)
    return events


def _deep_messages(name, b0, b1, b2, q, d, it, coords, strict) -> list[MessageClass]:
    """:func:`_deep_events` grouped, without enumerating the steps."""
    kk = _coords(coords, 3)[2]
    if name.startswith("mm3d"):
        if q == 1:
            return []
        return ([MessageClass("allgather", "row", q, b0 * b1 * it, 1),
                 MessageClass("allgather", "col", q, (b1 * b2 / q if not strict
                                                      else b1 * b2 // q) * it, 1)]
                + _ring_messages("ring_reduce_scatter", q * b0 * b2, q, kk, "depth", it, strict))
    out: list[MessageClass] = []
    if d > 1:
        out += [MessageClass("bcast", "depth", d, b0 * b1 * it, 1),
                MessageClass("bcast", "depth", d, b1 * b2 * it, 1)]
    steps = layer_steps(q, d, kk) if strict else q / d
    if q > 1 and steps:
        out += [MessageClass("bcast", "row", q, b0 * b1 * it, steps),
                MessageClass("bcast", "col", q, b1 * b2 * it, steps)]
    if d > 1:
        out += _ring_messages("ring_allreduce", b0 * b2, d, kk, "depth", it, strict)
    return out


def _ring_args(name, count, p, coords, m):
    if count is None:
        count = m
    if count is None or p is None:
        raise ValueError(f"{name}: give count=N (items) and p=P (ranks)")
    return count, p, _coords(coords, 1)[0]


def algorithm_messages(name: str, m: int | None = None, k: int | None = None,
                       n: int | None = None, q: int = 1, d: int = 1, itemsize: int = 8,
                       coords=None, *, count: int | None = None, p: int | None = None,
                       group: str | None = None, strict: bool = True,
                       pc: int | None = None, cols=None) -> list[MessageClass]:
    """The events of :func:`algorithm_events` grouped into :class:`MessageClass`
    entries, computed in O(1) per class (no enumeration; fast for q, P ~ 10^5).

    ``strict=False`` accepts dimensions that do not divide (real-valued block
    sizes and equal ring chunks): the continuous relaxation used in scaling studies;
    on a rectangular grid (``pc``) its ``pr + pc - gcd(pr, pc)`` steps move equal pieces
    (:func:`_relaxed_rect`; ``cols`` is then left out).
    """
    if name in RING_NAMES:
        n_items, size, r = _ring_args(name, count, p, coords, m)
        return _ring_messages(name, n_items, size, r, group or "ring", itemsize, strict)
    if strict and is_general(name, m, k, n, q, d, pc, cols):
        return _grouped(_general(name, m, k, n, q, q if pc is None else pc, d, int(itemsize),
                                 coords, cols)[0])
    if not strict and name in RECT_NAMES and _rectangular(q, pc):
        return _relaxed_rect(name, m, k, n, int(q), int(pc), int(d), int(itemsize))[0]
    (b0, b1, b2), plan = _matmul_plan(name, m, k, n, q, d, itemsize, coords, strict)
    q = int(q)
    out: list[MessageClass] = []
    if name == "cannon_ab":
        if q == 1:
            return out
        i, j = _coords(coords, 2)[:2]
        rows = (q - 1) + (1 if i % q else 0)
        cols = (q - 1) + (1 if j % q else 0)
        return [MessageClass("sendrecv", "row", q, b0 * b1 * itemsize, rows),
                MessageClass("sendrecv", "col", q, b1 * b2 * itemsize, cols)]
    if name in DEEP_NAMES:
        return _deep_messages(name, b0, b1, b2, q, int(d), int(itemsize), coords, strict)
    out = [MessageClass(op, grp, q, nbytes, q) for op, grp, nbytes in plan]
    if name == "summa25_atb" and int(d) > 1:
        depth_rank = _coords(coords, 3)[2]
        out += _ring_messages("ring_allreduce", b1 * b2, int(d), depth_rank, "depth", itemsize,
                              strict)
    return out


def _grouped(events) -> list[MessageClass]:
    """Identical events as :class:`MessageClass` entries, in first-seen order."""
    acc: dict = {}
    for e in events:
        key = (e.op, e.group, e.group_size, e.nbytes)
        acc[key] = acc.get(key, 0) + 1
    return [MessageClass(*key, c) for key, c in acc.items()]


def moved_bytes(messages) -> float:
    """Bytes a rank moves (sends or receives) in ``messages``: the ledger's ``nbytes``,
    except that an all-gather, whose event holds the rank's own contribution, moves the
    other ``group_size - 1`` contributions (what the lower bounds count)."""
    return sum(mc.count * mc.nbytes * (mc.group_size - 1 if mc.op == "allgather" else 1)
               for mc in messages)


def summarize_events(events: Iterable) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(op, group): (count, total nbytes)}`` of any events with ``op``, ``group``
    and ``nbytes`` attributes (EventSpec, summasim.trace.Event, MessageClass)."""
    acc: dict = defaultdict(lambda: [0, 0])
    for e in getattr(events, "events", events):
        c = getattr(e, "count", 1) if isinstance(e, MessageClass) else 1
        a = acc[(e.op, e.group)]
        a[0] += c
        a[1] += c * e.nbytes
    return {key: (v[0], v[1]) for key, v in acc.items()}


def algorithm_traffic(name: str, m: int | None = None, k: int | None = None,
                      n: int | None = None, q: int = 1, d: int = 1, itemsize: int = 8,
                      coords=None, *, count: int | None = None, p: int | None = None,
                      group: str | None = None, pc: int | None = None,
                      cols=None) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(op, group): (number of events, total nbytes)}`` of one rank running ``name``.

    Same arguments as :func:`algorithm_events`. Example: ``summa_ab`` with
    m = k = n = 8, q = 2, float64 gives ``{("bcast", "row"): (2, 256),
    ("bcast", "col"): (2, 256)}``.
    """
    return summarize_events(algorithm_messages(name, m, k, n, q, d, itemsize, coords,
                                               count=count, p=p, group=group, pc=pc,
                                               cols=cols))


def algorithm_compute(name: str, m: int | None = None, k: int | None = None,
                      n: int | None = None, q: int = 1, d: int = 1, itemsize: int = 8,
                      coords=None, *, count: int | None = None, p: int | None = None,
                      group: str | None = None, strict: bool = True,
                      pc: int | None = None, cols=None) -> Compute:
    """Local work of one rank: GEMM shapes ``(m_, k_, n_, count)`` (flops = 2 m_ k_ n_
    each) and bytes added locally (the ring reduce-scatter's ``+=``; SUMMA's reduce
    sums happen inside MPI and are priced with the reduce)."""
    if name in RING_NAMES:
        n_items, size, r = _ring_args(name, count, p, coords, m)
        if name == "ring_allgather":
            return Compute((), 0)
        # step s adds the received chunk (r - s - 1) mod P: every chunk except r
        rs = _ring_messages("ring_reduce_scatter", n_items, size, (r - 1) % size, "ring",
                            itemsize, strict)
        return Compute((), sum(mc.nbytes * mc.count for mc in rs))
    if strict and is_general(name, m, k, n, q, d, pc, cols):
        _, gemms, red = _general(name, m, k, n, q, q if pc is None else pc, d, int(itemsize),
                                 coords, cols)
        return Compute(tuple(gemms), red)
    if not strict and name in RECT_NAMES and _rectangular(q, pc):
        _, gemms, red = _relaxed_rect(name, m, k, n, int(q), int(pc), int(d), int(itemsize))
        return Compute(tuple(gemms), red)
    (b0, b1, b2), _ = _matmul_plan(name, m, k, n, q, d, itemsize, coords, strict)
    q = int(q)
    if name == "summa25_atb":                        # A block (k/(dq), m/q): C += A^T B
        gemm = (b1, b0, b2, q)
        red = 0
        if int(d) > 1:
            red = algorithm_compute("ring_reduce_scatter", count=b1 * b2, p=int(d),
                                    coords=_coords(coords, 3)[2], itemsize=itemsize,
                                    strict=strict).reduce_bytes
        return Compute((gemm,), red)
    if name == "summa_atb":
        return Compute(((b1, b0, b2, q),), 0)
    if name in DEEP_NAMES:
        kk, d, cube = _coords(coords, 3)[2], int(d), name.startswith("mm3d")
        group = q if cube else d
        gemm = ((q * b0, b1, b2, 1) if cube else
                (b0, b1, b2, layer_steps(q, d, kk) if strict else q / d))
        red = 0
        if group > 1:
            count = (q * b0 if cube else b0) * b2
            red = algorithm_compute("ring_reduce_scatter", count=count, p=group, coords=kk,
                                    itemsize=itemsize, strict=strict).reduce_bytes
        return Compute(tuple(g for g in (gemm,) if g[3]), red)
    return Compute(((b0, b1, b2, q),), 0)


def algorithm_flops(name: str, m: int, k: int, n: int, q: int = 1, d: int = 1,
                    coords=None, *, pc: int | None = None) -> int:
    """Flops of one rank's GEMMs (2 per multiply-add): ``2 m k n / (d q^2)`` for the
    2.5D and 3D forms (sd25_ab: its layer's share of the q steps), ``2 m k n / q^2``
    otherwise."""
    return sum(2 * a * b * c * cnt for a, b, c, cnt in
               algorithm_compute(name, m, k, n, q, d, coords=coords, pc=pc).gemms)
