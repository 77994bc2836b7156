"""Combine kernels against ``ep_comm.contract.reduce``: bit for bit, float32/float16/bfloat16, with weights and bias.

Compact mode: the rows a rank received from itself are not sent back into its own buffer; the reduce
reads them from ``y``.
"""
from __future__ import annotations

import numpy as np
import pytest
from combine_checks import PARITY, run_combine
from dispatch_checks import run_dispatch
from world import bits, kernel_world, random_payload, spy_launches

from ep_comm.contract import reduce
from ep_comm.contract.arrays import to_host
from ep_comm.contract.symmetric import payload_rows


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_expand_combine_weighted_with_bias_pair(xp, dtype):
    world = kernel_world(xp, seed=11, dtype=dtype, hidden=40, masked=0.2, nowhere=1)
    run_combine(world, expand=True, weighted=True, bias=2)


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bias", [0, 2])
def test_compact_combine_reads_own_rows_from_y(xp, monkeypatch, ranks, dtype, bias):
    """Compact combine at 1-3 ranks is bit for bit the reference while every rank's own region is poisoned
    and stays so: the own rows are neither copied there nor read from there. With one rank the send
    launches nothing; with several, one copy per rank."""
    from ep_comm.kernels.combine import combine_copy_kernel

    world = kernel_world(xp, seed=20 + ranks, ranks=ranks, experts=12, dtype=dtype, hidden=40, tokens=(7, 9, 4),
                       masked=0.2, nowhere=1)
    launched = spy_launches(monkeypatch)
    run_combine(world, expand=False, weighted=False, bias=bias, deterministic=False, poison_own=True)
    assert launched.count(combine_copy_kernel) == (0 if ranks == 1 else ranks)


def test_compact_reduce_takes_y_and_its_psum_together(xp):
    world = kernel_world(xp, seed=12, ranks=2, experts=4, hidden=8, tokens=(3, 2))
    out = xp.zeros((3, 8), world.device_payload(world.x[0]).dtype)
    with pytest.raises(ValueError, match="y is given but recv_rank_psum is None"):
        world.kernels.combine_reduce(world.views[0].rows, world.step(PARITY), xp.zeros((3, 3), np.int32),
                                     world.dev(world.topk[0]), out, my_rank=0, y=out, stream=0)


@pytest.mark.parametrize("expand", [False, True])
def test_bfloat16_combine_without_bias_reduces_16_bytes_per_access(xp, monkeypatch, expand):
    """The wide bfloat16 reduce (hidden a multiple of 8, no bias) is the one launched, and it is bit
    for bit the reference sum, NaN and infinity rounding included (random payloads hold both)."""
    from ep_comm.kernels.combine import combine_reduce_kernel
    from ep_comm.kernels.combine_bf16 import combine_reduce_bf16_kernel

    world = kernel_world(xp, seed=15, dtype="bfloat16", hidden=72, masked=0.2)
    launched = spy_launches(monkeypatch)
    run_combine(world, expand=expand, weighted=expand, bias=0)
    assert combine_reduce_bf16_kernel in launched and combine_reduce_kernel not in launched


def test_expand_combine_unweighted_no_bias_many_ranks(xp):
    world = kernel_world(xp, seed=13, ranks=4, experts=16, topk=5, tokens=(9, 0, 12, 5), hidden=8)
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
    from ep_comm.launching.kernel_launches import Kernels

    world = kernel_world(xp, seed=16, dtype=dtype, hidden=hidden, tokens=(5, 3, 1), masked=0.2)
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


