"""The arguments of ``Buffer``'s calls, checked and put in the forms a backend takes (private to ``ep_comm.buffer``):
the constructor's own checks, a routing as the backend's array, the dispatch payload (the rows, or the FP8 pair
or ``use_fp8`` as the backend's FP8 payload) and the FP8 pair of its output, weights as float32, and a handle checked
once per Buffer."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

from ep_comm.backends.interface import Backend, DispatchRequest
from ep_comm.contract import checks as chk
from ep_comm.contract import fp8
from ep_comm.contract.arrays import as_float32
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.topology import check_scaleup_ranks
from ep_comm.handle import DispatchOutput, HandleChecks


def check_constructor_arguments(num_ranks: int, num_experts: Any, hidden: Any, num_topk: Any,
                                num_max_tokens_per_rank: Any, timeout_s: Any, num_sms: Any, transport: Any,
                                scaleup_ranks: Any, forwarding: Any, profile: Any) -> None:
    """This rank's own checks of the constructor's arguments (TypeError / ValueError), no communication."""
    chk.check_geometry(num_ranks, num_experts, hidden, num_topk, num_max_tokens_per_rank)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds")
    chk.check_num_sms(num_sms)
    chk.check_transport(transport)
    check_scaleup_ranks(scaleup_ranks, num_ranks)
    if transport == "stores" and scaleup_ranks is not None and scaleup_ranks < num_ranks:
        raise ValueError(f"transport='stores' with scaleup_ranks={scaleup_ranks}: stores reach only the peers of a "
                         f"rank's node of {scaleup_ranks}, and {num_ranks} ranks make {num_ranks // scaleup_ranks} "
                         "nodes: use transport='auto' or 'puts'")
    chk.check_flag(forwarding, "forwarding")
    chk.check_profile(profile)


def fp8_output(out: DispatchOutput, hidden: int) -> DispatchOutput:
    """``out`` with its packed FP8 ``recv_x`` (``[rows, P / itemsize]``) as the pair ``(recv_x_fp8 [rows, H],
    recv_scales [rows, H / 128] float32)``, views of it (``ep_comm.contract.fp8.unpack``)."""
    return DispatchOutput(fp8.unpack(out.recv_x, hidden), out.recv_topk_idx, out.recv_topk_weights, out.handle)


def topk_idx_array(be: Backend, geo: Geometry, topk_idx: Any, doing: str) -> Any:
    """``topk_idx`` ``[T, K]`` as the backend's array of signed ids, for Buffer call ``doing``: its type, shape, token
    count and (unsigned) int64 range checked (``checks.check_topk_idx``); unsigned ids as a new int64 array, so that
    no id wraps round to "no expert". Its values are the dispatch's count step's to check.

    Raises:
        RuntimeError: unsigned ids while the caller's stream is being captured into a CUDA graph (their range check
            reads uint64 ids back to the host, which a capture cannot hold), before anything is enqueued.
    """
    topk_idx = be.as_array(topk_idx, "topk_idx")
    unsigned = topk_idx.dtype.kind == "u"
    if unsigned and be.capturing():
        raise RuntimeError(f"topk_idx has dtype {topk_idx.dtype}: a {doing} captured into a CUDA graph needs signed "
                           "expert ids (int32 or int64), which its kernels check on the device; unsigned ids are "
                           "checked and converted on the host path first, which a capture cannot hold. Pass topk_idx "
                           "as int32 or int64 (nothing was enqueued: the Buffer stays usable)")
    chk.check_topk_idx(topk_idx, geo)
    return topk_idx.astype(be.xp.int64) if unsigned else topk_idx


def dispatch_payload(be: Backend, geo: Geometry, x: Any, num_tokens: int, use_fp8: Any) -> tuple:
    """``(payload, is_fp8)``: ``x`` checked as the dispatch's payload (``num_tokens`` rows). Non-FP8: ``x``
    itself ``[T, H]``. FP8 (``x`` a pair, or ``use_fp8``): the backend's ``pack_fp8`` of the pair or of ``x``,
    the packed FP8 rows ``[T, P]`` (``ep_comm.contract.fp8``) as a payload in the buffer dtype, ``[T, P / itemsize]``
    (the narrower payload the backends carry; on ``nvshmem`` written by the scatter itself)."""
    chk.check_flag(use_fp8, "use_fp8")
    is_pair = not hasattr(x, "shape") and chk.is_fp8_pair(x)  # an array is no pair: no call on the fast path
    if is_pair and use_fp8:
        raise ValueError("use_fp8=True with x given as an FP8 pair (x_fp8, scales): use_fp8 quantizes x given in "
                         "the buffer's dtype; pass one or the other")
    if is_pair or use_fp8:
        chk.check_fp8_hidden(geo.hidden)
    if is_pair:
        x_fp8, scales = (be.as_array(a, name) for name, a in zip(chk.FP8_PARTS, chk.fp8_pair(x)))
        chk.check_fp8_pair(x_fp8, scales, num_tokens, geo, "num_tokens")
        return be.pack_fp8((x_fp8, scales)), True
    x = be.as_array(x, "x")
    chk.check_payload(x, "x", num_tokens, geo, "num_tokens")
    return (be.pack_fp8(x), True) if use_fp8 else (x, False)


def dispatch_request(be: Backend, geo: Geometry, handles: HandleChecks, x: Any, topk_idx: Any, topk_weights: Any,
                     handle: Any, expand: Any, expert_alignment: Any, zero_padding: Any, cpu_sync: Any, stats: Any,
                     use_fp8: Any) -> Tuple[DispatchRequest, Optional[Callable[[DispatchOutput], DispatchOutput]]]:
    """``(request, finish)``: the arguments of ``Buffer.dispatch`` checked (its docstring says the rules) as the
    backend's ``DispatchRequest``, and what turns the backend's output into the caller's (the FP8 pair of a packed
    ``recv_x``) or None."""
    if (topk_idx is None) == (handle is None):
        raise ValueError("give exactly one of topk_idx (a new routing) and handle (a cached dispatch)")
    if handle is not None:
        handles.check(handle, "an earlier dispatch")
        num_tokens, idx = handle.num_tokens, handle.topk_idx
        expand, expert_alignment, zero_padding = handle.expand, handle.expert_alignment, handle.zero_padding
    else:
        idx = topk_idx_array(be, geo, topk_idx, "dispatch")
        num_tokens = idx.shape[0]
        chk.check_alignment(expert_alignment)
        chk.check_flag(expand, "expand")
        chk.check_flag(zero_padding, "zero_padding")
    chk.check_flag(cpu_sync, "cpu_sync")
    x, is_fp8 = dispatch_payload(be, geo, x, num_tokens, use_fp8)
    if topk_weights is not None:
        topk_weights = be.as_array(topk_weights, "topk_weights")
        chk.check_weights(topk_weights, "topk_weights", (num_tokens, geo.num_topk))
    if stats is not None:
        stats = be.as_array(stats, "stats")
        chk.check_stats(stats, geo)
    # the handle owns its routing: the backend copies the ids (the GPU's count kernel as it reads them), the weights
    # are copied here (none on a replay)
    if topk_weights is not None:
        topk_weights = as_float32(be.xp, topk_weights, copy=True)
    elif handle is not None:
        topk_weights = handle.topk_weights
    finish = functools.partial(fp8_output, hidden=geo.hidden) if is_fp8 else None
    return DispatchRequest(x, idx, topk_weights, handle, bool(expand), int(expert_alignment), bool(zero_padding),
                           bool(cpu_sync), stats), finish
