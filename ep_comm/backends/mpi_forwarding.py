"""Node-aware forwarding on the mpi backend (``Buffer(forwarding=True)`` with several nodes, ``MpiForwarding``).

A step's send part writes the ranks of this rank's node directly, as the flat path does, and for every other node
one block into the inbox (``ep_comm.contract.forward_inbox``) of that node's forwarder (``Topology.forwarder``: the
rank with this rank's local index), then signals the inboxes. The receive part (at once for a plain step, in the
hook for a split one) waits for the inboxes of this rank, the forwarder (bounded, as every wait), relays their rows
into the ranks of its node at the flat path's offsets and slots, and only then signals every rank and waits for
every rank's signal: a destination that sees a forwarder's signal sees the rows it relayed. So every destination
window holds the bytes the flat path writes, and the receive parts (``MpiProtocol``) read them unchanged.

Dispatch sends a token over the scale-out path once per remote destination node; combine relays each rank's
partials unreduced (the contract sums them at the source in rank order in float32, docs/design.md), so it moves
as many scale-out rows as the flat path, through the forwarder.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from ep_comm.backends.collective_steps import step_word
from ep_comm.backends.interface import DispatchRequest
from ep_comm.backends.mpi_protocol import MpiProtocol
from ep_comm.contract import layout as lay
from ep_comm.contract.forward_inbox import HEADER_WORDS, ForwardInbox, relay_meta, slot_order
from ep_comm.handle import Routing


class MpiForwarding(MpiProtocol):
    """``MpiBackend``'s forwarded sends and relays; with ``inbox`` None (no forwarding, or one node) the flat path."""

    inbox: Optional[ForwardInbox]

    def _remote_nodes(self) -> List[int]:
        """The nodes other than this rank's, ascending."""
        mine = self.topology.node_of(self.rank)
        return [node for node in range(self.topology.num_nodes) if node != mine]

    def _forwarders(self) -> List[int]:
        """This rank's forwarders in the other nodes, which are also the ranks it forwards for."""
        return [self.topology.forwarder(self.rank, node) for node in self._remote_nodes()]

    # ------------------------------------------------------------------ sends
    def _scatter(self, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                 words: Optional[np.ndarray]) -> None:
        """Rank scatter (``MpiProtocol._scatter``); forwarded: the ranks of this node directly, every other node
        through its forwarder's inbox (:meth:`_to_forwarder`)."""
        if self.inbox is None:
            super()._scatter(parity, request, routing, slots, words)
            return
        for dst in self.topology.node_ranks(self.topology.node_of(self.rank)):
            self._scatter_to(dst, parity, request, routing, slots, words)
        for node in self._remote_nodes():
            self._to_forwarder(node, parity, request, routing, slots, words)

    def _to_forwarder(self, node: int, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                      words: Optional[np.ndarray]) -> None:
        """Every token bound for a rank of ``node``, once, in token order, into its forwarder's inbox block: the
        row, its meta (global ids, weights) with its slot in each rank of the node, and with ``words`` (a new
        routing) the count words of each rank of the node."""
        inbox, weights, ranks = self.inbox, request.topk_weights, self.topology.node_ranks(node)
        forwarder = self.topology.forwarder(self.rank, node)
        block = inbox.block(self.topology.node_of(self.rank), 0)
        tokens = np.nonzero((slots[:, ranks] >= 0).any(axis=1))[0]
        meta = self._pack_meta(tokens, routing.topk_idx[tokens], None if weights is None else weights[tokens])
        self._to_inbox(forwarder, parity, block, self._pack_rows(request.x[tokens]),
                       relay_meta(meta, slots[tokens][:, ranks]), words is not None)
        if words is not None:  # the blocks of one sender node are consecutive: one put for the node's ranks
            self.window.put(words[ranks], forwarder, inbox.count_at(parity, block))
        self.scaleout_rows["dispatch"] += len(tokens)

    def _return_rows(self, src: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        """A combine's partials for ``src`` (``MpiProtocol._return_rows``); forwarded, for a rank of another
        node: unreduced into the inbox block of its forwarder for ``src``."""
        if self.inbox is None or self.topology.in_reach(self.rank, src):
            super()._return_rows(src, parity, rows, meta)
            return
        node = self.topology.node_of(src)
        block = self.inbox.block(self.topology.node_of(self.rank), self.topology.local_index(src))
        no_slots = np.full((len(meta), self.topology.scaleup_ranks), -1)
        self._to_inbox(self.topology.forwarder(self.rank, node), parity, block, self._pack_rows(rows),
                       relay_meta(meta, no_slots), False)
        self.scaleout_rows["combine"] += len(rows)

    def _to_inbox(self, forwarder: int, parity: int, block: int, rows: np.ndarray, meta: np.ndarray,
                  with_counts: bool) -> None:
        """Rows ``[n, row_bytes]`` uint8, inbox meta rows ``[n, relay_words]`` int32 and the header of ``block``
        into ``forwarder``'s inbox."""
        inbox = self.inbox
        self.window.put(rows, forwarder, inbox.row_at(parity, block))
        self.window.put(meta, forwarder, inbox.meta_at(parity, block))
        self.window.put(np.array([len(rows), int(with_counts)], dtype=np.int64), forwarder,
                        inbox.header_at(parity, block))

    # ------------------------------------------------------------ signal, relay
    def _signal(self, what: str, seq: int, hooked: bool) -> None:
        """The end of a send part (``MpiSteps._signal``); forwarded: signal the forwarders' inboxes, then (a plain
        step) relay, signal every rank and wait; a split step does that in its receive part (:meth:`_wait`)."""
        if self.inbox is None:
            super()._signal(what, seq, hooked)
        elif hooked:
            with self.profile.phase(what, "signal"):
                self._signal_inboxes(what, seq)
        else:
            with self.profile.phase(what, "signal+wait"):
                self._signal_inboxes(what, seq)
                self._relay_signal_and_wait(what, seq)

    def _wait(self, what: str, seq: int, hooked: bool) -> None:
        """The start of a receive part (``MpiSteps._wait``); forwarded and split: relay, signal and wait."""
        if self.inbox is None:
            super()._wait(what, seq, hooked)
        elif hooked:
            with self.profile.phase(what, "wait"):
                self._relay_signal_and_wait(what, seq)

    def _signal_inboxes(self, what: str, seq: int) -> None:
        """Signal step ``seq`` to the inbox signals of every rank, after this rank's puts (its forwarders wait for
        it there; the others learn that this rank began the step)."""
        self.window.signal(range(self.geo.num_ranks), step_word(seq, what), self.inbox.signal_offset)

    def _relay_signal_and_wait(self, what: str, seq: int) -> None:
        """Wait (bounded) for the inboxes of step ``seq``, relay them (:meth:`_relay`), then signal every rank and
        wait for every rank's signal."""
        senders = self._forwarders()
        word = step_word(seq, what)
        missing = self.window.wait(senders, word, time.monotonic() + self.timeout_s, self.inbox.signal_offset)
        self.steps.after_wait(what, missing, seen=True)
        with self.profile.phase(what, "relay"):
            for node, sender in zip(self._remote_nodes(), senders):
                self._relay(what, seq % 2, node, sender)
        everyone = range(self.geo.num_ranks)
        self.window.signal(everyone, word)
        # a rank that began the step (its inbox signal is here) and is missing waits for another one: that one
        # is named, as on the flat path, and the first one's abort record does not end this wait
        missing = self.window.wait(everyone, word, time.monotonic() + self.timeout_s, entered=self.inbox.signal_offset)
        self.steps.after_wait(what, missing, seen=True)

    def _relay(self, what: str, parity: int, node: int, sender: int) -> None:
        """Write the inbox blocks of ``sender`` (of ``node``) into the ranks of this node, where the flat path
        would have put them: region ``[parity][sender]`` of each, rows in slot order (:func:`slot_order`)."""
        inbox, sym, k = self.inbox, self.sym, self.geo.num_topk
        for j, dst in enumerate(self.topology.node_ranks(self.topology.node_of(self.rank))):
            block = inbox.block(node, 0 if what == "dispatch" else j)
            n, with_counts = self.window.local(inbox.header_at(parity, block), 8 * HEADER_WORDS).view(np.int64)
            rows = self.window.local(inbox.row_at(parity, block), int(n) * sym.row_bytes).reshape(-1, sym.row_bytes)
            meta = self.window.local(inbox.meta_at(parity, block), int(n) * inbox.relay_words * 4).view(
                np.int32).reshape(-1, inbox.relay_words)
            if what == "dispatch":
                order = slot_order(meta[:, sym.meta_words + j])
                rows, meta = rows[order], meta[order, : sym.meta_words].copy()
                meta[:, 1 : 1 + k] = lay.local_topk(meta[:, 1 : 1 + k], dst, self.geo.experts_per_rank)
                if with_counts:
                    words = self.window.local(inbox.count_at(parity, inbox.block(node, j)), 8 * sym.count_words)
                    self.window.put(words.copy(), dst, sym.count_at(parity, sender))
            self.window.put(rows.copy(), dst, sym.row_at(parity, sender))
            self.window.put(np.ascontiguousarray(meta[:, : sym.meta_words]), dst, sym.meta_at(parity, sender))
