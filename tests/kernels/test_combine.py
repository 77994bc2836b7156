"""Combine kernels against ``ep_comm.reduce``: bit for bit, float32/float16/bfloat16, with weights and bias.

Compact mode: the rows a rank received from itself are not sent back into its own buffer; the reduce
reads them from ``y``.
"""
from __future__ import annotations

import numpy as np
import pytest

from ep_comm import layout as ref
from ep_comm import reduce
from ep_comm.host import to_host
from ep_comm.launching.views import payload_rows
from test_dispatch import make_world, run_dispatch
from world import bits, random_payload, spy_launches

PARITY = 0  # dispatch ran with parity 1


def expected_combine(world, sent, received, ys, weights, bias_terms, expand: bool) -> list:
    """Per source rank: ``reduce.combine_rows`` over the partials ``reduce.expand_partials`` makes."""
    from_rank = []
    for d in range(world.num_ranks):
        n = len(world.arrivals(d, sent))
        meta = received[d].recv_src_metadata[:n]
        partial = (reduce.expand_partials(ys[d], meta[:, 2:], weights[d], world.dtype) if expand else ys[d][:n])
        from_rank.append((meta, partial))
    out = []
    for s in range(world.num_ranks):
        tokens = world.topk[s].shape[0]
        rows = []
        for meta, partial in from_rank:
            per_token = np.zeros((tokens, world.hidden), world.dtype)
            mine = meta[:, 0] // world.max_tokens == s
            per_token[meta[mine, 0] % world.max_tokens] = partial[mine]
            rows.append(per_token)
        reached = ref.is_token_in_rank(world.topk[s], world.num_experts, world.num_ranks)
        out.append(reduce.combine_rows(rows, reached, bias_terms[s], world.dtype))
    return out


def poison_own_regions(world) -> list:
    """Fill every rank's own region ``rows[PARITY, rank]`` with all-one bits (NaN in every payload dtype);
    returns a copy of each region as filled."""
    filled = []
    for s, view in enumerate(world.views):
        view.rows[PARITY, s] = np.iinfo(view.rows.dtype).max
        filled.append(to_host(view.rows[PARITY, s]).copy())
    return filled


def run_combine(world, *, expand: bool, weighted: bool, bias: int, deterministic: bool = True,
                poison_own: bool = False):
    """Dispatch, combine on every rank and compare with the reference bit for bit; with ``poison_own``
    (compact), every rank's own region is poisoned before the combine and must stay untouched by it."""
    sent, received = run_dispatch(world, deterministic=deterministic, expand=expand, alignment=2, zero_padding=True)
    poisoned = poison_own_regions(world) if poison_own else None
    rng = np.random.default_rng(7)
    k, xp = world.kernels, world.xp
    ys, device_ys, weights = [], [], []
    for d in range(world.num_ranks):
        rows = len(received[d].recv_x) if expand else received[d].recv_src_metadata.shape[0]
        ys.append(random_payload(rng, (rows, world.hidden), world.dtype))
        device_ys.append(world.device_payload(ys[d]))
        weights.append(rng.standard_normal(rows).astype(np.float32) if weighted and expand else None)
        k.combine_send(device_ys[d], xp.asarray(received[d].recv_src_metadata),
                       received[d].counts.rank_psum, [v.rows for v in world.views], my_rank=d, step=world.step(PARITY),
                       expand=expand, weights=world.dev(weights[d]))
    for s, region in enumerate(poisoned or ()):
        np.testing.assert_array_equal(to_host(world.views[s].rows[PARITY, s]), region)
    bias_terms = []
    for s in range(world.num_ranks):
        shape = (world.topk[s].shape[0], world.hidden)
        terms = [random_payload(rng, shape, world.dtype), random_payload(rng, shape, np.dtype(np.float32))][:bias]
        bias_terms.append(terms)
    want = expected_combine(world, sent, received, ys, weights, bias_terms, expand)
    for s in range(world.num_ranks):
        out = xp.full((world.topk[s].shape[0], world.hidden), 3, world.device_payload(world.x[s]).dtype)
        own = {} if expand else dict(y=device_ys[s], recv_rank_psum=received[s].counts.rank_psum)
        k.combine_reduce(world.views[s].rows, world.step(PARITY), xp.asarray(sent[s].slot_idx),
                         world.dev(world.topk[s]), out, my_rank=s,
                         bias=[world.device_payload(b) for b in bias_terms[s]], **own)
        np.testing.assert_array_equal(bits(to_host(out)), bits(want[s]))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_expand_combine_weighted_with_bias_pair(xp, dtype):
    world = make_world(xp, seed=11, dtype=dtype, hidden=40, masked=0.2, nowhere=1)
    run_combine(world, expand=True, weighted=True, bias=2)


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bias", [0, 2])
def test_compact_combine_reads_own_rows_from_y(xp, monkeypatch, ranks, dtype, bias):
    """Compact combine at 1-3 ranks is bit for bit the reference while every rank's own region is poisoned
    and stays so: the own rows are neither copied there nor read from there. With one rank the send
    launches nothing; with several, one copy per rank."""
    from ep_comm.kernels.combine import combine_copy_kernel

    world = make_world(xp, seed=20 + ranks, ranks=ranks, experts=12, dtype=dtype, hidden=40, tokens=(7, 9, 4),
                       masked=0.2, nowhere=1)
    launched = spy_launches(monkeypatch)
    run_combine(world, expand=False, weighted=False, bias=bias, deterministic=False, poison_own=True)
    assert launched.count(combine_copy_kernel) == (0 if ranks == 1 else ranks)


