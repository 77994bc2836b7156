"""Benchmark results on rank 0: aggregation over ranks, the text report, JSON, CSV, plots, progress.

Conventions (printed in the report header too):

* latency of an operation = per-rank p50/p99 over iterations; the aggregate is the slowest rank's
  (a collective is done when its last rank is);
* logical bytes = all compact rows a rank received (DeepEP's convention); NVLink bytes = the rows
  received from other ranks; GB/s = a rank's bytes / its p50, averaged over ranks; bytes per row are
  ``row_bytes`` per operation (``hidden * itemsize``; with ``--fp8`` the dispatch's are the FP8 bytes and
  scales, ``ep_comm.contract.fp8.row_bytes(hidden)``, without the packed row's padding); ``logical_bytes`` and
  ``nvlink_bytes`` are the dispatch's;
* tokens/s = tokens of all ranks / aggregate p50 of dispatch + combine;
* imbalance = max / mean of received rows over ranks;
* every point carries its SM count: ``num_sms`` as asked (an int, or ``"all"``) and
  ``num_sms_in_effect`` (``Buffer.num_sms``: the kernels' SM count on ``nvshmem``, None on ``mpi``,
  which has no kernels and ignores it);
* every point says whether ranks shared a GPU (``shared_gpu``); such points carry ``note`` =
  ``"shared GPU: not an NVLink figure"`` (:data:`ep_comm.bench.shared_gpu.NOTE`) in the JSON, the
  CSV and the text report: their bytes "from peers" never crossed NVLink.
"""
from __future__ import annotations

import csv
import json
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO, Union

import numpy as np
from mpi4py import MPI

from ep_comm.bench import eager, link_model
from ep_comm.bench import shared_gpu as sharing
from ep_comm.bench import waits as bench_waits
from ep_comm.bench.busy import format_busy, summarize_busy
from ep_comm.bench.measure import BF16_REFERENCE, RankSample
from ep_comm.bench.stats import percentiles
from ep_comm.cli import progress

EP_OPS = ("dispatch", "combine")
CACHED_OPS = ("dispatch_cached", "dispatch_cast")  # eager cached dispatch (of the prepared pair) / --fp8: with the cast
OWN_OPS = EP_OPS + ("round_trip",) + CACHED_OPS  # every other operation of latency_us is a baseline
COMBINE_COPY = "device_copy_combine"  # --fp8: the same-run device copy of the combine's bytes
ALL_SMS = "all"  # --num-sms value (and point["num_sms"]) for Buffer(num_sms=None): every SM of the device
HEADER = ("latency: slowest rank's p50/p99; GB/s: per-rank bytes / p50, mean over ranks; "
          "logical = all received rows, NVLink = rows from peers")


def gather_samples(comm: MPI.Comm, sample: RankSample) -> Optional[List[RankSample]]:
    """Every rank's sample on rank 0 (None elsewhere)."""
    return comm.gather(sample, root=0)


def sms_label(num_sms: Optional[int]) -> str:
    """How the command line and the report name an SM count: ``"all"`` for None, else the number."""
    return ALL_SMS if num_sms is None else str(num_sms)


def op_row_bytes(row_bytes: Union[int, Mapping[str, int]]) -> Dict[str, int]:
    """Bytes per received row of each operation of :data:`EP_OPS`: ``row_bytes`` for both, or as the mapping
    says."""
    if isinstance(row_bytes, Mapping):
        return {op: int(row_bytes[op]) for op in EP_OPS}
    return {op: int(row_bytes) for op in EP_OPS}


def compared_op(baseline: str) -> str:
    """The ep_comm operation a baseline is set against: the combine for :data:`COMBINE_COPY`, else the dispatch."""
    return "combine" if baseline == COMBINE_COPY else "dispatch"


