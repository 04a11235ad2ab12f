"""Fault injection: corrupt one output on one rank after it is computed, to show that
the validator fails when it must (``summasim.run --inject KIND@RANK``, ``--self-test``).

=========  ====================================================================
kind       what happens on the chosen rank
=========  ====================================================================
nan        one entry of the output becomes NaN
inf        one entry becomes +Inf
perturb    one entry is multiplied by (1 + 1e-6): a relative error far above
           float64 round-off (in float32 it is below round-off, so the self-test
           runs in float64)
drop       one block is left unreduced: a product's block misses the summand of
           one k-panel; the all-reduce result misses another rank's input; in a
           training step, the first sum all-reduce on that rank returns the rank's
           own contribution instead of the sum
=========  ====================================================================

The entry is the one of largest magnitude in the rank's output (for a training
step: in the rank's local gradient of the first weight), so ``perturb`` is not lost
next to a larger entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("nan", "inf", "perturb", "drop")
PERTURB = 1e-6


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


def _target(x: np.ndarray) -> tuple:
    flat = np.abs(np.nan_to_num(x.astype(np.float64, copy=False))).reshape(-1)
    idx = int(np.argmax(flat)) if flat.size else 0
    return np.unravel_index(idx, x.shape)


def corrupt_entry(x: np.ndarray, kind: str) -> None:
    """Apply ``nan``, ``inf`` or ``perturb`` in place to one entry of host array ``x``."""
    if x.size == 0:
        return
    at = _target(x)
    if kind == "nan":
        x[at] = np.nan
    elif kind == "inf":
        x[at] = np.inf
    elif kind == "perturb":
        x[at] = x[at] * (1.0 + PERTURB) if x[at] != 0 else PERTURB
    else:
        raise ValueError(f"corrupt_entry does not do {kind!r}")
