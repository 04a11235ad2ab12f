"""What the benchmarks share: their options, the run's context (who speaks, the report,
the backend, the cost-model machine) and the message buffers."""

from __future__ import annotations

import argparse
import math

import numpy as np

from .. import cli
from ..backends import NAMES

DEFAULT_REPEATS = 3
#: The most timed repeats a benchmark takes (each repeat is a full call of every
#: contender: more only waits longer for the same medians).
MAX_REPEATS = 1000
DEFAULT_SIZES_MIB = "0.0625,0.25,1,4,16,64"
#: The most message sizes one run takes (each is timed for seconds; the largest is
#: bounded by the node's memory, checked before any work).
MAX_SIZES = 32
BACKENDS = NAMES


def quiet_bcast(world, value):
    """Broadcast rank 0's value after a barrier that waits without spinning (the
    other ranks idle while rank 0 measures with all cores). Their naps grow to
    :data:`~summasim.mpiutil.LONG_WAIT_NAP_S`: 15 ranks polling every 20 us took the
    cores rank 0 was measuring with (a 2-thread NumPy ceiling of 68 GFLOP/s read 7-8
    at p = 16)."""
    from ..mpiutil import LONG_WAIT_NAP_S, quiet_barrier

    quiet_barrier(world, longest=LONG_WAIT_NAP_S)
    return world.bcast(value, root=0)


def mib_list(text) -> list[float]:
    """argparse type: comma-separated positive message sizes in MiB, each once (in the
    order first given)."""
    try:
        sizes = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers, got {text!r}") \
            from None
    if not sizes or not all(math.isfinite(x) and x > 0 for x in sizes):
        raise argparse.ArgumentTypeError(f"must be positive numbers, got {text!r}")
    sizes = list(dict.fromkeys(sizes))
    if len(sizes) > MAX_SIZES:
        raise argparse.ArgumentTypeError(f"at most {MAX_SIZES} sizes, got {len(sizes)}")
    return sizes


# -- options ----------------------------------------------------------------------------
def repeats_count(text) -> int:
    """argparse type of ``--repeats``: an integer from 1 to :data:`MAX_REPEATS`."""
    val = cli.positive_int(text)
    if val > MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_REPEATS}, got {text!r}")
    return val


def add_repeats(ap, help_more: str = ""):
    ap.add_argument("--repeats", type=repeats_count, default=None, metavar="N",
                    help=f"timed repeats, 1 to {MAX_REPEATS} (default {DEFAULT_REPEATS}"
                         f"{help_more})")


def add_json(ap):
    ap.add_argument("--json", metavar="PATH", type=cli.report_path("bench"),
                    action=cli.ReportAction, help="also write the results as JSON "
                                                  "(atomically; its folder must exist)")
    cli.add_force(ap)


def add_backend(ap, what: str):
    ap.add_argument("--backend", choices=BACKENDS, default="numpy",
                    help=f"array backend of {what}: numpy (CPU), cupy (GPU), or staged-host / "
                         f"ipc-host (NumPy through the GPU's staged or IPC path) (default "
                         f"numpy)")


def add_predict(ap, what: str):
    from ..options import add_machine

    add_machine(ap, help_more=f"; prices {what} (default: as summasim.run chooses)")
    ap.add_argument("--no-predict", action="store_true", help="skip the prediction")


def add_sizes(ap):
    ap.add_argument("--sizes-mib", type=mib_list, default=mib_list(DEFAULT_SIZES_MIB),
                    metavar="MIB,...",
                    help=f"all-reduce message sizes in MiB, at most {MAX_SIZES} of them, the "
                         f"largest as the node's memory allows (checked before any work; "
                         f"default {DEFAULT_SIZES_MIB})")
    ap.add_argument("--np-empty", action="store_true",
                    help="message buffers as np.empty returns them (partly on huge pages, "
                         "by the luck of their alignment) instead of on huge pages from end "
                         "to end")


def repeats(args) -> int:
    """``--repeats``, or :data:`DEFAULT_REPEATS` when not given."""
    return args.repeats or DEFAULT_REPEATS


def given(args, name: str, default):
    """``args.<name>``, or ``default`` where the command left it unset (``all``, whose
    shared options default to each benchmark's own)."""
    value = getattr(args, name, None)
    return default if value is None else value


def runtime_config(model, dtype):
    """The runtime's :class:`~summasim.transformer.model.Config` of a ``--model``."""
    from ..transformer.model import Config

    return Config.of(model, np.dtype(dtype).type)


# -- the run ----------------------------------------------------------------------------
class Run:
    """One benchmark run on ``world``: who speaks (``say``: rank 0), the report, the
    backend and the cost-model machine of the predictions (resolved once, on demand)."""

    def __init__(self, args, world, backend, report: dict):
        self.args, self.world, self.backend, self.report = args, world, backend, report
        self.p, self.rank = world.Get_size(), world.Get_rank()
        self.say = print if self.rank == 0 else (lambda *a, **k: None)
        self._machine = []

    def machine(self):
        """The cost-model machine of the predictions (None: ``--no-predict``, or a
        backend the cost model does not price)."""
        if not self._machine:
            if self.args.no_predict:
                self._machine.append(None)
            elif self.backend.name != "numpy":
                self.say(f"backend {self.backend.name}: no prediction: the cost model "
                         f"prices host arrays only")
                self._machine.append(None)
            else:
                from ..harness.machinefile import resolve_machine

                self._machine.append(resolve_machine(self.args.machine, self.world,
                                                     self.say))
        return self._machine[0]


def message_buffers(backend, hx, huge: bool = True):
    """``(x, out)``: ``hx``'s values and an output buffer, as ``backend``'s arrays;
    with ``huge``, host arrays from a huge page up lie on transparent huge pages from
    end to end (:func:`~summasim.backends.numpy_backend.empty_huge`), so that their page
    backing, worth 15-55% of a memory-bound all-reduce here, is the same in every
    launch."""
    make = backend.empty_huge if huge else backend.empty
    x = make(hx.shape, hx.dtype)
    x[...] = backend.asarray(hx)
    return x, make(hx.shape, hx.dtype)


def say_buffers(run: Run, huge: bool) -> None:
    """Report how the message buffers are backed (host backends)."""
    from ..backends.numpy_backend import transparent_huge_pages

    mode, page = transparent_huge_pages()
    run.report["buffers"] = {"huge_pages": huge, "thp": mode, "page_bytes": page}
    run.say("message buffers: " + (f"from {page >> 20} MiB on, on huge pages from end to end"
                                   if huge else "as np.empty returns them (--np-empty)")
            + f"; transparent huge pages: {mode}")
