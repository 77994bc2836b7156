"""Pre-bound launches (``ep_comm._launcher.prebound``): argument kinds, parameter blocks in Numba's ABI
(``ep_comm._launcher.param_blocks``), plan binding, driver launches.

The first tests need no GPU: fake CUDA arrays, a fake dispatcher and a fake ``cuLaunchKernel`` stand in
for CuPy, Numba's compiled kernel and the driver; the bytes a parameter block passes are compared with
Numba's ABI computed here from the array interface. On a GPU, the parameters of every driver launch of a
small dispatch and combine are compared with the ones Numba's own launch builds (``_Kernel._prepare_args``).
"""
from __future__ import annotations

import ctypes
import functools
import gc
import weakref
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
from cuda.bindings.driver import CUresult
from numba.core import types
from numba.cuda.np.numpy_support import strides_from_shape

from ep_comm._launcher import param_blocks
from ep_comm._launcher import prebound as bound_module
from ep_comm._launcher import raw as raw_module
from ep_comm._launcher.param_blocks import ParamBlock, arg_kind, array_fields, c_strides, param_slot
from ep_comm._launcher.prebound import PreboundKernel
from ep_comm._launcher.recorded_calls import FixedArguments, RecordedCalls, arguments, call_key
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED


class FakeCudaArray:
    """A device array known only by its ``__cuda_array_interface__`` (as a PyTorch tensor is)."""

    def __init__(self, ptr: int, shape, dtype, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "strides": strides,
                                         "typestr": np.dtype(dtype).str, "version": 3}


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
    with pytest.raises(TypeError, match="array_fields: a of type str"):
        array_fields("text")


class FakeCupyArray:
    """A CuPy array as :func:`arg_kind` reads one (attributes, no interface), weakly referenceable as CuPy's are."""

    __module__ = "cupy._core.core"
    data = flags = None  # class attributes, as CuPy's are

    def __init__(self, ptr: int, shape, dtype, strides=None, contiguous=None):
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self.itemsize, self.ndim, self.size = self.dtype.itemsize, len(shape), int(np.prod(shape, dtype=np.int64))
        self.strides = tuple(strides) if strides else c_strides(self.shape, self.itemsize)
        self.data = SimpleNamespace(ptr=ptr)
        if contiguous is None:
            contiguous = self.strides == c_strides(self.shape, self.itemsize)
        self.flags = SimpleNamespace(c_contiguous=contiguous, f_contiguous=self.ndim <= 1 and contiguous)


def reference_params(ty, value):
    """The bytes of each kernel parameter Numba's ABI gives ``value`` of type ``ty`` (the module docstring of
    ``ep_comm._launcher.param_blocks``), computed independently from the array interface."""
    if isinstance(ty, types.BaseTuple):
        return [p for t, v in zip(ty, value) for p in reference_params(t, v)]
    if isinstance(ty, types.Array):
        if isinstance(value, FakeCupyArray):  # CuPy's interface names no strides for a C-contiguous array
            ptr, shape, itemsize = value.data.ptr if value.size else 0, value.shape, value.itemsize
            strides = None if value.flags.c_contiguous else value.strides
        else:
            desc = value.__cuda_array_interface__
            ptr, shape, itemsize = desc["data"][0], desc["shape"], np.dtype(desc["typestr"]).itemsize
            strides = desc["strides"]
        if strides is None:  # as Numba's launch computes them
            strides = strides_from_shape(shape=shape, itemsize=itemsize, c_contiguous=True, f_contiguous=False)
        words = [0, 0, int(np.prod(shape, dtype=np.int64)), itemsize, ptr, *shape, *strides]
        return [bytes(ctypes.c_ssize_t(w)) for w in words]
    if ty == types.boolean:
        return [bytes(ctypes.c_bool(value))]
    if ty in (types.float32, types.float64):
        return [bytes((ctypes.c_float if ty == types.float32 else ctypes.c_double)(value))]
    return [bytes(getattr(ctypes, f"c_{ty}")(int(value)))]


def block_params(address: int, sizes):
    """The bytes the driver reads through the ``void*[]`` at ``address``: ``sizes[i]`` from parameter ``i``."""
    pointers = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]


