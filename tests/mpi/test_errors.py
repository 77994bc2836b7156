"""Bad input is refused before anything is sent; a missing rank is named within ``timeout_s``, and a rank that
comes after its peers gave up gets their abort records (``PeerAbortedError``). The values of ``topk_idx`` are the
dispatch's count step's to check: ``test_routing_verdict``.

Collective like the rest of ``tests/mpi``: every rank passes the same bad argument.
"""
from __future__ import annotations

import dataclasses
import time

import ml_dtypes
import numpy as np
import pytest
from helpers.collective import dispatch, make_buffer, to_device
from helpers.options import current
from helpers.oracle import COMM, RANK, WORLD, bits, expected_compact_combine, make_world
from mpi4py import MPI

import ep_comm
from ep_comm.contract.arrays import to_host

pytestmark = pytest.mark.mpi
BACKEND = current().backend


@pytest.fixture(scope="module")
def world():
    return make_world("uniform", dtype="float32")


@pytest.fixture(scope="module")
def buf(world):
    b = make_buffer(world)
    yield b
    b.close()


def bad_dispatch_cases(world):
    """(name, kwargs for Buffer.dispatch, expected exception) with one rule broken each."""
    x, idx, w = world.x[RANK], world.topk_idx[RANK], world.weights[RANK]
    too_many = np.zeros((world.max_tokens + 1, world.num_topk), dtype=np.int64)
    past_int64 = idx.astype(np.uint64)
    past_int64[0, 0] = 2**63
    read_only = np.zeros(world.experts_per_rank, np.int64)
    read_only.flags.writeable = False
    host_only = [("read-only stats", dict(x=x, topk_idx=idx, stats=read_only), ValueError)] if BACKEND == "mpi" else []
    return host_only + [
        ("unsigned id past int64", dict(x=x, topk_idx=past_int64), ValueError),
        ("too many tokens", dict(x=np.zeros((world.max_tokens + 1, world.hidden), np.float32), topk_idx=too_many),
         ValueError),
        ("wrong hidden", dict(x=np.zeros((len(x), world.hidden + 1), np.float32), topk_idx=idx), ValueError),
        ("wrong top-k width", dict(x=x, topk_idx=idx[:, :-1]), ValueError),
        ("row-count mismatch", dict(x=x[:-1], topk_idx=idx), ValueError),
        ("weights shape", dict(x=x, topk_idx=idx, topk_weights=w[:, :-1]), ValueError),
        ("non-integer ids", dict(x=x, topk_idx=idx.astype(np.float32)), TypeError),
        ("wrong dtype", dict(x=x.astype(np.float16), topk_idx=idx), TypeError),
        ("1-D ids", dict(x=x, topk_idx=idx[:, 0]), ValueError),
        ("no routing", dict(x=x), ValueError),
        ("alignment 0", dict(x=x, topk_idx=idx, expert_alignment=0), ValueError),
        ("stats shape", dict(x=x, topk_idx=idx, stats=np.zeros(world.experts_per_rank + 1, np.int64)), ValueError),
        # on/off arguments are bools, never read by their truth: "False" is a non-empty string
        ("expand a string", dict(x=x, topk_idx=idx, expand="False"), TypeError),
        ("zero_padding an int", dict(x=x, topk_idx=idx, expand=True, zero_padding=1), TypeError),
        ("cpu_sync a string", dict(x=x, topk_idx=idx, cpu_sync="False"), TypeError),
    ]


CASES = [c[0] for c in bad_dispatch_cases(make_world("uniform", dtype="float32"))]


