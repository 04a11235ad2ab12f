"""Local compute: the rate of GEMMs (``gemm``) and the roofline of every other kernel
(``roofline``: :class:`Device`, max(flops / peak, bytes / bandwidth) + launch)."""

from __future__ import annotations
