"""The combine protocol of ``NvshmemBackend`` (``NvshmemCombine``, given an ``NvshmemContext``): the send half
(``Kernels.combine_scatter`` back into the sources' buffers, the weights' return route, puts, signal) and the receive
half (wait, then ``combine_reduce`` with the bias; in compact mode this rank's own rows straight from ``y``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ep_comm._launcher.device_arrays import aligned16
from ep_comm.backends.interface import CombineRequest, ReceiveHalf
from ep_comm.backends.nvshmem.forwarding import Arrive, FlatRoute
from ep_comm.backends.nvshmem.steps import NvshmemContext
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

    def combine(self, request: CombineRequest) -> CombineOutput:
        """One collective combine of ``request.y`` along the routes of ``request.handle``."""
        return self.runner.collective("combine", request.handle.cpu_sync, "total", self.runner.plain_step,
                                      self._combine, request)

    def combine_send(self, request: CombineRequest) -> ReceiveHalf[CombineOutput]:
        """The send half of one collective combine (rows and weights back, puts, signal; no wait), and its receive
        half."""
        return self.runner.split("combine", request.handle.cpu_sync, self._combine, request)

    def _combine(self, seq: int, stream: Any, request: CombineRequest, hooked: bool) -> Callable[[Any], CombineOutput]:
        """The send half of a combine, on ``stream``; returns its receive half."""
        h, weights, y = request.handle, self.ctx.as_contiguous(request.topk_weights), self.ctx.as_rows(request.y)
        with self.profile.phase("combine", "send"):
            self.runner.run_recorded(combine_send_key(h, y, weights), combine_send_roots(h, y, weights),
                                     functools.partial(self.send, stream, h, y, weights))
            self.route.flush(functools.partial(self.transport.flush, stream, lambda: h.psum_num_recv_tokens_per_rank,
                                               with_meta=weights is not None))
        arrive = self.route.combine_sent(stream, hooked, h)
        return functools.partial(self._combine_receive, request, y, weights, arrive)

    def _combine_receive(self, request: CombineRequest, y: Array, weights: Optional[Array], arrive: Arrive,
                         stream: Any) -> CombineOutput:
        """The receive half of a combine, on ``stream``: the wait (the route's), then the reduce (with this rank's
        own rows from ``y``)."""
        h = request.handle
        arrive(stream)
        arrived = self.device.progress() if h.cpu_sync else None
        with self.profile.phase("combine", "reduce"):
            x, back = self._combine_reduce(stream, h, y, request.bias_terms, weights is not None)
        if arrived is not None:
            self.runner.check_arrival(arrived, "combine")
        return CombineOutput(x, back)

    def send(self, stream: Any, h: EPHandle, y: Array, weights: Optional[Array]) -> None:
        """On ``stream``, the rows of ``y`` back to their sources' buffers (compact: those of other sources only, the
        reduce reads this rank's own from ``y``) and the weights' return route (with puts into the staging blocks, which
        the caller then puts: the block of this rank's own compact rows too, unwritten and never read)."""
        xp, t, k = self.xp, self.transport, self.kernels
        k.combine_scatter(y, h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, self.route.combine_rows,
                          my_rank=self.rank, step=t.step, ahead=1, expand=h.expand, stream=stream,
                          weights=weights if h.expand else None)
        if weights is not None:
            bits = weights.view(xp.int32).reshape(weights.shape[0], weights.shape[1] if weights.ndim == 2 else 1)
            weight_return.send_weights(functools.partial(k.launcher, stream=stream), bits, h.expand,
                                       h.recv_src_metadata, h.psum_num_recv_tokens_per_rank, self.route.combine_metas,
                                       my_rank=self.rank, step=t.step, ahead=1, max_blocks=k.num_blocks)

    def _combine_reduce(self, stream: Any, h: EPHandle, y: Array, bias_terms: Sequence[Array],
                        with_weights: bool) -> tuple:
        """``(x [T, H], gathered weights [T, K] float32 or None)``, reduced on ``stream``, from the rows every rank sent
        back and, in compact mode, this rank's own rows straight from ``y``: one allocation for both, one recorded
        call."""
        terms = tuple(_bias_term(self.xp, b) for b in bias_terms)
        arrays, block = self.device.carve(self.combine_shapes(h, with_weights))
        x, back = arrays[0], arrays[1] if with_weights else None
        self.runner.run_recorded(reduce_key(h, y, with_weights, terms), reduce_roots(h, y, block, terms),
                                 functools.partial(self.reduce, stream, h, y, x, back, terms))
        return x, back

    def combine_shapes(self, h: EPHandle, with_weights: bool) -> list:
        """The ``(shape, dtype)`` of a combine's outputs: ``x [T, H]`` and, ``with_weights``, float32 ``[T, K]``."""
        geo = self.geo
        return [((h.num_tokens, geo.hidden), geo.dtype)] + (
            [((h.num_tokens, geo.num_topk), np.float32)] if with_weights else [])

    def reduce(self, stream: Any, h: EPHandle, y: Array, x: Array, back: Optional[Array], terms: tuple) -> None:
        """The reduce, on ``stream``, into ``x [T, H]`` (with this rank's own compact rows from ``y``, and the ``terms``
        of the bias), and with ``back`` (float32 ``[T, K]``) the gathered weights."""
        k, t = self.kernels, self.transport
        own = {} if h.expand else dict(y=y, recv_rank_psum=h.psum_num_recv_tokens_per_rank)
        k.combine_reduce(self.ctx.own_rows, t.step, h.dst_buffer_slot_idx, h.topk_idx, x, my_rank=self.rank,
                         stream=stream, bias=list(terms), node_size=self.route.node_size, **own)
        if back is not None:
            weight_return.gather_weights(functools.partial(k.launcher, stream=stream), self.ctx.own_meta, t.step,
                                         h.dst_buffer_slot_idx, h.topk_idx, back.view(self.xp.int32),
                                         experts_per_rank=self.geo.experts_per_rank, my_rank=self.rank,
                                         max_blocks=k.num_blocks, node_size=self.route.node_size)


def combine_send_key(h: EPHandle, y: Array, weights: Optional[Array]) -> tuple:
    """The recorded-call key of a combine's send (``NvshmemCombine.send``): ``y``'s shape, dtype and 16-byte start
    (its rows' copy width) among them."""
    return ("combine send", y.shape, y.dtype.char, aligned16(y), h.expand, None if weights is None else weights.shape)


def combine_send_roots(h: EPHandle, y: Array, weights: Optional[Array]) -> tuple:
    """The per-call arrays of a combine's send, in order."""
    return (y, h.recv_src_metadata, h.psum_num_recv_tokens_per_rank) + (() if weights is None else (weights,))


def reduce_key(h: EPHandle, y: Array, with_weights: bool, terms: tuple) -> tuple:
    """The recorded-call key of a combine's reduce (``NvshmemCombine.reduce``): in compact mode ``y``'s shape and
    16-byte start (the copy width of the rows read from it) among them."""
    return ("combine reduce", h.num_tokens, h.topk_idx.dtype.char, h.expand, with_weights,
            None if h.expand else (y.shape, aligned16(y)), tuple(b.dtype.char for b in terms))


def reduce_roots(h: EPHandle, y: Array, block: Array, terms: tuple) -> tuple:
    """The per-call arrays of a combine's reduce, in order: the handle's routing, the outputs' ``block``, in
    compact mode ``y`` and the handle's psum, the bias terms."""
    own = () if h.expand else (y, h.psum_num_recv_tokens_per_rank)
    return (h.dst_buffer_slot_idx, h.topk_idx, block) + own + terms


def _bias_term(xp: Any, b: Array) -> Array:
    """A bias term the combine kernel reads: float32/float16/bfloat16 as is, other floats as float32."""
    kind = np.dtype(b.dtype)
    if kind.itemsize == 2 or kind == np.float32:
        return xp.ascontiguousarray(b)
    return xp.ascontiguousarray(b.astype(xp.float32))
