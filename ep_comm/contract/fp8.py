"""FP8 payloads (DeepSeek-V3 format): the quantizer every FP8 dispatch is checked against, and the packed
row layout FP8 rows travel in.

Format: ``x_fp8 [T, H]`` float8 e4m3fn (``ml_dtypes.float8_e4m3fn``, max 448, no infinities) and
``scales [T, H // 128]`` float32, one scale per block of 128 consecutive elements of a row:
``x ~= x_fp8 * scale`` blockwise. ``H % 128 == 0`` is required.

Quantization of one block (:func:`quantize`): the values as float32 (bfloat16 and float16 exactly),
``amax = max |v|``, ``scale = amax / 448`` in float32, ``q = clip(v / scale, -448, 448)`` (IEEE float32
division) rounded to nearest even into e4m3fn. A block whose scale is 0 (all zeros, or an amax so small
that ``amax / 448`` underflows) gets ``scale = 1.0``, so its values become (signed) zeros. Non-finite
input (NaN, inf) is refused with ValueError: an FP8 block has no way to carry it. The GPU quantizer
(``ep_comm.kernels.fp8``) computes the same bits for finite input and does not check (a check would
need a host synchronisation); see its docstring for what it makes of non-finite values.

Packed rows (:func:`pack`, :func:`unpack`): one row is the ``H`` bytes of ``x_fp8``, then the ``H / 32``
bytes of ``scales`` (float32, native byte order), then zero bytes up to :func:`packed_row_bytes`, a
multiple of 16. That is what crosses the link in an FP8 dispatch. Functions taking ``xp`` work with
NumPy and CuPy arrays alike.
"""
from __future__ import annotations

from typing import Any, Tuple

import ml_dtypes
import numpy as np

__all__ = ["BLOCK", "E4M3_MAX", "FP8_DTYPE", "scale_columns", "row_bytes", "packed_row_bytes", "quantize",
           "dequantize", "pack", "unpack", "scale_words", "fp8_array"]

BLOCK = 128  # elements per scale
E4M3_MAX = 448.0  # the largest finite float8 e4m3fn
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_ROW_ALIGN = 16  # packed rows are a multiple of this many bytes (16-byte copies, any payload itemsize divides)


def scale_columns(hidden: int) -> int:
    """Scales per row: ``hidden // 128``."""
    return hidden // BLOCK


def row_bytes(hidden: int) -> int:
    """The useful bytes of one FP8 row: ``hidden`` FP8 bytes + ``hidden // 32`` scale bytes (no padding)."""
    return hidden + 4 * scale_columns(hidden)


def packed_row_bytes(hidden: int) -> int:
    """Bytes of one packed row: :func:`row_bytes` rounded up to 16."""
    return -(-row_bytes(hidden) // _ROW_ALIGN) * _ROW_ALIGN


def _as_float32(x: np.ndarray) -> np.ndarray:
    """float32 values of a float32/float16/bfloat16 array (exact)."""
    return np.asarray(x).astype(np.float32)


def quantize(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Blockwise FP8 quantization of ``x [T, H]`` (float32, float16 or bfloat16; ``H % 128 == 0``).

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)``, as the module docstring says.

    Raises:
        ValueError: ``x`` is not 2-D with ``H % 128 == 0``, or holds NaN or infinity.
    """
    v = _as_float32(x)
    if v.ndim != 2 or v.shape[1] % BLOCK:
        raise ValueError(f"x has shape {v.shape}: must be [num_tokens, hidden] with hidden a multiple of {BLOCK}")
    finite = np.isfinite(v)
    if not finite.all():
        row = int(np.nonzero(~finite.all(axis=1))[0][0])
        raise ValueError(f"x row {row} holds a non-finite value: FP8 quantization needs finite input "
                         "(e4m3fn has no infinities and a scale cannot carry NaN)")
    blocks = v.reshape(v.shape[0], v.shape[1] // BLOCK, BLOCK)
    scales = np.abs(blocks).max(axis=2, initial=np.float32(0)) / np.float32(E4M3_MAX)
    scales[scales == 0] = 1.0
    q = np.clip(blocks / scales[:, :, None], -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)
    return q.reshape(v.shape), scales.astype(np.float32)


def dequantize(x_fp8: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``x_fp8 [T, H] * scales [T, H // 128]`` blockwise, float32 ``[T, H]`` (``x_fp8`` any 1-byte view of
    e4m3fn bits)."""
    q = np.asarray(x_fp8).view(FP8_DTYPE).astype(np.float32)
    t, h = q.shape
    out: np.ndarray = (q.reshape(t, h // BLOCK, BLOCK) * np.asarray(scales, np.float32)[:, :, None]).reshape(t, h)
    return out


def pack(x_fp8: Any, scales: Any, xp: Any = np) -> Any:
    """Packed rows ``[T, packed_row_bytes(H)]`` uint8 (a new C-contiguous array of ``xp``) of ``x_fp8 [T, H]``
    (any 1-byte dtype: e4m3fn bits) and ``scales [T, H // 128]`` float32; the pad bytes are zero."""
    t, h = x_fp8.shape
    packed = xp.empty((t, packed_row_bytes(h)), dtype=np.uint8)
    packed[:, :h] = x_fp8.view(np.uint8)
    scale_words(packed, h)[...] = scales
    packed[:, row_bytes(h):] = 0  # the pad; every other byte is written above
    return packed


def scale_words(packed: Any, hidden: int) -> Any:
    """The float32 scales ``[T, hidden // 128]`` inside packed rows ``[T, P]`` uint8 (a view). The rows are
    viewed as float32 ``[T, P / 4]`` first and then sliced: CuPy refuses itemsize-changing views of
    non-contiguous arrays."""
    words = packed.view(np.float32)
    return words[:, hidden // 4: hidden // 4 + scale_columns(hidden)]


def unpack(packed: Any, hidden: int) -> Tuple[Any, Any]:
    """``(x_fp8 [T, hidden], scales [T, hidden // 128] float32)``: zero-copy views into packed rows ``[T, P]``
    of any dtype whose rows are ``P = packed_row_bytes(hidden)`` bytes (C-contiguous); ``x_fp8`` as
    :func:`fp8_array` makes it."""
    rows = packed.view(np.uint8)
    if rows.shape[-1] != packed_row_bytes(hidden):
        raise ValueError(f"packed rows have {rows.shape[-1]} bytes: hidden={hidden} packs into "
                         f"{packed_row_bytes(hidden)} (hidden + hidden / 32, rounded up to {_ROW_ALIGN})")
    return fp8_array(rows[:, :hidden]), scale_words(rows, hidden)


def fp8_array(bits: Any) -> Any:
    """uint8 ``bits`` (e4m3fn bit patterns) as a float8_e4m3fn view for a NumPy array, else ``bits`` itself
    (uint8). CuPy 14 makes such a view but cannot copy it to the host or compute with it (``Unsupported
    dtype``, seen on the H200), so GPU arrays stay uint8: the same bytes, which a GPU user reads with
    ``torch.from_dlpack(a).view(torch.float8_e4m3fn)``."""
    return bits.view(FP8_DTYPE) if isinstance(bits, np.ndarray) else bits
