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

Expectations come from ``oracle.py`` (plain loops written from DESIGN.md).
Run by ``tests/test_multirank.py`` under ``mpirun -n 1..4`` with ``--with-mpi``; the backend and transport from
``--backend`` and ``--transport``; the number of examples from the Hypothesis profile (``tests/conftest.py``:
``ci`` 150, ``gpu`` 20), the same on every rank.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ep_comm
from ep_comm.bench.routing import KINDS, make_routing
from ep_comm.host import to_host
from helpers.collective import to_device
from helpers.oracle import (COMM, DTYPES, RANK, WORLD, World, align, bits, expected_compact_combine,
                            expected_expand_combine)
from helpers.options import current

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
    routing: str  # one of ep_comm.bench.routing.KINDS
    mask_rate: float  # share of top-k entries set to -1
    nowhere_rate: float  # share of tokens with every entry -1
    token_mode: str  # how each rank's token count is drawn, see ``num_tokens``
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
def num_tokens(case: Case, rng: np.random.Generator, rank: int) -> int:
    """Tokens of ``rank`` in ``[0, max_tokens]`` by the case's token mode."""
    mode = case.token_mode
    if mode == "full":
        return case.max_tokens
    if mode == "all_empty":
        return 0
    if mode == "one":
        return 1
    if mode == "some_empty" and (rank + case.seed) % 2 == 0:
        return 0
    return int(rng.integers(0, case.max_tokens + 1))


def payload(rng: np.random.Generator, shape: Tuple[int, int], dtype: str) -> np.ndarray:
    """``shape`` random payload in ``dtype``, with some -0.0 entries (adding +0.0 is not a no-op on them)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.1] = -0.0
    return x.astype(DTYPES[dtype])


def rank_inputs(case: Case, rank: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(topk_idx [T, K] idx_dtype, x [T, H] payload, weights [T, K] float32)`` of ``rank``."""
    rng = np.random.default_rng((case.seed, rank))
    t = num_tokens(case, rng, rank)
    routing = make_routing(case.routing, t, case.num_experts, case.num_topk, seed=(case.seed, rank, 1),
                           hot_expert=case.seed % case.num_experts)
    idx = routing.topk_idx.copy()
    idx[rng.random(idx.shape) < case.mask_rate] = -1
    idx[rng.random(t) < case.nowhere_rate] = -1
    return idx.astype(case.idx_dtype), payload(rng, (t, case.hidden), case.dtype), routing.topk_weights


def make_world(case: Case) -> World:
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
    """Host copies of one dispatch and the combine of its outputs."""

    recv_x: np.ndarray
    recv_idx: np.ndarray
    recv_w: Optional[np.ndarray]
    meta: np.ndarray
    psum_rank: np.ndarray
    psum_expert: np.ndarray
    aligned: np.ndarray
    unaligned: np.ndarray
    num_recv: int
    num_expanded: int
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
    return Received(
        recv_x, to_host(out.recv_topk_idx), to_host(out.recv_topk_weights), to_host(h.recv_src_metadata),
        to_host(h.psum_num_recv_tokens_per_rank), to_host(h.psum_num_recv_tokens_per_expert),
        np.asarray(to_host(h.num_recv_tokens_per_expert)), to_host(h.num_unaligned_recv_tokens_per_expert),
        int(to_host(h.num_recv_tokens)), int(to_host(h.num_expanded_tokens)), to_host(stats).copy(),
        to_host(res.x), to_host(res.topk_weights))


# ---------------------------------------------------------------- checks (local)
def check_compact_rows(case: Case, world: World, got: Received) -> List[Tuple[int, int]]:
    """Every (token, rank) pair delivered exactly once, grouped by source, payload byte-exact;
    returns the origins ``(src, token)`` of the received rows in row order."""
    recv = world.received(RANK)
    counts = [sum(1 for s, _ in recv if s == src) for src in range(WORLD)]
    np.testing.assert_array_equal(got.psum_rank, np.cumsum(counts))
    assert got.num_recv == len(recv)
    n = got.num_recv
    origins = [divmod(int(m), case.max_tokens) for m in got.meta[:n, 0]]
    if case.deterministic:
        assert origins == recv, "deterministic rows must be in (source rank, source token) order"
    else:
        assert sorted(origins) == recv, "each (token, rank) pair exactly once"
        assert [s for s, _ in origins] == sorted(s for s, _ in origins), "rows must be grouped by source rank"
    assert got.meta.shape == ((n if case.cpu_sync else WORLD * case.max_tokens), 2 + case.num_topk)
    assert (got.meta[n:] == -1).all(), "unused metadata rows carry -1"
    for i, (s, t) in enumerate(origins):
        entries = world.entries_on(s, t, RANK)
        has_row = [bool(got.meta[i, 2 + k] >= 0) for k in range(case.num_topk)]
        assert has_row == [case.expand and k in entries for k in range(case.num_topk)], f"row {i}: expanded rows"
        if not case.expand:
            check_compact_row(case, world, got, i, s, t)
    return origins


def check_compact_row(case: Case, world: World, got: Received, i: int, s: int, t: int) -> None:
    """Compact row ``i`` carries token ``t`` of rank ``s``: payload, local expert ids, weights."""
    assert bits(got.recv_x[i]).tobytes() == bits(world.x[s][t]).tobytes(), f"row {i} from {(s, t)}"
    entries = world.entries_on(s, t, RANK)
    for k in range(case.num_topk):
        want = world.topk_idx[s][t, k] - RANK * case.experts_per_rank if k in entries else -1
        assert got.recv_idx[i, k] == want, f"row {i} entry {k}: local expert id"
        if case.with_weights and k in entries:
            assert got.recv_w[i, k] == world.weights[s][t, k], f"row {i} entry {k}: weight"


