"""What the simulated nvshmem backend launches (kernels in the Numba CUDA simulator, a loopback transport on one
rank): the same launches at every step (what a CUDA graph replay relies on), a new routing's count exchange, and the
views of the symmetric rows made once per buffer."""

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, launch_log, simulated_backend

from ep_comm.contract import layout as ref
from ep_comm.contract.checks import topk_values, verdict_words
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [True, False], ids=["expand", "compact"])
def test_the_launches_of_a_step_do_not_depend_on_the_step_number(monkeypatch, expand):
    """What a CUDA graph replay relies on: a cached dispatch launches the same kernels with the same
    shapes and scalars at an even step as at an odd one, and so does a combine (the buffer parity
    comes from the device step counter). Compact mode writes the rank's own rows straight into
    ``recv_x`` and reads its own partials from ``y``: the same at every step too."""
    be = simulated_backend(SMALL_GEO, True, False)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    first = dispatch(be, x, SMALL_IDX, None, None, expand, 2 if expand else 1, False, False, None)
    log = launch_log(monkeypatch)

    def launches(call) -> list:
        start = len(log)
        call()
        return log[start:]

    dispatches = [launches(lambda: dispatch(be, x, None, None, first.handle, expand, 2 if expand else 1, False,
                                            False, None))
                  for _ in range(2)]
    combines = [launches(lambda: combine(be, first.recv_x, first.handle, None, ())) for _ in range(2)]
    assert dispatches[0] and dispatches[0] == dispatches[1]
    assert combines[0] and combines[0] == combines[1]
    assert int(be.transport.step[0]) == 5


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_new_routing_exchanges_counts_per_local_expert_and_compact_counts_from_them_alone(monkeypatch, expand):
    """A new routing's count exchange leaves, per source, its rows then its entries per local expert (the
    reference's ``send_count_words``), then its routing verdict's words, in the count words of the step's
    parity; a compact receive (``cpu_sync=False``) counts from
    those words alone in its copy's launch (``receive_counted_compact_kernel``, no scan of the meta rows, no launch of
    its own), an expand one scans the meta rows (``receive_count_kernel``); the launches are the same at an odd step
    as at an even one."""
    be = simulated_backend(SMALL_GEO, True, False)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    counts = ref.send_count_words(ref.dispatch_layout(SMALL_IDX, SMALL_GEO.num_experts, 1))
    want = np.append(counts, [verdict_words(*topk_values(np, SMALL_IDX))], axis=1)
    log = launch_log(monkeypatch)
    steps = []
    for _ in range(2):
        start = len(log)
        dispatch(be, x, SMALL_IDX, None, None, expand, 2, False, False, None)
        steps.append(log[start:])
        np.testing.assert_array_equal(be.transport.own.counts[int(be.transport.step[0]) % 2], want)
    names = {launch[0] for launch in steps[0]}
    assert ("receive_counted_compact_kernel" in names) != expand and ("receive_count_kernel" in names) == expand
    assert "receive_count_words_kernel" not in names
    assert steps[0] == steps[1]
    be.close()


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_cached_pair_decides_on_the_symmetric_rows_once_per_buffer(monkeypatch, expand):
    """The 16-byte verdict (``wide_rows``) and the payload views of the Buffer's symmetric rows are made by the
    first calls and reused by every later cached dispatch and combine (launches stubbed: host work only)."""
    from ep_comm._launcher import prebound
    from ep_comm.launching import kernel_launches as launching

    geo = Geometry(1, 6, 16, 3, 9, payload_dtype("bfloat16"))
    be = simulated_backend(geo, True, False)
    monkeypatch.setattr(prebound.PreboundKernel, "__call__", lambda self, *args: None)
    seen = []
    for name in ("wide_rows", "payload_rows"):
        made = getattr(launching, name)
        monkeypatch.setattr(launching, name, lambda *args, made=made: seen.append(args) or made(*args))
    symmetric = {id(a) for a in (*be.transport.rows, be.ctx.own_rows)}

    def on_symmetric_rows() -> int:
        """How many calls so far were made on the symmetric rows."""
        return sum(any(id(a) in symmetric for a in args) for args in seen)

    x = np.ones((3, geo.hidden), geo.dtype)
    first = dispatch(be, x, SMALL_IDX, None, None, expand, 1, False, False, None)
    combine(be, first.recv_x, first.handle, None, ())
    made = on_symmetric_rows()
    assert made > 0
    for _ in range(2):
        out = dispatch(be, x, None, None, first.handle, expand, 1, False, False, None)
        combine(be, out.recv_x, out.handle, None, ())
    assert on_symmetric_rows() == made and len(seen) > made
