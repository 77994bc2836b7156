"""Scale-out rows counted on the device (``Buffer.traffic()`` on the nvshmem backend): the payload rows a rank puts
into ranks of other nodes (forwarders' inboxes included), added into a counter the backend owns, int64 ``[2]``
(word :data:`DISPATCH_ROWS`, word :data:`COMBINE_ROWS`: ``ep_comm.contract.traffic.OPS``'s order). Nodes are blocks
of ``node_size`` consecutive ranks (``ep_comm.contract.topology``).

* :func:`dispatch_rows_kernel`: a dispatch's rows from its ``is_token_in_rank``: per token, the ranks of other nodes
  it goes to (flat), or the other nodes holding one of them (forwarded: one row per node, into its forwarder's
  inbox).
* :func:`combine_rows_kernel`: a flat combine's rows from the handle's received psum: the rows received from each
  rank of another node go back to it.
* A forwarded combine's rows are counted by the node reduce that writes them (``forward.node_reduce_kernel``, with
  :func:`add_warp_rows`).

The host does not know these counts when it enqueues a step (``cpu_sync=False``, CUDA-graph replays): the kernels
add them on the device, so that graph replays count too, and ``Buffer.traffic()`` copies the counter back.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ep_comm.kernels.index32 import quotient32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.pdl import pdl_enter
from ep_comm.kernels.warp import FULL_MASK, WARP, lane_id

DISPATCH_ROWS, COMBINE_ROWS = 0, 1  # the counter's words


@cuda.jit(device=True)
def add_warp_rows(counter, word, rows):
    """``counter[word] +=`` the sum of every lane's ``rows`` (int64): one atomic, by lane 0, none for a sum of 0.
    Every lane of the warp calls it."""
    offset = WARP // 2
    while offset > 0:
        rows += cuda.shfl_down_sync(FULL_MASK, rows, offset)
        offset //= 2
    if lane_id() == 0 and rows != 0:
        cuda.atomic.add(counter, word, rows)


@cuda.jit(device=True)
def token_rows(in_rank, t, node_size, my_node, per_node):
    """Scale-out rows of token ``t`` (row ``t`` of ``in_rank [T, R]`` bool): the ranks outside node ``my_node`` it
    goes to, or with ``per_node`` their distinct nodes."""
    rows = np.int64(0)
    for node in range(quotient32(in_rank.shape[1], node_size)):
        if node != my_node:
            hits = np.int64(0)
            for j in range(node_size):
                if in_rank[t, node * node_size + j]:
                    hits += 1
            rows += min(hits, np.int64(1)) if per_node else hits
    return rows


@kernel
def dispatch_rows_kernel(in_rank, node_size, my_rank, per_node, counter):
    """See :meth:`ep_comm.launching.kernel_launches.Kernels.dispatch_rows`: ``counter[DISPATCH_ROWS] +=`` the
    :func:`token_rows` of every token of ``in_rank [T, R]`` bool; one thread per token."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    my_node = quotient32(my_rank, node_size)
    rows = np.int64(0)
    t, stride = np.int32(cuda.grid(1)), np.int32(cuda.gridsize(1))
    while t < in_rank.shape[0]:
        rows += token_rows(in_rank, t, node_size, my_node, per_node)
        t = np.int32(t + stride)
    add_warp_rows(counter, DISPATCH_ROWS, rows)


@kernel
def combine_rows_kernel(rank_psum, node_size, my_rank, counter):
    """See :meth:`ep_comm.launching.kernel_launches.Kernels.combine_rows`: ``counter[COMBINE_ROWS] +=`` the rows
    received from the ranks of other nodes (``rank_psum [R]`` int32, inclusive prefix sum of the rows received from
    each rank); one thread per rank."""
    pdl_enter()  # nothing unless EP_COMM_KERNEL_PDL=1
    my_node = quotient32(my_rank, node_size)
    rows = np.int64(0)
    r, stride = np.int32(cuda.grid(1)), np.int32(cuda.gridsize(1))
    while r < rank_psum.shape[0]:
        if quotient32(r, node_size) != my_node:
            rows += rank_psum[r] - (rank_psum[r - 1] if r > 0 else 0)
        r = np.int32(r + stride)
    add_warp_rows(counter, COMBINE_ROWS, rows)
