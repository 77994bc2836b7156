"""The dispatch protocol of ``NvshmemBackend`` (``NvshmemDispatch``, given an ``NvshmemContext``): the FP8 payload,
the send half of a new routing (count and scatter, the count exchange) or of a handle's replay (recorded slots,
outputs allocated first), and their receive halves (receive count, the rows into the outputs, the handle). Their
steps are written once, for both paths: ``NvshmemDispatch.new_send`` and ``new_receive``, ``replay_send`` and
``replay_receive``; the prepared path runs them too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from ep_comm._launcher.recorded_calls import FixedArguments
from ep_comm.backends.interface import DispatchRequest, ReceiveHalf
from ep_comm.backends.nvshmem.forwarding import Arrive, FlatRoute, Sent
from ep_comm.backends.nvshmem.routing_roots import COUNT_ROOT, HANDLE_ROOTS, HeldRoots, handle_roots, routing_arrays
from ep_comm.backends.nvshmem.steps import Launch, NvshmemContext, launch_now
from ep_comm.contract.arrays import Array, to_host
from ep_comm.contract.symmetric import record_counts
from ep_comm.handle import DispatchOutput, EPHandle, make_handle
from ep_comm.launching import kernel_launches
from ep_comm.launching.fp8 import Fp8Rows


class NvshmemDispatch:
    """``NvshmemBackend``'s ``pack_fp8``, ``dispatch`` and ``dispatch_send``, over the backend's context ``ctx``; its
    steps run through ``ctx.runner``, its rows travel by ``route`` (a ``FlatRoute``, or a ``ForwardedRoute`` through
    the forwarders). Its pieces (counts, scatter, receive) are public to the prepared path."""

    def __init__(self, ctx: NvshmemContext, route: FlatRoute):
        self.route = route
        self.ctx, self.geo, self.rank, self.xp = ctx, ctx.geo, ctx.rank, ctx.xp
        self.kernels, self.transport, self.device, self.runner = ctx.kernels, ctx.transport, ctx.device, ctx.runner
        self.profile, self.capture = ctx.runner.profile, ctx.runner.capture
        self.deterministic = ctx.deterministic
        self._record_shape = (ctx.geo.num_ranks, ctx.geo.experts_per_rank)  # how received_counts reads the record
        # the receive placement of a new routing: stable (deterministic) or atomic
        self.place_mode = kernel_launches.PLACE_STABLE if ctx.deterministic else kernel_launches.PLACE_ATOMIC
        self._scratch = ctx.xp.empty(0, dtype=np.float32)  # weight outputs nobody asked for
        self._puts_phase = functools.partial(self.profile.phase, "dispatch", "puts")  # made only where puts run
        self._puts = bool(ctx.transport.puts_to)  # a rank reached through puts: a send flushes its staged rows
        self._count_carvings: Dict[tuple, tuple] = {}  # count_carvings' by argument
        self._pointers = ctx.device.array_pointers  # the recorded calls' (a handle's arrays are read once with them)

    def pack_fp8(self, x: Any) -> Fp8Rows:
        """The payload of an FP8 dispatch of ``x``, the pair ``(x_fp8 [T, H], scales [T, H / 128])`` or ``x [T, H]``
        in the buffer dtype (``Buffer.dispatch(use_fp8=True)``): an ``Fp8Rows`` over them (C-contiguous), from
        which the scatter writes the packed FP8 rows as it reads each row, quantizing ``x`` on the way (the bits of
        ``ep_comm.contract.fp8.quantize`` for finite ``x``; not checked for non-finite values, see ``ep_comm.kernels.fp8``).
        Nothing is launched here."""
        if isinstance(x, tuple):  # x_fp8 as its bits first: CuPy copies no float8 array
            return Fp8Rows(self.ctx.as_rows(x[0].view(np.uint8)), self.ctx.as_contiguous(x[1]), self.geo.dtype)
        return Fp8Rows(self.ctx.as_rows(x), None, self.geo.dtype)

    def dispatch(self, request: DispatchRequest) -> DispatchOutput:
        """One collective dispatch: a new routing (``request.handle`` None) or a replay of the handle's."""
        body = self._dispatch_new if request.handle is None else self._dispatch_cached
        return self.runner.collective("dispatch", request.cpu_sync, "total", self.runner.plain_step, body, request)

    def dispatch_send(self, request: DispatchRequest) -> ReceiveHalf[DispatchOutput]:
        """The send half of one collective dispatch (count, scatter, puts, signal; no wait), and its receive half."""
        body = self._dispatch_new if request.handle is None else self._dispatch_cached
        return self.runner.split("dispatch", request.cpu_sync, body, request)

    def scatter(self, stream: Any, x: Any, idx: Array, weights: Optional[Array], slot_idx: Array, in_rank: Array,
                mode: int, local: Optional[tuple] = None) -> None:
        """Rank scatter, on ``stream``, of rows ``x [T, W]`` (C-contiguous, or an ``Fp8Rows``) and meta rows (ids
        ``idx [T, K]``, float32 ``weights [T, K]`` or None) into every destination, at ``slot_idx [T, K]`` int32 (into
        the staging blocks with puts, which the send steps then put; forwarded, only those of this rank's node:
        ``route.written``), and the dispatch's scale-out rows from its ``in_rank [T, R]`` bool (``is_token_in_rank``)
        counted (``route.count_dispatch``); ``local``: ``(recv_x, received psum [R])`` of a compact replay, where the
        rows for this rank itself go."""
        t = self.transport
        recv_x, recv_psum = local if local is not None else (None, None)
        with self.profile.phase("dispatch", "scatter"):
            self.kernels.scatter(x, idx, weights, slot_idx, t.rows, t.meta, src_rank=self.rank, step=t.step, ahead=1,
                                 mode=mode, stream=stream, recv_x=recv_x, recv_psum=recv_psum,
                                 written=self.route.written)
            self.route.count_dispatch(stream, in_rank)

    def _contiguous_request(self, request: DispatchRequest) -> DispatchRequest:
        """``request`` with ``x`` as the kernels read rows (``NvshmemContext.as_rows``; an ``Fp8Rows``' arrays are
        already) and ``topk_weights`` C-contiguous (itself when they are)."""
        x = request.x if isinstance(request.x, Fp8Rows) else self.ctx.as_rows(request.x)
        weights = self.ctx.as_contiguous(request.topk_weights)
        if x is request.x and weights is request.topk_weights:
            return request
        return dataclasses.replace(request, x=x, topk_weights=weights)

    def _dispatch_new(self, seq: int, stream: Any, request: DispatchRequest,
                      hooked: bool) -> Callable[[Any], DispatchOutput]:
        """The send half of a dispatch of a new routing, on ``stream`` (the routing check of a captured call, then
        :meth:`new_send`, then the route's end of the send half: the signal with the count words); returns its
        receive half.

        One allocation before the first launch: the count block (:meth:`count_carvings`; ids out of range or named
        twice are read as "no expert" and make this rank's verdict, which the count words carry to every rank)."""
        request = self._contiguous_request(request)
        idx = request.topk_idx
        if self.capture.active:  # a replay's verdict is reported by this rank's next call (CapturePolicy)
            with self.profile.phase("dispatch", "check"):
                self.kernels.check_routing(idx, into=self.capture.checks, stream=stream)
        launch, views = self.count_carvings(idx.shape[0], idx.dtype, not request.cpu_sync)
        block, (words, *slots) = launch.new()  # slots: [slot_idx] where the route reads them (count_carvings), else []
        self.new_send(self.runner.run_recorded, stream, idx, request.x, request.topk_weights, block)
        arrive = self.route.dispatch_sent(stream, hooked, Sent(request.x, idx, request.topk_weights,
                                                               slots[0] if slots else None, words))
        return functools.partial(self._receive_new, request, block, views, arrive)

    def _receive_new(self, request: DispatchRequest, block: Array, views: Any, arrive: Arrive,
                     stream: Any) -> DispatchOutput:
        """The receive half of a dispatch of a new routing, on ``stream``: the route's start of it (a split step's
        wait; forwarded, the relay first), :meth:`new_receive` (outputs of the worst case, or with ``cpu_sync`` exact
        ones after the poll, their copy then not recorded), the ids the route keeps, the stats."""
        arrive(stream)
        expand, weighted = request.expand, request.topk_weights is not None
        worst = None if request.cpu_sync else self._carved_outputs(request, None)
        options = self.receive_options(expand, request.expert_alignment, request.zero_padding, True, weighted,
                                       self.counts_in_copy(expand, worst is not None))
        plan = RoutingPlan(options, views)
        out = self.new_receive(self.runner.run_recorded, stream, block, plan, request.topk_weights, request.cpu_sync,
                               worst, functools.partial(self._exact_outputs, request))
        self.route.keep_ids(out.handle, out.recv_topk_idx)
        if request.stats is not None:
            _add_counts(self.xp, request.stats, out.handle.num_unaligned_recv_tokens_per_expert)
        return out

    def new_send(self, launch: Launch, stream: Any, idx: Array, x: Any, weights: Optional[Array],
                 block: Array) -> None:
        """The send steps of a new routing ``idx [T, K]`` (both paths run these, in this order), on ``stream``: count
        and scatter (:meth:`count_and_scatter`, launched by ``launch``: a :data:`Launch`) of ``x`` and ``weights``
        into count block ``block``, then the puts of the staged rows (the route's: none forwarded)."""
        launch(self.count_and_scatter, stream, idx, x, weights, block)
        if self._puts:
            self.route.flush(functools.partial(self.transport.flush, stream,
                                               functools.partial(self.send_psum, block, idx.shape[0]), with_meta=True,
                                               timed=self._puts_phase))

    def new_receive(self, launch: Launch, stream: Any, block: Array, plan: RoutingPlan, weights: Optional[Array],
                    cpu_sync: bool, worst: Optional[tuple], exact: Callable[[int, int], tuple]) -> DispatchOutput:
        """The receive steps of a new routing after its wait (both paths run these, in this order), on ``stream``:
        the receive count into count block ``block`` (unless the copy counts, ``plan.options.counted``), then the receive
        copy, then the handle's views of the block, then the verdicts (deferred with ``cpu_sync=False``, else one
        poll and raised) and the outputs. The poll's marker is taken after the receive count, or after the counting
        copy (then the record's tag, written before the copy ends, may end the poll first: ``received_counts``).

        Args:
            launch: how the pieces are launched (a :data:`Launch`).
            worst: ``(carving, block, scratch)`` of worst-case outputs (:meth:`replay_send`'s ``outputs``), copied
                into before the poll (``cpu_sync``: the outputs are then views of their first received rows); None:
                ``exact(received rows, expanded rows)`` gives ``(carving, block, launch, scratch)`` of exact ones
                after the poll, and how their copy is launched.
        """
        options = plan.options
        if not options.counted:
            launch(self.receive_count, stream, block, options.expand, options.alignment)
        # after the receive count: the poll does not wait for the copy (None: a counting copy's, taken after it)
        marker = self.device.progress() if cpu_sync and not options.counted else None
        rows = None  # the outputs' rows where they are views of the first rows of worst-case ones
        if worst is None:
            num_recv, num_expanded, aligned = self.received_counts(marker)
            carving, out_block, copy, scratch = exact(num_recv, num_expanded)
        else:
            (carving, out_block, scratch), copy = worst, launch
        copy(self.carved_receive_copy, stream, options, carving, out_block, scratch, block)
        ids, in_rank, slots, rank_psum, expert_psum, unaligned, *device_counts = plan.views.views(block)
        if not cpu_sync:
            self.runner.defer_verdict()  # after the launch that writes the record
            aligned, num_recv, num_expanded = device_counts
        elif worst is not None:  # the copy is enqueued: the poll, then views of the exact rows
            num_recv, num_expanded, aligned = self.received_counts(marker)
            rows, scratch = num_recv, None
        arrays = arranged_outputs(carving.views(out_block, rows), options.weighted, scratch)
        received = (rank_psum, expert_psum, aligned, unaligned, num_recv, num_expanded)
        counted = ((plan.views, block), ids, in_rank, slots, rank_psum, expert_psum)  # routing_roots.COUNT_ROOT's
        return self.output(options, arrays, received, (ids, in_rank, slots), weights, cpu_sync, counted)

    def send_block(self, block: Array) -> Array:
        """The count's ``[Kernels.send_words(T)]`` words of a new routing's count block (int32, one allocation: the
        receive count's ``[Kernels.recv_words]`` words first, then these)."""
        return block[self.kernels.recv_words:]

    def receive_block(self, block: Array) -> Array:
        """The receive count's ``[Kernels.recv_words]`` words of a new routing's count block (:meth:`send_block`)."""
        return block[:self.kernels.recv_words]

    def send_psum(self, block: Array, num_tokens: int) -> Array:
        """The send psum (int32 ``[R]``: inclusive prefix sum of the rows per destination, the puts' blocks) in count
        block ``block`` of a new routing of ``num_tokens`` tokens (:meth:`send_block`)."""
        return self.kernels.send_layout(self.send_block(block), num_tokens).rank_psum

    def count_carvings(self, num_tokens: int, ids_dtype: Any, device_counts: bool) -> tuple:
        """``(launch, handle)``: the device's recarvings of the count block of a new routing of ``num_tokens`` tokens
        (ids of ``ids_dtype``; :meth:`send_block`). ``launch.new()`` gives the block and what its launches take
        besides it, ``(count_words,)`` (the signal's words; also ``slot_idx`` where the route reads it,
        ``route.reads_slots``; the recorded calls take the whole block as their root); ``handle.views(block)``
        what the handle holds, made after the launches: ``(the ids' copy, is_token_in_rank, slot_idx, the receive
        count's rank psum, expert psum, unaligned counts)`` and, ``device_counts`` (``cpu_sync=False``), its aligned
        counts, received rows N and expanded rows M (0-d arrays). Kept per argument (a full table is cleared)."""
        key = (num_tokens, ids_dtype, device_counts)
        held = self._count_carvings.get(key)
        if held is None:
            if len(self._count_carvings) >= _MAX_COUNT_CARVINGS:
                self._count_carvings.clear()
            held = self._count_carvings[key] = self._new_count_carvings(num_tokens, ids_dtype, device_counts)
        return held

    def _new_count_carvings(self, num_tokens: int, ids_dtype: Any, device_counts: bool) -> tuple:
        """:meth:`count_carvings`, made anew (from one block of the layout)."""
        k, recarving = self.kernels, self.device.recarving
        block = self.xp.empty(k.recv_words + k.send_words(num_tokens), np.int32)
        send, recv = k.send_layout(self.send_block(block), num_tokens), k.receive_layout(self.receive_block(block))
        views = (k.ids_view(self.send_block(block), num_tokens, ids_dtype), send.is_token_in_rank, send.slot_idx,
                 recv.rank_psum, recv.expert_psum, recv.num_unaligned_per_expert)
        if device_counts:
            views += (recv.num_aligned_per_expert, recv.totals[:1].reshape(()), recv.totals[1:].reshape(()))
        launched = (send.count_words, send.slot_idx) if self.route.reads_slots else (send.count_words,)
        return recarving(block, launched), recarving(block, views)

    def count_and_scatter(self, stream: Any, idx: Array, x: Any, weights: Optional[Array], block: Array) -> None:
        """On ``stream``: count routing ``idx [T, K]`` into the count block ``block`` (:meth:`send_block`), then
        scatter ``x`` with its ``weights`` at the slots the count assigned (stable ones where ``Kernels.send_stable``
        says so)."""
        stable = self.kernels.send_stable(idx.shape[0], self.deterministic)
        with self.profile.phase("dispatch", "count"):
            send = self.kernels.count(idx, stable=stable, stream=stream, block=self.send_block(block))
        mode = kernel_launches.SLOT_STABLE if stable else kernel_launches.SLOT_ATOMIC
        self.scatter(stream, x, idx, weights, send.slot_idx, send.is_token_in_rank, mode)

    def receive_count(self, stream: Any, block: Array, expand: bool, alignment: int) -> None:
        """The receive count of a new routing, on ``stream``, into the count block ``block`` (its
        :meth:`receive_block`) and the runner's mapped record."""
        with self.profile.phase("dispatch", "receive_count"):
            self.kernels.receive_count(self.ctx.own_counts, self.ctx.own_meta, self.transport.step, alignment=alignment,
                                       expand=expand, stable=self.deterministic, stream=stream,
                                       block=self.receive_block(block), record=self.runner.record)

    def counts_in_copy(self, expand: bool, worst: bool) -> bool:
        """Whether a new routing's receive counts in its copy's launch (:meth:`receive_copy`'s ``counted``): compact
        and copied into ``worst``-case outputs, enqueued before any poll (every ``cpu_sync=False`` call, and a
        ``cpu_sync=True`` one whose outputs are views of their first rows: the prepared path's decode shapes); not
        where exact outputs are allocated after the poll (their copy needs the counts first), nor when switched back
        (``Kernels.counted_copy``)."""
        return worst and not expand and self.kernels.counted_copy

    def received_counts(self, marker: Any = None) -> tuple:
        """``(received rows, expanded rows, aligned counts [L])`` as host ints, from the mapped record of this
        step's receive count, after one poll of ``marker`` (a ``device.progress()`` taken after the receive count;
        None: one taken now) or of the record's tag (``StepRunner.check_arrival``); the routing error of any rank's bad
        verdict instead."""
        runner = self.runner
        step = runner.steps.latest
        runner.check_arrival(self.device.progress() if marker is None else marker, "dispatch", True)
        words = runner.record_host.tolist()  # one read of the mapped record: the verdicts, then the counts
        error = runner.verdict(step, words)
        if error is not None:
            raise error
        return record_counts(words, *self._record_shape)

    def _dispatch_cached(self, seq: int, stream: Any, request: DispatchRequest,
                         hooked: bool) -> Callable[[Any], DispatchOutput]:
        """The send half, on ``stream``, of a replay of the handle's routing (:meth:`replay_send`; the outputs
        allocated first, exact with ``cpu_sync``, their receive copy then not recorded); returns its receive half."""
        h, request = request.handle, self._contiguous_request(request)
        if request.cpu_sync:
            counts = host_counts(h)
        else:
            counts = self.device_counts(h)
        weighted = request.topk_weights is not None
        outputs = self._carved_outputs(request, counts[:2])
        made = self.replay_send(self.runner.run_recorded, stream, request.x, h, request.topk_weights, outputs, weighted)
        arrive = self.route.dispatch_sent(stream, hooked, Sent(request.x, h.topk_idx, request.topk_weights,
                                                               h.dst_buffer_slot_idx, None))
        return functools.partial(self._receive_cached, request, counts, outputs, made, arrive)

    def _receive_cached(self, request: DispatchRequest, counts: tuple, outputs: tuple, made: tuple,
                        arrive: Arrive, stream: Any) -> DispatchOutput:
        """The receive half of a replay, on ``stream``: the route's start of it, the stats, then
        :meth:`replay_receive` into the ``outputs`` allocated before the send (``made``: what the send returned), the
        ids the route keeps."""
        h = request.handle
        arrive(stream)
        if request.stats is not None:
            _add_counts(self.xp, request.stats, h.num_unaligned_recv_tokens_per_expert)
        options = self.receive_options(request.expand, request.expert_alignment, request.zero_padding, False,
                                       request.topk_weights is not None)
        copy = launch_now if request.cpu_sync else self.runner.run_recorded
        arrays = self.replay_receive(copy, stream, outputs, options, made)
        received = (h.psum_num_recv_tokens_per_rank, h.psum_num_recv_tokens_per_expert, counts[2],
                    h.num_unaligned_recv_tokens_per_expert, counts[0], counts[1])
        out = self.output(options, arrays, received, h.routing, request.topk_weights, request.cpu_sync,
                          h.derived.get(COUNT_ROOT), h.derived.get(HANDLE_ROOTS))
        self.route.keep_ids(out.handle, out.recv_topk_idx)
        return out

    def replay_send(self, launch: Launch, stream: Any, x: Any, h: EPHandle, weights: Optional[Array], outputs: tuple,
                    weighted: bool) -> tuple:
        """The send steps of a replay of handle ``h`` (both paths run these, in this order), on ``stream``: in expand
        mode the outputs' arrays first, the handle's expanded rows copied into their metadata (not received again);
        the scatter of ``x`` (and ``weights``) at the handle's recorded slots (compact: this rank's own rows straight
        into ``recv_x``, made inside the launch, which the receive then skips); the puts of the staged rows (the
        route's: none forwarded). No count exchange: the handle gave every count.

        Args:
            launch: how the scatter is launched (:data:`Launch`: a recorded call or as it is).
            outputs: ``(carving, block, scratch)``: the outputs' recarving (:meth:`output_carving`), a new block of
                its layout, and the float32 weights the kernels write where none are carved (else None).
            weighted: whether the outputs carve weights.

        Returns:
            What :meth:`replay_receive` takes as ``made``: the outputs' arrays ``(recv_x, recv_topk_idx,
            recv_topk_weights, recv_src_metadata)`` where made (expand), else None; and the handle's routing
            (``routing_roots.handle_roots``' ``routing``).
        """
        carving, block, scratch = outputs
        arrays, routing = None, handle_roots(h, self._pointers)[0]
        if h.expand:
            arrays = arranged_outputs(carving.views(block), weighted, scratch)
            metadata, recorded = arrays[3], h.recv_src_metadata  # the recorded rows that fit (worst-case outputs)
            rows = min(metadata.shape[0], recorded.shape[0])
            metadata[:rows] = recorded[:rows]
            carving = block = None  # every row is sent, none written into recv_x by the scatter
        launch(self.replay_scatter, stream, x, weights, routing, carving, block)
        if self._puts:
            self.route.flush(functools.partial(self.transport.flush, stream,
                                               functools.partial(self.handle_value, h, "send_psum", _send_psum),
                                               with_meta=True, timed=self._puts_phase))
        return arrays, routing

    def replay_receive(self, launch: Launch, stream: Any, outputs: tuple, options: CopyOptions, made: tuple) -> tuple:
        """The receive steps of a replay after its wait (both paths run these), on ``stream``: the received rows into
        ``outputs`` (:meth:`replay_send`'s), launched by ``launch``, ``options`` as :meth:`receive_copy` takes them;
        the outputs' arrays. ``made``: what :meth:`replay_send` returned (the arrays where it made them, else they are
        made after the launch; the handle's routing)."""
        carving, block, scratch = outputs
        arrays, routing = made
        launch(self.carved_receive_copy, stream, options, carving, block, scratch, routing)
        return arrays if arrays is not None else arranged_outputs(carving.views(block), options.weighted, scratch)

    def replay_scatter(self, stream: Any, x: Any, weights: Optional[Array], routing: Any, carving: Any,
                       block: Optional[Array]) -> None:
        """A replay's scatter (:meth:`scatter` of ``x`` and ``weights`` at the recorded slots of ``routing``,
        ``routing_roots.handle_roots``' ``routing`` for the handle); compact (``carving`` not None), this rank's own
        rows straight into ``recv_x``, ``carving``'s first view of ``block``. The arrays are made here: a recorded
        call's later calls launch it on their roots' pointers alone."""
        ids, in_rank, slots, rank_psum, _ = routing_arrays(routing)
        local = None if carving is None else (carving.views(block)[0], rank_psum)
        self.scatter(stream, x, ids, weights, slots, in_rank, kernel_launches.SLOT_CACHED, local)

    def carved_receive_copy(self, stream: Any, options: CopyOptions, carving: Any, block: Array,
                            scratch: Optional[Array], source: Any) -> None:
        """:meth:`receive_copy` into ``carving``'s views of ``block`` (and ``scratch`` weights where none are carved),
        made here: a recorded call's later calls launch it on their roots' pointers alone. ``source``: the count
        block of a new routing (its receive count's psums; also counted in the copy where ``options.counted``), or
        ``routing_roots.handle_roots``' ``routing`` for the handle a replay replays (its psums)."""
        arrays = arranged_outputs(carving.views(block), options.weighted, scratch)
        if type(source) is tuple or type(source) is FixedArguments:  # a replay: the handle's routing
            _, _, _, rank_psum, expert_psum = routing_arrays(source)
            self.receive_copy(stream, rank_psum, expert_psum, arrays, options)
            return
        recv_block = self.receive_block(source)
        recv = self.kernels.receive_layout(recv_block)
        self.receive_copy(stream, recv.rank_psum, recv.expert_psum, arrays, options,
                          recv_block if options.counted else None)

    def output(self, options: CopyOptions, arrays: tuple, received: tuple, routing: tuple, weights: Optional[Array],
               cpu_sync: bool, counted: Optional[tuple], replayed: Optional[HeldRoots] = None) -> DispatchOutput:
        """The ``DispatchOutput`` of ``arrays`` and its handle (``handle.make_handle``): ``options`` as
        :meth:`receive_copy` takes them, ``received`` ``(rank psum, expert psum, aligned counts, unaligned counts,
        received rows, expanded rows)``, ``routing`` the handle's ``(topk_idx, is_token_in_rank,
        dst_buffer_slot_idx)``; ``counted``: the count block these arrays are views of (``routing_roots.COUNT_ROOT``),
        kept with the handle, or None; ``replayed``: a replay's, the replayed handle's ``routing_roots.HANDLE_ROOTS``
        (its routing, where read already, is the new handle's too: the same arrays), or None."""
        expand, alignment, zero_padding = options[:3]
        fields = received[:4] + (arrays[3],) + received[4:] + (arrays[0].shape[0],)  # in Received's order
        handle = make_handle(routing, fields, weights, geometry=self.geo, expand=expand, expert_alignment=alignment,
                             zero_padding=zero_padding, deterministic=self.deterministic, cpu_sync=cpu_sync)
        if counted is not None:
            handle.derived[COUNT_ROOT] = counted
        if replayed is not None and type(replayed.routing) is FixedArguments:
            # the replayed handle's routing, read already, is this handle's too while their routing arrays are the
            # same objects (handle_roots checks); its send is not read yet
            handle.derived[HANDLE_ROOTS] = tuple.__new__(HeldRoots, replayed[:5] + (
                handle.recv_src_metadata, replayed.expand, replayed.routing, None))
        return DispatchOutput(arrays[0], arrays[1], arrays[2] if weights is not None else None, handle)

    def output_carving(self, block: Array, arrays: tuple, weighted: bool) -> Any:
        """The recarving of outputs ``arrays`` (``recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata``)
        carved from ``block``; the weights only where given (else a scratch array outside the block)."""
        return self.device.recarving(block, (arrays[0], arrays[1], arrays[3]) + ((arrays[2],) if weighted else ()))

    def device_counts(self, h: EPHandle) -> tuple:
        """``(num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert)`` of handle ``h`` on the device, for
        the outputs of a ``cpu_sync=False`` replay (kept with the handle as ``h.derived["device_counts"]``)."""
        return self.handle_value(h, "device_counts", _device_counts)

    def handle_value(self, h: EPHandle, name: str, derive: Any) -> Any:
        """``derive(xp, h)``, computed once per handle and kept in ``h.derived``; under CUDA graph capture
        computed anew on every call (the capture holds what it allocates: a graph must not depend on a
        handle that its user may drop)."""
        if self.capture.active:
            return derive(self.xp, h)
        value = h.derived.get(name)
        if value is None:
            value = h.derived[name] = derive(self.xp, h)
        return value

    def receive_options(self, expand: bool, alignment: int, zero_padding: bool, new: bool, weighted: bool,
                        counted: bool = False) -> CopyOptions:
        """The options of a receive copy (:meth:`carved_receive_copy`) of a ``new`` routing or a replay: a new
        routing's placement (:attr:`place_mode`) or a replay's (recorded), and the source whose rows a compact
        replay's scatter wrote into ``recv_x`` itself (this rank), else -1; whether the outputs carve weights and
        whether the copy counts (:meth:`counts_in_copy`)."""
        mode = self.place_mode if new else kernel_launches.PLACE_CACHED
        return CopyOptions(bool(expand), int(alignment), bool(zero_padding), mode, -1 if new or expand else self.rank,
                           bool(weighted), bool(counted))

    def receive_copy(self, stream: Any, rank_psum: Array, expert_psum: Array, arrays: tuple, options: CopyOptions,
                     counted: Optional[Array] = None) -> None:
        """The received rows, on ``stream``, into ``arrays`` (``recv_x, recv_topk_idx, recv_topk_weights,
        recv_src_metadata``) as ``options`` say.
        ``counted``: a compact new routing's receive count block (int32 ``[recv_words]``, ``rank_psum`` and
        ``expert_psum`` its views), which this launch fills as :meth:`receive_count` would, with the runner's record
        (``Kernels.receive_counted``); None: the counts were made before."""
        expand, alignment, zero_padding, mode, skip_source = options[:5]
        ctx, step = self.ctx, self.transport.step
        with self.profile.phase("dispatch", "receive_copy"):
            if counted is not None:
                self.kernels.receive_counted(ctx.own_counts, ctx.own_rows, ctx.own_meta, step, *arrays,
                                             alignment=alignment, stream=stream, block=counted,
                                             record=self.runner.record)
                return
            self.kernels.receive_copy(rank_psum, ctx.own_rows, ctx.own_meta, step, *arrays, expand=expand, mode=mode,
                                      expert_psum=expert_psum, alignment=alignment, zero_padding=zero_padding,
                                      stream=stream, skip_source=skip_source)

    def _carved_outputs(self, request: DispatchRequest, exact: Optional[tuple]) -> tuple:
        """``(carving, block, scratch)`` of new outputs of ``request`` (:meth:`_alloc_outputs`, :meth:`replay_send`'s
        ``outputs``)."""
        weighted = request.topk_weights is not None
        arrays, block = self._alloc_outputs(request, exact)
        return self.output_carving(block, arrays, weighted), block, None if weighted else arrays[2]

    def _exact_outputs(self, request: DispatchRequest, num_recv: int, num_expanded: int) -> tuple:
        """``(carving, block, launch_now, scratch)``: the general path's exact outputs of a ``cpu_sync=True`` new
        routing (``new_receive``'s ``exact``), their copy not recorded (their shapes change from call to call)."""
        carving, block, scratch = self._carved_outputs(request, (num_recv, num_expanded))
        return carving, block, launch_now, scratch

    def _alloc_outputs(self, request: DispatchRequest, exact: Optional[tuple]) -> tuple:
        """``((recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata), block)`` of ``request``
        (:meth:`carve_outputs`; ``exact``: ``(received rows, expanded rows)``, used with ``cpu_sync``)."""
        with self.profile.phase("dispatch", "alloc outputs"):
            shapes = self.output_shapes(request.x.shape[1], request.expand, request.expert_alignment,
                                        request.topk_weights is not None, exact if request.cpu_sync else None)
            return self.carve_outputs(shapes)

    def carve_outputs(self, shapes: list) -> tuple:
        """``((recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata), block)`` of ``shapes``
        (:meth:`output_shapes`), not yet filled, carved from ``block``, one allocation; the weights a scratch array
        when none were given."""
        arrays, block = self.device.carve(shapes)
        recv_x, recv_idx, metadata = arrays[:3]
        recv_w = arrays[3] if len(arrays) > 3 else self._scratch_weights(shapes[1][0])
        return (recv_x, recv_idx, recv_w, metadata), block

    def output_shapes(self, width: int, expand: bool, alignment: int, weighted: bool,
                      exact: Optional[tuple]) -> list:
        """The ``(shape, dtype)`` of ``recv_x [rows, width]`` (the payload's width: H, or fewer elements for packed
        FP8 rows), ``recv_topk_idx`` int64, ``recv_src_metadata [N_out, 2+K]`` int32 and, ``weighted``,
        ``recv_topk_weights`` float32; ids/weights ``[N_out, K]`` compact or ``[M_out]`` expand. ``exact``:
        ``(received rows, expanded rows)`` of a ``cpu_sync=True`` call, or None (the worst case)."""
        geo = self.geo
        n_out, rows = geo.output_rows(exact, expand, alignment)
        ids_shape = (rows,) if expand else (rows, geo.num_topk)
        return [((rows, width), geo.dtype), (ids_shape, np.int64), ((n_out, 2 + geo.num_topk), np.int32)] + (
            [(ids_shape, np.float32)] if weighted else [])

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


