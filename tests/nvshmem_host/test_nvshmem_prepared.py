"""The prepared path (``ep_comm.backends.nvshmem.prepared``) against the general path, through ``Buffer`` over the
fake GPU with the kernels in the CUDA simulator: the same calls give the same bytes, and the calls it must not take
(a refusal, a deferred routing verdict, profiling, a new identity) behave as on the general path."""
import dataclasses

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, launch_log, simulated_buffer
from helpers.same_outputs import assert_same, assert_same_dispatch, assert_same_outputs

import ep_comm.backends.nvshmem.prepared as prepared_module
import ep_comm.buffer as buffer_module
from ep_comm.contract import fp8
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.errors import RoutingError

# SMALL_GEO's routing with a hidden size an FP8 dispatch takes (a multiple of 128), bfloat16 payload
FP8_GEO = Geometry(1, 6, 256, 3, 9, payload_dtype("bfloat16"))


def _buffer(prepared: bool, use_puts: bool = False, profile: bool = False) -> buffer_module.Buffer:
    """A Buffer of ``SMALL_GEO`` over the simulated nvshmem backend; ``prepared=False``: the general path only."""
    return simulated_buffer(prepared, use_puts, profile)


# SMALL_IDX's shape with a token that picks no expert: the same prepared shape, fewer rows received (other exact
# output shapes with cpu_sync=True)
FEWER_ROWS_IDX = np.array([[0, 1, -1], [-1, -1, -1], [4, 5, 3]], np.int64)


def _calls(buf, expand: bool, weighted: bool) -> list:
    """The outputs of a fixed sequence of eager calls: new routings (cpu_sync False, then True), replays (cpu_sync
    False and True) and combines, each shape twice (the second call of a shape is the prepared one), then a routing
    of the same shape receiving fewer rows (exact outputs of other shapes with cpu_sync=True) and its replays."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32) for _ in range(4)]
    weights = rng.random((3, SMALL_GEO.num_topk)).astype(np.float32) if weighted else None
    options = dict(expand=expand, expert_alignment=2, zero_padding=True)
    outs = []
    for sync in (False, True, False, True):
        for x in xs[:2]:
            out = buf.dispatch(x, SMALL_IDX, weights, cpu_sync=sync, **options)
            outs += [out, buf.combine(out.recv_x, out.handle)]
    first, synced = outs[0], outs[4]
    for handle in (first.handle, synced.handle):
        for sync in (False, True):
            for x in xs[2:]:
                out = buf.dispatch(x, handle=handle, cpu_sync=sync)
                # a cpu_sync=False output's tail rows are unwritten (never combined): any bits, NaN and inf among them
                with np.errstate(over="ignore", invalid="ignore"):
                    y = out.recv_x * 2
                outs += [out, buf.combine(y, out.handle)]
    for x in xs:
        out = buf.dispatch(x, FEWER_ROWS_IDX, weights, cpu_sync=True, **options)
        outs += [out, buf.combine(out.recv_x, out.handle)]
        out = buf.dispatch(x * 3, handle=out.handle, cpu_sync=True)
        outs += [out, buf.combine(out.recv_x, out.handle)]
    return outs


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_the_prepared_path_gives_the_bytes_of_the_general_path(expand, weighted):
    general, prepared = _buffer(False), _buffer(True)
    want, got = _calls(general, expand, weighted), _calls(prepared, expand, weighted)
    assert_same_outputs(want, got)
    # every call but the first of each shape (new routings 6, their combines 6 (two shapes of y), replays 4 (a
    # cpu_sync=True replay of a cpu_sync=False handle is the general path's), their combines 8; with fewer rows: 4 new
    # routings, 3 combines (another y), 4 replays, 4 combines)
    assert prepared._backend.prepared.replayed == 39 and general._backend.prepared.replayed == 0
    assert prepared._backend.runner.steps.seq == general._backend.runner.steps.seq


def test_the_prepared_path_over_puts_gives_the_bytes_of_the_general_path():
    general, prepared = _buffer(False, use_puts=True), _buffer(True, use_puts=True)
    assert_same_outputs(_calls(general, False, True), _calls(prepared, False, True))
    assert prepared._backend.prepared.replayed >= 8


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_exact_shapes_past_the_recorded_ones_launch_unrecorded_and_give_the_bytes_of_the_general_path(expand,
                                                                                                    monkeypatch):
    """``cpu_sync=True`` calls of two exact output shapes with room for one: the pieces of the second that depend on
    its shape launch as they are (``steps.launch_now``), not recorded (an expand replay's scatter does not: it stays
    recorded), and every call gives the general path's bytes."""
    unrecorded = []
    monkeypatch.setattr(prepared_module, "_MAX_EXACT_COPIES", 1)
    monkeypatch.setattr(prepared_module, "launch_now",
                        lambda path, stream, *args: unrecorded.append(path.__name__) or path(stream, *args))
    general, prepared = _buffer(False), _buffer(True)
    assert_same_outputs(_calls(general, expand, True), _calls(prepared, expand, True))
    assert len(prepared._backend.prepared._exact_copies) == 1
    assert "carved_receive_copy" in unrecorded
    assert ("replay_scatter" in unrecorded) is not expand


