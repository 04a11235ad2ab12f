"""Per-rank memory: estimate before allocating, refuse what cannot fit, and say
what would (pure, except for reading /proc).

The estimate of a product run counts, per rank: the A, B and C blocks; the
algorithm's workspaces (two receive buffers per broadcast operand, two partial
products and the tree-reduce scratch for the reducing forms, the depth ring's
receive chunk); the host copy of C the check reads; and the check itself (the
float64 reference and scale blocks and one k-panel of each operand for ``exact``,
the panels and probe products for ``freivalds``). Peak RSS measured at 4096^3 on 4
ranks: 318 MiB, of which about 60 MiB is the interpreter and MPI before any
allocation; the estimate is 288 MiB (``--check freivalds``, what ``auto`` picks there).
"""

from __future__ import annotations

import math
import os
import resource

from ..layout import local_shape
from .check import choose_method, panel_width

HEADROOM = 0.85      # use at most this share of the memory the OS calls available


def available_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def product_bytes(case, method: str = "exact") -> int:
    """Estimated peak bytes per rank of a harness product run (see the module doc);
    ``method`` as given to the check ("auto" is resolved the way the check does)."""
    spec, q, d, p = case.spec, case.q, case.d, case.p
    it = 8 if case.dtype == "float64" else 4
    sa, sb = spec.stored_shapes(case.m, case.k, case.n)
    na = math.prod(local_shape(sa, spec.layout_a, q, d, p))
    nb_ = math.prod(local_shape(sb, spec.layout_b, q, d, p))
    mb, nb = local_shape((case.m, case.n), spec.layout_c, q, d, p)
    method = choose_method(method, mb, nb, case.k)      # "auto" as the check resolves it
    nc = mb * nb
    blocks = (na + nb_ + nc) * it
    work = (2 * na + 2 * nb_) * it if q > 1 else 0
    if spec.op != "ab" and q > 1:
        work += (2 + max(1, math.ceil(math.log2(q)))) * nc * it
    if d > 1 and spec.op == "atb":
        work += nc * it // d + 1
    host = nc * 8                                       # float64 copy of C for the check
    width = panel_width(case)
    panels = 2 * (mb * width + width * nb) * 8          # float64 panels and their abs
    check = (2 * nc * 8 if method == "exact" else 4 * mb * 8 * 4) + panels
    return blocks + work + host + check


def ring_bytes(case, p: int) -> int:
    it = 8 if case.dtype == "float64" else 4
    return 2 * case.n * it + (case.n // max(p, 1) + 1) * it + 4 * (1 << 18) * 8


def largest_cube(case, ranks_on_node: int, budget: int, method: str = "exact") -> int:
    """The largest n such that the case at n x n x n (rounded to fit the grid) fits
    ``budget`` bytes on a node running ``ranks_on_node`` ranks (0 if none does)."""
    spec = case.spec
    step = math.lcm(*spec.divisors(case.q, case.d).values())
    lo, hi = 0, 1
    fits = lambda n: ranks_on_node * product_bytes(  # noqa: E731
        type(case)(case.algorithm, case.q, case.d, n, n, n, case.dtype), method) <= budget
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def check_fits(case, ranks_on_node: int, method: str = "exact", available: int | None = None,
               p: int | None = None) -> str:
    """"" when the case fits this node's available memory, else a message that says
    how much it needs, what is available and the largest cube that fits. It runs
    after every rank has started, so what they hold already (the interpreter, MPI)
    is outside ``MemAvailable``."""
    avail = available_bytes() if available is None else available
    budget = int(HEADROOM * avail)
    if case.kind == "ring":
        need = ranks_on_node * ring_bytes(case, p or ranks_on_node)
        if need <= budget:
            return ""
        per = ring_bytes(case, p or ranks_on_node)
        most = int(case.n * budget / need)
        return (f"{case.label(p)} needs about {per / 2**30:.2f} GiB per rank, "
                f"{need / 2**30:.1f} GiB for {ranks_on_node} ranks on this node, but "
                f"{budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
                f"{avail / 2**30:.1f} GiB available); the largest that fits is about "
                f"N = {most}")
    per = product_bytes(case, method)
    if ranks_on_node * per <= budget:
        return ""
    n = largest_cube(case, ranks_on_node, budget, method)
    fits = f"the largest cube that fits is {n}x{n}x{n}" if n else "not even the smallest fits"
    return (f"{case.label()} {case.dtype} needs about {per / 2**30:.2f} GiB per rank, "
            f"{ranks_on_node * per / 2**30:.1f} GiB for {ranks_on_node} ranks on this node, "
            f"but {budget / 2**30:.1f} GiB can be used ({HEADROOM:.0%} of "
            f"{avail / 2**30:.1f} GiB available); {fits}")
