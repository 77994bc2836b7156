"""Dispatch kernels (count, rank scatter, receive) against the NumPy reference, R ranks simulated."""
from __future__ import annotations

import numpy as np
import pytest
from dispatch_checks import check_compact, check_expand, run_dispatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from world import MAX_TOKENS, World, kernel_world, random_payload, routing_verdict, spy_launches, with_verdict

from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host
from ep_comm.launching import launch_shapes
from ep_comm.launching.kernel_launches import PLACE_CACHED, PLACE_STABLE, SLOT_ATOMIC, SLOT_CACHED, Kernels


def check_count(world: World, deterministic: bool) -> None:
    for s in range(world.num_ranks):
        lay = world.kernels.count(world.dev(world.topk[s]), stable=deterministic, stream=0)
        want = ref.dispatch_layout(world.topk[s], world.num_experts, world.num_ranks)
        np.testing.assert_array_equal(to_host(lay.num_tokens_per_rank), want.num_tokens_per_rank)
        np.testing.assert_array_equal(to_host(lay.num_tokens_per_expert), want.num_tokens_per_expert)
        np.testing.assert_array_equal(to_host(lay.is_token_in_rank), want.is_token_in_rank)
        np.testing.assert_array_equal(to_host(lay.rank_psum), ref.inclusive_psum(want.num_tokens_per_rank))
        np.testing.assert_array_equal(to_host(lay.expert_psum), ref.exclusive_psum(want.num_tokens_per_expert))
        np.testing.assert_array_equal(to_host(lay.count_words), with_verdict(ref.send_count_words(want),
                                                                             routing_verdict(world.topk[s])))


@pytest.mark.parametrize("case", [
    dict(),
    dict(hot_expert=5, masked=0.0),
    dict(nowhere=4, masked=0.3),
    # > 32 experts and ranks' chunks, several groups per unit
    dict(ranks=2, experts=70, topk=8, tokens=(40, 1), max_tokens=40),
    # more ranks than lanes: a token's in_rank row is cleared by its K lanes, several ranks each
    dict(ranks=33, experts=66, topk=4, tokens=(30,) + (1,) * 32, max_tokens=30),
])
def test_count_matches_reference_and_leaves_workspace_clean(xp, case):
    world = kernel_world(xp, **case)
    check_count(world, deterministic=True)
    check_count(world, deterministic=False)  # counters and ticket were reset by the last block
    assert not to_host(world.kernels._work.counters).any() and not to_host(world.kernels._work.ticket).any()


@pytest.mark.parametrize("deterministic", [True, False])
def test_decode_count_on_many_blocks(xp, deterministic):
    """The decode cut (``count_min_warps``): one unit per count warp, over several blocks whose shared histograms
    meet in the last block; the same counts, words and stable slots as the reference (and so as one block)."""
    world = kernel_world(xp, seed=7, ranks=2, experts=64, topk=8, tokens=(128, 96), max_tokens=128, masked=0.05)
    k = world.kernels = Kernels(xp, num_ranks=2, num_experts=64, num_topk=8, max_tokens=128, num_blocks=8,
                                warps_per_block=4, recv_rows_per_unit=16)
    num_units, units_per_warp = k.token_cut(128)
    assert (num_units, units_per_warp) == (32, 1) and k._blocks_for(num_units, k.num_blocks) == 8
    assert Kernels(np, num_ranks=2, num_experts=64, num_topk=8, max_tokens=128, count_min_warps=0).token_cut(128) \
        == (32, 4)  # the old cut: 8 warps, one block
    check_count(world, deterministic)
    assert not to_host(k._work.counters).any() and not to_host(k._work.ticket).any()
    run_dispatch(world, deterministic=deterministic, expand=False)


