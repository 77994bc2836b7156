"""Rank scatter: give each (token, destination rank) pair a slot and write its row and meta row there.

Destinations are a tuple of per-rank arrays (NVSHMEM peer views on a GPU), indexed by a runtime
rank. Slots come from one of three sources (``mode``): an atomic counter per destination rank
(``SLOT_ATOMIC``, any order), the stable per-unit cursors left by the count kernel
(``SLOT_STABLE``: slot = number of earlier tokens going to the same rank), or a recorded
``dst_buffer_slot_idx`` (``SLOT_CACHED``, no counting).

Few tokens with long rows (decode) cut each row into pieces, one warp each (:func:`scatter_rows_kernel`). Their
slots are assigned first by :func:`scatter_kernel`, or, stable and when every unit of the cut is one warp step at
most, by every piece's warp itself (:func:`step_slot`: the count's unit start plus a ballot over the step's
entries), so that slots and rows are one launch.

With ``direct`` (a cached compact dispatch, whose receive layout is the handle's) the payload of a
row this rank sends to itself skips its own buffer: it goes straight to its compact output row
``recv_x[base + slot]``, ``base`` the rows received from lower sources (``recv_psum[src_rank - 1]``,
0 at rank 0), and the receive copies only the other sources' rows. Its meta row still goes to the
own buffer, which the receive reads for ids, weights and metadata.

A row's ``row_words`` words come from its source (``ep_comm.kernels.payload``): the payload words as they are,
or a packed FP8 row written from the FP8 pair, or cast from the payload, as the row is read (no packed copy is
made before the scatter).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ep_comm.kernels.expert_ids import routed_expert
from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.payload import write_row_piece
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import ROW_MAX_REGISTERS
from ep_comm.kernels.units import lane_entry, lane_place, row_piece, unit_range
from ep_comm.kernels.warp import (
    FULL_MASK,
    WARP,
    ballot,
    bucket_rank,
    global_warp,
    is_group_leader,
    lane_id,
    pop_lowest,
    stable_bucket_slots,
)

SLOT_ATOMIC = 0
SLOT_STABLE = 1
SLOT_CACHED = 2


@cuda.jit(device=True)
def write_meta(meta, topk_idx, weight_bits, has_weights, token, rank, experts_per_rank, lane):
    """Meta row of (token, rank): source token, K local expert ids (-1 off this rank), the K weights' bits
    as given (0 without weights; the receiver masks them)."""
    num_topk = topk_idx.shape[1]
    if lane == 0:
        meta[0] = token
    if lane < num_topk:
        expert = np.int64(topk_idx[token, lane])
        on_rank = expert >= 0 and quotient32(expert, experts_per_rank) == rank
        meta[1 + lane] = expert - rank * experts_per_rank if on_rank else -1
        meta[1 + num_topk + lane] = weight_bits[token, lane] if has_weights else 0


@cuda.jit(device=True)
def assign_slot(mode, topk_idx, slot_idx, rank_cursor, unit_cursor, t, k, active, rank, first, src_base, lane):
    """Slot of a lane's (token, rank) pair, -1 if the lane is not its pair's first entry; records it in ``slot_idx``.

    Must be called by all lanes of the warp (stable mode uses warp collectives).
    """
    if mode == SLOT_CACHED:
        recorded = np.int32(slot_idx[t, k]) if active else np.int32(-1)
        return recorded - src_base if recorded >= 0 else -1
    if mode == SLOT_STABLE:
        slot = stable_bucket_slots(unit_cursor, rank, first, lane)
    else:
        slot = cuda.atomic.add(rank_cursor, rank, 1) if first else -1
    if active:
        slot_idx[t, k] = src_base + slot if first else -1
    return slot


@cuda.jit(device=True)
def unit_start(unit_counts, group_counts, unit, units_per_warp, rank):
    """The first stable slot of ``unit``'s tokens in ``rank``: its start inside its count group
    (``unit_counts [U, R]``) plus the group's start (``group_counts [groups, R]``, as the stable count left them)."""
    return unit_counts[unit, rank] + group_counts[quotient32(unit, units_per_warp), rank]


@cuda.jit(device=True)
def start_stable_unit(unit_cursor, group_counts, unit, units_per_warp, lane):
    """Turn unit ``unit``'s start inside its count group into its start inside each rank (``unit_cursor[unit]``)."""
    num_ranks = unit_cursor.shape[1]
    for r in range(lane, num_ranks, WARP):
        unit_cursor[unit, r] = unit_start(unit_cursor, group_counts, unit, units_per_warp, r)
    cuda.syncwarp(FULL_MASK)


