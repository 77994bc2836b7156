"""The benchmark command under ``mpirun``, as the CLI tests run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

from helpers.mpirun import launcher, run_job

REPO = Path(__file__).resolve().parents[2]


def run_bench(nranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``mpirun -n nranks python -m ep_comm.bench ARGS`` from the repository root, killed past ``timeout`` s."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return run_job(launcher(nranks, env) + [sys.executable, "-m", "ep_comm.bench", *args], env, timeout, cwd=REPO)


def bench_results(tmp_path: Path, nranks: int, *args: str) -> Tuple[Dict[str, Any], Path]:
    """``(JSON result, CSV path)`` of ``run_bench(nranks, *args)`` writing both into ``tmp_path``; the run must exit
    0."""
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    done = run_bench(nranks, *args, "--json", str(out), "--csv", str(table))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), table
