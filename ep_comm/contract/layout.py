"""Reference layout math in NumPy: the oracle every backend and kernel is checked against.

A dispatch is a two-level counting sort (see ``docs/design.md``, "How a dispatch runs"):

* sender side: count (token, destination rank) pairs and (token, expert) pairs, give every
  (token, rank) pair a *slot* in ``[0, count)`` inside the destination's block for this source;
* receiver side: concatenate the blocks by source rank (compact layout) and, for the expand
  layout, place every (row, local expert) pair expert-major with aligned expert starts.

Shapes: ``T`` tokens, ``K`` top-k width, ``R`` ranks, ``E`` global experts, ``L = E // R`` local
experts, ``N`` received (compact) rows, ``M`` expanded rows. Index arrays are int64 unless said.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np


class DispatchLayout(NamedTuple):
    """What ``Buffer.get_dispatch_layout`` returns (no communication involved)."""

    num_tokens_per_rank: np.ndarray  # [R] int32: tokens going to each rank (a token counts once per rank)
    num_tokens_per_expert: np.ndarray  # [E] int32: (token, expert) pairs per global expert
    is_token_in_rank: np.ndarray  # [T, R] bool


class ReceiveLayout(NamedTuple):
    """Receiver-side layout of the local experts, derived from the received local top-k ids."""

    num_unaligned_per_expert: np.ndarray  # [L] int32: rows each local expert received
    num_aligned_per_expert: np.ndarray  # [L] int32: the same, rounded up to the alignment
    psum_per_expert: np.ndarray  # [L] int32: see ``expert_psum``
    expanded_row: np.ndarray  # [N, K] int32: expert-major row of each (row, entry), -1 if none
    num_expanded_tokens: int  # rows of the expanded output, padding included


def align_up(value: Any, alignment: int) -> Any:
    """Round ``value`` (int or integer array) up to a multiple of ``alignment`` (>= 1)."""
    return -(-value // alignment) * alignment


def entry_ranks(topk_idx: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """[T, K] destination rank of each top-k entry, -1 where the entry is masked (< 0)."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    return np.where(idx >= 0, idx // experts_per_rank, -1)


