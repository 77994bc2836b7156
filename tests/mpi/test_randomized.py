"""Randomized contract test: hypothesis draws dispatch/combine cases, every rank runs each one collectively.

Collective hypothesis needs every rank to draw the same examples and to fail the same ones:

* ``derandomize=True`` and no database: the examples are a function of this file's source;
  health checks (timing dependent) are off; only shared parameters are drawn, rank-specific
  inputs come from ``numpy.random.default_rng((seed, rank))``;
* each example first allgathers the drawn case and fails on every rank if they differ;
* each example runs all its collective calls first, then checks locally, then allgathers the
  failures: one rank's failed assertion fails the example on every rank, so shrinking stays
  in step. A rank that raises in the middle of a collective makes its peers time out after
  ``TIMEOUT_S``: never an endless hang.

Each rank's outputs go through the shared checker (``ep_comm.testing.check``, the NumPy reference);
the reference's rows, counts and combine are checked against the plain loops of ``helpers/oracle.py``
(written from ``docs/design.md``).
Run by ``tests/jobs/test_multirank.py`` under ``mpirun -n 1..4`` with ``--with-mpi``; the backend and transport from
``--backend`` and ``--transport``; the number of examples from the Hypothesis profile (``tests/conftest.py``:
``ci`` 150, ``gpu`` 20, ``nodes`` 50: the virtual-node jobs), the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np
import pytest
from helpers.collective import agree_on, fail_together, to_device
from helpers.options import current
from helpers.oracle import RANK, WORLD, World, bits, expected_compact_combine, expected_expand_combine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ep_comm
from ep_comm.contract.arrays import to_host
from ep_comm.testing.check import (
    DispatchOptions,
    HostDispatch,
    Sources,
    check_combine,
    check_dispatch,
    expected_receive,
)
from ep_comm.testing.dtypes import DTYPES
from ep_comm.testing.routing import KINDS, make_routing, mask_routing, random_payload, token_count

pytestmark = pytest.mark.mpi
BUFFER_KWARGS = current().buffer_kwargs()  # backend, and on nvshmem its transport
TIMEOUT_S = 20.0
TOKEN_MODES = ("random", "some_empty", "full", "one", "all_empty")


@dataclass(frozen=True)
class Case:
    """One drawn example; identical on every rank."""

    seed: int
    experts_per_rank: int
    num_topk: int
    hidden: int
    max_tokens: int
    dtype: str
    routing: str  # one of ep_comm.testing.routing.KINDS
    mask_rate: float  # share of top-k entries set to -1
    nowhere_rate: float  # share of tokens with every entry -1
    token_mode: str  # how each rank's token count is drawn (ep_comm.testing.routing.token_count)
    idx_dtype: str
    expand: bool
    alignment: int
    zero_padding: bool
    deterministic: bool
    cpu_sync: bool
    with_weights: bool
    bias_terms: int  # compact combine: 0, 1 or 2 bias arrays
    replay: bool  # also a cached dispatch of a new payload with the handle

    @property
    def num_experts(self) -> int:
        return self.experts_per_rank * WORLD

    def options(self) -> DispatchOptions:
        return DispatchOptions(self.expand, self.alignment, self.zero_padding, self.cpu_sync, self.with_weights,
                               self.deterministic, current().forwarded_nodes(WORLD))


@st.composite
def cases(draw) -> Case:
    experts_per_rank = draw(st.integers(1, 4))
    return Case(
        seed=draw(st.integers(0, 2**31 - 1)),
        experts_per_rank=experts_per_rank,
        num_topk=draw(st.integers(1, min(4, experts_per_rank * WORLD))),
        hidden=draw(st.sampled_from([1, 3, 8, 24])),
        max_tokens=draw(st.integers(1, 12)),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        routing=draw(st.sampled_from(KINDS)),
        mask_rate=draw(st.sampled_from([0.0, 0.25, 0.6])),
        nowhere_rate=draw(st.sampled_from([0.0, 0.2])),
        token_mode=draw(st.sampled_from(TOKEN_MODES)),
        idx_dtype=draw(st.sampled_from(["int64", "int32"])),
        expand=draw(st.booleans()),
        alignment=draw(st.sampled_from([1, 2, 8])),
        zero_padding=draw(st.booleans()),
        deterministic=draw(st.booleans()),
        cpu_sync=draw(st.booleans()),
        with_weights=draw(st.booleans()),
        bias_terms=draw(st.integers(0, 2)),
        replay=draw(st.booleans()),
    )


# ---------------------------------------------------------------- inputs
NEGATIVE_ZERO_RATE = 0.1  # -0.0 entries of payloads and biases (adding +0.0 is not a no-op on them)


def rank_inputs(case: Case, rank: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(topk_idx [T, K] idx_dtype, x [T, H] payload, weights [T, K] float32)`` of ``rank``."""
    rng = np.random.default_rng((case.seed, rank))
    t = token_count(case.token_mode, case.max_tokens, rng, rank, turn=case.seed)
    routing = make_routing(case.routing, t, case.num_experts, case.num_topk, seed=(case.seed, rank, 1),
                           hot_expert=case.seed % case.num_experts, idx_dtype=case.idx_dtype)
    idx = mask_routing(routing.topk_idx, rng, entry_rate=case.mask_rate, token_rate=case.nowhere_rate)
    x = random_payload(rng, (t, case.hidden), DTYPES[case.dtype], NEGATIVE_ZERO_RATE)
    return idx, x, routing.topk_weights


