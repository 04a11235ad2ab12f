"""Mixed precision: 16-bit compute with fp32 master weights, fp32 Adam and loss scaling.

What a mixed-precision step does (Micikevicius et al. 2018, "Mixed Precision Training",
ICLR, section 3; Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training",
for bfloat16):

1. the fp32 master weights are rounded to the 16-bit compute type (:meth:`Precision.round`);
2. the forward and backward run on 16-bit values: every tensor an op hands to the next
   op (activations and their gradients) is rounded to 16 bits, while each op computes
   internally in fp32 -- a GEMM multiplies 16-bit inputs and accumulates in fp32, as
   tensor cores do (NVIDIA A100 whitepaper, "TF32 and mixed precision": FP16/BF16 inputs,
   FP32 accumulate);
3. the backward is seeded with the loss times a scale S, so that small gradients do not
   flush to zero in 16 bits (Micikevicius et al., section 3.2);
4. the gradients are checked for Inf/NaN; if any rank finds one, every rank skips the
   step and a dynamic scaler halves S; otherwise the gradients are divided by S and the
   fp32 Adam updates the fp32 master weights (:class:`LossScaler`).

On the CPU the 16-bit values travel in float32 containers: :meth:`Precision.round`
rounds each element to the nearest 16-bit value (round to nearest, ties to even, through
``ml_dtypes`` for bfloat16 and NumPy's float16) and stores it back as float32, so every
NumPy kernel runs in fp32 on exactly the values a 16-bit tensor holds. The messages and
the memory are counted at 2 bytes per item where a real run would hold 16-bit tensors.

bfloat16 (8 exponent bits) has float32's range, so its gradients do not overflow and
need no scaling (loss scale ``none`` by default); float16 (5 exponent bits, largest
finite 65504) needs it (``dynamic`` by default).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from summasim.backends import array_module
from summasim.validate import HALF_UNIT_ROUNDOFF as UNIT_ROUNDOFF
#: The largest finite value of each 16-bit type.
FINITE_MAX = {"bfloat16": float.fromhex("0x1.fep127"), "float16": 65504.0}


def _bfloat16_type():
    import ml_dtypes

    return ml_dtypes.bfloat16


class Precision(NamedTuple):
    """A mixed-precision policy: the 16-bit compute type ``name`` ("bfloat16" or
    "float16") over float32 containers and fp32 master weights."""

    name: str

    @classmethod
    def of(cls, name: str) -> "Precision":
        if name not in UNIT_ROUNDOFF:
            raise ValueError(f"mixed precision computes in bfloat16 or float16, got {name!r}")
        return cls(name)

    @property
    def unit_roundoff(self) -> float:
        return UNIT_ROUNDOFF[self.name]

    @property
    def itemsize(self) -> int:
        """Bytes of one 16-bit item (what messages and activations cost)."""
        return 2

    def round(self, x, out=None):
        """``x`` (float32) rounded elementwise to the nearest 16-bit value, as float32.

        In place when ``out is x``. Values past the 16-bit range become +-Inf, as a
        16-bit store does; NaN stays NaN.
        """
        xp = array_module(x)
        if out is None:
            out = xp.empty(x.shape, dtype=np.float32)
        if self.name == "float16":
            with np.errstate(over="ignore"):       # past 65504 is Inf, as a store is
                out[...] = x.astype(np.float16)
            return out
        if xp is np:
            out[...] = np.asarray(x, dtype=np.float32).astype(_bfloat16_type())
            return out
        out[...] = round_bfloat16_bits(x, xp)   # another array module (CuPy)
        return out

    def round_tree(self, tree: dict) -> dict:
        """Every array of ``tree`` rounded (a new dict of new float32 arrays)."""
        return {k: self.round(v) for k, v in tree.items()}


def round_bfloat16_bits(x, xp):
    """``x`` rounded to bfloat16 on its float32 bit pattern (for array modules without a
    bfloat16 type): add 0x7FFF plus the lowest kept bit, then clear the low 16 bits --
    round to nearest, ties to even; a carry out of the significand bumps the exponent,
    so values past bfloat16's largest finite become Inf. NaN is returned unchanged."""
    f = xp.array(x, dtype=np.float32, copy=True)
    nan = xp.isnan(f)            # before rounding: a NaN's payload may carry into Inf or 0
    bits = f.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    bits += np.uint32(0x7FFF) + lsb
    bits &= np.uint32(0xFFFF0000)
    return xp.where(nan, xp.asarray(x, dtype=np.float32), f)


