"""Combine: the dispatch routes run backwards, with the float32 order of ``ep_comm/contract/reduce.py``.

Expert side: each compact row goes back to the slot it came from in its source rank's buffer,
``rows[src][parity, my_rank, slot]`` (a tuple of peer arrays): compact mode copies ``y[i]``, except
the rows whose source is this rank (the source side reads those from ``y`` itself); expand mode
first reduces the row's expanded rows in top-k order (``acc = 0; acc = acc + w * y``, each
operation rounded, no FMA) and rounds once to the payload type, its own rows included. Source
side: each token sums ``0 + bias terms + the partial of every reached rank, ascending``, rounded
once; the partial of a reached rank ``r`` is row ``slot`` of ``rows[r]`` in this rank's buffer, or,
in compact mode for ``r == my_rank``, row ``psum[my_rank - 1] + slot`` of ``y`` (compact rows are
grouped by source ascending, slot order inside a source; ``psum`` the inclusive prefix sum of the
rows received per source).

Both sides have a bfloat16 kernel with 16-byte accesses (uint64 words of 4 bfloat16, a lane's 8
elements per pass): :func:`combine_expand_bf16_kernel` for the expert side's expand send,
:func:`combine_reduce_bf16_kernel` for the source side's reduce without bias; each gives the bits of
its general kernel, which handles every other payload and row shape.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint64

from ep_comm.kernels.convert import add_rn, bf16_bits_to_f32, f32_to_bf16_bits, load_f32, mul_rn, store_f32
from ep_comm.kernels.index32 import quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.units import row_piece
from ep_comm.kernels.vector import load_pair, store_pair
from ep_comm.kernels.warp import FULL_MASK, WARP, ballot, copy_row, count_lanes, global_warp, lane_id, lanes_below

SPAN = 8  # elements per lane per pass over a row: SPAN loads in flight per term instead of one


@cuda.jit(device=True)
def clear_span(acc):
    """Zero a span's float32 accumulators ``acc[SPAN]`` (a local array)."""
    for u in range(SPAN):
        acc[u] = np.float32(0.0)


@cuda.jit(device=True)
def add_span(acc, vals, row, h, is_bf16, scale, scaled):
    """``acc[u] += (scale *) row[h + u * 32]`` for the lane's span, each operation rounded.

    All SPAN loads go into ``vals`` before any add, so they are in flight together; elements
    past the row's end add 0 (their accumulators are never stored).
    """
    for u in range(SPAN):
        j = h + u * WARP
        vals[u] = load_f32(row, j, is_bf16) if j < row.shape[0] else np.float32(0.0)
    for u in range(SPAN):
        acc[u] = add_rn(acc[u], mul_rn(scale, vals[u]) if scaled else vals[u])


@cuda.jit(device=True)
def store_span(row, h, acc, is_bf16):
    """``row[h + u * 32] = acc[u]`` rounded to the row's payload type, inside the row."""
    for u in range(SPAN):
        if h + u * WARP < row.shape[0]:
            store_f32(row, h + u * WARP, acc[u], is_bf16)


@cuda.jit(device=True)
def return_address(recv_src_metadata, row, max_tokens):
    """Source rank and slot a compact row came from."""
    src = quotient32(recv_src_metadata[row, 0], max_tokens)
    return src, recv_src_metadata[row, 1] - src * max_tokens


@cuda.jit(device=True)
def own_rows(rank_psum, my_rank):
    """``(first, count)``: the compact rows this rank received from itself (``rank_psum`` inclusive)."""
    first = rank_psum[my_rank - 1] if my_rank > 0 else 0
    return first, rank_psum[my_rank] - first