def summarize(samples: Sequence[RankSample], row_bytes: Union[int, Mapping[str, int]], num_sms: Optional[int] = None,
              num_sms_in_effect: Optional[int] = None, shared_gpu: bool = False) -> Dict[str, Any]:
    """JSON-ready summary of one point from all ranks' samples; ``row_bytes``: bytes per received row, one
    number (``hidden * itemsize``) or ``{"dispatch": n, "combine": m}`` (``--fp8``).

    ``num_sms``: the SM count the point ran with as asked (None: all, stored as ``"all"``);
    ``num_sms_in_effect``: ``Buffer.num_sms`` (None on the mpi backend); ``shared_gpu``: ranks of the
    run share a GPU (the point then carries ``note``, :data:`ep_comm.bench.shared_gpu.NOTE`).
    """
    per_row = op_row_bytes(row_bytes)
    recv = np.array([s.recv_rows for s in samples], dtype=np.float64)
    peers = recv - np.array([s.recv_from_self for s in samples])
    ops = {op: [s.times[op] for s in samples] for op in samples[0].times}
    ops["round_trip"] = [np.add(s.times["dispatch"], s.times["combine"]) for s in samples]
    latency = {op: percentiles(times) for op, times in ops.items()}
    bandwidth = {
        op: {kind: float(np.mean(nbytes * per_row[op] / (np.array(latency[op]["p50_per_rank"]) * 1e-6))) / 1e9
             for kind, nbytes in (("logical", recv), ("nvlink", peers))}
        for op in EP_OPS
    }
    graph = {op: percentiles([s.graph_times[op] for s in samples]) for op in samples[0].graph_times}
    point = {
        "tokens_per_rank": samples[0].num_tokens,
        "num_sms": ALL_SMS if num_sms is None else int(num_sms),
        "num_sms_in_effect": num_sms_in_effect,
        "check_passed": not any(s.failures for s in samples),
        "failures": [f"rank {s.rank}: {f}" for s in samples for f in s.failures],
        "rows_sent": [s.rows_sent for s in samples],
        "recv_rows": [s.recv_rows for s in samples],
        "recv_from_peers": [int(p) for p in peers],
        "expanded_rows": [s.expanded_rows for s in samples],
        "imbalance": float(recv.max() / recv.mean()) if recv.sum() else 1.0,
        "row_bytes": per_row,
        "logical_bytes": [int(b) for b in recv * per_row["dispatch"]],
        "nvlink_bytes": [int(b) for b in peers * per_row["dispatch"]],
        "latency_us": latency,
        "bandwidth_gbps": bandwidth,
        "tokens_per_s": sum(s.num_tokens for s in samples) / (latency["round_trip"]["p50"] * 1e-6),
        "first_round_trip_s": max(s.first_round_trip_s for s in samples),
        **eager.first_call(samples),
        "host_us": {op: percentiles([s.host_times[op] for s in samples]) for op in samples[0].host_times},
        "graph_us": graph,
        "baseline_over_ep_comm": {op: latency[op]["p50"] / latency[compared_op(op)]["p50"]
                                  for op in latency if op not in OWN_OPS},
        "graph_over_device_copy": _over_copy(latency, graph),
        "graph_fp8_over_bf16": _fp8_over_bf16(graph),
        "eager_over_graph": eager.eager_over_graph(latency, graph),
        "shared_gpu": shared_gpu,
    }
    busy = summarize_busy(samples, graph)
    if busy is not None:
        point["busy_check"] = busy
    waits = bench_waits.section([s.waits for s in samples])
    if waits is not None:
        point["wait_stats"] = waits
    if shared_gpu:
        point["note"] = sharing.NOTE
    return point


def _over_copy(latency: Dict[str, Any], graph: Dict[str, Any]) -> Dict[str, float]:
    """Each CUDA-graph replay's p50 over the same-run device copy's p50 (empty without either): a combine over
    the copy of the combine's bytes (:data:`COMBINE_COPY`) where the run has one (``--fp8``), else over
    ``device_copy`` (the dispatch's bytes)."""
    copy = latency.get("device_copy")
    if copy is None or not copy["p50"]:
        return {}
    combine_copy = latency.get(COMBINE_COPY, copy)
    return {op: stats["p50"] / (combine_copy if op.startswith("combine") else copy)["p50"]
            for op, stats in graph.items() if not op.endswith(BF16_REFERENCE)}