def has_overflow(arrays) -> bool:
    """Whether any array holds an Inf or a NaN (this rank's part of the verdict; the
    caller reduces it over every rank that shares the step)."""
    for a in arrays:
        xp = array_module(a)
        if a.size and not bool(xp.isfinite(a).all()):
            return True
    return False


class LossScaler:
    """Static or dynamic loss scaling (Micikevicius et al. 2018, section 3.2).

    ``kind``: "none" (S = 1), "static:S", or "dynamic": start at ``init`` (2^16, PyTorch
    ``torch.amp.GradScaler``'s default), halve S and skip the step on an overflow, double
    it after ``growth_interval`` (2000, GradScaler's default) overflow-free steps in a
    row. :meth:`update` takes the step's collective overflow verdict and returns whether
    the optimizer may apply the step. ``skipped`` counts the skipped steps.
    """

    def __init__(self, kind: str = "dynamic", *, init: float = 2.0 ** 16,
                 growth: float = 2.0, backoff: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        kind = str(kind)
        if kind.startswith("static:"):
            scale = float(kind.split(":", 1)[1])
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"a static loss scale must be finite and positive, got "
                                 f"{kind!r}")
            self.kind, self.scale = "static", scale
        elif kind in ("dynamic", "none"):
            self.kind, self.scale = kind, (float(init) if kind == "dynamic" else 1.0)
        else:
            raise ValueError(f"loss scale must be none, dynamic or static:S, got {kind!r}")
        if not (growth > 1 and 0 < backoff < 1 and growth_interval >= 1 and min_scale > 0):
            raise ValueError("LossScaler needs growth > 1, 0 < backoff < 1, "
                             "growth_interval >= 1 and min_scale > 0")
        self.growth, self.backoff = float(growth), float(backoff)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.good_steps = 0
        self.skipped = 0
        self.steps = 0

    def update(self, overflow: bool) -> bool:
        """Record one step's collective overflow verdict; True when the step applies.

        An overflow always skips the step (a static scale, or none, keeps S: the run
        reports the skip; a dynamic scale halves S, never below ``min_scale``).
        """
        self.steps += 1
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            if self.kind == "dynamic":
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return False
        self.good_steps += 1
        if self.kind == "dynamic" and self.good_steps >= self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
        return True


# --------------------------------------------------------------------------- #
# 16-bit messages: the bits of a 16-bit value, two bytes per item on the wire  #
# --------------------------------------------------------------------------- #
def pack_bits(precision: Precision, x, out=None):
    """``x`` (float32) rounded to ``precision``'s 16-bit type, as its uint16 bit
    patterns (what a 16-bit message carries). A value that is already 16-bit (an
    activation under :func:`summasim.transformer.ops.autocast`, a compute copy) packs
    exactly."""
    xp = array_module(x)
    if out is None:
        out = xp.empty(x.shape, dtype=np.uint16)
    if precision.name == "float16":
        with np.errstate(over="ignore"):
            out.view(np.float16)[...] = x
    elif xp is np:
        out.view(_bfloat16_type())[...] = x
    else:                                   # bfloat16 is the top half of float32
        out[...] = (round_bfloat16_bits(x, xp).view(np.uint32) >> np.uint32(16)
                    ).astype(np.uint16)
    return out


def unpack_bits(precision: Precision, bits, out=None):
    """The float32 values of 16-bit patterns ``bits`` (exact: float32 holds every
    16-bit value)."""
    xp = array_module(bits)
    if out is None:
        out = xp.empty(bits.shape, dtype=np.float32)
    if precision.name == "float16":
        out[...] = bits.view(np.float16)
    elif xp is np:
        out[...] = bits.view(_bfloat16_type())
    else:
        out.view(np.uint32)[...] = bits.astype(np.uint32) << np.uint32(16)
    return out


def bits_adder(precision: Precision):
    """``add(a, b, out=)`` on uint16 bit patterns: the 16-bit sum, rounded to nearest
    (what a ring reduction in bfloat16 or float16 adds at each step). NumPy adds in the
    16-bit type itself (ml_dtypes' bfloat16, NumPy's float16); other array modules
    unpack, add in float32 and round."""
    half = np.float16 if precision.name == "float16" else None

    def add(a, b, out):
        xp = array_module(out)
        if xp is np or half is not None:
            t = half or _bfloat16_type()
            with np.errstate(over="ignore"):
                xp.add(a.view(t), b.view(t), out=out.view(t))
            return out
        s = unpack_bits(precision, a)
        s += unpack_bits(precision, b)
        return pack_bits(precision, s, out=out)

    return add
