"""The nvshmem backend's forwarded steps (``Buffer(forwarding=True)``, 4 ranks as 2 nodes of 2; docs/design.md,
"Forwarding on nvshmem") end to end on the CPU: four backends in one process over host heaps (``helpers.fake_world``),
the real call sequence with the kernels in the Numba CUDA simulator and the signal and wait kernels stood in for.

A forwarded rank's scatter writes no rows for the other node (the fake's staging views for its ranks stay zero), so the
other node's ranks receive them only through the inbox send and their forwarder's relay. Every dispatch (new routing,
handle replay, ``cpu_sync=False``, split into send and hook) gives the outputs and handle of the same calls on a flat
4-rank world byte for byte, and the first one the contract's reference (``ep_comm.testing.check``); every combine (plain
and split) gives the sum in the forwarded order (``ep_comm.testing.forwarded``, through ``check_combine``) and the
dispatched weights. FP8 dispatches (cast, and from the pair) give the flat bytes; a replay and its combine made while
the fake GPU says it is capturing a CUDA graph give the eager results. The scale-out rows the kernels count are
``ep_comm.contract.traffic``'s, flat and forwarded. The inbox waits measure a forwarded step's wait statistics (a late
sender comes last, its forwarder does not). A rank that never arrives, and a forwarder that never runs its hook, are
named by their peers within the wait's bound."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers.fake_gpu import combine, dispatch
from helpers.fake_world import WAIT_BOUND_S, World, arrived, random_sources, run_ranks, world_backends
from helpers.same_outputs import assert_same, assert_same_as_eager, assert_same_dispatch

import ep_comm
from ep_comm.backends.interface import CombineRequest, DispatchRequest
from ep_comm.contract import fp8, traffic
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.protocol import RECORD_TAG
from ep_comm.contract.symmetric import STEP_KINDS
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.testing.check import DispatchOptions, HostDispatch, Sources, check_combine, check_dispatch
from ep_comm.transport.wait_stats import decode

pytestmark = [pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator"),
              pytest.mark.timeout(300)]
RANKS, SCALEUP, EXPERTS, HIDDEN, TOPK, MAX_TOKENS = 4, 2, 8, 16, 3, 5
TOKENS = (4, 3, 5, 0)  # per rank: the last one sends nothing
# the fault tests' waits: a forwarder whose inbox wait gave up relays and signals well within its peers' step waits,
# the ranks' inbox waits starting one send half apart on a busy CI core (the steps' final waits do not yet take
# "entered" from the inbox signals, which would spare a late forwarder)
FAULT_TIMEOUT_S = 5.0
STRAGGLER_S = 0.3  # how long a late rank lets the others' waits see their peers' signals before it begins a step


def geometry(dtype: str, hidden: int = HIDDEN) -> Geometry:
    return Geometry(RANKS, EXPERTS, hidden, TOPK, MAX_TOKENS, payload_dtype(dtype))


def sources(dtype: str, weighted: bool, seed: int, hidden: int = HIDDEN) -> Sources:
    """Every rank's inputs (``fake_world.random_sources``; the last rank sends nothing)."""
    return random_sources(geometry(dtype, hidden), TOKENS, weighted, seed)


def calls(be, rank: int, src: Sources, expand: bool, alignment: int) -> dict:
    """One rank's calls, in this order: a new routing and its combine (weighted as dispatched), a replay of its
    handle with another payload, a new routing with ``cpu_sync=False``, and a split dispatch and combine."""
    x, idx, w = src.x[rank], src.topk_idx[rank], src.weights[rank]
    args = (expand, alignment, expand, True)
    out = {"first": dispatch(be, x, idx, w, None, *args, None)}
    first = out["first"]
    out["combine"] = combine(be, first.recv_x, first.handle, first.recv_topk_weights, ())
    x2 = (x.astype(np.float32) * 2 + 1).astype(x.dtype)
    out["replay"] = dispatch(be, x2, None, w, first.handle, *args, None)
    out["lazy"] = dispatch(be, x, idx, w, None, *args[:3], False, None)
    half = be.dispatch_send(DispatchRequest(x, idx, w, None, *args, None))
    half.prepare()
    out["hooked"] = hooked = half.receive()
    half = be.combine_send(CombineRequest(hooked.recv_x, hooked.handle, None, ()))
    half.prepare()
    out["hooked combine"] = half.receive()
    return out


