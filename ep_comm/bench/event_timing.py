"""Timing GPU work with CUDA events behind a hold: :class:`CupyTiming` (streams, events and the hold through
CuPy) and :func:`time_launch` (one launch, timed on the GPU and on the host) for ``python -m ep_comm.bench.kernels``.

The timed launches queue up behind a sleeping kernel (the hold), so the events time the kernels alone, not the
host preparing each launch on an idle GPU (that cost is the host time).
"""
from __future__ import annotations

import time
from typing import Any, Callable, ContextManager

import numpy as np

from ep_comm.kernels.sleep import sleep_kernel

HOLD_US_PER_ITER = 2000  # longer than any launch call takes on the host


class CupyTiming:
    """What the timing needs of CUDA, through CuPy: non-blocking streams, timing events, the hold.

    A stream of None is the current CuPy stream (the legacy default stream unless one is made current).
    The simulator tests use a host stand-in with the same methods.
    """

    def __init__(self, cp):
        self.cuda = cp.cuda

    def stream(self) -> Any:
        """A new non-blocking CuPy stream (it does not wait for the legacy default stream)."""
        return self.cuda.Stream(non_blocking=True)

    @staticmethod
    def numba_stream(stream: Any) -> Any:
        """The Numba stream that :class:`Kernels` launches on for a CuPy ``stream`` (None: 0, the default)."""
        from numba import cuda

        return 0 if stream is None or stream.ptr == 0 else cuda.external_stream(stream.ptr)

    @staticmethod
    def current(stream: Any) -> ContextManager[Any]:
        """Within the block CuPy's own work (allocations, copies) goes to ``stream``."""
        return stream

    def record(self, stream: Any = None) -> Any:
        """A timing event recorded now on ``stream``."""
        event = self.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""
        stream.wait_event(event)

    def hold(self, stream: Any, microseconds: int) -> None:
        """Keep ``stream`` busy for about ``microseconds`` (one sleeping thread), so that what is queued next
        runs back to back, not as fast as the host queues it."""
        sleep_kernel[1, 1, self.numba_stream(stream)](microseconds)

    @staticmethod
    def done(event: Any) -> bool:
        """Whether the GPU has passed ``event``."""
        return bool(event.done)

    def elapsed_us(self, start: Any, end: Any) -> float:
        """Microseconds from event ``start`` to event ``end`` (both finished)."""
        return self.cuda.get_elapsed_time(start, end) * 1e3

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""
        self.cuda.runtime.deviceSynchronize()


def time_launch(timing: CupyTiming, launch: Callable[[], None], warmup: int, iters: int) -> dict:
    """GPU time (events around each launch) and host time of the call, in microseconds."""
    for _ in range(warmup):
        launch()
    timing.synchronize()
    timing.hold(None, iters * HOLD_US_PER_ITER)
    events, host = [], []
    for _ in range(iters):
        start = timing.record()
        t0 = time.perf_counter()
        launch()
        host.append(time.perf_counter() - t0)
        events.append((start, timing.record()))
    timing.synchronize()
    gpu = np.array([timing.elapsed_us(s, e) for s, e in events])
    return {"gpu_us_p50": float(np.median(gpu)), "gpu_us_p99": float(np.percentile(gpu, 99)),
            "host_us_p50": float(np.median(host) * 1e6)}
