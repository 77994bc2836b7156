"""GPU tests of the nvshmem backend: ``nvshmem_vs_mpi.py`` on stores, puts, and two virtual nodes under ``mpirun -n N`` for each
N of ``--ranks`` (default 2; several ranks may share one GPU), skipped without a GPU stack (CuPy, nvshmem4py
and a GPU).

On the device kit: ``source .device-kit/setup.sh && PYTHONPATH=$PWD:$PYTHONPATH pytest tests/gpu``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers.mpirun import launcher, run_job
from helpers.options import current

from ep_comm.backends import choose_backend

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("nvshmem_vs_mpi.py")
JOB_TIMEOUT_S = 420
DEFAULT_JOB_SIZES = (2,)


GPU = choose_backend("auto")  # skips only where the GPU stack is not installed or has no device; a broken one raises

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPU.name != "nvshmem", reason=f"needs a GPU with CuPy and nvshmem4py ({GPU.reason})")]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_ranks" in metafunc.fixturenames:
        metafunc.parametrize("num_ranks", current().ranks or DEFAULT_JOB_SIZES)


@pytest.mark.parametrize("transport, nodes, forwarding", [("stores", 1, False), ("puts", 1, False),
                                                         ("auto", 2, False), ("auto", 2, True)],
                         ids=["peer-stores", "nvshmem-puts", "two-virtual-nodes", "two-virtual-nodes-forwarded"])
def test_nvshmem_matches_mpi_and_times_out_cleanly(num_ranks, transport, nodes, forwarding):
    """``two-virtual-nodes``: ``transport="auto"`` with ``scaleup_ranks = num_ranks / 2``: stores inside a node,
    puts between the two; ``-forwarded``: ``forwarding=True``, against the mpi backend forwarding in the same nodes."""
    if num_ranks % nodes:
        pytest.skip(f"{num_ranks} ranks do not split into {nodes} nodes")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               NUMBA_CUDA_ENABLE_NRT="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = launcher(num_ranks, env) + [sys.executable, str(SCRIPT), "--transport", transport]
    if nodes > 1:
        cmd += ["--scaleup-ranks", str(num_ranks // nodes)]
    if forwarding:
        cmd.append("--forwarding")
    proc = run_job(cmd, env, JOB_TIMEOUT_S, cwd=REPO)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ALL OK") == num_ranks