def test_decode_count_on_one_wide_block(xp, monkeypatch):
    """``count_warps_per_block``: the decode count on one block of 16 warps (two warp steps each, no cross-block
    combine), the scatter on the same cut: the reference's counts and stable slots."""
    world = kernel_world(xp, seed=8, ranks=2, experts=64, topk=8, tokens=(128, 64), max_tokens=128, masked=0.05)
    k = world.kernels = Kernels(xp, num_ranks=2, num_experts=64, num_topk=8, max_tokens=128, num_blocks=8,
                                warps_per_block=4, recv_rows_per_unit=16, count_min_warps=16, count_warps_per_block=16)
    from ep_comm.kernels.count import count_kernel

    shapes, launch = [], k._launch

    def spy(kernel, stream, shared_bytes=0, blocks=0, warps_per_block=0):
        if kernel is count_kernel:
            shapes.append((blocks, warps_per_block))
        return launch(kernel, stream, shared_bytes, blocks, warps_per_block)

    monkeypatch.setattr(k, "_launch", spy)
    assert k.token_cut(128) == (32, 2)
    check_count(world, deterministic=True)
    assert shapes[0] == (1, 16)
    run_dispatch(world, deterministic=True, expand=False)
    with pytest.raises(ValueError, match="count_warps_per_block=17"):
        Kernels(np, num_ranks=2, num_experts=64, num_topk=8, max_tokens=128, count_warps_per_block=17)


def test_column_sum_over_any_number_of_sources():
    from ep_comm.kernels.numba_internals import ENABLE_CUDASIM
    from ep_comm.kernels.receive_count import column_sum

    if not ENABLE_CUDASIM:
        pytest.skip("a device function: called from Python in the simulator only")
    words = np.arange(9 * 5, dtype=np.int64).reshape(9, 5)
    for n in range(10):
        assert column_sum(words, 2, n) == words[:n, 2].sum()


def test_indices_must_fit_32_bits():
    with pytest.raises(ValueError, match=r"num_ranks \* num_max_tokens_per_rank \* \(num_topk \+ 2\) = 1024 \* "
                                         r"131072 \* \(6 \+ 2\) = 1073741824: must be below 2\*\*30"):
        Kernels(np, num_ranks=2**10, num_experts=2**10, num_topk=6, max_tokens=2**17)
    Kernels(np, num_ranks=2**10, num_experts=2**10, num_topk=6, max_tokens=2**17 - 1)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compact_dispatch(xp, deterministic, dtype):
    run_dispatch(kernel_world(xp, seed=1, dtype=dtype), deterministic=deterministic, expand=False)


@pytest.mark.parametrize("deterministic", [True, False])
def test_expand_dispatch_aligned_zero_padded(xp, deterministic):
    world = kernel_world(xp, seed=2, dtype="float16", hidden=11, masked=0.2)  # odd row bytes: 16-bit words
    run_dispatch(world, deterministic=deterministic, expand=True, alignment=4, zero_padding=True)


def test_expand_dispatch_many_experts_and_worst_case_outputs(xp):
    world = kernel_world(xp, seed=3, ranks=2, experts=70, topk=8, tokens=(40, 17), hot_expert=3, nowhere=2,
                       max_tokens=40)
    run_dispatch(world, deterministic=True, expand=True, alignment=8, zero_padding=True, worst_case=True)


def test_compact_worst_case_tail_and_parity_zero(xp):
    world = kernel_world(xp, seed=4, weights=False)
    run_dispatch(world, deterministic=True, expand=False, worst_case=True, parity=0)


def test_zero_tokens_everywhere(xp):
    world = kernel_world(xp, tokens=(0, 0, 0))
    run_dispatch(world, deterministic=True, expand=True, alignment=2, zero_padding=True)


@pytest.mark.parametrize("ranks, experts, tokens, alignment, missing", [
    (1, 4, (9,), 1, None),
    (1, 4, (0,), 4, None),  # nothing sent
    (2, 70, (40, 1), 8, None),  # 35 local experts: more than a warp
    (2, 12, (10, 13), 2, 1),
    (3, 12, (10, 13, 0), 1, None),  # a source with zero rows
    (3, 12, (10, 13, 7), 4, 0),
    (6, 12, (3, 5, 0, 7, 2, 4), 2, None),  # the per-expert sums load four sources at a time: one and a half steps
], ids=["1-rank", "1-rank-empty", "2-ranks-35-local", "2-ranks-missing", "3-ranks-zero-rows", "3-ranks-missing",
        "6-ranks"])
