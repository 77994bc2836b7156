"""How the nvshmem backend runs a collective step (``StepRunner``) and what its two protocols work with
(``NvshmemContext``).

A step runs on the caller's stream (taken when the step starts and passed down to every launch), numbered by
``collective_steps.Steps``, whole or split into a send half and a receive hook, its launches as recorded calls; the
step's signal and bounded GPU wait (``transport.signals``), the host's bounded poll where ``cpu_sync`` needs host
numbers, and the deferred routing verdict of a ``cpu_sync=False`` dispatch. What a capture refuses and holds is
``capture.py``'s; the step numbers and abort records are ``collective_steps.py``'s.
"""
from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

from ep_comm._launcher.recorded_calls import RecordedCalls
from ep_comm.backends.collective_steps import STEP_KINDS, Steps
from ep_comm.backends.interface import ReceiveHalf
from ep_comm.backends.nvshmem.capture import CapturePolicy
from ep_comm.backends.profile import Profile
from ep_comm.contract.arrays import Array
from ep_comm.contract.checks import routing_error, verdicts_clean
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.protocol import RECORD_TAG, RECORD_VERDICTS, VERDICT_WORDS
from ep_comm.contract.symmetric import record_verdicts, record_words
from ep_comm.contract.topology import Topology
from ep_comm.errors import RoutingError
from ep_comm.launching.kernel_launches import Kernels

POLL_SLACK_S = 10.0  # a host poll gives the GPU timeout_s (its own waits' bound) plus this for the work before them
# How a host poll waits (StepRunner._poll): it checks the marker (one event query, ~0.5 us) back to back for
# POLL_SPIN_S, then yields the core between checks (os.sched_yield, ~0.5 us when nothing else runs) until POLL_YIELD_S,
# and only then sleeps, from POLL_NAP_S doubling up to POLL_NAP_MAX_S: a sleep wakes up to one timer slack late
# (time.sleep(0) takes ~57 us with Linux's default 50 us slack), which only a long wait can afford. The spin covers
# a prefill step's wait (a yield on a busy core may give it away for a scheduler slice; DeepEP's host spins throughout).
POLL_SPIN_S = 200e-6
POLL_YIELD_S = 20e-3
POLL_NAP_S, POLL_NAP_MAX_S = 50e-6, 1e-3
NO_TAG = -1  # no step's record tag (the device step counter starts at 0 and grows): a poll given it ends on its marker


