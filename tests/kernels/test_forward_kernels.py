"""The forwarder's kernels (``ep_comm.kernels.forward``) in the simulator, against the flat path and the mpi backend's
reference arithmetic.

Inbox send: every sender's kernel writes the dispatch blocks the design states (meta rows of every token, the rows of
the tokens sent into the node, the header). Relay: after the senders' inbox sends (and their count words), the relay on
every forwarder leaves every rank's symmetric buffer byte for byte as the flat scatter and count exchange leave it
(rows, meta rows, count words), so the receive kernels read the flat path's bytes. Node reduce: the rows a forwarder
writes into a source are ``reduce.node_sum`` of its node's partials bit for bit (the mpi backend's stage 1), whatever
the order the partials sit in, with each entry's weight from the rank owning its expert
(``mpi.forwarding.gather_owned_weights``). A whole forwarded combine, compact and expand (the flat send kernels and the meta kernel
writing a remote source's partials into its forwarder's inbox through the C-contiguous views the GPU takes,
``forward_inbox.combine_send_views``, the node reduce, the source's reduce and weight gather with nodes) is
``ep_comm.testing.forwarded`` bit for bit, every piece written by its kernel."""
from __future__ import annotations

import numpy as np
import pytest
from dispatch_checks import run_dispatch
from forward_checks import (
    clear_remote_regions,
    combine_views,
    designed_counts,
    designed_meta,
    device_ranks,
    fill_combine_inbox,
    inbox_buffers,
    inboxes,
    relay_all,
    send_to_inboxes,
)
from fp8_world import narrow_world
from world import bits, kernel_world, random_payload

from ep_comm.backends.mpi.forwarding import gather_owned_weights
from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host
from ep_comm.contract.fp8 import packed_row_bytes
from ep_comm.contract.reduce import expand_partials, node_sum
from ep_comm.contract.symmetric import payload_rows
from ep_comm.contract.topology import Topology
from ep_comm.launching import weight_return
from ep_comm.testing.forwarded import Forwarded, forwarded_combine

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
    send_to_inboxes(world, boxes, topology, sent, PARITY)  # the count words too: the relay copies the inbox's
    relay_all(world, boxes, topology, PARITY)
    for d in range(ranks):
        np.testing.assert_array_equal(to_host(world.buffers[d]), flat[d], err_msg=f"rank {d}'s symmetric buffer")