def _weighted_combines(buf, expand: bool) -> list:
    """The outputs of dispatches with weights (cpu_sync False and True) and of combines given weights of the
    received rows (float32, then float64, which the general path converts), each call twice."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
    weights = rng.random((3, SMALL_GEO.num_topk)).astype(np.float32)
    outs = []
    for sync in (False, True):
        for dtype in (np.float32, np.float64, np.float32):
            for _ in range(2):
                out = buf.dispatch(x, SMALL_IDX, weights, cpu_sync=sync, expand=expand, expert_alignment=2,
                                   zero_padding=True)
                back = (out.recv_topk_weights * 3).astype(dtype)
                outs += [out, buf.combine(out.recv_x, out.handle, topk_weights=back)]
    return outs


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_combine_given_weights_is_prepared_and_gives_the_bytes_of_the_general_path(expand):
    general, prepared = _buffer(False), _buffer(True)
    want, got = _weighted_combines(general, expand), _weighted_combines(prepared, expand)
    assert_same_outputs(want, got)
    assert all(out.topk_weights is not None for out in got[1::2])
    # per cpu_sync: dispatches 5 of 6, combines of float32 weights 3 of 4 (float64 ones take the general path)
    assert prepared._backend.prepared.replayed == 16


def _prepared_buffer():
    """A Buffer whose shape of ``SMALL_IDX`` (cpu_sync=False) and its combine are prepared."""
    buf = _buffer(True)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    for _ in range(2):
        out = buf.dispatch(x, SMALL_IDX, cpu_sync=False)
        buf.combine(out.recv_x, out.handle)
    assert buf._backend.prepared.replayed == 2
    return buf, x, out


@pytest.mark.parametrize("bad", ["dtype", "rows", "weights", "alignment"])
def test_a_refused_call_of_a_prepared_shape_raises_as_the_general_path_and_takes_no_step(bad):
    buf, x, _ = _prepared_buffer()
    general = _buffer(False)
    args = {"dtype": (x.astype(np.float64), SMALL_IDX, None, {}),
            "rows": (np.ones((4, SMALL_GEO.hidden), np.float32), SMALL_IDX, None, {}),
            "weights": (x, SMALL_IDX, np.ones((3, 2), np.float32), {}),
            "alignment": (x, SMALL_IDX, None, dict(expert_alignment=True))}[bad]
    errors = []
    for b in (general, buf):
        seq = b._backend.runner.steps.seq
        with pytest.raises((TypeError, ValueError)) as error:
            b.dispatch(*args[:3], cpu_sync=False, **args[3])
        errors.append((type(error.value), str(error.value)))
        assert b._backend.runner.steps.seq == seq
    assert errors[0] == errors[1]


def test_a_deferred_routing_verdict_is_raised_by_the_next_prepared_call():
    buf, x, out = _prepared_buffer()
    bad = SMALL_IDX.copy()
    bad[1, 0] = SMALL_GEO.num_experts  # out of range: the count kernel's verdict, checked by the next call
    buf.dispatch(x, bad, cpu_sync=False)
    replayed = buf._backend.prepared.replayed
    with pytest.raises(RoutingError, match="expert id 6"):
        buf.combine(out.recv_x, out.handle)
    assert buf._backend.prepared.replayed == replayed
    buf.combine(out.recv_x, out.handle)  # usable after: the ranks stayed in step
    assert buf._backend.prepared.replayed == replayed + 1


def test_profiling_and_a_hook_take_the_general_path():
    buf = _buffer(True, profile=True)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    for _ in range(2):
        out = buf.dispatch(x, SMALL_IDX, cpu_sync=False)
        buf.combine(out.recv_x, out.handle)
    assert buf._backend.prepared.replayed == 0
    buf, x, out = _prepared_buffer()
    hook = buf.dispatch(x, SMALL_IDX, cpu_sync=False, return_recv_hook=True)
    hook()
    assert buf._backend.prepared.replayed == 2


def test_a_prepared_shape_never_takes_a_capture_and_refuses_unsigned_ids_there_as_the_general_path(monkeypatch):
    """Under CUDA-graph capture a call of a prepared shape is the general path's: unsigned ids are refused by name
    before anything is enqueued (``_buffer_arguments.topk_idx_array``), signed ones are captured there (the prepared
    path replays nothing); outside the capture the unsigned ids of the shape take the general path too."""
    buf, x, out = _prepared_buffer()
    be, replayed = buf._backend, buf._backend.prepared.replayed
    unsigned = np.array([[0, 1, 2], [2, 3, 5], [4, 5, 3]], np.uint32)  # SMALL_IDX's shape, no "no expert"
    launches = launch_log(monkeypatch)
    be.device.capturing_now = True
    seq, step = be.runner.steps.seq, int(be.transport.step[0])
    with pytest.raises(RuntimeError, match="topk_idx has dtype uint32: a dispatch captured into a CUDA graph needs "
                                           "signed expert ids"):
        buf.dispatch(x, unsigned, cpu_sync=False)
    assert launches == [] and be.runner.steps.seq == seq and int(be.transport.step[0]) == step, "nothing was enqueued"
    captured = buf.dispatch(x, SMALL_IDX, cpu_sync=False)
    buf.combine(captured.recv_x, captured.handle)
    assert be.prepared.replayed == replayed and be.runner.steps.seq == seq + 2
    be.device.capturing_now = False
    got, want = buf.dispatch(x, unsigned), buf.dispatch(x, unsigned.astype(np.int64))
    assert be.prepared.replayed == replayed
    assert_same_dispatch("unsigned ids", want, got)


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
def test_a_cpu_sync_replay_waits_for_nothing_and_the_next_call_raises_its_timeout(prepared, monkeypatch):
    """``docs/design.md``, "The eager path": a replay with ``cpu_sync=True`` takes its counts from its handle and
    does not poll; a peer its GPU wait missed is raised by the next call (``ep_comm.TimeoutError`` naming it)."""
    buf = _buffer(prepared)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    out = buf.dispatch(x, SMALL_IDX)
    for _ in range(2):
        buf.dispatch(x, handle=out.handle)
    be = buf._backend
    transport, exchange = be.transport, be.transport.exchange

    def missing_a_peer(*args):
        exchange(*args)
        transport.missing = [0]  # what the GPU wait records when a peer does not come within timeout_s

    monkeypatch.setattr(transport, "exchange", missing_a_peer)
    polls, replayed = be.device.polls, be.prepared.replayed
    replay = buf.dispatch(x, handle=out.handle)
    assert be.device.polls == polls, "no poll"
    assert be.prepared.replayed == replayed + prepared
    np.testing.assert_array_equal(replay.handle.num_recv_tokens_per_expert, out.handle.num_recv_tokens_per_expert)
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        buf.combine(replay.recv_x, replay.handle)


def _fp8_calls(buf, pair: bool, expand: bool) -> list:
    """FP8 dispatches (the pair, or ``x`` with ``use_fp8=True``): per ``cpu_sync`` a new routing twice (the second
    prepared), then two replays of its handle (the second prepared); ``x`` differs from call to call."""
    rng = np.random.default_rng(11)
    xs = [(rng.standard_normal((3, FP8_GEO.hidden)) * 8).astype(FP8_GEO.dtype) for _ in range(4)]

    def payload(x):
        if pair:
            q, scales = fp8.quantize(x)
            return dict(x=(q.view(np.uint8), scales), use_fp8=False)
        return dict(x=x, use_fp8=True)

    outs = []
    for sync in (False, True):
        for x in xs[:2]:
            outs.append(buf.dispatch(**payload(x), topk_idx=SMALL_IDX, cpu_sync=sync, expand=expand,
                                     expert_alignment=2, zero_padding=True))
        handle = outs[-1].handle
        outs += [buf.dispatch(**payload(x), handle=handle, cpu_sync=sync) for x in xs[2:]]
    return outs


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("pair", [True, False], ids=["pair", "use_fp8"])
def test_an_fp8_dispatch_is_prepared_and_gives_the_bytes_of_the_general_path(pair, expand):
    """The FP8 pair and ``use_fp8=True`` take the prepared path from a shape's second call (the scatter reads the same
    arrays), and ``recv_x`` comes back as the general path's pair: the same FP8 bits and scales of every defined
    row, the same ids, weights and handle."""
    general = simulated_buffer(False, geo=FP8_GEO)
    prepared = simulated_buffer(True, geo=FP8_GEO)
    want, got = _fp8_calls(general, pair, expand), _fp8_calls(prepared, pair, expand)
    for i, (a, b) in enumerate(zip(want, got)):
        (bits_a, scales_a), (bits_b, scales_b) = a.recv_x, b.recv_x
        rows = int(a.handle.num_expanded_tokens if expand else a.handle.num_recv_tokens)
        assert bits_b.dtype == bits_a.dtype and scales_b.dtype == scales_a.dtype == np.float32, i
        assert_same(f"call {i} scales", scales_a[:rows], scales_b[:rows])
        assert_same_dispatch(f"call {i}", dataclasses.replace(a, recv_x=bits_a), dataclasses.replace(b, recv_x=bits_b))
    # per cpu_sync: the second new routing and the second replay
    assert prepared._backend.prepared.replayed == 4 and general._backend.prepared.replayed == 0
    assert prepared._backend.runner.steps.seq == general._backend.runner.steps.seq