def run_world(src: Sources, dtype: str, scaleup_ranks, calls_of) -> tuple:
    """``(per rank results, backends)`` of ``calls_of(backend, rank)`` on a fresh world in nodes of ``scaleup_ranks``
    (None: one node, flat; forwarding across nodes otherwise) of ``src``'s hidden size."""
    world = World(geometry(dtype, src.x[0].shape[1]), scaleup_ranks, forwarding=scaleup_ranks is not None)
    backends = world_backends(world)
    return run_ranks(world, [lambda r=r: calls_of(backends[r], r) for r in range(RANKS)]), backends


@pytest.mark.parametrize("dtype, expand, alignment, weighted", [
    ("bfloat16", False, 1, True),
    ("float32", True, 2, True),
    ("float16", False, 1, False),
], ids=["compact-bf16-weighted", "expand-f32-weighted", "compact-f16"])
def test_forwarded_steps_give_the_flat_bytes_and_the_forwarded_sum(dtype, expand, alignment, weighted):
    src = sources(dtype, weighted, seed=len(dtype) + 10 * expand)
    calls_of = functools.partial(calls, src=src, expand=expand, alignment=alignment)
    flat, _ = run_world(src, dtype, None, calls_of)
    forwarded, backends = run_world(src, dtype, SCALEUP, calls_of)
    opts = DispatchOptions(expand=expand, alignment=alignment, zero_padding=expand, weighted=weighted,
                           deterministic=True, forwarded_scaleup_ranks=SCALEUP)
    for rank, (want, got) in enumerate(zip(flat, forwarded)):
        transport = backends[rank].transport
        assert transport.inbox_signals_sent == 6, "every step went through the inboxes"
        for q in transport.puts_to:  # the other node's ranks: their rows go through the forwarders only
            assert not transport.rows[q].any() and not transport.meta[q].any(), f"rank {rank} scattered into {q}"
        for name in ("first", "replay", "lazy", "hooked"):
            assert_same_dispatch(f"rank {rank} {name}", want[name], got[name])
        assert check_dispatch(src, rank, opts, HostDispatch.of(got["first"])) == []
        assert check_combine(src, rank, opts, got["combine"].x, got["combine"].topk_weights) == []
        unweighted = DispatchOptions(expand=expand, forwarded_scaleup_ranks=SCALEUP)
        assert check_combine(src, rank, unweighted, got["hooked combine"].x, None) == []
        assert_same(f"rank {rank} combine topk_weights", want["combine"].topk_weights, got["combine"].topk_weights)


@pytest.mark.parametrize("forwarding, expand", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["flat-compact", "flat-expand", "forwarded-compact", "forwarded-expand"])
def test_the_scaleout_rows_counted_on_the_device_are_the_traffic_model(forwarding, expand):
    """``traffic()`` on the nvshmem backend in 2 nodes of 2 (flat: every rank through stores), after :func:`calls`
    (four dispatches of one routing: new, replay, ``cpu_sync=False``, split; two combines: plain, split): each rank's
    scale-out rows are four of its dispatches' and two of its combines' as ``ep_comm.contract.traffic`` counts them
    (flat: a row per token and remote rank, and back per row received from one; forwarded: a row per token and remote
    node, and a forwarder's one per token of a source it forwards for that reached its node), the same after the
    close."""
    src = sources("float32", True, seed=23 + expand)
    world = World(geometry("float32"), SCALEUP, forwarding, transport="auto" if forwarding else "stores")
    backends = world_backends(world)
    run_ranks(world, [lambda r=r: calls(backends[r], r, src, expand, 1) for r in range(RANKS)])
    model = traffic.world_rows(src.topk_idx, EXPERTS, world.topology)[:, traffic.ROUTES.index(
        "forwarded" if forwarding else "flat"), traffic.LINKS.index("scaleout")]
    want = [(4 * int(model[0, rank]), 2 * int(model[1, rank])) for rank in range(RANKS)]
    assert sum(d + c for d, c in want) > 0, "the routing crosses the nodes"
    assert [be.traffic().scaleout_rows for be in backends] == want
    run_ranks(world, [backends[r].close for r in range(RANKS)])
    assert [be.traffic().scaleout_rows for be in backends] == want


