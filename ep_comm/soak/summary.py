"""The soak's summary: every rank's phase results gathered to rank 0, and the lines it prints."""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from ep_comm.soak.memory import MIB
from ep_comm.transport import wait_stats

MAX_REPORTED_FAILURES = 20  # failure lines kept in the summary (all ranks; the count covers all)


def summarize(comm: MPI.Comm, meta: Dict[str, Any], phases: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Gather every rank's phase results to rank 0: failures merged, per-rank memory kept."""
    gathered = comm.gather(phases, root=0)
    if comm.rank != 0:
        return None
    summary = dict(meta)
    failures = [f for rank_phases in gathered for p in rank_phases.values() for f in p["failures"]]
    for name in phases:
        per_rank = [g[name] for g in gathered]
        merged = {k: v for k, v in per_rank[0].items() if k not in ("failures", "memory", "digest", "wait_table")}
        tables = [p.get("wait_table") for p in per_rank]
        if tables and all(t is not None for t in tables):  # every rank's Buffer.wait_stats() at the phase's end
            merged["wait_stats"] = wait_stats.summary([np.array(t, dtype=np.int64) for t in tables])
        merged["elapsed_s"] = max(p["elapsed_s"] for p in per_rank)
        for key in ("memory", "digest"):
            if key in per_rank[0]:
                merged[key] = {f"rank{r}": p[key] for r, p in enumerate(per_rank)}
        merged["failures"] = sum(len(p["failures"]) for p in per_rank)
        summary[name] = merged
    summary["ok"] = not failures
    summary["failures"] = {"count": len(failures), "first": failures[:MAX_REPORTED_FAILURES]}
    return summary


def print_summary(summary: Dict[str, Any]) -> None:
    """A few lines on stdout: one per phase, then the first failures."""
    for name in ("soak", "determinism", "create_close"):
        if name in summary:
            p = summary[name]
            mem = "; ".join(f"{r}: " + ", ".join(f"{k.replace('_bytes', '')} {m['start'] / MIB:.0f}->"
                                                 f"{m['end'] / MIB:.0f} (max {m['max'] / MIB:.0f}) MiB"
                                                 for k, m in metrics.items())
                            for r, metrics in p.get("memory", {}).items())
            print(f"[ep_comm.soak] {name}: {p['failures']} failures in {p['elapsed_s']:.1f} s"
                  f"{'; memory ' + mem if mem else ''}", flush=True)
            for note in p.get("memory_notes", []):
                print(f"[ep_comm.soak] {name}: memory: {note}", flush=True)
            if "wait_stats" in p:
                print(f"[ep_comm.soak] {name}: {wait_stats.straggler_line(p['wait_stats'])}", flush=True)
    for line in summary["failures"]["first"]:
        print(f"[ep_comm.soak] FAILED {line}", flush=True)
    print(f"[ep_comm.soak] {'OK' if summary['ok'] else 'FAILED'}", flush=True)
