"""pytest under MPI: run as ``mpiexec -n P python -m mpi4py -m pytest mpi_tests``.

* Every rank runs every test; tests are written for the communicator they get,
  not for a process count, and skip on every rank alike when the grid does not fit.
* Verdicts are collective (:func:`_util.parallel_assert`): all ranks agree first.
* An exception that is NOT a collective verdict (so possibly on one rank only)
  aborts the whole job with that rank's traceback instead of leaving the others
  waiting in a collective. pytest-timeout (thread method) bounds every test, and
  the launcher in tests/ runs mpiexec under a timeout too.
* Hypothesis is derandomized and has no example database, so all ranks draw the
  same examples in the same order.
* Only rank 0 writes pytest's report to stdout.
"""

from __future__ import annotations

import os
import sys
import traceback

import pytest
from hypothesis import HealthCheck, Phase, settings
from mpi4py import MPI

from _util import CollectiveFailure

from summasim.backends import NAMES as BACKENDS
from summasim.mpiutil import abort_job

settings.register_profile(
    "mpi",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("SUMMASIM_MPI_EXAMPLES", "8")),
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    print_blob=False,
)
settings.load_profile("mpi")

WORLD = MPI.COMM_WORLD


def pytest_addoption(parser):
    parser.addoption("--backend", default="numpy", choices=BACKENDS,
                     help="array backend the algorithm tests run on (default numpy)")


def pytest_configure(config):
    if WORLD.Get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one report, from rank 0
    if not config.getoption("timeout", None):
        config.option.timeout = 120
        config.option.timeout_method = "thread"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.failed and call.excinfo is not None \
            and not call.excinfo.errisinstance(CollectiveFailure):
        # a failure that the ranks did not agree on: the others may be waiting for us
        tb = "".join(traceback.format_exception(call.excinfo.value))
        abort_job(WORLD, f"[rank {WORLD.Get_rank()}/{WORLD.Get_size()}] {item.nodeid} raised "
                         f"outside a collective verdict; aborting the job:\n{tb}")


@pytest.fixture
def world():
    return WORLD


@pytest.fixture(scope="module")
def grids(backend):
    """``get(q, d, pc=None)``: a Grid over every rank (q rows, pc columns, d deep), built
    once per module on the chosen backend, its trace cleared; freed at the module's end."""
    from summasim.grid import Grid

    made: dict = {}

    def get(q, d, pc=None):
        if (q, d, pc) not in made:
            made[(q, d, pc)] = Grid(WORLD, q, d, backend=backend, pc=pc)
        g = made[(q, d, pc)]
        g.trace.clear()
        return g

    yield get
    for g in made.values():
        g.free()


@pytest.fixture(scope="session")
def backend(request):
    """The backend chosen with --backend. CuPy skips (on every rank) only without a GPU."""
    name = request.config.getoption("backend")
    if name == "cupy":
        try:
            import cupy

            ndev = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 - no CuPy or no driver
            ndev, why = 0, f"{type(e).__name__}: {e}"
        else:
            why = "no CUDA device"
        if WORLD.allreduce(ndev, op=MPI.MIN) < 1:
            pytest.skip(f"--backend cupy needs a GPU on every rank ({why})")
    from summasim.backends import get_backend

    return get_backend(name)
