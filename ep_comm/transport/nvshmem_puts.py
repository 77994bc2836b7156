"""Sending through NVSHMEM device puts instead of peer-view stores (peers without P2P).

Same operations and arguments as ``gpu_copy.put_rows`` / ``gpu_copy.signal_peers``, written as
Numba kernels calling nvshmem4py's device API: ``put_nbi_block`` of each row to its symmetric
address on the destination PE, ``nvshmem_quiet`` at the end of every CTA (so every row has
landed when the kernel ends), then a later kernel writes each peer's ``signal[me]`` with
``nvshmem_p``. Kernels that call NVSHMEM device functions cannot be cached on disk: the first
call in a process compiles them (~10 s). The NVSHMEM world equals the communicator, so a rank
is its PE. Source rows must be reachable by the transport (true for P2P and the local GPU).
"""
from __future__ import annotations

import functools
import warnings

import numpy as np

from .gpu_copy import PUT_THREADS


@functools.lru_cache(maxsize=None)
def _kernels():
    """``(put_rows_kernel, signal_kernel)``, compiled lazily on first use."""
    from numba import cuda, int32
    import nvshmem.core.device.numba as nvd
    from nvshmem.bindings.device.numba import quiet

    @cuda.jit
    def put_rows_kernel(src, src_pitch, num_pairs, fanout, num_ranks, dst_rank, has_rank, dst_row, sym, dst_offset,
                        dst_pitch, row_bytes):
        p = cuda.blockIdx.x
        while p < num_pairs:
            d = dst_row[p]
            if d >= 0:
                r = dst_rank[p] if has_rank else p % num_ranks
                s0 = (p // fanout) * src_pitch
                t0 = dst_offset + d * dst_pitch
                nvd.put_nbi_block(sym[t0:t0 + row_bytes], src[s0:s0 + row_bytes], int32(r))
            p += cuda.gridDim.x
        quiet()

    @cuda.jit
    def signal_kernel(signals, num_ranks, me, seq):
        r = cuda.threadIdx.x
        if r < num_ranks:
            nvd.p(signals[me:me + 1], seq, int32(r))

    return put_rows_kernel, signal_kernel


def _numba(arr):
    """Zero-copy Numba view of a CuPy array."""
    from numba import cuda

    return cuda.as_cuda_array(arr)


def _stream():
    import cupy
    from numba import cuda

    return cuda.external_stream(cupy.cuda.get_current_stream().ptr)


def _launch(kernel, grid: int, block: int, *args) -> None:
    """Launch on the current CuPy stream; one CTA per row pair is the intended grid, so Numba's
    low-occupancy warning is silenced."""
    from numba.cuda.core.errors import NumbaPerformanceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        kernel[grid, block, _stream()](*args)


def put_rows(src, src_pitch: int, num_pairs: int, fanout: int, num_ranks: int, dst_rank, dst_row, sym_local,
             dst_offset: int, dst_pitch: int, row_bytes: int) -> None:
    """``gpu_copy.put_rows`` through ``nvshmem_put_nbi_block``; ``src`` is a C-contiguous device
    array (any dtype) and ``sym_local`` this rank's uint8 symmetric buffer (the symmetric address)."""
    import cupy

    if num_pairs == 0 or row_bytes == 0:
        return
    put_rows_kernel, _ = _kernels()
    has_rank = dst_rank is not None
    ranks = dst_rank if has_rank else cupy.zeros(1, dtype=cupy.int32)
    src_bytes = src.reshape(-1).view(cupy.uint8)
    grid = max(1, min(num_pairs, 65535))
    _launch(put_rows_kernel, grid, PUT_THREADS,
            _numba(src_bytes), np.int64(src_pitch), np.int64(num_pairs), np.int64(fanout), np.int64(num_ranks),
            _numba(ranks), has_rank, _numba(dst_row), _numba(sym_local), np.int64(dst_offset), np.int64(dst_pitch),
            np.int64(row_bytes))


def signal_peers(signals_local, num_ranks: int, me: int, seq: int) -> None:
    """After every earlier put on the stream: ``signal[me] = seq`` on every PE (``signals_local``:
    this rank's int64 ``signal[R]`` view, the symmetric address)."""
    _, signal_kernel = _kernels()
    _launch(signal_kernel, 1, max(32, -(-num_ranks // 32) * 32),
            _numba(signals_local), np.int64(num_ranks), np.int64(me), np.int64(seq))
