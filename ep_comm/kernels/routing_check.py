"""Routing check: the largest expert id of ``topk_idx`` and the first token that names an expert twice.

The count kernel checks its routing while it counts (``count.py``); ``routing_check_kernel`` does the same
check in a launch of its own, for the argument check of ``Buffer.dispatch`` (one device read instead of a
dozen array operations).

Each thread keeps its own ``(top, first)``, a block folds them by warp shuffles and in shared memory
(:func:`fold_check`), one global atomic per block goes into a persistent accumulator, and the last block to
arrive (``ticket.py``)
takes the grid's result out and resets the accumulator for the next launch (:func:`grid_check`). A grid
of one block keeps its result in shared memory and leaves the accumulator alone. With ``fold`` the
result is folded into ``out`` (the larger of each) instead: a sticky record for checks that nobody reads
at once (a dispatch captured into a CUDA graph).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ep_comm.contract.protocol import ID_CLAMP
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.switches import legacy
from ep_comm.kernels.ticket import last_block_to_arrive
from ep_comm.kernels.warp import FULL_MASK, WARP, lane_id, lanes_below, match_any

NO_ROW = np.int64(1) << np.int64(62)  # "no repeated row yet": above any token index
ACC_INIT = (-1, int(NO_ROW))  # what the accumulator holds between launches
WARP_FOLD = not legacy("warp_fold")  # a compile-time constant of the kernels


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


@cuda.jit(device=True)
def repeats_an_earlier_lane(entry, item_lanes, lane):
    """Whether the int64 id ``entry`` (negative: none) of this lane is valid and also held by a lower lane of
    ``item_lanes`` (the uint32 lanes of its token): one 64-bit match. Call with all lanes of the warp."""
    key = entry if entry >= 0 else np.int64(-1 - lane)  # "none" matches no other lane
    earlier = match_any(key) & item_lanes & lanes_below(lane)  # on every lane: a collective
    return entry >= 0 and earlier != 0


@cuda.jit(device=True)
def start_check(block_check):
    """Thread 0: the block's ``(top, first)`` (int64 ``[2]``, shared) := :data:`ACC_INIT`; sync before use."""
    if cuda.threadIdx.x == 0:
        block_check[0] = np.int64(-1)
        block_check[1] = NO_ROW


@cuda.jit(device=True)
def warp_fold(top, first):
    """``(largest top, smallest first)`` over the lanes of the warp, on every lane: five xor-shuffle steps of each
    (int64: two 32-bit shuffles a step). Call with all lanes of the warp."""
    offset = WARP // 2
    while offset > 0:
        top = max(top, cuda.shfl_xor_sync(FULL_MASK, top, offset))
        first = min(first, cuda.shfl_xor_sync(FULL_MASK, first, offset))
        offset //= 2
    return top, first


@cuda.jit(device=True)
def fold_check(top, first, block_check, acc):
    """Fold this thread's largest id ``top`` and first repeated row ``first`` (:data:`NO_ROW`: none) into the
    block's ``block_check``, sync the block, then (more than one block) fold the block's into the grid's
    accumulator ``acc`` (int64 ``[2]``, global): before the last-block ticket, whose fence orders it.
    Each warp folds its lanes' by shuffles first and lane 0 adds the warp's (two shared atomics per warp, not per
    thread; ``EP_COMM_KERNEL_LEGACY=warp_fold``: per thread). Call from all threads of the block (whole warps)."""
    if WARP_FOLD:
        top, first = warp_fold(top, first)
    if top >= 0 and (not WARP_FOLD or lane_id() == 0):
        cuda.atomic.max(block_check, 0, top)
    if first < NO_ROW and (not WARP_FOLD or lane_id() == 0):
        cuda.atomic.min(block_check, 1, first)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and cuda.gridDim.x > 1:
        cuda.atomic.max(acc, 0, block_check[0])
        cuda.atomic.min(acc, 1, block_check[1])


@cuda.jit(device=True)
def grid_check(block_check, acc):
    """In the last block to arrive: the grid's ``(top, first)`` into ``block_check`` (in every thread after the
    sync), resetting ``acc`` to :data:`ACC_INIT` (a grid of one block: its own, ``acc`` untouched).
    Returns ``(largest id or -1, first repeated row or -1)``. Call from all threads of the block."""
    if cuda.threadIdx.x == 0 and cuda.gridDim.x > 1:
        top = cuda.atomic.exch(acc, 0, np.int64(-1))
        first = cuda.atomic.exch(acc, 1, NO_ROW)  # before either store: both atomics in flight together
        block_check[0] = top
        block_check[1] = first
    cuda.syncthreads()
    first = block_check[1]
    return block_check[0], first if first < NO_ROW else np.int64(-1)


@cuda.jit(device=True)
def verdict_words(top, twice):
    """The two verdict words of ``(largest id or -1, first repeated row or -1)``, as int32:
    ``ep_comm.contract.checks.verdict_words`` (``min(top + 1, ID_CLAMP)`` without overflowing at the int64 maximum)."""
    return np.int32(min(top, np.int64(ID_CLAMP - 1)) + 1), np.int32(twice + 1)


@cuda.jit(device=True)
def bad_verdict(top_word, twice_word, num_experts):
    """Whether a rank's two verdict words (:func:`verdict_words`) tell a bad routing: an id at or above
    ``num_experts``, or a row naming an expert twice (``ep_comm.contract.checks.routing_error``'s rule)."""
    return top_word > num_experts or twice_word > 0


@kernel
def routing_check_kernel(topk_idx, acc, ticket, out, fold):
    """``topk_idx [T, K]`` any signed int; ``acc`` int64[2] holding :data:`ACC_INIT` between launches;
    ``ticket`` uint32[1]; ``out`` int64[2] := (largest id or -1, first repeated row or -1), or with
    ``fold`` the elementwise maximum of ``out`` and those."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    block_check = cuda.shared.array(2, int64)
    start_check(block_check)
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
    fold_check(top, first, block_check, acc)
    if last_block_to_arrive(ticket):
        top, twice = grid_check(block_check, acc)
        if cuda.threadIdx.x == 0:
            out[0] = max(out[0], top) if fold else top
            out[1] = max(out[1], twice) if fold else twice