@kernel
def combine_copy_kernel(y_words, wide, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_scatter` (compact): one warp per piece of ``span``
    words (even) of a row; the rows whose source is ``my_rank`` are skipped (not given a warp)."""
    parity = step_parity(step, ahead)
    max_tokens = rows[0].shape[2]
    words = y_words.shape[1]
    pieces = quotient32(words + span - 1, span)
    own_first, own_count = own_rows(rank_psum, my_rank)
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < (rank_psum[rank_psum.shape[0] - 1] - own_count) * pieces:
        row, begin, end = row_piece(item, pieces, span, words)
        if row >= own_first:
            row += own_count
        src, slot = return_address(recv_src_metadata, row, max_tokens)
        copy_row(rows[src][parity, my_rank, slot][begin:end], y_words[row, begin:end], end - begin, wide)
        item = np.int32(item + num_warps)


@cuda.jit(device=True)
def gather_terms(recv_src_metadata, row, weights, has_weights, terms, scales):
    """Write a row's expanded rows in top-k order into ``terms`` and their weights into ``scales``; return how many.

    Lane ``k`` holds entry ``k``; the list lives in this warp's shared memory so that the loop over
    the hidden dimension reads it without touching global memory.
    """
    lane = lane_id()
    expanded = recv_src_metadata[row, 2 + lane] if lane < terms.shape[0] else -1
    valid = ballot(expanded >= 0)
    if expanded >= 0:
        position = count_lanes(valid & lanes_below(lane))
        terms[position] = expanded
        scales[position] = weights[expanded] if has_weights else np.float32(1.0)
    cuda.syncwarp(FULL_MASK)
    return count_lanes(valid)


@cuda.jit(device=True)
def term_lists(num_topk):
    """This warp's ``(terms, scales)``: int32 ``[K]`` and float32 ``[K]`` slices of the dynamic shared memory,
    laid out as ``[warps * K]`` int32 then ``[warps * K]`` float32 (what :func:`gather_terms` fills)."""
    first = cuda.threadIdx.x // WARP * num_topk
    scales_first = cuda.blockDim.x // WARP * num_topk + first
    return (cuda.shared.array(0, int32)[first: first + num_topk],
            cuda.shared.array(0, float32)[scales_first: scales_first + num_topk])


@kernel
def combine_expand_kernel(y, y_is_bf16, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead,
                          rows):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_scatter` (expand); dynamic shared memory: ``[warps * K]``
    int32 then ``[warps * K]`` float32."""
    parity = step_parity(step, ahead)
    max_tokens = rows[0].shape[2]
    hidden = y.shape[1]
    terms, scales = term_lists(recv_src_metadata.shape[1] - 2)
    acc = cuda.local.array(SPAN, float32)
    vals = cuda.local.array(SPAN, float32)
    lane = lane_id()
    row, num_warps = global_warp()
    row = np.int32(row)
    while row < rank_psum[rank_psum.shape[0] - 1]:
        src, slot = return_address(recv_src_metadata, row, max_tokens)
        dst = rows[src][parity, my_rank, slot]
        count = gather_terms(recv_src_metadata, row, weights, has_weights, terms, scales)
        for h in range(lane, hidden, SPAN * WARP):
            clear_span(acc)
            for j in range(count):
                add_span(acc, vals, y[terms[j]], h, y_is_bf16, scales[j], has_weights)
            store_span(dst, h, acc, y_is_bf16)
        cuda.syncwarp(FULL_MASK)
        row = np.int32(row + num_warps)


@cuda.jit(device=True)
def order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, order):
    """Write this token's reached ranks by ascending rank into ``order[:K]``, their slots into
    ``order[K:2K]``; return how many. Lane ``k`` holds entry ``k``, a pair when ``slot_idx`` has a slot (then
    its expert id is >= 0).
    """
    lane = lane_id()
    num_topk = slot_idx.shape[1]
    rank = np.int32(-1)  # int32: one register per shuffle
    if lane < num_topk and slot_idx[token, lane] >= 0:
        rank = np.int32(quotient32(topk_idx[token, lane], experts_per_rank))
    position = 0
    for k in range(num_topk):
        other = cuda.shfl_sync(FULL_MASK, rank, k)
        if other >= 0 and other < rank:
            position += 1
    if rank >= 0:
        order[position] = rank
        order[num_topk + position] = slot_idx[token, lane] - src_base
    reached = count_lanes(ballot(rank >= 0))
    cuda.syncwarp(FULL_MASK)
    return reached


@kernel
def combine_reduce_kernel(rows_by_parity, step, rows_is_bf16, slot_idx, topk_idx, experts_per_rank, my_rank, y,
                          own_from_y, rank_psum, bias0, bias0_is_bf16, bias1, bias1_is_bf16, num_bias, out,
                          out_is_bf16, span):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_reduce`; dynamic shared memory: int32 ``[warps * 2K]``.

    With ``own_from_y`` this rank's own partials are rows of ``y``, row ``rank_psum[my_rank - 1] + slot``
    (``rank_psum`` the inclusive psum of the compact rows per source), else ``y`` and ``rank_psum`` are
    not read.
    Each token's row is cut into pieces of ``span`` elements (a multiple of ``SPAN * 32``), one warp per
    (token, piece): every element still sums its terms in the same order.
    """
    rows = rows_by_parity[step_parity(step, 0)]
    num_tokens, num_topk = slot_idx.shape
    hidden = out.shape[1]
    pieces = quotient32(hidden + span - 1, span)
    src_base = my_rank * rows.shape[1]
    own_first = own_rows(rank_psum, my_rank)[0] if own_from_y else -1
    first = cuda.threadIdx.x // WARP * 2 * num_topk
    order = cuda.shared.array(0, int32)[first: first + 2 * num_topk]
    acc = cuda.local.array(SPAN, float32)
    vals = cuda.local.array(SPAN, float32)
    one = np.float32(1.0)
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_tokens * pieces:
        token, begin, end = row_piece(item, pieces, span, hidden)
        reached = order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, order)
        for h in range(begin + lane, end, SPAN * WARP):
            clear_span(acc)
            if num_bias > 0:
                add_span(acc, vals, bias0[token], h, bias0_is_bf16, one, False)
            if num_bias > 1:
                add_span(acc, vals, bias1[token], h, bias1_is_bf16, one, False)
            for j in range(reached):
                rank, slot = order[j], order[num_topk + j]
                row = y[own_first + slot] if rank == my_rank and own_first >= 0 else rows[rank, slot]
                add_span(acc, vals, row, h, rows_is_bf16, one, False)
            store_span(out[token], h, acc, out_is_bf16)
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)


