"""How a Comm decides its ring-step limits: naps only on a crowded node (or when the
environment sets the size), never under "spin"; byte counts from the environment are
checked with a message naming the variable."""

import pytest
from mpi4py import MPI

from summasim import comm as C


@pytest.fixture
def node(monkeypatch):
    """Pretend the node has ``ranks`` ranks on ``cores`` cores."""
    def set_node(ranks, cores):
        monkeypatch.setenv("MPI_LOCALNRANKS", str(ranks))
        monkeypatch.setattr(C, "cores", lambda: cores)
    return set_node


@pytest.mark.parametrize("ranks, naps", [(4, False), (7, False), (8, True), (16, True)])
def test_steps_nap_from_four_ranks_per_core(node, monkeypatch, ranks, naps):
    node(ranks, 2)
    monkeypatch.setattr(C, "_NAP_ENV", None)
    c = C.Comm(MPI.COMM_SELF, wait="sleep")
    assert c.nap_limit == (C.NAP_BYTES if naps else C._UNLIMITED)


def test_spin_never_naps_and_the_environment_sets_the_size(node, monkeypatch):
    node(16, 2)
    assert C.Comm(MPI.COMM_SELF, wait="spin").nap_limit == C._UNLIMITED
    node(2, 2)                                        # not crowded, but asked for
    monkeypatch.setattr(C, "_NAP_ENV", 0)
    monkeypatch.setattr(C, "NAP_BYTES", 0)
    assert C.Comm(MPI.COMM_SELF, wait="yield").nap_limit == 0


@pytest.mark.parametrize("raw, want", [("", None), ("  ", None), ("0", 0), ("262144", 262144)])
def test_env_bytes_reads_counts(monkeypatch, raw, want):
    monkeypatch.setenv("SUMMASIM_NAP_BYTES", raw)
    assert C._env_bytes("SUMMASIM_NAP_BYTES") == want


@pytest.mark.parametrize("raw", ["256K", "-1", "1.5"])
def test_env_bytes_refuses_what_is_not_a_count(monkeypatch, raw):
    monkeypatch.setenv("SUMMASIM_NAP_BYTES", raw)
    with pytest.raises(ValueError, match="SUMMASIM_NAP_BYTES"):
        C._env_bytes("SUMMASIM_NAP_BYTES")


@pytest.mark.parametrize("var", C.BYTE_SETTINGS)
def test_a_bad_limit_is_taken_as_the_default_at_import_and_refused_by_a_comm(monkeypatch,
                                                                             var):
    """Read at import, a bad value cannot raise (a front-end would die in its import,
    before it can say so in one line); the front-ends check it before any work, and a
    Comm, made by every other user (the fit, the accuracy workers, library code),
    refuses it: it is never silently the default."""
    monkeypatch.setenv(var, "abc")
    assert C._env_bytes_at_import(var) is None
    with pytest.raises(ValueError, match=var):
        C.Comm(MPI.COMM_SELF)
    monkeypatch.setenv(var, "4096")
    C.Comm(MPI.COMM_SELF)
