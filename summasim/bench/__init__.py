"""The benchmarks, one module per benchmark: ``mpirun -n P python -m summasim.bench
BENCHMARK [options]`` (:mod:`summasim.bench.__main__` dispatches).

``gemm``         :mod:`.gemm`         distributed products vs the single-process ceiling
``allreduce``    :mod:`.allreduce`    ring_allreduce vs a plain ring and MPI_Allreduce
``ring-steps``   :mod:`.ring_steps`   a ring all-reduce's time per step
``transformer``  :mod:`.transformer`  each tensor-parallel scheme vs the serial model
``mesh``         :mod:`.mesh`         sharded-training compositions vs pure tensor parallelism
``layer``        :mod:`.layer`        one serial layer vs PyTorch eager (no MPI)

Shared helpers are in :mod:`.common`; every timing loop is the harness's one timer
(:mod:`summasim.harness.timing`) and every prediction the cost model's
(:mod:`summasim.costmodel.tools.bench`).
"""
