"""Distributed matrix products and all-reduce: local block in, local block out.

========================  ========  ========  ========  ===========================
function                  C =       A layout  B layout  C layout
========================  ========  ========  ========  ===========================
``cannon_ab``             A B       2d        2d        2d (d == 1)
``summa_ab``              A B       2d        2d        2d
``summa_abt``             A B^T     2d        2d        2d
``summa_atb``             A^T B     2d        2d        2d
``summa25_ab``            A B       2.5d      2d        2.5d
``summa25_abt``           A B^T     2.5d      2d        2.5d
``summa25_atb``           A^T B     2.5d      2.5d      2d (all-reduced over depth)
``ring_allreduce``        sum       any                 same shape, every rank
========================  ========  ========  ========  ===========================

Backward of C = A B is the closed set of Optimus eqs. (1)-(3):
dA = summa_abt(dC, B), dB = summa_atb(A, dC).
"""

from .allreduce import chunk_bounds, ring_allgather, ring_allreduce, ring_reduce_scatter
from .cannon import cannon_ab
from .summa import summa_ab, summa_abt, summa_atb
from .summa25 import summa25_ab, summa25_abt, summa25_atb

__all__ = ["cannon_ab", "summa_ab", "summa_abt", "summa_atb", "summa25_ab", "summa25_abt",
           "summa25_atb", "ring_allreduce", "ring_reduce_scatter", "ring_allgather",
           "chunk_bounds"]
