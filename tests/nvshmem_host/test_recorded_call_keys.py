"""A recorded call's key holds everything its launches depend on: here the 16-byte start of the payload (``x``) and
of the combine's ``y``, which decides the rows' copy width (``ep_comm._launcher.device_arrays.aligned16``). On a GPU
a later call of a key replays the first call's launches, scalars included; ``helpers.fake_gpu.RootCheckingCalls``
asserts in the simulator that every call of a key makes the same launches with the same scalars."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, combine, dispatch, simulated_backend

from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.launching.fp8 import payload_key

pytestmark = pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")


def _rows(num_tokens: int, hidden: int, offset_words: int, seed: int) -> np.ndarray:
    """float32 ``[num_tokens, hidden]`` random rows whose data start ``offset_words`` float32 words into an
    allocation (NumPy's allocations start on 16 bytes: 2 words give an 8-byte, not 16-byte, start)."""
    base = np.empty(num_tokens * hidden + 4, np.float32)
    rows = base[offset_words:offset_words + num_tokens * hidden].reshape(num_tokens, hidden)
    rows[:] = np.random.default_rng(seed).standard_normal((num_tokens, hidden))
    return rows


def test_the_payload_key_tells_a_16_byte_start_from_an_8_byte_one():
    aligned, shifted = _rows(3, SMALL_GEO.hidden, 0, 1), _rows(3, SMALL_GEO.hidden, 2, 1)
    assert payload_key(aligned) != payload_key(shifted)
    assert payload_key(aligned) == payload_key(_rows(3, SMALL_GEO.hidden, 4, 2))  # 16 bytes in: the same launches


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("first_offset, second_offset", [(0, 2), (2, 0)], ids=["aligned-then-shifted", "shifted-then-aligned"])
def test_calls_of_one_shape_with_payloads_on_different_16_byte_starts_round_trip_exactly(expand, first_offset,
                                                                                       second_offset):
    """Dispatch and combine of one call shape, the payload once on a 16-byte start and once 8 bytes past one: each
    call's rows arrive and come back exactly (the simulator's recorded calls assert that no key is replayed with
    another copy width)."""
    be = simulated_backend(SMALL_GEO, True, False)
    for seed, offset in enumerate((first_offset, second_offset)):
        x = _rows(3, SMALL_GEO.hidden, offset, seed)
        out = dispatch(be, x, SMALL_IDX, None, None, expand, 1, True, True, None)
        y = _rows(*out.recv_x.shape, offset, seed + 10)
        y[:] = out.recv_x
        back = combine(be, y, out.handle, None, ())
        np.testing.assert_array_equal(back.x, _combined(x, expand))


def _combined(x: np.ndarray, expand: bool) -> np.ndarray:
    """The combine of ``y = recv_x`` at one rank: compact sends one row per token (taken once), expand one per
    (token, expert), summed in float32 from zero in top-k order."""
    if not expand:
        return x
    total = np.zeros_like(x)
    for k in range(SMALL_IDX.shape[1]):
        total += np.where(SMALL_IDX[:, k:k + 1] >= 0, x, np.float32(0))
    return total
