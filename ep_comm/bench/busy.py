"""The busy-stream check (``--busy-check``): does an eager ``cpu_sync=False`` call wait for the stream it is queued on?

Per point (GPU): a 1 ms spin kernel (one thread reading ``%globaltimer``) is queued on the current stream, then
the cached ``cpu_sync=False`` dispatch of the point's handle and its combine. Neither call should wait for the
device, so the host gets both back long before the spin ends; a hidden synchronization shows as a host time of
about 1 ms. CUDA events before the spin, after it and after the combine give the GPU time of each part. The
``mpi`` backend runs its calls on the host: there is no stream to keep busy, and the check says so.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mpi4py import MPI

from ep_comm.bench.calls import AsyncPair
from ep_comm.bench.measure import PointSpec, RankSample, sample_times
from ep_comm.bench.stats import percentiles

SPIN_US = 1000.0  # how long the spin kernel keeps the stream busy
HIDDEN_SYNC_US = 500.0  # a host time above this (slowest rank's p50) means a call waited for the spin
SKIPPED_ON_MPI = "the mpi backend runs its calls on the host, there is no GPU stream to keep busy"
FIGURES = ("host", "gpu_total", "spin", "pair")  # seconds per round, by figure (RankSample.busy)
SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


def busy_times(comm: MPI.Comm, pair: AsyncPair, spec: PointSpec) -> Dict[str, Any]:
    """``spec.warmup + spec.iters`` rounds (each after a barrier) of: the spin kernel, then ``pair``'s dispatch and
    combine, on the current stream. Returns seconds per round of ``host`` (from after the spin's launch until
    the combine returned), ``gpu_total`` (event before the spin to event after the combine), ``spin`` and
    ``pair`` (its two parts), and ``result``: the last combine's x."""
    import cupy

    kernel = cupy.RawKernel(SPIN_SOURCE, "spin")
    kernel.compile()  # NVRTC before the rounds, not in the first one
    marks = [cupy.cuda.Event() for _ in range(3)]
    last: Dict[str, Any] = {}

    def round_trip() -> Tuple[float, float, float, float]:
        marks[0].record()
        kernel((1,), (1,), (cupy.uint64(SPIN_US * 1e3),))
        marks[1].record()
        start = time.perf_counter()
        last["x"] = pair.combine(pair.dispatch())
        host = time.perf_counter() - start
        marks[2].record()
        marks[2].synchronize()
        spin, calls = (cupy.cuda.get_elapsed_time(a, b) / 1e3 for a, b in zip(marks, marks[1:]))
        return host, spin + calls, spin, calls

    rows = sample_times(comm, round_trip, spec.warmup, spec.iters)
    return {**{name: rows[:, i].tolist() for i, name in enumerate(FIGURES)}, "result": last["x"]}


def summarize_busy(samples: Sequence[RankSample], graph: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The point's ``busy_check`` from every rank's figures and the point's ``graph_us``: p50/p99 of each figure
    in us (``host_us``, ``gpu_total_us``, ``spin_us``, ``pair_us``), ``graph_pair_us`` (cached dispatch + combine
    graph replay p50s; None without graphs), ``expected_gpu_us`` (1 ms + that), ``hidden_sync`` (host p50 of the
    slowest rank above 0.5 ms). ``{"skipped": reason}`` where it did not run; None where it was not asked for."""
    busy = samples[0].busy
    if not busy:
        return None
    if "skipped" in busy:
        return {"skipped": busy["skipped"]}
    summary = {f"{name}_us": percentiles([s.busy[name] for s in samples]) for name in FIGURES}
    pair = graph["dispatch"]["p50"] + graph["combine"]["p50"] if graph else None
    return {**summary, "graph_pair_us": pair, "expected_gpu_us": None if pair is None else SPIN_US + pair,
            "hidden_sync": summary["host_us"]["p50"] > HIDDEN_SYNC_US}


def format_busy(check: Optional[Dict[str, Any]]) -> List[str]:
    """The report's line of a point's ``busy_check`` (none when it was not asked for)."""
    if check is None:
        return []
    if "skipped" in check:
        return [f"  busy-stream check skipped: {check['skipped']}"]
    host, total = check["host_us"], check["gpu_total_us"]
    expected = check["expected_gpu_us"]
    against = "no graph replays to compare" if expected is None else (
        f"1 ms + graph replays of the pair = {expected:.1f} us")
    return [f"  busy stream (1 ms spin queued first), cached dispatch cpu_sync=False + combine: host until both "
            f"returned p50 {host['p50']:.1f} us p99 {host['p99']:.1f} us "
            f"({'HIDDEN SYNC' if check['hidden_sync'] else 'no hidden sync'}); GPU spin to combine end p50 "
            f"{total['p50']:.1f} us p99 {total['p99']:.1f} us (spin {check['spin_us']['p50']:.1f}, pair "
            f"{check['pair_us']['p50']:.1f}; {against})"]
