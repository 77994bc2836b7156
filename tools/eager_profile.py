"""Where an eager call's host time goes, on one GPU rank: cProfile of cpu_sync=False cached dispatch + combine
pairs and of new-routing dispatches, the recorded calls made and refused, and host microseconds per call.
A developer's measurement, never a test::

    launch/mpirun_gpu.sh 1 tools.eager_profile [--tokens 128] [--calls 300] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any, Tuple

import cupy
import numpy as np
from mpi4py import MPI

import ep_comm
from ep_comm.testing.routing import uniform_routing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    t, h, e, k = args.tokens, 7168, 256, 8
    buf = ep_comm.Buffer(MPI.COMM_WORLD, num_experts=e, hidden=h, num_topk=k, num_max_tokens_per_rank=t,
                         backend="nvshmem")
    idx = cupy.asarray(uniform_routing(t, e, k, seed=0).topk_idx)
    x = cupy.asarray(np.ones((t, h), buf.geometry.dtype))
    out = buf.dispatch(x, idx, cpu_sync=False)
    calls = {
        "cached async pair": lambda: buf.combine(buf.dispatch(x, handle=out.handle, cpu_sync=False).recv_x, out.handle),
        "new async": lambda: buf.dispatch(x, idx, cpu_sync=False),
        "new sync": lambda: buf.dispatch(x, idx, cpu_sync=True),
        "combine async": lambda: buf.combine(out.recv_x, out.handle),
    }
    for name, call in calls.items():
        for _ in range(20):
            call()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - start) / args.calls * 1e6
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        cupy.cuda.Device().synchronize()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        print(f"== {name}: {host:.1f} us host per call (loop incl. GPU backpressure), "
              f"{stats.total_calls / args.calls:.0f} Python calls per call")
        stats.sort_stats("tottime").print_stats(args.top)
        print("\n".join(text.getvalue().splitlines()[:args.top + 12]))
    counts = buf._backend.runner.recorded.launch_counts()
    print("recorded calls (launches; None: not recordable):", {_key_name(key): n for key, n in counts.items()})
    buf.close()


def _key_name(key: Tuple[Any, ...]) -> str:
    """A recorded call's key as text: since issue 51 a key starts with the recorded function
    (``recorded_calls.call_key``), named by it, then its argument words; an older tree's key (this script also runs
    on other trees) as it is."""
    head = getattr(key[0], "__qualname__", None)
    return str(key)[:90] if head is None else f"{head}{str(key[1:])[:70]}"


if __name__ == "__main__":
    main()
