"""Random sequences of eager calls on one Buffer (``helpers.call_sequences``) on the simulated nvshmem backend: kernels
in the CUDA simulator, recorded calls in check mode (each call of a key must make its first call's launches but for
its roots' pointers, as a replay on a GPU does); every output must be byte for byte the mpi backend's at one rank for
the same sequence. As many sequences as the Hypothesis profile's examples (``ci``: 150), over stores and over puts."""
import pytest
from helpers.call_sequences import run_sequence, sequences
from helpers.fake_gpu import SMALL_GEO, simulated_buffer
from helpers.same_outputs import assert_same_outputs
from hypothesis import given
from mpi4py import MPI

import ep_comm
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")


def _mpi_buffer() -> ep_comm.Buffer:
    """The mpi backend's Buffer of ``SMALL_GEO`` at one rank (the reference)."""
    return ep_comm.Buffer(MPI.COMM_SELF, num_experts=SMALL_GEO.num_experts, hidden=SMALL_GEO.hidden,
                          num_topk=SMALL_GEO.num_topk, num_max_tokens_per_rank=SMALL_GEO.max_tokens,
                          dtype="float32", deterministic=True, backend="mpi")


@pytest.mark.parametrize("use_puts", [False, True], ids=["stores", "puts"])
@given(sequence=sequences)
def test_a_random_sequence_of_calls_on_one_buffer_gives_the_mpi_backends_bytes(use_puts, sequence):
    with _mpi_buffer() as reference, simulated_buffer(use_puts=use_puts) as simulated:
        assert_same_outputs(run_sequence(reference, sequence), run_sequence(simulated, sequence))
