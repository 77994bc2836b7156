"""Starting ``mpiexec`` jobs from tests: which ``mpiexec`` to use and the flags that it needs.

Used by the tests that launch multi-rank jobs (``test_multirank.py``, ``test_examples.py``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Mapping

import pytest

# Variables forwarded to the ranks under Open MPI (MPICH passes the whole environment on by itself).
FORWARD_PREFIXES = ("EP_COMM_", "NVSHMEM_", "NCCL_", "NUMBA_", "CUDA_", "PYTHON", "UCX_", "LD_LIBRARY_PATH")


def mpiexec() -> str:
    """The mpiexec of the running interpreter's environment (the mpich wheel), else the PATH's."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        pytest.fail("no mpiexec: install the test extra (pip install -e '.[test]'), which brings the mpich wheel")
    return found


def launcher(num_ranks: int, env: Mapping[str, str]) -> List[str]:
    """mpiexec with the flags Open MPI needs to pass our environment on (MPICH passes it by itself)."""
    cmd = [mpiexec(), "-n", str(num_ranks)]
    version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        cmd += [a for name in sorted(env) if name.startswith(FORWARD_PREFIXES) for a in ("-x", name)]
    return cmd
