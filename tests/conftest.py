"""Shared fixtures for the serial tests and the MPI launchers."""

from __future__ import annotations

import os
import shlex
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec_command() -> list[str]:
    """The launcher: $SUMMASIM_MPIEXEC, else mpiexec beside this Python, else on PATH.

    Extra flags (e.g. ``--oversubscribe`` for Open MPI) come from
    $SUMMASIM_MPIEXEC_FLAGS.
    """
    exe = os.environ.get("SUMMASIM_MPIEXEC")
    if not exe:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        exe = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not exe:
        pytest.fail("no mpiexec found: install the mpich wheel (pip install mpich) or set "
                    "SUMMASIM_MPIEXEC")
    return shlex.split(exe) + shlex.split(os.environ.get("SUMMASIM_MPIEXEC_FLAGS", ""))


@pytest.fixture(scope="session")
def mpiexec():
    return mpiexec_command()


def mpi_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


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
