"""What the command lines (benchmark, soak, examples) share: argparse value types and the way out."""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, List, NoReturn


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
    """argparse type: a comma- or space-separated list of integers >= ``minimum`` (``what`` names them)."""
    def parse(text: str) -> List[int]:
        try:
            values = [int(v) for v in text.replace(",", " ").split()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a list of {what} >= {minimum}, e.g. {example}")
        return values

    return parse


def exit_collectively(main: Callable[[], int]) -> NoReturn:
    """``sys.exit(main())`` for a command that runs on every rank of an MPI job.

    An exception escaping ``main`` on one rank is printed with that rank and aborts the whole job
    (``MPI_Abort``): the other ranks may be waiting for it in a collective, and its own
    ``MPI_Finalize`` at exit would wait for them, so the job would hang instead of failing.
    """
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        from mpi4py import MPI

        traceback.print_exc()
        print(f"rank {MPI.COMM_WORLD.rank}: unhandled error, aborting the MPI job", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
    sys.exit(code)
