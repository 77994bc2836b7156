"""The public contract of docs/design.md, checked on every rank of an ``mpirun`` job.

Dispatch outputs go through the shared checker (``ep_comm.testing.check``, the NumPy reference), whose
expected rows and counts are checked against the plain loops of ``helpers/oracle.py``; combines against the oracle.

Run by ``tests/jobs/test_multirank.py`` under ``mpirun -n 1..4`` with ``--with-mpi``; the backend and its
transport come from ``--backend`` and ``--transport`` (``mpi`` by default, ``nvshmem`` on GPUs).
Every test is collective.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.collective import dispatch, shared_buffers, to_device
from helpers.contract_checks import check_compact, check_dispatch_outputs
from helpers.oracle import COMM, RANK, WORLD, align, bits, expected_compact_combine, expected_expand_combine, make_world

from ep_comm.contract.arrays import to_host
from ep_comm.testing.check import DispatchOptions

pytestmark = pytest.mark.mpi

ROUTINGS = ["uniform", "masked", "hot", "zero_rank", "uneven", "full"]


@pytest.fixture(scope="module")
def buffers():
    """One buffer per geometry and ``deterministic``, shared by the tests of this module."""
    with shared_buffers() as get:
        yield get


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("routing", ROUTINGS)
def test_dispatch_layout_counts(buffers, routing):
    world = make_world(routing)
    buf = buffers(world)
    layout = buf.get_dispatch_layout(to_device(world.topk_idx[RANK]))
    idx = world.topk_idx[RANK]
    in_rank = np.array([[bool(world.entries_on(RANK, t, r)) for r in range(WORLD)] for t in range(len(idx))],
                       dtype=bool).reshape(len(idx), WORLD)
    np.testing.assert_array_equal(to_host(layout.is_token_in_rank), in_rank)
    np.testing.assert_array_equal(to_host(layout.num_tokens_per_rank), in_rank.sum(axis=0))
    per_expert = [int((idx == e).sum()) for e in range(world.num_experts)]
    np.testing.assert_array_equal(to_host(layout.num_tokens_per_expert), per_expert)


# ---------------------------------------------------------------- compact dispatch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("deterministic", [True, False])
def test_compact_dispatch_and_combine(buffers, routing, dtype, deterministic):
    world = make_world(routing, dtype=dtype)
    buf = buffers(world, deterministic)
    out = dispatch(buf, world)
    check_compact(world, out, deterministic)
    res = buf.combine(out.recv_x, out.handle)
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


def test_dst_buffer_slot_idx_names_first_entry_per_rank(buffers):
    world = make_world("uniform")
    buf = buffers(world)
    out = dispatch(buf, world)
    slot_idx = to_host(out.handle.dst_buffer_slot_idx)
    idx = world.topk_idx[RANK]
    assert slot_idx.shape == idx.shape
    for t in range(len(idx)):
        seen = set()
        for k, e in enumerate(idx[t]):
            r = int(e) // world.experts_per_rank if e >= 0 else -1
            if r >= 0 and r not in seen:
                seen.add(r)
                assert slot_idx[t, k] // world.max_tokens == RANK
            else:
                assert slot_idx[t, k] == -1
        # deterministic slots count the earlier tokens going to the same rank
        for r in seen:
            k = next(k for k, e in enumerate(idx[t]) if e >= 0 and e // world.experts_per_rank == r)
            earlier = sum(1 for u in range(t) if world.entries_on(RANK, u, r))
            assert slot_idx[t, k] % world.max_tokens == earlier


# ---------------------------------------------------------------- expand dispatch
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("routing", ["uniform", "masked", "hot", "zero_rank"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_expand_dispatch(buffers, routing, alignment, deterministic):
    world = make_world(routing)
    buf = buffers(world, deterministic)
    out = dispatch(buf, world, expand=True, expert_alignment=alignment, zero_padding=True)
    check_dispatch_outputs(world, out, DispatchOptions(expand=True, alignment=alignment, zero_padding=True,
                                                       weighted=True, deterministic=deterministic))
    h = out.handle
    psum = to_host(h.psum_num_recv_tokens_per_expert).astype(int)
    start = 0
    for e in range(world.experts_per_rank):
        rows = world.expert_rows(RANK, e)
        assert psum[e] - start == len(rows), "psum[i] - align(psum[i-1]) must be expert i's count"
        assert h.num_unaligned_recv_tokens_per_expert[e] == len(rows)
        assert h.num_recv_tokens_per_expert[e] == align(len(rows), alignment)
        start = align(psum[e], alignment)
    assert int(to_host(h.num_expanded_tokens)) == start == out.recv_x.shape[0]


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("routing", ["uniform", "masked", "hot"])
def test_expand_combine_is_the_weighted_sum(buffers, routing, weighted):
    world = make_world(routing, dtype="float32")
    buf = buffers(world)
    out = dispatch(buf, world, expand=True, expert_alignment=2)
    res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights if weighted else None)
    assert bits(to_host(res.x)).tobytes() == bits(expected_expand_combine(world, weighted)).tobytes()
    if weighted:  # the weights come back to their entries
        want = np.where(world.topk_idx[RANK] >= 0, world.weights[RANK], 0)
        np.testing.assert_array_equal(to_host(res.topk_weights), want)


def test_combine_bias_single_and_pair(buffers):
    world = make_world("masked")
    buf = buffers(world)
    out = dispatch(buf, world)
    rng = np.random.default_rng(RANK)
    b0 = rng.standard_normal(world.x[RANK].shape).astype(world.dtype)
    b1 = rng.standard_normal(world.x[RANK].shape).astype(world.dtype)
    res = buf.combine(out.recv_x, out.handle, bias=to_device(b0))
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world, bias=(b0,))).tobytes()
    res = buf.combine(out.recv_x, out.handle, bias=(to_device(b0), to_device(b1)))
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world, bias=(b0, b1))).tobytes()


def test_combine_gathers_compact_topk_weights(buffers):
    world = make_world("masked")
    buf = buffers(world)
    out = dispatch(buf, world)
    res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
    want = np.where(world.topk_idx[RANK] >= 0, world.weights[RANK], 0)
    np.testing.assert_array_equal(to_host(res.topk_weights), want)


# ---------------------------------------------------------------- determinism, cached dispatch
@pytest.mark.parametrize("expand", [False, True])
def test_deterministic_is_bitwise_repeatable(buffers, expand):
    world = make_world("hot")
    buf = buffers(world, deterministic=True)
    first = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True)
    y = first.recv_x
    res1 = buf.combine(y, first.handle, topk_weights=first.recv_topk_weights if expand else None)
    for _ in range(3):
        again = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True)
        assert bits(to_host(again.recv_x)).tobytes() == bits(to_host(first.recv_x)).tobytes()
        np.testing.assert_array_equal(to_host(again.handle.recv_src_metadata), to_host(first.handle.recv_src_metadata))
        res = buf.combine(again.recv_x, again.handle, topk_weights=again.recv_topk_weights if expand else None)
        assert bits(to_host(res.x)).tobytes() == bits(to_host(res1.x)).tobytes()


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_cached_dispatch_replays_the_routing(buffers, expand, deterministic):
    world = make_world("masked")
    buf = buffers(world, deterministic)
    first = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True)
    replay = buf.dispatch(to_device(world.x[RANK]), handle=first.handle)
    assert bits(to_host(replay.recv_x)).tobytes() == bits(to_host(first.recv_x)).tobytes()
    np.testing.assert_array_equal(to_host(replay.recv_topk_idx), to_host(first.recv_topk_idx))
    np.testing.assert_array_equal(to_host(replay.recv_topk_weights), to_host(first.recv_topk_weights))
    # new payload, same routing: every row moves to the same place
    x2 = (world.x[RANK].astype(np.float32) * 2 + 1).astype(world.dtype)
    replay2 = buf.dispatch(to_device(x2), handle=first.handle)
    x2_all = COMM.allgather(x2)
    meta = to_host(first.handle.recv_src_metadata)
    recv = to_host(replay2.recv_x)
    for i in range(int(to_host(first.handle.num_recv_tokens))):
        s, t = divmod(int(meta[i, 0]), world.max_tokens)
        rows = [meta[i, 2 + k] for k in range(world.num_topk) if meta[i, 2 + k] >= 0] if expand else [i]
        for row in rows:
            assert bits(recv[row]).tobytes() == bits(x2_all[s][t]).tobytes()


# ---------------------------------------------------------------- cpu_sync=False, stats
@pytest.mark.parametrize("expand", [False, True])
def test_cpu_sync_false_gives_worst_case_outputs(buffers, expand):
    world = make_world("masked")
    buf = buffers(world)
    ref = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True)
    out = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True, cpu_sync=False)
    L, K = world.experts_per_rank, world.num_topk
    if expand:
        rows = align(WORLD * world.max_tokens * min(K, L) + 3 * L, 4)
        n = int(to_host(ref.handle.num_expanded_tokens))
        assert int(to_host(out.handle.num_expanded_tokens)) == n
    else:
        rows = WORLD * world.max_tokens
        n = int(to_host(ref.handle.num_recv_tokens))
        assert int(to_host(out.handle.num_recv_tokens)) == n
    assert out.recv_x.shape[0] == rows
    assert bits(to_host(out.recv_x)[:n]).tobytes() == bits(to_host(ref.recv_x)).tobytes()
    tail = to_host(out.recv_topk_idx)[n:]
    assert (tail == -1).all()
    nrecv = int(to_host(ref.handle.num_recv_tokens))
    assert (to_host(out.handle.recv_src_metadata)[nrecv:] == -1).all()
    # the worst-case outputs combine like the exact ones
    res = buf.combine(out.recv_x, out.handle)
    res_ref = buf.combine(ref.recv_x, ref.handle)
    assert bits(to_host(res.x)).tobytes() == bits(to_host(res_ref.x)).tobytes()


@pytest.mark.parametrize("expand", [False, True])
def test_cached_dispatch_without_cpu_sync_replays_at_worst_case_size(buffers, expand):
    """The path a CUDA graph would replay: a handle's routing, no host wait, worst-case outputs."""
    world = make_world("masked")
    buf = buffers(world)
    first = dispatch(buf, world, expand=expand, expert_alignment=4, zero_padding=True)
    x2 = (world.x[RANK].astype(np.float32) * 3 - 1).astype(world.dtype)
    exact = buf.dispatch(to_device(x2), handle=first.handle)
    lazy = buf.dispatch(to_device(x2), handle=first.handle, cpu_sync=False)
    n = exact.recv_x.shape[0]
    assert lazy.recv_x.shape[0] >= n
    assert bits(to_host(lazy.recv_x)[:n]).tobytes() == bits(to_host(exact.recv_x)).tobytes()
    np.testing.assert_array_equal(to_host(lazy.recv_topk_idx)[:n], to_host(exact.recv_topk_idx))
    assert (to_host(lazy.recv_topk_idx)[n:] == -1).all()
    res_lazy = buf.combine(lazy.recv_x, lazy.handle)
    res_exact = buf.combine(exact.recv_x, exact.handle)
    assert bits(to_host(res_lazy.x)).tobytes() == bits(to_host(res_exact.x)).tobytes()


def test_stats_accumulate_received_counts(buffers):
    world = make_world("hot")
    buf = buffers(world)
    stats = to_device(np.zeros(world.experts_per_rank, dtype=np.int64))
    dispatch(buf, world, stats=stats)
    out = dispatch(buf, world, stats=stats)
    want = [2 * len(world.expert_rows(RANK, e)) for e in range(world.experts_per_rank)]
    np.testing.assert_array_equal(to_host(stats), want)
    np.testing.assert_array_equal(to_host(out.handle.num_unaligned_recv_tokens_per_expert), [w // 2 for w in want])
