"""What ``combine(dispatch(x).recv_x)`` must return, computed with the NumPy reference, and a bitwise comparison.

The round trip without weights returns ``x * (ranks the token reached)`` in compact mode and
``x * (experts the token picked)`` in expand mode, each summed in the contract's float32 order and
rounded to the payload dtype (the reference arithmetic of ``ep_comm.contract.reduce``); forwarded (a Buffer with
``forwarding=True`` and several nodes), in the forwarded order instead (``ep_comm.testing.forwarded``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from ep_comm.contract import layout as lay
from ep_comm.contract.reduce import combine_rows, expand_partials
from ep_comm.testing.forwarded import Forwarded, forwarded_combine

SentBack = Callable[[int, np.ndarray], np.ndarray]  # (rank, rows [T, H]) -> what that rank's experts send back


def expected_round_trip(x: np.ndarray, topk_idx: np.ndarray, num_experts: int, num_ranks: int, expand: bool,
                        weights: Optional[np.ndarray] = None, bias_terms: Sequence[np.ndarray] = (),
                        sent_back: Optional[SentBack] = None, forwarded: Optional[Forwarded] = None) -> np.ndarray:
    """``[T, H]`` payload dtype: what ``combine(dispatch(x).recv_x)`` must return (unweighted, no bias by default).

    Args:
        x: ``[T, H]`` payload of the tokens.
        topk_idx: ``[T, K]`` integer global expert ids, -1 = no expert.
        num_experts: global experts ``E``, split evenly over ``num_ranks`` ranks.
        expand: the dispatch's mode.
        weights: ``[T, K]`` float32 (expand only): each entry's partial is weighted by it.
        bias_terms: up to two ``[T, H]`` arrays (payload dtype or float32) added first.
        sent_back: compact only: rank ``r``'s partial for token ``t`` is ``sent_back(r, x)[t]``
            (default: ``x`` unchanged).
        forwarded: the source rank and ``scaleup_ranks`` of a Buffer with ``forwarding=True`` and several nodes:
            the partials are summed in the forwarded order (:func:`ep_comm.testing.forwarded.forwarded_combine`);
            None: the flat order.

    Returns:
        ``[T, H]`` in ``x.dtype``: in expand mode rank ``r``'s partial is ``x[t]`` summed once per entry of
        ``t`` on ``r`` in top-k order; partials are summed in rank order after the bias, in
        ``ep_comm.contract.reduce``'s float32 order.
    """
    reached = lay.is_token_in_rank(topk_idx, num_experts, num_ranks)
    if not expand:
        partials = [x if sent_back is None else sent_back(r, x) for r in range(num_ranks)]
    else:
        partials = _expand_partials(x, topk_idx, num_experts // num_ranks, num_ranks, weights)
    if forwarded is not None:
        return forwarded_combine(partials, reached, forwarded, tuple(bias_terms))
    return combine_rows(partials, reached, tuple(bias_terms), x.dtype)


def _expand_partials(x: np.ndarray, topk_idx: np.ndarray, experts_per_rank: int, num_ranks: int,
                     weights: Optional[np.ndarray]) -> List[np.ndarray]:
    """Per rank, ``[T, H]`` in ``x.dtype``: its expand partial of each token (``x[t]`` once per entry of ``t`` on
    it, weighted by ``weights [T, K]`` when given, in top-k order, rounded)."""
    ranks = lay.entry_ranks(topk_idx, experts_per_rank)
    if weights is None:  # each entry reads its token's row of x
        y, row, flat_w = x, np.broadcast_to(np.arange(len(x))[:, None], topk_idx.shape), None
    else:  # one row of np.repeat(x, K) per (token, entry), so that each has its own weight
        num_tokens, k = topk_idx.shape
        y, row, flat_w = np.repeat(x, k, axis=0), np.arange(num_tokens * k).reshape(num_tokens, k), weights.reshape(-1)
    return [expand_partials(y, np.where(ranks == r, row, -1), flat_w, x.dtype) for r in range(num_ranks)]


def first_mismatch(got: np.ndarray, want: np.ndarray) -> Optional[str]:
    """None when ``got`` equals ``want`` bit for bit (``[T, H]`` arrays), else a description of the first
    differing element (its token and hidden index and both values)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
    diff = np.ascontiguousarray(got).view(np.uint8) != np.ascontiguousarray(want).view(np.uint8)
    if not diff.any():
        return None
    t, b = np.argwhere(diff)[0]
    h = b // got.dtype.itemsize
    return f"token {t} hidden {h}: got {float(got[t, h])!r}, expected {float(want[t, h])!r}"
