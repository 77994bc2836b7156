"""Grid-wide reduction without spinning: 64-bit arrival-encoded counters and a last-block ticket.

Every block adds ``(1 << 32) | count`` to each global counter (high word: blocks arrived, low
word: the count; nothing where its count is 0: the high word is never read), fences, and takes a ticket.
The block that draws the last ticket does the
grid-wide epilogue and leaves counters and ticket at zero for the next launch. No block ever
waits for another, so this also runs in the simulator, which runs one block at a time. A grid of
one block (decode sizes) skips all of it: its histogram is already the total (:func:`block_totals`).

The fences: the block's threads meet at a barrier, then one thread fences (release: the barrier orders every
thread's writes before it, as in a cooperative grid barrier), draws the ticket and, in the last block, fences again
(acquire) before the barrier that lets the block read what the others wrote. ``EP_COMM_KERNEL_LEGACY=one_fence``
(``ep_comm.kernels.switches``) puts back a fence in every thread and the zero bins' atomics.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.switches import legacy

ARRIVED = np.int64(1) << np.int64(32)
LOW_WORD = np.int64(0xFFFFFFFF)
ONE_FENCE = not legacy("one_fence")  # a compile-time constant of the kernels


@cuda.jit(device=True)
def flush_counters(hist, counters):
    """Add the block's int32 histogram ``hist[n]`` to the global int64 ``counters[n]``, arrival-encoded (the
    bins that are 0: nothing, unless ``one_fence`` is switched back)."""
    i = cuda.threadIdx.x
    while i < hist.shape[0]:
        if hist[i] != 0 or not ONE_FENCE:
            cuda.atomic.add(counters, i, ARRIVED | np.int64(hist[i]))
        i = np.int32(i + cuda.blockDim.x)


@cuda.jit(device=True)
def last_block_to_arrive(ticket):
    """Fence this block's global writes and draw a ticket (``ticket`` is uint32[1]).

    Returns True in every thread of the last block to arrive, which also resets the ticket; there the
    other blocks' writes are visible to every thread afterwards. Call it from all threads of the block.
    """
    is_last = cuda.shared.array(1, int32)
    if not ONE_FENCE:
        cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        if ONE_FENCE:
            cuda.threadfence()  # release: every thread's writes, ordered before it by the barrier
        drawn = cuda.atomic.add(ticket, 0, np.uint32(1))
        is_last[0] = 1 if drawn == cuda.gridDim.x - 1 else 0
        if is_last[0]:
            ticket[0] = np.uint32(0)
            if ONE_FENCE:
                cuda.threadfence()  # acquire: the other blocks' writes, for every thread after the barrier
    cuda.syncthreads()
    return is_last[0] != 0


@cuda.jit(device=True)
def drain_counters(counters, out):
    """In the last block: move the counts out of ``counters[n]`` into int32 ``out[n]``, zeroing them."""
    i = cuda.threadIdx.x
    while i < out.shape[0]:
        out[i] = np.int32(cuda.atomic.exch(counters, i, np.int64(0)) & LOW_WORD)
        i = np.int32(i + cuda.blockDim.x)
    if not ONE_FENCE:
        cuda.threadfence()
    cuda.syncthreads()


@cuda.jit(device=True)
def block_totals(hist, counters, ticket):
    """Leave the grid-wide totals of every block's int32 histogram ``hist[n]`` (shared) in the ``hist`` of
    one block, and return True in every thread of that block (False elsewhere): the last block to
    arrive (flush, ticket, drain), or with a grid of one block that block at once, without a global
    round trip (``counters`` and ``ticket`` stay untouched at zero). Call it from all threads of the block.
    """
    if cuda.gridDim.x == 1:
        cuda.syncthreads()  # the block's global writes are visible to all of its threads after it
        return True
    flush_counters(hist, counters)
    if not last_block_to_arrive(ticket):
        return False
    drain_counters(counters, hist)
    return True
