"""Time of MPI collectives (seconds) in the alpha-beta-gamma model.

Every function takes ``nbytes`` (bytes), the group size ``p`` and a
:class:`~summasim.costmodel.machine.Machine`, and returns seconds. ``nbytes`` means
what a summasim trace :class:`~summasim.trace.Event` records:

=================  ============================================================
bcast, reduce,     the buffer on every member (B)
allreduce
allgather          this rank's contribution; the gathered total is ``p * nbytes``
reduce_scatter     the whole input buffer on every member (B)
sendrecv           the bytes this rank sends (sends and receives overlap)
barrier            0
=================  ============================================================

Each message of ``m`` bytes costs ``alpha(m) + beta(m) * m`` with the regime of its
own size (eager below the link's ``eager_threshold``, rendezvous above); a reduction
adds ``gamma_r * m``. ``lg p = ceil(log2 p)``; p' is the largest power of two
<= p. The formulas (Thakur, Rabenseifner and Gropp 2005, for p a power of two):

==========================================  =================================================
bcast  binomial                             lg p (alpha + B beta)
bcast  scatter + recursive-doubling         2 lg p alpha + 2 (p-1)/p B beta  (van de Geijn)
       allgather
bcast  scatter + ring allgather             (lg p + p - 1) alpha + 2 (p-1)/p B beta
reduce tree (summasim's Comm, the default)  lg p (alpha + B beta) + lg p (lg p + 1)/2 B gamma_add
                                            (+ B gamma_add for the root's copy)
reduce binomial                             lg p (alpha + B beta + B gamma_r)
reduce reduce-scatter + gather              2 lg p alpha + 2 (p-1)/p B beta + (p-1)/p B gamma_r
       (Rabenseifner)
allreduce recursive doubling                lg p (alpha + B beta + B gamma_r)
allreduce reduce-scatter + allgather        2 lg p alpha + 2 (p-1)/p B beta + (p-1)/p B gamma_r
       (Rabenseifner)
allreduce ring                              2 (p-1) alpha + 2 (p-1)/p B beta + (p-1)/p B gamma_r
allgather ring (total pB)                   (p-1) alpha + (p-1) B beta
allgather recursive doubling / Bruck        lg p alpha + (p-1) B beta
reduce_scatter recursive halving            lg p alpha + (p-1)/p B (beta + gamma_r)
reduce_scatter pairwise (ring)              (p-1) alpha + (p-1)/p B (beta + gamma_r)
sendrecv                                    alpha + B beta
barrier (dissemination)                     lg p alpha
==========================================  =================================================

``gamma_add`` is ``machine.gamma_reduce`` (a NumPy ``a += b``), ``gamma_r`` is
``machine.gamma_reduce_mpi`` (MPI's own reduction loops, slower here).

summasim's reduce
-----------------
``Comm.reduce``/``ireduce`` do not call ``MPI_Ireduce`` by default: they run a
binomial tree of point-to-point messages with the additions done by NumPy
(``reduce_algorithm="tree"``, environment ``SUMMASIM_REDUCE=tree|mpi``). With
``rel = (rank - root) mod p`` a rank receives the partial sums of its children
``rel + 1, rel + 2, rel + 4, ...`` (those below its lowest set bit), waits for all
of them, adds them one after the other (``acc = child_0; acc += own; acc += child_1
...``; the root first copies its own buffer into the result) and sends the sum to
its parent. The receives overlap each other, the additions do not, so a node
finishes ``max_c (T_c + alpha + B beta) + n_c B gamma_add`` after the start and the
root of a full tree of ``2^k`` ranks after ``k (alpha + B beta) + k (k+1)/2 B
gamma_add`` (plus its copy). :func:`reduce_tree` evaluates the recursion for any p
(``O(log^2 p)``). :func:`collective_time` prices "reduce" with it unless
``reduce_impl="mpi"`` (then MPICH's selection applies).

When p is not a power of two, Rabenseifner and recursive doubling first fold the
p - p' extra ranks in (``alpha + B beta + B gamma_r``) and, for the all-reduces,
finally send them the result (``alpha + B beta`` more); the rest runs on p' ranks,
as in MPICH.

The "paper" mode is the Optimus paper's section 2.5: broadcast = reduce =
``log2(p) beta B`` (eq. 4), all-reduce = ``2 beta (p-1) B / p`` (eq. 5), alpha
omitted; by the same rule allgather = reduce_scatter = ``(p-1)/p beta B`` (of the
total), sendrecv = ``beta B`` and barrier = 0.

Algorithm selection
-------------------
:func:`select_algorithm` mirrors MPICH's choice. Its defaults are the selection
tree compiled into the ``mpich`` 5.0.2 wheel (the JSON string in ``libmpi.so.12``;
source ``maint/tuning/coll/mpir/generic.json`` in pmodels/mpich) for the
non-blocking collectives summasim's ``Comm`` calls (``MPIR_Ibcast``, ``Ireduce``,
``Iallreduce``, ``Iallgather`` ``..._intra_sched_*``), which are also the legacy
CVAR rules (values printed by ``mpivars``):

* bcast: binomial if ``p < MPIR_CVAR_BCAST_MIN_PROCS`` (8) or
  ``B < MPIR_CVAR_BCAST_SHORT_MSG_SIZE`` (12288); else, p a power of two and
  ``B < MPIR_CVAR_BCAST_LONG_MSG_SIZE`` (524288): scatter + recursive-doubling
  allgather; else scatter + ring allgather.
* reduce: binomial if ``B <= MPIR_CVAR_REDUCE_SHORT_MSG_SIZE`` (2048) or the item
  count < p'; else reduce-scatter + gather.
* allreduce: recursive doubling if ``B <= MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE`` (2048)
  or the item count < p'; else reduce-scatter + allgather. (The *blocking*
  MPI_Allreduce tree of 5.0.2 uses recursive doubling only up to 8 bytes: set
  ``Thresholds(allreduce_short_msg_size=8)`` to model it.)
* allgather (total T = pB): recursive doubling if p is a power of two and
  ``T < MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE`` (524288); Bruck if p is not and
  ``T < MPIR_CVAR_ALLGATHER_SHORT_MSG_SIZE`` (81920); else ring.
* reduce_scatter: recursive halving if ``B < 524288`` (commutative ops), else pairwise.

:class:`Thresholds` holds these; ``Thresholds.from_env()`` reads ``MPIR_CVAR_*``
overrides from the environment, as MPICH would, for a caller that passes it (the
front-ends price the defaults). Not modelled: the hierarchical
("smp") variants MPICH picks for communicators spanning several nodes with
several ranks each, and the POSIX shared-memory release-gather algorithms the ch4
device may use for *blocking* Bcast/Reduce/Allreduce inside a node; a fitted
machine absorbs such differences only on average. Pass ``algorithm=`` to force
one algorithm.

References
----------
R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005.
M. Barnett, L. Shuler, R. van de Geijn et al., "Interprocessor collective
communication library (InterCom)", SHPCC 1994 (scatter + allgather broadcast).
Q. Xu et al., "An Efficient 2D Method for Training Super-Large Deep Learning
Models" (Optimus), 2021, section 2.5, eqs. (4)-(5).
"""

