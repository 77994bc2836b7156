"""``NvshmemTransport``: how bytes reach the peers on the GPU, over the NVSHMEM symmetric heap.

Two ways, chosen by ``Buffer(transport=...)``: ``"stores"``, the kernels store straight into every
peer's buffer through NVSHMEM peer views, and the signal is a CuPy kernel (``signals``); or
``"puts"``, the kernels write each destination's rows into a local staging block
(``staging``) that ``nvshmem_puts.put_blocks`` sends, and NVSHMEM carries the signal (peers
without P2P). GPU only: imports CuPy and Numba-CUDA.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import cupy
import numpy as np
from mpi4py import MPI
from numba import cuda

from ep_comm.contract.symmetric import ABORT_WORDS, SymmetricLayout, symmetric_views
from ep_comm.transport import nvshmem_puts, signals
from ep_comm.transport.nvshmem_heap import NvshmemHeap
from ep_comm.transport.staging import staged_destinations, staging_bytes


def _current_stream() -> int:
    """The handle of CuPy's current stream (the stream CuPy's own launches would take)."""
    return cupy.cuda.get_current_stream().ptr


def numba_view(a: Any) -> Any:
    """Zero-copy Numba device array of a CuPy array, without the interface's stream sync."""
    return cuda.as_cuda_array(a, sync=False)


