"""Collective step bookkeeping shared by the backends: numbering, and the unusable state after a failure.

Every dispatch, combine and close is one collective step ``seq`` (1, 2, ...) using buffer parity
``seq % 2``; messages count each kind apart (``dispatch #4`` is the 4th dispatch). A step that times
out or fails midway leaves the peers out of step: this rank posts an abort record to every peer
(``aborts``) and from then on the buffer refuses work with ``BufferUnusableError`` and must be closed
and recreated. A rank that finds a peer's abort record (on entering a step, :meth:`Steps.check_peers`;
after a wait, :meth:`Steps.after_wait`) raises ``PeerAbortedError`` and is unusable too, without
posting a record of its own.

A step may run in two parts (``Buffer(..., return_recv_hook=True)``): :meth:`Steps.run` numbers it and runs its
send part, which returns the receive part; :meth:`Steps.resume` runs that later under the same guard.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, TypeVar

from ep_comm.backends import aborts
from ep_comm.contract.symmetric import STEP_KINDS
from ep_comm.errors import BufferUnusableError, PeerAbortedError, RoutingError, TimeoutError
from ep_comm.transport import exit_guard

__all__ = ["STEP_KINDS", "Steps", "step_word"]

T = TypeVar("T")


def step_word(seq: int, what: str) -> int:
    """The signal word of step number ``seq`` of kind ``what``: ``seq << 2 | kind`` (monotone in ``seq``).

    A peer has arrived at a step when its word equals the step's word or it reached the next step
    (``step_word(seq + 1, ...) >= (seq + 1) << 2``); a peer in another kind of step with the same
    number (closing while this rank dispatches) has not.
    """
    return seq << 2 | STEP_KINDS[what]


class Steps:
    """The step counter of one Buffer on one rank, and its abort records (``board``).

    ``seq`` numbers every step (the signal words and parities); messages name a step by its kind and
    its number among the steps of that kind (``dispatch #4`` is the 4th dispatch), :meth:`name`.
    """

    def __init__(self, rank: int, timeout_s: float, board: aborts.AbortBoard):
        self.rank = rank
        self.timeout_s = timeout_s
        self.board = board
        self.seq = 0
        self.unusable: Optional[str] = None
        self._calls: Dict[str, int] = dict.fromkeys(STEP_KINDS, 0)
        self._last = "no step yet"
        self._last_kind = ""

    def name(self, what: str) -> str:
        """``what`` with the latest step: ``"combine #2"``, or ``"an earlier operation (combine #2)"``."""
        return self._last if self._last.startswith(what + " #") else f"{what} ({self._last})"

    def run(self, what: str, read_board: bool, body: Callable[..., T], *args: Any) -> T:
        """Number the next step ``seq`` and return ``body(seq, *args)``; an exception from ``body`` marks the
        buffer unusable and posts this rank's abort record (then propagates).

        Args:
            what: the step's kind.
            read_board: read the peers' abort records first (:meth:`check_peers`). ``mpi`` reads them always; ``nvshmem``
                only when the last finished wait saw a record (the mapped status record), so that it does not read
                the device: a step learns of a record posted since at its own wait (which ends early) and raises
                from its poll (``cpu_sync=True``) or at the next call.
            body: the step's work, called as ``body(seq, *args)``.
        """
        if self.unusable:
            raise BufferUnusableError(
                f"rank {self.rank}: cannot {what}: {self.unusable}; close this Buffer and create a new one")
        if read_board:
            self.check_peers(f"cannot {what}")
        self.seq += 1
        self._calls[what] += 1
        self._last = f"{what} #{self._calls[what]}"
        self._last_kind = what
        return self.resume(what, body, self.seq, *args)

    @property
    def latest(self) -> str:
        """The latest step by kind and number among its kind, e.g. ``"dispatch #3"``."""
        return self._last

    def resume(self, what: str, rest: Callable[..., T], *args: Any) -> T:
        """``rest(*args)``, a part of the latest step (of kind ``what``) guarded as :meth:`run` guards its body: an
        exception marks the buffer unusable and posts this rank's abort record (then propagates). :meth:`run`
        runs the whole body so; a split step (``return_recv_hook``) runs its receive part through it later. A
        ``RoutingError`` is raised by every rank after a complete step (the ranks stay in step): it leaves the buffer
        usable."""
        try:
            return rest(*args)
        except RoutingError:
            raise
        except BaseException as exc:
            if not self.unusable:
                self._give_up(f"{self.name(what)} failed midway", f"failed midway ({type(exc).__name__}: {exc})")
            raise

    def check_peers(self, doing: str) -> None:
        """Raise ``PeerAbortedError`` (and mark the buffer unusable) when a peer posted an abort record.

        Args:
            doing: what this rank is doing, for the message (``"cannot dispatch"``, ``"dispatch #3"``).
        """
        records = aborts.decode(self.board.abort_table())
        if records:
            raise self._peer_aborted(doing, records)

    def after_wait(self, what: str, missing: Sequence[int], seen: bool) -> None:
        """The outcome of this step's wait, ``missing`` the ranks that did not arrive: ``PeerAbortedError``
        when one of them posted an abort record (it left the protocol), or when every rank arrived but a
        peer posted one (the step's rows are not to be used); this rank's own ``ep_comm.TimeoutError`` when
        ranks are missing and none of them posted (records of ranks that did arrive, e.g. a peer that timed
        out first waiting for the same missing rank, do not replace it).

        When every rank arrived and ``seen`` is False, the records are not read: a record posted after the
        wait looked is raised by the next call.

        Args:
            what: the step's kind.
            missing: the ranks the wait gave up on (empty when all arrived).
            seen: whether the wait saw a posted record (on ``nvshmem`` the mapped status record the GPU wait
                kernel wrote); ``mpi`` passes True (its records are host memory): it reads them after every wait.
        """
        if not missing and not seen:
            return
        records = aborts.decode(self.board.abort_table())
        gave_up = [record for record in records if record[0] in set(missing)]
        if missing and not gave_up:
            raise self.timed_out(what, missing)
        if records:
            raise self._peer_aborted(self.name(what), gave_up or records)

    def stalled(self, what: str, seconds: float) -> TimeoutError:
        """Mark the buffer unusable, post the abort record, and return the ``ep_comm.TimeoutError`` of a step whose
        GPU work did not finish within ``seconds`` although no peer was seen missing (the stream's earlier work
        never finished, or a kernel hangs)."""
        step = self.name(what)
        self._give_up(f"{step}: the GPU did not finish it within {seconds:g} s",
                      f"its GPU work did not finish within {seconds:g} s")
        return TimeoutError(f"rank {self.rank}: {step}: the GPU did not finish the step within {seconds:g} s "
                            "(timeout_s plus a margin): the work queued before it on the stream never finished, or "
                            "a kernel hangs")

    def _peer_aborted(self, doing: str, records: list) -> PeerAbortedError:
        """Mark the buffer unusable (no record of its own: the peers already know) and return the error."""
        self.unusable = "; ".join(f"rank {r} gave up at {step} ({reason})" for r, step, reason in records)
        exit_guard.note_failure(self.timeout_s)
        return aborts.peer_aborted(self.rank, doing, records)

    def timed_out(self, what: str, missing: Sequence[int]) -> TimeoutError:
        """Mark the buffer unusable, post the abort record, and return the ``ep_comm.TimeoutError`` naming
        ``missing`` and the latest step."""
        missing = [int(r) for r in missing]
        step = self.name(what)
        self._give_up(f"{step} timed out waiting for ranks {missing}",
                      f"timed out after {self.timeout_s:g} s waiting for ranks {missing}")
        return TimeoutError(
            f"rank {self.rank}: {step} timed out after {self.timeout_s:g} s waiting for ranks {missing} "
            f"(every rank must call dispatch/combine/close collectively)", missing)

    def _give_up(self, unusable: str, reason: str) -> None:
        """This rank leaves the protocol: the buffer is unusable, every peer gets the abort record of the
        latest step with ``reason``, and the process's exit is bounded (``exit_guard``)."""
        self.unusable = unusable
        exit_guard.note_failure(self.timeout_s)
        self.board.post_abort(aborts.encode(self._last_kind, self._calls.get(self._last_kind, 0), reason))
