"""Which ranks reach each other by load/store: ranks grouped into (virtual) nodes of ``scaleup_ranks`` consecutive
ranks. Peers inside a rank's node are in scale-up reach (NVLink stores); the rest are reached over the scale-out path
(NVSHMEM puts, RDMA). A node's *forwarder* for a source rank is the rank with the source's local index in that node:
node-aware forwarding sends a token over scale-out at most once per destination node, to that forwarder.
:func:`transport_mode` names a rank's mix of the two ways (``Buffer.transport``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence


def check_scaleup_ranks(scaleup_ranks: Any, num_ranks: int) -> None:
    """``Buffer(scaleup_ranks=...)``: None (every rank in one node) or an int >= 1 that divides ``num_ranks``."""
    if scaleup_ranks is None:
        return
    if isinstance(scaleup_ranks, bool) or not isinstance(scaleup_ranks, int):
        raise TypeError(f"scaleup_ranks={scaleup_ranks!r} must be None or an int (ranks per node), "
                        f"got {type(scaleup_ranks).__name__}")
    if scaleup_ranks < 1 or num_ranks % scaleup_ranks:
        raise ValueError(f"scaleup_ranks={scaleup_ranks}: must be >= 1 and divide the rank count {num_ranks} "
                         "(nodes of equal size, consecutive ranks)")


@dataclass(frozen=True)
class Topology:
    """``num_ranks`` ranks in nodes of ``scaleup_ranks`` consecutive ranks (``scaleup_ranks`` divides ``num_ranks``)."""

    num_ranks: int
    scaleup_ranks: int

    @classmethod
    def of(cls, num_ranks: int, scaleup_ranks: Optional[int]) -> "Topology":
        """The topology ``Buffer(scaleup_ranks=...)`` names; None = one node of every rank."""
        check_scaleup_ranks(scaleup_ranks, num_ranks)
        return cls(num_ranks, num_ranks if scaleup_ranks is None else scaleup_ranks)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.scaleup_ranks

    def node_of(self, rank: int) -> int:
        return rank // self.scaleup_ranks

    def local_index(self, rank: int) -> int:
        return rank % self.scaleup_ranks

    def node_ranks(self, node: int) -> range:
        """The ranks of ``node``, ascending."""
        return range(node * self.scaleup_ranks, (node + 1) * self.scaleup_ranks)

    def in_reach(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` share a node (scale-up reach)."""
        return self.node_of(a) == self.node_of(b)

    def forwarder(self, src: int, node: int) -> int:
        """The rank of ``node`` that forwards ``src``'s tokens inside it: the one with ``src``'s local index."""
        return node * self.scaleup_ranks + self.local_index(src)

    def forwarders(self, rank: int) -> List[int]:
        """``rank``'s forwarders in the other nodes, in node order: also the ranks it forwards for (the relation is
        symmetric)."""
        mine = self.node_of(rank)
        return [self.forwarder(rank, node) for node in range(self.num_nodes) if node != mine]


def transport_mode(puts_to: Sequence[int], num_ranks: int, me: int) -> str:
    """The name of a transport that reaches the ranks ``puts_to`` through puts and the others through stores:
    ``"stores"`` (none through puts), ``"puts"`` (every peer but ``me``, or more) or ``"stores+puts"``."""
    if not puts_to:
        return "stores"
    return "puts" if set(puts_to) >= set(range(num_ranks)) - {me} else "stores+puts"
