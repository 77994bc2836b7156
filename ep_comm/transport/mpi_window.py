"""The symmetric buffer as an MPI one-sided window: puts into peers, signals, bounded waits.

One window per Buffer, allocated once at worst-case capacity (``SymmetricLayout.total_bytes``)
and kept in a passive-target ``Lock_all`` epoch for its whole life. Data goes out with
``Put`` + ``Flush``; only then is the signal word put, so a receiver that sees the signal sees
the data. Receivers poll their own window memory (``Win.Sync``) against a deadline.
"""
from __future__ import annotations

import time
from typing import Iterable, List

import numpy as np
from mpi4py import MPI

from ..symmetric import SymmetricLayout


class MpiWindow:
    """A rank's symmetric buffer and one-sided access to its peers' buffers."""

    def __init__(self, comm: MPI.Comm, layout: SymmetricLayout):
        self.comm = comm
        self.layout = layout
        self.win = MPI.Win.Allocate(layout.total_bytes, disp_unit=1, comm=comm)
        self.mem = np.frombuffer(self.win.tomemory(), dtype=np.uint8)
        self.mem[: layout.rows_offset] = 0  # signals and counts start at zero
        self._signals = self.mem[layout.signal_offset : layout.signal_offset + 8 * comm.size].view(np.int64)
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

    def signal(self, targets: Iterable[int], word: int) -> None:
        """Complete every put so far to ``targets``, then set their ``signal[me]`` to ``word``."""
        targets = list(targets)
        self.flush(targets)
        word = np.array([word], dtype=np.int64)
        for target in targets:
            self.put(word, target, self.layout.signal_at(self.comm.rank))
        self.flush(targets)

    def local(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view of ``nbytes`` of this rank's own window at ``offset``."""
        return self.mem[offset : offset + nbytes]

    def wait(self, sources: Iterable[int], word: int, deadline: float) -> List[int]:
        """Poll until every source's signal shows it reached step ``word``; return the sources still
        missing at ``deadline`` (``time.monotonic()`` clock), an empty list when all arrived.

        Signal words are ``seq << 2 | kind`` (see ``ep_comm.backends.collective_steps.step_word``): a
        source has arrived when its word equals ``word`` or it has moved past ``seq``. A peer in
        another kind of step with the same number (closing while we dispatch) has not arrived.
        """
        pending = np.array(sorted(set(sources)), dtype=np.int64)
        pause = 1e-6
        while True:
            self.win.Sync()
            seen = self._signals[pending]
            pending = pending[(seen != word) & ((seen >> 2) <= (word >> 2))]
            if pending.size == 0 or time.monotonic() >= deadline:
                return [int(r) for r in pending]
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def free(self, collective: bool = True) -> None:
        """Release the window: collectively when every peer frees it too, else only locally."""
        self.win.Unlock_all()
        if collective:
            self.win.Free()
        self.mem = None
