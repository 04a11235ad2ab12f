"""The machine presets shipped with summasim, and THE resolver of ``--machine FILE|PRESET``."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from .record import Machine

#: The preset used when none is named: this project's CPU VM.
DEFAULT_PRESET = "local-2core-mpich"


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


def load_machine(text: "str | Machine") -> Machine:
    """THE resolver of ``--machine FILE|PRESET``: an existing file is a machine JSON
    (``costmodel fit``'s output, or a preset copied and edited); any other text is a
    preset name. A file is read by :func:`summasim.cli.read_json_file` (regular files
    only, bounded size and nesting). ``ValueError`` (a :class:`summasim.cli.UsageError`
    naming the file when it cannot be read) otherwise, naming the known presets."""
    import os

    if isinstance(text, Machine):
        return text
    text = str(text)
    if os.path.exists(text) or os.sep in text or text.endswith(".json"):
        return Machine.load(text)
    names = list_presets()
    if text not in names:
        raise ValueError(f"{text!r} is neither a machine file nor a preset; known presets: "
                         f"{', '.join(names)}")
    return load_preset(text)


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
