"""What one eager ``Buffer`` call costs the host, counted on the fake GPU (``helpers.fake_gpu``): kernel launches,
allocations (and which of them come before the first launch), stream synchronisations, device-to-host reads,
progress polls, and Python function calls. Counts, not timings: the budgets of the eager path are asserted on them
(``tests/nvshmem_host/test_eager_budget.py``).

No kernel runs under a :class:`LaunchCounter` (every launch is stubbed and noted), so the outputs are garbage:
only the host's call sequence is real. Recorded calls are replayed as the GPU replays them (:class:`ReplayedCalls`).
"""
from __future__ import annotations

import gc
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import numpy as np

from ep_comm._launcher import prebound
from ep_comm._launcher.recorded_calls import call_key, refuse_made_per_call
from ep_comm.backends.nvshmem import backend as nvshmem_backend
from ep_comm.contract import arrays as host
from helpers.fake_gpu import HostDevice

_CTYPES = np._core._internal.__file__  # NumPy's ndarray.ctypes (a data pointer, an attribute on CuPy arrays)
ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "array", "asarray",
              "ascontiguousarray", "concatenate", "cumsum", "arange", "copy")  # array-module calls that allocate


@dataclass
class Counts:
    """One call's counts; ``events`` is the order of launches ("launch <kernel>"), allocations ("alloc <what>"), arrays
    carved by a recarving ("views <how many>") and
    polls ("poll")."""

    launches: int = 0
    allocations: int = 0
    syncs: int = 0
    reads: int = 0
    polls: int = 0
    views: int = 0  # arrays carved from a block by the device's recarvings (``cupy.ndarray(memptr=...)`` on a GPU)
    views_before_first_launch: int = 0
    python_calls: int = 0
    events: List[str] = field(default_factory=list)

    @property
    def allocations_before_first_launch(self) -> int:
        first = next((i for i, e in enumerate(self.events) if e.startswith("launch")), len(self.events))
        return sum(e.startswith("alloc") for e in self.events[:first])

    def launch(self, what: str) -> None:
        self.launches += 1
        self.events.append(f"launch {what}")

    def allocate(self, what: str) -> None:
        self.allocations += 1
        self.events.append(f"alloc {what}")


class ReplayedCalls:
    """``_launcher.recorded_calls.RecordedCalls`` as the GPU runs it: each call reads its key, roots and their data
    pointers from its arguments by the production lookup (``recorded_calls.call_key``); the first call of a key runs
    its path (noting its launches; a path made per call refused, as ``RecordedCalls.run`` refuses it), every later
    call replays them, one ``LaunchCounter.launch`` per kernel."""

    enabled = True

    def __init__(self, counter: "LaunchCounter") -> None:
        self._counter = counter
        self._plans: dict = {}
        self.built = 0

    def run(self, on: Any, path: Callable[..., None], stream: Any, *args: Any) -> None:
        key, _, _ = call_key(path, args, HostDevice.array_pointers)
        kernels = self._plans.get(key)
        if kernels is None:
            refuse_made_per_call(path)
            with self._counter.noting() as noted:
                path(stream, *args)
            self._plans[key] = tuple(noted)
            self.built += 1
            return
        for kernel in kernels:
            self._counter.launch(kernel)


