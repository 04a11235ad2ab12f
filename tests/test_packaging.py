"""summasim installed as a wheel (``pip install .``, not the editable install of the
set-up scripts): every module and data file of the source tree is in it, and the
wheel alone imports and runs, away from the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


def _source_files() -> set[str]:
    out = set()
    for top, dirs, files in os.walk(os.path.join(ROOT, "summasim")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                out.add(os.path.relpath(os.path.join(top, name), ROOT).replace(os.sep, "/"))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of what a clone holds: setuptools builds in the tree it is given,
    # and a build/ left there by an earlier install would lend the wheel its files.
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "summasim"), src / "summasim",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dest = tmp_path_factory.mktemp("wheel")
    # with this venv's setuptools and wheel (the test extra's): no index is needed
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "-w", str(dest), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"pip wheel failed:\n{res.stdout}\n{res.stderr}"
    found = [f for f in os.listdir(dest) if f.endswith(".whl")]
    assert len(found) == 1, found
    return dest / found[0]


def test_the_wheel_holds_every_module_and_data_file(wheel):
    with zipfile.ZipFile(wheel) as zf:
        held = {n for n in zf.namelist() if n.startswith("summasim/")}
    missing = sorted(_source_files() - held)
    assert not missing, (f"{len(missing)} files of summasim/ are not in the wheel (a package "
                         f"without __init__.py, or data not in package_data): {missing[:10]}")


def test_the_wheel_alone_imports_every_module_and_prices(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    probe = (
        "import importlib, pkgutil, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import summasim\n"
        f"assert summasim.__file__.startswith({str(site)!r}), summasim.__file__\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(summasim.__path__, 'summasim.'):\n"
        "    if m.name.endswith('__main__') or m.name.endswith('cupy_backend'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{m.name}: {exc!r}')\n"
        "assert not bad, bad\n"
        "from summasim.costmodel.machine import list_presets, load_preset\n"
        "names = list_presets()\n"
        "assert names and all(load_preset(n).name for n in names), names\n"
        "print(len(names))\n")
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.split()[-1]) >= 1
    run = subprocess.run([sys.executable, "-c",
                          f"import sys; sys.path.insert(0, {str(site)!r}); "
                          "from summasim.costmodel.__main__ import main; "
                          "sys.exit(main(['devset']))"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr
    assert "MAPE" in run.stdout
