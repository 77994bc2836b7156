"""``python -m ep_comm.info``: what this machine offers ep_comm (versions, GPUs, NVLink, environment).

Works without a GPU: missing pieces are reported as such, never raised.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ep_comm.backends import resolve_backend
from ep_comm.bench.config import available_configs
from ep_comm.cli import ArgumentParser

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
ENV_PREFIXES = ("NVSHMEM_", "NCCL_", "NUMBA_", "CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "EP_COMM_")


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


def command_output(args: List[str]) -> Optional[str]:
    """Output of a command, or None when it is missing or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def gpus() -> str:
    """GPU list and NVLink topology from ``nvidia-smi``, or why there is none."""
    listing = command_output(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    if listing is None:
        return "no nvidia-smi (or it failed): no NVIDIA GPU visible"
    topo = command_output(["nvidia-smi", "topo", "-m"]) or "(nvidia-smi topo -m failed)"
    return f"{listing}\n\nNVLink topology (nvidia-smi topo -m):\n{topo}"


def environment() -> Dict[str, str]:
    """The environment variables that steer NVSHMEM, NCCL, Numba and rank-to-GPU binding."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def report() -> str:
    """The whole text printed by ``python -m ep_comm.info``."""
    lines = ["ep_comm info", "", "versions:"]
    lines += [f"  {k:<12} {v}" for k, v in versions().items()]
    lines += ["", f"backend='auto' resolves to: {resolve_backend('auto')}", "", "GPUs:", gpus(), "",
              "environment (NVSHMEM_*, NCCL_*, NUMBA_*, binding):"]
    env = environment()
    lines += [f"  {k}={v}" for k, v in env.items()] or ["  (none set)"]
    lines += ["", f"configs: {', '.join(available_configs())}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m ep_comm.info [--help]``: print :func:`report`."""
    about = __doc__.splitlines()[0].split(": ", 1)[1]
    ArgumentParser(prog="python -m ep_comm.info", description=about).parse_args(argv)
    print(report())


if __name__ == "__main__":
    main()
