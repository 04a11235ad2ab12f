"""Moved to :mod:`summasim.costmodel.workload.scheme`, :mod:`summasim.costmodel.workload.layer`, :mod:`summasim.costmodel.workload.footprint`, :mod:`summasim.costmodel.workload.table1`, :mod:`summasim.costmodel.workload.step`.

A re-export of every name the old module had, for the importers not moved yet; it goes
with them."""

from .workload.scheme import (  # noqa: F401
    SCHEMES, _ALIASES, TransformerConfig, Scheme, grid_shapes, _divides, misfit,
    _fmt_num, _whole)
from .workload.layer import (  # noqa: F401
    _gemm_seconds, layer_ops, _LINEARS_COL, _linears, _optimus_layer_aux, _split,
    PassCost, SchemeCost, _ring_allreduce_messages, _price_ops, scheme_cost, best_grid)
from .workload.footprint import (  # noqa: F401
    Memory, memory, batch_step, largest_batch, _layer_activations)
from .workload.table1 import (  # noqa: F401
    _log2_exact, table1, table1_paper)
from .workload.step import (  # noqa: F401
    model_ops, StepWork, elementwise_items, step_work, _ops_messages, model_messages,
    step_cost, StepBreakdown, _nonempty, step_ops, step_breakdown)
