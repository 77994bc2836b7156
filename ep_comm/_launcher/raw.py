"""The package's one raw kernel launcher: ``cuLaunchKernel`` with a parameter block the caller prepared.

Every launch that bypasses Numba's dispatcher (pre-bound kernels, recorded calls, slotted kernels such as the
signal kernels) goes through :func:`launch`, so that a test can count or fake them in one place
(``raw.driver_launch``). Functions and streams are the driver's handles as integers: nothing is converted per
launch. ``driver_launch`` is CuPy's binding of ``cuLaunchKernel`` where CuPy is installed (C-typed arguments:
about 0.7 us less per launch than cuda.bindings' on an H100, whose arguments are typed in Python), else
cuda.bindings'.

Programmatic dependent launch (off by default): a function registered by :func:`allow_programmatic` (the pre-bound
kernels of ``ep_comm.kernels`` compiled with ``EP_COMM_KERNEL_PDL=1``, which wait for their prerequisites first:
``ep_comm/kernels/pdl.py``) launches through ``cuLaunchKernelEx`` with the programmatic stream serialization
attribute, so that it may start while the kernel before it in the stream finishes. Nothing else ever does: a kernel
without ``griddepcontrol.wait`` could read its predecessor's results too early.
"""
from __future__ import annotations

from typing import Callable, Dict, Set, Tuple

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

__all__ = ["launch", "allow_programmatic", "programmatic", "driver_launch"]

_SUCCESS = CUresult.CUDA_SUCCESS
_PROGRAMMATIC: Set[int] = set()  # handles of the functions that launch with programmatic stream serialization
_CONFIGS: Dict[Tuple[int, int, int, int], CUlaunchConfig] = {}  # (grid, block, shared bytes, stream) -> config


def _bindings_launch(function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared_bytes: int,
                     stream: int, params: int, extra: int) -> None:
    """``cuLaunchKernel`` through cuda.bindings, arguments as CuPy's ``driver.launchKernel`` takes them;
    RuntimeError naming the driver's result where it refuses."""
    _succeeded(*cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra))


def _succeeded(result: CUresult) -> None:
    """RuntimeError naming a cuda.bindings ``result`` other than success."""
    if result != _SUCCESS:
        raise RuntimeError(f"returned {result!r}")


def _driver_launch() -> Callable[..., None]:
    """CuPy's ``driver.launchKernel`` where CuPy is installed (it raises ``CUDADriverError``, a RuntimeError, where
    the driver refuses), else :func:`_bindings_launch`."""
    try:
        from cupy.cuda import driver
    except ImportError:
        return _bindings_launch
    return driver.launchKernel


driver_launch = _driver_launch()


def allow_programmatic(function: int) -> None:
    """Launch ``function`` (a driver handle) with programmatic stream serialization from now on; only for kernels
    that execute ``griddepcontrol.wait`` before their first memory access (``ep_comm/kernels/pdl.py``)."""
    _PROGRAMMATIC.add(function)


def programmatic(function: int) -> bool:
    """Whether :func:`launch` starts ``function`` (a driver handle) with programmatic stream serialization."""
    return function in _PROGRAMMATIC


def _programmatic_config(grid: int, block: int, shared_bytes: int, on: int) -> CUlaunchConfig:
    """The launch configuration of a programmatic launch on stream handle ``on``, made once per shape and
    stream."""
    key = (grid, block, shared_bytes, on)
    config = _CONFIGS.get(key)
    if config is None:
        attribute = CUlaunchAttribute()
        attribute.id = CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes, config.hStream = shared_bytes, CUstream(on)
        config.attrs, config.numAttrs = [attribute], 1
        config = _CONFIGS[key] = config
    return config


def launch(function: int, grid: int, block: int, shared_bytes: int, on: int, params: int, name: str) -> None:
    """Launch ``function`` (a driver handle) on ``grid`` x 1 x 1 blocks of ``block`` x 1 x 1 threads with
    ``shared_bytes`` of dynamic shared memory on the stream whose handle is ``on`` (0: the legacy default stream);
    ``params`` is the address of the ``void*[]`` of its parameters' addresses (the driver copies them during the
    call). RuntimeError naming ``name`` (e.g. ``kernel count_kernel``), the shape and the driver's answer when the
    driver refuses.
    """
    try:
        if _PROGRAMMATIC and function in _PROGRAMMATIC:
            _succeeded(*cuLaunchKernelEx(_programmatic_config(grid, block, shared_bytes, on), CUfunction(function),
                                         params, 0))
        else:
            driver_launch(function, grid, 1, 1, block, 1, 1, shared_bytes, on, params, 0)
    except RuntimeError as refused:  # CuPy's CUDADriverError is one
        raise RuntimeError(f"cuLaunchKernel of {name} (grid={grid}, block={block}, shared_bytes={shared_bytes}) "
                           f"failed: {refused}") from refused
