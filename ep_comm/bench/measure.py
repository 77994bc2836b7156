"""One rank's part of a benchmark point: inputs, the round-trip check, counts and timings.

The round trip is ``combine(dispatch(x).recv_x)`` without weights; its expected result
(``ep_comm.testing.expected_round_trip``, the reference arithmetic of ``ep_comm.reduce``) is compared
bit for bit, and the rows received per source rank against what the sources counted.
"""
from __future__ import annotations

import cProfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.dtypes import payload_dtype
from ep_comm.host import to_host
from ep_comm.testing import Routing, check_counts, expected_round_trip, first_mismatch, make_routing, random_payload

Timer = Callable[[Callable[[], Any]], Tuple[Any, float]]


@dataclass
class PointSpec:
    """What one benchmark point runs (the same on every rank)."""

    num_experts: int
    hidden: int
    num_topk: int
    num_tokens: int
    dtype: str
    routing: str
    seed: int
    zipf_s: float
    hot_expert: int
    expand: bool
    expert_alignment: int
    warmup: int
    iters: int


@dataclass
class RankSample:
    """What one rank measured for one point; gathered to rank 0 by ``report``."""

    rank: int
    num_tokens: int
    rows_sent: int  # (token, destination rank) rows this rank sent, itself included
    recv_rows: int  # compact rows received
    recv_from_self: int
    expanded_rows: int  # rows of the expand layout (padding included); 0 in compact mode
    failures: List[str] = field(default_factory=list)
    times: Dict[str, List[float]] = field(default_factory=dict)  # seconds per iteration, by operation
    first_round_trip_s: float = 0.0  # host wall clock of the point's first dispatch + combine (kernel loads included)
    host_times: Dict[str, List[float]] = field(default_factory=dict)  # host seconds per call, no wait, by operation
    graph_times: Dict[str, List[float]] = field(default_factory=dict)  # GPU seconds per CUDA graph replay, by operation


def host_timer(fn: Callable[[], Any]) -> Tuple[Any, float]:
    """Run ``fn`` and return ``(result, host wall-clock seconds)``."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def cuda_timer(fn: Callable[[], Any]) -> Tuple[Any, float]:
    """Run ``fn`` between two CUDA events on the current stream; ``(result, GPU seconds)``."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return result, cupy.cuda.get_elapsed_time(start, end) / 1e3


def make_inputs(spec: PointSpec, rank: int) -> Tuple[np.ndarray, Routing]:
    """This rank's tokens ``x [T, H]`` (payload dtype) and routing; seeded by ``(seed, rank)``."""
    routing = make_routing(spec.routing, spec.num_tokens, spec.num_experts, spec.num_topk,
                           seed=(spec.seed, rank), zipf_s=spec.zipf_s, hot_expert=spec.hot_expert)
    x = random_payload(np.random.default_rng((spec.seed, rank, 1)), (spec.num_tokens, spec.hidden),
                       payload_dtype(spec.dtype))
    return x, routing


