"""The forwarding inbox on the GPU (docs/design.md, "Forwarding on nvshmem") in a simulated ``world.World`` split into
nodes of ``S`` ranks: filled by the senders' kernels, but for the count words (the transport's part, on the host
here), and what the design says a dispatch block holds. The inbox of each rank lives in a buffer of its own
(``ForwardInbox.total_bytes``, the symmetric part unused)."""
from __future__ import annotations

from typing import Optional

import numpy as np
from world import World, routing_verdict, with_verdict

from ep_comm.contract import layout as ref
from ep_comm.contract.forward_inbox import ForwardInbox, InboxViews, combine_send_views, inbox_views
from ep_comm.contract.symmetric import word_dtype
from ep_comm.contract.topology import Topology


def inbox_buffers(world: World, scaleup_ranks: int) -> list:
    """Every rank's zeroed inbox buffer for ``world`` in nodes of ``scaleup_ranks`` (uint8, ``ForwardInbox.total_bytes``,
    the symmetric part unused)."""
    inbox = ForwardInbox(world.sym, scaleup_ranks)
    return [world.xp.zeros(inbox.total_bytes, np.uint8) for _ in range(world.num_ranks)]


def inboxes(world: World, scaleup_ranks: int, buffers: Optional[list] = None) -> list:
    """Every rank's :class:`InboxViews` for ``world`` in nodes of ``scaleup_ranks``, of ``buffers``
    (:func:`inbox_buffers`; default: zeroed ones)."""
    inbox = ForwardInbox(world.sym, scaleup_ranks)
    word = word_dtype(world.hidden, world.dtype.itemsize)
    return [inbox_views(b, inbox, word) for b in buffers or inbox_buffers(world, scaleup_ranks)]


def designed_meta(world: World, s: int, slot_idx: np.ndarray, node_ranks: range) -> np.ndarray:
    """int32 ``[T_s, 1 + 2K + S]``: source ``s``'s dispatch inbox meta rows for a node as the design states them
    (token, global ids with -1 for none, weight bits or 0, the slot in each rank of the node or -1)."""
    topk = world.topk[s]
    tokens, k = topk.shape
    meta = np.full((tokens, 1 + 2 * k + len(node_ranks)), -1, np.int32)
    meta[:, 0] = np.arange(tokens)
    meta[:, 1: 1 + k] = np.where(topk >= 0, topk, -1)
    meta[:, 1 + k: 1 + 2 * k] = 0 if world.w[s] is None else world.w[s].view(np.int32)
    ranks = ref.entry_ranks(topk, world.local)
    for j, dst in enumerate(node_ranks):
        t, col = np.nonzero((ranks == dst) & (slot_idx >= 0))
        meta[t, 1 + 2 * k + j] = slot_idx[t, col] - s * world.max_tokens
    return meta


def send_to_inboxes(world: World, boxes: list, topology: Topology, sent: list, parity: int,
                    new_routing: bool = True) -> None:
    """Every sender's ``Kernels.inbox_send`` into the blocks ``node(s) * S`` of its forwarders, with the slots its
    scatter recorded (``sent[s].slot_idx``) and, for a new routing, the count words its count kernel wrote
    (``sent[s].layout.count_words``)."""
    for s in range(world.num_ranks):
        targets = [boxes[topology.forwarder(s, node)] for node in range(topology.num_nodes)]
        payload = world.device_payload(world.x[s]) if world.sources is None else world.sources[s]  # FP8: Fp8Rows
        world.kernels.inbox_send(payload, world.dev(world.topk[s]), world.dev(world.w[s]),
                                 world.dev(sent[s].slot_idx), [box.rows for box in targets],
                                 [box.meta for box in targets], [box.header for box in targets],
                                 [box.counts for box in targets], src_rank=s,
                                 count_words=sent[s].layout.count_words if new_routing else None,
                                 step=world.step(parity), ahead=0, stream=0)


