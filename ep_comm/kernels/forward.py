"""The forwarder's kernels of node-aware forwarding on the GPU (``Buffer(forwarding=True)`` with several nodes;
docs/design.md, "Forwarding on nvshmem"): they read this rank's forwarding inbox and store onward, with no host
step between the inbox wait and the step's signal, so that a forwarded step is captured in a CUDA graph.

The inbox (``ep_comm.contract.forward_inbox``) is viewed as ``rows [2, R, max_tokens, W]`` (payload words or
elements), ``meta [2, R, max_tokens, relay_words]`` int32, ``header [2, R, 2]`` int64 and ``counts [2, R,
count_words]`` int64, block ``node * S + j`` (``S`` ranks per node). On the GPU a dispatch block is indexed by
source token (row ``t`` is token ``t``, every ``t`` below the header's row count carries a meta row, slots -1 where
the token is not sent); a combine block holds a rank's partials in its slot order, as the flat combine sends them.

* :func:`inbox_send_kernel` (dispatch, on the sender): per other node, every token's meta row and the rows of the
  tokens going to a rank there into the block ``node(sender) * S`` of that node's forwarder (its staging block where
  the forwarder is reached through puts), and the block's header.
* :func:`relay_kernel` (dispatch): every inbox row into each rank ``j`` of this node that its meta names a slot of,
  at region ``[parity, sender, slot]``, with the meta row of the flat scatter (``ep_comm.kernels.scatter``:
  source token, rank ``j``'s local expert ids, the weight bits as sent) and the count words of rank ``j``.
* :func:`combine_meta_kernel` (combine, on each rank): the header and the token and id words of the meta rows of its
  partials for the sources of other nodes, in the blocks of their forwarders (the send kernels write the rows and
  weight bits there through the same views, ``ep_comm.contract.forward_inbox.combine_send_views``: the combine
  blocks' meta rows are the inbox's ``combine_meta``).
* :func:`node_reduce_kernel` (combine): per source forwarded for and token, the float32 sum from 0 of the partials
  of the node's ranks holding it, ascending rank, rounded to the payload dtype (``ep_comm.contract.reduce.node_sum``),
  into the source at ``[parity, this rank, token]``, with the meta row ``(token, -1 * K, each entry's weight from
  the rank owning its expert)``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ep_comm.kernels.combine import SPAN, add_span, clear_span, store_span
from ep_comm.kernels.expert_ids import routed_expert
from ep_comm.kernels.index32 import divmod32, quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.payload import write_row_piece
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.step_counter import step_parity
from ep_comm.kernels.switches import ROW_MAX_REGISTERS
from ep_comm.kernels.traffic import COMBINE_ROWS, add_warp_rows
from ep_comm.kernels.units import row_piece
from ep_comm.kernels.warp import FULL_MASK, WARP, ballot, copy_row, global_warp, lane_id, pop_lowest


@cuda.jit(device=True)
def rank_slot(slot_idx, topk_idx, t, rank, experts_per_rank, num_experts, src_base):
    """Token ``t``'s slot in ``rank`` (its entry on ``rank`` that holds one in ``slot_idx``, as the scatter recorded
    it), or -1; all lanes of a warp, the same answer in each."""
    lane = lane_id()
    num_topk = topk_idx.shape[1]
    slot = np.int32(slot_idx[t, lane]) if lane < num_topk else np.int32(-1)
    mine = False
    if slot >= 0:
        expert = routed_expert(topk_idx, t, lane, num_experts)
        mine = expert >= 0 and quotient32(expert, experts_per_rank) == rank
    hits = ballot(mine)
    if hits == 0:
        return np.int32(-1)
    return np.int32(cuda.shfl_sync(FULL_MASK, slot, pop_lowest(hits)[0]) - src_base)


@cuda.jit(device=True)
def write_inbox_meta(meta, topk_idx, weight_bits, has_weights, t, num_experts, slot):
    """An inbox meta row of token ``t`` (``meta [1 + 2K + S]`` int32): the token, its global ids (-1: none), its
    weight bits (0 without weights), lane ``j``'s ``slot`` in rank ``j`` of the node."""
    lane = lane_id()
    num_topk = topk_idx.shape[1]
    if lane == 0:
        meta[0] = t
    if lane < num_topk:
        expert = routed_expert(topk_idx, t, lane, num_experts)
        meta[1 + lane] = expert if expert >= 0 else -1
        meta[1 + num_topk + lane] = weight_bits[t, lane] if has_weights else 0
    if lane < meta.shape[0] - 1 - 2 * num_topk:
        meta[1 + 2 * num_topk + lane] = slot


