"""What ``Buffer`` asks of a backend: the ``Backend`` protocol, the settings it is built with, and one
request object per collective call (the arguments ``Buffer`` has already checked).

Shapes: ``T`` tokens of this rank, ``H`` hidden, ``K`` top-k width, ``R`` ranks, ``L`` local experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Generic,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
    runtime_checkable,
)

from ep_comm.backends.profile import ProfileRow
from ep_comm.contract.arrays import Array
from ep_comm.contract.layout import DispatchLayout
from ep_comm.handle import CombineOutput, DispatchOutput, EPHandle

Output = TypeVar("Output", DispatchOutput, CombineOutput)


@dataclass(frozen=True)
class BackendSettings:
    """The Buffer's choices every backend is built with (validated by ``Buffer``)."""

    deterministic: bool
    timeout_s: float
    num_sms: Optional[int] = None  # SMs the GPU kernels are sized for; None: all of the device's
    transport: str = "auto"  # one of contract.choices.TRANSPORTS; the mpi backend has no choice to make
    scaleup_ranks: Optional[int] = None  # ranks per (virtual) node (contract.topology); None: one node
    forwarding: bool = False  # node-aware forwarding (contract.forward_inbox); across nodes built on mpi only
    profile: bool = False  # record per-phase timings for Backend.profile_table()
    wait_stats: bool = True  # measure every dispatch's and combine's waits per peer (Backend.wait_table())


@dataclass(frozen=True)
class DispatchRequest:
    """One checked ``Buffer.dispatch`` call.

    ``x [T, W]`` payload in the buffer dtype: ``W = H``, or for an FP8 dispatch what the backend's
    ``pack_fp8`` gave: the packed FP8 rows (``ep_comm.contract.fp8``, ``packed_row_bytes(H)`` bytes) viewed in the buffer
    dtype, ``W = P / itemsize``, or an object that stands for them (``shape`` ``(T, W)``; ``nvshmem``: an
    ``ep_comm.launching.fp8.Fp8Rows``, written as packed rows by the scatter); ``recv_x`` then has ``W`` columns
    too. ``topk_idx [T, K]`` int (the handle's for a replay); ``topk_weights [T, K]``
    float32 or None; ``handle`` the routing to replay or None; ``stats [L]`` int or None. For a replay
    ``expand``/``expert_alignment``/``zero_padding`` are the handle's.
    """

    x: Array
    topk_idx: Array
    topk_weights: Optional[Array]
    handle: Optional[EPHandle]
    expand: bool
    expert_alignment: int
    zero_padding: bool
    cpu_sync: bool
    stats: Optional[Array]


@dataclass(frozen=True)
class CombineRequest:
    """One checked ``Buffer.combine`` call: ``y [rows, H]`` laid out as the dispatch's ``recv_x``,
    ``topk_weights`` (``[rows]`` expand, ``[rows, K]`` compact) float32 or None, ``bias_terms``: 0-2
    arrays ``[T, H]``."""

    y: Array
    handle: EPHandle
    topk_weights: Optional[Array]
    bias_terms: Tuple[Array, ...]


@dataclass(frozen=True)
class ReceiveHalf(Generic[Output]):
    """The receive part of a step whose send part a backend enqueued (``Buffer(..., return_recv_hook=True)``).

    ``step``: the step by kind and number (``"dispatch #3"``); ``prepare()``: raises RuntimeError when the receive
    cannot be enqueued now (nothing is enqueued and the step stays pending: e.g. the send was captured into a
    CUDA graph and the caller's stream is not being captured), else orders the caller's stream after the send
    where needed; ``receive()``: enqueues the bounded wait for every rank's signal and the receive, and returns
    the step's output (guarded by ``Steps.resume``).
    """

    step: str
    prepare: Callable[[], None]
    receive: Callable[[], Output]


class OperationRows(NamedTuple):
    """Rows per collective operation."""

    dispatch: int
    combine: int


