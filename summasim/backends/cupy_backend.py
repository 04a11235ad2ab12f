"""CuPy backend: device arrays, handed to MPI directly or staged through pinned memory.

Mode selection (reported as ``comm_mode`` and ``comm_mode_reason``):

1. ``SUMMASIM_GPU_COMM=staged|direct|ipc`` forces a mode.
2. Otherwise "direct" when the MPI library says it is CUDA-aware: the MPI-4.1 info
   key ``mpi_memory_alloc_kinds`` of ``COMM_WORLD`` lists ``cuda``, or the vendor
   call ``MPIX_Query_cuda_support()`` returns 1.
3. Otherwise "ipc" when every rank of the job is on this node (the launcher's local
   rank count equals the job's size): device-to-device copies between the processes
   through CUDA IPC handles (:mod:`summasim.backends.ipc`).
4. Otherwise "staged": the PyPI MPI wheels are not CUDA-aware, and handing a device
   pointer to such an MPI segfaults instead of raising, so staging through pinned host
   buffers is the fallback.

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


GPU_COMM_MODES = ("staged", "direct", "ipc")


def gpu_comm_setting() -> str:
    """``SUMMASIM_GPU_COMM`` as the CuPy backend reads it ("" when unset); a ValueError
    naming the modes when it is none of them. The front-ends ask every rank before any
    work (:func:`summasim.comm.check_environment`), so a bad or differing value is one
    line and exit status 2, not an abort when the backend starts."""
    forced = os.environ.get("SUMMASIM_GPU_COMM", "").strip().lower()
    if forced and forced not in GPU_COMM_MODES:
        raise ValueError(f"SUMMASIM_GPU_COMM={forced!r}: expected one of "
                         f"{', '.join(GPU_COMM_MODES)}")
    return forced


def choose_mode(forced: str, aware: bool, why: str, ranks_on_node: int,
                world_size: int) -> tuple[str, str]:
    """``(comm_mode, reason)`` of the CuPy backend (pure; the rules of the module doc).

    ``forced``: ``SUMMASIM_GPU_COMM`` ("" when unset); ``aware``/``why``: what
    :func:`cuda_aware_mpi` found; ``ranks_on_node``: the launcher's count of ranks on
    this node; ``world_size``: ranks in the job.
    """
    if forced:
        if forced not in GPU_COMM_MODES:
            raise ValueError(f"SUMMASIM_GPU_COMM={forced!r}: expected one of "
                             f"{', '.join(GPU_COMM_MODES)}")
        return forced, "forced by SUMMASIM_GPU_COMM"
    if aware:
        return "direct", why
    if ranks_on_node >= world_size:
        return "ipc", (f"all {world_size} ranks on one node: CUDA IPC device-to-device "
                       f"(MPI not CUDA-aware: {why})")
    return "staged", (f"{world_size} ranks over several nodes ({ranks_on_node} on this "
                      f"one) and MPI not CUDA-aware ({why})")


def launcher_local_ranks() -> int | None:
    """Ranks on this node according to the launcher's environment (None: it says not)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE"):
        val = os.environ.get(var, "")
        if val.isdigit():
            return int(val)
    return None


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
        from mpi4py import MPI

        forced = (mode or os.environ.get("SUMMASIM_GPU_COMM", "")).strip().lower()
        aware, why = (False, "") if forced else cuda_aware_mpi()
        self.comm_mode, self.comm_mode_reason = choose_mode(
            forced, aware, why, launcher_local_ranks() or MPI.COMM_WORLD.Get_size(),
            MPI.COMM_WORLD.Get_size())
        self._pool = cupy.get_default_memory_pool()
        self._ipc_owned: list = []

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

    # -- CUDA IPC (comm_mode "ipc"; summasim.backends.ipc) ----------------------
    def ipc_alloc(self, nbytes: int):
        """A device buffer of ``nbytes`` outside CuPy's pool, and its IPC handle."""
        cupy = self.xp
        ptr = cupy.cuda.runtime.malloc(nbytes)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, None)
        buf = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        self._ipc_owned.append(ptr)   # freed never: peers may have it open until the end
        return buf, bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr))

    def ipc_open(self, handle: bytes, capacity: int):
        """A peer's outbox, opened once (cudaIpcOpenMemHandle)."""
        cupy = self.xp
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        mem = cupy.cuda.UnownedMemory(ptr, capacity, None)
        return cupy.ndarray((capacity,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def ipc_copy(self, src, dst):
        """Device-to-device copy on the current stream (waited for by synchronize)."""
        self.xp.copyto(dst, src)
