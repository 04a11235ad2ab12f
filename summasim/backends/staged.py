"""A host backend that takes the staged path, so CI exercises GPU staging on CPU.

:class:`StagedHostBackend` behaves like the CuPy backend in staged mode: every
array handed to MPI is first copied into a reusable "pinned" host buffer and
copied back after the call. Its arrays are NumPy arrays, and it counts every copy
and buffer allocation so tests can check the staging logic exactly.
"""

from __future__ import annotations

import numpy as np

from .numpy_backend import NumpyBackend


class StagedHostBackend(NumpyBackend):
    """NumPy arrays, staged through host buffers like a non-CUDA-aware GPU path."""

    name = "staged-host"
    comm_mode = "staged"

    def __init__(self):
        super().__init__()
        self.reset_counters()

    def reset_counters(self):
        """Zero the copy and allocation counters."""
        self.d2h_copies = 0      # "device" -> staging buffer
        self.h2d_copies = 0      # staging buffer -> "device"
        self.pinned_allocs = 0   # staging buffers created
        self.syncs = 0           # stream synchronizations before MPI calls

    def synchronize(self):
        self.syncs += 1

    def pinned_empty(self, nbytes: int):
        """A fresh staging buffer of ``nbytes`` bytes (a plain host array here)."""
        self.pinned_allocs += 1
        return np.empty(nbytes, dtype=np.uint8)

    def copy_to_host(self, src, dst):
        """Copy array ``src`` into host buffer ``dst`` (same shape and dtype)."""
        self.d2h_copies += 1
        np.copyto(dst, src)

    def copy_from_host(self, src, dst):
        """Copy host buffer ``src`` into array ``dst``."""
        self.h2d_copies += 1
        np.copyto(dst, src)
