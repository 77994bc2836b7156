"""Receive kernels: from the rows in this rank's symmetric buffer to ``recv_x`` and the handle's arrays.

Not for a cached dispatch, the counts: every source sent, with its signal, its rows, its entries per
local expert and its routing verdict (``ep_comm.contract.symmetric``, ``counts[2][R][1 + L + 2]``). When any source's
verdict is bad, nothing is received: the counts read as if every source sent no row, so that the copy that
follows copies none. Both count kernels end by writing the host-mapped record (``ep_comm.contract.symmetric``,
:func:`publish_record`) that the host polls for the counts and the verdicts. In compact mode
``receive_count_words_kernel`` (one block) derives everything from those words alone: the
``psum_num_recv_tokens_per_rank`` scan, the per-expert sums, aligned counts and expert psum. Expand mode
needs the per-unit cursors of a scan over the received meta rows: ``receive_count_kernel`` scans word 0
(rows) of every source's count words into the psum, counts rows per local expert (shared-memory
histograms, ticketed last block as in ``count.py``) and lays out the expand placement: aligned expert
starts, the DeepEP V2 expert psum and, in stable mode, per-unit cursors.

Compact mode needs no placement: row ``i`` comes from source ``s`` and slot ``i - psum[s-1]``, so
``receive_compact_kernel`` does the whole receive in one launch, with every warp of the grid on a
piece of a row (ids, weights and metadata with the row's first piece), then marks the unused tail.
A cached compact dispatch has put the payload of this rank's rows to itself in ``recv_x`` already
(``scatter.py``, ``direct``): the kernel copies only the other sources' payload rows then.

Expand mode takes two launches. ``receive_place_kernel`` gives every (row, local expert) entry its
expert-major row and writes ids, weights and metadata, marking padding and unused tail entries;
``receive_rows_kernel`` then moves the payload rows with every warp of the grid: the placement
walks few, long units (its stable order costs a scan over units per expert), the copy needs many
warps in flight. Placement units are cut as in ``units.py``; copies by pieces of rows.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.contract.protocol import RECORD_N, RECORD_TAG, RECORD_VERDICTS, VERDICT_WORDS
from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.routing_check import bad_verdict
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.ticket import block_totals
from ep_comm.kernels.units import lane_entry, lane_place, row_piece, source_of_row, unit_range, units_for_device
from ep_comm.kernels.warp import FULL_MASK, WARP, copy_row, global_warp, lane_id, stable_bucket_slots, warp_scan

PLACE_ATOMIC = 0
PLACE_STABLE = 1
PLACE_CACHED = 2


@cuda.jit(device=True)
def align_up(value, alignment):
    """``value`` (>= 0) rounded up to a multiple of ``alignment``."""
    return quotient32(value + alignment - 1, alignment) * alignment


@cuda.jit(device=True)
def any_bad_source(words, num_local):
    """Whether any source's verdict in the count words ``words [R, 1 + L + VERDICT_WORDS]`` is bad
    (:func:`~ep_comm.kernels.routing_check.bad_verdict`, ``num_local * R`` experts). Call from all threads of the block."""
    num_ranks = words.shape[0]
    at = words.shape[1] - VERDICT_WORDS
    bad = False
    s = cuda.threadIdx.x
    while s < num_ranks:
        bad = bad or bad_verdict(words[s, at], words[s, at + 1], num_local * num_ranks)
        s = np.int32(s + cuda.blockDim.x)
    return cuda.syncthreads_or(np.int32(bad)) != 0


@cuda.jit(device=True)
def rows_psum(rows, psum, bad, coherent):
    """One warp: the inclusive prefix sum of the sources' rows ``rows [R]`` into ``psum [R]`` (``coherent``: see
    :func:`~ep_comm.kernels.warp.warp_scan`), all zero when ``bad`` (nothing is received); returns the total."""
    if bad:
        for s in range(lane_id(), psum.shape[0], WARP):
            psum[s] = 0
        return np.int64(0)
    return warp_scan(rows, psum, psum.shape[0], False, 0, coherent)


@cuda.jit(device=True)
def record_word(w, totals, words, aligned):
    """Word ``w >= RECORD_N`` of the record: N and M (``totals``), every source's raw verdict words (the last
    ``VERDICT_WORDS`` columns of ``words``), the ``aligned`` counts."""
    verdicts_end = RECORD_VERDICTS + words.shape[0] * VERDICT_WORDS
    if w < RECORD_VERDICTS:
        return np.int64(totals[w - RECORD_N])
    if w < verdicts_end:
        s, j = divmod32(w - RECORD_VERDICTS, VERDICT_WORDS)
        return np.int64(words[s, words.shape[1] - VERDICT_WORDS + j])
    return np.int64(aligned[w - verdicts_end])


@cuda.jit(device=True)
def publish_record(record, tag, totals, words, aligned):
    """Write the record (int64 ``[record_words(R, L)]``, host-mapped on a GPU; ``ep_comm.contract.symmetric``): N and M
    from ``totals [2]``, every source's verdict words from ``words [R, 1 + L + VERDICT_WORDS]``, the ``aligned [L]``
    counts, then, after a system fence, ``tag`` (the step number) last, so that a host that sees the tag sees
    the rest. Call from all threads of one block, once ``totals`` and ``aligned`` are written and synced."""
    w = RECORD_N + cuda.threadIdx.x
    while w < record.shape[0]:
        record[w] = record_word(w, totals, words, aligned)
        w = np.int32(w + cuda.blockDim.x)
    cuda.threadfence_system()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        record[RECORD_TAG] = tag


@cuda.jit(device=True)
def lane_local_expert(meta, rank_psum, first_row, end, place):
    """Compact row, entry column, source, slot and local expert (-1: none) of a lane in a row group, from its
    :func:`~ep_comm.kernels.units.lane_place` for K entries."""
    row, k, active = lane_entry(first_row, end, place)
    src = 0
    slot = 0
    expert = np.int32(-1)
    if active:
        src, slot = source_of_row(rank_psum, row)
        expert = meta[src, slot, 1 + k]
    return row, k, active, src, slot, expert


@cuda.jit(device=True)
def add_local_expert(expert, hist, stable, unit_counts, unit):
    """Count one entry's local expert (-1: none) in ``hist`` and, with ``stable``, in ``unit_counts[unit]``."""
    if expert >= 0:
        cuda.atomic.add(hist, expert, 1)
        if stable:
            cuda.atomic.add(unit_counts, (unit, expert), 1)


