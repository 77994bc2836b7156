"""Parameter blocks of Numba-CUDA kernel launches: every kernel parameter in Numba's ABI, in ctypes storage.

A :class:`ParamBlock` is ctypes storage for every kernel parameter in Numba's ABI (below) and the ``void*[]``
array of their addresses that ``cuLaunchKernel`` reads, made once per kernel overload and launch configuration
(``ep_comm._launcher.prebound``) from slots typed by :func:`param_slot`. A launch rewrites only the arguments that
differ from the ones the block last took: an array argument that is the same object (a weak reference tells,
so no user array is kept alive by it) is skipped, a scalar of the same type and value too; any other argument
is checked against its *argument kind* (:func:`arg_kind`: array dtype, rank and contiguity; scalar type; tuples
of those) and written in place.

Numba's kernel ABI (``numba.cuda.dispatcher._Kernel._prepare_args``), per argument type:

- array of ``ndim`` dims: ``meminfo=0, parent=0, nitems, itemsize, data pointer, *shape, *strides``
  (strides in bytes), all pointer-sized integers;
- integer: the value as a C integer of the type's width; boolean: a byte; float32/float64: C float
  or double;
- tuple: its items, flattened in order.

Any other type (records, complex numbers) gets no slot (:func:`param_slot` answers None): its launches keep
Numba's own path. Numba's types come through :mod:`ep_comm.kernels.numba_internals`. An array object's data
pointer, shape and strides are taken as fixed for its life (true of CuPy arrays and Numba device arrays unless
reshaped in place).
"""
from __future__ import annotations

import ctypes
import functools
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ep_comm.kernels.numba_internals import numba_types

__all__ = ["ParamBlock", "arg_kind", "array_fields", "param_slot", "c_strides"]

_WORD = ctypes.c_int64  # Numba's pointer-sized array fields (64-bit hosts only, as CUDA is)
_ARRAY_HEAD = 5  # meminfo, parent, nitems, itemsize, data: then shape and strides


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
        """``((pointer, shape, byte strides, itemsize), arg kind)`` of ``a``, which has a
        ``__cuda_array_interface__``."""
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


ArrayFields = Tuple[int, Tuple[int, ...], Tuple[int, ...], int]


def _array(a: Any) -> Optional[Tuple[ArrayFields, Tuple[Any, ...]]]:
    """``(array fields, arg kind)`` of a CuPy array or any CUDA-array-interface object, each attribute
    read once (None: ``a`` is neither)."""
    role = _role(type(a))
    if role == "cupy":
        flags, shape, itemsize = a.flags, a.shape, a.itemsize
        c = flags.c_contiguous
        # as Numba sees it: CuPy's interface gives no strides for a C-contiguous array (empty ones too)
        strides = c_strides(shape, itemsize) if c else a.strides
        # an empty array's pointer as its interface gives it to Numba (0): views of an allocation may be empty
        ptr = a.data.ptr if a.size else 0
        return (ptr, shape, strides, itemsize), ("array", a.dtype, len(shape), c, flags.f_contiguous)
    if role == "other" and (_described.knows(a) or hasattr(a, "__cuda_array_interface__")):
        return _described(a)
    return None


def array_fields(a: Any) -> ArrayFields:
    """``(data pointer, shape, byte strides, itemsize)`` of a CuPy array or any CUDA-array-interface object."""
    described = _array(a)
    if described is None:
        raise TypeError(f"array_fields: a of type {type(a).__name__} is neither a CuPy array nor has a "
                        "__cuda_array_interface__")
    return described[0]


def arg_kind(a: Any) -> Optional[Tuple[Any, ...]]:
    """A hashable key that decides how Numba types ``a`` (None: not a kind this module binds)."""
    role = _role(type(a))
    if role == "scalar":
        return ("scalar", type(a))
    if role == "tuple":
        items = tuple(arg_kind(item) for item in a)
        return None if any(item is None for item in items) else ("tuple",) + items
    described = _array(a)
    return None if described is None else described[1]


def _expected_layout(kind: Tuple[Any, ...]) -> str:
    return "C" if kind[3] else "F" if kind[4] else "A"


def _reference(a: Any) -> Optional[weakref.ref]:
    """A weak reference to ``a`` (None where its type takes none: then it is rewritten every launch)."""
    try:
        return weakref.ref(a)
    except TypeError:
        return None


