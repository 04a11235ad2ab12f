"""The commands shown in README.md and docs/*.md run as written.

Every ``mpirun -n P python -m summasim.run|bench ...`` (and ``./scripts/run``) is
parsed and planned at its P in-process: it must be free of user errors and check or
time something (:func:`test_documented_launch_would_run`). Below, the cost model's.

Every ``python -m summasim.costmodel SUB ...`` line of a fenced code block is found
(``\\``-continued lines joined, ``# comments`` and ``$`` prompts dropped) and:

- a runnable example (predict, plan, explore, devset, presets, table1) is run with this
  Python from the repository root and must exit 0 with output on stdout; any path it
  would write (``--json``, ``--csv``, ``--plot``, ``--out``, ``--outdir``) is moved under
  ``tmp_path``, and ``explore`` always gets ``--outdir tmp_path``;
- a usage synopsis (a line with ``[``, ``|`` or ``…``) is not run: each ``--flag`` it
  names must appear in that subcommand's ``--help``;
- ``fit`` and ``accuracy`` need MPI and minutes: they are listed in ``MPI_SUBCOMMANDS``
  and only their flags are checked against ``--help``.

Cases are named ``page:line`` so a failure points at the doc line. No doc may spell an
option or module that was removed (``REMOVED``).
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

RUNNABLE = {"predict", "plan", "explore", "devset", "presets", "table1"}
MPI_SUBCOMMANDS = {"fit", "accuracy"}  # need mpiexec and minutes: flags checked only
OUTPUT_FLAGS = {"--json", "--csv", "--plot", "--out", "--outdir"}
TIMEOUT_S = 180

# A documented example that is too slow for this file would be listed here, by
# "page:line", with the reason; none is today (the slowest, plan at 3,072 devices,
# takes 18-31 s on the 2-core VM).
SLOW: dict[str, str] = {}

REMOVED = [r"--tf-config", r"--tf-shape", r"--mesh-shape", r"--tf-dtype", r"--preset\b(?!s)",
           r"summasim\.transformer\.bench", r"costmodel\.schemes", r"costmodel\.compose",
           r"predictcmd",
           # the old module names, spelled without the package prefix
           r"`compose\.\w", r"`schemes\.\w"]

COMMAND = re.compile(r"python3?\s+-m\s+summasim\.costmodel\s+(\S+)(.*)$")


def _fenced_lines(text: str):
    """(line number, line) of each line inside a ``` fence."""
    inside = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            yield n, line


def _strip_comment(line: str) -> str:
    # a ' #' that starts a shell comment (the examples quote no '#')
    return re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""


def _commands():
    """(page, line, subcommand, argument string, is_synopsis) of every costmodel line."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            lines = list(_fenced_lines(f.read()))
        i = 0
        while i < len(lines):
            n, line = lines[i]
            i += 1
            m = COMMAND.search(_strip_comment(line))
            if not m:
                continue
            text = _strip_comment(line)
            while text.rstrip().endswith("\\") and i < len(lines) and lines[i][0] == lines[i - 1][0] + 1:
                text = text.rstrip()[:-1] + " " + _strip_comment(lines[i][1]).strip()
                i += 1
            synopsis = any(c in text for c in "[|…")
            if synopsis:  # a synopsis continues on indented lines without a backslash
                while (i < len(lines) and lines[i][0] == lines[i - 1][0] + 1
                       and lines[i][1].startswith((" ", "\t"))):
                    text += " " + lines[i][1].strip()
                    i += 1
            m = COMMAND.search(text)
            found.append((page, n, m.group(1), m.group(2).strip(), synopsis))
    return found


COMMANDS = _commands()


def _id(case):
    return f"{case[0]}:{case[1]}"


@functools.lru_cache(maxsize=None)
def _help(sub: str) -> str:
    r = subprocess.run([sys.executable, "-m", "summasim.costmodel", sub, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"costmodel {sub} --help failed:\n{r.stderr}"
    return r.stdout


def _flags_missing(sub: str, args: str) -> list[str]:
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args))
    usage = _help(sub)
    return sorted(f for f in flags if not re.search(re.escape(f) + r"(?![a-z0-9-])", usage))


def _into_tmp(sub: str, argv: list[str], tmp) -> list[str]:
    """argv with every output path under tmp (bare optional-path flags get one there)."""
    out = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag, eq, value = a.partition("=")
        if flag in OUTPUT_FLAGS and eq:
            out.append(f"{flag}={tmp if flag == '--outdir' else tmp / os.path.basename(value)}")
        elif a in OUTPUT_FLAGS:
            out.append(a)
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            if has_value:
                i += 1
                out.append(str(tmp if a == "--outdir" else tmp / os.path.basename(argv[i])))
            elif sub == "plan" and a in ("--json", "--plot"):
                out.append(str(tmp / ("plan.json" if a == "--json" else "plan.png")))
        else:
            out.append(a)
        i += 1
    if sub == "explore" and "--outdir" not in out and not any(a.startswith("--outdir=") for a in out):
        out += ["--outdir", str(tmp)]
    return out


@functools.lru_cache(maxsize=None)
def _run(cmd: tuple) -> subprocess.CompletedProcess:
    """Run once per distinct command (README and a page may show the same one); a command
    that writes files gets a fresh run (its tmp_path differs) through ``__wrapped__``."""
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


def test_found_the_examples():
    assert COMMANDS, "no costmodel command in any fenced block"
    subs = {c[2] for c in COMMANDS}
    unknown = subs - RUNNABLE - MPI_SUBCOMMANDS
    assert not unknown, f"docs use unknown costmodel subcommands {sorted(unknown)}: " + ", ".join(
        _id(c) for c in COMMANDS if c[2] in unknown)


@pytest.mark.parametrize("case", [c for c in COMMANDS if c[2] in RUNNABLE and not c[4]], ids=_id)
def test_costmodel_example_runs(case, tmp_path):
    page, line, sub, args, _ = case
    if _id(case) in SLOW:
        pytest.skip(SLOW[_id(case)])
    argv = _into_tmp(sub, shlex.split(args), tmp_path)
    cmd = [sys.executable, "-m", "summasim.costmodel", sub] + argv
    where = f"{page}:{line}: {shlex.join(cmd[1:])}"
    r = _run(tuple(cmd)) if argv == shlex.split(args) else _run.__wrapped__(tuple(cmd))
    assert r.returncode == 0, f"{where}\nexit {r.returncode}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{where}\nprinted nothing"


@pytest.mark.parametrize("case", [c for c in COMMANDS if c[4] or c[2] in MPI_SUBCOMMANDS], ids=_id)
def test_documented_flags_exist(case):
    """A synopsis, or a command that needs MPI, names only flags its --help knows."""
    page, line, sub, args, _ = case
    missing = _flags_missing(sub, args)
    assert not missing, f"{page}:{line}: costmodel {sub} has no {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES)
def test_no_removed_spelling(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    hits = [f"{page}:{n}: {pat}: {line.strip()}" for n, line in enumerate(lines, 1)
            for pat in REMOVED if re.search(pat, line)]
    assert not hits, "removed spellings:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES)
def test_commands_are_in_fences(page):
    """A command in an indented block would escape every check above: the pages show
    commands in ``` fences only."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    fenced = {n for n, _ in _fenced_lines(text)}
    hits = [f"{page}:{n}: {line.strip()}" for n, line in enumerate(text.split("\n"), 1)
            if n not in fenced and re.match(r"(?: {4}|\t)\s*(?:\S+=\S+\s+)*"
                                            r"(?:python3?|mpirun|mpiexec|\./scripts/)", line)]
    assert not hits, "commands outside a fence:\n" + "\n".join(hits)