def test_compact_receive_count_reads_only_the_count_words(xp, monkeypatch, ranks, experts, tokens, alignment,
                                                          missing):
    """Compact mode counts from the ``[R, 1 + L]`` count words alone, in one single-block launch: rank psum,
    unaligned and aligned counts per local expert, the compact expert psum and the totals are the reference's
    for the rows received, with every received meta row overwritten first; a missing source's block, zeroed
    as the wait does, counts as a source that sent nothing."""
    from ep_comm.kernels.receive_count import receive_count_words_kernel

    world = kernel_world(xp, seed=31, ranks=ranks, experts=experts, topk=3, tokens=tokens, masked=0.2,
                       max_tokens=40)
    sent = world.send(1, deterministic=True)
    launched = spy_launches(monkeypatch)
    for d in range(ranks):
        if missing is not None:
            world.views[d].counts[1, missing] = 0
        world.views[d].meta[...] = -7  # not read
        got = world.kernels.receive_count(world.views[d].counts, world.views[d].meta, world.step(1),
                                          alignment=alignment, expand=False, stable=True, stream=0)
        arrivals = world.arrivals(d, sent)
        keep = [i for i, (s, _, _) in enumerate(arrivals) if s != missing]
        local = world.expected_compact(d, sent)["local"][keep]
        per_source = np.bincount([arrivals[i][0] for i in keep], minlength=ranks)
        want = ref.receive_layout(local, world.local, alignment, expand=False)
        np.testing.assert_array_equal(to_host(got.rank_psum), ref.inclusive_psum(per_source))
        np.testing.assert_array_equal(to_host(got.num_unaligned_per_expert), want.num_unaligned_per_expert)
        np.testing.assert_array_equal(to_host(got.num_aligned_per_expert), want.num_aligned_per_expert)
        np.testing.assert_array_equal(to_host(got.expert_psum), want.psum_per_expert)
        np.testing.assert_array_equal(to_host(got.totals), [len(keep), want.num_expanded_tokens])
    assert launched == [receive_count_words_kernel] * ranks


@pytest.mark.parametrize("ranks, experts, tokens, alignment, bad", [
    (1, 4, (9,), 2, None),
    (3, 12, (10, 13, 0), 4, None),  # a source with zero rows
    (2, 70, (40, 1), 8, None),  # 35 local experts: more than a warp
    (3, 12, (10, 13, 7), 1, 1),  # a bad verdict: nothing is received
], ids=["1-rank", "3-ranks", "2-ranks-35-local", "3-ranks-bad-verdict"])
def test_a_compact_receive_counts_in_its_copy(xp, monkeypatch, ranks, experts, tokens, alignment, bad):
    """``Kernels.receive_counted``, the compact receive count and copy of a new routing in one launch: its counts, its
    record and its worst-case outputs are every byte those of ``receive_count`` then ``receive_copy``."""
    from ep_comm.contract.symmetric import record_words
    from ep_comm.kernels.receive import receive_counted_compact_kernel

    world = kernel_world(xp, seed=33, ranks=ranks, experts=experts, topk=3, tokens=tokens, masked=0.2, max_tokens=40)
    world.send(1, deterministic=True)
    if bad is not None:
        words = ref.send_count_words(ref.dispatch_layout(world.topk[bad], experts, ranks))
        world.exchange_counts(1, bad, words, (experts + 2, 0))
    k, step = world.kernels, world.step(1)
    for d in range(ranks):
        view = world.views[d]
        before, after = (world.outputs(expand=False, alignment=alignment, worst_case=True, num_rows=0,
                                       num_expanded=0) for _ in range(2))
        records = [xp.full(record_words(ranks, world.local), -5, np.int64) for _ in range(2)]
        counts = k.receive_count(view.counts, view.meta, step, alignment=alignment, expand=False, stable=True,
                                 record=records[0], stream=0)
        k.receive_copy(counts.rank_psum, view.rows, view.meta, step, *before, expand=False, mode=PLACE_STABLE,
                       expert_psum=counts.expert_psum, alignment=alignment, zero_padding=False, stream=0)
        launched = spy_launches(monkeypatch)
        got = k.receive_counted(view.counts, view.rows, view.meta, step, *after, alignment=alignment,
                                record=records[1], stream=0)
        assert launched == [receive_counted_compact_kernel]
        for a, b in zip((*counts, *before, records[0]), (*got, *after, records[1])):
            np.testing.assert_array_equal(to_host(a).view(np.uint8), to_host(b).view(np.uint8))
        assert (int(to_host(got.totals)[0]) == 0) == (bad is not None or not sum(tokens))


