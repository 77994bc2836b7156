"""The benchmark command under ``mpirun``, as the CLI tests run it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.mpirun import launcher, run_job

REPO = Path(__file__).resolve().parents[2]


def run_bench(nranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``mpirun -n nranks python -m ep_comm.bench ARGS`` from the repository root, killed past ``timeout`` s."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return run_job(launcher(nranks, env) + [sys.executable, "-m", "ep_comm.bench", *args], env, timeout, cwd=REPO)