from __future__ import annotations

import math
import os
from typing import Callable

from ..machine import Machine

OPS = ("bcast", "reduce", "allreduce", "allgather", "reduce_scatter", "sendrecv", "barrier")
MODES = ("mpich", "paper")
#: How ``Comm.reduce`` runs: summasim's tree (default) or MPI_Ireduce.
REDUCE_IMPLS = ("tree", "mpi")


def default_reduce_impl(environ=None) -> str:
    """``$SUMMASIM_REDUCE`` (as ``Comm`` reads it) or "tree"."""
    env = os.environ if environ is None else environ
    impl = env.get("SUMMASIM_REDUCE", "tree").strip().lower() or "tree"
    if impl not in REDUCE_IMPLS:
        raise ValueError(f"SUMMASIM_REDUCE={impl!r}: expected 'tree' or 'mpi'")
    return impl


def lg(p: int) -> int:
    """``ceil(log2 p)`` for p >= 1 (0 for p == 1)."""
    return (int(p) - 1).bit_length()


def pof2_floor(p: int) -> int:
    """Largest power of two <= p."""
    return 1 << (int(p).bit_length() - 1)


def is_pof2(p: int) -> bool:
    return p >= 1 and (p & (p - 1)) == 0


def _msgs(link, sizes, gamma_r: float = 0.0) -> float:
    """Sum of ``alpha(m) + (beta(m) + gamma_r) * m`` over message sizes."""
    return sum(link.alpha(m) + (link.beta(m) + gamma_r) * m for m in sizes)


