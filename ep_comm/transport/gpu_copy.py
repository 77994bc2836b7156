"""GPU side of the symmetric-buffer protocol: row puts through peer views, signals, bounded waits.

Small CUDA C kernels compiled once through CuPy (``RawModule``, disk-cached, ~10 us launch):

* ``put_rows``: copy rows of a local array into rows of peers' symmetric buffers, one CTA per
  (source row, destination) pair, through the peers' ``nvshmem_ptr`` views (NVLink stores);
* ``gather_rows``: rows of a local array picked by index (-1: a zero row);
* ``signal_peers``: a system-scope fence, then ``signal[me] = seq`` in every peer with a
  ``st.release.sys`` store: a receiver that acquires the signal sees every row sent before it;
* ``wait_signals``: one CTA polls the local ``signal[s]`` words with ``ld.acquire.sys`` until each
  equals the awaited value or passed the next step's threshold (a peer at most one step ahead),
  or a ``%globaltimer`` deadline passes, and records the outcome in a sticky status record.

The status record (``WaitStatus``) lives in pinned host memory mapped into the device, so the
host reads it without a copy: after a stream synchronisation (``cpu_sync``), or at the next call.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

STATUS_SEQ, STATUS_MISSING, STATUS_FLAGS = 0, 1, 2  # int64 words of the status record
WAIT_THREADS = 128
PUT_THREADS = 256

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

// pair p sends local row p / fanout to rank (dst_rank ? dst_rank[p] : p % num_ranks), row dst_row[p] (-1: skip)
template <typename U>
__global__ void put_rows(const unsigned char* src, i64 src_pitch, i64 num_pairs, int fanout, int num_ranks,
                         const int* dst_rank, const i64* dst_row, const u64* peers,
                         i64 dst_offset, i64 dst_pitch, i64 row_bytes) {
    const i64 units = row_bytes / (i64)sizeof(U);
    for (i64 p = blockIdx.x; p < num_pairs; p += gridDim.x) {
        const i64 d = dst_row[p];
        if (d < 0) continue;
        const int r = dst_rank ? dst_rank[p] : (int)(p % num_ranks);
        const U* s = (const U*)(src + (p / fanout) * src_pitch);
        U* t = (U*)(peers[r] + dst_offset + d * dst_pitch);
        for (i64 u = threadIdx.x; u < units; u += blockDim.x) t[u] = s[u];
    }
}

// out row i = src row index[i], or zeros where index[i] < 0
template <typename U>
__global__ void gather_rows(const unsigned char* src, i64 src_pitch, const i64* index, i64 num_rows,
                            unsigned char* out, i64 out_pitch, i64 row_bytes) {
    const i64 units = row_bytes / (i64)sizeof(U);
    for (i64 i = blockIdx.x; i < num_rows; i += gridDim.x) {
        const i64 k = index[i];
        U* o = (U*)(out + i * out_pitch);
        if (k < 0) {
            for (i64 u = threadIdx.x; u < units; u += blockDim.x) o[u] = U();
        } else {
            const U* s = (const U*)(src + k * src_pitch);
            for (i64 u = threadIdx.x; u < units; u += blockDim.x) o[u] = s[u];
        }
    }
}

extern "C" __global__ void signal_peers(const u64* peers, int num_ranks, int me, i64 signal_offset, i64 seq) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    __threadfence_system();
    if (r < num_ranks) store_release_sys((i64*)(peers[r] + signal_offset) + me, seq);
}

// One CTA. Rank s arrived when signal[s] == want (this step) or >= ahead (its next step).
// status: [want, missing total (sticky), missing flag per rank (sticky)]; counts (or NULL) of a rank
// that did not arrive are zeroed so that later kernels see an empty, well-formed block.
extern "C" __global__ void wait_signals(const i64* signals, int num_ranks, i64 want, i64 ahead, u64 timeout_ns,
                                        i64* status, i64* counts) {
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
            if (global_ns() - start > timeout_ns) break;
            __nanosleep(pause);
            if (pause < 4096) pause *= 2;
        }
        if (!arrived) {
            atomicAdd(&missing, 1);
            ((volatile i64*)status)[2 + s] = 1;
            if (counts) counts[s] = 0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ((volatile i64*)status)[1] += missing;
        __threadfence_system();
        ((volatile i64*)status)[0] = want;
    }
}
"""

_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def copy_unit(row_bytes: int, *addresses_and_pitches: int) -> int:
    """Widest copy unit (16, 8, 4, 2 or 1 bytes) dividing the row length and every address/pitch."""
    for unit in (16, 8, 4, 2):
        if row_bytes % unit == 0 and all(v % unit == 0 for v in addresses_and_pitches):
            return unit
    return 1


@functools.lru_cache(maxsize=None)
def _module(device: int):
    """The compiled kernels for CUDA device ``device`` (one RawModule, all copy units)."""
    import cupy

    names = [f"{kind}<{t}>" for kind in ("put_rows", "gather_rows") for t in _UNITS.values()]
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=_SOURCE, options=("--std=c++14",), name_expressions=names)


def _kernel(name: str):
    import cupy

    return _module(cupy.cuda.Device().id).get_function(name)


def _or_null(arr):
    """A device array kernel argument, or a NULL pointer for None."""
    return np.uint64(0) if arr is None else arr


