"""GPU side of the symmetric-buffer protocol: signals (carrying the count exchange) and bounded waits.

Rows travel in the Numba kernels of ``ep_comm.kernels`` (stores through peer views) or through
``nvshmem_puts``. Small CUDA C kernels (``ep_comm.kernels.signal_wait``) compiled once through CuPy
(``RawModule``, disk-cached) and launched through ``cuLaunchKernel`` with a parameter block built once per transport
(:class:`SignalKernels`; a call writes its kind, count block and timeout), all reading the step
number from the Buffer's device step counter (int64 ``[1]``, see ``ep_comm.kernels.step_counter``)
so that a CUDA graph can replay them:

* ``signal_and_wait`` (every peer through stores), one launch per step: advances the counter to this step,
  ``step + 1``; optionally sends this rank's per-destination count block (rows, then entries per local
  expert, then the routing verdict: ``1 + L + 2`` words) into every peer's count words of the step's parity, then a system-scope
  fence and ``signal[me] = step << 2 | kind`` in every peer with a ``st.release.sys`` store (a
  receiver that acquires the signal sees every row and count sent before it); then the wait below;
* ``send_signal``: the signal part of ``signal_and_wait`` alone (the send half of a split step,
  ``Buffer(..., return_recv_hook=True)``, or a step that also reaches peers through puts, whose NVSHMEM signal
  kernel follows it: it skips the peers whose address is 0); ``wait_signals`` follows;
* ``wait_signals``: one CTA polls the local ``signal[s]`` words with ``ld.acquire.sys`` until each
  equals the step's word or passed the next step's threshold (a peer at most one step ahead),
  rank ``s`` posted an abort record (``ep_comm.backends.aborts``: it will not come), or a
  ``%globaltimer`` deadline passes, and records the outcome in a sticky status record, with word 0
  of every rank's abort record.

The status record (``WaitStatus``) lives in pinned host memory mapped into the device, so the
host reads it without a copy: after a stream synchronisation (``cpu_sync``), or at the next call
(which thus learns of a peer's abort record without reading the device).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ep_comm._launcher.slotted import SlottedKernel, address
from ep_comm.kernels.signal_wait import CUDA_SOURCE, STATUS_FLAGS, STATUS_MISSING, STATUS_SEQ
from ep_comm.kernels.switches import LINEINFO

WAIT_THREADS = 128
# NVRTC options of the module; with the debug switch EP_COMM_KERNEL_LINEINFO=1 (ep_comm.kernels.switches) also line
# information, so that Nsight Compute's source page places the signal and wait kernels' stall samples on CUDA_SOURCE
MODULE_OPTIONS = ("--std=c++14",) + (("-lineinfo",) if LINEINFO else ())


@functools.lru_cache(maxsize=None)
def _module(device: int):
    """The compiled kernels for CUDA device ``device`` (one RawModule)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=CUDA_SOURCE, options=MODULE_OPTIONS)


def compiled_function(name: str, device: int) -> Tuple[int, object]:
    """``(CUfunction handle, its owner)`` of kernel ``name`` on CUDA device ``device``, compiled once per device:
    CuPy's ``Function`` (``RawKernel.kernel``, whose ``ptr`` is the handle) keeps the module loaded while held."""
    import cupy

    with cupy.cuda.Device(device):
        function = _module(device).get_function(name).kernel
    return int(function.ptr), function


_PTR, _I32, _I64, _U64 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
# every kernel's parameters in the order of its CUDA C signature in CUDA_SOURCE (pointers as 64-bit addresses)
PARAMS: Dict[str, Tuple[Tuple[str, type], ...]] = {
    "signal_and_wait": (("peers", _PTR), ("num_ranks", _I32), ("me", _I32), ("signal_offset", _I64),
                        ("step", _PTR), ("kind", _I32), ("counts", _PTR), ("counts_offset", _I64),
                        ("count_words", _I32), ("signals", _PTR), ("timeout_ns", _U64), ("status", _PTR),
                        ("counts_by_parity", _PTR), ("aborts", _PTR), ("abort_words", _I32), ("waits", _PTR)),
    "send_signal": (("peers", _PTR), ("num_ranks", _I32), ("me", _I32), ("signal_offset", _I64), ("step", _PTR),
                    ("kind", _I32), ("counts", _PTR), ("counts_offset", _I64), ("count_words", _I32)),
    "wait_signals": (("signals", _PTR), ("num_ranks", _I32), ("me", _I32), ("step", _PTR), ("kind", _I32),
                     ("timeout_ns", _U64), ("status", _PTR), ("counts_by_parity", _PTR), ("count_words", _I32),
                     ("aborts", _PTR), ("abort_words", _I32), ("waits", _PTR)),
}
# what a call of SignalKernels writes
_PER_CALL = ("kind", "counts", "count_words", "counts_by_parity", "timeout_ns", "waits")
THREADS = {"signal_and_wait": WAIT_THREADS, "send_signal": WAIT_THREADS, "wait_signals": WAIT_THREADS}  # one CTA each


