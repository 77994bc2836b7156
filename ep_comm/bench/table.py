"""The README's performance table, generated from recorded benchmark results.

    python -m ep_comm.bench.table RESULT.json [RESULT.json ...] [--out FILE]

Each ``RESULT.json`` is a ``python -m ep_comm.bench --json`` file (``{"meta": ..., "points": [...]}``).
The files must come from one recorded run: the same git commit, clean (no uncommitted changes), the same
GPU. The table has one row per point (config, marked ``fp8`` for a ``--fp8`` run, ranks, tokens per rank); under it, a line names the
commit, the GPU, each file's command and whether the ranks shared a GPU. Exit status 2 when the files
disagree, are not bench results, or cannot be read.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ep_comm.bench.eager import EAGER_GRAPH, eager_over_graph

__all__ = ["ResultError", "load_results", "markdown_table", "main"]

COLUMNS = ("config", "ranks", "tokens/rank", "eager dispatch p50 / p99 (us)", "eager cached dispatch p50 / p99 (us)",
           "eager combine p50 / p99 (us)", "graph dispatch cached / new p50 (us)", "graph combine p50 (us)",
           "eager / graph p50: dispatch new / cached / combine", "first call (us)",
           "host us per call: dispatch cached / new / combine", "dispatch logical / NVLink GB/s",
           "NCCL dedup p50 (us)", "same-run device copy p50 (us)")
SAME_RUN = ("git_commit", "gpu")  # meta fields every file of one recorded run shares


class ResultError(ValueError):
    """A results file that cannot make the table (unreadable, not a bench result, not of the same run)."""


def load_results(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The bench results at ``paths``, checked to come from one recorded run.

    Args:
        paths: ``python -m ep_comm.bench --json`` files.

    Returns:
        One ``{"meta": dict, "points": list}`` per path, in order.

    Raises:
        ResultError: a file that cannot be read or is not a bench result, a file from a dirty checkout
            or without a commit, or files whose commit or GPU differ (the message names the field).
    """
    results = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ResultError(f"{path}: cannot read a bench result ({exc})") from exc
        if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not data.get("points"):
            raise ResultError(f"{path}: not a `python -m ep_comm.bench --json` result (no meta and points)")
        meta = data["meta"]
        if not meta.get("git_commit") or meta.get("git_dirty", True):
            note = f" ({meta['git_commit_note']})" if meta.get("git_commit_note") else ""
            raise ResultError(f"{path}: git_commit={meta.get('git_commit')!r} git_dirty={meta.get('git_dirty')!r}: "
                             f"the table comes from a run of a clean, committed checkout{note}")
        results.append(data)
    first = results[0]["meta"]
    for path, data in zip(paths[1:], results[1:]):
        for field in SAME_RUN:
            if data["meta"].get(field) != first.get(field):
                raise ResultError(f"{path}: {field}={data['meta'].get(field)!r} but {paths[0]} has "
                                 f"{first.get(field)!r}: the table comes from one recorded run")
    return results


def _p50_p99(stats: Optional[Dict[str, Any]]) -> str:
    return "" if not stats else f"{stats['p50']:.1f} / {stats['p99']:.1f}"


def _p50(stats: Optional[Dict[str, Any]]) -> str:
    return "" if not stats else f"{stats['p50']:.1f}"


def _joined(*values: str) -> str:
    """``a / b / c``, ``-`` for a missing one; empty when all are."""
    return " / ".join(v or "-" for v in values) if any(values) else ""


def _ratios(point: Dict[str, Any]) -> str:
    """Eager over graph p50 per operation (:data:`ep_comm.bench.eager.EAGER_GRAPH`), from the point's figures (so
    results recorded before the field existed have it too)."""
    ratios = eager_over_graph(point["latency_us"], point.get("graph_us", {}))
    return _joined(*(f"{ratios[op]:.1f}x" if op in ratios else "" for op in EAGER_GRAPH))


def _row(meta: Dict[str, Any], point: Dict[str, Any]) -> List[str]:
    lat, graph, host = point["latency_us"], point.get("graph_us", {}), point.get("host_us", {})
    bandwidth = point["bandwidth_gbps"]["dispatch"]
    return [f"`{meta['config']}`" + (" fp8" if meta.get("fp8") else ""), str(meta["ranks"]), str(point["tokens_per_rank"]),
            _p50_p99(lat["dispatch"]), _p50_p99(lat.get("dispatch_cached")), _p50_p99(lat["combine"]),
            _joined(_p50(graph.get("dispatch")), _p50(graph.get("dispatch_new"))), _p50(graph.get("combine")),
            _ratios(point), f"{point['first_call_us']:.1f}" if "first_call_us" in point else "",
            _joined(*(_p50(host.get(op)) for op in ("dispatch_cached_async", "dispatch_new_async", "combine"))),
            f"{bandwidth['logical']:.1f} / {bandwidth['nvlink']:.1f}", _nccl(meta, lat), _p50(lat.get("device_copy"))]


def _nccl(meta: Dict[str, Any], latency: Dict[str, Any]) -> str:
    if "nccl_dedup" in latency:
        return _p50(latency["nccl_dedup"])
    return "skipped" if str(meta.get("baselines", "")).startswith("skipped") else ""


def _source_line(results: Sequence[Dict[str, Any]]) -> str:
    meta = results[0]["meta"]
    commands = "; ".join(f"`{r['meta'].get('command', r['meta']['config'])}`" for r in results)
    shared = [r["meta"]["config"] for r in results if r["meta"].get("shared_gpu")]
    note = f" Ranks shared one GPU in {', '.join(shared)}: not NVLink figures." if shared else ""
    return (f"Generated by `python -m ep_comm.bench.table` from one recorded run at commit "
            f"{meta['git_commit'][:7]} on {meta.get('gpu') or 'an unnamed GPU'}: {commands}.{note}")


def markdown_table(results: Sequence[Dict[str, Any]]) -> str:
    """The performance table of ``results`` (from :func:`load_results`) in Markdown, with its source line.

    Args:
        results: bench results of one recorded run.

    Returns:
        The table, a blank line and the line naming the commit, the GPU and the commands.
    """
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for result in results:
        for point in result["points"]:
            lines.append("| " + " | ".join(_row(result["meta"], point)) + " |")
    return "\n".join(lines) + "\n\n" + _source_line(results) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ep_comm.bench.table",
                            description="The README's performance table from recorded `ep_comm.bench --json` runs.")
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="bench results of one recorded run")
    parser.add_argument("--out", metavar="FILE", help="write the table here instead of stdout")
    args = parser.parse_args(argv)
    try:
        table = markdown_table(load_results(args.results))
        if args.out:
            Path(args.out).write_text(table)
        else:
            sys.stdout.write(table)
    except ResultError as exc:
        print(f"python -m ep_comm.bench.table: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"python -m ep_comm.bench.table: --out {args.out}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
