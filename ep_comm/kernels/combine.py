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
rows received per source). A forwarded combine (nodes of ``node_size``) replaces the terms of another node's
ranks by one, at the place of that node's first rank: row ``token`` of its forwarder's region
(``ep_comm.kernels.forward.node_reduce_kernel`` wrote it).

Both sides have a bfloat16 kernel with 16-byte accesses (``combine_bf16.py``); each gives the bits of its
general kernel here, which handles every other payload and row shape.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ep_comm.kernels.convert import add_rn, load_f32, mul_rn, store_f32
from ep_comm.kernels.index32 import quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import ROW_MAX_REGISTERS
from ep_comm.kernels.units import row_piece
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


@kernel(max_registers=ROW_MAX_REGISTERS)
def combine_copy_kernel(y_words, wide, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_scatter` (compact): one warp per piece of ``span``
    words (even) of a row; the rows whose source is ``my_rank`` are skipped (not given a warp)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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
def term_place(rank, my_rank, node_size):
    """Where a reached ``rank``'s term stands in the source's sum: at ``rank`` in this rank's node, at the first
    rank of its node elsewhere (a forwarded combine: the node's one term, its forwarder's sum); -1 stays -1."""
    if rank < 0 or quotient32(rank, node_size) == quotient32(my_rank, node_size):
        return rank
    return np.int32(quotient32(rank, node_size) * node_size)


@cuda.jit(device=True)
def order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, my_rank, node_size, order):
    """Write this token's terms by ascending place (:func:`term_place`) into ``order[:K]`` (the rank whose region
    holds the term) and their rows there into ``order[K:2K]``; return how many. Lane ``k`` holds entry ``k``, a pair
    when ``slot_idx`` has a slot (then its expert id is >= 0). A rank of this node gives its own term (its slot); the
    ranks of another node give one term, row ``token`` of the region of their forwarder (the rank of that node with
    ``my_rank``'s local index). ``node_size``: the ranks per node of a forwarded combine, ``R`` for a flat one.
    """
    lane = lane_id()
    num_topk = slot_idx.shape[1]
    rank = np.int32(-1)  # int32: one register per shuffle
    if lane < num_topk and slot_idx[token, lane] >= 0:
        rank = np.int32(quotient32(topk_idx[token, lane], experts_per_rank))
    place = term_place(rank, my_rank, node_size)
    lead = place >= 0  # the node's lowest lane gives a forwarded node's term (a rank of this node has one lane)
    for k in range(num_topk):
        if cuda.shfl_sync(FULL_MASK, place, k) == place and k < lane:
            lead = False
    leads = ballot(lead)
    position = 0
    for k in range(num_topk):
        other = cuda.shfl_sync(FULL_MASK, place, k)
        if (leads >> k) & 1 and other < place:
            position += 1
    if lead and quotient32(rank, node_size) == quotient32(my_rank, node_size):
        order[position] = rank
        order[num_topk + position] = slot_idx[token, lane] - src_base
    elif lead:
        order[position] = place + my_rank - quotient32(my_rank, node_size) * node_size
        order[num_topk + position] = token
    reached = count_lanes(leads)
    cuda.syncwarp(FULL_MASK)
    return reached


@kernel
def combine_reduce_kernel(rows_by_parity, step, rows_is_bf16, slot_idx, topk_idx, experts_per_rank, my_rank, node_size,
                          y, own_from_y, rank_psum, bias0, bias0_is_bf16, bias1, bias1_is_bf16, num_bias, out,
                          out_is_bf16, span):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_reduce`; dynamic shared memory: int32 ``[warps * 2K]``.

    ``node_size``: see :func:`order_reached_ranks` (``R``: the flat order). With ``own_from_y`` this rank's own
    partials are rows of ``y``, row ``rank_psum[my_rank - 1] + slot``
    (``rank_psum`` the inclusive psum of the compact rows per source), else ``y`` and ``rank_psum`` are
    not read.
    Each token's row is cut into pieces of ``span`` elements (a multiple of ``SPAN * 32``), one warp per
    (token, piece): every element still sums its terms in the same order.
    """
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
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
        reached = order_reached_ranks(slot_idx, topk_idx, token, experts_per_rank, src_base, my_rank, node_size, order)
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
