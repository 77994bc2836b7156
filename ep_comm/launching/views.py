"""How the kernels see arrays: typed views of a symmetric buffer, payload rows as raw words, and the
Numba device arrays a launch takes.

Payloads travel as raw words: rows of ``hidden * itemsize`` bytes are viewed as the widest of
uint64/uint32/uint16 that divides them (:func:`word_dtype`, :func:`payload_words`); bfloat16 is
handled as uint16 bits. Arrays are NumPy (in the simulator) or CuPy / any
``__cuda_array_interface__`` array (on a GPU); nothing here copies payload data.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
from numba import cuda

from ep_comm.launching.bound import array_fields
from ep_comm.symmetric import SymmetricLayout

Array = Any

__all__ = ["SymmetricViews", "symmetric_views", "word_dtype", "payload_words", "payload_rows", "wide_rows",
           "DeviceViews"]


class SymmetricViews(NamedTuple):
    """Typed views of one rank's symmetric buffer (``ep_comm.symmetric`` byte layout)."""

    signal: Array  # [R] int64
    counts: Array  # [2, R, 1 + L + 2] int64: per source rows, then entries per local expert, then its verdict
    rows: Array  # [2, R, max_tokens, row_bytes // word] words
    meta: Array  # [2, R, max_tokens, 1 + 2K] int32


def payload_words(x: Array) -> Array:
    """View ``x [rows, H]`` (float32/float16/bfloat16/uint16) as ``[rows, H * itemsize // word]`` words
    (:func:`word_dtype`), in one view."""
    return x.view(word_dtype(x.shape[1], x.dtype.itemsize))


def wide_rows(*arrays: Array) -> bool:
    """Whether a row copy between these word arrays (rows on the last axis) may move 16 bytes per access:
    64-bit words, an even number per row, and every row 16-byte aligned."""
    for a in arrays:
        if isinstance(a, np.ndarray):
            ptr, strides = a.__array_interface__["data"][0], a.strides
        else:
            ptr, _, strides, _ = array_fields(a)
        if a.dtype.itemsize != 8 or a.shape[-1] % 2 or ptr % 16 or any(st % 16 for st in strides[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=256)
def word_dtype(hidden: int, itemsize: int) -> np.dtype:
    """The word type :func:`payload_words` uses for rows of ``hidden`` elements of ``itemsize`` bytes: the widest
    of uint64/uint32/uint16 that divides a row (remembered: every launch asks it again)."""
    row_bytes = hidden * itemsize
    return np.dtype(next(w for w in (np.uint64, np.uint32, np.uint16) if row_bytes % np.dtype(w).itemsize == 0))


def symmetric_views(buffer: Array, layout: SymmetricLayout, word: np.dtype) -> SymmetricViews:
    """Typed views of a flat uint8 symmetric buffer (``layout.total_bytes`` long); rows as ``word``."""
    def region(offset: int, nbytes: int, dtype) -> Array:
        return buffer[offset: offset + nbytes].view(dtype)

    r, t = layout.num_ranks, layout.max_tokens
    rows_bytes = 2 * r * t * layout.row_bytes
    return SymmetricViews(
        signal=region(layout.signal_offset, 8 * r, np.int64),
        counts=region(layout.counts_offset, 16 * r * layout.count_words, np.int64).reshape(2, r, layout.count_words),
        rows=region(layout.rows_offset, rows_bytes, word).reshape(2, r, t, layout.row_bytes // np.dtype(word).itemsize),
        meta=region(layout.meta_offset, 2 * r * t * layout.meta_words * 4, np.int32).reshape(
            2, r, t, layout.meta_words),
    )


def payload_rows(rows: Array, dtype) -> Array:
    """Re-view ``[..., words]`` row storage as payload elements of ``dtype`` (bfloat16 as uint16 bits)."""
    dtype = np.dtype(dtype)
    return rows.view(dtype if dtype in (np.float32, np.float16) else np.uint16)


class DeviceViews:
    """Numba device arrays for the CUDA arrays a launch gets, made once per memory descriptor.

    Numba turns each ``__cuda_array_interface__`` argument into a device array on every launch
    (tens of microseconds of Python each, plus a stream sync when the interface names a stream);
    a Numba device array launches at almost no cost. The views are keyed by (pointer, shape,
    strides, type) and hold no reference to the memory: a hit describes the caller's array
    exactly, and the array is alive while its launch runs. No stream sync: every argument must be
    ready in stream order on the launch stream, as for CuPy's own kernels.
    """

    def __init__(self, capacity: int = 1024):
        self._views: "OrderedDict[tuple, Array]" = OrderedDict()
        self._capacity = capacity

    def __call__(self, a: Any) -> Any:
        """``a`` as a launch argument: tuples element-wise, CUDA arrays as cached Numba views, the rest as is."""
        if isinstance(a, tuple):
            return tuple(self(item) for item in a)
        desc = getattr(a, "__cuda_array_interface__", None)
        if desc is None or hasattr(a, "copy_to_host"):  # not a CUDA array, or a Numba one already
            return a
        key = (desc["data"][0], tuple(desc["shape"]), desc.get("strides"), desc["typestr"])
        view = self._views.get(key)
        if view is None:
            view = cuda.from_cuda_array_interface({k: v for k, v in desc.items() if k != "stream"}, owner=None,
                                                  sync=False)
            self._views[key] = view
            if len(self._views) > self._capacity:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return view
