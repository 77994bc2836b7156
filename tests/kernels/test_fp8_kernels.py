"""The FP8 device code (``ep_comm.kernels.fp8``) against ``ml_dtypes`` and ``ep_comm.contract.fp8.quantize``, bit for bit,
and the packed FP8 rows (narrower than the symmetric rows) through the scatter and receive kernels: as prepared
rows, written by the scatter from the pair where it lies, and cast by the scatter as it reads each row."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from dispatch_checks import check_compact, run_dispatch
from fp8_world import narrow_world
from numba import cuda

from ep_comm.contract import fp8
from ep_comm.contract.arrays import to_host
from ep_comm.kernels.fp8 import e4m3x2_bits, f32_to_e4m3_bits


@cuda.jit
def convert_kernel(values, out):
    i = cuda.grid(1)
    while i < values.shape[0]:
        out[i] = f32_to_e4m3_bits(values[i])
        i += cuda.gridsize(1)


@cuda.jit
def convert_pairs_kernel(values, out):
    i = cuda.grid(1)
    while i < out.shape[0] // 2:
        pair = e4m3x2_bits(values[2 * i + 1], values[2 * i])
        out[2 * i] = pair & 0xFF
        out[2 * i + 1] = pair >> 8
        i += cuda.gridsize(1)


def boundary_values() -> np.ndarray:
    """float32 values around every e4m3fn rounding boundary: each finite e4m3fn value, the midpoints between
    neighbours (ties to even), one and two float32 ulps either side of both; subnormals, ±0, ±448 and past it,
    the float32 extremes, random bit patterns in and beyond range; both signs."""
    codes = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0 .. 448
    mids = (codes[:-1].astype(np.float64) + codes[1:]) / 2
    points = np.concatenate([codes, mids.astype(np.float32), [464.0, 480.0, 1e6, np.finfo(np.float32).max,
                                                             np.finfo(np.float32).tiny, 1e-45, 2.0**-10, 2.0**-11]])
    bits = points.astype(np.float32).view(np.int32)
    near = np.concatenate([bits + d for d in (-2, -1, 0, 1, 2)])
    near = near[near >= 0]
    rng = np.random.default_rng(7)
    spread = rng.integers(0, 0x44000000, size=3000, dtype=np.int64).astype(np.int32)  # up to ~512
    magnitudes = np.concatenate([near, spread, [0x7F800000]]).view(np.float32)
    return np.concatenate([magnitudes, -magnitudes]).astype(np.float32)


def reference_bits(values: np.ndarray) -> np.ndarray:
    """ml_dtypes' e4m3fn bits of ``clip(values, -448, 448)`` (what ``ep_comm.contract.fp8.quantize`` does)."""
    with np.errstate(invalid="ignore"):  # the NaN inputs cast to e4m3fn's NaN, as they should
        return np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize("pairs", [False, True], ids=["f32_to_e4m3_bits", "e4m3x2_bits"])
def test_conversion_matches_ml_dtypes_at_every_rounding_boundary(xp, pairs):
    """Both conversions (the scalar one, and the pair the cast uses: one cvt instruction on a GPU)."""
    values = boundary_values()
    out = xp.zeros(values.shape, dtype=np.int64)
    if pairs:
        convert_pairs_kernel[4, 64](xp.asarray(values), out)
    else:
        convert_kernel[4, 64](xp.asarray(values), out)
    got = to_host(out)
    want = reference_bits(values)
    if pairs:  # the cvt instruction gives a NaN the NaN bits of either sign (the H200 gives -NaN 0x7F): NaN is NaN
        nan = np.isnan(values)
        assert set(got[nan].tolist()) <= {0x7F, 0xFF}
        want = np.where(nan, got, want)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(float(values[i]), hex(values[i:i + 1].view(np.uint32)[0]), int(got[i]), int(want[i]))
                          for i in bad[:10]]


