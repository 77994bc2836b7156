"""Host time of single eager calls per rank, in two orders: each call alone on an idle device, and the bench's
decode round. A developer's measurement, never a test (the budgets are counts: ``tests/nvshmem_host/test_eager_budget.py``)::

    launch/mpirun_gpu.sh 1 tools.host_calls --json OUT.json [--calls 1000] [--tokens 128]
    launch/with_mps.sh --ranks-per-gpu 2 -- launch/mpirun_gpu.sh 2 tools.host_calls --json OUT.json  # OUT.rank{r}.json
    PYTHONPATH=OTHER_TREE:$PYTHONPATH mpirun -np 1 python3 tools/host_calls.py --json OUT.json   # another tree's ep_comm

It uses the public ``Buffer`` API only, so one copy times any tree: run it once per tree, the trees alternating in
one GPU call, and compare within that call (``docs/performance.md``, session 12: the two orders ranked the trees
differently, and the cause was left for a run of this tool).

Orders (hidden 7168 in the Buffer's dtype, top-8 of 256 experts, ``--tokens`` tokens, float32 weights):

- ``alone``: the device synchronized before each call; the calls round-robin, so that a slow spell of the machine
  falls on all of them. ``cached_weights`` and ``cached`` replay one ``cpu_sync=False`` handle with and without
  ``topk_weights``; ``combine`` combines that handle's first output (the same handle each time), ``combine_fresh`` the
  output of a cached dispatch made just before (a new handle each time, the device synchronized between them);
  ``new`` and ``new_sync`` dispatch the routing as new with ``cpu_sync`` False and True; ``cached_sync`` replays a
  ``cpu_sync=True`` handle, and ``combine_sync`` combines its first output.
- ``round``: what ``ep_comm.bench`` times per round: after a device synchronize, a cached dispatch without weights
  (``cached``), the combine of its output (``combine``: a new handle, the dispatch still running on the device),
  then the routing as new (``new``, ``cpu_sync=False``).

Writes ``{order: {call: {"p50", "p99", "mean"}}}`` (us) to ``--json`` and prints the p50/p99 table; with several
ranks (every call is collective: the ranks make them together) each rank writes ``OUT.rank{r}.json`` and prints its
table under its rank.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import numpy as np

WARMUP = 50  # rounds before the timed ones (kernel loads, recorded calls, the memory pool's first blocks)
Times = Dict[str, List[float]]  # per call name, host seconds per timed call


def alone_order(buf: Any, x: Any, idx: Any, weights: Any, sync: Callable[[], None]) -> Dict[str, Callable[[], Any]]:
    """The calls of the ``alone`` order, by name, on ``buf`` (its first dispatches made here).

    Args:
        buf: an ``ep_comm.Buffer`` whose geometry takes ``x``.
        x: ``[T, hidden]`` payload in the Buffer's dtype, on the Buffer's device.
        idx: ``[T, top-k]`` int64 expert ids.
        weights: ``[T, top-k]`` float32.
        sync: waits for the device (``cupy.cuda.Device().synchronize``).
    """
    out = buf.dispatch(x, idx, topk_weights=weights, cpu_sync=False)
    out_sync = buf.dispatch(x, idx, topk_weights=weights, cpu_sync=True)

    def combine_fresh() -> Any:
        made = buf.dispatch(x, handle=out.handle, cpu_sync=False)
        sync()
        start = time.perf_counter()
        buf.combine(made.recv_x, made.handle)
        return time.perf_counter() - start

    return {
        "cached_weights": lambda: buf.dispatch(x, handle=out.handle, topk_weights=weights, cpu_sync=False),
        "cached": lambda: buf.dispatch(x, handle=out.handle, cpu_sync=False),
        "combine": lambda: buf.combine(out.recv_x, out.handle),
        "combine_fresh": combine_fresh,
        "new": lambda: buf.dispatch(x, idx, topk_weights=weights, cpu_sync=False),
        "cached_sync": lambda: buf.dispatch(x, handle=out_sync.handle, topk_weights=weights, cpu_sync=True),
        "new_sync": lambda: buf.dispatch(x, idx, topk_weights=weights, cpu_sync=True),
        "combine_sync": lambda: buf.combine(out_sync.recv_x, out_sync.handle),
    }


def time_alone(calls: Mapping[str, Callable[[], Any]], rounds: int, sync: Callable[[], None]) -> Times:
    """``rounds`` timed rounds (after :data:`WARMUP` untimed ones) of every call of ``calls`` in turn, the device
    synchronized before each. A call that returns a float has timed itself (``combine_fresh``): that is its time."""
    times: Times = {name: [] for name in calls}
    for i in range(WARMUP + rounds):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            took = call()
            took = took if isinstance(took, float) else time.perf_counter() - start
            if i >= WARMUP:
                times[name].append(took)
    sync()
    return times


def time_round(buf: Any, x: Any, idx: Any, weights: Any, rounds: int, sync: Callable[[], None]) -> Times:
    """``rounds`` timed rounds (after :data:`WARMUP` untimed ones) of the bench's decode round (the ``round`` order),
    arguments as :func:`alone_order`'s."""
    handle = buf.dispatch(x, idx, topk_weights=weights, cpu_sync=False).handle
    times: Times = {"cached": [], "combine": [], "new": []}
    for i in range(WARMUP + rounds):
        sync()
        t0 = time.perf_counter()
        out = buf.dispatch(x, handle=handle, cpu_sync=False)
        t1 = time.perf_counter()
        buf.combine(out.recv_x, out.handle)
        t2 = time.perf_counter()
        buf.dispatch(x, idx, topk_weights=weights, cpu_sync=False)
        t3 = time.perf_counter()
        if i >= WARMUP:
            for name, took in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(took)
    sync()
    return times


