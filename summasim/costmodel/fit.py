"""Moved: the pure regression to :mod:`summasim.costmodel.machine.regression`, the MPI
microbenchmarks (``run_fit``, ``MemoryProbe``, ``node_memory`` ...) to
:mod:`summasim.harness.fitbench`.

A re-export of every name the old module had, for the importers not moved yet; it goes
with them."""

from .machine.regression import (  # noqa: F401
    MiB, FitRejected, LinearFit, RegimeFit, _soft_l1, fit_alpha_beta, _unresolved,
    _small_and_large, fit_regimes, library_eager_threshold, split_huge, median_rel_err,
    log_sizes, gamma_reduce_from_collectives, fit_nonneg_linear, fit_shared_core,
    fit_elementwise)

#: The names that moved up to the harness, loaded on first use (importing the cost model
#: never imports mpi4py). By name, not by an import statement: this shim is the one
#: temporary edge from the cost model up to the harness, and goes with its importers.
_FITBENCH = ("MemoryProbe", "node_memory", "node_cache_bytes", "run_fit", "_Bench",
             "_touched", "_gemm_seconds", "_reduce_seconds_per_byte", "_cores", "_phys_mem",
             "_sleep_barrier")


def __getattr__(name):
    if name in _FITBENCH:
        import importlib

        return getattr(importlib.import_module("summasim.harness.fitbench"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
