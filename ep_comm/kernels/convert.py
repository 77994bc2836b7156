"""Payload element <-> float32 in device code, and float32 arithmetic that is never contracted to FMA.

Payload arrays reach kernels as float32, float16 or uint16 (bfloat16 bits, as NumPy and CuPy
have no bfloat16 that Numba types). bfloat16 -> float32 is a 16-bit shift; float32 -> bfloat16
rounds to nearest even, as ``ml_dtypes``' ``astype`` does. float16 uses the hardware conversion
(round to nearest even). ``fmul_rn``/``fadd_rn`` round each operation: NVVM would otherwise fuse
``acc + w * y`` into one FMA and break agreement with the NumPy reference.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import libdevice

BF16_QUIET_NAN = 0x7FC0


@cuda.jit(device=True)
def bf16_bits_to_f32(bits):
    """float32 value of bfloat16 bits (uint16)."""
    return libdevice.int_as_float(np.int32(bits) << 16)


@cuda.jit(device=True)
def f32_to_bf16_bits(value):
    """bfloat16 bits (0..65535) of a float32, rounded to nearest even; NaN becomes the signed quiet NaN."""
    bits = np.int64(libdevice.float_as_int(value)) & 0xFFFFFFFF
    if bits & 0x7FFFFFFF > 0x7F800000:
        return ((bits >> 16) & 0x8000) | BF16_QUIET_NAN
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@cuda.jit(device=True)
def load_f32(row, j, is_bf16):
    """``row[j]`` as float32 (``is_bf16``: the row holds bfloat16 bits)."""
    if is_bf16:
        return bf16_bits_to_f32(row[j])
    return np.float32(row[j])


@cuda.jit(device=True)
def store_f32(row, j, value, is_bf16):
    """``row[j] = value`` rounded once to the row's payload type."""
    if is_bf16:
        row[j] = f32_to_bf16_bits(value)
    else:
        row[j] = value


@cuda.jit(device=True)
def add_rn(acc, value):
    """float32 ``acc + value``, rounded on its own."""
    return libdevice.fadd_rn(acc, value)


@cuda.jit(device=True)
def mul_rn(a, b):
    """float32 ``a * b``, rounded on its own."""
    return libdevice.fmul_rn(a, b)