@pytest.mark.parametrize("apart", [True, False], ids=["count-apart", "legacy"])
def test_the_counted_receive_gives_the_count_a_block_of_its_own(xp, monkeypatch, apart):
    """``Kernels.receive_counted`` launches the compact copy's grid and one block more, whose block 0 counts while the
    others copy (its bytes: the test above); with ``EP_COMM_KERNEL_LEGACY=count_apart`` the copy's grid alone."""
    from ep_comm.kernels import switches
    from ep_comm.kernels.receive import receive_compact_kernel, receive_counted_compact_kernel

    monkeypatch.setattr(switches, "LEGACY", frozenset() if apart else frozenset({"count_apart"}))
    world = kernel_world(xp, seed=34, ranks=2, experts=8, topk=2, tokens=(12, 5), max_tokens=40)
    world.send(1, deterministic=True)
    k, step, view = world.kernels, world.step(1), world.views[0]
    grids = {}
    launch = Kernels._launch

    def spy(self, kernel, stream, shared_bytes=0, blocks=0, warps_per_block=0):
        grids[kernel] = blocks
        return launch(self, kernel, stream, shared_bytes, blocks, warps_per_block)

    monkeypatch.setattr(Kernels, "_launch", spy)
    outputs = world.outputs(expand=False, alignment=1, worst_case=True, num_rows=0, num_expanded=0)
    counts = k.receive_counted(view.counts, view.rows, view.meta, step, *outputs, alignment=1, stream=0)
    k.receive_copy(counts.rank_psum, view.rows, view.meta, step, *outputs, expand=False, mode=PLACE_STABLE,
                   expert_psum=counts.expert_psum, alignment=1, zero_padding=False, stream=0)
    assert grids[receive_counted_compact_kernel] == grids[receive_compact_kernel] + (1 if apart else 0)


@pytest.mark.parametrize("expand", [False, True])
def test_cached_dispatch_replays_the_routing(xp, expand):
    world = kernel_world(xp, seed=5, hot_expert=1)
    sent, first = run_dispatch(world, deterministic=False, expand=expand, alignment=2, zero_padding=True)
    rng = np.random.default_rng(9)
    world.x = [random_payload(rng, x.shape, x.dtype) for x in world.x]
    for buf in world.buffers:
        buf[...] = 0
    world.send(0, deterministic=False, cached=[item.slot_idx for item in sent])
    for d in range(world.num_ranks):
        again = world.receive(d, 0, expand=expand, alignment=2, zero_padding=True, deterministic=False,
                              cached=first[d])
        want = world.expected_compact(d, sent)
        np.testing.assert_array_equal(again.recv_src_metadata, first[d].recv_src_metadata)
        np.testing.assert_array_equal(again.recv_topk_idx, first[d].recv_topk_idx)
        if expand:
            check_expand(world, d, again, want, 2, True, deterministic=False)
        else:
            check_compact(world, d, again, want)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), ranks=st.sampled_from([1, 2, 4]), topk=st.sampled_from([1, 2, 5]),
       alignment=st.sampled_from([1, 3]), deterministic=st.booleans())
