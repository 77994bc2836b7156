"""Host stand-in for ``ep_comm.bench.event_timing.CupyTiming`` in the Numba CUDA simulator, whose kernels run to the
end at launch and which has no streams of its own: a stream is a plain object (Numba stream 0), an event the
host time at its record, and waits, the hold and synchronisation do nothing."""
from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager


class HostTiming:
    """The methods of ``CupyTiming``, on the host; ``done`` says False, as if the hold had lasted."""

    @staticmethod
    def stream() -> Any:
        return object()

    @staticmethod
    def numba_stream(stream: Any) -> int:
        return 0

    @staticmethod
    def current(stream: Any) -> ContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def record(stream: Any = None) -> float:
        return time.perf_counter()

    @staticmethod
    def wait(stream: Any, event: float) -> None:
        pass

    @staticmethod
    def hold(stream: Any, microseconds: int) -> None:
        pass

    @staticmethod
    def done(event: float) -> bool:
        return False

    @staticmethod
    def elapsed_us(start: float, end: float) -> float:
        return (end - start) * 1e6

    @staticmethod
    def synchronize() -> None:
        pass
