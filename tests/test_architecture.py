"""The house rules, read off docs/architecture.md and checked against the source: data
flows down the floors, no module imports one on a floor above it (function-level imports
included), the siblings on one floor (the transformer runtime and the cost model) do not
import each other, the cost model imports only the ground floor, there are no import
cycles, and the cost model predicts without MPI."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "summasim"
PAGE = ROOT / "docs" / "architecture.md"


def _page_floors() -> list[set[str]]:
    """The floor table of docs/architecture.md: the fenced block whose every line is
    ``N: name, name, ...``, lowest floor first."""
    for block in re.findall(r"```[^\n]*\n(.*?)```", PAGE.read_text(), re.S):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        rows = [re.fullmatch(r"(\d+):\s*(.+)", ln) for ln in lines]
        if lines and all(rows):
            assert [int(r.group(1)) for r in rows] == list(range(len(rows))), lines
            return [{n.strip() for n in r.group(2).split(",")} for r in rows]
    raise AssertionError(f"{PAGE} has no floor table (a fenced block of 'N: name, ...' lines)")


# lowest first; a module may import its own floor and those below
FLOORS = _page_floors()
#: Floors shared by siblings that must not import each other.
SIBLINGS = [f for f in FLOORS if len({n.split(".")[0] for n in f} & {"transformer",
                                                                      "costmodel"}) == 2]


def _floor(mod: str) -> int:
    parts = mod.split(".")
    for depth in (2, 1):
        key = ".".join(parts[:depth])
        for level, names in enumerate(FLOORS):
            if key in names and (depth == 2 or ".".join(parts[:2]) not in
                                 {n for f in FLOORS for n in f if "." in n}):
                return level
    raise KeyError(mod)


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts[1:]), path, path.name == "__init__.py"


def _imports(name: str, path: pathlib.Path, is_pkg: bool) -> set[str]:
    """summasim modules imported anywhere in the file (lazy imports included)."""
    tree = ast.parse(path.read_text())
    here = name.split(".") if name else []
    base = here if is_pkg else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("summasim."):
                    out.add(a.name[len("summasim."):])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(root + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("summasim"):
                mod = node.module[len("summasim."):] if node.module != "summasim" else ""
            else:
                continue
            for a in node.names:
                full = f"{mod}.{a.name}" if mod else a.name
                out.add(full if (PKG / (full.replace(".", "/") + ".py")).exists()
                        or (PKG / full.replace(".", "/")).is_dir() else mod)
    return {m for m in out if m}


GRAPH = {name: _imports(name, path, pkg) for name, path, pkg in _modules() if name}


def test_no_module_imports_a_floor_above_it():
    bad = []
    for mod, deps in GRAPH.items():
        for dep in deps:
            if _floor(dep) > _floor(mod):
                bad.append(f"{mod} (floor {_floor(mod)}) imports {dep} (floor {_floor(dep)})")
    assert not bad, "\n".join(bad)


def test_every_module_has_a_floor():
    assert all(_floor(mod) >= 0 for mod in GRAPH)


def test_the_transformer_and_the_cost_model_are_siblings():
    assert SIBLINGS, "transformer and costmodel should share a floor"
    bad = [f"{mod} imports {dep}" for mod, deps in GRAPH.items() for dep in deps
           if {mod.split(".")[0], dep.split(".")[0]} == {"transformer", "costmodel"}
           and _floor(mod) == _floor(dep)]
    assert not bad, "\n".join(bad)


def test_the_cost_model_imports_only_the_ground_floor():
    bad = [f"{mod} imports {dep}" for mod, deps in GRAPH.items() for dep in deps
           if mod.split(".")[0] == "costmodel" and _floor(mod) == _floor("costmodel")
           and dep.split(".")[0] != "costmodel" and _floor(dep) != 0]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    # package __init__ modules re-export their children lazily; edges into a package
    # are edges to the package only
    state: dict = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for dep in GRAPH.get(node, ()):
            if dep == node or node.startswith(dep + "."):
                continue                      # a module importing its own package
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif state.get(dep) is None:
                visit(dep, stack + [dep])
        state[node] = 2

    for mod in GRAPH:
        if state.get(mod) is None:
            visit(mod, [mod])
    assert not cycles, cycles


@pytest.mark.parametrize("mod", ["summasim.costmodel.workload.predict",
                                 "summasim.costmodel.tools.explore", "summasim.costmodel.tools.plan",
                                 "summasim.costmodel.workload.composition",
                                 "summasim.costmodel.tools.accuracy", "summasim.spec",
                                 "summasim.algorithms.table", "summasim.harness.plan",
                                 "summasim.grid"])
def test_pure_modules_do_not_start_mpi(mod):
    code = f"import sys, {mod}; sys.exit(1 if 'mpi4py.MPI' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, mod


def test_registries_are_the_only_lists():
    """No code outside spec's registries spells out the algorithms (four or more) or
    all the schemes as a literal tuple or list (docstrings may name them; a scheme's
    own three SUMMA forms are not a list of the algorithms)."""
    from summasim.spec import ALGORITHM_KINDS as ALGORITHMS
    from summasim.spec import SCHEME_KINDS as SCHEMES

    homes = {PKG / "spec.py"}
    bad = []
    for path in PKG.rglob("*.py"):
        if path in homes:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(names & set(ALGORITHMS)) >= 4 or set(SCHEMES) <= names:
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, bad
