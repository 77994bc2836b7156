"""The package's one raw kernel launcher: ``cuLaunchKernel`` with a parameter block the caller prepared.

Every launch that bypasses Numba's dispatcher (pre-bound kernels, recorded calls, slotted kernels such as the
signal kernels) goes through :func:`launch`, so that a test can count or fake them in one place
(``raw.cuLaunchKernel``).
"""
from __future__ import annotations

from typing import Dict

from cuda.bindings.driver import CUfunction, CUresult, CUstream, cuLaunchKernel

__all__ = ["launch", "stream"]

_SUCCESS = CUresult.CUDA_SUCCESS
_STREAMS: Dict[int, CUstream] = {}


def stream(handle: int) -> CUstream:
    """The driver object of stream handle ``handle`` (0: the legacy default stream), made once per handle."""
    held = _STREAMS.get(handle)
    if held is None:
        held = _STREAMS[handle] = CUstream(handle)
    return held


def launch(function: CUfunction, grid: int, block: int, shared_bytes: int, on: CUstream, params: int,
           name: str) -> None:
    """Launch ``function`` on ``grid`` x 1 x 1 blocks of ``block`` x 1 x 1 threads with ``shared_bytes`` of dynamic
    shared memory on stream ``on``; ``params`` is the address of the ``void*[]`` of its parameters' addresses (the
    driver copies them during the call). RuntimeError naming ``name`` (e.g. ``kernel count_kernel``) and the shape
    when the driver refuses.
    """
    (result,) = cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, on, params, 0)
    if result != _SUCCESS:
        raise RuntimeError(f"cuLaunchKernel of {name} (grid={grid}, block={block}, "
                           f"shared_bytes={shared_bytes}) returned {result!r}")
