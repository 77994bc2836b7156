"""The arrays ep_comm takes and returns, and their host copies: NumPy only, no CuPy or Numba at load."""
from __future__ import annotations

from typing import Any

import numpy as np

from ep_comm.contract.choices import PAYLOAD_DTYPES

Array = Any  # numpy.ndarray on the mpi backend; cupy.ndarray (or any __cuda_array_interface__ array) on nvshmem


def to_host(arr: Any) -> Any:
    """A NumPy array of a NumPy, CuPy or Numba device array (or of a host list / int); None stays None.

    A NumPy array comes back as is, not copied."""
    if arr is None:
        return None
    if hasattr(arr, "copy_to_host"):  # a Numba device array
        return arr.copy_to_host()
    return arr.get() if hasattr(arr, "__cuda_array_interface__") else np.asarray(arr)


def as_float32(xp: Any, a: Any, copy: bool) -> Any:
    """Floating array ``a`` as float32 (a new array when ``copy``); bfloat16 exactly through its bits, so that
    no bfloat16 arithmetic is needed from the array module (CuPy)."""
    if np.dtype(a.dtype) == PAYLOAD_DTYPES["bfloat16"]:
        return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32, copy=copy)
