"""What one eager ``Buffer`` call costs the host, counted on the fake GPU (``helpers.fake_gpu``): kernel launches,
allocations (and which of them come before the first launch), stream synchronisations, device-to-host reads,
progress polls, and Python function calls. Counts, not timings: the budgets of the eager path are asserted on them
(``tests/test_eager_budget.py``).

Kernels do not run here (every launch is stubbed and counted), so the outputs are garbage: only the call sequence
is real.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List

import numpy as np

from ep_comm import host
from ep_comm.backends import nvshmem as nvshmem_backend
from ep_comm.launching import bound

ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like", "array", "asarray",
              "ascontiguousarray", "concatenate", "cumsum", "arange", "copy")  # array-module calls that allocate


@dataclass
class Counts:
    """One call's counts; ``events`` is the order of launches ("launch <kernel>") and allocations ("alloc <what>")."""

    launches: int = 0
    allocations: int = 0
    syncs: int = 0
    reads: int = 0
    polls: int = 0
    python_calls: int = 0
    events: List[str] = field(default_factory=list)

    @property
    def allocations_before_first_launch(self) -> int:
        first = next((i for i, e in enumerate(self.events) if e.startswith("launch")), len(self.events))
        return sum(e.startswith("alloc") for e in self.events[:first])


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


class ReplayedPlans:
    """``launching.plans.Plans`` as the GPU runs it, for kernels that do not run: the first call of a key runs its
    path (whose stubbed launches it notes), every later call replays them, one ``replay(kernel)`` per launch
    after reading each root's data pointer (what ``Plans.run`` and ``LaunchPlan`` do per call)."""

    enabled = True

    def __init__(self) -> None:
        self._plans: dict = {}
        self.built = 0
        self.recording: List[str] = []  # the launches of a path being recorded
        self.replay: Callable[[str], None] = lambda kernel: None

    def run(self, key: Any, on: Any, roots: Any, path: Callable[[], None]) -> None:
        kernels = self._plans.get(key)
        if kernels is None:
            self.recording = []
            path()
            self._plans[key], self.recording = tuple(self.recording), []
            self.built += 1
            return
        pointers = [r.ctypes.data for r in roots]
        for kernel in kernels:
            self.replay(kernel)
        del pointers


def count_call(backend: Any, call: Callable[[], Any], python_calls: bool = False) -> Counts:
    """Run ``call()`` (one Buffer call on a Buffer over ``backend``, a ``helpers.fake_gpu.simulated_backend`` whose
    ``plans`` is a :class:`ReplayedPlans`) with every kernel launch stubbed, and count what it did.
    ``python_calls``: count only the Python function calls made inside the call (``sys.setprofile``; C functions
    not counted; nothing else is wrapped then, so that no counting wrapper is counted)."""
    counts = Counts()
    transport, device, plans = backend.transport, backend.device, backend.plans

    def launch(what: str) -> None:
        counts.launches += 1
        counts.events.append(f"launch {what}")

    def stub(self: bound.BoundLaunch, *args: Any) -> None:
        kernel = getattr(self.dispatcher, "__name__", "kernel")
        plans.recording.append(kernel)
        launch(kernel)

    if python_calls:
        return _python_calls(call, plans, stub, counts)
    plans.replay = launch

    def allocating(name: str, allocate: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts.allocations += 1
            counts.events.append(f"alloc {name}")
            return allocate(*args, **kwargs)
        return wrapper

    def signal_launch(name: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            launch(name)
            return original(*args, **kwargs)
        return wrapper

    def sync() -> None:
        counts.syncs += 1

    def reached(marker: Any) -> bool:
        counts.polls += 1
        return True

    def read(a: Any) -> Any:
        counts.reads += 1
        return np.asarray(a)

    patches = [(bound.BoundLaunch, "__call__", stub), (device, "synchronize", sync), (device, "reached", reached),
               (host, "to_host", read), (nvshmem_backend, "to_host", read),
               (device, "carve", allocating("carve", device.carve)),
               (transport, "exchange", signal_launch("signal_and_wait", transport.exchange)),
               (transport, "signal", signal_launch("send_signal", transport.signal)),
               (transport, "wait", signal_launch("wait_signals", transport.wait))]
    patches += [(np, name, allocating(name, getattr(np, name))) for name in ALLOCATORS]
    with _patching(patches):
        call()
    return counts


def _python_calls(call: Callable[[], Any], plans: ReplayedPlans, stub: Callable, counts: Counts) -> Counts:
    """``counts`` with the Python function calls of ``call()`` (launches stubbed as GPU-free no-ops)."""
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1

    plans.replay = lambda kernel: None
    with _patched(bound.BoundLaunch, "__call__", stub):
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
    counts.python_calls = calls[0]
    return counts


@contextmanager
def _patching(patches: list) -> Iterator[None]:
    if not patches:
        yield
        return
    obj, name, value = patches[0]
    with _patched(obj, name, value), _patching(patches[1:]):
        yield
