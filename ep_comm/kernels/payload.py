"""What a sender writes as a token's row: its payload words as they are, or a packed FP8 row (``ep_comm.contract.fp8``)
made on the way from the FP8 pair or from the payload with the cast (``ep_comm.kernels.fp8``).

A row's source is a tuple over the sender's ``T`` tokens; its length says its form, so that each form compiles
into kernels of its own (a plain copy holds none of the cast's registers):

- ``(x_words,)``: ``[T, W]``, the payload as words, copied;
- ``(fp8_words, scales)``: the FP8 pair, ``[T, H / 8]`` uint64 (the ``x_fp8`` bytes) and ``[T, H / 128]`` uint32
  (the float32 scales' bits);
- ``(x_words, x_values, is_bf16)``: the payload to quantize, ``x_values [T, H]`` its elements (bfloat16 as
  uint16 bits with ``is_bf16``) and ``x_words [T, H * itemsize / 8]`` uint64 the same rows as words.

The Python bodies are what the CUDA simulator runs; compiled kernels pick the form's writer when they are typed.
"""
from __future__ import annotations

from numba.cuda.extending import overload

from ep_comm.kernels.fp8 import write_cast_piece, write_pair_piece
from ep_comm.kernels.warp import copy_row

__all__ = ["write_row_piece"]


def _rows_piece(dst, source, t, begin, end, wide):
    copy_row(dst[begin:end], source[0][t, begin:end], end - begin, wide)


def _pair_piece(dst, source, t, begin, end, wide):
    write_pair_piece(dst, source[0][t], source[1][t], begin, end, wide)


def _cast_piece(dst, source, t, begin, end, wide):
    write_cast_piece(dst, source[0][t], source[1][t], source[2], begin, end, wide)


_WRITERS = (_rows_piece, _pair_piece, _cast_piece)  # by the source's length


def write_row_piece(dst, source, t, begin, end, wide):
    """Words ``[begin, end)`` of token ``t``'s row from ``source`` (see the module) into ``dst[begin:end]``, all
    lanes of a warp; ``wide``: 16 bytes per access (``begin``, ``end`` even, rows 16-byte aligned). A cast piece
    must start on a multiple of 32 words (``write_cast_piece``)."""
    _WRITERS[len(source) - 1](dst, source, t, begin, end, wide)


@overload(write_row_piece, target="cuda")
def _write_row_piece_cuda(dst, source, t, begin, end, wide):
    return _WRITERS[len(source) - 1]
