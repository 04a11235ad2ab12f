"""Which cost-model Machine a run uses, and when a fitted one may be trusted and saved.

``resolve_machine(spec, world, say)`` returns a :class:`~summasim.costmodel.machine.Machine`
on every rank:

1. ``spec`` (``--machine FILE|PRESET``): that file or preset. A spec that is neither
   raises ValueError before any communication (:func:`check_machine_spec` does the same
   check at parse time). A file out of the physical bounds
   (:func:`~summasim.costmodel.machine.sanity.physical_problems`) is refused as it loads;
   one that fails only the fit's own checks
   (:func:`~summasim.costmodel.machine.sanity_problems`) is still used (it was asked
   for), with the problems printed.
2. ``results/accuracy/machine-calibrated.json`` (the accuracy benchmark's calibration),
   when it passes the sanity checks.
3. ``results/machine.json`` (an earlier quick fit), when it passes the sanity checks.
   One fitted while the machine was busy is used with a warning, or refitted when the
   machine is quiet now. One whose borrowed parts came from the preset as it was before
   (summasim recalibrated the preset since: :func:`preset_digest` differs) is refitted,
   so that a new preset is never hidden behind a saved copy of the old one.
4. Otherwise a quick fit on ranks 0 and 1 (the other ranks sleep), saved to
   ``results/machine.json``.

Trust rules for the fit (4):

- **One fit at a time.** Rank 0 holds an exclusive ``fcntl.flock`` on
  ``results/machine.json.lock`` from the moment it finds no usable file until the fit is
  saved. A second job started at the same time waits for the lock (its ranks asleep),
  then finds the first job's file and uses it: two fits competing for the same cores
  measure each other (this once saved an infinite small-message bandwidth and a 2x slow
  GEMM, and every later run reused it: prediction error 12.7 % -> 87 %).
- **Busy fits are marked.** Rank 0 measures the CPU used by processes outside this job
  (:func:`summasim.harness.load.foreign_cpu`, the job's own ranks excluded) just before
  the fit (the reading that decides to fit, handed to ``run_fit`` so that the fit warns
  from the same reading), in each phase of it and just after it
  (:func:`~summasim.harness.fitbench.run_fit`, which also holds the host's one fit lock);
  above :data:`~summasim.harness.load.BUSY_CORES` cores in any of them the fit is
  saved with ``fit_conditions["busy"] = True``, and every later run that uses it says so
  and how to refit (it refits by itself once the machine is quiet).
- **Impossible fits are refused.** A fit that ``sanity_problems`` refuses (zero latency,
  infinite bandwidth, GEMM far below one process alone, ...) is neither saved nor used:
  the run falls back to the preset :data:`FALLBACK_PRESET` and says why.

What comes from the preset (:func:`compose_with_preset`): the quick fit measures links,
GEMM and reductions in seconds; the run-level models (oversubscription, elementwise,
per-layer) need the accuracy benchmark's runs. On the machine the preset was calibrated on
(same core count and MPI library, link times within 25 %) the preset's links, reductions
and run-level models are used and only the GEMM rates (which change with the CPU model
behind the VM) are measured; on another machine the measured links are kept and only the
run-level models are borrowed. The run prints which parts come from where.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat

from ..costmodel.machine import (Machine, list_presets, load_machine, load_preset,
                                 sanity_problems)
from ..jsonio import ReportNotSaved
from . import load

DEFAULT_MACHINE_FILE = os.path.join("results", "machine.json")
CALIBRATED_MACHINE_FILE = os.path.join("results", "accuracy", "machine-calibrated.json")
#: The preset used when no fit can be trusted, and whose run-level models a fit borrows.
FALLBACK_PRESET = "local-2core-mpich"
#: GEMM block sizes of the quick fit.
QUICK_GEMM_SIZES = (128, 256, 512, 1024)
#: Ranks the quick fit runs on (no more than the cores: waiting ranks spin).
FIT_RANKS = 2
#: Seconds of each foreign-load reading around a fit.
LOAD_INTERVAL = 0.3
#: Longest wait for another job's fit (then: the preset, said so).
LOCK_WAIT = load.LOCK_WAIT
#: Largest relative difference of link times at which a fit "is" the preset's machine.
MATCH_TOLERANCE = 0.25

REFIT_HINT = ("delete {path} on a quiet machine to refit, or run `OMP_NUM_THREADS=1 mpiexec "
              "-n 2 python -m summasim.costmodel fit --out {path}`")


# --------------------------------------------------------------------------- spec
def check_machine_spec(spec) -> Machine | None:
    """The machine of ``spec`` (a ``--machine`` value): None for None, else the machine
    JSON file or preset it names (:func:`~summasim.costmodel.machine.load_machine`, THE
    resolver), loaded once. ``ValueError`` naming the problem otherwise. Pure: no MPI,
    nothing written."""
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--machine must be a file or a preset name, got {spec!r}")
    if os.path.isdir(spec):
        raise ValueError(f"--machine {spec!r} is a directory, not a machine JSON file")
    try:
        return load_machine(spec)
    except OSError as exc:
        if not os.path.exists(spec):
            raise ValueError(f"--machine {spec!r}: no such file, and not a preset "
                             f"({', '.join(list_presets())})") from None
        raise ValueError(f"--machine {spec!r}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        base = spec.split(":", 1)[0]       # a variant's errors name its key: keep them
        if not os.path.exists(spec) and base not in list_presets() \
                and not os.path.exists(base):
            raise ValueError(f"--machine {spec!r}: no such file, and not a preset "
                             f"({', '.join(list_presets())})") from None
        text = str(exc)                          # the reader's message starts with the path
        raise ValueError(f"--machine {text}" if text.startswith(spec)
                         else f"--machine {spec!r}: {text}") from None


def machine_misfit(machine: Machine | None, devices: int) -> str:
    """Why ``machine`` cannot price a job of ``devices`` ranks ("" when it can): a
    topology whose nodes have no NICs holds one node's devices at most. A preflight
    says it before any work (the pricing raises it only after)."""
    topo = getattr(machine, "topology", None)
    if topo is None or topo.nics_per_node > 0 or devices <= topo.devices_per_node:
        return ""
    return (f"--machine {machine.name}: its nodes have no NICs (topology.nics_per_node = "
            f"0), so it prices at most one node of {topo.devices_per_node} devices; the "
            f"job has {devices}: give the NICs (nics_per_node, nic_bandwidth) or "
            f"--no-predict")


def _busy_line(machine: Machine, path: str | None) -> str:
    """The warning of a fit made while the machine was busy: of the file at ``path``, or
    (None) of this run's fit, which was not saved."""
    fc = machine.fit_conditions or {}
    seen = max(fc.get("foreign_cpu_before") or 0.0, fc.get("foreign_cpu_after") or 0.0)
    what = path if path is not None else "this run's fit (not saved)"
    return (f"cost model: WARNING: {what} was fitted while the machine was busy (other "
            f"processes used {seen:.2f} cores at {fc.get('time', '?')}); its times include "
            f"their load." + (f" {REFIT_HINT.format(path=path)}" if path is not None else ""))


