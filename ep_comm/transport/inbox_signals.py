"""The forwarding inbox's signals and bounded wait on the GPU (``Buffer(forwarding=True)`` with several nodes;
docs/design.md, "Forwarding on nvshmem", dispatch steps 3 and 4, combine steps 2 and 3).

A rank that has written its inbox blocks of a step (the dispatch's inbox send, the combine's partials for the
sources of other nodes) stores ``inbox.signal[me] = step word`` into the inbox of every rank; a forwarder waits,
bounded by ``timeout_s``, until the inbox signals of the step came, before it relays (or sums) what they wrote. The
step word is the one the step's own signal will carry (``collective_steps.step_word``: ``seq << 2 | kind``, ``seq``
the step counter plus one), but the inbox signal does not advance the step counter: the kernels that follow it (the
relay, the node reduce) still read the parity ``ahead=1``, and the step's signal advances the counter after them.

These are the CUDA C kernels of the step's signal and wait (``ep_comm.transport.signals.SignalKernels``:
``send_signal`` and ``wait_signals``) over the inbox's words instead of the symmetric buffer's: the inbox's signal
offset, this rank's inbox signal words, and a step counter of their own (``inbox_step``, int64 ``[1]``) into which
:meth:`InboxSignals.signal` first copies the step counter on the same stream, so that ``send_signal``'s ``step[0] += 1``
gives the step's number there and leaves the Buffer's counter as it was; :meth:`InboxSignals.wait` reads that number
back. The wait shares the Buffer's status record and abort records: a sender whose inbox signal never came is flagged
missing there, sticky, and the host names it as it names a rank missing at the step's wait
(``NvshmemTransport.wait_state``); an abort record ends the inbox wait early as it ends the step's. It adds to the wait
statistics, and the step's own wait does not (:func:`measured_wait`).

Reach: the inbox signal is a peer store (system-scope fence, then a release store), so every rank whose inbox this
rank signals must be in load/store reach (a peer view: every rank of one host, virtual nodes included). The puts
variant (``nvshmem_p`` of the inbox signal to a forwarder out of reach, after the inbox's staging blocks are put) is
not built: :func:`inbox_peer_pointers` refuses a rank without a peer view, naming it.

The wait is over every rank's inbox signal, a superset of what the design needs (a dispatch forwarder needs only the
ranks it forwards for, a combine forwarder those of its node): every rank signals every inbox at every forwarded
step, so the superset costs one barrier-like wait and never waits for a signal that is not sent. Narrowing it needs a
subset parameter in the CUDA C wait (not built).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from ep_comm.contract.symmetric import STEP_KINDS
from ep_comm.transport.signals import SignalKernels, compiled_function


def measured_wait(measuring: bool, kind: int, forwarding: bool, inbox: bool) -> bool:
    """Whether a wait adds its per-peer delays to the wait statistics: a dispatch's or combine's wait (step kind
    ``kind``, not the close step's) while ``measuring``; on a transport that forwards across nodes (``forwarding``),
    its inbox wait (``inbox``) and not the step's final wait. The inbox wait waits for every rank's inbox signal,
    the end of its send part, which is the arrival the mpi backend measures in a forwarded step: a forwarder that
    waited for a late rank is not named for relaying after it, and each step counts each peer once."""
    return measuring and kind != STEP_KINDS["close"] and inbox == forwarding


def inbox_peer_pointers(peer_addresses: Sequence[Optional[int]], inbox_ranks: Sequence[int]) -> List[int]:
    """Every rank's heap base address for the inbox signal (``peer_addresses[r]``: the device address of rank ``r``'s
    symmetric heap through its peer view, None where there is none), 0 for a rank not in ``inbox_ranks`` (whose inbox
    this rank does not signal). ValueError naming the ranks of ``inbox_ranks`` without a peer view: the inbox's
    signals and blocks reach a rank through stores only (the puts of the inbox are not built)."""
    unreachable = [r for r in inbox_ranks if peer_addresses[r] is None]
    if unreachable:
        raise ValueError(f"forwarding=True: ranks {unreachable} are not in load/store reach (no peer view), but a "
                         "forwarded step stores its inbox blocks and inbox signals into every rank's inbox; the "
                         "inbox's puts (staging blocks and nvshmem_p signals for forwarders on other hosts) are not "
                         "built: forward within one host (virtual nodes, scaleup_ranks), or use backend='mpi'")
    wanted = set(inbox_ranks)
    return [int(a) if r in wanted and a is not None else 0 for r, a in enumerate(peer_addresses)]


class InboxSignals:
    """The inbox signal and wait launches of one transport (one Buffer on one rank).

    Args:
        peer_ptrs: uint64 ``[R]`` device addresses of every rank's symmetric heap (:func:`inbox_peer_pointers`),
            0 for a rank not signalled.
        num_ranks: ``R``.
        me: this rank.
        signal_offset: byte offset of the inbox's int64 ``[R]`` signal words in every rank's heap
            (``ForwardInbox.signal_offset``).
        step: the Buffer's device step counter (int64 ``[1]``), only read.
        inbox_step: this rank's inbox step counter (int64 ``[1]``, device memory).
        signals: this rank's inbox signal words (int64 ``[R]``, ``InboxViews.signal``).
        status: the Buffer's mapped ``WaitStatus`` record (shared with the step's waits).
        aborts: this rank's int64 ``[R, ABORT_WORDS]`` abort records, or None.
        device: the CUDA device ordinal.
        waits: the Buffer's int64 ``[R, WAIT_WORDS]`` wait statistics (``ep_comm.transport.wait_stats``), which a
            measured inbox wait adds to, or None: not measured.
        copy_step: ``(dst, src) -> None``, enqueues ``dst[0] = src[0]`` on CuPy's current stream (the stream the
            signal launches take); default ``dst[...] = src`` (a CuPy copy kernel).
        function: as ``SignalKernels``' (the tests give a stand-in).
    """

    def __init__(self, peer_ptrs: Any, num_ranks: int, me: int, signal_offset: int, step: Any, inbox_step: Any,
                 signals: Any, status: Any, aborts: Any, device: int, waits: Any = None,
                 copy_step: Optional[Callable[[Any, Any], None]] = None,
                 function: Callable[[str, int], Tuple[int, object]] = compiled_function):
        self._step, self._inbox_step = step, inbox_step
        self._copy_step = copy_step or _copy
        # no count words (the inbox's count words travel with its blocks)
        self._kernels = SignalKernels(peer_ptrs, num_ranks, me, signal_offset, 0, inbox_step, signals, status, None,
                                      aborts, device, function=function, waits=waits)

    def signal(self, stream: int, kind: int) -> None:
        """Enqueue on stream handle ``stream`` (CuPy's current stream): the inbox step counter set to the step
        counter, then ``send_signal``: ``inbox.signal[me] = (step + 1) << 2 | kind`` in every signalled rank, after a
        system-scope fence (every inbox row and meta row stored before it is seen with it). The step counter is not
        advanced."""
        self._copy_step(self._inbox_step, self._step)
        self._kernels.send_signal(stream, kind, None)

    def wait(self, stream: int, kind: int, timeout_s: float, measured: bool) -> None:
        """Enqueue on stream handle ``stream`` the bounded wait (``timeout_s``) for every rank's inbox signal of the
        step :meth:`signal` signalled (a rank that posted an abort record is not waited for); a rank missing is
        flagged in the shared status record. ``measured``: its per-peer delays (from this rank's entry into the wait
        to each inbox signal) go into the wait statistics (:func:`measured_wait`)."""
        self._kernels.wait_signals(stream, kind, False, timeout_s, measured=measured)


def _copy(dst: Any, src: Any) -> None:
    dst[...] = src
