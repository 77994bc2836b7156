"""Host-side logic of the nvshmem backend that runs without a GPU: heap sizing, device choice,
copy widths, wait-status decoding, and the error when the GPU stack is missing."""
import numpy as np
import pytest
from mpi4py import MPI

from ep_comm.backends import make_backend
from ep_comm.dtypes import payload_dtype
from ep_comm.transport.gpu_copy import STATUS_FLAGS, copy_unit, read_status
from ep_comm.transport.nvshmem_heap import HEAP_ENV, env_flag, heap_size_for, parse_size, pick_device
from ep_comm.validate import Geometry


@pytest.mark.parametrize("text, value", [("1024", 1024), ("20m", 20 << 20), ("2G", 2 << 30), ("0.5k", 512),
                                         ("3.1M", 3250586), (" 1t ", 1 << 40)])
def test_parse_size_follows_nvshmem_suffixes(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage_naming_the_variable():
    with pytest.raises(ValueError, match=HEAP_ENV):
        parse_size("lots")


def test_heap_size_default_is_at_least_nvshmem_default_and_fits_the_buffer():
    size, export = heap_size_for(10 << 20, None)
    assert export and size == 1 << 30
    size, export = heap_size_for(3 << 30, None)
    assert export and size >= (3 << 30) + (64 << 20) and size % (2 << 20) == 0


def test_heap_size_keeps_a_user_value_that_fits_and_refuses_one_that_does_not():
    assert heap_size_for(100 << 20, "4g") == (4 << 30, False)
    with pytest.raises(ValueError, match=f"{HEAP_ENV}='200m'.*too small"):
        heap_size_for(300 << 20, "200m")


@pytest.mark.parametrize("local_rank, visible, device", [(0, 1, 0), (5, 1, 0), (3, 8, 3), (9, 8, 1), (1, 2, 1)])
def test_pick_device_by_local_rank_unless_one_device_is_visible(local_rank, visible, device):
    assert pick_device(local_rank, visible) == device


def test_pick_device_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        pick_device(0, 0)


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                             ("no", False)])
def test_env_flag(monkeypatch, value, expected):
    monkeypatch.setenv("EP_COMM_TEST_FLAG", value)
    assert env_flag("EP_COMM_TEST_FLAG") is expected


@pytest.mark.parametrize("row_bytes, others, unit", [(14336, (0, 128, 14336), 16), (80, (8, 80), 8), (12, (0,), 4),
                                                     (6, (2,), 2), (7, (0,), 1), (32, (4,), 4)])
def test_copy_unit_is_the_widest_dividing_everything(row_bytes, others, unit):
    assert copy_unit(row_bytes, *others) == unit


def test_read_status_reports_sticky_missing_ranks():
    words = [13, 0, 0, 0, 0]
    assert read_status(words, 3).missing_ranks == [] and read_status(words, 3).last_seq == 13
    words = [17, 2, 1, 0, 1]
    assert read_status(words, 3).missing_ranks == [0, 2]
    assert STATUS_FLAGS == 2


def test_nvshmem_backend_without_gpu_stack_names_what_is_missing():
    try:
        import cupy  # noqa: F401
        import nvshmem.core  # noqa: F401

        pytest.skip("the GPU stack is installed here")
    except ImportError:
        pass
    geo = Geometry(1, 2, 8, 1, 4, payload_dtype("float32"))
    with pytest.raises(RuntimeError, match="backend='nvshmem' needs CuPy and nvshmem4py"):
        make_backend("nvshmem", MPI.COMM_SELF, geo, True, 1.0)


def test_signal_kinds_make_close_wait_for_close():
    from ep_comm.backends import nvshmem as nv

    kinds = nv._SIGNAL_KIND
    assert kinds["close"] > max(kinds["dispatch"], kinds["combine"]) and max(kinds.values()) < 4
    assert np.all(np.diff(sorted(kinds.values())) > 0)


def _numpy_backend(num_ranks: int, num_experts: int, num_topk: int, max_tokens: int, rank: int):
    """The nvshmem backend's index math with NumPy standing in for CuPy (no GPU, no heap)."""
    from ep_comm.backends.nvshmem import NvshmemBackend
    from ep_comm.symmetric import SymmetricLayout

    be = object.__new__(NvshmemBackend)
    be._cp = np
    be.geo = Geometry(num_ranks, num_experts, 8, num_topk, max_tokens, payload_dtype("float32"))
    be.rank = rank
    be.sym = SymmetricLayout(num_ranks, max_tokens, 8, num_topk, 4)
    return be


@pytest.mark.parametrize("seed", range(20))
def test_device_index_math_equals_the_reference_layout(seed):
    from ep_comm import layout as lay

    rng = np.random.default_rng(seed)
    ranks, local, max_tokens = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 12
    experts, topk = ranks * local, int(rng.integers(1, min(ranks * local, 4) + 1))
    tokens, me = int(rng.integers(0, max_tokens + 1)), int(rng.integers(0, ranks))
    be = _numpy_backend(ranks, experts, topk, max_tokens, me)
    idx = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)]).astype(np.int64) \
        if tokens else np.zeros((0, topk), np.int64)
    idx[rng.random(idx.shape) < 0.3] = -1
    entry_ranks = be._entry_ranks(idx)
    in_rank = be._in_rank(entry_ranks)
    np.testing.assert_array_equal(in_rank, lay.is_token_in_rank(idx, experts, ranks))
    slots = be._stable_slots(in_rank)
    np.testing.assert_array_equal(slots, lay.stable_rank_slots(in_rank))
    slot_idx = be._slot_idx(entry_ranks, slots)
    np.testing.assert_array_equal(slot_idx, lay.dst_buffer_slot_idx(idx, slots, me, local, max_tokens))

    class Replay:
        num_tokens, topk_idx, dst_buffer_slot_idx = tokens, idx, slot_idx

    np.testing.assert_array_equal(be._slots_from_handle(Replay), slots)
    meta = be._dispatch_meta(idx, rng.random(idx.shape).astype(np.float32))
    for r in range(ranks):
        np.testing.assert_array_equal(meta[:, r, 1 : 1 + topk], lay.local_topk(idx, r, local))
    for got, want in zip(be.dispatch_layout(idx), lay.dispatch_layout(idx, experts, ranks)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("expand, alignment", [(False, 1), (False, 3), (True, 1), (True, 4)])
def test_device_receive_layout_equals_the_reference(expand, alignment):
    from ep_comm import layout as lay

    rng = np.random.default_rng(alignment + 10 * expand)
    num_local, topk = 4, 3
    be = _numpy_backend(2, 2 * num_local, topk, 16, 0)
    ids = np.stack([np.where(rng.random(topk) < 0.6, rng.permutation(num_local)[:topk], -1) for _ in range(30)])
    unaligned, aligned, psum, num_expanded, expanded_row = be._expert_layout(ids.astype(np.int64), alignment, expand)
    ref = lay.receive_layout(ids, num_local, alignment, expand)
    np.testing.assert_array_equal(unaligned, ref.num_unaligned_per_expert)
    np.testing.assert_array_equal(aligned, ref.num_aligned_per_expert)
    np.testing.assert_array_equal(psum, ref.psum_per_expert)
    assert int(num_expanded) == ref.num_expanded_tokens
    if expand:
        np.testing.assert_array_equal(expanded_row, ref.expanded_row)
