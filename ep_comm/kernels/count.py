"""Sender-side count: per-rank and per-expert histograms, their prefix sums, ``is_token_in_rank``.

Tokens are cut into units (see ``units.py``), one top-k entry per lane. The scatter kernel needs
many units (one warp streams each unit's rows), but a stable order costs a scan over units per
rank in the last block. So each count warp walks a *group* of ``units_per_warp`` consecutive
units: it records where each unit starts inside its group (per rank, in ``unit_counts``) and the
group's totals (in ``group_counts``); the last block scans the few group columns, and the scatter
kernel adds a unit's group offset to its start. Each block counts into shared memory, merges into
arrival-encoded global counters, and the last block to arrive scans (see ``ticket.py``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.jit import kernel
from ep_comm.kernels.routing import routed_expert
from ep_comm.kernels.ticket import block_totals
from ep_comm.kernels.units import lane_entry, unit_range
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, is_group_leader, lane_id, warp_scan


@cuda.jit(device=True)
def count_unit(topk_idx, experts_per_rank, unit, num_units, hist, running, stable, in_rank, lane):
    """Count one unit's tokens into the block histogram ``hist [E + R]`` and, with ``stable``, the warp's
    per-rank running counts ``running [R]`` (shared); write its ``in_rank`` rows."""
    num_tokens, num_topk = topk_idx.shape
    num_ranks = in_rank.shape[1]
    num_experts = hist.shape[0] - num_ranks
    group = WARP // num_topk
    begin, end = unit_range(unit, num_units, num_tokens)
    for t0 in range(begin, end, group):
        for j in range(lane, group * num_ranks, WARP):
            if t0 + j // num_ranks < end:
                in_rank[t0 + j // num_ranks, j % num_ranks] = False
        cuda.syncwarp(FULL_MASK)
        t, k, active = lane_entry(t0, end, num_topk, lane)
        expert = routed_expert(topk_idx, t, k, num_experts) if active else np.int64(-1)
        valid = expert >= 0
        rank = expert // experts_per_rank if valid else np.int64(-1)
        key = (t - t0) * num_ranks + rank if valid else np.int64(-1 - lane)
        first = is_group_leader(key, lane) and valid
        if valid:
            cuda.atomic.add(hist, expert, 1)
        if first:
            cuda.atomic.add(hist, num_experts + rank, 1)
            in_rank[t, rank] = True
            if stable:
                cuda.atomic.add(running, rank, 1)
    cuda.syncwarp(FULL_MASK)


@kernel
def count_kernel(topk_idx, experts_per_rank, num_units, units_per_warp, stable, counters, ticket, unit_counts,
                 group_counts, rank_cursor, tokens_per_rank, tokens_per_expert, rank_psum, expert_psum, in_rank,
                 count_words):
    """See :meth:`ep_comm.launching.kernels.Kernels.count`; dynamic shared memory: int32 ``[E + R + warps * R]``.

    ``count_words [R, 1 + L]`` gets, per destination ``r``, ``tokens_per_rank[r]`` then
    ``tokens_per_expert[r*L:(r+1)*L]``: the block the count exchange sends to ``r``.

    Stable mode leaves ``unit_counts[u, r]``: rank-r tokens of ``u``'s group before ``u``, and
    ``group_counts[g, r]``: rank-r tokens before group ``g`` (exclusive scan over groups).
    """
    num_ranks = tokens_per_rank.shape[0]
    num_experts = tokens_per_expert.shape[0]
    smem = cuda.shared.array(0, int32)
    hist = smem[: num_experts + num_ranks]
    running_first = num_experts + num_ranks + cuda.threadIdx.x // WARP * num_ranks
    running = smem[running_first: running_first + num_ranks]
    for i in range(cuda.threadIdx.x, hist.shape[0], cuda.blockDim.x):
        hist[i] = 0
    cuda.syncthreads()

    lane = lane_id()
    num_groups = (num_units + units_per_warp - 1) // units_per_warp
    warp, num_warps = global_warp()
    for g in range(warp, num_groups, num_warps):
        for r in range(lane, num_ranks, WARP):
            running[r] = 0
        cuda.syncwarp(FULL_MASK)
        for unit in range(g * units_per_warp, min(g * units_per_warp + units_per_warp, num_units)):
            if stable:
                for r in range(lane, num_ranks, WARP):
                    unit_counts[unit, r] = running[r]
            count_unit(topk_idx, experts_per_rank, unit, num_units, hist, running, stable, in_rank, lane)
        if stable:
            for r in range(lane, num_ranks, WARP):
                group_counts[g, r] = running[r]
        cuda.syncwarp(FULL_MASK)
    cuda.syncthreads()

    if not block_totals(hist, counters, ticket):
        return
    for i in range(cuda.threadIdx.x, num_experts, cuda.blockDim.x):
        tokens_per_expert[i] = hist[i]
    for i in range(cuda.threadIdx.x, num_ranks, cuda.blockDim.x):
        tokens_per_rank[i] = hist[num_experts + i]
        rank_cursor[i] = 0
    width = count_words.shape[1]
    for i in range(cuda.threadIdx.x, num_ranks * width, cuda.blockDim.x):
        r = i // width
        j = i - r * width
        count_words[r, j] = hist[num_experts + r] if j == 0 else hist[r * experts_per_rank + j - 1]
    # Scan jobs round-robin over the block's warps: ranks and experts from shared memory, then one
    # per rank over the groups (written by other blocks: coherent loads).
    num_jobs = 2 + (num_ranks if stable else 0)
    for job in range(cuda.threadIdx.x // WARP, num_jobs, cuda.blockDim.x // WARP):
        if job == 0:
            warp_scan(hist[num_experts:], rank_psum, num_ranks, False, 0, False)
        elif job == 1:
            total = warp_scan(hist, expert_psum, num_experts, True, 0, False)
            if lane == 0:
                expert_psum[num_experts] = total
        else:
            column = group_counts[:num_groups, job - 2]
            warp_scan(column, column, num_groups, True, 0, True)
