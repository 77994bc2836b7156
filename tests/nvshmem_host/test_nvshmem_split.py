"""Split steps on the simulated nvshmem backend (the send half, then its receive hook): what each half launches, a
hook on another stream or in another capture state than its send, and the halves captured apart."""

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, eager_replay, launch_log, simulated_backend
from helpers.same_outputs import assert_same, assert_same_as_eager, assert_same_dispatch

from ep_comm.backends.interface import CombineRequest, DispatchRequest
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED


def _log_transport(transport, log: list) -> None:
    """Append the name of each signal/wait call of ``transport`` to ``log`` (beside the kernel launches)."""
    for name in ("exchange", "signal", "wait"):
        call = getattr(transport, name)
        setattr(transport, name, lambda *args, call=call, name=name: log.append(name) or call(*args))


def _split(be, request_of, send):
    """The send half of ``send`` (``be.dispatch_send`` / ``be.combine_send``) of ``request_of()``."""
    with be.captured_memory():
        return send(request_of())


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("cpu_sync", [True, False], ids=["cpu_sync", "no_cpu_sync"])
def test_a_split_step_signals_without_waiting_and_its_hook_waits_then_receives(monkeypatch, expand, cpu_sync):
    """``dispatch_send`` / ``combine_send`` launch up to the signal and no wait; the hook launches the wait first,
    then the receive kernels; the outputs are the plain calls' bit for bit (new routing, replay, combine)."""
    geo = SMALL_GEO
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, geo.hidden)).astype(np.float32)
    w = rng.random((3, geo.num_topk)).astype(np.float32)
    plain_be, be = simulated_backend(geo, True, False), simulated_backend(geo, True, False)
    log = launch_log(monkeypatch)
    _log_transport(be.transport, log)
    args = (expand, 2 if expand else 1, True, cpu_sync)
    plain = dispatch(plain_be, x, SMALL_IDX, w, None, *args, None)
    requests = [lambda: DispatchRequest(x, SMALL_IDX, w, None, *args, None),
                lambda: DispatchRequest(x * 2, plain.handle.topk_idx, w, plain.handle, *args, None)]
    wants = [plain, dispatch(plain_be, x * 2, None, w, plain.handle, *args, None)]
    for seq, (request_of, want) in enumerate(zip(requests, wants), start=1):
        start = len(log)
        half = _split(be, request_of, be.dispatch_send)
        sent = [entry if isinstance(entry, str) else entry[0] for entry in log[start:]]
        assert sent[-1] == "signal" and "wait" not in sent and "exchange" not in sent
        assert not any(name.startswith("receive") for name in sent), sent
        assert half.step == f"dispatch #{seq}"
        half.prepare()
        start = len(log)
        got = half.receive()
        hook = [entry if isinstance(entry, str) else entry[0] for entry in log[start:]]
        assert hook[0] == "wait" and "signal" not in hook and any(name.startswith("receive") for name in hook), hook
        assert_same_dispatch("hooked dispatch", want, got)
    y_w = plain.recv_topk_weights
    half = _split(be, lambda: CombineRequest(plain.recv_x, plain.handle, y_w, ()), be.combine_send)
    assert log[-1] == "signal"
    half.prepare()
    start = len(log)
    got = half.receive()
    assert log[start] == "wait"
    want = combine(plain_be, plain.recv_x, plain.handle, y_w, ())
    assert_same("hooked combine.x", want.x, got.x)
    assert_same("hooked combine.topk_weights", want.topk_weights, got.topk_weights)
    assert "exchange" not in log
    be.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_hook_on_another_stream_waits_for_the_send_and_one_captured_unlike_its_send_is_refused():
    """The hook's stream waits for the event marked after the send when it is not the send's stream; a hook whose
    capture state differs from its send's raises before enqueuing anything and can be called afterwards."""
    geo = SMALL_GEO
    be = simulated_backend(geo, True, False)
    x = np.ones((3, geo.hidden), np.float32)
    request = DispatchRequest(x, SMALL_IDX, None, None, False, 1, False, False, None)
    half = be.dispatch_send(request)
    be.device.current_stream = 7
    be.device.capturing_now = True
    with pytest.raises(RuntimeError, match=r"^dispatch's receive hook was called while the current stream is being "
                                           r"captured, but its send was enqueued outside any CUDA graph capture"):
        half.prepare()
    assert not getattr(be.device, "waited", [])
    be.device.capturing_now = False
    half.prepare()
    assert be.device.waited == ["event 1"]
    be.device.current_stream = 0
    assert half.step == "dispatch #1"
    half.receive()
    captured = simulated_backend(geo, True, False)
    captured.device.capturing_now = True
    half = _split(captured, lambda: request, captured.dispatch_send)
    captured.device.capturing_now = False
    with pytest.raises(RuntimeError, match="is not being captured, but its send was captured into a CUDA graph"):
        half.prepare()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_send_and_its_hook_captured_apart_hold_their_memory_and_give_the_eager_results(expand):
    """Send half and hook under capture (two graphs): each half's allocations are held for its graph (the send's
    the replay's outputs, the hook's the handle and what the receive allocates), and the results are the eager
    call's."""
    be, x, first, eager, eager_sum = eager_replay(expand, seed=8)
    be.device.capturing_now = True
    request = DispatchRequest(x * 2, first.handle.topk_idx, None, first.handle, expand, 2, True, False, None)
    half = _split(be, lambda: request, be.dispatch_send)
    held = len(be.runner.capture.held)
    assert held == 1
    half.prepare()
    captured = half.receive()
    assert len(be.runner.capture.held) == held + 1
    half = _split(be, lambda: CombineRequest(captured.recv_x, captured.handle, None, ()), be.combine_send)
    half.prepare()
    captured_sum = half.receive()
    be.device.capturing_now = False
    assert len(be.runner.capture.held) == held + 3
    assert_same_as_eager(first, eager, eager_sum, captured, captured_sum)
    be.close()
    assert not be.runner.capture.held
