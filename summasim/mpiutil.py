"""MPI helpers: abort on error, the input agreement, the one waiting loop, BLAS threads.

These use raw mpi4py communicators (untraced): they are bookkeeping, not part of
any algorithm's traffic.

Abort on an unhandled exception
-------------------------------
:func:`install_abort_hook` makes an exception that nobody catches end the whole job
(``MPI_Abort``) with the failing rank's ``[rank r/p]`` and traceback, instead of
leaving the other ranks waiting forever in their next collective. Opt out with
``SUMMASIM_ABORT_HOOK=0``. :func:`abort_on_error` does the same for one block.

Last words
----------
A job that ends early says which rank ended it and what that rank was doing
(:func:`doing` keeps a short description, e.g. "the preflight" or a run's label), and
unlinks the node's shared-memory segments that this process maps
(:func:`release_shared_memory`), which MPI would otherwise leave in ``/dev/shm`` when
the launcher kills the job. :func:`end_on_signals` turns SIGINT (Ctrl-C) and SIGTERM
into one line and exit status 128 + signal instead of a traceback per rank. A rank
killed outright (SIGKILL, the OOM killer) runs none of this: the launcher names its
process id, and the segment stays until the node is cleaned.

Agreement on arguments
----------------------
:func:`agree` is the one collective that makes a local argument check collective:
every rank checks its own arguments, then all ranks all-gather ``(signature, local
error)`` and either all raise the same error or none does. The public algorithms
(:mod:`summasim.algorithms`) and the transformer schemes' entry points use it; see
:mod:`summasim.algorithms._common` for what it costs. :func:`set_agreement` (or
``SUMMASIM_AGREE=0``, read at import) switches it off everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import zlib

import numpy as np
from mpi4py import MPI

from .cli import env_switch
from .jsonio import discard_unfinished
from .trace import untraced

_AGREE = env_switch("SUMMASIM_AGREE", True, strict=False)   # strictly: check_environment


# --------------------------------------------------------------------------- #
# abort on an unhandled exception                                             #
# --------------------------------------------------------------------------- #
_ABORT_GRACE_S = 1.0     # seconds between printing the last words and MPI_Abort


_DOING = ["starting", time.monotonic()]   # what this rank is doing, and since when


def doing(what: str | None = None) -> str:
    """Set what this rank is doing now when ``what`` is given (a few words that follow
    "it was", e.g. "in the preflight" or "running summa_ab 2x2 float64"); return the
    current description."""
    if what is not None:
        _DOING[:] = [str(what), time.monotonic()]
    return _DOING[0]


@contextlib.contextmanager
def heartbeat(every: float = 30.0, stream=None):
    """While the block runs, write ``summasim: still <doing()> (N s)`` to ``stream``
    (stderr by default) each time one :func:`doing` has lasted another ``every``
    seconds, so that a long row (one product of minutes) shows it is alive and where.

    A daemon thread that only reads ``doing()`` and prints: it makes no MPI call.
    Use it on one rank (the one that prints the report)."""
    stop = threading.Event()
    out = stream if stream is not None else sys.stderr

    def beat():
        said = None, 0                      # (the doing() spoken of, times said)
        while not stop.wait(min(every / 4, 5.0)):
            what, since = _DOING
            age = time.monotonic() - since
            told = said[1] if said[0] == (what, since) else 0
            if age >= every * (told + 1):
                print(f"summasim: still {what} ({age:.0f} s)", file=out, flush=True)
                said = (what, since), told + 1

    thread = threading.Thread(target=beat, name="summasim-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def mpi_library() -> str:
    """The MPI library's name and version in one line: the first line of
    ``MPI.Get_library_version()``, its whitespace collapsed and without the NUL that Open
    MPI's ends in (it would reach the report and the fitted machine's file)."""
    text = MPI.Get_library_version().replace("\0", " ").strip()
    return " ".join(text.splitlines()[0].split()) if text else "unknown MPI"


@contextlib.contextmanager
def activity(what: str):
    """``with activity("summa_ab 2x2 float64"): ...``: :func:`doing` for the block."""
    previous = doing()
    doing(what)
    try:
        yield
    finally:
        doing(previous)


#: Name prefixes of the MPI libraries' own segments in ``/dev/shm`` (MPICH; Open MPI's
#: vader/sm transports): only these are released, never a segment the user's own code
#: maps beside summasim.
MPI_SHM_PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")


def shared_memory_segments() -> list[str]:
    """The ``/dev/shm`` files of the MPI library (:data:`MPI_SHM_PREFIXES`) that this
    process maps and that still have a name: the node's intranode channel and shared
    windows. Read from ``/proc/self/maps``; empty where there is none (not Linux)."""
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)") \
                        and os.path.basename(path).startswith(MPI_SHM_PREFIXES) \
                        and path not in found:
                    found.append(path)
    except OSError:
        return []
    return found


def release_shared_memory() -> list[str]:
    """Unlink the shared-memory segments this process maps (on the way out of a job that
    ends early: the launcher's kill leaves them in ``/dev/shm``). The mappings stay valid
    for every rank that holds them; only the names go. Returns what was unlinked."""
    gone = []
    for path in shared_memory_segments():
        with contextlib.suppress(OSError):
            os.unlink(path)
            gone.append(path)
    return gone


def abort_job(comm, text: str) -> None:
    """Write ``text`` to stderr, give the launcher a moment to forward it, abort.

    ``MPI_Abort`` races the launcher's output forwarding: Hydra kills the job as
    soon as the abort reaches it and can drop what this rank wrote a moment before
    (the traceback went missing about one launch in thirty on the 2-core box). The
    pause (:data:`_ABORT_GRACE_S`) is on the error path only. The node's shared-memory
    segments are unlinked first (:func:`release_shared_memory`).
    """
    sys.stderr.write(text)
    sys.stderr.flush()
    release_shared_memory()
    time.sleep(_ABORT_GRACE_S)
    comm.Abort(1)


#: how long a rank other than 0 waits, after a signal, for rank 0 to end the job (the
#: launcher then kills it silently) before it says its own line
_SIGNAL_GRACE_S = 0.5
_SIGNALS = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


def end_on_signals(prog: str, rank: int) -> bool:
    """End this rank on SIGINT or SIGTERM with one line and status 128 + signal.

    A launcher forwards Ctrl-C (and its own SIGTERM, e.g. from ``timeout``) to every
    rank. Python's default turns it into a ``KeyboardInterrupt`` traceback on each rank
    that is running Python code, while a rank inside an MPI call never sees it and the
    job waits. Here the signal wakes a watcher thread (``signal.set_wakeup_fd``, so it
    works while the main thread is inside MPI); rank 0 writes ``<prog>: interrupted
    (SIGINT) on rank 0; it was <doing>; the job ends`` and exits at once. The others
    wait :data:`_SIGNAL_GRACE_S`: if the launcher has not ended them by then (the signal
    reached this rank alone), they say their own line. Each unlinks the node's shared
    memory first. Main thread only; returns False where it cannot be installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    try:
        signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        for sig in _SIGNALS:
            signal.signal(sig, lambda *_: None)     # the watcher ends the rank
    except (ValueError, OSError):
        return False

    def watch():
        try:
            data = os.read(rfd, 1)
        except OSError:
            return
        sig = signal.Signals(data[0]) if data else signal.SIGTERM
        if sig not in _SIGNALS:
            return
        if rank != 0:
            time.sleep(_SIGNAL_GRACE_S)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"{prog}: {_SIGNALS[sig]} on rank {rank}; it was {doing()}; "
                             f"the job ends\n")
            sys.stderr.flush()
        release_shared_memory()
        discard_unfinished()             # a report half-way to its rename: no temp file
        os._exit(128 + int(sig))

    threading.Thread(target=watch, name="summasim-signals", daemon=True).start()
    return True


