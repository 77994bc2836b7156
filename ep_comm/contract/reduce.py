"""Reference combine arithmetic in NumPy: the fixed float32 order every backend reproduces bit for bit.

Two stages (see ``docs/design.md``, "Combine"):

1. on the expert side, each received (compact) row ``i`` becomes one partial row: compact mode
   sends ``y[i]`` unchanged; expand mode reduces ``i``'s expanded rows in top-k order,
   ``acc = 0.0f; acc = acc + w * y[row_k]`` (multiply, round, add, round: no fused multiply-add),
   and rounds ``acc`` to the payload dtype before sending it back;
2. on the source side, ``acc = 0.0f``, plus each bias term, plus the partial of every rank the
   token reached in ascending rank order, rounded once to the payload dtype.

Forwarded (``Buffer(forwarding=True)`` with several nodes), a remote node's partials of a token are first summed at
its forwarder (:func:`node_sum`: from 0.0f, ascending rank, rounded to the payload dtype), and that one row is the
node's term in stage 2, at the place of the node's first rank (:func:`combine_rows` over those terms).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np


def expand_partials(
    y: np.ndarray, expanded_row: np.ndarray, weights: Optional[np.ndarray], out_dtype: np.dtype
) -> np.ndarray:
    """``[N, H]`` partial rows in ``out_dtype`` from expanded rows ``y [M, H]``.

    ``expanded_row [N, K]`` gives the expanded row of each (row, entry), -1 if none; ``weights``
    is ``[M]`` float32 per expanded row or None (unweighted).
    """
    num_rows, num_topk = expanded_row.shape
    acc = np.zeros((num_rows, y.shape[1]), dtype=np.float32)
    for k in range(num_topk):
        rows = np.nonzero(expanded_row[:, k] >= 0)[0]
        src = expanded_row[rows, k]
        term = y[src].astype(np.float32)
        if weights is not None:
            term = weights[src].astype(np.float32)[:, None] * term
        acc[rows] = acc[rows] + term
    return acc.astype(out_dtype)


def combine_rows(
    rows_from_rank: Sequence[np.ndarray], reached: np.ndarray, bias_terms: Sequence[np.ndarray],
    out_dtype: np.dtype,
) -> np.ndarray:
    """Source-side reduce to ``[T, H]`` in ``out_dtype``.

    ``rows_from_rank[r]`` is ``[T, H]`` (payload dtype): the row rank ``r`` sent back for each
    token, ignored where ``reached[T, R]`` is False. A rank is added only where reached: adding
    +0.0 is not a no-op on -0.0.
    """
    num_tokens = reached.shape[0]
    hidden = rows_from_rank[0].shape[1] if len(rows_from_rank) else 0
    acc = np.zeros((num_tokens, hidden), dtype=np.float32)
    for term in bias_terms:
        acc = acc + np.asarray(term).astype(np.float32)
    for r, rows in enumerate(rows_from_rank):
        mask = reached[:, r]
        acc[mask] = acc[mask] + rows[mask].astype(np.float32)
    return acc.astype(out_dtype)


def node_sum(tokens_by_rank: Sequence[np.ndarray], rows_by_rank: Sequence[np.ndarray],
             out_dtype: np.dtype) -> Tuple[np.ndarray, np.ndarray]:
    """Stage 1 of the forwarded combine, at the forwarder of (source, node): one row per token of the source.

    Args:
        tokens_by_rank: per rank of the node, ascending: int ``[n_i]`` the source tokens it holds (each once).
        rows_by_rank: per rank of the node: ``[n_i, H]`` its partials of those tokens (payload dtype).
        out_dtype: the payload dtype.

    Returns:
        ``(tokens, rows)``: int64 ``[n]`` the tokens any rank holds, ascending, and ``[n, H]`` in ``out_dtype``:
        ``acc = 0.0f``, plus the partial of every rank holding the token in ascending rank order, rounded once.
    """
    tokens = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens_by_rank]))
    hidden = rows_by_rank[0].shape[1]
    acc = np.zeros((len(tokens), hidden), dtype=np.float32)
    for held, rows in zip(tokens_by_rank, rows_by_rank):
        at = np.searchsorted(tokens, held)
        acc[at] = acc[at] + rows.astype(np.float32)
    return tokens, acc.astype(out_dtype)
