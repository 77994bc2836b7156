"""Argument checks run before anything is sent: each error names the argument, the value and the rule.

The functions take the array module ``xp`` (numpy or cupy) so that both backends share them. The values of a
dispatch's ``topk_idx`` are the exception: each rank checks its own in the count step, the verdicts travel with
the count exchange (:func:`verdict_words`), and every rank raises the same :func:`routing_error`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.contract.choices import PAYLOAD_DTYPES, TRANSPORTS
from ep_comm.contract.fp8 import BLOCK as FP8_BLOCK
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.protocol import ID_CLAMP, VERDICT_WORDS
from ep_comm.errors import RoutingError

_INT64_MAX = int(np.iinfo(np.int64).max)
FLOATS = "float16, bfloat16, float32 or float64"  # the weight and bias dtypes taken (as float32)


def check_comm(comm: Any) -> MPI.Comm:
    """``comm``: None (``MPI.COMM_WORLD``) or a valid mpi4py intra-communicator; returns the communicator."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator or None, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm=MPI.COMM_NULL: must be a valid communicator (None = MPI.COMM_WORLD)")
    if comm.Is_inter():
        raise TypeError(f"comm is an inter-communicator ({type(comm).__name__}): the ranks of a Buffer must form one "
                        "group; give an intra-communicator (e.g. intercomm.Merge())")
    return comm


def check_geometry(num_ranks: int, num_experts: int, hidden: int, num_topk: int, max_tokens: int) -> None:
    """Rules of the Buffer's constructor arguments."""
    for name, value in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk),
                        ("num_max_tokens_per_rank", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks ({num_ranks})")
    if num_topk > num_experts:
        raise ValueError(f"num_topk={num_topk} must not exceed num_experts={num_experts}")


def check_num_sms(num_sms: Any) -> None:
    """``num_sms``: None (all SMs of the device) or an integer >= 1 (bool refused)."""
    if num_sms is None:
        return
    if isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer)):
        raise TypeError(f"num_sms={num_sms!r}: must be an integer >= 1 or None (all SMs of the device), "
                        f"got {type(num_sms).__name__}")
    if num_sms < 1:
        raise ValueError(f"num_sms={num_sms!r}: must be an integer >= 1 or None (all SMs of the device)")


def check_transport(transport: Any) -> None:
    """``transport``: one of :data:`TRANSPORTS`."""
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: must be one of {TRANSPORTS} (auto: stores where every peer is "
                         "in scale-up reach, else puts; peer-view stores; or NVSHMEM puts for peers without P2P)")


def check_profile(profile: Any) -> None:
    """``profile``: a bool (``numpy.bool_`` too)."""
    check_flag(profile, "profile")


