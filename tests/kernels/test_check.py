"""The routing check kernel against ``ep_comm.contract.checks``'s array code: largest id, first repeated row."""
from __future__ import annotations

import numpy as np
import pytest

from ep_comm.contract.arrays import to_host
from ep_comm.contract.checks import topk_values
from ep_comm.launching.kernel_launches import Kernels
from ep_comm.testing.routing import make_routing, mask_routing


def kernels(xp, topk: int) -> Kernels:
    return Kernels(xp, num_ranks=2, num_experts=16, num_topk=topk, max_tokens=300, num_blocks=3, warps_per_block=2)


def routing(seed: int, tokens: int, topk: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = make_routing("uniform", tokens, 16, topk, seed=rng, idx_dtype=dtype).topk_idx
    return mask_routing(idx, rng, entry_rate=0.2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_check_matches_the_array_code_and_resets_between_launches(xp, dtype, tokens):
    k = kernels(xp, 4)
    clean = routing(tokens, tokens, 4, dtype)
    bad = clean.copy()
    bad[tokens // 2, 0] = 99  # out of range
    if tokens > 2:
        bad[tokens - 1, 1:3] = [7, 7]  # a repeat, and one more at an earlier row
        bad[2, 2:4] = [5, 5]
    bad[-1, 0] = -1
    for case in (clean, bad, clean, np.full((tokens, 4), -1, dtype)):
        got = to_host(k.check_routing(xp.asarray(case), stream=0)).tolist()
        assert got == list(topk_values(np, case)), case


def test_masked_repeats_are_not_repeats(xp):
    k = kernels(xp, 3)
    case = np.array([[-1, -1, 3], [4, -1, -1], [2, 2, -1]], np.int64)
    assert to_host(k.check_routing(xp.asarray(case), stream=0)).tolist() == [4, 2]


def test_folded_checks_keep_the_worst_result_until_reset(xp):
    """``into``: the sticky record of checks nobody reads at once (captured dispatches)."""
    k = kernels(xp, 3)
    record = xp.asarray(np.array([-1, -1], np.int64))
    clean = np.array([[0, 1, 2], [3, -1, 4]], np.int64)
    assert k.check_routing(xp.asarray(clean), into=record, stream=0) is record
    assert to_host(record).tolist() == [4, -1]
    k.check_routing(xp.asarray(np.array([[40, 1, 1], [3, 3, 2], [0, 1, 2]], np.int64)), into=record, stream=0)
    assert to_host(record).tolist() == [40, 0]
    k.check_routing(xp.asarray(clean), into=record, stream=0)
    assert to_host(record).tolist() == [40, 0]
    assert to_host(k.check_routing(xp.asarray(clean), stream=0)).tolist() == [4, -1]  # the accumulator was reset
