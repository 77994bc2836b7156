"""One rank's benchmark point on a Buffer: the checked round trips and every timing of it (``measure``,
``calls``, ``busy``), and the priming round trip that runs first on each Buffer."""
from __future__ import annotations

import cProfile
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.bench import busy
from ep_comm.bench.calls import AsyncPair, cached_times, host_call_times
from ep_comm.bench.measure import (
    Payload,
    PointSpec,
    RankSample,
    Timer,
    fp8_failures,
    graph_replay_times,
    host_rows,
    make_inputs,
    new_dispatch,
    round_trip_failures,
    sample_times,
    with_rows,
)
from ep_comm.bench.waits import LateBuffer
from ep_comm.contract.arrays import to_host
from ep_comm.testing import Routing, check_counts, expected_round_trip
from ep_comm.testing.forwarded import Forwarded
from ep_comm.transport.wait_stats import merge


def prime_tokens(tokens: Sequence[int]) -> int:
    """The token count of a Buffer's priming round trip: the largest count below the largest of ``tokens`` that is
    none of them (every rank still receives rows, and the Buffer is not grown), else one above the largest."""
    top = max(tokens)
    return next((t for t in range(top - 1, 0, -1) if t not in tokens), top + 1)


def prime(buf: Any, spec: PointSpec, timer: Timer, device: Callable[[np.ndarray], Any], rank: int) -> float:
    """Host seconds of one untimed round trip of ``spec`` (:func:`prime_tokens` tokens) on ``buf``, its first:
    it compiles and loads the kernels, so each point's first call (``first_call_s``) is a new token count on a
    warm Buffer. Collective."""
    x, routing = make_inputs(spec, rank)
    payload = Payload.of(x, device, spec.fp8)
    start = time.perf_counter()
    timer(lambda: _round_trip(buf, payload, device(routing.topk_idx), device(routing.topk_weights), spec))
    return time.perf_counter() - start


def _round_trip(buf: Any, payload: Payload, didx: Any, weights: Any, spec: PointSpec) -> Tuple[Any, Any, Any]:
    """An eager dispatch of the routing ``didx`` as new and the combine of its rows: ``(dispatch output, combine
    input, combine output)``."""
    out = new_dispatch(buf, payload, didx, spec, weights)
    y = payload.combine_input(buf, out)  # out.recv_x itself without FP8
    return out, y, buf.combine(y, out.handle)