@cuda.jit(device=True)
def count_local_experts(meta, psum, num_units, hist, stable, unit_counts):
    """Count received entries per local expert into the block histogram ``hist [L]`` (shared) and, with
    ``stable``, per unit into ``unit_counts [units, L]``; ``psum [R]``: inclusive rows per source.

    Each step reads four row groups' metadata before counting, so four loads are in flight.
    """
    num_topk = (meta.shape[2] - 1) // 2
    num_local = hist.shape[0]
    num_rows = psum[psum.shape[0] - 1]
    lane = lane_id()
    place = lane_place(num_topk, lane)
    group = quotient32(WARP, num_topk)
    unit, num_warps = global_warp()
    unit = np.int32(unit)
    while unit < num_units:
        begin, end = unit_range(unit, num_units, num_rows)
        if stable:
            for e in range(lane, num_local, WARP):
                unit_counts[unit, e] = 0
            cuda.syncwarp(FULL_MASK)
        r0 = np.int32(begin)
        while r0 < end:
            e0 = lane_local_expert(meta, psum, r0, end, place)[5]
            e1 = lane_local_expert(meta, psum, r0 + group, end, place)[5]
            e2 = lane_local_expert(meta, psum, r0 + 2 * group, end, place)[5]
            e3 = lane_local_expert(meta, psum, r0 + 3 * group, end, place)[5]
            add_local_expert(e0, hist, stable, unit_counts, unit)
            add_local_expert(e1, hist, stable, unit_counts, unit)
            add_local_expert(e2, hist, stable, unit_counts, unit)
            add_local_expert(e3, hist, stable, unit_counts, unit)
            r0 = np.int32(r0 + 4 * group)
        unit = np.int32(unit + num_warps)


