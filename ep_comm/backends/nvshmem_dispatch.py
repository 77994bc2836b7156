"""The dispatch half of ``NvshmemBackend`` (``NvshmemDispatch``): the FP8 payload, the send half of a new routing
(count and scatter, the count exchange) or of a handle's replay (recorded slots, outputs allocated first), and
their receive halves (receive count, the rows into the outputs, the handle). The steps are listed in
``ep_comm.backends.nvshmem``'s docstring.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ep_comm.backends.interface import DispatchRequest, ReceiveHalf
from ep_comm.backends.nvshmem_steps import NvshmemSteps
from ep_comm.contract.arrays import Array
from ep_comm.contract.symmetric import record_counts
from ep_comm.handle import DispatchOutput, EPHandle, Received, Routing, make_handle
from ep_comm.launching import kernel_launches
from ep_comm.launching.fp8 import Fp8Rows, payload_arrays, payload_key


class NvshmemDispatch(NvshmemSteps):
    """``NvshmemBackend``'s ``pack_fp8``, ``dispatch`` and ``dispatch_send``."""

    deterministic: bool
    _own_counts: Array
    _scratch: Array
    _record: Array

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

    def _scatter(self, request: DispatchRequest, routing: Routing, mode: int, local: Optional[tuple] = None) -> None:
        """Rank scatter of rows and meta rows into every destination (into the staging blocks with puts, which
        :meth:`_flush` sends); ``request.x`` and its weights C-contiguous; ``local``: ``(recv_x, received psum [R])``
        of a compact replay, where the rows for this rank itself go."""
        t = self.transport
        recv_x, recv_psum = local if local is not None else (None, None)
        with self.profile.phase("dispatch", "scatter"):
            self.kernels.scatter(request.x, routing.topk_idx, request.topk_weights, routing.dst_buffer_slot_idx,
                                 t.rows, t.meta, src_rank=self.rank, step=t.step, ahead=1, mode=mode,
                                 recv_x=recv_x, recv_psum=recv_psum)

    def _flush(self, psum: Callable[[], Array]) -> None:
        """Send the staged rows and meta rows where there are puts (the transport's test; timed as phase ``puts``),
        ``psum()`` (int32 ``[R]``, called only then) the inclusive prefix sum of the rows per destination."""
        self.transport.flush(self.kernels.stream, psum, with_meta=True, timed=self.profile.phase("dispatch", "puts"))

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
        mode = kernel_launches.SLOT_STABLE if stable else kernel_launches.SLOT_ATOMIC

        def count_and_scatter() -> None:
            with self.profile.phase("dispatch", "count"):
                send = k.count(idx, stable=stable, block=send_block)
            self._scatter(request, Routing(idx, send.is_token_in_rank, send.slot_idx), mode)

        key = ("send", num_tokens, idx.dtype.char, payload_key(x), weights is not None, stable)
        roots = (idx, *payload_arrays(x), block) + (() if weights is None else (weights,))
        self._planned(key, roots, count_and_scatter)
        self._flush(lambda: k.send_layout(send_block, num_tokens).rank_psum)
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
                             counts, None, kernel_launches.PLACE_STABLE if stable else kernel_launches.PLACE_ATOMIC)

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
        self._planned(key, roots, lambda: self._scatter(request, h.routing, kernel_launches.SLOT_CACHED, local))
        self._flush(functools.partial(self._derived, h, "send_psum", _send_psum))
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
        out = self._receive(request, h.routing, layout, counts, h.recv_src_metadata, kernel_launches.PLACE_CACHED,
                            outputs=outputs, skip_source=-1 if request.expand else self.rank)
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