class StepRunner:
    """How one ``NvshmemBackend`` runs its collective steps: on the caller's stream, after the checks every step
    makes, timed by its ``profile``, under its ``capture`` policy, numbered by its ``steps``, its launches as its
    ``recorded`` calls; the bounded polls, and the routing verdicts of the count exchange (in the mapped ``record``).

    A step's body is called as ``body(seq, stream, *args)``: ``stream`` is the Numba stream of the caller's current
    stream, taken when the step starts, which the body passes to every launch (a split step's receive half gets the
    hook's). ``record``: int64 ``[record_words(R, L)]`` of device-mapped memory the receive count of a new routing
    writes (``record_host`` its host view); ``unchecked``: the ``(progress marker, step)`` of a ``cpu_sync=False``
    new routing whose verdicts the next call checks, or None.
    """

    def __init__(self, rank: int, geo: Geometry, timeout_s: float, profiling: bool, transport: Any, device: Any,
                 recorded: RecordedCalls):
        self.rank, self.geo, self.timeout_s = rank, geo, timeout_s
        self.transport, self.device, self.recorded = transport, device, recorded
        self.capture = CapturePolicy(device, geo.num_experts)
        self.profile = Profile(profiling, device)
        self.steps = Steps(rank, timeout_s, transport)
        self.record_host, self.record = device.mapped_int64(record_words(geo.num_ranks, geo.experts_per_rank), 0)
        self._verdict_words = slice(RECORD_VERDICTS, RECORD_VERDICTS + VERDICT_WORDS * geo.num_ranks)  # in the record
        self.unchecked: Optional[Tuple[Any, str]] = None

    @contextmanager
    def launching(self) -> Iterator[Any]:
        """Launches outside a step: yields the Numba stream of the caller's current stream (taken now) for them,
        without interface syncs inside."""
        with self.device.launching():
            yield self.device.stream()

    def collective(self, what: str, host_wait: bool, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body(seq, stream, *args)`` as the next collective step (host number ``seq``), timed as its ``phase``, on
        the caller's stream, after raising any timeout an earlier asynchronous wait recorded (the step's signal
        advances the device counter) and the routing error of an earlier ``cpu_sync=False`` dispatch
        (:meth:`raise_unchecked`). ``host_wait``: the step waits on the host (cpu_sync), which a graph capture cannot
        hold. A dispatch or combine reads the peers' abort records from the device on entry only when the last
        finished wait saw one (the mapped status record, ``Steps.run``): a record posted since ends this step's GPU
        wait early, and the step's poll raises. A close reads them always ("cannot close": a peer gave up, nothing to
        wait for).
        """
        self.capture.begin(what, host_wait)
        if not self.capture.active and what != "close":
            self.capture.raise_for_checks()
            self.raise_unchecked()
        seen = True  # an unusable buffer: Steps.run raises BufferUnusableError before reading anything
        if not self.steps.unusable:
            missing, seen = self.transport.wait_state()
            if missing:
                raise self.steps.timed_out("an earlier operation", missing)
        return self.steps.run(what, seen or what == "close", self._step, what, phase, body, *args)

    def _step(self, seq: int, what: str, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body(seq, stream, *args)`` timed as the step's ``phase``, ``stream`` the caller's (taken now)."""
        device = self.device
        stream = device.stream()
        with self.profile.phase(what, phase), device.launching():
            return body(seq, stream, *args)

    @staticmethod
    def plain_step(seq: int, stream: Any, send: Callable[..., Callable[[Any], Any]], *args: Any) -> Any:
        """A step not split: ``send(seq, stream, *args, False)`` (signal and wait), then at once the receive half it
        returns, on the same ``stream``."""
        return send(seq, stream, *args, False)(stream)

    def split(self, what: str, host_wait: bool, send: Callable[..., Callable[[Any], Any]], *args: Any) -> ReceiveHalf:
        """Step ``what``'s send half now (``send(seq, stream, *args, True)``: up to a signal that waits for nothing),
        and its receive half as a ``ReceiveHalf`` (guarded by ``Steps.resume``): the hook's call must be captured
        into a CUDA graph exactly when the send was, and an uncaptured one waits for an event recorded after the send
        when it runs on another stream."""
        receive = self.collective(what, host_wait, "send part", send, *args, True)
        captured = self.capture.active
        sent = None if captured else self.device.mark()
        return ReceiveHalf(self.steps.latest, functools.partial(self._prepare_hook, what, captured, sent),
                           functools.partial(self.steps.resume, what, self._hook, what, receive))

    def _prepare_hook(self, what: str, captured: bool, sent: Any) -> None:
        """Before a hook enqueues anything: RuntimeError unless its capture state is its send's; an uncaptured
        hook's stream waits for ``sent`` (``device.mark()`` after the send) when it is not the send's stream."""
        self.capture.resume(what, captured)
        if sent is not None:
            self.device.wait_for(sent)

    def _hook(self, what: str, receive: Callable[[Any], Any]) -> Any:
        """``receive(stream)``, the receive half of a split step, on the hook's caller's stream (taken now), timed as
        its ``hook``; under capture the memory it allocates is held for the graph."""
        with self.capture.memory(), self.profile.phase(what, "hook"), self.launching() as stream:
            return receive(stream)

    def signal_and_wait(self, what: str, stream: Any, counts: Optional[Array] = None) -> None:
        """Signal the step to every rank (with this rank's per-destination ``counts``, int32 ``[R, 1 + L]``: rows,
        then entries per local expert, ``SendLayout.count_words``), then enqueue the bounded wait for every rank's
        signal (the received counts of a missing rank become 0), on ``stream``.

        The signal word is ``step_word(seq, what)`` (monotone). A peer has arrived when its word equals
        this step's value or reached the next step (a peer is at most one step ahead); a peer in
        another kind of step with the same number (e.g. closing while this rank dispatches) has not."""
        with self.profile.phase(what, "signal+wait"):
            self.transport.exchange(stream, STEP_KINDS[what], self.timeout_s, counts)

    def signal(self, what: str, stream: Any, hooked: bool, counts: Optional[Array] = None) -> None:
        """The end of a step's send half: :meth:`signal_and_wait` for a plain step; for a split one (``hooked``) the
        signal alone (with ``counts`` as there), whose wait the hook enqueues (:meth:`wait`)."""
        if not hooked:
            self.signal_and_wait(what, stream, counts)
            return
        with self.profile.phase(what, "signal"):
            self.transport.signal(stream, STEP_KINDS[what], counts)

    def wait(self, what: str, hooked: bool, with_counts: bool) -> None:
        """The start of a split step's receive half (``hooked``): the bounded GPU wait for every rank's signal
        (``with_counts``: zeroing a missing rank's received count words); nothing for a plain step."""
        if hooked:
            with self.profile.phase(what, "wait"):
                self.transport.wait(STEP_KINDS[what], self.timeout_s, with_counts)

    def check_arrival(self, marker: Any, what: str, recorded: bool = False) -> None:
        """Poll until the GPU reached ``marker`` (``device.progress()`` taken after the step's wait: the work
        enqueued after it runs on meanwhile) or, ``recorded`` (the step writes the record: a new routing's receive
        count), the mapped record's tag is this step's, then raise on a peer's abort record or a timeout: one poll,
        no stream synchronisation.

        The tag (``receive_count.publish_record``, written last, before the count's launch ends) is the device step
        counter, which every step's signal advances: the host's ``steps.seq`` while no step of this Buffer was
        captured. Once one was (``CapturePolicy.captured``), its graph's replays advance the counter unseen by the
        host, an earlier step's record could hold the number the host would expect, and the marker alone ends the
        poll."""
        tag = self.steps.seq if recorded and not self.capture.captured else NO_TAG
        if self.profile.enabled:
            with self.profile.phase(what, "host sync"):
                self._poll(marker, what, tag)
        else:
            self._poll(marker, what, tag)
        # PeerAbortedError or ep_comm.TimeoutError as Steps.after_wait says; the abort records are read from the
        # device only when a rank is missing or the mapped status shows one: no round trip after a clean wait
        self.steps.after_wait(what, *self.transport.wait_state())

    def _poll(self, marker: Any, what: str, tag: int = NO_TAG) -> None:
        """Spin until the GPU reached ``marker`` (``device.progress()``) or the mapped record's tag word is ``tag``
        (:data:`NO_TAG`: the marker alone), waking within a microsecond or two of it: back to back for
        ``POLL_SPIN_S``, then yielding the core between checks until ``POLL_YIELD_S``, then sleeping (``POLL_NAP_S``
        doubling up to ``POLL_NAP_MAX_S``) so that a long wait does not burn a core. The GPU's waits are bounded by
        ``timeout_s``, so past ``timeout_s + POLL_SLACK_S`` the step is given up (``ep_comm.TimeoutError`` naming the
        missing ranks; else the stream's earlier work never finished, or a kernel hangs)."""
        reached, record = self.device.reached, self.record_host
        if record[RECORD_TAG] == tag or reached(marker):
            return
        clock = time.perf_counter
        start = clock()
        spin_until, yield_until = start + POLL_SPIN_S, start + POLL_YIELD_S
        while clock() < spin_until:
            if record[RECORD_TAG] == tag or reached(marker):
                return
        deadline, nap = start + self.timeout_s + POLL_SLACK_S, POLL_NAP_S
        while not (record[RECORD_TAG] == tag or reached(marker)):
            now = clock()
            if now > deadline:
                missing = self.transport.wait_state()[0]
                raise self.steps.timed_out(what, missing) if missing else self.steps.stalled(
                    what, self.timeout_s + POLL_SLACK_S)
            if now < yield_until:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, POLL_NAP_MAX_S)

    def defer_verdict(self) -> None:
        """A ``cpu_sync=False`` new routing: its verdicts are checked by the next call (after a poll of the progress
        marker taken now); a captured one's by ``CapturePolicy.raise_for_checks``."""
        if not self.capture.active:
            self.unchecked = (self.device.progress(), self.steps.latest)

    def raise_unchecked(self) -> None:
        """The routing error of the last ``cpu_sync=False`` dispatch of a new routing, if any rank's verdict was bad
        (every rank raises it at its next call, before that call does anything). Polls that dispatch's receive count
        when it has not finished yet (bounded, :meth:`_poll`)."""
        if self.unchecked is None:
            return
        (marker, step), self.unchecked = self.unchecked, None
        self._poll(marker, "dispatch")
        error = self.verdict(step)
        if error is not None:
            raise error

    def verdict(self, step: str, words: Optional[Sequence[int]] = None) -> Optional[RoutingError]:
        """The ``RoutingError`` of the routing verdicts in the record (every rank's, from the count exchange), or
        None when all are clean; ``words``: the whole record as a host list, read already (one ``tolist()``), or
        None (its verdict words are read here)."""
        geo = self.geo
        verdicts = self.record_host[self._verdict_words].tolist() if words is None else words[self._verdict_words]
        if verdicts_clean(verdicts, geo.num_experts):
            return None
        return routing_error(record_verdicts(self.record_host, geo.num_ranks), geo.num_experts, step)

    def run_recorded(self, path: Callable[..., None], stream: Any, *args: Any) -> None:
        """``path(stream, *args)`` (launches through ``Kernels`` on the caller's ``stream``) as a recorded call
        (``RecordedCalls.run``: its key and roots read from ``args``); run as it is while profiling (its phases) or
        capturing (what a capture holds is its own)."""
        if self.profile.enabled or self.capture.active:
            path(stream, *args)
            return
        self.recorded.run(self.device.handle(), path, stream, *args)


