"""The summasim cost model: alpha-beta-gamma predictions without MPI.

Pure functions with the papers' symbols (alpha s/message, beta s/byte, gamma
s/flop; p ranks, q x q grids, depth d). Only :mod:`summasim.costmodel.fit`
imports mpi4py, and only when a fit runs.

Modules
-------
machine         :class:`Machine`, :class:`Link`, JSON presets (``load_preset``)
topology        nodes, intra-node links, NICs; rank placement; the links a group crosses
collectives     collective times and MPICH's algorithm selection
nccl            NCCL's ring/tree algorithms, LL/LL128/Simple protocols and its choice
roofline        memory-bound kernels of a training step: max(flops/peak, bytes/bw) + launch
traffic         exact per-rank events of each summasim algorithm (closed forms)
predict         ``predict_trace`` (price a Trace) and ``predict_algorithm``
schemes         Megatron / Optimus / SUMMA2.5-LM layer costs, memory, Table 1, whole
                steps with their breakdown (``step_breakdown``)
isoefficiency   W(p) at fixed efficiency and its growth exponent
fit             microbenchmarks and the robust alpha/beta fit (MPI)
explore         the ``explore`` CLI: scaling sweeps, best grids, plots
predictcmd      the ``predict`` CLI: one configuration, its step breakdown and memory
devset          published GPU-cluster measurements against the model (``devset.json``)

Command line: ``python -m summasim.costmodel {predict,explore,devset,fit,presets,table1} --help``.
"""

from .collectives import (ALGORITHMS, MPICH, CollectiveCost, Thresholds, collective_time,
                          select_algorithm)
from .isoefficiency import IsoResult, isoefficiency, paper_machine, reference_slope
from .machine import (DEFAULT_PRESET, Link, Machine, get_machine, itemsize_of, list_presets,
                      load_preset)
from .predict import Prediction, group_spans_nodes, predict_algorithm, predict_trace
from .nccl import NcclCost, bus_factor, nccl_time
from .roofline import Device
from .schemes import (Memory, Scheme, SchemeCost, StepBreakdown, TransformerConfig, best_grid,
                      largest_batch, memory, scheme_cost, step_breakdown, step_cost, table1,
                      table1_paper)
from .topology import GridShape, GroupPath, Placement, Topology, group_path
from .traffic import (ALGORITHM_NAMES, EventSpec, MessageClass, algorithm_compute,
                      algorithm_events, algorithm_flops, algorithm_messages, algorithm_traffic,
                      ring_allgather_events, ring_allreduce_events, ring_reduce_scatter_events,
                      summarize_events)

__all__ = [
    "ALGORITHMS", "ALGORITHM_NAMES", "CollectiveCost", "DEFAULT_PRESET", "Device", "EventSpec",
    "GridShape", "GroupPath", "IsoResult", "NcclCost", "Placement", "StepBreakdown", "Topology",
    "bus_factor", "group_path", "nccl_time", "step_breakdown", "step_cost",
    "Link", "MPICH", "Machine", "Memory", "MessageClass", "Prediction", "Scheme", "SchemeCost",
    "Thresholds", "TransformerConfig", "algorithm_compute", "algorithm_events",
    "algorithm_flops", "algorithm_messages", "algorithm_traffic", "best_grid",
    "collective_time", "get_machine", "group_spans_nodes", "isoefficiency", "itemsize_of",
    "largest_batch", "list_presets", "load_preset", "memory", "paper_machine",
    "predict_algorithm", "predict_trace", "reference_slope", "ring_allgather_events",
    "ring_allreduce_events", "ring_reduce_scatter_events", "scheme_cost", "select_algorithm",
    "summarize_events", "table1", "table1_paper",
]
