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
    writable_path             a file path that can be written: its folder exists or
                              can be created and accepts a new file (tried for real)
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

Messages name the argument as the user typed it (``--lr``), the value received,
and what would be accepted, on one line.
"""

from __future__ import annotations

import argparse
import math
import re
import os
import sys
import tempfile
from typing import Callable, Iterable, NoReturn

__all__ = [
    "ArgumentParser", "UsageError", "require", "print_error", "launcher_rank", "one_line",
    "positive_int", "nonnegative_int", "byte_size", "int_at_least", "int_list", "choice_list",
    "finite_float", "finite_positive_float", "finite_nonnegative_float", "float_range",
    "existing_file", "writable_path", "writable_dir",
    "check_existing_file", "check_writable_path", "check_writable_dir", "module_available",
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
    :func:`launcher_rank`); return 2, the exit status of a user error, so a
    ``main()`` can ``return cli.print_error(parser.prog, exc)``."""
    if launcher_rank() == 0:
        sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
        sys.stderr.flush()
    return 2


def run_command(prog: str, run: Callable, args) -> int:
    """``run(args)`` with a :class:`UsageError` turned into one line and status 2.

    ``run`` returns an exit status (an int) or anything else for success (0); the
    ``main()`` of a front-end is ``return cli.run_command(ap.prog, run, ap.parse_args(argv))``.
    """
    try:
        status = run(args)
        sys.stdout.flush()
    except UsageError as exc:
        return print_error(prog, exc)
    except BrokenPipeError:
        # the reader went away (``... | head``): not an error of ours, and no traceback;
        # stdout goes to devnull so that the interpreter's final flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
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
def check_existing_file(path) -> str:
    """``path`` if it is a readable regular file, else raise :class:`UsageError`
    (the message starts with the path; prefix the argument name when reporting)."""
    path = os.fspath(path)
    if not path:
        raise UsageError("empty path")
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a folder, not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return path


def _probe_dir(folder: str) -> None:
    """Create ``folder`` (and parents) if needed, then create and delete a temp file
    in it; raise :class:`UsageError` saying why when either fails."""
    anc = folder
    while anc and not os.path.exists(anc):
        parent = os.path.dirname(anc)
        if parent == anc:
            break
        anc = parent
    if anc and os.path.exists(anc) and not os.path.isdir(anc):
        raise UsageError(f"{folder}: cannot make a folder there, {anc} is a file")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".summasim-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise UsageError(f"{folder}: cannot write there ({exc.strerror or exc})") from None


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


def check_writable_path(path) -> str:
    """``path`` if a file can be written there, else raise :class:`UsageError`.

    The path must not be a folder; its folder must exist or be creatable (it is
    created) and accept a new file (tried for real with a temp file, so read-only
    file systems and missing permissions are caught, also for root); an existing
    file must be writable.
    """
    path = os.fspath(path)
    if not path:
        raise UsageError("empty path")
    if path.endswith(os.sep) or os.path.isdir(path):
        raise UsageError(f"{path}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    _probe_dir(folder)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{path}: exists and is not writable")
    return path


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
#: argparse type: a writable file path; creates its folder (see :func:`check_writable_path`).
writable_path = _as_type(check_writable_path, "writable_path")
#: argparse type: a writable folder; creates it (see :func:`check_writable_dir`).
writable_dir = _as_type(check_writable_dir, "writable_dir")


def choice_list(allowed: Iterable[str], what: str = "name") -> Callable[[str], list]:
    """Factory: an argparse type for comma-separated names, each one of ``allowed``
    (``what`` names them in the message: ``unknown dtype 'float8'; known: ...``)."""
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
        return names

    convert.__name__ = "choice_list"
    return convert


def module_available(name: str) -> bool:
    """True when ``import name`` would find the module (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

