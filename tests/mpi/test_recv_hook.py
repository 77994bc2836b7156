"""``return_recv_hook=True``: the send half now, the receive half when the hook is called (docs/design.md, "Send/receive
split"). The hook's outputs are the plain call's bit for bit; the send waits for nobody; misuse raises RuntimeError
naming the step; two Buffers' halves interleave; a rank that never sends is named by the hooks' timeout.

Collective like the rest of ``tests/mpi`` (``tests/jobs/test_multirank.py`` runs it under ``mpirun -n 1..4``).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from helpers.collective import dispatch, forwarded, make_buffer, to_device
from helpers.oracle import COMM, RANK, WORLD, bits, make_world

import ep_comm
from ep_comm.contract.arrays import to_host
from ep_comm.testing import token_rows

pytestmark = pytest.mark.mpi

HANDLE_FIELDS = ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert", "num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx", "num_recv_tokens",
                 "num_expanded_tokens", "num_out_rows", "is_token_in_rank", "topk_idx", "topk_weights", "cpu_sync")
HEAD_START_S = 1.0  # as in test_errors: the skipping rank closes after its peers' deadlines passed


@pytest.fixture(scope="module")
def world():
    return make_world("uneven", dtype="bfloat16")


@pytest.fixture(scope="module")
def buf(world):
    b = make_buffer(world)
    yield b
    b.close()


def same(name: str, a, b) -> None:
    """``a`` and ``b`` (arrays, host values or None) hold the same bytes."""
    if a is None or b is None:
        assert a is None and b is None, name
        return
    a, b = np.asarray(to_host(a)), np.asarray(to_host(b))
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    assert bits(a).tobytes() == bits(b).tobytes(), f"{name} differs"


def same_dispatch(plain, hooked) -> None:
    assert isinstance(hooked, ep_comm.DispatchOutput)
    same("recv_topk_idx", plain.recv_topk_idx, hooked.recv_topk_idx)
    rows = token_rows(plain)
    for field in ("recv_x", "recv_topk_weights"):
        a, b = getattr(plain, field), getattr(hooked, field)
        same(field, a if a is None else to_host(a)[rows], b if b is None else to_host(b)[rows])
    for field in HANDLE_FIELDS:
        same(f"handle.{field}", getattr(plain.handle, field), getattr(hooked.handle, field))


def hooked(call, *args, **kwargs):
    """``call(*args, return_recv_hook=True, **kwargs)``: the pending hook, then what calling it returns."""
    hook = call(*args, return_recv_hook=True, **kwargs)
    assert isinstance(hook, ep_comm.RecvHook) and hook.pending
    out = hook()
    assert not hook.pending
    return out


@pytest.mark.parametrize("cpu_sync", [True, False], ids=["cpu_sync", "no_cpu_sync"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_hook_returns_the_plain_calls_outputs_bit_for_bit(world, buf, expand, cpu_sync):
    """New routing and cached replay (with weights), then combines with weights and two bias terms."""
    opts = dict(expand=expand, expert_alignment=4 if expand else 1, zero_padding=expand, cpu_sync=cpu_sync)
    stats_plain, stats_hooked = (np.zeros(world.experts_per_rank, np.int64) for _ in range(2))
    plain = dispatch(buf, world, stats=to_device(stats_plain), **opts)
    hooked_out = hooked(dispatch, buf, world, stats=to_device(stats_hooked), **opts)
    same_dispatch(plain, hooked_out)
    x2 = to_device((world.x[RANK].astype(np.float32) * 3 - 1).astype(world.dtype))
    replay = buf.dispatch(x2, handle=plain.handle, cpu_sync=cpu_sync)
    same_dispatch(replay, hooked(buf.dispatch, x2, handle=plain.handle, cpu_sync=cpu_sync))
    bias = tuple(to_device(np.full(world.x[RANK].shape, v, np.float32)) for v in (0.25, -1.5))
    for out in (plain, replay):
        args = (out.recv_x, out.handle)
        kwargs = dict(topk_weights=out.recv_topk_weights, bias=bias)
        want, got = buf.combine(*args, **kwargs), hooked(buf.combine, *args, **kwargs)
        assert isinstance(got, ep_comm.CombineOutput)
        same("combine.x", want.x, got.x)
        same("combine.topk_weights", want.topk_weights, got.topk_weights)


def test_the_send_half_waits_for_nobody_and_the_hook_receives(world, buf):
    """Every peer of rank 0 sends 0.5 s late: rank 0's send half returns at once, its hook waits for them."""
    late_s = 0.5
    COMM.Barrier()
    if RANK != 0:
        time.sleep(late_s)
    start = time.monotonic()
    hook = dispatch(buf, world, return_recv_hook=True)
    sent_s = time.monotonic() - start
    out = hook()
    received_s = time.monotonic() - start
    if RANK == 0 and WORLD > 1:
        assert sent_s < late_s / 2 <= received_s, (sent_s, received_s)
    same_dispatch(dispatch(buf, world), out)


