"""CuPy backend: device arrays, handed to MPI directly or staged through pinned memory.

Mode selection (reported as ``comm_mode`` and ``comm_mode_reason``):

1. ``SUMMASIM_GPU_COMM=staged|direct`` forces a mode.
2. Otherwise "direct" when the MPI library says it is CUDA-aware: the MPI-4.1 info
   key ``mpi_memory_alloc_kinds`` of ``COMM_WORLD`` lists ``cuda``, or the vendor
   call ``MPIX_Query_cuda_support()`` returns 1.
3. Otherwise "staged": the PyPI MPI wheels are not CUDA-aware, and handing a device
   pointer to such an MPI segfaults instead of raising, so staging is the default.

Each rank uses device ``local_rank % device_count``; several ranks may share one GPU
(staged MPI works for that; NCCL would refuse it).
"""

from __future__ import annotations

import ctypes
import os


def cuda_aware_mpi() -> tuple[bool, str]:
    """Whether the MPI library reports CUDA support, and the evidence."""
    from mpi4py import MPI

    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
        if kinds and "cuda" in kinds:
            return True, f"mpi_memory_alloc_kinds = {kinds!r}"
    except Exception:  # noqa: BLE001 - an MPI older than 4.1
        kinds = None
    try:
        query = ctypes.CDLL(None).MPIX_Query_cuda_support
        query.restype = ctypes.c_int
        if query() == 1:
            return True, "MPIX_Query_cuda_support() = 1"
        return False, "MPIX_Query_cuda_support() = 0"
    except (AttributeError, OSError):
        pass
    return False, (f"no CUDA support reported (mpi_memory_alloc_kinds = {kinds!r}, "
                   "no MPIX_Query_cuda_support)")


def _local_rank() -> int:
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID"):
        val = os.environ.get(var, "")
        if val.isdigit():
            return int(val)
    return 0


def gpu_share(ranks_on_node: int) -> tuple[int, int]:
    """``(free bytes, ranks that share it)`` of this rank's GPU: the ranks of a node go
    round its GPUs (``local rank % device count``)."""
    import cupy

    ndev = cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(_local_rank() % ndev):
        free, _ = cupy.cuda.runtime.memGetInfo()
    return int(free), -(-ranks_on_node // ndev)


class CupyBackend:
    """Device arrays on the rank's GPU (see the module docstring for the MPI path)."""

    name = "cupy"
    on_device = True

    def __init__(self, mode: str | None = None):
        import cupy
        import cupyx

        self.xp = cupy
        self._cupyx = cupyx
        ndev = cupy.cuda.runtime.getDeviceCount()
        if ndev < 1:
            raise RuntimeError("the cupy backend needs a CUDA device; none was found")
        self.device = cupy.cuda.Device(_local_rank() % ndev)
        self.device.use()
        forced = (mode or os.environ.get("SUMMASIM_GPU_COMM", "")).strip().lower()
        if forced:
            if forced not in ("staged", "direct"):
                raise ValueError(f"SUMMASIM_GPU_COMM={forced!r}: expected 'staged' or 'direct'")
            self.comm_mode, self.comm_mode_reason = forced, "forced by SUMMASIM_GPU_COMM"
        else:
            aware, why = cuda_aware_mpi()
            self.comm_mode = "direct" if aware else "staged"
            self.comm_mode_reason = why
        self._pool = cupy.get_default_memory_pool()

    # -- arrays ---------------------------------------------------------------
    def asarray(self, x, dtype=None):
        return self.xp.ascontiguousarray(self.xp.asarray(x, dtype=dtype))

    def to_numpy(self, x):
        return self.xp.asnumpy(x)

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def empty_huge(self, shape, dtype):
        """:meth:`empty`: device memory has no page backing to choose."""
        return self.xp.empty(shape, dtype=dtype)

    def synchronize(self):
        """Wait for the current stream (before MPI touches a buffer it produced)."""
        self.xp.cuda.get_current_stream().synchronize()

    # -- memory ---------------------------------------------------------------
    def peak_memory(self) -> int:
        """Bytes held by CuPy's memory pool: the peak since :meth:`reset_peak_memory`."""
        return int(self._pool.total_bytes())

    def reset_peak_memory(self):
        self._pool.free_all_blocks()

    # -- compute --------------------------------------------------------------
    def gemm(self, a, b, c, *, trans_a=False, trans_b=False, accumulate=False):
        """``c = op(a) @ op(b) (+ c)``; the product's temporary comes from CuPy's pool."""
        opa = a.T if trans_a else a
        opb = b.T if trans_b else b
        if accumulate:
            c += opa @ opb
        else:
            self.xp.matmul(opa, opb, out=c)
        return c

    # -- staging --------------------------------------------------------------
    def pinned_empty(self, nbytes: int):
        """Page-locked host buffer of ``nbytes`` bytes (fast, async-capable copies)."""
        import numpy as np

        return self._cupyx.empty_pinned((nbytes,), dtype=np.uint8)

    def copy_to_host(self, src, dst):
        src.get(out=dst)

    def copy_from_host(self, src, dst):
        dst.set(src)
