"""Reading a machine file's nested objects (pure)."""

from __future__ import annotations

from typing import Mapping


def nested_from_dict(cls, d, field: str, required: tuple):
    """``cls(**d)`` for the machine field ``field`` (``"device"``, ``"topology"``):
    ``ValueError`` naming the field when ``d`` is not an object, has a key outside
    ``cls._FIELDS`` or misses one of ``required``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"machine field {field!r} must be an object or null")
    extra = sorted(set(d) - set(cls._FIELDS))
    if extra:
        raise ValueError(f"unknown machine field(s) "
                         f"{', '.join(repr(field + '.' + e) for e in extra)}; allowed: "
                         f"{', '.join(cls._FIELDS)}")
    for req in required:
        if req not in d:
            raise ValueError(f"machine field '{field}.{req}' is missing")
    return cls(**dict(d))
