"""GPU tests of the nvshmem backend: ``nvshmem_vs_mpi.py`` under ``mpirun -np 2`` (skipped without 2 GPUs).

On the device kit: ``source .device-kit/setup.sh && PYTHONPATH=$PWD:$PYTHONPATH pytest tests/gpu``.
Open MPI needs the environment forwarded (``-x``); MPICH's mpirun forwards it by itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("nvshmem_vs_mpi.py")
FORWARD = ("PYTHONPATH", "NVSHMEM_DISABLE_NVLS", "NUMBA_CUDA_ENABLE_NRT", "NCCL_NVLS_ENABLE",
           "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def gpu_count() -> int:
    try:
        import cupy
        import nvshmem.core  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no nvshmem4py or no driver: no usable GPU here
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs with CuPy and nvshmem4py")]


def mpirun_command(nranks: int, transport: str) -> list:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on PATH")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    cmd = [mpirun, "-np", str(nranks)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + [a for name in FORWARD if name in os.environ for a in ("-x", name)]
    return cmd + [sys.executable, str(SCRIPT), "--transport", transport]


@pytest.mark.parametrize("transport", ["stores", "puts"], ids=["peer-stores", "nvshmem-puts"])
def test_nvshmem_matches_mpi_and_times_out_cleanly(transport):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               NUMBA_CUDA_ENABLE_NRT="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run(mpirun_command(2, transport), cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ALL OK") == 2
