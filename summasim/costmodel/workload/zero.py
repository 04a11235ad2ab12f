"""Model states under ZeRO: bytes per parameter (:class:`StateBytes`) and what each data-
parallel rank keeps of the parameters, gradients and optimizer states at stages 0-3."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..machine import itemsize_of
from .pipeline import _check_int

ZERO_STAGES = (0, 1, 2, 3)
#: Default gradient bucket: PyTorch DDP's ``bucket_cap_mb = 25`` (MiB).
BUCKET_BYTES = 25 << 20
#: Dtypes trained in mixed precision by default (16-bit params and grads, fp32 Adam).
HALF_DTYPES = ("float16", "bfloat16")
#: The ring collectives summasim implements by hand, as the MPICH-family algorithm names
#: that price them: all-reduce "ring", reduce-scatter "pairwise" (ring), all-gather "ring".
_RING_ALGORITHM = {"allreduce": "ring", "reduce_scatter": "pairwise", "allgather": "ring"}


# -- model states ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state.

    ``param`` and ``grad`` are the working copies, ``optim`` each of Adam's two moments,
    ``master`` an optional higher-precision copy of the parameters that the optimizer
    updates (0: none). The ZeRO paper's mixed precision is ``StateBytes(2, 2, 4, 4)``
    (16 bytes per parameter); this simulator's plain float64 is ``StateBytes(8, 8, 8)``.
    """

    param: int = 8
    grad: int = 8
    optim: int = 8
    master: int = 0

    def __post_init__(self):
        for name in ("param", "grad", "optim", "master"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0 \
                    or (val == 0 and name != "master"):
                raise ValueError(f"StateBytes.{name} must be a positive integer "
                                 f"(master: >= 0), got {val!r}")

    @classmethod
    def for_dtype(cls, dtype, mixed: bool | None = None) -> "StateBytes":
        """Mixed precision (2, 2, 4, 4) for 16-bit dtypes, else everything in ``dtype``
        with no master copy; ``mixed`` forces either."""
        it = itemsize_of(dtype)
        mixed = (str(getattr(dtype, "name", dtype)) in HALF_DTYPES) if mixed is None else mixed
        return cls(it, it, 4, 4) if mixed else cls(it, it, it, 0)

    @classmethod
    def for_training(cls, dtype, grad_reduce: str | None = None) -> "StateBytes":
        """The model states of :class:`summasim.spec.Training` in ``dtype``: mixed
        precision for bfloat16/float16 (16-bit parameters, float32 master weights and
        Adam moments; Micikevicius et al. 2018, ZeRO section 3.1) with the gradients in
        the type of the data-parallel reduction, ``grad_reduce``: ``float32`` (the
        default) accumulates them in a float32 buffer and reduces 4 bytes per item
        (Megatron-LM's ``main_grad``, ``--accumulate-allreduce-grads-in-fp32``):
        ``(2, 4, 4, 4)``, 18 bytes per parameter; ``bfloat16`` keeps and reduces them in
        16 bits, the ZeRO paper's ``(2, 2, 4, 4)``, 16 bytes. Plain dtypes: everything
        in ``dtype`` (``grad_reduce`` must be None)."""
        name = str(getattr(dtype, "name", dtype))
        if name not in HALF_DTYPES:
            if grad_reduce is not None:
                raise ValueError(f"grad_reduce {grad_reduce} needs mixed precision "
                                 f"(bfloat16 or float16), the dtype is {name}")
            return cls.for_dtype(name, mixed=False)
        grad_reduce = grad_reduce or "float32"
        if grad_reduce not in ("float32", "bfloat16"):
            raise ValueError(f"grad_reduce must be float32 or bfloat16, got {grad_reduce!r}")
        return cls(itemsize_of(name), itemsize_of(grad_reduce), 4, 4)

    @property
    def optimizer(self) -> int:
        """Optimizer bytes per parameter: two moments and the master copy."""
        return 2 * self.optim + self.master

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer

    def to_dict(self) -> dict:
        return {"param": self.param, "grad": self.grad, "optim": self.optim,
                "master": self.master, "total": self.total}


def _int_pieces(params) -> list:
    """``params`` as a list of non-negative ints (a ValueError names a bad one)."""
    if isinstance(params, (numbers.Real, str, bytes)) or not hasattr(params, "__iter__"):
        pieces = [params]
    else:
        pieces = list(params)
    for n in pieces:
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, numbers.Integral)) \
                or n < 0:
            raise ValueError(f"params must be non-negative integers, got {n!r}")
    return pieces


def _states(full: float, part: float, zero: int, sb: "StateBytes") -> dict:
    """Model-state bytes of ``full`` parameters whose 1/dp shard has ``part``."""
    p_items = part if zero >= 3 else full
    g_items = part if zero >= 2 else full
    o_items = part if zero >= 1 else full
    out = {"params": p_items * sb.param, "grads": g_items * sb.grad,
           "optimizer": o_items * sb.optimizer}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def model_state_bytes(params, dp: int, zero: int, param_bytes: int = 8, grad_bytes: int = 8,
                      optim_bytes: int = 8, master_bytes: int = 0) -> dict:
    """Persistent model-state bytes per device under ZeRO stage ``zero``.

    Parameters
    ----------
    params : int or sequence of int
        P, the parameters the device holds without ZeRO (its tensor shard of its
        pipeline stage). A sequence gives the pieces that are sharded separately
        (each flattened and split over dp).
    dp : int
        Data-parallel ranks the states are partitioned over.
    zero : {0, 1, 2, 3}
    param_bytes, grad_bytes : int
        Bytes per parameter and per gradient (16-bit mixed precision: 2, 2).
    optim_bytes : int
        Bytes of each of Adam's two moments (mixed precision: 4).
    master_bytes : int
        Bytes of the optimizer's master copy of a parameter (mixed precision: 4;
        plain: 0). It is optimizer state: partitioned from ZeRO 1 on.

    Returns
    -------
    dict
        ``{"params", "grads", "optimizer", "total"}`` in bytes. A partitioned state
        counts the largest shard, ``ceil(n / dp)`` items of each piece (rank 0 of the
        dp group in the ring's chunking, ``n // dp + (r < n % dp)``).

    Notes
    -----
    With ``K = 2 optim_bytes + master_bytes``: ZeRO 0 ``P (bp + bg + K)``; 1 ``P (bp +
    bg) + K P/dp``; 2 ``P bp + (bg + K) P/dp``; 3 ``(bp + bg + K) P/dp``. With (2, 2,
    4, 4) these are the ZeRO paper's 16P, 4P + 12P/dp, 2P + 14P/dp and 16P/dp.

    References
    ----------
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC 2020, section 5 and Figure 1.
    """
    sb = StateBytes(param_bytes, grad_bytes, optim_bytes, master_bytes)
    _check_int("dp", dp)
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of 0, 1, 2, 3, got {zero!r}")
    pieces = _int_pieces(params)
    return _states(sum(int(n) for n in pieces), sum(-(-int(n) // dp) for n in pieces), zero, sb)


# -- pipeline -------------------------------------------------------------------------------