def _raw(arr):
    """The same device memory as uint8 (kernels take rows as untyped pointers; C-contiguous arrays)."""
    import cupy

    return arr.reshape(-1).view(cupy.uint8)


def _grid(work: int, cap: int = 65535) -> int:
    return max(1, min(work, cap))


def put_rows(src, src_pitch: int, num_pairs: int, fanout: int, num_ranks: int, dst_rank, dst_row, peer_ptrs,
             dst_offset: int, dst_pitch: int, row_bytes: int) -> None:
    """Pair ``p``: local row ``p // fanout`` of ``src`` (C-contiguous device array, rows ``src_pitch``
    bytes apart) -> row ``dst_row[p]`` (int64, -1 skips) at ``dst_offset`` in the buffer of rank
    ``dst_rank[p]`` (int32; None: ``p % num_ranks``); ``row_bytes`` bytes each, on the current stream.
    ``peer_ptrs``: uint64 ``[R]`` base addresses of the ranks' buffers (peer views)."""
    if num_pairs == 0 or row_bytes == 0:
        return
    unit = copy_unit(row_bytes, int(src.data.ptr), src_pitch, dst_offset, dst_pitch)
    threads = min(PUT_THREADS, max(32, row_bytes // unit))
    _kernel(f"put_rows<{_UNITS[unit]}>")(
        (_grid(num_pairs),), (threads,),
        (_raw(src), np.int64(src_pitch), np.int64(num_pairs), np.int32(fanout), np.int32(num_ranks), _or_null(dst_rank), dst_row, peer_ptrs,
         np.int64(dst_offset), np.int64(dst_pitch), np.int64(row_bytes)))


def gather_rows(src, src_pitch: int, index, out, out_pitch: int, row_bytes: int) -> None:
    """``out`` row ``i`` (``out_pitch`` bytes apart) = ``src`` row ``index[i]`` (int64), zeros where -1."""
    num_rows = int(index.shape[0])
    if num_rows == 0 or row_bytes == 0:
        return
    unit = copy_unit(row_bytes, int(src.data.ptr), src_pitch, int(out.data.ptr), out_pitch)
    threads = min(PUT_THREADS, max(32, row_bytes // unit))
    _kernel(f"gather_rows<{_UNITS[unit]}>")(
        (_grid(num_rows),), (threads,),
        (_raw(src), np.int64(src_pitch), index, np.int64(num_rows), _raw(out), np.int64(out_pitch),
         np.int64(row_bytes)))


def signal_peers(peer_ptrs, num_ranks: int, me: int, signal_offset: int, seq: int) -> None:
    """After every earlier write on the stream: ``signal[me] = seq`` in every rank's buffer (release, system scope)."""
    _kernel("signal_peers")((1,), (max(32, -(-num_ranks // 32) * 32),),
                            (peer_ptrs, np.int32(num_ranks), np.int32(me), np.int64(signal_offset), np.int64(seq)))


def wait_signals(signals, num_ranks: int, want: int, ahead: int, timeout_s: float, status, counts=None) -> None:
    """Enqueue the bounded wait until ``signals[s] == want or >= ahead`` (int64 device view) for every
    ``s``; ``status`` is the mapped ``WaitStatus`` record; ``counts`` (int64 [R] or None) of missing
    ranks are zeroed."""
    _kernel("wait_signals")((1,), (WAIT_THREADS,),
                            (signals, np.int32(num_ranks), np.int64(want), np.int64(ahead),
                             np.uint64(int(timeout_s * 1e9)), status, _or_null(counts)))


@dataclass
class WaitOutcome:
    """What the host reads back from a status record."""

    last_seq: int  # the signal value of the last wait that finished
    missing_ranks: List[int]  # ranks that ever failed to arrive (sticky)


def read_status(words: Sequence[int], num_ranks: int) -> WaitOutcome:
    """Decode the int64 words ``[seq, missing total, flag per rank]`` of a status record."""
    flags = words[STATUS_FLAGS:STATUS_FLAGS + num_ranks]
    missing = [r for r, f in enumerate(flags) if f] if int(words[STATUS_MISSING]) > 0 else []
    return WaitOutcome(int(words[STATUS_SEQ]), missing)


class WaitStatus:
    """A status record in pinned, device-mapped host memory: ``2 + R`` int64 words, zero at start."""

    def __init__(self, num_ranks: int, device: Optional[int] = None):
        import cupy

        self.num_ranks = num_ranks
        nbytes = 8 * (STATUS_FLAGS + num_ranks)
        self._pinned = cupy.cuda.alloc_pinned_memory(nbytes)
        self.host = np.frombuffer(self._pinned, dtype=np.int64, count=STATUS_FLAGS + num_ranks)
        self.host[:] = 0
        device = cupy.cuda.Device().id if device is None else device
        mem = cupy.cuda.UnownedMemory(self._pinned.ptr, nbytes, self._pinned, device)
        self.device = cupy.ndarray((STATUS_FLAGS + num_ranks,), cupy.int64, cupy.cuda.MemoryPointer(mem, 0))

    def read(self) -> WaitOutcome:
        """The record as the device last wrote it (no synchronisation)."""
        return read_status(self.host.tolist(), self.num_ranks)
