"""Numba's low-occupancy warning, silenced for ep_comm's own launches.

Numba-CUDA warns ``NumbaPerformanceWarning: Grid size N will likely result in GPU under-utilization
due to low occupancy`` for every launch of fewer than 128 blocks. ep_comm's small grids are
deliberate (``num_sms`` sizes them, and decode sizes have few rows), so the warning is noise on
every GPU run. :func:`quiet_low_occupancy` ignores exactly that category and message while an
ep_comm launch is configured; the user's own launches keep the warning.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

from numba.cuda.core.errors import NumbaPerformanceWarning  # the class numba-cuda's dispatcher warns with

# matched at the message's start, after the terminal colour codes that Numba's highlighting puts first
# wherever a colour package (termcolor, colorama) is installed
LOW_OCCUPANCY = r"(?:\x1b\[[0-9;]*m)*Grid size \d+ will likely result in GPU under-utilization"


@contextmanager
def quiet_low_occupancy() -> Iterator[None]:
    """Inside: Numba's low-occupancy ``NumbaPerformanceWarning`` is ignored; every other warning,
    other performance warnings included, is kept. The filters are restored on exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LOW_OCCUPANCY, category=NumbaPerformanceWarning)
        yield