def _fp8_over_bf16(graph: Dict[str, Any]) -> Dict[str, float]:
    """An FP8 run's dispatch graph replays (cached ``dispatch``, ``dispatch_new``), each p50 over the p50 of the
    same-run replay of the same dispatch sending ``x`` in the payload dtype (``<op>_bf16``); empty without them."""
    return {op: graph[op]["p50"] / graph[op + BF16_REFERENCE]["p50"] for op in ("dispatch", "dispatch_new")
            if op in graph and op + BF16_REFERENCE in graph and graph[op + BF16_REFERENCE]["p50"]}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def point_sms(point: Dict[str, Any]) -> str:
    """``num_sms=...`` of a point: ``num_sms=all (132 SMs)``, ``num_sms=16``, or on the mpi backend
    (no kernels) ``num_sms=16 (no effect on mpi)``."""
    asked, used = point["num_sms"], point["num_sms_in_effect"]
    if used is None:
        return f"num_sms={asked}" + ("" if asked == ALL_SMS else " (no effect on mpi)")
    return f"num_sms={asked}" + (f" ({used} SMs)" if asked == ALL_SMS else "")


def point_title(point: Dict[str, Any]) -> str:
    """``256 tokens/rank, num_sms=all``: what names a point in the report, progress and failures."""
    return f"{point['tokens_per_rank']} tokens/rank, {point_sms(point)}"


def note_mark(points: Sequence[Dict[str, Any]]) -> str:
    """`` [shared GPU: not an NVLink figure]`` when one of ``points`` carries a note, else empty."""
    notes = sorted({p["note"] for p in points if "note" in p})
    return "".join(f" [{n}]" for n in notes)