def _composed_line(machine: Machine) -> str:
    comp = (machine.notes or {}).get("composed")
    if not isinstance(comp, dict):
        return ""
    return (f"; from the preset {comp.get('preset')}: {', '.join(comp.get('from_preset', []))}"
            f"; measured: {', '.join(comp.get('measured', []))}")


def _explicit(spec: str, machine: Machine, say) -> Machine:
    say(f"cost model: machine {machine.name!r} from {spec}")
    problems = sanity_problems(machine)
    if problems:
        say(f"cost model: WARNING: {spec} looks implausible (used as asked): "
            + "; ".join(problems))
    if machine.fitted_busy:
        say(_busy_line(machine, spec))
    return machine


# --------------------------------------------------------------------------- waiting
def _sleep_barrier(world) -> None:
    """The others sleep (growing naps up to 20 ms) while rank 0 fits or waits."""
    from ..mpiutil import quiet_barrier

    quiet_barrier(world, longest=0.02)


#: The lock of a machine file (the same class as the host-wide lock every fit takes).
FitLock = load.FitLock


# --------------------------------------------------------------------------- preset parts
def borrow_run_models(machine: Machine, say, preset: str = FALLBACK_PRESET) -> Machine:
    """A quick fit measures links and GEMMs only: take the run-level models (the
    shared-core model of oversubscribed runs, elementwise and per-layer seconds of
    training steps) from ``preset`` when it was calibrated on a machine with the same
    core count, and say so."""
    ref = load_preset(preset)
    if machine.shared_core is not None or ref.shared_core is None or ref.cores != machine.cores:
        return machine
    say(f"cost model: oversubscription and elementwise models from the preset {preset} "
        f"(calibrated on {ref.cores} cores; `python -m summasim.costmodel accuracy` "
        f"calibrates this machine's own)")
    return machine.replace(shared_core=ref.shared_core, gamma_elementwise=ref.gamma_elementwise,
                           layer_seconds=ref.layer_seconds)


