"""Table 1 of the SUMMA2.5-LM paper: each scheme's communication and computation per layer,
in the paper's symbols, as this model counts them (:func:`table1`) and as the paper
prints them (:func:`table1_paper`)."""

from __future__ import annotations

import math
from fractions import Fraction

from . import traffic as _traffic
from .layer import layer_ops, product_work
from .scheme import Scheme, TransformerConfig, _ALIASES

# -- Table 1 ------------------------------------------------------------------------------
def _log2_exact(x: int):
    return x.bit_length() - 1 if x > 0 and x & (x - 1) == 0 else math.log2(x)


def table1(scheme: str | Scheme, b: int, s: int, h: int, p: int, n: int | None = None,
           checkpoint: bool = True, ffn: float = 4) -> dict[str, Fraction | float]:
    """The Optimus paper's Table 1 entries computed from :func:`layer_ops`.

    Communication is priced with the paper's formulas (alpha = 0, beta = 1 per
    scalar; an all-gather ``(P-1) B`` of its B per rank and a reduce-scatter ``(P-1)/P B``,
    as :mod:`~summasim.costmodel.collectives.mpich`'s "paper" mode), computation is
    counted in scalar multiplications. Any scheme: SUMMA2.5 on [q, q, d], a rectangular
    ``pr x pc`` (``[pr, pc, d]``) grid (``Scheme.make("optimus", q=pr, pc=pc)``; the
    busiest rank, rank (0, 0, 0), where the sizes do not divide it) and the 3D cube
    (``Scheme.make("3d", q=q)``) have no column in the paper. With integer arguments and
    group sizes powers of two the values are exact Fractions. ``n`` defaults to
    gcd(h, p q) (heads that every grid divides); ``ffn`` is the MLP multiplier f (the
    paper's 4).

    Returns
    -------
    dict
        Keys "forward communication", "backward communication", "forward
        computation", "backward computation".
    """
    sch = scheme if isinstance(scheme, Scheme) else Scheme.make(scheme, p=p)
    n = n if n is not None else math.gcd(h, sch.p * sch.q) or 1
    cfg = TransformerConfig(b=b, s=s, h=h, n=n, N=1, dtype="float64", checkpoint=checkpoint,
                            ffn=ffn)
    ops = layer_ops(sch, cfg)
    out = {}
    for key in ("forward", "backward"):
        comm, mults, logs = Fraction(0), Fraction(0), {}
        for op in ops[key]:
            if op[0] == "gemm":
                mults += Fraction(op[4]) * Fraction(op[1]) * Fraction(op[2]) * Fraction(op[3])
                continue
            if op[0] == "mm":
                msgs, work = product_work(sch, op, 1, strict=True)
                mults += sum(Fraction(a * b_ * c * cnt) for a, b_, c, cnt in work.gemms)
            else:
                _, cop, grp, size, items, cnt = op
                msgs = [_traffic.MessageClass(cop, grp, size, items, cnt)]
            for mc in msgs:
                B, P = Fraction(mc.nbytes) * mc.count, mc.group_size
                if P <= 1:
                    continue
                if mc.op in ("bcast", "reduce"):
                    if isinstance(_log2_exact(P), int):
                        comm += B * _log2_exact(P)
                    else:                 # log2 P irrational: its coefficient exactly
                        logs[P] = logs.get(P, Fraction(0)) + B
                elif mc.op == "allreduce":
                    comm += 2 * B * Fraction(P - 1, P)
                elif mc.op == "allgather":        # B is this rank's piece
                    comm += B * (P - 1)
                elif mc.op == "reduce_scatter":   # B is the whole buffer
                    comm += B * Fraction(P - 1, P)
                else:
                    comm += B
        for P, coef in sorted(logs.items()):  # one rounding per group size, as the paper's
            comm = comm + float(coef) * math.log2(P)
        out[f"{key} communication"] = comm
        out[f"{key} computation"] = mults
    return out


def table1_paper(scheme: str, b, s, h, p, ffn: float = 4) -> dict:
    """Table 1 as printed (log = log2; Fractions for integer input when sqrt(p) is
    an integer power of two), for an MLP ``ffn`` times h wide: the paper's f = 4
    gives the printed entries; for any f, 12 b s h^2 becomes (4 + 2f) b s h^2,
    7 b s h becomes (3 + f) b s h and 12 h^2 becomes (4 + 2f) h^2."""
    key = _ALIASES.get(str(scheme).lower())
    if key not in ("megatron", "optimus"):
        raise ValueError(f"table1_paper: Table 1 of the Optimus paper has a Megatron and an "
                         f"Optimus column, not {scheme!r}; for SUMMA2.5 on [q, q, d] use "
                         f"table1(Scheme.make('summa25', q=q, d=d), ...), for the 3D "
                         f"cube table1(Scheme.make('3d', q=q), ...)")
    f = Fraction(ffn)
    wide, act = 4 + 2 * f, 3 + f              # 12 and 7 for f = 4
    comp_f = (wide * b * s * h * h + 2 * b * s * s * h) / Fraction(p)
    comp_b = 3 * comp_f
    if key == "megatron":
        return {"forward communication": Fraction(4 * (p - 1), p) * b * s * h,
                "backward communication": Fraction(8 * (p - 1), p) * b * s * h,
                "forward computation": comp_f, "backward computation": comp_b}
    sq = math.isqrt(p)
    per = act * b * s * h + wide * h * h
    if sq * sq != p:                                   # no q x q grid: the formula in floats
        fwd = math.log2(p) / (2 * math.sqrt(p)) * float(per)
        bwd = 3 * fwd
    elif isinstance(_log2_exact(p), int):              # exact
        fwd = Fraction(_log2_exact(p), 2 * sq) * per
        bwd = 3 * fwd
    else:   # log(p) / (2 sqrt p) = log2(q) / q, rounded once (table1's order of operations)
        fwd = float(Fraction(per, sq)) * math.log2(sq)
        bwd = float(Fraction(3 * per, sq)) * math.log2(sq)
    return {"forward communication": fwd, "backward communication": bwd,
            "forward computation": comp_f, "backward computation": comp_b}


# -- memory ---------------------------------------------------------------------------------
