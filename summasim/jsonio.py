"""Reports as valid JSON, written atomically (pure; the bottom floor).

JSON has no NaN or infinity. :func:`json_safe` replaces every non-finite float by
``null`` and records what it was in a sibling key ``"<key>_nonfinite"`` (``"nan"``,
``"inf"`` or ``"-inf"``; in a list, the sibling is a list of ``[index, what]``), so a
reader can tell a missing value from a NaN. :func:`write_json_atomic` writes with
``allow_nan=False`` through a temp file in the same folder and a rename, so a report
is either the old file or the whole new one.

:func:`write_report` writes a command's report: tagged with its kind (the top-level
field :data:`summasim.cli.REPORT_FIELD`, by which the next run knows it may replace the
file), and never lost: when the write fails after the work is done (the disk is full,
the folder went away), the report is saved in the temp folder and the message says
where. Reading user files safely is :func:`summasim.cli.read_json_file`.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import tempfile

from .cli import REPORT_FIELD, ReportPath, UsageError, check_writable_path, one_line


def _what(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _bad(x) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def json_safe(obj):
    """A copy of ``obj`` (dicts, lists, tuples, scalars) with non-finite floats as
    ``None`` and a ``"<key>_nonfinite"`` note beside each (see the module doc)."""
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()                                   # NumPy scalars
    if isinstance(obj, dict):
        out = {}
        for key, val in obj.items():
            if hasattr(val, "item") and hasattr(val, "dtype") and getattr(val, "ndim", 1) == 0:
                val = val.item()
            if _bad(val):
                out[key] = None
                out[f"{key}_nonfinite"] = _what(val)
            elif isinstance(val, (list, tuple)) and any(_bad(v) for v in val):
                out[key] = [None if _bad(v) else json_safe(v) for v in val]
                out[f"{key}_nonfinite"] = [[i, _what(v)] for i, v in enumerate(val) if _bad(v)]
            else:
                out[key] = json_safe(val)
        return out
    if isinstance(obj, (list, tuple)):
        return [None if _bad(v) else json_safe(v) for v in obj]
    if _bad(obj):
        return None
    return obj


#: the temp files of writes in progress (:func:`discard_unfinished`)
_WRITING: set = set()


def discard_unfinished() -> None:
    """Unlink the temp files of atomic writes still in progress: for a process about to
    end at once (``os._exit`` on a signal, :func:`summasim.mpiutil.end_on_signals`), whose
    ``finally`` blocks will not run. The target files are untouched: a write that had
    got as far as its rename is whole, one that had not never happened."""
    for tmp in list(_WRITING):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def write_text_atomic(path, text: str, make_folder: bool = True) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``,
    so a reader never sees a half-written file. A file replaced keeps its permission
    bits (a private report stays private); a new one gets ``open()``'s. The folder is
    created when missing only if ``make_folder``. A symbolic link stays a link: the file
    it points to is replaced. (A hard link to the old file keeps the old contents: the
    rename gives the path a new file.)"""
    path = os.fspath(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if make_folder:
        os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    _WRITING.add(tmp)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:                     # a new file: what open() would give it
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        _WRITING.discard(tmp)


def write_json_atomic(path, obj) -> None:
    """Write ``json_safe(obj)`` to ``path`` atomically, as strict JSON. The text is
    built first, so an object that cannot be written leaves the old file alone."""
    write_text_atomic(path, json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")


class ReportNotSaved(UsageError):
    """A report that could not be written where asked; the message says where it went.

    Found after the work, so not a mistake in the arguments: a front-end prints it as one
    line, as a user error, but exits 1, as the MPI front-ends do when their report fails."""

    exit_status = 1


def _fallback(kind: str, text: str) -> str | None:
    """Save ``text`` as a new file in the temp folder; its path, or None if that fails too."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"summasim-{kind}-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        return path
    except OSError:
        return None


def write_report(path, kind: str, obj, prog: str | None = None) -> bool:
    """Write the report ``obj`` (a dict) of ``kind`` to ``path``, atomically, as strict
    JSON with ``"summasim_report": kind`` first. True when written.

    A failing write (``OSError``) loses nothing: the report is saved to a new file in
    the temp folder instead, and then, with ``prog`` None, :class:`ReportNotSaved` (one
    line, exit 1) says where; with ``prog`` given (an MPI front-end,
    where rank 0 writes and must not raise), ``<prog>: error: ...`` goes to stderr and
    the result is False (the caller exits non-zero). The folder is created only for a
    command's own default path (a :class:`summasim.cli.ReportPath` with ``default``).
    """
    doc = {REPORT_FIELD: kind, **{k: v for k, v in obj.items() if k != REPORT_FIELD}}
    text = json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n"
    try:
        if isinstance(path, ReportPath) and os.path.lexists(path):
            # checked again now: a file put there since the preflight is not replaced
            check_writable_path(path)
        # a link to a report: the report it points to is replaced, the link stays
        write_text_atomic(path, text, make_folder=getattr(path, "default", False))
        return True
    except UsageError as exc:
        why = one_line(str(exc))
        saved = _fallback(kind, text)
    except OSError as exc:
        why = one_line(exc.strerror or exc)
        saved = _fallback(kind, text)
    msg = (f"{os.fspath(path)}: the {kind} report could not be written ({why}); "
           + (f"it is saved in {saved} instead" if saved else
              "saving it in the temp folder failed too"))
    if prog is None:
        raise ReportNotSaved(msg)
    sys.stderr.write(f"{prog}: error: {msg}\n")
    sys.stderr.flush()
    return False
