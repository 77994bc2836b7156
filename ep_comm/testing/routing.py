"""Seeded inputs for benchmarks, tests and soak runs: routings, masks, token counts and payloads.

Every routing generator returns a :class:`Routing`: ``topk_idx`` int64 ``[T, K]`` with K distinct global
expert ids per row (no masked entries) and ``topk_weights`` float32 ``[T, K]``, positive, rows
summing to 1 (a softmax over sorted random logits, so column 0 carries the largest weight, as
after a router's top-k).

Distinct experts are drawn with the Gumbel-top-k trick: the K largest of ``log(p_e) + Gumbel``
are a sample without replacement with probabilities ``p``, which covers uniform (equal ``p``)
and Zipf popularity with one vectorised draw.

For multi-rank runs, give each rank its own stream with ``seed=(base_seed, rank)``; the expert
popularity (Zipf ranking, hot expert) does not depend on the seed, so it is global. A seed may
also be a ``numpy.random.Generator``, which is then drawn from (and advanced).

Masked entries, tokens going nowhere (:func:`mask_routing`), empty ranks (:func:`token_count`) and
payloads with ``-0.0`` entries (:func:`random_payload`) are drawn from a generator the caller owns,
so that every rank can rebuild every other rank's inputs from shared seeds.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple, Union

import numpy as np

Seed = Union[int, Sequence[int], np.random.Generator]
KINDS = ("uniform", "hot", "zipf")
TOKEN_MODES = ("random", "full", "some_empty", "small", "one", "all_empty")
SMALL_TOKENS = 8  # the most tokens a rank holds in token mode "small"


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
                 zipf_s: float = 1.2, hot_expert: int = 0, idx_dtype: np.dtype = np.int64) -> Routing:
    """Dispatch on ``kind`` (``uniform`` | ``hot`` | ``zipf``); the extra arguments apply to their kind only.

    Returns a :class:`Routing` whose ``topk_idx`` has dtype ``idx_dtype`` (an integer dtype).
    """
    if kind == "uniform":
        routing = uniform_routing(num_tokens, num_experts, num_topk, seed)
    elif kind == "hot":
        routing = hot_routing(num_tokens, num_experts, num_topk, seed, hot_expert)
    elif kind == "zipf":
        routing = zipf_routing(num_tokens, num_experts, num_topk, seed, zipf_s)
    else:
        raise ValueError(f"routing kind={kind!r}: must be one of {list(KINDS)}")
    if not np.issubdtype(idx_dtype, np.integer):
        raise ValueError(f"idx_dtype={np.dtype(idx_dtype).name}: must be an integer dtype")
    return Routing(routing.topk_idx.astype(idx_dtype, copy=False), routing.topk_weights)


def mask_routing(topk_idx: np.ndarray, rng: np.random.Generator, *, entry_rate: float = 0.0,
                 token_rate: float = 0.0, first_tokens: int = 0) -> np.ndarray:
    """A copy of ``topk_idx [T, K]`` with entries set to -1 ("no expert"), drawn from ``rng``.

    Each entry is masked with probability ``entry_rate``, then every entry of a token with
    probability ``token_rate`` (a token going nowhere), then every entry of the first
    ``first_tokens`` tokens. Both draws are taken whatever the rates, so that the stream of ``rng``
    does not depend on them. Returns ``[T, K]`` in the dtype of ``topk_idx``.
    """
    for name, rate in (("entry_rate", entry_rate), ("token_rate", token_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name}={rate}: must be in [0, 1]")
    if first_tokens < 0:
        raise ValueError(f"first_tokens={first_tokens}: must be >= 0")
    idx = np.array(topk_idx, copy=True)
    idx[rng.random(idx.shape) < entry_rate] = -1
    idx[rng.random(len(idx)) < token_rate] = -1
    idx[:first_tokens] = -1
    return idx


def token_count(mode: str, max_tokens: int, rng: np.random.Generator, rank: int, turn: int = 0) -> int:
    """A rank's token count in ``[0, max_tokens]`` under token ``mode``.

    ``random``: uniform in ``[0, max_tokens]``; ``full``: ``max_tokens``; ``some_empty``: 0 on the ranks
    with ``rank + turn`` even, else random; ``small``: uniform in ``[0, min(max_tokens, 8)]``; ``one``: 1;
    ``all_empty``: 0. Only the random modes draw from ``rng`` (one integer).
    """
    if mode not in TOKEN_MODES:
        raise ValueError(f"token mode={mode!r}: must be one of {list(TOKEN_MODES)}")
    if mode == "full":
        return max_tokens
    if mode == "all_empty" or (mode == "some_empty" and (rank + turn) % 2 == 0):
        return 0
    if mode == "one":
        return 1
    high = min(max_tokens, SMALL_TOKENS) if mode == "small" else max_tokens
    return int(rng.integers(0, high + 1))


def random_payload(rng: np.random.Generator, shape: Tuple[int, ...], dtype: np.dtype,
                   negative_zero_rate: float = 0.0) -> np.ndarray:
    """``shape`` standard normal values drawn in float32, a share ``negative_zero_rate`` of them set to
    ``-0.0`` (adding +0.0 to it is not a no-op), rounded to ``dtype``. The masking draw is taken only
    when the rate is not 0."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if negative_zero_rate:
        x[rng.random(shape) < negative_zero_rate] = -0.0
    return x.astype(dtype)
