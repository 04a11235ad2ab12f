"""The rate of local GEMMs: the machine's ``gamma`` table (seconds/flop), or on a
roofline device :func:`~summasim.costmodel.compute.roofline.gemm_roofline`. Seconds."""

from __future__ import annotations

from ..machine import Machine
from .roofline import gemm_roofline


def gemms_seconds(machine: Machine, gemms, dtype, reduce_bytes) -> float:
    """Seconds of ``gemms`` (``(m, k, n, count)`` each) at the machine's ``gamma``, plus
    ``reduce_bytes`` of local reduction at ``gamma_reduce``."""
    t = sum(cnt * machine.gemm_time(a, b, c, dtype) for a, b, c, cnt in gemms)
    return t + machine.gamma_reduce * reduce_bytes


def gemm_seconds(machine: Machine, m_, k_, n_, cnt, dtype, itemsize, batched=False) -> float:
    """``cnt`` local GEMMs: the machine's gamma, or on a roofline device
    :func:`~summasim.costmodel.compute.roofline.gemm_roofline` (one launch per GEMM, or one
    for the whole batch when ``batched``: attention's per-head products)."""
    if machine.device is None:
        return cnt * machine.gemm_time(m_, k_, n_, dtype)
    dev = machine.device
    one = gemm_roofline(machine, dev, m_, k_, n_, dtype, itemsize,
                        batch=int(cnt) if batched and cnt > 1 else 1)
    if batched and cnt > 1 and one > 0:
        return cnt * (one - dev.launch_seconds) + dev.launch_seconds
    return cnt * one
