"""Host side of the kernels: one method per kernel, on the launch shapes and the persistent workspace of
:class:`~ep_comm.launching.launch_shapes.LaunchShapes`.

Arrays are NumPy (in the simulator) or CuPy / any ``__cuda_array_interface__`` array (on a GPU);
this module only slices, views and allocates with the array module ``xp`` it was given. Payloads
travel as raw words (:func:`ep_comm.contract.symmetric.payload_words`). The mode constants of the scatter
(``SLOT_*``) and of the receive placement (``PLACE_*``) are the device modules' own, re-exported.

Typical use by a backend, per dispatch on rank ``me`` (``views[r]`` are rank r's symmetric
buffer, see :func:`ep_comm.contract.symmetric.symmetric_views`)::

    k = Kernels(xp, num_ranks=R, num_experts=E, num_topk=K, max_tokens=T_max)
    send = k.count(topk_idx, stable=deterministic, stream=s)  # + count exchange by the transport
    k.scatter(x, topk_idx, topk_weights, send.slot_idx, [v.rows for v in views],
              [v.meta for v in views], src_rank=me, step=step, ahead=1, mode=SLOT_STABLE, stream=s)
    recv = k.receive_count(own.counts, own.meta, step, alignment=a, expand=e, stable=d, stream=s)
    k.receive_copy(recv.rank_psum, own.rows, own.meta, step, recv_x, recv_topk_idx, recv_topk_weights,
                   recv_src_metadata, expand=e, mode=PLACE_STABLE, expert_psum=recv.expert_psum,
                   alignment=a, zero_padding=z, stream=s)
    # combine (next step): k.combine_scatter(y, recv_src_metadata, recv.rank_psum, [v.rows for v in views],
    #          my_rank=me, step=step, ahead=1, expand=e, weights=w, stream=s); transport signal;
    #          k.combine_reduce(own.rows, step, ..., stream=s)

``step`` is the step counter (int64 ``[1]`` on the device, ``ep_comm.kernels.step_counter``): every kernel
reads the buffer parity from it (the senders, which run before the signal that advances it, with
``ahead=1``), so a launch takes the same arguments at every step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from ep_comm._launcher.device_arrays import wide_rows
from ep_comm._launcher.prebound import prebound_kernel
from ep_comm.contract.arrays import Array
from ep_comm.contract.forward_inbox import InboxViews
from ep_comm.contract.fp8 import packed_row_bytes
from ep_comm.contract.symmetric import payload_rows, payload_words
from ep_comm.kernels.combine import SPAN, combine_copy_kernel, combine_expand_kernel, combine_reduce_kernel
from ep_comm.kernels.combine_bf16 import BF16_PASSES, combine_expand_bf16_kernel, combine_reduce_bf16_kernel
from ep_comm.kernels.count import count_kernel
from ep_comm.kernels.forward import combine_meta_kernel, inbox_send_kernel, node_reduce_kernel, relay_kernel
from ep_comm.kernels.receive import (
    PLACE_ATOMIC,
    PLACE_CACHED,
    PLACE_STABLE,
    receive_compact_kernel,
    receive_counted_compact_kernel,
    receive_place_kernel,
    receive_rows_kernel,
)
from ep_comm.kernels.receive_count import receive_count_kernel, receive_count_words_kernel
from ep_comm.kernels.routing_check import routing_check_kernel
from ep_comm.kernels.scatter import SLOT_ATOMIC, SLOT_CACHED, SLOT_STABLE, scatter_kernel, scatter_rows_kernel
from ep_comm.kernels.switches import legacy
from ep_comm.kernels.traffic import combine_rows_kernel, dispatch_rows_kernel
from ep_comm.kernels.units import units_for
from ep_comm.kernels.warp import COPY_UNROLL, WARP
from ep_comm.launching.fp8 import Fp8Rows
from ep_comm.launching.launch_shapes import (
    KeptViews,
    LaunchShapes,
    ReceiveCounts,
    SendLayout,
    Workspace,
    check_index_range,
    launch_device,
)

__all__ = ["Kernels", "SendLayout", "ReceiveCounts", "check_index_range", "SLOT_ATOMIC", "SLOT_STABLE",
           "SLOT_CACHED", "PLACE_ATOMIC", "PLACE_STABLE", "PLACE_CACHED"]


def _payload(x: Array) -> tuple[Array, bool]:
    """A payload array as Numba can type it, and whether it holds bfloat16 bits."""
    if x.dtype in (np.float32, np.float16):
        return x, False
    if x.dtype.itemsize == 2:  # bfloat16 (ml_dtypes) or its uint16 bits
        return x.view(np.uint16), True
    raise TypeError(f"payload dtype {x.dtype} is not float32, float16 or bfloat16")


def _copy_step(wide: bool) -> int:
    """Words one warp moves in one round trip of :func:`~ep_comm.kernels.warp.copy_row`."""
    return COPY_UNROLL * WARP * (2 if wide else 1)


class Kernels(LaunchShapes):
    """Launches the dispatch/combine kernels for one geometry; owns a small persistent workspace.

    ``xp``: the array module (NumPy in the simulator, CuPy on a GPU); ``shapes``: the base's launch shapes. The
    constructor allocates the :class:`~ep_comm.launching.launch_shapes.Workspace`. Every launch method takes the
    ``stream`` it launches on (a Numba stream, or 0: the legacy default stream); nothing is kept for the next call.
    """

    def __init__(self, xp: Any, **shapes: int):
        super().__init__(**shapes)
        self.xp, self._launch_device = xp, launch_device(xp)
        self._work = Workspace.allocate(xp, self)
        self._fixed = KeptViews().get  # views and verdicts of long-lived arrays, made once

    @property
    def prebound(self) -> bool:
        """Whether kernels launch pre-bound (a GPU, not ``EP_COMM_NUMBA_LAUNCH=1``): then calls can be recorded."""
        return self._launch_device is not None

    def _launch(self, kernel: Any, stream: Any, shared_bytes: int = 0, blocks: int = 0,
                warps_per_block: int = 0) -> Callable[..., None]:
        """``_launch(kernel, stream, ...)(*args)``: ``kernel`` on ``stream``, ``blocks`` blocks (default ``num_blocks``)
        of ``warps_per_block`` warps (default ``self.warps_per_block``), ``shared_bytes`` of dynamic shared memory."""
        threads = WARP * warps_per_block if warps_per_block else self.threads
        bound, grid = prebound_kernel(kernel, self._launch_device), blocks or self.num_blocks
        return lambda *args: bound(grid, threads, stream, shared_bytes, *args)

    def launcher(self, kernel: Any, blocks: int, threads: int, *, stream: Any) -> Callable[..., None]:
        """``launcher(kernel, blocks, threads, stream=s)(*args)``: launch another module's ``kernel`` on ``s`` as these
        kernels launch theirs (pre-bound on a GPU, no dynamic shared memory)."""
        bound = prebound_kernel(kernel, self._launch_device)
        return lambda *args: bound(blocks, threads, stream, 0, *args)

    def _wide(self, rows: Any) -> bool:
        """:func:`~ep_comm._launcher.device_arrays.wide_rows` of symmetric rows (one array, or a tuple of every rank's),
        decided once per Buffer."""
        return self._fixed("wide", rows, lambda: wide_rows(*rows) if isinstance(rows, tuple) else wide_rows(rows))

    def check_routing(self, topk_idx: Array, into: Optional[Array] = None, *, stream: Any) -> Array:
        """``[2]`` int64 on the device: the largest id in ``topk_idx [T, K]`` (signed ints, T >= 1) or -1,
        and the first token (row) that names an expert twice or -1. With ``into`` (int64 ``[2]``) the
        two are folded into it (the larger of each) and ``into`` is returned."""
        out = self.xp.empty(2, np.int64) if into is None else into
        blocks = min(self.num_blocks, -(-topk_idx.shape[0] // self.threads))
        self._launch(routing_check_kernel, stream, 0, blocks)(topk_idx, self._work.check_acc, self._work.ticket, out,
                                                              into is not None)
        return out

    def count(self, topk_idx: Array, *, stable: bool, stream: Any, block: Optional[Array] = None) -> SendLayout:
        """Count a routing ``topk_idx [T, K]`` (int32/int64, -1 = no expert) on the sender, and check it: ids at or
        above ``num_experts`` count as no expert, and the verdict (largest id, first row naming an expert twice)
        goes into every row of ``count_words``.

        Also resets the atomic slot counters and, with ``stable``, prepares the per-unit cursors that
        :meth:`scatter` consumes next. Returns a :class:`SendLayout` with an unfilled ``slot_idx`` and, in
        ``count_words``, the block the count exchange sends (written by the same launch): views of ``block``
        (int32 ``[send_words(T)]``; None: a new one), which also gets the copy of ``topk_idx`` (:meth:`ids_view`).
        """
        e, r = self.num_experts, self.num_ranks
        num_tokens = topk_idx.shape[0]
        if block is None:
            block = self.xp.empty(self.send_words(num_tokens), np.int32)
        out = self.send_layout(block, num_tokens)
        num_units, units_per_warp = self.token_cut(num_tokens)
        count_warps, warps = -(-num_units // units_per_warp), self.count_warps_per_block
        blocks, work = max(1, min(self.num_blocks, -(-count_warps // warps))), self._work
        self._launch(count_kernel, stream, 4 * (e + r + warps * r), blocks, warps)(
            topk_idx, self.num_local, num_units, units_per_warp, stable, work.counters, work.ticket, work.check_acc,
            work.send_units, work.send_groups, work.rank_cursor, out.num_tokens_per_rank,
            out.num_tokens_per_expert, out.rank_psum, out.expert_psum, out.is_token_in_rank, out.count_words,
            self.ids_view(block, num_tokens, topk_idx.dtype))
        return out

    @staticmethod
    def _row_source(x: Any) -> tuple:
        """``(source, row_words)``: the scatter's row source of payload ``x`` (``ep_comm.kernels.payload``: the
        payload's words, the FP8 pair's bytes and scale bits, or the payload to cast as elements and words) and the
        words of one row it writes."""
        if not isinstance(x, Fp8Rows):
            x_words = payload_words(x)
            return (x_words,), x_words.shape[1]
        row_words = packed_row_bytes(x.hidden) // 8
        if x.cast:
            return (x.tokens.view(np.uint64), *_payload(x.tokens)), row_words
        return (x.tokens.view(np.uint8).view(np.uint64), x.scales.view(np.uint32)), row_words

    def scatter(self, x: Any, topk_idx: Array, topk_weights: Optional[Array], slot_idx: Array,
                rows: Sequence[Array], metas: Sequence[Array], *, src_rank: int, step: Array, mode: int,
                stream: Any, ahead: int = 0, recv_x: Optional[Array] = None, recv_psum: Optional[Array] = None,
                written: Optional[range] = None) -> None:
        """Write each (token, destination) row of ``x [T, H]`` and its meta row into the destinations.

        Args:
            x: ``[T, H]`` float32/float16/bfloat16 payload, or an ``ep_comm.launching.fp8.Fp8Rows``: its packed FP8
                rows (``[T, packed_row_bytes(H) / itemsize]`` as a payload) are written from the pair, or from the
                payload quantized as each row is read, straight into the destinations (no packed copy).
            topk_idx: ``[T, K]`` routing (-1: no expert).
            topk_weights: ``[T, K]`` float32 or None.
            slot_idx: ``[T, K]`` int32, written (``dst_buffer_slot_idx``: ``src_rank * max_tokens + slot``
                on the first entry per rank, else -1), or read with ``mode=SLOT_CACHED``.
            rows, metas: rank r's ``SymmetricViews.rows``/``.meta`` (``[2, R, max_tokens, ...]``, peer
                views on a GPU); row ``slot`` of this source goes to ``[parity, src_rank, slot]``,
                ``parity`` that of step ``step[0] + ahead`` (``ahead=1`` before the step's signal
                advances the counter).
            src_rank: this rank.
            step: the device step counter (int64 ``[1]``).
            mode: ``SLOT_ATOMIC``/``SLOT_STABLE`` (need :meth:`count` just before) or ``SLOT_CACHED``.
            ahead: see ``rows``.
            recv_x: with ``mode=SLOT_CACHED`` only, this rank's compact output ``[N_out, W]`` of the
                dispatch (``W`` columns of ``x``'s payload): the payload of a row for ``src_rank`` itself goes
                straight to ``recv_x[recv_psum[src_rank - 1] + slot]`` (row ``slot`` at rank 0) instead of
                ``rows[src_rank]``, so that :meth:`receive_copy` with ``skip_source=src_rank`` leaves
                it there; its meta row still goes to ``metas[src_rank]``.
            recv_psum: with ``recv_x``, the replayed handle's int32 ``[R]`` inclusive prefix sum of rows
                received per source (on the device).
            written: the destinations whose rows and meta rows are written (a range of ranks; None: every rank):
                a forwarded dispatch writes only its own node's, the other nodes' go through their forwarders
                (every destination's slot is assigned and recorded alike).

        With few tokens (fewer token units than ``scatter_min_units``) or rows cut into pieces, one warp per row or
        piece copies the rows; with ``SLOT_STABLE`` and :meth:`slots_with_rows` those warps take their slots themselves
        (one launch), else the slots are assigned first (not with ``SLOT_CACHED``) in a launch of their own. The
        launches do not depend on whether ``recv_x`` is given (a flag argument of the same kernels).
        """
        direct = recv_x is not None
        if direct != (recv_psum is not None) or (direct and mode != SLOT_CACHED):
            raise ValueError(f"recv_x given: {direct}, recv_psum given: {recv_psum is not None}, mode={mode}: "
                             "recv_x and recv_psum go together, with mode=SLOT_CACHED only (the received layout "
                             "is known before the send only from a handle)")
        if x.shape[0] == 0:
            return
        weights = self._work.no_weights if topk_weights is None else topk_weights.view(np.int32)
        num_units, units_per_warp = self.token_cut(x.shape[0])
        source, row_words = self._row_source(x)
        # without recv_x the kernels get unread stand-ins of the same kinds
        recv_words = payload_words(recv_x) if direct else source[0]
        local = (recv_words, recv_psum if direct else self._work.rank_cursor)
        rows, metas = tuple(rows), tuple(metas)
        reach = (0, self.num_ranks) if written is None else (written.start, written.stop)
        wide = wide_rows(source[0], recv_words) and self._wide(rows)
        span, blocks = self._row_pieces(topk_idx.size, row_words, _copy_step(wide))
        # few tokens (a grid mostly without units) or long rows in pieces: the rows by warps, their slots by unit first
        # or on the way
        by_rows = span < row_words or num_units < self.scatter_min_units
        own_slots = by_rows and mode == SLOT_STABLE and self.slots_with_rows(x.shape[0])
        rows_from, units = (source, row_words, wide), (self._work.send_units, self._work.send_groups)
        if not by_rows or not (mode == SLOT_CACHED or own_slots):
            self._launch(scatter_kernel, stream, blocks=self._blocks_for(num_units, self.num_blocks))(
                *rows_from, topk_idx, weights, topk_weights is not None, self.num_local, src_rank, step, ahead,
                mode, num_units, units_per_warp, self._work.rank_cursor, *units, slot_idx, not by_rows, rows, metas,
                *reach, direct, *local)
        if by_rows:
            self._launch(scatter_rows_kernel, stream, blocks=blocks)(
                *rows_from, topk_idx, weights, topk_weights is not None, self.num_local, src_rank, step, ahead,
                span, own_slots, num_units, units_per_warp, *units, slot_idx, rows, metas, *reach, direct, *local)

    def receive_count(self, src_counts: Array, meta: Array, step: Array, *, alignment: int, expand: bool,
                      stable: bool, stream: Any, block: Optional[Array] = None,
                      record: Optional[Array] = None) -> ReceiveCounts:
        """Count what arrived at the parity of ``step``; nothing (every count 0) when any source's routing
        verdict is bad.

        Args:
            src_counts: ``[2, R, 1 + L + VERDICT_WORDS]`` int64 (``SymmetricViews.counts``): per source its rows,
                then its entries per local expert, then its routing verdict's words.
            meta: ``[2, R, max_tokens, 1 + 2K]`` int32 (``SymmetricViews.meta``), read in expand mode only.
            step: the device step counter (int64 ``[1]``).
            alignment: the expert alignment of the aligned counts and the expert psum.
            expand: expand mode, which also prepares the placement that :meth:`receive_copy` consumes next
                (a scan over the received meta rows, with per-unit cursors when ``stable``); compact mode
                is one single-block launch over the count words alone.
            stable: stable (deterministic) expand placement.
            record: int64 ``[record_words(R, L)]`` (``ep_comm.contract.symmetric``; host-mapped memory on a GPU): gets N,
                M, every source's verdict words and the aligned counts, then ``step[0]`` in its tag word last.
                None: a scratch record of this Kernels.

            block: int32 ``[recv_words]`` the results are views of (None: a new one).

        Returns:
            A :class:`ReceiveCounts` on the device: views of ``block``.
        """
        r, local = self.num_ranks, self.num_local
        record, out = self._receive_outputs(block, record)
        if not expand:
            self._launch(receive_count_words_kernel, stream, 4 * local, 1)(
                src_counts, step, alignment, out.rank_psum, out.num_unaligned_per_expert, out.num_aligned_per_expert,
                out.expert_psum, out.totals, record)
            return out
        worst_units = units_for(meta.shape[1] * meta.shape[2], self.recv_rows_per_unit, self.recv_units)
        warps = self.recv_count_warps_per_block
        blocks, work = min(self.num_blocks, -(-worst_units // warps)), self._work
        self._launch(receive_count_kernel, stream, 4 * (r + 2 * local), blocks, warps)(
            src_counts, meta, step, alignment, stable, self.recv_rows_per_unit, self.recv_units,
            work.counters[:local], work.ticket, work.recv_cursor, out.rank_psum, out.num_unaligned_per_expert,
            out.num_aligned_per_expert, out.expert_psum, work.expert_cursor, out.totals, record)
        return out

    def _receive_outputs(self, block: Optional[Array], record: Optional[Array]) -> tuple[Array, ReceiveCounts]:
        """``(record, counts)``: the record a receive count writes (None: this Kernels' scratch one) and its results,
        views of ``block`` (None: a new one)."""
        record = self._work.record if record is None else record
        return record, self.receive_layout(self.xp.empty(self._recv_words, np.int32) if block is None else block)

    def _copy_shape(self, recv_x: Array, rows: Array, max_rows: int) -> tuple[Array, bool, int, int]:
        """``(recv_x's words, wide, span, blocks)`` of a receive copy of up to ``max_rows`` rows into ``recv_x`` from
        the symmetric ``rows``."""
        recv_words = payload_words(recv_x)
        wide = wide_rows(recv_words) and self._wide(rows)
        return (recv_words, wide) + self._row_pieces(max_rows, recv_words.shape[1], _copy_step(wide))

    @property
    def counted_copy(self) -> bool:
        """Whether a new routing's compact receive into worst-case outputs counts in its copy's launch
        (:meth:`receive_counted`); not with the debug switch ``EP_COMM_KERNEL_LEGACY=count_in_copy``."""
        return not legacy("count_in_copy")

    def receive_counted(self, src_counts: Array, rows: Array, meta: Array, step: Array, recv_x: Array,
                        recv_topk_idx: Array, recv_topk_weights: Array, recv_src_metadata: Array, *, alignment: int,
                        stream: Any, block: Optional[Array] = None, record: Optional[Array] = None) -> ReceiveCounts:
        """A new routing's compact :meth:`receive_count` and :meth:`receive_copy` in one launch: the same results,
        record and outputs (worst-case shapes: ``N`` is not known on the host before), the rows' placement read from
        the count words instead of a ``rank_psum`` written before. The grid is the copy's and, unless
        ``EP_COMM_KERNEL_LEGACY=count_apart``, one block more that counts while the others copy."""
        record, out = self._receive_outputs(block, record)
        recv_words, wide, span, blocks = self._copy_shape(recv_x, rows, recv_src_metadata.shape[0])
        blocks += 0 if legacy("count_apart") else 1
        self._launch(receive_counted_compact_kernel, stream, 4 * (self.num_ranks + self.num_local), blocks)(
            src_counts, step, alignment, out.rank_psum, out.num_unaligned_per_expert, out.num_aligned_per_expert,
            out.expert_psum, out.totals, record, rows, meta, recv_topk_idx, recv_topk_weights.view(np.int32),
            recv_src_metadata, recv_words, wide, span)
        return out

    def receive_copy(self, rank_psum: Array, rows: Array, meta: Array, step: Array, recv_x: Array,
                     recv_topk_idx: Array, recv_topk_weights: Array, recv_src_metadata: Array, *, expand: bool,
                     mode: int, expert_psum: Array, alignment: int, zero_padding: bool,
                     stream: Any, skip_source: int = -1) -> None:
        """Copy received rows out of this rank's buffer at the parity of ``step`` (``rows``/``meta``:
        ``SymmetricViews.rows/meta``, ``[2, R, max_tokens, ...]``).

        Compact: ``recv_x [N_out, H]`` rows grouped by source ascending, ``recv_topk_idx [N_out, K]``
        (any int dtype) local ids or -1, ``recv_topk_weights [N_out, K]`` float32. Expand:
        ``recv_x [M_out, H]`` expert-major, ``recv_topk_idx [M_out]`` local expert or -1 (padding,
        tail), ``recv_topk_weights [M_out]``. ``recv_src_metadata [N_out, 2 + K]`` int32 (read as
        well with ``mode=PLACE_CACHED``: cols 2.. are the recorded expanded rows). ``rank_psum`` and
        ``expert_psum`` come from :meth:`receive_count` or, cached, from the handle. Rows past
        ``N``/``M`` get -1 ids and metadata (``cpu_sync=False`` outputs).

        Compact mode is one launch (``mode`` is ignored: rows keep their arrival order); expand mode
        places the entries first, then a second launch copies the rows. Both copy rows by pieces
        (:meth:`_row_pieces` over ``N_out`` rows). ``skip_source`` (compact only; -1: none): the source
        whose payload rows :meth:`scatter` already wrote into ``recv_x`` (its ``recv_x`` argument); only
        their ids, weights and metadata are written here.
        """
        if expand and skip_source != -1:
            raise ValueError(f"skip_source={skip_source} with expand=True: only a compact receive can leave a "
                             "source's rows to the scatter (-1 in expand mode)")
        max_rows = recv_src_metadata.shape[0]  # N_out >= the N the kernels read on the device
        recv_words, wide, span, blocks = self._copy_shape(recv_x, rows, max_rows)
        weight_bits = recv_topk_weights.view(np.int32)
        if not expand:
            self._launch(receive_compact_kernel, stream, blocks=blocks)(
                rank_psum, rows, meta, step, recv_topk_idx, weight_bits, recv_src_metadata, recv_words, wide, span,
                skip_source)
            return
        rows_per_unit = self.recv_rows_per_unit if mode == PLACE_STABLE else 1
        place_units = units_for(max_rows, rows_per_unit, self.recv_units)
        work = self._work
        self._launch(receive_place_kernel, stream, blocks=self._blocks_for(place_units, self.num_blocks))(
            rank_psum, meta, step, mode, rows_per_unit, self.recv_units, work.expert_cursor, work.recv_cursor,
            expert_psum, alignment, recv_topk_idx.reshape(-1, 1), weight_bits.reshape(-1, 1), recv_src_metadata)
        self._launch(receive_rows_kernel, stream, blocks=blocks)(
            rank_psum, rows, step, zero_padding, expert_psum, alignment, recv_src_metadata, recv_words, wide, span)

    def combine_scatter(self, y: Array, recv_src_metadata: Array, rank_psum: Array, rows: Sequence[Array], *,
                     my_rank: int, step: Array, expand: bool, stream: Any,
                        weights: Optional[Array] = None, ahead: int = 0) -> None:
        """Send expert outputs back: row ``i`` goes to ``rows[src][parity, my_rank, slot]`` of its source
        (``parity`` that of step ``step[0] + ahead``, as in :meth:`scatter`).

        ``y``: compact ``[N, H]`` or expand ``[M, H]`` payload; ``recv_src_metadata [N, 2 + K]`` and
        ``rank_psum [R]`` from the dispatch; ``rows[r]``: rank r's ``SymmetricViews.rows`` (compact)
        or the same bytes viewed as ``[2, R, max_tokens, row_bytes // itemsize]`` payload elements
        (expand, see :func:`~ep_comm.contract.symmetric.payload_rows`). Compact copies only the rows of
        other sources: :meth:`combine_reduce` reads this rank's own from ``y`` (with one rank nothing is
        launched). Expand reduces the row's expanded rows in top-k order, weighted by ``weights [M]``
        float32 when given, this rank's own rows included. Bfloat16 ``y`` goes through
        :func:`~ep_comm.kernels.combine_bf16.combine_expand_bf16_kernel` (16 bytes per access, rows cut into
        pieces when few, :meth:`_row_pieces`) when ``y``'s rows and ``rows`` (as uint64 words, i.e.
        ``SymmetricViews.rows`` itself) are an even number of words and 16-byte aligned (hidden a
        multiple of 8); anything else through the general
        :func:`~ep_comm.kernels.combine.combine_expand_kernel`, one warp per row. Both give the same bits.
        """
        rows = tuple(rows)
        if not expand:
            if self.num_ranks == 1:  # every row is this rank's own: nothing to send (shapes only, as capture needs)
                return
            y_words = payload_words(y)
            wide = wide_rows(y_words) and self._wide(rows)
            span, blocks = self._row_pieces(recv_src_metadata.shape[0], y_words.shape[1], _copy_step(wide))
            self._launch(combine_copy_kernel, stream, blocks=blocks)(
                y_words, wide, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows)
            return
        y_raw, is_bf16 = _payload(y)
        has_weights = weights is not None
        weights = weights if has_weights else self._work.no_bias[0]
        shared = 8 * self.warps_per_block * self.num_topk
        if is_bf16:  # 16 bytes per access when every row array allows it
            y_words = payload_words(y)
            if wide_rows(y_words) and self._wide(rows):
                span, blocks = self._row_pieces(recv_src_metadata.shape[0], y_words.shape[1], BF16_PASSES * 2 * WARP)
                self._launch(combine_expand_bf16_kernel, stream, shared, blocks)(
                    y_words, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows)
                return
        blocks = self._blocks_for(recv_src_metadata.shape[0], self.stream_blocks)  # one warp per row
        self._launch(combine_expand_kernel, stream, shared, blocks)(
            y_raw, is_bf16, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead,
            self._fixed(("payload", y.dtype), rows, lambda: tuple(payload_rows(v, y.dtype) for v in rows)))

    def combine_reduce(self, rows: Array, step: Array, slot_idx: Array, topk_idx: Array, out: Array, *,
                       my_rank: int, stream: Any, bias: Optional[Sequence[Array]] = None, y: Optional[Array] = None,
                       recv_rank_psum: Optional[Array] = None, node_size: int = 0) -> None:
        """Source-side sum into ``out [T, H]``: ``0 + bias terms + partial of each reached rank, ascending``.

        ``rows``: this rank's ``[2, R, max_tokens, ...]`` rows, read at the parity of ``step`` (words or payload
        view); ``slot_idx``/``topk_idx`` ``[T, K]`` from the dispatch; ``bias``: up to two ``[T, H]``
        arrays of any payload dtype. Compact mode gives ``y [N, H]`` (the combine's input, ``out``'s
        dtype) and ``recv_rank_psum`` (int32 ``[R]``, the dispatch's inclusive psum of rows per source):
        this rank's own partials are then read from ``y`` (row ``recv_rank_psum[my_rank - 1] + slot``),
        as :meth:`combine_scatter` did not copy them; expand mode gives neither (they are in ``rows``).
        ``node_size`` (a forwarded combine: ranks per node; 0 = flat): the ranks of another node give one term, at
        the place of its first rank, row ``token`` of its forwarder's region (:meth:`node_reduce` wrote it).
        """
        if (y is None) != (recv_rank_psum is None):
            raise ValueError(f"y is {'None' if y is None else 'given'} but recv_rank_psum is "
                             f"{'None' if recv_rank_psum is None else 'given'}: "
                             "compact mode gives both, expand neither")
        if out.shape[0] == 0:
            return
        out_raw, out_bf16 = _payload(out)
        terms = [_payload(b) for b in (bias or ()) if b is not None]
        shared = 4 * self.warps_per_block * 2 * self.num_topk
        # without y (expand) the kernels get a stand-in of y's array type, never read: a block of rows
        from_y = y is not None
        psum = recv_rank_psum if from_y else self._work.rank_cursor
        node_size = node_size or self.num_ranks
        if out_bf16 and not terms:  # the common case, 16 bytes per access when every row array allows it
            out_words = payload_words(out)
            y_words = payload_words(y) if from_y else self._fixed("first block", rows, lambda: rows[0, 0])
            if wide_rows(out_words, y_words) and self._wide(rows):
                span, blocks = self._row_pieces(out.shape[0], out_words.shape[1], BF16_PASSES * 2 * WARP)
                self._launch(combine_reduce_bf16_kernel, stream, shared, blocks)(
                    rows, step, slot_idx, topk_idx, self.num_local, my_rank, node_size, y_words, from_y, psum,
                    out_words, span)
                return
        padded = terms + [(self._work.no_bias, False)] * (2 - len(terms))
        span, blocks = self._row_pieces(out.shape[0], out.shape[1], SPAN * WARP)
        elements = self._fixed(("payload", out.dtype), rows, lambda: payload_rows(rows, out.dtype))
        y_elements = _payload(y)[0] if from_y else self._fixed("first block", elements, lambda: elements[0, 0])
        self._launch(combine_reduce_kernel, stream, shared, blocks)(
            elements, step, out_bf16, slot_idx, topk_idx, self.num_local, my_rank, node_size, y_elements, from_y, psum,
            *padded[0], *padded[1], len(terms), out_raw, out_bf16, span)

    def inbox_send(self, x: Any, topk_idx: Array, topk_weights: Optional[Array], slot_idx: Array,
                   rows: Sequence[Array], metas: Sequence[Array], headers: Sequence[Array], counts: Sequence[Array],
                   *, src_rank: int, count_words: Optional[Array], step: Array, stream: Any, ahead: int = 1) -> None:
        """A forwarded dispatch's send to the other nodes (``ep_comm.kernels.forward.inbox_send_kernel``): per node
        ``n`` other than this rank's, the block ``node(src_rank) * S`` of its forwarder's inbox: ``rows[n]`` ``[2, R,
        max_tokens, W]`` words (its :class:`~ep_comm.contract.forward_inbox.InboxViews` ``rows``, or a staging view of
        that shape), ``metas[n]`` ``[2, R, max_tokens, relay_words]`` int32 and ``headers[n]`` ``[2, R, 2]`` int64
        (C-contiguous, as the compiled row copies need; this node's entries: any arrays of those kinds, not
        written): row ``t`` = token ``t`` of ``x`` where it goes to a rank of ``n``, a meta row for every token
        (token, global ids, weight bits, its slot in each rank of ``n`` from ``slot_idx``, as :meth:`scatter`
        recorded or replayed them), and the header ``(T, new_routing)``; parity of step ``step[0] + ahead``. ``x``, ``topk_idx``,
        ``topk_weights``: as in :meth:`scatter` (FP8 rows included). ``count_words``: a new routing's send block
        (``SendLayout.count_words``, int32 ``[R, 1 + L + 2]``), whose row ``n * S + j`` goes into block
        ``node(src_rank) * S + j`` of ``counts[n]`` (``[2, R, 1 + L + 2]`` int64, the forwarder's inbox counts) and the
        header's word 1 is 1; None for a replay (nothing written there, word 1 is 0)."""
        weights = self._work.no_weights if topk_weights is None else topk_weights.view(np.int32)
        new_routing = count_words is not None
        if new_routing and tuple(count_words.shape) != (self.num_ranks, counts[0].shape[2]):
            raise ValueError(f"count_words has shape {tuple(count_words.shape)}: must be [R, count words] = "
                             f"{(self.num_ranks, int(counts[0].shape[2]))}, one row per destination rank as the "
                             "inbox counts hold them")
        source, row_words = self._row_source(x)
        rows = tuple(rows)
        wide = wide_rows(source[0]) and self._wide(rows)
        span, blocks = self._row_pieces(len(rows) * x.shape[0], row_words, _copy_step(wide))
        self._launch(inbox_send_kernel, stream, blocks=blocks)(
            source, row_words, wide, topk_idx, weights, topk_weights is not None, slot_idx, self.num_local, src_rank,
            new_routing, count_words if new_routing else self._work.no_weights, step, ahead, span, rows, tuple(metas),
            tuple(headers), tuple(counts))

    def relay(self, inbox: InboxViews, senders: Array, rows: Sequence[Array], metas: Sequence[Array],
              counts: Sequence[Array], *, node_first: int, step: Array, stream: Any, ahead: int = 1,
              row_words: Optional[int] = None) -> None:
        """The forwarder's dispatch relay (``ep_comm.kernels.forward.relay_kernel``): each row of the dispatch inbox
        blocks of ``senders`` (int32 ``[n]`` on the device, the ranks this rank forwards for) into the ranks of this
        node where its meta row names a slot, at ``[parity, sender, slot]`` of ``rows``/``metas`` (every rank's
        ``SymmetricViews.rows``/``.meta``, peer views), and each block's count words into ``counts`` (every rank's
        ``SymmetricViews.counts``) when its header says they were sent. ``inbox``: this rank's
        :func:`~ep_comm.contract.forward_inbox.inbox_views`; ``node_first``: the first rank of this node; the parity
        is that of step ``step[0] + ahead`` (the relay runs before the step's signal advances the counter).
        ``row_words``: the words of a row the senders' inbox send wrote (:meth:`inbox_send`'s row words: fewer than the
        inbox row's for packed FP8 rows, ``packed_row_bytes(hidden) // 8``); None: the inbox row's. Only those are
        copied, as the flat scatter writes only those."""
        rows = tuple(rows)
        words = inbox.rows.shape[3] if row_words is None else row_words
        if not 0 <= words <= inbox.rows.shape[3]:
            raise ValueError(f"row_words={row_words}: must be in [0, {inbox.rows.shape[3]}], the words of an inbox row")
        wide = wide_rows(inbox.rows) and self._wide(rows)
        span, blocks = self._row_pieces(senders.shape[0] * self.max_tokens, words, _copy_step(wide))
        self._launch(relay_kernel, stream, blocks=blocks)(
            inbox.rows, inbox.meta, inbox.header, inbox.counts, senders, node_first, self.num_local, step, ahead,
            span, wide, words, rows, tuple(metas), tuple(counts))

    def combine_meta(self, recv_src_metadata: Array, ids: Array, rank_psum: Array, metas: Sequence[Array],
                     headers: Sequence[Array], *, my_rank: int, node_size: int, step: Array, stream: Any,
                     ahead: int = 1) -> None:
        """A forwarded combine's meta words for the forwarders (``ep_comm.kernels.forward.combine_meta_kernel``): for
        each received row from a source of another node (nodes of ``node_size``), its source token and ``ids``
        (``[N, K]``: compact, the dispatch's ``recv_topk_idx``; expand, ``recv_src_metadata[:, 2:]``: >= 0 where
        this rank owns the entry) into ``metas[src][parity, my_rank, slot]``, and the rows from each such source into
        ``headers[src][parity, my_rank]`` (``[2, R, 2]`` int64 views). ``metas``/``headers``: per source, views of the
        forwarder's inbox in which ``[parity, my_rank]`` is the block (``forward_inbox.combine_send_views``); the
        entries of this node's sources are not written. The rows and weight bits go through :meth:`combine_scatter` and
        ``ep_comm.launching.weight_return.send_weights`` with the same views."""
        blocks = self._thread_blocks(recv_src_metadata.shape[0] * ids.shape[1] + self.num_ranks)
        self._launch(combine_meta_kernel, stream, blocks=blocks)(
            recv_src_metadata, ids, rank_psum, my_rank, node_size, step, ahead, tuple(metas), tuple(headers))

    def node_reduce(self, inbox: InboxViews, sources: Array, rows: Sequence[Array], metas: Sequence[Array], *,
                    my_rank: int, dtype: np.dtype, hidden: int, step: Array, scaleout: Array, stream: Any,
                    ahead: int = 1) -> None:
        """The forwarder's node reduce of a forwarded combine (``ep_comm.kernels.forward.node_reduce_kernel``): for
        each of ``sources`` (int32 ``[n]`` on the device, the ranks this rank forwards for) and each of its tokens
        held by a rank of this node (the combine inbox blocks ``node * S + j``), the float32 sum from 0 of their
        partials (``hidden`` elements) in ascending rank, rounded to ``dtype`` (the payload's), into ``rows[source]`` at
        ``[parity, my_rank, token]`` (every rank's ``SymmetricViews.rows``), and its meta row (token, -1 ids, the
        owners' weight bits) into ``metas[source]``; parity as in :meth:`relay`. The blocks' meta rows are read from
        ``inbox.combine_meta`` (where the combine's send writes them, ``forward_inbox.combine_send_views``).
        ``scaleout``: the backend's int64 ``[2]`` scale-out row counter (``ep_comm.kernels.traffic``), to whose combine
        word the rows written are added (one atomic per warp that wrote any)."""
        rows = tuple(rows)
        elements = self._fixed(("payload", dtype), rows, lambda: tuple(payload_rows(v, dtype) for v in rows))
        inbox_elements, is_bf16 = _payload(payload_rows(inbox.rows, dtype))
        node_size = inbox.meta.shape[3] - inbox.combine_meta.shape[3]  # the slot columns of a dispatch meta row
        blocks = self._blocks_for(sources.shape[0] * node_size * self.max_tokens, self.stream_blocks)
        self._launch(node_reduce_kernel, stream, blocks=blocks)(
            inbox_elements, inbox.combine_meta, inbox.header, is_bf16, hidden, node_size, sources, step, ahead,
            my_rank, elements, tuple(metas), scaleout)

    def dispatch_rows(self, in_rank: Array, scaleout: Array, *, node_size: int, my_rank: int, per_node: bool,
                      stream: Any) -> None:
        """Add a dispatch's scale-out rows to ``scaleout`` (int64 ``[2]``, word ``traffic.DISPATCH_ROWS``;
        ``ep_comm.kernels.traffic.dispatch_rows_kernel``): per token of ``in_rank [T, R]`` bool (the routing's
        ``is_token_in_rank``), the ranks outside ``my_rank``'s node (nodes of ``node_size``) it goes to, or with
        ``per_node`` their distinct nodes."""
        self._launch(dispatch_rows_kernel, stream, 0, self._thread_blocks(in_rank.shape[0]))(
            in_rank, node_size, my_rank, per_node, scaleout)

    def combine_rows(self, rank_psum: Array, scaleout: Array, *, node_size: int, my_rank: int, stream: Any) -> None:
        """Add a flat combine's scale-out rows to ``scaleout`` (int64 ``[2]``, word ``traffic.COMBINE_ROWS``;
        ``ep_comm.kernels.traffic.combine_rows_kernel``): the rows received from the ranks outside ``my_rank``'s node
        (nodes of ``node_size``; ``rank_psum [R]`` int32, the handle's inclusive psum), which it sends back. One warp."""
        self._launch(combine_rows_kernel, stream, 0, 1, 1)(rank_psum, node_size, my_rank, scaleout)
