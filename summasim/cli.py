"""Argument checks shared by summasim's command lines.

The rule (DESIGN.md, reliability): a user error (arguments, files, models that
cannot exist) gets ONE message, ``<prog>: error: <what is wrong>``, on stderr from
rank 0, and exit status 2, found before any work is done; never a traceback.

This module is the toolbox for that rule. It imports only the standard library
(no NumPy, no mpi4py), so any floor of summasim, and any front-end, may use it.

Three kinds of tools
--------------------
argparse ``type=`` callables
    They turn one command-line string into a checked value or raise
    :class:`argparse.ArgumentTypeError`, which argparse reports as
    ``argument --lr: must be a finite number > 0, got 'nan'``::

        ap.add_argument("--lr", type=cli.finite_positive_float)
        ap.add_argument("--batch", type=cli.positive_int, default=8)
        ap.add_argument("--groups", type=cli.int_list(minimum=2))
        ap.add_argument("--machine", type=cli.existing_file)
        ap.add_argument("--json", type=cli.writable_path)       # only when given

    ========================  =====================================================
    positive_int              integer >= 1 ("8", also integral "1e3"; not "1.5")
    byte_size                 bytes: "4M", "64MiB", "512k", "0.5M", "1048576" (>= 1)
    nonnegative_int           integer >= 0
    int_at_least(m)           factory: integer >= m
    finite_float              any finite number (not nan, inf)
    finite_positive_float     finite number > 0 (learning rates, sizes in GiB)
    finite_nonnegative_float  finite number >= 0 (weight decay, budgets)
    float_range(lo, hi, ...)  factory: finite number in [lo, hi] (ends open on request)
    int_list(minimum=1)       factory: comma-separated integers, each >= minimum
    choice_list(names)        factory: comma-separated names, each one of ``names``
    existing_file             a path to a readable regular file
    writable_path             a file path that can be written: its folder exists and
                              the file can be created there (tried for real)
    report_path(kind)         factory: a ``--json``/``--out`` report path of one kind
                              (with ``action=ReportAction``; see "Reports" below)
    writable_dir              a folder that exists or can be created and is writable
    ========================  =====================================================

    :func:`module_available` tells whether an optional package (``torch``,
    ``matplotlib``) can be imported, without importing it, for options that need one.

    Do not give ``writable_path``/``writable_dir`` to an option whose default is a
    string that is not always written: argparse converts string defaults through
    ``type=`` too, so the probe (which creates the folder) would run on every call.
    Check such paths after parsing with :func:`check_writable_path` /
    :func:`check_writable_dir` when the output is actually requested.

Checks after parsing
    For what one argument cannot tell (``--heads`` must divide ``--h``; a file
    that must parse; the output folder only when an output is asked for), raise
    :class:`UsageError` with a message that names the argument, and let the
    front-end report it with ``parser.error(str(exc))``::

        try:
            plan = check_args(args)            # raises cli.UsageError
        except cli.UsageError as exc:
            ap.error(str(exc))                 # one line, exit 2 (SystemExit)
            # or: return cli.print_error(ap.prog, exc)   (same line, returns 2)

    :func:`require` is a one-line form: ``cli.require(h % n == 0, "--heads ...")``.
    :func:`check_existing_file`, :func:`check_writable_path` and
    :func:`check_writable_dir` are the file checks behind the types above, raising
    :class:`UsageError` (prefix the argument: ``f"argument --out: {exc}"``).

:class:`ArgumentParser`
    A drop-in :class:`argparse.ArgumentParser` whose ``error()`` prints exactly one
    line (no usage block: the message names the argument; ``--help`` has the rest)
    and exits 2, printed only by rank 0 when launched under an MPI launcher (see
    :func:`launcher_rank`; the other ranks exit 2 silently). Sub-parsers made with
    ``add_subparsers().add_parser`` inherit the class.

Input files
    :func:`read_json_file` is THE reader of every file a user names (``--machine FILE``,
    measurements, any JSON a command reads). It refuses, without blocking, whatever is
    not a regular file (a FIFO, a device such as ``/dev/zero``, a folder), reads at most
    :data:`MAX_INPUT_BYTES`, nests at most :data:`MAX_JSON_DEPTH` levels, and rejects
    NaN, infinities, duplicate keys and text that is not UTF-8; every refusal is a
    :class:`UsageError` that starts with the path and says what is wrong.

Reports
    A report says what it is in its top-level field :data:`REPORT_FIELD`
    (``"summasim_report": "run"``); reports written before that field existed are
    recognised by their top-level keys (:data:`LEGACY_KEYS`). An output option is
    declared with ``type=report_path(kind), action=ReportAction`` and the command adds
    ``--force`` with :func:`add_force`; the value is a :class:`ReportPath` (a ``str``
    that carries its kind and whether ``--force`` was given), so
    :func:`check_writable_path` refuses, before any work, to replace a file that is not
    a summasim report of the same kind, and :func:`summasim.jsonio.write_report` writes
    the tagged report (or saves it elsewhere, and says where, when the write fails).

Messages name the argument as the user typed it (``--lr``), the value received,
and what would be accepted, on one line.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import re
import os
import signal
import stat
import sys
import tempfile
from typing import Callable, Iterable, NoReturn

__all__ = [
    "ArgumentParser", "UsageError", "require", "print_error", "launcher_rank", "one_line",
    "positive_int", "nonnegative_int", "byte_size", "int_at_least", "int_list", "choice_list",
    "finite_float", "finite_positive_float", "finite_nonnegative_float", "float_range",
    "existing_file", "writable_path", "writable_dir",
    "check_existing_file", "check_writable_path", "check_writable_dir", "module_available",
    "available_memory", "launcher_rank0_output",
    "read_json_file", "MAX_INPUT_BYTES", "MAX_JSON_DEPTH", "REPORT_FIELD", "report_kind",
    "ReportPath", "report_path", "ReportAction", "ForceAction", "add_force",
]

#: Environment variables through which MPI launchers give a process its rank
#: (MPICH/Hydra and Intel MPI, Open MPI, PMIx, MVAPICH2, Slurm's srun).
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
                  "SLURM_PROCID")


class UsageError(ValueError):
    """THE user error of every summasim command: a mistake in the arguments or files
    (cross-argument, file content, model shape), found before any work.

    The message names the offending argument(s) and fits on one line; front-ends
    print it as ``<prog>: error: <message>`` and exit with status 2 (the MPI
    front-ends through :func:`summasim.harness.frontend.mpi_main`).
    """

    exit_status = 2


def argument_error(flag: str, message) -> UsageError:
    """The :class:`UsageError` of one argument: ``argument <flag>: <message>``."""
    return UsageError(f"argument {flag}: {message}")


def require(condition: bool, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)


def launcher_rank() -> int:
    """This process's rank as an MPI launcher announced it in the environment, else 0.

    Needs no MPI import, so arguments can be checked (and one rank can speak) before
    ``MPI_Init``. Unparsable values count as 0.
    """
    for var in RANK_VARIABLES:
        val = os.environ.get(var)
        if val is not None:
            try:
                return int(val)
            except ValueError:
                return 0
    return 0


def one_line(message: str) -> str:
    """``message`` with its lines joined by spaces (errors are one line)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def print_error(prog: str, message) -> int:
    """Write ``<prog>: error: <message>`` as one line to stderr (rank 0 only, by
    :func:`launcher_rank`); return the exit status, so a ``main()`` can
    ``return cli.print_error(parser.prog, exc)``: 2, a user error's, unless ``message`` is
    an error with an ``exit_status`` of its own (a report the work could not write: 1)."""
    if launcher_rank() == 0:
        sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
        sys.stderr.flush()
    return getattr(message, "exit_status", 2)


