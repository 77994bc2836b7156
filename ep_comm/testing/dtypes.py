"""The dtype table of the tests, the checks and the examples: payload dtype names, their NumPy dtypes
(bfloat16 from ml_dtypes, the library's rule in ``ep_comm.contract.choices``) and the error bounds a computation
in each dtype is held to."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ep_comm.contract.choices import PAYLOAD_DTYPES

DTYPES: Dict[str, np.dtype] = dict(PAYLOAD_DTYPES)  # name -> NumPy dtype
DTYPE_NAMES: Tuple[str, ...] = tuple(sorted(DTYPES))

# Bound on a relative error ||out - reference|| / ||reference|| of a layer computed in float32 whose
# inputs, intermediate results and output are rounded to the payload dtype (float32: summation order only).
RELATIVE_ERROR_BOUND: Dict[str, float] = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}
