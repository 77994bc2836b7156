"""Runs the collective suites of ``tests/mpi`` on every rank of ``mpirun -n N`` jobs (N: ``--ranks``; default
1..4 on mpi, 1..2 on nvshmem), with this session's ``--backend``, ``--transport`` and Hypothesis profile; on mpi
also the contract, randomized, error, hook, FP8 and input-layout suites in virtual nodes (4 ranks as 2 nodes, 6 as 3
and 2, 8 as 2 and 4), flat and forwarded (Hypothesis's ``nodes`` profile unless ``--hypothesis-profile`` is given),
and ``test_forwarding`` at 6 and 8 ranks.

Each rank runs the same pytest session and writes its own JUnit XML result; this test passes when every
rank's file shows tests passed and none failed. A hung job is killed after a bounded time, so a protocol
bug shows as a failure, not a stall.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from helpers import rank_results
from helpers.mpirun import launcher, run_job
from helpers.options import SessionOptions, current

SUITE = Path(__file__).parents[1] / "mpi"  # tests/mpi
JOB_TIMEOUT_S = 600
# Under pytest-xdist (.ci/run, --dist loadgroup) the jobs of one group run one after another on one worker: two
# groups of about the same length (on 2 cores), so that at most two jobs run at once
GROUP_A, GROUP_B = pytest.mark.xdist_group("multirank_a"), pytest.mark.xdist_group("multirank_b")
# (ranks, ranks per node) of the jobs that run NODE_SUITES in virtual nodes, flat and forwarded (issues 31 and 39)
VIRTUAL_NODES = [pytest.param(4, 2, marks=GROUP_B), pytest.param(6, 2, marks=GROUP_A),
                 pytest.param(6, 3, marks=GROUP_B), pytest.param(8, 2, marks=GROUP_B),
                 pytest.param(8, 4, marks=GROUP_A)]
NODE_SUITES = ["test_contract.py", "test_randomized.py", "test_errors.py", "test_recv_hook.py", "test_fp8_dispatch.py",
               "test_input_layouts.py"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_ranks" in metafunc.fixturenames:
        metafunc.parametrize("num_ranks", [pytest.param(n, marks=GROUP_A) for n in current().job_sizes])


def job_output(job: subprocess.CompletedProcess) -> str:
    return f"{' '.join(job.args)} exited {job.returncode}:\n{job.stdout[-20000:]}\n{job.stderr[-5000:]}"


def test_contract_suite_under_mpirun(num_ranks, session_options, tmp_path):
    run_suites(num_ranks, session_options, [SUITE], tmp_path)


@pytest.mark.parametrize("forwarding", [False, True], ids=["flat", "forwarded"])
@pytest.mark.parametrize("ranks, scaleup_ranks", VIRTUAL_NODES)
def test_suites_in_virtual_nodes(ranks, scaleup_ranks, forwarding, session_options, tmp_path):
    if session_options.backend != "mpi":
        pytest.skip("virtual nodes and forwarding are checked on the mpi backend")
    # Hypothesis's nodes profile unless one was chosen: 50 randomized cases a job, 500 over the ten node splits
    options = dataclasses.replace(session_options, scaleup_ranks=scaleup_ranks, forwarding=forwarding,
                                  hypothesis_profile=session_options.hypothesis_profile or "nodes")
    run_suites(ranks, options, [SUITE / name for name in NODE_SUITES], tmp_path)


@pytest.mark.parametrize("ranks", [pytest.param(6, marks=GROUP_A), pytest.param(8, marks=GROUP_B)])
def test_forwarding_suite_at_more_ranks(ranks, session_options, tmp_path):
    """``test_forwarding`` at the job sizes of more nodes (the contract suite's jobs run it up to 4 ranks)."""
    run_suites(ranks, session_options, [SUITE / "test_forwarding.py"], tmp_path)


def run_suites(num_ranks: int, options: SessionOptions, paths: List[Path], tmp_path: Path) -> None:
    """Run the collective suites ``paths`` with ``options`` on every rank of an ``mpirun -n num_ranks`` job; every
    rank's result must show tests passed and none failed."""
    env = dict(os.environ, UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1")
    cmd = launcher(num_ranks, env) + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                      "--with-mpi",
                                      *options.pytest_args(), f"--junitxml={rank_results.pattern(tmp_path)}",
                                      *map(str, paths)]
    job = run_job(cmd, env, JOB_TIMEOUT_S)
    for rank in range(num_ranks):
        try:
            result = rank_results.read(tmp_path, rank)
        except (OSError, SyntaxError) as exc:  # no file, or a cut-off one: the rank died before its summary
            pytest.fail(f"rank {rank} left no readable result ({exc}); {job_output(job)}")
        assert result.failures == 0 and result.errors == 0 and result.passed > 0, \
            f"{result.summary()}\n" + "\n".join(result.failed_texts)[-20000:] + f"\n{job_output(job)}"
    assert job.returncode == 0, job_output(job)