_LIBRARIES = (("MPICH", r"MPICH\D*?(\d+(?:\.\d+)+)"), ("Open MPI", r"Open MPI\D*?(\d+(?:\.\d+)+)"),
              ("Intel MPI", r"Intel\(R\) MPI Library\D*?(\d+(?:\.\d+)*)"))


def mpi_library(text: str) -> tuple[str, str] | None:
    """``(library, version)`` named in a machine's ``source`` (or an MPI library version
    string), e.g. ``("MPICH", "5.0.2")``; None when neither is recognisable."""
    for lib, pattern in _LIBRARIES:
        m = re.search(pattern, text or "")
        if m:
            return lib, m.group(1)
    return None


def preset_matches(fitted: Machine, ref: Machine,
                   tolerance: float = MATCH_TOLERANCE) -> tuple[bool, str]:
    """Whether ``fitted`` was measured on the machine ``ref`` was calibrated on: the
    same core count and MPI library, and link times within ``tolerance`` at 8 B .. 4 MiB.
    Returns ``(match, reason)``."""
    if fitted.cores != ref.cores:
        return False, f"{fitted.cores} cores, the preset {ref.cores}"
    lib, rlib = mpi_library(fitted.source), mpi_library(ref.source)
    if lib is None or lib != rlib:
        return False, f"MPI library {lib or 'unknown'}, the preset {rlib or 'unknown'}"
    for nbytes in (8, 1024, 65536, 1 << 20, 4 << 20):
        ratio = fitted.link().time(nbytes) / ref.link().time(nbytes)
        if abs(ratio - 1.0) > tolerance:
            return False, (f"a {nbytes}-byte message takes {ratio:.2f}x the preset's time "
                           f"(another CPU behind the VM)")
    return True, (f"same {ref.cores} cores and {' '.join(lib)}, link times within "
                  f"{tolerance:.0%} of the preset's")


