"""Machine: the alpha-beta-gamma parameters of one machine, with JSON presets.

Symbols and units (the papers' symbols; every time is in seconds)
------------------------------------------------------------------
``alpha``         latency of one message, seconds/message
``beta``          inverse bandwidth, seconds/byte (the Optimus paper's beta is per
                  scalar: multiply ours by the item size in bytes to compare)
``gamma``         local GEMM time, seconds/flop (one multiply-add = 2 flops)
``gamma_reduce``  local reduction (NumPy ``a += b``) time, seconds/byte of one operand:
                  summasim's own reductions (the tree reduce of ``Comm.reduce``, the
                  ring all-reduce's ``+=``)
``gamma_reduce_mpi``  the same inside MPI's reductions (``MPI_Allreduce``, and
                  ``MPI_Reduce`` when ``SUMMASIM_REDUCE=mpi``); defaults to
                  ``gamma_reduce`` (MPICH's loops ran 3.5x slower per byte here)

Messages are in two regimes, split at ``eager_threshold`` bytes: small messages
(``nbytes < eager_threshold``) go eagerly through preallocated cells, large ones
through a rendezvous / single-copy protocol with different alpha and beta. With
MPICH's ch4 shared-memory transport the split is the iqueue cell size
``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE`` (8192 bytes in the ``mpich`` 5.0.2
wheel, see ``mpivars``), where the CMA single-copy path also starts
(``MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD`` = 8192).

A :class:`Link` holds one pair of regimes. A :class:`Machine` has an ``intra``
link (inside a node) and optionally an ``inter`` link (between nodes; ``None``
means the same as ``intra``).

GEMM efficiency depends on the block size, so ``gamma`` is a small table per dtype
of ``(n, seconds_per_flop)`` points, interpolated linearly in log(n)-log(gamma)
and clamped at the ends; a GEMM of shape (m, k, n) uses the size
``(m k n) ** (1/3)``.

Shared cores
------------
With more ranks on a node than compute units (``cores``: CPU cores, or GPUs), the
ranks time-share them. The model scales every local time by
``slowdown = max(1, ranks_per_node / cores)``: compute always, and communication
too when ``shared_comm`` is true (shared-memory MPI moves bytes with CPU copies,
and a rank waiting in MPI spins on a core that another rank needs; MPICH polls
``MPIR_CVAR_POLLS_BEFORE_YIELD`` = 1000 times before it yields). This is the
simplest model that conserves core-seconds; it does not capture who waits for whom.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

from ..jsonio import write_json_atomic
from .roofline import Device
from .topology import Topology

FORMAT = "summasim.machine/1"
#: Collective libraries a machine can name: MPICH's algorithms (this VM, any MPI
#: cluster) or NCCL's (GPU clusters; needs a topology).
LIBRARIES = ("mpich", "nccl")

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
    :mod:`~summasim.costmodel.predict`)::

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
        (:func:`~summasim.costmodel.predict.shared_core_time`) and per operation."""
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


