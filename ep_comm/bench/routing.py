"""Seeded routing generators for benchmarks, tests and soak runs.

Every generator returns a :class:`Routing`: ``topk_idx`` int64 ``[T, K]`` with K distinct global
expert ids per row (no masked entries) and ``topk_weights`` float32 ``[T, K]``, positive, rows
summing to 1 (a softmax over sorted random logits, so column 0 carries the largest weight, as
after a router's top-k).

Distinct experts are drawn with the Gumbel-top-k trick: the K largest of ``log(p_e) + Gumbel``
are a sample without replacement with probabilities ``p``, which covers uniform (equal ``p``)
and Zipf popularity with one vectorised draw.

For multi-rank runs, give each rank its own stream with ``seed=(base_seed, rank)``; the expert
popularity (Zipf ranking, hot expert) does not depend on the seed, so it is global.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import numpy as np

Seed = Union[int, Sequence[int]]
KINDS = ("uniform", "hot", "zipf")


class Routing(NamedTuple):
    topk_idx: np.ndarray  # [T, K] int64 global expert ids, distinct per row
    topk_weights: np.ndarray  # [T, K] float32, rows sum to 1


def _check_shape(num_tokens: int, num_experts: int, num_topk: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk={num_topk}: must be in [1, num_experts={num_experts}]")


def _top_k_by_gumbel(rng: np.random.Generator, log_p: np.ndarray, num_tokens: int, k: int) -> np.ndarray:
    """[T, k] int64 distinct indices per row, drawn without replacement with probabilities ``exp(log_p)``."""
    if k == 0:
        return np.empty((num_tokens, 0), dtype=np.int64)
    keys = log_p[None, :] + rng.gumbel(size=(num_tokens, log_p.shape[0]))
    part = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1).astype(np.int64)


def _weights(rng: np.random.Generator, num_tokens: int, num_topk: int) -> np.ndarray:
    logits = -np.sort(-rng.standard_normal((num_tokens, num_topk)), axis=1)
    w = np.exp(logits - logits[:, :1])
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def uniform_routing(num_tokens: int, num_experts: int, num_topk: int, seed: Seed = 0) -> Routing:
    """Each token picks ``num_topk`` distinct experts uniformly at random."""
    _check_shape(num_tokens, num_experts, num_topk)
    rng = np.random.default_rng(seed)
    idx = _top_k_by_gumbel(rng, np.zeros(num_experts), num_tokens, num_topk)
    return Routing(idx, _weights(rng, num_tokens, num_topk))


def hot_routing(num_tokens: int, num_experts: int, num_topk: int, seed: Seed = 0, hot_expert: int = 0) -> Routing:
    """Every token picks ``hot_expert`` (column 0) plus ``num_topk - 1`` other distinct experts uniformly."""
    _check_shape(num_tokens, num_experts, num_topk)
    if not 0 <= hot_expert < num_experts:
        raise ValueError(f"hot_expert={hot_expert}: must be in [0, num_experts={num_experts})")
    rng = np.random.default_rng(seed)
    log_p = np.zeros(num_experts)
    log_p[hot_expert] = -np.inf
    others = _top_k_by_gumbel(rng, log_p, num_tokens, num_topk - 1)
    idx = np.concatenate([np.full((num_tokens, 1), hot_expert, dtype=np.int64), others], axis=1)
    return Routing(idx, _weights(rng, num_tokens, num_topk))


def zipf_routing(num_tokens: int, num_experts: int, num_topk: int, seed: Seed = 0, s: float = 1.2) -> Routing:
    """Expert ``e`` has popularity ``(e + 1) ** -s`` (expert 0 hottest, so rank 0 is the most loaded);
    each token picks ``num_topk`` distinct experts by that popularity."""
    _check_shape(num_tokens, num_experts, num_topk)
    if not s > 0:
        raise ValueError(f"s={s}: the Zipf exponent must be > 0")
    rng = np.random.default_rng(seed)
    log_p = -s * np.log(np.arange(1, num_experts + 1, dtype=np.float64))
    idx = _top_k_by_gumbel(rng, log_p, num_tokens, num_topk)
    return Routing(idx, _weights(rng, num_tokens, num_topk))


def make_routing(kind: str, num_tokens: int, num_experts: int, num_topk: int, *, seed: Seed = 0,
                 zipf_s: float = 1.2, hot_expert: int = 0) -> Routing:
    """Dispatch on ``kind`` (``uniform`` | ``hot`` | ``zipf``); the extra arguments apply to their kind only."""
    if kind == "uniform":
        return uniform_routing(num_tokens, num_experts, num_topk, seed)
    if kind == "hot":
        return hot_routing(num_tokens, num_experts, num_topk, seed, hot_expert)
    if kind == "zipf":
        return zipf_routing(num_tokens, num_experts, num_topk, seed, zipf_s)
    raise ValueError(f"routing kind={kind!r}: must be one of {list(KINDS)}")
