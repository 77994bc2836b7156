"""FP8 dispatch (docs/design.md, FP8): the pair ``(x_fp8, scales)`` and ``use_fp8=True``, on every rank of an
``mpirun`` job.

The received pair, packed again (``ep_comm.contract.fp8.pack``), must be what the shared checker expects when the
sources' payloads are their packed FP8 rows (the reference's expected rows, checked against the oracle's
received pairs), and byte for byte what a plain dispatch of those packed bytes (a Buffer whose hidden is the
packed row in bfloat16 elements) receives. ``use_fp8=True`` must equal dispatching ``ep_comm.contract.fp8.quantize(x)``
as a pair. Collective: every test runs on every rank.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from helpers.collective import shared_buffers, to_device
from helpers.options import current
from helpers.oracle import RANK, World, bits, expected_compact_combine, make_world

from ep_comm.contract import fp8
from ep_comm.contract.arrays import to_host
from ep_comm.testing.check import DispatchOptions, HostDispatch, Sources, check_dispatch, expected_receive

pytestmark = pytest.mark.mpi
HIDDEN = 256
EXPAND = dict(expand=True, expert_alignment=4, zero_padding=True)


@pytest.fixture(scope="module")
def buffers():
    """One buffer per geometry and ``deterministic``, shared by the tests of this module."""
    with shared_buffers() as get:
        yield get


def fp8_world(routing: str, dtype: str = "bfloat16", seed: int = 0) -> World:
    return make_world(routing, hidden=HIDDEN, dtype=dtype, seed=seed)


def pair_of(x: np.ndarray) -> tuple:
    """``ep_comm.contract.fp8.quantize(x)`` where the backend under test wants it (x_fp8 as uint8 bits off NumPy)."""
    q, s = fp8.quantize(x)
    return to_device(q if current().backend == "mpi" else q.view(np.uint8)), to_device(s)


def dispatch_pair(buf, world: World, x=None, **kw):
    """This rank's tokens of ``world`` (or ``x``) quantized, dispatched as the FP8 pair with its routing and
    weights."""
    return buf.dispatch(pair_of(world.x[RANK] if x is None else x), to_device(world.topk_idx[RANK]),
                        to_device(world.weights[RANK]), **kw)


def received_packed(out) -> np.ndarray:
    """The received pair of an FP8 dispatch packed again: ``[rows, P]`` uint8 on the host."""
    q, s = out.recv_x
    return fp8.pack(to_host(q).view(np.uint8), to_host(s))


def packed_sources(world: World) -> Sources:
    """Every rank's inputs with its payload as packed FP8 rows ``[T, P]`` uint8."""
    return Sources(world.num_experts, world.max_tokens, world.topk_idx,
                   [fp8.pack(*fp8.quantize(x)) for x in world.x], world.weights)