def _gamma_table(table: Mapping, path: str = "gamma_gemm") -> dict:
    """Validate ``{dtype: [[n, seconds_per_flop], ...]}``; return it with tuples."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"machine field {path!r} must be a non-empty object "
                         f"{{dtype: [[n, seconds_per_flop], ...]}}")
    out = {}
    for dt, pts in table.items():
        if dt not in DTYPE_SIZES:
            raise ValueError(f"machine field {path + '.' + str(dt)!r}: unknown dtype; "
                             f"known: {', '.join(DTYPE_SIZES)}")
        if not isinstance(pts, (list, tuple)) or not pts:
            raise ValueError(f"machine field {path + '.' + dt!r} must be a non-empty list "
                             f"of [n, seconds_per_flop] pairs")
        clean = []
        for idx, pt in enumerate(pts):
            if not isinstance(pt, (list, tuple)) or len(pt) != 2:
                raise ValueError(f"machine field {path}.{dt}[{idx}] must be a pair "
                                 f"[n, seconds_per_flop], got {pt!r}")
            n = _number(f"{path}.{dt}[{idx}].n", pt[0], positive=True)
            g = _number(f"{path}.{dt}[{idx}].gamma", pt[1], positive=True)
            clean.append((n, g))
        sizes = [n for n, _ in clean]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"machine field {path + '.' + dt!r}: block sizes must be "
                             f"strictly increasing, got {sizes}")
        out[dt] = tuple(clean)
    return out


_CONDITION_NUMBERS = ("foreign_cpu_before", "foreign_cpu_after", "loadavg", "limit")


def _fit_conditions(fc):
    """Validate ``fit_conditions`` (None or an object whose ``busy`` is a bool and
    whose load figures are numbers >= 0); return it as a plain dict, or None."""
    if fc is None:
        return None
    if not isinstance(fc, Mapping):
        raise ValueError(f"machine field 'fit_conditions' must be an object or null, "
                         f"got {type(fc).__name__}")
    if "busy" in fc and not isinstance(fc["busy"], bool):
        raise ValueError(f"machine field 'fit_conditions.busy' must be true or false, "
                         f"got {fc['busy']!r}")
    for key in _CONDITION_NUMBERS:
        if fc.get(key) is not None:
            _number("fit_conditions." + key, fc[key])
    return dict(fc)


@dataclass(frozen=True)
class Machine:
    """Alpha-beta-gamma parameters of a machine (all times in seconds).

    Parameters
    ----------
    name : str
        Short name ("local-2core-mpich", "h100-dgx-ndr", ...).
    source : str
        Where the numbers come from: a datasheet, a fit command and date.
    cores : int
        Compute units per node that ranks share: CPU cores, or GPUs.
    intra : Link
        Alpha/beta regimes inside a node.
    gamma_gemm : dict
        ``{dtype: ((n, seconds_per_flop), ...)}``, increasing n.
    gamma_reduce : float
        Seconds per byte of one operand of a NumPy ``a += b`` (summasim's reductions).
    inter : Link or None
        Alpha/beta between nodes; ``None`` means the same as ``intra``.
    node_size : int or None
        Ranks placed per node; ``None``: every rank on one node (as on this VM).
    memory_bytes : float
        Memory per rank (device memory per GPU, or node memory / ranks), bytes;
        0 when unknown. The default budget of the largest-batch solver.
    shared_comm : bool
        Whether communication also needs the cores (CPU shared-memory MPI), so it
        slows down under oversubscription like compute does.
    gamma_reduce_mpi : float or None
        Seconds per byte of a reduction inside MPI; None means ``gamma_reduce``.
    call_seconds : float
        CPU seconds of one communication call on top of its messages (Python,
        request bookkeeping, the wait loop); counted in the shared-core model.
    gamma_elementwise : float
        Seconds per activation item of one transformer layer's elementwise work
        (LayerNorm, GELU, softmax, residuals; forward + backward), see
        :func:`summasim.costmodel.schemes.step_cost`.
    layer_seconds : float
        Fixed seconds per transformer layer of a training step (forward + backward:
        the NumPy and Python call overheads that do not shrink with the arrays).
    shared_core : SharedCore or None
        The oversubscription model; None: the plain ``slowdown`` factor.
    notes : dict
        Free-form provenance: date, command, measured points, caveats.
    library : {"mpich", "nccl"}
        The collective library whose algorithms price the messages. "mpich" (the
        default) is the alpha-beta model of :mod:`~summasim.costmodel.collectives`
        on ``intra``/``inter``; "nccl" uses :mod:`~summasim.costmodel.nccl` on the
        links of ``topology`` (required then).
    topology : Topology or None
        Nodes, devices per node, intra-node links, NICs
        (:class:`~summasim.costmodel.topology.Topology`); None: the two-link model
        (``intra``, ``inter``, ``node_size``).
    memory_bandwidth : float or None
        Bytes per second that all of a node's cores move through host memory at once
        (a STREAM-like add over arrays far larger than the caches, every core busy),
        measured, never taken from a datasheet for a shared VM: on this project's VM it
        changes from launch to launch (docs/performance.md). With it, a prediction is
        never below the node's memory floor (:meth:`memory_floor`): the bytes its
        ranks' copies and additions stream, over this bandwidth. None: no floor (nor
        on an NCCL machine: its collectives do not use host memory).
    cache_bytes : float or None
        The node's last-level cache, bytes (all its instances; from Linux's sysfs).
        With it, the memory floor leaves out runs whose ranks' data fits in it
        together (they stream from the cache); None: every run outgrows it.
    device : Device or None
        Roofline parameters of one device (:class:`~summasim.costmodel.roofline.Device`):
        with one, a training step prices every non-GEMM kernel as max(flops / peak,
        bytes / memory bandwidth) plus a launch, instead of ``gamma_elementwise``.
    fit_conditions : dict or None
        How busy the machine was while it was measured (None: not recorded, as in
        the presets): ``foreign_cpu_before`` / ``foreign_cpu_after`` (cores' worth of
        CPU used by other processes just before and after the fit), ``loadavg``,
        ``time`` (UTC), ``limit`` (the foreign load counted as busy) and ``busy``
        (bool: the numbers include other work's time and should be refitted on a
        quiet machine). See :func:`sanity_problems` for what a fit must satisfy.
    """

    name: str
    source: str
    cores: int
    intra: Link
    gamma_gemm: dict
    gamma_reduce: float
    inter: Link | None = None
    node_size: int | None = None
    memory_bytes: float = 0.0
    shared_comm: bool = True
    gamma_reduce_mpi: float | None = None
    call_seconds: float = 0.0
    gamma_elementwise: float = 0.0
    layer_seconds: float = 0.0
    shared_core: SharedCore | None = None
    notes: dict = field(default_factory=dict)
    fit_conditions: dict | None = None
    library: str = "mpich"
    topology: Topology | None = None
    device: Device | None = None
    memory_bandwidth: float | None = None
    cache_bytes: float | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("machine field 'name' must be a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError("machine field 'source' must be a string")
        _number("cores", self.cores, integer=True, positive=True)
        _number("gamma_reduce", self.gamma_reduce)
        if self.gamma_reduce_mpi is None:
            object.__setattr__(self, "gamma_reduce_mpi", self.gamma_reduce)
        _number("gamma_reduce_mpi", self.gamma_reduce_mpi)
        _number("call_seconds", self.call_seconds)
        _number("gamma_elementwise", self.gamma_elementwise)
        _number("layer_seconds", self.layer_seconds)
        if self.shared_core is not None and not isinstance(self.shared_core, SharedCore):
            raise ValueError("machine field 'shared_core' must be a SharedCore or None")
        _number("memory_bytes", self.memory_bytes)
        for f in ("memory_bandwidth", "cache_bytes"):
            if getattr(self, f) is not None:
                _number(f, getattr(self, f), positive=True)
        if self.node_size is not None:
            _number("node_size", self.node_size, integer=True, positive=True)
        if not isinstance(self.intra, Link):
            raise ValueError("machine field 'intra' must be a Link")
        if self.inter is not None and not isinstance(self.inter, Link):
            raise ValueError("machine field 'inter' must be a Link or None")
        if not isinstance(self.shared_comm, bool):
            raise ValueError("machine field 'shared_comm' must be true or false")
        if not isinstance(self.notes, dict):
            raise ValueError("machine field 'notes' must be an object")
        _fit_conditions(self.fit_conditions)
        object.__setattr__(self, "gamma_gemm", _gamma_table(self.gamma_gemm))
        if self.library not in LIBRARIES:
            raise ValueError(f"machine field 'library' must be one of {', '.join(LIBRARIES)}, "
                             f"got {self.library!r}")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise ValueError("machine field 'topology' must be a Topology or None")
        if self.device is not None and not isinstance(self.device, Device):
            raise ValueError("machine field 'device' must be a Device or None")
        if self.library == "nccl" and self.topology is None:
            raise ValueError("machine field 'topology' is missing: library 'nccl' prices "
                             "collectives on the topology's links")
        if self.topology is not None and self.node_size is not None \
                and self.node_size != self.topology.devices_per_node:
            raise ValueError(f"machine: node_size {self.node_size} differs from "
                             f"topology.devices_per_node {self.topology.devices_per_node}")

    # -- construction ----------------------------------------------------------
    @classmethod
    def simple(cls, alpha: float = 0.0, beta: float = 1e-9, gamma: float = 1e-11, *,
               gamma_reduce: float = 0.0, gamma_reduce_mpi: float | None = None,
               cores: int = 1 << 30, name: str = "simple", source: str = "synthetic",
               dtypes=("float64", "float32", "bfloat16", "float16")) -> "Machine":
        """A machine with one regime, one link and a size-independent gamma.

        Useful for the papers' assumptions (e.g. ``alpha=0``) and for tests;
        ``cores`` defaults to "never oversubscribed".
        """
        link = Link(alpha, beta, alpha, beta, 0)
        table = {dt: ((1.0, gamma),) for dt in dtypes}
        return cls(name=name, source=source, cores=cores, intra=link, gamma_gemm=table,
                   gamma_reduce=gamma_reduce, gamma_reduce_mpi=gamma_reduce_mpi)

    def replace(self, **changes) -> "Machine":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- model -----------------------------------------------------------------
    def link(self, inter: bool = False) -> Link:
        """The inter-node link when ``inter`` and one exists, else the intra-node link."""
        return self.inter if (inter and self.inter is not None) else self.intra

    def ranks_per_node(self, p: int) -> int:
        """Ranks sharing one node when ``p`` ranks run (``node_size`` caps it)."""
        return p if self.node_size is None else min(p, self.node_size)

    def slowdown(self, ranks_per_node: int) -> float:
        """``max(1, ranks_per_node / cores)``: the time-sharing factor (see module doc)."""
        return max(1.0, ranks_per_node / self.cores)

    def memory_floor(self, ranks_per_node: int, traffic_bytes: float,
                     working_set: float | None = None) -> float:
        """Seconds the node's memory needs to stream ``traffic_bytes`` for each of its
        ``ranks_per_node`` ranks (a roofline's memory bound: the ranks of a node share
        one memory, so their streams add up); 0 without ``memory_bandwidth``, on an
        NCCL machine (its messages and additions stay in device memory), and when the
        ranks' data (``working_set`` bytes each; None: unknown, taken as too large)
        fits in the node's ``cache_bytes`` together."""
        if self.memory_bandwidth is None or traffic_bytes <= 0 or self.library == "nccl":
            return 0.0
        if self.fits_cache(ranks_per_node, working_set):
            return 0.0
        return ranks_per_node * traffic_bytes / self.memory_bandwidth

    def fits_cache(self, ranks_per_node: int, working_set: float | None) -> bool:
        """Whether ``ranks_per_node`` ranks' data of ``working_set`` bytes each fits in
        the node's ``cache_bytes`` together (False when either is unknown)."""
        return (self.cache_bytes is not None and working_set is not None
                and ranks_per_node * working_set <= self.cache_bytes)

    def gamma(self, n: float, dtype="float64") -> float:
        """Seconds per flop of a local GEMM of block size ``n`` in ``dtype``.

        Log-log interpolation in the ``gamma_gemm`` table, clamped at its ends.
        A dtype missing from the table raises ValueError naming the known ones.
        """
        name = _dtype_name(dtype)
        if name not in self.gamma_gemm:
            raise ValueError(f"machine {self.name!r} has no gamma for dtype {name!r}; "
                             f"it has {', '.join(self.gamma_gemm)}")
        pts = self.gamma_gemm[name]
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        if n >= pts[-1][0]:
            return pts[-1][1]
        for (n0, g0), (n1, g1) in zip(pts, pts[1:]):
            if n0 <= n <= n1:
                t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return math.exp(math.log(g0) + t * (math.log(g1) - math.log(g0)))
        return pts[-1][1]  # pragma: no cover - unreachable for increasing sizes

    def gemm_time(self, m: float, k: float, n: float, dtype="float64") -> float:
        """Seconds of one local GEMM ``[m, k] @ [k, n]``: ``2 m k n gamma((m k n)^(1/3))``.

        No oversubscription factor (apply :meth:`slowdown` on top).
        """
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0
        size = (m * k * n) ** (1.0 / 3.0)
        return 2.0 * m * k * n * self.gamma(size, dtype)

    def peak_flops(self, dtype="float64") -> float:
        """Best flop/s in the gamma table for ``dtype``."""
        return 1.0 / min(g for _, g in self.gamma_gemm[_dtype_name(dtype)])

    @property
    def fitted_busy(self) -> bool:
        """True when ``fit_conditions`` says the machine was busy during the fit."""
        return bool(self.fit_conditions and self.fit_conditions.get("busy"))

    # -- JSON ------------------------------------------------------------------
    _TOP = ("format", "name", "source", "cores", "node_size", "memory_bytes", "shared_comm",
            "intra", "inter", "gamma_gemm", "gamma_reduce", "gamma_reduce_mpi", "call_seconds",
            "gamma_elementwise", "layer_seconds", "shared_core", "notes", "fit_conditions",
            "library", "topology", "device", "memory_bandwidth", "cache_bytes")

    def to_dict(self) -> dict:
        """A JSON-ready dict; :meth:`from_dict` of it gives back an equal Machine.
        ``fit_conditions`` is written only when recorded (files without it load)."""
        d = {
            "format": FORMAT,
            "name": self.name,
            "source": self.source,
            "cores": self.cores,
            "node_size": self.node_size,
            "memory_bytes": self.memory_bytes,
            "shared_comm": self.shared_comm,
            "intra": self.intra.to_dict(),
            "inter": None if self.inter is None else self.inter.to_dict(),
            "gamma_gemm": {dt: [list(pt) for pt in pts] for dt, pts in self.gamma_gemm.items()},
            "gamma_reduce": self.gamma_reduce,
            "gamma_reduce_mpi": self.gamma_reduce_mpi,
            "call_seconds": self.call_seconds,
            "gamma_elementwise": self.gamma_elementwise,
            "layer_seconds": self.layer_seconds,
            "shared_core": None if self.shared_core is None else self.shared_core.to_dict(),
            "notes": self.notes,
        }
        if self.fit_conditions is not None:
            d["fit_conditions"] = self.fit_conditions
        for f in ("memory_bandwidth", "cache_bytes"):
            if getattr(self, f) is not None:
                d[f] = getattr(self, f)
        d["library"] = self.library
        if self.topology is not None or self.device is not None:
            d["topology"] = None if self.topology is None else self.topology.to_dict()
            d["device"] = None if self.device is None else self.device.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Machine":
        """Validate and build. Raises ValueError naming any missing, unknown,
        non-numeric or negative field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a machine must be a JSON object, got {type(d).__name__}")
        fmt = d.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"machine field 'format' is {fmt!r}; expected {FORMAT!r}")
        _no_extra(d, cls._TOP)
        name = _require(d, "name")
        source = _require(d, "source")
        cores = _number("cores", _require(d, "cores"), integer=True, positive=True)
        intra = Link.from_dict(_require(d, "intra"), "intra.")
        inter_d = d.get("inter")
        inter = None if inter_d is None else Link.from_dict(inter_d, "inter.")
        gamma_gemm = _gamma_table(_require(d, "gamma_gemm"))
        gamma_reduce = _number("gamma_reduce", _require(d, "gamma_reduce"))
        gamma_reduce_mpi = d.get("gamma_reduce_mpi")
        if gamma_reduce_mpi is not None:
            gamma_reduce_mpi = _number("gamma_reduce_mpi", gamma_reduce_mpi)
        call_seconds = _number("call_seconds", d.get("call_seconds", 0.0))
        gamma_elementwise = _number("gamma_elementwise", d.get("gamma_elementwise", 0.0))
        layer_seconds = _number("layer_seconds", d.get("layer_seconds", 0.0))
        sc = d.get("shared_core")
        shared_core = None if sc is None else SharedCore.from_dict(sc)
        node_size = d.get("node_size")
        if node_size is not None:
            node_size = _number("node_size", node_size, integer=True, positive=True)
        memory = _number("memory_bytes", d.get("memory_bytes", 0.0))
        host = {f: (None if d.get(f) is None else _number(f, d[f], positive=True))
                for f in ("memory_bandwidth", "cache_bytes")}
        return cls(name=name, source=source, cores=cores, intra=intra, inter=inter,
                   gamma_gemm=gamma_gemm, gamma_reduce=gamma_reduce,
                   gamma_reduce_mpi=gamma_reduce_mpi, call_seconds=call_seconds,
                   gamma_elementwise=gamma_elementwise, layer_seconds=layer_seconds,
                   shared_core=shared_core,
                   node_size=node_size,
                   memory_bytes=memory, shared_comm=d.get("shared_comm", True),
                   notes=dict(d.get("notes") or {}),
                   fit_conditions=_fit_conditions(d.get("fit_conditions")),
                   library=d.get("library", "mpich"),
                   topology=(None if d.get("topology") is None
                             else Topology.from_dict(d["topology"])),
                   device=None if d.get("device") is None else Device.from_dict(d["device"]),
                   **host)

    def save(self, path) -> None:
        """Write JSON atomically (temp file in the same folder, then ``os.replace``)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path) -> "Machine":
        """Read a machine JSON file (see :meth:`from_dict` for validation)."""
        with open(path, encoding="utf-8") as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(d)


