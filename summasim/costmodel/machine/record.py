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
import math
import os
from dataclasses import dataclass, field
from typing import Mapping

from ...cli import REPORT_FIELD, read_json_file
from ...jsonio import write_report
from ..compute.roofline import Device
from .link import DTYPE_SIZES, Link, SharedCore, _dtype_name, _no_extra, _number, _require
from .topology import Topology

FORMAT = "summasim.machine/1"
#: Collective libraries a machine can name: MPICH's algorithms (this VM, any MPI
#: cluster) or NCCL's (GPU clusters; needs a topology).
LIBRARIES = ("mpich", "nccl")


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


def _notes(notes) -> dict:
    """Validate ``notes`` (None or an object of free text); return it as a dict."""
    if notes is None:
        return {}
    if not isinstance(notes, Mapping):
        raise ValueError(f"machine field 'notes' must be an object or null, got "
                         f"{type(notes).__name__}")
    return dict(notes)


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
        :func:`summasim.costmodel.workload.step.step_cost`.
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
        on ``intra``/``inter``; "nccl" uses :mod:`~summasim.costmodel.collectives.nccl` on the
        links of ``topology`` (required then).
    topology : Topology or None
        Nodes, devices per node, intra-node links, NICs
        (:class:`~summasim.costmodel.machine.topology.Topology`); None: the two-link model
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
        Roofline parameters of one device (:class:`~summasim.costmodel.compute.roofline.Device`):
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
        if self.device is not None and self.memory_bytes > 0 \
                and self.device.reserve_bytes >= self.memory_bytes:
            raise ValueError(f"machine field 'device.reserve_bytes' ({self.device.reserve_bytes:g}"
                             f") must be below 'memory_bytes' ({self.memory_bytes:g}): the "
                             f"reserve would leave a training step no memory")
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
            "library", "topology", "device", "memory_bandwidth", "cache_bytes", REPORT_FIELD)

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
        if d.get(REPORT_FIELD, "machine") != "machine":
            raise ValueError(f"this is a summasim {d[REPORT_FIELD]!r} report, not a machine "
                             f"(write one with `python -m summasim.costmodel fit`)")
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
                   notes=_notes(d.get("notes")),
                   fit_conditions=_fit_conditions(d.get("fit_conditions")),
                   library=d.get("library", "mpich"),
                   topology=(None if d.get("topology") is None
                             else Topology.from_dict(d["topology"])),
                   device=None if d.get("device") is None else Device.from_dict(d["device"]),
                   **host)

    def save(self, path, prog: str | None = None) -> bool:
        """Write JSON atomically (temp file in the same folder, then ``os.replace``),
        tagged as a ``machine`` report; a failed write is saved elsewhere and said
        (:func:`summasim.jsonio.write_report`, whose ``prog`` this passes on)."""
        return write_report(path, "machine", self.to_dict(), prog=prog)

    @classmethod
    def load(cls, path) -> "Machine":
        """Read a machine JSON file the user named (:func:`summasim.cli.read_json_file`:
        regular files only, bounded size and nesting, strict JSON; a
        :class:`~summasim.cli.UsageError` naming the file otherwise), then validate it
        (:meth:`from_dict`, whose ``ValueError`` is prefixed with the path)."""
        d = read_json_file(path)
        try:
            return cls.from_dict(d)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)}: {exc}") from None