def packed(types_, args):
    """A fresh parameter block of ``args`` (Numba types ``types_``), and the bytes it passes."""
    block = ParamBlock([param_slot(t, arg_kind(a)) for t, a in zip(types_, args)])
    assert block.patch(tuple(args))
    want = [p for t, a in zip(types_, args) for p in reference_params(t, a)]
    return block, block_params(block.address, [len(p) for p in want]), want


ARRAYS = [  # (value, Numba type): C, F, non-contiguous, 0-d, empty, CuPy-like
    (FakeCudaArray(0x8000, (2, 4), np.float32), types.Array(types.float32, 2, "C")),
    (FakeCudaArray(0x7000, (4, 6), np.int32, (4, 16)), types.Array(types.int32, 2, "F")),
    (FakeCudaArray(0x7000, (3, 5), np.uint16, (20, 2)), types.Array(types.uint16, 2, "A")),
    (FakeCudaArray(0x6000, (), np.float64), types.Array(types.float64, 0, "C")),
    (FakeCudaArray(0x5000, (0, 7), np.int64), types.Array(types.int64, 2, "C")),
    (FakeCupyArray(0x9000, (3, 2, 4), np.uint64), types.Array(types.uint64, 3, "C")),
    (FakeCupyArray(0x9000, (3, 4), np.int32, (32, 4)), types.Array(types.int32, 2, "A")),
    (FakeCupyArray(2**63 + 2**40, (5,), np.uint8), types.Array(types.uint8, 1, "C")),  # a pointer past int64
    (FakeCupyArray(0xA000, (0, 7), np.int64, (0, 8), contiguous=True), types.Array(types.int64, 2, "C")),
]


@pytest.mark.parametrize("value, ty", ARRAYS)
def test_array_parameters_follow_numbas_abi(value, ty):
    _, got, want = packed([ty], [value])
    assert got == want and len(got) == 5 + 2 * ty.ndim


SCALARS = [(types.boolean, True), (types.boolean, np.bool_(False)), (types.int8, np.int8(-7)),
           (types.uint8, np.uint8(200)), (types.int16, np.int16(-300)), (types.uint16, np.uint16(60000)),
           (types.int32, np.int32(-5)), (types.uint32, np.uint32(2**32 - 2)), (types.int64, -3),
           (types.int64, np.int64(2**40)), (types.uint64, np.uint64(2**64 - 1)), (types.float32, np.float32(0.5)),
           (types.float64, 0.25), (types.float64, -0.0)]


def test_scalar_and_tuple_parameters_follow_numbas_abi():
    a, b = FakeCudaArray(0x100, (2,), np.int64), FakeCupyArray(0x200, (2,), np.int64)
    array = types.Array(types.int64, 1, "C")
    sig = [ty for ty, _ in SCALARS] + [types.UniTuple(array, 2), types.Tuple((array, types.int32, types.boolean))]
    args = [v for _, v in SCALARS] + [(a, b), (b, np.int32(4), False)]
    _, got, want = packed(sig, args)
    assert got == want
    assert [len(p) for p in got[:len(SCALARS)]] == [1, 1, 1, 1, 2, 2, 4, 4, 8, 8, 8, 4, 8, 8]


def test_patching_a_changed_argument_gives_a_fresh_packs_bytes(monkeypatch):
    sig = [types.Array(types.int32, 2, "A"), types.Array(types.uint64, 3, "C"), types.int32, types.float64,
           types.UniTuple(types.Array(types.int64, 1, "C"), 2), types.boolean]
    x, y = ARRAYS[6][0], ARRAYS[5][0]
    p, q = FakeCupyArray(0x100, (2,), np.int64), FakeCupyArray(0x300, (9,), np.int64)
    block, _, _ = packed(sig, [x, y, np.int32(3), 0.5, (p, p), True])
    reads = []
    describe = param_blocks._array  # what an array slot reads of an array it has not taken yet
    monkeypatch.setattr(param_blocks, "_array", lambda a: reads.append(a) or describe(a))
    z = FakeCupyArray(0x9100, (3, 4), np.int32, (32, 4))
    for args, read in (([z, y, np.int32(3), 0.5, (p, q), True], [z, q]),  # two arrays new, the rest the same
                       ([z, y, np.int32(-1), -0.5, (p, q), False], []),  # scalars only
                       ([x, y, np.int32(-1), -0.5, (q, p), False], [x, q, p])):
        reads.clear()
        assert block.patch(tuple(args))
        assert reads == read
        _, fresh, want = packed(sig, args)
        assert block_params(block.address, [len(w) for w in want]) == fresh == want


