"""Moved to :mod:`summasim.costmodel.workload.traffic` (this alias goes when its importers move)."""

import sys

from .workload import traffic as _moved

sys.modules[__name__] = _moved
