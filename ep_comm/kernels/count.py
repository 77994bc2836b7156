"""Sender-side count in one block: histograms, prefix sums, ``is_token_in_rank`` and the stable slots.

A counting sort of the (token, destination rank) pairs that needs no global counters: one block of
``W`` warps, warp ``w`` owning the ``w``-th of ``W`` even, contiguous token ranges, one token per lane in
chunks of 32 tokens. Pass 1 reads the routing once (a token's entries loaded together), counts each
warp's tokens per rank (a ballot per rank, shared ``[W, R]``), the per-expert histogram (shared
atomics) and ``is_token_in_rank``, and keeps each entry's rank as a byte in shared memory (the *rank
cache*, as many tokens as fit); one warp per rank scans the warps' counts; pass 2 gives each (token,
rank) pair its slot from the cached ranks (tokens past the cache re-read the routing): the warp's
start plus the earlier chunks' pairs plus the lanes below with the same rank. So a slot is the
number of earlier tokens going to the same rank, the order ``deterministic=True`` promises, at no
extra cost.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from ep_comm.kernels.jit import kernel
from ep_comm.kernels.routing import routed_expert
from ep_comm.kernels.units import unit_range
from ep_comm.kernels.warp import (FULL_MASK, WARP, ballot, count_lanes, lane_id, lanes_below, warp_inclusive_sum,
                                  warp_scan)

LOAD_UNROLL = 8  # top-k entries a lane loads before it uses any (a literal trip count: unrolled)
RANKS_PER_WORD = 4  # cached entry ranks per int32 word of the rank cache, a byte each (rank + 1, 0: none)
MAX_CACHED_RANKS = 127  # ranks that fit the cache's bytes while a word stays a non-negative int32


@cuda.jit(device=True)
def cache_word(cache, t, k0, cached_tokens, num_topk):
    """The rank-cache word of token ``t`` that holds entries ``k0 .. k0 + 3`` (``k0 % 4 == 0``), -1 when
    the token is not cached (cached words are never negative)."""
    if t >= cached_tokens:
        return np.int32(-1)
    return cache[t * ((num_topk + RANKS_PER_WORD - 1) // RANKS_PER_WORD) + k0 // RANKS_PER_WORD]


@cuda.jit(device=True)
def entry_rank(topk_idx, t, k, rank_of, word):
    """Rank of entry ``(t, k)``, -1 for no expert: the low byte of ``word`` (its cache word shifted by
    ``8 * (k % 4)``) minus 1, or with ``word < 0`` (not cached) its expert's ``rank_of [E]`` (shared)."""
    if word >= 0:
        return np.int64(word & 0xFF) - 1
    expert = routed_expert(topk_idx, t, k, rank_of.shape[0])
    return np.int64(rank_of[expert]) if expert >= 0 else np.int64(-1)


@cuda.jit(device=True)
def rank_bits(topk_idx, t, active, rank_of, first_rank, cache, cached_tokens):
    """uint32 with bit ``j`` set when token ``t`` reaches rank ``first_rank + j`` (``j < 32``); 0 when not
    ``active``."""
    num_topk = topk_idx.shape[1]
    bits = np.uint32(0)
    if active:
        for k0 in range(0, num_topk, RANKS_PER_WORD):
            word = cache_word(cache, t, k0, cached_tokens, num_topk)
            for j in range(RANKS_PER_WORD):
                if k0 + j < num_topk:
                    bit = entry_rank(topk_idx, t, k0 + j, rank_of, word >> np.int32(8 * j)) - first_rank
                    if 0 <= bit < WARP:
                        bits |= np.uint32(1) << np.uint32(bit)
    return bits


@cuda.jit(device=True)
def load_token(topk_idx, t, active, rank_of, hist, cache, cache_token):
    """Read token ``t``'s entries once (``LOAD_UNROLL`` loads in flight): add its experts to the shared
    histogram ``hist [E]``, cache its entry ranks when ``cache_token`` (an active token below the cache's
    size: lanes past their warp's tokens must not overwrite the next warp's), and return its ranks below 32 as
    bits (see :func:`rank_bits`). An id outside ``[0, E)`` is no expert, as :func:`routed_expert` reads it."""
    num_topk = topk_idx.shape[1]
    num_experts = hist.shape[0]
    words = (num_topk + RANKS_PER_WORD - 1) // RANKS_PER_WORD
    ids = cuda.local.array(LOAD_UNROLL, int64)
    bits = np.uint32(0)
    for k0 in range(0, num_topk, LOAD_UNROLL):
        for j in range(LOAD_UNROLL):
            ids[j] = np.int64(topk_idx[t, k0 + j]) if active and k0 + j < num_topk else np.int64(-1)
        packed = np.int32(0)
        for j in range(LOAD_UNROLL):
            expert = ids[j]
            rank = np.int64(rank_of[expert]) if 0 <= expert < num_experts else np.int64(-1)
            if rank >= 0:
                cuda.atomic.add(hist, expert, 1)
                if rank < WARP:
                    bits |= np.uint32(1) << np.uint32(rank)
            packed |= np.int32(rank + 1) << np.int32(8 * (j % RANKS_PER_WORD))
            if j % RANKS_PER_WORD == RANKS_PER_WORD - 1:
                word = (k0 + j) // RANKS_PER_WORD
                if cache_token and word < words:
                    cache[t * words + word] = packed
                packed = np.int32(0)
    return bits