def check_flag(value: Any, name: str) -> None:
    """``value`` of the argument ``name``: a bool (``numpy.bool_`` too), TypeError otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: must be True or False, got {type(value).__name__}")


def check_num_sms_fits(num_sms: Optional[int], sms_per_rank: Sequence[int]) -> None:
    """``num_sms`` must not exceed the SM count of any rank's GPU (``sms_per_rank [R]``, every rank's)."""
    if num_sms is None:
        return
    fewest = min(range(len(sms_per_rank)), key=lambda r: sms_per_rank[r])
    if num_sms > sms_per_rank[fewest]:
        raise ValueError(f"num_sms={num_sms}: must not exceed the GPU's SM count; rank {fewest}'s GPU has "
                         f"{sms_per_rank[fewest]} SMs (use None for all of them)")


def _shape(arr: Any, name: str) -> Tuple[int, ...]:
    shape = getattr(arr, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be an array, got {type(arr).__name__}")
    return tuple(shape)


def check_topk_idx(topk_idx: Any, geo: Geometry) -> None:
    """``topk_idx``: integer ``[T, K]``, ``T <= max_tokens``; unsigned ids must fit int64 (they are taken as int64).

    The values of signed ids are not read here: the dispatch checks them where they live, in its count step, and
    every rank raises :func:`routing_error` (``get_dispatch_layout``: :func:`check_topk_values`)."""
    shape = _shape(topk_idx, "topk_idx")
    dtype = np.dtype(topk_idx.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"topk_idx has dtype {topk_idx.dtype}: expert ids must be integers")
    if len(shape) != 2 or shape[1] != geo.num_topk:
        raise ValueError(f"topk_idx has shape {shape}: must be [num_tokens, num_topk={geo.num_topk}]")
    if shape[0] > geo.max_tokens:
        raise ValueError(f"topk_idx has {shape[0]} tokens: more than num_max_tokens_per_rank={geo.max_tokens}")
    if shape[0] and np.iinfo(dtype).max > _INT64_MAX:  # uint64: ids past int64 must not wrap round to "no expert"
        top = int(topk_idx.max())
        if top > _INT64_MAX:
            raise ValueError(f"topk_idx holds expert id {top}: does not fit int64; ids must be < "
                             f"num_experts={geo.num_experts} (negative = none)")


def check_topk_values(top: int, twice: int, geo: Geometry) -> None:
    """The values of a local routing (``get_dispatch_layout``), from its :func:`topk_values` summary: ids
    ``< num_experts``, no expert twice per token; ValueError at once on this rank.

    Args:
        top: the largest expert id (-1 when it names none).
        twice: the first row naming an expert twice, or -1.
    """
    rule = _routing_rule(top, twice, geo.num_experts, str(top))
    if rule is not None:
        raise ValueError(f"topk_idx {rule}")


def _routing_rule(top: int, twice: int, num_experts: int, shown: str) -> Optional[str]:
    """The rule a routing breaks, as the words after "topk_idx" (the largest id ``top`` shown as ``shown``), or
    None for a good one: ids ``< num_experts`` first, then no expert twice in row ``twice`` (-1: none)."""
    if top >= num_experts:
        return f"holds expert id {shown}: ids must be < num_experts={num_experts} (negative = none)"
    if twice >= 0:
        return f"row {twice} names the same expert twice: each token picks distinct experts"
    return None


def verdict_words(top: int, twice: int) -> Tuple[int, int]:
    """The two int32 words a rank sends with its counts for its routing: ``(min(top + 1, ID_CLAMP), twice + 1)``.
    All-zero words are a clean verdict (the wait zeroes the count words of a rank that did not arrive).

    Args:
        top: the largest expert id of the rank's ``topk_idx`` (-1 when it names none).
        twice: the first row naming an expert twice, or -1.
    """
    return min(int(top) + 1, ID_CLAMP), int(twice) + 1


def verdict_of(words: Sequence[int]) -> Tuple[int, int]:
    """``(largest id, first repeated row)`` from the two words of :func:`verdict_words` (-1 for none; a clamped
    id reads as ``ID_CLAMP - 1``, shown as "or more" by :func:`routing_error`)."""
    return int(words[0]) - 1, int(words[1]) - 1


def verdicts_clean(words: Sequence[int], num_experts: int) -> bool:
    """Whether every rank's verdict words (a flat host list, ``VERDICT_WORDS`` per rank, of :func:`verdict_words`,
    e.g. one ``tolist()`` of the mapped record's) are clean: no id at or past ``num_experts``, no repeated row
    (:func:`routing_error`'s rule read on the encoded words: two builtin reductions on the hot path, no decoding; the
    error itself decodes them)."""
    return max(words[0::VERDICT_WORDS], default=0) <= num_experts and not any(words[1::VERDICT_WORDS])


def routing_error(verdicts: Sequence[Tuple[int, int]], num_experts: int, step: str) -> Optional[RoutingError]:
    """The ``ep_comm.RoutingError`` (a ``ValueError``) every rank raises for a dispatch whose routing some rank got
    wrong, or None.

    The rule (``docs/design.md``, Errors): each rank checks its own ``topk_idx`` where it is (in the count kernel on
    the GPU), the verdicts travel with the count exchange, and when any is bad no rank receives a row and every rank
    raises this same error, naming the lowest bad rank and its rule and listing every bad rank; the Buffer stays
    usable (the ranks stayed in step).

    Args:
        verdicts: per rank ``r`` its ``(largest id or -1, first repeated row or -1)`` (:func:`verdict_of`).
        num_experts: ``E``: ids must be below it.
        step: the step's name for the message (``"dispatch #3"``).
    """
    rules = [_routing_rule(top, twice, num_experts, f"{top} or more" if top >= ID_CLAMP - 1 else f"{top}")
             for top, twice in verdicts]
    bad = [r for r, rule in enumerate(rules) if rule is not None]
    if not bad:
        return None
    return RoutingError(f"{step}: rank {bad[0]}'s topk_idx {rules[bad[0]]}; no rank received a row "
                        f"(ranks with a bad topk_idx: {bad}); the Buffer stays usable")


def topk_values(xp: Any, topk_idx: Any) -> Tuple[int, int]:
    """``(largest id, first row naming an expert twice or -1)`` of a non-empty ``[T, K]`` routing.

    No sort and a single device-to-host read: on the GPU this is a handful of small launches and
    one synchronisation per new routing.
    """
    valid = topk_idx >= 0
    equal = (topk_idx[:, :, None] == topk_idx[:, None, :]) & valid[:, None, :]
    repeated = (equal.sum(axis=2) > 1).any(axis=1)  # [T]: an entry equals another valid entry
    first = repeated.argmax()
    summary = xp.stack([topk_idx.max().astype(xp.int64), xp.where(repeated[first], first, -1).astype(xp.int64)])
    top, twice = (summary.get() if hasattr(summary, "get") else summary).tolist()
    return int(top), int(twice)


def check_payload(x: Any, name: str, rows: int, geo: Geometry, row_name: str) -> None:
    """``x``: ``[rows, hidden]`` of the buffer's dtype."""
    shape = _shape(x, name)
    if np.dtype(x.dtype) != geo.dtype:
        raise TypeError(f"{name} has dtype {x.dtype}: the buffer moves {geo.dtype.name}")
    if len(shape) != 2 or shape[1] != geo.hidden:
        raise ValueError(f"{name} has shape {shape}: must be [{row_name}, hidden={geo.hidden}]")
    if shape[0] != rows:
        raise ValueError(f"{name} has {shape[0]} rows: must equal {row_name} ({rows})")


