"""Array backends: NumPy on the CPU, CuPy on the GPU.

The backend is chosen once, at the edge (``summasim.run``, test fixtures), with
:func:`get_backend`. Everything inside summasim takes the array module from its
inputs with :func:`array_module` and never imports NumPy or CuPy by name.

A backend object has:

``name``            "numpy", "cupy", "staged-host" or "ipc-host"
``xp``              the array module
``on_device``       whether its arrays live on a device (CuPy); a host array handed to a
                    device backend's communicator goes to MPI as it is, never staged
``comm_mode``       how :class:`summasim.comm.Comm` hands its arrays to MPI:
                    "host" (they are host memory), "direct" (device pointers to a
                    CUDA-aware MPI), "staged" (copied through pinned host buffers) or
                    "ipc" (device to device between the processes of a node,
                    :mod:`summasim.backends.ipc`)
``asarray(x, dtype=None)``, ``to_numpy(x)``, ``empty(shape, dtype)``,
``zeros(shape, dtype)``, ``synchronize()``, ``peak_memory()``,
``reset_peak_memory()``, ``gemm(a, b, c, ...)``
and, for staged backends, ``pinned_empty(nbytes)``, ``copy_to_host(src, dst)``,
``copy_from_host(src, dst)``; for "ipc" ones also ``ipc_alloc(nbytes)``,
``ipc_open(handle, capacity)`` and ``ipc_copy(src, dst)``.
"""

from __future__ import annotations

import sys

import numpy as np

from .numpy_backend import NumpyBackend
from .ipc import IpcHostBackend
from .staged import StagedHostBackend

#: every backend's name; the two host stand-ins run NumPy arrays through the GPU's
#: staged and IPC paths, for CI
NAMES = ("numpy", "cupy", "staged-host", "ipc-host")
_NAMES = NAMES
_cache: dict = {}


def get_backend(name: str = "numpy"):
    """Return the backend called ``name`` (one of :data:`NAMES`).

    The instance is created once per process and reused, so its pinned buffers and
    its memory statistics persist across calls. ``"cupy"`` where CuPy or a GPU is
    missing: a ``RuntimeError`` saying which (:func:`unavailable`).
    """
    if not isinstance(name, str) or name not in _NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(_NAMES)}")
    if name not in _cache:
        if name == "numpy":
            _cache[name] = NumpyBackend()
        elif name == "staged-host":
            _cache[name] = StagedHostBackend()
        elif name == "ipc-host":
            _cache[name] = IpcHostBackend()
        else:
            why = unavailable(name)
            if why:                 # the library caller's error: what is missing, and how
                raise RuntimeError(f"get_backend: {why.replace('--backend cupy', 'cupy')}")
            from .cupy_backend import CupyBackend  # imports cupy: only on request

            _cache[name] = CupyBackend()
    return _cache[name]


def unavailable(name: str) -> str:
    """Why backend ``name`` cannot run in this process ("" when it can): a user error for
    a front end's preflight, found before any data moves. Only "cupy" can be missing:
    CuPy not installed, or no CUDA device visible to it."""
    if name != "cupy":
        return ""
    try:
        import cupy
    except ImportError:
        return ("--backend cupy needs CuPy (pip install 'summasim[cupy]') and a GPU; "
                "CuPy is not installed here")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDA's own errors (no driver, no device)
        return f"--backend cupy needs a GPU; CUDA found none ({exc})"
    return "" if count > 0 else "--backend cupy needs a GPU; CUDA found none"


def device_share(name: str, ranks_on_node: int):
    """For a device backend, ``(free bytes, ranks sharing it)`` of this rank's GPU, what
    a preflight checks a run's device memory against; ``None`` for a host backend.
    Call it only where :func:`unavailable` says the backend can run."""
    if name != "cupy":
        return None
    from .cupy_backend import gpu_share

    return gpu_share(ranks_on_node)


def is_device_array(x) -> bool:
    """True for a CuPy array (without importing CuPy when it was never loaded)."""
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def backend_of(x):
    """The default backend for an array: "cupy" for device arrays, else "numpy"."""
    return get_backend("cupy" if is_device_array(x) else "numpy")


def to_backend(backend, arrays: dict) -> dict:
    """The values of ``arrays`` on ``backend``'s device: copied there for a device backend
    (CuPy), returned unchanged (the same dict) for a host one or ``backend=None``. The
    harness builds parameters and inputs on the host and moves a rank's shards with it."""
    if backend is None or not getattr(backend, "on_device", False):
        return arrays
    return {k: backend.asarray(v) for k, v in arrays.items()}


def array_module(*arrays):
    """The array module (``numpy`` or ``cupy``) of the given arrays.

    Raises ``TypeError`` when host and device arrays are mixed.
    """
    for a in arrays:                    # plain host arrays, the common case, looked up fast
        if type(a) is not np.ndarray:
            break
    else:
        if arrays:
            return np
    kinds = {is_device_array(a) for a in arrays}
    if len(kinds) > 1:
        raise TypeError("mixed host (NumPy) and device (CuPy) arrays in one call")
    return backend_of(arrays[0]).xp if arrays else get_backend("numpy").xp


__all__ = ["get_backend", "unavailable", "device_share", "backend_of", "array_module",
           "is_device_array", "to_backend", "NumpyBackend", "StagedHostBackend",
           "IpcHostBackend", "NAMES"]