def test_an_argument_of_another_kind_is_refused_and_the_block_stays_whole():
    sig = [types.Array(types.int32, 2, "A"), types.int32, types.UniTuple(types.int64, 2)]
    args = [ARRAYS[6][0], np.int32(3), (1, 2)]
    block, before, want = packed(sig, args)
    for other in ([ARRAYS[5][0], np.int32(3), (1, 2)], [args[0], 3, (1, 2)], [args[0], np.int32(3), (1, 2, 3)],
                  [args[0], np.int32(3), (1, 2.0)], [args[0], np.int32(3)], ["text", np.int32(3), (1, 2)]):
        assert not block.patch(tuple(other))
        assert block.patch(tuple(args)) and block_params(block.address, [len(w) for w in want]) == before


def test_a_block_holds_no_strong_reference_to_cupy_arrays():
    x = FakeCupyArray(0x100, (2,), np.int64)
    alive = weakref.ref(x)
    block, _, _ = packed([types.Array(types.int64, 1, "C")], [x])
    del x
    gc.collect()
    assert alive() is None
    y = FakeCupyArray(0x400, (3,), np.int64)  # may reuse x's id: its own fields all the same
    assert block.patch((y,))
    assert block_params(block.address, [8] * 7) == reference_params(types.Array(types.int64, 1, "C"), y)


def test_layout_mismatch_or_unknown_types_are_not_bound():
    a = FakeCudaArray(0x100, (4, 6), np.int32, (48, 4))  # not contiguous: Numba types it "A"
    assert param_slot(types.Array(types.int32, 2, "C"), arg_kind(a)) is None
    assert param_slot(types.complex64, arg_kind(1.0)) is None
    assert param_slot(types.int64, arg_kind(a)) is None
    assert param_slot(types.UniTuple(types.complex64, 2), arg_kind((1.0, 2.0))) is None


class FakeDispatcher:
    """Numba's dispatcher as PreboundKernel uses it: ``[config](*args)``, ``typeof_pyval``, ``overloads``."""

    __name__ = "fake_kernel"
    sig = (types.Array(types.int32, 1, "C"), types.int64, types.boolean)

    def __init__(self, overload_flags=None):
        self.numba_launches = []
        flags = {**dict(debug=False, cooperative=False, extensions=[]), **(overload_flags or {})}
        function = SimpleNamespace(kernel=SimpleNamespace(handle=0xABC))
        self.overloads = {self.sig: SimpleNamespace(
            _codelibrary=SimpleNamespace(get_cufunc=lambda: function), **flags)}

    def __getitem__(self, config):
        return lambda *args: self.numba_launches.append((config, args))

    def typeof_pyval(self, value):
        return {FakeCudaArray: self.sig[0], FakeCupyArray: self.sig[0], int: types.int64,
                bool: types.boolean}[type(value)]


class FakeDriver:
    """``cuLaunchKernel`` as the driver sees it (``raw.driver_launch``): each launch's function, shape, stream and
    the bytes its parameters point at (read during the call, as the driver copies them), refusing (a RuntimeError, as
    CuPy's binding raises) unless ``result`` is success."""

    def __init__(self, sizes):
        self.sizes, self.launches, self.result, self.during = sizes, [], CUresult.CUDA_SUCCESS, None

    def __call__(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append((int(f), (gx, gy, gz), (bx, by, bz), shared, int(stream), extra,
                              block_params(params, self.sizes)))
        if self.during is not None:
            during, self.during = self.during, None
            during()
        if self.result != CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{self.result!r}")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver([len(p) for p in reference_params(
        types.Tuple(FakeDispatcher.sig), (FakeCudaArray(0, (1,), np.int32), 0, False))])
    monkeypatch.setattr(raw_module, "driver_launch", fake)
    monkeypatch.setattr(bound_module, "stream_handle", lambda stream: {"s": 0x5, 0: 0}[stream])
    return fake


def raw(args, grid=8, block=32, shared=0, stream=0x5):
    return (0xABC, (grid, 1, 1), (block, 1, 1), shared, stream, 0,
            reference_params(types.Tuple(FakeDispatcher.sig), args))