def _preset_dir():
    return resources.files("summasim.costmodel").joinpath("presets")


def list_presets() -> list[str]:
    """Names of the machine presets shipped with summasim."""
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Machine:
    """The shipped preset called ``name``; ValueError lists the known names."""
    names = list_presets()
    if name not in names:
        raise ValueError(f"unknown machine preset {name!r}; known presets: {', '.join(names)}")
    d = json.loads(_preset_dir().joinpath(name + ".json").read_text(encoding="utf-8"))
    return Machine.from_dict(d)


def get_machine(machine: Any = None, preset: str | None = None) -> Machine:
    """Resolve a Machine from an instance, a JSON path, or a preset name."""
    if isinstance(machine, Machine):
        return machine
    if machine is not None and preset is not None:
        raise ValueError("give a machine file or a preset name, not both")
    if machine is not None:
        return Machine.load(machine)
    return load_preset(preset or DEFAULT_PRESET)


def machine_from_args(machine: str | None, preset: str | None) -> Machine:
    """The machine of a command's ``--machine FILE`` or ``--preset NAME`` (the caller
    puts its default preset in ``preset``); a :class:`summasim.cli.UsageError` naming
    the argument when the file or preset cannot be read."""
    from ..cli import argument_error

    if machine is not None:
        try:
            return get_machine(machine)
        except (OSError, ValueError) as exc:
            raise argument_error("--machine", exc) from None
    try:
        return get_machine(None, preset)
    except ValueError as exc:
        raise argument_error("--preset", exc) from None


