"""The forwarder's kernels (``ep_comm.kernels.forward``) in the simulator, against the flat path and the mpi
backend's reference arithmetic.

Relay: with every sender's inbox blocks filled as the design says, the relay on every forwarder leaves every
rank's symmetric buffer byte for byte as the flat scatter and count exchange leave it (rows, meta rows, count
words), so the receive kernels read the flat path's bytes. Node reduce: the rows a forwarder writes into a source
are ``reduce.node_sum`` of its node's partials bit for bit (the mpi backend's stage 1), whatever the order the
partials sit in, with each entry's weight from the rank owning its expert (``mpi_forwarding.gather_owned_weights``).
"""
from __future__ import annotations

import numpy as np
import pytest
from forward_checks import (
    clear_remote_regions,
    device_ranks,
    fill_combine_inbox,
    fill_dispatch_inboxes,
    forwarded_for,
    inboxes,
)
from world import bits, kernel_world, random_payload

from ep_comm.backends.mpi_forwarding import gather_owned_weights
from ep_comm.contract.arrays import to_host
from ep_comm.contract.reduce import node_sum
from ep_comm.contract.symmetric import payload_rows
from ep_comm.contract.topology import Topology

PARITY = 1


@pytest.mark.parametrize("ranks, scaleup, tokens, deterministic, dtype, hidden", [
    (4, 2, (10, 13, 0, 7), True, "bfloat16", 40),  # 2 x 2, a sender with no token still relays its counts
    (4, 2, (9, 5, 12, 3), False, "float16", 20),  # atomic slots, a padded row (40 of 48 bytes)
    (6, 3, (8, 0, 11, 4, 6, 9), True, "float32", 24),  # 2 x 3
    (6, 2, (5, 7, 6, 4, 8, 3), True, "bfloat16", 16),  # 3 nodes: two senders per forwarder
])
def test_relay_leaves_the_flat_bytes(xp, ranks, scaleup, tokens, deterministic, dtype, hidden):
    world = kernel_world(xp, seed=50 + ranks + scaleup, ranks=ranks, experts=4 * ranks, topk=3, tokens=tokens,
                         dtype=dtype, hidden=hidden, masked=0.2)
    topology = Topology.of(ranks, scaleup)
    sent = world.send(PARITY, deterministic)
    flat = [to_host(b).copy() for b in world.buffers]
    clear_remote_regions(world, topology, PARITY)
    boxes = inboxes(world, scaleup)
    fill_dispatch_inboxes(world, boxes, topology, sent, PARITY)
    for f, box in enumerate(boxes):
        world.kernels.relay(box, device_ranks(world, forwarded_for(topology, f)), [v.rows for v in world.views],
                            [v.meta for v in world.views], [v.counts for v in world.views],
                            node_first=topology.node_ranks(topology.node_of(f)).start, step=world.step(PARITY),
                            ahead=0, stream=0)
    for d in range(ranks):
        np.testing.assert_array_equal(to_host(world.buffers[d]), flat[d], err_msg=f"rank {d}'s symmetric buffer")


def _partials(rng, world, tokens: int, holders: int) -> tuple:
    """Per holder: a random subset of the source's ``tokens`` in a random (slot) order, their local ids and weight
    bits ``[n, 2K]`` (one holder owns each routed entry), and random partials with some -0.0."""
    k = world.num_topk
    held = [rng.permutation(np.nonzero(rng.random(tokens) < 0.6)[0]) for _ in range(holders)]
    owner = rng.integers(-1, holders, size=(tokens, k))  # -1: the entry is not routed into this node
    out = []
    for j, order in enumerate(held):
        ids = np.where(owner[order] == j, rng.integers(0, world.local, size=(len(order), k)), -1).astype(np.int32)
        weights = rng.random((len(order), k)).astype(np.float32).view(np.int32)
        out.append((order, np.concatenate([ids, weights], axis=1),
                    random_payload(rng, (len(order), world.hidden), world.dtype)))
    return out


@pytest.mark.parametrize("ranks, scaleup, dtype, hidden", [
    (4, 2, "bfloat16", 40),
    (4, 2, "float32", 300),  # several passes of SPAN * 32 elements
    (6, 3, "float16", 20),
    (6, 2, "bfloat16", 24),  # 3 nodes: two sources per forwarder
])
def test_node_reduce_is_node_sum(xp, ranks, scaleup, dtype, hidden):
    world = kernel_world(xp, seed=60 + ranks + scaleup, ranks=ranks, experts=2 * ranks, topk=3, hidden=hidden,
                         dtype=dtype, tokens=(11,) * ranks)
    topology = Topology.of(ranks, scaleup)
    rng = np.random.default_rng(ranks * scaleup)
    boxes = inboxes(world, scaleup)
    expected = {}
    for f, box in enumerate(boxes):
        for src in forwarded_for(topology, f):
            held = _partials(rng, world, world.max_tokens, scaleup)
            for j, (tokens, meta, rows) in enumerate(held):
                fill_combine_inbox(box, PARITY, topology.node_of(src) * scaleup + j, tokens, meta, rows, xp)
            expected[src, f] = held
        world.kernels.node_reduce(box, device_ranks(world, forwarded_for(topology, f)), [v.rows for v in world.views],
                                  [v.meta for v in world.views], my_rank=f, dtype=world.dtype, hidden=hidden,
                                  step=world.step(PARITY), ahead=0, stream=0)
    k = world.num_topk
    for (src, f), held in expected.items():
        tokens, sums = node_sum([t for t, _, _ in held], [r for _, _, r in held], world.dtype)
        weights = gather_owned_weights(tokens, [np.concatenate([t[:, None].astype(np.int32), m], axis=1)
                                                for t, m, _ in held], k)
        view = world.views[src]
        got = payload_rows(to_host(view.rows[PARITY, f, tokens]), world.dtype)[:, :hidden]
        np.testing.assert_array_equal(bits(got.view(world.dtype)), bits(sums), err_msg=f"source {src}, forwarder {f}")
        meta = to_host(view.meta[PARITY, f, tokens])
        np.testing.assert_array_equal(meta[:, 0], tokens)
        np.testing.assert_array_equal(meta[:, 1: 1 + k], -1)
        np.testing.assert_array_equal(meta[:, 1 + k:], weights.view(np.int32))
