"""Moved to :mod:`summasim.costmodel.workload.zero`, :mod:`summasim.costmodel.workload.pipeline`, :mod:`summasim.costmodel.workload.tensor`, :mod:`summasim.costmodel.workload.mesh`, :mod:`summasim.costmodel.workload.stage_memory`, :mod:`summasim.costmodel.workload.composition`, :mod:`summasim.costmodel.workload.measured`.

A re-export of every name the old module had, for the importers not moved yet; it goes
with them."""

from .workload.zero import (  # noqa: F401
    ZERO_STAGES, BUCKET_BYTES, HALF_DTYPES, _RING_ALGORITHM, StateBytes, _int_pieces,
    _states, model_state_bytes)
from .workload.pipeline import (  # noqa: F401
    SCHEDULES, _check_int, _check_schedule, bubble_fraction, in_flight, pipeline_time,
    overlap_exposed)
from .workload.tensor import (  # noqa: F401
    make_scheme, check_composition, Part, TensorMemory, TensorPrice, _membound_field,
    _gemm_seconds, _split_step, _sublist_at, _embedding_parts, tensor_memory,
    tensor_price)
from .workload.mesh import (  # noqa: F401
    MeshGroup, _MeshGrid, _Coll, _memory_bandwidth, model_flops)
from .workload.stage_memory import (  # noqa: F401
    _pieces, stage_memory, composition_memory, _rep_stages)
from .workload.composition import (  # noqa: F401
    Stage, _Setup, _cached, _setup, _zero3_gathers, stage_cost, pipeline_seconds,
    stage_tail, composition_breakdown, price_composition, predict_case,
    flatten_breakdown)
from .workload.measured import (  # noqa: F401
    ADAM_PASSES, mesh_features, predict_measured_mesh)