def designed_counts(world: World, topology: Topology, s: int, node: int) -> np.ndarray:
    """int64 ``[S, words]``: the count words the design puts into block ``node(s) * S + j`` of ``s``'s forwarder in
    ``node``, those of rank ``j`` of ``node`` with ``s``'s verdict (the host reference's words)."""
    layout = ref.dispatch_layout(world.topk[s], world.num_experts, world.num_ranks)
    words = with_verdict(ref.send_count_words(layout), routing_verdict(world.topk[s]))
    ranks = topology.node_ranks(node)
    return words[ranks.start: ranks.stop].astype(np.int64)


def clear_remote_regions(world: World, topology: Topology, parity: int) -> None:
    """Zero, in every rank, the rows, meta rows and count words of ``parity`` from the ranks of other nodes:
    what the relay is to write."""
    for d, view in enumerate(world.views):
        for s in range(world.num_ranks):
            if not topology.in_reach(d, s):
                view.rows[parity, s] = 0
                view.meta[parity, s] = 0
                view.counts[parity, s] = 0


def fill_combine_meta(box: InboxViews, parity: int, block: int, tokens: np.ndarray, meta: np.ndarray, xp) -> None:
    """The header and meta rows of a rank's combine partials for one source in a forwarder's inbox block, in the
    given (slot) order: ``tokens [n]`` source tokens, ``meta [n, <= 2K]`` int32 local ids, then weight bits."""
    n = len(tokens)
    box.header[parity, block] = xp.asarray(np.array([n, 0], np.int64))
    box.combine_meta[parity, block, :n, 0] = xp.asarray(tokens.astype(np.int32))
    box.combine_meta[parity, block, :n, 1: 1 + meta.shape[1]] = xp.asarray(meta)


def fill_combine_inbox(box: InboxViews, parity: int, block: int, tokens: np.ndarray, meta: np.ndarray,
                       partials: np.ndarray, xp) -> None:
    """:func:`fill_combine_meta`, and the partials ``[n, H]`` (payload) as the block's rows."""
    fill_combine_meta(box, parity, block, tokens, meta, xp)
    words = np.ascontiguousarray(partials).view(box.rows.dtype)
    box.rows[parity, block, :len(tokens), : words.shape[1]] = xp.asarray(words)


def combine_views(world: World, buffers: list, topology: Topology, me: int) -> tuple:
    """``(rows, metas, headers)`` per source, as rank ``me``'s combine sends: a source of its node's own symmetric
    views (and a header view of ``me``'s own inbox, not written), a source of another node the block ``node(source) *
    S + local(me)`` of that source's forwarder in ``me``'s node, through the C-contiguous views the GPU takes
    (``forward_inbox.combine_send_views`` of the forwarder's inbox buffer, ``buffers``: :func:`inbox_buffers`)."""
    inbox = ForwardInbox(world.sym, topology.scaleup_ranks)
    word = word_dtype(world.hidden, world.dtype.itemsize)
    rows, metas, headers = [], [], []
    for src in range(world.num_ranks):
        if topology.in_reach(me, src):
            rows.append(world.views[src].rows)
            metas.append(world.views[src].meta)
            headers.append(inbox_views(buffers[me], inbox, word).header)
            continue
        block = topology.node_of(src) * topology.scaleup_ranks + topology.local_index(me)
        views = combine_send_views(buffers[topology.forwarder(src, topology.node_of(me))], inbox, me, block, word)
        rows.append(views.rows)
        metas.append(views.meta)
        headers.append(views.header)
    return rows, metas, headers


def device_ranks(world: World, ranks: list):
    """int32 ``[n]`` on the device."""
    return world.xp.asarray(np.array(ranks, np.int32))


def relay_all(world: World, boxes: list, topology: Topology, parity: int, row_words: Optional[int] = None) -> None:
    """Every forwarder's ``Kernels.relay`` of its inbox (``boxes[f]``) into the ranks of its node, for the ranks it
    forwards for, in the parity ``parity``, rows of ``row_words`` words (None: the inbox row's)."""
    for f, box in enumerate(boxes):
        world.kernels.relay(box, device_ranks(world, topology.forwarders(f)), [v.rows for v in world.views],
                            [v.meta for v in world.views], [v.counts for v in world.views],
                            node_first=topology.node_ranks(topology.node_of(f)).start, step=world.step(parity),
                            ahead=0, stream=0, row_words=row_words)
