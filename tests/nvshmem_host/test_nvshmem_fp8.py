"""The ``nvshmem`` backend's FP8 path in the Numba CUDA simulator (one rank, loopback transport): ``pack_fp8`` of the
pair and of ``x`` (``use_fp8=True``) names the arrays the scatter reads (nothing is launched or copied before the
send), and the dispatch of either, new and replayed, stores and puts, is byte for byte the ``mpi`` backend's dispatch
of the packed rows ``ep_comm.contract.fp8.pack(*ep_comm.contract.fp8.quantize(x))``."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.fake_gpu import dispatch, simulated_backend
from helpers.same_outputs import assert_same_dispatch
from mpi4py import MPI

from ep_comm.backends.interface import BackendSettings, DispatchRequest
from ep_comm.backends.mpi import MpiBackend
from ep_comm.contract import fp8
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.launching.fp8 import Fp8Rows
from ep_comm.testing.routing import mask_routing, uniform_routing

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")


@pytest.mark.parametrize("dtype, expand, cpu_sync, use_puts, pair", [
    ("bfloat16", False, True, False, False),
    ("bfloat16", False, True, False, True),
    ("float32", True, True, False, False),
    ("float16", True, False, True, True),
    ("bfloat16", False, False, True, False),
])
def test_fp8_dispatch_matches_the_mpi_backend(dtype, expand, cpu_sync, use_puts, pair):
    geo = Geometry(1, 6, 256, 3, 9, payload_dtype(dtype))
    rng = np.random.default_rng(5)
    idx = mask_routing(uniform_routing(7, geo.num_experts, geo.num_topk, seed=rng).topk_idx, rng, entry_rate=0.25,
                       first_tokens=1)
    x = (rng.standard_normal((7, geo.hidden)) * 10.0 ** rng.integers(-3, 3, size=(7, 1))).astype(geo.dtype)
    mpi = MpiBackend(MPI.COMM_SELF, geo, BackendSettings(True, 5.0))
    nv = simulated_backend(geo, True, use_puts)

    def payloads(values):
        source = tuple(a.view(np.uint8) if a.itemsize == 1 else a for a in fp8.quantize(values)) if pair else values
        sent = nv.pack_fp8(source)
        assert isinstance(sent, Fp8Rows) and sent.cast == (not pair)
        packed = mpi.pack_fp8(source)
        assert packed.tobytes() == fp8.pack(*fp8.quantize(values)).tobytes()
        assert sent.shape == packed.shape == (len(values), fp8.packed_row_bytes(geo.hidden) // geo.dtype.itemsize)
        return packed, sent

    packed, sent = payloads(x)
    args = (expand, 4, True, cpu_sync, None)
    om = dispatch(mpi, packed, idx, None, None, *args)
    on = dispatch(nv, sent, idx, None, None, *args)
    assert on.recv_x.shape[1] == fp8.packed_row_bytes(geo.hidden) // geo.dtype.itemsize
    assert_same_dispatch("dispatch", om, on)
    packed2, sent2 = payloads(x[::-1].copy())
    rm = dispatch(mpi, packed2, None, None, om.handle, *args)
    rn = dispatch(nv, sent2, None, None, on.handle, *args)
    assert_same_dispatch("replay", rm, rn)
    nv.close()
    mpi.close()


def test_a_split_fp8_dispatch_writes_its_rows_in_the_send_half():
    """``dispatch_send`` of the pair (the receive hook's send part): the scatter writes the packed rows from the pair
    in the send half, and the hook receives them as the plain dispatch does."""
    geo = Geometry(1, 6, 256, 3, 9, payload_dtype("bfloat16"))
    rng = np.random.default_rng(6)
    idx = uniform_routing(5, geo.num_experts, geo.num_topk, seed=rng).topk_idx
    x = rng.standard_normal((5, geo.hidden)).astype(geo.dtype)
    q, scales = fp8.quantize(x)
    mpi = MpiBackend(MPI.COMM_SELF, geo, BackendSettings(True, 5.0))
    nv = simulated_backend(geo, True, False)
    om = dispatch(mpi, mpi.pack_fp8((q, scales)), idx, None, None, False, 1, False, True, None)
    half = nv.dispatch_send(DispatchRequest(nv.pack_fp8((q.view(np.uint8), scales)), idx, None, None, False, 1, False,
                                            True, None))
    half.prepare()
    assert_same_dispatch("hooked dispatch", om, half.receive())
    nv.close()
    mpi.close()
