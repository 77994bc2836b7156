"""Nsight Compute over one rank's eager chain: ``python -m ep_comm.bench.kernel_profile --config CONFIG [--out DIR]
[-- BENCH ARGS]``.

Runs ``python -m ep_comm.bench --config CONFIG --no-graphs ...`` (one process: one rank) under ``ncu`` with the
metrics below, skips the first ``--launch-skip`` kernel launches (compilation, warm-up) and profiles the next
``--launch-count``, then prints one line per kernel and launch shape: launches profiled, median time (us), DRAM and
SM throughput (% of peak), achieved occupancy (% of the SM's warps), registers per thread, grid and block. It
writes ncu's own CSV (``ncu_CONFIG.csv``, with its stderr in ``ncu_CONFIG.err``) and the summary
(``kernels_CONFIG.csv``, ``kernels_CONFIG.json``) into ``--out``. ``--parse FILE`` summarises a CSV written
before, without a GPU.

ncu serialises the launches, flushes the caches before each (``--cache-control all``) and locks the clocks to
base (``--clock-control base``) unless ``--ncu-arg`` says otherwise: its times run above a graph replay's.
Compare kernels with each other, and one kernel before and after a change, in the same call.
``ncu`` is ``--ncu``, else ``$NCU``, else ``ncu`` on the PATH, else ``/usr/local/cuda/bin/ncu``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# (column, ncu metric) of the summary, in print order
METRICS: Tuple[Tuple[str, str], ...] = (
    ("time_us", "gpu__time_duration.sum"),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("registers", "launch__registers_per_thread"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
)
TIME_METRIC = METRICS[0][1]
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
DEFAULT_NCU = "/usr/local/cuda/bin/ncu"
BENCH_ARGS = ("--iters", "6", "--warmup", "2", "--no-graphs", "--no-busy-check", "--no-baselines", "--quiet")
EXIT_NO_NCU, EXIT_NO_ROWS = 2, 1


class NcuMissing(RuntimeError):
    """No Nsight Compute binary where the profile looks for one."""


@dataclass
class Launch:
    """One profiled kernel launch: ncu's launch ``id``, the kernel's short name and its metric values."""

    id: str
    kernel: str
    values: Dict[str, float]


@dataclass
class KernelRow:
    """One line of the summary: a kernel at one launch shape, the median of each metric over its ``launches``."""

    kernel: str
    launches: int
    time_us: float
    dram_pct: float
    sm_pct: float
    occupancy_pct: float
    registers: float
    grid: float
    block: float


def find_ncu(explicit: Optional[str] = None) -> str:
    """The ncu binary: ``explicit``, else ``$NCU``, else ``ncu`` on the PATH, else :data:`DEFAULT_NCU`; raises
    :class:`NcuMissing` naming every place looked at when none is an executable file."""
    tried = [c for c in (explicit, os.environ.get("NCU"), shutil.which("ncu"), DEFAULT_NCU) if c]
    for candidate in tried:
        found = shutil.which(candidate)
        if found:
            return found
    raise NcuMissing("Nsight Compute (ncu) not found: looked at " + ", ".join(tried or [DEFAULT_NCU]) +
                     "; give --ncu PATH or set NCU (it ships with the CUDA toolkit, in the device image at "
                     f"{DEFAULT_NCU})")


def ncu_command(ncu: str, config: str, bench_args: Sequence[str], skip: int, count: int,
                ncu_args: Sequence[str] = ()) -> List[str]:
    """The command line: ``ncu`` with the summary's metrics as CSV in base units over ``count`` launches after
    ``skip``, around one rank of the bench on ``config`` (eager chain only) with ``bench_args`` after it."""
    metrics = ",".join(name for _, name in METRICS)
    return [ncu, "--target-processes", "all", "--launch-skip", str(skip), "--launch-count", str(count),
            "--metrics", metrics, "--csv", "--print-units", "base", *ncu_args,
            sys.executable, "-m", "ep_comm.bench", "--config", config, *BENCH_ARGS, *bench_args]


def short_name(name: str) -> str:
    """A kernel's name without its namespaces, ABI tags, template and parameter lists
    (``cudapy::ep_comm::kernels::count::count_kernel[abi:...](Array<...>)`` -> ``count_kernel``)."""
    cut = len(name)
    for mark in "([<":
        at = name.find(mark)
        if at > 0:
            cut = min(cut, at)
    return name[:cut].rsplit("::", 1)[-1].strip() or name


def metric_value(text: str, unit: str, metric: str) -> float:
    """A metric's value as a float (thousands separators dropped; NaN when ncu gave none), the time in us."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return math.nan
    if metric == TIME_METRIC:
        value *= TO_US.get(unit.strip().lower(), 1e-3)  # base units: ns
    return value


