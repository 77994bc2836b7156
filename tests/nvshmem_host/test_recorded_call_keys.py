"""A recorded call's key holds everything its launches depend on (``ep_comm._launcher.recorded_calls.call_key``):
here the 16-byte start of the payload (``x``) and of the combine's ``y``, which decides the rows' copy width
(``ep_comm._launcher.device_arrays.wide_rows``). On a GPU a later call of a key replays the first call's launches,
scalars included; ``helpers.fake_gpu.RootCheckingCalls`` asserts in the simulator that every call of a key makes the
same launches with the same scalars."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, HostDevice, combine, dispatch, simulated_backend, simulated_buffer

from ep_comm._launcher.recorded_calls import FixedArguments, call_key
from ep_comm.backends.nvshmem.routing_roots import COUNT_ROOT, handle_roots
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")


def _rows(num_tokens: int, hidden: int, offset_words: int, seed: int) -> np.ndarray:
    """float32 ``[num_tokens, hidden]`` random rows whose data start ``offset_words`` float32 words into an
    allocation (NumPy's allocations start on 16 bytes: 2 words give an 8-byte, not 16-byte, start)."""
    base = np.empty(num_tokens * hidden + 4, np.float32)
    rows = base[offset_words:offset_words + num_tokens * hidden].reshape(num_tokens, hidden)
    rows[:] = np.random.default_rng(seed).standard_normal((num_tokens, hidden))
    return rows


def _key(x: np.ndarray) -> tuple:
    """The key of a call taking payload ``x`` (its roots and their pointers left out)."""
    return call_key(_key, (x, 3, None), HostDevice.array_pointers)[0]


def test_the_payload_key_tells_a_16_byte_start_from_an_8_byte_one():
    aligned, shifted = _rows(3, SMALL_GEO.hidden, 0, 1), _rows(3, SMALL_GEO.hidden, 2, 1)
    assert _key(aligned) != _key(shifted)
    assert _key(aligned) == _key(_rows(3, SMALL_GEO.hidden, 4, 2))  # 16 bytes in: the same launches


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("first_offset, second_offset", [(0, 2), (2, 0)], ids=["aligned-then-shifted", "shifted-then-aligned"])
def test_calls_of_one_shape_with_payloads_on_different_16_byte_starts_round_trip_exactly(expand, first_offset,
                                                                                       second_offset):
    """Dispatch and combine of one call shape, the payload once on a 16-byte start and once 8 bytes past one: each
    call's rows arrive and come back exactly (the simulator's recorded calls assert that no key is replayed with
    another copy width)."""
    be = simulated_backend(SMALL_GEO, True, False)
    for seed, offset in enumerate((first_offset, second_offset)):
        x = _rows(3, SMALL_GEO.hidden, offset, seed)
        out = dispatch(be, x, SMALL_IDX, None, None, expand, 1, True, True, None)
        y = _rows(*out.recv_x.shape, offset, seed + 10)
        y[:] = out.recv_x
        back = combine(be, y, out.handle, None, ())
        np.testing.assert_array_equal(back.x, _combined(x, expand))


def _combined(x: np.ndarray, expand: bool) -> np.ndarray:
    """The combine of ``y = recv_x`` at one rank: compact sends one row per token (taken once), expand one per
    (token, expert), summed in float32 from zero in top-k order."""
    if not expand:
        return x
    total = np.zeros_like(x)
    for k in range(SMALL_IDX.shape[1]):
        total += np.where(SMALL_IDX[:, k:k + 1] >= 0, x, np.float32(0))
    return total


# every recorded piece, by the function a recorded call is given (the same on both paths: they run one sequence)
PIECES = {"NvshmemDispatch.count_and_scatter", "NvshmemDispatch.receive_count", "NvshmemDispatch.replay_scatter",
          "NvshmemDispatch.carved_receive_copy", "NvshmemCombine.send", "NvshmemCombine.reduce"}


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
def test_every_recorded_piece_is_held_to_its_first_call_in_check_mode(prepared):
    """Each eager call three times (the later ones prepared, where ``prepared``), compact and expand, new routings and
    replays with and without ``cpu_sync``, and their combines: every recorded piece of the path is called again
    under a key seen before, and made its first call's launches word for word (``RootCheckingCalls``); none had roots
    sharing bytes (a GPU would record no such call)."""
    buf = simulated_buffer(prepared)
    rng = np.random.default_rng(5)
    weights = rng.random((3, SMALL_GEO.num_topk)).astype(np.float32)
    for expand in (False, True):
        for sync in (False, True):
            handles = []
            for _ in range(3):
                x = rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
                out = buf.dispatch(x, SMALL_IDX, weights, expand=expand, cpu_sync=sync)
                buf.combine(out.recv_x, out.handle)
                handles.append(out.handle)
            for handle in handles:
                out = buf.dispatch(rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32), handle=handle,
                                   cpu_sync=sync)
                buf.combine(out.recv_x, out.handle)
    recorded = buf._backend.runner.recorded
    assert {piece for piece, calls in recorded.compared.items() if calls} == PIECES, recorded.compared
    assert not recorded.shared, f"pieces called with roots that share bytes (never recorded on a GPU): {recorded.shared}"


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_handle_copied_with_other_routing_arrays_is_replayed_and_combined_from_them(prepared, expand):
    """A replay and a combine take a handle's routing arrays as the count block of the dispatch that made them
    (``backends/nvshmem/routing_roots.py``) only while they are that dispatch's own: a copy of the handle given copies
    of them (``dataclasses.replace``) is read from the copies. The first handle's count block is overwritten after its
    calls were recorded: the copy replays and combines as the first handle did before."""
    buf = simulated_buffer(prepared)
    x = np.random.default_rng(3).standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
    h = buf.dispatch(x, SMALL_IDX, expand=expand).handle
    for _ in range(3):  # recorded, then replayed (prepared: learnt first)
        want = buf.dispatch(x, handle=h)
        want_back = buf.combine(want.recv_x, want.handle)
    copied = dataclasses.replace(h, **{name: getattr(h, name).copy() for name in ROUTING_FIELDS})
    (_, block), *_ = h.derived[COUNT_ROOT]
    block[:] = -7  # the first handle's routing, its slots and psums: gone
    got = buf.dispatch(x, handle=copied)
    got_back = buf.combine(got.recv_x, got.handle)
    np.testing.assert_array_equal(got.recv_x, want.recv_x)
    np.testing.assert_array_equal(got.recv_topk_idx, want.recv_topk_idx)
    np.testing.assert_array_equal(got_back.x, want_back.x)


