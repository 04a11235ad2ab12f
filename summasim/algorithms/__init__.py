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
``sd25_ab``               A B       2d        2d        2d (2.5D: c = d copies)
``mm3d_ab``               A B       3d-a      3d-b      3d-c (q x q x q cube)
``mm3d_abt``              A B^T     3d-a      3d-bt     3d-c
``mm3d_atb``              A^T B     3d-at     3d-b      3d-c
``ring_allreduce``        sum       any                 same shape, every rank
========================  ========  ========  ========  ===========================

Backward of C = A B is the closed set of Optimus eqs. (1)-(3):
dA = summa_abt(dC, B), dB = summa_atb(A, dC).

The table that describes each algorithm (layouts, stored shapes, divisibility) is
:mod:`summasim.algorithms.table`; it is pure, and so is importing this package: the
functions below are loaded (with mpi4py) on first use.
"""

import importlib

_HOME = {"cannon_ab": "cannon", "summa_ab": "summa", "summa_abt": "summa",
         "summa_atb": "summa", "summa25_ab": "summa25", "summa25_abt": "summa25",
         "summa25_atb": "summa25", "sd25_ab": "deep", "mm3d_ab": "deep", "mm3d_abt": "deep",
         "mm3d_atb": "deep",
         "ring_allreduce": "allreduce",
         "ring_reduce_scatter": "allreduce", "ring_allgather": "allreduce",
         "chunk_bounds": "allreduce", "set_agreement": "_common", "agreement": "_common",
         "agreement_enabled": "_common"}

__all__ = list(_HOME)


def __getattr__(name):
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
