"""The forwarded combine's order (docs/design.md, "Combine") as ``ep_comm.testing.forwarded`` states it, in one
process: one node is the flat order, a node of one rank adds its partial unchanged, and a remote node's partials
are summed and rounded before the source adds them, at the place of the node's first rank."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep_comm.testing import Forwarded, expected_round_trip, forwarded_combine, random_payload, uniform_routing

BF16 = np.dtype(ml_dtypes.bfloat16)
R, E, K, T, H = 8, 32, 6, 40, 16


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    idx = uniform_routing(T, E, K, seed=seed).topk_idx
    idx[rng.random(idx.shape) < 0.2] = -1
    x = random_payload(rng, (T, H), BF16, 0.1)
    bias = random_payload(rng, (T, H), BF16, 0.1)
    return idx, x, bias


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("source", [0, 5])
def test_one_node_and_nodes_of_one_rank_give_the_flat_bytes(expand, source):
    idx, x, bias = _inputs(source)
    flat = expected_round_trip(x, idx, E, R, expand, bias_terms=(bias,))
    for scaleup_ranks in (R, 1):
        got = expected_round_trip(x, idx, E, R, expand, bias_terms=(bias,), forwarded=Forwarded(source, scaleup_ranks))
        assert _bits(got) == _bits(flat), scaleup_ranks


def _one_token(values: dict) -> tuple:
    """Partials ``[1, 1]`` bfloat16 of ranks 0..3 (``values[rank]``, the ranks the token reached) and ``reached``."""
    partials = [np.array([[values.get(r, 0.0)]], dtype=BF16) for r in range(4)]
    reached = np.array([[r in values for r in range(4)]])
    return partials, reached


def test_a_remote_node_is_rounded_before_the_source_adds_it():
    """Source 0 in nodes {0, 1} and {2, 3}: flat, 2**-8 + 1 + 2**-8 = 1 + 2**-7 is exact in bfloat16; forwarded,
    node 1's 1 + 2**-8 rounds to 1 (a tie, to even), and so does 2**-8 + 1 at the source."""
    partials, reached = _one_token({1: 2.0**-8, 2: 1.0, 3: 2.0**-8})
    flat = forwarded_combine(partials, reached, Forwarded(0, 4))
    forwarded = forwarded_combine(partials, reached, Forwarded(0, 2))
    assert float(flat[0, 0]) == 1 + 2.0**-7
    assert float(forwarded[0, 0]) == 1.0


def test_a_remote_node_takes_the_place_of_its_first_rank():
    """Source 3 (node {2, 3}): node {0, 1}'s sum comes first, rounded (1 + 2**-8 to 1), then ranks 2 and 3 one by one
    in float32: 1 + 2**-7, exact in bfloat16. Flat, 1 + 3 * 2**-8 is a tie between 1 + 2**-7 and 1 + 2**-6 and rounds
    to the even one."""
    partials, reached = _one_token({0: 1.0, 1: 2.0**-8, 2: 2.0**-8, 3: 2.0**-8})
    assert float(forwarded_combine(partials, reached, Forwarded(3, 2))[0, 0]) == 1 + 2.0**-7
    assert float(forwarded_combine(partials, reached, Forwarded(3, 4))[0, 0]) == 1 + 2.0**-6
