"""Random sequences of eager calls on one Buffer (``helpers.call_sequences``), collective: every rank runs the same
drawn sequence with its own tokens on a Buffer of the session's backend, and again with every input C-contiguous and
no two inputs sharing bytes on a fresh Buffer; every output must have the same bytes. On nvshmem (the GPU) the later
calls of a shape replay recorded launches and take the prepared path: this holds them to the calls of plain layouts.

Collective Hypothesis as in ``test_randomized.py``: ``derandomize=True`` (every rank draws the same sequences, checked
by an allgather), and an example's failure on any rank fails it on every rank (``fail_together``).
"""
from __future__ import annotations

import pytest
from helpers.call_sequences import run_sequence, sequences
from helpers.collective import agree_on, fail_together, make_buffer, to_device
from helpers.oracle import RANK, make_world
from helpers.same_outputs import assert_same_outputs
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.mpi


@settings(derandomize=True, suppress_health_check=list(HealthCheck), print_blob=False)  # examples: the profile's
@given(sequence=sequences)
def test_a_random_sequence_of_calls_gives_the_bytes_of_its_plain_layouts(sequence):
    agree_on(sequence)
    world = make_world("uniform", hidden=12, num_topk=3, max_tokens=3, dtype="float32")

    def body() -> None:
        with make_buffer(world) as buf, make_buffer(world) as fresh:
            got = run_sequence(buf, sequence, RANK, to_device)
            want = run_sequence(fresh, sequence, RANK, to_device, apart=True)
        assert_same_outputs(want, got)

    fail_together(body)
