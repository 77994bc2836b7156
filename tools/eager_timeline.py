"""Where one eager call's time goes, host and GPU on one clock: a per-phase timeline of ``Buffer.dispatch`` /
``Buffer.combine`` on the nvshmem backend, per rank. A developer's measurement, never a test (issue 47)::

    launch/mpirun_gpu.sh 1 tools.eager_timeline --out DIR [--tokens 128,4096] [--ops new_sync,cached_sync,combine]
    launch/with_mps.sh --ranks-per-gpu 2 -- launch/mpirun_gpu.sh 2 tools.eager_timeline --out DIR --num-sms 24

Per timed call (after a barrier and a device synchronisation: the stream is idle) the host notes, on
``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every rank of the host), the call's start, every kernel
launch's driver call (``ep_comm._launcher.raw.launch``: recorded calls, pre-bound and signal kernels), the poll's start
and end (``StepRunner._poll``) and the return. CUDA events recorded around each launch give every kernel's start and
end on the GPU; they are put on the host clock through a reference event recorded on the idle stream just before the
call (its GPU time is taken as the host time of its record; ``calibration_us``, the time until the host saw it done,
bounds the error). An event after the return marks the GPU's end (``gpu_done``). The events add ~1 us of host time
per launch: compare phases within the tool, not its totals with ``ep_comm.bench``.

Phases (us from the call's start, p50 over the timed calls; ``rank`` per rank and the slowest):
``enqueue`` (start to the poll, or to the return without a poll), ``poll`` (the poll's wait), ``after_poll`` (poll to
return), ``call`` (start to return), ``gpu_done`` (start to the GPU's end), and per kernel in launch order
``<i>:<name>`` host launch time, the driver call's own time (``driver``: a launch slowed by MPS or the driver,
not by Python), GPU start and end, and the GPU idle before it (``gap``). Writes ``DIR/rank{r}.json``
(every call's raw times) and, on rank 0 (with each rank's call start after rank 0's, ``start skew``), ``DIR/timeline.json`` (the summary of every rank) and ``DIR/timeline.txt``
(the tables).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

OPS = ("new_sync", "cached_sync", "combine", "new_async", "cached_async")
DEFAULT_OPS = "new_sync,cached_sync,combine"


# ----------------------------------------------------------------------------------------- CPU side (tested)
def call_phases(call: Mapping[str, Any]) -> Dict[str, float]:
    """The host phases of one call's record (``call``: ``start``, ``end``, ``poll`` (``[begin, end]`` or None), host
    times in seconds; ``gpu_done`` in seconds on the host clock, or None), in us from its start."""
    start, end, poll = call["start"], call["end"], call.get("poll")
    phases = {"call": (end - start) * 1e6}
    if poll:
        phases.update(enqueue=(poll[0] - start) * 1e6, poll=(poll[1] - poll[0]) * 1e6,
                      after_poll=(end - poll[1]) * 1e6)
    else:
        phases["enqueue"] = phases["call"]
    if call.get("gpu_done") is not None:
        phases["gpu_done"] = (call["gpu_done"] - start) * 1e6
    return phases


def kernel_rows(call: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Per launch of one call's record (``launches``: ``name``, ``host`` (when it was launched, s), ``driver`` (the
    ``cuLaunchKernel`` call's own seconds, or None), ``gpu`` (``[start, end]`` on the host clock, s, or None)), in
    launch order: its name, host launch time, the host's Python time before it (from the previous launch's driver
    call or the call's start, the poll's wait left out: ``python_us``), driver call time, GPU start and end and the
    GPU idle before it (``gap``, from the previous kernel's end, or from the poll's end for the first kernel
    launched after the poll), in us from the call's start."""
    start, poll = call["start"], call.get("poll")
    rows, previous_end, host_free = [], None, start
    for i, launch in enumerate(call["launches"]):
        row: Dict[str, Any] = {"kernel": f"{i}:{launch['name']}", "host_us": (launch["host"] - start) * 1e6}
        waited = 0.0 if poll is None or not host_free <= poll[0] <= launch["host"] else poll[1] - poll[0]
        row["python_us"] = max(0.0, (launch["host"] - host_free - waited) * 1e6)
        host_free = launch["host"]
        if launch.get("driver") is not None:
            row["driver_us"] = launch["driver"] * 1e6
            host_free += launch["driver"]
        gpu = launch.get("gpu")
        if gpu is not None:
            row["gpu_start_us"], row["gpu_end_us"] = (gpu[0] - start) * 1e6, (gpu[1] - start) * 1e6
            after_poll = poll is not None and launch["host"] >= poll[1]
            reference = previous_end
            if after_poll and (previous_end is None or previous_end < poll[1]):
                reference = poll[1]
            if reference is not None:
                row["gap_us"] = max(0.0, (gpu[0] - reference) * 1e6)
            previous_end = gpu[1] if previous_end is None else max(previous_end, gpu[1])
        rows.append(row)
    return rows


