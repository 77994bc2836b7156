"""How a step's rows travel on the nvshmem backend: the flat route (``FlatRoute``: every row straight into its
destination, then the step's signal and wait) or, for ``Buffer(forwarding=True)`` across several nodes, the forwarded
one (``ForwardedRoute``: through the forwarders' inboxes; docs/design.md, "Forwarding on nvshmem"). The dispatch and
combine protocols (``nvshmem.dispatch``, ``nvshmem.combine``) end their send half with the route's
:meth:`~FlatRoute.dispatch_sent` / :meth:`~FlatRoute.combine_sent`, which return what their receive half runs first
(``arrive(stream)``), and write the combine's partials through the route's views (``combine_rows``,
``combine_metas``).

A forwarded dispatch, on ``stream``: count and scatter as on the flat path but for the rows of the ranks of other
nodes, which the scatter does not write (their slots are assigned alike), the inbox send into the forwarders
of the other nodes (``Kernels.inbox_send``, with a new routing's count words), the inbox signal; then (at once, or in
the hook of a split step) the bounded inbox wait, the relay into this node's ranks (``Kernels.relay``), the step's
signal and bounded wait. A forwarded combine: the partials through ``ForwardViews.to_sources`` (a source of this node
directly, another through its forwarder's inbox) with their meta words (``Kernels.combine_meta``), the inbox signal;
then the inbox wait, the node reduce into the sources forwarded for (``Kernels.node_reduce``), the step's signal and
wait; the source's reduce takes the node size (``FlatRoute.node_size``: 0 flat). With ``Buffer(profile=True)`` the
forwarded steps add the phases ``inbox send`` and ``inbox wait+relay`` (dispatch) or ``inbox wait+node reduce``
(combine).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

from ep_comm.backends.collective_steps import STEP_KINDS
from ep_comm.backends.nvshmem.steps import NvshmemContext
from ep_comm.contract.arrays import Array
from ep_comm.contract.fp8 import packed_row_bytes
from ep_comm.handle import EPHandle
from ep_comm.launching.fp8 import Fp8Rows

Arrive = Callable[[Any], None]  # the start of a step's receive half, on its stream
RECEIVED_IDS = "received ids"  # EPHandle.derived: a forwarded compact dispatch's recv_topk_idx, for its combine


class Sent(NamedTuple):
    """What a dispatch's send half sent: payload ``x [T, W]`` (or an ``Fp8Rows``), ids ``[T, K]``, float32 weights
    ``[T, K]`` or None, the int32 slots ``[T, K]`` the scatter wrote or replayed (None from a new routing on the flat
    route, which reads none), and a new routing's count words (int32 ``[R, 1 + L + 2]``) or None (a replay)."""

    x: Any
    topk_idx: Array
    topk_weights: Optional[Array]
    slot_idx: Optional[Array]
    count_words: Optional[Array]