class _GuardedStdout:
    """``sys.stdout`` while a command runs (:func:`guarded_stdout`): what the work prints
    cannot end the work. A reader that went away (``... | head -1``) sends the rest to
    devnull and sets :attr:`lost`, so the reports the user asked for are still written
    (the command then exits 1: what it printed was not all read); text the stream cannot
    encode (a path in UTF-8 under ``PYTHONIOENCODING=ascii``) is written with backslash
    escapes."""

    def __init__(self, stream):
        self._stream = stream
        self.lost = False

    def _gone(self) -> None:
        self.lost = True
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()        # the buffered rest, now into devnull

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
        except UnicodeEncodeError:
            enc = getattr(self._stream, "encoding", None) or "ascii"
            try:
                return self._stream.write(text.encode(enc, "backslashreplace").decode(enc))
            except BrokenPipeError:
                self._gone()
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_stdout():
    """Run the block with ``sys.stdout`` guarded (:class:`_GuardedStdout`, given to
    ``as``); a closed stdout (``>&-``, ``sys.stdout`` None) is devnull meanwhile. Put
    back on exit."""
    before = sys.stdout
    null = open(os.devnull, "w", encoding="utf-8") if before is None else None
    guard = sys.stdout = _GuardedStdout(null if before is None else before)
    try:
        yield guard
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        sys.stdout = before
        if null is not None:
            null.close()


