"""Host cost of ``cpu_sync=False`` dispatch + combine pairs through ``ep_comm.Buffer``, without a GPU.

Two pairs, compact and expand each: ``cached`` (dispatch with ``handle=``, then combine) and ``new`` (dispatch
of a new routing with ``topk_idx``, then combine of its handle). The nvshmem backend runs over the fake GPU of
``tests/test_nvshmem_host.py`` (a loopback transport, NumPy arrays): one real dispatch in the Numba CUDA
simulator makes the handle, then every kernel launch is stubbed out (``BoundLaunch.__call__`` does nothing but
report a clean routing check) and the pairs are timed and counted. Prints, per pair, Python function calls
(cProfile), allocator calls through the array module (``numpy.empty``, ``zeros``, ... counted by a wrapper;
array methods such as ``.copy()`` are not counted) and host microseconds (best of several repeats). A
measurement, never a pass/fail test::

    cd /work/wt-h2 && PYTHONPATH=. python tests/helpers/host_pairs.py [--pairs 2000]

The figures are of this machine and of NumPy standing in for CuPy (``numpy.empty`` is far cheaper than
``cupy.empty``): compare them before and after a change on the same machine, not with GPU figures.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from helpers import cudasim_warp  # noqa: E402

cudasim_warp.use_without_gpu()

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ep_comm.buffer as buffer_module  # noqa: E402
from ep_comm.kernels.check import routing_check_kernel  # noqa: E402
from ep_comm.launching import bound  # noqa: E402
from ep_comm.testing.routing import uniform_routing  # noqa: E402
from helpers.fake_gpu import simulated_backend  # noqa: E402


ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "array", "asarray",
              "ascontiguousarray", "concatenate", "cumsum", "arange")  # the array-module calls that allocate


def _buffer(expand: bool) -> tuple:
    """A Buffer over the simulated nvshmem backend, and ``(x, topk_idx, handle, recv_x)`` of a dispatch."""
    def make_backend(name, comm, geo, settings):
        return simulated_backend(geo, settings.deterministic, False)

    buffer_module.make_backend = make_backend
    buf = buffer_module.Buffer(MPI.COMM_SELF, num_experts=8, hidden=64, num_topk=4, num_max_tokens_per_rank=16,
                               dtype="bfloat16", backend="mpi", deterministic=True)
    idx = uniform_routing(16, 8, 4, seed=1).topk_idx
    x = np.ones((16, 64), buf.geometry.dtype)
    out = buf.dispatch(x, idx, expand=expand, expert_alignment=2 if expand else 1, cpu_sync=False)
    return buf, x, idx, out.handle, out.recv_x


def _stubbed_launch(self: bound.BoundLaunch, grid: int, block: int, stream: object, shared: int, *args: object) -> None:
    """No kernel runs; the routing check reports a clean routing (its output, ``args[3]``, is read back)."""
    if self.dispatcher is routing_check_kernel:
        args[3][:] = -1


def _allocations(pair, calls: int) -> float:
    """Calls of the ``ALLOCATORS`` of NumPy (the fake GPU's array module) per ``pair()``."""
    count = [0]
    saved = {name: getattr(np, name) for name in ALLOCATORS}

    def counting(allocate):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return allocate(*args, **kwargs)
        return wrapper

    for name, allocate in saved.items():
        setattr(np, name, counting(allocate))
    try:
        for _ in range(calls):
            pair()
    finally:
        for name, allocate in saved.items():
            setattr(np, name, allocate)
    return count[0] / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    launch = bound.BoundLaunch.__call__
    for expand in (False, True):
        bound.BoundLaunch.__call__ = launch
        buf, x, idx, handle, recv_x = _buffer(expand)
        bound.BoundLaunch.__call__ = _stubbed_launch  # every kernel launch from here on: stubbed
        alignment = 2 if expand else 1

        def cached() -> None:
            out = buf.dispatch(x, handle=handle, cpu_sync=False)
            buf.combine(recv_x, out.handle)

        def new() -> None:
            out = buf.dispatch(x, idx, expand=expand, expert_alignment=alignment, cpu_sync=False)
            buf.combine(out.recv_x, out.handle)

        for kind, pair in (("cached", cached), ("new", new)):
            for _ in range(50):
                pair()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(200):
                pair()
            profiler.disable()
            calls = pstats.Stats(profiler).total_calls / 200
            allocations = _allocations(pair, 200)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.pairs):
                    pair()
                best = min(best, (time.perf_counter() - start) / args.pairs)
            print(f"{'expand' if expand else 'compact'} {kind}: {calls:.0f} Python calls, {allocations:.0f} "
                  f"allocator calls, {best * 1e6:.1f} us per pair")


if __name__ == "__main__":
    main()