class FlatRoute:
    """Every row straight into its destination (stores, or the staging blocks that ``flush`` puts)."""

    node_size = 0  # the source's reduce: flat
    written: Optional[range] = None  # the ranks the scatter writes rows into: every rank
    reads_slots = False  # whether dispatch_sent reads a new routing's slot_idx (Sent.slot_idx): flat, no
    per_node = False  # a dispatch's scale-out rows: one per token and remote rank (count_dispatch)

    def __init__(self, ctx: NvshmemContext):
        self.ctx, self.runner = ctx, ctx.runner
        self.combine_rows, self.combine_metas = ctx.transport.rows, ctx.transport.meta

    @staticmethod
    def flush(flush: Callable[[], None]) -> None:
        """``flush()``: the puts of the rows staged for the ranks reached through puts."""
        flush()

    def count_dispatch(self, stream: Any, in_rank: Array) -> None:
        """On ``stream``, a dispatch's scale-out rows (per token of ``in_rank [T, R]`` bool, its routing's
        ``is_token_in_rank``: the remote ranks it goes to; :attr:`per_node`: the remote nodes) added to the context's
        counter (``Kernels.dispatch_rows``: one launch); nothing in one node."""
        ctx = self.ctx
        if ctx.topology.num_nodes > 1:
            ctx.kernels.dispatch_rows(in_rank, ctx.scaleout, node_size=ctx.topology.scaleup_ranks, my_rank=ctx.rank,
                                      per_node=self.per_node, stream=stream)

    def count_combine(self, stream: Any, rank_psum: Array) -> None:
        """On ``stream``, a combine's scale-out rows (the rows received from the remote ranks, ``rank_psum [R]``
        int32: the handle's received psum, go back to them) added to the context's counter (``Kernels.combine_rows``:
        one launch); nothing in one node."""
        ctx = self.ctx
        if ctx.topology.num_nodes > 1:
            ctx.kernels.combine_rows(rank_psum, ctx.scaleout, node_size=ctx.topology.scaleup_ranks, my_rank=ctx.rank,
                                     stream=stream)

    def dispatch_sent(self, stream: Any, hooked: bool, sent: Sent) -> Arrive:
        """The end of a dispatch's send half on ``stream``: the step's signal with the count words (and, not
        ``hooked``, its wait). Returns the receive half's start: the wait of a split step."""
        self.runner.signal("dispatch", stream, hooked, sent.count_words)
        return functools.partial(_wait, self.runner, "dispatch", hooked, sent.count_words is not None)

    def combine_sent(self, stream: Any, hooked: bool, h: EPHandle) -> Arrive:
        """The end of a combine's send half on ``stream`` for handle ``h``: the step's signal (and, not ``hooked``,
        its wait). Returns the receive half's start."""
        self.runner.signal("combine", stream, hooked)
        return functools.partial(_wait, self.runner, "combine", hooked, False)

    def keep_ids(self, h: EPHandle, recv_topk_idx: Array) -> None:
        """Nothing: a flat combine sends no ids."""


def _wait(runner: Any, what: str, hooked: bool, with_counts: bool, stream: Any) -> None:
    """``runner.wait``: a split step's bounded wait, nothing for a plain one (``stream`` unused: CuPy's current)."""
    runner.wait(what, hooked, with_counts)


