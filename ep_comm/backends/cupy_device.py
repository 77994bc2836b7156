"""``CupyDevice``: the nvshmem backend's handle on its GPU through CuPy (GPU only: imports CuPy and Numba-CUDA).

The caller's current stream (every launch is enqueued there), Numba's launch settings, one-sync
reads of small counts, device-mapped pinned memory, the allocator hold of a captured call, and
CUDA-graph capture detection. ``tests/test_nvshmem_host.py`` has a host twin for the simulator.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ContextManager, Dict, Iterator, List, Tuple

import cupy
import numpy as np
from numba import cuda

from ..numba_internals import interface_sync_disabled
from ..transport.nvshmem import numba_view
from ..transport.signals import mapped_int64

_DEVICE_TO_HOST = 2  # cudaMemcpyKind


class CupyDevice:
    """CUDA device ``device`` (ordinal) of one rank; ``num_local``: local experts (sizes the count reads)."""

    xp = cupy

    def __init__(self, device: int, num_local: int):
        self.device = device
        self._streams: Dict[int, Any] = {}
        self._sent: Any = None  # the event of mark(), made at the first split step
        self._pinned = cupy.cuda.alloc_pinned_memory(4 * (2 + num_local))
        self._host = np.frombuffer(self._pinned, dtype=np.int32, count=2 + num_local)

    @staticmethod
    def count() -> int:
        """The number of CUDA devices CuPy sees."""
        return int(cupy.cuda.runtime.getDeviceCount())

    def sm_count(self) -> int:
        """The number of SMs (``MultiProcessorCount``) of the device, e.g. 132 on an H200."""
        return int(cupy.cuda.Device(self.device).attributes["MultiProcessorCount"])

    def kernel_array(self, a: Any) -> Any:
        """A kernel argument made once: the Numba device array of CuPy array ``a`` (zero copy)."""
        return numba_view(a)

    def stream(self) -> Any:
        """The Numba stream of the current CuPy stream (0: the legacy default stream)."""
        ptr = cupy.cuda.get_current_stream().ptr
        if ptr == 0:
            return 0
        if ptr not in self._streams:
            self._streams[ptr] = cuda.external_stream(ptr)
        return self._streams[ptr]

    def launching(self) -> ContextManager[None]:
        """Numba skips the CUDA-array-interface stream sync while we launch on the caller's stream."""
        return interface_sync_disabled()

    def synchronize(self) -> None:
        """Wait for the current stream."""
        cupy.cuda.get_current_stream().synchronize()

    def mapped_int64(self, count: int, fill: int) -> tuple:
        """``(host, device)`` views of ``count`` int64 words of device-mapped pinned memory (``signals``)."""
        return mapped_int64(count, fill=fill)

    @contextmanager
    def allocations_into(self, held: List[Any]) -> Iterator[None]:
        """Every CuPy allocation made inside is also appended to ``held`` (through the current allocator)."""
        allocate = cupy.cuda.get_allocator()

        def holding(size: int):
            memory = allocate(size)
            held.append(memory)
            return memory

        with cupy.cuda.using_allocator(holding):
            yield

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph (the legacy stream never is)."""
        ptr = cupy.cuda.get_current_stream().ptr
        return ptr != 0 and cupy.cuda.runtime.streamIsCapturing(ptr) != 0

    def read_int32(self, totals: Any, per_expert: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Host copies of int32 ``totals [2]`` and ``per_expert [L]``: two async copies, one synchronisation."""
        stream = cupy.cuda.get_current_stream()
        host_ptr = self._pinned.ptr
        for a, offset in ((totals, 0), (per_expert, 8)):
            if a.size:
                cupy.cuda.runtime.memcpyAsync(host_ptr + offset, a.data.ptr, a.nbytes, _DEVICE_TO_HOST, stream.ptr)
        stream.synchronize()
        return self._host[:2].copy(), self._host[2: 2 + per_expert.size].copy()

    def mark(self) -> Tuple[int, Any]:
        """``(current stream handle, an event recorded on it now)``: the end of a split step's send half, which
        :meth:`wait_for` orders a hook after (one event per device, re-recorded: a Buffer has one pending hook)."""
        stream = cupy.cuda.get_current_stream()
        if self._sent is None:
            self._sent = cupy.cuda.Event(block=False, disable_timing=True)
        self._sent.record(stream)
        return stream.ptr, self._sent

    def wait_for(self, mark: Tuple[int, Any]) -> None:
        """Make the current stream wait for ``mark`` (:meth:`mark`) unless it is the stream ``mark`` was taken on."""
        stream = cupy.cuda.get_current_stream()
        if stream.ptr != mark[0]:
            stream.wait_event(mark[1])

    def event(self) -> Any:
        """A CUDA event recorded on the current stream."""
        event = cupy.cuda.Event()
        event.record()
        return event

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events (waits for ``end``)."""
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, end)) / 1e3
