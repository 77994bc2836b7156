"""``CupyDevice``: the nvshmem backend's handle on its GPU through CuPy (GPU only: imports CuPy and Numba-CUDA).

The caller's current stream (every launch is enqueued there), Numba's launch settings, a progress marker the
host polls without synchronising, device-mapped pinned memory, the allocator hold of a captured call, and
CUDA-graph capture detection. ``tests/helpers/fake_gpu.py`` has a host twin (``HostDevice``) for the simulator.
"""
from __future__ import annotations

import itertools
import math
import operator
from contextlib import contextmanager
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import cupy
import numpy as np
from numba import cuda

from ep_comm.kernels.numba_internals import interface_sync_disabled
from ep_comm.transport.nvshmem import numba_view
from ep_comm.transport.signals import mapped_int64

_LAYOUT_NUMBERS: Dict[tuple, int] = {}  # Recarving.launch_key: per layout seen in this process, its number
_NEXT_NUMBER = itertools.count()
_CARVE_BYTES = 128  # where each array carved from one allocation starts (vector loads need 16)


def _c_order(a: Any) -> bool:
    """Whether non-empty ``a`` has the byte strides of C order for its shape and itemsize (those CuPy makes)."""
    step = a.itemsize
    for extent, stride in zip(reversed(a.shape), reversed(a.strides)):
        if extent == 0 or stride != step:
            return False
        step *= extent
    return True


class Recarving:
    """New arrays laid out as given views of one block: :meth:`new` allocates a block of the same shape and dtype
    and returns ``(block, views)`` at the same offsets, shapes, dtypes and strides (``cupy.ndarray(memptr=...)``:
    no slicing). The block is a root of the recorded calls it is passed to, whose key holds its layout: it is made
    as the general path makes it. A single view that is the block itself (:meth:`CupyDevice.carve` of one array)
    is the new block again: one array made, not two. :meth:`block` and :meth:`views` are its two halves, for a
    caller that launches on the block before it needs the views (or needs none: a recorded call takes the block).
    ``launch_key``: its layout, what a recorded call that makes its views inside takes from it
    (``ep_comm._launcher.recorded_calls.call_key``), as the number of that layout among those seen."""

    __slots__ = ("_block", "_views", "_whole", "launch_key")

    def __init__(self, block: Any, views: Sequence[Any]):
        base = block.data.ptr
        self._block = (block.shape, block.dtype)
        # strides None where they are C order's (CuPy computes those itself, about 0.25 us less per view)
        self._views = tuple((v.shape, v.dtype, v.data.ptr - base, None if _c_order(v) else v.strides) for v in views)
        self._whole = len(views) == 1 and views[0] is block
        # one small int per distinct layout: a key word that hashes and compares at once, on every recorded call (a
        # number drawn from a counter, never from the table's size: two threads may add layouts at once)
        self.launch_key = _LAYOUT_NUMBERS.setdefault((self._block, self._views, self._whole), next(_NEXT_NUMBER))

    def new(self) -> Tuple[Any, List[Any]]:
        """``(block, views)``: one allocation."""
        block = cupy.empty(*self._block)
        return block, [block] if self._whole else self.views(block)

    def block(self) -> Any:
        """A new block (one allocation), no views."""
        return cupy.empty(*self._block)

    def views(self, block: Any, rows: Optional[int] = None) -> List[Any]:
        """The views of ``block`` (one this recarving made); ``rows``: each view's first extent is ``rows`` instead
        (the leading rows of views of worst-case rows, as ``view[:rows]`` gives them, without the slice)."""
        if self._whole:
            return [block if rows is None else block[:rows]]
        memory, views = block.data, []
        for shape, dtype, at, strides in self._views:  # a loop, not a comprehension: no frame of its own
            views.append(cupy.ndarray(shape if rows is None else (rows, *shape[1:]), dtype, memptr=memory + at,
                                      strides=strides))
        return views


class CupyDevice:
    """CUDA device ``device`` (ordinal) of one rank."""

    xp = cupy
    array_pointers = {cupy.ndarray: operator.attrgetter("data.ptr")}  # a recorded call's roots' (call_key)

    def __init__(self, device: int):
        self.device = device
        self._streams: Dict[int, Any] = {}
        self._launch_streams: Dict[int, Tuple[Any, Any]] = {}
        self._sent: Any = None  # the event of mark(), made at the first split step
        self._progress = cupy.cuda.Event(block=False, disable_timing=True)

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

    def launch_streams(self) -> Tuple[Any, Any]:
        """``(Numba stream, driver handle)`` of the current CuPy stream (:meth:`stream`; the handle is what
        ``raw.launch`` takes), made once per stream."""
        ptr = cupy.cuda.get_current_stream().ptr
        held = self._launch_streams.get(ptr)
        if held is None:
            held = self._launch_streams[ptr] = (self.stream(), ptr)
        return held

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

    @staticmethod
    def carve(shapes: Sequence[Tuple[tuple, Any]]) -> Tuple[List[Any], Any]:
        """``(arrays, block)``: one new allocation ``block`` (uint8) and a C-contiguous array of each
        ``(shape, dtype)`` of ``shapes`` in it, each on 128 bytes (one allocation for many arrays)."""
        if len(shapes) == 1:  # one array: itself
            array = cupy.empty(*shapes[0])
            return [array], array
        offsets, total = [], 0
        for shape, dtype in shapes:
            offsets.append(total)
            total += -(-math.prod(shape) * np.dtype(dtype).itemsize // _CARVE_BYTES) * _CARVE_BYTES
        block = cupy.empty(max(total, 1), cupy.uint8)
        memory = block.data
        return [cupy.ndarray(shape, dtype, memptr=memory + at) for (shape, dtype), at in zip(shapes, offsets)], block

    recarving = Recarving  # (block, views of it) -> Recarving

    @staticmethod
    def copy(a: Any) -> Any:
        """A new C-contiguous copy of C-contiguous ``a``, one asynchronous device-to-device copy on the current stream
        (``astype(copy=True)`` launches an elementwise kernel: about four times the host time)."""
        out = cupy.empty(a.shape, a.dtype)
        out.data.copy_from_device_async(a.data, a.nbytes)
        return out

    # ``(data pointer, device ordinal)`` of a CuPy array, attribute reads only (the prepared path's identity)
    placement = staticmethod(operator.attrgetter("data.ptr", "data.device_id"))

    def handle(self) -> int:
        """The handle of the current CuPy stream (0: the legacy default stream), as raw launches take it."""
        return cupy.cuda.get_current_stream().ptr

    def progress(self) -> Any:
        """A marker of everything enqueued on the current stream so far: one event per device, re-recorded (a
        Buffer has one such marker outstanding at a time); :meth:`reached` polls it."""
        self._progress.record()
        return self._progress

    @staticmethod
    def reached(marker: Any) -> bool:
        """Whether the GPU has done everything enqueued before ``marker`` (:meth:`progress`): one non-blocking
        query, no synchronisation."""
        return marker.done

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