@pytest.mark.parametrize("case", CASES)
def test_bad_dispatch_input_raises_and_buffer_stays_usable(world, buf, case):
    _, kwargs, exc = next(c for c in bad_dispatch_cases(world) if c[0] == case)
    kwargs = {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises(exc) as info:
        buf.dispatch(**kwargs)
    assert str(info.value), "the error must say what is wrong"
    out = dispatch(buf, world)  # the next collective call still works
    res = buf.combine(out.recv_x, out.handle)
    assert to_host(res.x).shape == world.x[RANK].shape


def test_error_messages_name_the_argument(world, buf):
    idx = world.topk_idx[RANK].copy()
    idx[0, 0] = world.num_experts + 5  # every rank's: the routing error names the lowest, rank 0
    with pytest.raises(ValueError, match=rf"dispatch #\d+: rank 0's topk_idx holds expert id {world.num_experts + 5}: "
                                         rf"ids must be < num_experts={world.num_experts} \(negative = none\)"):
        buf.dispatch(to_device(world.x[RANK]), to_device(idx))
    with pytest.raises(ValueError, match=r"topk_idx has shape \(\d+, 1\): must be \[num_tokens, num_topk="):
        buf.dispatch(to_device(world.x[RANK]), to_device(idx[:, :1]))
    with pytest.raises(TypeError, match="x"):
        buf.dispatch(to_device(world.x[RANK].astype(np.float64)), to_device(world.topk_idx[RANK]))
    with pytest.raises(TypeError, match="^cpu_sync='False': must be True or False, got str$"):
        buf.dispatch(to_device(world.x[RANK]), to_device(world.topk_idx[RANK]), cpu_sync="False")


def test_handle_of_another_buffer_raises_before_sending(world, buf):
    """A handle whose shapes do not fit this Buffer (top-k width, ranks, local experts) is refused up front."""
    out = dispatch(buf, world)
    h = out.handle
    foreign = [dataclasses.replace(h, topk_idx=h.topk_idx[:, :-1]),
               dataclasses.replace(h, is_token_in_rank=h.is_token_in_rank[:, :1].repeat(WORLD + 1, axis=1)),
               dataclasses.replace(h, recv_src_metadata=h.recv_src_metadata[:, :-1]),
               dataclasses.replace(h, num_unaligned_recv_tokens_per_expert=h.num_unaligned_recv_tokens_per_expert[:-1])]
    for bad in foreign:
        with pytest.raises(ValueError, match="handle"):
            buf.dispatch(to_device(world.x[RANK]), handle=bad)
        with pytest.raises(ValueError, match="handle"):
            buf.combine(out.recv_x, bad)
    res = buf.combine(buf.dispatch(to_device(world.x[RANK]), handle=h).recv_x, h)  # still usable
    assert to_host(res.x).shape == world.x[RANK].shape


def test_bad_combine_input_raises_and_buffer_stays_usable(world, buf):
    out = dispatch(buf, world)
    y = to_host(out.recv_x)
    for bad, exc in [(dict(y=y[:, :-1]), ValueError), (dict(y=np.concatenate([y, y[:1]])), ValueError),
                     (dict(y=y.astype(np.float16)), TypeError),
                     (dict(y=y, bias=np.zeros((len(world.x[RANK]) + 1, world.hidden), np.float32)), ValueError),
                     (dict(y=y, topk_weights=np.zeros((len(y) + 1, world.num_topk), np.float32)), ValueError),
                     (dict(y=y, handle="not a handle"), TypeError)]:
        kwargs = {"handle": out.handle, **bad}
        kwargs = {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        with pytest.raises(exc):
            buf.combine(**kwargs)
    res = buf.combine(out.recv_x, out.handle)
    assert to_host(res.x).shape == world.x[RANK].shape


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_unsigned_ids_past_int64_are_refused_naming_the_value(world, buf, value):
    idx = world.topk_idx[RANK].astype(np.uint64)
    idx[-1, -1] = value
    with pytest.raises(ValueError) as info:
        buf.dispatch(to_device(world.x[RANK]), to_device(idx))
    assert str(info.value) == (f"topk_idx holds expert id {value}: does not fit int64; ids must be < "
                               f"num_experts={world.num_experts} (negative = none)")


@pytest.mark.skipif(BACKEND != "mpi", reason="read-only arrays are NumPy's (a CuPy array is always writeable)")
def test_read_only_stats_are_refused_before_sending(world, buf):
    stats = np.zeros(world.experts_per_rank, np.int64)
    stats.flags.writeable = False
    with pytest.raises(ValueError) as info:
        dispatch(buf, world, stats=stats)
    assert str(info.value) == ("stats is read-only (flags.writeable=False): dispatch adds the received counts into "
                               "it, it must be writeable")
    stats = np.zeros(world.experts_per_rank, np.int64)
    dispatch(buf, world, stats=stats)  # the Buffer stayed usable: every rank refused before sending
    np.testing.assert_array_equal(stats, [len(world.expert_rows(RANK, e)) for e in range(world.experts_per_rank)])


def test_handle_of_a_buffer_with_another_capacity_is_refused(world, buf):
    """The geometry a handle records (here num_max_tokens_per_rank) must be the Buffer's."""
    with make_buffer(dataclasses.replace(world, max_tokens=world.max_tokens + 8)) as other:
        out = dispatch(other, world)
        want = (f"handle comes from a dispatch of a Buffer with num_max_tokens_per_rank={world.max_tokens + 8} "
                f"(this Buffer: {world.max_tokens}): a handle replays and combines only on a Buffer of the "
                "geometry it was made with")
        with pytest.raises(ValueError) as info:
            buf.dispatch(to_device(world.x[RANK]), handle=out.handle)
        assert str(info.value) == want
        with pytest.raises(ValueError) as info:
            buf.combine(out.recv_x, out.handle)
        assert str(info.value) == want
        other.combine(out.recv_x, out.handle)
    res = buf.combine(*_recv_and_handle(buf, world))  # still usable
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


def test_bfloat16_weights_and_bias_are_taken_as_their_float32_values(world, buf):
    """bfloat16 ``topk_weights`` (dispatch, combine) and bias compute exactly what float32 copies of them do."""
    x, idx = to_device(world.x[RANK]), to_device(world.topk_idx[RANK])
    w16 = world.weights[RANK].astype(ml_dtypes.bfloat16)
    bias16 = np.random.default_rng(RANK).standard_normal(world.x[RANK].shape).astype(ml_dtypes.bfloat16)
    got = buf.dispatch(x, idx, to_device(w16), expand=True)
    want = buf.dispatch(x, idx, to_device(w16.astype(np.float32)), expand=True)
    assert bits(to_host(got.recv_topk_weights)).tobytes() == bits(to_host(want.recv_topk_weights)).tobytes()
    w_rows = to_host(got.recv_topk_weights).astype(ml_dtypes.bfloat16)
    res = buf.combine(got.recv_x, got.handle, topk_weights=to_device(w_rows), bias=to_device(bias16))
    ref = buf.combine(want.recv_x, want.handle, topk_weights=to_device(w_rows.astype(np.float32)),
                      bias=to_device(bias16.astype(np.float32)))
    assert bits(to_host(res.x)).tobytes() == bits(to_host(ref.x)).tobytes()


def test_null_and_inter_communicators_are_refused():
    common = dict(num_experts=4 * WORLD, hidden=8, num_topk=2, num_max_tokens_per_rank=4, backend=BACKEND)
    with pytest.raises(ValueError) as info:
        ep_comm.Buffer(MPI.COMM_NULL, **common)
    assert str(info.value) == "comm=MPI.COMM_NULL: must be a valid communicator (None = MPI.COMM_WORLD)"
    if WORLD < 2:
        return
    half = COMM.Split(RANK % 2, RANK)
    inter = half.Create_intercomm(0, COMM, 1 - RANK % 2, tag=15)
    try:
        with pytest.raises(TypeError) as info:
            ep_comm.Buffer(inter, **common)
        assert str(info.value) == ("comm is an inter-communicator (Intercomm): the ranks of a Buffer must form one "
                                   "group; give an intra-communicator (e.g. intercomm.Merge())")
    finally:
        inter.Free()
        half.Free()


def test_bad_constructor_arguments(world):
    common = dict(hidden=8, num_topk=2, num_max_tokens_per_rank=4, backend=BACKEND)
    with pytest.raises(ValueError, match="num_experts"):
        ep_comm.Buffer(num_experts=WORLD * 4 + 1 if WORLD > 1 else 0, **common)
    with pytest.raises(TypeError, match="dtype"):
        ep_comm.Buffer(num_experts=WORLD * 4, dtype="int8", **common)
    with pytest.raises(ValueError, match="backend"):
        ep_comm.Buffer(num_experts=WORLD * 4, hidden=8, num_topk=2, num_max_tokens_per_rank=4, backend="nccl")
    with pytest.raises(ValueError, match="timeout_s"):
        ep_comm.Buffer(num_experts=WORLD * 4, timeout_s=0, **common)
    with pytest.raises(TypeError, match="^deterministic='False': must be True or False, got str$"):
        ep_comm.Buffer(num_experts=WORLD * 4, deterministic="False", **common)


HEAD_START_S = 1.0  # a rank that skips a call enters its next one this much later, so that its peers' deadlines
# pass first (two ranks waiting for each other in different calls race to time out: the first to give up posts
# its abort record and the other raises PeerAbortedError)


@pytest.mark.mpi(min_size=2)  # a peer that can go missing
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_missing_rank_raises_timeout_naming_it(world, op):
    timeout_s = 1.5
    buf = make_buffer(world, timeout_s=timeout_s)
    missing = WORLD - 1
    out = dispatch(buf, world)
    if RANK != missing:
        start = time.monotonic()
        with pytest.raises(ep_comm.TimeoutError) as info:
            if op == "dispatch":
                dispatch(buf, world)
            else:
                buf.combine(out.recv_x, out.handle)
        waited = time.monotonic() - start
        assert info.value.missing_ranks == (missing,)
        assert str(missing) in str(info.value)
        assert timeout_s <= waited < timeout_s + 10
        assert isinstance(info.value, TimeoutError)  # the built-in one, too
        with pytest.raises(ep_comm.BufferUnusableError):
            dispatch(buf, world)
        buf.close()  # local release, no hang
    else:
        # the rank that skipped finds its peers' abort records at close: raised at once, named
        time.sleep(timeout_s + HEAD_START_S)
        start = time.monotonic()
        with pytest.raises(ep_comm.PeerAbortedError) as info:
            buf.close()
        assert time.monotonic() - start < 1.0
        assert info.value.aborted_ranks == tuple(range(WORLD - 1))
        assert f"gave up at {op} #{2 if op == 'dispatch' else 1}" in str(info.value)
    COMM.Barrier()
    # a fresh buffer works again
    with make_buffer(world) as again:
        res = again.combine(*_recv_and_handle(again, world))
        assert to_host(res.x).shape == world.x[RANK].shape


def _recv_and_handle(buf, world):
    out = dispatch(buf, world)
    return out.recv_x, out.handle


@pytest.mark.mpi(min_size=2)  # a peer that can go missing
def test_after_a_timeout_the_buffer_says_how_to_recover(world):
    """A rank skips a combine: the others' TimeoutError names it, then every call raises a
    BufferUnusableError naming the failed step and the way out; close is bounded and idempotent;
    the skipping rank's close, while its peers still wait, gets their abort records (PeerAbortedError
    naming them) instead of waiting out its own timeout; a fresh buffer is exact again."""
    timeout_s = 1.0
    skipper = WORLD - 1
    buf = make_buffer(world, timeout_s=timeout_s)
    out = dispatch(buf, world)
    start = time.monotonic()
    if RANK != skipper:
        with pytest.raises(ep_comm.TimeoutError) as info:
            buf.combine(out.recv_x, out.handle)
        assert info.value.missing_ranks == (skipper,) and "combine" in str(info.value)
        for call in (lambda: dispatch(buf, world), lambda: buf.combine(out.recv_x, out.handle)):
            with pytest.raises(ep_comm.BufferUnusableError) as info:
                call()
            assert "combine #1 timed out" in str(info.value) and "create a new one" in str(info.value)
        buf.close()
    else:
        time.sleep(HEAD_START_S / 2)  # in close while the peers still wait: the abort records reach its wait
        with pytest.raises(ep_comm.PeerAbortedError) as info:
            buf.close()
        # the first record to land ends the wait: with 3+ ranks the others may not have landed yet
        assert info.value.aborted_ranks and set(info.value.aborted_ranks) <= set(range(WORLD - 1))
        assert time.monotonic() - start < timeout_s + HEAD_START_S, "the abort record ends the wait"
    assert time.monotonic() - start < 2 * timeout_s + 10, "close must not hang"
    buf.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        dispatch(buf, world)
    COMM.Barrier()
    with make_buffer(world, timeout_s=timeout_s) as again:
        out = dispatch(again, world)
        res = again.combine(out.recv_x, out.handle)
        assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


@pytest.mark.mpi(min_size=2)  # a peer that can go missing
def test_messages_count_dispatches_and_combines_apart(world):
    """Three dispatch/combine pairs, then a rank skips the 4th dispatch: the others' TimeoutError and
    every later BufferUnusableError say "dispatch #4" (the 4th dispatch, the 7th step); the skipper's close
    names the step its peers gave up at, "dispatch #4"."""
    timeout_s = 1.0
    skipper = WORLD - 1
    buf = make_buffer(world, timeout_s=timeout_s)
    for _ in range(3):
        buf.combine(*_recv_and_handle(buf, world))
    if RANK != skipper:
        with pytest.raises(ep_comm.TimeoutError) as info:
            dispatch(buf, world)
        assert f"rank {RANK}: dispatch #4 timed out after 1 s waiting for ranks [{skipper}]" in str(info.value)
        with pytest.raises(ep_comm.BufferUnusableError) as info:
            dispatch(buf, world)
        assert f"rank {RANK}: cannot dispatch: dispatch #4 timed out waiting for ranks [{skipper}]" in str(info.value)
        buf.close()
    else:
        time.sleep(timeout_s + HEAD_START_S)
        with pytest.raises(ep_comm.PeerAbortedError) as info:
            buf.close()
        assert (f"rank {RANK}: cannot close: rank 0 gave up at dispatch #4 (timed out after 1 s waiting for ranks "
                f"[{skipper}])") in str(info.value)
    COMM.Barrier()


@pytest.mark.mpi(min_size=2)  # a peer that can be late
def test_a_late_rank_gets_the_peers_abort_instead_of_stale_rows(world):
    """A rank arrives at a combine after its peers timed out: the rows it would read belong to a step its
    peers gave up on, so its combine raises PeerAbortedError at once naming them and the step; its close is
    then a quiet local release; nobody hangs and a fresh buffer works."""
    timeout_s = 1.0
    late = WORLD - 1
    buf = make_buffer(world, timeout_s=timeout_s)
    out = dispatch(buf, world)
    if RANK == late:
        time.sleep(timeout_s + HEAD_START_S)
        start = time.monotonic()
        with pytest.raises(ep_comm.PeerAbortedError) as info:
            buf.combine(out.recv_x, out.handle)
        assert info.value.aborted_ranks == tuple(range(WORLD - 1))
        assert all(step == "combine #1" for _, step, _ in info.value.records)
        assert f"waiting for ranks [{late}]" in str(info.value)
        buf.close()
        assert time.monotonic() - start < 1.0
    else:
        with pytest.raises(ep_comm.TimeoutError) as info:
            buf.combine(out.recv_x, out.handle)
        assert info.value.missing_ranks == (late,)
        buf.close()
    COMM.Barrier()
    with make_buffer(world) as again:
        out = dispatch(again, world)
        res = again.combine(out.recv_x, out.handle)
        assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()
