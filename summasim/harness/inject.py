"""Fault injection: corrupt one output on one rank after it is computed, to show that
the validator fails when it must (``summasim.run --inject KIND@RANK``, ``--self-test``).

=========  ====================================================================
kind       what happens on the chosen rank
=========  ====================================================================
nan        one entry of the output becomes NaN
inf        one entry becomes +Inf
perturb    one entry is multiplied by (1 + 1e-6) in double precision, (1 + 1e-2)
           in single: a relative error far above the dtype's round-off (1e-6 would
           be below float32's bounds) and far below anything a norm-wise check sees
           (a float32 ``freivalds`` row check, about n times looser than the
           per-entry one, can miss it at large n; the self-test checks exactly). In
           a product's block the entry C_ij moves by that fraction of its scale
           (|A||B|)_ij, the unit of the check's bound 8 sqrt(k) (u + u_64)
           (:func:`perturb_product`): a fraction of |C_ij| itself, which is about
           sqrt(k) times smaller on mean-zero inputs (and can be near 0), would
           fall under the float32 bound from k of a few thousand
drop       one block is left unreduced: a product's block misses the summand of
           one k-panel; the all-reduce result misses another rank's input; in a
           training step, the first sum all-reduce on that rank returns the rank's
           own contribution instead of the sum
drift      one entry of a replicated tensor moves by one unit in the last place
           on that rank only, so its replicas differ by one bit: in a sharded
           training step, the first replicated parameter the rank holds after the
           step (over dp under ZeRO 0-2, else over the tensor group or the tied
           embedding's pair), or, under ZeRO-3 with dp > 1 or with nothing else
           replicated, the first unit it all-gathers in the step (a receive gone
           wrong). Far below every value check's bound: only the replica audit
           sees it. A run with no replica audit (a product, a ring, a pure
           tensor-parallel step) has no replica to drift: there it changes its
           entry as ``perturb`` does, so it still fails the row and never passes
           unseen
=========  ====================================================================

Which checks can catch which fault: :func:`uncatchable` says why a product check
method cannot promise to catch a fault (``perturb`` in single precision under
``freivalds``, whose row threshold is about n times the per-entry bound), and
:func:`check_method` picks the method a product run uses under a fault (``auto``
checks exactly then). ``summasim.run`` refuses the first up front and reports any
fault that was applied but not caught as a failure.

The entry is the one of largest magnitude in the rank's output (for a training
step: in the rank's local gradient of the first weight), so ``perturb`` is not lost
next to a larger entry.

Where each is applied: ``nan``, ``inf`` and ``perturb`` by :func:`corrupt_entry`, after
the run computes, on every path; ``drift`` by :func:`drift_entry` in the mesh executor
(:func:`drift_at_gathers` inside a ZeRO-3 step). ``drop`` in a training step (the tensor
schemes, the composed meshes) by the one hook at the reduction, :class:`summasim.comm.DropFault`,
armed with :meth:`Comm.drop_next_sum <summasim.comm.Comm.drop_next_sum>`:
:meth:`Comm.allreduce <summasim.comm.Comm.allreduce>` takes it, and so do the
trainer's ring reductions, through :func:`drop_at_rings`. The product and ring runs
keep their ``drop`` written on the result, :func:`drop_panel` and :func:`drop_summand`:
a SUMMA AB or Cannon block sums its k-panels locally, with no reduction to hook, and
a ring run at p = 1 has no sum to drop, where this form still corrupts it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..algorithms.allreduce import chunk_bounds
from .check import op_panels, product_block_slices, ring_input

KINDS = ("nan", "inf", "perturb", "drop", "drift")
PERTURB = 1e-6               # double precision (float64, complex128)
PERTURB_SINGLE = 1e-2        # anything coarser (float32, complex64)
#: a mixed-precision step, held to the 16-bit bound (``validate.mixed_tolerance``: about
#: 0.04 in float16, 0.3-0.4 in bfloat16): the entry doubles
PERTURB_HALF = 1.0


def perturbation(dtype) -> float:
    """The relative change ``perturb`` makes to one entry of an array of ``dtype``."""
    return PERTURB if np.finfo(dtype).eps < 1e-10 else PERTURB_SINGLE


@dataclass(frozen=True)
class Fault:
    """Corrupt the output of a run on world rank ``rank``."""

    kind: str
    rank: int

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """``KIND@RANK`` (e.g. ``nan@2``); ``ValueError`` with the accepted forms."""
        kind, sep, rank = str(text).partition("@")
        if not sep or kind not in KINDS or not rank.isdigit():
            raise ValueError(f"--inject takes KIND@RANK with KIND one of {', '.join(KINDS)} "
                             f"and RANK a rank number, e.g. nan@2; got {text!r}")
        return cls(kind, int(rank))

    def __str__(self):
        return f"{self.kind}@{self.rank}"


def _single(dtype) -> bool:
    return np.finfo(np.dtype(dtype)).eps > 1e-10


def uncatchable(fault: Fault | None, method: str, dtypes) -> str:
    """Why the product check ``method`` ("auto", "exact", "freivalds") cannot promise
    to catch ``fault`` in some dtype of ``dtypes``, or "" (it can, or no fault).

    ``perturb`` in single precision changes one entry by 1e-2 of its value; a
    ``freivalds`` check compares whole rows against a threshold about n_J times the
    per-entry bound, which in float32 reaches that size from n_J of a few hundred, so
    the fault can pass unseen. In double precision (1e-6 against a bound near 1e-13 per
    entry) and under ``exact`` it is caught; ``auto`` checks exactly under this fault
    (:func:`check_method`). ``nan``, ``inf`` and ``drop`` are caught by every method.
    """
    if fault is None or fault.kind != "perturb" or method != "freivalds":
        return ""
    single = [str(np.dtype(d)) for d in dtypes if _single(d)]
    if not single:
        return ""
    return (f"--inject {fault} with --check freivalds in {', '.join(single)}: the fault "
            f"changes one entry by {PERTURB_SINGLE:g} of its value, below the Freivalds "
            f"row threshold (about n times the per-entry bound), so it could pass unseen; "
            f"use --check exact or auto (which checks exactly under this fault)")


def check_method(fault: Fault | None, method: str, dtype) -> str:
    """The product check method of a run in ``dtype`` under ``fault``: ``method``, except
    that ``auto`` becomes ``exact`` where a Freivalds check could miss the fault."""
    if method == "auto" and uncatchable(fault, "freivalds", [dtype]):
        return "exact"
    return method


def _target(x: np.ndarray) -> tuple:
    flat = np.abs(np.nan_to_num(x.astype(np.float64, copy=False))).reshape(-1)
    idx = int(np.argmax(flat)) if flat.size else 0
    return np.unravel_index(idx, x.shape)


def corrupt_entry(x, kind: str, eps: float | None = None) -> None:
    """Apply ``nan``, ``inf`` or ``perturb`` in place to one entry of array ``x`` (a device
    array is corrupted through a host copy, then written back); ``perturb`` moves it by
    ``eps`` of itself (default :func:`perturbation` of its dtype)."""
    if x.size == 0:
        return
    if not isinstance(x, np.ndarray):
        from ..backends import backend_of

        be = backend_of(x)
        host = np.array(be.to_numpy(x), copy=True)
        corrupt_entry(host, kind, eps)
        x[...] = be.asarray(host)
        return
    at = _target(x)
    if kind == "nan":
        x[at] = np.nan
    elif kind == "inf":
        x[at] = np.inf
    elif kind in ("perturb", "drift"):     # drift: on an output with no replicas
        eps = perturbation(x.dtype) if eps is None else eps
        x[at] = x[at] * (1.0 + eps) if x[at] != 0 else eps
    else:
        raise ValueError(f"corrupt_entry does not do {kind!r}")


def drift_entry(x) -> bool:
    """``drift`` in place: the entry of largest magnitude of array ``x`` moves by one
    unit in the last place (``nextafter`` towards +inf; the lowest bit of the raw bits
    of a 16-bit float held as integers; a device array through a host copy). Returns
    whether ``x`` had an entry to move."""
    if x.size == 0:
        return False
    if not isinstance(x, np.ndarray):
        from ..backends import backend_of

        be = backend_of(x)
        host = np.array(be.to_numpy(x), copy=True)
        drift_entry(host)
        x[...] = be.asarray(host)
        return True
    at = _target(x)
    if np.issubdtype(x.dtype, np.integer):
        # the raw bits of a 16-bit float (a mixed-precision gather moves them as
        # uint16): one unit in the last place is the lowest bit
        x[at] ^= 1
    else:
        x[at] = np.nextafter(x[at], x.dtype.type(np.inf))   # in x.dtype on any NumPy
    return True


class _Applied:
    """Whether a one-shot hook fired (``applied``)."""

    applied = False


@contextmanager
def drift_at_gathers(namespace):
    """Route the ring all-gathers that ``namespace`` (a module) calls,
    ``ring_allgather_unchecked``, through ``drift`` for the ``with`` block: the first
    one's result moves by one unit in the last place in one entry (:func:`drift_entry`)
    on this rank, as a receive gone wrong would leave it. Yields an object whose
    ``applied`` says whether one did. The messages are unchanged, so no rank waits."""
    ag = namespace.ring_allgather_unchecked
    hook = _Applied()

    def allgather(flat, comm):
        out = ag(flat, comm)
        if not hook.applied and comm.size > 1:
            hook.applied = drift_entry(out)
        return out

    namespace.ring_allgather_unchecked = allgather
    try:
        yield hook
    finally:
        namespace.ring_allgather_unchecked = ag


def perturb_product(host, case, g, seed: int) -> None:
    """``perturb`` on a product's block ``host`` (in place): its largest entry C_ij moves
    by :func:`perturbation` of its scale (|A||B|)_ij, from row i of op(A) and column j
    of op(B) regenerated whole (2 k values)."""
    if host.size == 0:
        return
    i, j = _target(host)
    rows, cols = product_block_slices(case, g)
    dtype = np.dtype(case.dtype)
    a, b = op_panels(case.spec, case.m, case.k, case.n, slice(rows.start + i, rows.start + i + 1),
                     slice(cols.start + j, cols.start + j + 1), slice(0, case.k), seed, dtype)
    scale = float((np.abs(a) @ np.abs(b))[0, 0])
    host[i, j] += perturbation(dtype) * (scale if scale > 0 else 1.0)


def drop_panel(host, case, g, seed: int) -> None:
    """``drop`` on a product's block ``host`` (in place): it misses the summand of its
    first k-panel."""
    rows, cols = product_block_slices(case, g)
    kc = slice(0, max(1, case.k // max(case.q, 1)))
    a, b = op_panels(case.spec, case.m, case.k, case.n, rows, cols, kc, seed,
                     np.dtype(case.dtype))
    host -= (a @ b).astype(host.dtype)


def drop_summand(host, seed: int, rank: int, p: int) -> None:
    """``drop`` on a ring all-reduce result ``host`` (in place) of world rank ``rank``:
    it misses the next rank's input."""
    host -= ring_input(seed, (rank + 1) % p, host.shape[0], host.dtype)


