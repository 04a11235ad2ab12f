"""Communication lower bounds of classical matrix multiplication, beside what each
product of the algorithm table moves (pure: no MPI, no arrays).

C[m, n] = A[m, k] B[k, n] computed classically (all ``m k n`` scalar multiply-adds) on
``p`` processors, the work spread evenly (``F = m k n / p`` multiply-adds on the busiest
one). Two lower bounds hold on the words some processor must send or receive:

**Memory-dependent** (Irony, Toledo & Tiskin, "Communication lower bounds for
distributed-memory matrix multiplication", J. Parallel Distrib. Comput. 64 (2004),
Theorem 3.1; Ballard, Demmel, Holtz & Schwartz, "Minimizing communication in numerical
linear algebra", SIAM J. Matrix Anal. Appl. 32 (2011), for the sequential form): with
``M`` words of memory per processor,

    W >= m k n / (2 sqrt(2) p sqrt(M)) - M.

**Memory-independent** (Ballard, Demmel, Holtz, Lipshitz & Schwartz, "Brief announcement:
strong scaling of matrix multiplication algorithms and memory-independent communication
lower bounds", SPAA 2012; Demmel et al., "Communication-optimal parallel recursive
rectangular matrix multiplication", IPDPS 2013, section 2): by the Loomis-Whitney
inequality a processor that performs ``F`` multiply-adds touches at least ``3 F^(2/3)``
entries of A, B and C together; it starts with at most its share ``(m k + k n + m n) / p``
of them, so

    W >= 3 (m k n / p)^(2/3) - (m k + k n + m n) / p,

which for square ``n`` is ``Omega(n^2 / p^(2/3))``: what 3D algorithms attain, and
2.5D ones with ``c`` copies approach as ``n^2 / sqrt(c p)`` (Solomonik & Demmel,
"Communication-optimal parallel 2.5D matrix multiplication and LU factorization
algorithms", Euro-Par 2011). The subtracted term is what the processor starts with: an
algorithm whose inputs arrive replicated (SUMMA2.5's weight, copied over the depth)
starts with more, ``S`` words, and the bound is ``3 F^(2/3) - S``; on ``[1, 1, d]`` it
is 0, and SUMMA2.5 there sends nothing.

:func:`product_bounds` gives both for a product on its grid, with ``M`` the words of
A, B and C a rank holds there (its blocks in their layouts: the least memory the
algorithm runs in, before its workspaces, and what it starts with). The ledger
(:class:`summasim.trace.Event`) counts, per rank, the buffer of every broadcast or
reduction it takes part in and what it sends in a sendrecv: the words it moves, sent or
received, which is what the bounds count on the busiest processor.
"""

from __future__ import annotations

import math


def memory_dependent_words(m: int, k: int, n: int, p: int, memory_words: float) -> float:
    """Irony-Toledo-Tiskin: ``m k n / (2 sqrt(2) p sqrt(M)) - M``, at least 0."""
    if min(m, k, n, p) < 1 or memory_words <= 0:
        raise ValueError(f"need positive m, k, n, p and memory, got {(m, k, n, p)} and "
                         f"{memory_words}")
    return max(0.0, m * k * n / (2.0 * math.sqrt(2.0) * p * math.sqrt(memory_words))
               - memory_words)


def memory_independent_words(m: int, k: int, n: int, p: int,
                             start_words: float | None = None) -> float:
    """Loomis-Whitney: ``3 (m k n / p)^(2/3) - S``, at least 0, with ``S`` the words of
    A, B and C the processor starts with (default its even share, ``(m k + k n + m n) /
    p``)."""
    if min(m, k, n, p) < 1:
        raise ValueError(f"need positive m, k, n and p, got {(m, k, n, p)}")
    start = (m * k + k * n + m * n) / p if start_words is None else start_words
    return max(0.0, 3.0 * (m * k * n / p) ** (2.0 / 3.0) - start)


def held_words(operands) -> float:
    """Words one rank holds of ``operands``, ``[((rows, cols), (row blocks, column
    blocks)), ...]`` (A, B and C as stored, each with the blocks its layout cuts it
    into): each one's global size over its block count."""
    return sum((r / br) * (c / bc) for (r, c), (br, bc) in operands)


def product_bounds(operands, m: int, k: int, n: int, q: int, d: int, pc: int = 0) -> dict:
    """Both lower bounds for C[m, n] = op(A) op(B) stored as ``operands``
    (:func:`held_words`; ``AlgorithmSpec.operands``) on ``[q, q, d]`` (``p = d q^2``;
    ``[q, pc, d]`` with ``p = d q pc`` when ``pc`` is given): ``{"p", "memory_words",
    "memory_dependent", "memory_independent", "bound"}``, with ``bound`` the larger of
    the two (words per rank). With sizes that do not divide, ``memory_words`` is the
    average rank's share."""
    p = d * q * (pc or q)
    held = held_words(operands)
    dep = memory_dependent_words(m, k, n, p, held)
    ind = memory_independent_words(m, k, n, p, held)
    return {"p": p, "memory_words": held, "memory_dependent": dep,
            "memory_independent": ind, "bound": max(dep, ind)}
