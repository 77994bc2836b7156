"""Opt-in per-phase timings of a backend (``Buffer(profile=True)``): host time, and GPU time where there are events.

Every rank keeps its own records (ranks differ: a rank's wait includes its peers' lag);
``Buffer.profile_table()`` reads them as one row per (operation, phase).
"""
from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager
from typing import Any, ContextManager, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

import numpy as np

_OFF = contextlib.nullcontext()  # every phase while profiling is off: one shared, reusable no-op context


class EventClock(Protocol):
    """Timing events on the device's stream (``CupyDevice``)."""

    def event(self) -> Any:
        """A recorded event on the current stream."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events (waits for ``end``)."""


class ProfileRow(NamedTuple):
    """One row of ``Buffer.profile_table()``: medians over the calls of one phase of one operation."""

    op: str  # "dispatch", "combine" or "close"
    phase: str  # e.g. "total", "signal+wait"
    calls: int
    host_us_p50: float  # median host microseconds (perf_counter)
    gpu_us_p50: Optional[float]  # median GPU microseconds (CUDA events); None without a GPU


class Profile:
    """Per-phase timings: host seconds always, GPU seconds when ``clock`` is given (events)."""

    def __init__(self, enabled: bool, clock: Optional[EventClock] = None):
        self.enabled = enabled
        self._clock = clock
        self._records: List[Tuple[str, str, float, Any, Any]] = []

    def phase(self, op: str, name: str) -> ContextManager[None]:
        """A context that times one phase of operation ``op`` (a shared no-op when profiling is off)."""
        return self._timed(op, name) if self.enabled else _OFF

    @contextmanager
    def _timed(self, op: str, name: str) -> Iterator[None]:
        start_event = self._event()
        start = time.perf_counter()
        yield
        self._records.append((op, name, time.perf_counter() - start, start_event, self._event()))

    def _event(self) -> Any:
        return None if self._clock is None else self._clock.event()

    def table(self) -> List[ProfileRow]:
        """One :class:`ProfileRow` per (operation, phase), in first-seen order (waits for the GPU events)."""
        samples: Dict[Tuple[str, str], List[Tuple[float, Optional[float]]]] = {}
        for op, name, host_s, start, end in self._records:
            gpu_s = None if start is None else self._clock.elapsed_s(start, end)
            samples.setdefault((op, name), []).append((host_s, gpu_s))
        return [_row(op, name, calls) for (op, name), calls in samples.items()]


def _row(op: str, name: str, calls: List[Tuple[float, Optional[float]]]) -> ProfileRow:
    host = float(np.median([h for h, _ in calls])) * 1e6
    gpu = None if calls[0][1] is None else float(np.median([g for _, g in calls])) * 1e6
    return ProfileRow(op, name, len(calls), host, gpu)
