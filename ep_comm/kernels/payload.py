"""What a sender writes as a token's row: its payload words as they are, or a packed FP8 row (``ep_comm.fp8``)
made on the way from the FP8 pair or from the payload with the cast (``ep_comm.kernels.fp8``).

A row's source is the tuple ``(form, x_words, scales, x_values, is_bf16)`` over the sender's ``T`` tokens:

- ``ROWS``: ``x_words [T, W]``, the payload as words, copied (``scales``, ``x_values`` are not read);
- ``FP8_PAIR``: ``x_words [T, H / 8]`` uint64, the ``x_fp8`` bytes; ``scales [T, H / 128]`` uint32, the float32
  scales' bits (``x_values`` is not read);
- ``FP8_CAST``: ``x_values [T, H]``, the payload elements (bfloat16 as uint16 bits with ``is_bf16``) and
  ``x_words [T, H * itemsize / 8]`` uint64, the same rows as words (``scales`` is not read).

Unread arrays are stand-ins of the same kinds from the host (``ep_comm.launching.fp8``).
"""
from __future__ import annotations

from numba import cuda

from ep_comm.kernels.fp8 import write_cast_piece, write_pair_piece
from ep_comm.kernels.warp import copy_row

ROWS = 0
FP8_PAIR = 1
FP8_CAST = 2


@cuda.jit(device=True)
def write_row_piece(dst, source, t, begin, end, wide):
    """Words ``[begin, end)`` of token ``t``'s row from ``source`` (see the module) into ``dst[begin:end]``, all
    lanes of a warp; ``wide``: 16 bytes per access (``begin``, ``end`` even, rows 16-byte aligned). An
    ``FP8_CAST`` piece must start on a multiple of 32 words (``write_cast_piece``)."""
    form, x_words, scales, x_values, is_bf16 = source
    if form == FP8_PAIR:
        write_pair_piece(dst, x_words[t], scales[t], begin, end, wide)
    elif form == FP8_CAST:
        write_cast_piece(dst, x_words[t], x_values[t], is_bf16, begin, end, wide)
    else:
        copy_row(dst[begin:end], x_words[t, begin:end], end - begin, wide)