def format_point(point: Dict[str, Any], ceiling_gbps: Optional[float]) -> str:
    """The text block of one point: per-rank rows, then the aggregates."""
    lat = point["latency_us"]
    status = "OK" if point["check_passed"] else "FAILED"
    lines = [f"== {point_title(point)}: round trip {status}{note_mark([point])}",
             f"  {'rank':>4} {'sent':>8} {'recv':>8} {'peers':>8} {'dispatch p50/p99 us':>21} "
             f"{'combine p50/p99 us':>20}"]
    for r, (sent, recv, peer) in enumerate(zip(point["rows_sent"], point["recv_rows"], point["recv_from_peers"])):
        d = f"{lat['dispatch']['p50_per_rank'][r]:.1f}/{lat['dispatch']['p99_per_rank'][r]:.1f}"
        c = f"{lat['combine']['p50_per_rank'][r]:.1f}/{lat['combine']['p99_per_rank'][r]:.1f}"
        lines.append(f"  {r:>4} {sent:>8} {recv:>8} {peer:>8} {d:>21} {c:>20}")
    lines.append(f"  rows sent {sum(point['rows_sent'])}, imbalance {point['imbalance']:.3f} (max/mean received rows), "
                 f"per rank: logical {_fmt_bytes(np.mean(point['logical_bytes']))}, "
                 f"NVLink {_fmt_bytes(np.mean(point['nvlink_bytes']))}{_row_bytes_note(point)}")
    if any(point["expanded_rows"]):
        lines.append(f"  expanded rows per rank (padding included): {point['expanded_rows']}")
    for op in EP_OPS:
        bw = point["bandwidth_gbps"][op]
        of_ceiling = f" ({bw['nvlink'] / ceiling_gbps:.0%} of the NVLink ceiling)" if ceiling_gbps else ""
        lines.append(f"  {op:<8} p50 {lat[op]['p50']:.1f} us  p99 {lat[op]['p99']:.1f} us  "
                     f"logical {bw['logical']:.2f} GB/s  NVLink {bw['nvlink']:.2f} GB/s{of_ceiling}")
    lines.append(f"  dispatch+combine p50 {lat['round_trip']['p50']:.1f} us: {point['tokens_per_s']:.4g} tokens/s")
    lines += eager.format_eager(point)
    host = point["host_us"]
    if host:
        lines.append("  host time per call, no host wait (cpu_sync=False; dispatch_cached_async and combine: the "
                     "cached pair, dispatch_new_async: the routing as new): "
                     + ", ".join(f"{op} p50 {v['p50']:.1f} us p99 {v['p99']:.1f} us" for op, v in host.items()))
    graph = point.get("graph_us")
    if graph:
        lines.append("  CUDA graph replay, GPU time per replay (cpu_sync=False; dispatch/combine: cached, "
                     "dispatch_new/combine_new: the routing as new): "
                     + ", ".join(f"{op} p50 {v['p50']:.1f} us p99 {v['p99']:.1f} us" for op, v in graph.items()))
    if "dispatch_cast" in lat:
        cast, pair = lat["dispatch_cast"], lat["dispatch_cached"]
        lines.append(f"  sender cast (eager cached dispatch): use_fp8=True from the payload dtype p50 {cast['p50']:.1f} us "
                     f"p99 {cast['p99']:.1f} us, the prepared FP8 pair p50 {pair['p50']:.1f} us p99 {pair['p99']:.1f} us: "
                     f"the cast adds {cast['p50'] - pair['p50']:.1f} us at p50")
    for op, ratio in point["baseline_over_ep_comm"].items():
        lines.append(f"  baseline {op}: p50 {lat[op]['p50']:.1f} us, {ratio:.2f}x ep_comm's {compared_op(op)} time")
    lines += format_busy(point.get("busy_check")) + link_model.format_lines(point.get("link_model"))
    lines += bench_waits.format_lines(point)
    fp8_over_bf16 = point.get("graph_fp8_over_bf16")
    if fp8_over_bf16:
        lines.append("  CUDA graph replay, FP8 dispatch over the same-run dispatch of x in the payload dtype (p50): "
                     + ", ".join(f"{op} {ratio:.2f}x" for op, ratio in fp8_over_bf16.items()))
    over_copy = point.get("graph_over_device_copy")
    if over_copy:
        lines.append("  CUDA graph replay over the same-run device copy of the received bytes: "
                     + ", ".join(f"{op} {ratio:.2f}x" for op, ratio in over_copy.items()))
    lines += [f"  FAILED {f}" for f in point["failures"]]
    return "\n".join(lines)


def _row_bytes_note(point: Dict[str, Any]) -> str:
    """`` (bytes per row: dispatch 264 (FP8 + scales), combine 512)`` when the two differ (``--fp8``), else empty."""
    per_row = point.get("row_bytes", {})
    if per_row.get("dispatch") == per_row.get("combine"):
        return ""
    return f" (bytes per row: dispatch {per_row['dispatch']} (FP8 + scales), combine {per_row['combine']})"


def format_sms_table(points: Sequence[Dict[str, Any]]) -> str:
    """Dispatch and combine p50/p99 (slowest rank) per (tokens, SM count): the ``--num-sms`` comparison."""
    lines = [f"== per SM count (slowest rank, us){note_mark(points)}",
             f"  {'tokens':>7} {'num_sms':>14} {'dispatch p50/p99':>20} {'combine p50/p99':>20}  check"]
    for p in sorted(points, key=lambda p: p["tokens_per_rank"]):
        lat = p["latency_us"]
        sms = p["num_sms"] if p["num_sms_in_effect"] in (None, p["num_sms"]) else f"all ({p['num_sms_in_effect']})"
        d = f"{lat['dispatch']['p50']:.1f}/{lat['dispatch']['p99']:.1f}"
        c = f"{lat['combine']['p50']:.1f}/{lat['combine']['p99']:.1f}"
        check = "ok" if p["check_passed"] else "FAILED"
        lines.append(f"  {p['tokens_per_rank']:>7} {sms!s:>14} {d:>20} {c:>20}  {check}")
    return "\n".join(lines)


