"""FP8 in device code: float32 -> float8 e4m3fn bits, and the writers of packed FP8 rows (``ep_comm.contract.fp8``
layout) that a sender calls as it writes each row: from the pair ``(x_fp8, scales)`` (:func:`write_pair_piece`)
or from the payload with the quantization on the way (:func:`write_cast_piece`).

The reference is ``ep_comm.contract.fp8.quantize`` (NumPy); for finite input the cast computes the same bits. The
conversion (round to nearest even, saturating at ±448) is :func:`f32_to_e4m3_bits`, integer bit arithmetic on
the float32 pattern; the cast converts two values at once with :func:`e4m3x2_bits`, one
``cvt.rn.satfinite.e4m3x2.f32`` (sm_89 and later) in compiled kernels, ``f32_to_e4m3_bits`` twice in the CUDA
simulator (the same bits for every non-NaN float32). The scale and the division use ``libdevice.fdiv_rn`` (IEEE
float32 division, as NumPy's): never an approximate or fast-math division.

Non-finite input is not checked here (the host reference refuses it): a block holding an infinity
or a NaN gets a non-finite or NaN scale and values that mean nothing.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types
from numba.cuda import libdevice
from numba.cuda.core.errors import TypingError
from numba.cuda.extending import intrinsic, overload

from ep_comm.kernels.convert import bf16_bits_to_f32
from ep_comm.kernels.index32 import quotient32
from ep_comm.kernels.vector import load_pair
from ep_comm.kernels.warp import FULL_MASK, WARP, copy_row, lane_id

BLOCK = 128  # elements per scale (ep_comm.contract.fp8.BLOCK)
LANE_ELEMENTS = 8  # elements one lane casts per warp step: one uint64 word of FP8 bytes
BLOCK_WORDS = BLOCK // LANE_ELEMENTS  # uint64 words of FP8 bytes per block (16 lanes of a step)
CAST_STEPS = 4  # warp steps (2 blocks each) whose loads a lane issues before it casts them
CAST_VALUES = CAST_STEPS * LANE_ELEMENTS  # float32 values a lane holds (a compile-time local array size)
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


def e4m3x2_bits(hi, lo):
    """e4m3fn bits of two float32 values, ``hi``'s in bits 8..15 and ``lo``'s in bits 0..7: those of
    :func:`f32_to_e4m3_bits` for non-NaN values (a NaN's are NaN bits, of either sign)."""
    return (f32_to_e4m3_bits(hi) << 8) | f32_to_e4m3_bits(lo)


@intrinsic
def _cvt_e4m3x2(typingctx, hi, lo):
    if not isinstance(hi, types.Float) or not isinstance(lo, types.Float):
        raise TypingError(f"e4m3x2 conversion needs two floats, got {hi} and {lo}")
    sig = types.uint16(hi, lo)

    def codegen(context, builder, sig, args):
        values = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        asm_type = ir.FunctionType(ir.IntType(16), [ir.FloatType(), ir.FloatType()])
        cvt = ir.InlineAsm(asm_type, "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f")
        return builder.call(cvt, values)

    return sig, codegen


@overload(e4m3x2_bits, target="cuda")
def _e4m3x2_bits_cuda(hi, lo):
    return lambda hi, lo: _cvt_e4m3x2(hi, lo)


@cuda.jit(device=True)
def group_amax(value, width):
    """max of a float32 ``value`` over each aligned group of ``width`` lanes (a power of two up to 32; every lane of
    a group gets it; xor shuffles, called by all lanes of the warp)."""
    offset = width // 2
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


@cuda.jit(device=True)
def scale_bits(scale):
    """The float32 ``scale``'s bits as uint64 (the low half of a word)."""
    return np.uint64(np.int64(libdevice.float_as_int(scale)) & 0xFFFFFFFF)


@cuda.jit(device=True)
def scale_pair_word(scales, i):
    """The packed row's word of scales ``i`` and ``i + 1`` of a row (``scales``: their float32 bits, uint32
    ``[H / 128]``), the first in the low half (little-endian bytes); 0 for a scale past the row (the pad)."""
    n = scales.shape[0]
    lo = np.uint64(scales[i]) if i < n else np.uint64(0)
    hi = np.uint64(scales[i + 1]) if i + 1 < n else np.uint64(0)
    return lo | (hi << np.uint64(32))


@cuda.jit(device=True)
def write_pair_piece(dst, fp8_words, scales, begin, end, wide):
    """Words ``[begin, end)`` of one token's packed FP8 row into ``dst[begin:end]`` (uint64), read where the pair
    lies: the FP8 bytes from ``fp8_words`` (the token's ``x_fp8`` as uint64 ``[H / 8]``, copied as
    :func:`~ep_comm.kernels.warp.copy_row` copies, 16 bytes per access when ``wide``: ``begin``, ``end`` even and
    both rows 16-byte aligned), then the scales (uint32 bits ``[H / 128]``) two to a word, then zero words up to
    the row's end. All lanes of a warp."""
    head = fp8_words.shape[0]
    stop = min(end, head)
    if begin < stop:
        copy_row(dst[begin:stop], fp8_words[begin:stop], stop - begin, wide)
    w = np.int32(max(begin, head) + lane_id())
    while w < end:
        dst[w] = scale_pair_word(scales, 2 * (w - head))
        w = np.int32(w + WARP)


@cuda.jit(device=True)
def load_cast_values(x_words, x_values, is_bf16, w, wide, values, at):
    """Elements ``8w .. 8w + 7`` of a row (those of its FP8 word ``w``) as float32 into ``values[at:at + 8]``:
    bfloat16 from the row's uint64 words ``x_words`` (two words, one 16-byte load when ``wide``), float16 and
    float32 from its elements ``x_values``."""
    if is_bf16:
        if wide:
            first, second = load_pair(x_words, 2 * w)
        else:
            first, second = x_words[2 * w], x_words[2 * w + 1]
        for j in range(4):
            values[at + j] = bf16_bits_to_f32((np.uint64(first) >> np.uint64(16 * j)) & np.uint64(0xFFFF))
            values[at + 4 + j] = bf16_bits_to_f32((np.uint64(second) >> np.uint64(16 * j)) & np.uint64(0xFFFF))
    else:
        for j in range(LANE_ELEMENTS):
            values[at + j] = np.float32(x_values[LANE_ELEMENTS * w + j])


@cuda.jit(device=True)
def cast_step(dst, values, at, active, first, head, blocks, lane):
    """One warp step of :func:`write_cast_piece` at FP8 word ``first`` (a multiple of 32: blocks ``first / 16``
    and the next): each ``active`` lane quantizes its 8 values (``values[at:at + 8]``) with its block's scale
    into word ``first + lane``; lane 0 writes the word of the two blocks' scales (the second 0 past the row)."""
    amax = np.float32(0.0)
    if active:
        for j in range(LANE_ELEMENTS):
            amax = max(amax, abs(values[at + j]))
    scale = block_scale(group_amax(amax, BLOCK_WORDS))
    if active:
        word = np.uint64(0)
        for j in range(0, LANE_ELEMENTS, 2):
            pair = e4m3x2_bits(libdevice.fdiv_rn(values[at + j + 1], scale), libdevice.fdiv_rn(values[at + j], scale))
            word |= np.uint64(pair) << np.uint64(8 * j)
        dst[first + lane] = word
    second = cuda.shfl_down_sync(FULL_MASK, scale, BLOCK_WORDS)
    if lane == 0:
        block = quotient32(first, BLOCK_WORDS)
        hi = scale_bits(second) if block + 1 < blocks else np.uint64(0)
        dst[head + quotient32(block, 2)] = scale_bits(scale) | (hi << np.uint64(32))


@cuda.jit(device=True)
def write_cast_piece(dst, x_words, x_values, is_bf16, begin, end, wide):
    """Words ``[begin, end)`` of the packed FP8 row of one token's ``x`` into ``dst`` (uint64), quantized on the
    way: the bits of ``ep_comm.contract.fp8.pack(*ep_comm.contract.fp8.quantize(x))`` for finite ``x``. All lanes of a warp.

    ``x_values``: the token's ``H`` elements (float32, float16, or bfloat16 as uint16 bits with ``is_bf16``);
    ``x_words``: the same row as uint64 words, read for bfloat16 (16 bytes per access when ``wide``). A warp
    step casts two blocks of 128 (8 elements per lane, one word of FP8 bytes each), ``CAST_STEPS`` steps'
    loads issued before they are cast; the scales of a step's blocks are written with them (lane 0, one word),
    also where that word lies past ``end``; the pad words in ``[begin, end)`` are zeroed. ``begin`` must be a
    multiple of 32 and ``end`` too unless it is past the FP8 bytes (``H / 8``): no block pair is split.
    """
    hidden = x_values.shape[0]
    head = hidden // LANE_ELEMENTS
    blocks = hidden // BLOCK
    lane = lane_id()
    values = cuda.local.array(CAST_VALUES, float32)
    stop = min(end, head)
    first = np.int32(begin)
    while first < stop:
        for s in range(CAST_STEPS):
            w = first + s * WARP + lane
            if w < stop:
                load_cast_values(x_words, x_values, is_bf16, w, wide, values, s * LANE_ELEMENTS)
        for s in range(CAST_STEPS):
            at = first + s * WARP
            if at < stop:  # the same on every lane: the step's shuffles are collectives
                cast_step(dst, values, s * LANE_ELEMENTS, at + lane < stop, at, head, blocks, lane)
        first = np.int32(first + CAST_STEPS * WARP)
    w = np.int32(max(begin, head + (blocks + 1) // 2) + lane)
    while w < end:
        dst[w] = np.uint64(0)
        w = np.int32(w + WARP)
