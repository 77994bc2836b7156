"""The ``nvshmem`` backend: the dispatch/combine protocol on GPUs over the NVSHMEM symmetric heap.

Same protocol and results as the ``mpi`` backend (``ep_comm/backends/mpi.py``), bit for bit in
deterministic mode. The data path is ``ep_comm.launching.kernel_launches.Kernels``; per dispatch on rank ``me``:

1. ``count`` (new routing): per-rank/per-expert counts, ``is_token_in_rank``, slot cursors;
2. ``scatter``: each (token, destination) row and meta row straight into region ``[parity][me]``
   of the destination's symmetric buffer (stores through peer views; with ``transport="puts"``
   into a local staging block that ``nvshmem_puts.put_blocks`` sends). A replayed handle in compact
   mode allocates the outputs first and sends the payload of the rows for ``me`` itself straight to
   their ``recv_x`` rows instead (their meta rows still go to the own buffer);
3. signal ``step_word(seq, kind)`` to every rank, carrying this rank's per-destination counts (new
   routing: rows and entries per local expert), then a bounded GPU wait for every rank's signal
   (``ep_comm.transport.signals``);
4. ``receive_count`` (new routing; in compact mode from the count words alone) and ``receive_copy``
   into the outputs (after a compact replay without the payload of the rows from ``me``, already in
   place).

Every step's signal advances the device step counter (``ep_comm.kernels.step_counter``): the kernels read
the step number and buffer parity from it, not from the host (the senders, before the signal, one
step ahead). The launches of a step are therefore the same at every step, and the ``cpu_sync=False``
calls (a dispatch of a new routing or of a handle, a combine) can be captured into a CUDA graph and
replayed, with peer stores (``capture.py`` says what is refused).

Combine runs ``Kernels.combine_scatter`` back into the sources' buffers (plus the weights' return route when
weights are given, ``weight_return``), signal + wait, then ``combine_reduce`` with the bias. In
compact mode the rows this rank received from itself are not sent: ``combine_reduce`` reads their
partials straight from ``y`` (with one rank there is no send launch at all); expand mode sends its
own partials too (``combine_expand_kernel`` computes them).

Everything is enqueued on the caller's current stream (``CupyDevice``), with Numba's
CUDA-array-interface stream sync off during our launches: every array we pass was made on, or
handed in for, that same stream. The host waits only where ``cpu_sync=True`` needs it: a dispatch
reads its row counts (one synchronisation), a combine reports a timeout. With ``cpu_sync=False``
nothing waits on the host: outputs have the contract's worst-case rows, the true counts stay on the
device, and a timeout is reported by the next call.

The backend gets its transport (``ep_comm.transport.nvshmem.NvshmemTransport``) and device
(``CupyDevice``) from :meth:`NvshmemBackend.open`; the tests give it a loopback transport and a
host device instead, to run this whole call sequence in the Numba CUDA simulator. This module
imports no CuPy: it uses the device's array module.

A split step (``Buffer(..., return_recv_hook=True)``, :meth:`NvshmemBackend.dispatch_send` and
:meth:`~NvshmemBackend.combine_send`) enqueues its send half up to a signal that waits for nothing
(``signals.send_signal`` on peer stores, the NVSHMEM signal with puts), and returns its receive half, which
enqueues ``signals.wait_signals`` and the receive on the hook's stream (made to wait for the send's when it
is another stream and nothing is captured). The two halves may be captured into two graphs: a hook is
captured exactly when its send was (``CapturePolicy.resume``).

``Buffer(profile=True)``: per-phase host time (perf_counter) and GPU time (CUDA events), read by
``Buffer.profile_table()``; a split step records ``send part``, ``signal``, ``hook`` and ``wait`` where a
plain one records ``total`` and ``signal+wait``.

Inputs: CuPy arrays, or any GPU array with DLPack / ``__cuda_array_interface__`` (PyTorch
tensors, zero copy). Outputs: CuPy arrays.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.backends.capture import CapturePolicy
from ep_comm.backends.collective_steps import STEP_KINDS, Steps
from ep_comm.backends.interface import BackendSettings, CombineRequest, DispatchRequest, ReceiveHalf
from ep_comm.backends.profile import Profile, ProfileRow
from ep_comm.contract import layout as lay
from ep_comm.contract.arrays import to_host
from ep_comm.contract.checks import check_num_sms_fits, routing_error, topk_values, verdicts_clean
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import (
    SymmetricLayout,
    record_counts,
    record_verdict_words,
    record_verdicts,
    record_words,
    word_dtype,
)
from ep_comm.errors import RoutingError
from ep_comm.handle import Array, CombineOutput, DispatchOutput, EPHandle, Received, Routing, make_handle
from ep_comm.launching import raw, weight_return
from ep_comm.launching.fp8 import Fp8Rows, payload_arrays, payload_key
from ep_comm.launching.kernel_launches import (
    PLACE_ATOMIC,
    PLACE_CACHED,
    PLACE_STABLE,
    SLOT_ATOMIC,
    SLOT_CACHED,
    SLOT_STABLE,
    Kernels,
    check_index_range,
)
from ep_comm.launching.plans import Plans

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types the backend accepts
BLOCKS_PER_SM = 2  # blocks of the unit-cut kernels (count, scatter, receive count/place) per SM
STREAM_BLOCKS_PER_SM = 8  # blocks of the row-streaming kernels (receive rows, combine) per SM
POLL_SLACK_S = 10.0  # a host poll gives the GPU timeout_s (its own waits' bound) plus this for the work before them


def sms_in_effect(comm: MPI.Comm, num_sms: Optional[int], device_sms: int) -> int:
    """The SM count the kernels use on this rank: ``num_sms``, or ``device_sms`` (this rank's GPU) for None.

    Collective: every rank learns every rank's SM count, so a ``num_sms`` above any rank's raises
    the same ValueError (naming ``num_sms``, the value and the fewest SMs) on every rank.
    """
    check_num_sms_fits(num_sms, comm.allgather(int(device_sms)))
    return device_sms if num_sms is None else int(num_sms)


def grid_shape(num_sms: int) -> Dict[str, int]:
    """``Kernels`` launch shape for ``num_sms`` SMs: ``num_blocks = 2 * num_sms`` (unit-cut kernels) and
    ``stream_blocks = 8 * num_sms`` (row-streaming kernels); 132 SMs (H200) give 264 / 1056."""
    return dict(num_blocks=BLOCKS_PER_SM * num_sms, stream_blocks=STREAM_BLOCKS_PER_SM * num_sms)


class NvshmemBackend:
    """GPU backend. Arrays in: CuPy / DLPack / ``__cuda_array_interface__``; arrays out: CuPy.

    ``transport``: an ``NvshmemTransport`` (or its loopback twin in the tests); ``device``: a
    ``CupyDevice`` (or its host twin), whose ``xp`` is the array module; ``comm``: this backend's own
    communicator (freed at a clean close); ``num_sms``: the SM count in effect; ``launch``: the
    ``Kernels`` launch shape (:func:`grid_shape`).
    """

    name = "nvshmem"

    def __init__(self, comm: MPI.Comm, geo: Geometry, settings: BackendSettings, *, transport: Any, device: Any,
                 num_sms: int, launch: Dict[str, int]):
        xp = device.xp
        self.xp = xp
        self.comm, self.rank, self.geo = comm, comm.rank, geo
        self.deterministic, self.timeout_s = settings.deterministic, settings.timeout_s
        self.num_sms: Optional[int] = num_sms
        self.transport, self.device = transport, device
        self.transport_name = "puts" if transport.use_puts else "stores"
        self.kernels = Kernels(xp, num_ranks=geo.num_ranks, num_experts=geo.num_experts, num_topk=geo.num_topk,
                               max_tokens=geo.max_tokens, **launch)
        own = transport.own
        self._own_rows = device.kernel_array(own.rows)
        self._own_meta = device.kernel_array(own.meta)
        self._own_counts = device.kernel_array(own.counts)
        self._scratch = xp.empty(0, dtype=np.float32)  # weight outputs nobody asked for
        self.capture = CapturePolicy(device, geo.num_experts, transport.use_puts)
        self.profile = Profile(settings.profile, device)
        self.steps = Steps(self.rank, settings.timeout_s, transport)
        self.plans = Plans(self.kernels.prebound, device.allocations_into)
        # what the receive count of a new routing writes for the host: counts and every rank's routing verdict
        self._record_host, self._record = device.mapped_int64(record_words(geo.num_ranks, geo.experts_per_rank), 0)
        self._unchecked: Optional[Tuple[Any, str]] = None  # (progress marker, step) of a cpu_sync=False new routing

    @classmethod
    def open(cls, comm: MPI.Comm, geo: Geometry, settings: BackendSettings, transport_type: type,
             device_type: type) -> "NvshmemBackend":
        """The backend on this rank's GPU (collective over ``comm``, which is duplicated).

        Args:
            comm: the Buffer's communicator.
            geo: the Buffer's geometry.
            settings: the Buffer's settings (``transport``, ``num_sms``, ...).
            transport_type: ``NvshmemTransport``, built over the symmetric heap.
            device_type: ``CupyDevice``, built on the transport's GPU.

        Returns:
            The backend; its kernels sized for ``settings.num_sms`` (ValueError on every rank, with
            everything released, when that exceeds any rank's SM count).
        """
        check_index_range(geo.num_ranks, geo.max_tokens, geo.num_topk)  # before anything collective is allocated
        comm = comm.Dup()
        sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize,
                              geo.experts_per_rank)
        transport = transport_type(comm, sym, word_dtype(geo.hidden, geo.dtype.itemsize),
                                   settings.transport == "puts")
        device = device_type(transport.device)
        try:
            num_sms = sms_in_effect(comm, settings.num_sms, device.sm_count())
        except ValueError:  # raised on every rank alike: the collective release cannot hang
            transport.close(collective=True)
            comm.Free()
            raise
        return cls(comm, geo, settings, transport=transport, device=device, num_sms=num_sms,
                   launch=grid_shape(num_sms))

    # ------------------------------------------------------------------ inputs
    def as_array(self, obj: Any, name: str) -> Array:
        """A CuPy view of GPU array ``obj`` (zero copy); host arrays raise TypeError naming ``name``."""
        xp = self.xp
        if isinstance(obj, xp.ndarray):
            return self._on_my_gpu(obj, name)
        on_gpu = (int(obj.__dlpack_device__()[0]) in (_DL_CUDA, _DL_CUDA_MANAGED)
                  if hasattr(obj, "__dlpack_device__") else hasattr(obj, "__cuda_array_interface__"))
        if on_gpu:
            return self._on_my_gpu(xp.from_dlpack(obj) if hasattr(obj, "__dlpack__") else xp.asarray(obj), name)
        if hasattr(obj, "__dlpack__") or hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
            raise TypeError(f"{name} is a host array ({type(obj).__name__}): the nvshmem backend takes GPU arrays "
                            "(CuPy, PyTorch CUDA tensors, anything with __cuda_array_interface__ or DLPack)")
        raise TypeError(f"{name} must be a GPU array, got {type(obj).__name__}")

    def _on_my_gpu(self, a: Array, name: str) -> Array:
        """``a`` if it lives on this rank's GPU; ValueError naming ``name`` and both GPUs otherwise."""
        mine = self.transport.device
        where = getattr(getattr(a, "device", None), "id", mine)
        if mine is not None and where != mine:
            raise ValueError(f"{name} is on GPU {where}: this rank's Buffer works on GPU {mine} "
                             "(each rank's arrays must live on its own GPU)")
        return a

    def routing_summary(self, topk_idx: Array) -> Tuple[int, int]:
        """``(largest id, first row naming an expert twice or -1)`` of a non-empty integer routing
        (``validate.check_topk_idx``): one kernel and one read for signed ids, CuPy code for unsigned.

        Under CUDA graph capture nothing can be read back: the check kernel folds its result into the
        capture policy's record, which the first call after the replays reads, and ``(-1, -1)``
        ("nothing wrong yet") is returned. The kernels read ids past the experts as "no expert"
        meanwhile (``ep_comm.kernels.expert_ids``)."""
        signed = np.issubdtype(np.dtype(topk_idx.dtype), np.signedinteger)
        if self.capture.capturing():
            if not signed:
                raise RuntimeError(f"topk_idx has dtype {topk_idx.dtype}: a dispatch captured into a CUDA graph "
                                   "needs signed expert ids (int32 or int64), whose check runs on the device")
            with self._launching():
                self.kernels.check_routing(topk_idx, into=self.capture.checks)
            return -1, -1
        self.capture.raise_for_checks()
        if not signed:
            return topk_values(self.xp, topk_idx)
        with self._launching():
            top, twice = to_host(self.kernels.check_routing(topk_idx)).tolist()
        return int(top), int(twice)

    def dispatch_layout(self, topk_idx: Array) -> lay.DispatchLayout:
        """``ep_comm.contract.layout.dispatch_layout`` by the count kernel (no host synchronisation)."""
        with self._launching():
            send = self.kernels.count(topk_idx, stable=False)
        return lay.DispatchLayout(send.num_tokens_per_rank, send.num_tokens_per_expert, send.is_token_in_rank)

    def captured_memory(self) -> ContextManager[None]:
        """Around a whole ``Buffer`` call: the capture policy's hold on what it allocates under capture."""
        return self.capture.memory()

    def profile_table(self) -> List[ProfileRow]:
        """Median host and GPU microseconds per (operation, phase) so far."""
        return self.profile.table()

    # ---------------------------------------------------------------- protocol
    def _launching(self) -> ContextManager[None]:
        """Kernels launch on the caller's current stream (taken now), without interface syncs inside the
        returned context."""
        self.kernels.stream = self.device.stream()
        return self.device.launching()

    def _collective(self, what: str, host_wait: bool, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body(seq, *args)`` as the next collective step (host number ``seq``), timed as its ``phase``, on the
        caller's stream, after
        raising any timeout an earlier asynchronous wait recorded (the step's signal advances the device
        counter) and the routing error of an earlier ``cpu_sync=False`` dispatch (:meth:`_raise_unchecked`).
        ``host_wait``: the step waits on the host (cpu_sync), which a graph capture cannot hold. A dispatch or
        combine reads the peers' abort records from the device on entry only when the last finished wait saw one
        (the mapped status record, ``Steps.run``): a record posted since ends this step's GPU wait early, and the
        step's poll raises. A close reads them always ("cannot close": a peer gave up, nothing to wait for).
        """
        self.capture.begin(what, host_wait)
        if not self.capture.active and what != "close":
            self.capture.raise_for_checks()
            self._raise_unchecked()
        seen = True  # an unusable buffer: Steps.run raises BufferUnusableError before reading anything
        if not self.steps.unusable:
            missing, seen = self.transport.wait_state()
            if missing:
                raise self.steps.timed_out("an earlier operation", missing)
        return self.steps.run(what, seen or what == "close", self._step, what, phase, body, *args)

    def _step(self, seq: int, what: str, phase: str, body: Callable[..., Any], *args: Any) -> Any:
        """``body(seq, *args)`` timed as the step's ``phase``, launching on the caller's stream."""
        with self.profile.phase(what, phase), self._launching():
            return body(seq, *args)

    def _whole(self, seq: int, send: Callable[..., Callable[[], Any]], *args: Any) -> Any:
        """A plain step: ``send(seq, *args, False)`` (signal and wait), then at once the receive half it returns."""
        return send(seq, *args, False)()

    def _split(self, what: str, host_wait: bool, send: Callable[..., Callable[[], Any]], *args: Any) -> ReceiveHalf:
        """Step ``what``'s send half now (``send(seq, *args, True)``: up to a signal that waits for nothing), and its
        receive half as a ``ReceiveHalf`` (guarded by ``Steps.resume``): the hook's call must be captured into a
        CUDA graph exactly when the send was, and an uncaptured one waits for an event recorded after the send
        when it runs on another stream."""
        receive = self._collective(what, host_wait, "send part", send, *args, True)
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

    def _hook(self, what: str, receive: Callable[[], Any]) -> Any:
        """The receive half of a split step on the caller's stream, timed as its ``hook``; under capture the
        memory it allocates is held for the graph."""
        with self.capture.memory(), self.profile.phase(what, "hook"), self._launching():
            return receive()

    def _contiguous(self, a: Optional[Array]) -> Optional[Array]:
        """``a`` C-contiguous: ``a`` itself when it is (no call into the array module), else a copy."""
        return a if a is None or a.flags.c_contiguous else self.xp.ascontiguousarray(a)

    def _signal_and_wait(self, what: str, seq: int, counts: Optional[Array] = None) -> None:
        """Signal step ``seq`` to every rank (with this rank's per-destination ``counts``, int32 ``[R, 1 + L]``:
        rows, then entries per local expert, ``SendLayout.count_words``), then enqueue the bounded wait for
        every rank's signal (the received counts of a missing rank become 0).

        The signal word is ``step_word(seq, what)`` (monotone). A peer has arrived when its word equals
        this step's value or reached the next step (a peer is at most one step ahead); a peer in
        another kind of step with the same number (e.g. closing while this rank dispatches) has not."""
        with self.profile.phase(what, "signal+wait"):
            self.transport.exchange(self.kernels.stream, seq, STEP_KINDS[what], self.timeout_s, counts)

    def _signal(self, what: str, seq: int, hooked: bool, counts: Optional[Array] = None) -> None:
        """The end of step ``seq``'s send half: :meth:`_signal_and_wait` for a plain step; for a split one
        (``hooked``) the signal alone (with ``counts`` as there), whose wait the hook enqueues (:meth:`_wait`)."""
        if not hooked:
            self._signal_and_wait(what, seq, counts)
            return
        with self.profile.phase(what, "signal"):
            self.transport.signal(self.kernels.stream, seq, STEP_KINDS[what], counts)

    def _wait(self, what: str, hooked: bool, with_counts: bool) -> None:
        """The start of a split step's receive half (``hooked``): the bounded GPU wait for every rank's signal
        (``with_counts``: zeroing a missing rank's received count words); nothing for a plain step."""
        if hooked:
            with self.profile.phase(what, "wait"):
                self.transport.wait(STEP_KINDS[what], self.timeout_s, with_counts)

    def _check_arrival(self, marker: Any, what: str) -> None:
        """Poll until the GPU reached ``marker`` (``device.progress()`` taken after the step's wait: the work
        enqueued after it runs on meanwhile), then raise on a peer's abort record or a timeout: one poll, no
        stream synchronisation."""
        with self.profile.phase(what, "host sync"):
            self._poll(marker, what)
        self._after_host_wait(what)

    def _poll(self, marker: Any, what: str) -> None:
        """Spin until the GPU reached ``marker`` (``device.progress()``); its waits are bounded by ``timeout_s``, so
        past ``timeout_s + POLL_SLACK_S`` the step is given up (``ep_comm.TimeoutError``: the stream's earlier work
        never finished, or a kernel hangs)."""
        reached = self.device.reached
        if reached(marker):
            return
        deadline = time.perf_counter() + self.timeout_s + POLL_SLACK_S
        while not reached(marker):
            if time.perf_counter() > deadline:
                missing = self.transport.wait_state()[0]
                raise self.steps.timed_out(what, missing) if missing else self.steps.stalled(
                    what, self.timeout_s + POLL_SLACK_S)
            time.sleep(0)

    def _raise_unchecked(self) -> None:
        """The routing error of the last ``cpu_sync=False`` dispatch of a new routing, if any rank's verdict was bad
        (every rank raises it at its next call, before that call does anything). Polls that dispatch's receive count
        when it has not finished yet (bounded, :meth:`_poll`)."""
        if self._unchecked is None:
            return
        (marker, step), self._unchecked = self._unchecked, None
        self._poll(marker, "dispatch")
        error = self._verdict(step)
        if error is not None:
            raise error

    def _verdict(self, step: str) -> Optional[RoutingError]:
        """The ``RoutingError`` of the routing verdicts in the record (every rank's, from the count exchange), or
        None when all are clean."""
        geo = self.geo
        words = record_verdict_words(self._record_host, geo.num_ranks)
        if verdicts_clean(words, geo.num_experts):
            return None
        return routing_error(record_verdicts(self._record_host, geo.num_ranks), geo.num_experts, step)

    def _after_host_wait(self, what: str) -> None:
        """After the host waited for this step's GPU wait: PeerAbortedError or ep_comm.TimeoutError as
        ``Steps.after_wait`` says (a peer's abort record: the rows of this step are not to be used). The abort
        records are read from the device only when a rank is missing or the mapped status record shows one
        (the wait kernel copies word 0 of every record there): no host round trip after a clean wait."""
        self.steps.after_wait(what, *self.transport.wait_state())

    # ---------------------------------------------------------------- dispatch
    def pack_fp8(self, x: Any) -> Fp8Rows:
        """The payload of an FP8 dispatch of ``x``, the pair ``(x_fp8 [T, H], scales [T, H / 128])`` or ``x [T, H]``
        in the buffer dtype (``Buffer.dispatch(use_fp8=True)``): an ``Fp8Rows`` over them (C-contiguous), from
        which the scatter writes the packed FP8 rows as it reads each row, quantizing ``x`` on the way (the bits of
        ``ep_comm.contract.fp8.quantize`` for finite ``x``; not checked for non-finite values, see ``ep_comm.kernels.fp8``).
        Nothing is launched here."""
        if isinstance(x, tuple):  # x_fp8 as its bits first: CuPy copies no float8 array
            return Fp8Rows(self._contiguous(x[0].view(np.uint8)), self._contiguous(x[1]), self.geo.dtype)
        return Fp8Rows(self._contiguous(x), None, self.geo.dtype)

    def dispatch(self, request: DispatchRequest) -> DispatchOutput:
        """One collective dispatch: a new routing (``request.handle`` None) or a replay of the handle's."""
        body = self._dispatch_new if request.handle is None else self._dispatch_cached
        return self._collective("dispatch", request.cpu_sync, "total", self._whole, body, request)

    def dispatch_send(self, request: DispatchRequest) -> ReceiveHalf[DispatchOutput]:
        """The send half of one collective dispatch (count, scatter, puts, signal; no wait), and its receive half."""
        body = self._dispatch_new if request.handle is None else self._dispatch_cached
        return self._split("dispatch", request.cpu_sync, body, request)

    def _planned(self, key: Any, roots: Sequence[Array], path: Callable[[], None]) -> None:
        """``path()`` (launches through ``Kernels``) as a launch plan of ``key`` over ``roots`` (``Plans.run``); run
        as it is while profiling (its phases) or capturing (what a capture holds is its own)."""
        if self.profile.enabled or self.capture.active:
            path()
            return
        self.plans.run(key, raw.stream(self.device.handle()), roots, path)

    def _scatter(self, request: DispatchRequest, routing: Routing, mode: int, local: Optional[tuple] = None) -> None:
        """Rank scatter of rows and meta rows into every destination (into the staging blocks with puts, which
        :meth:`_flush` sends); ``request.x`` and its weights C-contiguous; ``local``: ``(recv_x, received psum [R])``
        of a compact replay, where the rows for this rank itself go."""
        t = self.transport
        recv_x, recv_psum = local if local is not None else (None, None)
        with self.profile.phase("dispatch", "scatter"):
            self.kernels.scatter(request.x, routing.topk_idx, request.topk_weights, routing.dst_buffer_slot_idx,
                                 t.rows, t.meta, src_rank=self.rank, step=t.send_step, ahead=t.send_ahead, mode=mode,
                                 recv_x=recv_x, recv_psum=recv_psum)

    def _flush(self, seq: int, psum: Optional[Array]) -> None:
        """Puts only: send the staged rows and meta rows, ``psum`` (int32 ``[R]``) the inclusive prefix sum of the
        rows per destination."""
        if self.transport.use_puts:
            with self.profile.phase("dispatch", "puts"):
                self.transport.flush(self.kernels.stream, seq % 2, psum, with_meta=True)

    def _contiguous_request(self, request: DispatchRequest) -> DispatchRequest:
        """``request`` with ``x`` (an ``Fp8Rows``' arrays are already) and ``topk_weights`` C-contiguous (itself when
        they are)."""
        x = request.x if isinstance(request.x, Fp8Rows) else self._contiguous(request.x)
        weights = self._contiguous(request.topk_weights)
        if x is request.x and weights is request.topk_weights:
            return request
        return dataclasses.replace(request, x=x, topk_weights=weights)

    def _dispatch_new(self, seq: int, request: DispatchRequest, hooked: bool) -> Callable[[], DispatchOutput]:
        """The send half of a dispatch of a new routing; returns its receive half.

        One allocation before the first launch: the int32 block of the receive count (``Kernels.recv_words``) and
        of the count (``Kernels.send_words``); count and scatter run as one launch plan (ids out of range or named
        twice are read as "no expert" and make this rank's verdict, which the count words carry to every rank)."""
        k, stable, xp = self.kernels, self.deterministic, self.xp
        request = self._contiguous_request(request)
        idx, x, weights = request.topk_idx, request.x, request.topk_weights
        if self.capture.active:  # a replay's verdict is reported by this rank's next call (CapturePolicy)
            with self.profile.phase("dispatch", "check"):
                k.check_routing(idx, into=self.capture.checks)
        num_tokens = idx.shape[0]
        block = xp.empty(k.recv_words + k.send_words(num_tokens), np.int32)
        send_block = block[k.recv_words:]
        mode = SLOT_STABLE if stable else SLOT_ATOMIC

        def count_and_scatter() -> None:
            with self.profile.phase("dispatch", "count"):
                send = k.count(idx, stable=stable, block=send_block)
            self._scatter(request, Routing(idx, send.is_token_in_rank, send.slot_idx), mode)

        key = ("send", num_tokens, idx.dtype.char, payload_key(x), weights is not None, stable)
        roots = (idx, *payload_arrays(x), block) + (() if weights is None else (weights,))
        self._planned(key, roots, count_and_scatter)
        if self.transport.use_puts:
            self._flush(seq, k.send_layout(send_block, num_tokens).rank_psum)
        self._signal("dispatch", seq, hooked, k.count_words_view(send_block))
        routing = Routing(k.ids_view(send_block, num_tokens, idx.dtype), *k.routing_views(send_block, num_tokens))
        return functools.partial(self._receive_new, request, routing, block[:k.recv_words], hooked)

    def _receive_new(self, request: DispatchRequest, routing: Routing, block: Array, hooked: bool) -> DispatchOutput:
        """The receive half of a dispatch of a new routing: counts (into ``block``, int32 ``[recv_words]``, and the
        mapped record), then the rows into new outputs. ``cpu_sync``: one poll, then the routing error of any
        rank's bad verdict (every rank raises it here, in step), else the exact outputs; without it the next call
        checks the verdicts."""
        k, stable = self.kernels, self.deterministic
        self._wait("dispatch", hooked, with_counts=True)

        def receive_count() -> None:
            with self.profile.phase("dispatch", "receive_count"):
                k.receive_count(self._own_counts, self._own_meta, self.transport.step, alignment=request.expert_alignment,
                                expand=request.expand, stable=stable, block=block, record=self._record)

        self._planned(("receive_count", request.expand, request.expert_alignment, stable), (block,), receive_count)
        recv = k.receive_layout(block)
        if request.stats is not None:
            _add_counts(self.xp, request.stats, recv.num_unaligned_per_expert)
        step = self.steps.latest
        if request.cpu_sync:
            self._check_arrival(self.device.progress(), "dispatch")
            error = self._verdict(step)
            if error is not None:
                raise error
            num_recv, num_expanded, aligned = record_counts(self._record_host, self.geo.num_ranks,
                                                            self.geo.experts_per_rank)
            counts = (num_recv, num_expanded, aligned)
        else:
            if not self.capture.active:  # a captured dispatch's verdict: CapturePolicy.raise_for_checks
                self._unchecked = (self.device.progress(), step)
            counts = (recv.totals[0], recv.totals[1], recv.num_aligned_per_expert)
        return self._receive(request, routing, (recv.rank_psum, recv.expert_psum, recv.num_unaligned_per_expert),
                             counts, None, PLACE_STABLE if stable else PLACE_ATOMIC)

    def _dispatch_cached(self, seq: int, request: DispatchRequest, hooked: bool) -> Callable[[], DispatchOutput]:
        """The send half of a replay of the handle's routing (recorded slots and layout, no counting, no count
        exchange); returns its receive half. The outputs are allocated before the send; in compact mode the
        scatter writes the payload of this rank's rows to itself straight into ``recv_x`` and the receive skips
        them."""
        h, request = request.handle, self._contiguous_request(request)
        psum = h.psum_num_recv_tokens_per_rank
        if request.cpu_sync:
            counts = (int(h.num_recv_tokens), int(h.num_expanded_tokens),
                      [int(c) for c in _host(h.num_recv_tokens_per_expert)])
        else:
            counts = self._derived(h, "device_counts", _device_counts)
        outputs, block = self._alloc_outputs(request, counts[:2], h.recv_src_metadata)
        local = None if request.expand else (outputs[0], psum)
        x, weights = request.x, request.topk_weights
        roots = (*payload_arrays(x), h.topk_idx, h.dst_buffer_slot_idx) + ((block, psum) if local else ()) + (
            (weights,) if weights is not None else ())
        key = ("cached send", payload_key(x), h.topk_idx.dtype.char, weights is not None,
               None if local is None else outputs[0].shape)
        self._planned(key, roots, lambda: self._scatter(request, h.routing, SLOT_CACHED, local))
        if self.transport.use_puts:
            self._flush(seq, self._derived(h, "send_psum", _send_psum))
        self._signal("dispatch", seq, hooked)
        return functools.partial(self._receive_cached, request, counts, (outputs, block), hooked)

    def _receive_cached(self, request: DispatchRequest, counts: tuple, outputs: tuple, hooked: bool) -> DispatchOutput:
        """The receive half of a replay: the rows into the ``outputs`` allocated before the send."""
        h = request.handle
        psum = h.psum_num_recv_tokens_per_rank
        self._wait("dispatch", hooked, with_counts=False)
        arrived = self.device.progress() if request.cpu_sync else None
        if request.stats is not None:
            _add_counts(self.xp, request.stats, h.num_unaligned_recv_tokens_per_expert)
        layout = (psum, h.psum_num_recv_tokens_per_expert, h.num_unaligned_recv_tokens_per_expert)
        out = self._receive(request, h.routing, layout, counts, h.recv_src_metadata, PLACE_CACHED, outputs=outputs,
                            skip_source=-1 if request.expand else self.rank)
        if arrived is not None:
            self._check_arrival(arrived, "dispatch")
        return out

    def _derived(self, h: EPHandle, name: str, derive: Any) -> Any:
        """``derive(xp, h)``, computed once per handle and kept in ``h.derived``; under CUDA graph capture
        computed anew on every call (the capture holds what it allocates: a graph must not depend on a
        handle that its user may drop)."""
        if self.capture.active:
            return derive(self.xp, h)
        value = h.derived.get(name)
        if value is None:
            value = h.derived[name] = derive(self.xp, h)
        return value

    def _receive(self, request: DispatchRequest, routing: Routing, layout: tuple, counts: tuple,
                 recorded: Optional[Array], mode: int, *, outputs: Optional[tuple] = None,
                 skip_source: int = -1) -> DispatchOutput:
        """Allocate the outputs (unless given), copy the received rows into them, and make the handle.

        ``layout``: ``(rank_psum [R], expert_psum [L], unaligned counts [L])`` on the device;
        ``counts``: ``(received rows, expanded rows, aligned counts [L])``, host values with
        ``cpu_sync``; ``recorded``: the metadata of the handle replayed (its expanded rows are
        reused), or None; ``outputs``: ``(arrays, block)`` :meth:`_alloc_outputs` gave before the send, or None;
        ``skip_source``: the source whose payload rows the scatter already wrote into ``recv_x``
        (compact only), or -1. With ``cpu_sync=False`` (worst-case shapes) the copy is a launch plan."""
        rank_psum, expert_psum, unaligned = layout
        (recv_x, recv_idx, recv_w, metadata), block = (
            outputs if outputs is not None else self._alloc_outputs(request, counts[:2], recorded))

        def receive_copy() -> None:
            with self.profile.phase("dispatch", "receive_copy"):
                self.kernels.receive_copy(rank_psum, self._own_rows, self._own_meta, self.transport.step, recv_x,
                                          recv_idx, recv_w, metadata, expand=request.expand, mode=mode,
                                          expert_psum=expert_psum, alignment=request.expert_alignment,
                                          zero_padding=request.zero_padding, skip_source=skip_source)

        if request.cpu_sync:  # exact output shapes change from call to call: no plan
            receive_copy()
        else:
            key = ("receive copy", request.expand, request.expert_alignment, request.zero_padding, mode, skip_source,
                   recv_x.shape, recv_x.dtype.char, request.topk_weights is not None)
            self._planned(key, (rank_psum, expert_psum, block), receive_copy)
        received = Received(rank_psum, expert_psum, counts[2], unaligned, metadata, counts[0], counts[1],
                            int(recv_x.shape[0]))
        handle = make_handle(routing, received, request.topk_weights, geometry=self.geo, expand=request.expand,
                             expert_alignment=request.expert_alignment, zero_padding=request.zero_padding,
                             deterministic=self.deterministic, cpu_sync=request.cpu_sync)
        with_weights = request.topk_weights is not None
        return DispatchOutput(recv_x, recv_idx, recv_w if with_weights else None, handle)

    def _alloc_outputs(self, request: DispatchRequest, exact: tuple, recorded: Optional[Array]) -> tuple:
        """``((recv_x [rows, W], recv_topk_idx, recv_topk_weights, recv_src_metadata [N_out, 2+K]), block)``, not yet
        filled, carved from ``block``, one allocation; ``W`` is the payload's width (``request.x.shape[1]``: H, or
        fewer elements for packed FP8 rows, which the scatter writes and the receive kernels copy as any row's);
        ids/weights are ``[N_out, K]`` compact or ``[M_out]`` expand (the weights a scratch array when none
        were given)."""
        geo, expand = self.geo, request.expand
        with self.profile.phase("dispatch", "alloc outputs"):
            n_out, rows = geo.output_rows(exact if request.cpu_sync else None, expand, request.expert_alignment)
            ids_shape = (rows,) if expand else (rows, geo.num_topk)
            weighted = request.topk_weights is not None
            shapes = [((rows, request.x.shape[1]), geo.dtype), (ids_shape, np.int64),
                      ((n_out, 2 + geo.num_topk), np.int32)] + ([(ids_shape, np.float32)] if weighted else [])
            arrays, block = self.device.carve(shapes)
            recv_x, recv_idx, metadata = arrays[:3]
            recv_w = arrays[3] if weighted else self._scratch_weights(ids_shape)
            if recorded is not None and expand:
                m = min(n_out, recorded.shape[0])
                metadata[:m] = recorded[:m]
        return (recv_x, recv_idx, recv_w, metadata), block

    def _scratch_weights(self, shape: tuple) -> Array:
        """A float32 array of ``shape`` for the weights the kernels write when nobody asked for them: one
        reused array, or a new one held for the graph when captured (a later growth of the reused one
        would free it under the graph)."""
        size = math.prod(shape)  # a tuple of ints: no NumPy call
        if self.capture.active:
            return self.xp.empty(shape, dtype=np.float32)
        if self._scratch.size < size:
            self._scratch = self.xp.empty(size, dtype=np.float32)
        return self._scratch[:size].reshape(shape)

    # ----------------------------------------------------------------- combine
    def combine(self, request: CombineRequest) -> CombineOutput:
        """One collective combine of ``request.y`` along the routes of ``request.handle``."""
        return self._collective("combine", request.handle.cpu_sync, "total", self._whole, self._combine, request)

    def combine_send(self, request: CombineRequest) -> ReceiveHalf[CombineOutput]:
        """The send half of one collective combine (rows and weights back, puts, signal; no wait), and its receive
        half."""
        return self._split("combine", request.handle.cpu_sync, self._combine, request)

    def _combine(self, seq: int, request: CombineRequest, hooked: bool) -> Callable[[], CombineOutput]:
        """The send half of a combine; returns its receive half."""
        h, weights, y = request.handle, self._contiguous(request.topk_weights), self._contiguous(request.y)
        key = ("combine send", y.shape, y.dtype.char, h.expand, None if weights is None else weights.shape)
        roots = (y, h.recv_src_metadata, h.psum_num_recv_tokens_per_rank) + ((weights,) if weights is not None else ())
        with self.profile.phase("combine", "send"):
            self._planned(key, roots, lambda: self._combine_send(h, y, weights))
            self.transport.flush(self.kernels.stream, seq % 2, h.psum_num_recv_tokens_per_rank,
                                 with_meta=weights is not None)
        self._signal("combine", seq, hooked)
        return functools.partial(self._combine_receive, request, y, weights, hooked)

    def _combine_receive(self, request: CombineRequest, y: Array, weights: Optional[Array],
                         hooked: bool) -> CombineOutput:
        """The receive half of a combine: the wait, then the reduce (with this rank's own rows from ``y``)."""
        h = request.handle
        self._wait("combine", hooked, with_counts=False)
        arrived = self.device.progress() if h.cpu_sync else None
        with self.profile.phase("combine", "reduce"):
            x, back = self._combine_reduce(h, y, request.bias_terms, weights is not None)
        if arrived is not None:
            self._check_arrival(arrived, "combine")
        return CombineOutput(x, back)

    def _combine_send(self, h: EPHandle, y: Array, weights: Optional[Array]) -> None:
        """The rows of ``y`` back to their sources' buffers (compact: those of other sources only, the reduce
        reads this rank's own from ``y``) and the weights' return route (with puts into the staging blocks, which
        the caller then puts: the block of this rank's own compact rows too, unwritten and never read)."""
        xp, t, k = self.xp, self.transport, self.kernels
        k.combine_scatter(y, h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, t.rows, my_rank=self.rank,
                       step=t.send_step, ahead=t.send_ahead, expand=h.expand, weights=weights if h.expand else None)
        if weights is not None:
            bits = weights.view(xp.int32).reshape(weights.shape[0], weights.shape[1] if weights.ndim == 2 else 1)
            weight_return.send_weights(k.launcher, bits, h.expand, h.recv_src_metadata,
                                       h.psum_num_recv_tokens_per_rank, t.meta, my_rank=self.rank,
                                       step=t.send_step, ahead=t.send_ahead, max_blocks=k.num_blocks)

    def _combine_reduce(self, h: EPHandle, y: Array, bias_terms: Sequence[Array], with_weights: bool) -> tuple:
        """``(x [T, H], gathered weights [T, K] float32 or None)`` from the rows every rank sent back and,
        in compact mode, this rank's own rows straight from ``y``: one allocation for both, one launch plan."""
        xp, geo, t, k = self.xp, self.geo, self.transport, self.kernels
        terms = tuple(_bias_term(xp, b) for b in bias_terms)
        shapes = [((h.num_tokens, geo.hidden), geo.dtype)] + (
            [((h.num_tokens, geo.num_topk), np.float32)] if with_weights else [])
        arrays, block = self.device.carve(shapes)
        x, back = arrays[0], arrays[1] if with_weights else None
        own = {} if h.expand else dict(y=y, recv_rank_psum=h.psum_num_recv_tokens_per_rank)

        def reduce() -> None:
            k.combine_reduce(self._own_rows, t.step, h.dst_buffer_slot_idx, h.topk_idx, x, my_rank=self.rank,
                             bias=list(terms), **own)
            if with_weights:
                weight_return.gather_weights(k.launcher, self._own_meta, t.step, h.dst_buffer_slot_idx, h.topk_idx,
                                             back.view(xp.int32), experts_per_rank=geo.experts_per_rank,
                                             my_rank=self.rank, max_blocks=k.num_blocks)

        key = ("combine reduce", h.num_tokens, h.topk_idx.dtype.char, h.expand, with_weights,
               None if h.expand else y.shape, tuple(b.dtype.char for b in terms))
        roots = (h.dst_buffer_slot_idx, h.topk_idx, block) + (() if h.expand else (y, own["recv_rank_psum"])) + terms
        self._planned(key, roots, reduce)
        return x, back

    # ------------------------------------------------------------------- close
    def _close_step(self, seq: int) -> None:
        self._signal_and_wait("close", seq)
        self._check_arrival(self.device.progress(), "close")

    def close(self) -> None:
        """Collective close with a bounded wait after a clean run; after any failure (this rank's timeout or
        error, a peer's abort record) a local release: the symmetric heap is leaked and NVSHMEM's finalize
        skipped at exit (``transport.nvshmem_heap``), the communicator is not freed (collective)."""
        if self.transport is None:
            return
        clean = False
        try:
            if not self.steps.unusable:
                self._collective("close", True, "total", self._close_step)
                clean = True
        finally:
            self.device.synchronize()
            self.transport.close(collective=clean)
            self.transport = None
            self.capture.release()
            if clean:
                self.comm.Free()


def _host(values: Any) -> Sequence:
    """A host sequence of a host list or a device array."""
    return values.get() if hasattr(values, "get") else values


def _device_counts(xp: Any, h: EPHandle) -> tuple:
    """``(num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert)`` of handle ``h`` as device
    arrays, for the outputs of a ``cpu_sync=False`` replay. A ``cpu_sync=True`` handle holds the last two
    as host values: they are derived on the device from its unaligned counts (no host-to-device copy,
    which a CUDA graph capture cannot hold): the aligned counts, and their sum (expanded rows, padding
    included)."""
    received = h.psum_num_recv_tokens_per_rank[-1]
    if not h.cpu_sync:
        return received, h.num_expanded_tokens, h.num_recv_tokens_per_expert
    aligned = _align_up(h.num_unaligned_recv_tokens_per_expert.astype(xp.int32), h.expert_alignment)
    return received, aligned.sum(dtype=xp.int64), aligned


def _send_psum(xp: Any, h: EPHandle) -> Array:
    """int32 ``[R]``: inclusive prefix sum of the rows handle ``h`` sends to each rank (the puts' blocks)."""
    return xp.cumsum(h.is_token_in_rank.sum(axis=0, dtype=xp.int32), dtype=xp.int32)


def _align_up(values: Array, alignment: int) -> Array:
    """``values`` (a new device array, changed in place: no temporaries) rounded up to ``alignment``."""
    if alignment > 1:
        values += alignment - 1
        values //= alignment
        values *= alignment
    return values


def _add_counts(xp: Any, stats: Array, counts: Array) -> None:
    """``stats += counts`` in ``stats``'s dtype, without a temporary (a captured call must not free one)."""
    xp.add(stats, counts, out=stats, casting="unsafe")


def _bias_term(xp: Any, b: Array) -> Array:
    """A bias term the combine kernel reads: float32/float16/bfloat16 as is, other floats as float32."""
    kind = np.dtype(b.dtype)
    if kind.itemsize == 2 or kind == np.float32:
        return xp.ascontiguousarray(b)
    return xp.ascontiguousarray(b.astype(xp.float32))
