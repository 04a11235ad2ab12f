"""NumPy backend: host arrays, BLAS through SciPy for in-place accumulation."""

from __future__ import annotations

import ctypes
import functools
import mmap
import resource
import tracemalloc

import numpy as np

_THP = "/sys/kernel/mm/transparent_hugepage/"


@functools.lru_cache(maxsize=1)
def transparent_huge_pages() -> tuple[str | None, int]:
    """``(mode, page bytes)`` of the kernel's transparent huge pages: mode "always",
    "madvise" or "never" (None where the kernel does not say: not Linux, or no THP)
    and the huge page's size (2 MiB on x86-64; that size where the kernel does not say)."""
    try:
        with open(_THP + "enabled") as f:
            text = f.read()
        mode = text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return None, 2 << 20
    try:
        with open(_THP + "hpage_pmd_size") as f:
            size = int(f.read())
    except (OSError, ValueError):
        size = 2 << 20
    return mode, size


# successive huge-page buffers start this many bytes further past a huge-page boundary
# (modulo the page): 33 small pages and a cache line, so that no two of the first 15
# share their offset within a huge page (STREAM's OFFSET, for the same reason)
STAGGER_BYTES = 33 * 4096 + 64
_huge_buffers = 0


def empty_huge(shape, dtype):
    """``np.empty(shape, dtype)`` that the kernel can back with transparent huge pages
    from end to end, when it spans at least one huge page and the kernel offers them
    ("always", or "madvise").

    ``np.empty`` aligns to 64 bytes, so the kernel backs only the whole huge pages
    inside an array: a 4 MiB array almost always gets one 2 MiB page and 2 MiB of 4 KiB
    pages, and which part a ring chunk falls in is the luck of the allocation (and
    malloc may hand out reused heap instead of fresh pages). Here the array is a view of
    a fresh anonymous mapping advised ``MADV_HUGEPAGE``, three huge pages longer than
    the array, so every huge page the array touches lies inside it (the slack is never
    touched: virtual only). Each array starts :data:`STAGGER_BYTES` further past a
    huge-page boundary than the previous one did: buffers that all start on a boundary
    put equal offsets of two operands on the same cache sets and memory banks, which
    slowed a 64 MiB ring at p = 4 from 50 to 75 ms and ``MPI_Allreduce`` from 100 to
    130 ms (docs/performance.md). The mapping lives as long as the array (and views of
    it); tracemalloc does not see it."""
    global _huge_buffers
    dtype = np.dtype(dtype)
    shape = tuple(shape) if np.ndim(shape) else (int(shape),)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mode, page = transparent_huge_pages()
    if mode in (None, "never") or nbytes < page:
        return np.empty(shape, dtype)
    _huge_buffers += 1
    region = mmap.mmap(-1, nbytes + 3 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = (-raw.ctypes.data) % page + (_huge_buffers * STAGGER_BYTES) % page
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@functools.lru_cache(maxsize=None)
def _gemm_routine(dtype):
    from scipy.linalg import blas as _blas     # 0.2-0.4 s: imported where a GEMM runs

    try:
        return {np.dtype(np.float64): _blas.dgemm, np.dtype(np.float32): _blas.sgemm,
                np.dtype(np.complex128): _blas.zgemm, np.dtype(np.complex64): _blas.cgemm}[dtype]
    except KeyError:
        return None


# a GEMM of at least this many flops (about a millisecond and more) is called without the
# GIL (:func:`_gil_free_gemm`); below it, SciPy's wrapper, whose call costs ~1 us to the
# ~6 us of a ctypes call
GIL_FREE_FLOPS = 1 << 26
_INT32 = 1 << 31
_SCALARS = {np.dtype(np.float64): (ctypes.c_double, "dgemm"),
            np.dtype(np.float32): (ctypes.c_float, "sgemm"),
            np.dtype(np.complex128): (ctypes.c_double * 2, "zgemm"),
            np.dtype(np.complex64): (ctypes.c_float * 2, "cgemm")}


@functools.lru_cache(maxsize=None)
def _gil_free_gemm(dtype):
    """SciPy's own BLAS ``?gemm`` for ``dtype`` as a ctypes function (``None`` where it
    cannot be had), with ``alpha = 1`` and ``beta`` 0 or 1 ready as ctypes scalars.

    SciPy's ``scipy.linalg.blas`` wrappers hold the GIL for the whole call, so a long
    GEMM froze every other thread of the rank: the heartbeat and the watcher that ends a
    rank on SIGINT or SIGTERM (:func:`summasim.mpiutil.end_on_signals`). ctypes releases
    the GIL around a foreign call. The function is the one ``scipy.linalg.cython_blas``
    exports (its ``__pyx_capi__`` capsule): the same library, the same thread limits."""
    if dtype not in _SCALARS:
        return None
    scalar, name = _SCALARS[dtype]
    try:
        from scipy.linalg import cython_blas

        capsule = cython_blas.__pyx_capi__[name]
        # prototypes of their own: ctypes.pythonapi's functions are shared process-wide
        get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
            ("PyCapsule_GetName", ctypes.pythonapi))
        get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_GetPointer", ctypes.pythonapi))
        signature = get_name(capsule)
        if b"int *" not in signature:     # 32-bit dimensions, as _call_gil_free passes
            return None
        pointer = get_pointer(capsule, signature)
    except (ImportError, AttributeError, KeyError, ValueError, TypeError):
        return None
    if not pointer:
        return None
    vp = ctypes.c_void_p
    fn = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, *([vp] * 11))(pointer)
    one, zero = ((scalar(1.0, 0.0), scalar(0.0, 0.0)) if dtype.kind == "c"   # (re, im)
                 else (scalar(1.0), scalar(0.0)))
    return fn, one, zero