def is_token_in_rank(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """[T, R] bool: token t picked at least one expert owned by rank r."""
    ranks = entry_ranks(topk_idx, num_experts // num_ranks)
    mask = np.zeros((ranks.shape[0], num_ranks), dtype=bool)
    rows, cols = np.nonzero(ranks >= 0)
    mask[rows, ranks[rows, cols]] = True
    return mask


def dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> DispatchLayout:
    """Count tokens per destination rank (deduplicated) and per global expert."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    in_rank = is_token_in_rank(idx, num_experts, num_ranks)
    per_expert = np.bincount(idx[idx >= 0], minlength=num_experts).astype(np.int32)
    per_rank = in_rank.sum(axis=0, dtype=np.int64).astype(np.int32)
    return DispatchLayout(per_rank, per_expert, in_rank)


def send_count_words(layout: DispatchLayout) -> np.ndarray:
    """The count exchange's blocks of a sender, int64 ``[R, 1 + L]``: row ``r`` is what goes to rank ``r``,
    ``layout.num_tokens_per_rank[r]`` then ``layout.num_tokens_per_expert[r*L:(r+1)*L]`` (its rows, and its
    entries per local expert of ``r``)."""
    per_rank = np.asarray(layout.num_tokens_per_rank, dtype=np.int64)
    per_expert = np.asarray(layout.num_tokens_per_expert, dtype=np.int64).reshape(len(per_rank), -1)
    return np.concatenate([per_rank[:, None], per_expert], axis=1)


def inclusive_psum(counts: np.ndarray) -> np.ndarray:
    """Inclusive prefix sum, int32: ``out[i] = counts[0] + ... + counts[i]``."""
    return np.cumsum(np.asarray(counts, dtype=np.int64)).astype(np.int32)


def exclusive_psum(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum with the total appended, int32, length ``len(counts) + 1``."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=out[1:])
    return out.astype(np.int32)


def stable_rank_slots(in_rank: np.ndarray) -> np.ndarray:
    """[T, R] slot of each (token, rank) pair, -1 where not sent.

    Stable: a token's slot is the number of earlier tokens going to the same rank, so slots
    ascend with the token index (what ``deterministic=True`` computes in the kernels).
    """
    in_rank = np.asarray(in_rank, dtype=bool)
    slots = np.cumsum(in_rank, axis=0, dtype=np.int64) - 1
    return np.where(in_rank, slots, -1)


def atomic_rank_slots(in_rank: np.ndarray, tokens_per_block: int = 4, seed: int = 0) -> np.ndarray:
    """[T, R] slots as an atomic counter hands them out when blocks race.

    Tokens are cut into blocks of ``tokens_per_block``; blocks take their slots in a shuffled
    order (``seed``), tokens inside a block in order. Any permutation of the stable slots is a
    valid non-deterministic result; this one makes tests see a non-trivial order.
    """
    in_rank = np.asarray(in_rank, dtype=bool)
    num_tokens = in_rank.shape[0]
    num_blocks = -(-num_tokens // tokens_per_block) if num_tokens else 0
    block_order = np.random.default_rng(seed).permutation(num_blocks)
    token_order = (block_order[:, None] * tokens_per_block + np.arange(tokens_per_block)).ravel()
    token_order = token_order[token_order < num_tokens]
    slots = np.full(in_rank.shape, -1, dtype=np.int64)
    slots[token_order] = stable_rank_slots(in_rank[token_order])
    return slots


def first_entry_of_rank(topk_idx: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """[T, K] bool: entry k is the lowest entry of its token whose expert lives on its rank.

    That entry carries the (token, rank) slot in ``dst_buffer_slot_idx``; later entries that go
    to the same rank carry -1, so a replay sends each (token, rank) row once.
    """
    ranks = entry_ranks(topk_idx, experts_per_rank)
    num_topk = ranks.shape[1]
    first = ranks >= 0
    for k in range(1, num_topk):
        first[:, k] &= ~(ranks[:, :k] == ranks[:, k : k + 1]).any(axis=1)
    return first


def dst_buffer_slot_idx(
    topk_idx: np.ndarray, slots: np.ndarray, src_rank: int, experts_per_rank: int, max_tokens: int
) -> np.ndarray:
    """[T, K] int32: row of the (token, rank) pair in the destination's symmetric receive buffer.

    The receive buffer is ``[R source, max_tokens, ...]``, so the row is
    ``src_rank * max_tokens + slot``; set on the first entry per destination rank, -1 elsewhere.
    """
    ranks = entry_ranks(topk_idx, experts_per_rank)
    first = first_entry_of_rank(topk_idx, experts_per_rank)
    token = np.broadcast_to(np.arange(ranks.shape[0])[:, None], ranks.shape)
    slot = slots[token, np.maximum(ranks, 0)]
    return np.where(first, src_rank * max_tokens + slot, -1).astype(np.int32)


def local_topk(topk_idx: np.ndarray, dst_rank: int, experts_per_rank: int) -> np.ndarray:
    """[T, K] local expert id on ``dst_rank`` of each entry (``global - dst_rank * L``), else -1."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    local = idx - dst_rank * experts_per_rank
    on_rank = (idx >= 0) & (local >= 0) & (local < experts_per_rank)
    return np.where(on_rank, local, -1)


def expert_psum(counts: np.ndarray, alignment: int, expand: bool) -> np.ndarray:
    """[L] int32 ``psum_num_recv_tokens_per_expert`` from unaligned per-expert counts.

    Expand (DeepEP V2): ``psum[i] = align(psum[i-1]) + count[i]`` (``psum[-1] = 0``), so
    ``count[i] = psum[i] - align(psum[i-1])`` and expert i+1 starts at ``align(psum[i])``.
    Compact: the inclusive prefix sum of the aligned counts.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if not expand:
        return inclusive_psum(align_up(counts, alignment))
    starts = exclusive_psum(align_up(counts, alignment))[:-1].astype(np.int64)
    psum: np.ndarray = (starts + counts).astype(np.int32)
    return psum


def expert_starts(psum: np.ndarray, alignment: int) -> np.ndarray:
    """[L] aligned first row of each expert in the expand layout, from an expand-mode psum."""
    psum = np.asarray(psum, dtype=np.int64)
    starts = np.zeros_like(psum)
    starts[1:] = align_up(psum[:-1], alignment)
    return starts


def receive_layout(recv_local_topk: np.ndarray, num_local_experts: int, alignment: int, expand: bool) -> ReceiveLayout:
    """Expert layout of the received rows.

    ``recv_local_topk`` is ``[N, K]`` local expert ids in compact row order (-1: not here).
    In the expand layout expert ``e``'s rows start at its aligned start and follow the compact
    row order (stable); a row that hits ``e`` appears once in ``e``'s block.
    """
    local = np.asarray(recv_local_topk, dtype=np.int64)
    valid = local >= 0
    counts = np.bincount(local[valid], minlength=num_local_experts).astype(np.int64)
    aligned = align_up(counts, alignment)
    psum = expert_psum(counts, alignment, expand)
    starts = exclusive_psum(aligned)[:-1].astype(np.int64)
    expanded_row = np.full(local.shape, -1, dtype=np.int64)
    rows, cols = np.nonzero(valid)  # row-major: ascending compact row, then entry
    experts = local[rows, cols]
    order = np.argsort(experts, kind="stable")
    rank_in_expert = np.empty(len(order), dtype=np.int64)
    group_start = exclusive_psum(counts)[:-1].astype(np.int64)
    rank_in_expert[order] = np.arange(len(order)) - group_start[experts[order]]
    expanded_row[rows, cols] = starts[experts] + rank_in_expert
    return ReceiveLayout(
        counts.astype(np.int32),
        aligned.astype(np.int32),
        psum,
        expanded_row.astype(np.int32),
        int(aligned.sum()),
    )


def worst_case_recv_rows(num_ranks: int, max_tokens: int) -> int:
    """Compact rows a rank can receive at most: every source sends all its tokens."""
    return num_ranks * max_tokens


def worst_case_expanded_rows(num_ranks: int, max_tokens: int, num_topk: int, num_local_experts: int,
                             alignment: int) -> int:
    """Expanded rows at most: ``align(R*T*min(K, L) + (align-1)*L, align)`` (the contract's bound)."""
    pairs = num_ranks * max_tokens * min(num_topk, num_local_experts)
    return int(align_up(pairs + (alignment - 1) * num_local_experts, alignment))


def output_rows(exact: Optional[Tuple[int, int]], expand: bool, alignment: int, num_ranks: int, max_tokens: int,
                num_topk: int, num_local_experts: int) -> Tuple[int, int]:
    """``(rows of recv_src_metadata, rows of recv_x)`` of a dispatch's outputs.

    ``exact``: ``(received rows N, expanded rows M)`` when the host knows them (``cpu_sync=True``):
    ``(N, M)`` expand, ``(N, N)`` compact. None: the contract's worst cases,
    :func:`worst_case_recv_rows` and (expand) :func:`worst_case_expanded_rows`.
    """
    if exact is not None:
        n, m = exact
        return n, (m if expand else n)
    n = worst_case_recv_rows(num_ranks, max_tokens)
    if not expand:
        return n, n
    return n, worst_case_expanded_rows(num_ranks, max_tokens, num_topk, num_local_experts, alignment)
