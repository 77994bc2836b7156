"""Property-based tests of the reference layout (``ep_comm.contract.layout``) on random routings."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_comm.contract import layout as lay


@st.composite
def routings(draw):
    """(topk_idx [T, K] int64 with -1 masks, num_experts, num_ranks)."""
    num_ranks = draw(st.integers(1, 6))
    num_experts = num_ranks * draw(st.integers(1, 5))
    num_topk = draw(st.integers(1, min(6, num_experts)))
    num_tokens = draw(st.integers(0, 24))
    rows = []
    for _ in range(num_tokens):
        experts = draw(st.lists(st.integers(0, num_experts - 1), min_size=num_topk, max_size=num_topk, unique=True))
        mask = draw(st.lists(st.booleans(), min_size=num_topk, max_size=num_topk))
        rows.append([-1 if m else e for e, m in zip(experts, mask)])
    idx = np.array(rows, dtype=np.int64).reshape(num_tokens, num_topk)
    return idx, num_experts, num_ranks


@settings(max_examples=150, deadline=None)
@given(routings())
def test_counts_match_brute_force(case):
    idx, num_experts, num_ranks = case
    layout = lay.dispatch_layout(idx, num_experts, num_ranks)
    per = num_experts // num_ranks
    for t, row in enumerate(idx):
        ranks = {int(e) // per for e in row if e >= 0}
        assert [bool(r in ranks) for r in range(num_ranks)] == layout.is_token_in_rank[t].tolist()
    assert layout.num_tokens_per_rank.tolist() == layout.is_token_in_rank.sum(axis=0).tolist()
    assert layout.num_tokens_per_expert.tolist() == [int((idx == e).sum()) for e in range(num_experts)]
    assert layout.num_tokens_per_expert.sum() == (idx >= 0).sum()


@settings(max_examples=150, deadline=None)
@given(routings(), st.integers(1, 5), st.integers(0, 1000))
def test_slots_are_permutations_and_stable_slots_ascend(case, tokens_per_block, seed):
    idx, num_experts, num_ranks = case
    in_rank = lay.is_token_in_rank(idx, num_experts, num_ranks)
    stable = lay.stable_rank_slots(in_rank)
    atomic = lay.atomic_rank_slots(in_rank, tokens_per_block, seed)
    for r in range(num_ranks):
        count = int(in_rank[:, r].sum())
        for slots in (stable, atomic):
            assert sorted(slots[in_rank[:, r], r].tolist()) == list(range(count))
            assert (slots[~in_rank[:, r], r] == -1).all()
        assert stable[in_rank[:, r], r].tolist() == list(range(count))  # ascending with the token


@settings(max_examples=150, deadline=None)
@given(routings(), st.integers(0, 5), st.integers(1, 64))
def test_dst_buffer_slot_idx_one_entry_per_token_and_rank(case, src_rank, extra_capacity):
    idx, num_experts, num_ranks = case
    per = num_experts // num_ranks
    max_tokens = len(idx) + extra_capacity
    in_rank = lay.is_token_in_rank(idx, num_experts, num_ranks)
    slots = lay.stable_rank_slots(in_rank)
    slot_idx = lay.dst_buffer_slot_idx(idx, slots, src_rank, per, max_tokens)
    for t, row in enumerate(idx):
        for r in range(num_ranks):
            ks = [k for k, e in enumerate(row) if e >= 0 and e // per == r]
            marked = [k for k in ks if slot_idx[t, k] >= 0]
            assert marked == ks[:1]
            if ks:
                assert slot_idx[t, ks[0]] == src_rank * max_tokens + slots[t, r]
        assert all(slot_idx[t, k] == -1 for k, e in enumerate(row) if e < 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 16))
def test_expert_psum_identities(counts, alignment):
    psum = lay.expert_psum(counts, alignment, expand=True).astype(int)
    starts = lay.expert_starts(psum, alignment)
    prev_aligned = 0
    for i, count in enumerate(counts):
        assert psum[i] - prev_aligned == count  # count_i = psum[i] - align(psum[i-1])
        assert starts[i] == prev_aligned
        prev_aligned = int(lay.align_up(psum[i], alignment))
    compact = lay.expert_psum(counts, alignment, expand=False)
    assert compact.tolist() == np.cumsum([lay.align_up(c, alignment) for c in counts]).tolist()


@settings(max_examples=150, deadline=None)
@given(routings(), st.integers(1, 8))
def test_receive_layout_places_every_pair_once_expert_major(case, alignment):
    idx, num_experts, num_ranks = case
    per = num_experts // num_ranks
    local = lay.local_topk(idx, 0, per)  # rank 0 receiving this routing
    local = local[(local >= 0).any(axis=1)]
    recv = lay.receive_layout(local, per, alignment, expand=True)
    rows = recv.expanded_row
    assert ((rows >= 0) == (local >= 0)).all()
    placed = rows[rows >= 0]
    assert len(set(placed.tolist())) == len(placed)  # one row per (row, expert) pair
    assert recv.num_expanded_tokens == int(recv.num_aligned_per_expert.sum())
    starts = lay.expert_starts(recv.psum_per_expert, alignment)
    for e in range(per):
        i, k = np.nonzero(local == e)
        got = rows[i, k]
        assert got.tolist() == list(range(starts[e], starts[e] + len(i)))  # contiguous, in row order
    worst = lay.worst_case_expanded_rows(num_ranks, max(len(idx), 1), idx.shape[1], per, alignment)
    assert recv.num_expanded_tokens <= worst
