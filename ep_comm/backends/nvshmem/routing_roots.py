"""The arrays of a handle as the recorded calls of its replays and combines take them (:func:`handle_roots`).

The routing arrays are the count block of the new routing that made them (one root, and one key word for the layout
of its views), not five arrays, each a key word of shape, strides, dtype and alignment read on every call
(``ep_comm._launcher.recorded_calls.call_key``). A new routing's handle keeps its count root in ``EPHandle.derived``
under ``COUNT_ROOT``, with the arrays it was made with; a replay's handle, whose routing arrays are the replayed
handle's, keeps the same.

A handle used more than once (replayed, combined again) has its arguments read once: from its second use on, its
routing and the combine send's arrays come as ``FixedArguments``, one key word each, their roots' pointers read with
them. Its first use takes them as they are: a handle used once (the output of a replay, or of a new routing, combined
once) is read once either way, and reading it into a ``FixedArguments`` would cost it more than that saves.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

from ep_comm._launcher.recorded_calls import FixedArguments, Pointers, arguments
from ep_comm.handle import EPHandle

__all__ = ["COUNT_ROOT", "HANDLE_ROOTS", "HeldRoots", "handle_roots", "routing_arrays"]

# EPHandle.derived: ((views, block), topk_idx, is_token_in_rank, dst_buffer_slot_idx, rank psum, expert psum) of the
# new routing that made the handle: the recarving of the handle's views of its count block, the block, those views
COUNT_ROOT = "count_root"
# EPHandle.derived: the HeldRoots of handle_roots' last answer
HANDLE_ROOTS = "handle_roots"


class HeldRoots(NamedTuple):
    """What :func:`handle_roots` keeps in ``EPHandle.derived[HANDLE_ROOTS]``: the handle's fields its answer was made
    from (checked by identity on every use), then the answer, ``routing`` and ``send``; ``send`` None: the handle not
    used yet, its routing read already (a replay's output handle takes the replayed handle's routing,
    ``NvshmemDispatch.output``). Made with ``tuple.__new__(HeldRoots, values)`` on the eager path: the same record
    without the Python frame of the generated ``__new__`` (the eager budgets count Python calls)."""

    topk_idx: Any
    is_token_in_rank: Any
    dst_buffer_slot_idx: Any
    rank_psum: Any
    expert_psum: Any
    recv_src_metadata: Any
    expand: bool
    routing: Any
    send: Any


def handle_roots(h: EPHandle, pointers: Pointers) -> Tuple[Any, Any]:
    """``(routing, send)``: the arguments of handle ``h`` that its recorded calls take, each as it is at the handle's
    first use and as a ``FixedArguments`` (read once, with ``pointers``: per array type its data pointer, the recorded
    calls') from its second use on.

    ``routing``, a replay's and a combine reduce's (read with :func:`routing_arrays`): the handle's routing arrays
    (``topk_idx``, ``is_token_in_rank``, ``dst_buffer_slot_idx``, the rank psum and the expert psum) as a pair,
    ``(views, block)``, the count block of the new routing that made them and the recarving of its views, where they
    are its views still (their identities checked against ``COUNT_ROOT``); else ``(None, the five arrays)``. ``send``,
    a combine send's (read with ``recorded_calls.arguments``): ``(recv_src_metadata, psum_num_recv_tokens_per_rank,
    expand)``.

    The answer is kept in ``h.derived`` with the fields it was made from and used while the handle's fields are those
    very objects (checked by identity on every call: a copy of the handle given other arrays, ``dataclasses.replace``,
    shares ``derived`` and is read anew). The handle holds its arrays and never changes them: their pointers cannot go
    stale. A replay's output handle, whose routing arrays are the replayed handle's, starts with the replayed
    handle's ``routing`` where that was read (``NvshmemDispatch.output``)."""
    derived = h.derived
    held = derived.get(HANDLE_ROOTS)
    if held is not None:
        ids, in_rank, slots, rank_psum, expert_psum, metadata, expand, routing, send = held
        if (h.topk_idx is ids and h.is_token_in_rank is in_rank and h.dst_buffer_slot_idx is slots
                and h.psum_num_recv_tokens_per_rank is rank_psum and h.psum_num_recv_tokens_per_expert is expert_psum
                and h.recv_src_metadata is metadata and h.expand is expand):
            if type(send) is FixedArguments:
                return routing, send
            if send is None:  # a replay's output, its routing read with the replayed handle's: its first use
                send = (metadata, rank_psum, expand)
            else:  # the handle's second use: read once, for every use after it
                if type(routing) is not FixedArguments:
                    routing = FixedArguments(routing, pointers)
                send = FixedArguments(send, pointers)
            derived[HANDLE_ROOTS] = tuple.__new__(HeldRoots, (ids, in_rank, slots, rank_psum, expert_psum, metadata,
                                                              expand, routing, send))
            return routing, send
    # the handle's first use (all that a handle used once pays: no call made, no FixedArguments read)
    ids, in_rank, slots = h.topk_idx, h.is_token_in_rank, h.dst_buffer_slot_idx
    rank_psum, expert_psum = h.psum_num_recv_tokens_per_rank, h.psum_num_recv_tokens_per_expert
    fields = (ids, in_rank, slots, rank_psum, expert_psum)
    counted = derived.get(COUNT_ROOT)
    if (counted is not None and counted[1] is ids and counted[2] is in_rank and counted[3] is slots
            and counted[4] is rank_psum and counted[5] is expert_psum):
        routing = counted[0]
    else:
        routing = (None, fields)
    send = (h.recv_src_metadata, rank_psum, h.expand)
    derived[HANDLE_ROOTS] = tuple.__new__(HeldRoots, fields + (h.recv_src_metadata, h.expand, routing, send))
    return routing, send


def routing_arrays(routing: Any) -> Tuple[Any, ...]:
    """``(topk_idx, is_token_in_rank, dst_buffer_slot_idx, rank psum, expert psum)`` of :func:`handle_roots`'
    ``routing``, as it is or as a ``FixedArguments`` (a count block's views are made here: call it inside a recorded
    call, which runs only when it records)."""
    views, held = arguments(routing)
    return held if views is None else tuple(views.views(held)[:5])
