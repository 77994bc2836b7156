"""``ep_comm.Buffer``: the public API. Checks every argument, then hands the work to a backend."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

from mpi4py import MPI

from . import validate as chk
from .backends import make_backend
from .dtypes import payload_dtype
from .handle import CombineOutput, DispatchOutput, EPHandle
from .layout import DispatchLayout


def _holds_captured_memory(method: Callable) -> Callable:
    """Run a Buffer method inside the backend's :meth:`Buffer._captured_memory`."""
    @functools.wraps(method)
    def call(self: "Buffer", *args: Any, **kwargs: Any) -> Any:
        with self._captured_memory():
            return method(self, *args, **kwargs)
    return call


class Buffer:
    """Expert-parallel dispatch/combine among the ranks of an MPI communicator.

    Rank ``r`` owns global experts ``[r*E/R, (r+1)*E/R)``. Buffers are allocated once, at the
    worst case of ``R * num_max_tokens_per_rank`` rows. Every rank must call ``dispatch`` and
    ``combine`` collectively; a rank that does not arrive within ``timeout_s`` makes the others
    raise ``ep_comm.TimeoutError`` naming it.

    ``num_sms`` (keyword-only, an extension of the contract, like DeepEP's ``Buffer.set_num_sms``):
    how many SMs the GPU kernels' grids are sized for; None (default) = all SMs of the device.
    An integer >= 1 (TypeError for another type, bool included; ValueError below 1). On
    ``nvshmem`` the kernels run ``2 * num_sms`` blocks (``8 * num_sms`` for the row-streaming
    ones), and a value above the SM count of any rank's GPU raises ValueError on every rank.
    On ``mpi`` it is accepted and has no effect (there are no kernels). Give every rank the same
    value. ``buf.num_sms`` is the SM count in effect: an int on ``nvshmem`` (the device's SM count
    for None), None on ``mpi``.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, num_experts: int, hidden: int, num_topk: int,
                 num_max_tokens_per_rank: int, dtype: Any = "bfloat16", backend: str = "auto",
                 deterministic: bool = False, timeout_s: float = 100.0, num_sms: Optional[int] = None):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator or None, got {type(comm).__name__}")
        chk.check_geometry(comm.size, num_experts, hidden, num_topk, num_max_tokens_per_rank)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds")
        chk.check_num_sms(num_sms)
        self.geometry = chk.Geometry(comm.size, int(num_experts), int(hidden), int(num_topk),
                                     int(num_max_tokens_per_rank), payload_dtype(dtype))
        self.deterministic = bool(deterministic)
        self.timeout_s = float(timeout_s)
        self._backend = make_backend(backend, comm, self.geometry, self.deterministic, self.timeout_s,
                                     None if num_sms is None else int(num_sms))
        self.num_sms: Optional[int] = self._backend.num_sms
        self.rank = comm.rank
        self.num_ranks = comm.size

    @property
    def backend(self) -> str:
        """``"mpi"`` or ``"nvshmem"``."""
        return self._backend.name

    @property
    def num_local_experts(self) -> int:
        return self.geometry.experts_per_rank

    def _live(self):
        if self._backend is None:
            raise RuntimeError("this Buffer is closed")
        return self._backend

    def _topk_idx(self, topk_idx: Any):
        be = self._live()
        topk_idx = be.as_array(topk_idx, "topk_idx")
        chk.check_topk_idx(be.xp, topk_idx, self.geometry, getattr(be, "routing_summary", None))
        return topk_idx

    @_holds_captured_memory
    def get_dispatch_layout(self, topk_idx: Any) -> DispatchLayout:
        """Counts of a routing ``topk_idx [T, K]`` (local, no communication):
        ``num_tokens_per_rank [R]``, ``num_tokens_per_expert [E]``, ``is_token_in_rank [T, R]``."""
        return self._live().dispatch_layout(self._topk_idx(topk_idx))

    @_holds_captured_memory
    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *, handle: Optional[EPHandle] = None,
                 expand: bool = False, expert_alignment: int = 1, zero_padding: bool = False, cpu_sync: bool = True,
                 stats: Any = None) -> DispatchOutput:
        """Send each token ``x [T, H]`` to the ranks of its experts.

        Give exactly one of ``topk_idx [T, K]`` (a new routing) and ``handle`` (replay the
        routing of an earlier dispatch: no counting, no count exchange; ``expand``,
        ``expert_alignment`` and ``zero_padding`` then come from the handle). ``topk_weights
        [T, K]`` float is carried along. See ``DispatchOutput`` for the outputs.
        """
        be = self._live()
        geo = self.geometry
        if (topk_idx is None) == (handle is None):
            raise ValueError("give exactly one of topk_idx (a new routing) and handle (a cached dispatch)")
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be an EPHandle from an earlier dispatch, got {type(handle).__name__}")
            chk.check_handle(handle, geo)
            num_tokens, idx = handle.num_tokens, handle.topk_idx
            expand, expert_alignment, zero_padding = handle.expand, handle.expert_alignment, handle.zero_padding
        else:
            idx = self._topk_idx(topk_idx)
            num_tokens = idx.shape[0]
            chk.check_alignment(expert_alignment)
        x = be.as_array(x, "x")
        chk.check_payload(x, "x", num_tokens, geo, "num_tokens")
        if topk_weights is not None:
            topk_weights = be.as_array(topk_weights, "topk_weights")
            chk.check_weights(topk_weights, "topk_weights", (num_tokens, geo.num_topk))
            topk_weights = topk_weights.astype(be.xp.float32, copy=False)
        elif handle is not None:
            topk_weights = handle.topk_weights
        if stats is not None:
            stats = be.as_array(stats, "stats")
            chk.check_stats(stats, geo)
        return be.dispatch(x, idx, topk_weights, handle, bool(expand), int(expert_alignment), bool(zero_padding),
                           bool(cpu_sync), stats)

    def _captured_memory(self):
        """The backend's hold on what a call allocates while a CUDA graph is captured (GPU backends)."""
        return getattr(self._live(), "captured_memory", contextlib.nullcontext)()

    @_holds_captured_memory
    def combine(self, y: Any, handle: EPHandle, *, topk_weights: Any = None, bias: Any = None) -> CombineOutput:
        """Bring expert outputs back and reduce them.

        ``y`` is ``[rows, H]`` laid out as the dispatch's ``recv_x`` (compact or expand).
        Compact: ``x[t] = bias + sum over ranks r ascending of y_r[row(t, r)]``. Expand: each rank
        first reduces its rows of token t in top-k order, weighted by ``topk_weights [rows]`` when
        given. float32 accumulation in a fixed order: bitwise reproducible. ``bias``: None, ``[T, H]``
        or a pair. Compact ``topk_weights [rows, K]`` are gathered back into ``res.topk_weights [T, K]``.
        """
        be = self._live()
        geo = self.geometry
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from dispatch, got {type(handle).__name__}")
        chk.check_handle(handle, geo)
        y = be.as_array(y, "y")
        chk.check_payload(y, "y", handle.num_out_rows, geo, "rows of the dispatch's recv_x")
        if topk_weights is not None:
            topk_weights = be.as_array(topk_weights, "topk_weights")
            shape = (handle.num_out_rows,) if handle.expand else (handle.num_out_rows, geo.num_topk)
            chk.check_weights(topk_weights, "topk_weights", shape)
            topk_weights = topk_weights.astype(be.xp.float32, copy=False)
        bias_terms = tuple(be.as_array(b, "bias") for b in chk.check_bias(bias, handle.num_tokens, geo))
        return be.combine(y, handle, topk_weights, bias_terms)

    def close(self) -> None:
        """Release the symmetric buffer (collective, bounded wait). Safe to call twice."""
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
