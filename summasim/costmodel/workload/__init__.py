"""The priced workloads (pure, no MPI): what each algorithm and training step sends and
computes, and its time on a :class:`~summasim.costmodel.machine.Machine`.

traffic, bounds   each product's per-rank messages in closed form, and the lower bounds
pricer, predict   a run's predicted time: from its trace, or in closed form
scheme, layer     the transformer workload and its grid; one layer's cost per scheme
step, tensor      a tensor grid's whole training step, and one micro-batch of it
composition       data x pipeline x ZeRO x tensor compositions (``price_composition``)
mesh, pipeline, overlap, zero, stage_memory, footprint
                  the composition's groups, schedules, overlap, model states and memory
measured, table1  measured runs as the pricers read them; the SUMMA2.5-LM paper's Table 1
"""
