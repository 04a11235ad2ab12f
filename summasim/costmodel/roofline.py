"""Moved to :mod:`summasim.costmodel.compute.roofline` (this alias goes when its importers move)."""

import sys

from .compute import roofline as _moved

sys.modules[__name__] = _moved
