"""Sending through NVSHMEM device puts to the peers out of load/store reach (or to every rank, ``transport="puts"``).

For a destination reached through puts, the kernels of ``ep_comm.kernels`` write its rows into a local staging
block (``staging``); then ``put_blocks`` sends every such destination its block, one contiguous run of ``count`` rows,
with ``put_nbi_block`` in chunks, and ``nvshmem_quiet`` at the end of every CTA (so every byte has landed when the
kernel ends); after the stores' signal launch (which advances the device step counter), ``signal_peers`` writes each
such peer's count block (optional) and ``signal[me]`` with ``nvshmem_p``. Both read the step from the device counter,
so a CUDA graph replays them. The kernels (``ep_comm.kernels.puts``) call NVSHMEM device functions, so they cannot be
cached on disk: the first call in a process compiles them (~10 s); later calls launch them pre-bound
(``ep_comm._launcher.prebound.prebound_kernel``), without Numba's dispatcher. The NVSHMEM world equals the communicator, so a rank
is its PE. Staging blocks live in the symmetric heap, so every transport can read them.
"""
from __future__ import annotations

import numpy as np

from ep_comm.kernels.puts import CHUNK_BYTES, put_kernels

PUT_THREADS = 256
MAX_PUT_CTAS = 1024


def put_blocks(stream, device: int, stage, block_bytes: int, sym, dst_offset: int, parity_bytes: int, step,
               row_bytes: int, psum, remote, me: int) -> None:
    """Every rank ``r`` with ``remote[r]`` gets ``psum[r] - psum[r-1]`` rows of ``row_bytes`` from staging block
    ``me + parity * R + r`` (``stage``: uint8 Numba device array over the symmetric heap, blocks ``block_bytes``
    apart) at byte ``dst_offset + parity * parity_bytes`` of its copy of ``sym`` (this rank's uint8 symmetric buffer,
    the symmetric address), ``parity`` that of step ``step[0] + 1`` (``step``: the int64 ``[1]`` device step counter;
    the puts run before the step's signal). ``psum``: int32 ``[R]`` inclusive prefix sum on the device; ``remote``:
    uint8 ``[R]``, 1 for the ranks reached through puts. Launched on Numba stream ``stream`` of CUDA device ``device``
    (arrays: CuPy or Numba)."""
    from ep_comm._launcher.prebound import prebound_kernel  # imports Numba: importing this module does not

    put_blocks_kernel, _ = put_kernels()
    chunks = max(1, -(-block_bytes // CHUNK_BYTES))
    grid = max(1, min(psum.shape[0] * chunks, MAX_PUT_CTAS))
    prebound_kernel(put_blocks_kernel, device)(grid, PUT_THREADS, stream, 0, stage, np.int64(block_bytes), sym,
                                            np.int64(dst_offset), np.int64(parity_bytes), step, np.int64(row_bytes),
                                            psum, remote, np.int64(me), np.int64(chunks))


def signal_peers(stream, device: int, signals, count_words, remote, me: int, step, kind: int, counts=None) -> None:
    """After every earlier put on the stream: ``signal[me] = step[0] << 2 | kind`` on every PE ``r`` with ``remote[r]``
    (``signals``: this rank's int64 ``[R]`` signal words, the symmetric address; ``step``: the device step counter,
    which the stores' signal launch advanced to this step). With ``counts`` (int32 ``[R, 1 + L + 2]``: per destination
    its rows, its entries per local expert, the routing verdict), first ``count_words[parity, me] = counts[r]`` on PE
    ``r`` (``count_words``: int64 ``[2, R, 1 + L + 2]`` symmetric words; not written without ``counts``, whose place a
    ``[R, 1 + L + 2]`` block of them takes then, never read). Launched as :func:`put_blocks`."""
    from ep_comm._launcher.prebound import prebound_kernel  # as in put_blocks

    _, signal_kernel = put_kernels()
    num_ranks = remote.shape[0]
    has_counts = counts is not None
    prebound_kernel(signal_kernel, device)(
        1, max(32, -(-num_ranks // 32) * 32), stream, 0, signals, count_words,
        counts if has_counts else count_words[0], has_counts, remote, np.int64(me), step, np.int64(kind))