def test_a_forwarded_step_advances_the_device_step_counter_once_as_the_host_numbers_it():
    """The record's tag, which a ``cpu_sync=True`` poll may end on (docs/design.md, "Polls, not syncs"), is the device
    step counter: a forwarded step's inbox signal leaves it, its step signal advances it once, as the host's step
    number counts the step (six steps, the last record the hooked dispatch's: its combine writes none)."""
    src = sources("bfloat16", True, seed=5)
    _, backends = run_world(src, "bfloat16", SCALEUP, functools.partial(calls, src=src, expand=False, alignment=1))
    for be in backends:
        assert be.transport.inbox_signals_sent == be.runner.steps.seq == int(be.transport.step[0]) == 6
        assert int(be.runner.record_host[RECORD_TAG]) == 5


def fp8_calls(be, rank: int, src: Sources, expand: bool) -> list:
    """A new routing of ``src``'s payload cast to FP8 as the scatter reads it (``use_fp8=True``), and a replay of its
    handle with the pair ``(x_fp8, scales)`` of the payload doubled (``ep_comm.contract.fp8``)."""
    x, idx = src.x[rank], src.topk_idx[rank]
    args = (expand, 2 if expand else 1, expand, True)
    first = dispatch(be, be.pack_fp8(x), idx, None, None, *args, None)
    pair = fp8.quantize((x.astype(np.float32) * 2).astype(x.dtype))
    return [first, dispatch(be, be.pack_fp8((pair[0].view(np.uint8), pair[1])), None, None, first.handle, *args,
                            None)]


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_forwarded_fp8_dispatches_give_the_flat_bytes(expand):
    """The relay copies the packed FP8 rows the inbox send wrote (their words only), cast or from the pair."""
    src = sources("bfloat16", False, seed=23, hidden=128)
    calls_of = functools.partial(fp8_calls, src=src, expand=expand)
    flat, _ = run_world(src, "bfloat16", None, calls_of)
    forwarded, backends = run_world(src, "bfloat16", SCALEUP, calls_of)
    for rank, (want, got) in enumerate(zip(flat, forwarded)):
        assert backends[rank].transport.inbox_signals_sent == 2
        for name, a, b in zip(("first", "replay"), want, got):
            assert_same_dispatch(f"rank {rank} fp8 {name}", a, b)


def captured_calls(be, rank: int, src: Sources, expand: bool) -> tuple:
    """``(first, eager, eager combine, captured, captured combine)``: a new routing, an eager ``cpu_sync=False``
    replay of its handle with the payload doubled and its combine, then the same two calls while the fake GPU says it
    is capturing a CUDA graph (what a captured step launches must give the eager bytes: no host step between)."""
    x, idx = src.x[rank], src.topk_idx[rank]
    args = (expand, 2 if expand else 1, expand)
    first = dispatch(be, x, idx, None, None, *args, True, None)
    outs = [first]
    for capturing in (False, True):
        be.device.capturing_now = capturing
        replay = dispatch(be, x * 2, None, None, first.handle, *args, False, None)
        outs += [replay, combine(be, replay.recv_x, replay.handle, None, ())]
    be.device.capturing_now = False
    return tuple(outs)


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_captured_forwarded_replay_and_combine_give_the_eager_results(expand):
    src = sources("float32", False, seed=31)
    outs, backends = run_world(src, "float32", SCALEUP, functools.partial(captured_calls, src=src, expand=expand))
    for rank, (first, eager, eager_sum, captured, captured_sum) in enumerate(outs):
        assert backends[rank].transport.inbox_signals_sent == 5
        assert_same_as_eager(first, eager, eager_sum, captured, captured_sum)