# --------------------------------------------------------------------------- sanity
#: Fastest link any machine summasim models can have, bytes/s per direction (NVLink 5
#: is 900 GB/s; shared memory on a CPU box copies at a few tens of GB/s).
MAX_LINK_BANDWIDTH = 1e12
#: Slowest believable link, bytes/s (1 MB/s: slower than any network since the 1980s).
MIN_LINK_BANDWIDTH = 1e6
#: Longest believable per-message latency, seconds.
MAX_ALPHA = 0.1
#: Fastest believable local reduction, bytes/s of one operand (HBM3e reads 8 TB/s).
MAX_REDUCE_BANDWIDTH = 1e13
#: Fastest believable GEMM per compute unit, flop/s (a B200 does 2.2 PFLOP/s dense fp16).
MAX_FLOPS = 1e16
#: Slowest believable GEMM per compute unit, flop/s.
MIN_FLOPS = 1e7
#: Largest median relative error of a fitted link regime on its own points
#: (``notes["fit"]``): quiet fits here miss by 0.2-5 %; one taken while other jobs
#: ran missed by 28 % (and had a 46 us latency, 34x the quiet one).
MAX_FIT_ERROR = 0.15
#: All ranks' GEMM may be at most this many times slower than one process alone
#: (``notes["gemm_single"]``): on the 2-core VM two ranks at once ran as fast as one
#: alone (ratio 0.93-1.00 at n = 256 and 1024, 2026-11-23); one core busy with other
#: work would make it about 1.5 (3 processes on 2 cores vs 2 on 2).
MAX_GEMM_SHARING = 1.5


