"""Host time of one rank's cpu_sync=False calls (cached dispatch, combine, new routing) at DeepSeek-V3 decode, and a
cProfile of each: run from a tree's root with that tree on PYTHONPATH. Args: OUTDIR TAG."""
import cProfile, pstats, sys, time, io
import numpy as np, cupy
from mpi4py import MPI
import ep_comm
from ep_comm.testing.routing import uniform_routing
from ep_comm.contract.choices import payload_dtype
out_dir, tag = sys.argv[1], sys.argv[2]
T, E, H, K = 128, 256, 7168, 8
buf = ep_comm.Buffer(MPI.COMM_WORLD, num_experts=E, hidden=H, num_topk=K, num_max_tokens_per_rank=T,
                     dtype="bfloat16", backend="nvshmem")
r = uniform_routing(T, E, K, seed=0)
x = cupy.asarray(np.ones((T, H), payload_dtype("bfloat16")))
idx, w = cupy.asarray(r.topk_idx), cupy.asarray(r.topk_weights)
out = buf.dispatch(x, idx, w, cpu_sync=False)
synced = buf.dispatch(x, idx, w)  # a cpu_sync=True handle: its replays know every count on the host
ops = {"cached": lambda: buf.dispatch(x, handle=out.handle, cpu_sync=False),
       "combine": lambda: buf.combine(out.recv_x, out.handle),
       "new": lambda: buf.dispatch(x, idx, w, cpu_sync=False),
       "cached_sync": lambda: buf.dispatch(x, handle=synced.handle)}
dev = cupy.cuda.Device()
for name, op in ops.items():
    for _ in range(300):
        op(); dev.synchronize()
    times = []
    for _ in range(1000):
        t0 = time.perf_counter(); op(); times.append(time.perf_counter() - t0); dev.synchronize()
    pr = cProfile.Profile()
    for _ in range(1000):
        pr.enable(); op(); pr.disable(); dev.synchronize()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(30)
    p = np.percentile(np.array(times) * 1e6, [50, 99])
    print(f"{tag} {name}: host p50 {p[0]:.1f} us p99 {p[1]:.1f} us", flush=True)
    with open(f"{out_dir}/prof-{tag}-{name}.txt", "w") as f:
        f.write(f"{tag} {name}: host p50 {p[0]:.1f} us p99 {p[1]:.1f}\n" + s.getvalue())
buf.close()
