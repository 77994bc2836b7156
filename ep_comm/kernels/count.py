"""Sender-side count: per-rank and per-expert histograms, their prefix sums, ``is_token_in_rank``.

Tokens are cut into units (see ``units.py``), one top-k entry per lane. The scatter kernel needs
many units (one warp streams each unit's rows), but a stable order costs a scan over units per
rank in the last block. So each count warp walks a *group* of ``units_per_warp`` consecutive
units: it records where each unit starts inside its group (per rank, in ``unit_counts``) and the
group's totals (in ``group_counts``); the last block scans the few group columns, and the scatter
kernel adds a unit's group offset to its start. Each block counts into shared memory, merges into
arrival-encoded global counters, and the last block to arrive scans (see ``ticket.py``).

The count also checks the routing (``check.py``) from the ids its lanes load anyway: the largest id, and
one 64-bit warp match per step for an id repeated within a token. The last block writes the verdict into
every destination's count words, so that it travels with the count exchange.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from ep_comm.kernels.expert_ids import as_expert
from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.routing_check import (
    NO_ROW,
    fold_check,
    grid_check,
    repeats_an_earlier_lane,
    start_check,
    verdict_words,
)
from ep_comm.kernels.ticket import block_totals
from ep_comm.kernels.units import item_lanes, lane_entry, lane_place, unit_range
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, is_group_leader, lane_id, warp_scan


@cuda.jit(device=True)
def count_unit(topk_idx, experts_per_rank, unit, num_units, hist, running, stable, in_rank, idx_copy, place, lane,
               check):
    """Count one unit's tokens into the block histogram ``hist [E + R]`` and, with ``stable``, the warp's
    per-rank running counts ``running [R]`` (shared); write its ``in_rank`` rows and its ids into ``idx_copy``
    (the handle's own copy of the routing, as given). ``place``: the lane's
    :func:`~ep_comm.kernels.units.lane_place` for K entries. ``check``: the lane's ``(largest id, first
    repeated row or NO_ROW)`` so far (``check.py``), returned with this unit's entries folded in."""
    num_tokens, num_topk = topk_idx.shape
    num_ranks = in_rank.shape[1]
    num_experts = hist.shape[0] - num_ranks
    group = quotient32(WARP, num_topk)
    lanes = item_lanes(place, num_topk)
    top, repeated = check
    begin, end = unit_range(unit, num_units, num_tokens)
    t0 = np.int32(begin)
    while t0 < end:
        t, k, active = lane_entry(t0, end, place)
        if active:  # the K lanes of token t clear its row, ranks k, k + K, ...
            r = np.int32(k)
            while r < num_ranks:
                in_rank[t, r] = False
                r = np.int32(r + num_topk)
        cuda.syncwarp(FULL_MASK)
        entry = np.int64(topk_idx[t, k]) if active else np.int64(-1)
        if active:
            idx_copy[t, k] = topk_idx[t, k]
        top = max(top, entry)
        if repeats_an_earlier_lane(entry, lanes, lane):
            repeated = min(repeated, np.int64(t))
        expert = as_expert(entry, num_experts)
        valid = expert >= 0
        rank = quotient32(expert, experts_per_rank) if valid else np.int64(-1)
        # a 32-bit key: match.any.sync.b32 (a 64-bit match costs two)
        key = np.int32((t - t0) * num_ranks + rank) if valid else np.int32(-1 - lane)
        first = is_group_leader(key, lane) and valid
        if valid:
            cuda.atomic.add(hist, expert, 1)
        if first:
            cuda.atomic.add(hist, num_experts + rank, 1)
            in_rank[t, rank] = True
            if stable:
                cuda.atomic.add(running, rank, 1)
        t0 = np.int32(t0 + group)
    cuda.syncwarp(FULL_MASK)
    return top, repeated


@cuda.jit(device=True)
def count_word(hist, num_experts, r, j, experts_per_rank, verdict):
    """Word ``j`` of the count words for destination ``r`` from the grid's histogram ``hist [E + R]``: its
    tokens, then the entries of its ``experts_per_rank`` experts, then the two ``verdict`` words."""
    if j == 0:
        return hist[num_experts + r]
    if j <= experts_per_rank:
        return hist[r * experts_per_rank + j - 1]
    return verdict[j - 1 - experts_per_rank]


