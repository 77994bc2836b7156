"""Input layouts changing between calls of one shape, and masked ids written as any negative value, on the nvshmem
backend over the fake GPU (kernels in the CUDA simulator), against the mpi backend at one rank.

The simulator runs every launch, but its recorded calls are in check mode (``helpers.fake_gpu.RootCheckingCalls``):
each call of a recorded call's lookup key (the production one) must make the launches of its first call, with the
same words but for its roots' pointers, as a replay on a GPU would. So a key that left out a layout shows here as a
failed check, and a wrong result as different bytes. The sequences and their own assertions: ``helpers.layouts``."""
import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, simulated_buffer
from helpers.layouts import bias_pair_sequence, layout_sequence, negative_id_sequence
from helpers.same_outputs import assert_same_outputs
from mpi4py import MPI

import ep_comm
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")


def _mpi_buffer() -> ep_comm.Buffer:
    """The mpi backend's Buffer of ``SMALL_GEO`` at one rank (the reference)."""
    return ep_comm.Buffer(MPI.COMM_SELF, num_experts=SMALL_GEO.num_experts, hidden=SMALL_GEO.hidden,
                          num_topk=SMALL_GEO.num_topk, num_max_tokens_per_rank=SMALL_GEO.max_tokens,
                          dtype="float32", deterministic=True, backend="mpi")


def _inputs() -> tuple:
    """``(x [3, H], topk_idx, topk_weights [3, K], bias [3, H])`` C-contiguous, ``SMALL_IDX``'s routing."""
    rng = np.random.default_rng(45)
    x, bias = (rng.standard_normal((3, SMALL_GEO.hidden)).astype(np.float32) for _ in range(2))
    return x, SMALL_IDX, rng.random((3, SMALL_GEO.num_topk)).astype(np.float32), bias


@pytest.mark.parametrize("expand, cpu_sync", [(False, True), (True, False)], ids=["compact-cpu_sync", "expand-no_sync"])
def test_layouts_changing_between_calls_of_one_shape(expand, cpu_sync):
    assert_same_outputs(layout_sequence(_mpi_buffer(), _inputs(), expand, cpu_sync),
                         layout_sequence(simulated_buffer(), _inputs(), expand, cpu_sync))


@pytest.mark.parametrize("dtype, expand", [("int64", False), ("int32", True)])
def test_negative_ids_of_any_value(dtype, expand):
    x, _, weights, _ = _inputs()
    runs = [negative_id_sequence(buf, x, SMALL_IDX, weights, dtype, expand, lambda a: a)
            for buf in (_mpi_buffer(), simulated_buffer())]
    assert_same_outputs(*runs)


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_bias_pair_of_one_array_and_then_of_two_combines_each_pair(expand):
    """``bias=(b, b)``, one array twice, then pairs of two arrays (``helpers.layouts.bias_pair_sequence``): each
    combine sums its own pair, with the bytes of the mpi backend at one rank (on a GPU a reduce recorded while both
    slots held ``b`` would put its pointer in both slots of the later calls); the check mode holds every call whose roots
    are apart to the first such call."""
    runs = [bias_pair_sequence(buf, _inputs(), expand, apart=False) for buf in (_mpi_buffer(), simulated_buffer())]
    for want, got in zip(*runs):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(runs[0][1], runs[0][0])  # the pairs give different sums: a misread pair shows
