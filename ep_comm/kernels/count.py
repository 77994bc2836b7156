"""Sender-side count in one block: per-rank and per-expert histograms, their prefix sums, ``is_token_in_rank``.

DeepEP's two-level counting sort without a grid-wide step: a routing has at most a few tens of
thousands of entries, which one block of up to 1024 threads counts in shared memory, so no block
waits for another and nothing is merged through global atomics.

Tokens are cut into units (see ``units.py``) exactly as the scatter cuts them, one top-k entry per
lane; ``units_per_warp`` consecutive units form a *group*. Each warp walks a contiguous run of groups.
Level 1, per warp: its per-rank running counts in shared memory give, in stable mode, where each unit
starts inside its group (``unit_counts``) and where each group starts inside the warp's run
(``group_counts``); expert counts go straight into the block's shared histogram. Level 2, after a
block barrier: one warp-wide scan per rank over the warps' totals turns them into each warp's start,
which every warp adds to its groups; one warp scans the ranks, another the experts. The scatter
kernel adds a unit's group start to its start inside the group.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.jit import kernel
from ep_comm.kernels.warp import FULL_MASK, WARP, is_group_leader, lane_id, warp_inclusive_sum, warp_scan

MAX_COUNT_WARPS = WARP  # level 2 scans one value per warp in the lanes of one warp


def count_shared_words(num_experts: int, num_ranks: int, num_warps: int) -> int:
    """int32 words of dynamic shared memory :func:`count_kernel` needs with ``num_warps`` warps."""
    return num_experts + 2 * num_warps * (num_ranks | 1) + num_ranks


@cuda.jit(device=True)
def rank_of(expert, experts_per_rank, inverse):
    """``expert // experts_per_rank`` for ``expert >= 0`` (int32), from the float32 reciprocal ``inverse``
    and a correction: an integer division costs about twenty instructions per entry."""
    rank = np.int32(np.float32(expert) * inverse)
    while rank * experts_per_rank > expert:
        rank -= np.int32(1)
    while (rank + np.int32(1)) * experts_per_rank <= expert:
        rank += np.int32(1)
    return rank


@cuda.jit(device=True)
def count_entry(raw, t, token_in_step, divisor, counts, in_rank, lane):
    """Count one lane's entry ``raw`` (-1 on inactive lanes) of token ``t``: its expert into the histogram
    ``counts[0] [E]``, and on the first entry of its (token, rank) pair the rank into the running counts
    ``counts[2] [R]`` and ``in_rank [T * R]``. ``divisor``: ``(experts_per_rank, its float32 reciprocal)``.

    Call with all lanes of the warp (the pair's first entry is found with a warp collective).
    """
    hist, _, running = counts
    num_ranks = running.shape[0]
    valid = raw >= 0 and raw < hist.shape[0]  # ids at or above E read as "no expert" (routing.py)
    expert = np.int32(raw) if valid else np.int32(-1)
    rank = rank_of(expert, divisor[0], divisor[1]) if valid else np.int32(-1)
    key = np.int32(token_in_step * num_ranks + rank) if valid else np.int32(-1 - lane)
    first = is_group_leader(key, lane) and valid
    if valid:
        cuda.atomic.add(hist, expert, 1)
    if first:
        cuda.atomic.add(running, rank, 1)
        in_rank[t * num_ranks + rank] = True


@cuda.jit(device=True)
def start_unit(pos, stable, counts, cursors, lane):
    """At the first step of unit ``pos[0]``: close the previous group if the unit opens one (fold the running
    counts into the warp's totals, record the group's start) and, with ``stable``, record where the unit
    starts inside its group."""
    unit, _, unit_in_group, group = pos
    _, totals, running = counts
    unit_counts, group_counts = cursors
    # The lane again, through a shuffle: the compiler cannot hoist the addresses below out of the walk, which
    # would keep a few dozen registers live across every step.
    first_rank = cuda.shfl_sync(FULL_MASK, lane, lane)
    cuda.syncwarp(FULL_MASK)  # the previous step's counts are in
    for r in range(first_rank, running.shape[0], WARP):
        if unit_in_group == 0:
            totals[r] += running[r]
            running[r] = 0
            if stable:
                group_counts[group, r] = totals[r]
        if stable:
            unit_counts[unit, r] = running[r]
    cuda.syncwarp(FULL_MASK)


@cuda.jit(device=True)
def lane_token(walk, unit, step):
    """Token of this lane at ``step`` of ``unit``, and whether the lane has an entry there."""
    num_tokens, per_unit, _, tokens_per_step, token_in_step, _, end_unit, _ = walk
    begin = min(unit * per_unit, num_tokens)
    t = begin + step * tokens_per_step + token_in_step
    return t, unit < end_unit and t < min(begin + per_unit, num_tokens)


@cuda.jit(device=True)
def next_step(walk, pos):
    """The walk position ``(unit, step in unit, unit in group, group)`` one step on."""
    unit, step, unit_in_group, group = pos
    steps_per_unit = walk[2]
    units_per_group = walk[7]
    step += 1
    if step == steps_per_unit:
        step = 0
        unit += 1
        unit_in_group += 1
        if unit_in_group == units_per_group:
            unit_in_group = 0
            group += 1
    return unit, step, unit_in_group, group


@cuda.jit(device=True)
def load_step(topk_idx, walk, pos):
    """This lane's raw entry at ``pos`` (-1: none), and the next position."""
    t, active = lane_token(walk, pos[0], pos[1])
    return (np.int64(topk_idx[t, walk[5]]) if active else np.int64(-1)), next_step(walk, pos)


@cuda.jit(device=True)
def count_step(raw, walk, pos, stable, divisor, counts, cursors, in_rank, lane):
    """Count the step at ``pos`` whose entry :func:`load_step` loaded; returns the next position."""
    if pos[0] < walk[6]:
        if pos[1] == 0:
            start_unit(pos, stable, counts, cursors, lane)
        t, _ = lane_token(walk, pos[0], pos[1])
        count_entry(raw, t, walk[4], divisor, counts, in_rank, lane)
    return next_step(walk, pos)


@cuda.jit(device=True)
def count_groups(topk_idx, experts_per_rank, num_units, units_per_warp, stable, first_group, end_group, counts,
                 cursors, in_rank, lane):
    """Level 1: one warp counts groups ``[first_group, end_group)``. ``counts``: the block's expert histogram
    ``[E]``, the warp's rank totals ``[R]`` and running counts ``[R]`` (shared, int32); ``cursors``:
    ``(unit_counts, group_counts)``, which get warp-relative group starts. Leaves the warp's totals.

    A unit of ``per_unit`` tokens takes ``steps_per_unit`` steps of ``32 // K`` tokens (a short last unit
    leaves steps without an active lane). Eight steps are loaded before the first of them is counted: one
    memory round trip per eight steps (by hand, as in ``copy_row``: the compiler keeps neither the loop
    unrolled nor a local array in registers).
    """
    num_tokens, num_topk = topk_idx.shape
    tokens_per_step = WARP // num_topk
    per_unit = (num_tokens + num_units - 1) // num_units  # as unit_range
    # a lane past the step's last entry gets a token beyond every unit: never active
    token_in_step = lane // num_topk if lane < tokens_per_step * num_topk else num_tokens + per_unit
    walk = (num_tokens, per_unit, max(1, (per_unit + tokens_per_step - 1) // tokens_per_step), tokens_per_step,
            token_in_step, lane % num_topk, min(end_group * units_per_warp, num_units), units_per_warp)
    divisor = (np.int32(experts_per_rank), np.float32(1) / np.float32(experts_per_rank))
    pos = (min(first_group * units_per_warp, num_units), 0, 0, first_group)
    while pos[0] < walk[6]:
        e0, p = load_step(topk_idx, walk, pos)
        e1, p = load_step(topk_idx, walk, p)
        e2, p = load_step(topk_idx, walk, p)
        e3, p = load_step(topk_idx, walk, p)
        e4, p = load_step(topk_idx, walk, p)
        e5, p = load_step(topk_idx, walk, p)
        e6, p = load_step(topk_idx, walk, p)
        e7, p = load_step(topk_idx, walk, p)
        # The counting walk restarts from a shuffled copy of the position: otherwise the compiler reuses the
        # loading walk's eight positions and tokens, which keeps ~60 more registers live (spills at 1024 threads).
        pos = (cuda.shfl_sync(FULL_MASK, pos[0], 0), cuda.shfl_sync(FULL_MASK, pos[1], 0), pos[2], pos[3])
        pos = count_step(e0, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e1, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e2, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e3, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e4, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e5, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e6, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
        pos = count_step(e7, walk, pos, stable, divisor, counts, cursors, in_rank, lane)
    _, totals, running = counts
    cuda.syncwarp(FULL_MASK)
    for r in range(lane, running.shape[0], WARP):
        totals[r] += running[r]


@kernel(max_threads=MAX_COUNT_WARPS * WARP)
def count_kernel(topk_idx, experts_per_rank, num_units, units_per_warp, stable, unit_counts, group_counts,
                 rank_cursor, tokens_per_rank, tokens_per_expert, rank_psum, expert_psum, in_rank):
    """See :meth:`ep_comm.launching.kernels.Kernels.count`. One block of up to :data:`MAX_COUNT_WARPS` warps;
    dynamic shared memory: int32 ``[count_shared_words(E, R, warps)]``.

    ``topk_idx [T, K]`` int32/int64; ``in_rank`` bool ``[T * R]`` (``is_token_in_rank`` flattened);
    ``tokens_per_rank``, ``rank_psum``, ``rank_cursor`` int32 ``[R]``; ``tokens_per_expert`` int32 ``[E]``,
    ``expert_psum`` int32 ``[E + 1]``. Stable mode leaves ``unit_counts[u, r]``: rank-r tokens of ``u``'s group
    before ``u``, and ``group_counts[g, r]``: rank-r tokens before group ``g`` (int32 ``[>= units, R]`` each).
    """
    num_ranks = tokens_per_rank.shape[0]
    num_experts = tokens_per_expert.shape[0]
    num_warps = cuda.blockDim.x // WARP
    stride = num_ranks | 1  # odd: level 2's lanes read one word per row without bank conflicts
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = lane_id()
    smem = cuda.shared.array(0, int32)
    hist = smem[:num_experts]
    table = smem[num_experts: num_experts + num_warps * stride]  # per-warp rank totals, one row a warp
    runs = num_experts + num_warps * stride  # per-warp running counts of the open group
    rank_total = smem[runs + num_warps * stride: runs + num_warps * stride + num_ranks]
    for i in range(tid, runs + num_warps * stride, cuda.blockDim.x):
        smem[i] = 0
    for i in range(tid, in_rank.shape[0], cuda.blockDim.x):
        in_rank[i] = False
    cuda.syncthreads()

    num_groups = (num_units + units_per_warp - 1) // units_per_warp
    groups_per_warp = (num_groups + num_warps - 1) // num_warps
    first_group = min(warp * groups_per_warp, num_groups)
    end_group = min(first_group + groups_per_warp, num_groups)
    totals = table[warp * stride: warp * stride + num_ranks]
    running = smem[runs + warp * stride: runs + warp * stride + num_ranks]
    count_groups(topk_idx, experts_per_rank, num_units, units_per_warp, stable, first_group, end_group,
                 (hist, totals, running), (unit_counts, group_counts), in_rank, lane)
    cuda.syncthreads()

    # Level 2: each warp's start per rank (exclusive over warps, in place) and the rank totals.
    for r in range(warp, num_ranks, num_warps):
        value = table[lane * stride + r] if lane < num_warps else np.int32(0)
        inclusive = warp_inclusive_sum(value, lane)
        if lane < num_warps:
            table[lane * stride + r] = inclusive - value
        if lane == WARP - 1:
            rank_total[r] = inclusive
            tokens_per_rank[r] = inclusive
    cuda.syncthreads()

    for i in range(tid, num_experts, cuda.blockDim.x):
        tokens_per_expert[i] = hist[i]
    for i in range(tid, num_ranks, cuda.blockDim.x):
        rank_cursor[i] = 0
    if warp == 0:
        warp_scan(rank_total, rank_psum, num_ranks, False, 0, False)
    if warp == min(1, num_warps - 1):
        total = warp_scan(hist, expert_psum, num_experts, True, 0, False)
        if lane == 0:
            expert_psum[num_experts] = total
    if stable:
        for g in range(first_group, end_group):
            for r in range(lane, num_ranks, WARP):
                group_counts[g, r] += totals[r]
