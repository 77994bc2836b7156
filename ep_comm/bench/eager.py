"""The eager path in the report: each eager operation over its CUDA-graph replay, the first call at a token
count, and the sweep (``--sweep``): one entry and one table row per point.

Eager operations (``latency_us``) and the graph replays (``graph_us``) they are set against (:data:`EAGER_GRAPH`):
``dispatch`` (a new routing, ``cpu_sync=True``) against ``dispatch_new``, ``dispatch_cached`` (the point's handle,
``cpu_sync=True``) against ``dispatch`` (the cached replay), ``combine`` (of the new routing's rows) against
``combine_new``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from ep_comm.bench.measure import RankSample

EAGER_GRAPH = {"dispatch": "dispatch_new", "dispatch_cached": "dispatch", "combine": "combine_new"}
HOST_OPS = ("dispatch_new_async", "dispatch_cached_async", "combine")  # host_us of the cpu_sync=False calls
SWEEP_TITLE = ("== sweep: eager calls per token count (slowest rank, us; first call: the count's first dispatch + "
               "combine, before its warm-up, on a primed Buffer)")


def eager_over_graph(latency: Mapping[str, Any], graph: Mapping[str, Any]) -> Dict[str, float]:
    """Each eager operation's p50 over its graph replay's p50 (:data:`EAGER_GRAPH`), where the point has both."""
    return {op: latency[op]["p50"] / graph[replay]["p50"] for op, replay in EAGER_GRAPH.items()
            if op in latency and graph.get(replay, {}).get("p50")}


def first_call(samples: Sequence[RankSample]) -> Dict[str, Any]:
    """``first_call_us`` (the slowest rank's first dispatch + combine of the point) and its per-rank list."""
    per_rank = [s.first_call_s * 1e6 for s in samples]
    return {"first_call_us": max(per_rank), "first_call_us_per_rank": per_rank}


def _p50_p99(stats: Mapping[str, Any], ops: Sequence[str]) -> Dict[str, Dict[str, float]]:
    return {op: {"p50": stats[op]["p50"], "p99": stats[op]["p99"]} for op in ops if op in stats}


def sweep_entry(point: Mapping[str, Any]) -> Dict[str, Any]:
    """The sweep's entry of a point: its token and SM counts, ``first_call_us``, eager and host p50/p99 per
    operation (``eager_us``, ``host_us``), ``eager_over_graph``, ``check_passed``."""
    return {"tokens_per_rank": point["tokens_per_rank"], "num_sms": point["num_sms"],
            "first_call_us": point["first_call_us"], "eager_us": _p50_p99(point["latency_us"], list(EAGER_GRAPH)),
            "host_us": _p50_p99(point["host_us"], HOST_OPS), "eager_over_graph": point["eager_over_graph"],
            "check_passed": point["check_passed"]}


def _cell(stats: Mapping[str, Any], op: str) -> str:
    return f"{stats[op]['p50']:.1f}/{stats[op]['p99']:.1f}" if op in stats else "-"


def _ratios(ratios: Mapping[str, float]) -> str:
    return "/".join(f"{ratios[op]:.1f}" if op in ratios else "-" for op in EAGER_GRAPH)


def format_sweep_table(points: Sequence[Dict[str, Any]]) -> str:
    """One row per point: first call, eager p50/p99 per operation, host p50 per ``cpu_sync=False`` call, eager
    over graph (``-`` where the point has no graph replays)."""
    lines = [SWEEP_TITLE, f"  {'tokens':>7} {'num_sms':>7} {'first call':>10} {'dispatch new':>15} "
                          f"{'dispatch cached':>15} {'combine':>15} {'host new/cached/combine':>24} "
                          f"{'eager/graph':>15}  check"]
    for p in points:
        eager, host = p["latency_us"], p["host_us"]
        host_p50 = "/".join(f"{host[op]['p50']:.1f}" if op in host else "-" for op in HOST_OPS)
        lines.append(f"  {p['tokens_per_rank']:>7} {p['num_sms']!s:>7} {p['first_call_us']:>10.1f} "
                     + " ".join(f"{_cell(eager, op):>15}" for op in EAGER_GRAPH)
                     + f" {host_p50:>24} {_ratios(p['eager_over_graph']):>15}  "
                     + ("ok" if p["check_passed"] else "FAILED"))
    return "\n".join(lines)


def format_eager(point: Mapping[str, Any]) -> List[str]:
    """The report's lines of a point's eager path: the cached dispatch, the first call, the ratios to the graphs."""
    lat, ratios = point["latency_us"], point["eager_over_graph"]
    lines = [f"  first call at this count {point['first_call_us']:.1f} us (before the warm-up; the Buffer's first "
             f"round trip, kernel loads included: {point['first_round_trip_s']:.3f} s; slowest rank)"]
    if "dispatch_cached" in lat:
        lines.append(f"  eager cached dispatch (cpu_sync=True) p50 {lat['dispatch_cached']['p50']:.1f} us "
                     f"p99 {lat['dispatch_cached']['p99']:.1f} us")
    if ratios:
        lines.append("  eager over CUDA graph replay (p50): " + ", ".join(
            f"{op} {ratio:.2f}x (graph {EAGER_GRAPH[op]})" for op, ratio in ratios.items()))
    return lines


def sweep_sections(points: Sequence[Dict[str, Any]], swept: bool) -> Dict[str, Any]:
    """The JSON's extra sections: ``{"sweep": [one entry per point]}`` for a ``--sweep`` run (``swept``), else none."""
    return {"sweep": [sweep_entry(p) for p in points]} if swept else {}


def sweep_tail(points: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The sweep table when the points have more than one token count, else None."""
    return format_sweep_table(points) if len({p["tokens_per_rank"] for p in points}) > 1 else None
