"""The memory THIS process holds, sampled over a run, and the check that it stays flat (``ep_comm.soak``).

Metrics of a sample (bytes):

* ``rss_bytes``: host resident set size (``/proc/self/statm``); watched;
* GPU only, ``pool_used_bytes``: CuPy's default pool, bytes in use; watched;
* GPU only, ``pool_held_bytes``: the pool's bytes held (in use + cached free blocks); reported only;
* GPU only, ``process_device_bytes``: this process's device memory as NVML counts it (its context,
  the pool, the NVSHMEM heap: ``nvidia-smi --query-compute-apps=pid,used_memory`` for
  ``os.getpid()``); watched. Missing when NVML does not list this process with a figure: under
  CUDA MPS the MPS server holds the clients' memory, and in a container the PIDs may differ. Then
  the pool and RSS are what is watched, and :meth:`MemoryProbe.notes` says so;
* GPU only, ``gpu_wide_used_bytes``: the whole GPU's memory in use (total - free), every process on
  it included (the other ranks sharing the GPU, the MPS server); reported only, never watched.

The pool's free blocks are released before the device figures are read, so cached blocks do not count.
"""
from __future__ import annotations

import gc
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

MIB = 1 << 20
WATCHED = ("rss_bytes", "pool_used_bytes", "process_device_bytes")
GPU_WIDE_NOTE = ("gpu_wide_used_bytes counts every process on the GPU (other ranks sharing it, an MPS server): "
                 "reported, not checked")
COMPUTE_APPS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def compute_apps_csv() -> str:
    """NVML's processes with a GPU context: ``"pid, used MiB"`` lines (``[N/A]`` where NVML has no figure)."""
    return subprocess.run(COMPUTE_APPS_QUERY, capture_output=True, text=True, timeout=30, check=True).stdout


def process_used_bytes(compute_apps: str, pid: int) -> Optional[int]:
    """This process's device memory from :func:`compute_apps_csv` output.

    Args:
        compute_apps: ``"pid, used_memory"`` lines, used memory in MiB.
        pid: the process to add up (a process appears once per GPU it holds memory on).

    Returns:
        The bytes over all its lines, or None when no line of ``pid`` has a figure.
    """
    used = []
    for line in compute_apps.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            used.append(int(fields[1]) * MIB)
    return sum(used) if used else None


class MemoryProbe:
    """Samples the memory this process holds (the metrics of the module docstring).

    Args:
        gpu: sample the GPU metrics too (the nvshmem backend; CuPy's current device is this rank's).
        compute_apps: the NVML query, :func:`compute_apps_csv` (a stand-in in tests).
    """

    def __init__(self, gpu: bool, compute_apps: Callable[[], str] = compute_apps_csv):
        self.gpu = gpu
        self.compute_apps = compute_apps
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.unmeasured: Dict[str, int] = {}  # why process_device_bytes was missing -> in how many samples

    def rss_bytes(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def process_device_bytes(self) -> Optional[int]:
        """This process's device memory per NVML, None (the reason counted in ``unmeasured``) when unknown."""
        try:
            used = process_used_bytes(self.compute_apps(), os.getpid())
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"nvidia-smi failed: {type(exc).__name__}: {exc}"
        else:
            if used is not None:
                return used
            reason = (f"nvidia-smi lists no memory of pid {os.getpid()} (under CUDA MPS the MPS server holds it; "
                      "in a container the pids may differ)")
        self.unmeasured[reason] = self.unmeasured.get(reason, 0) + 1
        return None

    def sample(self) -> Dict[str, int]:
        """One sample: metric name -> bytes (``process_device_bytes`` only when NVML has it)."""
        gc.collect()
        out = {"rss_bytes": self.rss_bytes()}
        if self.gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            pool = cupy.get_default_memory_pool()
            out["pool_used_bytes"] = int(pool.used_bytes())
            out["pool_held_bytes"] = int(pool.total_bytes())
            pool.free_all_blocks()
            free, total = cupy.cuda.runtime.memGetInfo()
            out["gpu_wide_used_bytes"] = int(total - free)
            own = self.process_device_bytes()
            if own is not None:
                out["process_device_bytes"] = own
        return out

    def notes(self) -> List[str]:
        """What the samples do not show: the GPU-wide figure's scope, why a per-process figure was missing."""
        if not self.gpu:
            return []
        return [GPU_WIDE_NOTE] + [f"process_device_bytes not measured in {n} sample(s): {reason}; the CuPy pool "
                                  "and RSS are checked" for reason, n in self.unmeasured.items()]


@dataclass
class MemoryTrack:
    """Samples of one phase; ``baseline`` is the sample taken when the warm-up ended."""

    samples: List[Dict[str, int]] = field(default_factory=list)
    baseline: Optional[Dict[str, int]] = None

    def add(self, sample: Dict[str, int], is_baseline: bool = False) -> None:
        self.samples.append(sample)
        if is_baseline:
            self.baseline = sample

    def summary(self, tolerance_bytes: int) -> Dict[str, Dict[str, Any]]:
        """Per metric present in every sample: start, baseline, end, max (after the baseline), growth
        and whether it stayed within ``tolerance_bytes`` of the baseline (always ok for a metric not watched)."""
        out = {}
        if not self.samples:
            return out
        base = self.baseline or self.samples[0]
        after = self.samples[self.samples.index(base):]
        for name in [n for n in self.samples[0] if all(n in s for s in self.samples)]:
            peak = max(s[name] for s in after)
            growth = peak - base[name]
            out[name] = {"start": self.samples[0][name], "baseline": base[name], "end": self.samples[-1][name],
                         "max": peak, "growth": growth,
                         "ok": name not in WATCHED or growth <= tolerance_bytes}
        return out


def memory_failures(phase: str, summary: Dict[str, Dict[str, Any]], tolerance_bytes: int) -> List[str]:
    """One failure line per watched metric of ``summary`` (:meth:`MemoryTrack.summary`) that grew too much."""
    return [f"{phase}: {name} grew by {m['growth'] / MIB:.1f} MiB after warm-up (baseline {m['baseline'] / MIB:.1f} "
            f"MiB, max {m['max'] / MIB:.1f} MiB; tolerance {tolerance_bytes / MIB:g} MiB)"
            for name, m in summary.items() if not m["ok"]]
