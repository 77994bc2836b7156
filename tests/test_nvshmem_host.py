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
