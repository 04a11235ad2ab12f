"""Moved to :mod:`summasim.costmodel.collectives.nccl` (this alias goes when its importers move)."""

import sys

from .collectives import nccl as _moved

sys.modules[__name__] = _moved
