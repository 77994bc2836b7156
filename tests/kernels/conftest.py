"""Kernel tests run the real kernels: on a GPU when there is one, else in the Numba CUDA simulator.

The simulator is chosen, and its warp intrinsics installed, by the root ``tests/conftest.py``
before ``numba.cuda`` is first imported.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.cudasim_warp import HAVE_GPU

from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED


def pytest_collection_modifyitems(config, items):
    if SIMULATED or HAVE_GPU:
        return
    skip = pytest.mark.skip(
        reason="numba.cuda was imported without the simulator before tests/kernels and there is no GPU")
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
