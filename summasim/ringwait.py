"""How the steps of a ring wait, chosen per communicator and size by measuring them.

A ring step on host arrays (:meth:`summasim.comm.Comm.exchanger`) waits in one of three
ways (:data:`MODES`):

- ``"blocking"``: one ``MPI_Sendrecv`` per step, which returns when the right neighbour
  has taken the message and the left one's has arrived;
- ``"yield"``: ``MPI_Irecv`` and ``MPI_Isend``, the receive alone polled with
  ``MPI_Test`` and ``sched_yield``, the sends completed together when the half ends;
- ``"nap"``: as ``"yield"``, but after ``NAP_AFTER_POLLS`` polls the step sleeps 20 us
  between polls, which takes a waiter off the run queue.

Which is fastest depends on how many ranks share a core, the step's size, the MPI and
the machine (docs/performance.md: on 2 cores, blocking steps win with a core per rank,
yielding from 2 ranks per core, napping for long steps from 4 ranks per core). A fixed
rule tuned on one machine can be wrong on the next, so a communicator measures, once
per size class (a step's bytes, rounded down to a power of two), inside the first ring
call of that class, before its own steps: trial rings of the class's size on scratch
buffers (untraced) try the three modes, one ring each per round in a rotating order
(:func:`trial_order`), :func:`rounds_for` rounds (15 below 1 MiB steps, where a ring is
short and noisy, else 5), each timed on every rank. One ``MPI_Iallreduce`` (``MAX``) of
the trial times over the communicator then agrees on one mode (:func:`choose`): the
rule's mode stays unless another mode beat it in the rounds beyond chance (a one-sided
sign test at 5% on the slowest rank's paired times: all 5 of 5 rounds, or 12 of 15)
with a lower median; of several such, the one with the least median. That call and
every later ring of that class on that communicator wait that way. Like an FFT plan
measured on first use, the first call of a class pays for the trials, and no later
call does; a timer that warms up with one call never sees them.

``SUMMASIM_RING_WAIT`` (:func:`ring_wait_setting`): ``auto`` (the default: measure),
``rule`` (the fixed rule: blocking under the ``spin`` wait policy, else yield, napping
from ``NAP_BYTES`` at 4 or more ranks per core), or one of :data:`MODES` for every
ring. A ring on device or staged arrays, and a point-to-point ``sendrecv``, always
waits by the rule: only the ring's calls are collective over the communicator, which
the agreement needs.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

#: The ways a host ring step can wait (see the module doc).
MODES = ("blocking", "yield", "nap")
#: The values of ``SUMMASIM_RING_WAIT``.
SETTINGS = ("auto", "rule") + MODES
#: Rounds of trials (one call of each mode per round) of a size class, and of a class
#: whose steps are shorter than :data:`SMALL_BYTES` (cheap calls, noisy times).
TRIALS, TRIALS_SMALL, SMALL_BYTES = 5, 15, 1 << 20
#: The sign test's one-sided level: how rarely chance alone may switch the mode.
LEVEL = 0.05


def ring_wait_setting() -> str:
    """``SUMMASIM_RING_WAIT`` (``"auto"`` when unset or empty); a ValueError names the
    values it takes."""
    raw = os.environ.get("SUMMASIM_RING_WAIT", "").strip().lower() or "auto"
    if raw not in SETTINGS:
        raise ValueError(f"SUMMASIM_RING_WAIT={raw!r}: expected one of {', '.join(SETTINGS)}")
    return raw


def size_class(nbytes: int) -> int:
    """The size class of a ring whose steps carry at most ``nbytes``: ``floor(log2)``."""
    return max(0, int(nbytes).bit_length() - 1)


def rounds_for(nbytes: int) -> int:
    """Rounds of trials of the size class of ``nbytes`` (:data:`TRIALS`,
    :data:`TRIALS_SMALL` below :data:`SMALL_BYTES`)."""
    return TRIALS_SMALL if (1 << size_class(nbytes)) < SMALL_BYTES else TRIALS


def trial_order(rounds: int = TRIALS) -> tuple[str, ...]:
    """The modes of the trial calls, in order: :data:`MODES` rotated by one per round
    (blocking, yield, nap; yield, nap, blocking; ...), so that each mode runs first,
    second and last of a round alike and a machine that drifts during the trials favours
    none of them."""
    k = len(MODES)
    return tuple(MODES[(t + j) % k] for t in range(rounds) for j in range(k))


def wins_needed(rounds: int, level: float = LEVEL) -> int:
    """The fewest of ``rounds`` paired rounds a mode must win to beat another beyond
    chance (the one-sided sign test at ``level``); ``rounds + 1`` when none suffice."""
    from scipy.stats import binom

    return next((k for k in range(rounds + 1) if binom.sf(k - 1, rounds, 0.5) <= level),
                rounds + 1)


def choose(slowest: np.ndarray, prior: str) -> tuple[str, dict]:
    """The agreed mode and each mode's median, from ``slowest``: per trial call (in
    :func:`trial_order`), the slowest rank's seconds. ``prior`` (the rule's mode) stays
    unless another mode won at least :func:`wins_needed` of the rounds against it, with
    a lower median; of several such, the least median wins (a tie: the first in
    :data:`MODES`)."""
    k = len(MODES)
    rounds = len(slowest) // k
    order = trial_order(rounds)
    per = {m: [0.0] * rounds for m in MODES}
    for i, (m, t) in enumerate(zip(order, slowest)):
        per[m][i // k] = float(t)
    medians = {m: statistics.median(per[m]) for m in MODES}
    need = wins_needed(rounds)
    beat = [m for m in MODES if m != prior and medians[m] < medians[prior]
            and sum(a < b for a, b in zip(per[m], per[prior])) >= need]
    if not beat:
        return prior, medians
    return min(beat, key=lambda m: (medians[m], MODES.index(m))), medians


_KEYVAL: list = []     # the MPI attribute key of a communicator's RingWaits, made once


def kept_on(raw, keyval: list, make):
    """The object kept on the mpi4py communicator ``raw`` under the MPI attribute key in
    ``keyval`` (a one-item list, the key made on first use), ``make()`` the first time:
    every summasim ``Comm`` over the same communicator shares it, and it goes when the
    communicator is freed. A duplicate starts with none."""
    from mpi4py import MPI

    if not keyval:
        keyval.append(MPI.Comm.Create_keyval())
    kept = raw.Get_attr(keyval[0])
    if kept is None:
        kept = make()
        raw.Set_attr(keyval[0], kept)
    return kept


def waits_of(raw) -> "RingWaits":
    """The :class:`RingWaits` of the mpi4py communicator ``raw`` (:func:`kept_on`: a ring
    called with a plain communicator wraps it anew each call, and still shares them)."""
    return kept_on(raw, _KEYVAL, RingWaits)


class RingWaits:
    """One communicator's ring waits: per size class the agreed mode (see the module
    doc)."""

    def __init__(self):
        self.chosen: dict[int, str] = {}          # size class -> agreed mode
        self.medians: dict[int, dict] = {}        # size class -> {mode: median seconds}

    def decided(self, nbytes: int) -> str | None:
        """The agreed mode of rings of steps of at most ``nbytes`` (None before its
        trials)."""
        return self.chosen.get(size_class(nbytes))

    def settle(self, nbytes: int, trial, prior: str, raw, wait) -> str:
        """The agreed mode of the size class of ``nbytes``, after running its trials now
        if they have not run: ``trial(mode)`` runs one ring of the class on scratch
        buffers, waiting by ``mode``, and is timed on this rank; one ``Iallreduce`` (MAX)
        over the raw communicator ``raw`` (completed by ``wait(request)``) agrees on the
        mode against ``prior``, the rule's (:func:`choose`). Every rank calls it in the
        same ring call, so all run the same trials."""
        c = size_class(nbytes)
        if c in self.chosen:
            return self.chosen[c]
        from mpi4py import MPI

        clock, mine = time.perf_counter, []
        for mode in trial_order(rounds_for(1 << c)):
            t0 = clock()
            trial(mode)
            mine.append(clock() - t0)
        slowest = np.empty(len(mine))
        wait(raw.Iallreduce(np.array(mine, dtype=np.float64), slowest, op=MPI.MAX))
        self.chosen[c], self.medians[c] = choose(slowest, prior)
        return self.chosen[c]

    def report(self) -> list[dict]:
        """The agreed classes, smallest first: ``{"from_bytes", "mode", "medians"}``
        (``medians``: each mode's median trial time of the slowest rank, s)."""
        return [{"from_bytes": 1 << c, "mode": self.chosen[c], "medians": self.medians[c]}
                for c in sorted(self.chosen)]