def _abort_with(comm, text: str) -> None:
    """Print ``[rank r/p] unhandled exception, aborting the job: it was <doing>`` and
    ``text``; abort."""
    abort_job(comm, f"[rank {comm.Get_rank()}/{comm.Get_size()}] unhandled exception, "
                    f"aborting the job: it was {doing()}\n{text}")


@contextlib.contextmanager
def abort_on_error(comm=None):
    """Abort the whole job (``MPI_Abort``) on an unhandled exception in the block.

    The failing rank prints ``[rank r/p]`` and its traceback to stderr first, so
    a failure on one rank never leaves the others waiting in a collective.
    ``SystemExit`` passes through (argument errors exit on every rank alike).
    """
    comm = comm or MPI.COMM_WORLD
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - anything else must take the job down
        _abort_with(comm, traceback.format_exc())


def abort_hook_wanted() -> bool:
    """False when ``SUMMASIM_ABORT_HOOK`` is 0/false/no/off (the opt-out)."""
    return env_switch("SUMMASIM_ABORT_HOOK", True, strict=False)


def install_abort_hook() -> bool:
    """Make an unhandled exception on any rank end the whole MPI job.

    Installs a :data:`sys.excepthook` that prints ``[rank r/p] unhandled exception,
    aborting the job:`` and the traceback to stderr, then calls
    ``MPI.COMM_WORLD.Abort(1)``; without it the other ranks of a job wait forever
    in their next collective. Nothing is installed (the previous hook stays) when the
    world has one rank or ``SUMMASIM_ABORT_HOOK=0``. Idempotent.

    Returns
    -------
    bool
        Whether the hook is installed now.

    Notes
    -----
    Only exceptions that reach the interpreter's top level pass through
    ``sys.excepthook``; ``SystemExit`` never does, and pytest catches test failures
    itself (mpi_tests/conftest.py aborts those). Exceptions in threads other than the
    main one end only their thread and are left alone.
    """
    if getattr(sys.excepthook, "_summasim_abort", False):
        return True
    if not abort_hook_wanted() or MPI.COMM_WORLD.Get_size() == 1:
        return False

    def hook(exc_type, exc, tb):
        _abort_with(MPI.COMM_WORLD, "".join(traceback.format_exception(exc_type, exc, tb)))

    hook._summasim_abort = True          # marks our hook (idempotence)
    hook.previous = sys.excepthook       # what it replaced, for the curious
    sys.excepthook = hook
    return True


