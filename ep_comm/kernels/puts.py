"""The NVSHMEM puts' two Numba kernels: ``put_blocks_kernel`` sends each destination reached through puts its
staging block with ``put_nbi_block`` in chunks of :data:`CHUNK_BYTES`, then ``nvshmem_quiet``; ``signal_kernel`` writes
each such peer's count block (optional) and ``signal[me]`` with ``nvshmem_p``. Both take the step's parity and number
from the device step counter (as the stores do), so a CUDA graph can replay them. The host side is
``ep_comm.transport.nvshmem_puts``.

They call NVSHMEM device functions, so they cannot use the ``@kernel`` disk cache (``jit.py``: Numba cannot pickle
their linked code): :func:`put_kernels` compiles them on first use (~10 s per process). Importing this module
imports neither NVSHMEM nor Numba.
"""
from __future__ import annotations

import functools

CHUNK_BYTES = 256 << 10


@functools.lru_cache(maxsize=None)
def put_kernels():
    """``(put_blocks_kernel, signal_kernel)``, compiled lazily on first use."""
    import nvshmem.core.device.numba as nvd
    from numba import cuda, int32, int64
    from nvshmem.bindings.device.numba import quiet

    @cuda.jit
    def put_blocks_kernel(stage, block_bytes, sym, dst_offset, parity_bytes, step, row_bytes, psum, remote, me, chunks):
        num_ranks = psum.shape[0]
        parity = (step[0] + 1) & 1  # the step the next signal starts (senders run before it)
        first_block = me + parity * num_ranks
        job = cuda.blockIdx.x
        while job < num_ranks * chunks:
            r = job // chunks
            begin = (job - r * chunks) * CHUNK_BYTES
            rows = psum[r] - (psum[r - 1] if r > 0 else 0)
            end = min(begin + CHUNK_BYTES, rows * row_bytes)
            if remote[r] != 0 and begin < end:
                s0 = (first_block + r) * block_bytes + begin
                t0 = dst_offset + parity * parity_bytes + begin
                nvd.put_nbi_block(sym[t0:t0 + end - begin], stage[s0:s0 + end - begin], int32(r))
            job += cuda.gridDim.x
        quiet()

    @cuda.jit
    def signal_kernel(signals, count_words, counts, has_counts, remote, me, step, kind):
        r = cuda.threadIdx.x
        seq = step[0]  # the stores' signal launch advanced the counter to this step
        if r < remote.shape[0] and remote[r] != 0:
            if has_counts:
                for w in range(count_words.shape[2]):
                    nvd.p(count_words[seq & 1, me, w:w + 1], int64(counts[r, w]), int32(r))
                quiet()
            nvd.p(signals[me:me + 1], (seq << 2) | kind, int32(r))

    return put_blocks_kernel, signal_kernel
