"""Interpreter exit after a failed Buffer: a bounded ``MPI_Finalize`` instead of one that can hang.

``MPI_Finalize`` waits for every rank of the job (MPICH's does): after a Buffer failed because a peer is
stopped, stuck or still late, this rank's finalize at exit would wait for it without bound. Once any
Buffer of the process has failed (``note_failure``), an ``atexit`` handler, which runs before mpi4py's
own finalization, finalizes MPI itself under a C-level watchdog (``faulthandler``, which needs no GIL:
``MPI_Finalize`` holds it): when the finalize has not returned after the grace period the watchdog prints
the stack and ends the process with status 1 (``_exit``, no further cleanup). The NVSHMEM runtime's
collective finalize is skipped after a failure (``transport.nvshmem_heap``).

The grace period is the largest ``timeout_s`` of the failed Buffers plus ``GRACE_MARGIN_S``.
"""
from __future__ import annotations

import atexit
import faulthandler
from typing import Optional

GRACE_MARGIN_S = 5.0  # ranks that all reach exit finish their pytest summaries, reports and files in this time

_grace_s: Optional[float] = None


def note_failure(timeout_s: float) -> None:
    """Record that a Buffer with ``timeout_s`` failed in this process (a timeout, a peer's abort record,
    an error midway); the first call registers the bounded finalize at exit.

    Args:
        timeout_s: the failed Buffer's ``timeout_s``.
    """
    global _grace_s
    if _grace_s is None:
        atexit.register(_bounded_finalize)
        _grace_s = 0.0
    _grace_s = max(_grace_s, float(timeout_s) + GRACE_MARGIN_S)


def failed() -> bool:
    """Whether any Buffer of this process failed (its collective teardown is no longer safe).

    Returns:
        True after ``note_failure``.
    """
    return _grace_s is not None


def _bounded_finalize() -> None:
    """``MPI_Finalize`` under a watchdog of ``_grace_s`` seconds (``_exit(1)`` when it does not return)."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    faulthandler.dump_traceback_later(_grace_s, exit=True)
    try:
        MPI.Finalize()
    finally:
        faulthandler.cancel_dump_traceback_later()