def preset_digest(machine: Machine) -> str:
    """A short fingerprint of a preset's contents (recorded by :func:`compose_with_preset`,
    so that a saved fit knows which version of the preset it took parts from)."""
    text = json.dumps(machine.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stale_composition(machine: Machine) -> str | None:
    """Why a saved quick fit's preset parts are out of date, or None when they are not
    (or it took nothing from a preset). A fit composed before the preset was recalibrated
    (another digest), or by a summasim that did not record the digest, is stale."""
    comp = (machine.notes or {}).get("composed")
    if not isinstance(comp, dict) or not comp.get("from_preset"):
        return None
    name = comp.get("preset")
    if name not in list_presets():
        return f"it took parts from the preset {name!r}, which this summasim does not ship"
    if comp.get("preset_digest") != preset_digest(load_preset(name)):
        return (f"it took {', '.join(comp['from_preset'])} from an older version of the "
                f"preset {name}")
    return None


def stale_fit(machine: Machine) -> str | None:
    """Why a saved quick fit is out of date, or None: its preset parts are
    (:func:`stale_composition`), or it was made by a summasim that did not yet measure
    the node's memory bandwidth and cache (no ``memory_bandwidth`` and ``cache_bytes``
    notes), so its predictions would have no memory floor."""
    stale = stale_composition(machine)
    notes = machine.notes or {}
    if stale is None and not {"memory_bandwidth", "cache_bytes"} <= set(notes):
        stale = "it has no measurement of the node's memory bandwidth and cache"
    return stale


def _merge_gemm(measured: dict, ref: dict) -> dict:
    """The measured GEMM table, extended below and above its sizes with the reference
    table's points scaled by the measured/reference ratio at the nearest measured size
    (the shape of the curve from the full fit, the level from today's CPU)."""
    out = {}
    for dt in set(measured) | set(ref):
        pts = [tuple(p) for p in measured.get(dt, ())]
        rpts = [tuple(p) for p in ref.get(dt, ())]
        if not pts:  # a dtype only the reference has: scale it by float64's ratio
            base = measured.get("float64") or next(iter(measured.values()))
            n0 = base[0][0]
            r = base[0][1] / _interp(ref.get("float64", rpts), n0)
            out[dt] = tuple((n, g * r) for n, g in rpts)
            continue
        lo_n, hi_n = pts[0][0], pts[-1][0]
        if rpts:
            r_lo = pts[0][1] / _interp(rpts, lo_n)
            r_hi = pts[-1][1] / _interp(rpts, hi_n)
            pts = ([(n, g * r_lo) for n, g in rpts if n < lo_n] + pts
                   + [(n, g * r_hi) for n, g in rpts if n > hi_n])
        out[dt] = tuple(pts)
    return out


def _interp(pts, n) -> float:
    """Seconds per flop at size ``n`` in a ``((n, gamma), ...)`` table: log-log
    interpolation, clamped at the ends (as :meth:`Machine.gamma`)."""
    pts = sorted(pts)
    if n <= pts[0][0]:
        return pts[0][1]
    for (n0, g0), (n1, g1) in zip(pts, pts[1:]):
        if n <= n1:
            t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(g0) + t * (math.log(g1) - math.log(g0)))
    return pts[-1][1]


def compose_with_preset(fitted: Machine, say, preset: str = FALLBACK_PRESET,
                        tolerance: float = MATCH_TOLERANCE) -> Machine:
    """The machine a quick fit stands for, with what it cannot measure from ``preset``.

    On the preset's own machine (:func:`preset_matches`) the calibrated preset's links,
    reductions, per-call, elementwise and oversubscription models are used with the
    GEMM rates just measured; elsewhere the measured links, GEMM and reductions are kept
    and only the run-level models are borrowed (:func:`borrow_run_models`). Says which
    parts come from where and records it in ``notes["composed"]``.
    """
    ref = load_preset(preset)
    digest = preset_digest(ref)
    same, why = preset_matches(fitted, ref, tolerance)
    bandwidth = (["memory bandwidth"] if fitted.memory_bandwidth is not None else []) + \
        (["cache"] if fitted.cache_bytes is not None else [])
    if same:
        gemm = _merge_gemm(fitted.gamma_gemm, ref.gamma_gemm)
        ratio = fitted.gamma(1024) / ref.gamma(1024) if "float64" in fitted.gamma_gemm else math.nan
        parts = {"preset": preset, "why": why,
                 "from_preset": ["links", "reductions", "per-call", "elementwise",
                                 "per-layer", "oversubscription"],
                 "measured": ["GEMM rates"] + bandwidth, "gemm_vs_preset": ratio,
                 "preset_digest": digest}
        say(f"cost model: this is the preset {preset}'s machine ({why}): its calibrated "
            f"links, reductions, per-call, elementwise and oversubscription models; GEMM "
            f"rates measured now ({ratio:.2f}x the preset's seconds per flop at n = 1024)")
        quick = {k: fitted.notes[k] for k in ("date", "command", "fit", "seconds")
                 if k in fitted.notes}
        notes = {**ref.notes, "quick_fit": quick, "composed": parts}
        notes.update({k: fitted.notes[k] for k in ("memory_bandwidth", "cache_bytes")
                      if k in fitted.notes})
        if "gemm_single" in fitted.notes:
            notes["gemm_single"] = fitted.notes["gemm_single"]
        return ref.replace(name=f"{preset}+gemm", source=f"{ref.source}; GEMM: {fitted.source}",
                           gamma_gemm=gemm, memory_bytes=fitted.memory_bytes or ref.memory_bytes,
                           memory_bandwidth=fitted.memory_bandwidth,
                           cache_bytes=fitted.cache_bytes,
                           notes=notes, fit_conditions=fitted.fit_conditions)
    out = borrow_run_models(fitted, lambda line: None, preset)
    borrowed = ["elementwise", "per-layer", "oversubscription"] if out is not fitted else []
    say(f"cost model: not the preset {preset}'s machine ({why}): links, GEMM and reductions "
        f"measured now" + (f"; {', '.join(borrowed)} models from the preset (calibrated on "
                           f"another CPU: expect per-call-heavy runs to be off)" if borrowed
                           else ""))
    parts = {"preset": preset, "why": why, "from_preset": borrowed,
             "measured": ["links", "GEMM rates", "reductions"] + bandwidth,
             "preset_digest": digest}
    return out.replace(notes={**out.notes, "composed": parts})


