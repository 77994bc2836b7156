"""The arrays a launch takes: Numba device views of CUDA arrays, made once per memory descriptor, and whether
a row copy between word arrays may move 16 bytes per access (a choice a recorded call's key must hold: its rule,
``docs/design.md``, "Recorded calls", reads every array argument's pointer modulo 16). Nothing here copies payload
data."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from numba import cuda

from ep_comm._launcher.param_blocks import array_fields
from ep_comm.contract.arrays import Array

__all__ = ["DeviceViews", "wide_rows"]


def _pointer_and_strides(a: Array) -> tuple:
    """``(data pointer, byte strides)`` of a NumPy, CuPy or CUDA-array-interface array."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0], a.strides
    ptr, _, strides, _ = array_fields(a)
    return ptr, strides


def wide_rows(*arrays: Array) -> bool:
    """Whether a row copy between these word arrays (rows on the last axis) may move 16 bytes per access:
    64-bit words, an even number per row, and every row 16-byte aligned."""
    for a in arrays:
        ptr, strides = _pointer_and_strides(a)
        if a.dtype.itemsize != 8 or a.shape[-1] % 2 or ptr % 16 or any(st % 16 for st in strides[:-1]):
            return False
    return True


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
