"""What the command lines (benchmark, soak, examples, info) share: the parser, argparse value types,
the checks made before any work (environment, output paths) and the way out."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from typing import IO, Callable, List, NoReturn, Optional

from mpi4py import MPI

from ep_comm.cli.environment import environment_problem

# after an unhandled error's report, before MPI_Abort: the launcher's I/O forwarding (a proxy reading each rank's
# pipe) gets this long to pass the report on; an abort tears the proxies down, and a report still in a pipe is lost
ABORT_GRACE_S = 0.5
EXIT_USAGE = 2  # bad options, a config that does not fit, an output path that cannot be written, no GPU stack

__all__ = ["ArgumentParser", "EXIT_USAGE", "environment_problem", "exit_collectively", "int_at_least", "int_list",
           "list_items", "output_problem", "usage_exit"]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose messages (``--help``, usage errors) print on rank 0 of
    ``MPI.COMM_WORLD`` only; every rank still exits with argparse's status (2 for an error)."""

    def _print_message(self, message: str, file: Optional[IO[str]] = None) -> None:
        if MPI.COMM_WORLD.rank == 0:
            super()._print_message(message, file)


def list_items(text: str) -> Optional[List[str]]:
    """The items of a comma- or space-separated list (``"128, 512,4096"`` -> 3 items); None when an
    item is empty (``"1,,2"``, a leading or trailing comma) or there is none."""
    items = re.split(r"\s*,\s*|\s+", text.strip())
    return None if "" in items else items


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {minimum}")
        return value

    return parse


def int_list(what: str, minimum: int, example: str) -> Callable[[str], List[int]]:
    """argparse type: a comma- or space-separated list of integers >= ``minimum`` (``what`` names them),
    no empty item."""
    def parse(text: str) -> List[int]:
        try:
            values = [int(v) for v in list_items(text) or []]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a list of {what} >= {minimum}, e.g. {example}")
        return values

    return parse


def output_problem(option: str, path: Optional[str]) -> Optional[str]:
    """Make ``path`` (the value of ``option``, e.g. ``--json``) writable before any measuring: create its
    parent directories and open it for appending (a file this creates is removed again). Returns None
    when it can be written (or ``path`` is None), else the one-line reason."""
    if not path:
        return None
    existed, parent = os.path.exists(path), os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"{option} {path}: cannot be written ({parent} is not a directory)"
    try:
        os.makedirs(parent, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"{option} {path}: cannot be written ({exc.strerror or exc})"
    if not existed:
        os.remove(path)
    return None


def usage_exit(prog: str, comm: MPI.Comm, problem: Optional[str]) -> Optional[int]:
    """:data:`EXIT_USAGE` when ``problem`` (rank 0's, broadcast) is set, printed once by rank 0 as
    ``prog: problem``; None when there is none. Collective over ``comm``."""
    problem = comm.bcast(problem if comm.rank == 0 else None, root=0)
    if problem is None:
        return None
    if comm.rank == 0:
        print(f"{prog}: {problem}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def exit_collectively(main: Callable[[], int]) -> NoReturn:
    """``sys.exit(main())`` for a command that runs on every rank of an MPI job, with stdout
    line-buffered (a report reaches ``mpirun``'s output line by line, not at exit).

    An exception escaping ``main`` on one rank is printed with that rank and aborts the whole job
    (``MPI_Abort``, ``ABORT_GRACE_S`` after the report): the other ranks may be waiting for it in a
    collective, and its own ``MPI_Finalize`` at exit would wait for them, so the job would hang
    instead of failing.
    """
    sys.stdout.reconfigure(line_buffering=True)
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        # one write: mpirun forwards it whole before the abort tears the job down (two could lose the second)
        sys.stderr.write(f"{traceback.format_exc()}rank {MPI.COMM_WORLD.rank}: unhandled error, aborting the MPI job\n")
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)
        code = 1  # Abort can return on a rank whose job is already being torn down
    sys.exit(code)