# --------------------------------------------------------------------------- resolve
def _load_checked(path: str, what: str, say) -> Machine | None:
    """The machine in ``path`` if it loads and passes the sanity checks, else None
    (with the reason said)."""
    try:
        machine = Machine.load(path)
    except (ValueError, OSError) as exc:
        say(f"cost model: {what} {path} cannot be used ({exc}); ignoring it")
        return None
    problems = sanity_problems(machine)
    if problems:
        say(f"cost model: {what} {path} fails the sanity checks, not using it: "
            + "; ".join(problems))
        return None
    return machine


def _one_rank(preset: str, say) -> dict:
    """What a job of fewer than :data:`FIT_RANKS` ranks uses when nothing saved serves."""
    say(f"cost model: one rank cannot fit a machine; using the preset {preset}")
    return {"use": load_preset(preset).to_dict()}


def _plan_on_root(path, calibrated, size, pids, say, preset):
    """Rank 0: ``({"use": machine dict} or {"fit": before-snapshot}, lock or None)``."""
    if os.path.exists(calibrated):
        m = _load_checked(calibrated, "the accuracy benchmark's machine", say)
        if m is not None:
            say(f"cost model: machine calibrated by the accuracy benchmark, {calibrated}")
            sc = m.shared_core
            if sc is not None and sc.mpi_hop_seconds_per_byte is None:
                say("cost model: note: its oversubscription model has no byte price of ring "
                    "steps (calibrated by a summasim before 2026-11-24, or on runs without "
                    "such steps), so rings beyond 2 ranks per core may be priced far off; "
                    "`python -m summasim.costmodel accuracy` recalibrates it")
            if m.fitted_busy:
                say(_busy_line(m, calibrated))
            return {"use": m.to_dict()}, None
    if size < FIT_RANKS and not os.path.exists(path):
        # nothing saved, and one rank cannot fit: the preset, with no lock (and no
        # results/ folder) made for it
        return _one_rank(preset, say), None
    lock = FitLock(path)
    try:
        got = lock.acquire(say)
    except OSError as exc:
        folder = os.path.dirname(lock.lock_path) or "."
        why = (f"{folder} is not a folder" if os.path.exists(folder)
               and not os.path.isdir(folder) else exc.strerror)
        say(f"cost model: cannot lock {lock.lock_path} ({why}); a fit will not be saved")
        lock, got = None, True
    if not got:
        say(f"cost model: waited {LOCK_WAIT:.0f} s for another job's fit; using the preset "
            f"{preset}")
        return {"use": load_preset(preset).to_dict()}, None
    try:
        if os.path.exists(path):
            m = _load_checked(path, "the saved fit", say)
            stale = None if m is None else stale_fit(m)
            if stale is not None and size >= FIT_RANKS:
                say(f"cost model: the saved fit {path} is out of date ({stale}); refitting")
                return {"fit": load.snapshot(LOAD_INTERVAL, exclude=pids)}, lock
            if stale is not None and stale_composition(m) is None:
                # only the memory floor's inputs are missing: one rank needs no floor
                say(f"cost model: the saved fit {path} predates the memory floor ({stale}); "
                    f"one rank cannot refit and needs none: using it")
                return {"use": m.to_dict()}, _released(lock)
            if stale is not None:
                say(f"cost model: the saved fit {path} is out of date ({stale}) and one rank "
                    f"cannot refit; using the preset {preset}")
                return {"use": load_preset(preset).to_dict()}, _released(lock)
            if m is not None and not m.fitted_busy:
                say(f"cost model: machine fitted earlier, {path} (delete it to re-fit)"
                    + _composed_line(m))
                return {"use": m.to_dict()}, _released(lock)
            if m is not None:  # fitted while busy: refit if the machine is quiet now
                now = load.snapshot(LOAD_INTERVAL, exclude=pids)
                if now["foreign_cpu"] > load.BUSY_CORES or size < FIT_RANKS:
                    say(_busy_line(m, path))
                    return {"use": m.to_dict()}, _released(lock)
                say(f"cost model: {path} was fitted while the machine was busy, and it is "
                    f"quiet now: refitting")
                return {"fit": now}, lock
        if size < FIT_RANKS:
            return _one_rank(preset, say), _released(lock)
        if os.path.exists(path) and not _machine_file(path):
            # someone else's file at the fit's path (a report written there): fit, use,
            # and leave it alone
            say(f"cost model: {path} is not a machine file, and a fit will not replace it; "
                f"fitting a quick one on {FIT_RANKS} ranks for this run only (the other "
                f"ranks wait)")
            return {"fit": load.snapshot(LOAD_INTERVAL, exclude=pids)}, _released(lock)
        say(f"cost model: no usable machine file; fitting a quick one on {FIT_RANKS} ranks "
            f"first (the other ranks wait)")
        return {"fit": load.snapshot(LOAD_INTERVAL, exclude=pids)}, lock
    except BaseException:
        _released(lock)
        raise


