"""Pre-bound launches (``ep_comm.launching.bound``): argument kinds, Numba's parameter ABI, plan binding.

The first tests need no GPU: fake CUDA arrays and a fake dispatcher stand in for CuPy and Numba's
compiled kernel. On a GPU, the parameters of every kernel launch of a small dispatch are compared
with the ones Numba's own launch builds (``_Kernel._prepare_args``).
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from numba.core import types

from ep_comm.launching import bound as bound_module
from ep_comm.launching.bound import BoundLaunch, arg_kind, c_strides, flattener
from ep_comm.numba_internals import ENABLE_CUDASIM as SIMULATED


class FakeCudaArray:
    """A device array known only by its ``__cuda_array_interface__`` (as a PyTorch tensor is)."""

    def __init__(self, ptr: int, shape, dtype, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "strides": strides,
                                         "typestr": np.dtype(dtype).str, "version": 3}


def params_as_ints(params):
    return [p.value if isinstance(p, ctypes._SimpleCData) else p for p in params]


def test_c_strides():
    assert c_strides((3, 4, 5), 2) == (40, 10, 2)
    assert c_strides((0, 7), 8) == (56, 8)
    assert c_strides((), 4) == ()


@pytest.mark.parametrize("shape, strides, layout", [
    ((4, 6), None, (True, False)),
    ((4, 6), (4, 16), (False, True)),
    ((4, 6), (48, 4), (False, False)),  # every other row
    ((5,), None, (True, True)),
])
def test_arg_kind_of_arrays(shape, strides, layout):
    a = FakeCudaArray(4096, shape, np.int32, strides)
    assert arg_kind(a) == ("array", np.dtype(np.int32), len(shape)) + layout


def test_arg_kind_of_scalars_and_tuples():
    a = FakeCudaArray(4096, (3,), np.uint64)
    assert arg_kind(True) == ("scalar", bool)
    assert arg_kind(7) == ("scalar", int)
    assert arg_kind(np.int32(7)) == ("scalar", np.int32)
    assert arg_kind((a, a)) == ("tuple", arg_kind(a), arg_kind(a))
    assert arg_kind("text") is None
    assert arg_kind((a, None)) is None


def test_array_parameters_follow_numbas_abi():
    a = FakeCudaArray(0x7000, (3, 5), np.uint16, (20, 2))
    flat = []
    flattener(types.Array(types.uint16, 2, "A"), arg_kind(a))(a, flat)
    assert flat == [0, 0, 15, 2, 0x7000, 3, 5, 20, 2]  # meminfo, parent, nitems, itemsize, data, shape, strides
    c = FakeCudaArray(0x8000, (2, 4), np.float32)
    flat = []
    flattener(types.Array(types.float32, 2, "C"), arg_kind(c))(c, flat)
    assert flat == [0, 0, 8, 4, 0x8000, 2, 4, 16, 4]


def test_scalar_and_tuple_parameters_follow_numbas_abi():
    a = FakeCudaArray(0x100, (2,), np.int64)
    b = FakeCudaArray(0x200, (2,), np.int64)
    pair = types.UniTuple(types.Array(types.int64, 1, "C"), 2)
    flat = []
    flattener(pair, arg_kind((a, b)))((a, b), flat)
    assert flat == [0, 0, 2, 8, 0x100, 2, 8, 0, 0, 2, 8, 0x200, 2, 8]
    flat = []
    for ty, value in ((types.boolean, True), (types.int64, -3), (types.int32, -5), (types.uint32, 9),
                      (types.float32, 0.5), (types.float64, 0.25)):
        flattener(ty, arg_kind(value))(value, flat)
    assert [type(p) for p in flat] == [bool, int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_double]
    assert params_as_ints(flat) == [True, -3, -5, 9, 0.5, 0.25]


def test_layout_mismatch_or_unknown_types_are_not_bound():
    a = FakeCudaArray(0x100, (4, 6), np.int32, (48, 4))  # not contiguous: Numba types it "A"
    assert flattener(types.Array(types.int32, 2, "C"), arg_kind(a)) is None
    assert flattener(types.complex64, arg_kind(1.0)) is None
    assert flattener(types.int64, arg_kind(a)) is None


class FakeDispatcher:
    """Numba's dispatcher as BoundLaunch uses it: ``[config](*args)``, ``typeof_pyval``, ``overloads``."""

    def __init__(self, overload_flags=None):
        self.numba_launches = []
        self.sig = (types.Array(types.int32, 1, "C"), types.int64, types.boolean)
        flags = {**dict(debug=False, cooperative=False, extensions=[]), **(overload_flags or {})}
        function = SimpleNamespace(kernel="compiled kernel")
        self.overloads = {self.sig: SimpleNamespace(
            _codelibrary=SimpleNamespace(get_cufunc=lambda: function), **flags)}

    def __getitem__(self, config):
        return lambda *args: self.numba_launches.append((config, args))

    def typeof_pyval(self, value):
        return {FakeCudaArray: self.sig[0], int: types.int64, bool: types.boolean}[type(value)]


