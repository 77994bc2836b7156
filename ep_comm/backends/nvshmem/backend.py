"""The ``nvshmem`` backend: the dispatch/combine protocol on GPUs over the NVSHMEM symmetric heap.

Same protocol and results as the ``mpi`` backend (``ep_comm/backends/mpi/backend.py``), bit for bit in
deterministic mode. The data path is ``ep_comm.launching.kernel_launches.Kernels``; per dispatch on rank ``me``:

1. ``count`` (new routing): per-rank/per-expert counts, ``is_token_in_rank``, slot cursors;
2. ``scatter``: each (token, destination) row and meta row straight into region ``[parity][me]``
   of the destination's symmetric buffer (stores through peer views; for a destination reached through puts, out of
   scale-up reach or with ``transport="puts"``, into a local staging block that ``nvshmem_puts.put_blocks`` sends). A replayed handle in compact
   mode allocates the outputs first and sends the payload of the rows for ``me`` itself straight to
   their ``recv_x`` rows instead (their meta rows still go to the own buffer);
3. signal ``step_word(seq, kind)`` to every rank, carrying this rank's per-destination counts (new
   routing: rows and entries per local expert), then a bounded GPU wait for every rank's signal
   (``ep_comm.transport.signals``);
4. ``receive_count`` (new routing; in compact mode from the count words alone) and ``receive_copy``
   into the outputs (after a compact replay without the payload of the rows from ``me``, already in
   place); a compact new routing with ``cpu_sync=False`` does both in one launch (``Kernels.receive_counted``).

Every step's signal advances the device step counter (``ep_comm.kernels.step_counter``): the kernels read
the step number and buffer parity from it, not from the host (the senders, before the signal, one
step ahead). The launches of a step are therefore the same at every step, and the ``cpu_sync=False``
calls (a dispatch of a new routing or of a handle, a combine) can be captured into a CUDA graph and
replayed, over stores, puts or both (``capture.py`` says what is refused).

Combine runs ``Kernels.combine_scatter`` back into the sources' buffers (plus the weights' return route when
weights are given, ``weight_return``), signal + wait, then ``combine_reduce`` with the bias. In
compact mode the rows this rank received from itself are not sent: ``combine_reduce`` reads their
partials straight from ``y`` (with one rank there is no send launch at all); expand mode sends its
own partials too (``combine_expand_kernel`` computes them).

Both end their send half through a route (``nvshmem.forwarding``): ``FlatRoute``, or with ``Buffer(forwarding=True)``
across several nodes ``ForwardedRoute``, which sends to the other nodes through their forwarders' inboxes (inbox send,
inbox signal and wait, relay; combine meta words, node reduce, the source's reduce in the forwarded order).

Everything is enqueued on the caller's current stream (``CupyDevice``), with Numba's
CUDA-array-interface stream sync off during our launches: every array we pass was made on, or
handed in for, that same stream. The host waits only where ``cpu_sync=True`` needs it, by polling a
progress marker (no stream synchronisation): a new routing reads its row counts, a combine reports a
timeout; a replay takes its counts from its handle and waits for nothing. With ``cpu_sync=False``
nothing waits on the host: outputs have the contract's worst-case rows, the true counts stay on the
device, and a timeout is reported by the next call (as for a replay).

The backend gets its transport (``ep_comm.transport.nvshmem.NvshmemTransport``) and device
(``CupyDevice``) from :meth:`NvshmemBackend.open`; the tests give it a loopback transport and a
host device instead, to run this whole call sequence in the Numba CUDA simulator. This module
imports no CuPy: it uses the device's array module.

A split step (``Buffer(..., return_recv_hook=True)``, :meth:`NvshmemDispatch.dispatch_send` and
:meth:`NvshmemCombine.combine_send`) enqueues its send half up to a signal that waits for nothing
(``signals.send_signal`` on peer stores, then the NVSHMEM signal of the peers reached through puts), and returns its receive half, which
enqueues ``signals.wait_signals`` and the receive on the hook's stream (made to wait for the send's when it
is another stream and nothing is captured). The two halves may be captured into two graphs: a hook is
captured exactly when its send was (``CapturePolicy.resume``).

``Buffer(profile=True)``: per-phase host time (perf_counter) and GPU time (CUDA events), read by
``Buffer.profile_table()``; a split step records ``send part``, ``signal``, ``hook`` and ``wait`` where a
plain one records ``total`` and ``signal+wait``.

Inputs: CuPy arrays, or any GPU array with DLPack / ``__cuda_array_interface__`` (PyTorch
tensors, zero copy). Outputs: CuPy arrays.

This module holds the class (its construction, inputs, close), composed of parts, each given what it works with
explicitly: ``nvshmem.steps`` (``StepRunner``: how a step runs: the caller's stream, taken when the step starts and
passed to every launch, signal and wait, hooks, polls, recorded calls, the routing verdicts; and ``NvshmemContext``,
the kernels, transport, device, runner and this rank's symmetric views the protocols share), ``nvshmem.dispatch``
and ``nvshmem.combine`` (``NvshmemDispatch``, ``NvshmemCombine``: the two halves of the protocol, the general
path, which the backend's ``dispatch``/``combine`` methods call), ``nvshmem.prepared`` (``PreparedCalls``: the
prepared path of a call shape seen before, ``backend.prepared``, which ``Buffer`` offers each eager call first,
running the protocols' pieces); ``sm_grid`` sizes the kernels' grids.
"""
from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm._launcher.recorded_calls import RecordedCalls
from ep_comm.backends.interface import BackendSettings, OperationRows, Traffic
from ep_comm.backends.nvshmem.combine import NvshmemCombine
from ep_comm.backends.nvshmem.dispatch import NvshmemDispatch
from ep_comm.backends.nvshmem.forwarding import FlatRoute, ForwardedRoute
from ep_comm.backends.nvshmem.prepared import PreparedCalls
from ep_comm.backends.nvshmem.steps import NvshmemContext, StepRunner
from ep_comm.backends.profile import ProfileRow
from ep_comm.backends.sm_grid import grid_shape, sms_in_effect
from ep_comm.contract import layout as lay
from ep_comm.contract.arrays import Array, to_host
from ep_comm.contract.forward_inbox import ForwardInbox
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import SymmetricLayout, word_dtype
from ep_comm.contract.topology import Topology
from ep_comm.contract.traffic import OPS
from ep_comm.launching.kernel_launches import Kernels, check_index_range

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types the backend accepts


