"""Run ``fault_job.py`` as a child of this process, so that the launcher's signals reach this process only.

``mpiexec -disable-auto-cleanup python shielded.py ARGS...`` runs ``python fault_job.py ARGS...`` as a child
that inherits this process's PMI socket and environment (so it is the MPI rank), and ends the way its child
ended: with its exit status, or killed by the same signal (so the launcher still sees a rank killed by
SIGKILL in the kill case).

Why: under load, MPICH's hydra sometimes ends the job at once when a rank is killed, ``-disable-auto-cleanup``
notwithstanding, by SIGKILL to every rank it started (seen in CI: the survivor gone 1.4 s into the job, no
result file). That kill reaches this shim, not the rank; the rank runs on, gives up at its own deadline and
writes its result file, which ``tests/jobs/test_faults.py`` waits for after the launcher ends. The child stays in
the launcher's process group, so the test's hard outer timeout still kills it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("fault_job.py")


def main() -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice of a killed rank; the child ignores it too
    child = subprocess.Popen([sys.executable, str(JOB), *sys.argv[1:]], close_fds=False)
    status = child.wait()
    if status < 0:  # killed by signal -status: end the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main())