@kernel
def count_kernel(topk_idx, experts_per_rank, num_units, units_per_warp, stable, counters, ticket, check_acc,
                 unit_counts, group_counts, rank_cursor, tokens_per_rank, tokens_per_expert, rank_psum, expert_psum,
                 in_rank, count_words, idx_copy):
    """See :meth:`ep_comm.launching.kernel_launches.Kernels.count`; dynamic shared memory: int32 ``[E + R + warps * R]``.

    ``idx_copy [T, K]`` (``topk_idx``'s dtype) gets ``topk_idx`` as given: the copy a handle owns, written by the
    lanes that read the ids anyway (no copy kernel, no allocation of its own).

    ``count_words [R, 1 + L + 2]`` gets, per destination ``r``, ``tokens_per_rank[r]`` then
    ``tokens_per_expert[r*L:(r+1)*L]`` then the routing verdict's two words (``ep_comm.contract.checks.verdict_words``
    of the largest id and the first row naming an expert twice, over all tokens): the block the count exchange
    sends to ``r``. ``check_acc``: int64 ``[2]`` holding ``routing_check.ACC_INIT`` between launches.

    Stable mode leaves ``unit_counts[u, r]``: rank-r tokens of ``u``'s group before ``u``, and
    ``group_counts[g, r]``: rank-r tokens before group ``g`` (exclusive scan over groups).
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    num_ranks = tokens_per_rank.shape[0]
    num_experts = tokens_per_expert.shape[0]
    smem = cuda.shared.array(0, int32)
    hist = smem[: num_experts + num_ranks]
    running_first = num_experts + num_ranks + cuda.threadIdx.x // WARP * num_ranks
    running = smem[running_first: running_first + num_ranks]
    block_check = cuda.shared.array(2, int64)
    start_check(block_check)
    i = cuda.threadIdx.x
    while i < hist.shape[0]:
        hist[i] = 0
        i = np.int32(i + cuda.blockDim.x)
    cuda.syncthreads()

    check = (np.int64(-1), NO_ROW)
    lane = lane_id()
    place = lane_place(topk_idx.shape[1], lane)
    num_groups = quotient32(num_units + units_per_warp - 1, units_per_warp)
    g, num_warps = global_warp()
    g = np.int32(g)
    while g < num_groups:
        for r in range(lane, num_ranks, WARP):
            running[r] = 0
        cuda.syncwarp(FULL_MASK)
        for unit in range(g * units_per_warp, min(g * units_per_warp + units_per_warp, num_units)):
            if stable:
                for r in range(lane, num_ranks, WARP):
                    unit_counts[unit, r] = running[r]
            check = count_unit(topk_idx, experts_per_rank, unit, num_units, hist, running, stable, in_rank, idx_copy,
                               place, lane, check)
        if stable:
            for r in range(lane, num_ranks, WARP):
                group_counts[g, r] = running[r]
        cuda.syncwarp(FULL_MASK)
        g = np.int32(g + num_warps)
    fold_check(check[0], check[1], block_check, check_acc)  # syncs the block: hist is complete after it

    if not block_totals(hist, counters, ticket):
        return
    top, twice = grid_check(block_check, check_acc)
    verdict = verdict_words(top, twice)
    i = cuda.threadIdx.x
    while i < hist.shape[0]:
        if i < num_experts:
            tokens_per_expert[i] = hist[i]
        else:
            tokens_per_rank[i - num_experts] = hist[i]
            rank_cursor[i - num_experts] = 0
        i = np.int32(i + cuda.blockDim.x)
    width = count_words.shape[1]
    i = cuda.threadIdx.x
    while i < num_ranks * width:
        r, j = divmod32(i, width)
        count_words[r, j] = count_word(hist, num_experts, r, j, experts_per_rank, verdict)
        i = np.int32(i + cuda.blockDim.x)
    # Scan jobs round-robin over the block's warps: ranks and experts from shared memory, then one
    # per rank over the groups (written by other blocks: coherent loads).
    num_jobs = 2 + (num_ranks if stable else 0)
    job = cuda.threadIdx.x // WARP
    while job < num_jobs:
        if job == 0:
            warp_scan(hist[num_experts:], rank_psum, num_ranks, False, 0, False)
        elif job == 1:
            total = warp_scan(hist, expert_psum, num_experts, True, 0, False)
            if lane == 0:
                expert_psum[num_experts] = total
        else:
            column = group_counts[:num_groups, job - 2]
            warp_scan(column, column, num_groups, True, 0, True)
        job = np.int32(job + cuda.blockDim.x // WARP)