class ForwardedRoute(FlatRoute):
    """Through the forwarders (the transport's ``forward``: ``ForwardViews``, its ``inbox_signal`` and ``inbox_wait``).
    Every rank is in load/store reach (``NvshmemTransport`` with an inbox); nothing is put."""

    def __init__(self, ctx: NvshmemContext):
        super().__init__(ctx)
        self.views = ctx.transport.forward
        self.node_size = self.views.node_size
        self.written = range(self.views.node_first, self.views.node_first + self.node_size)  # this node's ranks
        self.reads_slots = True  # the inbox send writes each entry's slot in the ranks of the forwarder's node
        self.per_node = True  # a token crosses to a remote node once, into its forwarder's inbox
        self.combine_rows, self.combine_metas, self._combine_headers = self.views.source_arrays()

    @staticmethod
    def flush(flush: Callable[[], None]) -> None:
        """Nothing: the scatter writes no rows for the ranks of other nodes (:attr:`written`; the relay delivers
        them), and a combine writes the inboxes and this node's sources through peer views."""

    def count_combine(self, stream: Any, rank_psum: Array) -> None:
        """Nothing: a forwarded combine's partials stay in the node; the node reduce counts the rows it puts into
        the sources of other nodes (:meth:`_node_reduce`)."""

    def dispatch_sent(self, stream: Any, hooked: bool, sent: Sent) -> Arrive:
        """The inbox send and its signal; then, not
        ``hooked``, :meth:`_relay` at once; ``hooked``, in the receive half."""
        ctx, t = self.ctx, self.ctx.transport
        rows, metas, headers, counts = self.views.forwarder_arrays()
        with self.runner.profile.phase("dispatch", "inbox send"):
            ctx.kernels.inbox_send(sent.x, sent.topk_idx, sent.topk_weights, sent.slot_idx, rows, metas, headers,
                                   counts, src_rank=ctx.rank, count_words=sent.count_words, step=t.step,
                                   stream=stream)
            t.inbox_signal(STEP_KINDS["dispatch"])
        relay = functools.partial(self._relay, hooked, sent.count_words, self._row_words(sent.x))
        if hooked:
            return relay
        relay(stream)
        return _nothing

    def _row_words(self, x: Any) -> Optional[int]:
        """The words of a row the inbox send wrote: a packed FP8 row's (``uint64`` words), else None (the whole
        inbox row)."""
        return packed_row_bytes(x.hidden) // 8 if isinstance(x, Fp8Rows) else None

    def _relay(self, hooked: bool, count_words: Optional[Array], row_words: Optional[int], stream: Any) -> None:
        """On ``stream``: the bounded inbox wait, the relay into this node's ranks, the step's signal with
        ``count_words`` and its bounded wait."""
        ctx, t, views = self.ctx, self.ctx.transport, self.views
        with self.runner.profile.phase("dispatch", "inbox wait+relay"):
            t.inbox_wait(STEP_KINDS["dispatch"], self.runner.timeout_s)
            ctx.kernels.relay(views.inbox, views.forwarded_for, *views.peer_arrays(), node_first=views.node_first,
                              step=t.step, stream=stream, row_words=row_words)
        self.runner.signal("dispatch", stream, hooked, count_words)
        self.runner.wait("dispatch", hooked, count_words is not None)

    def combine_sent(self, stream: Any, hooked: bool, h: EPHandle) -> Arrive:
        """The meta words of the partials sent through the forwarders' inboxes, and the inbox signal; then, not
        ``hooked``, :meth:`_node_reduce` at once; ``hooked``, in the receive half."""
        ctx, t = self.ctx, self.ctx.transport
        ids = h.recv_src_metadata[:, 2:] if h.expand else h.derived[RECEIVED_IDS]
        with self.runner.profile.phase("combine", "inbox send"):
            ctx.kernels.combine_meta(h.recv_src_metadata, ids, h.psum_num_recv_tokens_per_rank, self.combine_metas,
                                     self._combine_headers, my_rank=ctx.rank, node_size=self.node_size, step=t.step,
                                     stream=stream)
            t.inbox_signal(STEP_KINDS["combine"])
        reduce = functools.partial(self._node_reduce, hooked)
        if hooked:
            return reduce
        reduce(stream)
        return _nothing

    def _node_reduce(self, hooked: bool, stream: Any) -> None:
        """On ``stream``: the bounded inbox wait, the node reduce into the sources forwarded for, the step's signal
        and its bounded wait."""
        ctx, t, views = self.ctx, self.ctx.transport, self.views
        rows, metas, _ = views.peer_arrays()
        with self.runner.profile.phase("combine", "inbox wait+node reduce"):
            t.inbox_wait(STEP_KINDS["combine"], self.runner.timeout_s)
            ctx.kernels.node_reduce(views.inbox, views.forwarded_for, rows, metas, my_rank=ctx.rank,
                                    dtype=ctx.geo.dtype, hidden=ctx.geo.hidden, step=t.step, scaleout=ctx.scaleout,
                                    stream=stream)
        self.runner.signal("combine", stream, hooked)
        self.runner.wait("combine", hooked, False)

    def keep_ids(self, h: EPHandle, recv_topk_idx: Array) -> None:
        """A compact handle keeps a copy of its dispatch's ``recv_topk_idx [N, K]`` (the received rows' local ids,
        which its combine's meta words carry to the forwarders; the caller may change the output)."""
        if not h.expand:
            h.derived[RECEIVED_IDS] = recv_topk_idx.copy()


def _nothing(stream: Any) -> None:
    """The receive half's start of a plain forwarded step: its waits ran in the send half."""
