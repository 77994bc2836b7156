"""Collective step bookkeeping shared by the backends: numbering, and the unusable state after a failure.

Every dispatch, combine and close is one collective step ``seq`` (1, 2, ...) using buffer parity
``seq % 2``; messages count each kind apart (``dispatch #4`` is the 4th dispatch). A step that times
out or fails midway leaves the peers out of step: from then on the buffer refuses work with
``BufferUnusableError`` and must be closed and recreated.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Sequence

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
    """The step counter of one Buffer on one rank.

    ``seq`` numbers every step (the signal words and parities); messages name a step by its kind and
    its number among the steps of that kind (``dispatch #4`` is the 4th dispatch), :meth:`name`.
    """

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.seq = 0
        self.unusable: Optional[str] = None
        self._calls: Dict[str, int] = dict.fromkeys(STEP_KINDS, 0)
        self._last = "no step yet"

    def name(self, what: str) -> str:
        """``what`` with the latest step: ``"combine #2"``, or ``"an earlier operation (combine #2)"``."""
        return self._last if self._last.startswith(what + " #") else f"{what} ({self._last})"

    @contextmanager
    def collective(self, what: str) -> Iterator[tuple]:
        """Number the next step and yield ``(seq, parity)``; an exception inside marks the buffer unusable."""
        if self.unusable:
            raise BufferUnusableError(
                f"rank {self.rank}: cannot {what}: {self.unusable}; close this Buffer and create a new one")
        self.seq += 1
        self._calls[what] += 1
        self._last = f"{what} #{self._calls[what]}"
        try:
            yield self.seq, self.seq % 2
        except BaseException as exc:
            if not self.unusable:
                self.unusable = f"{self.name(what)} failed midway ({type(exc).__name__}: {exc})"
            raise

    def timed_out(self, what: str, missing: Sequence[int]) -> TimeoutError:
        """Mark the buffer unusable and return the ``ep_comm.TimeoutError`` naming ``missing`` and the latest step."""
        missing = [int(r) for r in missing]
        step = self.name(what)
        self.unusable = f"{step} timed out waiting for ranks {missing}"
        return TimeoutError(
            f"rank {self.rank}: {step} timed out after {self.timeout_s:g} s waiting for ranks {missing} "
            f"(every rank must call dispatch/combine/close collectively)", missing)
