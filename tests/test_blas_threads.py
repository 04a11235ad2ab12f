"""One BLAS thread per rank: ``mpiutil.limit_blas_threads`` reaches SciPy's own
OpenBLAS (the NumPy backend's GEMMs), which is imported lazily at the first GEMM, after
the limit is set. Before it did, every rank of a run launched without
``OPENBLAS_NUM_THREADS`` ran SciPy's GEMMs on one thread per core (an Optimus 2x2 step of
``bench mesh``'s default model at p = 4 on 2 cores: 4.9 s instead of 0.3 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json
from summasim.mpiutil import limit_blas_threads
keep = limit_blas_threads({n})
import scipy.linalg.blas  # what the NumPy backend imports at its first GEMM
from threadpoolctl import threadpool_info
print(json.dumps([[d["filepath"], d["num_threads"]] for d in threadpool_info()
                  if d.get("user_api") == "blas"]))
"""


def _blas_threads(n: int) -> list:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(n=n)], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2,
                    reason="one core: every BLAS library starts with one thread, so the "
                           "limit cannot be told from the default")
def test_the_limit_reaches_scipys_blas_loaded_after_it():
    libs = _blas_threads(1)
    assert any("scipy" in path for path, _ in libs), libs   # SciPy's own OpenBLAS is there
    assert libs and all(threads == 1 for _, threads in libs), libs