def set_agreement(on: bool) -> bool:
    """Switch the collective agreement of the public entry points on or off (this
    process; every rank must choose alike). Returns the previous setting."""
    global _AGREE
    previous, _AGREE = _AGREE, bool(on)
    return previous


def agreement_enabled() -> bool:
    """Whether the public entry points run the collective agreement."""
    return _AGREE


@contextlib.contextmanager
def agreement(on: bool):
    """``with agreement(False): ...`` runs the block with the agreement switched off."""
    previous = set_agreement(on)
    try:
        yield
    finally:
        set_agreement(previous)


def shape_of(x):
    """A picklable description of an argument for a signature: its shape, or its type."""
    shape = getattr(x, "shape", None)
    return tuple(int(n) for n in shape) if shape is not None else type(x).__name__


def dtype_of(x) -> str:
    """The dtype's name, or the type's when ``x`` is not an array."""
    dt = getattr(x, "dtype", None)
    return str(dt) if dt is not None else type(x).__name__


def fingerprint(x) -> str:
    """``"(2, 5) int64 crc32 1a2b3c4d"``: shape, dtype and a checksum of the contents
    (small arrays such as token ids; a device array is copied to the host)."""
    if x is None or not hasattr(x, "shape"):
        return type(x).__name__
    host = x.get() if hasattr(x, "get") and not hasattr(x, "__array_interface__") else x
    try:
        crc = zlib.crc32(np.ascontiguousarray(host).view(np.uint8).reshape(-1))
    except (TypeError, ValueError):      # not a plain numeric array: shape and dtype only
        return f"{shape_of(x)} {dtype_of(x)}"
    return f"{shape_of(x)} {dtype_of(x)} crc32 {crc:08x}"