@kernel
def receive_count_kernel(counts_by_parity, meta_by_parity, step, alignment, stable, rows_per_unit, max_units,
                         counters, ticket, unit_counts, rank_psum, unaligned, aligned, expert_psum, expert_cursor,
                         totals, record):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_count`, expand mode; dynamic shared memory: int32
    ``[R + 2L]``.

    The received rows are cut into ``units_for(N, rows_per_unit, max_units)`` units, a cut that
    :func:`receive_place_kernel` repeats from the same arguments.
    """
    words = counts_by_parity[step_parity(step, 0)]
    meta = meta_by_parity[step_parity(step, 0)]
    num_ranks = words.shape[0]
    num_local = unaligned.shape[0]
    smem = cuda.shared.array(0, int32)
    psum = smem[:num_ranks]
    hist = smem[num_ranks: num_ranks + num_local]
    start = smem[num_ranks + num_local: num_ranks + 2 * num_local]
    i = cuda.threadIdx.x
    while i < num_local:
        hist[i] = 0
        i = np.int32(i + cuda.blockDim.x)
    bad = any_bad_source(words, num_local)
    if cuda.threadIdx.x < WARP:
        rows_psum(words[:, 0], psum, bad, True)
    cuda.syncthreads()

    num_rows = psum[num_ranks - 1]
    num_units = units_for_device(num_rows, rows_per_unit, max_units)
    count_local_experts(meta, psum, num_units, hist, stable, unit_counts)
    cuda.syncthreads()

    if not block_totals(hist, counters, ticket):
        return
    i = cuda.threadIdx.x
    while i < num_local + num_ranks:
        if i < num_local:
            unaligned[i] = hist[i]
            aligned[i] = align_up(hist[i], alignment)
            start[i] = align_up(hist[i], alignment)
        else:
            rank_psum[i - num_local] = psum[i - num_local]
        i = np.int32(i + cuda.blockDim.x)
    cuda.syncthreads()
    if cuda.threadIdx.x < WARP:
        total = warp_scan(start, start, num_local, True, 0, False)
        if lane_id() == 0:
            totals[0] = num_rows
            totals[1] = total
    cuda.syncthreads()
    publish_record(record, step[0], totals, words, aligned)
    e = cuda.threadIdx.x
    while e < num_local:
        expert_cursor[e] = start[e]
        expert_psum[e] = start[e] + hist[e]
        e = np.int32(e + cuda.blockDim.x)
    e = cuda.threadIdx.x // WARP
    while stable and e < num_local:
        column = unit_counts[:num_units, e]
        warp_scan(column, column, num_units, True, start[e], True)
        e = np.int32(e + cuda.blockDim.x // WARP)


@kernel
def receive_count_words_kernel(counts_by_parity, step, alignment, rank_psum, unaligned, aligned, expert_psum,
                               totals, record):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_count`, compact mode: one block, which reads only
    the ``[R, 1 + L + 2]`` count words of the parity of ``step``; dynamic shared memory: int32 ``[L]``.
    """
    words = counts_by_parity[step_parity(step, 0)]
    num_ranks = words.shape[0]
    num_local = unaligned.shape[0]
    sizes = cuda.shared.array(0, int32)
    bad = any_bad_source(words, num_local)
    sources = 0 if bad else num_ranks
    e = cuda.threadIdx.x
    while e < num_local:
        count = 0
        for s in range(sources):
            count += words[s, 1 + e]
        size = align_up(count, alignment)
        unaligned[e] = count
        aligned[e] = size
        sizes[e] = size
        e = np.int32(e + cuda.blockDim.x)
    cuda.syncthreads()
    warp = cuda.threadIdx.x // WARP
    if warp == 0:
        num_rows = rows_psum(words[:, 0], rank_psum, bad, False)
        if lane_id() == 0:
            totals[0] = num_rows
    elif warp == 1:
        total = warp_scan(sizes, expert_psum, num_local, False, 0, False)
        if lane_id() == 0:
            totals[1] = total
    cuda.syncthreads()
    publish_record(record, step[0], totals, words, aligned)


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


@kernel
def receive_rows_kernel(rank_psum, rows_by_parity, step, zero_padding, expert_psum, alignment, recv_src_metadata,
                        recv_x, wide, span):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_copy`, expand mode: the payload rows, one warp
    per piece of ``span`` words (even) of a received row, copied to each of its expanded rows.

    Runs after :func:`receive_place_kernel`, whose metadata says where each row goes. ``wide``: rows
    move 16 bytes per access (see :func:`~ep_comm.kernels.warp.copy_row`).
    """
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


@kernel
def receive_compact_kernel(rank_psum, rows_by_parity, meta_by_parity, step, recv_topk_idx, recv_weight_bits,
                           recv_src_metadata, recv_x, wide, span, skip_source):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_copy`, compact mode: the whole receive in one
    launch, one warp per piece of ``span`` words (even) of a row (ids and weight bits ``[N_out, K]``).

    Row ``i`` is slot ``i - psum[s-1]`` of source ``s`` (:func:`~ep_comm.kernels.units.source_of_row`),
    so nothing needs placing: a row's first piece also writes its ids, weights and metadata, loaded
    before the piece's copy so that those loads overlap the payload's. Then the grid marks the tail
    past ``N``. ``wide``: rows move 16 bytes per access (see :func:`~ep_comm.kernels.warp.copy_row`).
    """
    rows = rows_by_parity[step_parity(step, 0)]
    meta = meta_by_parity[step_parity(step, 0)]
    max_tokens = meta.shape[1]
    num_rows = rank_psum[rank_psum.shape[0] - 1]
    words = recv_x.shape[1]
    pieces = quotient32(words + span - 1, span)
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_rows * pieces:
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
