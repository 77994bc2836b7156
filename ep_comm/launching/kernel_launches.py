"""Host side of the kernels: launch shapes, the persistent workspace, and one method per kernel.

Arrays are NumPy (in the simulator) or CuPy / any ``__cuda_array_interface__`` array (on a GPU);
this module only slices, views and allocates with the array module ``xp`` it was given. Payloads
travel as raw words (:func:`ep_comm.contract.symmetric.payload_words`). The mode constants of the scatter
(``SLOT_*``) and of the receive placement (``PLACE_*``) are the device modules' own, re-exported.

Typical use by a backend, per dispatch on rank ``me`` (``views[r]`` are rank r's symmetric
buffer, see :func:`ep_comm.contract.symmetric.symmetric_views`)::

    k = Kernels(xp, num_ranks=R, num_experts=E, num_topk=K, max_tokens=T_max)
    send = k.count(topk_idx, stable=deterministic)            # + count exchange by the transport
    k.scatter(x, topk_idx, topk_weights, send.slot_idx, [v.rows for v in views],
              [v.meta for v in views], src_rank=me, step=step, ahead=1, mode=SLOT_STABLE)
    recv = k.receive_count(own.counts, own.meta, step, alignment=a, expand=e, stable=d)
    k.receive_copy(recv.rank_psum, own.rows, own.meta, step, recv_x, recv_topk_idx, recv_topk_weights,
                   recv_src_metadata, expand=e, mode=PLACE_STABLE, expert_psum=recv.expert_psum,
                   alignment=a, zero_padding=z)
    # combine (next step): k.combine_scatter(y, recv_src_metadata, recv.rank_psum, [v.rows for v in views],
    #          my_rank=me, step=step, ahead=1, expand=e, weights=w); transport signal;
    #          k.combine_reduce(own.rows, step, ...)

``step`` is the step counter (int64 ``[1]`` on the device, ``ep_comm.kernels.step_counter``): every kernel
reads the buffer parity from it (the senders, which run before the signal that advances it, with
``ahead=1``), so a launch takes the same arguments at every step.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ep_comm.contract.arrays import Array
from ep_comm.contract.fp8 import packed_row_bytes
from ep_comm.contract.protocol import VERDICT_WORDS
from ep_comm.contract.symmetric import payload_rows, payload_words, record_words
from ep_comm.kernels.combine import SPAN, combine_copy_kernel, combine_expand_kernel, combine_reduce_kernel
from ep_comm.kernels.combine_bf16 import BF16_PASSES, combine_expand_bf16_kernel, combine_reduce_bf16_kernel
from ep_comm.kernels.count import count_kernel
from ep_comm.kernels.receive import (
    PLACE_ATOMIC,
    PLACE_CACHED,
    PLACE_STABLE,
    receive_compact_kernel,
    receive_place_kernel,
    receive_rows_kernel,
)
from ep_comm.kernels.receive_count import receive_count_kernel, receive_count_words_kernel
from ep_comm.kernels.routing_check import ACC_INIT, routing_check_kernel
from ep_comm.kernels.scatter import SLOT_ATOMIC, SLOT_CACHED, SLOT_STABLE, scatter_kernel, scatter_rows_kernel
from ep_comm.kernels.units import units_for
from ep_comm.kernels.warp import COPY_UNROLL, WARP
from ep_comm.launching.bound import BoundLaunch
from ep_comm.launching.device_arrays import DeviceViews, wide_rows
from ep_comm.launching.fp8 import Fp8Rows

__all__ = ["Kernels", "SendLayout", "ReceiveCounts", "bound_launch", "SLOT_ATOMIC", "SLOT_STABLE", "SLOT_CACHED",
           "PLACE_ATOMIC", "PLACE_STABLE", "PLACE_CACHED"]

# debugging escape hatch, read once: EP_COMM_NUMBA_LAUNCH=1 launches every kernel through Numba's dispatcher
NUMBA_LAUNCH_ONLY = os.environ.get("EP_COMM_NUMBA_LAUNCH", "0") == "1"


class SendLayout(NamedTuple):
    """What :meth:`Kernels.count` produces (all on the device)."""

    num_tokens_per_rank: Array  # [R] int32, a token counts once per rank
    num_tokens_per_expert: Array  # [E] int32
    rank_psum: Array  # [R] int32, inclusive
    expert_psum: Array  # [E + 1] int32, exclusive with the total appended
    is_token_in_rank: Array  # [T, R] bool
    slot_idx: Array  # [T, K] int32, dst_buffer_slot_idx: filled by :meth:`Kernels.scatter`
    # [R, 1 + L + VERDICT_WORDS] int32: row r is num_tokens_per_rank[r], num_tokens_per_expert[r*L:(r+1)*L], then
    # the routing verdict's words (ep_comm.contract.checks.verdict_words), the same in every row
    count_words: Array


class ReceiveCounts(NamedTuple):
    """What :meth:`Kernels.receive_count` produces (all on the device)."""

    rank_psum: Array  # [R] int32, inclusive prefix sum of rows per source rank
    num_unaligned_per_expert: Array  # [L] int32
    num_aligned_per_expert: Array  # [L] int32
    expert_psum: Array  # [L] int32, ep_comm.contract.layout.expert_psum(counts, alignment, expand)
    totals: Array  # [2] int32: received rows N, expanded rows M (padding included)


_DEVICE_VIEWS = DeviceViews()
_BOUND: dict = {}


def bound_launch(kernel: Any, device: Optional[int]) -> BoundLaunch:
    """The process's one :class:`BoundLaunch` of ``kernel`` on CUDA device ``device`` (None: launches
    through Numba, as in the simulator). Its plans depend only on the kernel, the device (a compiled
    function belongs to one device's context) and the argument kinds, so every ``Kernels`` (every
    Buffer) shares them and binds each kind once."""
    bound = _BOUND.get((kernel, device))
    if bound is None:
        bound = _BOUND[kernel, device] = BoundLaunch(kernel, _DEVICE_VIEWS, enabled=device is not None)
    return bound


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


_CARVE_WORDS = 4  # each array carved from a shared allocation starts on 16 bytes, as vector loads need


def _carved(sizes: Sequence[int]) -> tuple[list, int]:
    """``(slices, words)``: the int32 word slices of consecutive arrays of ``sizes`` words in one allocation
    of ``words`` words, each slice starting on a multiple of ``_CARVE_WORDS``."""
    slices, at = [], 0
    for size in sizes:
        slices.append(slice(at, at + size))
        at += -(-size // _CARVE_WORDS) * _CARVE_WORDS
    return slices, at


_FIXED_MAX = 64  # views and verdicts of long-lived arrays one Kernels keeps (Kernels._fixed)


def _blocks(warps: int, cap: int, warps_per_block: int) -> int:
    """Blocks of ``warps_per_block`` warps for ``warps`` busy warps: at least 1, at most ``cap``."""
    return max(1, min(cap, -(-warps // warps_per_block)))


@functools.lru_cache(maxsize=4096)
def _row_pieces(rows: int, n: int, quantum: int, split_warps: int, warps_per_block: int,
                stream_blocks: int) -> tuple[int, int]:
    """:meth:`Kernels._row_pieces` of a Kernels with ``split_warps``, ``warps_per_block`` and ``stream_blocks``
    (ints in, ints out: remembered, as calls repeat the same few shapes)."""
    passes = max(1, -(-n // quantum))
    span = -(-passes // min(passes, max(1, split_warps // max(rows, 1)))) * quantum
    return span, _blocks(rows * -(-n // span), stream_blocks, warps_per_block)


@functools.lru_cache(maxsize=4096)
def _token_cut(num_tokens: int, num_topk: int, num_units: int, count_tokens_per_warp: int) -> tuple[int, int]:
    """:meth:`Kernels.token_cut` of a Kernels with ``num_topk``, ``num_units`` and ``count_tokens_per_warp``
    (remembered, as :func:`_row_pieces`)."""
    step = WARP // num_topk
    per_unit = -(-max(num_tokens, 1) // num_units)
    per_unit = -(-per_unit // step) * step
    return units_for(num_tokens, per_unit, num_units), max(1, count_tokens_per_warp // per_unit)


INDEX_LIMIT = 2**30


def check_index_range(num_ranks: int, max_tokens: int, num_topk: int) -> None:
    """Raise ValueError unless ``num_ranks * max_tokens * (num_topk + 2)`` is below ``2**30``: that bounds every row
    and entry index of the kernels (the widest arrays: ``R * max_tokens`` rows of ``K + 2`` metadata words), with
    room for a grid stride past the end, since kernel indices are 32-bit (``ep_comm/kernels/index32.py``)."""
    entries = num_ranks * max_tokens * (num_topk + 2)
    if entries >= INDEX_LIMIT:
        raise ValueError(f"num_ranks * num_max_tokens_per_rank * (num_topk + 2) = {num_ranks} * {max_tokens} * "
                         f"({num_topk} + 2) = {entries}: must be below 2**30 on the GPU backend, whose kernels "
                         "index rows and entries in 32 bits")


@dataclass
class Kernels:
    """Launches the dispatch/combine kernels for one geometry; owns a small persistent workspace.

    ``num_blocks`` x ``warps_per_block`` warps run each kernel at most. Tokens are cut into up to
    one unit per warp, each a whole number of warp steps (``32 // K`` tokens), for the scatter
    (count and scatter agree on the cut); the count runs one warp per ``count_tokens_per_warp``
    tokens on as few blocks as that needs. Received rows are cut into units of about
    ``recv_rows_per_unit`` rows, at most ``recv_units`` (default: ``num_blocks``), because the
    stable expand placement scans its per-unit counts once per local expert; the receive count
    runs on blocks of ``recv_count_warps_per_block`` warps (default: ``2 * warps_per_block``),
    whose last block does those scans (one column per warp at a time). The row-streaming
    kernels (compact receive, expand receive rows, combine) need no unit cut and run on
    ``stream_blocks`` blocks (default: ``4 * num_blocks``), enough warps per SM to keep HBM and
    NVLink busy; they cut rows into pieces when rows are few, about ``split_warps`` pieces in all
    (default: ``2 * num_blocks * warps_per_block``), one warp per piece. ``stream`` is a Numba
    stream (or 0). On a GPU every kernel is launched pre-bound (:mod:`ep_comm.launching.bound`);
    ``EP_COMM_NUMBA_LAUNCH=1`` launches through Numba's dispatcher instead.
    """

    xp: Any
    num_ranks: int
    num_experts: int
    num_topk: int
    max_tokens: int
    num_blocks: int = 264
    warps_per_block: int = 8
    recv_units: int = 0
    stream: Any = 0
    stream_blocks: int = 0
    count_tokens_per_warp: int = 16
    recv_rows_per_unit: int = 32
    recv_count_warps_per_block: int = 0
    split_warps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_topk <= WARP:
            raise ValueError(f"num_topk={self.num_topk}: the kernels handle 1..{WARP} entries per token")
        if self.warps_per_block < 2:
            raise ValueError("warps_per_block must be at least 2")
        check_index_range(self.num_ranks, self.max_tokens, self.num_topk)
        xp, r, e = self.xp, self.num_ranks, self.num_experts
        self.num_units = self.num_blocks * self.warps_per_block
        self.recv_units = self.recv_units or self.num_blocks
        self.recv_count_warps_per_block = self.recv_count_warps_per_block or 2 * self.warps_per_block
        self.stream_blocks = self.stream_blocks or 4 * self.num_blocks
        self.split_warps = self.split_warps or 2 * self.num_units
        self.threads = self.warps_per_block * WARP
        # the CUDA device whose pre-bound launches this Kernels uses (None: Numba's own launch path)
        prebound = xp is not np and not NUMBA_LAUNCH_ONLY
        self._launch_device = xp.cuda.runtime.getDevice() if prebound else None
        self._counters = xp.zeros(max(e + r, self.num_local), dtype=np.int64)
        self._ticket = xp.zeros(1, dtype=np.uint32)
        self._check_acc = xp.asarray(np.array(ACC_INIT, dtype=np.int64))  # check_routing's and count's (one stream)
        self._record = xp.zeros(record_words(r, self.num_local), dtype=np.int64)  # receive_count's, when not given
        self._rank_cursor = xp.zeros(r, dtype=np.int32)
        self._expert_cursor = xp.zeros(self.num_local, dtype=np.int32)
        self._send_units = xp.zeros((self.num_units, r), dtype=np.int32)
        self._send_groups = xp.zeros((self.num_units, r), dtype=np.int32)
        self._recv_cursor = xp.zeros((self.recv_units, self.num_local), dtype=np.int32)
        self._no_weights = xp.zeros((1, self.num_topk), dtype=np.int32)
        self._no_bias = xp.zeros((1, 1), dtype=np.float32)
        self._fixed_views: dict = {}  # _fixed: (what, id(base)) -> (base, view or verdict)
        # the int32 arrays one count (SendLayout, slot_idx after them) and one receive_count (ReceiveCounts)
        # return: views of one fresh allocation per call (they are returned together, and kept together)
        local = self.num_local
        self._send_slices, self._send_words = _carved((r * self.count_width, r, e, r, e + 1))
        self._recv_slices, self._recv_words = _carved((2, r, local, local, local))

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def prebound(self) -> bool:
        """Whether kernels launch pre-bound (a GPU, not ``EP_COMM_NUMBA_LAUNCH=1``): then launch plans can be made."""
        return self._launch_device is not None

    @property
    def count_width(self) -> int:
        """int32 count words per destination: rows, one per local expert, the verdict's ``VERDICT_WORDS``."""
        return 1 + self.num_local + VERDICT_WORDS

    def _launch(self, kernel, shared_bytes: int = 0, blocks: int = 0, warps_per_block: int = 0):
        threads = WARP * warps_per_block if warps_per_block else self.threads
        bound = bound_launch(kernel, self._launch_device)
        grid, stream = blocks or self.num_blocks, self.stream
        return lambda *args: bound(grid, threads, stream, shared_bytes, *args)

    def launcher(self, kernel: Any, blocks: int, threads: int) -> Callable[..., None]:
        """``launcher(kernel, blocks, threads)(*args)``: launch another module's ``kernel`` as these kernels launch
        theirs (pre-bound on a GPU, on :attr:`stream`, no dynamic shared memory)."""
        bound, stream = bound_launch(kernel, self._launch_device), self.stream
        return lambda *args: bound(blocks, threads, stream, 0, *args)

    def _blocks_for(self, warps: int, cap: int) -> int:
        """Blocks for ``warps`` busy warps (one per unit, row or token), at most ``cap``: a grid-stride
        kernel needs no more, and idle blocks cost launch time that small (decode) calls feel."""
        return _blocks(warps, cap, self.warps_per_block)

    def _row_pieces(self, rows: int, n: int, quantum: int) -> tuple[int, int]:
        """``(span, blocks)`` of a row-streaming kernel over ``rows`` rows of ``n`` indices (elements or
        words) cut into pieces of ``span``, a whole number of ``quantum`` (one warp pass): about
        ``split_warps`` pieces in all, so that few rows (decode) still keep thousands of warps busy, and
        whole rows once there are that many. Depends on shapes only, as graph capture needs."""
        return _row_pieces(rows, n, quantum, self.split_warps, self.warps_per_block, self.stream_blocks)

    def token_cut(self, num_tokens: int) -> tuple[int, int]:
        """``(num_units, units_per_warp)``: the scatter's unit cut of ``num_tokens`` tokens, and how many
        consecutive units one count warp walks."""
        return _token_cut(num_tokens, self.num_topk, self.num_units, self.count_tokens_per_warp)

    def _fixed(self, what: Any, base: Any, make: Callable[[], Any]) -> Any:
        """``make()`` for a long-lived ``base`` (a symmetric buffer's rows, or the tuple of every rank's: the
        same objects at every call of a Buffer), made once per (``what``, ``base``) and kept with ``base``.
        At most ``_FIXED_MAX`` are kept (callers that pass new objects each time only refill the table)."""
        key = (what, id(base))
        held = self._fixed_views.get(key)
        if held is None or held[0] is not base:
            if len(self._fixed_views) >= _FIXED_MAX:
                self._fixed_views.clear()
            held = self._fixed_views[key] = (base, make())
        return held[1]

    def _wide(self, rows: Any) -> bool:
        """:func:`~ep_comm.launching.device_arrays.wide_rows` of symmetric rows (one array, or a tuple of every rank's),
        decided once per Buffer."""
        return self._fixed("wide", rows, lambda: wide_rows(*rows) if isinstance(rows, tuple) else wide_rows(rows))

    def check_routing(self, topk_idx: Array, into: Optional[Array] = None) -> Array:
        """``[2]`` int64 on the device: the largest id in ``topk_idx [T, K]`` (signed ints, T >= 1) or -1,
        and the first token (row) that names an expert twice or -1. With ``into`` (int64 ``[2]``) the
        two are folded into it (the larger of each) and ``into`` is returned."""
        out = self.xp.empty(2, np.int64) if into is None else into
        blocks = min(self.num_blocks, -(-topk_idx.shape[0] // self.threads))
        self._launch(routing_check_kernel, 0, blocks)(topk_idx, self._check_acc, self._ticket, out, into is not None)
        return out

    def send_words(self, num_tokens: int) -> int:
        """int32 words of the block one :meth:`count` of ``num_tokens`` tokens writes (:meth:`send_layout`)."""
        return self._ids_at(num_tokens) + 2 * num_tokens * self.num_topk

    def _ids_at(self, num_tokens: int) -> int:
        """The first word of the ids' copy in a count block: after ``is_token_in_rank``, on 16 bytes."""
        bool_words = -(-num_tokens * self.num_ranks // 4)
        return self._in_rank_at(num_tokens) + -(-bool_words // _CARVE_WORDS) * _CARVE_WORDS

    def _in_rank_at(self, num_tokens: int) -> int:
        """The first word of ``is_token_in_rank`` in a count block: after ``slot_idx``, on 16 bytes."""
        return self._send_words + -(-num_tokens * self.num_topk // _CARVE_WORDS) * _CARVE_WORDS

    def send_layout(self, block: Array, num_tokens: int) -> SendLayout:
        """The :class:`SendLayout` arrays of a count of ``num_tokens`` tokens: views of ``block``, int32
        ``[send_words(num_tokens)]`` (``is_token_in_rank`` as bool bytes of its last words)."""
        _, per_rank, per_expert, rank_psum, expert_psum = map(block.__getitem__, self._send_slices)
        in_rank, slot_idx = self.routing_views(block, num_tokens)
        return SendLayout(per_rank, per_expert, rank_psum, expert_psum, in_rank, slot_idx, self.count_words_view(block))

    def count_words_view(self, block: Array) -> Array:
        """``count_words [R, count_width]`` of a count ``block`` (the first of its views, :meth:`send_layout`)."""
        return block[self._send_slices[0]].reshape(self.num_ranks, self.count_width)

    def routing_views(self, block: Array, num_tokens: int) -> tuple[Array, Array]:
        """``(is_token_in_rank [T, R] bool, slot_idx [T, K] int32)``, the handle's views of a count ``block``."""
        words, k, r = self._send_words, self.num_topk, self.num_ranks
        in_rank = block[self._in_rank_at(num_tokens):].view(np.bool_)[: num_tokens * r].reshape(num_tokens, r)
        return in_rank, block[words:words + num_tokens * k].reshape(num_tokens, k)

    def ids_view(self, block: Array, num_tokens: int, dtype: Any) -> Array:
        """``[T, K]`` of ``dtype`` (an integer type of at most 8 bytes): the copy of the ids a count writes into its
        ``block``."""
        first, entries = self._ids_at(num_tokens), num_tokens * self.num_topk
        ids = block[first:first + 2 * entries].view(np.uint8)[:entries * np.dtype(dtype).itemsize]
        return ids.view(dtype).reshape(num_tokens, self.num_topk)

    def count(self, topk_idx: Array, *, stable: bool, block: Optional[Array] = None) -> SendLayout:
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
        count_warps = -(-num_units // units_per_warp)
        blocks = self._blocks_for(count_warps, self.num_blocks)
        self._launch(count_kernel, 4 * (e + r + self.warps_per_block * r), blocks)(
            topk_idx, self.num_local, num_units, units_per_warp, stable, self._counters, self._ticket, self._check_acc,
            self._send_units, self._send_groups, self._rank_cursor, out.num_tokens_per_rank,
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
                ahead: int = 0, recv_x: Optional[Array] = None, recv_psum: Optional[Array] = None) -> None:
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

        When rows are cut into pieces (few tokens), the slots are assigned first (not with
        ``SLOT_CACHED``) and a second launch copies the rows, one warp per piece. The launches do not
        depend on whether ``recv_x`` is given (a flag argument of the same kernels).
        """
        direct = recv_x is not None
        if direct != (recv_psum is not None) or (direct and mode != SLOT_CACHED):
            raise ValueError(f"recv_x given: {direct}, recv_psum given: {recv_psum is not None}, mode={mode}: "
                             "recv_x and recv_psum go together, with mode=SLOT_CACHED only (the received layout "
                             "is known before the send only from a handle)")
        if x.shape[0] == 0:
            return
        weights = self._no_weights if topk_weights is None else topk_weights.view(np.int32)
        num_units, units_per_warp = self.token_cut(x.shape[0])
        source, row_words = self._row_source(x)
        # without recv_x the kernels get unread stand-ins of the same kinds
        recv_words = payload_words(recv_x) if direct else source[0]
        local = (recv_words, recv_psum if direct else self._rank_cursor)
        rows, metas = tuple(rows), tuple(metas)
        wide = wide_rows(source[0], recv_words) and self._wide(rows)
        span, blocks = self._row_pieces(topk_idx.size, row_words, _copy_step(wide))
        pieces = span < row_words  # few tokens: slots by unit first, then the rows by pieces
        rows_from = (source, row_words, wide)
        if mode != SLOT_CACHED or not pieces:
            self._launch(scatter_kernel, blocks=self._blocks_for(num_units, self.num_blocks))(
                *rows_from, topk_idx, weights, topk_weights is not None, self.num_local, src_rank, step, ahead,
                mode, num_units, units_per_warp, self._rank_cursor, self._send_units, self._send_groups, slot_idx,
                not pieces, rows, metas, direct, *local)
        if pieces:
            self._launch(scatter_rows_kernel, blocks=blocks)(
                *rows_from, topk_idx, weights, topk_weights is not None, self.num_local, src_rank, step, ahead,
                span, slot_idx, rows, metas, direct, *local)

    @property
    def recv_words(self) -> int:
        """int32 words of the block one :meth:`receive_count` writes (:meth:`receive_layout`)."""
        return self._recv_words

    def receive_layout(self, block: Array) -> ReceiveCounts:
        """The :class:`ReceiveCounts` arrays: views of ``block``, int32 ``[recv_words]``."""
        totals, rank_psum, unaligned, aligned, expert_psum = map(block.__getitem__, self._recv_slices)
        return ReceiveCounts(rank_psum, unaligned, aligned, expert_psum, totals)

    def receive_count(self, src_counts: Array, meta: Array, step: Array, *, alignment: int, expand: bool,
                      stable: bool, block: Optional[Array] = None, record: Optional[Array] = None) -> ReceiveCounts:
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
        record = self._record if record is None else record
        out = self.receive_layout(self.xp.empty(self._recv_words, np.int32) if block is None else block)
        if not expand:
            self._launch(receive_count_words_kernel, 4 * local, 1)(
                src_counts, step, alignment, out.rank_psum, out.num_unaligned_per_expert, out.num_aligned_per_expert,
                out.expert_psum, out.totals, record)
            return out
        worst_units = units_for(meta.shape[1] * meta.shape[2], self.recv_rows_per_unit, self.recv_units)
        warps = self.recv_count_warps_per_block
        blocks = min(self.num_blocks, -(-worst_units // warps))
        self._launch(receive_count_kernel, 4 * (r + 2 * local), blocks, warps)(
            src_counts, meta, step, alignment, stable, self.recv_rows_per_unit, self.recv_units,
            self._counters[:local], self._ticket, self._recv_cursor, out.rank_psum, out.num_unaligned_per_expert,
            out.num_aligned_per_expert, out.expert_psum, self._expert_cursor, out.totals, record)
        return out

    def receive_copy(self, rank_psum: Array, rows: Array, meta: Array, step: Array, recv_x: Array,
                     recv_topk_idx: Array, recv_topk_weights: Array, recv_src_metadata: Array, *, expand: bool,
                     mode: int, expert_psum: Array, alignment: int, zero_padding: bool,
                     skip_source: int = -1) -> None:
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
        recv_words = payload_words(recv_x)
        wide = wide_rows(recv_words) and self._wide(rows)
        max_rows = recv_src_metadata.shape[0]  # N_out >= the N the kernels read on the device
        span, blocks = self._row_pieces(max_rows, recv_words.shape[1], _copy_step(wide))
        weight_bits = recv_topk_weights.view(np.int32)
        if not expand:
            self._launch(receive_compact_kernel, blocks=blocks)(
                rank_psum, rows, meta, step, recv_topk_idx, weight_bits, recv_src_metadata, recv_words, wide, span,
                skip_source)
            return
        rows_per_unit = self.recv_rows_per_unit if mode == PLACE_STABLE else 1
        place_units = units_for(max_rows, rows_per_unit, self.recv_units)
        self._launch(receive_place_kernel, blocks=self._blocks_for(place_units, self.num_blocks))(
            rank_psum, meta, step, mode, rows_per_unit, self.recv_units, self._expert_cursor, self._recv_cursor,
            expert_psum, alignment, recv_topk_idx.reshape(-1, 1), weight_bits.reshape(-1, 1), recv_src_metadata)
        self._launch(receive_rows_kernel, blocks=blocks)(
            rank_psum, rows, step, zero_padding, expert_psum, alignment, recv_src_metadata, recv_words, wide, span)

    def combine_scatter(self, y: Array, recv_src_metadata: Array, rank_psum: Array, rows: Sequence[Array], *,
                     my_rank: int, step: Array, expand: bool, weights: Optional[Array] = None,
                     ahead: int = 0) -> None:
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
            self._launch(combine_copy_kernel, blocks=blocks)(
                y_words, wide, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows)
            return
        y_raw, is_bf16 = _payload(y)
        has_weights = weights is not None
        weights = weights if has_weights else self._no_bias[0]
        shared = 8 * self.warps_per_block * self.num_topk
        if is_bf16:  # 16 bytes per access when every row array allows it
            y_words = payload_words(y)
            if wide_rows(y_words) and self._wide(rows):
                span, blocks = self._row_pieces(recv_src_metadata.shape[0], y_words.shape[1], BF16_PASSES * 2 * WARP)
                self._launch(combine_expand_bf16_kernel, shared, blocks)(
                    y_words, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead, span, rows)
                return
        blocks = self._blocks_for(recv_src_metadata.shape[0], self.stream_blocks)  # one warp per row
        self._launch(combine_expand_kernel, shared, blocks)(
            y_raw, is_bf16, weights, has_weights, recv_src_metadata, rank_psum, my_rank, step, ahead,
            self._fixed(("payload", y.dtype), rows, lambda: tuple(payload_rows(v, y.dtype) for v in rows)))

    def combine_reduce(self, rows: Array, step: Array, slot_idx: Array, topk_idx: Array, out: Array, *,
                       my_rank: int, bias: Optional[Sequence[Array]] = None, y: Optional[Array] = None,
                       recv_rank_psum: Optional[Array] = None) -> None:
        """Source-side sum into ``out [T, H]``: ``0 + bias terms + partial of each reached rank, ascending``.

        ``rows``: this rank's ``[2, R, max_tokens, ...]`` rows, read at the parity of ``step`` (words or payload
        view); ``slot_idx``/``topk_idx`` ``[T, K]`` from the dispatch; ``bias``: up to two ``[T, H]``
        arrays of any payload dtype. Compact mode gives ``y [N, H]`` (the combine's input, ``out``'s
        dtype) and ``recv_rank_psum`` (int32 ``[R]``, the dispatch's inclusive psum of rows per source):
        this rank's own partials are then read from ``y`` (row ``recv_rank_psum[my_rank - 1] + slot``),
        as :meth:`combine_scatter` did not copy them; expand mode gives neither (they are in ``rows``).
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
        psum = recv_rank_psum if from_y else self._rank_cursor
        if out_bf16 and not terms:  # the common case, 16 bytes per access when every row array allows it
            out_words = payload_words(out)
            y_words = payload_words(y) if from_y else self._fixed("first block", rows, lambda: rows[0, 0])
            if wide_rows(out_words, y_words) and self._wide(rows):
                span, blocks = self._row_pieces(out.shape[0], out_words.shape[1], BF16_PASSES * 2 * WARP)
                self._launch(combine_reduce_bf16_kernel, shared, blocks)(
                    rows, step, slot_idx, topk_idx, self.num_local, my_rank, y_words, from_y, psum, out_words, span)
                return
        padded = terms + [(self._no_bias, False)] * (2 - len(terms))
        span, blocks = self._row_pieces(out.shape[0], out.shape[1], SPAN * WARP)
        elements = self._fixed(("payload", out.dtype), rows, lambda: payload_rows(rows, out.dtype))
        y_elements = _payload(y)[0] if from_y else self._fixed("first block", elements, lambda: elements[0, 0])
        self._launch(combine_reduce_kernel, shared, blocks)(
            elements, step, out_bf16, slot_idx, topk_idx, self.num_local, my_rank, y_elements, from_y, psum,
            *padded[0], *padded[1], len(terms), out_raw, out_bf16, span)