@pytest.mark.parametrize("source", ["rows", "pair", "cast"])
def test_fp8_rows_are_relayed_as_the_flat_scatter_writes_them(xp, source):
    """An FP8 dispatch (packed rows narrower than the symmetric rows: prepared, or written by the inbox send from the
    pair or cast as it reads them, as the scatter does): the inbox send and the relay leave the flat bytes, the relay
    copying only the packed words (the inbox rows' tails hold an earlier, wider step's bytes here)."""
    ranks, scaleup = 4, 2
    world = narrow_world(xp, seed=53, hidden=256, source=source, ranks=ranks, experts=4 * ranks,
                         tokens=(5, 0, 7, 4), masked=0.2)
    topology = Topology.of(ranks, scaleup)
    sent = world.send(PARITY, deterministic=True)
    flat = [to_host(b).copy() for b in world.buffers]
    clear_remote_regions(world, topology, PARITY)
    boxes = inboxes(world, scaleup)
    for box in boxes:
        box.rows[PARITY] = np.iinfo(box.rows.dtype).max  # stale bytes past the packed rows
    send_to_inboxes(world, boxes, topology, sent, PARITY)
    relay_all(world, boxes, topology, PARITY, row_words=packed_row_bytes(256) // 8)
    for d in range(ranks):
        np.testing.assert_array_equal(to_host(world.buffers[d]), flat[d], err_msg=f"rank {d}'s symmetric buffer")


def test_a_replayed_relay_leaves_the_flat_rows_and_no_count_words(xp):
    """A replay's inbox send (no count words, header word 1 = 0): the relay stores the flat path's rows and meta rows
    and leaves the count words of the other nodes' senders as they were (a replay exchanges no counts)."""
    ranks, scaleup = 4, 2
    world = kernel_world(xp, seed=57, ranks=ranks, experts=4 * ranks, topk=3, tokens=(6, 0, 9, 4), dtype="float16",
                         hidden=24, masked=0.2)
    topology = Topology.of(ranks, scaleup)
    sent = world.send(PARITY, deterministic=True)
    flat = [to_host(b).copy() for b in world.buffers]
    clear_remote_regions(world, topology, PARITY)
    for d in range(ranks):  # what the relay must leave alone: the count words, zeroed above
        for s in range(ranks):
            if not topology.in_reach(d, s):
                flat[d][world.sym.count_at(PARITY, s): world.sym.count_at(PARITY, s) + 8 * world.sym.count_words] = 0
    boxes = inboxes(world, scaleup)
    send_to_inboxes(world, boxes, topology, sent, PARITY, new_routing=False)
    relay_all(world, boxes, topology, PARITY)
    for d in range(ranks):
        np.testing.assert_array_equal(to_host(world.buffers[d]), flat[d], err_msg=f"rank {d}'s symmetric buffer")


@pytest.mark.parametrize("ranks, scaleup, tokens, dtype, hidden", [
    (4, 2, (10, 13, 0, 7), "bfloat16", 40),
    (6, 3, (8, 0, 11, 4, 6, 9), "float16", 20),  # a padded row (40 of 48 bytes)
    (6, 2, (5, 7, 6, 4, 8, 3), "float32", 24),  # 3 nodes
])
@pytest.mark.parametrize("new_routing", [True, False])
def test_inbox_send_writes_the_designed_blocks(xp, ranks, scaleup, tokens, dtype, hidden, new_routing):
    world = kernel_world(xp, seed=40 + ranks + scaleup, ranks=ranks, experts=4 * ranks, topk=3, tokens=tokens,
                         dtype=dtype, hidden=hidden, masked=0.2, weights=scaleup != 3)
    topology = Topology.of(ranks, scaleup)
    sent = world.send(PARITY, deterministic=False)
    boxes = inboxes(world, scaleup)
    send_to_inboxes(world, boxes, topology, sent, PARITY, new_routing)
    for f, box in enumerate(boxes):
        for s in topology.forwarders(f):
            block, n = topology.node_of(s) * scaleup, len(world.topk[s])
            meta = designed_meta(world, s, sent[s].slot_idx, topology.node_ranks(topology.node_of(f)))
            np.testing.assert_array_equal(to_host(box.header[PARITY, block]), [n, int(new_routing)])
            counts = to_host(box.counts[PARITY, block: block + scaleup])  # a replay sends no count words
            want = designed_counts(world, topology, s, topology.node_of(f)) if new_routing else np.zeros_like(counts)
            np.testing.assert_array_equal(counts, want, err_msg=f"count words {s} -> {f}")
            np.testing.assert_array_equal(to_host(box.meta[PARITY, block, :n]), meta, err_msg=f"{s} -> {f}")
            sent_rows = (meta[:, 1 + 2 * world.num_topk:] >= 0).any(axis=1)
            rows = payload_rows(to_host(box.rows[PARITY, block, :n]), world.dtype)[:, :hidden]
            np.testing.assert_array_equal(bits(rows[sent_rows].view(world.dtype)), bits(world.x[s][sent_rows]))


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
    (6, 3, "float32", 40),  # three holders: the order of the adds shows in float32
    (6, 2, "bfloat16", 24),  # 3 nodes: two sources per forwarder
])
def test_node_reduce_is_node_sum(xp, ranks, scaleup, dtype, hidden):
    world = kernel_world(xp, seed=60 + ranks + scaleup, ranks=ranks, experts=2 * ranks, topk=3, hidden=hidden,
                         dtype=dtype, tokens=(11,) * ranks)
    topology = Topology.of(ranks, scaleup)
    rng = np.random.default_rng(ranks * scaleup)
    boxes = inboxes(world, scaleup)
    expected = {}
    scaleout = [xp.zeros(2, np.int64) for _ in boxes]  # each forwarder's counter (ep_comm.kernels.traffic)
    for f, box in enumerate(boxes):
        for src in topology.forwarders(f):
            held = _partials(rng, world, world.max_tokens, scaleup)
            for j, (tokens, meta, rows) in enumerate(held):
                fill_combine_inbox(box, PARITY, topology.node_of(src) * scaleup + j, tokens, meta, rows, xp)
            expected[src, f] = held
        world.kernels.node_reduce(box, device_ranks(world, topology.forwarders(f)), [v.rows for v in world.views],
                                  [v.meta for v in world.views], my_rank=f, dtype=world.dtype, hidden=hidden,
                                  step=world.step(PARITY), scaleout=scaleout[f], ahead=0, stream=0)
    k = world.num_topk
    summed = [0] * ranks  # rows each forwarder put into sources of other nodes: one per token it summed
    for (src, f), held in expected.items():
        summed[f] += len(node_sum([t for t, _, _ in held], [r for _, _, r in held], world.dtype)[0])
    assert [to_host(c).tolist() for c in scaleout] == [[0, rows] for rows in summed]
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


def _send_partials(world, buffers, topology, d: int, received, y, step, row_weights) -> None:
    """Rank ``d``'s combine send, forwarded: rows (expand: reduced from the expanded rows ``y``, weighted by
    ``row_weights [M]`` or None), weights and meta words through :func:`combine_views`."""
    k, xp, got = world.kernels, world.xp, received[d]
    expand = got.recv_topk_idx.ndim == 1
    metadata = xp.asarray(got.recv_src_metadata)
    rows, metas, headers = combine_views(world, buffers, topology, d)
    k.combine_scatter(world.device_payload(y), metadata, got.counts.rank_psum, rows, my_rank=d, step=step,
                      expand=expand, weights=world.dev(row_weights), stream=0)
    weight_return.send_weights(lambda kernel, blocks, threads: k.launcher(kernel, blocks, threads, stream=0),
                               xp.asarray(got.recv_topk_weights.view(np.int32).reshape(len(got.recv_x), -1)), expand,
                               metadata,
                               got.counts.rank_psum, metas, my_rank=d, step=step, ahead=0, max_blocks=4)
    ids = got.recv_src_metadata[:, 2:] if expand else got.recv_topk_idx
    k.combine_meta(metadata, xp.asarray(ids), got.counts.rank_psum, metas, headers, my_rank=d,
                   node_size=topology.scaleup_ranks, step=step, ahead=0, stream=0)


