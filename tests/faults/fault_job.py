"""One fault scenario on every rank of an ``mpiexec`` job (started by ``tests/jobs/test_faults.py``).

``python fault_job.py SCENARIO --out DIR --backend mpi|nvshmem --timeout S [--scaleup-ranks N [--forwarding]]``:
every rank makes a Buffer (in virtual nodes of ``N`` ranks, forwarded: ``Buffer(forwarding=True)``), runs
one clean dispatch/combine, then the scenario's faulty rank (the last; rank 0 for ``kill``) misbehaves while the
others go on:

* ``skip``: it skips the second combine and goes to ``close`` ``timeout_s / 2`` after its peers' combine began
  (so it waits in close while they time out);
* ``late``: it sleeps ``timeout_s + 2`` s before its second dispatch;
* ``stop``: it stops itself with SIGSTOP before its second dispatch; a helper process resumes it
  ``timeout_s + 2`` s later;
* ``kill``: it kills itself with SIGKILL before its second dispatch (the launcher must keep the others running;
  rank 0 is the one killed: MPICH's hydra does not keep a surviving rank 0 reliably);
* ``late_close``: after the clean round it reaches ``close`` 8 s late (``--timeout 3``).

Each surviving rank writes ``DIR/rank{r}.json`` (and prints it): its rank and, per call, the outcome (``ok`` or
the exception's class), the message and the seconds the call took. Files, not only stdout: after a kill the
launcher may exit, and stop forwarding output, before the survivors are done.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np
from mpi4py import MPI

import ep_comm
from ep_comm.testing.routing import uniform_routing

SCENARIOS = ("skip", "late", "stop", "kill", "late_close")
LATE_CLOSE_S = 8.0
WARM_TIMEOUT_S = 120.0  # the warm-up Buffer's timeout_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--out", required=True, help="folder for the per-rank result files")
    parser.add_argument("--scaleup-ranks", type=int, default=None, help="ranks per virtual node (default: one node)")
    parser.add_argument("--forwarding", action="store_true", help="send to other nodes through their forwarders")
    args = parser.parse_args()
    # hydra's -disable-auto-cleanup tells the survivors of a killed rank with SIGUSR1, whose default action ends
    # them: the survivors of the kill case must keep running to be checked
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    comm = MPI.COMM_WORLD
    faulty = comm.rank == faulty_rank(args.scenario, comm.size)
    tokens, hidden, experts, topk = 16, 32, 4 * comm.size, 2

    def make_buffer(timeout_s: float) -> ep_comm.Buffer:
        return ep_comm.Buffer(comm, num_experts=experts, hidden=hidden, num_topk=topk,
                              num_max_tokens_per_rank=tokens, dtype="float32", backend=args.backend,
                              timeout_s=timeout_s, scaleup_ranks=args.scaleup_ranks, forwarding=args.forwarding)

    # a first call compiles and loads the kernels of its shapes (seconds on a GPU): done on a Buffer with a
    # generous timeout, so that the short timeout of the scenario measures the fault, not the compiler
    warm = make_buffer(WARM_TIMEOUT_S)
    xp = np
    if warm.backend == "nvshmem":
        import cupy as xp  # the GPU stack is there when the nvshmem backend is
    idx, weights = uniform_routing(tokens, experts, topk, seed=(0, comm.rank))
    x = xp.asarray(np.random.default_rng(comm.rank).standard_normal((tokens, hidden), dtype=np.float32))
    idx, weights = xp.asarray(idx), xp.asarray(weights)
    first = warm.dispatch(x, idx, weights)
    warm.combine(first.recv_x, first.handle)
    warm.close()
    buf = make_buffer(args.timeout)
    calls: List[Dict[str, Any]] = []

    def call(name: str, fn: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            result, outcome, message = fn(), "ok", ""
        except (ep_comm.TimeoutError, ep_comm.BufferUnusableError) as exc:
            result, outcome, message = None, type(exc).__name__, str(exc)
        calls.append(dict(call=name, outcome=outcome, message=message, seconds=time.monotonic() - start))
        return result

    out = call("dispatch", lambda: buf.dispatch(x, idx, weights))
    call("combine", lambda: buf.combine(out.recv_x, out.handle))
    if faulty and args.scenario != "late_close":
        misbehave(args.scenario, args.timeout)
    if args.scenario != "late_close" and not (faulty and args.scenario == "skip"):
        out = call("dispatch", lambda: buf.dispatch(x, idx, weights)) or out
        call("combine", lambda: buf.combine(out.recv_x, out.handle))
    if faulty and args.scenario == "late_close":
        time.sleep(LATE_CLOSE_S)
    call("close", buf.close)
    text = json.dumps(dict(rank=comm.rank, scenario=args.scenario, calls=calls))
    path = os.path.join(args.out, f"rank{comm.rank}.json")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    print(f"FAULT {text}", flush=True)
    return 0


def faulty_rank(scenario: str, num_ranks: int) -> int:
    """The rank that misbehaves: the last one, rank 0 for ``kill``."""
    return 0 if scenario == "kill" else num_ranks - 1


def misbehave(scenario: str, timeout_s: float) -> None:
    """What the faulty rank does instead of its second dispatch (``skip``: a head start for its peers)."""
    if scenario == "skip":
        time.sleep(timeout_s / 2)
    elif scenario == "late":
        time.sleep(timeout_s + 2)
    elif scenario == "stop":
        subprocess.Popen(["sh", "-c", f"sleep {timeout_s + 2}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    elif scenario == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
