"""Grid-wide reduction without spinning: 64-bit arrival-encoded counters and a last-block ticket.

Every block adds ``(1 << 32) | count`` to each global counter (high word: blocks arrived, low
word: the count), fences, and takes a ticket. The block that draws the last ticket does the
grid-wide epilogue and leaves counters and ticket at zero for the next launch. No block ever
waits for another, so this also runs in the simulator, which runs one block at a time.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

ARRIVED = np.int64(1) << np.int64(32)
LOW_WORD = np.int64(0xFFFFFFFF)


@cuda.jit(device=True)
def flush_counters(hist, counters):
    """Add the block's int32 histogram ``hist[n]`` to the global int64 ``counters[n]``, arrival-encoded."""
    for i in range(cuda.threadIdx.x, hist.shape[0], cuda.blockDim.x):
        cuda.atomic.add(counters, i, ARRIVED | np.int64(hist[i]))


@cuda.jit(device=True)
def last_block_to_arrive(ticket):
    """Fence this block's global writes and draw a ticket (``ticket`` is uint32[1]).

    Returns True in every thread of the last block to arrive, which also resets the ticket.
    Call it from all threads of the block.
    """
    is_last = cuda.shared.array(1, int32)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        drawn = cuda.atomic.add(ticket, 0, np.uint32(1))
        is_last[0] = 1 if drawn == cuda.gridDim.x - 1 else 0
        if is_last[0]:
            ticket[0] = np.uint32(0)
    cuda.syncthreads()
    return is_last[0] != 0


@cuda.jit(device=True)
def drain_counters(counters, out):
    """In the last block: move the counts out of ``counters[n]`` into int32 ``out[n]``, zeroing them."""
    for i in range(cuda.threadIdx.x, out.shape[0], cuda.blockDim.x):
        out[i] = np.int32(cuda.atomic.exch(counters, i, np.int64(0)) & LOW_WORD)
    cuda.threadfence()
    cuda.syncthreads()