def start_skew(starts: Sequence[Sequence[float]]) -> List[Optional[float]]:
    """Per rank, the p50 over calls of its call's start minus rank 0's (us; ``starts[r][i]``: rank ``r``'s start of
    call ``i`` on the host clock, which every rank of a host shares)."""
    return [_median([(a - b) * 1e6 for a, b in zip(mine, starts[0])]) for mine in starts]


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(calls: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """p50 over ``calls`` (records of one op on one rank) of every phase (:func:`call_phases`) and, per kernel
    position, of its host launch time, GPU start, end and gap (:func:`kernel_rows`); ``calibration_us`` p50 and max."""
    phases: Dict[str, List[float]] = {}
    kernels: Dict[str, Dict[str, List[float]]] = {}
    for call in calls:
        for name, value in call_phases(call).items():
            phases.setdefault(name, []).append(value)
        for row in kernel_rows(call):
            fields = kernels.setdefault(row["kernel"], {})
            for name, value in row.items():
                if name != "kernel":
                    fields.setdefault(name, []).append(value)
    calibration = [c["calibration_us"] for c in calls if c.get("calibration_us") is not None]
    return {"calls": len(calls),
            "phases_us": {name: _median(values) for name, values in phases.items()},
            "kernels_us": {kernel: {name: _median(values) for name, values in fields.items()}
                           for kernel, fields in kernels.items()},
            "calibration_us": {"p50": _median(calibration), "max": max(calibration) if calibration else None}}


PHASE_ORDER = ("enqueue", "poll", "after_poll", "call", "gpu_done")


def _us(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(title: str, per_rank: Sequence[Mapping[str, Any]],
                   skew: Optional[Sequence[Optional[float]]] = None) -> List[str]:
    """The text of one point and op: a phase table (one column per rank; ``skew``: each rank's call start after rank
    0's, :func:`start_skew`) and a kernel table (per kernel position: host launch / Python before it / driver call /
    GPU start / GPU end / GPU gap per rank), p50 us from the call's start."""
    lines = [f"== {title} (p50 us from the call's start; {per_rank[0]['calls'] if per_rank else 0} calls; "
             "calibration p50/max " + ", ".join(
                 f"r{r}: {_us(s['calibration_us']['p50'])}/{_us(s['calibration_us']['max'])}"
                 for r, s in enumerate(per_rank)) + ")"]
    lines.append(f"  {'phase':<12}" + "".join(f"{'rank ' + str(r):>12}" for r in range(len(per_rank))))
    if skew is not None:
        lines.append(f"  {'start skew':<12}" + "".join(f"{_us(v):>12}" for v in skew))
    for phase in PHASE_ORDER:
        if any(phase in s["phases_us"] for s in per_rank):
            lines.append(f"  {phase:<12}" + "".join(f"{_us(s['phases_us'].get(phase)):>12}" for s in per_rank))
    kernels: List[str] = []
    for s in per_rank:
        kernels += [k for k in s["kernels_us"] if k not in kernels]
    if kernels:
        lines.append(f"  {'kernel':<28}" + "".join(f"{'r' + str(r) + ' launch/python/driver/start/end/gap':>46}"
                                                   for r in range(len(per_rank))))
        for kernel in kernels:
            cells = []
            for s in per_rank:
                k = s["kernels_us"].get(kernel, {})
                cells.append("/".join(_us(k.get(f)) for f in ("host_us", "python_us", "driver_us", "gpu_start_us",
                                                               "gpu_end_us", "gap_us")))
            lines.append(f"  {kernel[:28]:<28}" + "".join(f"{c:>46}" for c in cells))
    return lines


# ----------------------------------------------------------------------------------------- GPU side
class _Recorder:
    """While ``active``: every ``raw.launch`` noted with its host time and two CUDA events around it (from a pool),
    and the backend runner's polls' begin and end."""

    def __init__(self, cupy: Any, runner: Any, raw: Any, pool: int = 128):
        self.cupy, self.raw, self.runner = cupy, raw, runner
        self.events = [cupy.cuda.Event() for _ in range(2 * pool)]
        self.active = False
        self.launches: List[list] = []
        self.poll: Optional[list] = None
        self._launch, self._poll = raw.launch, runner._poll
        self._own_poll = "_poll" in vars(runner)  # an instance's own attribute (a stand-in), not the class's method
        raw.launch = self._timed_launch
        runner._poll = self._timed_poll

    def restore(self) -> None:
        self.raw.launch = self._launch
        if self._own_poll:
            self.runner._poll = self._poll
        else:
            del self.runner._poll

    def begin(self) -> None:
        self.launches, self.poll, self.active = [], None, True

    def _timed_launch(self, function: Any, grid: int, block: int, shared: int, on: Any, params: int,
                      name: str) -> None:
        if not self.active or 2 * len(self.launches) + 2 > len(self.events):
            return self._launch(function, grid, block, shared, on, params, name)
        record = self.cupy.cuda.runtime.eventRecord
        handle = int(on)
        begin, end = self.events[2 * len(self.launches)], self.events[2 * len(self.launches) + 1]
        host = time.perf_counter()
        record(begin.ptr, handle)
        driver = time.perf_counter()
        self._launch(function, grid, block, shared, on, params, name)
        driver = time.perf_counter() - driver
        record(end.ptr, handle)
        self.launches.append([name.replace("kernel ", ""), host, driver, begin, end])

    def _timed_poll(self, *args: Any, **kwargs: Any) -> None:  # StepRunner._poll's arguments, whatever they are
        begin = time.perf_counter()
        try:
            self._poll(*args, **kwargs)
        finally:
            self.poll = [begin, time.perf_counter()]


def _timed_call(cupy: Any, recorder: _Recorder, op: Callable[[], Any]) -> Dict[str, Any]:
    """One call on an idle stream: its record (host times on ``perf_counter``, GPU times put on it)."""
    stream = cupy.cuda.get_current_stream()
    reference, done = cupy.cuda.Event(), cupy.cuda.Event()
    stream.synchronize()
    h0 = time.perf_counter()
    reference.record(stream)
    while not reference.done:
        pass
    calibration = (time.perf_counter() - h0) * 1e6
    recorder.begin()
    start = time.perf_counter()
    op()
    end = time.perf_counter()
    recorder.active = False
    done.record(stream)
    done.synchronize()

    def on_host(event: Any) -> float:
        return h0 + cupy.cuda.get_elapsed_time(reference, event) / 1e3

    launches = [{"name": name, "host": host, "driver": driver, "gpu": [on_host(b), on_host(e)]}
                for name, host, driver, b, e in recorder.launches]
    return {"start": start, "end": end, "poll": recorder.poll, "gpu_done": on_host(done), "launches": launches,
            "calibration_us": calibration}


def _ops(buf: Any, x: Any, idx: Any, expand: bool) -> Dict[str, Callable[[], Any]]:
    synced = buf.dispatch(x, idx, expand=expand, cpu_sync=True)
    free = buf.dispatch(x, idx, expand=expand, cpu_sync=False)
    return {"new_sync": lambda: buf.dispatch(x, idx, expand=expand, cpu_sync=True),
            "cached_sync": lambda: buf.dispatch(x, handle=synced.handle, cpu_sync=True),
            "combine": lambda: buf.combine(synced.recv_x, synced.handle),
            "new_async": lambda: buf.dispatch(x, idx, expand=expand, cpu_sync=False),
            "cached_async": lambda: buf.dispatch(x, handle=free.handle, cpu_sync=False)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank{r}.json, timeline.json, timeline.txt")
    parser.add_argument("--tokens", default="128,4096", help="tokens per rank, comma-separated (decode, prefill)")
    parser.add_argument("--ops", default=DEFAULT_OPS, help=f"comma-separated of {','.join(OPS)}")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=None)
    parser.add_argument("--expand", action="store_true")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"--ops: unknown {unknown}; choose from {OPS}")
    tokens = [int(t) for t in args.tokens.split(",")]

    import cupy
    import numpy as np
    from mpi4py import MPI

    import ep_comm
    from ep_comm._launcher import raw
    from ep_comm.testing.routing import uniform_routing

    comm = MPI.COMM_WORLD
    os.makedirs(args.out, exist_ok=True)
    buf = ep_comm.Buffer(comm, num_experts=args.experts, hidden=args.hidden, num_topk=args.topk,
                         num_max_tokens_per_rank=max(tokens), backend="nvshmem", num_sms=args.num_sms)
    recorder = _Recorder(cupy, buf._backend.runner, raw)
    raw_calls: Dict[str, Any] = {}
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    summary: Dict[str, Any] = {"ranks": comm.size, "rank": comm.rank, "num_sms": buf.num_sms,
                               "device": name.decode() if isinstance(name, bytes) else str(name),
                               "cpus": len(os.sched_getaffinity(0)), "expand": args.expand, "points": {}}
    try:
        for t in tokens:
            idx = cupy.asarray(uniform_routing(t, args.experts, args.topk, seed=(0, comm.rank)).topk_idx)
            x = cupy.asarray(np.ones((t, args.hidden), buf.geometry.dtype))
            calls = _ops(buf, x, idx, args.expand)
            for op in ops:
                records = []
                for i in range(args.warmup + args.iters):
                    comm.Barrier()
                    record = _timed_call(cupy, recorder, calls[op])
                    if i >= args.warmup:
                        records.append(record)
                key = f"tokens={t} {op}"
                raw_calls[key] = records
                summary["points"][key] = summarize(records)
    finally:
        recorder.restore()
    buf.close()
    with open(os.path.join(args.out, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"summary": summary, "calls": raw_calls}, f)
    every = comm.gather(summary, root=0)
    starts = comm.gather({key: [c["start"] for c in records] for key, records in raw_calls.items()}, root=0)
    if comm.rank == 0:
        for key in summary["points"]:
            skew = start_skew([s[key] for s in starts])
            for r, s in enumerate(every):
                s["points"][key]["start_skew_us"] = skew[r]
        lines = [f"eager timeline: {comm.size} rank(s), {summary['device']}, num_sms {summary['num_sms']}, "
                 f"{'expand' if args.expand else 'compact'}, H {args.hidden}, top-{args.topk} of {args.experts}; "
                 f"CPUs each rank may run on: {[s['cpus'] for s in every]}, MPS: "
                 f"{'CUDA_MPS_PIPE_DIRECTORY' in os.environ}"]
        for key in summary["points"]:
            lines += format_summary(key, [s["points"][key] for s in every],
                                    [s["points"][key]["start_skew_us"] for s in every])
        text = "\n".join(lines)
        print(text, flush=True)
        with open(os.path.join(args.out, "timeline.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "timeline.json"), "w") as f:
            json.dump(every, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
