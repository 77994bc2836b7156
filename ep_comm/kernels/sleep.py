"""A kernel that only keeps the GPU busy: the kernel benchmark (``ep_comm.bench.kernels``) queues the
launches it times behind it."""
from __future__ import annotations

from numba import cuda

from ep_comm.kernels.jit import kernel


@kernel
def sleep_kernel(microseconds):
    """Keep the GPU busy for about ``microseconds`` (one thread)."""
    for _ in range(microseconds):
        cuda.nanosleep(1000)
