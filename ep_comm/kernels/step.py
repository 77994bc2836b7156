"""The collective step as the kernels see it: a device counter, so that launches need no host value.

A Buffer's step counter is an int64 ``[1]`` device array that a tiny kernel advances at the start of
every dispatch, combine and close (``ep_comm.transport.gpu_copy.advance_step``). Kernels read the
buffer parity (which half of the double-buffered symmetric regions a step uses) from it instead of
taking it as an argument: the same launches are then right at every step, which is what a CUDA
graph replay needs. A constant ``[0]`` array selects parity 0 (the puts staging area has one half).
"""
from __future__ import annotations

from numba import cuda


@cuda.jit(device=True)
def step_parity(step):
    """Parity (0 or 1) of the step number held in ``step[0]`` (int64)."""
    return step[0] & 1