def test_random_routings(xp, seed, ranks, topk, alignment, deterministic):
    tokens = tuple(np.random.default_rng(seed).integers(0, MAX_TOKENS + 1, size=ranks))
    world = kernel_world(xp, seed=seed, ranks=ranks, experts=4 * ranks + 4 * (ranks == 1), topk=topk, hidden=6,
                       tokens=tokens, masked=0.25)
    run_dispatch(world, deterministic=deterministic, expand=True, alignment=alignment, zero_padding=True)


@pytest.mark.parametrize("dtype, hidden", [("bfloat16", 2600), ("float16", 2601)])
@pytest.mark.parametrize("own_slots", [True, False], ids=["slots-in-rows", "slots-first"])
def test_scatter_cuts_long_rows_into_pieces(xp, monkeypatch, dtype, hidden, own_slots):
    """Few tokens with long rows (650 wide words, or 2601 narrow ones): one warp per piece of a row copies it (the
    last piece shorter), each taking its entry's stable slot itself (one launch), or with
    ``EP_COMM_KERNEL_LEGACY=slots_in_rows`` after a launch that assigns slots by unit (atomic ones without
    ``deterministic``); stable, any-order and cached dispatches stay bit for bit the reference."""
    from ep_comm.kernels.scatter import scatter_kernel, scatter_rows_kernel

    if not own_slots:
        monkeypatch.setattr(launch_shapes, "legacy", lambda name: name == "slots_in_rows")
    world = kernel_world(xp, seed=17, dtype=dtype, hidden=hidden, tokens=(5, 3, 1), masked=0.2)
    world.kernels.split_warps = 64
    launched = spy_launches(monkeypatch)
    run_dispatch(world, deterministic=True, expand=True, alignment=2, zero_padding=True)
    sent, first = run_dispatch(world, deterministic=False, expand=False, parity=0)
    slot_launches = 0 if own_slots else 2 * world.num_ranks
    assert launched.count(scatter_kernel) == slot_launches
    assert launched.count(scatter_rows_kernel) == 2 * world.num_ranks
    for buf in world.buffers:
        buf[...] = 0
    world.send(1, deterministic=False, cached=[item.slot_idx for item in sent])
    assert launched.count(scatter_kernel) == slot_launches
    assert launched.count(scatter_rows_kernel) == 3 * world.num_ranks
    for d in range(world.num_ranks):
        again = world.receive(d, 1, expand=False, alignment=1, zero_padding=False, deterministic=False,
                              cached=first[d])
        check_compact(world, d, again, world.expected_compact(d, sent))


def decode_world(xp) -> World:
    """Two ranks of 40 and 27 tokens with rows of 301 16-bit words cut into two pieces, on a token cut of one warp step
    per unit (16 tokens, top-2) and two units per count group: 3 units in 2 groups at T=40."""
    world = kernel_world(xp, seed=41, ranks=2, experts=8, topk=2, dtype="float16", hidden=301, tokens=(40, 27),
                         max_tokens=40, masked=0.1)
    world.kernels = Kernels(xp, num_ranks=2, num_experts=8, num_topk=2, max_tokens=40, num_blocks=2, warps_per_block=2,
                            count_tokens_per_warp=32, count_min_warps=0, recv_rows_per_unit=4, split_warps=160)
    return world