#: The words an on/off ``SUMMASIM_*`` switch takes (any case), and what they mean.
SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                "0": False, "false": False, "no": False, "off": False}


def env_switch(name: str, default: bool, strict: bool = True) -> bool:
    """The on/off environment variable ``name`` (:data:`SWITCH_WORDS`; unset or blank:
    ``default``). Another value raises ``ValueError`` naming it, or, not ``strict`` (a
    module reading it at import, whose front-end checks it strictly before any work), is
    taken as ``default``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in SWITCH_WORDS:
        return SWITCH_WORDS[raw]
    if strict:
        raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no "
                         f"or on/off")
    return default


def check_working_folder() -> None:
    """Raise :class:`UsageError` when the current folder no longer exists (deleted while
    the shell was in it): every relative path, ``results/`` included, would fail later."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise UsageError("the current folder no longer exists (it was deleted while the "
                         "shell was in it): cd to a folder that exists") from None


def quiet_interrupts() -> None:
    """A Ctrl-C that lands before a front-end's own handler is up (while NumPy, SciPy and
    mpi4py load: a second and more per rank on a loaded node) ends the process by the
    signal itself: no traceback (one per rank before, and a segmentation fault when it
    landed inside MPI's start-up). A front-end's ``__main__`` calls it before its other
    imports; :func:`summasim.mpiutil.end_on_signals` (MPI front-ends) and
    :func:`run_command` (serial ones) take over once the work starts."""
    with contextlib.suppress(ValueError):          # not the main thread: nothing to do
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:   # (cmd & in a script)
            signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_command(prog: str, run: Callable, args) -> int:
    """``run(args)`` with a :class:`UsageError` turned into one line and status 2, and
    stdout guarded (:func:`guarded_stdout`): a reader that goes away or a path stdout
    cannot encode does not end the work before its reports are written. A command whose
    output was not all read (``... | head -1``) exits 1, quietly; a Ctrl-C is one line,
    exit 130.

    ``run`` returns an exit status (an int) or anything else for success (0); the
    ``main()`` of a front-end is ``return cli.run_command(ap.prog, run, ap.parse_args(argv))``.
    """
    old = None
    with contextlib.suppress(ValueError):          # Ctrl-C: a KeyboardInterrupt, said below
        old = signal.getsignal(signal.SIGINT)
        if old is signal.SIG_DFL:                  # (set so by quiet_interrupts; ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)   # stays ignored)
        else:
            old = None
    try:
        return _run_guarded(prog, run, args)
    finally:
        if old is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, old)