class LaunchCounter:
    """Inside ``with LaunchCounter(backend) as counter``: no kernel of ``backend`` (a ``fake_gpu.simulated_backend``)
    runs, its plans are :class:`ReplayedCalls`, and :meth:`count` counts one call."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._counts: Optional[Counts] = None
        self._noted: Optional[List[str]] = None
        self._inside = 0  # > 0 inside a counted call that others are made from (their costs are its own)
        self._stack = ExitStack()

    def __enter__(self) -> "LaunchCounter":
        be, counter = self.backend, self
        be.runner.recorded = ReplayedCalls(self)

        def stub(launch: prebound.PreboundKernel, *args: Any) -> None:
            counter.launch(getattr(launch.dispatcher, "__name__", "kernel"))

        patch = self._patch
        patch(prebound.PreboundKernel, "__call__", stub)
        patch(be.device, "synchronize", self._counted("syncs", lambda: None))
        patch(be.device, "reached", self._poll)
        read = self._counted("reads", np.array)
        patch(host, "to_host", read)
        patch(nvshmem_backend, "to_host", read)
        patch(be.device, "carve", self._allocating("carve", be.device.carve))
        recarving = be.device.recarving
        patch(recarving, "views", self._viewing(recarving.views))
        for name in ALLOCATORS:
            patch(np, name, self._allocating(name, getattr(np, name)))
        transport = be.transport
        for name, kernel in (("exchange", "signal_and_wait"), ("signal", "send_signal"), ("wait", "wait_signals")):
            patch(transport, name, self._launching(kernel, getattr(transport, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        saved = getattr(obj, name)
        setattr(obj, name, value)
        self._stack.callback(setattr, obj, name, saved)

    @contextmanager
    def noting(self) -> Iterator[List[str]]:
        """Inside, the kernels launched are also appended to the list yielded (a plan being recorded)."""
        self._noted = noted = []
        try:
            yield noted
        finally:
            self._noted = None

    def launch(self, kernel: str) -> None:
        if self._noted is not None:
            self._noted.append(kernel)
        if self._counts is not None and not self._inside:
            self._counts.launch(kernel)

    def _poll(self, marker: Any) -> bool:
        """``device.reached``, counted and noted in the events as "poll" (the GPU is done at once here)."""
        if self._counts is not None:
            self._counts.polls += 1
            self._counts.events.append("poll")
        return True

    def _counted(self, what: str, function: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._counts is not None:
                setattr(self._counts, what, getattr(self._counts, what) + 1)
            return function(*args, **kwargs)
        return wrapper

    def _viewing(self, views: Callable) -> Callable:
        """A recarving's ``views``, the arrays it makes counted."""
        def wrapper(carving: Any, *args: Any) -> Any:
            made = views(carving, *args)
            counts = self._counts
            if counts is not None:
                counts.views += len(made)
                counts.events.append(f"views {len(made)}")
                if not counts.launches:
                    counts.views_before_first_launch += len(made)
            return made
        return wrapper

    def _allocating(self, name: str, allocate: Callable) -> Callable:
        return self._outermost(allocate, lambda: self._counts.allocate(name))

    def _launching(self, kernel: str, original: Callable) -> Callable:
        return self._outermost(original, lambda: self._counts.launch(kernel))

    def _outermost(self, function: Callable, note: Callable[[], None]) -> Callable:
        """``function`` noted once per outermost call (a launch or allocation made inside another is its part)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._counts is None or self._inside:
                return function(*args, **kwargs)
            note()
            self._inside += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._inside -= 1
        return wrapper

    def count(self, call: Callable[[], Any]) -> Counts:
        """The counts of ``call()``."""
        self._counts = counts = Counts()
        try:
            call()
        finally:
            self._counts = None
        return counts

    def python_calls(self, call: Callable[[], Any]) -> int:
        """Python function calls made inside ``call()`` (``sys.setprofile``; C functions not counted), minus those
        of this counter's own wrappers and of NumPy's ``ndarray.ctypes`` (a NumPy array's data pointer, which a
        CuPy array has as an attribute, ``.data.ptr``): neither exists on a GPU. The cyclic garbage collector is run
        before and kept off during ``call()``: a collection that frees an earlier call's objects runs their weakref
        callbacks (``HandleChecks``' handles) inside whatever call it interrupts, calls that are not this call's own."""
        calls = [0]
        own = {self._counted.__code__, self._outermost.__code__, self.launch.__code__, Counts.launch.__code__}

        def profile(frame: Any, event: str, arg: Any) -> None:
            code = frame.f_code
            if event == "call" and code.co_name != "wrapper" and code not in own and code.co_filename != _CTYPES:
                calls[0] += 1

        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
            if collecting:
                gc.enable()
        return calls[0]