def case_world(case: Case) -> World:
    """Every rank's inputs; each rank builds them all from the seed (no communication)."""
    inputs = [rank_inputs(case, r) for r in range(WORLD)]
    return World(case.num_experts, case.hidden, case.num_topk, case.max_tokens, DTYPES[case.dtype],
                 [i[0].astype(np.int64) for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs])


def expert_output(rows: np.ndarray, rank: int) -> np.ndarray:
    """What rank ``rank``'s "experts" send back for received rows (compact combine): a rank-dependent map."""
    return (rows.astype(np.float32) * np.float32(rank + 2) - np.float32(rank)).astype(rows.dtype)


# ---------------------------------------------------------------- collective part
@dataclass
class Received:
    """Host copies of one dispatch, the stats after it and the combine of its outputs."""

    dispatch: HostDispatch
    stats: np.ndarray
    combined: np.ndarray
    combined_w: Optional[np.ndarray]


def run_collective(buf: ep_comm.Buffer, case: Case, world: World, bias: List[np.ndarray]) -> List[Received]:
    """Dispatch (and, with ``case.replay``, a cached dispatch of ``2x``) and combine each; no checks here."""
    stats = to_device(np.zeros(case.experts_per_rank, dtype=np.int64))
    weights = to_device(world.weights[RANK]) if case.with_weights else None
    idx = to_device(world.topk_idx[RANK].astype(case.idx_dtype))
    out = buf.dispatch(to_device(world.x[RANK]), idx, weights, expand=case.expand,
                       expert_alignment=case.alignment, zero_padding=case.zero_padding,
                       cpu_sync=case.cpu_sync, stats=stats)
    got = [_combine(buf, case, out, stats, bias)]
    if case.replay:
        x2 = doubled(world.x[RANK])
        again = buf.dispatch(to_device(x2), handle=out.handle, cpu_sync=case.cpu_sync, stats=stats)
        got.append(_combine(buf, case, again, stats, bias))
    return got


def doubled(x: np.ndarray) -> np.ndarray:
    """The replay's payload: ``2x + 1`` in the payload dtype."""
    return (x.astype(np.float32) * 2 + 1).astype(x.dtype)


