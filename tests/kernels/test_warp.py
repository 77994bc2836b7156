"""Device building blocks in small test kernels: chunked warp scans, lane masks, payload conversions, index walks."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from ep_comm._launcher.device_arrays import wide_rows
from ep_comm.contract import layout as ref
from ep_comm.contract.arrays import to_host
from ep_comm.kernels.convert import load_f32, store_f32
from ep_comm.kernels.index32 import divmod32
from ep_comm.kernels.units import lane_entry, lane_place
from ep_comm.kernels.warp import WARP, ballot, copy_row, pop_lowest, stable_bucket_slots, warp_scan


@cuda.jit
def scan_kernel(src, inclusive_out, exclusive_out, totals):
    totals[0] = warp_scan(src, inclusive_out, src.shape[0], False, 0, True)
    totals[1] = warp_scan(src, exclusive_out, src.shape[0], True, 5, False)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 70, 129, 300])
def test_warp_scan_chunks_carry_the_total(xp, n):
    src = np.random.default_rng(n).integers(0, 9, n).astype(np.int32)
    inclusive, exclusive, totals = xp.zeros(n, np.int32), xp.zeros(n, np.int32), xp.zeros(2, np.int32)
    scan_kernel[1, 32](xp.asarray(src), inclusive, exclusive, totals)
    np.testing.assert_array_equal(to_host(inclusive), ref.inclusive_psum(src))
    np.testing.assert_array_equal(to_host(exclusive), 5 + ref.exclusive_psum(src)[:-1])
    np.testing.assert_array_equal(to_host(totals), [src.sum(), 5 + src.sum()])


@cuda.jit
def round_trip_kernel(src, src_bf16, dst, dst_bf16):
    i = cuda.grid(1)
    if i < src.shape[0]:
        store_f32(dst, i, load_f32(src, i, src_bf16), dst_bf16)


def special_floats() -> np.ndarray:
    """Values where rounding to 16 bits is delicate: ties, carries into the exponent, overflow, subnormals, NaN."""
    raw = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00000001,
                    0x80008000, 0x00018000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFF812345, 0x80000000,
                    0x33800000, 0x33000001, 0x387FE000, 0x477FF000, 0x477FEFFF, 0x38800000], dtype=np.uint32)
    rng = np.random.default_rng(0)
    return np.concatenate([raw.view(np.float32), rng.standard_normal(44).astype(np.float32) * 1e3])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)])
def test_float32_to_payload_rounds_like_numpy(xp, dtype):
    """Bit-exact except NaN payloads in float16: the hardware conversion makes its own NaN."""
    values = special_floats()
    is_bf16 = dtype.name == "bfloat16"
    out = xp.zeros(len(values), np.uint16 if is_bf16 else dtype)
    round_trip_kernel[2, 32](xp.asarray(values), False, out, is_bf16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(dtype)
    got = to_host(out).view(dtype)
    exact = ~np.isnan(values) | is_bf16
    np.testing.assert_array_equal(got.view(np.uint16)[exact], want.view(np.uint16)[exact])
    assert np.isnan(got[~exact].astype(np.float32)).all()
    back = xp.zeros(len(values), np.float32)
    round_trip_kernel[2, 32](out, is_bf16, back, False)
    np.testing.assert_array_equal(to_host(back).view(np.uint32)[exact], want.astype(np.float32).view(np.uint32)[exact])


@cuda.jit
def copy_kernel(dst, src, n, wide):
    copy_row(dst, src, n, wide)


@pytest.mark.parametrize("n, wide", [(0, False), (1, False), (5, False), (256, False), (300, False), (600, False), (0, True),
                                     (2, True), (6, True), (512, True), (600, True), (1200, True)])
def test_copy_row_unrolled_and_tail(xp, n, wide):
    src = np.arange(1, n + 1, dtype=np.uint64)
    dst = xp.zeros(n + 3, np.uint64)
    copy_kernel[1, 32](dst, xp.asarray(src), n, wide)
    np.testing.assert_array_equal(to_host(dst), np.concatenate([src, np.zeros(3, np.uint64)]))


def test_wide_rows_needs_64_bit_words_even_rows_and_16_byte_alignment():
    words = np.zeros(80, np.uint64)
    aligned = words[words.ctypes.data % 16 // 8:][:64]
    assert wide_rows(aligned.reshape(8, 8))
    assert not wide_rows(aligned[1:57].reshape(7, 8))  # rows start 8 bytes off
    assert not wide_rows(aligned[:63].reshape(9, 7))  # odd words per row
    assert not wide_rows(aligned.view(np.uint32).reshape(8, 16))
    assert not wide_rows(aligned.reshape(8, 8), aligned[1:57].reshape(7, 8))


@cuda.jit
def bucket_slots_kernel(buckets, cursor, slots, popped):
    lane = cuda.threadIdx.x
    slots[lane] = stable_bucket_slots(cursor, buckets[lane], buckets[lane] >= 0, lane)
    pairs = ballot(buckets[lane] >= 0)
    n = 0
    while pairs != 0:
        src, pairs = pop_lowest(pairs)
        if lane == 0:
            popped[n] = src
        n += 1


@pytest.mark.parametrize("pattern", ["lane 31 alone", "one bucket", "random"])
def test_lane_masks_with_lane_31_set(xp, pattern):
    """Lane 31's bit is the sign bit of Numba's int32 masks: a widened mask would count 32 phantom lanes."""
    rng = np.random.default_rng(1)
    buckets = {"lane 31 alone": np.r_[np.full(31, -1), 2], "one bucket": np.zeros(32),
               "random": rng.integers(-1, 4, 32)}[pattern].astype(np.int32)
    start = np.array([10, 20, 30, 40], np.int32)
    cursor, slots, popped = xp.array(start), xp.zeros(32, np.int32), xp.full(33, -1, np.int32)
    bucket_slots_kernel[1, 32](xp.asarray(buckets), cursor, slots, popped)
    want = np.array([start[b] + (buckets[:lane] == b).sum() if b >= 0 else -1 for lane, b in enumerate(buckets)])
    np.testing.assert_array_equal(to_host(slots), want)
    np.testing.assert_array_equal(to_host(cursor), start + np.bincount(buckets[buckets >= 0], minlength=4))
    active = np.flatnonzero(buckets >= 0)
    np.testing.assert_array_equal(to_host(popped), np.r_[active, np.full(33 - len(active), -1)])


@cuda.jit
def divmod_kernel(a, b, out):
    i = cuda.grid(1)
    if i < a.shape[0]:
        out[i, 0], out[i, 1] = divmod32(a[i], b[i])


def test_divmod32_on_indices_up_to_2_to_the_31(xp):
    a = np.array([0, 1, 31, 32, 1000, 2**31 - 1, 2**31 - 1, 2**30 + 5, 7], np.int64)
    b = np.array([1, 32, 32, 32, 7, 1, 2**31 - 1, 3, 9], np.int32)
    out = xp.zeros((len(a), 2), np.int64)
    divmod_kernel[1, 32](xp.asarray(a), xp.asarray(b), out)
    np.testing.assert_array_equal(to_host(out), np.stack([a // b, a % b], axis=1))


@cuda.jit
def lane_walk_kernel(visits, begin, end):
    width = visits.shape[1]
    lane = cuda.threadIdx.x
    place = lane_place(width, lane)
    first = np.int32(begin)
    while first < end:
        item, column, active = lane_entry(first, end, place)
        if active:
            visits[item, column] += 1
        first = np.int32(first + WARP // width)


@pytest.mark.parametrize("width", [1, 3, 8, 11, 32])
@pytest.mark.parametrize("begin, end", [(0, 1), (2, 13), (5, 40)])
def test_lane_entries_visit_every_entry_once(xp, width, begin, end):
    visits = xp.zeros((40, width), np.int32)
    lane_walk_kernel[1, 32](visits, begin, end)
    want = np.zeros((40, width), np.int32)
    want[begin:end] = 1
    np.testing.assert_array_equal(to_host(visits), want)


@pytest.mark.parametrize("a, b", [(-1, 3), (2**31, 3), (5, 0), (5, -2), (5, 2**31)])
def test_divmod32_python_body_refuses_operands_outside_its_domain(a, b):
    """The body the simulator runs raises where the compiled unsigned division would differ from ``//``."""
    with pytest.raises(ValueError, match=rf"a={a} by b={b}: needs 0 <= a < 2\*\*31 and 0 < b < 2\*\*31"):
        divmod32(a, b)
