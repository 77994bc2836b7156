"""The launch shapes and the result blocks of the kernels' host side.

:class:`LaunchShapes`, the base of :class:`~ep_comm.launching.kernel_launches.Kernels`, holds one geometry and
how work is cut for it (units of tokens, pieces of rows, blocks: shapes only, as graph capture needs; no arrays),
and lays out the int32 blocks that one count and one receive count write (:class:`SendLayout`,
:class:`ReceiveCounts`: views of one allocation each). :class:`Workspace` is the persistent workspace the kernels
share, allocated by its factory ``Workspace.allocate``; :class:`KeptViews` what they make once per long-lived
array. :func:`launch_device` is the device of the kernels' pre-bound launches
(:func:`ep_comm._launcher.prebound.prebound_kernel`); :func:`check_index_range` is the bound that keeps every kernel
index within 32 bits.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ep_comm.contract.arrays import Array
from ep_comm.contract.protocol import VERDICT_WORDS
from ep_comm.contract.symmetric import record_words
from ep_comm.kernels.routing_check import ACC_INIT
from ep_comm.kernels.switches import legacy
from ep_comm.kernels.units import units_for
from ep_comm.kernels.warp import WARP

__all__ = ["LaunchShapes", "Workspace", "KeptViews", "SendLayout", "ReceiveCounts", "launch_device",
           "check_index_range", "INDEX_LIMIT"]


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


class Workspace(NamedTuple):
    """The small persistent arrays one :class:`~ep_comm.launching.kernel_launches.Kernels` shares between its
    launches (on the device; R ranks, E experts, L local experts, U units, K entries per token)."""

    counters: Array  # int64 [max(E + R, L)]: the count's per-rank/expert counters, the receive count's per expert
    ticket: Array  # uint32 [1]: the last block's ticket
    check_acc: Array  # int64 [2]: the routing check's accumulator (check_routing's and count's, one stream)
    record: Array  # int64 [record_words(R, L)]: receive_count's record when none is given
    rank_cursor: Array  # int32 [R]
    expert_cursor: Array  # int32 [L]
    send_units: Array  # int32 [U, R]
    send_groups: Array  # int32 [U, R]
    recv_cursor: Array  # int32 [recv_units, L]
    no_weights: Array  # int32 [1, K]: the weights' stand-in when none are given
    no_bias: Array  # float32 [1, 1]: the bias terms' and weights' stand-in

    @classmethod
    def allocate(cls, xp: Any, shapes: "LaunchShapes") -> "Workspace":
        """A zeroed workspace for ``shapes``, allocated with array module ``xp`` (the check accumulator at
        ``ACC_INIT``)."""
        r, local, units = shapes.num_ranks, shapes.num_local, shapes.num_units
        return cls(xp.zeros(max(shapes.num_experts + r, local), dtype=np.int64), xp.zeros(1, dtype=np.uint32),
                   xp.asarray(np.array(ACC_INIT, dtype=np.int64)), xp.zeros(record_words(r, local), dtype=np.int64),
                   xp.zeros(r, dtype=np.int32), xp.zeros(local, dtype=np.int32), xp.zeros((units, r), dtype=np.int32),
                   xp.zeros((units, r), dtype=np.int32), xp.zeros((shapes.recv_units, local), dtype=np.int32),
                   xp.zeros((1, shapes.num_topk), dtype=np.int32), xp.zeros((1, 1), dtype=np.float32))


_KEPT_MAX = 64  # views and verdicts of long-lived arrays one KeptViews keeps


class KeptViews:
    """Things made once for long-lived arrays: a symmetric buffer's rows, or the tuple of every rank's (the same
    objects at every call of a Buffer)."""

    def __init__(self) -> None:
        self._kept: dict = {}  # (what, id(base)) -> (base, view or verdict)

    def get(self, what: Any, base: Any, make: Callable[[], Any]) -> Any:
        """``make()`` for ``base``, made once per (``what``, ``base``) and kept with ``base``. At most ``_KEPT_MAX``
        are kept (callers that pass new objects each time only refill the table)."""
        key = (what, id(base))
        held = self._kept.get(key)
        if held is None or held[0] is not base:
            if len(self._kept) >= _KEPT_MAX:
                self._kept.clear()
            held = self._kept[key] = (base, make())
        return held[1]


# debug knob for measurements, read once: EP_COMM_COUNT_MIN_WARPS=N overrides every LaunchShapes' count_min_warps
# (e.g. 1024: one unit per count warp at prefill too, 128 blocks at T=4096 on 132 SMs)
_COUNT_MIN_WARPS = int(os.environ.get("EP_COMM_COUNT_MIN_WARPS", "0") or 0)
# and EP_COMM_COUNT_BLOCK_WARPS=N every LaunchShapes' count_warps_per_block (e.g. 16 with EP_COMM_COUNT_MIN_WARPS=16:
# the decode count on one block of 16 warps, two warp steps each, no cross-block combine)
_COUNT_BLOCK_WARPS = int(os.environ.get("EP_COMM_COUNT_BLOCK_WARPS", "0") or 0)

# debugging escape hatch, read once: EP_COMM_NUMBA_LAUNCH=1 launches every kernel through Numba's dispatcher
NUMBA_LAUNCH_ONLY = os.environ.get("EP_COMM_NUMBA_LAUNCH", "0") == "1"


def launch_device(xp: Any) -> Optional[int]:
    """The CUDA device whose pre-bound launches (:func:`ep_comm._launcher.prebound.prebound_kernel`) the kernels of
    array module ``xp`` use: CuPy's current one, or None (NumPy, the simulator, or ``EP_COMM_NUMBA_LAUNCH=1``: Numba's own launch path)."""
    return xp.cuda.runtime.getDevice() if xp is not np and not NUMBA_LAUNCH_ONLY else None


_CARVE_WORDS = 4  # each array carved from a shared allocation starts on 16 bytes, as vector loads need


def _carve_slices(sizes: Sequence[int]) -> tuple[list, int]:
    """``(slices, words)``: the int32 word slices of consecutive arrays of ``sizes`` words in one allocation
    of ``words`` words, each slice starting on a multiple of ``_CARVE_WORDS``."""
    slices, at = [], 0
    for size in sizes:
        slices.append(slice(at, at + size))
        at += -(-size // _CARVE_WORDS) * _CARVE_WORDS
    return slices, at


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
def _token_cut(num_tokens: int, num_topk: int, num_units: int, count_tokens_per_warp: int,
               count_min_warps: int) -> tuple[int, int]:
    """:meth:`Kernels.token_cut` of a Kernels with ``num_topk``, ``num_units``, ``count_tokens_per_warp`` and
    ``count_min_warps`` (remembered, as :func:`_row_pieces`)."""
    step = WARP // num_topk
    per_unit = -(-max(num_tokens, 1) // num_units)
    per_unit = -(-per_unit // step) * step
    units = units_for(num_tokens, per_unit, num_units)
    units_per_warp = max(1, count_tokens_per_warp // per_unit)
    if count_min_warps > 0:  # few tokens (decode): fewer units per count warp, down to one
        units_per_warp = max(1, min(units_per_warp, units // count_min_warps))
    return units, units_per_warp


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


class LaunchShapes:
    """The base of :class:`~ep_comm.launching.kernel_launches.Kernels`: its launch shapes for one geometry (shapes
    only, no arrays: :class:`~ep_comm.launching.kernel_launches.Kernels` allocates its workspace), and the views of
    the blocks its count and receive count write.

    ``num_blocks`` x ``warps_per_block`` warps run each kernel at most. Tokens are cut into up to
    one unit per warp, each a whole number of warp steps (``32 // K`` tokens), for the scatter
    (count and scatter agree on the cut); the count runs one warp per ``count_tokens_per_warp``
    tokens on as few blocks as that needs, but at least ``count_min_warps`` warps while there are that many
    units (default 64: at decode one warp per unit, each a single warp step; 0 or the debug switch
    ``EP_COMM_KERNEL_LEGACY=count_cut``: ``count_tokens_per_warp`` alone; ``EP_COMM_COUNT_MIN_WARPS=N``, a
    debug knob, overrides it everywhere), in blocks of ``count_warps_per_block`` warps (default:
    ``warps_per_block``; at most 16, ``EP_COMM_COUNT_BLOCK_WARPS`` overrides it). Received rows are cut into units of about
    ``recv_rows_per_unit`` rows, at most ``recv_units`` (default: ``num_blocks``), because the
    stable expand placement scans its per-unit counts once per local expert; the receive count
    runs on blocks of ``recv_count_warps_per_block`` warps (default: ``2 * warps_per_block``),
    whose last block does those scans (one column per warp at a time). The row-streaming
    kernels (compact receive, expand receive rows, combine) need no unit cut and run on
    ``stream_blocks`` blocks (default: ``4 * num_blocks``), enough warps per SM to keep HBM and
    NVLink busy; they cut rows into pieces when rows are few, about ``split_warps`` pieces in all
    (default: ``2 * num_blocks * warps_per_block``), one warp per piece. The scatter copies rows in its unit
    kernel only when the token cut gives at least ``scatter_min_units`` units (default: a quarter of ``num_blocks *
    warps_per_block``); with fewer tokens its units only assign slots and the rows kernel copies the rows, one warp
    per row or piece (at decode on a few SMs, e.g. 128 tokens on 24 SMs, the unit kernel would copy every row on 32
    warps; at prefill the unit kernel, a quarter of the grid or more, is the faster). ValueError for a ``num_topk`` the
    kernels cannot handle, fewer than 2 warps per block, or indices past 32 bits (:func:`check_index_range`).
    """

    def __init__(self, *, num_ranks: int, num_experts: int, num_topk: int, max_tokens: int, num_blocks: int = 264,
                 warps_per_block: int = 8, recv_units: int = 0, stream_blocks: int = 0,
                 count_tokens_per_warp: int = 16, recv_rows_per_unit: int = 32, recv_count_warps_per_block: int = 0,
                 split_warps: int = 0, count_min_warps: int = 64, count_warps_per_block: int = 0,
                 scatter_min_units: int = 0):
        if not 1 <= num_topk <= WARP:
            raise ValueError(f"num_topk={num_topk}: the kernels handle 1..{WARP} entries per token")
        if warps_per_block < 2:
            raise ValueError("warps_per_block must be at least 2")
        check_index_range(num_ranks, max_tokens, num_topk)
        self.num_ranks, self.num_experts, self.num_topk, self.max_tokens = num_ranks, num_experts, num_topk, max_tokens
        self.num_blocks, self.warps_per_block = num_blocks, warps_per_block
        self.count_tokens_per_warp, self.recv_rows_per_unit = count_tokens_per_warp, recv_rows_per_unit
        self.count_min_warps = 0 if legacy("count_cut") else _COUNT_MIN_WARPS or count_min_warps
        self.count_warps_per_block = _COUNT_BLOCK_WARPS or count_warps_per_block or warps_per_block
        if not 1 <= self.count_warps_per_block <= 16:  # the count uses up to 92 registers: 512 threads fit an SM
            raise ValueError(f"count_warps_per_block={self.count_warps_per_block}: must be 1..16")
        self.num_units = num_blocks * warps_per_block
        self.recv_units = recv_units or num_blocks
        self.recv_count_warps_per_block = recv_count_warps_per_block or 2 * warps_per_block
        self.stream_blocks = stream_blocks or 4 * num_blocks
        self.split_warps = split_warps or 2 * self.num_units
        self.scatter_min_units = scatter_min_units or max(1, self.num_units // 4)
        self.threads = warps_per_block * WARP
        self.num_local = num_experts // num_ranks
        # the int32 arrays one count (SendLayout, slot_idx after them) and one receive_count (ReceiveCounts)
        # return: views of one fresh allocation per call (they are returned together, and kept together)
        r, e, local = num_ranks, num_experts, self.num_local
        self._send_slices, self._send_words = _carve_slices((r * self.count_width, r, e, r, e + 1))
        self._recv_slices, self._recv_words = _carve_slices((2, r, local, local, local))

    @property
    def count_width(self) -> int:
        """int32 count words per destination: rows, one per local expert, the verdict's ``VERDICT_WORDS``."""
        return 1 + self.num_local + VERDICT_WORDS

    def _blocks_for(self, warps: int, cap: int) -> int:
        """Blocks for ``warps`` busy warps (one per unit, row or token), at most ``cap``: a grid-stride
        kernel needs no more, and idle blocks cost launch time that small (decode) calls feel."""
        return _blocks(warps, cap, self.warps_per_block)

    def _thread_blocks(self, items: int) -> int:
        """Blocks of ``threads`` threads for ``items`` busy threads (one per item), at least 1, at most
        ``num_blocks``."""
        return max(1, min(self.num_blocks, -(-items // self.threads)))

    def _row_pieces(self, rows: int, n: int, quantum: int) -> tuple[int, int]:
        """``(span, blocks)`` of a row-streaming kernel over ``rows`` rows of ``n`` indices (elements or
        words) cut into pieces of ``span``, a whole number of ``quantum`` (one warp pass): about
        ``split_warps`` pieces in all, so that few rows (decode) still keep thousands of warps busy, and
        whole rows once there are that many. Depends on shapes only, as graph capture needs."""
        return _row_pieces(rows, n, quantum, self.split_warps, self.warps_per_block, self.stream_blocks)

    def token_cut(self, num_tokens: int) -> tuple[int, int]:
        """``(num_units, units_per_warp)``: the scatter's unit cut of ``num_tokens`` tokens, and how many
        consecutive units one count warp walks."""
        return _token_cut(num_tokens, self.num_topk, self.num_units, self.count_tokens_per_warp, self.count_min_warps)

    def slots_with_rows(self, num_tokens: int) -> bool:
        """Whether a stable scatter of ``num_tokens`` tokens whose rows are cut into pieces takes its slots in the
        rows' launch (``scatter_rows_kernel``'s ``own_slots``, one launch instead of two): so few tokens that their
        rows are cut (``split_warps`` at least two pieces per entry) and every unit of :meth:`token_cut` one warp
        step at most; not with the debug switch ``EP_COMM_KERNEL_LEGACY=slots_in_rows``."""
        entries, step = num_tokens * self.num_topk, WARP // self.num_topk
        return (not legacy("slots_in_rows") and 0 < entries <= self.split_warps // 2
                and -(-num_tokens // self.num_units) <= step)

    def send_stable(self, num_tokens: int, deterministic: bool) -> bool:
        """Whether a new routing of ``num_tokens`` tokens counts and scatters with stable slots: ``deterministic``
        asks for them, and where :meth:`slots_with_rows` holds they cost one launch less than atomic ones (any
        order being allowed, the stable one is as good)."""
        return deterministic or self.slots_with_rows(num_tokens)

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

    @property
    def recv_words(self) -> int:
        """int32 words of the block one :meth:`receive_count` writes (:meth:`receive_layout`)."""
        return self._recv_words

    def receive_layout(self, block: Array) -> ReceiveCounts:
        """The :class:`ReceiveCounts` arrays: views of ``block``, int32 ``[recv_words]``."""
        totals, rank_psum, unaligned, aligned, expert_psum = map(block.__getitem__, self._recv_slices)
        return ReceiveCounts(rank_psum, unaligned, aligned, expert_psum, totals)