@cuda.jit(device=True)
def named_before(topk_idx, t, k, rank, rank_of, cache, cached_tokens):
    """True when an entry of token ``t`` before ``k`` goes to ``rank``."""
    for k2 in range(k):
        word = cache_word(cache, t, k2 - k2 % RANKS_PER_WORD, cached_tokens, topk_idx.shape[1])
        if entry_rank(topk_idx, t, k2, rank_of, word >> np.int32(8 * (k2 % RANKS_PER_WORD))) == rank:
            return True
    return False


@cuda.jit(device=True)
def write_slots(topk_idx, t, slot_idx, start, masks, src_base, rank_of, cache, cached_tokens, lane):
    """``slot_idx[t, k]``: ``src_base + slot`` on the first entry of each rank token ``t`` reaches, else -1,
    where ``slot = start[r] +`` the lanes below ``lane`` in this chunk's ballot ``masks[r]`` (int32 bits)."""
    num_topk = topk_idx.shape[1]
    seen = np.uint32(0)  # ranks below 32 named by an earlier entry
    for k0 in range(0, num_topk, RANKS_PER_WORD):
        word = cache_word(cache, t, k0, cached_tokens, num_topk)
        for j in range(RANKS_PER_WORD):
            k = k0 + j
            if k < num_topk:
                rank = entry_rank(topk_idx, t, k, rank_of, word >> np.int32(8 * j))
                slot = np.int32(-1)
                if rank >= 0:
                    if rank < WARP:
                        bit = np.uint32(1) << np.uint32(rank)
                        first = (seen & bit) == 0
                        seen |= bit
                    else:
                        first = not named_before(topk_idx, t, k, rank, rank_of, cache, cached_tokens)
                    if first:
                        below = count_lanes(np.uint32(masks[rank]) & lanes_below(lane))
                        slot = np.int32(src_base + start[rank] + below)
                slot_idx[t, k] = slot


@cuda.jit(device=True)
def count_ranks(topk_idx, begin, end, rank_of, hist, counts, in_rank, cache, cached_tokens, lane):
    """Pass 1 of one warp over tokens ``[begin, end)``: ``counts[r]`` (shared, owned by the warp) = its
    tokens that reach rank ``r``, their ``in_rank`` rows, their experts in the shared histogram ``hist``
    and their entry ranks in the rank cache (tokens below ``cached_tokens``)."""
    num_ranks = counts.shape[0]
    for first_rank in range(0, num_ranks, WARP):
        mine = np.int32(0)  # lane j: the count of rank first_rank + j
        for t0 in range(begin, end, WARP):
            t = t0 + lane
            if first_rank == 0:  # the one read of the routing
                bits = load_token(topk_idx, t, t < end, rank_of, hist, cache, t < min(end, cached_tokens))
            else:
                bits = rank_bits(topk_idx, t, t < end, rank_of, first_rank, cache, cached_tokens)
            for r in range(first_rank, min(first_rank + WARP, num_ranks)):
                reached = (bits >> np.uint32(r - first_rank)) & np.uint32(1) != 0
                ranked = ballot(reached)
                if lane == r - first_rank:
                    mine += count_lanes(ranked)
                if t < end:
                    in_rank[t, r] = reached
        if first_rank + lane < num_ranks:
            counts[first_rank + lane] = mine


@cuda.jit(device=True)
def scan_warps(counts, totals, num_warps, lane):
    """One warp per rank: each warp's count ``counts[w * R + r]`` (shared, row-major ``[W, R]``) becomes
    its exclusive start over the warps, ``totals[r]`` the rank's tokens (``W <= 32``)."""
    num_ranks = totals.shape[0]
    warp = cuda.threadIdx.x // WARP
    for r in range(warp, num_ranks, num_warps):
        own = counts[lane * num_ranks + r] if lane < num_warps else np.int32(0)
        inclusive = warp_inclusive_sum(own, lane)
        if lane < num_warps:
            counts[lane * num_ranks + r] = inclusive - own
        if lane == WARP - 1:
            totals[r] = inclusive


