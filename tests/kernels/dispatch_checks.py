"""The checks of a simulated dispatch (``world.World``) against the NumPy reference (``ep_comm.contract.layout``):
the senders' slots, a receiver's compact and expand outputs, and :func:`run_dispatch`, a whole dispatch checked."""
from __future__ import annotations

import numpy as np
from world import World, bits

from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host


def check_sender(world: World, sent: list, deterministic: bool) -> None:
    """dst_buffer_slot_idx: exact in deterministic mode; else each rank's slots are a permutation."""
    for s, item in enumerate(sent):
        in_rank = ref.is_token_in_rank(world.topk[s], world.num_experts, world.num_ranks)
        stable = ref.dst_buffer_slot_idx(world.topk[s], ref.stable_rank_slots(in_rank), s, world.local,
                                          world.max_tokens)
        if deterministic:
            np.testing.assert_array_equal(item.slot_idx, stable)
            continue
        np.testing.assert_array_equal(item.slot_idx >= 0, stable >= 0)
        ranks = ref.entry_ranks(world.topk[s], world.local)
        for d in range(world.num_ranks):
            pick = (ranks == d) & (stable >= 0)
            assert sorted(item.slot_idx[pick]) == sorted(stable[pick])


def check_compact(world: World, d: int, got, want: dict) -> None:
    n = len(want["x"])
    np.testing.assert_array_equal(to_host(got.counts.rank_psum), ref.inclusive_psum(want["per_source"]))
    np.testing.assert_array_equal(bits(got.recv_x[:n]), bits(want["x"]))
    np.testing.assert_array_equal(got.recv_topk_idx[:n], want["local"])
    np.testing.assert_array_equal(got.recv_topk_weights[:n].view(np.uint32), want["weights"].view(np.uint32))
    np.testing.assert_array_equal(got.recv_src_metadata[:n, :2], want["origin"])
    np.testing.assert_array_equal(got.recv_src_metadata[:n, 2:], -1)
    assert (got.recv_topk_idx[n:] == -1).all() and (got.recv_src_metadata[n:] == -1).all()
    assert (got.recv_topk_weights[n:] == 0).all()


def check_expand(world: World, d: int, got, want: dict, alignment: int, zero_padding: bool, deterministic: bool):
    n = len(want["x"])
    lay = ref.receive_layout(want["local"], world.local, alignment, expand=True)
    counts = got.counts
    np.testing.assert_array_equal(to_host(counts.num_unaligned_per_expert), lay.num_unaligned_per_expert)
    np.testing.assert_array_equal(to_host(counts.num_aligned_per_expert), lay.num_aligned_per_expert)
    np.testing.assert_array_equal(to_host(counts.expert_psum), lay.psum_per_expert)
    np.testing.assert_array_equal(to_host(counts.totals), [n, lay.num_expanded_tokens])
    np.testing.assert_array_equal(got.recv_src_metadata[:n, :2], want["origin"])
    placed = got.recv_src_metadata[:n, 2:]
    np.testing.assert_array_equal(placed >= 0, want["local"] >= 0)
    if deterministic:
        np.testing.assert_array_equal(placed, lay.expanded_row)
    else:  # any order inside each expert's block
        for e in range(world.local):
            assert sorted(placed[want["local"] == e]) == sorted(lay.expanded_row[want["local"] == e])
    rows, cols = np.nonzero(placed >= 0)
    dest = placed[rows, cols]
    np.testing.assert_array_equal(bits(got.recv_x[dest]), bits(want["x"][rows]))
    np.testing.assert_array_equal(got.recv_topk_idx[dest], want["local"][rows, cols])
    np.testing.assert_array_equal(got.recv_topk_weights[dest], want["weights"][rows, cols])
    unused = np.ones(len(got.recv_topk_idx), bool)
    unused[dest] = False
    assert (got.recv_topk_idx[unused] == -1).all() and (got.recv_topk_weights[unused] == 0).all()
    padding = unused.copy()
    padding[lay.num_expanded_tokens:] = False
    if zero_padding:
        assert (bits(got.recv_x[padding]) == 0).all()
    assert (got.recv_src_metadata[n:] == -1).all()


def run_dispatch(world: World, *, deterministic: bool, expand: bool, alignment: int = 1, zero_padding: bool = False,
                 worst_case: bool = False, parity: int = 1):
    sent = world.send(parity, deterministic)
    check_sender(world, sent, deterministic)
    received = []
    for d in range(world.num_ranks):
        got = world.receive(d, parity, expand=expand, alignment=alignment, zero_padding=zero_padding,
                            deterministic=deterministic, worst_case=worst_case)
        want = world.expected_compact(d, sent)
        if expand:
            check_expand(world, d, got, want, alignment, zero_padding, deterministic)
        else:
            check_compact(world, d, got, want)
        received.append(got)
    return sent, received