@pytest.mark.parametrize("ranks, hidden, topk, weighted, bias, split", [
    (1, 8, 8, True, 0, False),  # one word pair per row, two groups of terms
    (1, 1000, 8, False, 0, True),  # rows cut into pieces (few rows), the last piece shorter
    (2, 72, 3, False, 2, False),
    (2, 512, 5, True, 0, False),  # a whole number of loop trips (512 elements)
    (3, 200, 4, True, 2, False),
    (3, 1024, 6, False, 0, True),
])
def test_expand_combine_bfloat16_sends_16_bytes_per_access(xp, monkeypatch, ranks, hidden, topk, weighted, bias,
                                                           split):
    """bfloat16 expand combine with rows of whole 16-byte pairs: the wide expand send is the one launched (once
    per rank, never the general one) and the combine is bit for bit the reference, weighted or not, with and
    without bias, whole rows or pieces (``split``: thousands of warps' worth of pieces for few rows)."""
    from ep_comm.kernels.combine import combine_expand_kernel
    from ep_comm.kernels.combine_bf16 import combine_expand_bf16_kernel

    world = kernel_world(xp, seed=30 + hidden, ranks=ranks, experts=16 * ranks, topk=topk, hidden=hidden,
                       tokens=(6, 4, 3), masked=0.2, nowhere=1)
    if split:
        world.kernels.split_warps = 256
    arguments = []
    launched = spy_launches(monkeypatch, arguments)
    run_combine(world, expand=True, weighted=weighted, bias=bias)
    assert launched.count(combine_expand_bf16_kernel) == ranks and combine_expand_kernel not in launched
    spans = [args[8] for kernel, args in arguments if kernel is combine_expand_bf16_kernel]  # in words
    assert all((span < hidden // 4) == split for span in spans)


@pytest.mark.parametrize("dtype, hidden", [("float32", 72), ("float16", 72), ("bfloat16", 44)])
def test_expand_combine_general_kernel_for_narrow_payloads(xp, monkeypatch, dtype, hidden):
    """float32, float16 and bfloat16 rows that are not whole 16-byte pairs (44 elements: 11 words) take the
    general expand send, bit for bit the reference."""
    from ep_comm.kernels.combine import combine_expand_kernel
    from ep_comm.kernels.combine_bf16 import combine_expand_bf16_kernel

    world = kernel_world(xp, seed=17, ranks=2, experts=8, topk=3, dtype=dtype, hidden=hidden, tokens=(5, 4))
    launched = spy_launches(monkeypatch)
    run_combine(world, expand=True, weighted=True, bias=0)
    assert launched.count(combine_expand_kernel) == 2 and combine_expand_bf16_kernel not in launched


@pytest.mark.parametrize("weighted", [False, True])
def test_expand_send_bfloat16_signed_zeros_are_the_reference_partials(xp, weighted):
    """The wide expand send's rows in the sources' buffers are ``reduce.expand_partials`` bit for bit when
    most terms are -0.0 and weights include -0.0, 0 and negatives (``acc = 0`` first: sums of -0.0 are +0.0)."""
    world = kernel_world(xp, seed=18, ranks=2, experts=16, topk=6, hidden=136, tokens=(5, 4), masked=0.1)
    world.kernels.split_warps = 256
    sent, received = run_dispatch(world, deterministic=True, expand=True, alignment=2, zero_padding=True)
    rng = np.random.default_rng(3)
    for d in range(world.num_ranks):
        rows = len(received[d].recv_x)
        y = random_payload(rng, (rows, world.hidden), world.dtype)
        y[rng.random(y.shape) < 0.7] = -0.0
        weights = rng.choice(np.float32([-0.0, 0.0, -1.5, 0.75]), rows) if weighted else None
        meta = received[d].recv_src_metadata
        world.kernels.combine_scatter(world.device_payload(y), xp.asarray(meta), received[d].counts.rank_psum,
                                   [v.rows for v in world.views], my_rank=d, step=world.step(PARITY), expand=True,
                                   weights=world.dev(weights), stream=0)
        n = len(world.arrivals(d, sent))
        want = reduce.expand_partials(y, meta[:n, 2:], weights, world.dtype)
        sources = meta[:n, 0] // world.max_tokens
        for i, (src, slot) in enumerate(zip(sources, meta[:n, 1] - sources * world.max_tokens)):
            got = to_host(payload_rows(world.views[src].rows, world.dtype)[PARITY, d, slot])
            np.testing.assert_array_equal(got, bits(want[i]))
