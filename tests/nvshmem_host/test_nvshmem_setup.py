"""Opening the nvshmem backend, without a GPU: the heap size it asks NVSHMEM for, the device each rank picks, what
it refuses before allocating anything (a missing GPU stack, indices past 32 bits, arrays on another GPU), and the
fake GPU's backend (``helpers.fake_gpu``) being a ``Backend`` that names its transport."""

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, simulated_backend
from mpi4py import MPI

from ep_comm.backends import make_backend
from ep_comm.backends.interface import Backend, BackendSettings, OperationRows, Traffic
from ep_comm.backends.nvshmem import NvshmemBackend
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.transport.nvshmem_heap import HEAP_ENV, heap_size_for, parse_size, pick_device


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


def test_nvshmem_backend_without_gpu_stack_names_what_is_missing():
    try:
        import cupy  # noqa: F401
        import nvshmem.core  # noqa: F401

        pytest.skip("the GPU stack is installed here")
    except ImportError:
        pass
    geo = Geometry(1, 2, 8, 1, 4, payload_dtype("float32"))
    with pytest.raises(RuntimeError, match="backend='nvshmem' needs CuPy and nvshmem4py"):
        make_backend("nvshmem", MPI.COMM_SELF, geo, BackendSettings(True, 1.0))


def test_open_refuses_indices_past_32_bits_before_allocating_anything():
    """The kernels index in 32 bits: a geometry past that is refused before the collective heap allocation."""
    def allocate(*args, **kwargs):
        raise AssertionError("the transport was built before the index range was checked")

    geo = Geometry(1024, 1024, 8, 6, 2**17, payload_dtype("bfloat16"))
    with pytest.raises(ValueError, match=r"= 1024 \* 131072 \* \(6 \+ 2\) = 1073741824: must be below 2\*\*30"):
        NvshmemBackend.open(MPI.COMM_SELF, geo, BackendSettings(True, 1.0), allocate, allocate)


def test_open_frees_its_communicator_when_the_transport_cannot_be_built():
    """A transport that raises (the heap refused, NVSHMEM not initialised) leaves no duplicated communicator."""
    duplicates = []

    class Comm:
        size, rank = 1, 0

        def Dup(self):
            duplicates.append(MPI.COMM_SELF.Dup())
            return duplicates[-1]

    def no_heap(*args, **kwargs):
        raise RuntimeError("nvshmem_malloc failed")

    with pytest.raises(RuntimeError, match="nvshmem_malloc failed"):
        NvshmemBackend.open(Comm(), SMALL_GEO, BackendSettings(True, 1.0), no_heap, no_heap)
    assert len(duplicates) == 1 and duplicates[0] == MPI.COMM_NULL, "the duplicated communicator was not freed"


class _OnGpu1(np.ndarray):
    """A device array that says it lives on GPU 1 (as a CuPy array there would)."""

    device = type("Gpu1", (), {"id": 1})()


def test_arrays_on_another_gpu_are_refused_naming_both_gpus():
    be = simulated_backend(Geometry(1, 6, 12, 3, 9, payload_dtype("float32")), False, False)
    be.transport.device = 0
    with pytest.raises(ValueError, match=r"x is on GPU 1: this rank's Buffer works on GPU 0"):
        be.as_array(np.zeros((2, 12), np.float32).view(_OnGpu1), "x")
    mine = np.zeros((2, 12), np.float32)
    assert be.as_array(mine, "x") is mine


def test_the_simulated_nvshmem_backend_is_a_backend_with_its_transport_named():
    stores = simulated_backend(SMALL_GEO, False, False)
    puts = simulated_backend(SMALL_GEO, False, True)
    assert isinstance(stores, Backend) and isinstance(puts, Backend)
    assert (stores.transport_name, puts.transport_name, stores.num_sms) == ("stores", "puts", 1)
    assert stores.traffic() == puts.traffic() == Traffic(OperationRows(0, 0)), "one node: no scale-out rows"
