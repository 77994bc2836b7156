"""The symmetric buffer as an MPI one-sided window: puts into peers, signals, bounded waits.

One window per Buffer, allocated once at worst-case capacity (``SymmetricLayout.total_bytes``)
and kept in a passive-target ``Lock_all`` epoch for its whole life. Data goes out with
``Put`` + ``Flush``; only then is the signal word put, so a receiver that sees the signal sees
the data. Receivers poll their own window memory (``Win.Sync``) against a deadline, and stop early
when a peer's abort record arrives (``ep_comm.backends.aborts``).

``Put`` and ``Flush`` complete without the target's help (a stopped, late or killed peer included);
``Unlock_all`` and ``Free`` do not (MPICH's need every peer to make MPI progress), so a window whose
peers are out of step is dropped without them and leaked (:meth:`MpiWindow.free`).
"""
from __future__ import annotations

import time
from typing import Any, Iterable, List, Optional

import numpy as np
from mpi4py import MPI

from ep_comm.contract.forward_inbox import ForwardInbox
from ep_comm.contract.symmetric import ABORT_WORDS, SymmetricLayout

_LEAKED: List[MPI.Win] = []  # windows dropped after a failure: never freed (Unlock_all / Free wait for the peers)


class MpiWindow:
    """A rank's symmetric buffer (and with ``inbox`` the forwarding inbox after it) and one-sided access to its
    peers' buffers."""

    def __init__(self, comm: MPI.Comm, layout: SymmetricLayout, inbox: Optional[ForwardInbox] = None):
        self.comm = comm
        self.layout = layout
        self.win = MPI.Win.Allocate(layout.total_bytes if inbox is None else inbox.total_bytes, disp_unit=1,
                                    comm=comm)
        self.mem = np.frombuffer(self.win.tomemory(), dtype=np.uint8)
        self.mem[: layout.rows_offset] = 0  # signals and counts start at zero
        self.mem[layout.abort_offset : layout.abort_offset + layout.abort_bytes] = 0  # and no abort record
        if inbox is not None:  # and so do the inbox's signals
            self.mem[inbox.signal_offset : inbox.signal_offset + 8 * comm.size] = 0
        self._aborts = self.mem[layout.abort_offset : layout.abort_offset + layout.abort_bytes].view(
            np.int64).reshape(comm.size, ABORT_WORDS)
        self.win.Lock_all()
        comm.Barrier()

    def put(self, data: np.ndarray, target: int, offset: int) -> None:
        """Copy the bytes of the C-contiguous array ``data`` to ``offset`` in ``target``'s window."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size:
            self.win.Put([raw, MPI.BYTE], target, target=(offset, raw.size, MPI.BYTE))

    def flush(self, targets: Iterable[int]) -> None:
        for target in targets:
            self.win.Flush(target)

    def signal(self, targets: Iterable[int], word: int, signals: Optional[int] = None) -> None:
        """Complete every put so far to ``targets``, then set their ``signal[me]`` to ``word``: of the symmetric
        buffer, or of the int64 ``[R]`` signal array at byte offset ``signals`` (the forwarding inbox's)."""
        targets = list(targets)
        self.flush(targets)
        word = np.array([word], dtype=np.int64)
        at = (self.layout.signal_offset if signals is None else signals) + 8 * self.comm.rank
        for target in targets:
            self.put(word, target, at)
        self.flush(targets)

    def local(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view of ``nbytes`` of this rank's own window at ``offset``."""
        return self.mem[offset : offset + nbytes]

    def post_abort(self, record: np.ndarray) -> None:
        """Put ``record`` (int64 ``[ABORT_WORDS]``) into this rank's abort slot of every peer's window, word 0
        last (``aborts.AbortBoard``); a put that MPI refuses (a peer gone) is skipped."""
        me = self.comm.rank
        offset = self.layout.abort_at(me)
        for target in range(self.comm.size):
            if target == me:
                continue
            try:
                self.put(record[1:], target, offset + 8)
                self.win.Flush(target)
                self.put(record[:1], target, offset)
                self.win.Flush(target)
            except MPI.Exception:
                continue

    def abort_table(self) -> np.ndarray:
        """A copy of the int64 ``[R, ABORT_WORDS]`` abort records peers put here (``aborts.AbortBoard``), taken after
        a window sync: peers may post into the window while the caller reads (``np.nonzero`` over the live words
        raised "number of non-zero array elements changed" when two ranks gave up at once)."""
        self.win.Sync()
        return self._aborts.copy()

    def wait(self, sources: Iterable[int], word: int, deadline: float, signals: Optional[int] = None,
             entered: Optional[int] = None, clock: Any = None) -> List[int]:
        """Poll until every source's signal (of the symmetric buffer, or of the int64 ``[R]`` signal array at byte
        offset ``signals``) shows it reached step ``word``, or a source still missing
        posted an abort record (it will not come); return the sources still missing then, or at
        ``deadline`` (``time.monotonic()`` clock), an empty list when all arrived (the caller reads the
        abort records: ``abort_table``).

        Signal words are ``seq << 2 | kind`` (see ``ep_comm.backends.collective_steps.step_word``): a
        source has arrived when its word equals ``word`` or it has moved past ``seq``. A peer in
        another kind of step with the same number (closing while we dispatch) has not arrived.

        ``entered``: the byte offset of a second int64 ``[R]`` signal array whose word shows that a source began
        the step (the forwarding inbox's, which every rank signals at the end of its send part): a missing
        source that began it waits for another one, so its abort record does not end the wait, and the sources
        returned are those that did not begin the step where there are any (the ones the others wait for).

        ``clock``: a ``wait_stats.WaitClock`` (or None), polled after every window sync: it notes when each peer's
        signal shows (the wait statistics).
        """
        pending = np.array(sorted(set(sources)), dtype=np.int64)
        board = self._int64s(self.layout.signal_offset if signals is None else signals)
        began = None if entered is None else self._int64s(entered)
        pause = 1e-6
        while True:
            self.win.Sync()
            if clock is not None:
                clock.poll()
            pending = pending[_not_at(board[pending], word)]
            absent = pending if began is None else pending[_not_at(began[pending], word)]
            if pending.size == 0 or self._aborts[absent, 0].any() or time.monotonic() >= deadline:
                return [int(r) for r in (absent if absent.size else pending)]
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def arrivals(self, word: int, signals: Optional[int] = None) -> Any:
        """A function of no argument: bool ``[R]``, which ranks' signals (of the symmetric buffer, or of the int64
        ``[R]`` signal array at byte offset ``signals``) show them at step ``word`` or past it (what
        ``wait_stats.HostWaits.clock`` reads after each window sync)."""
        board = self._int64s(self.layout.signal_offset if signals is None else signals)
        return lambda: ~_not_at(board, word)

    def _int64s(self, offset: int) -> np.ndarray:
        """The int64 ``[R]`` signal array at byte ``offset`` of this rank's window."""
        return self.mem[offset : offset + 8 * self.comm.size].view(np.int64)

    def free(self, collective: bool) -> None:
        """Release the window: collectively (``Unlock_all``, ``Free``) when every peer frees it too; else
        drop it without any MPI call, leaking its memory until the process exits."""
        if collective:
            self.win.Unlock_all()
            self.win.Free()
        else:
            _LEAKED.append(self.win)
        self.win = self.mem = self._aborts = None


def _not_at(seen: np.ndarray, word: int) -> np.ndarray:
    """Which signal words ``seen`` show their rank not (yet) at step ``word`` (nor past it)."""
    return (seen != word) & ((seen >> 2) <= (word >> 2))