def _run_guarded(prog: str, run: Callable, args) -> int:
    try:
        with guarded_stdout() as guard:
            try:
                check_working_folder()
                status = run(args)
            except UsageError as exc:
                return print_error(prog, exc)
        if guard.lost:
            return 1
    except BrokenPipeError:
        # a pipe closed under a stream the guard does not cover (stderr in ``2>&1 |
        # head``): no traceback, and stdout to devnull for the interpreter's last flush
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:     # Ctrl-C: one line, as the MPI front-ends say it
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"{prog}: interrupted (SIGINT)\n")
            sys.stderr.flush()
        return 128 + signal.SIGINT
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` that reports a user error as ONE line.

    ``error(message)`` writes ``<prog>: error: <message>`` to stderr (rank 0 only,
    by :func:`launcher_rank`) and exits with status 2. Everything else is argparse.
    """

    def error(self, message: str) -> NoReturn:
        raise SystemExit(print_error(self.prog, message))


# -- numbers ----------------------------------------------------------------------------
def _as_int(text) -> int:
    """An integer from ``"12"``, or from an integral number written ``"1e3"``."""
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
    if isinstance(text, int):
        return text
    s = str(text).strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not math.isfinite(x) or not x.is_integer():
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
    return int(x)


def launcher_rank0_output():
    """A context in which only the launcher's rank 0 prints (``--help`` parsed on every
    rank before MPI starts): stdout is swallowed on the other ranks."""
    import contextlib
    import io

    return (contextlib.redirect_stdout(io.StringIO()) if launcher_rank()
            else contextlib.nullcontext())


def available_memory() -> int:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping), in
    bytes; the free pages where there is no /proc."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def int_between(lo: int, hi: int) -> Callable[[str], int]:
    """Factory: an argparse type for integers from ``lo`` to ``hi``."""

    def convert(text) -> int:
        val = _as_int(text)
        if not lo <= val <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer from {lo} to {hi}, "
                                             f"got {text!r}")
        return val

    convert.__name__ = f"int_between_{lo}_{hi}"
    return convert


def int_at_least(minimum: int) -> Callable[[str], int]:
    """Factory: an argparse type for integers ``>= minimum``."""

    def convert(text) -> int:
        val = _as_int(text)
        if val < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return val

    convert.__name__ = f"int_at_least_{minimum}"
    return convert


def positive_int(text) -> int:
    """argparse type: an integer >= 1 (``"8"``; an integral ``"1e3"`` is 1000)."""
    val = _as_int(text)
    if val < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return val


def byte_size(text) -> int:
    """argparse type: a byte count, ``"4M"``, ``"64MiB"``, ``"512k"``, ``"1048576"`` or
    a decimal ``"0.5M"`` (k, M, G are powers of 1024, with an optional ``B`` or ``iB``;
    at least 1 byte). The one byte parser of every command."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4M, 64MiB, 8192)")
    val = int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20,
                                    "g": 1 << 30}[m.group(2).lower()])
    if val < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return val


def nonnegative_int(text) -> int:
    """argparse type: an integer >= 0."""
    val = _as_int(text)
    if val < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return val


def int_list(minimum: int = 1) -> Callable[[str], list]:
    """Factory: an argparse type for comma-separated integers, each ``>= minimum``
    (``"2,4,8"`` -> ``[2, 4, 8]``; at least one)."""

    def convert(text) -> list:
        parts = [x.strip() for x in str(text).split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {minimum}, got {text!r}")
        out = []
        for part in parts:
            try:
                val = _as_int(part)
            except argparse.ArgumentTypeError:
                val = None
            if val is None or val < minimum:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated integers >= {minimum}, got {text!r}")
            out.append(val)
        return out

    convert.__name__ = "int_list"
    return convert


def finite_float(text) -> float:
    """argparse type: a finite number (rejects nan, inf and non-numbers)."""
    return _finite(text, "a finite number")


def finite_positive_float(text) -> float:
    """argparse type: a finite number > 0 (rates, step sizes, sizes)."""
    val = _finite(text, "a finite number > 0")
    if val <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return val


def finite_nonnegative_float(text) -> float:
    """argparse type: a finite number >= 0."""
    val = _finite(text, "a finite number >= 0")
    if val < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return val


def float_range(lo: float, hi: float, *, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """Factory: an argparse type for finite numbers in ``[lo, hi]``; ``lo_open`` /
    ``hi_open`` exclude an end (``float_range(0, 1, lo_open=True, hi_open=True)``
    is the open interval (0, 1))."""
    want = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def convert(text) -> float:
        val = _finite(text, want)
        if val < lo or val > hi or (lo_open and val == lo) or (hi_open and val == hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return val

    convert.__name__ = "float_range"
    return convert


def _finite(text, want: str) -> float:
    try:
        val = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
    if not math.isfinite(val):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return val


# -- files ------------------------------------------------------------------------------
def _regular_file(path: str, folder: str | None = None) -> os.stat_result:
    """``os.stat(path)`` of a regular file, found without opening it; else
    :class:`UsageError` starting with the path (``folder``: the words for a folder)."""
    if not path:
        raise UsageError("empty path")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{path}: {_os_reason(exc)}") from None
    if folder and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path}: {folder}")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: is {_file_type(st.st_mode)}; expected a regular file")
    return st


def check_existing_file(path) -> str:
    """``path`` if it is a readable regular file, else raise :class:`UsageError`
    (the message starts with the path; prefix the argument name when reporting).
    Never blocks: a FIFO or device is refused before it is opened."""
    path = os.fspath(path)
    _regular_file(path, folder="is a folder, not a file")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({_os_reason(exc)})") from None
    return path


def _probe_dir(folder: str, make: bool = True) -> None:
    """Create ``folder`` (and parents) if needed and ``make``, then create and delete a
    temp file in it; raise :class:`UsageError` saying why when either fails."""
    anc = folder
    while anc and not os.path.exists(anc):
        parent = os.path.dirname(anc)
        if parent == anc:
            break
        anc = parent
    if anc and os.path.exists(anc) and not os.path.isdir(anc):
        raise UsageError(f"{folder}: cannot make a folder there, {anc} is a file")
    try:
        if make:
            os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".summasim-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise UsageError(f"{folder}: cannot write there ({_os_reason(exc)})") from None


def check_distinct_outputs(outputs) -> None:
    """Refuse two outputs of one command at one file: ``outputs`` is ``[(flag, path)]``
    (None paths skipped); a :class:`UsageError` names both flags, since the second
    write would replace the first's file."""
    seen: dict = {}
    for flag, path in outputs:
        if path is None:
            continue
        real = os.path.realpath(os.fspath(path))
        if real in seen:
            raise UsageError(f"{seen[real]} and {flag} both write {os.fspath(path)}: the "
                             f"second would replace the first; give them other paths")
        seen[real] = flag


def check_writable_dir(path) -> str:
    """``path`` if it is (or can be made) a folder that accepts new files, else raise
    :class:`UsageError`. Creates the folder (that is what an output folder is for)."""
    path = os.fspath(path)
    if not path:
        raise UsageError("empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{path}: is a file, not a folder")
    _probe_dir(path)
    return path


def _os_reason(exc: OSError) -> str:
    """What an ``OSError`` says, in a few words (``name too long``, ``permission denied``)."""
    return {errno.ENOENT: "no such file", errno.ENAMETOOLONG: "the name is too long",
            errno.ELOOP: "too many levels of symbolic links",
            errno.ENOTDIR: "a part of the path is not a folder",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device",
            }.get(exc.errno, (exc.strerror or str(exc)).lower())


def _file_type(mode: int) -> str:
    """The kind of file ``mode`` describes, for messages (``a FIFO``, ``a folder``)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _probe_name(folder: str, name: str) -> None:
    """Create and remove, in ``folder``, a new file whose name is as long (in bytes) as
    ``name``: what creating ``name`` itself would meet (a name or path too long, no
    permission, a read-only file system), without touching ``name``, so that ranks
    probing the same path at once cannot trip over each other's probe."""
    import secrets

    size = len(os.fsencode(name))
    for _ in range(8):
        probe = ".summasim-probe-" + secrets.token_hex(8)
        if size > len(probe):
            probe += "x" * (size - len(probe))
        try:
            fd = os.open(os.path.join(folder, probe), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o600)
        except FileExistsError:
            continue
        os.close(fd)
        os.unlink(os.path.join(folder, probe))
        return


def _results_folder(folder: str) -> bool:
    """Whether ``folder`` is a ``results`` folder whose parent exists: the one folder
    summasim makes when a report path names it (``--json results/run.json`` on a fresh
    clone)."""
    return os.path.basename(folder) == "results" and os.path.isdir(os.path.dirname(folder))


#: Outputs that are not JSON reports, by how their files begin: an existing file is
#: replaced without ``--force`` only when it begins so (a PNG image; explore's CSV).
FILE_SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "explore csv": b"table,"}


def _begins_with(path: str, signature: bytes) -> bool:
    """Whether the regular file ``path`` begins with ``signature``."""
    try:
        with open(path, "rb") as f:
            return f.read(len(signature)) == signature
    except OSError:
        return False


def check_writable_path(path, kind: str | None = None, force: bool | None = None) -> str:
    """``path`` if a report can be written there, else raise :class:`UsageError`.

    Checked for real, before any work, so that a finished job never loses its result:

    - the path is not a folder, and its folder exists (no folder is created, except for
      a command's own default path, a :class:`ReportPath` with ``default=True``, and
      summasim's own ``results/`` folder in an existing folder, where the README sends
      every report);
    - a new file with a name as long as ``path``'s is created beside it and removed
      again (a name too long, a read-only file system or a missing permission is caught,
      also for root);
    - an existing ``path`` must be a regular file (never a FIFO or a device) and, when
      ``kind`` is given, a summasim report of that kind (:func:`report_kind`), or a file
      that begins as ``kind``'s do (:data:`FILE_SIGNATURES`: a PNG, explore's CSV),
      unless ``force``; its folder must accept the temp file of the atomic write.

    ``kind`` and ``force`` default to those a :class:`ReportPath` carries. Returns
    ``path`` itself (a :class:`ReportPath` stays one).
    """
    text = os.fspath(path)
    kind = kind if kind is not None else getattr(path, "kind", None)
    force = force if force is not None else getattr(path, "force", False)
    if not text:
        raise UsageError("empty path")
    if text.endswith(os.sep) or os.path.isdir(text):
        raise UsageError(f"{text}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        if getattr(path, "default", False) or _results_folder(folder):
            _probe_dir(folder)
        elif os.path.exists(folder):
            raise UsageError(f"{text}: {folder} is not a folder")
        else:
            raise UsageError(f"{text}: folder {folder} does not exist (summasim creates no "
                             f"folder you did not ask for; make it first)")
    try:
        st = os.stat(text)
    except FileNotFoundError:
        st = None
        if os.path.lexists(text):
            raise UsageError(f"{text}: is a broken symbolic link") from None
    except OSError as exc:
        raise UsageError(f"{text}: cannot be written ({_os_reason(exc)})") from None
    if st is None:
        try:
            _probe_name(folder, os.path.basename(text))
        except OSError as exc:
            raise UsageError(f"{text}: cannot be created ({_os_reason(exc)})") from None
        return path
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{text}: is {_file_type(st.st_mode)}; a report is written only to "
                         f"a regular file")
    if kind in FILE_SIGNATURES and not force:
        if not _begins_with(text, FILE_SIGNATURES[kind]):
            article = "an" if kind[0] in "aeiou" else "a"
            raise UsageError(f"{text}: exists and is not {article} {kind} file; not replacing "
                             f"it (give another path, or --force to replace it)")
    elif kind and not force:
        found = report_kind_of_file(text)
        if found != kind:
            what = (f"a summasim {found} report, not a {kind} report" if found
                    else f"not a summasim {kind} report")
            raise UsageError(f"{text}: exists and is {what}; not replacing it (give another "
                             f"path, or --force to replace it)")
    if os.path.islink(text):    # the file it points to is replaced, in that file's folder
        folder = os.path.dirname(os.path.realpath(text))
    _probe_dir(folder, make=False)
    if not os.access(text, os.W_OK):
        raise UsageError(f"{text}: exists and is not writable")
    return path


# -- input files ------------------------------------------------------------------------
#: The most bytes read from any file a user names (64 MiB; machine files are a few KiB).
MAX_INPUT_BYTES = 64 << 20
#: The deepest nesting of arrays and objects accepted in a JSON file a user names.
MAX_JSON_DEPTH = 64


def _size_words(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def read_user_file(path, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Never blocks and never reads without bound: the file is ``stat``-ed before it is
    opened (a folder, FIFO, device or socket is refused), opened non-blocking, checked
    again on the open descriptor (the path may have changed in between), and read up
    to ``max_bytes + 1`` bytes. :class:`UsageError` starting with the path otherwise.
    """
    text = os.fspath(path)
    st = _regular_file(text)
    limit = f"at most {_size_words(max_bytes)} are read"
    if st.st_size > max_bytes:
        raise UsageError(f"{text}: is {st.st_size} bytes, too large ({limit})")
    try:
        fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{text}: cannot be read ({_os_reason(exc)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"{text}: is {_file_type(mode)}; expected a regular file")
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise UsageError(f"{text}: cannot be read ({_os_reason(exc)})") from None
    finally:
        os.close(fd)
    if got > max_bytes:
        raise UsageError(f"{text}: is larger than {_size_words(max_bytes)}, too large "
                         f"({limit})")
    return b"".join(chunks)


def _decode(text: str, data: bytes) -> str:
    """``data`` as UTF-8 text (a UTF-8 byte order mark is allowed), or UsageError."""
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
                      (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16")):
        if data.startswith(bom):
            raise UsageError(f"{text}: is {name} text; expected UTF-8")
    if b"\x00" in data:
        raise UsageError(f"{text}: holds NUL bytes (binary data); expected JSON text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{text}: is not UTF-8 text (byte {data[exc.start]:#04x} at "
                         f"offset {exc.start}); expected JSON") from None


def _json_depth(obj) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        val, depth = stack.pop()
        if isinstance(val, dict):
            val = list(val.values())
        if isinstance(val, list):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in val if isinstance(v, (dict, list)))
    return deepest


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true or false",
               int: "a number", float: "a number", type(None): "null"}


def read_json_file(path, *, expect: type | None = dict, max_bytes: int = MAX_INPUT_BYTES,
                   max_depth: int = MAX_JSON_DEPTH):
    """The JSON value in the user's file ``path``, read safely (:func:`read_user_file`).

    Strict: the text must be UTF-8, nest at most ``max_depth`` levels, hold no NaN or
    infinity (JSON has none; an overflowing number such as ``1e999`` or an integer
    beyond a float's range counts as one), no key twice in one object, and (unless
    ``expect`` is None) be a JSON value of type ``expect`` at the top.
    :class:`UsageError` starting with the path otherwise.
    """
    text = os.fspath(path)
    raw = _decode(text, read_user_file(text, max_bytes))
    if not raw.strip():
        raise UsageError(f"{text}: is empty; expected JSON")

    def constant(name):
        raise UsageError(f"{text}: holds {name}, which JSON does not allow")

    def number(s):
        val = float(s)
        if not math.isfinite(val):
            raise UsageError(f"{text}: holds the number {s[:40]}, out of range")
        return val

    def integer(s):
        val = int(s)
        try:
            float(val)
        except OverflowError:
            raise UsageError(f"{text}: holds the integer {s[:40]}..., out of range") from None
        return val

    def unique(pairs):
        seen = {}
        for key, val in pairs:
            if key in seen:
                raise UsageError(f"{text}: holds the key {key[:60]!r} twice in one object")
            seen[key] = val
        return seen

    try:
        obj = json.loads(raw, parse_constant=constant, parse_float=number,
                         parse_int=integer, object_pairs_hook=unique)
    except RecursionError:
        raise UsageError(f"{text}: nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{text}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from None
    except UsageError:
        raise
    except (ValueError, MemoryError) as exc:    # e.g. an integer of more than 4300 digits
        raise UsageError(f"{text}: cannot be read as JSON ({one_line(exc)[:120]})") from None
    if _json_depth(obj) > max_depth:
        raise UsageError(f"{text}: nests deeper than {max_depth} levels")
    if expect is not None and not isinstance(obj, expect):
        raise UsageError(f"{text}: holds {_JSON_TYPES.get(type(obj), type(obj).__name__)}; "
                         f"expected {_JSON_TYPES.get(expect, expect.__name__)}")
    return obj


# -- reports ----------------------------------------------------------------------------
#: The top-level field in which a summasim report names its kind.
REPORT_FIELD = "summasim_report"
#: How reports written before :data:`REPORT_FIELD` existed are recognised: the kind, and
#: top-level keys that every report of that kind has (``predict`` has two forms).
LEGACY_KEYS = (
    ("run", frozenset({"world_size", "backend", "ok", "rows"})),
    ("bench", frozenset({"p", "cores", "dtype", "wait_policy", "backend"})),
    ("machine", frozenset({"name", "source", "cores", "intra", "gamma_gemm"})),
    ("predict", frozenset({"budget_bytes", "fits", "largest_batch"})),
    ("predict", frozenset({"composition", "memory", "breakdown", "step_seconds"})),
    ("plan", frozenset({"format", "machine", "searched", "ranked"})),
    ("explore", frozenset({"machine", "config", "mode", "tables"})),
    ("devset", frozenset({"points", "summary"})),
)


def report_kind(obj) -> str | None:
    """The kind of summasim report ``obj`` (a parsed JSON value) is, or None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get(REPORT_FIELD), str):
        return obj[REPORT_FIELD]
    found = {kind for kind, keys in LEGACY_KEYS if keys <= obj.keys()}
    return found.pop() if len(found) == 1 else None


def report_kind_of_file(path) -> str | None:
    """The kind of summasim report in the file ``path``, or None when it is none
    (or cannot be read as JSON)."""
    try:
        return report_kind(read_json_file(path, expect=None))
    except UsageError:
        return None


class ReportPath(str):
    """A report path from the command line: a ``str`` that also carries the report's
    ``kind``, whether ``--force`` allows replacing any regular file there (``force``),
    and whether it is the command's own default, whose folder may be created
    (``default``)."""

    kind: str | None
    force: bool
    default: bool

    def __new__(cls, text="", kind: str | None = None, force: bool = False,
                default: bool = False):
        obj = super().__new__(cls, text)
        obj.kind, obj.force, obj.default = kind, force, default
        return obj

    def forced(self) -> "ReportPath":
        """The same path with ``force`` set."""
        return ReportPath(str(self), self.kind, True, self.default)


def report_path(kind: str) -> Callable[[str], ReportPath]:
    """Factory: the argparse type of a report path of ``kind`` (a :class:`ReportPath`;
    one already is stays as it is, so a default or ``const`` keeps its flags)."""

    def convert(text) -> ReportPath:
        if isinstance(text, ReportPath):
            return text
        if not str(text).strip():
            raise argparse.ArgumentTypeError("needs a file path, got an empty one")
        return ReportPath(text, kind)

    convert.__name__ = "report_path"
    return convert


class ReportAction(argparse.Action):
    """Stores a :class:`ReportPath`, marked forced when ``--force`` came before it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, ReportPath) and getattr(namespace, "force", False):
            values = values.forced()
        setattr(namespace, self.dest, values)


class ForceAction(argparse.Action):
    """``--force``: sets ``force`` and marks every :class:`ReportPath` parsed so far."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, required=required,
                         help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        for name, val in list(vars(namespace).items()):
            if isinstance(val, ReportPath):
                setattr(namespace, name, val.forced())


def add_force(ap) -> None:
    """``--force``: replace an existing output file that is not a summasim report of the
    same kind (a FIFO, a device or a folder is never replaced)."""
    ap.add_argument("--force", action=ForceAction,
                    help="replace an existing output file even if it is not a summasim "
                         "report of the same kind")


def _as_type(check: Callable[[str], str], name: str) -> Callable[[str], str]:
    def convert(text) -> str:
        try:
            return check(text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    convert.__doc__ = f"argparse type form of :func:`{check.__name__}`."
    return convert


#: argparse type: a readable regular file (see :func:`check_existing_file`).
existing_file = _as_type(check_existing_file, "existing_file")
#: argparse type: a writable file path in an existing folder (see :func:`check_writable_path`).
writable_path = _as_type(check_writable_path, "writable_path")
#: argparse type: a writable folder; creates it (see :func:`check_writable_dir`).
writable_dir = _as_type(check_writable_dir, "writable_dir")


def choice_list(allowed: Iterable[str], what: str = "name") -> Callable[[str], list]:
    """Factory: an argparse type for comma-separated names, each one of ``allowed``
    (``what`` names them in the message: ``unknown dtype 'float8'; known: ...``), each
    once in the first order given (a name given twice runs once)."""
    allowed = tuple(allowed)

    def convert(text) -> list:
        names = [x.strip() for x in str(text).split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r}; known: "
                                             f"{', '.join(allowed)}")
        if not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}s from "
                                             f"{', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(names))

    convert.__name__ = "choice_list"
    return convert


def module_available(name: str) -> bool:
    """True when ``import name`` would find the module (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def sig3(x: float) -> str:
    """``x`` to three significant digits, without an exponent from 0.001 to 99,999
    (``104.7`` -> ``105``, ``0.0123`` -> ``0.0123``): a rate that is small on one machine
    and large on another reads on both."""
    if x == 0 or not math.isfinite(x) or not 1e-3 <= abs(x) < 1e5:
        return f"{x:.3g}"
    r = float(f"{x:.3g}")                     # rounded first: 99.96 is 100, not 100.0
    digits = max(0, 2 - math.floor(math.log10(abs(r))))
    return f"{r:.{digits}f}"


def number_ranges(values) -> str:
    """Sorted integers as runs: ``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs, start = [], None
    values = list(values)
    for n, r in enumerate(values):
        if start is None:
            start = r
        if n + 1 == len(values) or values[n + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(runs)
