"""The one-block count against the NumPy reference, bit for bit: counts, prefix sums, ``is_token_in_rank``
and the stable cursors the scatter consumes (``unit_counts``, ``group_counts``)."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from ep_comm import layout as ref
from ep_comm.host import to_host
from ep_comm.kernels.count import rank_of
from ep_comm.launching.kernels import Kernels
from world import random_routing

GARBAGE = 12345


def reference_cursors(in_rank: np.ndarray, num_units: int, units_per_warp: int) -> tuple:
    """``(unit_counts, group_counts)`` ``[units, R]`` / ``[groups, R]``: rank-r tokens of a unit's group before
    the unit, and rank-r tokens before a group, for the scatter's cut of the tokens into units."""
    num_tokens = in_rank.shape[0]
    per_unit = -(-num_tokens // num_units)
    starts = np.minimum(np.arange(num_units + 1) * per_unit, num_tokens)
    per_unit_counts = np.array([in_rank[starts[u]:starts[u + 1]].sum(axis=0) for u in range(num_units)])
    before_unit = np.cumsum(per_unit_counts, axis=0) - per_unit_counts
    group_first = np.arange(num_units) // units_per_warp * units_per_warp
    unit_counts = before_unit - before_unit[group_first]
    group_counts = before_unit[::units_per_warp]
    return unit_counts, group_counts


def check_count(k: Kernels, topk: np.ndarray, stable: bool, expected_topk: np.ndarray) -> None:
    """``expected_topk``: the routing as the reference reads it (ids the kernel takes for "no expert" set to -1)."""
    r, e = k.num_ranks, k.num_experts
    k._send_units[...] = GARBAGE
    k._send_groups[...] = GARBAGE
    k._rank_cursor[...] = GARBAGE
    lay = k.count(k.xp.asarray(topk), stable=stable)
    want = ref.dispatch_layout(expected_topk, e, r)
    for got, expected in ((lay.num_tokens_per_rank, want.num_tokens_per_rank),
                          (lay.num_tokens_per_expert, want.num_tokens_per_expert),
                          (lay.is_token_in_rank, want.is_token_in_rank),
                          (lay.rank_psum, ref.inclusive_psum(want.num_tokens_per_rank)),
                          (lay.expert_psum, ref.exclusive_psum(want.num_tokens_per_expert)),
                          (k._rank_cursor, np.zeros(r, np.int32))):
        got = to_host(got)
        assert got.dtype == np.asarray(expected).dtype
        np.testing.assert_array_equal(got, expected)
    if stable:
        num_units, units_per_warp = k.token_cut(topk.shape[0])
        unit_counts, group_counts = reference_cursors(want.is_token_in_rank, num_units, units_per_warp)
        np.testing.assert_array_equal(to_host(k._send_units)[:num_units], unit_counts)
        np.testing.assert_array_equal(to_host(k._send_groups)[:len(group_counts)], group_counts)


CASES = [  # tokens, topk, ranks, experts per rank, count warps, Kernels cut (blocks, warps per block), routing
    (0, 3, 3, 4, 32, (3, 2), {}),
    (1, 1, 1, 1, 32, (264, 8), {}),
    (1, 8, 8, 2, 2, (3, 2), {"masked": 0.5}),
    (13, 3, 2, 5, 4, (3, 2), {}),  # 10-token steps: units of 7 tokens, a short last step
    (33, 5, 4, 3, 3, (264, 8), {"masked": 0.3, "nowhere": 4}),  # one unit per step, groups split over warps
    (40, 8, 2, 35, 32, (3, 2), {"hot_expert": 5}),
    (57, 2, 8, 1, 5, (2, 2), {"masked": 0.2}),  # E = R: experts_per_rank 1
    (64, 4, 5, 7, 1, (4, 4), {}),  # a single warp walks every group
    (100, 6, 3, 4, 32, (264, 8), {"masked": 0.1}),
    (150, 7, 6, 3, 8, (5, 3), {"nowhere": 9, "masked": 0.15}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-K{c[1]}-R{c[2]}-L{c[3]}-w{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_count_matches_reference(xp, case, dtype):
    tokens, topk, ranks, local, warps, (blocks, per_block), routing = case
    experts = ranks * local
    rng = np.random.default_rng(tokens * 131 + topk)
    idx = random_routing(rng, tokens, topk, experts, **routing).astype(dtype)
    k = Kernels(xp, num_ranks=ranks, num_experts=experts, num_topk=topk, max_tokens=max(tokens, 1),
                num_blocks=blocks, warps_per_block=per_block, count_warps=warps)
    for stable in (True, False):
        check_count(k, idx, stable, idx)


def test_negative_and_oversized_ids_are_no_expert(xp):
    """Any negative id is "no expert", and so is an id at or above E (a captured dispatch checks it later)."""
    rng = np.random.default_rng(7)
    idx = random_routing(rng, 48, 4, 16, masked=0.0)
    idx[rng.random(idx.shape) < 0.2] = -7
    oversized = rng.random(idx.shape) < 0.1
    idx[oversized] = 16 + 3
    expected = np.where(oversized | (idx < 0), -1, idx)
    k = Kernels(xp, num_ranks=4, num_experts=16, num_topk=4, max_tokens=48, num_blocks=3, warps_per_block=2,
                count_warps=3)
    check_count(k, idx, True, expected)


def test_counts_repeat_after_other_routings(xp):
    """Nothing is left over from one count to the next (shared memory and outputs are rewritten)."""
    rng = np.random.default_rng(3)
    k = Kernels(xp, num_ranks=2, num_experts=8, num_topk=2, max_tokens=30, num_blocks=3, warps_per_block=2,
                count_warps=2)
    for tokens in (30, 0, 17, 30):
        idx = random_routing(rng, tokens, 2, 8, masked=0.2)
        check_count(k, idx, True, idx)


@cuda.jit
def rank_of_kernel(experts, divisors, out):
    for i in range(cuda.threadIdx.x, experts.shape[0], cuda.blockDim.x):
        d = np.int32(divisors[i])
        out[i] = rank_of(np.int32(experts[i]), d, np.float32(1) / np.float32(d))


def test_rank_of_divides_exactly(xp):
    rng = np.random.default_rng(0)
    divisors = np.concatenate([np.arange(1, 65), rng.integers(1, 5000, 64)]).astype(np.int32)
    divisors = np.repeat(divisors, 4)
    experts = (divisors * rng.integers(0, 2000, divisors.size) + rng.integers(-1, 2, divisors.size)).clip(0)
    experts[::4] = divisors[::4] * 3  # exact multiples, where the float quotient may land just below
    experts = experts.astype(np.int32)
    out = xp.zeros(experts.size, np.int32)
    rank_of_kernel[1, 32](xp.asarray(experts), xp.asarray(divisors), out)
    np.testing.assert_array_equal(to_host(out), experts // divisors)


def test_one_block_count_refuses_what_its_shared_memory_cannot_hold(xp):
    with pytest.raises(ValueError, match="shared memory"):
        Kernels(xp, num_ranks=256, num_experts=256, num_topk=8, max_tokens=8)
    with pytest.raises(ValueError, match="count_warps"):
        Kernels(xp, num_ranks=2, num_experts=8, num_topk=2, max_tokens=8, count_warps=33)