def parse_csv(text: str) -> List[Launch]:
    """The launches of ncu's ``--csv`` output (one row per launch and metric, after any ``==PROF==`` lines),
    in launch order."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Name" in r), None)
    if start is None:
        return []
    header = rows[start]
    at = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
    unit_at = header.index("Metric Unit") if "Metric Unit" in header else None
    launches: Dict[str, Launch] = {}
    for row in rows[start + 1:]:
        if len(row) != len(header):
            continue
        launch_id = row[at["ID"]]
        launch = launches.setdefault(launch_id, Launch(launch_id, short_name(row[at["Kernel Name"]]), {}))
        metric = row[at["Metric Name"]]
        unit = row[unit_at] if unit_at is not None else ""
        launch.values[metric] = metric_value(row[at["Metric Value"]], unit, metric)
    return list(launches.values())


def median(values: List[float]) -> float:
    """The median of the values that are numbers, NaN when none is."""
    numbers = [v for v in values if not math.isnan(v)]
    return statistics.median(numbers) if numbers else math.nan


def summarize(launches: Sequence[Launch]) -> List[KernelRow]:
    """One :class:`KernelRow` per kernel and launch shape (grid, block), in order of first launch."""
    groups: Dict[Tuple[str, float, float], List[Launch]] = {}
    for launch in launches:
        grid, block = (launch.values.get(name, math.nan) for name in ("launch__grid_size", "launch__block_size"))
        groups.setdefault((launch.kernel, grid, block), []).append(launch)
    out = []
    for (kernel, _, _), group in groups.items():
        medians = {column: median([g.values.get(name, math.nan) for g in group]) for column, name in METRICS}
        out.append(KernelRow(kernel=kernel, launches=len(group), **medians))
    return out


def format_table(rows: Sequence[KernelRow]) -> str:
    """The summary as text, one line per row."""
    width = max([len("kernel")] + [len(r.kernel) for r in rows])
    heads = ("time us", "DRAM %", "SM %", "occ %", "regs", "grid", "block")
    lines = [f"{'kernel':{width}s} {'n':>3s} " + " ".join(f"{h:>8s}" for h in heads)]
    for r in rows:
        values = (r.time_us, r.dram_pct, r.sm_pct, r.occupancy_pct, r.registers, r.grid, r.block)
        cells = [f"{v:8.1f}" for v in values[:4]] + [f"{v:8.0f}" for v in values[4:]]
        lines.append(f"{r.kernel:{width}s} {r.launches:3d} " + " ".join(cells))
    return "\n".join(lines)


def write_summary(out_dir: Path, config: str, rows: Sequence[KernelRow]) -> Tuple[Path, Path]:
    """``kernels_CONFIG.csv`` and ``kernels_CONFIG.json`` under ``out_dir`` (made if missing); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table, record = out_dir / f"kernels_{config}.csv", out_dir / f"kernels_{config}.json"
    fields = list(asdict(rows[0]).keys()) if rows else ["kernel"]
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    record.write_text(json.dumps({"config": config, "metrics": dict(METRICS),
                                  "kernels": [asdict(r) for r in rows]}, indent=2) + "\n")
    return table, record


def run_ncu(command: Sequence[str], out_dir: Path, config: str, timeout_s: float) -> Tuple[str, int]:
    """Run ``command``; ncu's CSV (stdout) to ``ncu_CONFIG.csv``, stderr to ``ncu_CONFIG.err`` under ``out_dir``.
    Returns the CSV text and the exit status (124 when the timeout ended it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, status = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as late:
        stdout, stderr, status = _text(late.stdout), _text(late.stderr), 124
    (out_dir / f"ncu_{config}.csv").write_text(stdout)
    (out_dir / f"ncu_{config}.err").write_text(stderr)
    return stdout, status


def _text(data: object) -> str:
    """What a timed-out process wrote, as text."""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data if isinstance(data, str) else ""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ep_comm.bench.kernel_profile", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="deepseek_v3_decode", help="the bench's config (default: %(default)s)")
    p.add_argument("--out", default="results/kernel_profile", help="directory of the CSV/JSON (default: %(default)s)")
    p.add_argument("--ncu", help=f"ncu binary (default: $NCU, ncu on the PATH, {DEFAULT_NCU})")
    p.add_argument("--launch-skip", type=int, default=150, help="launches not profiled first (default: %(default)s)")
    p.add_argument("--launch-count", type=int, default=40, help="launches profiled (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (default: %(default)s)")
    p.add_argument("--ncu-arg", action="append", default=[], metavar="ARG",
                   help="one more ncu option, e.g. --ncu-arg=--clock-control --ncu-arg=none (repeatable)")
    p.add_argument("--parse", metavar="CSV", help="summarise this ncu CSV instead of running ncu")
    p.add_argument("bench_args", nargs="*", help="after --: more `python -m ep_comm.bench` options (--tokens 128)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    out_dir = Path(a.out)
    status = 0
    if a.parse:
        text = Path(a.parse).read_text()
    else:
        try:
            ncu = find_ncu(a.ncu)
        except NcuMissing as missing:
            print(f"error: {missing}", file=sys.stderr)
            return EXIT_NO_NCU
        command = ncu_command(ncu, a.config, a.bench_args, a.launch_skip, a.launch_count, a.ncu_arg)
        print("$ " + " ".join(command), flush=True)
        text, status = run_ncu(command, out_dir, a.config, a.timeout)
        if status != 0:
            print(f"ncu exited with status {status}: see {out_dir / f'ncu_{a.config}.err'}", file=sys.stderr)
    rows = summarize(parse_csv(text))
    if not rows:
        print("error: no kernel rows in ncu's output (see the .err file next to the CSV)", file=sys.stderr)
        return EXIT_NO_ROWS
    print(format_table(rows))
    table, record = write_summary(out_dir, a.config, rows)
    print(f"wrote {table} and {record}")
    return status


if __name__ == "__main__":
    sys.exit(main())