def test_compact_reduce_takes_y_and_its_psum_together(xp):
    world = make_world(xp, seed=12, ranks=2, experts=4, hidden=8, tokens=(3, 2))
    out = xp.zeros((3, 8), world.device_payload(world.x[0]).dtype)
    with pytest.raises(ValueError, match="y is given but recv_rank_psum is None"):
        world.kernels.combine_reduce(world.views[0].rows, world.step(PARITY), xp.zeros((3, 3), np.int32),
                                     world.dev(world.topk[0]), out, my_rank=0, y=out)


@pytest.mark.parametrize("expand", [False, True])
def test_bfloat16_combine_without_bias_reduces_16_bytes_per_access(xp, monkeypatch, expand):
    """The wide bfloat16 reduce (hidden a multiple of 8, no bias) is the one launched, and it is bit
    for bit the reference sum, NaN and infinity rounding included (random payloads hold both)."""
    from ep_comm.kernels.combine import combine_reduce_bf16_kernel, combine_reduce_kernel

    world = make_world(xp, seed=15, dtype="bfloat16", hidden=72, masked=0.2)
    launched = spy_launches(monkeypatch)
    run_combine(world, expand=expand, weighted=expand, bias=0)
    assert combine_reduce_bf16_kernel in launched and combine_reduce_kernel not in launched


def test_expand_combine_unweighted_no_bias_many_ranks(xp):
    world = make_world(xp, seed=13, ranks=4, experts=16, topk=5, tokens=(9, 0, 12, 5), hidden=8)
    run_combine(world, expand=True, weighted=False, bias=0)


def test_payload_rows_views_words_as_elements():
    rows = np.zeros((2, 3, 4, 5), np.uint64)
    assert payload_rows(rows, np.float16).shape == (2, 3, 4, 20)
    assert payload_rows(rows, np.float32).dtype == np.float32


@pytest.mark.parametrize("dtype, hidden, bias, expand", [
    ("bfloat16", 2600, 0, False),  # 650 words: wide copies and the wide reduce
    ("float32", 2600, 2, True),  # the general reduce, expand rows copied to several places
    ("float16", 2601, 1, False),  # 16-bit words: narrow copies
])
def test_long_rows_are_cut_into_uneven_pieces(xp, monkeypatch, dtype, hidden, bias, expand):
    """Few tokens with long rows: the row kernels (scatter, receive rows, combine copy, reduce) cut rows into
    pieces, the last one shorter, one warp per piece; every output stays bit for bit the reference."""
    from ep_comm.launching.kernels import Kernels

    world = make_world(xp, seed=16, dtype=dtype, hidden=hidden, tokens=(5, 3, 1), masked=0.2)
    world.kernels.split_warps = 64
    cuts = []
    row_pieces = Kernels._row_pieces

    def spy(self, rows, n, quantum):
        span, blocks = row_pieces(self, rows, n, quantum)
        cuts.append((n, span))
        return span, blocks

    monkeypatch.setattr(Kernels, "_row_pieces", spy)
    run_combine(world, expand=expand, weighted=expand, bias=bias)
    assert len(cuts) == 12 - 3 * expand  # scatter, receive rows and reduce per rank, combine copy (compact)
    assert all(span < n and n % span for n, span in cuts)
