"""The experiment layer: everything that runs a case end to end.

Front-ends (``summasim.run``, ``summasim.bench``, ``python -m summasim.costmodel
accuracy``) ask the harness for cases; the harness builds a ``Grid`` and a backend,
makes each rank's own inputs, calls ``algorithms`` or a ``transformer`` scheme,
checks the result with no rank holding a global operand, times it, and hands the
trace and timings to ``costmodel``, which never calls back up.

==================  ===========================================================
module              what it holds
==================  ===========================================================
``cases``           typed cases: MatmulCase, RingCase, TransformerCase
``plan``            which cases fit p ranks, and why the others do not
``data``            rank-local inputs (any block of a global random matrix)
``check``           rank-local validation (exact panels, Freivalds) and the
                    collective verdict that cannot lose a NaN
``inject``          fault injection (nan, inf, perturb, drop, drift) for the self-test
``timing``          the one timer (spans after a non-spinning barrier)
``memory``          per-rank memory estimate, refusal, largest size that fits
``execute``         executors: run_product, run_ring, run_case -> Result
``transformer``     the training-step executor (scheme vs the serial model)
``composed``        the sharded-training executor (a mesh vs the serial model)
``shared``          the serial reference as one read-only copy per node
``report``          tables and JSON records of results
``worker``          the MPI worker and its launcher (mpiexec under timeout)
``accuracy``        the cost model's accuracy benchmark, measuring side
``machinefile``     which cost-model machine a job uses (fit lock, sanity, load)
``load``            CPU used by other processes (/proc), waiting for quiet
==================  ===========================================================
"""
