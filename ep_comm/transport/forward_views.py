"""The views a forwarded step's kernels take (``Buffer(forwarding=True)`` with several nodes; docs/design.md,
"Forwarding on nvshmem"), made once per Buffer from every rank's heap (its own and the peer views).

Every rank's heap is ``ForwardInbox.total_bytes`` of uint8: the symmetric buffer, then the inbox. A forwarded step
reaches every rank through load/store (the inbox's puts are not built): the dispatch's inbox send writes the
forwarders' inboxes of the other nodes, the relay and the node reduce write the ranks' symmetric buffers, the
combine's send writes the sources of this node and the forwarders' inboxes of this node. Array-module agnostic (NumPy
on the CPU fake, CuPy on the GPU): ``wrap`` turns an array into what the kernels take (a Numba view on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Tuple

import numpy as np

from ep_comm.contract.arrays import Array
from ep_comm.contract.forward_inbox import ForwardInbox, InboxViews, combine_send_views, inbox_views
from ep_comm.contract.symmetric import SymmetricViews, symmetric_views
from ep_comm.contract.topology import Topology


@dataclass(frozen=True)
class ForwardViews:
    """What one rank's forwarded launches take (every array long-lived: the same at every step, so the launches are
    recorded or captured like the flat ones).

    ``inbox``: this rank's ``InboxViews``; ``forwarded_for``: int32 ``[nodes - 1]`` (device) the ranks this rank
    forwards for, ascending; ``node_first``: the first rank of its node; ``node_size``: ``S``.
    ``to_forwarders``: per node, ``(rows, metas, headers, counts)`` of the inbox of this rank's forwarder there (its
    own inbox for its own node: never written), the tuples ``Kernels.inbox_send`` takes. ``peers``: every rank's
    ``(rows, meta, counts)`` of its symmetric buffer (the relay's and the node reduce's destinations).
    ``to_sources``: per source rank, ``(rows, meta, header)`` a combine's send writes through: the source's own
    symmetric rows and meta for a source of this node (with this rank's inbox header, never written), the block
    ``node(source) * S + local(me)`` of its forwarder in this node for another (``forward_inbox.combine_send_views``).
    """

    inbox: InboxViews
    forwarded_for: Array
    node_first: int
    node_size: int
    to_forwarders: Tuple[Tuple[Any, ...], ...]
    peers: Tuple[Tuple[Any, ...], ...]
    to_sources: Tuple[Tuple[Any, ...], ...]

    def forwarder_arrays(self) -> Tuple[Tuple[Any, ...], ...]:
        """``(rows, metas, headers, counts)``, each a tuple per node (:attr:`to_forwarders`)."""
        return _columns(self.to_forwarders)

    def peer_arrays(self) -> Tuple[Tuple[Any, ...], ...]:
        """``(rows, metas, counts)``: every rank's symmetric rows, meta rows and count words, each a tuple."""
        return _columns(self.peers)

    def source_arrays(self) -> Tuple[Tuple[Any, ...], ...]:
        """``(rows, metas, headers)``, each a tuple per source rank (:attr:`to_sources`)."""
        return _columns(self.to_sources)


def _columns(table: Tuple[Tuple[Any, ...], ...]) -> Tuple[Tuple[Any, ...], ...]:
    """The columns of a table of equal-length tuples, each a tuple."""
    return tuple(zip(*table))


def forward_views(heaps: Sequence[Array], inbox: ForwardInbox, me: int, word: np.dtype, xp: Any,
                  wrap: Callable[[Any], Any]) -> ForwardViews:
    """Rank ``me``'s :class:`ForwardViews` over ``heaps`` (every rank's uint8 heap of ``inbox.total_bytes``, through
    its peer view; ``heaps[me]`` this rank's own), rows as ``word``; ``xp``: the array module of the device list,
    ``wrap``: what the kernels take of an array."""
    topology = Topology.of(inbox.sym.num_ranks, inbox.scaleup_ranks)
    boxes = [inbox_views(h, inbox, word) for h in heaps]
    syms = [symmetric_views(h[: inbox.sym.total_bytes], inbox.sym, word) for h in heaps]
    mine = topology.node_of(me)
    to_forwarders = []
    for node in range(topology.num_nodes):
        box = boxes[me if node == mine else topology.forwarder(me, node)]
        to_forwarders.append(tuple(wrap(a) for a in (box.rows, box.meta, box.header, box.counts)))
    return ForwardViews(
        inbox=InboxViews(*(wrap(a) for a in boxes[me])),
        forwarded_for=wrap(xp.asarray(np.array(topology.forwarders(me), np.int32))),
        node_first=topology.node_ranks(mine).start, node_size=topology.scaleup_ranks,
        to_forwarders=tuple(to_forwarders),
        peers=tuple(tuple(wrap(a) for a in (v.rows, v.meta, v.counts)) for v in syms),
        to_sources=tuple(_to_source(heaps, syms, boxes[me], inbox, topology, me, src, word, wrap)
                         for src in range(inbox.sym.num_ranks)))


def _to_source(heaps: Sequence[Array], syms: Sequence[SymmetricViews], own: InboxViews, inbox: ForwardInbox,
               topology: Topology, me: int, src: int, word: np.dtype, wrap: Callable[[Any], Any]) -> Tuple[Any, ...]:
    """``(rows, meta, header)`` through which rank ``me``'s combine send writes its partials for source ``src``
    (:attr:`ForwardViews.to_sources`)."""
    if topology.in_reach(me, src):
        return wrap(syms[src].rows), wrap(syms[src].meta), wrap(own.header)
    block = inbox.block(topology.node_of(src), topology.local_index(me))
    views = combine_send_views(heaps[topology.forwarder(src, topology.node_of(me))], inbox, me, block, word)
    return wrap(views.rows), wrap(views.meta), wrap(views.header)
