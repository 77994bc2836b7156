"""The budgets of the eager path, counted per call on the fake GPU with an H200's launch shape (132 SMs) and the
DeepSeek-V3 decode shape (``helpers.eager_counts``: kernels stubbed, recorded calls replayed as on the GPU): kernel
launches, allocations before the first launch, stream synchronisations, device-to-host reads, polls, Python calls.
Counts, not timings. Each call is counted after a warm-up (its plans built)."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest
from helpers.eager_counts import Counts, LaunchCounter
from helpers.fake_gpu import simulated_backend
from mpi4py import MPI

import ep_comm.buffer as buffer_module
from ep_comm.backends.sm_grid import grid_shape
from ep_comm.contract import fp8
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.testing.routing import uniform_routing

GEO = Geometry(1, 256, 7168, 8, 128, payload_dtype("bfloat16"))
# per op (expand?): the most launches; the budget is 5 / 3 / 2 (3 for an expand combine, which sends its
# own partials; 6 for an expand new routing, whose receive places, then copies); a new routing at decode scatters in
# one launch (the row pieces take their stable slots themselves; 6 / 7 before issue 46's slots_in_rows), and a compact
# one with cpu_sync=False counts in its receive copy's launch (4: issue 46's count_in_copy); measured 4 / 6 since a
# compact one with cpu_sync=True copied into worst-case outputs counts there too (issue 47: 5 before, its receive
# count launched apart)
LAUNCHES = {"new": (4, 6), "cached": (3, 4), "combine": (2, 3)}
# cpu_sync=False calls of a prepared shape (ep_comm.backends.nvshmem.prepared), each recorded call looked up as on the
# GPU (recorded_calls.call_key): measured 41-43 / 34-35 / 27 (issue 51: each key read from the call's arguments in
# one pass, no key, roots or layout function of its own; each operation runs the general path's two step functions,
# NvshmemDispatch.new_send/new_receive, replay_send/replay_receive, NvshmemCombine.send_steps/receive_steps: 2
# calls); before: 43-46 / 36-37 / 28 (issue 47, third pass: a
# recorded call's layout read without a comprehension frame, a new routing's count_in_copy choice learned once per
# shape, a combine's one output made without a views call; the arrays carved fewer, which no call count shows, VIEWS
# below); 47-49 / 38-39 / 30 (second pass), 59 / 49-50 / 40-42 (first); at 635f594 (the general path, lookups not
# counted) 132 / 101 / 92
PYTHON_CALLS = {"new": 43, "cached": 35, "combine": 27}
# an FP8 dispatch's cpu_sync=False call (the pair, or x with use_fp8=True) of a prepared shape: the bfloat16 call's,
# plus the payload's arrays named for the scatter (NvshmemDispatch.pack_fp8) and the packed recv_x viewed as the pair
# (fp8.unpack); measured 64-66 / 53 (pair), 60-62 / 49 (use_fp8); on the general path before: 172 / 150 (pair)
FP8_PYTHON_CALLS = {"new": 66, "cached": 53}
# tools/host_pairs.py measures the same pairs: 60-61 / 72-74 (before issue 51: 63-64 / 75-78; 68 / 83; 91 / 105)
PAIR_CALLS = {"cached": 61, "new": 74}
# cpu_sync=True calls of a prepared shape: measured 49-52 / 36-37 / 33 (issue 47, fourth pass: a compact new routing
# counts in its copy, one recorded call fewer; the poll's record tag chosen without a call); before 51-52 / 36-37 / 33
# (issue 51); 54-55 / 38-39 / 34 (a new routing's poll, verdict and counts read from one read of the mapped record; a
# compact one's exact outputs carved as views of the exact rows after the poll, no worst-case views sliced; a replay as
# its cpu_sync=False twin, no poll; a combine's poll); 57-58 / 40-41 / 36 (second pass), 69 / 49-50 / 46-48 (first);
# before issue 47 (c0b50a8, lookups not counted) 90-99 / 131-141 / 36
PYTHON_CALLS_SYNC = {"new": 52, "cached": 37, "combine": 33}
# a combine given float32 topk_weights (prepared since issue 47; 116-126 on the general path before): measured 31
# with a cpu_sync=False handle, 37 with a cpu_sync=True one (before the third pass 33 / 39); since issue 51 30 / 36
WEIGHTED_COMBINE_CALLS = {False: 30, True: 36}
# arrays carved per call by the device's recarvings (``cupy.ndarray(memptr=...)``, about 1.1 us each on an H100): a new
# routing's count block 1 before its first launch (its count words) and its handle's 6 after its last (9 with
# cpu_sync=False: its device counts too), its outputs 3 (a compact one with cpu_sync=True: views of the exact rows,
# made after the poll); a replay's outputs 3; a combine's one output is its block. Before issue 47's third pass a
# new routing carved 16, 13 of them (the whole count block) before its first launch, and a compact one with
# cpu_sync=True sliced its 3 worst-case outputs after the poll besides
VIEWS = {"new": {False: 13, True: 10}, "cached": {False: 3, True: 3}, "combine": {False: 0, True: 0}}
# of those, carved before the first launch (compact, expand): an expand replay's outputs before its scatter (the
# handle's expanded rows are copied into their metadata first); a compact replay's after its receive copy
VIEWS_BEFORE_FIRST_LAUNCH = {"new": (1, 1), "cached": (0, 3), "combine": (0, 0)}


@pytest.fixture(params=[False, True], ids=["compact", "expand"], scope="module")
def counted(request):
    """``(counter, ops)``: a Buffer over the fake GPU and its eager ops by name, each counted after two warm-up
    calls."""
    backend = simulated_backend(GEO, False, False, launch=grid_shape(132))
    saved, buffer_module.make_backend = buffer_module.make_backend, lambda *args: backend
    try:
        buf = buffer_module.Buffer(MPI.COMM_SELF, num_experts=GEO.num_experts, hidden=GEO.hidden,
                                   num_topk=GEO.num_topk, num_max_tokens_per_rank=GEO.max_tokens, backend="mpi")
    finally:
        buffer_module.make_backend = saved
    expand = request.param
    idx = uniform_routing(GEO.max_tokens, GEO.num_experts, GEO.num_topk, seed=3).topk_idx
    x = np.ones((GEO.max_tokens, GEO.hidden), GEO.dtype)
    with LaunchCounter(backend) as counter:
        handles = {sync: buf.dispatch(x, idx, expand=expand, cpu_sync=sync) for sync in (True, False)}
        ops: Dict[str, Callable] = {}
        for sync, out in handles.items():
            ops[f"new cpu_sync={sync}"] = lambda sync=sync: buf.dispatch(x, idx, expand=expand, cpu_sync=sync)
            ops[f"cached cpu_sync={sync}"] = lambda out=out, sync=sync: buf.dispatch(x, handle=out.handle, cpu_sync=sync)
            ops[f"combine cpu_sync={sync}"] = lambda out=out: buf.combine(out.recv_x, out.handle)
        for op in ops.values():
            op(), op()
        ops["pair inputs"] = (x, idx, handles[False].handle)  # type: ignore[assignment]
        yield counter, ops, expand, buf
    buf.close()


def _count(counter: LaunchCounter, ops: Dict[str, Callable], name: str) -> Counts:
    """The counts of op ``name``, after a cpu_sync=True call (which leaves no dispatch's verdict to check)."""
    ops["cached cpu_sync=True"]()
    return counter.count(ops[name])


@pytest.mark.parametrize("kind", ["new", "cached", "combine"])
@pytest.mark.parametrize("sync", [True, False])
def test_an_eager_call_enqueues_its_chain_without_waiting_on_the_stream(counted, kind, sync):
    counter, ops, expand, _ = counted
    counts = _count(counter, ops, f"{kind} cpu_sync={sync}")
    assert counts.syncs == 0 and counts.reads == 0, counts.events
    # one poll where the contract needs host numbers; a replay has them from its handle (docs/design.md)
    assert counts.polls == (1 if sync and kind != "cached" else 0), counts.events
    assert counts.launches <= LAUNCHES[kind][expand], counts.events
    assert counts.allocations_before_first_launch <= 1, counts.events
    assert counts.allocations <= 2, counts.events


@pytest.mark.parametrize("kind", ["new", "cached", "combine"])
@pytest.mark.parametrize("sync", [True, False])
def test_arrays_carved_per_call(counted, kind, sync):
    counter, ops, expand, _ = counted
    counts = _count(counter, ops, f"{kind} cpu_sync={sync}")
    assert counts.views <= VIEWS[kind][sync], counts
    assert counts.views_before_first_launch <= VIEWS_BEFORE_FIRST_LAUNCH[kind][expand], counts


def test_the_call_after_a_cpu_sync_false_new_routing_polls_its_verdict_once(counted):
    counter, ops, _, _ = counted
    ops["new cpu_sync=False"]()
    assert counter.count(ops["cached cpu_sync=False"]).polls == 1


@pytest.mark.parametrize("kind", ["new", "cached", "combine"])
def test_python_calls_of_the_cpu_sync_false_path(counted, kind):
    counter, ops, _, _ = counted
    ops["cached cpu_sync=True"]()
    assert counter.python_calls(ops[f"{kind} cpu_sync=False"]) <= PYTHON_CALLS[kind]


@pytest.mark.parametrize("kind", ["new", "cached", "combine"])
def test_python_calls_of_the_cpu_sync_true_path(counted, kind):
    counter, ops, _, buf = counted
    ops["cached cpu_sync=True"]()
    replayed = buf._backend.prepared.replayed
    assert counter.python_calls(ops[f"{kind} cpu_sync=True"]) <= PYTHON_CALLS_SYNC[kind]
    assert buf._backend.prepared.replayed == replayed + 1, "the call took the prepared path"


def test_after_the_poll_of_a_new_routing_only_the_exact_outputs_and_their_copy_remain(counted):
    """A new routing with ``cpu_sync=True``: compact, the receive copy (into worst-case outputs) is enqueued before
    the poll and nothing is launched or allocated after it, only the outputs' views of the exact rows are carved;
    expand, the exact outputs (one allocation) and their receive copy (two launches) come after it, and every view
    (the handle's, the outputs') after the copy's launches. Nothing else."""
    counter, ops, expand, _ = counted
    events = _count(counter, ops, "new cpu_sync=True").events
    after = [e.split()[0] for e in events[events.index("poll") + 1:]]
    assert after == (["alloc", "launch", "launch", "views", "views"] if expand else ["views"]), events


def test_the_counter_sees_a_stream_sync_and_an_extra_launch(counted, monkeypatch):
    """The counts fail when the path waits on the stream or launches once more (what the budgets guard)."""
    counter, ops, expand, buf = counted
    backend = buf._backend
    wait_state = backend.transport.wait_state

    def with_extras():
        backend.device.synchronize()
        backend.kernels.launcher(object, 1, 32, stream=0)()
        return wait_state()

    monkeypatch.setattr(backend.transport, "wait_state", with_extras)
    counts = _count(counter, ops, "cached cpu_sync=False")
    assert counts.syncs == 1 and counts.launches == LAUNCHES["cached"][expand] + 1


@pytest.mark.parametrize("kind", ["new", "cached"])
@pytest.mark.parametrize("source", ["pair", "use_fp8"])
def test_an_fp8_dispatch_enqueues_what_a_bfloat16_one_does(counted, kind, source):
    """The FP8 pair, and ``x`` with ``use_fp8=True``, go to the scatter as they are (it writes the packed rows):
    the same launches and allocations, in the same order, as the bfloat16 dispatch of the same call; no pack
    step, no cast launch; and a shape seen before takes the prepared path (its Python calls within budget)."""
    counter, ops, expand, buf = counted
    x = np.ones((GEO.max_tokens, GEO.hidden), GEO.dtype)
    q, scales = fp8.quantize(x)
    payload, use_fp8 = ((q.view(np.uint8), scales), False) if source == "pair" else (x, True)
    idx = uniform_routing(GEO.max_tokens, GEO.num_experts, GEO.num_topk, seed=3).topk_idx
    handle = buf.dispatch(x, idx, expand=expand, cpu_sync=False).handle
    routing = dict(topk_idx=idx) if kind == "new" else dict(handle=handle)

    def call():
        return buf.dispatch(payload, **routing, expand=expand, cpu_sync=False, use_fp8=use_fp8)

    call(), call()
    ops["cached cpu_sync=True"]()
    counts = counter.count(call)
    ops["cached cpu_sync=True"]()
    plain = counter.count(ops[f"{kind} cpu_sync=False"])
    assert _kinds(counts.events) == _kinds(plain.events) and counts.syncs == plain.syncs == 0, (counts.events,
                                                                                               plain.events)
    ops["cached cpu_sync=True"]()
    assert counter.python_calls(call) <= FP8_PYTHON_CALLS[kind]


def _kinds(events: list) -> list:
    """Launches by kernel, allocations by kind only (the prepared path carves with ``empty``, the general one with
    ``carve``: one allocation either way), no views (the general path slices, which is not counted)."""
    return ["alloc" if e.startswith("alloc") else e for e in events if not e.startswith("views")]


def test_python_calls_of_the_prepared_pairs(counted):
    """The budgets of a ``cpu_sync=False`` pair (dispatch, then the combine of its handle) on the prepared
    path, as ``tools/host_pairs.py`` counts them (``PAIR_CALLS``)."""
    counter, ops, _, buf = counted
    x, idx, handle = ops["pair inputs"]

    def cached():
        out = buf.dispatch(x, handle=handle, cpu_sync=False)
        buf.combine(out.recv_x, out.handle)

    def new():
        out = buf.dispatch(x, idx, expand=handle.expand, cpu_sync=False)
        buf.combine(out.recv_x, out.handle)

    for pair, budget in ((cached, PAIR_CALLS["cached"]), (new, PAIR_CALLS["new"])):
        pair(), pair()
        replayed = buf._backend.prepared.replayed
        assert counter.python_calls(pair) <= budget
        assert buf._backend.prepared.replayed == replayed + 2, "both calls of the pair took the prepared path"


@pytest.mark.parametrize("sync", [False, True])
def test_python_calls_of_a_combine_given_weights(counted, sync):
    """A combine with ``topk_weights`` (float32, the received rows' shape) takes the prepared path, with two launches
    more than without (the weights sent back, then gathered) and no other allocation."""
    counter, ops, expand, buf = counted
    x, idx, _ = ops["pair inputs"]
    out = buf.dispatch(x, idx, expand=expand, cpu_sync=sync)
    rows = out.handle.num_out_rows
    weights = np.ones((rows,) if expand else (rows, GEO.num_topk), np.float32)

    def combine():
        return buf.combine(out.recv_x, out.handle, topk_weights=weights)

    combine(), combine()
    ops["cached cpu_sync=True"]()
    replayed = buf._backend.prepared.replayed
    counts = counter.count(combine)
    assert buf._backend.prepared.replayed == replayed + 1, "the call took the prepared path"
    assert counts.syncs == 0 and counts.reads == 0 and counts.allocations <= 1, counts.events
    assert counts.launches <= LAUNCHES["combine"][expand] + 2, counts.events
    ops["cached cpu_sync=True"]()
    assert counter.python_calls(combine) <= WEIGHTED_COMBINE_CALLS[sync]
