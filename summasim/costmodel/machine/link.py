"""A link's message regimes (:class:`Link`) and the shared-core model (:class:`SharedCore`).

A :class:`Link` holds the alpha-beta regimes of one kind of connection (inside a node,
between nodes), split at its eager threshold; :class:`SharedCore` prices ranks that
time-share the cores of a node (see :mod:`summasim.costmodel.machine.record`).
Units: seconds, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

#: Bytes per item of the dtype names the cost model knows.
DTYPE_SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
               "complex128": 16, "complex64": 8}


def itemsize_of(dtype) -> int:
    """Bytes per item of ``dtype`` (a name such as "float32" or a NumPy dtype)."""
    name = getattr(dtype, "name", dtype)
    name = str(name)
    if name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_SIZES)}")
    return DTYPE_SIZES[name]


def _dtype_name(dtype) -> str:
    return str(getattr(dtype, "name", dtype))


def _number(path: str, value, *, integer: bool = False, positive: bool = False) -> float:
    """Validate one numeric field; raise ValueError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"machine field {path!r} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"machine field {path!r} must be finite, got {value!r}")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"machine field {path!r} must be {bound}, got {value!r}")
    if integer:
        if int(value) != value:
            raise ValueError(f"machine field {path!r} must be an integer, got {value!r}")
        return int(value)
    return value


def _require(d: Mapping, key: str, prefix: str = ""):
    if not isinstance(d, Mapping):
        raise ValueError(f"machine field {prefix.rstrip('.') or 'machine'!r} must be an "
                         f"object, got {type(d).__name__}")
    if key not in d:
        raise ValueError(f"machine field {prefix + key!r} is missing")
    return d[key]


def _no_extra(d: Mapping, allowed, prefix: str = ""):
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise ValueError(f"unknown machine field(s) {', '.join(repr(prefix + e) for e in extra)}"
                         f"; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class Link:
    """One network link with a small-message and a large-message regime, and
    optionally a third regime for very large messages.

    Parameters
    ----------
    alpha_small, alpha_large : float
        Latency per message, seconds, for ``nbytes < eager_threshold`` and above.
    beta_small, beta_large : float
        Inverse bandwidth, seconds/byte, in the same two regimes.
    eager_threshold : int
        Bytes at which the large-message regime starts (MPICH ch4 shared memory:
        8 KiB, its eager cell and the start of the CMA single-copy protocol).
    huge_threshold : int or None
        Bytes at which the third regime starts (None: no third regime). On Linux
        hosts NumPy backs arrays of 4 MiB and more with transparent huge pages,
        which a single-copy ``process_vm_readv`` moves measurably faster.
    alpha_huge, beta_huge : float
        Latency and inverse bandwidth of the third regime.
    """

    alpha_small: float
    beta_small: float
    alpha_large: float
    beta_large: float
    eager_threshold: int
    huge_threshold: int | None = None
    alpha_huge: float = 0.0
    beta_huge: float = 0.0

    _FIELDS = ("alpha_small", "beta_small", "alpha_large", "beta_large", "eager_threshold")
    _HUGE = ("huge_threshold", "alpha_huge", "beta_huge")

    def __post_init__(self):
        for f in self._FIELDS + self._HUGE[1:]:
            _number(f, getattr(self, f), integer=(f == "eager_threshold"))
        if self.huge_threshold is not None:
            _number("huge_threshold", self.huge_threshold, integer=True)
            if self.huge_threshold <= self.eager_threshold:
                raise ValueError(f"huge_threshold ({self.huge_threshold}) must be above "
                                 f"eager_threshold ({self.eager_threshold})")

    def _huge(self, nbytes: float) -> bool:
        return self.huge_threshold is not None and nbytes >= self.huge_threshold

    def alpha(self, nbytes: float) -> float:
        """Latency (seconds) of one message of ``nbytes`` bytes."""
        if nbytes < self.eager_threshold:
            return self.alpha_small
        return self.alpha_huge if self._huge(nbytes) else self.alpha_large

    def beta(self, nbytes: float) -> float:
        """Inverse bandwidth (seconds/byte) for a message of ``nbytes`` bytes."""
        if nbytes < self.eager_threshold:
            return self.beta_small
        return self.beta_huge if self._huge(nbytes) else self.beta_large

    def time(self, nbytes: float) -> float:
        """Point-to-point time ``alpha + beta * nbytes`` (seconds) of one message."""
        return self.alpha(nbytes) + self.beta(nbytes) * nbytes

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self._FIELDS}
        if self.huge_threshold is not None:
            d.update({f: getattr(self, f) for f in self._HUGE})
        return d

    @classmethod
    def from_dict(cls, d: Mapping, prefix: str = "intra.") -> "Link":
        """Build from a dict; ValueError names a missing, extra or negative field.
        The three ``huge`` fields are optional, but all or none."""
        vals = {}
        for f in cls._FIELDS:
            vals[f] = _number(prefix + f, _require(d, f, prefix),
                              integer=(f == "eager_threshold"))
        present = [f for f in cls._HUGE if f in d]
        if present and len(present) != len(cls._HUGE):
            raise ValueError(f"machine link {prefix.rstrip('.')!r}: give all of "
                             f"{', '.join(cls._HUGE)} or none, got {', '.join(present)}")
        for f in present:
            vals[f] = _number(prefix + f, d[f], integer=(f == "huge_threshold"))
        _no_extra(d, cls._FIELDS + cls._HUGE, prefix)
        return cls(**vals)