def test_stable_slots_where_the_row_pieces_take_them(monkeypatch):
    """``slots_with_rows``: at most ``split_warps // 2`` entries (their rows are cut) and units of one warp step at
    most; there a new routing counts for stable slots whatever ``deterministic`` says (``send_stable``), not at
    prefill, nor with ``EP_COMM_KERNEL_LEGACY=slots_in_rows``."""
    k = Kernels(np, num_ranks=2, num_experts=64, num_topk=8, max_tokens=4096)  # 2112 units, split_warps 4224
    assert k.slots_with_rows(128) and k.send_stable(128, False)  # decode: 1024 entries
    assert k.slots_with_rows(264) and not k.slots_with_rows(265)  # 2112 entries, then 2120
    assert not k.slots_with_rows(0) and not k.send_stable(4096, False) and k.send_stable(4096, True)
    few_units = Kernels(np, num_ranks=2, num_experts=64, num_topk=8, max_tokens=64, num_blocks=1, warps_per_block=2,
                        split_warps=1000)
    assert few_units.slots_with_rows(8) and not few_units.slots_with_rows(9)  # 2 units: 4 tokens each, then 5
    monkeypatch.setattr(launch_shapes, "legacy", lambda name: name == "slots_in_rows")
    assert not k.slots_with_rows(128) and not k.send_stable(128, False) and k.send_stable(128, True)


@pytest.mark.parametrize("deterministic", [True, False])
def test_row_pieces_take_their_stable_slots_across_units_and_groups(xp, monkeypatch, deterministic):
    """Decode's scatter in one launch: every piece's warp takes its entry's stable slot from its unit's start in its
    count group and the group's start (units after the first of a group, groups after the first), with or without
    ``deterministic``; the slots and every byte of the symmetric buffers are those of the two launches before
    (``EP_COMM_KERNEL_LEGACY=slots_in_rows``: slots by unit, then the row pieces; stable ones there too), and the
    received outputs the reference's."""
    from ep_comm.kernels.scatter import scatter_kernel, scatter_rows_kernel

    new = decode_world(xp)
    assert new.kernels.token_cut(40) == (3, 2) and new.kernels.slots_with_rows(40)
    launched = spy_launches(monkeypatch)
    sent = run_dispatch(new, deterministic=deterministic, expand=False)[0]
    assert scatter_kernel not in launched and launched.count(scatter_rows_kernel) == 2
    monkeypatch.setattr(launch_shapes, "legacy", lambda name: name == "slots_in_rows")
    old = decode_world(xp)
    assert not old.kernels.slots_with_rows(40)
    before = run_dispatch(old, deterministic=True, expand=False)[0]
    assert launched.count(scatter_kernel) == 2
    for a, b in zip(sent, before):
        np.testing.assert_array_equal(a.slot_idx, b.slot_idx)
    for a, b in zip(new.buffers, old.buffers):
        np.testing.assert_array_equal(to_host(a), to_host(b))


@pytest.mark.parametrize("dtype, hidden, tokens, split_warps, wide, cut", [
    ("float32", 20, (10, 13, 0), 0, True, False),  # 10 64-bit words: wide, whole rows
    ("bfloat16", 20, (10, 13, 0), 0, False, False),  # 5 64-bit words: odd, so narrow
    ("float16", 11, (10, 13, 0), 0, False, False),  # 11 16-bit words
    ("bfloat16", 2600, (5, 3, 1), 1024, True, True),  # 650 wide words: a piece of 512 and one of 138
    ("float16", 2601, (5, 3, 1), 1024, False, True),  # 2601 16-bit words: pieces of 256, the last of 41
    ("float32", 20, (0, 0, 0), 0, True, False),  # N = 0
], ids=["f32-wide", "bf16-narrow", "f16-narrow", "bf16-wide-pieces", "f16-narrow-pieces", "nothing"])
@pytest.mark.parametrize("worst_case", [False, True], ids=["exact", "worst-case"])
def test_compact_receive_is_one_launch(xp, monkeypatch, dtype, hidden, tokens, split_warps, wide, cut, worst_case):
    """A compact receive is one launch of ``receive_compact_kernel`` (rows whole or in pieces, wide or
    narrow): payload, ids, weight bits and metadata bit for bit the reference, and with worst-case
    outputs (``cpu_sync=False``) the tail past N marked -1 with zero weight bits."""
    from ep_comm.kernels.receive import receive_compact_kernel
    from ep_comm.kernels.receive_count import receive_count_words_kernel

    world = kernel_world(xp, seed=21, dtype=dtype, hidden=hidden, tokens=tokens, masked=0.2)
    world.kernels.split_warps = split_warps or world.kernels.split_warps
    sent = world.send(1, deterministic=True)
    launches = []
    launched = spy_launches(monkeypatch, launches)
    for d in range(world.num_ranks):
        got = world.receive(d, 1, expand=False, alignment=1, zero_padding=False, deterministic=True,
                            worst_case=worst_case)
        want = world.expected_compact(d, sent)
        check_compact(world, d, got, want)
        n = len(want["x"])
        assert (len(got.recv_x) > n) == worst_case
        assert not got.recv_topk_weights[n:].view(np.uint32).any()
    assert set(launched) == {receive_count_words_kernel, receive_compact_kernel}
    copies = [args for kernel, args in launches if kernel is receive_compact_kernel]
    assert len(copies) == world.num_ranks
    for args in copies:
        recv_words, is_wide, span, skip_source = args[-4:]
        assert is_wide == wide and (span < recv_words.shape[1]) == cut and skip_source == -1