def _bad(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) \
        or not math.isfinite(value)


def _link_problems(link: Link, tag: str) -> list[str]:
    """What is impossible in one link's reachable regimes."""
    out = []
    regimes = []
    if link.eager_threshold > 0:
        regimes.append(("small", link.alpha_small, link.beta_small))
    regimes.append(("large", link.alpha_large, link.beta_large))
    if link.huge_threshold is not None:
        regimes.append(("huge", link.alpha_huge, link.beta_huge))
    for name, alpha, beta in regimes:
        where = f"{tag} {name}-message regime"
        if _bad(alpha) or alpha <= 0:
            out.append(f"{where}: latency alpha = {alpha!r} s (must be finite and > 0: "
                       f"no message is free)")
        elif alpha > MAX_ALPHA:
            out.append(f"{where}: latency alpha = {alpha:.3g} s is above {MAX_ALPHA:g} s")
        if _bad(beta) or beta <= 0:
            out.append(f"{where}: beta = {beta!r} s/B, an infinite bandwidth (must be "
                       f"finite and > 0)")
        elif 1.0 / beta > MAX_LINK_BANDWIDTH:
            out.append(f"{where}: bandwidth {1 / beta / 1e9:.3g} GB/s is above the "
                       f"ceiling of {MAX_LINK_BANDWIDTH / 1e9:g} GB/s")
        elif 1.0 / beta < MIN_LINK_BANDWIDTH:
            out.append(f"{where}: bandwidth {1 / beta / 1e6:.3g} MB/s is below "
                       f"{MIN_LINK_BANDWIDTH / 1e6:g} MB/s")
    sizes = {1, max(1, link.eager_threshold - 1), link.eager_threshold, 1 << 26}
    if link.huge_threshold is not None:
        sizes |= {link.huge_threshold - 1, link.huge_threshold}
    for m in sorted(x for x in sizes if x >= 1):
        t = link.time(m)
        if _bad(t) or t <= 0:
            out.append(f"{tag}: a {m}-byte message costs {t!r} s (must be finite and > 0)")
    return out


