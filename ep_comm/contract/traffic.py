"""The byte model of a routing on nodes: rows and bytes each rank sends over scale-up (NVLink) and scale-out (RDMA)
for a dispatch and its combine, sent flat or forwarded, and the time they take at stated link rates.

Only rows that leave a rank count (a token's row to its own rank crosses no link). Experts live on ranks in
contiguous blocks (``ep_comm.contract.layout.is_token_in_rank``); ranks in nodes as ``ep_comm.contract.topology``
says. Per source rank ``s`` and token, ``D`` = the distinct destination ranks of the token other than ``s``:

* **flat** dispatch: ``s`` sends one row to every rank of ``D``: over scale-up to those of its node, over scale-out
  to the rest. Flat combine: every rank of ``D`` sends its partial row back to ``s`` the same way.
* **forwarded** dispatch (DeepEP-V1 style): ``s`` sends the rows of its own node over scale-up as flat; for every
  other node holding a rank of ``D`` it sends one row over scale-out to that node's forwarder
  (``Topology.forwarder(s, node)``, whether or not the forwarder is in ``D``), and the forwarder sends it over
  scale-up to the ranks of ``D`` in its node other than itself. Those scale-up rows are counted as the
  forwarder's: they leave the forwarder's GPU, so they load its NVLink, not ``s``'s.
* **forwarded** combine, the reverse route reduced in the node (docs/design.md, "Combine"): every rank of ``D`` in
  a remote node other than the forwarder sends its partial over scale-up to the forwarder (counted as that rank's),
  and the forwarder sums its node's partials and sends one row per token over scale-out to ``s`` (counted as the
  forwarder's). Its scale-out rows are the forwarded dispatch's (one per token and distinct remote node), sent by
  the forwarders instead of ``s``.

Bytes are rows times the bytes of one row of the operation (the caller's: ``hidden * itemsize``, or FP8 and its
scales for an FP8 dispatch). The model time of an operation is the slowest link: the largest, over ranks and their
two links, of the bytes a rank sends over a link divided by the link's rate (each GPU sends over its own links in
parallel; the receiving side and latency are not modelled).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from ep_comm.contract.layout import is_token_in_rank
from ep_comm.contract.topology import Topology

OPS = ("dispatch", "combine")  # axis 0 of sent_rows
ROUTES = ("flat", "forwarded")  # axis 1
LINKS = ("scaleup", "scaleout")  # axis 2
LINK_RATES_GBPS = {"scaleup": 356.0, "scaleout": 50.0}  # GB/s per GPU: NVLink, and 400 Gb/s RDMA


def sent_rows(topk_idx: np.ndarray, src_rank: int, num_experts: int, topology: Topology) -> np.ndarray:
    """Rows each rank sends over each link to move ``src_rank``'s tokens, as the module docstring counts them.

    Args:
        topk_idx: int64 ``[T, K]`` global expert ids of ``src_rank``'s tokens, -1 = no expert.
        src_rank: the rank whose tokens these are.
        num_experts: global experts, a multiple of ``topology.num_ranks``.
        topology: ranks in nodes.

    Returns:
        int64 ``[len(OPS), len(ROUTES), len(LINKS), R]``: ``rows[op, route, link, r]`` = rows rank ``r`` sends
        over ``link`` (axes named by :data:`OPS`, :data:`ROUTES`, :data:`LINKS`). Sum over source ranks for a world.
    """
    num_ranks, size = topology.num_ranks, topology.scaleup_ranks
    dest = is_token_in_rank(topk_idx, num_experts, num_ranks)
    dest[:, src_rank] = False
    per_rank = dest.sum(axis=0, dtype=np.int64)  # [R] rows to (dispatch) and from (combine) each rank
    own = topology.node_of(src_rank)
    in_node = np.array([topology.node_of(r) == own for r in range(num_ranks)])
    rows = np.zeros((len(OPS), len(ROUTES), len(LINKS), num_ranks), dtype=np.int64)
    up, out = LINKS.index("scaleup"), LINKS.index("scaleout")
    for route in range(len(ROUTES)):  # the own node's rows go over scale-up either way
        rows[0, route, up, src_rank] = per_rank[in_node].sum()
        rows[1, route, up] = np.where(in_node, per_rank, 0)
    rows[0, 0, out, src_rank] = per_rank[~in_node].sum()
    rows[1, 0, out] = np.where(in_node, 0, per_rank)
    nodes_hit = dest.reshape(len(dest), topology.num_nodes, size).any(axis=2).sum(axis=0)
    for node in range(topology.num_nodes):
        if node == own:
            continue
        forwarder, ranks = topology.forwarder(src_rank, node), topology.node_ranks(node)
        node_rows = per_rank[ranks.start:ranks.stop].sum()
        rows[0, 1, out, src_rank] += nodes_hit[node]
        rows[0, 1, up, forwarder] += node_rows - per_rank[forwarder]
        rows[1, 1, up, ranks.start:ranks.stop] += per_rank[ranks.start:ranks.stop]
        rows[1, 1, up, forwarder] -= per_rank[forwarder]
        rows[1, 1, out, forwarder] += nodes_hit[node]
    return rows


def world_rows(topk_by_rank: Sequence[np.ndarray], num_experts: int, topology: Topology) -> np.ndarray:
    """:func:`sent_rows` summed over the source ranks; ``topk_by_rank[r]``: rank ``r``'s ``topk_idx`` ``[T_r, K]``.

    Returns:
        int64 ``[len(OPS), len(ROUTES), len(LINKS), R]``: the rows each rank sends over each link in all.
    """
    return sum((sent_rows(idx, r, num_experts, topology) for r, idx in enumerate(topk_by_rank)),
               np.zeros((len(OPS), len(ROUTES), len(LINKS), topology.num_ranks), dtype=np.int64))


def model_time_s(scaleup_bytes: np.ndarray, scaleout_bytes: np.ndarray,
                 scaleup_gbps: float = LINK_RATES_GBPS["scaleup"],
                 scaleout_gbps: float = LINK_RATES_GBPS["scaleout"]) -> float:
    """Seconds of the slowest link: ``max_r max(scaleup_bytes[r] / scaleup rate, scaleout_bytes[r] / scaleout
    rate)``, rates in GB/s (1e9 bytes/s) per GPU; bytes ``[R]`` sent by each rank over each link."""
    up = np.asarray(scaleup_bytes, dtype=np.float64) / (scaleup_gbps * 1e9)
    out = np.asarray(scaleout_bytes, dtype=np.float64) / (scaleout_gbps * 1e9)
    return float(np.maximum(up, out).max(initial=0.0))


class UniformExpectation(NamedTuple):
    """Expected distinct destinations per token other than its own rank, for top-k without replacement uniform
    over the experts (floats)."""

    in_node_ranks: float  # ranks of the own node: scale-up rows per token of a flat dispatch
    remote_node_ranks: float  # ranks of other nodes: scale-out rows per token flat
    remote_nodes: float  # other nodes: scale-out rows per token forwarded (dispatch, and its combine)


def uniform_expectation(num_experts: int, topk: int, num_ranks: int, scaleup_ranks: int) -> UniformExpectation:
    """:class:`UniformExpectation` of ``topk`` distinct experts drawn uniformly from ``num_experts`` on ``num_ranks``
    ranks in nodes of ``scaleup_ranks``.

    A group of ``g`` experts (a rank's or a node's block) is missed with probability ``C(E - g, K) / C(E, K)``, so
    ``E[distinct remote nodes] = (nodes - 1) * (1 - C(E - E/nodes, K) / C(E, K))`` and
    ``E[distinct ranks of other nodes] = (R - scaleup_ranks) * (1 - C(E - E/R, K) / C(E, K))`` (linearity of
    expectation over the groups); the own node's other ranks likewise with ``scaleup_ranks - 1``.
    """
    topology = Topology.of(num_ranks, scaleup_ranks)
    total = math.comb(num_experts, topk)

    def hit(group: int) -> float:
        return 1.0 - math.comb(num_experts - group, topk) / total

    per_rank = hit(num_experts // num_ranks)
    return UniformExpectation(in_node_ranks=(scaleup_ranks - 1) * per_rank,
                              remote_node_ranks=(num_ranks - scaleup_ranks) * per_rank,
                              remote_nodes=(topology.num_nodes - 1) * hit(num_experts // topology.num_nodes))