FP8_PARTS = ("x[0] (x_fp8)", "x[1] (scales)")  # how errors name the two items of an FP8 pair


def check_fp8_hidden(hidden: int) -> None:
    """An FP8 dispatch needs ``hidden`` a multiple of 128 (one float32 scale per 128-element block)."""
    if hidden % FP8_BLOCK:
        raise ValueError(f"hidden={hidden}: an FP8 dispatch needs hidden a multiple of {FP8_BLOCK} (one float32 "
                         f"scale per {FP8_BLOCK}-element block)")


def _is_array(obj: Any) -> bool:
    """Whether ``obj`` is an array object (NumPy, CuPy, PyTorch, any array or DLPack protocol), not a Python list."""
    return any(hasattr(obj, name) for name in
               ("__array_interface__", "__cuda_array_interface__", "__dlpack__", "__array__"))


def is_fp8_pair(x: Any) -> bool:
    """Whether the payload ``x`` is given as the FP8 pair: a tuple (checked by :func:`fp8_pair`), or a list of two
    arrays. Any other list (rows given as nested lists) is a payload in the buffer dtype, refused as ``x``."""
    return isinstance(x, tuple) or (isinstance(x, list) and len(x) == 2 and all(_is_array(a) for a in x))


def fp8_pair(x: Any) -> Tuple[Any, ...]:
    """``x`` given as the FP8 pair ``(x_fp8, scales)``: exactly two items, both given (None is no array)."""
    if len(x) != 2:
        raise ValueError(f"x is a {type(x).__name__} of {len(x)} items: an FP8 payload is the pair (x_fp8, scales)")
    for name, part in zip(FP8_PARTS, x):
        if part is None:
            raise TypeError(f"{name} is None: an FP8 payload is the pair (x_fp8, scales), both arrays")
    return tuple(x)


