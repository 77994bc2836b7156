"""GPU side of the symmetric-buffer protocol: signals (carrying the count exchange) and bounded waits.

Rows travel in the Numba kernels of ``ep_comm.kernels`` (stores through peer views) or through
``nvshmem_puts``. Small CUDA C kernels compiled once through CuPy (``RawModule``, disk-cached,
~10 us launch), all reading the step number from the Buffer's device step counter (int64 ``[1]``,
see ``ep_comm.kernels.step_counter``) so that a CUDA graph can replay them:

* ``signal_and_wait`` (peer stores), one launch per step: advances the counter to this step,
  ``step + 1``; optionally sends this rank's per-destination count block (rows, then entries per local
  expert: ``1 + L`` words) into every peer's count words of the step's parity, then a system-scope
  fence and ``signal[me] = step << 2 | kind`` in every peer with a ``st.release.sys`` store (a
  receiver that acquires the signal sees every row and count sent before it); then the wait below;
* ``advance_step``: ``step += 1`` alone (the puts transport signals through NVSHMEM instead);
* ``wait_signals``: one CTA polls the local ``signal[s]`` words with ``ld.acquire.sys`` until each
  equals the step's word or passed the next step's threshold (a peer at most one step ahead),
  rank ``s`` posted an abort record (``ep_comm.backends.aborts``: it will not come), or a
  ``%globaltimer`` deadline passes, and records the outcome in a sticky status record, with word 0
  of every rank's abort record.

The status record (``WaitStatus``) lives in pinned host memory mapped into the device, so the
host reads it without a copy: after a stream synchronisation (``cpu_sync``), or at the next call
(which thus learns of a peer's abort record without reading the device).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

STATUS_SEQ, STATUS_MISSING, STATUS_FLAGS = 0, 1, 2  # int64 words of the status record
WAIT_THREADS = 128

_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ i64 load_acquire_sys(const i64* p) {
    i64 v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(i64* p, i64 v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

extern "C" __global__ void advance_step(i64* step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) step[0] += 1;
}

// The step number this launch signals, step[0] + 1, read by every thread of the CTA; thread 0 stores it
// back only after all have read it. counts (or NULL, int32 [R][count_words]): row r goes to block me of the
// step's parity of the int64 [2][R][count_words] count words at counts_offset of rank r, before the signal.
__device__ i64 signal_step(const u64* peers, int num_ranks, int me, i64 signal_offset, i64* step, int kind,
                           const int* counts, i64 counts_offset, int count_words) {
    const i64 seq = step[0] + 1;
    __syncthreads();
    if (threadIdx.x == 0) step[0] = seq;
    if (counts)
        for (int i = threadIdx.x; i < num_ranks * count_words; i += blockDim.x) {
            const int r = i / count_words;
            volatile i64* block = (volatile i64*)(peers[r] + counts_offset) + ((seq & 1) * num_ranks + me) * count_words;
            block[i - r * count_words] = counts[i];
        }
    __threadfence_system();
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
        store_release_sys((i64*)(peers[r] + signal_offset) + me, seq << 2 | kind);
    return seq;
}

// Rank s arrived when signal[s] == seq << 2 | kind (this step) or >= (seq + 1) << 2 (its next); it gave up
// when word 0 of its abort record (aborts, int64 [R][abort_words], or NULL) is set: then it is not waited for.
// status: [want, missing total (sticky), missing flag per rank (sticky), abort word 0 per rank]; the count
// words (counts_by_parity, or NULL: int64 [2][R][count_words], the step's parity) of a rank that did not
// arrive are zeroed so that later kernels see an empty, well-formed block.
__device__ void wait_step(const i64* signals, int num_ranks, i64 seq, int kind, u64 timeout_ns, i64* status,
                          i64* counts_by_parity, int count_words, const i64* aborts, int abort_words) {
    const i64 want = seq << 2 | kind, ahead = (seq + 1) << 2;
    i64* counts = counts_by_parity ? counts_by_parity + (seq & 1) * num_ranks * count_words : 0;
    __shared__ int missing;
    __shared__ int poisoned;
    if (threadIdx.x == 0) {
        missing = 0;
        poisoned = ((volatile i64*)status)[1] > 0;
    }
    __syncthreads();
    const u64 start = global_ns();
    for (int s = threadIdx.x; s < num_ranks; s += blockDim.x) {
        bool arrived = false;
        unsigned pause = 32;
        while (!poisoned) {
            const i64 v = load_acquire_sys(signals + s);
            if (v == want || v >= ahead) { arrived = true; break; }
            if (aborts && load_acquire_sys(aborts + (i64)s * abort_words) != 0) break;
            if (global_ns() - start > timeout_ns) break;
            __nanosleep(pause);
            if (pause < 256) pause *= 2;  // a signal is seen within ~0.3 us: decode steps last tens of us
        }
        if (!arrived) {
            atomicAdd(&missing, 1);
            ((volatile i64*)status)[2 + s] = 1;
            if (counts)
                for (int w = 0; w < count_words; ++w) ((volatile i64*)counts)[s * count_words + w] = 0;
        }
        if (aborts) ((volatile i64*)status)[2 + num_ranks + s] = load_acquire_sys(aborts + (i64)s * abort_words);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ((volatile i64*)status)[1] += missing;
        __threadfence_system();
        ((volatile i64*)status)[0] = want;
    }
}

// One CTA: the step's signal to every rank (peer stores), then the bounded wait for every rank's signal.
extern "C" __global__ void signal_and_wait(const u64* peers, int num_ranks, int me, i64 signal_offset, i64* step,
                                           int kind, const int* counts, i64 counts_offset, int count_words,
                                           const i64* signals, u64 timeout_ns, i64* status, i64* counts_by_parity,
                                           const i64* aborts, int abort_words) {
    const i64 seq = signal_step(peers, num_ranks, me, signal_offset, step, kind, counts, counts_offset, count_words);
    wait_step(signals, num_ranks, seq, kind, timeout_ns, status, counts_by_parity, count_words, aborts, abort_words);
}

// One CTA: the bounded wait alone, for the step the counter holds (the puts transport signals through NVSHMEM).
extern "C" __global__ void wait_signals(const i64* signals, int num_ranks, const i64* step, int kind, u64 timeout_ns,
                                        i64* status, i64* counts_by_parity, int count_words, const i64* aborts,
                                        int abort_words) {
    wait_step(signals, num_ranks, step[0], kind, timeout_ns, status, counts_by_parity, count_words, aborts,
              abort_words);
}
"""