class Traffic(NamedTuple):
    """What one rank of a Buffer has sent over its links so far (``Buffer.traffic()``).

    ``scaleout_rows``: the payload rows this rank put into ranks of other nodes (``Buffer(scaleup_ranks=...)``),
    forwarders' inboxes included, per operation (``mpi``: counted on the host; ``nvshmem``: by the kernels, on the
    device; ``ep_comm.contract.traffic`` models them).
    """

    scaleout_rows: OperationRows


@runtime_checkable
class Backend(Protocol):
    """The protocol on one rank: ``mpi`` (``MpiBackend``) and ``nvshmem`` (``NvshmemBackend``)."""

    name: str  # "mpi" or "nvshmem"
    num_sms: Optional[int]  # SMs the kernels use; None without kernels
    transport_name: Optional[str]  # "stores", "puts" or "stores+puts" in effect; None where there is no choice (mpi)
    xp: Any  # the array module of the backend's arrays (numpy or cupy)

    def as_array(self, obj: Any, name: str) -> Array:
        """``obj`` as an array of ``xp`` (zero copy); TypeError naming ``name`` for arrays it cannot take."""

    def capturing(self) -> bool:
        """Whether the caller's stream is being captured into a CUDA graph now (never on a backend without graphs)."""

    def routing_summary(self, topk_idx: Array) -> Tuple[int, int]:
        """``(largest id, first row naming an expert twice or -1)`` of a non-empty ``[T, K]`` routing of signed ids:
        the local check of ``Buffer.get_dispatch_layout`` (a dispatch checks its routing in its count step, see
        :meth:`dispatch`)."""

    def dispatch_layout(self, topk_idx: Array) -> DispatchLayout:
        """The local counts of a routing ``[T, K]`` (no communication)."""

    def pack_fp8(self, x: Any) -> Any:
        """The payload of an FP8 dispatch (local, no communication) of ``x``: the pair ``(x_fp8 [T, H], scales
        [T, H // 128])`` (a tuple), or ``x [T, H]`` in the buffer dtype to quantize as ``ep_comm.contract.fp8.quantize``
        (``Buffer.dispatch(use_fp8=True)``). Returns the packed FP8 rows ``[T, packed_row_bytes(H) / itemsize]``
        (``ep_comm.contract.fp8``) in the buffer dtype, or what stands for them in :class:`DispatchRequest`."""

    def dispatch(self, request: DispatchRequest) -> DispatchOutput:
        """One collective dispatch. A new routing's ids are checked in its count step and the verdict travels with
        the count exchange: when any rank's is bad no rank receives a row and every rank raises the same
        ``checks.routing_error``, with ``cpu_sync`` from this call (from the receive part of
        :meth:`dispatch_send`), else from its next ``dispatch``/``combine`` (before anything collective), the
        backend usable after; ``close`` drops one not raised yet."""

    def dispatch_send(self, request: DispatchRequest) -> ReceiveHalf[DispatchOutput]:
        """The send part of one collective dispatch (count, scatter, signal; no wait), and its receive part."""

    def combine(self, request: CombineRequest) -> CombineOutput:
        """One collective combine."""

    def combine_send(self, request: CombineRequest) -> ReceiveHalf[CombineOutput]:
        """The send part of one collective combine (rows back, signal; no wait), and its receive part."""

    def captured_memory(self) -> ContextManager[None]:
        """Around a whole Buffer call: holds what the call allocates while a CUDA graph is captured."""

    def profile_table(self) -> List[ProfileRow]:
        """The per-phase timings so far (empty when profiling is off)."""

    def traffic(self) -> Traffic:
        """What this rank has sent over its links so far (:class:`Traffic`); still readable after ``close``."""

    def wait_table(self) -> Any:
        """A host copy of this rank's wait statistics so far: int64 ``[R, WAIT_WORDS]``
        (``ep_comm.transport.wait_stats``; all zero when not measured)."""

    def reset_waits(self) -> None:
        """Set the wait statistics to zero (on ``nvshmem`` in stream order, after the waits enqueued before)."""

    def close(self) -> None:
        """Collective release with a bounded wait; a second call does nothing."""
