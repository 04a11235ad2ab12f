"""The summasim cost model: alpha-beta-gamma predictions without MPI.

Pure functions with the papers' symbols (alpha s/message, beta s/byte, gamma
s/flop; p ranks, q x q grids, depth d). The cost model never imports mpi4py: the fit's
microbenchmarks are :mod:`summasim.harness.fitbench`.

Packages, one concept per module
--------------------------------
machine/      :class:`Machine`, :class:`Link`, :class:`SharedCore`; presets and
              ``load_machine`` (``--machine FILE|PRESET``); topology and placement; the
              pure regression of a fit (its MPI microbenchmarks: ``summasim.harness.fitbench``)
collectives/  MPICH's collective formulas and its selection; NCCL's algorithms and protocols
compute/      GEMM rates; the roofline of every other kernel (:class:`Device`)
workload/     what is priced: an algorithm's traffic; a scheme's grid, layer ops, step and
              memory; data, pipeline and ZeRO compositions; the trace and feature pricer
tools/        the commands built on them (predict, plan, explore, devset, isoefficiency,
              accuracy)

Command line: ``python -m summasim.costmodel {predict,explore,devset,fit,presets,table1} --help``.
"""

from .collectives import (ALGORITHMS, MPICH, CollectiveCost, Thresholds, collective_time,
                          select_algorithm)
from .collectives.nccl import NcclCost, bus_factor, nccl_time
from .compute.roofline import Device
from summasim.costmodel.tools.isoefficiency import (
    IsoResult, isoefficiency, paper_machine, reference_slope)
from .machine import (DEFAULT_PRESET, GridShape, GroupPath, Link, Machine, Placement, Topology,
                      get_machine, group_path, itemsize_of, list_presets, load_machine,
                      load_preset)
from .workload.footprint import Memory, largest_batch, memory
from .workload.layer import SchemeCost, best_grid, scheme_cost
from .workload.predict import predict_algorithm, predict_trace
from .workload.pricer import Prediction, group_spans_nodes
from .workload.scheme import Scheme, TransformerConfig
from .workload.step import StepBreakdown, step_breakdown, step_cost
from .workload.table1 import table1, table1_paper
from .workload.traffic import (ALGORITHM_NAMES, EventSpec, MessageClass, algorithm_compute,
                               algorithm_events, algorithm_flops, algorithm_messages,
                               algorithm_traffic, ring_allgather_events, ring_allreduce_events,
                               ring_reduce_scatter_events, summarize_events)

__all__ = [
    "ALGORITHMS", "ALGORITHM_NAMES", "CollectiveCost", "DEFAULT_PRESET", "Device", "EventSpec",
    "GridShape", "GroupPath", "IsoResult", "NcclCost", "Placement", "StepBreakdown", "Topology",
    "bus_factor", "group_path", "nccl_time", "step_breakdown", "step_cost",
    "Link", "MPICH", "Machine", "Memory", "MessageClass", "Prediction", "Scheme", "SchemeCost",
    "Thresholds", "TransformerConfig", "algorithm_compute", "algorithm_events",
    "algorithm_flops", "algorithm_messages", "algorithm_traffic", "best_grid",
    "collective_time", "get_machine", "group_spans_nodes", "isoefficiency", "itemsize_of",
    "largest_batch", "list_presets", "load_machine", "load_preset", "memory", "paper_machine",
    "predict_algorithm", "predict_trace", "reference_slope", "ring_allgather_events",
    "ring_allreduce_events", "ring_reduce_scatter_events", "scheme_cost", "select_algorithm",
    "summarize_events", "table1", "table1_paper",
]
