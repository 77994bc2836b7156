"""FP8 quantization in device code: float32 -> float8 e4m3fn bits, and the sender's quantize kernel.

The reference is ``ep_comm.fp8.quantize`` (NumPy); for finite input this computes the same bits. The
conversion is integer bit arithmetic on the float32 pattern (round to nearest even, saturating at
±448), so it runs unchanged in the CUDA simulator and needs no FP8 hardware instruction. The scale
and the division use ``libdevice.fdiv_rn`` (IEEE float32 division, as NumPy's): never an approximate
or fast-math division.

Non-finite input is not checked here (the host reference refuses it): a block holding an infinity
or a NaN gets a non-finite or NaN scale and values that mean nothing.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from ep_comm.kernels.convert import load_f32
from ep_comm.kernels.index32 import divmod32
from ep_comm.kernels.jit import kernel
from ep_comm.kernels.warp import FULL_MASK, WARP, global_warp, lane_id

BLOCK = 128  # elements per scale (ep_comm.fp8.BLOCK)
PER_LANE = BLOCK // WARP  # elements one lane quantizes: 4, stored as one 32-bit word
E4M3_MAX = np.float32(448.0)
_F32_448_BITS = 0x43E00000  # 448.0f: the largest finite e4m3fn
_F32_INF_BITS = 0x7F800000
_E4M3_MAX_BITS = 0x7E
_E4M3_NAN_BITS = 0x7F
_MIN_NORMAL_EXP = 121  # biased float32 exponent of 2**-6, the smallest normal e4m3fn
_EXP_REBIAS = 127 - 7  # float32 exponent bias minus e4m3's


@cuda.jit(device=True)
def f32_to_e4m3_bits(value):
    """e4m3fn bits (0..255) of a float32, rounded to nearest even; magnitudes past 448 (infinities too)
    saturate to ±448, NaN becomes the signed NaN 0x7F / 0xFF. ``clip(v, -448, 448)`` then
    ``astype(float8_e4m3fn)`` in ``ml_dtypes`` gives the same bits for every non-NaN float32."""
    bits = np.int64(libdevice.float_as_int(value)) & 0xFFFFFFFF
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    if mag > _F32_INF_BITS:
        return sign | _E4M3_NAN_BITS
    if mag >= _F32_448_BITS:
        return sign | _E4M3_MAX_BITS
    exp = mag >> 23
    if exp >= _MIN_NORMAL_EXP:  # normal: keep 3 mantissa bits, the rounding may carry into the exponent
        return sign | ((mag - (_EXP_REBIAS << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20)
    shift = 141 - exp  # subnormal: units of 2**-9 = (1.m * 2**23) * 2**(exp - 150 + 9)
    if shift > 24:  # below half of 2**-9 (float32 zeros and subnormals too): a signed zero
        return sign
    mant = (mag & 0x7FFFFF) | 0x800000
    q = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1  # 8 is the smallest normal, 0x08: the carry is right
    return sign | q


@cuda.jit(device=True)
def warp_amax(value):
    """max over the warp's lanes of a float32 ``value`` (all lanes get it; xor shuffles)."""
    offset = WARP // 2
    while offset > 0:
        other = cuda.shfl_xor_sync(FULL_MASK, value, offset)
        value = other if other > value else value
        offset //= 2
    return value


@cuda.jit(device=True)
def block_scale(amax):
    """float32 ``amax / 448`` rounded once (IEEE), or 1.0 where that is 0 (a zero block)."""
    scale = libdevice.fdiv_rn(amax, E4M3_MAX)
    return scale if scale != 0 else np.float32(1.0)


@kernel
def quantize_kernel(x, is_bf16, out_words):
    """Packed FP8 rows (``ep_comm.fp8.pack`` of ``ep_comm.fp8.quantize(x)``) of ``x [T, H]`` (float32,
    float16, or bfloat16 as uint16 bits with ``is_bf16``; ``H % 128 == 0``) into ``out_words [T, P / 4]``
    uint32 (the packed rows' words, ``P = packed_row_bytes(H)``): one warp per (row, 128-block), each lane
    4 elements written as one word; lane 0 writes the block's scale, the warp of a row's block 0 its pad
    words."""
    num_tokens, hidden = x.shape
    blocks = hidden // BLOCK
    scale_at = hidden // 4
    lane = lane_id()
    item, num_warps = global_warp()
    item = np.int32(item)
    while item < num_tokens * blocks:
        t, b = divmod32(item, blocks)
        first = b * BLOCK + lane * PER_LANE
        amax = np.float32(0.0)
        for j in range(PER_LANE):
            amax = max(amax, abs(load_f32(x[t], first + j, is_bf16)))
        scale = block_scale(warp_amax(amax))
        word = np.int64(0)
        for j in range(PER_LANE):
            q = f32_to_e4m3_bits(libdevice.fdiv_rn(load_f32(x[t], first + j, is_bf16), scale))
            word |= q << (8 * j)
        out_words[t, b * WARP + lane] = np.uint32(word)
        if lane == 0:
            out_words[t, scale_at + b] = np.uint32(np.int64(libdevice.float_as_int(scale)) & 0xFFFFFFFF)
        if b == 0:
            for w in range(scale_at + blocks + lane, out_words.shape[1], WARP):
                out_words[t, w] = np.uint32(0)
        item = np.int32(item + num_warps)