class _ArraySlot:
    """The ``5 + 2 * ndim`` pointer-sized parameters of one array argument of kind ``kind``."""

    __slots__ = ("kind", "store", "_held")

    def __init__(self, kind: Tuple[Any, ...]):
        self.kind = kind
        self.store = (_WORD * (_ARRAY_HEAD + 2 * kind[2]))()  # meminfo and parent stay 0
        self._held: Optional[weakref.ref] = None

    def addresses(self) -> List[int]:
        base = ctypes.addressof(self.store)
        return [base + i * ctypes.sizeof(_WORD) for i in range(len(self.store))]

    def patch(self, a: Any) -> bool:
        """Take ``a``; False (nothing written) where it is not an array of this slot's kind."""
        held = self._held
        if held is not None and held() is a:
            return True
        described = _array(a)
        if described is None or described[1] != self.kind:
            return False
        ptr, shape, strides, itemsize = described[0]
        size = 1
        for extent in shape:
            size *= extent
        self._held = None  # until the store is whole again
        self.store[2:] = (size, itemsize, ptr, *shape, *strides)
        self._held = _reference(a)
        return True


class _ScalarSlot:
    """One scalar parameter: a C value of the Numba type's width, taken from Python values of type ``kind``."""

    __slots__ = ("kind", "store", "_value", "_by_value")

    def __init__(self, kind: type, ctype: Any, by_value: bool):
        self.kind = kind
        self.store = ctype()
        self._by_value = by_value  # floats are always written: 0.0 == -0.0, nan != nan
        self._value: Any = None

    def addresses(self) -> List[int]:
        return [ctypes.addressof(self.store)]

    def patch(self, v: Any) -> bool:
        """Take ``v``; False (nothing written) where it is not of this slot's type."""
        if type(v) is not self.kind:
            return False
        if not self._by_value:
            self.store.value = v
        elif v != self._value:
            self._value = None
            self.store.value = v
            self._value = v
        return True


class _TupleSlot:
    """The parameters of a tuple argument: its items', in order."""

    __slots__ = ("items",)

    def __init__(self, items: List["Slot"]):
        self.items = items

    def addresses(self) -> List[int]:
        return [address for item in self.items for address in item.addresses()]

    def patch(self, value: Any) -> bool:
        """Take ``value``; False where it is not a tuple of this slot's kinds (its items up to the first
        that is not are taken)."""
        items = self.items
        if not isinstance(value, tuple) or len(value) != len(items):
            return False
        for item, v in zip(items, value):
            if not item.patch(v):
                return False
        return True


Slot = Union[_ArraySlot, _ScalarSlot, _TupleSlot]


def _scalar_ctype(ty: Any) -> Optional[Any]:
    if ty == numba_types.boolean:
        return ctypes.c_bool
    if isinstance(ty, numba_types.Integer):
        return getattr(ctypes, f"c_{ty}")
    if ty == numba_types.float64:
        return ctypes.c_double
    if ty == numba_types.float32:
        return ctypes.c_float
    return None


def param_slot(ty: Any, kind: Tuple[Any, ...]) -> Optional[Slot]:
    """Fresh parameter storage for an argument of Numba type ``ty`` whose :func:`arg_kind` is ``kind``, in
    Numba's ABI; None where this module does not bind that type (Numba keeps launching it)."""
    if isinstance(ty, numba_types.Array):
        if kind[0] != "array" or ty.ndim != kind[2] or ty.layout != _expected_layout(kind):
            return None
        return _ArraySlot(kind)
    if isinstance(ty, numba_types.BaseTuple):
        if kind[0] != "tuple" or len(ty) != len(kind) - 1:
            return None
        items = [param_slot(t, k) for t, k in zip(ty, kind[1:])]
        return None if any(item is None for item in items) else _TupleSlot(items)
    ctype = _scalar_ctype(ty) if kind[0] == "scalar" else None
    if ctype is None:
        return None
    return _ScalarSlot(kind[1], ctype, by_value=ty not in (numba_types.float32, numba_types.float64))


class ParamBlock(_TupleSlot):
    """The parameters of one launch: the argument tuple's slots (its parameters are its items', as a
    tuple argument's are) and ``params``, the ``void*[]`` of every parameter's address that
    ``cuLaunchKernel`` reads (``address`` is where it lies). :meth:`patch` takes a launch's arguments,
    writing only those that differ from the last ones taken; where one is not of its slot's kind it
    answers False and the block stays usable (every slot holds what it last took)."""

    __slots__ = ("params", "address")

    def __init__(self, slots: List[Slot]):
        super().__init__(slots)
        addresses = self.addresses()
        self.params = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
        self.address = ctypes.addressof(self.params)