@cuda.jit(device=True)
def step_pairs(topk_idx, experts_per_rank, num_ranks, t0, end, place, lane):
    """A lane's entry in the warp step of tokens ``[t0, end)`` (its :func:`~ep_comm.kernels.units.lane_place`
    ``place``): ``(t, k, active, rank, first)``, ``rank`` its destination (-1: no expert) and ``first`` whether it
    is the first entry of token ``t`` for that rank (its (token, rank) pair's). Call with all lanes of the warp."""
    t, k, active = lane_entry(t0, end, place)
    expert = routed_expert(topk_idx, t, k, experts_per_rank * num_ranks) if active else np.int64(-1)
    rank = quotient32(expert, experts_per_rank) if expert >= 0 else np.int64(-1)
    key = np.int32((t - t0) * num_ranks + rank) if expert >= 0 else np.int32(-1 - lane)
    first = is_group_leader(key, lane) and expert >= 0
    return t, k, active, rank, first


@cuda.jit(device=True)
def step_slot(topk_idx, experts_per_rank, num_ranks, unit_counts, group_counts, num_units, units_per_warp, t, k,
              lane):
    """The stable slot of entry ``(t, k)`` (-1: not its pair's first entry, or no expert), on every lane, when each
    of the ``num_units`` units of the token cut is one warp step at most: the start of ``t``'s unit in the entry's
    rank (:func:`unit_start`, one load per lane for rank ``lane`` while the step's ids load) plus the pairs of that
    rank before it in the step. Every lane must hold the same ``(t, k)``."""
    num_tokens, num_topk = topk_idx.shape
    unit = quotient32(t, quotient32(num_tokens + num_units - 1, num_units))  # unit_range's cut
    begin, end = unit_range(unit, num_units, num_tokens)
    own = unit_start(unit_counts, group_counts, unit, units_per_warp, lane) if lane < num_ranks else np.int32(0)
    _, _, _, rank, first = step_pairs(topk_idx, experts_per_rank, num_ranks, begin, end, lane_place(num_topk, lane),
                                      lane)
    below = bucket_rank(rank, first, lane)[0]
    if num_ranks <= WARP:
        start = cuda.shfl_sync(FULL_MASK, own, np.int32(rank) if first else np.int32(0))
    else:
        start = unit_start(unit_counts, group_counts, unit, units_per_warp, rank) if first else np.int32(0)
    slot = np.int32(start + below) if first else np.int32(-1)
    return cuda.shfl_sync(FULL_MASK, slot, np.int32((t - begin) * num_topk + k))


@cuda.jit(device=True)
def local_row_base(direct, recv_psum, src_rank):
    """First compact output row of the rows from ``src_rank`` (``recv_psum [R]`` int32, inclusive), 0
    without ``direct``."""
    return np.int64(recv_psum[src_rank - 1]) if direct and src_rank > 0 else np.int64(0)


@cuda.jit(device=True)
def copy_payload(rows, recv_x, direct, base, parity, src_rank, rank, slot, source, t, begin, end, wide):
    """Write words ``[begin, end)`` of token ``t``'s row from ``source`` (``ep_comm.kernels.payload``) to this
    source's row ``slot`` for ``rank``: ``recv_x[base + slot]`` when it stays on this rank with ``direct``, else
    ``rows[rank][parity, src_rank, slot]`` (all lanes of a warp)."""
    if direct and rank == src_rank:
        write_row_piece(recv_x[base + slot], source, t, begin, end, wide)
    else:
        write_row_piece(rows[rank][parity, src_rank, slot], source, t, begin, end, wide)


