"""How the mpi backend runs a collective step (``MpiSteps``, the base of ``MpiBackend``): numbered and guarded by
``collective_steps.Steps``, whole or split into a send part and a receive hook, timed by its phases; its signal
and bounded wait over the MPI window; the routing error a dispatch found, raised where the call returns on the
host or by the next call.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Tuple

from ep_comm.backends.collective_steps import Steps, step_word
from ep_comm.backends.interface import ReceiveHalf
from ep_comm.backends.profile import Profile
from ep_comm.contract.geometry import Geometry
from ep_comm.transport.mpi_window import MpiWindow


def _nothing_to_prepare() -> None:
    """A receive part on the mpi backend can always be enqueued (no streams, no graphs)."""


class MpiSteps:
    """The step machinery of ``MpiBackend``, over the attributes its ``__init__`` sets (declared here)."""

    rank: int
    geo: Geometry
    timeout_s: float
    window: MpiWindow
    steps: Steps
    profile: Profile
    _refused: Optional[ValueError]

    def _step(self, seq: int, what: str, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body((seq, parity), *args)`` of collective step ``seq`` (``Steps.run``), timed as its ``phase``."""
        with self.profile.phase(what, phase):
            return body((seq, seq % 2), *args)

    def _whole(self, step: Tuple[int, int], send: Callable[..., Callable[[], Any]], *args: Any) -> Any:
        """A plain step: ``send(step, *args, False)`` (signal and wait), then at once the receive part it returns."""
        return send(step, *args, False)()

    def _plain(self, what: str, on_host: bool, send: Callable[..., Callable[[], Any]], request: Any) -> Any:
        """Collective step ``what`` whole (``send(step, request, False)``, then its receive part), once a pending
        routing error is raised (:meth:`_raise_refused`: then nothing runs); ``on_host``: the output is the host's
        (``cpu_sync``), so the step's own routing error is raised now (:meth:`_settled`)."""
        self._raise_refused()
        out = self.steps.run(what, True, self._step, what, "total", self._whole, send, request)
        return self._settled(out, on_host)

    def _split(self, what: str, on_host: bool, send: Callable[..., Callable[[], Any]], request: Any) -> ReceiveHalf:
        """Step ``what``'s send part now (``send(step, request, True)``: puts and signal, no wait), once a pending
        routing error is raised as in :meth:`_plain`, and its receive part (wait, read, assemble) as a
        ``ReceiveHalf`` (:meth:`_hook`)."""
        self._raise_refused()
        receive = self.steps.run(what, True, self._step, what, "send part", send, request, True)
        return ReceiveHalf(self.steps.latest, _nothing_to_prepare,
                           functools.partial(self._hook, what, on_host, receive))

    def _hook(self, what: str, on_host: bool, receive: Callable[[], Any]) -> Any:
        """The receive part of a split step guarded by ``Steps.resume`` and timed as its ``hook``, then its routing
        error where ``on_host``."""
        out = self.steps.resume(what, self._timed_hook, what, receive)
        return self._settled(out, on_host)

    def _timed_hook(self, what: str, receive: Callable[[], Any]) -> Any:
        """``receive()``, timed as the step's ``hook``."""
        with self.profile.phase(what, "hook"):
            return receive()

    def _settled(self, out: Any, on_host: bool) -> Any:
        """A step's output ``out``, after its guarded part: where ``on_host`` (the call returns on the host), the
        routing error the step found raised instead; otherwise kept for the next call."""
        if on_host:
            self._raise_refused()
        return out

    def _raise_refused(self) -> None:
        """Raise (once) the routing error a dispatch found and has not raised yet."""
        refused, self._refused = self._refused, None
        if refused is not None:
            raise refused

    def _signal(self, what: str, seq: int, hooked: bool) -> None:
        """The end of step ``seq``'s send part: signal every rank, then (a plain step) wait for every rank's signal;
        a split step (``hooked``) waits in its receive part (:meth:`_wait`)."""
        if not hooked:
            self._signal_and_wait(what, seq)
            return
        with self.profile.phase(what, "signal"):
            self.window.signal(range(self.geo.num_ranks), step_word(seq, what))

    def _wait(self, what: str, seq: int, hooked: bool) -> None:
        """The start of step ``seq``'s receive part: a split step's bounded wait for every rank's signal (its
        ``timeout_s`` counts from now); nothing for a plain step (its send part waited)."""
        if hooked:
            with self.profile.phase(what, "wait"):
                self._wait_all(what, seq)

    def _signal_and_wait(self, what: str, seq: int) -> None:
        """Signal step ``seq`` to every rank, then wait for every rank's signal (bounded)."""
        with self.profile.phase(what, "signal+wait"):
            self.window.signal(range(self.geo.num_ranks), step_word(seq, what))
            self._wait_all(what, seq)

    def _wait_all(self, what: str, seq: int) -> None:
        """Wait for every rank's signal of step ``seq`` (bounded), then raise as ``Steps.after_wait`` says: a
        missing rank's abort record ends the wait at once."""
        missing = self.window.wait(range(self.geo.num_ranks), step_word(seq, what), time.monotonic() + self.timeout_s)
        self.steps.after_wait(what, missing, seen=True)