def format_header(meta: Dict[str, Any]) -> str:
    """The report's first lines: the run's parameters and provenance (``meta``), the package versions,
    the conventions."""
    head = " ".join(f"{k}={v}" for k, v in meta.items() if k != "versions" and v is not None)
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    return f"ep_comm.bench {head}\n" + (f"versions: {versions}\n" if versions else "") + f"({HEADER})"


def format_tail(points: Sequence[Dict[str, Any]]) -> Optional[str]:
    """What ends the report: the table of dispatch/combine latency per SM count when the run had more
    than one count, the sweep table (:func:`ep_comm.bench.eager.format_sweep_table`) when it had more than one
    token count; None when neither."""
    sms = format_sms_table(points) if len({p["num_sms"] for p in points}) > 1 else None
    tables = [t for t in (sms, eager.sweep_tail(points)) if t is not None]
    return "\n".join(tables) if tables else None


def format_report(meta: Dict[str, Any], points: Sequence[Dict[str, Any]]) -> str:
    """The whole report: :func:`format_header`, one block per point, :func:`format_tail`. (The
    benchmark prints these pieces as the run reaches them.)"""
    ceiling = meta.get("nvlink_ceiling_gbps")
    blocks = [format_header(meta)] + [format_point(p, ceiling) for p in points] + [format_tail(points)]
    return "\n".join(b for b in blocks if b is not None)