def fields_of(obj, prefix: str) -> dict:
    """``{"prefix.field": value}`` of a dataclass (dtypes by name), for a signature."""
    if not dataclasses.is_dataclass(obj):
        return {prefix: type(obj).__name__}
    out = {}
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        out[f"{prefix}.{f.name}"] = val if isinstance(val, (int, float, str, bool)) \
            else getattr(val, "__name__", str(val))
    return out


def local_error(check, *args, **kwargs):
    """``(check(*args, **kwargs), None)``, or ``(None, error)`` if it raised
    ``ValueError``/``TypeError`` (to be shared by :func:`agree`, not raised alone)."""
    try:
        return check(*args, **kwargs), None
    except (TypeError, ValueError) as e:
        return None, e


def raw_mpi(comm):
    """The raw mpi4py communicator of a summasim Comm (``.mpi``), a grid (its
    ``world``) or an mpi4py communicator itself (:func:`summasim.trace.untraced`, which
    takes anything else as it is; here anything else is a TypeError)."""
    raw = untraced(comm)
    if isinstance(raw, MPI.Comm):
        return raw
    raise TypeError(f"expected a communicator or a grid, got {type(comm).__name__}")


def ranks_text(ranks: list[int]) -> str:
    """``[0]`` -> "rank 0"; ``[1, 2, 3, 5]`` -> "ranks 1-3, 5"."""
    from .cli import number_ranges

    return ("rank " if len(ranks) == 1 else "ranks ") + number_ranges(ranks)


def _groups(values: list) -> list:
    """``[(value, ranks holding it)]`` in the order of each value's first rank."""
    out: list = []
    for r, v in enumerate(values):
        for val, ranks in out:
            if val == v:
                ranks.append(r)
                break
        else:
            out.append((v, [r]))
    return out


