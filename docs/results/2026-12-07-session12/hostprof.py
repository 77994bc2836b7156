"""Host time of single eager calls (session 12's old-against-new figures), 1 rank on the nvshmem backend.

Decode shape: 128 tokens, hidden 7168 in the Buffer's dtype, top-8 of 256 experts, float32 weights. The six calls run
round-robin (so that a slow spell of the machine falls on all of them), the device synchronized before each, and each
call is timed alone from its start to its return. Writes p50 / p99 / mean microseconds per call to ``--json``::

    mpirun -np 1 python3 hostprof.py --calls 1000 --json hostprof.json   (ep_comm of the tree to time on PYTHONPATH)
"""
import argparse
import json
import statistics
import time

import cupy
import numpy as np
from mpi4py import MPI

import ep_comm
from ep_comm.testing.routing import uniform_routing

WARMUP = 50


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    t, h, e, k = 128, 7168, 256, 8
    buf = ep_comm.Buffer(MPI.COMM_WORLD, num_experts=e, hidden=h, num_topk=k, num_max_tokens_per_rank=t,
                         backend="nvshmem")
    idx = cupy.asarray(uniform_routing(t, e, k, seed=0).topk_idx)
    w = cupy.asarray(np.random.default_rng(0).random((t, k), dtype=np.float32))
    x = cupy.asarray(np.ones((t, h), buf.geometry.dtype))
    out = buf.dispatch(x, idx, topk_weights=w, cpu_sync=False)
    outs = buf.dispatch(x, idx, topk_weights=w, cpu_sync=True)
    ops = {
        "cached": lambda: buf.dispatch(x, handle=out.handle, topk_weights=w, cpu_sync=False),
        "combine": lambda: buf.combine(out.recv_x, out.handle),
        "new": lambda: buf.dispatch(x, idx, topk_weights=w, cpu_sync=False),
        "cached_sync": lambda: buf.dispatch(x, handle=outs.handle, topk_weights=w, cpu_sync=True),
        "new_sync": lambda: buf.dispatch(x, idx, topk_weights=w, cpu_sync=True),
        "combine_sync": lambda: buf.combine(outs.recv_x, outs.handle),
    }
    device = cupy.cuda.Device()
    times = {name: [] for name in ops}
    for i in range(args.calls + WARMUP):
        for name, op in ops.items():
            device.synchronize()
            start = time.perf_counter()
            op()
            took = time.perf_counter() - start
            if i >= WARMUP:
                times[name].append(took * 1e6)
    device.synchronize()
    result = {name: {"p50": statistics.median(v), "p99": float(np.percentile(v, 99)), "mean": statistics.fmean(v)}
              for name, v in times.items()}
    print(json.dumps({name: f"{v['p50']:.1f}/{v['p99']:.1f}" for name, v in result.items()}))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    buf.close()


if __name__ == "__main__":
    main()
