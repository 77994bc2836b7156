"""Byte layout of the symmetric buffer every rank allocates once, at worst-case capacity.

Both transports (MPI one-sided windows, NVSHMEM symmetric heap) allocate the same layout so
that a peer's region is addressed by the same offsets everywhere:

* ``signal[R]`` int64: the step word ``seq << 2 | kind`` (kind 1 dispatch, 2 combine, 3 close) of
  the last collective step source rank ``s`` finished writing into this rank (monotone; a waiter
  wants ``signal[s]`` equal to its own step's word, or a later step number);
* ``counts[2][R][1 + L + V]`` int64 (``L`` local experts): what source ``s`` sent in the operation of that
  parity (new routing only): word 0 its rows, word ``1 + j`` its entries for local expert ``j`` (the
  slice ``[r*L:(r+1)*L]`` of its count kernel's tokens per expert, for this rank ``r``), then the ``V``
  (``verdict_words``) words of its routing verdict (``ep_comm.validate.verdict_words``; all zero = clean);
* ``rows[2][R][max_tokens]`` payload rows of ``row_bytes`` (hidden * itemsize, padded to 16 B);
* ``meta[2][R][max_tokens][1 + 2K]`` int32: source token, K local expert ids, K float32 weights
  (as raw bits);
* ``abort[R][ABORT_WORDS]`` int64: the abort record source rank ``s`` posted here when it gave up on
  the Buffer (``ep_comm.backends.aborts``; all zero until then). Last, so that the offsets of the
  regions the kernels use do not depend on it.

Operations alternate between two parities (``seq % 2``): a peer is at most one operation ahead
(it cannot finish operation ``n+1`` before this rank has sent its own signal for ``n+1``, which
it does only after it has read operation ``n``), so double buffering needs no extra handshake.
"""
from __future__ import annotations

from dataclasses import dataclass

_ALIGN = 128
STEP_KINDS = {"dispatch": 1, "combine": 2, "close": 3}  # the low bits of a signal word (collective_steps)
ABORT_WORDS = 16  # int64 words of one abort record (ep_comm.backends.aborts)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SymmetricLayout:
    num_ranks: int
    max_tokens: int
    hidden: int
    num_topk: int
    itemsize: int
    num_local_experts: int
    verdict_words: int = 0  # words of the routing verdict after the counts: validate.VERDICT_WORDS where the count
    # step sends one (mpi), 0 where it does not yet (the nvshmem count kernel)

    @property
    def count_words(self) -> int:
        """int64 words one source writes per operation into a destination's counts: rows, then one per local
        expert, then the routing verdict's ``verdict_words``."""
        return 1 + self.num_local_experts + self.verdict_words

    @property
    def row_bytes(self) -> int:
        return -(-self.hidden * self.itemsize // 16) * 16

    @property
    def meta_words(self) -> int:
        return 1 + 2 * self.num_topk

    @property
    def signal_offset(self) -> int:
        return 0

    @property
    def counts_offset(self) -> int:
        return _up(8 * self.num_ranks)

    @property
    def rows_offset(self) -> int:
        return self.counts_offset + _up(2 * 8 * self.num_ranks * self.count_words)

    @property
    def meta_offset(self) -> int:
        return self.rows_offset + _up(2 * self.num_ranks * self.max_tokens * self.row_bytes)

    @property
    def abort_offset(self) -> int:
        return self.meta_offset + _up(2 * self.num_ranks * self.max_tokens * self.meta_words * 4)

    @property
    def abort_bytes(self) -> int:
        return 8 * ABORT_WORDS * self.num_ranks

    @property
    def total_bytes(self) -> int:
        return self.abort_offset + _up(self.abort_bytes)

    def abort_at(self, src: int) -> int:
        return self.abort_offset + 8 * ABORT_WORDS * src

    def signal_at(self, src: int) -> int:
        return self.signal_offset + 8 * src

    def count_at(self, parity: int, src: int) -> int:
        """Byte offset of source ``src``'s ``count_words`` words of the operation of ``parity``."""
        return self.counts_offset + 8 * (parity * self.num_ranks + src) * self.count_words

    def row_at(self, parity: int, src: int, slot: int = 0) -> int:
        return self.rows_offset + ((parity * self.num_ranks + src) * self.max_tokens + slot) * self.row_bytes

    def meta_at(self, parity: int, src: int, slot: int = 0) -> int:
        return self.meta_offset + ((parity * self.num_ranks + src) * self.max_tokens + slot) * self.meta_words * 4
