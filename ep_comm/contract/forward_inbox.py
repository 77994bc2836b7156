"""Byte layout of the forwarding inbox (``Buffer(forwarding=True)`` with several nodes), and the order a forwarder
writes in.

The inbox follows the symmetric buffer in the same allocation (it starts at ``SymmetricLayout.total_bytes``). A
forwarder forwards for one rank of every other node, the rank with its own local index (``Topology.forwarder`` is
symmetric): in a dispatch it receives from that rank, in a combine from the ranks of its own node, their partials
for that rank. Its regions have ``R`` blocks per parity, block ``b = node * S + j`` (``S = scaleup_ranks``, ``node``
the node of the rank forwarded for, ``j`` a local index in the forwarder's node):

* ``signal[R]`` int64: the step word (``collective_steps.step_word``) of the last step sender ``s`` finished
  writing into this inbox (monotone, as the symmetric buffer's signals);
* ``header[2][R][2]`` int64: rows in the block, and 1 when the block's count words were written (a new routing);
* ``counts[2][R][count_words]`` int64: dispatch, block ``node * S + j``: the sender's count words for rank ``j`` of
  the forwarder's node (``layout.send_count_words`` and its routing verdict), as the flat path puts them;
* ``rows[2][R][max_tokens]`` payload rows of ``row_bytes``;
* ``meta[2][R][max_tokens][relay_words]`` int32: a symmetric meta row (source token, K ids, K weights as bits),
  then ``S`` slots.

Dispatch (block ``node * S``): every token of the sender bound for any rank of the forwarder's node, once, in token
order; its meta carries the token's *global* expert ids and its slot in each rank ``j`` of the node (-1: not sent
there), the slots the flat path computed. Combine (block ``node * S + j``): the partials of rank ``j`` of the
forwarder's node for the rank forwarded for in ``node``, in slot order, their meta rows as the flat path sends them
(source token, rank ``j``'s local expert ids, weights; slots unused); the forwarder sums them per token
(``reduce.node_sum``).

The forwarder's writes depend on the slots (dispatch) or the token ids (combine) alone, never on arrival order
(:func:`slot_order`).

That is the mpi backend's use of the layout. The GPU kernels (``ep_comm.kernels.forward``, :func:`inbox_views`) index
a dispatch block by source token instead (row ``t`` is token ``t``, a meta row for every token below the header's
row count, slots -1 where not sent), and a combine block's meta rows sit in a region of their own,
``combine_meta[2][R][max_tokens][meta_words]`` int32 (the symmetric meta row's width, no slots), so that the flat
combine's send kernels write a block through C-contiguous views (:func:`combine_send_views`); a tail after it keeps
those views inside the allocation: docs/design.md, "Forwarding on nvshmem".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Tuple

import numpy as np

from ep_comm.contract.arrays import Array
from ep_comm.contract.layout import align_up
from ep_comm.contract.symmetric import SymmetricLayout

HEADER_WORDS = 2  # int64 words of one block's header: rows, count words written
_ALIGN = 128  # region alignment, as the symmetric buffer's


def _pad_to_alignment(nbytes: int) -> int:
    return int(align_up(nbytes, _ALIGN))


@dataclass(frozen=True)
class ForwardInbox:
    """The inbox of ``sym.num_ranks`` ranks in nodes of ``scaleup_ranks``, after ``sym``'s regions."""

    sym: SymmetricLayout
    scaleup_ranks: int

    @property
    def relay_words(self) -> int:
        """int32 words of one inbox meta row: the symmetric meta row, then one slot per rank of the node."""
        return self.sym.meta_words + self.scaleup_ranks

    def block(self, sender_node: int, local: int) -> int:
        """The block of sender node ``sender_node`` for local index ``local`` of the forwarder's node."""
        return sender_node * self.scaleup_ranks + local

    @property
    def signal_offset(self) -> int:
        return self.sym.total_bytes

    @property
    def header_offset(self) -> int:
        return self.signal_offset + _pad_to_alignment(8 * self.sym.num_ranks)

    @property
    def counts_offset(self) -> int:
        return self.header_offset + _pad_to_alignment(2 * 8 * self.sym.num_ranks * HEADER_WORDS)

    @property
    def rows_offset(self) -> int:
        return self.counts_offset + _pad_to_alignment(2 * 8 * self.sym.num_ranks * self.sym.count_words)

    @property
    def meta_offset(self) -> int:
        sym = self.sym
        return self.rows_offset + _pad_to_alignment(2 * sym.num_ranks * sym.max_tokens * sym.row_bytes)

    @property
    def combine_meta_offset(self) -> int:
        """The GPU's combine meta rows (``meta_words`` int32 each, no slots), after the meta rows."""
        sym = self.sym
        return self.meta_offset + _pad_to_alignment(2 * sym.num_ranks * sym.max_tokens * self.relay_words * 4)

    @property
    def tail_bytes(self) -> int:
        """Bytes after the last region that a :func:`combine_send_views` view may span (never written): a view of
        block ``b`` for rank ``me`` starts ``(b - me)`` blocks after its region's start, at most ``R - 1`` blocks."""
        sym = self.sym
        block = max(sym.max_tokens * sym.row_bytes, sym.max_tokens * sym.meta_words * 4, 8 * HEADER_WORDS)
        return _pad_to_alignment((sym.num_ranks - 1) * block)

    @property
    def total_bytes(self) -> int:
        """Bytes of the symmetric buffer and the inbox together."""
        sym = self.sym
        return (self.combine_meta_offset + _pad_to_alignment(2 * sym.num_ranks * sym.max_tokens * sym.meta_words * 4)
                + self.tail_bytes)

    def header_at(self, parity: int, block: int) -> int:
        return self.header_offset + 8 * HEADER_WORDS * (parity * self.sym.num_ranks + block)

    def count_at(self, parity: int, block: int) -> int:
        """Byte offset of block ``block``'s count words; the blocks of one sender node are consecutive."""
        return self.counts_offset + 8 * self.sym.count_words * (parity * self.sym.num_ranks + block)

    def row_at(self, parity: int, block: int) -> int:
        return self.rows_offset + (parity * self.sym.num_ranks + block) * self.sym.max_tokens * self.sym.row_bytes

    def meta_at(self, parity: int, block: int) -> int:
        return self.meta_offset + (parity * self.sym.num_ranks + block) * self.sym.max_tokens * self.relay_words * 4

    def combine_meta_at(self, parity: int, block: int) -> int:
        sym = self.sym
        return self.combine_meta_offset + (parity * sym.num_ranks + block) * sym.max_tokens * sym.meta_words * 4


