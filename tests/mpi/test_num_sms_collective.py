"""``Buffer(num_sms=...)``: bad values are refused naming the argument; a good one works on every backend.

Collective like the rest of ``tests/mpi``: every rank passes the same value. On ``mpi`` the knob is
accepted and has no effect (``buf.num_sms`` is None); on ``nvshmem`` it sizes the kernels' grids.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers.collective import dispatch, make_buffer
from helpers.contract_checks import check_compact
from helpers.options import current
from helpers.oracle import bits, expected_compact_combine, expected_expand_combine, make_world

from ep_comm.contract.arrays import to_host

pytestmark = pytest.mark.mpi
BACKEND = current().backend


@pytest.fixture(scope="module")
def world():
    return make_world("uniform", dtype="float32")


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-3, ValueError), (True, TypeError), (16.0, TypeError),
                                      ("16", TypeError), (np.float32(8), TypeError)])
def test_bad_num_sms_is_refused_naming_it(world, bad, exc):
    with pytest.raises(exc) as info:
        make_buffer(world, num_sms=bad)
    message = str(info.value)
    assert message.startswith(f"num_sms={bad!r}") and ">= 1" in message


# at most 8: ranks sharing a GPU under CUDA MPS see a share of its SMs (8 ranks on an H200: 14)
@pytest.mark.parametrize("num_sms", [1, 8, np.int64(8)])
def test_a_good_num_sms_gives_the_contract_results(world, num_sms):
    with make_buffer(world, num_sms=num_sms) as buf:
        assert buf.num_sms == (None if BACKEND == "mpi" else int(num_sms))
        assert buf.num_sms is None or isinstance(buf.num_sms, int)
        out = dispatch(buf, world)
        check_compact(world, out, deterministic=True)
        res = buf.combine(out.recv_x, out.handle)
        assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()
        out = dispatch(buf, world, expand=True, expert_alignment=4)
        res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
        assert bits(to_host(res.x)).tobytes() == bits(expected_expand_combine(world, weighted=True)).tobytes()


def test_default_num_sms_is_every_sm_of_the_device(world):
    with make_buffer(world) as buf:
        if BACKEND == "mpi":
            assert buf.num_sms is None
        else:
            import cupy

            assert buf.num_sms == cupy.cuda.Device().attributes["MultiProcessorCount"]


def test_num_sms_above_the_device_is_refused_on_nvshmem_and_ignored_on_mpi(world):
    too_many = 1 << 20
    if BACKEND == "mpi":
        with make_buffer(world, num_sms=too_many) as buf:
            assert buf.num_sms is None
            res = buf.combine(*_recv_and_handle(buf, world))
    else:
        with pytest.raises(ValueError, match=rf"num_sms={too_many}: must not exceed the GPU's SM count"):
            make_buffer(world, num_sms=too_many)
        with make_buffer(world) as buf:  # the refused Buffer released its memory and its steps
            res = buf.combine(*_recv_and_handle(buf, world))
    assert bits(to_host(res.x)).tobytes() == bits(expected_compact_combine(world)).tobytes()


def _recv_and_handle(buf, world):
    out = dispatch(buf, world)
    return out.recv_x, out.handle
