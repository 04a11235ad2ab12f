"""The machine: what the cost model knows of the hardware it prices.

link        :class:`Link` (alpha-beta regimes of one kind of connection), :class:`SharedCore`
            (ranks time-sharing cores), dtype sizes
record      :class:`Machine`: links, GEMM rates (``gamma``), memory, topology, device
topology    nodes, intra-node links, NICs; rank placement; the links a group crosses
presets     the shipped presets, ``load_preset`` and ``load_machine`` (``--machine FILE|PRESET``)
sanity      plausibility bounds of a machine's numbers
regression  the pure regression of a fit: alpha/beta regimes, shared-core and element-wise
            rates (the microbenchmarks that time them live in :mod:`summasim.harness.fitbench`)
"""

from __future__ import annotations

# the private names are re-exported for the modules that imported them from machine.py
# flake8: noqa: F401

from .link import (DTYPE_SIZES, Link, SharedCore, _dtype_name, _no_extra, _number, _require,
                   itemsize_of)
from .presets import (DEFAULT_PRESET, _preset_dir, get_machine, list_presets, load_machine,
                      load_preset)
from .record import (FORMAT, LIBRARIES, Machine, _CONDITION_NUMBERS, _fit_conditions,
                     _gamma_table)
from .sanity import (MAX_ALPHA, MAX_FIT_ERROR, MAX_FLOPS, MAX_GEMM_SHARING, MAX_LINK_BANDWIDTH,
                     MAX_REDUCE_BANDWIDTH, MIN_FLOPS, MIN_LINK_BANDWIDTH, _bad, _link_problems,
                     sanity_problems)
from .topology import GridShape, GroupPath, Placement, Topology, group_path

__all__ = ["DEFAULT_PRESET", "DTYPE_SIZES", "FORMAT", "GridShape", "GroupPath", "LIBRARIES",
           "Link", "MAX_ALPHA", "MAX_FIT_ERROR", "MAX_FLOPS", "MAX_GEMM_SHARING",
           "MAX_LINK_BANDWIDTH", "MAX_REDUCE_BANDWIDTH", "MIN_FLOPS", "MIN_LINK_BANDWIDTH",
           "Machine", "Placement", "SharedCore", "Topology", "get_machine", "group_path",
           "itemsize_of", "list_presets", "load_machine", "load_preset",
           "sanity_problems"]
