"""Receive count kernels: what arrived in this rank's symmetric buffer, counted before the copy (``receive.py``).

Not for a cached dispatch, the counts: every source sent, with its signal, its rows, its entries per
local expert and its routing verdict (``ep_comm.contract.symmetric``, ``counts[2][R][1 + L + 2]``). When any source's
verdict is bad, nothing is received: the counts read as if every source sent no row, so that the copy that
follows copies none. Both count kernels end by writing the host-mapped record (``ep_comm.contract.symmetric``,
:func:`publish_record`) that the host polls for the counts and the verdicts. In compact mode
``receive_count_words_kernel`` (one block; or block 0 of ``receive.receive_counted_compact_kernel``, the count and
the copy in one launch) derives everything from those words alone (:func:`count_words`): the
``psum_num_recv_tokens_per_rank`` scan, the per-expert sums, aligned counts and expert psum. Expand mode
needs the per-unit cursors of a scan over the received meta rows: ``receive_count_kernel`` scans word 0
(rows) of every source's count words into the psum, counts rows per local expert (shared-memory
histograms, ticketed last block as in ``count.py``) and lays out the expand placement: aligned expert
starts, the DeepEP V2 expert psum and, in stable mode, per-unit cursors.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ep_comm.contract.protocol import RECORD_N, RECORD_TAG, RECORD_VERDICTS, VERDICT_WORDS
from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.routing_check import bad_verdict
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import legacy
from ep_comm.kernels.ticket import ONE_FENCE, block_totals
from ep_comm.kernels.units import lane_entry, lane_place, source_of_row, unit_range, units_for_device
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, lane_id, warp_scan

RECV_LOADS = not legacy("recv_loads")  # a compile-time constant of the kernels


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
    the rest. Call from all threads of one block, once ``totals`` and ``aligned`` are written and synced.

    The block's threads meet at a barrier and one thread fences, then writes the tag (``ticket.py``'s pattern:
    one system fence per block, not one per thread; ``EP_COMM_KERNEL_LEGACY=one_fence`` fences in every thread)."""
    w = RECORD_N + cuda.threadIdx.x
    while w < record.shape[0]:
        record[w] = record_word(w, totals, words, aligned)
        w = np.int32(w + cuda.blockDim.x)
    if not ONE_FENCE:
        cuda.threadfence_system()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        if ONE_FENCE:
            cuda.threadfence_system()  # every thread's record words, ordered before it by the barrier
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
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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


@cuda.jit(device=True)
def column_sum(words, column, sources):
    """``words[0, column] + ... + words[sources - 1, column]``: four loads before their adds, so that a sum over up
    to four sources costs one memory round trip, not one per source (``EP_COMM_KERNEL_LEGACY=recv_loads``: one
    load, one add, source by source)."""
    total = np.int64(0)
    if not RECV_LOADS:
        for s in range(sources):
            total += words[s, column]
        return total
    last = sources - 1  # loads past it reread the last source (no branch around a load), and add nothing
    s = 0
    while s < sources:
        a = words[s, column]
        b = words[min(s + 1, last), column]
        c = words[min(s + 2, last), column]
        d = words[min(s + 3, last), column]
        total += a + (b if s + 1 < sources else 0) + (c if s + 2 < sources else 0) + (d if s + 3 < sources else 0)
        s += 4
    return total


@cuda.jit(device=True)
def count_words(words, step, alignment, rank_psum, unaligned, aligned, expert_psum, totals, record, sizes):
    """The compact receive count of one block from the count words ``words [R, 1 + L + 2]`` alone: rank psum,
    unaligned and aligned counts, expert psum, totals, then the record (:func:`publish_record`, tag ``step[0]``);
    ``sizes``: int32 ``[L]`` of shared memory. Call from all threads of one block."""
    num_ranks = words.shape[0]
    num_local = unaligned.shape[0]
    bad = any_bad_source(words, num_local)
    sources = 0 if bad else num_ranks
    e = cuda.threadIdx.x
    while e < num_local:
        count = column_sum(words, 1 + e, sources)
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


@kernel
def receive_count_words_kernel(counts_by_parity, step, alignment, rank_psum, unaligned, aligned, expert_psum,
                               totals, record):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.receive_count`, compact mode: one block, which reads only
    the ``[R, 1 + L + 2]`` count words of the parity of ``step`` (:func:`count_words`); dynamic shared memory: int32
    ``[L]``.
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    count_words(counts_by_parity[step_parity(step, 0)], step, alignment, rank_psum, unaligned, aligned, expert_psum,
                totals, record, cuda.shared.array(0, int32))