ROUTING_FIELDS = ("topk_idx", "is_token_in_rank", "dst_buffer_slot_idx", "psum_num_recv_tokens_per_rank",
                  "psum_num_recv_tokens_per_expert")


def _copied(h, names):
    """A copy of handle ``h`` (``dataclasses.replace``: the same ``derived`` dict) given copies of arrays ``names``."""
    return dataclasses.replace(h, **{name: getattr(h, name).copy() for name in names})


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("fields", [("recv_src_metadata",), ("dst_buffer_slot_idx",), ROUTING_FIELDS,
                                    ("recv_src_metadata",) + ROUTING_FIELDS],
                         ids=["metadata", "slots", "routing", "all"])
def test_a_copied_handle_with_other_arrays_does_not_take_the_arrays_read_for_the_first(prepared, expand, fields):
    """A handle used again has its arrays read once (``routing_roots.handle_roots``: ``FixedArguments`` kept in
    ``h.derived``); a copy of it given other arrays (``fields``) shares that dict (``dataclasses.replace``) and must
    not take them. Combines along the handle and along such a copy, in turns, each give the first handle's result and,
    in check mode (``RootCheckingCalls``), make the launches of their key's first call; each one's arrays read are its
    own. Then, the first handle's read last, its copied arrays are overwritten: the copy still combines as before."""
    buf = simulated_buffer(prepared)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
    out = buf.dispatch(x, SMALL_IDX, rng.random((3, SMALL_GEO.num_topk)).astype(np.float32), expand=expand)
    h = out.handle

    def combined(handle):  # with the weights: launches in the send at one rank in compact mode too
        back = buf.combine(out.recv_x, handle, topk_weights=out.recv_topk_weights)
        return np.concatenate([back.x.ravel(), back.topk_weights.ravel()])

    want = combined(h)
    copied = _copied(h, fields)
    for handle in (h, h, copied, copied, h, h, copied, copied, h, copied):  # read at each one's second use in turn
        np.testing.assert_array_equal(combined(handle), want)
    (_, block), *_ = h.derived[COUNT_ROOT]
    for handle in (copied, h):
        handle_roots(handle, HostDevice.array_pointers)
        routing, send = handle_roots(handle, HostDevice.array_pointers)  # its second use in a row: read
        assert type(send) is FixedArguments and type(routing) is FixedArguments
        assert _same(send.roots, [handle.recv_src_metadata, handle.psum_num_recv_tokens_per_rank])
        copied_routing = handle is copied and fields[-1] in ROUTING_FIELDS  # then the five arrays, not the block
        assert _same(routing.roots, [getattr(copied, name) for name in ROUTING_FIELDS] if copied_routing else [block])
    assert handle_roots(h, HostDevice.array_pointers)[1] is handle_roots(h, HostDevice.array_pointers)[1]  # kept
    for name in fields:  # the first handle's arrays that the copy has its own of: gone
        garbage = getattr(h, name)
        garbage[...] = ~garbage if garbage.dtype == np.bool_ else -7
    for _ in range(2):
        np.testing.assert_array_equal(combined(copied), want)
    recorded = buf._backend.runner.recorded
    assert recorded.compared["NvshmemCombine.send"] and recorded.compared["NvshmemCombine.reduce"], recorded.compared
    assert not recorded.shared, recorded.shared