def puts_peers(settings: BackendSettings, num_ranks: int, me: int) -> Tuple[int, ...]:
    """The ranks rank ``me`` reaches through NVSHMEM puts: every rank with ``transport="puts"`` (itself included),
    none with ``"stores"``, and with ``"auto"`` those out of its node (``settings.scaleup_ranks``), the rest through
    stores."""
    if settings.transport == "auto":
        topology = Topology.of(num_ranks, settings.scaleup_ranks)
        return tuple(r for r in range(num_ranks) if not topology.in_reach(me, r))
    return tuple(range(num_ranks)) if settings.transport == "puts" else ()


# the pieces of a forwarded step on this backend that are not built (docs/design.md, "Forwarding on nvshmem")
FORWARDING_NOT_BUILT = (
    "the inbox's staging blocks and puts (a forwarder or a rank of its node reached through NVSHMEM puts: "
    "transport='puts', or ranks out of load/store reach)",
)


def forward_inbox(num_ranks: int, settings: BackendSettings, sym: SymmetricLayout) -> Optional[ForwardInbox]:
    """The forwarding inbox after ``sym`` of a Buffer that forwards across several nodes (``settings.forwarding``
    with nodes of ``settings.scaleup_ranks`` ranks), or None: flat, or one node (every rank is its own node's: the
    forwarded results are the flat ones, as on the mpi backend). A forwarded step writes its node's ranks and the
    other nodes' inboxes through peer views, so ``transport="puts"`` (every rank through puts) raises ValueError, before
    anything is allocated, naming what is not built (:data:`FORWARDING_NOT_BUILT`); with ``"auto"`` every rank must be
    in load/store reach (``NvshmemTransport`` raises otherwise, on every rank). Every rank agreed on these settings
    (``contract.agreement``), so every rank raises alike."""
    if not settings.forwarding:
        return None
    topology = Topology.of(num_ranks, settings.scaleup_ranks)
    if topology.num_nodes == 1:
        return None
    if settings.transport != "auto":
        raise ValueError(f"forwarding=True with {topology.num_nodes} nodes (scaleup_ranks={settings.scaleup_ranks} of "
                         f"{num_ranks} ranks) and transport={settings.transport!r}: on nvshmem "
                         + "; ".join(FORWARDING_NOT_BUILT) + " are not built; use transport='auto' (every rank in "
                         "load/store reach), forwarding=False, or backend='mpi'")
    return ForwardInbox(sym, topology.scaleup_ranks)


