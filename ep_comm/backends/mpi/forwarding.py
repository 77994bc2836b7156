"""The forwarded route of the mpi backend (``Buffer(forwarding=True)`` with several nodes, ``ForwardedRoute``).

A step's send part writes the ranks of this rank's node directly, as the flat path does, and for every other node
one block into the inbox (``ep_comm.contract.forward_inbox``) of that node's forwarder (``Topology.forwarder``: the
rank with this rank's local index), then signals the inboxes. The receive part (at once for an unsplit step, in the
hook for a split one) waits for the inboxes of this rank, the forwarder (bounded, as every wait), relays their rows
into the ranks of its node at the flat path's offsets and slots, and only then signals every rank and waits for
every rank's signal: a destination that sees a forwarder's signal sees the rows it relayed. So every destination
window holds the bytes the flat path writes, and the receive parts (``MpiProtocol``) read them unchanged. Within
this rank's node the route sends through the flat route (``mpi.flat.FlatRoute``).

Dispatch sends a token over the scale-out path once per remote destination node. Combine reduces in the node
(docs/design.md, "Combine"): a rank puts its partials for a source of another node into the inbox of that source's
forwarder in its own node; the forwarder's receive part sums them per token (``reduce.node_sum``) and puts one row
per token into the source, which adds it as that node's term (:meth:`ForwardedRoute.term_of`,
:meth:`ForwardedRoute.read_term`). So a combine, too, sends a token over the scale-out path once per remote node.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np

from ep_comm.backends.collective_steps import step_word
from ep_comm.backends.interface import DispatchRequest
from ep_comm.backends.mpi.context import MpiContext
from ep_comm.backends.mpi.flat import FlatRoute
from ep_comm.contract import layout as lay
from ep_comm.contract.forward_inbox import HEADER_WORDS, ForwardInbox, relay_meta, slot_order
from ep_comm.contract.reduce import node_sum
from ep_comm.handle import Routing


def gather_owned_weights(tokens: np.ndarray, metas: List[np.ndarray], num_topk: int) -> np.ndarray:
    """float32 ``[n, K]``: for each of ``tokens`` (int64 ``[n]`` ascending), entry k's weight from the rank of the
    node owning its expert, 0 where none does. ``metas``: per rank, its combine meta rows ``[n_i, >= 1 + 2K]`` int32
    (source token, its local expert ids, -1 for entries it does not own, weights as bits)."""
    out = np.zeros((len(tokens), num_topk), dtype=np.float32)
    for meta in metas:
        row, k = np.nonzero(meta[:, 1 : 1 + num_topk] >= 0)
        weights = meta[:, 1 + num_topk : 1 + 2 * num_topk].view(np.float32)
        out[np.searchsorted(tokens, meta[row, 0]), k] = weights[row, k]
    return out


class ForwardedRoute:
    """Sends, signals, relays and reduce terms of forwarding, over ``ctx`` and ``inbox`` (the window's forwarding
    inbox); the same methods as ``mpi.flat.FlatRoute``, whose puts it makes within this rank's node (``flat``)."""

    def __init__(self, ctx: MpiContext, inbox: ForwardInbox):
        self.ctx = ctx
        self.inbox = inbox
        self.flat = FlatRoute(ctx)

    def _remote_nodes(self) -> List[int]:
        """The nodes other than this rank's, ascending."""
        mine = self.ctx.topology.node_of(self.ctx.rank)
        return [node for node in range(self.ctx.topology.num_nodes) if node != mine]

    def _forwarders(self) -> List[int]:
        """This rank's forwarders in the other nodes, which are also the ranks it forwards for."""
        return self.ctx.topology.forwarders(self.ctx.rank)

    def _node_ranks(self) -> range:
        """The ranks of this rank's node."""
        return self.ctx.topology.node_ranks(self.ctx.topology.node_of(self.ctx.rank))

    def term_of(self) -> np.ndarray:
        """int64 ``[R]`` (``FlatRoute.term_of``): a rank of another node is carried by the term of its node's first
        rank (the forwarder's sum), a rank of this node by its own."""
        ranks = self.flat.term_of()
        first = ranks - ranks % self.ctx.topology.scaleup_ranks
        return np.where(first == self._node_ranks().start, ranks, first)

    # ------------------------------------------------------------------ sends
    def scatter(self, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                words: Optional[np.ndarray]) -> None:
        """Rank scatter (``FlatRoute.scatter``): the ranks of this node directly, every other node through its
        forwarder's inbox (:meth:`_send_to_forwarder`)."""
        for dst in self._node_ranks():
            self.flat.scatter_to(dst, parity, request, routing, slots, words)
        for node in self._remote_nodes():
            self._send_to_forwarder(node, parity, request, routing, slots, words)

    def _send_to_forwarder(self, node: int, parity: int, request: DispatchRequest, routing: Routing,
                           slots: np.ndarray, words: Optional[np.ndarray]) -> None:
        """Every token bound for a rank of ``node``, once, in token order, into its forwarder's inbox block: the
        row, its meta (global ids, weights) with its slot in each rank of the node, and with ``words`` (a new
        routing) the count words of each rank of the node."""
        ctx, inbox, weights = self.ctx, self.inbox, request.topk_weights
        ranks = ctx.topology.node_ranks(node)
        forwarder = ctx.topology.forwarder(ctx.rank, node)
        block = inbox.block(ctx.topology.node_of(ctx.rank), 0)
        tokens = np.nonzero((slots[:, ranks] >= 0).any(axis=1))[0]
        meta = ctx.pack_meta(tokens, routing.topk_idx[tokens], None if weights is None else weights[tokens])
        self._put_into_inbox(forwarder, parity, block, ctx.pack_rows(request.x[tokens]),
                             relay_meta(meta, slots[tokens][:, ranks]), words is not None)
        if words is not None:  # the blocks of one sender node are consecutive: one put for the node's ranks
            ctx.window.put(words[ranks], forwarder, inbox.count_at(parity, block))
        ctx.scaleout_rows["dispatch"] += len(tokens)

    def return_rows(self, src: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        """A combine's partials for ``src`` (``FlatRoute.return_rows``); for a rank of another node: into the inbox
        of ``src``'s forwarder in this node (over scale-up), block ``src``'s node and this rank's local index, for
        the forwarder to sum (:meth:`_reduce_for`)."""
        ctx, topology = self.ctx, self.ctx.topology
        if topology.in_reach(ctx.rank, src):
            self.flat.return_rows(src, parity, rows, meta)
            return
        block = self.inbox.block(topology.node_of(src), topology.local_index(ctx.rank))
        no_slots = np.full((len(meta), topology.scaleup_ranks), -1)
        self._put_into_inbox(topology.forwarder(src, topology.node_of(ctx.rank)), parity, block,
                             ctx.pack_rows(rows), relay_meta(meta, no_slots), False)

    def _put_into_inbox(self, forwarder: int, parity: int, block: int, rows: np.ndarray, meta: np.ndarray,
                        with_counts: bool) -> None:
        """Rows ``[n, row_bytes]`` uint8, inbox meta rows ``[n, relay_words]`` int32 and the header of ``block``
        into ``forwarder``'s inbox."""
        inbox, window = self.inbox, self.ctx.window
        window.put(rows, forwarder, inbox.row_at(parity, block))
        window.put(meta, forwarder, inbox.meta_at(parity, block))
        window.put(np.array([len(rows), int(with_counts)], dtype=np.int64), forwarder, inbox.header_at(parity, block))

    # ------------------------------------------------------------ signal, relay
    def signal(self, what: str, seq: int, hooked: bool) -> None:
        """The end of a send part (``FlatRoute.signal``): signal the forwarders' inboxes, then (an unsplit step)
        relay, signal every rank and wait; a split step does that in its receive part (:meth:`wait`)."""
        profile = self.ctx.runner.profile
        if hooked:
            with profile.phase(what, "signal"):
                self._signal_inboxes(what, seq)
        else:
            with profile.phase(what, "signal+wait"):
                self._signal_inboxes(what, seq)
                self._relay_signal_and_wait(what, seq)

    def wait(self, what: str, seq: int, hooked: bool) -> None:
        """The start of a receive part (``FlatRoute.wait``); split: relay, signal and wait."""
        if hooked:
            with self.ctx.runner.profile.phase(what, "wait"):
                self._relay_signal_and_wait(what, seq)

    def _signal_inboxes(self, what: str, seq: int) -> None:
        """Signal step ``seq`` to the inbox signals of every rank, after this rank's puts (its forwarders wait for
        it there; the others learn that this rank began the step)."""
        self.ctx.window.signal(range(self.ctx.geo.num_ranks), step_word(seq, what), self.inbox.signal_offset)

    def _relay_signal_and_wait(self, what: str, seq: int) -> None:
        """Wait (bounded) for the inboxes of step ``seq`` (a dispatch's from this rank's forwarders, a combine's
        from the ranks of its node), relay them (:meth:`_relay`) or sum them (:meth:`_reduce_for`), then signal
        every rank and wait for every rank's signal. The wait statistics take a peer's arrival from its inbox signal
        (the end of its send part), seen in either wait."""
        ctx, runner = self.ctx, self.ctx.runner
        dispatch = what == "dispatch"
        senders = self._forwarders() if dispatch else list(self._node_ranks())
        word = step_word(seq, what)
        clock = runner.waits.clock(ctx.window.arrivals(word, self.inbox.signal_offset))
        missing = ctx.window.wait(senders, word, time.monotonic() + runner.timeout_s, self.inbox.signal_offset,
                                  clock=clock)
        runner.steps.after_wait(what, missing, seen=True)
        with runner.profile.phase(what, "relay" if dispatch else "node reduce"):
            for node, forwarder in zip(self._remote_nodes(), self._forwarders()):
                if dispatch:
                    self._relay(seq % 2, node, forwarder)
                else:
                    self._reduce_for(seq % 2, forwarder)
        everyone = range(ctx.geo.num_ranks)
        ctx.window.signal(everyone, word)
        # a rank that began the step (its inbox signal is here) and is missing waits for another one: that one
        # is named, as on the flat path, and the first one's abort record does not end this wait
        missing = ctx.window.wait(everyone, word, time.monotonic() + runner.timeout_s,
                                  entered=self.inbox.signal_offset, clock=clock)
        runner.steps.after_wait(what, missing, seen=True)
        if clock is not None:
            clock.finish()

    def _read_inbox_block(self, parity: int, block: int) -> Tuple[int, bool, np.ndarray, np.ndarray]:
        """``(rows, count words written, rows [n, row_bytes] uint8, meta [n, relay_words] int32)`` of inbox block
        ``block`` of this rank (views of its window)."""
        inbox, sym, window = self.inbox, self.ctx.sym, self.ctx.window
        n, with_counts = window.local(inbox.header_at(parity, block), 8 * HEADER_WORDS).view(np.int64)
        rows = window.local(inbox.row_at(parity, block), int(n) * sym.row_bytes).reshape(-1, sym.row_bytes)
        meta = window.local(inbox.meta_at(parity, block), int(n) * inbox.relay_words * 4).view(
            np.int32).reshape(-1, inbox.relay_words)
        return int(n), bool(with_counts), rows, meta

    def _relay(self, parity: int, node: int, sender: int) -> None:
        """Write the dispatch inbox block of ``sender`` (of ``node``) into the ranks of this node, where the flat
        path would have put them: region ``[parity][sender]`` of each, rows in slot order (:func:`slot_order`)."""
        ctx, inbox, sym, k = self.ctx, self.inbox, self.ctx.sym, self.ctx.geo.num_topk
        _, with_counts, rows, meta = self._read_inbox_block(parity, inbox.block(node, 0))
        for j, dst in enumerate(self._node_ranks()):
            order = slot_order(meta[:, sym.meta_words + j])
            dst_meta = meta[order, : sym.meta_words].copy()
            dst_meta[:, 1 : 1 + k] = lay.local_topk(dst_meta[:, 1 : 1 + k], dst, ctx.geo.experts_per_rank)
            if with_counts:
                words = ctx.window.local(inbox.count_at(parity, inbox.block(node, j)), 8 * sym.count_words)
                ctx.window.put(words.copy(), dst, sym.count_at(parity, sender))
            ctx.window.put(rows[order], dst, sym.row_at(parity, sender))
            ctx.window.put(dst_meta, dst, sym.meta_at(parity, sender))

    def _reduce_for(self, parity: int, src: int) -> None:
        """Sum the partials for ``src`` (a rank of another node, which this rank forwards for) that the ranks of this
        node put into its inbox, one row per token (``reduce.node_sum``), and put them into ``src`` at region
        ``[parity][this rank]``, in token order, with meta rows carrying each entry's weight from the rank owning
        its expert (:func:`gather_owned_weights`)."""
        ctx, geo = self.ctx, self.ctx.geo
        node = ctx.topology.node_of(src)
        blocks = [self._read_inbox_block(parity, self.inbox.block(node, j)) for j in range(ctx.topology.scaleup_ranks)]
        metas = [meta for _, _, _, meta in blocks]
        tokens, rows = node_sum([meta[:, 0] for meta in metas],
                                [ctx.unpack_rows(raw, geo.hidden) for _, _, raw, _ in blocks], geo.dtype)
        ctx.put_block(src, parity, rows, ctx.pack_meta(tokens, -1, gather_owned_weights(tokens, metas, geo.num_topk)))
        ctx.count_scaleout("combine", src, len(tokens))

    def read_term(self, parity: int, q: int, reached: np.ndarray, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Term ``q`` of the source's reduce (``FlatRoute.read_term``); for the first rank of another node: its
        forwarder's sums (in token order, one per token reaching the node), placed at their tokens (the node's other
        ranks carry no term: ``reached`` is all False there, and their rows are zeros)."""
        ctx, geo = self.ctx, self.ctx.geo
        if ctx.topology.in_reach(ctx.rank, q):
            return self.flat.read_term(parity, q, reached, slots)
        tokens = np.nonzero(reached)[0]
        sums, meta = ctx.read_block(parity, ctx.topology.forwarder(ctx.rank, ctx.topology.node_of(q)), len(tokens),
                                    geo.hidden)
        rows = np.zeros((len(reached), geo.hidden), geo.dtype)
        weights = np.zeros((len(reached), geo.num_topk), np.float32)
        rows[tokens], weights[tokens] = sums, meta[:, 1 + geo.num_topk :].view(np.float32)
        return rows, weights
