"""Collective step bookkeeping shared by the backends: numbering, and the unusable state after a failure.

Every dispatch, combine and close is one collective step ``seq`` (1, 2, ...) using buffer parity
``seq % 2``. A step that times out or fails midway leaves the peers out of step: from then on the
buffer refuses work with ``BufferUnusableError`` and must be closed and recreated.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

from ..errors import BufferUnusableError, TimeoutError


STEP_KINDS = {"dispatch": 1, "combine": 2, "close": 3}


def step_word(seq: int, what: str) -> int:
    """The signal word of step number ``seq`` of kind ``what``: ``seq << 2 | kind`` (monotone in ``seq``).

    A peer has arrived at a step when its word equals the step's word or it reached the next step
    (``step_word(seq + 1, ...) >= (seq + 1) << 2``); a peer in another kind of step with the same
    number (closing while this rank dispatches) has not.
    """
    return seq << 2 | STEP_KINDS[what]


class Steps:
    """The step counter of one Buffer on one rank."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.seq = 0
        self.unusable: Optional[str] = None

    @contextmanager
    def collective(self, what: str) -> Iterator[tuple]:
        """Number the next step and yield ``(seq, parity)``; an exception inside marks the buffer unusable."""
        if self.unusable:
            raise BufferUnusableError(
                f"rank {self.rank}: cannot {what}: {self.unusable}; close this Buffer and create a new one")
        self.seq += 1
        try:
            yield self.seq, self.seq % 2
        except BaseException as exc:
            if not self.unusable:
                self.unusable = f"{what} #{self.seq} failed midway ({type(exc).__name__}: {exc})"
            raise

    def timed_out(self, what: str, seq: int, missing: Sequence[int]) -> TimeoutError:
        """Mark the buffer unusable and return the ``ep_comm.TimeoutError`` naming ``missing``."""
        missing = [int(r) for r in missing]
        self.unusable = f"{what} #{seq} timed out waiting for ranks {missing}"
        return TimeoutError(
            f"rank {self.rank}: {what} #{seq} timed out after {self.timeout_s:g} s waiting for ranks {missing} "
            f"(every rank must call dispatch/combine/close collectively)", missing)