def check_compact_outputs(case: Case, got: Received) -> None:
    rows = got.num_recv if case.cpu_sync else WORLD * case.max_tokens
    assert got.recv_x.shape == (rows, case.hidden) and got.recv_idx.shape == (rows, case.num_topk)
    assert (got.recv_idx[got.num_recv:] == -1).all(), "unused rows carry -1 in recv_topk_idx"
    assert (got.recv_w is not None) == case.with_weights


def check_expand_rows(case: Case, world: World, got: Received, origins: List[Tuple[int, int]]) -> None:
    """Every (token, local expert) pair delivered exactly once into its expert's aligned block."""
    m, k_max = got.num_expanded, case.num_topk
    start, owner = 0, {}
    for e in range(case.experts_per_rank):
        rows = world.expert_rows(RANK, e)
        assert got.psum_expert[e] - start == len(rows), "psum[i] - align(psum[i-1]) must be expert i's count"
        assert got.unaligned[e] == len(rows) and got.aligned[e] == align(len(rows), case.alignment)
        for j in range(start, start + len(rows)):
            owner[j] = e
        start = align(int(got.psum_expert[e]), case.alignment)
    assert m == start
    worst = align(WORLD * case.max_tokens * min(k_max, case.experts_per_rank)
                  + (case.alignment - 1) * case.experts_per_rank, case.alignment)
    assert got.recv_x.shape == ((m if case.cpu_sync else worst), case.hidden) and got.recv_idx.shape == (len(got.recv_x),)
    placed = {}
    for i, (s, t) in enumerate(origins):
        for k in world.entries_on(s, t, RANK):
            row = int(got.meta[i, 2 + k])
            e = int(world.topk_idx[s][t, k]) - RANK * case.experts_per_rank
            assert owner.get(row) == e, f"entry ({s}, {t}, {k}) placed at row {row}, outside expert {e}'s block"
            assert row not in placed, f"rows {placed.get(row)} and {(s, t, k)} share expanded row {row}"
            placed[row] = (s, t, k)
            assert bits(got.recv_x[row]).tobytes() == bits(world.x[s][t]).tobytes()
            assert got.recv_idx[row] == e
            if case.with_weights:
                assert got.recv_w[row] == world.weights[s][t, k]
    assert len(placed) == len(owner), "every (token, local expert) pair exactly once"
    if case.deterministic:
        for e in range(case.experts_per_rank):
            block = sorted(j for j, o in owner.items() if o == e)
            assert [placed[j] for j in block] == world.expert_rows(RANK, e), f"expert {e}: rows out of order"
    padding = [j for j in range(len(got.recv_x)) if j not in placed]
    assert (got.recv_idx[padding] == -1).all(), "padding and unused rows carry -1"
    if case.zero_padding:
        assert not bits(got.recv_x[[j for j in padding if j < m]]).any(), "padding rows must be exactly zero"


def check_combine(case: Case, world: World, got: Received, bias: List[np.ndarray]) -> None:
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


def check_received(case: Case, world: World, got: Received, bias: List[np.ndarray], dispatches: int) -> None:
    origins = check_compact_rows(case, world, got)
    if case.expand:
        check_expand_rows(case, world, got, origins)
    else:
        check_compact_outputs(case, got)
    want_stats = [dispatches * len(world.expert_rows(RANK, e)) for e in range(case.experts_per_rank)]
    np.testing.assert_array_equal(got.stats, want_stats)
    check_combine(case, world, got, bias)


def check_case(case: Case, world: World, results: List[Received], bias: List[np.ndarray]) -> None:
    check_received(case, world, results[0], bias, 1)
    if case.replay:  # same routing, new payload: same rows, same metadata
        np.testing.assert_array_equal(results[1].meta, results[0].meta)
        replayed = replace(world, x=[doubled(x) for x in world.x])
        check_received(case, replayed, results[1], bias, 2)


# ---------------------------------------------------------------- collective failure
def fail_together(body: Callable[[], None]) -> None:
    """Run ``body`` on every rank; if it raised on any rank, raise AssertionError on every rank
    with each failing rank's error, so all ranks fail (and shrink) the same examples."""
    try:
        body()
        error = None
    except Exception as exc:  # any failure, reported collectively below
        error = f"rank {RANK}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    errors = [e for e in COMM.allgather(error) if e]
    if errors:
        raise AssertionError(f"{len(errors)} of {WORLD} ranks failed:\n" + "\n".join(errors))


def agree_on(case: Case) -> None:
    """Every rank must have drawn the same case: a divergence fails at once instead of hanging."""
    drawn = COMM.allgather(repr(case))
    if len(set(drawn)) != 1:
        raise AssertionError("hypothesis drew different examples on different ranks:\n" + "\n".join(drawn))


@settings(derandomize=True, suppress_health_check=list(HealthCheck), print_blob=False)  # examples: the profile's
@given(case=cases())
def test_randomized_dispatch_combine(case: Case):
    agree_on(case)

    def body() -> None:
        world = make_world(case)
        rng = np.random.default_rng((case.seed, RANK, 2))
        bias = [payload(rng, world.x[RANK].shape, case.dtype) for _ in range(0 if case.expand else case.bias_terms)]
        with ep_comm.Buffer(num_experts=case.num_experts, hidden=case.hidden, num_topk=case.num_topk,
                            num_max_tokens_per_rank=case.max_tokens, dtype=case.dtype, **BUFFER_KWARGS,
                            deterministic=case.deterministic, timeout_s=TIMEOUT_S) as buf:
            results = run_collective(buf, case, world, bias)
        check_case(case, world, results, bias)

    fail_together(body)
