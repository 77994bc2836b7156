"""Node-aware forwarding (``Buffer(forwarding=True)``, docs/design.md "Transports and nodes") on the session's backend
(mpi; nvshmem on GPUs, which counts its scale-out rows on the device), on every rank of an ``mpirun`` job.

The contract's cases (the routings of ``test_contract``, compact and expand, deterministic or not, new routings,
handle replays, ``cpu_sync=False``, receive hooks, FP8) on Buffers in virtual nodes of every size ``S < R`` that
divides the rank count, flat and forwarded: dispatches give byte for byte what a one-node Buffer gives on the same
routing; combines too when flat, and when forwarded the bytes of the forwarded order (docs/design.md, "Combine"),
from the independent sum of ``ep_comm.testing.forwarded``. The rows each rank puts over the scale-out path are
the flat path's (one per token and remote destination rank; a combine's, one per row received from a remote rank)
or the forwarded one's (one per token and remote destination node, both ways: a forwarder sends one summed row per
token of each source it forwards for). A rank that never arrives, or never calls its hook, is named by its peers'
timeouts. Collective: every test runs on every rank; each Buffer is made fresh, so that its step numbers (the
non-deterministic slots) match the reference's.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest
from helpers.collective import dispatch, make_buffer, to_device
from helpers.options import current
from helpers.oracle import (
    COMM,
    RANK,
    WORLD,
    World,
    bits,
    expected_compact_combine,
    expected_expand_combine,
    make_world,
)
from helpers.same_outputs import assert_same, assert_same_dispatch, assert_same_dispatch_unordered

import ep_comm

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]
NODE_SIZES = [s for s in range(1, WORLD) if WORLD % s == 0]  # every split into more than one node
ROUTINGS = ["uniform", "masked", "hot", "zero_rank", "uneven", "full"]
EXPAND = dict(expand=True, expert_alignment=4, zero_padding=True)
HEAD_START_S = 0.5  # how much longer than its peers' timeout a rank that is late waits


def nodes_buffer(world: World, scaleup_ranks: Any, forwarding: bool, **kw: Any) -> ep_comm.Buffer:
    """A Buffer for ``world`` in nodes of ``scaleup_ranks`` (None: one node)."""
    return make_buffer(world, scaleup_ranks=scaleup_ranks, forwarding=forwarding, **kw)


def calls(buf: ep_comm.Buffer, world: World, expand: bool) -> Dict[str, Any]:
    """The outputs of the contract's kinds of call, in this order, on ``buf``: a new routing and its combine
    (weighted in expand mode), a replay of its handle with another payload, ``cpu_sync=False``, and a split
    dispatch and combine (receive hooks)."""
    kw = EXPAND if expand else {}
    out: Dict[str, Any] = {"first": dispatch(buf, world, **kw)}
    first = out["first"]
    out["combine"] = buf.combine(first.recv_x, first.handle,
                                 topk_weights=first.recv_topk_weights if expand else None)
    x2 = (world.x[RANK].astype(np.float32) * 2 + 1).astype(world.dtype)
    out["replay"] = buf.dispatch(to_device(x2), handle=first.handle)
    out["lazy"] = dispatch(buf, world, cpu_sync=False, **kw)
    out["hooked"] = dispatch(buf, world, return_recv_hook=True, **kw)()
    out["hooked combine"] = buf.combine(out["hooked"].recv_x, out["hooked"].handle, return_recv_hook=True)()
    return out


@functools.lru_cache(maxsize=None)
def one_node_calls(routing: str, deterministic: bool, expand: bool) -> Dict[str, Any]:
    """:func:`calls` on a fresh one-node Buffer for ``make_world(routing)``: what every node split and either
    forwarding of that routing, ``deterministic`` and ``expand`` must give. Made once, by the first of the
    ``2 * len(NODE_SIZES)`` tests that compare against it, and kept for the others (collective: every rank runs the
    same tests in the same order, so every rank makes it in the same test)."""
    world = make_world(routing, dtype="bfloat16" if expand else "float32")
    with nodes_buffer(world, None, False, deterministic=deterministic) as one_node:
        return calls(one_node, world, expand)


def assert_same_calls(want: Dict[str, Any], got: Dict[str, Any], world: World, expand: bool,
                      forwarded_nodes: Optional[int], deterministic: bool) -> None:
    """``got`` (of :func:`calls`) against the one-node Buffer's ``want``: the dispatches and the combines'
    ``topk_weights`` byte for byte; the combines' ``x`` too, or with ``forwarded_nodes`` (a forwarding Buffer's
    ``scaleup_ranks``) the oracle's sum in the forwarded order. Without ``deterministic`` on nvshmem the atomic slots
    take the GPU's order, which no two runs share: the dispatches then received the same rows in any order."""
    same = assert_same_dispatch if deterministic or current().backend == "mpi" else assert_same_dispatch_unordered
    for name in ("first", "replay", "lazy", "hooked"):
        same(name, want[name], got[name])
    for name, weighted in (("combine", expand), ("hooked combine", False)):
        if forwarded_nodes is None:
            expected = want[name].x
        elif expand:
            expected = expected_expand_combine(world, weighted, scaleup_ranks=forwarded_nodes)
        else:
            expected = expected_compact_combine(world, scaleup_ranks=forwarded_nodes)
        assert bits(expected).tobytes() == bits(got[name].x).tobytes(), name
        assert_same(f"{name} topk_weights", want[name].topk_weights, got[name].topk_weights)