def test_first_launch_goes_through_numba_then_the_driver(driver):
    dispatcher = FakeDispatcher()
    bound = PreboundKernel(dispatcher, to_numba=lambda a: a)
    x = FakeCudaArray(0x500, (6,), np.int32)
    bound(4, 64, "s", 128, x, 11, True)
    assert dispatcher.numba_launches == [((4, 64, "s", 128), (x, 11, True))] and driver.launches == []
    y = FakeCupyArray(0x900, (3,), np.int32)
    bound(8, 32, "s", 0, y, 12, False)
    bound(8, 32, "s", 0, y, 13, False)  # the block again, one scalar patched
    bound(4, 64, 0, 128, x, 11, True)  # another config: its own block
    assert len(dispatcher.numba_launches) == 1
    assert driver.launches == [raw((y, 12, False)), raw((y, 13, False)), raw((x, 11, True), 4, 64, 128, 0)]
    z = FakeCudaArray(0x900, (3, 2), np.int32)  # another kind: Numba again, and (types disagree) every time
    bound(8, 32, "s", 0, z, 12, False)
    bound(8, 32, "s", 0, z, 12, False)
    assert len(dispatcher.numba_launches) == 3 and len(driver.launches) == 3
    bound(8, 32, "s", 0, y, 12, True)  # back to the bound kind
    assert len(dispatcher.numba_launches) == 3 and driver.launches[-1] == raw((y, 12, True))


def test_interleaved_launches_never_share_a_block(driver):
    """A launch that starts while another is inside the driver call (two Buffers on two threads share
    one PreboundKernel) gets a block of its own; both pass their own parameters."""
    bound = PreboundKernel(FakeDispatcher(), to_numba=lambda a: a)
    x, y = FakeCupyArray(0x500, (6,), np.int32), FakeCupyArray(0x700, (2,), np.int32)
    bound(8, 32, "s", 0, x, 1, True)  # binds
    driver.during = lambda: bound(8, 32, "s", 0, y, 2, False)
    bound(8, 32, "s", 0, x, 3, True)
    bound(8, 32, "s", 0, x, 4, True)
    assert driver.launches == [raw((x, 3, True)), raw((y, 2, False)), raw((x, 4, True))]


def test_a_failed_launch_names_the_kernel_and_the_result(driver):
    bound = PreboundKernel(FakeDispatcher(), to_numba=lambda a: a)
    x = FakeCupyArray(0x500, (6,), np.int32)
    bound(8, 32, "s", 0, x, 1, True)
    driver.result = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="fake_kernel.*CUDA_ERROR_INVALID_VALUE"):
        bound(8, 32, "s", 0, x, 1, True)
    driver.result = CUresult.CUDA_SUCCESS
    bound(8, 32, "s", 0, x, 2, True)
    assert driver.launches[-1] == raw((x, 2, True))


@pytest.mark.parametrize("flags", [dict(debug=True), dict(cooperative=True), dict(extensions=[object()])])
def test_kernels_numba_must_launch_itself_stay_on_numba(driver, flags):
    dispatcher = FakeDispatcher(flags)
    bound = PreboundKernel(dispatcher, to_numba=lambda a: a)
    x = FakeCudaArray(0x500, (6,), np.int32)
    for _ in range(3):
        bound(1, 32, 0, 0, x, 1, True)
    assert len(dispatcher.numba_launches) == 3 and driver.launches == []


def test_disabled_binding_always_uses_numba(driver):
    dispatcher = FakeDispatcher()
    bound = PreboundKernel(dispatcher, to_numba=lambda a: a, enabled=False)
    x = FakeCudaArray(0x500, (6,), np.int32)
    for _ in range(3):
        bound(1, 32, 0, 0, x, 1, True)
    assert len(dispatcher.numba_launches) == 3 and driver.launches == []