@contextmanager
def drop_at_rings(namespace):
    """Route the ring reductions that ``namespace`` (a module) calls,
    ``ring_allreduce_unchecked``, ``ring_reduce_scatter_unchecked`` and, when it has
    it, the non-blocking ``ring_start`` (a reduce-scatter or all-reduce in flight, the
    trainer's ``overlap``), through the ``drop`` hook for the ``with`` block: the one the
    armed hook picks (:meth:`~summasim.comm.Comm.take_drop`) keeps this rank's own
    contribution in what it returns (an all-reduce) or in the chunk it owns (a
    reduce-scatter; a ring in flight: when it is done). The messages are unchanged, so
    no rank waits; every rank that reads the chunk later sees the error."""
    ar, rs = namespace.ring_allreduce_unchecked, namespace.ring_reduce_scatter_unchecked
    start = getattr(namespace, "ring_start", None)

    # ``**kw`` (the 16-bit reductions' ``add``) passes through unchanged
    def allreduce(x, comm, out=None, **kw):
        if not comm.take_drop():
            return ar(x, comm, out=out, **kw)
        mine = x.copy()
        res = ar(x, comm, out=out, **kw)
        res[...] = mine
        return res

    def reduce_scatter(flat, comm, work=None, src=None, **kw):
        if not comm.take_drop():
            return rs(flat, comm, work, src, **kw)
        mine = (flat if src is None else src).copy()
        own = rs(flat, comm, work, src, **kw)
        lo, hi = chunk_bounds(flat.shape[0], comm.size)[own]
        flat[lo:hi] = mine[lo:hi]
        return own

    def ring_start(flat, comm, half="ar", work=None, **kw):
        if half == "ag" or not comm.take_drop():
            return start(flat, comm, half, work, **kw)
        mine = flat.copy()
        ring = start(flat, comm, half, work, **kw)
        p = comm.size
        lo, hi = (0, flat.shape[0]) if half == "ar" else \
            chunk_bounds(flat.shape[0], p)[(comm.rank + 1) % p]

        def keep_mine():
            flat[lo:hi] = mine[lo:hi]

        if ring.done:
            keep_mine()
        else:
            ring.on_done.insert(0, keep_mine)     # before any ``then`` reads the chunk
        return ring

    namespace.ring_allreduce_unchecked = allreduce
    namespace.ring_reduce_scatter_unchecked = reduce_scatter
    if start is not None:
        namespace.ring_start = ring_start
    try:
        yield
    finally:
        namespace.ring_allreduce_unchecked = ar
        namespace.ring_reduce_scatter_unchecked = rs
        if start is not None:
            namespace.ring_start = start
