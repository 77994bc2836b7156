"""A second process takes the kernels from the on-disk cache instead of compiling them (GPU only: the
simulator has no cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numba.cuda.core import config

REPO = Path(__file__).parent.parent.parent

CHILD = """
import json
import cupy as cp
import numpy as np
from ep_comm.kernels.api import Kernels
from ep_comm.kernels.count import count_kernel

k = Kernels(cp, num_ranks=2, num_experts=16, num_topk=4, max_tokens=64)
k.count(cp.asarray(np.arange(256).reshape(64, 4) % 16), stable=True)
cp.cuda.runtime.deviceSynchronize()
print(json.dumps({"hits": sum(count_kernel.stats.cache_hits.values()),
                  "misses": sum(count_kernel.stats.cache_misses.values())}))
"""


def count_in_new_process(cache_dir: Path) -> dict:
    """Cache hits and misses of the count kernel in a fresh process caching under ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(config.ENABLE_CUDASIM, reason="the CUDA simulator compiles nothing")
def test_second_process_loads_the_kernel_from_disk(tmp_path):
    assert count_in_new_process(tmp_path) == {"hits": 0, "misses": 1}
    assert count_in_new_process(tmp_path) == {"hits": 1, "misses": 0}
