"""Launch of the FP8 quantize kernel (``ep_comm.kernels.fp8``): the sender's cast of an FP8 dispatch.

One warp per (row, 128-element block), ``THREADS`` to a block, at most ``max_blocks`` blocks
(grid-stride loops cover the rest); launched through Numba's dispatcher on a Numba stream.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ep_comm.fp8 import BLOCK, packed_row_bytes
from ep_comm.kernels.fp8 import quantize_kernel
from ep_comm.kernels.warp import WARP

__all__ = ["THREADS", "quantize_packed"]

THREADS = 256


def quantize_packed(stream: Any, x: Any, out: Any, *, max_blocks: int) -> None:
    """Write the packed FP8 rows of ``x [T, H]`` (float32/float16/bfloat16, bfloat16 as ml_dtypes or uint16
    bits; ``H % 128 == 0``, C-contiguous) into ``out [T, packed_row_bytes(H)]`` (uint8, C-contiguous): the
    bytes of ``ep_comm.fp8.pack(*ep_comm.fp8.quantize(x))``, pad bytes zero. Enqueued on ``stream``."""
    num_tokens, hidden = x.shape
    if tuple(out.shape) != (num_tokens, packed_row_bytes(hidden)) or np.dtype(out.dtype).itemsize != 1:
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}: must be uint8 "
                         f"[{num_tokens}, {packed_row_bytes(hidden)}] (packed_row_bytes(hidden={hidden}))")
    if num_tokens == 0:
        return
    is_bf16 = x.dtype not in (np.float32, np.float16)
    values = x.view(np.uint16) if is_bf16 else x
    warps = num_tokens * (hidden // BLOCK)
    blocks = max(1, min(max_blocks, -(-warps * WARP // THREADS)))
    quantize_kernel[blocks, THREADS, stream](values, is_bf16, out.view(np.uint32))