@dataclass(frozen=True)
class SharedCore:
    """How ranks behave when more of them share a node than it has cores.

    With ``R = ranks_per_node / cores > 1`` a rank's time is (see
    :mod:`~summasim.costmodel.workload.pricer`)::

        R * (work_factor * W + hops * hop_seconds + mpi_hops * mpi_hop_seconds
             + hop_bytes * hop_seconds_per_byte
             + mpi_hop_bytes * mpi_hop_seconds_per_byte + sync_seconds)

    where W is the rank's CPU work (GEMMs, additions, the copies its receives need,
    ``call_seconds`` per communication call). Every term is per unit of R: the p
    ranks time-share the cores, so the work of all of them is done at ``cores``
    ranks' speed (``work_factor`` - 1 is what waiting ranks cost: each polls MPI
    every 20 us and the wakeups take the cores from the ranks that compute), and a
    message on the critical path waits for its receiver to be scheduled and does its
    copy at 1/R speed.

    Two kinds of wait are told apart, because they cost differently: ``hops`` are
    messages completed by summasim's wait policy (``MPI_Test`` and a sleep of 20 us
    that Linux stretches to 60-80 us, so most hops cost at least one nap), and
    ``mpi_hops`` are messages whose rank waited without sleeping: a ring step
    or a ``Comm.sendrecv`` below its limit (``Comm.exchanger``: the receive polled
    with ``sched_yield``; older runs: a blocking ``MPI_Sendrecv``); trace events with
    ``blocking`` set. The bytes of the two kinds are priced apart too, and a ring
    step's price covers its copies (:meth:`charged_work`): with one price for both,
    fitted mostly on products, the ring's byte cost came from the 2-rank link fit
    times the products' work factor, and its prediction at p = 16 moved by a factor
    of 2-3 between two calibrations of the same day (docs/performance.md).
    Fitted by the accuracy benchmark on runs at 1.5 to 4 ranks per core.

    Parameters
    ----------
    work_factor : float
        Multiplies the CPU work (>= 0; 1 = perfect time sharing).
    hop_seconds : float
        Seconds per polled message on the critical path, per unit of R.
    hop_seconds_per_byte : float
        Seconds per byte carried on the critical path, per unit of R.
    sync_seconds : float
        Seconds per call (start and end synchronization), per unit of R.
    mpi_hop_seconds : float or None
        Seconds per message on the critical path whose wait is inside MPI, per unit of
        R; None (machine files from before the distinction) prices such a message as a
        polled one (``hop_seconds``).
    mpi_hop_seconds_per_byte : float or None
        Seconds per byte carried by such messages, per unit of R; None (machine files
        from before the distinction) prices their bytes like a polled hop's
        (``hop_seconds_per_byte``).
    """

    work_factor: float = 1.0
    hop_seconds: float = 0.0
    hop_seconds_per_byte: float = 0.0
    sync_seconds: float = 0.0
    mpi_hop_seconds: float | None = None
    mpi_hop_seconds_per_byte: float | None = None

    _FIELDS = ("work_factor", "hop_seconds", "hop_seconds_per_byte", "sync_seconds")
    _OPTIONAL = ("mpi_hop_seconds", "mpi_hop_seconds_per_byte")

    def __post_init__(self):
        for f in self._FIELDS:
            _number("shared_core." + f, getattr(self, f))
        for f in self._OPTIONAL:
            if getattr(self, f) is not None:
                _number("shared_core." + f, getattr(self, f))

    @property
    def blocking_hop_seconds(self) -> float:
        """Seconds per unit of R of a hop that waits inside MPI (``mpi_hop_seconds``,
        or ``hop_seconds`` when the machine does not tell the two apart)."""
        return self.hop_seconds if self.mpi_hop_seconds is None else self.mpi_hop_seconds

    @property
    def blocking_seconds_per_byte(self) -> float:
        """Seconds per byte and unit of R of a hop that waits inside MPI
        (``mpi_hop_seconds_per_byte``, or ``hop_seconds_per_byte`` when the machine
        does not tell the two apart)."""
        return (self.hop_seconds_per_byte if self.mpi_hop_seconds_per_byte is None
                else self.mpi_hop_seconds_per_byte)

    def charged_work(self, work: float, blocking_copy: float) -> float:
        """The CPU work that ``work_factor`` multiplies: all of ``work`` for a machine
        without ``mpi_hop_seconds_per_byte``; without ``blocking_copy`` (the link copies
        of the hops that wait inside MPI, within ``work``) for one that has it, whose
        byte price covers those copies as measured on the crowded node."""
        return work if self.mpi_hop_seconds_per_byte is None else work - blocking_copy

    def unit_seconds(self, work: float, hops: float, hop_bytes: float, mpi_hops: float,
                     mpi_hop_bytes: float, mpi_copy: float) -> float:
        """The class formula per unit of R, without ``sync_seconds`` (paid once per
        run, not per operation): the one place it is written, for a whole rank
        (:func:`~summasim.costmodel.workload.pricer.shared_core_time`) and per operation."""
        return (self.work_factor * self.charged_work(work, mpi_copy)
                + hops * self.hop_seconds + mpi_hops * self.blocking_hop_seconds
                + hop_bytes * self.hop_seconds_per_byte
                + mpi_hop_bytes * self.blocking_seconds_per_byte)

    def to_dict(self) -> dict:
        out = {f: getattr(self, f) for f in self._FIELDS}
        for f in self._OPTIONAL:
            if getattr(self, f) is not None:
                out[f] = getattr(self, f)
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> "SharedCore":
        vals = {f: _number("shared_core." + f, _require(d, f, "shared_core."))
                for f in cls._FIELDS}
        for f in cls._OPTIONAL:
            if d.get(f) is not None:
                vals[f] = _number("shared_core." + f, d[f])
        _no_extra(d, cls._FIELDS + cls._OPTIONAL, "shared_core.")
        return cls(**vals)
