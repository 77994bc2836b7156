"""The routing arrays of a handle as the recorded calls of its replays and combines take them: the count block of
the new routing that made them (one root, and one key word for the layout of its views), not five arrays, each a key
word of shape, strides, dtype and alignment read on every call (``ep_comm._launcher.recorded_calls.call_key``).

A new routing's handle keeps its count root in ``EPHandle.derived`` under ``COUNT_ROOT``, with the arrays it was made
with; a replay's handle, whose routing arrays are the replayed handle's, keeps the same.
"""
from __future__ import annotations

from typing import Any, Tuple

from ep_comm.handle import EPHandle

__all__ = ["COUNT_ROOT", "handle_routing", "routing_arrays"]

# EPHandle.derived: ((views, block), topk_idx, is_token_in_rank, dst_buffer_slot_idx, rank psum, expert psum) of the
# new routing that made the handle: the recarving of the handle's views of its count block, the block, those views
COUNT_ROOT = "count_root"


def handle_routing(h: EPHandle) -> Tuple[Any, Any]:
    """What the recorded calls of a replay or a combine take for the routing arrays of handle ``h`` (``topk_idx``,
    ``is_token_in_rank``, ``dst_buffer_slot_idx``, the rank psum and the expert psum), a pair: ``(views, block)``,
    the count block of the new routing that made them and the recarving of its views, where they are its views
    still (their identities checked: a handle copied with other arrays is not its dispatch's); else ``(None, the
    five arrays)``. A recorded call reads either with :func:`routing_arrays`."""
    held = h.derived.get(COUNT_ROOT)
    if held is not None:
        root, ids, in_rank, slots, rank_psum, expert_psum = held
        if (h.topk_idx is ids and h.is_token_in_rank is in_rank and h.dst_buffer_slot_idx is slots
                and h.psum_num_recv_tokens_per_rank is rank_psum and h.psum_num_recv_tokens_per_expert is expert_psum):
            return root
    return None, (h.topk_idx, h.is_token_in_rank, h.dst_buffer_slot_idx, h.psum_num_recv_tokens_per_rank,
                  h.psum_num_recv_tokens_per_expert)


def routing_arrays(routing: Tuple[Any, Any]) -> tuple:
    """``(topk_idx, is_token_in_rank, dst_buffer_slot_idx, rank psum, expert psum)`` of :func:`handle_routing`'s
    answer (a count block's views are made here: call it inside a recorded call, which runs only when it records)."""
    views, held = routing
    return held if views is None else tuple(views.views(held)[:5])