def test_misuse_raises_naming_the_step_and_leaves_the_buffer_usable(world, buf):
    with pytest.raises(TypeError, match=r"^return_recv_hook=1: must be True or False, got int$"):
        dispatch(buf, world, return_recv_hook=1)
    first = dispatch(buf, world)
    hook = dispatch(buf, world, return_recv_hook=True)
    step = hook.step
    assert step.startswith("dispatch #") and repr(hook) == f"<RecvHook of {step}: pending>"
    pending = f"{step}'s receive hook has not been called: call it first"
    with pytest.raises(RuntimeError, match=f"^cannot dispatch: {pending}"):
        dispatch(buf, world)
    with pytest.raises(RuntimeError, match=f"^cannot combine: {pending}"):
        buf.combine(first.recv_x, first.handle, return_recv_hook=True)
    buf.get_dispatch_layout(to_device(world.topk_idx[RANK]))  # local, no step: allowed
    out = hook()
    with pytest.raises(RuntimeError, match=f"^{step}'s receive hook was already called"):
        hook()
    combined = buf.combine(out.recv_x, out.handle, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="already called"):
        hook()
    assert combined.step.startswith("combine #")
    got = combined()
    same("combine.x", buf.combine(out.recv_x, out.handle).x, got.x)


def test_close_invalidates_a_pending_hook_and_closes_normally(world):
    b = make_buffer(world)
    out = dispatch(b, world)
    hook = b.combine(out.recv_x, out.handle, return_recv_hook=True)
    b.close()
    assert not hook.pending and repr(hook) == f"<RecvHook of {hook.step}: closed>"
    with pytest.raises(RuntimeError, match=f"^{hook.step}'s receive hook belongs to a Buffer that was closed"):
        hook()
    with pytest.raises(RuntimeError, match="closed"):
        dispatch(b, world)
    with make_buffer(world) as again:  # the close was the collective one: the ranks stayed in step
        same_dispatch(dispatch(again, world), hooked(dispatch, again, world))


@pytest.mark.parametrize("order", ["a_then_b", "b_then_a"])
def test_two_buffers_interleave_their_halves(world, buf, order):
    """buf_a send, buf_b send, then the hooks in either order: each equals its plain call."""
    with make_buffer(world, deterministic=True) as other:
        want_a = dispatch(buf, world, expand=True, expert_alignment=2)
        want_b = other.combine(want_a.recv_x, want_a.handle, topk_weights=want_a.recv_topk_weights)
        hook_a = dispatch(buf, world, expand=True, expert_alignment=2, return_recv_hook=True)
        hook_b = other.combine(want_a.recv_x, want_a.handle, topk_weights=want_a.recv_topk_weights,
                               return_recv_hook=True)
        if order == "a_then_b":
            got_a, got_b = hook_a(), hook_b()
        else:
            got_b, got_a = hook_b(), hook_a()
        same_dispatch(want_a, got_a)
        same("combine.x", want_b.x, got_b.x)
        same("combine.topk_weights", want_b.topk_weights, got_b.topk_weights)


def test_a_split_step_records_its_phases(world):
    with make_buffer(world, profile=True) as b:
        out = hooked(dispatch, b, world)
        hooked(b.combine, out.recv_x, out.handle)
        phases = {(row.op, row.phase) for row in b.profile_table()}
    assert {("dispatch", p) for p in ("send part", "signal", "hook", "wait")} <= phases
    assert {("combine", p) for p in ("send part", "signal", "hook", "wait")} <= phases
    assert ("dispatch", "total") not in phases and ("combine", "signal+wait") not in phases


@pytest.mark.mpi(min_size=2)  # a peer that can go missing
def test_a_hook_times_out_naming_the_rank_that_never_sent(world):
    """The last rank skips a hooked dispatch: every other rank's send returns, and its hook raises
    ep_comm.TimeoutError naming that rank within timeout_s of the hook's call (not of the send); the Buffer is
    unusable and posted its abort record, which the skipping rank's close raises."""
    timeout_s = 1.0
    skipper = WORLD - 1
    b = make_buffer(world, timeout_s=timeout_s)
    dispatch(b, world)
    if RANK != skipper:
        hook = dispatch(b, world, return_recv_hook=True)
        time.sleep(timeout_s / 2)
        start = time.monotonic()
        with pytest.raises(ep_comm.TimeoutError) as info:
            hook()
        waited = time.monotonic() - start
        assert info.value.missing_ranks == (skipper,)
        assert f"dispatch #2 timed out after 1 s waiting for ranks [{skipper}]" in str(info.value)
        assert timeout_s <= waited < timeout_s + 10
        with pytest.raises(ep_comm.BufferUnusableError, match="dispatch #2 timed out"):
            dispatch(b, world)
        b.close()
    else:
        time.sleep(1.5 * timeout_s + HEAD_START_S)
        with pytest.raises(ep_comm.PeerAbortedError, match="gave up at dispatch #2"):
            b.close()
    COMM.Barrier()


@pytest.mark.mpi(min_size=2)  # a peer that can go missing
def test_a_rank_that_never_calls_its_hook_is_named_by_the_next_step(world):
    """The last rank sends but never calls its hook: its peers' hooks receive (its rows came with the send),
    their next dispatch times out naming it; its close invalidates the hook and raises the peers' records."""
    if forwarded():
        pytest.skip("forwarded, a rank relays its node's rows in its hook: test_forwarding checks that case")
    timeout_s = 1.0
    stuck = WORLD - 1
    b = make_buffer(world, timeout_s=timeout_s)
    want = dispatch(b, world)
    hook = dispatch(b, world, return_recv_hook=True)
    if RANK != stuck:
        same_dispatch(want, hook())
        with pytest.raises(ep_comm.TimeoutError) as info:
            dispatch(b, world)
        assert info.value.missing_ranks == (stuck,)
        b.close()
    else:
        time.sleep(timeout_s + HEAD_START_S)
        with pytest.raises(ep_comm.PeerAbortedError, match="gave up at dispatch #3"):
            b.close()
        with pytest.raises(RuntimeError, match="closed"):
            hook()
    COMM.Barrier()
