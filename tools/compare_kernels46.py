"""Tables of ``tools/measure_kernels46.sh``'s results: ``python tools/compare_kernels46.py OUT_DIR``.

Per shape (T=128, T=4096): one row per kernel measurement of ``python -m ep_comm.bench.kernels``, one column per
variant (GPU p50 us, CUDA events), the last column ``new`` over ``old``. Then, per config, the ncu profiles
(``python -m ep_comm.bench.kernel_profile``) of each profiled variant side by side: time us, DRAM %, occupancy %,
registers; then the tail of each chain run's report (whole ops, graph replays).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List

ORDER = ("old", "new", "no_count_cut", "no_one_fence", "no_warp_fold", "no_recv_loads", "no_bounds", "no_slots_in_rows",
         "no_count_in_copy", "no_count_apart", "regs80", "regs64", "reduce128", "count1024", "count16x1", "pdl")


def _rank(variant: str) -> int:
    return ORDER.index(variant) if variant in ORDER else len(ORDER)


def kernel_tables(out: Path) -> List[str]:
    lines: List[str] = []
    runs: Dict[str, Dict[str, dict]] = {}  # T -> variant -> {name: p50}
    for path in sorted(out.glob("kernels_*_T*.json")):
        m = re.fullmatch(r"kernels_(.+)_T(\d+)\.json", path.name)
        if not m:
            continue
        rows = json.loads(path.read_text())["results"]
        runs.setdefault(m.group(2), {})[m.group(1)] = {r["name"]: r["gpu_us_p50"] for r in rows}
    for tokens in sorted(runs, key=int):
        variants = sorted(runs[tokens], key=_rank)
        names: List[str] = []
        for v in variants:
            names += [n for n in runs[tokens][v] if n not in names]
        width = max(len(n) for n in names)
        lines.append(f"\nT={tokens}: GPU p50 us (CUDA events, python -m ep_comm.bench.kernels)")
        lines.append(f"{'kernel':{width}s} " + " ".join(f"{v:>13s}" for v in variants) + "  new/old")
        for n in names:
            cells = [runs[tokens][v].get(n) for v in variants]
            text = " ".join(f"{c:13.1f}" if c is not None else f"{'-':>13s}" for c in cells)
            old, new = runs[tokens].get("old", {}).get(n), runs[tokens].get("new", {}).get(n)
            ratio = f"{new / old:8.2f}" if old and new else ""
            lines.append(f"{n:{width}s} {text} {ratio}")
    return lines


def profile_tables(out: Path) -> List[str]:
    lines: List[str] = []
    found: Dict[str, Dict[str, list]] = {}  # config -> variant -> rows
    for path in sorted(out.glob("profile_*/kernels_*.json")):
        variant = path.parent.name[len("profile_"):]
        record = json.loads(path.read_text())
        found.setdefault(record["config"], {})[variant] = record["kernels"]
    for config, by_variant in found.items():
        lines.append(f"\nncu profile, {config}: time us / DRAM % / occupancy % / registers (grid)")
        for variant in sorted(by_variant, key=_rank):
            lines.append(f"  {variant}:")
            for r in by_variant[variant]:
                lines.append(f"    {r['kernel']:34s} {r['time_us']:8.1f} {r['dram_pct']:6.1f} {r['occupancy_pct']:6.1f} "
                             f"{r['registers']:5.0f} ({r['grid']:.0f}x{r['block']:.0f})")
    return lines


def chain_reports(out: Path) -> List[str]:
    """The last lines of each chain run's log (the bench's own report), variant by variant."""
    lines: List[str] = []
    for path in sorted(out.glob("chain_*.log"), key=lambda p: (p.name.split("_deepseek")[0], p.name)):
        tail = path.read_text(errors="replace").strip().splitlines()[-24:]
        lines += [f"\n{path.name}:"] + [f"  {t}" for t in tail]
    return lines


def main(out_dir: str) -> None:
    out = Path(out_dir)
    lines = kernel_tables(out) + profile_tables(out) + chain_reports(out)
    print("\n".join(lines) if lines else f"no results under {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/kernels46")
