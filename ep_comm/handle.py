"""Results of a dispatch and of a combine, the handle that replays a routing, and the record of the handles a Buffer
has checked (``HandleChecks``, which the public API and the prepared path share)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

from ep_comm.contract import checks as chk
from ep_comm.contract.arrays import Array
from ep_comm.contract.geometry import Geometry

Count = Union[int, Array]  # a host int when cpu_sync, else a 0-d device array


@dataclass
class EPHandle:
    """Everything needed to replay a routing (cached dispatch) and to combine its outputs.

    Fields follow DeepEP V2. ``N`` = rows of the compact receive layout, ``M`` = rows of the
    expand layout, ``L`` = local experts; with ``cpu_sync=False`` ``N``/``M`` are worst cases.

    The handle owns its routing: ``topk_idx`` and ``topk_weights`` are copies ``Buffer.dispatch``
    made of the caller's arrays, so later writes into those change neither replays nor combines.
    """

    psum_num_recv_tokens_per_rank: Array  # [R] int32, inclusive prefix sum of rows per source rank
    psum_num_recv_tokens_per_expert: Array  # [L] int32 (expand: align(psum[i-1]) + count[i])
    num_recv_tokens_per_expert: Any  # [L] aligned counts: a host list when cpu_sync, else a device array
    num_unaligned_recv_tokens_per_expert: Array  # [L] int32
    # [N, 2+K] int32: col 0 src_rank*max_tokens+src_token, col 1 symmetric-buffer row, cols 2.. expanded row or -1
    recv_src_metadata: Array
    # [T, K] int32: src_rank*max_tokens+slot in the destination buffer, on the first entry per rank
    dst_buffer_slot_idx: Array
    num_recv_tokens: Count  # compact rows received
    num_expanded_tokens: Count  # expanded rows, padding included
    # the dispatch arguments
    num_tokens: int
    topk_idx: Array  # [T, K] integer ids as given (validated): the handle's own copy, never the caller's array
    topk_weights: Optional[Array]  # [T, K] float32, the handle's own copy, or None
    is_token_in_rank: Array  # [T, R] bool, source side
    expand: bool
    expert_alignment: int
    zero_padding: bool
    deterministic: bool
    cpu_sync: bool
    num_out_rows: int  # rows of recv_x (M when expand, else N)
    geometry: Geometry  # of the Buffer that made it: only a Buffer of the same geometry takes the handle
    # arrays a backend keeps with the handle, by name (device arrays derived from the fields above for replays: the
    # handle is never changed after the dispatch that made it, so they are computed once; on mpi, the received rows'
    # local expert ids its combine sends back); not part of the contract
    derived: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def routing(self) -> "Routing":
        """The sender side this handle recorded (what a replay of it sends)."""
        return Routing(self.topk_idx, self.is_token_in_rank, self.dst_buffer_slot_idx)


class Routing(NamedTuple):
    """The sender side of a routing: what a dispatch computed from ``topk_idx`` and a replay reuses."""

    topk_idx: Array  # [T, K] integer ids, the handle's own copy (see EPHandle)
    is_token_in_rank: Array  # [T, R] bool
    dst_buffer_slot_idx: Array  # [T, K] int32, see EPHandle


class Received(NamedTuple):
    """The receiver side of one dispatch, as the ``EPHandle`` fields of the same names hold it."""

    psum_num_recv_tokens_per_rank: Array
    psum_num_recv_tokens_per_expert: Array
    num_recv_tokens_per_expert: Any
    num_unaligned_recv_tokens_per_expert: Array
    recv_src_metadata: Array
    num_recv_tokens: Count
    num_expanded_tokens: Count
    num_out_rows: int


def make_handle(routing: Tuple[Array, Array, Array], received: Tuple[Any, ...], topk_weights: Optional[Array], *,
                geometry: Geometry, expand: bool, expert_alignment: int, zero_padding: bool, deterministic: bool,
                cpu_sync: bool) -> EPHandle:
    """The handle of one dispatch (every backend and dispatch path builds it here).

    Args:
        routing: the sender side, a ``Routing`` or a tuple in its order (``topk_idx [T, K]``,
            ``is_token_in_rank [T, R]``, ``dst_buffer_slot_idx [T, K]``).
        received: the receiver side, a ``Received`` or a tuple in its order (the ``EPHandle`` fields of the same
            names; the prepared path passes a plain tuple: no NamedTuple to build per call).
        topk_weights: ``[T, K]`` float32 the dispatch carried, or None.
        geometry: the geometry of the Buffer dispatching (``geometry.Geometry``).
        expand, expert_alignment, zero_padding, deterministic, cpu_sync: the dispatch's options.

    Returns:
        The ``EPHandle``; ``num_tokens`` is ``T``.
    """
    topk_idx, is_token_in_rank, slots = routing
    rank_psum, expert_psum, aligned, unaligned, metadata, num_recv, num_expanded, num_out_rows = received
    return EPHandle(psum_num_recv_tokens_per_rank=rank_psum, psum_num_recv_tokens_per_expert=expert_psum,
                    num_recv_tokens_per_expert=aligned, num_unaligned_recv_tokens_per_expert=unaligned,
                    recv_src_metadata=metadata, dst_buffer_slot_idx=slots, num_recv_tokens=num_recv,
                    num_expanded_tokens=num_expanded, num_tokens=int(topk_idx.shape[0]), topk_idx=topk_idx,
                    topk_weights=topk_weights, is_token_in_rank=is_token_in_rank, expand=expand,
                    expert_alignment=expert_alignment, zero_padding=zero_padding, deterministic=deterministic,
                    cpu_sync=cpu_sync, num_out_rows=num_out_rows, geometry=geometry)


@dataclass
class DispatchOutput:
    """``recv_x [rows, H]``; ``recv_topk_idx``/``recv_topk_weights`` are ``[N, K]`` (compact,
    local expert ids or -1) or ``[M]`` (expand: the row's local expert, -1 for padding)."""

    recv_x: Array
    recv_topk_idx: Array
    recv_topk_weights: Optional[Array]
    handle: EPHandle


@dataclass
class CombineOutput:
    """``x [T, H]`` in the payload dtype; ``topk_weights [T, K]`` float32 gathered back, or None."""

    x: Array
    topk_weights: Optional[Array]


class HandleChecks:
    """The handles that passed ``checks.check_handle`` on one Buffer (``seen``: ``id(handle)`` -> weak reference,
    a handle's lifetime stays its user's; forgotten when they die). The check runs once per handle: a handle is
    never changed after the dispatch that made it, and the geometry is the Buffer's for good."""

    def __init__(self, geo: Geometry):
        self.geo = geo
        self.seen: Dict[int, weakref.ref] = {}

    def check(self, handle: Any, doing: str) -> None:
        """``handle`` must be an ``EPHandle`` that ``checks.check_handle`` passes for this Buffer's geometry
        (TypeError / ValueError otherwise, naming ``doing``, where such a handle comes from)."""
        seen = self.seen.get(id(handle))
        if seen is not None and seen() is handle:
            return
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from {doing}, got {type(handle).__name__}")
        chk.check_handle(handle, self.geo)
        self.note(handle)

    def note(self, handle: EPHandle) -> None:
        """``handle`` passes: checked, or made by a dispatch of this Buffer."""
        key = id(handle)
        self.seen[key] = weakref.ref(handle, lambda _, key=key: self.seen.pop(key, None))
