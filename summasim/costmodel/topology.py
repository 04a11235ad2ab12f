"""Moved to :mod:`summasim.costmodel.machine.topology` (this alias goes when its importers move)."""

import sys

from .machine import topology as _moved

sys.modules[__name__] = _moved