def _strip(fn: str, msg: str) -> str:
    """``msg`` without a leading "fn: " or "module: " (the combined message starts so)."""
    for prefix in (f"{fn}: ", f"{fn.split('.')[0]}: "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _joined(parts: list, limit: int = 4) -> str:
    more = f"; ... ({len(parts) - limit} more)" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


def _wait_policy(comm) -> str:
    """The wait policy of a summasim Comm or of a grid's world; "spin" for a raw comm."""
    policy = getattr(comm, "wait_policy", None) or getattr(getattr(comm, "world", None),
                                                           "wait_policy", None)
    return policy if policy in ("sleep", "yield") else "spin"


WAIT_POLICIES = ("spin", "sleep", "yield")
SLEEP_S = 20e-6


def wait_requests(reqs, policy: str = "sleep", longest: float | None = None) -> None:
    """Complete raw mpi4py requests: the one waiting loop of summasim.

    ``"spin"``: ``MPI_Waitall``. ``"yield"``: ``MPI_Testall`` then ``sched_yield``.
    ``"sleep"``: ``MPI_Testall`` then a nap of 20 us, growing by 1.5x per nap up to
    ``longest`` seconds when given (for long waits: an idle rank wakes rarely), so a
    waiting rank gives its core to the ranks that compute (oversubscription).
    """
    reqs = list(reqs) if isinstance(reqs, (list, tuple)) else [reqs]
    if policy == "spin":
        MPI.Request.Waitall(reqs)
        return
    nap = SLEEP_S
    while not MPI.Request.Testall(reqs):
        if policy == "yield":
            os.sched_yield()
        else:
            time.sleep(nap)
            if longest is not None:
                nap = min(longest, nap * 1.5)


#: The longest nap of a rank that waits for another rank's long work (a reference, a
#: ceiling): its naps grow from 20 us by 1.5x to this, so it wakes about 100 times a
#: second instead of 50,000 times, and leaves the cores to the rank that works.
LONG_WAIT_NAP_S = 0.01


def quiet_barrier(comm, longest: float | None = None) -> None:
    """A barrier over a raw mpi4py communicator that waits without spinning (untraced);
    ``longest``: the cap of its growing naps (None: 20 us naps, for short waits)."""
    wait_requests(comm.Ibarrier(), "sleep", longest)


def allgather_objects(raw, obj, policy: str = "spin") -> list:
    """``raw.allgather(obj)`` (small picklable objects), waiting by ``policy``.

    "spin" is mpi4py's blocking ``allgather`` (one collective); "sleep"/"yield" (what an
    oversubscribed Comm uses) pickle by hand and run a non-blocking ``Iallgather`` of the
    lengths and an ``Iallgatherv`` of the bytes, so that a waiting rank does not keep a
    core from the ranks that are still on their way (measured: a spinning agreement
    added milliseconds to a 64 x 64 SUMMA at p = 4 on 2 busy cores).
    """
    if policy == "spin":
        return raw.allgather(obj)
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    size = raw.Get_size()
    counts = np.empty(size, np.int64)
    wait_requests(raw.Iallgather(np.array([data.size], np.int64), counts), policy)
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    buf = np.empty(int(counts.sum()), np.uint8)
    wait_requests(raw.Iallgatherv(data, [buf, (counts.tolist(), displs.tolist()), MPI.BYTE]), policy)
    return [pickle.loads(buf[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def agree(fn: str, comm, signature: dict, error: BaseException | None = None) -> None:
    """Collective: every rank raises the same error, or none does.

    Parameters
    ----------
    fn : str
        The public function's name (the first word of every message).
    comm : Comm, grid or mpi4py.MPI.Comm
        The ranks that must agree (a grid: its ``world``). Its raw communicator
        carries, untraced and waited for by the Comm's wait policy, one ``Iallreduce``
        (MAX) of 3 int64: a 56-bit digest of the signature, its negation and a failure
        flag. Only when they show a difference or a failure does a pickled all-gather
        of every signature and error follow (:func:`allgather_objects`), to say what.
    signature : dict or callable
        ``{what: value}`` (or a function returning it, called only when the agreement
        runs, so a switched-off agreement costs nothing) that must be equal on every
        rank (small picklable values;
        a key ending in "dtype" makes a difference a ``TypeError``), e.g.
        ``{"dtype": "float64", "A block shape": (5, 8)}``.
    error : ValueError or TypeError, optional
        This rank's local check failure.

    Raises
    ------
    ValueError or TypeError
        On every rank alike: the local error itself if every rank had that same
        error; else, if any rank failed, the lowest failing rank's error type with
        each distinct message and the ranks that raised it (``summa_ab: bad input on
        rank 0: ...; ranks 1-3 passed the checks``); else, if the signatures differ,
        e.g. ``summa_ab: ranks disagree on the A block shape: rank 0 has (5, 8),
        ranks 1-3 have (6, 8)``.

    Notes
    -----
    Switched off (:func:`set_agreement`), or on one rank, it only raises ``error``.
    """
    raw = raw_mpi(comm) if _AGREE else None
    if raw is None or raw.Get_size() == 1:
        if error is not None:
            raise error
        return
    if callable(signature):
        signature = signature()
    policy = _wait_policy(comm)
    # fast path, one collective: the max of (digest, -digest, failed) over the ranks shows
    # whether every digest is the same and no rank failed (a digest that differs for equal
    # signatures only costs the slow path, which compares by ==)
    digest = _digest(fn, signature)
    mine = np.array([digest, -digest, error is not None], np.int64)
    top = np.empty(3, np.int64)
    wait_requests(raw.Iallreduce(mine, top, op=MPI.MAX), policy)
    if top[0] == digest and top[1] == -digest and not top[2]:
        return
    _disagreement(fn, raw, signature, error, policy)


def _digest(fn: str, signature: dict) -> int:
    data = repr((fn, signature)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def gather_agreed(fn: str, comm, signature, values, error: BaseException | None = None):
    """Collective: :func:`agree` on ``signature`` and, in the same collective, every
    rank's ``values`` (a few ints, e.g. its block shapes), returned as an int64 array
    ``[rank, value]`` on every rank.

    One ``Iallgather`` of ``3 + len(values)`` int64 (the signature's digest, a failure
    flag, the values) over the raw communicator, waited for by the Comm's wait policy.
    When a rank failed or the digests differ, every rank raises as :func:`agree` does.
    It runs whether or not the agreement is switched off: its caller needs the values
    (an uneven layout's global sizes, say).
    """
    raw = raw_mpi(comm)
    vals = [int(v) for v in values]
    if raw.Get_size() == 1:
        if error is not None:
            raise error
        return np.array([vals], np.int64).reshape(1, len(vals))
    if callable(signature):
        signature = signature()
    policy = _wait_policy(comm)
    digest = _digest(fn, signature)
    mine = np.array([digest, error is not None] + vals, np.int64)
    every = np.empty((raw.Get_size(), mine.size), np.int64)
    wait_requests(raw.Iallgather(mine, every), policy)
    if (every[:, 0] != digest).any() or every[:, 1].any():
        _disagreement(fn, raw, signature, error, policy)
        raise ValueError(f"{fn}: the ranks' checks differ")      # not reached
    return every[:, 2:]


def _disagreement(fn: str, raw, signature: dict, error, policy: str) -> None:
    """The slow path of :func:`agree`: gather every signature and error, raise."""
    # someone differs or failed (every rank knows it): gather everything to say what
    mine = None if error is None else (
        TypeError if isinstance(error, TypeError) else ValueError, str(error))
    everyone = allgather_objects(raw, (fn, signature, mine), policy)
    fn = everyone[0][0]                  # one prefix everywhere, even if the calls differ
    errors = [e for _, _, e in everyone]
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        kinds = _groups(errors)
        if len(failed) == len(errors) and len(kinds) == 1:
            raise error                  # the same error on every rank: as it is
        parts = [f"bad input on {ranks_text(ranks)}: {_strip(fn, e[1])}"
                 for e, ranks in kinds if e is not None]
        passed = [r for r, e in enumerate(errors) if e is None]
        if passed:
            parts.append(f"{ranks_text(passed)} passed the checks")
        raise errors[failed[0]][0](f"{fn}: {_joined(parts)}") from error
    sigs = [{"function": f, **s} for f, s, _ in everyone]
    diffs, etype = [], ValueError
    for key in dict.fromkeys(k for s in sigs for k in s):
        groups = _groups([s.get(key, "nothing") for s in sigs])
        if len(groups) == 1:
            continue
        if key.endswith("dtype"):
            etype = TypeError
        held = ", ".join(f"{ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {val}"
                         for val, ranks in groups[:4])
        more = f", ... ({len(groups) - 4} more)" if len(groups) > 4 else ""
        diffs.append(f"ranks disagree on the {key}: {held}{more}")
    if diffs:
        raise etype(f"{fn}: {_joined(diffs)}")


# --------------------------------------------------------------------------- #
# threads                                                                     #
# --------------------------------------------------------------------------- #
def blas_threads() -> tuple[int, list[str]]:
    """This process's BLAS threads now (the most of any BLAS loaded; 0 when none is) and
    the BLAS libraries (threadpoolctl's ``internal_api``: "openblas", "mkl", ...)."""
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return (max((int(i["num_threads"]) for i in blas), default=0),
            sorted({str(i.get("internal_api")) for i in blas}))


def limit_blas_threads(n: int | None = None):
    """Limit BLAS/OpenMP threads of this process (default: 1 under MPI with p > 1).

    The limit reaches only the libraries loaded when it is set, so SciPy's BLAS (its
    own OpenBLAS, which the NumPy backend's GEMMs call, :mod:`summasim.backends`) is
    loaded first: imported later, at the first GEMM, it ran with one thread per core
    on every rank, and 4 ranks on 2 cores spun 8 OpenBLAS threads (an Optimus 2x2 step
    of ``bench mesh``'s default model took 4.9 s instead of 0.2 s). Returns the
    threadpoolctl controller (keep it alive) or ``None``.
    """
    from threadpoolctl import threadpool_limits

    if n is None:
        if MPI.COMM_WORLD.Get_size() == 1:
            return None
        n = 1
    with contextlib.suppress(ImportError):
        import scipy.linalg.blas  # noqa: F401 -- loaded now, so the limit covers it
    return threadpool_limits(limits=int(n))