@cuda.jit(device=True)
def send_inbox_counts(count_words, counts, node, node_size, block, parity, lane):
    """A new routing's count words of each rank ``j`` of ``node`` (row ``node * S + j`` of the send block
    ``count_words [R, words]`` int32) into block ``block + j`` of that node's forwarder's ``counts [2, R, words]``
    int64, as the flat signal sends them to rank ``j`` (lanes over the words)."""
    words = count_words.shape[1]
    for j in range(node_size):
        for w in range(lane, words, WARP):
            counts[parity, block + j, w] = count_words[node * node_size + j, w]


@kernel(max_registers=ROW_MAX_REGISTERS)
def inbox_send_kernel(source, row_words, wide, topk_idx, weight_bits, has_weights, slot_idx, experts_per_rank,
                      src_rank, new_routing, count_words, step, ahead, span, rows, metas, headers, counts):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.inbox_send`. ``rows``/``metas``/``headers``/``counts``:
    per node, the forwarder's inbox (``[2, R, max_tokens, W]`` words, ``[2, R, max_tokens, relay_words]`` int32,
    ``[2, R, 2]`` int64, ``[2, R, words]`` int64), written in block ``node(src_rank) * S`` (counts: blocks
    ``node(src_rank) * S + j``); this rank's own node's entry is not written. One warp per (node, token, piece of
    ``span`` words); the warp of a row's first piece writes its meta row; the first warps write the headers ``(T,
    new_routing)`` and, for a new routing, the count words of the node's ranks (``count_words [R, words]`` int32, the
    send block the flat signal sends; not read otherwise)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, ahead)
    num_tokens, num_topk = topk_idx.shape
    num_nodes = len(rows)
    node_size = metas[0].shape[3] - 1 - 2 * num_topk
    num_experts = experts_per_rank * num_nodes * node_size
    my_node = quotient32(src_rank, node_size)
    src_base = src_rank * rows[0].shape[2]
    block = my_node * node_size
    pieces = quotient32(row_words + span - 1, span)
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_nodes:
        if item != my_node:
            if new_routing:
                send_inbox_counts(count_words, counts[item], item, node_size, block, parity, lane)
            if lane == 0:
                headers[item][parity, block, 0] = num_tokens
                headers[item][parity, block, 1] = new_routing
        item = np.int32(item + num_warps)
    item = np.int32(global_warp()[0])
    while item < num_nodes * num_tokens * pieces:
        entry, begin, end = row_piece(item, pieces, span, row_words)
        node, t = divmod32(entry, num_tokens)
        if node != my_node:
            sent = False
            slot = np.int32(-1)
            for j in range(node_size):
                found = rank_slot(slot_idx, topk_idx, t, node * node_size + j, experts_per_rank, num_experts, src_base)
                sent = sent or found >= 0
                if lane == j:
                    slot = found
            if sent:
                write_row_piece(rows[node][parity, block, t], source, t, begin, end, wide)
            if begin == 0:
                write_inbox_meta(metas[node][parity, block, t], topk_idx, weight_bits, has_weights, t, num_experts,
                                 slot)
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)


@cuda.jit(device=True)
def relay_meta_row(dst_meta, src_meta, token, rank, experts_per_rank, num_topk, lane):
    """The flat scatter's meta row of ``rank`` (``dst_meta [1 + 2K]`` int32) from an inbox meta row ``src_meta``
    (global expert ids, -1 = none): the token, ``rank``'s local ids (-1 off it), the weight bits as they are."""
    if lane == 0:
        dst_meta[0] = token
    if lane < num_topk:
        expert = np.int64(src_meta[1 + lane])
        on_rank = expert >= 0 and quotient32(expert, experts_per_rank) == rank
        dst_meta[1 + lane] = expert - rank * experts_per_rank if on_rank else -1
        dst_meta[1 + num_topk + lane] = src_meta[1 + num_topk + lane]


@cuda.jit(device=True)
def relay_counts(inbox_header, inbox_counts, senders, node_first, node_size, parity, counts, item, lane):
    """Work item ``item < len(senders) * node_size`` of the count words: those of sender ``senders[item // S]``
    for rank ``j = item % S`` of this node into that rank's counts ``[parity, sender]``, when the block has them
    (a new routing; header word 1)."""
    index, j = divmod32(item, node_size)
    sender = senders[index]
    block = quotient32(sender, node_size) * node_size
    if inbox_header[parity, block, 1] != 0:
        words = inbox_counts.shape[2]
        for w in range(lane, words, WARP):
            counts[node_first + j][parity, sender, w] = inbox_counts[parity, block + j, w]


@kernel(max_registers=ROW_MAX_REGISTERS)
def relay_kernel(inbox_rows, inbox_meta, inbox_header, inbox_counts, senders, node_first, experts_per_rank, step,
                 ahead, span, wide, words, rows, metas, counts):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.relay`. One warp per (sender, token, piece of ``span``
    words); the warp of a row's first piece writes its meta rows; the first ``len(senders) * S`` warps also copy the
    count words (:func:`relay_counts`). ``senders`` int32 ``[n]``: the ranks this rank forwards for (one per other
    node); ``rows``/``metas``/``counts``: every rank's symmetric views (peer views), only this node's written;
    ``words``: the words of a row the senders wrote (fewer than the inbox row's for packed FP8 rows)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, ahead)
    max_tokens = inbox_rows.shape[2]
    meta_words = metas[0].shape[3]
    node_size = inbox_meta.shape[3] - meta_words  # the slot columns of an inbox meta row
    num_topk = (meta_words - 1) // 2
    pieces = quotient32(words + span - 1, span)
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < len(senders) * node_size:
        relay_counts(inbox_header, inbox_counts, senders, node_first, node_size, parity, counts, item, lane)
        item = np.int32(item + num_warps)
    item = np.int32(global_warp()[0])
    while item < len(senders) * max_tokens * pieces:
        entry, begin, end = row_piece(item, pieces, span, words)
        index, token = divmod32(entry, max_tokens)
        sender = senders[index]
        block = quotient32(sender, node_size) * node_size
        if token < inbox_header[parity, block, 0]:
            src_meta = inbox_meta[parity, block, token]
            for j in range(node_size):
                slot = src_meta[meta_words + j]
                if slot >= 0:
                    dst = node_first + j
                    copy_row(rows[dst][parity, sender, slot][begin:end], inbox_rows[parity, block, token][begin:end],
                             end - begin, wide)
                    if begin == 0:
                        relay_meta_row(metas[dst][parity, sender, slot], src_meta, token, dst, experts_per_rank,
                                       num_topk, lane)
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)


