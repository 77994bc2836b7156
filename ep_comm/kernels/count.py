"""Sender-side count in one block: histograms, prefix sums, ``is_token_in_rank`` and the stable slots.

A counting sort of the (token, destination rank) pairs that needs no global counters: one block of
``W`` warps, warp ``w`` owning the ``w``-th of ``W`` even, contiguous token ranges, one token per lane in
chunks of 32 tokens. Pass 1 counts each warp's tokens per rank (ballots, shared ``[W, R]``) and the
per-expert histogram (shared atomics); one warp per rank scans the warps' counts; pass 2 re-reads the
routing (now cached) and gives each (token, rank) pair its slot: the warp's start plus the earlier
chunks' pairs plus the lanes below with the same rank (a ballot per rank). So a slot is the number of
earlier tokens going to the same rank, the order ``deterministic=True`` promises, at no extra cost.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.jit import kernel
from ep_comm.kernels.routing import routed_expert
from ep_comm.kernels.units import unit_range
from ep_comm.kernels.warp import (FULL_MASK, WARP, ballot, count_lanes, lane_id, lanes_below, warp_inclusive_sum,
                                  warp_scan)

LOAD_UNROLL = 8  # top-k entries a lane loads before it uses them (a literal trip count, unrolled)


@cuda.jit(device=True)
def rank_bits(topk_idx, t, active, experts_per_rank, num_experts, first_rank):
    """uint32 with bit ``j`` set when token ``t`` names an expert of rank ``first_rank + j`` (``j < 32``);
    0 when not ``active``. Ids outside ``[0, num_experts)`` name no rank."""
    num_topk = topk_idx.shape[1]
    bits = np.uint32(0)
    if active:
        for k0 in range(0, num_topk, LOAD_UNROLL):
            for j in range(LOAD_UNROLL):
                if k0 + j < num_topk:
                    expert = routed_expert(topk_idx, t, k0 + j, num_experts)
                    bit = expert // experts_per_rank - first_rank if expert >= 0 else np.int64(-1)
                    if 0 <= bit < WARP:
                        bits |= np.uint32(1) << np.uint32(bit)
    return bits


@cuda.jit(device=True)
def count_experts(topk_idx, t, hist):
    """Add token ``t``'s experts to the shared int32 histogram ``hist [E]``."""
    for k in range(topk_idx.shape[1]):
        expert = routed_expert(topk_idx, t, k, hist.shape[0])
        if expert >= 0:
            cuda.atomic.add(hist, expert, 1)


@cuda.jit(device=True)
def named_before(topk_idx, t, k, rank, experts_per_rank, num_experts):
    """True when an entry of token ``t`` before ``k`` names an expert of ``rank``."""
    for k2 in range(k):
        expert = routed_expert(topk_idx, t, k2, num_experts)
        if expert >= 0 and expert // experts_per_rank == rank:
            return True
    return False


@cuda.jit(device=True)
def write_slots(topk_idx, t, slot_idx, start, masks, src_base, experts_per_rank, num_experts, lane):
    """``slot_idx[t, k]``: ``src_base + slot`` on the first entry of each rank token ``t`` reaches, else -1.

    ``slot = start[r] + `` the lanes below ``lane`` in this chunk's ballot ``masks[r]`` (int32 bits) of rank r.
    """
    seen = np.uint32(0)  # ranks below 32 already named by an earlier entry
    for k in range(topk_idx.shape[1]):
        expert = routed_expert(topk_idx, t, k, num_experts)
        slot = np.int32(-1)
        if expert >= 0:
            rank = expert // experts_per_rank
            if rank < WARP:
                bit = np.uint32(1) << np.uint32(rank)
                first = (seen & bit) == 0
                seen |= bit
            else:
                first = not named_before(topk_idx, t, k, rank, experts_per_rank, num_experts)
            if first:
                below = count_lanes(np.uint32(masks[rank]) & lanes_below(lane))
                slot = np.int32(src_base + start[rank] + below)
        slot_idx[t, k] = slot