@pytest.mark.skipif(SIMULATED, reason="needs a GPU: compares with Numba's own launch parameters")
def test_every_kernel_of_a_dispatch_gets_numbas_parameters(monkeypatch):
    """A small dispatch and combine (results bit-exact against the NumPy reference), every driver launch's
    parameters checked against ``_Kernel._prepare_args`` (Numba's launch) on the same arguments."""
    import cupy as cp
    from combine_checks import run_combine
    from world import kernel_world

    from ep_comm._launcher.device_arrays import DeviceViews

    views, checked, original = DeviceViews(), [], PreboundKernel._launch_packed

    def checked_launch(self, plan, free, config, stream, args):
        launched = original(self, plan, free, config, stream, args)
        if launched:
            expected = []
            for ty, value in zip(plan.types, args):
                plan.overload._prepare_args(ty, views(value), 0, [], expected)
            want = [bytes(p) if isinstance(p, ctypes._SimpleCData) else
                    bytes(ctypes.c_bool(p)) if isinstance(p, (bool, np.bool_)) else bytes(ctypes.c_ssize_t(p))
                    for p in expected]
            assert block_params(free[-1].address, [len(w) for w in want]) == want, plan.name
            checked.append(plan.overload)
        return launched

    monkeypatch.setattr(PreboundKernel, "_launch_packed", checked_launch)
    world = kernel_world(cp, seed=21, hidden=40, masked=0.2)
    for expand in (False, True, False, True):  # each kind's first launch binds, the second runs pre-bound
        run_combine(world, expand=expand, weighted=expand, bias=1)
    assert len(set(map(id, checked))) >= 6


@pytest.mark.skipif(SIMULATED, reason="needs a GPU: runs the kernels")
def test_driver_launches_compute_what_numbas_launches_do(monkeypatch):
    """The same small dispatch and combine through Numba's launch only, then pre-bound: both bit-exact against
    the NumPy reference (``run_combine`` asserts it), and the pre-bound run launches through the driver."""
    import cupy as cp
    from combine_checks import run_combine
    from world import kernel_world

    raw_launches = []
    launch = raw_module.driver_launch
    monkeypatch.setattr(raw_module, "driver_launch", lambda *a: raw_launches.append(a[0]) or launch(*a))
    with monkeypatch.context() as numba_only:
        numba_only.setattr(PreboundKernel, "_launch_packed", lambda *a: False)
        for expand in (False, True):
            run_combine(kernel_world(cp, seed=23, hidden=40, masked=0.2), expand=expand, weighted=expand, bias=1)
    assert raw_launches == []
    for expand in (False, True, False, True):  # each kind's first launch binds, the second runs pre-bound
        run_combine(kernel_world(cp, seed=23, hidden=40, masked=0.2), expand=expand, weighted=expand, bias=1)
    assert len(set(map(int, raw_launches))) >= 6


# ------------------------------------------------------------------ recorded calls (ep_comm._launcher.recorded_calls)
def _two_launches(bound, first, second):
    """A call's launches: a view of the call's root, then a long-lived array."""
    return lambda: (bound(4, 64, "s", 0, first, 3, True), bound(2, 32, "s", 16, second, 5, False))


class _Call:
    """A recorded call's launches (``_two_launches``) of ``launch``, a view ``offset`` bytes into its root and then
    ``held``, a long-lived array; ``ran``: the roots it ran on."""

    def __init__(self, launch, offset: int, held):
        self.launch, self.offset, self.held, self.ran = launch, offset, held, []

    def path(self, stream, root):
        self.ran.append(root)
        _two_launches(self.launch, FakeCupyArray(root.data.ptr + self.offset, (6,), np.int32), self.held)()


def test_a_launch_plan_replays_the_recorded_launches_with_new_root_pointers(driver):
    fixed = FakeCupyArray(0x9000, (6,), np.int32)
    call = _Call(PreboundKernel(FakeDispatcher(), to_numba=lambda a: a), 0x10, fixed)
    plans, on = RecordedCalls(enabled=True), 0x5
    plans.run(on, call.path, "s", FakeCupyArray(0x1000, (64,), np.int32))
    assert plans.built == 1 and len(driver.launches) == 1  # the first launch of a kind goes through Numba
    del driver.launches[:]
    plans.run(on, call.path, "s", FakeCupyArray(0x7000, (64,), np.int32))
    assert len(call.ran) == 1, "a recorded call must not run its path again"
    assert driver.launches == [raw((FakeCupyArray(0x7010, (6,), np.int32), 3, True), 4, 64),
                               raw((fixed, 5, False), 2, 32, 16)]


