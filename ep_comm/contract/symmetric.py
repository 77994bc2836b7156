"""Byte layout of the symmetric buffer every rank allocates once, at worst-case capacity.

Both transports (MPI one-sided windows, NVSHMEM symmetric heap) allocate the same layout so
that a peer's region is addressed by the same offsets everywhere:

* ``signal[R]`` int64: the step word ``seq << 2 | kind`` (kind 1 dispatch, 2 combine, 3 close) of
  the last collective step source rank ``s`` finished writing into this rank (monotone; a waiter
  wants ``signal[s]`` equal to its own step's word, or a later step number);
* ``counts[2][R][1 + L + VERDICT_WORDS]`` int64 (``L`` local experts): what source ``s`` sent in the operation
  of that parity (new routing only): word 0 its rows, word ``1 + j`` its entries for local expert ``j`` (the
  slice ``[r*L:(r+1)*L]`` of its count kernel's tokens per expert, for this rank ``r``), then the two words of
  its routing verdict (``ep_comm.contract.checks.verdict_words``; all zero, as a missing rank's zeroed block, reads clean);
* ``rows[2][R][max_tokens]`` payload rows of ``row_bytes`` (hidden * itemsize, padded to 16 B);
* ``meta[2][R][max_tokens][1 + 2K]`` int32: source token, K local expert ids, K float32 weights
  (as raw bits);
* ``abort[R][ABORT_WORDS]`` int64: the abort record source rank ``s`` posted here when it gave up on
  the Buffer (``ep_comm.backends.aborts``; all zero until then). Last, so that the offsets of the
  regions the kernels use do not depend on it.

Operations alternate between two parities (``seq % 2``): a peer is at most one operation ahead
(it cannot finish operation ``n+1`` before this rank has sent its own signal for ``n+1``, which
it does only after it has read operation ``n``), so double buffering needs no extra handshake.

The receive count's **record** (not in the symmetric buffer: host-mapped memory the host polls) is int64
``[record_words(R, L)]``: ``RECORD_TAG`` the step number, written last; ``RECORD_N`` the received rows;
``RECORD_M`` the expanded rows; from ``RECORD_VERDICTS`` every source's two verdict words as received
(``2R``), then the aligned count of every local expert (``L``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Sequence, Tuple

import numpy as np
from numpy.typing import DTypeLike

from ep_comm.contract.arrays import Array
from ep_comm.contract.checks import verdict_of
from ep_comm.contract.protocol import RECORD_M, RECORD_N, RECORD_TAG, RECORD_VERDICTS, VERDICT_WORDS  # re-exported

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

    @property
    def count_words(self) -> int:
        """int64 words one source writes per operation into a destination's counts: rows, then one per local
        expert, then its routing verdict's ``VERDICT_WORDS``."""
        return 1 + self.num_local_experts + VERDICT_WORDS

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


def record_words(num_ranks: int, num_local_experts: int) -> int:
    """int64 words of the receive count's record: tag, N, M, ``VERDICT_WORDS`` per source, one per local expert."""
    return RECORD_VERDICTS + VERDICT_WORDS * num_ranks + num_local_experts


class Record(NamedTuple):
    """The receive count's record, decoded (:func:`read_record`)."""

    tag: int  # the step number of the receive count that wrote it
    num_recv: int  # N: received rows (0 when any verdict is bad)
    num_expanded: int  # M: expanded rows, padding included (0 when any verdict is bad)
    verdicts: List[Tuple[int, int]]  # per source rank (largest id or -1, first repeated row or -1)
    aligned: List[int]  # [L] aligned received entries per local expert


def read_record(words: Sequence[int], num_ranks: int, num_local_experts: int) -> Record:
    """Decode a whole record (int64 ``[record_words(R, L)]``, e.g. a host copy) read once its tag is the step's
    number: :func:`record_counts` and :func:`record_verdicts` with the tag."""
    record = np.asarray(words, dtype=np.int64)
    num_recv, num_expanded, aligned = record_counts(record.tolist(), num_ranks, num_local_experts)
    return Record(int(record[RECORD_TAG]), num_recv, num_expanded, record_verdicts(record, num_ranks), aligned)


