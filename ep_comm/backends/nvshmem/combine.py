"""The combine protocol of ``NvshmemBackend`` (``NvshmemCombine``, given an ``NvshmemContext``): the send half
(``Kernels.combine_scatter`` back into the sources' buffers, the weights' return route, puts, signal) and the receive
half (wait, then ``combine_reduce`` with the bias; in compact mode this rank's own rows straight from ``y``). Their
steps (``NvshmemCombine.send_steps``, ``receive_steps``) are the prepared path's too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np

from ep_comm._launcher.recorded_calls import arguments
from ep_comm.backends.interface import CombineRequest, ReceiveHalf
from ep_comm.backends.nvshmem.forwarding import Arrive, FlatRoute
from ep_comm.backends.nvshmem.routing_roots import handle_roots, routing_arrays
from ep_comm.backends.nvshmem.steps import Launch, NvshmemContext
from ep_comm.contract.arrays import Array
from ep_comm.handle import CombineOutput, EPHandle
from ep_comm.launching import weight_return


class NvshmemCombine:
    """``NvshmemBackend``'s ``combine`` and ``combine_send``, over the backend's context ``ctx``; its steps run through
    ``ctx.runner``, its rows travel by ``route`` (a ``FlatRoute``, or a ``ForwardedRoute`` through the forwarders).
    Its pieces (send, reduce) are public to the prepared path."""

    def __init__(self, ctx: NvshmemContext, route: FlatRoute):
        self.route = route
        self.ctx, self.geo, self.rank, self.xp = ctx, ctx.geo, ctx.rank, ctx.xp
        self.kernels, self.transport, self.device, self.runner = ctx.kernels, ctx.transport, ctx.device, ctx.runner
        self.profile = ctx.runner.profile
        self._puts = bool(ctx.transport.puts_to)  # a rank reached through puts: a send flushes its staged rows
        self._pointers = ctx.device.array_pointers  # the recorded calls' (a handle's arrays are read once with them)

    def combine(self, request: CombineRequest) -> CombineOutput:
        """One collective combine of ``request.y`` along the routes of ``request.handle``."""
        return self.runner.collective("combine", request.handle.cpu_sync, "total", self.runner.plain_step,
                                      self._combine, request)

    def combine_send(self, request: CombineRequest) -> ReceiveHalf[CombineOutput]:
        """The send half of one collective combine (rows and weights back, puts, signal; no wait), and its receive
        half."""
        return self.runner.split("combine", request.handle.cpu_sync, self._combine, request)

    def _combine(self, seq: int, stream: Any, request: CombineRequest, hooked: bool) -> Callable[[Any], CombineOutput]:
        """The send half of a combine, on ``stream`` (:meth:`send_steps`, timed as phase ``send``, then the route's end
        of the send half: the signal); returns its receive half."""
        h, weights, y = request.handle, self.ctx.as_contiguous(request.topk_weights), self.ctx.as_rows(request.y)
        with self.profile.phase("combine", "send"):
            routing = self.send_steps(self.runner.run_recorded, stream, h, y, weights)
        arrive = self.route.combine_sent(stream, hooked, h)
        return functools.partial(self._combine_receive, request, y, weights, routing, arrive)

    def _combine_receive(self, request: CombineRequest, y: Array, weights: Optional[Array], routing: Any,
                         arrive: Arrive, stream: Any) -> CombineOutput:
        """The receive half of a combine, on ``stream``: the route's start of it (a split step's wait; forwarded, the
        node reduce first), the outputs and bias terms, then :meth:`receive_steps` (the reduce timed as phase
        ``reduce``; ``routing``: what :meth:`send_steps` returned)."""
        h = request.handle
        arrive(stream)
        terms = tuple(_bias_term(self.xp, b) for b in request.bias_terms)
        arrays, _ = self.device.carve(self.combine_shapes(h, weights is not None))  # one allocation for both
        back = arrays[1] if weights is not None else None
        return self.receive_steps(self._timed_reduce, stream, h, routing, y, arrays[0], back, terms)

    def send_steps(self, launch: Launch, stream: Any, h: EPHandle, y: Array, weights: Optional[Array]) -> Any:
        """The send steps of a combine along handle ``h`` (both paths run these, in this order), on ``stream``: the
        rows of ``y`` (and ``weights``) back (:meth:`send`, launched by ``launch``: a :data:`Launch`), then the puts
        of the staged rows (the route's: none forwarded). Returns what :meth:`receive_steps` takes as ``routing``: the
        handle's routing arrays (``routing_roots.handle_roots``, as the handle's arrays here)."""
        routing, arrays = handle_roots(h, self._pointers)
        launch(self.send, stream, y, weights, arrays)
        if self._puts:
            self.route.flush(functools.partial(self.transport.flush, stream, lambda: h.psum_num_recv_tokens_per_rank,
                                               with_meta=weights is not None))
        return routing

    def receive_steps(self, launch: Launch, stream: Any, h: EPHandle, routing: Any, y: Array, x: Array,
                      back: Optional[Array], terms: tuple) -> CombineOutput:
        """The receive steps of a combine after its wait (both paths run these, in this order), on ``stream``: the
        progress marker of a ``cpu_sync`` handle, the reduce (:meth:`reduce`, launched by ``launch``) into ``x [T,
        H]`` (and ``back``, float32 ``[T, K]``, the gathered weights) with the bias ``terms``, along the routing of
        handle ``h`` (``routing``: what :meth:`send_steps` returned), then that handle's one poll."""
        arrived = self.device.progress() if h.cpu_sync else None
        launch(self.reduce, stream, routing, x, back, terms, None if h.expand else y)
        if arrived is not None:
            self.runner.check_arrival(arrived, "combine")
        return CombineOutput(x, back)

    def _timed_reduce(self, path: Callable[..., None], stream: Any, *args: Any) -> None:
        """The general path's :data:`Launch` of the reduce: a recorded call timed as phase ``reduce``."""
        with self.profile.phase("combine", "reduce"):
            self.runner.run_recorded(path, stream, *args)

    def send(self, stream: Any, y: Array, weights: Optional[Array], handle_arrays: Any) -> None:
        """On ``stream``, the rows of ``y`` back to their sources' buffers (compact: those of other sources only, the
        reduce reads this rank's own from ``y``) and the weights' return route (with puts into the staging blocks, which
        the caller then puts: the block of this rank's own compact rows too, unwritten and never read);
        ``handle_arrays`` (``routing_roots.handle_roots``' ``send``, as it is or read once): ``(metadata, psum,
        expand)``, ``metadata`` (int32 ``[N_out, 2+K]``) and ``psum`` (int32 ``[R]``) the handle's
        ``recv_src_metadata`` and ``psum_num_recv_tokens_per_rank``, ``expand`` its mode. The rows sent over scale-out
        are counted (``route.count_combine``)."""
        metadata, psum, expand = arguments(handle_arrays)
        xp, t, k = self.xp, self.transport, self.kernels
        k.combine_scatter(y, metadata, psum, self.route.combine_rows, my_rank=self.rank, step=t.step, ahead=1,
                          expand=expand, stream=stream, weights=weights if expand else None)
        self.route.count_combine(stream, psum)
        if weights is not None:
            bits = weights.view(xp.int32).reshape(weights.shape[0], weights.shape[1] if weights.ndim == 2 else 1)
            weight_return.send_weights(functools.partial(k.launcher, stream=stream), bits, expand, metadata, psum,
                                       self.route.combine_metas, my_rank=self.rank, step=t.step, ahead=1,
                                       max_blocks=k.num_blocks)

    def combine_shapes(self, h: EPHandle, with_weights: bool) -> list:
        """The ``(shape, dtype)`` of a combine's outputs: ``x [T, H]`` and, ``with_weights``, float32 ``[T, K]``."""
        geo = self.geo
        return [((h.num_tokens, geo.hidden), geo.dtype)] + (
            [((h.num_tokens, geo.num_topk), np.float32)] if with_weights else [])

    def reduce(self, stream: Any, routing: Any, x: Array, back: Optional[Array], terms: tuple,
               y: Optional[Array]) -> None:
        """The reduce, on ``stream``, into ``x [T, H]`` of the rows sent back to the handle's slots and ids
        (``routing``: ``routing_roots.handle_roots``' ``routing``, read here), with this rank's own compact rows from
        ``y`` (None in expand mode: every row was sent) and the ``terms`` of the bias, and with ``back`` (float32
        ``[T, K]``) the gathered weights."""
        k, t = self.kernels, self.transport
        topk_idx, _, slot_idx, rank_psum, _ = routing_arrays(routing)
        kept = {} if y is None else dict(y=y, recv_rank_psum=rank_psum)
        k.combine_reduce(self.ctx.own_rows, t.step, slot_idx, topk_idx, x, my_rank=self.rank, stream=stream,
                         bias=list(terms), node_size=self.route.node_size, **kept)
        if back is not None:
            weight_return.gather_weights(functools.partial(k.launcher, stream=stream), self.ctx.own_meta, t.step,
                                         slot_idx, topk_idx, back.view(self.xp.int32),
                                         experts_per_rank=self.geo.experts_per_rank, my_rank=self.rank,
                                         max_blocks=k.num_blocks, node_size=self.route.node_size)


def _bias_term(xp: Any, b: Array) -> Array:
    """A bias term the combine kernel reads: float32/float16/bfloat16 as is, other floats as float32."""
    kind = np.dtype(b.dtype)
    if kind.itemsize == 2 or kind == np.float32:
        return xp.ascontiguousarray(b)
    return xp.ascontiguousarray(b.astype(xp.float32))
