"""Warp-level building blocks shared by every kernel: Kogge-Stone scans and match-based grouping.

All functions here are CUDA device functions that must be called by all 32 lanes of a warp
together (full mask): kernels never exit early before a warp collective.

Lane masks are uint32 and only ever built by :func:`ballot` and :func:`match_any`: Numba types the
raw intrinsics' results int32 and widens any arithmetic on them to int64, which sign-extends lane
31's bit into 32 phantom lanes (``popc`` then counts 33 where one lane is set).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.vector import load_pair, store_pair

FULL_MASK = 0xFFFFFFFF
WARP = 32
COPY_UNROLL = 8
SCAN_CHUNKS = 8


@cuda.jit(device=True)
def lane_id():
    """Lane of the calling thread in its warp (1-D blocks)."""
    return cuda.threadIdx.x % WARP


@cuda.jit(device=True)
def global_warp():
    """Index of the calling warp in the grid and the number of warps in the grid."""
    warps_per_block = cuda.blockDim.x // WARP
    return cuda.blockIdx.x * warps_per_block + cuda.threadIdx.x // WARP, cuda.gridDim.x * warps_per_block


@cuda.jit(device=True)
def warp_inclusive_sum(value, lane):
    """Kogge-Stone inclusive sum of an int32 ``value`` over the lanes of the warp (5 shuffle steps), as int32:
    kept 32-bit so that each step shuffles one register (Numba would widen the sum to int64, two)."""
    offset = 1
    while offset < WARP:
        other = cuda.shfl_up_sync(FULL_MASK, value, offset)
        if lane >= offset:
            value = np.int32(value + other)
        offset *= 2
    return value


@cuda.jit(device=True)
def load_or_zero(src, i, n, coherent):
    """``src[i]`` as int32, 0 past ``n``; ``coherent``: through ``ld.global.cv`` (global memory written by
    other blocks in this launch), else a plain load (shared memory, or global written before the launch)."""
    if i >= n:
        return np.int32(0)
    return np.int32(cuda.ldcv(src, i)) if coherent else np.int32(src[i])


@cuda.jit(device=True)
def scan_chunk(value, i, n, dst, exclusive, carry, lane):
    """Scan one 32-value chunk on top of ``carry`` into ``dst[i]`` (lane's slot); return the new carry."""
    inclusive = warp_inclusive_sum(value, lane)
    if i < n:
        dst[i] = carry + inclusive - (value if exclusive else 0)
    return carry + cuda.shfl_sync(FULL_MASK, inclusive, WARP - 1)


@cuda.jit(device=True)
def warp_scan(src, dst, n, exclusive, carry, coherent):
    """Prefix sum of ``src[:n]`` into ``dst[:n]`` by one warp, in chunks of 32 with a carried total.

    ``dst[i] = carry + src[0] + ... + src[i]`` (inclusive) or ``... + src[i-1]`` (exclusive).
    ``src`` is an integer array (possibly a strided view), global or shared; ``coherent`` when it is
    global memory that other blocks may have written in this launch. ``dst`` is int32, global or
    shared, and may be ``src``. ``SCAN_CHUNKS`` chunks are loaded before they are scanned, so their
    load latencies overlap: a scan of up to 256 values costs one memory round trip; chunks wholly
    past ``n`` are neither loaded nor scanned. Returns ``carry + sum(src[:n])`` on every lane.
    """
    lane = lane_id()
    values = cuda.local.array(SCAN_CHUNKS, int32)
    for first in range(0, n, SCAN_CHUNKS * WARP):  # the same trip count on every lane: the scans are collectives
        for c in range(SCAN_CHUNKS):
            values[c] = load_or_zero(src, first + c * WARP + lane, n, coherent)
        for c in range(SCAN_CHUNKS):
            if first + c * WARP < n:  # chunks wholly past n add nothing (the test is the same on every lane)
                carry = scan_chunk(values[c], first + c * WARP + lane, n, dst, exclusive, carry, lane)
    return carry


@cuda.jit(device=True)
def ballot(predicate):
    """uint32 mask of the lanes whose ``predicate`` holds."""
    return np.uint32(cuda.ballot_sync(FULL_MASK, predicate))


@cuda.jit(device=True)
def match_any(key):
    """uint32 mask of the lanes holding the same ``key`` as this lane."""
    return np.uint32(cuda.match_any_sync(FULL_MASK, key))


@cuda.jit(device=True)
def count_lanes(mask):
    """Number of lanes set in a uint32 lane mask, as int32."""
    return np.int32(cuda.popc(np.uint32(mask)))


@cuda.jit(device=True)
def lanes_below(lane):
    """Bit mask of the lanes with a lower index than ``lane``."""
    return (np.uint32(1) << np.uint32(lane)) - np.uint32(1)


@cuda.jit(device=True)
def lowest_lane(mask):
    """Lowest lane set in a non-zero 32-bit lane mask."""
    return np.int32(cuda.ffs(np.uint32(mask))) - 1


@cuda.jit(device=True)
def is_group_leader(key, lane):
    """True on the lowest lane among those holding the same ``key`` (deduplication)."""
    return lowest_lane(match_any(key)) == lane


@cuda.jit(device=True)
def bucket_rank(bucket, active, lane):
    """``(below, same)``: the number of active lanes below this one with its ``bucket``, and the uint32 mask of the
    active lanes with its bucket (lanes are in item order, so ``below`` is the item's place in its bucket). Call
    with all lanes of the warp."""
    key = bucket if active else -1 - lane
    same = np.uint32(match_any(key) & ballot(active))
    return count_lanes(same & lanes_below(lane)), same


@cuda.jit(device=True)
def stable_bucket_slots(cursor, bucket, active, lane):
    """Stable slots for the active lanes of a warp, bucket by bucket, from a per-bucket cursor.

    Active lane ``j`` with bucket ``b`` gets ``cursor[b]`` plus the number of active lanes below
    ``j`` with the same bucket (:func:`bucket_rank`); afterwards
    ``cursor[b]`` has advanced past this warp's items of bucket ``b``. ``cursor`` is owned by this
    warp (int32, global). Returns the slot, -1 on inactive lanes.
    """
    below, same = bucket_rank(bucket, active, lane)
    slot = np.int32(-1)
    if active:
        slot = cursor[bucket] + below
    cuda.syncwarp(FULL_MASK)
    if active and lane == WARP - 1 - np.int32(cuda.clz(same)):
        cursor[bucket] += count_lanes(same)
    cuda.syncwarp(FULL_MASK)
    return slot


@cuda.jit(device=True)
def load_words(src, i, wide):
    """``(src[i], src[i + 1])`` in one 2-word load when ``wide``, else ``(src[i], src[i])``."""
    if wide:
        return load_pair(src, i)
    return src[i], src[i]


@cuda.jit(device=True)
def store_words(dst, i, words, wide):
    """Store what :func:`load_words` loaded at ``i``: both words when ``wide``, else the first."""
    if wide:
        store_pair(dst, i, words[0], words[1])
    else:
        dst[i] = words[0]


@cuda.jit(device=True)
def load_words_below(src, i, n, wide):
    """:func:`load_words` at ``i``, or at the last access below ``n`` when ``i`` is past it: a reload
    inside the row whose words are never stored, so that a row's tail needs no separate loop."""
    return load_words(src, min(i, n - (2 if wide else 1)), wide)


@cuda.jit(device=True)
def store_words_below(dst, i, n, words, wide):
    """:func:`store_words` at ``i`` if ``i`` is below ``n``."""
    if i < n:
        store_words(dst, i, words, wide)


@cuda.jit(device=True)
def copy_row(dst, src, n, wide):
    """Copy words ``src[:n]`` into ``dst[:n]`` with the lanes of one warp (coalesced).

    ``wide``: every lane moves two adjacent words per access (16 bytes for 64-bit words); ``n``
    must then be even and both rows aligned to two words. Eight loads per lane are issued before
    their stores: the compiler cannot hoist loads above stores to a possibly aliasing ``dst`` by
    itself, and one load in flight per warp is far too few to keep HBM or NVLink busy. The tail
    takes the same eight-access step (accesses past ``n`` reload inside the row and store nothing),
    so every ``COPY_UNROLL * 32`` accesses or fewer cost one memory round trip.
    """
    width = 2 if wide else 1
    lane_step = WARP * width
    base = np.int32(lane_id() * width)
    while base < n:
        w0 = load_words_below(src, base, n, wide)
        w1 = load_words_below(src, base + lane_step, n, wide)
        w2 = load_words_below(src, base + 2 * lane_step, n, wide)
        w3 = load_words_below(src, base + 3 * lane_step, n, wide)
        w4 = load_words_below(src, base + 4 * lane_step, n, wide)
        w5 = load_words_below(src, base + 5 * lane_step, n, wide)
        w6 = load_words_below(src, base + 6 * lane_step, n, wide)
        w7 = load_words_below(src, base + 7 * lane_step, n, wide)
        store_words_below(dst, base, n, w0, wide)
        store_words_below(dst, base + lane_step, n, w1, wide)
        store_words_below(dst, base + 2 * lane_step, n, w2, wide)
        store_words_below(dst, base + 3 * lane_step, n, w3, wide)
        store_words_below(dst, base + 4 * lane_step, n, w4, wide)
        store_words_below(dst, base + 5 * lane_step, n, w5, wide)
        store_words_below(dst, base + 6 * lane_step, n, w6, wide)
        store_words_below(dst, base + 7 * lane_step, n, w7, wide)
        base = np.int32(base + COPY_UNROLL * lane_step)


@cuda.jit(device=True)
def pop_lowest(mask):
    """Split a non-zero uint32 lane mask into its lowest lane and the mask without it."""
    return lowest_lane(mask), np.uint32(mask & (mask - np.uint32(1)))