def _call_gil_free(fn, one, zero, a, b, c, trans_a: bool, trans_b: bool,
                   accumulate: bool) -> None:
    """``c = op(a) op(b) (+ c)`` through ``fn`` (:func:`_gil_free_gemm`), all three
    C-contiguous: column-major ``C^T = op(b)^T op(a)^T``, as the SciPy call below."""
    k = a.shape[0] if trans_a else a.shape[1]
    dim = ctypes.c_int
    ref = ctypes.byref
    m_, n_, k_ = dim(c.shape[1]), dim(c.shape[0]), dim(k)
    lda, ldb, ldc = dim(b.shape[1]), dim(a.shape[1]), dim(c.shape[1])
    fn(b"T" if trans_b else b"N", b"T" if trans_a else b"N", ref(m_), ref(n_), ref(k_),
       ref(one), b.ctypes.data, ref(lda), a.ctypes.data, ref(ldb),
       ref(one if accumulate else zero), c.ctypes.data, ref(ldc))


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

    def empty_huge(self, shape, dtype):
        """:meth:`empty` on transparent huge pages from end to end (:func:`empty_huge`):
        the message buffers of the benchmarks and of the accuracy runs, whose times
        should not depend on how malloc aligned them."""
        return empty_huge(shape, dtype)

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
        if not c.flags.writeable:      # SciPy's wrapper would write a copy and drop it
            raise ValueError("gemm: the output array c is read-only")
        routine = _gemm_routine(c.dtype)
        if (routine is None or not c.flags.c_contiguous or a.dtype != c.dtype
                or b.dtype != c.dtype or not a.flags.c_contiguous or not b.flags.c_contiguous
                or not (a.flags.aligned and b.flags.aligned and c.flags.aligned)
                or c.size == 0 or a.size == 0 or b.size == 0):
            # (a misaligned c: SciPy's wrapper would write an aligned copy and drop it)
            opa = a.T if trans_a else a
            opb = b.T if trans_b else b
            if accumulate:
                c += opa @ opb
            else:
                np.matmul(opa, opb, out=c)
            return c
        (ma, ka), (kb, nb) = a.shape[::-1] if trans_a else a.shape, \
            b.shape[::-1] if trans_b else b.shape
        if (2 * c.size * ka >= GIL_FREE_FLOPS and ka == kb and c.shape == (ma, nb)
                and max(ma, ka, nb) < _INT32):
            # (raw BLAS checks nothing: a mismatch goes on to SciPy's call, which raises;
            # cython_blas takes 32-bit dimensions)
            free = _gil_free_gemm(c.dtype)
            if free is not None:
                _call_gil_free(*free, a, b, c, trans_a, trans_b, accumulate)
                return c
        # Row-major C = op(a) op(b) is column-major C^T = op(b)^T op(a)^T. The
        # Fortran view of a C-contiguous x is x.T, so op(x)^T is x.T (trans=0)
        # when op is the identity and x (trans=1 on x.T) when op is a transpose.
        routine(1.0, b.T, a.T, beta=1.0 if accumulate else 0.0, c=c.T,
                trans_a=int(trans_b), trans_b=int(trans_a), overwrite_c=1)
        return c
