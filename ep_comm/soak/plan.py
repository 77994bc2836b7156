"""What a soak run does: the shape, each iteration's plan (a function of ``(seed, iteration)``, the same on every
rank) and every rank's inputs of it (a function of ``(seed, iteration, rank)``, so any rank can rebuild anyone's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ep_comm.contract.choices import payload_dtype
from ep_comm.testing.routing import KINDS, make_routing, mask_routing, random_payload, token_count

FORCED_STEPS = 4  # the first iterations run the worst cases, so warm-up reaches the peak memory


@dataclass(frozen=True)
class Shape:
    """The Buffer geometry of a run."""

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens: int
    dtype: str


@dataclass(frozen=True)
class Step:
    """One iteration's plan, the same on every rank (drawn from ``(seed, index)``)."""

    index: int
    routing: str  # ep_comm.testing.routing kind
    mask_rate: float  # share of top-k entries set to -1
    nowhere_rate: float  # share of tokens with every entry -1
    token_mode: str  # random | full | some_empty | small
    expand: bool
    alignment: int
    zero_padding: bool
    cpu_sync: bool
    weights: bool  # dispatched; compact combine gathers them back, expand combine is weighted
    bias: bool  # combine with a bias [T, H]
    replay: bool  # a cached dispatch of another payload with the handle, then its combine
    check: bool  # full check of this iteration

    def describe(self) -> str:
        padding = " zero_padding" if self.zero_padding else ""
        mode = f"expand align={self.alignment}{padding}" if self.expand else "compact"
        flags = [f for f, on in (("cpu_sync=False", not self.cpu_sync), ("weights", self.weights),
                                 ("bias", self.bias), ("replay", self.replay)) if on]
        return (f"iteration {self.index} [{self.routing}, {mode}, tokens {self.token_mode}, mask {self.mask_rate}, "
                f"nowhere {self.nowhere_rate}{', ' if flags else ''}{', '.join(flags)}]")


def forced_step(index: int, alignment: int) -> Step:
    """The worst cases, run first: full ranks, worst-case (``cpu_sync=False``) outputs, the largest alignment."""
    expand, cpu_sync = index in (1, 2), index in (2, 3)
    return Step(index, "hot", 0.0, 0.0, "full", expand, alignment if expand else 1, expand, cpu_sync,
                weights=index % 2 == 1, bias=index % 2 == 0, replay=cpu_sync, check=True)


def plan_step(seed: int, index: int, check_every: int, alignments: Sequence[int]) -> Step:
    """The plan of iteration ``index``; a function of ``(seed, index)`` only."""
    if index < FORCED_STEPS:
        return forced_step(index, max(alignments))
    rng = np.random.default_rng((seed, index, 0))
    expand = bool(rng.random() < 0.5)
    return Step(
        index=index,
        routing=str(rng.choice(KINDS)),
        mask_rate=float(rng.choice([0.0, 0.0, 0.1, 0.5])),
        nowhere_rate=float(rng.choice([0.0, 0.0, 0.1])),
        token_mode=str(rng.choice(["random", "random", "full", "some_empty", "small"])),
        expand=expand,
        alignment=int(rng.choice(alignments)) if expand else 1,
        zero_padding=bool(rng.random() < 0.5),
        cpu_sync=bool(rng.random() < 0.75),
        weights=bool(rng.random() < 0.5),
        bias=bool(rng.random() < 0.5),
        replay=bool(rng.random() < 0.25),
        check=index % check_every == 0,
    )


@dataclass
class RankInputs:
    """One rank's inputs of one iteration."""

    rows: np.ndarray  # [T] int64: payload row t is row rows[t] of the base payload
    topk_idx: np.ndarray  # [T, K] int64, -1 = no expert
    topk_weights: np.ndarray  # [T, K] float32


def rank_inputs(shape: Shape, step: Step, seed: int, rank: int, base_rows: int) -> RankInputs:
    """``rank``'s inputs of ``step``: a function of ``(seed, step, rank)``, so every rank can rebuild anyone's."""
    rng = np.random.default_rng((seed, step.index, rank + 1))
    t = token_count(step.token_mode, shape.max_tokens, rng, rank, turn=step.index)
    routing = make_routing(step.routing, t, shape.num_experts, shape.num_topk, seed=(seed, step.index, rank, 1),
                           hot_expert=(seed + step.index) % shape.num_experts)
    idx = mask_routing(routing.topk_idx, rng, entry_rate=step.mask_rate, token_rate=step.nowhere_rate)
    return RankInputs(rng.integers(0, base_rows, t), idx, routing.topk_weights)


def base_payload(shape: Shape, seed: int) -> np.ndarray:
    """``[2 * max_tokens, H]`` payload rows every iteration picks its tokens from; some entries are -0.0."""
    return random_payload(np.random.default_rng((seed, 1 << 30)), (2 * shape.max_tokens, shape.hidden),
                          payload_dtype(shape.dtype), negative_zero_rate=0.01)


def replay_rows(rows: np.ndarray, base_rows: int) -> np.ndarray:
    """``[T]`` base rows of the replay's payload (another payload, the same routing)."""
    return (rows + 1) % base_rows


def bias_rows(rows: np.ndarray, base_rows: int) -> np.ndarray:
    """``[T]`` base rows of the combine's bias."""
    return (rows + 2) % base_rows
