"""Receive copy kernels: from the rows in this rank's symmetric buffer to ``recv_x`` and the handle's arrays, by
the counts of ``receive_count.py`` (a cached dispatch: of its handle).

Compact mode needs no placement: row ``i`` comes from source ``s`` and slot ``i - psum[s-1]``, so
``receive_compact_kernel`` does the whole receive in one launch, with every warp of the grid on a
piece of a row (ids, weights and metadata with the row's first piece), then marks the unused tail.
A cached compact dispatch has put the payload of this rank's rows to itself in ``recv_x`` already
(``scatter.py``, ``direct``): the kernel copies only the other sources' payload rows then. A new routing's compact
receive into outputs allocated before its counts are known (``cpu_sync=False``) counts in the same launch
(``receive_counted_compact_kernel``: each block scans the sources' rows from the count words itself; block 0 writes
the receive count's results and record while the other blocks copy the rows), one dependent launch fewer.

Expand mode takes two launches. ``receive_place_kernel`` gives every (row, local expert) entry its
expert-major row and writes ids, weights and metadata, marking padding and unused tail entries;
``receive_rows_kernel`` then moves the payload rows with every warp of the grid: the placement
walks few, long units (its stable order costs a scan over units per expert), the copy needs many
warps in flight. Placement units are cut as in ``units.py``; copies by pieces of rows.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.receive_count import align_up, any_bad_source, count_words, lane_local_expert, rows_psum
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import ROW_MAX_REGISTERS, legacy
from ep_comm.kernels.units import lane_place, row_piece, source_of_row, unit_range, units_for_device
from ep_comm.kernels.warp import WARP, copy_row, global_warp, lane_id, stable_bucket_slots

PLACE_ATOMIC = 0
PLACE_STABLE = 1
PLACE_CACHED = 2
COUNT_APART = not legacy("count_apart")  # a compile-time constant of the kernels


@cuda.jit(device=True)
def place_expanded(mode, recorded, expert_cursor, unit_cursor, row, k, active, expert, lane):
    """Expanded row of a lane's (row, local expert) entry, -1 if none. Call with all lanes of the warp."""
    if mode == PLACE_CACHED:
        return np.int32(recorded[row, 2 + k]) if active and expert >= 0 else np.int32(-1)
    if mode == PLACE_STABLE:
        return stable_bucket_slots(unit_cursor, expert, expert >= 0, lane)
    return cuda.atomic.add(expert_cursor, expert, 1) if expert >= 0 else np.int32(-1)


@cuda.jit(device=True)
def num_expanded_rows(expert_psum, alignment):
    """Rows of the expand layout, padding included, from the expand-mode expert psum."""
    num_local = expert_psum.shape[0]
    return align_up(expert_psum[num_local - 1], alignment) if num_local > 0 else 0


@cuda.jit(device=True)
def grid_thread():
    """Index of the calling thread in the grid and the number of threads in the grid (1-D)."""
    warp, num_warps = global_warp()
    return warp * WARP + lane_id(), num_warps * WARP


@cuda.jit(device=True)
def mark_tail(recv_topk_idx, recv_weight_bits, recv_src_metadata, num_rows, first_unused):
    """-1 metadata on rows from ``num_rows`` on, -1 ids and zero weights on rows from ``first_unused`` on
    (one thread of the grid per entry)."""
    thread, threads = grid_thread()
    meta_width = recv_src_metadata.shape[1]
    j = np.int32(thread)
    while j < (recv_src_metadata.shape[0] - num_rows) * meta_width:
        row, column = divmod32(j, meta_width)
        recv_src_metadata[num_rows + row, column] = -1
        j = np.int32(j + threads)
    width = recv_topk_idx.shape[1]
    j = np.int32(thread)
    while j < (recv_topk_idx.shape[0] - first_unused) * width:
        row, column = divmod32(j, width)
        recv_topk_idx[first_unused + row, column] = -1
        recv_weight_bits[first_unused + row, column] = 0
        j = np.int32(j + threads)


