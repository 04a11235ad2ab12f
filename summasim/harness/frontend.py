"""What every MPI front-end shares: user errors reported once, with exit status 2,
before any work; everything else aborts the whole job with its traceback; nothing
waits forever.

    def main(argv=None):
        return mpi_main(lambda: parse(argv), preflight, body, prog="python -m summasim.x",
                        argv=argv)

``parse()`` runs on every rank (pure: arguments only) and raises
:class:`summasim.cli.UsageError` (the one user-error exception);
``preflight(args, world)`` runs on rank 0 only (files, memory, paths) and returns an
error message or ""; rank 0's answer is broadcast, so every rank stops alike.
``body(args, world)`` is the work.

The preflight, the broadcast and the body all run under one guard
(:func:`summasim.mpiutil.abort_on_error`): a preflight that raises a user error
(``UsageError``, or the ``ValueError``/``OSError`` of reading a user's file) is that
error's one line and exit 2 on every rank; anything else it raises (a
``RecursionError``, a ``MemoryError``, a bug) prints rank 0's traceback and aborts the
job, so the other ranks never wait in the broadcast. A rank that leaves the body by
``SystemExit`` while the others work on would leave them waiting in their next
collective: it aborts the job too, naming the rank. SIGINT and SIGTERM end the job
with one line (:func:`summasim.mpiutil.end_on_signals`).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..cli import UsageError, check_working_folder, guarded_stdout


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`~summasim.cli.UsageError` instead of printing on
    every rank."""

    def error(self, message):
        raise UsageError(message)


def check_outputs(json_path: str | None, machine: str | None, devices: int = 1) -> str:
    """The preflight every front-end shares (rank 0): the ``--json`` path can be
    written, and the ``--machine`` file or preset loads and can price a job of
    ``devices`` ranks (:func:`~summasim.harness.machinefile.machine_misfit`). An error
    message, or ""."""
    from ..cli import check_writable_path
    from .machinefile import check_machine_spec, machine_misfit

    if json_path:
        try:
            check_writable_path(json_path)
        except UsageError as e:
            return f"--json: {e}"
    if machine:
        try:
            return machine_misfit(check_machine_spec(machine), devices)
        except ValueError as e:
            return str(e)                      # it names --machine and the file
    return ""


#: What a preflight may raise for a mistake in the user's input: one line, exit 2.
USER_ERRORS = (UsageError, ValueError, OSError)


def _preflight_message(preflight, args, world) -> str:
    """Rank 0's preflight verdict: its message, or a user error it raised as one line.
    Anything else propagates (to the guard, which aborts the job)."""
    try:
        return preflight(args, world) or ""
    except USER_ERRORS as e:
        from ..cli import one_line

        return one_line(str(e) or type(e).__name__)


def _environment() -> tuple[str, dict]:
    """This rank's ``SUMMASIM_*`` runtime settings (:func:`summasim.comm.check_environment`,
    whose module reads its byte limits when imported): the error as one line ("" when
    none) and the settings every rank must share."""
    from ..cli import one_line

    try:
        from ..comm import check_environment

        return "", check_environment()
    except ValueError as e:
        return one_line(str(e)), {}


def environment_error(world) -> str:
    """Collective over ``world``: the one-line error of a ``SUMMASIM_*`` setting that is
    bad on any rank or differs between ranks ("" when none), the same on every rank (for
    a front-end that is not :func:`mpi_main`'s, such as ``costmodel fit``)."""
    err, shared = _environment()
    return _agreed_error(err, world, shared)


def _agreed_error(err: str, world, shared: dict | None = None, command=()) -> str:
    """The first rank's error of every rank's ``err`` ("" when none has one), naming the
    ranks where only some have it, else the ranks' ``command`` lines when they differ,
    else a setting of ``shared`` that differs between ranks: every rank then stops, or
    none does."""
    from ..mpiutil import ranks_text

    every = world.allgather((err, shared or {}, list(command)))
    bad = [r for r, (e, _, _) in enumerate(every) if e]
    if bad:
        first = every[bad[0]][0]
        return first if len(bad) == len(every) else f"{first} (on {ranks_text(bad)})"
    def which(values, show) -> str | None:
        """``"A on ranks ...; B on ranks ..."`` when ``values`` differ, else None."""
        if len(set(values)) == 1:
            return None
        return "; ".join(f"{show(v)} on {ranks_text([r for r, w in enumerate(values) if w == v])}"
                         for v in dict.fromkeys(values))

    # ranks started with other arguments (``mpiexec -n 1 prog A : -n 1 prog B``) would
    # run other work and wait for each other forever
    differ = which([tuple(a) for _, _, a in every], lambda c: repr(" ".join(c) or "(none)"))
    if differ:
        return (f"the ranks were started with different arguments ({differ}); every rank "
                f"must run the same job, so start them alike")
    for name in every[0][1]:
        differ = which([s.get(name) for _, s, _ in every],
                       lambda v: "unset" if v is None else repr(v))
        if differ:
            return (f"{name} differs between ranks ({differ}); every rank must send the "
                    f"same messages, so set it alike on all of them")
    return ""


def mpi_main(parse, preflight, body, prog: str, argv=None) -> int:
    """Run a front-end (see the module doc); returns the exit status. ``argv`` is the
    command line ``parse`` reads (None: ``sys.argv[1:]``), which every rank must share."""
    try:
        check_working_folder()
        args, err = parse(), ""
    except UsageError as e:
        args, err = None, str(e)
    from mpi4py import MPI

    from ..mpiutil import abort_job, abort_on_error, doing, end_on_signals

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    end_on_signals(prog, rank)
    with abort_on_error(world):
        env_err, shared = _environment()
        command = sys.argv[1:] if argv is None else [str(a) for a in argv]
        err = _agreed_error(err or env_err, world, shared, command)
        if not err and preflight is not None:
            doing("in the preflight" if rank == 0 else "waiting for rank 0's preflight")
            err = _preflight_message(preflight, args, world) if rank == 0 else None
            err = world.bcast(err, root=0)
        if err:
            if rank == 0:
                print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
            return 2
        doing("starting the work")
        from ..comm import learn_node_cores

        learn_node_cores(world)      # whether the node's ranks share cores (its wait policy)
        try:
            with guarded_stdout() as guard:   # a reader gone, or a path stdout cannot
                status = body(args, world)     # encode: the work goes on to its reports
            return 1 if guard.lost else status   # and what was printed was not all read
        except BrokenPipeError:
            # the reader of the output went away (``... | head``): not a bug of ours, so no
            # traceback; stdout goes to devnull so that the final flush cannot raise again,
            # and a job of several ranks ends (the others would wait for this one)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if world.Get_size() > 1:
                abort_job(world, f"[rank {rank}/{world.Get_size()}] its output was closed "
                                 f"(the reader went away), ending the job: it was {doing()}\n")
            return 1
        except SystemExit as e:
            abort_job(world, f"[rank {rank}/{world.Get_size()}] left the job early (exit "
                             f"status {e.code}) while the other ranks work on, aborting the "
                             f"job: it was {doing()}\n")
            return 1
