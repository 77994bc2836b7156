"""Host cost of ``cpu_sync=False`` dispatch + combine pairs through ``ep_comm.Buffer``, without a GPU.

Two pairs, compact and expand each: ``cached`` (dispatch with ``handle=``, then combine) and ``new`` (dispatch
of a new routing with ``topk_idx``, then combine of its handle). The nvshmem backend runs over the fake GPU of
``helpers.fake_gpu`` at an H200's launch shape under ``helpers.eager_counts.LaunchCounter``: no kernel runs, launch
plans are replayed as on the GPU. Prints, per pair, Python function calls, kernel launches, allocations and host
microseconds (best of several repeats). A measurement, never a pass/fail test (the budgets are
``tests/nvshmem_host/test_eager_budget.py``)::

    python tools/host_pairs.py [--pairs 2000] [--repeats 5]

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


def _pairs(expand: bool, backend) -> dict:
    """The two pairs of a Buffer over ``backend``, by name (called under a LaunchCounter)."""
    buffer_module.make_backend = lambda *args: backend
    buf = buffer_module.Buffer(MPI.COMM_SELF, num_experts=GEO.num_experts, hidden=GEO.hidden, num_topk=GEO.num_topk,
                               num_max_tokens_per_rank=GEO.max_tokens, backend="mpi")
    idx = uniform_routing(GEO.max_tokens, GEO.num_experts, GEO.num_topk, seed=1).topk_idx
    x = np.ones((GEO.max_tokens, GEO.hidden), GEO.dtype)
    alignment = 2 if expand else 1
    out = buf.dispatch(x, idx, expand=expand, expert_alignment=alignment, cpu_sync=False)

    def cached() -> None:
        buf.combine(out.recv_x, buf.dispatch(x, handle=out.handle, cpu_sync=False).handle)

    def new() -> None:
        mine = buf.dispatch(x, idx, expand=expand, expert_alignment=alignment, cpu_sync=False)
        buf.combine(mine.recv_x, mine.handle)

    return {"cached": cached, "new": new}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for expand in (False, True):
        backend = simulated_backend(GEO, False, False, launch=grid_shape(132))
        with LaunchCounter(backend) as counter:
            for kind, pair in _pairs(expand, backend).items():
                for _ in range(50):
                    pair()
                counts = counter.count(pair)
                calls = counter.python_calls(pair)
                best = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for _ in range(args.pairs):
                        pair()
                    best = min(best, (time.perf_counter() - start) / args.pairs)
                print(f"{'expand' if expand else 'compact'} {kind}: {calls} Python calls, {counts.launches} launches, "
                      f"{counts.allocations} allocations, {best * 1e6:.1f} us per pair")


if __name__ == "__main__":
    main()