POISON = 0xA5  # every byte of the symmetric buffers before a direct replay


@pytest.mark.parametrize("ranks, dtype, hidden, tokens, split_warps, by_units, worst_case", [
    (1, "bfloat16", 20, (10,), 0, True, False),  # whole rows by the unit kernel, every row local
    (2, "float32", 20, (10, 13), 0, True, True),  # the same, worst-case outputs (cpu_sync=False)
    (3, "float16", 11, (10, 13, 0), 0, True, False),  # the same, 16-bit words, a source without tokens
    (2, "float32", 20, (10, 13), 0, False, True),  # whole rows by the rows kernel (few tokens), worst-case outputs
    (1, "float32", 1100, (4,), 64, False, False),  # 550 wide words in pieces of 512 and 38
    (2, "float16", 601, (5, 3), 64, False, True),  # 601 16-bit words in pieces of 256
    (3, "bfloat16", 2600, (5, 3, 1), 64, False, False),  # 650 wide words in pieces of 512 and 138
], ids=["1-bf16-rows", "2-f32-rows-worst", "3-f16-rows", "2-f32-rows-kernel-worst", "1-f32-pieces",
        "2-f16-pieces-worst", "3-bf16-pieces"])
def test_cached_compact_dispatch_writes_its_own_rows_straight_into_recv_x(xp, monkeypatch, ranks, dtype, hidden,
                                                                          tokens, split_warps, by_units, worst_case):
    """A cached compact dispatch with its outputs allocated before the send: the scatter (whole rows by the unit
    kernel, or by the rows kernel at few tokens, whole or in pieces) writes the payload of the rows a rank sends to
    itself straight into its ``recv_x`` and leaves region ``[parity, me]`` of its own rows untouched (poisoned
    here), the receive copies only the other sources' payload; every output stays bit for bit the reference."""
    from ep_comm.kernels.receive import receive_compact_kernel
    from ep_comm.kernels.scatter import scatter_kernel, scatter_rows_kernel

    world = kernel_world(xp, seed=31, ranks=ranks, dtype=dtype, hidden=hidden, tokens=tokens, masked=0.2)
    world.kernels.split_warps = split_warps or world.kernels.split_warps
    world.kernels.scatter_min_units = 1 if by_units else 10**6  # the unit kernel's rows, or the rows kernel's
    sent, first = run_dispatch(world, deterministic=False, expand=False)
    rng = np.random.default_rng(32)
    world.x = [random_payload(rng, x.shape, x.dtype) for x in world.x]
    for buf in world.buffers:
        buf[...] = POISON
    outputs = [world.outputs(expand=False, alignment=1, worst_case=worst_case, num_rows=len(got.recv_x),
                             num_expanded=len(got.recv_x), cached=got) for got in first]
    launches = []
    launched = spy_launches(monkeypatch, launches)
    world.send(1, deterministic=False, cached=[item.slot_idx for item in sent],
               direct=[(out[0], got.counts.rank_psum) for out, got in zip(outputs, first)])
    senders = sum(t > 0 for t in tokens)
    assert launched == [scatter_kernel if by_units else scatter_rows_kernel] * senders
    assert all(args[-3] is True for _, args in launches)  # direct
    for d in range(world.num_ranks):
        assert (to_host(world.views[d].rows[1, d]).view(np.uint8) == POISON).all()
        again = world.receive(d, 1, expand=False, alignment=1, zero_padding=False, deterministic=False,
                              cached=first[d], outputs=outputs[d], skip_source=d)
        check_compact(world, d, again, world.expected_compact(d, sent))
    skipped = [args[-1] for kernel, args in launches if kernel is receive_compact_kernel]
    assert skipped == list(range(world.num_ranks))