def remote_rows(world: World, scaleup_ranks: int, per_node: bool) -> int:
    """Scale-out rows of this rank's dispatch of ``world``: per token, its destination ranks outside this rank's
    node, or (``per_node``) their distinct nodes."""
    mine = RANK // scaleup_ranks
    total = 0
    for token in range(len(world.topk_idx[RANK])):
        ranks = [r for r in world.ranks_of(token) if r // scaleup_ranks != mine]
        total += len({r // scaleup_ranks for r in ranks}) if per_node else len(ranks)
    return total


def returned_rows(world: World, scaleup_ranks: int, forwarded: bool) -> int:
    """Scale-out rows of this rank's combine: one partial per row it received from a rank of another node; or
    (``forwarded``) one summed row per token of each source it forwards for (the rank with its local index in
    every other node) that reached a rank of its node."""
    mine = RANK // scaleup_ranks
    if not forwarded:
        return sum(1 for src, _ in world.received(RANK) if src // scaleup_ranks != mine)
    sources = [node * scaleup_ranks + RANK % scaleup_ranks for node in range(WORLD // scaleup_ranks) if node != mine]
    node = range(mine * scaleup_ranks, (mine + 1) * scaleup_ranks)
    return sum(1 for src in sources for t in range(len(world.topk_idx[src]))
               if any(world.entries_on(src, t, r) for r in node))


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("forwarding", [False, True])
@pytest.mark.parametrize("scaleup_ranks", NODE_SIZES)
def test_virtual_nodes_dispatch_as_one_node_and_combine_in_their_order(scaleup_ranks, forwarding, routing,
                                                                       deterministic, expand):
    world = make_world(routing, dtype="bfloat16" if expand else "float32")
    want = one_node_calls(routing, deterministic, expand)
    with nodes_buffer(world, scaleup_ranks, forwarding, deterministic=deterministic) as buf:
        first = dispatch(buf, world, **(EXPAND if expand else {}))
        assert buf.traffic().scaleout_rows.dispatch == remote_rows(world, scaleup_ranks, per_node=forwarding)
        buf.combine(first.recv_x, first.handle)
    # read after the close (the counts up to it)
    assert buf.traffic().scaleout_rows == (remote_rows(world, scaleup_ranks, per_node=forwarding),
                                           returned_rows(world, scaleup_ranks, forwarded=forwarding))
    with nodes_buffer(world, scaleup_ranks, forwarding, deterministic=deterministic) as buf:
        assert_same_calls(want, calls(buf, world, expand), world, expand, scaleup_ranks if forwarding else None,
                              deterministic)


@pytest.mark.parametrize("forwarding", [False, True])
@pytest.mark.parametrize("scaleup_ranks", NODE_SIZES)
def test_fp8_dispatch_gives_the_one_node_bytes(scaleup_ranks, forwarding):
    world = make_world("masked", hidden=256, dtype="bfloat16")
    outs: List[Any] = []
    for nodes, fwd in ((None, False), (scaleup_ranks, forwarding)):
        with nodes_buffer(world, nodes, fwd) as buf:
            outs.append(buf.dispatch(to_device(world.x[RANK]), to_device(world.topk_idx[RANK]),
                                     to_device(world.weights[RANK]), use_fp8=True, **EXPAND))
    want, got = outs
    for part, (a, b) in zip(("x_fp8", "scales"), zip(want.recv_x, got.recv_x)):
        assert_same(part, bits(a), bits(b))
    # the rest of the outputs and the handles, with the scales standing for recv_x
    assert_same_dispatch("fp8", dataclasses.replace(want, recv_x=want.recv_x[1]),
                         dataclasses.replace(got, recv_x=got.recv_x[1]))


def test_forwarding_saves_scale_out_rows_on_a_hot_routing():
    """Every token to an expert of every rank, two nodes: flat, a dispatch sends it to each remote rank and each
    remote rank sends a partial back; forwarded, it crosses once each way (one summed row per token)."""
    if WORLD < 4:
        pytest.skip("needs two nodes of two ranks")
    world = make_world("full", num_topk=WORLD, num_experts=WORLD)  # one expert per rank, every rank in every top-k
    rows = {}
    for forwarding in (False, True):
        with nodes_buffer(world, WORLD // 2, forwarding) as buf:
            out = dispatch(buf, world)
            buf.combine(out.recv_x, out.handle)
            rows[forwarding] = buf.traffic().scaleout_rows
    tokens = len(world.topk_idx[RANK])
    assert rows == {False: (tokens * (WORLD // 2), tokens * (WORLD // 2)), True: (tokens, tokens)}


def named_by_every_peer(buf: ep_comm.Buffer, absent: int, call: Callable[[], Any], timeout_s: float,
                        step: str) -> None:
    """Collective: on every rank but ``absent``, ``call()`` raises ep_comm.TimeoutError naming only ``absent``
    within ``timeout_s`` (+ a margin), then ``buf`` closes; on ``absent``, after its peers gave up, ``buf``'s close
    raises their abort records of ``step``."""
    if RANK != absent:
        start = time.monotonic()
        with pytest.raises(ep_comm.TimeoutError) as info:
            call()
        assert info.value.missing_ranks == (absent,)
        assert timeout_s <= time.monotonic() - start < timeout_s + 10
        buf.close()
    else:
        time.sleep(timeout_s + HEAD_START_S)
        with pytest.raises(ep_comm.PeerAbortedError, match=f"gave up at {step}") as info:
            buf.close()
        assert info.value.aborted_ranks == tuple(range(WORLD - 1))
    COMM.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scaleup_ranks", NODE_SIZES)
def test_a_rank_that_never_arrives_is_named_by_every_forwarded_peer(scaleup_ranks):
    """The last rank skips a forwarded dispatch: its forwarders time out waiting for their inboxes, the other
    ranks waiting for every rank; every one names only the missing rank."""
    world = make_world("uniform")
    buf = nodes_buffer(world, scaleup_ranks, True, timeout_s=1.5)
    dispatch(buf, world)
    named_by_every_peer(buf, WORLD - 1, lambda: dispatch(buf, world), 1.5, "dispatch #2")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scaleup_ranks", NODE_SIZES)
def test_a_forwarder_that_never_calls_its_hook_is_named_by_every_hook(scaleup_ranks):
    """Forwarded, a rank relays its node's rows in its receive hook: the last rank sends and never calls its hook,
    so every peer's hook names it (not the ranks whose rows it holds)."""
    world = make_world("uniform")
    buf = nodes_buffer(world, scaleup_ranks, True, timeout_s=1.5)
    hook = dispatch(buf, world, return_recv_hook=True)
    named_by_every_peer(buf, WORLD - 1, hook, 1.5, "dispatch #1")
