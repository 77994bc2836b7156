"""Backends run the protocol: ``mpi`` (CPU, NumPy over MPI windows) and ``nvshmem`` (GPU).

Both implement ``interface.Backend``. The GPU stack (CuPy, Numba-CUDA, nvshmem4py) is imported in
one place, :func:`gpu_stack`, so that ``import ep_comm`` and the mpi backend need none of it.
"""
from __future__ import annotations

from typing import NamedTuple

from mpi4py import MPI

from ep_comm.backends.interface import Backend, BackendSettings
from ep_comm.backends.mpi import MpiBackend
from ep_comm.contract.choices import BACKENDS
from ep_comm.contract.geometry import Geometry


class _GpuStack(NamedTuple):
    """The classes of the nvshmem backend, loaded with the GPU stack."""

    backend: type  # NvshmemBackend
    transport: type  # NvshmemTransport
    device: type  # CupyDevice


def gpu_stack() -> _GpuStack:
    """THE lazy import of the package: the nvshmem backend's modules, which import CuPy, Numba-CUDA
    and nvshmem4py at their top; a RuntimeError says what is missing (its ``__cause__``: the ImportError)."""
    try:
        import nvshmem.core  # noqa: F401  (nvshmem4py: the heap calls it)

        from ep_comm.backends.cupy_device import CupyDevice
        from ep_comm.backends.nvshmem import NvshmemBackend
        from ep_comm.transport.nvshmem import NvshmemTransport
    except ImportError as exc:
        raise RuntimeError(f"backend='nvshmem' needs CuPy and nvshmem4py ({exc}); use backend='mpi' on CPU") from exc
    return _GpuStack(NvshmemBackend, NvshmemTransport, CupyDevice)


def gpu_available() -> bool:
    """True when the GPU stack imports and CuPy sees a CUDA device."""
    try:
        return gpu_stack().device.count() > 0
    except Exception:  # any import or driver failure means: no usable GPU stack here
        return False


def resolve_backend(name: str) -> str:
    """``"mpi"`` or ``"nvshmem"``: ``auto`` picks ``nvshmem`` where a GPU stack is present, else ``mpi``."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
    if name == "auto":
        return "nvshmem" if gpu_available() else "mpi"
    return name


def make_backend(name: str, comm: MPI.Comm, geo: Geometry, settings: BackendSettings) -> Backend:
    """Instantiate backend ``name`` (resolved by :func:`resolve_backend`); collective over ``comm``.

    ``settings`` (validated by the caller): ``num_sms`` sizes the ``nvshmem`` kernels' grids (None:
    all SMs of the device) and ``transport`` picks its stores or puts; the ``mpi`` backend has no
    kernels and one transport, and ignores both.
    """
    name = resolve_backend(name)
    if name == "mpi":
        return MpiBackend(comm, geo, settings)
    stack = gpu_stack()
    return stack.backend.open(comm, geo, settings, stack.transport, stack.device)