@kernel
def combine_meta_kernel(recv_src_metadata, ids, rank_psum, my_rank, node_size, step, ahead, metas, headers):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.combine_meta`. One thread per (received row, top-k entry),
    then one per source: for a source of another node, word 0 (the source token) and word ``1 + k`` (``ids[row, k]``,
    -1 where negative) of the row's meta row ``metas[src][parity, my_rank, slot]``, and ``headers[src][parity,
    my_rank] = (rows from src, 0)``. ``recv_src_metadata [N, 2 + K]`` int32 and ``rank_psum [R]`` int32 from the
    dispatch; ``ids [N, K]`` (any int: >= 0 where this rank owns the entry)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, ahead)
    num_ranks = rank_psum.shape[0]
    num_topk = ids.shape[1]
    max_tokens = metas[0].shape[2]
    my_node = quotient32(my_rank, node_size)
    num_entries = rank_psum[num_ranks - 1] * num_topk
    j, stride = np.int32(cuda.grid(1)), np.int32(cuda.gridsize(1))
    while j < num_entries + num_ranks:  # an int32 index: no 64-bit division for the trip count
        if j >= num_entries:
            src = j - num_entries
            if quotient32(src, node_size) != my_node:
                headers[src][parity, my_rank, 0] = rank_psum[src] - (rank_psum[src - 1] if src > 0 else 0)
                headers[src][parity, my_rank, 1] = 0
        else:
            row, k = divmod32(j, num_topk)
            src = quotient32(recv_src_metadata[row, 0], max_tokens)
            if quotient32(src, node_size) != my_node:
                meta = metas[src][parity, my_rank, recv_src_metadata[row, 1] - src * max_tokens]
                if k == 0:
                    meta[0] = recv_src_metadata[row, 0] - src * max_tokens
                meta[1 + k] = ids[row, k] if ids[row, k] >= 0 else -1
        j = np.int32(j + stride)


@cuda.jit(device=True)
def find_token(meta, count, token):
    """The row ``i < count`` of ``meta [max_tokens, >= 1]`` (a combine inbox block) whose word 0 is ``token``, or -1;
    all lanes of a warp, the same answer in each."""
    lane = lane_id()
    first = np.int32(0)
    while first < count:
        i = first + lane
        hits = ballot(i < count and meta[min(i, count - 1), 0] == token)
        if hits != 0:
            return first + pop_lowest(hits)[0]
        first = np.int32(first + WARP)
    return np.int32(-1)


@cuda.jit(device=True)
def held_slots(inbox_meta, inbox_header, parity, node_block, node_size, first_holder, slot, token):
    """Lane ``j``'s slot of ``token`` in block ``node_block + j`` (-1: rank ``j`` does not hold it), for ``j`` from
    ``first_holder`` on (whose slot is ``slot``); -1 on every lane when a rank below ``first_holder`` holds it
    (that rank's warp sums the token). Returns ``(owner, lane's slot)``."""
    lane = lane_id()
    for j in range(first_holder):
        block = node_block + j
        if find_token(inbox_meta[parity, block], inbox_header[parity, block, 0], token) >= 0:
            return False, np.int32(-1)
    mine = np.int32(slot) if lane == first_holder else np.int32(-1)
    for j in range(first_holder + 1, node_size):
        block = node_block + j
        found = find_token(inbox_meta[parity, block], inbox_header[parity, block, 0], token)
        if lane == j:
            mine = found
    return True, mine


@cuda.jit(device=True)
def owned_weight_bits(inbox_meta, parity, node_block, node_size, mine, num_topk):
    """Lane ``k``'s weight bits of entry ``k`` from the holder whose local id there is >= 0, 0 where none is
    (``mine``: each lane ``j``'s slot, as :func:`held_slots` gives it)."""
    lane = lane_id()
    bits = np.int32(0)
    for j in range(node_size):
        slot = cuda.shfl_sync(FULL_MASK, mine, j)
        if slot >= 0 and lane < num_topk:
            row = inbox_meta[parity, node_block + j, slot]
            if row[1 + lane] >= 0:
                bits = row[1 + num_topk + lane]
    return bits


@cuda.jit(device=True)
def sum_held(out, hidden, inbox_rows, parity, node_block, node_size, first_holder, mine, is_bf16):
    """``out[:hidden] =`` the float32 sum from 0 of the rows lane ``j`` names (``mine``, :func:`held_slots`) in
    block ``node_block + j``, ``j`` ascending from ``first_holder``, rounded to the payload dtype. Every lane runs
    every pass (the shuffles of the slots stay converged); elements past ``hidden`` are neither read nor written."""
    acc = cuda.local.array(SPAN, float32)
    vals = cuda.local.array(SPAN, float32)
    row, lane = out[:hidden], lane_id()
    for first in range(0, hidden, SPAN * WARP):
        h = first + lane
        clear_span(acc)
        for j in range(first_holder, node_size):
            held = cuda.shfl_sync(FULL_MASK, mine, j)
            if held >= 0:
                add_span(acc, vals, inbox_rows[parity, node_block + j, held][:hidden], h, is_bf16, np.float32(1.0),
                         False)
        store_span(row, h, acc, is_bf16)


@cuda.jit(device=True)
def write_sum_meta(meta, token, bits, num_topk):
    """The meta row of a node sum (``meta [1 + 2K]`` int32): the token, -1 ids, lane ``k``'s weight bits."""
    lane = lane_id()
    if lane == 0:
        meta[0] = token
    if lane < num_topk:
        meta[1 + lane] = -1
        meta[1 + num_topk + lane] = bits


@kernel
def node_reduce_kernel(inbox_rows, inbox_meta, inbox_header, rows_is_bf16, hidden, node_size, sources, step, ahead,
                       my_rank, rows, metas, scaleout):
    """See :func:`ep_comm.launching.kernel_launches.Kernels.node_reduce`. One warp per (source, rank ``j`` of this
    node, row of ``j``'s block); the warp of a token's lowest holder sums it (:func:`held_slots`, :func:`sum_held`),
    the others skip it. ``inbox_rows [2, R, max_tokens, >= hidden]`` and ``rows[r] [2, R, max_tokens, >= hidden]``
    payload elements (bfloat16 as uint16 with ``rows_is_bf16``); ``inbox_meta [2, R, max_tokens, 1 + 2K]`` int32:
    the inbox's combine meta rows; ``sources`` int32 ``[n]``: the ranks forwarded for; ``node_size``: ``S``.
    ``scaleout`` int64 ``[2]``: the rows written (one per token summed, put into a source of another node) are added
    to its word ``traffic.COMBINE_ROWS`` (:func:`~ep_comm.kernels.traffic.add_warp_rows`, once per warp at its end)."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    parity = step_parity(step, ahead)
    max_tokens = inbox_rows.shape[2]
    num_topk = (metas[0].shape[3] - 1) // 2
    written = np.int64(0)  # rows this warp summed (the same on every lane)
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < len(sources) * node_size * max_tokens:
        pair, slot = divmod32(item, max_tokens)
        index, holder = divmod32(pair, node_size)
        src = sources[index]
        node_block = quotient32(src, node_size) * node_size
        if slot < inbox_header[parity, node_block + holder, 0]:
            token = inbox_meta[parity, node_block + holder, slot, 0]
            owner, mine = held_slots(inbox_meta, inbox_header, parity, node_block, node_size, holder, slot, token)
            if owner:
                sum_held(rows[src][parity, my_rank, token], hidden, inbox_rows, parity, node_block, node_size, holder,
                         mine, rows_is_bf16)
                write_sum_meta(metas[src][parity, my_rank, token], token,
                               owned_weight_bits(inbox_meta, parity, node_block, node_size, mine, num_topk), num_topk)
                written += 1
        cuda.syncwarp(FULL_MASK)
        item = np.int32(item + num_warps)
    add_warp_rows(scaleout, COMBINE_ROWS, written if lane_id() == 0 else np.int64(0))