def run_point(comm: MPI.Comm, buf: Any, spec: PointSpec, timer: Timer, device: Callable[[np.ndarray], Any],
              tick: Optional[Callable[[int], None]] = None, graphs: bool = False, busy_check: bool = False,
              profiler: Optional[cProfile.Profile] = None,
              pause: Optional[Callable[[], None]] = None) -> Tuple[RankSample, Tuple[np.ndarray, Routing]]:
    """Dispatch + combine ``spec.warmup + spec.iters`` times on ``buf``; check the first and last round trip.

    ``device`` moves a host array to where the backend wants it (identity on CPU). Then the eager cached
    dispatch (:func:`cached_times`) and the host time per ``cpu_sync=False`` call (:func:`host_call_times`,
    recorded by ``profiler``). With ``graphs`` (GPU), the ``cpu_sync=False`` path is also captured into CUDA graphs
    and replayed (:func:`graph_replay_times`); with ``busy_check`` the busy-stream check runs (``busy``; on the
    ``mpi`` backend it is reported skipped). With ``spec.fp8`` the dispatches send the FP8 pair (:class:`Payload`)
    and the sender cast is timed too. Returns this rank's sample and the host rows its dispatches send with the
    routing (the baselines exchange them: ``x [T, H]``, or with ``spec.fp8`` its packed FP8 rows).

    ``pause`` (``--straggler``'s rank, else None): called before each of this rank's calls and graph launches
    (``ep_comm.bench.waits``). The sample's ``waits``: this rank's ``Buffer.wait_stats()`` tables of the point, the
    eager calls and the graph replays apart.
    """
    buf.reset_wait_stats()
    if pause is not None:
        buf = LateBuffer(buf, pause)
    x, routing = make_inputs(spec, comm.rank)
    payload = Payload.of(x, device, spec.fp8)
    didx, dw = device(routing.topk_idx), device(routing.topk_weights)
    nodes = None if spec.forwarded_nodes is None else Forwarded(comm.rank, spec.forwarded_nodes)
    want = expected_round_trip(x, routing.topk_idx, spec.num_experts, comm.size, spec.expand, forwarded=nodes)
    last: Dict[str, Any] = {}

    def body() -> Tuple[float, float]:
        out, t_dispatch = timer(lambda: new_dispatch(buf, payload, didx, spec, dw))
        y = payload.combine_input(buf, out)  # untimed; out.recv_x itself without FP8
        res, t_combine = timer(lambda: buf.combine(y, out.handle))
        last.update(out=out, y=y, res=res)
        return t_dispatch, t_combine

    def checked(which: str) -> List[str]:
        found = round_trip_failures(last["res"].x, want, which)
        return found + (fp8_failures(last["out"], last["y"], f"{which} iteration") if spec.fp8 else [])

    # check the round trip on fresh buffers and again after every reuse (both parities, many sequence numbers)
    start = time.perf_counter()
    body()
    first_s = time.perf_counter() - start
    failures = checked("first")
    times = sample_times(comm, body, spec.warmup, spec.iters, tick)
    failures += checked("last")
    out = last["out"]
    op_times = {"dispatch": times[:, 0].tolist(), "combine": times[:, 1].tolist()}
    cached = cached_times(comm, buf, payload, out.handle, timer, spec)
    failures += cached.pop("failures")
    op_times.update(cached)
    host = host_call_times(comm, buf, payload, didx, out.handle, timer, spec, profiler)
    failures += round_trip_failures(host.pop("result"), want, "cached, cpu_sync=False")
    sent = to_host(buf.get_dispatch_layout(didx).num_tokens_per_rank)
    recv_per_source = np.diff(to_host(out.handle.psum_num_recv_tokens_per_rank), prepend=0)
    failures += check_counts(comm, sent, recv_per_source, with_rows(out), spec.expand)
    eager_waits = buf.wait_stats(reset=True).table
    buf.wait_stats()  # GPU: the reset is stream-ordered; this read waits for it before the graphs' side stream runs
    graph, found = _graph_replays(comm, buf, payload, didx, out.handle, spec, want, pause) if graphs else ({}, [])
    failures += found
    graph_waits = buf.wait_stats(reset=True).table
    host.update(graph.pop("host", {}))
    busy_figures, found = _busy_figures(comm, buf, payload, out.handle, spec, want) if busy_check else ({}, [])
    failures += found
    waits = {"eager": merge([eager_waits, buf.wait_stats().table])}  # the busy check's calls are eager too
    if graphs:
        waits["graphs"] = graph_waits
    sample = RankSample(
        rank=comm.rank, num_tokens=spec.num_tokens, rows_sent=int(sent.sum()), recv_rows=int(recv_per_source.sum()),
        recv_from_self=int(recv_per_source[comm.rank]),
        expanded_rows=int(out.handle.num_expanded_tokens) if spec.expand else 0, failures=failures,
        times=op_times, first_call_s=first_s, host_times=host, graph_times=graph, busy=busy_figures,
        waits=waits if buf.wait_stats().enabled else {},
    )
    return sample, (host_rows(x, spec.fp8), routing)


def _graph_replays(comm: MPI.Comm, buf: Any, payload: Payload, didx: Any, handle: Any, spec: PointSpec,
                   want: np.ndarray, pause: Optional[Callable[[], None]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """:func:`graph_replay_times` and the failures of its replayed round trips (and FP8 rows) against ``want``."""
    graph = graph_replay_times(comm, buf, payload, didx, handle, spec, pause)
    failures = []
    for got, which in zip(graph.pop("results"), ("cached", "new routing")):
        failures += round_trip_failures(got, want, f"CUDA graph replay, {which}")
    for (dispatched, y), which in zip(graph.pop("fp8_rows"), ("cached", "new routing")):
        failures += fp8_failures(dispatched, y, f"CUDA graph replay, {which}")
    return graph, failures


def _busy_figures(comm: MPI.Comm, buf: Any, payload: Payload, handle: Any, spec: PointSpec,
                  want: np.ndarray) -> Tuple[Dict[str, Any], List[str]]:
    """The busy-stream check's figures (:func:`busy.busy_times`) and the failure of its last round trip, or on the
    ``mpi`` backend ``{"skipped": reason}``."""
    if buf.backend != "nvshmem":
        return {"skipped": busy.SKIPPED_ON_MPI}, []
    figures = busy.busy_times(comm, AsyncPair(buf, payload, handle), spec)
    return figures, round_trip_failures(figures.pop("result"), want, "busy stream, cached, cpu_sync=False")


def primed_spec(specs: Sequence[PointSpec]) -> PointSpec:
    """The spec of a Buffer's priming round trip: the first point's, at :func:`prime_tokens` of all points."""
    return dataclasses.replace(specs[0], num_tokens=prime_tokens([s.num_tokens for s in specs]))


def buffer_tokens(specs: Sequence[PointSpec]) -> int:
    """``num_max_tokens_per_rank`` of the Buffer that runs ``specs`` and their priming round trip."""
    return max(s.num_tokens for s in [*specs, primed_spec(specs)])
