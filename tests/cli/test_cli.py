"""The shared command-line exit path: an error on one rank must end the whole MPI job, not hang it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import mpirun

REPO = Path(__file__).resolve().parents[2]

ONE_RANK_FAILS = """
from mpi4py import MPI
from ep_comm.cli import exit_collectively

def main():
    if MPI.COMM_WORLD.rank == 0:
        raise RuntimeError("rank 0 breaks")
    MPI.COMM_WORLD.Barrier()  # the others wait for rank 0 in a collective
    return 0

exit_collectively(main)
"""

ALL_RETURN = """
from ep_comm.cli import exit_collectively
exit_collectively(lambda: 4)
"""


def run_job(code: str, nranks: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               UCX_LOG_LEVEL="error")
    return mpirun.run_job(mpirun.launcher(nranks, env) + [sys.executable, "-c", code], env, timeout_s=120)


def test_an_error_on_one_rank_aborts_the_job_instead_of_hanging():
    done = run_job(ONE_RANK_FAILS)
    assert done.returncode != 0
    assert "RuntimeError: rank 0 breaks" in done.stderr
    assert "rank 0: unhandled error, aborting the MPI job" in done.stderr


def test_the_exit_status_of_main_is_the_jobs():
    assert run_job(ALL_RETURN).returncode == 4
