"""Moved to :mod:`summasim.costmodel.workload.pricer`, :mod:`summasim.costmodel.workload.predict`.

A re-export of every name the old module had, for the importers not moved yet; it goes
with them."""

from .workload.pricer import (  # noqa: F401
    _UNIT_SHARED, COPY_STREAMS, ADD_STREAMS, ADD_OUT_STREAMS, _GROUP_SHAPES,
    group_spans_nodes, Prediction, _Pricer, make_pricer, _resolve_p, shared_core_time,
    _POINT_TO_POINT, _Tally, _finish, _raise_to_floor, _combine, _count, Messages,
    summary_messages)
from .workload.predict import (  # noqa: F401
    _compute_seconds, predict_trace, SharedFeatures, trace_features, predict_features,
    merge_features, _worst_coords, price_messages, predict_algorithm)