def sample_times(comm: MPI.Comm, body: Callable[[], Sequence[float]], warmup: int, iters: int,
                 tick: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Run ``body`` ``warmup + iters`` times, each after a barrier; ``[iters, m]`` seconds it returned."""
    rows = []
    for i in range(warmup + iters):
        comm.Barrier()
        seconds = body()
        if i >= warmup:
            rows.append(seconds)
        if tick is not None:
            tick(i + 1)
    return np.asarray(rows, dtype=np.float64)


def run_point(comm: MPI.Comm, buf: Any, spec: PointSpec, timer: Timer, device: Callable[[np.ndarray], Any],
              tick: Optional[Callable[[int], None]] = None, graphs: bool = False,
              profiler: Optional[cProfile.Profile] = None) -> Tuple[RankSample, Tuple[np.ndarray, Routing]]:
    """Dispatch + combine ``spec.warmup + spec.iters`` times on ``buf``; check the first and last round trip.

    ``device`` moves a host array to where the backend wants it (identity on CPU). With ``graphs``
    (GPU), the cached ``cpu_sync=False`` path is also captured into CUDA graphs and replayed
    (:func:`graph_replay_times`). ``profiler`` records the host calls of :func:`host_call_times`.
    Returns this rank's sample and its host inputs (the baselines reuse them).
    """
    x, routing = make_inputs(spec, comm.rank)
    dx, didx, dw = device(x), device(routing.topk_idx), device(routing.topk_weights)
    want = expected_round_trip(x, routing.topk_idx, spec.num_experts, comm.size, spec.expand)
    last: Dict[str, Any] = {}

    def body() -> Tuple[float, float]:
        out, t_dispatch = timer(lambda: buf.dispatch(dx, didx, dw, expand=spec.expand,
                                                     expert_alignment=spec.expert_alignment))
        res, t_combine = timer(lambda: buf.combine(out.recv_x, out.handle))
        last.update(out=out, res=res)
        return t_dispatch, t_combine

    # check the round trip on fresh buffers and again after every reuse (both parities, many sequence numbers)
    start = time.perf_counter()
    body()
    first_s = time.perf_counter() - start
    failures = _round_trip_failures(last["res"].x, want, "first")
    times = sample_times(comm, body, spec.warmup, spec.iters, tick)
    failures += _round_trip_failures(last["res"].x, want, "last")
    out = last["out"]
    host = host_call_times(comm, buf, dx, out.handle, timer, spec, profiler)
    failures += _round_trip_failures(host.pop("result"), want, "cached, cpu_sync=False")
    sent = to_host(buf.get_dispatch_layout(didx).num_tokens_per_rank)
    recv_per_source = np.diff(to_host(out.handle.psum_num_recv_tokens_per_rank), prepend=0)
    failures += check_counts(comm, sent, recv_per_source, out, spec.expand)
    graph: Dict[str, Any] = {}
    if graphs:
        graph = graph_replay_times(comm, buf, dx, didx, out.handle, spec)
        for got, which in zip(graph.pop("results"), ("cached", "new routing")):
            failures += _round_trip_failures(got, want, f"CUDA graph replay, {which}")
        host.update(graph.pop("host"))
    sample = RankSample(
        rank=comm.rank, num_tokens=spec.num_tokens, rows_sent=int(sent.sum()), recv_rows=int(recv_per_source.sum()),
        recv_from_self=int(recv_per_source[comm.rank]),
        expanded_rows=int(out.handle.num_expanded_tokens) if spec.expand else 0, failures=failures,
        times={"dispatch": times[:, 0].tolist(), "combine": times[:, 1].tolist()}, first_round_trip_s=first_s,
        host_times=host, graph_times=graph,
    )
    return sample, (x, routing)


def host_call_times(comm: MPI.Comm, buf: Any, dx: Any, handle: Any, timer: Timer, spec: PointSpec,
                    profiler: Optional[cProfile.Profile] = None) -> Dict[str, Any]:
    """Host seconds per call of the path that never waits on the host: the cached dispatch with
    ``cpu_sync=False``, then its combine, ``spec.warmup + spec.iters`` times. Each round runs inside
    ``timer``, which waits for the device afterwards, so rounds do not pile up; ``profiler`` (cProfile)
    records the two calls of each round, not the wait. Returns
    ``{"dispatch_cached_async": [...], "combine": [...], "result": last combine's x}``."""
    last: Dict[str, Any] = {}

    def calls() -> Tuple[float, float]:
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        out = buf.dispatch(dx, handle=handle, cpu_sync=False)
        t1 = time.perf_counter()
        last["x"] = buf.combine(out.recv_x, out.handle).x
        t2 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        return t1 - t0, t2 - t1

    rows = sample_times(comm, lambda: timer(calls)[0], spec.warmup, spec.iters)
    return {"dispatch_cached_async": rows[:, 0].tolist(), "combine": rows[:, 1].tolist(), "result": last["x"]}


def graph_replay_times(comm: MPI.Comm, buf: Any, dx: Any, didx: Any, handle: Any, spec: PointSpec) -> Dict[str, Any]:
    """GPU seconds per CUDA graph replay of the path that never waits on the host, captured on a side
    stream one call per graph (each graph is one collective step: the buffer parity comes from the
    device): the cached dispatch with ``cpu_sync=False`` and its combine, then a dispatch of the
    routing ``didx`` as new (count, count exchange and all, in the point's mode) and its combine. All four are replayed
    ``spec.warmup + spec.iters`` times, each round after a barrier, between CUDA events. Returns
    ``{"dispatch": [...], "combine": [...], "dispatch_new": [...], "combine_new": [...], "host":
    {"graph_launch_dispatch": [...], "graph_launch_combine": [...]}`` (host seconds per replay
    launch, cached pair), ``"results": (last cached combine's x, last new combine's x)}``."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)

    def dispatch_new() -> Any:  # the point's mode: an expand point replays an expand dispatch
        return buf.dispatch(dx, didx, cpu_sync=False, expand=spec.expand, expert_alignment=spec.expert_alignment)

    with stream:
        warm = dispatch_new()  # every launch bound before the captures
        buf.combine(warm.recv_x, warm.handle)
        warm = buf.dispatch(dx, handle=handle, cpu_sync=False)
        buf.combine(warm.recv_x, warm.handle)
        stream.synchronize()
        cached, cached_dispatch = captured(stream, lambda: buf.dispatch(dx, handle=handle, cpu_sync=False))
        cached_sum, cached_combine = captured(stream, lambda: buf.combine(cached.recv_x, cached.handle))
        new, new_dispatch = captured(stream, dispatch_new)
        new_sum, new_combine = captured(stream, lambda: buf.combine(new.recv_x, new.handle))
    graphs = (cached_dispatch, cached_combine, new_dispatch, new_combine)
    marks = [cupy.cuda.Event() for _ in range(len(graphs) + 1)]

    def replay() -> List[float]:
        host = []
        marks[0].record(stream)
        for graph, mark in zip(graphs, marks[1:]):
            start = time.perf_counter()
            graph.launch(stream)
            host.append(time.perf_counter() - start)
            mark.record(stream)
        marks[-1].synchronize()
        return [cupy.cuda.get_elapsed_time(a, b) / 1e3 for a, b in zip(marks, marks[1:])] + host[:2]

    rows = sample_times(comm, replay, spec.warmup, spec.iters)
    return {"dispatch": rows[:, 0].tolist(), "combine": rows[:, 1].tolist(), "dispatch_new": rows[:, 2].tolist(),
            "combine_new": rows[:, 3].tolist(),
            "host": {"graph_launch_dispatch": rows[:, 4].tolist(), "graph_launch_combine": rows[:, 5].tolist()},
            "results": (cached_sum.x, new_sum.x)}


def captured(stream: Any, call: Callable[[], Any]) -> Tuple[Any, Any]:
    """``(result, graph)``: ``call`` captured into a CUDA graph on ``stream``; the capture is ended even
    when ``call`` raises."""
    stream.begin_capture()
    try:
        result = call()
    finally:
        graph = stream.end_capture()
    return result, graph


def _round_trip_failures(got: Any, want: np.ndarray, which: str) -> List[str]:
    problem = first_mismatch(to_host(got), want)
    return [] if problem is None else [f"round trip ({which} iteration) differs: {problem}"]
