"""Exceptions raised by ep_comm."""
from __future__ import annotations

import builtins
from typing import Sequence, Tuple


class TimeoutError(builtins.TimeoutError):  # noqa: A001 - the contract names it ep_comm.TimeoutError
    """A peer did not arrive within ``timeout_s``; ``missing_ranks`` names the ranks waited for."""

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.missing_ranks = tuple(int(r) for r in missing_ranks)


class RoutingError(ValueError):
    """A dispatch's ``topk_idx`` broke a rule (an id past the experts, an expert named twice in a row) on some rank:
    checked where the ids are (on the GPU, in the count kernel), the verdicts travel with the count exchange, and
    every rank raises this same error in step (with ``cpu_sync=True`` from the call, else from the next call); no
    rank received a row, and the Buffer stays usable."""


class BufferUnusableError(RuntimeError):
    """The buffer lost step with its peers (after a timeout) and must be closed and recreated."""


class PeerAbortedError(BufferUnusableError):
    """A peer gave up on this Buffer (it timed out or failed midway) and posted an abort record; ``records``
    holds ``(rank, step, reason)`` per peer that did, e.g. ``(0, "dispatch #2", "timed out after 3 s waiting
    for ranks [1]")``. Raised at once by the next call or wait of every other rank, instead of consuming
    rows the peers no longer stand behind or waiting out its own timeout."""

    def __init__(self, message: str, records: Sequence[Tuple[int, str, str]] = ()):
        super().__init__(message)
        self.records = tuple((int(r), str(step), str(reason)) for r, step, reason in records)

    @property
    def aborted_ranks(self) -> Tuple[int, ...]:
        """The ranks that posted an abort record."""
        return tuple(r for r, _, _ in self.records)