@cuda.jit(device=True)
def padding_row(expert_psum, job, alignment):
    """Row of padding job ``job`` (``alignment - 1`` jobs per local expert, ``alignment > 1``: the rows after its
    end ``expert_psum[e]``) and whether it is padding (below the expert's aligned end)."""
    e, offset = divmod32(job, alignment - 1)
    end = expert_psum[e]
    return end + offset, end + offset < align_up(end, alignment)


@cuda.jit(device=True)
def mark_padding(recv_topk_idx, recv_weight_bits, expert_psum, alignment):
    """-1 ids, zero weights on the expand padding (ids and weights ``[M, 1]``): rows between each expert's
    end ``expert_psum[e]`` and its aligned end (one thread of the grid per row; ``alignment > 1``)."""
    thread, threads = grid_thread()
    j = np.int32(thread)
    while j < expert_psum.shape[0] * (alignment - 1):
        row, padding = padding_row(expert_psum, j, alignment)
        if padding:
            recv_topk_idx[row, 0] = -1
            recv_weight_bits[row, 0] = 0
        j = np.int32(j + threads)


@cuda.jit(device=True)
def entry_weight_bits(meta, src, slot, k, expert):
    """Bits of the float32 weight of entry ``k`` of source ``src``'s row ``slot``, 0 where its local
    ``expert`` is -1 (none)."""
    num_topk = (meta.shape[2] - 1) // 2
    return meta[src, slot, 1 + num_topk + k] if expert >= 0 else 0


@cuda.jit(device=True)
def write_row_origin(recv_src_metadata, row, src, slot, token, max_tokens):
    """Columns 0 and 1 of a received row's metadata: ``src * max_tokens`` plus its ``token`` at the
    source, and plus its ``slot`` in the buffer."""
    recv_src_metadata[row, 0] = src * max_tokens + token
    recv_src_metadata[row, 1] = src * max_tokens + slot


@kernel
def receive_place_kernel(rank_psum, meta_by_parity, step, mode, rows_per_unit, max_units, expert_cursor,
                         unit_cursor, expert_psum, alignment, recv_topk_idx, recv_weight_bits, recv_src_metadata):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_copy`, expand mode: everything but the payload
    rows (ids and weight bits ``[M_out, 1]``).

    Rows are cut into ``units_for(N, rows_per_unit, max_units)`` units: the cut of
    :func:`receive_count_kernel` in stable mode, any other cut else.
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    meta = meta_by_parity[step_parity(step, 0)]
    num_ranks = rank_psum.shape[0]
    max_tokens = meta.shape[1]
    num_topk = (meta.shape[2] - 1) // 2
    num_rows = rank_psum[num_ranks - 1]
    num_units = units_for_device(num_rows, rows_per_unit, max_units)
    lane = lane_id()
    place = lane_place(num_topk, lane)
    group = quotient32(WARP, num_topk)
    unit, num_warps = global_warp()
    unit = np.int32(unit)
    while unit < num_units:
        begin, end = unit_range(unit, num_units, num_rows)
        r0 = np.int32(begin)
        while r0 < end:
            row, k, active, src, slot, expert = lane_local_expert(meta, rank_psum, r0, end, place)
            weight_bits = entry_weight_bits(meta, src, slot, k, expert)
            if active and k == 0:
                write_row_origin(recv_src_metadata, row, src, slot, meta[src, slot, 0], max_tokens)
            dst = place_expanded(mode, recv_src_metadata, expert_cursor, unit_cursor[unit], row, k, active, expert,
                                 lane)
            if active:
                recv_src_metadata[row, 2 + k] = dst
            if dst >= 0:
                recv_topk_idx[dst, 0] = expert
                recv_weight_bits[dst, 0] = weight_bits
            r0 = np.int32(r0 + group)
        unit = np.int32(unit + num_warps)
    mark_tail(recv_topk_idx, recv_weight_bits, recv_src_metadata, num_rows, num_expanded_rows(expert_psum, alignment))
    if alignment > 1:
        mark_padding(recv_topk_idx, recv_weight_bits, expert_psum, alignment)


@kernel(max_registers=ROW_MAX_REGISTERS)
def receive_rows_kernel(rank_psum, rows_by_parity, step, zero_padding, expert_psum, alignment, recv_src_metadata,
                        recv_x, wide, span):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_copy`, expand mode: the payload rows, one warp
    per piece of ``span`` words (even) of a received row, copied to each of its expanded rows.

    Runs after :func:`receive_place_kernel`, whose metadata says where each row goes. ``wide``: rows
    move 16 bytes per access (see :func:`~ep_comm.kernels.warp.copy_row`).
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    rows = rows_by_parity[step_parity(step, 0)]
    max_tokens = rows.shape[1]
    num_topk = recv_src_metadata.shape[1] - 2
    num_rows = rank_psum[rank_psum.shape[0] - 1]
    words = recv_x.shape[1]
    pieces = quotient32(words + span - 1, span)
    lane = lane_id()
    warp, num_warps = global_warp()
    item = np.int32(warp)
    while item < num_rows * pieces:
        row, begin, end = row_piece(item, pieces, span, words)
        src, slot = divmod32(recv_src_metadata[row, 1], max_tokens)
        piece = rows[src, slot, begin:end]
        for k in range(num_topk):
            dst = recv_src_metadata[row, 2 + k]
            if dst >= 0:
                copy_row(recv_x[dst, begin:end], piece, end - begin, wide)
        item = np.int32(item + num_warps)
    job = np.int32(warp)
    while zero_padding and alignment > 1 and job < expert_psum.shape[0] * (alignment - 1):
        row, padding = padding_row(expert_psum, job, alignment)
        if padding:
            for w in range(lane, words, WARP):
                recv_x[row, w] = 0
        job = np.int32(job + num_warps)