def begin_last(world: World, be, kind: str) -> None:
    """Before ``be``'s next step of ``kind``: let the other ranks run until each has sent its inbox signal of that
    step and is waiting, then :data:`STRAGGLER_S` more, in which their waits see those signals."""
    rank, seq = be.transport.rank, int(be.transport.step[0]) + 1
    world.turn.wait_for(lambda: sum(arrived(world.inbox_signals(rank), seq, STEP_KINDS[kind])) == RANKS - 1,
                        timeout=WAIT_BOUND_S)
    world.turn.wait_for(lambda: False, timeout=STRAGGLER_S)


def test_the_inbox_waits_measure_a_forwarded_step_and_name_the_late_sender():
    """Rank 3 begins every forwarded step last (:func:`begin_last`): each rank's wait statistics count each step
    once per peer (the inbox wait measures it, the step's final wait does not: ``inbox_signals.measured_wait``),
    rank 3 came last in every wait of every other rank, and its forwarder in the other node (rank 1), which relayed
    only after rank 3's inbox signal, in none."""
    world = World(geometry("float32"), SCALEUP, True)
    backends, src, rounds = world_backends(world), sources("float32", False, seed=13), 2

    def late_steps(rank: int):
        be = backends[rank]
        for _ in range(rounds):
            if rank == 3:
                begin_last(world, be, "dispatch")
            out = dispatch(be, src.x[rank], src.topk_idx[rank], None, None, False, 1, False, True, None)
            if rank == 3:
                begin_last(world, be, "combine")
            combine(be, out.recv_x, out.handle, None, ())
        return decode(be.wait_table(), rank)

    stats = run_ranks(world, [lambda r=r: late_steps(r) for r in range(RANKS)])
    for rank, got in enumerate(stats):
        assert [p.steps for p in got.peers] == [0 if p == rank else 2 * rounds for p in range(RANKS)], rank
        if rank != 3:
            assert got.peers[3].times_last == 2 * rounds and got.slowest().peer == 3, (rank, got.peers)
            assert got.peers[1].times_last == 0, (rank, got.peers)


def fault_world(timeout_s: float) -> tuple:
    """``(world, backends, sources)`` forwarding in 2 nodes of 2, waits bounded by ``timeout_s``."""
    world = World(geometry("float32"), SCALEUP, True, timeout_s=timeout_s)
    return world, world_backends(world), sources("float32", False, seed=11)


def failure(call) -> BaseException:
    """What ``call()`` raised (AssertionError when it returned)."""
    try:
        call()
    except ep_comm.TimeoutError as error:
        return error
    raise AssertionError("the call returned, but a rank it waits for never came")


def test_a_rank_that_never_arrives_is_named_by_every_forwarded_peer():
    """Rank 3 skips the dispatch: the inbox waits and the step's wait of every other rank give up at the bound, and
    each raises ``ep_comm.TimeoutError`` naming rank 3 (its forwarder, rank 1, relays nothing for it)."""
    world, backends, src = fault_world(FAULT_TIMEOUT_S)

    def call(rank: int):
        if rank == 3:
            return None
        be = backends[rank]
        return failure(lambda: dispatch(be, src.x[rank], src.topk_idx[rank], None, None, False, 1, False, True,
                                        None))

    errors = run_ranks(world, [lambda r=r: call(r) for r in range(RANKS)])
    for rank, error in enumerate(errors[:3]):
        assert error.missing_ranks == (3,), f"rank {rank}: {error}"
        assert "waiting for ranks [3]" in str(error), str(error)


def test_a_forwarder_that_never_runs_its_hook_is_named_by_every_peer():
    """A split forwarded dispatch: rank 2 sends (its inbox blocks and inbox signal) but never calls its hook, so it
    never relays nor signals the step; every other rank's hook raises ``ep_comm.TimeoutError`` naming rank 2."""
    world, backends, src = fault_world(FAULT_TIMEOUT_S)

    def call(rank: int):
        be = backends[rank]
        half = be.dispatch_send(DispatchRequest(src.x[rank], src.topk_idx[rank], None, None, False, 1, False, True,
                                                None))
        if rank == 2:
            return None
        half.prepare()
        return failure(half.receive)

    errors = run_ranks(world, [lambda r=r: call(r) for r in range(RANKS)])
    for rank in (0, 1, 3):
        assert errors[rank].missing_ranks == (2,), f"rank {rank}: {errors[rank]}"