@cuda.jit(device=True)
def place_ranks(topk_idx, begin, end, rank_of, src_base, start, masks, slot_idx, cache, cached_tokens, num_units,
                unit_cursor, group_counts, lane):
    """Pass 2 of one warp over tokens ``[begin, end)``: their ``slot_idx`` rows, from the warp's per-rank
    starts ``start [R]`` (shared, advanced chunk by chunk); ``masks [R]`` is its shared ballot scratch.
    With ``num_units`` > 0 also the scatter's ``SLOT_STABLE`` cursors of the units that ``unit_range``
    cuts out of the tokens: ``group_counts[u, r]`` the unit's start, ``unit_cursor[u, r] = 0``.
    """
    num_tokens = slot_idx.shape[0]
    num_ranks = start.shape[0]
    per_unit = (num_tokens + num_units - 1) // num_units if num_units > 0 else 0
    for t0 in range(begin, end, WARP):
        t = t0 + lane
        active = t < end
        for first_rank in range(0, num_ranks, WARP):
            bits = rank_bits(topk_idx, t, active, rank_of, first_rank, cache, cached_tokens)
            for r in range(first_rank, min(first_rank + WARP, num_ranks)):
                ranked = ballot((bits >> np.uint32(r - first_rank)) & np.uint32(1) != 0)
                if lane == r - first_rank:
                    masks[r] = np.int32(ranked)
        cuda.syncwarp(FULL_MASK)
        if active:
            write_slots(topk_idx, t, slot_idx, start, masks, src_base, rank_of, cache, cached_tokens, lane)
            if per_unit > 0 and t % per_unit == 0:
                for r in range(num_ranks):
                    group_counts[t // per_unit, r] = start[r] + count_lanes(np.uint32(masks[r]) & lanes_below(lane))
                    unit_cursor[t // per_unit, r] = 0
        cuda.syncwarp(FULL_MASK)
        for r in range(lane, num_ranks, WARP):
            start[r] += count_lanes(np.uint32(masks[r]))
        cuda.syncwarp(FULL_MASK)


@kernel
def count_kernel(topk_idx, experts_per_rank, src_base, cached_tokens, num_units, unit_cursor, group_counts,
                 rank_cursor, tokens_per_rank, tokens_per_expert, rank_psum, expert_psum, in_rank, slot_idx):
    """See :meth:`ep_comm.launching.kernels.Kernels.count`. One block of ``W <= 32`` warps; dynamic shared
    memory: int32 ``[2 * E + 2 * W * R + R + cached_tokens * ceil(K / 4)]`` (histogram, expert ranks,
    per-warp starts, per-warp ballots, rank totals, rank cache; ``cached_tokens`` 0 when ``R > MAX_CACHED_RANKS``).

    ``slot_idx [T, K]`` int32: ``src_base + slot`` on the first entry of each (token, rank) pair, else -1.
    ``num_units`` > 0 also leaves the scatter's ``SLOT_STABLE`` cursors for that unit cut with one unit
    per group (``unit_cursor``, ``group_counts`` ``[>= num_units, R]``); ``rank_cursor [R]`` (the
    ``SLOT_ATOMIC`` counters) is zeroed.
    """
    num_tokens = topk_idx.shape[0]
    num_ranks = tokens_per_rank.shape[0]
    num_experts = tokens_per_expert.shape[0]
    num_warps = cuda.blockDim.x // WARP
    warp = cuda.threadIdx.x // WARP
    lane = lane_id()
    smem = cuda.shared.array(0, int32)
    hist = smem[:num_experts]
    rank_of = smem[num_experts: 2 * num_experts]
    starts = smem[2 * num_experts: 2 * num_experts + num_warps * num_ranks]  # [W, R] row-major, then [W, R] ballots
    mine = 2 * num_experts + warp * num_ranks
    own_start = smem[mine: mine + num_ranks]
    own_masks = smem[mine + num_warps * num_ranks: mine + num_warps * num_ranks + num_ranks]
    totals_first = 2 * num_experts + 2 * num_warps * num_ranks
    totals = smem[totals_first: totals_first + num_ranks]
    cache = smem[totals_first + num_ranks:]
    for i in range(cuda.threadIdx.x, num_experts, cuda.blockDim.x):
        hist[i] = 0
        rank_of[i] = i // experts_per_rank  # the one division per expert: entries look their rank up
    for i in range(cuda.threadIdx.x, num_ranks, cuda.blockDim.x):
        rank_cursor[i] = 0
    cuda.syncthreads()

    begin, end = unit_range(warp, num_warps, num_tokens)
    count_ranks(topk_idx, begin, end, rank_of, hist, own_start, in_rank, cache, cached_tokens, lane)
    cuda.syncthreads()
    scan_warps(starts, totals, num_warps, lane)
    cuda.syncthreads()
    place_ranks(topk_idx, begin, end, rank_of, src_base, own_start, own_masks, slot_idx, cache, cached_tokens,
                num_units, unit_cursor, group_counts, lane)

    # the totals and the histogram are complete since the scan: one warp scans each
    if warp == 0:
        warp_scan(totals, rank_psum, num_ranks, False, 0, False)
        for i in range(lane, num_ranks, WARP):
            tokens_per_rank[i] = totals[i]
    if warp == 1 % num_warps:
        total = warp_scan(hist, expert_psum, num_experts, True, 0, False)
        if lane == 0:
            expert_psum[num_experts] = total
        for i in range(lane, num_experts, WARP):
            tokens_per_expert[i] = hist[i]
