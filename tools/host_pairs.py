"""Host cost of ``cpu_sync=False`` dispatch + combine pairs through ``ep_comm.Buffer``, without a GPU.

Two pairs, compact and expand each: ``cached`` (dispatch with ``handle=``, then combine) and ``new`` (dispatch
of a new routing with ``topk_idx``, then combine of its handle). With ``--ops``, instead, each eager call on its own:
``new``, ``cached`` and ``combine`` with ``cpu_sync=False`` and ``True`` (a combine's ``cpu_sync`` is its handle's),
Python calls counted as ``tests/nvshmem_host/test_eager_budget.py`` counts them (after a ``cpu_sync=True`` replay,
which leaves no verdict to check), microseconds over a loop of the call alone. The nvshmem backend runs over the fake GPU of
``helpers.fake_gpu`` at an H200's launch shape under ``helpers.eager_counts.LaunchCounter``: no kernel runs, launch
plans are replayed as on the GPU. Prints, per pair, Python function calls, kernel launches, allocations and host
microseconds of CPU time (best of several repeats). A measurement, never a pass/fail test (the budgets are
``tests/nvshmem_host/test_eager_budget.py``)::

    python tools/host_pairs.py [--pairs 2000] [--repeats 5] [--ops]

The figures are of this machine and of NumPy standing in for CuPy (``numpy.empty`` is far cheaper than
``cupy.empty``, and no driver call is made): compare them before and after a change on the same machine, not with
GPU figures. The ``ep_comm`` and ``tests/helpers`` imported are those of the checkout this script lies in.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's ep_comm and its tests' helpers
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from helpers import cudasim_warp

cudasim_warp.use_without_gpu()  # before anything imports numba.cuda

import numpy as np
from helpers.eager_counts import LaunchCounter
from helpers.fake_gpu import simulated_backend
from mpi4py import MPI

import ep_comm.buffer as buffer_module
from ep_comm.backends.sm_grid import grid_shape
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.testing.routing import uniform_routing

GEO = Geometry(1, 256, 7168, 8, 128, payload_dtype("bfloat16"))  # DeepSeek-V3 decode


def _buffer(backend) -> buffer_module.Buffer:
    """A Buffer of ``GEO`` over ``backend``."""
    buffer_module.make_backend = lambda *args: backend
    return buffer_module.Buffer(MPI.COMM_SELF, num_experts=GEO.num_experts, hidden=GEO.hidden, num_topk=GEO.num_topk,
                                num_max_tokens_per_rank=GEO.max_tokens, backend="mpi")


def _inputs() -> tuple:
    """``(topk_idx [T, K] int64, x [T, H])`` of ``GEO``: a uniform routing and rows of ones."""
    idx = uniform_routing(GEO.max_tokens, GEO.num_experts, GEO.num_topk, seed=1).topk_idx
    return idx, np.ones((GEO.max_tokens, GEO.hidden), GEO.dtype)


def _pairs(expand: bool, backend) -> dict:
    """The two pairs of a Buffer over ``backend``, by name (called under a LaunchCounter)."""
    buf = _buffer(backend)
    idx, x = _inputs()
    alignment = 2 if expand else 1
    out = buf.dispatch(x, idx, expand=expand, expert_alignment=alignment, cpu_sync=False)

    def cached() -> None:
        buf.combine(out.recv_x, buf.dispatch(x, handle=out.handle, cpu_sync=False).handle)

    def new() -> None:
        mine = buf.dispatch(x, idx, expand=expand, expert_alignment=alignment, cpu_sync=False)
        buf.combine(mine.recv_x, mine.handle)

    return {"cached": cached, "new": new}


def _ops(expand: bool, backend) -> dict:
    """Each eager call of a Buffer over ``backend`` on its own, by name (called under a LaunchCounter); a combine
    takes the outputs of the dispatch of a new routing with the same ``cpu_sync``."""
    buf = _buffer(backend)
    idx, x = _inputs()
    ops = {}
    for sync in (False, True):
        out = buf.dispatch(x, idx, expand=expand, expert_alignment=2 if expand else 1, cpu_sync=sync)
        ops[f"new cpu_sync={sync}"] = lambda sync=sync: buf.dispatch(x, idx, expand=expand,
                                                                      expert_alignment=2 if expand else 1,
                                                                      cpu_sync=sync)
        ops[f"cached cpu_sync={sync}"] = lambda out=out, sync=sync: buf.dispatch(x, handle=out.handle, cpu_sync=sync)
        ops[f"combine cpu_sync={sync}"] = lambda out=out: buf.combine(out.recv_x, out.handle)
    return ops


def _best_us(call, calls: int, repeats: int) -> float:
    """Microseconds of this process's CPU time per ``call()`` (``time.process_time``: what other processes on a
    shared machine take is left out), the best over ``repeats`` loops of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="calls per timed loop (pairs, or calls with --ops)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", action="store_true", help="each eager call on its own instead of the pairs")
    args = parser.parse_args()
    for expand in (False, True):
        mode = "expand" if expand else "compact"
        backend = simulated_backend(GEO, False, False, launch=grid_shape(132))
        with LaunchCounter(backend) as counter:
            if args.ops:
                ops = _ops(expand, backend)
                for name, op in ops.items():
                    for _ in range(50):
                        op()
                    ops["cached cpu_sync=True"]()
                    calls = counter.python_calls(op)
                    print(f"{mode} {name}: {calls} Python calls, {_best_us(op, args.pairs, args.repeats):.1f} us per "
                          "call")
                continue
            for kind, pair in _pairs(expand, backend).items():
                for _ in range(50):
                    pair()
                counts = counter.count(pair)
                calls = counter.python_calls(pair)
                print(f"{mode} {kind}: {calls} Python calls, {counts.launches} launches, {counts.allocations} "
                      f"allocations, {_best_us(pair, args.pairs, args.repeats):.1f} us per pair")


if __name__ == "__main__":
    main()
