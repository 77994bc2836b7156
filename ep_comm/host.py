"""Host-side array helpers for CPU code (bench, soak, the test oracle): NumPy only, no CuPy or Numba at load."""
from __future__ import annotations

from typing import Any

import numpy as np


def to_host(arr: Any) -> Any:
    """A NumPy array of a NumPy or CuPy array (or of a host list / int); None stays None."""
    if arr is None:
        return None
    return arr.get() if hasattr(arr, "__cuda_array_interface__") else np.asarray(arr)