_MAX_COUNT_CARVINGS = 64  # count block layouts kept (token count, ids dtype, device counts)


class CopyOptions(NamedTuple):
    """What a receive copy (``NvshmemDispatch.carved_receive_copy``) takes besides its arrays
    (``NvshmemDispatch.receive_options``): the outputs' layout, the placement mode (a new routing's, or a replay's
    recorded slots), the source whose rows a compact replay's scatter wrote into ``recv_x`` itself (-1: none), whether
    the outputs carve weights, and whether the copy counts (a compact new routing's). A recorded call takes it by its
    ``launch_key`` (its fields, of fixed types): one key word, not a word per field."""

    expand: bool
    alignment: int
    zero_padding: bool
    mode: int
    skip_source: int
    weighted: bool
    counted: bool

    # the recorded calls' key word of these options (recorded_calls.call_key): the fields as a plain tuple, read by a
    # C-level getter (no Python call on the eager path)
    launch_key = property(tuple)


class RoutingPlan(NamedTuple):
    """What the receive steps of a new routing (``NvshmemDispatch.new_receive``) take besides its arrays: the receive
    copy's ``options`` and the recarving of the handle's views of the count block
    (``NvshmemDispatch.count_carvings``). The prepared path keeps one per shape."""

    options: CopyOptions
    views: Any


def arranged_outputs(views: Any, weighted: bool, scratch: Optional[Array]) -> Tuple[Array, ...]:
    """``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata)`` of the views of an output carving
    (``NvshmemDispatch.output_carving``'s order), the weights ``scratch`` where none are carved."""
    return views[0], views[1], views[3] if weighted else scratch, views[2]


def host_counts(h: EPHandle) -> tuple:
    """``(received rows, expanded rows, aligned counts [L] as a new list)`` of handle ``h`` as host values, for the exact
    outputs of a ``cpu_sync=True`` replay: a ``cpu_sync`` handle holds them on the host (no device read, one list
    copy: each handle owns its list); a ``cpu_sync=False`` one on the device (three reads, which wait for the stream)."""
    if h.cpu_sync:
        return int(h.num_recv_tokens), int(h.num_expanded_tokens), list(h.num_recv_tokens_per_expert)
    return int(h.num_recv_tokens), int(h.num_expanded_tokens), to_host(h.num_recv_tokens_per_expert).tolist()


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