BF16_PER_WORD = 4  # bfloat16 elements in one 64-bit word
BF16_PER_LANE = 8  # elements a lane sums per pass: one 16-byte access (two words)
BF16_PASSES = 2  # passes per loop trip: their loads are issued before any of their adds
BF16_ACC = BF16_PASSES * BF16_PER_LANE  # float32 accumulators of a lane (a compile-time constant for Numba)
BF16_SHIFTS = (np.uint64(0), np.uint64(16), np.uint64(32), np.uint64(48))
BF16_MASK = np.uint64(0xFFFF)


@cuda.jit(device=True)
def add_bf16_word(acc, first, word):
    """``acc[first + i] += element i`` of the 4 bfloat16 in a 64-bit ``word``, each add rounded."""
    for i in range(BF16_PER_WORD):
        acc[first + i] = add_rn(acc[first + i], bf16_bits_to_f32((word >> BF16_SHIFTS[i]) & BF16_MASK))


@cuda.jit(device=True)
def bf16_word(acc, first):
    """The 64-bit word of ``acc[first:first + 4]`` rounded to bfloat16."""
    word = np.uint64(0)
    for i in range(BF16_PER_WORD):
        word |= np.uint64(f32_to_bf16_bits(acc[first + i])) << BF16_SHIFTS[i]
    return word


@cuda.jit(device=True)
def own_term(order, reached, my_rank):
    """Position of ``my_rank`` among a token's ``reached`` ranks in ``order`` (ascending), or ``reached``."""
    for j in range(reached):
        if order[j] == my_rank:
            return j
    return reached


@cuda.jit(device=True)
def add_bf16_term(acc, row, w, w2, end):
    """Add one term's words ``w`` and ``w2`` (the second pass, if below ``end``) of ``row`` into ``acc``: both
    16-byte loads before the adds."""
    low, high = load_pair(row, w)
    low2, high2 = np.uint64(0), np.uint64(0)
    if w2 < end:
        low2, high2 = load_pair(row, w2)
    add_bf16_word(acc, 0, low)
    add_bf16_word(acc, BF16_PER_WORD, high)
    add_bf16_word(acc, BF16_PER_LANE, low2)
    add_bf16_word(acc, BF16_PER_LANE + BF16_PER_WORD, high2)


