"""Plausibility of a machine's numbers: the bounds a fitted or written machine must keep."""

from __future__ import annotations

import math
from typing import Mapping

from .link import Link, SharedCore
from .record import Machine

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


def _link_problems(link: Link, tag: str, slack: float = 1.0) -> list[str]:
    """What is impossible in one link's reachable regimes (the bounds ``slack`` times
    wider)."""
    top, floor, longest = MAX_LINK_BANDWIDTH * slack, MIN_LINK_BANDWIDTH / slack, \
        MAX_ALPHA * slack
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
        elif alpha > longest:
            out.append(f"{where}: latency alpha = {alpha:.3g} s is above {longest:g} s")
        if _bad(beta) or beta <= 0:
            out.append(f"{where}: beta = {beta!r} s/B, an infinite bandwidth (must be "
                       f"finite and > 0)")
        elif 1.0 / beta > top:
            out.append(f"{where}: bandwidth {1 / beta / 1e9:.3g} GB/s is above the "
                       f"ceiling of {top / 1e9:g} GB/s")
        elif 1.0 / beta < floor:
            out.append(f"{where}: bandwidth {1 / beta / 1e6:.3g} MB/s is below "
                       f"{floor / 1e6:g} MB/s")
    sizes = {1, max(1, link.eager_threshold - 1), link.eager_threshold, 1 << 26}
    if link.huge_threshold is not None:
        sizes |= {link.huge_threshold - 1, link.huge_threshold}
    for m in sorted(x for x in sizes if x >= 1):
        t = link.time(m)
        if _bad(t) or t <= 0:
            out.append(f"{tag}: a {m}-byte message costs {t!r} s (must be finite and > 0)")
    return out


#: Most compute units a machine can have per node.
MAX_CORES = 1 << 20
#: How much wider than the bounds above a machine file may go as it loads
#: (:func:`physical_problems`): three orders of magnitude, for hardware beyond today's
#: (the fits are held to the bounds themselves).
LOAD_SLACK = 1000.0


def physical_problems(machine, slack: float = 1.0) -> list[str]:
    """What is physically impossible in ``machine``'s own numbers (a Machine): the
    bounds above on the links, GEMM, reductions and the other terms, and on the device
    and topology where given, each ``slack`` times wider (ceilings times it, floors
    over it); what :func:`sanity_problems` checks but the fit's notes. Every
    ``--machine FILE`` is held to them with :data:`LOAD_SLACK` as it loads
    (:func:`~summasim.costmodel.machine.presets.load_machine`): a number hundreds of
    orders of magnitude off priced steps of "inf ms" and exited 0, while a file for
    hardware beyond today's must still load."""
    m = machine
    out = []
    flops = (MIN_FLOPS / slack, MAX_FLOPS * slack)
    link = (MIN_LINK_BANDWIDTH / slack, MAX_LINK_BANDWIDTH * slack)
    memory = (MIN_LINK_BANDWIDTH / slack, MAX_REDUCE_BANDWIDTH * slack)
    if _bad(m.cores) or m.cores < 1 or m.cores > MAX_CORES:
        out.append(f"cores = {m.cores!r} (must be an integer from 1 to {MAX_CORES})")
    out += _link_problems(m.intra, "intra-node link", slack)
    if m.inter is not None:
        out += _link_problems(m.inter, "inter-node link", slack)
    for dt, pts in m.gamma_gemm.items():
        for n, g in pts:
            if _bad(g) or g <= 0:
                out.append(f"GEMM {dt} n={n:g}: gamma = {g!r} s/flop (must be finite, > 0)")
            elif not flops[0] <= 1.0 / g <= flops[1]:
                out.append(f"GEMM {dt} n={n:g}: {1 / g / 1e9:.4g} GFLOP/s per compute unit "
                           f"is outside [{flops[0] / 1e9:g}, {flops[1] / 1e9:g}] GFLOP/s")
    for name in ("gamma_reduce", "gamma_reduce_mpi"):
        g = getattr(m, name)
        if _bad(g) or g < 0:
            out.append(f"{name} = {g!r} s/B (must be finite and >= 0)")
        elif g > 0 and not memory[0] <= 1.0 / g <= memory[1]:
            out.append(f"{name}: {1 / g / 1e9:.4g} GB/s of reduction is outside "
                       f"[{memory[0] / 1e9:g}, {memory[1] / 1e9:g}] GB/s")
    for name in ("call_seconds", "gamma_elementwise", "layer_seconds", "memory_bytes"):
        v = getattr(m, name)
        if _bad(v) or v < 0:
            out.append(f"{name} = {v!r} (must be finite and >= 0)")
    # per-call and per-layer seconds, and seconds per elementwise item: none as long
    # as a message's latency bound
    for name in ("call_seconds", "layer_seconds", "gamma_elementwise"):
        v = getattr(m, name)
        if not _bad(v) and v > MAX_ALPHA * slack:
            out.append(f"{name} = {v:.3g} s is above {MAX_ALPHA * slack:g} s")
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
    out += _device_problems(m, flops, link, memory)
    return out


def _device_problems(m, flops, link, memory) -> list[str]:
    """The device's and the topology's rates within the ``(floor, ceiling)`` bounds."""
    out = []
    dev = getattr(m, "device", None)
    if dev is not None:
        bw = dev.memory_bandwidth
        if not memory[0] <= bw <= memory[1]:
            out.append(f"device.memory_bandwidth = {bw:.3g} B/s is outside "
                       f"[{memory[0]:g}, {memory[1]:g}]")
        for dt, f in (dev.vector_flops or {}).items():
            if not flops[0] <= f <= flops[1]:
                out.append(f"device.vector_flops.{dt} = {f:.3g} flop/s is outside "
                           f"[{flops[0]:g}, {flops[1]:g}]")
    topo = getattr(m, "topology", None)
    if topo is not None:
        for name in ("intra_bandwidth", "socket_bandwidth", "nic_bandwidth",
                     "host_bandwidth"):
            v = getattr(topo, name)
            if v and not link[0] <= v <= link[1]:
                out.append(f"topology.{name} = {v:.3g} B/s is outside "
                           f"[{link[0]:g}, {link[1]:g}]")
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
    out = physical_problems(m)
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
