"""Kernels of the return route of the top-k weights in a combine (only when the caller passes ``topk_weights``).

Expert side (``send_weights_kernel``): each received row writes its K weights into the weight columns
``1 + K ..`` of the meta row it came from, ``metas[src][parity, my_rank, slot]`` (a tuple of per-rank
meta views, as the kernels of ``ep_comm.kernels`` take them; the parity comes from the step counter,
``ep_comm.kernels.step_counter``). Source side (``gather_weights_kernel``):
entry ``k`` of token ``t`` reads weight ``k`` of the row sent back by the rank owning its expert
(0 where the entry is masked), or, in a forwarded combine, by the forwarder of that rank's node. Weights travel as raw float32 bits (int32). One thread per entry;
``ep_comm.launching.weight_return`` launches them.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ep_comm.kernels.step_counter import step_parity


@cuda.jit
def send_weights_kernel(weight_bits, expand, recv_src_metadata, rank_psum, my_rank, step, ahead, metas):
    """``weight_bits``: compact ``[N, K]``, expand ``[M, 1]`` (the weight of each expanded row)."""
    parity = step_parity(step, ahead)
    num_topk = recv_src_metadata.shape[1] - 2
    max_tokens = metas[0].shape[2]
    num_entries = rank_psum[rank_psum.shape[0] - 1] * num_topk
    start = cuda.grid(1)
    for j in range(start, num_entries, cuda.gridsize(1)):
        row = j // num_topk
        k = j - row * num_topk
        src = recv_src_metadata[row, 0] // max_tokens
        slot = recv_src_metadata[row, 1] - src * max_tokens
        if expand:
            expanded = recv_src_metadata[row, 2 + k]
            bits = weight_bits[expanded, 0] if expanded >= 0 else 0
        else:
            bits = weight_bits[row, k]
        metas[src][parity, my_rank, slot, 1 + num_topk + k] = bits


@cuda.jit
def gather_weights_kernel(meta_by_parity, step, slot_idx, topk_idx, experts_per_rank, my_rank, node_size, out_bits):
    """``meta_by_parity [2, R, max_tokens, 1 + 2K]`` int32: this rank's meta rows; the combine's parity is
    read from ``step``. ``node_size``: ranks per node of a forwarded combine (``R``: flat), where an entry owned
    in another node reads the meta row ``token`` of that node's forwarder (the rank with ``my_rank``'s local
    index), which ``ep_comm.kernels.forward.node_reduce_kernel`` wrote."""
    meta = meta_by_parity[step_parity(step, 0)]
    num_tokens, num_topk = topk_idx.shape
    max_tokens = meta.shape[1]
    my_node = my_rank // node_size
    start = cuda.grid(1)
    for j in range(start, num_tokens * num_topk, cuda.gridsize(1)):
        t = j // num_topk
        k = j - t * num_topk
        expert = np.int64(topk_idx[t, k])
        bits = np.int32(0)
        if expert >= 0:
            rank = expert // experts_per_rank
            node = rank // node_size
            if node != my_node:  # a forwarded node: its forwarder's row of the token (ids past R: none)
                if rank < meta.shape[0]:
                    bits = meta[node * node_size + my_rank - my_node * node_size, t, 1 + num_topk + k]
            else:
                for kk in range(num_topk):  # the token's first entry on that rank holds the slot
                    other = np.int64(topk_idx[t, kk])
                    if other >= 0 and other // experts_per_rank == rank and slot_idx[t, kk] >= 0:
                        bits = meta[rank, slot_idx[t, kk] - my_rank * max_tokens, 1 + num_topk + k]
                        break
        out_bits[t, k] = bits