@cuda.jit(device=True)
def add_buffer_terms(acc, rows, order, j0, j1, w, w2, end):
    """:func:`add_bf16_term` of the reached ranks ``j0 <= j < j1`` of ``order``, rows of this rank's buffer."""
    num_topk = order.shape[0] // 2
    for j in range(j0, j1):
        add_bf16_term(acc, rows[order[j], order[num_topk + j]], w, w2, end)


@kernel
def combine_reduce_bf16_kernel(rows_by_parity, step, slot_idx, topk_idx, experts_per_rank, my_rank, y, own_from_y,
                               rank_psum, out, span):
    """:func:`combine_reduce_kernel` for bfloat16 rows and output without bias, 16 bytes per lane access.

    ``rows_by_parity [2, R, max_tokens, W]``, ``y [N, W]`` (read as in :func:`combine_reduce_kernel`)
    and ``out [T, W]`` are uint64 words of 4 bfloat16 each, W even, rows 16-byte aligned. Each lane
    sums 8 elements per pass (two words), in the same float32 order as the general kernel (``0 +
    partial of each reached rank, ascending``): bit for bit the same. Rows are cut into pieces of
    ``span`` words (a multiple of 64), one warp per (token, piece). A loop trip covers two passes
    (words ``w`` and ``w + 64``), both loads of a term before its adds: a lane keeps two 16-byte
    loads in flight where one pass would wait for each (measured on the H200: 100 ->
    77 us at 4096 tokens, 11.5 -> 9.1 us at 128). The own term (from ``y``) is added between two
    loops over the buffer's terms, not chosen per term inside one loop: that choice made the kernel
    126.6 us at 4096 tokens against 76.4 us without it (H200, same data); with the split it is 101.3 us.
    """
    rows = rows_by_parity[step_parity(step, 0)]
    num_tokens, num_topk = slot_idx.shape
    words = out.shape[1]
    pieces = quotient32(words + span - 1, span)
    src_base = my_rank * rows.shape[1]
    own_first = own_rows(rank_psum, my_rank)[0] if own_from_y else -1
    first = cuda.threadIdx.x // WARP * 2 * num_topk
    order = cuda.shared.array(0, int32)[first: first + 2 * num_topk]
    acc = cuda.local.array(BF16_ACC, float32)
    second = BF16_PER_LANE  # where the second pass's accumulators start
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_tokens * pieces:
        token, begin, end = row_piece(item, pieces, span, words)
        reached = order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, order)
        own = own_term(order, reached, my_rank) if own_first >= 0 else reached
        for w in range(begin + 2 * lane_id(), end, BF16_PASSES * 2 * WARP):
            w2 = w + 2 * WARP
            for u in range(BF16_ACC):
                acc[u] = np.float32(0.0)
            # the own term (from y) splits the buffer's terms in two runs, so that no loop picks its row array
            add_buffer_terms(acc, rows, order, 0, own, w, w2, end)
            if own < reached:
                add_bf16_term(acc, y[own_first + order[num_topk + own]], w, w2, end)
                add_buffer_terms(acc, rows, order, own + 1, reached, w, w2, end)
            store_pair(out[token], w, bf16_word(acc, 0), bf16_word(acc, BF16_PER_WORD))
            if w2 < end:
                store_pair(out[token], w2, bf16_word(acc, second), bf16_word(acc, second + BF16_PER_WORD))
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)


# expanded rows whose loads (both passes) a lane issues before their adds: 8 x 16 bytes in flight. ptxas
# sm_90: 96 registers, no stack (2: 63 registers, half the loads; 8: the loaded words go to a stack frame)
BF16_GROUP = 4
BF16_WORDS = 2 * BF16_PASSES  # 64-bit words a lane loads per term in one loop trip
BF16_LOADED = BF16_GROUP * BF16_WORDS  # a lane's loaded words (registers: a compile-time size, indices unrolled)


@cuda.jit(device=True)
def add_scaled_bf16_word(acc, first, word, scale, scaled):
    """``acc[first + i] += (scale *) element i`` of the 4 bfloat16 in a 64-bit ``word``: with ``scaled``,
    ``add_rn(acc, mul_rn(scale, x))``, else ``add_rn(acc, x)`` (the order of :func:`add_span`)."""
    for i in range(BF16_PER_WORD):
        value = bf16_bits_to_f32((word >> BF16_SHIFTS[i]) & BF16_MASK)
        acc[first + i] = add_rn(acc[first + i], mul_rn(scale, value) if scaled else value)