class SignalKernels:
    """The signal and wait launches of one transport (one Buffer on one rank), each a :class:`SlottedKernel`
    whose fixed arguments are written once here; a call writes only the step's kind, the count block and
    the timeout.

    Args:
        peer_ptrs: uint64 ``[R]`` device addresses of every rank's buffer, 0 for a rank reached through puts (which
            NVSHMEM signals: the signal kernels skip it).
        num_ranks: ``R``.
        me: this rank.
        signal_offset: byte offset of the int64 ``[R]`` signal words in every rank's buffer.
        counts_offset: byte offset of the int64 ``[2, R, 1 + L + 2]`` count words in every rank's buffer.
        step: the device step counter (int64 ``[1]``).
        signals: this rank's int64 ``[R]`` signal words.
        status: the mapped ``WaitStatus`` record (int64 ``[2 + 2R]``).
        counts_by_parity: this rank's int64 ``[2, R, 1 + L + 2]`` count words.
        aborts: this rank's int64 ``[R, ABORT_WORDS]`` abort records, or None.
        device: the CUDA device ordinal all of these live on.
        waits: the int64 ``[R, WAIT_WORDS]`` wait statistics the waits add to (``ep_comm.transport.wait_stats``),
            or None: not measured.
        function: ``(name, device) -> (CUfunction handle, owner)``: :func:`compiled_function`, which compiles (the
            tests give a stand-in).
    """

    def __init__(self, peer_ptrs: Any, num_ranks: int, me: int, signal_offset: int, counts_offset: int, step: Any,
                 signals: Any, status: Any, counts_by_parity: Any, aborts: Any, device: int,
                 function: Callable[[str, int], Tuple[int, object]] = compiled_function, waits: Any = None):
        self._counts_by_parity = counts_by_parity
        self._waits = address(waits)
        self._received = address(counts_by_parity)
        self._words = _count_words(None, counts_by_parity)
        fixed = dict(signals=address(signals), num_ranks=num_ranks, step=address(step), status=address(status),
                     aborts=address(aborts), abort_words=_abort_words(aborts), peers=address(peer_ptrs), me=me,
                     signal_offset=signal_offset, counts_offset=counts_offset)
        self._kernels = {name: _signal_kernel(name, fixed, function(name, device)) for name in PARAMS}
        # per launch, the slots of the per-call values (_PER_CALL); a value the kernel does not take goes to a sink
        self._per_call_slots = {name: tuple(launch.slot(p) if launch.takes(p) else _I64() for p in _PER_CALL)
                                for name, launch in self._kernels.items()}

    def _per_call(self, name: str, kind: int, counts: Any, sent: int, zeroed: int, timeout_s: float,
                  measured: bool = False) -> SlottedKernel:
        """The launch of kernel ``name`` with a call's values in the slots it has: ``kind``, the send block
        ``counts`` (int32 ``[R, 1 + L + 2]`` or None) and its words per block ``sent`` (:func:`_count_words`; 0
        without), ``zeroed`` (the received count words a wait zeroes for a missing rank: 0 for none; one
        ``count_words`` serves both in ``signal_and_wait``), the timeout and whether the wait adds to the wait
        statistics (``measured``, where the transport has them)."""
        kind_slot, counts_slot, words_slot, received_slot, timeout_slot, waits_slot = self._per_call_slots[name]
        waits_slot.value = self._waits if measured else 0
        kind_slot.value = kind
        counts_slot.value = address(counts)
        words_slot.value = sent or zeroed
        received_slot.value = self._received if zeroed else 0
        timeout_slot.value = int(timeout_s * 1e9)  # the kernels' %globaltimer deadline, ns
        return self._kernels[name]

    def signal_and_wait(self, stream: int, kind: int, counts: Any, timeout_s: float, measured: bool = True) -> None:
        """One launch on stream handle ``stream``, after every earlier write on it: ``step[0] += 1`` (the device
        step counter), then ``signal[me] = step[0] << 2 | kind`` in every rank's buffer (release, system scope),
        then the bounded wait of :meth:`wait_signals` for every rank's signal of that step. With ``counts``
        (int32 ``[R, 1 + L + 2]`` device array, or None: per destination its rows, then its entries per local
        expert, then the routing verdict), first row ``r`` goes to block ``me`` of the step's parity of rank ``r``'s count words (the
        count exchange rides on the signal), and the wait zeroes a missing rank's block here. ``measured``: the wait
        adds its per-peer delays to the wait statistics (when the transport keeps them)."""
        words = 0 if counts is None else _count_words(counts, self._counts_by_parity)
        self._per_call("signal_and_wait", kind, counts, words, words, timeout_s, measured)(stream)

    def send_signal(self, stream: int, kind: int, counts: Any) -> None:
        """The signal part of :meth:`signal_and_wait` alone, one launch on stream handle ``stream`` (the send half of
        a split step, or a step that also signals through puts): ``step[0] += 1``, ``counts`` (or None) into the count
        words of every rank reached through stores, ``signal[me]`` in their buffers; nothing waits (the hook, or the
        step after its puts' signal, enqueues :meth:`wait_signals`)."""
        sent = 0 if counts is None else _count_words(counts, self._counts_by_parity)
        self._per_call("send_signal", kind, counts, sent, 0, 0.0)(stream)

    def wait_signals(self, stream: int, kind: int, with_counts: bool, timeout_s: float, measured: bool = True) -> None:
        """Enqueue on stream handle ``stream`` the bounded wait until ``signals[s] == step[0] << 2 | kind`` or
        ``>= (step[0] + 1) << 2`` for every ``s``, or until rank ``s`` posted an abort record (it is not waited
        for then); the status record gets the outcome and word 0 of every abort record. ``with_counts``: the
        step's parity block of this rank's count words of a missing rank is zeroed; ``measured`` as in
        :meth:`signal_and_wait`."""
        self._per_call("wait_signals", kind, None, 0, self._words if with_counts else 0, timeout_s, measured)(stream)


