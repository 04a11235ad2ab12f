"""What overlapped communication costs: the contention of a collective with the compute
it hides behind, and ZeRO-3's per-piece schedule of gathers and reduce-scatters.

Contention
----------
A GPU collective is a kernel: NCCL runs each channel as one thread block (CTA) on one
streaming multiprocessor, so while a collective overlaps compute, the compute kernels run
on the SMs that are left (NCCL's ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS``
documentation; Jangda et al. 2022, CoCoNet, section 2, and Rashidi et al. 2021, ACE,
section 3, measure the slowdown). With ``f = comm_sms / sms`` of the device taken
(:func:`contention_share`), compute of ``c`` seconds alone that overlaps a collective of
``y`` seconds alone progresses at ``1 - f`` while the collective runs, so the two end at

    t = max(y, c + f y)                                  (:func:`overlapped`)

(the compute is slowed by ``f y``; when ``y >= c / (1 - f)`` the collective is the
critical path). ``c + f y - max(c, y)``, when positive, is the contention; ``y - c``
the exposed communication. Machines without a device (``f = 0``, the CPU model: MPI's
progress runs on the cores the ranks wait on) price ``max(c, y)``.

ZeRO-3 per piece
----------------
ZeRO-3 (Rajbhandari et al. 2020, section 5.3; PyTorch FSDP, Zhao et al. 2023, section
3.3) all-gathers each piece of the model (the embedding, each layer, the head) before
its forward and again before its backward, in every micro-batch, and reduce-scatters
each piece's gradient once its backward has made it. With prefetch (FSDP's forward
issue-ahead and ``BACKWARD_PRE``, DeepSpeed's prefetch bucket; FSDP's rate limiter
keeps at most two all-gathers in flight, so one piece ahead), in the pieces' order:

* forward: piece 1's gather is exposed; piece j's forward (``c_f``) overlaps the
  gather of piece j+1;
* backward (the reverse order): the first piece's gather is exposed; piece j's backward
  (``c_b``) overlaps the gather of the piece after it, in the link time the gradient
  reduce-scatters (bucketed, :func:`~summasim.costmodel.workload.pipeline.overlap_exposed`,
  as DeepSpeed and summasim's engine run them) leave free: ``c_b - busy_b``.

Without prefetch every gather is exposed. :func:`zero3_gathers` prices that in O(runs of
equal pieces), not O(layers).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


def contention_share(machine) -> float:
    """``f = comm_sms / sms`` of the machine's device: the share of its compute a
    running collective takes (0 without a device or without those fields)."""
    dev = getattr(machine, "device", None)
    sms = getattr(dev, "sms", 0) if dev is not None else 0
    comm = getattr(dev, "comm_sms", 0) if dev is not None else 0
    if not sms or not comm:
        return 0.0
    return min(1.0, comm / sms)


def overlapped(compute: float, comm: float, share: float) -> float:
    """Seconds of ``compute`` overlapping a collective of ``comm`` seconds when the
    collective takes ``share`` of the device: ``max(comm, compute + share comm)``."""
    return max(comm, compute + share * comm)


class Window(NamedTuple):
    """Communication overlapping compute, in seconds: ``exposed`` (what the compute did
    not hide), ``contention`` (what the compute was slowed by)."""

    exposed: float = 0.0
    contention: float = 0.0

    def __add__(self, other):
        return Window(self.exposed + other.exposed, self.contention + other.contention)

    def times(self, k: float) -> "Window":
        return Window(self.exposed * k, self.contention * k)


def window(compute: float, comm: float, share: float) -> Window:
    """One compute window of ``compute`` seconds that hides a collective of ``comm``:
    its exposed part ``max(0, comm - compute)`` and its contention ``overlapped -
    max(compute, comm)``."""
    if comm <= 0:
        return Window()
    top = max(compute, comm)
    return Window(top - compute, overlapped(compute, comm, share) - top)


def bucket_contention(hidden: float, exposed: float, last: float, share: float) -> float:
    """The contention of a bucketed reduction that ran ``hidden`` seconds under the
    compute that produces its buckets and left ``exposed`` seconds after it, the last
    bucket ``last`` of them: the compute ends ``share x hidden`` later, and so do the
    buckets it produces, which delays the reduction only by what its backlog (the
    exposed time beyond the last bucket's) does not absorb:
    ``max(0, share hidden - (exposed - last))``. With the reduction hidden but for its
    last bucket this is :func:`overlapped`'s ``share x hidden``; a reduction that
    outlasts its compute by more than that is slowed by nothing."""
    return max(0.0, share * max(0.0, hidden) - max(0.0, exposed - last))


def _next_gathers(runs: Sequence[tuple]) -> list:
    """``(x, count)``: the gather that overlaps each piece's compute when piece j
    overlaps the gather of piece j+1 (``runs``: ``(gather seconds, count)`` in order)."""
    out = []
    for i, (x, cnt) in enumerate(runs):
        nxt = runs[i + 1][0] if i + 1 < len(runs) else 0.0
        if cnt > 1:
            out.append((x, cnt - 1))
        out.append((nxt, 1))
    return out


def zero3_gathers(runs: Sequence[tuple], c_f: float, c_b: float, busy_b: float,
                  share: float, prefetch: bool) -> tuple[Window, Window]:
    """ZeRO-3's all-gathers of one micro-batch (module docstring): ``runs`` the
    ``(seconds, count)`` of equal pieces in forward order, ``c_f`` and ``c_b`` each
    piece's forward and backward compute, ``busy_b`` the seconds of each piece's
    backward that the reduce-scatters hold the links for (a gather hides in the rest),
    ``share`` the device's :func:`contention_share`. Returns the forward and backward
    :class:`Window` s: with ``prefetch`` the first gather of each pass is exposed and
    every other overlaps the compute of the piece before it; without, all are exposed.
    O(runs), not O(layers)."""
    runs = [(float(x), int(k)) for x, k in runs if k > 0]
    if not runs:
        return Window(), Window()
    if not prefetch:
        total = sum(x * k for x, k in runs)
        return Window(total, 0.0), Window(total, 0.0)
    fwd, bwd = Window(runs[0][0], 0.0), Window(runs[-1][0], 0.0)
    for x, k in _next_gathers(runs):
        fwd = fwd + window(c_f, x, share).times(k)
    for x, k in _next_gathers(runs[::-1]):
        bwd = bwd + window(max(0.0, c_b - busy_b), x, share).times(k)
    return fwd, bwd


__all__ = ["Window", "bucket_contention", "contention_share", "overlapped", "window",
           "zero3_gathers"]