def write_json(path: str, meta: Dict[str, Any], points: Sequence[Dict[str, Any]],
               sections: Optional[Mapping[str, Any]] = None) -> None:
    """``{"meta": ..., "points": [...]}`` and the extra top-level ``sections`` (``sweep``) as JSON at ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "points": list(points), **(sections or {})}, f, indent=2)


def csv_row(point: Dict[str, Any]) -> Dict[str, Any]:
    """One flat CSV row of a point (with ``--scaleup-ranks`` its link model's columns, ``link_model.csv_columns``)."""
    row = {
        "tokens_per_rank": point["tokens_per_rank"],
        "num_sms": point["num_sms"],
        "num_sms_in_effect": "" if point["num_sms_in_effect"] is None else point["num_sms_in_effect"],
        "check_passed": point["check_passed"],
        "rows_sent": sum(point["rows_sent"]),
        "recv_rows_max": max(point["recv_rows"]),
        "imbalance": round(point["imbalance"], 4),
        "dispatch_row_bytes": point["row_bytes"]["dispatch"],
        "combine_row_bytes": point["row_bytes"]["combine"],
        "logical_bytes_mean": float(np.mean(point["logical_bytes"])),
        "nvlink_bytes_mean": float(np.mean(point["nvlink_bytes"])),
        "tokens_per_s": point["tokens_per_s"],
    }
    for op, lat in point["latency_us"].items():
        row[f"{op}_p50_us"], row[f"{op}_p99_us"] = lat["p50"], lat["p99"]
    for op, bw in point["bandwidth_gbps"].items():
        row[f"{op}_logical_gbps"], row[f"{op}_nvlink_gbps"] = bw["logical"], bw["nvlink"]
    for op, lat in point["host_us"].items():
        row[f"host_{op}_p50_us"], row[f"host_{op}_p99_us"] = lat["p50"], lat["p99"]
    for op, lat in point.get("graph_us", {}).items():
        row[f"graph_{op}_p50_us"], row[f"graph_{op}_p99_us"] = lat["p50"], lat["p99"]
    for op, ratio in point["baseline_over_ep_comm"].items():
        row[f"{op}_over_ep_comm"] = ratio
    for op, ratio in point.get("graph_over_device_copy", {}).items():
        row[f"graph_{op}_over_device_copy"] = ratio
    for op, ratio in point.get("graph_fp8_over_bf16", {}).items():
        row[f"graph_{op}_fp8_over_bf16"] = ratio
    for op, ratio in point.get("eager_over_graph", {}).items():
        row[f"{op}_eager_over_graph"] = ratio
    row.update(link_model.csv_columns(point.get("link_model")))
    row["first_call_us"] = point.get("first_call_us", "")
    row["shared_gpu"], row["note"] = point["shared_gpu"], point.get("note", "")
    return row


def write_csv(path: str, points: Sequence[Dict[str, Any]]) -> None:
    rows = [csv_row(p) for p in points]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def matplotlib_missing() -> Optional[str]:
    """None when ``--plot`` can be honoured, else the message to stop with (checked before the run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: pip install -e '.[bench]' "
                "(or pip install matplotlib)")
    return None


def _sms_groups(points: Sequence[Dict[str, Any]]) -> Dict[Any, List[Dict[str, Any]]]:
    """Points grouped by ``num_sms``, in the order the run met them."""
    groups: Dict[Any, List[Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault(p["num_sms"], []).append(p)
    return groups


# Line and marker per series kind: logical / NVLink bytes and p50 / p99 differ in both, so series stay
# apart under their markers and a single point (one token count) is still visible and named.
PLOT_STYLES = {
    "logical": dict(linestyle="-", marker="o"), "nvlink": dict(linestyle="--", marker="s", markerfacecolor="none"),
    "p50": dict(linestyle="-", marker="o"), "p99": dict(linestyle=":", marker="^", markerfacecolor="none"),
}


def write_plot(path: str, meta: Dict[str, Any], points: Sequence[Dict[str, Any]]) -> None:
    """Bandwidth and latency against tokens per rank, one figure with two panels, each with its legend
    to its right (outside the data); one set of lines per SM count (``sms=...`` in the legend when the
    run had more than one). Series differ in colour (operation, SM count), line style and marker
    (:data:`PLOT_STYLES`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _sms_groups(points)
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(15, 4.5))
    ops = list(points[0]["latency_us"])
    for g, (sms, group) in enumerate(groups.items()):
        tokens = [p["tokens_per_rank"] for p in group]
        tag = f" sms={sms}" if len(groups) > 1 else ""
        for i, op in enumerate(EP_OPS):
            for kind in ("logical", "nvlink"):
                bw_ax.plot(tokens, [p["bandwidth_gbps"][op][kind] for p in group], color=f"C{g * len(EP_OPS) + i}",
                           label=f"{op} {kind}{tag}", **PLOT_STYLES[kind])
        for i, op in enumerate(ops):
            for stat in ("p50", "p99"):
                lat_ax.plot(tokens, [p["latency_us"][op][stat] for p in group], color=f"C{g * len(ops) + i}",
                            label=f"{op} {stat}{tag}", **PLOT_STYLES[stat])
    if meta.get("nvlink_ceiling_gbps"):
        bw_ax.axhline(meta["nvlink_ceiling_gbps"], color="gray", linestyle="-.", label="NVLink ceiling")
    for ax, ylabel in ((bw_ax, "GB/s per rank"), (lat_ax, "us (slowest rank)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle(f"ep_comm {meta.get('config')} backend={meta.get('backend')} ranks={meta.get('ranks')}"
                 f"{note_mark(points)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


class Progress(progress.Progress):
    """``ep_comm.bench``'s progress line: live (a TTY or ``--progress``) shows the iteration of the
    point; ``final`` prints one closing line per point. Both off is ``--quiet``."""

    def __init__(self, live: bool, final: bool, stream: TextIO = sys.stderr):
        super().__init__("ep_comm.bench", "{label}: iteration {done}/{total}", live=live, final=final, stream=stream)
