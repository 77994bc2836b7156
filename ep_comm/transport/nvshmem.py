"""``NvshmemTransport``: how bytes reach the peers on the GPU, over the NVSHMEM symmetric heap.

Per peer, one of two ways, fixed at construction (``puts_to``): **stores**, the kernels store straight into the
peer's buffer through its NVSHMEM peer view, and the signal is a CUDA C kernel (``signals``); or **puts**, the kernels
write the peer's rows into a local staging block (``staging``) that ``nvshmem_puts.put_blocks`` sends, and NVSHMEM
carries its count block and signal (peers out of scale-up reach, or every rank with ``Buffer(transport="puts")``).
Both kinds go out in the same launches of a step, and all of them read the step from the device counter, so a CUDA
graph captures any mix. GPU only: imports CuPy and Numba-CUDA.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import cupy
import numpy as np
from mpi4py import MPI
from numba import cuda

from ep_comm.contract.forward_inbox import ForwardInbox, inbox_views
from ep_comm.contract.symmetric import ABORT_WORDS, SymmetricLayout, symmetric_views
from ep_comm.contract.topology import transport_mode
from ep_comm.transport import nvshmem_puts, signals, wait_stats
from ep_comm.transport.forward_views import ForwardViews, forward_views
from ep_comm.transport.inbox_signals import InboxSignals, inbox_peer_pointers, measured_wait
from ep_comm.transport.nvshmem_heap import NvshmemHeap
from ep_comm.transport.staging import staged_destination, staging_blocks, staging_bytes


def _current_stream() -> int:
    """The handle of CuPy's current stream (the stream CuPy's own launches would take)."""
    return cupy.cuda.get_current_stream().ptr


def numba_view(a: Any) -> Any:
    """Zero-copy Numba device array of a CuPy array, without the interface's stream sync."""
    return cuda.as_cuda_array(a, sync=False)


def _heap(comm: MPI.Comm, nbytes: int, stores_to: Tuple[int, ...], forwarding: bool) -> NvshmemHeap:
    """``NvshmemHeap(comm, nbytes, stores_to)``; its RuntimeError (every rank alike: a rank of ``stores_to`` without a
    peer view) says, when ``forwarding``, that a forwarded step reaches every rank through peer views."""
    try:
        return NvshmemHeap(comm, nbytes, stores_to)
    except RuntimeError as error:
        if not forwarding:
            raise
        raise RuntimeError(f"forwarding=True across nodes: {error}. A forwarded step writes the inboxes of the other "
                           "nodes through peer views: the inbox's staging blocks and puts are not built; use "
                           "forwarding=False, or backend='mpi'") from error


