"""Backends run the protocol: ``mpi`` (CPU, NumPy over MPI windows) and ``nvshmem`` (GPU).

Both implement ``interface.Backend``. The GPU stack (CuPy, Numba-CUDA, nvshmem4py) is imported in
one place, :func:`gpu_stack`, so that ``import ep_comm`` and the mpi backend need none of it;
:func:`choose_backend` probes it for ``backend="auto"``.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, NamedTuple

from mpi4py import MPI

from ep_comm.backends.interface import Backend, BackendSettings
from ep_comm.backends.mpi import MpiBackend
from ep_comm.contract.choices import BACKENDS
from ep_comm.contract.geometry import Geometry

_LOG = logging.getLogger(__name__)
# the modules of the GPU stack whose absence means "not installed" (auto then picks mpi), and what they come from
GPU_PACKAGES: Dict[str, str] = {"cupy": "CuPy", "nvshmem": "nvshmem4py", "numba": "Numba", "numba.cuda": "Numba-CUDA",
                                "cuda": "cuda-python"}
# CuPy's runtime errors that mean "no CUDA device here" (auto then picks mpi)
NO_DEVICE: Dict[int, str] = {35: "cudaErrorInsufficientDriver", 100: "cudaErrorNoDevice"}


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

        from ep_comm.backends.nvshmem import NvshmemBackend
        from ep_comm.backends.nvshmem.cupy_device import CupyDevice
        from ep_comm.transport.nvshmem import NvshmemTransport
    except ImportError as exc:
        raise RuntimeError(f"backend='nvshmem' needs CuPy and nvshmem4py ({exc}); use backend='mpi' on CPU") from exc
    return _GpuStack(NvshmemBackend, NvshmemTransport, CupyDevice)


def gpu_available() -> bool:
    """True when :func:`choose_backend` would pick ``nvshmem`` for ``auto`` (raises as it does)."""
    return choose_backend("auto").name == "nvshmem"


class BackendChoice(NamedTuple):
    """The backend a Buffer runs (``"mpi"`` or ``"nvshmem"``) and the grounds on which it was chosen."""

    name: str
    reason: str


def choose_backend(name: str) -> BackendChoice:
    """The backend ``name`` (``auto``, ``mpi`` or ``nvshmem``) resolves to, and why: ``auto`` picks ``nvshmem``
    where CuPy, Numba-CUDA and nvshmem4py import and CuPy sees a CUDA device, and ``mpi`` where one of them is not
    installed or there is no device (no driver). Any other failure of the GPU stack (a broken library, a driver
    error) raises RuntimeError naming it: a broken install never silently selects the CPU backend."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
    if name != "auto":
        return BackendChoice(name, f"backend={name!r} was asked for")
    try:
        cupy = _import_gpu_packages()
    except Exception as exc:
        return BackendChoice("mpi", "auto: " + _not_installed(exc))
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return BackendChoice("mpi", "auto: " + _no_device(exc, cupy))
    if count < 1:
        return BackendChoice("mpi", "auto: CuPy counts 0 CUDA devices")
    return BackendChoice("nvshmem", f"auto: CuPy, Numba-CUDA and nvshmem4py import, CuPy sees {count} CUDA device(s)")


def _import_gpu_packages() -> Any:
    """CuPy, after importing the GPU stack's packages (CuPy, Numba-CUDA, nvshmem4py)."""
    import cupy
    import numba.cuda  # noqa: F401
    import nvshmem.core  # noqa: F401

    return cupy


def _not_installed(exc: Exception) -> str:
    """Why ``auto`` chose ``mpi`` when ``exc``, raised importing the GPU stack, says a package of it is not
    installed; RuntimeError naming ``exc`` when it says anything else."""
    if isinstance(exc, ModuleNotFoundError) and exc.name in GPU_PACKAGES:
        return f"{GPU_PACKAGES[exc.name]} is not installed ({exc})"
    raise RuntimeError(f"backend='auto': importing the GPU stack (CuPy, Numba-CUDA, nvshmem4py) failed with "
                       f"{type(exc).__name__}: {exc}; the stack is installed but broken: repair it, or pass "
                       "backend='mpi' to run on CPU") from exc


def _no_device(exc: Exception, cupy: Any) -> str:
    """Why ``auto`` chose ``mpi`` when ``exc``, raised by CuPy's device count, says there is no CUDA device or no
    driver; RuntimeError naming ``exc`` when it says anything else."""
    status = getattr(exc, "status", None)
    if isinstance(exc, cupy.cuda.runtime.CUDARuntimeError) and status in NO_DEVICE:
        return f"CuPy finds no CUDA device ({NO_DEVICE[status]}: {exc})"
    raise RuntimeError(f"backend='auto': cupy.cuda.runtime.getDeviceCount() failed with {type(exc).__name__}: "
                       f"{exc}; the CUDA driver or runtime is broken: repair it, or pass backend='mpi' to run on "
                       "CPU") from exc


def resolve_backend(name: str) -> str:
    """``"mpi"`` or ``"nvshmem"``: :func:`choose_backend`'s choice, its grounds logged at DEBUG
    (logger ``ep_comm.backends``)."""
    choice = choose_backend(name)
    _LOG.debug("backend=%r resolves to %r: %s", name, choice.name, choice.reason)
    return choice.name


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
