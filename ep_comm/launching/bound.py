"""Pre-bound launches of Numba-CUDA kernels: the compiled kernel, launched without Numba's dispatcher.

A Numba launch types every argument, resolves the overload and converts each array to a device
array on every call: 80-230 us of Python per launch on the H200 machines, far more than the
kernels take at decode sizes. :class:`BoundLaunch` does that work once per *argument kind* (array
dtype, rank and contiguity; scalar type; tuples of those): the first launch of a kind goes
through Numba (which compiles it if needed), then the overload Numba chose is looked up and every
later launch of that kind flattens its arguments straight into the kernel's parameter list (Numba's
ABI, below) and calls ``cuda.core.launch`` on the compiled function.

Numba's kernel ABI (``numba.cuda.dispatcher._Kernel._prepare_args``), per argument type:

- array of ``ndim`` dims: ``meminfo=0, parent=0, nitems, itemsize, data pointer, *shape, *strides``
  (strides in bytes), all pointer-sized integers;
- integer: the value as a C integer of the type's width; boolean: a byte; float32/float64: C float
  or double;
- tuple: its items, flattened in order.

Anything else (records, complex numbers, debug or cooperative kernels, kernels with argument
extensions) keeps Numba's own launch path. What this takes from Numba's dispatcher, driver and types
comes through :mod:`ep_comm.numba_internals`.
"""
from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import cuda.core
import numpy as np

from ep_comm.numba_internals import compiled_function, compiles, core_stream, launchable_overload, numba_types

from .occupancy import quiet_low_occupancy

__all__ = ["BoundLaunch", "arg_kind", "array_fields", "flattener", "c_strides"]

Flatten = Callable[[Any, List[Any]], None]


@functools.lru_cache(maxsize=4096)
def c_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape`` (a tuple), remembered: launches flatten the same
    few shapes again and again."""
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


class _Described:
    """What a launch needs of one non-CuPy CUDA array (a Numba device array, say), read from its
    ``__cuda_array_interface__`` once: such arrays here are long-lived views (the symmetric buffers),
    so they are remembered by identity, holding a reference so that the identity stays theirs."""

    def __init__(self, capacity: int = 256):
        self._held: "OrderedDict[int, Tuple[Any, tuple, tuple]]" = OrderedDict()
        self._capacity = capacity

    def knows(self, a: Any) -> bool:
        held = self._held.get(id(a))
        return held is not None and held[0] is a

    def __call__(self, a: Any) -> Tuple[tuple, tuple]:
        """``((pointer, shape, byte strides, itemsize), arg kind)`` of ``a``."""
        held = self._held.get(id(a))
        if held is None or held[0] is not a:
            desc = a.__cuda_array_interface__
            shape = tuple(desc["shape"])
            dtype = np.dtype(desc["typestr"])
            strides = tuple(desc.get("strides") or c_strides(shape, dtype.itemsize))
            c = strides == c_strides(shape, dtype.itemsize)
            f = strides == tuple(reversed(c_strides(tuple(reversed(shape)), dtype.itemsize)))
            held = (a, (desc["data"][0], shape, strides, dtype.itemsize), ("array", dtype, len(shape), c, f))
            self._held[id(a)] = held
            if len(self._held) > self._capacity:
                self._held.popitem(last=False)
        return held[1], held[2]


_described = _Described()


_SCALARS = (bool, int, float, np.bool_, np.integer, np.floating)
_ROLES: Dict[type, str] = {}


def _role(t: type) -> str:
    """How arguments of type ``t`` are read: "cupy" (attributes), "scalar", "tuple" or "other"
    (``__cuda_array_interface__``, remembered per object). Decided once per type: asking an object
    for its interface builds a dict (microseconds each, many per launch)."""
    role = _ROLES.get(t)
    if role is None:
        if issubclass(t, tuple):
            role = "tuple"
        elif issubclass(t, _SCALARS):
            role = "scalar"
        elif getattr(t, "__module__", "").split(".")[0] == "cupy" and hasattr(t, "data") and hasattr(t, "flags"):
            role = "cupy"
        else:
            role = "other"
        _ROLES[t] = role
    return role


def array_fields(a: Any) -> Tuple[int, Tuple[int, ...], Tuple[int, ...], int]:
    """``(data pointer, shape, byte strides, itemsize)`` of a CuPy array or any CUDA-array-interface object."""
    if _role(type(a)) == "cupy":
        shape = a.shape
        # as Numba sees it: CuPy's interface gives no strides for a C-contiguous array (empty ones too)
        strides = c_strides(shape, a.itemsize) if a.flags.c_contiguous else a.strides
        return a.data.ptr, shape, strides, a.itemsize
    return _described(a)[0]


def arg_kind(a: Any) -> Optional[Tuple[Any, ...]]:
    """A hashable key that decides how Numba types ``a`` (None: not a kind this module binds)."""
    role = _role(type(a))
    if role == "cupy":
        flags = a.flags
        return ("array", a.dtype, a.ndim, flags.c_contiguous, flags.f_contiguous)
    if role == "scalar":
        return ("scalar", type(a))
    if role == "tuple":
        items = tuple(arg_kind(item) for item in a)
        return None if any(item is None for item in items) else ("tuple",) + items
    if not _described.knows(a) and not hasattr(a, "__cuda_array_interface__"):
        return None
    return _described(a)[1]


def _expected_layout(kind: Tuple[Any, ...]) -> str:
    return "C" if kind[3] else "F" if kind[4] else "A"


def _flatten_array(a: Any, out: List[Any]) -> None:
    ptr, shape, strides, itemsize = array_fields(a)
    size = 1
    for extent in shape:
        size *= extent
    out += (0, 0, size, itemsize, ptr)
    out += shape
    out += strides


def _scalar_flattener(ty: Any) -> Optional[Flatten]:
    if ty == numba_types.boolean:
        return lambda v, out: out.append(bool(v))
    if isinstance(ty, numba_types.Integer):
        if ty.bitwidth == 64 and ty.signed:  # cuda.core passes a Python int as a pointer-sized integer
            return lambda v, out: out.append(int(v))
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda v, out: out.append(ctype(int(v)))
    if ty == numba_types.float64:
        return lambda v, out: out.append(ctypes.c_double(v))
    if ty == numba_types.float32:
        return lambda v, out: out.append(ctypes.c_float(v))
    return None


def flattener(ty: Any, kind: Tuple[Any, ...]) -> Optional[Flatten]:
    """How to append a value of Numba type ``ty`` (whose :func:`arg_kind` is ``kind``) to a parameter
    list in Numba's ABI; None where this module does not bind that type (Numba keeps launching it)."""
    if isinstance(ty, numba_types.Array):
        if kind[0] != "array" or ty.ndim != kind[2] or ty.layout != _expected_layout(kind):
            return None
        return _flatten_array
    if isinstance(ty, numba_types.BaseTuple):
        if kind[0] != "tuple" or len(ty) != len(kind) - 1:
            return None
        parts = [flattener(t, k) for t, k in zip(ty, kind[1:])]
        if any(p is None for p in parts):
            return None

        def flatten_tuple(value: tuple, out: List[Any]) -> None:
            for part, item in zip(parts, value):
                part(item, out)
        return flatten_tuple
    if kind[0] != "scalar":
        return None
    return _scalar_flattener(ty)


