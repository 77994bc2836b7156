"""What the contract says comes out of the collective suites of ``tests/mpi``: the world's inputs and expectations.

Written from docs/design.md with plain loops, independent of ``ep_comm.contract.layout`` and ``ep_comm.contract.reduce``,
so that the suite checks the backends (and the reference) against the contract itself.
Every rank computes the same expectations from the allgathered inputs. A combine of Buffers that forward (several
nodes) is expected in the forwarded order, from ``ep_comm.testing.forwarded`` (itself independent of the reduce).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import ml_dtypes
import numpy as np
from mpi4py import MPI

from ep_comm.contract.arrays import to_host
from ep_comm.testing.forwarded import Forwarded, forwarded_combine
from helpers.options import current

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.rank, COMM.size


def bits(a: Any) -> np.ndarray:
    """Bytes of an array (NumPy's, or the GPU's copied to the host), for byte-exact comparisons."""
    return np.ascontiguousarray(to_host(a)).view(np.uint8)


@dataclass
class World:
    """Every rank's routing and payload (index = rank)."""

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens: int
    dtype: np.dtype
    topk_idx: List[np.ndarray]  # [T_r, K] int64 per rank
    x: List[np.ndarray]  # [T_r, H] per rank
    weights: List[np.ndarray]  # [T_r, K] float32 per rank

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // WORLD

    def entries_on(self, src: int, token: int, dst: int) -> List[int]:
        """Top-k positions k of (src, token) whose expert lives on ``dst``."""
        lo, hi = dst * self.experts_per_rank, (dst + 1) * self.experts_per_rank
        return [k for k, e in enumerate(self.topk_idx[src][token]) if lo <= e < hi]

    def received(self, dst: int) -> List[tuple]:
        """(src, token) pairs ``dst`` receives in compact mode, ascending (src, token)."""
        return [(s, t) for s in range(WORLD) for t in range(len(self.topk_idx[s])) if self.entries_on(s, t, dst)]

    def expert_rows(self, dst: int, local_expert: int) -> List[tuple]:
        """(src, token, k) triples of local expert ``local_expert`` on ``dst``, ascending (src, token)."""
        e = dst * self.experts_per_rank + local_expert
        return [(s, t, int(np.nonzero(self.topk_idx[s][t] == e)[0][0]))
                for s in range(WORLD) for t in range(len(self.topk_idx[s])) if e in self.topk_idx[s][t]]

    def ranks_of(self, token: int) -> List[int]:
        """Ranks this rank's ``token`` reaches, ascending."""
        return sorted({int(e) // self.experts_per_rank for e in self.topk_idx[RANK][token] if e >= 0})


def make_world(routing: str, num_experts: int = None, hidden: int = 24, num_topk: int = 4, max_tokens: int = 24,
               dtype: str = "bfloat16", seed: int = 0) -> World:
    """Build this rank's inputs from ``routing`` and allgather everyone's.

    Routings: ``uniform``; ``masked`` (some entries -1, some tokens go nowhere); ``hot`` (expert 0
    in every token); ``zero_rank`` (rank 0 has no tokens); ``uneven`` (token counts differ);
    ``full`` (every rank at ``max_tokens``).
    """
    num_experts = num_experts or 4 * WORLD
    rng = np.random.default_rng(1000 * seed + RANK)
    num_tokens = {"zero_rank": 0 if RANK == 0 else max_tokens // 2, "uneven": 3 + 5 * RANK % max_tokens,
                  "full": max_tokens}.get(routing, max_tokens // 2 + RANK)
    num_tokens = min(num_tokens, max_tokens)
    idx = np.stack([rng.choice(num_experts, num_topk, replace=False) for _ in range(num_tokens)]) \
        if num_tokens else np.zeros((0, num_topk), dtype=np.int64)
    idx = idx.astype(np.int64)
    if routing == "masked" and num_tokens:
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[: max(1, num_tokens // 4)] = -1  # tokens that go nowhere
    if routing == "hot" and num_tokens:
        has0 = (idx == 0).any(axis=1)
        idx[~has0, 0] = 0
    x = rng.standard_normal((num_tokens, hidden)).astype(DTYPES[dtype])
    w = rng.random((num_tokens, num_topk)).astype(np.float32)
    gathered = COMM.allgather((idx, x, w))
    return World(num_experts, hidden, num_topk, max_tokens, DTYPES[dtype],
                 [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered])


def align(n: int, a: int) -> int:
    return -(-n // a) * a


def expected_compact_combine(world: World, y_of: Optional[dict] = None, bias=(),
                             scaleup_ranks: Optional[int] = None) -> np.ndarray:
    """``[T, H]``: 0.0f + bias terms + for each rank reached (ascending) the row sent back,
    rounded once. ``y_of[(rank, token)]`` is the row rank sends back (default: x[token]).

    ``scaleup_ranks``: the nodes of a Buffer that forwards (``WORLD``: one node, the flat order); None: the
    session's Buffers' (``helpers.options``). With several nodes, in the forwarded order (:func:`forwarded_sum`).
    """
    nodes = current().forwarded_nodes(WORLD) if scaleup_ranks is None else scaleup_ranks
    if nodes is not None and nodes < WORLD:
        return forwarded_sum(world, y_of, bias, nodes)
    x = world.x[RANK]
    acc = np.zeros(x.shape, dtype=np.float32)
    for term in bias:
        acc = acc + term.astype(np.float32)
    for t in range(len(x)):
        for r in world.ranks_of(t):
            row = x[t] if y_of is None else y_of[(r, t)]
            acc[t] = acc[t] + row.astype(np.float32)
    return acc.astype(world.dtype)


def forwarded_sum(world: World, y_of: Optional[dict], bias, scaleup_ranks: int) -> np.ndarray:
    """:func:`expected_compact_combine` of a Buffer forwarding in nodes of ``scaleup_ranks``: the rows sent back
    summed in the forwarded order (``ep_comm.testing.forwarded_combine``)."""
    x = world.x[RANK]
    reached = np.zeros((len(x), WORLD), dtype=bool)
    partials = [np.zeros_like(x) for _ in range(WORLD)]
    for t in range(len(x)):
        for r in world.ranks_of(t):
            reached[t, r] = True
            partials[r][t] = x[t] if y_of is None else y_of[(r, t)]
    return forwarded_combine(partials, reached, Forwarded(RANK, scaleup_ranks), bias)


def expected_expand_combine(world: World, weighted: bool, scaleup_ranks: Optional[int] = None) -> np.ndarray:
    """Expand combine of ``y = recv_x``: per rank, ``acc = 0; acc += w_k * x`` over its entries
    in top-k order, rounded to the payload dtype; then the rank partials summed as in compact (``scaleup_ranks``
    as there)."""
    x, w = world.x[RANK], world.weights[RANK]
    partial = {}
    for t in range(len(x)):
        for r in world.ranks_of(t):
            acc = np.zeros(world.hidden, dtype=np.float32)
            for k in world.entries_on(RANK, t, r):
                term = x[t].astype(np.float32)
                acc = acc + (w[t, k] * term if weighted else term)
            partial[(r, t)] = acc.astype(world.dtype)
    return expected_compact_combine(world, partial, scaleup_ranks=scaleup_ranks)
