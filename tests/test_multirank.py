"""Runs the collective suites of ``tests/mpi`` on every rank of ``mpirun -np N`` jobs (N = 1..4).

Each rank runs the same pytest session; this test passes when every rank's session passes.
A hung job is killed after a bounded time, so a protocol bug shows as a failure, not a stall.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import launcher

SUITE = Path(__file__).parent / "mpi"
JOB_TIMEOUT_S = 600


BACKEND = os.environ.get("EP_COMM_TEST_BACKEND", "mpi")
RANKS = [1, 2] if BACKEND == "nvshmem" else [1, 2, 3, 4]  # nvshmem: one rank per GPU (2-GPU machines)


@pytest.mark.parametrize("num_ranks", RANKS)
def test_contract_suite_under_mpirun(num_ranks):
    env = dict(os.environ, EP_COMM_MPI_SUITE="1", UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1")
    cmd = launcher(num_ranks, env) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun -np {num_ranks} did not finish within {JOB_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}:\n{run.stdout[-20000:]}\n{run.stderr[-5000:]}"
    # ranks share one stdout, so their summary lines may interleave: count the summaries, not lines
    passed = re.findall(r"\d+ passed", run.stdout)
    assert len(passed) == num_ranks, f"expected one pytest summary per rank, got:\n{run.stdout[-5000:]}"
    assert not re.search(r"\d+ (failed|errors?)\b", run.stdout), run.stdout[-20000:]
