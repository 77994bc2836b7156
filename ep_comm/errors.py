"""Exceptions raised by ep_comm."""
from __future__ import annotations

import builtins
from typing import Sequence


class TimeoutError(builtins.TimeoutError):  # noqa: A001 - the contract names it ep_comm.TimeoutError
    """A peer did not arrive within ``timeout_s``; ``missing_ranks`` names the ranks waited for."""

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.missing_ranks = tuple(int(r) for r in missing_ranks)


class BufferUnusableError(RuntimeError):
    """The buffer lost step with its peers (after a timeout) and must be closed and recreated."""