def _signal_kernel(name: str, fixed: Dict[str, int], function: Tuple[int, object]) -> SlottedKernel:
    """The :class:`~ep_comm._launcher.slotted.SlottedKernel` of signal kernel ``name`` with the values of ``fixed``
    it takes."""
    takes = {param for param, _ in PARAMS[name]}
    return SlottedKernel(name, PARAMS[name], THREADS[name], {p: v for p, v in fixed.items() if p in takes}, function)


def _count_words(counts, counts_by_parity) -> int:
    """int64 words of one source's count block (0 without ``counts_by_parity [2, R, words]``); ``counts``
    (the send block ``[R, words]``, or None) must match it."""
    if counts_by_parity is None:
        if counts is not None:
            raise ValueError("counts given without counts_by_parity: the count exchange needs this rank's count "
                             "words, whose blocks of a missing rank the wait zeroes")
        return 0
    words = int(counts_by_parity.shape[2])
    if counts is not None and tuple(counts.shape) != (counts_by_parity.shape[1], words):
        raise ValueError(f"counts has shape {tuple(counts.shape)}: must be [R, 1 + L + 2] = "
                         f"{(int(counts_by_parity.shape[1]), words)}, one block per destination as counts_by_parity "
                         "holds them")
    return words


def _abort_words(aborts) -> int:
    """int64 words of one abort record in ``aborts [R, ABORT_WORDS]`` (0 without)."""
    return 0 if aborts is None else int(aborts.shape[1])


@dataclass
class WaitOutcome:
    """What the host reads back from a status record."""

    last_seq: int  # the signal value of the last wait that finished
    missing_ranks: List[int]  # ranks that ever failed to arrive (sticky)
    aborted_ranks: List[int]  # ranks whose abort record the last wait saw posted


def read_status(words: Sequence[int], num_ranks: int) -> WaitOutcome:
    """Decode the int64 words ``[seq, missing total, missing flag per rank, abort word 0 per rank]`` of a
    status record."""
    flags = words[STATUS_FLAGS:STATUS_FLAGS + num_ranks]
    missing = [r for r, f in enumerate(flags) if f] if int(words[STATUS_MISSING]) > 0 else []
    posted = words[STATUS_FLAGS + num_ranks:STATUS_FLAGS + 2 * num_ranks]
    return WaitOutcome(int(words[STATUS_SEQ]), missing, [r for r, w in enumerate(posted) if w])


def status_state(words: Sequence[int], num_ranks: int) -> Tuple[List[int], bool]:
    """``(ranks any wait gave up on (sticky), whether the last finished wait saw a posted abort record)`` of the words
    of a status record (:func:`read_status`'s): a clean record, every call's case, is told by two reads without
    decoding the rest."""
    if not words[STATUS_MISSING] and not any(words[STATUS_FLAGS + num_ranks:STATUS_FLAGS + 2 * num_ranks]):
        return [], False
    outcome = read_status(words, num_ranks)
    return outcome.missing_ranks, bool(outcome.aborted_ranks)


def mapped_int64(count: int, device: Optional[int] = None, fill: int = 0) -> Tuple[np.ndarray, object]:
    """``(host, device)`` views of ``count`` int64 words of pinned host memory mapped into CUDA device
    ``device`` (None: the current one), set to ``fill``: kernels write them with plain stores and the
    host reads them without a copy, once those kernels finished."""
    import cupy

    pinned = cupy.cuda.alloc_pinned_memory(8 * count)
    host = np.frombuffer(pinned, dtype=np.int64, count=count)  # keeps ``pinned`` alive
    host[:] = fill
    device = cupy.cuda.Device().id if device is None else device
    mem = cupy.cuda.UnownedMemory(pinned.ptr, 8 * count, pinned, device)
    return host, cupy.ndarray((count,), cupy.int64, cupy.cuda.MemoryPointer(mem, 0))


class WaitStatus:
    """A status record in pinned, device-mapped host memory: ``2 + 2R`` int64 words, zero at start."""

    def __init__(self, num_ranks: int, device: Optional[int] = None):
        self.num_ranks = num_ranks
        self.host, self.device = mapped_int64(STATUS_FLAGS + 2 * num_ranks, device)