class _Plan:
    """One argument kind of one kernel: Numba's overload (``types``: its signature), its compiled
    function, and the flattening of each argument."""

    def __init__(self, overload: Any, types: Tuple[Any, ...], parts: List[Flatten]):
        self.overload = overload
        self.types = types
        self.function = compiled_function(overload)
        self.parts = parts

    def params(self, args: tuple) -> List[Any]:
        out: List[Any] = []
        for part, arg in zip(self.parts, args):
            part(arg, out)
        return out


class BoundLaunch:
    """Launches one Numba ``@cuda.jit`` dispatcher; after the first launch of each argument kind,
    without the dispatcher.

    ``to_numba`` turns an argument into what Numba's own launch takes (see
    :class:`ep_comm.launching.views.DeviceViews`).
    ``enabled=False`` (the CUDA simulator, or ``EP_COMM_NUMBA_LAUNCH=1``) always launches through
    Numba.
    """

    def __init__(self, dispatcher: Any, to_numba: Callable[[Any], Any], enabled: bool = True):
        self.dispatcher = dispatcher
        self._to_numba = to_numba
        self._enabled = enabled and compiles(dispatcher)
        self._plans: Dict[Tuple[Any, ...], Optional[_Plan]] = {}
        self._configs: Dict[Tuple[int, int, int], Any] = {}
        self._streams: Dict[int, Tuple[Any, Any]] = {}

    def __call__(self, grid: int, block: int, stream: Any, shared_bytes: int, *args: Any) -> None:
        """Launch ``grid`` blocks of ``block`` threads with ``shared_bytes`` of dynamic shared memory
        on ``stream`` (a Numba stream or 0)."""
        if self._enabled:
            key = tuple(arg_kind(a) for a in args)
            plan = self._plans.get(key)
            if plan is not None:
                cuda.core.launch(self._core_stream(stream), self._config(grid, block, shared_bytes), plan.function,
                                 *plan.params(args))
                return
        numba_args = [self._to_numba(a) for a in args]
        with quiet_low_occupancy():  # small grids are deliberate: no warning per launch
            self.dispatcher[grid, block, stream, shared_bytes](*numba_args)
        if self._enabled and key not in self._plans:
            self._plans[key] = self._bind(key, numba_args)

    def _bind(self, key: Tuple[Any, ...], numba_args: List[Any]) -> Optional[_Plan]:
        """The plan for ``key`` from the overload Numba just launched (None: keep Numba's launch)."""
        if any(k is None for k in key):
            return None
        chosen = launchable_overload(self.dispatcher, numba_args)
        if chosen is None:
            return None
        overload, types = chosen
        parts = [flattener(t, k) for t, k in zip(types, key)]
        if any(p is None for p in parts):
            return None
        return _Plan(overload, types, parts)

    def _config(self, grid: int, block: int, shared_bytes: int) -> Any:
        key = (grid, block, shared_bytes)
        config = self._configs.get(key)
        if config is None:
            config = self._configs[key] = cuda.core.LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
        return config

    def _core_stream(self, stream: Any) -> Any:
        """The ``cuda.core`` stream of a Numba stream (0: the default stream), kept with its source."""
        held = self._streams.get(id(stream))
        if held is None or held[0] is not stream:
            held = self._streams[id(stream)] = (stream, core_stream(stream))
        return held[1]
