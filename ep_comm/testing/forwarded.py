"""What a forwarded combine (``Buffer(forwarding=True)`` with several nodes) must return: the two-stage order of
docs/design.md ("Combine"), written from that page with plain loops per token, independent of
``ep_comm.contract.reduce`` and of the backends.

Stage 1, at the forwarder of (source, remote node): ``0.0f`` plus the partials of that node's ranks holding the
token, in ascending rank order, rounded to the payload dtype. Stage 2, at the source: ``0.0f``, plus each bias term,
plus the terms in ascending rank order, where the ranks of a remote node give one term (their stage-1 row) at the
place of the node's first rank and the ranks of the source's node give their partials; rounded once.
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Sequence

import numpy as np


class Forwarded(NamedTuple):
    """Whose combine, in which nodes: the source rank, and ``scaleup_ranks`` of the forwarding Buffer."""

    source: int
    scaleup_ranks: int


def _terms(partials: Sequence[np.ndarray], reached: np.ndarray, token: int, nodes: Forwarded) -> Iterator[np.ndarray]:
    """The terms of ``token`` in stage 2's order: per node ascending, the source's node rank by rank, any other
    node as its stage-1 row (payload dtype)."""
    size = nodes.scaleup_ranks
    for node in range(len(partials) // size):
        ranks: List[int] = [r for r in range(node * size, (node + 1) * size) if reached[token, r]]
        if node == nodes.source // size:
            yield from (partials[r][token] for r in ranks)
        elif ranks:
            rows = [partials[r][token] for r in ranks]
            acc = np.zeros(rows[0].shape, dtype=np.float32)
            for row in rows:
                acc = acc + row.astype(np.float32)
            yield acc.astype(rows[0].dtype)


def forwarded_combine(partials: Sequence[np.ndarray], reached: np.ndarray, nodes: Forwarded,
                      bias_terms: Sequence[np.ndarray] = ()) -> np.ndarray:
    """The source's combined tokens ``[T, H]`` (payload dtype) in the forwarded order.

    Args:
        partials: per rank ``r`` (``R`` of them), ``[T, H]`` payload dtype: ``r``'s partial of each token of the
            source (compact: the row it sends back; expand: its top-k-ordered sum, rounded), read where reached.
        reached: ``[T, R]`` bool: the ranks each token reached.
        nodes: the source rank and the Buffer's ``scaleup_ranks`` (a divisor of ``R``).
        bias_terms: up to two ``[T, H]`` arrays (payload dtype or float32), added first.
    """
    num_tokens, hidden = reached.shape[0], partials[0].shape[1]
    out = np.zeros((num_tokens, hidden), dtype=partials[0].dtype)
    for t in range(num_tokens):
        acc = np.zeros(hidden, dtype=np.float32)
        for bias in bias_terms:
            acc = acc + np.asarray(bias)[t].astype(np.float32)
        for term in _terms(partials, reached, t, nodes):
            acc = acc + term.astype(np.float32)
        out[t] = acc.astype(out.dtype)
    return out
