"""The machine presets shipped with summasim, and THE resolver of ``--machine FILE|PRESET``.

A preset is a JSON file in ``summasim/costmodel/presets/`` whose every number names its
source (datasheet, white paper, benchmark) in ``notes``, ``topology.sources`` and
``device.sources``. ``--machine`` also takes a derived variant, one flag away from a preset
or a machine file: ``NAME:key=value,key=value`` (:func:`derive`), e.g.
``dgx-a100:memory=40GiB,nics=4``, or ``dgx-a100:nodes_per_leaf=32,oversub=2`` (a fabric
of 32-node leaf domains with 2:1 oversubscribed uplinks). A variant sets exactly the fields its keys name (and
the source of each, which becomes the variant itself); its name is the whole spec, so a
report shows what was priced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from importlib import resources
from typing import Any

from .record import Machine

#: The preset used when none is named: this project's CPU VM.
DEFAULT_PRESET = "local-2core-mpich"

#: Other names of shipped presets: ``alias -> preset`` (the same machine, named as the preset).
ALIASES = {"dgx-a100-80gb": "dgx-a100"}

#: The keys of a ``NAME:key=value,...`` variant and what each sets (all read by the model:
#: ``memory_bytes`` by the memory-fit checks of predict, plan and explore; the topology's
#: fields by :func:`~summasim.costmodel.machine.topology.group_path`, which prices NCCL
#: collectives, including the leaf domains and oversubscription of the fabric above the
#: NICs: see :mod:`summasim.costmodel.machine.topology`).
VARIANT_KEYS = {
    "memory": "device memory per rank, a byte size with a unit (40GiB, 80GB, 512MiB, "
              "1TiB; k, M, G, T are powers of 1024 as in every summasim byte size, and "
              "NVIDIA's '80 GB' is 80 GiB; Gb, in bits, is refused): Machine.memory_bytes",
    "gpus": "devices (ranks) per node: topology.devices_per_node, node_size and cores",
    "nics": "cluster NICs per node: topology.nics_per_node",
    "nic_gbps": "line rate of one NIC, Gb/s per direction (200 = HDR, 400 = NDR): "
                "topology.nic_bandwidth = value / 8 GB/s",
    "nodes_per_leaf": "nodes per leaf domain of the fabric (a rail-optimized scalable unit, "
                      "32 on a DGX SuperPOD; or one leaf switch's nodes), a whole number "
                      ">= 1: topology.nodes_per_leaf",
    "oversub": "a leaf's downlink : uplink ratio, a number >= 1 (2 for 2:1), on a fabric "
               "with leaf domains (nodes_per_leaf, the preset's or given with it): "
               "topology.oversubscription",
}
#: A variant spec to show in help text and docs.
VARIANT_EXAMPLE = "dgx-a100:memory=40GiB,nics=4"
#: What a variant may set, beyond which a value is a typo, not a machine: device memory
#: (1 PiB per device), counts (devices or NICs per node, nodes per leaf switch), a
#: NIC's line rate in Gb/s (1 Mb/s to 1 Pb/s) and the fabric's oversubscription.
MEMORY_MOST = 1 << 50
COUNT_MOST = 1 << 20
GBPS_RANGE = (1e-3, 1e6)
OVERSUB_MOST = 1024.0


def _preset_dir():
    return resources.files("summasim.costmodel").joinpath("presets")


def list_presets() -> list[str]:
    """Names of the machine presets shipped with summasim."""
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Machine:
    """The shipped preset called ``name`` (or one of its :data:`ALIASES`); ValueError
    lists the known names."""
    name = ALIASES.get(name, name)
    names = list_presets()
    if name not in names:
        raise ValueError(f"unknown machine preset {name!r}; known presets: {', '.join(names)}")
    d = json.loads(_preset_dir().joinpath(name + ".json").read_text(encoding="utf-8"))
    return Machine.from_dict(d)


def get_machine(machine: Any = None, preset: str | None = None) -> Machine:
    """Resolve a Machine from an instance, a JSON path, or a preset name (either may
    carry a variant, ``:key=value,...``: :func:`load_machine`)."""
    if isinstance(machine, Machine):
        return machine
    if machine is not None and preset is not None:
        raise ValueError("give a machine file or a preset name, not both")
    if machine is not None:
        return Machine.load(machine) if os.path.exists(machine) else load_machine(machine)
    if preset is not None and ":" in preset:            # a variant NAME:key=value,...
        return load_machine(preset)
    return load_preset(preset or DEFAULT_PRESET)


def load_machine(text: "str | Machine") -> Machine:
    """THE resolver of ``--machine FILE|PRESET[:key=value,...]``: an existing file is a
    machine JSON (``costmodel fit``'s output, or a preset copied and edited); any other
    text is a preset name (or an alias, :data:`ALIASES`). Either may end in a variant,
    ``:key=value,...`` (:func:`derive`; the keys are :data:`VARIANT_KEYS`). A file is read
    by :func:`summasim.cli.read_json_file` (regular files only, bounded size and nesting).
    ``ValueError`` (a :class:`summasim.cli.UsageError` naming the file when it cannot be
    read) otherwise, naming the known presets, or the bad variant key and the valid ones."""
    if isinstance(text, Machine):
        return text
    text = str(text)
    if os.path.exists(text):
        return _load_file(text)
    base, sep, spec = text.rpartition(":")
    if sep and base and ("=" in spec or not spec or base in list_presets()
                         or base in ALIASES or os.path.exists(base)):
        if not os.path.exists(base) and "=" in base.rpartition(":")[2]:
            raise ValueError(f"machine {text!r}: one variant per machine; give every "
                             f"key=value after one ':', comma-separated (e.g. "
                             f"{VARIANT_EXAMPLE})")
        return derive(load_machine(base), spec)          # NAME:key=value,...
    if os.sep in text or text.endswith(".json"):
        return _load_file(text)
    names = list_presets()
    if text not in names and text not in ALIASES:
        raise ValueError(f"{text!r} is neither a machine file nor a preset; known presets: "
                         f"{', '.join(names)}")
    return load_preset(text)


def _load_file(path: str) -> Machine:
    """A machine file, held to the physical bounds three orders of magnitude wide
    (:func:`~summasim.costmodel.machine.sanity.physical_problems`): a
    :class:`summasim.cli.UsageError` naming the file and the first number out of them."""
    from summasim.cli import UsageError

    from .sanity import LOAD_SLACK, physical_problems

    machine = Machine.load(path)
    bad = physical_problems(machine, LOAD_SLACK)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(f"machine file {path}: {bad[0]}{more}")
    return machine


# --------------------------------------------------------------------------- variants
def _variant_keys(machine: Machine) -> list[str]:
    """The :data:`VARIANT_KEYS` that apply to ``machine`` (the topology's need one; the
    NICs' and the fabric's above them, ``nodes_per_leaf`` and ``oversub``, need a
    topology with NICs)."""
    keys = ["memory"]
    if machine.topology is not None:
        keys.append("gpus")
        if machine.topology.nics_per_node > 0:
            keys += ["nics", "nic_gbps", "nodes_per_leaf", "oversub"]
    return keys


def _memory_bytes(text: str) -> float:
    """``memory=``: a byte size that names its unit (a bare number is refused: 40 bytes
    of device memory is a typo for 40GiB, not a machine)."""
    from ...cli import byte_size

    if re.search(r"[KMGT]b\s*$", text):       # Gb, as in "200 Gb/s": bits
        raise ValueError("is in bits (b); device memory is in bytes: write GB or GiB")
    if re.fullmatch(r"\s*\d+(\.\d+)?\s*[tT](i?[bB])?\s*", text):
        val = float(re.sub(r"[^\d.]", "", text)) * (1 << 40)   # TiB: beyond byte_size's G
    elif not re.search(r"[kKmMgG]", text):
        raise ValueError("needs a unit, e.g. 40GiB, 80GB or 1TiB")
    else:
        try:
            val = float(byte_size(text))
        except Exception as exc:                # argparse.ArgumentTypeError: not a byte size
            raise ValueError(str(exc)) from None
    if not 1 <= val <= MEMORY_MOST:
        raise ValueError(f"must be at least 1 byte and at most {MEMORY_MOST >> 40} TiB per "
                         f"device")
    return val


def _count(text: str) -> int:
    """``gpus=``, ``nics=``, ``nodes_per_leaf=``: an integer in [1, :data:`COUNT_MOST`]."""
    if not re.fullmatch(r"\s*\d+\s*", text) or not 1 <= int(text) <= COUNT_MOST:
        raise ValueError(f"must be a whole number from 1 to {COUNT_MOST}")
    return int(text)


def _gbps(text: str) -> float:
    """``nic_gbps=``: a finite number > 0 of Gb/s."""
    import math

    try:
        val = float(text)
    except ValueError:
        raise ValueError("must be a number of Gb/s, e.g. 200") from None
    if not (math.isfinite(val) and GBPS_RANGE[0] <= val <= GBPS_RANGE[1]):
        raise ValueError(f"must be a number of Gb/s from {GBPS_RANGE[0]:g} to "
                         f"{GBPS_RANGE[1]:g}, e.g. 200")
    return val


def _ratio(text: str) -> float:
    """``oversub=``: a finite number >= 1 (downlink : uplink; 1 is non-blocking)."""
    import math

    try:
        val = float(text)
    except ValueError:
        raise ValueError("must be a number >= 1, e.g. 2 for 2:1") from None
    if not (math.isfinite(val) and 1 <= val <= OVERSUB_MOST):
        raise ValueError(f"must be a number from 1 to {OVERSUB_MOST:g} (downlink : uplink), "
                         f"e.g. 2 for 2:1")
    return val


#: ``key -> (topology field, parser, unit shown in the source)`` of the variant keys
#: that set one topology field each.
_TOPOLOGY_KEYS = {
    "nics": ("nics_per_node", _count, ""),
    "nodes_per_leaf": ("nodes_per_leaf", _count, ""),
    "oversub": ("oversubscription", _ratio, ":1"),
}


def derive(machine: Machine, spec: str) -> Machine:
    """``machine`` with the fields a variant ``spec`` (``"key=value,key=value"``) names set.

    Parameters
    ----------
    machine : Machine
        A preset or a loaded machine file.
    spec : str
        Comma-separated ``key=value`` pairs, the keys from :data:`VARIANT_KEYS`:
        ``memory`` (``Machine.memory_bytes``), ``gpus`` (``topology.devices_per_node``,
        ``node_size`` and ``cores``, one number), ``nics`` (``topology.nics_per_node``),
        ``nic_gbps`` (``topology.nic_bandwidth``, bytes/s = Gb/s * 1e9 / 8),
        ``nodes_per_leaf`` (``topology.nodes_per_leaf``, a whole number >= 1) and
        ``oversub`` (``topology.oversubscription``, a number >= 1).

    Returns
    -------
    Machine
        Named ``"{machine.name}:{spec}"``; every other field equal to ``machine``'s,
        but the sources of the fields set (``notes``, ``topology.sources``), which say
        the variant set them, and ``notes["variant"]`` (``{"of": name, "set": {key:
        value}}``).

    Raises
    ------
    ValueError
        An unknown key, a key that does not apply to ``machine`` (``gpus`` needs a
        topology, ``nics``, ``nic_gbps``, ``nodes_per_leaf`` and ``oversub`` one with
        NICs), a key given twice, or a bad value (no unit, unparseable, not positive,
        an oversubscription below 1); the message names the key and lists the valid
        ones.
    """
    pairs: dict = {}
    whole = f"{machine.name}:{spec}"
    valid = _variant_keys(machine)
    listing = f"valid keys for {machine.name!r}: {', '.join(valid)} (e.g. {VARIANT_EXAMPLE})"
    if not spec.strip():
        raise ValueError(f"machine variant of {machine.name!r}: nothing after ':'; "
                         f"give key=value pairs; {listing}")
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in VARIANT_KEYS:
            raise ValueError(f"machine variant {whole!r}: unknown key {key!r}; {listing}")
        if not eq or not value:
            raise ValueError(f"machine variant {whole!r}: key {key!r} needs a value "
                             f"({key}=VALUE); {listing}")
        if key not in valid:
            why = ("it has no topology" if machine.topology is None
                   else "its topology has no NICs")
            raise ValueError(f"machine variant {whole!r}: key {key!r} does not apply to "
                             f"{machine.name!r} ({why}); {listing}")
        if key in pairs:
            raise ValueError(f"machine variant {whole!r}: key {key!r} is given twice; {listing}")
        pairs[key] = value
    name = f"{machine.name}:{','.join(f'{k}={v}' for k, v in pairs.items())}"
    said = f"set by the variant {name} (not from the preset's sources)"
    changes: dict = {}
    topo: dict = {}
    notes = dict(machine.notes)
    tsources = dict(machine.topology.sources) if machine.topology is not None else {}
    for key, value in pairs.items():
        try:
            if key == "memory":
                changes["memory_bytes"] = _memory_bytes(value)
                notes["memory_bytes"] = f"{value}: {said}"
            elif key == "gpus":
                n = _count(value)
                topo["devices_per_node"] = n
                changes["cores"] = n
                changes["node_size"] = None if machine.node_size is None else n
                tsources["devices_per_node"] = f"{n}: {said}"
            elif key in _TOPOLOGY_KEYS:
                fld, parse, unit = _TOPOLOGY_KEYS[key]
                topo[fld] = parse(value)
                tsources[fld] = f"{value}{unit}: {said}"
            else:
                topo["nic_bandwidth"] = _gbps(value) * 1e9 / 8
                tsources["nic_bandwidth"] = f"{value} Gb/s: {said}"
        except ValueError as exc:
            raise ValueError(f"machine variant {whole!r}: key {key!r}: {value!r} {exc}; "
                             f"{listing}") from None
    if ("oversub" in pairs and "nodes_per_leaf" not in pairs
            and not machine.topology.nodes_per_leaf):
        raise ValueError(f"machine variant {whole!r}: key 'oversub' needs leaf domains, and "
                         f"{machine.name!r} has none (one non-blocking fabric): give "
                         f"nodes_per_leaf too; {listing}")
    notes["variant"] = {"of": machine.name, "set": dict(pairs)}
    try:
        if machine.topology is not None:
            topo["sources"] = tsources
            changes["topology"] = dataclasses.replace(machine.topology, **topo)
        return machine.replace(name=name, notes=notes, **changes)
    except ValueError as exc:             # e.g. gpus that do not split over the sockets
        raise ValueError(f"machine variant {whole!r}: {exc}; "
                         f"{listing}") from None


# --------------------------------------------------------------------------- listing
def describe(machine: Machine) -> str:
    """One line of what ``machine`` is: devices per node, device and its memory, the
    intra-node link, the NICs and the collective library (all read from its fields)."""
    gib = machine.memory_bytes / (1 << 30)
    mem = f"{gib:.4g} GiB" if gib else "memory unknown"
    topo = machine.topology
    if topo is None:
        return (f"{machine.cores} cores per node, {mem} per rank, {machine.library} "
                f"alpha-beta links")
    device = machine.device.name if machine.device is not None else "devices"
    nics = (f"{topo.nics_per_node}x {topo.nic_bandwidth * 8 / 1e9:g} Gb/s NICs"
            if topo.nics_per_node else "no NICs")
    return (f"{topo.devices_per_node}x {device} ({mem}), {topo.intra_kind} "
            f"{topo.intra_bandwidth / 1e9:.4g} GB/s per direction per device, {nics}, "
            f"{machine.library}")


def main_sources(machine: Machine, width: int = 200) -> str:
    """The first sentence of ``machine.source`` (what it is and where its numbers come
    from), cut at ``width`` characters."""
    first = re.split(r"(?<=[.;])\s", machine.source.strip(), maxsplit=1)[0].rstrip(";")
    return first if len(first) <= width else first[:width - 3].rstrip() + "..."


def presets_listing() -> str:
    """``python -m summasim.costmodel presets``: every preset with a one-line description
    and its main sources, the aliases, and the variant keys with an example."""
    lines = []
    for name in list_presets():
        m = load_preset(name)
        lines.append(f"{name:<20s} {describe(m)}")
        lines.append(f"{'':<20s} sources: {main_sources(m)}")
    lines.append("")
    lines.append("aliases: " + ", ".join(f"{a} = {p}" for a, p in sorted(ALIASES.items())))
    lines.append("")
    lines.append("variants: --machine NAME:key=value,key=value (any command that takes "
                 "--machine; NAME a preset or a machine file); keys:")
    for key, what in VARIANT_KEYS.items():
        lines.append(f"  {key:<14s} {what}")
    lines.append(f"  example: --machine {VARIANT_EXAMPLE}   "
                 f"(`python -m summasim.costmodel presets {VARIANT_EXAMPLE}` prints it)")
    lines.append("every number's source: python -m summasim.costmodel presets NAME "
                 "(notes, topology.sources, device.sources); docs/presets.md")
    return "\n".join(lines)
