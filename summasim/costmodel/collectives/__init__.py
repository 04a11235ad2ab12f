"""Collectives: the time of one call over a group.

mpich   MPICH's algorithms as alpha-beta-gamma formulas (and the Optimus paper's)
shape   what one member of each algorithm sends and reduces (the shared-core model's input)
select  MPICH's choice by CVAR thresholds, and :func:`collective_time`
nccl    NCCL's ring/tree algorithms, LL/LL128/Simple protocols and its choice
"""

from __future__ import annotations

# flake8: noqa: F401  (the old collectives.py's names, private ones included)
from .mpich import *  # noqa: F403
from .mpich import (_doublings, _fold, _halvings, _msgs, _tree_finish)
from .select import (MPICH, CollectiveCost, Thresholds, collective_time, select_algorithm)
from .shape import Shape, collective_shape