def test_conversion_of_nan_is_the_signed_nan(xp):
    values = np.array([np.nan, -np.nan], dtype=np.float32)
    values[1] = -np.abs(values[1])
    out = xp.zeros(2, dtype=np.int64)
    convert_kernel[1, 32](xp.asarray(values), out)
    assert to_host(out).tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_scatter_and_receive_carry_a_payload_narrower_than_the_symmetric_row(xp, expand, deterministic):
    """The scatter copies ``x_words.shape[1]`` words per row and the receive ``recv_x.shape[1]``: packed FP8 rows
    (272 bytes for hidden 256) cross rows of 512 bytes byte for byte, compact and expand (aligned, zero padded),
    exact and worst-case outputs."""
    world = narrow_world(xp, seed=11, hidden=256, masked=0.2)
    run_dispatch(world, deterministic=deterministic, expand=expand, alignment=4, zero_padding=True)
    run_dispatch(world, deterministic=deterministic, expand=expand, alignment=4, zero_padding=True, worst_case=True,
                 parity=0)


def check_direct_replay(world, new_rows: bool) -> None:
    """A new routing, then its cached compact replay on the direct path (own rows straight into ``recv_x``), with
    the payload rows reversed first when ``new_rows``: every rank's outputs checked against the expected rows."""
    sent, first = run_dispatch(world, deterministic=False, expand=False)
    if new_rows:
        world.x = [x[::-1].copy() for x in world.x]  # new payload rows, same routing
    outputs = [world.outputs(expand=False, alignment=1, worst_case=False, num_rows=len(got.recv_x),
                             num_expanded=len(got.recv_x), cached=got) for got in first]
    world.send(0, deterministic=False, cached=[item.slot_idx for item in sent],
               direct=[(out[0], got.counts.rank_psum) for out, got in zip(outputs, first)])
    for d in range(world.num_ranks):
        again = world.receive(d, 0, expand=False, alignment=1, zero_padding=False, deterministic=False,
                              cached=first[d], outputs=outputs[d], skip_source=d)
        check_compact(world, d, again, world.expected_compact(d, sent))


def test_a_cached_compact_replay_writes_narrow_rows_straight_into_recv_x(xp):
    """The direct path of a cached compact dispatch (own rows into ``recv_x``) with a narrow payload."""
    check_direct_replay(narrow_world(xp, seed=12, hidden=384, masked=0.2), new_rows=True)


@pytest.mark.parametrize("source", ["pair", "cast"])
@pytest.mark.parametrize("expand", [False, True])
def test_the_scatter_writes_packed_rows_from_the_pair_or_the_cast(xp, source, expand):
    """No packed copy before the send: the scatter reads the pair where it lies (FP8 bytes, then the scales two to
    a word, then the pad), or casts the payload as it reads it, and the rows that arrive are byte for byte
    ``ep_comm.contract.fp8.pack(*ep_comm.contract.fp8.quantize(x))`` (zero blocks, subnormal-only blocks, -0.0 included)."""
    world = narrow_world(xp, seed=13, hidden=384, source=source, masked=0.2)  # 3 blocks: a scale word half pad
    run_dispatch(world, deterministic=True, expand=expand, alignment=4, zero_padding=True)
    run_dispatch(world, deterministic=False, expand=expand, worst_case=True, parity=0)


@pytest.mark.parametrize("dtype, hidden", [("float32", 256), ("float16", 128)])
def test_the_scatter_casts_float32_and_float16_payloads(xp, dtype, hidden):
    world = narrow_world(xp, seed=14, hidden=hidden, dtype=dtype, source="cast", masked=0.2)
    run_dispatch(world, deterministic=True, expand=False)


@pytest.mark.parametrize("source", ["pair", "cast"])
def test_rows_cut_into_pieces_are_written_piece_by_piece(xp, source):
    """Few tokens and long rows: the rows kernel writes each packed row in pieces of whole block pairs (the cast's
    scales from the piece of their blocks, the pair's from the piece that holds their words)."""
    world = narrow_world(xp, seed=15, hidden=4096, source=source, ranks=2, topk=2, tokens=(2, 1), masked=0.0)
    row_words = fp8.packed_row_bytes(4096) // 8
    span, _ = world.kernels._row_pieces(world.topk[0].size, row_words, 512)
    assert span < row_words  # the case under test: more than one piece per row
    run_dispatch(world, deterministic=True, expand=False)


def test_a_cached_compact_replay_casts_straight_into_recv_x(xp):
    """The direct path of a cached compact dispatch (own rows into ``recv_x``) with the cast in the scatter."""
    check_direct_replay(narrow_world(xp, seed=16, hidden=256, source="cast", masked=0.2), new_rows=False)