@cuda.jit(device=True)
def load_row_entries(meta, src, slot, lane, first):
    """What ``lane`` writes for source ``src``'s row ``slot`` on the row's ``first`` piece: the local expert
    (-1: none) and weight bits of entry ``lane`` (lanes below K), and the row's token at the source (lane 0);
    ``(-1, 0, 0)`` where there is nothing to write."""
    num_topk = (meta.shape[2] - 1) // 2
    expert = meta[src, slot, 1 + lane] if first and lane < num_topk else np.int32(-1)
    token = meta[src, slot, 0] if first and lane == 0 else np.int32(0)
    return expert, entry_weight_bits(meta, src, slot, lane, expert), token


@cuda.jit(device=True)
def store_row_entries(recv_topk_idx, recv_weight_bits, recv_src_metadata, row, src, slot, max_tokens, lane, loaded):
    """Write compact row ``row``'s ids, weight bits and metadata from what :func:`load_row_entries` loaded
    (all lanes of a warp, on the row's first piece)."""
    expert, weight_bits, token = loaded
    if lane < recv_topk_idx.shape[1]:
        recv_topk_idx[row, lane] = expert
        recv_weight_bits[row, lane] = weight_bits
        recv_src_metadata[row, 2 + lane] = -1
    if lane == 0:
        write_row_origin(recv_src_metadata, row, src, slot, token, max_tokens)


