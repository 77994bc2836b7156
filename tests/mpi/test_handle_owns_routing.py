"""The handle owns its routing (docs/design.md, "The handle"): writing into the caller's ``topk_idx`` and
``topk_weights`` after a dispatch changes neither a replay of its handle nor the combine. Collective."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.collective import make_buffer, to_device
from helpers.oracle import RANK, bits, expected_compact_combine, expected_expand_combine, make_world

from ep_comm.contract.arrays import to_host

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world_and_buffer():
    """A routing with masked entries and tokens that go nowhere, bfloat16 rows, and a Buffer for it."""
    world = make_world("masked", dtype="bfloat16")
    with make_buffer(world) as buf:
        yield world, buf


def overwrite(idx, weights, num_experts: int) -> None:
    """Other ids (masked entries become ``num_experts``) and other weights, written in place into the caller's
    arrays."""
    idx[...] = num_experts - 1 - idx
    weights[...] = 7.0


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_writes_into_the_callers_routing_change_neither_replay_nor_combine(world_and_buffer, expand):
    world, buf = world_and_buffer
    x = to_device(world.x[RANK])
    idx, weights = to_device(world.topk_idx[RANK].copy()), to_device(world.weights[RANK].copy())
    out = buf.dispatch(x, idx, weights, expand=expand)
    h = out.handle
    assert h.topk_idx is not idx and h.topk_weights is not weights
    overwrite(idx, weights, world.num_experts)
    replay = buf.dispatch(x, handle=h)
    assert replay.handle.topk_idx is h.topk_idx, "a replay of the handle's own routing copies nothing"
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
        assert bits(to_host(getattr(replay, name))).tobytes() == bits(to_host(getattr(out, name))).tobytes(), name
    np.testing.assert_array_equal(to_host(h.topk_idx), world.topk_idx[RANK])
    np.testing.assert_array_equal(to_host(h.topk_weights), world.weights[RANK])
    res = buf.combine(replay.recv_x, h, topk_weights=replay.recv_topk_weights)
    if expand:
        want = expected_expand_combine(world, weighted=True)
    else:
        want = expected_compact_combine(world)
        masked = np.where(world.topk_idx[RANK] >= 0, world.weights[RANK], 0)
        np.testing.assert_array_equal(to_host(res.topk_weights), masked)
    assert bits(to_host(res.x)).tobytes() == bits(want).tobytes()


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_the_handles_of_later_dispatches_of_one_shape_own_their_routing_too(world_and_buffer, expand):
    """The calls after a shape's first take the nvshmem backend's prepared path, which copies the weights its own way
    (one device-to-device copy): their handles own their routing as the first call's does."""
    world, buf = world_and_buffer
    x = to_device(world.x[RANK])
    prepared = getattr(buf._backend, "prepared", None)  # the nvshmem backend's prepared path (None on mpi)
    before = None if prepared is None else prepared.replayed
    for _ in range(3):
        idx, weights = to_device(world.topk_idx[RANK].copy()), to_device(world.weights[RANK].copy())
        h = buf.dispatch(x, idx, weights, expand=expand).handle
        assert h.topk_idx is not idx and h.topk_weights is not weights
        overwrite(idx, weights, world.num_experts)
        np.testing.assert_array_equal(to_host(h.topk_idx), world.topk_idx[RANK])
        np.testing.assert_array_equal(to_host(h.topk_weights), world.weights[RANK])
    assert prepared is None or prepared.replayed >= before + 2
