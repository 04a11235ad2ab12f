"""Shared fixtures for the serial tests and the MPI launchers."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec_command() -> list[str]:
    """The launcher: $SUMMASIM_MPIEXEC, else mpiexec beside this Python, else on PATH.

    Extra flags (e.g. ``--oversubscribe`` for Open MPI) come from
    $SUMMASIM_MPIEXEC_FLAGS.
    """
    from summasim.cli import UsageError
    from summasim.harness.worker import check_launcher, mpiexec

    try:
        check_launcher()
    except UsageError as exc:
        pytest.fail(f"{exc}: install the mpich wheel (pip install mpich) or set "
                    f"SUMMASIM_MPIEXEC")
    return mpiexec()


@pytest.fixture(scope="session")
def mpiexec():
    return mpiexec_command()


_OPEN_MPI: list = []


def launcher_is_open_mpi() -> bool:
    """Whether the suite's launcher is Open MPI's (``mpiexec --version`` names OpenRTE or
    Open MPI). Open MPI forwards a Ctrl-C to the ranks as SIGTERM, sends SIGTERM to the
    other ranks when one dies of a signal, and reports a failed job in a framed message
    of its own (:func:`launcher_free`)."""
    if not _OPEN_MPI:
        import subprocess

        try:
            text = subprocess.run([*mpiexec_command(), "--version"], capture_output=True,
                                  text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        _OPEN_MPI.append("OpenRTE" in text or "Open MPI" in text or "Open-MPI" in text)
    return _OPEN_MPI[0]


def launcher_free(text: str) -> list[str]:
    """The non-empty lines of a job's stderr without its launcher's own report. Open MPI
    frames each of its messages ("Primary job terminated normally, but 1 process
    returned a non-zero exit code", "mpiexec detected that one or more processes exited
    with non-zero status") between lines of dashes; MPICH's Hydra adds none to a job
    that exits 2."""
    out, inside = [], False
    for line in text.splitlines():
        bare = line.strip()
        if len(bare) >= 20 and set(bare) == {"-"}:
            inside = not inside
        elif bare and not inside:
            out.append(line)
    return out


def mpi_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


#: How far a frozen prediction may move in its last bits: Python 3.12's built-in ``sum``
#: of floats is compensated (``sum([0.1] * 10)`` is 1.0, 0.9999999999999999 on 3.11), so
#: the same arithmetic ends a few ulps apart across versions; any change of a mechanism
#: moves a prediction by far more.
FROZEN_REL = 1e-12


def frozen_same(got, want) -> bool:
    """``got`` equals the frozen ``want``: floats within :data:`FROZEN_REL` of each other,
    everything else (ints, strings, None, the nesting of lists, tuples and dicts)
    exactly."""
    if isinstance(want, float) or isinstance(got, float):
        if not isinstance(got, (int, float)) or not isinstance(want, (int, float)) or \
                isinstance(got, bool) or isinstance(want, bool):
            return got == want
        return got == want or abs(got - want) <= FROZEN_REL * max(abs(got), abs(want))
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(map(frozen_same, got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(frozen_same(got[k], want[k]) for k in want)
    return got == want


def synthetic_machine(**kw):
    """A small made-up 2-core machine for cost-model tests; ``kw`` overrides fields."""
    from summasim.costmodel.machine import Link, Machine

    link = Link(alpha_small=2e-6, beta_small=1e-10, alpha_large=5e-6, beta_large=8e-11,
                eager_threshold=8192)
    base = dict(name="synthetic", source="test", cores=2, intra=link,
                gamma_gemm={"float64": [[64, 4e-11], [1024, 2e-11]]}, gamma_reduce=1e-10)
    base.update(kw)
    return Machine(**base)


def matmul_result(alg, q, n, p, measured):
    """The measured run (a :class:`~summasim.costmodel.workload.measured.MeasuredRun`) of
    a distributed product (cost-model analysis tests): its closed-form messages on every
    rank of the q x q grid (five-field event lines, as recorded before the ``blocking``
    flag), ``measured`` as its spans."""
    from summasim.costmodel.workload.measured import EventCount, MeasuredRun
    from summasim.costmodel.workload.traffic import algorithm_messages

    events, coords = [], []
    for i in range(q):
        for j in range(q):
            c = (0, i, j)
            events.append(tuple(EventCount(mc.op, mc.group, mc.group_size, mc.nbytes, mc.count)
                                for mc in algorithm_messages(alg, n, n, n, q, 1, 8, c)))
            coords.append(c)
    return MeasuredRun(kind="matmul", p=p, dtype="float64", algorithm=alg, q=q, d=1, m=n,
                       k=n, n=n, spans=tuple(measured), events=tuple(events),
                       coords=tuple(coords))
