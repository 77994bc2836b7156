"""The sender's count kernel against the NumPy reference: counts, prefix sums, ``is_token_in_rank`` and the
stable ``dst_buffer_slot_idx``, bit for bit, in one launch of one block."""
from __future__ import annotations

import numpy as np
import pytest

import ep_comm.launching.kernels as launching
from ep_comm import layout as ref
from ep_comm.host import to_host
from ep_comm.kernels.count import count_kernel
from ep_comm.launching.kernels import Kernels
from world import random_routing, spy_launches

MAX_TOKENS = 1024
SRC_RANK = 1


def count(xp, topk_idx: np.ndarray, num_ranks: int, num_experts: int, **kernels):
    """``Kernels.count`` of ``topk_idx`` on a Kernels of that geometry (keyword options passed on)."""
    k = Kernels(xp, num_ranks=num_ranks, num_experts=num_experts, num_topk=topk_idx.shape[1], max_tokens=MAX_TOKENS,
                num_blocks=3, warps_per_block=2, **kernels)
    return k.count(xp.asarray(topk_idx), src_rank=SRC_RANK)


def check(lay, topk_idx: np.ndarray, num_ranks: int, num_experts: int) -> None:
    """Every output of ``lay`` equals the reference's, ids at or above ``num_experts`` read as no expert."""
    idx = np.where(topk_idx >= num_experts, -1, topk_idx)
    want = ref.dispatch_layout(idx, num_experts, num_ranks)
    slots = ref.dst_buffer_slot_idx(idx, ref.stable_rank_slots(want.is_token_in_rank), SRC_RANK,
                                    num_experts // num_ranks, MAX_TOKENS)
    np.testing.assert_array_equal(to_host(lay.num_tokens_per_rank), want.num_tokens_per_rank)
    np.testing.assert_array_equal(to_host(lay.num_tokens_per_expert), want.num_tokens_per_expert)
    np.testing.assert_array_equal(to_host(lay.is_token_in_rank), want.is_token_in_rank)
    np.testing.assert_array_equal(to_host(lay.rank_psum), ref.inclusive_psum(want.num_tokens_per_rank))
    np.testing.assert_array_equal(to_host(lay.expert_psum), ref.exclusive_psum(want.num_tokens_per_expert))
    np.testing.assert_array_equal(to_host(lay.slot_idx), slots)


@pytest.mark.parametrize("tokens, ranks, topk, experts, routing", [
    (0, 2, 2, 8, dict()),
    (1, 1, 1, 4, dict()),
    (31, 3, 2, 12, dict(masked=0.3)),
    (33, 8, 8, 64, dict(masked=0.2, nowhere=3)),
    (128, 2, 8, 16, dict(hot_expert=5, masked=0.0)),
    (128, 8, 1, 256, dict(masked=0.1)),
    (1000, 8, 8, 256, dict(masked=0.1)),
    (50, 4, 12, 32, dict(masked=0.2)),  # K past one load round and not a multiple of 4 (cache words)
    (40, 2, 32, 64, dict(masked=0.1)),  # the widest top-k
])
def test_count_matches_the_reference(xp, tokens, ranks, topk, experts, routing):
    idx = random_routing(np.random.default_rng(tokens + ranks), tokens, topk, experts, **routing)
    check(count(xp, idx, ranks, experts), idx, ranks, experts)


@pytest.mark.parametrize("tokens_per_warp", [1, 8, 32, 5000])  # 16 warps (the most), 13, 4, one warp
def test_block_sizes_give_the_same_slots(xp, tokens_per_warp):
    idx = random_routing(np.random.default_rng(7), 100, 3, 12, masked=0.2)
    check(count(xp, idx, 3, 12, count_tokens_per_warp=tokens_per_warp), idx, 3, 12)


def test_ids_out_of_range_are_no_expert(xp):
    rng = np.random.default_rng(3)
    idx = random_routing(rng, 40, 4, 16, masked=0.1).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = 16
    idx[0, :] = [2**31 - 1, -(2**31), 17, 3]
    check(count(xp, idx, 4, 16), idx, 4, 16)


def test_tokens_past_the_rank_cache_reread_the_routing(xp, monkeypatch):
    """A shared memory budget that caches the ranks of only some tokens: the rest are read again."""
    ranks, experts, topk, tokens = 2, 8, 8, 70
    fixed = 4 * (2 * experts + 2 * 3 * ranks + ranks)  # 3 warps of 32 tokens
    monkeypatch.setattr(launching, "_COUNT_SHARED_BYTES", fixed + 8 * 20)  # 20 tokens of 8 cached ranks
    idx = random_routing(np.random.default_rng(5), tokens, topk, experts, masked=0.2)
    check(count(xp, idx, ranks, experts, count_tokens_per_warp=24), idx, ranks, experts)


def test_more_ranks_than_a_warp_or_the_rank_cache_holds(xp):
    """130 ranks (one expert each): ballots over several words of ranks and no rank cache."""
    idx = random_routing(np.random.default_rng(11), 40, 3, 130, masked=0.1)
    idx[1, :] = [40, 100, 129]  # ranks in different words
    check(count(xp, idx, 130, 130), idx, 130, 130)


def test_one_launch_of_one_block(xp, monkeypatch):
    arguments = []
    spy_launches(monkeypatch, arguments)
    blocks = []
    launch = Kernels._launch

    def record_blocks(self, kernel, shared_bytes=0, blocks_arg=0, warps_per_block=0):
        blocks.append(blocks_arg)
        return launch(self, kernel, shared_bytes, blocks_arg, warps_per_block)

    monkeypatch.setattr(Kernels, "_launch", record_blocks)
    idx = random_routing(np.random.default_rng(2), 50, 2, 8)
    check(count(xp, idx, 2, 8), idx, 2, 8)
    assert [kernel for kernel, _ in arguments] == [count_kernel] and blocks == [1]


def test_the_block_fits_the_registers_and_the_shared_memory(xp):
    """At most 16 warps (120 registers a thread), one per 32 tokens by default; geometries whose fixed
    shared memory passes 48 KiB are refused."""
    k = Kernels(xp, num_ranks=8, num_experts=256, num_topk=8, max_tokens=4096)
    assert [k.count_warps(t) for t in (0, 1, 128, 500, 4096)] == [1, 1, 4, 16, 16]
    with pytest.raises(ValueError, match=r"num_experts=8192, num_ranks=8: the count kernel needs"):
        Kernels(xp, num_ranks=8, num_experts=8192, num_topk=8, max_tokens=16).count_warps(16)
