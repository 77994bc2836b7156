"""The nvshmem backend's whole call sequence without a GPU (kernels in the Numba CUDA simulator, a loopback transport
on one rank) against the mpi backend, bit for bit, for peer stores and for the puts staging layout; strided inputs;
and its profile table."""

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, simulated_backend
from helpers.same_outputs import assert_same, assert_same_dispatch
from mpi4py import MPI

from ep_comm.backends.interface import BackendSettings
from ep_comm.backends.mpi import MpiBackend
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.testing.routing import mask_routing, uniform_routing

CASES = [  # dtype, expand, alignment, cpu_sync, weighted, bias terms, use_puts
    ("bfloat16", False, 1, True, True, 2, False),
    ("float32", True, 4, True, True, 0, False),
    ("float16", True, 2, False, False, 1, False),
    ("bfloat16", False, 1, False, False, 0, True),
    ("bfloat16", True, 3, True, True, 0, True),
]


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("dtype, expand, alignment, cpu_sync, weighted, bias, use_puts", CASES)
def test_call_sequence_matches_the_mpi_backend(dtype, expand, alignment, cpu_sync, weighted, bias, use_puts):
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype(dtype))
    rng = np.random.default_rng(hash((dtype, expand, alignment)) % 1000)
    tokens = 7
    idx = mask_routing(uniform_routing(tokens, geo.num_experts, geo.num_topk, seed=rng).topk_idx, rng,
                       entry_rate=0.25, first_tokens=1)
    x = rng.standard_normal((tokens, geo.hidden)).astype(geo.dtype)
    w = rng.random((tokens, geo.num_topk)).astype(np.float32) if weighted else None
    terms = tuple(rng.standard_normal((tokens, geo.hidden)).astype(np.float32) for _ in range(bias))
    mpi = MpiBackend(MPI.COMM_SELF, geo, BackendSettings(True, 5.0))
    nv = simulated_backend(geo, True, use_puts)
    stats_m, stats_n = np.zeros(6, np.int64), np.zeros(6, np.int64)
    for got, want in zip(nv.dispatch_layout(idx), mpi.dispatch_layout(idx)):
        assert_same("dispatch_layout", want, got)
    args = (expand, alignment, True, cpu_sync)
    om = dispatch(mpi, x, idx, w, None, *args, stats_m)
    on = dispatch(nv, x, idx, w, None, *args, stats_n)
    assert_same_dispatch("dispatch", om, on)
    x2 = (x.astype(np.float32) * 2 + 1).astype(x.dtype)
    for replay_sync in (True, False):  # a cached dispatch, with the same and the other cpu_sync
        rm = dispatch(mpi, x2, None, w, om.handle, *args[:3], replay_sync, stats_m)
        rn = dispatch(nv, x2, None, w, on.handle, *args[:3], replay_sync, stats_n)
        assert_same_dispatch(f"replay cpu_sync={replay_sync}", rm, rn)
    assert_same("stats", stats_m, stats_n)
    for om_, on_ in ((om, on), (rm, rn)):
        yw_m = om_.recv_topk_weights if weighted else None
        yw_n = on_.recv_topk_weights if weighted else None
        cm = combine(mpi, om_.recv_x, om_.handle, yw_m, terms)
        cn = combine(nv, on_.recv_x, on_.handle, yw_n, terms)
        assert_same("combine.x", cm.x, cn.x)
        assert_same("combine.topk_weights", cm.topk_weights, cn.topk_weights)
    nv.close()
    mpi.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True])
def test_non_contiguous_inputs_give_the_results_of_contiguous_ones(expand):
    """Strided views and Fortran-order arrays (as slicing or a transpose hands them over) are read as
    the arrays they show: x, topk_idx, topk_weights, the combine's y and its weights."""
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))
    rng = np.random.default_rng(21)
    wide_x = rng.standard_normal((4, 2 * geo.hidden)).astype(np.float32)
    x = wide_x[:, ::2]
    idx = np.asfortranarray(np.array([[0, 4, -1], [5, 1, 2], [-1, -1, 3], [2, 0, 5]], np.int64))
    w = rng.random((4, 2 * geo.num_topk)).astype(np.float32)[:, 1::2]
    assert not (x.flags.c_contiguous or idx.flags.c_contiguous or w.flags.c_contiguous)
    args = (expand, 2, True, True, None)
    want_be, got_be = simulated_backend(geo, True, False), simulated_backend(geo, True, False)
    want = dispatch(want_be, np.ascontiguousarray(x), np.ascontiguousarray(idx), np.ascontiguousarray(w), None, *args)
    got = dispatch(got_be, x, idx, w, None, *args)
    assert_same_dispatch("non-contiguous dispatch", want, got)
    y = np.repeat(got.recv_x, 2, axis=1)[:, ::2]
    y_weights = np.repeat(got.recv_topk_weights, 2, axis=-1)[..., ::2]
    want_sum = combine(want_be, want.recv_x, want.handle, want.recv_topk_weights, ())
    got_sum = combine(got_be, y, got.handle, y_weights, ())
    assert_same("non-contiguous combine.x", want_sum.x, got_sum.x)
    assert_same("non-contiguous combine.topk_weights", want_sum.topk_weights, got_sum.topk_weights)


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_the_nvshmem_profile_table_times_every_phase_of_the_call_sequence():
    be = simulated_backend(SMALL_GEO, True, False, profile=True)
    x = np.ones((3, SMALL_GEO.hidden), np.float32)
    out = dispatch(be, x, SMALL_IDX, None, None, False, 1, False, True, None)
    dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    combine(be, out.recv_x, out.handle, None, ())
    rows = {(row.op, row.phase): row for row in be.profile_table()}
    assert rows["dispatch", "total"].calls == 2 and rows["dispatch", "count"].calls == 1
    assert {("dispatch", p) for p in ("scatter", "signal+wait", "receive_count", "host sync", "alloc outputs",
                                      "receive_copy")} <= set(rows)
    assert {("combine", p) for p in ("total", "send", "signal+wait", "reduce", "host sync")} <= set(rows)
    assert all(row.host_us_p50 > 0 and row.gpu_us_p50 is None for row in rows.values())  # no events on the host
    be.close()
