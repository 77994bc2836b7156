"""``ep_comm.Buffer``: the public API. Checks every argument (``ep_comm._buffer_arguments``: the checks and forms
a backend takes), then hands the work to a backend."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Union

from mpi4py import MPI

from ep_comm._buffer_arguments import (
    check_constructor_arguments,
    dispatch_request,
    topk_idx_array,
)
from ep_comm.backends import make_backend, resolve_backend
from ep_comm.backends.capture import holds_captured_memory
from ep_comm.backends.interface import Backend, BackendSettings, CombineRequest, Traffic
from ep_comm.backends.profile import ProfileRow
from ep_comm.contract import checks as chk
from ep_comm.contract.agreement import agree, construction_fields
from ep_comm.contract.arrays import as_float32
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.layout import DispatchLayout
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle, HandleChecks
from ep_comm.recv_hook import RecvHook


class Buffer:
    """Expert-parallel dispatch/combine among the ranks of an MPI communicator.

    Rank ``r`` owns global experts ``[r*E/R, (r+1)*E/R)``. Buffers are allocated once, at the
    worst case of ``R * num_max_tokens_per_rank`` rows. Every rank must call ``dispatch`` and
    ``combine`` collectively; a rank that does not arrive within ``timeout_s`` makes the others
    raise ``ep_comm.TimeoutError`` naming it, and they post abort records that make it raise
    ``ep_comm.PeerAbortedError`` at its next call or wait.

    Attributes: ``backend`` (``"mpi"``/``"nvshmem"``), ``num_sms`` (the SM count in effect: an int
    on ``nvshmem``, None on ``mpi``), ``transport`` (``"stores"``/``"puts"``/``"stores+puts"`` on ``nvshmem``,
    None on ``mpi``), ``scaleup_ranks`` (ranks per node), ``forwarding``, ``geometry``, ``rank``, ``num_ranks``,
    ``deterministic``, ``timeout_s``.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, num_experts: int, hidden: int, num_topk: int,
                 num_max_tokens_per_rank: int, dtype: Any = "bfloat16", backend: str = "auto",
                 deterministic: bool = False, timeout_s: float = 100.0, num_sms: Optional[int] = None,
                 transport: str = "auto", scaleup_ranks: Optional[int] = None, forwarding: bool = False,
                 profile: bool = False):
        """Collective over ``comm``: every rank passes the same arguments.

        The first collective call is the construction check (``ep_comm.contract.agreement``), before anything is
        allocated: where a rank's own arguments are invalid it raises its error and every other rank a
        ValueError naming it; where the ranks' geometry, dtype, backend, transport, ``deterministic``,
        ``num_sms`` or ep_comm version differ, every rank raises a ValueError naming the field, the
        ranks and their values. ``comm`` itself is checked locally first (no communication is possible
        over an invalid one).

        Args:
            comm: an mpi4py intra-communicator; None = ``MPI.COMM_WORLD``. Its size is the rank count ``R``.
                ``MPI.COMM_NULL`` raises ValueError, an inter-communicator TypeError.
            num_experts: ``E`` global experts, a multiple of ``R``.
            hidden: ``H``, elements per token row.
            num_topk: ``K``, experts per token (``<= E``).
            num_max_tokens_per_rank: the most tokens ``T`` a rank dispatches at once.
            dtype: the payload dtype, ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or the NumPy /
                ml_dtypes type).
            backend: ``"nvshmem"`` (GPU), ``"mpi"`` (CPU) or ``"auto"`` (``ep_comm.backends.choose_backend``).
            deterministic: rows inside each block in ascending (source rank, source token) order.
            timeout_s: seconds to wait for a peer before ``ep_comm.TimeoutError`` (> 0).
            num_sms: (keyword-only, an extension of the contract, like DeepEP's ``deep_ep.Buffer.set_num_sms``)
                how many SMs the GPU kernels' grids are sized for; None = all SMs of the device. An
                integer >= 1 (TypeError for another type, bool included; ValueError below 1). On
                ``nvshmem`` the kernels run ``2 * num_sms`` blocks (``8 * num_sms`` for the
                row-streaming ones), and a value above the SM count of any rank's GPU raises
                ValueError on every rank. On ``mpi`` it is accepted and has no effect.
            transport: how the ``nvshmem`` backend reaches its peers: ``"stores"`` (stores through
                NVSHMEM peer views to every rank; needs P2P between all GPUs), ``"puts"`` (NVSHMEM puts to
                every rank, for peers without P2P) or ``"auto"`` (the default: stores to the ranks of this
                rank's node, ``scaleup_ranks``, and puts to the rest, in the same launches). Every mix can be
                captured into a CUDA graph. Anything else raises ValueError, and so does ``"stores"`` with
                ``scaleup_ranks`` below the rank count. ``buf.transport`` is the one in effect: ``"stores"``,
                ``"puts"`` (every peer through puts) or ``"stores+puts"``. On ``mpi`` it is accepted and has
                no effect (``buf.transport`` is None there).
            scaleup_ranks: ranks per (virtual) node: nodes of this many consecutive ranks, peers outside a
                rank's node out of scale-up reach (``ep_comm.contract.topology``; how a job pins its topology,
                and how several nodes are tested on one host). None (default) = every rank in one node; else
                an int >= 1 that divides the rank count (TypeError / ValueError otherwise).
            forwarding: node-aware forwarding (a bool, TypeError otherwise; default False). With several nodes
                a dispatch sends each token over the scale-out path once per destination node, to that node's
                forwarder (the rank with the source's local index), which writes it into every destination rank
                of its node at the flat path's slots (dispatch outputs are the flat path's, bit for bit). A combine
                reduces in the node: that forwarder sums its node's partials of each token (float32, ascending rank)
                and sends one row per token, rounded to the payload dtype, which the source adds in place of that
                node's ranks (a fixed order differing from the flat one only by that rounding; docs/design.md,
                "Combine"). ``mpi`` only: ``nvshmem`` refuses True (ValueError). One node: no effect.
            profile: True records per-phase timings on every rank, read by :meth:`profile_table`
                (host time; GPU time on ``nvshmem``). A bool (TypeError otherwise).
        """
        comm = chk.check_comm(comm)
        fields, error = None, None
        try:
            backend_name = resolve_backend(backend)
            check_constructor_arguments(comm.size, num_experts, hidden, num_topk, num_max_tokens_per_rank,
                                        timeout_s, num_sms, transport, scaleup_ranks, forwarding, profile)
            self.geometry = Geometry(comm.size, int(num_experts), int(hidden), int(num_topk),
                                         int(num_max_tokens_per_rank), payload_dtype(dtype))
            fields = construction_fields(num_experts=num_experts, hidden=hidden, num_topk=num_topk,
                                         num_max_tokens_per_rank=num_max_tokens_per_rank,
                                         dtype=self.geometry.dtype.name, backend=backend_name, transport=transport,
                                         scaleup_ranks=scaleup_ranks, forwarding=forwarding,
                                         deterministic=deterministic, num_sms=num_sms)
        except (TypeError, ValueError, RuntimeError) as exc:  # still collective: the peers learn of it and raise too
            error = exc
        agree(comm, fields, error)
        self.deterministic = bool(deterministic)
        self.timeout_s = float(timeout_s)
        settings = BackendSettings(self.deterministic, self.timeout_s, None if num_sms is None else int(num_sms),
                                   transport, scaleup_ranks, bool(forwarding), bool(profile))
        self._backend: Optional[Backend] = make_backend(backend_name, comm, self.geometry, settings)
        self._closed_profile: List[ProfileRow] = []
        self._closed_traffic = Traffic(None)
        self._checked_handles = HandleChecks(self.geometry)  # the handles check_handle passed on this Buffer
        self._prepared = getattr(self._backend, "prepared", None)  # the backend's prepared paths, if it has them
        self._profiling = bool(profile)
        self._pending: Optional[RecvHook] = None  # the receive hook of a split call, until it is called
        self.backend: str = self._backend.name
        self.num_sms: Optional[int] = self._backend.num_sms
        self.transport: Optional[str] = self._backend.transport_name
        self.scaleup_ranks: int = comm.size if scaleup_ranks is None else int(scaleup_ranks)
        self.forwarding = bool(forwarding)
        self.rank = comm.rank
        self.num_ranks = comm.size

    @property
    def num_local_experts(self) -> int:
        """``E / R``, the experts this rank owns."""
        return self.geometry.experts_per_rank

    def _live(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("this Buffer is closed")
        return self._backend

    def _ready(self, doing: str) -> Backend:
        """The backend, for collective call ``doing``: RuntimeError while a receive hook is pending."""
        be = self._live()
        if self._pending is not None:
            raise RuntimeError(f"cannot {doing}: {self._pending.step}'s receive hook has not been called: call it "
                               "first (a Buffer runs its collective calls one at a time)")
        return be

    def _start(self, hooked: bool, plain: Callable[[Any], Any], send: Callable[[Any], Any], request: Any,
               finish: Optional[Callable[[Any], Any]] = None) -> Any:
        """``plain(request)``; with ``hooked`` the backend's send part (``send(request)``) and the pending
        ``RecvHook`` of its receive part. ``finish``, when given, turns the backend's output into the caller's
        (the FP8 pair of a packed ``recv_x``), in both cases."""
        if not hooked:
            out = plain(request)
            return out if finish is None else finish(out)
        half = send(request)
        if finish is not None:
            receive = half.receive
            half = dataclasses.replace(half, receive=lambda: finish(receive()))
        self._pending = RecvHook(half, self._hook_called)
        return self._pending

    def _hook_called(self, hook: RecvHook) -> None:
        """``hook`` (this Buffer's pending one) is being called: collective calls may follow."""
        self._pending = None

    @holds_captured_memory
    def get_dispatch_layout(self, topk_idx: Any) -> DispatchLayout:
        """Counts of a routing (local, no communication).

        Args:
            topk_idx: ``[T, K]`` integer global expert ids, ``< 0`` = no expert.

        Returns:
            ``DispatchLayout``: ``num_tokens_per_rank [R]`` int32 (a token counts once per rank),
            ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool.

        Raises:
            ValueError: an id ``>= num_experts`` or a row naming an expert twice, at once on this rank (nothing
                is collective here; ``dispatch`` raises it on every rank, ``checks.routing_error``).
        """
        be = self._live()
        idx = topk_idx_array(be, self.geometry, topk_idx, "get_dispatch_layout")
        if idx.shape[0]:
            chk.check_topk_values(*be.routing_summary(idx), self.geometry)
        return be.dispatch_layout(idx)

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *, handle: Optional[EPHandle] = None,
                 expand: bool = False, expert_alignment: int = 1, zero_padding: bool = False, cpu_sync: bool = True,
                 stats: Any = None, use_fp8: bool = False,
                 return_recv_hook: bool = False) -> Union[DispatchOutput, RecvHook]:
        """Send each token to the ranks of its experts (collective).

        Give exactly one of ``topk_idx`` (a new routing) and ``handle`` (replay the routing of an
        earlier dispatch: no counting, no count exchange). The returned handle owns its routing: it
        holds copies of ``topk_idx`` and ``topk_weights`` (one copy each, in the backend's array
        module; a replay of the handle's own arrays copies nothing), so writing into the caller's
        arrays afterwards changes neither replays nor combines.

        FP8 (DeepSeek-V3 format, ``ep_comm.contract.fp8``; ``H % 128 == 0``, else ValueError): ``x`` given as the pair
        ``(x_fp8, scales)``, or ``use_fp8=True`` with ``x`` in the buffer's dtype (quantized by the sender, as
        ``ep_comm.contract.fp8.quantize``; on ``nvshmem`` inside the send, as each row is read). Only the
        packed FP8 rows (FP8 bytes + scales, ``ep_comm.contract.fp8.packed_row_bytes(H)`` bytes) cross the link, and
        ``recv_x`` is the pair ``(recv_x_fp8 [rows, H], recv_scales [rows, H // 128] float32)``, byte-exact per
        row, zero where the non-FP8 ``recv_x`` is zero: two views into one allocation (the received packed
        rows). ``recv_x_fp8`` is float8_e4m3fn where the array module has it (NumPy), else its uint8 bits
        (``ep_comm.contract.fp8.fp8_array``). Combine is unchanged: it takes ``y [rows, H]`` in the buffer's dtype.

        Args:
            x: ``[T, H]`` tokens in the buffer's dtype; or the FP8 pair ``(x_fp8 [T, H], scales [T, H // 128])``, a
                tuple or a list of two arrays (any other list is refused as ``x``, which must be an array):
                ``x_fp8`` float8_e4m3fn or its bits in any 1-byte dtype (uint8/int8: GPU users pass
                ``torch.float8_e4m3fn`` tensors viewed as uint8), ``scales`` float32, one per 128-element block.
            topk_idx: ``[T, K]`` integer global expert ids (``< 0`` = no expert, no expert twice per
                token), or None with ``handle``.
            topk_weights: ``[T, K]`` floating-point weights (bfloat16 included) carried along as float32,
                or None; with ``handle`` and None, the handle's weights.

            handle: an ``EPHandle`` of an earlier dispatch of this Buffer's geometry, or None.
            expand: False: one row per (source token, rank), grouped by source rank; True: one row
                per (source token, local expert), expert-major. Taken from ``handle`` on a replay.
            expert_alignment: (expand) each expert's rows start at a multiple of it; an integer
                >= 1. Taken from ``handle`` on a replay.
            zero_padding: (expand) padding rows are zero. Taken from ``handle`` on a replay.
            cpu_sync: True: the host waits for the row counts, outputs have exactly the received
                rows; False: nothing waits on the host, outputs have the contract's worst-case rows,
                the counts stay on the device (the CUDA-graph path).
            stats: ``[E/R]`` writeable integer array to which the received unaligned per-local-expert
                counts are added, or None.
            use_fp8: quantize ``x`` (buffer dtype) to FP8 on the sender (DeepEP's name); with ``x`` given as an
                FP8 pair a ValueError. On ``mpi`` a non-finite ``x`` raises ValueError; on ``nvshmem`` it is not
                checked (``ep_comm.kernels.fp8``).
            return_recv_hook: True: enqueue only the send half (count, scatter, signal: nothing waits) and return at
                once an ``ep_comm.RecvHook``; calling it enqueues the receive half and returns the
                ``DispatchOutput`` (nothing is received, and no output exists, before). Until it is called this
                Buffer takes no other dispatch or combine. See ``RecvHook`` (streams, CUDA graphs).

        Returns:
            ``DispatchOutput``: ``recv_x [rows, H]`` (buffer dtype; the FP8 pair above for an FP8 dispatch);
            ``recv_topk_idx`` int64 ``[N, K]``
            compact (local expert ids or -1) or ``[M]`` expand (the row's local expert, -1 for
            padding); ``recv_topk_weights`` float32 of the same shape, or None without weights;
            ``handle``, the ``EPHandle`` that replays this routing and combines its outputs. With
            ``return_recv_hook=True`` the ``RecvHook`` that returns it.

        Raises:
            RuntimeError: a receive hook of this Buffer is pending (call it first).
            ValueError: some rank's ``topk_idx`` holds an id ``>= num_experts`` or names an expert twice in a row:
                checked by each rank in its count step, the verdict travels with the count exchange, no rank
                receives a row, and every rank raises the same error naming the lowest bad rank
                (``checks.routing_error``), the Buffer usable after. ``cpu_sync=True``: raised by this call (or by
                its receive hook); ``cpu_sync=False``: this call returns outputs that hold no row, and the next
                ``dispatch`` or ``combine`` raises it instead of running. Also any argument that breaks its rule,
                on this rank before anything is sent.
        """
        prepared = self._prepared
        if (prepared is not None and self._pending is None and stats is None and use_fp8 is False
                and return_recv_hook is False):
            return prepared.dispatch(self._dispatch, self._checked_handles, x, topk_idx, topk_weights, handle, expand,
                                     expert_alignment, zero_padding, cpu_sync)
        return self._dispatch(x, topk_idx, topk_weights, handle, expand, expert_alignment, zero_padding, cpu_sync,
                              stats, use_fp8, return_recv_hook)

    @holds_captured_memory
    def _dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, expand: Any, expert_alignment: Any,
                  zero_padding: Any, cpu_sync: Any, stats: Any, use_fp8: Any,
                  return_recv_hook: Any) -> Union[DispatchOutput, RecvHook]:
        """:meth:`dispatch` by the general path: every argument checked, then the backend's request."""
        be = self._ready("dispatch")
        chk.check_flag(return_recv_hook, "return_recv_hook")
        request, finish = dispatch_request(be, self.geometry, self._checked_handles, x, topk_idx, topk_weights, handle,
                                           expand, expert_alignment, zero_padding, cpu_sync, stats, use_fp8)
        return self._start(return_recv_hook, be.dispatch, be.dispatch_send, request, finish)

    def combine(self, y: Any, handle: EPHandle, *, topk_weights: Any = None, bias: Any = None,
                return_recv_hook: bool = False) -> Union[CombineOutput, RecvHook]:
        """Bring expert outputs back and reduce them (collective).

        Compact: ``x[t] = bias + sum over ranks r ascending of y_r[row(t, r)]``. Expand: each rank
        first reduces its rows of token t in top-k order, weighted by ``topk_weights`` when given.
        float32 accumulation in a fixed order: bitwise reproducible.

        Args:
            y: ``[rows, H]`` in the buffer's dtype, laid out as the dispatch's ``recv_x`` (compact or expand).
            handle: the ``EPHandle`` of that dispatch.
            topk_weights: floating-point weights (bfloat16 included; as float32): ``[rows]`` expand (each row's
                weight in the reduction), ``[rows, K]`` compact (gathered back into
                ``res.topk_weights``); or None.
            bias: None, one ``[T, H]`` floating-point array (bfloat16 included) or a pair of them, added
                to every token (as float32).
            return_recv_hook: True: enqueue only the send half (the rows and weights back, signal: nothing waits)
                and return at once an ``ep_comm.RecvHook``; calling it enqueues the wait and the reduce and returns
                the ``CombineOutput`` (which does not exist before). Until it is called this Buffer takes no other
                dispatch or combine. See ``RecvHook``.

        Returns:
            ``CombineOutput``: ``x [T, H]`` in the buffer's dtype; ``topk_weights [T, K]`` float32
            gathered back (0 for masked entries), or None without weights. With ``return_recv_hook=True`` the
            ``RecvHook`` that returns it.

        Raises:
            RuntimeError: a receive hook of this Buffer is pending (call it first).
            ValueError: the routing error of the previous ``dispatch`` (``cpu_sync=False``), raised instead of running
                (see ``dispatch``); also any argument that breaks its rule, before anything is sent.
        """
        prepared = self._prepared
        if prepared is not None and self._pending is None and topk_weights is None and bias is None and \
                return_recv_hook is False:
            return prepared.combine(self._combine, self._checked_handles, y, handle)
        return self._combine(y, handle, topk_weights, bias, return_recv_hook)

    @holds_captured_memory
    def _combine(self, y: Any, handle: Any, topk_weights: Any, bias: Any,
                 return_recv_hook: Any) -> Union[CombineOutput, RecvHook]:
        """:meth:`combine` by the general path: every argument checked, then the backend's request."""
        be = self._ready("combine")
        chk.check_flag(return_recv_hook, "return_recv_hook")
        geo = self.geometry
        self._checked_handles.check(handle, "dispatch")
        y = be.as_array(y, "y")
        chk.check_payload(y, "y", handle.num_out_rows, geo, "rows of the dispatch's recv_x")
        if topk_weights is not None:
            topk_weights = be.as_array(topk_weights, "topk_weights")
            shape = (handle.num_out_rows,) if handle.expand else (handle.num_out_rows, geo.num_topk)
            chk.check_weights(topk_weights, "topk_weights", shape)
            topk_weights = as_float32(be.xp, topk_weights, copy=False)
        bias_terms = tuple(be.as_array(b, "bias") for b in chk.check_bias(bias, handle.num_tokens, geo))
        return self._start(return_recv_hook, be.combine, be.combine_send,
                           CombineRequest(y, handle, topk_weights, bias_terms))

    def profile_table(self) -> List[ProfileRow]:
        """This rank's per-phase timings (``Buffer(profile=True)``); after ``close``, those up to the close.

        Returns:
            A list of ``ProfileRow`` (a NamedTuple), one per (operation, phase) in first-seen order:
            ``op`` str (``"dispatch"``, ``"combine"``, ``"close"``), ``phase`` str (``"total"``,
            ``"signal+wait"``, ...), ``calls`` int, ``host_us_p50`` float (median host
            microseconds), ``gpu_us_p50`` float (median GPU microseconds, CUDA events) or None on
            ``mpi``. Reading it on ``nvshmem`` waits for the recorded events.

        Raises:
            RuntimeError: the Buffer was made with ``profile=False``.
        """
        if not self._profiling:
            raise RuntimeError("profile_table: this Buffer was made with profile=False; "
                               "pass Buffer(..., profile=True) to record timings")
        return self._closed_profile if self._backend is None else self._backend.profile_table()

    def traffic(self) -> Traffic:
        """What this rank has sent over its links so far (after ``close``: up to the close); local.

        Returns:
            ``Traffic`` (a NamedTuple): ``scaleout_rows``, the payload rows put into ranks of other nodes (forwarders'
            inboxes included) as ``OperationRows(dispatch, combine)`` ints; None on ``nvshmem`` (not counted).
        """
        return self._closed_traffic if self._backend is None else self._backend.traffic()

    def close(self) -> None:
        """Release the buffer: collective (bounded wait) after a clean run; after any failure (this rank's
        timeout or error, a peer's abort record) a local release without collective calls, whose window or
        symmetric memory and communicator are leaked to the process (README, Reliability). Safe to call twice.
        A pending receive hook (``return_recv_hook=True``) is invalidated (calling it raises RuntimeError) and the
        close proceeds as usual (the peers may still receive what its send half sent).

        Raises:
            ep_comm.TimeoutError: a peer did not close within ``timeout_s`` (local resources are
            released anyway, and the peers get this rank's abort record).
            ep_comm.PeerAbortedError: a peer had given up on the Buffer (its abort record was here on entry
            or came during the wait); released locally, at once.
        """
        if self._pending is not None:
            self._pending.invalidate()
            self._pending = None
        if self._backend is not None:
            backend, self._backend, self._prepared = self._backend, None, None
            try:
                backend.close()
            finally:
                self._closed_traffic = backend.traffic()
                if self._profiling:
                    self._closed_profile = backend.profile_table()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