@cuda.jit(device=True)
def load_term_group(y_words, terms, group, count, w, w2, end, loaded):
    """Load words ``w, w + 1`` and, when ``w2 < end``, ``w2, w2 + 1`` (else zeros) of the expanded rows
    ``terms[group:group + BF16_GROUP]`` (those below ``count``) of ``y_words [M, W]`` into
    ``loaded[t * 4: t * 4 + 4]`` for term ``group + t``: every load before any add, in flight together."""
    for t in range(BF16_GROUP):
        if group + t < count:
            row = y_words[terms[group + t]]
            low, high = load_pair(row, w)
            low2, high2 = np.uint64(0), np.uint64(0)
            if w2 < end:
                low2, high2 = load_pair(row, w2)
            loaded[t * BF16_WORDS] = low
            loaded[t * BF16_WORDS + 1] = high
            loaded[t * BF16_WORDS + 2] = low2
            loaded[t * BF16_WORDS + 3] = high2


@cuda.jit(device=True)
def add_term_group(acc, loaded, scales, group, count, scaled):
    """Add the words :func:`load_term_group` loaded to the lane's ``acc [16]``, term by term in top-k order
    (word ``p`` of a term into ``acc[4p: 4p + 4]``), weighted by ``scales`` when ``scaled``."""
    for t in range(BF16_GROUP):
        if group + t < count:
            for p in range(BF16_WORDS):
                add_scaled_bf16_word(acc, p * BF16_PER_WORD, loaded[t * BF16_WORDS + p], scales[group + t], scaled)


@kernel
def combine_expand_bf16_kernel(y_words, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead,
                               span, rows):
    """:func:`combine_expand_kernel` for bfloat16 ``y`` and rows, 16 bytes per lane access.

    ``y_words [M, W]`` and ``rows[r] [2, R, max_tokens, W]`` are uint64 words of 4 bfloat16 each, W
    even, rows 16-byte aligned. Each element sums its row's expanded rows in top-k order, ``acc = 0;
    acc = add_rn(acc, mul_rn(w, x))`` (``add_rn(acc, x)`` without ``has_weights``), rounded once: bit
    for bit the general kernel. Rows are cut into pieces of ``span`` words (a multiple of 128), one
    warp per (row, piece). A loop trip covers two passes (words ``w`` and ``w + 64``, 8 elements per
    lane each) and takes the terms in groups of ``BF16_GROUP``: all of a group's loads (both passes)
    are issued before its adds, so a lane keeps up to 8 16-byte loads in flight. Dynamic shared
    memory as :func:`combine_expand_kernel`.
    """
    parity = step_parity(step, ahead)
    max_tokens = rows[0].shape[2]
    words = y_words.shape[1]
    pieces = quotient32(words + span - 1, span)
    terms, scales = term_lists(recv_src_metadata.shape[1] - 2)
    acc = cuda.local.array(BF16_ACC, float32)
    loaded = cuda.local.array(BF16_LOADED, uint64)
    second = BF16_PER_LANE  # where the second pass's accumulators start
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < rank_psum[rank_psum.shape[0] - 1] * pieces:
        row, begin, end = row_piece(item, pieces, span, words)
        src, slot = return_address(recv_src_metadata, row, max_tokens)
        dst = rows[src][parity, my_rank, slot]
        count = gather_terms(recv_src_metadata, row, weights, has_weights, terms, scales)
        for w in range(begin + 2 * lane_id(), end, BF16_PASSES * 2 * WARP):
            w2 = w + 2 * WARP
            for u in range(BF16_ACC):
                acc[u] = np.float32(0.0)
            for group in range(0, count, BF16_GROUP):
                load_term_group(y_words, terms, group, count, w, w2, end, loaded)
                add_term_group(acc, loaded, scales, group, count, has_weights)
            store_pair(dst, w, bf16_word(acc, 0), bf16_word(acc, BF16_PER_WORD))
            if w2 < end:
                store_pair(dst, w2, bf16_word(acc, second), bf16_word(acc, second + BF16_PER_WORD))
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)
