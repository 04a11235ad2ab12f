"""The ring's wait modes, chosen by measuring (:mod:`summasim.ringwait`): the trials'
order, the choice from the slowest rank's times, the setting, and one communicator's
trials from the first call of a size class to its agreed mode (on one rank; the agreement
over many ranks is ``mpi_tests/test_ring_waits.py``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mpi4py import MPI

from summasim import ringwait as rw


def test_the_trials_rotate_every_mode_through_every_position():
    for rounds in (rw.TRIALS, rw.TRIALS_SMALL):
        order = rw.trial_order(rounds)
        k = len(rw.MODES)
        assert len(order) == k * rounds
        assert all(order.count(m) == rounds for m in rw.MODES)
        rounds_ = [order[i:i + k] for i in range(0, len(order), k)]
        assert all(sorted(r) == sorted(rw.MODES) for r in rounds_)
        # over the first k rounds each mode runs in each position once
        for m in rw.MODES:
            assert sorted(r.index(m) for r in rounds_[:k]) == list(range(k))


def _times(per_mode: dict, rounds: int) -> np.ndarray:
    """Trial times in :func:`trial_order`: ``per_mode[m]`` a number or one per round."""
    order, k = rw.trial_order(rounds), len(rw.MODES)
    return np.array([per_mode[m] if np.isscalar(per_mode[m]) else per_mode[m][i // k]
                     for i, m in enumerate(order)], dtype=float)


def test_the_sign_test_needs_all_of_5_rounds_or_12_of_15():
    assert rw.wins_needed(5) == 5 and rw.wins_needed(15) == 12
    assert rw.wins_needed(4) == 5                       # 4 rounds can never decide
    assert rw.rounds_for(64 << 10) == rw.TRIALS_SMALL and rw.rounds_for(1 << 20) == rw.TRIALS


def test_a_mode_that_wins_every_round_replaces_the_rule():
    times = _times({"blocking": 3.0, "yield": 1.0, "nap": 2.0}, 5)
    mode, medians = rw.choose(times, "blocking")
    assert mode == "yield" and medians == {"blocking": 3.0, "yield": 1.0, "nap": 2.0}
    # both beat the prior in every round: the least median of them
    assert rw.choose(_times({"blocking": 3.0, "yield": 2.0, "nap": 1.0}, 5), "blocking")[0] == "nap"


def test_the_rule_stays_unless_beaten_beyond_chance():
    # yield faster on the median but slower in one of 5 rounds: not enough
    times = _times({"blocking": 2.0, "yield": [1.0, 1.0, 1.0, 1.0, 9.0], "nap": 3.0}, 5)
    assert rw.choose(times, "blocking")[0] == "blocking"
    # 12 of 15 rounds is enough, 11 is not
    for wins, want in ((12, "yield"), (11, "blocking")):
        y = [1.0] * wins + [3.0] * (15 - wins)
        times = _times({"blocking": 2.0, "yield": y, "nap": 5.0}, 15)
        assert rw.choose(times, "blocking")[0] == want, wins
    # winning rounds with a worse median (a few big losses) does not switch either
    y = [1.9] * 12 + [9.0] * 3
    assert rw.choose(_times({"blocking": [2.0] * 15, "yield": y, "nap": 5.0}, 15),
                     "blocking")[0] == "yield"       # its median 1.9 < 2.0
    assert rw.choose(_times({"blocking": 1.0, "yield": 1.0, "nap": 1.0}, 5), "nap")[0] == "nap"


@pytest.mark.parametrize("nbytes,cls", [(0, 0), (1, 0), (2, 1), (65536, 16), (65537, 16),
                                        (131071, 16), (131072, 17)])
def test_size_classes_are_powers_of_two(nbytes, cls):
    assert rw.size_class(nbytes) == cls


def test_the_setting(monkeypatch):
    monkeypatch.delenv("SUMMASIM_RING_WAIT", raising=False)
    assert rw.ring_wait_setting() == "auto"
    for value in rw.SETTINGS:
        monkeypatch.setenv("SUMMASIM_RING_WAIT", f" {value.upper()} ")
        assert rw.ring_wait_setting() == value
    monkeypatch.setenv("SUMMASIM_RING_WAIT", "spin")
    with pytest.raises(ValueError, match="SUMMASIM_RING_WAIT='spin'.*auto, rule, blocking"):
        rw.ring_wait_setting()


def test_a_communicator_tries_each_mode_then_keeps_the_fastest(monkeypatch):
    """The first call of a class runs every trial in order; their (faked) times decide
    against the rule's mode; later calls of the class run none, other classes run
    their own, and the result is kept on the MPI communicator, shared by every wrapper
    and gone with a duplicate."""
    raw = MPI.COMM_SELF.Dup()
    try:
        waits = rw.waits_of(raw)
        assert rw.waits_of(raw) is waits
        fake = {"blocking": 0.004, "yield": 0.003, "nap": 0.001}
        clock = itertools.count()
        now = [0.0]
        monkeypatch.setattr(rw.time, "perf_counter", lambda: now[0])
        seen = []

        def trial(mode):
            seen.append(mode)
            now[0] += fake[mode] + 1e-9 * next(clock)

        assert waits.decided(1000) is None
        assert waits.settle(1000, trial, "yield", raw, lambda req: req.Wait()) == "nap"
        assert tuple(seen) == rw.trial_order(rw.TRIALS_SMALL)
        assert waits.decided(1000) == "nap" and waits.decided(1023) == "nap"
        seen.clear()
        assert waits.settle(600, trial, "yield", raw, lambda req: req.Wait()) == "nap"
        assert seen == []                                  # the same class: no trials
        assert waits.decided(1024) is None                 # a new class
        [row] = waits.report()
        assert row["from_bytes"] == 512 and row["mode"] == "nap"
        assert row["medians"]["nap"] == pytest.approx(0.001, abs=1e-6)
        dup = raw.Dup()
        assert rw.waits_of(dup).decided(1000) is None
        dup.Free()
    finally:
        raw.Free()
