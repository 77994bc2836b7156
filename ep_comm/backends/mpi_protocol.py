"""The reference protocol of the mpi backend (``MpiProtocol``): dispatch (count, prefix sums, count exchange with
the routing verdicts, rank scatter into the peers' windows, expert scatter on receipt) and combine (rows back,
reduced at the source in rank order), with ``ep_comm.contract.layout`` and ``ep_comm.contract.reduce`` doing the
math; the rows and meta rows a step puts into and reads from the windows.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ep_comm.backends.interface import CombineRequest, DispatchRequest, ReceiveHalf
from ep_comm.backends.mpi_steps import MpiSteps
from ep_comm.contract import fp8
from ep_comm.contract import layout as lay
from ep_comm.contract.checks import routing_error, topk_values, verdict_of, verdict_words
from ep_comm.contract.forward_inbox import slot_order
from ep_comm.contract.protocol import VERDICT_WORDS
from ep_comm.contract.reduce import combine_rows, expand_partials
from ep_comm.contract.symmetric import SymmetricLayout
from ep_comm.contract.topology import Topology
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle, Received, Routing, make_handle

# handle.derived key: int64 [N, K] local expert ids of the rows a dispatch received here (-1: the expert is elsewhere),
# the entries this rank owns; its combine sends them back in the meta rows (a forwarder merges its node's weights)
RECV_LOCAL_IDS = "mpi.recv_local_ids"


def _routes_nothing(routing: Routing) -> Routing:
    """``routing`` (its ids kept) as a dispatch refused for a bad verdict leaves it: no token in any rank, no slot."""
    return Routing(routing.topk_idx, np.zeros_like(routing.is_token_in_rank),
                   np.full_like(routing.dst_buffer_slot_idx, -1))


class MpiProtocol(MpiSteps):
    """``MpiBackend``'s ``pack_fp8``, ``dispatch``, ``dispatch_send``, ``combine`` and ``combine_send``."""

    deterministic: bool
    sym: SymmetricLayout
    topology: Topology
    scaleout_rows: Dict[str, int]  # rows this rank put over the scale-out path, per operation ("dispatch", "combine")

    def _count_scaleout(self, what: str, dst: int, rows: int) -> None:
        """Count ``rows`` put by operation ``what`` into ``dst``'s window when ``dst`` is in another node."""
        if not self.topology.in_reach(self.rank, dst):
            self.scaleout_rows[what] += rows

    def _pack_rows(self, rows: np.ndarray) -> np.ndarray:
        """``[n, H]`` payload -> ``[n, row_bytes]`` uint8 (padded to the symmetric row pitch)."""
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.shape[1] * rows.dtype.itemsize)
        if raw.shape[1] == self.sym.row_bytes:
            return raw
        padded = np.zeros((len(rows), self.sym.row_bytes), dtype=np.uint8)
        padded[:, : raw.shape[1]] = raw
        return padded

    def _pack_meta(self, tokens: np.ndarray, local_ids: np.ndarray, weights: Optional[np.ndarray]) -> np.ndarray:
        """``[n, 1+2K]`` int32 meta rows: source token, K local expert ids, K float32 weights as bits."""
        k = self.geo.num_topk
        meta = np.zeros((len(tokens), self.sym.meta_words), dtype=np.int32)
        meta[:, 0] = tokens
        meta[:, 1 : 1 + k] = local_ids
        if weights is not None:
            meta[:, 1 + k :] = np.ascontiguousarray(weights, dtype=np.float32).view(np.int32)
        return meta

    def _put_block(self, dst: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        self.window.put(self._pack_rows(rows), dst, self.sym.row_at(parity, self.rank))
        self.window.put(meta, dst, self.sym.meta_at(parity, self.rank))

    def _unpack_rows(self, raw: np.ndarray, width: int) -> np.ndarray:
        """``[n, row_bytes]`` uint8 (or its flat bytes) -> ``[n, width]`` payload (a copy; ``width`` is H, or
        narrower for packed FP8 rows): :meth:`_pack_rows` undone."""
        rows = raw.reshape(-1, self.sym.row_bytes)[:, : width * self.geo.dtype.itemsize]
        return np.ascontiguousarray(rows).view(self.geo.dtype).reshape(-1, width)

    def _read_block(self, parity: int, src: int, count: int, width: int) -> tuple:
        """Rows ``[count, width]`` (payload dtype; ``width`` is H, or narrower for packed FP8 rows) and meta
        ``[count, 1+2K]`` int32 that ``src`` wrote here."""
        rows = self._unpack_rows(self.window.local(self.sym.row_at(parity, src), count * self.sym.row_bytes), width)
        meta = self.window.local(self.sym.meta_at(parity, src), count * self.sym.meta_words * 4)
        return rows, meta.view(np.int32).reshape(count, self.sym.meta_words).copy()

    # ---------------------------------------------------------------- dispatch
    def pack_fp8(self, x: Any) -> np.ndarray:
        """The payload of an FP8 dispatch: the packed FP8 rows ``[T, P / itemsize]`` in the buffer dtype of the pair
        ``x = (x_fp8, scales)`` (``ep_comm.contract.fp8.pack``), or of ``x [T, H]`` quantized (``ep_comm.contract.fp8.quantize``,
        ValueError for non-finite ``x``)."""
        rows = fp8.pack(*x) if isinstance(x, tuple) else fp8.pack(*fp8.quantize(x))
        return rows.view(self.geo.dtype)

    def dispatch(self, request: DispatchRequest) -> DispatchOutput:
        """One collective dispatch: a new routing (``request.handle`` None) or a replay of the handle's."""
        return self._plain("dispatch", request.cpu_sync, self._dispatch, request)

    def dispatch_send(self, request: DispatchRequest) -> ReceiveHalf[DispatchOutput]:
        """The send part of one collective dispatch (puts into the peers' windows, signal), and its receive part."""
        return self._split("dispatch", request.cpu_sync, self._dispatch, request)

    def _dispatch(self, step: Tuple[int, int], request: DispatchRequest,
                  hooked: bool) -> Callable[[], DispatchOutput]:
        """The send part of a dispatch; returns its receive part."""
        geo, handle = self.geo, request.handle
        seq, parity = step
        words = None
        if handle is None:
            topk_idx, verdict = self._checked(request.topk_idx)
            sent = lay.dispatch_layout(topk_idx, geo.num_experts, geo.num_ranks)
            in_rank = sent.is_token_in_rank
            words = np.concatenate([lay.send_count_words(sent), np.tile(verdict, (geo.num_ranks, 1))], axis=1)
            slots = lay.stable_rank_slots(in_rank) if self.deterministic else lay.atomic_rank_slots(in_rank, seed=seq)
            slot_idx = lay.dst_buffer_slot_idx(topk_idx, slots, self.rank, geo.experts_per_rank, geo.max_tokens)
            routing = Routing(topk_idx, in_rank, slot_idx)
        else:
            routing = handle.routing
            slots = self._slots_from_handle(handle)
        with self.profile.phase("dispatch", "scatter"):
            self._scatter(parity, request, routing, slots, words)
        self._signal("dispatch", seq, hooked)
        return functools.partial(self._dispatch_receive, step, request, routing, hooked)

    def _checked(self, topk_idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(ids, verdict)`` of this rank's new routing ``topk_idx [T, K]``: ``verdict``, the ``VERDICT_WORDS``
        int64 words of ``checks.verdict_words`` its count block carries; ``ids``, the handle's own copy of
        ``topk_idx`` with the ids past the experts read as "no expert" (-1), as the GPU count kernel reads them:
        nothing is sent past a bound."""
        top, twice = topk_values(np, topk_idx) if len(topk_idx) else (-1, -1)
        ids = np.where(topk_idx < self.geo.num_experts, topk_idx, -1) if top >= self.geo.num_experts else topk_idx.copy()
        return ids, np.array(verdict_words(top, twice), dtype=np.int64)

    def _received_counts(self, parity: int) -> List[int]:
        """The rows each source rank sent here in the new routing's dispatch of ``parity``, read from its count
        block; all 0 when any rank's verdict is bad, whose ``checks.routing_error`` is kept for the call to
        raise (:meth:`_settled`)."""
        blocks = [self.window.local(self.sym.count_at(parity, s), 8 * self.sym.count_words).view(np.int64)
                  for s in range(self.geo.num_ranks)]
        self._refused = routing_error([verdict_of(b[-VERDICT_WORDS:]) for b in blocks], self.geo.num_experts,
                                      self.steps.latest)
        return [0 if self._refused else int(b[0]) for b in blocks]

    def _dispatch_receive(self, step: Tuple[int, int], request: DispatchRequest, routing: Routing,
                          hooked: bool) -> DispatchOutput:
        """The receive part of a dispatch: the rows every rank put here, assembled into the outputs; none, and a
        handle that routes nothing, when a rank's routing verdict is bad (:meth:`_received_counts`)."""
        handle = request.handle
        seq, parity = step
        self._wait("dispatch", seq, hooked)
        with self.profile.phase("dispatch", "receive"):
            if handle is None:
                counts = self._received_counts(parity)
                if self._refused:
                    routing = _routes_nothing(routing)
            else:
                counts = np.diff(np.asarray(handle.psum_num_recv_tokens_per_rank), prepend=0).tolist()
            blocks = [self._read_block(parity, s, c, request.x.shape[1]) for s, c in enumerate(counts)]
            rows = np.concatenate([b[0] for b in blocks])  # one block per source rank, possibly empty
            meta = np.concatenate([b[1] for b in blocks])
            return self._assemble(rows, meta, counts, request, routing)

    def _scatter(self, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                 words: Optional[np.ndarray]) -> None:
        """Rank scatter: each destination's rows in slot order, one put per destination, and with ``words``
        (a new routing: ``layout.send_count_words`` and this rank's verdict, int64 ``[R, 1 + L + VERDICT_WORDS]``)
        the count exchange, row ``dst`` to ``dst``: its rows, its entries per local expert, the verdict."""
        for dst in range(self.geo.num_ranks):
            self._scatter_to(dst, parity, request, routing, slots, words)

    def _scatter_to(self, dst: int, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                    words: Optional[np.ndarray]) -> None:
        """The rank scatter's puts into ``dst`` (:meth:`_scatter`)."""
        geo, weights = self.geo, request.topk_weights
        tokens = slot_order(slots[:, dst])
        local_ids = lay.local_topk(routing.topk_idx[tokens], dst, geo.experts_per_rank)
        self._put_block(dst, parity, request.x[tokens],
                        self._pack_meta(tokens, local_ids, None if weights is None else weights[tokens]))
        self._count_scaleout("dispatch", dst, len(tokens))
        if words is not None:  # count exchange
            self.window.put(words[dst], dst, self.sym.count_at(parity, self.rank))

    def _slots_from_handle(self, handle: EPHandle) -> np.ndarray:
        """``[T, R]`` slots recorded in a handle's ``dst_buffer_slot_idx``."""
        geo = self.geo
        slots = np.full((handle.num_tokens, geo.num_ranks), -1, dtype=np.int64)
        ranks = lay.entry_ranks(handle.topk_idx, geo.experts_per_rank)
        t, k = np.nonzero(handle.dst_buffer_slot_idx >= 0)
        slots[t, ranks[t, k]] = handle.dst_buffer_slot_idx[t, k] - self.rank * geo.max_tokens
        return slots

    def _expert_layout(self, local_ids: np.ndarray, request: DispatchRequest) -> tuple:
        """``(expanded_row [N, K], unaligned [L], aligned [L], psum_per_expert [L], num_expanded)`` of the
        received rows: computed for a new routing, the handle's for a replay."""
        handle, n = request.handle, len(local_ids)
        if handle is None:
            recv = lay.receive_layout(local_ids, self.geo.experts_per_rank, request.expert_alignment, request.expand)
            expanded_row = recv.expanded_row if request.expand else np.full(local_ids.shape, -1, dtype=np.int32)
            return (expanded_row, recv.num_unaligned_per_expert, recv.num_aligned_per_expert, recv.psum_per_expert,
                    recv.num_expanded_tokens)
        return (np.asarray(handle.recv_src_metadata)[:n, 2:], np.asarray(handle.num_unaligned_recv_tokens_per_expert),
                np.asarray(handle.num_recv_tokens_per_expert, dtype=np.int32),
                np.asarray(handle.psum_num_recv_tokens_per_expert), int(handle.num_expanded_tokens))

    def _assemble(self, rows: np.ndarray, meta: np.ndarray, counts: List[int], request: DispatchRequest,
                  routing: Routing) -> DispatchOutput:
        """Receiver side: compact rows grouped by source -> outputs, metadata and the handle."""
        geo, cpu_sync = self.geo, request.cpu_sync
        k = geo.num_topk
        n = len(rows)
        local_ids = meta[:, 1 : 1 + k].astype(np.int64)
        weights = meta[:, 1 + k :].view(np.float32) if request.topk_weights is not None else None
        src_rank = np.repeat(np.arange(geo.num_ranks), counts)
        slot = np.arange(n) - np.repeat(lay.exclusive_psum(counts)[:-1], counts)
        expanded_row, unaligned, aligned, psum_e, num_expanded = self._expert_layout(local_ids, request)
        stats = request.stats
        if stats is not None:
            stats += unaligned.astype(stats.dtype)
        meta_rows, out_rows = geo.output_rows((n, num_expanded) if cpu_sync else None, request.expand,
                                              request.expert_alignment)
        metadata = np.full((meta_rows, 2 + k), -1, dtype=np.int32)
        metadata[:n, 0] = src_rank * geo.max_tokens + meta[:, 0]
        metadata[:n, 1] = src_rank * geo.max_tokens + slot
        metadata[:n, 2:] = expanded_row
        if request.expand:
            recv_x, recv_idx, recv_w = self._expand(rows, local_ids, weights, expanded_row, out_rows)
        else:
            recv_x, recv_idx, recv_w = self._compact(rows, local_ids, weights, out_rows)
        received = Received(
            lay.inclusive_psum(counts), psum_e, [int(c) for c in aligned] if cpu_sync else aligned, unaligned,
            metadata, n if cpu_sync else np.array(n, dtype=np.int64),
            num_expanded if cpu_sync else np.array(num_expanded, dtype=np.int64), out_rows)
        handle = make_handle(routing, received, request.topk_weights, geometry=self.geo, expand=request.expand,
                             expert_alignment=request.expert_alignment, zero_padding=request.zero_padding,
                             deterministic=self.deterministic, cpu_sync=cpu_sync)
        handle.derived[RECV_LOCAL_IDS] = local_ids
        return DispatchOutput(recv_x, recv_idx, recv_w, handle)

    def _compact(self, rows, local_ids, weights, out_rows) -> tuple:
        """Compact outputs: the received rows, then zero rows (ids -1) up to ``out_rows``."""
        n, k = len(rows), self.geo.num_topk
        recv_x = np.zeros((out_rows, rows.shape[1]), dtype=self.geo.dtype)
        recv_x[:n] = rows
        recv_idx = np.full((out_rows, k), -1, dtype=np.int64)
        recv_idx[:n] = local_ids
        recv_w = None
        if weights is not None:
            recv_w = np.zeros((out_rows, k), dtype=np.float32)
            recv_w[:n] = np.where(local_ids >= 0, weights, 0)
        return recv_x, recv_idx, recv_w

    def _expand(self, rows, local_ids, weights, expanded_row, out_rows) -> tuple:
        """Expert scatter: one output row per (row, local expert); padding rows stay zero."""
        recv_x = np.zeros((out_rows, rows.shape[1]), dtype=self.geo.dtype)
        recv_idx = np.full(out_rows, -1, dtype=np.int64)
        recv_w = np.zeros(out_rows, dtype=np.float32) if weights is not None else None
        r, k = np.nonzero(expanded_row >= 0)
        dest = expanded_row[r, k]
        recv_x[dest] = rows[r]
        recv_idx[dest] = local_ids[r, k]
        if recv_w is not None:
            recv_w[dest] = weights[r, k]
        return recv_x, recv_idx, recv_w

    # ----------------------------------------------------------------- combine
    def combine(self, request: CombineRequest) -> CombineOutput:
        """One collective combine of ``request.y`` along the routes of ``request.handle``."""
        return self._plain("combine", True, self._combine, request)

    def combine_send(self, request: CombineRequest) -> ReceiveHalf[CombineOutput]:
        """The send part of one collective combine (rows and weights back into the sources' windows, signal), and
        its receive part."""
        return self._split("combine", True, self._combine, request)

    def _combine(self, step: Tuple[int, int], request: CombineRequest, hooked: bool) -> Callable[[], CombineOutput]:
        """The send part of a combine; returns its receive part."""
        geo, handle, topk_weights = self.geo, request.handle, request.topk_weights
        seq, parity = step
        with self.profile.phase("combine", "send"):
            counts = np.diff(np.asarray(handle.psum_num_recv_tokens_per_rank), prepend=0)
            n = int(counts.sum())
            meta = np.asarray(handle.recv_src_metadata)[:n]
            if handle.expand:
                partial = expand_partials(request.y, meta[:, 2:], topk_weights, geo.dtype)
                back_w = None if topk_weights is None else np.where(meta[:, 2:] >= 0,
                                                                    topk_weights[np.maximum(meta[:, 2:], 0)], 0)
            else:
                partial, back_w = request.y[:n], None if topk_weights is None else topk_weights[:n]
            starts, owned = lay.exclusive_psum(counts), handle.derived[RECV_LOCAL_IDS]
            for src in range(geo.num_ranks):
                block = slice(starts[src], starts[src + 1])
                w = None if back_w is None else back_w[block]
                self._return_rows(src, parity, partial[block],
                                  self._pack_meta(meta[block, 0] % geo.max_tokens, owned[block], w))
        self._signal("combine", seq, hooked)
        return functools.partial(self._combine_receive, step, request, hooked)

    def _return_rows(self, src: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        """A combine's partials ``rows [n, H]`` for source rank ``src`` (the rows it sent here, in slot order) and
        their meta rows ``[n, 1 + 2K]`` int32 (source token, this rank's local expert ids, weights), into ``src``'s
        window."""
        self._put_block(src, parity, rows, meta)
        self._count_scaleout("combine", src, len(rows))

    def _combine_receive(self, step: Tuple[int, int], request: CombineRequest, hooked: bool) -> CombineOutput:
        """The receive part of a combine: every token's rows from the ranks it reached, reduced."""
        seq, parity = step
        self._wait("combine", seq, hooked)
        with self.profile.phase("combine", "reduce"):
            return self._reduce_at_source(request.handle, parity, request.topk_weights is not None,
                                          request.bias_terms)

    def _reduce_at_source(self, handle: EPHandle, parity: int, with_weights: bool, bias_terms) -> CombineOutput:
        """Source side: each token's terms (:meth:`_term_of`) gathered from the rows sent back, summed in rank
        order (``reduce.combine_rows``)."""
        geo = self.geo
        slots = self._slots_from_handle(handle)
        term_of = self._term_of()
        reached = np.stack([handle.is_token_in_rank[:, term_of == q].any(axis=1) for q in range(geo.num_ranks)],
                           axis=1)
        terms = [self._read_term(parity, q, reached[:, q], slots) for q in range(geo.num_ranks)]
        x = combine_rows([rows for rows, _ in terms], reached, bias_terms, geo.dtype)
        topk_w = self._gather_weights(handle, term_of, [w for _, w in terms]) if with_weights else None
        return CombineOutput(x, topk_w)

    def _term_of(self) -> np.ndarray:
        """int64 ``[R]``: the rank whose term of the source's reduce carries each rank's partial; flat, itself."""
        return np.arange(self.geo.num_ranks)

    def _read_term(self, parity: int, q: int, reached: np.ndarray, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(rows [T, H] payload, weights [T, K] float32)`` of term ``q`` for each token of this rank, meaningful
        where ``reached [T]``: the rows rank ``q`` sent back, picked by their slots ``slots[:, q]``."""
        geo = self.geo
        rows, meta = self._read_block(parity, q, int(reached.sum()), geo.hidden)
        if not len(rows):
            return np.zeros((len(reached), geo.hidden), geo.dtype), np.zeros((len(reached), geo.num_topk), np.float32)
        pick = np.maximum(slots[:, q], 0)
        return rows[pick], meta[pick, 1 + geo.num_topk :].view(np.float32)

    def _gather_weights(self, handle: EPHandle, term_of: np.ndarray, weights_of_term) -> np.ndarray:
        """``[T, K]``: entry k's weight as sent back by the rank owning its expert, read from the term carrying
        that rank (``term_of [R]``, ``weights_of_term[q] [T, K]`` float32); 0 if masked."""
        ranks = lay.entry_ranks(handle.topk_idx, self.geo.experts_per_rank)
        terms = np.where(ranks >= 0, term_of[np.maximum(ranks, 0)], -1)
        out = np.zeros(ranks.shape, dtype=np.float32)
        for q, w in enumerate(weights_of_term):
            mask = terms == q
            out[mask] = w[mask]
        return out
