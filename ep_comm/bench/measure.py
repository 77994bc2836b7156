"""The pieces of one rank's benchmark point: inputs, payloads, timers, the round-trip check and the CUDA-graph
replays (:mod:`ep_comm.bench.point` runs the point with them).

The round trip is ``combine(dispatch(x).recv_x)`` without weights; its expected result
(``ep_comm.testing.expected_round_trip``, the reference arithmetic of ``ep_comm.contract.reduce``) is compared
bit for bit, and the rows received per source rank against what the sources counted.

With ``--fp8`` (``PointSpec.fp8``) the timed dispatches send ``x`` as the FP8 pair ``ep_comm.contract.fp8.quantize(x)``,
made once per point on the host (:class:`Payload`). The combine still takes rows in the payload dtype: its input
is the ``recv_x`` of an untimed cached plain dispatch of ``x`` replaying the FP8 dispatch's handle (the same
layout), so the round trip is checked as without ``--fp8``, and the received FP8 rows are checked byte for byte
against ``ep_comm.contract.fp8.quantize`` of those rows.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.contract import fp8 as fp8_format
from ep_comm.contract.arrays import to_host
from ep_comm.contract.choices import payload_dtype
from ep_comm.testing import Routing, first_mismatch, make_routing, random_payload, token_rows

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
    fp8: bool = False  # the timed dispatches send the FP8 pair of x (--fp8)
    forwarded_nodes: Optional[int] = None  # --forwarding: scaleup_ranks of the forwarding Buffer (None: flat)


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
    first_round_trip_s: float = 0.0  # host wall clock of the Buffer's first dispatch + combine (kernel loads included)
    first_call_s: float = 0.0  # host wall clock of the point's first dispatch + combine (a new T on a primed Buffer)
    host_times: Dict[str, List[float]] = field(default_factory=dict)  # host seconds per call, no wait, by operation
    graph_times: Dict[str, List[float]] = field(default_factory=dict)  # GPU seconds per CUDA graph replay, by operation
    busy: Dict[str, Any] = field(default_factory=dict)  # busy-stream check: seconds per round by figure, or "skipped"
    waits: Dict[str, Any] = field(default_factory=dict)  # Buffer.wait_stats() tables by part ("eager", "graphs")


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


@dataclass(frozen=True)
class Payload:
    """What a point's timed dispatches send: ``x [T, H]`` (payload dtype, where the backend wants it), or with
    ``--fp8`` the pair ``(x_fp8 [T, H] uint8 e4m3fn bits, scales [T, H // 128] float32)`` of
    ``ep_comm.contract.fp8.quantize(x)``, made once before timing (``pair``)."""

    x: Any
    pair: Optional[Tuple[Any, Any]] = None

    @classmethod
    def of(cls, x: np.ndarray, device: Callable[[np.ndarray], Any], fp8: bool) -> "Payload":
        """``x`` (host) on the device, and its FP8 pair when ``fp8``."""
        if not fp8:
            return cls(device(x))
        q, scales = fp8_format.quantize(x)
        return cls(device(x), (device(q.view(np.uint8)), device(scales)))

    @property
    def sent(self) -> Any:
        """The ``x`` argument of the timed dispatches: the FP8 pair, else ``x``."""
        return self.x if self.pair is None else self.pair

    def combine_input(self, buf: Any, out: Any, cpu_sync: bool = True) -> Any:
        """``y`` for ``buf.combine(y, out.handle)``: ``out.recv_x``; with FP8 (a pair there) the payload-dtype rows
        in the same layout, the ``recv_x`` of a cached dispatch of ``x`` replaying ``out.handle`` (collective)."""
        if self.pair is None:
            return out.recv_x
        return buf.dispatch(self.x, handle=out.handle, cpu_sync=cpu_sync).recv_x


def new_dispatch(buf: Any, payload: Payload, didx: Any, spec: PointSpec, weights: Any = None,
                 cpu_sync: bool = True) -> Any:
    """A dispatch of the routing ``didx`` as new (count, count exchange and all) in the point's mode."""
    return buf.dispatch(payload.sent, didx, weights, cpu_sync=cpu_sync, expand=spec.expand,
                        expert_alignment=spec.expert_alignment)


def host_rows(x: np.ndarray, fp8: bool) -> np.ndarray:
    """The rows a dispatch of ``x [T, H]`` moves, on the host: ``x``, or with ``fp8`` its packed FP8 rows
    ``[T, packed_row_bytes(H)]`` uint8 (what the NCCL baselines then exchange)."""
    return fp8_format.pack(*fp8_format.quantize(x)) if fp8 else x


def packed_received(out: Any, rows: np.ndarray) -> np.ndarray:
    """The received FP8 pair of ``out`` at ``rows``, packed again on the host: ``[len(rows), P]`` uint8."""
    q, scales = out.recv_x
    return fp8_format.pack(to_host(q).view(np.uint8)[rows], to_host(scales)[rows])


def fp8_failures(out: Any, y: Any, which: str) -> List[str]:
    """The received FP8 pair of ``out`` byte for byte against ``ep_comm.contract.fp8.quantize`` of ``y`` (the payload-dtype
    rows of the same layout, :meth:`Payload.combine_input`), on the rows that hold a token."""
    rows = token_rows(out)
    got, want = packed_received(out, rows), fp8_format.pack(*fp8_format.quantize(to_host(y)[rows]))
    bad = np.nonzero((got != want).any(axis=1))[0]
    if not len(bad):
        return []
    return [f"FP8 rows ({which}) differ from ep_comm.contract.fp8.quantize of the sent rows: {len(bad)} of {len(rows)} "
            f"rows, first recv_x row {int(rows[bad[0]])}"]


def with_rows(out: Any) -> Any:
    """``out`` with ``recv_x`` an array of its rows (an FP8 pair's ``x_fp8``), for :func:`check_counts`."""
    return dataclasses.replace(out, recv_x=out.recv_x[0]) if isinstance(out.recv_x, tuple) else out


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


def graph_replay_times(comm: MPI.Comm, buf: Any, payload: Payload, didx: Any, handle: Any,
                       spec: PointSpec, pause: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """GPU seconds per CUDA graph replay of the path that never waits on the host, captured on a side
    stream one call per graph (each graph is one collective step: the buffer parity comes from the
    device): the cached dispatch of ``payload`` with ``cpu_sync=False`` and its combine, then a dispatch of the
    routing ``didx`` as new (count, count exchange and all, in the point's mode) and its combine. All four are
    replayed ``spec.warmup + spec.iters`` times, each round after a barrier, between CUDA events. With FP8 the
    cached combine's input is made once before the captures (:meth:`Payload.combine_input`) and the new
    routing's is a fifth graph (a cached plain dispatch of its handle), replayed before its combine, untimed; and
    the same two dispatches of ``x`` in the payload dtype are replayed last, the same-run reference of the FP8
    ones (:func:`bf16_reference_graphs`: ``"dispatch_bf16"``, ``"dispatch_new_bf16"``). ``pause`` (``--straggler``,
    or None): called before each replay's launch, outside its host time.
    Returns ``{"dispatch": [...], "combine": [...], "dispatch_new": [...], "combine_new": [...], "host":
    {"graph_launch_dispatch": [...], "graph_launch_combine": [...]}`` (host seconds per replay
    launch, cached pair), ``"results": (last cached combine's x, last new combine's x)``, ``"fp8_rows": ((cached
    dispatch output, its combine input), (new one, its combine input))`` with FP8, else ``()``}."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)

    def dispatch_new() -> Any:  # the point's mode: an expand point replays an expand dispatch
        return new_dispatch(buf, payload, didx, spec, cpu_sync=False)

    def cached_dispatch() -> Any:
        return buf.dispatch(payload.sent, handle=handle, cpu_sync=False)

    with stream:
        for make in (dispatch_new, cached_dispatch):  # every launch bound before the captures
            warm = make()
            warm_y = payload.combine_input(buf, warm, cpu_sync=False)
            buf.combine(warm_y, warm.handle)
        stream.synchronize()
        cached, cached_dispatch_graph = captured(stream, cached_dispatch)
        cached_y = cached.recv_x if payload.pair is None else warm_y  # warm_y: the cached layout, made last
        cached_sum, cached_combine = captured(stream, lambda: buf.combine(cached_y, cached.handle))
        new, new_graph = captured(stream, dispatch_new)
        steps = [("dispatch", cached_dispatch_graph), ("combine", cached_combine), ("dispatch_new", new_graph)]
        new_y = new.recv_x
        if payload.pair is not None:
            new_y, fill = captured(stream, lambda: payload.combine_input(buf, new, cpu_sync=False))
            steps.append(("", fill))  # untimed: the new routing's combine input
        new_sum, new_combine = captured(stream, lambda: buf.combine(new_y, new.handle))
        steps.append(("combine_new", new_combine))
        if payload.pair is not None:
            steps += bf16_reference_graphs(stream, buf, Payload(payload.x), didx, handle, spec)
    marks = [cupy.cuda.Event() for _ in range(len(steps) + 1)]

    def replay() -> List[float]:
        host = []
        marks[0].record(stream)
        for (_, graph), mark in zip(steps, marks[1:]):
            if pause is not None:
                pause()
            start = time.perf_counter()
            graph.launch(stream)
            host.append(time.perf_counter() - start)
            mark.record(stream)
        marks[-1].synchronize()
        return [cupy.cuda.get_elapsed_time(a, b) / 1e3 for a, b in zip(marks, marks[1:])] + host[:2]

    rows = sample_times(comm, replay, spec.warmup, spec.iters)
    times = {name: rows[:, i].tolist() for i, (name, _) in enumerate(steps) if name}
    launches = rows[:, len(steps):]
    fp8_rows = ((cached, cached_y), (new, new_y)) if payload.pair is not None else ()
    return {**times, "host": {"graph_launch_dispatch": launches[:, 0].tolist(),
                              "graph_launch_combine": launches[:, 1].tolist()},
            "results": (cached_sum.x, new_sum.x), "fp8_rows": fp8_rows}


BF16_REFERENCE = "_bf16"  # the suffix of the graph replays of an FP8 run that send x in the payload dtype


def bf16_reference_graphs(stream: Any, buf: Any, plain: Payload, didx: Any, handle: Any,
                          spec: PointSpec) -> List[Tuple[str, Any]]:
    """The graphs of the same-run reference of an FP8 run's dispatches: the cached dispatch of ``handle`` and the
    dispatch of the routing ``didx`` as new, both ``cpu_sync=False`` sending ``plain`` (``x`` in the payload dtype),
    each called once on ``stream`` before its capture (its launches bound). Collective. Returns ``[("dispatch" +
    BF16_REFERENCE, graph), ("dispatch_new" + BF16_REFERENCE, graph)]``."""
    calls = (("dispatch", lambda: buf.dispatch(plain.sent, handle=handle, cpu_sync=False)),
             ("dispatch_new", lambda: new_dispatch(buf, plain, didx, spec, cpu_sync=False)))
    graphs = []
    for name, call in calls:
        call()
        graphs.append((name + BF16_REFERENCE, captured(stream, call)[1]))
    return graphs


def captured(stream: Any, call: Callable[[], Any]) -> Tuple[Any, Any]:
    """``(result, graph)``: ``call`` captured into a CUDA graph on ``stream``; the capture is ended even
    when ``call`` raises."""
    stream.begin_capture()
    try:
        result = call()
    finally:
        graph = stream.end_capture()
    return result, graph


def round_trip_failures(got: Any, want: np.ndarray, which: str) -> List[str]:
    """The one-line failure of a round trip (``which`` iteration) whose ``got`` is not ``want`` bit for bit, or none."""
    problem = first_mismatch(to_host(got), want)
    return [] if problem is None else [f"round trip ({which} iteration) differs: {problem}"]
