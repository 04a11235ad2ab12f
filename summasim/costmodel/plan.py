"""Moved to :mod:`summasim.costmodel.tools.plan` (a shim until the lead removes it)."""

import sys

from .tools import plan as _moved

if __name__ == "__main__":  # pragma: no cover
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
