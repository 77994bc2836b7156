"""Backends run the protocol: ``mpi`` (CPU, NumPy over MPI windows) and ``nvshmem`` (GPU)."""
from __future__ import annotations

from typing import Optional

from mpi4py import MPI

from ..validate import Geometry

BACKENDS = ("auto", "mpi", "nvshmem")


def gpu_available() -> bool:
    """True when CuPy sees a CUDA device and nvshmem4py imports."""
    try:
        import cupy
        import nvshmem.core  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # any import or driver failure means: no usable GPU stack here
        return False


def resolve_backend(name: str) -> str:
    """``"mpi"`` or ``"nvshmem"``: ``auto`` picks ``nvshmem`` where a GPU stack is present, else ``mpi``."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
    if name == "auto":
        return "nvshmem" if gpu_available() else "mpi"
    return name


def make_backend(name: str, comm: MPI.Comm, geo: Geometry, deterministic: bool, timeout_s: float,
                 num_sms: Optional[int] = None):
    """Instantiate backend ``name`` (resolved by :func:`resolve_backend`).

    ``num_sms`` (validated by the caller: None or an int >= 1) sizes the ``nvshmem`` kernels' grids
    (None: all SMs of the device); the ``mpi`` backend has no kernels and ignores it.
    """
    name = resolve_backend(name)
    if name == "mpi":
        from .mpi import MpiBackend

        return MpiBackend(comm, geo, deterministic, timeout_s)
    from .nvshmem import NvshmemBackend

    return NvshmemBackend(comm, geo, deterministic, timeout_s, num_sms=num_sms)
