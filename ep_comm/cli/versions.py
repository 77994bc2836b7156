"""The version report of the commands (``python -m ep_comm.info``, the benchmark's header and JSON): Python,
ep_comm, the MPI library and the packages ep_comm uses, each as a string, never raising."""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
from typing import Dict, Sequence, Tuple

# (shown name, module to import, distribution names to ask for a version when the module has none)
PACKAGES: Sequence[Tuple[str, str, Tuple[str, ...]]] = (
    ("numpy", "numpy", ()),
    ("ml_dtypes", "ml_dtypes", ()),
    ("mpi4py", "mpi4py", ()),
    ("numba", "numba", ()),
    ("numba-cuda", "numba_cuda", ("numba-cuda",)),
    ("cupy", "cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("nvshmem4py", "nvshmem.core", ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py")),
    ("torch", "torch", ()),
)


def package_version(module: str, dists: Sequence[str] = ()) -> str:
    """Version of an importable module, ``not installed``, or ``import failed: ...``."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        return "not installed"
    except Exception as exc:  # a broken install (driver, ABI) is exactly what this command should show
        return f"import failed: {type(exc).__name__}: {exc}"
    top = sys.modules[module.split(".")[0]]
    version = getattr(mod, "__version__", None) or getattr(top, "__version__", None)
    for dist in dists:
        if version:
            break
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(version or "installed (version unknown)")


def mpi_library() -> str:
    """First line of the MPI library's version string (e.g. ``MPICH Version: 5.0.2``)."""
    try:
        from mpi4py import MPI
    except Exception as exc:
        return f"unavailable: {exc}"
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


def versions() -> Dict[str, str]:
    """Python, ep_comm, the MPI library and the packages of :data:`PACKAGES`."""
    from ep_comm import __version__

    out = {"python": platform.python_version(), "ep_comm": __version__}
    out.update({name: package_version(module, dists) for name, module, dists in PACKAGES})
    out["mpi_library"] = mpi_library()
    return out