class _TwoRoots:
    """A recorded call's launches (``_two_launches``) of ``launch`` on its two roots; ``ran``: the roots it ran on."""

    def __init__(self, launch):
        self.launch, self.ran = launch, []

    def path(self, stream, first, second):
        self.ran.append((first, second))
        _two_launches(self.launch, first, second)()


def test_a_call_whose_roots_share_bytes_runs_unrecorded_and_the_next_call_of_its_key_records(driver):
    """Recorded with one array as both roots, a launch's pointer would be bound to the first root, and a later call
    of the key with two arrays would replay the first one's pointer into both slots: such a call (the same array
    twice, or overlapping views) runs its launches and records nothing; a call of the key with roots apart records,
    and its replays write each root's own pointer, also where the roots then share bytes."""
    call = _TwoRoots(PreboundKernel(FakeDispatcher(), to_numba=lambda a: a))
    plans, on = RecordedCalls(enabled=True), 0x5
    same = FakeCupyArray(0x1000, (6,), np.int32)
    plans.run(on, call.path, "s", same, same)
    plans.run(on, call.path, "s", FakeCupyArray(0x2000, (6,), np.int32), FakeCupyArray(0x2010, (6,), np.int32))
    assert plans.built == 0 and len(call.ran) == 2
    plans.run(on, call.path, "s", FakeCupyArray(0x3000, (6,), np.int32), FakeCupyArray(0x4000, (6,), np.int32))
    assert plans.built == 1 and len(call.ran) == 3
    del driver.launches[:]
    first, second = FakeCupyArray(0x5000, (6,), np.int32), FakeCupyArray(0x6000, (6,), np.int32)
    plans.run(on, call.path, "s", first, second)
    plans.run(on, call.path, "s", same, same)
    assert len(call.ran) == 3, "a recorded call must not run its path again"
    assert driver.launches == [raw((first, 3, True), 4, 64), raw((second, 5, False), 2, 32, 16),
                               raw((same, 3, True), 4, 64), raw((same, 5, False), 2, 32, 16)]


def test_a_call_that_allocates_outside_its_roots_or_cannot_be_bound_is_not_planned(driver):
    allocating = RecordedCalls(enabled=True, allocations=lambda held: _appending(held))
    cooperative = PreboundKernel(FakeDispatcher(dict(cooperative=True)), to_numba=lambda a: a)
    bound = PreboundKernel(FakeDispatcher(), to_numba=lambda a: a)
    root, held = FakeCupyArray(0x1000, (6,), np.int32), FakeCupyArray(0x2000, (6,), np.int32)
    calls = []
    for plans, launch in ((allocating, bound), (RecordedCalls(enabled=True), cooperative), (RecordedCalls(enabled=False), bound)):
        calls.append(_Call(launch, 0, held))
        for _ in range(2):
            plans.run(0x5, calls[-1].path, "s", root)
        assert plans.built == 0
    assert [len(call.ran) for call in calls] == [2, 2, 2]  # every call ran its own launches


class _appending:
    """An allocator hook that reports one allocation."""

    def __init__(self, held):
        held.append("an allocation")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Carving:
    """An object a recorded call takes by its ``launch_key``."""

    def __init__(self, launch_key):
        self.launch_key = launch_key


def test_a_call_key_holds_every_word_of_the_arguments_but_the_arrays_pointers():
    """``call_key``: an array's shape, strides, dtype and 16-byte misalignment, a scalar's type and value, a tuple's
    items, an object's ``launch_key``, and the function; the arrays are the roots, in order. A function made per call
    is refused by the recorded calls (recording or not)."""
    def key(*args, path=_two_launches):
        return call_key(path, args, {})

    base = (FakeCupyArray(0x1000, (4, 6), np.int32), 3, (True, None), _Carving(("rows", 7)))
    assert key(*base)[1:] == ([base[0]], [0x1000])
    same = (FakeCupyArray(0x7010, (4, 6), np.int32),) + base[1:]  # another pointer, 16 bytes apart: the same words
    assert key(*same)[0] == key(*base)[0]
    others = [(FakeCupyArray(0x1008, (4, 6), np.int32),) + base[1:],
              (FakeCupyArray(0x1000, (4, 6), np.int32, strides=(4, 16)),) + base[1:],
              (FakeCupyArray(0x1000, (6, 4), np.int32),) + base[1:],
              (FakeCupyArray(0x1000, (4, 6), np.float32),) + base[1:],
              base[:1] + (3.0,) + base[2:], base[:2] + ((1, None),) + base[3:], base[:2] + ((True,), None) + base[3:],
              base[:3] + (_Carving(("rows", 8)),)]
    keys = {key(*args)[0] for args in others} | {key(*base)[0], key(*base, path=raw)[0]}
    assert len(keys) == len(others) + 2
    with pytest.raises(TypeError, match="argument .*object.* gives no launch words"):
        key(object())
    for made_per_call in (functools.partial(_two_launches, None), lambda stream: None):
        for calls in (RecordedCalls(enabled=True), RecordedCalls(enabled=False)):
            with pytest.raises(TypeError, match="new at every call"):
                calls.run(0x5, made_per_call, None, *base)