def relay_meta(meta: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Inbox meta rows: symmetric meta rows ``meta [n, 1 + 2K]`` int32 with the slots ``slots [n, S]`` (-1: not
    sent to that rank) appended; ``[n, 1 + 2K + S]`` int32."""
    return np.concatenate([meta, np.asarray(slots, dtype=np.int32)], axis=1)


def slot_order(slots: np.ndarray) -> np.ndarray:
    """The inbox rows a forwarder writes to one rank of its node, in the order of their slots there (``slots [n]``,
    that rank's column of the inbox meta; -1 rows are not sent there): the flat path's block order, whatever the
    order the rows arrived in. Returns int64 row indices."""
    sent = np.nonzero(slots >= 0)[0]
    return sent[np.argsort(slots[sent], kind="stable")]


class InboxViews(NamedTuple):
    """Typed views of one rank's forwarding inbox (:class:`ForwardInbox` byte layout), as the GPU kernels take them
    (``ep_comm.kernels.forward``)."""

    signal: Array  # [R] int64
    header: Array  # [2, R, HEADER_WORDS] int64
    counts: Array  # [2, R, count_words] int64
    rows: Array  # [2, R, max_tokens, row_bytes // word] words
    meta: Array  # [2, R, max_tokens, relay_words] int32
    combine_meta: Array  # [2, R, max_tokens, meta_words] int32: the GPU's combine blocks' meta rows


def inbox_views(buffer: Array, inbox: ForwardInbox, word: np.dtype) -> InboxViews:
    """Typed views of the inbox in a flat uint8 buffer of ``inbox.total_bytes`` (the symmetric buffer first);
    rows as ``word``."""
    sym, r = inbox.sym, inbox.sym.num_ranks

    def region(offset: int, nbytes: int, dtype: np.dtype, shape: Tuple[int, ...]) -> Array:
        return buffer[offset: offset + nbytes].view(dtype).reshape(shape)

    rows_shape = (2, r, sym.max_tokens, sym.row_bytes // np.dtype(word).itemsize)
    return InboxViews(
        signal=region(inbox.signal_offset, 8 * r, np.dtype(np.int64), (r,)),
        header=region(inbox.header_offset, 16 * r * HEADER_WORDS, np.dtype(np.int64), (2, r, HEADER_WORDS)),
        counts=region(inbox.counts_offset, 16 * r * sym.count_words, np.dtype(np.int64), (2, r, sym.count_words)),
        rows=region(inbox.rows_offset, 2 * r * sym.max_tokens * sym.row_bytes, np.dtype(word), rows_shape),
        meta=region(inbox.meta_offset, 8 * r * sym.max_tokens * inbox.relay_words, np.dtype(np.int32),
                    (2, r, sym.max_tokens, inbox.relay_words)),
        combine_meta=region(inbox.combine_meta_offset, 8 * r * sym.max_tokens * sym.meta_words, np.dtype(np.int32),
                            (2, r, sym.max_tokens, sym.meta_words)),
    )


class CombineSendViews(NamedTuple):
    """C-contiguous views of one forwarder's inbox through which a rank's flat combine send writes its partials for
    a source of another node (:func:`combine_send_views`)."""

    rows: Array  # [2, R, max_tokens, row_bytes // word] words
    meta: Array  # [2, R, max_tokens, meta_words] int32
    header: Array  # [2, R, HEADER_WORDS] int64


def combine_send_views(buffer: Array, inbox: ForwardInbox, me: int, block: int, word: np.dtype) -> CombineSendViews:
    """Views of the inbox in ``buffer`` (a forwarder's flat uint8 buffer of ``inbox.total_bytes``, or its peer view)
    of the symmetric rows', meta rows' and header's shapes, C-contiguous, in which ``[parity, me, slot]`` is block
    ``block``'s ``[parity, slot]`` (rows, combine meta rows, header): the flat combine send kernels, which write only
    ``[parity, me, ...]`` of each source's view, then write that block. Each view starts ``block - me`` blocks from
    its region's start (before it, inside the allocation, the symmetric buffer; past its end, at most
    ``inbox.tail_bytes``); the other entries of a view alias other regions and are never written."""
    sym, r, t = inbox.sym, inbox.sym.num_ranks, inbox.sym.max_tokens

    def shifted(offset: int, block_bytes: int, dtype: np.dtype, shape: Tuple[int, ...]) -> Array:
        start = offset + (block - me) * block_bytes
        return buffer[start: start + 2 * r * block_bytes].view(dtype).reshape(shape)

    return CombineSendViews(
        rows=shifted(inbox.rows_offset, t * sym.row_bytes, np.dtype(word),
                     (2, r, t, sym.row_bytes // np.dtype(word).itemsize)),
        meta=shifted(inbox.combine_meta_offset, t * sym.meta_words * 4, np.dtype(np.int32), (2, r, t, sym.meta_words)),
        header=shifted(inbox.header_offset, 8 * HEADER_WORDS, np.dtype(np.int64), (2, r, HEADER_WORDS)),
    )