@kernel(max_registers=ROW_MAX_REGISTERS)
def scatter_kernel(source, row_words, wide, topk_idx, weight_bits, has_weights, experts_per_rank, src_rank, step, ahead,
                   mode, num_units, units_per_warp, rank_cursor, unit_cursor, group_counts, slot_idx, copy_rows, rows,
                   metas, written_first, written_end, direct, recv_x, recv_psum):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.scatter`; ``source``: where the rows come from
    (``ep_comm.kernels.payload``), ``row_words`` words per row; ``wide``: rows move 16 bytes per access (see
    :func:`~ep_comm.kernels.warp.copy_row`). Stable mode reads the cursors that
    :func:`~ep_comm.kernels.count.count_kernel` left with the same ``num_units`` and ``units_per_warp``.
    Without ``copy_rows`` only the slots are assigned (into ``slot_idx``): :func:`scatter_rows_kernel`
    writes the rows and meta rows next. Rows and meta rows go only to the ranks in ``[written_first, written_end)``
    (every rank's slot is assigned). ``direct``, ``recv_x [N_out, W]`` words and ``recv_psum [R]``: see
    :func:`copy_payload` (``recv_x`` and ``recv_psum`` are not read without ``direct``)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    num_tokens, num_topk = topk_idx.shape
    parity = step_parity(step, ahead)
    num_ranks = len(rows)
    max_tokens = rows[0].shape[2]
    src_base = src_rank * max_tokens
    base = local_row_base(direct, recv_psum, src_rank)
    lane = lane_id()
    place = lane_place(num_topk, lane)
    group = quotient32(WARP, num_topk)
    unit, num_warps = global_warp()
    unit = np.int32(unit)
    while unit < num_units:
        begin, end = unit_range(unit, num_units, num_tokens)
        if mode == SLOT_STABLE:
            start_stable_unit(unit_cursor, group_counts, unit, units_per_warp, lane)
        t0 = np.int32(begin)
        while t0 < end:
            t, k, active, rank, first = step_pairs(topk_idx, experts_per_rank, num_ranks, t0, end, place, lane)
            slot = assign_slot(mode, topk_idx, slot_idx, rank_cursor, unit_cursor[unit], t, k, active, rank, first,
                               src_base, lane)
            pairs = ballot(slot >= 0 and copy_rows and written_first <= rank < written_end)
            while pairs != 0:
                src, pairs = pop_lowest(pairs)
                pt = cuda.shfl_sync(FULL_MASK, t, src)
                pr = cuda.shfl_sync(FULL_MASK, rank, src)
                ps = cuda.shfl_sync(FULL_MASK, slot, src)
                copy_payload(rows, recv_x, direct, base, parity, src_rank, pr, ps, source, pt, 0, row_words, wide)
                write_meta(metas[pr][parity, src_rank, ps], topk_idx, weight_bits, has_weights, pt, pr,
                           experts_per_rank, lane)
            t0 = np.int32(t0 + group)
        unit = np.int32(unit + num_warps)


@kernel(max_registers=ROW_MAX_REGISTERS)
def scatter_rows_kernel(source, row_words, wide, topk_idx, weight_bits, has_weights, experts_per_rank, src_rank, step,
                        ahead, span, own_slots, num_units, units_per_warp, unit_counts, group_counts, slot_idx, rows,
                        metas, written_first, written_end, direct, recv_x, recv_psum):
    """The rows and meta rows of :func:`scatter_kernel`, from the slots in ``slot_idx [T, K]`` (recorded by
    it or cached): one warp per piece of ``span`` words (a multiple of 32) of each entry that has a slot, so that few
    tokens still spread over many warps; the warp of a row's first piece writes its meta row.
    ``written_first``, ``written_end``, ``direct``, ``recv_x``, ``recv_psum``: as in :func:`scatter_kernel`.

    ``own_slots``: no slots were assigned before; each warp takes its entry's stable slot itself
    (:func:`step_slot`, from the ``unit_counts`` and ``group_counts`` a stable count left for ``num_units`` units of
    at most one warp step each, ``units_per_warp`` per count group), and the warp of its first piece records it in
    ``slot_idx`` (``src_rank * max_tokens + slot``, -1 where none), as :func:`scatter_kernel` would have. Without it
    those four arguments are not read."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    num_tokens, num_topk = topk_idx.shape
    num_ranks = len(rows)
    parity = step_parity(step, ahead)
    max_tokens = rows[0].shape[2]
    src_base = src_rank * max_tokens
    base = local_row_base(direct, recv_psum, src_rank)
    pieces = quotient32(row_words + span - 1, span)
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_tokens * num_topk * pieces:  # the same item on every lane: step_slot is a collective
        entry, begin, end = row_piece(item, pieces, span, row_words)
        t, k = divmod32(entry, num_topk)
        expert = routed_expert(topk_idx, t, k, experts_per_rank * num_ranks)
        if own_slots:
            slot = step_slot(topk_idx, experts_per_rank, num_ranks, unit_counts, group_counts, num_units,
                             units_per_warp, t, k, lane)
            if begin == 0 and lane == 0:
                slot_idx[t, k] = src_base + slot if slot >= 0 else -1
        else:
            recorded = slot_idx[t, k]
            slot = recorded - src_base if recorded >= 0 else np.int32(-1)
        rank = quotient32(expert, experts_per_rank) if expert >= 0 else np.int32(-1)
        if slot >= 0 and written_first <= rank < written_end:
            copy_payload(rows, recv_x, direct, base, parity, src_rank, rank, slot, source, t, begin, end, wide)
            if begin == 0:
                write_meta(metas[rank][parity, src_rank, slot], topk_idx, weight_bits, has_weights, t, rank,
                           experts_per_rank, lane)
        item = np.int32(item + num_warps)
