"""summasim: an MPI simulation and validation engine for distributed matrix
multiplication and tensor-parallel transformers.

The floors and each module's job: docs/architecture.md.
"""

__version__ = "0.1.0"
