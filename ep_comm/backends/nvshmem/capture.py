"""The nvshmem backend's CUDA-graph capture policy: what may be captured, the memory a captured call
holds, and the routing checks of captured dispatches, reported after their replays.

A capture can hold dispatches with ``cpu_sync=False`` (a new routing with int32/int64 ids, or
``handle=...``) and the combines of their handles, over peer stores, puts or both (every launch reads the step
from the device counter). A step that waits on the host is refused before it enqueues anything: the buffer stays
usable. A split step (``return_recv_hook=True``)
may be captured in two graphs, its send half in one and its hook in another: each half holds what it
allocates (the send half the outputs of a replay, the hook those of a new routing), and a hook is captured
exactly when its send was (:meth:`CapturePolicy.resume`).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, List, Optional, Protocol, Tuple

_NOTHING = nullcontext()  # what an uncaptured call holds: one shared, reusable no-op context


class CaptureDevice(Protocol):
    """What the policy needs of the device (``CupyDevice``)."""

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph."""

    def mapped_int64(self, count: int, fill: int) -> Tuple[Any, Any]:
        """``(host, device)`` views of ``count`` int64 words of device-mapped memory set to ``fill``."""

    def allocations_into(self, held: List[Any]) -> ContextManager[None]:
        """A context in which every allocation is also appended to ``held``."""


def refusal(what: str, host_wait: bool) -> Optional[str]:
    """Why step ``what`` cannot be captured into a CUDA graph, or None when it can.

    ``host_wait``: the step waits on the host (cpu_sync)."""
    if host_wait:
        return "it waits on the host (cpu_sync=True, or a combine of a cpu_sync=True dispatch's handle)"
    return None


class CapturePolicy:
    """One Buffer's capture state on one rank.

    ``active``: the current call is being captured; ``captured``: a step of this Buffer was ever captured (its
    graph's replays advance the device step counter, which the host then no longer knows); ``held``: the memory
    captured calls allocated (graph replays use it; released at close); ``checks``: int64 ``[2]`` device-mapped
    record ``[largest id, a repeated row]`` that the routing check of captured dispatches folds into.
    """

    def __init__(self, device: CaptureDevice, num_experts: int):
        self._device = device
        self._num_experts = num_experts
        self.active = False
        self.captured = False
        self.held: List[Any] = []
        self._checks_host, self.checks = device.mapped_int64(2, fill=-1)

    def capturing(self) -> bool:
        """Whether the caller's stream is being captured now."""
        return self._device.capturing()

    def begin(self, what: str, host_wait: bool) -> None:
        """Start step ``what``: note whether it is captured (for good in :attr:`captured`), and raise RuntimeError
        (before anything is enqueued) when it is but cannot be (see :func:`refusal`)."""
        self.active = self._device.capturing()
        if not self.active:
            return
        why = refusal(what, host_wait)
        if why:
            raise RuntimeError(f"{what} was called while the current stream is being captured into a CUDA graph, "
                               f"and {why}: a capture can hold dispatches with cpu_sync=False (a new routing with "
                               "int32/int64 ids, or handle=...) and the combines of their handles; "
                               "call it outside the capture")
        self.captured = True

    def resume(self, what: str, send_captured: bool) -> None:
        """Start the receive half (hook) of split step ``what``, whose send half was captured or not
        (``send_captured``): note whether the hook is captured, and raise RuntimeError (before anything is
        enqueued) when that differs from its send (a captured send runs only when its graph is replayed: its
        hook must be captured too, into a graph replayed after it; an eager send needs an eager hook)."""
        self.active = self._device.capturing()
        if self.active != send_captured:
            sent, now = ("captured into a CUDA graph", "is not") if send_captured else ("enqueued outside any CUDA "
                                                                                      "graph capture", "is")
            raise RuntimeError(f"{what}'s receive hook was called while the current stream {now} being captured, but "
                               f"its send was {sent}: capture the hook exactly when the send was captured (the hook "
                               "is still pending)")

    def memory(self) -> ContextManager[None]:
        """Around a whole ``Buffer`` call: while the caller's stream is being captured into a CUDA graph,
        every allocation the call makes is held until the Buffer closes (the graph's replays use that
        memory; back in the pool it would be handed out again). A shared no-op otherwise."""
        if not self._device.capturing():
            return _NOTHING
        return self._device.allocations_into(self.held)

    def raise_for_checks(self) -> None:
        """ValueError naming the bad ``topk_idx`` that a dispatch replayed from a CUDA graph was given,
        once (the record is cleared: the buffer stays usable, the ranks stayed in step). Read without
        a synchronisation: a replay still running is reported by a later call."""
        top, twice = self._checks_host.tolist()
        if top < self._num_experts and twice < 0:
            return
        self._checks_host[:] = -1
        what = (f"expert id {top} (ids must be < num_experts={self._num_experts})" if top >= self._num_experts
                else f"row {twice} naming the same expert twice")
        raise ValueError(f"a dispatch replayed from a CUDA graph was given a topk_idx holding {what}; its kernels "
                         "read ids past the experts as 'no expert', so that replay's outputs are not what was asked")

    def release(self) -> None:
        """Let go of the memory captured calls held (the Buffer closes: no replay may follow)."""
        self.held.clear()
