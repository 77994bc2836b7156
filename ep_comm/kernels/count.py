"""Sender-side count: per-rank and per-expert histograms, their prefix sums, ``is_token_in_rank``.

Tokens are cut into units (see ``units.py``), one top-k entry per lane. Each block counts into
shared memory, merges into arrival-encoded global counters, and the last block to arrive scans
(see ``ticket.py``). In stable mode it also scans the per-unit per-rank counts over units: the
scatter kernel starts each unit's tokens there.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.ticket import drain_counters, flush_counters, last_block_to_arrive
from ep_comm.kernels.units import lane_entry, unit_range
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, is_group_leader, lane_id, warp_scan


@cuda.jit
def count_kernel(topk_idx, experts_per_rank, num_units, stable, counters, ticket, unit_counts, rank_cursor,
                 tokens_per_rank, tokens_per_expert, rank_psum, expert_psum, in_rank):
    """See :meth:`ep_comm.kernels.api.Kernels.count`; dynamic shared memory: int32 ``[E + R]``."""
    num_tokens, num_topk = topk_idx.shape
    num_ranks = tokens_per_rank.shape[0]
    num_experts = tokens_per_expert.shape[0]
    hist = cuda.shared.array(0, int32)[: num_experts + num_ranks]
    for i in range(cuda.threadIdx.x, hist.shape[0], cuda.blockDim.x):
        hist[i] = 0
    cuda.syncthreads()

    lane = lane_id()
    group = WARP // num_topk
    warp, num_warps = global_warp()
    for unit in range(warp, num_units, num_warps):
        begin, end = unit_range(unit, num_units, num_tokens)
        if stable:
            for r in range(lane, num_ranks, WARP):
                unit_counts[unit, r] = 0
        for t0 in range(begin, end, group):
            for j in range(lane, group * num_ranks, WARP):
                if t0 + j // num_ranks < end:
                    in_rank[t0 + j // num_ranks, j % num_ranks] = False
            cuda.syncwarp(FULL_MASK)
            t, k, active = lane_entry(t0, end, num_topk, lane)
            expert = np.int64(topk_idx[t, k]) if active else np.int64(-1)
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
                    cuda.atomic.add(unit_counts, (unit, rank), 1)
    cuda.syncthreads()

    flush_counters(hist, counters)
    if not last_block_to_arrive(ticket):
        return
    drain_counters(counters, hist)
    for i in range(cuda.threadIdx.x, num_experts, cuda.blockDim.x):
        tokens_per_expert[i] = hist[i]
    for i in range(cuda.threadIdx.x, num_ranks, cuda.blockDim.x):
        tokens_per_rank[i] = hist[num_experts + i]
        rank_cursor[i] = 0
    cuda.threadfence()
    cuda.syncthreads()
    # Scan jobs round-robin over the block's warps: ranks, experts, then one per rank over units.
    num_jobs = 2 + (num_ranks if stable else 0)
    for job in range(cuda.threadIdx.x // WARP, num_jobs, cuda.blockDim.x // WARP):
        if job == 0:
            warp_scan(tokens_per_rank, rank_psum, num_ranks, False, 0)
        elif job == 1:
            total = warp_scan(tokens_per_expert, expert_psum, num_experts, True, 0)
            if lane == 0:
                expert_psum[num_experts] = total
        else:
            column = unit_counts[:, job - 2]
            warp_scan(column, column, num_units, True, 0)