# -- the MPI commands: every documented launch would run at its rank count ----------------
LAUNCH = re.compile(r"(?:mpirun|mpiexec)\s+-n\s+(\d+)\s+python3?\s+-m\s+summasim\.(run|bench)"
                    r"(?![\w.])(.*)$")
SCRIPT = re.compile(r"(?:SUMMASIM_RANKS=(\d+)\s+)?\./scripts/run(?![\w/])(.*)$")


def _launches():
    """(page, line, p, module, argument list) of every ``mpirun -n P python -m
    summasim.run|bench ...`` (a number P; fenced lines and inline code) and every
    ``./scripts/run ...`` (16 ranks unless ``SUMMASIM_RANKS`` says)."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        fenced = dict(_fenced_lines(text))
        lines = text.split("\n")
        for n, line in enumerate(lines, 1):
            pieces = ([_strip_comment(line)] if n in fenced
                      else re.findall(r"`([^`]*)`", line))
            for piece in pieces:
                piece = piece.lstrip("$ ").strip()
                k = n
                while piece.endswith("\\") and n in fenced and k < len(lines):
                    piece = piece[:-1] + " " + _strip_comment(lines[k]).strip()
                    k += 1
                if any(c in piece for c in "[|…{") or " P " in piece:
                    continue                                  # a synopsis, not a command
                m = LAUNCH.search(piece)
                if m:
                    found.append((page, n, int(m.group(1)), m.group(2),
                                  shlex.split(m.group(3))))
                    continue
                m = SCRIPT.search(piece)
                if m and n in fenced:
                    found.append((page, n, int(m.group(1) or 16), "run",
                                  shlex.split(m.group(2))))
    return found


LAUNCHES = _launches()


def test_found_the_launches():
    modules = {c[3] for c in LAUNCHES}
    assert modules == {"run", "bench"}, modules
    assert len(LAUNCHES) >= 20, len(LAUNCHES)


@pytest.mark.parametrize("case", LAUNCHES, ids=lambda c: f"{c[0]}:{c[1]}")
def test_documented_launch_would_run(case):
    """Parsed as the launch would parse it and planned at its rank count (no MPI, no
    work): no user error, something to check, and every named section runs something.
    An example that could only fail (meshes for two rank counts at once, a benchmark
    with nothing to time) fails here. What needs the machine (memory, the GPU) is the
    launch's own preflight."""
    page, line, p, module, argv = case
    where = f"{page}:{line}: -n {p} summasim.{module} {shlex.join(argv)}"
    from summasim.cli import UsageError, module_available

    if "--torch" in argv and not module_available("torch"):
        pytest.skip(f"{where}: --torch runs PyTorch's peers, and torch (not a summasim "
                    f"dependency) is not installed in this Python")

    try:
        if module == "run":
            from summasim import run

            args = run.parse_args(argv)
            jb = run.job(args, p)
            assert not jb.mesh_error, f"{where}\n{jb.mesh_error}"
            assert jb.cases or jb.tcases or jb.mcases, f"{where}\nnothing to check at p = {p}"
            why = run.named_but_unrunnable(args, jb)
            assert not why, f"{where}\n{why}"
        else:
            from summasim.bench import __main__ as bench

            args = bench.parse_args(argv)
            names = bench.ALL if args.what == "all" else (args.what,)
            nothing = {name: bench._nothing_to_measure(name, args, p) for name in names}
            assert not all(nothing.values()), f"{where}\n{nothing}"
    except UsageError as exc:
        pytest.fail(f"{where}\nuser error: {exc}")


# -- the library snippets: every ``from summasim... import ...`` a page shows imports ------
IMPORT = re.compile(r"^\s*(from\s+summasim[\w.]*\s+import\s+(?:\([^)]*\)|.*)|import\s+summasim[\w.]*)",
                    re.M)


def _imports():
    """(page, line, statement) of each summasim import in a fenced block."""
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            lines = list(_fenced_lines(f.read()))
        block = "\n".join(line for _, line in lines)
        numbers = [n for n, _ in lines]
        for m in IMPORT.finditer(block):
            found.append((page, numbers[block.count("\n", 0, m.start(1))],
                          " ".join(" ".join(_strip_comment(part) for part in
                                            m.group(1).split("\n")).split())))
    return found


IMPORTS = _imports()


def test_found_the_imports():
    assert len(IMPORTS) >= 10, IMPORTS


@pytest.mark.parametrize("case", IMPORTS, ids=lambda c: f"{c[0]}:{c[1]}")
def test_documented_import_works(case):
    """A library snippet's imports name modules and objects that exist."""
    page, line, statement = case
    try:
        exec(compile(statement, f"{page}:{line}", "exec"), {})
    except ImportError as exc:
        pytest.fail(f"{page}:{line}: {statement}\n{exc}")
