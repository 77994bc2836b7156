"""``ep_comm.Buffer``: the public API. Checks every argument (``ep_comm._buffer_arguments``: the checks and forms
a backend takes), then hands the work to a backend."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional, Union

from mpi4py import MPI

from ep_comm._buffer_arguments import (
    check_constructor_arguments,
    dispatch_request,
    fp8_output,
    topk_idx_array,
)
from ep_comm.backends import make_backend, resolve_backend
from ep_comm.backends.interface import Backend, BackendSettings, CombineRequest, OperationRows, Traffic
from ep_comm.backends.profile import ProfileRow
from ep_comm.contract import checks as chk
from ep_comm.contract.agreement import agree, construction_fields
from ep_comm.contract.arrays import as_float32
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.layout import DispatchLayout
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle, HandleChecks
from ep_comm.recv_hook import RecvHook
from ep_comm.transport.wait_stats import WaitStats, decode


def holds_captured_memory(method: Callable) -> Callable:
    """Run a Buffer method inside its backend's ``captured_memory()`` (what a CUDA graph capture allocates)."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._open_backend().captured_memory():
            return method(self, *args, **kwargs)
    return call


class Buffer:
    """Expert-parallel dispatch/combine among the ranks of an MPI communicator.

    Rank ``r`` owns global experts ``[r*E/R, (r+1)*E/R)``. Every rank calls ``dispatch``, ``combine`` and ``close``
    collectively; a peer missing past ``timeout_s`` raises ``ep_comm.TimeoutError``, a peer's abort record
    ``ep_comm.PeerAbortedError``. The full contract is docs/design.md, "The public API" (attributes: "Construction").
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, num_experts: int, hidden: int, num_topk: int,
                 num_max_tokens_per_rank: int, dtype: Any = "bfloat16", backend: str = "auto",
                 deterministic: bool = False, timeout_s: float = 100.0, num_sms: Optional[int] = None,
                 transport: str = "auto", scaleup_ranks: Optional[int] = None, forwarding: bool = False,
                 profile: bool = False, wait_stats: bool = True):
        """Collective over ``comm``: every rank passes the same arguments (docs/design.md, "Construction").

        Args:
            comm: an mpi4py intra-communicator, or None for ``MPI.COMM_WORLD``; its size is ``R``.
            num_experts: ``E`` global experts, a multiple of ``R``.
            hidden: ``H``, elements per token row.
            num_topk: ``K <= E``, experts per token.
            num_max_tokens_per_rank: ``T``, the most tokens a rank dispatches at once.
            dtype: the payload dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or the NumPy / ml_dtypes type.
            backend: ``"nvshmem"`` (GPU), ``"mpi"`` (CPU) or ``"auto"`` (``ep_comm.backends.choose_backend``).
            deterministic: rows inside each block in ascending (source rank, source token) order.
            timeout_s: seconds (> 0) to wait for a peer before ``ep_comm.TimeoutError``.
            num_sms: an int >= 1, the SMs the GPU kernels' grids are sized for; None = all (no effect on ``mpi``).
            transport: ``"auto"``, ``"stores"`` or ``"puts"``: how ``nvshmem`` reaches each peer (no effect on ``mpi``).
            scaleup_ranks: ranks per (virtual) node, an int >= 1 dividing ``R``; None = one node.
            forwarding: a bool: node-aware forwarding across nodes (``mpi``; ``nvshmem`` takes it in one node only).
            profile: a bool: record per-phase timings for :meth:`profile_table`.
            wait_stats: a bool: measure every dispatch's and combine's waits per peer for :meth:`wait_stats`
                (default on: a few device stores per wait on ``nvshmem``, see docs/design.md, "Wait statistics").

        Raises:
            TypeError: an argument of the wrong type (``comm`` an inter-communicator, a non-bool flag, ...).
            ValueError: an argument that breaks its rule, on this rank and named on every other; ranks that disagree.
            RuntimeError: ``backend="auto"`` found a broken GPU stack.
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
            chk.check_flag(wait_stats, "wait_stats")
            chk.check_flag(deterministic, "deterministic")
        except (TypeError, ValueError, RuntimeError) as exc:  # still collective: the peers learn of it and raise too
            error = exc
        agree(comm, fields, error)
        self.deterministic = bool(deterministic)
        self.timeout_s = float(timeout_s)
        settings = BackendSettings(self.deterministic, self.timeout_s, None if num_sms is None else int(num_sms),
                                   transport, scaleup_ranks, bool(forwarding), bool(profile), bool(wait_stats))
        self._backend: Optional[Backend] = make_backend(backend_name, comm, self.geometry, settings)
        self._closed_profile: List[ProfileRow] = []
        self._closed_traffic = Traffic(OperationRows(0, 0))
        self._checked_handles = HandleChecks(self.geometry)  # the handles check_handle passed on this Buffer
        self._prepared = getattr(self._backend, "prepared", None)  # the backend's prepared paths, if it has them
        self._profiling = bool(profile)
        self._measuring_waits = bool(wait_stats)
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

    def _open_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("this Buffer is closed")
        return self._backend

    @staticmethod
    def _uncaptured(be: Backend, doing: str, what: str) -> Backend:
        """``be``, for ``doing``, which reads ``what`` back from the device: RuntimeError while the current stream is
        being captured into a CUDA graph (nothing can be read back then)."""
        if be.capturing():
            raise RuntimeError(f"{doing}: cannot read {what} while a CUDA graph is being captured")
        return be

    def _ready(self, doing: str) -> Backend:
        """The backend, for collective call ``doing``: RuntimeError while a receive hook is pending."""
        be = self._open_backend()
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
        """Counts of a routing (local, no communication; docs/design.md, "Layout without communication").

        Args:
            topk_idx: ``[T, K]`` integer global expert ids, ``< 0`` = no expert.

        Returns:
            ``DispatchLayout``: ``num_tokens_per_rank [R]`` int32 (a token counts once per rank),
            ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool.

        Raises:
            ValueError: an id ``>= num_experts`` or a row naming an expert twice, at once on this rank (nothing
                is collective here; ``dispatch`` raises it on every rank, ``checks.routing_error``).
        """
        be = self._open_backend()
        idx = topk_idx_array(be, self.geometry, topk_idx, "get_dispatch_layout")
        if idx.shape[0]:
            chk.check_topk_values(*be.routing_summary(idx), self.geometry)
        return be.dispatch_layout(idx)

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *, handle: Optional[EPHandle] = None,
                 expand: bool = False, expert_alignment: int = 1, zero_padding: bool = False, cpu_sync: bool = True,
                 stats: Any = None, use_fp8: bool = False,
                 return_recv_hook: bool = False) -> Union[DispatchOutput, RecvHook]:
        """Send each token to the ranks of its experts (collective; docs/design.md, "Dispatch", "FP8 dispatch").

        Give exactly one of ``topk_idx`` (a new routing) and ``handle`` (replay an earlier dispatch's routing).

        Args:
            x: ``[T, H]`` buffer dtype, or the FP8 pair ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)``.
            topk_idx: ``[T, K]`` integer global expert ids (``< 0`` = no expert), or None with ``handle``.
            topk_weights: ``[T, K]`` floating-point (carried as float32), or None (with ``handle``: its weights).
            handle: an ``EPHandle`` of an earlier dispatch of this geometry, or None.
            expand: False: rows per (token, rank), by source rank; True: per (token, local expert), expert-major.
            expert_alignment: (expand) an int >= 1; each expert's rows start at a multiple of it.
            zero_padding: (expand) padding rows are zero.
            cpu_sync: True: exact-size outputs; False: worst-case outputs, counts on the device (CUDA graphs).
            stats: ``[E/R]`` writeable integer array, the received unaligned per-local-expert counts added; or None.
            use_fp8: quantize ``x`` (buffer dtype) to FP8 on the sender.
            return_recv_hook: True: send only, and return an ``ep_comm.RecvHook`` that receives.

        Returns:
            ``DispatchOutput``: ``recv_x [rows, H]`` buffer dtype (an FP8 pair for FP8); ``recv_topk_idx`` int64
            ``[N, K]`` compact / ``[M]`` expand; ``recv_topk_weights`` float32, same shape, or None; ``handle``
            (``EPHandle``). With ``return_recv_hook=True`` the ``RecvHook`` that returns it.

        Raises:
            RuntimeError: a receive hook of this Buffer is pending, or a call refused under CUDA graph capture.
            ValueError: a bad ``topk_idx`` on any rank (on every rank, ``checks.routing_error``), or a bad argument.
            TypeError: an argument of the wrong type, on this rank before anything is sent.
        """
        prepared = self._prepared
        if prepared is not None and self._pending is None and stats is None and return_recv_hook is False:
            out = prepared.dispatch(self._checked_handles, x, topk_idx, topk_weights, handle, expand, expert_alignment,
                                    zero_padding, cpu_sync, use_fp8)
            if type(out) is DispatchOutput:  # FP8 (the pair, or use_fp8): the packed rows, unpacked as the general path
                return fp8_output(out, self.geometry.hidden) if use_fp8 is True or type(x) is tuple else out
            general = self._dispatch(x, topk_idx, topk_weights, handle, expand, expert_alignment, zero_padding,
                                     cpu_sync, None, use_fp8, False)
            prepared.learn_dispatch(out, general)
            return general
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
        """Bring expert outputs back and reduce them in a fixed float32 order (collective; docs/design.md, "Combine").

        Args:
            y: ``[rows, H]`` in the buffer's dtype, laid out as the dispatch's ``recv_x``.
            handle: the ``EPHandle`` of that dispatch.
            topk_weights: floating-point (as float32): ``[rows]`` expand, ``[rows, K]`` compact; or None.
            bias: None, one ``[T, H]`` floating-point array or a pair of them (as float32).
            return_recv_hook: True: send only, and return an ``ep_comm.RecvHook`` that reduces.

        Returns:
            ``CombineOutput``: ``x [T, H]`` buffer dtype; ``topk_weights [T, K]`` float32 or None. With
            ``return_recv_hook=True`` the ``RecvHook`` that returns it.

        Raises:
            RuntimeError: a receive hook of this Buffer is pending, or a call refused under CUDA graph capture.
            ValueError: the previous ``cpu_sync=False`` dispatch's routing error, or a bad argument.
            TypeError: an argument of the wrong type, on this rank before anything is sent.
        """
        prepared = self._prepared
        if prepared is not None and self._pending is None and bias is None and return_recv_hook is False:
            out = prepared.combine(self._checked_handles, y, handle, topk_weights)
            if type(out) is CombineOutput:
                return out
            general = self._combine(y, handle, topk_weights, None, False)
            prepared.learn_combine(out, general)
            return general
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

        A dispatch puts, flat, one row per token and destination rank of another node; forwarded, one per token and
        destination node (into its forwarder's inbox). A combine puts, flat, one row per row received from a rank of
        another node; forwarded, a forwarder puts one row per token of each source it forwards for that reached a
        rank of its node. On ``mpi`` the host counts them; on ``nvshmem`` the kernels count them on the device (so
        ``cpu_sync=False`` calls and CUDA-graph replays count too), and reading them copies the counter after the
        work enqueued on the current stream: it waits for that work (docs/design.md, "Node-aware forwarding").

        Returns:
            ``Traffic`` (a NamedTuple): ``scaleout_rows``, the payload rows put into ranks of other nodes (forwarders'
            inboxes included) as ``OperationRows(dispatch, combine)`` ints (0 in one node).

        Raises:
            RuntimeError: (``nvshmem``) the current stream is being captured into a CUDA graph.
        """
        if self._backend is None:
            return self._closed_traffic
        return self._uncaptured(self._backend, "traffic", "the scale-out rows").traffic()

    def wait_stats(self, reset: bool = False) -> WaitStats:
        """How long this rank's dispatches and combines waited for each peer since construction or the last reset
        (docs/design.md, "Wait statistics"); local, no communication.

        Every wait of a dispatch or combine (eager, split, CUDA-graph replays; stores, puts, forwarding) adds, per
        peer, the time from this rank's entry into the wait to the arrival of that peer's signal (0 when it was
        there already): on ``nvshmem`` the wait kernel keeps them on the device (``%globaltimer``), and reading
        them waits for the work enqueued on the current stream; on ``mpi`` the host wait loop keeps them.

        Args:
            reset: set them to zero after the read.

        Returns:
            ``WaitStats`` (``ep_comm.transport.wait_stats``): ``peers``, one ``PeerWaits`` per rank (``steps``,
            ``times_last`` (the waits in which it came last), ``total_us``, ``p50_us`` and ``p99_us`` from a
            half-octave histogram, ``max_us``, ``recent_us``, ``histogram``; this rank's own is zero), ``table`` (the
            raw int64 ``[R, WAIT_WORDS]`` words) and ``enabled`` (False with ``Buffer(wait_stats=False)``).

        Raises:
            RuntimeError: the Buffer is closed, or (``nvshmem``) the current stream is being captured.
        """
        be = self._uncaptured(self._open_backend(), "wait_stats", "the wait statistics")
        stats = decode(be.wait_table(), self.rank, self._measuring_waits)
        if reset:
            be.reset_waits()
        return stats

    def reset_wait_stats(self) -> None:
        """Set this rank's wait statistics to zero (on ``nvshmem`` in stream order: the waits enqueued before on the
        current stream are dropped too); local.

        Raises:
            RuntimeError: the Buffer is closed.
        """
        self._open_backend().reset_waits()

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