@cuda.jit(device=True)
def count_ranks(topk_idx, begin, end, experts_per_rank, hist, counts, lane):
    """Pass 1 of one warp over tokens ``[begin, end)``: ``counts[r]`` (shared, owned by the warp) = its
    tokens that reach rank ``r``; its experts go into the shared histogram ``hist``."""
    num_ranks = counts.shape[0]
    for first_rank in range(0, num_ranks, WARP):
        mine = np.int32(0)  # lane j: the count of rank first_rank + j
        for t0 in range(begin, end, WARP):
            t = t0 + lane
            bits = rank_bits(topk_idx, t, t < end, experts_per_rank, hist.shape[0], first_rank)
            if first_rank == 0 and t < end:
                count_experts(topk_idx, t, hist)
            for r in range(first_rank, min(first_rank + WARP, num_ranks)):
                ranked = ballot((bits >> np.uint32(r - first_rank)) & np.uint32(1) != 0)
                if lane == r - first_rank:
                    mine += count_lanes(ranked)
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
def place_ranks(topk_idx, begin, end, experts_per_rank, num_experts, src_base, start, masks, in_rank, slot_idx,
                num_units, unit_cursor, group_counts, lane):
    """Pass 2 of one warp over tokens ``[begin, end)``: ``in_rank`` rows and ``slot_idx`` rows, from the
    warp's per-rank starts ``start [R]`` (shared, advanced chunk by chunk); ``masks [R]`` is its shared
    ballot scratch. With ``num_units`` > 0 also the scatter's ``SLOT_STABLE`` cursors of the units that
    ``unit_range`` cuts out of the tokens: ``group_counts[u, r]`` the unit's start, ``unit_cursor[u, r] = 0``.
    """
    num_tokens = in_rank.shape[0]
    num_ranks = in_rank.shape[1]
    per_unit = (num_tokens + num_units - 1) // num_units if num_units > 0 else 0
    for t0 in range(begin, end, WARP):
        t = t0 + lane
        active = t < end
        for first_rank in range(0, num_ranks, WARP):
            bits = rank_bits(topk_idx, t, active, experts_per_rank, num_experts, first_rank)
            for r in range(first_rank, min(first_rank + WARP, num_ranks)):
                reached = (bits >> np.uint32(r - first_rank)) & np.uint32(1) != 0
                ranked = ballot(reached)
                if lane == r - first_rank:
                    masks[r] = np.int32(ranked)
                if active:
                    in_rank[t, r] = reached
        cuda.syncwarp(FULL_MASK)
        if active:
            write_slots(topk_idx, t, slot_idx, start, masks, src_base, experts_per_rank, num_experts, lane)
            if per_unit > 0 and t % per_unit == 0:
                for r in range(num_ranks):
                    group_counts[t // per_unit, r] = start[r] + count_lanes(np.uint32(masks[r]) & lanes_below(lane))
                    unit_cursor[t // per_unit, r] = 0
        cuda.syncwarp(FULL_MASK)
        for r in range(lane, num_ranks, WARP):
            start[r] += count_lanes(np.uint32(masks[r]))
        cuda.syncwarp(FULL_MASK)


@kernel
def count_kernel(topk_idx, experts_per_rank, src_base, num_units, unit_cursor, group_counts, rank_cursor,
                 tokens_per_rank, tokens_per_expert, rank_psum, expert_psum, in_rank, slot_idx):
    """See :meth:`ep_comm.launching.kernels.Kernels.count`. One block of ``W <= 32`` warps; dynamic shared
    memory: int32 ``[E + 2 * W * R + R]`` (histogram, per-warp starts, per-warp ballots, rank totals).

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
    starts = smem[num_experts: num_experts + num_warps * num_ranks]  # [W, R] row-major, then [W, R] ballots
    mine = num_experts + warp * num_ranks
    own_start = smem[mine: mine + num_ranks]
    own_masks = smem[mine + num_warps * num_ranks: mine + num_warps * num_ranks + num_ranks]
    totals = smem[num_experts + 2 * num_warps * num_ranks: num_experts + 2 * num_warps * num_ranks + num_ranks]
    for i in range(cuda.threadIdx.x, num_experts, cuda.blockDim.x):
        hist[i] = 0
    for i in range(cuda.threadIdx.x, num_ranks, cuda.blockDim.x):
        rank_cursor[i] = 0
    cuda.syncthreads()

    begin, end = unit_range(warp, num_warps, num_tokens)
    count_ranks(topk_idx, begin, end, experts_per_rank, hist, own_start, lane)
    cuda.syncthreads()
    scan_warps(starts, totals, num_warps, lane)
    cuda.syncthreads()
    place_ranks(topk_idx, begin, end, experts_per_rank, num_experts, src_base, own_start, own_masks, in_rank,
                slot_idx, num_units, unit_cursor, group_counts, lane)

    # the totals and the histogram are complete since the scan: one warp scans each (round-robin)
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
