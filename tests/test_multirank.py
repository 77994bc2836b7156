"""Runs the collective suites of ``tests/mpi`` on every rank of ``mpirun -n N`` jobs (N: ``--ranks``; default
1..4 on mpi, 1..2 on nvshmem), with this session's ``--backend``, ``--transport`` and Hypothesis profile.

Each rank runs the same pytest session and writes its own JUnit XML result; this test passes when every
rank's file shows tests passed and none failed. A hung job is killed after a bounded time, so a protocol
bug shows as a failure, not a stall.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import rank_results
from helpers.mpirun import launcher, run_job
from helpers.options import current

SUITE = Path(__file__).parent / "mpi"
JOB_TIMEOUT_S = 600


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_ranks" in metafunc.fixturenames:
        metafunc.parametrize("num_ranks", current().job_sizes)


def job_output(job: subprocess.CompletedProcess) -> str:
    return f"{' '.join(job.args)} exited {job.returncode}:\n{job.stdout[-20000:]}\n{job.stderr[-5000:]}"


def test_contract_suite_under_mpirun(num_ranks, session_options, tmp_path):
    env = dict(os.environ, UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1")
    cmd = launcher(num_ranks, env) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi",
                                      *session_options.pytest_args(), f"--junitxml={rank_results.pattern(tmp_path)}",
                                      str(SUITE)]
    job = run_job(cmd, env, JOB_TIMEOUT_S)
    for rank in range(num_ranks):
        try:
            result = rank_results.read(tmp_path, rank)
        except (OSError, SyntaxError) as exc:  # no file, or a cut-off one: the rank died before its summary
            pytest.fail(f"rank {rank} left no readable result ({exc}); {job_output(job)}")
        assert result.failures == 0 and result.errors == 0 and result.passed > 0, \
            f"{result.summary()}\n" + "\n".join(result.failed_texts)[-20000:] + f"\n{job_output(job)}"
    assert job.returncode == 0, job_output(job)
