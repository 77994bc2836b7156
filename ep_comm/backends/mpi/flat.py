"""The flat route of the mpi backend (``FlatRoute``): every rank's rows go straight into the destination's window,
and a step ends with the runner's signal and bounded wait. ``MpiProtocol`` sends and reads over a route; the
forwarded route (``mpi.forwarding.ForwardedRoute``) has the same methods and uses this one within a node.

Shapes: ``T`` tokens of this rank, ``H`` hidden, ``K`` top-k width, ``R`` ranks.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ep_comm.backends.interface import DispatchRequest
from ep_comm.backends.mpi.context import MpiContext
from ep_comm.contract import layout as lay
from ep_comm.contract.forward_inbox import slot_order
from ep_comm.handle import Routing


class FlatRoute:
    """Sends, signals and reduce terms of the flat path, over ``ctx``."""

    def __init__(self, ctx: MpiContext):
        self.ctx = ctx

    def scatter(self, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                words: Optional[np.ndarray]) -> None:
        """Rank scatter: each destination's rows in slot order (``slots`` int64 ``[T, R]``), one put per destination,
        and with ``words`` (a new routing: ``layout.send_count_words`` and this rank's verdict, int64
        ``[R, 1 + L + VERDICT_WORDS]``) the count exchange, row ``dst`` to ``dst``: its rows, its entries per local
        expert, the verdict."""
        for dst in range(self.ctx.geo.num_ranks):
            self.scatter_to(dst, parity, request, routing, slots, words)

    def scatter_to(self, dst: int, parity: int, request: DispatchRequest, routing: Routing, slots: np.ndarray,
                   words: Optional[np.ndarray]) -> None:
        """The rank scatter's puts into ``dst`` (:meth:`scatter`)."""
        ctx, weights = self.ctx, request.topk_weights
        tokens = slot_order(slots[:, dst])
        local_ids = lay.local_topk(routing.topk_idx[tokens], dst, ctx.geo.experts_per_rank)
        ctx.put_block(dst, parity, request.x[tokens],
                      ctx.pack_meta(tokens, local_ids, None if weights is None else weights[tokens]))
        ctx.count_scaleout("dispatch", dst, len(tokens))
        if words is not None:  # count exchange
            ctx.window.put(words[dst], dst, ctx.sym.count_at(parity, ctx.rank))

    def return_rows(self, src: int, parity: int, rows: np.ndarray, meta: np.ndarray) -> None:
        """A combine's partials ``rows [n, H]`` for source rank ``src`` (the rows it sent here, in slot order) and
        their meta rows ``[n, 1 + 2K]`` int32 (source token, this rank's local expert ids, weights), into ``src``'s
        window."""
        self.ctx.put_block(src, parity, rows, meta)
        self.ctx.count_scaleout("combine", src, len(rows))

    def signal(self, what: str, seq: int, hooked: bool) -> None:
        """The end of step ``seq``'s send part (``MpiStepRunner.signal``)."""
        self.ctx.runner.signal(what, seq, hooked)

    def wait(self, what: str, seq: int, hooked: bool) -> None:
        """The start of step ``seq``'s receive part (``MpiStepRunner.wait``)."""
        self.ctx.runner.wait(what, seq, hooked)

    def term_of(self) -> np.ndarray:
        """int64 ``[R]``: the rank whose term of the source's reduce carries each rank's partial; flat, itself."""
        return np.arange(self.ctx.geo.num_ranks)

    def read_term(self, parity: int, q: int, reached: np.ndarray, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(rows [T, H] payload, weights [T, K] float32)`` of term ``q`` for each token of this rank, meaningful
        where ``reached [T]``: the rows rank ``q`` sent back, picked by their slots ``slots[:, q]``."""
        geo = self.ctx.geo
        rows, meta = self.ctx.read_block(parity, q, int(reached.sum()), geo.hidden)
        if not len(rows):
            return np.zeros((len(reached), geo.hidden), geo.dtype), np.zeros((len(reached), geo.num_topk), np.float32)
        pick = np.maximum(slots[:, q], 0)
        return rows[pick], meta[pick, 1 + geo.num_topk :].view(np.float32)
