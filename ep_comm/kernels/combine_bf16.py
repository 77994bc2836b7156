"""Combine kernels for bfloat16 with 16-byte accesses (uint64 words of 4 bfloat16, a lane's 8 elements per
pass): :func:`combine_expand_bf16_kernel` for the expert side's expand send, :func:`combine_reduce_bf16_kernel`
for the source side's reduce without bias; each gives the bits of its general kernel in ``combine.py``,
which handles every other payload and row shape (and its float32 order, ``ep_comm/contract/reduce.py``).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint64

from ep_comm.kernels.combine import gather_terms, order_reached_ranks, own_rows, return_address, term_lists
from ep_comm.kernels.convert import add_rn, bf16_bits_to_f32, f32_to_bf16_bits, mul_rn
from ep_comm.kernels.index32 import quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import REDUCE_MAX_REGISTERS, ROW_MAX_REGISTERS
from ep_comm.kernels.units import row_piece
from ep_comm.kernels.vector import load_pair, store_pair
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, lane_id

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


@kernel(max_registers=REDUCE_MAX_REGISTERS)
def combine_reduce_bf16_kernel(rows_by_parity, step, slot_idx, topk_idx, experts_per_rank, my_rank, node_size, y,
                               own_from_y, rank_psum, out, span):
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
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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
        reached = order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, my_rank, node_size, order)
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


@kernel(max_registers=ROW_MAX_REGISTERS)
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
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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
