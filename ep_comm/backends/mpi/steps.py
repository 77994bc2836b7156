"""How the mpi backend runs a collective step (``MpiStepRunner``): numbered and guarded by
``collective_steps.Steps``, unsplit or split into a send part and a receive hook, timed by its phases; the flat
path's signal and bounded wait over the MPI window; the routing error a dispatch found, raised where the call
returns on the host or by the next call.

A step's body is a *send* function ``send(step, request, hooked)``: ``step`` is ``(seq, parity)``, ``hooked`` says
whether the step is split; it does the send part and returns the receive part, a function of no argument.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Tuple

from ep_comm.backends.collective_steps import Steps, step_word
from ep_comm.backends.interface import ReceiveHalf
from ep_comm.backends.profile import Profile
from ep_comm.transport.mpi_window import MpiWindow
from ep_comm.transport.wait_stats import HostWaits

Send = Callable[..., Callable[[], Any]]  # send(step, request, hooked) -> the receive part


def _nothing_to_prepare() -> None:
    """A receive part on the mpi backend can always be enqueued (no streams, no graphs)."""


class MpiStepRunner:
    """The step machinery of one mpi Buffer on one rank: ``steps`` (numbers, guard, abort records over ``window``),
    ``profile`` (host times per phase) and ``pending_routing_error`` (the routing error of the latest dispatch of a
    new routing, until raised) and ``waits`` (the wait statistics of every dispatch and combine, ``wait_stats``)."""

    def __init__(self, rank: int, num_ranks: int, timeout_s: float, window: MpiWindow, profile: Profile,
                 measure_waits: bool = True):
        self.num_ranks = num_ranks
        self.waits = HostWaits(num_ranks, rank, measure_waits)
        self.timeout_s = timeout_s
        self.window = window
        self.steps = Steps(rank, timeout_s, window)
        self.profile = profile
        self.pending_routing_error: Optional[ValueError] = None

    def run(self, what: str, on_host: bool, send: Send, request: Any) -> Any:
        """Collective step ``what`` unsplit (``send(step, request, False)``, then its receive part), once a pending
        routing error is raised (:meth:`raise_pending_error`: then nothing runs); ``on_host``: the output is the
        host's (``cpu_sync``), so the step's own routing error is raised now (:meth:`_deliver`)."""
        self.raise_pending_error()
        out = self.steps.run(what, True, self._run_timed, what, "total", _send_and_receive, send, request)
        return self._deliver(out, on_host)

    def run_send_part(self, what: str, on_host: bool, send: Send, request: Any) -> ReceiveHalf[Any]:
        """Step ``what``'s send part now (``send(step, request, True)``: puts and signal, no wait), once a pending
        routing error is raised as in :meth:`run`, and its receive part (wait, read, assemble) as a
        ``ReceiveHalf`` (:meth:`_run_receive_part`)."""
        self.raise_pending_error()
        receive = self.steps.run(what, True, self._run_timed, what, "send part", send, request, True)
        return ReceiveHalf(self.steps.latest, _nothing_to_prepare,
                           functools.partial(self._run_receive_part, what, on_host, receive))

    def run_close(self) -> None:
        """The close step: signal every rank and wait for every rank's signal (bounded), guarded as every step."""
        self.steps.run("close", True, self._run_timed, "close", "total", self._signal_and_wait_step)

    def _signal_and_wait_step(self, step: Tuple[int, int]) -> None:
        """Signal step ``step = (seq, parity)`` to every rank and wait for every rank's signal (the close step)."""
        self.signal_and_wait("close", step[0])

    def _run_timed(self, seq: int, what: str, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body((seq, parity), *args)`` of collective step ``seq`` (``Steps.run``), timed as its ``phase``."""
        with self.profile.phase(what, phase):
            return body((seq, seq % 2), *args)

    def _run_receive_part(self, what: str, on_host: bool, receive: Callable[[], Any]) -> Any:
        """The receive part of a split step guarded by ``Steps.resume`` and timed as its ``hook``, then its routing
        error where ``on_host``."""
        out = self.steps.resume(what, self._time_receive_part, what, receive)
        return self._deliver(out, on_host)

    def _time_receive_part(self, what: str, receive: Callable[[], Any]) -> Any:
        """``receive()``, timed as the step's ``hook``."""
        with self.profile.phase(what, "hook"):
            return receive()

    def _deliver(self, out: Any, on_host: bool) -> Any:
        """A step's output ``out``, after its guarded part: where ``on_host`` (the call returns on the host), the
        routing error the step found raised instead; otherwise kept for the next call."""
        if on_host:
            self.raise_pending_error()
        return out

    def raise_pending_error(self) -> None:
        """Raise (once) the routing error a dispatch found and has not raised yet."""
        error, self.pending_routing_error = self.pending_routing_error, None
        if error is not None:
            raise error

    def signal(self, what: str, seq: int, hooked: bool) -> None:
        """The end of step ``seq``'s send part: signal every rank, then (an unsplit step) wait for every rank's
        signal; a split step (``hooked``) waits in its receive part (:meth:`wait`)."""
        if not hooked:
            self.signal_and_wait(what, seq)
            return
        with self.profile.phase(what, "signal"):
            self.window.signal(range(self.num_ranks), step_word(seq, what))

    def wait(self, what: str, seq: int, hooked: bool) -> None:
        """The start of step ``seq``'s receive part: a split step's bounded wait for every rank's signal (its
        ``timeout_s`` counts from now); nothing for an unsplit step (its send part waited)."""
        if hooked:
            with self.profile.phase(what, "wait"):
                self.wait_all(what, seq)

    def signal_and_wait(self, what: str, seq: int) -> None:
        """Signal step ``seq`` to every rank, then wait for every rank's signal (bounded)."""
        with self.profile.phase(what, "signal+wait"):
            self.window.signal(range(self.num_ranks), step_word(seq, what))
            self.wait_all(what, seq)

    def wait_all(self, what: str, seq: int) -> None:
        """Wait for every rank's signal of step ``seq`` (bounded), then raise as ``Steps.after_wait`` says: a
        missing rank's abort record ends the wait at once. A dispatch's or combine's wait adds to the wait
        statistics (``waits``)."""
        word = step_word(seq, what)
        clock = None if what == "close" else self.waits.clock(self.window.arrivals(word))
        missing = self.window.wait(range(self.num_ranks), word, time.monotonic() + self.timeout_s, clock=clock)
        self.steps.after_wait(what, missing, seen=True)
        if clock is not None:
            clock.finish()


def _send_and_receive(step: Tuple[int, int], send: Send, request: Any) -> Any:
    """An unsplit step: ``send(step, request, False)`` (signal and wait), then at once the receive part it
    returns."""
    return send(step, request, False)()
