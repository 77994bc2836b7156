"""A bad ``topk_idx`` value (an id past the experts, an expert twice in a row) on some ranks: each rank checks its own
in the dispatch's count step, the verdict travels with the count exchange, no rank receives a row, and every rank
raises the same ValueError naming the lowest bad rank (``checks.routing_error``), in step: with ``cpu_sync=True``
from the call (or its receive hook), with ``cpu_sync=False`` from the next dispatch or combine. The Buffer stays
usable: the dispatch and combine after are exact.

Collective like the rest of ``tests/mpi`` (``tests/jobs/test_multirank.py`` runs it under ``mpirun -n 1..4``).
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest
from helpers.collective import dispatch, make_buffer, to_device
from helpers.oracle import RANK, WORLD, bits, expected_compact_combine, make_world

from ep_comm.contract.arrays import to_host

pytestmark = pytest.mark.mpi

CLEAN = "; no rank received a row (ranks with a bad topk_idx: {bad}); the Buffer stays usable"


@pytest.fixture(scope="module")
def world():
    return make_world("uniform", dtype="float32")


def out_of_range(idx: np.ndarray, num_experts: int) -> np.ndarray:
    idx[1, 2] = num_experts + 3
    return idx


def repeated(idx: np.ndarray, num_experts: int) -> np.ndarray:
    idx[2, 3] = idx[2, 0]
    return idx


def past_int32(idx: np.ndarray, num_experts: int) -> np.ndarray:
    idx[0, 1] = 2**31 + 5
    return idx


def past_int32_unsigned(idx: np.ndarray, num_experts: int) -> np.ndarray:
    idx = idx.astype(np.uint32)
    idx[3, 0] = 2**32 - 1
    return idx


BREAKS: Dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "out of range": out_of_range, "repeated": repeated, "int64 past int32": past_int32,
    "uint32 past int32": past_int32_unsigned}


def rule(kind: str, num_experts: int) -> str:
    """The words after "topk_idx" that ``routing_error`` gives a routing broken by ``BREAKS[kind]``."""
    ids = "2147483646 or more" if "past int32" in kind else f"{num_experts + 3}"  # the verdict word clamps at 2**31-1
    if kind == "repeated":
        return "row 2 names the same expert twice: each token picks distinct experts"
    return f"holds expert id {ids}: ids must be < num_experts={num_experts} (negative = none)"


def routing(world, kind_of_rank: Dict[int, str]) -> np.ndarray:
    """This rank's ``topk_idx``, broken by ``BREAKS[kind_of_rank[RANK]]`` where it names this rank."""
    idx = world.topk_idx[RANK].copy()
    kind = kind_of_rank.get(RANK)
    return idx if kind is None else BREAKS[kind](idx, world.num_experts)


def message(world, kind_of_rank: Dict[int, str], step: str) -> str:
    """The error every rank raises for a dispatch ``step`` whose bad ranks are the keys of ``kind_of_rank``."""
    lowest = min(kind_of_rank)
    return (f"{step}: rank {lowest}'s topk_idx {rule(kind_of_rank[lowest], world.num_experts)}"
            + CLEAN.format(bad=sorted(kind_of_rank)))


def exact_round_trip(buf, world) -> None:
    """A correct dispatch and combine on ``buf``: the combine is the contract's, bit for bit."""
    out = dispatch(buf, world)
    res = buf.combine(out.recv_x, out.handle)
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


def assert_no_row(out, world, expand: bool) -> None:
    """A ``cpu_sync=False`` dispatch that received nothing: worst-case shapes, every row an unused tail (-1 ids and
    metadata; its ``recv_x`` rows are unspecified, as every unused tail row's)."""
    rows = WORLD * world.max_tokens
    ids, meta = to_host(out.recv_topk_idx), to_host(out.handle.recv_src_metadata)
    assert meta.shape == (rows, 2 + world.num_topk) and (meta == -1).all()
    assert (ids == -1).all()
    if not expand:
        assert ids.shape == (rows, world.num_topk)
    assert int(to_host(out.handle.num_recv_tokens)) == 0


