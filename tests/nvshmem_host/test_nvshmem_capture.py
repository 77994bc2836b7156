"""CUDA-graph capture on the simulated nvshmem backend (a fake GPU that says it is capturing): which steps may be
captured, a captured bad routing reported by the next call, and a captured cached dispatch and combine giving the
eager results."""

import re

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, eager_replay, launch_log, simulated_backend
from helpers.same_outputs import assert_same_as_eager
from mpi4py import MPI

import ep_comm.buffer as buffer_module
from ep_comm import Buffer
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED


def test_only_host_free_steps_may_be_captured_and_a_refusal_leaves_the_buffer_usable():
    be = simulated_backend(SMALL_GEO, False, False)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    out = dispatch(be, x, SMALL_IDX, None, None, False, 1, False, True, None)
    be.device.capturing_now = True
    with pytest.raises(RuntimeError, match=r"captured into a CUDA graph, and it waits on the host \(cpu_sync=True"):
        dispatch(be, x, SMALL_IDX, None, None, False, 1, False, True, None)
    with pytest.raises(RuntimeError, match=r"captured into a CUDA graph, and it waits on the host \(cpu_sync=True"):
        dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    with pytest.raises(RuntimeError, match="combine was called while .* waits on the host"):
        combine(be, out.recv_x, out.handle, None, ())
    assert be.runner.steps.seq == 1 and int(be.transport.step[0]) == 1 and not be.runner.steps.unusable
    be.device.capturing_now = False
    again = dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    np.testing.assert_array_equal(again.recv_x, out.recv_x)


def simulated_buffer(monkeypatch, be) -> Buffer:
    """A Buffer of ``SMALL_GEO`` over the simulated nvshmem backend ``be``."""
    monkeypatch.setattr(buffer_module, "make_backend", lambda *args: be)
    geo = SMALL_GEO
    return Buffer(MPI.COMM_SELF, num_experts=geo.num_experts, hidden=geo.hidden, num_topk=geo.num_topk,
                  num_max_tokens_per_rank=geo.max_tokens, dtype="float32", backend="mpi")


def test_the_scaleout_rows_are_not_read_back_under_capture(monkeypatch):
    """``Buffer.traffic()`` copies the device counter back to the host: refused while the stream is being captured,
    read again after."""
    be = simulated_backend(SMALL_GEO, True, False)
    buf = simulated_buffer(monkeypatch, be)
    be.device.capturing_now = True
    with pytest.raises(RuntimeError, match="^traffic: cannot read the scale-out rows while a CUDA graph is being "
                                           "captured$"):
        buf.traffic()
    be.device.capturing_now = False
    assert buf.traffic().scaleout_rows == (0, 0)


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64])
def test_unsigned_ids_under_capture_are_refused_by_name_before_anything_is_enqueued(monkeypatch, dtype):
    """uint64 ids would have their largest id read back to the host (illegal under capture): every unsigned dtype is
    refused alike, by a dispatch and by get_dispatch_layout, and the Buffer takes them again outside the capture."""
    be = simulated_backend(SMALL_GEO, True, False)
    buf = simulated_buffer(monkeypatch, be)
    x = np.arange(3 * SMALL_GEO.hidden, dtype=np.float32).reshape(3, SMALL_GEO.hidden)
    signed = np.array([[0, 1, 2], [2, 3, 5], [4, 5, 3]], np.int64)  # unsigned ids have no "no expert"
    idx = signed.astype(dtype)
    launches = launch_log(monkeypatch)
    be.device.capturing_now = True
    for doing, call in (("dispatch", lambda: buf.dispatch(x, idx, cpu_sync=False)),
                        ("get_dispatch_layout", lambda: buf.get_dispatch_layout(idx))):
        with pytest.raises(RuntimeError, match=re.escape(
                f"topk_idx has dtype {np.dtype(dtype)}: a {doing} captured into a CUDA graph needs signed expert ids "
                "(int32 or int64)") + ".* Pass topk_idx as int32 or int64 "):
            call()
    assert launches == [] and be.runner.steps.seq == 0 and int(be.transport.step[0]) == 0, "nothing was enqueued"
    be.device.capturing_now = False
    got, want = buf.dispatch(x, idx), buf.dispatch(x, signed)
    np.testing.assert_array_equal(got.recv_x, want.recv_x)
    np.testing.assert_array_equal(got.recv_topk_idx, want.recv_topk_idx)
    buf.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_captured_dispatch_with_a_bad_routing_is_reported_by_the_next_call_and_receives_nothing():
    """The bad id is read as "no expert" (nothing written out of bounds), and the verdict that travels with the
    count exchange empties the receive: only the -1 tails of the worst-case outputs are written."""
    geo = SMALL_GEO
    be = simulated_backend(geo, True, False)
    x = np.arange(3 * geo.hidden, dtype=np.float32).reshape(3, geo.hidden)
    bad = SMALL_IDX.copy()
    bad[1, 1] = 40  # past the 6 experts: read as "no expert" by the kernels
    be.device.capturing_now = True
    with be.captured_memory():
        assert be.routing_summary(bad) == (-1, -1)  # nothing can be read back under capture
        captured = dispatch(be, x, bad, None, None, False, 1, False, False, None)
    be.device.capturing_now = False
    assert be.runner.capture.held, "the captured call's allocations are held for the graph"
    with pytest.raises(ValueError, match="replayed from a CUDA graph was given a topk_idx holding expert id 40"):
        dispatch(be, x, None, None, captured.handle, False, 1, False, False, None)
    assert not be.runner.steps.unusable
    assert (captured.recv_topk_idx == -1).all() and (captured.handle.recv_src_metadata == -1).all()
    assert be.routing_summary(SMALL_IDX) == (5, -1)  # reported once: the record was cleared


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("use_puts", [False, True])
def test_a_captured_cached_dispatch_and_combine_give_the_eager_results(expand, use_puts):
    """Over stores or puts alike: every launch reads the step from the device counter."""
    be, x, first, eager, eager_sum = eager_replay(expand, seed=3, use_puts=use_puts)
    be.device.capturing_now = True
    captured = dispatch(be, x * 2, None, None, first.handle, expand, 2, True, False, None)
    captured_sum = combine(be, captured.recv_x, captured.handle, None, ())
    be.device.capturing_now = False
    assert_same_as_eager(first, eager, eager_sum, captured, captured_sum)
    np.testing.assert_array_equal(captured.handle.num_recv_tokens_per_expert, first.handle.num_recv_tokens_per_expert)
    assert int(captured.handle.num_expanded_tokens) == int(first.handle.num_expanded_tokens)
    be.close()
    assert not be.runner.capture.held