def _machine_file(path: str) -> bool:
    """Whether ``path`` holds a summasim machine, usable or not (its ``format``, or, in a
    file from before the format was written, a machine's own fields): only such a file
    is replaced by a new fit."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):   # a FIFO would block the open
            return False
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict):
        return False
    return (str(doc.get("format", "")).startswith("summasim.machine")
            or {"intra", "gamma_gemm", "gamma_reduce"} <= set(doc))


def _released(lock):
    if lock is not None:
        lock.release()
    return None


def _finish_on_root(fitted, rejected, before, path, pids, say, preset, can_save):
    """Rank 0 after the fit: the machine to use (as a dict), saved when trusted."""
    if rejected is not None:
        say("cost model: the quick fit is refused, not saved and not used: "
            + "; ".join(rejected) + f". Using the preset {preset} instead")
        return load_preset(preset).to_dict()
    # run_fit marks its machine from the snapshot that decided to fit (``before``), the
    # load during the fit and a snapshot after it; measure here only when it did not
    conditions = fitted.fit_conditions or load.fit_conditions(
        before, load.snapshot(LOAD_INTERVAL, exclude=pids))
    machine = compose_with_preset(fitted.replace(fit_conditions=conditions), say, preset)
    problems = sanity_problems(machine)
    if problems:
        say("cost model: the composed machine fails the sanity checks, not saved and not "
            "used: " + "; ".join(problems) + f". Using the preset {preset} instead")
        return load_preset(preset).to_dict()
    saved = can_save
    if can_save:
        try:
            machine.save(path)
        except ReportNotSaved as exc:   # the fit is good: used for this run, said, not lost
            saved = False
            say(f"cost model: the fit is used for this run but {exc}")
        else:
            say(f"cost model: saved the fit to {path}"
                + (" marked busy" if conditions["busy"] else "")
                + " (every measured point is in its notes)")
    if conditions["busy"]:
        say(_busy_line(machine, path if saved else None))
    return machine.to_dict()


def resolve_machine(spec, world, say, *, path: str | None = None,
                    calibrated: str | None = None, preset: str = FALLBACK_PRESET,
                    loaded: Machine | None = None) -> Machine:
    """The cost-model Machine on every rank (see the module doc for the order and the
    trust rules).

    Parameters
    ----------
    spec : str or None
        ``--machine``: a machine JSON file or a preset name; None: the default files or
        a quick fit.
    world : mpi4py communicator
        Every rank of the job calls this (collective).
    say : callable
        Prints one line (rank 0 prints, the others may discard).
    path, calibrated : str, optional
        The saved fit (default :data:`DEFAULT_MACHINE_FILE`) and the accuracy
        benchmark's machine (default :data:`CALIBRATED_MACHINE_FILE`).
    preset : str
        The fallback preset, and the source of what a quick fit cannot measure.
    loaded : Machine, optional
        On rank 0: ``spec``'s machine as the preflight already loaded it (so a run loads
        its machine file once).

    Raises
    ------
    ValueError
        ``spec`` is neither a valid machine file nor a preset; raised on every rank
        before any communication.
    """
    if spec is not None:
        # one load per run: rank 0's (the preflight's, when it passes it as ``loaded``),
        # handed to the others; a bad spec raises on every rank before any communication
        if loaded is None and not (os.path.exists(spec) or spec in list_presets()):
            check_machine_spec(spec)                # raises, naming the problem
        rank = world.Get_rank()
        machine = (loaded if loaded is not None else check_machine_spec(spec)) \
            if rank == 0 else None
        data = world.bcast(machine.to_dict() if rank == 0 else None, root=0)
        return _explicit(spec, machine or Machine.from_dict(data), say)
    from . import fitbench as _fit

    path = DEFAULT_MACHINE_FILE if path is None else path
    calibrated = CALIBRATED_MACHINE_FILE if calibrated is None else calibrated
    rank, size = world.Get_rank(), world.Get_size()
    pids = world.allgather(os.getpid())
    plan, lock = (_plan_on_root(path, calibrated, size, pids, say, preset)
                  if rank == 0 else (None, None))
    _sleep_barrier(world)                 # the others sleep while rank 0 waits or reads
    plan = world.bcast(plan, root=0)
    if "use" in plan:
        return Machine.from_dict(plan["use"])
    data = None
    try:
        sub = world.Split(0 if rank < FIT_RANKS else 1, rank)
        fitted = rejected = None
        if rank < FIT_RANKS:
            for attempt in (1, 2):      # a noisy fit is tried once more before giving up
                try:
                    fitted = _fit.run_fit(sub, quick=True, gemm_sizes=QUICK_GEMM_SIZES,
                                          say=lambda m: say(f"  {m}"), before=plan["fit"],
                                          exclude=pids, detail=lambda m: None)
                    rejected = None
                    break
                except load.FitBusy as exc:
                    rejected = [str(exc)]
                    break
                except _fit.FitRejected as exc:
                    rejected = exc.problems
                    if attempt == 1:
                        say(f"  the fit was refused ({'; '.join(exc.problems)}); fitting "
                            f"once more")
        sub.Free()
        if rank == 0:
            data = _finish_on_root(fitted, rejected, plan["fit"], path, pids, say, preset,
                                   can_save=lock is not None)
    finally:
        _released(lock)
    _sleep_barrier(world)                 # the fit's ranks finish; the others sleep
    return Machine.from_dict(world.bcast(data, root=0))
