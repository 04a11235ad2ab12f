"""What every MPI front-end shares: user errors reported once, with exit status 2,
before any work; everything else aborts the whole job with its traceback.

    def main(argv=None):
        return mpi_main(lambda: parse(argv), preflight, body, prog="python -m summasim.x")

``parse()`` runs on every rank (pure: arguments only) and raises
:class:`summasim.cli.UsageError` (the one user-error exception);
``preflight(args, world)`` runs on rank 0 only (files, memory, paths) and returns an
error message or ""; rank 0's answer is broadcast, so every rank stops alike.
``body(args, world)`` is the work, under :func:`summasim.mpiutil.abort_on_error`.
"""

from __future__ import annotations

import argparse
import sys

from ..cli import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`~summasim.cli.UsageError` instead of printing on
    every rank."""

    def error(self, message):
        raise UsageError(message)


def check_outputs(json_path: str | None, machine: str | None) -> str:
    """The preflight every front-end shares (rank 0): the ``--json`` path can be
    written and the ``--machine`` file or preset loads. An error message, or ""."""
    from ..cli import check_writable_path
    from .machinefile import check_machine_spec

    if json_path:
        try:
            check_writable_path(json_path)
        except UsageError as e:
            return f"--json: {e}"
    if machine:
        try:
            check_machine_spec(machine)
        except ValueError as e:
            return f"--machine: {e}"
    return ""


def mpi_main(parse, preflight, body, prog: str) -> int:
    """Run a front-end (see the module doc); returns the exit status."""
    try:
        args, err = parse(), ""
    except UsageError as e:
        args, err = None, str(e)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if not err and preflight is not None:
        err = preflight(args, world) if rank == 0 else None
        err = world.bcast(err, root=0)
    if err:
        if rank == 0:
            print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2
    from ..mpiutil import abort_on_error

    with abort_on_error(world):
        return body(args, world)