def test_own_rows_straight_into_recv_x_only_for_a_cached_compact_dispatch(xp):
    """``recv_x`` needs ``recv_psum`` and the recorded slots of a handle; ``skip_source`` a compact receive."""
    world = kernel_world(xp, ranks=1, tokens=(4,))
    k, view = world.kernels, world.views[0]
    topk, x = world.dev(world.topk[0]), world.device_payload(world.x[0])
    recv_x = xp.zeros_like(x)
    slots = xp.full(topk.shape, -1, np.int32)
    with pytest.raises(ValueError, match="recv_x given: True, recv_psum given: False, mode=2"):
        k.scatter(x, topk, None, slots, [view.rows], [view.meta], src_rank=0, step=world.step(0), mode=SLOT_CACHED,
                  recv_x=recv_x, stream=0)
    with pytest.raises(ValueError, match="mode=0: recv_x and recv_psum go together, with mode=SLOT_CACHED only"):
        k.scatter(x, topk, None, slots, [view.rows], [view.meta], src_rank=0, step=world.step(0), mode=SLOT_ATOMIC,
                  recv_x=recv_x, recv_psum=xp.zeros(1, np.int32), stream=0)
    none = xp.zeros(0, np.int32)
    with pytest.raises(ValueError, match="skip_source=0 with expand=True"):
        k.receive_copy(none, view.rows, view.meta, world.step(0), recv_x, none, none.view(np.float32), none,
                       expand=True, mode=PLACE_CACHED, expert_psum=none, alignment=1, zero_padding=False,
                       skip_source=0, stream=0)


def test_count_and_receive_count_return_new_separate_arrays_on_every_call(monkeypatch):
    """The int32 arrays of ``count`` and ``receive_count`` are views of one allocation per call: each has its
    shape and dtype, starts on 16 bytes, overlaps none of the others, and none is shared with an earlier
    call's (launches stubbed: only the host side)."""
    k = Kernels(np, num_ranks=3, num_experts=12, num_topk=3, max_tokens=16, num_blocks=4)
    monkeypatch.setattr(k, "_launch", lambda *args, **kwargs: lambda *launch_args: None)
    idx = np.zeros((5, 3), np.int64)
    counts, meta = np.zeros((2, 3, 7), np.int64), np.zeros((2, 3, 16, 7), np.int32)
    step = np.zeros(1, np.int64)
    calls = [(k.count(idx, stable=True, stream=0),
              k.receive_count(counts, meta, step, alignment=1, expand=False, stable=True, stream=0)) for _ in range(2)]
    send, recv = calls[0]
    shapes = [(3,), (12,), (3,), (13,), (5, 3), (5, 3), (3, 7)] + [(3,), (4,), (4,), (4,), (2,)]
    arrays = list(send) + list(recv)
    assert [a.shape for a in arrays] == shapes
    assert [a.dtype for a in arrays] == [np.int32] * 4 + [np.bool_] + [np.int32] * 7
    assert all(a.ctypes.data % 16 == 0 and a.flags.c_contiguous for a in arrays)
    later = list(calls[1][0]) + list(calls[1][1])
    for i, a in enumerate(arrays):
        assert not any(np.shares_memory(a, b) for b in arrays[i + 1:] + later)
