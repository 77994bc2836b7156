"""The byte model of a routing on nodes (``ep_comm.contract.traffic``): exact rows per link for hand-built routings,
forwarded against flat, the uniform expectation against enumeration and sampling, the model time."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ep_comm.contract.layout import is_token_in_rank
from ep_comm.contract.topology import Topology
from ep_comm.contract.traffic import model_time_s, sent_rows, uniform_expectation, world_rows
from ep_comm.testing import uniform_routing

TOP = Topology.of(8, 4)  # nodes {0..3} and {4..7}
E = 16  # 2 experts per rank: expert e lives on rank e // 2


def _rows(topk_idx, src=1, topology=TOP, num_experts=E):
    """``{(op, route, link): [rows sent by each rank]}`` of :func:`sent_rows`."""
    rows = sent_rows(np.array(topk_idx, dtype=np.int64), src, num_experts, topology)
    return {(op, route, link): rows[i, j, k].tolist()
            for i, op in enumerate(("dispatch", "combine")) for j, route in enumerate(("flat", "forwarded"))
            for k, link in enumerate(("scaleup", "scaleout"))}


def _at(**rows):
    """A per-rank list of 8 with the given ``r<rank>=rows``."""
    out = [0] * 8
    for name, value in rows.items():
        out[int(name[1:])] = value
    return out


def test_tokens_to_ranks_of_the_own_node_go_over_scale_up_only_on_either_route():
    got = _rows([[0, 4, 6, -1], [2, 3, -1, -1]])  # ranks 0, 2, 3 (one row each); the second token stays on rank 1
    for route in ("flat", "forwarded"):
        assert got[("dispatch", route, "scaleup")] == _at(r1=3)
        assert got[("dispatch", route, "scaleout")] == [0] * 8
        assert got[("combine", route, "scaleup")] == _at(r0=1, r2=1, r3=1)
        assert got[("combine", route, "scaleout")] == [0] * 8


def test_a_token_to_several_ranks_of_one_remote_node_crosses_once_forwarded():
    got = _rows([[8, 10, 11, 14]])  # ranks 4, 5, 5, 7 of node 1; source 1's forwarder there is rank 5
    assert got[("dispatch", "flat", "scaleout")] == _at(r1=3)
    assert got[("dispatch", "flat", "scaleup")] == [0] * 8
    assert got[("dispatch", "forwarded", "scaleout")] == _at(r1=1)
    assert got[("dispatch", "forwarded", "scaleup")] == _at(r5=2)  # the forwarder stores to ranks 4 and 7
    assert got[("combine", "flat", "scaleout")] == _at(r4=1, r5=1, r7=1)
    assert got[("combine", "forwarded", "scaleup")] == _at(r4=1, r7=1)  # partials to the forwarder
    assert got[("combine", "forwarded", "scaleout")] == _at(r5=1)  # their sum, one row, crosses back


def test_masked_entries_self_and_a_forwarder_that_is_no_destination():
    got = _rows([[-1, -1, -1, -1], [0, 12, 3, -1]])  # nowhere; ranks 0, 6 and 1 itself (no link)
    assert got[("dispatch", "flat", "scaleup")] == _at(r1=1)
    assert got[("dispatch", "flat", "scaleout")] == _at(r1=1)
    assert got[("dispatch", "forwarded", "scaleout")] == _at(r1=1)  # to rank 5, which is not a destination
    assert got[("dispatch", "forwarded", "scaleup")] == _at(r1=1, r5=1)
    assert got[("combine", "flat", "scaleup")] == _at(r0=1)
    assert got[("combine", "flat", "scaleout")] == _at(r6=1)
    assert got[("combine", "forwarded", "scaleup")] == _at(r0=1, r6=1)
    assert got[("combine", "forwarded", "scaleout")] == _at(r5=1)  # the one partial of node 1, through rank 5


def test_world_rows_sum_the_sources():
    routings = [uniform_routing(32, E, 4, seed=(3, r)).topk_idx for r in range(8)]
    want = sum(sent_rows(idx, r, E, TOP) for r, idx in enumerate(routings))
    np.testing.assert_array_equal(world_rows(routings, E, TOP), want)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_forwarded_never_sends_more_over_scale_out_and_the_combine_as_much_as_the_dispatch(size):
    topology = Topology.of(8, size)
    routings = [uniform_routing(64, E, 4, seed=(size, r)).topk_idx for r in range(8)]
    rows = world_rows(routings, E, topology)
    flat_out, fwd_out = rows[0, 0, 1].sum(), rows[0, 1, 1].sum()
    assert fwd_out <= flat_out
    assert rows[1, 0, 1].sum() == flat_out  # flat, a partial crosses back for every row that crossed out
    assert rows[1, 1, 1].sum() == fwd_out  # forwarded, one summed row per token and remote node
    if size == 1:  # one rank per node: every forwarder is the destination itself
        np.testing.assert_array_equal(rows[:, 1], rows[:, 0])
    if size == 8:  # one node: nothing crosses scale-out
        assert not rows[:, :, 1].any()
    received = sum(is_token_in_rank(idx, E, 8).sum() - is_token_in_rank(idx, E, 8)[:, r].sum()
                   for r, idx in enumerate(routings))
    assert rows[0, 0].sum() == received  # flat: one row per (token, distinct destination rank other than its own)


def _enumerated(num_experts, topk, num_ranks, size):
    """Mean over every top-k set of the distinct destinations of a token of rank 0: (own node's other ranks, ranks
    of other nodes, other nodes)."""
    top, per_rank = Topology.of(num_ranks, size), num_experts // num_ranks
    sums = np.zeros(3)
    sets = list(itertools.combinations(range(num_experts), topk))
    for experts in sets:
        ranks = {e // per_rank for e in experts} - {0}
        sums += [sum(top.in_reach(0, r) for r in ranks), sum(not top.in_reach(0, r) for r in ranks),
                 len({top.node_of(r) for r in ranks} - {0})]
    return sums / len(sets)


@pytest.mark.parametrize("shape", [(8, 3, 4, 2), (12, 2, 6, 3), (6, 4, 3, 1)])
def test_uniform_expectation_equals_exact_enumeration(shape):
    assert uniform_expectation(*shape) == pytest.approx(_enumerated(*shape), abs=1e-12)


def test_uniform_expectation_of_deepseek_v3_on_two_nodes_of_four():
    got = uniform_expectation(256, 8, 8, 4)
    assert got.remote_nodes == pytest.approx(1 - math.comb(128, 8) / math.comb(256, 8))
    assert got.remote_node_ranks == pytest.approx(4 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert round(got.remote_nodes, 4) == 0.9965 and round(got.remote_node_ranks, 3) == 2.647
    assert got.remote_nodes <= got.remote_node_ranks / 2


def test_uniform_expectation_matches_sampled_routing():
    """40000 sampled tokens of rank 0: a per-token count within [0, m] has a standard deviation of at most m / 2, so
    the sample mean lies within 5 (m / 2) / sqrt(n) of the expectation but with probability below 1e-6."""
    n, top = 40000, Topology.of(8, 4)
    rows = sent_rows(uniform_routing(n, 256, 8, seed=7).topk_idx, 0, 256, top)
    want = uniform_expectation(256, 8, 8, 4)
    cases = ((rows[0, 0, 0, 0], want.in_node_ranks, 3), (rows[0, 0, 1, 0], want.remote_node_ranks, 4),
             (rows[0, 1, 1, 0], want.remote_nodes, 1), (rows[1, 1, 1].sum(), want.remote_nodes, 1))
    for got, expected, most in cases:
        assert got / n == pytest.approx(expected, abs=5 * most / 2 / math.sqrt(n))


@pytest.mark.parametrize("op", [0, 1])
def test_forwarding_deepseek_v3_prefill_on_two_nodes_of_four_sends_under_0_4_of_the_flat_scale_out_bytes(op):
    """Issue 39's bound, dispatch (op 0) and combine (op 1): 256 experts, top-8, uniform, 4096 tokens per rank."""
    routings = [uniform_routing(4096, 256, 8, seed=(0, r)).topk_idx for r in range(8)]
    rows = world_rows(routings, 256, Topology.of(8, 4))
    assert rows[op, 1, 1].sum() / rows[op, 0, 1].sum() <= 0.40


def test_model_time_is_the_slowest_link_of_the_slowest_rank():
    assert model_time_s(np.array([356_000, 0]), np.array([0, 50_000])) == pytest.approx(1e-6)
    assert model_time_s(np.array([356_000, 0]), np.array([0, 100_000])) == pytest.approx(2e-6)
    assert model_time_s(np.array([712_000]), np.array([0]), scaleup_gbps=712.0) == pytest.approx(1e-6)
