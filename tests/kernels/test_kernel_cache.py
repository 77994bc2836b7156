"""The on-disk kernel cache: a second process takes the kernels from it instead of compiling them, and
its key (``ep_comm.kernels.jit.SOURCES_DIGEST``) covers the device code only (``ep_comm/kernels`` and the
protocol constants the kernels compile in, ``ep_comm/contract/protocol.py``), so that editing host code
(``ep_comm/launching``, the backends, ...) keeps every cached kernel.

The process tests need a GPU (the simulator has no cache). To see the cold-start times of a first
process and of one after a host-side edit on a GPU machine::

    python -m pytest -s -p no:cacheprovider tests/kernels/test_kernel_cache.py -k host_edit
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ep_comm.kernels.jit import SOURCES_DIGEST, kernel, sources_digest
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM

REPO = Path(__file__).parent.parent.parent
PACKAGE = REPO / "ep_comm"

COUNT_CHILD = """
import json
import cupy as cp
import numpy as np
from ep_comm.launching.kernel_launches import Kernels
from ep_comm.kernels.count import count_kernel

k = Kernels(cp, num_ranks=2, num_experts=16, num_topk=4, max_tokens=64)
k.count(cp.asarray(np.arange(256).reshape(64, 4) % 16), stable=True, stream=0)
cp.cuda.runtime.deviceSynchronize()
print(json.dumps({"hits": sum(count_kernel.stats.cache_hits.values()),
                  "misses": sum(count_kernel.stats.cache_misses.values())}))
"""

EVERY_KERNEL_CHILD = """
import json
import cupy as cp
import ep_comm
from ep_comm.bench.kernels import Bench, parse_args
from ep_comm.kernels import combine, combine_bf16, count, receive, receive_count, routing_check, scatter

bench = Bench(cp, parse_args(["--tokens", "64", "--hidden", "256", "--experts", "16", "--topk", "4",
                              "--alignment", "4", "--warps-per-block", "2"]), 2)  # 2 SMs: 4 blocks
for launch, _ in bench.measurements().values():
    launch()
cp.cuda.runtime.deviceSynchronize()
modules = (combine, combine_bf16, count, receive, receive_count, routing_check, scatter)
kernels = {id(k): k for m in modules for k in vars(m).values() if hasattr(k, "stats")}
print(json.dumps({"package": ep_comm.__file__,
                  "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels.values()),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels.values())}))
"""


def in_new_process(script: str, cache_dir: Path, source_root: Path = REPO) -> dict:
    """The JSON line ``script`` prints last, run in a fresh process that imports ``ep_comm`` from
    ``source_root`` and caches kernels under ``cache_dir``; ``seconds``: the process's wall time."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(source_root), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    # from source_root: ``python -c`` puts the working directory first on sys.path
    run = subprocess.run([sys.executable, "-c", script], cwd=source_root, env=env, capture_output=True, text=True,
                         timeout=600)
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]), seconds=seconds)


def copy_of_the_package(root: Path) -> Path:
    """A copy of ``ep_comm`` (no bytecode, no cache) under ``root``; returns ``root``."""
    shutil.copytree(PACKAGE, root / "ep_comm", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def append_comment(path: Path) -> None:
    with path.open("a") as f:
        f.write("# an edit\n")


@pytest.mark.skipif(ENABLE_CUDASIM, reason="the CUDA simulator compiles nothing")
def test_second_process_loads_the_kernel_from_disk(tmp_path):
    first, second = (in_new_process(COUNT_CHILD, tmp_path) for _ in range(2))
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0)


@pytest.mark.skipif(ENABLE_CUDASIM, reason="the CUDA simulator compiles nothing")
def test_a_host_edit_keeps_every_cached_kernel(tmp_path):
    """Every kernel a dispatch and combine launch is compiled by a first process; after an edit of
    host code (``launching/kernel_launches.py``) a second process loads them all from the cache."""
    root = copy_of_the_package(tmp_path / "src")
    first = in_new_process(EVERY_KERNEL_CHILD, tmp_path / "cache", root)
    append_comment(root / "ep_comm" / "launching" / "kernel_launches.py")
    second = in_new_process(EVERY_KERNEL_CHILD, tmp_path / "cache", root)
    print(f"\ncold start: first process {first['seconds']:.1f} s ({first['misses']} kernels compiled), "
          f"after a host-side edit {second['seconds']:.1f} s ({second['hits']} from the cache, "
          f"{second['misses']} compiled)")
    assert Path(first["package"]).parent == root / "ep_comm"
    assert first["misses"] > 0 and first["hits"] == 0
    assert (second["hits"], second["misses"]) == (first["misses"], 0)


def test_the_cache_key_covers_device_code_only(tmp_path):
    """Host modules are outside the key; ``ep_comm/kernels/*.py`` (the Numba shim ``numba_internals.py``
    included, as it lives there) and ``contract/protocol.py`` are inside."""
    root = copy_of_the_package(tmp_path) / "ep_comm"
    assert sources_digest(root) == SOURCES_DIGEST == sources_digest(PACKAGE)
    for host_module in ("launching/kernel_launches.py", "launching/bound.py", "transport/signals.py",
                        "contract/checks.py", "backends/nvshmem/backend.py"):
        append_comment(root / host_module)
    assert sources_digest(root) == SOURCES_DIGEST
    for device_module in ("kernels/warp.py", "kernels/numba_internals.py", "contract/protocol.py"):
        before = sources_digest(root)
        append_comment(root / device_module)
        assert sources_digest(root) != before, device_module


def test_device_modules_import_only_device_modules():
    """``ep_comm/kernels`` imports nothing of ep_comm's host side (whose edits the cache key ignores): only
    ``ep_comm.kernels.*`` and the protocol constants ``ep_comm.contract.protocol``, both inside the key."""
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else [f"relative import level {node.level}"]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "ep_comm" or name.startswith("relative"):
                    assert name.startswith("ep_comm.kernels.") or name == "ep_comm.contract.protocol", (path.name, name)


def test_the_uncached_kernels_modules_import_neither_nvshmem_nor_numba():
    """The NVSHMEM puts kernels (outside the disk cache) compile on first use, the signal kernels are CUDA C
    text: importing their modules and the puts' host side loads neither NVSHMEM nor Numba."""
    script = ("import sys, ep_comm.kernels.puts, ep_comm.kernels.signal_wait, ep_comm.transport.nvshmem_puts; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nvshmem', 'numba')))")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == "[]"


def test_kernel_refuses_a_function_defined_outside_the_package():
    def outside(x):
        x[0] = 1

    with pytest.raises(ValueError, match="fn=.*outside.*caches only kernels defined in"):
        kernel(outside)
