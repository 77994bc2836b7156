"""Routing check in one launch: the largest expert id of ``topk_idx`` and the first token that names an
expert twice, for the argument check of ``Buffer.dispatch`` (one device read instead of a dozen
array operations).

One thread per token (grid-stride), a block-wide reduction in shared memory, one global atomic per
block into a persistent accumulator, and the last block to arrive (``ticket.py``) moves the result
out and resets the accumulator for the next launch. With ``fold`` the result is folded into ``out``
(the larger of each) instead: a sticky record for checks that nobody reads at once (a dispatch
captured into a CUDA graph).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ep_comm.kernels.jit import kernel
from ep_comm.kernels.ticket import last_block_to_arrive

NO_ROW = np.int64(1) << np.int64(62)  # "no repeated row yet": above any token index
ACC_INIT = (-1, int(NO_ROW))  # what the accumulator holds between launches


@cuda.jit(device=True)
def token_check(topk_idx, t):
    """``(largest id of token t, whether a valid id appears twice in its row)``."""
    top = np.int64(-1)
    repeated = False
    for i in range(topk_idx.shape[1]):
        e = np.int64(topk_idx[t, i])
        top = max(top, e)
        if e >= 0:
            for j in range(i):
                if np.int64(topk_idx[t, j]) == e:
                    repeated = True
    return top, repeated


@kernel
def routing_check_kernel(topk_idx, acc, ticket, out, fold):
    """``topk_idx [T, K]`` any signed int; ``acc`` int64[2] holding :data:`ACC_INIT` between launches;
    ``ticket`` uint32[1]; ``out`` int64[2] := (largest id or -1, first repeated row or -1), or with
    ``fold`` the elementwise maximum of ``out`` and those."""
    block_top = cuda.shared.array(1, int64)
    block_first = cuda.shared.array(1, int64)
    if cuda.threadIdx.x == 0:
        block_top[0] = np.int64(-1)
        block_first[0] = NO_ROW
    cuda.syncthreads()
    top = np.int64(-1)
    first = NO_ROW
    t = np.int32(cuda.grid(1))
    while t < topk_idx.shape[0]:  # not a range: its run-time step would divide for the trip count
        token_top, repeated = token_check(topk_idx, t)
        top = max(top, token_top)
        if repeated and t < first:
            first = np.int64(t)
        t = np.int32(t + cuda.gridsize(1))
    cuda.atomic.max(block_top, 0, top)
    cuda.atomic.min(block_first, 0, first)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.atomic.max(acc, 0, block_top[0])
        cuda.atomic.min(acc, 1, block_first[0])
    if last_block_to_arrive(ticket) and cuda.threadIdx.x == 0:
        top = cuda.atomic.exch(acc, 0, np.int64(-1))
        found = cuda.atomic.exch(acc, 1, NO_ROW)
        first = found if found < NO_ROW else np.int64(-1)
        out[0] = max(out[0], top) if fold else top
        out[1] = max(out[1], first) if fold else first