def check_fp8_pair(x_fp8: Any, scales: Any, rows: int, geo: Geometry, row_name: str) -> None:
    """The FP8 pair of a dispatch: ``x[0]`` (x_fp8) ``[rows, hidden]`` of a 1-byte dtype (float8_e4m3fn, or its
    bits as uint8/int8), ``x[1]`` (scales) float32 ``[rows, hidden // 128]``."""
    parts = ((FP8_PARTS[0], x_fp8, geo.hidden, f"hidden={geo.hidden}"),
             (FP8_PARTS[1], scales, geo.hidden // FP8_BLOCK, f"hidden // {FP8_BLOCK}={geo.hidden // FP8_BLOCK}"))
    shapes = [_shape(arr, name) for name, arr, _, _ in parts]
    if np.dtype(x_fp8.dtype).itemsize != 1:
        raise TypeError(f"x[0] (x_fp8) has dtype {x_fp8.dtype}: FP8 values must be a 1-byte dtype (float8_e4m3fn, "
                        "or its bits as uint8/int8)")
    if np.dtype(scales.dtype) != np.float32:
        raise TypeError(f"x[1] (scales) has dtype {scales.dtype}: FP8 scales must be float32")
    for (name, _, width, width_rule), shape in zip(parts, shapes):
        if shape != (rows, width):
            raise ValueError(f"{name} has shape {shape}: must be [{row_name}={rows}, {width_rule}]")


def check_weights(weights: Optional[Any], name: str, shape: Tuple[int, ...]) -> None:
    """Floating-point weights of exactly ``shape`` (or None)."""
    if weights is None:
        return
    got = _shape(weights, name)
    if not is_floating(weights.dtype):
        raise TypeError(f"{name} has dtype {weights.dtype}: weights must be floating point ({FLOATS})")
    if got != tuple(shape):
        raise ValueError(f"{name} has shape {got}: must be {list(shape)}")



def is_floating(dtype: Any) -> bool:
    """A NumPy floating dtype, or bfloat16 (ml_dtypes' is no ``numpy.floating`` subtype)."""
    dtype = np.dtype(dtype)
    return bool(np.issubdtype(dtype, np.floating)) or dtype == PAYLOAD_DTYPES["bfloat16"]


def check_handle(handle: Any, geo: Geometry) -> None:
    """A handle must come from a dispatch of a Buffer of this geometry (ranks, experts, hidden, top-k, capacity,
    dtype: the geometry it recorded), with arrays of that geometry's shapes."""
    differ = handle.geometry.differences(geo) if handle.geometry is not geo else []
    if differ:
        raise ValueError(f"handle comes from a dispatch of a Buffer with {', '.join(differ)}: a handle replays "
                         "and combines only on a Buffer of the geometry it was made with")
    local = geo.experts_per_rank
    rules = (
        ("topk_idx", tuple(handle.topk_idx.shape), (handle.num_tokens, geo.num_topk)),
        ("is_token_in_rank", tuple(handle.is_token_in_rank.shape), (handle.num_tokens, geo.num_ranks)),
        ("dst_buffer_slot_idx", tuple(handle.dst_buffer_slot_idx.shape), (handle.num_tokens, geo.num_topk)),
        ("psum_num_recv_tokens_per_rank", tuple(handle.psum_num_recv_tokens_per_rank.shape), (geo.num_ranks,)),
        ("num_unaligned_recv_tokens_per_expert", tuple(handle.num_unaligned_recv_tokens_per_expert.shape), (local,)),
        ("recv_src_metadata", tuple(handle.recv_src_metadata.shape[1:]), (2 + geo.num_topk,)),
    )
    for name, got, want in rules:
        if got != want:
            raise ValueError(f"handle.{name} has shape {got}, this Buffer needs {want}: the handle comes from a "
                             "dispatch of another Buffer (ranks, experts, top-k or capacity differ)")
    if handle.num_tokens > geo.max_tokens:
        raise ValueError(f"handle has {handle.num_tokens} tokens: more than num_max_tokens_per_rank={geo.max_tokens}")


def check_alignment(expert_alignment: Any) -> None:
    if (isinstance(expert_alignment, bool) or not isinstance(expert_alignment, (int, np.integer))
            or expert_alignment < 1):
        raise ValueError(f"expert_alignment={expert_alignment!r}: must be an integer >= 1")


def check_stats(stats: Optional[Any], geo: Geometry) -> None:
    """``stats``: an integer array ``[E/R]`` that dispatch adds the received counts to."""
    if stats is None:
        return
    shape = _shape(stats, "stats")
    if not np.issubdtype(np.dtype(stats.dtype), np.integer):
        raise TypeError(f"stats has dtype {stats.dtype}: must be an integer array")
    if shape != (geo.experts_per_rank,):
        raise ValueError(f"stats has shape {shape}: must be [num_local_experts={geo.experts_per_rank}]")
    if not getattr(getattr(stats, "flags", None), "writeable", True):
        raise ValueError("stats is read-only (flags.writeable=False): dispatch adds the received counts into it, "
                         "it must be writeable")


def check_bias(bias: Any, num_tokens: int, geo: Geometry) -> Tuple[Any, ...]:
    """``bias``: None, one ``[T, H]`` array or a pair of them; returns a tuple of arrays."""
    if bias is None:
        return ()
    terms = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if len(terms) > 2:
        raise ValueError(f"bias has {len(terms)} terms: give one array or a pair")
    for i, term in enumerate(terms):
        shape = _shape(term, f"bias[{i}]")
        if shape != (num_tokens, geo.hidden):
            raise ValueError(f"bias[{i}] has shape {shape}: must be [num_tokens={num_tokens}, hidden={geo.hidden}]")
        if not is_floating(term.dtype):
            raise TypeError(f"bias[{i}] has dtype {term.dtype}: must be floating point ({FLOATS})")
    return terms