class NvshmemTransport:
    """One Buffer's symmetric heap on this rank, and the stores or puts that reach the peers.

    ``rows``/``meta``: per-rank destination views for the kernels (Numba device arrays, made once);
    ``own``: typed views of this rank's buffer (``SymmetricViews``); ``step``: the device step
    counter (int64 ``[1]``); ``send_step`` and ``send_ahead``: where the sending kernels take their
    parity from, ``step[0] + 1`` (they run before the signal that advances the counter), or a
    constant 0 with puts (the staging area has one half); ``device``: the CUDA device ordinal.
    """

    def __init__(self, comm: MPI.Comm, sym: SymmetricLayout, word: np.dtype, use_puts: bool):
        """Collective over ``comm``: allocates ``sym.total_bytes`` (plus the staging area with
        ``use_puts``) of symmetric heap; rows are viewed as ``word`` (``contract.symmetric.word_dtype``)."""
        self.use_puts = use_puts
        self.sym = sym
        extra = staging_bytes(sym) if use_puts else 0
        self.heap = NvshmemHeap(comm, sym.total_bytes + extra, use_puts)
        self.rank, self.device = self.heap.rank, self.heap.device
        self.status = signals.WaitStatus(sym.num_ranks, self.device)
        self.step = cupy.zeros(1, dtype=cupy.int64)
        self.send_step = cupy.zeros(1, dtype=cupy.int64) if use_puts else self.step
        self.send_ahead = 0 if use_puts else 1
        self.own = symmetric_views(self.heap.local, sym, word)
        rows, meta = self._staged(word) if use_puts else self._peer_views(word)
        self.rows = tuple(numba_view(v) for v in rows)
        self.meta = tuple(numba_view(v) for v in meta)
        self._aborts = self.heap.local[sym.abort_offset: sym.abort_offset + sym.abort_bytes]
        self._abort_words = self._aborts.view(cupy.int64).reshape(sym.num_ranks, ABORT_WORDS)
        self._side = cupy.cuda.Stream(non_blocking=True)  # abort records: never queued behind the caller's waits
        self._signals = signals.SignalLaunches(None if use_puts else self.heap.peer_ptrs, sym.num_ranks, self.rank,
                                               sym.signal_offset, sym.counts_offset, self.step, self.own.signal,
                                               self.status.device, self.own.counts, self._abort_words, self.device)
        self._no_records = np.zeros((sym.num_ranks, ABORT_WORDS), dtype=np.int64)

    def _peer_views(self, word: np.dtype) -> tuple:
        """Every rank's rows and meta views (stores)."""
        peers = [symmetric_views(p, self.sym, word) for p in self.heap.peers]
        return tuple(v.rows for v in peers), tuple(v.meta for v in peers)

    def _staged(self, word: np.dtype) -> tuple:
        """The per-destination views into the staging area (puts), which also keeps its Numba views."""
        sym = self.sym
        r, t = sym.num_ranks, sym.max_tokens
        rows_bytes = (2 * r - 1) * t * sym.row_bytes
        stage = self.heap.local[sym.total_bytes: sym.total_bytes + staging_bytes(sym)]
        self._stage_rows = numba_view(stage[:rows_bytes])
        self._stage_meta = numba_view(stage[rows_bytes:])
        self._sym = numba_view(self.heap.local)
        return staged_destinations(stage[:rows_bytes].view(word).reshape(2 * r - 1, t, -1),
                                   stage[rows_bytes:].view(cupy.int32).reshape(2 * r - 1, t, -1), r)

    def flush(self, stream: Any, parity: int, psum: Any, with_meta: bool) -> None:
        """Puts only: send each destination ``r`` its staged ``psum[r] - psum[r-1]`` rows (and meta rows)."""
        if not self.use_puts:
            return
        sym, me = self.sym, self.rank
        nvshmem_puts.put_blocks(stream, self._stage_rows, me, sym.max_tokens * sym.row_bytes, self._sym,
                                sym.row_at(parity, me), sym.row_bytes, psum)
        if with_meta:
            meta_bytes = 4 * sym.meta_words
            nvshmem_puts.put_blocks(stream, self._stage_meta, me, sym.max_tokens * meta_bytes, self._sym,
                                    sym.meta_at(parity, me), meta_bytes, psum)

    def exchange(self, stream: Any, seq: int, kind: int, timeout_s: float, counts: Any = None) -> None:
        """Enqueue step ``seq``'s signal to every rank, then the bounded wait for every rank's signal: :meth:`signal`
        then :meth:`wait`, in one launch (``signals.signal_and_wait``) on peer stores."""
        if self.use_puts:
            self.signal(stream, seq, kind, counts)
            self.wait(kind, timeout_s, counts is not None)
            return
        self._signals.signal_and_wait(_current_stream(), kind, counts, timeout_s)

    def signal(self, stream: Any, seq: int, kind: int, counts: Any = None) -> None:
        """Enqueue step ``seq``'s signal to every rank, without a wait (the send half of a split step).

        Advances the device step counter, then ``signal[me] = step << 2 | kind`` in every rank (the step
        word, ``collective_steps.step_word``), after ``counts`` (int32 ``[R, 1 + L + 2]``: per destination its
        rows, then its entries per local expert, then the routing verdict) went to their count words of the step's parity. The signal
        kernels go on CuPy's current stream (``stream`` is its Numba twin, which the puts take) through their
        prepared launches (``signals.SignalLaunches``). Peer stores read the step from the device counter
        (``signals.send_signal``); puts signal with the host's ``seq`` (equal to it: the puts path is never
        captured into a graph) through NVSHMEM."""
        on = _current_stream()
        if not self.use_puts:
            self._signals.send_signal(on, kind, counts)
            return
        sym, me = self.sym, self.rank
        self._signals.advance_step(on)
        nvshmem_puts.signal_peers(stream, numba_view(self.own.signal), numba_view(self.own.counts[seq % 2]),
                                  sym.num_ranks, me, seq << 2 | kind, None if counts is None else numba_view(counts))

    def wait(self, kind: int, timeout_s: float, with_counts: bool) -> None:
        """Enqueue on CuPy's current stream the bounded wait for every rank's signal of the step the device counter
        holds (``signals.wait_signals``); with ``with_counts`` (the step exchanged counts) the received count words
        of missing ranks are zeroed. The wait ends early for a rank that posted an abort record."""
        self._signals.wait_signals(_current_stream(), kind, with_counts, timeout_s)

    def post_abort(self, record: np.ndarray) -> None:
        """Host copies of ``record`` (int64 ``[ABORT_WORDS]``) into this rank's abort slot of every peer
        reachable through a peer view, word 0 last, on a stream of their own (``aborts.AbortBoard``). A peer
        without a peer view (no P2P) is not told and finds out at its own deadline."""
        offset = self.sym.abort_at(self.rank)
        raw = record.view(np.uint8)
        with self._side:
            for r, peer in enumerate(self.heap.peers):
                if r != self.rank and peer is not None:
                    peer[offset + 8: offset + raw.size].set(raw[8:])
                    peer[offset: offset + 8].set(raw[:8])
            self._side.synchronize()

    def abort_table(self) -> np.ndarray:
        """The int64 ``[R, ABORT_WORDS]`` abort records peers wrote here, copied out on the side stream
        (``aborts.AbortBoard``); all zero while the caller's stream is being captured into a CUDA graph
        (nothing can be read back then: the next call outside the capture reads them)."""
        if cupy.cuda.get_current_stream().is_capturing():
            return self._no_records
        with self._side:
            raw = self._aborts.get(stream=self._side)
        return raw.view(np.int64).reshape(self.sym.num_ranks, ABORT_WORDS)

    def wait_state(self) -> Tuple[List[int], bool]:
        """``(ranks any wait so far gave up on (sticky), whether the last finished wait saw a peer's abort
        record)``, from one read of the mapped status record (no synchronisation: the wait kernel copies
        word 0 of every record there)."""
        outcome = self.status.read()
        return outcome.missing_ranks, bool(outcome.aborted_ranks)

    def close(self, collective: bool) -> None:
        """Free the heap: collectively, or (after a timeout) locally only."""
        self.heap.close(collective=collective)
