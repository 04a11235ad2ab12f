"""NumPy backend: host arrays, BLAS through SciPy for in-place accumulation."""

from __future__ import annotations

import resource
import tracemalloc

import numpy as np
from scipy.linalg import blas as _blas


def _gemm_routine(dtype):
    try:
        return {np.dtype(np.float64): _blas.dgemm, np.dtype(np.float32): _blas.sgemm,
                np.dtype(np.complex128): _blas.zgemm, np.dtype(np.complex64): _blas.cgemm}[dtype]
    except KeyError:
        return None


class NumpyBackend:
    """Host arrays; MPI receives them as they are (``comm_mode == "host"``)."""

    name = "numpy"
    comm_mode = "host"
    on_device = False      # its arrays are host memory (see :func:`summasim.backends.to_backend`)

    def __init__(self):
        self.xp = np

    # -- arrays ---------------------------------------------------------------
    def asarray(self, x, dtype=None):
        return np.ascontiguousarray(x, dtype=dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def synchronize(self):
        """Nothing to wait for on the host."""

    # -- memory ---------------------------------------------------------------
    def peak_memory(self) -> int:
        """Peak bytes: traced NumPy allocations under ``tracemalloc``, else peak RSS."""
        if tracemalloc.is_tracing():
            return tracemalloc.get_traced_memory()[1]
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory(self):
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()

    # -- compute --------------------------------------------------------------
    def gemm(self, a, b, c, *, trans_a=False, trans_b=False, accumulate=False):
        """``c = op(a) @ op(b) (+ c if accumulate)`` written into ``c`` in place.

        ``c`` must be C-contiguous; ``a`` and ``b`` C-contiguous too. Uses BLAS
        ``?gemm`` on the transposed (Fortran-ordered) views, so no temporary is
        allocated: C^T = op(b)^T op(a)^T.
        """
        routine = _gemm_routine(c.dtype)
        if (routine is None or not c.flags.c_contiguous or a.dtype != c.dtype
                or b.dtype != c.dtype or not a.flags.c_contiguous or not b.flags.c_contiguous
                or c.size == 0 or a.size == 0 or b.size == 0):
            opa = a.T if trans_a else a
            opb = b.T if trans_b else b
            if accumulate:
                c += opa @ opb
            else:
                np.matmul(opa, opb, out=c)
            return c
        # Row-major C = op(a) op(b) is column-major C^T = op(b)^T op(a)^T. The
        # Fortran view of a C-contiguous x is x.T, so op(x)^T is x.T (trans=0)
        # when op is the identity and x (trans=1 on x.T) when op is a transpose.
        routine(1.0, b.T, a.T, beta=1.0 if accumulate else 0.0, c=c.T,
                trans_a=int(trans_b), trans_b=int(trans_a), overwrite_c=1)
        return c