def summary(times: Times) -> Dict[str, Dict[str, float]]:
    """Per call, ``p50``, ``p99`` and ``mean`` of its times in microseconds."""
    result = {}
    for name, seconds in times.items():
        us = np.asarray(seconds) * 1e6
        result[name] = {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
                        "mean": float(us.mean())}
    return result


def table(results: Mapping[str, Mapping[str, Mapping[str, float]]]) -> List[str]:
    """The printed lines: per order and call, p50/p99 us."""
    lines = []
    for order, calls in results.items():
        lines.append(f"{order}: " + ", ".join(f"{name} {v['p50']:.1f}/{v['p99']:.1f}" for name, v in calls.items()))
    return lines


def rank_output(path: str, lines: List[str], rank: int, size: int) -> Tuple[str, List[str]]:
    """``(JSON path, printed lines)`` of rank ``rank`` of ``size``: ``path`` and ``lines`` as they are on one rank;
    with several, ``OUT.rank{r}.json`` and each line led by ``rank {r}``."""
    if size == 1:
        return path, lines
    return str(Path(path).with_suffix(f".rank{rank}.json")), [f"rank {rank} {line}" for line in lines]


def main(argv: Sequence[str] = ()) -> None:
    import cupy
    from mpi4py import MPI

    import ep_comm
    from ep_comm.testing.routing import uniform_routing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where the p50/p99/mean per order and call go")
    parser.add_argument("--calls", type=int, default=1000, help="timed rounds per order")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(list(argv) or None)
    t, h, e, k = args.tokens, 7168, 256, 8
    buf = ep_comm.Buffer(MPI.COMM_WORLD, num_experts=e, hidden=h, num_topk=k, num_max_tokens_per_rank=t,
                         backend="nvshmem")
    idx = cupy.asarray(uniform_routing(t, e, k, seed=0).topk_idx)
    weights = cupy.asarray(np.random.default_rng(0).random((t, k), dtype=np.float32))
    x = cupy.asarray(np.ones((t, h), buf.geometry.dtype))
    sync = cupy.cuda.Device().synchronize
    results = {"alone": summary(time_alone(alone_order(buf, x, idx, weights, sync), args.calls, sync)),
               "round": summary(time_round(buf, x, idx, weights, args.calls, sync))}
    comm = MPI.COMM_WORLD
    path, lines = rank_output(args.json, table(results), comm.rank, comm.size)
    print("\n".join(lines))
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    buf.close()


if __name__ == "__main__":
    main()