def _halvings(nbytes: float, p: int) -> list[float]:
    """Message sizes of a recursive-halving / binomial scatter over p ranks: B/2, B/4, ..."""
    return [nbytes / (1 << s) for s in range(1, lg(p) + 1)]


def _doublings(nbytes_total: float, p: int) -> list[float]:
    """Sizes of a recursive-doubling allgather of a total: T/p, 2T/p, ..., capped."""
    out, have = [], 1
    while have < p:
        step = min(have, p - have)
        out.append(step * nbytes_total / p)
        have += step
    return out


def _fold(link, nbytes: float, p: int, gamma_r: float, back: bool = True) -> float:
    """Extra cost of folding p - p' ranks into a power of two (and, if ``back``,
    sending them the result): ``(1 or 2) (alpha + B beta) + B gamma_r``."""
    if is_pof2(p):
        return 0.0
    return (2.0 if back else 1.0) * link.time(nbytes) + gamma_r * nbytes


# -- broadcast ---------------------------------------------------------------------
def bcast_binomial(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Binomial-tree broadcast: ``lg p (alpha + B beta)`` seconds."""
    if p <= 1:
        return 0.0
    return lg(p) * machine.link(inter).time(nbytes)


def bcast_scatter_recursive_doubling_allgather(nbytes: float, p: int, machine: Machine, *,
                                               inter: bool = False) -> float:
    """Van de Geijn broadcast: binomial scatter, then recursive-doubling allgather.

    ``2 lg p alpha + 2 (p-1)/p B beta`` seconds for p a power of two.
    """
    if p <= 1:
        return 0.0
    link = machine.link(inter)
    return _msgs(link, _halvings(nbytes, p)) + _msgs(link, _doublings(nbytes, p))


def bcast_scatter_ring_allgather(nbytes: float, p: int, machine: Machine, *,
                                 inter: bool = False) -> float:
    """Broadcast as binomial scatter then ring allgather:
    ``(lg p + p - 1) alpha + 2 (p-1)/p B beta`` seconds."""
    if p <= 1:
        return 0.0
    link = machine.link(inter)
    chunk = nbytes / p
    return _msgs(link, _halvings(nbytes, p)) + (p - 1) * link.time(chunk)


# -- reduce ------------------------------------------------------------------------
def reduce_binomial(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Binomial-tree reduce: ``lg p (alpha + B beta + B gamma_r)`` seconds."""
    if p <= 1:
        return 0.0
    link = machine.link(inter)
    return lg(p) * (link.time(nbytes) + machine.gamma_reduce_mpi * nbytes)


def _tree_finish(start: int, span: int, p: int, msg: float, add: float, cache: dict) -> float:
    """Finish time of the tree node ``start`` whose subtree is ``start .. start+span-1``
    (capped at p): ``max_c (T_c + msg) + n_c add`` over its children ``start + 2^i``."""
    key = (span, min(span, p - start))
    hit = cache.get(key)
    if hit is not None:
        return hit
    worst, children, i = 0.0, 0, 1
    while i < span and start + i < p:
        worst = max(worst, _tree_finish(start + i, i, p, msg, add, cache) + msg)
        children += 1
        i <<= 1
    out = worst + children * add
    cache[key] = out
    return out


def reduce_tree(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """summasim's binomial-tree reduce (``Comm.reduce``, the default; see the module doc).

    Root finish time ``max_c (T_c + alpha + B beta) + n_c B gamma_add`` recursively,
    plus the root's copy of its own buffer (``B gamma_add``); for p = 2^k that is
    ``k (alpha + B beta) + (k (k+1)/2 + 1) B gamma_add``. ``gamma_add`` is the
    machine's NumPy ``gamma_reduce``, not MPI's.
    """
    if p <= 1:
        return 0.0
    link = machine.link(inter)
    add = machine.gamma_reduce * nbytes
    span = 1 << lg(p)
    # subtrees that do not reach p are full: their finish depends on (span, size) only
    return _tree_finish(0, span, int(p), link.time(nbytes), add, {}) + add


def reduce_scatter_gather(nbytes: float, p: int, machine: Machine, *,
                          inter: bool = False) -> float:
    """Rabenseifner reduce: recursive-halving reduce-scatter, binomial gather.

    ``2 lg p' alpha + 2 (p'-1)/p' B beta + (p'-1)/p' B gamma_r`` plus the fold
    for p not a power of two.
    """
    if p <= 1:
        return 0.0
    link, gr, p2 = machine.link(inter), machine.gamma_reduce_mpi, pof2_floor(p)
    sizes = _halvings(nbytes, p2)
    return _fold(link, nbytes, p, gr, back=False) + _msgs(link, sizes, gr) + _msgs(link, sizes)


# -- allreduce ---------------------------------------------------------------------
def allreduce_recursive_doubling(nbytes: float, p: int, machine: Machine, *,
                                 inter: bool = False) -> float:
    """Recursive-doubling all-reduce: ``lg p' (alpha + B beta + B gamma_r)`` (+ fold)."""
    if p <= 1:
        return 0.0
    link, gr, p2 = machine.link(inter), machine.gamma_reduce_mpi, pof2_floor(p)
    return _fold(link, nbytes, p, gr) + lg(p2) * (link.time(nbytes) + gr * nbytes)


def allreduce_reduce_scatter_allgather(nbytes: float, p: int, machine: Machine, *,
                                       inter: bool = False) -> float:
    """Rabenseifner all-reduce: recursive-halving reduce-scatter + recursive-doubling
    allgather, ``2 lg p' alpha + 2 (p'-1)/p' B beta + (p'-1)/p' B gamma_r`` (+ fold)."""
    if p <= 1:
        return 0.0
    link, gr, p2 = machine.link(inter), machine.gamma_reduce_mpi, pof2_floor(p)
    sizes = _halvings(nbytes, p2)
    return _fold(link, nbytes, p, gr) + _msgs(link, sizes, gr) + _msgs(link, sizes)


def allreduce_ring(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Ring all-reduce: ``2 (p-1) (alpha + B/p beta) + (p-1) B/p gamma_r`` seconds.

    The cost of :func:`summasim.algorithms.allreduce.ring_allreduce` (2(p-1)
    sendrecvs of about B/p bytes) and of Optimus eq. (5) when alpha = 0.
    """
    if p <= 1:
        return 0.0
    link, chunk = machine.link(inter), nbytes / p
    return 2 * (p - 1) * link.time(chunk) + (p - 1) * machine.gamma_reduce * chunk


# -- allgather / reduce_scatter ----------------------------------------------------
def allgather_ring(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Ring allgather of ``nbytes`` per rank: ``(p-1) (alpha + B beta)`` seconds."""
    if p <= 1:
        return 0.0
    return (p - 1) * machine.link(inter).time(nbytes)


def allgather_recursive_doubling(nbytes: float, p: int, machine: Machine, *,
                                 inter: bool = False) -> float:
    """Recursive-doubling allgather of ``nbytes`` per rank:
    ``lg p alpha + (p-1) B beta`` seconds (sizes B, 2B, 4B, ...)."""
    if p <= 1:
        return 0.0
    return _msgs(machine.link(inter), _doublings(nbytes * p, p))


def allgather_bruck(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Bruck allgather: ``lg p alpha + (p-1) B beta`` for any p (same sizes as doubling)."""
    return allgather_recursive_doubling(nbytes, p, machine, inter=inter)


def reduce_scatter_recursive_halving(nbytes: float, p: int, machine: Machine, *,
                                     inter: bool = False) -> float:
    """Recursive-halving reduce-scatter of a B-byte buffer:
    ``lg p alpha + (p-1)/p B (beta + gamma_r)`` seconds."""
    if p <= 1:
        return 0.0
    link, gr = machine.link(inter), machine.gamma_reduce_mpi
    return (_fold(link, nbytes, p, gr, back=False)
            + _msgs(link, _halvings(nbytes, pof2_floor(p)), gr))


def reduce_scatter_pairwise(nbytes: float, p: int, machine: Machine, *,
                            inter: bool = False) -> float:
    """Pairwise (ring) reduce-scatter: ``(p-1) (alpha + B/p (beta + gamma_r))`` seconds."""
    if p <= 1:
        return 0.0
    link, chunk = machine.link(inter), nbytes / p
    return (p - 1) * (link.time(chunk) + machine.gamma_reduce_mpi * chunk)


# -- point to point, barrier ---------------------------------------------------------
def sendrecv(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """One shift: send ``nbytes`` and receive as many at once, ``alpha + B beta``."""
    if p <= 1:
        return 0.0
    return machine.link(inter).time(nbytes)


def barrier_dissemination(nbytes: float, p: int, machine: Machine, *,
                          inter: bool = False) -> float:
    """Dissemination barrier: ``lg p`` zero-byte messages."""
    if p <= 1:
        return 0.0
    return lg(p) * machine.link(inter).time(0)


# -- the Optimus paper's formulas (alpha omitted) ---------------------------------------
def paper_bcast(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Optimus eq. (4): ``log2(p) beta B``."""
    if p <= 1:
        return 0.0
    return math.log2(p) * machine.link(inter).beta(nbytes) * nbytes


paper_reduce = paper_bcast


def paper_allreduce(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Optimus eq. (5): ``2 beta (p-1) B / p``."""
    if p <= 1:
        return 0.0
    return 2.0 * machine.link(inter).beta(nbytes) * (p - 1) * nbytes / p


def paper_allgather(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """Half of eq. (5) on the gathered total: ``(p-1) beta B`` for B bytes per rank."""
    if p <= 1:
        return 0.0
    return machine.link(inter).beta(nbytes) * (p - 1) * nbytes


def paper_reduce_scatter(nbytes: float, p: int, machine: Machine, *,
                         inter: bool = False) -> float:
    """Half of eq. (5): ``(p-1)/p beta B``."""
    if p <= 1:
        return 0.0
    return machine.link(inter).beta(nbytes) * (p - 1) * nbytes / p


def paper_sendrecv(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """``beta B`` (alpha omitted)."""
    if p <= 1:
        return 0.0
    return machine.link(inter).beta(nbytes) * nbytes


def paper_barrier(nbytes: float, p: int, machine: Machine, *, inter: bool = False) -> float:
    """0: a barrier moves no data and the paper omits latency."""
    return 0.0


#: ``ALGORITHMS[op][name]`` is the time function of that algorithm.
ALGORITHMS: dict[str, dict[str, Callable[..., float]]] = {
    "bcast": {"binomial": bcast_binomial,
              "scatter_recursive_doubling_allgather": bcast_scatter_recursive_doubling_allgather,
              "scatter_ring_allgather": bcast_scatter_ring_allgather,
              "paper": paper_bcast},
    "reduce": {"tree": reduce_tree,
               "binomial": reduce_binomial,
               "reduce_scatter_gather": reduce_scatter_gather,
               "paper": paper_reduce},
    "allreduce": {"recursive_doubling": allreduce_recursive_doubling,
                  "reduce_scatter_allgather": allreduce_reduce_scatter_allgather,
                  "ring": allreduce_ring,
                  "paper": paper_allreduce},
    "allgather": {"ring": allgather_ring,
                  "recursive_doubling": allgather_recursive_doubling,
                  "bruck": allgather_bruck,
                  "paper": paper_allgather},
    "reduce_scatter": {"recursive_halving": reduce_scatter_recursive_halving,
                       "pairwise": reduce_scatter_pairwise,
                       "paper": paper_reduce_scatter},
    "sendrecv": {"sendrecv": sendrecv, "paper": paper_sendrecv},
    "barrier": {"dissemination": barrier_dissemination, "paper": paper_barrier},
}
