"""The choices a Buffer takes by name: payload dtypes (bfloat16 from ml_dtypes), backends and transports."""
from __future__ import annotations

from typing import Any, Dict

import ml_dtypes
import numpy as np

BACKENDS = ("auto", "mpi", "nvshmem")  # Buffer(backend=...): "auto" picks nvshmem where a GPU stack runs, else mpi
# Buffer(transport=...) on nvshmem: "auto" (stores where every peer is in scale-up reach, else puts), peer-view
# stores, or NVSHMEM puts
TRANSPORTS = ("auto", "stores", "puts")

PAYLOAD_DTYPES: Dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def payload_dtype(dtype: Any) -> np.dtype:
    """Resolve ``dtype`` (a name or a NumPy dtype) to one of the supported payload dtypes."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:  # NumPy dtypes and scalar types (np.float32, ml_dtypes.bfloat16), torch-style objects by name
            name = np.dtype(dtype).name
        except TypeError:
            name = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(name, name)
    if name not in PAYLOAD_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not supported: use one of {sorted(PAYLOAD_DTYPES)}")
    return PAYLOAD_DTYPES[name]
