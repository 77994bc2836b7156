"""Inputs in every memory layout a user can pass, and masked ids written as any negative value: the call sequences
that check a Buffer's results depend on neither (docs/design.md, "Recorded calls" and "Dispatch").

:func:`layout_sequence` makes calls of one shape with the layouts of every input changing between them; each call
must give the bytes of the same call with C-contiguous inputs. :func:`negative_id_sequence` writes the masked entries
of a routing as each negative value; each call must give the bytes of -1. :func:`bias_pair_sequence` gives a combine's
bias as one array twice in some calls of a shape and as two in others. They return every output, in call order, so
that two backends' sequences (or a Buffer's and a fresh one's) can be compared with each other too."""
from __future__ import annotations

import itertools
from typing import Any, List, Optional

import numpy as np

from helpers.same_outputs import assert_same, assert_same_dispatch, assert_same_outputs

# the layouts cycled through, offset so that every pair (C then F, F then C, ...) follows each other somewhere
IDX_LAYOUTS = ["C", "F", "C", "F", "columns", "C", "rows", "offset", "F", "C"]
X_LAYOUTS = ["C", "C", "F", "offset", "rows", "C", "columns", "F", "offset", "C"]
OTHER_LAYOUTS = ["C", "offset", "F", "C", "rows", "columns", "C", "offset", "F", "C"]

INT64_MIN, INT32_MIN = int(np.iinfo(np.int64).min), int(np.iinfo(np.int32).min)
NEGATIVE_IDS = {"int64": [-2, INT32_MIN, INT64_MIN, INT64_MIN + 1], "int32": [-1, -2, INT32_MIN]}