class NvshmemBackend:
    """GPU backend. Arrays in: CuPy / DLPack / ``__cuda_array_interface__``; arrays out: CuPy.

    ``transport``: an ``NvshmemTransport`` (or its loopback twin in the tests); ``device``: a
    ``CupyDevice`` (or its host twin), whose ``xp`` is the array module; ``comm``: this backend's own
    communicator (freed at a clean close); ``num_sms``: the SM count in effect; ``launch``: the
    ``Kernels`` launch shape (``sm_grid.grid_shape``).

    Composed of: ``kernels`` (``Kernels``), ``runner`` (``StepRunner``: how a step runs), ``ctx``
    (``NvshmemContext``: what the protocols work with), the protocols ``dispatcher`` (``NvshmemDispatch``) and
    ``combiner`` (``NvshmemCombine``), which the ``Backend`` methods of dispatch and combine call, and ``prepared``
    (``PreparedCalls``).
    """

    name = "nvshmem"

    def __init__(self, comm: MPI.Comm, geo: Geometry, settings: BackendSettings, *, transport: Any, device: Any,
                 num_sms: int, launch: Dict[str, int]):
        xp = device.xp
        self.xp = xp
        self.comm, self.rank, self.geo = comm, comm.rank, geo
        self.num_sms: Optional[int] = num_sms
        self.transport, self.device = transport, device
        self.transport_name = transport.mode
        transport.measuring = settings.wait_stats
        self.kernels = Kernels(xp, num_ranks=geo.num_ranks, num_experts=geo.num_experts, num_topk=geo.num_topk,
                               max_tokens=geo.max_tokens, **launch)
        self.runner = StepRunner(self.rank, geo, settings.timeout_s, settings.profile, transport, device,
                                 RecordedCalls(self.kernels.prebound, device.allocations_into, device.array_pointers))
        own = transport.own
        self.ctx = NvshmemContext(geo, self.rank, settings.deterministic, xp, self.kernels, transport, device,
                                  self.runner, device.kernel_array(own.rows), device.kernel_array(own.meta),
                                  device.kernel_array(own.counts), Topology.of(geo.num_ranks, settings.scaleup_ranks),
                                  xp.zeros(len(OPS), np.int64))
        self._closed_rows: Optional[OperationRows] = None  # the scale-out rows at the close (traffic)
        route = FlatRoute(self.ctx) if transport.forward is None else ForwardedRoute(self.ctx)
        self.dispatcher, self.combiner = NvshmemDispatch(self.ctx, route), NvshmemCombine(self.ctx, route)
        # the Backend interface's calls of the protocols, bound to them once
        d, c = self.dispatcher, self.combiner
        self.pack_fp8, self.dispatch, self.dispatch_send = d.pack_fp8, d.dispatch, d.dispatch_send
        self.combine, self.combine_send = c.combine, c.combine_send
        # the prepared paths of the eager calls (Buffer offers each call there); a forwarded step takes the general path
        self.prepared: Optional[PreparedCalls] = None if transport.forward is not None else PreparedCalls(
            self.ctx, self.dispatcher, self.combiner)

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
            everything released, when that exceeds any rank's SM count; the duplicated communicator is freed too
            when building the transport raises). ``settings.forwarding`` with several nodes and what is not built of
            it raises ValueError before anything is allocated (:func:`forward_inbox`).
        """
        sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize,
                              geo.experts_per_rank)
        inbox = forward_inbox(geo.num_ranks, settings, sym)  # before anything is allocated
        check_index_range(geo.num_ranks, geo.max_tokens, geo.num_topk)  # before anything collective is allocated
        comm = comm.Dup()
        try:
            transport = transport_type(comm, sym, word_dtype(geo.hidden, geo.dtype.itemsize),
                                       puts_peers(settings, geo.num_ranks, comm.rank), inbox)
        except BaseException:  # the heap was not built: nothing else to release
            comm.Free()
            raise
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

    def capturing(self) -> bool:
        """Whether the caller's stream is being captured into a CUDA graph now."""
        return self.runner.capture.capturing()

    def routing_summary(self, topk_idx: Array) -> Tuple[int, int]:
        """``(largest id, first row naming an expert twice or -1)`` of a non-empty routing of signed ids
        (``Buffer`` passes unsigned ones as int64): one kernel and one read.

        Under CUDA graph capture nothing can be read back: the check kernel folds its result into the
        capture policy's record, which the first call after the replays reads, and ``(-1, -1)``
        ("nothing wrong yet") is returned. The kernels read ids past the experts as "no expert"
        meanwhile (``ep_comm.kernels.expert_ids``)."""
        capture = self.runner.capture
        if capture.capturing():
            with self.runner.launching() as stream:
                self.kernels.check_routing(topk_idx, into=capture.checks, stream=stream)
            return -1, -1
        capture.raise_for_checks()
        with self.runner.launching() as stream:
            top, twice = to_host(self.kernels.check_routing(topk_idx, stream=stream)).tolist()
        return int(top), int(twice)

    def dispatch_layout(self, topk_idx: Array) -> lay.DispatchLayout:
        """``ep_comm.contract.layout.dispatch_layout`` by the count kernel (no host synchronisation)."""
        with self.runner.launching() as stream:
            send = self.kernels.count(topk_idx, stable=False, stream=stream)
        return lay.DispatchLayout(send.num_tokens_per_rank, send.num_tokens_per_expert, send.is_token_in_rank)

    def captured_memory(self) -> ContextManager[None]:
        """Around a whole ``Buffer`` call: the capture policy's hold on what it allocates under capture."""
        return self.runner.capture.memory()

    def profile_table(self) -> List[ProfileRow]:
        """Median host and GPU microseconds per (operation, phase) so far."""
        return self.runner.profile.table()

    def traffic(self) -> Traffic:
        """``scaleout_rows``: the rows the kernels counted on the device so far (``ctx.scaleout``, read after the
        work enqueued on the caller's stream: it waits for it), or after ``close`` those up to the close.

        The kernels count (``ep_comm.kernels.traffic``), so that ``cpu_sync=False`` steps and CUDA-graph replays
        count too: a dispatch, one launch of ``Kernels.dispatch_rows`` after its scatter, from the routing's
        ``is_token_in_rank`` (the one array a new routing, in its count block, and a replay, in its handle, both
        have: the count kernel does not run in a replay and counts ranks, not nodes); a flat combine, one one-warp
        launch of ``Kernels.combine_rows`` after its send, from the handle's received psum; a forwarded combine, in
        the node reduce that puts the rows (no launch). In one node nothing is launched."""
        return Traffic(self._closed_rows if self.transport is None else self._scaleout_rows())

    def _scaleout_rows(self) -> OperationRows:
        """A host copy of the scale-out row counter (after the work enqueued on the caller's stream)."""
        return OperationRows(*(int(rows) for rows in to_host(self.ctx.scaleout).tolist()))

    def wait_table(self) -> Any:
        """A host copy of the wait statistics the wait kernel keeps (``transport.waits``), after the work enqueued on
        the caller's stream."""
        return self.transport.wait_table()

    def reset_waits(self) -> None:
        self.transport.reset_waits()

    # ------------------------------------------------------------------- close
    def _close_step(self, seq: int, stream: Any) -> None:
        """The close step's signal and wait on ``stream``, and its poll."""
        self.runner.signal_and_wait("close", stream)
        self.runner.check_arrival(self.device.progress(), "close")

    def close(self) -> None:
        """Collective close with a bounded wait after a clean run; after any failure (this rank's timeout or
        error, a peer's abort record) a local release: the symmetric heap is leaked and NVSHMEM's finalize
        skipped at exit (``transport.nvshmem_heap``), the communicator is not freed (collective)."""
        if self.transport is None:
            return
        clean = False
        try:
            if not self.runner.steps.unusable:
                self.runner.collective("close", True, "total", self._close_step)
                clean = True
        finally:
            self.device.synchronize()
            self._closed_rows = self._scaleout_rows()
            self.transport.close(collective=clean)
            self.transport = None
            self.runner.capture.release()
            if clean:
                self.comm.Free()

