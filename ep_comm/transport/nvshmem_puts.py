"""Sending through NVSHMEM device puts instead of peer-view stores (peers without P2P).

With puts, the kernels of ``ep_comm.kernels`` write each destination's rows into a local staging
block (see ``NvshmemTransport``); then ``put_blocks`` sends every destination its block, one
contiguous run of ``count`` rows, with ``put_nbi_block`` in chunks, and ``nvshmem_quiet`` at the
end of every CTA (so every byte has landed when the kernel ends); a later kernel
(``signal_peers``) writes each peer's count block (optional) and ``signal[me]`` with ``nvshmem_p``.
The kernels (``ep_comm.kernels.puts``) call NVSHMEM device functions, so they cannot be cached on disk:
the first call in a process compiles them (~10 s). The NVSHMEM world equals the communicator, so a rank
is its PE. Staging blocks live in the symmetric heap, so every transport can read them.
"""
from __future__ import annotations

import numpy as np

from ep_comm.kernels.puts import CHUNK_BYTES, put_kernels

PUT_THREADS = 256
MAX_PUT_CTAS = 1024


def put_blocks(stream, stage, first_block: int, block_bytes: int, sym, dst_offset: int, row_bytes: int, psum) -> None:
    """Rank ``r`` gets ``psum[r] - psum[r-1]`` rows of ``row_bytes`` from staging block ``first_block + r``
    (``stage``: uint8 Numba device array over the symmetric heap, blocks ``block_bytes`` apart) at byte
    ``dst_offset`` of its copy of ``sym`` (this rank's uint8 symmetric buffer, the symmetric address).
    ``psum``: int32 ``[R]`` inclusive prefix sum on the device. Launched on Numba stream ``stream``."""
    put_blocks_kernel, _ = put_kernels()
    chunks = max(1, -(-block_bytes // CHUNK_BYTES))
    grid = max(1, min(psum.shape[0] * chunks, MAX_PUT_CTAS))
    put_blocks_kernel[grid, PUT_THREADS, stream](stage, np.int64(first_block), np.int64(block_bytes), sym,
                                                 np.int64(dst_offset), np.int64(row_bytes), psum, np.int64(chunks))


def signal_peers(stream, signals, count_words, num_ranks: int, me: int, seq: int, counts=None) -> None:
    """After every earlier put on the stream: ``signal[me] = seq`` on every PE (``signals``: this rank's
    int64 ``[R]`` signal words, the symmetric address). With ``counts`` (int32 ``[R, 1 + L + 2]``: per destination
    its rows, its entries per local expert, the routing verdict), first ``count_words[me] = counts[r]`` on PE ``r``
    (``count_words``: int64 ``[R, 1 + L + 2]`` symmetric words, the step's parity; not written without ``counts``)."""
    _, signal_kernel = put_kernels()
    has_counts = counts is not None
    signal_kernel[1, max(32, -(-num_ranks // 32) * 32), stream](
        signals, count_words, counts if has_counts else count_words, has_counts, np.int64(num_ranks), np.int64(me),
        np.int64(seq))
