"""Starting ``mpiexec`` jobs from tests: which ``mpiexec`` to use, the flags it needs, and a bounded run.

Every test that starts a job uses this module (``test_multirank``, ``test_examples``, ``test_soak``, ``test_cli``,
``test_bench_cli``, ``gpu/test_nvshmem_backend``). A job runs in its own session and process group; one that
outlives its time limit has the whole group killed and fails the test with its output, so a hang never stalls
the test run.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

import pytest

# Variables forwarded to the ranks under Open MPI (MPICH passes the whole environment on by itself).
FORWARD_PREFIXES = ("EP_COMM_", "NVSHMEM_", "NCCL_", "NUMBA_", "CUDA_", "PYTHON", "UCX_", "LD_LIBRARY_PATH")
# MPICH's progress engine spins while a rank waits in a collective; with more ranks than cores (the 4..8-rank jobs on
# a 2-core machine) the spinning ranks take the CPU from the rank they wait for. Throttled, a rank that found nothing
# to do for a while sleeps 1 us between polls. Given to every job unless its environment sets them (Open MPI and
# commands that are no MPI job ignore them).
OVERSUBSCRIBED = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "256"}


def mpiexec() -> str:
    """The mpiexec beside the running interpreter (the venv's mpich wheel), else the PATH's.

    On the GPU machines no mpich wheel sits beside the interpreter, so this finds Open MPI's, the MPI that
    mpi4py is built against there.
    """
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        pytest.fail("no mpiexec: install the test extra (pip install -e '.[test]'), which brings the mpich wheel")
    return found


def launcher(num_ranks: int, env: Mapping[str, str]) -> List[str]:
    """``mpiexec -n num_ranks`` with the flags Open MPI needs: oversubscription (several ranks per core or
    GPU), ``--allow-run-as-root`` as root, and ``-x NAME`` for each variable of ``env`` the ranks need."""
    cmd = [mpiexec(), "-n", str(num_ranks)]
    version = mpiexec_version(cmd[0])
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        cmd += [a for name in sorted(env) if name.startswith(FORWARD_PREFIXES) for a in ("-x", name)]
    return cmd


@functools.lru_cache(maxsize=None)
def mpiexec_version(path: str) -> str:
    """``path --version``'s output (asked once per session)."""
    return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout


def run_job(cmd: Sequence[str], env: Mapping[str, str], timeout_s: float,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion in a new session, capturing its text output.

    Args:
        cmd: the command line (usually ``launcher(...)`` followed by the ranks' command).
        env: its environment (plus ``OVERSUBSCRIBED``'s variables where it does not set them).
        timeout_s: hard limit; past it the job's whole process group (mpiexec and every rank it started) is
            killed and the calling test fails with the output so far.
        cwd: its working directory (None: this process's).

    Returns:
        The finished process (any exit status; the caller asserts on it).
    """
    proc = subprocess.Popen(list(cmd), cwd=cwd, env={**OVERSUBSCRIBED, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)  # before reaping mpiexec, so that its group id cannot have been reused
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout_s} s (its process group was killed):\n"
                    f"{stdout[-20000:]}\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a job started by ``run_job``), if anything is left in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
