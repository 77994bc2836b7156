"""``ep_comm.contract.fp8``: the reference quantizer and the packed row layout (host code, no communication)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ep_comm.contract import fp8

FINITE = st.floats(float(np.float32(-3e38)), float(np.float32(3e38)), width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


def blocks(tokens: int, hidden: int):
    return hnp.arrays(np.float32, (tokens, hidden), elements=FINITE)


@given(st.integers(0, 3).flatmap(lambda t: blocks(t, 256)))
def test_quantize_follows_the_block_rule(x):
    q, s = fp8.quantize(x)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == x.shape and s.dtype == np.float32 and s.shape == (len(x), 2)
    amax = np.abs(x.reshape(len(x), 2, 128)).max(axis=2, initial=np.float32(0))
    want = amax / np.float32(448)
    want[want == 0] = 1
    np.testing.assert_array_equal(s, want)
    assert (np.abs(q.astype(np.float32)) <= 448).all()
    # each value is v / scale rounded to nearest even e4m3fn (within the 448 clip)
    ratio = np.clip(x.reshape(len(x), 2, 128) / s[:, :, None], -448, 448).reshape(x.shape)
    np.testing.assert_array_equal(q.view(np.uint8), ratio.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@given(st.integers(0, 3).flatmap(lambda t: blocks(t, 128)))
def test_dequantize_is_within_half_an_e4m3_step(x):
    q, s = fp8.quantize(x)
    err = np.abs(fp8.dequantize(q, s) - x)
    # relative step 2**-3 for normals; subnormals of e4m3 are 2**-9 * scale apart
    bound = np.maximum(np.abs(x) * 2.0**-4, np.repeat(s, 128, axis=1) * 2.0**-10) * 1.0001 + 2.0**-149
    assert (err <= bound).all()


def test_edge_values():
    x = np.zeros((4, 128), np.float32)
    x[1, 0], x[1, 1], x[1, 2] = 448.0, -448.0, -0.0  # scale 1: the values themselves
    x[2, :3] = [1e-45, -1e-45, 0]  # scale underflows to 0: scale 1, zeros
    x[3, 0], x[3, 1] = 3e38, 1.0  # the largest magnitudes
    q, s = fp8.quantize(x)
    assert s.tolist() == [[1.0], [1.0], [1.0], [np.float32(3e38) / np.float32(448)]]
    bits = q.view(np.uint8)
    assert not bits[0].any()  # a zero block: zeros, scale 1
    assert bits[1, :3].tolist() == [0x7E, 0xFE, 0x80]  # ±448, -0 stays -0
    assert bits[2, :3].tolist() == [0x00, 0x80, 0x00]
    assert bits[3, 0] == 0x7E and q[3, 1] == 0  # 1.0 / (3e38 / 448) underflows to zero


def test_bfloat16_and_float16_are_quantized_through_their_exact_float32_values():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        narrow = x.astype(dtype)
        got, want = fp8.quantize(narrow), fp8.quantize(narrow.astype(np.float32))
        assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_input_is_refused(bad):
    x = np.ones((3, 128), np.float32)
    x[2, 7] = bad
    with pytest.raises(ValueError, match=r"x row 2 holds a non-finite value: FP8 quantization needs finite input"):
        fp8.quantize(x)


def test_hidden_must_be_a_multiple_of_128():
    with pytest.raises(ValueError, match=r"x has shape \(2, 100\): must be \[num_tokens, hidden\] with hidden a "
                                         r"multiple of 128"):
        fp8.quantize(np.zeros((2, 100), np.float32))


@pytest.mark.parametrize("hidden, want", [(128, 144), (256, 272), (384, 400), (512, 528), (7168, 7392)])
def test_packed_row_bytes(hidden, want):
    assert fp8.packed_row_bytes(hidden) == want and want % 16 == 0 and want >= hidden + hidden // 32
    assert want <= 2 * hidden  # fits the symmetric row of every payload dtype


@given(st.integers(0, 4).flatmap(lambda t: blocks(t, 384)))
def test_pack_and_unpack_are_inverse_views(x):
    q, s = fp8.quantize(x)
    packed = fp8.pack(q, s)
    assert packed.dtype == np.uint8 and packed.shape == (len(x), 400) and packed.flags.c_contiguous
    assert packed[:, :384].tobytes() == np.ascontiguousarray(q).view(np.uint8).tobytes()
    assert packed[:, 384:396].tobytes() == s.tobytes() and not packed[:, 396:].any()
    q2, s2 = fp8.unpack(packed.view(ml_dtypes.bfloat16), 384)  # as the buffer dtype carries it
    assert q2.dtype == fp8.FP8_DTYPE and q2.tobytes() == q.tobytes() and s2.tobytes() == s.tobytes()
    if len(x):
        assert np.may_share_memory(q2, packed) and np.may_share_memory(s2, packed)


def test_unpack_refuses_rows_of_another_width():
    with pytest.raises(ValueError, match=r"packed rows have 256 bytes: hidden=256 packs into 272"):
        fp8.unpack(np.zeros((1, 256), np.uint8), 256)


def test_pack_takes_any_one_byte_dtype_for_the_fp8_bits():
    q, s = fp8.quantize(np.arange(256, dtype=np.float32).reshape(2, 128))
    for bits in (q.view(np.uint8), q.view(np.int8)):
        assert fp8.pack(bits, s).tobytes() == fp8.pack(q, s).tobytes()


def test_fp8_array_is_float8_on_numpy_and_the_bits_elsewhere():
    class GpuArray:  # stands in for a CuPy array: CuPy 14 views float8 but cannot copy or compute with it
        def view(self, dtype):
            raise AssertionError(f"viewed as {dtype}")

    bits = GpuArray()
    assert fp8.fp8_array(bits) is bits
    assert fp8.fp8_array(np.zeros(3, np.uint8)).dtype == fp8.FP8_DTYPE
