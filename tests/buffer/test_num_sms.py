"""``Buffer(num_sms=...)`` in one process: the argument's rules, the mpi backend ignoring it, and how the
nvshmem backend turns it into the kernels' grids (the GPU itself is exercised by
``tests/mpi/test_num_sms_collective.py`` under ``--backend nvshmem``)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

import ep_comm
from ep_comm.backends.sm_grid import grid_shape, sms_in_effect
from ep_comm.contract.checks import check_num_sms, check_num_sms_fits
from ep_comm.testing.routing import uniform_routing

SHAPE = dict(num_experts=8, hidden=16, num_topk=2, num_max_tokens_per_rank=8, dtype="float32")


@pytest.mark.parametrize("bad", [0, -1, np.int32(0)])
def test_num_sms_below_one_is_a_value_error(bad):
    with pytest.raises(ValueError, match="^" + re.escape(f"num_sms={bad!r}: must be an integer >= 1 or None")):
        check_num_sms(bad)


@pytest.mark.parametrize("bad", [True, False, 1.0, "16", [16]])
def test_num_sms_of_another_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"^num_sms=.*: must be an integer >= 1 or None .*got "):
        check_num_sms(bad)


@pytest.mark.parametrize("good", [None, 1, 16, np.int64(132)])
def test_good_num_sms_passes(good):
    check_num_sms(good)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (True, TypeError), (2.5, TypeError)])
def test_buffer_refuses_bad_num_sms_before_building_a_backend(bad, exc):
    with pytest.raises(exc, match="num_sms"):
        ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", num_sms=bad)


def test_mpi_backend_accepts_num_sms_and_round_trips():
    with ep_comm.Buffer(MPI.COMM_SELF, **SHAPE, backend="mpi", num_sms=16) as buf:
        assert buf.num_sms is None, "the mpi backend has no kernels: num_sms has no effect"
        routing = uniform_routing(8, 8, 2, seed=(0, 0))
        x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
        out = buf.dispatch(x, routing.topk_idx, routing.topk_weights, expand=True)
        res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
        np.testing.assert_allclose(res.x, x, rtol=1e-6, atol=1e-6)


def test_num_sms_must_fit_every_ranks_gpu():
    check_num_sms_fits(None, [132, 132])
    check_num_sms_fits(132, [132, 132])
    with pytest.raises(ValueError, match=r"^num_sms=133: must not exceed the GPU's SM count; rank 0's GPU has 132"):
        check_num_sms_fits(133, [132, 132])
    with pytest.raises(ValueError, match=r"rank 1's GPU has 114 SMs"):
        check_num_sms_fits(120, [132, 114])


def test_sms_in_effect_defaults_to_the_device():
    assert sms_in_effect(MPI.COMM_SELF, None, 132) == 132
    assert sms_in_effect(MPI.COMM_SELF, 16, 132) == 16
    with pytest.raises(ValueError, match="num_sms=200"):
        sms_in_effect(MPI.COMM_SELF, 200, 132)


def test_grid_shape_keeps_todays_launch_at_all_sms_of_an_h200():
    assert grid_shape(132) == {"num_blocks": 264, "stream_blocks": 1056}
    assert grid_shape(16) == {"num_blocks": 32, "stream_blocks": 128}
    kernels_api = pytest.importorskip("ep_comm.launching.kernel_launches")
    default = kernels_api.Kernels(np, num_ranks=2, num_experts=8, num_topk=2, max_tokens=8)
    sized = kernels_api.Kernels(np, num_ranks=2, num_experts=8, num_topk=2, max_tokens=8, **grid_shape(132))
    assert (sized.num_blocks, sized.stream_blocks, sized.recv_units) == \
        (default.num_blocks, default.stream_blocks, default.recv_units)
