"""Moved to :mod:`summasim.costmodel.tools.explore` (a shim until the lead removes it)."""

import sys

from .tools import explore as _moved

if __name__ == "__main__":  # pragma: no cover
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
