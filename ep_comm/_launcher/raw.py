"""The package's one raw kernel launcher: ``cuLaunchKernel`` with a parameter block the caller prepared.

Every launch that bypasses Numba's dispatcher (pre-bound kernels, recorded calls, slotted kernels such as the
signal kernels) goes through :func:`launch`, so that a test can count or fake them in one place
(``raw.cuLaunchKernel``).

Programmatic dependent launch (off by default): a function registered by :func:`allow_programmatic` (the pre-bound
kernels of ``ep_comm.kernels`` compiled with ``EP_COMM_KERNEL_PDL=1``, which wait for their prerequisites first:
``ep_comm/kernels/pdl.py``) launches through ``cuLaunchKernelEx`` with the programmatic stream serialization
attribute, so that it may start while the kernel before it in the stream finishes. Nothing else ever does: a kernel
without ``griddepcontrol.wait`` could read its predecessor's results too early.
"""
from __future__ import annotations

from typing import Dict, Set, Tuple

from cuda.bindings.driver import (
    CUfunction,
    CUlaunchAttribute,
    CUlaunchAttributeID,
    CUlaunchConfig,
    CUresult,
    CUstream,
    cuLaunchKernel,
    cuLaunchKernelEx,
)

__all__ = ["launch", "stream", "allow_programmatic", "programmatic"]

_SUCCESS = CUresult.CUDA_SUCCESS
_STREAMS: Dict[int, CUstream] = {}
_PROGRAMMATIC: Set[int] = set()  # handles of the functions that launch with programmatic stream serialization
_CONFIGS: Dict[Tuple[int, int, int, int], CUlaunchConfig] = {}  # (grid, block, shared bytes, stream) -> config


def allow_programmatic(function: CUfunction) -> None:
    """Launch ``function`` with programmatic stream serialization from now on; only for kernels that execute
    ``griddepcontrol.wait`` before their first memory access (``ep_comm/kernels/pdl.py``)."""
    _PROGRAMMATIC.add(int(function))


def programmatic(function: CUfunction) -> bool:
    """Whether :func:`launch` starts ``function`` with programmatic stream serialization."""
    return int(function) in _PROGRAMMATIC


def _programmatic_config(grid: int, block: int, shared_bytes: int, on: CUstream) -> CUlaunchConfig:
    """The launch configuration of a programmatic launch, made once per shape and stream."""
    key = (grid, block, shared_bytes, int(on))
    config = _CONFIGS.get(key)
    if config is None:
        attribute = CUlaunchAttribute()
        attribute.id = CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes, config.hStream = shared_bytes, on
        config.attrs, config.numAttrs = [attribute], 1
        config = _CONFIGS[key] = config
    return config


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
    if _PROGRAMMATIC and int(function) in _PROGRAMMATIC:
        (result,) = cuLaunchKernelEx(_programmatic_config(grid, block, shared_bytes, on), function, params, 0)
    else:
        (result,) = cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, on, params, 0)
    if result != _SUCCESS:
        raise RuntimeError(f"cuLaunchKernel of {name} (grid={grid}, block={block}, "
                           f"shared_bytes={shared_bytes}) returned {result!r}")