def record_verdicts(words: Any, num_ranks: int) -> List[Tuple[int, int]]:
    """Every source's ``(largest id or -1, first repeated row or -1)`` from a record (a NumPy int64 view of it)."""
    return [verdict_of(pair) for pair in record_verdict_words(words, num_ranks).tolist()]


def record_counts(words: List[int], num_ranks: int, num_local_experts: int) -> Tuple[int, int, List[int]]:
    """``(N, M, aligned counts [L])`` of a record's words as a host list (one ``tolist()`` of it): three reads, no
    decoding of the rest."""
    end = RECORD_VERDICTS + VERDICT_WORDS * num_ranks
    return words[RECORD_N], words[RECORD_M], words[end: end + num_local_experts]


def record_verdict_words(words: Any, num_ranks: int) -> Any:
    """The int64 ``[R, VERDICT_WORDS]`` verdict words of a record (a NumPy view of it, not copied)."""
    return words[RECORD_VERDICTS: RECORD_VERDICTS + VERDICT_WORDS * num_ranks].reshape(num_ranks, VERDICT_WORDS)


class SymmetricViews(NamedTuple):
    """Typed views of one rank's symmetric buffer (``ep_comm.contract.symmetric`` byte layout)."""

    signal: Array  # [R] int64
    counts: Array  # [2, R, 1 + L + 2] int64: per source rows, then entries per local expert, then its verdict
    rows: Array  # [2, R, max_tokens, row_bytes // word] words
    meta: Array  # [2, R, max_tokens, 1 + 2K] int32


def symmetric_views(buffer: Array, layout: SymmetricLayout, word: np.dtype) -> SymmetricViews:
    """Typed views of a flat uint8 symmetric buffer (``layout.total_bytes`` long); rows as ``word``."""
    def region(offset: int, nbytes: int, dtype: DTypeLike) -> Array:
        return buffer[offset: offset + nbytes].view(dtype)

    r, t = layout.num_ranks, layout.max_tokens
    rows_bytes = 2 * r * t * layout.row_bytes
    return SymmetricViews(
        signal=region(layout.signal_offset, 8 * r, np.int64),
        counts=region(layout.counts_offset, 16 * r * layout.count_words, np.int64).reshape(2, r, layout.count_words),
        rows=region(layout.rows_offset, rows_bytes, word).reshape(2, r, t, layout.row_bytes // np.dtype(word).itemsize),
        meta=region(layout.meta_offset, 2 * r * t * layout.meta_words * 4, np.int32).reshape(
            2, r, t, layout.meta_words),
    )


@functools.lru_cache(maxsize=256)
def word_dtype(hidden: int, itemsize: int) -> np.dtype:
    """The word type :func:`payload_words` uses for rows of ``hidden`` elements of ``itemsize`` bytes: the widest
    of uint64/uint32/uint16 that divides a row (remembered: every launch asks it again)."""
    row_bytes = hidden * itemsize
    return np.dtype(next(w for w in (np.uint64, np.uint32, np.uint16) if row_bytes % np.dtype(w).itemsize == 0))


def payload_words(x: Array) -> Array:
    """View ``x [rows, H]`` (float32/float16/bfloat16/uint16) as ``[rows, H * itemsize // word]`` words
    (:func:`word_dtype`), in one view."""
    return x.view(word_dtype(x.shape[1], x.dtype.itemsize))


def payload_rows(rows: Array, dtype: DTypeLike) -> Array:
    """Re-view ``[..., words]`` row storage as payload elements of ``dtype`` (bfloat16 as uint16 bits)."""
    dtype = np.dtype(dtype)
    return rows.view(dtype if dtype in (np.float32, np.float16) else np.uint16)
