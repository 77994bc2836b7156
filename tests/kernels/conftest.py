"""Kernel tests run the real kernels: on a GPU when there is one, else in the Numba CUDA simulator.

The simulator must be chosen before ``numba.cuda`` is first imported, hence the check at import.
"""
from __future__ import annotations

import os
import shutil
import sys

HAVE_GPU = shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")
if not HAVE_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba.cuda.core import config as _cuda_config  # noqa: E402

SIMULATED = bool(_cuda_config.ENABLE_CUDASIM)

if SIMULATED:
    sys.path.insert(0, os.path.dirname(__file__))
    import cudasim_warp  # noqa: E402

    cudasim_warp.install()


def pytest_collection_modifyitems(config, items):
    if SIMULATED or HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="numba.cuda was imported without the simulator before tests/kernels and there is no GPU")
    for item in items:
        if "tests/kernels" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def xp():
    """The array module kernels get: NumPy in the simulator, CuPy on a GPU."""
    if SIMULATED:
        return np
    import cupy

    return cupy