def _module(a: Any) -> Any:
    """The array module of ``a`` (NumPy, or CuPy for GPU arrays)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy  # only GPU arrays are not NumPy's

    return cupy


def in_layout(a: Optional[Any], layout: str) -> Optional[Any]:
    """The values of array ``a`` (on its device) in a new array of memory layout ``layout``: ``C`` (row-major),
    ``F`` (column-major), ``columns`` (every second element of the last axis of a wider array), ``rows`` (every
    second row of a taller array, one row in), ``offset`` (C order, one element past an allocation's start: not on
    16 bytes)."""
    if a is None:
        return None
    xp = _module(a)
    if layout in ("C", "F"):
        return xp.array(a, order=layout)
    if layout == "offset":
        view = xp.zeros(a.size + 1, a.dtype)[1:].reshape(a.shape)
    elif layout == "columns":
        view = xp.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)[..., 1::2]
    else:
        view = xp.zeros((2 * a.shape[0] + 1,) + a.shape[1:], a.dtype)[1::2]
    view[...] = a
    return view


def layout_sequence(buf: Any, inputs: tuple, expand: bool, cpu_sync: bool) -> List[Any]:
    """A new routing, its combine (``y``, weights, bias) and a cached dispatch, with C-contiguous ``inputs``
    ``(x [T, H], topk_idx [T, K], topk_weights [T, K], bias [T, H] float32)``; then each again ten times with the
    layouts of every input changing between calls, each asserted equal, byte for byte, to its C-contiguous call.
    Returns every output, in call order."""
    x, idx, weights, bias = inputs
    opts = dict(expand=expand, expert_alignment=2 if expand else 1, zero_padding=expand, cpu_sync=cpu_sync)
    want = buf.dispatch(x, idx, weights, **opts)
    want_back = buf.combine(want.recv_x, want.handle, topk_weights=want.recv_topk_weights, bias=bias)
    want_cached = buf.dispatch(x, handle=want.handle, topk_weights=weights, cpu_sync=cpu_sync)
    outputs = [want, want_back, want_cached]
    layouts = zip(IDX_LAYOUTS, X_LAYOUTS, OTHER_LAYOUTS, itertools.cycle(["F", "offset", "C", "rows"]))
    for call, (li, lx, lw, ly) in enumerate(layouts):
        tag = f"call {call} (topk_idx {li}, x {lx}, weights {lw}, y {ly})"
        got = buf.dispatch(in_layout(x, lx), in_layout(idx, li), in_layout(weights, lw), **opts)
        assert_same_dispatch(f"{tag} dispatch", want, got)
        back = buf.combine(in_layout(got.recv_x, ly), got.handle, topk_weights=in_layout(got.recv_topk_weights, lw),
                           bias=in_layout(bias, lx))
        assert_same_outputs([want_back], [back])
        cached = buf.dispatch(in_layout(x, ly), handle=want.handle, topk_weights=in_layout(weights, li),
                              cpu_sync=cpu_sync)
        assert_same_dispatch(f"{tag} cached dispatch", want_cached, cached)
        outputs += [got, back, cached]
    return outputs


def with_masked_as(idx: np.ndarray, dtype: str, value: int) -> np.ndarray:
    """Host ids ``idx`` (int64, -1 masked) as ``dtype`` ids with every masked entry written as ``value``."""
    out = idx.astype(dtype)
    out[idx < 0] = value
    return out


def negative_id_sequence(buf: Any, x: Any, idx: np.ndarray, weights: Any, dtype: str, expand: bool,
                         to_device: Any) -> List[Any]:
    """Dispatches (cpu_sync and not, with ``stats``), cached replays, combines and layout calls of routing ``idx``
    (host int64, -1 masked), first as it is, then with its masked entries written as each of ``NEGATIVE_IDS[dtype]``
    in ``dtype`` ids: each asserted equal, byte for byte, to the call with -1. ``to_device``: a host array where the
    Buffer takes its inputs. Returns every output, in call order."""
    assert (idx < 0).any(), "a routing with masked entries"
    opts = dict(expand=expand, expert_alignment=2 if expand else 1, zero_padding=expand)
    local = buf.geometry.experts_per_rank
    outputs: List[Any] = []
    for cpu_sync in (True, False):
        want_stats = to_device(np.zeros(local, np.int64))
        want = buf.dispatch(x, to_device(idx), weights, cpu_sync=cpu_sync, stats=want_stats, **opts)
        want_back = buf.combine(want.recv_x, want.handle, topk_weights=want.recv_topk_weights)
        want_cached = buf.dispatch(x, handle=want.handle, cpu_sync=cpu_sync)
        want_layout = buf.get_dispatch_layout(to_device(idx))
        outputs += [want, want_back, want_cached]
        for value in NEGATIVE_IDS[dtype]:
            tag = f"{dtype} ids, masked as {value}, cpu_sync={cpu_sync}"
            ids = to_device(with_masked_as(idx, dtype, value))
            stats = to_device(np.zeros(local, np.int64))
            got = buf.dispatch(x, ids, weights, cpu_sync=cpu_sync, stats=stats, **opts)
            assert_same_dispatch(tag, want, got)
            assert_same(f"{tag}: stats", want_stats, stats)
            back = buf.combine(got.recv_x, got.handle, topk_weights=got.recv_topk_weights)
            assert_same_outputs([want_back], [back])
            cached = buf.dispatch(x, handle=got.handle, cpu_sync=cpu_sync)
            assert_same_dispatch(f"{tag} cached", want_cached, cached)
            layout = buf.get_dispatch_layout(ids)
            for field in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
                assert_same(f"{tag}: layout {field}", getattr(want_layout, field), getattr(layout, field))
            outputs += [got, back, cached]
    return outputs


def bias_pair_sequence(buf: Any, inputs: tuple, expand: bool, apart: bool) -> List[Any]:
    """A new routing of ``inputs`` ``(x [T, H], topk_idx [T, K], topk_weights [T, K], bias [T, H] float32)``, then
    combines of one shape whose bias pairs are ``(b, b)``, ``(b, o)``, ``(o, b)`` and ``(o, o)`` (``b`` the bias,
    ``o`` another of its shape): the same array twice in some calls, two in others (a recorded reduce must not bind
    both slots to one of them). ``apart``: each pair's arrays copied first, never one array twice (the reference).
    Returns the combines' ``x``, in call order."""
    x, idx, weights, bias = inputs
    other = bias * np.float32(3) + np.float32(1)
    out = buf.dispatch(x, idx, weights, expand=expand)
    sums = []
    for first, second in ((bias, bias), (bias, other), (other, bias), (other, other)):
        pair = (first.copy(), second.copy()) if apart else (first, second)
        sums.append(buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights, bias=pair).x)
    return sums
