"""The FP8 payload of a dispatch on the GPU, as the scatter reads it: no packed rows are made before the send.

An :class:`Fp8Rows` names the arrays a packed FP8 row (``ep_comm.contract.fp8`` layout) is written from, by the scatter
itself (``ep_comm.kernels.payload``): the pair ``(x_fp8, scales)`` where the caller has it, or the payload ``x``
with the quantization of ``ep_comm.contract.fp8.quantize`` done as each row is read (``Buffer.dispatch(use_fp8=True)``).
Where a payload array is expected it stands for the packed rows ``[T, packed_row_bytes(H) / itemsize]`` viewed
in the buffer dtype (``shape``, ``dtype``), the rows that cross the link and land in ``recv_x``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np

from ep_comm.contract.fp8 import packed_row_bytes

__all__ = ["Fp8Rows"]

from ep_comm.contract.arrays import Array


class Fp8Rows(NamedTuple):
    """The sources of the packed FP8 rows of ``T`` tokens of ``H`` elements, each C-contiguous on the device.

    ``tokens``: ``x_fp8 [T, H]`` (any 1-byte dtype: e4m3fn bits) with ``scales [T, H / 128]`` float32 (the pair),
    or with ``scales`` None the payload ``x [T, H]`` (float32, float16, bfloat16) that the scatter quantizes;
    ``dtype``: the buffer dtype the packed rows are viewed in.
    """

    tokens: Array
    scales: Optional[Array]
    dtype: np.dtype

    @property
    def cast(self) -> bool:
        """Whether the scatter quantizes ``tokens`` (else it reads the pair)."""
        return self.scales is None

    @property
    def hidden(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def shape(self) -> Tuple[int, int]:
        """``(T, packed_row_bytes(H) / itemsize)``: the packed rows as a payload in the buffer dtype."""
        return int(self.tokens.shape[0]), packed_row_bytes(self.hidden) // self.dtype.itemsize