def sanity_problems(machine) -> list[str]:
    """What is physically impossible or suspicious in a measured machine.

    A fit that hits a bound (``beta = 0``: infinite bandwidth) or was distorted by
    other work (GEMM much slower than one process alone) predicts nonsense that
    nothing downstream notices; check a fitted machine with this before using or
    saving it. Synthetic machines (``Machine.simple(alpha=0)``, the papers'
    assumptions) are allowed to fail it: they are not measurements.

    Parameters
    ----------
    machine : Machine or dict
        A Machine, or its JSON dict (a dict that :meth:`Machine.from_dict` refuses,
        e.g. a negative alpha, gives that refusal as its one problem).

    Returns
    -------
    list of str
        One line per problem; empty when the machine is plausible. Checked: every
        reachable link regime (intra and inter) has finite alpha in (0, ``MAX_ALPHA``]
        and a bandwidth 1/beta within [``MIN_LINK_BANDWIDTH``, ``MAX_LINK_BANDWIDTH``];
        messages cost a finite positive time; every GEMM rate is finite and within
        [``MIN_FLOPS``, ``MAX_FLOPS``]; reductions finite and not faster than
        ``MAX_REDUCE_BANDWIDTH``; the per-call, elementwise, per-layer and shared-core
        terms finite and >= 0 (shared-core work factor > 0); each fitted link regime
        within ``MAX_FIT_ERROR`` of its own points (``notes["fit"]``); and, when the
        fit recorded one process's GEMM alone (``notes["gemm_single"]``), all ranks' GEMM
        at that size is at most ``MAX_GEMM_SHARING`` times slower.
    """
    if not isinstance(machine, Machine):
        try:
            machine = Machine.from_dict(machine)
        except ValueError as exc:
            return [f"not a valid machine: {exc}"]
    m = machine
    out = []
    if _bad(m.cores) or m.cores < 1:
        out.append(f"cores = {m.cores!r} (must be a positive integer)")
    out += _link_problems(m.intra, "intra-node link")
    if m.inter is not None:
        out += _link_problems(m.inter, "inter-node link")
    for dt, pts in m.gamma_gemm.items():
        for n, g in pts:
            if _bad(g) or g <= 0:
                out.append(f"GEMM {dt} n={n:g}: gamma = {g!r} s/flop (must be finite, > 0)")
            elif not MIN_FLOPS <= 1.0 / g <= MAX_FLOPS:
                out.append(f"GEMM {dt} n={n:g}: {1 / g / 1e9:.4g} GFLOP/s per compute unit "
                           f"is outside [{MIN_FLOPS / 1e9:g}, {MAX_FLOPS / 1e9:g}] GFLOP/s")
    for name in ("gamma_reduce", "gamma_reduce_mpi"):
        g = getattr(m, name)
        if _bad(g) or g < 0:
            out.append(f"{name} = {g!r} s/B (must be finite and >= 0)")
        elif g > 0 and 1.0 / g > MAX_REDUCE_BANDWIDTH:
            out.append(f"{name}: {1 / g / 1e9:.4g} GB/s of reduction is above "
                       f"{MAX_REDUCE_BANDWIDTH / 1e9:g} GB/s")
    for name in ("call_seconds", "gamma_elementwise", "layer_seconds", "memory_bytes"):
        v = getattr(m, name)
        if _bad(v) or v < 0:
            out.append(f"{name} = {v!r} (must be finite and >= 0)")
    if m.shared_core is not None:
        for name in SharedCore._FIELDS + SharedCore._OPTIONAL:
            v = getattr(m.shared_core, name)
            if v is None and name in SharedCore._OPTIONAL:
                continue
            if _bad(v) or v < 0:
                out.append(f"shared_core.{name} = {v!r} (must be finite and >= 0)")
        wf = m.shared_core.work_factor
        if not _bad(wf) and wf <= 0:
            out.append("shared_core.work_factor = 0: oversubscribed work would be free")
    fitted = (m.notes or {}).get("fit")
    if isinstance(fitted, Mapping):
        for regime in ("small", "large", "huge"):
            row = fitted.get(regime)
            if isinstance(row, (list, tuple)) and len(row) == 3 and not _bad(row[2]) \
                    and row[2] > MAX_FIT_ERROR:
                out.append(f"the {regime}-message fit misses its own points by {row[2]:.0%} "
                           f"(median; at most {MAX_FIT_ERROR:.0%}): the timings were noisy")
    single = (m.notes or {}).get("gemm_single")
    if isinstance(single, Mapping):
        dt, n, g1 = single.get("dtype"), single.get("n"), single.get("seconds_per_flop")
        if dt in m.gamma_gemm and not _bad(n) and not _bad(g1) and g1 > 0 and n > 0:
            ratio = m.gamma(n, dt) / g1
            if ratio > MAX_GEMM_SHARING:
                out.append(f"GEMM {dt} n={n:g} with all ranks at once is {ratio:.2f}x slower "
                           f"than one process alone (at most {MAX_GEMM_SHARING:g}x when the "
                           f"ranks have the cores to themselves): other work shared them")
    return out


#: The preset used when none is named: this project's CPU VM.
DEFAULT_PRESET = "local-2core-mpich"