def _partial_rows(world, sent, received, ys, row_weights, d: int) -> tuple:
    """``(meta [n, 2 + K], partials [n, H])`` of rank ``d``'s received rows: ``ys[d]`` itself (compact) or
    ``reduce.expand_partials`` of its expanded rows (expand)."""
    got = received[d]
    n = len(world.arrivals(d, sent))
    meta = got.recv_src_metadata[:n]
    if got.recv_topk_idx.ndim == 1:
        return meta, expand_partials(ys[d], meta[:, 2:], row_weights[d], world.dtype)
    return meta, ys[d][:n]


@pytest.mark.parametrize("ranks, scaleup, dtype, hidden, expand", [
    (4, 2, "bfloat16", 40, False),  # the wide bfloat16 reduce
    (6, 3, "float32", 20, False),
    (6, 2, "float16", 24, False),  # 3 nodes
    (4, 2, "float32", 24, True),  # expand: each rank's weighted reduce of its expanded rows is its partial
    (6, 2, "bfloat16", 40, True),  # 3 nodes
])
def test_forwarded_combine_is_the_oracle(xp, ranks, scaleup, dtype, hidden, expand):
    world = kernel_world(xp, seed=70 + ranks + scaleup, ranks=ranks, experts=2 * ranks, topk=3, hidden=hidden,
                         dtype=dtype, tokens=(10, 13, 0, 7, 9, 5)[:ranks], masked=0.2, nowhere=1)
    topology = Topology.of(ranks, scaleup)
    sent, received = run_dispatch(world, deterministic=False, expand=expand, alignment=2 if expand else 1,
                                  zero_padding=expand)  # parity 1; the combine's is 0
    rng = np.random.default_rng(ranks + scaleup)
    sizes = [len(got.recv_x) if expand else got.recv_src_metadata.shape[0] for got in received]
    ys = [random_payload(rng, (n, hidden), world.dtype) for n in sizes]
    row_weights = [rng.standard_normal(n).astype(np.float32) if expand else None for n in sizes]
    buffers = inbox_buffers(world, scaleup)
    boxes, step, k = inboxes(world, scaleup, buffers), world.step(0), world.kernels
    for d in range(ranks):
        _send_partials(world, buffers, topology, d, received, ys[d], step, row_weights[d])
    from_rank = [_partial_rows(world, sent, received, ys, row_weights, d) for d in range(ranks)]
    for f, box in enumerate(boxes):
        k.node_reduce(box, device_ranks(world, topology.forwarders(f)), [v.rows for v in world.views],
                      [v.meta for v in world.views], my_rank=f, dtype=world.dtype, hidden=hidden, step=step,
                      scaleout=xp.zeros(2, np.int64), ahead=0, stream=0)
    for s in range(ranks):
        tokens = world.topk[s].shape[0]
        partials = []
        for meta, partial in from_rank:
            rows = np.zeros((tokens, hidden), world.dtype)
            mine = meta[:, 0] // world.max_tokens == s
            rows[meta[mine, 0] % world.max_tokens] = partial[mine]
            partials.append(rows)
        reached = ref.is_token_in_rank(world.topk[s], world.num_experts, ranks)
        out = xp.full((tokens, hidden), 3, world.device_payload(world.x[s]).dtype)
        slot_idx, topk = xp.asarray(sent[s].slot_idx), world.dev(world.topk[s])
        own = {} if expand else dict(y=world.device_payload(ys[s]), recv_rank_psum=received[s].counts.rank_psum)
        k.combine_reduce(world.views[s].rows, step, slot_idx, topk, out, my_rank=s, node_size=scaleup, **own,
                         stream=0)
        want = forwarded_combine(partials, reached, Forwarded(s, scaleup))
        np.testing.assert_array_equal(bits(to_host(out)), bits(want), err_msg=f"source {s}")
        weight_bits = xp.full((tokens, world.num_topk), 7, np.int32)
        weight_return.gather_weights(lambda kernel, blocks, threads: k.launcher(kernel, blocks, threads, stream=0),
                                     world.views[s].meta, step, slot_idx, topk, weight_bits,
                                     experts_per_rank=world.local, my_rank=s, max_blocks=4, node_size=scaleup)
        np.testing.assert_array_equal(to_host(weight_bits).view(np.float32),
                                      np.where(world.topk[s] >= 0, world.w[s], 0), err_msg=f"source {s}")
