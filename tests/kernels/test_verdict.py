"""The routing verdict on the device: the count kernel checks its routing and sends the verdict with its counts;
the receive count reads every source's, receives nothing when any is bad, and writes the host-mapped record."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from world import World, kernel_world, random_routing, routing_verdict

from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host
from ep_comm.contract.checks import verdict_of, verdict_words
from ep_comm.contract.protocol import ID_CLAMP
from ep_comm.contract.symmetric import read_record, record_words
from ep_comm.kernels.routing_check import ACC_INIT
from ep_comm.kernels.routing_check import verdict_words as device_verdict_words
from ep_comm.launching.kernel_launches import Kernels

INT64_MAX = int(np.iinfo(np.int64).max)
EXPERTS = 64


@cuda.jit
def verdict_words_kernel(cases, out):
    i = cuda.grid(1)
    if i < cases.shape[0]:
        out[i, 0], out[i, 1] = device_verdict_words(cases[i, 0], cases[i, 1])


def test_the_device_encodes_verdicts_as_the_host_does():
    cases = np.array([(-1, -1), (0, -1), (15, 0), (ID_CLAMP - 2, 7), (ID_CLAMP - 1, -1), (ID_CLAMP, -1),
                      (2**40, 3), (INT64_MAX, 2**30)], np.int64)
    out = np.zeros(cases.shape, np.int32)
    verdict_words_kernel[1, 32](cases, out)
    assert out.tolist() == [list(verdict_words(top, twice)) for top, twice in cases.tolist()]


def count_kernels(xp, topk: int) -> Kernels:
    """Several count blocks for 100 tokens (one warp per unit, two warps per block, up to three blocks)."""
    return Kernels(xp, num_ranks=2, num_experts=EXPERTS, num_topk=topk, max_tokens=300, num_blocks=3,
                   warps_per_block=2, count_tokens_per_warp=1)


def routings(tokens: int, topk: int, dtype) -> list:
    """Clean and bad ``[tokens, topk]`` routings of ``EXPERTS`` experts, -1 entries among them."""
    clean = random_routing(np.random.default_rng(tokens + topk), tokens, topk, EXPERTS, masked=0.2).astype(dtype)
    cases = [clean, np.full((tokens, topk), -1, dtype)]
    out_of_range = clean.copy()
    out_of_range[tokens // 2, 0] = 99
    out_of_range[0, topk - 1] = EXPERTS  # the first id past the end, in the first block
    cases.append(out_of_range)
    if topk > 1:
        repeated = clean.copy()
        repeated[tokens - 1, :2] = [7, 7]  # the last row, and an earlier one in another block
        repeated[tokens // 3, topk - 2:] = [5, 5]
        cases.append(repeated)
        both = out_of_range.copy()
        both[tokens - 1, :2] = [70, 70]  # a repeated id out of range is a repeat too
        cases.append(both)
    if dtype == np.int64:
        huge = clean.copy()
        huge[tokens - 1, 0] = INT64_MAX  # ids past ID_CLAMP travel clamped
        huge[0, 0] = 2**40
        cases.append(huge)
    return cases


@pytest.mark.parametrize("topk", [1, 3, 8, 32])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tokens", [1, 7, 100])
def test_count_sends_the_routing_verdict_with_its_counts(xp, topk, dtype, tokens):
    """Every row of the count words ends in the routing's verdict words (the host rule, encoded), clean or bad,
    over one block or several, launch after launch (the accumulator is back at its start after each); ids out
    of range count as no expert."""
    k = count_kernels(xp, topk)
    for case in routings(tokens, topk, dtype) * 2:
        words = to_host(k.count(xp.asarray(case), stable=True, stream=0).count_words)
        inside = np.where(case < EXPERTS, case, -1)
        counts = ref.send_count_words(ref.dispatch_layout(inside, EXPERTS, 2))
        np.testing.assert_array_equal(words, np.concatenate([counts, [routing_verdict(case)] * 2], axis=1))
        assert to_host(k._work.check_acc).tolist() == list(ACC_INIT) and not to_host(k._work.ticket).any()


def test_a_huge_id_travels_clamped(xp):
    k = count_kernels(xp, 2)
    case = np.array([[0, INT64_MAX], [3, 4]], np.int64)
    words = to_host(k.count(xp.asarray(case), stable=False, stream=0).count_words)
    assert words[:, -2:].tolist() == [[ID_CLAMP, 0]] * 2
    assert verdict_of(words[0, -2:]) == (ID_CLAMP - 1, -1)


def receive_kernels(xp, world: World) -> Kernels:
    """Kernels whose expand receive count runs on several blocks (many units of few rows)."""
    return Kernels(xp, num_ranks=world.num_ranks, num_experts=world.num_experts, num_topk=world.num_topk,
                   max_tokens=world.max_tokens, num_blocks=3, warps_per_block=2, recv_units=16,
                   recv_rows_per_unit=2, recv_count_warps_per_block=2)


def new_record(xp, world: World):
    return xp.full(record_words(world.num_ranks, world.local), -5, np.int64)


MODES = [(False, False), (False, True), (True, False), (True, True)]
MODE_IDS = ["compact", "compact-stable", "expand", "expand-stable"]


@pytest.mark.parametrize("expand, stable", MODES, ids=MODE_IDS)
def test_receive_count_writes_the_record(xp, expand, stable):
    """A clean receive count matches the reference and writes its record: the step number, N, M, every source's
    verdict words, the aligned counts."""
    world = kernel_world(xp, seed=5, tokens=(10, 13, 0), masked=0.2)
    world.kernels = receive_kernels(xp, world)
    sent = world.send(1, deterministic=stable)
    for d in range(world.num_ranks):
        record = new_record(xp, world)
        got = world.kernels.receive_count(world.views[d].counts, world.views[d].meta, world.step(1), alignment=4,
                                          expand=expand, stable=stable, record=record, stream=0)
        want = ref.receive_layout(world.expected_compact(d, sent)["local"], world.local, 4, expand)
        per_source = world.expected_compact(d, sent)["per_source"]
        tag, n, m, verdicts, aligned = read_record(to_host(record), world.num_ranks, world.local)
        assert (tag, n, m) == (5, per_source.sum(), want.num_expanded_tokens)
        assert verdicts == [verdict_of(routing_verdict(topk)) for topk in world.topk]
        assert aligned == want.num_aligned_per_expert.tolist() == to_host(got.num_aligned_per_expert).tolist()
        np.testing.assert_array_equal(to_host(got.rank_psum), ref.inclusive_psum(per_source))
        np.testing.assert_array_equal(to_host(got.expert_psum), want.psum_per_expert)


@pytest.mark.parametrize("expand, stable", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("bad", [verdict_words(12, -1), verdict_words(3, 4), verdict_words(INT64_MAX, 0)],
                         ids=["id-out-of-range", "repeated", "both"])
def test_a_bad_verdict_of_any_source_empties_every_receive(xp, expand, stable, bad):
    """When one source's verdict is bad, every receiver counts nothing (psums, counts, totals all 0), its record
    says so with every source's verdict, and the copy that follows copies no row: worst-case outputs get only
    their -1 tails; the next clean step receives as usual."""
    world = kernel_world(xp, seed=9, tokens=(10, 13, 7), masked=0.1)
    world.kernels = receive_kernels(xp, world)
    world.send(0, deterministic=stable)
    world.exchange_counts(0, 1, ref.send_count_words(ref.dispatch_layout(world.topk[1], world.num_experts, 3)),
                          bad)
    verdicts = [verdict_of(routing_verdict(topk)) for topk in world.topk]
    verdicts[1] = verdict_of(bad)
    for d in range(world.num_ranks):
        record = new_record(xp, world)
        got = world.kernels.receive_count(world.views[d].counts, world.views[d].meta, world.step(0), alignment=2,
                                          expand=expand, stable=stable, record=record, stream=0)
        assert all(not to_host(a).any() for a in got)
        assert read_record(to_host(record), 3, world.local) == (4, 0, 0, verdicts, [0] * world.local)
        out = world.receive(d, 0, expand=expand, alignment=2, zero_padding=True, deterministic=stable,
                            worst_case=True)
        assert (out.recv_x == 3).all() and (out.recv_topk_idx == -1).all() and not out.recv_topk_weights.any()
        assert (out.recv_src_metadata == -1).all()
    assert not to_host(world.kernels._work.counters).any() and not to_host(world.kernels._work.ticket).any()
    sent = world.send(1, deterministic=stable)
    for d in range(world.num_ranks):
        got = world.kernels.receive_count(world.views[d].counts, world.views[d].meta, world.step(1), alignment=2,
                                          expand=expand, stable=stable, stream=0)
        assert int(to_host(got.totals)[0]) == len(world.arrivals(d, sent))