@pytest.fixture
def fake_core(monkeypatch):
    import cuda.core

    launches = []
    monkeypatch.setattr(cuda.core, "launch", lambda stream, config, kernel, *params: launches.append(
        (stream, config, kernel, params)))
    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **kw: kw)
    monkeypatch.setattr(bound_module.BoundLaunch, "_core_stream", lambda self, stream: f"core({stream})")
    return launches


def test_first_launch_goes_through_numba_then_the_plan_is_used(fake_core):
    dispatcher = FakeDispatcher()
    bound = BoundLaunch(dispatcher, to_numba=lambda a: a)
    x = FakeCudaArray(0x500, (6,), np.int32)
    bound(4, 64, "s", 128, x, 11, True)
    assert dispatcher.numba_launches == [((4, 64, "s", 128), (x, 11, True))] and fake_core == []
    y = FakeCudaArray(0x900, (3,), np.int32)
    bound(8, 32, "s", 0, y, 12, False)
    assert len(dispatcher.numba_launches) == 1
    assert fake_core == [("core(s)", dict(grid=8, block=32, shmem_size=0), "compiled kernel",
                          (0, 0, 3, 4, 0x900, 3, 4, 12, False))]
    z = FakeCudaArray(0x900, (3, 2), np.int32)  # another kind: Numba again, and (types disagree) every time
    bound(8, 32, "s", 0, z, 12, False)
    bound(8, 32, "s", 0, z, 12, False)
    assert len(dispatcher.numba_launches) == 3 and len(fake_core) == 1


@pytest.mark.parametrize("flags", [dict(debug=True), dict(cooperative=True), dict(extensions=[object()])])
def test_kernels_numba_must_launch_itself_stay_on_numba(fake_core, flags):
    dispatcher = FakeDispatcher(flags)
    bound = BoundLaunch(dispatcher, to_numba=lambda a: a)
    x = FakeCudaArray(0x500, (6,), np.int32)
    for _ in range(3):
        bound(1, 32, 0, 0, x, 1, True)
    assert len(dispatcher.numba_launches) == 3 and fake_core == []


def test_disabled_binding_always_uses_numba(fake_core):
    dispatcher = FakeDispatcher()
    bound = BoundLaunch(dispatcher, to_numba=lambda a: a, enabled=False)
    x = FakeCudaArray(0x500, (6,), np.int32)
    for _ in range(3):
        bound(1, 32, 0, 0, x, 1, True)
    assert len(dispatcher.numba_launches) == 3 and fake_core == []


@pytest.mark.skipif(SIMULATED, reason="needs a GPU: compares with Numba's own launch parameters")
def test_every_kernel_of_a_dispatch_gets_numbas_parameters(monkeypatch):
    """A small dispatch and combine, every pre-bound launch's parameters checked against
    ``_Kernel._prepare_args`` (Numba's launch) on the same arguments."""
    import cupy as cp

    from ep_comm.launching.views import DeviceViews
    from test_combine import run_combine
    from test_dispatch import make_world

    views, checked, original = DeviceViews(), [], bound_module._Plan.params

    def checked_params(plan, args):
        params = original(plan, args)
        expected = []
        for ty, value in zip(plan.types, args):
            plan.overload._prepare_args(ty, views(value), 0, [], expected)
        assert params_as_ints(params) == params_as_ints(expected), plan.overload.entry_point
        checked.append(plan.overload)
        return params

    monkeypatch.setattr(bound_module._Plan, "params", checked_params)
    world = make_world(cp, seed=21, hidden=40, masked=0.2)
    for expand in (False, True, False, True):  # each kind's first launch binds, the second runs pre-bound
        run_combine(world, expand=expand, weighted=expand, bias=1)
    assert len(set(map(id, checked))) >= 6