def test_fixed_arguments_are_one_word_and_their_roots_in_place():
    """A ``FixedArguments`` (arguments read once: a handle's arrays) gives ``call_key`` one word, the same for arguments
    of the same words whatever their pointers, another wherever a word differs; its roots and their pointers come at
    its place among the call's, as the arguments' would."""
    def key(*args):
        return call_key(_two_launches, args, {})

    def fixed(*args):
        return FixedArguments(args, {})

    rows, meta, psum = (FakeCupyArray(p, (4, 6), np.int32) for p in (0x1000, 0x2000, 0x3000))
    held = fixed(meta, psum, True)
    words, roots, pointers = key(rows, held, None)
    assert len(words) == 4 and words[2] == held.word  # the function, rows, the fixed arguments, None
    assert (roots, pointers) == ([rows, meta, psum], [0x1000, 0x2000, 0x3000])
    elsewhere = (FakeCupyArray(0x9000, (4, 6), np.int32), FakeCupyArray(0x4000, (4, 6), np.int32))
    assert fixed(*elsewhere, True).word == held.word
    others = [fixed(FakeCupyArray(0x2008, (4, 6), np.int32), psum, True), fixed(meta, psum, False),
              fixed(FakeCupyArray(0x2000, (6, 4), np.int32), psum, True), fixed(meta, (psum,), True),
              fixed(psum, True), fixed(meta, psum, 1)]
    assert len({other.word for other in others} | {held.word}) == len(others) + 1
    assert key(rows, fixed(meta), None)[0] != key(rows, meta, None)[0]  # read once or walked: two keys
    assert arguments(held) == (meta, psum, True) and arguments((meta,)) == (meta,)


class _Pair(NamedTuple):
    """Two scalars a recorded call takes as one key word (its ``launch_key``, as ``CopyOptions`` does)."""

    first: int
    second: bool
    launch_key = property(tuple)


class _PlainPair(NamedTuple):
    first: int
    second: bool


def test_a_named_tuple_with_a_launch_key_is_one_word_and_one_without_is_walked():
    """A tuple subclass with a ``launch_key`` gives that value (every field, so that no two options share a key); one
    without is read as a tuple, its items' words following; arrays inside one are roots."""
    def key(*args):
        return call_key(_two_launches, args, {})

    pairs = [_Pair(1, True), _Pair(1, False), _Pair(2, True)]
    assert key(pairs[0])[0] == key(_Pair(1, True))[0]
    assert len({key(p)[0] for p in pairs}) == len(pairs)
    assert key(pairs[0])[0][1] == (_Pair, (1, True))  # one word after the function
    assert key(_PlainPair(1, True))[0][1:] == ((_PlainPair, 2), (int, 1), (bool, True))
    x = FakeCupyArray(0x2000, (3,), np.int32)
    assert key(_PlainPair(x, True))[1:] == ([x], [0x2000])


def test_launches_are_recorded_per_thread(driver):
    """A recording sees its own thread's launches only, and another thread may record at the same time."""
    import threading

    from ep_comm._launcher.prebound import recording

    bound = PreboundKernel(FakeDispatcher(), to_numba=lambda a: a)
    x = FakeCupyArray(0x500, (6,), np.int32)
    seen_there = []

    def elsewhere():
        with recording() as there:
            bound(8, 32, "s", 0, x, 2, True)
        seen_there.extend(there)

    with recording() as here:
        bound(8, 32, "s", 0, x, 1, True)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert [args[1] for _, _, args in here] == [1] and [args[1] for _, _, args in seen_there] == [2]
