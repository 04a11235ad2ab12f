"""MPICH's choice of a collective algorithm (its CVAR thresholds) and the time of one
collective call: :func:`collective_time`, the cost model's entry to
:mod:`~summasim.costmodel.collectives.mpich`'s formulas."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import NamedTuple

from .._checks import finite_size, whole
from ..machine import Machine
from .mpich import ALGORITHMS, MODES, OPS, REDUCE_IMPLS, is_pof2, pof2_floor

@dataclass(frozen=True)
class Thresholds:
    """MPICH's collective-selection thresholds in bytes (defaults: MPICH 4.x/5.x).

    Field ``x`` is the CVAR ``MPIR_CVAR_<X upper-cased>``, e.g. ``bcast_short_msg_size``
    is ``MPIR_CVAR_BCAST_SHORT_MSG_SIZE``.
    """

    bcast_short_msg_size: int = 12288
    bcast_min_procs: int = 8
    bcast_long_msg_size: int = 524288
    reduce_short_msg_size: int = 2048
    allreduce_short_msg_size: int = 2048
    allgather_short_msg_size: int = 81920
    allgather_long_msg_size: int = 524288
    redscat_commutative_long_msg_size: int = 524288

    @classmethod
    def from_env(cls, environ=None) -> "Thresholds":
        """Defaults overridden by ``MPIR_CVAR_*`` variables in ``environ`` (os.environ)."""
        env = os.environ if environ is None else environ
        vals = {}
        for f in fields(cls):
            key = "MPIR_CVAR_" + f.name.upper()
            if key in env:
                try:
                    vals[f.name] = int(env[key])
                except ValueError:
                    raise ValueError(f"{key}={env[key]!r} is not an integer") from None
        return cls(**vals)


MPICH = Thresholds()


class CollectiveCost(NamedTuple):
    """Predicted time of one collective call and the algorithm the model assumed."""

    seconds: float
    algorithm: str


def select_algorithm(op: str, nbytes: float, p: int, thresholds: Thresholds = MPICH, *,
                     itemsize: int = 8) -> str:
    """The algorithm MPICH would pick for ``op`` (see the module docstring).

    Parameters
    ----------
    op : str
        One of :data:`OPS`.
    nbytes : float
        Bytes as in a trace Event (per-rank contribution for allgather).
    p : int
        Group size.
    thresholds : Thresholds
        Selection thresholds (MPICH defaults).
    itemsize : int
        Bytes per item, for the "count < p'" rules of reduce and allreduce.

    Returns
    -------
    str
        A key of ``ALGORITHMS[op]``, or "none" when ``p == 1``.
    """
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if p <= 1:
        return "none"
    t = thresholds
    count = nbytes // max(1, itemsize)
    if op == "bcast":
        if nbytes < t.bcast_short_msg_size or p < t.bcast_min_procs:
            return "binomial"
        if nbytes < t.bcast_long_msg_size and is_pof2(p):
            return "scatter_recursive_doubling_allgather"
        return "scatter_ring_allgather"
    if op == "reduce":
        if nbytes <= t.reduce_short_msg_size or count < pof2_floor(p):
            return "binomial"
        return "reduce_scatter_gather"
    if op == "allreduce":
        if nbytes <= t.allreduce_short_msg_size or count < pof2_floor(p):
            return "recursive_doubling"
        return "reduce_scatter_allgather"
    if op == "allgather":
        total = nbytes * p
        if is_pof2(p) and total < t.allgather_long_msg_size:
            return "recursive_doubling"
        if not is_pof2(p) and total < t.allgather_short_msg_size:
            return "bruck"
        return "ring"
    if op == "reduce_scatter":
        return ("recursive_halving" if nbytes < t.redscat_commutative_long_msg_size
                else "pairwise")
    if op == "sendrecv":
        return "sendrecv"
    return "dissemination"


def collective_time(op: str, nbytes: float, p: int, machine: Machine, *,
                    algorithm: str | None = None, mode: str = "mpich",
                    thresholds: Thresholds | None = None, itemsize: int = 8,
                    inter: bool = False, reduce_impl: str = "tree") -> CollectiveCost:
    """Seconds of one ``op`` of ``nbytes`` over ``p`` ranks, and the algorithm assumed.

    Parameters
    ----------
    op : str
        "bcast", "reduce", "allreduce", "allgather", "reduce_scatter", "sendrecv"
        or "barrier".
    nbytes : float
        Bytes as in a trace Event (see the module docstring).
    p : int
        Group size.
    machine : Machine
    algorithm : str, optional
        Force this algorithm (a key of ``ALGORITHMS[op]``, "paper" included).
    mode : {"mpich", "paper"}
        "mpich": pick like MPICH with ``thresholds``; "paper": the Optimus formulas.
    thresholds : Thresholds, optional
        Defaults to MPICH's.
    itemsize : int
        Bytes per item (selection rules only).
    inter : bool
        Use the machine's inter-node link.
    reduce_impl : {"tree", "mpi"}
        How a "reduce" runs: summasim's tree (:func:`reduce_tree`, what ``Comm``
        does by default) or ``MPI_Ireduce`` (MPICH's selection). Mode "paper" and a
        forced ``algorithm`` take precedence.

    Returns
    -------
    CollectiveCost
        ``(seconds, algorithm)``; ``(0.0, "none")`` when ``p == 1``.
    """
    if reduce_impl not in REDUCE_IMPLS:
        raise ValueError(f"unknown reduce_impl {reduce_impl!r}; choose one of "
                         f"{', '.join(REDUCE_IMPLS)}")
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    nbytes = finite_size(f"{op}: nbytes", nbytes)
    p = whole(f"{op}: p (the group size)", p)
    if p == 1:
        return CollectiveCost(0.0, "none")
    if algorithm is None:
        if mode == "paper":
            algorithm = "paper"
        elif op == "reduce" and reduce_impl == "tree":
            algorithm = "tree"
        else:
            algorithm = select_algorithm(op, nbytes, p, thresholds or MPICH, itemsize=itemsize)
    table = ALGORITHMS[op]
    if algorithm not in table:
        raise ValueError(f"unknown {op} algorithm {algorithm!r}; known: {', '.join(table)}")
    return CollectiveCost(table[algorithm](nbytes, p, machine, inter=inter), algorithm)