class NvshmemTransport:
    """One Buffer's symmetric heap on this rank, and the stores or puts that reach each peer.

    ``rows``/``meta``: per-rank destination views for the kernels (Numba device arrays, made once; ``[2, R,
    max_tokens, ...]`` each: the peer's own rows and meta for a peer reached through stores, a staging view for one
    reached through puts); ``own``: typed views of this rank's buffer (``SymmetricViews``); ``step``: the device step
    counter (int64 ``[1]``; the sending kernels take their parity from ``step[0] + 1``, as they run before the signal
    that advances it); ``puts_to``: the ranks reached through puts; ``mode``: :func:`transport_mode`; ``device``: the
    CUDA device ordinal; ``waits``: the wait statistics (int64 ``[R, WAIT_WORDS]`` device memory, ``wait_stats``),
    which the waits of dispatches and combines add to while ``measuring`` (the backend sets it from
    ``Buffer(wait_stats=...)``); ``forward``: the views of a forwarded step (``forward_views.ForwardViews``), or None
    when the Buffer does not forward across nodes.
    """

    def __init__(self, comm: MPI.Comm, sym: SymmetricLayout, word: np.dtype, puts_to: Sequence[int],
                 inbox: Optional[ForwardInbox] = None):
        """Collective over ``comm``: allocates ``sym.total_bytes`` (plus the staging area when ``puts_to`` names a
        rank) of symmetric heap; rows are viewed as ``word`` (``contract.symmetric.word_dtype``). ``puts_to``: the
        ranks reached through puts; the others must be in load/store reach (RuntimeError on every rank otherwise).
        ``inbox``: a forwarding Buffer's inbox layout across several nodes (the heap then holds
        ``inbox.total_bytes`` before the staging area, and every rank must be in load/store reach: the inbox is
        written through peer views), or None."""
        self.sym, r = sym, sym.num_ranks
        self.puts_to = tuple(sorted(set(puts_to)))
        self.mode = transport_mode(self.puts_to, r, comm.rank)
        stores_to = tuple(q for q in range(r) if inbox is not None or q not in self.puts_to)
        self._heap_bytes = sym.total_bytes if inbox is None else inbox.total_bytes  # where the staging area starts
        self.heap = _heap(comm, self._heap_bytes + (staging_bytes(sym) if self.puts_to else 0), stores_to,
                          inbox is not None)
        self.rank, self.device = self.heap.rank, self.heap.device
        self.status = signals.WaitStatus(r, self.device)
        self.step = cupy.zeros(1, dtype=cupy.int64)
        self.waits = cupy.zeros((r, wait_stats.WAIT_WORDS), dtype=cupy.int64)
        self.measuring = True
        self.own = symmetric_views(self.heap.local, sym, word)
        rows, meta = self._views(word)
        self.rows = tuple(numba_view(v) for v in rows)
        self.meta = tuple(numba_view(v) for v in meta)
        self._aborts = self.heap.local[sym.abort_offset: sym.abort_offset + sym.abort_bytes]
        self._abort_words = self._aborts.view(cupy.int64).reshape(r, ABORT_WORDS)
        self._side = cupy.cuda.Stream(non_blocking=True)  # abort records: never queued behind the caller's waits
        # held here: the signal launches keep only its address
        self._stores_ptrs = cupy.asarray([0 if q in self.puts_to else int(self.heap.peers[q].data.ptr)
                                          for q in range(r)], dtype=cupy.uint64)
        self._signals = signals.SignalKernels(self._stores_ptrs, r, self.rank, sym.signal_offset, sym.counts_offset,
                                               self.step, self.own.signal, self.status.device, self.own.counts,
                                               self._abort_words, self.device, waits=self.waits)
        self._no_records = np.zeros((r, ABORT_WORDS), dtype=np.int64)
        self.forward: Optional[ForwardViews] = None
        if inbox is not None:
            self._forwarding(inbox, word)

    def _forwarding(self, inbox: ForwardInbox, word: np.dtype) -> None:
        """The forwarded step's views (:attr:`forward`) and its inbox signals (``inbox_signals.InboxSignals``)."""
        heaps = [self.heap.local[: inbox.total_bytes] if q == self.rank else p[: inbox.total_bytes]
                 for q, p in enumerate(self.heap.peers)]
        self.forward = forward_views(heaps, inbox, self.rank, word, cupy, numba_view)
        self._inbox_ptrs = cupy.asarray(inbox_peer_pointers([int(h.data.ptr) for h in heaps], range(len(heaps))),
                                        dtype=cupy.uint64)
        self._inbox_step = cupy.zeros(1, dtype=cupy.int64)
        own = inbox_views(self.heap.local[: inbox.total_bytes], inbox, word)
        self._inbox_signals = InboxSignals(self._inbox_ptrs, len(heaps), self.rank, inbox.signal_offset, self.step,
                                           self._inbox_step, own.signal, self.status.device, self._abort_words,
                                           self.device, waits=self.waits)

    def inbox_signal(self, kind: int) -> None:
        """Enqueue on CuPy's current stream the inbox signal of a forwarded step of kind ``kind`` to every rank
        (``InboxSignals.signal``: the step counter is not advanced)."""
        self._inbox_signals.signal(_current_stream(), kind)

    def inbox_wait(self, kind: int, timeout_s: float) -> None:
        """Enqueue on CuPy's current stream the bounded wait for every rank's inbox signal of this step
        (``InboxSignals.wait``); a rank missing is flagged in the status record, as at the step's wait. It measures
        the step's waits (:meth:`_measured`)."""
        self._inbox_signals.wait(_current_stream(), kind, timeout_s, self._measured(kind, inbox=True))

    def _views(self, word: np.dtype) -> tuple:
        """Every rank's rows and meta views: its own (stores) or a staging view (puts, see ``staging``); with puts,
        also keeps the Numba views the puts and their signal read (the step counter, the ranks they reach, the signal
        and count words) and :attr:`_put_blocks`."""
        sym, r, t = self.sym, self.sym.num_ranks, self.sym.max_tokens
        peers = [None if q in self.puts_to else symmetric_views(p, sym, word) for q, p in enumerate(self.heap.peers)]
        if not self.puts_to:
            return tuple(v.rows for v in peers), tuple(v.meta for v in peers)
        rows_bytes = staging_blocks(r) * t * sym.row_bytes
        stage = self.heap.local[self._heap_bytes: self._heap_bytes + staging_bytes(sym)]
        stage_rows = stage[:rows_bytes].view(word).reshape(staging_blocks(r), t, -1)
        stage_meta = stage[rows_bytes:].view(cupy.int32).reshape(staging_blocks(r), t, -1)
        self._step = numba_view(self.step)
        self._signal_words, self._count_words = numba_view(self.own.signal), numba_view(self.own.counts)
        self._remote = numba_view(cupy.asarray([q in self.puts_to for q in range(r)], dtype=cupy.uint8))
        self._put_blocks = self._put_arguments(stage[:rows_bytes], stage[rows_bytes:])
        return (tuple(staged_destination(stage_rows, q, r) if v is None else v.rows for q, v in enumerate(peers)),
                tuple(staged_destination(stage_meta, q, r) if v is None else v.meta for q, v in enumerate(peers)))

    def _put_arguments(self, stage_rows: Any, stage_meta: Any) -> Tuple[tuple, ...]:
        """The constant arguments of ``nvshmem_puts.put_blocks`` (``stage`` to ``row_bytes``), once for the rows and
        once for the meta rows: the staging area (uint8 CuPy ``stage_rows`` / ``stage_meta``) as Numba views, its
        blocks' bytes, this rank's buffer, its region's offset in the destination and the parities' distance, the
        step counter and the bytes per row."""
        sym, me, heap = self.sym, self.rank, numba_view(self.heap.local)
        return tuple((numba_view(stage), sym.max_tokens * row_bytes, heap, at(0, me), at(1, me) - at(0, me),
                      self._step, row_bytes)
                     for stage, row_bytes, at in ((stage_rows, sym.row_bytes, sym.row_at),
                                                  (stage_meta, 4 * sym.meta_words, sym.meta_at)))

    def flush(self, stream: Any, psum: Callable[[], Any], with_meta: bool,
              timed: Callable[[], ContextManager[None]] = nullcontext) -> None:
        """Send each destination ``r`` reached through puts its staged ``psum()[r] - psum()[r-1]`` rows (and meta rows)
        (``psum()``: int32 ``[R]`` on the device, called only where there are puts), inside ``timed()`` (a profile
        phase, made only then); nothing at all without puts. Before the step's signal."""
        if not self.puts_to:
            return
        prefix = psum()
        with timed():
            for arguments in self._put_blocks[: 2 if with_meta else 1]:
                nvshmem_puts.put_blocks(stream, self.device, *arguments, prefix, self._remote, self.rank)

    def exchange(self, stream: Any, kind: int, timeout_s: float, counts: Any = None) -> None:
        """Enqueue the step's signal to every rank, then the bounded wait for every rank's signal: :meth:`signal`
        then :meth:`wait`; one launch (``signals.signal_and_wait``) where every rank is reached through stores."""
        if self.puts_to:
            self.signal(stream, kind, counts)
            self.wait(kind, timeout_s, counts is not None)
            return
        self._signals.signal_and_wait(_current_stream(), kind, counts, timeout_s, self._measured(kind))

    def _measured(self, kind: int, inbox: bool = False) -> bool:
        """Whether a wait of step kind ``kind`` (``inbox``: a forwarded step's inbox wait) adds to the wait
        statistics: a dispatch's or combine's while ``measuring``, forwarded at its inbox wait
        (``inbox_signals.measured_wait``)."""
        return measured_wait(self.measuring, kind, self.forward is not None, inbox)

    def signal(self, stream: Any, kind: int, counts: Any = None) -> None:
        """Enqueue the step's signal to every rank, without a wait (the send half of a split step).

        Advances the device step counter, then ``signal[me] = step << 2 | kind`` in every rank (the step
        word, ``collective_steps.step_word``), after ``counts`` (int32 ``[R, 1 + L + 2]``: per destination its
        rows, then its entries per local expert, then the routing verdict) went to their count words of the step's
        parity: one launch for the ranks reached through stores (``signals.send_signal``, on CuPy's current stream),
        then one for those reached through puts (``nvshmem_puts.signal_peers``, on ``stream``, its Numba twin), after
        every put of the step landed. Both read the step from the device counter."""
        self._signals.send_signal(_current_stream(), kind, counts)
        if self.puts_to:
            nvshmem_puts.signal_peers(stream, self.device, self._signal_words, self._count_words, self._remote,
                                      self.rank, self._step, kind, counts)

    def wait(self, kind: int, timeout_s: float, with_counts: bool) -> None:
        """Enqueue on CuPy's current stream the bounded wait for every rank's signal of the step the device counter
        holds (``signals.wait_signals``); with ``with_counts`` (the step exchanged counts) the received count words
        of missing ranks are zeroed. The wait ends early for a rank that posted an abort record."""
        self._signals.wait_signals(_current_stream(), kind, with_counts, timeout_s, self._measured(kind))

    def wait_table(self) -> np.ndarray:
        """A host copy of the wait statistics, after every wait enqueued on CuPy's current stream so far."""
        return self.waits.get()  # on CuPy's current stream, blocking

    def reset_waits(self) -> None:
        """Zero the wait statistics on CuPy's current stream (after the waits enqueued on it before)."""
        self.waits.fill(0)

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
        return signals.status_state(self.status.host.tolist(), self.sym.num_ranks)

    def close(self, collective: bool) -> None:
        """Free the heap: collectively, or (after a timeout) locally only."""
        self.heap.close(collective=collective)