def _same(arrays, others) -> bool:
    """Whether ``arrays`` are the very objects ``others``, in order."""
    return len(arrays) == len(others) and all(a is b for a, b in zip(arrays, others))


def _walked(buf, call) -> dict:
    """Per recorded piece of ``call()``, the argument items ``call_key`` read for it: the words of its key after the
    function (an array, a scalar, a tuple, an object with a ``launch_key`` or a ``FixedArguments``: one word each;
    a tuple's items follow its word)."""
    recorded, walked = buf._backend.runner.recorded, {}
    run = recorded.run

    def counting(on, path, stream, *args):
        walked[path.__qualname__] = len(call_key(path, args, HostDevice.array_pointers)[0]) - 1
        run(on, path, stream, *args)

    recorded.run = counting
    try:
        call()
    finally:
        recorded.run = run
    return walked


# per piece, the argument items call_key reads at a handle's third use, weights or none (before the handle's arrays
# were read once: the combine's send 5, its reduce 7, a replay's scatter 7 and its receive copy 7)
WALKED = {"NvshmemCombine.send": 3, "NvshmemCombine.reduce": 5, "NvshmemDispatch.replay_scatter": 5,
          "NvshmemDispatch.carved_receive_copy": 5}


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("sync", [False, True], ids=["device-counts", "cpu_sync"])
def test_a_handle_used_again_is_read_in_few_items(prepared, expand, sync):
    """The items ``call_key`` walks per recorded piece of a combine and of a replay along a handle used twice already:
    the handle's arrays come as one item per piece (``routing_roots.handle_roots``), and so does the routing of a
    replay's output handle at its first combine. A change that walks them again (or walks more) fails here."""
    buf = simulated_buffer(prepared)
    x = np.random.default_rng(6).standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)
    weights = np.full((3, SMALL_GEO.num_topk), 0.5, np.float32)
    out = buf.dispatch(x, SMALL_IDX, weights, expand=expand, cpu_sync=sync)
    for _ in range(2):
        buf.combine(out.recv_x, out.handle)
    combined = _walked(buf, lambda: buf.combine(out.recv_x, out.handle))
    weighted = _walked(buf, lambda: buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights))
    made = []
    replayed = _walked(buf, lambda: made.append(buf.dispatch(x, handle=out.handle, cpu_sync=sync)))
    pieces = ("NvshmemCombine.send", "NvshmemCombine.reduce")
    assert combined == weighted == {piece: WALKED[piece] for piece in pieces}, (combined, weighted)
    assert sum(combined.values()) == 8  # 12 before
    for piece in ("NvshmemDispatch.replay_scatter", "NvshmemDispatch.carved_receive_copy"):
        assert replayed.get(piece, WALKED[piece]) == WALKED[piece], replayed
    assert "NvshmemDispatch.replay_scatter" in replayed, replayed
    # the replay's output handle, at its first use: its routing (the replayed handle's arrays) read already, its
    # metadata walked (the send's three arrays and scalars as a tuple: 6 items, 5 before)
    fresh = _walked(buf, lambda: buf.combine(made[0].recv_x, made[0].handle))
    assert fresh == {"NvshmemCombine.send": 6, "NvshmemCombine.reduce": WALKED["NvshmemCombine.reduce"]}, fresh
