"""summasim: an MPI simulation and validation engine for distributed matrix
multiplication and tensor-parallel transformers.

See DESIGN notes in the README for the module map.
"""

__version__ = "0.1.0"
