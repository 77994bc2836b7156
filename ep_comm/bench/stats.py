"""Per-rank percentiles of the benchmark's timings, and the slowest rank's (a collective ends with its last rank)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np


def percentiles(times_per_rank: Sequence[Sequence[float]]) -> Dict[str, Any]:
    """``{"p50", "p99"}`` in us of the slowest rank, and ``p50_per_rank`` / ``p99_per_rank``, from seconds per
    iteration of each rank."""
    p50 = [float(np.percentile(t, 50)) * 1e6 for t in times_per_rank]
    p99 = [float(np.percentile(t, 99)) * 1e6 for t in times_per_rank]
    return {"p50": max(p50), "p99": max(p99), "p50_per_rank": p50, "p99_per_rank": p99}