@functools.lru_cache(maxsize=None)
def _module(device: int):
    """The compiled kernels for CUDA device ``device`` (one RawModule)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


def _kernel(name: str):
    import cupy

    return _module(cupy.cuda.Device().id).get_function(name)


def _or_null(arr):
    """A device array kernel argument, or a NULL pointer for None."""
    return np.uint64(0) if arr is None else arr


def advance_step(step) -> None:
    """Enqueue ``step[0] += 1`` (int64 ``[1]`` device array): the start of a collective step."""
    _kernel("advance_step")((1,), (32,), (step,))


def signal_and_wait(peer_ptrs, num_ranks: int, me: int, signal_offset: int, step, kind: int, counts, counts_offset: int,
                    signals, timeout_s: float, status, counts_by_parity=None, aborts=None) -> None:
    """One launch, after every earlier write on the stream: ``step[0] += 1`` (the device step counter), then
    ``signal[me] = step[0] << 2 | kind`` in every rank's buffer (release, system scope), then the bounded wait
    of :func:`wait_signals` for every rank's signal of that step. With ``counts`` (int32 ``[R, 1 + L]`` device
    array, or None: per destination its rows, then its entries per local expert), first row ``r`` goes to
    block ``me`` of the step's parity of the int64 ``[2, R, 1 + L]`` count words at byte ``counts_offset`` of
    rank ``r``'s buffer (the count exchange rides on the signal); ``counts_by_parity`` (this rank's count
    words) comes with it. ``peer_ptrs``: uint64 ``[R]`` device addresses of every rank's buffer;
    ``signals``: this rank's int64 ``[R]`` signal words; the rest as in :func:`wait_signals`."""
    _kernel("signal_and_wait")((1,), (WAIT_THREADS,),
                               (peer_ptrs, np.int32(num_ranks), np.int32(me), np.int64(signal_offset), step,
                                np.int32(kind), _or_null(counts), np.int64(counts_offset),
                                np.int32(_count_words(counts, counts_by_parity)), signals, _timeout_ns(timeout_s),
                                status, _or_null(counts_by_parity), _or_null(aborts), np.int32(_abort_words(aborts))))