@cuda.jit(device=True)
def copy_compact(rank_psum, rows, meta, recv_topk_idx, recv_weight_bits, recv_src_metadata, recv_x, wide, span,
                 skip_source, first_block):
    """The compact receive of the rows and meta rows of one parity (``rows``, ``meta``) by every warp of the grid's
    blocks from ``first_block`` on (:func:`receive_compact_kernel`), ``rank_psum [R]`` the inclusive rows per source
    (global or shared); then the grid, every block, marks the tail."""
    max_tokens = meta.shape[1]
    num_rows = rank_psum[rank_psum.shape[0] - 1]
    words = recv_x.shape[1]
    pieces = quotient32(words + span - 1, span)
    lane = lane_id()
    item, num_warps = global_warp()
    skipped = first_block * (cuda.blockDim.x // WARP)  # the warps of the blocks before first_block copy nothing
    item = np.int32(item - skipped)
    num_warps = np.int32(num_warps - skipped)
    while item >= 0 and item < num_rows * pieces:
        row, begin, end = row_piece(item, pieces, span, words)
        src, slot = source_of_row(rank_psum, row)
        first = begin == 0
        loaded = load_row_entries(meta, src, slot, lane, first)
        if src != skip_source:
            copy_row(recv_x[row, begin:end], rows[src, slot, begin:end], end - begin, wide)
        if first:
            store_row_entries(recv_topk_idx, recv_weight_bits, recv_src_metadata, row, src, slot, max_tokens, lane,
                              loaded)
        item = np.int32(item + num_warps)
    mark_tail(recv_topk_idx, recv_weight_bits, recv_src_metadata, num_rows, num_rows)


@kernel(max_registers=ROW_MAX_REGISTERS)
def receive_compact_kernel(rank_psum, rows_by_parity, meta_by_parity, step, recv_topk_idx, recv_weight_bits,
                           recv_src_metadata, recv_x, wide, span, skip_source):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_copy`, compact mode: the whole receive in one
    launch, one warp per piece of ``span`` words (even) of a row (ids and weight bits ``[N_out, K]``).

    Row ``i`` is slot ``i - psum[s-1]`` of source ``s`` (:func:`~ep_comm.kernels.units.source_of_row`),
    so nothing needs placing: a row's first piece also writes its ids, weights and metadata, loaded
    before the piece's copy so that those loads overlap the payload's. Then the grid marks the tail
    past ``N``. ``wide``: rows move 16 bytes per access (see :func:`~ep_comm.kernels.warp.copy_row`).
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, 0)
    copy_compact(rank_psum, rows_by_parity[parity], meta_by_parity[parity], recv_topk_idx, recv_weight_bits,
                 recv_src_metadata, recv_x, wide, span, skip_source, 0)


@kernel(max_registers=ROW_MAX_REGISTERS)
def receive_counted_compact_kernel(counts_by_parity, step, alignment, rank_psum, unaligned, aligned, expert_psum,
                                   totals, record, rows_by_parity, meta_by_parity, recv_topk_idx, recv_weight_bits,
                                   recv_src_metadata, recv_x, wide, span):
    """The compact receive count and copy of a new routing in one launch (see
    :func:`ep_comm.launching.kernel_launches.Kernels.receive_counted`); dynamic shared memory: int32 ``[R + L]``.

    Every block scans the sources' rows in the count words (zero when any verdict is bad) into shared memory, the
    psum :func:`copy_compact` walks; block 0 writes what
    :func:`~ep_comm.kernels.receive_count.receive_count_words_kernel` writes (:func:`count_words`, the record
    last) while the other blocks copy the rows (:data:`COUNT_APART`: the launch has one block more than the copy's
    shape for it; a grid of one block, or ``EP_COMM_KERNEL_LEGACY=count_apart``, has block 0 copy its share after
    counting). Every block marks its share of the tail.
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, 0)
    words = counts_by_parity[parity]
    num_ranks = words.shape[0]
    smem = cuda.shared.array(0, int32)
    psum = smem[:num_ranks]
    bad = any_bad_source(words, unaligned.shape[0])
    if cuda.threadIdx.x < WARP:
        rows_psum(words[:, 0], psum, bad, False)
    cuda.syncthreads()
    if cuda.blockIdx.x == 0:  # the same in every thread of the block: count_words syncs it
        count_words(words, step, alignment, rank_psum, unaligned, aligned, expert_psum, totals, record,
                    smem[num_ranks:num_ranks + unaligned.shape[0]])
    first_block = 1 if COUNT_APART and cuda.gridDim.x > 1 else 0
    copy_compact(psum, rows_by_parity[parity], meta_by_parity[parity], recv_topk_idx, recv_weight_bits,
                 recv_src_metadata, recv_x, wide, span, -1, first_block)
