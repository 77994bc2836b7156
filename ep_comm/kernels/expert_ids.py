"""Reading a routing ``topk_idx`` in device code.

An entry is an expert id ``0 <= e < num_experts``, or "no expert" (any negative id). Ids at or above
``num_experts`` are refused, but on the device: the count kernel checks the routing while it counts and
its verdict travels with the count exchange (``check.py``). Until then the kernels must stay inside their
arrays, so they read such an id as "no expert".
"""
from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit(device=True)
def as_expert(entry, num_experts):
    """An int64 id as an expert id: -1 at or above ``num_experts`` (negative ids stay negative: "no expert")."""
    return entry if entry < num_experts else np.int64(-1)


@cuda.jit(device=True)
def routed_expert(topk_idx, t, k, num_experts):
    """Entry ``(t, k)`` as an int64 expert id (:func:`as_expert`)."""
    return as_expert(np.int64(topk_idx[t, k]), num_experts)