def _combine(buf: ep_comm.Buffer, case: Case, out, stats, bias: List[np.ndarray]) -> Received:
    h = out.handle
    recv_x = to_host(out.recv_x)
    if case.expand:
        weights = out.recv_topk_weights if case.with_weights else None
        res = buf.combine(out.recv_x, h, topk_weights=weights)
    else:
        y = to_device(expert_output(recv_x, RANK))
        terms = [to_device(b) for b in bias]
        res = buf.combine(y, h, topk_weights=out.recv_topk_weights,
                          bias=None if not terms else terms[0] if len(terms) == 1 else tuple(terms))
    return Received(HostDispatch.of(out), to_host(stats).copy(), to_host(res.x), to_host(res.topk_weights))


# ---------------------------------------------------------------- checks (local)
def check_received(case: Case, world: World, got: Received, bias: List[np.ndarray], dispatches: int) -> None:
    """The shared checker on this rank's outputs; then the reference it checks against, the stats after
    ``dispatches`` dispatches and the combine against the oracle's plain loops."""
    sources = Sources(world.num_experts, world.max_tokens, world.topk_idx, world.x, world.weights)
    sent_back = None if case.expand else (lambda r, rows: expert_output(rows, r))
    problems = check_dispatch(sources, RANK, case.options(), got.dispatch)
    problems += check_combine(sources, RANK, case.options(), got.combined, got.combined_w, bias, sent_back)
    assert not problems, problems
    want = expected_receive(sources, RANK)
    assert [divmod(int(o), case.max_tokens) for o in want.origin] == world.received(RANK), "reference != oracle"
    per_expert = [len(world.expert_rows(RANK, e)) for e in range(case.experts_per_rank)]
    assert want.expert_counts(case.experts_per_rank).tolist() == per_expert, "reference != oracle"
    np.testing.assert_array_equal(got.stats, [dispatches * n for n in per_expert])
    check_combine_against_oracle(case, world, got, bias)


def check_combine_against_oracle(case: Case, world: World, got: Received, bias: List[np.ndarray]) -> None:
    """Bitwise equal to the oracle's float32-order reduction."""
    if case.expand:
        want = expected_expand_combine(world, case.with_weights)
    else:
        y_of = {(r, t): expert_output(world.x[RANK][t], r) for t in range(len(world.x[RANK]))
                for r in world.ranks_of(t)}
        want = expected_compact_combine(world, y_of, bias)
    assert bits(got.combined).tobytes() == bits(want).tobytes(), "combine differs from the float32-order oracle"
    if case.with_weights:
        np.testing.assert_array_equal(got.combined_w, np.where(world.topk_idx[RANK] >= 0, world.weights[RANK], 0))
    else:
        assert got.combined_w is None


def check_case(case: Case, world: World, results: List[Received], bias: List[np.ndarray]) -> None:
    check_received(case, world, results[0], bias, 1)
    if case.replay:  # same routing, new payload: same rows, same metadata
        np.testing.assert_array_equal(results[1].dispatch.meta, results[0].dispatch.meta)
        replayed = replace(world, x=[doubled(x) for x in world.x])
        check_received(case, replayed, results[1], bias, 2)


@settings(derandomize=True, suppress_health_check=list(HealthCheck), print_blob=False)  # examples: the profile's
@given(case=cases())
def test_randomized_dispatch_combine(case: Case):
    agree_on(case)

    def body() -> None:
        world = case_world(case)
        rng = np.random.default_rng((case.seed, RANK, 2))
        bias = [random_payload(rng, world.x[RANK].shape, DTYPES[case.dtype], NEGATIVE_ZERO_RATE)
                for _ in range(0 if case.expand else case.bias_terms)]
        with ep_comm.Buffer(num_experts=case.num_experts, hidden=case.hidden, num_topk=case.num_topk,
                            num_max_tokens_per_rank=case.max_tokens, dtype=case.dtype, **BUFFER_KWARGS,
                            deterministic=case.deterministic, timeout_s=TIMEOUT_S) as buf:
            results = run_collective(buf, case, world, bias)
        check_case(case, world, results, bias)

    fail_together(body)
