"""Reading a routing ``topk_idx`` in device code.

An entry is an expert id ``0 <= e < num_experts``, or "no expert" (any negative id). Ids at or above
``num_experts`` are refused by ``Buffer.dispatch``'s argument check, except in a dispatch captured
into a CUDA graph: its check runs on the device and reports after the replay. Until then the kernels
must stay inside their arrays, so they read such an id as "no expert".
"""
from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit(device=True)
def routed_expert(topk_idx, t, k, num_experts):
    """Entry ``(t, k)`` as an int64 expert id; -1 for an id at or above ``num_experts`` (negative ids
    stay negative: "no expert")."""
    expert = np.int64(topk_idx[t, k])
    return expert if expert < num_experts else np.int64(-1)