def refused(buf, world, kind_of_rank: Dict[int, str], mode: str) -> str:
    """One dispatch of the broken routing in ``mode``; returns the message of the error it (or the call after)
    raised, after checking that it raised where ``mode`` says."""
    x, idx = to_device(world.x[RANK]), to_device(routing(world, kind_of_rank))
    cpu_sync = not mode.endswith("async")
    if mode.startswith("hook"):
        hook = buf.dispatch(x, idx, return_recv_hook=True, cpu_sync=cpu_sync)
        call = hook
    else:
        def call():
            return buf.dispatch(x, idx, cpu_sync=cpu_sync)
    if cpu_sync:
        with pytest.raises(ValueError) as info:
            call()
        return str(info.value)
    out = call()
    assert_no_row(out, world, expand=False)
    with pytest.raises(ValueError) as info:
        if mode.startswith("combine"):
            buf.combine(out.recv_x, out.handle)
        else:
            dispatch(buf, world)
    return str(info.value)


MODES = ["cpu_sync", "hook", "dispatch after async", "combine after async", "hook async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(BREAKS))
@pytest.mark.parametrize("who", ["last", "first"])
def test_one_bad_rank_is_named_by_every_rank_in_step(world, who, kind, mode):
    bad = WORLD - 1 if who == "last" else 0
    with make_buffer(world) as buf:
        got = refused(buf, world, {bad: kind}, mode)
        assert got == message(world, {bad: kind}, "dispatch #1")
        exact_round_trip(buf, world)


@pytest.mark.parametrize("mode", ["cpu_sync", "combine after async"])
def test_every_rank_bad_names_the_lowest_and_lists_them_all(world, mode):
    kinds = {r: ("repeated", "out of range")[r % 2] for r in range(WORLD)}
    with make_buffer(world) as buf:
        exact_round_trip(buf, world)
        assert refused(buf, world, kinds, mode) == message(world, kinds, "dispatch #2")
        exact_round_trip(buf, world)


def test_an_async_dispatch_refused_expands_to_no_row(world):
    """Expand, ``cpu_sync=False``: worst-case expanded rows, every one padding (-1, zero)."""
    with make_buffer(world) as buf:
        out = buf.dispatch(to_device(world.x[RANK]), to_device(routing(world, {0: "out of range"})), expand=True,
                           expert_alignment=4, cpu_sync=False)
        assert_no_row(out, world, expand=True)
        with pytest.raises(ValueError) as info:
            dispatch(buf, world)
        assert str(info.value) == message(world, {0: "out of range"}, "dispatch #1")
        exact_round_trip(buf, world)


def test_close_drops_a_pending_routing_error(world):
    with make_buffer(world) as buf:
        buf.dispatch(to_device(world.x[RANK]), to_device(routing(world, {0: "repeated"})), cpu_sync=False)
    buf.close()  # a second close does nothing either
    with make_buffer(world) as again:
        exact_round_trip(again, world)


def test_get_dispatch_layout_refuses_bad_values_at_once_locally(world):
    """``get_dispatch_layout`` is local: only the rank with the bad routing raises, at once, its own message."""
    with make_buffer(world) as buf:
        for kind, want in [("out of range", f"topk_idx holds expert id {world.num_experts + 3}: ids must be < "
                                             f"num_experts={world.num_experts} (negative = none)"),
                           ("repeated", "topk_idx row 2 names the same expert twice: each token picks distinct "
                                        "experts"),
                           ("uint32 past int32", f"topk_idx holds expert id {2**32 - 1}: ids must be < "
                                                 f"num_experts={world.num_experts} (negative = none)")]:
            idx = to_device(routing(world, {WORLD - 1: kind}))
            if RANK != WORLD - 1:
                buf.get_dispatch_layout(idx)
                continue
            with pytest.raises(ValueError) as info:
                buf.get_dispatch_layout(idx)
            assert str(info.value) == want
        exact_round_trip(buf, world)


# ------------------------------------------------ a host refusal after a routing error leaves nothing behind
def twice_in_every_row(num_tokens: int, num_topk: int) -> np.ndarray:
    """int64 ``[num_tokens, num_topk]`` naming expert 0 twice in every row: a count that read any of it would say
    "row 0 names the same expert twice"."""
    idx = np.tile(np.arange(num_topk, dtype=np.int64), (num_tokens, 1))
    idx[:, 1] = 0
    return idx


def host_refusals(world) -> Dict[str, Callable[[object], object]]:
    """Dispatches that ``Buffer.dispatch`` refuses on this rank's host, before anything is sent, by kind; each one's
    ids name an expert twice in every row."""
    x, n, k = world.x[RANK], len(world.x[RANK]), world.num_topk
    ids = twice_in_every_row(n, k)
    weights = np.ones((n, k + 1), np.float32)
    return {
        "too many tokens": lambda buf: buf.dispatch(to_device(np.zeros((world.max_tokens + 1, world.hidden),
                                                                        x.dtype)),
                                                    to_device(twice_in_every_row(world.max_tokens + 1, k))),
        "topk columns": lambda buf: buf.dispatch(to_device(x), to_device(twice_in_every_row(n, k + 1))),
        "x rows": lambda buf: buf.dispatch(to_device(np.concatenate([x, x[:1]])), to_device(ids)),
        "weights shape": lambda buf: buf.dispatch(to_device(x), to_device(ids), to_device(weights)),
        "float ids": lambda buf: buf.dispatch(to_device(x), to_device(ids.astype(np.float32))),
        "expert_alignment": lambda buf: buf.dispatch(to_device(x), to_device(ids), expert_alignment=0),
    }


def unweighted_round_trip(buf, world, handle=None, cpu_sync: bool = True):
    """A dispatch of this rank's tokens without weights (a new routing, or a replay of ``handle``) and its combine,
    which must be the contract's sum bit for bit; returns the dispatch's output."""
    x = to_device(world.x[RANK])
    if handle is None:
        out = buf.dispatch(x, to_device(world.topk_idx[RANK]), cpu_sync=cpu_sync)
    else:
        out = buf.dispatch(x, handle=handle, cpu_sync=cpu_sync)
    res = buf.combine(out.recv_x, out.handle)
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()
    return out


def captured_round_trip(buf, world) -> None:
    """nvshmem: a new-routing dispatch (``cpu_sync=False``) and its combine captured into CUDA graphs and replayed:
    the contract's sum bit for bit (the mpi backend has no graphs: nothing to do there)."""
    if buf.backend != "nvshmem":
        return
    import cupy

    from ep_comm.bench.measure import captured

    stream = cupy.cuda.Stream(non_blocking=True)
    x, idx = to_device(world.x[RANK]), to_device(world.topk_idx[RANK])
    with stream:
        unweighted_round_trip(buf, world, cpu_sync=False)  # compiled and planned outside the capture
        stream.synchronize()
        out, d_graph = captured(stream, lambda: buf.dispatch(x, idx, cpu_sync=False))
        res, c_graph = captured(stream, lambda: buf.combine(out.recv_x, out.handle))
        for _ in range(2):
            d_graph.launch(stream)
            c_graph.launch(stream)
        stream.synchronize()
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


@pytest.mark.parametrize("refusal", ["too many tokens", "topk columns", "x rows", "weights shape", "float ids",
                                     "expert_alignment"])
@pytest.mark.parametrize("kind", ["out of range", "repeated"])
def test_a_call_refused_on_the_host_after_a_routing_error_leaves_no_trace(world, kind, refusal):
    """A routing error, then a dispatch refused on the host (whose ids name an expert twice in every row), then
    valid calls with the routing error's call shape: the refused call took no step and left nothing on the
    device (its ids are never read: the valid dispatch, its replay and a captured one are exact, and the next
    routing error names the next step)."""
    bad = {WORLD - 1: kind}
    with make_buffer(world) as buf:
        x = to_device(world.x[RANK])
        # the arrays of the failed and of the refused call die with the calls: their memory is free for the next
        assert raised(lambda: buf.dispatch(x, to_device(routing(world, bad)))) == message(world, bad, "dispatch #1")
        assert "dispatch #" not in raised(lambda: host_refusals(world)[refusal](buf))
        out = unweighted_round_trip(buf, world)
        unweighted_round_trip(buf, world, handle=out.handle)
        assert raised(lambda: buf.dispatch(x, to_device(routing(world, bad)))) == message(world, bad, "dispatch #4")
        captured_round_trip(buf, world)


def raised(call: Callable[[], object]) -> str:
    """The message of the TypeError or ValueError ``call()`` raises (AssertionError when it returns); the exception
    and its frames are let go here, and with them the arrays the call made."""
    try:
        call()
    except (TypeError, ValueError) as exc:
        return str(exc)
    raise AssertionError("the call was not refused")