def check_fp8(world: World, out, opts: DispatchOptions) -> np.ndarray:
    """The shared checker on the received packed rows; the reference's received pairs agree with the oracle's.
    Returns the received packed rows."""
    q, s = out.recv_x
    rows = q.shape[0]
    assert q.shape == (rows, HIDDEN) and s.shape == (rows, HIDDEN // 128) and s.dtype == np.float32
    if current().backend == "mpi":
        assert q.dtype == fp8.FP8_DTYPE and (rows == 0 or np.may_share_memory(q, s)), "the pair are views of one allocation"
    packed = received_packed(out)
    sources = packed_sources(world)
    problems = check_dispatch(sources, RANK, opts, HostDispatch.of(dataclasses.replace(out, recv_x=packed)))
    assert not problems, problems
    want = expected_receive(sources, RANK)
    assert [divmod(int(o), world.max_tokens) for o in want.origin] == world.received(RANK), "reference != oracle"
    return packed


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("routing", ["uniform", "masked", "zero_rank", "full"])
def test_fp8_pair_dispatch(buffers, routing, expand):
    world = fp8_world(routing)
    kw = EXPAND if expand else {}
    out = dispatch_pair(buffers(world), world, **kw)
    check_fp8(world, out, DispatchOptions(expand=expand, alignment=4 if expand else 1, zero_padding=expand,
                                          weighted=True, deterministic=True))


@pytest.mark.parametrize("expand", [False, True])
def test_fp8_pair_dispatch_not_deterministic(buffers, expand):
    world = fp8_world("masked", seed=1)
    kw = EXPAND if expand else {}
    out = dispatch_pair(buffers(world, deterministic=False), world, **kw)
    check_fp8(world, out, DispatchOptions(expand=expand, alignment=4 if expand else 1, zero_padding=expand,
                                          weighted=True, deterministic=False))


@pytest.mark.parametrize("expand", [False, True])
def test_fp8_rows_are_what_a_plain_dispatch_of_the_packed_bytes_receives(buffers, expand):
    world = fp8_world("masked")
    kw = EXPAND if expand else {}
    out = dispatch_pair(buffers(world), world, **kw)
    width = fp8.packed_row_bytes(HIDDEN) // 2  # the packed rows as bfloat16 elements
    plain = dataclasses.replace(world, hidden=width, dtype=np.dtype(ml_dtypes.bfloat16),
                                x=[fp8.pack(*fp8.quantize(x)).view(ml_dtypes.bfloat16) for x in world.x])
    ref = buffers(plain).dispatch(to_device(plain.x[RANK]), to_device(plain.topk_idx[RANK]),
                                  to_device(plain.weights[RANK]), **kw)
    assert received_packed(out).tobytes() == bits(to_host(ref.recv_x)).tobytes()


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_use_fp8_is_the_quantized_pair(buffers, dtype, expand):
    world = fp8_world("uniform", dtype=dtype)
    buf = buffers(world)
    kw = EXPAND if expand else {}
    cast = buf.dispatch(to_device(world.x[RANK]), to_device(world.topk_idx[RANK]), to_device(world.weights[RANK]),
                        use_fp8=True, **kw)
    pair = dispatch_pair(buf, world, **kw)
    assert received_packed(cast).tobytes() == received_packed(pair).tobytes()
    np.testing.assert_array_equal(to_host(cast.recv_topk_idx), to_host(pair.recv_topk_idx))


@pytest.mark.parametrize("expand", [False, True])
def test_fp8_cached_dispatch_replays_the_routing(buffers, expand):
    world = fp8_world("masked")
    buf = buffers(world)
    kw = EXPAND if expand else {}
    first = dispatch_pair(buf, world, **kw)
    x2 = (world.x[RANK].astype(np.float32) * 3 - 1).astype(world.dtype)
    fresh = dispatch_pair(buf, world, x=x2, **kw)  # deterministic: the same layout as the first
    replay = buf.dispatch(pair_of(x2), handle=first.handle)
    cast = buf.dispatch(to_device(x2), handle=first.handle, use_fp8=True)
    assert received_packed(replay).tobytes() == received_packed(fresh).tobytes()
    assert received_packed(cast).tobytes() == received_packed(fresh).tobytes()
    np.testing.assert_array_equal(to_host(replay.recv_topk_idx), to_host(first.recv_topk_idx))


@pytest.mark.parametrize("expand", [False, True])
def test_fp8_through_a_recv_hook_is_the_plain_fp8_dispatch(buffers, expand):
    """``return_recv_hook=True`` with an FP8 dispatch (a pair and ``use_fp8``, new and cached): the hook returns the
    pair, the bytes the plain call receives."""
    world = fp8_world("masked")
    buf = buffers(world)
    kw = EXPAND if expand else {}
    plain = dispatch_pair(buf, world, **kw)
    hook = dispatch_pair(buf, world, return_recv_hook=True, **kw)
    hooked = hook()
    assert isinstance(hooked.recv_x, tuple) and received_packed(hooked).tobytes() == received_packed(plain).tobytes()
    cast = buf.dispatch(to_device(world.x[RANK]), handle=plain.handle, use_fp8=True, return_recv_hook=True)()
    assert received_packed(cast).tobytes() == received_packed(plain).tobytes()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("expand", [False, True])
def test_fp8_without_cpu_sync_gives_worst_case_rows(buffers, expand, cached):
    world = fp8_world("masked")
    buf = buffers(world)
    kw = EXPAND if expand else {}
    exact = dispatch_pair(buf, world, **kw)
    lazy = (buf.dispatch(pair_of(world.x[RANK]), handle=exact.handle, cpu_sync=False) if cached
            else dispatch_pair(buf, world, cpu_sync=False, **kw))
    n = exact.recv_x[0].shape[0]
    assert lazy.recv_x[0].shape[0] == lazy.handle.num_out_rows >= n
    assert received_packed(lazy)[:n].tobytes() == received_packed(exact).tobytes()
    assert (to_host(lazy.recv_topk_idx)[n:] == -1).all()
    check_fp8(world, lazy, DispatchOptions(expand=expand, alignment=4 if expand else 1, zero_padding=expand,
                                           cpu_sync=False, weighted=True, deterministic=True))


def test_fp8_dispatch_combines_like_any_other(buffers):
    """Combine is unchanged: the dequantized rows, in the buffer's dtype, come back as the oracle sums them."""
    world = fp8_world("masked")
    buf = buffers(world)
    out = dispatch_pair(buf, world)
    q, s = out.recv_x
    y = fp8.dequantize(to_host(q), to_host(s)).astype(world.dtype)
    res = buf.combine(to_device(y), out.handle)
    deq = fp8.dequantize(*fp8.quantize(world.x[RANK])).astype(world.dtype)
    want = expected_compact_combine(world, {(r, t): deq[t] for t in range(len(deq)) for r in world.ranks_of(t)})
    assert bits(to_host(res.x)).tobytes() == bits(want).tobytes()


def bad_fp8_cases(world: World) -> list:
    """(name, x, kwargs, exception, message pattern) with one FP8 rule broken each, on a hidden=256 buffer."""
    x = world.x[RANK]
    q, s = pair_of(x)
    t = len(x)
    return [
        ("use_fp8 with a pair", (q, s), dict(use_fp8=True), ValueError, r"use_fp8=True with x given as an FP8 pair"),
        ("three items", (q, s, s), {}, ValueError, r"x is a tuple of 3 items: an FP8 payload is the pair"),
        ("x_fp8 2 bytes", (to_device(x), s), {}, TypeError, r"x\[0\] \(x_fp8\) has dtype \w+: FP8 values must be a "
         r"1-byte dtype"),
        ("scales float64", (q, to_device(fp8.quantize(x)[1].astype(np.float64))), {}, TypeError,
         r"x\[1\] \(scales\) has dtype float64: FP8 scales must be float32"),
        ("x_fp8 narrow", (q[:, :128], s), {}, ValueError,
         rf"x\[0\] \(x_fp8\) has shape \({t}, 128\): must be \[num_tokens={t}, hidden=256\]"),
        ("scales wide", [q, to_device(np.ones((t, 3), np.float32))], {}, ValueError,
         rf"x\[1\] \(scales\) has shape \({t}, 3\): must be \[num_tokens={t}, hidden // 128=2\]"),
        ("scales None", (q, None), {}, TypeError, r"x\[1\] \(scales\) is None: an FP8 payload is the pair"),
        ("rows as lists", x.tolist(), {}, TypeError, r"^x must be (an|a GPU) array, got list"),
        ("two rows as lists", x[:2].tolist(), {}, TypeError, r"^x must be (an|a GPU) array, got list"),
        ("use_fp8 not a bool", to_device(x), dict(use_fp8=1), TypeError, r"use_fp8=1: must be True or False"),
    ]


def test_fp8_bad_arguments_are_refused_and_the_buffer_stays_usable(buffers):
    world = fp8_world("uniform")
    buf = buffers(world)
    for name, x, kw, exc, pattern in bad_fp8_cases(world):
        with pytest.raises(exc, match=pattern):
            buf.dispatch(x, to_device(world.topk_idx[RANK]), **kw)
    check_fp8(world, dispatch_pair(buf, world), DispatchOptions(weighted=True, deterministic=True))


def test_fp8_needs_hidden_a_multiple_of_128(buffers):
    world = make_world("uniform", hidden=24)
    buf = buffers(world)
    x, idx = world.x[RANK], to_device(world.topk_idx[RANK])
    rule = r"hidden=24: an FP8 dispatch needs hidden a multiple of 128 \(one float32 scale per 128-element block\)"
    with pytest.raises(ValueError, match=rule):
        buf.dispatch(to_device(x), idx, use_fp8=True)
    with pytest.raises(ValueError, match=rule):
        buf.dispatch((to_device(x.view(np.uint8)[:, :24]), to_device(np.ones((len(x), 0), np.float32))), idx)


@pytest.mark.skipif(current().backend != "mpi", reason="the GPU cast does not check for non-finite values")
def test_use_fp8_refuses_non_finite_input_on_mpi(buffers):
    world = fp8_world("uniform")
    buf = buffers(world)
    x = world.x[RANK].copy()  # every rank has tokens in this routing: every rank raises
    x[len(x) - 1, 5] = np.inf
    with pytest.raises(ValueError, match=rf"x row {len(x) - 1} holds a non-finite value"):
        buf.dispatch(x, world.topk_idx[RANK], use_fp8=True)
    check_fp8(world, dispatch_pair(buf, world), DispatchOptions(weighted=True, deterministic=True))