def wait_signals(signals, num_ranks: int, step, kind: int, timeout_s: float, status, counts=None,
                 aborts=None) -> None:
    """Enqueue the bounded wait until ``signals[s] == step[0] << 2 | kind`` or ``>= (step[0] + 1) << 2``
    (int64 device views) for every ``s``, or until rank ``s`` posted an abort record (``aborts``: int64
    ``[R, ABORT_WORDS]``, this rank's abort region, or None); ``status`` is the mapped ``WaitStatus``
    record, which also gets word 0 of every abort record; ``counts`` (int64 ``[2, R, 1 + L]`` or None): the
    step's parity block of a missing rank is zeroed."""
    _kernel("wait_signals")((1,), (WAIT_THREADS,),
                            (signals, np.int32(num_ranks), step, np.int32(kind), _timeout_ns(timeout_s), status,
                             _or_null(counts), np.int32(_count_words(None, counts)), _or_null(aborts),
                             np.int32(_abort_words(aborts))))


def _count_words(counts, counts_by_parity) -> int:
    """int64 words of one source's count block (0 without ``counts_by_parity [2, R, words]``); ``counts``
    (the send block ``[R, words]``, or None) must match it."""
    if counts_by_parity is None:
        if counts is not None:
            raise ValueError("counts given without counts_by_parity: the count exchange needs this rank's count "
                             "words, whose blocks of a missing rank the wait zeroes")
        return 0
    words = int(counts_by_parity.shape[2])
    if counts is not None and tuple(counts.shape) != (counts_by_parity.shape[1], words):
        raise ValueError(f"counts has shape {tuple(counts.shape)}: must be [R, 1 + L] = "
                         f"{(int(counts_by_parity.shape[1]), words)}, one block per destination as counts_by_parity "
                         "holds them")
    return words


def _timeout_ns(timeout_s: float) -> np.uint64:
    return np.uint64(int(timeout_s * 1e9))


def _abort_words(aborts) -> int:
    """int64 words of one abort record in ``aborts [R, ABORT_WORDS]`` (0 without)."""
    return 0 if aborts is None else int(aborts.shape[1])


@dataclass
class WaitOutcome:
    """What the host reads back from a status record."""

    last_seq: int  # the signal value of the last wait that finished
    missing_ranks: List[int]  # ranks that ever failed to arrive (sticky)
    aborted_ranks: List[int]  # ranks whose abort record the last wait saw posted


def read_status(words: Sequence[int], num_ranks: int) -> WaitOutcome:
    """Decode the int64 words ``[seq, missing total, missing flag per rank, abort word 0 per rank]`` of a
    status record."""
    flags = words[STATUS_FLAGS:STATUS_FLAGS + num_ranks]
    missing = [r for r, f in enumerate(flags) if f] if int(words[STATUS_MISSING]) > 0 else []
    posted = words[STATUS_FLAGS + num_ranks:STATUS_FLAGS + 2 * num_ranks]
    return WaitOutcome(int(words[STATUS_SEQ]), missing, [r for r, w in enumerate(posted) if w])


def mapped_int64(count: int, device: Optional[int] = None, fill: int = 0) -> Tuple[np.ndarray, object]:
    """``(host, device)`` views of ``count`` int64 words of pinned host memory mapped into CUDA device
    ``device`` (None: the current one), set to ``fill``: kernels write them with plain stores and the
    host reads them without a copy, once those kernels finished."""
    import cupy

    pinned = cupy.cuda.alloc_pinned_memory(8 * count)
    host = np.frombuffer(pinned, dtype=np.int64, count=count)  # keeps ``pinned`` alive
    host[:] = fill
    device = cupy.cuda.Device().id if device is None else device
    mem = cupy.cuda.UnownedMemory(pinned.ptr, 8 * count, pinned, device)
    return host, cupy.ndarray((count,), cupy.int64, cupy.cuda.MemoryPointer(mem, 0))


class WaitStatus:
    """A status record in pinned, device-mapped host memory: ``2 + 2R`` int64 words, zero at start."""

    def __init__(self, num_ranks: int, device: Optional[int] = None):
        self.num_ranks = num_ranks
        self.host, self.device = mapped_int64(STATUS_FLAGS + 2 * num_ranks, device)

    def read(self) -> WaitOutcome:
        """The record as the device last wrote it (no synchronisation)."""
        return read_status(self.host.tolist(), self.num_ranks)