Launch = Callable[..., None]  # (path, stream, *args): a piece launched as a recorded call, or as it is (launch_now)


def launch_now(path: Callable[..., None], stream: Any, *args: Any) -> None:
    """A piece launched as it is, not recorded (a :data:`Launch`): ``path(stream, *args)``."""
    path(stream, *args)


@dataclass(frozen=True)
class NvshmemContext:
    """What the dispatch and combine protocols of one ``NvshmemBackend`` work with: its geometry, rank and mode, the
    array module, its ``kernels``, ``transport`` and ``device``, the step ``runner``, and this rank's symmetric rows,
    meta rows and count words as the kernels take them (``own_rows``, ``own_meta``, ``own_counts``), the ranks in
    nodes (``topology``) and the scale-out row counter (``scaleout``: int64 ``[2]`` on the device, the rows put into
    ranks of other nodes by dispatches and combines, ``ep_comm.kernels.traffic``; ``NvshmemBackend.traffic``)."""

    geo: Geometry
    rank: int
    deterministic: bool
    xp: Any
    kernels: Kernels
    transport: Any
    device: Any
    runner: StepRunner
    own_rows: Array
    own_meta: Array
    own_counts: Array
    topology: Topology
    scaleout: Array

    def as_contiguous(self, a: Optional[Array]) -> Optional[Array]:
        """``a`` C-contiguous: ``a`` itself when it is (no call into the array module), else a copy."""
        return a if a is None or a.flags.c_contiguous else self.xp.ascontiguousarray(a)

    def kernel_rows(self, a: Array) -> bool:
        """Whether the kernels may read payload rows ``a`` in place: C-contiguous, its data on 8 bytes (they read
        rows as words of up to 8 bytes, ``contract.symmetric.word_dtype``: a view at an odd offset would fault)."""
        return a.flags.c_contiguous and self.device.placement(a)[0] % 8 == 0

    def as_rows(self, a: Array) -> Array:
        """Payload rows ``a`` as the kernels read them (:meth:`kernel_rows`): ``a`` itself, else a C-contiguous copy
        in a new allocation."""
        return a if self.kernel_rows(a) else a.copy(order="C")
