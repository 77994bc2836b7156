"""The environment checks a command makes before any work: an MPI that is not the launcher's, a GPU
stack that is missing. Each yields one line for the user, never a traceback."""
from __future__ import annotations

import os
from typing import Optional

from mpi4py import MPI

from ep_comm.backends import gpu_stack

# Environment variables in which launchers announce the job's size: Open MPI, then MPICH's Hydra / PMI.
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def mpi_problem(comm: MPI.Comm) -> Optional[str]:
    """Why ``comm`` (COMM_WORLD) is not the job the launcher started, or None: a launcher that announced
    N > 1 ranks while mpi4py's MPI sees one is another MPI than the launcher's (every rank is rank 0 of 1)."""
    for name in LAUNCHER_SIZE_VARIABLES:
        announced = os.environ.get(name, "")
        if announced.isdigit() and int(announced) > 1 and comm.size == 1:
            library = " ".join(MPI.Get_library_version().split()[:3])
            return (f"the launcher started {announced} ranks ({name}={announced}) but mpi4py's MPI ({library}) "
                    f"sees 1: mpirun is not the MPI mpi4py was built against (see README, 'GPU and clusters')")
    return None


def gpu_problem(backend: str) -> Optional[str]:
    """Why ``backend`` ('auto', 'mpi' or 'nvshmem') cannot run here, or None: only 'nvshmem' needs
    CuPy, numba-cuda, nvshmem4py (the backend's own loader, ``ep_comm.backends.gpu_stack``) and a CUDA device."""
    if backend != "nvshmem":
        return None
    try:
        stack = gpu_stack()
    except RuntimeError as exc:
        return (f"--backend nvshmem needs CuPy, numba-cuda and nvshmem4py (pip install -e '.[gpu]'): "
                f"{exc.__cause__ or exc}; use --backend mpi on CPU")
    try:
        count = stack.device.count()
    except Exception as exc:  # a missing driver or libcudart shows here: say which, do not trace it
        return f"--backend nvshmem: CuPy finds no CUDA device ({type(exc).__name__}: {exc})"
    return None if count else "--backend nvshmem: CuPy finds no CUDA device"


def environment_problem(comm: MPI.Comm, backend: str) -> Optional[str]:
    """The first rank's problem among :func:`mpi_problem` and :func:`gpu_problem`, prefixed with the
    ranks that have one (``ranks [0, 1, 2, 3]: ...``); None when no rank has one. Collective over ``comm``."""
    problems = comm.allgather(mpi_problem(comm) or gpu_problem(backend))
    ranks = [rank for rank, problem in enumerate(problems) if problem]
    return f"ranks {ranks}: {problems[ranks[0]]}" if ranks else None
